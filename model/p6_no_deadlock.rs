//! P6 no deadlock: pinning (Interleave policy, so it really overlaps), a
//! capture window inside which the engine asks for the pin state and for a
//! capture-unsafe call, a transfer job, and shutdown all terminate in
//! every explored interleaving (loom reports a deadlock otherwise).
//!
//! Threads (4): the engine (main: window, capture, then shutdown), the
//! pinner (2 chunks), a library thread owning a real `TransferEngine`
//! (one store of one 16-byte block, per-fragment copies: refused because
//! the window is open or shutdown began, or submitted, waited for with
//! `TransferEngine::wait` and reported by `poll_finished`, which releases
//! its admission ticket; then the engine is dropped), the sim's device
//! thread. Preemption bound 2.
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

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{engine, fixture, models, Bounds};
use kvoffload::internal::pin::{NoPrefault, PinHandle};
use kvoffload::internal::protocol::{shutdown, Variant};
use kvoffload::internal::sync::thread;
use kvoffload::internal::transfer::JobBlocks;
use kvoffload::{Backend, BackendChoice, JobId, Request, TransferError};
use kvoffload::{CaptureMode, CapturePolicy, ProtocolError};

fn scenario(variant: Variant) {
    let f = fixture(CapturePolicy::Interleave, variant, 2, 64);
    let rt = f.rt.clone();
    let s = rt.stream_create().unwrap();
    let d = f.coord.unsafe_call("alloc", Request::new(), |g| rt.mem_alloc(g, 64)).unwrap().unwrap();
    let (eng, _dev) = engine(&f, 2, 16, 4, BackendChoice::Force(Backend::PerFragment));
    let pin = PinHandle::spawn(rt.clone(), f.coord.clone(), NoPrefault::shared());
    let jc = f.coord.clone();
    let job = thread::spawn(move || {
        match eng.store(JobId(1), &JobBlocks::single(vec![0], vec![0])) {
            Ok(()) => {
                // Blocking waits, no spinning: `wait` (gated) until the job
                // completed, then `poll_finished`, which reports it unless
                // a window is open, in which case wait for the window.
                let mut seen = Vec::new();
                while seen.is_empty() {
                    eng.wait(JobId(1)).unwrap();
                    seen.extend(eng.poll_finished());
                    if seen.is_empty() {
                        jc.wait_no_window(Request::new(), None).unwrap();
                    }
                }
            }
            Err(TransferError::ShutDown { .. }) | Err(TransferError::CaptureWindowOpen { .. }) => {}
            Err(e) => panic!("submit failed: {e}"),
        }
    });

    let w = f.coord.open_window(Request::new()).unwrap();
    match f.coord.pinning().wait_final(Request::new()) {
        Ok(_) | Err(ProtocolError::WouldDeadlock { .. }) => {}
        Err(e) => panic!("unexpected {e}"),
    }
    assert!(matches!(
        f.coord.unsafe_call("inside window", Request::new(), |_| ()),
        Err(ProtocolError::WouldDeadlock { .. })
    ));
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

const B: Bounds = Bounds { property: "P6", threads: 4, preemptions: 2, ci: None };

models! {
    p6_pin_capture_jobs_shutdown_terminate:
        check("p6_no_deadlock", B, || scenario(Variant::Production));
    negative_n6_wait_for_pinning_inside_window:
        negative("n6_wait_inside_window", Bounds { property: "N6", ..B },
            "deadlock; threads", || scenario(Variant::WaitInsideWindow));
}
