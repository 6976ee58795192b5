//! The transfer engine's settings.

use super::backend::BackendChoice;
use super::select::AutoThresholds;
#[cfg(doc)]
use super::{Backend, Lane, TransferEngine, TransferError};

/// Settings of a [`TransferEngine`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TransferOptions {
    /// Backend for every job: automatic, or forced.
    pub backend: BackendChoice,
    /// Sizes at which the automatic choice switches backend.
    pub thresholds: AutoThresholds,
    /// Entries of each handler's device descriptor table for the gather
    /// kernel; a job with more fragments launches the kernel once per
    /// table-full (uploads and launches alternate on the handler's stream).
    pub gather_table_entries: usize,
    /// Entries of each handler's page-locked staging ring, where jobs write
    /// their descriptor tables so that uploads do not synchronize the
    /// stream (0: tables in pageable memory; a job that finds the ring full
    /// uses pageable memory too).
    pub staging_ring_entries: usize,
    /// Bytes of each handler's device staging memory for the staged
    /// backend ([`Backend::Staged`]): two buffers of half each, so one
    /// chunk's kernel overlaps the previous chunk's copies (0: no staged
    /// backend). Allocated at creation when the backend choice may use it.
    /// The default, 32 MiB, holds a 16 MiB job in one half: on the H200 it
    /// gave both ways at once 45.3 - 45.6 GB/s for the slower direction at
    /// 16 KiB fragments, against 43.5 - 44.5 with 16 MiB
    /// (docs/gpu-runs/2026-12-01-duplex-linger/).
    pub staging_bytes: usize,
    /// A third handler for expedited loads ([`Lane::LoadExpedited`]), with
    /// its own stream, completion FIFO, descriptor table, staging ring and
    /// staging memory (the cost of one more load handler). `false` (the
    /// default): an expedited load is refused
    /// ([`TransferError::NoExpeditedLane`]).
    pub expedited_lane: bool,
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            backend: BackendChoice::Auto,
            thresholds: AutoThresholds::default(),
            gather_table_entries: 1 << 13,
            staging_ring_entries: 1 << 15,
            staging_bytes: 32 << 20,
            expedited_lane: false,
        }
    }
}
