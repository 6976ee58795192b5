//! [`OffloaderError`]: every way an offloader operation can fail, typed by
//! the layer that refused it.

use crate::manager::{BlockKey, ManagerError};
use crate::pin::PinError;
use crate::protocol::{ProtocolError, ShutdownError};
use crate::region::RegionError;
use crate::runtime::DriverError;
use crate::transfer::{JobId, LayoutError, TransferError};

/// Why an [`super::Offloader`] operation failed.
#[derive(Debug, thiserror::Error)]
pub enum OffloaderError {
    /// The options or the KV description are inconsistent.
    #[error("invalid offloader options: {0}")]
    Options(String),
    /// The KV layout could not be built.
    #[error("KV layout: {0}")]
    Layout(#[from] LayoutError),
    /// Creating, joining or mapping the host region failed.
    #[error("host region: {0}")]
    Region(#[from] RegionError),
    /// Pinning could not be set up.
    #[error("pinning set-up: {0}")]
    Pin(#[from] PinError),
    /// The capture-safety protocol refused (a window open, shut down, a
    /// call that would wait for the caller's own window).
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A driver call failed.
    #[error("{what}: {error}")]
    Driver {
        /// What the offloader was doing.
        what: &'static str,
        /// The driver's error.
        error: DriverError,
    },
    /// The transfer engine refused a job or failed.
    #[error("transfer: {0}")]
    Transfer(#[from] TransferError),
    /// The block manager refused (a key loaded while its store is pending,
    /// no slot free, a key twice in one batch).
    #[error("block manager: {0}")]
    Manager(#[from] ManagerError),
    /// `gpu_blocks` does not give `block_factor` GPU blocks per key.
    #[error("{keys} keys need {need} GPU blocks ({factor} per key), {got} given")]
    GpuBlockCount {
        /// Keys in the call.
        keys: usize,
        /// GPU blocks per key.
        factor: usize,
        /// GPU blocks needed.
        need: usize,
        /// GPU blocks given.
        got: usize,
    },
    /// A slot job's lists do not fit each other or the KV cache groups
    /// ([`super::SlotJob`]).
    #[error("slot job: {given} {what}, {expected} expected")]
    SlotJobShape {
        /// Which list, and what its length must be.
        what: &'static str,
        /// Entries given.
        given: usize,
        /// The length it must have.
        expected: usize,
    },
    /// A slot job named a host slot that a job not yet reported by `poll`
    /// uses: any job, for a store; a store, for a load.
    #[error("host slot {slot} of group {group} is in use by job {job} ({direction:?}) until poll reports it")]
    SlotBusy {
        /// The KV cache group.
        group: usize,
        /// The host slot id the engine named.
        slot: usize,
        /// The job in flight that uses it.
        job: JobId,
        /// That job's direction.
        direction: crate::runtime::Direction,
    },
    /// A slot job on the core of a [`super::KeyedOffloader`], whose block
    /// manager owns the host slots (submit keyed jobs through the keyed
    /// layer).
    #[error("{call} is not available on the core of a KeyedOffloader: its block manager owns the host slots")]
    KeyedCore {
        /// The refused call.
        call: &'static str,
    },
    /// A load named a key the offloader does not hold ready.
    #[error("key {key} is not stored (or its store has not completed)")]
    NotStored {
        /// The key the batch named.
        key: BlockKey,
    },
    /// `wait` named a job that is not in flight.
    #[error("job {id} is not in flight")]
    UnknownJob {
        /// The engine's job id.
        id: JobId,
    },
    /// [`super::CaptureHook::end`] or [`super::CaptureHook::abort`] on a
    /// thread whose hook depth is 0 (no [`super::CaptureHook::begin`] to
    /// match).
    #[error("{call} without a capture_begin on this thread")]
    HookNotOpen {
        /// The refused call.
        call: &'static str,
    },
    /// The operation came after `shutdown`.
    #[error("the offloader is shut down")]
    ShutDown,
    /// Shutdown did not complete; the region stays mapped (leaked) if
    /// anything of it is still registered.
    #[error("shutdown: {0}")]
    Shutdown(#[from] ShutdownError),
    /// The pinning thread panicked.
    #[error("the pinning thread panicked")]
    PinnerPanicked,
}

impl OffloaderError {
    pub(crate) fn driver(what: &'static str) -> impl FnOnce(DriverError) -> OffloaderError {
        move |error| OffloaderError::Driver { what, error }
    }
}
