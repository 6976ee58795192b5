//! [`Gate`]: the proof a capture-unsafe driver call needs, and
//! [`GateBinding`]: which coordinator's gates a runtime handle accepts.
//!
//! Three things together make "no capture-unsafe call outside the gate of
//! the coordinator that guards this runtime" hold through safe code:
//!
//! 1. **Only the coordinator's module can make a gate.** [`Gate::minted`]
//!    takes a [`GateSeal`], and there is one seal per process:
//!    [`GateSeal::take`] hands it out once, and the coordinator's module
//!    takes it into a private static the first time a coordinator is made
//!    (it panics if anything else took it first, so a change that takes the
//!    seal elsewhere fails every test that makes a coordinator). No lint is
//!    involved: code without the seal cannot call the constructor.
//! 2. **A gate names its coordinator**, and a runtime handle accepts the
//!    gates of one coordinator only: the coordinator binds the handle when
//!    it is made ([`GateBinding::bind`], refused while another coordinator
//!    holds it) and releases it when it is gone. Every capture-unsafe
//!    operation of both runtimes asks [`GateBinding::admits`] first and
//!    answers [`Code::GATE_REFUSED`](super::Code::GATE_REFUSED) otherwise, so
//!    the gate of another coordinator (one made for another runtime handle)
//!    is refused in every build, on the real driver too.
//! 3. **A gate is in flight only while its closure runs**, on the thread
//!    that runs it: the coordinator records its serial as in flight on the
//!    calling thread, and the simulated GPU stops the run (a panic, "capture-
//!    unsafe call outside the gate") when a gate is used anywhere else. The
//!    closure gets `&Gate`, which it cannot keep past its return (the borrow
//!    ends there) nor send to another thread (`Gate` is neither `Send` nor
//!    `Sync`).

use std::cell::RefCell;
use std::marker::PhantomData;
// Not synchronisation between library threads (so not from the sync facade,
// whose loom atomics would add interleavings that cannot matter): the seal's
// one-time hand-out, and the binding's owner, which is written when a
// coordinator is made, before any gate of it exists, and cleared when the
// coordinator and every guard of it are gone.
#[allow(clippy::disallowed_types)]
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::Code;

// Per thread: the last gate serial handed out, and the serials of the gates
// alive on this thread (made by the coordinator's gate, not yet dropped).
// The simulated GPU checks every capture-unsafe call against it
// (`Gate::in_flight_here`). Loom's macro takes no `const` initializer.
#[cfg(not(any(loom, shuttle)))]
crate::sync::thread_local! {
    static IN_FLIGHT: RefCell<(u64, Vec<u64>)> = const { RefCell::new((0, Vec::new())) };
}
#[cfg(any(loom, shuttle))]
crate::sync::thread_local! {
    static IN_FLIGHT: RefCell<(u64, Vec<u64>)> = RefCell::new((0, Vec::new()));
}

/// The one capability that makes gates. One exists per process; the
/// coordinator's module holds it (see the module docs).
pub struct GateSeal {
    _private: (),
}

#[allow(clippy::disallowed_types)]
static SEAL_TAKEN: AtomicBool = AtomicBool::new(false);

impl GateSeal {
    /// The seal, the first time this is called in the process; `None` ever
    /// after.
    pub(crate) fn take() -> Option<GateSeal> {
        if SEAL_TAKEN.swap(true, Ordering::SeqCst) {
            None
        } else {
            Some(GateSeal { _private: () })
        }
    }
}

/// The identity of one coordinator, as gates and bindings carry it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct CoordinatorId(u64);

impl CoordinatorId {
    /// A fresh identity (never 0, never repeated in the process).
    pub(crate) fn fresh(_seal: &GateSeal) -> CoordinatorId {
        #[allow(clippy::disallowed_types)]
        static NEXT: AtomicU64 = AtomicU64::new(1);
        CoordinatorId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// Proof that the calling code runs inside the gate of the coordinator that
/// guards the runtime it calls: no capture window of that coordinator is
/// open, and none opens until the gate's closure returns
/// (`crate::protocol::Coordinator::unsafe_call`).
///
/// Every capture-unsafe operation of [`super::GpuRuntime`] takes one; see
/// the module docs for why safe code cannot make one, keep one, or use one
/// on another coordinator's runtime.
pub struct Gate {
    /// Unique per thread while in flight; 0 for a forged gate.
    serial: u64,
    coordinator: CoordinatorId,
    _not_send: PhantomData<*const ()>,
}

impl Gate {
    /// Made by the coordinator (`seal` is the proof) for the closure it
    /// runs inside its gate; in flight on this thread until dropped.
    pub(crate) fn minted(_seal: &GateSeal, coordinator: CoordinatorId) -> Gate {
        let serial = IN_FLIGHT.with(|c| {
            let mut c = c.borrow_mut();
            c.0 += 1;
            let s = c.0;
            c.1.push(s);
            s
        });
        Gate { serial, coordinator, _not_send: PhantomData }
    }

    /// True when this gate was made by the coordinator's gate on the calling
    /// thread and its closure is still running.
    pub(crate) fn in_flight_here(&self) -> bool {
        self.serial != 0 && IN_FLIGHT.with(|c| c.borrow().1.contains(&self.serial))
    }

    /// A gate of coordinator `coordinator` that is not in flight on any
    /// thread (loom builds only: `Coordinator::forged_gate`, for the
    /// negative model N8 that shows the simulated GPU catches a call made
    /// with it).
    #[cfg(any(loom, shuttle))]
    pub(crate) fn unrecorded(_seal: &GateSeal, coordinator: CoordinatorId) -> Gate {
        Gate { serial: 0, coordinator, _not_send: PhantomData }
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
        write!(f, "Gate(coordinator {})", self.coordinator.0)
    }
}

/// Which coordinator's gates a runtime handle accepts: none until a
/// coordinator binds it, then that coordinator's only, until it is gone.
///
/// Every [`super::GpuRuntime`] holds one and returns it from
/// [`super::GpuRuntime::gate_binding`]; its capture-unsafe operations refuse
/// (with [`Code::GATE_REFUSED`](super::Code::GATE_REFUSED)) a gate it does not
/// [admit](GateBinding::admits). Only the crate can bind it. A clone is the
/// same binding (the coordinator keeps one to release it when it is gone).
#[derive(Clone, Default)]
pub struct GateBinding {
    /// The bound coordinator's id, 0 while unbound.
    #[allow(clippy::disallowed_types)]
    owner: std::sync::Arc<AtomicU64>,
    /// The rules [`GateBinding::admits`] runs (`crate::rules`: the shipped
    /// ones outside model builds; in them, the bound coordinator's, set
    /// through its `set_variant`).
    rules: crate::rules::Knob,
}

impl std::fmt::Debug for GateBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.owner.load(Ordering::SeqCst) {
            0 => f.write_str("GateBinding(unbound)"),
            id => write!(f, "GateBinding(coordinator {id})"),
        }
    }
}

impl GateBinding {
    /// An unbound binding (a runtime's, at its creation).
    pub fn new() -> GateBinding {
        GateBinding::default()
    }

    /// Binds to `id`; refused while another coordinator is bound (no
    /// second coordinator for one runtime handle).
    pub(crate) fn bind(&self, id: CoordinatorId) -> Result<(), ()> {
        self.owner.compare_exchange(0, id.0, Ordering::SeqCst, Ordering::SeqCst).map(|_| ()).map_err(|_| ())
    }

    /// Releases the binding of `id` (no effect if another is bound).
    pub(crate) fn release(&self, id: CoordinatorId) {
        let _ = self.owner.compare_exchange(id.0, 0, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// True while a coordinator is bound.
    pub fn is_bound(&self) -> bool {
        self.owner.load(Ordering::SeqCst) != 0
    }

    /// Runs the rules `r` from now on (model builds only: the bound
    /// coordinator's `set_variant`).
    #[cfg(any(loom, shuttle))]
    pub(crate) fn set_rules(&self, r: crate::rules::Active) {
        self.rules.set(r);
    }

    /// True when `gate` is a gate of the bound coordinator.
    pub fn admits(&self, gate: &Gate) -> bool {
        use crate::rules::Rules;
        self.rules.rules().admits_gate(|| {
            let owner = self.owner.load(Ordering::SeqCst);
            owner != 0 && owner == gate.coordinator.0
        })
    }

    /// `Ok` when `gate` is admitted, otherwise the error a capture-unsafe
    /// operation named `call` answers.
    pub fn check(&self, gate: &Gate, call: &'static str) -> super::DriverResult<()> {
        if self.admits(gate) {
            Ok(())
        } else {
            tracing::error!(call, ?gate, binding = ?self, "capture-unsafe call with a gate of another coordinator refused");
            Err(super::DriverError::new(call, Code::GATE_REFUSED))
        }
    }
}
