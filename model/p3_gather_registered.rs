//! P3 no kernel on pageable memory: the gather-kernel copy path reads only
//! host memory whose registration completed before the launch.
//!
//! Threads (3): the pinner (`PinHandle`, 2 chunks; the registration of the
//! second chunk fails, so the first is rolled back and unregistered while
//! the engine may be using it), the engine (main) submitting one load job
//! with the gather backend forced (`TransferEngine`, blocks of chunk 0) and
//! waiting for it, the sim's device thread. Preemption bound 3.
//!
//! Checked: the job completes without error, the device holds the host
//! bytes, and the simulated GPU was never poisoned (a gather through the
//! device alias of unregistered memory is a device fault there, as an
//! access to unmapped memory is on a real GPU).
//!
//! Why it holds: the gather kernel gets host addresses only from
//! `Coordinator::acquire_alias`, which hands them out only for chunks in
//! state Registered and counts the user until the launch is enqueued;
//! `unregister_chunk` first marks the chunk Unregistering (no new users),
//! waits for the users, and the driver's unregister then waits for the
//! enqueued kernel (docs/driver-rules.md: unregister waits for the device
//! to go idle).
//! When no alias is available the engine falls back to per-fragment copies,
//! which are valid on pageable memory.
//!
//! Negative N4: `acquire_alias` without the registration check; loom finds
//! the launch on unregistered memory.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{engine, fixture, host, models, Bounds};
use kvoffload::internal::pin::{NoPrefault, PinHandle};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::transfer::JobBlocks;
use kvoffload::{Backend, BackendChoice, CapturePolicy, Code, Direction, JobId, SimFault};

/// Chunks of the region (the last one's registration fails) and gather
/// jobs (job `j` loads two blocks of chunk `j % CHUNKS`): loom's size, and
/// shuttle's past it.
const CHUNKS: usize = common::sized(2, 6);
const JOBS: usize = common::sized(1, 4);

fn scenario(variant: Variant) {
    let f = fixture(CapturePolicy::Interleave, variant, CHUNKS, 64);
    let page = 16;
    let per_chunk = 64 / page;
    host(&f, CHUNKS * 64).iter_mut().enumerate().for_each(|(i, b)| *b = (i as u8).wrapping_add(1));
    let (eng, dev) = engine(&f, CHUNKS, page, 2 * JOBS, BackendChoice::Force(Backend::Gather));
    f.sim().inject(SimFault::Register { nth: CHUNKS as u64, code: Code::OUT_OF_MEMORY });
    let pin = PinHandle::spawn(f.rt.clone(), f.coord.clone(), NoPrefault::shared());

    let slot = |j: usize| per_chunk * (j % CHUNKS);
    // A submission's error is checked after the poison check: a gather that
    // poisoned the context fails the later submissions (its sticky error).
    let submitted: Vec<_> = (0..JOBS)
        .map(|j| {
            let blocks = JobBlocks::single(vec![2 * j, 2 * j + 1], vec![slot(j), slot(j) + 1]);
            eng.submit(JobId(1 + j as u64), Direction::HostToDevice, &blocks)
        })
        .collect();
    let waited: Vec<_> = (0..JOBS).filter(|&j| submitted[j].is_ok()).map(|j| eng.wait(JobId(1 + j as u64))).collect();
    let results = eng.poll_finished();
    pin.join();

    assert!(f.sim().poisoned().is_none(), "context poisoned: the gather kernel read unregistered memory");
    submitted.into_iter().for_each(|s| s.unwrap());
    waited.into_iter().for_each(|w| w.unwrap());
    assert!(results.iter().all(|r| r.error.is_none()), "job failed: {results:?}");
    for j in 0..JOBS {
        let mut out = [0u8; 32];
        // SAFETY: `out` is a writable local buffer of 32 bytes.
        unsafe { f.rt.copy_dtoh(out.as_mut_ptr() as usize, dev.offset(2 * j * page), 32) }.unwrap();
        assert_eq!(&out[..], &host(&f, CHUNKS * 64)[slot(j) * page..][..32], "device holds the wrong bytes");
    }
}

const B: Bounds = Bounds { property: "P3", threads: 3, preemptions: 3, ci: None };

models! {
    p3_gather_reads_only_registered_memory:
        check("p3_gather_registered", B.ci_at(2), || scenario(Variant::Production));
    negative_n4_gather_before_registration_completed:
        negative("n4_unchecked_gather", Bounds { property: "N4", ..B },
            "context poisoned", || scenario(Variant::UncheckedGather));
}
