//! The eviction policy a property test runs, as a type (the state machines
//! of `manager_state_machine.rs` and `offloader_keyed.rs` are generic over
//! it), and the proptest configuration both state machines run under.
#![allow(dead_code)]

use kvoffload::PolicyKind;
use proptest::test_runner::Config;

/// A state machine's proptest configuration: `cases` runs unless the
/// environment variable `var` names another number, shrinking for at most
/// `max_shrink_iters` steps.
pub fn sm_config(var: &str, cases: u32, max_shrink_iters: u32) -> Config {
    let cases = std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(cases);
    Config { cases, max_shrink_iters, ..Config::default() }
}

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
