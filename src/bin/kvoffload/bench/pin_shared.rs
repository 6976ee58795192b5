//! `kvoffload bench pin --shared`: pinning a shared /dev/shm region from N
//! rank processes, today's one-file path against the multi-file path, in
//! one run.
//!
//! Each measurement is a fresh region of `size` bytes: N processes (the
//! binary re-executed, one per rank; rank r on GPU r mod the GPUs there
//! are) create or join it, pin what [`Region::pin_ranges`] gives them with
//! [`pin_with`] (the P7 agreement through the region's header) and
//! report their clock readings (CLOCK_MONOTONIC, one clock for every
//! process of the machine). The parent reports the region's bytes over:
//! - **pin**: from the first rank starting to pin to the last rank Pinned
//!   and agreed (the measure);
//! - **end to end**: from the first rank starting to create or join to the
//!   last rank Pinned and agreed (creating includes reserving the data
//!   files with `fallocate`, work the one-file path leaves to faulting).
//!
//! Variants ([`Variant`]):
//! - `old`: one file, row-interleaved layout, every rank pre-faults and
//!   registers the whole region (what the code did before data files);
//! - `new`: data files, rank-major layout, each rank reserves, pre-faults
//!   and registers its own share (the default shared path);
//! - `overlap`: `new` with the reservation left to the pre-fault workers
//!   (`ShmOptions::defer_reserve`: each slice reserved right before it is
//!   faulted), so create/join returns without reserving and reserving runs
//!   beside pre-faulting and registering;
//! - `new-noreserve`: `new` without `fallocate` (pages allocated by faults);
//! - `rows`: data files, row-interleaved layout (every rank registers the
//!   whole region, ranks start on different files): what a caller that
//!   keeps the row-interleaved layout gets from the data files alone.
//!
//! The library part (this module) is the rank's side and the report; the
//! CLI spawns the processes. With the simulated GPU registration is
//! instant, so only the host-side work is measured (the report says so).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::run::metrics::monotonic_secs;
use kvoffload::internal::pin::RegionSlots;
use kvoffload::internal::protocol::agreement::RankSlots;
use kvoffload::internal::protocol::PinState;
use kvoffload::internal::region::{pages, FileSplit, Layout, Order, Region, ShmOptions};
use kvoffload::internal::runtime::GpuRuntime;
use kvoffload::internal::sync::{self, Arc, Mutex};
use kvoffload::units::fmt_bytes;

use super::pin_existing::PoolPhase;

use kvoffload::internal::pin::Prepared;
use kvoffload::internal::pin::{available_cores, PinOptions};
use kvoffload::internal::pin::{pin_with, Agreement, PinObserver};

/// What one variant changes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Variant {
    /// Short name (`old`, `new`, `new-noreserve`, `rows`).
    pub name: &'static str,
    /// How the region is split into files.
    pub files: FileSplit,
    /// The layout's order.
    pub order: Order,
    /// Whether ranks reserve their data files.
    pub reserve: bool,
    /// Whether the reservation is left to the pre-fault workers
    /// (`ShmOptions::defer_reserve`): overlapped with pinning.
    pub defer: bool,
}

impl Variant {
    /// Every variant the bench knows, `old` and `new` first.
    pub fn all(file_bytes: usize) -> Vec<Variant> {
        let multi = FileSplit::Multi { max_file_bytes: file_bytes };
        vec![
            Variant {
                name: "old",
                files: FileSplit::Single,
                order: Order::RowInterleaved,
                reserve: false,
                defer: false,
            },
            Variant { name: "new", files: multi, order: Order::RankMajor, reserve: true, defer: false },
            Variant { name: "overlap", files: multi, order: Order::RankMajor, reserve: true, defer: true },
            Variant { name: "new-noreserve", files: multi, order: Order::RankMajor, reserve: false, defer: false },
            Variant { name: "rows", files: multi, order: Order::RowInterleaved, reserve: true, defer: false },
        ]
    }

    /// The variant called `name`.
    pub fn named(name: &str, file_bytes: usize) -> Result<Variant, String> {
        Self::all(file_bytes).into_iter().find(|v| v.name == name).ok_or_else(|| {
            format!(
                "unknown variant {name:?} (known: {})",
                Self::all(0).iter().map(|v| v.name).collect::<Vec<_>>().join(", ")
            )
        })
    }

    /// In words.
    pub fn describe(&self) -> String {
        let order = match self.order {
            Order::RowInterleaved => "rows, whole region per rank",
            Order::RankMajor => "rank-major, own share",
        };
        let reserve = match (self.files, self.reserve, self.defer) {
            (FileSplit::Single, _, _) => "",
            (_, true, false) => ", fallocate in create/join",
            (_, true, true) => ", fallocate per slice by the pre-fault workers (overlapped)",
            (_, false, _) => ", no fallocate",
        };
        format!("{}, {order}{reserve}", self.files.describe())
    }
}

/// One rank's part of one measurement.
#[derive(Clone, Debug)]
pub struct RankConfig {
    /// The region's name (shared by the ranks of one measurement).
    pub name: String,
    /// This rank.
    pub rank: usize,
    /// Ranks of the region.
    pub ranks: usize,
    /// Data bytes of the region.
    pub size: usize,
    /// Bytes of one slot (chunk of the layout).
    pub slot: usize,
    /// Registration chunk bound.
    pub chunk: usize,
    /// Pre-fault (and reserve) threads of this rank.
    pub threads: usize,
    /// Directory of the region's files.
    pub dir: PathBuf,
    /// The variant.
    pub variant: Variant,
    /// How long a rank waits for the others.
    pub timeout: Duration,
}

impl RankConfig {
    /// The region options of this rank's variant (create/join and the
    /// persistent region alike).
    pub fn shm_options(&self) -> ShmOptions {
        ShmOptions::new()
            .dir(&self.dir)
            .timeout(self.timeout)
            .files(self.variant.files)
            .reserve(self.variant.reserve)
            .defer_reserve(self.variant.defer)
            .threads(self.threads)
    }

    /// The region's layout: `size / (ranks * slot)` slots per rank.
    pub fn layout(&self) -> Result<Layout, String> {
        let row = self.ranks.checked_mul(self.slot).ok_or("ranks x slot overflows")?;
        if row == 0 || self.size % row != 0 || self.size == 0 {
            return Err(format!(
                "--size {} is not a positive multiple of ranks x slot = {}",
                fmt_bytes(self.size),
                fmt_bytes(row)
            ));
        }
        let per_rank = self.size / row;
        let l = Layout::new(self.ranks, self.slot, per_rank).map_err(|e| e.to_string())?;
        Ok(l.with_order(self.variant.order))
    }
}

/// What a rank measured (monotonic seconds, machine-wide).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankTimes {
    /// The rank.
    pub rank: usize,
    /// Before create/join.
    pub create: f64,
    /// After create/join returned (every rank mapped).
    pub created: f64,
    /// Before pinning started.
    pub pin: f64,
    /// This rank's own registrations done (pre-faulting settled).
    pub pinned: f64,
    /// Pinned and agreed by every rank.
    pub agreed: f64,
    /// Bytes this rank registered.
    pub share: u64,
    /// Bytes of the region this rank has mapped with 2 MiB pages after pinning.
    pub huge: u64,
    /// Files of the region.
    pub files: usize,
    /// Seconds to unregister afterwards.
    pub unregister: f64,
    /// `pinned`, or what went wrong.
    pub outcome: String,
}

/// Marker of a rank's result line on stdout.
pub const LINE_TAG: &str = "KVO-PIN-RANK";

impl RankTimes {
    /// One line for the parent.
    pub fn to_line(&self) -> String {
        format!(
            "{LINE_TAG} rank={} create={:.6} created={:.6} pin={:.6} pinned={:.6} agreed={:.6} share={} huge={} files={} unregister={:.6} outcome={}",
            self.rank,
            self.create,
            self.created,
            self.pin,
            self.pinned,
            self.agreed,
            self.share,
            self.huge,
            self.files,
            self.unregister,
            // One token: '%' and ' ' escaped (underscores, e.g. in
            // "nr_hugepages", stay as they are).
            self.outcome.replace('%', "%25").replace(' ', "%20")
        )
    }

    /// Parses [`RankTimes::to_line`].
    pub fn parse(line: &str) -> Option<RankTimes> {
        let rest = line.strip_prefix(LINE_TAG)?;
        let mut t = RankTimes::default();
        for kv in rest.split_whitespace() {
            let (k, v) = kv.split_once('=')?;
            let f = || v.parse::<f64>().ok();
            match k {
                "rank" => t.rank = v.parse().ok()?,
                "create" => t.create = f()?,
                "created" => t.created = f()?,
                "pin" => t.pin = f()?,
                "pinned" => t.pinned = f()?,
                "agreed" => t.agreed = f()?,
                "share" => t.share = v.parse().ok()?,
                "huge" => t.huge = v.parse().ok()?,
                "files" => t.files = v.parse().ok()?,
                "unregister" => t.unregister = f()?,
                "outcome" => t.outcome = v.replace("%20", " ").replace("%25", "%"),
                _ => {}
            }
        }
        Some(t)
    }
}

/// Notes when this rank's pinning settles (its registrations are done).
pub(crate) struct Settled {
    pub(crate) at: Mutex<Option<f64>>,
}

impl PinObserver for Settled {
    fn settled(&self) {
        sync::lock(&self.at).get_or_insert_with(monotonic_secs);
    }
}

/// Runs one rank of one measurement on `rt`: create (rank 0) or join, pin
/// with the agreement, unregister, and report. Errors end up in the
/// outcome; the times taken so far are kept.
pub fn run_rank(cfg: &RankConfig, rt: &dyn GpuRuntime) -> RankTimes {
    let mut t = RankTimes { rank: cfg.rank, ..Default::default() };
    if let Err(e) = run_rank_inner(cfg, rt, &mut t) {
        t.outcome = format!("FAILED: {e}");
    }
    t
}

fn run_rank_inner(cfg: &RankConfig, rt: &dyn GpuRuntime, t: &mut RankTimes) -> Result<(), String> {
    let layout = cfg.layout()?;
    let opts = cfg.shm_options();
    t.create = monotonic_secs();
    let region = if cfg.rank == 0 {
        Region::create(&cfg.name, layout, 0, &opts)
    } else {
        Region::join(&cfg.name, layout, cfg.rank, &opts)
    }
    .map_err(|e| e.to_string())?;
    t.created = monotonic_secs();
    t.files = region.file_paths().len();
    let region = Arc::new(region);
    t.pin = monotonic_secs();
    let popts = PinOptions::default().threads(cfg.threads).max_chunk_bytes(cfg.chunk);
    let prepared = Prepared::new(rt, &region, &popts).map_err(|e| e.to_string())?;
    t.share = prepared.bytes() as u64;
    let (coord, prefault) = prepared.into_parts();
    let settled = Settled { at: Mutex::new(None) };
    let slots: Arc<dyn RankSlots> = match RegionSlots::new(region.clone()) {
        Some(s) => Arc::new(s),
        None => return Err("the region is not shared".into()),
    };
    let agreement = Agreement { slots, rank: cfg.rank, timeout: Some(cfg.timeout) };
    let state = pin_with(rt, &coord, prefault.as_ref(), Some(&settled), Some(&agreement.into())).agreed();
    t.agreed = monotonic_secs();
    t.pinned = sync::lock(&settled.at).unwrap_or(t.agreed);
    t.huge = pages::huge_mapped_bytes(region.mapping_range().addr_range()).unwrap_or(0);
    t.outcome = match &state {
        Ok(PinState::Pinned) => "pinned".into(),
        Ok(s) => format!("ended {s:?}"),
        Err(e) => format!("agreement failed: {e}"),
    };
    if coord.pinning().registered_chunks() > 0 {
        let u = Instant::now();
        coord.pinning().unregister_all(rt).map_err(|e| format!("unregister: {e}"))?;
        t.unregister = u.elapsed().as_secs_f64();
    }
    Ok(())
}

/// One measurement: a variant at a size and a number of ranks.
#[derive(Clone, Debug)]
pub struct Measurement {
    /// Data bytes of the region.
    pub size: usize,
    /// Ranks.
    pub ranks: usize,
    /// Pre-fault threads per rank.
    pub threads: usize,
    /// The variant.
    pub variant: Variant,
    /// With `--existing`: which use of the persistent region this is
    /// ([`super::pin_existing`]); None for a create/join region.
    pub phase: Option<PoolPhase>,
    /// Every rank's times (fewer than `ranks` if some gave no line).
    pub times: Vec<RankTimes>,
    /// Files of the region left in its directory afterwards.
    pub left: Vec<String>,
    /// Problems the parent saw (a rank's exit status, a missing line).
    pub errors: Vec<String>,
}

impl Measurement {
    /// The variant's name, with the phase of a persistent region
    /// (`new/fresh`, `new/existing`).
    pub fn label(&self) -> String {
        match self.phase {
            Some(p) => format!("{}/{}", self.variant.name, p.name()),
            None => self.variant.name.to_string(),
        }
    }

    fn span(&self, from: impl Fn(&RankTimes) -> f64) -> Option<f64> {
        if self.times.len() != self.ranks || !self.ok() {
            return None;
        }
        let start = self.times.iter().map(&from).fold(f64::INFINITY, f64::min);
        let end = self.times.iter().map(|t| t.agreed).fold(0.0, f64::max);
        (end > start).then_some(end - start)
    }

    /// Whether every rank pinned and agreed and nothing was left.
    pub fn ok(&self) -> bool {
        self.errors.is_empty()
            && self.left.is_empty()
            && self.times.len() == self.ranks
            && self.times.iter().all(|t| t.outcome == "pinned")
    }

    /// Seconds from the first rank starting to pin to the last agreed.
    pub fn pin_s(&self) -> Option<f64> {
        self.span(|t| t.pin)
    }

    /// Seconds from the first rank starting to create or join to the last agreed.
    pub fn e2e_s(&self) -> Option<f64> {
        self.span(|t| t.create)
    }

    /// Seconds from the first rank starting to create or join to the last returning from it.
    pub fn create_s(&self) -> Option<f64> {
        let start = self.times.iter().map(|t| t.create).fold(f64::INFINITY, f64::min);
        let end = self.times.iter().map(|t| t.created).fold(0.0, f64::max);
        (self.ok() && end > start).then_some(end - start)
    }

    /// Region bytes per second (1e9) over `s`.
    pub fn gbps(&self, s: Option<f64>) -> Option<f64> {
        s.map(|s| self.size as f64 / s / 1e9)
    }

    /// Share of the region mapped with 2 MiB pages, summed over the ranks'
    /// mappings (each maps with 2 MiB pages only what it faulted).
    pub fn huge_share(&self) -> f64 {
        let h: u64 = self.times.iter().map(|t| t.huge).sum();
        (h as f64 / self.size as f64).min(1.0)
    }
}

/// The whole run.
#[derive(Clone, Debug)]
pub struct SharedReport {
    /// `cuda` or `sim`.
    pub backend: String,
    /// The device(s), in words.
    pub device: String,
    /// The region directory.
    pub dir: PathBuf,
    /// What its mount gives, in words (region::pages).
    pub pages: String,
    /// Cores of the machine.
    pub cores: usize,
    /// Slot and registration chunk bytes.
    pub slot: usize,
    /// Registration chunk bound.
    pub chunk: usize,
    /// Seconds of the warm-up (None: none).
    pub warmup_s: Option<f64>,
    /// Every measurement, in the order run.
    pub rows: Vec<Measurement>,
    /// Seconds the whole bench took.
    pub wall_s: f64,
}

/// The target of the issue: >= 20 GB/s from the start of pinning to every
/// rank Pinned and agreed.
pub const TARGET_GBPS: f64 = 20.0;

impl SharedReport {
    /// The median pin GB/s of a (size, ranks, variant label).
    pub fn median_gbps(&self, size: usize, ranks: usize, variant: &str, e2e: bool) -> Option<f64> {
        super::pin::median(
            self.rows
                .iter()
                .filter(|m| m.size == size && m.ranks == ranks && m.label() == variant)
                .filter_map(|m| m.gbps(if e2e { m.e2e_s() } else { m.pin_s() }))
                .collect(),
        )
    }
}

impl fmt::Display for SharedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rows.iter().any(|m| m.phase.is_some()) {
            writeln!(
                f,
                "kvoffload bench pin --shared --existing: per run a persistent region, made and pinned by one set \
                 of rank processes (fresh), then opened and pinned by new ones after those exited (existing)"
            )?;
        } else {
            writeln!(f, "kvoffload bench pin --shared: a fresh shared region per run, one process per rank")?;
        }
        writeln!(f, "backend: {} ({})", self.backend, self.device)?;
        writeln!(
            f,
            "region dir: {} ({}); slots of {}, registration chunks of at most {}; {} cores",
            self.dir.display(),
            self.pages,
            fmt_bytes(self.slot),
            fmt_bytes(self.chunk),
            self.cores
        )?;
        match self.warmup_s {
            Some(w) => writeln!(f, "warm-up: the largest size mapped, pre-faulted and unmapped once ({w:.2} s)")?,
            None => writeln!(f, "warm-up: none")?,
        }
        if self.backend == "sim" {
            writeln!(
                f,
                "NOTE: simulated GPU: registration is instant, so these figures measure only the host-side work \
                 (creating, reserving, pre-faulting). Run with --backend cuda on a GPU machine for the real comparison."
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "{:<22} {:>5} {:>5} {:>7} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>5} {:>7}  result",
            "variant",
            "size",
            "ranks",
            "threads",
            "files",
            "create s",
            "pin s",
            "pin GB/s",
            "e2e s",
            "e2e GB/s",
            "2MiB%",
            "unreg s"
        )?;
        for m in &self.rows {
            let s = |o: Option<f64>| o.map_or("-".to_string(), |x| format!("{x:.3}"));
            let g = |o: Option<f64>| o.map_or("-".to_string(), |x| format!("{x:.2}"));
            let files = m.times.first().map_or(0, |t| t.files);
            let unreg = m.times.iter().map(|t| t.unregister).fold(0.0, f64::max);
            let result = if m.ok() {
                let per: Vec<String> = m
                    .times
                    .iter()
                    .map(|t| format!("r{} {} in {:.3}s", t.rank, fmt_bytes(t.share as usize), t.pinned - t.pin))
                    .collect();
                format!("ok ({})", per.join(", "))
            } else {
                let mut why: Vec<String> = m.errors.clone();
                why.extend(
                    m.times.iter().filter(|t| t.outcome != "pinned").map(|t| format!("rank {}: {}", t.rank, t.outcome)),
                );
                if !m.left.is_empty() {
                    why.push(format!("files left: {:?}", m.left));
                }
                format!("FAILED: {}", why.join("; "))
            };
            writeln!(
                f,
                "{:<22} {:>5} {:>5} {:>7} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>5.0} {:>7.3}  {}",
                m.label(),
                fmt_bytes(m.size).replace(' ', ""),
                m.ranks,
                m.threads,
                files,
                s(m.create_s()),
                s(m.pin_s()),
                g(m.gbps(m.pin_s())),
                s(m.e2e_s()),
                g(m.gbps(m.e2e_s())),
                m.huge_share() * 100.0,
                unreg,
                result
            )?;
        }
        writeln!(f)?;
        let mut seen: Vec<&'static str> = Vec::new();
        for m in &self.rows {
            if !seen.contains(&m.variant.name) {
                seen.push(m.variant.name);
                writeln!(f, "{:<22} {}", m.variant.name, m.variant.describe())?;
            }
        }
        writeln!(
            f,
            "create s: first rank starting create/join to the last returning (every rank mapped; reserving included); \
             pin s: first rank starting to pin to the last Pinned and agreed (the issue's measure); e2e: create + pin; \
             GB/s: region bytes (1e9) over that time; 2MiB%: region bytes the ranks mapped with 2 MiB pages"
        )?;
        if self.rows.iter().any(|m| m.phase.is_some()) {
            writeln!(
                f,
                "/fresh: a persistent region made by these ranks (create s: create-or-open, reserving included); \
                 /existing: the same region opened by new processes (its pages in tmpfs already; pin s: pre-fault \
                 + register, no agreement between ranks)"
            )?;
            for line in super::pin_existing::summary(self) {
                writeln!(f, "{line}")?;
            }
        }
        let mut combos: Vec<(usize, usize)> = Vec::new();
        for m in &self.rows {
            if !combos.contains(&(m.size, m.ranks)) {
                combos.push((m.size, m.ranks));
            }
        }
        for (size, ranks) in combos {
            let old = self.median_gbps(size, ranks, "old", false);
            let new = self.median_gbps(size, ranks, "new", false);
            let new_e2e = self.median_gbps(size, ranks, "new", true);
            let ov = self.median_gbps(size, ranks, "overlap", false);
            let ov_e2e = self.median_gbps(size, ranks, "overlap", true);
            let old_e2e = self.median_gbps(size, ranks, "old", true);
            if let Some(oe) = ov_e2e {
                let target = if self.backend == "sim" {
                    "(not meaningful on the simulated GPU)".to_string()
                } else {
                    format!(
                        "target >= {TARGET_GBPS} GB/s end to end: {}",
                        if oe >= TARGET_GBPS { "met" } else { "NOT met" }
                    )
                };
                let g = |o: Option<f64>| o.map_or("-".to_string(), |x| format!("{x:.2}"));
                writeln!(
                    f,
                    "{} x {} rank(s), end to end (create/join + pin to agreed), median: old {}, new (reserve first) {}, \
                     overlap {oe:.2} GB/s (pin alone {}); {target}",
                    fmt_bytes(size),
                    ranks,
                    g(old_e2e),
                    g(new_e2e),
                    g(ov),
                )?;
            }
            if let (Some(o), Some(n)) = (old, new) {
                let target = if self.backend == "sim" {
                    "(not meaningful on the simulated GPU)".to_string()
                } else {
                    format!(
                        "target >= {TARGET_GBPS} GB/s: pin {}, end to end {}",
                        if n >= TARGET_GBPS { "met" } else { "NOT met" },
                        if new_e2e.is_some_and(|e| e >= TARGET_GBPS) { "met" } else { "NOT met" }
                    )
                };
                writeln!(
                    f,
                    "{} x {} rank(s): old {o:.2} GB/s, new {n:.2} GB/s (end to end {}): {:.1}x; {target}",
                    fmt_bytes(size),
                    ranks,
                    new_e2e.map_or("-".into(), |e| format!("{e:.2}")),
                    n / o
                )?;
            }
        }
        write!(f, "bench wall time: {:.1} s", self.wall_s)
    }
}

impl SharedReport {
    /// Writes the picture: median end-to-end GB/s (create/join + pin until
    /// every rank is pinned and agreed) against the region size, one series
    /// per variant and rank count, with the target as a line.
    pub fn write_svg(&self, path: &Path) -> Result<(), String> {
        use crate::plot::{lines, Limit, LineChart, Series};
        let mut keys: Vec<(String, usize)> = Vec::new();
        let mut sizes: Vec<usize> = Vec::new();
        for m in &self.rows {
            if !keys.contains(&(m.label(), m.ranks)) {
                keys.push((m.label(), m.ranks));
            }
            if !sizes.contains(&m.size) {
                sizes.push(m.size);
            }
        }
        sizes.sort_unstable();
        let series: Vec<Series> = keys
            .iter()
            .map(|(v, ranks)| Series {
                name: format!("{v}, {ranks} rank(s), end to end"),
                points: sizes
                    .iter()
                    .filter_map(|&size| {
                        self.median_gbps(size, *ranks, v, true).map(|g| (size as f64 / (1u64 << 30) as f64, g))
                    })
                    .collect(),
            })
            .collect();
        let limits = if self.backend == "sim" {
            Vec::new()
        } else {
            vec![Limit { name: format!("target {TARGET_GBPS} GB/s"), y: TARGET_GBPS }]
        };
        let title = format!("Shared region, create/join + pin to agreed ({}, {})", self.backend, self.device);
        lines(
            path,
            &LineChart {
                title: &title,
                x_label: "region size (GiB)",
                y_label: "GB/s of region bytes (1e9 bytes/s)",
                log_x: false,
                series: &series,
                limits: &limits,
                x_fmt: Some(|x| if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { format!("{x:.1}") }),
            },
        )
    }
}

/// Default pre-fault threads per rank: the cores divided by the ranks.
pub fn default_threads(ranks: usize) -> usize {
    (available_cores() / ranks.max(1)).max(1)
}

/// Names of the files of region `name` left in `dir`.
pub fn files_left(dir: &Path, name: &str) -> Vec<String> {
    let Ok(base) = kvoffload::internal::region::shm_path(dir, name) else {
        return Vec::new();
    };
    let base = base.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let dotted = format!("{base}.");
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<String> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| *n == base || n.starts_with(&dotted))
        .collect();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lines_round_trip() {
        let t = RankTimes {
            rank: 1,
            create: 1.5,
            created: 1.75,
            pin: 2.0,
            pinned: 3.25,
            agreed: 3.5,
            share: 1 << 30,
            huge: 0,
            files: 9,
            unregister: 0.125,
            outcome: "pinned".into(),
        };
        assert_eq!(RankTimes::parse(&t.to_line()), Some(t.clone()));
        let bad = RankTimes { outcome: "FAILED: no space".into(), ..t.clone() };
        assert_eq!(RankTimes::parse(&bad.to_line()).unwrap().outcome, "FAILED: no space");
        let odd = RankTimes { outcome: "FAILED: nr_hugepages 0, 100% %20 used".into(), ..t };
        assert_eq!(RankTimes::parse(&odd.to_line()).unwrap().outcome, "FAILED: nr_hugepages 0, 100% %20 used");
        assert_eq!(RankTimes::parse("something else"), None);
    }

    #[test]
    fn measurement_spans_run_from_the_first_start_to_the_last_agreement() {
        let v = Variant::named("new", kvoffload::internal::region::DEFAULT_FILE_BYTES).unwrap();
        let r = |rank, create, pin, agreed| RankTimes {
            rank,
            create,
            created: pin,
            pin,
            pinned: agreed,
            agreed,
            outcome: "pinned".into(),
            ..Default::default()
        };
        let m = Measurement {
            size: 4_000_000_000,
            ranks: 2,
            threads: 1,
            variant: v,
            phase: None,
            times: vec![r(0, 10.0, 10.5, 11.0), r(1, 10.1, 10.4, 11.2)],
            left: vec![],
            errors: vec![],
        };
        assert!((m.pin_s().unwrap() - 0.8).abs() < 1e-9);
        assert!((m.e2e_s().unwrap() - 1.2).abs() < 1e-9);
        assert!((m.gbps(m.pin_s()).unwrap() - 5.0).abs() < 1e-9);
        let mut bad = m.clone();
        bad.left = vec!["kvoffload-x.3".into()];
        assert!(!bad.ok() && bad.pin_s().is_none());
        assert!(Variant::named("nope", kvoffload::internal::region::DEFAULT_FILE_BYTES)
            .unwrap_err()
            .contains("old, new"));
    }
}
