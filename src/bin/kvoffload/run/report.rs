//! What one rank reports (a `KVO-RESULT` line of `key=value` pairs) and the
//! run's summary over every rank.

use kvoffload::Named;
use std::fmt::Write as _;

use super::metrics::{ratio, Intervals, Latencies, Throughput};
use kvoffload::Backend;

/// Prefix of a rank's phase markers: `KVO-PHASE rank=R phase=P`.
pub const PHASE: &str = "KVO-PHASE";
/// Prefix of progress lines: `KVO-PROGRESS rank=R phase=P done=D total=T`.
pub const PROGRESS: &str = "KVO-PROGRESS";
/// Prefix of a pause announcement: `KVO-PAUSE rank=R at=P` (fault tests).
pub const PAUSE: &str = "KVO-PAUSE";
/// Prefix of latency samples (microseconds, comma separated).
pub const LATENCY: &str = "KVO-LAT";
/// Prefix of busy intervals: `KVO-BUSY rank=R dir=store|load a-b,a-b,...`
/// (monotonic seconds).
pub const BUSY: &str = "KVO-BUSY";
/// Prefix of the final result line.
pub const RESULT: &str = "KVO-RESULT";
/// Prefix of a notice the parent prints as is: `KVO-NOTE rank=R <message>`.
pub const NOTE: &str = "KVO-NOTE";
/// Prefix of a rank's fatal error: `KVO-ERROR rank=R <message>`.
pub const ERROR: &str = "KVO-ERROR";

/// One rank's figures.
#[derive(Clone, Debug, Default)]
pub struct RankReport {
    pub rank: usize,
    pub backend: String,
    /// Final pin state (e.g. `Pinned`, `Pageable(PeerPageable)`).
    pub pin_state: String,
    /// `pinned`, `pageable`, or `failed: <why>` (agreement not reached).
    pub agreement: String,
    pub region_bytes: u64,
    /// Bytes of the region's mapping in 2 MiB pages once pinning settled
    /// (`ShmemPmdMapped`, see [`kvoffload::Region::huge_mapped_bytes`]).
    pub huge_bytes: u64,
    /// Seconds from the start of pinning until this rank's chunks were all
    /// registered (or rolled back).
    pub pin_seconds: f64,
    /// Seconds from the start of pinning until every rank agreed.
    pub agreed_seconds: f64,
    pub windows: u64,
    pub window_wait_total: f64,
    pub window_wait_max: f64,
    /// Chunk registrations that completed while windows waited.
    pub chunks_waited: u64,
    pub graphs_ok: u64,
    pub graphs_failed: u64,
    pub requests: u64,
    pub lookups: u64,
    pub hits: u64,
    pub stores: u64,
    pub loads: u64,
    /// Stores and loads of the Zipf requests by the backend that moved
    /// them, in [`Backend::all`](kvoffload::Named::all)'s order.
    pub store_backends: [u64; 4],
    pub load_backends: [u64; 4],
    /// Stores and loads of the Zipf requests (both directions at once).
    pub store: Throughput,
    pub load: Throughput,
    /// Stores of the prefill (stores alone) and loads of the final sweep
    /// (loads alone).
    pub prefill_store: Throughput,
    pub sweep_load: Throughput,
    pub prefill_seconds: f64,
    pub jobs_failed: u64,
    pub stores_failed: u64,
    pub loads_failed: u64,
    pub blocks_verified: u64,
    pub blocks_corrupted: u64,
    pub blocks_lost: u64,
    /// Blocks the final sweep loaded and checked (part of blocks_verified).
    pub sweep_blocks: u64,
    pub evictions: u64,
    pub workload_seconds: f64,
    /// The rank was asked to stop (SIGINT, SIGTERM) and ended early: its
    /// figures cover what it did until then.
    pub interrupted: bool,
}

macro_rules! fields {
    ($m:ident) => {
        $m!(rank, usize);
        $m!(region_bytes, u64);
        $m!(huge_bytes, u64);
        $m!(pin_seconds, f64);
        $m!(agreed_seconds, f64);
        $m!(windows, u64);
        $m!(window_wait_total, f64);
        $m!(window_wait_max, f64);
        $m!(chunks_waited, u64);
        $m!(graphs_ok, u64);
        $m!(graphs_failed, u64);
        $m!(requests, u64);
        $m!(lookups, u64);
        $m!(hits, u64);
        $m!(stores, u64);
        $m!(loads, u64);
        $m!(jobs_failed, u64);
        $m!(stores_failed, u64);
        $m!(loads_failed, u64);
        $m!(blocks_verified, u64);
        $m!(blocks_corrupted, u64);
        $m!(blocks_lost, u64);
        $m!(sweep_blocks, u64);
        $m!(evictions, u64);
        $m!(workload_seconds, f64);
        $m!(prefill_seconds, f64);
        $m!(interrupted, bool);
    };
}

impl RankReport {
    /// The `KVO-RESULT` line (without latencies, which go on `KVO-LAT` lines).
    pub fn to_line(&self) -> String {
        let mut s = RESULT.to_string();
        macro_rules! put {
            ($f:ident, $t:ty) => {
                let _ = write!(s, " {}={}", stringify!($f), self.$f);
            };
        }
        fields!(put);
        let _ = write!(s, " store_bytes={} store_secs={}", self.store.bytes, self.store.seconds);
        let _ = write!(s, " load_bytes={} load_secs={}", self.load.bytes, self.load.seconds);
        let _ = write!(s, " store_job_secs={} load_job_secs={}", self.store.job_seconds, self.load.job_seconds);
        let counts = |c: &[u64; 4]| c.map(|n| n.to_string()).join("/");
        let _ =
            write!(s, " store_backends={} load_backends={}", counts(&self.store_backends), counts(&self.load_backends));
        let _ = write!(s, " prefill_bytes={} prefill_secs={}", self.prefill_store.bytes, self.prefill_store.seconds);
        let _ = write!(s, " sweep_bytes={} sweep_secs={}", self.sweep_load.bytes, self.sweep_load.seconds);
        // Free-text fields last, spaces replaced.
        let esc = |v: &str| v.replace(' ', "_");
        let _ = write!(
            s,
            " backend={} pin_state={} agreement={}",
            esc(&self.backend),
            esc(&self.pin_state),
            esc(&self.agreement)
        );
        s
    }

    /// Parses a `KVO-RESULT` line; unknown keys are ignored, bad numbers refused.
    pub fn parse(line: &str) -> Result<RankReport, String> {
        let rest = line.strip_prefix(RESULT).ok_or_else(|| format!("not a result line: {line:?}"))?;
        let mut r = RankReport::default();
        for kv in rest.split_whitespace() {
            let (k, v) = kv.split_once('=').ok_or_else(|| format!("bad field {kv:?}"))?;
            let bad = || format!("bad value in {kv:?}");
            macro_rules! get {
                ($f:ident, $t:ty) => {
                    if k == stringify!($f) {
                        r.$f = v.parse::<$t>().map_err(|_| bad())?;
                        continue;
                    }
                };
            }
            fields!(get);
            match k {
                "store_bytes" => r.store.bytes = v.parse().map_err(|_| bad())?,
                "store_secs" => r.store.seconds = v.parse().map_err(|_| bad())?,
                "load_bytes" => r.load.bytes = v.parse().map_err(|_| bad())?,
                "load_secs" => r.load.seconds = v.parse().map_err(|_| bad())?,
                "store_backends" => r.store_backends = backend_counts(v).ok_or_else(bad)?,
                "load_backends" => r.load_backends = backend_counts(v).ok_or_else(bad)?,
                "store_job_secs" => r.store.job_seconds = v.parse().map_err(|_| bad())?,
                "load_job_secs" => r.load.job_seconds = v.parse().map_err(|_| bad())?,
                "prefill_bytes" => r.prefill_store.bytes = v.parse().map_err(|_| bad())?,
                "prefill_secs" => r.prefill_store.seconds = v.parse().map_err(|_| bad())?,
                "sweep_bytes" => r.sweep_load.bytes = v.parse().map_err(|_| bad())?,
                "sweep_secs" => r.sweep_load.seconds = v.parse().map_err(|_| bad())?,
                "backend" => r.backend = v.replace('_', " "),
                "pin_state" => r.pin_state = v.to_string(),
                "agreement" => r.agreement = v.replace('_', " "),
                _ => {}
            }
        }
        Ok(r)
    }

    /// `KVO-LAT` lines carrying the latency samples, at most `per_line` a line.
    pub fn latency_lines(&self, samples: &[f64], per_line: usize) -> Vec<String> {
        list_lines(&format!("{LATENCY} rank={}", self.rank), samples, per_line, |s, v| {
            let _ = write!(s, "{:.1}", v * 1e6);
        })
    }

    /// Hit rate of lookups (0 when there were none).
    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits as f64, self.lookups as f64)
    }

    /// Pinning rate: the region's bytes over the pin time.
    pub fn pin_gbps(&self) -> f64 {
        ratio(self.region_bytes as f64, self.pin_seconds) / 1e9
    }

    /// True when nothing is corrupted or lost and the rank verified blocks.
    pub fn clean(&self) -> bool {
        self.blocks_corrupted == 0 && self.blocks_lost == 0 && self.graphs_failed == 0
    }
}

/// `a/b/c/d`: one count per backend of [`Backend::all`](kvoffload::Named::all).
fn backend_counts(v: &str) -> Option<[u64; 4]> {
    let mut out = [0u64; 4];
    let mut it = v.split('/');
    for n in &mut out {
        *n = it.next()?.parse().ok()?;
    }
    it.next().is_none().then_some(out)
}

/// Jobs by backend, as `934 staged, 512 gather` (backends with none left out).
pub fn backend_mix(counts: &[u64; 4]) -> String {
    let parts: Vec<String> =
        Backend::all().iter().zip(counts).filter(|(_, n)| **n > 0).map(|(b, n)| format!("{n} {}", b.name())).collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// Parses the samples of a `KVO-LAT` line into `into` (seconds); returns the rank.
pub fn parse_latency_line(line: &str, into: &mut Latencies) -> Result<usize, String> {
    let rest = line.strip_prefix(LATENCY).ok_or_else(|| format!("not a latency line: {line:?}"))?.trim();
    let (rank, samples) = rest.split_once(' ').unwrap_or((rest, ""));
    let rank =
        rank.strip_prefix("rank=").and_then(|r| r.parse().ok()).ok_or_else(|| format!("bad rank in {line:?}"))?;
    for v in samples.split(',').filter(|v| !v.is_empty()) {
        let us: f64 = v.parse().map_err(|_| format!("bad latency {v:?}"))?;
        into.push_secs(us / 1e6);
    }
    Ok(rank)
}

/// `KVO-BUSY` lines carrying `intervals` of direction `dir`, at most
/// `per_line` a line.
pub fn busy_lines(rank: usize, dir: &str, intervals: &Intervals, per_line: usize) -> Vec<String> {
    list_lines(&format!("{BUSY} rank={rank} dir={dir}"), &intervals.0, per_line, |s, (a, b)| {
        let _ = write!(s, "{a:.6}-{b:.6}");
    })
}

/// Lines of `head` followed by a space and at most `per_line` items, comma
/// separated, each written by `put`.
fn list_lines<T>(head: &str, items: &[T], per_line: usize, put: impl Fn(&mut String, &T)) -> Vec<String> {
    items
        .chunks(per_line.max(1))
        .map(|c| {
            let mut s = head.to_string();
            for (i, v) in c.iter().enumerate() {
                s.push(if i == 0 { ' ' } else { ',' });
                put(&mut s, v);
            }
            s
        })
        .collect()
}

/// Parses a `KVO-BUSY` line: its direction and intervals.
pub fn parse_busy_line(line: &str) -> Result<(String, Intervals), String> {
    let dir = field(line, "dir").ok_or_else(|| format!("no dir in {line:?}"))?.to_string();
    let mut out = Intervals::default();
    let list = line.split_whitespace().nth(3).unwrap_or("");
    for iv in list.split(',').filter(|v| !v.is_empty()) {
        let (a, b) = iv.split_once('-').ok_or_else(|| format!("bad interval {iv:?}"))?;
        let p = |v: &str| v.parse::<f64>().map_err(|_| format!("bad interval {iv:?}"));
        out.push(p(a)?, p(b)?);
    }
    Ok((dir, out))
}

/// The value of `key=` in a marker line (`KVO-PHASE rank=1 phase=pinning`).
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines_round_trip() {
        let r = RankReport {
            rank: 1,
            backend: "sim".into(),
            pin_state: "Pageable(PeerPageable)".into(),
            agreement: "failed: rank 0 died".into(),
            blocks_verified: 42,
            pin_seconds: 0.25,
            store: Throughput { bytes: 10, seconds: 0.5, job_seconds: 0.75 },
            load_backends: [0, 1, 0, 7],
            sweep_load: Throughput { bytes: 7, seconds: 0.25, ..Default::default() },
            interrupted: true,
            ..Default::default()
        };
        let p = RankReport::parse(&r.to_line()).unwrap();
        assert_eq!((p.rank, p.blocks_verified, p.pin_seconds), (1, 42, 0.25));
        assert!(p.interrupted);
        assert_eq!(p.agreement, "failed: rank 0 died");
        assert_eq!((p.store.bytes, p.store.job_seconds), (10, 0.75));
        assert_eq!(p.store.mean_in_flight(), 1.5);
        assert_eq!((p.load_backends, p.store_backends), ([0, 1, 0, 7], [0; 4]));
        assert_eq!(backend_mix(&p.load_backends), "1 batched, 7 staged");
        assert_eq!(backend_counts("1/2/3"), None);
        assert_eq!((p.sweep_load.bytes, p.sweep_load.seconds), (7, 0.25));
        let mut l = Latencies::default();
        for line in r.latency_lines(&[1e-6, 2e-6, 3e-6], 2) {
            assert_eq!(parse_latency_line(&line, &mut l).unwrap(), 1);
        }
        assert_eq!(l.len(), 3);
        assert_eq!(field("KVO-PHASE rank=1 phase=pinning", "phase"), Some("pinning"));
        let iv = Intervals(vec![(1.5, 2.25), (3.0, 4.0), (10.0, 10.5)]);
        let lines = busy_lines(1, "load", &iv, 2);
        assert_eq!(lines.len(), 2);
        let mut back = Intervals::default();
        for l in &lines {
            let (dir, i) = parse_busy_line(l).unwrap();
            assert_eq!(dir, "load");
            back.extend(&i);
        }
        assert_eq!(back, iv);
    }
}
