//! Sim rule S1 (docs/driver-rules.md section 1, rows "cuMemHostRegister", default and
//! relaxed columns; ordering effect "register running, then begin_capture
//! blocks"): in every interleaving of a register on thread B with a GLOBAL
//! capture on thread A, the simulated GPU either
//! - lets the register finish before the capture begins (begin_capture
//!   waits for a running register), or after it ended: both succeed; or
//! - refuses the register inside the capture window with 900 and
//!   invalidates the capture, which then ends with 901 and no graph.
//!
//! Never both "register succeeded inside the window" and "capture ok".
//! With B in RELAXED mode, both always succeed.
//!
//! Threads: A (the model's main thread), B, and the sim's device thread: 3.
//! Preemption bound 3. It holds because the sim applies the capture rules
//! and the registration count under one lock (`rules::check` and
//! `registers_running` in src/runtime/sim), so the window is a single
//! critical-section boundary that every interleaving falls on one side of.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{models, Bounds};
use kvoffload::internal::protocol::Coordinator;
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::{CaptureMode, CapturePolicy, Code, GpuRuntime, Request, SimRuntime};

static HOST: [u8; 64] = [0; 64];

fn scenario(relaxed: bool) {
    let sim = Arc::new(SimRuntime::new());
    // The runtime's capture-unsafe calls take a gate: here from a
    // coordinator with no region that A's capture does not go through (no
    // window), so B's register reaches the sim during the capture, which is
    // the rule this model checks.
    let coord = Coordinator::without_region(&*sim, CapturePolicy::AfterPinning).unwrap();
    let s = sim.stream_create().unwrap();
    let d = coord.unsafe_call("alloc", Request::new(), |g| sim.mem_alloc(g, 64)).unwrap().unwrap();
    let addr = HOST.as_ptr() as usize;
    let (b_sim, b_coord) = (sim.clone(), coord.clone());
    let b = thread::spawn(move || {
        if relaxed {
            b_sim.exchange_capture_mode(CaptureMode::Relaxed).unwrap();
        }
        b_coord
            .unsafe_call("B's register", Request::new(), |g| {
                // SAFETY: HOST is a static, mapped for the whole program; the
                // sim never writes registered memory on registration.
                unsafe { b_sim.host_register(g, addr, HOST.len()) }
            })
            .unwrap()
    });
    sim.begin_capture(s, CaptureMode::Global).unwrap();
    // SAFETY: `d` is a 64-byte allocation of the sim, never freed; the
    // memset is only captured.
    let enq = unsafe { sim.memset_d8_async(d, 1, 64, s) };
    let end = sim.end_capture(s);
    let reg = b.join().unwrap();

    let refused = matches!(&reg, Err(e) if e.code == Code::STREAM_CAPTURE_UNSUPPORTED);
    let invalidated = matches!(&end, Err(e) if e.code == Code::STREAM_CAPTURE_INVALIDATED);
    assert!(reg.is_ok() || refused, "register failed otherwise: {reg:?}");
    assert_eq!(refused, invalidated, "register {reg:?} but capture end {end:?}");
    if relaxed {
        assert!(reg.is_ok() && end.is_ok(), "relaxed B must never disturb A: {reg:?} {end:?}");
    }
    if refused {
        assert!(enq.is_ok() || matches!(&enq, Err(e) if e.code == Code::STREAM_CAPTURE_INVALIDATED));
    } else {
        coord.unsafe_call("unregister", Request::new(), |g| sim.host_unregister(g, addr)).unwrap().unwrap();
    }
}

models! {
    register_during_global_capture_invalidates_it:
        check("capture_invalidation/default", Bounds { property: "S1", threads: 3, preemptions: 3, ci: None },
            || scenario(false));
    relaxed_register_never_disturbs_capture:
        check("capture_invalidation/relaxed", Bounds { property: "S1", threads: 3, preemptions: 3, ci: None },
            || scenario(true));
}
