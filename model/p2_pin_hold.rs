//! P2 pin hold: while an engine holds pinning back
//! (`Pinning::hold`, its capture phase), no chunk registration
//! starts: at most the one in flight when the hold was taken completes;
//! capture windows meanwhile open without waiting for a registration; once
//! the hold drops, pinning goes on and ends Pinned, every chunk registered
//! once. A hold never holds up a cancel: with the hold still alive,
//! cancelling pinning (what a shutdown does first) ends pinning final.
//!
//! Registrations are counted by the simulated GPU
//! (`SimRuntime::registrations_completed`), not by the coordinator: read
//! after the hold was taken and again after a window opened and closed
//! under it, they differ by at most one (the registration that may have
//! been in flight, or admitted, when the hold was taken).
//!
//! Threads (3): the engine (main: takes the hold, opens and closes one
//! window, drops the hold or cancels), the pinner (`PinHandle`, 3 chunks,
//! `NoPrefault`), the sim's device thread. Preemption bound 3.
//!
//! Why it holds: `Pinning::register_chunk` waits under the
//! coordinator's lock while a hold lives and pinning is not cancelled,
//! before it is admitted as a capture-unsafe call; the check and the
//! admission are one critical section, so a hold taken before it sees the
//! registration waiting, and one taken after it sees it in flight (at most
//! one, since the pinner registers one chunk at a time). While held back it
//! is not counted as a waiting library call, so it takes no window's turn.
//! `cancel_pinning` sets `cancel_pin` under the lock and wakes every
//! waiter, which ends the hold's effect.
//!
//! Negative: N31 (`PinIgnoresHold`: registrations ignore the holds): more
//! than one registration completes under the hold.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{fixture, models, Bounds};
use kvoffload::internal::pin::{NoPrefault, PinHandle};
use kvoffload::internal::protocol::Variant;
use kvoffload::{CapturePolicy, PageableReason, PinState, Request};

const B: Bounds = Bounds { property: "P2", threads: 3, preemptions: 3, ci: None };

/// The capture phase under a hold; `cancel`: a shutdown's cancel with the
/// hold still alive instead of the hold's drop.
fn scenario(variant: Variant, cancel: bool) {
    let f = fixture(CapturePolicy::Interleave, variant, 3, 64);
    let rt = f.rt.clone();
    let pin = PinHandle::spawn(rt.clone(), f.coord.clone(), NoPrefault::shared());
    let hold = f.coord.pinning().hold();
    let at_hold = f.sim().registrations_completed();
    // A capture under the hold: its window opens and closes.
    drop(f.coord.open_window(Request::new()).unwrap());
    let after = f.sim().registrations_completed();
    assert!(after - at_hold <= 1, "{} registrations completed under a pin hold", after - at_hold);
    if cancel {
        f.coord.pinning().cancel();
        let state = pin.join();
        assert!(
            state == PinState::Pinned || state == PinState::Pageable(PageableReason::Cancelled),
            "cancelled under a hold: {state:?}"
        );
        drop(hold);
    } else {
        drop(hold);
        assert_eq!(pin.join(), PinState::Pinned);
        assert_eq!(f.sim().registrations_completed(), 3, "the driver registered other than once per chunk");
    }
    f.coord.pinning().unregister_all(rt.as_ref()).unwrap();
}

models! {
    p2_pin_hold_keeps_registrations_out_of_the_capture_phase:
        check("p2_pin_hold", B, || scenario(Variant::Production, false));
    p2_pin_hold_gives_way_to_a_cancel:
        check("p2_pin_hold_cancel", B, || scenario(Variant::Production, true));
    negative_n31_pin_ignores_hold:
        negative("n31_pin_ignores_hold", Bounds { property: "N31", ..B },
            "registrations completed under a pin hold", || scenario(Variant::PinIgnoresHold, false));
}
