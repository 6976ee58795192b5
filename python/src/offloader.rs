//! `kvoffload._OffloaderBase` (what both classes share), its subclasses
//! `kvoffload.Offloader` (the slot-addressed core) and
//! `kvoffload.KeyedOffloader` (keyed), and `kvoffload.CaptureWindow`.
//!
//! # Lock discipline (the job bookkeeping, issue 28)
//!
//! A completion is always in exactly one of two places: the library's job
//! table (inside `Offloader`, under its lock) until some thread's poll takes
//! it from the engine, then this wrapper's [`Book`] (`book`, book.rs). The move is
//! one critical section of the library's lock: `poll_each` and the waits
//! call the sink ([`PyOffloaderBase::keep`]) under that lock, and the sink takes
//! `book`'s lock inside it. Hence the rules:
//!
//! 1. Order: the library's lock, then `book`. `book` is never held while
//!    calling the library, nor while taking the GIL or any other lock of
//!    this file; it is held for a few instructions only.
//! 2. To learn a job's outcome, ask the library first and `book` after:
//!    once the library says a job is not in flight (`UnknownJob`, or a wait
//!    that returned), the critical section that removed it has ended, so
//!    its completion is already in `book` (asking `book` first is the race
//!    of issue 28, item 2: the completion can move in between).
//! 3. `poll` moves completions from `book.reported` to `book.collected`
//!    under `book`'s lock alone; `collected` keeps the outcomes of the last
//!    [`COLLECTED_KEPT`] jobs `poll` returned, so a `wait` for a job another
//!    thread already collected returns that job's result.
//!
//! The other mutexes of this file (`tensors`, `adopted`, `adoptions`, a
//! window's `guard` and `waited`) each guard one field, are never held two
//! at once, and never across a call that blocks.
//!
//! Every entry point that takes arguments runs inside [`guarded`]: a Rust
//! panic becomes a `KvoffloadError` (kind `"panic"`), never a
//! `PanicException`.

use super::*;
use kvoffload::{ProtocolError, Request};

/// What `kvoffload.Offloader` and `kvoffload.KeyedOffloader` share (the
/// hidden base `kvoffload._OffloaderBase`): the library offloader, the
/// engine's tensors and stream, the job bookkeeping, and every call both
/// have (pinning, capture windows and the hook, `gated`, `poll`, `wait`,
/// `wait_all`, shutdown, the properties). Not constructible itself.
#[pyclass(name = "_OffloaderBase", module = "kvoffload", subclass, frozen)]
pub(crate) struct PyOffloaderBase {
    pub(crate) off: Arc<Front>,
    pub(crate) runtime: Py<PyRuntime>,
    /// The engine's tensors, kept alive until shutdown.
    pub(crate) tensors: Mutex<Vec<Py<PyAny>>>,
    /// The engine's compute stream, adopted (forgotten after shutdown), or
    /// on the simulated GPU a stream made for this offloader (destroyed).
    pub(crate) adopted: Mutex<Option<Stream>>,
    /// On the simulated GPU with CPU tensors: the storage ranges adopted as
    /// device memory, released once the offloader shut down.
    pub(crate) adoptions: Mutex<Vec<DevicePtr>>,
    /// The job bookkeeping (module docs: its lock discipline).
    pub(crate) book: Mutex<Book>,
    /// The gate of the `agreement=` callable, closed once the offloader
    /// shut down (agreement.rs).
    pub(crate) agreement: Option<Arc<Gate>>,
}

impl Drop for PyOffloaderBase {
    fn drop(&mut self) {
        // Shut down with the GIL released (front.rs).
        shut_down_dropped(&self.off, self.agreement.as_ref());
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

impl PyOffloaderBase {
    /// A sink for `Offloader::poll_each` and the waits: into
    /// `book.reported` (called under the library's lock; takes `book`'s
    /// lock inside it and nothing else, no GIL: rule 1).
    pub(crate) fn keep(&self) -> impl FnMut(Completion) + '_ {
        move |c| self.book().reported.push(c)
    }

    pub(crate) fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Job `id`'s outcome from the book, once the library said it is no
    /// longer in flight (rule 2); `r` when the book has none.
    fn outcome_after(&self, py: Python<'_>, id: JobId, r: Result<(), OffloaderError>) -> PyResult<()> {
        let kept = match &r {
            Ok(()) | Err(OffloaderError::UnknownJob { .. }) => self.book().outcome(id),
            Err(_) => None,
        };
        match kept {
            Some(None) => Ok(()),
            Some(Some(error)) => Err(errors::offloader(py, TransferError::JobFailed { id, error }.into())),
            None => r.map_err(|e| errors::offloader(py, e)),
        }
    }

    /// Ends the adoptions of the CPU tensors' storage (simulated GPU; after
    /// shutdown, so no job of this offloader is queued). Each release waits
    /// for the device to be idle. A failure is reported on stderr and the
    /// tensors are then leaked, since the sim may still reach them.
    pub(crate) fn release_adoptions(&self) -> bool {
        let ptrs = std::mem::take(&mut *self.adoptions.lock().unwrap_or_else(|p| p.into_inner()));
        let Some(sim) = self.off.geometry().runtime.as_sim() else { return ptrs.is_empty() };
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
    pub(crate) fn slot_job(
        &self,
        py: Python<'_>,
        lane: Lane,
        job: u64,
        gpu_blocks: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        first_subs: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        guarded(py, || {
            let g = parse_blocks(py, gpu_blocks)?;
            let sizes = parse_ids(py, "a group size", group_sizes)?;
            let s = parse_ids(py, "a host slot id", slots)?;
            let subs = parse_ids(py, "a first_sub", first_subs)?;
            let j = SlotJob::groups(&g, &sizes, &s, &subs);
            let off = self.off.slots();
            py.detach(|| off.submit(JobId(job), lane, &j)).map_err(|e| errors::offloader(py, e))
        })
    }

    fn shutdown_inner(&self, py: Python<'_>) -> PyResult<()> {
        let off = &self.off;
        let signals = Signals::default();
        let r = py.detach(|| off.shutdown(Request::new().interruptible(&|| signals.check()), &mut self.keep()));
        if self.off.is_shut_down() {
            // No thread of kvoffload enters Python for the agreement any
            // more (the callable's own thread may still run it).
            if let Some(g) = &self.agreement {
                py.detach(|| g.close());
            }
            // As the library's `poll` after shutdown: nothing more to report.
            self.book().clear();
            self.forget_stream();
            py.detach(|| self.release_adoptions());
            let keep = std::mem::take(&mut *self.tensors.lock().unwrap_or_else(|p| p.into_inner()));
            drop(keep);
        }
        signals.result(py, r)
    }

    pub(crate) fn forget_stream(&self) {
        if let Some(s) = self.adopted.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = self.off.geometry().runtime.stream_destroy(s);
        }
    }
}

/// The constructors' keyword arguments: pyo3 hands each constructor
/// `host_blocks` and the rest as one dict, read here, once for both
/// classes. A keyword is taken out as it is read; what is left is unknown
/// ([`options::unknown_arguments`]).
pub(crate) struct Keywords<'py>(Bound<'py, PyDict>);

impl<'py> Keywords<'py> {
    /// The keywords as given (a copy: taking does not touch the caller's).
    pub(crate) fn new(py: Python<'py>, kw: Option<&Bound<'py, PyDict>>) -> PyResult<Self> {
        Ok(Self(kw.map_or_else(|| Ok(PyDict::new(py)), |k| k.copy())?))
    }

    /// Keyword `name` as a `T` (None when not given), checked as pyo3
    /// checks a declared argument: a `TypeError` noted "while processing
    /// '`name`'", any other error (an `OverflowError`) as it is.
    pub(crate) fn take<T>(&self, name: &str) -> PyResult<Option<T>>
    where
        T: pyo3::conversion::FromPyObjectOwned<'py>,
    {
        let Some(v) = self.0.get_item(name)? else { return Ok(None) };
        self.0.del_item(name)?;
        v.extract::<T>().map(Some).map_err(|e| {
            let e: PyErr = e.into();
            let _ = e.value(v.py()).call_method1("add_note", (format!("while processing '{name}'"),));
            e
        })
    }

    /// Keyword `name`, any object; None when not given or None.
    fn any(&self, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.take::<Bound<'py, PyAny>>(name)?.filter(|v| !v.is_none()))
    }
}

/// Which class is built, with the argument only it takes.
pub(crate) enum Class {
    /// `kvoffload.Offloader`, the slot-addressed core.
    Slots { kv_groups: Option<Vec<usize>> },
    /// `kvoffload.KeyedOffloader`.
    Keyed { eviction: String },
}

impl PyOffloaderBase {
    /// The constructors' one body: `class` says which library offloader it
    /// builds ([`KeyedOffloader`] or the slot-addressed core [`Offloader`]).
    ///
    /// The keywords both classes take: `kv`, `runtime`, `region`, `pin`,
    /// `transfer`, `agreement` (the ranks' agreement callable, run on a
    /// daemon thread of its own, never bounded by kvoffload; or a
    /// `kvoffload.Pool` joined as this rank's worker: the ranks agree
    /// through their engine entry's words, `OffloaderOptions::agreement_slots`),
    /// `agreement_timeout` (seconds a rank waits for its peers through a
    /// shared region's header or a pool's words; it bounds neither the
    /// callable nor the wait for it; default 120) and `start`; `kw` holds them and whatever else
    /// was given, the class's own argument already taken.
    pub(crate) fn build(py: Python<'_>, class: Class, host_blocks: usize, kw: Keywords<'_>) -> PyResult<Self> {
        let (kv, runtime) = (kw.any("kv")?, kw.take::<Option<Py<PyRuntime>>>("runtime")?.flatten());
        let (region, pin, transfer) = (kw.any("region")?, kw.any("pin")?, kw.any("transfer")?);
        let agreement = kw.any("agreement")?.map(Bound::unbind);
        let agreement_timeout = kw.take::<Option<f64>>("agreement_timeout")?.unwrap_or(Some(120.0));
        let start = kw.take::<bool>("start")?.unwrap_or(false);
        let keyed = matches!(class, Class::Keyed { .. });
        guarded(py, move || {
            options::unknown_arguments(py, keyed, Some(&kw.0))?;
            let kv = tensors::kv(py, if keyed { "KeyedOffloader" } else { "Offloader" }, kv.as_ref())?;
            let region: PyRegionSpec = options::given(py, "region", "RegionSpec", region.as_ref())?;
            let pin: PyPinOptions = options::given(py, "pin", "PinOptions", pin.as_ref())?;
            let transfer: PyTransferOptions = options::given(py, "transfer", "TransferOptions", transfer.as_ref())?;
            let runtime = match runtime {
                Some(r) => r,
                None => Py::new(py, PyRuntime::open(py, "auto", 0)?)?,
            };
            let device = runtime.get().device;
            let mut opts = OffloaderOptions::with_host_blocks(host_blocks);
            match class {
                Class::Slots { kv_groups } => opts.kv_groups = kv_groups,
                Class::Keyed { eviction } => opts.eviction = named(py, "eviction", &eviction)?,
            }
            // Joining or creating a shared region waits for the other ranks:
            // Ctrl-C stops it (see `Signals`).
            let signals = Signals::default();
            opts.region = region.build(&signals);
            opts.pin = pin.o;
            opts.transfer = transfer.o;
            opts.agreement_timeout = seconds(py, "agreement_timeout", agreement_timeout)?;
            let mut gate = None;
            if let Some(f) = agreement {
                if let Ok(pool) = f.bind(py).cast::<super::pool::PyPool>() {
                    // The words of the engine's entry in a node pool (a
                    // persistent region's ranks have none of their own).
                    opts.agreement_slots = Some(pool.get().agreement_slots(py, opts.region.rank())?);
                } else if !f.bind(py).is_callable() {
                    return Err(errors::options(
                        py,
                        "agreement must be a callable, f(mine: int) -> list[int] | int, or a kvoffload.Pool joined \
                         as this rank's worker",
                    ));
                } else {
                    let t = Arc::new(PyTransport::new(py, f)?);
                    gate = Some(t.gate.clone());
                    opts.agreement = Some(t);
                }
            }

            let rt_ref = runtime.get();
            let rt = rt_ref.rt.clone();
            let on_sim = rt.as_sim().is_some();
            // A KvSpec's tensors are read here, with the runtime known.
            let kv = match kv {
                tensors::Kv::Alloc(alloc) => Err(alloc),
                tensors::Kv::Spec(spec) => {
                    let spec = spec.get();
                    let parsed = tensors::parse(py, &spec.bound(py), spec.gpu_blocks, spec.page_bytes, device, on_sim)?;
                    Ok((parsed, spec.block_factor, spec.compute_stream))
                }
            };
            let mut adoptions: Vec<DevicePtr> = Vec::new();
            let (off, keep, adopted) = match kv {
                Err(alloc) => {
                    let off = py.detach(|| match keyed {
                        true => KeyedOffloader::with_allocated_tensors(rt, alloc, opts).map(Front::Keyed),
                        false => Offloader::with_allocated_tensors(rt, alloc, opts).map(Front::Slots),
                    });
                    (off, Vec::new(), None)
                }
                Ok((tensors::External { tensors: ts, gpu_blocks, keep, host }, block_factor, stream)) if on_sim => {
                    let sim = rt.as_sim().expect("on_sim");
                    if let Some(i) = host.iter().position(|h| h.is_none()) {
                        return Err(errors::options(
                            py,
                            format!(
                            "tensors[{i}] is not a CPU tensor: the simulated GPU takes CPU tensors (adopted as its \
                             device memory) and cannot reach other memory; an engine's GPU tensors need the CUDA \
                             backend, or give kv=kvoffload.KvAlloc(...) to let the offloader allocate its own"
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
                                return Err(errors::driver(
                                    py,
                                    "adopting the CPU tensors as simulated device memory",
                                    e,
                                ));
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
                        Some(raw) => match sim.stream_by_raw(raw as u64) {
                            Some(s) => (s, false),
                            None => {
                                release(&adoptions);
                                return Err(errors::options(py, format!("no stream {raw} on this simulated GPU")));
                            }
                        },
                    };
                    let kv = KvSpec {
                        tensors: ts
                            .iter()
                            .map(|&(p, b)| TensorSpec { device_base: device_of(p), page_bytes: b })
                            .collect(),
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
                    let off = py.detach(|| match keyed {
                        true => unsafe { KeyedOffloader::new(rt2, kv, opts) }.map(Front::Keyed),
                        false => unsafe { Offloader::new(rt2, kv, opts) }.map(Front::Slots),
                    });
                    if off.is_err() {
                        release(&adoptions);
                        adoptions.clear();
                        if own {
                            let _ = sim.stream_destroy(s);
                        }
                    }
                    (off, keep, own.then_some(s))
                }
                Ok((tensors::External { tensors: ts, gpu_blocks, keep, .. }, block_factor, stream)) => {
                    let Some(cuda) = rt_ref.cuda.clone() else {
                        return Err(errors::options(
                            py,
                            "an engine's tensors need the CUDA backend (the simulated GPU cannot reach them); \
                         give kv=kvoffload.KvAlloc(...) to let the offloader allocate its own",
                        ));
                    };
                    let raw = stream.unwrap_or(0);
                    // SAFETY: `raw` is the engine's stream of this device's
                    // primary context (the caller's word, as for the tensors);
                    // it is forgotten again after the offloader shut down.
                    let s = unsafe { cuda.adopt_stream(raw) };
                    let kv = KvSpec {
                        tensors: ts
                            .iter()
                            .map(|&(p, b)| TensorSpec { device_base: DevicePtr(p), page_bytes: b })
                            .collect(),
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
                    let off = py.detach(|| match keyed {
                        true => unsafe { KeyedOffloader::new(rt, kv, opts) }.map(Front::Keyed),
                        false => unsafe { Offloader::new(rt, kv, opts) }.map(Front::Slots),
                    });
                    if off.is_err() {
                        let _ = cuda.stream_destroy(s);
                    }
                    (off, keep, Some(s))
                }
            };
            let off = Arc::new(signals.result(py, off)?);
            let me = PyOffloaderBase {
                off,
                runtime,
                tensors: Mutex::new(keep),
                adopted: Mutex::new(adopted),
                adoptions: Mutex::new(adoptions),
                book: Mutex::new(Book::default()),
                agreement: gate,
            };
            if start {
                me.off.start().map_err(|e| errors::offloader(py, e))?;
            }
            Ok(me)
        })
    }
}

#[pymethods]
impl PyOffloaderBase {
    /// The runtime (GPU) this offloader runs on.
    #[getter]
    pub(crate) fn runtime(&self, py: Python<'_>) -> Py<PyRuntime> {
        self.runtime.clone_ref(py)
    }

    /// Device addresses of the KV tensors.
    #[getter]
    pub(crate) fn tensor_addresses(&self) -> Vec<u64> {
        self.off.geometry().tensors().into_iter().map(DevicePtr::raw).collect()
    }

    /// Bytes of one GPU block of each tensor.
    #[getter]
    pub(crate) fn page_bytes(&self) -> Vec<usize> {
        self.off.geometry().kv.tensors.iter().map(|t| t.page_bytes).collect()
    }

    /// GPU blocks in each tensor.
    #[getter]
    pub(crate) fn gpu_blocks(&self) -> usize {
        self.off.geometry().kv.gpu_blocks
    }

    /// GPU blocks per key.
    #[getter]
    pub(crate) fn block_factor(&self) -> usize {
        self.off.geometry().kv.block_factor
    }

    /// Bytes of the host region (every rank's part).
    #[getter]
    pub(crate) fn region_bytes(&self) -> usize {
        self.off.geometry().region.len()
    }

    /// Starts background pinning (idempotent; ShutDownError after shutdown).
    pub(crate) fn start(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || {
            let off = &self.off;
            if off.is_shut_down() {
                return Err(errors::offloader(py, kvoffload::OffloaderError::ShutDown));
            }
            py.detach(|| off.start()).map_err(|e| errors::offloader(py, e))
        })
    }

    /// Pinning now: its state (`PinProgress.state`, a `PinState`) and how
    /// far it got (the library's `pin_progress`).
    #[getter]
    pub(crate) fn pin_progress(&self, py: Python<'_>) -> PyResult<PyPinProgress> {
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
    pub(crate) fn wait_pinned(&self, py: Python<'_>) -> PyResult<PyPinOutcome> {
        guarded(py, || {
            if self.agreement.as_ref().is_some_and(|g| g.on_caller_thread()) {
                // Pinning ends only once the callable returned.
                let what = "waiting for pinning inside the agreement callable";
                return Err(errors::offloader(py, ProtocolError::WouldDeadlock { what }.into()));
            }
            let off = &self.off;
            let signals = Signals::default();
            let out: PinOutcome =
                signals.result(py, py.detach(|| off.wait_pinned(Request::new().interruptible(&|| signals.check()))))?;
            let (agreed, agreement_error) = match &out.agreement {
                None => (None, None),
                Some(Ok(())) => (Some(true), None),
                Some(Err(e)) => (Some(false), Some(errors::agreement(py, e).into_value(py).into_any())),
            };
            Ok(PyPinOutcome { state: Py::new(py, PyPinState::from(&out.state))?, agreed, agreement_error })
        })
    }

    /// Holds pinning back while the returned `PinHold` is held (taken at
    /// once; `release()` or leaving its `with` block ends it): no chunk
    /// registration starts meanwhile, so an engine's capture phase (many
    /// graphs captured back to back) never waits for one. The registration
    /// in flight, if any, completes; pre-faulting goes on. Holds nest;
    /// shutdown is never held up; `wait_pinned` on the thread that holds
    /// one raises `WouldDeadlockError`.
    pub(crate) fn hold_pinning(&self) -> PyPinHold {
        PyPinHold { hold: Mutex::new(Some(self.off.hold_pinning())) }
    }

    /// A capture window, as a context manager: `with off.capture_window():
    /// capture graphs here`. No library thread makes a capture-unsafe
    /// driver call while it is open; with the default policy it opens only
    /// once pinning is final (entering waits, GIL released; Ctrl-C stops
    /// the wait with KeyboardInterrupt, the window not opened).
    pub(crate) fn capture_window(&self) -> PyCaptureWindow {
        PyCaptureWindow {
            off: self.off.clone(),
            agreement: self.agreement.clone(),
            guard: Mutex::new(None),
            waited: Mutex::new(0),
        }
    }

    /// The capture hook's begin (for a wrapper of a framework's capture
    /// begin, called before it, on the capturing thread): opens this
    /// thread's hook window (depth 0 -> 1; deeper begins only count). It
    /// waits, GIL released, at most for the library call in flight (one
    /// chunk's registration), never for pinning to finish. While a hook
    /// window is open, jobs submitted on any thread are deferred and
    /// submitted when the last one closes.
    ///
    /// Ctrl-C stops the wait (KeyboardInterrupt, nothing opened, depth
    /// unchanged); a signal that arrives as the window opens closes it again
    /// before KeyboardInterrupt is raised, so the call either returns with
    /// the window open or raises with it closed.
    pub(crate) fn capture_begin(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || {
            let off = &self.off;
            let signals = Signals::default();
            let depth = off.capture_hook().depth();
            signals.result(
                py,
                py.detach(|| off.capture_hook().begin(Request::new().interruptible(&|| signals.check()))),
            )?;
            if let Err(e) = py.check_signals() {
                // Opened (or counted) just as Ctrl-C came: undo this begin.
                // The window closes at once; a job deferred meanwhile that
                // an engine window refuses is not waited for (the check
                // says stop: at most one 50 ms slice) but left deferred,
                // for the next poll, wait or submission.
                let _ = py.detach(|| {
                    let (hook, stop) = (off.capture_hook(), Request::new().interruptible(&|| true));
                    if depth == 0 {
                        hook.abort(stop)
                    } else {
                        hook.end(stop)
                    }
                });
                return Err(e);
            }
            Ok(())
        })
    }

    /// The capture hook's end (after the framework's capture end, also
    /// when it failed): depth n -> n - 1; at 0 the window closes and the
    /// deferred jobs are submitted, in order, on this thread, GIL released
    /// (a job refused for another thread's `capture_window` waits for it).
    /// ProtocolError (kind `"hook_not_open"`) at depth 0.
    ///
    /// Ctrl-C stops that wait (KeyboardInterrupt): the window is closed
    /// all the same (depth decremented) and the jobs not yet submitted stay
    /// deferred, in order, submitted by the next `poll`, wait, submission,
    /// `capture_end` or `shutdown`.
    pub(crate) fn capture_end(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || {
            let off = &self.off;
            let signals = Signals::default();
            signals.result(py, py.detach(|| off.capture_hook().end(Request::new().interruptible(&|| signals.check()))))
        })
    }

    /// What `capture_end` does, for a capture whose framework begin failed
    /// after `capture_begin` succeeded (Ctrl-C as there).
    pub(crate) fn capture_abort(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || {
            let off = &self.off;
            let signals = Signals::default();
            signals
                .result(py, py.detach(|| off.capture_hook().abort(Request::new().interruptible(&|| signals.check()))))
        })
    }

    /// This thread's hook depth: `capture_begin`s not yet ended.
    #[getter]
    pub(crate) fn capture_depth(&self) -> usize {
        self.off.capture_hook().depth()
    }

    /// Jobs deferred behind a hook window and not yet submitted.
    #[getter]
    pub(crate) fn deferred_jobs(&self) -> usize {
        self.off.capture_hook().deferred_jobs()
    }

    /// Runs `f()` (the engine's own capture-unsafe calls, e.g.
    /// `torch.cuda.synchronize`) at a moment no capture window is open;
    /// windows wait for it. Returns what `f` returns.
    ///
    /// Ctrl-C stops the wait for windows to close (KeyboardInterrupt, `f`
    /// not run); inside `f`, opening a capture window (`capture_window`,
    /// `capture_begin`) or a nested `gated` raises ProtocolError (reason
    /// `"would_deadlock"`): it would wait for this call.
    pub(crate) fn gated(&self, py: Python<'_>, f: Py<PyAny>) -> PyResult<Py<PyAny>> {
        guarded(py, || {
            let off = &self.off;
            let signals = Signals::default();
            let r = py.detach(|| {
                off.gated("the engine's own call", Request::new().interruptible(&|| signals.check()), |_| {
                    Python::attach(|py| f.call0(py))
                })
            });
            signals.result(py, r)?
        })
    }

    /// Host blocks of this rank (an `Offloader`'s slot ids are
    /// `0..host_blocks`).
    #[getter]
    pub(crate) fn host_blocks(&self) -> usize {
        self.off.geometry().host_blocks
    }

    /// Jobs finished since the last call, each reported once, in
    /// submission order per direction, already applied to the block
    /// manager. Never blocks on the GPU.
    pub(crate) fn poll(&self, py: Python<'_>) -> PyResult<Vec<PyCompletion>> {
        guarded(py, || {
            let out = py.detach(|| {
                self.off.poll_each(&mut self.keep());
                self.book().take()
            });
            out.into_iter().map(|c| completion(py, c)).collect()
        })
    }

    /// Blocks until job `job` completed on the GPU (it is still reported by
    /// `poll`), and returns its outcome (TransferError `job_failed` when it
    /// failed), also when another thread's wait or poll took its completion
    /// (module docs, rules 2 and 3). Ctrl-C stops the wait
    /// (KeyboardInterrupt; the job goes on).
    pub(crate) fn wait(&self, py: Python<'_>, job: u64) -> PyResult<()> {
        guarded(py, || {
            let id = JobId(job);
            let off = &self.off;
            let signals = Signals::default();
            let r = py.detach(|| off.wait(id, Request::new().interruptible(&|| signals.check()), &mut self.keep()));
            if let Some(e) = signals.raised.lock().unwrap_or_else(|p| p.into_inner()).take() {
                return Err(e);
            }
            self.outcome_after(py, id, r)
        })
    }

    /// Blocks until every job submitted so far completed on the GPU.
    /// Ctrl-C stops the wait (KeyboardInterrupt; the jobs go on).
    pub(crate) fn wait_all(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || {
            let off = &self.off;
            let signals = Signals::default();
            let r = py.detach(|| off.wait_all(Request::new().interruptible(&|| signals.check()), &mut self.keep()));
            signals.result(py, r)
        })
    }

    /// Jobs submitted and not yet reported by `poll` (those a wait already
    /// took from the engine included).
    #[getter]
    pub(crate) fn in_flight(&self) -> usize {
        // The library's count first: a job moving into `reported` between
        // the two reads is counted twice for a moment, never missed.
        let engine = self.off.in_flight();
        engine + self.book().reported.len()
    }

    /// Shuts down: refused (ProtocolError) while a capture window is open;
    /// drains the jobs, stops pinning, unregisters, frees what the
    /// offloader allocated, and lets go of the engine's tensors and stream.
    /// A second call raises ShutDownError. Ctrl-C stops the wait for the
    /// jobs in flight (KeyboardInterrupt; nothing shut down, the jobs go
    /// on); past that the rest is bounded (a chunk's registration, the
    /// driver's frees).
    pub(crate) fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || self.shutdown_inner(py))
    }

    /// True once `shutdown` completed.
    #[getter]
    pub(crate) fn is_shut_down(&self) -> bool {
        self.off.is_shut_down()
    }

    pub(crate) fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Shuts down (unless already); a shutdown error is raised only when
    /// the block raised nothing.
    #[pyo3(signature = (exc_type = None, _exc = None, _tb = None))]
    pub(crate) fn __exit__(
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

    pub(crate) fn __repr__(&self) -> String {
        format!(
            "kvoffload.{}(runtime={:?}, region_bytes={}, rank={}, pin={})",
            match &*self.off {
                Front::Keyed(_) => "KeyedOffloader",
                Front::Slots(_) => "Offloader",
            },
            self.off.geometry().runtime.backend(),
            self.off.geometry().region.len(),
            self.off.geometry().region.rank(),
            PyPinState::from(&self.off.pin_progress().state).__repr__()
        )
    }
}

/// The context manager `Offloader.capture_window()` returns.
#[pyclass(name = "CaptureWindow", module = "kvoffload", frozen)]
pub(crate) struct PyCaptureWindow {
    pub(crate) off: Arc<Front>,
    pub(crate) agreement: Option<Arc<Gate>>,
    pub(crate) guard: Mutex<Option<CaptureWindow>>,
    pub(crate) waited: Mutex<usize>,
}

/// A window left open (its `with` block never ended, or another thread
/// entered it) closes when the object goes, before the offloader it may
/// hold the last reference to: that offloader's drop shuts it down, which
/// would otherwise wait for this very window (its transfer engine's
/// release waits for windows to close) and never return (issue 43,
/// item 4). As the last holder, it shuts the offloader down with the GIL
/// released, as `_OffloaderBase`'s drop does.
impl Drop for PyCaptureWindow {
    fn drop(&mut self) {
        let w = self.guard.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        drop(w);
        if Arc::strong_count(&self.off) == 1 {
            shut_down_dropped(&self.off, self.agreement.as_ref());
        }
    }
}

#[pymethods]
impl PyCaptureWindow {
    /// Opens the window (waiting, GIL released; Ctrl-C stops the wait with
    /// KeyboardInterrupt, nothing opened). A signal that arrives as the
    /// window opens closes it again before KeyboardInterrupt is raised (as
    /// `capture_begin`), so `__enter__` either returns with the window open
    /// or raises with it closed: raised before the `with` body, no
    /// `__exit__` would close it.
    pub(crate) fn __enter__(slf: Py<Self>, py: Python<'_>) -> PyResult<Py<Self>> {
        {
            let me = slf.get();
            let off = &me.off;
            let signals = Signals::default();
            let w = signals
                .result(py, py.detach(|| off.capture_window(Request::new().interruptible(&|| signals.check()))))?;
            if let Err(e) = py.check_signals() {
                // Opened just as Ctrl-C came: close it again.
                drop(w);
                return Err(e);
            }
            *me.waited.lock().unwrap_or_else(|p| p.into_inner()) = w.chunks_waited();
            let old = me.guard.lock().unwrap_or_else(|p| p.into_inner()).replace(w);
            drop(old);
        }
        Ok(slf)
    }

    #[pyo3(signature = (_exc_type = None, _exc = None, _tb = None))]
    pub(crate) fn __exit__(
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
    pub(crate) fn is_open(&self) -> bool {
        self.guard.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Chunk registrations that completed while the window waited to open.
    #[getter]
    pub(crate) fn chunks_waited(&self) -> usize {
        *self.waited.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What `Offloader.hold_pinning()` returns: pinning is held back until
/// `release()` (idempotent), the end of its `with` block, or its garbage
/// collection.
#[pyclass(name = "PinHold", module = "kvoffload", frozen)]
pub(crate) struct PyPinHold {
    pub(crate) hold: Mutex<Option<PinHold>>,
}

#[pymethods]
impl PyPinHold {
    /// Lets pinning go on (idempotent).
    pub(crate) fn release(&self) {
        let h = self.hold.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(h);
    }

    /// True until released.
    #[getter]
    pub(crate) fn is_held(&self) -> bool {
        self.hold.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    pub(crate) fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (_exc_type = None, _exc = None, _tb = None))]
    pub(crate) fn __exit__(
        &self,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.release();
        false
    }

    pub(crate) fn __repr__(&self) -> String {
        format!("PinHold({})", if self.is_held() { "held" } else { "released" })
    }
}

/// `kvoffload.Offloader`: the slot-addressed core (the library's
/// `Offloader`). The engine picks host slots `0..host_blocks` and job ids;
/// its jobs are the slot jobs below (the library's `submit` with a
/// `SlotJob` on a `Lane`), waited for by `wait_jobs` as well as the
/// common waits.
#[pyclass(name = "Offloader", module = "kvoffload", extends = PyOffloaderBase, frozen)]
pub(crate) struct PyOffloader {}

#[pymethods]
impl PyOffloader {
    /// `Offloader(host_blocks, *, kv, ...)`: the slot-addressed core over
    /// `kv` (`KvSpec` or `KvAlloc`), with `kv_groups` (its own argument)
    /// and the keywords both classes take ([`PyOffloaderBase::build`]).
    #[new]
    #[pyo3(
        signature = (host_blocks, **kw),
        text_signature = "(host_blocks, *, kv=None, runtime=None, region=None, pin=None, transfer=None, \
                          agreement=None, agreement_timeout=120.0, kv_groups=None, start=False, **unknown)"
    )]
    pub(crate) fn new<'py>(
        py: Python<'py>,
        host_blocks: usize,
        kw: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let kw = Keywords::new(py, kw)?;
        let kv_groups = kw.take::<Option<Vec<usize>>>("kv_groups")?.flatten();
        let base = PyOffloaderBase::build(py, Class::Slots { kv_groups }, host_blocks, kw)?;
        Ok(PyClassInitializer::from(base).add_subclass(Self {}))
    }

    /// Stores GPU blocks `gpu_blocks` into host slots `slots` as job `job`
    /// (the engine's id, never used before):
    /// GPU block `i` goes to sub-block `(first_sub + i) % block_factor` of
    /// slot `slots[(first_sub + i) // block_factor]`. The engine must not
    /// write those blocks until `poll` reports the job.
    #[pyo3(signature = (job, gpu_blocks, slots, first_sub = 0))]
    pub(crate) fn store_slots(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        job: u64,
        gpu_blocks: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        first_sub: usize,
    ) -> PyResult<()> {
        guarded(py, || {
            let (g, s) = (parse_blocks(py, gpu_blocks)?, parse_ids(py, "a host slot id", slots)?);
            let off = slf.as_super().get().off.slots();
            py.detach(|| off.submit(JobId(job), Lane::Store, &SlotJob::single(&g, &s, first_sub)))
                .map_err(|e| errors::offloader(py, e))
        })
    }

    /// Loads host slots `slots` into GPU blocks `gpu_blocks` as job `job`,
    /// placed as `store_slots` placed them. The engine must not touch those
    /// blocks until `poll` reports the job. `expedited`: on the expedited
    /// lane's own stream, never behind a regular load (needs
    /// `expedited_lane=True`; TransferError, reason `"no_expedited_lane"`,
    /// otherwise).
    #[pyo3(signature = (job, gpu_blocks, slots, first_sub = 0, *, expedited = false))]
    pub(crate) fn load_slots(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        job: u64,
        gpu_blocks: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        first_sub: usize,
        expedited: bool,
    ) -> PyResult<()> {
        guarded(py, || {
            let (g, s) = (parse_blocks(py, gpu_blocks)?, parse_ids(py, "a host slot id", slots)?);
            let lane = if expedited { Lane::LoadExpedited } else { Lane::Load };
            let off = slf.as_super().get().off.slots();
            py.detach(|| off.submit(JobId(job), lane, &SlotJob::single(&g, &s, first_sub)))
                .map_err(|e| errors::offloader(py, e))
        })
    }

    /// `store_slots` over every KV cache group (`kv_groups`), in vLLM's
    /// shape: `gpu_blocks` and `slots` group after group, `group_sizes`
    /// and `first_subs` one per group.
    pub(crate) fn store_slot_job(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        job: u64,
        gpu_blocks: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        first_subs: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        slf.as_super().get().slot_job(py, Lane::Store, job, gpu_blocks, group_sizes, slots, first_subs)
    }

    /// `load_slots` over every KV cache group, as `store_slot_job` stored
    /// them (`expedited` as for `load_slots`).
    #[pyo3(signature = (job, gpu_blocks, group_sizes, slots, first_subs, *, expedited = false))]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load_slot_job(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        job: u64,
        gpu_blocks: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        first_subs: &Bound<'_, PyAny>,
        expedited: bool,
    ) -> PyResult<()> {
        let lane = if expedited { Lane::LoadExpedited } else { Lane::Load };
        slf.as_super().get().slot_job(py, lane, job, gpu_blocks, group_sizes, slots, first_subs)
    }

    /// Blocks, GIL released, until each of `jobs` that is in flight
    /// completed on the GPU; ids never submitted or already reported are
    /// skipped, failures are reported by `poll` (vLLM's `wait`). Ctrl-C
    /// stops the wait (KeyboardInterrupt; the jobs go on).
    pub(crate) fn wait_jobs(slf: &Bound<'_, Self>, py: Python<'_>, jobs: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(py, || {
            let ids: Vec<JobId> = parse_ids(py, "a job id", jobs)?.into_iter().map(|j| JobId(j as u64)).collect();
            let base = slf.as_super().get();
            let off = base.off.slots();
            let signals = Signals::default();
            let r =
                py.detach(|| off.wait_jobs(&ids, Request::new().interruptible(&|| signals.check()), &mut base.keep()));
            signals.result(py, r)
        })
    }
}

/// `kvoffload.KeyedOffloader`: the library's `KeyedOffloader`, a block
/// manager over the core that places the engine's keys in host blocks
/// (`lookup`, `store`, `load`, `stored_blocks`). It takes no `kv_groups`
/// (its jobs have one group); `eviction` is its own.
#[pyclass(name = "KeyedOffloader", module = "kvoffload", extends = PyOffloaderBase, frozen)]
pub(crate) struct PyKeyedOffloader {}

impl PyKeyedOffloader {
    /// The keyed offloader this object was built with.
    fn keyed<'a>(slf: &'a Bound<'_, Self>) -> &'a KeyedOffloader {
        slf.as_super().get().off.keyed()
    }
}

#[pymethods]
impl PyKeyedOffloader {
    /// `KeyedOffloader(host_blocks, *, kv, ...)`: the keyed offloader over
    /// `kv`, with `eviction` (its own argument) and the keywords both
    /// classes take ([`PyOffloaderBase::build`]).
    #[new]
    #[pyo3(
        signature = (host_blocks, **kw),
        text_signature = "(host_blocks, *, kv=None, runtime=None, region=None, pin=None, transfer=None, \
                          eviction='lru', agreement=None, agreement_timeout=120.0, start=False, **unknown)"
    )]
    pub(crate) fn new<'py>(
        py: Python<'py>,
        host_blocks: usize,
        kw: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let kw = Keywords::new(py, kw)?;
        let eviction = kw.take::<String>("eviction")?.unwrap_or_else(|| "lru".to_string());
        let base = PyOffloaderBase::build(py, Class::Keyed { eviction }, host_blocks, kw)?;
        Ok(PyClassInitializer::from(base).add_subclass(Self {}))
    }

    /// What the offloader holds of each key: `"hit"`, `"miss"` or
    /// `"hit_pending"` (stored, store not yet complete), the library's
    /// `Lookup` variants.
    pub(crate) fn lookup(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<&'static str>> {
        guarded(py, || {
            let off = Self::keyed(slf);
            let keys = parse_keys(py, keys)?;
            Ok(py.detach(|| off.lookup(&keys)).into_iter().map(|l| l.name()).collect())
        })
    }

    /// Stores `keys` from GPU blocks `gpu_blocks` (`block_factor` per key,
    /// in key order). The engine must not write those blocks until `poll`
    /// reports the job (or `wait` returns for it).
    pub(crate) fn store(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        gpu_blocks: &Bound<'_, PyAny>,
    ) -> PyResult<PyStoreSubmitted> {
        guarded(py, || {
            let (keys, blocks) = (parse_keys(py, keys)?, parse_blocks(py, gpu_blocks)?);
            let off = Self::keyed(slf);
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
        })
    }

    /// Loads `keys` (each stored and readable) into GPU blocks
    /// `gpu_blocks`; returns the job id. The engine must not touch those
    /// blocks until the job is reported.
    pub(crate) fn load(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        gpu_blocks: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        guarded(py, || {
            let (keys, blocks) = (parse_keys(py, keys)?, parse_blocks(py, gpu_blocks)?);
            let off = Self::keyed(slf);
            py.detach(|| off.load(&keys, &blocks)).map(|j| j.0).map_err(|e| errors::offloader(py, e))
        })
    }

    /// Keys stored and readable now.
    #[getter]
    pub(crate) fn stored_blocks(slf: &Bound<'_, Self>) -> usize {
        Self::keyed(slf).stored_blocks()
    }
}
