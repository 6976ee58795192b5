//! P6, liveness: back-to-back capture windows cannot starve pinning, and
//! every guard's release wakes the thread waiting for it.
//!
//! - **Bounded waiting** (3 threads: the engine on main opens three windows
//!   back to back, the pinner registers 3 chunks with the Interleave policy,
//!   the sim's device thread). Each time a window opens while a library
//!   call waits, the number of chunks registered is noted; if the next
//!   window also opens while a call waits, at least one more chunk must have
//!   been registered in between: the pinner never waits through two
//!   windows in a row. Negative N16 (`Variant::WindowKeepsTurn`: a closing
//!   window does not hand the turn to the waiting call) is caught ("the
//!   pinner waited through two windows in a row").
//! - **Each guard's own wake-up** (3 threads each: the holder on main, the
//!   waiter, the sim's device thread). The holder takes the guard, the
//!   waiter starts waiting for its release, the holder releases it, and
//!   nothing else happens after: no later call would wake the waiter by
//!   chance, so a release that forgot to notify leaves it waiting for ever,
//!   which loom reports as a deadlock. Guards: a capture window (the waiter:
//!   a gated library call), a job ticket (shutdown's drain), a chunk's alias
//!   (its unregistration), and the end of a gated call (a window waiting to
//!   open). A graph token has no waiter: shutdown refuses while one lives
//!   instead of waiting. Negative N17 (`Variant::SilentRelease`: every
//!   release forgets the wake-up) is caught in each ("deadlock").
//!
//! Why it holds: a closing window sets the turn to the library side, and a
//! window may open while a call waits only on the window side's turn, which
//! the call's end gives back; every release changes the state and notifies
//! the coordinator's one condition variable in the same critical section.
//! Bounds: preemption bound 3 (2 for the negatives, a subset).

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{fixture, models, pinning_interleaved, Bounds};
use kvoffload::internal::pin::{pin_all, NoPrefault};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::thread;
use kvoffload::Request;
use kvoffload::{CapturePolicy, PinState};

/// Chunks the pinner registers and windows the engine opens back to back:
/// loom's size, and shuttle's past it.
const CHUNKS: usize = common::sized(3, 8);
const WINDOWS: usize = common::sized(3, 8);

fn back_to_back_windows(variant: Variant) {
    let (f, pin) = pinning_interleaved(variant, CHUNKS);
    let mut waited_at: Option<usize> = None;
    for _ in 0..WINDOWS {
        let w = f.coord.open_window(Request::new()).unwrap();
        let (waiting, registered) = (f.coord.activity().calls_waiting > 0, f.coord.pinning().registered_chunks());
        if waiting {
            if let Some(before) = waited_at {
                assert!(registered > before, "the pinner waited through two windows in a row ({registered} chunks)");
            }
            waited_at = Some(registered);
        } else {
            waited_at = None;
        }
        drop(w);
    }
    assert_eq!(pin.join(), PinState::Pinned);
    f.coord.pinning().unregister_all(f.rt.as_ref()).unwrap();
}

#[derive(Copy, Clone)]
enum Guard {
    Window,
    Ticket,
    Alias,
    GateEnd,
}

fn own_wake_up(guard: Guard, variant: Variant) {
    let f = fixture(CapturePolicy::AfterPinning, variant, 1, 64);
    assert_eq!(pin_all(f.rt.as_ref(), &f.coord, &NoPrefault), PinState::Pinned);
    let (c, rt) = (f.coord.clone(), f.rt.clone());
    match guard {
        Guard::Window => {
            let w = f.coord.open_window(Request::new()).unwrap();
            let waiter = thread::spawn(move || {
                c.unsafe_call("a library call", Request::new(), |g| rt.ctx_synchronize(g)).unwrap()
            });
            drop(w);
            waiter.join().unwrap().unwrap();
        }
        Guard::Ticket => {
            let t = f.coord.admit_job().unwrap();
            let waiter = thread::spawn(move || c.shutdown_steps().begin());
            drop(t);
            waiter.join().unwrap().unwrap();
        }
        Guard::Alias => {
            let a = f.coord.acquire_alias(f.base, 8).unwrap();
            let waiter = thread::spawn(move || c.pinning().unregister_chunk(rt.as_ref(), 0));
            drop(a);
            waiter.join().unwrap().unwrap().unwrap();
        }
        Guard::GateEnd => {
            let waiter = f.coord.unsafe_call("a library call", Request::new(), |_| {
                thread::spawn(move || c.open_window(Request::new()).map(drop))
            });
            waiter.unwrap().join().unwrap().unwrap();
        }
    }
    let _ = f.coord.pinning().unregister_all(f.rt.as_ref());
}

const B: Bounds = Bounds { property: "P6", threads: 3, preemptions: 3, ci: None };
const NEG: Bounds = Bounds { preemptions: 2, ..B };

models! {
    p6_back_to_back_windows_do_not_starve_pinning:
        check("p6_back_to_back_windows", B, || back_to_back_windows(Variant::Production));
    p6_a_closing_window_wakes_the_waiting_call:
        check("p6_wake_window", B, || own_wake_up(Guard::Window, Variant::Production));
    p6_a_dropped_ticket_wakes_the_drain:
        check("p6_wake_ticket", B, || own_wake_up(Guard::Ticket, Variant::Production));
    p6_a_dropped_alias_wakes_the_unregistration:
        check("p6_wake_alias", B, || own_wake_up(Guard::Alias, Variant::Production));
    p6_a_gated_calls_end_wakes_the_waiting_window:
        check("p6_wake_gate_end", B, || own_wake_up(Guard::GateEnd, Variant::Production));
    negative_n16_a_closing_window_keeps_the_turn:
        negative("n16_window_keeps_turn", Bounds { property: "N16", ..NEG },
            "the pinner waited through two windows in a row", || back_to_back_windows(Variant::WindowKeepsTurn));
    negative_n17_a_window_release_forgets_to_notify:
        negative("n17_silent_window", Bounds { property: "N17", ..NEG },
            "deadlock", || own_wake_up(Guard::Window, Variant::SilentRelease));
    negative_n17_a_ticket_release_forgets_to_notify:
        negative("n17_silent_ticket", Bounds { property: "N17", ..NEG },
            "deadlock", || own_wake_up(Guard::Ticket, Variant::SilentRelease));
    negative_n17_an_alias_release_forgets_to_notify:
        negative("n17_silent_alias", Bounds { property: "N17", ..NEG },
            "deadlock", || own_wake_up(Guard::Alias, Variant::SilentRelease));
    negative_n17_a_gated_calls_end_forgets_to_notify:
        negative("n17_silent_gate_end", Bounds { property: "N17", ..NEG },
            "deadlock", || own_wake_up(Guard::GateEnd, Variant::SilentRelease));
}
