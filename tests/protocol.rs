//! The coordinator's refusals: typed errors, never a hang or a panic.

use std::sync::Arc;

use kvoffload::internal::pin::{pin_all, NoPrefault};
use kvoffload::internal::protocol::{
    shutdown, CapturePolicy, ChunkReg, Coordinator, PageableReason, PinState, ProtocolError, ShutdownError,
};
use kvoffload::internal::runtime::sim::{HoldPoint, SimRuntime};
use kvoffload::internal::runtime::GpuRuntime;

/// A coordinator over `chunks` chunks of 4096 bytes of heap memory, which
/// it holds, and the chunks' ranges.
fn coordinator(rt: &SimRuntime, policy: CapturePolicy, chunks: usize) -> (Arc<Coordinator>, Vec<(usize, usize)>) {
    let mem = vec![0u8; chunks * 4096];
    let ranges: Vec<(usize, usize)> = (0..chunks).map(|i| (mem.as_ptr() as usize + i * 4096, 4096)).collect();
    // SAFETY: the chunks are pieces of `mem`'s heap buffer (read-write),
    // which the coordinator holds (moving the Vec does not move the buffer).
    let coord = unsafe { Coordinator::new(rt, policy, &ranges, Some(Box::new(mem))) }.unwrap();
    (coord, ranges)
}

#[test]
fn shutdown_refuses_while_a_window_is_open_then_succeeds() {
    let rt = SimRuntime::new();
    let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 2);
    assert_eq!(pin_all(&rt, &coord, &NoPrefault), PinState::Pinned);
    let w = coord.open_window().unwrap();
    assert_eq!(shutdown(&rt, &coord, || {}), Err(ShutdownError::Refused(ProtocolError::WindowOpen { open: 1 })));
    drop(w);
    shutdown(&rt, &coord, || {}).unwrap();
    assert_eq!(rt.registered_ranges(), 0);
    assert_eq!(shutdown(&rt, &coord, || {}), Err(ShutdownError::Refused(ProtocolError::AlreadyShutDown)));
}

#[test]
fn shutdown_refuses_while_graphs_live() {
    let rt = SimRuntime::new();
    let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    pin_all(&rt, &coord, &NoPrefault);
    let g = coord.register_graph().unwrap();
    assert_eq!(shutdown(&rt, &coord, || {}), Err(ShutdownError::Refused(ProtocolError::GraphsAlive { live: 1 })));
    assert_eq!(rt.registered_ranges(), 1, "a refused shutdown changes nothing");
    drop(g);
    shutdown(&rt, &coord, || {}).unwrap();
}

#[test]
fn work_after_shutdown_is_refused() {
    let rt = SimRuntime::new();
    let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    shutdown(&rt, &coord, || {}).unwrap();
    assert!(matches!(coord.admit_job(), Err(ProtocolError::ShutDown)));
    assert!(matches!(coord.open_window(), Err(ProtocolError::ShutDown)));
    assert!(matches!(coord.register_graph(), Err(ProtocolError::ShutDown)));
    assert!(coord.pin_state().is_final(), "shutdown before pinning settles the state");
}

#[test]
fn waiting_inside_ones_own_window_is_refused() {
    let rt = Arc::new(SimRuntime::new());
    let (coord, _) = coordinator(&rt, CapturePolicy::Interleave, 2);
    let w = coord.open_window().unwrap();
    assert!(matches!(coord.wait_pin_final(), Err(ProtocolError::WouldDeadlock { .. })));
    assert!(matches!(coord.unsafe_call("x", |_| ()), Err(ProtocolError::WouldDeadlock { .. })));
    assert!(matches!(coord.try_unsafe_call(|_| ()), Err(ProtocolError::WindowBusy)));
    assert!(matches!(coord.open_window(), Err(ProtocolError::NestedWindow)));
    drop(w);
    assert_eq!(pin_all(rt.as_ref(), &coord, &NoPrefault), PinState::Pinned);
    assert_eq!(coord.wait_pin_final().unwrap(), PinState::Pinned);
    coord.unregister_all(rt.as_ref()).unwrap();
}

#[test]
fn alias_only_for_registered_chunks() {
    let rt = SimRuntime::new();
    let (coord, ranges) = coordinator(&rt, CapturePolicy::AfterPinning, 2);
    assert!(coord.acquire_alias(ranges[0].0, 64).is_none(), "alias before registration");
    pin_all(&rt, &coord, &NoPrefault);
    let a = coord.acquire_alias(ranges[1].0 + 128, 64).expect("alias of a registered chunk");
    assert_eq!(a.device, rt_alias(&rt, ranges[1].0).offset(128));
    assert!(coord.acquire_alias(ranges[0].0 + 4000, 200).is_none(), "a range across two chunks");
    drop(a);
    coord.unregister_all(&rt).unwrap();
    assert!(coord.acquire_alias(ranges[1].0, 64).is_none(), "alias after unregistration");
}

fn rt_alias(rt: &SimRuntime, addr: usize) -> kvoffload::internal::runtime::DevicePtr {
    use kvoffload::internal::runtime::GpuRuntime;
    rt.host_device_ptr(addr).unwrap()
}

/// Holds a chunk's memory; sets its flag when dropped (unmapped).
struct Unmapped(Arc<std::sync::atomic::AtomicBool>, #[allow(dead_code)] Vec<u8>);

impl Drop for Unmapped {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn a_coordinator_dropped_with_a_chunk_registered_keeps_its_memory() {
    for unregister_first in [false, true] {
        let rt = SimRuntime::new();
        let unmapped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mem = vec![0u8; 4096];
        let ranges = [(mem.as_ptr() as usize, 4096)];
        // SAFETY: the chunk is `mem`'s heap buffer, held by `keep_alive`.
        let coord = unsafe {
            Coordinator::new(&rt, CapturePolicy::AfterPinning, &ranges, Some(Box::new(Unmapped(unmapped.clone(), mem))))
        }
        .unwrap();
        assert_eq!(pin_all(&rt, &coord, &NoPrefault), PinState::Pinned);
        if unregister_first {
            coord.unregister_all(&rt).unwrap();
        }
        drop(coord);
        // Registered memory is leaked (stays mapped); unregistered memory is released.
        assert_eq!(
            unmapped.load(std::sync::atomic::Ordering::SeqCst),
            unregister_first,
            "unregistered first: {unregister_first}"
        );
    }
}

#[test]
fn the_coordinators_accessors_report_its_state() {
    let rt = SimRuntime::new();
    let (coord, ranges) = coordinator(&rt, CapturePolicy::Interleave, 2);
    assert_eq!(coord.policy(), CapturePolicy::Interleave);
    assert_eq!((coord.windows_open(), coord.registered_chunks()), (0, 0));
    assert_eq!(coord.chunk_reg(0), Some(ChunkReg::Unregistered));
    assert_eq!(coord.chunk_reg(2), None, "no chunk 2");
    assert!(!coord.shutting_down());
    // Windows are counted while open, and again after one closed.
    let w = coord.open_window().unwrap();
    assert_eq!(coord.windows_open(), 1);
    drop(w);
    assert_eq!(coord.windows_open(), 0);
    let w = coord.open_window().unwrap();
    assert_eq!(coord.windows_open(), 1);
    drop(w);
    assert_eq!(coord.windows_open(), 0);
    // One chunk registered; a thread waiting for pinning meanwhile (outside
    // any window: it waits, it is not refused).
    assert!(coord.pin_begin());
    assert!(!coord.pin_begin(), "pinning began already");
    let waiter = {
        let coord = coord.clone();
        std::thread::spawn(move || coord.wait_pin_final())
    };
    while coord.activity().pin_waiters == 0 && !waiter.is_finished() {
        std::thread::yield_now();
    }
    assert!(!waiter.is_finished(), "the wait for pinning returned before pinning was final");
    coord.register_chunk(&rt, 1).unwrap().unwrap();
    assert_eq!(coord.pin_state(), PinState::Pinning { done: 1, total: 2 });
    assert_eq!(coord.registered_chunks(), 1);
    assert_eq!((coord.activity().calls_in_flight, coord.activity().calls_waiting), (0, 0), "a call left counted");
    // Windows still open and close after library calls (none left waiting).
    for _ in 0..2 {
        let w = coord.open_window().unwrap();
        assert_eq!(coord.activity().windows_open, 1);
        drop(w);
    }
    // Aliases and jobs are counted while held.
    let a = coord.acquire_alias(ranges[1].0, 64).unwrap();
    assert_eq!(coord.activity().alias_users, 1);
    drop(a);
    assert_eq!(coord.activity().alias_users, 0);
    let (j1, j2) = (coord.admit_job().unwrap(), coord.admit_job().unwrap());
    assert_eq!(coord.activity().jobs_in_flight, 2);
    drop((j1, j2));
    assert_eq!(coord.activity().jobs_in_flight, 0);
    assert!(matches!(coord.chunk_reg(1), Some(ChunkReg::Registered { .. })));
    assert!(!coord.pin_cancelled());
    coord.cancel_pinning();
    assert!(coord.pin_cancelled());
    coord.unregister_all(&rt).unwrap();
    assert_eq!((coord.registered_chunks(), coord.chunk_reg(1)), (0, Some(ChunkReg::Unregistered)));
    coord.pin_finish(PinState::Pageable(PageableReason::Cancelled));
    assert_eq!(waiter.join().unwrap(), Ok(PinState::Pageable(PageableReason::Cancelled)));
    assert_eq!(coord.activity().pin_waiters, 0);
    shutdown(&rt, &coord, || {}).unwrap();
    assert!(coord.shutting_down());
    // A cancel before pinning begins stops it from beginning (a fresh
    // coordinator for the runtime, once the first is gone).
    drop(coord);
    let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    assert_eq!(coord.policy(), CapturePolicy::AfterPinning);
    coord.cancel_pinning();
    assert!(!coord.pin_begin(), "pinning began after a cancel");
}

#[test]
fn a_window_counts_the_registrations_it_waited_for() {
    let rt = Arc::new(SimRuntime::new());
    let (coord, _) = coordinator(&rt, CapturePolicy::Interleave, 2);
    // Nothing in flight: the window waits for nothing (after one
    // registration, counted before it asked).
    assert_eq!(coord.open_window().unwrap().chunks_waited(), 0);
    coord.register_chunk(rt.as_ref(), 1).unwrap().unwrap();
    assert_eq!(coord.open_window().unwrap().chunks_waited(), 0);
    // A registration held inside the driver: a window asking now waits for it.
    let hold = rt.hold(HoldPoint::Register);
    let pinner = {
        let (rt, coord) = (rt.clone(), coord.clone());
        std::thread::spawn(move || coord.register_chunk(rt.as_ref(), 0).unwrap().unwrap())
    };
    hold.wait_entered();
    let engine = {
        let coord = coord.clone();
        std::thread::spawn(move || coord.open_window().unwrap().chunks_waited())
    };
    while coord.activity().windows_waiting == 0 {
        std::thread::yield_now();
    }
    hold.release();
    pinner.join().unwrap();
    assert_eq!(engine.join().unwrap(), 1, "the window waited for the registration in flight");
    coord.unregister_all(rt.as_ref()).unwrap();
}

#[test]
fn unregistering_waits_for_the_chunks_alias_users() {
    let rt = Arc::new(SimRuntime::new());
    let (coord, ranges) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    assert_eq!(pin_all(rt.as_ref(), &coord, &NoPrefault), PinState::Pinned);
    let a = coord.acquire_alias(ranges[0].0, 64).unwrap();
    let unregister = {
        let (rt, coord) = (rt.clone(), coord.clone());
        std::thread::spawn(move || coord.unregister_chunk(rt.as_ref(), 0))
    };
    while coord.activity().unregisters_waiting == 0 && !unregister.is_finished() {
        std::thread::yield_now();
    }
    assert!(!unregister.is_finished(), "the chunk was unregistered while its alias was held");
    assert_eq!(rt.registered_ranges(), 1);
    assert_eq!(coord.chunk_reg(0), Some(ChunkReg::Unregistering));
    assert!(coord.acquire_alias(ranges[0].0, 64).is_none(), "a new alias user while unregistering");
    drop(a);
    unregister.join().unwrap().unwrap().unwrap();
    assert_eq!((rt.registered_ranges(), coord.activity().unregisters_waiting), (0, 0));
}

/// Issue 20's route: a second coordinator for the runtime an offloader's
/// coordinator guards, whose gate would let a capture-unsafe call overlap
/// the first one's window (the seed incident: 900, the capture ends 901).
/// It cannot be made while the first lives, and can once it is gone.
#[test]
fn a_second_coordinator_for_a_guarded_runtime_is_refused() {
    let rt = SimRuntime::new();
    let (first, _) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    match Coordinator::without_region(&rt, CapturePolicy::AfterPinning) {
        Err(ProtocolError::RuntimeGuarded { backend: "sim" }) => {}
        Err(e) => panic!("expected RuntimeGuarded, got {e}"),
        Ok(_) => panic!("a second coordinator was made for a guarded runtime"),
    }
    // A guard of the first keeps the runtime guarded after the coordinator
    // itself is dropped (its gates would still be in use).
    let graph = first.register_graph().unwrap();
    drop(first);
    assert!(matches!(
        Coordinator::without_region(&rt, CapturePolicy::AfterPinning),
        Err(ProtocolError::RuntimeGuarded { .. })
    ));
    drop(graph);
    let second = Coordinator::without_region(&rt, CapturePolicy::AfterPinning).expect("the runtime is free again");
    second.unsafe_call("alloc", |g| rt.mem_alloc(g, 64)).unwrap().unwrap();
}

/// A gate of one coordinator is refused by a runtime another coordinator
/// guards, with `GATE_REFUSED` and nothing done: the capture of the
/// guarded runtime's window stays valid. The same for a runtime no
/// coordinator guards.
#[test]
fn a_gate_of_another_coordinator_is_refused_and_the_capture_survives() {
    use kvoffload::internal::runtime::{CaptureMode, Code};
    let rt = SimRuntime::new();
    let other = SimRuntime::new();
    let unguarded = SimRuntime::new();
    let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    assert_eq!(pin_all(&rt, &coord, &NoPrefault), PinState::Pinned);
    let foreign = Coordinator::without_region(&other, CapturePolicy::AfterPinning).unwrap();

    let s = rt.stream_create().unwrap();
    let w = coord.open_window().unwrap();
    rt.begin_capture(s, CaptureMode::Global).unwrap();
    let refused = std::thread::scope(|sc| {
        sc.spawn(|| foreign.unsafe_call("the attacker's alloc", |g| rt.mem_alloc(g, 64)).unwrap()).join().unwrap()
    });
    assert_eq!(refused.map_err(|e| e.code), Err(Code::GATE_REFUSED));
    let graph = rt.end_capture(s).expect("the capture was not invalidated");
    rt.graph_destroy(graph).unwrap();
    drop(w);
    assert!(rt.refusals().is_empty(), "nothing reached the simulated driver: {:?}", rt.refusals());
    assert_eq!(
        foreign.unsafe_call("alloc", |g| unguarded.mem_alloc(g, 64)).unwrap().map_err(|e| e.code),
        Err(Code::GATE_REFUSED)
    );
    shutdown(&rt, &coord, || {}).unwrap();
}

/// A failed registration's driver code gives its pageable reason: the
/// three the protocol names (801, 900, 2), each with its code in its
/// message, and any other kept whole (call and code).
#[test]
fn a_failed_registrations_code_gives_its_pageable_reason() {
    use kvoffload::internal::runtime::{Code, DriverError};
    let reason = |code| PageableReason::from_driver(DriverError::new("cuMemHostRegister", code));
    for (code, want, shown) in [
        (Code::NOT_SUPPORTED, PageableReason::NotSupported, "(801)"),
        (Code::STREAM_CAPTURE_UNSUPPORTED, PageableReason::CaptureUnsupported, "(900)"),
        (Code::OUT_OF_MEMORY, PageableReason::OutOfMemory, "(2)"),
    ] {
        let got = reason(code);
        assert_eq!(got, want, "code {code:?}");
        assert!(got.to_string().contains(shown), "{got}");
    }
    let other = DriverError::new("cuMemHostRegister", Code::INVALID_VALUE);
    assert_eq!(reason(Code::INVALID_VALUE), PageableReason::Driver(other));
}
