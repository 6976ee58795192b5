//! P4 at the engine's edge: the `Offloader` itself (not its parts) on the
//! simulated GPU, as the core of a `KeyedOffloader` built by
//! `KeyedOffloader::with_allocated_tensors` and pinning in the background
//! (`Offloader::start`), as an engine uses it (the keyed calls `store`,
//! `load`, `stored_blocks` are the keyed layer's, the rest its core's).
//!
//! Three scenarios, each with the offloader's pinner (2 chunks, no
//! pre-fault), the sim's device thread and a thread that calls
//! `Offloader::shutdown`:
//! - **a live graph** (4 threads): the engine registered a graph token and
//!   has a store in flight while pinning runs; shutdown is called on
//!   another thread and must be refused (`GraphsAlive`) with nothing
//!   changed: pinning still ends Pinned, the store completes, a load of its
//!   key into another GPU block brings back its bytes, a window still
//!   opens, and once the token is
//!   dropped a later shutdown succeeds and the region ends unregistered.
//!   Offloader paths driven: `start`, `store`, `register_graph`, `shutdown`
//!   (refused, then done), `wait`, `wait_all`, `poll`, `load`,
//!   `capture_window`, `Drop` (after shutdown).
//! - **racing a window and a capture** (4 threads): shutdown on another
//!   thread while the engine opens a window (it waits for pinning, policy
//!   AfterPinning), captures a memset in GLOBAL mode and ends the capture;
//!   or is refused because shutdown began. If shutdown was refused because
//!   the window was open, the engine retries it after closing the window.
//!   Every capture ends with a graph, and the region ends unregistered.
//!   Paths: `start`, `gated`, `capture_window`, `shutdown` (concurrent,
//!   maybe refused, retried), `Drop`.
//!
//! - **jobs in flight while pinning runs** (4 threads): the engine has a
//!   store in flight and pinning running when shutdown is called on another
//!   thread; it succeeds, the store was applied (the key counted stored,
//!   nothing in flight), and nothing is left registered. Paths: `start`,
//!   `store`, `shutdown`, `in_flight`, `stored_blocks`. Negative N20
//!   (`Variant::OffloaderSkipsDrain`: the offloader does not poll its jobs
//!   to completion before it drops the transfer engine) is caught: "shutdown
//!   returned with a job not applied" (the engine's drop waits for the copy
//!   but its completion never reaches the block manager: the stored key is
//!   lost).
//!
//! Negative N15 (`Variant::TeardownBeforeRefusal`): `Offloader::shutdown`
//! in its earlier order, which tore the offloader down (closed it,
//! drained and dropped the transfer engine, freed its tensors) and asked
//! the coordinator only afterwards. Caught in the first scenario ("a
//! refused shutdown marked the offloader down": the later load would get
//! `ShutDown`, the retry `AlreadyShutDown`) and in the second ("a shutdown
//! retried after the window closed": a window that opened after the old
//! code's check made the coordinator refuse after the teardown, and the
//! retry gets `AlreadyShutDown`, the region staying registered).
//!
//! Why it holds: `Offloader::shutdown` first calls `ShutdownSteps::close`,
//! which in one critical section refuses (window open, graph alive) or
//! starts shutdown, after which windows, graphs and jobs are refused; only
//! then does it drain, drop the engine, wait for pinning and unregister.
//! Bound: preemption bound 2 (the scenarios have 4 threads each).

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::offloader::{keyed_on, lean, poll_n, read_block, sim, write_block, PAGE};
use common::{capture_memset, models, Bounds};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::{
    shared, BlockKey, CaptureMode, GpuRuntime, KeyedOffloader, OffloaderError, OffloaderOptions, PinState,
    ProtocolError, Request, SimRuntime,
};

/// An offloader of one KV tensor of 4 GPU blocks of 64 bytes and 2 host
/// blocks (two registration chunks), on a simulated GPU.
fn offloader(variant: Variant) -> (Arc<dyn GpuRuntime>, Arc<KeyedOffloader>) {
    let rt = shared(SimRuntime::new());
    let opts = lean(OffloaderOptions::with_host_blocks(2), Some(kvoffload::page_size()));
    (rt.clone(), Arc::new(keyed_on(rt, opts, variant)))
}

fn refused_with_a_live_graph(variant: Variant) {
    let (rt, off) = offloader(variant);
    write_block(off.core(), 0, 0x5a);
    off.core().start().unwrap();
    let token = off.core().register_graph().unwrap();
    let k = [BlockKey::new(1, 0)];
    off.store(&k, &[0]).unwrap();
    let o2 = off.clone();
    let refused = thread::spawn(move || o2.core().shutdown(Request::new(), &mut drop)).join().unwrap();
    assert!(
        matches!(refused, Err(OffloaderError::Protocol(ProtocolError::GraphsAlive { live: 1 }))),
        "shutdown with a live graph: {refused:?}"
    );
    assert!(!off.core().is_shut_down(), "a refused shutdown marked the offloader down");
    // Pinning included: it still ends Pinned (no registration fails here).
    let pinned = off.core().wait_pinned(Request::new()).expect("wait_pinned after a refused shutdown").state;
    assert_eq!(pinned, PinState::Pinned, "a refused shutdown changed pinning");
    // Nothing changed: the store completes and is applied, its key loads.
    off.core().wait_all(Request::new(), &mut drop).unwrap();
    let stored = poll_n(off.core(), 1);
    assert!(stored[0].error.is_none(), "the store failed: {stored:?}");
    let job = off.load(&k, &[1]).expect("a load after a refused shutdown");
    off.core().wait(job, Request::new(), &mut drop).unwrap();
    let loaded = poll_n(off.core(), 1);
    assert!(loaded[0].error.is_none(), "the load failed: {loaded:?}");
    assert_eq!(read_block(off.core(), 1), [0x5a; PAGE], "a load after a refused shutdown brought back other bytes");
    drop(off.core().capture_window(Request::new()).expect("a window after a refused shutdown"));
    drop(token);
    off.core().shutdown(Request::new(), &mut drop).expect("a shutdown once the graph is gone");
    assert_eq!(sim(&rt).registered_ranges(), 0, "region left registered after shutdown");
    assert!(off.core().pin_progress().state.is_final());
}

/// Shutdown (on another thread) while a store is in flight and pinning
/// runs: it succeeds, the store is applied before it returns (its key is
/// counted stored), and nothing is left registered.
fn with_jobs_and_pinning(variant: Variant) {
    let (rt, off) = offloader(variant);
    write_block(off.core(), 0, 0x5a);
    off.core().start().unwrap();
    off.store(&[BlockKey::new(1, 0)], &[0]).unwrap();
    let o2 = off.clone();
    let done = thread::spawn(move || o2.core().shutdown(Request::new(), &mut drop)).join().unwrap();
    assert!(done.is_ok(), "shutdown with a job in flight failed: {done:?}");
    assert_eq!(off.core().in_flight(), 0, "shutdown returned with a job not applied");
    assert_eq!(off.stored_blocks(), 1, "the store in flight was lost");
    assert_eq!(sim(&rt).registered_ranges(), 0, "region left registered after shutdown");
    assert!(off.core().pin_progress().state.is_final());
}

fn racing_a_capture(variant: Variant) {
    let (rt, off) = offloader(variant);
    off.core().start().unwrap();
    let s = rt.stream_create().unwrap();
    let d = off.core().gated("the engine's scratch", Request::new(), |c| c.mem_alloc(64)).unwrap().unwrap();
    let o2 = off.clone();
    let sh = thread::spawn(move || o2.core().shutdown(Request::new(), &mut drop));
    match off.core().capture_window(Request::new()) {
        Ok(w) => {
            // SAFETY: `d` is a 64-byte allocation of the sim, never freed.
            let (enq, end) = unsafe { capture_memset(rt.as_ref(), s, CaptureMode::Global, d, 0, 64) };
            drop(w);
            assert!(enq.is_ok() && end.is_ok(), "capture invalidated during shutdown: enqueue {enq:?}, end {end:?}");
            rt.graph_destroy(end.unwrap()).unwrap();
        }
        Err(OffloaderError::Protocol(ProtocolError::ShutDown)) => {}
        Err(e) => panic!("capture_window failed: {e}"),
    }
    match sh.join().unwrap() {
        Ok(()) => {}
        Err(OffloaderError::Protocol(ProtocolError::WindowOpen { .. })) => {
            off.core().shutdown(Request::new(), &mut drop).expect("a shutdown retried after the window closed");
        }
        Err(e) => panic!("shutdown failed: {e}"),
    }
    assert_eq!(sim(&rt).registered_ranges(), 0, "region left registered after shutdown");
    assert!(matches!(off.core().pin_progress().state, PinState::Pinned | PinState::Pageable(_)));
}

const B: Bounds = Bounds { property: "P4", threads: 4, preemptions: 2, ci: None };

models! {
    p4_offloader_refuses_shutdown_with_a_live_graph_and_changes_nothing:
        check("p4_offloader_live_graph", B, || refused_with_a_live_graph(Variant::Production));
    negative_n25_a_refused_shutdown_cancels_pinning:
        negative("n25_refusal_cancels_pinning", Bounds { property: "N25", ..B },
            "a refused shutdown changed pinning", || refused_with_a_live_graph(Variant::RefusalCancelsPinning));
    negative_n15_offloader_tears_down_before_refusing:
        negative("n15_teardown_before_refusal", Bounds { property: "N15", ..B },
            "a refused shutdown marked the offloader down",
            || refused_with_a_live_graph(Variant::TeardownBeforeRefusal));
    p4_offloader_shutdown_races_a_window_and_a_capture:
        check("p4_offloader_racing_a_capture", B, || racing_a_capture(Variant::Production));
    negative_n15_offloader_tears_down_before_refusing_a_window:
        negative("n15_teardown_before_refusal_window", Bounds { property: "N15", ..B },
            "a shutdown retried after the window closed", || racing_a_capture(Variant::TeardownBeforeRefusal));
    p4_offloader_shutdown_drains_jobs_while_pinning_runs:
        check("p4_offloader_jobs_and_pinning", B, || with_jobs_and_pinning(Variant::Production));
    negative_n20_offloader_skips_its_drain:
        negative("n20_offloader_skips_drain", Bounds { property: "N20", ..B },
            "shutdown returned with a job not applied", || with_jobs_and_pinning(Variant::OffloaderSkipsDrain));
}
