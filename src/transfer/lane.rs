//! The lanes a job runs on (a handler each: its stream and FIFO) and what a
//! lane reports of a job.

use crate::runtime::{Direction, DriverError};

use super::backend::Backend;
use super::ids::JobId;
#[cfg(doc)]
use super::{TransferEngine, TransferOptions};
use crate::names::named;

/// Index of each lane's handler in the engine's handler table.
pub(super) const STORE: usize = 0;
pub(super) const LOAD: usize = 1;
pub(super) const EXPEDITED: usize = 2;

/// Which handler, with its own stream and FIFO, runs a job.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Stores (GPU to host).
    Store,
    /// Loads (host to GPU).
    Load,
    /// Expedited loads (host to GPU) on a stream of their own
    /// ([`TransferOptions::expedited_lane`]): never behind a regular load.
    LoadExpedited,
}

named!(Lane, "lane" {
    Store => "store",
    Load => "load",
    LoadExpedited => "load_expedited",
});

impl Lane {
    /// The lane of a regular job of `dir`.
    pub fn of(dir: Direction) -> Lane {
        match dir {
            Direction::DeviceToHost => Lane::Store,
            Direction::HostToDevice => Lane::Load,
        }
    }

    /// The direction its copies go.
    pub fn direction(self) -> Direction {
        match self {
            Lane::Store => Direction::DeviceToHost,
            Lane::Load | Lane::LoadExpedited => Direction::HostToDevice,
        }
    }

    pub(super) fn index(self) -> usize {
        match self {
            Lane::Store => STORE,
            Lane::Load => LOAD,
            Lane::LoadExpedited => EXPEDITED,
        }
    }
}

/// What became of one job, reported once by [`TransferEngine::poll_finished`].
#[derive(Clone, Debug, PartialEq)]
pub struct JobResult {
    /// The job's id.
    pub id: JobId,
    /// Store (`DeviceToHost`) or load (`HostToDevice`).
    pub direction: Direction,
    /// The lane that ran it.
    pub lane: Lane,
    /// Bytes the job moves.
    pub bytes: u64,
    /// Fragments after merging.
    pub fragments: usize,
    /// Seconds from submission until completion was observed (an upper
    /// bound on the transfer time: it includes the wait for compute and
    /// the polling delay).
    pub seconds: f64,
    /// Device seconds of the job's copies: from the moment its stream
    /// started it (after the compute work it is ordered after, and the
    /// lane's earlier jobs) to its completion event, by CUDA's event timer
    /// (`cuEventElapsedTime`). What a transfer rate is computed from
    /// (`bytes / device_seconds`). `None` when it could not be timed (a job
    /// that failed before its first copy, or an event the driver refused
    /// to time); then only `seconds` is known.
    pub device_seconds: Option<f64>,
    /// The backend that enqueued the job.
    pub backend: Backend,
    /// `None` when every byte arrived; otherwise the driver error that
    /// failed the job (at enqueue or on the device).
    pub error: Option<DriverError>,
}

impl JobResult {
    /// True when the job completed without error.
    pub fn succeeded(&self) -> bool {
        self.error.is_none()
    }
}
