//! The capture-safety protocol (the verified core): capture windows around
//! graph capture, the discipline of library threads around capture-unsafe
//! driver calls, registration of chunks with gather-kernel users, and the
//! shutdown order. Depends only on [`crate::sync`] and the runtime trait;
//! the loom models under model/ drive it on the simulated GPU.

pub mod agreement;
mod coordinator;
mod error;
mod request;
mod shutdown;

pub use coordinator::{
    Activity, AliasGuard, CapturePolicy, CaptureWindow, ChunkReg, Coordinator, GraphToken, JobTicket, KeepAlive,
    PinHold, Pinning, ShutdownSteps,
};
pub use error::{PageableReason, PinState, ProtocolError};
pub use request::Request;
// The negative models' variants (model builds only; `crate::rules`).
#[cfg(any(loom, shuttle))]
pub use crate::rules::negatives::Variant;
pub use shutdown::{finish_shutdown, shutdown, ShutdownError};
