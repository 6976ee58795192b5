//! The parent's summary after its ranks ended: each rank's lines, the
//! totals, and the exit status.

use kvoffload::units::fmt_bytes;

use crate::run::metrics::{Intervals, Latencies, Throughput};
use crate::run::report::{self, RankReport};
use crate::run::RunConfig;

use super::supervise::Outcome;
use super::{signal_name, STOP_GRACE};

/// Prints the summary of `o` and gives the run's exit status (the module
/// docs of `cli/run.rs` say which).
pub(super) fn summarise(cfg: &RunConfig, o: &Outcome) -> i32 {
    let Outcome {
        reports,
        errors,
        statuses,
        killed,
        aborted,
        overdue,
        lat,
        per_rank_lat,
        busy,
        interrupted,
        wall,
        left,
    } = o;
    let (interrupted, wall, left) = (*interrupted, *wall, *left);
    let mut ok = true;
    let mut tot = RankReport::default();
    let (mut store, mut load) = (Throughput::default(), Throughput::default());
    let (mut prefill, mut sweep) = (Throughput::default(), Throughput::default());
    for r in 0..cfg.ranks {
        match (&reports[r], killed[r]) {
            (_, true) => println!("rank {r}: killed (SIGKILL at {}), as asked", cfg.kill_at.name()),
            (Some(rep), false) => {
                print_rank(rep, &per_rank_lat[r]);
                ok &= rep.clean();
                tot.requests += rep.requests;
                tot.stores += rep.stores;
                tot.loads += rep.loads;
                tot.lookups += rep.lookups;
                tot.hits += rep.hits;
                tot.blocks_verified += rep.blocks_verified;
                tot.blocks_corrupted += rep.blocks_corrupted;
                tot.blocks_lost += rep.blocks_lost;
                tot.sweep_blocks += rep.sweep_blocks;
                tot.jobs_failed += rep.jobs_failed;
                tot.graphs_failed += rep.graphs_failed;
                store.add(rep.store.bytes, rep.store.seconds);
                load.add(rep.load.bytes, rep.load.seconds);
                prefill.add(rep.prefill_store.bytes, rep.prefill_store.seconds);
                sweep.add(rep.sweep_load.bytes, rep.sweep_load.seconds);
            }
            (None, false) if aborted[r] && errors[r].is_none() => {
                ok = false;
                println!("rank {r}: stopped (another rank failed)");
            }
            (None, false) if overdue[r] => {
                ok = false;
                println!("rank {r}: no result (SIGKILLed: still running {} s after SIGTERM)", STOP_GRACE.as_secs());
            }
            (None, false) => {
                ok = false;
                let why = errors[r].clone().unwrap_or_else(|| match statuses[r] {
                    Some(s) => format!("exited without a result ({s})"),
                    None => "exited without a result".into(),
                });
                println!("rank {r}: FAILED: {why}");
            }
        }
    }
    let finished = reports.iter().filter(|r| r.is_some()).count();
    let failed = (0..cfg.ranks).any(|r| reports[r].is_none() && !killed[r]);
    if let (Some(sig), 0) = (interrupted, tot.stores + tot.loads) {
        // Stopped before any transfer: the rank lines above (if any) are
        // all it measured, no table of zeros.
        println!("region file left: {}", if left { "YES (removed now)" } else { "no" });
        println!(
            "result: INTERRUPTED by {} after {wall:.2} s, before any transfer ({finished} of {} ranks reported)",
            signal_name(sig),
            cfg.ranks
        );
        return 128 + sig;
    }
    if failed && interrupted.is_none() {
        // No figures from a failed run: the errors above are what it says.
        println!("region file left: {}", if left { "YES (removed now)" } else { "no" });
        println!("result: FAILED");
        return 1;
    }
    println!(
        "total: {} requests, {} stores, {} loads over {finished} rank(s) in {wall:.2} s; hit rate {:.1}%; \
         store {:.2} GB/s, load {:.2} GB/s (bytes / summed busy time per rank); job latency p50 {} p99 {}",
        tot.requests,
        tot.stores,
        tot.loads,
        100.0 * tot.hit_rate(),
        store.gbps(),
        load.gbps(),
        fmt_us(lat.percentile(50.0)),
        fmt_us(lat.percentile(99.0)),
    );
    // "-" where a stage moved nothing (no --prefill-blocks, say).
    let rate = |bytes: u64, gbps: f64| if bytes > 0 { format!("{gbps:.2} GB/s") } else { "-".to_string() };
    println!(
        "one direction at a time: stores alone (prefill) {}, loads alone (final sweep) {} (bytes / summed busy time per rank)",
        rate(prefill.bytes, prefill.gbps()),
        rate(sweep.bytes, sweep.gbps()),
    );
    if finished > 1 {
        let union = |k: &str| busy.get(k).map_or(0.0, Intervals::union);
        let gbps =
            |bytes: u64, k: &str| rate(bytes, Throughput { bytes, seconds: union(k), ..Default::default() }.gbps());
        println!(
            "all ranks together (every rank's bytes / time with a job of that kind in flight on any rank): \
             requests: store {}, load {} ({:.3} s, {:.3} s); stores alone {}, loads alone {}",
            gbps(store.bytes, "store-mixed"),
            gbps(load.bytes, "load-mixed"),
            union("store-mixed"),
            union("load-mixed"),
            gbps(prefill.bytes, "store-prefill"),
            gbps(sweep.bytes, "load-sweep"),
        );
    }
    println!(
        "blocks: {} verified ({} in the final sweep), {} corrupted, {} lost; jobs failed (injected faults): {}",
        tot.blocks_verified, tot.sweep_blocks, tot.blocks_corrupted, tot.blocks_lost, tot.jobs_failed
    );
    println!("region file left: {}", if left { "YES (removed now)" } else { "no" });
    if let Some(sig) = interrupted {
        println!(
            "result: INTERRUPTED by {} after {wall:.2} s: {} of {} ranks reported; {} blocks verified, {} corrupted, {} lost",
            signal_name(sig),
            finished,
            cfg.ranks,
            tot.blocks_verified,
            tot.blocks_corrupted,
            tot.blocks_lost
        );
        return 128 + sig;
    }
    ok &= !left && finished > 0;
    if ok {
        println!("result: ok, every loaded block verified ({} blocks), 0 corrupted, 0 lost", tot.blocks_verified);
        0
    } else {
        println!("result: FAILED");
        1
    }
}

fn fmt_us(s: f64) -> String {
    if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.0} us", s * 1e6)
    }
}

fn print_rank(r: &RankReport, lat: &Latencies) {
    if r.interrupted {
        println!("rank {}: stopped early on request (SIGINT/SIGTERM); its figures cover the work until then", r.rank);
        if r.pin_state.is_empty() {
            // Stopped before pinning settled: shutdown cancelled it.
            println!("rank {}: stopped before its pin state settled (pinning cancelled)", r.rank);
            return;
        }
    }
    println!(
        "rank {}: pinning {} took {:.3} s ({:.2} GB/s, {:.0}% in 2 MiB pages); state {}; agreement {} after {:.3} s",
        r.rank,
        fmt_bytes(r.region_bytes as usize),
        r.pin_seconds,
        r.pin_gbps(),
        100.0 * r.huge_bytes as f64 / (r.region_bytes.max(1)) as f64,
        r.pin_state,
        r.agreement,
        r.agreed_seconds
    );
    println!(
        "  capture: {} windows, waited {:.3} s in total, {:.3} s at most ({} chunk registrations meanwhile); graphs {} ok, {} failed",
        r.windows, r.window_wait_total, r.window_wait_max, r.chunks_waited, r.graphs_ok, r.graphs_failed
    );
    if r.interrupted && r.stores + r.loads == 0 {
        println!("  stopped before its first transfer");
        return;
    }
    if r.prefill_store.bytes > 0 {
        println!(
            "  prefill: {} stored in {:.2} s at {:.2} GB/s (stores alone)",
            fmt_bytes(r.prefill_store.bytes as usize),
            r.prefill_seconds,
            r.prefill_store.gbps()
        );
    }
    println!(
        "  workload: {} requests in {:.2} s; {} stores {} at {:.2} GB/s ({:.1} in flight on average while any; {}), {} loads {} at {:.2} GB/s ({:.1} in flight; {}); hit rate {:.1}%; {} evictions; latency p50 {} p99 {}",
        r.requests,
        r.workload_seconds,
        r.stores,
        fmt_bytes(r.store.bytes as usize),
        r.store.gbps(),
        r.store.mean_in_flight(),
        report::backend_mix(&r.store_backends),
        r.loads,
        fmt_bytes(r.load.bytes as usize),
        r.load.gbps(),
        r.load.mean_in_flight(),
        report::backend_mix(&r.load_backends),
        100.0 * r.hit_rate(),
        r.evictions,
        fmt_us(lat.percentile(50.0)),
        fmt_us(lat.percentile(99.0)),
    );
    println!(
        "  blocks: {} verified ({} in the final sweep, loaded at {:.2} GB/s alone), {} corrupted, {} lost; jobs failed: {} ({} stores, {} loads)",
        r.blocks_verified,
        r.sweep_blocks,
        r.sweep_load.gbps(),
        r.blocks_corrupted,
        r.blocks_lost,
        r.jobs_failed,
        r.stores_failed,
        r.loads_failed
    );
}
