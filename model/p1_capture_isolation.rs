//! P1 capture isolation: no library thread makes a capture-unsafe driver
//! call (register, event query, ...) in a non-relaxed mode while a GLOBAL
//! capture is open. Observable: the simulated GPU never invalidates the
//! engine's capture because of the library.
//!
//! Threads (4): the engine (main) opens a capture window and captures in
//! GLOBAL mode; the pinner (`PinHandle`, 2 chunks, Interleave policy, so
//! pinning really overlaps the window); a completion poller making one
//! gated event query (`Coordinator::try_unsafe_call`); the sim's device
//! thread. Preemption bound 3 (the negatives below run at 2, which loom
//! explores as a subset of 3: each is caught there already).
//!
//! Why it holds: every capture-unsafe library call runs inside
//! `Coordinator::unsafe_call`/`try_unsafe_call`, which start only while no
//! window is open, and a window opens only when no such call is in flight;
//! both checks and the counters they read sit under one mutex, so a call
//! and a window never overlap. The engine begins its capture only inside
//! the window.
//!
//! The simulated GPU default-denies: any call without a measured row made
//! during the engine's GLOBAL capture would be refused and invalidate it
//! (src/runtime/sim/rules.rs), so the model also shows the library makes no
//! unmeasured call during a capture.
//!
//! Negatives: N1 (upstream's design: no capture window) and N3 (the poller
//! queries without the gate) are this scenario with one knob changed; loom
//! finds an interleaving where the sim invalidates the capture. N8: the
//! poller makes its query with a forged gate (`Gate::forged`, loom builds
//! only: the type system forbids this in library code); the sim knows the
//! gate is not in flight and stops the model with "capture-unsafe call
//! outside the gate: cuEventQuery", in the first interleaving, whether or
//! not a capture is open then.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{capture_memset, fixture, models, Bounds};
use kvoffload::internal::pin::{NoPrefault, PinHandle};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::thread;
use kvoffload::Request;
use kvoffload::{CaptureMode, CapturePolicy, PinState};

fn scenario(variant: Variant) {
    scenario_with(variant, false)
}

/// `forged`: the poller bypasses the coordinator with a forged gate (N8).
fn scenario_with(variant: Variant, forged: bool) {
    let f = fixture(CapturePolicy::Interleave, variant, 2, 64);
    let rt = f.rt.clone();
    let s = rt.stream_create().unwrap();
    let d = f.coord.unsafe_call("alloc", Request::new(), |g| rt.mem_alloc(g, 64)).unwrap().unwrap();
    let poll_stream = rt.stream_create().unwrap();
    let e = rt.event_create().unwrap();
    rt.event_record(e, poll_stream).unwrap();

    let pin = PinHandle::spawn(rt.clone(), f.coord.clone(), NoPrefault::shared());
    let (prt, pcoord) = (rt.clone(), f.coord.clone());
    let poller = thread::spawn(move || {
        if forged {
            return Ok(prt.event_query(&pcoord.forged_gate(), e).is_ok());
        }
        pcoord.try_unsafe_call(|g| prt.event_query(g, e)).map(|r| r.is_ok())
    });

    let w = f.coord.open_window(Request::new()).unwrap();
    // SAFETY: `d` is a 64-byte allocation of the sim, never freed; the
    // memset is only captured.
    let (enq, end) = unsafe { capture_memset(rt.as_ref(), s, CaptureMode::Global, d, 0, 64) };
    drop(w);

    let polled = poller.join().unwrap();
    let pinned = pin.join();
    assert!(end.is_ok() && enq.is_ok(), "capture invalidated by a library call: enqueue {enq:?}, end {end:?}");
    assert_eq!(pinned, PinState::Pinned, "pinning failed: {pinned:?}");
    if let Ok(ok) = polled {
        assert!(ok, "gated event query failed");
    }
    f.coord.pinning().unregister_all(rt.as_ref()).unwrap();
}

const B: Bounds = Bounds { property: "P1", threads: 4, preemptions: 3, ci: None };

/// The negatives run at bound 2: every interleaving of bound 2 is also one
/// of bound 3, so a failure found there is found at 3 (N1 at bound 3 took
/// 436k interleavings and 39 s before its failure; at 2 it takes about 1 s).
const NEG: Bounds = Bounds { preemptions: 2, ..B };

models! {
    p1_library_calls_never_invalidate_capture:
        check("p1_capture_isolation", B.ci_at(2), || scenario(Variant::Production));
    negative_n1_upstream_background_pin_without_window:
        negative("n1_no_capture_window", Bounds { property: "N1", ..NEG },
            "capture invalidated", || scenario(Variant::NoCaptureWindow));
    negative_n3_poller_queries_during_capture:
        negative("n3_ungated_poller", Bounds { property: "N3", ..NEG },
            "capture invalidated", || scenario(Variant::UngatedPoller));
    negative_n8_capture_unsafe_call_with_a_forged_gate:
        negative("n8_forged_gate", Bounds { property: "N8", ..NEG },
            "capture-unsafe call outside the gate: cuEventQuery", || scenario_with(Variant::Production, true));
}
