//! Typed errors of the transfer layer: bad layouts, bad jobs, refused
//! submissions, failed jobs.

use crate::protocol::ProtocolError;
use crate::runtime::DriverError;

use super::JobId;

/// A [`super::KvLayout`] that cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A size or count that must be positive is zero.
    #[error("{what} is zero")]
    Zero { what: &'static str },
    /// The layout has no KV cache group.
    #[error("the layout has no KV cache group")]
    NoGroups,
    /// A KV cache group has no tensor.
    #[error("KV cache group {group} has no tensor")]
    NoTensors { group: usize },
    /// An address or size computation overflows.
    #[error("{what} overflows ({detail})")]
    Overflow { what: &'static str, detail: String },
    /// [`HostPlacement::BlockStrided`](super::HostPlacement::BlockStrided):
    /// the stride cannot hold one host block of every group side by side.
    #[error("host block stride {stride} is smaller than the {needed} bytes of one host block of every group")]
    StrideTooSmall { stride: usize, needed: usize },
}

/// Why a job was refused, failed, or could not be waited for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The layout itself is invalid.
    #[error("invalid layout: {0}")]
    Layout(#[from] LayoutError),
    /// The job names a different number of KV cache groups than the layout has.
    #[error("the job has {given} KV cache group(s), the layout {expected}")]
    GroupCount { given: usize, expected: usize },
    /// A GPU block id is not below the group's number of GPU blocks.
    #[error("GPU block id {block} of group {group} is out of range (the group has {num_blocks} GPU blocks)")]
    GpuBlockOutOfRange { group: usize, block: usize, num_blocks: usize },
    /// A host block id is not below the group's number of host blocks.
    #[error("host block id {block} of group {group} is out of range (the group has {num_blocks} host blocks)")]
    HostBlockOutOfRange { group: usize, block: usize, num_blocks: usize },
    /// The same GPU block id appears twice in one group of one job.
    #[error("GPU block id {block} appears more than once in group {group} of one job")]
    RepeatedGpuBlock { group: usize, block: usize },
    /// The same host block id appears twice in one group of one job.
    #[error("host block id {block} appears more than once in group {group} of one job")]
    RepeatedHostBlock { group: usize, block: usize },
    /// The GPU block count does not fit the host blocks: `host` host blocks
    /// of `factor` GPU blocks each hold between `(host-1)*factor+1` and
    /// `host*factor` GPU blocks (only the first host block may be partial).
    #[error(
        "group {group}: {gpu} GPU block(s) do not fit {host} host block(s) of {factor} GPU blocks \
         (expected between {min} and {max})"
    )]
    BlockCountMismatch { group: usize, gpu: usize, host: usize, factor: usize, min: usize, max: usize },
    /// The job moves no block at all.
    #[error("job {id} moves no block")]
    EmptyJob { id: JobId },
    /// The job id was used by an earlier job of this engine.
    #[error("job id {id} was already used by an earlier job")]
    JobIdReused { id: JobId },
    /// The offloader is shutting down: no new jobs.
    #[error("job {id} refused: the offloader is shutting down")]
    ShutDown { id: JobId },
    /// The compute stream is being captured: the job's event wait would
    /// pull the handler's stream into the capture, so its copies would run
    /// only when the graph is launched. Submit outside captures.
    #[error("job {id} refused: the compute stream is capturing a graph")]
    ComputeCapturing { id: JobId },
    /// No job with this id is in flight (never submitted, or already reported).
    #[error("no job {id} is in flight")]
    UnknownJob { id: JobId },
    /// The job failed on the GPU or at enqueue; it is also reported failed by
    /// [`super::TransferEngine::poll_finished`].
    #[error("job {id} failed: {error}")]
    JobFailed { id: JobId, error: DriverError },
    /// The capture-safety protocol refused the call (e.g. a blocking wait
    /// inside the caller's own capture window).
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A driver call of the engine itself failed (set-up or tear-down).
    #[error(transparent)]
    Driver(#[from] DriverError),
}
