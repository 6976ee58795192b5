//! Choosing the runtime a command runs on, and parsing byte sizes.

use clap::ValueEnum;
use kvoffload::internal::runtime::cuda::CudaRuntime;
use kvoffload::internal::runtime::sim::SimRuntime;
use kvoffload::internal::runtime::{shared, GpuRuntime};
use kvoffload::internal::sync::Arc;
use kvoffload::Named;

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

pub use kvoffload::units::parse_size;

/// The clap parser of a [`Named`] enum: its table's names are the
/// possible values (`--help` lists them), parsed with the same table.
pub fn named<T: Named + Send + Sync>() -> impl clap::builder::TypedValueParser<Value = T> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(T::names()).map(|s| T::from_name(&s).expect("clap checked the name"))
}
