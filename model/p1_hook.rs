//! P1 and P6 through the capture hook: the `Offloader`'s own
//! `CaptureHook` (`capture_hook()`: `begin` / `end` / `abort`, no lexical
//! guard; `capture_begin` below is the hook's `begin`, and so on),
//! on the simulated GPU, with the offloader's pinner running.
//!
//! - **A job beside a hooked capture** (4 threads: the engine on main, a
//!   library thread, the offloader's pinner, the sim's device thread). The
//!   engine calls `capture_begin` (the offloader's policy is the default,
//!   AfterPinning, so only the hook's Interleave rule lets the window open
//!   while pinning runs), captures a memset on the compute stream in
//!   GLOBAL mode, ends the capture and calls `capture_end`. The library
//!   thread submits a slot store (`submit` on `Lane::Store`) at any point of that and
//!   waits for it (`wait_jobs`, from a thread that holds no window). In
//!   every interleaving: the capture ends with a graph, the simulated GPU
//!   refused no call (it default-denies any unmeasured call during a
//!   capture and any touch of the capturing stream), the store is reported
//!   once, succeeded, its bytes in its slot, `deferred_seconds > 0` exactly
//!   when it was submitted while the hook's window was open or opening;
//!   pinning ends Pinned and shutdown leaves nothing registered. Paths:
//!   `start`, `capture_begin`, `submit` (direct or deferred),
//!   `wait_jobs` (waiting for a deferred job, then for the copy),
//!   `capture_end` (and its flush of the deferred queue), `poll`,
//!   `wait_pinned`, `shutdown`.
//!
//!   Negative N21 (`Variant::HookFlushesInsideWindow`: `capture_end`
//!   submits the deferred jobs before it closes its window): caught, "a
//!   job of the hooked capture failed" (the submission inside the window
//!   is refused by the coordinator's gate, so the job is lost as failed;
//!   without the gate it would have recorded the order event on the
//!   capturing compute stream, N9's invalidation).
//! - **Two hooked captures** (5 threads, 4 at once: main and a second capture thread,
//!   each `capture_begin`, a THREAD_LOCAL capture of its own stream (a
//!   second begin during a GLOBAL capture is refused), `end`,
//!   `capture_end`; a library thread's `submit` and `wait_jobs`; the
//!   sim's device thread; the pinner, whose pinning is final and which is
//!   joined before the others start): both
//!   captures intact, no refusal, no window and no deferred job left, the
//!   store reported succeeded with its bytes. Checks that only the close
//!   that leaves no hook window open submits the queue, and that a begin
//!   during a flush stops it (the rest left for that window's close).
//! - **An aborted capture** (4 threads: main, the capture thread, the
//!   pinner, the sim's device thread). The capture thread calls
//!   `capture_begin`, the framework's own begin fails (no driver call), it
//!   calls `capture_abort` and ends. Main submits a slot store, waits for
//!   it (`wait`) and for pinning (`wait_pinned`), joins the capture thread
//!   and makes a gated call of its own (`Offloader::gated`, which waits
//!   while any window is open): all return in every interleaving, the
//!   store succeeded. Negative N22
//!   (`Variant::HookAbortKeepsWindow`: `capture_abort` forgets to close)
//!   caught as "deadlock": the window stays open for good, so the pinner
//!   never registers again and main waits for ever, in `wait` (a deferred
//!   job), `wait_pinned` or its gated call (P6, liveness, as N17).
//!
//! Why it holds: while a hook window is open or opening, or deferred jobs
//! wait, a submission is checked and queued under the hook's lock, never
//! handed to the transfer engine; the queue is submitted only while no hook
//! window is open or opening, by whoever finds it so (the close that leaves
//! none open, after the coordinator's window closed; or, after an
//! interrupted close, the next close, blocking wait, poll, submission or
//! shutdown), each job leaving the queue in the critical section of the
//! hook's lock that submits it, so no hook window begins during one (and a
//! begin marks itself under that lock before it asks the coordinator), and
//! two flushes submit each job once, in order. Every capture-unsafe call of a job (the order event on the
//! compute stream, the copies' enqueue) therefore runs inside the
//! coordinator's gate at a moment no window is open (P1's argument for the
//! transfer engine). `capture_abort` drops the coordinator's window and
//! wakes the hook's waiters, as `capture_end` does.
//! Bound: preemption bound 2 (4 threads); ci/test explores the positives at
//! bound 1 (`Bounds::ci_at`), `ci/prove --full` at 2.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::offloader::{lean, offloader_on, poll_n, sim, slot_bytes, write_block, PAGE};
use common::{capture_memset, models, Bounds};
use kvoffload::internal::offloader::activity;
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::{
    shared, CaptureMode, GpuRuntime, JobId, Lane, Offloader, OffloaderOptions, PinState, Request, SimRuntime, SlotJob,
};

/// Host slots (one registration chunk each) and, beside a hooked capture,
/// library threads storing a job each: loom's size, and shuttle's past it.
const SLOTS: usize = common::sized(2, 5);
const LIBRARY_THREADS: usize = common::sized(1, 3);

/// An offloader of one KV tensor of 4 GPU blocks of 64 bytes and `SLOTS`
/// host slots (as many registration chunks), on a simulated GPU.
fn offloader(variant: Variant) -> (Arc<dyn GpuRuntime>, Arc<Offloader>) {
    let rt = shared(SimRuntime::new());
    let opts = lean(OffloaderOptions::with_host_blocks(SLOTS), Some(kvoffload::page_size()));
    (rt.clone(), Arc::new(offloader_on(rt, opts, variant)))
}

fn beside_a_hooked_capture(variant: Variant) {
    let (rt, off) = offloader(variant);
    write_block(&off, 0, 0x5a);
    let d = off.gated("the engine's scratch", Request::new(), |c| c.mem_alloc(64)).unwrap().unwrap();
    let compute = off.geometry().compute_stream();
    off.start().unwrap();
    // Library thread `i` stores GPU block 0 into slot `1 + i`.
    let library: Vec<_> = (0..LIBRARY_THREADS)
        .map(|i| {
            let (o2, job) = (off.clone(), JobId(1 + i as u64));
            thread::spawn(move || {
                o2.submit(job, Lane::Store, &SlotJob::single(&[0], &[1 + i], 0))
                    .expect("a store beside a capture is never refused");
                o2.wait_jobs(&[job], Request::new(), &mut drop).expect("a wait from a thread without a window");
            })
        })
        .collect();
    off.capture_hook().begin(Request::new()).unwrap();
    // SAFETY: `d` is a 64-byte allocation of the sim, never freed; the
    // memset is only captured.
    let (enq, end) = unsafe { capture_memset(rt.as_ref(), compute, CaptureMode::Global, d, 0, 64) };
    off.capture_hook().end(Request::new()).unwrap();
    library.into_iter().for_each(|t| t.join().unwrap());
    assert!(enq.is_ok() && end.is_ok(), "capture invalidated: enqueue {enq:?}, end {end:?}");
    assert!(sim(&rt).refusals().is_empty(), "the simulated GPU refused a call: {:?}", sim(&rt).refusals());
    let done = poll_n(&off, LIBRARY_THREADS);
    for d in &done {
        assert!(d.error.is_none(), "a job of the hooked capture failed: {done:?}");
        assert!(d.deferred_seconds >= 0.0 && d.seconds >= d.deferred_seconds, "{done:?}");
    }
    for i in 0..LIBRARY_THREADS {
        assert_eq!(slot_bytes(&off, 1 + i), [0x5a; PAGE], "the store's bytes are not in its slot");
    }
    rt.graph_destroy(end.unwrap()).unwrap();
    assert_eq!(off.wait_pinned(Request::new()).unwrap().state, PinState::Pinned);
    off.shutdown(Request::new(), &mut drop).unwrap();
    assert_eq!(sim(&rt).registered_ranges(), 0, "region left registered after shutdown");
}

fn an_aborted_capture(variant: Variant) {
    let (_rt, off) = offloader(variant);
    write_block(&off, 2, 0x3c);
    off.start().unwrap();
    let o2 = off.clone();
    let capture = thread::spawn(move || {
        o2.capture_hook().begin(Request::new()).unwrap();
        // The framework's capture begin failed here (before any driver
        // call): the hook aborts.
        o2.capture_hook().abort(Request::new()).unwrap();
    });
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&[2], &[0], 0))
        .expect("a store beside a capture is never refused");
    off.wait(JobId(1), Request::new(), &mut drop).expect("a wait from a thread without a window");
    assert_eq!(off.wait_pinned(Request::new()).unwrap().state, PinState::Pinned);
    capture.join().unwrap();
    // The engine's own gated call after the capture thread ended: it waits
    // while any window is open (a blocking wait, so a window left open is
    // a deadlock loom reports, not a spin).
    off.gated("the engine's call after an aborted capture", Request::new(), |c| c.ctx_synchronize()).unwrap().unwrap();
    let done = poll_n(&off, 1);
    assert!(done[0].error.is_none(), "the store failed: {done:?}");
    assert_eq!(slot_bytes(&off, 0), [0x3c; PAGE]);
    off.shutdown(Request::new(), &mut drop).unwrap();
}

/// Two hook windows on two threads (pinning final first), each around a
/// THREAD_LOCAL capture of its own stream (the sim, like CUDA, refuses a
/// second capture's begin while a GLOBAL one runs), and a library thread's store and
/// wait: the last close submits what was deferred.
fn two_hooked_captures() {
    let (rt, off) = offloader(Variant::Production);
    write_block(&off, 1, 0x77);
    // Pinning runs and ends (its thread joined) before the model's threads.
    assert_eq!(off.wait_pinned(Request::new()).unwrap().state, PinState::Pinned);
    let d = off.gated("the engine's scratch", Request::new(), |c| c.mem_alloc(128)).unwrap().unwrap();
    let s_b = rt.stream_create().unwrap();
    let (o_b, rt_b) = (off.clone(), rt.clone());
    let b = thread::spawn(move || {
        o_b.capture_hook().begin(Request::new()).unwrap();
        // SAFETY: `d` holds 128 bytes of the sim, never freed; the memset
        // is only captured.
        let (enq, end) = unsafe { capture_memset(rt_b.as_ref(), s_b, CaptureMode::ThreadLocal, d.offset(64), 1, 64) };
        o_b.capture_hook().end(Request::new()).unwrap();
        assert!(enq.is_ok() && end.is_ok(), "the second capture was invalidated: enqueue {enq:?}, end {end:?}");
        rt_b.graph_destroy(end.unwrap()).unwrap();
    });
    let o_l = off.clone();
    let library = thread::spawn(move || {
        o_l.submit(JobId(1), Lane::Store, &SlotJob::single(&[1], &[0], 0))
            .expect("a store beside two captures is never refused");
        o_l.wait_jobs(&[JobId(1)], Request::new(), &mut drop).expect("a wait from a thread without a window");
    });
    let compute = off.geometry().compute_stream();
    off.capture_hook().begin(Request::new()).unwrap();
    // SAFETY: as above, the first 64 bytes of `d`.
    let (enq, end) = unsafe { capture_memset(rt.as_ref(), compute, CaptureMode::ThreadLocal, d, 0, 64) };
    off.capture_hook().end(Request::new()).unwrap();
    b.join().unwrap();
    library.join().unwrap();
    assert!(enq.is_ok() && end.is_ok(), "the first capture was invalidated: enqueue {enq:?}, end {end:?}");
    assert!(sim(&rt).refusals().is_empty(), "the simulated GPU refused a call: {:?}", sim(&rt).refusals());
    assert_eq!(
        (activity(&off).windows_open, off.capture_hook().deferred_jobs()),
        (0, 0),
        "a window or a deferred job left"
    );
    let done = poll_n(&off, 1);
    assert!(done[0].error.is_none(), "the job beside two captures failed: {done:?}");
    assert_eq!(slot_bytes(&off, 0), [0x77; PAGE], "the store's bytes are not in its slot");
    rt.graph_destroy(end.unwrap()).unwrap();
    off.shutdown(Request::new(), &mut drop).unwrap();
}

const B: Bounds = Bounds { property: "P1", threads: 4, preemptions: 2, ci: None };

models! {
    // Five threads spawned in all: the pinner ends before the other three
    // start, so at most four run at once.
    p1_hook_two_hooked_captures_and_a_job_the_last_close_submits:
        check("p1_hook_two_captures", Bounds { threads: 5, ..B }.ci_at(1), two_hooked_captures);
    p1_hook_a_job_beside_a_hooked_capture_never_disturbs_it:
        check("p1_hook_job_beside_capture", B.ci_at(1), || beside_a_hooked_capture(Variant::Production));
    p6_hook_an_aborted_capture_closes_its_window:
        check("p6_hook_aborted_capture", Bounds { property: "P6", ..B }.ci_at(1),
            || an_aborted_capture(Variant::Production));
    negative_n21_hook_submits_deferred_jobs_inside_its_window:
        negative("n21_hook_flushes_inside_window", Bounds { property: "N21", ..B },
            "a job of the hooked capture failed", || beside_a_hooked_capture(Variant::HookFlushesInsideWindow));
    negative_n22_hook_abort_forgets_to_close:
        negative("n22_hook_abort_keeps_window", Bounds { property: "N22", ..B },
            "deadlock", || an_aborted_capture(Variant::HookAbortKeepsWindow));
}
