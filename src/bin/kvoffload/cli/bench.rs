//! `kvoffload bench ...`: benchmarks that compare against a named baseline
//! in the same run.

use crate::bench::manager::{run_bench, BenchConfig};

#[derive(clap::Subcommand, Debug)]
pub enum Bench {
    /// Hit rate and operations per second of the LRU and ARC block managers
    /// on a Zipf and a scan-heavy trace.
    Manager(ManagerArgs),
    /// Pinning speed: one register call on untouched memory (upstream) against the pre-fault + chunked pipeline, and a sweep.
    Pin(super::bench_pin::PinArgs),
    /// GB/s of scattered store and load fragments for every copy backend
    /// and the automatic choice, data checked after every run.
    Transfer(super::bench_transfer::TransferArgs),
}

#[derive(clap::Args, Debug)]
pub struct ManagerArgs {
    /// Host slots the manager owns.
    #[arg(long, default_value_t = BenchConfig::default().capacity)]
    capacity: usize,
    /// Distinct keys in the Zipf trace.
    #[arg(long, default_value_t = BenchConfig::default().universe)]
    universe: usize,
    /// Accesses per (workload, policy) run.
    #[arg(long, default_value_t = BenchConfig::default().accesses)]
    accesses: usize,
    /// Zipf exponent (0 uniform, 1 classic Zipf).
    #[arg(long, default_value_t = BenchConfig::default().zipf_exponent)]
    zipf: f64,
    /// Seed of the traces.
    #[arg(long, default_value_t = BenchConfig::default().seed)]
    seed: u64,
}

pub fn run(b: Bench) -> Result<i32, String> {
    match b {
        Bench::Manager(a) => {
            let cfg = BenchConfig {
                capacity: a.capacity,
                universe: a.universe,
                accesses: a.accesses,
                zipf_exponent: a.zipf,
                seed: a.seed,
                ..BenchConfig::default()
            };
            cfg.validate().map_err(|e| e.to_string())?;
            println!("{}", run_bench(&cfg));
            Ok(0)
        }
        Bench::Pin(a) => super::bench_pin::run(a),
        Bench::Transfer(a) => super::bench_transfer::run(a),
    }
}
