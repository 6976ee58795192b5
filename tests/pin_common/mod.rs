//! Helpers shared by the pinning tests: small anonymous regions, a data
//! pattern to prove memory is usable, and residency checks.
#![allow(dead_code)]

use std::sync::Arc;

use kvoffload::internal::pin::Prepared;
use kvoffload::internal::protocol::Coordinator;
use kvoffload::internal::region::AnonOptions;
use kvoffload::{page_size, CapturePolicy, GpuRuntime, Layout, PinOptions, Region, SimRuntime};

/// An anonymous region of `chunks` registration chunks of `chunk_bytes`
/// each (one rank, rows of one page), and options that cut it there.
pub fn region(chunks: usize, chunk_bytes: usize) -> (Arc<Region>, PinOptions) {
    let p = page_size();
    assert_eq!(chunk_bytes % p, 0);
    let l = Layout::new(1, p, chunks * chunk_bytes / p).unwrap();
    let r = Region::anonymous(l, &AnonOptions::new()).unwrap();
    (Arc::new(r), PinOptions::default().max_chunk_bytes(chunk_bytes))
}

/// `region(chunks, chunk_bytes)` on a simulated GPU, prepared for pinning
/// there: the region, the GPU (and as the engine takes it), the prepared pin.
pub fn prepared(chunks: usize, chunk_bytes: usize) -> (Arc<Region>, Arc<SimRuntime>, Arc<dyn GpuRuntime>, Prepared) {
    let (r, opts) = region(chunks, chunk_bytes);
    let (s, rt) = sim();
    let p = Prepared::new(rt.as_ref(), &r, &opts).unwrap();
    (r, s, rt, p)
}

/// A coordinator (policy AfterPinning) over `chunks`, each checked to lie
/// inside `r`, which the coordinator then holds.
pub fn coordinator_over(rt: &dyn GpuRuntime, r: &Arc<Region>, chunks: &[(usize, usize)]) -> Arc<Coordinator> {
    let (lo, hi) = (r.as_ptr() as usize, r.as_ptr() as usize + r.len());
    for &(a, l) in chunks {
        assert!(a >= lo && a + l <= hi, "chunk {a:#x}+{l} outside the region {lo:#x}..{hi:#x}");
    }
    // SAFETY: every range lies in `r` (checked above; its memory is
    // read-write), which the coordinator holds for as long as it lives.
    unsafe { Coordinator::new(rt, CapturePolicy::AfterPinning, chunks, Some(Box::new(r.clone()))) }.unwrap()
}

/// A simulated GPU as the engine takes it.
pub fn sim() -> (Arc<SimRuntime>, Arc<dyn GpuRuntime>) {
    let s = Arc::new(SimRuntime::new());
    let d: Arc<dyn GpuRuntime> = s.clone();
    (s, d)
}

/// Writes a pattern over the whole anonymous region and reads it back: the
/// memory is usable (pinned or pageable). The caller holds the only
/// reference left: every coordinator that held the region is gone.
#[track_caller]
pub fn assert_usable(r: &mut Arc<Region>, seed: u8) {
    let r = Arc::get_mut(r).expect("the region is still held (by a coordinator?)");
    let s = r.as_mut_slice().expect("anonymous region");
    for (i, b) in s.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    let s = r.as_slice().unwrap();
    assert!(s.iter().enumerate().all(|(i, b)| *b == (i as u8).wrapping_mul(31).wrapping_add(seed)));
}

/// Pages of `[addr, addr+len)` that mincore(2) reports not resident.
pub fn not_resident(addr: usize, len: usize) -> usize {
    let p = page_size();
    let mut v = vec![0u8; len.div_ceil(p)];
    // SAFETY: addr is page aligned (callers pass region chunks) and `v` has
    // one byte per page of the range.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, v.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    v.iter().filter(|b| **b & 1 == 0).count()
}

/// Pages of an anonymous private range that are not present-and-exclusive
/// in /proc/self/pagemap: a page that was only read maps the shared zero
/// page (present, not exclusive); a page faulted for writing is present
/// and exclusively ours. Stricter than mincore, which counts the zero page.
pub fn not_written(addr: usize, len: usize) -> usize {
    use std::io::{Read, Seek, SeekFrom};
    let p = page_size();
    let n = len.div_ceil(p);
    let mut f = std::fs::File::open("/proc/self/pagemap").unwrap();
    f.seek(SeekFrom::Start((addr / p * 8) as u64)).unwrap();
    let mut buf = vec![0u8; n * 8];
    f.read_exact(&mut buf).unwrap();
    buf.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .filter(|e| e & (1 << 63) == 0 || e & (1 << 56) == 0)
        .count()
}

/// Files in /dev/shm whose name contains "kvoffload" and `tag`.
pub fn shm_files(tag: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains("kvoffload") && n.contains(tag))
                .collect()
        })
        .unwrap_or_default()
}

/// `f` on a thread of its own; its result, or `None` when it has not
/// returned within `secs` (the thread is then left behind: a hang is
/// reported as a failure within the bound, not by the harness's limit).
pub fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs)).ok()
}

/// `f` on the pre-faulter `pf` on a thread of its own, bounded as
/// [`within`].
pub fn within_on<T: Send + 'static>(
    pf: &Arc<kvoffload::internal::pin::Prefaulter>,
    secs: u64,
    f: impl FnOnce(&kvoffload::internal::pin::Prefaulter) -> T + Send + 'static,
) -> Option<T> {
    let pf = pf.clone();
    within(secs, move || f(&pf))
}

/// What a call bounded by [`within`] returned, with `region` handed back;
/// when it did not return, the test fails with `what`, leaking `region`
/// (a thread left behind might still reach it).
pub fn returned<T, R>(got: Option<T>, region: R, what: &str) -> (T, R) {
    match got {
        Some(got) => (got, region),
        None => {
            std::mem::forget(region);
            panic!("{what}")
        }
    }
}

/// A pre-faulter whose workers broke on a panic settles within 10 s, its
/// workers all gone; `region` is handed back (leaked, the test failing with
/// `what`, when settling did not return).
pub fn settles_after_a_panic<R>(pf: &Arc<kvoffload::internal::pin::Prefaulter>, region: R, what: &str) -> R {
    use kvoffload::internal::pin::Prefault as _;
    let ((), region) = returned(within_on(pf, 10, |pf| pf.settle()), region, what);
    assert_eq!(pf.workers_running(), 0);
    region
}
