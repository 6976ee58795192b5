//! Rust errors as a small hierarchy of Python exceptions.
//!
//! ```text
//! KvoffloadError                 every error of the package
//! ├── OptionsError               bad arguments, options, KV description, layout,
//! │                              a slot job's shape, kv_groups on a KeyedOffloader
//! │                              (also a ValueError: `except ValueError` catches it)
//! ├── RegionError                creating, joining or mapping the host region
//! ├── ProtocolError              the capture-safety protocol refused
//! │   └── ShutDownError          used after shutdown (or shut down twice)
//! ├── DriverError                a CUDA driver call failed (.code, .call)
//! ├── ManagerError               the block manager refused (key not stored, no slot)
//! ├── TransferError              the transfer engine refused a job (a job id
//! │                              used before, a host slot busy, a window open)
//! ├── AgreementError             the ranks did not agree (P7)
//! └── PoolError                  the node pool refused (its file, the engine
//!     │                          table: full, not joined, a timeout)
//!     ├── PoolStateError         a slot not in the state a call needs, a corrupt word
//!     └── PoolMismatchError      the pool holds KV of another meaning (a
//!                                fingerprint field; also a ValueError)
//! ```
//!
//! Every instance carries the typed reason as attributes: `kind` (the Rust
//! variant in snake case, e.g. `"gpu_block_count"`), `reason` (the inner
//! error's variant, e.g. `"already_exists"`, or None) and, for driver
//! errors, `code` (the CUresult as an int, or None when no driver exists),
//! `code_name` and `call` (the driver entry point). `ShutDownError` is the
//! one exception: whichever call met the shutdown (a store, a wait, a
//! capture window, `gated`, a second `shutdown`), its `kind` is
//! `"shut_down"` and its `reason` `"shut_down"`, or `"already_shut_down"`
//! for `shutdown` asked for again.
//!
//! A Rust panic inside a call is caught at the entry point and raised as
//! `KvoffloadError` with kind `"panic"` (never `PanicException`).
//!
//! An interrupted wait (the library's `Interrupted` errors) is not a
//! kvoffload error: it raises the exception the signal handler raised
//! (`Signals` in lib.rs keeps it), or `KeyboardInterrupt` when none was
//! kept.

use kvoffload::{
    AgreementError as RustAgreementError, DriverError as RustDriverError, OffloaderError, OpenError, PinError,
    ProtocolError as RustProtocolError, RegionError as RustRegionError, ShutdownError,
    TransferError as RustTransferError,
};
use pyo3::exceptions::{PyException, PyKeyboardInterrupt, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::PyTypeInfo;

pyo3::create_exception!(kvoffload, KvoffloadError, PyException, "Base class of every kvoffload error.");
pyo3::create_exception!(
    kvoffload,
    RegionError,
    KvoffloadError,
    "The host region could not be created, joined or mapped."
);
pyo3::create_exception!(
    kvoffload,
    ProtocolError,
    KvoffloadError,
    "The capture-safety protocol refused (a window open, a nested window, a wait that would deadlock)."
);
pyo3::create_exception!(kvoffload, ShutDownError, ProtocolError, "The offloader is shut down (or shutting down).");
pyo3::create_exception!(kvoffload, DriverError, KvoffloadError, "A CUDA driver call failed; `code` is the CUresult.");
pyo3::create_exception!(
    kvoffload,
    ManagerError,
    KvoffloadError,
    "The block manager refused (a key not stored, no slot free)."
);
pyo3::create_exception!(kvoffload, TransferError, KvoffloadError, "The transfer engine refused a job.");
pyo3::create_exception!(kvoffload, AgreementError, KvoffloadError, "The ranks did not agree on the pin state (P7).");
pyo3::create_exception!(
    kvoffload,
    PoolError,
    KvoffloadError,
    "The node pool refused: its file, the engine table (full, not joined, a timeout), its words."
);
pyo3::create_exception!(
    kvoffload,
    PoolStateError,
    PoolError,
    "A pool slot is not in the state the call needs (not held, not written by this engine, its epoch moved), \
     or a pool word is corrupt."
);

/// `kvoffload.PoolMismatchError`: a subclass of both `PoolError` and
/// `ValueError` (the pool holds KV of another meaning than the engine's
/// config: a bad value), made once with Python's `type` as
/// [`options_error_type`].
fn pool_mismatch_type(py: Python<'_>) -> PyResult<Bound<'_, PyType>> {
    static TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let ty = TYPE.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        let bases = PyTuple::new(py, [py.get_type::<PoolError>(), py.get_type::<PyValueError>()])?;
        let ns = PyDict::new(py);
        ns.set_item("__module__", "kvoffload")?;
        ns.set_item(
            "__doc__",
            "The pool holds KV of another meaning than this engine's (a fingerprint field differs: `field`, \
             `pool_value`, `engine_value`).",
        )?;
        let made = py.get_type::<PyType>().call1(("PoolMismatchError", bases, ns))?;
        Ok(made.cast_into::<PyType>()?.unbind())
    })?;
    Ok(ty.bind(py).clone())
}

/// `kvoffload.OptionsError`: a subclass of both `KvoffloadError` and
/// `ValueError` (a bad argument is a bad value, as Python code expects),
/// made once with Python's `type`, since PyO3's exceptions take one base.
/// Made at import ([`register`]); a later call finds it made.
fn options_error_type(py: Python<'_>) -> PyResult<Bound<'_, PyType>> {
    static TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let ty = TYPE.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        let bases = PyTuple::new(py, [py.get_type::<KvoffloadError>(), py.get_type::<PyValueError>()])?;
        let ns = PyDict::new(py);
        ns.set_item("__module__", "kvoffload")?;
        ns.set_item("__doc__", "Bad arguments: options, the KV description, GPU block ids, the layout.")?;
        let made = py.get_type::<PyType>().call1(("OptionsError", bases, ns))?;
        Ok(made.cast_into::<PyType>()?.unbind())
    })?;
    Ok(ty.bind(py).clone())
}

/// `CamelCase` -> `camel_case`; a name already in upper case (a driver
/// code's, `CUDA_ERROR_OUT_OF_MEMORY`) is only lowered
/// (`cuda_error_out_of_memory`). An underscore is put before an upper-case
/// letter that follows a lower-case letter or a digit, or that begins a
/// new word after an upper-case run (`HTTPServer` -> `http_server`), never
/// next to an underscore.
pub fn snake(name: &str) -> String {
    let chars: Vec<char> = name.chars().collect();
    let mut out = String::with_capacity(name.len() + 4);
    for (i, &c) in chars.iter().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            let prev = chars[i - 1];
            let next_lower = chars.get(i + 1).is_some_and(|n| n.is_ascii_lowercase());
            let boundary =
                prev.is_ascii_lowercase() || prev.is_ascii_digit() || (prev.is_ascii_uppercase() && next_lower);
            if boundary && !out.ends_with('_') {
                out.push('_');
            }
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// The variant name at the start of a `Debug` rendering, in snake case.
pub fn variant(debug: &str) -> String {
    let end = debug.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(debug.len());
    snake(&debug[..end])
}

/// The inner error's variant: `Outer(Inner { .. })` -> `inner`.
fn inner_variant(debug: &str) -> Option<String> {
    let open = debug.find('(')?;
    let v = variant(debug[open + 1..].trim_start());
    (!v.is_empty()).then_some(v)
}

/// An exception of class `T` with `message` and the typed attributes.
fn make<T: PyTypeInfo>(
    py: Python<'_>,
    message: String,
    kind: &str,
    reason: Option<String>,
    driver: Option<(&str, Option<u32>, Option<&str>)>,
) -> PyErr {
    make_of(py, T::type_object(py), message, kind, reason, driver)
}

/// An `OptionsError` with `message` and the typed attributes.
fn make_options(py: Python<'_>, message: String, kind: &str, reason: Option<String>) -> PyErr {
    match options_error_type(py) {
        Ok(ty) => make_of(py, ty, message, kind, reason, None),
        // Only where the class could not be made at import (out of
        // memory), which then failed the import itself.
        Err(e) => e,
    }
}

/// A `ShutDownError`: kind `"shut_down"` whichever call met the shutdown
/// (the Rust error's outer variant differs by call: `Protocol`,
/// `Transfer`, `Shutdown`, `ShutDown`), reason `"shut_down"` or
/// `"already_shut_down"`.
fn make_shut_down(py: Python<'_>, message: String, again: bool) -> PyErr {
    let reason = if again { "already_shut_down" } else { "shut_down" };
    make::<ShutDownError>(py, message, "shut_down", Some(reason.into()), None)
}

/// An exception of class `ty` with `message` and the typed attributes.
fn make_of(
    py: Python<'_>,
    ty: Bound<'_, PyType>,
    message: String,
    kind: &str,
    reason: Option<String>,
    driver: Option<(&str, Option<u32>, Option<&str>)>,
) -> PyErr {
    let err = PyErr::from_type(ty, message);
    let v = err.value(py);
    let _ = v.setattr("kind", kind);
    let _ = v.setattr("reason", reason);
    if let Some((call, code, name)) = driver {
        let _ = v.setattr("call", call);
        let _ = v.setattr("code", code);
        let _ = v.setattr("code_name", name);
    }
    err
}

fn driver_err(py: Python<'_>, message: String, kind: &str, e: &RustDriverError) -> PyErr {
    make::<DriverError>(
        py,
        message,
        kind,
        Some(snake(e.code.name())),
        Some((e.call, Some(e.code.0), Some(e.code.name()))),
    )
}

/// An offloader error as its Python exception.
pub fn offloader(py: Python<'_>, e: OffloaderError) -> PyErr {
    let msg = e.to_string();
    let dbg = format!("{e:?}");
    let kind = variant(&dbg);
    let reason = inner_variant(&dbg);
    match &e {
        OffloaderError::Region(RustRegionError::Interrupted { .. })
        | OffloaderError::Pin(PinError::Region(RustRegionError::Interrupted { .. })) => {
            PyKeyboardInterrupt::new_err(msg)
        }
        OffloaderError::Options(_)
        | OffloaderError::Layout(_)
        | OffloaderError::GpuBlockCount { .. }
        | OffloaderError::SlotJobShape { .. }
        | OffloaderError::KeyedCore { .. } => make_options(py, msg, &kind, reason),
        // The engine named a slot of a job not yet reported: its own
        // bookkeeping is wrong, the job refused.
        OffloaderError::SlotBusy { .. } => make::<TransferError>(py, msg, &kind, None, None),
        OffloaderError::Pin(PinError::Region(_)) | OffloaderError::Region(_) => {
            make::<RegionError>(py, msg, &kind, reason, None)
        }
        // The runtime handle guarded by another coordinator: a protocol
        // refusal wherever it comes from.
        OffloaderError::Pin(PinError::Protocol(p)) => protocol(py, msg, &kind, p),
        OffloaderError::Pin(_) => make_options(py, msg, &kind, reason),
        OffloaderError::Protocol(p) => protocol(py, msg, &kind, p),
        OffloaderError::Shutdown(ShutdownError::Refused(p)) => protocol(py, msg, &kind, p),
        OffloaderError::Shutdown(ShutdownError::Unregister(d)) | OffloaderError::Driver { error: d, .. } => {
            driver_err(py, msg, &kind, d)
        }
        OffloaderError::Transfer(t) => match t {
            RustTransferError::Driver(d) => driver_err(py, msg, &kind, d),
            // A job that failed on the GPU: the transfer engine's error (as
            // `kvoffload._slotworker` raises it), with the driver's call and
            // code as attributes.
            RustTransferError::JobFailed { error: d, .. } => {
                make::<TransferError>(py, msg, &kind, reason, Some((d.call, Some(d.code.0), Some(d.code.name()))))
            }
            RustTransferError::Protocol(p) => protocol(py, msg, &kind, p),
            RustTransferError::ShutDown { .. } => make_shut_down(py, msg, false),
            RustTransferError::Layout(_)
            | RustTransferError::GroupCount { .. }
            | RustTransferError::GpuBlockOutOfRange { .. }
            | RustTransferError::HostBlockOutOfRange { .. }
            | RustTransferError::RepeatedGpuBlock { .. }
            | RustTransferError::RepeatedHostBlock { .. }
            | RustTransferError::BlockCountMismatch { .. }
            | RustTransferError::FirstSubTooLarge { .. }
            | RustTransferError::HostCountMismatch { .. }
            | RustTransferError::EmptyJob { .. } => make_options(py, msg, &kind, reason),
            // JobIdReused, ComputeCapturing, CaptureWindowOpen, UnknownJob:
            // the engine refused the job as given at this moment.
            _ => make::<TransferError>(py, msg, &kind, reason, None),
        },
        OffloaderError::UnknownJob { .. } => make::<TransferError>(py, msg, &kind, None, None),
        OffloaderError::HookNotOpen { .. } => make::<ProtocolError>(py, msg, &kind, None, None),
        OffloaderError::Manager(_) | OffloaderError::NotStored { .. } => {
            make::<ManagerError>(py, msg, &kind, reason, None)
        }
        OffloaderError::ShutDown => make_shut_down(py, msg, false),
        _ => make::<KvoffloadError>(py, msg, &kind, reason, None),
    }
}

/// One sample of every error variant an offloader call raises (every
/// `OffloaderError` variant, with every variant of the inner errors whose
/// variant picks the Python class), each with its Rust path: the test that
/// each maps to one Python class, with `kind` the outer variant in snake
/// case and `reason` the inner one (`kvoffload._testing.error_table`,
/// python/tests/test_api.py).
pub fn samples() -> Vec<(String, OffloaderError)> {
    use kvoffload::{BlockKey, Code, Direction, JobId, LayoutError, ManagerError};
    let d = || RustDriverError::new("cuMemcpyAsync", Code::INVALID_VALUE);
    let id = JobId(7);
    let transfer = [
        RustTransferError::Layout(LayoutError::NoGroups),
        RustTransferError::GroupCount { given: 2, expected: 1 },
        RustTransferError::GpuBlockOutOfRange { group: 0, block: 9, num_blocks: 8 },
        RustTransferError::HostBlockOutOfRange { group: 0, block: 9, num_blocks: 8 },
        RustTransferError::RepeatedGpuBlock { group: 0, block: 1 },
        RustTransferError::RepeatedHostBlock { group: 0, block: 1 },
        RustTransferError::BlockCountMismatch { group: 0, gpu: 3, host: 1, factor: 2, min: 1, max: 2 },
        RustTransferError::FirstSubTooLarge { group: 0, first_sub: 2, factor: 2 },
        RustTransferError::HostCountMismatch { group: 0, gpu: 3, host: 1, first_sub: 0, factor: 2, need: 2 },
        RustTransferError::EmptyJob { id },
        RustTransferError::JobIdReused { id },
        RustTransferError::ShutDown { id },
        RustTransferError::ComputeCapturing { id },
        RustTransferError::CaptureWindowOpen { id },
        RustTransferError::NoExpeditedLane { id },
        RustTransferError::UnknownJob { id },
        RustTransferError::JobFailed { id, error: d() },
        RustTransferError::Protocol(RustProtocolError::NestedWindow),
        RustTransferError::Protocol(RustProtocolError::ShutDown),
        RustTransferError::Driver(d()),
    ];
    let mut out: Vec<OffloaderError> = vec![
        OffloaderError::Options("x".into()),
        OffloaderError::Layout(LayoutError::NoGroups),
        OffloaderError::Region(RustRegionError::ZeroSize { what: "x" }),
        OffloaderError::Pin(PinError::ZeroSize { what: "threads" }),
        OffloaderError::Pin(PinError::TooLarge { what: "threads", value: 2, limit: 1 }),
        OffloaderError::Pin(PinError::OutOfRange { what: "prefault_nice", value: 20, min: 0, max: 19 }),
        OffloaderError::Pin(PinError::Region(RustRegionError::ZeroSize { what: "x" })),
        OffloaderError::Pin(PinError::Protocol(RustProtocolError::NestedWindow)),
        OffloaderError::Protocol(RustProtocolError::NestedWindow),
        OffloaderError::Protocol(RustProtocolError::ShutDown),
        OffloaderError::Protocol(RustProtocolError::AlreadyShutDown),
        OffloaderError::Driver { what: "x", error: d() },
        OffloaderError::Manager(ManagerError::ZeroCapacity),
        OffloaderError::GpuBlockCount { keys: 1, factor: 1, need: 1, got: 2 },
        OffloaderError::SlotJobShape { what: "x", given: 1, expected: 2 },
        OffloaderError::SlotBusy { group: 0, slot: 1, job: id, direction: Direction::DeviceToHost },
        OffloaderError::KeyedCore { call: "submit" },
        OffloaderError::NotStored { key: BlockKey::new(1, 0) },
        OffloaderError::UnknownJob { id },
        OffloaderError::HookNotOpen { call: "capture_end" },
        OffloaderError::ShutDown,
        OffloaderError::Shutdown(ShutdownError::Refused(RustProtocolError::NestedWindow)),
        OffloaderError::Shutdown(ShutdownError::Unregister(d())),
        OffloaderError::PinnerPanicked,
    ];
    out.extend(transfer.into_iter().map(OffloaderError::Transfer));
    out.into_iter()
        .map(|e| {
            // Without a wildcard: a new variant fails to compile here until
            // it has a sample above and a row in the Python test.
            let outer = match &e {
                OffloaderError::Options(_) => "Options",
                OffloaderError::Layout(_) => "Layout",
                OffloaderError::Region(_) => "Region",
                OffloaderError::Pin(_) => "Pin",
                OffloaderError::Protocol(_) => "Protocol",
                OffloaderError::Driver { .. } => "Driver",
                OffloaderError::Transfer(_) => "Transfer",
                OffloaderError::Manager(_) => "Manager",
                OffloaderError::GpuBlockCount { .. } => "GpuBlockCount",
                OffloaderError::SlotJobShape { .. } => "SlotJobShape",
                OffloaderError::SlotBusy { .. } => "SlotBusy",
                OffloaderError::KeyedCore { .. } => "KeyedCore",
                OffloaderError::NotStored { .. } => "NotStored",
                OffloaderError::UnknownJob { .. } => "UnknownJob",
                OffloaderError::HookNotOpen { .. } => "HookNotOpen",
                OffloaderError::ShutDown => "ShutDown",
                OffloaderError::Shutdown(_) => "Shutdown",
                OffloaderError::PinnerPanicked => "PinnerPanicked",
            };
            let dbg = format!("{e:?}");
            // The inner error's variant, for a tuple variant holding one.
            let inner = dbg[outer.len()..].strip_prefix('(').map(|rest| {
                rest[..rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len())].to_string()
            });
            let path = match inner {
                Some(v) if !v.is_empty() => format!("OffloaderError::{outer}({v})"),
                _ => format!("OffloaderError::{outer}"),
            };
            (path, e)
        })
        .collect()
}

fn protocol(py: Python<'_>, msg: String, kind: &str, p: &RustProtocolError) -> PyErr {
    let reason = Some(variant(&format!("{p:?}")));
    match p {
        RustProtocolError::Interrupted { .. } => PyKeyboardInterrupt::new_err(msg),
        RustProtocolError::ShutDown => make_shut_down(py, msg, false),
        RustProtocolError::AlreadyShutDown => make_shut_down(py, msg, true),
        _ => make::<ProtocolError>(py, msg, kind, reason, None),
    }
}

/// Opening the CUDA runtime failed.
pub fn open(py: Python<'_>, e: OpenError) -> PyErr {
    let msg = e.to_string();
    match &e {
        OpenError::NoDriver => {
            make::<DriverError>(py, msg, "no_driver", None, Some(("dlopen(libcuda.so.1)", None, None)))
        }
        OpenError::Device { source, .. } => driver_err(py, msg, "device", source),
    }
}

/// A bare driver error (test helpers).
pub fn driver(py: Python<'_>, what: &str, e: RustDriverError) -> PyErr {
    driver_err(py, format!("{what}: {e}"), "driver", &e)
}

/// A Rust panic caught at an entry point (`offloader::guarded`): a
/// `KvoffloadError` of kind `"panic"`, never a `PanicException`.
pub fn panicked(py: Python<'_>, what: &str) -> PyErr {
    make::<KvoffloadError>(py, format!("internal error (a Rust panic, caught): {what}"), "panic", None, None)
}

/// A bad argument found on the Python side.
pub fn options(py: Python<'_>, message: impl Into<String>) -> PyErr {
    make_options(py, message.into(), "options", None)
}

/// A `PoolError` of kind `kind` (no inner reason).
pub fn pool_other(py: Python<'_>, message: String, kind: &str) -> PyErr {
    make::<PoolError>(py, message, kind, None, None)
}

/// A slot transition refused or a corrupt word: `PoolStateError`, kind the
/// `SlotError` variant (`"not_held"`, `"epoch_moved"`, ...).
pub fn pool_slot(py: Python<'_>, message: String, e: &kvoffload::internal::pool::slot::SlotError) -> PyErr {
    make::<PoolStateError>(py, message, &variant(&format!("{e:?}")), None, None)
}

/// Joining or leaving the engine table failed.
pub fn pool_join(py: Python<'_>, pool: &str, e: kvoffload::internal::pool::sweep::JoinError) -> PyErr {
    use kvoffload::internal::pool::sweep::JoinError;
    let msg = format!("pool {pool:?}: {e}");
    match &e {
        JoinError::Slot(s) => pool_slot(py, msg, s),
        JoinError::MemberOutOfRange { .. } => make_options(py, msg, "member_out_of_range", None),
        _ => make::<PoolError>(py, msg, &variant(&format!("{e:?}")), None, None),
    }
}

/// A `PoolMismatchError` with the differing field and both values as
/// attributes.
pub fn pool_mismatch(py: Python<'_>, message: String, field: &str, pool_value: &str, engine_value: &str) -> PyErr {
    let err = match pool_mismatch_type(py) {
        Ok(ty) => make_of(py, ty, message, "mismatch", None, None),
        Err(e) => return e,
    };
    let v = err.value(py);
    let _ = v.setattr("field", field);
    let _ = v.setattr("pool_value", pool_value);
    let _ = v.setattr("engine_value", engine_value);
    err
}

/// A pool file's error: `PoolMismatchError` for a fingerprint field that
/// differs, `PoolStateError` for a slot word, `OptionsError` for a name or
/// record the file cannot carry, `PoolError` otherwise (kind: the variant).
/// An interruption is `KeyboardInterrupt` (the caller raises the signal
/// handler's exception first, when one was kept).
pub fn pool_file(py: Python<'_>, e: kvoffload::internal::pool::error::PoolError) -> PyErr {
    use kvoffload::internal::pool::error::PoolError as E;
    let msg = e.to_string();
    let kind = variant(&format!("{e:?}"));
    match &e {
        E::Mismatch { field, pool_value, engine_value, .. } => pool_mismatch(py, msg, field, pool_value, engine_value),
        E::Slot(s) => pool_slot(py, msg, s),
        E::Interrupted { .. } => PyKeyboardInterrupt::new_err(msg),
        E::BadName { .. } | E::TooLong { .. } | E::TooMany { .. } | E::BadGeometry { .. } => {
            make_options(py, msg, &kind, None)
        }
        _ => make::<PoolError>(py, msg, &kind, inner_variant(&format!("{e:?}")), None),
    }
}

/// An agreement error as an (unraised) exception instance.
pub fn agreement(py: Python<'_>, e: &RustAgreementError) -> PyErr {
    make::<AgreementError>(py, e.to_string(), &variant(&format!("{e:?}")), None, None)
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvoffloadError", py.get_type::<KvoffloadError>())?;
    m.add("OptionsError", options_error_type(py)?)?;
    m.add("RegionError", py.get_type::<RegionError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("ShutDownError", py.get_type::<ShutDownError>())?;
    m.add("DriverError", py.get_type::<DriverError>())?;
    m.add("ManagerError", py.get_type::<ManagerError>())?;
    m.add("TransferError", py.get_type::<TransferError>())?;
    m.add("AgreementError", py.get_type::<AgreementError>())?;
    m.add("PoolError", py.get_type::<PoolError>())?;
    m.add("PoolStateError", py.get_type::<PoolStateError>())?;
    m.add("PoolMismatchError", pool_mismatch_type(py)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::snake;

    #[test]
    fn snake_case_of_camel_case_and_of_upper_case_names() {
        assert_eq!(snake("GpuBlockCount"), "gpu_block_count");
        assert_eq!(snake("AlreadyExists"), "already_exists");
        assert_eq!(snake("JobFailed"), "job_failed");
        assert_eq!(snake("P7Agreement"), "p7_agreement");
        // Issue 28 item 7: a driver code's name is already upper case.
        assert_eq!(snake("CUDA_ERROR_OUT_OF_MEMORY"), "cuda_error_out_of_memory");
        assert_eq!(snake("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"), "cuda_error_stream_capture_unsupported");
        assert_eq!(snake("HTTPServer"), "http_server");
        assert_eq!(snake(""), "");
    }
}
