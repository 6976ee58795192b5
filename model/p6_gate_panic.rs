//! P6 for a panic under the gate: a callable an engine runs inside the
//! offloader's gate (`Offloader::gated`, which runs it through
//! `Coordinator::unsafe_call`) that panics ends its call all the same.
//!
//! - **A panicking gated call ends, counted once** (3 threads: main, an
//!   engine thread, the sim's device thread; pinning final first, its
//!   thread joined). Main makes a gated call whose callable panics (its
//!   panic caught by main around the call, as the Python front catches
//!   one before it could cross into Python); the engine thread opens a
//!   capture window at any point, before, during (it waits for the call) or
//!   after, and closes it. Then main checks that nothing is counted in
//!   flight or waiting, opens a capture window itself and closes it, and
//!   makes a gated call that returns (its thread is no longer marked as
//!   inside `gated`). Property: every call returns, the panicking call is
//!   not counted once it unwound, and later windows and gated calls go on.
//!
//!   Negative N37 (`Variant::PanicUnderGateLeaks`: the call's in-flight
//!   count is not dropped on unwinding): caught, "the panicked call is
//!   still counted in flight", or loom's "deadlock" when the engine's
//!   window waits for the call for ever first.
//!
//! The panic is raised with `std::panic::resume_unwind`, which runs no
//! panic hook: a negative's hook (model/common) records the first panic as
//! the model's failure, and this one is the scenario's, not a failure.
//! Under shuttle the model says so (`common::catches_its_own_panics`):
//! its unwinding passes a scheduling point (the call's release), where
//! shuttle would otherwise stop the schedule as failed.
//!
//! Why it holds: `Coordinator::counted` holds an `InFlight` guard, armed
//! while the callable runs, whose drop (on unwinding) drops the count and
//! hands the turn to the windows with a release that notifies (P6), and
//! is disarmed once the callable returned, so a normal end is counted
//! once, by the release after it; `Offloader::run_gated`'s mark of the
//! thread as inside `gated` is a guard too.
//! Bound: preemption bound 3 (3 threads).

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use common::offloader::pinned;
use common::{check, negative, Bounds};
use kvoffload::internal::offloader::activity;
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::thread;
use kvoffload::Request;

/// Panicking gated calls main makes, and windows the engine thread opens:
/// loom's size, and shuttle's past it.
const ROUNDS: usize = common::sized(1, 3);

/// What the callable panics with.
const PANIC: &str = "the engine's callable panicked under the gate";

fn a_panic_under_the_gate(variant: Variant) {
    let (_rt, off) = pinned(1, variant);
    let o_e = off.clone();
    let engine = thread::spawn(move || {
        for _ in 0..ROUNDS {
            drop(o_e.capture_window(Request::new()).expect("a window after (or while) a call panicked under the gate"));
        }
    });
    for _ in 0..ROUNDS {
        let caught = catch_unwind(AssertUnwindSafe(|| {
            let _ = off.gated("a callable that panics", Request::new(), |_| -> () { resume_unwind(Box::new(PANIC)) });
        }));
        let payload = caught.expect_err("the gated call's panic unwinds to its caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&PANIC), "another panic unwound");
        let a = activity(&off);
        assert_eq!((a.calls_in_flight, a.calls_waiting), (0, 0), "the panicked call is still counted in flight");
    }
    drop(off.capture_window(Request::new()).expect("a window after a call panicked under the gate"));
    engine.join().unwrap();
    off.gated("a call after the panic", Request::new(), |c| c.ctx_synchronize())
        .expect("a gated call after a panicked one")
        .unwrap();
    let a = activity(&off);
    assert_eq!((a.calls_in_flight, a.windows_open), (0, 0), "a call or a window left counted");
    off.shutdown(Request::new(), &mut drop).unwrap();
}

const B: Bounds = Bounds { property: "P6", threads: 4, preemptions: 3, ci: None };

#[test]
fn p6_a_panic_under_the_gate_ends_the_call_once() {
    common::catches_its_own_panics();
    check("p6_gate_panic", B, || a_panic_under_the_gate(Variant::Production));
}

#[test]
#[ignore = "negative model: run by ci/prove, must fail"]
fn negative_n37_a_panic_under_the_gate_leaks_its_call() {
    common::catches_its_own_panics();
    negative(
        "n37_panic_under_gate_leaks",
        Bounds { property: "N37", ..B },
        "the panicked call is still counted in flight || deadlock",
        || a_panic_under_the_gate(Variant::PanicUnderGateLeaks),
    );
}
