//! P6 no deadlock: pinning (Interleave policy, so it really overlaps), a
//! capture window inside which the engine asks for the pin state and for a
//! capture-unsafe call, a transfer-like job, and shutdown all terminate in
//! every explored interleaving (loom reports a deadlock otherwise).
//!
//! Threads (4): the engine (main: window, capture, then shutdown), the
//! pinner (2 chunks), a job thread (admit, one gated call, done), the sim's
//! device thread. Preemption bound 2.
//!
//! Why it holds: every wait in the coordinator is for a condition that the
//! other parties establish without needing anything the waiter holds,
//! except two, which are refused with a typed error instead of waiting:
//! waiting for pinning inside one's own window (the pinner is paused by
//! that window) and a gated capture-unsafe call inside one's own window.
//! Shutdown waits for jobs (which never wait for shutdown) and for the
//! pinner (which stops at the next chunk boundary once cancelled).
//!
//! Negative N6: waiting for pinning inside an open window is allowed; loom
//! finds the deadlock. It declares loom's own message ("deadlock; threads =
//! [..]"), not just "deadlock", which `ProtocolError::WouldDeadlock`'s text
//! ("... would deadlock") also contains.

#![cfg(loom)]

#[path = "common/mod.rs"]
mod common;

use common::{check, fixture, negative, Bounds};
use kvoffload::pin::{NoPrefault, PinHandle};
use kvoffload::protocol::{shutdown, CapturePolicy, ProtocolError, Variant};
use kvoffload::runtime::CaptureMode;
use kvoffload::sync::thread;

fn scenario(variant: Variant) {
    let f = fixture(CapturePolicy::Interleave, variant, 2, 64);
    let rt = f.rt.clone();
    let s = rt.stream_create().unwrap();
    let d = f.coord.unsafe_call("alloc", |g| rt.mem_alloc(g, 64)).unwrap().unwrap();
    let pin = PinHandle::spawn(rt.clone(), f.coord.clone(), NoPrefault::shared());
    let (jc, jrt) = (f.coord.clone(), rt.clone());
    let job = thread::spawn(move || {
        if let Ok(ticket) = jc.admit_job() {
            let _ = jc.unsafe_call("job sync", |g| jrt.ctx_synchronize(g));
            drop(ticket);
        }
    });

    let w = f.coord.open_window().unwrap();
    match f.coord.wait_pin_final() {
        Ok(_) | Err(ProtocolError::WouldDeadlock { .. }) => {}
        Err(e) => panic!("unexpected {e}"),
    }
    assert!(matches!(f.coord.unsafe_call("inside window", |_| ()), Err(ProtocolError::WouldDeadlock { .. })));
    rt.begin_capture(s, CaptureMode::Global).unwrap();
    // SAFETY: `d` is a 64-byte allocation of the sim, never freed; the
    // memset is only captured.
    unsafe { rt.memset_d8_async(d, 0, 64, s) }.unwrap();
    rt.end_capture(s).unwrap();
    drop(w);

    shutdown(rt.as_ref(), &f.coord, move || {
        pin.join();
    })
    .unwrap();
    job.join().unwrap();
    assert_eq!(f.sim().registered_ranges(), 0);
}

const B: Bounds = Bounds { property: "P6", threads: 4, preemptions: 2 };

#[test]
fn p6_pin_capture_jobs_shutdown_terminate() {
    check("p6_no_deadlock", B, || scenario(Variant::Production));
}

#[test]
#[ignore = "negative model: run by ci/prove, must fail"]
fn negative_n6_wait_for_pinning_inside_window() {
    negative("n6_wait_inside_window", Bounds { property: "N6", ..B }, "deadlock; threads", || {
        scenario(Variant::WaitInsideWindow)
    });
}
