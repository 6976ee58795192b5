//! P2 for the capture hook's window: `Coordinator::open_window` with
//! `Request::interleaved`
//! (what `CaptureHook::begin` opens at depth 0) on a coordinator
//! whose policy is AfterPinning (the default): the window opens while
//! pinning runs, having waited for at most one registration, no
//! registration runs or completes while it is open, the pinner resumes
//! after it closes and pinning still ends Pinned; a window of the
//! coordinator's own policy asked for right after still waits for the
//! final state (the hook's rule is per request, not a change of policy).
//!
//! Registrations are counted by the simulated GPU, as in
//! model/p2_pin_before_capture.rs: the count when the window asks to open
//! (under the coordinator's lock, by the hook of `Request::noting`, loom
//! builds only) and when it opened differ by at most one.
//!
//! Threads (3): the engine (main) opening the hook's window and capturing
//! in GLOBAL mode, the pinner (`PinHandle`, 3 chunks), the sim's device
//! thread. Preemption bound 3.
//!
//! Why it holds: an interleaved request is counted in
//! `interleave_waiting`; it may open once no library call is in flight and
//! the turn is the windows' (whatever the policy), and while it waits
//! library calls start only on their turn, which each call's end gives to
//! the windows: so at most the registration already in flight, or one
//! started on the library's turn before the request, completes first.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{models, pinning_under, waited_at_most_one, window_counting_registrations, Bounds};
use kvoffload::{CaptureMode, CapturePolicy, PinState, Request};

fn scenario() {
    let (f, rt, s, d, pin) = pinning_under(CapturePolicy::AfterPinning);

    let (w, at_request, at_open) = window_counting_registrations(&f, Request::new().interleaved());
    waited_at_most_one("the hook's window", at_request, at_open);
    assert_eq!(f.sim().registers_running(), 0, "registration running inside the window");
    rt.begin_capture(s, CaptureMode::Global).unwrap();
    // SAFETY: `d` is a 64-byte allocation of the sim, never freed; the
    // memset is only captured.
    unsafe { rt.memset_d8_async(d, 0, 64, s) }.unwrap();
    assert!(rt.end_capture(s).is_ok(), "capture invalidated");
    assert_eq!(f.sim().registrations_completed(), at_open, "a registration completed inside the window");
    drop(w);
    // The coordinator's own policy still holds for its other windows.
    let after = f.coord.open_window(Request::new()).unwrap();
    assert!(f.coord.pinning().state().is_final(), "an AfterPinning window opened while pinning");
    assert_eq!(f.sim().registrations_completed(), 3);
    drop(after);

    assert_eq!(pin.join(), PinState::Pinned);
    f.coord.pinning().unregister_all(rt.as_ref()).unwrap();
}

models! {
    p2_hook_window_waits_at_most_one_chunk_under_after_pinning:
        check("p2_hook_interleave", Bounds { property: "P2", threads: 3, preemptions: 3, ci: None }.ci_at(2), scenario);
}
