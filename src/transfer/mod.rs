//! Store (GPU to host) and load (host to GPU) of KV-cache blocks.
//!
//! - [`layout`]: where blocks live ([`KvLayout`]) and the expansion of a
//!   job into merged `(host, device, bytes)` fragments.
//! - [`engine`]: the [`TransferEngine`] and its submit paths: job ids,
//!   admission, ordering after the compute stream, the lanes; `enqueue`:
//!   the backend chosen for a job and its gather and staged paths;
//!   `handler`: the per-lane handler (stream, events, tables, FIFO of jobs),
//!   completion by events, in-order reporting per lane, release at drop.
//! - [`backend`]: per-fragment async copies, batched copies and the gather
//!   kernel; `staged`: the gather kernel into device staging buffers and
//!   batched copies of them (copy engines both ways when a load and a
//!   store run at once); [`select`]: the automatic choice between them;
//!   `ring`: the page-locked staging ring the gather tables are uploaded
//!   from.
//! - `kvoffload bench transfer` (the binary crate) measures it.
//!
//! Properties served (docs/PROOFS.md): P3 (the gather kernel reads only host
//! memory whose registration completed: aliases come only from
//! [`crate::protocol::Coordinator::acquire_alias`], held until the launch
//! is enqueued; the staged backend's kernel touches device memory only) and P5 (every submitted job reported exactly once, in
//! order per direction), with P1 for the poller (event queries only
//! through `try_unsafe_call`).

pub mod backend;
mod chunks;
mod completion;
pub mod engine;
mod enqueue;
pub mod error;
mod handler;
mod ids;
mod lane;
pub mod layout;
mod options;
mod ring;
pub mod select;
mod staged;

pub use backend::{Backend, BackendChoice};
pub use engine::TransferEngine;
pub use error::{LayoutError, TransferError};
pub use ids::JobId;
pub use lane::{JobResult, Lane};
pub use layout::{merge_adjacent, Expansion, GroupBlocks, GroupSpec, HostPlacement, JobBlocks, KvLayout, TensorSpec};
pub use options::TransferOptions;
pub use select::{AutoThresholds, Situation};
