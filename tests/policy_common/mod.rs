//! The eviction policy a property test runs, as a type (the state machines
//! of `manager_state_machine.rs` and `offloader_keyed.rs` are generic over
//! it).
#![allow(dead_code)]

use kvoffload::PolicyKind;

/// Chooses the policy a test runs.
pub trait Policy: 'static + std::fmt::Debug {
    /// The policy.
    const KIND: PolicyKind;
}
/// Least recently used.
#[derive(Debug)]
pub struct Lru;
impl Policy for Lru {
    const KIND: PolicyKind = PolicyKind::Lru;
}
/// Adaptive replacement.
#[derive(Debug)]
pub struct Arc;
impl Policy for Arc {
    const KIND: PolicyKind = PolicyKind::Arc;
}
