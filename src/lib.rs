//! kvoffload: moves LLM KV-cache blocks between GPU memory and a pinned host
//! region, with the concurrency around pinning, CUDA graph capture, transfers
//! and shutdown checked by the loom model checker (docs/PROOFS.md).
//!
//! # What an engine uses
//!
//! An engine holds one [`KeyedOffloader`] (jobs by block keys, placed by a
//! block manager) or one [`Offloader`] (its slot-addressed core: jobs by the
//! engine's own host slots and job ids, for engines whose scheduler manages
//! its own host blocks, vLLM's offloading connector), built from one
//! [`OffloaderOptions`]. The type decides what it can do: a keyed
//! offloader's [`KeyedOffloader::core`] is its core for everything but the
//! keyed jobs. The items it needs are re-exported here, at the crate root
//! (every type in a public signature of the two and of their options), and
//! they are the only ones whose behaviour the proofs cover at the engine's
//! edge (`model/p4_offloader.rs`, `model/p5_offloader.rs`,
//! `model/p1_hook.rs`):
//!
//! | item | what for |
//! |---|---|
//! | [`CudaRuntime::open`], [`SimRuntime::new`] ([`SimConfig`]), [`shared`], [`GpuRuntime`] | a runtime handle; one offloader per handle (a second is refused: [`ProtocolError::RuntimeGuarded`]) |
//! | [`Offloader::new`] / [`KeyedOffloader::new`] (the engine's tensors, `unsafe`: their lifetime is the contract; [`KvSpec`], [`TensorSpec`]) or [`Offloader::with_allocated_tensors`] / [`KeyedOffloader::with_allocated_tensors`] ([`KvAlloc`]) | build it; [`RegionSpec`] picks an anonymous or a node-shared region ([`ShmOptions`], [`FileSplit`], [`ShmStep`]); [`PinOptions`] ([`CapturePolicy`], [`HugePages`], [`PrefaultMode`], [`NumaPolicy`]), [`TransferOptions`] ([`BackendChoice`], [`AutoThresholds`]), [`PolicyKind`], `OffloaderOptions::kv_groups` (slot jobs only) tune it |
//! | [`Offloader::start`], [`Offloader::pin_progress`], [`Offloader::wait_pinned`], [`Offloader::cancel_pinning`], [`PinObserver`] | pinning in the background and its progress ([`PinState`], [`PinProgress`], [`PinOutcome`]) |
//! | [`Offloader::capture_window`] ([`CaptureWindow`]), [`Offloader::register_graph`] ([`GraphToken`]) | around each CUDA graph capture; for each graph that references the region |
//! | [`Offloader::hold_pinning`] ([`PinHold`]) | around the engine's capture phase: no registration starts while it lives, so back-to-back captures never wait for one |
//! | [`Offloader::capture_hook`] ([`CaptureHook`]: `begin`, `end`, `abort`, `depth`, `deferred_jobs`) | the same window for a hook that wraps a framework's capture calls (PyTorch's `CUDAGraph.capture_begin`/`capture_end`): jobs submitted meanwhile are queued and submitted when it closes ([`Completion::deferred_seconds`]) |
//! | [`Offloader::gated`] ([`GatedCalls`]) | the engine's own capture-unsafe driver calls, inside the offloader's gate |
//! | [`KeyedOffloader::lookup`], [`KeyedOffloader::store`] ([`StoreSubmitted`]), [`KeyedOffloader::load`], [`KeyedOffloader::stored_blocks`], [`KeyedOffloader::poll`] | by block keys ([`BlockKey`], [`Lookup`], [`Skipped`]) and the engine's GPU block ids |
//! | [`Offloader::submit`] ([`SlotJob::single`], [`SlotJob::groups`] for `OffloaderOptions::kv_groups`; [`Lane`]: store, load, or the expedited load lane of `TransferOptions::expedited_lane`), [`Offloader::wait_jobs`] | host slots and job ids ([`JobId`]) chosen by the engine, no block manager |
//! | [`Offloader::poll_each`] ([`Completion`]), [`Offloader::wait`], [`Offloader::wait_all`], [`Offloader::in_flight`] | completions, applied to a keyed offloader's block manager |
//! | [`Request`] (`Request::new()`, [`Request::interruptible`], [`Request::interleaved`]) | what every wait above takes (the window, the hook's begin and end, `gated`, `wait_pinned`, the job waits, shutdown): blocking, or interruptible by a check (the Python front's Ctrl-C) |
//! | [`Offloader::shutdown`], [`Offloader::is_shut_down`] | shutdown (refused with nothing changed while a window is open or a graph lives) |
//! | [`Offloader::geometry`] ([`Geometry`]: the GPU's runtime, the tensors, the host blocks, the [`KvLayout`] with the host and device address of every block, the [`Region`], the lanes' streams) | where things are |
//! | [`Kernel`] (the pattern kernels of [`GpuRuntime::launch`]: [`pattern`], [`PATTERN_ENTRY_WORDS`], [`GATHER_ENTRY_WORDS`]), [`SimFault`] ([`SimRuntime::inject`]), [`Layout`] ([`Region::layout`], [`page_size`]), [`GroupSpec`] and [`HostPlacement`] ([`KvLayout::new`]), the options' defaults and limits ([`DEFAULT_MAX_CHUNK_BYTES`], [`DEFAULT_SHM_DIR`], [`DEFAULT_FILE_BYTES`], [`MAX_FILES`], [`MAX_RANKS`]) | the rest of those items' signatures: what the `run` job's ranks (engine-like processes on this API alone) verify every block with, fault injection on the simulated GPU, and region sizing |
//! | [`OffloaderError`] and the errors it wraps ([`ProtocolError`], [`ShutdownError`], [`PinError`], [`RegionError`], [`TransferError`], [`ManagerError`], [`LayoutError`], [`DriverError`] with its [`Code`], [`AgreementError`]) | every failure, typed |
//!
//! The layers these are built from (the coordinator and its gate, the
//! pinner, the transfer engine, the block manager, the region's files, the
//! simulated GPU's test controls, the `sync` facade) are reachable only
//! through `kvoffload::internal`, hidden from these docs: it is there for
//! the crate's own tools (the CLI, the benchmarks, conformance:
//! `src/bin/kvoffload/`), its tests, its loom models and the Python test
//! hooks, which drive those layers directly. An engine does not need it,
//! and a change there is not an API change. The safety argument does not
//! rest on that path being hidden: a second coordinator for a runtime handle
//! an offloader guards cannot be made, and a gate of another coordinator is
//! refused by the runtime ([`Code::GATE_REFUSED`]).
//!
//! # Layers, bottom up (README.md's layout table)
//! These are the modules under `kvoffload::internal`, each in its own folder
//! of `src/`:
//! - `sync`: std or loom primitives, the only source of locks and threads.
//! - `runtime`: the abstract GPU runtime ([`GpuRuntime`]) with a
//!   real backend on cudarc and a simulated GPU that follows the driver rules
//!   measured on an H200 (docs/driver-rules.md).
//! - `region`: the host region (anonymous or /dev/shm shared).
//! - `protocol`: the verified core: capture windows, gated capture-unsafe
//!   calls, chunk registration, shutdown order, rank agreement.
//! - `pin`: chunked registration with rollback, in the background.
//! - `manager`: block states, reference counts and eviction.
//! - `pool`: the node pool shared by a node's engines
//!   (docs/node-pool-design.md): its words (slot, key, engine table), the
//!   index protocol over them (lookup and hold, claim and CLOCK eviction,
//!   each rank's completion, the sweep of a dead engine), the pool's index
//!   file with its fingerprint, and `kvoffload pool ls|rm`.
//! - `transfer`: store and load jobs between GPU blocks and host blocks,
//!   with per-fragment, batched, gather-kernel and staged copy backends.
//! - `offloader`: the slot-addressed core an engine holds, and the keyed
//!   layer over it.
//!
//! The tools (the `run` job, conformance, the incident, the benchmarks and
//! the CLI) live in the binary crate, `src/bin/kvoffload/`.

#![warn(missing_docs)]

// Hidden from the engine's docs. ci/lint documents it too (with
// `--cfg kvo_document_internal`), so missing docs and broken links inside
// it still fail the lint: rustc's `missing_docs` skips hidden items.
#[cfg_attr(not(kvo_document_internal), doc(hidden))]
pub mod internal;

// The layers by their short names inside the crate (`crate::protocol::...`).
use internal::{manager, offloader, pin, protocol, region, rules, runtime, sync, transfer};

pub use internal::{names, units};

// The engine's API. Grouped by the layer each item comes from.
pub use manager::{BlockKey, BlockState, Lookup, ManagerError, PolicyKind, SkipReason, Skipped};
pub use names::{Named, UnknownName};
pub use offloader::{
    CaptureHook, Completion, GatedCalls, Geometry, KeyedOffloader, KvAlloc, KvSpec, Offloader, OffloaderError,
    OffloaderOptions, PinObserver, PinOutcome, PinProgress, RegionSpec, SlotJob, StoreSubmitted,
};
pub use pin::{HugePages, NumaPolicy, PinError, PinOptions, PrefaultMode, DEFAULT_MAX_CHUNK_BYTES};
pub use protocol::agreement::{AgreementError, RankSlots, Transport};
pub use protocol::{
    CapturePolicy, CaptureWindow, GraphToken, PageableReason, PinHold, PinState, ProtocolError, Request, ShutdownError,
};
pub use region::{
    page_size, AbandonReason, FileProblem, FileSplit, JoinPhase, Layout, RawRange, Region, RegionError, ShmOptions,
    ShmStep, DEFAULT_FILE_BYTES, DEFAULT_SHM_DIR, MAX_FILES, MAX_RANKS,
};
#[cfg(not(any(loom, shuttle)))]
pub use runtime::cuda::CudaRuntime;
pub use runtime::sim::{SimConfig, SimFault, SimRuntime};
pub use runtime::{
    pattern, shared, CaptureMode, CaptureStatus, Code, DevicePtr, Direction, DriverError, DriverResult, Event,
    GpuRuntime, Graph, Kernel, OpenError, Stream, GATHER_ENTRY_WORDS, PATTERN_ENTRY_WORDS,
};
pub use transfer::{
    AutoThresholds, Backend, BackendChoice, GroupSpec, HostPlacement, JobId, KvLayout, Lane, LayoutError, TensorSpec,
    TransferError, TransferOptions,
};

/// The README's library example, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
