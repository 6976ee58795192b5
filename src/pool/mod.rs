//! The node pool (docs/node-pool-design.md, issue 46): one host KV pool
//! shared by the engines of a node.
//!
//! - [`slot`]: a slot's state word (design 2.2) and its transitions
//!   (design 3), each one CAS on one word;
//! - [`words`]: where the pool's words live ([`words::PoolWords`]: a pool
//!   file's mapping, or the `sync` facade's atomics for the models);
//! - [`engines`]: the engine table's words (design 2.4);
//! - [`table`]: the index protocol (lookup and hold, claim and CLOCK
//!   eviction, each rank's completion, abandon);
//! - [`sweep`]: engines joining and leaving, and the sweep of a dead
//!   engine's marks.

pub mod engines;
pub mod slot;
pub mod sweep;
pub mod table;
pub mod words;
