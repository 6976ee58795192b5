//! Pinning the host region: parallel pre-faulting, chunked registration
//! through the capture-safety coordinator, in the background or on the
//! caller's thread, with rollback to pageable memory on any failure.

mod engine;
pub mod memlock;
pub mod options;
pub mod prefault;

pub use engine::{pin_all, NoPrefault, PinHandle, Prefault};
pub use options::{
    available_cores, HugePages, PinError, PinOptions, PrefaultMode, DEFAULT_MAX_CHUNK_BYTES, MAX_CHUNK_LIMIT,
    MAX_THREADS, RECOMMENDED_MAX_CHUNK_BYTES,
};
pub use prefault::{thp_setting, PrefaultConfig, PrefaultError, PrefaultStats, Prefaulter, HUGE_PAGE_BYTES};
