//! The coordinator's interruptible waits: an interrupted
//! wait returns `Interrupted` and leaves no trace (the coordinator's
//! activity as before the call; a later window opens), its check is called
//! with the coordinator's lock released, and the blocked parties it held
//! back are woken.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use kvoffload::internal::protocol::{Activity, Coordinator};
use kvoffload::internal::runtime::sim::HoldPoint;
use kvoffload::{CapturePolicy, PageableReason, PinState, ProtocolError, Request, SimRuntime};

/// A coordinator over `chunks` chunks of 4096 bytes of heap memory, which
/// it holds.
fn coordinator(rt: &SimRuntime, policy: CapturePolicy, chunks: usize) -> Arc<Coordinator> {
    let mem = vec![0u8; chunks * 4096];
    let ranges: Vec<(usize, usize)> = (0..chunks).map(|i| (mem.as_ptr() as usize + i * 4096, 4096)).collect();
    // SAFETY: the chunks are pieces of `mem`'s heap buffer (read-write),
    // which the coordinator holds (moving the Vec does not move the buffer).
    unsafe { Coordinator::new(rt, policy, &ranges, Some(Box::new(mem))) }.unwrap()
}

/// Spins (yielding) until `cond` holds: the tests' way of knowing a thread
/// is waiting before they let it go (as tests/protocol.rs does).
fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        thread::yield_now();
    }
}

/// The interrupt check of one waiter: `stop` makes it say so; `calls`
/// counts how often it was asked.
#[derive(Clone, Default)]
struct Flag {
    stop: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
}

impl Flag {
    fn check(&self) -> bool {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.stop.load(Ordering::SeqCst)
    }
    fn raise(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

/// Raises `flag` once it has been asked at least once (the waiter is then
/// inside its wait, between slices), and returns the moment it did.
fn raise_once_asked(flag: &Flag) -> Instant {
    until(|| flag.calls() > 0);
    flag.raise();
    Instant::now()
}

#[test]
fn an_interrupted_window_request_leaves_no_trace_and_a_later_window_opens() {
    let rt = SimRuntime::new();
    // Pinning not final: with AfterPinning a window waits.
    let coord = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    let before = coord.activity();
    assert_eq!(before, Activity::default());
    let flag = Flag::default();
    let engine = {
        let (coord, flag) = (coord.clone(), flag.clone());
        thread::spawn(move || {
            coord.open_window(Request::new().interruptible(&|| flag.check())).map(|w| w.chunks_waited())
        })
    };
    until(|| coord.activity().windows_waiting == 1);
    assert_eq!(flag.calls(), 0, "asked before the first slice passed");
    let raised = raise_once_asked(&flag);
    let r = engine.join().unwrap();
    let latency = raised.elapsed();
    assert_eq!(r, Err(ProtocolError::Interrupted { what: "a capture window" }));
    println!("window request: returned {latency:?} after its check said stop");
    assert!(latency < Duration::from_secs(2), "the interrupted request returned after {latency:?}");
    // No trace: nothing open, nothing waiting, nothing counted.
    assert_eq!(coord.activity(), before);
    assert_eq!(coord.activity().windows_open, 0);
    // A later window opens once the policy allows it, and waited for no chunk.
    coord.pinning().finish(PinState::Pageable(PageableReason::Disabled));
    let w = coord.open_window(Request::new()).unwrap();
    assert_eq!((w.chunks_waited(), coord.activity().windows_open), (0, 1));
    drop(w);
    // And an interruptible request that is never interrupted opens as the
    // blocking form does, without ever asking (no wait).
    let quiet = Flag::default();
    let w = coord.open_window(Request::new().interruptible(&|| quiet.check())).unwrap();
    assert_eq!((coord.activity().windows_open, quiet.calls()), (1, 0));
    drop(w);
    assert_eq!(coord.activity(), before);
}

#[test]
fn a_withdrawn_request_wakes_the_library_call_it_held_back() {
    let rt = Arc::new(SimRuntime::new());
    let coord = coordinator(&rt, CapturePolicy::Interleave, 2);
    // A registration held inside the driver (a capture-unsafe call in
    // flight): a window asking now waits for it.
    let hold = rt.hold(HoldPoint::Register);
    let pinner = {
        let (rt, coord) = (rt.clone(), coord.clone());
        thread::spawn(move || coord.pinning().register_chunk(rt.as_ref(), 0).unwrap().unwrap())
    };
    hold.wait_entered();
    let flag = Flag::default();
    let engine = {
        let (coord, flag) = (coord.clone(), flag.clone());
        thread::spawn(move || coord.open_window(Request::new().interruptible(&|| flag.check())).map(|_| ()))
    };
    until(|| coord.activity().windows_waiting == 1);
    // A second library call now defers to the waiting window (their turn
    // is the window's): it waits while the request waits.
    let call = {
        let coord = coord.clone();
        thread::spawn(move || coord.unsafe_call("a call behind the window", Request::new(), |_| ()))
    };
    until(|| coord.activity().calls_waiting == 1);
    let with_request = coord.activity();
    assert_eq!((with_request.calls_in_flight, with_request.windows_waiting), (1, 1));
    raise_once_asked(&flag);
    assert_eq!(engine.join().unwrap(), Err(ProtocolError::Interrupted { what: "a capture window" }));
    // Withdrawn: the call it held back was woken and ran (while the
    // registration is still held, so nothing else could have woken it).
    call.join().unwrap().unwrap();
    assert_eq!(coord.activity(), Activity { windows_waiting: 0, calls_waiting: 0, ..with_request });
    hold.release();
    pinner.join().unwrap();
    assert_eq!(coord.activity(), Activity::default());
    let w = coord.open_window(Request::new()).unwrap();
    drop(w);
    coord.pinning().unregister_all(rt.as_ref()).unwrap();
}

#[test]
fn the_check_runs_with_the_lock_released() {
    let rt = SimRuntime::new();
    let coord = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    // The check takes the coordinator's lock itself (`activity`): called
    // under the lock it would deadlock (std's mutex is not reentrant). It
    // sees its own request counted, and stops at the third call.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let r = {
        let (c, seen) = (coord.clone(), seen.clone());
        let check = move || {
            let mut s = seen.lock().unwrap();
            s.push(c.activity().windows_waiting);
            s.len() >= 3
        };
        coord.open_window(Request::new().interruptible(&check)).map(|_| ())
    };
    assert_eq!(r, Err(ProtocolError::Interrupted { what: "a capture window" }));
    assert_eq!(*seen.lock().unwrap(), vec![1, 1, 1]);
    assert_eq!(coord.activity(), Activity::default());
}

#[test]
fn an_interrupted_wait_for_pinning_is_uncounted_and_pinning_goes_on() {
    let rt = SimRuntime::new();
    let coord = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    assert!(coord.pinning().begin());
    let flag = Flag::default();
    let waiter = {
        let (coord, flag) = (coord.clone(), flag.clone());
        thread::spawn(move || coord.pinning().wait_final(Request::new().interruptible(&|| flag.check())))
    };
    until(|| coord.activity().pin_waiters == 1);
    raise_once_asked(&flag);
    assert_eq!(waiter.join().unwrap(), Err(ProtocolError::Interrupted { what: "pinning" }));
    assert_eq!(coord.activity(), Activity::default());
    assert_eq!(coord.pinning().state(), PinState::Pinning { done: 0, total: 1 });
    // Pinning goes on; a later wait sees it final.
    coord.pinning().register_chunk(&rt, 0).unwrap().unwrap();
    coord.pinning().finish(PinState::Pinned);
    let quiet = Flag::default();
    assert_eq!(coord.pinning().wait_final(Request::new().interruptible(&|| quiet.check())), Ok(PinState::Pinned));
    assert_eq!(quiet.calls(), 0);
    coord.pinning().unregister_all(&rt).unwrap();
}

#[test]
fn an_interrupted_wait_for_windows_to_close() {
    let rt = SimRuntime::new();
    let coord = coordinator(&rt, CapturePolicy::Interleave, 1);
    let w = coord.open_window(Request::new()).unwrap();
    // Inside one's own window: refused, as the blocking form is.
    let never = Flag::default();
    assert_eq!(
        coord.wait_no_window(Request::new().interruptible(&|| never.check()), None),
        Err(ProtocolError::WouldDeadlock { what: "waiting for a transfer" })
    );
    let flag = Flag::default();
    let poller = {
        let (coord, flag) = (coord.clone(), flag.clone());
        thread::spawn(move || coord.wait_no_window(Request::new().interruptible(&|| flag.check()), None))
    };
    raise_once_asked(&flag);
    assert_eq!(poller.join().unwrap(), Err(ProtocolError::Interrupted { what: "capture windows to close" }));
    assert_eq!(coord.activity(), Activity { windows_open: 1, ..Activity::default() });
    drop(w);
    assert_eq!(coord.wait_no_window(Request::new().interruptible(&|| never.check()), None), Ok(true));
    assert_eq!(never.calls(), 0);
}

/// `wait_no_window` with a `since` (the capture hook's flush): it waits for
/// the windows open at its reading of `window_requests` like
/// `wait_no_window` without one, and also ends, `Ok(false)`, at a window requested
/// after that reading; `Ok(true)` once no window holds library calls back;
/// refused inside one's own window; interruptible.
#[test]
fn a_wait_for_windows_ends_at_a_later_request() {
    let rt = SimRuntime::new();
    let coord = coordinator(&rt, CapturePolicy::Interleave, 1);
    let before = coord.window_requests();
    let w = coord.open_window(Request::new()).unwrap();
    assert_eq!(coord.window_requests(), before + 1, "a request is counted");
    assert_eq!(
        coord.wait_no_window(Request::new(), Some(coord.window_requests())),
        Err(ProtocolError::WouldDeadlock { what: "waiting for a transfer" })
    );
    // A wait from the count now, on another thread: main's window holds it.
    let since = coord.window_requests();
    let waiter = {
        let coord = coord.clone();
        thread::spawn(move || coord.wait_no_window(Request::new(), Some(since)))
    };
    // A second window, requested (and opened) on a third thread after the
    // reading, ends the wait at once, both windows still open.
    let (opened_tx, opened_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let second = {
        let coord = coord.clone();
        thread::spawn(move || {
            let w2 = coord.open_window(Request::new()).unwrap();
            opened_tx.send(()).unwrap();
            release_rx.recv().unwrap();
            drop(w2);
        })
    };
    opened_rx.recv().unwrap();
    assert_eq!(waiter.join().unwrap(), Ok(false), "the wait did not end at the later request");
    assert_eq!(coord.activity().windows_open, 2);
    // A wait from the count now (the second window's request before it)
    // lasts until both windows closed; interruptible, it is asked while it
    // waits and not stopped.
    let since = coord.window_requests();
    let quiet = Flag::default();
    let waiter = {
        let (coord, quiet) = (coord.clone(), quiet.clone());
        thread::spawn(move || coord.wait_no_window(Request::new().interruptible(&|| quiet.check()), Some(since)))
    };
    until(|| quiet.calls() > 0);
    drop(w);
    release_tx.send(()).unwrap();
    second.join().unwrap();
    assert_eq!(waiter.join().unwrap(), Ok(true));
    // Interrupted: stopped, nothing changed.
    let w = coord.open_window(Request::new()).unwrap();
    let flag = Flag::default();
    let waiter = {
        let (coord, flag) = (coord.clone(), flag.clone());
        let since = coord.window_requests();
        thread::spawn(move || coord.wait_no_window(Request::new().interruptible(&|| flag.check()), Some(since)))
    };
    raise_once_asked(&flag);
    assert_eq!(waiter.join().unwrap(), Err(ProtocolError::Interrupted { what: "capture windows to close" }));
    assert_eq!(coord.activity(), Activity { windows_open: 1, ..Activity::default() });
    drop(w);
}

#[test]
fn a_request_that_can_open_is_not_asked_and_shutdown_still_ends_a_wait() {
    let rt = SimRuntime::new();
    let coord = coordinator(&rt, CapturePolicy::AfterPinning, 1);
    let flag = Flag::default();
    let engine = {
        let (coord, flag) = (coord.clone(), flag.clone());
        thread::spawn(move || coord.open_window(Request::new().interruptible(&|| flag.check())).map(|_| ()))
    };
    until(|| coord.activity().windows_waiting == 1);
    // Shutdown ends the wait with ShutDown, as for the blocking form.
    coord.shutdown_steps().close().unwrap();
    assert_eq!(engine.join().unwrap(), Err(ProtocolError::ShutDown));
    assert_eq!(coord.activity().windows_waiting, 0);
    assert!(!flag.stop.load(Ordering::SeqCst));
}

/// `Coordinator::unsafe_call` with an interruptible request (the offloader's `gated` with
/// an interrupt check): runs at once when no window is open, without
/// asking; refused inside the caller's own window; while it waits it is
/// counted as waiting, and once its check says stop it returns
/// `Interrupted`, its callable never ran, it is no longer counted, and a
/// window its turn held back opens.
#[test]
fn an_interrupted_library_call_never_runs_and_lets_the_windows_it_held_back_open() {
    let rt = SimRuntime::new();
    let coord = coordinator(&rt, CapturePolicy::Interleave, 1);
    let what = "an interruptible library call";
    // No window: it runs at once, and a check that would stop it is never asked.
    let stop_if_asked = Flag::default();
    stop_if_asked.raise();
    assert_eq!(coord.unsafe_call(what, Request::new().interruptible(&|| stop_if_asked.check()), |_| 7), Ok(7));
    assert_eq!((stop_if_asked.calls(), coord.activity()), (0, Activity::default()));
    // Inside this thread's own window: refused (it would wait for itself).
    let own = coord.open_window(Request::new()).unwrap();
    assert_eq!(
        coord.unsafe_call(what, Request::new().interruptible(&|| stop_if_asked.check()), |_| panic!(
            "ran inside its own window"
        )),
        Err(ProtocolError::WouldDeadlock { what })
    );
    drop(own);
    // Two windows open on threads (held until told to close); the call waits.
    let (first_tx, first_rx) = std::sync::mpsc::channel::<()>();
    let (second_tx, second_rx) = std::sync::mpsc::channel::<()>();
    let window_until = |rx: std::sync::mpsc::Receiver<()>| {
        let coord = coord.clone();
        thread::spawn(move || {
            let w = coord.open_window(Request::new()).unwrap();
            rx.recv().unwrap();
            drop(w);
        })
    };
    let first = window_until(first_rx);
    let second = window_until(second_rx);
    until(|| coord.activity().windows_open == 2);
    let flag = Flag::default();
    let call = {
        let (coord, flag) = (coord.clone(), flag.clone());
        thread::spawn(move || {
            coord.unsafe_call(what, Request::new().interruptible(&|| flag.check()), |_| {
                panic!("the interrupted call ran")
            })
        })
    };
    until(|| coord.activity().calls_waiting == 1);
    // The first window closes: the turn is the call's, so a third window
    // asking now waits behind it.
    first_tx.send(()).unwrap();
    first.join().unwrap();
    let third = {
        let coord = coord.clone();
        thread::spawn(move || drop(coord.open_window(Request::new()).unwrap()))
    };
    until(|| coord.activity().windows_waiting == 1);
    assert_eq!(
        coord.activity(),
        Activity { windows_open: 1, windows_waiting: 1, calls_waiting: 1, ..Activity::default() }
    );
    // Interrupted: it never ran, is no longer counted, and the third window
    // opens (beside the second, which is still open: only the withdrawal
    // can have let it go).
    raise_once_asked(&flag);
    assert_eq!(call.join().unwrap(), Err(ProtocolError::Interrupted { what }));
    third.join().unwrap();
    assert_eq!(coord.activity(), Activity { windows_open: 1, ..Activity::default() });
    second_tx.send(()).unwrap();
    second.join().unwrap();
    assert_eq!(coord.activity(), Activity::default());
}
