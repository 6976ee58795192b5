//! kvoffload: moves LLM KV-cache blocks between GPU memory and a pinned host
//! region, with the concurrency around pinning, CUDA graph capture, transfers
//! and shutdown checked by the loom model checker (docs/PROOFS.md).
//!
//! # What an engine uses
//!
//! An engine holds one [`Offloader`], built from one [`OffloaderOptions`].
//! The items it needs are re-exported here, at the crate root, and they are
//! the only ones whose behaviour the proofs cover at the engine's edge
//! (`model/p4_offloader.rs`, `model/p5_offloader.rs`):
//!
//! | item | what for |
//! |---|---|
//! | [`CudaRuntime::open`], [`SimRuntime::new`] ([`SimConfig`]), [`shared`], [`GpuRuntime`] | a runtime handle; one offloader per handle (a second is refused: [`ProtocolError::RuntimeGuarded`]) |
//! | [`Offloader::new`] (the engine's tensors, `unsafe`: their lifetime is the contract; [`KvSpec`], [`TensorSpec`]) or [`Offloader::with_allocated_tensors`] ([`KvAlloc`]) | build it; [`RegionSpec`] picks an anonymous or a node-shared region ([`ShmOptions`]); [`PinOptions`], [`TransferOptions`], [`PolicyKind`] tune it |
//! | [`Offloader::start`], [`Offloader::pin_state`], [`Offloader::pin_progress`], [`Offloader::wait_pinned`], [`PinObserver`] | pinning in the background and its progress ([`PinState`], [`PinProgress`], [`PinOutcome`]) |
//! | [`Offloader::capture_window`] ([`CaptureWindow`]), [`Offloader::register_graph`] ([`GraphToken`]) | around each CUDA graph capture; for each graph that references the region |
//! | [`Offloader::capture_begin`], [`Offloader::capture_end`], [`Offloader::capture_abort`], [`Offloader::capture_depth`], [`Offloader::deferred_jobs`] | the same window for a hook that wraps a framework's capture calls (PyTorch's `CUDAGraph.capture_begin`/`capture_end`): jobs submitted meanwhile are queued and submitted when it closes ([`Completion::deferred_seconds`]) |
//! | [`Offloader::gated`] ([`GatedCalls`]) | the engine's own capture-unsafe driver calls, inside the offloader's gate |
//! | [`Offloader::lookup`], [`Offloader::store`] ([`StoreSubmitted`]), [`Offloader::load`] | by block keys ([`BlockKey`], [`Lookup`]) and the engine's GPU block ids |
//! | [`OffloaderOptions::with_host_slots`] ([`Addressing`], `OffloaderOptions::kv_groups`), [`Offloader::store_slots`], [`Offloader::load_slots`], [`Offloader::store_slot_job`] / [`Offloader::load_slot_job`] ([`SlotJob`]), [`Offloader::wait_jobs`], [`Offloader::load_slots_expedited`] / [`Offloader::load_slot_job_expedited`] ([`Lane`], [`Offloader::lane_stream`], `TransferOptions::expedited_lane`) | for engines whose scheduler manages its own host blocks (vLLM's offloading connector): host slots and job ids ([`JobId`]) chosen by the engine, no block manager |
//! | [`Offloader::poll`] ([`Completion`]), [`Offloader::wait`], [`Offloader::wait_all`], [`Offloader::in_flight`] | completions, applied to the block manager |
//! | [`Offloader::shutdown`], [`Offloader::is_shut_down`] | shutdown (refused with nothing changed while a window is open or a graph lives) |
//! | [`Offloader::layout`] ([`KvLayout`]: the host and device address of every block), [`Offloader::region`] ([`Region`]), [`Offloader::tensors`], [`Offloader::activity`] ([`Activity`]) | where things are, and what the coordinator has open or waiting (diagnostics) |
//! | [`OffloaderError`] and the errors it wraps ([`ProtocolError`], [`PinError`], [`RegionError`], [`TransferError`], [`ManagerError`], [`LayoutError`], [`DriverError`] with its [`Code`], [`AgreementError`]) | every failure, typed |
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
//! - `transfer`: store and load jobs between GPU blocks and host blocks,
//!   with per-fragment, batched, gather-kernel and staged copy backends.
//! - `offloader`: the one type an engine holds.
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
use internal::{manager, offloader, pin, protocol, region, runtime, sync, transfer};

pub use internal::units;

// The engine's API. Grouped by the layer each item comes from.
pub use manager::{BlockKey, Lookup, ManagerError, PolicyKind, SkipReason, Skipped};
pub use offloader::{
    Addressing, Completion, GatedCalls, KvAlloc, KvSpec, Offloader, OffloaderError, OffloaderOptions, PinObserver,
    PinOutcome, PinProgress, RegionSpec, SlotJob, StoreSubmitted,
};
pub use pin::{HugePages, NumaPolicy, PinError, PinOptions, PrefaultMode};
pub use protocol::agreement::{AgreementError, Transport};
pub use protocol::{Activity, CaptureWindow, GraphToken, PageableReason, PinState, ProtocolError};
pub use region::{FileProblem, JoinPhase, Region, RegionError, ShmOptions};
#[cfg(not(any(loom, shuttle)))]
pub use runtime::cuda::CudaRuntime;
pub use runtime::sim::{SimConfig, SimRuntime};
pub use runtime::{
    shared, CaptureMode, CaptureStatus, Code, DevicePtr, Direction, DriverError, Event, GpuRuntime, Graph, OpenError,
    Stream,
};
pub use transfer::{
    Backend, BackendChoice, JobId, KvLayout, Lane, LayoutError, TensorSpec, TransferError, TransferOptions,
};

/// The README's library example, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
