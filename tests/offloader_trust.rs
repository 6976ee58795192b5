//! The safety claim at the `KeyedOffloader` edge, through its public API only:
//! a refused shutdown changes nothing, a drop with a live graph leaks on
//! purpose, a second offloader (or coordinator) for the runtime handle an
//! offloader guards is refused, and the engine's gated calls are the
//! offloader's.

use kvoffload::internal::protocol::Coordinator;
use kvoffload::internal::sync::Arc;
use kvoffload::{
    shared, BlockKey, CaptureMode, CapturePolicy, Code, GpuRuntime, KeyedOffloader, KvAlloc, OffloaderError,
    OffloaderOptions, PinState, ProtocolError, Request, SimRuntime,
};

const PAGE: usize = 4096;

fn kv() -> KvAlloc {
    KvAlloc { tensors: 2, page_bytes: PAGE, gpu_blocks: 16, block_factor: 1 }
}

fn offloader(rt: &Arc<dyn GpuRuntime>) -> KeyedOffloader {
    let mut opts = OffloaderOptions::with_host_blocks(8);
    opts.pin = opts.pin.max_chunk_bytes(2 * 2 * PAGE);
    KeyedOffloader::with_allocated_tensors(rt.clone(), kv(), opts).expect("offloader on the simulated GPU")
}

fn sim(rt: &Arc<dyn GpuRuntime>) -> &SimRuntime {
    rt.as_sim().expect("the simulated GPU")
}

/// Shutdown with a live graph token is refused with nothing changed: the
/// region stays registered, jobs are still accepted and complete, keys stay
/// readable, and once the token is gone a later shutdown succeeds and
/// unregisters everything. (The refusal used to come after the
/// offloader had closed, drained and dropped its engine and freed its
/// tensors: the next store got `ShutDown`, the retry `AlreadyShutDown`, and
/// the region stayed registered.)
#[test]
fn a_refused_shutdown_changes_nothing() {
    let rt = shared(SimRuntime::new());
    let off = offloader(&rt);
    assert_eq!(off.core().wait_pinned(Request::new()).unwrap().state, PinState::Pinned);
    let registered = sim(&rt).registered_ranges();
    assert!(registered > 0);
    let k = [BlockKey::new(1, 0)];
    off.store(&k, &[3]).unwrap();
    off.core().wait_all(Request::new(), &mut drop).unwrap();
    off.poll();

    let token = off.core().register_graph().unwrap();
    match off.core().shutdown(Request::new(), &mut drop) {
        Err(OffloaderError::Protocol(ProtocolError::GraphsAlive { live: 1 })) => {}
        other => panic!("expected GraphsAlive, got {other:?}"),
    }
    assert!(!off.core().is_shut_down());
    assert_eq!(sim(&rt).registered_ranges(), registered, "nothing unregistered");
    // Work goes on as before the refusal.
    let job = off.load(&k, &[5]).expect("a load after a refused shutdown");
    off.core().wait(job, Request::new(), &mut drop).unwrap();
    let k2 = [BlockKey::new(2, 0)];
    let stored = off.store(&k2, &[4]).expect("a store after a refused shutdown");
    assert_eq!(stored.stored, k2.to_vec());
    off.core().wait_all(Request::new(), &mut drop).unwrap();
    let done = off.poll();
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|c| c.error.is_none()), "{done:?}");
    let _w = off.core().capture_window(Request::new()).expect("windows still open after a refused shutdown");
    drop(_w);

    drop(token);
    off.core().shutdown(Request::new(), &mut drop).expect("shutdown once the graph is gone");
    assert!(off.core().is_shut_down());
    assert_eq!(sim(&rt).registered_ranges(), 0, "the region is unregistered");
    assert!(matches!(
        off.core().shutdown(Request::new(), &mut drop),
        Err(OffloaderError::Protocol(ProtocolError::AlreadyShutDown))
    ));
}

/// The same with a window open: refused, nothing changed, and the window's
/// capture stays valid.
#[test]
fn a_shutdown_refused_during_a_window_leaves_the_capture_valid() {
    let rt = shared(SimRuntime::new());
    let off = offloader(&rt);
    off.core().wait_pinned(Request::new()).unwrap();
    let s = rt.stream_create().unwrap();
    let w = off.core().capture_window(Request::new()).unwrap();
    rt.begin_capture(s, CaptureMode::Global).unwrap();
    assert!(matches!(
        off.core().shutdown(Request::new(), &mut drop),
        Err(OffloaderError::Protocol(ProtocolError::WindowOpen { open: 1 }))
    ));
    let g = rt.end_capture(s).expect("capture valid");
    rt.graph_destroy(g).unwrap();
    drop(w);
    assert!(off.store(&[BlockKey::new(9, 0)], &[1]).unwrap().job.is_some());
    off.core().shutdown(Request::new(), &mut drop).unwrap();
    assert_eq!(sim(&rt).registered_ranges(), 0);
}

/// Dropping an offloader whose graph still lives leaks on purpose: the
/// region stays registered (a replay of the graph still reads it) and the
/// runtime stays guarded until the token is gone.
#[test]
fn a_drop_with_a_live_graph_leaks_the_region_registered() {
    let rt = shared(SimRuntime::new());
    let off = offloader(&rt);
    off.core().wait_pinned(Request::new()).unwrap();
    let chunks = off.core().pin_progress().chunks_total;
    let token = off.core().register_graph().unwrap();
    drop(off);
    // The engine's own page-locked staging rings are freed with it; every
    // chunk of the region stays registered.
    let registered = sim(&rt).registered_ranges();
    assert!(registered >= chunks, "the region stays registered for the live graph: {registered} < {chunks}");
    drop(token);
    // The coordinator is gone with its last guard: the memory stays mapped
    // and registered (leaked, logged), and the handle is free again.
    assert_eq!(sim(&rt).registered_ranges(), registered);
    Coordinator::without_region(rt.as_ref(), CapturePolicy::AfterPinning).expect("the handle is free again");
}

/// A second offloader, or any coordinator, for the runtime handle an
/// offloader guards is refused; a second handle on the same device works.
#[test]
fn one_runtime_handle_one_offloader() {
    let rt = shared(SimRuntime::new());
    let off = offloader(&rt);
    match KeyedOffloader::with_allocated_tensors(rt.clone(), kv(), OffloaderOptions::with_host_blocks(8)) {
        Err(OffloaderError::Protocol(ProtocolError::RuntimeGuarded { .. })) => {}
        other => panic!("expected RuntimeGuarded, got {other:?}"),
    }
    assert!(matches!(
        Coordinator::without_region(rt.as_ref(), CapturePolicy::AfterPinning),
        Err(ProtocolError::RuntimeGuarded { .. })
    ));
    let second = shared(sim(&rt).another_handle());
    let off2 = offloader(&second);
    off2.core().shutdown(Request::new(), &mut drop).unwrap();
    off.core().shutdown(Request::new(), &mut drop).unwrap();
}

/// The engine's gated calls run on the offloader's runtime inside its gate;
/// a gate of another coordinator used on that runtime (the second-
/// coordinator route, with a coordinator of another handle) is refused.
#[test]
fn gated_calls_are_the_offloaders_and_foreign_gates_are_refused() {
    let rt = shared(SimRuntime::new());
    let off = offloader(&rt);
    let p = off.core().gated("engine scratch", Request::new(), |calls| calls.mem_alloc(64)).unwrap().unwrap();
    // SAFETY: no work used `p`; nothing uses it afterwards.
    off.core().gated("engine scratch", Request::new(), |calls| unsafe { calls.mem_free(p) }).unwrap().unwrap();
    let elsewhere = shared(SimRuntime::new());
    let foreign = Coordinator::without_region(elsewhere.as_ref(), CapturePolicy::AfterPinning).unwrap();
    let r = foreign.unsafe_call("attack", Request::new(), |g| rt.mem_alloc(g, 64)).unwrap();
    assert_eq!(r.map_err(|e| e.code), Err(Code::GATE_REFUSED));
    off.core().shutdown(Request::new(), &mut drop).unwrap();
}
