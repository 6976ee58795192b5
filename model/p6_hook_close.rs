//! P5 and P6 at the capture hook's close: the deferred queue at every
//! close, by `capture_end` and by `capture_abort`, and a wait for a
//! deferred job from the thread that holds the window it waits behind; on
//! the simulated GPU with pinning final first (its thread joined before
//! the model's threads start).
//!
//! - **The last close empties the queue, by end or by abort** (3 threads:
//!   main, a library thread, the sim's device thread). Main calls
//!   `capture_begin`, then `capture_end`, or `capture_abort` (the
//!   framework's begin failed); the library thread submits a slot store at
//!   any point (deferred while main's window is marked). Property: once
//!   both returned, no window is open and the deferred queue is empty
//!   (nobody polled or waited meanwhile: the close submitted what was
//!   deferred), the store is reported exactly once, succeeded, its bytes in
//!   its slot. Negative N35 (`Variant::HookAbortSkipsFlush`: `capture_abort`
//!   closes its window but leaves the queue; `capture_end` still flushes;
//!   p1_hook.rs's aborted capture cannot see it, its `wait` submits the
//!   queue itself): caught in the abort scenario, "the deferred queue is
//!   not empty after the last close".
//! - **The holder's wait is refused, never a self-deadlock** (3 threads:
//!   main, a library thread, the sim's device thread). Main calls
//!   `capture_begin`; the library thread, once main's window is open,
//!   submits a slot store (deferred) and waits for it (`wait_jobs`, from a
//!   thread without a window: it waits until the job was submitted, then
//!   for its copy). Once the store was submitted, main waits for it itself,
//!   inside its window: `wait`, `wait_jobs`, `wait_all` and the
//!   interruptible `wait_jobs` are each refused with `WouldDeadlock`. Then
//!   main calls `capture_end`. Property: every call returns; main's waits
//!   are refused; the library thread's wait returns; the store is reported
//!   once, succeeded, its bytes in its slot. Negative N36
//!   (`Variant::WaitForOwnDeferredJob`: a blocking wait for a deferred job
//!   does not refuse the thread that holds the hook window): caught, loom's
//!   "deadlock" (main waits for its own close).
//!
//! Why it holds: the close's critical section of the hook's lock drops the
//! coordinator's window and, when no other hook window is open, submits
//! the queue in the same call (`flush_if_last`), for `end` and `abort`
//! alike (one function, `hook_close`); each job leaves the queue in the
//! critical section that submits it, so it is submitted once. A wait for a
//! deferred job looks, under the hook's lock, for the caller among the
//! hook windows' owners before it waits, and refuses if it is one (the job
//! cannot be submitted before that thread's close); the interruptible
//! waits are refused by the coordinator's own check (a wait for the
//! engine's event queries inside one's own window).
//! Bound: preemption bound 3 (3 threads); ci/test explores the positives
//! at bound 2 (`Bounds::ci_at`: bound 3 takes 15-60 s each on 2 cores),
//! `ci/prove --full` at 3.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::offloader::{drain_reports, pinned, poll_n, slot_bytes, stores_landed_then_shutdown, write_block, PAGE};
use common::{models, Bounds, Flag};
use kvoffload::internal::offloader::activity;
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::{JobId, Lane, OffloaderError, ProtocolError, Request, SlotJob};

#[derive(Copy, Clone, Debug)]
enum Close {
    End,
    Abort,
}

/// Stores the library thread submits one after another beside the close
/// (one host slot each): loom's size, and shuttle's past it.
const STORES: usize = common::sized(1, 3);

fn the_last_close(close: Close, variant: Variant) {
    let (_rt, off) = pinned(STORES.max(2), variant);
    write_block(&off, 1, 0x3c);
    let o_l = off.clone();
    let library = thread::spawn(move || {
        for i in 0..STORES {
            o_l.submit(JobId(1 + i as u64), Lane::Store, &SlotJob::single(&[1], &[i], 0))
                .expect("a store beside a hook window is never refused");
        }
    });
    off.capture_hook().begin(Request::new()).unwrap();
    match close {
        Close::End => off.capture_hook().end(Request::new()),
        Close::Abort => off.capture_hook().abort(Request::new()),
    }
    .unwrap();
    library.join().unwrap();
    assert_eq!(
        (off.capture_hook().deferred_jobs(), activity(&off).windows_open),
        (0, 0),
        "the deferred queue is not empty after the last close ({close:?}), or a window is open"
    );
    stores_landed_then_shutdown(&off, STORES, 0x3c);
}

/// `r` is the refusal of a wait inside one's own hook window.
fn refused(r: Result<(), OffloaderError>, what: &str) {
    match r {
        Err(OffloaderError::Protocol(ProtocolError::WouldDeadlock { .. })) => {}
        r => panic!("{what} for a job deferred behind this thread's hook window: {r:?}, not WouldDeadlock"),
    }
}

fn the_holders_wait(variant: Variant) {
    let (_rt, off) = pinned(2, variant);
    write_block(&off, 2, 0x66);
    let (opened, submitted) = (Arc::new(Flag::default()), Arc::new(Flag::default()));
    let (o_l, op, sub) = (off.clone(), opened.clone(), submitted.clone());
    let library = thread::spawn(move || {
        op.wait();
        o_l.submit(JobId(1), Lane::Store, &SlotJob::single(&[2], &[1], 0))
            .expect("a store inside a hook window is deferred, never refused");
        sub.set();
        o_l.wait_jobs(&[JobId(1)], Request::new(), &mut drop).expect("a wait from a thread without a window");
    });
    off.capture_hook().begin(Request::new()).unwrap();
    opened.set();
    submitted.wait();
    refused(off.wait(JobId(1), Request::new(), &mut drop), "wait");
    refused(off.wait_jobs(&[JobId(1)], Request::new(), &mut drop), "wait_jobs");
    refused(off.wait_all(Request::new(), &mut drop), "wait_all");
    let mut sink = |c| panic!("the holder's refused wait reported {c:?}");
    refused(
        off.wait_jobs(&[JobId(1)], Request::new().interruptible(&|| false), &mut sink),
        "the interruptible wait_jobs",
    );
    off.capture_hook().end(Request::new()).unwrap();
    library.join().unwrap();
    let done = poll_n(&off, 1);
    assert!(done[0].error.is_none(), "the store failed: {done:?}");
    assert!(drain_reports(&off).is_empty(), "a job reported twice");
    assert_eq!(slot_bytes(&off, 1), [0x66; PAGE], "the store's bytes are not in its slot");
    off.shutdown(Request::new(), &mut drop).unwrap();
}

/// Four threads spawned in all: the pinner ends before the other two
/// start, so at most three run at once.
const B: Bounds = Bounds { property: "P5", threads: 4, preemptions: 3, ci: None };

models! {
    p5_hook_capture_end_submits_the_deferred_queue_once:
        check("p5_hook_close_by_end", B.ci_at(2), || the_last_close(Close::End, Variant::Production));
    p5_hook_capture_abort_submits_the_deferred_queue_once:
        check("p5_hook_close_by_abort", B.ci_at(2), || the_last_close(Close::Abort, Variant::Production));
    p6_hook_a_holders_wait_for_its_deferred_job_is_refused:
        check("p6_hook_holders_wait", Bounds { property: "P6", ..B }.ci_at(2),
            || the_holders_wait(Variant::Production));
    negative_n35_hook_abort_skips_the_flush:
        negative("n35_hook_abort_skips_flush", Bounds { property: "N35", ..B },
            "the deferred queue is not empty after the last close",
            || the_last_close(Close::Abort, Variant::HookAbortSkipsFlush));
    negative_n36_a_holders_wait_for_its_deferred_job_is_not_refused:
        negative("n36_wait_for_own_deferred_job", Bounds { property: "N36", ..B },
            "deadlock", || the_holders_wait(Variant::WaitForOwnDeferredJob));
}
