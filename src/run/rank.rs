//! One rank of `kvoffload run`: an engine-like process that shares the
//! region with its peers.
//!
//! 1. creates (rank 0) or joins the shared region; the file is unlinked as
//!    soon as every rank has mapped it;
//! 2. starts background pinning of the whole region through its own
//!    coordinator, with the P7 agreement over the region header's words;
//! 3. runs its own start-up work (a compute loop) meanwhile;
//! 4. captures graphs in GLOBAL mode through capture windows;
//! 5. waits for the agreed pin state, then runs requests: each picks
//!    `blocks_per_job` consecutive keys (Zipf), loads the leading hits and
//!    stores the misses (each block's pattern written into its GPU blocks
//!    by the pattern-fill kernel on the compute stream first, so stores
//!    must be ordered after compute); every page of every loaded block is
//!    checked on the GPU by the pattern-check kernel, driven by a verifier
//!    thread (`verify.rs`);
//! 6. loads and checks every block the manager still holds (the sweep);
//! 7. shuts down in the protocol's order and unmaps the region.
//!
//! It speaks to the parent through stdout lines (`report::PHASE`, ...).

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use crate::manager::bench::{SplitMix64, Zipf};
use crate::manager::{BlockKey, BlockManager, BlockState, Lookup, ManagerConfig, ManagerError, PolicyKind};
use crate::pattern;
use crate::pin::{pin_all_agreed, Agreement, PinError, PinOptions, Prefault, Prepared};
use crate::protocol::agreement::{AgreementError, RankSlots};
use crate::protocol::{shutdown, GraphToken, PinState, ProtocolError, ShutdownError};
use crate::region::slots::RegionSlots;
use crate::region::{Region, RegionError, ShmOptions};
use crate::runtime::sim::SimFault;
use crate::runtime::{
    CaptureMode, Code, DevicePtr, Direction, DriverError, GpuRuntime, Graph, Kernel, Stream, PATTERN_ENTRY_WORDS,
};
use crate::sync::{self, thread, Arc, Mutex};
use crate::transfer::{
    GroupSpec, HostPlacement, JobBlocks, JobId, KvLayout, TensorSpec, TransferEngine, TransferError, TransferOptions,
};

use super::config::{ConfigError, Derived, KillAt, RunConfig};
use super::pages::{Shape, TablePool};
use super::report::{RankReport, NOTE, PAUSE, PHASE, PROGRESS};
use super::verify::{Checker, Loaded, Outcome, Verdict};

/// Why a rank stopped before its report.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("region: {0}")]
    Region(#[from] RegionError),
    #[error("pinning set-up: {0}")]
    Pin(#[from] PinError),
    #[error("protocol: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("{what}: {error}")]
    Driver { what: &'static str, error: DriverError },
    #[error("transfer: {0}")]
    Transfer(#[from] TransferError),
    #[error("block manager: {0}")]
    Manager(#[from] ManagerError),
    #[error("shutdown: {0}")]
    Shutdown(#[from] ShutdownError),
    #[error("{0}")]
    Other(String),
}

fn drv(what: &'static str) -> impl FnOnce(DriverError) -> RankError {
    move |error| RankError::Driver { what, error }
}

/// Writes one line on stdout for the parent, flushed at once.
pub fn emit(line: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{line}");
    let _ = o.flush();
}

fn phase(rank: usize, p: &str) {
    emit(&format!("{PHASE} rank={rank} phase={p}"));
}

fn progress(rank: usize, p: &str, done: usize, total: usize) {
    emit(&format!("{PROGRESS} rank={rank} phase={p} done={done} total={total}"));
}

/// Announces a pause point and blocks until the parent writes a line or
/// closes stdin (the parent SIGKILLs the rank here in the fault tests; if
/// the parent is gone, stdin reaches EOF and the rank goes on).
fn pause(rank: usize, at: KillAt) {
    emit(&format!("{PAUSE} rank={rank} at={}", at.name()));
    let mut s = String::new();
    let _ = std::io::stdin().lock().read_line(&mut s);
}

/// Wraps the pre-faulter: reports progress per chunk, pauses where the
/// fault test asks, and notes when this rank's own pinning ended.
struct PinProbe {
    inner: Arc<dyn Prefault>,
    rank: usize,
    total: usize,
    pause_at: Option<usize>,
    started: Instant,
    local_done: Mutex<Option<Duration>>,
}

impl Prefault for PinProbe {
    fn ensure(&self, i: usize, addr: usize, len: usize) -> Result<(), String> {
        progress(self.rank, "pinning", i, self.total);
        if self.pause_at == Some(i) {
            pause(self.rank, KillAt::Pinning);
        }
        self.inner.ensure(i, addr, len)
    }

    fn hint(&self, i: usize, addr: usize, len: usize) {
        self.inner.hint(i, addr, len)
    }

    fn settle(&self) {
        self.inner.settle();
        sync::lock(&self.local_done).get_or_insert(self.started.elapsed());
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Kind {
    Store,
    Load,
}

/// One transfer job in flight.
struct Job {
    kind: Kind,
    keys: Vec<BlockKey>,
    gpu: Vec<usize>,
    /// Stores: the pattern-fill table the compute stream uploads (read by
    /// the copy engine until the store job, ordered after compute,
    /// completes), and the slot of the device buffer it goes to.
    #[allow(dead_code)] // held, never read here: the copy engine reads it
    staging: Vec<u64>,
    table: Option<usize>,
    /// Sweep loads: attempts so far.
    attempt: u32,
}

/// Runs rank `rank` of `cfg` on `rt` with the region `region_name`;
/// `pause_at` makes it stop where a fault test kills it.
pub fn run_rank(
    cfg: &RunConfig,
    rank: usize,
    region_name: &str,
    rt: Arc<dyn GpuRuntime>,
    pause_at: Option<KillAt>,
) -> Result<RankReport, RankError> {
    let d = cfg.validate()?;
    let mut rep = RankReport { rank, backend: rt.backend().to_string(), ..Default::default() };

    // 1. The region.
    phase(rank, "region");
    let opts = ShmOptions::new().timeout(cfg.rank_timeout);
    let region = if rank == 0 {
        Region::create(region_name, d.layout, 0, &opts)?
    } else {
        Region::join(region_name, d.layout, rank, &opts)?
    };
    let region = Arc::new(region);
    rep.region_bytes = region.len() as u64;

    // Faults (simulated GPU only; the parent refuses them elsewhere).
    let faulty = cfg.fault_rank.is_none_or(|r| r == rank);
    if faulty {
        if let Some(sim) = rt.as_sim() {
            if let Some(k) = cfg.fault_register_at {
                sim.inject(SimFault::Register { nth: k, code: Code::NOT_SUPPORTED });
            }
            if let Some(k) = cfg.fault_copy_every {
                sim.inject(SimFault::Copy { nth: k, code: Code::INVALID_VALUE });
            }
        }
    }
    let copy_fault = if faulty { cfg.fault_copy_every } else { None };
    let rearm = |rt: &dyn GpuRuntime| {
        if let (Some(k), Some(sim)) = (copy_fault, rt.as_sim()) {
            sim.inject(SimFault::Copy { nth: k, code: Code::INVALID_VALUE });
        }
    };

    // 2. Background pinning with the agreement.
    phase(rank, "pinning");
    let mut popts = PinOptions::default().max_chunk_bytes(d.pin_chunk).huge_pages(cfg.pin_huge_pages);
    if let Some(t) = cfg.pin_threads {
        popts = popts.threads(t);
    }
    let prepared = Prepared::new(&region, &popts)?;
    let chunks = prepared.chunks();
    let (coord, prefault) = prepared.into_parts();
    let started = Instant::now();
    let probe = Arc::new(PinProbe {
        inner: prefault,
        rank,
        total: chunks,
        pause_at: (pause_at == Some(KillAt::Pinning)).then_some(chunks / 2),
        started,
        local_done: Mutex::new(None),
    });
    let slots: Arc<dyn RankSlots> = match RegionSlots::new(region.clone()) {
        Some(s) => Arc::new(s),
        None => return Err(RankError::Other("the run's region is not shared".into())),
    };
    let agreement = Agreement { slots, rank, timeout: Some(cfg.rank_timeout) };
    let pinner = {
        let (rt, coord, probe) = (rt.clone(), coord.clone(), probe.clone());
        thread::spawn(move || pin_all_agreed(rt.as_ref(), &coord, probe.as_ref(), &agreement))
    };

    // 3. The engine's own start-up work, overlapping pinning.
    phase(rank, "startup");
    let t = Instant::now();
    let mut buf = vec![0u8; 64 << 10];
    let mut n = 0u64;
    while t.elapsed() < cfg.startup {
        pattern::fill(n, &mut buf);
        n += 1;
    }
    std::hint::black_box(&buf);

    // 4. Graph capture through capture windows (GLOBAL mode).
    phase(rank, "capture");
    let cstream = rt.stream_create().map_err(drv("creating the capture stream"))?;
    let scratch = rt.mem_alloc(1 << 20).map_err(drv("allocating the capture scratch buffer"))?;
    let mut graphs: Vec<(Graph, GraphToken)> = Vec::new();
    for _ in 0..cfg.graphs {
        let t = Instant::now();
        let window = coord.open_window()?;
        let waited = t.elapsed().as_secs_f64();
        rep.windows += 1;
        rep.window_wait_total += waited;
        rep.window_wait_max = rep.window_wait_max.max(waited);
        rep.chunks_waited += window.chunks_waited() as u64;
        match capture_one(rt.as_ref(), cstream, scratch, cfg.graph_nodes) {
            Ok(g) => {
                drop(window);
                graphs.push((g, coord.register_graph()?));
                rep.graphs_ok += 1;
            }
            Err(e) => {
                drop(window);
                tracing::error!(rank, error = %e, "graph capture failed");
                rep.graphs_failed += 1;
            }
        }
    }
    for (g, _) in &graphs {
        rt.graph_launch(*g, cstream).map_err(drv("replaying a graph"))?;
    }
    rt.stream_synchronize(cstream).map_err(drv("replaying the graphs"))?;

    // 5a. The agreed pin state.
    phase(rank, "agree");
    let state = coord.wait_pin_final()?;
    let agreed = pinner.join().map_err(|_| RankError::Other("the pinning thread panicked".into()))?;
    rep.agreed_seconds = started.elapsed().as_secs_f64();
    rep.pin_seconds = sync::lock(&probe.local_done).map_or(rep.agreed_seconds, |d| d.as_secs_f64());
    rep.pin_state = format!("{state:?}").replace(' ', "");
    rep.agreement = match &agreed {
        Ok(PinState::Pinned) => "pinned".into(),
        Ok(_) => "pageable".into(),
        Err(e @ AgreementError::RankDied { .. }) | Err(e @ AgreementError::Timeout { .. }) => {
            emit(&format!("{NOTE} rank={rank} agreement not reached ({e}); this rank runs on pageable memory"));
            format!("failed: {e}")
        }
        Err(e) => format!("failed: {e}"),
    };
    drop(probe);

    // 5b. GPU tensors, the transfer engine, the manager, the verifier.
    let mut tensors: Vec<DevicePtr> = Vec::with_capacity(cfg.layers);
    let alloc = (|| {
        for _ in 0..cfg.layers {
            tensors.push(rt.mem_alloc(cfg.gpu_blocks * cfg.page_bytes)?);
        }
        Ok(())
    })();
    let result = alloc
        .map_err(drv("allocating the GPU KV tensors"))
        .and_then(|()| workload(cfg, &d, rank, &rt, &coord, &region, &tensors, &rearm, &mut rep, pause_at));
    for p in tensors {
        if let Err(e) = rt.mem_free(p) {
            tracing::warn!(error = %e, "freeing a KV tensor failed");
        }
    }

    // 7. Shutdown: graphs first, then the protocol's order, then unmap.
    phase(rank, "shutdown");
    for (g, token) in graphs {
        rt.graph_destroy(g).map_err(drv("destroying a graph"))?;
        drop(token);
    }
    rt.mem_free(scratch).map_err(drv("freeing the capture scratch buffer"))?;
    rt.stream_destroy(cstream).map_err(drv("destroying the capture stream"))?;
    // Unregister even when the workload failed: the region is unmapped next.
    let down = shutdown(rt.as_ref(), &coord, || {});
    result?;
    down?;
    drop(coord);
    drop(region);
    Ok(rep)
}

/// One GLOBAL-mode capture of `nodes` memsets into `scratch`.
fn capture_one(rt: &dyn GpuRuntime, s: Stream, scratch: DevicePtr, nodes: usize) -> Result<Graph, DriverError> {
    rt.begin_capture(s, CaptureMode::Global)?;
    let mut first = None;
    for i in 0..nodes {
        if let Err(e) = rt.memset_d8_async(scratch, i as u8, 1 << 20, s) {
            first = Some(e);
            break;
        }
    }
    let g = rt.end_capture(s)?;
    match first {
        None => Ok(g),
        Some(e) => {
            let _ = rt.graph_destroy(g);
            Err(e)
        }
    }
}

/// Per-direction time with at least one job in flight.
#[derive(Default)]
struct Busy {
    in_flight: usize,
    since: Option<Instant>,
    seconds: f64,
}

impl Busy {
    fn start(&mut self) {
        if self.in_flight == 0 {
            self.since = Some(Instant::now());
        }
        self.in_flight += 1;
    }
    fn end(&mut self) {
        self.in_flight -= 1;
        if self.in_flight == 0 {
            if let Some(s) = self.since.take() {
                self.seconds += s.elapsed().as_secs_f64();
            }
        }
    }
}

struct Work<'a> {
    rank: usize,
    cfg: &'a RunConfig,
    rt: &'a Arc<dyn GpuRuntime>,
    engine: &'a TransferEngine,
    mgr: BlockManager,
    shape: Shape,
    compute: Stream,
    /// Device buffers of the stores' pattern-fill tables.
    tables: TablePool,
    free_gpu: Vec<usize>,
    jobs: BTreeMap<JobId, Job>,
    next_id: JobId,
    verifying: usize,
    resident: HashSet<BlockKey>,
    busy: [Busy; 2],
    latencies: Vec<f64>,
    sweep: bool,
    retry: Vec<Job>,
}

/// The verifier's queue; each loaded job carries its sweep attempt.
type Verifier = super::verify::Verifier<u32>;

fn dir_slot(k: Kind) -> usize {
    match k {
        Kind::Store => 0,
        Kind::Load => 1,
    }
}

#[allow(clippy::too_many_arguments)]
fn workload(
    cfg: &RunConfig,
    d: &Derived,
    rank: usize,
    rt: &Arc<dyn GpuRuntime>,
    coord: &Arc<crate::protocol::Coordinator>,
    region: &Region,
    tensors: &[DevicePtr],
    rearm: &dyn Fn(&dyn GpuRuntime),
    rep: &mut RankReport,
    pause_at: Option<KillAt>,
) -> Result<(), RankError> {
    let f = cfg.block_factor;
    let spec = GroupSpec {
        tensors: tensors.iter().map(|&p| TensorSpec { device_base: p, page_bytes: cfg.page_bytes }).collect(),
        num_gpu_blocks: cfg.gpu_blocks,
        num_host_blocks: d.host_blocks,
    };
    let host_base = region.chunk_ptr(rank, 0)?.as_ptr() as usize;
    let placement = HostPlacement::BlockStrided { stride: d.layout.row_bytes() };
    let layout = KvLayout::new(&[spec], f, host_base, placement).map_err(TransferError::from)?;
    let compute = rt.stream_create().map_err(drv("creating the compute stream"))?;
    // SAFETY: the host area is this rank's slots of `region`, which outlives
    // the engine (dropped at the end of this function, the region later);
    // only DMA touches those slots while jobs are in flight (the verifier
    // reads GPU memory, never the region); the tensors are live
    // allocations of `rt`, freed by the caller after the engine is dropped.
    let engine =
        unsafe { TransferEngine::new(rt.clone(), coord.clone(), layout.clone(), compute, TransferOptions::default()) };
    let engine = match engine {
        Ok(e) => e,
        Err(e) => {
            let _ = rt.stream_destroy(compute);
            return Err(e.into());
        }
    };
    let shape = Shape { rank, layers: cfg.layers, factor: f, page: cfg.page_bytes, layout };
    // A job has at most `blocks_per_job` blocks: one table entry per page.
    let entries = cfg.blocks_per_job * shape.pages_per_block();
    let made = TablePool::new(rt.as_ref(), cfg.inflight, entries)
        .map_err(drv("allocating the pattern-fill tables"))
        .and_then(|t| match Checker::new(rt.as_ref(), entries) {
            Ok(c) => Ok((t, c)),
            Err(e) => {
                t.release(rt.as_ref());
                Err(drv("setting up the verifier")(e))
            }
        });
    let (tables, checker) = match made {
        Ok(m) => m,
        Err(e) => {
            drop(engine);
            let _ = rt.stream_destroy(compute);
            return Err(e);
        }
    };
    let verifier = Arc::new(Verifier::new());
    let vthread = {
        let (v, rt, shape) = (verifier.clone(), rt.clone(), shape.clone());
        thread::spawn(move || {
            let r = v.run(rt.as_ref(), &checker, &shape);
            (checker, r)
        })
    };
    let mut w = Work {
        rank,
        cfg,
        rt,
        engine: &engine,
        mgr: BlockManager::new(ManagerConfig::new(d.host_blocks, PolicyKind::Lru))?,
        shape,
        compute,
        tables,
        free_gpu: (0..cfg.gpu_blocks).rev().collect(),
        jobs: BTreeMap::new(),
        next_id: 1,
        verifying: 0,
        resident: HashSet::new(),
        busy: Default::default(),
        latencies: Vec::new(),
        sweep: false,
        retry: Vec::new(),
    };
    let r = w.run(rep, &verifier, rearm, pause_at);
    verifier.stop();
    let vr = match vthread.join() {
        Ok((checker, vr)) => {
            checker.release(rt.as_ref());
            vr
        }
        Err(_) => return Err(RankError::Other("the verifier thread panicked".into())),
    };
    let lat = std::mem::take(&mut w.latencies);
    let tables = w.tables;
    drop(engine);
    if let Err(e) = rt.stream_destroy(compute) {
        tracing::warn!(error = %e, "destroying the compute stream failed");
    }
    tables.release(rt.as_ref());
    r?;
    vr.map_err(drv("reading GPU blocks back"))?;
    for line in rep.latency_lines(&lat, 4096) {
        emit(&line);
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
        let t0 = Instant::now();
        let mut issued = 0usize;
        let mut paused = false;
        let mut sweep: VecDeque<Vec<BlockKey>> = VecDeque::new();
        loop {
            if pause_at == Some(KillAt::Transfers) && !paused && issued >= cfg.jobs / 2 && !self.jobs.is_empty() {
                paused = true;
                pause(self.rank, KillAt::Transfers);
            }
            let mut progressed = false;
            // Issue requests (or sweep loads) while there is room.
            while self.jobs.len() + self.verifying < cfg.inflight && self.free_gpu.len() >= need {
                if !self.sweep && issued < cfg.jobs {
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
            for r in self.engine.poll_finished() {
                progressed = true;
                self.finished(r, rep, verifier, rearm)?;
            }
            for v in verifier.drain() {
                progressed = true;
                self.verified(v, rep, rearm)?;
            }
            let idle = self.jobs.is_empty() && self.verifying == 0;
            if idle
                && self.retry.is_empty()
                && ((self.sweep && sweep.is_empty()) || (!self.sweep && issued >= cfg.jobs))
            {
                if self.sweep {
                    break;
                }
                // 6. The sweep: every block still held must load with its pattern.
                rep.workload_seconds = t0.elapsed().as_secs_f64();
                progress(self.rank, "workload", issued, cfg.jobs);
                phase(self.rank, "verify");
                self.sweep = true;
                sweep = self.sweep_batches(rep);
                continue;
            }
            if !progressed {
                if let Some(&id) = self.jobs.keys().next() {
                    match self.engine.wait(id) {
                        Ok(()) | Err(TransferError::JobFailed { .. }) | Err(TransferError::UnknownJob { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                } else if self.verifying > 0 {
                    if !verifier.wait_done() {
                        return Err(RankError::Other("the verifier stopped".into()));
                    }
                } else {
                    return Err(RankError::Other(format!(
                        "a request of {} blocks cannot be placed: {} GPU blocks free, {} host slots",
                        cfg.blocks_per_job,
                        self.free_gpu.len(),
                        self.mgr.capacity()
                    )));
                }
            }
        }
        rep.lookups = self.mgr.counters().lookups;
        rep.hits = self.mgr.counters().hits;
        rep.store.seconds = self.busy[0].seconds;
        rep.load.seconds = self.busy[1].seconds;
        Ok(())
    }

    /// Checks the manager against the blocks this rank stored and returns
    /// the resident keys in load batches.
    fn sweep_batches(&mut self, rep: &mut RankReport) -> VecDeque<Vec<BlockKey>> {
        let mut keys: Vec<BlockKey> = self.resident.iter().copied().collect();
        keys.sort_unstable();
        let mut ok = Vec::with_capacity(keys.len());
        for k in keys {
            match self.mgr.state(&k) {
                Some(BlockState::Ready { .. }) => ok.push(k),
                other => {
                    tracing::error!(rank = self.rank, key = %k, state = ?other, "a stored block is no longer readable");
                    rep.blocks_lost += 1;
                }
            }
        }
        if self.mgr.len() != ok.len() {
            tracing::error!(
                rank = self.rank,
                held = self.mgr.len(),
                known = ok.len(),
                "the manager holds blocks this rank did not store"
            );
            rep.blocks_lost += self.mgr.len().abs_diff(ok.len()) as u64;
        }
        ok.chunks(self.cfg.blocks_per_job).map(|c| c.to_vec()).collect()
    }

    fn id(&mut self) -> JobId {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn take_gpu(&mut self, n: usize) -> Vec<usize> {
        let at = self.free_gpu.len() - n;
        self.free_gpu.split_off(at)
    }

    /// One request: load the leading hits, store the misses.
    fn request(
        &mut self,
        keys: &[BlockKey],
        rep: &mut RankReport,
        rearm: &dyn Fn(&dyn GpuRuntime),
    ) -> Result<(), RankError> {
        let answers = self.mgr.lookup(keys);
        let h = Lookup::leading_hits(&answers);
        if h > 0 {
            self.submit_load(keys[..h].to_vec(), 0, rep)?;
        }
        let misses: Vec<BlockKey> =
            keys[h..].iter().zip(&answers[h..]).filter(|(_, a)| **a == Lookup::Miss).map(|(k, _)| *k).collect();
        if misses.is_empty() {
            return Ok(());
        }
        let out = match self.mgr.prepare_store(&misses) {
            Ok(o) => o,
            // Every slot is pending or being read: skip storing this time.
            Err(ManagerError::InsufficientCapacity { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        for e in &out.evicted {
            self.resident.remove(&e.key);
            rep.evictions += 1;
        }
        if out.to_store.is_empty() {
            return Ok(());
        }
        let f = self.cfg.block_factor;
        let stored: Vec<BlockKey> = out.to_store.iter().map(|p| p.key).collect();
        let slots: Vec<usize> = out.to_store.iter().map(|p| p.slot.index()).collect();
        let gpu = self.take_gpu(stored.len() * f);
        let Some((table, dtable)) = self.tables.take() else {
            return Err(RankError::Other(format!("no free pattern table ({} stores in flight)", self.jobs.len())));
        };
        // The engine's "compute": the pattern-fill kernel writes each block's
        // pattern into its GPU blocks on the compute stream (one table entry
        // per page); the store is ordered after it.
        let staging = self.shape.table(&stored, &gpu);
        let count = staging.len() / PATTERN_ENTRY_WORDS;
        debug_assert!(count <= self.tables.entries(), "{count} pages, tables of {}", self.tables.entries());
        // SAFETY: `staging` moves into the job (its heap buffer stays put)
        // and lives until the store job (ordered after this stream's work)
        // is reported, or until the stream is synchronized below.
        let r = unsafe { self.rt.copy_htod_async(dtable, staging.as_ptr() as usize, staging.len() * 8, self.compute) }
            .and_then(|()| self.rt.launch(Kernel::PatternFill { table: dtable, count: count as u32 }, self.compute));
        if let Err(e) = r {
            tracing::warn!(rank = self.rank, error = %e, "writing blocks on the compute stream failed; their store is dropped");
            self.rt.stream_synchronize(self.compute).map_err(drv("synchronizing the compute stream"))?;
            self.tables.give(table);
            self.mgr.complete_store(&stored, false)?;
            self.free_gpu.extend(gpu);
            rep.jobs_failed += 1;
            rep.stores_failed += 1;
            rearm(self.rt.as_ref());
            return Ok(());
        }
        let id = self.id();
        let blocks = JobBlocks::single(gpu.clone(), slots);
        self.engine.store(id, &blocks)?;
        rep.stores += 1;
        self.busy[0].start();
        self.jobs.insert(id, Job { kind: Kind::Store, keys: stored, gpu, staging, table: Some(table), attempt: 0 });
        Ok(())
    }

    fn submit_load(&mut self, keys: Vec<BlockKey>, attempt: u32, rep: &mut RankReport) -> Result<(), RankError> {
        let placements = self.mgr.prepare_load(&keys)?;
        let slots: Vec<usize> = placements.iter().map(|p| p.slot.index()).collect();
        let gpu = self.take_gpu(keys.len() * self.cfg.block_factor);
        let id = self.id();
        if let Err(e) = self.engine.load(id, &JobBlocks::single(gpu.clone(), slots)) {
            self.mgr.complete_load(&keys)?;
            self.free_gpu.extend(gpu);
            return Err(e.into());
        }
        rep.loads += 1;
        self.busy[1].start();
        self.jobs.insert(id, Job { kind: Kind::Load, keys, gpu, staging: Vec::new(), table: None, attempt });
        Ok(())
    }

    fn finished(
        &mut self,
        r: crate::transfer::JobResult,
        rep: &mut RankReport,
        verifier: &Verifier,
        rearm: &dyn Fn(&dyn GpuRuntime),
    ) -> Result<(), RankError> {
        let Some(job) = self.jobs.remove(&r.id) else {
            return Err(RankError::Other(format!("job {} reported but not submitted", r.id)));
        };
        self.busy[dir_slot(job.kind)].end();
        debug_assert_eq!(
            r.direction,
            if job.kind == Kind::Store { Direction::DeviceToHost } else { Direction::HostToDevice }
        );
        if r.succeeded() {
            self.latencies.push(r.seconds);
        } else {
            rep.jobs_failed += 1;
            if !self.sweep {
                rearm(self.rt.as_ref());
            }
        }
        match job.kind {
            Kind::Store => {
                if r.succeeded() {
                    rep.store.bytes += r.bytes;
                    self.mgr.complete_store(&job.keys, true)?;
                    self.resident.extend(job.keys.iter().copied());
                } else {
                    rep.stores_failed += 1;
                    // A job that failed before its completion event may leave
                    // the compute stream still reading the fill table.
                    self.rt.stream_synchronize(self.compute).map_err(drv("synchronizing the compute stream"))?;
                    self.mgr.complete_store(&job.keys, false)?;
                }
                // The fill kernel has run: the store completed after it, or
                // the compute stream was synchronized.
                if let Some(t) = job.table {
                    self.tables.give(t);
                }
                self.free_gpu.extend(job.gpu);
            }
            Kind::Load => {
                if r.succeeded() {
                    rep.load.bytes += r.bytes;
                    self.verifying += 1;
                    verifier.push(Loaded { keys: job.keys, gpu: job.gpu, job: job.attempt });
                } else {
                    self.load_failed(job.keys, job.gpu, job.attempt, rep)?;
                }
            }
        }
        Ok(())
    }

    /// A load that delivered nothing checked: its blocks are released (not
    /// lost: they stay in the manager); the sweep tries a batch three times.
    fn load_failed(
        &mut self,
        keys: Vec<BlockKey>,
        gpu: Vec<usize>,
        attempt: u32,
        rep: &mut RankReport,
    ) -> Result<(), RankError> {
        rep.loads_failed += 1;
        self.mgr.complete_load(&keys)?;
        self.free_gpu.extend(gpu);
        if self.sweep {
            if attempt + 1 >= 3 {
                tracing::error!(rank = self.rank, keys = keys.len(), "sweep load failed three times");
                rep.blocks_lost += keys.len() as u64;
            } else {
                let job = Job {
                    kind: Kind::Load,
                    keys,
                    gpu: Vec::new(),
                    staging: Vec::new(),
                    table: None,
                    attempt: attempt + 1,
                };
                self.retry.push(job);
            }
        }
        Ok(())
    }

    fn verified(
        &mut self,
        v: Verdict<u32>,
        rep: &mut RankReport,
        rearm: &dyn Fn(&dyn GpuRuntime),
    ) -> Result<(), RankError> {
        self.verifying -= 1;
        let Loaded { keys, gpu, job: attempt } = v.loaded;
        match v.outcome {
            Outcome::Checked { verified, corrupted } => {
                rep.blocks_verified += verified;
                rep.blocks_corrupted += corrupted;
                if self.sweep {
                    rep.sweep_blocks += verified + corrupted;
                }
                self.mgr.complete_load(&keys)?;
                self.free_gpu.extend(gpu);
                Ok(())
            }
            Outcome::NotChecked(e) => {
                tracing::warn!(rank = self.rank, error = %e, "a loaded job could not be checked; it counts as a failed load");
                rep.jobs_failed += 1;
                if !self.sweep {
                    rearm(self.rt.as_ref());
                }
                self.load_failed(keys, gpu, attempt, rep)
            }
        }
    }
}
