//! The store threshold: how many times each absent key was looked up.

use std::collections::HashMap;

use super::key::BlockKey;
use super::policy::recency::Recency;

/// Counts lookup misses per key, for at most `limit` keys (the least
/// recently missed count is forgotten first).
#[derive(Clone, Debug)]
pub(crate) struct MissCounter {
    threshold: u32,
    limit: usize,
    counts: HashMap<BlockKey, u32>,
    order: Recency<BlockKey>,
}

impl MissCounter {
    pub(crate) fn new(threshold: u32, limit: usize) -> Self {
        Self { threshold, limit, counts: HashMap::new(), order: Recency::default() }
    }

    pub(crate) fn threshold(&self) -> u32 {
        self.threshold
    }

    /// Records one miss for `key`.
    pub(crate) fn record_miss(&mut self, key: BlockKey) {
        if self.threshold == 0 {
            return;
        }
        let count = self.counts.entry(key).or_insert(0);
        *count = count.saturating_add(1);
        self.order.push_mru(key, true);
        if self.order.len() > self.limit {
            if let Some(old) = self.order.pop_lru_candidate() {
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
        if self.counts.remove(key).is_some() {
            self.order.remove(key);
        }
    }

    pub(crate) fn clear(&mut self) {
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
