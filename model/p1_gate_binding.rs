//! P1 across coordinators: a runtime handle refuses another coordinator's
//! gate.
//!
//! Property: a capture-unsafe call reaches a runtime handle only under a
//! gate of the coordinator bound to that handle, so no other coordinator's
//! call ever invalidates a capture on it.
//!
//! Scenario: one simulated device, two runtime handles on it (the first,
//! and `SimRuntime::another_handle`), each bound to a coordinator of its
//! own (`Coordinator::without_region`, Interleave policy: nothing to pin).
//! The engine of the first (main) opens its coordinator's window, captures
//! a memset on its stream in GLOBAL mode and ends the capture. Concurrently
//! a thread of the second coordinator makes, inside that coordinator's gate
//! (`unsafe_call`), a capture-unsafe call on the *first* handle
//! (`cuMemAlloc`), then a legitimate one on its own handle (`cuMemAlloc`
//! again, in RELAXED mode: see below). Checked in every interleaving: the
//! capture ends with a graph and the simulated GPU refused nothing (no call
//! reached the capture); the call on the first handle was refused with
//! `GATE_REFUSED`; the call on its own handle was admitted (the refusal is
//! of the other coordinator's gate, not of every call); after the window
//! closed, the first coordinator's own gate is admitted on its handle.
//! Threads: main, the second coordinator's thread, the sim's device thread
//! (3); bound 3.
//!
//! What stands in for what: a second coordinator on the same device is what
//! a second offloader of the process (or a tool with a coordinator of its
//! own) holds; its legitimate calls on its own handle are not this
//! property's (its coordinator does not know the first one's windows), and
//! the simulated device applies one set of capture rules to all its handles
//! (stricter than two processes on a GPU), so the model makes that call in
//! RELAXED mode (`exchange_capture_mode`, measured safe during another
//! thread's capture), which the sim, like the driver, lets through beside
//! another thread's GLOBAL capture; the call on the first handle is made in
//! the default (GLOBAL) mode, where it would invalidate the capture.
//!
//! Negative: N27 (`Variant::BindingAdmitsAnyGate`, set on the first
//! coordinator: the binding of its handle admits every gate) -> "a capture
//! on the first handle was invalidated" (the call lands inside the capture)
//! or "a call under another coordinator's gate reached the first handle"
//! (it lands outside and succeeds), whichever the interleaving explored
//! first shows; both break the property.
//!
//! Why it holds: a gate names its coordinator and only the coordinator's
//! module can make one; the coordinator binds its handle's `GateBinding`
//! when it is made (a second coordinator for a bound handle is refused);
//! every capture-unsafe operation of the simulated GPU (and of the CUDA
//! runtime) asks `GateBinding::admits` before anything else and answers
//! `GATE_REFUSED` otherwise. So a call on the first handle runs only inside
//! the first coordinator's gate, which never overlaps its windows (P1).

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{capture_memset, models, Bounds};
use kvoffload::internal::protocol::{Coordinator, Variant};
use kvoffload::internal::sync::thread;
use kvoffload::{shared, CaptureMode, CapturePolicy, Code, Request, SimRuntime};

fn scenario(variant: Variant) {
    let first = SimRuntime::new();
    let second = shared(first.another_handle());
    let first = shared(first);
    let mine = Coordinator::without_region(first.as_ref(), CapturePolicy::Interleave).unwrap();
    let other = Coordinator::without_region(second.as_ref(), CapturePolicy::Interleave).unwrap();
    mine.set_variant(variant);
    let s = first.stream_create().unwrap();
    let d = mine.unsafe_call("the engine's scratch", Request::new(), |g| first.mem_alloc(g, 64)).unwrap().unwrap();

    let (rt1, rt2, other2) = (first.clone(), second.clone(), other.clone());
    let foreign = thread::spawn(move || {
        let cross = other2
            .unsafe_call("a call on another coordinator's handle", Request::new(), |g| rt1.mem_alloc(g, 64))
            .unwrap();
        let was = rt2.exchange_capture_mode(CaptureMode::Relaxed).unwrap();
        let own = other2.unsafe_call("a call on its own handle", Request::new(), |g| rt2.mem_alloc(g, 64)).unwrap();
        rt2.exchange_capture_mode(was).unwrap();
        (cross, own)
    });

    let w = mine.open_window(Request::new()).unwrap();
    // SAFETY: `d` is a 64-byte allocation of the sim, never freed; the
    // memset is only captured.
    let (enq, end) = unsafe { capture_memset(first.as_ref(), s, CaptureMode::Global, d, 0, 64) };
    drop(w);
    let (cross, own) = foreign.join().unwrap();

    let refusals = first.as_sim().unwrap().refusals();
    assert!(
        enq.is_ok() && end.is_ok() && refusals.is_empty(),
        "a capture on the first handle was invalidated: enqueue {enq:?}, end {end:?}, the sim refused {refusals:?}"
    );
    assert!(
        matches!(&cross, Err(e) if e.code == Code::GATE_REFUSED),
        "a call under another coordinator's gate reached the first handle: {cross:?}"
    );
    assert!(own.is_ok(), "the second coordinator's gate was refused on its own handle: {own:?}");
    let again = mine
        .unsafe_call("the engine's own call after its capture", Request::new(), |g| first.mem_alloc(g, 64))
        .unwrap();
    assert!(again.is_ok(), "the first coordinator's gate was refused on its own handle: {again:?}");
    first.graph_destroy(end.unwrap()).unwrap();
}

const B: Bounds = Bounds { property: "P1", threads: 3, preemptions: 3, ci: None };

models! {
    p1_gate_binding_another_coordinators_call_never_reaches_a_capture:
        check("p1_gate_binding", B, || scenario(Variant::Production));
    negative_n27_binding_admits_any_gate:
        negative("n27_binding_admits_any_gate", Bounds { property: "N27", ..B },
            "a capture on the first handle was invalidated || a call under another coordinator's gate reached the first handle",
            || scenario(Variant::BindingAdmitsAnyGate));
}
