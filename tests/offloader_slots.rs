//! The slot-addressed core `Offloader` (`submit` of `SlotJob`s), on the
//! simulated GPU: an engine that chooses its own host slots and job ids
//! (vLLM's offloading manager) stores GPU blocks into slots and loads them
//! back, byte for byte; slots reused after their store was reported; every
//! typed refusal; job ids never reused; keyed and slot jobs never mixed;
//! shutdown drains slot jobs in flight.

use kvoffload::internal::runtime::sim::{Hold, HoldPoint};
use kvoffload::{
    pattern, shared, BlockKey, Completion, Direction, JobId, KeyedOffloader, KvAlloc, Lane, Offloader, OffloaderError,
    OffloaderOptions, ProtocolError, Request, SimConfig, SimRuntime, SlotJob, TransferError,
};

const PAGE: usize = 4096;
const TENSORS: usize = 3;
const FACTOR: usize = 2;
const GPU_BLOCKS: usize = 32;
const SLOTS: usize = 16;

fn kv() -> KvAlloc {
    KvAlloc { tensors: TENSORS, page_bytes: PAGE, gpu_blocks: GPU_BLOCKS, block_factor: FACTOR }
}

fn slot_offloader() -> Offloader {
    let mut opts = OffloaderOptions::with_host_blocks(SLOTS);
    // Small chunks, so pinning takes several registrations.
    opts.pin = opts.pin.max_chunk_bytes(4 * TENSORS * FACTOR * PAGE);
    let off = Offloader::with_allocated_tensors(shared(SimRuntime::new()), kv(), opts).expect("slot offloader");
    assert_eq!(off.geometry().host_blocks, SLOTS);
    off
}

/// A handle of the simulated GPU to hold or fault its work with, and an
/// offloader of `SLOTS` host slots (default options) on that GPU.
fn device_and_offloader() -> (SimRuntime, Offloader) {
    let sim = SimRuntime::new();
    let device = sim.another_handle();
    let off = Offloader::with_allocated_tensors(shared(sim), kv(), OffloaderOptions::with_host_blocks(SLOTS)).unwrap();
    (device, off)
}

/// An offloader whose store (job 1, block 0 to slot 0) the device holds
/// inside its copy, and that hold.
fn a_store_held() -> (Offloader, Hold) {
    let (device, off) = device_and_offloader();
    let hold = device.hold(HoldPoint::DeviceOp);
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0], &[0], 0)).unwrap();
    hold.wait_entered();
    (off, hold)
}

/// Releases `hold` 100 ms from now, on a thread of its own: a wait that
/// returns before then returned before the held work ran.
fn release_in_100_ms(hold: Hold) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(100));
        hold.release();
    })
}

/// Runs `first`, then releases `hold` once the returned sender sends (or
/// is dropped), or 5 s later at most, on a thread of its own: a call that
/// should return while the work is held and does not still ends, and the
/// test fails its assertions instead of hanging.
fn release_once_returned(
    hold: Hold,
    first: impl FnOnce() + Send + 'static,
) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    let (returned, wait) = std::sync::mpsc::channel::<()>();
    let release = std::thread::spawn(move || {
        first();
        let _ = wait.recv_timeout(std::time::Duration::from_secs(5));
        hold.release();
    });
    (returned, release)
}

/// The completions a poll hands out, collected.
fn poll(off: &Offloader) -> Vec<Completion> {
    let mut done = Vec::new();
    let n = off.poll_each(&mut |c| done.push(c));
    assert_eq!(n, done.len(), "poll_each's count is not what it handed out");
    done
}

/// The bytes of page `j` of tensor `t` of content `tag`.
fn page(tag: u64, t: usize, j: usize) -> Vec<u8> {
    let mut buf = vec![0u8; PAGE];
    pattern::fill(tag * 1000 + (t * 64 + j) as u64, &mut buf);
    buf
}

/// Writes content `tag` into GPU blocks `gpu` of every tensor (synchronous
/// copies through the offloader's runtime).
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

/// Zeroes GPU blocks `gpu` of every tensor.
fn zero_blocks(off: &Offloader, gpu: &[usize]) {
    let rt = &off.geometry().runtime;
    let zero = vec![0u8; PAGE];
    for base in off.geometry().tensors() {
        for &b in gpu {
            // SAFETY: as in `write_blocks`.
            unsafe { rt.copy_htod(base.offset(b * PAGE), zero.as_ptr() as usize, PAGE) }.unwrap();
        }
    }
}

/// Pages of GPU blocks `gpu` (every tensor) that differ from content `tag`.
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

/// Pages of host slots `slots` (every tensor, `FACTOR` sub-blocks each)
/// that differ from content `tag` written from `FACTOR` GPU blocks per
/// slot, read straight from the region. Only while no job touches them.
fn bad_host_pages(off: &Offloader, tag: u64, slots: &[usize]) -> usize {
    let l = &off.geometry().layout;
    let mut bad = 0;
    for t in 0..TENSORS {
        for (i, &s) in slots.iter().enumerate() {
            for sub in 0..FACTOR {
                let addr = l.host_addr(0, t, s, sub);
                // SAFETY: a page of this rank's slot `s` of the mapped
                // region; no job is in flight (the caller waited).
                let got = unsafe { std::slice::from_raw_parts(addr as *const u8, PAGE) };
                bad += usize::from(got != page(tag, t, i * FACTOR + sub).as_slice());
            }
        }
    }
    bad
}

/// Waits for every job and returns what poll reports.
fn drain(off: &Offloader) -> Vec<kvoffload::Completion> {
    off.wait_all(Request::new(), &mut drop).unwrap();
    let done = poll(off);
    assert_eq!(off.in_flight(), 0);
    done
}

fn gpu_range(first: usize, n: usize) -> Vec<usize> {
    (first..first + n).collect()
}

#[test]
fn round_trip_through_chosen_slots_byte_for_byte() {
    let off = slot_offloader();
    off.start().unwrap();
    let src = gpu_range(0, 4);
    write_blocks(&off, 1, &src);
    // Two slots the engine chose, out of order.
    let slots = [9, 5];
    off.submit(JobId(100), Lane::Store, &SlotJob::single(&src, &slots, 0)).unwrap();
    assert_eq!(off.in_flight(), 1);
    let done = drain(&off);
    assert_eq!(done.len(), 1);
    let c = &done[0];
    assert_eq!((c.job, c.direction), (JobId(100), Direction::DeviceToHost));
    assert!(c.keys.is_empty());
    assert!(c.error.is_none(), "{:?}", c.error);
    assert_eq!(c.bytes, (src.len() * TENSORS * PAGE) as u64);
    assert!(c.seconds >= 0.0);
    // The bytes sit in the slots the engine named, in its order.
    assert_eq!(bad_host_pages(&off, 1, &slots), 0);

    zero_blocks(&off, &src);
    assert_eq!(bad_pages(&off, 1, &src), src.len() * TENSORS, "zeroed");
    // Back into other GPU blocks, in the stored order ...
    let dst = gpu_range(10, 4);
    off.submit(JobId(101), Lane::Load, &SlotJob::single(&dst, &slots, 0)).unwrap();
    // ... and the slots the other way round into a third set.
    let swapped = gpu_range(20, 4);
    off.submit(JobId(102), Lane::Load, &SlotJob::single(&swapped, &[5, 9], 0)).unwrap();
    let done = drain(&off);
    assert_eq!(done.iter().map(|c| c.job).collect::<Vec<_>>(), [JobId(101), JobId(102)]);
    for c in &done {
        assert_eq!(c.direction, Direction::HostToDevice);
        assert!(c.keys.is_empty() && c.error.is_none(), "{c:?}");
        assert_eq!(c.bytes, (4 * TENSORS * PAGE) as u64);
    }
    assert_eq!(bad_pages(&off, 1, &dst), 0);
    // GPU blocks 20, 21 got slot 5, which holds blocks 2 and 3 of the store.
    let rt = &off.geometry().runtime;
    for (t, base) in off.geometry().tensors().into_iter().enumerate() {
        for (j, &b) in swapped.iter().enumerate() {
            let mut got = vec![0u8; PAGE];
            // SAFETY: `got` is writable for the synchronous copy.
            unsafe { rt.copy_dtoh(got.as_mut_ptr() as usize, base.offset(b * PAGE), PAGE) }.unwrap();
            assert!(got == page(1, t, (j + FACTOR) % (2 * FACTOR)), "tensor {t}, GPU block {b}");
        }
    }
    off.shutdown(Request::new(), &mut drop).unwrap();
}

/// Page `sub` of tensor `t` in host slot `slot`, read from the region.
fn host_page(off: &Offloader, t: usize, slot: usize, sub: usize) -> Vec<u8> {
    let addr = off.geometry().layout.host_addr(0, t, slot, sub);
    // SAFETY: a page of this rank's slot of the mapped region; the callers
    // read only while no job is in flight.
    unsafe { std::slice::from_raw_parts(addr as *const u8, PAGE) }.to_vec()
}

#[test]
fn partial_first_and_last_slots_from_first_sub() {
    let off = slot_offloader();
    let slots = [4, 6];
    // Full slots first: tag 7, GPU blocks 0..4.
    write_blocks(&off, 7, &gpu_range(0, 4));
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&gpu_range(0, 4), &slots, 0)).unwrap();
    drain(&off);
    // Then 2 GPU blocks from sub-block 1: the second half of slot 4 and the
    // first half of slot 6 (vLLM's block_indices[0] % factor == 1), both
    // slots partial.
    write_blocks(&off, 8, &[10, 11]);
    off.submit(JobId(2), Lane::Store, &SlotJob::single(&[10, 11], &slots, 1)).unwrap();
    let done = drain(&off);
    assert_eq!(done[0].bytes, (2 * TENSORS * PAGE) as u64);
    for t in 0..TENSORS {
        assert!(host_page(&off, t, 4, 0) == page(7, t, 0), "tensor {t}: slot 4, sub-block 0 untouched");
        assert!(host_page(&off, t, 4, 1) == page(8, t, 0), "tensor {t}: slot 4, sub-block 1");
        assert!(host_page(&off, t, 6, 0) == page(8, t, 1), "tensor {t}: slot 6, sub-block 0");
        assert!(host_page(&off, t, 6, 1) == page(7, t, 3), "tensor {t}: slot 6, sub-block 1 untouched");
    }
    // Loads the same way: the partial range, and the whole slots.
    off.submit(JobId(3), Lane::Load, &SlotJob::single(&[20, 21], &slots, 1)).unwrap();
    off.submit(JobId(4), Lane::Load, &SlotJob::single(&gpu_range(24, 4), &slots, 0)).unwrap();
    // One GPU block from the last sub-block of slot 6.
    off.submit(JobId(5), Lane::Load, &SlotJob::single(&[30], &[6], 1)).unwrap();
    drain(&off);
    assert_eq!(bad_pages(&off, 8, &[20, 21]), 0);
    let rt = &off.geometry().runtime;
    for (t, base) in off.geometry().tensors().into_iter().enumerate() {
        let want = [page(7, t, 0), page(8, t, 0), page(8, t, 1), page(7, t, 3), page(7, t, 3)];
        for (b, want) in [24, 25, 26, 27, 30].into_iter().zip(want) {
            let mut got = vec![0u8; PAGE];
            // SAFETY: `got` is writable for the synchronous copy.
            unsafe { rt.copy_dtoh(got.as_mut_ptr() as usize, base.offset(b * PAGE), PAGE) }.unwrap();
            assert!(got == want, "tensor {t}, GPU block {b}");
        }
    }
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn slot_jobs_are_ordered_after_the_compute_stream() {
    // Two device workers: a store not ordered after the compute stream
    // would run on the second while the first holds the compute stream's
    // memset.
    let sim = SimRuntime::with_config(SimConfig { workers: 2, ..SimConfig::default() });
    let device = sim.another_handle();
    let opts = OffloaderOptions::with_host_blocks(SLOTS);
    let off = Offloader::with_allocated_tensors(shared(sim), kv(), opts).unwrap();
    let rt = off.geometry().runtime.clone();
    let base = off.geometry().tensors()[0];
    write_blocks(&off, 2, &[0, 1]);
    let hold = device.hold(HoldPoint::DeviceOp);
    // Work on the compute stream, held on the device while the store is
    // submitted: the store must see what it writes.
    // SAFETY: GPU blocks 0 and 1 of tensor 0 are the offloader's, written
    // by nothing else until the store is reported.
    unsafe { rt.memset_d8_async(base, 0xAB, 2 * PAGE, off.geometry().compute_stream()) }.unwrap();
    hold.wait_entered();
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0, 1], &[3], 0)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(poll(&off), Vec::new(), "the store completed while the compute stream's work was held");
    hold.release();
    drain(&off);
    off.submit(JobId(2), Lane::Load, &SlotJob::single(&[6, 7], &[3], 0)).unwrap();
    drain(&off);
    for b in [6, 7] {
        let mut got = vec![0u8; PAGE];
        // SAFETY: `got` is writable for the synchronous copy.
        unsafe { rt.copy_dtoh(got.as_mut_ptr() as usize, base.offset(b * PAGE), PAGE) }.unwrap();
        assert!(got.iter().all(|&x| x == 0xAB), "GPU block {b} did not get the compute stream's bytes");
    }
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn slots_are_reused_after_their_store_was_reported() {
    let off = slot_offloader();
    off.start().unwrap();
    let src = gpu_range(0, 2);
    let mut id = 1000u64;
    let mut next = || {
        id += 1;
        JobId(id)
    };
    for round in 1..=4u64 {
        write_blocks(&off, round, &src);
        let store = next();
        off.submit(store, Lane::Store, &SlotJob::single(&src, &[7], 0)).unwrap();
        off.wait(store, Request::new(), &mut drop).unwrap();
        let done = poll(&off);
        assert_eq!(done.iter().map(|c| c.job).collect::<Vec<_>>(), [store]);
        let dst = gpu_range(8 + 2 * round as usize, 2);
        let load = next();
        off.submit(load, Lane::Load, &SlotJob::single(&dst, &[7], 0)).unwrap();
        off.wait(load, Request::new(), &mut drop).unwrap();
        assert_eq!(poll(&off).len(), 1);
        assert_eq!(bad_pages(&off, round, &dst), 0, "round {round}: slot 7 holds the last store");
        assert_eq!(bad_host_pages(&off, round, &[7]), 0);
    }
    // Two loads of one slot at once (a shared prefix) are fine.
    off.submit(next(), Lane::Load, &SlotJob::single(&[30, 31], &[7], 0)).unwrap();
    off.submit(next(), Lane::Load, &SlotJob::single(&[28, 29], &[7], 0)).unwrap();
    assert_eq!(drain(&off).len(), 2);
    assert_eq!(bad_pages(&off, 4, &[30, 31]), 0);
    assert_eq!(bad_pages(&off, 4, &[28, 29]), 0);
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn bad_slot_jobs_are_typed_errors_and_submit_nothing() {
    let off = slot_offloader();
    let store = |id: u64, gpu: &[usize], slots: &[usize]| {
        off.submit(JobId(id), Lane::Store, &SlotJob::single(gpu, slots, 0)).unwrap_err()
    };
    let load = |id: u64, gpu: &[usize], slots: &[usize]| {
        off.submit(JobId(id), Lane::Load, &SlotJob::single(gpu, slots, 0)).unwrap_err()
    };
    match store(1, &[0, 1, 2], &[0]) {
        OffloaderError::Transfer(TransferError::HostCountMismatch {
            group: 0,
            gpu: 3,
            host: 1,
            first_sub: 0,
            factor: FACTOR,
            need: 2,
        }) => {}
        e => panic!("{e:?}"),
    }
    match load(1, &[0, 1], &[]) {
        OffloaderError::Transfer(TransferError::HostCountMismatch { gpu: 2, host: 0, need: 1, .. }) => {}
        e => panic!("{e:?}"),
    }
    // From sub-block 1: 2 GPU blocks need 2 slots, 1 GPU block needs 1.
    match off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0, 1], &[0], 1)).unwrap_err() {
        OffloaderError::Transfer(TransferError::HostCountMismatch {
            group: 0,
            gpu: 2,
            host: 1,
            first_sub: 1,
            factor: FACTOR,
            need: 2,
        }) => {}
        e => panic!("{e:?}"),
    }
    match off.submit(JobId(1), Lane::Load, &SlotJob::single(&[0], &[0, 1], 1)).unwrap_err() {
        OffloaderError::Transfer(TransferError::HostCountMismatch {
            gpu: 1, host: 2, first_sub: 1, need: 1, ..
        }) => {}
        e => panic!("{e:?}"),
    }
    match off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0], &[0], FACTOR)).unwrap_err() {
        OffloaderError::Transfer(TransferError::FirstSubTooLarge { group: 0, first_sub: FACTOR, factor: FACTOR }) => {}
        e => panic!("{e:?}"),
    }
    match store(1, &[0, 1], &[SLOTS]) {
        OffloaderError::Transfer(TransferError::HostBlockOutOfRange { group: 0, block: SLOTS, num_blocks: SLOTS }) => {}
        e => panic!("{e:?}"),
    }
    match load(1, &[0, GPU_BLOCKS], &[0]) {
        OffloaderError::Transfer(TransferError::GpuBlockOutOfRange {
            group: 0,
            block: GPU_BLOCKS,
            num_blocks: GPU_BLOCKS,
        }) => {}
        e => panic!("{e:?}"),
    }
    match store(1, &[0, 1, 2, 3], &[4, 4]) {
        OffloaderError::Transfer(TransferError::RepeatedHostBlock { group: 0, block: 4 }) => {}
        e => panic!("{e:?}"),
    }
    match load(1, &[5, 6, 5, 7], &[1, 2]) {
        OffloaderError::Transfer(TransferError::RepeatedGpuBlock { group: 0, block: 5 }) => {}
        e => panic!("{e:?}"),
    }
    match store(1, &[], &[]) {
        OffloaderError::Transfer(TransferError::EmptyJob { id: JobId(1) }) => {}
        e => panic!("{e:?}"),
    }
    assert_eq!(off.in_flight(), 0, "a refused job is not in flight");
    assert!(poll(&off).is_empty(), "a refused job is never reported");
    // Nothing was submitted, so id 1 was not used: it is accepted now.
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0, 1], &[0], 0)).unwrap();
    assert_eq!(drain(&off).len(), 1);
    // Waits on ids that are not in flight: never submitted, and reported.
    assert!(matches!(
        off.wait(JobId(77), Request::new(), &mut drop),
        Err(OffloaderError::UnknownJob { id: JobId(77) })
    ));
    assert!(matches!(off.wait(JobId(1), Request::new(), &mut drop), Err(OffloaderError::UnknownJob { id: JobId(1) })));
    off.shutdown(Request::new(), &mut drop).unwrap();
    match store(2, &[0, 1], &[0]) {
        OffloaderError::ShutDown => {}
        e => panic!("{e:?}"),
    }
}

#[test]
fn job_ids_are_never_reused() {
    let off = slot_offloader();
    off.submit(JobId(5), Lane::Store, &SlotJob::single(&[0, 1], &[0], 0)).unwrap();
    // In flight: the same id again, either direction.
    match off.submit(JobId(5), Lane::Store, &SlotJob::single(&[2, 3], &[1], 0)) {
        Err(OffloaderError::Transfer(TransferError::JobIdReused { id: JobId(5) })) => {}
        other => panic!("{other:?}"),
    }
    match off.submit(JobId(5), Lane::Load, &SlotJob::single(&[2, 3], &[1], 0)) {
        Err(OffloaderError::Transfer(TransferError::JobIdReused { id: JobId(5) })) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(off.in_flight(), 1);
    let done = drain(&off);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].bytes, (FACTOR * TENSORS * PAGE) as u64, "the first job, not a refused one");
    // Reported: still used.
    match off.submit(JobId(5), Lane::Load, &SlotJob::single(&[2, 3], &[0], 0)) {
        Err(OffloaderError::Transfer(TransferError::JobIdReused { id: JobId(5) })) => {}
        other => panic!("{other:?}"),
    }
    // Ids need not grow: any id never used is accepted.
    off.submit(JobId(3), Lane::Load, &SlotJob::single(&[2, 3], &[0], 0)).unwrap();
    off.submit(JobId(u64::MAX), Lane::Load, &SlotJob::single(&[4, 5], &[0], 0)).unwrap();
    off.submit(JobId(0), Lane::Load, &SlotJob::single(&[6, 7], &[0], 0)).unwrap();
    let done = drain(&off);
    assert_eq!(done.iter().map(|c| c.job).collect::<Vec<_>>(), [JobId(3), JobId(u64::MAX), JobId(0)]);
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn keyed_and_slot_jobs_never_mix() {
    // A core offloader has no keyed calls (the type decides); the core of
    // a keyed offloader refuses slot jobs, which would write host slots its
    // block manager owns, with nothing submitted.
    let k = [BlockKey::new(1, 0)];
    let keyed = KeyedOffloader::with_allocated_tensors(
        shared(SimRuntime::new()),
        kv(),
        OffloaderOptions::with_host_blocks(SLOTS),
    )
    .unwrap();
    for lane in [Lane::Store, Lane::Load, Lane::LoadExpedited] {
        match keyed.core().submit(JobId(1), lane, &SlotJob::single(&[0, 1], &[0], 0)) {
            Err(OffloaderError::KeyedCore { call: "submit" }) => {}
            other => panic!("{lane:?}: {other:?}"),
        }
    }
    assert_eq!(keyed.core().in_flight(), 0);
    // The keyed API still works there.
    let stored = keyed.store(&k, &[0, 1]).unwrap();
    keyed.core().wait_all(Request::new(), &mut drop).unwrap();
    assert_eq!(keyed.poll().iter().map(|c| c.job).collect::<Vec<_>>(), [stored.job.unwrap()]);
    assert_eq!(keyed.stored_blocks(), 1);
    keyed.core().shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn shutdown_drains_slot_jobs_in_flight() {
    let off = slot_offloader();
    off.start().unwrap();
    let mut slots = Vec::new();
    for i in 0..8usize {
        let gpu = gpu_range(2 * i, 2);
        write_blocks(&off, 10 + i as u64, &gpu);
        off.submit(JobId(i as u64), Lane::Store, &SlotJob::single(&gpu, &[15 - i], 0)).unwrap();
        slots.push(15 - i);
    }
    write_blocks(&off, 30, &[16, 17]);
    off.submit(JobId(8), Lane::Store, &SlotJob::single(&[16, 17], &[0], 0)).unwrap();
    // A load from a slot the engine filled before (its store reported).
    off.wait(JobId(8), Request::new(), &mut drop).unwrap();
    assert_eq!(poll(&off).len(), 9);
    off.submit(JobId(9), Lane::Load, &SlotJob::single(&[20, 21], &[0], 0)).unwrap();
    for i in 0..4usize {
        let gpu = gpu_range(24 + 2 * i, 2);
        write_blocks(&off, 40 + i as u64, &gpu);
        off.submit(JobId(10 + i as u64), Lane::Store, &SlotJob::single(&gpu, &[1 + i], 0)).unwrap();
    }
    assert_eq!(off.in_flight(), 5);
    off.shutdown(Request::new(), &mut drop).unwrap();
    assert_eq!(off.in_flight(), 0, "every slot job drained and reported");
    assert!(poll(&off).is_empty());
    // Every store's bytes are in its slot, the drained ones too (the GPU
    // blocks of the drained load went with the tensors at shutdown).
    for (i, &s) in slots.iter().enumerate() {
        assert_eq!(bad_host_pages(&off, 10 + i as u64, &[s]), 0, "slot {s}");
    }
    assert_eq!(bad_host_pages(&off, 30, &[0]), 0);
    for i in 0..4usize {
        assert_eq!(bad_host_pages(&off, 40 + i as u64, &[1 + i]), 0, "drained store to slot {}", 1 + i);
    }
    match off.submit(JobId(99), Lane::Store, &SlotJob::single(&[0, 1], &[0], 0)) {
        Err(OffloaderError::ShutDown) => {}
        other => panic!("{other:?}"),
    }
}

fn grouped_offloader() -> Offloader {
    // Group 0: tensors 0 and 1; group 1: tensor 2.
    let opts = OffloaderOptions { kv_groups: Some(vec![2, 1]), ..OffloaderOptions::with_host_blocks(SLOTS) };
    Offloader::with_allocated_tensors(shared(SimRuntime::new()), kv(), opts).expect("grouped slot offloader")
}

/// Page `sub` of slot `slot` for tensor `t` (local to group `g`).
fn group_page(off: &Offloader, g: usize, t: usize, slot: usize, sub: usize) -> Vec<u8> {
    let addr = off.geometry().layout.host_addr(g, t, slot, sub);
    // SAFETY: as in `host_page`.
    unsafe { std::slice::from_raw_parts(addr as *const u8, PAGE) }.to_vec()
}

fn gpu_page(off: &Offloader, t: usize, b: usize) -> Vec<u8> {
    let mut got = vec![0u8; PAGE];
    // SAFETY: `got` is writable for the synchronous copy.
    unsafe {
        off.geometry().runtime.copy_dtoh(got.as_mut_ptr() as usize, off.geometry().tensors()[t].offset(b * PAGE), PAGE)
    }
    .unwrap();
    got
}

#[test]
fn kv_groups_share_slot_ids_and_touch_only_their_tensors() {
    let off = grouped_offloader();
    assert_eq!(off.geometry().layout.num_groups(), 2);
    write_blocks(&off, 5, &gpu_range(0, 5));
    // vLLM's shape: group 0 has GPU blocks 0..3 from sub-block 1 (slots 2
    // and 3), group 1 GPU blocks 3, 4 (slot 3 too: its own tensor's part).
    let job = SlotJob::groups(&[0, 1, 2, 3, 4], &[3, 2], &[2, 3, 3], &[1, 0]);
    off.submit(JobId(1), Lane::Store, &job).unwrap();
    let done = drain(&off);
    assert_eq!(done[0].bytes, ((3 * 2 + 2) * PAGE) as u64, "3 blocks of 2 tensors, 2 of 1");
    let zero = vec![0u8; PAGE];
    for t in 0..2 {
        assert!(group_page(&off, 0, t, 2, 0) == zero, "group 0, tensor {t}: slot 2, sub-block 0 untouched");
        for (sub_at, j) in [((2, 1), 0), ((3, 0), 1), ((3, 1), 2)] {
            assert!(group_page(&off, 0, t, sub_at.0, sub_at.1) == page(5, t, j), "group 0, tensor {t}, {sub_at:?}");
        }
    }
    assert!(group_page(&off, 1, 0, 3, 0) == page(5, 2, 3), "group 1: slot 3, sub-block 0");
    assert!(group_page(&off, 1, 0, 3, 1) == page(5, 2, 4), "group 1: slot 3, sub-block 1");
    for sub in 0..FACTOR {
        assert!(group_page(&off, 1, 0, 2, sub) == zero, "group 1: slot 2 untouched");
    }
    // Back into other GPU blocks, the same shape.
    let back = SlotJob::groups(&[10, 11, 12, 13, 14], &[3, 2], &[2, 3, 3], &[1, 0]);
    off.submit(JobId(2), Lane::Load, &back).unwrap();
    // Only group 1, from its last sub-block of slot 3.
    let one = SlotJob::groups(&[20], &[0, 1], &[3], &[0, 1]);
    off.submit(JobId(3), Lane::Load, &one).unwrap();
    drain(&off);
    for t in 0..2 {
        for (i, b) in [10, 11, 12].into_iter().enumerate() {
            assert!(gpu_page(&off, t, b) == page(5, t, i), "tensor {t}, GPU block {b}");
        }
    }
    for (i, b) in [13, 14].into_iter().enumerate() {
        assert!(gpu_page(&off, 2, b) == page(5, 2, 3 + i), "tensor 2, GPU block {b}");
    }
    assert!(gpu_page(&off, 2, 20) == page(5, 2, 4), "tensor 2, GPU block 20");
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn kv_group_jobs_of_the_wrong_shape_are_typed_errors() {
    let off = grouped_offloader();
    let store = |job: SlotJob<'_>| off.submit(JobId(1), Lane::Store, &job).unwrap_err();
    let shape = |e: OffloaderError| match e {
        OffloaderError::SlotJobShape { given, expected, .. } => (given, expected),
        e => panic!("{e:?}"),
    };
    assert_eq!(shape(store(SlotJob::groups(&[0, 1], &[2], &[0], &[0]))), (1, 2));
    assert_eq!(shape(store(SlotJob::groups(&[0, 1], &[2, 0], &[0], &[0]))), (1, 2), "first_subs");
    assert_eq!(shape(store(SlotJob::groups(&[0, 1, 2], &[2, 2], &[0, 1], &[0, 0]))), (3, 4), "GPU blocks");
    assert_eq!(shape(store(SlotJob::groups(&[0, 1, 2], &[2, 1], &[0], &[0, 0]))), (1, 2), "slots");
    // One-group calls on two groups.
    assert_eq!(shape(off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0, 1], &[0], 0)).unwrap_err()), (1, 2));
    // Per-group checks name the group.
    match store(SlotJob::groups(&[0, 1, 2, 3], &[0, 4], &[5, 5], &[0, 0])) {
        OffloaderError::Transfer(TransferError::RepeatedHostBlock { group: 1, block: 5 }) => {}
        e => panic!("{e:?}"),
    }
    match store(SlotJob::groups(&[0, 1, 2], &[2, 1], &[SLOTS, 0], &[0, 0])) {
        OffloaderError::Transfer(TransferError::HostBlockOutOfRange { group: 0, block: SLOTS, num_blocks: SLOTS }) => {}
        e => panic!("{e:?}"),
    }
    match store(SlotJob::groups(&[0, 1], &[1, 1], &[0, 0, 1], &[0, FACTOR])) {
        OffloaderError::Transfer(TransferError::FirstSubTooLarge { group: 1, first_sub: FACTOR, .. }) => {}
        e => panic!("{e:?}"),
    }
    assert_eq!(off.in_flight(), 0);
    off.submit(JobId(1), Lane::Store, &SlotJob::groups(&[0], &[1, 0], &[0], &[0, 0])).unwrap();
    assert_eq!(drain(&off).len(), 1);
    off.shutdown(Request::new(), &mut drop).unwrap();

    // Groups need slot jobs (a keyed offloader refuses them) and a
    // partition of the tensors.
    for (keyed, groups) in [(true, vec![2, 1]), (false, vec![2, 2]), (false, vec![3, 0])] {
        let opts = OffloaderOptions { kv_groups: Some(groups.clone()), ..OffloaderOptions::with_host_blocks(SLOTS) };
        let r = if keyed {
            KeyedOffloader::with_allocated_tensors(shared(SimRuntime::new()), kv(), opts).map(|_| ())
        } else {
            Offloader::with_allocated_tensors(shared(SimRuntime::new()), kv(), opts).map(|_| ())
        };
        match r {
            Err(OffloaderError::Options(_)) => {}
            other => panic!("keyed {keyed} {groups:?}: {other:?}"),
        }
    }
}

#[test]
fn slots_of_jobs_not_yet_reported_are_busy() {
    let off = slot_offloader();
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0, 1], &[3], 0)).unwrap();
    // Until poll reports the store, no job may use slot 3.
    match off.submit(JobId(2), Lane::Store, &SlotJob::single(&[2, 3], &[5, 3], 0)) {
        Err(OffloaderError::SlotBusy { group: 0, slot: 3, job: JobId(1), direction: Direction::DeviceToHost }) => {}
        other => panic!("{other:?}"),
    }
    match off.submit(JobId(2), Lane::Load, &SlotJob::single(&[2, 3], &[3], 0)) {
        Err(OffloaderError::SlotBusy { group: 0, slot: 3, job: JobId(1), direction: Direction::DeviceToHost }) => {}
        other => panic!("{other:?}"),
    }
    // Completed on the GPU is not enough: reported is.
    off.wait(JobId(1), Request::new(), &mut drop).unwrap();
    assert!(matches!(
        off.submit(JobId(2), Lane::Store, &SlotJob::single(&[2, 3], &[3], 0)),
        Err(OffloaderError::SlotBusy { slot: 3, .. })
    ));
    assert_eq!(poll(&off).len(), 1);
    // Loads of one slot run together; a store to it waits for their report.
    off.submit(JobId(2), Lane::Load, &SlotJob::single(&[4, 5], &[3], 0)).unwrap();
    off.submit(JobId(3), Lane::Load, &SlotJob::single(&[6, 7], &[3], 0)).unwrap();
    match off.submit(JobId(4), Lane::Store, &SlotJob::single(&[8, 9], &[3], 0)) {
        Err(OffloaderError::SlotBusy {
            group: 0,
            slot: 3,
            job: JobId(2) | JobId(3),
            direction: Direction::HostToDevice,
        }) => {}
        other => panic!("{other:?}"),
    }
    // Other slots are free meanwhile; the refused id 4 is unused.
    off.submit(JobId(4), Lane::Store, &SlotJob::single(&[8, 9], &[4], 0)).unwrap();
    assert_eq!(drain(&off).len(), 3);
    off.submit(JobId(5), Lane::Store, &SlotJob::single(&[8, 9], &[3], 0)).unwrap();
    assert_eq!(drain(&off).len(), 1);
    off.shutdown(Request::new(), &mut drop).unwrap();

    // With groups, a slot id is one slot per group.
    let off = grouped_offloader();
    let g0 = SlotJob::groups(&[0, 1], &[2, 0], &[3], &[0, 0]);
    let g1 = SlotJob::groups(&[0, 1], &[0, 2], &[3], &[0, 0]);
    off.submit(JobId(1), Lane::Store, &g0).unwrap();
    off.submit(JobId(2), Lane::Store, &g1).unwrap();
    match off.submit(JobId(3), Lane::Load, &g1) {
        Err(OffloaderError::SlotBusy { group: 1, slot: 3, job: JobId(2), .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(drain(&off).len(), 2);
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn wait_jobs_waits_for_those_in_flight_and_skips_the_rest() {
    let (device, off) = device_and_offloader();
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0, 1], &[0], 0)).unwrap();
    off.wait_all(Request::new(), &mut drop).unwrap();
    assert_eq!(poll(&off).len(), 1);
    write_blocks(&off, 3, &[2, 3]);
    // The store's copies are held on the device until 100 ms from now.
    let hold = device.hold(HoldPoint::DeviceOp);
    off.submit(JobId(2), Lane::Store, &SlotJob::single(&[2, 3], &[1], 0)).unwrap();
    off.submit(JobId(3), Lane::Load, &SlotJob::single(&[4, 5], &[0], 0)).unwrap();
    hold.wait_entered();
    let release = release_in_100_ms(hold);
    // 1 reported, 2 and 3 in flight, 9 never submitted.
    off.wait_jobs(&[JobId(9), JobId(1), JobId(2), JobId(3)], Request::new(), &mut drop).unwrap();
    assert_eq!(bad_host_pages(&off, 3, &[1]), 0, "job 2 completed when wait_jobs returned");
    release.join().unwrap();
    assert_eq!(poll(&off).iter().map(|c| c.job).collect::<Vec<_>>(), [JobId(2), JobId(3)]);
    off.wait_jobs(&[], Request::new(), &mut drop).unwrap();
    off.shutdown(Request::new(), &mut drop).unwrap();
    assert!(matches!(off.wait_jobs(&[JobId(2)], Request::new(), &mut drop), Err(OffloaderError::ShutDown)));
}

#[test]
fn wait_all_waits_for_every_job_in_flight() {
    let (device, off) = device_and_offloader();
    write_blocks(&off, 4, &[2, 3]);
    // The store's copies are held on the device until 100 ms from now.
    let hold = device.hold(HoldPoint::DeviceOp);
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&[2, 3], &[1], 0)).unwrap();
    hold.wait_entered();
    let release = release_in_100_ms(hold);
    off.wait_all(Request::new(), &mut drop).unwrap();
    assert_eq!(bad_host_pages(&off, 4, &[1]), 0, "job 1 completed when wait_all returned");
    release.join().unwrap();
    assert_eq!(poll(&off).iter().map(|c| c.job).collect::<Vec<_>>(), [JobId(1)]);
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn a_slot_job_hands_back_its_blocks_and_slots() {
    let single = SlotJob::single(&[3, 4, 5], &[7, 8], 1);
    assert_eq!((single.gpu_blocks(), single.slots()), (&[3, 4, 5][..], &[7, 8][..]));
    let groups = SlotJob::groups(&[0, 1, 2], &[1, 2], &[5, 6], &[0, 1]);
    assert_eq!((groups.gpu_blocks(), groups.slots()), (&[0, 1, 2][..], &[5, 6][..]));
}

/// An interruptible wait reports the failure of the job it waits for, and
/// only that one: a job failed beside it goes to the sink, not to its
/// result.
#[test]
fn an_interruptible_wait_reports_its_own_jobs_failure_not_anothers() {
    use kvoffload::{Code, SimFault};
    let never = || false;
    for (failing, waited) in [(1, 2), (1, 1)] {
        let (device, off) = device_and_offloader();
        // Job 1's first copy enqueue fails.
        device.inject(SimFault::Copy { nth: 1, code: Code::INVALID_VALUE });
        off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0], &[0], 0)).unwrap();
        off.submit(JobId(2), Lane::Store, &SlotJob::single(&[1], &[1], 0)).unwrap();
        let mut seen = Vec::new();
        let r = off
            .wait(JobId(waited), Request::new().interruptible(&never), &mut |c| seen.push((c.job, c.error.is_some())));
        assert!(seen.contains(&(JobId(waited), waited == failing)), "{seen:?}");
        match (r, waited == failing) {
            (Err(OffloaderError::Transfer(TransferError::JobFailed { id, error })), true) => {
                assert_eq!((id, error.code), (JobId(failing), Code::INVALID_VALUE))
            }
            (Ok(()), false) => {}
            (r, _) => panic!("waiting for job {waited} beside failing job {failing}: {r:?} ({seen:?})"),
        }
        drain(&off);
        off.shutdown(Request::new(), &mut drop).unwrap();
    }
}

/// Shutdown drains stores and loads alike: after it, none is in flight
/// (one of each in flight when it begins).
#[test]
fn shutdown_drains_stores_and_loads_in_flight() {
    let off = slot_offloader();
    write_blocks(&off, 5, &[0, 1]);
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0, 1], &[2], 0)).unwrap();
    drain(&off);
    off.submit(JobId(2), Lane::Store, &SlotJob::single(&[0, 1], &[3], 0)).unwrap();
    off.submit(JobId(3), Lane::Load, &SlotJob::single(&[4, 5], &[2], 0)).unwrap();
    off.shutdown(Request::new(), &mut drop).unwrap();
    assert_eq!(off.in_flight(), 0, "shutdown left jobs in flight");
    assert_eq!(bad_host_pages(&off, 5, &[3]), 0, "the store did not run before shutdown returned");
}

/// Interruptible shutdown with a registered graph alive is refused before
/// it waits for the jobs in flight (here a store the device holds).
#[test]
fn an_interruptible_shutdown_beside_a_live_graph_is_refused_before_waiting() {
    let (off, hold) = a_store_held();
    let token = off.register_graph().unwrap();
    let never = || false;
    // A shutdown that waited for the store first ends too, and fails below.
    let (returned, release) = release_once_returned(hold, || {});
    let r = off.shutdown(Request::new().interruptible(&never), &mut |_| {});
    let _ = returned.send(());
    assert!(matches!(r, Err(OffloaderError::Protocol(ProtocolError::GraphsAlive { live: 1 }))), "{r:?}");
    assert_eq!(off.in_flight(), 1, "the refused shutdown waited for the held store");
    drop(token);
    release.join().unwrap();
    drain(&off);
    off.shutdown(Request::new(), &mut drop).unwrap();
}

/// An interruptible wait calls its check once every 50 ms
/// (`sync::INTERRUPT_EVERY`), also after its first few checks: interrupted
/// well after it began (the job held on the device), it returns
/// `Interrupted`.
#[test]
fn an_interruptible_wait_is_interrupted_however_long_it_waited() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (off, hold) = a_store_held();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    // The interrupt after 6 of the wait's 50 ms check periods; a wait that
    // missed it returns once the hold ends (and the test fails).
    let (returned, later) = release_once_returned(hold, move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        s2.store(true, Ordering::SeqCst);
    });
    let calls = std::sync::atomic::AtomicU32::new(0);
    let check = || {
        calls.fetch_add(1, Ordering::SeqCst);
        stop.load(Ordering::SeqCst)
    };
    let began = std::time::Instant::now();
    let r = off.wait(JobId(1), Request::new().interruptible(&check), &mut |_| {});
    let waited = began.elapsed();
    let _ = returned.send(());
    assert!(matches!(r, Err(OffloaderError::Protocol(ProtocolError::Interrupted { .. }))), "{r:?}");
    // And not more often than every 50 ms (the check may be costly: the
    // Python front's takes the GIL): at most one per period begun.
    let periods = (waited.as_millis() / 50) as u32 + 1;
    let calls = calls.load(Ordering::SeqCst);
    assert!(calls <= periods, "{calls} checks in {waited:?}");
    later.join().unwrap();
    drain(&off);
    off.shutdown(Request::new(), &mut drop).unwrap();
}
