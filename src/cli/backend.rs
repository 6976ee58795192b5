//! Choosing the runtime a command runs on, and parsing byte sizes.

use clap::ValueEnum;
use kvoffload::runtime::cuda::CudaRuntime;
use kvoffload::runtime::sim::SimRuntime;
use kvoffload::runtime::{shared, GpuRuntime};
use kvoffload::sync::Arc;

/// Which runtime to use.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The real GPU when a CUDA driver is present, the simulated GPU otherwise.
    Auto,
    /// The simulated GPU (no driver needed).
    Sim,
    /// The real GPU through the CUDA driver.
    Cuda,
}

/// Opens the chosen runtime; `auto` says on stderr which one it took.
pub fn open(b: BackendArg) -> Result<Arc<dyn GpuRuntime>, String> {
    match b {
        BackendArg::Sim => Ok(shared(SimRuntime::new())),
        BackendArg::Cuda => Ok(shared(CudaRuntime::open(0).map_err(|e| e.to_string())?)),
        BackendArg::Auto => {
            if CudaRuntime::driver_present() {
                match CudaRuntime::open(0) {
                    Ok(rt) => return Ok(shared(rt)),
                    Err(e) => eprintln!("kvoffload: no usable GPU ({e}); using the simulated GPU"),
                }
            } else {
                eprintln!("kvoffload: no CUDA driver found; using the simulated GPU");
            }
            Ok(shared(SimRuntime::new()))
        }
    }
}

/// Parses `512MiB`, `16GiB`, `1G`, `4096`, `2 MiB` (binary units; K/M/G/T
/// and KB/MB/GB/TB are taken as binary too).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("bad size {s:?}: expected a number with an optional unit like 16GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => return Err(format!("bad size {s:?}: unknown unit {other:?} (use KiB, MiB, GiB, TiB)")),
    };
    n.checked_shl(shift)
        .filter(|v| v >> shift == n)
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| format!("size {s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("16GiB"), Ok(16 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2 MiB"), Ok(2 << 20));
        assert!(parse_size("x").is_err());
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }
}
