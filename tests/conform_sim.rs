//! The conformance suite on the simulated GPU: every scenario matches what
//! FACTS.md section 1 (as corrected by the H200 run) says.

use kvoffload::conform::{run, scenarios, Backend};

#[test]
fn every_scenario_matches_on_the_simulated_gpu() {
    let report = run(&Backend::Sim, None, |_| {});
    assert_eq!(report.rows.len(), scenarios().len());
    assert!(report.rows.len() >= 28, "20 table cells and the ordering effects");
    for r in &report.rows {
        assert!(r.matches, "{}: expected {:?}, observed {:?}", r.id, r.expected, r.observed);
    }
}
