//! kvoffload: moves LLM KV-cache blocks between GPU memory and a pinned host
//! region, with the concurrency around pinning, CUDA graph capture, transfers
//! and shutdown checked by the loom model checker (docs/PROOFS.md).
//!
//! # What an engine uses
//!
//! An engine holds one [`offloader::Offloader`], built from one
//! [`offloader::OffloaderOptions`]; these are the items it needs, and the
//! only ones whose behaviour the proofs cover at the engine's edge
//! (`model/p4_offloader.rs`, `model/p5_offloader.rs`):
//!
//! | item | what for |
//! |---|---|
//! | [`runtime::cuda::CudaRuntime::open`], [`runtime::sim::SimRuntime::new`], [`runtime::shared`] | a runtime handle; one offloader per handle (a second is refused: [`protocol::ProtocolError::RuntimeGuarded`]) |
//! | [`offloader::Offloader::new`] (the engine's tensors, `unsafe`: their lifetime is the contract) or [`offloader::Offloader::with_allocated_tensors`] ([`offloader::KvAlloc`]) | build it over a [`offloader::KvSpec`]; [`offloader::RegionSpec`] picks an anonymous or a node-shared region ([`region::ShmOptions`]) |
//! | [`offloader::Offloader::start`], [`offloader::Offloader::pin_state`], [`offloader::Offloader::pin_progress`], [`offloader::Offloader::wait_pinned`], [`offloader::PinObserver`] | pinning in the background and its progress ([`protocol::PinState`], [`offloader::PinProgress`], [`offloader::PinOutcome`]) |
//! | [`offloader::Offloader::capture_window`] ([`protocol::CaptureWindow`]), [`offloader::Offloader::register_graph`] ([`protocol::GraphToken`]) | around each CUDA graph capture; for each graph that references the region |
//! | [`offloader::Offloader::gated`] ([`offloader::GatedCalls`]) | the engine's own capture-unsafe driver calls, inside the offloader's gate |
//! | [`offloader::Offloader::lookup`], [`offloader::Offloader::store`] ([`offloader::StoreSubmitted`]), [`offloader::Offloader::load`] | by block keys ([`manager::BlockKey`], [`manager::Lookup`]) and the engine's GPU block ids |
//! | [`offloader::OffloaderOptions::with_host_slots`] ([`offloader::Addressing`], `OffloaderOptions::kv_groups`), [`offloader::Offloader::store_slots`], [`offloader::Offloader::load_slots`], [`offloader::Offloader::store_slot_job`] / [`offloader::Offloader::load_slot_job`] ([`offloader::SlotJob`]), [`offloader::Offloader::wait_jobs`] | for engines whose scheduler manages its own host blocks (vLLM's offloading connector): host slots and job ids chosen by the engine, no block manager |
//! | [`offloader::Offloader::poll`] ([`offloader::Completion`]), [`offloader::Offloader::wait`], [`offloader::Offloader::wait_all`], [`offloader::Offloader::in_flight`] | completions, applied to the block manager |
//! | [`offloader::Offloader::shutdown`], [`offloader::Offloader::is_shut_down`] | shutdown (refused with nothing changed while a window is open or a graph lives) |
//! | [`offloader::OffloaderError`] and the errors it wraps | every failure, typed |
//!
//! Everything else is public for the crate's own tools (the CLI, the
//! benchmarks, conformance: `src/bin/kvoffload/`), its tests and its loom
//! models, which drive the layers below the offloader directly: an engine
//! does not need it, and a change there is not an API change for engines.
//! Of those, the coordinator's capture-unsafe gate stays safe to misuse:
//! a second [`protocol::Coordinator`] for a runtime handle an offloader
//! guards cannot be made, and a gate of another coordinator is refused by
//! the runtime ([`runtime::Code::GATE_REFUSED`]).
//!
//! # Layers, bottom up (README.md's layout table)
//! - [`sync`]: std or loom primitives, the only source of locks and threads.
//! - [`runtime`]: the abstract GPU runtime ([`runtime::GpuRuntime`]) with a
//!   real backend on cudarc and a simulated GPU that follows the driver rules
//!   measured on an H200 (docs/driver-rules.md).
//! - [`region`]: the host region (anonymous or /dev/shm shared).
//! - [`protocol`]: the verified core: capture windows, gated capture-unsafe
//!   calls, chunk registration, shutdown order, rank agreement.
//! - [`pin`]: chunked registration with rollback, in the background.
//! - [`manager`]: block states, reference counts and eviction.
//! - [`transfer`]: store and load jobs between GPU blocks and host blocks,
//!   with per-fragment, batched, gather-kernel and staged copy backends.
//! - [`offloader`]: the one type an engine holds.
//!
//! The tools (the `run` job, conformance, the incident, the benchmarks and
//! the CLI) live in the binary crate, `src/bin/kvoffload/`.

#![warn(missing_docs)]

pub mod manager;
pub mod offloader;
pub mod pin;
pub mod protocol;
pub mod region;
pub mod runtime;
pub mod sync;
pub mod transfer;
pub mod units;

/// The README's library example, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
