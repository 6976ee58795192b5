//! `kvoffload incident`: the seed incident (background pinning racing graph
//! capture), with upstream's design and with ours, on the same machine.

use crate::incident::{run as run_design, Design, IncidentConfig};
use clap::ValueEnum;

use super::backend::{self, BackendArg};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum DesignArg {
    All,
    Upstream,
    Windowed,
    Interleaved,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Host region size.
    #[arg(long, default_value = "16GiB", value_parser = backend::parse_size)]
    size: usize,
    /// Registration unit of the background pinner.
    #[arg(long, default_value = "256MiB", value_parser = backend::parse_size)]
    chunk: usize,
    /// How long each capture stays open, in milliseconds.
    #[arg(long, default_value_t = 100)]
    capture_ms: u64,
    /// Which design(s) to run.
    #[arg(long, value_enum, default_value_t = DesignArg::All)]
    design: DesignArg,
}

pub fn run(a: Args) -> Result<i32, String> {
    if a.size == 0 || a.chunk == 0 {
        return Err("--size and --chunk must be greater than zero".into());
    }
    let rt = backend::open(a.backend)?;
    println!("incident reproduction on {}: {} GiB region, {} MiB chunks", rt.describe(), a.size >> 30, a.chunk >> 20);
    let designs: &[Design] = match a.design {
        DesignArg::All => &[Design::Upstream, Design::Windowed, Design::Interleaved],
        DesignArg::Upstream => &[Design::Upstream],
        DesignArg::Windowed => &[Design::Windowed],
        DesignArg::Interleaved => &[Design::Interleaved],
    };
    let cfg = IncidentConfig {
        region_bytes: a.size,
        chunk_bytes: a.chunk,
        capture: std::time::Duration::from_millis(a.capture_ms),
        ..IncidentConfig::default()
    };
    let mut ours_clean = true;
    for &d in designs {
        let r = run_design(rt.clone(), d, &cfg)?;
        println!("{r}");
        match d {
            Design::Upstream if r.clean() => {
                println!("  note: no registration landed inside a capture this time (the race is timing-dependent)")
            }
            Design::Upstream => {
                println!("  => the seed's failure: captures invalidated by the background registration")
            }
            _ => ours_clean &= r.clean(),
        }
    }
    Ok(if ours_clean { 0 } else { 1 })
}
