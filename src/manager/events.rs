//! Manager events: traced at debug level, counted, and optionally logged.

use super::key::{BlockKey, SlotId};

/// Why a block left the manager other than by eviction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RemoveReason {
    /// Its store completed with failure; the slot was freed.
    StoreFailed,
    /// [`reset`](super::BlockManager::reset) dropped it.
    Reset,
}

/// Something that changed which blocks the host region holds. In every
/// event, `key` is the block and `slot` the host slot it was stored in
/// (after `Evicted` and `Removed`, a slot now free).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // the fields are the same in every variant, described above
pub enum ManagerEvent {
    /// A store completed: the block is readable from `slot`.
    Stored { key: BlockKey, slot: SlotId },
    /// The policy evicted a ready, unread block to make room.
    Evicted { key: BlockKey, slot: SlotId },
    /// A block was dropped without eviction, for `reason`.
    Removed { key: BlockKey, slot: SlotId, reason: RemoveReason },
}

/// Running totals since the manager was built (reset does not clear them).
///
/// Key counts count keys, not calls: a lookup of 8 keys adds 8 to `lookups`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ManagerCounters {
    /// Keys looked up.
    pub lookups: u64,
    /// Lookups answered [`Hit`](super::Lookup::Hit).
    pub hits: u64,
    /// Lookups answered [`HitPending`](super::Lookup::HitPending).
    pub hits_pending: u64,
    /// Lookups answered [`Miss`](super::Lookup::Miss).
    pub misses: u64,
    /// Keys touched.
    pub touches: u64,
    /// Keys given a slot by prepare_store.
    pub stores_prepared: u64,
    /// Keys prepare_store skipped because they were stored or pending.
    pub stores_skipped_present: u64,
    /// Keys prepare_store skipped for the store threshold.
    pub stores_skipped_threshold: u64,
    /// prepare_store batches refused for lack of evictable blocks.
    pub stores_rejected: u64,
    /// [`ManagerEvent::Stored`] events.
    pub stored: u64,
    /// [`ManagerEvent::Evicted`] events.
    pub evicted: u64,
    /// [`ManagerEvent::Removed`] events.
    pub removed: u64,
    /// Keys pinned by prepare_load.
    pub loads_prepared: u64,
    /// Keys released by complete_load.
    pub loads_completed: u64,
    /// Successful resets.
    pub resets: u64,
    /// Calls refused with a [`ManagerError`](super::ManagerError).
    pub errors: u64,
}

/// Where the manager sends its events: tracing, counters, optional log.
#[derive(Clone, Debug, Default)]
pub(crate) struct EventSink {
    pub(crate) counters: ManagerCounters,
    log: Option<Vec<ManagerEvent>>,
}

impl EventSink {
    pub(crate) fn new(record: bool) -> Self {
        Self { counters: ManagerCounters::default(), log: record.then(Vec::new) }
    }

    /// Traces, counts and (when recording) logs `event`.
    pub(crate) fn emit(&mut self, event: ManagerEvent) {
        let c = &mut self.counters;
        match event {
            ManagerEvent::Stored { key, slot } => {
                tracing::debug!(%key, slot = slot.0, "kv block stored");
                c.stored += 1;
            }
            ManagerEvent::Evicted { key, slot } => {
                tracing::debug!(%key, slot = slot.0, "kv block evicted");
                c.evicted += 1;
            }
            ManagerEvent::Removed { key, slot, reason } => {
                tracing::debug!(%key, slot = slot.0, ?reason, "kv block removed");
                c.removed += 1;
            }
        }
        if let Some(log) = &mut self.log {
            log.push(event);
        }
    }

    /// Events in the log now (0 when not recording).
    pub(crate) fn logged(&self) -> usize {
        self.log.as_ref().map_or(0, Vec::len)
    }

    /// Drops the events logged after the first `n`.
    pub(crate) fn truncate(&mut self, n: usize) {
        if let Some(log) = &mut self.log {
            log.truncate(n);
        }
    }

    /// Drains the event log (empty when not recording).
    pub(crate) fn take(&mut self) -> Vec<ManagerEvent> {
        self.log.as_mut().map(std::mem::take).unwrap_or_default()
    }
}
