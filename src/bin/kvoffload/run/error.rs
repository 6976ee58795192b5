//! Why a rank stops, and its capture-unsafe driver calls through the
//! offloader's gate, with the error naming the call.

use kvoffload::Request;
use kvoffload::{DriverError, DriverResult, GatedCalls, Offloader, OffloaderError};

use super::config::ConfigError;

/// Why a rank stopped before its report.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Offloader(#[from] OffloaderError),
    #[error("{what}: {error}")]
    Driver { what: &'static str, error: DriverError },
    #[error("{0}")]
    Other(String),
}

pub fn drv(what: &'static str) -> impl FnOnce(DriverError) -> RankError {
    move |error| RankError::Driver { what, error }
}

/// `f`, a capture-unsafe driver call, through the offloader's gate (it
/// waits while a capture window is open); the offloader's refusal and the
/// driver's error both become a [`RankError`] naming `what`.
pub fn gated<T>(
    off: &Offloader,
    what: &'static str,
    f: impl FnOnce(&GatedCalls<'_>) -> DriverResult<T>,
) -> Result<T, RankError> {
    off.gated(what, Request::new(), f)?.map_err(drv(what))
}
