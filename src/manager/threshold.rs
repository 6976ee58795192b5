//! The store threshold: how many times each absent key was looked up.

use std::collections::HashMap;

use super::key::BlockKey;
use super::policy::recency::{Recency, RecencyUndo};

/// Counts lookup misses per key, for at most `limit` keys (the least
/// recently missed count is forgotten first).
#[derive(Clone, Debug)]
pub(crate) struct MissCounter {
    threshold: u32,
    limit: usize,
    counts: HashMap<BlockKey, u32>,
    order: Recency<BlockKey>,
    /// While a journal is kept: each changed key's count before its first
    /// change.
    journal: Option<HashMap<BlockKey, Option<u32>>>,
}

/// What [`MissCounter::undo`] needs to put the counts back.
#[derive(Clone, Debug)]
pub(crate) struct MissUndo {
    counts: HashMap<BlockKey, Option<u32>>,
    order: RecencyUndo<BlockKey>,
}

impl MissCounter {
    pub(crate) fn new(threshold: u32, limit: usize) -> Self {
        Self { threshold, limit, counts: HashMap::new(), order: Recency::default(), journal: None }
    }

    /// Starts a journal of the changes (see [`Recency::begin_undo`]).
    pub(crate) fn begin_undo(&mut self) {
        self.journal = Some(HashMap::new());
        self.order.begin_undo();
    }

    /// Ends the journal; returns what [`MissCounter::undo`] needs.
    pub(crate) fn end_undo(&mut self) -> MissUndo {
        MissUndo { counts: self.journal.take().unwrap_or_default(), order: self.order.end_undo() }
    }

    /// Puts the counts back as they were when `undo`'s journal began (valid
    /// only while nothing changed since it ended).
    pub(crate) fn undo(&mut self, undo: MissUndo) {
        self.journal = None;
        for (key, before) in undo.counts {
            match before {
                Some(n) => self.counts.insert(key, n),
                None => self.counts.remove(&key),
            };
        }
        self.order.undo(undo.order);
    }

    fn note(&mut self, key: &BlockKey) {
        if let Some(j) = &mut self.journal {
            j.entry(*key).or_insert_with(|| self.counts.get(key).copied());
        }
    }

    pub(crate) fn threshold(&self) -> u32 {
        self.threshold
    }

    /// Records one miss for `key`.
    pub(crate) fn record_miss(&mut self, key: BlockKey) {
        if self.threshold == 0 {
            return;
        }
        self.note(&key);
        let count = self.counts.entry(key).or_insert(0);
        *count = count.saturating_add(1);
        self.order.push_mru(key, true);
        if self.order.len() > self.limit {
            if let Some(old) = self.order.pop_lru_candidate() {
                self.note(&old);
                self.counts.remove(&old);
            }
        }
    }

    /// Misses recorded for `key`.
    pub(crate) fn misses(&self, key: &BlockKey) -> u32 {
        self.counts.get(key).copied().unwrap_or(0)
    }

    /// Whether `key` may be stored.
    pub(crate) fn admits(&self, key: &BlockKey) -> bool {
        self.misses(key) >= self.threshold
    }

    /// Forgets `key` (it was admitted).
    pub(crate) fn forget(&mut self, key: &BlockKey) {
        self.note(key);
        if self.counts.remove(key).is_some() {
            self.order.remove(key);
        }
    }

    pub(crate) fn clear(&mut self) {
        if let Some(j) = &mut self.journal {
            for (k, n) in &self.counts {
                j.entry(*k).or_insert(Some(*n));
            }
        }
        self.counts.clear();
        self.order.clear();
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        if self.counts.len() != self.order.len() || self.counts.len() > self.limit {
            return Err(format!(
                "miss counter tracks {} counts, {} ordered, limit {}",
                self.counts.len(),
                self.order.len(),
                self.limit
            ));
        }
        self.order.check("miss counter")
    }
}
