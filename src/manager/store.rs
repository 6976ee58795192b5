//! prepare_store and complete_store.

use super::batch::check_unique;
use super::block_manager::BlockManager;
use super::error::ManagerError;
use super::events::{ManagerCounters, ManagerEvent, RemoveReason};
use super::key::{BlockKey, Placement};
use super::policy::PolicyUndo;
use super::state::{Block, BlockState};
use super::threshold::MissUndo;

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

/// How to take back one store prepared by
/// [`BlockManager::prepare_store_undoable`]: its evictions, its slots and
/// what the policy and the store threshold were before it. Opaque; dropping
/// it keeps the store.
#[derive(Debug)]
pub struct StoreUndo {
    /// The manager's call count after the prepare: an undo is exact only
    /// before the next call.
    epoch: u64,
    policy: PolicyUndo,
    misses: MissUndo,
    /// Blocks evicted (all ready and unread), in eviction order.
    evicted: Vec<Placement>,
    /// Slots given, in the order they were taken.
    placed: Vec<Placement>,
    counters: ManagerCounters,
    logged: usize,
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
    /// slots are free.
    ///
    /// The contract, with [`undo_store`](Self::undo_store) for a caller
    /// whose own submission of the store may still fail:
    /// - a call that fails changes nothing: all or nothing, when the free
    ///   slots plus the evictable blocks not in `keys` cannot hold every key
    ///   to store, the call fails with
    ///   [`ManagerError::InsufficientCapacity`]; a call
    ///   [`undo_store`](Self::undo_store) takes back is as if never made;
    /// - a key of `keys` is never a victim of the same call: the keys it
    ///   skips as [`SkipReason::AlreadyStored`] are kept from eviction while
    ///   it chooses, so `skipped` and `evicted` are disjoint, and every key
    ///   it evicts is in `evicted`;
    /// - a block stays stored (readable once its store completed) until a
    ///   call reports it in `evicted` (or it is dropped by a failed
    ///   [`complete_store`](Self::complete_store) or a
    ///   [`reset`](Self::reset)).
    pub fn prepare_store(&mut self, keys: &[BlockKey]) -> Result<PrepareStoreOutput, ManagerError> {
        self.prepare_store_undoable(keys).map(|(out, _)| out)
    }

    /// [`prepare_store`](Self::prepare_store), and what
    /// [`undo_store`](Self::undo_store) needs to take it back as if it were
    /// never made, as long as no other call on the manager came between
    /// (dropping the [`StoreUndo`] keeps the store). For a caller that
    /// submits the store after preparing it and may be refused (the keyed
    /// offloader, inside a capture window).
    pub fn prepare_store_undoable(
        &mut self,
        keys: &[BlockKey],
    ) -> Result<(PrepareStoreOutput, StoreUndo), ManagerError> {
        self.epoch = self.epoch.wrapping_add(1);
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
        // From here every change is journaled, so a failure (or the
        // caller's undo_store) puts everything back.
        let counters = self.events.counters;
        let logged = self.events.logged();
        self.policy.begin_undo();
        self.misses.begin_undo();
        for &key in &pinned {
            self.policy.set_candidate(key, false);
        }
        let free = self.slots.free_count();
        let evictable = self.policy.candidates();
        let need = admit.len().saturating_sub(free);
        if need > evictable {
            let undo = self.end_undo(Vec::new(), Vec::new(), counters, logged);
            if let Err(e) = self.apply_undo(undo) {
                return self.refuse(e);
            }
            self.events.counters.stores_rejected += 1;
            return self.refuse(ManagerError::InsufficientCapacity {
                requested: admit.len(),
                free,
                evictable,
                capacity: self.slots.capacity(),
            });
        }
        let mut placed = Vec::with_capacity(admit.len());
        if let Err(e) = self.place(&admit, need, &pinned, &mut out.evicted, &mut placed) {
            // A bug (the policy and the table disagree): nothing is kept.
            let undo = self.end_undo(std::mem::take(&mut out.evicted), placed, counters, logged);
            let e = self.apply_undo(undo).err().unwrap_or(e);
            return self.refuse(e);
        }
        out.to_store = placed.iter().rev().copied().collect();
        let c = &mut self.events.counters;
        c.stores_prepared += out.to_store.len() as u64;
        for s in &out.skipped {
            match s.reason {
                SkipReason::BelowThreshold { .. } => c.stores_skipped_threshold += 1,
                _ => c.stores_skipped_present += 1,
            }
        }
        let undo = self.end_undo(out.evicted.clone(), placed, counters, logged);
        Ok((out, undo))
    }

    /// Takes back the [`prepare_store_undoable`](Self::prepare_store_undoable)
    /// that returned `undo`: the evicted blocks are stored and readable
    /// again in their slots, the slots it gave are free, and the policy
    /// (order, candidates, ARC's ghosts and target), the store threshold's
    /// counts, the counters and the event log are as before it. Refused
    /// with [`ManagerError::Internal`], changing nothing, when another call
    /// on the manager came between (the undo would no longer be exact).
    pub fn undo_store(&mut self, undo: StoreUndo) -> Result<(), ManagerError> {
        if undo.epoch != self.epoch {
            let e = ManagerError::Internal("a prepare_store can be undone only before any other call".into());
            return self.refuse(e);
        }
        self.epoch = self.epoch.wrapping_add(1);
        match self.apply_undo(undo) {
            Ok(()) => Ok(()),
            Err(e) => self.refuse(e),
        }
    }

    /// Evicts `need` victims into `evicted`, then gives each key of `admit`
    /// a slot (last key first, so the first ends most recently used),
    /// recording each in `placed`; puts the `pinned` keys back among the
    /// candidates between the two.
    fn place(
        &mut self,
        admit: &[BlockKey],
        need: usize,
        pinned: &[BlockKey],
        evicted: &mut Vec<Placement>,
        placed: &mut Vec<Placement>,
    ) -> Result<(), ManagerError> {
        for _ in 0..need {
            evicted.push(self.evict_one()?);
        }
        self.unpin(pinned);
        for &key in admit.iter().rev() {
            let slot = self
                .slots
                .allocate(key)
                .ok_or_else(|| ManagerError::Internal(format!("no free slot for {key} after eviction")))?;
            self.blocks.insert(key, Block { slot, state: BlockState::WritePending });
            self.policy.insert(key);
            self.misses.forget(&key);
            placed.push(Placement { key, slot });
        }
        Ok(())
    }

    /// Ends the journals; with what the call evicted and placed, and the
    /// counters and log length from before it, that is its undo.
    fn end_undo(
        &mut self,
        evicted: Vec<Placement>,
        placed: Vec<Placement>,
        counters: ManagerCounters,
        logged: usize,
    ) -> StoreUndo {
        StoreUndo {
            epoch: self.epoch,
            policy: self.policy.end_undo(),
            misses: self.misses.end_undo(),
            evicted,
            placed,
            counters,
            logged,
        }
    }

    /// Puts back what `undo` recorded: placements last first (their slots
    /// back on the free list in the order they left it), then evictions
    /// last first, then the journals, counters and log.
    fn apply_undo(&mut self, undo: StoreUndo) -> Result<(), ManagerError> {
        for p in undo.placed.iter().rev() {
            self.blocks.remove(&p.key);
            self.slots.unallocate(p.slot);
        }
        for p in undo.evicted.iter().rev() {
            if !self.slots.unrelease(p.slot, p.key) {
                return Err(ManagerError::Internal(format!("undoing the eviction of {} found its slot taken", p.key)));
            }
            self.blocks.insert(p.key, Block { slot: p.slot, state: BlockState::Ready { readers: 0 } });
        }
        self.policy.undo(undo.policy).map_err(ManagerError::Internal)?;
        self.misses.undo(undo.misses);
        self.events.counters = undo.counters;
        self.events.truncate(undo.logged);
        if !undo.evicted.is_empty() || !undo.placed.is_empty() {
            tracing::debug!(
                evicted = undo.evicted.len(),
                placed = undo.placed.len(),
                "a prepared store was undone: its evictions and slots are back"
            );
        }
        Ok(())
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
        self.epoch = self.epoch.wrapping_add(1);
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
        self.check_each(keys, |key, state| match state {
            BlockState::WritePending => Ok(()),
            state => Err(ManagerError::NotPending { key, state }),
        })
    }
}
