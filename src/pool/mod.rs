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
//!   engine's marks;
//! - [`closing`]: removing a pool only while no engine is registered
//!   (`pool rm`, the last engine leaving a pool not kept), the pool word;
//! - [`agreement`]: the P7 pin agreement of an engine's ranks through its
//!   entry's words ([`agreement::EngineSlots`]);
//! - [`error`]: the pool's typed errors ([`error::PoolError`]), a refused
//!   fingerprint field among them;
//! - [`fingerprint`]: what the pool's bytes mean (design 1.3), its three
//!   parts as typed records and their write-once state words;
//! - [`mod@file`]: the pool's index file on tmpfs (design 2.1): creating,
//!   opening, trusting and removing it, its words as
//!   [`file::words::ShmPoolWords`] with the liveness oracle of design 3.6,
//!   and what `kvoffload pool ls | rm` show and do.

pub mod agreement;
pub mod closing;
pub mod engines;
pub mod error;
pub mod file;
pub mod fingerprint;
pub mod slot;
pub mod sweep;
pub mod table;
pub mod words;
