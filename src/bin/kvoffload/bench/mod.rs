//! The benchmarks behind `kvoffload bench`, each against the baseline its
//! issue names, in the same run: pinning ([`pin`]), copies ([`transfer`])
//! and eviction policies ([`manager`]).

pub mod manager;
pub mod pin;
pub mod transfer;
