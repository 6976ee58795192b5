//! The policy comparison behind `kvoffload bench manager`.

use kvoffload::manager::bench::{run_bench, BenchConfig, BenchError, Workload};
use kvoffload::manager::PolicyKind;

fn small() -> BenchConfig {
    BenchConfig {
        capacity: 64,
        universe: 512,
        accesses: 6_000,
        hot_run: 128,
        scan_length: 64,
        ..BenchConfig::default()
    }
}

#[test]
fn manager_bench_report_has_every_row_and_no_refused_call() {
    let report = run_bench(&small());
    assert_eq!(report.rows.len(), 4);
    for w in Workload::ALL {
        for p in PolicyKind::ALL {
            let row = report.row(w, p).expect("row");
            assert_eq!(row.accesses, 6_000);
            assert_eq!(row.failures, 0);
            assert!(row.hit_rate() > 0.0 && row.hit_rate() < 1.0);
            assert_eq!(row.counters.hits, row.hits);
        }
    }
    let text = report.to_string();
    for needle in ["zipf", "scan-heavy", "lru", "arc", "hit rate", "ops/s"] {
        assert!(text.contains(needle), "{needle} missing from\n{text}");
    }
}

#[test]
fn manager_bench_arc_resists_scans_better_than_lru() {
    let report = run_bench(&small());
    let hit = |p| report.row(Workload::ScanHeavy, p).map(|r| r.hit_rate()).unwrap_or(0.0);
    assert!(hit(PolicyKind::Arc) > hit(PolicyKind::Lru), "{report}");
}

#[test]
fn manager_bench_same_seed_same_hit_rates() {
    let (a, b) = (run_bench(&small()), run_bench(&small()));
    let hits = |r: &kvoffload::manager::bench::BenchReport| -> Vec<u64> { r.rows.iter().map(|row| row.hits).collect() };
    assert_eq!(hits(&a), hits(&b));
}

#[test]
fn manager_bench_bad_config_is_typed_error_and_clamped() {
    let bad = BenchConfig { capacity: 0, zipf_exponent: f64::NAN, accesses: 10, ..small() };
    assert!(matches!(bad.validate(), Err(BenchError::OutOfRange { field: "capacity", value: 0, .. })));
    let report = run_bench(&bad);
    assert_eq!(report.config.capacity, 1);
    assert!(report.config.validate().is_ok());
    assert_eq!(report.rows.len(), 4);
    let neg = BenchConfig { zipf_exponent: -1.0, ..small() };
    assert!(matches!(neg.validate(), Err(BenchError::Exponent { .. })));
    assert!(BenchConfig::default().validate().is_ok());
}

/// Prints the default comparison (run with `--ignored --nocapture`).
#[test]
#[ignore = "prints the default report; run with --ignored --nocapture"]
fn manager_bench_print_default_report() {
    let start = std::time::Instant::now();
    let report = run_bench(&BenchConfig::default());
    println!("{report}\n(took {:?})", start.elapsed());
}
