//! `kvoffload bench transfer` on the simulated GPU: every row runs and
//! verifies, and the report names the targets.

use std::sync::Arc;

use kvoffload::runtime::sim::SimRuntime;
use kvoffload::runtime::GpuRuntime;
use kvoffload::transfer::bench::{run_bench, BenchConfig};
use kvoffload::transfer::{Backend, BackendChoice};

#[test]
fn sim_bench_verifies_every_row() {
    let rt: Arc<dyn GpuRuntime> = Arc::new(SimRuntime::new());
    let cfg = BenchConfig {
        total: 2 << 20,
        sizes: vec![16 << 10, 256 << 10, 2 << 20],
        repeats: 2,
        chunk_bytes: 1 << 20,
        ..BenchConfig::sim_default()
    };
    let mut labels = 0;
    let r = run_bench(rt, &cfg, |_| labels += 1).unwrap();
    // Per size: 2 directions x 4 choices alone, then a load and a store at
    // once where the size gives at least two blocks (not 2 MiB of 2 MiB).
    assert_eq!(r.rows.len(), 3 * 2 * 4 + 2 * 2);
    assert_eq!(labels, 3 * 2 * 4 + 2);
    assert_eq!(r.failures(), 0, "{r}");
    for row in &r.rows {
        if let BackendChoice::Force(b) = row.choice {
            assert_eq!(row.used, Some(b), "{row:?}");
        }
        assert_eq!(row.ratio.is_some(), !row.concurrent, "{row:?}");
        assert!(row.bytes > 0, "{row:?}");
    }
    assert_eq!(r.rows.iter().filter(|x| x.concurrent).count(), 4);
    // Auto: gather for small fragments, batched at 2 MiB (pinned, not capturing).
    let auto =
        |size| r.rows.iter().find(|x| x.choice == BackendChoice::Auto && !x.concurrent && x.size == size).unwrap().used;
    assert_eq!(auto(16 << 10), Some(Backend::Gather));
    assert_eq!(auto(2 << 20), Some(Backend::Batched));
    let text = r.to_string();
    assert!(
        text.contains("meaningless")
            && text.contains("target >= 45")
            && text.contains("both directions at once")
            && text.contains("rows verified: 28 of 28"),
        "{text}"
    );
}

#[test]
fn bad_config_is_refused() {
    let rt: Arc<dyn GpuRuntime> = Arc::new(SimRuntime::new());
    let cfg = BenchConfig { sizes: vec![12], ..BenchConfig::sim_default() };
    assert!(run_bench(rt.clone(), &cfg, |_| {}).unwrap_err().contains("multiple of 8"));
    let cfg = BenchConfig { sizes: vec![4 << 20], total: 1 << 20, ..BenchConfig::sim_default() };
    assert!(run_bench(rt, &cfg, |_| {}).unwrap_err().contains("larger than --total"));
}
