//! `kvoffload bench transfer`: store and load GB/s of scattered fragments
//! for every copy backend and the automatic choice, data checked after
//! every run (library side: [`crate::bench::transfer`]).

use super::backend::{open, BackendArg};
use crate::bench::transfer::{parse_size, run_bench, BenchConfig, BenchReport};
use crate::plot::{lines, Limit, LineChart, Series};
use kvoffload::internal::runtime::Direction;
use kvoffload::internal::transfer::{Backend, BackendChoice};
use kvoffload::Named;

/// Arguments of `kvoffload bench transfer`.
#[derive(clap::Args, Debug)]
pub struct TransferArgs {
    /// Runtime: auto (cuda if a GPU can be opened, else sim), sim or cuda.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Fragment sizes, comma-separated (B, KiB, MiB, GiB).
    #[arg(long, value_delimiter = ',', default_value = "16KiB,32KiB,64KiB,256KiB,2MiB")]
    sizes: Vec<String>,
    /// Bytes per run (default 1GiB on a GPU, 8MiB on the simulated GPU).
    #[arg(long)]
    total: Option<String>,
    /// Run only these backends (next to the per-fragment baseline),
    /// comma-separated: per-fragment, batched, gather, staged or auto.
    #[arg(long, value_delimiter = ',')]
    force: Vec<String>,
    /// Leave out the per-fragment baseline (slow at small fragments).
    #[arg(long)]
    no_baseline: bool,
    /// Pages of one host block, comma-separated, one run each: 1 scatters
    /// every host page; more make each host block one contiguous run (one
    /// page of each of that many layers, block major).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    layers: Vec<usize>,
    /// Job size of the both-ways runs (each direction's half in jobs of
    /// about this size, loads and stores alternating).
    #[arg(long)]
    both_job: Option<String>,
    /// Bytes of each handler's device staging memory (staged backend; 0:
    /// none).
    #[arg(long)]
    staging: Option<String>,
    /// Auto: mean host run from which the staged backend is used while the
    /// other direction is busy ("never" to turn it off).
    #[arg(long)]
    staged_duplex_min_run: Option<String>,
    /// Auto: mean host run from which the staged backend is used even when
    /// the other direction is idle ("never": only while it is busy).
    #[arg(long)]
    staged_min_run: Option<String>,
    /// Timed repetitions per run; the fastest counts.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Registration chunk size of the host buffer.
    #[arg(long)]
    chunk: Option<String>,
    /// Seed of the block permutations.
    #[arg(long)]
    seed: Option<u64>,
    /// Auto: largest mean fragment size for the gather kernel.
    #[arg(long)]
    gather_max: Option<String>,
    /// Auto: smallest mean fragment size for per-fragment copies.
    #[arg(long)]
    per_fragment_min: Option<String>,
    /// Entries of the gather kernel's device descriptor table (fragments
    /// per launch).
    #[arg(long)]
    table_entries: Option<usize>,
    /// Load and store backends to run at the same time, as LOAD/STORE pairs,
    /// comma-separated (auto, gather, staged, batched, per-fragment), or none.
    #[arg(long, value_delimiter = ',', default_value = "auto/auto")]
    both: Vec<String>,
    /// Also draw the results: in this directory one SVG per direction and
    /// host-block shape (--layers value), GB/s against fragment size for
    /// each backend, alone and with a job the other way, with the link's
    /// limit.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
    /// The limit drawn on the pictures, GB/s: by default the H200's pinned
    /// 1 GiB copy, one way (docs/driver-rules.md, row "Large fragments").
    #[arg(long, default_value_t = LINK_GBPS)]
    link_gbps: f64,
}

/// Pinned 1 GiB copies on the H200 (cuMemcpyAsync, one way), the fastest a
/// copy of the host region went: docs/driver-rules.md, row "Large
/// fragments".
const LINK_GBPS: f64 = 55.4;

/// One picture per direction and host-block shape: a series per backend
/// (alone, or with a job the other way), points at each fragment size;
/// failed rows left out.
fn draw(report: &BenchReport, dir: &std::path::Path, link_gbps: f64) -> Result<Vec<std::path::PathBuf>, String> {
    super::svg_dir(dir)?;
    let mut written = Vec::new();
    for (&layers, direction) in
        report.config.layers.iter().flat_map(|l| [(l, Direction::DeviceToHost), (l, Direction::HostToDevice)])
    {
        let dname = direction.name();
        let mut series: Vec<Series> = Vec::new();
        let rows = report.rows.iter().filter(|r| r.layers == layers && r.direction == direction);
        for r in rows.filter(|r| r.error.is_none() && r.verified && r.gbps > 0.0) {
            let name = match r.other {
                Some(o) => format!("{} (a {o} job the other way)", r.choice),
                None => r.choice.to_string(),
            };
            match series.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push((r.size as f64 / 1024.0, r.gbps)),
                None => series.push(Series { name, points: vec![(r.size as f64 / 1024.0, r.gbps)] }),
            }
        }
        for s in &mut series {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        let shape =
            if layers == 1 { "host pages scattered".to_string() } else { format!("host blocks of {layers} pages") };
        if series.is_empty() {
            continue;
        }
        let path = dir.join(format!("transfer-{dname}-layers{layers}.svg"));
        let title = format!("{dname}s, {shape}: {}", report.device);
        let limits = [Limit { name: format!("pinned 1 GiB copy, {link_gbps} GB/s"), y: link_gbps }];
        let chart = LineChart {
            title: &title,
            x_label: "fragment KiB",
            y_label: "GB/s",
            log_x: true,
            series: &series,
            limits: &limits,
            x_fmt: None,
        };
        lines(&path, &chart)?;
        written.push(path);
    }
    Ok(written)
}

/// Runs the bench; exit status 1 when any run's data was wrong.
pub fn run(a: TransferArgs) -> Result<i32, String> {
    let rt = open(a.backend)?;
    let mut cfg = if rt.backend() == "sim" { BenchConfig::sim_default() } else { BenchConfig::gpu_default() };
    cfg.sizes = a.sizes.iter().map(|s| parse_size(s)).collect::<Result<_, _>>()?;
    if let Some(t) = &a.total {
        cfg.total = parse_size(t)?;
    }
    if let Some(c) = &a.chunk {
        cfg.chunk_bytes = parse_size(c)?;
    }
    if let Some(s) = a.seed {
        cfg.seed = s;
    }
    cfg.repeats = a.repeats;
    cfg.both = Vec::new();
    for p in a.both.iter().filter(|p| p.as_str() != "none") {
        let (l, s) =
            p.split_once('/').ok_or_else(|| format!("--both {p}: expected LOAD/STORE, e.g. gather/batched"))?;
        cfg.both.push((
            BackendChoice::from_name(l).map_err(|e| e.to_string())?,
            BackendChoice::from_name(s).map_err(|e| e.to_string())?,
        ));
    }
    if let Some(g) = &a.gather_max {
        cfg.options.thresholds.gather_max_bytes = parse_size(g)?;
    }
    if let Some(p) = &a.per_fragment_min {
        cfg.options.thresholds.per_fragment_min_bytes = parse_size(p)?;
    }
    if let Some(t) = a.table_entries {
        cfg.options.gather_table_entries = t;
    }
    let size_or_never = |s: &str| if s == "never" { Ok(usize::MAX) } else { parse_size(s) };
    if let Some(s) = &a.staging {
        cfg.options.staging_bytes = parse_size(s)?;
    }
    if let Some(s) = &a.staged_duplex_min_run {
        cfg.options.thresholds.staged_duplex_min_run_bytes = size_or_never(s)?;
    }
    if let Some(s) = &a.staged_min_run {
        cfg.options.thresholds.staged_min_run_bytes = size_or_never(s)?;
    }
    if let Some(j) = &a.both_job {
        cfg.both_job_bytes = parse_size(j)?;
    }
    cfg.layers = a.layers.clone();
    cfg.baseline = !a.no_baseline;
    if !a.force.is_empty() {
        cfg.choices =
            a.force.iter().map(|f| BackendChoice::from_name(f)).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
        cfg.choices.retain(|c| *c != BackendChoice::Force(Backend::PerFragment));
        if !cfg.baseline && a.force.iter().any(|f| f == "per-fragment") {
            cfg.choices.insert(0, BackendChoice::Force(Backend::PerFragment));
        }
    }
    cfg.validate()?;
    let runs = cfg.layers.len() * cfg.sizes.len() * (2 * (cfg.choices.len() + cfg.baseline as usize) + cfg.both.len());
    let bar = indicatif::ProgressBar::new(runs as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut started = false;
    let report = run_bench(rt, &cfg, |label| {
        if started {
            bar.inc(1);
        }
        started = true;
        bar.set_message(label.to_string());
    });
    bar.finish_and_clear();
    let report = report?;
    println!("{report}");
    if let Some(dir) = &a.svg {
        for p in draw(&report, dir, a.link_gbps)? {
            println!("picture: {}", p.display());
        }
    }
    Ok(if report.failures() == 0 { 0 } else { 1 })
}
