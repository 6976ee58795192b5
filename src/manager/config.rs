//! Manager configuration.

use crate::names::named;

/// Which eviction policy the manager uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Least recently used.
    #[default]
    Lru,
    /// Adaptive Replacement Cache (Megiddo and Modha): recency and frequency
    /// lists with ghost lists and an adaptive target.
    Arc,
}

named!(PolicyKind, "eviction policy" {
    Lru => "lru",
    Arc => "arc",
});

/// How to build a [`BlockManager`](super::BlockManager).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Number of host slots (blocks the region holds). At least 1.
    pub capacity: usize,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Store a key only after [`lookup`](super::BlockManager::lookup)
    /// answered [`Miss`](super::Lookup::Miss) for it this many times; 0
    /// stores every key offered.
    pub store_threshold: u32,
    /// How many distinct missed keys the threshold counts at once; the least
    /// recently missed count is forgotten beyond this. Unused when
    /// `store_threshold` is 0.
    pub lookup_tracking_limit: usize,
    /// Keep a log of [`ManagerEvent`](super::ManagerEvent)s for
    /// [`take_events`](super::BlockManager::take_events) (events always go to
    /// `tracing` and the counters).
    pub record_events: bool,
}

impl ManagerConfig {
    /// A configuration with `capacity` slots and defaults elsewhere.
    pub fn new(capacity: usize, policy: PolicyKind) -> Self {
        Self {
            capacity,
            policy,
            store_threshold: 0,
            lookup_tracking_limit: capacity.saturating_mul(4).max(1024),
            record_events: false,
        }
    }
}
