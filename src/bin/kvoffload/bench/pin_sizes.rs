//! `kvoffload bench pin --sizes 16GiB,64GiB,96GiB`: pinning at several
//! region sizes in one run, each against the one-call baseline and the
//! bound of its slower stage.
//!
//! Per size, in this order, each on fresh untouched anonymous memory:
//! 1. **first touch**: the defaults (b) once, reported on its own line and
//!    left out of every median. It is also the size's warm-up: in a virtual
//!    machine the host backs guest memory on first use (the first 16 GiB
//!    run of a fresh H200 machine gave 7.0 GB/s), so the first run of a
//!    size larger than any before pays for memory nobody touched yet;
//! 2. `repeat` runs (at least 3) of (a), one `host_register` call over the
//!    untouched region (upstream's path), one after the other;
//! 3. **after the baseline**: the defaults once more, reported apart and
//!    left out of the medians: the run right after (a) freed its region's
//!    4 KiB pages finds huge pages slow to get (on the H200 machine, 1.4 -
//!    9.9 GB/s with compaction and reclaim stalls, where the next runs
//!    reached 30 - 37: docs/gpu-runs/2026-12-02-pin-sizes/), a state of the
//!    machine that one run clears; the rounds after it are warm;
//! 4. `repeat` rounds of: (b) the pipeline with its defaults, (s) the same
//!    pipeline with its overlap off, which times its two stages apart:
//!    pre-faulting alone (the pinning thread's wait for each chunk to be
//!    resident) and registering alone (the rest), (h) 4 KiB pages, and the
//!    candidates.
//!
//! The stage bound of a round is the region's bytes over the longer of the
//! two stage times: what a perfect pipeline of those two stages would
//! reach. The report gives, per size, the median and the spread (min -
//! max, and (max - min) / median) of (a), (b), pre-fault alone, register
//! alone and the bound, and (b) against the bound and against (a).

use std::fmt;
use std::path::Path;

use crate::run::metrics::ratio;
use kvoffload::internal::runtime::GpuRuntime;

use super::{fmt_bytes, median, one_call, pipeline, plan, BenchConfig, Group, Progress, Row, RunConfig};

/// Counters of /proc/vmstat that say how the kernel got huge pages for a
/// run (what the collapse near the memory limit points at): transparent
/// huge pages faulted in, faults that fell back to 4 KiB pages, direct
/// compaction stalls (and the failed ones), and direct reclaim stalls
/// (movable and normal zones: page cache given back for the region).
pub const VMSTAT_KEYS: [&str; 6] = [
    "thp_fault_alloc",
    "thp_fault_fallback",
    "compact_stall",
    "compact_fail",
    "allocstall_movable",
    "allocstall_normal",
];

/// The [`VMSTAT_KEYS`] counters, or how much they grew over a run.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct VmStat(pub [u64; 6]);

impl VmStat {
    /// Reads /proc/vmstat now (None where it cannot be read).
    pub fn read() -> Option<VmStat> {
        Self::parse(&std::fs::read_to_string("/proc/vmstat").ok()?)
    }

    fn parse(text: &str) -> Option<VmStat> {
        let mut v = [None; 6];
        for line in text.lines() {
            let mut it = line.split_whitespace();
            if let (Some(k), Some(n)) = (it.next(), it.next()) {
                if let Some(i) = VMSTAT_KEYS.iter().position(|x| *x == k) {
                    v[i] = n.parse().ok();
                }
            }
        }
        // A kernel without THP or compaction lacks some: count them as 0.
        v.iter().any(Option::is_some).then(|| VmStat(v.map(|x| x.unwrap_or(0))))
    }

    /// `self - before`, counter by counter.
    pub fn since(&self, before: &VmStat) -> VmStat {
        VmStat(std::array::from_fn(|i| self.0[i].saturating_sub(before.0[i])))
    }
}

impl fmt::Display for VmStat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [alloc, fallback, stall, fail, movable, normal] = self.0;
        write!(
            f,
            "THP faults +{alloc}, fell back to 4 KiB +{fallback}, compaction stalls +{stall} (failed +{fail}), \
             reclaim stalls +{}",
            movable + normal
        )
    }
}

/// Runs `f` and returns its row with the vmstat growth over it; prints
/// the row on stderr as it ends (a long run's figures survive a run cut
/// short).
fn with_vmstat(size: usize, f: impl FnOnce() -> Row) -> (Row, Option<VmStat>) {
    let before = VmStat::read();
    let row = f();
    let delta = VmStat::read().zip(before).map(|(a, b)| a.since(&b));
    let gb = match &row.outcome {
        Ok(()) => format!("{:.2} GB/s", row.gbps(size)),
        Err(e) => format!("FAILED ({e})"),
    };
    eprintln!(
        "  {}: [{}] {gb} in {:.2} s (fault wait {:.2} s){}{}",
        fmt_bytes(size),
        row.label,
        row.total_s,
        row.fault_wait_s.unwrap_or(0.0),
        delta.map_or(String::new(), |v| format!("; {v}")),
        row.slice_gbps.map_or(String::new(), |h| format!("; slices by GB/s/worker {}", hist(&h)))
    );
    (row, delta)
}

/// One round of one size.
#[derive(Clone, Debug)]
pub struct Round {
    /// (a) one call.
    pub one_call: Row,
    /// (b) the defaults.
    pub defaults: Row,
    /// (s) the defaults without overlap: the stages apart.
    pub split: Row,
    /// (h) the defaults with huge pages off (4 KiB pages: no huge-page
    /// allocation, no compaction), the fallback candidate near the memory
    /// limit.
    pub huge_off: Row,
    /// /proc/vmstat's growth over (b).
    pub defaults_vm: Option<VmStat>,
    /// /proc/vmstat's growth over (s).
    pub split_vm: Option<VmStat>,
    /// The candidates' runs ([`SizesReport::candidates`], in that order),
    /// each with /proc/vmstat's growth over it.
    pub candidates: Vec<(Row, Option<VmStat>)>,
}

impl Round {
    /// Seconds of the two stages apart: (pre-fault, register).
    fn stage_s(&self) -> Option<(f64, f64)> {
        if self.split.outcome.is_err() {
            return None;
        }
        let fault = self.split.fault_wait_s?;
        let reg = self.split.total_s - fault;
        (fault > 0.0 && reg > 0.0).then_some((fault, reg))
    }
}

/// Everything measured at one size.
#[derive(Clone, Debug)]
pub struct SizeResult {
    /// Bytes of the region.
    pub size: usize,
    /// The first run of the size (the defaults), not in the medians.
    pub first_touch: Row,
    /// The defaults right after the baseline runs (None without them), not
    /// in the medians, with /proc/vmstat's growth over it.
    pub after_baseline: Option<(Row, Option<VmStat>)>,
    /// With `--once --after-one-call`: the one call (a) run right before
    /// the size's one run (a figure of (a) like the rounds' ones).
    pub one_call_before: Option<Row>,
    /// /proc/vmstat's growth over the first touch.
    pub first_vm: Option<VmStat>,
    /// MemAvailable when the size started (how close to the memory limit
    /// the size runs).
    pub mem_available: Option<u64>,
    /// The measured rounds.
    pub rounds: Vec<Round>,
}

/// Median, min and max of some GB/s figures.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Spread {
    /// The median.
    pub median: f64,
    /// The smallest.
    pub min: f64,
    /// The largest.
    pub max: f64,
    /// How many figures.
    pub n: usize,
}

impl Spread {
    /// None when `v` is empty.
    pub fn of(v: Vec<f64>) -> Option<Spread> {
        let n = v.len();
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some(Spread { median: median(v)?, min, max, n })
    }

    /// (max - min) / median, in percent.
    pub fn spread_pct(&self) -> f64 {
        ratio(self.max - self.min, self.median) * 100.0
    }
}

impl fmt::Display for Spread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2} [{:.2}-{:.2}, {:.0}%]", self.median, self.min, self.max, self.spread_pct())
    }
}

/// Which figure of a round.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Figure {
    /// (a).
    OneCall,
    /// (b).
    Defaults,
    /// Pre-faulting alone.
    Prefault,
    /// Registering alone.
    Register,
    /// The stage bound.
    Bound,
    /// (h): the defaults with 4 KiB pages.
    HugeOff,
    /// Candidate k of [`SizesReport::candidates`].
    Candidate(usize),
}

impl SizeResult {
    /// GB/s of `fig` in every round where it was measured.
    pub fn figures(&self, fig: Figure) -> Vec<f64> {
        let gb = self.size as f64 / 1e9;
        let ok = |r: &Row| r.outcome.is_ok() && r.total_s > 0.0;
        let before = match fig {
            Figure::OneCall => self.one_call_before.as_ref().filter(|r| ok(r)).map(|r| r.gbps(self.size)),
            _ => None,
        };
        before
            .into_iter()
            .chain(self.rounds.iter().filter_map(|r| match fig {
                Figure::OneCall => ok(&r.one_call).then(|| r.one_call.gbps(self.size)),
                Figure::Defaults => ok(&r.defaults).then(|| r.defaults.gbps(self.size)),
                Figure::Prefault => r.stage_s().map(|(f, _)| gb / f),
                Figure::Register => r.stage_s().map(|(_, g)| gb / g),
                Figure::Bound => r.stage_s().map(|(f, g)| gb / f.max(g)),
                Figure::HugeOff => ok(&r.huge_off).then(|| r.huge_off.gbps(self.size)),
                Figure::Candidate(k) => r.candidates.get(k).filter(|c| ok(&c.0)).map(|c| c.0.gbps(self.size)),
            }))
            .collect()
    }

    /// [`Spread`] of `fig`.
    pub fn spread(&self, fig: Figure) -> Option<Spread> {
        Spread::of(self.figures(fig))
    }
}

/// The whole run.
#[derive(Clone, Debug)]
pub struct SizesReport {
    /// `cuda` or `sim`.
    pub backend: &'static str,
    /// The runtime's description.
    pub device: String,
    /// The defaults (b).
    pub defaults: RunConfig,
    /// Other configurations run in every round after (h): the spec they
    /// were given as ([`RunConfig::with_spec`]) and the configuration.
    pub candidates: Vec<(String, RunConfig)>,
    /// A probe: one round, no one-call baseline (exploring candidates;
    /// its figures are not the committed kind).
    pub probe: bool,
    /// Only the first touch of each size, with the first candidate instead
    /// of the defaults when there is one (a machine state that one run
    /// changes, such as fragmented memory, is measured once per state).
    pub once: bool,
    /// With `once`: the run followed one (a) of the size (the state an
    /// engine restarting after a 4 KiB-pinned region was freed finds).
    pub after_one_call: bool,
    /// Every size, in the order run.
    pub sizes: Vec<SizeResult>,
    /// Seconds the whole bench took.
    pub wall_s: f64,
}

/// Runs every size of `sizes` with `base`'s threads and chunk bound and
/// `base.repeat.max(3)` rounds; each round also runs every candidate spec
/// (the defaults changed by it). A `probe` runs one round per size without
/// the one-call baseline.
#[allow(clippy::too_many_arguments)] // the bench's knobs, each a CLI flag
pub fn run(
    rt: &dyn GpuRuntime,
    sizes: &[usize],
    base: &BenchConfig,
    candidates: &[String],
    probe: bool,
    once: bool,
    after_one_call: bool,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<SizesReport, String> {
    if sizes.is_empty() {
        return Err("--sizes is empty".into());
    }
    for &s in sizes {
        BenchConfig { size: s, ..base.clone() }.validate()?;
    }
    let wall = std::time::Instant::now();
    let (defaults, _, _) = plan(&BenchConfig { quick: true, ..base.clone() });
    let split_cfg = RunConfig { pipelined: false, ..defaults.clone() };
    let small_cfg = RunConfig { huge_pages: kvoffload::internal::pin::HugePages::Off, ..defaults.clone() };
    let candidates: Vec<(String, RunConfig)> =
        candidates.iter().map(|spec| defaults.with_spec(spec).map(|c| (spec.clone(), c))).collect::<Result<_, _>>()?;
    let rounds = match (once, probe) {
        (true, _) => 0,
        (false, true) => 1,
        (false, false) => base.repeat.max(3),
    };
    let first_cfg = match (once, candidates.first()) {
        (true, Some((_, c))) => c.clone(),
        _ => defaults.clone(),
    };
    let mut out = Vec::with_capacity(sizes.len());
    for &size in sizes {
        let one_call_before = (once && after_one_call).then(|| {
            eprintln!("{}: one call before the run ...", fmt_bytes(size));
            with_vmstat(size, || one_call(rt, size, progress)).0
        });
        eprintln!("{}: first touch (the defaults once, reported apart) ...", fmt_bytes(size));
        let mem_available = kvoffload::internal::region::mem_available().ok();
        let (first_touch, first_vm) = with_vmstat(size, || pipeline(rt, size, Group::Defaults, &first_cfg, progress));
        let mut baseline: Vec<Row> = (0..rounds)
            .map(|k| {
                if probe {
                    let mut r = Row::empty(Group::OneCall, "one call (not run: probe)".into(), None, 1);
                    r.outcome = Err("not run (probe)".into());
                    r
                } else {
                    eprintln!("{}: one call {}/{rounds}", fmt_bytes(size), k + 1);
                    with_vmstat(size, || one_call(rt, size, progress)).0
                }
            })
            .collect();
        let after_baseline = (!probe && rounds > 0).then(|| {
            eprintln!("{}: the defaults once after the baseline (reported apart) ...", fmt_bytes(size));
            with_vmstat(size, || pipeline(rt, size, Group::Defaults, &defaults, progress))
        });
        let mut rs = Vec::with_capacity(rounds);
        for (k, one_call) in baseline.drain(..).enumerate() {
            eprintln!("{}: round {}/{rounds}", fmt_bytes(size), k + 1);
            let (d, defaults_vm) = with_vmstat(size, || pipeline(rt, size, Group::Defaults, &defaults, progress));
            let (split, split_vm) = with_vmstat(size, || pipeline(rt, size, Group::Sweep, &split_cfg, progress));
            let huge_off = with_vmstat(size, || pipeline(rt, size, Group::Sweep, &small_cfg, progress)).0;
            let cands = candidates
                .iter()
                .map(|(_, c)| with_vmstat(size, || pipeline(rt, size, Group::Sweep, c, progress)))
                .collect();
            rs.push(Round { one_call, defaults: d, split, huge_off, defaults_vm, split_vm, candidates: cands });
        }
        out.push(SizeResult {
            size,
            first_touch,
            first_vm,
            after_baseline,
            one_call_before,
            mem_available,
            rounds: rs,
        });
    }
    Ok(SizesReport {
        backend: rt.backend(),
        device: rt.describe(),
        defaults,
        candidates,
        probe,
        once,
        after_one_call,
        sizes: out,
        wall_s: wall.elapsed().as_secs_f64(),
    })
}

impl SizesReport {
    /// Writes the picture: median GB/s of (b), (a) and the stage bound
    /// against the region size, with min - max as separate series.
    pub fn write_svg(&self, path: &Path) -> Result<(), String> {
        use crate::plot::{lines, LineChart, Series};
        let series_of = |name: &str, fig: Figure, pick: fn(&Spread) -> f64| Series {
            name: name.to_string(),
            points: self
                .sizes
                .iter()
                .filter_map(|s| s.spread(fig).map(|sp| (s.size as f64 / (1u64 << 30) as f64, pick(&sp))))
                .collect(),
        };
        let mut series = vec![
            series_of("(b) defaults, median", Figure::Defaults, |s| s.median),
            series_of("(b) defaults, slowest", Figure::Defaults, |s| s.min),
            series_of("stage bound, median", Figure::Bound, |s| s.median),
            series_of("pre-fault alone, median", Figure::Prefault, |s| s.median),
            series_of("(h) 4 KiB pages (huge off), median", Figure::HugeOff, |s| s.median),
        ];
        // On the simulated GPU registration is instant: its figures would
        // only flatten the chart.
        if self.backend != "sim" {
            series.push(series_of("register alone, median", Figure::Register, |s| s.median));
            series.push(series_of("(a) one call (baseline), median", Figure::OneCall, |s| s.median));
        }
        let title = format!("Pinning anonymous memory ({}, {})", self.backend, self.device);
        lines(
            path,
            &LineChart {
                title: &title,
                x_label: "region size (GiB)",
                y_label: "GB/s (1e9 bytes/s)",
                log_x: false,
                series: &series,
                limits: &[],
                x_fmt: Some(|x| if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { format!("{x:.1}") }),
            },
        )
    }
}

/// The timeline of one pipeline run: per chunk, the pinning thread's wait
/// for pre-faulting (lane 0) and its registration (lane 1), from the run's
/// start (None for a run without waits recorded).
pub fn timeline_spans(r: &Row) -> Vec<crate::plot::Span> {
    use crate::plot::Span;
    let mut out = Vec::with_capacity(2 * r.waits.len());
    for (i, &(s, e)) in r.waits.iter().enumerate() {
        out.push(Span { lane: 0, start: s, end: e, label: None });
        let next = r.waits.get(i + 1).map_or(r.total_s, |w| w.0);
        if next > e {
            out.push(Span { lane: 1, start: e, end: next, label: None });
        }
    }
    out
}

impl SizesReport {
    /// Writes one timeline per size into `dir` (`pin-timeline-<size>.svg`):
    /// the slowest (b) run of the size's rounds, its chunks' pre-fault
    /// waits and registrations. Returns the paths written.
    pub fn write_timelines(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>, String> {
        let mut paths = Vec::new();
        for s in &self.sizes {
            let Some(slowest) = s
                .rounds
                .iter()
                .map(|r| &r.defaults)
                .filter(|r| r.outcome.is_ok() && !r.waits.is_empty())
                .max_by(|a, b| a.total_s.total_cmp(&b.total_s))
            else {
                continue;
            };
            let path = dir.join(format!("pin-timeline-{}.svg", fmt_bytes(s.size).replace(' ', "")));
            let title = format!(
                "Pinning {} with the defaults, slowest of {} rounds: {:.2} GB/s ({})",
                fmt_bytes(s.size),
                s.rounds.len(),
                slowest.gbps(s.size),
                self.backend
            );
            let lanes = ["waiting for pre-faulting", "registering"];
            crate::plot::timeline(&path, &title, &lanes, &timeline_spans(slowest))?;
            paths.push(path);
        }
        Ok(paths)
    }
}

/// A slice histogram as `<0.125:n <0.25:n ... >=8:n` (empty buckets left out).
fn hist(h: &[u64; 8]) -> String {
    use kvoffload::internal::pin::SLICE_GBPS_EDGES;
    let mut parts = Vec::new();
    for (k, &n) in h.iter().enumerate() {
        if n == 0 {
            continue;
        }
        parts.push(match SLICE_GBPS_EDGES.get(k) {
            Some(e) => format!("<{e}:{n}"),
            None => format!(">={}:{n}", SLICE_GBPS_EDGES[SLICE_GBPS_EDGES.len() - 1]),
        });
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(" ")
    }
}

impl fmt::Display for SizesReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "kvoffload bench pin --sizes: fresh untouched anonymous memory for every run")?;
        writeln!(f, "backend: {} ({})", self.backend, self.device)?;
        writeln!(f, "defaults (b): {}", super::describe(&self.defaults))?;
        if self.backend == "sim" {
            writeln!(
                f,
                "NOTE: simulated GPU: registration is instant, so only the host-side work is measured; \
                 (a), register alone and the ratios mean nothing here. Run with --backend cuda on a GPU machine."
            )?;
        }
        writeln!(f)?;
        writeln!(f, "every run (GB/s; (s): overlap off, its two stages apart):")?;
        for s in &self.sizes {
            let g = |r: &Row| match &r.outcome {
                Ok(()) => format!("{:.2}", r.gbps(s.size)),
                Err(e) => format!("FAILED ({e})"),
            };
            let thp = |r: &Row| {
                r.thp_bytes.map_or("-".into(), |b| format!("{:.0}%", (b as f64 * 100.0 / s.size as f64).min(100.0)))
            };
            let vm = |tag: &str, v: &Option<VmStat>| v.map_or(String::new(), |v| format!("; {tag} {v}"));
            let slices = |r: &Row| {
                let mut t = r.slice_gbps.map_or(String::new(), |h| format!("; slices by GB/s/worker {}", hist(&h)));
                if let Some((at, gbps)) = r.huge_fallback {
                    t += &format!("; fell back to 4 KiB at {:.0}% ({gbps:.2} GB/s/worker)", at * 100.0);
                }
                t
            };
            if let Some(m) = s.mem_available {
                writeln!(
                    f,
                    "  {:>7} MemAvailable {} at the start: the region is {:.0}% of it",
                    fmt_bytes(s.size),
                    fmt_bytes(m as usize),
                    s.size as f64 * 100.0 / m.max(1) as f64
                )?;
            }
            if let Some(r) = &s.one_call_before {
                writeln!(f, "  {:>7} one call (a) right before the run: {}", fmt_bytes(s.size), g(r))?;
            }
            writeln!(
                f,
                "  {:>7} first touch {} {} (THP {}, fault wait {:.2} s{}{})",
                fmt_bytes(s.size),
                if self.once { format!("[{}]", s.first_touch.label) } else { "(b)".into() },
                g(&s.first_touch),
                thp(&s.first_touch),
                s.first_touch.fault_wait_s.unwrap_or(0.0),
                vm("(b)", &s.first_vm),
                slices(&s.first_touch)
            )?;
            if let Some((r, v)) = &s.after_baseline {
                writeln!(
                    f,
                    "  {:>7} after the baseline (b) {} (THP {}, fault wait {:.2} s{}{})",
                    fmt_bytes(s.size),
                    g(r),
                    thp(r),
                    r.fault_wait_s.unwrap_or(0.0),
                    vm("(b)", v),
                    slices(r)
                )?;
            }
            for (k, r) in s.rounds.iter().enumerate() {
                let stages = r.stage_s().map_or("-".into(), |(p, q)| {
                    let gb = s.size as f64 / 1e9;
                    format!("pre-fault {:.2}, register {:.2}", gb / p, gb / q)
                });
                writeln!(
                    f,
                    "  {:>7} round {}: (a) {}, (b) {} (THP {}, fault wait {:.2} s), (s) {} ({stages}), (h) {}{}",
                    fmt_bytes(s.size),
                    k + 1,
                    g(&r.one_call),
                    g(&r.defaults),
                    thp(&r.defaults),
                    r.defaults.fault_wait_s.unwrap_or(0.0),
                    g(&r.split),
                    g(&r.huge_off),
                    vm("(b)", &r.defaults_vm) + &vm("(s)", &r.split_vm) + &slices(&r.defaults)
                )?;
                for ((spec, _), (c, cvm)) in self.candidates.iter().zip(&r.candidates) {
                    writeln!(
                        f,
                        "  {:>7} round {}: candidate [{spec}] {} (THP {}, fault wait {:.2} s{}{})",
                        fmt_bytes(s.size),
                        k + 1,
                        g(c),
                        thp(c),
                        c.fault_wait_s.unwrap_or(0.0),
                        vm("", cvm),
                        slices(c)
                    )?;
                }
            }
        }
        writeln!(f)?;
        writeln!(f, "median [min-max, spread = (max-min)/median] over the rounds, GB/s:")?;
        writeln!(
            f,
            "{:>7} {:>11} {:>26} {:>26} {:>26} {:>26} {:>26} {:>8} {:>7} {:>26}",
            "size",
            "first touch",
            "(a) one call",
            "(b) defaults",
            "pre-fault alone",
            "register alone",
            "stage bound",
            "b/bound",
            "b/a",
            "(h) 4 KiB pages"
        )?;
        for s in &self.sizes {
            let sp = |fig| s.spread(fig).map_or("-".to_string(), |x| x.to_string());
            let med = |fig| s.spread(fig).map(|x| x.median);
            let ratio = |a: Option<f64>, b: Option<f64>, pct: bool| match (a, b) {
                (Some(a), Some(b)) if b > 0.0 => {
                    if pct {
                        format!("{:.0}%", a / b * 100.0)
                    } else {
                        format!("{:.1}x", a / b)
                    }
                }
                _ => "-".into(),
            };
            let first = if s.first_touch.outcome.is_ok() {
                format!("{:.2}", s.first_touch.gbps(s.size))
            } else {
                "FAILED".into()
            };
            writeln!(
                f,
                "{:>7} {:>11} {:>26} {:>26} {:>26} {:>26} {:>26} {:>8} {:>7} {:>26}",
                fmt_bytes(s.size).replace(' ', ""),
                first,
                sp(Figure::OneCall),
                sp(Figure::Defaults),
                sp(Figure::Prefault),
                sp(Figure::Register),
                sp(Figure::Bound),
                ratio(med(Figure::Defaults), med(Figure::Bound), true),
                ratio(med(Figure::Defaults), med(Figure::OneCall), false),
                sp(Figure::HugeOff)
            )?;
        }
        writeln!(
            f,
            "stage bound: the region's bytes over the longer of pre-faulting alone and registering alone (the same \
             round's (s) run): what a perfect two-stage pipeline would reach; b/bound and b/a from the medians; \
             (h): the defaults with huge pages off (no huge-page allocation or compaction: what falling back to \
             4 KiB pages near the memory limit would give)"
        )?;
        for (k, (spec, cfg)) in self.candidates.iter().enumerate() {
            writeln!(f, "candidate [{spec}]: {}", super::describe(cfg))?;
            for s in &self.sizes {
                let Some(c) = s.spread(Figure::Candidate(k)) else {
                    writeln!(f, "  {:>7} -", fmt_bytes(s.size).replace(' ', ""))?;
                    continue;
                };
                let of = |fig| s.spread(fig).map(|x| x.median).filter(|&m| m > 0.0);
                let pct = |m: Option<f64>| m.map_or("-".into(), |m| format!("{:.0}%", c.median / m * 100.0));
                writeln!(
                    f,
                    "  {:>7} {c} GB/s: {} of (b), {} of the stage bound",
                    fmt_bytes(s.size).replace(' ', ""),
                    pct(of(Figure::Defaults)),
                    pct(of(Figure::Bound))
                )?;
            }
        }
        if self.once {
            writeln!(
                f,
                "ONCE: only the first touch of each size was run{}",
                if self.after_one_call { ", right after one (a) of the size" } else { "" }
            )?;
        }
        if self.probe {
            writeln!(f, "PROBE: one round per size and no one-call baseline; not a committed measurement")?;
        }
        write!(f, "bench wall time: {:.1} s", self.wall_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(group: Group, total_s: f64, fault: Option<f64>, ok: bool) -> Row {
        let mut r = Row::empty(group, "x".into(), None, 1);
        r.total_s = total_s;
        r.fault_wait_s = fault;
        if !ok {
            r.outcome = Err("failed".into());
        }
        r
    }

    #[test]
    fn the_bound_is_the_slower_stage_and_failed_runs_are_left_out() {
        let size = 4_000_000_000usize; // 4 GB
        let round = |a: f64, b: f64, fault: f64, split_total: f64| Round {
            one_call: row(Group::OneCall, a, None, true),
            defaults: row(Group::Defaults, b, Some(0.0), true),
            split: row(Group::Sweep, split_total, Some(fault), true),
            huge_off: row(Group::Sweep, 2.0 * b, Some(0.0), true),
            defaults_vm: None,
            split_vm: None,
            candidates: Vec::new(),
        };
        let mut failed = round(1.0, 1.0, 0.1, 1.0);
        failed.defaults.outcome = Err("x".into());
        failed.split.outcome = Err("x".into());
        failed.huge_off.outcome = Err("x".into());
        let s = SizeResult {
            size,
            first_touch: row(Group::Defaults, 4.0, Some(1.0), true),
            first_vm: None,
            after_baseline: None,
            one_call_before: None,
            mem_available: None,
            rounds: vec![
                // pre-fault 0.1 s (40 GB/s), register 0.2 s (20): bound 20.
                round(2.0, 0.25, 0.1, 0.3),
                // pre-fault 0.4 s (10), register 0.1 s (40): bound 10.
                round(1.0, 0.5, 0.4, 0.5),
                round(4.0, 0.2, 0.2, 0.4),
                failed,
            ],
        };
        let b = s.spread(Figure::Bound).unwrap();
        assert_eq!(b.n, 3);
        assert!((b.min - 10.0).abs() < 1e-9 && (b.max - 20.0).abs() < 1e-9 && (b.median - 20.0).abs() < 1e-9, "{b:?}");
        let d = s.spread(Figure::Defaults).unwrap();
        assert_eq!(d.n, 3); // the failed (b) is not a figure
        assert!((d.median - 16.0).abs() < 1e-9, "{d:?}");
        assert!((d.spread_pct() - (20.0 - 8.0) / 16.0 * 100.0).abs() < 1e-9);
        assert_eq!(s.figures(Figure::OneCall).len(), 4);
        assert!((s.spread(Figure::Prefault).unwrap().median - 20.0).abs() < 1e-9);
        assert!((s.spread(Figure::Register).unwrap().median - 20.0).abs() < 1e-9);
        // (h) took twice (b)'s time in every round: half its GB/s.
        assert!((s.spread(Figure::HugeOff).unwrap().median - 8.0).abs() < 1e-9);
        // A split with no fault wait gives no stage figures.
        let zero = SizeResult { rounds: vec![round(1.0, 1.0, 0.0, 1.0)], ..s.clone() };
        assert!(zero.spread(Figure::Bound).is_none());
        assert!(Spread::of(vec![]).is_none());
    }

    #[test]
    fn the_timeline_alternates_waits_and_registrations() {
        let mut r = row(Group::Defaults, 1.0, Some(0.3), true);
        r.waits = vec![(0.0, 0.2), (0.5, 0.6), (0.6, 0.6)];
        let spans = timeline_spans(&r);
        let got: Vec<(usize, f64, f64)> = spans.iter().map(|s| (s.lane, s.start, s.end)).collect();
        // Chunk 1 was resident when asked for (no registration gap before
        // chunk 2 either): the last registration runs to the end.
        assert_eq!(got, vec![(0, 0.0, 0.2), (1, 0.2, 0.5), (0, 0.5, 0.6), (0, 0.6, 0.6), (1, 0.6, 1.0)]);
    }

    #[test]
    fn the_report_keeps_the_first_touch_apart_and_prints_every_size() {
        let size = 1usize << 30;
        let r = |t| row(Group::Defaults, t, Some(t / 2.0), true);
        let s = SizeResult {
            size,
            first_touch: r(10.0),
            first_vm: Some(VmStat([512, 7, 3, 1, 2, 3])),
            after_baseline: Some((r(1.0), None)),
            one_call_before: None,
            mem_available: Some(4 << 30),
            rounds: (0..3)
                .map(|_| Round {
                    one_call: row(Group::OneCall, 1.0, None, true),
                    defaults: r(0.1),
                    split: r(0.2),
                    huge_off: r(0.4),
                    defaults_vm: None,
                    split_vm: None,
                    candidates: Vec::new(),
                })
                .collect(),
        };
        let rep = SizesReport {
            backend: "sim",
            device: "simulated".into(),
            defaults: plan(&BenchConfig { quick: true, ..BenchConfig::new(size) }).0,
            candidates: Vec::new(),
            probe: false,
            once: false,
            after_one_call: false,
            sizes: vec![s.clone(), SizeResult { size: 2 * size, ..s }],
            wall_s: 1.0,
        };
        let text = rep.to_string();
        // The first touch (0.11 GB/s) is printed, but the medians ignore it.
        assert!(text.contains("first touch (b) 0.11"), "{text}");
        // The run after the baseline is printed apart and out of the medians.
        assert!(text.contains("after the baseline (b) 1.07"), "{text}");
        assert!(text.contains("10.74 [10.74-10.74, 0%]"), "{text}");
        assert!(text.contains("1 GiB") && text.contains("2 GiB"), "{text}");
        assert!(!text.contains("FAILED"), "{text}");
        assert!(text.contains("fell back to 4 KiB +7, compaction stalls +3 (failed +1), reclaim stalls +5"), "{text}");
        assert!(text.contains("MemAvailable 4 GiB at the start: the region is 25% of it"), "{text}");
    }

    #[test]
    fn vmstat_counters_are_read_and_subtracted() {
        let before = VmStat::parse("pgfault 5\nthp_fault_alloc 10\ncompact_stall 2\nthp_fault_fallback 1\n").unwrap();
        assert_eq!(before, VmStat([10, 1, 2, 0, 0, 0]));
        let after = VmStat([15, 4, 2, 1, 6, 0]);
        assert_eq!(after.since(&before), VmStat([5, 3, 0, 1, 6, 0]));
        assert_eq!(VmStat::parse("pgfault 5\n"), None);
        // This machine's, if it has one, parses.
        if std::path::Path::new("/proc/vmstat").exists() {
            assert!(VmStat::read().is_some());
        }
    }
}
