//! The transfer engine on the simulated GPU: every byte of random layouts
//! and jobs in both directions for every backend, ordering after compute,
//! in-order reporting, failed jobs, typed errors, shutdown, the gather
//! kernel kept off unregistered memory, and polling during a capture window.

#[path = "transfer_common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{gated, opts, random_case, simple, Pin, Rig, Rng, Shape, DIRS};
use kvoffload::internal::runtime::sim::{Blocked, HoldPoint};
use kvoffload::internal::transfer::JobBlocks;
use kvoffload::{
    Backend, BackendChoice, CaptureMode, Code, Direction, GpuRuntime, HostPlacement, JobId, ProtocolError, Request,
    SimFault, SimRuntime, TransferError, TransferOptions,
};

fn sim() -> (Arc<SimRuntime>, Arc<dyn GpuRuntime>) {
    let s = Arc::new(SimRuntime::new());
    let rt: Arc<dyn GpuRuntime> = s.clone();
    (s, rt)
}

/// A simulated GPU and a rig on it of one tensor of `blocks` pages of
/// `page` bytes, registered, its backend chosen by `choice`.
fn one_tensor_rig(page: usize, blocks: usize, choice: BackendChoice) -> (Arc<SimRuntime>, Arc<dyn GpuRuntime>, Rig) {
    let (s, rt) = sim();
    (s, rt.clone(), Rig::new(rt, simple(1, page, blocks), opts(choice), Pin::Registered))
}

fn random_layouts(choice: BackendChoice, expect: Option<Backend>, seed: u64) {
    let mut rng = Rng(seed);
    for case in 0..24 {
        let (s, rt) = sim();
        random_case(rt, &mut rng, case, choice, expect, seed);
        assert_eq!(s.poisoned(), None);
    }
}

#[test]
fn every_byte_per_fragment() {
    random_layouts(BackendChoice::Force(Backend::PerFragment), Some(Backend::PerFragment), 1);
}

#[test]
fn every_byte_batched() {
    random_layouts(BackendChoice::Force(Backend::Batched), Some(Backend::Batched), 2);
}

#[test]
fn every_byte_gather() {
    random_layouts(BackendChoice::Force(Backend::Gather), Some(Backend::Gather), 3);
}

#[test]
fn every_byte_auto() {
    random_layouts(BackendChoice::Auto, None, 4);
}

#[test]
fn every_byte_staged() {
    random_layouts(BackendChoice::Force(Backend::Staged), Some(Backend::Staged), 15);
}

/// `layers` tensors of `page`-byte pages, `blocks` GPU and host blocks,
/// block major: each host block one contiguous run of `layers` pages.
fn block_major(layers: usize, page: usize, blocks: usize) -> Shape {
    Shape { groups: vec![(vec![page; layers], blocks, blocks)], factor: 1, placement: HostPlacement::BlockMajor }
}

#[test]
fn staged_in_many_chunks_on_both_streams() {
    // 2 x 4 KiB of staging (the smallest), 3-entry tables: jobs of 12 host
    // blocks of 3 pages (1 KiB, or 1 KiB + 8: the kernel's byte path) cut
    // into many chunks, alternating between the handler's two streams;
    // plus pages larger than a staging buffer, cut inside the page.
    // The last case's ring holds 40 entries: some jobs' tables land in the
    // ring (read by the kernel through its alias), the rest on the heap
    // (uploaded).
    for (page, entries, blocks, ring) in [
        (1024, 3, 16, 1 << 15),
        (1032, 3, 16, 1 << 15),
        (1024, 1 << 10, 16, 1 << 15),
        (12 << 10, 8, 4, 1 << 15),
        (1024, 3, 16, 40),
    ] {
        let (s, rt) = sim();
        let o = TransferOptions {
            staging_bytes: 8 << 10,
            gather_table_entries: entries,
            staging_ring_entries: ring,
            ..opts(BackendChoice::Force(Backend::Staged))
        };
        let mut rig = Rig::new(rt, block_major(3, page, blocks), o, Pin::Registered);
        let mut rng = Rng(page as u64);
        for k in 0..3 {
            for dir in DIRS {
                let n = blocks - k;
                let res = rig.run_checked(
                    dir,
                    &JobBlocks::single(rng.distinct(blocks, n), rng.distinct(blocks, n)),
                    k as u64,
                );
                assert_eq!(res.backend, Backend::Staged);
            }
        }
        assert_eq!(s.poisoned(), None);
    }
}

#[test]
fn auto_stages_while_the_other_direction_was_busy_within_the_linger() {
    // Host runs of 4 KiB (4 pages of 1 KiB a block), staged from 1 KiB runs
    // while the other direction is busy: a job in flight, or one reported
    // less than `duplex_linger` ago. An engine serving requests sends
    // stores in bursts; a load in a gap must not take the gather kernel
    // against the next store's copy engine (issue #15).
    for (linger, after_other) in [(Duration::from_secs(3600), Backend::Staged), (Duration::ZERO, Backend::Gather)] {
        let (s, rt) = sim();
        let mut o = opts(BackendChoice::Auto);
        o.thresholds.staged_duplex_min_run_bytes = 1 << 10;
        o.thresholds.duplex_linger = linger;
        let mut rig = Rig::new(rt, block_major(4, 1024, 16), o, Pin::Registered);
        let mut rng = Rng(31);
        // Nothing ran the other way yet: the gather kernel.
        let job = JobBlocks::single(rng.distinct(16, 8), rng.distinct(16, 8));
        assert_eq!(rig.run_checked(Direction::DeviceToHost, &job, 1).backend, Backend::Gather);
        // The store was reported (nothing in flight now): the load is
        // staged only within the linger; and so is the next store.
        let job = JobBlocks::single(rng.distinct(16, 8), rng.distinct(16, 8));
        assert_eq!(rig.run_checked(Direction::HostToDevice, &job, 2).backend, after_other, "{linger:?}");
        let job = JobBlocks::single(rng.distinct(16, 8), rng.distinct(16, 8));
        assert_eq!(rig.run_checked(Direction::DeviceToHost, &job, 3).backend, after_other, "{linger:?}");
        drop(rig);
        assert_eq!(s.poisoned(), None);
    }
}

#[test]
fn staged_tables_are_read_from_the_pinned_ring_in_place() {
    // The same staged stores with and without the pinned ring: with it, the
    // kernel reads each chunk's table through the ring's alias (no upload)
    // wherever in the ring the table lies: 40 jobs in flight at once hold
    // tables across most of the ring's 96 KiB and make 40 times the copies
    // of one job alone; without a ring each job makes more (one upload a
    // chunk).
    let copies = |ring: usize, jobs: usize| {
        let (s, rt) = sim();
        let o = TransferOptions {
            staging_bytes: 8 << 10,
            staging_ring_entries: ring,
            ..opts(BackendChoice::Force(Backend::Staged))
        };
        let mut rig = Rig::new(rt, block_major(3, 1024, 16), o, Pin::Registered);
        assert_eq!(rig.engine().options(), &o);
        rig.fill(1);
        let job = JobBlocks::single((0..12).collect(), (2..14).collect());
        let before = s.copy_enqueues();
        for _ in 0..jobs {
            let id = rig.fresh_id();
            rig.engine().store(id, &job).unwrap();
        }
        assert_eq!(rig.engine().in_flight(Direction::DeviceToHost), jobs);
        rig.engine().wait_all().unwrap();
        let res = poll_n(&rig, jobs);
        assert!(res.iter().all(|r| r.succeeded() && r.backend == Backend::Staged), "{res:?}");
        assert_eq!(rig.engine().in_flight(Direction::DeviceToHost), 0);
        s.copy_enqueues() - before
    };
    let one = copies(1 << 12, 1);
    assert_eq!(copies(1 << 12, 40), 40 * one, "a table in the ring was uploaded");
    assert!(one < copies(0, 1), "copies of a job with the ring {one}, without one more");
}

#[test]
fn in_flight_counts_each_directions_unreported_jobs() {
    let (_s, rt) = sim();
    let mut rig = Rig::new(rt, simple(2, 256, 8), opts(BackendChoice::Auto), Pin::Registered);
    let ids: Vec<JobId> = (0..3).map(|_| rig.fresh_id()).collect();
    rig.engine().store(ids[0], &JobBlocks::single(vec![0], vec![1])).unwrap();
    rig.engine().store(ids[1], &JobBlocks::single(vec![2], vec![3])).unwrap();
    rig.engine().load(ids[2], &JobBlocks::single(vec![4], vec![5])).unwrap();
    assert_eq!(rig.engine().in_flight(Direction::DeviceToHost), 2);
    assert_eq!(rig.engine().in_flight(Direction::HostToDevice), 1);
    rig.engine().wait_all().unwrap();
    let res = poll_n(&rig, 3);
    assert!(res.iter().all(|r| r.succeeded()));
    assert_eq!(rig.engine().in_flight(Direction::DeviceToHost) + rig.engine().in_flight(Direction::HostToDevice), 0);
}

/// Polls until `n` results were reported.
fn poll_n(rig: &Rig, n: usize) -> Vec<kvoffload::internal::transfer::JobResult> {
    let mut out = Vec::new();
    while out.len() < n {
        out.extend(rig.engine().poll_finished());
        std::thread::yield_now();
    }
    out
}

#[test]
fn staged_runs_end_at_registration_chunks() {
    // Host blocks of 4 KiB in 8 KiB registration chunks, jobs of nearly
    // every block: host-adjacent blocks make runs that would cross chunk
    // boundaries (one copy may not span two registrations); and a merged
    // batched fragment across chunks likewise.
    let (s, rt) = sim();
    let mut rig = Rig::chunked(
        rt.clone(),
        block_major(4, 1024, 16),
        opts(BackendChoice::Force(Backend::Staged)),
        Pin::Registered,
        8 << 10,
    );
    let mut rng = Rng(21);
    for dir in DIRS {
        let res = rig.run_checked(dir, &JobBlocks::single(rng.distinct(16, 15), rng.distinct(16, 15)), 2);
        assert_eq!(res.backend, Backend::Staged);
        let res = rig.run_checked(dir, &JobBlocks::single((0..16).collect(), (0..16).collect()), 3);
        assert_eq!(res.backend, Backend::Staged);
    }
    drop(rig);
    // Pages of 3 KiB in 8 KiB chunks: single pages straddle two chunks and
    // are cut there.
    let mut rig = Rig::chunked(
        rt.clone(),
        block_major(1, 3 << 10, 16),
        opts(BackendChoice::Force(Backend::Staged)),
        Pin::Registered,
        8 << 10,
    );
    for dir in DIRS {
        let res = rig.run_checked(dir, &JobBlocks::single((0..16).collect(), (0..16).collect()), 4);
        assert_eq!(res.backend, Backend::Staged);
    }
    drop(rig);
    let o = opts(BackendChoice::Force(Backend::Batched));
    let mut rig = Rig::chunked(rt, simple(1, 4096, 8), o, Pin::Registered, 8 << 10);
    for dir in DIRS {
        let res = rig.run_checked(dir, &JobBlocks::single((0..8).collect(), (0..8).collect()), 4);
        assert_eq!((res.backend, res.fragments), (Backend::Batched, 1));
    }
    assert_eq!(s.poisoned(), None);
}

#[test]
fn auto_stages_only_while_the_other_direction_is_busy() {
    // 4 layers of 64 KiB: host runs of 256 KiB, the default threshold. No
    // linger: busy means jobs in flight here (the linger has its own test).
    let (s, rt) = sim();
    let mut o = opts(BackendChoice::Auto);
    o.thresholds.duplex_linger = Duration::ZERO;
    let mut rig = Rig::new(rt, block_major(4, 64 << 10, 8), o, Pin::Registered);
    rig.fill(4);
    let (host_before, dev_before) = (rig.host.to_vec(), rig.device_snapshot());
    // Nothing in flight: the gather kernel. The load stays unreported (in
    // flight) until polled, so the store after it sees it busy: staged; so
    // does a second load.
    let jobs = [
        (Direction::HostToDevice, JobBlocks::single(vec![0, 1], vec![5, 3])),
        (Direction::DeviceToHost, JobBlocks::single(vec![2, 6], vec![0, 7])),
        (Direction::HostToDevice, JobBlocks::single(vec![4], vec![2])),
    ];
    for (i, (dir, job)) in jobs.iter().enumerate() {
        rig.engine().submit(JobId(i as u64 + 1), *dir, job).unwrap();
    }
    rig.engine().wait_all().unwrap();
    let mut res = poll_n(&rig, 3);
    res.sort_by_key(|r| r.id);
    let used: Vec<Backend> = res.iter().map(|r| r.backend).collect();
    assert_eq!(used, vec![Backend::Gather, Backend::Staged, Backend::Staged], "{res:?}");
    assert!(res.iter().all(|r| r.succeeded()));
    let dev_after = rig.device_snapshot();
    for (dir, job) in &jobs {
        for (g, t, b, off, p) in rig.shape.pages(job) {
            let (want, got) = match dir {
                Direction::HostToDevice => (&host_before[off..off + p], &dev_after[g][t][b * p..(b + 1) * p]),
                Direction::DeviceToHost => (&dev_before[g][t][b * p..(b + 1) * p], &rig.host[off..off + p]),
            };
            assert!(want == got, "{dir:?}: block {b} tensor {t} differs");
        }
    }
    // Alone again: the gather kernel.
    let r = rig.run_checked(Direction::DeviceToHost, &JobBlocks::single(vec![3], vec![1]), 9);
    assert_eq!(r.backend, Backend::Gather);
    // Scattered host pages (one tensor): never staged, busy or not.
    drop(rig);
    let (_s2, rt2) = sim();
    let rig = Rig::new(rt2, simple(1, 64 << 10, 8), opts(BackendChoice::Auto), Pin::Registered);
    rig.engine().load(JobId(1), &JobBlocks::single(vec![0, 1], vec![5, 3])).unwrap();
    rig.engine().store(JobId(2), &JobBlocks::single(vec![2, 6], vec![0, 7])).unwrap();
    rig.engine().wait_all().unwrap();
    let res = poll_n(&rig, 2);
    assert!(res.iter().all(|r| r.backend == Backend::Gather), "{res:?}");
    assert_eq!(s.poisoned(), None);
}

#[test]
fn staged_without_staging_buffers_falls_back() {
    let (_s, rt) = sim();
    let o = TransferOptions { staging_bytes: 0, ..opts(BackendChoice::Force(Backend::Staged)) };
    let mut rig = Rig::new(rt, block_major(2, 4096, 8), o, Pin::Registered);
    let r = rig.run_checked(Direction::DeviceToHost, &JobBlocks::single(vec![1, 2], vec![3, 4]), 1);
    assert_eq!(r.backend, Backend::PerFragment);
}

#[test]
fn staged_job_failing_on_the_second_stream_is_reported_in_order() {
    // Chunks of one 4 KiB page: chunk 1 runs on the second stream; its
    // batched copy fails at enqueue. The job is reported failed, after the
    // job before it, and the next job completes.
    let (s, rt) = sim();
    let o = TransferOptions { staging_bytes: 8 << 10, ..opts(BackendChoice::Force(Backend::Staged)) };
    let mut rig = Rig::new(rt.clone(), block_major(1, 4096, 16), o, Pin::Registered);
    rig.fill(3);
    let hold = s.hold(HoldPoint::DeviceOp);
    rig.engine().store(JobId(1), &JobBlocks::single(vec![0, 2, 4], vec![0, 2, 4])).unwrap();
    hold.wait_entered();
    // Copies of job 2 (its tables are read from the pinned ring, not
    // uploaded): chunk 0's batched copy (1), chunk 1's (2), on the second
    // staging stream.
    s.inject(SimFault::Copy { nth: 2, code: Code::OUT_OF_MEMORY });
    rig.engine().store(JobId(2), &JobBlocks::single(vec![6, 8, 10], vec![6, 8, 10])).unwrap();
    rig.engine().store(JobId(3), &JobBlocks::single(vec![12, 14], vec![12, 14])).unwrap();
    assert!(rig.engine().poll_finished().is_empty());
    hold.release();
    assert!(matches!(rig.engine().wait(JobId(2)), Err(TransferError::JobFailed { id: JobId(2), .. })));
    rig.engine().wait(JobId(3)).unwrap();
    let res = rig.poll_until(JobId(3));
    let ids: Vec<(u64, bool)> = res.iter().map(|r| (r.id.0, r.succeeded())).collect();
    assert_eq!(ids, vec![(1, true), (2, false), (3, true)]);
    assert!(res.iter().all(|r| r.backend == Backend::Staged));
    assert_eq!(rig.host[12 * 4096..13 * 4096], rig.device_snapshot()[0][0][12 * 4096..13 * 4096]);
    assert_eq!(s.poisoned(), None);
}

#[test]
fn engine_dropped_with_staged_jobs_in_flight() {
    // Dropping the engine waits for both streams before freeing the staging
    // buffers: the sim would fault a copy out of freed device memory.
    let (s, rt) = sim();
    let o = TransferOptions { staging_bytes: 8 << 10, ..opts(BackendChoice::Force(Backend::Staged)) };
    let mut rig = Rig::new(rt, block_major(2, 4096, 16), o, Pin::Registered);
    rig.fill(6);
    let dev = rig.device_snapshot();
    let hold = s.hold(HoldPoint::DeviceOp);
    rig.engine().store(JobId(1), &JobBlocks::single((0..8).collect(), (0..8).collect())).unwrap();
    hold.wait_entered();
    let dropper = {
        let engine = rig.engine.take().unwrap();
        std::thread::spawn(move || drop(engine))
    };
    // The drop waits for the job's stream (it cannot finish: the device is
    // held), and only then frees anything.
    while s.blocked(Blocked::Stream) + s.blocked(Blocked::Idle) == 0 && !dropper.is_finished() {
        std::thread::yield_now();
    }
    assert!(!dropper.is_finished(), "the engine was dropped without waiting for its job");
    hold.release();
    dropper.join().unwrap();
    assert_eq!(s.poisoned(), None);
    // It freed what it allocated (staging buffers, tables): only the rig's
    // tensors are left on the device.
    let tensors: usize = rig.shape.groups.iter().map(|(pages, ng, _)| pages.iter().sum::<usize>() * ng).sum();
    assert_eq!(s.device_bytes_in_use(), tensors, "the engine's device memory outlived it");
    // Block-major: host block b holds block b's page of tensor 0, then of tensor 1.
    for b in 0..8 {
        for (t, tensor) in dev[0].iter().enumerate() {
            let host = &rig.host[(b * 2 + t) * 4096..(b * 2 + t + 1) * 4096];
            assert!(host == &tensor[b * 4096..(b + 1) * 4096], "block {b} tensor {t}");
        }
    }
}

#[test]
fn engine_is_send_and_sync() {
    fn is<T: Send + Sync>() {}
    is::<kvoffload::internal::transfer::TransferEngine>();
}

#[test]
fn gather_table_in_several_launches() {
    // Tables of 3, 4 and 5 entries, 40 scattered fragments (20 blocks of 2
    // tensors): 8 to 14 upload+launch rounds, each a whole number of
    // entries, each uploaded once from the pinned ring (none from pageable
    // memory).
    for entries in [3, 4, 5] {
        let (s, rt) = sim();
        let shape = simple(2, 64, 40);
        let o = TransferOptions { gather_table_entries: entries, ..opts(BackendChoice::Force(Backend::Gather)) };
        let mut rig = Rig::new(rt, shape, o, Pin::Registered);
        let mut rng = Rng(9);
        for dir in DIRS {
            let gpu = rng.distinct(40, 20);
            let host = rng.distinct(40, 20);
            let (copies, pageable) = (s.copy_enqueues(), s.pageable_async_copies());
            let res = rig.run_checked(dir, &JobBlocks::single(gpu, host), 5);
            assert_eq!(res.backend, Backend::Gather, "{entries} entries");
            assert_eq!(s.copy_enqueues() - copies, 40u64.div_ceil(entries as u64), "uploads of {entries}-entry tables");
            assert_eq!(s.pageable_async_copies(), pageable, "a table uploaded from pageable memory");
        }
    }
}

#[test]
fn a_gather_job_whose_first_upload_fails_is_reported_failed() {
    // Three launches (3-entry tables, 9 fragments that do not merge); the
    // first upload fails: the launches after it are not enqueued and the
    // job reports the error.
    let (s, rt) = sim();
    let o = TransferOptions { gather_table_entries: 3, ..opts(BackendChoice::Force(Backend::Gather)) };
    let mut rig = Rig::new(rt, simple(1, 64, 32), o, Pin::Registered);
    s.inject(SimFault::Copy { nth: 1, code: Code::INVALID_VALUE });
    let id = rig.fresh_id();
    let before = s.copy_enqueues();
    let job = JobBlocks::single((0..9).map(|i| 2 * i).collect(), (0..9).rev().map(|i| 2 * i + 1).collect());
    rig.engine().store(id, &job).unwrap();
    rig.engine().wait_all().unwrap();
    let res = rig.poll_until(id);
    let r = res.iter().find(|r| r.id == id).unwrap();
    assert_eq!((r.backend, r.error.as_ref().map(|e| e.code)), (Backend::Gather, Some(Code::INVALID_VALUE)), "{r:?}");
    assert_eq!(s.copy_enqueues() - before, 1, "uploads enqueued after the failed one");
    assert_eq!(s.poisoned(), None);
}

#[test]
fn gather_across_registration_chunks() {
    // 48 KiB pages over 64 KiB chunks: many pages straddle two chunks and
    // are cut into one table entry per chunk.
    let (s, rt) = sim();
    let o = opts(BackendChoice::Force(Backend::Gather));
    let mut rig = Rig::chunked(rt, simple(2, 48 << 10, 12), o, Pin::Registered, 64 << 10);
    let mut rng = Rng(8);
    for dir in DIRS {
        let res = rig.run_checked(dir, &JobBlocks::single(rng.distinct(12, 9), rng.distinct(12, 9)), 6);
        assert_eq!(res.backend, Backend::Gather);
    }
    assert_eq!(s.poisoned(), None);
}

#[test]
fn auto_choice_by_size_and_pin_state() {
    let (_s, rt) = sim();
    // Small scattered fragments on registered memory: gather.
    let mut rig = Rig::new(rt.clone(), simple(1, 16 << 10, 8), opts(BackendChoice::Auto), Pin::Registered);
    let r = rig.run_checked(Direction::DeviceToHost, &JobBlocks::single(vec![5, 1, 3], vec![0, 4, 2]), 1);
    assert_eq!(r.backend, Backend::Gather);
    drop(rig);
    // Mid-size: batched.
    let mut rig = Rig::new(rt.clone(), simple(1, 512 << 10, 3), opts(BackendChoice::Auto), Pin::Registered);
    let r = rig.run_checked(Direction::HostToDevice, &JobBlocks::single(vec![2, 0], vec![0, 1]), 1);
    assert_eq!(r.backend, Backend::Batched);
    drop(rig);
    // A 2 MiB run after merging (contiguous on both sides): one batched copy.
    let mut rig = Rig::new(rt.clone(), simple(1, 512 << 10, 4), opts(BackendChoice::Auto), Pin::Registered);
    let r = rig.run_checked(Direction::HostToDevice, &JobBlocks::single(vec![0, 1, 2, 3], vec![0, 1, 2, 3]), 1);
    assert_eq!((r.backend, r.fragments), (Backend::Batched, 1));
    drop(rig);
    // Pageable memory: per-fragment whatever the size.
    let mut rig = Rig::new(rt, simple(1, 16 << 10, 8), opts(BackendChoice::Auto), Pin::Unregistered);
    let r = rig.run_checked(Direction::DeviceToHost, &JobBlocks::single(vec![5, 1, 3], vec![0, 4, 2]), 1);
    assert_eq!(r.backend, Backend::PerFragment);
}

#[test]
fn gather_never_runs_on_unregistered_memory() {
    for choice in [BackendChoice::Force(Backend::Gather), BackendChoice::Auto] {
        let (s, rt) = sim();
        let mut rig = Rig::new(rt, simple(2, 4096, 16), opts(choice), Pin::Unregistered);
        for dir in DIRS {
            let res = rig.run_checked(dir, &JobBlocks::single(vec![3, 9, 1], vec![7, 2, 0]), 3);
            assert_eq!(res.backend, Backend::PerFragment, "{choice:?} fell back");
        }
        assert_eq!(s.poisoned(), None);
        // Nothing of the layout got registered: the only registered host
        // memory is the engine's two page-locked staging rings.
        assert_eq!(s.registered_ranges(), 2);
    }
}

#[test]
fn many_tables_in_flight_fill_and_wrap_the_pinned_ring() {
    // Tables of 3 entries, a ring of 8: with twelve jobs in flight some
    // tables land in the ring (wrapping around) and the rest on the heap;
    // every job's bytes must arrive either way.
    let (s, rt) = sim();
    let o = TransferOptions {
        gather_table_entries: 3,
        staging_ring_entries: 8,
        ..opts(BackendChoice::Force(Backend::Gather))
    };
    let mut rig = Rig::new(rt, simple(1, 4096, 64), o, Pin::Registered);
    let mut rng = Rng(12);
    for dir in DIRS {
        rig.fill(11);
        let (host_before, dev_before) = (rig.host.to_vec(), rig.device_snapshot());
        let (gpu, host) = (rng.distinct(64, 24), rng.distinct(64, 24));
        let mut jobs = Vec::new();
        let mut at = 0;
        for i in 0..12 {
            let n = 1 + i % 3;
            jobs.push(JobBlocks::single(gpu[at..at + n].to_vec(), host[at..at + n].to_vec()));
            at += n;
        }
        let mut ids = Vec::new();
        for j in &jobs {
            let id = rig.fresh_id();
            rig.engine().submit(id, dir, j).unwrap();
            ids.push(id);
        }
        rig.engine().wait_all().unwrap();
        let res = rig.poll_until(*ids.last().unwrap());
        assert_eq!(res.iter().map(|r| r.id).collect::<Vec<_>>(), ids);
        assert!(res.iter().all(|r| r.succeeded() && r.backend == Backend::Gather), "{res:?}");
        let dev_after = rig.device_snapshot();
        for j in &jobs {
            for (g, t, b, off, p) in rig.shape.pages(j) {
                let (want, got) = match dir {
                    Direction::HostToDevice => (&host_before[off..off + p], &dev_after[g][t][b * p..(b + 1) * p]),
                    Direction::DeviceToHost => (&dev_before[g][t][b * p..(b + 1) * p], &rig.host[off..off + p]),
                };
                assert!(want == got, "{dir:?}: block {b} tensor {t} differs");
            }
        }
    }
    assert_eq!(s.poisoned(), None);
}

#[test]
fn gather_never_runs_on_memory_outside_the_coordinator() {
    // Host memory registered with the driver directly, but not a chunk of
    // the coordinator: no alias can be had, so no gather.
    let (s, rt, mut rig) = one_tensor_rig(4096, 8, BackendChoice::Force(Backend::Gather));
    // A second host buffer, registered behind the coordinator's back.
    let mut other = memmap2::MmapMut::map_anon(8 * 4096).unwrap();
    let addr = other.as_mut_ptr() as usize;
    // SAFETY: `other` stays mapped until it is unregistered below.
    unsafe { rig.gated(|gt| rt.host_register(gt, addr, other.len())) }.unwrap();
    let spec = kvoffload::GroupSpec {
        tensors: vec![kvoffload::TensorSpec { device_base: rig.tensors[0][0], page_bytes: 4096 }],
        num_gpu_blocks: 8,
        num_host_blocks: 8,
    };
    let layout = kvoffload::KvLayout::new(&[spec], 1, addr, HostPlacement::TensorMajor).unwrap();
    // SAFETY: `other` and the tensor outlive the engine (dropped below first).
    let eng = unsafe {
        kvoffload::internal::transfer::TransferEngine::new(
            rt.clone(),
            rig.coord.clone(),
            layout,
            rig.compute,
            opts(BackendChoice::Force(Backend::Gather)),
        )
    }
    .unwrap();
    eng.store(JobId(1), &JobBlocks::single(vec![1, 2], vec![5, 6])).unwrap();
    eng.wait(JobId(1)).unwrap();
    let r = eng.poll_finished();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].backend, Backend::PerFragment);
    drop(eng);
    rig.gated(|gt| rt.host_unregister(gt, addr)).unwrap();
    assert_eq!(s.poisoned(), None);
    let _ = rig.run_checked(Direction::DeviceToHost, &JobBlocks::single(vec![1], vec![2]), 1);
}

#[test]
fn the_sim_faults_a_gather_kernel_on_unregistered_host_memory() {
    // The negative that P3 guards against: a gather kernel given a stale
    // alias of host memory that is no longer registered poisons the context.
    let (s, rt) = sim();
    let mut host = memmap2::MmapMut::map_anon(4096).unwrap();
    let addr = host.as_mut_ptr() as usize;
    // SAFETY: `host` stays mapped until after it is unregistered.
    unsafe { gated(&*rt, |gt| rt.host_register(gt, addr, 4096)) }.unwrap();
    let alias = rt.host_device_ptr(addr).unwrap();
    gated(&*rt, |gt| rt.host_unregister(gt, addr)).unwrap();
    let dev = gated(&*rt, |gt| rt.mem_alloc(gt, 4096 + 24)).unwrap();
    let table: [u64; 3] = [alias.raw(), dev.raw(), 4096];
    // SAFETY: `table` is readable for 24 bytes.
    unsafe { rt.copy_htod(dev.offset(4096), table.as_ptr() as usize, 24) }.unwrap();
    let st = rt.stream_create().unwrap();
    // SAFETY: the simulated GPU faults on the stale alias (what this test
    // checks) instead of reading through it; the table is in place.
    unsafe { rt.launch(kvoffload::Kernel::Gather { table: dev.offset(4096), count: 1 }, st) }.unwrap();
    assert_eq!(gated(&*rt, |gt| rt.stream_synchronize(gt, st)).unwrap_err().code, Code::ILLEGAL_ADDRESS);
    assert_eq!(s.poisoned(), Some(Code::ILLEGAL_ADDRESS));
}

#[test]
fn store_is_ordered_after_compute() {
    let (s, rt, mut rig) = one_tensor_rig(256, 4, BackendChoice::Auto);
    rig.fill(1);
    let tensor = rig.tensors[0][0];
    // A gate stream created after the engine's streams: the device visits
    // streams by creation order, so without the engine's event wait its copy
    // would run before the compute stream's memset.
    let gate = rt.stream_create().unwrap();
    let gate_ev = rt.event_create().unwrap();
    let scratch = rig.gated(|gt| rt.mem_alloc(gt, 64)).unwrap();
    let hold = s.hold(HoldPoint::DeviceOp);
    // SAFETY (the three memsets): `scratch` is a 64-byte allocation freed
    // at the end, after `gate` is synchronized; `tensor` is the rig's
    // tensor of 4 pages of 256 bytes, read by the store ordered after it.
    unsafe { rt.memset_d8_async(scratch, 1, 64, gate) }.unwrap();
    hold.wait_entered();
    unsafe { rt.memset_d8_async(scratch, 2, 64, gate) }.unwrap();
    rt.event_record(gate_ev, gate).unwrap();
    rt.stream_wait_event(rig.compute, gate_ev).unwrap();
    unsafe { rt.memset_d8_async(tensor, 0xab, 4 * 256, rig.compute) }.unwrap();
    // Control: a raw copy on the store stream with no event wait sees the old data.
    let mut control = vec![0u8; 256];
    let store_stream = rig.engine().stream(Direction::DeviceToHost);
    // SAFETY: `control` lives until the stream is synchronized below.
    unsafe { rt.copy_dtoh_async(control.as_mut_ptr() as usize, tensor, 256, store_stream) }.unwrap();
    rig.engine().store(JobId(100), &JobBlocks::single(vec![0, 1, 2, 3], vec![3, 2, 1, 0])).unwrap();
    hold.release();
    rig.engine().wait(JobId(100)).unwrap();
    assert!(rig.poll_until(JobId(100)).iter().all(|r| r.succeeded()));
    assert!(control.iter().any(|&b| b != 0xab), "the control copy ran after the memset: the test would prove nothing");
    assert!(rig.host[..4 * 256].iter().all(|&b| b == 0xab), "the store did not see the compute stream's memset");
    rig.gated(|gt| rt.stream_synchronize(gt, gate)).unwrap();
    rt.stream_destroy(gate).unwrap();
    rt.event_destroy(gate_ev).unwrap();
    // SAFETY: the memset into `scratch` completed (its stream was
    // synchronized above); nothing uses it afterwards.
    rig.gated(|gt| unsafe { rt.mem_free(gt, scratch) }).unwrap();
}

#[test]
fn results_in_submission_order_per_direction() {
    let (s, _, mut rig) = one_tensor_rig(128, 64, BackendChoice::Auto);
    rig.fill(2);
    let hold = s.hold(HoldPoint::DeviceOp);
    let mut want = [Vec::new(), Vec::new()];
    let mut rng = Rng(3);
    // Ids deliberately not increasing.
    for (k, id) in [50u64, 7, 31, 2, 99, 13, 64, 40].into_iter().enumerate() {
        let dir = DIRS[k % 2];
        let job = JobBlocks::single(rng.distinct(64, 4), rng.distinct(64, 4));
        rig.engine().submit(JobId(id), dir, &job).unwrap();
        want[k % 2].push(JobId(id));
        if k == 0 {
            hold.wait_entered();
        }
    }
    // The device is held inside the first job: nothing is reported.
    assert!(rig.engine().poll_finished().is_empty());
    hold.release();
    let mut got = [Vec::new(), Vec::new()];
    let mut seen = 0;
    while seen < 8 {
        for r in rig.engine().poll_finished() {
            assert!(r.succeeded());
            let i = if r.direction == Direction::DeviceToHost { 0 } else { 1 };
            got[i].push(r.id);
            seen += 1;
        }
    }
    assert_eq!(got, want);
    assert!(rig.engine().poll_finished().is_empty(), "a job was reported twice");
}

#[test]
fn failed_enqueue_is_reported_failed_and_later_jobs_complete() {
    let (s, _, mut rig) = one_tensor_rig(128, 16, BackendChoice::Force(Backend::PerFragment));
    rig.fill(3);
    let hold = s.hold(HoldPoint::DeviceOp);
    // Job 1 runs (held on the device); job 2 fails at its second copy.
    rig.engine().store(JobId(1), &JobBlocks::single(vec![0, 2], vec![0, 2])).unwrap();
    hold.wait_entered();
    s.inject(SimFault::Copy { nth: 2, code: Code::OUT_OF_MEMORY });
    rig.engine().store(JobId(2), &JobBlocks::single(vec![4, 6, 8], vec![4, 6, 8])).unwrap();
    rig.engine().load(JobId(3), &JobBlocks::single(vec![10], vec![11])).unwrap();
    // Job 2 already failed but must not overtake job 1.
    assert!(rig.engine().poll_finished().is_empty());
    hold.release();
    assert!(matches!(rig.engine().wait(JobId(2)), Err(TransferError::JobFailed { id: JobId(2), .. })));
    rig.engine().wait_all().unwrap();
    let mut all = Vec::new();
    while all.len() < 3 {
        all.extend(rig.engine().poll_finished());
    }
    let ids: Vec<_> = all.iter().map(|r| (r.id.0, r.succeeded())).collect();
    assert_eq!(ids, vec![(1, true), (2, false), (3, true)]);
    assert_eq!(all[1].error.as_ref().map(|e| e.code), Some(Code::OUT_OF_MEMORY));
    assert_eq!(s.poisoned(), None);
    // And the engine goes on working.
    let r = rig.run_checked(Direction::DeviceToHost, &JobBlocks::single(vec![5, 6], vec![1, 0]), 4);
    assert!(r.succeeded());
}

#[test]
fn typed_errors_for_bad_jobs() {
    let (_s, rt) = sim();
    let rig = Rig::new(rt, simple(1, 64, 8), opts(BackendChoice::Auto), Pin::Registered);
    let e = rig.engine();
    assert!(matches!(
        e.store(JobId(1), &JobBlocks::single(vec![8], vec![0])),
        Err(TransferError::GpuBlockOutOfRange { block: 8, num_blocks: 8, .. })
    ));
    assert!(matches!(
        e.store(JobId(1), &JobBlocks::single(vec![0], vec![9])),
        Err(TransferError::HostBlockOutOfRange { block: 9, .. })
    ));
    assert!(matches!(
        e.store(JobId(1), &JobBlocks::single(vec![2, 2], vec![0, 1])),
        Err(TransferError::RepeatedGpuBlock { block: 2, .. })
    ));
    assert!(matches!(
        e.load(JobId(1), &JobBlocks::single(vec![2, 3], vec![1, 1])),
        Err(TransferError::RepeatedHostBlock { block: 1, .. })
    ));
    assert!(matches!(
        e.load(JobId(1), &JobBlocks::single(vec![], vec![])),
        Err(TransferError::EmptyJob { id: JobId(1) })
    ));
    // Refused jobs do not use up their id.
    e.store(JobId(1), &JobBlocks::single(vec![0], vec![0])).unwrap();
    assert_eq!(
        e.load(JobId(1), &JobBlocks::single(vec![1], vec![1])),
        Err(TransferError::JobIdReused { id: JobId(1) })
    );
    e.wait(JobId(1)).unwrap();
    while e.poll_finished().is_empty() {}
    // Still refused after the first job with that id was reported.
    assert_eq!(
        e.store(JobId(1), &JobBlocks::single(vec![1], vec![1])),
        Err(TransferError::JobIdReused { id: JobId(1) })
    );
    assert_eq!(e.wait(JobId(1)), Err(TransferError::UnknownJob { id: JobId(1) }));
    assert_eq!(e.wait(JobId(77)), Err(TransferError::UnknownJob { id: JobId(77) }));
}

#[test]
fn submit_while_the_compute_stream_captures_is_refused() {
    let (s, rt, rig) = one_tensor_rig(64, 8, BackendChoice::Auto);
    rt.begin_capture(rig.compute, CaptureMode::Relaxed).unwrap();
    let job = JobBlocks::single(vec![0], vec![0]);
    assert_eq!(rig.engine().store(JobId(1), &job), Err(TransferError::ComputeCapturing { id: JobId(1) }));
    let g = rt.end_capture(rig.compute).unwrap();
    rt.graph_destroy(g).unwrap();
    // The id was not used up.
    rig.engine().store(JobId(1), &job).unwrap();
    assert!(rig.poll_until(JobId(1))[0].succeeded());
    assert_eq!(s.poisoned(), None);
}

#[test]
fn shutdown_waits_for_jobs_then_refuses_new_ones() {
    let (s, rt) = sim();
    let rig = Rig::new(rt, simple(1, 64, 8), opts(BackendChoice::Auto), Pin::Registered);
    let hold = s.hold(HoldPoint::DeviceOp);
    rig.engine().store(JobId(1), &JobBlocks::single(vec![0, 1], vec![2, 3])).unwrap();
    hold.wait_entered();
    let coord = rig.coord.clone();
    let c2 = coord.clone();
    let t = std::thread::spawn(move || c2.shutdown_steps().begin());
    // Shutdown has begun (new work refused) while the job is held on the
    // device: it cannot have returned, since it waits for the job's ticket.
    while !coord.shutdown_steps().started() {
        std::thread::yield_now();
    }
    assert!(!t.is_finished(), "shutdown must wait for the job in flight");
    hold.release();
    let r = rig.poll_until(JobId(1));
    assert!(r[0].succeeded());
    t.join().unwrap().unwrap();
    assert_eq!(
        rig.engine().store(JobId(2), &JobBlocks::single(vec![0], vec![0])),
        Err(TransferError::ShutDown { id: JobId(2) })
    );
    rig.coord.pinning().unregister_all(&*rig.rt).unwrap();
}

#[test]
fn batched_copy_is_never_issued_on_a_capturing_stream() {
    let (s, rt, mut rig) = one_tensor_rig(4096, 8, BackendChoice::Force(Backend::Batched));
    rig.fill(5);
    let host_copy = rig.host.to_vec();
    let stream = rig.engine().stream(Direction::HostToDevice);
    // The load stream joins a capture (as it would by waiting on an event
    // of a capturing compute stream on the real driver).
    rt.begin_capture(stream, CaptureMode::Relaxed).unwrap();
    rig.engine().load(JobId(1), &JobBlocks::single(vec![1, 5, 3], vec![4, 0, 6])).unwrap();
    let graph = rt.end_capture(stream).expect("capture stays valid");
    rt.graph_launch(graph, stream).unwrap();
    rig.gated(|gt| rt.stream_synchronize(gt, stream)).unwrap();
    let r = rig.poll_until(JobId(1));
    assert_eq!(r[0].backend, Backend::PerFragment);
    let dev = rig.device_snapshot();
    for (gpu, host) in [(1usize, 4usize), (5, 0), (3, 6)] {
        assert_eq!(dev[0][0][gpu * 4096..(gpu + 1) * 4096], host_copy[host * 4096..(host + 1) * 4096]);
    }
    rt.graph_destroy(graph).unwrap();
    assert_eq!(s.poisoned(), None);
}

#[test]
fn poll_during_an_open_capture_window_queries_no_event() {
    let (s, rt, mut rig) = one_tensor_rig(256, 16, BackendChoice::Auto);
    rig.fill(6);
    // Two jobs in flight before the window opens; both complete on the
    // device, so a poll that queried events would report them.
    rig.engine().store(JobId(1), &JobBlocks::single(vec![1, 2], vec![3, 4])).unwrap();
    rig.engine().load(JobId(2), &JobBlocks::single(vec![5], vec![6])).unwrap();
    s.wait_device_idle();
    let (opened_tx, opened_rx) = std::sync::mpsc::channel();
    let (close_tx, close_rx) = std::sync::mpsc::channel::<()>();
    let coord = rig.coord.clone();
    let rt2 = rt.clone();
    let compute = rig.compute;
    let engine_thread = std::thread::spawn(move || {
        let scratch = coord.unsafe_call("test", Request::new(), |gt| rt2.mem_alloc(gt, 256)).unwrap().unwrap();
        let window = coord.open_window(Request::new()).unwrap();
        // The engine captures its compute stream, the one jobs are ordered
        // after.
        rt2.begin_capture(compute, CaptureMode::Global).unwrap();
        // SAFETY: `scratch` is a 256-byte allocation, freed below after the
        // graph is destroyed unlaunched (the memset is only captured).
        unsafe { rt2.memset_d8_async(scratch, 3, 256, compute) }.unwrap();
        opened_tx.send(()).unwrap();
        close_rx.recv().unwrap();
        let graph = rt2.end_capture(compute);
        drop(window);
        let ok = graph.is_ok();
        if let Ok(g) = graph {
            rt2.graph_destroy(g).unwrap();
        }
        // SAFETY: the only work on `scratch` was captured, never run, and
        // its graph is destroyed.
        coord.unsafe_call("test", Request::new(), |gt| unsafe { rt2.mem_free(gt, scratch) }).unwrap().unwrap();
        ok
    });
    opened_rx.recv().unwrap();
    for _ in 0..10 {
        assert!(rig.engine().poll_finished().is_empty());
    }
    // Submitting while the window is open is refused (the compute stream
    // may be capturing: its ordering event would join the capture), with
    // the id left unused.
    assert_eq!(
        rig.engine().store(JobId(3), &JobBlocks::single(vec![7], vec![8])),
        Err(TransferError::CaptureWindowOpen { id: JobId(3) })
    );
    close_tx.send(()).unwrap();
    assert!(engine_thread.join().unwrap(), "the engine's GLOBAL capture was invalidated");
    assert!(s.refusals().is_empty(), "a call was refused: {:?}", s.refusals());
    let r = rig.poll_until(JobId(2));
    assert!(r.iter().all(|r| r.succeeded()));
    rig.engine().store(JobId(3), &JobBlocks::single(vec![7], vec![8])).unwrap();
    assert!(rig.poll_until(JobId(3)).iter().all(|r| r.succeeded()));
    assert_eq!(s.poisoned(), None);
}

#[test]
fn dropping_the_engine_waits_for_the_jobs_in_flight() {
    // Every backend: a store held on the device when the engine is dropped;
    // the drop returns only after the job completed, so the host memory it
    // writes may be unmapped after it.
    for b in [Backend::PerFragment, Backend::Batched, Backend::Gather] {
        let (s, rt) = sim();
        let mut rig = Rig::new(rt, simple(1, 256, 8), opts(BackendChoice::Force(b)), Pin::Registered);
        rig.fill(3);
        let dev = rig.device_snapshot();
        let hold = s.hold(HoldPoint::DeviceOp);
        rig.engine().store(JobId(1), &JobBlocks::single(vec![2, 5], vec![6, 1])).unwrap();
        hold.wait_entered();
        let dropper = {
            let engine = rig.engine.take().unwrap();
            std::thread::spawn(move || drop(engine))
        };
        // It blocks, waiting for the stream (or for the device to go idle
        // before freeing a table), or returns without waiting
        // (`cuStreamDestroy` does not wait, in the sim as on the driver).
        let waits = || s.blocked(Blocked::Stream) + s.blocked(Blocked::Idle);
        while waits() == 0 && !dropper.is_finished() {
            std::thread::yield_now();
        }
        assert!(waits() > 0, "{b:?}: the engine was dropped without waiting for its job");
        hold.release();
        dropper.join().unwrap();
        for (gpu, host) in [(2, 6), (5, 1)] {
            assert!(rig.host[host * 256..(host + 1) * 256] == dev[0][0][gpu * 256..(gpu + 1) * 256], "{b:?}");
        }
        assert_eq!(s.poisoned(), None);
    }
}

#[test]
fn wait_inside_own_window_is_a_typed_error() {
    let (_s, rt) = sim();
    let rig = Rig::new(rt, simple(1, 64, 8), opts(BackendChoice::Auto), Pin::Registered);
    rig.engine().store(JobId(1), &JobBlocks::single(vec![0], vec![0])).unwrap();
    let w = rig.coord.open_window(Request::new()).unwrap();
    let would_deadlock = Err(TransferError::Protocol(ProtocolError::WouldDeadlock { what: "waiting for a transfer" }));
    assert_eq!(rig.engine().wait(JobId(1)), would_deadlock);
    assert_eq!(rig.engine().wait_all(), would_deadlock);
    assert!(rig.engine().poll_finished().is_empty());
    drop(w);
    assert_eq!(rig.engine().wait(JobId(1)), Ok(()));
    assert_eq!(rig.poll_until(JobId(1)).len(), 1);
}

/// A job's device time is its copies' time on its stream, not the time
/// from submission until the poll saw it: the compute work it is ordered
/// after (here a memset held on the device) counts in `seconds` and not in
/// `device_seconds`. What vLLM's offload stats divide bytes by (issue 42,
/// item 4): with `seconds` they showed kvoffload's copies 10-50x slower
/// than they ran. Both directions, and a job on an idle stream is timed too.
#[test]
fn device_seconds_count_the_copies_not_the_wait_for_compute() {
    let backends = [Backend::PerFragment, Backend::Batched, Backend::Gather, Backend::Staged];
    for (backend, dir) in backends.into_iter().flat_map(|b| DIRS.map(|d| (b, d))) {
        let (s, rt) = sim();
        let mut rig = Rig::new(rt.clone(), simple(2, 4096, 8), opts(BackendChoice::Force(backend)), Pin::Registered);
        let job = JobBlocks::single(vec![0, 1, 2], vec![0, 1, 2]);
        // On an idle compute stream: timed, and within its reported seconds.
        let idle = rig.run_checked(dir, &job, 1);
        let d = idle.device_seconds.expect("a job on an idle stream has device time");
        assert!(d >= 0.0 && d <= idle.seconds, "{backend:?} {dir:?}: device {d} s, seconds {} s", idle.seconds);

        // Behind compute work held on the device.
        let scratch = rig.tensors[0][0];
        let hold = s.hold(HoldPoint::DeviceOp);
        // SAFETY: `scratch` is the rig's tensor; the job below reads it only
        // after this memset (it is ordered after the compute stream).
        unsafe { rt.memset_d8_async(scratch, 7, 4096, rig.compute) }.unwrap();
        hold.wait_entered();
        let id = rig.fresh_id();
        rig.engine().submit(id, dir, &job).unwrap();
        let submitted = std::time::Instant::now();
        assert!(
            rig.engine().poll_finished().is_empty(),
            "{backend:?} {dir:?}: the job finished before the compute work it follows"
        );
        let released = std::time::Instant::now();
        hold.release();
        let r = rig.poll_until(id).into_iter().find(|r| r.id == id).unwrap();
        assert!(r.succeeded() && r.backend == backend, "{backend:?}: {r:?}");
        let d = r.device_seconds.expect("a completed job has device time");
        // The start event is reached only after the release, the poll that
        // reported the job ran after the copies: the held span is in
        // `seconds`, not in `device_seconds`.
        let held = (released - submitted).as_secs_f64();
        assert!(d >= 0.0, "{backend:?} {dir:?}: negative device time {d}");
        assert!(
            r.seconds - d >= held - 1e-6,
            "{backend:?} {dir:?}: device {d} s of {} s, held {held} s before it started",
            r.seconds
        );
    }
}
