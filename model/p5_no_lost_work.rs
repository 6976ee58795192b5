//! P5 no lost work (transfer part): every submitted job is reported
//! finished exactly once, in submission order per direction, with its data
//! moved; a failed job is reported failed, never dropped.
//!
//! Threads (3): the engine (main) submitting two stores and one load on a
//! pinned region (the load's enqueue fails once by fault injection in the
//! `failing` variant), a poller thread calling `poll_finished` until all
//! three are reported, the sim's device thread. Preemption bound 3.
//!
//! Why it holds: each direction's jobs sit in one FIFO; `poll_finished`
//! pops only a completed head (its completion event, recorded after its
//! copies on the handler's stream, queried through the coordinator), so a
//! job is reported once, never before its predecessors in that direction;
//! a job whose enqueue failed is queued as complete-with-error and reported
//! in its place. The block manager's side of P5 (readable only after a
//! successful store, never evicting a block being read) is checked by
//! tests/manager_state_machine.rs against a reference model.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{engine, fixture, host, models, Bounds};
use kvoffload::internal::pin::{pin_all, NoPrefault};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::internal::transfer::JobBlocks;
use kvoffload::{BackendChoice, CapturePolicy, Code, Direction, JobId, PinState, SimFault};

/// Stores and loads (the first load fails in the `failing` variant) over
/// `CHUNKS` pinned chunks: loom's size, and shuttle's past it.
const STORES: usize = common::sized(2, 6);
const LOADS: usize = common::sized(1, 3);
const CHUNKS: usize = common::sized(1, 2);
/// GPU blocks: one per store, one per load, one spare (loom's 4).
const GPU_BLOCKS: usize = STORES + LOADS + 1;

fn scenario(failing: bool) {
    let f = fixture(CapturePolicy::AfterPinning, Variant::Production, CHUNKS, 64);
    assert_eq!(pin_all(f.rt.as_ref(), &f.coord, &NoPrefault), PinState::Pinned);
    let page = 16;
    host(&f, CHUNKS * 64).fill(0);
    let (eng, dev) = engine(&f, CHUNKS, page, GPU_BLOCKS, BackendChoice::Auto);
    let pattern: Vec<u8> = (0..GPU_BLOCKS * page).map(|i| (i as u8).wrapping_add(1)).collect();
    // SAFETY: `pattern` is a live local buffer of GPU_BLOCKS pages.
    unsafe { f.rt.copy_htod(dev, pattern.as_ptr() as usize, pattern.len()) }.unwrap();
    let eng = Arc::new(eng);
    let jobs = STORES + LOADS;

    let poller_eng = eng.clone();
    let poller = thread::spawn(move || {
        let mut seen = Vec::new();
        while seen.len() < jobs {
            seen.extend(poller_eng.poll_finished());
            thread::yield_now();
        }
        seen
    });
    for i in 0..STORES {
        eng.store(JobId(1 + i as u64), &JobBlocks::single(vec![i], vec![i])).unwrap();
    }
    if failing {
        f.sim().inject(SimFault::Copy { nth: 1, code: Code::INVALID_VALUE });
    }
    for k in 0..LOADS {
        eng.load(JobId((STORES + 1 + k) as u64), &JobBlocks::single(vec![STORES + 1 + k], vec![k])).unwrap();
    }
    let seen = poller.join().unwrap();

    let ids: Vec<u64> = seen.iter().map(|r| r.id.0).collect();
    let stores: Vec<u64> = seen.iter().filter(|r| r.direction == Direction::DeviceToHost).map(|r| r.id.0).collect();
    assert_eq!(stores, (1..=STORES as u64).collect::<Vec<_>>(), "stores out of order or lost: {ids:?}");
    let loads: Vec<u64> = seen.iter().filter(|r| r.direction == Direction::HostToDevice).map(|r| r.id.0).collect();
    let want: Vec<u64> = (STORES as u64 + 1..=jobs as u64).collect();
    assert_eq!(loads, want, "loads out of order, lost or reported twice: {ids:?}");
    assert!(eng.poll_finished().is_empty(), "a job was reported twice");
    for r in seen.iter().filter(|r| r.direction == Direction::HostToDevice) {
        // The injected fault fails the first load's copy.
        let fails = failing && r.id.0 == STORES as u64 + 1;
        assert_eq!(r.error.is_some(), fails, "failed job not reported as failed: {r:?}");
    }
    assert_eq!(&host(&f, CHUNKS * 64)[..STORES * page], &pattern[..STORES * page], "stored bytes wrong");
}

const B: Bounds = Bounds { property: "P5", threads: 3, preemptions: 3, ci: None };

models! {
    p5_every_job_reported_once_in_order:
        check("p5_no_lost_work", B.ci_at(2), || scenario(false));
    p5_failed_job_reported_failed_in_order:
        check("p5_failed_job", B.ci_at(2), || scenario(true));
}
