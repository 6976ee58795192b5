//! `kvoffload._native`: the Python front of kvoffload (PyO3, abi3).
//!
//! One class an engine holds, [`PyOffloader`] (`kvoffload.Offloader`),
//! over the library's `Offloader`; a [`PyRuntime`] (`kvoffload.Runtime`)
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
//! ranks' agreement, entering a capture window, `wait`, `wait_all`) use the
//! library's interruptible forms with [`Signals`] as their check: Ctrl-C
//! (any signal whose Python handler raises) stops them within about 50 ms
//! and raises the handler's exception (`KeyboardInterrupt`), leaving
//! nothing behind.

mod errors;
mod tensors;
mod testing;

use std::sync::Mutex;
use std::time::Duration;

use kvoffload::internal::manager::{BlockKey, Lookup, PolicyKind, SkipReason};
use kvoffload::internal::offloader::{
    Addressing, Completion, KvAlloc, KvSpec, Offloader, OffloaderError, OffloaderOptions, PinOutcome, RegionSpec,
    SlotJob,
};
use kvoffload::internal::pin::options::{HugePages, PrefaultMode};
use kvoffload::internal::protocol::agreement::Transport;
use kvoffload::internal::protocol::{CapturePolicy, CaptureWindow, PinState};
use kvoffload::internal::region::ShmOptions;
use kvoffload::internal::runtime::cuda::CudaRuntime;
use kvoffload::internal::runtime::sim::SimRuntime;
use kvoffload::internal::runtime::{DevicePtr, Direction, GpuRuntime, Stream};
use kvoffload::internal::transfer::{Backend, BackendChoice, JobId, Lane, TensorSpec, TransferError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::sync::Arc;

// ---------------------------------------------------------------- runtime

/// The GPU an offloader runs on.
///
/// `Runtime("cuda", device=0)` opens the CUDA driver on `device` (its
/// primary context, the one PyTorch uses); `Runtime("sim")` is the
/// simulated GPU (tests, machines without a GPU); `Runtime("auto")` is the
/// CUDA driver where a device is visible, the simulated GPU otherwise. One
/// runtime can serve several offloaders.
#[pyclass(name = "Runtime", module = "kvoffload", frozen)]
struct PyRuntime {
    rt: Arc<dyn GpuRuntime>,
    cuda: Option<Arc<CudaRuntime>>,
}

impl PyRuntime {
    fn open(py: Python<'_>, backend: &str, device: usize) -> PyResult<PyRuntime> {
        let cuda = |py: Python<'_>| -> PyResult<PyRuntime> {
            let c = Arc::new(py.detach(|| CudaRuntime::open(device)).map_err(|e| errors::open(py, e))?);
            let rt: Arc<dyn GpuRuntime> = c.clone();
            Ok(PyRuntime { rt, cuda: Some(c) })
        };
        let sim = || PyRuntime { rt: Arc::new(SimRuntime::new()), cuda: None };
        match backend {
            "sim" => Ok(sim()),
            "cuda" => cuda(py),
            "auto" => match CudaRuntime::device_count() {
                Ok(n) if n > 0 => cuda(py),
                _ => Ok(sim()),
            },
            other => Err(errors::options(py, format!("backend must be 'auto', 'sim' or 'cuda', not {other:?}"))),
        }
    }
}

#[pymethods]
impl PyRuntime {
    #[new]
    #[pyo3(signature = (backend = "auto", device = 0))]
    fn new(py: Python<'_>, backend: &str, device: usize) -> PyResult<Self> {
        PyRuntime::open(py, backend, device)
    }

    /// `"cuda"` or `"sim"`.
    #[getter]
    fn backend(&self) -> &'static str {
        self.rt.backend()
    }

    /// The device and driver, for reports.
    fn describe(&self) -> String {
        self.rt.describe()
    }

    fn __repr__(&self) -> String {
        format!("kvoffload.Runtime({:?}: {})", self.rt.backend(), self.rt.describe())
    }
}

// ---------------------------------------------------------------- signals

/// Python's pending signals as the `interrupted` check of the library's
/// interruptible waits. The library calls [`Signals::check`] every 50 ms or
/// so while a wait lasts, from the waiting thread (which released the GIL)
/// and never while it holds a lock of its own, so taking the GIL there
/// cannot deadlock with a Python thread that holds the GIL and waits for
/// one of those locks. The check runs the Python signal handlers (on the
/// main thread only, as Python itself does: a wait on another thread is
/// not interrupted, as `threading.Event.wait` is not), and keeps the
/// exception a handler raised, so that the caller sees exactly that one.
#[derive(Clone, Default)]
struct Signals {
    raised: Arc<Mutex<Option<PyErr>>>,
}

impl Signals {
    /// True when a signal handler raised (the wait then stops).
    fn check(&self) -> bool {
        Python::attach(|py| match py.check_signals() {
            Ok(()) => false,
            Err(e) => {
                *self.raised.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                true
            }
        })
    }

    /// The wait's outcome for Python: the signal handler's exception when
    /// one was raised during the wait (whatever the wait returned),
    /// otherwise the error's exception (an `Interrupted` error with no
    /// exception kept raises KeyboardInterrupt, see `errors::offloader`).
    fn result<T>(&self, py: Python<'_>, r: Result<T, OffloaderError>) -> PyResult<T> {
        if let Some(e) = self.raised.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(e);
        }
        r.map_err(|e| errors::offloader(py, e))
    }
}

// ---------------------------------------------------------------- agreement

/// The agreement transport backed by a Python callable: `f(mine) ->
/// list[int] | int` (an all-gather of every rank's word, or the result of
/// an all-reduce with MAX). Called once, on the pinning thread, with the
/// GIL taken for the call.
struct PyTransport {
    f: Py<PyAny>,
}

impl Transport for PyTransport {
    fn exchange(&self, mine: u32) -> Result<Vec<u32>, String> {
        Python::attach(|py| {
            let r = self.f.call1(py, (mine,)).map_err(|e| format!("the agreement callable raised {e}"))?;
            let r = r.bind(py);
            if let Ok(w) = r.extract::<u32>() {
                return Ok(vec![w]);
            }
            r.extract::<Vec<u32>>().map_err(|_| {
                let shown = r.repr().map(|s| s.to_string()).unwrap_or_else(|_| "?".into());
                format!("the agreement callable returned {shown}, not an int or a list of ints")
            })
        })
    }
}

// ---------------------------------------------------------------- results

fn key_out(py: Python<'_>, k: BlockKey) -> PyResult<Bound<'_, PyTuple>> {
    PyTuple::new(py, [k.hash.into_pyobject(py)?.into_any(), k.group.into_pyobject(py)?.into_any()])
}

fn keys_out<'py>(py: Python<'py>, keys: &[BlockKey]) -> PyResult<Vec<Bound<'py, PyTuple>>> {
    keys.iter().map(|k| key_out(py, *k)).collect()
}

/// A pin state: `name` is `"pending"`, `"pinning"`, `"pinned"` or
/// `"pageable"`; `reason` says why a pageable region is (e.g.
/// `"not_supported"`, `"peer_pageable"`), `message` in words.
#[pyclass(name = "PinState", module = "kvoffload", frozen, get_all)]
struct PyPinState {
    name: &'static str,
    done: Option<usize>,
    total: Option<usize>,
    reason: Option<String>,
    message: Option<String>,
}

impl PyPinState {
    fn from(s: &PinState) -> Self {
        let (name, done, total, reason, message) = match s {
            PinState::Pending => ("pending", None, None, None, None),
            PinState::Pinning { done, total } => ("pinning", Some(*done), Some(*total), None, None),
            PinState::Pinned => ("pinned", None, None, None, None),
            PinState::Pageable(r) => {
                ("pageable", None, None, Some(errors::variant(&format!("{r:?}"))), Some(r.to_string()))
            }
        };
        PyPinState { name, done, total, reason, message }
    }
}

#[pymethods]
impl PyPinState {
    /// Pinned or pageable: pinning will not change the state any more.
    #[getter]
    fn is_final(&self) -> bool {
        matches!(self.name, "pinned" | "pageable")
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        if let Ok(s) = other.extract::<String>() {
            return s == self.name;
        }
        match other.cast::<PyPinState>() {
            Ok(o) => {
                let o = o.get();
                o.name == self.name && o.reason == self.reason && o.done == self.done && o.total == self.total
            }
            Err(_) => false,
        }
    }

    fn __hash__(&self) -> u64 {
        self.name.len() as u64
    }

    fn __str__(&self) -> String {
        self.name.to_string()
    }

    fn __repr__(&self) -> String {
        match (self.name, &self.reason, self.done) {
            ("pageable", Some(r), _) => format!("PinState('pageable', reason={r:?})"),
            ("pinning", _, Some(d)) => format!("PinState('pinning', {d}/{})", self.total.unwrap_or(0)),
            (n, _, _) => format!("PinState({n:?})"),
        }
    }
}

/// Pinning progress.
#[pyclass(name = "PinProgress", module = "kvoffload", frozen, get_all)]
struct PyPinProgress {
    state: Py<PyPinState>,
    chunks_done: usize,
    chunks_total: usize,
    bytes_total: usize,
}

#[pymethods]
impl PyPinProgress {
    fn __repr__(&self) -> String {
        format!("PinProgress({}/{} chunks, {} bytes)", self.chunks_done, self.chunks_total, self.bytes_total)
    }
}

/// How pinning ended: the final `state`, and `agreement_error` (an
/// `AgreementError`, not raised) when ranks had to agree and could not
/// (this rank then runs on pageable memory).
#[pyclass(name = "PinOutcome", module = "kvoffload", frozen, get_all)]
struct PyPinOutcome {
    state: Py<PyPinState>,
    agreed: Option<bool>,
    agreement_error: Option<Py<PyAny>>,
}

#[pymethods]
impl PyPinOutcome {
    fn __repr__(&self, py: Python<'_>) -> String {
        let st = self.state.get().__repr__();
        match &self.agreement_error {
            Some(e) => format!("PinOutcome({st}, agreement_error={})", e.bind(py)),
            None => {
                format!("PinOutcome({st}, agreed={})", self.agreed.map_or("None", |a| if a { "True" } else { "False" }))
            }
        }
    }
}

/// What a store submission did (the library's `StoreSubmitted`): `job`
/// (None when nothing needed storing), the keys it `stored` (readable once
/// `poll` reports the job), the keys `skipped` as `(key, reason)`, the keys
/// `evicted` to make room.
#[pyclass(name = "StoreSubmitted", module = "kvoffload", frozen, get_all)]
struct PyStoreSubmitted {
    job: Option<u64>,
    stored: Py<PyAny>,
    skipped: Py<PyAny>,
    evicted: Py<PyAny>,
}

#[pymethods]
impl PyStoreSubmitted {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StoreSubmitted(job={}, stored={}, skipped={}, evicted={})",
            self.job.map_or("None".to_string(), |j| j.to_string()),
            self.stored.bind(py),
            self.skipped.bind(py),
            self.evicted.bind(py)
        )
    }
}

/// A finished job, as `poll` reports it (already applied to the block
/// manager): `direction` is `"store"` or `"load"`; `seconds` from
/// submission until completion was seen, `deferred_seconds` of them queued
/// behind a capture hook window (0 when not deferred); `lane` is the
/// handler that ran it: `"store"`, `"load"` or `"load_expedited"` (an
/// expedited load on its own stream, `expedited_lane=True`); `error` is
/// None when every byte arrived, else a `DriverError` (not raised).
#[pyclass(name = "Completion", module = "kvoffload", frozen, get_all)]
struct PyCompletion {
    job: u64,
    direction: &'static str,
    lane: &'static str,
    keys: Py<PyAny>,
    bytes: u64,
    seconds: f64,
    deferred_seconds: f64,
    backend: &'static str,
    error: Option<Py<PyAny>>,
}

#[pymethods]
impl PyCompletion {
    /// True when the job moved every byte.
    #[getter]
    fn ok(&self) -> bool {
        self.error.is_none()
    }

    fn __repr__(&self) -> String {
        format!(
            "Completion(job={}, {}, {} bytes, {}{})",
            self.job,
            self.direction,
            self.bytes,
            self.backend,
            if self.error.is_some() { ", failed" } else { "" }
        )
    }
}

fn completion(py: Python<'_>, c: Completion) -> PyResult<PyCompletion> {
    Ok(PyCompletion {
        job: c.job.0,
        direction: match c.direction {
            Direction::DeviceToHost => "store",
            Direction::HostToDevice => "load",
        },
        lane: match c.lane {
            Lane::Store => "store",
            Lane::Load => "load",
            Lane::LoadExpedited => "load_expedited",
        },
        keys: keys_out(py, &c.keys)?.into_pyobject(py)?.into_any().unbind(),
        bytes: c.bytes,
        seconds: c.seconds,
        deferred_seconds: c.deferred_seconds,
        backend: c.backend.name(),
        error: c.error.map(|e| errors::driver(py, "the job failed", e).into_value(py).into_any()),
    })
}

// ---------------------------------------------------------------- offloader

fn parse_keys(py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<BlockKey>> {
    let mut out = Vec::new();
    for k in keys.try_iter()? {
        let k = k?;
        let hash_of = |h: &Bound<'_, PyAny>| -> PyResult<u64> {
            if let Ok(v) = h.extract::<u64>() {
                return Ok(v);
            }
            // Negative hashes (Python's hash()) fold to their 64-bit pattern.
            h.extract::<i64>()
                .map(|v| v as u64)
                .map_err(|_| errors::options(py, format!("a block hash must be an int in [-2**63, 2**64), not {k}")))
        };
        if let Ok(t) = k.cast::<PyTuple>() {
            if t.len() != 2 {
                return Err(errors::options(py, format!("a key is an int or a (hash, group) pair, not {k}")));
            }
            let group = t
                .get_item(1)?
                .extract::<u32>()
                .map_err(|_| errors::options(py, format!("a key's group must be an int in [0, 2**32), not {k}")))?;
            out.push(BlockKey::new(hash_of(&t.get_item(0)?)?, group));
        } else {
            out.push(BlockKey::new(hash_of(&k)?, 0));
        }
    }
    Ok(out)
}

fn parse_blocks(py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    parse_ids(py, "a GPU block id", blocks)
}

/// A list of non-negative ints: any iterable of ints, or an array with
/// `tolist()` (numpy, as vLLM's specs hold them), converted in one call.
fn parse_ids(py: Python<'_>, what: &str, ids: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    if let Ok(list) = ids.call_method0("tolist") {
        if let Ok(v) = list.extract::<Vec<usize>>() {
            return Ok(v);
        }
    }
    let mut out = Vec::new();
    for b in ids.try_iter()? {
        let b = b?;
        out.push(
            b.extract::<usize>()
                .map_err(|_| errors::options(py, format!("{what} must be a non-negative int, not {b}")))?,
        );
    }
    Ok(out)
}

fn choice<T: Copy>(py: Python<'_>, what: &str, given: &str, table: &[(&str, T)]) -> PyResult<T> {
    table.iter().find(|(n, _)| *n == given).map(|(_, v)| *v).ok_or_else(|| {
        let names: Vec<&str> = table.iter().map(|(n, _)| *n).collect();
        errors::options(py, format!("{what} must be one of {names:?}, not {given:?}"))
    })
}

fn seconds(py: Python<'_>, what: &str, s: Option<f64>) -> PyResult<Option<Duration>> {
    match s {
        None => Ok(None),
        Some(v) if v.is_finite() && v >= 0.0 => Duration::try_from_secs_f64(v).map(Some).map_err(|_| {
            errors::options(py, format!("{what} must be a non-negative number of seconds or None, not {v} (too large)"))
        }),
        Some(v) => {
            Err(errors::options(py, format!("{what} must be a non-negative number of seconds or None, not {v}")))
        }
    }
}

/// `allow_group`: a gid (int) or a group name (looked up with Python's
/// `grp` module).
fn group_id(py: Python<'_>, g: &Bound<'_, PyAny>) -> PyResult<u32> {
    if let Ok(gid) = g.extract::<u32>() {
        return Ok(gid);
    }
    let Ok(name) = g.extract::<String>() else {
        return Err(errors::options(py, format!("allow_group must be a gid (int) or a group name (str), not {g}")));
    };
    let entry = py
        .import("grp")?
        .call_method1("getgrnam", (name.as_str(),))
        .map_err(|_| errors::options(py, format!("allow_group: no group named {name:?}")))?;
    entry.getattr("gr_gid")?.extract::<u32>()
}

/// KV-cache offload between GPU memory and a pinned host region; the one
/// object an engine holds. See the package docs and `kvoffload/__init__.pyi`.
#[pyclass(name = "Offloader", module = "kvoffload", frozen)]
struct PyOffloader {
    off: Arc<Offloader>,
    runtime: Py<PyRuntime>,
    /// The engine's tensors, kept alive until shutdown.
    tensors: Mutex<Vec<Py<PyAny>>>,
    /// The engine's compute stream, adopted (forgotten after shutdown), or
    /// on the simulated GPU a stream made for this offloader (destroyed).
    adopted: Mutex<Option<Stream>>,
    /// On the simulated GPU with CPU tensors: the storage ranges adopted as
    /// device memory, released once the offloader shut down.
    adoptions: Mutex<Vec<DevicePtr>>,
    /// Completions taken from the engine and not yet returned by `poll`,
    /// in the engine's order: `poll` and the waits (which poll while they
    /// wait, see `Offloader::wait_interruptible`) put them here, each under
    /// the offloader's lock, and `poll` returns them all.
    reported: Mutex<Vec<Completion>>,
}

impl Drop for PyOffloader {
    fn drop(&mut self) {
        // The offloader's own Drop shuts it down, joining the pinner, which
        // may be inside the Python agreement callable waiting for the GIL:
        // shut down with the GIL released.
        let off = self.off.clone();
        Python::attach(|py| {
            py.detach(move || {
                if !off.is_shut_down() {
                    if let Err(e) = off.shutdown() {
                        eprintln!("kvoffload: offloader dropped, shutdown failed: {e}");
                    }
                }
            })
        });
        if self.off.is_shut_down() {
            self.release_adoptions();
        } else if !self.adoptions.get_mut().unwrap_or_else(|p| p.into_inner()).is_empty() {
            // The simulated GPU may still touch the adopted tensors: their
            // owners must outlive it, so they are leaked, not dropped.
            eprintln!("kvoffload: offloader dropped without shutting down; its CPU tensors are kept alive");
            for t in std::mem::take(self.tensors.get_mut().unwrap_or_else(|p| p.into_inner())) {
                std::mem::forget(t);
            }
        }
        self.forget_stream();
    }
}

impl PyOffloader {
    /// A sink for `Offloader::poll_each` and the waits: into `reported`
    /// (called under the offloader's lock; takes no other lock but this
    /// one's, and no GIL).
    fn keep(&self) -> impl FnMut(Completion) + '_ {
        move |c| self.reported.lock().unwrap_or_else(|p| p.into_inner()).push(c)
    }

    /// Ends the adoptions of the CPU tensors' storage (simulated GPU; after
    /// shutdown, so no job of this offloader is queued). Each release waits
    /// for the device to be idle. A failure is reported on stderr and the
    /// tensors are then leaked, since the sim may still reach them.
    fn release_adoptions(&self) -> bool {
        let ptrs = std::mem::take(&mut *self.adoptions.lock().unwrap_or_else(|p| p.into_inner()));
        let Some(sim) = self.off.runtime().as_sim() else { return ptrs.is_empty() };
        let mut ok = true;
        for p in ptrs {
            if let Err(e) = sim.release_adopted(p) {
                eprintln!("kvoffload: releasing the adopted CPU tensors at {:#x} failed: {e}", p.raw());
                ok = false;
            }
        }
        if !ok {
            for t in std::mem::take(&mut *self.tensors.lock().unwrap_or_else(|p| p.into_inner())) {
                std::mem::forget(t);
            }
        }
        ok
    }

    #[allow(clippy::too_many_arguments)]
    fn slot_job(
        &self,
        py: Python<'_>,
        lane: Lane,
        job: u64,
        gpu_blocks: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        first_subs: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let g = parse_blocks(py, gpu_blocks)?;
        let sizes = parse_ids(py, "a group size", group_sizes)?;
        let s = parse_ids(py, "a host slot id", slots)?;
        let subs = parse_ids(py, "a first_sub", first_subs)?;
        let j = SlotJob { gpu_blocks: &g, group_sizes: &sizes, slots: &s, first_subs: &subs };
        let off = &self.off;
        py.detach(|| match lane {
            Lane::Store => off.store_slot_job(JobId(job), &j),
            Lane::Load => off.load_slot_job(JobId(job), &j),
            Lane::LoadExpedited => off.load_slot_job_expedited(JobId(job), &j),
        })
        .map_err(|e| errors::offloader(py, e))
    }

    fn forget_stream(&self) {
        if let Some(s) = self.adopted.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = self.off.runtime().stream_destroy(s);
        }
    }
}

#[pymethods]
impl PyOffloader {
    #[new]
    #[pyo3(signature = (
        host_blocks, *, tensors, gpu_blocks = None, page_bytes = None, block_factor = 1, stream = None,
        backend = "auto", device = 0, runtime = None,
        region = "anonymous", name = None, rank = 0, ranks = 1, region_dir = None, join_timeout = 60.0,
        allow_group = None, check_memory = true,
        pin_threads = None, max_chunk_bytes = None, prefault = "populate", huge_pages = "auto",
        capture_policy = "after_pinning", copy_backend = "auto", staging_bytes = None, duplex_linger = None,
        eviction = "lru", agreement = None, agreement_timeout = Some(120.0), start = false,
        addressing = "keys", kv_groups = None, expedited_lane = false,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        host_blocks: usize,
        tensors: &Bound<'_, PyAny>,
        gpu_blocks: Option<usize>,
        page_bytes: Option<usize>,
        block_factor: usize,
        stream: Option<&Bound<'_, PyAny>>,
        backend: &str,
        device: usize,
        runtime: Option<Py<PyRuntime>>,
        region: &str,
        name: Option<String>,
        rank: usize,
        ranks: usize,
        region_dir: Option<std::path::PathBuf>,
        join_timeout: f64,
        allow_group: Option<&Bound<'_, PyAny>>,
        check_memory: bool,
        pin_threads: Option<usize>,
        max_chunk_bytes: Option<usize>,
        prefault: &str,
        huge_pages: &str,
        capture_policy: &str,
        copy_backend: &str,
        staging_bytes: Option<usize>,
        duplex_linger: Option<f64>,
        eviction: &str,
        agreement: Option<Py<PyAny>>,
        agreement_timeout: Option<f64>,
        start: bool,
        addressing: &str,
        kv_groups: Option<Vec<usize>>,
        expedited_lane: bool,
    ) -> PyResult<Self> {
        let runtime = match runtime {
            Some(r) => r,
            None => Py::new(py, PyRuntime::open(py, backend, device)?)?,
        };
        let mut opts = OffloaderOptions::with_host_blocks(host_blocks);
        opts.addressing =
            choice(py, "addressing", addressing, &[("keys", Addressing::Keys), ("slots", Addressing::Slots)])?;
        opts.kv_groups = kv_groups;
        // Joining or creating a shared region waits for the other ranks:
        // Ctrl-C stops it (see `Signals`).
        let signals = Signals::default();
        opts.region = match region {
            "anonymous" => {
                if ranks != 1 || rank != 0 || name.is_some() || allow_group.is_some() {
                    return Err(errors::options(
                        py,
                        "name, rank, ranks and allow_group describe a shared region: give region='shared' too",
                    ));
                }
                if !check_memory {
                    return Err(errors::options(
                        py,
                        "check_memory=False applies to shared regions only (an anonymous region is always checked)",
                    ));
                }
                RegionSpec::Anonymous
            }
            "shared" => {
                let name = name.ok_or_else(|| errors::options(py, "region='shared' needs a name"))?;
                let timeout = seconds(py, "join_timeout", Some(join_timeout))?.unwrap_or_default();
                let check = signals.clone();
                let mut o =
                    ShmOptions::new().timeout(timeout).check_memory(check_memory).interrupt(move || check.check());
                if let Some(d) = &region_dir {
                    o = o.dir(d);
                }
                if let Some(g) = allow_group {
                    o = o.allow_group(group_id(py, g)?);
                }
                RegionSpec::Shared { name, rank, ranks, options: o }
            }
            other => return Err(errors::options(py, format!("region must be 'anonymous' or 'shared', not {other:?}"))),
        };
        if let Some(t) = pin_threads {
            opts.pin.threads = t;
        }
        if let Some(c) = max_chunk_bytes {
            opts.pin.max_chunk_bytes = c;
        }
        opts.pin.prefault = choice(
            py,
            "prefault",
            prefault,
            &[("populate", PrefaultMode::Populate), ("touch", PrefaultMode::Touch), ("off", PrefaultMode::Off)],
        )?;
        opts.pin.huge_pages = choice(
            py,
            "huge_pages",
            huge_pages,
            &[("auto", HugePages::Auto), ("on", HugePages::On), ("off", HugePages::Off)],
        )?;
        opts.pin.policy = choice(
            py,
            "capture_policy",
            capture_policy,
            &[("after_pinning", CapturePolicy::AfterPinning), ("interleave", CapturePolicy::Interleave)],
        )?;
        opts.transfer.backend = choice(
            py,
            "copy_backend",
            copy_backend,
            &[
                ("auto", BackendChoice::Auto),
                ("per-fragment", BackendChoice::Force(Backend::PerFragment)),
                ("batched", BackendChoice::Force(Backend::Batched)),
                ("gather", BackendChoice::Force(Backend::Gather)),
                ("staged", BackendChoice::Force(Backend::Staged)),
            ],
        )?;
        opts.transfer.expedited_lane = expedited_lane;
        if let Some(b) = staging_bytes {
            opts.transfer.staging_bytes = b;
        }
        if let Some(d) = seconds(py, "duplex_linger", duplex_linger)? {
            opts.transfer.thresholds.duplex_linger = d;
        }
        opts.eviction = choice(py, "eviction", eviction, &[("lru", PolicyKind::Lru), ("arc", PolicyKind::Arc)])?;
        opts.agreement_timeout = seconds(py, "agreement_timeout", agreement_timeout)?;
        if let Some(f) = agreement {
            if !f.bind(py).is_callable() {
                return Err(errors::options(py, "agreement must be a callable: f(mine: int) -> list[int] | int"));
            }
            opts.agreement = Some(Arc::new(PyTransport { f }));
        }

        let rt_ref = runtime.get();
        let rt = rt_ref.rt.clone();
        let on_sim = rt.as_sim().is_some();
        let parsed = tensors::parse(py, tensors, gpu_blocks, page_bytes, device, on_sim)?;
        let mut adoptions: Vec<DevicePtr> = Vec::new();
        let (off, keep, adopted) = match parsed {
            tensors::Tensors::Allocate { count, gpu_blocks, page_bytes } => {
                let alloc = KvAlloc { tensors: count, page_bytes, gpu_blocks, block_factor };
                let off = py.detach(|| Offloader::with_allocated_tensors(rt, alloc, opts));
                (off, Vec::new(), None)
            }
            tensors::Tensors::External { tensors: ts, gpu_blocks, keep, host } if on_sim => {
                let sim = rt.as_sim().expect("on_sim");
                if let Some(i) = host.iter().position(|h| h.is_none()) {
                    return Err(errors::options(
                        py,
                        format!(
                            "tensors[{i}] is not a CPU tensor: the simulated GPU takes CPU tensors (adopted as its \
                             device memory) and cannot reach other memory; an engine's GPU tensors need the CUDA \
                             backend, or give tensors=<count> to let the offloader allocate its own"
                        ),
                    ));
                }
                let host: Vec<(u64, usize)> = host.into_iter().flatten().collect();
                let ranges = tensors::merged(&host);
                let mut bases: Vec<(u64, usize, DevicePtr)> = Vec::new();
                let release = |ptrs: &[DevicePtr]| {
                    for &p in ptrs {
                        let _ = sim.release_adopted(p);
                    }
                };
                for &(start, len) in &ranges {
                    // SAFETY: `start..start+len` is the storage of CPU
                    // tensors the caller gave (from `untyped_storage()`),
                    // owned by them, readable and writable; this offloader
                    // keeps the tensor objects (and with them the storage)
                    // alive until the adoption is released after shutdown,
                    // or leaks them when it cannot be; the caller must not
                    // touch blocks named in jobs until they are reported
                    // (the documented contract for device tensors).
                    match unsafe { sim.adopt_host_memory(start as usize, len) } {
                        Ok(p) => {
                            adoptions.push(p);
                            bases.push((start, len, p));
                        }
                        Err(e) => {
                            release(&adoptions);
                            return Err(errors::driver(py, "adopting the CPU tensors as simulated device memory", e));
                        }
                    }
                }
                let device_of = |ptr: u64| {
                    let &(start, _, p) = bases
                        .iter()
                        .find(|&&(s, n, _)| ptr >= s && ptr < s + n as u64)
                        .expect("each tensor lies in its storage (checked), and its storage in a merged range");
                    DevicePtr(p.raw() + (ptr - start))
                };
                let (s, own) = match stream {
                    None => match sim.stream_create() {
                        Ok(s) => (s, true),
                        Err(e) => {
                            release(&adoptions);
                            return Err(errors::driver(py, "creating the compute stream", e));
                        }
                    },
                    Some(st) => {
                        let raw = tensors::stream_handle(py, Some(st))?;
                        match sim.stream_by_raw(raw as u64) {
                            Some(s) => (s, false),
                            None => {
                                release(&adoptions);
                                return Err(errors::options(py, format!("no stream {raw} on this simulated GPU")));
                            }
                        }
                    }
                };
                let kv = KvSpec {
                    tensors: ts.iter().map(|&(p, b)| TensorSpec { device_base: device_of(p), page_bytes: b }).collect(),
                    gpu_blocks,
                    block_factor,
                    compute_stream: s,
                };
                let rt2 = rt.clone();
                // SAFETY: the tensors are the sim's device memory (adopted
                // above), each at least gpu_blocks * page_bytes long
                // (checked by `tensors::parse` against its size); the
                // adoption lasts until after shutdown; the stream is live
                // (made here, or found live on this sim) and outlives the
                // offloader (ours is destroyed after shutdown; a caller's
                // stream is the caller's to keep alive, as on CUDA).
                let off = py.detach(|| unsafe { Offloader::new(rt2, kv, opts) });
                if off.is_err() {
                    release(&adoptions);
                    adoptions.clear();
                    if own {
                        let _ = sim.stream_destroy(s);
                    }
                }
                (off, keep, own.then_some(s))
            }
            tensors::Tensors::External { tensors: ts, gpu_blocks, keep, .. } => {
                let Some(cuda) = rt_ref.cuda.clone() else {
                    return Err(errors::options(
                        py,
                        "an engine's tensors need the CUDA backend (the simulated GPU cannot reach them); \
                         give tensors=<count> to let the offloader allocate its own",
                    ));
                };
                let raw = tensors::stream_handle(py, stream)?;
                // SAFETY: `raw` is the engine's stream of this device's
                // primary context (the caller's word, as for the tensors);
                // it is forgotten again after the offloader shut down.
                let s = unsafe { cuda.adopt_stream(raw) };
                let kv = KvSpec {
                    tensors: ts.iter().map(|&(p, b)| TensorSpec { device_base: DevicePtr(p), page_bytes: b }).collect(),
                    gpu_blocks,
                    block_factor,
                    compute_stream: s,
                };
                // SAFETY: the tensors are device allocations of this
                // device's primary context (checked to be CUDA tensors of
                // `device` where the object says), each at least
                // gpu_blocks * page_bytes long; the Python objects are kept
                // alive by this offloader until it shut down, so their
                // memory stays allocated; the stream is the engine's, alive
                // as long (the documented contract of `Offloader`). Blocks
                // named in jobs are the engine's to leave alone until the
                // job is reported (documented in the Python API).
                let off = py.detach(|| unsafe { Offloader::new(rt, kv, opts) });
                if off.is_err() {
                    let _ = cuda.stream_destroy(s);
                }
                (off, keep, Some(s))
            }
        };
        let off = Arc::new(signals.result(py, off)?);
        let me = PyOffloader {
            off,
            runtime,
            tensors: Mutex::new(keep),
            adopted: Mutex::new(adopted),
            adoptions: Mutex::new(adoptions),
            reported: Mutex::new(Vec::new()),
        };
        if start {
            me.off.start().map_err(|e| errors::offloader(py, e))?;
        }
        Ok(me)
    }

    /// The runtime (GPU) this offloader runs on.
    #[getter]
    fn runtime(&self, py: Python<'_>) -> Py<PyRuntime> {
        self.runtime.clone_ref(py)
    }

    /// Device addresses of the KV tensors.
    #[getter]
    fn tensor_addresses(&self) -> Vec<u64> {
        self.off.tensors().into_iter().map(DevicePtr::raw).collect()
    }

    /// Bytes of one GPU block of each tensor.
    #[getter]
    fn page_bytes(&self) -> Vec<usize> {
        self.off.kv().tensors.iter().map(|t| t.page_bytes).collect()
    }

    /// GPU blocks in each tensor.
    #[getter]
    fn gpu_blocks(&self) -> usize {
        self.off.kv().gpu_blocks
    }

    /// GPU blocks per key.
    #[getter]
    fn block_factor(&self) -> usize {
        self.off.kv().block_factor
    }

    /// Bytes of the host region (every rank's part).
    #[getter]
    fn region_bytes(&self) -> usize {
        self.off.region().len()
    }

    /// Starts background pinning (idempotent; ShutDownError after shutdown).
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        let off = &self.off;
        if off.is_shut_down() {
            return Err(errors::offloader(py, kvoffload::internal::offloader::OffloaderError::ShutDown));
        }
        py.detach(|| off.start()).map_err(|e| errors::offloader(py, e))
    }

    /// The pin state now.
    #[getter]
    fn pin_state(&self) -> PyPinState {
        PyPinState::from(&self.off.pin_state())
    }

    /// Pinning progress now.
    #[getter]
    fn pin_progress(&self, py: Python<'_>) -> PyResult<PyPinProgress> {
        let p = self.off.pin_progress();
        Ok(PyPinProgress {
            state: Py::new(py, PyPinState::from(&p.state))?,
            chunks_done: p.chunks_done,
            chunks_total: p.chunks_total,
            bytes_total: p.bytes_total,
        })
    }

    /// Waits until pinning is final (and agreed, where ranks agree),
    /// starting it if needed; returns how it ended.
    fn wait_pinned(&self, py: Python<'_>) -> PyResult<PyPinOutcome> {
        let off = &self.off;
        let signals = Signals::default();
        let out: PinOutcome = signals.result(py, py.detach(|| off.wait_pinned_interruptible(&|| signals.check())))?;
        let (agreed, agreement_error) = match &out.agreement {
            None => (None, None),
            Some(Ok(())) => (Some(true), None),
            Some(Err(e)) => (Some(false), Some(errors::agreement(py, e).into_value(py).into_any())),
        };
        Ok(PyPinOutcome { state: Py::new(py, PyPinState::from(&out.state))?, agreed, agreement_error })
    }

    /// A capture window, as a context manager: `with off.capture_window():
    /// capture graphs here`. No library thread makes a capture-unsafe
    /// driver call while it is open; with the default policy it opens only
    /// once pinning is final (entering waits, GIL released; Ctrl-C stops
    /// the wait with KeyboardInterrupt, the window not opened).
    fn capture_window(&self) -> PyCaptureWindow {
        PyCaptureWindow { off: self.off.clone(), guard: Mutex::new(None), waited: Mutex::new(0) }
    }

    /// The capture hook's begin (for a wrapper of a framework's capture
    /// begin, called before it, on the capturing thread): opens this
    /// thread's hook window (depth 0 -> 1; deeper begins only count). It
    /// waits, GIL released, at most for the library call in flight (one
    /// chunk's registration), never for pinning to finish. While a hook
    /// window is open, jobs submitted on any thread are deferred and
    /// submitted when the last one closes.
    fn capture_begin(&self, py: Python<'_>) -> PyResult<()> {
        let off = &self.off;
        py.detach(|| off.capture_begin()).map_err(|e| errors::offloader(py, e))
    }

    /// The capture hook's end (after the framework's capture end, also
    /// when it failed): depth n -> n - 1; at 0 the window closes and the
    /// deferred jobs are submitted, in order, on this thread. ProtocolError
    /// (kind `"hook_not_open"`) at depth 0.
    fn capture_end(&self, py: Python<'_>) -> PyResult<()> {
        let off = &self.off;
        py.detach(|| off.capture_end()).map_err(|e| errors::offloader(py, e))
    }

    /// What `capture_end` does, for a capture whose framework begin failed
    /// after `capture_begin` succeeded.
    fn capture_abort(&self, py: Python<'_>) -> PyResult<()> {
        let off = &self.off;
        py.detach(|| off.capture_abort()).map_err(|e| errors::offloader(py, e))
    }

    /// This thread's hook depth: `capture_begin`s not yet ended.
    #[getter]
    fn capture_depth(&self) -> usize {
        self.off.capture_depth()
    }

    /// Jobs deferred behind a hook window and not yet submitted.
    #[getter]
    fn deferred_jobs(&self) -> usize {
        self.off.deferred_jobs()
    }

    /// Runs `f()` (the engine's own capture-unsafe calls, e.g.
    /// `torch.cuda.synchronize`) at a moment no capture window is open;
    /// windows wait for it. Returns what `f` returns.
    fn gated(&self, py: Python<'_>, f: Py<PyAny>) -> PyResult<Py<PyAny>> {
        let off = &self.off;
        let r = py.detach(|| off.gated("the engine's own call", |_| Python::attach(|py| f.call0(py))));
        r.map_err(|e| errors::offloader(py, e))?
    }

    /// What the offloader holds of each key: `"hit"`, `"miss"` or
    /// `"hit_pending"` (stored, store not yet complete), the library's
    /// `Lookup` variants.
    fn lookup(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<&'static str>> {
        let keys = parse_keys(py, keys)?;
        let off = &self.off;
        Ok(py
            .detach(|| off.lookup(&keys))
            .into_iter()
            .map(|l| match l {
                Lookup::Hit => "hit",
                Lookup::Miss => "miss",
                Lookup::HitPending => "hit_pending",
            })
            .collect())
    }

    /// Stores `keys` from GPU blocks `gpu_blocks` (`block_factor` per key,
    /// in key order). The engine must not write those blocks until `poll`
    /// reports the job (or `wait` returns for it).
    fn store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        gpu_blocks: &Bound<'_, PyAny>,
    ) -> PyResult<PyStoreSubmitted> {
        let (keys, blocks) = (parse_keys(py, keys)?, parse_blocks(py, gpu_blocks)?);
        let off = &self.off;
        let r = py.detach(|| off.store(&keys, &blocks)).map_err(|e| errors::offloader(py, e))?;
        let skipped: PyResult<Vec<(Bound<'_, PyTuple>, String)>> = r
            .skipped
            .iter()
            .map(|s| {
                let why = match s.reason {
                    SkipReason::AlreadyStored => "already_stored".to_string(),
                    SkipReason::StorePending => "store_pending".to_string(),
                    SkipReason::BelowThreshold { .. } => "below_threshold".to_string(),
                };
                Ok((key_out(py, s.key)?, why))
            })
            .collect();
        Ok(PyStoreSubmitted {
            job: r.job.map(|j| j.0),
            stored: keys_out(py, &r.stored)?.into_pyobject(py)?.into_any().unbind(),
            skipped: skipped?.into_pyobject(py)?.into_any().unbind(),
            evicted: keys_out(py, &r.evicted)?.into_pyobject(py)?.into_any().unbind(),
        })
    }

    /// Loads `keys` (each stored and readable) into GPU blocks
    /// `gpu_blocks`; returns the job id. The engine must not touch those
    /// blocks until the job is reported.
    fn load(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, gpu_blocks: &Bound<'_, PyAny>) -> PyResult<u64> {
        let (keys, blocks) = (parse_keys(py, keys)?, parse_blocks(py, gpu_blocks)?);
        let off = &self.off;
        py.detach(|| off.load(&keys, &blocks)).map(|j| j.0).map_err(|e| errors::offloader(py, e))
    }

    /// How host blocks are addressed: `"keys"` (the block manager picks
    /// them) or `"slots"` (the engine's slot ids, `addressing="slots"`).
    #[getter]
    fn addressing(&self) -> &'static str {
        match self.off.addressing() {
            Addressing::Keys => "keys",
            Addressing::Slots => "slots",
        }
    }

    /// Host blocks of this rank (with `addressing="slots"`, the slot ids
    /// are `0..host_blocks`).
    #[getter]
    fn host_blocks(&self) -> usize {
        self.off.host_blocks()
    }

    /// Stores GPU blocks `gpu_blocks` into host slots `slots` as job `job`
    /// (the engine's id, never used before), `addressing="slots"` only:
    /// GPU block `i` goes to sub-block `(first_sub + i) % block_factor` of
    /// slot `slots[(first_sub + i) // block_factor]`. The engine must not
    /// write those blocks until `poll` reports the job.
    #[pyo3(signature = (job, gpu_blocks, slots, first_sub = 0))]
    fn store_slots(
        &self,
        py: Python<'_>,
        job: u64,
        gpu_blocks: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        first_sub: usize,
    ) -> PyResult<()> {
        let (g, s) = (parse_blocks(py, gpu_blocks)?, parse_ids(py, "a host slot id", slots)?);
        let off = &self.off;
        py.detach(|| off.store_slots(JobId(job), &g, &s, first_sub)).map_err(|e| errors::offloader(py, e))
    }

    /// Loads host slots `slots` into GPU blocks `gpu_blocks` as job `job`,
    /// placed as `store_slots` placed them. The engine must not touch those
    /// blocks until `poll` reports the job. `expedited`: on the expedited
    /// lane's own stream, never behind a regular load (needs
    /// `expedited_lane=True`; TransferError, reason `"no_expedited_lane"`,
    /// otherwise).
    #[pyo3(signature = (job, gpu_blocks, slots, first_sub = 0, *, expedited = false))]
    fn load_slots(
        &self,
        py: Python<'_>,
        job: u64,
        gpu_blocks: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        first_sub: usize,
        expedited: bool,
    ) -> PyResult<()> {
        let (g, s) = (parse_blocks(py, gpu_blocks)?, parse_ids(py, "a host slot id", slots)?);
        let off = &self.off;
        py.detach(|| {
            if expedited {
                off.load_slots_expedited(JobId(job), &g, &s, first_sub)
            } else {
                off.load_slots(JobId(job), &g, &s, first_sub)
            }
        })
        .map_err(|e| errors::offloader(py, e))
    }

    /// `store_slots` over every KV cache group (`kv_groups`), in vLLM's
    /// shape: `gpu_blocks` and `slots` group after group, `group_sizes`
    /// and `first_subs` one per group.
    fn store_slot_job(
        &self,
        py: Python<'_>,
        job: u64,
        gpu_blocks: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        first_subs: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.slot_job(py, Lane::Store, job, gpu_blocks, group_sizes, slots, first_subs)
    }

    /// `load_slots` over every KV cache group, as `store_slot_job` stored
    /// them (`expedited` as for `load_slots`).
    #[pyo3(signature = (job, gpu_blocks, group_sizes, slots, first_subs, *, expedited = false))]
    #[allow(clippy::too_many_arguments)]
    fn load_slot_job(
        &self,
        py: Python<'_>,
        job: u64,
        gpu_blocks: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        first_subs: &Bound<'_, PyAny>,
        expedited: bool,
    ) -> PyResult<()> {
        let lane = if expedited { Lane::LoadExpedited } else { Lane::Load };
        self.slot_job(py, lane, job, gpu_blocks, group_sizes, slots, first_subs)
    }

    /// Blocks, GIL released, until each of `jobs` that is in flight
    /// completed on the GPU; ids never submitted or already reported are
    /// skipped, failures are reported by `poll` (vLLM's `wait`). Not
    /// interrupted by Ctrl-C.
    fn wait_jobs(&self, py: Python<'_>, jobs: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids: Vec<JobId> = parse_ids(py, "a job id", jobs)?.into_iter().map(|j| JobId(j as u64)).collect();
        let off = &self.off;
        py.detach(|| off.wait_jobs(&ids)).map_err(|e| errors::offloader(py, e))
    }

    /// Jobs finished since the last call, each reported once, in
    /// submission order per direction, already applied to the block
    /// manager. Never blocks on the GPU.
    fn poll(&self, py: Python<'_>) -> PyResult<Vec<PyCompletion>> {
        let out = py.detach(|| {
            self.off.poll_each(&mut self.keep());
            std::mem::take(&mut *self.reported.lock().unwrap_or_else(|p| p.into_inner()))
        });
        out.into_iter().map(|c| completion(py, c)).collect()
    }

    /// Blocks until job `job` completed on the GPU (it is still reported by
    /// `poll`). Ctrl-C stops the wait (KeyboardInterrupt; the job goes on).
    fn wait(&self, py: Python<'_>, job: u64) -> PyResult<()> {
        let id = JobId(job);
        let kept = self.reported.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|c| c.job == id).cloned();
        if let Some(c) = kept {
            // Completed, and taken from the engine by an earlier wait: not
            // reported by `poll` yet, so still the caller's to wait for,
            // with the outcome the blocking wait would give.
            return match c.error {
                None => Ok(()),
                Some(error) => Err(errors::offloader(py, TransferError::JobFailed { id, error }.into())),
            };
        }
        let off = &self.off;
        let signals = Signals::default();
        let r = py.detach(|| off.wait_interruptible(id, &|| signals.check(), &mut self.keep()));
        signals.result(py, r)
    }

    /// Blocks until every job submitted so far completed on the GPU.
    /// Ctrl-C stops the wait (KeyboardInterrupt; the jobs go on).
    fn wait_all(&self, py: Python<'_>) -> PyResult<()> {
        let off = &self.off;
        let signals = Signals::default();
        let r = py.detach(|| off.wait_all_interruptible(&|| signals.check(), &mut self.keep()));
        signals.result(py, r)
    }

    /// Jobs submitted and not yet reported by `poll` (those a wait already
    /// took from the engine included).
    #[getter]
    fn in_flight(&self) -> usize {
        // The library's count first: a job moving into `reported` between
        // the two reads is counted twice for a moment, never missed.
        let engine = self.off.in_flight();
        engine + self.reported.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Keys stored and readable now.
    #[getter]
    fn stored_blocks(&self) -> usize {
        self.off.stored_blocks()
    }

    /// Shuts down: refused (ProtocolError) while a capture window is open;
    /// drains the jobs, stops pinning, unregisters, frees what the
    /// offloader allocated, and lets go of the engine's tensors and stream.
    /// A second call raises ShutDownError.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let off = &self.off;
        let r = py.detach(|| off.shutdown());
        if self.off.is_shut_down() {
            // As the library's `poll` after shutdown: nothing more to report.
            self.reported.lock().unwrap_or_else(|p| p.into_inner()).clear();
            self.forget_stream();
            py.detach(|| self.release_adoptions());
            let keep = std::mem::take(&mut *self.tensors.lock().unwrap_or_else(|p| p.into_inner()));
            drop(keep);
        }
        r.map_err(|e| errors::offloader(py, e))
    }

    /// True once `shutdown` completed.
    #[getter]
    fn is_shut_down(&self) -> bool {
        self.off.is_shut_down()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Shuts down (unless already); a shutdown error is raised only when
    /// the block raised nothing.
    #[pyo3(signature = (exc_type = None, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if self.off.is_shut_down() {
            return Ok(false);
        }
        match self.shutdown(py) {
            Err(e) if exc_type.is_none_or(|t| t.is_none()) => Err(e),
            _ => Ok(false),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "kvoffload.Offloader(runtime={:?}, region_bytes={}, rank={}, pin={})",
            self.off.runtime().backend(),
            self.off.region().len(),
            self.off.region().rank(),
            PyPinState::from(&self.off.pin_state()).__repr__()
        )
    }
}

/// The context manager `Offloader.capture_window()` returns.
#[pyclass(name = "CaptureWindow", module = "kvoffload", frozen)]
struct PyCaptureWindow {
    off: Arc<Offloader>,
    guard: Mutex<Option<CaptureWindow>>,
    waited: Mutex<usize>,
}

#[pymethods]
impl PyCaptureWindow {
    fn __enter__(slf: Py<Self>, py: Python<'_>) -> PyResult<Py<Self>> {
        {
            let me = slf.get();
            let off = &me.off;
            let signals = Signals::default();
            let w = signals.result(py, py.detach(|| off.capture_window_interruptible(&|| signals.check())))?;
            *me.waited.lock().unwrap_or_else(|p| p.into_inner()) = w.chunks_waited();
            let old = me.guard.lock().unwrap_or_else(|p| p.into_inner()).replace(w);
            drop(old);
        }
        Ok(slf)
    }

    #[pyo3(signature = (_exc_type = None, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        let w = self.guard.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(w);
        false
    }

    /// True while the window is open.
    #[getter]
    fn is_open(&self) -> bool {
        self.guard.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Chunk registrations that completed while the window waited to open.
    #[getter]
    fn chunks_waited(&self) -> usize {
        *self.waited.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Sends the library's tracing events (pinning progress, agreement,
/// shutdown) to stderr, filtered like RUST_LOG (e.g. `"info"`,
/// `"kvoffload=debug"`). Returns False when a subscriber was already set.
#[pyfunction]
#[pyo3(signature = (filter = "info"))]
fn enable_logging(filter: &str) -> bool {
    let f =
        tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(f).with_writer(std::io::stderr).try_init().is_ok()
}

/// True when the CUDA driver library can be loaded here.
#[pyfunction]
fn cuda_driver_present() -> bool {
    CudaRuntime::driver_present()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRuntime>()?;
    m.add_class::<PyOffloader>()?;
    m.add_class::<PyCaptureWindow>()?;
    m.add_class::<PyPinState>()?;
    m.add_class::<PyPinProgress>()?;
    m.add_class::<PyPinOutcome>()?;
    m.add_class::<PyStoreSubmitted>()?;
    m.add_class::<PyCompletion>()?;
    m.add_function(wrap_pyfunction!(enable_logging, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_driver_present, m)?)?;
    m.add("SETTLED_PINNED", kvoffload::internal::protocol::agreement::SETTLED_PINNED)?;
    m.add("SETTLED_PAGEABLE", kvoffload::internal::protocol::agreement::SETTLED_PAGEABLE)?;
    testing::register(m)?;
    errors::register(m)
}
