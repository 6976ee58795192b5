//! `kvoffload run`: the main job. The parent process spawns one process per
//! rank (this binary again, with hidden `--as-rank`), reads their marker
//! lines (progress bars on stderr; phase lines on stdout when stderr is not
//! a terminal), kills a rank where a fault test asks, and prints the
//! summary. Library part: `crate::run`. The parent's three steps, one
//! file each under `run/`: `preflight` (runtime, placement, the banner),
//! `supervise` (spawn, follow, signals, kills) and `summary` (the figures
//! and the exit status).
//!
//! Lifecycle: the ranks die with the parent (`PR_SET_PDEATHSIG`, see
//! `crate::run::lifecycle`). When a rank fails (a `KVO-ERROR` line) the
//! others are killed at once: they would only wait for it. On SIGINT or
//! SIGTERM the parent forwards SIGTERM to the ranks, which stop issuing
//! work, drain it, shut their offloaders down and report; it waits for them
//! up to [`STOP_GRACE`] (then SIGKILL; a second signal kills at once),
//! prints the summary it has and removes the region file if one is left.
//!
//! Exit status: 0 when every rank that was not killed on request finished
//! with every loaded block verified, none corrupted, none lost, and no
//! region file left; 1 when a block was corrupted or lost, a rank failed or
//! died unexpectedly, or the region file remained; 2 for bad options or an
//! unusable environment; 128 + the signal's number when SIGINT or SIGTERM
//! stopped the run.

use std::time::Duration;

use clap::ValueEnum;
use signal_hook::consts::{SIGINT, SIGTERM};

use crate::run::report;
use crate::run::{lifecycle, run_rank, KillAt, RunConfig};
use kvoffload::internal::runtime::cuda::CudaRuntime;
use kvoffload::units::parse_size;

use super::backend::{self, BackendArg};
use kvoffload::internal::pin::{HugePages, MAX_THREADS};

mod preflight;
mod summary;
mod supervise;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum KillAtArg {
    /// During the join of the shared region (before the rank maps it).
    Join,
    /// In the middle of pinning (the rank stops before its middle chunk).
    Pinning,
    /// In the middle of the workload, with jobs in flight.
    Transfers,
}

impl From<KillAtArg> for KillAt {
    fn from(k: KillAtArg) -> Self {
        match k {
            KillAtArg::Join => KillAt::Join,
            KillAtArg::Pinning => KillAt::Pinning,
            KillAtArg::Transfers => KillAt::Transfers,
        }
    }
}

/// Where `kvoffload run` puts its ranks.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum RankGpus {
    /// Rank r on GPU r mod the number of visible GPUs.
    Spread,
    /// Every rank on GPU 0.
    Same,
}

/// Options of `kvoffload run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// GPU runtime: the real GPU when a driver is present, the simulated GPU otherwise.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Rank processes sharing the region.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Shared host region (all ranks together), rounded down to whole rows.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    region: usize,
    /// KV tensors (layers) per rank.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Bytes of one GPU block of one layer.
    #[arg(long, default_value = "16KiB", value_parser = parse_size)]
    page_bytes: usize,
    /// GPU blocks per host block.
    #[arg(long, default_value_t = 1)]
    block_factor: usize,
    /// GPU blocks per KV tensor.
    #[arg(long, default_value_t = 256)]
    gpu_blocks: usize,
    /// Requests per rank (each loads its leading hits and stores its misses).
    #[arg(long, default_value_t = 2000)]
    jobs: usize,
    /// Consecutive keys (host blocks) per request.
    #[arg(long, default_value_t = 4)]
    blocks_per_job: usize,
    /// Distinct keys per rank.
    #[arg(long, default_value_t = 2048)]
    keys: usize,
    /// Zipf exponent of the key choice (0 = uniform).
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Blocks stored first, keys 0.. in order (stores alone), before the Zipf requests; at most --keys.
    #[arg(long, default_value_t = 0)]
    prefill_blocks: usize,
    /// Transfer jobs in flight per rank, at most (loads being verified do not count; the GPU blocks they hold bound them).
    #[arg(long, default_value_t = 8)]
    inflight: usize,
    /// Graphs each rank captures through capture windows.
    #[arg(long, default_value_t = 8)]
    graphs: usize,
    /// Each rank's own start-up work (a compute loop) while pinning runs, in ms; at most 3600000 (an hour).
    #[arg(long, default_value_t = 300, value_parser = startup_ms)]
    startup_ms: u64,
    /// Pre-fault threads per rank, 1 to 1024 (the library's cap) [default: every core].
    #[arg(long, value_parser = pin_threads)]
    pin_threads: Option<usize>,
    /// Bound of one registration call [default: an eighth of the region, at most the library default, 256MiB].
    #[arg(long, value_parser = parse_size)]
    pin_chunk: Option<usize>,
    /// Huge-page advice for the shared region: auto (library default: none
    /// for /dev/shm), on (madvise MADV_HUGEPAGE; effective where
    /// /sys/kernel/mm/transparent_hugepage/shmem_enabled allows), off.
    #[arg(long, value_parser = backend::named::<HugePages>(), default_value = "auto")]
    pin_huge_pages: HugePages,
    /// Directory of the region file. /dev/shm usually has 4 KiB pages (no
    /// huge= mount option), which limit pinning to a few GB/s; a tmpfs
    /// mounted with huge=always (mount -t tmpfs -o huge=always,size=... none DIR)
    /// gives 2 MiB pages.
    #[arg(long, default_value = "/dev/shm")]
    region_dir: std::path::PathBuf,
    /// Seed of the key choice (rank r uses seed + r).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How long ranks wait for each other (joining, agreeing), in seconds: 1 to 86400 (a day).
    #[arg(long, default_value_t = 120, value_parser = rank_timeout_s)]
    rank_timeout_s: u64,
    /// Fault test: SIGKILL this rank ...
    #[arg(long)]
    kill_rank: Option<usize>,
    /// ... at this point (the rank stops there and announces it; the parent kills it).
    #[arg(long, value_enum, default_value_t = KillAtArg::Transfers)]
    kill_at: KillAtArg,
    /// Simulated GPU: about every K-th async copy fails (the failed jobs are reported).
    #[arg(long)]
    fault_copy_every: Option<u64>,
    /// Simulated GPU: the K-th registration call fails with 801 (the rank falls back to pageable; P7 makes all do).
    #[arg(long)]
    fault_register_at: Option<u64>,
    /// Only this rank gets the injected faults [default: every rank].
    #[arg(long)]
    fault_rank: Option<usize>,
    #[arg(long, hide = true)]
    as_rank: Option<usize>,
    #[arg(long, hide = true)]
    region_name: Option<String>,
    #[arg(long, hide = true, value_enum)]
    rank_backend: Option<BackendArg>,
    #[arg(long, hide = true)]
    rank_device: Option<usize>,
    /// Which GPU each rank uses: spread (rank r on GPU r mod the number of
    /// visible GPUs, as a tensor-parallel engine places its ranks) or same
    /// (every rank on GPU 0, sharing its PCIe link and time-slicing it).
    #[arg(long, value_enum, default_value_t = RankGpus::Spread)]
    rank_gpus: RankGpus,
    #[arg(long, hide = true, value_enum)]
    pause_at: Option<KillAtArg>,
    /// The parent's pid, for a rank to check it was not orphaned at birth.
    #[arg(long, hide = true)]
    parent_pid: Option<u32>,
}

/// Longest `--startup-ms`: an hour. The start-up work stands for an
/// engine's own start (loading a model) overlapping pinning: minutes at
/// most; a longer value is a typo that would run until Ctrl-C.
pub const MAX_STARTUP_MS: u64 = 3_600_000;

/// Longest `--rank-timeout-s`: a day. Ranks wait this long for each other
/// to join the region and to agree; a longer wait is a hang, not a wait.
pub const MAX_RANK_TIMEOUT_S: u64 = 86_400;

/// `--startup-ms`: 0 to [`MAX_STARTUP_MS`].
fn startup_ms(s: &str) -> Result<u64, String> {
    bounded(s, None, MAX_STARTUP_MS, || {
        format!(
            "at most {MAX_STARTUP_MS} ms (an hour): the start-up work stands for an engine's own start \
             overlapping pinning, and a longer one would run until Ctrl-C"
        )
    })
}

/// `--rank-timeout-s`: 1 to [`MAX_RANK_TIMEOUT_S`].
fn rank_timeout_s(s: &str) -> Result<u64, String> {
    bounded(
        s,
        Some("at least 1 s: with 0 a rank times out before another one can join the region"),
        MAX_RANK_TIMEOUT_S,
        || {
            format!(
                "at most {MAX_RANK_TIMEOUT_S} s (a day): the ranks wait this long for each other, and a longer \
             wait is a hang"
            )
        },
    )
}

/// `--pin-threads`: 1 to the library's cap ([`MAX_THREADS`], a typo
/// guard: the library refuses more, so the run would fail later).
fn pin_threads(s: &str) -> Result<usize, String> {
    bounded(s, Some("at least 1: the pre-fault needs a thread"), MAX_THREADS, || {
        format!("at most {MAX_THREADS} (the library's cap on pre-fault threads, a typo guard)")
    })
}

/// A number of an option: refused when it does not parse, when it is 0
/// and `zero` says why 0 is refused, and past `max` (`above` says why).
fn bounded<T>(s: &str, zero: Option<&str>, max: T, above: impl FnOnce() -> String) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + Default,
    T::Err: std::fmt::Display,
{
    let v: T = s.parse().map_err(|e| format!("{e}"))?;
    if let Some(why) = zero.filter(|_| v == T::default()) {
        return Err(why.into());
    }
    if v > max {
        return Err(above());
    }
    Ok(v)
}

/// How long the parent waits for its ranks after forwarding SIGTERM to
/// them, before it SIGKILLs those left.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

fn signal_name(sig: i32) -> &'static str {
    match sig {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

impl Args {
    fn config(&self) -> RunConfig {
        RunConfig {
            ranks: self.ranks,
            region_bytes: self.region,
            layers: self.layers,
            page_bytes: self.page_bytes,
            block_factor: self.block_factor,
            gpu_blocks: self.gpu_blocks,
            jobs: self.jobs,
            blocks_per_job: self.blocks_per_job,
            keys: self.keys,
            zipf: self.zipf,
            inflight: self.inflight,
            prefill_blocks: self.prefill_blocks,
            graphs: self.graphs,
            graph_nodes: 16,
            startup: Duration::from_millis(self.startup_ms),
            pin_threads: self.pin_threads,
            pin_chunk: self.pin_chunk,
            pin_huge_pages: self.pin_huge_pages,
            region_dir: self.region_dir.clone(),
            seed: self.seed,
            rank_timeout: Duration::from_secs(self.rank_timeout_s),
            kill_rank: self.kill_rank,
            kill_at: self.kill_at.into(),
            fault_copy_every: self.fault_copy_every,
            fault_register_at: self.fault_register_at,
            fault_rank: self.fault_rank,
        }
    }
}

pub fn run(a: Args, verbose: u8) -> Result<i32, String> {
    let cfg = a.config();
    if let Some(rank) = a.as_rank {
        return run_as_rank(&a, &cfg, rank);
    }
    let plan = preflight::plan(&a, &cfg)?;
    preflight::announce(&cfg, &plan);
    let outcome = supervise::supervise(&cfg, &plan, verbose)?;
    Ok(summary::summarise(&cfg, &outcome))
}

/// A rank process: die with the parent, stop on SIGINT/SIGTERM, open the
/// runtime it was told, run, print the result.
fn run_as_rank(a: &Args, cfg: &RunConfig, rank: usize) -> Result<i32, String> {
    let fail = |e: &dyn std::fmt::Display| {
        crate::run::parent::emit(&format!("{} rank={rank} {e}", report::ERROR));
        Ok(1)
    };
    if let Some(parent) = a.parent_pid {
        if let Err(e) = lifecycle::die_with_parent(parent) {
            return fail(&e);
        }
    }
    let stop = match lifecycle::Stop::install() {
        Ok(s) => s,
        Err(e) => return fail(&format!("installing the SIGINT/SIGTERM handlers: {e}")),
    };
    let name = a.region_name.as_deref().ok_or("--as-rank needs --region-name")?;
    let b = match a.rank_backend {
        Some(BackendArg::Cuda) => BackendArg::Cuda,
        _ => BackendArg::Sim,
    };
    let opened = match (b, a.rank_device) {
        (BackendArg::Cuda, Some(d)) => {
            CudaRuntime::open(d).map(kvoffload::internal::runtime::shared).map_err(|e| e.to_string())
        }
        _ => backend::open(b),
    };
    let rt = match opened {
        Ok(rt) => rt,
        Err(e) => {
            crate::run::parent::emit(&format!("{} rank={rank} {e}", report::ERROR));
            return Ok(1);
        }
    };
    match run_rank(cfg, rank, name, rt, a.pause_at.map(Into::into), stop) {
        Ok(rep) => {
            crate::run::parent::emit(&rep.to_line());
            Ok(0)
        }
        Err(e) => {
            crate::run::parent::emit(&format!("{} rank={rank} {e}", report::ERROR));
            Ok(1)
        }
    }
}
