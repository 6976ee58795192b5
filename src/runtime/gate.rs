//! [`Gate`]: the proof a capture-unsafe driver call needs.

use std::cell::RefCell;
use std::marker::PhantomData;

// Per thread: the last gate serial handed out, and the serials of the gates
// alive on this thread (made by the coordinator's gate, not yet dropped).
// The simulated GPU checks every capture-unsafe call against it
// (`Gate::in_flight_here`). Loom's macro takes no `const` initializer.
#[cfg(not(loom))]
crate::sync::thread_local! {
    static IN_FLIGHT: RefCell<(u64, Vec<u64>)> = const { RefCell::new((0, Vec::new())) };
}
#[cfg(loom)]
crate::sync::thread_local! {
    static IN_FLIGHT: RefCell<(u64, Vec<u64>)> = RefCell::new((0, Vec::new()));
}

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
///
/// A gate also carries an identity: the coordinator's gate records it as in
/// flight on the calling thread while its closure runs, and the simulated
/// GPU refuses to run a capture-unsafe call whose gate is not in flight on
/// the calling thread (it panics: "capture-unsafe call outside the gate").
/// Library code cannot get there (the type forbids it); loom builds have
/// `Gate::forged` for the one negative model that shows the check works.
pub struct Gate {
    /// Unique per thread while in flight; 0 for a forged gate.
    serial: u64,
    _not_send: PhantomData<*const ()>,
}

impl Gate {
    /// Made by the coordinator for the closure it runs inside its gate; in
    /// flight on this thread until dropped.
    pub(crate) fn new_inside_gate() -> Gate {
        let serial = IN_FLIGHT.with(|c| {
            let mut c = c.borrow_mut();
            c.0 += 1;
            let s = c.0;
            c.1.push(s);
            s
        });
        Gate { serial, _not_send: PhantomData }
    }

    /// True when this gate was made by the coordinator's gate on the calling
    /// thread and its closure is still running.
    pub(crate) fn in_flight_here(&self) -> bool {
        self.serial != 0 && IN_FLIGHT.with(|c| c.borrow().1.contains(&self.serial))
    }

    /// A gate that no coordinator made: a capture-unsafe call made with it
    /// bypasses the capture rule. Loom builds only, for the negative model
    /// that shows the simulated GPU catches such a call (N8 in
    /// model/p1_capture_isolation.rs); never used anywhere else.
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn forged() -> Gate {
        Gate { serial: 0, _not_send: PhantomData }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if self.serial != 0 {
            let s = self.serial;
            IN_FLIGHT.with(|c| c.borrow_mut().1.retain(|&x| x != s));
        }
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gate")
    }
}
