//! The slot-addressed `Offloader` on a persistent region
//! (`RegionSpec::Persistent`, `Region::open_persistent`: the node pool's
//! rows), on the simulated GPU: what one offloader stores is what a later
//! one, on the same region after the first shut down, loads byte for byte
//! (the region outlives its offloaders and is never unlinked by them); a
//! region of two ranks with neither agreement words nor an agreement
//! transport is refused before anything is made (P7 needs one), and so are
//! both at once and words of other ranks than the region's
//! (tests/pool_agreement.rs: two ranks agreeing through a pool's words).

use std::time::Duration;

use std::sync::Arc;

use kvoffload::internal::protocol::agreement::LocalSlots;
use kvoffload::{
    pattern, shared, JobId, KvAlloc, Lane, Offloader, OffloaderError, OffloaderOptions, RankSlots, Region, RegionSpec,
    Request, ShmOptions, SimRuntime, SlotJob, Transport,
};

const PAGE: usize = 4096;
const TENSORS: usize = 2;
const FACTOR: usize = 2;
const SLOTS: usize = 8;

fn kv() -> KvAlloc {
    KvAlloc { tensors: TENSORS, page_bytes: PAGE, gpu_blocks: 16, block_factor: FACTOR }
}

fn on_region(name: &str, ranks: usize) -> Result<Offloader, OffloaderError> {
    on_region_with(name, ranks, |_| {})
}

fn on_region_with(
    name: &str,
    ranks: usize,
    tune: impl FnOnce(&mut OffloaderOptions),
) -> Result<Offloader, OffloaderError> {
    let mut opts = OffloaderOptions::with_host_blocks(SLOTS);
    opts.region = RegionSpec::Persistent {
        name: name.into(),
        rank: 0,
        ranks,
        options: ShmOptions::new().timeout(Duration::from_secs(30)),
    };
    tune(&mut opts);
    Offloader::with_allocated_tensors(shared(SimRuntime::new()), kv(), opts)
}

fn page(tag: u64, t: usize, j: usize) -> Vec<u8> {
    let mut buf = vec![0u8; PAGE];
    pattern::fill(tag * 1000 + (t * 64 + j) as u64, &mut buf);
    buf
}

fn write_blocks(off: &Offloader, tag: u64, gpu: &[usize]) {
    let rt = &off.geometry().runtime;
    for (t, base) in off.geometry().tensors().into_iter().enumerate() {
        for (j, &b) in gpu.iter().enumerate() {
            let buf = page(tag, t, j);
            // SAFETY: `buf` is readable for the synchronous copy; the
            // destination is GPU block `b` of a tensor of the offloader.
            unsafe { rt.copy_htod(base.offset(b * PAGE), buf.as_ptr() as usize, PAGE) }.unwrap();
        }
    }
}

fn bad_pages(off: &Offloader, tag: u64, gpu: &[usize]) -> usize {
    let rt = &off.geometry().runtime;
    let mut bad = 0;
    for (t, base) in off.geometry().tensors().into_iter().enumerate() {
        for (j, &b) in gpu.iter().enumerate() {
            let mut got = vec![0u8; PAGE];
            // SAFETY: `got` is writable for the synchronous copy.
            unsafe { rt.copy_dtoh(got.as_mut_ptr() as usize, base.offset(b * PAGE), PAGE) }.unwrap();
            bad += usize::from(got != page(tag, t, j));
        }
    }
    bad
}

/// Submits `job` as job `id` and waits for it; it succeeded.
fn run(off: &Offloader, id: u64, lane: Lane, job: SlotJob) {
    off.submit(JobId(id), lane, &job).unwrap();
    let mut done = Vec::new();
    off.wait_jobs(&[JobId(id)], Request::new(), &mut |c| done.push(c)).unwrap();
    off.poll_each(&mut |c| done.push(c));
    assert_eq!(done.len(), 1, "{done:?}");
    assert!(done[0].error.is_none(), "{:?}", done[0]);
}

/// Removes the region when the test ends, passed or not.
struct Removed(String);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = Region::remove_persistent(&self.0, &ShmOptions::new());
    }
}

#[test]
fn a_later_offloader_loads_what_an_earlier_one_stored_in_a_persistent_region() {
    let name = format!("offloader-persistent-{}", std::process::id());
    let _cleanup = Removed(name.clone());
    let first = on_region(&name, 1).expect("first offloader creates the region");
    first.start().unwrap();
    write_blocks(&first, 7, &[0, 1, 2, 3]);
    run(&first, 1, Lane::Store, SlotJob::single(&[0, 1, 2, 3], &[6, 2], 0));
    first.shutdown(Request::new(), &mut drop).unwrap();
    drop(first);

    let second = on_region(&name, 1).expect("second offloader opens the region");
    second.start().unwrap();
    assert_eq!(bad_pages(&second, 7, &[8, 9, 10, 11]), TENSORS * 4, "its GPU blocks are not the content yet");
    run(&second, 1, Lane::Load, SlotJob::single(&[8, 9, 10, 11], &[6, 2], 0));
    assert_eq!(bad_pages(&second, 7, &[8, 9, 10, 11]), 0, "the first offloader's bytes, loaded by the second");
    second.shutdown(Request::new(), &mut drop).unwrap();
    assert!(!Region::remove_persistent(&name, &ShmOptions::new()).unwrap().is_empty(), "never unlinked by them");
}

/// Refused with an options error containing `says`, before the region
/// was made.
fn refused(name: &str, r: Result<Offloader, OffloaderError>, says: &str) {
    match r {
        Err(OffloaderError::Options(m)) => assert!(m.contains(says), "{m}"),
        r => panic!("{:?}", r.map(|_| ())),
    }
    assert!(Region::remove_persistent(name, &ShmOptions::new()).map(|v| v.is_empty()).unwrap_or(true));
}

#[test]
fn a_persistent_region_of_two_ranks_needs_agreement_words_or_a_transport() {
    let name = format!("offloader-persistent-ranks-{}", std::process::id());
    let _cleanup = Removed(name.clone());
    refused(&name, on_region(&name, 2), "needs agreement words (OffloaderOptions::agreement_slots");
}

struct Never;
impl Transport for Never {
    fn exchange(&self, _mine: u32) -> Result<Vec<u32>, String> {
        Err("never called: the offloader is refused first".into())
    }
}

fn words(ranks: usize) -> Arc<dyn RankSlots> {
    Arc::new(LocalSlots::new(ranks))
}

#[test]
fn agreement_words_and_a_transport_at_once_are_refused() {
    let name = format!("offloader-persistent-both-{}", std::process::id());
    let _cleanup = Removed(name.clone());
    let both = on_region_with(&name, 2, |o| {
        o.agreement_slots = Some(words(2));
        o.agreement = Some(Arc::new(Never));
    });
    refused(&name, both, "agreement and OffloaderOptions::agreement_slots are both set");
}

#[test]
fn agreement_words_of_other_ranks_than_the_regions_are_refused() {
    let name = format!("offloader-persistent-other-ranks-{}", std::process::id());
    let _cleanup = Removed(name.clone());
    for (ranks, given) in [(2, 3), (2, 1), (1, 2)] {
        let r = on_region_with(&name, ranks, |o| o.agreement_slots = Some(words(given)));
        refused(&name, r, &format!("holds the words of {given} ranks; the region has {ranks}"));
    }
}
