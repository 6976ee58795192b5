//! The node pool (docs/node-pool-design.md, issue 46): one host KV pool
//! shared by the engines of a node.
//!
//! - [`slot`]: a slot's state word (design 2.2) and its transitions
//!   (design 3), each one CAS on one word;
//! - [`words`]: where the pool's words live ([`words::PoolWords`]: a pool
//!   file's mapping, or the `sync` facade's atomics for the models);
//! - [`engines`]: the engine table's words (design 2.4).

pub mod slot;
pub mod engines;
pub mod words;
