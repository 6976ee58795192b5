//! Least recently used eviction.

use super::recency::Recency;
use super::{EvictionPolicy, PolicyUndo, UndoOf};
use crate::manager::config::PolicyKind;
use crate::manager::key::BlockKey;

/// Evicts the least recently used candidate. Inserting and touching make a
/// block most recently used.
#[derive(Clone, Debug, Default)]
pub struct LruPolicy {
    list: Recency<BlockKey>,
}

impl EvictionPolicy for LruPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }

    fn insert(&mut self, key: BlockKey) {
        self.list.push_mru(key, false);
    }

    fn touch(&mut self, key: BlockKey, _ready: bool) {
        if self.list.contains(&key) {
            self.list.push_mru(key, false);
        }
    }

    fn set_candidate(&mut self, key: BlockKey, candidate: bool) {
        self.list.set_candidate(&key, candidate);
    }

    fn remove(&mut self, key: BlockKey) {
        self.list.remove(&key);
    }

    fn evict(&mut self) -> Option<BlockKey> {
        self.list.pop_lru_candidate()
    }

    fn candidates(&self) -> usize {
        self.list.candidates()
    }

    fn resident(&self) -> usize {
        self.list.len()
    }

    fn is_resident(&self, key: &BlockKey) -> bool {
        self.list.contains(key)
    }

    fn is_candidate(&self, key: &BlockKey) -> bool {
        self.list.is_candidate(key)
    }

    fn clear(&mut self) {
        self.list.clear();
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.list.check("lru")
    }

    fn begin_undo(&mut self) {
        self.list.begin_undo();
    }

    fn end_undo(&mut self) -> PolicyUndo {
        PolicyUndo(UndoOf::Lru(self.list.end_undo()))
    }

    fn undo(&mut self, undo: PolicyUndo) -> Result<(), String> {
        match undo.0 {
            UndoOf::Lru(u) => {
                self.list.undo(u);
                Ok(())
            }
            UndoOf::Arc { .. } => Err("an ARC undo given to the LRU policy".into()),
        }
    }
}
