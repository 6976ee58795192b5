//! Parallel pre-faulting: a pool of worker threads makes a chunk's pages
//! resident before the driver registers it, and faults the next chunk
//! while the current one is being registered.
//!
//! Why: registering untouched pages makes the driver fault them one by one
//! on one thread (2.2 - 3.2 GB/s on the H200); registering pages that are
//! already resident runs at 22.8 - 24.6 GB/s, and faulting in parallel with
//! huge pages reaches 26.7 - 28.1 GB/s end to end (docs/driver-rules.md,
//! rows "One registration of untouched pages", "Registration of resident
//! pages" and "Pre-fault threads and huge pages"). With
//! [`Prefault::hint`] the faults of chunk i+1 overlap the registration of
//! chunk i, so the pipeline approaches max(fault, register) instead of the
//! sum.
//!
//! How:
//! - A chunk is split into slices (at most 16 MiB, at least one page, or
//!   one 2 MiB huge page when huge pages are on; boundaries at multiples of
//!   that alignment so no two workers fault the same huge page). Workers
//!   take slices from one queue, so a slow worker does not hold a chunk up.
//! - A slice is populated with `madvise(MADV_POPULATE_WRITE)`. Where the
//!   kernel does not know it (EINVAL on a probe page when the pre-faulter is
//!   made: older than 5.14), pages are touched instead: one atomic compare-exchange of a byte with
//!   itself per page (per 2 MiB with huge pages, then every page `mincore`
//!   still reports absent). Neither changes memory contents, so a region
//!   that DMA or other ranks already write may be pre-faulted safely.
//! - With a plan ([`Prefaulter::with_plan`], the chunks of a multi-file
//!   shared region, each inside one data file): every chunk is queued at the
//!   first `ensure`/`hint` (full lookahead), and an idle worker takes the
//!   first queued slice whose file no other worker is faulting (the first
//!   slice when every queued file is busy). Faulting one tmpfs file is
//!   bound by that file's page cache (one file: 4-5 GB/s with 16 threads on
//!   the H200 machine; 16 files side by side: 14 GB/s), so the workers
//!   spread over files, in the order the chunks are registered.
//! - Workers are spawned on first use and joined by [`Prefault::settle`]
//!   (the engine calls it when pinning ends), so no pre-fault work outlives
//!   pinning and no thread is created or destroyed (an `mmap_lock` writer)
//!   while registrations run.
//! - A panic while faulting a slice fails that slice's chunk
//!   ([`PrefaultError::Panicked`]). A worker that panics anywhere else (the
//!   pool's bookkeeping, under its lock; the reservation hook; placing
//!   itself) stops the pool for good: every `ensure` waiting for a chunk
//!   not done, and every later one, fails with
//!   [`PrefaultError::PoolBroken`], naming the panic; nothing waits for
//!   ever on what that worker would have done or counted.
//!
//! This file is the pool (its threads, the plan, the stats, the
//! [`Prefaulter`]); how one slice is faulted, with the safety argument of
//! every page access, is in `prefault_slice.rs`.
//!
//! Threads and locks come from [`crate::sync`], so loom and shuttle see
//! the pool's workers, lock and condition variables:
//! `model/f1_prefault_pool.rs` drives it under the pinning thread (most
//! other models pin with [`super::NoPrefault`]).

use std::collections::VecDeque;

use crate::region::page_size;
use crate::rules::Rules;
use crate::sync::{self, thread, Arc, Condvar, Mutex, MutexGuard};

use super::engine::Prefault;
use super::options::PrefaultMode;
pub use super::prefault_rates::SLICE_GBPS_EDGES;
use super::prefault_rates::{bucket, HugeFallback};
use super::prefault_slice::{
    advise_no_huge, align, panic_text, probe_populate, round_down, run_slice_caught, Populate, Slice,
};
pub use super::prefault_slice::{
    thp_setting, thp_stall_events, PrefaultConfig, PrefaultError, ReserveFn, HUGE_PAGE_BYTES,
};

/// Largest slice one worker takes at a time.
const MAX_SLICE_BYTES: usize = 16 << 20;

/// Stack of a worker thread (they only loop over madvise and byte accesses).
const WORKER_STACK_BYTES: usize = 256 << 10;

/// What a pre-faulter did so far.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct PrefaultStats {
    /// In [`PrefaultMode::Populate`]: whether the kernel has
    /// `MADV_POPULATE_WRITE` (`Some(true)`: it is used) or not (`Some(false)`:
    /// pages are touched instead), probed when the pre-faulter was made.
    /// `None` in the other modes, or when the probe could not run.
    pub populate_write: Option<bool>,
    /// Bytes made resident.
    pub bytes: u64,
    /// Slices processed.
    pub slices: u64,
    /// Slices by how fast one worker faulted them in, GB/s (1e9 bytes/s):
    /// below 0.125, 0.25, 0.5, 1, 2, 4, 8, and 8 or more
    /// ([`SLICE_GBPS_EDGES`]). Where a chunk stalls in huge-page allocation
    /// and compaction, its slices land in the first buckets.
    pub slice_gbps: [u64; 8],
    /// Where huge-page faulting was given up for 4 KiB pages
    /// ([`Prefaulter::with_huge_fallback`]): the address from which the
    /// rest of the region was advised `MADV_NOHUGEPAGE`, and the per-worker
    /// GB/s that tripped it. `None`: never.
    pub huge_fallback: Option<(usize, f64)>,
}

#[derive(Debug)]
struct Job {
    id: u64,
    chunk: usize,
    addr: usize,
    len: usize,
    /// Slices queued or running.
    pending: usize,
    /// Every job stays when done until the last `ensure` waiting for it
    /// has read it (one queued from the plan or by a hint may finish long
    /// before its `ensure`, with a lookahead of several chunks), or
    /// `settle` clears it (one no `ensure` waits for).
    error: Option<PrefaultError>,
    /// `ensure` calls waiting for this job: each reads its outcome, and
    /// the last one removes it (two threads that ensure one chunk share its
    /// job, and both get its outcome).
    waiters: usize,
}

/// One chunk of a plan: index, address, length, data file.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PlannedChunk {
    /// The chunk's index (what `ensure` is called with).
    pub chunk: usize,
    /// First byte.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// The data file it lies in: slices of one file are faulted by one
    /// worker at a time when other files wait.
    pub lane: usize,
}

struct Pool {
    queue: VecDeque<Slice>,
    jobs: Vec<Job>,
    next_id: u64,
    stop: bool,
    populate: Populate,
    bytes: u64,
    slices: u64,
    /// Chunks queued all at once on first use (taken when queued).
    plan: Option<Vec<PlannedChunk>>,
    /// Workers running a slice of each lane.
    running: Vec<u32>,
    /// Bytes of one huge page when `cfg.huge_pages`: [`HUGE_PAGE_BYTES`],
    /// or the hugetlbfs page of the region (1 GiB pages are faulted one
    /// worker a page).
    huge_bytes: usize,
    /// See [`PrefaultStats::slice_gbps`].
    slice_gbps: [u64; 8],
    /// Workers of the current start that have placed themselves (CPUs,
    /// niceness); `start_workers` waits for all of them.
    started: usize,
    /// Armed by [`Prefaulter::with_huge_fallback`].
    fallback: Option<HugeFallback>,
    /// A worker panicked outside a slice (the panic's message): the pool
    /// stopped for good ([`PrefaultError::PoolBroken`], `Shared::broke`).
    broken: Option<String>,
    /// The rules the pool runs (`crate::rules`: zero-sized, the shipped
    /// ones, outside model builds; in them, a negative model's, N28 or N29,
    /// set by [`Prefaulter::set_variant`]).
    rules: crate::rules::Active,
    /// The unit tests' seam: `finish` panics (a worker panicking in the
    /// pool's bookkeeping, under its lock).
    #[cfg(test)]
    panic_in_finish: bool,
}

impl Pool {
    fn new(populate: Populate, plan: Vec<PlannedChunk>, huge_bytes: usize) -> Pool {
        Pool {
            queue: VecDeque::new(),
            jobs: Vec::new(),
            next_id: 0,
            stop: false,
            populate,
            bytes: 0,
            slices: 0,
            plan: (!plan.is_empty()).then_some(plan),
            running: Vec::new(),
            huge_bytes,
            slice_gbps: [0; 8],
            started: 0,
            fallback: None,
            broken: None,
            rules: crate::rules::Active::default(),
            #[cfg(test)]
            panic_in_finish: false,
        }
    }

    /// What an `ensure` of `chunk` fails with once a worker panicked
    /// outside a slice; `None` while the pool runs.
    fn broken_for(&self, chunk: usize) -> Option<PrefaultError> {
        self.broken.as_ref().map(|msg| PrefaultError::PoolBroken { chunk, msg: msg.clone() })
    }

    /// `jobs` is ordered by id (ids only grow; removal keeps the order), so
    /// a job is found by binary search: this runs for every slice, under
    /// the pool's lock, with up to every chunk of the region queued.
    fn job_index(&self, id: u64) -> Option<usize> {
        self.jobs.binary_search_by_key(&id, |j| j.id).ok()
    }

    fn job_mut(&mut self, id: u64) -> Option<&mut Job> {
        let k = self.job_index(id)?;
        self.jobs.get_mut(k)
    }

    fn find(&self, chunk: usize, addr: usize, len: usize) -> Option<u64> {
        self.jobs.iter().find(|j| j.chunk == chunk && j.addr == addr && j.len == len).map(|j| j.id)
    }

    fn submit(&mut self, cfg: &PrefaultConfig, chunk: usize, addr: usize, len: usize, lane: Option<usize>) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        let slices = split(addr, len, cfg.threads, align(cfg, self.huge_bytes));
        let pending = slices.len();
        self.queue.extend(slices.into_iter().map(|(addr, len)| Slice { job: id, chunk, addr, len, lane }));
        self.jobs.push(Job { id, chunk, addr, len, pending, error: None, waiters: 0 });
        id
    }

    /// Queues the plan's chunks, in order, if not done yet. Returns whether
    /// it queued anything.
    fn submit_plan(&mut self, cfg: &PrefaultConfig) -> bool {
        let Some(plan) = self.plan.take() else {
            return false;
        };
        for c in plan {
            if c.len > 0 && c.addr % page_size() == 0 {
                self.submit(cfg, c.chunk, c.addr, c.len, Some(c.lane));
            }
        }
        true
    }

    /// The next slice for an idle worker: the first whose lane no worker
    /// runs (the front when every lane is busy, or without lanes).
    fn take(&mut self) -> Option<Slice> {
        let free = |s: &Slice| s.lane.is_none_or(|l| self.running.get(l).is_none_or(|&n| n == 0));
        let pos = self.queue.iter().position(free).unwrap_or(0);
        let s = self.queue.remove(pos)?;
        if let Some(l) = s.lane {
            if self.running.len() <= l {
                self.running.resize(l + 1, 0);
            }
            self.running[l] += 1;
        }
        Some(s)
    }

    /// Records how fast a worker faulted a slice in; returns the range to
    /// advise `MADV_NOHUGEPAGE` and the per-worker GB/s that tripped the
    /// huge-page fallback when this slice tripped it (the rest of the span
    /// from the first slice not yet started).
    fn timed(&mut self, s: &Slice, secs: f64, huge: bool, workers: usize) -> Option<(usize, usize, f64)> {
        let gbps = if secs > 0.0 { s.len as f64 / secs / 1e9 } else { f64::INFINITY };
        self.slice_gbps[bucket(gbps)] += 1;
        // From the first slice nobody started: the queue's front, as the
        // chunks of an anonymous region (the only kind the fallback is armed
        // for) are queued in address order (hinted and ensured in order);
        // without one, after this slice. O(1): this runs for every slice,
        // under the pool's lock, with up to every slice of the region queued.
        let from = self.queue.front().map_or(s.addr + s.len, |q| q.addr);
        self.fallback.as_mut()?.judge(s.len, secs, huge, workers, from)
    }

    /// Records the outcome of one slice.
    fn finish(&mut self, s: &Slice, res: Result<(), PrefaultError>, learned: Option<Populate>) {
        if let Some(l) = s.lane {
            if let Some(n) = self.running.get_mut(l) {
                *n = n.saturating_sub(1);
            }
        }
        if let Some(p) = learned {
            self.populate = p;
        }
        #[cfg(test)]
        if self.panic_in_finish {
            panic!("injected: the pool's bookkeeping panicked (test)");
        }
        self.slices += 1;
        if res.is_ok() {
            self.bytes += s.len as u64;
        }
        if let Some(j) = self.job_mut(s.job) {
            j.pending -= 1;
            if let Err(e) = res {
                j.error.get_or_insert(e);
            }
        }
    }
}

struct Shared {
    cfg: PrefaultConfig,
    /// Run on every slice before it is faulted.
    reserve: Option<ReserveFn>,
    pool: Mutex<Pool>,
    /// Workers wait here for slices (or stop).
    work: Condvar,
    /// `ensure` and `settle` wait here for slices to finish.
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Pool> {
        sync::lock(&self.pool)
    }

    /// A worker panicked outside a slice, with `msg`: the pool stops for
    /// good. The bookkeeping it was in may be half done (a chunk's count
    /// of unfinished slices may never reach 0), so nothing waits on it any
    /// more: the slices not started are dropped (the other workers return
    /// at their next look at the queue), and every waiter is woken: an
    /// `ensure` whose chunk is not done returns
    /// [`PrefaultError::PoolBroken`], `start_workers` stops waiting for
    /// workers to place themselves. Its lock may be poisoned (a panic under
    /// it): [`sync::lock`] takes it all the same.
    fn broke(&self, msg: String) {
        let mut g = self.lock();
        g.broken.get_or_insert(msg);
        g.queue.clear();
        drop(g);
        self.work.notify_all();
        self.done.notify_all();
    }
}

/// The pre-fault pool: a [`Prefault`] implementation with `threads` workers.
/// See the module documentation.
pub struct Prefaulter {
    shared: Arc<Shared>,
    workers: Mutex<Vec<thread::JoinHandle<()>>>,
    /// CPUs each worker restricts itself to as it starts (empty: anywhere).
    cpus: Vec<usize>,
    /// See [`Prefaulter::with_lookahead`].
    lookahead: usize,
    /// See [`Prefaulter::with_nice`].
    nice: i32,
}

/// Splits `[addr, addr+len)` into slices of about `len / threads` bytes (at
/// most [`MAX_SLICE_BYTES`], at least `align`), cut at multiples of `align`.
fn split(addr: usize, len: usize, threads: usize, align: usize) -> Vec<(usize, usize)> {
    let target = len.div_ceil(threads.max(1)).clamp(align, MAX_SLICE_BYTES.max(align));
    let end = addr + len;
    let mut out = Vec::with_capacity(len / target + 2);
    let mut p = addr;
    while p < end {
        let mut q = round_down(p.saturating_add(target), align);
        if q <= p {
            q = p + target;
        }
        let q = q.min(end);
        out.push((p, q - p));
        p = q;
    }
    out
}

/// Restricts worker `k` to `cpus` (not under loom: its threads are not OS
/// threads of their own).
fn pin_worker(k: usize, cpus: &[usize]) {
    if sync::MODEL || cpus.is_empty() {
        return;
    }
    if let Err(e) = super::numa::bind_current_thread(cpus) {
        tracing::warn!(worker = k, error = %e, "NUMA: sched_setaffinity refused; this pre-fault worker runs on any CPU");
    }
}

/// Raises this thread's niceness to `nice` (never lowers it: that needs
/// privileges); not under loom, whose threads are not OS threads.
fn lower_priority(k: usize, nice: i32) {
    if sync::MODEL || nice <= 0 {
        return;
    }
    let tid = rustix::thread::gettid();
    match rustix::process::getpriority_process(Some(tid)) {
        Ok(now) if now >= nice => {}
        _ => {
            if let Err(e) = rustix::process::setpriority_process(Some(tid), nice) {
                tracing::warn!(worker = k, nice, error = %e, "setpriority refused; this pre-fault worker keeps its priority");
            }
        }
    }
}

/// A worker thread, `k` of its start: places itself, counts itself placed
/// (`start_workers` waits for that), then runs [`worker`]. A panic
/// anywhere in it (one inside a slice is that slice's error already:
/// `run_slice_caught`), before it counted itself too, stops the pool
/// ([`Shared::broke`]) before the thread ends, so that nothing waits for
/// ever on what it would have done or counted; the panic then goes on,
/// for `settle`'s join to report (and, in the model builds, for loom and
/// shuttle to see). The thread has no other way to end before counting
/// itself.
fn run_worker(shared: &Shared, k: usize, cpus: &[usize], nice: i32) {
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pin_worker(k, cpus);
        lower_priority(k, nice);
        shared.lock().started += 1;
        shared.done.notify_all();
        worker(shared)
    }));
    if let Err(p) = ran {
        shared.broke(panic_text(&*p));
        std::panic::resume_unwind(p);
    }
}

fn worker(shared: &Shared) {
    let mut g = shared.lock();
    loop {
        if g.broken.is_some() {
            return;
        }
        if let Some(s) = g.take() {
            let skip = g.job_mut(s.job).is_none_or(|j| j.error.is_some());
            let (populate, huge) = (g.populate, g.huge_bytes);
            drop(g);
            let started = std::time::Instant::now();
            let (res, learned) = if skip {
                (Ok(()), None)
            } else {
                // SAFETY: slices come from `ensure`/`hint`, whose ranges the
                // Prefaulter's creator vouched for (`Prefaulter::new`), and
                // `settle` (run before pinning publishes its final state and
                // before the pre-faulter is dropped) joins every worker, so
                // it waits for every running slice; slices start page
                // aligned (checked, then cut at multiples of the page size).
                unsafe { run_slice_caught(&shared.cfg, shared.reserve.as_ref(), huge, populate, &s) }
            };
            let secs = started.elapsed().as_secs_f64();
            g = shared.lock();
            let give_up = if !skip && res.is_ok() {
                g.timed(&s, secs, shared.cfg.huge_pages && huge == HUGE_PAGE_BYTES, shared.cfg.threads)
            } else {
                None
            };
            g.finish(&s, res, learned);
            shared.done.notify_all();
            if let Some((addr, len, rate)) = give_up {
                drop(g);
                // SAFETY: `[addr, addr+len)` lies in the span the creator of
                // the pre-faulter vouched for (`Prefaulter::with_huge_fallback`):
                // a live mapping of this process until `settle` returned,
                // and this worker runs before `settle` returns. The advice
                // changes no memory contents and no page already present; it
                // only makes later faults of the range allocate base pages.
                match unsafe { advise_no_huge(addr, len) } {
                    Ok(()) => tracing::warn!(
                        from = format_args!("{addr:#x}"),
                        bytes = len,
                        worker_gbps = rate,
                        "pre-faulting huge pages stalled (reclaim or compaction near the memory limit); the rest of the region uses 4 KiB pages"
                    ),
                    Err(e) => tracing::warn!(errno = e, "huge-page fallback: madvise(MADV_NOHUGEPAGE) refused; going on with huge pages"),
                }
                g = shared.lock();
            }
            continue;
        }
        if g.stop {
            return;
        }
        g = sync::wait(&shared.work, g);
    }
}

impl Prefaulter {
    /// A pre-faulter with `cfg.threads` workers (spawned on first use).
    ///
    /// # Safety
    /// Every range later passed to [`Prefault::ensure`] or [`Prefault::hint`]
    /// must be a live, readable and writable mapping of this process from
    /// that call until pre-faulting it has finished: `ensure` returned for
    /// it, or [`Prefault::settle`] returned (which the pinning engine calls
    /// before publishing its final state; dropping the pre-faulter settles
    /// too). With [`PrefaultMode::Touch`], or where the kernel lacks
    /// `MADV_POPULATE_WRITE`, the pages are accessed directly.
    pub unsafe fn new(cfg: PrefaultConfig) -> Prefaulter {
        // SAFETY: forwarded contract (no plan).
        unsafe { Self::with_plan(cfg, Vec::new()) }
    }

    /// A pre-faulter that queues every chunk of `plan` at the first
    /// [`Prefault::ensure`] or [`Prefault::hint`] and spreads its workers
    /// over the chunks' lanes (data files); see the module documentation.
    /// Chunks `ensure` is asked for that are not in the plan are faulted as
    /// with [`Prefaulter::new`].
    ///
    /// # Safety
    /// As for [`Prefaulter::new`], for every chunk of `plan` too: from the
    /// first `ensure`/`hint` until `settle` returned.
    pub unsafe fn with_plan(cfg: PrefaultConfig, plan: Vec<PlannedChunk>) -> Prefaulter {
        // SAFETY: forwarded contract (no reservation hook).
        unsafe { Self::reserving(cfg, plan, None, None) }
    }

    /// [`Prefaulter::with_plan`] that calls `reserve(addr, len)` for every
    /// slice, on the worker that faults it, before any byte of it is
    /// touched; a slice whose reservation fails is not faulted and its
    /// chunk fails with [`PrefaultError::Reserve`]. What a shared region
    /// with deferred reservation gets ([`crate::region::ShmOptions::defer_reserve`]:
    /// `Region::reserve_addr`), so that no fault finds its file system full.
    /// `huge_page_bytes`: with `cfg.huge_pages`, the huge page slices are
    /// cut on and touching steps by (default [`HUGE_PAGE_BYTES`]; a region
    /// on hugetlbfs gives its page, 2 MiB or 1 GiB).
    ///
    /// # Safety
    /// As for [`Prefaulter::with_plan`].
    pub unsafe fn reserving(
        cfg: PrefaultConfig,
        plan: Vec<PlannedChunk>,
        reserve: Option<ReserveFn>,
        huge_page_bytes: Option<usize>,
    ) -> Prefaulter {
        let cfg = PrefaultConfig { threads: cfg.threads.max(1), ..cfg };
        let populate = if cfg.mode == PrefaultMode::Populate { probe_populate() } else { Populate::Unknown };
        Prefaulter {
            shared: Arc::new(Shared {
                cfg,
                reserve,
                pool: Mutex::new(Pool::new(populate, plan, huge_page_bytes.unwrap_or(HUGE_PAGE_BYTES))),
                work: Condvar::new(),
                done: Condvar::new(),
            }),
            workers: Mutex::new(Vec::new()),
            cpus: Vec::new(),
            lookahead: 0,
            nice: 0,
        }
    }

    /// Selects a known-bad variant of the pool (negative models N28 and
    /// N29 only).
    #[cfg(any(loom, shuttle))]
    #[doc(hidden)]
    pub fn set_variant(&self, v: crate::rules::Active) {
        self.shared.lock().rules = v;
    }

    /// Workers raise their niceness to `nice` as they start (0, or a value
    /// at or below the process's own: unchanged): they then take the cores
    /// the engine leaves idle and yield the others, so background pinning
    /// slows the engine's CPU work less. A refusal is logged and the worker
    /// keeps its priority.
    pub fn with_nice(mut self, nice: i32) -> Prefaulter {
        self.nice = nice;
        self
    }

    /// The registration loop may hint chunks until `bytes` are queued ahead
    /// of the chunk it registers ([`Prefault::lookahead_bytes`]; default 0:
    /// the next chunk only).
    pub fn with_lookahead(mut self, bytes: usize) -> Prefaulter {
        self.lookahead = bytes;
        self
    }

    /// Arms the huge-page fallback: when the last few huge-page slices (two
    /// per worker) were faulted in at under `min_mbps` MB/s per worker on
    /// average, and the kernel stalled in direct reclaim or compaction or
    /// fell back from huge pages since the fallback was armed
    /// ([`thp_stall_events`]; the rate alone where /proc/vmstat cannot be
    /// read), the rest of `[start, start+len)` from the first slice not yet
    /// started is advised `MADV_NOHUGEPAGE` once, so that its pages
    /// come as 4 KiB pages instead of waiting for compaction (logged, and
    /// reported in [`PrefaultStats::huge_fallback`]). Only where the
    /// pre-faulter faults transparent huge pages (`cfg.huge_pages` with
    /// 2 MiB pages); 0 or an empty range leaves it off.
    ///
    /// # Safety
    /// `[start, start+len)` is a live mapping of this process from this call
    /// until [`Prefault::settle`] returned (or the pre-faulter is dropped),
    /// and advising it `MADV_NOHUGEPAGE` is acceptable to its owner (the
    /// pinning of an anonymous region, which advised it huge itself).
    pub unsafe fn with_huge_fallback(self, min_mbps: u32, start: usize, len: usize) -> Prefaulter {
        if min_mbps > 0 && len > 0 {
            // Not read in the model builds (the rate alone decides there, as
            // where /proc/vmstat cannot be read): the kernel's counters move
            // outside the model, and a schedule run twice must take the
            // same branches (model/f1_prefault_pool.rs).
            let stalls = if sync::MODEL { None } else { thp_stall_events() };
            self.shared.lock().fallback = Some(HugeFallback::new(min_mbps, (start, start + len), stalls));
        }
        self
    }

    /// Workers restrict themselves to `cpus` (`sched_setaffinity`, the NUMA
    /// node's CPUs of [`super::numa::Placement`]) as they start; empty:
    /// anywhere. A refused affinity is logged and the worker runs anywhere.
    pub fn on_cpus(mut self, cpus: Vec<usize>) -> Prefaulter {
        self.cpus = cpus;
        self
    }

    /// The CPUs workers restrict themselves to (empty: anywhere).
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// The settings.
    pub fn config(&self) -> PrefaultConfig {
        self.shared.cfg
    }

    /// What was done so far.
    pub fn stats(&self) -> PrefaultStats {
        let g = self.shared.lock();
        PrefaultStats {
            populate_write: match g.populate {
                Populate::Unknown => None,
                Populate::Works => Some(true),
                Populate::Unsupported => Some(false),
            },
            bytes: g.bytes,
            slices: g.slices,
            slice_gbps: g.slice_gbps,
            huge_fallback: g.fallback.as_ref().and_then(|f| f.tripped()),
        }
    }

    /// Worker threads started and not yet joined (by [`Prefault::settle`]).
    pub fn workers_running(&self) -> usize {
        sync::lock(&self.workers).len()
    }

    /// Starts the workers if none run; returns how many run. A failed spawn
    /// is logged and the pool continues with fewer (0: the caller works).
    /// The panic's message when a worker panicked outside a slice (then or
    /// before): the pool stopped for good.
    fn start_workers(&self) -> Result<usize, String> {
        let mut w = sync::lock(&self.workers);
        if w.is_empty() {
            {
                let mut g = self.shared.lock();
                if let Some(msg) = &g.broken {
                    return Err(msg.clone());
                }
                g.stop = false;
                g.started = 0;
            }
            for k in 0..self.shared.cfg.threads {
                let sh = self.shared.clone();
                let b = thread::Builder::new().name(format!("kvo-prefault-{k}")).stack_size(WORKER_STACK_BYTES);
                let cpus = self.cpus.clone();
                let nice = self.nice;
                match b.spawn(move || run_worker(&sh, k, &cpus, nice)) {
                    Ok(h) => w.push(h),
                    Err(e) => {
                        tracing::warn!(error = %e, started = k, wanted = self.shared.cfg.threads, "could not start a pre-fault worker; continuing with fewer");
                        break;
                    }
                }
            }
            // Every worker has placed itself (CPUs, niceness) before any
            // slice is queued for it: no slice runs with the spawner's
            // placement. Bounded: a worker that does not count itself
            // panicked, which stops the pool (`run_worker`).
            let n = w.len();
            let mut g = self.shared.lock();
            while g.started < n && g.broken.is_none() {
                g = sync::wait(&self.shared.done, g);
            }
            if let Some(msg) = &g.broken {
                return Err(msg.clone());
            }
        }
        Ok(w.len())
    }

    fn check(&self, chunk: usize, addr: usize) -> Result<(), PrefaultError> {
        let page = page_size();
        if addr % page != 0 {
            return Err(PrefaultError::Misaligned { chunk, addr, page });
        }
        Ok(())
    }

    /// Runs a chunk on the calling thread (no worker could be started).
    fn run_inline(&self, chunk: usize, addr: usize, len: usize) -> Result<(), PrefaultError> {
        let cfg = self.shared.cfg;
        let huge = self.shared.lock().huge_bytes;
        for (addr, len) in split(addr, len, 1, align(&cfg, huge)) {
            let s = Slice { job: 0, chunk, addr, len, lane: None };
            let populate = self.shared.lock().populate;
            // SAFETY: the range passed to `ensure`, vouched for by the
            // creator (`Prefaulter::new`); the start was checked page aligned
            // and slices are cut at multiples of the page size.
            let (res, learned) = unsafe { run_slice_caught(&cfg, self.shared.reserve.as_ref(), huge, populate, &s) };
            self.shared.lock().finish(&s, res.clone(), learned);
            res?;
        }
        Ok(())
    }

    /// Like [`Prefault::ensure`], with the typed error. Two threads that
    /// ensure one chunk share its job and each gets its outcome; once a
    /// worker panicked outside a slice, every `ensure` whose chunk is not
    /// done fails with [`PrefaultError::PoolBroken`] (at once, or as the
    /// panic happens while it waits).
    pub fn ensure_typed(&self, chunk: usize, addr: usize, len: usize) -> Result<(), PrefaultError> {
        if self.shared.cfg.mode == PrefaultMode::Off || len == 0 {
            return Ok(());
        }
        self.check(chunk, addr)?;
        match self.start_workers() {
            Ok(0) => return self.run_inline(chunk, addr, len),
            Ok(_) => {}
            Err(msg) => return Err(PrefaultError::PoolBroken { chunk, msg }),
        }
        let sh = &self.shared;
        let mut g = sh.lock();
        if let Some(e) = g.broken_for(chunk) {
            return Err(e);
        }
        if g.submit_plan(&sh.cfg) {
            sh.work.notify_all();
        }
        // The chunk's job when it was hinted before.
        let rules = g.rules;
        let hinted = rules.ensure_takes_hint(|| g.find(chunk, addr, len));
        let id = match hinted {
            Some(id) => id,
            None => {
                let id = g.submit(&sh.cfg, chunk, addr, len, None);
                sh.work.notify_all();
                id
            }
        };
        // Until every slice of the chunk was faulted (not only taken by a
        // worker: some may still be being faulted then).
        let unfinished = |p: &Pool| {
            rules.ensure_waits_for_faulting(
                || p.job_index(id).is_some_and(|k| p.jobs[k].pending > 0),
                || p.queue.iter().any(|s| s.job == id),
            )
        };
        if let Some(j) = g.job_mut(id) {
            j.waiters += 1;
        }
        // Until the chunk is done, or a worker's panic stopped the pool (a
        // count it left unfinished would never reach 0).
        while unfinished(&g) && g.broken.is_none() {
            g = sync::wait(&sh.done, g);
        }
        // This call's outcome: its job's, read by every `ensure` waiting
        // for it; the last of them removes the job (no other is swept here:
        // a sweep of finished jobs could take another thread's `ensure` job
        // before that thread, woken but not yet running, read its error);
        // hinted and planned chunks stay until their `ensure` (or
        // `settle`). The job is there: only its waiters remove it, and
        // `settle` keeps the jobs waited for.
        let Some(k) = g.job_index(id) else {
            return Err(PrefaultError::Stopped { chunk });
        };
        let j = &mut g.jobs[k];
        j.waiters -= 1;
        let (done, res) = (j.pending == 0, j.error.clone().map_or(Ok(()), Err));
        if j.waiters == 0 {
            g.jobs.remove(k);
        }
        match g.broken_for(chunk) {
            Some(e) if !done => Err(e),
            _ => res,
        }
    }
}

impl Prefault for Prefaulter {
    fn ensure(&self, i: usize, addr: usize, len: usize) -> Result<(), String> {
        self.ensure_typed(i, addr, len).map_err(|e| e.to_string())
    }

    fn hint(&self, i: usize, addr: usize, len: usize) {
        if self.shared.cfg.mode == PrefaultMode::Off || len == 0 || self.check(i, addr).is_err() {
            // `ensure` reports a misaligned chunk.
            return;
        }
        if !matches!(self.start_workers(), Ok(n) if n > 0) {
            return;
        }
        let sh = &self.shared;
        let mut g = sh.lock();
        if g.broken.is_some() {
            // `ensure` reports it.
            return;
        }
        let planned = g.submit_plan(&sh.cfg);
        if g.find(i, addr, len).is_none() {
            g.submit(&sh.cfg, i, addr, len, None);
            sh.work.notify_all();
        } else if planned {
            sh.work.notify_all();
        }
    }

    fn lookahead_bytes(&self) -> usize {
        self.lookahead
    }

    fn settle(&self) {
        let sh = &self.shared;
        let mut g = sh.lock();
        let dropped: Vec<Slice> = g.queue.drain(..).collect();
        for s in &dropped {
            if let Some(j) = g.job_mut(s.job) {
                j.pending -= 1;
                j.error.get_or_insert(PrefaultError::Stopped { chunk: s.chunk });
            }
        }
        if !dropped.is_empty() {
            // An `ensure` beside this call (the engine makes none) whose
            // chunk is now done, with `Stopped`.
            sh.done.notify_all();
        }
        // The slices running are waited for by the joins below: a worker
        // returns only from the top of its loop, once it has finished the
        // slice it took. (No wait on the jobs' counts here, as there was:
        // the joins made it redundant, and a worker's panic can leave a
        // count that never reaches 0.) A job an `ensure` waits for stays
        // until that `ensure` has read it.
        g.jobs.retain(|j| j.waiters > 0);
        g.plan = None;
        g.stop = true;
        sh.work.notify_all();
        drop(g);
        let handles: Vec<_> = sync::lock(&self.workers).drain(..).collect();
        for h in handles {
            if h.join().is_err() {
                tracing::error!("a pre-fault worker panicked outside a slice");
            }
        }
    }
}

impl Drop for Prefaulter {
    fn drop(&mut self) {
        self.settle();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::io;

    use super::*;

    /// The huge-page fallback advises from the first slice nobody started:
    /// the queue's front, or, with nothing queued, right after the slice
    /// that tripped it; never a page faulted before (a slice already done,
    /// or the one that tripped it). `timed` fed by hand (no memory is
    /// touched), the fallback armed at a rate no slice reaches and without
    /// stall counters (the rate alone decides, as where /proc/vmstat cannot
    /// be read), so that it trips as soon as its window is full.
    #[test]
    fn the_fallback_advises_from_the_first_slice_not_started() {
        let h = HUGE_PAGE_BYTES;
        let base = 64 * h;
        let slice = |i: usize| Slice { job: 1, chunk: 0, addr: base + i * h, len: h, lane: None };
        for queued in [None, Some(6)] {
            let mut pool = Pool::new(Populate::Unknown, Vec::new(), h);
            pool.fallback = Some(HugeFallback::new(u32::MAX, (base, base + 8 * h), None));
            if let Some(q) = queued {
                pool.queue.push_back(slice(q));
            }
            let (tripper, advice) = (0..8)
                .find_map(|i| pool.timed(&slice(i), 1.0, true, 1).map(|a| (i, a)))
                .expect("the fallback never tripped");
            let from = queued.map_or(base + (tripper + 1) * h, |q| base + q * h);
            assert_eq!(
                (advice.0, advice.1),
                (from, base + 8 * h - from),
                "queued {queued:?}, tripped at slice {tripper}"
            );
            assert_eq!(pool.fallback.as_ref().unwrap().tripped().map(|t| t.0), Some(from));
        }
    }

    /// `f` on a thread of its own; its result, or `None` when it has not
    /// returned within `secs` (the thread is then left behind: a hang is
    /// reported as a failure within the bound, not by the harness's limit).
    fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(secs)).ok()
    }

    /// An anonymous region of `pages` untouched pages.
    fn pages(pages: usize) -> crate::region::Region {
        let l = crate::region::Layout::new(1, page_size(), pages).unwrap();
        crate::region::Region::anonymous(l, &crate::region::AnonOptions::new()).unwrap()
    }

    /// A worker that panics in the pool's bookkeeping, under the pool's
    /// lock (`finish`, through the tests' seam), stops the pool: the
    /// `ensure` waiting for the chunk returns an error naming the panic
    /// instead of waiting for ever, though the lock is poisoned and the
    /// chunk's count of unfinished slices never reaches 0; a later `ensure`
    /// fails at once; settling returns.
    #[test]
    fn a_panic_in_the_bookkeeping_under_the_lock_fails_ensure_instead_of_hanging() {
        let r = pages(2);
        let (addr, len) = (r.as_ptr() as usize, r.len());
        // SAFETY: the region outlives the pre-faulter: it is leaked below
        // when a call did not return (a worker might still reach it).
        let pf = Arc::new(unsafe {
            Prefaulter::new(PrefaultConfig { threads: 2, mode: PrefaultMode::Touch, huge_pages: false })
        });
        pf.shared.lock().panic_in_finish = true;
        let got = {
            let pf = pf.clone();
            within(10, move || pf.ensure_typed(5, addr, len))
        };
        let Some(got) = got else {
            std::mem::forget(r);
            panic!("ensure still waits 10 s after a worker panicked under the pool's lock");
        };
        match got {
            Err(PrefaultError::PoolBroken { chunk: 5, msg }) => assert!(msg.contains("bookkeeping panicked"), "{msg}"),
            other => panic!("expected PoolBroken for chunk 5, got {other:?}"),
        }
        assert!(pf.shared.pool.is_poisoned(), "the panic was not under the pool's lock: the case did not happen");
        let later = {
            let pf = pf.clone();
            within(10, move || pf.ensure_typed(6, addr, len))
        };
        assert!(matches!(later, Some(Err(PrefaultError::PoolBroken { chunk: 6, .. }))), "a later ensure: {later:?}");
        let settled = {
            let pf = pf.clone();
            within(10, move || pf.settle())
        };
        if settled.is_none() {
            std::mem::forget(r);
            panic!("settle still waits 10 s after a worker panicked under the pool's lock");
        }
        assert_eq!(pf.workers_running(), 0);
        drop(pf);
        drop(r);
    }

    /// Two threads `ensure` the same chunk, so they wait for one job: each
    /// gets its outcome (here the reservation hook's refusal), not only the
    /// first to read it. The chunk's one slice is held in the hook until
    /// the job counts both waiters.
    #[test]
    fn two_ensures_of_one_chunk_each_get_its_outcome() {
        use std::sync::mpsc;
        use std::time::{Duration, Instant};
        let r = pages(1);
        let (addr, len) = (r.as_ptr() as usize, r.len());
        let (entered_tx, entered) = mpsc::channel::<()>();
        let (go_tx, go) = mpsc::channel::<()>();
        let (entered_tx, go) = (Mutex::new(entered_tx), Mutex::new(go));
        let hook: ReserveFn = Box::new(move |_, _| {
            let _ = sync::lock(&entered_tx).send(());
            // Bounded: a test that fails elsewhere lets the worker go.
            let _ = sync::lock(&go).recv_timeout(Duration::from_secs(30));
            Err("refused by the test".to_string())
        });
        let cfg = PrefaultConfig { threads: 1, mode: PrefaultMode::Touch, huge_pages: false };
        // SAFETY: the region outlives the pre-faulter (dropped first).
        let pf = Arc::new(unsafe { Prefaulter::reserving(cfg, Vec::new(), Some(hook), None) });
        let ensure = |pf: &Arc<Prefaulter>| {
            let pf = pf.clone();
            std::thread::spawn(move || pf.ensure_typed(1, addr, len))
        };
        let first = ensure(&pf);
        entered.recv_timeout(Duration::from_secs(10)).expect("the chunk's slice never reached the hook");
        let second = ensure(&pf);
        let deadline = Instant::now() + Duration::from_secs(10);
        while pf.shared.lock().jobs.iter().map(|j| j.waiters).sum::<usize>() < 2 {
            assert!(Instant::now() < deadline, "the second ensure did not join the first's job within 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        go_tx.send(()).unwrap();
        for (who, h) in [("first", first), ("second", second)] {
            let got = h.join().unwrap();
            assert!(
                matches!(&got, Err(PrefaultError::Reserve { chunk: 1, msg, .. }) if msg == "refused by the test"),
                "the {who} ensure returned {got:?}"
            );
        }
        assert!(entered.try_recv().is_err(), "the chunk was queued twice");
        drop(pf);
        drop(r);
    }

    /// Polls `cond` on the pool until it holds; fails after 10 s with
    /// `what`.
    fn until(pf: &Prefaulter, what: &str, cond: impl Fn(&Pool) -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !cond(&pf.shared.lock()) {
            assert!(std::time::Instant::now() < deadline, "{what} within 10 s");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// `settle` beside two `ensure` calls (the engine makes none, but the
    /// pool is `Sync`): one waits for a chunk whose slice runs, held in the
    /// reservation hook, the other for a chunk queued behind it. The queued
    /// one is dropped, and its `ensure` returns `Stopped` at once, not when
    /// some slice happens to finish; the running one's `ensure` gets its
    /// chunk's real outcome (`Ok`), its job kept though `settle` cleared
    /// the others.
    #[test]
    fn settle_beside_ensure_ends_the_waits_with_each_chunks_outcome() {
        use std::sync::mpsc;
        use std::time::Duration;
        let r = pages(2);
        let (base, p) = (r.as_ptr() as usize, page_size());
        let (entered_tx, entered) = mpsc::channel::<()>();
        let (go_tx, go) = mpsc::channel::<()>();
        let (entered_tx, go) = (Mutex::new(entered_tx), Mutex::new(go));
        let hook: ReserveFn = Box::new(move |addr, _| {
            if addr == base {
                let _ = sync::lock(&entered_tx).send(());
                // Bounded: a test that fails elsewhere lets the worker go.
                let _ = sync::lock(&go).recv_timeout(Duration::from_secs(30));
            }
            Ok(())
        });
        let cfg = PrefaultConfig { threads: 1, mode: PrefaultMode::Touch, huge_pages: false };
        // SAFETY: the region outlives the pre-faulter: it is leaked below
        // when a call did not return.
        let pf = Arc::new(unsafe { Prefaulter::reserving(cfg, Vec::new(), Some(hook), None) });
        let running = {
            let pf = pf.clone();
            std::thread::spawn(move || pf.ensure_typed(0, base, p))
        };
        entered.recv_timeout(Duration::from_secs(10)).expect("chunk 0's slice never reached the hook");
        let queued = {
            let pf = pf.clone();
            std::thread::spawn(move || pf.ensure_typed(1, base + p, p))
        };
        until(&pf, "chunk 1's ensure waits", |g| g.jobs.iter().any(|j| j.chunk == 1 && j.waiters == 1));
        let settling = {
            let pf = pf.clone();
            std::thread::spawn(move || pf.settle())
        };
        let got = within(10, move || queued.join().unwrap());
        go_tx.send(()).unwrap();
        let Some(got) = got else {
            std::mem::forget(r);
            panic!("the ensure of a chunk settle dropped still waits 10 s later (for a slice of another chunk)");
        };
        assert_eq!(got, Err(PrefaultError::Stopped { chunk: 1 }));
        assert_eq!(running.join().unwrap(), Ok(()), "the ensure of the chunk that was running");
        settling.join().unwrap();
        assert_eq!(pf.workers_running(), 0);
        drop(pf);
        drop(r);
    }

    #[test]
    fn split_covers_the_range_at_aligned_cuts() {
        let p = page_size();
        for &(addr, len, threads, align) in &[
            (0x1000_0000usize, 64 << 20, 4usize, p),
            (0x1000_0000 + p, 64 << 20, 3, HUGE_PAGE_BYTES),
            (0x2000_0000, 5 * p, 8, p),
            (0x2000_0000, 3 * HUGE_PAGE_BYTES + p, 2, HUGE_PAGE_BYTES),
            (0x4000_0000, 1 << 30, 16, HUGE_PAGE_BYTES),
        ] {
            let s = split(addr, len, threads, align);
            assert_eq!(s[0].0, addr);
            let mut next = addr;
            for &(a, l) in &s {
                assert_eq!(a, next, "contiguous");
                assert!(l > 0 && l <= MAX_SLICE_BYTES.max(align));
                next = a + l;
                if next != addr + len {
                    assert_eq!(next % align, 0, "cut on a multiple of the alignment");
                }
            }
            assert_eq!(next, addr + len);
            assert!(s.len() >= threads.min(len / align), "enough slices for every thread: {} for {threads}", s.len());
        }
    }

    fn armed(min_mbps: u32, stalls_at_arm: Option<u64>) -> Pool {
        let mut p = Pool::new(Populate::Works, Vec::new(), HUGE_PAGE_BYTES);
        p.fallback = Some(HugeFallback::new(min_mbps, (0x4000_0000, 0x4000_0000 + (1 << 30)), stalls_at_arm));
        p
    }

    fn slice(addr: usize) -> Slice {
        Slice { job: 1, chunk: 0, addr, len: 16 << 20, lane: None }
    }

    #[test]
    fn slow_huge_slices_trip_the_fallback_from_the_first_queued_slice() {
        // Two workers: a window of 4 slices. 16 MiB in 0.1 s = 0.17 GB/s per
        // worker, under 1000 MB/s; no /proc/vmstat reading: the rate decides.
        let mut p = armed(1000, None);
        p.queue.push_back(slice(0x4000_0000 + (256 << 20)));
        p.queue.push_back(slice(0x4000_0000 + (512 << 20)));
        for k in 0..3 {
            assert_eq!(p.timed(&slice(0x4000_0000 + k * (16 << 20)), 0.1, true, 2), None, "window not full at {k}");
        }
        let from = 0x4000_0000 + (256 << 20);
        let (at, len, rate) = p.timed(&slice(0x4000_0000 + (48 << 20)), 0.1, true, 2).unwrap();
        assert_eq!((at, len), (from, (1 << 30) - (256 << 20)));
        assert!((rate - 0.1678).abs() < 1e-3, "{rate}");
        assert_eq!(p.fallback.as_ref().unwrap().tripped(), Some((at, rate)));
        // Once only; the buckets counted every slice (0.125 - 0.25 GB/s).
        assert_eq!(p.timed(&slice(0x4000_0000), 0.1, true, 2), None);
        assert_eq!(p.slice_gbps[1], 5);
    }

    #[test]
    fn fast_slices_base_pages_or_no_compaction_keep_huge_pages() {
        // 16 MiB in 4 ms: 4.2 GB/s per worker.
        let mut p = armed(1000, None);
        for _ in 0..8 {
            assert_eq!(p.timed(&slice(0x4000_0000), 0.004, true, 2), None);
        }
        // Slow base-page slices are not judged.
        for _ in 0..8 {
            assert_eq!(p.timed(&slice(0x4000_0000), 1.0, false, 2), None);
        }
        // Slow, but the kernel's stall counters did not grow since arming
        // (an arming count no reading can exceed): no trip, window restarts.
        if thp_stall_events().is_some() {
            let mut p = armed(1000, Some(u64::MAX));
            for _ in 0..8 {
                assert_eq!(p.timed(&slice(0x4000_0000), 1.0, true, 2), None);
            }
            assert!(p.fallback.as_ref().unwrap().tripped().is_none());
        }
        // Not armed: only counted.
        let mut p = Pool::new(Populate::Works, Vec::new(), HUGE_PAGE_BYTES);
        assert_eq!(p.timed(&slice(0x4000_0000), 1.0, true, 2), None);
        assert_eq!(p.slice_gbps[0], 1);
    }

    #[test]
    fn misaligned_address_is_typed() {
        // SAFETY: the address is rejected before any access.
        let pf =
            unsafe { Prefaulter::new(PrefaultConfig { threads: 2, mode: PrefaultMode::Populate, huge_pages: false }) };
        let e = pf.ensure_typed(3, 0x1001, 4096).unwrap_err();
        assert_eq!(e, PrefaultError::Misaligned { chunk: 3, addr: 0x1001, page: page_size() });
        assert!(e.to_string().contains("0x1001"), "{e}");
        assert_eq!(pf.workers_running(), 0);
    }

    #[test]
    fn populate_failure_is_typed_not_a_crash() {
        // A shared mapping of 4 pages over a memfd of 1 page: populating the
        // pages past the end of the file fails with EFAULT (SIGBUS would be
        // raised on access), as on a full /dev/shm (vLLM #46949).
        let page = page_size();
        // SAFETY: the name is a NUL-terminated literal.
        let fd = unsafe { libc::memfd_create(c"kvoffload-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: fd is the memfd just created.
        assert_eq!(unsafe { libc::ftruncate(fd, page as libc::off_t) }, 0);
        // SAFETY: a new shared mapping of the memfd; nothing else is affected.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), 4 * page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: Populate mode on a kernel with MADV_POPULATE_WRITE never
        // dereferences (checked just below; otherwise the test stops before
        // any ensure, as touching past the end of the file would SIGBUS).
        let pf =
            unsafe { Prefaulter::new(PrefaultConfig { threads: 2, mode: PrefaultMode::Populate, huge_pages: false }) };
        if pf.stats().populate_write == Some(true) {
            pf.ensure_typed(0, p as usize, page).unwrap();
            match pf.ensure_typed(1, p as usize, 4 * page) {
                Err(e @ PrefaultError::Populate { .. }) => {
                    let PrefaultError::Populate { chunk, errno, .. } = e.clone() else { unreachable!() };
                    assert_eq!((chunk, errno), (1, libc::EFAULT), "{e}");
                }
                other => panic!("expected a populate error, got {other:?}"),
            }
        }
        drop(pf);
        // SAFETY: unmaps the mapping made above; closes our fd.
        unsafe {
            assert_eq!(libc::munmap(p, 4 * page), 0);
            assert_eq!(libc::close(fd), 0);
        }
    }
}
