//! `kvoffload run`, the main job end to end: N rank processes share one
//! region; each holds one [`kvoffload::KeyedOffloader`], as an engine
//! would, which pins the region in the background while the rank does its
//! own start-up work; the rank captures graphs inside capture windows, waits
//! for the pin state every rank agreed on (P7), then stores and loads by
//! keys and GPU block ids, checking every loaded block byte for byte against
//! a pattern derived from its key.
//!
//! - [`config`]: the settings and the sizes derived from them.
//! - [`rank`]: the body of one rank process; `error`: why a rank stops,
//!   and its gated driver calls; [`parent`]: the lines it writes for its
//!   parent and the fault tests' pause points.
//! - [`lifecycle`]: a rank dies with its parent; SIGINT/SIGTERM stop it in
//!   order.
//! - [`report`]: the lines a rank prints for its parent, and its figures.
//! - `workload`: a rank's requests and the final sweep; `tables`, `verify`:
//!   a job's GPU pages as pattern-kernel tables, and the verifier thread
//!   that checks loaded pages on the GPU.
//! - [`metrics`]: latencies and throughput; block contents come from
//!   [`kvoffload::pattern`].
//!
//! The parent (spawning ranks, killing them in fault tests, forwarding
//! SIGINT/SIGTERM, the summary) is the CLI's `run` command
//! (`src/cli/run.rs`).

pub mod config;
mod error;
pub mod lifecycle;
pub mod metrics;
pub mod parent;
pub mod rank;
pub mod report;
mod tables;
mod verify;
mod workload;

pub use config::{KillAt, RunConfig};

/// `m`'s lock, also when a thread panicked holding it (the ranks' state
/// stays readable for the report).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
pub use rank::run_rank;
