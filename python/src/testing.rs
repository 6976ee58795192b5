//! `kvoffload._native._testing`: the test hooks, for tests only and not
//! part of the API (`kvoffload/_testing.py` wraps them and says so).
//!
//! Functions that take the object they look into: a `Runtime` on the
//! simulated GPU (its counters, an injected registration failure, a hold
//! point), or an `Offloader` (the coordinator's counts, a GPU block written
//! or read with a synchronous copy). The names follow the library's: the
//! `sim_` prefix stands for `kvoffload::runtime::sim` (`sim_hold` is
//! `SimRuntime::hold`, `SimHold` is `sim::Hold`), `activity` is
//! `Offloader::activity`.

use std::collections::HashMap;
use std::sync::Mutex;

use kvoffload::runtime::sim::{Hold, HoldPoint, SimFault, SimRuntime};
use kvoffload::runtime::{Code, DevicePtr};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::{choice, errors, PyOffloader, PyRuntime};

fn sim<'a>(py: Python<'_>, runtime: &'a PyRuntime) -> PyResult<&'a SimRuntime> {
    runtime.rt.as_sim().ok_or_else(|| errors::options(py, "this test hook needs the simulated GPU (backend='sim')"))
}

/// Device bytes allocated and not freed (simulated GPU only).
#[pyfunction]
fn sim_device_bytes_in_use(py: Python<'_>, runtime: &Bound<'_, PyRuntime>) -> PyResult<usize> {
    Ok(sim(py, runtime.get())?.device_bytes_in_use())
}

/// Host ranges registered now (simulated GPU only).
#[pyfunction]
fn sim_registered_ranges(py: Python<'_>, runtime: &Bound<'_, PyRuntime>) -> PyResult<usize> {
    Ok(sim(py, runtime.get())?.registered_ranges())
}

/// The `nth` host registration from now (1 = the next) fails with CUresult
/// `code` (801: not supported) (simulated GPU only).
#[pyfunction]
#[pyo3(signature = (runtime, nth = 1, code = 801))]
fn sim_fail_registration(py: Python<'_>, runtime: &Bound<'_, PyRuntime>, nth: u64, code: u32) -> PyResult<()> {
    sim(py, runtime.get())?.inject(SimFault::Register { nth, code: Code(code) });
    Ok(())
}

/// Arms a hold point (simulated GPU only): the next call that reaches it
/// (`"register"`: inside a host registration; `"device_op"`: an operation
/// executing on the device) stops there until the returned hold is
/// released (or dropped).
#[pyfunction]
#[pyo3(signature = (runtime, point = "device_op"))]
fn sim_hold(py: Python<'_>, runtime: &Bound<'_, PyRuntime>, point: &str) -> PyResult<PySimHold> {
    let point = choice(py, "point", point, &[("register", HoldPoint::Register), ("device_op", HoldPoint::DeviceOp)])?;
    Ok(PySimHold { hold: Mutex::new(Some(sim(py, runtime.get())?.hold(point))) })
}

/// A hold point of the simulated GPU (`sim_hold`): also a context manager
/// that releases it on exit.
#[pyclass(name = "SimHold", module = "kvoffload._testing", frozen)]
pub(crate) struct PySimHold {
    hold: Mutex<Option<Hold>>,
}

#[pymethods]
impl PySimHold {
    /// Blocks (GIL released) until a call has reached the hold point.
    fn wait_entered(&self, py: Python<'_>) {
        let g = self.hold.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = g.as_ref() {
            py.detach(|| h.wait_entered());
        }
    }

    /// Lets the held call continue (or disarms the hold if none arrived).
    fn release(&self) {
        let h = self.hold.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(h);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (_exc_type = None, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.release();
        false
    }
}

/// What the offloader's coordinator has open, in flight or waiting now, as
/// a dict of counts (the fields of the library's `Activity`).
#[pyfunction]
fn activity(off: &Bound<'_, PyOffloader>) -> HashMap<&'static str, usize> {
    let a = off.get().off.activity();
    [
        ("windows_open", a.windows_open),
        ("windows_waiting", a.windows_waiting),
        ("calls_in_flight", a.calls_in_flight),
        ("calls_waiting", a.calls_waiting),
        ("pin_waiters", a.pin_waiters),
        ("jobs_in_flight", a.jobs_in_flight),
        ("graphs_live", a.graphs_live),
        ("alias_users", a.alias_users),
        ("unregisters_waiting", a.unregisters_waiting),
    ]
    .into_iter()
    .collect()
}

/// GPU block `gpu_block` of tensor `tensor`: its address and length.
fn block(py: Python<'_>, off: &PyOffloader, tensor: usize, gpu_block: usize) -> PyResult<(DevicePtr, usize)> {
    let kv = off.off.kv();
    let t = kv
        .tensors
        .get(tensor)
        .ok_or_else(|| errors::options(py, format!("tensor {tensor} out of range ({} tensors)", kv.tensors.len())))?;
    if gpu_block >= kv.gpu_blocks {
        return Err(errors::options(py, format!("GPU block {gpu_block} out of range ({} blocks)", kv.gpu_blocks)));
    }
    Ok((DevicePtr(t.device_base.raw() + (gpu_block * t.page_bytes) as u64), t.page_bytes))
}

/// Writes `data` (exactly one page of tensor `tensor`) into GPU block
/// `gpu_block` with a synchronous copy.
#[pyfunction]
fn write_block(
    py: Python<'_>,
    off: &Bound<'_, PyOffloader>,
    tensor: usize,
    gpu_block: usize,
    data: &[u8],
) -> PyResult<()> {
    let off = off.get();
    let (dst, page) = block(py, off, tensor, gpu_block)?;
    if data.len() != page {
        return Err(errors::options(py, format!("a page of tensor {tensor} is {page} bytes, not {}", data.len())));
    }
    let rt = off.off.runtime();
    // SAFETY: `data` is a readable buffer of `page` bytes for the call;
    // `dst` is a block of a live tensor of this offloader.
    unsafe { rt.copy_htod(dst, data.as_ptr() as usize, page) }.map_err(|e| errors::driver(py, "writing a block", e))
}

/// The bytes of GPU block `gpu_block` of tensor `tensor` (a synchronous
/// copy).
#[pyfunction]
fn read_block<'py>(
    py: Python<'py>,
    off: &Bound<'_, PyOffloader>,
    tensor: usize,
    gpu_block: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let off = off.get();
    let (src, page) = block(py, off, tensor, gpu_block)?;
    let mut buf = vec![0u8; page];
    let rt = off.off.runtime();
    // SAFETY: `buf` is writable for `page` bytes; `src` is a block of a live
    // tensor of this offloader.
    unsafe { rt.copy_dtoh(buf.as_mut_ptr() as usize, src, page) }
        .map_err(|e| errors::driver(py, "reading a block", e))?;
    Ok(PyBytes::new(py, &buf))
}

/// Adds the submodule `_testing` to `m` (`kvoffload._native`).
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let t = PyModule::new(m.py(), "_testing")?;
    t.add_class::<PySimHold>()?;
    t.add_function(wrap_pyfunction!(sim_device_bytes_in_use, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_registered_ranges, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_fail_registration, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_hold, &t)?)?;
    t.add_function(wrap_pyfunction!(activity, &t)?)?;
    t.add_function(wrap_pyfunction!(write_block, &t)?)?;
    t.add_function(wrap_pyfunction!(read_block, &t)?)?;
    m.add_submodule(&t)
}
