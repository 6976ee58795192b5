//! F1, the pre-fault pool: the `Prefaulter`'s workers, its lookahead and
//! its huge-page fallback, under the pinning thread an engine gets.
//!
//! Property: every slice of the region is faulted exactly once, and none
//! after its chunk was registered (a registration never races a fault of
//! its own pages).
//!
//! Each scenario: the pinning thread of `pin::spawn_pinner` (the one spawn
//! path: `Offloader::start` and `PinHandle` run it) pins a region on the
//! simulated GPU (AfterPinning; main joins the pinner), its pre-faulter a
//! real `Prefaulter` pool. Checked in every interleaving: pinning ends
//! Pinned; each slice, when a worker faults it, overlaps no slice faulted
//! before, is of a chunk whose `ensure` has not returned, and is not
//! registered in the simulated driver; the slices faulted cover the region
//! exactly and the pool counted as many; the fallback tripped exactly where
//! it is armed; no worker is left running.
//! - **Two workers on the chunk `ensure` waits for**: one chunk of two
//!   pages (two slices), 2 workers (Touch mode, base pages). Threads: main,
//!   the pinner, 2 workers, the sim's device thread (5); bound 1 (690,626
//!   interleavings at bound 2, 255 s).
//! - **Lookahead**: three chunks of a page, 2 workers, a lookahead of two
//!   chunks: at chunk 0 the loop hints chunks 1 and 2, which the workers
//!   fault while chunk 0 is registered, and `ensure` of each finds it
//!   hinted. 5 threads; bound 1 (about 45 s: every chunk queued wakes both
//!   workers), so ci/test runs its one schedule without preemptions.
//! - **Huge pages and the fallback**: three chunks of one 2 MiB huge page
//!   (Populate mode), a lookahead of two chunks, the huge-page fallback
//!   armed at a rate no worker reaches (`u32::MAX` MB/s: it trips as soon
//!   as its window of two slices per worker is full, and the worker that
//!   trips it drops the pool's lock, advises the rest of the region
//!   `MADV_NOHUGEPAGE` and takes the lock again while the pinner goes on);
//!   one worker, so that the window fills within loom's size. 4 threads;
//!   bound 2 (ci/test: 1).
//!
//! Shuttle (docs/PROOFS.md, "Past loom's bound") runs 3 workers in each: 6
//! pages of one chunk (3 slices); six chunks of two pages (the last one
//! page: 11 slices) with a lookahead of three chunks; the same in huge
//! pages with the fallback (a window of six slices).
//!
//! What stands in for what. The fault: `Prefaulter::reserving`'s hook runs
//! on the worker that faults a slice, right before it touches it (what a
//! shared region with deferred reservation reserves there); the model's
//! hook records and checks the slice under the model's lock, and the real
//! fault that follows (`madvise(MADV_POPULATE_WRITE)`, or one byte touched
//! a page) makes no scheduling point before the worker takes the pool's
//! lock again, so to loom and shuttle it happens at the hook's unlock. The
//! region: one 2 MiB-aligned heap allocation made once per process (the
//! faults really populate it; later runs find it resident), not the
//! anonymous mapping of `src/region`. "Handed to registration": the
//! model's `Prefault` passes every call through to the pool, as the
//! engine's own wrapper does, and notes under the model's lock when
//! `ensure` of a chunk returned; the loop registers that chunk next, so
//! while the hook holds the lock with the chunk not handed, no
//! registration of it has begun. The fallback's rate is real time, but no
//! slice passes `u32::MAX` MB/s, so it trips in every run; the kernel's
//! stall counters (/proc/vmstat) are not read in the model builds
//! (`with_huge_fallback`), so the rate alone decides, as where they cannot
//! be read. Workers do not bind CPUs nor change their niceness in the
//! model builds (their threads are not OS threads).
//!
//! Negatives: N28 (`Variant::PrefaultEnsureBeforeFaulted`: `ensure` returns
//! once every slice of its chunk was taken by a worker, not once each was
//! faulted; on the first scenario) -> "a slice was faulted after its chunk
//! was handed to registration"; N29 (`Variant::PrefaultHintForgotten`:
//! `ensure` does not look for its chunk among those hinted and queues it
//! again; on the lookahead scenario) -> "a slice was faulted twice".
//!
//! Why it holds: a chunk is split into slices once, when it is first
//! queued (by a hint, or by its `ensure` when not hinted), and each slice
//! is taken from the queue by one worker under the pool's lock; `ensure`
//! finds the hinted chunk by its index and range, and returns only when the
//! chunk's count of slices queued or running is 0, which a worker lowers
//! under the lock after it faulted the slice; the loop registers chunk i
//! only after `ensure(i)` returned and hints only chunks after i, so every
//! fault of chunk i's pages happened before its registration began.
//! `settle` (before pinning publishes) drops the slices not started, then
//! joins the workers, which waits for the running ones (a worker returns
//! only once the slice it took is finished).

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{models, sized, Bounds};
use kvoffload::internal::pin::{spawn_pinner, Prefault, PrefaultConfig, Prefaulter, ReserveFn, HUGE_PAGE_BYTES};
use kvoffload::internal::protocol::{Coordinator, Variant};
use kvoffload::internal::sync::{self, arc_dyn, Arc, Mutex, StdArc};
use kvoffload::{page_size, shared, CapturePolicy, PinState, PrefaultMode, SimRuntime};

/// One scenario's pool and region.
#[derive(Copy, Clone, Debug)]
struct Size {
    /// Pre-fault workers.
    workers: usize,
    /// Chunks of the region.
    chunks: usize,
    /// Pages of each chunk but the last, which has one: with `huge`, 2 MiB
    /// huge pages (a slice each), otherwise base pages.
    pages: usize,
    /// The lookahead, in chunks of `pages` pages.
    lookahead: usize,
    /// Huge pages, Populate mode and the huge-page fallback armed; otherwise
    /// base pages touched (Touch mode), which costs loom a third of the
    /// time per interleaving.
    huge: bool,
}

impl Size {
    fn unit(&self) -> usize {
        if self.huge {
            HUGE_PAGE_BYTES
        } else {
            page_size()
        }
    }

    /// Chunk `i`'s bytes.
    fn chunk(&self, i: usize) -> usize {
        let pages = if i + 1 == self.chunks && self.chunks > 1 { 1 } else { self.pages };
        pages * self.unit()
    }

    fn bytes(&self) -> usize {
        (0..self.chunks).map(|i| self.chunk(i)).sum()
    }
}

/// Two workers on the one chunk `ensure` waits for (two slices of a page).
const ONE_CHUNK: Size = Size { workers: sized(2, 3), chunks: 1, pages: sized(2, 6), lookahead: 0, huge: false };
/// Two workers, three chunks of a page, a lookahead of two chunks: at chunk 0
/// the loop hints chunks 1 and 2, which the workers fault while chunk 0 is
/// registered.
const LOOKAHEAD: Size =
    Size { workers: sized(2, 3), chunks: sized(3, 6), pages: sized(1, 2), lookahead: sized(2, 3), huge: false };
/// Huge pages and the fallback: one worker under loom (its window of two
/// slices fills within three chunks of one huge page), three under shuttle
/// (a window of six slices, eleven slices in all).
const FALLBACK: Size =
    Size { workers: sized(1, 3), chunks: sized(3, 6), pages: sized(1, 2), lookahead: sized(2, 3), huge: true };

/// The region: one 2 MiB-aligned allocation, made once per process, never
/// freed; every scenario pins a prefix of it (faults do not change its
/// contents, so runs may share it).
fn region() -> usize {
    #[allow(clippy::disallowed_types)]
    static BASE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BASE.get_or_init(|| {
        let bytes = [ONE_CHUNK, LOOKAHEAD, FALLBACK].iter().map(Size::bytes).max().unwrap();
        let layout = std::alloc::Layout::from_size_align(bytes, HUGE_PAGE_BYTES).unwrap();
        // SAFETY: a non-zero size; the memory is never freed.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!p.is_null(), "the model's region could not be allocated");
        p as usize
    })
}

/// What the workers faulted, and which chunks were handed to registration.
struct Log {
    faulted: Vec<(usize, usize)>,
    handed: Vec<bool>,
}

/// The pool as the registration loop takes it: every call passed through
/// (as the engine's `PrefaultThenReserve`), with `ensure`'s return noted.
struct Watched {
    pool: Arc<Prefaulter>,
    log: Arc<Mutex<Log>>,
}

impl Prefault for Watched {
    fn ensure(&self, i: usize, addr: usize, len: usize) -> Result<(), String> {
        let r = self.pool.ensure(i, addr, len);
        sync::lock(&self.log).handed[i] = true;
        r
    }
    fn hint(&self, i: usize, addr: usize, len: usize) {
        self.pool.hint(i, addr, len)
    }
    fn lookahead_bytes(&self) -> usize {
        self.pool.lookahead_bytes()
    }
    fn settle(&self) {
        self.pool.settle()
    }
}

fn scenario(size: Size, variant: Variant) {
    let base = region();
    let mut ranges = Vec::new();
    let mut at = base;
    for i in 0..size.chunks {
        ranges.push((at, size.chunk(i)));
        at += size.chunk(i);
    }
    let rt = shared(SimRuntime::new());
    // SAFETY: the chunks are pieces of the model's region, read-write
    // memory that is never freed.
    let coord = unsafe { Coordinator::new(rt.as_ref(), CapturePolicy::AfterPinning, &ranges, None) }.unwrap();

    let log = Arc::new(Mutex::new(Log { faulted: Vec::new(), handed: vec![false; size.chunks] }));
    let (seen, sim_rt, chunks) = (log.clone(), rt.clone(), ranges.clone());
    // Runs on the worker, right before it faults `[addr, addr + len)`; its
    // last scheduling point is the log's unlock, so the fault happens there.
    // `handed` is set under the log's lock before the chunk is registered:
    // while this holds it unset, no registration of the chunk has begun.
    let fault: ReserveFn = Box::new(move |addr, len| {
        let c = chunks.iter().position(|&(a, l)| a <= addr && addr + len <= a + l).expect("a slice of a chunk");
        let mut g = sync::lock(&seen);
        let twice = g.faulted.iter().find(|&&(a, l)| addr < a + l && a < addr + len);
        assert!(twice.is_none(), "a slice was faulted twice: {addr:#x}+{len:#x} over {twice:x?}");
        assert!(!g.handed[c], "a slice was faulted after its chunk was handed to registration (chunk {c})");
        let sim = sim_rt.as_sim().unwrap();
        assert!(!sim.is_registered(addr, len), "a slice was faulted after its chunk was registered (chunk {c})");
        g.faulted.push((addr, len));
        Ok(())
    });
    let mode = if size.huge { PrefaultMode::Populate } else { PrefaultMode::Touch };
    let cfg = PrefaultConfig { threads: size.workers, mode, huge_pages: size.huge };
    // SAFETY: the pool only gets the model's chunks (the coordinator's
    // ranges), read-write memory that is never freed; the fallback's span
    // is that region, whose owner (this model) accepts MADV_NOHUGEPAGE.
    let mut pool = unsafe { Prefaulter::reserving(cfg, Vec::new(), Some(fault), None) }
        .with_lookahead(size.lookahead * size.chunk(0));
    if size.huge {
        // SAFETY: as above.
        pool = unsafe { pool.with_huge_fallback(u32::MAX, base, size.bytes()) };
    }
    pool.set_variant(variant);
    let pool = Arc::new(pool);
    let watched =
        arc_dyn(Watched { pool: pool.clone(), log: log.clone() }, |a: StdArc<Watched>| -> StdArc<dyn Prefault> { a });

    let pinner = spawn_pinner(rt.clone(), coord.clone(), watched, None, None);
    let out = pinner.join().unwrap();
    assert_eq!(out.state, PinState::Pinned, "pinning did not end Pinned");

    let mut faulted = sync::lock(&log).faulted.clone();
    faulted.sort_unstable();
    let mut next = base;
    for &(a, l) in &faulted {
        assert_eq!(a, next, "a slice of the region was not faulted (at {next:#x}): {faulted:x?}");
        next = a + l;
    }
    assert_eq!(next, base + size.bytes(), "the region's end was not faulted: {faulted:x?}");
    let stats = pool.stats();
    assert_eq!(stats.slices, faulted.len() as u64, "the pool counted other slices than were faulted: {stats:?}");
    assert_eq!(stats.huge_fallback.is_some(), size.huge, "the huge-page fallback tripped or not: {stats:?}");
    assert_eq!(pool.workers_running(), 0, "a pre-fault worker outlived pinning");
    coord.pinning().unregister_all(rt.as_ref()).unwrap();
}

models! {
    f1_prefault_two_workers_fault_the_chunk_ensure_waits_for:
        check("f1_prefault_one_chunk", Bounds { property: "F1", threads: 5, preemptions: 1, ci: None },
            || scenario(ONE_CHUNK, Variant::Production));
    /// Bound 1: about 45 s (278,809 interleavings: two workers woken by every
    /// chunk queued), so ci/test runs its one schedule without preemptions;
    /// at bound 2 it did not end within 5 minutes.
    f1_prefault_lookahead_chunks_are_faulted_once_before_their_registration:
        check("f1_prefault_lookahead", Bounds { property: "F1", threads: 5, preemptions: 1, ci: None }.ci_at(0),
            || scenario(LOOKAHEAD, Variant::Production));
    /// Bound 2: about 22 s; ci/test runs it at 1.
    f1_prefault_huge_fallback_trips_without_a_fault_after_registration:
        check("f1_prefault_huge_fallback", Bounds { property: "F1", threads: 4, preemptions: 2, ci: None }.ci_at(1),
            || scenario(FALLBACK, Variant::Production));
    negative_n28_ensure_returns_before_its_slices_are_faulted:
        negative("n28_ensure_before_faulted", Bounds { property: "N28", threads: 5, preemptions: 1, ci: None },
            "a slice was faulted after its chunk was handed to registration",
            || scenario(ONE_CHUNK, Variant::PrefaultEnsureBeforeFaulted));
    negative_n29_hinted_chunk_queued_again:
        negative("n29_hint_forgotten", Bounds { property: "N29", threads: 5, preemptions: 1, ci: None },
            "a slice was faulted twice", || scenario(LOOKAHEAD, Variant::PrefaultHintForgotten));
}
