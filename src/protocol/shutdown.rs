//! The shutdown order (P4): refuse while a capture window is open or
//! registered graphs live; refuse new work; drain in-flight transfers; stop
//! pinning at a chunk boundary (it rolls back); unregister every chunk, last
//! first. The caller then unmaps and unlinks the region (dropping it).

use crate::rules::Rules;
use crate::runtime::{DriverError, GpuRuntime};

use super::{Coordinator, ProtocolError};

/// Why shutdown did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShutdownError {
    /// Refused before anything changed (window open, graphs alive, twice).
    #[error(transparent)]
    Refused(#[from] ProtocolError),
    /// A chunk could not be unregistered; the region must stay mapped.
    #[error("unregistering the region failed: {0}")]
    Unregister(DriverError),
}

/// Runs the shutdown order. `join_pinner` is called once pinning has
/// settled (to join its thread). On success nothing of the region is
/// registered any more and it may be unmapped and unlinked.
pub fn shutdown(rt: &dyn GpuRuntime, coord: &Coordinator, join_pinner: impl FnOnce()) -> Result<(), ShutdownError> {
    coord.shutdown_steps().close()?;
    finish_shutdown(rt, coord, join_pinner)
}

/// The rest of the shutdown order once [`ShutdownSteps::close`](super::ShutdownSteps::close) succeeded (and
/// the caller retired its jobs, so that their tickets are gone): waits for
/// the jobs and for pinning to settle, calls `join_pinner`, unregisters
/// every chunk.
pub fn finish_shutdown(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    join_pinner: impl FnOnce(),
) -> Result<(), ShutdownError> {
    let r = coord.rules().drain_then_unregister(
        || coord.shutdown_steps().drain(),
        join_pinner,
        || coord.pinning().unregister_all(rt).map_err(ShutdownError::Unregister),
    );
    tracing::info!(ok = r.is_ok(), "shutdown complete");
    r
}
