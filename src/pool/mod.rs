//! The node pool (docs/node-pool-design.md, issue 46): one host KV pool
//! shared by the engines of a node.
//!
//! So far only its smallest piece: [`slot`], the state word of one slot
//! (design 2.2) and its transitions (design 3), each one CAS on one word.

pub mod slot;
