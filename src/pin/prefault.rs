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
//!
//! This file is the pool (its threads, the plan, the stats, the
//! [`Prefaulter`]); how one slice is faulted, with the safety argument of
//! every page access, is in `prefault_slice.rs`.
//!
//! Threads and locks come from [`crate::sync`]; the pool compiles under
//! loom, though the models drive the engine with [`super::NoPrefault`].

use std::collections::VecDeque;

use crate::region::page_size;
use crate::sync::{self, thread, Arc, Condvar, Mutex, MutexGuard};

use super::engine::Prefault;
use super::options::PrefaultMode;
use super::prefault_slice::{align, probe_populate, round_down, run_slice_caught, Populate, Slice};
pub use super::prefault_slice::{thp_setting, PrefaultConfig, PrefaultError, ReserveFn, HUGE_PAGE_BYTES};

/// Largest slice one worker takes at a time.
const MAX_SLICE_BYTES: usize = 16 << 20;

/// Stack of a worker thread (they only loop over madvise and byte accesses).
const WORKER_STACK_BYTES: usize = 256 << 10;

/// What a pre-faulter did so far.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
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
}

#[derive(Debug)]
struct Job {
    id: u64,
    chunk: usize,
    addr: usize,
    len: usize,
    /// Slices queued or running.
    pending: usize,
    error: Option<PrefaultError>,
    /// Queued from the plan: kept when done until `ensure` collects it.
    planned: bool,
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
}

impl Pool {
    fn job_mut(&mut self, id: u64) -> Option<&mut Job> {
        self.jobs.iter_mut().find(|j| j.id == id)
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
        self.jobs.push(Job { id, chunk, addr, len, pending, error: None, planned: lane.is_some() });
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
}

/// The pre-fault pool: a [`Prefault`] implementation with `threads` workers.
/// See the module documentation.
pub struct Prefaulter {
    shared: Arc<Shared>,
    workers: Mutex<Vec<thread::JoinHandle<()>>>,
    /// CPUs each worker restricts itself to as it starts (empty: anywhere).
    cpus: Vec<usize>,
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
    if sync::LOOM || cpus.is_empty() {
        return;
    }
    if let Err(e) = super::numa::bind_current_thread(cpus) {
        tracing::warn!(worker = k, error = %e, "NUMA: sched_setaffinity refused; this pre-fault worker runs on any CPU");
    }
}

fn worker(shared: Arc<Shared>) {
    let mut g = shared.lock();
    loop {
        if let Some(s) = g.take() {
            let skip = g.job_mut(s.job).is_none_or(|j| j.error.is_some());
            let (populate, huge) = (g.populate, g.huge_bytes);
            drop(g);
            let (res, learned) = if skip {
                (Ok(()), None)
            } else {
                // SAFETY: slices come from `ensure`/`hint`, whose ranges the
                // Prefaulter's creator vouched for (`Prefaulter::new`), and
                // `settle` (run before pinning publishes its final state and
                // before the pre-faulter is dropped) waits for every running
                // slice; slices start page aligned (checked, then cut at
                // multiples of the page size).
                unsafe { run_slice_caught(&shared.cfg, shared.reserve.as_ref(), huge, populate, &s) }
            };
            g = shared.lock();
            g.finish(&s, res, learned);
            shared.done.notify_all();
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
                pool: Mutex::new(Pool {
                    queue: VecDeque::new(),
                    jobs: Vec::new(),
                    next_id: 0,
                    stop: false,
                    populate,
                    bytes: 0,
                    slices: 0,
                    plan: (!plan.is_empty()).then_some(plan),
                    running: Vec::new(),
                    huge_bytes: huge_page_bytes.unwrap_or(HUGE_PAGE_BYTES),
                }),
                work: Condvar::new(),
                done: Condvar::new(),
            }),
            workers: Mutex::new(Vec::new()),
            cpus: Vec::new(),
        }
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
        }
    }

    /// Worker threads running right now.
    pub fn workers_running(&self) -> usize {
        sync::lock(&self.workers).len()
    }

    /// Starts the workers if none run; returns how many run. A failed spawn
    /// is logged and the pool continues with fewer (0: the caller works).
    fn start_workers(&self) -> usize {
        let mut w = sync::lock(&self.workers);
        if w.is_empty() {
            self.shared.lock().stop = false;
            for k in 0..self.shared.cfg.threads {
                let sh = self.shared.clone();
                let b = thread::Builder::new().name(format!("kvo-prefault-{k}")).stack_size(WORKER_STACK_BYTES);
                let cpus = self.cpus.clone();
                match b.spawn(move || {
                    pin_worker(k, &cpus);
                    worker(sh)
                }) {
                    Ok(h) => w.push(h),
                    Err(e) => {
                        tracing::warn!(error = %e, started = k, wanted = self.shared.cfg.threads, "could not start a pre-fault worker; continuing with fewer");
                        break;
                    }
                }
            }
        }
        w.len()
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

    /// Like [`Prefault::ensure`], with the typed error.
    pub fn ensure_typed(&self, chunk: usize, addr: usize, len: usize) -> Result<(), PrefaultError> {
        if self.shared.cfg.mode == PrefaultMode::Off || len == 0 {
            return Ok(());
        }
        self.check(chunk, addr)?;
        if self.start_workers() == 0 {
            return self.run_inline(chunk, addr, len);
        }
        let sh = &self.shared;
        let mut g = sh.lock();
        if g.submit_plan(&sh.cfg) {
            sh.work.notify_all();
        }
        let id = match g.find(chunk, addr, len) {
            Some(id) => id,
            None => {
                let id = g.submit(&sh.cfg, chunk, addr, len, None);
                sh.work.notify_all();
                id
            }
        };
        while g.jobs.iter().any(|j| j.id == id && j.pending > 0) {
            g = sync::wait(&sh.done, g);
        }
        let pos = g.jobs.iter().position(|j| j.id == id);
        let job = pos.map(|p| g.jobs.swap_remove(p));
        // Finished hints nobody asked for (not the engine's pattern) go too;
        // planned chunks stay until their `ensure`.
        g.jobs.retain(|j| j.pending > 0 || j.planned);
        match job.and_then(|j| j.error) {
            Some(e) => Err(e),
            None => Ok(()),
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
        if self.start_workers() == 0 {
            return;
        }
        let sh = &self.shared;
        let mut g = sh.lock();
        let planned = g.submit_plan(&sh.cfg);
        if g.find(i, addr, len).is_none() {
            g.submit(&sh.cfg, i, addr, len, None);
            sh.work.notify_all();
        } else if planned {
            sh.work.notify_all();
        }
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
        while g.jobs.iter().any(|j| j.pending > 0) {
            g = sync::wait(&sh.done, g);
        }
        g.jobs.clear();
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
