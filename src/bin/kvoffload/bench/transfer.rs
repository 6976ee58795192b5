//! `kvoffload bench transfer`: GB/s of scattered store and load jobs for
//! every backend and the automatic choice, at several fragment sizes, with
//! every destination byte checked after every run.
//!
//! Set-up: `total` bytes of device memory and an anonymous host mapping of
//! the same size, registered chunk by chunk through a [`Coordinator`]
//! (the gather kernel gets its aliases from it, as in production). For a
//! fragment size `s` and `L` layers ([`BenchConfig::layers`]) the device
//! buffer holds `L` tensors of `total / (s L)` pages of `s` bytes, and the
//! host buffer as many host blocks of `L` pages (one of each tensor, block
//! major: with `L = 1` every host page is scattered; with `L > 1` a host
//! block is one contiguous run, as the main job's host blocks hold every
//! layer's page). One job moves every block, GPU block ids and host block
//! ids each in a random permutation (fixed seed), so almost no two
//! fragments merge. Each (layers, size, direction, backend) run is timed
//! `repeats` times from `submit` to the return of `wait` (host clock; the
//! best counts), with the destination cleared before and checked word by
//! word after every repetition.

use kvoffload::Named;
use std::fmt;
use std::mem::ManuallyDrop;
use std::time::Instant;

use crate::random::SplitMix64;
use kvoffload::internal::pin::{pin_all, NoPrefault};
use kvoffload::internal::protocol::{CapturePolicy, Coordinator, PinState};
use kvoffload::internal::runtime::{DevicePtr, Direction, GpuRuntime, Stream};
use kvoffload::internal::sync::Arc;

use kvoffload::internal::transfer::{
    Backend, BackendChoice, GroupSpec, HostPlacement, JobBlocks, JobId, KvLayout, TensorSpec, TransferEngine,
    TransferOptions,
};
use kvoffload::Request;

/// What to run.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchConfig {
    /// Fragment sizes in bytes (multiples of 8).
    pub sizes: Vec<usize>,
    /// Bytes moved per run (and the size of each buffer).
    pub total: usize,
    /// Backends to compare; per-fragment is always run too, as the baseline.
    pub choices: Vec<BackendChoice>,
    /// Timed repetitions per run; the fastest counts.
    pub repeats: usize,
    /// Seed of the block permutations.
    pub seed: u64,
    /// Registration chunk size of the host buffer.
    pub chunk_bytes: usize,
    /// Engine options (thresholds of the automatic choice, gather table
    /// size); the backend choice in it is replaced by each of `choices`.
    pub options: TransferOptions,
    /// Also run, per size and per `(load, store)` pair of backends, a load
    /// and a store at the same time (half the blocks each, each direction on
    /// an engine of its own): what each direction gets while the other one
    /// is busy, as in an engine that offloads and reloads at once. Empty:
    /// none.
    pub both: Vec<(BackendChoice, BackendChoice)>,
    /// Pages of one host block (layers of a KV block), one run of the
    /// bench per entry: 1 scatters every host page; more make each host
    /// block one contiguous run of that many pages.
    pub layers: Vec<usize>,
    /// Bytes of each job when a load and a store run at once: each
    /// direction's half is submitted as jobs of about this size, loads and
    /// stores alternating, on one engine when both use the same backend
    /// choice (as an offloader does), so that the automatic choice sees the
    /// other direction busy.
    pub both_job_bytes: usize,
    /// Also run the per-fragment baseline (the `x per-fragment` column).
    pub baseline: bool,
}

impl BenchConfig {
    /// Sizes from the issue: 16, 32, 64, 256 KiB and 2 MiB.
    pub fn default_sizes() -> Vec<usize> {
        vec![16 << 10, 32 << 10, 64 << 10, 256 << 10, 2 << 20]
    }

    /// Every backend and the automatic choice.
    pub fn all_choices() -> Vec<BackendChoice> {
        let mut v: Vec<BackendChoice> = Backend::all().iter().copied().map(BackendChoice::Force).collect();
        v.push(BackendChoice::Auto);
        v
    }

    /// Defaults for a real GPU: 1 GiB per run.
    pub fn gpu_default() -> Self {
        BenchConfig {
            sizes: Self::default_sizes(),
            total: 1 << 30,
            choices: Self::all_choices(),
            repeats: 3,
            seed: 0x6b76_6f66_6c6f_6164,
            chunk_bytes: 256 << 20,
            options: TransferOptions::default(),
            both: vec![(BackendChoice::Auto, BackendChoice::Auto)],
            layers: vec![1],
            both_job_bytes: 16 << 20,
            baseline: true,
        }
    }

    /// Defaults for the simulated GPU: 8 MiB per run, so it ends in seconds.
    pub fn sim_default() -> Self {
        BenchConfig { total: 8 << 20, chunk_bytes: 2 << 20, both_job_bytes: 1 << 20, ..Self::gpu_default() }
    }

    /// Checks sizes and counts; the error names the value and the limit.
    pub fn validate(&self) -> Result<(), String> {
        if self.sizes.is_empty() {
            return Err("no fragment size given".into());
        }
        for &s in &self.sizes {
            if s == 0 || s % 8 != 0 {
                return Err(format!("fragment size {s} is not a positive multiple of 8 bytes"));
            }
            if s > self.total {
                return Err(format!("fragment size {} is larger than --total {}", human(s), human(self.total)));
            }
        }
        if self.total == 0 || self.total % 8 != 0 {
            return Err(format!("--total {} is not a positive multiple of 8 bytes", self.total));
        }
        if self.repeats == 0 {
            return Err("repeats must be at least 1".into());
        }
        if self.chunk_bytes == 0 || self.chunk_bytes % 4096 != 0 {
            return Err(format!("chunk size {} is not a positive multiple of 4096", self.chunk_bytes));
        }
        if self.options.gather_table_entries == 0 {
            return Err("the gather table needs at least 1 entry".into());
        }
        if self.choices.is_empty() && !self.baseline {
            return Err("no backend to run".into());
        }
        if self.layers.is_empty() || self.layers.contains(&0) {
            return Err("layers must be at least 1".into());
        }
        if self.both_job_bytes == 0 {
            return Err("the job size of the both-ways runs must be positive".into());
        }
        Ok(())
    }
}

/// One (size, direction, backend) run.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRow {
    /// Fragment size in bytes.
    pub size: usize,
    /// Pages of one host block (1: host pages scattered).
    pub layers: usize,
    /// Store (`DeviceToHost`) or load (`HostToDevice`).
    pub direction: Direction,
    /// The backend asked for (`auto` lets the engine choose per job).
    pub choice: BackendChoice,
    /// The backend the engine used (a forced backend can fall back); with
    /// several jobs, the one that moved the most of them.
    pub used: Option<Backend>,
    /// Jobs per backend used, when a run had several jobs that did not all
    /// use the same backend.
    pub mixed: Vec<(Backend, usize)>,
    /// Fragments of the job after merging.
    pub fragments: usize,
    /// Bytes per job.
    pub bytes: u64,
    /// Fastest repetition, seconds.
    pub best_seconds: f64,
    /// Seconds the `submit` call itself took in the fastest repetition (the
    /// host-side cost: expansion, checks, table encoding, enqueueing).
    pub submit_seconds: f64,
    /// Bytes / best seconds, in GB/s (10^9).
    pub gbps: f64,
    /// `gbps` over the per-fragment row of the same size and direction.
    pub ratio: Option<f64>,
    /// Every destination word was right after every repetition.
    pub verified: bool,
    /// Why a repetition failed, if one did.
    pub error: Option<String>,
    /// Ran at the same time as a job of the other direction ([`BenchConfig::both`]).
    pub concurrent: bool,
    /// The backend choice of that other job.
    pub other: Option<BackendChoice>,
}

impl BenchRow {
    /// A row not yet run: `other` is the backend choice of the job of the
    /// other direction running at the same time, if any.
    fn new(
        size: usize,
        layers: usize,
        direction: Direction,
        choice: BackendChoice,
        other: Option<BackendChoice>,
    ) -> Self {
        BenchRow {
            size,
            layers,
            direction,
            choice,
            used: None,
            mixed: Vec::new(),
            fragments: 0,
            bytes: 0,
            best_seconds: f64::INFINITY,
            submit_seconds: 0.0,
            gbps: 0.0,
            ratio: None,
            verified: true,
            error: None,
            concurrent: other.is_some(),
            other,
        }
    }
}

/// Everything a bench run measured.
#[derive(Clone, Debug)]
pub struct BenchReport {
    /// The runtime's own description of the device.
    pub device: String,
    /// `"sim"` or `"cuda"`.
    pub backend: &'static str,
    /// The configuration that ran.
    pub config: BenchConfig,
    /// Final pin state of the host buffer.
    pub pin: PinState,
    /// One row per (size, direction, backend).
    pub rows: Vec<BenchRow>,
}

impl BenchReport {
    /// Rows whose data was wrong or whose job failed.
    pub fn failures(&self) -> usize {
        self.rows.iter().filter(|r| !r.verified).count()
    }

    /// The slowest automatic-choice row among fragment sizes in `lo..=hi`,
    /// in GB/s (for the targets of docs/driver-rules.md, "Targets the
    /// benches print"), of the rows that ran alone
    /// (`concurrent` false) or of those that ran both ways at once, with
    /// host blocks of `layers` pages.
    pub fn auto_min_gbps(&self, layers: usize, lo: usize, hi: usize, concurrent: bool) -> Option<f64> {
        self.rows
            .iter()
            .filter(|r| r.layers == layers)
            .filter(|r| r.choice == BackendChoice::Auto && r.concurrent == concurrent && (lo..=hi).contains(&r.size))
            .filter(|r| !concurrent || r.other == Some(BackendChoice::Auto))
            .map(|r| r.gbps)
            .reduce(f64::min)
    }
}

pub use kvoffload::units::{fmt_bytes as human, parse_size};

/// The pattern word `k` of block `b` holds: distinct per block and position.
fn pattern(b: usize, k: usize) -> u64 {
    (b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (k as u64) ^ 0x5a5a_0000_0000_0000
}

/// Threads for filling and checking (a GiB at a time).
fn cpu_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(16)
}

fn fill_blocks(words: &mut [u64], size: usize, blocks: usize) {
    let per = size / 8;
    let words = &mut words[..blocks * per];
    let per_thread = blocks.div_ceil(cpu_threads()).max(1) * per;
    std::thread::scope(|sc| {
        for (i, part) in words.chunks_mut(per_thread).enumerate() {
            sc.spawn(move || {
                let first = i * per_thread / per;
                for (j, blk) in part.chunks_mut(per).enumerate() {
                    for (k, w) in blk.iter_mut().enumerate() {
                        *w = pattern(first + j, k);
                    }
                }
            });
        }
    });
}

/// Checks that block `dst[i]` of `words` holds the pattern of block `src[i]`.
fn check_blocks(words: &[u64], size: usize, src: &[usize], dst: &[usize]) -> Result<(), String> {
    let per = size / 8;
    let pairs: Vec<(usize, usize)> = src.iter().copied().zip(dst.iter().copied()).collect();
    let per_thread = pairs.len().div_ceil(cpu_threads()).max(1);
    let errors: Vec<String> = std::thread::scope(|sc| {
        let handles: Vec<_> = pairs
            .chunks(per_thread)
            .map(|part| {
                sc.spawn(move || {
                    for &(s, d) in part {
                        let got = &words[d * per..(d + 1) * per];
                        if let Some(k) = (0..per).find(|&k| got[k] != pattern(s, k)) {
                            return Some(format!("block {d} (from {s}) wrong at byte {}", k * 8));
                        }
                    }
                    None
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().unwrap_or_else(|_| Some("checker panicked".into()))).collect()
    });
    match errors.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Block ids of one run in units of `size` bytes: GPU block `gpu[i]` of
/// tensor `t` is unit `t n + gpu[i]` of the device buffer; its host page is
/// unit `host[i] layers + t` of the host buffer (block major).
fn units(gpu: &[usize], host: &[usize], layers: usize, n: usize) -> (Vec<usize>, Vec<usize>) {
    let mut d = Vec::with_capacity(gpu.len() * layers);
    let mut h = Vec::with_capacity(gpu.len() * layers);
    for t in 0..layers {
        for (&g, &hb) in gpu.iter().zip(host) {
            d.push(t * n + g);
            h.push(hb * layers + t);
        }
    }
    (d, h)
}

fn permutation(n: usize, rng: &mut SplitMix64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let z = rng.next_u64();
        v.swap(i, (z % (i as u64 + 1)) as usize);
    }
    v
}

/// Host and device buffers of the bench, released on drop.
struct Buffers {
    rt: Arc<dyn GpuRuntime>,
    coord: Arc<Coordinator>,
    /// Registered through `coord`; unmapped on drop only once every chunk
    /// is unregistered again (leaked otherwise).
    host: ManuallyDrop<memmap2::MmapMut>,
    scratch: Vec<u64>,
    device: DevicePtr,
    compute: Stream,
}

impl Buffers {
    fn new(rt: Arc<dyn GpuRuntime>, cfg: &BenchConfig) -> Result<Self, String> {
        let mut host = memmap2::MmapMut::map_anon(cfg.total)
            .map_err(|e| format!("mapping {} of host memory: {e}", human(cfg.total)))?;
        // Touch every page (registration of touched pages is fast:
        // docs/driver-rules.md, row "Registration of resident pages").
        host.fill(0);
        let base = host.as_ptr() as usize;
        let chunks: Vec<(usize, usize)> = (0..cfg.total.div_ceil(cfg.chunk_bytes))
            .map(|i| (base + i * cfg.chunk_bytes, cfg.chunk_bytes.min(cfg.total - i * cfg.chunk_bytes)))
            .collect();
        // SAFETY: the chunks are pieces of `host`, a read-write anonymous
        // mapping; nothing registers them before `host` moves into the
        // `Buffers` below, which unmaps it only after every chunk was
        // unregistered again (see its `Drop`).
        let coord = unsafe { Coordinator::new(rt.as_ref(), CapturePolicy::AfterPinning, &chunks, None) }
            .map_err(|e| format!("the bench's coordinator: {e}"))?;
        let alloc =
            coord.unsafe_call("bench: allocating device memory", Request::new(), |g| rt.mem_alloc(g, cfg.total));
        let device = alloc
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("allocating {} of device memory: {e}", human(cfg.total)))?;
        let compute = match rt.stream_create() {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: no job is in flight (the engine is gone or was never made); the memory is not used again.
                match coord
                    .unsafe_call("bench: freeing device memory", Request::new(), |g| unsafe { rt.mem_free(g, device) })
                {
                    Ok(Ok(())) => {}
                    Ok(Err(f)) => {
                        tracing::warn!(error = %f, "bench: freeing device memory after a failed set-up failed")
                    }
                    Err(f) => tracing::warn!(error = %f, "bench: freeing device memory after a failed set-up failed"),
                }
                return Err(e.to_string());
            }
        };
        let host = ManuallyDrop::new(host);
        let b = Buffers { rt, coord, host, scratch: vec![0u64; cfg.total / 8], device, compute };
        let pin = pin_all(&*b.rt, &b.coord, &NoPrefault);
        if pin != PinState::Pinned {
            tracing::warn!(?pin, "bench: host buffer not pinned; gather and batched rows fall back");
        }
        Ok(b)
    }

    fn words(&mut self) -> &mut [u64] {
        let len = self.host.len() / 8;
        // SAFETY: the mapping is page-aligned, `len * 8` bytes long, and no
        // job is in flight while the bench touches it (every job is waited
        // for first); u64 has no invalid bit patterns.
        unsafe { std::slice::from_raw_parts_mut(self.host.as_mut_ptr() as *mut u64, len) }
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        if let Err(e) = self.coord.shutdown_steps().begin() {
            tracing::warn!(error = %e, "bench: shutdown refused");
        }
        let unregistered = match self.coord.pinning().unregister_all(&*self.rt) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "bench: unregistering the host buffer failed; it stays mapped");
                false
            }
        };
        if let Err(e) = self.rt.stream_destroy(self.compute) {
            tracing::warn!(error = %e, "bench: destroying the compute stream failed");
        }
        // SAFETY: no job is in flight (the engine is gone or was never made); the memory is not used again.
        match self.coord.unsafe_call("bench: freeing device memory", Request::new(), |g| unsafe {
            self.rt.mem_free(g, self.device)
        }) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "bench: freeing device memory failed"),
            Err(e) => tracing::warn!(error = %e, "bench: freeing device memory failed"),
        }
        if unregistered {
            // SAFETY: no chunk of `host` is registered any more (the
            // coordinator is shut down: it registers nothing again), and
            // `host` is not used after this.
            unsafe { ManuallyDrop::drop(&mut self.host) };
        }
    }
}

/// Runs the bench on `rt`; `progress` hears each run's label before it starts.
pub fn run_bench(
    rt: Arc<dyn GpuRuntime>,
    cfg: &BenchConfig,
    mut progress: impl FnMut(&str),
) -> Result<BenchReport, String> {
    cfg.validate()?;
    let mut b = Buffers::new(rt.clone(), cfg)?;
    let pin = b.coord.pinning().state();
    let mut choices = Vec::new();
    if cfg.baseline {
        choices.push(BackendChoice::Force(Backend::PerFragment));
    }
    choices.extend(cfg.choices.iter().copied().filter(|c| *c != BackendChoice::Force(Backend::PerFragment)));
    let mut rows = Vec::new();
    let mut rng = SplitMix64::new(cfg.seed);
    let mut next_id = JobId(1);
    for &layers in &cfg.layers {
        for &size in &cfg.sizes {
            let n = cfg.total / (size * layers);
            if n == 0 {
                continue;
            }
            let gpu_ids = permutation(n, &mut rng);
            let host_ids = permutation(n, &mut rng);
            let job = JobBlocks::single(gpu_ids.clone(), host_ids.clone());
            let (dev_units, host_units) = units(&gpu_ids, &host_ids, layers, n);
            let spec = GroupSpec {
                tensors: (0..layers)
                    .map(|t| TensorSpec { device_base: b.device.offset(t * n * size), page_bytes: size })
                    .collect(),
                num_gpu_blocks: n,
                num_host_blocks: n,
            };
            let placement = if layers == 1 { HostPlacement::TensorMajor } else { HostPlacement::BlockMajor };
            let layout = KvLayout::new(&[spec], 1, b.host.as_ptr() as usize, placement).map_err(|e| e.to_string())?;
            let units_total = cfg.total / size;
            for dir in [Direction::HostToDevice, Direction::DeviceToHost] {
                let mut base_gbps = None;
                for &choice in &choices {
                    progress(&format!("{} x {layers} {} {}", human(size), dir_name(dir), choice));
                    let opts = TransferOptions { backend: choice, ..cfg.options };
                    // SAFETY: the buffers outlive the engine (dropped at the
                    // end of this iteration) and the bench touches them only
                    // between jobs, after waiting for them.
                    let engine =
                        unsafe { TransferEngine::new(rt.clone(), b.coord.clone(), layout.clone(), b.compute, opts) }
                            .map_err(|e| e.to_string())?;
                    let mut row = BenchRow::new(size, layers, dir, choice, None);
                    for _ in 0..cfg.repeats {
                        if let Err(e) = prepare(&mut b, dir, size, units_total) {
                            row.verified = false;
                            row.error = Some(e);
                            break;
                        }
                        let id = next_id;
                        next_id = JobId(next_id.0 + 1);
                        let t0 = Instant::now();
                        let submitted = engine.submit(id, dir, &job);
                        let ds = t0.elapsed().as_secs_f64();
                        let r = submitted.and_then(|()| engine.wait(id));
                        let dt = t0.elapsed().as_secs_f64();
                        let results = engine.poll_finished();
                        let res = results.iter().find(|r| r.id == id);
                        if let Some(res) = res {
                            row.used = Some(res.backend);
                            row.fragments = res.fragments;
                            row.bytes = res.bytes;
                        }
                        let checked = r.map_err(|e| e.to_string()).and_then(|()| match res {
                            Some(res) if res.succeeded() => verify(&mut b, dir, size, &dev_units, &host_units),
                            Some(res) => Err(format!("job failed: {:?}", res.error)),
                            None => Err("job not reported after wait".into()),
                        });
                        if let Err(e) = checked {
                            row.verified = false;
                            row.error = Some(e);
                            break;
                        }
                        if dt < row.best_seconds {
                            row.best_seconds = dt;
                            row.submit_seconds = ds;
                        }
                    }
                    drop(engine);
                    if row.verified && row.best_seconds > 0.0 {
                        row.gbps = row.bytes as f64 / row.best_seconds / 1e9;
                    }
                    if choice == BackendChoice::Force(Backend::PerFragment) && row.verified {
                        base_gbps = Some(row.gbps);
                    }
                    row.ratio = base_gbps.filter(|g| *g > 0.0 && row.verified).map(|g| row.gbps / g);
                    rows.push(row);
                }
            }
            for &pair in cfg.both.iter().filter(|_| n >= 2) {
                progress(&format!(
                    "{} x {layers} both directions at once, load {} + store {}",
                    human(size),
                    pair.0,
                    pair.1
                ));
                let run = Run { size, layers, n, gpu_ids: &gpu_ids, host_ids: &host_ids, units_total };
                rows.extend(both_ways(&mut b, cfg, &layout, &run, pair, &mut next_id)?);
            }
        }
    }
    Ok(BenchReport { device: rt.describe(), backend: rt.backend(), config: cfg.clone(), pin, rows })
}

/// What one (layers, size) run moves.
struct Run<'a> {
    size: usize,
    layers: usize,
    /// Blocks (GPU and host) of the run.
    n: usize,
    gpu_ids: &'a [usize],
    host_ids: &'a [usize],
    /// Units of `size` bytes in each buffer.
    units_total: usize,
}

/// A load of the first half of the blocks and a store of the second half,
/// submitted together as jobs of about [`BenchConfig::both_job_bytes`] each,
/// loads and stores alternating, with the backend choices of `pair` (load,
/// store): on one engine when the two are the same (as in an offloader: the
/// automatic choice then sees the other direction busy), else each
/// direction on an engine of its own. Each row's time runs from the common
/// start to the moment its direction's last job was seen complete by
/// polling.
fn both_ways(
    b: &mut Buffers,
    cfg: &BenchConfig,
    layout: &KvLayout,
    run: &Run<'_>,
    pair: (BackendChoice, BackendChoice),
    next_id: &mut JobId,
) -> Result<[BenchRow; 2], String> {
    let (size, layers) = (run.size, run.layers);
    let half = run.n / 2;
    let per_job = (cfg.both_job_bytes / (size * layers)).max(1);
    // Per direction (0 load, 1 store): its jobs' block ranges.
    let ranges: [Vec<std::ops::Range<usize>>; 2] = [
        (0..half).step_by(per_job).map(|s| s..(s + per_job).min(half)).collect(),
        (half..run.n).step_by(per_job).map(|s| s..(s + per_job).min(run.n)).collect(),
    ];
    let job = |r: &std::ops::Range<usize>| {
        JobBlocks::single(run.gpu_ids[r.clone()].to_vec(), run.host_ids[r.clone()].to_vec())
    };
    let jobs: [Vec<JobBlocks>; 2] = [ranges[0].iter().map(job).collect(), ranges[1].iter().map(job).collect()];
    let make = |backend| {
        let opts = TransferOptions { backend, ..cfg.options };
        // SAFETY: the buffers outlive the engines (dropped at the end of
        // this function) and are touched only between jobs, after they
        // completed.
        unsafe { TransferEngine::new(b.rt.clone(), b.coord.clone(), layout.clone(), b.compute, opts) }
            .map_err(|e| e.to_string())
    };
    let engines: Vec<TransferEngine> =
        if pair.0 == pair.1 { vec![make(pair.0)?] } else { vec![make(pair.0)?, make(pair.1)?] };
    let engine_of = |d: usize| &engines[d.min(engines.len() - 1)];
    let mut rows = [
        BenchRow::new(size, layers, Direction::HostToDevice, pair.0, Some(pair.1)),
        BenchRow::new(size, layers, Direction::DeviceToHost, pair.1, Some(pair.0)),
    ];
    let fail = |rows: &mut [BenchRow; 2], e: String| {
        for r in rows.iter_mut() {
            r.verified = false;
            r.error = Some(e.clone());
        }
    };
    let (load_dev, load_host) = units(&run.gpu_ids[..half], &run.host_ids[..half], layers, run.n);
    let (store_dev, store_host) = units(&run.gpu_ids[half..], &run.host_ids[half..], layers, run.n);
    for _ in 0..cfg.repeats {
        // Both sides hold every unit's pattern: a load then puts host unit
        // h's pattern into device unit d, a store device unit d's into host
        // unit h, and the two halves never overlap.
        if let Err(e) = prepare(b, Direction::DeviceToHost, size, run.units_total) {
            fail(&mut rows, e);
            break;
        }
        fill_blocks(b.words(), size, run.units_total);
        // (direction, job index) of each id, in submission order.
        let mut ids: Vec<(JobId, usize)> = Vec::new();
        let t0 = Instant::now();
        let mut submitted = Ok(());
        for k in 0..jobs[0].len().max(jobs[1].len()) {
            for (d, list) in jobs.iter().enumerate() {
                if let Some(j) = list.get(k) {
                    let id = *next_id;
                    *next_id = JobId(next_id.0 + 1);
                    let dir = if d == 0 { Direction::HostToDevice } else { Direction::DeviceToHost };
                    submitted = submitted.and_then(|()| engine_of(d).submit(id, dir, j));
                    ids.push((id, d));
                }
            }
        }
        let ds = t0.elapsed().as_secs_f64();
        if let Err(e) = submitted {
            // Whatever was accepted must finish before the buffers are reused.
            for e in &engines {
                let _ = e.wait_all();
                let _ = e.poll_finished();
            }
            fail(&mut rows, e.to_string());
            break;
        }
        let mut left = [jobs[0].len(), jobs[1].len()];
        let mut done_at = [0.0f64; 2];
        let mut frags = [0usize; 2];
        let mut bytes = [0u64; 2];
        let mut used: [Vec<(Backend, usize)>; 2] = [Vec::new(), Vec::new()];
        let mut error: Option<String> = None;
        while left.iter().any(|&l| l > 0) {
            for r in engines.iter().flat_map(|e| e.poll_finished()) {
                let Some(&(_, d)) = ids.iter().find(|(id, _)| *id == r.id) else { continue };
                left[d] -= 1;
                if left[d] == 0 {
                    done_at[d] = t0.elapsed().as_secs_f64();
                }
                frags[d] += r.fragments;
                bytes[d] += r.bytes;
                match used[d].iter_mut().find(|(b, _)| *b == r.backend) {
                    Some(u) => u.1 += 1,
                    None => used[d].push((r.backend, 1)),
                }
                if !r.succeeded() {
                    error.get_or_insert(format!("job {} failed: {:?}", r.id, r.error));
                }
            }
            if t0.elapsed().as_secs() > 120 {
                error.get_or_insert("jobs not reported within 120 s".into());
                break;
            }
            kvoffload::internal::sync::thread::yield_now();
        }
        if let Some(e) = error {
            fail(&mut rows, e);
            break;
        }
        let mut ok = true;
        for (d, row) in rows.iter_mut().enumerate() {
            used[d].sort_by_key(|u| std::cmp::Reverse(u.1));
            row.used = used[d].first().map(|u| u.0);
            row.mixed = if used[d].len() > 1 { used[d].clone() } else { Vec::new() };
            row.fragments = frags[d];
            row.bytes = bytes[d];
            let checked = if d == 0 {
                verify(b, row.direction, size, &load_dev, &load_host)
            } else {
                verify(b, row.direction, size, &store_dev, &store_host)
            };
            match checked {
                Ok(()) if done_at[d] < row.best_seconds => {
                    row.best_seconds = done_at[d];
                    row.submit_seconds = ds;
                }
                Ok(()) => {}
                Err(e) => {
                    row.verified = false;
                    row.error = Some(e);
                    ok = false;
                }
            }
        }
        if !ok {
            break;
        }
    }
    for r in rows.iter_mut() {
        if r.verified && r.best_seconds > 0.0 && r.best_seconds.is_finite() {
            r.gbps = r.bytes as f64 / r.best_seconds / 1e9;
        }
    }
    Ok(rows)
}

/// Puts the source pattern in place and clears the destination.
fn prepare(b: &mut Buffers, dir: Direction, size: usize, n: usize) -> Result<(), String> {
    let rt = b.rt.clone();
    let total = b.host.len();
    match dir {
        Direction::HostToDevice => {
            fill_blocks(b.words(), size, n);
            // SAFETY: `device` is the bench's allocation of `total` bytes, no
            // job is in flight (each is waited for), and the stream is
            // synchronized just below, before anything reads it.
            unsafe { rt.memset_d8_async(b.device, 0, total, b.compute) }.map_err(|e| e.to_string())?;
            b.coord
                .unsafe_call("bench: clearing device memory", Request::new(), |g| rt.stream_synchronize(g, b.compute))
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())
        }
        Direction::DeviceToHost => {
            fill_blocks(&mut b.scratch, size, n);
            // On the compute stream, then synchronized: a synchronous
            // cuMemcpyHtoD from pageable memory may return before its DMA
            // lands, and the engine's streams do not wait for the legacy
            // default stream.
            // SAFETY: `scratch` is `total` bytes, readable, and untouched
            // until the stream is synchronized below.
            unsafe { rt.copy_htod_async(b.device, b.scratch.as_ptr() as usize, total, b.compute) }
                .map_err(|e| e.to_string())?;
            b.coord
                .unsafe_call("bench: filling device memory", Request::new(), |g| rt.stream_synchronize(g, b.compute))
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            b.words().fill(0);
            Ok(())
        }
    }
}

/// Checks every destination block of a run.
fn verify(b: &mut Buffers, dir: Direction, size: usize, gpu: &[usize], host: &[usize]) -> Result<(), String> {
    match dir {
        Direction::DeviceToHost => check_blocks(b.words(), size, gpu, host),
        Direction::HostToDevice => {
            let total = b.host.len();
            let dst = b.scratch.as_mut_ptr() as usize;
            // SAFETY: `scratch` is `total` bytes, writable, not otherwise used.
            unsafe { b.rt.copy_dtoh(dst, b.device, total) }.map_err(|e| e.to_string())?;
            check_blocks(&b.scratch, size, host, gpu)
        }
    }
}

/// The other direction's job, in words.
fn other_name(d: Direction) -> &'static str {
    match d {
        Direction::HostToDevice => Direction::DeviceToHost.name(),
        Direction::DeviceToHost => Direction::HostToDevice.name(),
    }
}

/// The direction's job and its copies: `load H2D`, `store D2H`.
fn dir_name(d: Direction) -> String {
    let copies = match d {
        Direction::HostToDevice => "H2D",
        Direction::DeviceToHost => "D2H",
    };
    format!("{} {copies}", d.name())
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "kvoffload bench transfer")?;
        writeln!(f, "device: {} (runtime: {})", self.device, self.backend)?;
        writeln!(
            f,
            "per run: {} moved in one job of scattered fragments (random permutations of block ids on both sides), best of {}, host clock from submit to wait; host buffer {:?} in {} chunks",
            human(self.config.total),
            self.config.repeats,
            self.pin,
            human(self.config.chunk_bytes)
        )?;
        let th = self.config.options.thresholds;
        let never = |b: usize| if b == usize::MAX { "never".to_string() } else { human(b) };
        writeln!(
            f,
            "auto: gather up to {} mean fragment size, batched above (per-fragment from {}), per-fragment on pageable memory or while capturing; gather table {} entries per launch",
            human(th.gather_max_bytes),
            never(th.per_fragment_min_bytes),
            self.config.options.gather_table_entries
        )?;
        writeln!(
            f,
            "auto, staged (gather kernel into {} of device staging, batched copies of the host runs): where gather would be chosen, for mean host runs from {} while the other direction has jobs in flight or had within {:?}, from {} otherwise",
            human(self.config.options.staging_bytes),
            never(th.staged_duplex_min_run_bytes),
            th.duplex_linger,
            never(th.staged_min_run_bytes)
        )?;
        writeln!(
            f,
            "both ways at once: jobs of about {} a direction, loads and stores alternating, on one engine when both directions have the same backend choice; a direction's time runs from the common start to its last job seen complete",
            human(self.config.both_job_bytes)
        )?;
        if self.backend == "sim" {
            writeln!(
                f,
                "NOTE: simulated GPU: the GB/s below are meaningless; only the verification column means something."
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "| fragment | host run | direction | backend | used | fragments | GB/s | x per-fragment | submit ms | verified |"
        )?;
        writeln!(f, "|---:|---:|---|---|---|---:|---:|---:|---:|---|")?;
        for r in &self.rows {
            let used = if r.mixed.is_empty() {
                r.used.map_or("-".to_string(), |b| b.to_string())
            } else {
                let jobs: Vec<String> = r.mixed.iter().map(|(b, n)| format!("{b} {n}")).collect();
                format!("{} jobs", jobs.join(", "))
            };
            let run = if r.layers == 1 { "page".to_string() } else { human(r.size * r.layers) };
            let ratio = r.ratio.map_or("-".to_string(), |x| format!("{x:.2}"));
            let verified =
                if r.verified { "yes".to_string() } else { format!("NO: {}", r.error.as_deref().unwrap_or("?")) };
            writeln!(
                f,
                "| {} | {} | {} | {} | {} | {} | {:.1} | {} | {:.2} | {} |",
                human(r.size),
                run,
                match r.other {
                    Some(o) => format!("{}, {} {o} running", dir_name(r.direction), other_name(r.direction)),
                    None => dir_name(r.direction),
                },
                r.choice,
                used,
                r.fragments,
                r.gbps,
                ratio,
                r.submit_seconds * 1e3,
                verified
            )?;
        }
        writeln!(f)?;
        let mut layers: Vec<usize> = self.rows.iter().map(|r| r.layers).collect();
        layers.dedup();
        for l in layers {
            let what = if l == 1 { "host pages scattered".to_string() } else { format!("host blocks of {l} pages") };
            if let Some(g) = self.auto_min_gbps(l, 16 << 10, 64 << 10, false) {
                writeln!(
                    f,
                    "{what}: auto, 16-64 KiB fragments, one direction alone, slowest: {g:.1} GB/s (target >= 48)"
                )?;
            }
            if let Some(g) = self.auto_min_gbps(l, 16 << 10, 64 << 10, true) {
                writeln!(f, "{what}: auto, 16-64 KiB fragments, a load and a store at once, slowest direction: {g:.1} GB/s (target >= 45)")?;
            }
            if let Some(g) = self.auto_min_gbps(l, 2 << 20, usize::MAX, false) {
                writeln!(
                    f,
                    "{what}: auto, >= 2 MiB fragments, one direction alone, slowest: {g:.1} GB/s (target >= 52)"
                )?;
            }
            if let Some(g) = self.auto_min_gbps(l, 2 << 20, usize::MAX, true) {
                writeln!(f, "{what}: auto, >= 2 MiB fragments, both at once (the link's duplex limit), slowest direction: {g:.1} GB/s")?;
            }
        }
        write!(f, "rows verified: {} of {}", self.rows.len() - self.failures(), self.rows.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvoffload::internal::runtime::sim::SimRuntime;

    #[test]
    fn sizes_format() {
        assert_eq!(human(256 << 10), "256 KiB");
        assert_eq!(human(100), "100 B");
    }

    #[test]
    fn check_finds_a_wrong_word() {
        let mut w = vec![0u64; 4 * 4];
        fill_blocks(&mut w, 32, 4);
        assert_eq!(check_blocks(&w, 32, &[0, 1, 2, 3], &[0, 1, 2, 3]), Ok(()));
        assert!(check_blocks(&w, 32, &[1, 0], &[0, 1]).is_err());
        // Word 9 is the second word of block 2.
        w[9] ^= 1;
        assert!(check_blocks(&w, 32, &[3, 1], &[3, 1]).is_ok());
        assert_eq!(check_blocks(&w, 32, &[1, 2], &[1, 2]), Err("block 2 (from 2) wrong at byte 8".into()));
    }

    #[test]
    fn permutations_are_permutations() {
        let mut p = permutation(1000, &mut SplitMix64::new(1));
        p.sort_unstable();
        assert_eq!(p, (0..1000).collect::<Vec<_>>());
    }

    // `kvoffload bench transfer` on the simulated GPU: every row runs and
    // verifies, and the report names the targets (was tests/transfer_bench.rs).

    #[test]
    fn sim_bench_verifies_every_row() {
        let rt: Arc<dyn GpuRuntime> = Arc::new(SimRuntime::new());
        let cfg = BenchConfig {
            total: 2 << 20,
            sizes: vec![16 << 10, 256 << 10, 2 << 20],
            repeats: 2,
            chunk_bytes: 1 << 20,
            ..BenchConfig::sim_default()
        };
        let mut labels = 0;
        let r = run_bench(rt, &cfg, |_| labels += 1).unwrap();
        // Per size: 2 directions x 5 choices alone, then a load and a store at
        // once where the size gives at least two blocks (not 2 MiB of 2 MiB).
        assert_eq!(r.rows.len(), 3 * 2 * 5 + 2 * 2);
        assert_eq!(labels, 3 * 2 * 5 + 2);
        assert_eq!(r.failures(), 0, "{r}");
        for row in &r.rows {
            if let BackendChoice::Force(b) = row.choice {
                assert_eq!(row.used, Some(b), "{row:?}");
            }
            assert_eq!(row.ratio.is_some(), !row.concurrent, "{row:?}");
            assert!(row.bytes > 0, "{row:?}");
        }
        assert_eq!(r.rows.iter().filter(|x| x.concurrent).count(), 4);
        // Auto: gather for small fragments, batched at 2 MiB (pinned, not capturing).
        let auto = |size| {
            r.rows.iter().find(|x| x.choice == BackendChoice::Auto && !x.concurrent && x.size == size).unwrap().used
        };
        assert_eq!(auto(16 << 10), Some(Backend::Gather));
        assert_eq!(auto(2 << 20), Some(Backend::Batched));
        let text = r.to_string();
        assert!(
            text.contains("meaningless")
                && text.contains("target >= 45")
                && text.contains("a load and a store at once")
                && text.contains("rows verified: 34 of 34"),
            "{text}"
        );
    }

    /// Host blocks of several layers: the both-ways runs go in several jobs
    /// on one engine, and auto stages every job that sees the other
    /// direction busy (all but the first load); every byte verified.
    #[test]
    fn sim_bench_layers_both_ways_stage_when_busy() {
        let rt: Arc<dyn GpuRuntime> = Arc::new(SimRuntime::new());
        let cfg = BenchConfig {
            total: 4 << 20,
            sizes: vec![64 << 10],
            layers: vec![1, 8],
            repeats: 1,
            chunk_bytes: 1 << 20,
            choices: vec![BackendChoice::Auto, BackendChoice::Force(Backend::Staged)],
            both: vec![
                (BackendChoice::Auto, BackendChoice::Auto),
                (BackendChoice::Force(Backend::Staged), BackendChoice::Force(Backend::Staged)),
            ],
            baseline: false,
            both_job_bytes: 512 << 10,
            ..BenchConfig::sim_default()
        };
        let r = run_bench(rt, &cfg, |_| {}).unwrap();
        assert_eq!(r.failures(), 0, "{r}");
        assert_eq!(r.rows.len(), 2 * (2 * 2 + 2 * 2));
        let both_auto = |layers, dir| {
            r.rows
                .iter()
                .find(|x| x.layers == layers && x.concurrent && x.choice == BackendChoice::Auto && x.direction == dir)
                .unwrap()
        };
        // Scattered host pages: the gather kernel both ways.
        assert_eq!(both_auto(1, Direction::DeviceToHost).used, Some(Backend::Gather));
        // 512 KiB host runs: stores all staged (a load is always in flight
        // first), loads staged but the first.
        let store = both_auto(8, Direction::DeviceToHost);
        assert_eq!((store.used, store.mixed.is_empty()), (Some(Backend::Staged), true), "{store:?}");
        let load = both_auto(8, Direction::HostToDevice);
        assert_eq!(load.mixed, vec![(Backend::Staged, 3), (Backend::Gather, 1)], "{load:?}");
        assert!(r.to_string().contains("| 64 KiB | 512 KiB | store D2H, load auto running | auto | staged |"), "{r}");
    }

    #[test]
    fn bad_config_is_refused() {
        let rt: Arc<dyn GpuRuntime> = Arc::new(SimRuntime::new());
        let cfg = BenchConfig { sizes: vec![12], ..BenchConfig::sim_default() };
        assert!(run_bench(rt.clone(), &cfg, |_| {}).unwrap_err().contains("multiple of 8"));
        let cfg = BenchConfig { sizes: vec![4 << 20], total: 1 << 20, ..BenchConfig::sim_default() };
        assert!(run_bench(rt, &cfg, |_| {}).unwrap_err().contains("larger than --total"));
    }
}
