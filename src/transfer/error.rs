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
    Zero {
        /// The name of the zero value as [`super::KvLayout::new`] calls it:
        /// `"block_size_factor"`, `"num_gpu_blocks"`, `"num_host_blocks"` or
        /// `"page_bytes"`.
        what: &'static str,
    },
    /// The layout has no KV cache group.
    #[error("the layout has no KV cache group")]
    NoGroups,
    /// A KV cache group has no tensor.
    #[error("KV cache group {group} has no tensor")]
    NoTensors {
        /// Index of the empty group in the layout's group list (0-based).
        group: usize,
    },
    /// An address or size computation overflows.
    #[error("{what} overflows ({detail})")]
    Overflow {
        /// The quantity that does not fit in `usize` or `u64`, e.g.
        /// `"device tensor end"`, `"host area"` or `"host end"`.
        what: &'static str,
        /// The inputs of the failed computation (the tensor, the group
        /// index or the factors), for the message.
        detail: String,
    },
    /// [`HostPlacement::BlockStrided`](super::HostPlacement::BlockStrided):
    /// the stride cannot hold one host block of every group side by side.
    #[error("host block stride {stride} is smaller than the {needed} bytes of one host block of every group")]
    StrideTooSmall {
        /// The stride given, in bytes (the region's row size when the
        /// offloader builds the layout).
        stride: usize,
        /// Bytes from the start of a stride to the end of the first group
        /// whose host block no longer fits: one host block
        /// (`block_size_factor` pages of every tensor) of that group and of
        /// every group before it, side by side.
        needed: usize,
    },
}

/// Why a job was refused, failed, or could not be waited for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The layout itself is invalid.
    #[error("invalid layout: {0}")]
    Layout(#[from] LayoutError),
    /// The job names a different number of KV cache groups than the layout has.
    #[error("the job has {given} KV cache group(s), the layout {expected}")]
    GroupCount {
        /// Groups in the job ([`super::JobBlocks::groups`]).
        given: usize,
        /// Groups in the layout.
        expected: usize,
    },
    /// A GPU block id is not below the group's number of GPU blocks.
    #[error("GPU block id {block} of group {group} is out of range (the group has {num_blocks} GPU blocks)")]
    GpuBlockOutOfRange {
        /// Index of the KV cache group in the job and layout (0-based).
        group: usize,
        /// The offending GPU block id (the first one out of range).
        block: usize,
        /// GPU blocks per tensor of the group (`GroupSpec::num_gpu_blocks`):
        /// valid ids are `0..num_blocks`.
        num_blocks: usize,
    },
    /// A host block id is not below the group's number of host blocks.
    #[error("host block id {block} of group {group} is out of range (the group has {num_blocks} host blocks)")]
    HostBlockOutOfRange {
        /// Index of the KV cache group in the job and layout (0-based).
        group: usize,
        /// The offending host block id (the first one out of range).
        block: usize,
        /// Host blocks of the group (`GroupSpec::num_host_blocks`): valid
        /// ids are `0..num_blocks`.
        num_blocks: usize,
    },
    /// The same GPU block id appears twice in one group of one job (two
    /// copies into or out of one block in one job would race).
    #[error("GPU block id {block} appears more than once in group {group} of one job")]
    RepeatedGpuBlock {
        /// Index of the KV cache group in the job and layout (0-based).
        group: usize,
        /// The repeated GPU block id.
        block: usize,
    },
    /// The same host block id appears twice in one group of one job (two
    /// copies into or out of one block in one job would race).
    #[error("host block id {block} appears more than once in group {group} of one job")]
    RepeatedHostBlock {
        /// Index of the KV cache group in the job and layout (0-based).
        group: usize,
        /// The repeated host block id.
        block: usize,
    },
    /// The GPU block count does not fit the host blocks: `host` host blocks
    /// of `factor` GPU blocks each hold between `(host-1)*factor+1` and
    /// `host*factor` GPU blocks (only the first host block may be partial).
    #[error(
        "group {group}: {gpu} GPU block(s) do not fit {host} host block(s) of {factor} GPU blocks \
         (expected between {min} and {max})"
    )]
    BlockCountMismatch {
        /// Index of the KV cache group in the job and layout (0-based).
        group: usize,
        /// GPU block ids the job names for the group.
        gpu: usize,
        /// Host block ids the job names for the group.
        host: usize,
        /// GPU blocks per host block (the layout's `block_size_factor`).
        factor: usize,
        /// Fewest GPU blocks that fit: `(host-1)*factor+1` (1 when `host`
        /// is 0).
        min: usize,
        /// Most GPU blocks that fit: `host*factor`.
        max: usize,
    },
    /// An explicit first-slot skip ([`super::KvLayout::expand_skipping`])
    /// of `factor` or more sub-blocks.
    #[error("group {group}: first_sub {first_sub} skips a whole host block of {factor} GPU blocks (at most {max})", max = factor - 1)]
    FirstSubTooLarge {
        /// Index of the KV cache group.
        group: usize,
        /// The skip given.
        first_sub: usize,
        /// GPU blocks per host block.
        factor: usize,
    },
    /// With an explicit skip, `gpu` GPU blocks from sub-block `first_sub`
    /// of the first host block need exactly
    /// `ceil((gpu + first_sub) / factor)` host blocks.
    #[error(
        "group {group}: {gpu} GPU block(s) from sub-block {first_sub} need {need} host block(s) of {factor} GPU blocks, \
         {host} given"
    )]
    HostCountMismatch {
        /// Index of the KV cache group.
        group: usize,
        /// GPU block ids the job names for the group.
        gpu: usize,
        /// Host block ids the job names for the group.
        host: usize,
        /// The skip of the first host block.
        first_sub: usize,
        /// GPU blocks per host block.
        factor: usize,
        /// Host blocks needed.
        need: usize,
    },
    /// The job moves no block at all (every group empty); such a job would
    /// have nothing to complete by.
    #[error("job {id} moves no block")]
    EmptyJob {
        /// The refused job's id.
        id: JobId,
    },
    /// The job id was used by an earlier job of this engine.
    #[error("job id {id} was already used by an earlier job")]
    JobIdReused {
        /// The reused id. Ids are unique over the engine's lifetime, so
        /// completions can be reported by id exactly once (P5).
        id: JobId,
    },
    /// The offloader is shutting down: no new jobs. Shutdown waits for
    /// the jobs admitted before it began, then unregisters (P4); a job
    /// admitted later could touch memory being unregistered, so it is
    /// refused instead.
    #[error("job {id} refused: the offloader is shutting down")]
    ShutDown {
        /// The refused job's id (not marked as used: no id is consumed by a
        /// refused job).
        id: JobId,
    },
    /// The compute stream is being captured: the job's event wait would
    /// pull the handler's stream into the capture, so its copies would run
    /// only when the graph is launched. Submit outside captures.
    #[error("job {id} refused: the compute stream is capturing a graph")]
    ComputeCapturing {
        /// The refused job's id (not marked as used).
        id: JobId,
    },
    /// A capture window is open (or about to open, or held by the caller):
    /// the compute stream may begin capturing at any moment, so the job's
    /// ordering event could land in the capture. Submit once the window has
    /// closed ([`crate::protocol::Coordinator::wait_no_window`]).
    #[error("job {id} refused: a capture window is open")]
    CaptureWindowOpen {
        /// The refused job's id (not marked as used).
        id: JobId,
    },
    /// An expedited load on an engine made without an expedited lane
    /// ([`super::TransferOptions::expedited_lane`]).
    #[error("job {id} refused: no expedited lane (TransferOptions::expedited_lane is off)")]
    NoExpeditedLane {
        /// The refused job's id (not marked as used).
        id: JobId,
    },
    /// No job with this id is in flight (never submitted, or already reported).
    #[error("no job {id} is in flight")]
    UnknownJob {
        /// The id asked for.
        id: JobId,
    },
    /// The job failed on the GPU or at enqueue; it is also reported failed by
    /// [`super::TransferEngine::poll_finished`].
    #[error("job {id} failed: {error}")]
    JobFailed {
        /// The failed job's id.
        id: JobId,
        /// The first driver error recorded while the job was enqueued; if
        /// there was none, the error of the wait for its completion
        /// (`cuEventSynchronize` or `cuStreamSynchronize`), e.g. a sticky
        /// device fault such as ILLEGAL_ADDRESS or LAUNCH_FAILED.
        error: DriverError,
    },
    /// The capture-safety protocol refused the call (e.g. a blocking wait
    /// inside the caller's own capture window).
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A driver call of the engine itself failed (set-up or tear-down).
    #[error(transparent)]
    Driver(#[from] DriverError),
}
