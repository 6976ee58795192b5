//! The block manager: the table of stored blocks, lookups, touch and reset.
//! Stores live in `store.rs`, loads in `load.rs`, checks in `invariants.rs`.

use std::collections::HashMap;

use super::config::{ManagerConfig, PolicyKind};
use super::error::ManagerError;
use super::events::{EventSink, ManagerCounters, ManagerEvent, RemoveReason};
use super::key::{BlockKey, SlotId};
use super::policy::{new_policy, EvictionPolicy};
use super::slots::SlotTable;
use super::state::{Block, BlockState, Lookup};
use super::threshold::MissCounter;

/// Tracks which KV-cache blocks the host region holds, in which slot and
/// state, and which to evict when room is needed.
///
/// A plain single-threaded structure: callers that share it wrap it in
/// `crate::sync::Mutex`. Every operation is O(log n) per key (reset and
/// [`check_invariants`](Self::check_invariants) are O(n)).
///
/// The life of a block: [`prepare_store`](Self::prepare_store) gives it a
/// slot in state [`BlockState::WritePending`];
/// [`complete_store`](Self::complete_store) makes it
/// [`Ready`](BlockState::Ready) (or frees it on failure);
/// [`prepare_load`](Self::prepare_load) and
/// [`complete_load`](Self::complete_load) count its readers; the policy
/// evicts it only while it is ready with no readers.
#[derive(Debug)]
pub struct BlockManager {
    pub(crate) config: ManagerConfig,
    pub(crate) slots: SlotTable,
    pub(crate) blocks: HashMap<BlockKey, Block>,
    pub(crate) policy: Box<dyn EvictionPolicy>,
    pub(crate) misses: MissCounter,
    pub(crate) events: EventSink,
    /// Counts the calls that may change the manager, so that
    /// [`undo_store`](Self::undo_store) can tell a [`StoreUndo`](super::StoreUndo)
    /// made before the last call from one made by it.
    pub(crate) epoch: u64,
}

impl BlockManager {
    /// Builds a manager with every slot free.
    pub fn new(config: ManagerConfig) -> Result<Self, ManagerError> {
        if config.store_threshold > 0 && config.lookup_tracking_limit == 0 {
            return Err(ManagerError::ZeroTrackingLimit { threshold: config.store_threshold });
        }
        let slots = SlotTable::new(config.capacity)?;
        Ok(Self {
            slots,
            blocks: HashMap::new(),
            policy: new_policy(config.policy, config.capacity),
            misses: MissCounter::new(config.store_threshold, config.lookup_tracking_limit),
            events: EventSink::new(config.record_events),
            epoch: 0,
            config,
        })
    }

    /// The configuration the manager was built with.
    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots.capacity()
    }

    /// The eviction policy in use.
    pub fn policy_kind(&self) -> PolicyKind {
        self.policy.kind()
    }

    /// Number of blocks holding a slot (pending or ready).
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block holds a slot.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Number of free slots.
    pub fn free_slots(&self) -> usize {
        self.slots.free_count()
    }

    /// Number of blocks the policy could evict now (ready, no readers).
    pub fn evictable(&self) -> usize {
        self.policy.candidates()
    }

    /// The state of `key`, or `None` when it is not stored.
    pub fn state(&self, key: &BlockKey) -> Option<BlockState> {
        self.blocks.get(key).map(|b| b.state)
    }

    /// The slot of `key`, or `None` when it is not stored.
    pub fn slot(&self, key: &BlockKey) -> Option<SlotId> {
        self.blocks.get(key).map(|b| b.slot)
    }

    /// Running totals of operations and events.
    pub fn counters(&self) -> ManagerCounters {
        self.events.counters
    }

    /// Drains the event log; empty unless
    /// [`ManagerConfig::record_events`] is set.
    pub fn take_events(&mut self) -> Vec<ManagerEvent> {
        self.epoch = self.epoch.wrapping_add(1);
        self.events.take()
    }

    /// Answers, for each key, whether it is stored and readable. Does not
    /// change recency (see [`touch`](Self::touch)); counts each miss toward
    /// the store threshold.
    pub fn lookup(&mut self, keys: &[BlockKey]) -> Vec<Lookup> {
        self.epoch = self.epoch.wrapping_add(1);
        let c = &mut self.events.counters;
        c.lookups += keys.len() as u64;
        let mut answers = Vec::with_capacity(keys.len());
        for key in keys {
            let answer = match self.blocks.get(key).map(|b| b.state) {
                None => {
                    c.misses += 1;
                    self.misses.record_miss(*key);
                    Lookup::Miss
                }
                Some(BlockState::WritePending) => {
                    c.hits_pending += 1;
                    Lookup::HitPending
                }
                Some(BlockState::Ready { .. }) => {
                    c.hits += 1;
                    Lookup::Hit
                }
            };
            answers.push(answer);
        }
        answers
    }

    /// Marks the stored keys among `keys` as used now, the first key most
    /// recently; keys not stored are ignored.
    pub fn touch(&mut self, keys: &[BlockKey]) {
        self.epoch = self.epoch.wrapping_add(1);
        self.events.counters.touches += keys.len() as u64;
        for key in keys.iter().rev() {
            if let Some(block) = self.blocks.get(key) {
                let ready = matches!(block.state, BlockState::Ready { .. });
                self.policy.touch(*key, ready);
            }
        }
    }

    /// Drops every block, the policy's history and the threshold counts.
    /// Refused with [`ManagerError::Busy`] while any store or load is in
    /// flight, since a transfer still uses those slots.
    pub fn reset(&mut self) -> Result<(), ManagerError> {
        self.epoch = self.epoch.wrapping_add(1);
        let pending = self.blocks.values().filter(|b| b.state == BlockState::WritePending).count();
        let reading =
            self.blocks.values().filter(|b| matches!(b.state, BlockState::Ready { readers } if readers > 0)).count();
        if pending > 0 || reading > 0 {
            return self.refuse(ManagerError::Busy { pending, reading });
        }
        let mut dropped: Vec<(BlockKey, SlotId)> = self.blocks.drain().map(|(k, b)| (k, b.slot)).collect();
        dropped.sort_unstable_by_key(|(_, slot)| *slot);
        for (key, slot) in dropped {
            self.events.emit(ManagerEvent::Removed { key, slot, reason: RemoveReason::Reset });
        }
        self.slots.clear();
        self.policy.clear();
        self.misses.clear();
        self.events.counters.resets += 1;
        Ok(())
    }

    /// Counts a refused call and returns its error.
    pub(crate) fn refuse<T>(&mut self, err: ManagerError) -> Result<T, ManagerError> {
        self.events.counters.errors += 1;
        tracing::debug!(error = %err, "block manager refused a call");
        Err(err)
    }
}
