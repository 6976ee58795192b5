//! The benchmarks behind `kvoffload bench`, each against the baseline its
//! issue names, in the same run: pinning ([`pin`], and a shared region pinned by N ranks: [`pin_shared`]; a persistent one opened again: [`pin_existing`]), copies ([`transfer`])
//! and eviction policies ([`manager`]); and [`pin_project`], pinning at
//! 256 GiB - 1 TiB projected from measured sizes.

pub mod manager;
pub mod pin;
pub mod pin_existing;
pub mod pin_project;
pub mod pin_shared;
pub mod transfer;
