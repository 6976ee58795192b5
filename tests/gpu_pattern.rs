//! The pattern kernels (`Kernel::PatternFill`, `Kernel::PatternCheck`): one
//! test body run on the simulated GPU (always) and on the real GPU (skipped,
//! with a message on the real stderr, where there is none).
//!
//! - pages written by the fill read back as `pattern::fill` of their block;
//! - the check finds nothing in them, then exactly the words flipped;
//! - a misaligned destination with an odd length (the rule of
//!   `Kernel::PatternFill`: any address and length, the last short piece is
//!   the prefix of its word), bytes around it untouched;
//! - more entries than the grid has blocks, and host memory through its
//!   device alias.
//!
//! The sim-only tests check the faults the GPU would raise: host memory that
//! is no longer registered, a misaligned counter array.
//!
//! On a GPU machine: `gpu-bin/tests/gpu_pattern --test-threads=1` (built by
//! ci/build-gpu-bin).

use kvoffload::internal::runtime::PATTERN_ENTRY_BYTES;
use kvoffload::{pattern, Code, DevicePtr, GpuRuntime, Kernel, SimRuntime, Stream};

#[path = "gpu_common/mod.rs"]
mod gpu_common;
use gpu_common::{gated, gpu};

/// One table entry: `[address, key, first_word, bytes]`.
type Entry = [u64; 4];

/// A stream and a device table and counter array big enough for `cap`
/// entries.
struct Rig<'a> {
    rt: &'a dyn GpuRuntime,
    s: Stream,
    table: DevicePtr,
    out: DevicePtr,
    cap: usize,
}

impl<'a> Rig<'a> {
    fn new(rt: &'a dyn GpuRuntime, cap: usize) -> Self {
        let s = rt.stream_create().unwrap();
        let table = gated(rt, |gt| rt.mem_alloc(gt, cap * PATTERN_ENTRY_BYTES)).unwrap();
        let out = gated(rt, |gt| rt.mem_alloc(gt, cap * 4)).unwrap();
        Rig { rt, s, table, out, cap }
    }

    /// Host bytes to device memory, ordered on the rig's stream (a
    /// synchronous copy from pageable memory may still be in flight when a
    /// kernel on a non-blocking stream starts).
    fn write(&self, dst: DevicePtr, bytes: &[u8]) {
        // SAFETY: `bytes` outlives the synchronize below.
        unsafe { self.rt.copy_htod_async(dst, bytes.as_ptr() as usize, bytes.len(), self.s).unwrap() };
        gated(self.rt, |gt| self.rt.stream_synchronize(gt, self.s)).unwrap();
    }

    fn read(&self, src: DevicePtr, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        // SAFETY: `v` is a writable buffer of `n` bytes.
        unsafe { self.rt.copy_dtoh(v.as_mut_ptr() as usize, src, n).unwrap() };
        v
    }

    fn upload(&self, entries: &[Entry]) -> Vec<u64> {
        assert!(entries.len() <= self.cap);
        let words: Vec<u64> = entries.iter().flatten().copied().collect();
        // SAFETY: `words` is returned to the caller, who keeps it until the
        // stream is synchronized.
        unsafe { self.rt.copy_htod_async(self.table, words.as_ptr() as usize, words.len() * 8, self.s).unwrap() };
        words
    }

    fn fill(&self, entries: &[Entry]) {
        let _keep = self.upload(entries);
        let k = Kernel::PatternFill { table: self.table, count: entries.len() as u32 };
        // SAFETY: the table was uploaded on the same stream just before
        // (`_keep` outlives the synchronize below); its entries name memory
        // the test allocated (device memory, or registered or page-locked
        // host memory through its alias), or, in the sim-only fault tests,
        // memory the simulated GPU refuses with a fault instead of writing.
        unsafe { self.rt.launch(k, self.s).unwrap() };
        gated(self.rt, |gt| self.rt.stream_synchronize(gt, self.s)).unwrap();
    }

    /// Mismatching words per entry.
    fn check(&self, entries: &[Entry]) -> Vec<u32> {
        let _keep = self.upload(entries);
        // SAFETY: `out` holds `cap >= entries.len()` counters of 4 bytes and
        // is read only after the synchronize below.
        unsafe { self.rt.memset_d8_async(self.out, 0, entries.len() * 4, self.s).unwrap() };
        let k = Kernel::PatternCheck { table: self.table, count: entries.len() as u32, out: self.out };
        // SAFETY: as for `fill`; the kernel writes `entries.len()` counters
        // of `out`.
        unsafe { self.rt.launch(k, self.s).unwrap() };
        gated(self.rt, |gt| self.rt.stream_synchronize(gt, self.s)).unwrap();
        self.read(self.out, entries.len() * 4).chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    /// Flips bit 6 of the byte at `at`.
    fn flip(&self, at: DevicePtr) {
        let b = self.read(at, 1)[0] ^ 0x40;
        self.write(at, &[b]);
    }
}

impl Drop for Rig<'_> {
    fn drop(&mut self) {
        // SAFETY: every kernel of the rig ran on `s` and was synchronized by
        // the test that launched it (or faulted, poisoning the context); the
        // rig is gone after this.
        let _ = gated(self.rt, |gt| unsafe { self.rt.mem_free(gt, self.table) });
        // SAFETY: as above.
        let _ = gated(self.rt, |gt| unsafe { self.rt.mem_free(gt, self.out) });
        let _ = self.rt.stream_destroy(self.s);
    }
}

/// Indexes of the nonzero counts, with the counts.
fn nonzero(counts: &[u32]) -> Vec<(usize, u32)> {
    counts.iter().enumerate().filter(|(_, &c)| c != 0).map(|(i, &c)| (i, c)).collect()
}

/// The test body, on any runtime.
fn fill_check_and_odd_ranges(rt: &dyn GpuRuntime) {
    let rig = Rig::new(rt, 5000);

    // Two blocks of four 16 KiB pages, one entry per page: page p of block
    // b is words p * 2048.. of key 1000 + b.
    let page = 16 << 10;
    let mem = gated(rt, |gt| rt.mem_alloc(gt, 8 * page)).unwrap();
    // One entry over all of it (more words than a block has threads, more
    // bytes than the simulated GPU generates at a time).
    let whole = [[mem.raw(), 999, 0, 8 * page as u64]];
    rig.fill(&whole);
    let mut want = vec![0u8; 8 * page];
    pattern::fill(999, &mut want);
    assert!(rig.read(mem, 8 * page) == want, "one 128 KiB entry differs from pattern::fill");
    assert_eq!(rig.check(&whole), vec![0]);
    rig.flip(mem.offset(7 * page + 5));
    assert_eq!(rig.check(&whole), vec![1]);
    let pages: Vec<Entry> = (0..8u64)
        .map(|p| [mem.raw() + p * page as u64, 1000 + p / 4, (p % 4) * (page as u64 / 8), page as u64])
        .collect();
    rig.fill(&pages);
    for b in 0..2 {
        let mut want = vec![0u8; 4 * page];
        pattern::fill(1000 + b as u64, &mut want);
        assert!(rig.read(mem.offset(b * 4 * page), 4 * page) == want, "block {b} differs from pattern::fill");
    }
    assert_eq!(nonzero(&rig.check(&pages)), vec![]);
    rig.flip(mem.offset(6 * page + 12345));
    assert_eq!(nonzero(&rig.check(&pages)), vec![(6, 1)], "one flipped byte, one word");
    rig.flip(mem.offset(6 * page + 12346));
    assert_eq!(nonzero(&rig.check(&pages)), vec![(6, 1)], "a second byte of the same word");
    rig.flip(mem.offset(6 * page + 800));
    rig.flip(mem.offset(page));
    assert_eq!(nonzero(&rig.check(&pages)), vec![(1, 1), (6, 2)]);
    // A check against the wrong key finds every word.
    let wrong = [[mem.raw(), 7, 0, page as u64]];
    assert_eq!(rig.check(&wrong), vec![(page / 8) as u32]);

    // Misaligned and odd-length: 1001 bytes at +3 from word 5 of key 77, an
    // aligned 13 bytes (one word and a 5-byte tail), an empty entry; the
    // bytes around them keep their 0xAA.
    let odd = gated(rt, |gt| rt.mem_alloc(gt, 2048)).unwrap();
    rig.write(odd, &[0xAA; 2048]);
    let ranges: Vec<Entry> =
        vec![[odd.raw() + 3, 77, 5, 1001], [odd.raw() + 1024, 78, 0, 13], [odd.raw() + 1100, 79, 0, 0]];
    rig.fill(&ranges);
    let got = rig.read(odd, 2048);
    let (mut a, mut b) = (vec![0u8; 1001], vec![0u8; 13]);
    pattern::fill_from(77, 5, &mut a);
    pattern::fill_from(78, 0, &mut b);
    assert_eq!(got[..3], [0xAA; 3]);
    assert!(got[3..1004] == a, "misaligned odd-length range");
    assert!(got[1004..1024].iter().all(|&x| x == 0xAA), "bytes after the misaligned range");
    assert_eq!(got[1024..1037], b);
    assert!(got[1037..].iter().all(|&x| x == 0xAA), "bytes after the short range, or the empty entry wrote");
    assert_eq!(nonzero(&rig.check(&ranges)), vec![]);
    rig.flip(odd.offset(3 + 1000));
    assert_eq!(nonzero(&rig.check(&ranges)), vec![(0, 1)], "the last byte of the short last piece");
    rig.flip(odd.offset(1024 + 12));
    rig.flip(odd.offset(3));
    assert_eq!(nonzero(&rig.check(&ranges)), vec![(0, 2), (1, 1)]);

    // More entries than one launch has blocks (the grid strides): 5000
    // ranges of 40 bytes.
    let n = 5000u64;
    let many = gated(rt, |gt| rt.mem_alloc(gt, n as usize * 48)).unwrap();
    let small: Vec<Entry> = (0..n).map(|i| [many.raw() + 48 * i, i, i, 40]).collect();
    rig.fill(&small);
    let got = rig.read(many, n as usize * 48);
    for (i, e) in small.iter().enumerate() {
        let mut w = [0u8; 40];
        pattern::fill_from(e[1], e[2], &mut w);
        assert_eq!(got[48 * i..48 * i + 40], w, "entry {i}");
    }
    assert_eq!(nonzero(&rig.check(&small)), vec![]);
    rig.flip(many.offset(48 * 4321 + 39));
    assert_eq!(nonzero(&rig.check(&small)), vec![(4321, 1)]);

    // Host memory through its device alias.
    let host = gated(rt, |gt| rt.mem_alloc_host(gt, 4096)).unwrap();
    let alias = rt.host_device_ptr(host).unwrap();
    rig.fill(&[[alias.raw() + 8, 5, 0, 4000]]);
    // SAFETY: the allocation holds 4096 bytes and the kernel has finished.
    let seen = unsafe { std::slice::from_raw_parts(host as *const u8, 4096) }.to_vec();
    let mut want = vec![0u8; 4000];
    pattern::fill(5, &mut want);
    assert!(seen[8..4008] == want, "host memory written through its alias");
    assert_eq!(rig.check(&[[alias.raw() + 8, 5, 0, 4000]]), vec![0]);

    // SAFETY: the rig's kernels have finished (their checks synchronized
    // the stream); nothing uses the memory afterwards.
    gated(rt, |gt| unsafe { rt.mem_free_host(gt, host) }).unwrap();
    for p in [mem, odd, many] {
        // SAFETY: as above.
        gated(rt, |gt| unsafe { rt.mem_free(gt, p) }).unwrap();
    }
    drop(rig);
    gated(rt, |gt| rt.ctx_synchronize(gt)).expect("context healthy after the pattern kernels");
}

#[test]
fn sim_pattern_kernels_fill_check_and_odd_ranges() {
    fill_check_and_odd_ranges(&SimRuntime::new());
}

#[test]
fn gpu_pattern_kernels_fill_check_and_odd_ranges() {
    let Some(rt) = gpu("gpu_pattern_kernels_fill_check_and_odd_ranges") else { return };
    println!("device: {}", rt.describe());
    fill_check_and_odd_ranges(&rt);
}

/// The kernel reaches host memory only while it is registered: afterwards
/// the alias is a device fault, sticky, as for the gather kernel (P3).
#[test]
fn sim_pattern_fill_on_unregistered_host_memory_faults() {
    let rt = SimRuntime::new();
    let rig = Rig::new(&rt, 1);
    let buf = vec![0u8; 4096];
    // SAFETY: `buf` outlives its registration (unregistered below).
    unsafe { gated(&rt, |gt| rt.host_register(gt, buf.as_ptr() as usize, 4096)).unwrap() };
    let alias = rt.host_device_ptr(buf.as_ptr() as usize).unwrap();
    rig.fill(&[[alias.raw(), 1, 0, 64]]);
    assert!(pattern::first_mismatch(1, &buf[..64]).is_none(), "registered host memory written");
    gated(&rt, |gt| rt.host_unregister(gt, buf.as_ptr() as usize)).unwrap();
    let _keep = rig.upload(&[[alias.raw(), 1, 0, 64]]);
    // SAFETY: the simulated GPU faults on the unregistered alias (what this
    // test checks) instead of writing through it; the table was uploaded on
    // the same stream.
    unsafe { rt.launch(Kernel::PatternFill { table: rig.table, count: 1 }, rig.s).unwrap() };
    assert_eq!(gated(&rt, |gt| rt.stream_synchronize(gt, rig.s)).unwrap_err().code, Code::ILLEGAL_ADDRESS);
    assert_eq!(rt.poisoned(), Some(Code::ILLEGAL_ADDRESS));
}

/// The counters are added with 4-byte atomics: a misaligned `out` faults.
#[test]
fn sim_pattern_check_with_misaligned_counters_faults() {
    let rt = SimRuntime::new();
    let rig = Rig::new(&rt, 1);
    let mem = gated(&rt, |gt| rt.mem_alloc(gt, 64)).unwrap();
    let _keep = rig.upload(&[[mem.raw(), 1, 0, 64]]);
    // SAFETY: the simulated GPU faults on the misaligned counters (what this
    // test checks) instead of writing them; `mem` is a live allocation.
    unsafe { rt.launch(Kernel::PatternCheck { table: rig.table, count: 1, out: rig.out.offset(2) }, rig.s).unwrap() };
    assert_eq!(gated(&rt, |gt| rt.stream_synchronize(gt, rig.s)).unwrap_err().code, Code::MISALIGNED_ADDRESS);
}
