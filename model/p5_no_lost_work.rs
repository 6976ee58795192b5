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

#![cfg(loom)]

#[path = "common/mod.rs"]
mod common;

use common::{check, engine, fixture, host, Bounds};
use kvoffload::internal::pin::{pin_all, NoPrefault};
use kvoffload::internal::protocol::{CapturePolicy, PinState, Variant};
use kvoffload::internal::runtime::sim::SimFault;
use kvoffload::internal::runtime::{Code, Direction};
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::internal::transfer::{BackendChoice, JobBlocks, JobId};

fn scenario(failing: bool) {
    let f = fixture(CapturePolicy::AfterPinning, Variant::Production, 1, 64);
    assert_eq!(pin_all(f.rt.as_ref(), &f.coord, &NoPrefault), PinState::Pinned);
    let page = 16;
    host(&f, 64).fill(0);
    let (eng, dev) = engine(&f, 1, page, 4, BackendChoice::Auto);
    let pattern: Vec<u8> = (0..64u8).map(|i| i + 1).collect();
    // SAFETY: `pattern` is a live local buffer of 64 bytes.
    unsafe { f.rt.copy_htod(dev, pattern.as_ptr() as usize, 64) }.unwrap();
    let eng = Arc::new(eng);

    let poller_eng = eng.clone();
    let poller = thread::spawn(move || {
        let mut seen = Vec::new();
        while seen.len() < 3 {
            seen.extend(poller_eng.poll_finished());
            thread::yield_now();
        }
        seen
    });
    eng.store(JobId(1), &JobBlocks::single(vec![0], vec![0])).unwrap();
    eng.store(JobId(2), &JobBlocks::single(vec![1], vec![1])).unwrap();
    if failing {
        f.sim().inject(SimFault::Copy { nth: 1, code: Code::INVALID_VALUE });
    }
    eng.load(JobId(3), &JobBlocks::single(vec![3], vec![0])).unwrap();
    let seen = poller.join().unwrap();

    let ids: Vec<u64> = seen.iter().map(|r| r.id.0).collect();
    let stores: Vec<u64> = seen.iter().filter(|r| r.direction == Direction::DeviceToHost).map(|r| r.id.0).collect();
    assert_eq!(stores, vec![1, 2], "stores out of order or lost: {ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i == 3).count(), 1, "load reported {ids:?}");
    assert!(eng.poll_finished().is_empty(), "a job was reported twice");
    let load = seen.iter().find(|r| r.id == JobId(3)).unwrap();
    assert_eq!(load.error.is_some(), failing, "failed job not reported as failed: {load:?}");
    assert_eq!(&host(&f, 32)[..], &pattern[..32], "stored bytes wrong");
}

const B: Bounds = Bounds { property: "P5", threads: 3, preemptions: 3 };

#[test]
fn p5_every_job_reported_once_in_order() {
    check("p5_no_lost_work", B, || scenario(false));
}

#[test]
fn p5_failed_job_reported_failed_in_order() {
    check("p5_failed_job", B, || scenario(true));
}
