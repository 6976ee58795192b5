//! P1 capture isolation, on the transfer engine's production paths: while
//! the engine captures its compute stream (GLOBAL mode) inside a capture
//! window, a library thread runs the real `TransferEngine::submit`, `wait`,
//! `poll_finished` and the engine's drop. Observable: the capture ends with
//! a graph, no call is refused by the simulated GPU, and the job is
//! reported exactly once, succeeded, with its bytes moved.
//!
//! Threads (3): the engine (main: window, capture of the compute stream,
//! end); a library thread that owns the transfer engine (one store of one
//! 16-byte block on a pinned one-chunk region, `Auto` backend, so the
//! engine holds a gather descriptor table that its drop frees through the
//! gate); the sim's device thread. Preemption bound 3.
//!
//! What it checks beyond P1's first model: `submit` orders its job after
//! the compute stream by recording an event there and making the handler's
//! stream wait for it. Were that event recorded while the compute stream
//! captures, the handler's stream would join the capture (cross-stream
//! capture, conformance scenarios `order/cross_stream_capture_*`). Submit
//! does its check, record and wait inside the coordinator's gate
//! (`Coordinator::admit_job_outside_windows`): no window is open, none
//! opens until they are done, and the engine captures only inside its
//! window. A submit refused because a window is open
//! (`TransferError::CaptureWindowOpen`) is retried once after
//! `Coordinator::wait_no_window`. The sim default-denies: touching the
//! capturing stream from the library thread, or any unmeasured call during
//! the capture, would be refused and invalidate the capture.
//!
//! Negative N9 (`Variant::RacySubmit`): submit as it was before it moved inside the gate,
//! checking the compute stream's status and then recording its event,
//! outside the gate (check-then-act). Loom finds the capture beginning in
//! between: the library thread's record lands on the capturing stream, the
//! sim refuses it and the capture is invalidated.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{capture_memset, engine_with_compute, fixture, host, models, Bounds};
use kvoffload::internal::pin::{pin_all, NoPrefault};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::thread;
use kvoffload::internal::transfer::{JobBlocks, JobResult};
use kvoffload::{BackendChoice, JobId, Request, TransferError};
use kvoffload::{CaptureMode, CapturePolicy, PinState};

fn scenario(variant: Variant) {
    let f = fixture(CapturePolicy::AfterPinning, variant, 1, 64);
    let rt = f.rt.clone();
    assert_eq!(pin_all(rt.as_ref(), &f.coord, &NoPrefault), PinState::Pinned);
    let page = 16;
    host(&f, 64).fill(0);
    let (eng, dev, compute) = engine_with_compute(&f, 1, page, 4, BackendChoice::Auto);
    let pattern: Vec<u8> = (0..16u8).map(|i| i + 1).collect();
    // SAFETY: `pattern` is a live local buffer of 16 bytes; `dev` holds 64.
    unsafe { rt.copy_htod(dev, pattern.as_ptr() as usize, 16) }.unwrap();

    let lcoord = f.coord.clone();
    let library = thread::spawn(move || -> Result<Vec<JobResult>, TransferError> {
        let job = JobBlocks::single(vec![0], vec![0]);
        match eng.store(JobId(1), &job) {
            Err(TransferError::CaptureWindowOpen { .. }) => {
                lcoord.wait_no_window(Request::new(), None).unwrap();
                eng.store(JobId(1), &job)?;
            }
            r => r?,
        }
        // Blocking waits, no spinning: `wait` (gated: it waits while the
        // window is open), then `poll_finished`, which reports the job
        // unless a window is open, in which case wait for the window.
        let mut seen = Vec::new();
        while seen.is_empty() {
            eng.wait(JobId(1))?;
            seen.extend(eng.poll_finished());
            if seen.is_empty() {
                lcoord.wait_no_window(Request::new(), None).unwrap();
            }
        }
        // The engine's drop frees its descriptor tables through the gate
        // (it waits while the window is open).
        drop(eng);
        Ok(seen)
    });

    let w = f.coord.open_window(Request::new()).unwrap();
    // SAFETY: block 3 of the device tensor, never touched by the job (block
    // 0); the memset is only captured.
    let (enq, end) = unsafe { capture_memset(rt.as_ref(), compute, CaptureMode::Global, dev.offset(48), 0xAB, 16) };
    drop(w);
    let seen = library.join().unwrap();

    assert!(end.is_ok() && enq.is_ok(), "capture invalidated by a library call: enqueue {enq:?}, end {end:?}");
    assert!(f.sim().refusals().is_empty(), "the simulated GPU refused a call: {:?}", f.sim().refusals());
    let seen = seen.unwrap();
    assert_eq!(seen.len(), 1, "job reported {seen:?}");
    assert!(seen[0].id == JobId(1) && seen[0].error.is_none(), "job failed: {seen:?}");
    assert_eq!(&host(&f, 16)[..], &pattern[..], "stored bytes wrong");
    rt.graph_destroy(end.unwrap()).unwrap();
}

const B: Bounds = Bounds { property: "P1", threads: 3, preemptions: 3, ci: None };

models! {
    p1_transfer_paths_never_disturb_a_capture_of_the_compute_stream:
        check("p1_transfer_during_capture", B, || scenario(Variant::Production));
    negative_n9_submit_checks_then_records_outside_the_gate:
        negative("n9_racy_submit", Bounds { property: "N9", ..B },
            "capture invalidated", || scenario(Variant::RacySubmit));
}
