//! The workload of one rank (step 5 and 6 of [`super::rank`]), an engine's
//! use of its [`Offloader`]: a request generator and a verifier.
//!
//! An optional prefill (stores of keys 0.. in order: stores alone), then
//! requests that load their leading hits and store their misses (both
//! directions at once), each stored block written by the pattern-fill
//! kernel on the compute stream first, each loaded block checked on the GPU
//! by the verifier thread ([`super::verify`]); then the sweep, which loads
//! and checks every block the offloader still holds (loads alone). Each
//! stage's busy time is kept apart, so each direction's rate alone and both
//! ways at once are reported.
//!
//! The offloader places the blocks (its block manager) and moves them (its
//! transfer engine); the workload only chooses keys and GPU blocks.

use kvoffload::Named;
use kvoffload::Request;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::time::Instant;

use crate::random::{SplitMix64, Zipf};
use kvoffload::{
    Backend, BlockKey, Completion, Direction, GpuRuntime, JobId, Kernel, KeyedOffloader, Lookup, ManagerError,
    OffloaderError, Stream, TransferError, PATTERN_ENTRY_WORDS,
};
use std::sync::Arc;
use std::thread;

use super::config::{KillAt, RunConfig};
use super::error::{gated, RankError};
use super::lifecycle::Stop;
use super::metrics::{monotonic_secs, Intervals};
use super::parent::{emit, pause, phase, progress};
use super::report::{busy_lines, RankReport};
use super::tables::{Shape, TablePool};
use super::verify::{Checker, Loaded, Outcome, Verdict, Verifier};

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Kind {
    Store,
    Load,
}

/// One transfer job in flight.
struct Job {
    kind: Kind,
    keys: Vec<BlockKey>,
    /// The GPU blocks it holds (a store: those of every key it was asked
    /// to store, written by the fill kernel).
    gpu: Vec<usize>,
    /// Stores: the slot of the pinned pattern-fill table that the fill
    /// kernel on the compute stream reads (held until the store job,
    /// ordered after that kernel, is reported).
    table: Option<usize>,
    /// Sweep loads: attempts so far.
    attempt: u32,
}

/// Polls without progress before the loop blocks on its oldest job.
const IDLE_POLLS: u32 = 2000;

/// Per-direction time with at least one job in flight, as intervals on the
/// machine-wide monotonic clock (the parent merges every rank's).
#[derive(Default)]
struct Busy {
    in_flight: usize,
    since: Option<f64>,
    intervals: Intervals,
}

impl Busy {
    fn start(&mut self) {
        if self.in_flight == 0 {
            self.since = Some(monotonic_secs());
        }
        self.in_flight += 1;
    }
    fn end(&mut self) {
        self.in_flight -= 1;
        if self.in_flight == 0 {
            if let Some(s) = self.since.take() {
                self.intervals.push(s, monotonic_secs());
            }
        }
    }
}

struct Work<'a> {
    rank: usize,
    cfg: &'a RunConfig,
    off: &'a KeyedOffloader,
    shape: Shape,
    compute: Stream,
    /// Device buffers of the stores' pattern-fill tables.
    tables: TablePool,
    free_gpu: Vec<usize>,
    jobs: BTreeMap<JobId, Job>,
    verifying: usize,
    /// Keys this rank stored and did not see evicted.
    resident: HashSet<BlockKey>,
    /// Busy time per stage ([`PREFILL`], [`MIXED`], [`SWEEP`]) and direction.
    busy: [[Busy; 2]; 3],
    /// The stage jobs are issued in now (stages change only when idle).
    stage: usize,
    latencies: Vec<f64>,
    retry: Vec<Job>,
    stop: Stop,
}

/// Stages of a rank's workload: stores of the first `--prefill-blocks` keys
/// (stores alone), the Zipf requests (loads and stores at once), the final
/// sweep (loads alone).
const PREFILL: usize = 0;
const MIXED: usize = 1;
const SWEEP: usize = 2;
const STAGE_NAMES: [&str; 3] = ["prefill", "mixed", "sweep"];

/// Index of `b` in [`Backend::all`](kvoffload::Named::all).
fn backend_slot(b: Backend) -> usize {
    Backend::all().iter().position(|x| *x == b).unwrap_or(0)
}

fn dir_slot(k: Kind) -> usize {
    match k {
        Kind::Store => 0,
        Kind::Load => 1,
    }
}

/// What one rank's workload runs with: the run's settings, the rank, its
/// offloader, and the test controls.
pub(super) struct RankWorkload<'a> {
    pub(super) cfg: &'a RunConfig,
    pub(super) rank: usize,
    /// The rank's offloader (its KV tensors and compute stream).
    pub(super) off: &'a Arc<KeyedOffloader>,
    /// Re-injects the simulated copy fault after each one fired (a no-op
    /// without [`RunConfig::fault_copy_every`] for this rank).
    pub(super) rearm: &'a dyn Fn(&dyn GpuRuntime),
    /// Where a fault test kills this rank: the workload pauses there when
    /// it is [`KillAt::Transfers`].
    pub(super) pause_at: Option<KillAt>,
    /// Ends the workload early: no new work, what is in flight drains.
    pub(super) stop: Stop,
}

/// Runs the workload of rank `ctx.rank` on `ctx.off`, writing what it
/// measured into `rep`.
pub(super) fn workload(ctx: &RankWorkload<'_>, rep: &mut RankReport) -> Result<(), RankError> {
    let RankWorkload { cfg, rank, off, rearm, pause_at, stop } = *ctx;
    let shape = Shape {
        rank,
        layers: cfg.layers,
        factor: cfg.block_factor,
        page: cfg.page_bytes,
        layout: off.core().geometry().layout.clone(),
    };
    // A job has at most `blocks_per_job` blocks: one table entry per page.
    let entries = cfg.blocks_per_job * shape.pages_per_block();
    let tables = TablePool::new(off.core(), cfg.inflight, entries)?;
    let checker = match Checker::new(off.core(), entries) {
        Ok(c) => c,
        Err(e) => {
            tables.release(off.core());
            return Err(e);
        }
    };
    let verifier = Arc::new(Verifier::new());
    let vthread = {
        let (v, off, shape) = (verifier.clone(), off.clone(), shape.clone());
        thread::spawn(move || {
            let mut checker = checker;
            let r = v.run(off.core(), &mut checker, &shape);
            (checker, r)
        })
    };
    let mut w = Work {
        rank,
        cfg,
        off: off.as_ref(),
        shape,
        compute: off.core().geometry().compute_stream(),
        tables,
        free_gpu: (0..cfg.gpu_blocks).rev().collect(),
        jobs: BTreeMap::new(),
        verifying: 0,
        resident: HashSet::new(),
        busy: Default::default(),
        latencies: Vec::new(),
        stage: PREFILL,
        retry: Vec::new(),
        stop,
    };
    let r = w.run(rep, &verifier, rearm, pause_at);
    verifier.stop();
    let vr = match vthread.join() {
        Ok((checker, vr)) => {
            checker.release(off.core());
            vr
        }
        Err(_) => Err(RankError::Other("the verifier thread panicked".into())),
    };
    // After a failure jobs may still run: the fill tables are freed only
    // once nothing on the device reads them.
    if !w.jobs.is_empty() {
        if let Err(e) = off.core().wait_all(Request::new(), &mut drop) {
            tracing::warn!(rank, error = %e, "waiting for the jobs in flight failed");
        }
    }
    let lat = std::mem::take(&mut w.latencies);
    let busy = std::mem::take(&mut w.busy);
    w.tables.release(off.core());
    r?;
    vr?;
    for line in rep.latency_lines(&lat, 4096) {
        emit(&line);
    }
    for (stage, pair) in STAGE_NAMES.iter().zip(&busy) {
        for (dir, b) in ["store", "load"].into_iter().zip(pair) {
            for line in busy_lines(rep.rank, &format!("{dir}-{stage}"), &b.intervals, 1024) {
                emit(&line);
            }
        }
    }
    Ok(())
}

impl Work<'_> {
    fn run(
        &mut self,
        rep: &mut RankReport,
        verifier: &Verifier,
        rearm: &dyn Fn(&dyn GpuRuntime),
        pause_at: Option<KillAt>,
    ) -> Result<(), RankError> {
        phase(self.rank, "workload");
        let cfg = self.cfg;
        let mut rng = SplitMix64::new(cfg.seed.wrapping_add(self.rank as u64));
        let zipf = Zipf::new(cfg.keys, cfg.zipf);
        let need = cfg.blocks_per_job * cfg.block_factor;
        let step = (cfg.jobs / 100).max(1);
        let mut t0 = Instant::now();
        let mut issued = 0usize;
        let mut prefilled = 0usize;
        if cfg.prefill_blocks == 0 {
            self.stage = MIXED;
        } else {
            phase(self.rank, "prefill");
        }
        let mut paused = false;
        let mut sweep: VecDeque<Vec<BlockKey>> = VecDeque::new();
        let mut idle_polls = 0u32;
        loop {
            let stopping = self.stop.requested();
            if pause_at == Some(KillAt::Transfers)
                && !paused
                && !stopping
                && issued >= cfg.jobs / 2
                && !self.jobs.is_empty()
            {
                paused = true;
                pause(self.rank, KillAt::Transfers);
            }
            let mut progressed = false;
            // Issue requests (or sweep loads) while there is room.
            while !stopping && self.jobs.len() < cfg.inflight && self.free_gpu.len() >= need {
                if self.stage == PREFILL {
                    // Consecutive keys from 0: every one a miss, so stores only.
                    if prefilled >= cfg.prefill_blocks {
                        break;
                    }
                    let n = cfg.blocks_per_job.min(cfg.prefill_blocks - prefilled);
                    let keys: Vec<BlockKey> = (prefilled..prefilled + n).map(|k| BlockKey::new(k as u64, 0)).collect();
                    self.request(&keys, rep, rearm)?;
                    prefilled += n;
                } else if !self.sweeping() && issued < cfg.jobs {
                    let start = zipf.sample(&mut rng);
                    let keys: Vec<BlockKey> =
                        (0..cfg.blocks_per_job).map(|i| BlockKey::new(((start + i) % cfg.keys) as u64, 0)).collect();
                    self.request(&keys, rep, rearm)?;
                    issued += 1;
                    rep.requests += 1;
                    if issued % step == 0 {
                        progress(self.rank, "workload", issued, cfg.jobs);
                    }
                } else if let Some(job) = self.retry.pop() {
                    self.submit_load(job.keys, job.attempt, rep)?;
                } else if let Some(keys) = sweep.pop_front() {
                    self.submit_load(keys, 0, rep)?;
                } else {
                    break;
                }
                progressed = true;
            }
            for c in self.off.poll() {
                progressed = true;
                self.finished(c, rep, verifier, rearm)?;
            }
            for v in verifier.drain() {
                progressed = true;
                self.verified(v, rep)?;
            }
            let idle = self.jobs.is_empty() && self.verifying == 0;
            if idle && stopping {
                // Asked to stop: what was in flight has drained; no sweep.
                match self.stage {
                    PREFILL => rep.prefill_seconds = t0.elapsed().as_secs_f64(),
                    MIXED => rep.workload_seconds = t0.elapsed().as_secs_f64(),
                    _ => {}
                }
                tracing::info!(rank = self.rank, "stopped on request; the jobs in flight drained");
                break;
            }
            if idle && self.stage == PREFILL && prefilled >= cfg.prefill_blocks {
                rep.prefill_seconds = t0.elapsed().as_secs_f64();
                phase(self.rank, "workload");
                self.stage = MIXED;
                t0 = Instant::now();
                continue;
            }
            if idle
                && self.retry.is_empty()
                && ((self.sweeping() && sweep.is_empty()) || (!self.sweeping() && issued >= cfg.jobs))
            {
                if self.sweeping() {
                    break;
                }
                // 6. The sweep: every block still held must load with its pattern.
                rep.workload_seconds = t0.elapsed().as_secs_f64();
                progress(self.rank, "workload", issued, cfg.jobs);
                phase(self.rank, "verify");
                self.stage = SWEEP;
                sweep = self.sweep_batches(rep);
                continue;
            }
            if progressed {
                idle_polls = 0;
            } else if !self.jobs.is_empty() && idle_polls < IDLE_POLLS {
                // Poll again rather than block on one job: the oldest job
                // need not finish first (loads and stores run on their own
                // streams), and a blocked loop neither sees the others
                // finish nor refills the links.
                idle_polls += 1;
                thread::yield_now();
            } else {
                idle_polls = 0;
                if let Some(&id) = self.jobs.keys().next() {
                    match self.off.core().wait(id, Request::new(), &mut drop) {
                        Ok(())
                        | Err(OffloaderError::UnknownJob { .. })
                        | Err(OffloaderError::Transfer(TransferError::JobFailed { .. })) => {}
                        Err(e) => return Err(e.into()),
                    }
                } else if self.verifying > 0 {
                    if !verifier.wait_done() {
                        return Err(RankError::Other("the verifier stopped".into()));
                    }
                } else {
                    return Err(RankError::Other(format!(
                        "a request of {} blocks cannot be placed: {} GPU blocks free, {} host blocks held",
                        cfg.blocks_per_job,
                        self.free_gpu.len(),
                        self.off.stored_blocks()
                    )));
                }
            }
        }
        rep.store.seconds = self.busy[MIXED][0].intervals.total();
        rep.load.seconds = self.busy[MIXED][1].intervals.total();
        rep.prefill_store.seconds = self.busy[PREFILL][0].intervals.total();
        rep.sweep_load.seconds = self.busy[SWEEP][1].intervals.total();
        Ok(())
    }

    /// Checks the offloader against the blocks this rank stored and returns
    /// the resident keys in load batches.
    fn sweep_batches(&mut self, rep: &mut RankReport) -> VecDeque<Vec<BlockKey>> {
        let mut keys: Vec<BlockKey> = self.resident.iter().copied().collect();
        keys.sort_unstable();
        let mut ok = Vec::with_capacity(keys.len());
        for (k, answer) in keys.iter().zip(self.off.lookup(&keys)) {
            if answer == Lookup::Hit {
                ok.push(*k);
            } else {
                tracing::error!(rank = self.rank, key = %k, answer = ?answer, "a stored block is no longer readable");
                rep.blocks_lost += 1;
            }
        }
        let held = self.off.stored_blocks();
        if held != ok.len() {
            tracing::error!(
                rank = self.rank,
                held,
                known = ok.len(),
                "the offloader holds blocks this rank did not store"
            );
            rep.blocks_lost += held.abs_diff(ok.len()) as u64;
        }
        ok.chunks(self.cfg.blocks_per_job).map(|c| c.to_vec()).collect()
    }

    /// True in the final sweep (loads alone).
    fn sweeping(&self) -> bool {
        self.stage == SWEEP
    }

    fn take_gpu(&mut self, n: usize) -> Vec<usize> {
        let at = self.free_gpu.len() - n;
        self.free_gpu.split_off(at)
    }

    /// Waits for the compute stream (a fill kernel may still read a table
    /// or write GPU blocks that are about to be reused).
    fn sync_compute(&self) -> Result<(), RankError> {
        let compute = self.compute;
        gated(self.off.core(), "synchronizing the compute stream", |c| c.stream_synchronize(compute))
    }

    /// One request: load the leading hits, store the misses.
    fn request(
        &mut self,
        keys: &[BlockKey],
        rep: &mut RankReport,
        rearm: &dyn Fn(&dyn GpuRuntime),
    ) -> Result<(), RankError> {
        let answers = self.off.lookup(keys);
        if self.stage == MIXED {
            // Lookups and hits of the Zipf requests (the prefill's keys are
            // all new; the sweep looks nothing up).
            rep.lookups += keys.len() as u64;
            rep.hits += answers.iter().filter(|a| **a == Lookup::Hit).count() as u64;
        }
        let h = Lookup::leading_hits(&answers);
        if h > 0 {
            self.submit_load(keys[..h].to_vec(), 0, rep)?;
        }
        let misses: Vec<BlockKey> =
            keys[h..].iter().zip(&answers[h..]).filter(|(_, a)| **a == Lookup::Miss).map(|(k, _)| *k).collect();
        if misses.is_empty() {
            return Ok(());
        }
        let f = self.cfg.block_factor;
        let gpu = self.take_gpu(misses.len() * f);
        let entries = self.tables.entries();
        let Some((table, buf)) = self.tables.take() else {
            return Err(RankError::Other(format!("no free pattern table ({} jobs in flight)", self.jobs.len())));
        };
        // The engine's "compute": the pattern-fill kernel writes each block's
        // pattern into its GPU blocks on the compute stream (one table entry
        // per page); the store is ordered after it. The kernel reads its
        // table in place, in pinned host memory: no copy engine, so nothing
        // queues behind the loads' copies.
        let words = self.shape.table(&misses, &gpu);
        let count = words.len() / PATTERN_ENTRY_WORDS;
        debug_assert!(count <= entries, "{count} pages, tables of {entries}");
        // SAFETY: the buffer was free: the kernel that read it last has run
        // (its store was reported, or the compute stream was synchronized).
        unsafe { buf.write(&words) };
        let dtable = buf.device;
        let rt = self.off.core().geometry().runtime.as_ref();
        // SAFETY: the kernel reads the table written just before through
        // its device alias; the buffer stays with this job (not given back
        // to the pool) until the store, ordered after this kernel, is
        // reported or the stream is synchronized; the kernel writes the
        // job's GPU blocks, `gpu`, taken from the free list and not read
        // until the store job runs after it, in the offloader's live KV
        // tensors (freed at its shutdown, after every job).
        let r = unsafe { rt.launch(Kernel::PatternFill { table: dtable, count: count as u32 }, self.compute) };
        if let Err(e) = r {
            tracing::warn!(rank = self.rank, error = %e, "writing blocks on the compute stream failed; their store is dropped");
            self.sync_compute()?;
            self.tables.give(table);
            self.free_gpu.extend(gpu);
            rep.jobs_failed += 1;
            rep.stores_failed += 1;
            rearm(rt);
            return Ok(());
        }
        let submitted = match self.off.store(&misses, &gpu) {
            Ok(s) => s,
            Err(e) => {
                // Nothing was submitted: the fill kernel is the last reader
                // of the table and writer of the blocks.
                self.sync_compute()?;
                self.tables.give(table);
                self.free_gpu.extend(gpu);
                return match e {
                    // Every slot is pending or being read: skip storing this time.
                    OffloaderError::Manager(ManagerError::InsufficientCapacity { .. }) => Ok(()),
                    e => Err(e.into()),
                };
            }
        };
        for k in &submitted.evicted {
            self.resident.remove(k);
            rep.evictions += 1;
        }
        let Some(id) = submitted.job else {
            self.sync_compute()?;
            self.tables.give(table);
            self.free_gpu.extend(gpu);
            return Ok(());
        };
        rep.stores += 1;
        self.busy[self.stage][0].start();
        let job = Job { kind: Kind::Store, keys: submitted.stored, gpu, table: Some(table), attempt: 0 };
        self.jobs.insert(id, job);
        Ok(())
    }

    fn submit_load(&mut self, keys: Vec<BlockKey>, attempt: u32, rep: &mut RankReport) -> Result<(), RankError> {
        let gpu = self.take_gpu(keys.len() * self.cfg.block_factor);
        let id = match self.off.load(&keys, &gpu) {
            Ok(id) => id,
            Err(e) => {
                self.free_gpu.extend(gpu);
                return Err(e.into());
            }
        };
        rep.loads += 1;
        self.busy[self.stage][1].start();
        self.jobs.insert(id, Job { kind: Kind::Load, keys, gpu, table: None, attempt });
        Ok(())
    }

    /// A job the offloader reported (and already applied to its block
    /// manager: a stored key is readable, a failed store's keys are
    /// dropped, a loaded key's slot is released).
    fn finished(
        &mut self,
        c: Completion,
        rep: &mut RankReport,
        verifier: &Verifier,
        rearm: &dyn Fn(&dyn GpuRuntime),
    ) -> Result<(), RankError> {
        let Some(job) = self.jobs.remove(&c.job) else {
            return Err(RankError::Other(format!("job {} reported but not submitted", c.job)));
        };
        self.busy[self.stage][dir_slot(job.kind)].end();
        debug_assert_eq!(
            c.direction,
            if job.kind == Kind::Store { Direction::DeviceToHost } else { Direction::HostToDevice }
        );
        let ok = c.error.is_none();
        if ok {
            self.latencies.push(c.seconds);
        } else {
            rep.jobs_failed += 1;
            if !self.sweeping() {
                rearm(self.off.core().geometry().runtime.as_ref());
            }
        }
        match job.kind {
            Kind::Store => {
                if ok {
                    self.account(rep, Kind::Store, &c);
                    self.resident.extend(job.keys.iter().copied());
                } else {
                    rep.stores_failed += 1;
                    // A job that failed before its completion event may leave
                    // the compute stream still reading the fill table.
                    self.sync_compute()?;
                }
                // The fill kernel has run: the store completed after it, or
                // the compute stream was synchronized.
                if let Some(t) = job.table {
                    self.tables.give(t);
                }
                self.free_gpu.extend(job.gpu);
            }
            Kind::Load => {
                if ok {
                    self.account(rep, Kind::Load, &c);
                    self.verifying += 1;
                    verifier.push(Loaded { keys: job.keys, gpu: job.gpu });
                } else {
                    self.load_failed(job.keys, job.gpu, job.attempt, rep);
                }
            }
        }
        Ok(())
    }

    /// Adds a completed job to its stage's figures: bytes and latency, and
    /// during the requests the backend that moved it.
    fn account(&self, rep: &mut RankReport, kind: Kind, c: &Completion) {
        let (t, backends) = match (kind, self.stage) {
            (Kind::Store, PREFILL) => (&mut rep.prefill_store, None),
            (Kind::Store, _) => (&mut rep.store, Some(&mut rep.store_backends)),
            (Kind::Load, SWEEP) => (&mut rep.sweep_load, None),
            (Kind::Load, _) => (&mut rep.load, Some(&mut rep.load_backends)),
        };
        t.bytes += c.bytes;
        t.job_seconds += c.seconds;
        if let Some(b) = backends.filter(|_| self.stage == MIXED) {
            b[backend_slot(c.backend)] += 1;
        }
    }

    /// A load that delivered nothing checked: its GPU blocks are released
    /// (its keys are not lost: they stay stored); the sweep tries a batch
    /// three times.
    fn load_failed(&mut self, keys: Vec<BlockKey>, gpu: Vec<usize>, attempt: u32, rep: &mut RankReport) {
        rep.loads_failed += 1;
        self.free_gpu.extend(gpu);
        if self.sweeping() {
            if attempt + 1 >= 3 {
                tracing::error!(rank = self.rank, keys = keys.len(), "sweep load failed three times");
                rep.blocks_lost += keys.len() as u64;
            } else {
                let job = Job { kind: Kind::Load, keys, gpu: Vec::new(), table: None, attempt: attempt + 1 };
                self.retry.push(job);
            }
        }
    }

    fn verified(&mut self, v: Verdict, rep: &mut RankReport) -> Result<(), RankError> {
        self.verifying -= 1;
        let Outcome { verified, corrupted } = v.outcome;
        rep.blocks_verified += verified;
        rep.blocks_corrupted += corrupted;
        if self.sweeping() {
            rep.sweep_blocks += verified + corrupted;
        }
        self.free_gpu.extend(v.loaded.gpu);
        Ok(())
    }
}
