//! P2 pin before capture.
//!
//! - AfterPinning (default policy): every capture window opens only after
//!   pinning reached a final state, and no registration is running in the
//!   driver during the window.
//! - Interleave: a window may open during pinning; while it is open no
//!   registration runs, the pinner resumes after it closes (pinning still
//!   ends Pinned), and the window waited for at most one chunk.
//!
//! Registrations are counted by the simulated GPU (successful
//! `cuMemHostRegister` calls, `SimRuntime::registrations_completed`), not
//! by the coordinator: the count when the window asks to open (read under
//! the coordinator's lock at that moment, by the hook of
//! `Request::noting`, loom builds only) and when it has opened differ by at most one; the
//! count does not change while the window is open; the driver registered
//! exactly 3 times for the 3 chunks. With AfterPinning the driver has
//! completed all 3 when the window opens. A second window, opened as soon
//! as the first closes, opens too (no library call need come between).
//!
//! Threads (3): the engine (main) opening one window and capturing in
//! GLOBAL mode, the pinner (`PinHandle`, 3 chunks), the sim's device thread.
//! Preemption bound 3.
//!
//! Why it holds: `Coordinator::open_window` waits, under the coordinator's
//! lock, for `unsafe_in_flight == 0` and (AfterPinning) for a final pin
//! state; the pinner's registrations go through `unsafe_call`, which does
//! not start while a window is open or while a window that could open is
//! waiting. So at most the one registration already in flight when the
//! window asked completes before it opens.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{models, pinning_under, waited_at_most_one, window_counting_registrations, Bounds};
use kvoffload::{CaptureMode, CapturePolicy, PinState, Request};

fn scenario(policy: CapturePolicy) {
    let (f, rt, s, d, pin) = pinning_under(policy);

    let (w, at_request, at_open) = window_counting_registrations(&f, Request::new());
    let state = f.coord.pinning().state();
    match policy {
        CapturePolicy::AfterPinning => {
            assert!(state.is_final(), "window opened while pinning: {state:?}");
            assert_eq!(at_open, 3, "window opened before the driver completed every registration");
        }
        CapturePolicy::Interleave => waited_at_most_one("window", at_request, at_open),
    }
    assert_eq!(f.sim().registers_running(), 0, "registration running inside the window");
    rt.begin_capture(s, CaptureMode::Global).unwrap();
    // SAFETY: `d` is a 64-byte allocation of the sim, never freed; the
    // memset is only captured.
    unsafe { rt.memset_d8_async(d, 0, 64, s) }.unwrap();
    assert_eq!(f.sim().registers_running(), 0, "registration running inside the window");
    assert!(rt.end_capture(s).is_ok(), "capture invalidated");
    assert_eq!(f.sim().registrations_completed(), at_open, "a registration completed inside the window");
    drop(w);
    // A second window right after the first: it opens too, whether or not a
    // library call came between (closing a window gives library calls the
    // turn; with none waiting, the next window must not wait for one).
    drop(f.coord.open_window(Request::new()).unwrap());

    assert_eq!(pin.join(), PinState::Pinned);
    assert_eq!(f.sim().registrations_completed(), 3, "the driver registered other than once per chunk");
    f.coord.pinning().unregister_all(rt.as_ref()).unwrap();
}

models! {
    p2_after_pinning_windows_wait_for_final_state:
        check("p2_after_pinning", Bounds { property: "P2", threads: 3, preemptions: 3, ci: None }.ci_at(2),
            || scenario(CapturePolicy::AfterPinning));
    p2_interleave_window_waits_at_most_one_chunk:
        check("p2_interleave", Bounds { property: "P2", threads: 3, preemptions: 3, ci: None },
            || scenario(CapturePolicy::Interleave));
}
