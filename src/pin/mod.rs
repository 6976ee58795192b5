//! Pinning the host region: parallel pre-faulting, chunked registration
//! through the capture-safety coordinator, in the background or on the
//! caller's thread, with rollback to pageable memory on any failure.
//!
//! - [`Prepared::new`] / [`prepare`]: from a [`Region`](crate::region::Region)
//!   and [`PinOptions`] to the coordinator (the region's row-aligned chunks,
//!   at most [`PinOptions::max_chunk_bytes`] each) and a [`Prefaulter`].
//! - [`pin_all`] (blocking) or [`PinHandle`] (background): registers chunk
//!   after chunk while the pre-faulter makes the next one resident; any
//!   failure unregisters what was registered, last first, and leaves the
//!   region pageable with a typed [`PageableReason`](crate::protocol::PageableReason).
//!   [`pin_with`] is the general form (an agreement of the ranks, a
//!   [`PinObserver`] told of each chunk and of the end); [`spawn_pinner`]
//!   runs it on the one background thread both [`PinHandle`] and the
//!   offloader use.
//! - [`numa`]: the pre-fault threads and the region's pages on the GPU's
//!   NUMA node ([`PinOptions::numa`]), or a typed, logged reason why not.
//! - `kvoffload bench pin` (the binary crate) measures it; with `--shared`,
//!   a shared region pinned by N rank processes.

mod engine;
pub mod memlock;
pub mod numa;
pub mod options;
pub mod prefault;
mod prefault_rates;
mod prefault_slice;
mod region_slots;
mod setup;

pub use engine::{
    pin_all, pin_all_agreed, pin_all_agreed_by, pin_with, spawn_pinner, Agreement, NoPrefault, PinHandle, PinObserver,
    PinOutcome, Prefault, RankAgreement,
};
pub use options::{
    available_cores, default_threads, HugePages, NumaPolicy, PinError, PinOptions, PrefaultMode,
    DEFAULT_HUGE_FALLBACK_MBPS, DEFAULT_LOOKAHEAD_BYTES, DEFAULT_MAX_CHUNK_BYTES, DEFAULT_PREFAULT_NICE,
    MAX_CHUNK_LIMIT, MAX_THREADS,
};
pub use prefault::{
    thp_setting, PlannedChunk, PrefaultConfig, PrefaultError, PrefaultStats, Prefaulter, ReserveFn, HUGE_PAGE_BYTES,
    SLICE_GBPS_EDGES,
};
pub use region_slots::RegionSlots;
pub use setup::{prepare, Prepared};
