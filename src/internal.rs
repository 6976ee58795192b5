//! The layers below the engine's API, for the crate's own tools, tests and
//! loom models only.
//!
//! An engine uses the items re-exported at the crate root (the table in the
//! crate docs). Everything here is the machinery those items are built from:
//! the coordinator and its guards, the pinner, the transfer engine, the block
//! manager, the region's files, the simulated GPU's test controls and the
//! `sync` facade. The CLI (`src/bin/kvoffload/`), the tests, the loom models
//! (`model/`) and the Python bindings' test hooks (`kvoffload._testing`)
//! drive these layers directly; nothing here is an engine's API, and a
//! change here is not an API change. The safety argument does not rest on
//! this path being hidden: a second coordinator for a runtime handle an
//! offloader guards cannot be made, and a gate of another coordinator is
//! refused by the runtime.

#[path = "manager/mod.rs"]
pub mod manager;
#[path = "names.rs"]
pub mod names;
#[path = "offloader/mod.rs"]
pub mod offloader;
#[path = "pin/mod.rs"]
pub mod pin;
#[path = "pool/mod.rs"]
pub mod pool;
#[path = "protocol/mod.rs"]
pub mod protocol;
#[path = "region/mod.rs"]
pub mod region;
#[path = "runtime/mod.rs"]
pub mod runtime;
// The seam between the shipped rules and the negative models' variants
// (crate-private: the models reach the variants as `protocol::Variant`).
#[path = "rules/mod.rs"]
pub(crate) mod rules;
#[path = "sync/mod.rs"]
pub mod sync;
#[path = "transfer/mod.rs"]
pub mod transfer;
#[path = "units.rs"]
pub mod units;
