//! The automatic backend choice: by fragment size, pin state and capture
//! state (FACTS 3 for the speeds behind the thresholds).

use super::backend::{Backend, BackendChoice};

/// Fragment sizes at which [`BackendChoice::Auto`] changes backend. The
/// mean fragment size of the merged job is compared.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct AutoThresholds {
    /// Up to this mean size the gather kernel is tried first (FACTS 3: the
    /// kernel reached 50 GB/s at 16 and 128 KiB, where per-copy calls reach
    /// 5 - 24 and a batched copy 3.5 - 41).
    pub gather_max_bytes: usize,
    /// From this mean size on, one async copy per fragment even where a
    /// batched copy is allowed. Off by default (`usize::MAX`): on the H200
    /// (docs/gpu-runs/2026-11-29-run2-bench-transfer.txt) one batched copy
    /// of 2 MiB fragments reached 54.4 / 53.9 GB/s against 50.6 / 51.8 for
    /// per-fragment copies.
    pub per_fragment_min_bytes: usize,
}

impl Default for AutoThresholds {
    fn default() -> Self {
        AutoThresholds { gather_max_bytes: 256 << 10, per_fragment_min_bytes: usize::MAX }
    }
}

/// What the choice looks at for one job.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Situation {
    /// Mean bytes per fragment after merging.
    pub mean_bytes: u64,
    /// The handler's stream is capturing (batched copies are never allowed).
    pub capturing: bool,
    /// Every host range lies in a chunk whose registration completed.
    pub pinned: bool,
}

/// The backends to try for one job, best first; the last is always
/// [`Backend::PerFragment`], which is always allowed. The gather kernel may
/// still be refused later, when an alias cannot be had for every fragment.
pub fn candidates(choice: BackendChoice, th: &AutoThresholds, sit: Situation) -> Vec<Backend> {
    let batched_ok = !sit.capturing;
    let mut out = Vec::with_capacity(3);
    match choice {
        BackendChoice::Force(Backend::Batched) if batched_ok => out.push(Backend::Batched),
        BackendChoice::Force(Backend::Gather) => out.push(Backend::Gather),
        BackendChoice::Force(_) => {}
        BackendChoice::Auto => {
            let mean = sit.mean_bytes;
            if mean >= th.per_fragment_min_bytes as u64 {
                // Large runs reach the link with one copy each.
            } else {
                if mean <= th.gather_max_bytes as u64 && sit.pinned {
                    out.push(Backend::Gather);
                }
                if batched_ok && sit.pinned {
                    out.push(Backend::Batched);
                }
            }
        }
    }
    out.push(Backend::PerFragment);
    out
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use Backend::*;

    fn sit(mean_bytes: u64, capturing: bool, pinned: bool) -> Situation {
        Situation { mean_bytes, capturing, pinned }
    }

    #[test]
    fn auto_by_size_pin_and_capture() {
        let th = AutoThresholds::default();
        let a = |s| candidates(BackendChoice::Auto, &th, s);
        assert_eq!(a(sit(16 << 10, false, true)), vec![Gather, Batched, PerFragment]);
        assert_eq!(a(sit(256 << 10, false, true)), vec![Gather, Batched, PerFragment]);
        assert_eq!(a(sit(1 << 20, false, true)), vec![Batched, PerFragment]);
        assert_eq!(a(sit(2 << 20, false, true)), vec![Batched, PerFragment]);
        assert_eq!(a(sit(2 << 20, true, true)), vec![PerFragment], "never batched while capturing");
        let old = AutoThresholds { per_fragment_min_bytes: 2 << 20, ..th };
        assert_eq!(candidates(BackendChoice::Auto, &old, sit(2 << 20, false, true)), vec![PerFragment]);
        assert_eq!(a(sit(16 << 10, true, true)), vec![Gather, PerFragment]);
        assert_eq!(a(sit(1 << 20, true, true)), vec![PerFragment]);
        assert_eq!(a(sit(16 << 10, false, false)), vec![PerFragment]);
    }

    #[test]
    fn forced_backends_fall_back_only_when_not_allowed() {
        let th = AutoThresholds::default();
        let f = |b, s| candidates(BackendChoice::Force(b), &th, s);
        assert_eq!(f(Batched, sit(2 << 20, false, false)), vec![Batched, PerFragment]);
        assert_eq!(f(Batched, sit(16 << 10, true, true)), vec![PerFragment]);
        assert_eq!(f(Gather, sit(2 << 20, true, false)), vec![Gather, PerFragment]);
        assert_eq!(f(PerFragment, sit(16 << 10, false, true)), vec![PerFragment]);
    }

    #[test]
    fn names_round_trip() {
        for b in Backend::ALL {
            assert_eq!(b.name().parse::<Backend>(), Ok(b));
            assert_eq!(b.name().parse::<BackendChoice>(), Ok(BackendChoice::Force(b)));
        }
        assert_eq!("auto".parse::<BackendChoice>(), Ok(BackendChoice::Auto));
        assert!("fast".parse::<BackendChoice>().is_err());
    }
}
