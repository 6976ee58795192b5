//! kvoffload: moves LLM KV-cache blocks between GPU memory and a pinned host
//! region, with the concurrency around pinning, CUDA graph capture, transfers
//! and shutdown checked by the loom model checker.
//!
//! Layers, bottom up (see README.md and `../shared/DESIGN.md`):
//! - [`sync`]: std or loom primitives, the only source of locks and threads.
//! - [`runtime`]: the abstract GPU runtime ([`runtime::GpuRuntime`]) with a
//!   real backend on cudarc and a simulated GPU that follows the driver rules
//!   measured on an H200.
//! - [`region`]: the host region (anonymous or /dev/shm shared).
//! - [`protocol`]: the verified core: capture windows, gated capture-unsafe
//!   calls, chunk registration, shutdown order, rank agreement.
//! - [`pin`]: chunked registration with rollback, in the background.
//! - [`manager`]: block states, reference counts and eviction.
//! - [`transfer`]: store and load jobs between GPU blocks and host blocks,
//!   with per-fragment, batched and gather-kernel copy backends.
//!
//! The tools (the `run` job, conformance, the incident, the benchmarks and
//! the CLI) live in the binary crate, `src/bin/kvoffload/`, and use this
//! crate's public API like any engine.

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
