//! Latency and throughput figures of a run.

/// Collected job latencies (seconds), with percentiles.
#[derive(Default, Clone, Debug)]
pub struct Latencies {
    samples: Vec<f64>,
}

impl Latencies {
    pub fn push_secs(&mut self, s: f64) {
        self.samples.push(s);
    }

    /// Samples held (the tests count them).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.samples.len()
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
    /// Time with at least one job of this kind in flight.
    pub seconds: f64,
    /// The jobs' latencies summed (submit to report): over `seconds`, the
    /// mean number of jobs in flight while any was (Little's law).
    pub job_seconds: f64,
}

impl Throughput {
    pub fn add(&mut self, bytes: u64, seconds: f64) {
        self.bytes += bytes;
        self.seconds += seconds;
    }

    /// Mean jobs in flight while at least one was; 0 when nothing was timed.
    pub fn mean_in_flight(&self) -> f64 {
        ratio(self.job_seconds, self.seconds)
    }

    /// GB/s (1e9 bytes per second); 0 when nothing was timed.
    pub fn gbps(&self) -> f64 {
        ratio(self.bytes as f64, self.seconds) / 1e9
    }
}

/// `part / whole`, or 0 when `whole` is not positive (nothing counted or
/// timed): the one way the reports divide.
pub fn ratio(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        part / whole
    } else {
        0.0
    }
}

/// Seconds on CLOCK_MONOTONIC: one clock for every process of the machine,
/// so the ranks' busy intervals can be merged by the parent.
pub fn monotonic_secs() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    debug_assert_eq!(rc, 0);
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Time intervals `[start, end)` in [`monotonic_secs`] seconds: when a
/// direction had at least one job in flight.
#[derive(Default, Clone, Debug, PartialEq)]
pub struct Intervals(pub Vec<(f64, f64)>);

impl Intervals {
    pub fn push(&mut self, start: f64, end: f64) {
        if end > start {
            self.0.push((start, end));
        }
    }

    pub fn extend(&mut self, other: &Intervals) {
        self.0.extend_from_slice(&other.0);
    }

    /// Summed length of the intervals.
    pub fn total(&self) -> f64 {
        self.0.iter().map(|(a, b)| b - a).sum()
    }

    /// Length of their union (overlaps counted once).
    pub fn union(&self) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut total = 0.0;
        let mut cur: Option<(f64, f64)> = None;
        for (a, b) in v {
            cur = match cur {
                Some((s, e)) if a <= e => Some((s, e.max(b))),
                Some((s, e)) => {
                    total += e - s;
                    Some((a, b))
                }
                None => Some((a, b)),
            };
        }
        total + cur.map_or(0.0, |(s, e)| e - s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_counts_overlaps_once() {
        let mut i = Intervals::default();
        assert_eq!(i.union(), 0.0);
        i.push(5.0, 7.0);
        i.push(1.0, 2.0);
        i.push(1.5, 3.0);
        i.push(6.0, 6.5);
        i.push(4.0, 4.0); // empty: dropped
        assert_eq!(i.0.len(), 4);
        assert_eq!(i.total(), 2.0 + 1.0 + 1.5 + 0.5);
        assert_eq!(i.union(), 2.0 + 2.0);
        assert!(monotonic_secs() > 0.0);
    }

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
