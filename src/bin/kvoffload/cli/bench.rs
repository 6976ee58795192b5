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
    /// Pinning time at 256 GiB - 1 TiB per node, projected from measured sizes (by default the
    /// committed H200 medians of 2026-12-02), checked against each measured size first.
    PinProject(ProjectArgs),
    /// GB/s of scattered store and load fragments for every copy backend
    /// and the automatic choice, data checked after every run.
    Transfer(super::bench_transfer::TransferArgs),
}

#[derive(clap::Args, Debug)]
pub struct ProjectArgs {
    /// A measured size, SIZE:DEFAULTS:PREFAULT:REGISTER:ONECALL:SMALLPAGES in GB/s (from `bench pin
    /// --sizes`: (b), pre-fault alone, register alone, (a), (h)); repeat for each size [default: the
    /// committed H200 medians, docs/gpu-runs/2026-12-02-pin-sizes/].
    #[arg(long = "point", value_parser = crate::bench::pin_project::parse_point)]
    points: Vec<crate::bench::pin_project::Point>,
    /// Sizes to project to.
    #[arg(long, value_delimiter = ',', value_parser = kvoffload::units::parse_size, default_value = "256GiB,512GiB,768GiB,1TiB")]
    to: Vec<usize>,
    /// Largest error at a measured size, in percent, for the model to count as holding.
    #[arg(long, default_value_t = 10.0)]
    tolerance: f64,
    /// Write the picture (seconds against size) as pin-project.svg into this directory.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
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
    /// Keys of the fill trace, in percent of the capacity (1-100).
    #[arg(long, default_value_t = BenchConfig::default().fill_percent)]
    fill: usize,
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
                fill_percent: a.fill,
                ..BenchConfig::default()
            };
            cfg.validate().map_err(|e| e.to_string())?;
            println!("{}", run_bench(&cfg));
            Ok(0)
        }
        Bench::Pin(a) => super::bench_pin::run(a),
        Bench::PinProject(a) => {
            use crate::bench::pin_project::{Projection, H200_2026_12_02};
            let points = if a.points.is_empty() { H200_2026_12_02.to_vec() } else { a.points };
            let p = Projection::new(points, a.to, a.tolerance)?;
            println!("{p}");
            if let Some(dir) = &a.svg {
                super::picture(dir, "pin-project.svg", |path| p.write_svg(path))?;
            }
            Ok(if p.holds() { 0 } else { 1 })
        }
        Bench::Transfer(a) => super::bench_transfer::run(a),
    }
}
