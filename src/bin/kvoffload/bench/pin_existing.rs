//! `kvoffload bench pin --shared --existing`: time to ready on a persistent
//! region (the node pool's rows, docs/node-pool-design.md 6) whose pages
//! are already in tmpfs, beside a fresh one, in one run.
//!
//! Each measurement is one persistent region ([`Region::open_persistent`])
//! of `size` bytes, used twice:
//! - **fresh**: N rank processes create-or-open it (one creates, the others
//!   open it as it becomes ready), pin their own share with
//!   [`pin_with`] (pre-fault and register: `cuMemHostRegister` on a GPU),
//!   stamp every chunk of it, unregister and exit; the files stay;
//! - **existing**: N new rank processes open it (no process has it mapped
//!   any more; its pages were allocated and written by the fresh ones), pin
//!   their share the same way, and check the stamps (a rank that finds the
//!   region made anew, or another's stamps, fails the measurement).
//!
//! Afterwards the parent removes the region ([`Region::remove_persistent`])
//! and checks no file is left. The times are those of
//! [`super::pin_shared`]: open (create or open, reserving included) and pin
//! (pre-fault and register, to this rank's pinning settled), per rank, on
//! the machine's monotonic clock. There is no agreement between the ranks:
//! a persistent region offers no agreement words (they would be shared by
//! every engine that ever opened it), so each rank's outcome is its own.

use std::time::Instant;

use crate::run::metrics::monotonic_secs;
use kvoffload::internal::pin::{pin_with, PinOptions, Prepared};
use kvoffload::internal::protocol::PinState;
use kvoffload::internal::region::{pages, PersistentOrigin, Region};
use kvoffload::internal::runtime::GpuRuntime;
use kvoffload::internal::sync::{self, Arc, Mutex};
use kvoffload::units::fmt_bytes;

use super::pin_shared::{RankConfig, RankTimes, Settled, SharedReport};

/// Which use of the persistent region a measurement is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PoolPhase {
    /// Made by these ranks (one creates, the others open it).
    Fresh,
    /// Opened again by new processes after the fresh ones exited.
    Existing,
}

impl PoolPhase {
    /// `fresh` or `existing`, as the rank processes are told.
    pub fn name(self) -> &'static str {
        match self {
            PoolPhase::Fresh => "fresh",
            PoolPhase::Existing => "existing",
        }
    }

    /// The phase called `s`.
    pub fn parse(s: &str) -> Result<PoolPhase, String> {
        match s {
            "fresh" => Ok(PoolPhase::Fresh),
            "existing" => Ok(PoolPhase::Existing),
            other => Err(format!("unknown pool phase {other:?} (fresh, existing)")),
        }
    }
}

/// The stamp the fresh rank `rank` writes at the start of its chunk `chunk`.
fn stamp(rank: usize, chunk: usize) -> u64 {
    0x6b76_6f70_6f6f_6c00 ^ ((rank as u64) << 40) ^ chunk as u64
}

/// Runs one rank of one phase on `rt`: open the persistent region, pin
/// its share without agreement, stamp (fresh) or check (existing) it,
/// unregister, and report. Errors end up in the outcome.
pub fn run_pool_rank(cfg: &RankConfig, phase: PoolPhase, rt: &dyn GpuRuntime) -> RankTimes {
    let mut t = RankTimes { rank: cfg.rank, ..Default::default() };
    if let Err(e) = inner(cfg, phase, rt, &mut t) {
        t.outcome = format!("FAILED: {e}");
    }
    t
}

fn inner(cfg: &RankConfig, phase: PoolPhase, rt: &dyn GpuRuntime, t: &mut RankTimes) -> Result<(), String> {
    let layout = cfg.layout()?;
    let opts = cfg.shm_options();
    t.create = monotonic_secs();
    let region = Region::open_persistent(&cfg.name, layout, cfg.rank, &opts).map_err(|e| e.to_string())?;
    t.created = monotonic_secs();
    if phase == PoolPhase::Existing && region.persistent_origin() != Some(PersistentOrigin::Opened) {
        return Err("the region was not there any more: this rank made it anew".into());
    }
    t.files = region.file_paths().len();
    let region = Arc::new(region);
    t.pin = monotonic_secs();
    let popts = PinOptions::default().threads(cfg.threads).max_chunk_bytes(cfg.chunk);
    let prepared = Prepared::new(rt, &region, &popts).map_err(|e| e.to_string())?;
    t.share = prepared.bytes() as u64;
    let (coord, prefault) = prepared.into_parts();
    let settled = Settled::default();
    let state = pin_with(rt, &coord, prefault.as_ref(), Some(&settled), None).agreed();
    t.agreed = monotonic_secs();
    t.pinned = sync::lock(&settled.at).unwrap_or(t.agreed);
    t.huge = pages::huge_mapped_bytes(region.mapping_range().addr_range()).unwrap_or(0);
    t.outcome = match &state {
        Ok(PinState::Pinned) => "pinned".into(),
        Ok(s) => format!("ended {s:?}"),
        Err(e) => format!("pinning failed: {e}"),
    };
    // Pages pinning did not reserve (it ended early) are reserved before
    // the stamps touch them.
    let checked = match region.reserve_rest() {
        Ok(()) => stamps(&region, cfg.rank, phase),
        Err(e) => Err(e.to_string()),
    };
    if coord.pinning().registered_chunks() > 0 {
        let u = Instant::now();
        coord.pinning().unregister_all(rt).map_err(|e| format!("unregister: {e}"))?;
        t.unregister = u.elapsed().as_secs_f64();
    }
    checked
}

/// Fresh: writes this rank's stamp at the start of each of its chunks.
/// Existing: checks them (what the fresh ranks wrote is what this one
/// sees, so it pinned the same pages).
fn stamps(region: &Region, rank: usize, phase: PoolPhase) -> Result<(), String> {
    for chunk in 0..region.layout().num_rows() {
        let want = stamp(rank, chunk);
        match phase {
            PoolPhase::Fresh => {
                let p = region.chunk_ptr(rank, chunk).map_err(|e| e.to_string())?;
                // SAFETY: the chunk is this rank's own (no other process
                // writes it), page aligned and at least a page long, inside
                // the live mapping; nothing else of this process reads or
                // writes it now (pinning has settled).
                unsafe { p.as_ptr().cast::<u64>().write(want) };
            }
            PoolPhase::Existing => {
                let mut got = [0u8; 8];
                region.read_chunk(rank, chunk, 0, &mut got).map_err(|e| e.to_string())?;
                let got = u64::from_ne_bytes(got);
                if got != want {
                    return Err(format!("chunk {chunk} holds {got:#x}, not the fresh run's stamp {want:#x}"));
                }
            }
        }
    }
    Ok(())
}

/// Lines of the report's summary: per size, ranks and variant, the median
/// time to ready of the fresh and the existing region.
pub fn summary(r: &SharedReport) -> Vec<String> {
    let mut keys: Vec<(usize, usize, &'static str)> = Vec::new();
    for m in r.rows.iter().filter(|m| m.phase.is_some()) {
        if !keys.contains(&(m.size, m.ranks, m.variant.name)) {
            keys.push((m.size, m.ranks, m.variant.name));
        }
    }
    let med = |size, ranks, v, phase, f: &dyn Fn(&super::pin_shared::Measurement) -> Option<f64>| {
        super::pin::median(
            r.rows
                .iter()
                .filter(|m| m.size == size && m.ranks == ranks && m.variant.name == v && m.phase == Some(phase))
                .filter_map(f)
                .collect(),
        )
    };
    let s = |o: Option<f64>| o.map_or("-".to_string(), |x| format!("{x:.3} s"));
    let mut out = Vec::new();
    for (size, ranks, v) in keys {
        let open = |p| med(size, ranks, v, p, &|m| m.create_s());
        let pin = |p| med(size, ranks, v, p, &|m| m.pin_s());
        let e2e = |p| med(size, ranks, v, p, &|m| m.e2e_s());
        let (fe, xe) = (e2e(PoolPhase::Fresh), e2e(PoolPhase::Existing));
        let ratio = match (fe, xe) {
            (Some(f), Some(x)) if x > 0.0 => format!("{:.1}x faster", f / x),
            _ => "-".into(),
        };
        out.push(format!(
            "time to ready, {} x {ranks} rank(s), {v}, median: fresh region open {} + pin {} = {}; existing region \
             (pages in tmpfs from processes that exited) open {} + pin {} = {}: {ratio}",
            fmt_bytes(size),
            s(open(PoolPhase::Fresh)),
            s(pin(PoolPhase::Fresh)),
            s(fe),
            s(open(PoolPhase::Existing)),
            s(pin(PoolPhase::Existing)),
            s(xe),
        ));
    }
    out
}

/// A [`Settled`] with no time yet.
impl Default for Settled {
    fn default() -> Self {
        Settled { at: Mutex::new(None) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_round_trip_and_stamps_differ() {
        for p in [PoolPhase::Fresh, PoolPhase::Existing] {
            assert_eq!(PoolPhase::parse(p.name()), Ok(p));
        }
        assert!(PoolPhase::parse("old").unwrap_err().contains("fresh"));
        assert_ne!(stamp(0, 1), stamp(1, 1));
        assert_ne!(stamp(0, 1), stamp(0, 2));
    }
}
