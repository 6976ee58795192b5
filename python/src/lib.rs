//! `kvoffload._native`: the Python front of kvoffload (PyO3, abi3).
//!
//! The classes an engine holds mirror the library's: [`PyOffloader`]
//! (`kvoffload.Offloader`, the slot-addressed core `Offloader`) and
//! [`PyKeyedOffloader`] (`kvoffload.KeyedOffloader`, the keyed layer
//! `KeyedOffloader`), both subclasses of one hidden base
//! [`PyOffloaderBase`] (`kvoffload._OffloaderBase`) that holds the library
//! offloader and implements the calls they share; a [`PyRuntime`] (`kvoffload.Runtime`)
//! for the GPU it runs on (the CUDA driver on the device's primary context,
//! shared with PyTorch, or the simulated GPU); small result classes; the
//! exceptions of [`errors`]; and an agreement transport backed by a Python
//! callable ([`PyTransport`]). The test hooks (the simulated GPU's
//! counters, faults and hold points, the coordinator's counts, direct block
//! reads and writes) are not on these classes: they are the native
//! submodule [`testing`], which `kvoffload/_testing.py` wraps (tests only,
//! not part of the API).
//!
//! Every call that can block (construction, pinning waits, capture windows,
//! job waits, shutdown, the submissions) releases the GIL. The waits
//! (joining or creating a shared region, `wait_pinned` and with it the
//! ranks' agreement, entering a capture window, `capture_begin`,
//! `capture_end`, `capture_abort`, `gated`, `wait`, `wait_all`,
//! `wait_jobs`, the drain of `shutdown`; the table is
//! docs/blocking-calls.md) use the library's interruptible forms with
//! [`Signals`] as their check: Ctrl-C (any signal whose Python handler
//! raises) stops them within about 50 ms and raises the handler's
//! exception (`KeyboardInterrupt`), leaving nothing behind (an
//! interrupted `capture_end` closes its window and leaves the jobs it did
//! not submit deferred, in order, for the next flush).
//!
//! Files: `offloader.rs` (`_OffloaderBase`, `Offloader`,
//! `KeyedOffloader`, `CaptureWindow`; the lock
//! discipline of its job bookkeeping at the top), `front.rs` (the
//! library offloader it holds: keyed, or the slot-addressed core),
//! `book.rs` (that
//! bookkeeping, and the panic guard of the entry points), `runtime.rs`
//! (`Runtime`), `results.rs` (the result classes), `options.rs` (the option
//! classes: `PinOptions`, `TransferOptions`, `RegionSpec`, `ShmOptions`),
//! `args.rs` (arguments from Python), `tensors.rs` (the KV cache's classes,
//! `KvSpec` and `KvAlloc`, and the engine's tensors, CPU ones adopted on
//! the sim), `signals.rs`, `agreement.rs`, `errors.rs`, `testing.rs`;
//! `pool.rs` (`kvoffload.Pool`, the node pool's protocol for an engine's
//! processes), `pool_words.rs`, `pool_args.rs`.

mod agreement;
mod args;
mod book;
mod errors;
mod front;
mod offloader;
mod options;
mod pool;
mod pool_args;
mod pool_words;
mod results;
mod runtime;
mod signals;
mod tensors;
mod testing;

use std::sync::Mutex;
use std::time::Duration;

use kvoffload::{
    BlockKey, CaptureWindow, Completion, CudaRuntime, DevicePtr, GpuRuntime, JobId, KeyedOffloader, KvSpec, Lane,
    Named, Offloader, OffloaderError, OffloaderOptions, PinHold, PinOutcome, PinState, SimRuntime, SkipReason, SlotJob,
    Stream, TensorSpec, TransferError, Transport,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::Arc;

use agreement::*;
use args::*;
use book::*;
use front::*;
use offloader::*;
use options::{PyPinOptions, PyRegionSpec, PyShmOptions, PyTransferOptions};
use results::*;
use runtime::*;
use signals::*;
use tensors::{PyKvAlloc, PyKvSpec};

/// Sends the library's tracing events (pinning progress, agreement,
/// shutdown) to stderr, filtered like RUST_LOG (e.g. `"info"`,
/// `"kvoffload=debug"`). Returns False when a subscriber was already set.
/// A filter that does not parse raises `OptionsError` naming the first
/// directive that does not.
#[pyfunction]
#[pyo3(signature = (filter = "info"))]
fn enable_logging(py: Python<'_>, filter: &str) -> PyResult<bool> {
    use tracing_subscriber::filter::Directive;
    let f = tracing_subscriber::EnvFilter::try_new(filter).map_err(|e| {
        // The directive at fault: the first of the comma-separated ones
        // that does not parse alone (the whole filter if each does).
        let bad = filter.split(',').map(str::trim).find(|d| !d.is_empty() && d.parse::<Directive>().is_err());
        errors::options(
            py,
            format!(
                "enable_logging: {:?} is not a filter directive ({e}); a filter is RUST_LOG's syntax, directives \
                 separated by commas, such as \"info\" or \"warn,kvoffload=debug\"",
                bad.unwrap_or(filter)
            ),
        )
    })?;
    Ok(tracing_subscriber::fmt().with_env_filter(f).with_writer(std::io::stderr).try_init().is_ok())
}

/// True when the CUDA driver library can be loaded here.
#[pyfunction]
fn cuda_driver_present() -> bool {
    CudaRuntime::driver_present()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRuntime>()?;
    m.add_class::<PyOffloaderBase>()?;
    m.add_class::<PyOffloader>()?;
    m.add_class::<PyKeyedOffloader>()?;
    m.add_class::<PyCaptureWindow>()?;
    m.add_class::<PyPinHold>()?;
    m.add_class::<PyKvSpec>()?;
    m.add_class::<PyKvAlloc>()?;
    m.add_class::<PyPinOptions>()?;
    m.add_class::<PyTransferOptions>()?;
    m.add_class::<PyRegionSpec>()?;
    m.add_class::<PyShmOptions>()?;
    m.add_class::<PyPinState>()?;
    m.add_class::<PyPinProgress>()?;
    m.add_class::<PyPinOutcome>()?;
    m.add_class::<PyStoreSubmitted>()?;
    m.add_class::<PyCompletion>()?;
    m.add_class::<pool::PyPool>()?;
    m.add_function(wrap_pyfunction!(enable_logging, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_driver_present, m)?)?;
    m.add("SETTLED_PINNED", kvoffload::internal::protocol::agreement::SETTLED_PINNED)?;
    m.add("SETTLED_PAGEABLE", kvoffload::internal::protocol::agreement::SETTLED_PAGEABLE)?;
    testing::register(m)?;
    errors::register(m)
}
