//! Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), adapted to
//! blocks that may be pinned.
//!
//! - T1 holds blocks used once since they were stored, T2 blocks used again
//!   (a touch of a *ready* T1 block promotes it; a touch of a write-pending
//!   one does not, since the store and the touch of the same request are one
//!   use).
//! - B1 and B2 remember keys recently evicted from T1 and T2 ("ghosts").
//! - The target `p` is the size T1 aims for. Storing a key found in B1 (it
//!   was evicted too early from the recency side) raises `p` by
//!   `max(1, |B2| / |B1|)`; one found in B2 lowers it by `max(1, |B1| / |B2|)`.
//!   Such a key re-enters in T2: it has been used before.
//! - A victim comes from T1 when T1 has a candidate and `|T1| > p` (or T2
//!   has no candidate), else from T2; only candidates (ready, unread blocks)
//!   are chosen. The victim's key goes to the head of its ghost list.
//! - Ghost lists are bounded as in the paper: `|T1| + |B1| <= c` and
//!   `|T1| + |T2| + |B1| + |B2| <= 2c`, dropping the oldest ghosts.
//!
//! Unlike the paper, `p` adapts when the key is stored (prepare_store), not
//! on lookup, so the victim choice of a batch uses `p` as it was before the
//! batch.

use super::recency::Recency;
use super::{EvictionPolicy, PolicyUndo, UndoOf};
use crate::manager::config::PolicyKind;
use crate::manager::key::BlockKey;

/// The ARC policy; see the module documentation.
#[derive(Clone, Debug)]
pub struct ArcPolicy {
    capacity: usize,
    target: usize,
    /// The target when a journal began ([`EvictionPolicy::begin_undo`]).
    undo_target: Option<usize>,
    t1: Recency<BlockKey>,
    t2: Recency<BlockKey>,
    b1: Recency<BlockKey>,
    b2: Recency<BlockKey>,
}

impl ArcPolicy {
    /// An empty ARC policy for `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            target: 0,
            undo_target: None,
            t1: Recency::default(),
            t2: Recency::default(),
            b1: Recency::default(),
            b2: Recency::default(),
        }
    }

    /// The adaptive target size of T1.
    pub fn target(&self) -> usize {
        self.target
    }

    /// Sizes of T1, T2, B1 and B2.
    pub fn list_sizes(&self) -> [usize; 4] {
        [self.t1.len(), self.t2.len(), self.b1.len(), self.b2.len()]
    }

    fn trim_ghosts(&mut self) {
        while self.t1.len() + self.b1.len() > self.capacity {
            if self.b1.pop_lru_candidate().is_none() {
                break;
            }
        }
        while self.t1.len() + self.t2.len() + self.b1.len() + self.b2.len() > self.capacity.saturating_mul(2) {
            if self.b2.pop_lru_candidate().is_none() && self.b1.pop_lru_candidate().is_none() {
                break;
            }
        }
    }
}

impl EvictionPolicy for ArcPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Arc
    }

    fn insert(&mut self, key: BlockKey) {
        if self.t1.contains(&key) {
            self.t1.push_mru(key, false);
        } else if self.t2.contains(&key) {
            self.t2.push_mru(key, false);
        } else if self.b1.contains(&key) {
            let delta = (self.b2.len() / self.b1.len()).max(1);
            self.target = self.target.saturating_add(delta).min(self.capacity);
            self.b1.remove(&key);
            self.t2.push_mru(key, false);
        } else if self.b2.contains(&key) {
            let delta = (self.b1.len() / self.b2.len()).max(1);
            self.target = self.target.saturating_sub(delta);
            self.b2.remove(&key);
            self.t2.push_mru(key, false);
        } else {
            self.t1.push_mru(key, false);
        }
        self.trim_ghosts();
    }

    fn touch(&mut self, key: BlockKey, ready: bool) {
        if self.t1.contains(&key) {
            if ready {
                let candidate = self.t1.remove(&key).unwrap_or(false);
                self.t2.push_mru(key, candidate);
            } else {
                self.t1.push_mru(key, false);
            }
        } else if self.t2.contains(&key) {
            self.t2.push_mru(key, false);
        }
    }

    fn set_candidate(&mut self, key: BlockKey, candidate: bool) {
        if !self.t1.set_candidate(&key, candidate) {
            self.t2.set_candidate(&key, candidate);
        }
    }

    fn remove(&mut self, key: BlockKey) {
        if self.t1.remove(&key).is_none() {
            self.t2.remove(&key);
        }
    }

    fn evict(&mut self) -> Option<BlockKey> {
        let from_t1 = self.t1.candidates() > 0 && (self.t1.len() > self.target || self.t2.candidates() == 0);
        let victim = if from_t1 {
            let key = self.t1.pop_lru_candidate()?;
            self.b1.push_mru(key, true);
            key
        } else {
            let key = self.t2.pop_lru_candidate()?;
            self.b2.push_mru(key, true);
            key
        };
        self.trim_ghosts();
        Some(victim)
    }

    fn candidates(&self) -> usize {
        self.t1.candidates() + self.t2.candidates()
    }

    fn resident(&self) -> usize {
        self.t1.len() + self.t2.len()
    }

    fn is_resident(&self, key: &BlockKey) -> bool {
        self.t1.contains(key) || self.t2.contains(key)
    }

    fn is_candidate(&self, key: &BlockKey) -> bool {
        self.t1.is_candidate(key) || self.t2.is_candidate(key)
    }

    fn clear(&mut self) {
        self.target = 0;
        self.t1.clear();
        self.t2.clear();
        self.b1.clear();
        self.b2.clear();
    }

    fn check_invariants(&self) -> Result<(), String> {
        let c = self.capacity;
        let [t1, t2, b1, b2] = self.list_sizes();
        self.t1.check("arc t1")?;
        self.t2.check("arc t2")?;
        self.b1.check("arc b1")?;
        self.b2.check("arc b2")?;
        if self.target > c {
            return Err(format!("arc target {} exceeds capacity {c}", self.target));
        }
        if t1 + t2 > c {
            return Err(format!("arc holds {} resident blocks, capacity {c}", t1 + t2));
        }
        if t1 + b1 > c {
            return Err(format!("arc |T1| + |B1| = {} exceeds capacity {c}", t1 + b1));
        }
        if t1 + t2 + b1 + b2 > c.saturating_mul(2) {
            return Err(format!("arc tracks {} keys, more than twice capacity {c}", t1 + t2 + b1 + b2));
        }
        if self.b1.candidates() != b1 || self.b2.candidates() != b2 {
            return Err("arc ghost entries must all be candidates".into());
        }
        let lists = [("t1", &self.t1), ("t2", &self.t2), ("b1", &self.b1), ("b2", &self.b2)];
        for (i, (name, list)) in lists.iter().enumerate() {
            for (other, olist) in lists.iter().skip(i + 1) {
                if let Some(k) = list.keys_lru_first().into_iter().find(|k| olist.contains(k)) {
                    return Err(format!("arc key {k} is in both {name} and {other}"));
                }
            }
        }
        Ok(())
    }

    fn begin_undo(&mut self) {
        self.undo_target = Some(self.target);
        for l in [&mut self.t1, &mut self.t2, &mut self.b1, &mut self.b2] {
            l.begin_undo();
        }
    }

    fn end_undo(&mut self) -> PolicyUndo {
        let target = self.undo_target.take().unwrap_or(self.target);
        let lists = Box::new([self.t1.end_undo(), self.t2.end_undo(), self.b1.end_undo(), self.b2.end_undo()]);
        PolicyUndo(UndoOf::Arc { target, lists })
    }

    fn undo(&mut self, undo: PolicyUndo) -> Result<(), String> {
        match undo.0 {
            UndoOf::Arc { target, lists } => {
                let [t1, t2, b1, b2] = *lists;
                self.t1.undo(t1);
                self.t2.undo(t2);
                self.b1.undo(b1);
                self.b2.undo(b2);
                self.target = target;
                Ok(())
            }
            UndoOf::Lru(_) => Err("an LRU undo given to the ARC policy".into()),
        }
    }
}
