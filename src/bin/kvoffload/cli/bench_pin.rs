//! `kvoffload bench pin`: the pinning benchmark (library part in
//! [`crate::bench::pin`]; with `--shared`, [`crate::bench::pin_shared`]).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::bench::pin::{self, BenchConfig, Progress};
use crate::bench::pin_existing::{self, PoolPhase};
use crate::bench::pin_shared::{self as shared_bench, Measurement, RankConfig, RankTimes, SharedReport, Variant};
use kvoffload::internal::region::{pages, Region, ShmOptions, DEFAULT_SHM_DIR};
use kvoffload::internal::runtime::cuda::CudaRuntime;
use kvoffload::units::{fmt_bytes, parse_size};

use super::backend::{open, BackendArg};

/// Options of `kvoffload bench pin`.
#[derive(clap::Args, Debug)]
pub struct PinArgs {
    /// Bytes pinned per run, e.g. 16GiB, 512MiB, 1G (K/M/G/T = KiB/MiB/GiB/TiB; KB/MB/GB/TB are decimal).
    /// With --shared, a comma-separated list of region sizes.
    #[arg(long, default_value = "16GiB", value_delimiter = ',', value_parser = parse_size)]
    size: Vec<usize>,
    /// Several region sizes in one run (comma separated, e.g. 16GiB,64GiB,96GiB): per size its first
    /// touch (the defaults once, reported apart, also its warm-up), then --repeat rounds (at least 3) of
    /// the one-call baseline, the defaults and the defaults with the overlap off (the two stages apart,
    /// their bound); medians and spread. Replaces --size and the sweep.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<usize>,
    /// With --sizes: also run this configuration in every round, as the defaults changed by
    /// comma-separated key=value of threads=N, chunk=SIZE, lookahead=SIZE|all, fallback=MB/s, nice=N,
    /// huge=auto|on|off, prefault=populate|touch|off (repeat the option for several).
    #[arg(long = "candidate")]
    candidates: Vec<String>,
    /// With --sizes: one round per size and no one-call baseline, to explore candidates quickly
    /// (the report says it is a probe).
    #[arg(long)]
    probe: bool,
    /// With --sizes: only one run per size, of the first --candidate if given (else the defaults):
    /// for a machine state one run changes (fragmented memory), measured once per state.
    #[arg(long)]
    once: bool,
    /// With --once: one one-call baseline run of the size right before the run (the state a 4 KiB
    /// region just freed leaves).
    #[arg(long, requires = "once")]
    after_one_call: bool,
    /// With --sizes: write the GB/s-against-size picture (SVG) into this directory as
    /// pin-sizes-<sizes>.svg (e.g. pin-sizes-16GiB-64GiB.svg) and a per-chunk timeline per size;
    /// with --shared: pin-shared.svg (end-to-end GB/s against size per variant and ranks).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Which runtime registers the memory.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Pre-fault thread counts of the sweep, comma separated [default: 1,4,<available cores>].
    #[arg(long, value_delimiter = ',')]
    threads_sweep: Option<Vec<usize>>,
    /// Pre-fault threads of the default pipeline (b) [default: available cores]; with --shared, per rank
    /// [default: available cores / ranks].
    #[arg(long)]
    threads: Option<usize>,
    /// Bound of one registration call for (b) and the thread sweep [default: the library default, 256MiB].
    #[arg(long, value_parser = parse_size)]
    chunk: Option<usize>,
    /// Chunk bounds of the sweep, comma separated.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "256MiB,1GiB,4GiB")]
    chunk_sweep: Vec<usize>,
    /// Skip the sweep: only (a) and (b).
    #[arg(long)]
    quick: bool,
    /// Runs of (a) and (b) each; the ratio uses their medians. With --shared, runs of every variant.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Do not map, pre-fault and unmap the size once before measuring.
    #[arg(long)]
    no_warmup: bool,
    /// Pin a shared region from N rank processes instead (--ranks): today's one-file path
    /// against the multi-file path (--variants), region bytes over the time to every rank pinned and agreed.
    #[arg(long)]
    shared: bool,
    /// --shared: time to ready on an existing pool: per run one persistent region (what the node pool
    /// keeps across engine restarts) made and pinned by rank processes that then exit ("fresh"), then
    /// opened and pinned again by new rank processes while its pages are still in tmpfs ("existing"),
    /// both reported (open, pre-fault + register, and the ratio); the region is removed afterwards.
    /// Every --variants is measured both ways.
    #[arg(long, requires = "shared")]
    existing: bool,
    /// --shared: numbers of ranks, comma separated (rank r uses GPU r mod the GPUs there are).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    ranks: Vec<usize>,
    /// --shared: variants, comma separated, of old (one file, rows, whole region per rank), new (data files,
    /// rank-major, own share, fallocate in create/join), overlap (new with fallocate per slice by the
    /// pre-fault workers), new-noreserve, rows (data files, rows, whole region per rank).
    #[arg(long, value_delimiter = ',', default_value = "old,new,overlap")]
    variants: Vec<String>,
    /// --shared: directory of the region's files.
    #[arg(long, default_value = DEFAULT_SHM_DIR)]
    dir: PathBuf,
    /// --shared: bytes of one slot (a chunk of the layout).
    #[arg(long, default_value = "2MiB", value_parser = parse_size)]
    slot: usize,
    /// --shared: upper bound of one data file.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    file_bytes: usize,
    /// --shared: how long a rank waits for the others, in seconds.
    #[arg(long, default_value_t = 300)]
    rank_timeout: u64,
    /// Internal: run as this rank of a --shared measurement.
    #[arg(long, hide = true)]
    as_rank: Option<usize>,
    /// Internal: the region's name for --as-rank.
    #[arg(long, hide = true)]
    name: Option<String>,
    /// Internal: the GPU of --as-rank.
    #[arg(long, hide = true)]
    device: Option<usize>,
    /// Internal: the phase (fresh, existing) of an --existing rank.
    #[arg(long, hide = true)]
    pool_phase: Option<String>,
}

/// Runs the bench and prints its report on stdout (progress on stderr).
pub fn run(a: PinArgs) -> Result<i32, String> {
    if a.as_rank.is_some() {
        return run_as_rank(&a);
    }
    if a.sizes.is_empty() && (a.probe || a.once || !a.candidates.is_empty()) {
        return Err("--candidate, --probe and --once go with --sizes".into());
    }
    if a.shared && !a.sizes.is_empty() {
        return Err(
            "--sizes is for anonymous pinning; with --shared give the sizes to --size (e.g. --size 16GiB,64GiB)".into(),
        );
    }
    if a.shared {
        return run_shared(&a);
    }
    if !a.sizes.is_empty() {
        return run_sizes(a);
    }
    let [size] = a.size[..] else {
        return Err(format!("--size takes one size without --shared, got {}", a.size.len()));
    };
    let mut cfg = BenchConfig::new(size);
    if let Some(t) = a.threads_sweep {
        let mut t = t;
        t.sort_unstable();
        t.dedup();
        cfg.threads_sweep = t;
    }
    if let Some(t) = a.threads {
        cfg.threads = t;
    }
    if let Some(c) = a.chunk {
        cfg.chunk = c;
    }
    cfg.chunk_sweep = a.chunk_sweep;
    cfg.quick = a.quick;
    cfg.repeat = a.repeat;
    cfg.warmup = !a.no_warmup;
    cfg.validate()?;
    let rt = open(a.backend)?;

    let style = indicatif::ProgressStyle::with_template(
        "{prefix:<62} [{bar:30}] {bytes:>10}/{total_bytes:<10} {elapsed_precise}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
    .progress_chars("=> ");
    let current: kvoffload::internal::sync::Mutex<Option<indicatif::ProgressBar>> =
        kvoffload::internal::sync::Mutex::new(None);
    let progress = |p: Progress| {
        let mut cur = current.lock().unwrap_or_else(|e| e.into_inner());
        match p {
            Progress::Start { label, bytes } => {
                let bar =
                    indicatif::ProgressBar::with_draw_target(Some(bytes), indicatif::ProgressDrawTarget::stderr());
                bar.set_style(style.clone());
                bar.set_prefix(label);
                bar.enable_steady_tick(std::time::Duration::from_millis(200));
                *cur = Some(bar);
            }
            Progress::Advance { bytes } => {
                if let Some(b) = cur.as_ref() {
                    b.set_position(bytes);
                }
            }
            Progress::Finish => {
                if let Some(b) = cur.take() {
                    b.finish_and_clear();
                }
            }
        }
    };
    let report = pin::run(rt.as_ref(), &cfg, &progress)?;
    println!("{report}");
    Ok(0)
}

/// `kvoffload bench pin --sizes`.
fn run_sizes(a: PinArgs) -> Result<i32, String> {
    let mut cfg = BenchConfig::new(a.sizes[0]);
    if let Some(t) = a.threads {
        cfg.threads = t;
    }
    if let Some(c) = a.chunk {
        cfg.chunk = c;
    }
    cfg.repeat = a.repeat;
    cfg.quick = true;
    if let Some(dir) = &a.svg {
        super::svg_dir(dir)?;
    }
    let rt = open(a.backend)?;
    let report =
        pin::sizes::run(rt.as_ref(), &a.sizes, &cfg, &a.candidates, a.probe, a.once, a.after_one_call, &|_| {})?;
    println!("{report}");
    if let Some(dir) = &a.svg {
        let tag: Vec<String> = a.sizes.iter().map(|&s| fmt_bytes(s).replace(' ', "")).collect();
        super::picture(dir, &format!("pin-sizes-{}.svg", tag.join("-")), |path| report.write_svg(path))?;
        for p in report.write_timelines(dir)? {
            println!("timeline: {}", p.display());
        }
    }
    let failed = report.sizes.iter().any(|s| {
        s.rounds.iter().any(|r| {
            (r.one_call.outcome.is_err() && !a.probe)
                || r.defaults.outcome.is_err()
                || r.split.outcome.is_err()
                || r.candidates.iter().any(|c| c.0.outcome.is_err())
        }) || s.first_touch.outcome.is_err()
            || s.one_call_before.as_ref().is_some_and(|r| r.outcome.is_err())
    });
    Ok(if failed { 1 } else { 0 })
}

fn chunk_of(a: &PinArgs) -> usize {
    a.chunk.unwrap_or(kvoffload::internal::pin::DEFAULT_MAX_CHUNK_BYTES)
}

/// Which backend the ranks use: `(name, devices)`.
fn rank_backend(b: BackendArg) -> Result<(&'static str, usize), String> {
    let cuda = match b {
        BackendArg::Sim => false,
        BackendArg::Cuda => true,
        BackendArg::Auto => CudaRuntime::driver_present(),
    };
    if cuda {
        Ok(("cuda", CudaRuntime::device_count().map_err(|e| e.to_string())?.max(1)))
    } else {
        Ok(("sim", 1))
    }
}

/// `kvoffload bench pin --shared`: spawns the ranks of every measurement.
fn run_shared(a: &PinArgs) -> Result<i32, String> {
    let wall = Instant::now();
    let variants: Vec<Variant> =
        a.variants.iter().map(|v| Variant::named(v.trim(), a.file_bytes)).collect::<Result<_, _>>()?;
    if a.ranks.iter().any(|&r| r == 0 || r > kvoffload::internal::region::MAX_RANKS) {
        return Err(format!("--ranks must be 1..={} each", kvoffload::internal::region::MAX_RANKS));
    }
    if a.repeat == 0 {
        return Err("--repeat is zero; it must be at least 1".into());
    }
    if !a.dir.is_dir() {
        return Err(format!("--dir {}: not a directory", a.dir.display()));
    }
    let chunk = chunk_of(a);
    // Validate every shape before spending time on any.
    for &size in &a.size {
        for &ranks in &a.ranks {
            for v in &variants {
                let rc = rank_config(a, "check", 0, ranks, size, *v);
                rc.layout()?;
                kvoffload::internal::pin::PinOptions::default()
                    .threads(rc.threads)
                    .max_chunk_bytes(chunk)
                    .validate()
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    let (backend, devices) = rank_backend(a.backend)?;
    let device = if backend == "cuda" {
        let rt = CudaRuntime::open(0).map_err(|e| e.to_string())?;
        format!("{} x{devices}", kvoffload::internal::runtime::GpuRuntime::describe(&rt))
    } else {
        "simulated GPU, one per rank process".into()
    };
    let warmup_s = if a.no_warmup {
        None
    } else {
        let biggest = a.size.iter().copied().max().unwrap_or(0);
        eprintln!("warm-up: {} ...", fmt_bytes(biggest));
        Some(warm_up(biggest)?)
    };
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable to start ranks: {e}"))?;
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let mut rows = Vec::new();
    let mut n = 0;
    for &size in &a.size {
        for &ranks in &a.ranks {
            for rep in 0..a.repeat {
                for v in &variants {
                    n += 1;
                    let name = format!("pinbench-{}-{nonce}-{n}", std::process::id());
                    eprintln!(
                        "run {n}: {} x {ranks} rank(s), {}{} (repeat {}/{})",
                        fmt_bytes(size),
                        v.describe(),
                        if a.existing { ", persistent: fresh then existing" } else { "" },
                        rep + 1,
                        a.repeat
                    );
                    let phases: &[Option<PoolPhase>] =
                        if a.existing { &[Some(PoolPhase::Fresh), Some(PoolPhase::Existing)] } else { &[None] };
                    for &phase in phases {
                        let m = measure(a, &exe, &name, size, ranks, *v, backend, devices, phase)?;
                        eprintln!(
                            "  {}pin {} GB/s, end to end {} GB/s{}",
                            phase.map_or(String::new(), |p| format!("{}: ", p.name())),
                            m.gbps(m.pin_s()).map_or("-".into(), |g| format!("{g:.2}")),
                            m.gbps(m.e2e_s()).map_or("-".into(), |g| format!("{g:.2}")),
                            if m.ok() { "" } else { " (FAILED)" }
                        );
                        rows.push(m);
                    }
                }
            }
        }
    }
    let report = SharedReport {
        backend: backend.into(),
        device,
        dir: a.dir.clone(),
        pages: pages::mount_of(&a.dir).map_or("mount unknown".into(), |m| m.pages()),
        cores: kvoffload::internal::pin::available_cores(),
        slot: a.slot,
        chunk,
        warmup_s,
        rows,
        wall_s: wall.elapsed().as_secs_f64(),
    };
    let failed = report.rows.iter().any(|m| !m.ok());
    println!("{report}");
    if let Some(dir) = &a.svg {
        super::picture(dir, "pin-shared.svg", |path| report.write_svg(path))?;
    }
    Ok(if failed { 1 } else { 0 })
}

fn rank_config(a: &PinArgs, name: &str, rank: usize, ranks: usize, size: usize, variant: Variant) -> RankConfig {
    RankConfig {
        name: name.into(),
        rank,
        ranks,
        size,
        slot: a.slot,
        chunk: chunk_of(a),
        threads: a.threads.unwrap_or_else(|| shared_bench::default_threads(ranks)),
        dir: a.dir.clone(),
        variant,
        timeout: Duration::from_secs(a.rank_timeout),
    }
}

/// One measurement: spawns `ranks` processes and collects their lines.
#[allow(clippy::too_many_arguments)]
fn measure(
    a: &PinArgs,
    exe: &std::path::Path,
    name: &str,
    size: usize,
    ranks: usize,
    v: Variant,
    backend: &str,
    devices: usize,
    phase: Option<PoolPhase>,
) -> Result<Measurement, String> {
    let mut children = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "pin", "--shared", "--as-rank", &r.to_string(), "--name", name])
            .args(["--ranks", &ranks.to_string(), "--size", &size.to_string(), "--variants", v.name])
            .args(["--slot", &a.slot.to_string(), "--file-bytes", &a.file_bytes.to_string()])
            .args(["--chunk", &chunk_of(a).to_string(), "--rank-timeout", &a.rank_timeout.to_string()])
            .args(["--backend", backend, "--device", &(r % devices).to_string()])
            .arg("--dir")
            .arg(&a.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(t) = a.threads {
            cmd.args(["--threads", &t.to_string()]);
        }
        if let Some(p) = phase {
            cmd.args(["--existing", "--pool-phase", p.name()]);
        }
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("starting rank {r}: {e}"));
            }
        }
    }
    let mut times = Vec::new();
    let mut errors = Vec::new();
    for (r, mut c) in children.into_iter().enumerate() {
        let mut got = None;
        if let Some(out) = c.stdout.take() {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                match RankTimes::parse(&line) {
                    Some(t) => got = Some(t),
                    None => eprintln!("  rank {r}: {line}"),
                }
            }
        }
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => errors.push(format!("rank {r} exited with {s}")),
            Err(e) => errors.push(format!("rank {r}: wait: {e}")),
        }
        match got {
            Some(t) => times.push(t),
            None => errors.push(format!("rank {r} printed no result")),
        }
    }
    let left = match phase {
        None => shared_bench::files_left(&a.dir, name),
        // The files stay for the existing run.
        Some(PoolPhase::Fresh) => {
            if shared_bench::files_left(&a.dir, name).is_empty() {
                errors.push("the persistent region's files are gone after the fresh run".into());
            }
            Vec::new()
        }
        Some(PoolPhase::Existing) => {
            if let Err(e) = Region::remove_persistent(name, &ShmOptions::new().dir(&a.dir)) {
                errors.push(format!("removing the persistent region: {e}"));
            }
            shared_bench::files_left(&a.dir, name)
        }
    };
    let threads = a.threads.unwrap_or_else(|| shared_bench::default_threads(ranks));
    Ok(Measurement { size, ranks, threads, variant: v, phase, times, left, errors })
}

/// A rank process of `--shared`.
fn run_as_rank(a: &PinArgs) -> Result<i32, String> {
    let rank = a.as_rank.unwrap_or(0);
    let name = a.name.as_deref().ok_or("--as-rank needs --name")?;
    let [ranks] = a.ranks[..] else { return Err("--as-rank needs one --ranks".into()) };
    let [size] = a.size[..] else { return Err("--as-rank needs one --size".into()) };
    let [variant] = &a.variants[..] else { return Err("--as-rank needs one --variants".into()) };
    let v = Variant::named(variant, a.file_bytes)?;
    let rt = match (a.backend, a.device) {
        (BackendArg::Cuda, Some(d)) => {
            CudaRuntime::open(d).map(kvoffload::internal::runtime::shared).map_err(|e| e.to_string())?
        }
        (b, _) => open(b)?,
    };
    let cfg = rank_config(a, name, rank, ranks, size, v);
    let t = if a.existing {
        let phase = PoolPhase::parse(a.pool_phase.as_deref().ok_or("--existing with --as-rank needs --pool-phase")?)?;
        pin_existing::run_pool_rank(&cfg, phase, rt.as_ref())
    } else {
        shared_bench::run_rank(&cfg, rt.as_ref())
    };
    println!("{}", t.to_line());
    Ok(if t.outcome == "pinned" { 0 } else { 1 })
}

/// Maps `size` bytes of anonymous memory, pre-faults them on every core and
/// unmaps them (a VM that grows its memory on first use, or hands freed
/// memory back, then has it at hand). Returns the seconds it took.
fn warm_up(size: usize) -> Result<f64, String> {
    use kvoffload::internal::pin::{HugePages, PinOptions, Prepared};
    use kvoffload::internal::region::{AnonOptions, Layout, Region};
    let t = Instant::now();
    let page = kvoffload::internal::region::page_size();
    let unit = if size % (2 << 20) == 0 { 2 << 20 } else { page };
    let layout = Layout::new(1, unit, (size / unit).max(1)).map_err(|e| e.to_string())?;
    let region = kvoffload::internal::sync::Arc::new(
        // The region's own checks (the memory this process can get among
        // them) before anything is mapped, as without --shared: a size
        // above what the machine or its cgroup has is refused here, not
        // met by the OOM killer while pre-faulting.
        Region::anonymous(layout, &AnonOptions::new()).map_err(|e| format!("warm-up of {}: {e}", fmt_bytes(size)))?,
    );
    // No GPU is involved: a simulated one stands in for the runtime the
    // coordinator that `Prepared` makes must guard (nothing is registered).
    let sim = kvoffload::internal::runtime::sim::SimRuntime::new();
    let prepared =
        Prepared::new(&sim, &region, &PinOptions::default().huge_pages(HugePages::On)).map_err(|e| e.to_string())?;
    if let Some(pf) = prepared.prefaulter() {
        pf.ensure_typed(0, region.as_ptr() as usize, region.len()).map_err(|e| format!("warm-up: {e}"))?;
    }
    drop(prepared);
    drop(region);
    Ok(t.elapsed().as_secs_f64())
}
