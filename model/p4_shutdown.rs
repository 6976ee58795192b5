//! P4 shutdown safety: nothing is unregistered or unmapped while a transfer
//! touching it is in flight, while a graph that references it exists, or
//! while a capture is open; shutdown during pinning stops at a chunk
//! boundary and rolls back; shutdown terminates.
//!
//! Four scenarios, each with the sim's device thread:
//! - during pinning (3 threads: shutdown on main, the pinner with 3
//!   chunks). `shutdown`'s `join_pinner` does not join the pinner, so
//!   what keeps a registration from outliving shutdown is the
//!   coordinator's own wait for pinning to settle: when shutdown returns,
//!   the simulated GPU holds no registration, and none appears after (the
//!   pinner is joined only then). Negative N10 (`ShutdownSkipsPinWait`)
//!   drops that wait: caught ("left registered after shutdown").
//! - with a job in flight (3 threads: shutdown on main; a library thread
//!   that submits one store through the real `TransferEngine` (one 16-byte
//!   block, per-fragment copies), waits for it (`TransferEngine::wait`),
//!   checks that the region was not unmapped, and polls until it is
//!   reported, which releases its admission ticket; "unmapped" is set by
//!   main once shutdown returned). Negative N2 drops the drain: caught.
//! - racing a window and a capture (3 threads: the engine on main opens a
//!   window, captures in GLOBAL mode and ends the capture, or is refused
//!   because shutdown began; shutdown on another thread, retried by main
//!   if it was refused because the window was open): the capture always
//!   ends with a graph and the region ends unregistered. Negative N12 is a
//!   model-local bad engine that captures without taking a window: loom
//!   finds shutdown's unregister invalidating the capture.
//! - with a live graph (3 threads: the engine on main captured a graph that
//!   copies from the region and registered it; shutdown on another thread;
//!   the engine replays the graph, destroys it, releases the token, and
//!   retries shutdown if it was refused). Negative N5 ignores the graph:
//!   the replay after unregister poisons the context (docs/driver-rules.md,
//!   719).
//!
//! Preemption bound 4 (the negatives run at 3, a subset of the
//! interleavings of 4: each is caught there already). Why it holds: `ShutdownSteps::begin` decides, under the
//! coordinator's lock, to refuse (window open, graphs alive) or to flip to
//! ShuttingDown, after which `admit_job`, `open_window` and
//! `register_graph` refuse; it then waits until every job ticket is dropped
//! and pinning is final; only then does `shutdown` unregister.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{capture_memset, engine, fixture, models, Bounds};
use kvoffload::internal::pin::{pin_all, NoPrefault, PinHandle};
use kvoffload::internal::protocol::{shutdown, ChunkReg, Variant};
use kvoffload::internal::sync::atomic::{AtomicBool, Ordering};
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::internal::transfer::JobBlocks;
use kvoffload::{Backend, BackendChoice, JobId, Request, TransferError};
use kvoffload::{CaptureMode, CapturePolicy, PinState, ProtocolError, ShutdownError};

const B: Bounds = Bounds { property: "P4", threads: 3, preemptions: 4, ci: None };

/// The negatives run at bound 3: every interleaving of bound 3 is also one
/// of bound 4, so a failure found there is found at 4.
const NEG: Bounds = Bounds { preemptions: 3, ..B };

fn during_pinning(variant: Variant) {
    let f = fixture(CapturePolicy::AfterPinning, variant, 3, 64);
    let pin = PinHandle::spawn(f.rt.clone(), f.coord.clone(), NoPrefault::shared());
    // `join_pinner` does not join: the coordinator's own waits must keep
    // every registration from outliving shutdown.
    // Its result is checked last: a shutdown that did not wait for pinning
    // may also fail to unregister a chunk whose registration is in flight
    // (shuttle finds that schedule), and what must be shown is the chunk
    // it leaves registered.
    let down = shutdown(f.rt.as_ref(), &f.coord, || {});
    assert_eq!(f.sim().registered_ranges(), 0, "chunk left registered after shutdown returned");
    pin.join();
    assert_eq!(f.sim().registered_ranges(), 0, "chunk left registered after shutdown (pinner joined since)");
    down.expect("shutdown failed");
    assert!(f.coord.pinning().state().is_final());
    for i in 0..3 {
        assert_eq!(f.coord.pinning().chunk_reg(i), Some(ChunkReg::Unregistered), "chunk {i} left registered");
    }
}

fn with_job(variant: Variant) {
    let f = fixture(CapturePolicy::AfterPinning, variant, 1, 64);
    let rt = f.rt.clone();
    assert_eq!(pin_all(rt.as_ref(), &f.coord, &NoPrefault), PinState::Pinned);
    let (eng, _dev) = engine(&f, 1, 16, 4, BackendChoice::Force(Backend::PerFragment));
    let unmapped = Arc::new(AtomicBool::new(false));
    let ju = unmapped.clone();
    let job = thread::spawn(move || {
        match eng.store(JobId(1), &JobBlocks::single(vec![0], vec![0])) {
            Ok(()) => {
                eng.wait(JobId(1)).unwrap();
                // "unmapped" is the model's stand-in for munmap, set once
                // shutdown returned: the store's copy into the region has
                // completed, and its ticket is still held.
                assert!(!ju.load(Ordering::SeqCst), "transfer in flight after the region was unmapped");
                let mut seen = Vec::new();
                while seen.is_empty() {
                    seen.extend(eng.poll_finished());
                    thread::yield_now();
                }
                assert!(seen[0].error.is_none(), "job failed: {seen:?}");
            }
            Err(TransferError::ShutDown { .. }) => {}
            Err(e) => panic!("submit failed: {e}"),
        }
    });
    shutdown(rt.as_ref(), &f.coord, || {}).unwrap();
    unmapped.store(true, Ordering::SeqCst);
    job.join().unwrap();
    assert_eq!(f.sim().registered_ranges(), 0);
    // The region was pinned: every copy of a job admitted before shutdown
    // ran on registered memory, so shutdown unregistered only after them.
    assert_eq!(f.sim().pageable_copies(), 0, "a job copied the region after shutdown unregistered it");
}

/// `windowed`: the engine captures inside a capture window, as it must;
/// false is N12's bad engine.
fn racing_a_capture(windowed: bool) {
    let f = fixture(CapturePolicy::AfterPinning, Variant::Production, 1, 64);
    let rt = f.rt.clone();
    assert_eq!(pin_all(rt.as_ref(), &f.coord, &NoPrefault), PinState::Pinned);
    let s = rt.stream_create().unwrap();
    let d = f.coord.unsafe_call("alloc", Request::new(), |g| rt.mem_alloc(g, 64)).unwrap().unwrap();
    let (sc, srt) = (f.coord.clone(), rt.clone());
    let sh = thread::spawn(move || shutdown(srt.as_ref(), &sc, || {}));
    let w = if windowed { f.coord.open_window(Request::new()).map(Some) } else { Ok(None) };
    match w {
        Ok(w) => {
            // SAFETY: `d` is a 64-byte allocation of the sim, never freed.
            let (enq, end) = unsafe { capture_memset(rt.as_ref(), s, CaptureMode::Global, d, 0, 64) };
            drop(w);
            assert!(enq.is_ok() && end.is_ok(), "capture invalidated during shutdown: enqueue {enq:?}, end {end:?}");
            rt.graph_destroy(end.unwrap()).unwrap();
        }
        Err(ProtocolError::ShutDown) => {}
        Err(e) => panic!("open_window failed: {e}"),
    }
    match sh.join().unwrap() {
        Ok(()) => {}
        Err(ShutdownError::Refused(ProtocolError::WindowOpen { .. })) => {
            shutdown(rt.as_ref(), &f.coord, || {}).unwrap();
        }
        Err(e) => panic!("shutdown failed: {e}"),
    }
    assert_eq!(f.sim().registered_ranges(), 0);
    assert!(matches!(f.coord.open_window(Request::new()), Err(ProtocolError::ShutDown)));
}

fn with_graph(variant: Variant) {
    let f = fixture(CapturePolicy::AfterPinning, variant, 1, 64);
    let rt = f.rt.clone();
    assert_eq!(pin_all(rt.as_ref(), &f.coord, &NoPrefault), PinState::Pinned);
    let s = rt.stream_create().unwrap();
    let d = f.coord.unsafe_call("alloc", Request::new(), |g| rt.mem_alloc(g, 64)).unwrap().unwrap();
    let w = f.coord.open_window(Request::new()).unwrap();
    rt.begin_capture(s, CaptureMode::Global).unwrap();
    // SAFETY: leaked region memory, alive for the whole model.
    unsafe { rt.copy_htod_async(d, f.base, 64, s) }.unwrap();
    let graph = rt.end_capture(s).unwrap();
    let token = f.coord.register_graph().unwrap();
    drop(w);

    let (sc, srt) = (f.coord.clone(), rt.clone());
    let sh = thread::spawn(move || shutdown(srt.as_ref(), &sc, || {}));
    // The engine waits for its replay through the gate, as production does.
    let replay = rt
        .graph_launch(graph, s)
        .and_then(|_| f.coord.unsafe_call("replay sync", Request::new(), |g| rt.stream_synchronize(g, s)).unwrap());
    assert!(replay.is_ok(), "context poisoned: replay of a live graph gave {replay:?}");
    rt.graph_destroy(graph).unwrap();
    drop(token);
    match sh.join().unwrap() {
        Ok(()) => {}
        Err(ShutdownError::Refused(ProtocolError::GraphsAlive { .. })) => {
            shutdown(rt.as_ref(), &f.coord, || {}).unwrap();
        }
        Err(e) => panic!("shutdown failed: {e}"),
    }
    assert!(f.sim().poisoned().is_none(), "context poisoned");
    assert_eq!(f.sim().registered_ranges(), 0);
}

models! {
    p4_shutdown_during_pinning_rolls_back:
        check("p4_during_pinning", B, || during_pinning(Variant::Production));
    // Two ways the bug shows: a registration completing after shutdown
    // returned (loom finds this one first), or shutdown's unregister racing
    // a registration still in flight and failing (shuttle finds both).
    negative_n10_shutdown_does_not_wait_for_pinning:
        negative("n10_no_pin_wait", Bounds { property: "N10", ..NEG },
            "left registered after shutdown || shutdown failed: Unregister",
            || during_pinning(Variant::ShutdownSkipsPinWait));
    p4_shutdown_races_a_window_and_a_capture:
        check("p4_racing_a_capture", B, || racing_a_capture(true));
    negative_n12_engine_captures_without_a_window:
        negative("n12_capture_without_window", Bounds { property: "N12", ..NEG },
            "capture invalidated", || racing_a_capture(false));
    p4_shutdown_drains_jobs_before_unmap:
        check("p4_with_job", B, || with_job(Variant::Production));
    negative_n2_unregister_before_draining_transfers:
        negative("n2_no_drain", Bounds { property: "N2", ..NEG },
            "after the region was unmapped", || with_job(Variant::NoDrainBeforeUnregister));
    negative_n24_unregister_before_the_drain:
        negative("n24_unregister_first", Bounds { property: "N24", ..NEG },
            "after shutdown unregistered it", || with_job(Variant::UnregisterBeforeDrain));
    p4_shutdown_waits_for_graphs:
        check("p4_with_graph", B, || with_graph(Variant::Production));
    negative_n5_unregister_while_graph_references_region:
        negative("n5_ignore_graphs", Bounds { property: "N5", ..NEG },
            "context poisoned", || with_graph(Variant::IgnoreLiveGraphs));
}
