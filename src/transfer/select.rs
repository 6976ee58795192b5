//! The automatic backend choice: by fragment size, host run length, pin
//! state, capture state and whether the other direction is busy
//! (docs/driver-rules.md, section 6, for the speeds behind the thresholds,
//! and docs/gpu-runs/2026-11-30-duplex-*).

use std::time::Duration;

use super::backend::{Backend, BackendChoice};

/// [`AutoThresholds::duplex_linger`]'s default, in milliseconds.
const DUPLEX_LINGER_MS: u64 = 20;

/// Fragment sizes at which [`BackendChoice::Auto`] changes backend. The
/// mean fragment size of the merged job is compared.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct AutoThresholds {
    /// Up to this mean size the gather kernel is tried first
    /// (docs/driver-rules.md, rows "Gather kernel", "One copy call" and
    /// "Batched copy": the
    /// kernel reached 50 GB/s at 16 and 128 KiB, where per-copy calls reach
    /// 5 - 24 and a batched copy 3.5 - 41).
    pub gather_max_bytes: usize,
    /// From this mean size on, one async copy per fragment even where a
    /// batched copy is allowed. Off by default (`usize::MAX`): on the H200
    /// (docs/gpu-runs/2026-11-29-run2-bench-transfer.txt) one batched copy
    /// of 2 MiB fragments reached 54.4 / 53.9 GB/s against 50.6 / 51.8 for
    /// per-fragment copies.
    pub per_fragment_min_bytes: usize,
    /// Where the gather kernel would be chosen (mean fragment up to
    /// `gather_max_bytes`), the staged backend is chosen instead, whether or
    /// not the other direction is busy, when the job's contiguous host runs
    /// are at least this long on average. Off by default (`usize::MAX`):
    /// one way alone the gather kernel is as fast.
    pub staged_min_run_bytes: usize,
    /// Likewise, while the other direction is busy (jobs in flight, or within
    /// [`AutoThresholds::duplex_linger`] of its last one): at this mean
    /// host run length and above. With a load and a store at once, two
    /// gather kernels share about 80 GB/s of the link, and a copy engine
    /// against a gather kernel in the other direction gets about 25 GB/s
    /// (docs/gpu-runs/2026-11-30-duplex-probe.txt); copy engines both ways
    /// reach the link's duplex limit when their copies are long.
    pub staged_duplex_min_run_bytes: usize,
    /// How long after its last job was reported the other direction still
    /// counts as busy for [`Situation::other_busy`]. An engine serving
    /// requests sends stores in bursts with gaps between them: without
    /// this, a load submitted in a gap takes the gather kernel, and the
    /// next store, staged on a copy engine, runs against that kernel, the
    /// worst mix (about 25 GB/s for the copy engine). Zero: busy only while
    /// jobs are in flight.
    pub duplex_linger: Duration,
}

impl Default for AutoThresholds {
    fn default() -> Self {
        AutoThresholds {
            gather_max_bytes: 256 << 10,
            per_fragment_min_bytes: usize::MAX,
            staged_min_run_bytes: usize::MAX,
            staged_duplex_min_run_bytes: 256 << 10,
            duplex_linger: Duration::from_millis(DUPLEX_LINGER_MS),
        }
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
    /// The other direction's handler has jobs in flight, or had within
    /// [`AutoThresholds::duplex_linger`].
    pub other_busy: bool,
    /// Mean bytes of the job's contiguous host runs, when the handler has
    /// staging buffers and the job was planned for them (see [`may_stage`]);
    /// `None`: the staged backend is not available for this job.
    pub staged_run_bytes: Option<u64>,
}

/// Whether [`candidates`] could list [`Backend::Staged`] for a job with
/// this mean fragment size, before its host runs are known (the engine
/// plans host runs only then).
pub fn may_stage(choice: BackendChoice, th: &AutoThresholds, mean_bytes: u64, pinned: bool, other_busy: bool) -> bool {
    match choice {
        BackendChoice::Force(Backend::Staged) => true,
        BackendChoice::Auto => {
            let min = if other_busy {
                th.staged_min_run_bytes.min(th.staged_duplex_min_run_bytes)
            } else {
                th.staged_min_run_bytes
            };
            pinned
                && mean_bytes <= th.gather_max_bytes as u64
                && min != usize::MAX
                && mean_bytes < th.per_fragment_min_bytes as u64
        }
        BackendChoice::Force(_) => false,
    }
}

/// The backends to try for one job, best first; the last is always
/// [`Backend::PerFragment`], which is always allowed. The gather kernel may
/// still be refused later, when an alias cannot be had for every fragment.
pub fn candidates(choice: BackendChoice, th: &AutoThresholds, sit: Situation) -> Vec<Backend> {
    let batched_ok = !sit.capturing;
    let mut out = Vec::with_capacity(4);
    match choice {
        BackendChoice::Force(Backend::Batched) if batched_ok => out.push(Backend::Batched),
        BackendChoice::Force(Backend::Gather) => out.push(Backend::Gather),
        BackendChoice::Force(Backend::Staged) if batched_ok && sit.staged_run_bytes.is_some() => {
            out.push(Backend::Staged)
        }
        BackendChoice::Force(_) => {}
        BackendChoice::Auto => {
            let mean = sit.mean_bytes;
            if mean >= th.per_fragment_min_bytes as u64 {
                // Large runs reach the link with one copy each.
            } else {
                if let Some(run) = sit.staged_run_bytes.filter(|_| batched_ok && sit.pinned) {
                    let min = if sit.other_busy {
                        th.staged_min_run_bytes.min(th.staged_duplex_min_run_bytes)
                    } else {
                        th.staged_min_run_bytes
                    };
                    if mean <= th.gather_max_bytes as u64 && run >= min as u64 {
                        out.push(Backend::Staged);
                    }
                }
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
    use crate::names::Named;
    use Backend::*;

    fn sit(mean_bytes: u64, capturing: bool, pinned: bool) -> Situation {
        Situation { mean_bytes, capturing, pinned, other_busy: false, staged_run_bytes: None }
    }

    #[test]
    fn auto_stages_long_host_runs_while_the_other_direction_is_busy() {
        let th = AutoThresholds::default();
        let a = |s| candidates(BackendChoice::Auto, &th, s);
        let run =
            |mean, busy, run| Situation { other_busy: busy, staged_run_bytes: Some(run), ..sit(mean, false, true) };
        // Alone: the gather kernel, as before.
        assert_eq!(a(run(32 << 10, false, 1 << 20)), vec![Gather, Batched, PerFragment]);
        // Busy, host runs long enough: staged first.
        assert_eq!(a(run(32 << 10, true, 1 << 20)), vec![Staged, Gather, Batched, PerFragment]);
        assert_eq!(a(run(32 << 10, true, 256 << 10)), vec![Staged, Gather, Batched, PerFragment]);
        // Busy, host pages scattered: one DMA a page would be slow.
        assert_eq!(a(run(32 << 10, true, 32 << 10)), vec![Gather, Batched, PerFragment]);
        // Large fragments: batched copies already reach the link.
        assert_eq!(a(run(1 << 20, true, 1 << 20)), vec![Batched, PerFragment]);
        // Never while capturing, never on pageable memory.
        let capturing = Situation { capturing: true, ..run(32 << 10, true, 1 << 20) };
        assert_eq!(a(capturing), vec![Gather, PerFragment]);
        let pageable = Situation { pinned: false, ..run(32 << 10, true, 1 << 20) };
        assert_eq!(a(pageable), vec![PerFragment]);
        // Always staged from a run length on, when asked.
        let always = AutoThresholds { staged_min_run_bytes: 512 << 10, ..th };
        assert_eq!(candidates(BackendChoice::Auto, &always, run(32 << 10, false, 1 << 20))[0], Staged);
        assert_eq!(candidates(BackendChoice::Auto, &always, run(32 << 10, false, 256 << 10))[0], Gather);
        // may_stage agrees: planning is skipped where staged cannot win.
        assert!(may_stage(BackendChoice::Auto, &th, 32 << 10, true, true));
        assert!(!may_stage(BackendChoice::Auto, &th, 32 << 10, true, false));
        assert!(!may_stage(BackendChoice::Auto, &th, 32 << 10, false, true));
        assert!(!may_stage(BackendChoice::Auto, &th, 1 << 20, true, true));
        assert!(may_stage(BackendChoice::Auto, &always, 32 << 10, true, false));
        assert!(may_stage(BackendChoice::Force(Staged), &th, 1 << 30, false, false));
        assert!(!may_stage(BackendChoice::Force(Gather), &th, 16, true, true));
    }

    /// `may_stage` is exactly "`candidates` could list `Staged` for some
    /// host run length" (the engine plans host runs only where it says so,
    /// and a plan it says no to would never be used), at and around every
    /// threshold, for every choice.
    #[test]
    fn may_stage_is_exactly_where_candidates_could_stage() {
        let set = AutoThresholds {
            gather_max_bytes: 256 << 10,
            per_fragment_min_bytes: 128 << 10,
            staged_min_run_bytes: 64 << 10,
            staged_duplex_min_run_bytes: 32 << 10,
            ..AutoThresholds::default()
        };
        let wide = AutoThresholds { per_fragment_min_bytes: 512 << 10, ..set };
        let choices: Vec<BackendChoice> = std::iter::once(BackendChoice::Auto)
            .chain(Backend::all().iter().map(|&b| BackendChoice::Force(b)))
            .collect();
        for th in [AutoThresholds::default(), set, wide] {
            let edges = [
                th.gather_max_bytes,
                th.per_fragment_min_bytes,
                th.staged_min_run_bytes,
                th.staged_duplex_min_run_bytes,
            ];
            let finite = edges.into_iter().filter(|&e| e != usize::MAX).map(|e| e as u64);
            let means: Vec<u64> = finite.flat_map(|e| [e - 1, e, e + 1]).chain([1, 1 << 40]).collect();
            for &mean in &means {
                for (pinned, other_busy, &choice) in [false, true]
                    .into_iter()
                    .flat_map(|p| [false, true].map(|b| (p, b)))
                    .flat_map(|(p, b)| choices.iter().map(move |c| (p, b, c)))
                {
                    let could = [0u64, 32 << 10, 64 << 10, 1 << 40].into_iter().any(|run| {
                        let sit = Situation {
                            mean_bytes: mean,
                            capturing: false,
                            pinned,
                            other_busy,
                            staged_run_bytes: Some(run),
                        };
                        candidates(choice, &th, sit).contains(&Staged)
                    });
                    assert_eq!(
                        may_stage(choice, &th, mean, pinned, other_busy),
                        could,
                        "{choice:?}, mean {mean}, pinned {pinned}, other busy {other_busy}, {th:?}"
                    );
                }
            }
        }
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
        let planned = |capturing| Situation { staged_run_bytes: Some(64), ..sit(16 << 10, capturing, false) };
        assert_eq!(f(Staged, planned(false)), vec![Staged, PerFragment]);
        assert_eq!(f(Staged, planned(true)), vec![PerFragment], "never staged while capturing");
        assert_eq!(f(Staged, sit(16 << 10, false, true)), vec![PerFragment], "no staging buffers");
    }

    #[test]
    fn names_round_trip() {
        for &b in Backend::all() {
            assert_eq!(b.name().parse::<Backend>(), Ok(b));
            assert_eq!(b.name().parse::<BackendChoice>(), Ok(BackendChoice::Force(b)));
        }
        assert_eq!("auto".parse::<BackendChoice>(), Ok(BackendChoice::Auto));
        assert!("fast".parse::<BackendChoice>().is_err());
    }
}
