//! The coordinator's refusals: typed errors, never a hang or a panic.

use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvoffload::internal::pin::{pin_all, pin_all_agreed_by, Agreement, NoPrefault, RankAgreement};
use kvoffload::internal::protocol::agreement::{LocalSlots, RankSlots, UNSETTLED};
use kvoffload::internal::protocol::{shutdown, ChunkReg, Coordinator};
use kvoffload::internal::runtime::sim::HoldPoint;
use kvoffload::{
    AgreementError, CapturePolicy, GpuRuntime, PageableReason, PinState, ProtocolError, Request, ShutdownError,
    SimRuntime, Transport,
};

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
    let w = coord.open_window(Request::new()).unwrap();
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
    assert!(matches!(coord.open_window(Request::new()), Err(ProtocolError::ShutDown)));
    assert!(matches!(coord.register_graph(), Err(ProtocolError::ShutDown)));
    assert!(coord.pinning().state().is_final(), "shutdown before pinning settles the state");
}

#[test]
fn waiting_inside_ones_own_window_is_refused() {
    let rt = Arc::new(SimRuntime::new());
    let (coord, _) = coordinator(&rt, CapturePolicy::Interleave, 2);
    let w = coord.open_window(Request::new()).unwrap();
    assert!(matches!(coord.pinning().wait_final(Request::new()), Err(ProtocolError::WouldDeadlock { .. })));
    assert!(matches!(coord.unsafe_call("x", Request::new(), |_| ()), Err(ProtocolError::WouldDeadlock { .. })));
    assert!(matches!(coord.try_unsafe_call(|_| ()), Err(ProtocolError::WindowBusy)));
    assert!(matches!(coord.open_window(Request::new()), Err(ProtocolError::NestedWindow)));
    drop(w);
    assert_eq!(pin_all(rt.as_ref(), &coord, &NoPrefault), PinState::Pinned);
    assert_eq!(coord.pinning().wait_final(Request::new()).unwrap(), PinState::Pinned);
    coord.pinning().unregister_all(rt.as_ref()).unwrap();
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
    coord.pinning().unregister_all(&rt).unwrap();
    assert!(coord.acquire_alias(ranges[1].0, 64).is_none(), "alias after unregistration");
}

fn rt_alias(rt: &SimRuntime, addr: usize) -> kvoffload::DevicePtr {
    use kvoffload::GpuRuntime;
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
            coord.pinning().unregister_all(&rt).unwrap();
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
    assert_eq!((coord.activity().windows_open, coord.pinning().registered_chunks()), (0, 0));
    assert_eq!(coord.pinning().chunk_reg(0), Some(ChunkReg::Unregistered));
    assert_eq!(coord.pinning().chunk_reg(2), None, "no chunk 2");
    assert!(!coord.shutdown_steps().started());
    // Windows are counted while open, and again after one closed.
    let w = coord.open_window(Request::new()).unwrap();
    assert_eq!(coord.activity().windows_open, 1);
    drop(w);
    assert_eq!(coord.activity().windows_open, 0);
    let w = coord.open_window(Request::new()).unwrap();
    assert_eq!(coord.activity().windows_open, 1);
    drop(w);
    assert_eq!(coord.activity().windows_open, 0);
    // One chunk registered; a thread waiting for pinning meanwhile (outside
    // any window: it waits, it is not refused).
    assert!(coord.pinning().begin());
    assert!(!coord.pinning().begin(), "pinning began already");
    let waiter = {
        let coord = coord.clone();
        std::thread::spawn(move || coord.pinning().wait_final(Request::new()))
    };
    while coord.activity().pin_waiters == 0 && !waiter.is_finished() {
        std::thread::yield_now();
    }
    assert!(!waiter.is_finished(), "the wait for pinning returned before pinning was final");
    coord.pinning().register_chunk(&rt, 1).unwrap().unwrap();
    assert_eq!(coord.pinning().state(), PinState::Pinning { done: 1, total: 2 });
    assert_eq!(coord.pinning().registered_chunks(), 1);
    assert_eq!((coord.activity().calls_in_flight, coord.activity().calls_waiting), (0, 0), "a call left counted");
    // Windows still open and close after library calls (none left waiting).
    for _ in 0..2 {
        let w = coord.open_window(Request::new()).unwrap();
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
    assert!(matches!(coord.pinning().chunk_reg(1), Some(ChunkReg::Registered { .. })));
    assert!(!coord.pinning().cancelled());
    coord.pinning().cancel();
    assert!(coord.pinning().cancelled());
    coord.pinning().unregister_all(&rt).unwrap();
    assert_eq!((coord.pinning().registered_chunks(), coord.pinning().chunk_reg(1)), (0, Some(ChunkReg::Unregistered)));
    coord.pinning().finish(PinState::Pageable(PageableReason::Cancelled));
    assert_eq!(waiter.join().unwrap(), Ok(PinState::Pageable(PageableReason::Cancelled)));
    assert_eq!(coord.activity().pin_waiters, 0);
    shutdown(&rt, &coord, || {}).unwrap();
    assert!(coord.shutdown_steps().started());
    // A cancel before pinning begins stops it from beginning (a fresh
    // coordinator for the runtime, once the first is gone).
    drop(coord);
    let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    assert_eq!(coord.policy(), CapturePolicy::AfterPinning);
    coord.pinning().cancel();
    assert!(!coord.pinning().begin(), "pinning began after a cancel");
}

#[test]
fn a_window_counts_the_registrations_it_waited_for() {
    let rt = Arc::new(SimRuntime::new());
    let (coord, _) = coordinator(&rt, CapturePolicy::Interleave, 2);
    // Nothing in flight: the window waits for nothing (after one
    // registration, counted before it asked).
    assert_eq!(coord.open_window(Request::new()).unwrap().chunks_waited(), 0);
    coord.pinning().register_chunk(rt.as_ref(), 1).unwrap().unwrap();
    assert_eq!(coord.open_window(Request::new()).unwrap().chunks_waited(), 0);
    // A registration held inside the driver: a window asking now waits for it.
    let hold = rt.hold(HoldPoint::Register);
    let pinner = {
        let (rt, coord) = (rt.clone(), coord.clone());
        std::thread::spawn(move || coord.pinning().register_chunk(rt.as_ref(), 0).unwrap().unwrap())
    };
    hold.wait_entered();
    let engine = {
        let coord = coord.clone();
        std::thread::spawn(move || coord.open_window(Request::new()).unwrap().chunks_waited())
    };
    while coord.activity().windows_waiting == 0 {
        std::thread::yield_now();
    }
    hold.release();
    pinner.join().unwrap();
    assert_eq!(engine.join().unwrap(), 1, "the window waited for the registration in flight");
    coord.pinning().unregister_all(rt.as_ref()).unwrap();
}

#[test]
fn unregistering_waits_for_the_chunks_alias_users() {
    let rt = Arc::new(SimRuntime::new());
    let (coord, ranges) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    assert_eq!(pin_all(rt.as_ref(), &coord, &NoPrefault), PinState::Pinned);
    let a = coord.acquire_alias(ranges[0].0, 64).unwrap();
    let unregister = {
        let (rt, coord) = (rt.clone(), coord.clone());
        std::thread::spawn(move || coord.pinning().unregister_chunk(rt.as_ref(), 0))
    };
    while coord.activity().unregisters_waiting == 0 && !unregister.is_finished() {
        std::thread::yield_now();
    }
    assert!(!unregister.is_finished(), "the chunk was unregistered while its alias was held");
    assert_eq!(rt.registered_ranges(), 1);
    assert_eq!(coord.pinning().chunk_reg(0), Some(ChunkReg::Unregistering));
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
    second.unsafe_call("alloc", Request::new(), |g| rt.mem_alloc(g, 64)).unwrap().unwrap();
}

/// A gate of one coordinator is refused by a runtime another coordinator
/// guards, with `GATE_REFUSED` and nothing done: the capture of the
/// guarded runtime's window stays valid. The same for a runtime no
/// coordinator guards.
#[test]
fn a_gate_of_another_coordinator_is_refused_and_the_capture_survives() {
    use kvoffload::{CaptureMode, Code};
    let rt = SimRuntime::new();
    let other = SimRuntime::new();
    let unguarded = SimRuntime::new();
    let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    assert_eq!(pin_all(&rt, &coord, &NoPrefault), PinState::Pinned);
    let foreign = Coordinator::without_region(&other, CapturePolicy::AfterPinning).unwrap();

    let s = rt.stream_create().unwrap();
    let w = coord.open_window(Request::new()).unwrap();
    rt.begin_capture(s, CaptureMode::Global).unwrap();
    let refused = std::thread::scope(|sc| {
        sc.spawn(|| foreign.unsafe_call("the attacker's alloc", Request::new(), |g| rt.mem_alloc(g, 64)).unwrap())
            .join()
            .unwrap()
    });
    assert_eq!(refused.map_err(|e| e.code), Err(Code::GATE_REFUSED));
    let graph = rt.end_capture(s).expect("the capture was not invalidated");
    rt.graph_destroy(graph).unwrap();
    drop(w);
    assert!(rt.refusals().is_empty(), "nothing reached the simulated driver: {:?}", rt.refusals());
    assert_eq!(
        foreign.unsafe_call("alloc", Request::new(), |g| unguarded.mem_alloc(g, 64)).unwrap().map_err(|e| e.code),
        Err(Code::GATE_REFUSED)
    );
    shutdown(&rt, &coord, || {}).unwrap();
}

/// A failed registration's driver code gives its pageable reason: the
/// three the protocol names (801, 900, 2), each with its code in its
/// message, and any other kept whole (call and code).
#[test]
fn a_failed_registrations_code_gives_its_pageable_reason() {
    use kvoffload::{Code, DriverError};
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

/// Spins (yielding) until `cond` holds, failing with `what` after 30 s: a
/// guard against a protocol that never lets the thread go, not a speed
/// limit (each of these waits ends at once when the protocol is right).
fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "still waiting after 30 s: {what}");
        std::thread::yield_now();
    }
}

/// Opens a window on a thread of `s` and holds it until the returned sender
/// sends or is dropped: made inside the scope, so a failing check drops it
/// and the window's thread ends (the scope waits for it) instead of
/// waiting for ever.
fn window_held_on<'scope>(s: &'scope std::thread::Scope<'scope, '_>, coord: &'scope Coordinator) -> Sender<()> {
    let (close, closed) = std::sync::mpsc::channel::<()>();
    s.spawn(move || {
        let w = coord.open_window(Request::new()).unwrap();
        let _ = closed.recv();
        drop(w);
    });
    close
}

/// A capture-unsafe call whose callable unwinds (an engine's panic under
/// the gate) still ends: it is no longer counted in flight, and a window
/// opens instead of waiting for ever on a call that is gone (P6).
#[test]
fn a_call_that_unwinds_under_the_gate_still_ends() {
    let rt = SimRuntime::new();
    let (coord, _) = coordinator(&rt, CapturePolicy::Interleave, 1);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        coord.unsafe_call::<()>("a call that panics", Request::new(), |_| {
            panic!("the engine's callable panicked (expected)")
        })
    }));
    assert!(r.is_err(), "the panic did not reach the caller");
    assert_eq!(coord.activity().calls_in_flight, 0, "the call that unwound is still counted in flight");
    let w = coord
        .open_window(Request::new().interruptible(&|| panic!("the window waited for a call that unwound")))
        .unwrap();
    drop(w);
    assert_eq!(coord.activity(), Default::default(), "nothing open, in flight or waiting");
}

/// Windows and library calls take turns (P6): a window that closes gives
/// the turn to the library call waiting for it, so a window that asks
/// after that waits until the call ran (windows open beside each other
/// while the turn is theirs).
#[test]
fn a_closing_window_gives_the_turn_to_a_waiting_call() {
    let rt = SimRuntime::new();
    let (coord, _) = coordinator(&rt, CapturePolicy::Interleave, 1);
    let order = Mutex::new(Vec::new());
    // The turn starts with windows (as it is after every library call):
    // two windows open, one here and one on a thread until told to close.
    let first = coord.open_window(Request::new()).unwrap();
    std::thread::scope(|s| {
        let coord = &coord;
        let close_second = window_held_on(s, coord);
        until("the second window opens", || coord.activity().windows_open == 2);
        s.spawn(|| {
            coord.unsafe_call("a library call", Request::new(), |_| order.lock().unwrap().push("call")).unwrap()
        });
        until("the library call waits for the windows", || coord.activity().calls_waiting == 1);
        // The first window closes: the turn is the call's.
        drop(first);
        s.spawn(|| {
            let w = coord.open_window(Request::new()).unwrap();
            order.lock().unwrap().push("window");
            drop(w);
        });
        until("the third window waits, or opened", || {
            coord.activity().windows_waiting == 1 || !order.lock().unwrap().is_empty()
        });
        close_second.send(()).unwrap();
        until("the call and the window both ran", || order.lock().unwrap().len() == 2);
    });
    assert_eq!(*order.lock().unwrap(), ["call", "window"], "who went first once the windows closed");
}

/// Under AfterPinning, pinning's registrations take turns with a window
/// that could open now (an interleaved request: the capture hook's), which
/// then waits for at most the registration in flight (P2); they do not
/// defer to a window that waits for pinning's end (it could not open
/// before, so deferring would stall both).
#[test]
fn registrations_take_turns_only_with_windows_that_could_open() {
    let rt = Arc::new(SimRuntime::new());
    let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 4);
    assert!(coord.pinning().begin());
    coord.pinning().register_chunk(rt.as_ref(), 0).unwrap().unwrap();
    std::thread::scope(|s| {
        // Chunk 1's registration held in the driver; an interleaved request
        // comes, then chunk 2's registration.
        let hold = rt.hold(HoldPoint::Register);
        let p1 = s.spawn(|| coord.pinning().register_chunk(rt.as_ref(), 1).unwrap().unwrap());
        hold.wait_entered();
        let hook = s.spawn(|| coord.open_window(Request::new().interleaved()).unwrap().chunks_waited());
        until("the interleaved request waits", || coord.activity().windows_waiting == 1);
        let p2 = s.spawn(|| coord.pinning().register_chunk(rt.as_ref(), 2).unwrap().unwrap());
        until("chunk 2's registration waits, runs or ends", || {
            let a = coord.activity();
            a.calls_waiting == 1 || a.calls_in_flight == 2 || p2.is_finished()
        });
        assert_eq!(
            coord.activity().calls_waiting,
            1,
            "a registration went ahead of an interleaved window that could open"
        );
        hold.release();
        p1.join().unwrap();
        assert_eq!(hook.join().unwrap(), 1, "the interleaved window waited for more than the registration in flight");
        p2.join().unwrap();
        // A plain window waits for pinning's end; chunk 3's registration
        // goes ahead of it.
        let engine = s.spawn(|| coord.open_window(Request::new()).unwrap().chunks_waited());
        until("the window waits for pinning", || coord.activity().windows_waiting == 1);
        let p3 = s.spawn(|| coord.pinning().register_chunk(rt.as_ref(), 3).unwrap().unwrap());
        until("chunk 3's registration ends while a window waits for pinning", || p3.is_finished());
        p3.join().unwrap();
        coord.pinning().finish(PinState::Pinned);
        assert_eq!(engine.join().unwrap(), 1, "the window counted the registration it waited for");
    });
    assert_eq!(rt.registered_ranges(), 4);
    coord.pinning().unregister_all(rt.as_ref()).unwrap();
}

/// The forms that never wait or that are interruptible refuse and admit
/// as their blocking forms do: `try_unsafe_call` and
/// `admit_job_outside_windows` run at once with no window and say
/// `WindowBusy` while one is open (the caller's or another thread's);
/// `wait_no_window` and an interruptible `Pinning::wait_final` are refused inside
/// the caller's own window (they would wait for themselves), the latter
/// only while pinning is not final; a job admitted is counted until its
/// ticket goes; after close no job is admitted.
#[test]
fn the_non_waiting_and_interruptible_forms_refuse_and_admit_as_the_blocking_ones() {
    let rt = SimRuntime::new();
    let (coord, _) = coordinator(&rt, CapturePolicy::Interleave, 1);
    let stop = || true;
    // No window: each runs at once.
    assert_eq!(coord.try_unsafe_call(|_| 3), Ok(3));
    let ticket = coord.admit_job_outside_windows(|_, t| t).unwrap();
    assert_eq!(coord.activity().jobs_in_flight, 1, "an admitted job is counted while its ticket lives");
    drop(ticket);
    assert_eq!(coord.wait_no_window(Request::new(), None), Ok(true));
    assert_eq!(coord.activity(), Default::default());
    // Inside this thread's own window, pinning not final.
    let own = coord.open_window(Request::new()).unwrap();
    assert_eq!(
        coord.wait_no_window(Request::new(), None),
        Err(ProtocolError::WouldDeadlock { what: "waiting for a transfer" })
    );
    assert_eq!(
        coord.pinning().wait_final(Request::new().interruptible(&stop)),
        Err(ProtocolError::WouldDeadlock { what: "waiting for pinning" })
    );
    assert_eq!(
        coord.admit_job_outside_windows(|_, _| panic!("a job admitted inside its caller's window")).err(),
        Some(ProtocolError::WindowBusy)
    );
    // Pinning final: waiting for it inside a window is an answer, not a wait.
    coord.pinning().finish(PinState::Pageable(PageableReason::Disabled));
    assert_eq!(
        coord.pinning().wait_final(Request::new().interruptible(&stop)),
        Ok(PinState::Pageable(PageableReason::Disabled))
    );
    drop(own);
    // Another thread's window: both refuse, neither runs its callable.
    std::thread::scope(|s| {
        let coord = &coord;
        let close = window_held_on(s, coord);
        until("the other thread's window opens", || coord.activity().windows_open == 1);
        assert_eq!(coord.try_unsafe_call(|_| panic!("ran beside an open window")), Err(ProtocolError::WindowBusy));
        assert_eq!(
            coord.admit_job_outside_windows(|_, _| panic!("a job admitted beside an open window")).err(),
            Some(ProtocolError::WindowBusy)
        );
        close.send(()).unwrap();
    });
    assert_eq!(coord.activity(), Default::default());
    coord.shutdown_steps().close().unwrap();
    assert_eq!(coord.admit_job_outside_windows(|_, t| t).err(), Some(ProtocolError::ShutDown));
}

/// `ShutdownSteps::begin` closes (new jobs refused, pinning asked to stop) and
/// returns only once pinning is final: after it returns, nothing registers
/// any more, so the caller may unregister. The pinner here finishes as
/// soon as it sees the cancellation; repeated, since a shutdown that did
/// not wait would usually, not always, look before the pinner finished.
#[test]
fn begin_shutdown_closes_and_returns_only_once_pinning_is_final() {
    let rt = SimRuntime::new();
    // Pinning never begun: closing settles it (cancelled) at once.
    let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    coord.shutdown_steps().begin().unwrap();
    assert!(matches!(coord.admit_job(), Err(ProtocolError::ShutDown)));
    assert_eq!(coord.pinning().state(), PinState::Pageable(PageableReason::Cancelled));
    assert_eq!(coord.shutdown_steps().begin(), Err(ProtocolError::AlreadyShutDown));
    for round in 0..20 {
        let rt = SimRuntime::new(); // one coordinator per runtime
        let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 1);
        assert!(coord.pinning().begin());
        std::thread::scope(|s| {
            let shutdown = s.spawn(|| {
                coord.shutdown_steps().begin().unwrap();
                coord.pinning().state()
            });
            until("shutdown asks pinning to stop", || coord.pinning().cancelled());
            coord.pinning().finish(PinState::Pageable(PageableReason::Cancelled));
            let seen = shutdown.join().unwrap();
            assert!(seen.is_final(), "round {round}: ShutdownSteps::begin returned with pinning at {seen:?}");
        });
    }
}

/// A transport whose exchange says it began, then blocks until released.
struct Blocked {
    began: std::sync::atomic::AtomicBool,
    release: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Transport for Blocked {
    fn exchange(&self, mine: u32) -> Result<Vec<u32>, String> {
        self.began.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut released = self.release.lock().unwrap();
        while !*released {
            released = self.cv.wait(released).unwrap();
        }
        Ok(vec![mine])
    }
}

/// Issue 43, item 7: a rank whose own cancel (what its shutdown does) ends
/// its wait in the agreement, its region pinned, ends pageable for its own
/// reason, `Cancelled`, not `PeerPageable` (no peer fell back), through
/// the region's words and through a transport alike; its chunks are
/// unregistered.
#[test]
fn a_ranks_own_cancel_during_the_agreement_is_its_own_reason() {
    let transport =
        Arc::new(Blocked { began: false.into(), release: std::sync::Mutex::new(false), cv: std::sync::Condvar::new() });
    let words = Arc::new(LocalSlots::new(2)); // rank 1 never settles
    let settled = || words.load(0) != UNSETTLED;
    let exchanging = || transport.began.load(std::sync::atomic::Ordering::SeqCst);
    let cases: [(RankAgreement, &dyn Fn() -> bool, AgreementError); 2] = [
        (
            RankAgreement::Slots(Agreement { slots: words.clone(), rank: 0, timeout: None }),
            &settled,
            AgreementError::Cancelled { waiting: vec![1] },
        ),
        (RankAgreement::Transport(transport.clone()), &exchanging, AgreementError::ExchangeCancelled),
    ];
    for (agreement, waiting, error) in cases {
        let rt = SimRuntime::new();
        let (coord, _) = coordinator(&rt, CapturePolicy::AfterPinning, 2);
        std::thread::scope(|s| {
            let rank = s.spawn(|| pin_all_agreed_by(&rt, &coord, &NoPrefault, &agreement));
            // Its region pinned, this rank waits for the others.
            until("the rank waits in the agreement", waiting);
            coord.pinning().cancel();
            assert_eq!(rank.join().unwrap(), Err(error));
        });
        assert_eq!(coord.pinning().state(), PinState::Pageable(PageableReason::Cancelled));
        assert_eq!(rt.registered_ranges(), 0);
    }
    *transport.release.lock().unwrap() = true;
    transport.cv.notify_all();
}
