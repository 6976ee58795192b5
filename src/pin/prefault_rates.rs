//! How fast pre-fault slices are faulted in, and giving huge pages up when
//! faulting them stalls: the per-slice rate buckets of
//! [`PrefaultStats::slice_gbps`](super::PrefaultStats::slice_gbps) and the
//! huge-page fallback's decision ([`super::Prefaulter::with_huge_fallback`]).
//! The pool (`prefault.rs`) times each slice and applies the decision; this
//! file only judges.

use std::collections::VecDeque;

use crate::region::page_size;

use super::prefault_slice::thp_stall_events;

/// Upper edges of the [`PrefaultStats::slice_gbps`](super::PrefaultStats::slice_gbps) buckets (the last is
/// open).
pub const SLICE_GBPS_EDGES: [f64; 7] = [0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0];

/// Slices that must have been timed before [`HugeFallback`] judges, per
/// worker (the window is this many slices per worker).
const FALLBACK_WINDOW_PER_WORKER: usize = 2;

/// Giving up transparent huge pages when faulting them stalls: near the
/// memory limit the kernel compacts memory for every huge page (THP
/// `defrag=madvise` with `MADV_HUGEPAGE`), and pre-faulting can fall far
/// below what 4 KiB pages reach (see [`super::options::PinOptions::huge_fallback_mbps`]).
#[derive(Clone, Debug)]
pub(super) struct HugeFallback {
    /// Per-worker MB/s over the window below which the fallback trips.
    min_mbps: u32,
    /// The range the fallback's `MADV_NOHUGEPAGE` may cover (the region's
    /// chunks, first byte and end).
    span: (usize, usize),
    /// The last timed huge-page slices: (bytes, seconds).
    window: VecDeque<(u64, f64)>,
    /// Where it tripped and the rate that tripped it.
    tripped: Option<(usize, f64)>,
    /// [`thp_stall_events`] when armed: slow slices trip the fallback only
    /// when the kernel stalled in compaction or gave huge pages up since
    /// (a slow first touch of a virtual machine's memory is slow with
    /// 4 KiB pages too). None where /proc/vmstat cannot be read: the rate
    /// alone decides.
    stalls_at_arm: Option<u64>,
}

/// The bucket of [`SLICE_GBPS_EDGES`] a slice faulted at `gbps` per worker
/// falls in.
pub(super) fn bucket(gbps: f64) -> usize {
    SLICE_GBPS_EDGES.iter().position(|&e| gbps < e).unwrap_or(SLICE_GBPS_EDGES.len())
}

impl HugeFallback {
    /// Armed at `min_mbps` per worker over `span` (first byte, end), with
    /// the kernel's stall counters as they are now.
    pub(super) fn new(min_mbps: u32, span: (usize, usize), stalls_at_arm: Option<u64>) -> HugeFallback {
        HugeFallback { min_mbps, span, window: VecDeque::new(), tripped: None, stalls_at_arm }
    }

    /// Where it tripped and the per-worker GB/s that tripped it.
    pub(super) fn tripped(&self) -> Option<(usize, f64)> {
        self.tripped
    }

    /// One more slice of `len` bytes faulted in `secs` by one of `workers`
    /// (`huge`: as transparent huge pages). Returns the range to advise
    /// `MADV_NOHUGEPAGE`, from `from` (the first slice not started) to the
    /// span's end, with the per-worker GB/s that tripped it, when this slice
    /// trips the fallback: the window (two
    /// slices per worker) is full, its rate is below `min_mbps`, and the
    /// kernel's reclaim/compaction stall counters grew since arming (the
    /// rate alone where they cannot be read). Once only.
    pub(super) fn judge(
        &mut self,
        len: usize,
        secs: f64,
        huge: bool,
        workers: usize,
        from: usize,
    ) -> Option<(usize, usize, f64)> {
        if !huge || self.tripped.is_some() || secs <= 0.0 {
            return None;
        }
        self.window.push_back((len as u64, secs));
        let cap = FALLBACK_WINDOW_PER_WORKER * workers.max(1);
        while self.window.len() > cap {
            self.window.pop_front();
        }
        if self.window.len() < cap {
            return None;
        }
        let (bytes, t) = self.window.iter().fold((0u64, 0f64), |(b, t), &(x, y)| (b + x, t + y));
        let rate = bytes as f64 / t / 1e9;
        if rate * 1000.0 >= self.min_mbps as f64 {
            return None;
        }
        if let (Some(then), Some(now)) = (self.stalls_at_arm, thp_stall_events()) {
            if now <= then {
                // Slow, but not from reclaim or compaction: judge a fresh window.
                self.window.clear();
                return None;
            }
        }
        let page = page_size();
        let from = from.max(self.span.0).div_ceil(page) * page;
        self.tripped = Some((from, rate));
        (from < self.span.1).then_some((from, self.span.1 - from, rate))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_the_edges() {
        assert_eq!(bucket(0.1), 0);
        assert_eq!(bucket(0.125), 1);
        assert_eq!(bucket(3.9), 5);
        assert_eq!(bucket(8.0), 7);
        assert_eq!(bucket(f64::INFINITY), 7);
    }

    #[test]
    fn a_range_past_the_span_trips_without_advice() {
        // Rate alone (no counters): the window of one worker is 2 slices.
        let mut f = HugeFallback::new(1000, (0x1000_0000, 0x1000_0000 + (64 << 20)), None);
        assert_eq!(f.judge(16 << 20, 1.0, true, 1, 0x1000_0000 + (64 << 20)), None);
        assert_eq!(f.judge(16 << 20, 1.0, true, 1, 0x1000_0000 + (64 << 20)), None, "nothing left to advise");
        assert!(f.tripped().is_some(), "but it tripped: later slices are not judged again");
    }
}
