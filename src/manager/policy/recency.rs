//! An ordered set of keys by recency, with a subset marked as candidates.
//!
//! Every list the policies keep (the LRU list, ARC's T1, T2, B1, B2, the
//! lookup counter of the store threshold) is one of these. Each key carries
//! the stamp of its last use; candidates (keys the manager may evict right
//! now) are also indexed by stamp in a `BTreeMap`, so finding the least
//! recently used *candidate* is O(log n) however many non-candidates (blocks
//! being written or read) sit in front of it. A key that stops being a
//! candidate keeps its stamp, so when it becomes one again it returns to its
//! place in the recency order rather than to the front.
//!
//! A list can keep a journal ([`Recency::begin_undo`]): each key's entry as
//! it was before its first change, so that [`Recency::undo`] puts the list
//! back exactly as it was (order, stamps, candidates), in time linear in
//! the keys changed, not in the list's length.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// One key's place in a [`Recency`] list.
#[derive(Clone, Copy, Debug)]
struct Entry {
    stamp: u64,
    candidate: bool,
}

/// What a [`Recency`] list was before a journal began: the entry (or
/// absence) of every key changed since, and the next stamp.
#[derive(Clone, Debug)]
pub(crate) struct RecencyUndo<K> {
    next_stamp: u64,
    before: HashMap<K, Option<Entry>>,
}

/// Keys ordered by last use, with O(log n) access to the least recently used
/// candidate. See the module documentation.
#[derive(Clone, Debug)]
pub(crate) struct Recency<K> {
    entries: HashMap<K, Entry>,
    /// Candidates only, oldest stamp first.
    candidates: BTreeMap<u64, K>,
    next_stamp: u64,
    /// The journal, while one is kept.
    journal: Option<RecencyUndo<K>>,
}

impl<K: Copy + Eq + Hash> Default for Recency<K> {
    fn default() -> Self {
        Self { entries: HashMap::new(), candidates: BTreeMap::new(), next_stamp: 0, journal: None }
    }
}

impl<K: Copy + Eq + Hash> Recency<K> {
    /// Number of keys in the list, candidates or not.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Number of candidates.
    pub(crate) fn candidates(&self) -> usize {
        self.candidates.len()
    }

    /// Whether `key` is in the list.
    pub(crate) fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Whether `key` is in the list and a candidate.
    pub(crate) fn is_candidate(&self, key: &K) -> bool {
        self.entries.get(key).is_some_and(|e| e.candidate)
    }

    /// Starts a journal (dropping one in progress): from here, each key's
    /// entry is remembered before its first change.
    pub(crate) fn begin_undo(&mut self) {
        self.journal = Some(RecencyUndo { next_stamp: self.next_stamp, before: HashMap::new() });
    }

    /// Ends the journal and returns it (an empty one if none was kept).
    pub(crate) fn end_undo(&mut self) -> RecencyUndo<K> {
        self.journal.take().unwrap_or_else(|| RecencyUndo { next_stamp: self.next_stamp, before: HashMap::new() })
    }

    /// Puts the list back as it was when `undo`'s journal began. Valid only
    /// while the list has not changed since that journal ended.
    pub(crate) fn undo(&mut self, undo: RecencyUndo<K>) {
        self.journal = None;
        // Every stamp issued since the journal began belongs to a key it
        // names, and every stamp it restores was unique then: no collision.
        for (key, before) in undo.before {
            if let Some(now) = self.entries.remove(&key) {
                if now.candidate {
                    self.candidates.remove(&now.stamp);
                }
            }
            if let Some(e) = before {
                if e.candidate {
                    self.candidates.insert(e.stamp, key);
                }
                self.entries.insert(key, e);
            }
        }
        self.next_stamp = undo.next_stamp;
    }

    /// Remembers `key`'s entry if a journal is kept and it is the key's
    /// first change.
    fn note(&mut self, key: &K) {
        if let Some(j) = &mut self.journal {
            j.before.entry(*key).or_insert_with(|| self.entries.get(key).copied());
        }
    }

    fn stamp(&mut self) -> u64 {
        let s = self.next_stamp;
        // 2^64 uses are out of reach; wrapping keeps the arithmetic panic-free.
        self.next_stamp = self.next_stamp.wrapping_add(1);
        s
    }

    /// Puts `key` at the most recently used end, keeping its candidate flag
    /// if it is already in the list, else inserting it with `candidate`.
    pub(crate) fn push_mru(&mut self, key: K, candidate: bool) {
        self.note(&key);
        let stamp = self.stamp();
        let candidate = match self.entries.get(&key) {
            Some(old) => {
                if old.candidate {
                    self.candidates.remove(&old.stamp);
                }
                old.candidate
            }
            None => candidate,
        };
        self.entries.insert(key, Entry { stamp, candidate });
        if candidate {
            self.candidates.insert(stamp, key);
        }
    }

    /// Marks `key` as a candidate or not; returns false when it is absent.
    pub(crate) fn set_candidate(&mut self, key: &K, candidate: bool) -> bool {
        if !self.entries.contains_key(key) {
            return false;
        }
        self.note(key);
        let Some(e) = self.entries.get_mut(key) else {
            return false;
        };
        if e.candidate != candidate {
            e.candidate = candidate;
            if candidate {
                self.candidates.insert(e.stamp, *key);
            } else {
                self.candidates.remove(&e.stamp);
            }
        }
        true
    }

    /// Removes `key`; returns whether it was present and whether it was a
    /// candidate.
    pub(crate) fn remove(&mut self, key: &K) -> Option<bool> {
        if !self.entries.contains_key(key) {
            return None;
        }
        self.note(key);
        let e = self.entries.remove(key)?;
        if e.candidate {
            self.candidates.remove(&e.stamp);
        }
        Some(e.candidate)
    }

    /// Removes and returns the least recently used candidate.
    pub(crate) fn pop_lru_candidate(&mut self) -> Option<K> {
        let (_, key) = self.candidates.pop_first()?;
        self.note(&key);
        self.entries.remove(&key);
        Some(key)
    }

    /// Removes everything.
    pub(crate) fn clear(&mut self) {
        if let Some(j) = &mut self.journal {
            for (k, e) in &self.entries {
                j.before.entry(*k).or_insert(Some(*e));
            }
        }
        self.entries.clear();
        self.candidates.clear();
    }

    /// Checks that the candidate index matches the entries.
    pub(crate) fn check(&self, name: &str) -> Result<(), String> {
        let flagged = self.entries.values().filter(|e| e.candidate).count();
        if flagged != self.candidates.len() {
            return Err(format!("{name}: {flagged} entries flagged candidate but {} indexed", self.candidates.len()));
        }
        for (stamp, key) in &self.candidates {
            match self.entries.get(key) {
                Some(e) if e.candidate && e.stamp == *stamp => {}
                _ => return Err(format!("{name}: candidate index entry {stamp} is stale")),
            }
        }
        Ok(())
    }

    /// Keys from least to most recently used (O(n log n); for checks and tests).
    pub(crate) fn keys_lru_first(&self) -> Vec<K> {
        let mut v: Vec<(u64, K)> = self.entries.iter().map(|(k, e)| (e.stamp, *k)).collect();
        v.sort_unstable_by_key(|(s, _)| *s);
        v.into_iter().map(|(_, k)| k).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::Recency;

    #[test]
    fn lru_candidate_skips_pinned_and_keeps_place() {
        let mut r = Recency::default();
        for k in 0..4u32 {
            r.push_mru(k, true);
        }
        assert!(r.set_candidate(&0, false));
        assert_eq!(r.pop_lru_candidate(), Some(1));
        // 0 returns to its old place, ahead of 2 and 3.
        assert!(r.set_candidate(&0, true));
        assert_eq!(r.pop_lru_candidate(), Some(0));
        // Re-pushing keeps the candidate flag and moves 2 behind 3.
        r.push_mru(2, false);
        r.push_mru(7, false);
        assert_eq!(r.keys_lru_first(), vec![3, 2, 7]);
        assert_eq!(r.pop_lru_candidate(), Some(3));
        assert_eq!(r.pop_lru_candidate(), Some(2));
        assert_eq!(r.pop_lru_candidate(), None);
        assert_eq!((r.len(), r.candidates()), (1, 0));
        assert!(r.check("r").is_ok());
        assert_eq!(r.remove(&9), None);
        assert_eq!(r.remove(&7), Some(false));
    }

    /// Every change a journal saw is undone, whatever the mix: order,
    /// stamps (a later push lands where it would have) and candidates.
    #[test]
    fn undo_puts_the_list_back_exactly() {
        let mut r = Recency::default();
        for k in 0..5u32 {
            r.push_mru(k, k != 2);
        }
        let mut twin = r.clone();
        r.begin_undo();
        assert_eq!(r.pop_lru_candidate(), Some(0));
        r.push_mru(1, false);
        r.set_candidate(&3, false);
        r.set_candidate(&2, true);
        r.remove(&4);
        r.push_mru(9, true);
        r.push_mru(0, true);
        let undo = r.end_undo();
        r.undo(undo);
        assert!(r.check("r").is_ok());
        assert_eq!(r.keys_lru_first(), twin.keys_lru_first());
        for k in [7u32, 8] {
            r.push_mru(k, true);
            twin.push_mru(k, true);
        }
        let drain = |l: &mut Recency<u32>| std::iter::from_fn(|| l.pop_lru_candidate()).collect::<Vec<_>>();
        assert_eq!(drain(&mut r), drain(&mut twin));
        assert_eq!(r.keys_lru_first(), twin.keys_lru_first());
    }
}
