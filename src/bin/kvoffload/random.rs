//! Seeded, deterministic random generators shared by the run job's
//! requests (`run/workload.rs`) and the block-manager benchmark's traces
//! (`bench/manager/`), so a seed names the same key sequence in both, and
//! the block permutations of `bench transfer`.

use kvoffload::internal::runtime::pattern::mix;

/// splitmix64 (Steele, Lea and Flood): a small, seeded, deterministic PRNG.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits: the state advanced by splitmix64's step,
    /// through its finaliser ([`mix`] adds the step before it finalises).
    pub fn next_u64(&mut self) -> u64 {
        let z = mix(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_gives_the_reference_stream() {
        // The first outputs of splitmix64 seeded with 0 (Vigna's splitmix64.c).
        let mut r = SplitMix64::new(0);
        assert_eq!(
            [r.next_u64(), r.next_u64(), r.next_u64()],
            [0xe220_a839_7b1d_cdaf, 0x6e78_9e6a_a1b9_65f4, 0x06c4_5d18_8009_454f]
        );
    }

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
}
