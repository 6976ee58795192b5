//! `kvoffload bench pin`: pinning speed of the upstream path against ours,
//! in one run, each measurement on fresh untouched anonymous memory.
//!
//! - (a) one `host_register` call over the whole untouched region (what
//!   vLLM does; 2.2 - 3.2 GB/s on the H200, docs/driver-rules.md, row "One
//!   registration of untouched pages");
//! - (b) our pipeline with its defaults ([`PinOptions::default`]): huge-page
//!   advice, parallel pre-faulting, chunked registration with the next chunk
//!   faulted while the current one registers; timed end to end from the
//!   fresh mapping to `Pinned`, set-up included;
//! - (c) a sweep: thread counts x huge pages on/off, other chunk bounds,
//!   page touching instead of `MADV_POPULATE_WRITE`, and the pipeline with
//!   its overlap turned off (which also splits the time into faulting and
//!   registering).
//!
//! Every run maps its own region, unregisters after measuring (timed
//! separately) and unmaps. GB/s are 1e9 bytes per second. The library part
//! runs on any [`GpuRuntime`]; with the simulated GPU registration is
//! instant, so only the host-side work is measured (the report says so).

use kvoffload::Named;
use std::fmt;
use std::time::{Duration, Instant};

/// `bench pin --sizes`: several sizes, each with its first touch apart,
/// rounds of baseline, defaults and stage split, median and spread.
#[path = "pin_sizes.rs"]
pub mod sizes;

use kvoffload::internal::protocol::{CapturePolicy, Coordinator, PinState};
use kvoffload::internal::region::{page_size, AnonOptions, Layout, Region};
use kvoffload::internal::runtime::GpuRuntime;
use kvoffload::internal::sync::{self, Arc, Mutex};

use kvoffload::internal::pin::memlock;
use kvoffload::internal::pin::Prepared;
use kvoffload::internal::pin::{available_cores, HugePages, PinOptions, PrefaultMode, DEFAULT_MAX_CHUNK_BYTES};
use kvoffload::internal::pin::{pin_all, Prefault};
use kvoffload::internal::pin::{thp_setting, HUGE_PAGE_BYTES};
use kvoffload::Request;

/// What to measure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchConfig {
    /// Bytes per run (a multiple of the page size).
    pub size: usize,
    /// Pre-fault threads of the pipeline runs other than the sweep's
    /// (default: the available cores, as [`PinOptions::default`]).
    pub threads: usize,
    /// Chunk bound of (b) and of the thread sweep (default [`DEFAULT_MAX_CHUNK_BYTES`]).
    pub chunk: usize,
    /// [`PinOptions::lookahead_bytes`] of (b) (default: the library's).
    pub lookahead: usize,
    /// [`PinOptions::huge_fallback_mbps`] of (b) (default: the library's).
    pub fallback_mbps: u32,
    /// [`PinOptions::prefault_nice`] of (b) (default: the library's).
    pub nice: i32,
    /// Thread counts of the sweep (default 1, 4 and the available cores).
    pub threads_sweep: Vec<usize>,
    /// Other chunk bounds to try with the default threads (default 256 MiB,
    /// 1 GiB, 4 GiB; bounds that give the same chunks as (b) are skipped).
    pub chunk_sweep: Vec<usize>,
    /// Skip the sweep (c).
    pub quick: bool,
    /// Runs of (a) and (b) each (the ratio uses their medians).
    pub repeat: usize,
    /// Before measuring, map, pre-fault and unmap `size` bytes once, so
    /// that no measured run pays for memory the machine uses for the first
    /// time (in a virtual machine the host backs guest memory on first
    /// touch, which would penalise whichever run comes first).
    pub warmup: bool,
}

impl BenchConfig {
    /// The defaults for `size` bytes.
    pub fn new(size: usize) -> Self {
        let cores = available_cores();
        let mut sweep = vec![1, 4, cores];
        sweep.sort_unstable();
        sweep.dedup();
        BenchConfig {
            size,
            threads: PinOptions::default().threads,
            chunk: DEFAULT_MAX_CHUNK_BYTES,
            lookahead: PinOptions::default().lookahead_bytes,
            fallback_mbps: PinOptions::default().huge_fallback_mbps,
            nice: PinOptions::default().prefault_nice,
            threads_sweep: sweep,
            chunk_sweep: vec![256 << 20, 1 << 30, 4 << 30],
            quick: false,
            repeat: 1,
            warmup: true,
        }
    }

    /// Checks the values (size a positive multiple of the page size, chunk
    /// bounds and thread counts within the limits of [`PinOptions`]).
    pub fn validate(&self) -> Result<(), String> {
        let page = page_size();
        if self.size == 0 {
            return Err("--size is zero; it must be at least one page".into());
        }
        if self.size % page != 0 {
            return Err(format!("--size {} is not a multiple of the page size {page}", self.size));
        }
        if self.repeat == 0 {
            return Err("--repeat is zero; it must be at least 1".into());
        }
        for &c in std::iter::once(&self.chunk).chain(&self.chunk_sweep) {
            PinOptions::default().max_chunk_bytes(c).validate().map_err(|e| format!("chunk {}: {e}", fmt_bytes(c)))?;
            if c < page {
                return Err(format!("chunk {c} is below the page size {page}"));
            }
        }
        for &t in std::iter::once(&self.threads).chain(&self.threads_sweep) {
            PinOptions::default().threads(t).validate().map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// What the bench reports while it runs (for a progress bar).
#[derive(Clone, Debug, PartialEq)]
pub enum Progress {
    /// A run starts: `label`, `bytes` to pin.
    Start {
        /// The row's label.
        label: String,
        /// Bytes of the run.
        bytes: u64,
    },
    /// `bytes` of the current run are registered.
    Advance {
        /// Bytes registered so far.
        bytes: u64,
    },
    /// The current run ended.
    Finish,
}

/// Which part of the bench a row belongs to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Group {
    /// (a) one register call on untouched pages.
    OneCall,
    /// (b) the pipeline with its defaults.
    Defaults,
    /// (c) the sweep.
    Sweep,
}

/// One pipeline configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunConfig {
    /// Pre-fault threads.
    pub threads: usize,
    /// Huge pages.
    pub huge_pages: HugePages,
    /// Chunk bound.
    pub chunk: usize,
    /// Pre-fault mode.
    pub prefault: PrefaultMode,
    /// Whether chunk i+1 is faulted while chunk i registers.
    pub pipelined: bool,
    /// [`PinOptions::lookahead_bytes`].
    pub lookahead: usize,
    /// [`PinOptions::huge_fallback_mbps`].
    pub fallback_mbps: u32,
    /// [`PinOptions::prefault_nice`].
    pub nice: i32,
}

impl RunConfig {
    /// `self` changed by a candidate spec: comma-separated `key=value` of
    /// threads=N, chunk=SIZE, lookahead=SIZE|all, fallback=MB/s (0: off), nice=N,
    /// huge=auto|on|off, prefault=populate|touch|off.
    pub fn with_spec(&self, spec: &str) -> Result<RunConfig, String> {
        let mut c = self.clone();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) =
                part.split_once('=').ok_or_else(|| format!("candidate {spec:?}: {part:?} is not key=value"))?;
            let bad = |what: &str| format!("candidate {spec:?}: {k}={v:?} is not {what}");
            match k {
                "threads" => c.threads = v.parse().map_err(|_| bad("a thread count"))?,
                "chunk" => c.chunk = kvoffload::units::parse_size(v).map_err(|_| bad("a size"))?,
                "lookahead" if v == "all" => c.lookahead = usize::MAX,
                "lookahead" => c.lookahead = kvoffload::units::parse_size(v).map_err(|_| bad("a size or all"))?,
                "fallback" => c.fallback_mbps = v.parse().map_err(|_| bad("MB/s (0: off)"))?,
                "nice" => c.nice = v.parse().map_err(|_| bad("a niceness"))?,
                "huge" => c.huge_pages = HugePages::from_name(v).map_err(|e| bad(&e.expected()))?,
                "prefault" => c.prefault = PrefaultMode::from_name(v).map_err(|e| bad(&e.expected()))?,
                _ => {
                    return Err(format!(
                    "candidate {spec:?}: unknown key {k:?} (threads, chunk, lookahead, fallback, nice, huge, prefault)"
                ))
                }
            }
        }
        PinOptions::default()
            .threads(c.threads)
            .max_chunk_bytes(c.chunk)
            .prefault_nice(c.nice)
            .validate()
            .map_err(|e| format!("candidate {spec:?}: {e}"))?;
        Ok(c)
    }
}

/// One measurement.
#[derive(Clone, Debug)]
pub struct Row {
    /// Which part.
    pub group: Group,
    /// Short description.
    pub label: String,
    /// The configuration (None for the one-call path).
    pub config: Option<RunConfig>,
    /// Registration chunks (1 for the one-call path).
    pub chunks: usize,
    /// Seconds end to end (mapping excluded, everything after it included).
    pub total_s: f64,
    /// Seconds the pinning thread waited for pre-faulting (None for (a)).
    pub fault_wait_s: Option<f64>,
    /// Seconds to unregister everything afterwards (None if nothing was registered).
    pub unregister_s: Option<f64>,
    /// Whether huge pages were advised.
    pub huge_pages: bool,
    /// Bytes of the process in transparent huge pages right after pinning
    /// (`AnonHugePages` of /proc/self/smaps_rollup): how much of the advice
    /// the kernel granted.
    pub thp_bytes: Option<u64>,
    /// Whether MADV_POPULATE_WRITE was used (None: not in this mode).
    pub populate_write: Option<bool>,
    /// "ok", or what went wrong.
    pub outcome: Result<(), String>,
    /// The pinning thread's waits for pre-faulting, one per chunk: seconds
    /// from the start of the run to the `ensure` call and to its return
    /// (chunk i registers from the end of wait i to the start of wait i+1,
    /// the last one until `total_s`). Empty for the one-call path.
    pub waits: Vec<(f64, f64)>,
    /// The pre-faulter's slices by per-worker GB/s
    /// ([`kvoffload::internal::pin::PrefaultStats::slice_gbps`]; None: no pre-faulter).
    pub slice_gbps: Option<[u64; 8]>,
    /// Where the huge-page fallback tripped, as a share of the region from
    /// its start, and the per-worker GB/s that tripped it.
    pub huge_fallback: Option<(f64, f64)>,
}

impl Row {
    /// A row before its measurement: nothing timed yet, outcome Ok.
    fn empty(group: Group, label: String, config: Option<RunConfig>, chunks: usize) -> Row {
        Row {
            group,
            label,
            config,
            chunks,
            total_s: 0.0,
            fault_wait_s: None,
            unregister_s: None,
            huge_pages: false,
            thp_bytes: None,
            populate_write: None,
            outcome: Ok(()),
            waits: Vec::new(),
            slice_gbps: None,
            huge_fallback: None,
        }
    }

    /// GB/s (1e9 bytes per second) of `size` bytes in `total_s`.
    pub fn gbps(&self, size: usize) -> f64 {
        if self.total_s > 0.0 {
            size as f64 / self.total_s / 1e9
        } else {
            f64::INFINITY
        }
    }
}

/// Facts about the machine that explain the numbers.
#[derive(Clone, Debug, Default)]
pub struct MachineInfo {
    /// Cores this process may use (`available_parallelism`).
    pub cores: usize,
    /// `/sys/kernel/mm/transparent_hugepage/enabled`.
    pub thp_enabled: Option<String>,
    /// `/sys/kernel/mm/transparent_hugepage/defrag`.
    pub thp_defrag: Option<String>,
    /// `/proc/sys/kernel/osrelease`.
    pub kernel: Option<String>,
    /// RLIMIT_MEMLOCK (None: unlimited).
    pub memlock: Option<u64>,
    /// Whether MADV_POPULATE_WRITE was used by the default pipeline.
    pub populate_write: Option<bool>,
}

impl MachineInfo {
    /// Reads what the machine says now.
    pub fn read() -> Self {
        MachineInfo {
            cores: available_cores(),
            thp_enabled: thp_setting("enabled"),
            thp_defrag: thp_setting("defrag"),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_string()),
            memlock: memlock::memlock_limit(),
            populate_write: None,
        }
    }
}

/// Everything one bench run measured; `Display` prints the table.
#[derive(Clone, Debug)]
pub struct PinBenchReport {
    /// Bytes per run.
    pub size: usize,
    /// `"cuda"` or `"sim"`.
    pub backend: &'static str,
    /// The runtime's own description.
    pub device: String,
    /// The machine.
    pub machine: MachineInfo,
    /// The configuration of (b).
    pub defaults: RunConfig,
    /// Every measurement, in the order run.
    pub rows: Vec<Row>,
    /// Sweep configurations left out because they equal (b).
    pub skipped: Vec<String>,
    /// Seconds the warm-up took (None: no warm-up).
    pub warmup_s: Option<f64>,
    /// Seconds the whole bench took.
    pub wall_s: f64,
}

/// The median (the mean of the middle two for an even count); None when
/// `v` is empty.
pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

impl PinBenchReport {
    fn median_gbps(&self, g: Group) -> Option<f64> {
        median(self.rows.iter().filter(|r| r.group == g && r.outcome.is_ok()).map(|r| r.gbps(self.size)).collect())
    }

    /// Median GB/s of (a).
    pub fn one_call_gbps(&self) -> Option<f64> {
        self.median_gbps(Group::OneCall)
    }

    /// Median GB/s of (b).
    pub fn defaults_gbps(&self) -> Option<f64> {
        self.median_gbps(Group::Defaults)
    }

    /// (b) / (a), from the medians.
    pub fn ratio(&self) -> Option<f64> {
        Some(self.defaults_gbps()? / self.one_call_gbps()?)
    }

    /// The unpipelined run's split: (fault GB/s, register GB/s).
    pub fn split_rates(&self) -> Option<(f64, f64)> {
        let r = self.rows.iter().find(|r| r.outcome.is_ok() && r.config.as_ref().is_some_and(|c| !c.pipelined))?;
        let fault = r.fault_wait_s?;
        let reg = r.total_s - fault;
        if fault <= 0.0 || reg <= 0.0 {
            return None;
        }
        Some((self.size as f64 / fault / 1e9, self.size as f64 / reg / 1e9))
    }
}

pub use kvoffload::units::fmt_bytes;

/// `AnonHugePages` of /proc/self/smaps_rollup in bytes.
fn anon_huge_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = text.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Maps fresh anonymous memory of `size` bytes (untouched; no advice).
fn fresh_region(size: usize) -> Result<Arc<Region>, String> {
    let row = if size % HUGE_PAGE_BYTES == 0 { HUGE_PAGE_BYTES } else { page_size() };
    let layout = Layout::new(1, row, size / row).map_err(|e| e.to_string())?;
    Region::anonymous(layout, &AnonOptions::new()).map(Arc::new).map_err(|e| e.to_string())
}

/// A pre-faulter wrapper that times the pinning thread's waits, reports
/// progress (chunk i is about to be ensured = chunks before it registered)
/// and can drop hints (no overlap).
struct TimedPrefault<'a> {
    inner: &'a dyn Prefault,
    coord: &'a Coordinator,
    pipelined: bool,
    waited: Mutex<Duration>,
    /// Start of the run, and each `ensure`'s (start, end) from it.
    t0: Instant,
    waits: Mutex<Vec<(f64, f64)>>,
    progress: &'a (dyn Fn(Progress) + Sync),
}

impl Prefault for TimedPrefault<'_> {
    fn ensure(&self, i: usize, addr: usize, len: usize) -> Result<(), String> {
        let done: u64 = (0..i).map(|k| self.coord.pinning().chunk_range(k).1 as u64).sum();
        (self.progress)(Progress::Advance { bytes: done });
        let t = Instant::now();
        let r = self.inner.ensure(i, addr, len);
        *sync::lock(&self.waited) += t.elapsed();
        let from = |x: Instant| x.duration_since(self.t0).as_secs_f64();
        sync::lock(&self.waits).push((from(t), from(Instant::now())));
        r
    }

    fn hint(&self, i: usize, addr: usize, len: usize) {
        if self.pipelined {
            self.inner.hint(i, addr, len);
        }
    }

    fn lookahead_bytes(&self) -> usize {
        if self.pipelined {
            self.inner.lookahead_bytes()
        } else {
            0
        }
    }

    fn settle(&self) {
        self.inner.settle();
    }
}

fn one_call(rt: &dyn GpuRuntime, size: usize, progress: &(dyn Fn(Progress) + Sync)) -> Row {
    let label = "one register call, untouched pages (upstream)".to_string();
    let mut row = Row::empty(Group::OneCall, label.clone(), None, 1);
    let region = match fresh_region(size) {
        Ok(r) => r,
        Err(e) => {
            row.outcome = Err(e);
            return row;
        }
    };
    let addr = region.as_ptr() as usize;
    // No capture runs during the bench: the gate of a coordinator of its own,
    // with no region (upstream's one call knows no coordinator).
    let coord = match Coordinator::without_region(rt, CapturePolicy::AfterPinning) {
        Ok(c) => c,
        Err(e) => {
            row.outcome = Err(format!("the coordinator: {e}"));
            return row;
        }
    };
    progress(Progress::Start { label, bytes: size as u64 });
    let t = Instant::now();
    let r = coord.unsafe_call("the upstream register call", Request::new(), |g| {
        // SAFETY: the region stays mapped until after the unregister below
        // (and, should that fail, the whole region is leaked instead).
        unsafe { rt.host_register(g, addr, size) }
    });
    row.total_s = t.elapsed().as_secs_f64();
    row.thp_bytes = anon_huge_bytes();
    match r {
        Ok(Ok(())) => {
            progress(Progress::Advance { bytes: size as u64 });
            let t = Instant::now();
            let un = coord.unsafe_call("unregistering", Request::new(), |g| rt.host_unregister(g, addr));
            match un.map_err(|e| e.to_string()).and_then(|r| r.map_err(|e| e.to_string())) {
                Ok(()) => row.unregister_s = Some(t.elapsed().as_secs_f64()),
                Err(e) => {
                    row.outcome = Err(format!("unregister: {e}"));
                    // Still registered: never unmap it.
                    std::mem::forget(region);
                    progress(Progress::Finish);
                    return row;
                }
            }
        }
        Ok(Err(e)) => row.outcome = Err(e.to_string()),
        Err(e) => row.outcome = Err(e.to_string()),
    }
    progress(Progress::Finish);
    drop(region);
    row
}

fn describe(c: &RunConfig) -> String {
    let huge = c.huge_pages.name();
    let mode = match c.prefault {
        PrefaultMode::Off => "no prefault",
        m => m.name(),
    };
    let ahead = match c.lookahead {
        0 => String::new(),
        usize::MAX => ", lookahead all".into(),
        b => format!(", lookahead {}", fmt_bytes(b)),
    };
    let fallback = match c.fallback_mbps {
        0 => String::new(),
        m => format!(", 4 KiB fallback below {m} MB/s/worker"),
    };
    format!(
        "threads {:>3} (nice {}), huge {huge:>4}, chunk {:>8}, {mode}{}{ahead}{fallback}",
        c.threads,
        c.nice,
        fmt_bytes(c.chunk),
        if c.pipelined { "" } else { ", NOT pipelined" }
    )
}

/// Runs one pipeline configuration on fresh memory.
pub fn pipeline(
    rt: &dyn GpuRuntime,
    size: usize,
    group: Group,
    c: &RunConfig,
    progress: &(dyn Fn(Progress) + Sync),
) -> Row {
    let label = describe(c);
    let mut row = Row::empty(group, label.clone(), Some(c.clone()), 0);
    let region = match fresh_region(size) {
        Ok(r) => r,
        Err(e) => {
            row.outcome = Err(e);
            return row;
        }
    };
    let opts = PinOptions::default()
        .threads(c.threads)
        .huge_pages(c.huge_pages)
        .max_chunk_bytes(c.chunk)
        .prefault(c.prefault)
        .lookahead_bytes(c.lookahead)
        .huge_fallback_mbps(c.fallback_mbps)
        .prefault_nice(c.nice);
    progress(Progress::Start { label, bytes: size as u64 });
    let t = Instant::now();
    let prepared = match Prepared::new(rt, &region, &opts) {
        Ok(p) => p,
        Err(e) => {
            progress(Progress::Finish);
            row.outcome = Err(e.to_string());
            return row;
        }
    };
    let pf = prepared.prefault();
    let timed = TimedPrefault {
        inner: pf.as_ref(),
        coord: prepared.coordinator(),
        pipelined: c.pipelined,
        waited: Mutex::new(Duration::ZERO),
        t0: t,
        waits: Mutex::new(Vec::new()),
        progress,
    };
    let state = pin_all(rt, prepared.coordinator(), &timed);
    row.total_s = t.elapsed().as_secs_f64();
    row.fault_wait_s = Some(sync::lock(&timed.waited).as_secs_f64());
    row.waits = std::mem::take(&mut *sync::lock(&timed.waits));
    row.chunks = prepared.chunks();
    row.huge_pages = prepared.huge_pages();
    let stats = prepared.prefaulter().map(|p| p.stats());
    row.populate_write = stats.and_then(|s| s.populate_write);
    row.slice_gbps = stats.map(|s| s.slice_gbps);
    let base = region.as_ptr() as usize;
    row.huge_fallback =
        stats.and_then(|s| s.huge_fallback).map(|(at, gbps)| (at.saturating_sub(base) as f64 / size as f64, gbps));
    row.thp_bytes = anon_huge_bytes();
    progress(Progress::Advance { bytes: size as u64 });
    if state != PinState::Pinned {
        row.outcome = Err(format!("ended {state:?}"));
    }
    if prepared.coordinator().pinning().registered_chunks() > 0 {
        let t = Instant::now();
        match prepared.coordinator().pinning().unregister_all(rt) {
            Ok(()) => row.unregister_s = Some(t.elapsed().as_secs_f64()),
            Err(e) => row.outcome = Err(format!("unregister: {e}")),
        }
    }
    progress(Progress::Finish);
    drop(pf);
    drop(prepared);
    drop(region);
    row
}

/// The pipeline configurations the bench runs: (b) first, then the sweep
/// (without configurations that give the same chunks as (b)). The second
/// list names what was left out.
pub fn plan(cfg: &BenchConfig) -> (RunConfig, Vec<RunConfig>, Vec<String>) {
    let defaults = RunConfig {
        threads: cfg.threads,
        huge_pages: HugePages::Auto,
        chunk: cfg.chunk,
        prefault: PrefaultMode::Populate,
        pipelined: true,
        lookahead: cfg.lookahead,
        fallback_mbps: cfg.fallback_mbps,
        nice: cfg.nice,
    };
    let mut sweep = Vec::new();
    let mut skipped = Vec::new();
    if cfg.quick {
        return (defaults, sweep, skipped);
    }
    // Anonymous memory: Auto is On.
    let same = |a: &RunConfig, b: &RunConfig| {
        let huge = |h: HugePages| h != HugePages::Off;
        let eff = |c: usize| c.min(cfg.size).max(1).div_ceil(HUGE_PAGE_BYTES);
        a.threads == b.threads
            && huge(a.huge_pages) == huge(b.huge_pages)
            && eff(a.chunk) == eff(b.chunk)
            && a.prefault == b.prefault
            && a.pipelined == b.pipelined
            && a.lookahead == b.lookahead
            && a.fallback_mbps == b.fallback_mbps
            && a.nice == b.nice
    };
    let mut push = |c: RunConfig, sweep: &mut Vec<RunConfig>| {
        if same(&c, &defaults) || sweep.iter().any(|s| same(s, &c)) {
            skipped.push(format!("{} (= an earlier run)", describe(&c)));
        } else {
            sweep.push(c);
        }
    };
    for &t in &cfg.threads_sweep {
        for huge in [HugePages::On, HugePages::Off] {
            push(RunConfig { threads: t, huge_pages: huge, ..defaults.clone() }, &mut sweep);
        }
    }
    for &c in &cfg.chunk_sweep {
        push(RunConfig { chunk: c, ..defaults.clone() }, &mut sweep);
    }
    push(RunConfig { prefault: PrefaultMode::Touch, ..defaults.clone() }, &mut sweep);
    push(RunConfig { pipelined: false, ..defaults.clone() }, &mut sweep);
    (defaults, sweep, skipped)
}

/// Runs the whole bench on `rt`.
pub fn run(
    rt: &dyn GpuRuntime,
    cfg: &BenchConfig,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<PinBenchReport, String> {
    cfg.validate()?;
    let wall = Instant::now();
    let (defaults, sweep, skipped) = plan(cfg);
    let warmup_s = if cfg.warmup { Some(warm_up(cfg, progress)?) } else { None };
    let mut rows = Vec::new();
    for _ in 0..cfg.repeat {
        rows.push(one_call(rt, cfg.size, progress));
        rows.push(pipeline(rt, cfg.size, Group::Defaults, &defaults, progress));
    }
    for c in &sweep {
        rows.push(pipeline(rt, cfg.size, Group::Sweep, c, progress));
    }
    let mut machine = MachineInfo::read();
    machine.populate_write = rows.iter().find(|r| r.group == Group::Defaults).and_then(|r| r.populate_write);
    Ok(PinBenchReport {
        size: cfg.size,
        backend: rt.backend(),
        device: rt.describe(),
        machine,
        defaults,
        rows,
        skipped,
        warmup_s,
        wall_s: wall.elapsed().as_secs_f64(),
    })
}

/// Maps `size` bytes, pre-faults them with huge-page advice and unmaps them
/// (no GPU involved). Returns the seconds it took.
fn warm_up(cfg: &BenchConfig, progress: &(dyn Fn(Progress) + Sync)) -> Result<f64, String> {
    let t = Instant::now();
    let region = fresh_region(cfg.size)?;
    progress(Progress::Start { label: "warm-up (not measured)".into(), bytes: cfg.size as u64 });
    let opts = PinOptions::default().threads(cfg.threads).huge_pages(HugePages::On);
    // No GPU is involved: a simulated one stands in for the runtime the
    // coordinator that `Prepared` makes must guard (nothing is registered).
    let prepared = Prepared::new(&kvoffload::internal::runtime::sim::SimRuntime::new(), &region, &opts)
        .map_err(|e| e.to_string())?;
    if let Some(pf) = prepared.prefaulter() {
        pf.ensure_typed(0, region.as_ptr() as usize, region.len()).map_err(|e| format!("warm-up: {e}"))?;
    }
    progress(Progress::Finish);
    drop(prepared);
    drop(region);
    Ok(t.elapsed().as_secs_f64())
}

/// The target (docs/driver-rules.md, "Targets the benches print"): >= 20
/// GB/s end to end.
pub const TARGET_GBPS: f64 = 20.0;
/// The target ratio (b)/(a): at least 6x.
pub const TARGET_RATIO: f64 = 6.0;

impl fmt::Display for PinBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.machine;
        let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "unknown".into());
        writeln!(
            f,
            "kvoffload bench pin: {} ({:.2} GB) per run, fresh untouched anonymous memory for every run",
            fmt_bytes(self.size),
            self.size as f64 / 1e9
        )?;
        writeln!(f, "backend: {} ({})", self.backend, self.device)?;
        writeln!(
            f,
            "machine: {} cores available, THP enabled={} defrag={}, kernel {}, RLIMIT_MEMLOCK {}, MADV_POPULATE_WRITE {}",
            m.cores,
            opt(&m.thp_enabled),
            opt(&m.thp_defrag),
            opt(&m.kernel),
            m.memlock.map_or("unlimited".to_string(), |l| format!("{l} bytes")),
            match m.populate_write {
                Some(true) => "used",
                Some(false) => "not supported by the kernel (pages touched instead)",
                None => "not used",
            }
        )?;
        writeln!(f, "defaults (b): {}, pipelined", describe(&self.defaults).trim_end_matches(", NOT pipelined"))?;
        match self.warmup_s {
            Some(w) => writeln!(
                f,
                "warm-up: {} mapped, pre-faulted and unmapped once before measuring ({w:.2} s)",
                fmt_bytes(self.size)
            )?,
            None => writeln!(f, "warm-up: none (the first run may pay for memory used for the first time)")?,
        }
        if self.backend == "sim" {
            writeln!(
                f,
                "NOTE: simulated GPU: registration is instant, so these figures measure only the host-side work \
                 (huge-page advice, pre-faulting, chunking); (a) measures only the call overhead and b/a means nothing here. \
                 Run with --backend cuda on a GPU machine for the real comparison."
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "{:<4} {:<62} {:>6} {:>9} {:>8} {:>12} {:>10} {:>13} {:>5}  result",
            "run", "configuration", "chunks", "total s", "GB/s", "fault wait s", "register s", "unregister s", "THP%"
        )?;
        for r in &self.rows {
            let tag = match r.group {
                Group::OneCall => "(a)",
                Group::Defaults => "(b)",
                Group::Sweep => "(c)",
            };
            let secs = |o: Option<f64>| o.map_or("-".to_string(), |s| format!("{s:.3}"));
            let result = match &r.outcome {
                Ok(()) => "ok".to_string(),
                Err(e) => format!("FAILED: {e}"),
            };
            let huge_note = match &r.config {
                Some(c) if c.huge_pages != HugePages::Off && !r.huge_pages => " (huge-page advice refused)",
                _ => "",
            };
            let thp = r
                .thp_bytes
                .map_or("-".to_string(), |b| format!("{:.0}", (b as f64 * 100.0 / self.size as f64).min(100.0)));
            writeln!(
                f,
                "{:<4} {:<62} {:>6} {:>9.3} {:>8.2} {:>12} {:>10} {:>13} {:>5}  {}{}",
                tag,
                r.label,
                r.chunks,
                r.total_s,
                r.gbps(self.size),
                secs(r.fault_wait_s),
                format!("{:.3}", (r.total_s - r.fault_wait_s.unwrap_or(0.0)).max(0.0)),
                secs(r.unregister_s),
                thp,
                result,
                huge_note
            )?;
        }
        for s in &self.skipped {
            writeln!(f, "     skipped: {s}")?;
        }
        writeln!(
            f,
            "fault wait: time the pinning thread waited for pre-faulting; register: the rest of total (registration calls and \
             bookkeeping); THP%: share of the run's bytes in transparent huge pages after pinning (AnonHugePages)"
        )?;
        writeln!(f)?;
        if let Some((fault, reg)) = self.split_rates() {
            writeln!(
                f,
                "unpipelined split: pre-faulting {fault:.2} GB/s, registering {reg:.2} GB/s (pipelined, the slower of the two bounds the total)"
            )?;
        }
        match (self.one_call_gbps(), self.defaults_gbps(), self.ratio()) {
            (Some(a), Some(b), Some(ratio)) if self.backend != "sim" => {
                writeln!(f, "(a) {a:.2} GB/s, (b) {b:.2} GB/s: b/a = {ratio:.2}x")?;
                let ok_b = b >= TARGET_GBPS;
                let ok_r = ratio >= TARGET_RATIO;
                writeln!(
                    f,
                    "targets: (b) >= {TARGET_GBPS} GB/s: {}; b/a >= {TARGET_RATIO}x: {}",
                    if ok_b { "met" } else { "NOT met" },
                    if ok_r { "met" } else { "NOT met" }
                )?;
            }
            (Some(a), Some(b), Some(ratio)) => {
                writeln!(
                    f,
                    "(a) {a:.2} GB/s, (b) {b:.2} GB/s: b/a = {ratio:.2}x (not meaningful on the simulated GPU)"
                )?;
            }
            _ => writeln!(f, "b/a: not available (a run failed)")?,
        }
        write!(f, "bench wall time: {:.1} s", self.wall_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_format() {
        assert_eq!(fmt_bytes(16 << 30), "16 GiB");
        assert_eq!(fmt_bytes(256 << 20), "256 MiB");
        assert_eq!(fmt_bytes(3 << 29), "1.50 GiB");
        assert_eq!(fmt_bytes(100), "100 B");
    }

    #[test]
    fn plan_has_about_ten_runs_and_no_duplicate_of_the_defaults() {
        let mut cfg = BenchConfig::new(16 << 30);
        cfg.threads = 16;
        cfg.threads_sweep = vec![1, 4, 16];
        let (d, sweep, skipped) = plan(&cfg);
        assert_eq!(d.threads, 16);
        assert!(sweep.len() >= 8 && sweep.len() <= 11, "{} runs", sweep.len());
        assert!(!sweep.iter().any(|c| c.threads == 16
            && c.huge_pages == HugePages::On
            && c.chunk == d.chunk
            && c.pipelined
            && c.prefault == PrefaultMode::Populate));
        assert!(!skipped.is_empty());
        cfg.quick = true;
        assert!(plan(&cfg).1.is_empty());
    }

    #[test]
    fn config_validation_is_typed() {
        let mut c = BenchConfig::new(0);
        assert!(c.validate().unwrap_err().contains("zero"));
        c.size = page_size() + 1;
        assert!(c.validate().unwrap_err().contains("multiple"));
        c.size = 1 << 20;
        c.chunk = 600 << 30;
        assert!(c.validate().unwrap_err().contains("exceeds"));
        c.chunk = 1 << 20;
        c.threads_sweep = vec![0];
        assert!(c.validate().unwrap_err().contains("threads"));
    }
}
