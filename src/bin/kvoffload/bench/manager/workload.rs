//! Deterministic access traces for the policy comparison.

/// splitmix64 (Steele, Lea and Flood): a small, seeded, deterministic PRNG.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform float in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Samples ranks `0..n` with probability proportional to `1 / (rank + 1)^s`,
/// by binary search in a precomputed cumulative table (O(log n) a sample).
#[derive(Clone, Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// A sampler over `n` ranks (at least 1) with exponent `s` (0 is uniform).
    pub fn new(n: usize, s: f64) -> Self {
        let n = n.max(1);
        let mut cdf = Vec::with_capacity(n);
        let mut total = 0.0;
        for rank in 0..n {
            total += 1.0 / ((rank + 1) as f64).powf(s);
            cdf.push(total);
        }
        cdf.iter_mut().for_each(|c| *c /= total);
        Self { cdf }
    }

    /// One rank, most popular first.
    pub fn sample(&self, rng: &mut SplitMix64) -> usize {
        let u = rng.next_f64();
        self.cdf.partition_point(|c| *c <= u).min(self.cdf.len() - 1)
    }
}

/// Which access pattern a trace follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Workload {
    /// Every access draws a key from the Zipf distribution.
    Zipf,
    /// Runs of Zipf accesses, each followed by a sequential scan of keys
    /// that are never used again (a full-table read, a long one-off prompt).
    ScanHeavy,
}

impl Workload {
    /// Both workloads, in report order.
    pub const ALL: [Workload; 2] = [Workload::Zipf, Workload::ScanHeavy];

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Zipf => "zipf",
            Workload::ScanHeavy => "scan-heavy",
        }
    }
}

/// The shape of a trace.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TraceShape {
    pub(crate) universe: usize,
    pub(crate) accesses: usize,
    pub(crate) exponent: f64,
    pub(crate) seed: u64,
    pub(crate) hot_run: usize,
    pub(crate) scan_length: usize,
}

/// The block hashes a workload accesses, in order. Zipf keys are their ranks
/// `0..universe` (rank 0 the most popular); scan keys start at `universe`
/// and never repeat.
pub(crate) fn trace(workload: Workload, shape: &TraceShape) -> Vec<u64> {
    let zipf = Zipf::new(shape.universe, shape.exponent);
    let mut rng = SplitMix64::new(shape.seed);
    let mut out = Vec::with_capacity(shape.accesses);
    let mut next_scan_key = shape.universe as u64;
    while out.len() < shape.accesses {
        let hot = match workload {
            Workload::Zipf => shape.accesses,
            Workload::ScanHeavy => shape.hot_run,
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
    fn zipf_favours_low_ranks_and_is_deterministic() {
        let z = Zipf::new(1000, 1.0);
        let (mut a, mut b) = (SplitMix64::new(7), SplitMix64::new(7));
        let xs: Vec<usize> = (0..10_000).map(|_| z.sample(&mut a)).collect();
        let ys: Vec<usize> = (0..10_000).map(|_| z.sample(&mut b)).collect();
        assert_eq!(xs, ys);
        let top10 = xs.iter().filter(|r| **r < 10).count();
        // H(10)/H(1000) is about 0.39 for s = 1.
        assert!((3_400..4_400).contains(&top10), "{top10}");
        assert!(xs.iter().all(|r| *r < 1000));
    }

    #[test]
    fn scan_keys_never_repeat_and_trace_has_exact_length() {
        let shape = TraceShape { universe: 50, accesses: 1_000, exponent: 0.8, seed: 1, hot_run: 30, scan_length: 20 };
        let t = trace(Workload::ScanHeavy, &shape);
        assert_eq!(t.len(), 1_000);
        let scans: Vec<u64> = t.iter().copied().filter(|k| *k >= 50).collect();
        assert_eq!(scans.len(), 400);
        assert!(scans.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(trace(Workload::Zipf, &shape).len(), 1_000);
    }
}
