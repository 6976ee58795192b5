//! The conformance suite: every measured rule of docs/driver-rules.md as a
//! data-driven scenario that runs on any runtime, printed as expected
//! against observed. `kvoffload conform --backend sim|cuda` runs it; the sim
//! run is part of the test command, and the cuda run re-measures the rules
//! on a real GPU, so the simulated GPU can never drift from the driver
//! unnoticed.

mod cells;
mod ordering;
pub mod probe;

use std::fmt::Write as _;

pub use probe::Target;

use kvoffload::internal::runtime::sim::SimRuntime;
use kvoffload::internal::runtime::{DriverError, DriverResult};
use kvoffload::internal::sync::Arc;

/// A scenario's body: runs it on `Target`, returns what it observed (or why
/// it could not run).
pub type RunFn = dyn Fn(&Target) -> Result<Observed, String> + Send + Sync;

/// One scenario: what docs/driver-rules.md says, and the code that observes it.
pub struct Scenario {
    /// Stable name (`--only` takes it).
    pub id: String,
    /// The rule it checks (its description; docs/driver-rules.md has the row).
    pub facts: &'static str,
    /// The observation the rule predicts, in the format `run` produces.
    pub expected: String,
    /// Runs the scenario and describes what happened.
    pub run: Box<RunFn>,
    /// Leaves the runtime unusable (context poisoned): run it last, and on
    /// the simulated GPU on a runtime of its own.
    pub poisons: bool,
}

/// What a scenario saw: the compared outcome, and details (timings) that
/// are reported but not compared.
pub struct Observed {
    pub outcome: String,
    pub detail: String,
}

impl Observed {
    pub fn new(outcome: String) -> Self {
        Observed { outcome, detail: String::new() }
    }
    pub fn with_detail(mut self, d: String) -> Self {
        self.detail = d;
        self
    }
}

/// Renders a driver result the way scenarios compare them: `ok` or the code.
pub fn code<T>(r: &DriverResult<T>) -> String {
    match r {
        Ok(_) => "ok".to_string(),
        Err(DriverError { code, .. }) => code.0.to_string(),
    }
}

/// Every scenario, in the order they run (poisoning ones last).
pub fn scenarios() -> Vec<Scenario> {
    let mut v = cells::scenarios();
    v.extend(ordering::scenarios());
    v.sort_by_key(|s| s.poisons);
    v
}

/// One row of the report.
pub struct Row {
    pub id: String,
    pub facts: &'static str,
    pub expected: String,
    pub observed: String,
    pub detail: String,
    pub matches: bool,
}

/// Every scenario's outcome on one backend.
pub struct Report {
    pub backend: String,
    pub device: String,
    pub rows: Vec<Row>,
}

impl Report {
    pub fn mismatches(&self) -> usize {
        self.rows.iter().filter(|r| !r.matches).count()
    }

    /// The table as markdown, for committing next to the code.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# Conformance: backend `{}`\n\nDevice: {}\n", self.backend, self.device);
        let _ = writeln!(s, "| scenario | driver rule (docs/driver-rules.md) | expected | observed | match | detail |");
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for r in &self.rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                r.id,
                r.facts,
                r.expected,
                r.observed,
                if r.matches { "yes" } else { "**NO**" },
                r.detail
            );
        }
        let _ = writeln!(s, "\n{} scenarios, {} mismatches", self.rows.len(), self.mismatches());
        s
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "conformance of backend {} on {}", self.backend, self.device)?;
        let w = self.rows.iter().map(|r| r.id.len()).max().unwrap_or(8).max(8);
        writeln!(f, "{:<w$}  {:<44}  {:<44}  match", "scenario", "expected", "observed")?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<w$}  {:<44}  {:<44}  {}{}",
                r.id,
                r.expected,
                r.observed,
                if r.matches { "yes" } else { "MISMATCH" },
                if r.detail.is_empty() { String::new() } else { format!("  ({})", r.detail) }
            )?;
        }
        write!(f, "{} scenarios, {} mismatches", self.rows.len(), self.mismatches())
    }
}

/// Where scenarios run.
pub enum Backend {
    /// A fresh simulated GPU for every scenario.
    Sim,
    /// One real runtime for all of them.
    Real(Arc<dyn kvoffload::internal::runtime::GpuRuntime>),
}

/// Runs the scenarios whose id contains `only` (all when `None`).
/// `progress` is called before each scenario with its id.
pub fn run(backend: &Backend, only: Option<&str>, mut progress: impl FnMut(&str)) -> Report {
    let (name, device) = match backend {
        Backend::Sim => ("sim".to_string(), kvoffload::internal::runtime::sim::DESCRIPTION.to_string()),
        Backend::Real(rt) => (rt.backend().to_string(), rt.describe()),
    };
    let mut rows = Vec::new();
    for s in scenarios().into_iter().filter(|s| only.is_none_or(|o| s.id.contains(o))) {
        progress(&s.id);
        let target = match backend {
            Backend::Sim => Target::Sim(Arc::new(SimRuntime::new())),
            Backend::Real(rt) => Target::Real(rt.clone()),
        };
        let (observed, detail) = match (s.run)(&target) {
            Ok(o) => (o.outcome, o.detail),
            Err(e) => (format!("error: {e}"), String::new()),
        };
        let matches = observed == s.expected;
        tracing::info!(scenario = %s.id, expected = %s.expected, %observed, matches, "conformance scenario");
        rows.push(Row { id: s.id, facts: s.facts, expected: s.expected, observed, detail, matches });
    }
    Report { backend: name, device, rows }
}

/// The conformance suite on the simulated GPU: every scenario matches what
/// docs/driver-rules.md (as measured on the H200) says (was
/// tests/conform_sim.rs).
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_matches_on_the_simulated_gpu() {
        let report = run(&Backend::Sim, None, |_| {});
        assert_eq!(report.rows.len(), scenarios().len());
        assert!(report.rows.len() >= 28, "20 table cells and the ordering effects");
        for r in &report.rows {
            assert!(r.matches, "{}: expected {:?}, observed {:?}", r.id, r.expected, r.observed);
        }
    }
}
