//! `kvoffload bench transfer`: GB/s of scattered store and load jobs for
//! every backend and the automatic choice, at several fragment sizes, with
//! every destination byte checked after every run.
//!
//! Set-up: `total` bytes of device memory and an anonymous host mapping of
//! the same size, registered chunk by chunk through a [`Coordinator`]
//! (the gather kernel gets its aliases from it, as in production). For a
//! fragment size `s` the buffers are `total / s` blocks; one job moves every
//! block, GPU block ids and host block ids each in a random permutation
//! (fixed seed), so almost no two fragments merge. Each (size, direction,
//! backend) run is timed `repeats` times from `submit` to the return of
//! `wait` (host clock; the best counts), with the destination cleared
//! before and checked word by word after every repetition.

use std::fmt;
use std::mem::ManuallyDrop;
use std::time::Instant;

use kvoffload::pin::{pin_all, NoPrefault};
use kvoffload::protocol::{CapturePolicy, Coordinator, PinState};
use kvoffload::runtime::{DevicePtr, Direction, GpuRuntime, Stream};
use kvoffload::sync::Arc;

use kvoffload::transfer::{
    Backend, BackendChoice, GroupSpec, HostPlacement, JobBlocks, KvLayout, TensorSpec, TransferEngine, TransferOptions,
};

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
}

impl BenchConfig {
    /// Sizes from the issue: 16, 32, 64, 256 KiB and 2 MiB.
    pub fn default_sizes() -> Vec<usize> {
        vec![16 << 10, 32 << 10, 64 << 10, 256 << 10, 2 << 20]
    }

    /// Every backend and the automatic choice.
    pub fn all_choices() -> Vec<BackendChoice> {
        let mut v: Vec<BackendChoice> = Backend::ALL.into_iter().map(BackendChoice::Force).collect();
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
        }
    }

    /// Defaults for the simulated GPU: 8 MiB per run, so it ends in seconds.
    pub fn sim_default() -> Self {
        BenchConfig { total: 8 << 20, chunk_bytes: 2 << 20, ..Self::gpu_default() }
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
        if self.choices.is_empty() {
            return Err("no backend to run".into());
        }
        Ok(())
    }
}

/// One (size, direction, backend) run.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRow {
    /// Fragment size in bytes.
    pub size: usize,
    /// Store (`DeviceToHost`) or load (`HostToDevice`).
    pub direction: Direction,
    /// The backend asked for.
    pub choice: BackendChoice,
    /// The backend the engine used (a forced backend can fall back).
    pub used: Option<Backend>,
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
    fn new(size: usize, direction: Direction, choice: BackendChoice, other: Option<BackendChoice>) -> Self {
        BenchRow {
            size,
            direction,
            choice,
            used: None,
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
    /// in GB/s (for the targets of DESIGN.md), of the rows that ran alone
    /// (`concurrent` false) or of those that ran both ways at once.
    pub fn auto_min_gbps(&self, lo: usize, hi: usize, concurrent: bool) -> Option<f64> {
        self.rows
            .iter()
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

fn fill_blocks(words: &mut [u64], size: usize, blocks: usize) {
    let per = size / 8;
    for b in 0..blocks {
        for (k, w) in words[b * per..(b + 1) * per].iter_mut().enumerate() {
            *w = pattern(b, k);
        }
    }
}

/// Checks that block `dst[i]` of `words` holds the pattern of block `src[i]`.
fn check_blocks(words: &[u64], size: usize, src: &[usize], dst: &[usize]) -> Result<(), String> {
    let per = size / 8;
    for (&s, &d) in src.iter().zip(dst) {
        let got = &words[d * per..(d + 1) * per];
        if let Some(k) = (0..per).find(|&k| got[k] != pattern(s, k)) {
            return Err(format!("block {d} (from {s}) wrong at byte {}", k * 8));
        }
    }
    Ok(())
}

fn permutation(n: usize, seed: &mut u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        *seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
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
        // Touch every page (registration of touched pages is fast, FACTS 3).
        host.fill(0);
        let base = host.as_ptr() as usize;
        let chunks: Vec<(usize, usize)> = (0..cfg.total.div_ceil(cfg.chunk_bytes))
            .map(|i| (base + i * cfg.chunk_bytes, cfg.chunk_bytes.min(cfg.total - i * cfg.chunk_bytes)))
            .collect();
        // SAFETY: the chunks are pieces of `host`, a read-write anonymous
        // mapping; nothing registers them before `host` moves into the
        // `Buffers` below, which unmaps it only after every chunk was
        // unregistered again (see its `Drop`).
        let coord = unsafe { Coordinator::new(CapturePolicy::AfterPinning, &chunks, None) };
        let alloc = coord.unsafe_call("bench: allocating device memory", |g| rt.mem_alloc(g, cfg.total));
        let device = alloc
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("allocating {} of device memory: {e}", human(cfg.total)))?;
        let compute = match rt.stream_create() {
            Ok(s) => s,
            Err(e) => {
                match coord.unsafe_call("bench: freeing device memory", |g| rt.mem_free(g, device)) {
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
        if let Err(e) = self.coord.begin_shutdown() {
            tracing::warn!(error = %e, "bench: shutdown refused");
        }
        let unregistered = match self.coord.unregister_all(&*self.rt) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "bench: unregistering the host buffer failed; it stays mapped");
                false
            }
        };
        self.coord.finish_shutdown();
        if let Err(e) = self.rt.stream_destroy(self.compute) {
            tracing::warn!(error = %e, "bench: destroying the compute stream failed");
        }
        match self.coord.unsafe_call("bench: freeing device memory", |g| self.rt.mem_free(g, self.device)) {
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
    let pin = b.coord.pin_state();
    let mut choices = vec![BackendChoice::Force(Backend::PerFragment)];
    choices.extend(cfg.choices.iter().copied().filter(|c| *c != BackendChoice::Force(Backend::PerFragment)));
    let mut rows = Vec::new();
    let mut seed = cfg.seed;
    let mut next_id = 1u64;
    for &size in &cfg.sizes {
        let n = cfg.total / size;
        let gpu_ids = permutation(n, &mut seed);
        let host_ids = permutation(n, &mut seed);
        let job = JobBlocks::single(gpu_ids.clone(), host_ids.clone());
        let spec = GroupSpec {
            tensors: vec![TensorSpec { device_base: b.device, page_bytes: size }],
            num_gpu_blocks: n,
            num_host_blocks: n,
        };
        let layout = KvLayout::new(&[spec], 1, b.host.as_ptr() as usize, HostPlacement::TensorMajor)
            .map_err(|e| e.to_string())?;
        for dir in [Direction::HostToDevice, Direction::DeviceToHost] {
            let mut base_gbps = None;
            for &choice in &choices {
                progress(&format!("{} {} {}", human(size), dir_name(dir), choice));
                let opts = TransferOptions { backend: choice, ..cfg.options };
                // SAFETY: the buffers outlive the engine (dropped at the end
                // of this iteration) and the bench touches them only between
                // jobs, after waiting for them.
                let engine =
                    unsafe { TransferEngine::new(rt.clone(), b.coord.clone(), layout.clone(), b.compute, opts) }
                        .map_err(|e| e.to_string())?;
                let mut row = BenchRow::new(size, dir, choice, None);
                for _ in 0..cfg.repeats {
                    if let Err(e) = prepare(&mut b, dir, size, n) {
                        row.verified = false;
                        row.error = Some(e);
                        break;
                    }
                    let id = next_id;
                    next_id += 1;
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
                        Some(res) if res.succeeded() => verify(&mut b, dir, size, &gpu_ids, &host_ids),
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
            progress(&format!("{} both directions at once, load {} + store {}", human(size), pair.0, pair.1));
            rows.extend(both_ways(&mut b, cfg, &layout, size, pair, &gpu_ids, &host_ids, &mut next_id)?);
        }
    }
    Ok(BenchReport { device: rt.describe(), backend: rt.backend(), config: cfg.clone(), pin, rows })
}

/// A load of the first half of the blocks and a store of the second half,
/// submitted together, each on an engine of its own with its backend choice
/// of `pair` (load, store); each row's time runs from the common start to
/// its own job's completion, seen by polling.
#[allow(clippy::too_many_arguments)]
fn both_ways(
    b: &mut Buffers,
    cfg: &BenchConfig,
    layout: &KvLayout,
    size: usize,
    pair: (BackendChoice, BackendChoice),
    gpu_ids: &[usize],
    host_ids: &[usize],
    next_id: &mut u64,
) -> Result<[BenchRow; 2], String> {
    let half = gpu_ids.len() / 2;
    let load = JobBlocks::single(gpu_ids[..half].to_vec(), host_ids[..half].to_vec());
    let store = JobBlocks::single(gpu_ids[half..].to_vec(), host_ids[half..].to_vec());
    let make = |backend| {
        let opts = TransferOptions { backend, ..cfg.options };
        // SAFETY: the buffers outlive the engines (dropped at the end of
        // this function) and are touched only between jobs, after they
        // completed.
        unsafe { TransferEngine::new(b.rt.clone(), b.coord.clone(), layout.clone(), b.compute, opts) }
            .map_err(|e| e.to_string())
    };
    let engines = [make(pair.0)?, make(pair.1)?];
    let mut rows = [
        BenchRow::new(size, Direction::HostToDevice, pair.0, Some(pair.1)),
        BenchRow::new(size, Direction::DeviceToHost, pair.1, Some(pair.0)),
    ];
    let fail = |rows: &mut [BenchRow; 2], e: String| {
        for r in rows.iter_mut() {
            r.verified = false;
            r.error = Some(e.clone());
        }
    };
    for _ in 0..cfg.repeats {
        // Both sides hold every block's pattern: a load then puts host
        // block h's pattern into GPU block g, a store GPU block g's into
        // host block h, and the two halves never overlap.
        if let Err(e) = prepare(b, Direction::DeviceToHost, size, gpu_ids.len()) {
            fail(&mut rows, e);
            break;
        }
        fill_blocks(b.words(), size, gpu_ids.len());
        let ids = [*next_id, *next_id + 1];
        *next_id += 2;
        let t0 = Instant::now();
        let submitted = engines[0].load(ids[0], &load).and_then(|()| engines[1].store(ids[1], &store));
        let ds = t0.elapsed().as_secs_f64();
        if let Err(e) = submitted {
            fail(&mut rows, e.to_string());
            break;
        }
        let mut got: [Option<kvoffload::transfer::JobResult>; 2] = [None, None];
        while got.iter().any(Option::is_none) {
            for r in engines.iter().flat_map(|e| e.poll_finished()) {
                if let Some(i) = ids.iter().position(|&id| id == r.id) {
                    got[i] = Some(r);
                }
            }
            if t0.elapsed().as_secs() > 120 {
                break;
            }
            kvoffload::sync::thread::yield_now();
        }
        let mut ok = true;
        for (i, (row, res)) in rows.iter_mut().zip(&got).enumerate() {
            let checked = match res {
                Some(res) if res.succeeded() => {
                    row.used = Some(res.backend);
                    row.fragments = res.fragments;
                    row.bytes = res.bytes;
                    let (g, h) = if i == 0 {
                        (&gpu_ids[..half], &host_ids[..half])
                    } else {
                        (&gpu_ids[half..], &host_ids[half..])
                    };
                    verify(b, row.direction, size, g, h).map(|()| res.seconds)
                }
                Some(res) => Err(format!("job failed: {:?}", res.error)),
                None => Err("job not reported within 120 s".into()),
            };
            match checked {
                Ok(s) if s < row.best_seconds => {
                    row.best_seconds = s;
                    row.submit_seconds = ds;
                }
                Ok(_) => {}
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
                .unsafe_call("bench: clearing device memory", |g| rt.stream_synchronize(g, b.compute))
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
                .unsafe_call("bench: filling device memory", |g| rt.stream_synchronize(g, b.compute))
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
        Direction::HostToDevice => "store",
        Direction::DeviceToHost => "load",
    }
}

fn dir_name(d: Direction) -> &'static str {
    match d {
        Direction::HostToDevice => "load H2D",
        Direction::DeviceToHost => "store D2H",
    }
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
        writeln!(
            f,
            "auto: gather up to {} mean fragment size, batched above (per-fragment from {}), per-fragment on pageable memory or while capturing; gather table {} entries per launch",
            human(th.gather_max_bytes),
            if th.per_fragment_min_bytes == usize::MAX { "never".to_string() } else { human(th.per_fragment_min_bytes) },
            self.config.options.gather_table_entries
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
            "| fragment | direction | backend | used | fragments | GB/s | x per-fragment | submit ms | verified |"
        )?;
        writeln!(f, "|---:|---|---|---|---:|---:|---:|---:|---|")?;
        for r in &self.rows {
            let used = r.used.map_or("-".to_string(), |b| b.to_string());
            let ratio = r.ratio.map_or("-".to_string(), |x| format!("{x:.2}"));
            let verified =
                if r.verified { "yes".to_string() } else { format!("NO: {}", r.error.as_deref().unwrap_or("?")) };
            writeln!(
                f,
                "| {} | {} | {} | {} | {} | {:.1} | {} | {:.2} | {} |",
                human(r.size),
                match r.other {
                    Some(o) => format!("{}, {} {o} running", dir_name(r.direction), other_name(r.direction)),
                    None => dir_name(r.direction).to_string(),
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
        let small = self.auto_min_gbps(16 << 10, 64 << 10, false);
        let large = self.auto_min_gbps(2 << 20, usize::MAX, false);
        if let Some(g) = small {
            writeln!(f, "auto, 16-64 KiB fragments, slowest direction: {g:.1} GB/s (target >= 45)")?;
        }
        if let Some(g) = large {
            writeln!(f, "auto, >= 2 MiB fragments, slowest direction: {g:.1} GB/s (target >= 52)")?;
        }
        if let Some(g) = self.auto_min_gbps(16 << 10, 64 << 10, true) {
            writeln!(f, "auto, 16-64 KiB fragments, both directions at once, slowest: {g:.1} GB/s each way")?;
        }
        write!(f, "rows verified: {} of {}", self.rows.len() - self.failures(), self.rows.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvoffload::runtime::sim::SimRuntime;

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
        let mut s = 1;
        let mut p = permutation(1000, &mut s);
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
        // Per size: 2 directions x 4 choices alone, then a load and a store at
        // once where the size gives at least two blocks (not 2 MiB of 2 MiB).
        assert_eq!(r.rows.len(), 3 * 2 * 4 + 2 * 2);
        assert_eq!(labels, 3 * 2 * 4 + 2);
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
                && text.contains("both directions at once")
                && text.contains("rows verified: 28 of 28"),
            "{text}"
        );
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
