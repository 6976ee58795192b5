//! P5 no lost work, on the staged backend's two streams: every job is
//! reported exactly once, in submission order, and only once all of its
//! work ran: its bytes are where they belong when it is reported, even when
//! it failed half-way.
//!
//! Threads (3 or 4): the engine (main) submitting two jobs of one direction
//! with the staged backend forced and one descriptor a chunk: job 1 moves two
//! GPU pages to or from swapped host pages (two chunks, one on each staging
//! stream), job 2 one page (its chunk on the first stream again, so it may
//! run before job 1's second chunk); a poller thread calling
//! `poll_finished` and checking each job's bytes the moment it is reported
//! (the host pages after a store, the GPU pages, read back, after a load);
//! the sim's device, which runs each stream in order and the streams
//! independently. Two stores; and two loads of which the first fails
//! half-way: its second chunk's host copy cannot be enqueued while its
//! first chunk is already queued on the other stream. (A load runs the same
//! enqueue as a store with the host copy before the kernel.) Each twice:
//! with one device worker (one operation at a time, the oldest ready stream
//! first), preemption bound 3; and with two (`SimConfig::workers`: chunks
//! of the two staging streams run at the same time and finish in either
//! order, as on a GPU), 4 threads, preemption bound 2.
//!
//! Why it holds (`src/transfer/staged.rs`): both staging streams wait for
//! the job's compute-stream event; after its last chunk on each, the
//! handler's stream waits for that stream (`joins`), and only then is the
//! job's completion event recorded on the handler's stream, which the
//! poller queries. So the event covers every chunk, on both streams; a
//! chunk whose enqueue failed ends the job's enqueueing, and the joins
//! still cover what was queued before it. The FIFO per direction is P5's
//! own argument (`model/p5_no_lost_work.rs`).
//!
//! Negative N14: the joins skipped (`Variant::UnjoinedStaging`); loom finds
//! a store reported while its chunks are still queued on a staging stream.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{engine_with_options, fixture_on, host, models, Bounds};
use kvoffload::internal::pin::{pin_all, NoPrefault};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::internal::transfer::{JobBlocks, JobResult};
use kvoffload::{
    Backend, BackendChoice, CapturePolicy, Code, DevicePtr, Direction, GpuRuntime, JobId, PinState, SimConfig,
    SimFault, SimRuntime, TransferOptions,
};

const PAGE: usize = 16;

/// Bytes 1, 2, .. of pages 0-2, page 3 zero: the jobs' source side.
fn source() -> Vec<u8> {
    (0..64u8).map(|i| if i < 48 { i + 1 } else { 0 }).collect()
}

/// Pages `gpu` and `host` after job `r` of direction `dir` was reported:
/// (the destination page, the source page it must hold, what it is).
fn moved(dir: Direction, gpu: usize, host: usize) -> (usize, usize) {
    match dir {
        Direction::DeviceToHost => (host, gpu),
        Direction::HostToDevice => (gpu, host),
    }
}

/// Checks what job `r` of direction `dir` left behind when it was
/// reported: every page of a chunk that was enqueued holds its source.
fn check_reported(rt: &dyn GpuRuntime, dev: DevicePtr, host: usize, dir: Direction, r: &JobResult, failing: bool) {
    let dst = |page: usize| -> Vec<u8> {
        let mut out = vec![0u8; PAGE];
        match dir {
            // SAFETY: the region's first 64 bytes are leaked memory; a job
            // writes them only until it is reported, which this is about.
            Direction::DeviceToHost => {
                out.copy_from_slice(unsafe { std::slice::from_raw_parts((host + page * PAGE) as *const u8, PAGE) })
            }
            // SAFETY: `out` is a writable buffer of PAGE bytes; GPU page
            // `page` is inside the tensor.
            Direction::HostToDevice => {
                unsafe { rt.copy_dtoh(out.as_mut_ptr() as usize, dev.offset(page * PAGE), PAGE) }.unwrap()
            }
        }
        out
    };
    let src = source();
    let want = |page: usize| src[page * PAGE..(page + 1) * PAGE].to_vec();
    // Not vacuous: the job took the staged path (staging buffers made, the
    // plan accepted), not a fallback.
    assert_eq!(r.backend, Backend::Staged, "job {} did not take the staged backend", r.id.0);
    match r.id.0 {
        1 => {
            // GPU page 1 with host page 0 is chunk 0 (host order), GPU page
            // 0 with host page 1 chunk 1, on the other stream.
            assert_eq!(r.error.is_some(), failing, "job 1: {r:?}");
            let (d, s) = moved(dir, 1, 0);
            assert_eq!(dst(d), want(s), "job 1 reported before its first chunk ran");
            if !failing {
                let (d, s) = moved(dir, 0, 1);
                assert_eq!(dst(d), want(s), "job 1 reported before its second chunk ran");
            }
        }
        2 => {
            assert!(r.error.is_none(), "job 2 failed: {r:?}");
            let (d, s) = moved(dir, 2, 2);
            assert_eq!(dst(d), want(s), "job 2 reported before its chunk ran");
        }
        other => panic!("job {other} was never submitted"),
    }
}

fn scenario(variant: Variant, dir: Direction, failing: bool, workers: usize) {
    let sim = SimRuntime::with_config(SimConfig { workers, ..SimConfig::default() });
    let f = fixture_on(sim, CapturePolicy::AfterPinning, variant, 1, 64);
    assert_eq!(pin_all(f.rt.as_ref(), &f.coord, &NoPrefault), PinState::Pinned);
    let opts = TransferOptions {
        backend: BackendChoice::Force(Backend::Staged),
        gather_table_entries: 1,
        staging_ring_entries: 0,
        staging_bytes: 1,
        ..Default::default()
    };
    let (eng, dev, _) = engine_with_options(&f, 1, PAGE, 4, opts);
    // The source side holds `source()`, the destination side zeros.
    let (gpu, on_host) = match dir {
        Direction::DeviceToHost => (source(), vec![0u8; 64]),
        Direction::HostToDevice => (vec![0u8; 64], source()),
    };
    host(&f, 64).copy_from_slice(&on_host);
    // SAFETY: `gpu` is a live local buffer of 64 bytes, the tensor's size.
    unsafe { f.rt.copy_htod(dev, gpu.as_ptr() as usize, 64) }.unwrap();
    let eng = Arc::new(eng);

    let (poller_eng, rt, base) = (eng.clone(), f.rt.clone(), f.base);
    let poller = thread::spawn(move || {
        let mut seen = Vec::new();
        while seen.len() < 2 {
            for r in poller_eng.poll_finished() {
                check_reported(rt.as_ref(), dev, base, dir, &r, failing);
                seen.push(r.id.0);
            }
            thread::yield_now();
        }
        seen
    });
    if failing {
        // Job 1's copy enqueues: a store uploads chunk 0's descriptor, then
        // copies it to the host, then the same for chunk 1; a load copies
        // first. Chunk 1's host copy is the fourth or the third.
        let nth = if dir == Direction::DeviceToHost { 4 } else { 3 };
        f.sim().inject(SimFault::Copy { nth, code: Code::INVALID_VALUE });
    }
    eng.submit(JobId(1), dir, &JobBlocks::single(vec![0, 1], vec![1, 0])).unwrap();
    eng.submit(JobId(2), dir, &JobBlocks::single(vec![2], vec![2])).unwrap();
    let seen = poller.join().unwrap();

    assert_eq!(seen, vec![1, 2], "jobs out of order or lost");
    assert!(eng.poll_finished().is_empty(), "a job was reported twice");
}

/// One device worker (the device runs one operation at a time, the oldest
/// ready stream first): main, poller, worker.
const B: Bounds = Bounds { property: "P5", threads: 3, preemptions: 3, ci: None };

/// Two device workers: the two staging streams' chunks run at the same time
/// and finish in either order (one thread more, so one preemption less).
const B2: Bounds = Bounds { property: "P5", threads: 4, preemptions: 2, ci: None };

models! {
    p5_staged_stores_reported_in_order_after_both_streams:
        check("p5_staged_stores", B.ci_at(2), || scenario(Variant::Production, Direction::DeviceToHost, false, 1));
    p5_staged_load_failing_half_way_reported_failed_after_its_chunk:
        check("p5_staged_failed_load", B.ci_at(2), || scenario(Variant::Production, Direction::HostToDevice, true, 1));
    p5_staged_stores_on_two_device_workers:
        check("p5_staged_stores_2w", B2, || scenario(Variant::Production, Direction::DeviceToHost, false, 2));
    p5_staged_failed_load_on_two_device_workers:
        check("p5_staged_failed_load_2w", B2, || scenario(Variant::Production, Direction::HostToDevice, true, 2));
    negative_n14_staging_streams_not_joined:
        negative("n14_unjoined_staging", Bounds { property: "N14", ..B },
            "reported before its", || scenario(Variant::UnjoinedStaging, Direction::DeviceToHost, false, 1));
}
