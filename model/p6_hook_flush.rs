//! P6 and P4 through the capture hook's flush: the deferred jobs' flush
//! waiting for an engine's own window (`Offloader::capture_window`, a
//! lexical window on another thread), beside a second hook window and
//! beside shutdown, on the simulated GPU with pinning final first (its
//! thread joined before the model's threads start).
//!
//! - **A close never waits for another thread's hook window** (P6; main,
//!   a second hook thread, an engine thread, the sim's device thread).
//!   Main calls `capture_begin`, submits a slot store (deferred behind its
//!   own window) and calls `capture_end`, whose flush meets the engine
//!   thread's window at any point (`capture_window`, then drop) and waits
//!   for it. The second thread calls `capture_begin` and holds its window
//!   until main's `capture_end` has returned, then calls `capture_end`.
//!   Property: every call returns (a close that waited for the second
//!   window would wait for ever: loom's "deadlock"); the store is reported
//!   once, succeeded, its bytes in its slot; no window and no deferred job
//!   is left; shutdown succeeds and leaves nothing registered.
//!
//!   Negative N30 (`Variant::HookFlushWaitsForEveryWindow`: the flush's
//!   wait for the engine's window is `Coordinator::wait_no_window`, which
//!   also waits for any window that opens meanwhile): caught, "deadlock",
//!   in the same scenario with the engine's close after the second hook
//!   window opened (the order that deadlocks; left to the scheduler, shuttle's
//!   300 + 300 schedules of ci/test missed it, its 20000 + 20000 did not).
//!   It is the flush as it was before this model: the gap "a flush that
//!   waits for an engine's own window" of docs/PROOFS.md.
//! - **Shutdown beside the hook's flushers** (P4; main, an engine
//!   thread, the sim's device thread). Main calls `capture_begin`, submits
//!   a slot store, calls `capture_end` (its flush waits for the engine's
//!   window, or leaves the queue to a window that began) and then
//!   `shutdown`. The engine thread opens its own window, calls
//!   `capture_begin` inside it (refused, `NestedWindow`: that begin's
//!   flush, never waiting, leaves the store queued when the engine's
//!   window refuses it), closes its window and calls `shutdown`.
//!   Property: each shutdown either succeeds once, or is refused with
//!   nothing changed: `WindowOpen` naming at least one window (a refusal
//!   names what it saw), or `AlreadyShutDown`; if neither succeeded a
//!   later one does. The store, once submitted, is drained with its bytes
//!   in its slot, and nothing stays registered. Paths: `capture_window`,
//!   `capture_begin` (refused inside an engine window, its flush),
//!   `capture_end` (its flush, waiting or left to a begin), `submit`
//!   (deferred), `shutdown` (refused while a hook window is open or
//!   opening, waiting for a flush in progress, flushing itself, refused
//!   for an engine window, done).
//!
//! Why it holds: a flush waits for an engine window only after a
//! submission was refused, with the hook's lock released, and that wait
//! (`Coordinator::wait_no_window` with a `since`) ends when no window blocks
//! library calls or when a window was requested after the flush read the
//! request count, under the hook's lock. A hook window's begin marks
//! itself under the hook's lock before it asks the coordinator, so its
//! request comes after that reading and the flush, taking the lock again,
//! finds the mark and stops, leaving the rest to that window's close. So
//! a close waits only for engine windows, which close without the hook
//! (P6). Shutdown refuses while a hook window is marked, waits on the
//! hook's condition variable for a flush in progress only while no window
//! is open (the flush then waits for nothing that shutdown holds), flushes
//! a queue left behind under the hook's lock, and refuses for an engine
//! window with the count it read once, so `open >= 1`; everything before
//! the coordinator's `close` changes no state a later call sees (P4).
//! Bound: preemption bound 2 (5 threads and 4, the pinner's among them,
//! joined before the others start); ci/test explores them at
//! bound 1 (`Bounds::ci_at`), `ci/prove --full` at 2.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::offloader::{lean, offloader_on, poll_n, sim, write_block, PAGE};
use common::{models, Bounds};
use kvoffload::internal::offloader::activity;
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{self, thread, Arc, Condvar, Mutex};
use kvoffload::{
    shared, GpuRuntime, JobId, Lane, Offloader, OffloaderError, OffloaderOptions, PinState, ProtocolError, Request,
    SimRuntime, SlotJob,
};

/// An offloader of one KV tensor of 4 GPU blocks of 64 bytes and 2 host
/// slots, on a simulated GPU, pinned (its pinner joined) before it returns.
fn pinned_offloader(variant: Variant) -> (Arc<dyn GpuRuntime>, Arc<Offloader>) {
    let rt = shared(SimRuntime::new());
    let opts = lean(OffloaderOptions::with_host_blocks(2), None);
    let off = Arc::new(offloader_on(rt.clone(), opts, variant));
    assert_eq!(off.wait_pinned(Request::new()).unwrap().state, PinState::Pinned);
    (rt, off)
}

/// Host slot `slot`'s page, read from the region (mapped until the
/// offloader is dropped, also after shutdown).
fn slot_bytes(off: &Offloader, slot: usize) -> [u8; PAGE] {
    let addr = off.geometry().layout.host_addr(0, 0, slot, 0);
    let mut out = [0u8; PAGE];
    // SAFETY: a page of this rank's slot of the mapped region; the job
    // that wrote it was reported or drained.
    out.copy_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, PAGE) });
    out
}

/// A flag one thread sets and another waits for (a blocking wait: one
/// that never ends is loom's deadlock, not a spin).
#[derive(Default)]
struct Flag {
    set: Mutex<bool>,
    cv: Condvar,
}

impl Flag {
    fn set(&self) {
        *sync::lock(&self.set) = true;
        self.cv.notify_all();
    }

    fn wait(&self) {
        let mut g = sync::lock(&self.set);
        while !*g {
            g = sync::wait(&self.cv, g);
        }
    }
}

/// With `engine_waits_for_second`, the engine thread closes its window only
/// once the second thread's hook window is open (the order in which a
/// close that waits for every window meets the second one): N30's
/// scenario, so that shuttle's quick pass reaches it too; the positive
/// leaves the engine's close to the scheduler.
fn a_close_beside_another_hook_window(variant: Variant, engine_waits_for_second: bool) {
    let (rt, off) = pinned_offloader(variant);
    write_block(&off, 0, 0x5a);
    let main_closed = Arc::new(Flag::default());
    let second_open = Arc::new(Flag::default());
    let (o_b, closed, opened) = (off.clone(), main_closed.clone(), second_open.clone());
    let second = thread::spawn(move || {
        o_b.capture_hook().begin(Request::new()).unwrap();
        opened.set();
        // Held until main's close returned: a close that waits for this
        // window never returns.
        closed.wait();
        o_b.capture_hook().end(Request::new()).unwrap();
    });
    let o_e = off.clone();
    let engine = thread::spawn(move || {
        let w = o_e.capture_window(Request::new()).expect("an engine window before shutdown");
        if engine_waits_for_second {
            second_open.wait();
        }
        drop(w);
    });
    off.capture_hook().begin(Request::new()).unwrap();
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0], &[0], 0))
        .expect("a store inside a hook window is deferred, never refused");
    off.capture_hook().end(Request::new()).expect("a close that waits for an engine window ends with it");
    main_closed.set();
    second.join().unwrap();
    engine.join().unwrap();
    assert_eq!(
        (activity(&off).windows_open, off.capture_hook().deferred_jobs()),
        (0, 0),
        "a window or a deferred job left"
    );
    let done = poll_n(&off, 1);
    assert!(done.len() == 1 && done[0].error.is_none(), "the deferred store: {done:?}");
    assert_eq!(slot_bytes(&off, 0), [0x5a; PAGE], "the store's bytes are not in its slot");
    off.shutdown(Request::new(), &mut drop).unwrap();
    assert_eq!(sim(&rt).registered_ranges(), 0, "region left registered after shutdown");
}

/// Whether `r`, a shutdown's result, is one a shutdown may return here:
/// done (true), or refused naming what it saw (false).
fn settled(r: Result<(), OffloaderError>, who: &str) -> bool {
    match r {
        Ok(()) => true,
        Err(OffloaderError::Protocol(ProtocolError::WindowOpen { open })) => {
            assert!(open >= 1, "{who}'s shutdown was refused for {open} open windows");
            false
        }
        Err(OffloaderError::Protocol(ProtocolError::AlreadyShutDown)) => false,
        Err(e) => panic!("{who}'s shutdown failed: {e}"),
    }
}

fn shutdown_beside_the_hooks_flushers(variant: Variant) {
    let (rt, off) = pinned_offloader(variant);
    write_block(&off, 1, 0x3c);
    let o_e = off.clone();
    let engine = thread::spawn(move || {
        // Refused once main's shutdown is done.
        if let Ok(w) = o_e.capture_window(Request::new()) {
            // The framework's capture hooked inside the engine's own
            // window: refused, and its flush leaves what the window
            // refuses queued.
            match o_e.capture_hook().begin(Request::new()) {
                Err(OffloaderError::Protocol(ProtocolError::NestedWindow)) => {}
                r => panic!("a hook begin inside an engine window: {r:?}"),
            }
            drop(w);
        }
        settled(o_e.shutdown(Request::new(), &mut drop), "the engine thread")
    });
    let mut submitted = false;
    if off.capture_hook().begin(Request::new()).is_ok() {
        off.submit(JobId(1), Lane::Store, &SlotJob::single(&[1], &[0], 0))
            .expect("a store inside a hook window is deferred, never refused");
        submitted = true;
        off.capture_hook().end(Request::new()).expect("a close that waits for an engine window ends with it");
    }
    let mine = settled(off.shutdown(Request::new(), &mut drop), "main");
    let theirs = engine.join().unwrap();
    assert!(!(mine && theirs), "two shutdowns succeeded");
    if !mine && !theirs {
        // Both refused: nothing changed, so a shutdown now succeeds.
        off.shutdown(Request::new(), &mut drop).expect("a shutdown after refused ones");
    }
    if submitted {
        assert_eq!(slot_bytes(&off, 0), [0x3c; PAGE], "the deferred store was not drained by shutdown");
    }
    assert_eq!(sim(&rt).registered_ranges(), 0, "region left registered after shutdown");
}

/// Five threads spawned in all (main's pinner ends before the others
/// start, so at most four run at once).
const B: Bounds = Bounds { property: "P6", threads: 5, preemptions: 2, ci: None };

models! {
    p6_hook_a_close_never_waits_for_another_threads_hook_window:
        check("p6_hook_close_beside_hook_window", B.ci_at(1),
            || a_close_beside_another_hook_window(Variant::Production, false));
    p4_hook_shutdown_beside_the_flushers_refuses_naming_a_window_or_drains:
        check("p4_hook_shutdown_beside_flushers", Bounds { property: "P4", threads: 4, ..B }.ci_at(1),
            || shutdown_beside_the_hooks_flushers(Variant::Production));
    negative_n30_hook_flush_waits_for_every_window:
        negative("n30_hook_flush_waits_for_every_window", Bounds { property: "N30", ..B },
            "deadlock", || a_close_beside_another_hook_window(Variant::HookFlushWaitsForEveryWindow, true));
}
