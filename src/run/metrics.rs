//! Latency and throughput figures of a run.

use std::time::Duration;

/// Collected job latencies (seconds), with percentiles.
#[derive(Default, Clone, Debug)]
pub struct Latencies {
    samples: Vec<f64>,
}

impl Latencies {
    pub fn push(&mut self, d: Duration) {
        self.samples.push(d.as_secs_f64());
    }

    pub fn push_secs(&mut self, s: f64) {
        self.samples.push(s);
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The `p`-th percentile (0..=100) by nearest rank; 0 when empty.
    pub fn percentile(&self, p: f64) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        let mut v = self.samples.clone();
        v.sort_by(f64::total_cmp);
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1]
    }

    /// Merges another set of samples (another rank's).
    pub fn extend(&mut self, other: &Latencies) {
        self.samples.extend_from_slice(&other.samples);
    }
}

/// Bytes moved in one direction and the time the transfers took.
#[derive(Default, Clone, Copy, Debug)]
pub struct Throughput {
    pub bytes: u64,
    pub seconds: f64,
}

impl Throughput {
    pub fn add(&mut self, bytes: u64, seconds: f64) {
        self.bytes += bytes;
        self.seconds += seconds;
    }

    /// GB/s (1e9 bytes per second); 0 when nothing was timed.
    pub fn gbps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let mut l = Latencies::default();
        assert_eq!(l.percentile(50.0), 0.0);
        for i in 1..=100 {
            l.push_secs(i as f64);
        }
        assert_eq!(l.percentile(50.0), 50.0);
        assert_eq!(l.percentile(99.0), 99.0);
        assert_eq!(l.percentile(100.0), 100.0);
        assert_eq!(l.percentile(0.0), 1.0);
    }
}
