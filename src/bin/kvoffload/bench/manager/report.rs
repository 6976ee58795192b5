//! Results of the policy comparison and their table.

use kvoffload::Named;
use std::fmt;
use std::time::Duration;

use super::{BenchConfig, Workload};
use crate::run::metrics::ratio;
use kvoffload::internal::manager::{ManagerCounters, PolicyKind};

/// What a row ran: the in-process block manager under one of its policies,
/// or the node pool's index (`ways`-way sets, CLOCK within each set).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The block manager (LRU or ARC over every slot).
    Manager(PolicyKind),
    /// The node pool's sets of `ways` slots (docs/node-pool-design.md 2.3, 3.5).
    Pool { ways: u32 },
}

impl Policy {
    /// Short name for the table.
    pub fn name(self) -> String {
        match self {
            Policy::Manager(p) => p.name().to_string(),
            Policy::Pool { ways } => format!("pool-{ways}w"),
        }
    }
}

/// One (workload, policy) run.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRow {
    pub workload: Workload,
    pub policy: Policy,
    /// Host slots.
    pub capacity: usize,
    /// Accesses played.
    pub accesses: u64,
    /// Accesses whose lookup hit.
    pub hits: u64,
    /// Manager calls made (lookup, touch, prepare/complete store or load).
    pub ops: u64,
    /// Manager calls refused (expected 0).
    pub failures: u64,
    /// Time spent in the access loop.
    pub elapsed: Duration,
    /// The manager's counters at the end (zero for the pool).
    pub counters: ManagerCounters,
    /// Keys the pool skipped (their set had no claimable slot).
    pub skipped: u64,
}

impl BenchRow {
    pub(crate) fn new(workload: Workload, policy: Policy, capacity: usize) -> Self {
        Self {
            workload,
            policy,
            capacity,
            accesses: 0,
            hits: 0,
            ops: 0,
            failures: 0,
            elapsed: Duration::ZERO,
            counters: ManagerCounters::default(),
            skipped: 0,
        }
    }

    /// Fraction of accesses that hit, in `0.0..=1.0`.
    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits as f64, self.accesses as f64)
    }

    /// Manager calls per second.
    pub fn ops_per_sec(&self) -> f64 {
        ratio(self.ops as f64, self.elapsed.as_secs_f64())
    }
}

/// Every run of [`run_bench`](super::run_bench), with the configuration used.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchReport {
    /// The configuration after clamping.
    pub config: BenchConfig,
    /// One row per (workload, policy).
    pub rows: Vec<BenchRow>,
}

impl BenchReport {
    /// The row for `workload` under `policy` (the tests look rows up).
    #[cfg(test)]
    pub fn row(&self, workload: Workload, policy: Policy) -> Option<&BenchRow> {
        self.rows.iter().find(|r| r.workload == workload && r.policy == policy)
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "block manager: {} slots, zipf over {} keys (s = {}), seed {:#x}",
            c.capacity, c.universe, c.zipf_exponent, c.seed
        )?;
        writeln!(f, "scan-heavy: {} zipf accesses, then {} keys read once, repeated", c.hot_run, c.scan_length)?;
        writeln!(
            f,
            "fill: {} keys ({}% of the slots) read in order, repeated: every pass after the first hits in an LRU",
            c.fill_keys(),
            c.fill_percent
        )?;
        writeln!(
            f,
            "{:<11} {:<8} {:>9} {:>9} {:>9} {:>12}",
            "workload", "policy", "capacity", "accesses", "hit rate", "ops/s"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<11} {:<8} {:>9} {:>9} {:>8.2}% {:>12.0}",
                r.workload.name(),
                r.policy.name(),
                r.capacity,
                r.accesses,
                100.0 * r.hit_rate(),
                r.ops_per_sec()
            )?;
        }
        write!(
            f,
            "ops/s: manager calls per second (4 per access, one key per call); pool-Nw: the node pool's index, \
             N-way sets with CLOCK in each, one engine (its capacity rounded down to whole sets)"
        )?;
        let failures: u64 = self.rows.iter().map(|r| r.failures).sum();
        if failures > 0 {
            write!(f, "\nwarning: {failures} manager calls were refused")?;
        }
        Ok(())
    }
}
