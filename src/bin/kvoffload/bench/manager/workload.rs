//! Deterministic access traces for the policy comparison.

use crate::random::{SplitMix64, Zipf};

/// Which access pattern a trace follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Workload {
    /// Every access draws a key from the Zipf distribution.
    Zipf,
    /// Runs of Zipf accesses, each followed by a sequential scan of keys
    /// that are never used again (a full-table read, a long one-off prompt).
    ScanHeavy,
    /// The same `fill` keys, fewer than the slots, read in order again and
    /// again (engines' prompts stored then served again, as the GPU run of
    /// 2026-12-07 did at 73% full): an LRU of the capacity keeps them all,
    /// so every pass after the first hits; a hash table whose sets overflow
    /// loses keys while it has room.
    Fill,
}

impl Workload {
    /// Both workloads, in report order.
    pub const ALL: [Workload; 3] = [Workload::Zipf, Workload::ScanHeavy, Workload::Fill];

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Zipf => "zipf",
            Workload::ScanHeavy => "scan-heavy",
            Workload::Fill => "fill",
        }
    }
}

/// How a trace is drawn: `universe` keys (Zipf, `exponent`), `accesses`
/// in all, scans of `scan_length` fresh keys after every `hot_run` hot ones
/// (scan-heavy only), `fill` keys in each pass (fill only), from `seed`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TraceShape {
    pub(crate) universe: usize,
    pub(crate) accesses: usize,
    pub(crate) exponent: f64,
    pub(crate) seed: u64,
    pub(crate) hot_run: usize,
    pub(crate) scan_length: usize,
    pub(crate) fill: usize,
}

/// The first key of the fill trace, past every Zipf and scan key.
const FILL_BASE: u64 = 1 << 48;

/// The block hashes a workload accesses, in order. Zipf keys are their ranks
/// `0..universe` (rank 0 the most popular); scan keys start at `universe`
/// and never repeat.
pub(crate) fn trace(workload: Workload, shape: &TraceShape) -> Vec<u64> {
    if workload == Workload::Fill {
        let n = shape.fill.max(1) as u64;
        return (0..shape.accesses as u64).map(|i| FILL_BASE + i % n).collect();
    }
    let zipf = Zipf::new(shape.universe, shape.exponent);
    let mut rng = SplitMix64::new(shape.seed);
    let mut out = Vec::with_capacity(shape.accesses);
    let mut next_scan_key = shape.universe as u64;
    while out.len() < shape.accesses {
        let hot = match workload {
            Workload::Zipf => shape.accesses,
            Workload::ScanHeavy | Workload::Fill => shape.hot_run,
        };
        for _ in 0..hot.min(shape.accesses - out.len()) {
            out.push(zipf.sample(&mut rng) as u64);
        }
        for _ in 0..shape.scan_length.min(shape.accesses - out.len()) {
            out.push(next_scan_key);
            next_scan_key = next_scan_key.wrapping_add(1);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_keys_never_repeat_and_trace_has_exact_length() {
        let shape = TraceShape {
            universe: 50,
            accesses: 1_000,
            exponent: 0.8,
            seed: 1,
            hot_run: 30,
            scan_length: 20,
            fill: 300,
        };
        let t = trace(Workload::ScanHeavy, &shape);
        assert_eq!(t.len(), 1_000);
        let scans: Vec<u64> = t.iter().copied().filter(|k| *k >= 50).collect();
        assert_eq!(scans.len(), 400);
        assert!(scans.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(trace(Workload::Zipf, &shape).len(), 1_000);
        let fill = trace(Workload::Fill, &shape);
        assert_eq!((fill.len(), fill[0], fill[300], fill[999]), (1_000, FILL_BASE, FILL_BASE, FILL_BASE + 99));
    }
}
