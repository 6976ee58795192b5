//! [`Gate`]: the proof a capture-unsafe driver call needs.

use std::marker::PhantomData;

/// Proof that the calling code runs inside the coordinator's gate: no
/// capture window is open, and none opens until the gate's closure returns
/// (`crate::protocol::Coordinator::unsafe_call`).
///
/// Every capture-unsafe operation of [`super::GpuRuntime`] takes one. Only
/// the coordinator makes them (its constructor is private to the crate, and
/// clippy.toml disallows it everywhere but `src/protocol/coordinator.rs`);
/// the closure gets `&Gate`, which it cannot keep past its return (the
/// borrow ends there) nor send to another thread (`Gate` is neither `Send`
/// nor `Sync`).
pub struct Gate {
    _not_send: PhantomData<*const ()>,
}

impl Gate {
    /// Made by the coordinator for the closure it runs inside its gate.
    pub(crate) fn new_inside_gate() -> Gate {
        Gate { _not_send: PhantomData }
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gate")
    }
}
