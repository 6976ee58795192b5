//! Typed errors of the block manager.
//!
//! Every batch operation checks the whole batch before changing anything:
//! when it returns an error, the manager is exactly as it was before the call.

use super::key::BlockKey;
use super::state::BlockState;

/// Why a manager operation was refused. A variant's `key` is the key of
/// the batch that was refused, `state` that key's state when it was.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ManagerError {
    /// The configuration asked for no slots at all.
    #[error("capacity must be at least 1 slot, got 0")]
    ZeroCapacity,
    /// The configuration asked for more slots than a [`SlotId`](super::SlotId) can name.
    #[error("capacity of {requested} slots exceeds the limit of {limit}")]
    CapacityTooLarge {
        /// Slots asked for.
        requested: usize,
        /// Most slots a manager can own.
        limit: usize,
    },
    /// A store threshold was set but no lookups may be tracked.
    #[error("store threshold {threshold} needs a lookup tracking limit of at least 1, got 0")]
    ZeroTrackingLimit {
        /// The store threshold configured (misses before a store).
        threshold: u32,
    },
    /// The slot tables could not be allocated.
    #[error("could not allocate the slot table for {capacity} slots")]
    OutOfMemory {
        /// Slots asked for.
        capacity: usize,
    },
    /// The same key appears twice in one batch.
    #[error("key {key} appears twice in one batch (positions {first} and {second})")]
    DuplicateKey {
        #[allow(missing_docs)]
        key: BlockKey,
        /// Position of its first occurrence.
        first: usize,
        /// Position of its second occurrence.
        second: usize,
    },
    /// prepare_store needs more slots than are free plus evictable.
    #[error(
        "cannot store {requested} blocks: {free} slots free and {evictable} blocks evictable \
         (capacity {capacity}; the others are write-pending or being read)"
    )]
    InsufficientCapacity {
        /// Blocks the batch would store (after skipping present ones).
        requested: usize,
        /// Free slots.
        free: usize,
        /// Blocks that are ready and not being read.
        evictable: usize,
        /// Total slots.
        capacity: usize,
    },
    /// The key is not stored (never stored, evicted, or its store failed).
    #[error("key {key} is not stored")]
    #[allow(missing_docs)]
    NotFound { key: BlockKey },
    /// complete_store for a block whose store is not in flight (double
    /// complete, or complete without prepare).
    #[error("key {key} is {state}, not write-pending: no store to complete")]
    #[allow(missing_docs)]
    NotPending { key: BlockKey, state: BlockState },
    /// prepare_load for a block whose store has not completed.
    #[error("key {key} is write-pending: it cannot be loaded until its store completes")]
    #[allow(missing_docs)]
    NotReadable { key: BlockKey },
    /// complete_load for a block with no load in flight.
    #[error("key {key} is {state}: no load to complete")]
    #[allow(missing_docs)]
    NoLoadInFlight { key: BlockKey, state: BlockState },
    /// A block already has the most concurrent readers a count can hold.
    #[error("key {key} already has {limit} readers, the limit")]
    TooManyReaders {
        #[allow(missing_docs)]
        key: BlockKey,
        /// Loads of one block that may be in flight at once (the reference
        /// count's range).
        limit: u32,
    },
    /// reset while transfers still use slots.
    #[error("reset refused: {pending} blocks are write-pending and {reading} are being read")]
    Busy {
        /// Blocks whose store is in flight.
        pending: usize,
        /// Blocks with loads in flight.
        reading: usize,
    },
    /// The policy and the block table disagree: a bug in this crate. The
    /// message says what disagreed.
    #[error("internal inconsistency: {0}")]
    Internal(String),
}
