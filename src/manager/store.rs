//! prepare_store and complete_store.

use super::batch::check_unique;
use super::block_manager::BlockManager;
use super::error::ManagerError;
use super::events::{ManagerEvent, RemoveReason};
use super::key::{BlockKey, Placement};
use super::state::{Block, BlockState};

/// Why prepare_store did not give a key a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// The block is stored and ready.
    AlreadyStored,
    /// The block's store is already in flight.
    StorePending,
    /// The key was looked up fewer times than the store threshold.
    BelowThreshold {
        /// Misses counted for the key so far (this one included).
        misses: u32,
        /// Misses a key needs before it is stored
        /// ([`ManagerConfig::store_threshold`](super::ManagerConfig::store_threshold)).
        threshold: u32,
    },
}

/// A key prepare_store skipped (`key`), and why (`reason`): nothing was
/// placed for it and no slot was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // both fields are described above
pub struct Skipped {
    pub key: BlockKey,
    pub reason: SkipReason,
}

/// What prepare_store decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrepareStoreOutput {
    /// Blocks to write now, in batch order, with their slots; each is
    /// write-pending until [`BlockManager::complete_store`].
    pub to_store: Vec<Placement>,
    /// Blocks evicted to make room, in eviction order, with the slots they
    /// freed (slots that `to_store` may reuse).
    pub evicted: Vec<Placement>,
    /// Keys not stored, in batch order.
    pub skipped: Vec<Skipped>,
}

impl BlockManager {
    /// Reserves a slot for each key of `keys` that is not stored yet and
    /// passes the store threshold, evicting ready, unread blocks when too few
    /// slots are free. A key of `keys` is never a victim of the same call:
    /// the keys it skips as [`SkipReason::AlreadyStored`] are kept from
    /// eviction while it chooses, so `skipped` and `evicted` are disjoint.
    /// All or nothing: when the free slots plus the evictable blocks not in
    /// `keys` cannot hold every such key, nothing changes and the call fails
    /// with [`ManagerError::InsufficientCapacity`].
    pub fn prepare_store(&mut self, keys: &[BlockKey]) -> Result<PrepareStoreOutput, ManagerError> {
        if let Err(e) = check_unique(keys) {
            return self.refuse(e);
        }
        let mut out = PrepareStoreOutput::default();
        let mut admit = Vec::with_capacity(keys.len());
        // Keys the batch skips as stored that the policy could evict: kept
        // out of this call's victims, so no key is both skipped and evicted.
        let mut pinned = Vec::new();
        for &key in keys {
            let reason = match self.blocks.get(&key).map(|b| b.state) {
                Some(BlockState::WritePending) => SkipReason::StorePending,
                Some(state @ BlockState::Ready { .. }) => {
                    if state.is_evictable() {
                        pinned.push(key);
                    }
                    SkipReason::AlreadyStored
                }
                None if !self.misses.admits(&key) => {
                    SkipReason::BelowThreshold { misses: self.misses.misses(&key), threshold: self.misses.threshold() }
                }
                None => {
                    admit.push(key);
                    continue;
                }
            };
            out.skipped.push(Skipped { key, reason });
        }
        for &key in &pinned {
            self.policy.set_candidate(key, false);
        }
        let free = self.slots.free_count();
        let evictable = self.policy.candidates();
        let need = admit.len().saturating_sub(free);
        if need > evictable {
            self.unpin(&pinned);
            self.events.counters.stores_rejected += 1;
            return self.refuse(ManagerError::InsufficientCapacity {
                requested: admit.len(),
                free,
                evictable,
                capacity: self.slots.capacity(),
            });
        }
        for _ in 0..need {
            let victim = self.evict_one()?;
            out.evicted.push(victim);
        }
        self.unpin(&pinned);
        for &key in admit.iter().rev() {
            let slot = self
                .slots
                .allocate(key)
                .ok_or_else(|| ManagerError::Internal(format!("no free slot for {key} after eviction")))?;
            self.blocks.insert(key, Block { slot, state: BlockState::WritePending });
            self.policy.insert(key);
            self.misses.forget(&key);
            out.to_store.push(Placement { key, slot });
        }
        out.to_store.reverse();
        let c = &mut self.events.counters;
        c.stores_prepared += out.to_store.len() as u64;
        for s in &out.skipped {
            match s.reason {
                SkipReason::BelowThreshold { .. } => c.stores_skipped_threshold += 1,
                _ => c.stores_skipped_present += 1,
            }
        }
        Ok(out)
    }

    /// Makes `keys` (ready and unread) eviction candidates again.
    fn unpin(&mut self, keys: &[BlockKey]) {
        for &key in keys {
            self.policy.set_candidate(key, true);
        }
    }

    /// Asks the policy for a victim, checks it is evictable, frees its slot.
    fn evict_one(&mut self) -> Result<Placement, ManagerError> {
        let Some(key) = self.policy.evict() else {
            return Err(ManagerError::Internal("policy had no candidate to evict".into()));
        };
        match self.blocks.get(&key).copied() {
            Some(block) if block.state.is_evictable() => {
                self.blocks.remove(&key);
                self.slots.release(block.slot);
                self.events.emit(ManagerEvent::Evicted { key, slot: block.slot });
                Ok(Placement { key, slot: block.slot })
            }
            Some(block) => {
                Err(ManagerError::Internal(format!("policy chose {key} to evict, but it is {}", block.state)))
            }
            None => Err(ManagerError::Internal(format!("policy chose {key}, which is not stored"))),
        }
    }

    /// Ends the stores of `keys`: on success they become readable; on
    /// failure their slots are freed. Every key must be write-pending, else
    /// nothing changes and the first offending key is named
    /// ([`ManagerError::NotFound`] or [`ManagerError::NotPending`]).
    pub fn complete_store(&mut self, keys: &[BlockKey], success: bool) -> Result<(), ManagerError> {
        if let Err(e) = self.check_pending(keys) {
            return self.refuse(e);
        }
        for &key in keys {
            if success {
                let Some(block) = self.blocks.get_mut(&key) else {
                    continue;
                };
                block.state = BlockState::Ready { readers: 0 };
                let slot = block.slot;
                self.policy.set_candidate(key, true);
                self.events.emit(ManagerEvent::Stored { key, slot });
            } else if let Some(block) = self.blocks.remove(&key) {
                self.slots.release(block.slot);
                self.policy.remove(key);
                let reason = RemoveReason::StoreFailed;
                self.events.emit(ManagerEvent::Removed { key, slot: block.slot, reason });
            }
        }
        Ok(())
    }

    fn check_pending(&self, keys: &[BlockKey]) -> Result<(), ManagerError> {
        check_unique(keys)?;
        for &key in keys {
            match self.blocks.get(&key).map(|b| b.state) {
                None => return Err(ManagerError::NotFound { key }),
                Some(BlockState::WritePending) => {}
                Some(state) => return Err(ManagerError::NotPending { key, state }),
            }
        }
        Ok(())
    }
}
