//! Block manager: block states, reference counts and eviction.
//!
//! [`BlockManager`] decides which KV-cache blocks the host region holds and
//! in which slot. Keys are block hashes plus a KV-cache group index
//! ([`BlockKey`]); each stored block is write-pending (its GPU -> host copy
//! is in flight) or ready, with a count of loads in flight. Only ready blocks
//! with no readers can be evicted, by the configured [`EvictionPolicy`]
//! ([`PolicyKind::Lru`] or [`PolicyKind::Arc`]). Misuse (completing what was
//! not prepared, loading a pending block, repeating a key in a batch) is a
//! [`ManagerError`], never a panic or a silent change.
//!
//! The stores' contract ([`BlockManager::prepare_store`]): a call that
//! fails changes nothing, and a store prepared with
//! [`BlockManager::prepare_store_undoable`] can be taken back exactly
//! ([`BlockManager::undo_store`], for a caller whose submission is
//! refused); `skipped` and `evicted` of one call are disjoint (a batch
//! never evicts its own keys) and every eviction is reported; a block
//! stays stored until a call reports it evicted (or a failed store or a
//! reset drops it).
//!
//! Events ([`ManagerEvent`]) go to `tracing` at debug level and to
//! [`ManagerCounters`]; `kvoffload bench manager` compares the policies' hit rates.

mod batch;
mod block_manager;
mod config;
mod error;
mod events;
mod invariants;
mod key;
mod load;
pub mod policy;
mod slots;
mod state;
mod store;
mod threshold;

pub use block_manager::BlockManager;
pub use config::{ManagerConfig, PolicyKind};
pub use error::ManagerError;
pub use events::{ManagerCounters, ManagerEvent, RemoveReason};
pub use key::{BlockKey, Placement, SlotId};
pub use policy::{EvictionPolicy, PolicyUndo};
pub use state::{BlockState, Lookup};
pub use store::{PrepareStoreOutput, SkipReason, Skipped, StoreUndo};
