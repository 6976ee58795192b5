//! Pinning the host region: chunked registration through the capture-safety
//! coordinator, in the background or on the caller's thread, with rollback
//! to pageable memory on any failure.

mod engine;

pub use engine::{pin_all, pin_all_agreed, Agreement, NoPrefault, PinHandle, Prefault};
