//! P6 on the interruptible paths: the coordinator's interruptible waits
//! ask their check a bounded number of times and leave no trace when it
//! stops them, and a capture hook begin interrupted before its window
//! opened hands on the jobs deferred behind it.
//!
//! Time: loom and shuttle model none, and a timed wait never times out
//! there, so in model builds a wait's slice ends at a wake-up of its
//! condition variable (`sync::Slice`): the check may be called after every
//! wake-up at which the wait is still blocked, never without one. The
//! models make the wake-ups themselves (a job ticket admitted and dropped,
//! or a graph token: a release that notifies and changes nothing the wait
//! waits for) and count them (`sync::wakeups`, per thread).
//!
//! - **The check is asked once per wake-up** (3 threads: main, the waiter,
//!   the sim's device thread; pinning not involved). The waiter makes an
//!   interruptible wait of the coordinator that main holds up: a library
//!   call (`unsafe_call` with an interruptible `Request`) behind main's capture window, or a
//!   window request (`open_window`, interruptible) behind main's
//!   capture-unsafe call in flight. Main wakes the waiter once, tells it to
//!   stop (its check's answer turns true), wakes it again, and lets it go.
//!   Property: the check is called at most once per wake-up of the waiter
//!   (calls <= wake-ups, counted by the check itself), with the lock
//!   released (it takes the coordinator's lock itself, as the GIL may be
//!   taken by a thread that waits for it), while the waiter is still
//!   counted as waiting; the waiter either gets what it asked for or is
//!   `Interrupted`, and then it left no trace: not counted as waiting,
//!   nothing open or in flight of its own; at the end nothing at all is
//!   counted (`Activity::default()`).
//!
//!   Negative N34 (`Variant::CheckWithoutNewSlice`: after a check that
//!   said go on, the wait starts no new slice, so it calls the check on
//!   every turn of its loop without waiting): caught, "the check was called
//!   more often than the wait was woken" (from Python, a spin that takes
//!   the GIL each turn).
//! - **An interrupted hook begin hands on what it deferred** (4 threads:
//!   main, the hook thread, a library thread, the sim's device thread; the
//!   pinner joined first). Main makes a gated call (`Offloader::gated`) in
//!   which it wakes the coordinator's waiters once (a graph token). The
//!   hook thread calls the capture hook's `begin` with
//!   `Request::new().interruptible(&check)`, whose check says stop at once: the window opens (and the
//!   thread calls `end`) or, waiting behind main's call, is interrupted.
//!   The library thread submits a slot store at any point: deferred while
//!   the begin's window is marked. Property: once the three are done, no
//!   window is open or waiting and no job is deferred (the interrupted
//!   begin submitted what was deferred behind it, as a close would), the
//!   store is reported exactly once, succeeded, its bytes in its slot; an
//!   interrupted begin left depth 0; the check was called at most once per
//!   wake-up.
//!
//!   Negative N33 (`Variant::HookRefusedBeginKeepsQueue`: a refused or
//!   interrupted begin does not submit the jobs deferred behind it):
//!   caught, "a job deferred behind an interrupted begin was left queued".
//!
//! Why it holds: `wait_while_interruptible` calls the check only once a
//! slice is over and starts a new slice after every check that said go on,
//! so between two checks it waits on the condition variable at least once
//! (in model builds: is woken at least once); it calls the check with the
//! coordinator's lock released and undoes the waiter's count under that
//! lock when it stops, waking the waiters it held back. The hook's begin
//! removes its mark under the hook's lock when the coordinator refused or
//! withdrew its request, and submits the queue (never waiting) when that
//! leaves no hook window open, as the close that leaves none open does.
//! Bounds: preemption bound 3 (the coordinator's waits), 2 (the hook's
//! begin: 4 threads).

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use std::cell::Cell;

use common::offloader::{pinned, stores_landed_then_shutdown, write_block};
use common::{fixture, models, Bounds};
use kvoffload::internal::offloader::activity;
use kvoffload::internal::protocol::{Activity, Coordinator, Variant};
use kvoffload::internal::sync::atomic::{AtomicBool, Ordering};
use kvoffload::internal::sync::{self, thread, Arc};
use kvoffload::{CapturePolicy, JobId, Lane, OffloaderError, ProtocolError, Request, SlotJob};

/// Wake-ups main makes before it tells the waiter to stop, and after;
/// library threads storing a job each beside an interrupted hook begin:
/// loom's size, and shuttle's past it.
const WAKES: usize = common::sized(1, 4);
const LIBRARY_THREADS: usize = common::sized(1, 3);

/// A check for an interruptible wait on this thread: says `stop()`,
/// after asserting that it was called at most once per wake-up of this
/// thread's waits since it was made, and running `inside` (with the
/// coordinator's lock released, the check may take it).
struct CountedCheck {
    base: usize,
    calls: Cell<usize>,
}

impl CountedCheck {
    fn new() -> Self {
        CountedCheck { base: sync::wakeups(), calls: Cell::new(0) }
    }

    fn ask(&self, stop: bool) -> bool {
        let calls = self.calls.get() + 1;
        self.calls.set(calls);
        let woken = sync::wakeups() - self.base;
        assert!(
            calls <= woken,
            "the check was called more often than the wait was woken: {calls} calls, {woken} wake-ups"
        );
        stop
    }
}

/// A release that notifies the coordinator's waiters and changes nothing
/// they wait for: a job ticket admitted and dropped.
fn wake(c: &Coordinator) {
    drop(c.admit_job().expect("a ticket before shutdown"));
}

#[derive(Copy, Clone)]
enum Held {
    /// The waiter's library call behind main's window.
    CallBehindWindow,
    /// The waiter's window request behind main's call in flight.
    WindowBehindCall,
}

fn a_wait_held_up(held: Held, variant: Variant) {
    let f = fixture(CapturePolicy::Interleave, variant, 1, 64);
    let stop = Arc::new(AtomicBool::new(false));
    let (c, s) = (f.coord.clone(), stop.clone());
    let waiter = move || {
        let counted = CountedCheck::new();
        let check = || {
            let a = c.activity();
            let asking = match held {
                Held::CallBehindWindow => a.calls_waiting,
                Held::WindowBehindCall => a.windows_waiting,
            };
            assert_eq!(asking, 1, "the waiter was not counted as waiting while its check ran");
            counted.ask(s.load(Ordering::SeqCst))
        };
        let r = match held {
            Held::CallBehindWindow => c.unsafe_call("the waiter's call", Request::new().interruptible(&check), |_| ()),
            Held::WindowBehindCall => c.open_window(Request::new().interruptible(&check)).map(drop),
        };
        match r {
            Ok(()) => {}
            Err(ProtocolError::Interrupted { .. }) => {
                // Its own counts: main's window (or call) may still be
                // open (in flight), or not.
                let a = c.activity();
                let own = match held {
                    Held::CallBehindWindow => a.calls_in_flight,
                    Held::WindowBehindCall => a.windows_open,
                };
                assert_eq!((a.calls_waiting, a.windows_waiting, own), (0, 0, 0), "an interrupted wait left a trace");
            }
            Err(e) => panic!("the waiter's wait failed: {e}"),
        }
    };
    let c = f.coord.clone();
    let hold_up = move || {
        (0..WAKES).for_each(|_| wake(&c));
        stop.store(true, Ordering::SeqCst);
        (0..WAKES).for_each(|_| wake(&c));
    };
    match held {
        Held::CallBehindWindow => {
            let w = f.coord.open_window(Request::new()).unwrap();
            let t = thread::spawn(waiter);
            hold_up();
            drop(w);
            t.join().unwrap();
        }
        Held::WindowBehindCall => {
            let t = thread::spawn(waiter);
            f.coord.unsafe_call("main's call", Request::new(), |_| hold_up()).unwrap();
            t.join().unwrap();
        }
    }
    assert_eq!(f.coord.activity(), Activity::default(), "something left counted");
}

fn an_interrupted_begin(variant: Variant) {
    let (_rt, off) = pinned(LIBRARY_THREADS.max(2), variant);
    write_block(&off, 0, 0x5a);
    let o_h = off.clone();
    let hook = thread::spawn(move || {
        let counted = CountedCheck::new();
        // Ctrl-C was pressed: stop at the first chance.
        let check = || counted.ask(true);
        match o_h.capture_hook().begin(Request::new().interruptible(&check)) {
            Ok(()) => o_h.capture_hook().end(Request::new()).expect("the close of an opened window"),
            Err(OffloaderError::Protocol(ProtocolError::Interrupted { .. })) => {
                assert_eq!(o_h.capture_hook().depth(), 0, "an interrupted begin left depth");
            }
            Err(e) => panic!("the hook's begin failed: {e}"),
        }
    });
    // Library thread `i` stores GPU block 0 into slot `i`.
    let library: Vec<_> = (0..LIBRARY_THREADS)
        .map(|i| {
            let o_l = off.clone();
            thread::spawn(move || {
                o_l.submit(JobId(1 + i as u64), Lane::Store, &SlotJob::single(&[0], &[i], 0))
                    .expect("a store beside a hook begin is never refused");
            })
        })
        .collect();
    off.gated("the engine's call", Request::new(), |_| {
        drop(off.register_graph().expect("a graph token before shutdown"))
    })
    .unwrap();
    hook.join().unwrap();
    library.into_iter().for_each(|t| t.join().unwrap());
    let a = activity(&off);
    assert_eq!(
        off.capture_hook().deferred_jobs(),
        0,
        "a job deferred behind an interrupted begin was left queued (no hook window open: {a:?})"
    );
    assert_eq!((a.windows_open, a.windows_waiting), (0, 0), "a window left open or waiting");
    stores_landed_then_shutdown(&off, LIBRARY_THREADS, 0x5a);
}

const B: Bounds = Bounds { property: "P6", threads: 3, preemptions: 3, ci: None };
/// Four threads at once (the pinner joined before they start: five in all).
const HOOK: Bounds = Bounds { property: "P6", threads: 5, preemptions: 2, ci: None };

models! {
    p6_interruptible_call_asks_its_check_once_per_wake_up_and_leaves_no_trace:
        check("p6_interruptible_call", B, || a_wait_held_up(Held::CallBehindWindow, Variant::Production));
    p6_interruptible_window_asks_its_check_once_per_wake_up_and_leaves_no_trace:
        check("p6_interruptible_window", B, || a_wait_held_up(Held::WindowBehindCall, Variant::Production));
    p6_interrupted_hook_begin_hands_on_the_jobs_deferred_behind_it:
        check("p6_interrupted_hook_begin", HOOK, || an_interrupted_begin(Variant::Production));
    negative_n34_interruptible_wait_spins_on_its_check:
        negative("n34_check_without_new_slice", Bounds { property: "N34", ..B },
            "the check was called more often than the wait was woken",
            || a_wait_held_up(Held::CallBehindWindow, Variant::CheckWithoutNewSlice));
    negative_n33_interrupted_hook_begin_keeps_its_deferred_jobs:
        negative("n33_hook_refused_begin_keeps_queue", Bounds { property: "N33", ..HOOK },
            "a job deferred behind an interrupted begin was left queued",
            || an_interrupted_begin(Variant::HookRefusedBeginKeepsQueue));
}
