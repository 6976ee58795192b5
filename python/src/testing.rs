//! `kvoffload._native._testing`: the test hooks, for tests only and not
//! part of the API (`kvoffload/_testing.py` wraps them and says so).
//!
//! Functions that take the object they look into: a `Runtime` on the
//! simulated GPU (its counters, an injected registration failure, a hold
//! point), or an `Offloader` (the coordinator's counts, a GPU block written
//! or read with a synchronous copy). The names follow the library's: the
//! `sim_` prefix stands for `kvoffload::internal::runtime::sim` (`sim_hold` is
//! `SimRuntime::hold`, `SimHold` is `sim::Hold`), `activity` is
//! `kvoffload::internal::offloader::activity`.

use std::collections::HashMap;
use std::sync::Mutex;

use kvoffload::internal::runtime::sim::{Hold, HoldPoint};
use kvoffload::{CaptureMode, Code, DevicePtr, GpuRuntime, Graph, Kernel, SimFault, SimRuntime, Stream};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use std::sync::Arc;

use crate::{choice, errors, named, pool, PyOffloaderBase, PyRuntime};

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
    let point = named::<HoldPoint>(py, "point", point)?;
    Ok(PySimHold { hold: Mutex::new(Some(sim(py, runtime.get())?.hold(point))) })
}

/// Adopts `nbytes` of host memory at `addr` as simulated device memory in
/// place (`SimRuntime::adopt_host_memory`); returns its device address.
/// The Python wrapper keeps the object owning the memory alive until
/// `sim_release_adopted`.
#[pyfunction]
fn sim_adopt(py: Python<'_>, runtime: &Bound<'_, PyRuntime>, addr: usize, nbytes: usize) -> PyResult<u64> {
    let sim = sim(py, runtime.get())?;
    // SAFETY: test hook (`kvoffload._testing`, not part of the API): the
    // caller promises, as `sim_adopt`'s documentation says, that the memory
    // is its own, writable, valid until `sim_release_adopted` returned, and
    // untouched while device work on it is queued; the wrapper keeps its
    // owner alive until then.
    let p =
        unsafe { sim.adopt_host_memory(addr, nbytes) }.map_err(|e| errors::driver(py, "adopting host memory", e))?;
    Ok(p.raw())
}

/// Ends an adoption (`SimRuntime::release_adopted`): waits, GIL released,
/// until the device is idle.
#[pyfunction]
fn sim_release_adopted(py: Python<'_>, runtime: &Bound<'_, PyRuntime>, ptr: u64) -> PyResult<()> {
    let sim = sim(py, runtime.get())?;
    py.detach(|| sim.release_adopted(DevicePtr(ptr))).map_err(|e| errors::driver(py, "releasing adopted memory", e))
}

/// Host ranges adopted and not released (simulated GPU only).
#[pyfunction]
fn sim_adopted_ranges(py: Python<'_>, runtime: &Bound<'_, PyRuntime>) -> PyResult<usize> {
    Ok(sim(py, runtime.get())?.adopted_ranges())
}

fn stream_of(py: Python<'_>, sim: &SimRuntime, raw: u64) -> PyResult<Stream> {
    sim.stream_by_raw(raw).ok_or_else(|| errors::options(py, format!("no stream {raw} on this simulated GPU")))
}

fn graph_of(py: Python<'_>, sim: &SimRuntime, raw: u64) -> PyResult<Graph> {
    sim.graph_by_raw(raw).ok_or_else(|| errors::options(py, format!("no graph {raw} on this simulated GPU")))
}

/// A new stream of the simulated GPU (`stream_create`), as its number.
#[pyfunction]
fn sim_stream(py: Python<'_>, runtime: &Bound<'_, PyRuntime>) -> PyResult<u64> {
    let s = sim(py, runtime.get())?.stream_create().map_err(|e| errors::driver(py, "creating a stream", e))?;
    Ok(s.raw())
}

/// Destroys a stream of the simulated GPU (its queued work still runs).
#[pyfunction]
fn sim_stream_destroy(py: Python<'_>, runtime: &Bound<'_, PyRuntime>, stream: u64) -> PyResult<()> {
    let sim = sim(py, runtime.get())?;
    sim.stream_destroy(stream_of(py, sim, stream)?).map_err(|e| errors::driver(py, "destroying a stream", e))
}

/// Begins a capture on `stream` (`"global"`, `"thread_local"` or
/// `"relaxed"`); blocks, GIL released, while a registration runs.
#[pyfunction]
#[pyo3(signature = (runtime, stream, mode = "global"))]
fn sim_begin_capture(py: Python<'_>, runtime: &Bound<'_, PyRuntime>, stream: u64, mode: &str) -> PyResult<()> {
    let mode = choice(
        py,
        "mode",
        mode,
        &[
            ("global", CaptureMode::Global),
            ("thread_local", CaptureMode::ThreadLocal),
            ("relaxed", CaptureMode::Relaxed),
        ],
    )?;
    let sim = sim(py, runtime.get())?;
    let s = stream_of(py, sim, stream)?;
    py.detach(|| sim.begin_capture(s, mode)).map_err(|e| errors::driver(py, "beginning a capture", e))
}

/// Ends the capture on `stream`; the graph's number (`DriverError` with
/// the driver's code when the capture was invalidated, 901, or failed).
#[pyfunction]
fn sim_end_capture(py: Python<'_>, runtime: &Bound<'_, PyRuntime>, stream: u64) -> PyResult<u64> {
    let sim = sim(py, runtime.get())?;
    let g = sim.end_capture(stream_of(py, sim, stream)?).map_err(|e| errors::driver(py, "ending a capture", e))?;
    Ok(g.raw())
}

/// Launches (replays) graph `graph` on `stream`.
#[pyfunction]
fn sim_graph_launch(py: Python<'_>, runtime: &Bound<'_, PyRuntime>, graph: u64, stream: u64) -> PyResult<()> {
    let sim = sim(py, runtime.get())?;
    let (g, s) = (graph_of(py, sim, graph)?, stream_of(py, sim, stream)?);
    sim.graph_launch(g, s).map_err(|e| errors::driver(py, "launching a graph", e))
}

/// Destroys graph `graph`.
#[pyfunction]
fn sim_graph_destroy(py: Python<'_>, runtime: &Bound<'_, PyRuntime>, graph: u64) -> PyResult<()> {
    let sim = sim(py, runtime.get())?;
    sim.graph_destroy(graph_of(py, sim, graph)?).map_err(|e| errors::driver(py, "destroying a graph", e))
}

/// Enqueues (or, in a capture, records) a memset of `nbytes` bytes of
/// `value` at device address `ptr` on `stream`.
#[pyfunction]
fn sim_memset(
    py: Python<'_>,
    runtime: &Bound<'_, PyRuntime>,
    ptr: u64,
    value: u8,
    nbytes: usize,
    stream: u64,
) -> PyResult<()> {
    let sim = sim(py, runtime.get())?;
    let s = stream_of(py, sim, stream)?;
    // SAFETY: the sim bounds-checks `ptr..ptr+nbytes` against its device
    // memory (its own allocations, adopted memory the caller keeps valid by
    // `sim_adopt`'s contract, or registered host memory through its alias)
    // and refuses anything else.
    unsafe { sim.memset_d8_async(DevicePtr(ptr), value, nbytes, s) }.map_err(|e| errors::driver(py, "memset", e))
}

/// Enqueues (or records) the spin kernel, which touches no memory.
#[pyfunction]
fn sim_launch_spin(py: Python<'_>, runtime: &Bound<'_, PyRuntime>, stream: u64) -> PyResult<()> {
    let sim = sim(py, runtime.get())?;
    let s = stream_of(py, sim, stream)?;
    // SAFETY: the spin kernel reads and writes no memory.
    unsafe { sim.launch(Kernel::Spin { nanos: 1 }, s) }.map_err(|e| errors::driver(py, "launching a kernel", e))
}

/// Blocks, GIL released, until every stream's work has run.
#[pyfunction]
fn sim_wait_idle(py: Python<'_>, runtime: &Bound<'_, PyRuntime>) -> PyResult<()> {
    let sim = sim(py, runtime.get())?;
    py.detach(|| sim.wait_device_idle());
    Ok(())
}

/// Every call the capture rules refused so far, oldest first: dicts of
/// `call` (the driver entry point) and `reason` (the rule).
#[pyfunction]
fn sim_refusals<'py>(py: Python<'py>, runtime: &Bound<'_, PyRuntime>) -> PyResult<Vec<Bound<'py, PyDict>>> {
    sim(py, runtime.get())?
        .refusals()
        .into_iter()
        .map(|r| {
            let d = PyDict::new(py);
            d.set_item("call", r.call)?;
            d.set_item("reason", r.reason)?;
            Ok(d)
        })
        .collect()
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
fn activity(off: &Bound<'_, PyOffloaderBase>) -> HashMap<&'static str, usize> {
    let a = kvoffload::internal::offloader::activity(&off.get().off);
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
        ("pin_holds", a.pin_holds),
        ("registrations_held", a.registrations_held),
    ]
    .into_iter()
    .collect()
}

/// GPU block `gpu_block` of tensor `tensor`: its address and length.
fn block(py: Python<'_>, off: &PyOffloaderBase, tensor: usize, gpu_block: usize) -> PyResult<(DevicePtr, usize)> {
    let kv = &off.off.geometry().kv;
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
    off: &Bound<'_, PyOffloaderBase>,
    tensor: usize,
    gpu_block: usize,
    data: &[u8],
) -> PyResult<()> {
    let off = off.get();
    let (dst, page) = block(py, off, tensor, gpu_block)?;
    if data.len() != page {
        return Err(errors::options(py, format!("a page of tensor {tensor} is {page} bytes, not {}", data.len())));
    }
    let rt = &off.off.geometry().runtime;
    // SAFETY: `data` is a readable buffer of `page` bytes for the call;
    // `dst` is a block of a live tensor of this offloader.
    unsafe { rt.copy_htod(dst, data.as_ptr() as usize, page) }.map_err(|e| errors::driver(py, "writing a block", e))
}

/// The bytes of GPU block `gpu_block` of tensor `tensor` (a synchronous
/// copy).
#[pyfunction]
fn read_block<'py>(
    py: Python<'py>,
    off: &Bound<'_, PyOffloaderBase>,
    tensor: usize,
    gpu_block: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let off = off.get();
    let (src, page) = block(py, off, tensor, gpu_block)?;
    let mut buf = vec![0u8; page];
    let rt = &off.off.geometry().runtime;
    // SAFETY: `buf` is writable for `page` bytes; `src` is a block of a live
    // tensor of this offloader.
    unsafe { rt.copy_dtoh(buf.as_mut_ptr() as usize, src, page) }
        .map_err(|e| errors::driver(py, "reading a block", e))?;
    Ok(PyBytes::new(py, &buf))
}

/// Adds the submodule `_testing` to `m` (`kvoffload._native`).
/// `(rust_path, exception)` for a sample of every error variant an
/// offloader call raises (`errors::samples`), each as the Python exception
/// it becomes.
#[pyfunction]
fn error_table(py: Python<'_>) -> Vec<(String, Py<PyAny>)> {
    errors::samples().into_iter().map(|(path, e)| (path, errors::offloader(py, e).into_value(py).into_any())).collect()
}

/// An in-process pool of `slots` slots (`ways` per set, `ranks` ranks,
/// `engines` entries): its words are the sync facade's atomics, shared by
/// the `Pool` objects `local_pool_attach` makes; each `Pool` is a
/// "process" (a pid index) whose death `local_pool_kill` decides.
#[pyfunction]
#[pyo3(signature = (slots, ways = 16, ranks = 1, engines = 32, processes = 64))]
fn local_pool(py: Python<'_>, slots: u32, ways: u32, ranks: u8, engines: u8, processes: u32) -> PyResult<pool::PyPool> {
    use kvoffload::internal::pool::words::Geometry;
    let g = Geometry { slots, ways, ranks, engines };
    g.check().map_err(|why| errors::options(py, format!("local_pool: {g:?}: {why}")))?;
    let local = Arc::new(pool::LocalPool::new(g, processes));
    let me = local.process().ok_or_else(|| errors::options(py, "local_pool: processes must be at least 1"))?;
    Ok(pool::PyPool::new(pool::AnyWords::Local(local), me, "local".into(), None))
}

/// Another "process" on `pool`'s in-process words.
#[pyfunction]
fn local_pool_attach(py: Python<'_>, pool: &pool::PyPool) -> PyResult<pool::PyPool> {
    let pool::AnyWords::Local(local) = pool.words() else {
        return Err(errors::options(py, "local_pool_attach: not an in-process pool"));
    };
    let me = local
        .process()
        .ok_or_else(|| errors::options(py, "local_pool_attach: every process of this local pool is taken"))?;
    Ok(pool::PyPool::new(pool::AnyWords::Local(local.clone()), me, "local".into(), None))
}

/// Marks `pool`'s "process" dead: the liveness oracle says it is gone.
#[pyfunction]
fn local_pool_kill(py: Python<'_>, pool: &pool::PyPool) -> PyResult<()> {
    let pool::AnyWords::Local(local) = pool.words() else {
        return Err(errors::options(py, "local_pool_kill: not an in-process pool"));
    };
    local.words.kill(pool.me().pid);
    Ok(())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let t = PyModule::new(m.py(), "_testing")?;
    t.add_class::<PySimHold>()?;
    t.add_function(wrap_pyfunction!(sim_device_bytes_in_use, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_registered_ranges, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_fail_registration, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_hold, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_adopt, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_release_adopted, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_adopted_ranges, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_stream, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_stream_destroy, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_begin_capture, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_end_capture, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_graph_launch, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_graph_destroy, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_memset, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_launch_spin, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_wait_idle, &t)?)?;
    t.add_function(wrap_pyfunction!(sim_refusals, &t)?)?;
    t.add_function(wrap_pyfunction!(activity, &t)?)?;
    t.add_function(wrap_pyfunction!(write_block, &t)?)?;
    t.add_function(wrap_pyfunction!(read_block, &t)?)?;
    t.add_function(wrap_pyfunction!(error_table, &t)?)?;
    t.add_function(wrap_pyfunction!(local_pool, &t)?)?;
    t.add_function(wrap_pyfunction!(local_pool_attach, &t)?)?;
    t.add_function(wrap_pyfunction!(local_pool_kill, &t)?)?;
    m.add_submodule(&t)
}
