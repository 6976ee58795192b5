//! The KV cache as Python describes it (issue 30: Rust's types and field
//! names): `kvoffload.KvSpec`, the engine's tensors and compute stream, and
//! `kvoffload.KvAlloc`, tensors the offloader allocates, given to either
//! constructor as `kv=` ([`kv`]); and the reading of a `KvSpec`'s tensors
//! once the runtime is known ([`parse`]).
//!
//! A tensor is any object with `data_ptr()` (PyTorch: its size from
//! `nbytes`, or `numel() * element_size()`), or with
//! `__cuda_array_interface__` (CuPy, Numba: its size from `shape` and
//! `typestr`), or a bare device address (an int; then the `KvSpec`'s
//! `page_bytes` and `gpu_blocks` must be given). Tensors must be
//! contiguous; block `b` of a tensor is `page_bytes` bytes at
//! `address + b * page_bytes`. The package never imports PyTorch.
//!
//! On the simulated GPU (`host_ok`), CPU tensors are accepted too: each
//! one's storage range (`untyped_storage()`: its `data_ptr()` and
//! `nbytes()`) is returned with it, so that the offloader can adopt every
//! storage once as simulated device memory (vLLM's KV tensors are views of
//! one backing allocation).
//!
//! The two classes are built as the option classes of options.rs are
//! (immutable, by value, `replace`, `OptionsError` naming the field), with
//! its argument checker; `KvSpec`'s differences are written there.

use kvoffload::KvAlloc;
use pyo3::prelude::*;
use pyo3::pyclass::CompareOp;
use pyo3::types::{PyBool, PyDict, PyInt, PyTuple};

use crate::errors;
use crate::options::{arguments, int, opt_int, shown};

/// The engine's tensors as the offloader reads them: `(address, page
/// bytes)` each, and the Python objects to keep alive. `host[i]` is tensor
/// `i`'s storage range `(start, bytes)` when it is a CPU tensor (simulated
/// GPU only; its address is then a host address), None otherwise.
pub struct External {
    pub tensors: Vec<(u64, usize)>,
    pub gpu_blocks: usize,
    pub keep: Vec<Py<PyAny>>,
    pub host: Vec<Option<(u64, usize)>>,
}

/// One tensor: address, bytes (when known), blocks (its first dimension,
/// when known).
struct Seen {
    ptr: u64,
    nbytes: Option<usize>,
    rows: Option<usize>,
    /// A CPU tensor's storage range (start, bytes).
    storage: Option<(u64, usize)>,
}

fn attr_int(o: &Bound<'_, PyAny>, name: &str) -> Option<usize> {
    o.getattr(name).ok().and_then(|v| v.extract::<usize>().ok())
}

fn one(py: Python<'_>, i: usize, t: &Bound<'_, PyAny>, device: usize, host_ok: bool) -> PyResult<Seen> {
    let bad = |why: String| errors::options(py, format!("tensors[{i}]: {why}"));
    if let Ok(ptr) = t.extract::<u64>() {
        return Ok(Seen { ptr, nbytes: None, rows: None, storage: None });
    }
    if t.hasattr("data_ptr")? {
        // PyTorch (and look-alikes).
        let mut storage = None;
        if let Ok(dev) = t.getattr("device") {
            if let Ok(kind) = dev.getattr("type").and_then(|k| k.extract::<String>()) {
                if kind == "cpu" && host_ok {
                    let st = t.call_method0("untyped_storage").map_err(|_| {
                        bad("a CPU tensor without untyped_storage(); its storage range is needed".into())
                    })?;
                    let start = st.call_method0("data_ptr")?.extract::<u64>()?;
                    let len = st.call_method0("nbytes")?.extract::<usize>()?;
                    storage = Some((start, len));
                } else if kind == "cpu" {
                    return Err(bad(
                        "a cpu tensor; the KV cache must be in GPU memory (CPU tensors only on the simulated GPU)"
                            .into(),
                    ));
                } else if kind != "cuda" {
                    return Err(bad(format!("a {kind} tensor; the KV cache must be in GPU memory")));
                }
            }
            if let Ok(Some(index)) = dev.getattr("index").and_then(|k| k.extract::<Option<usize>>()) {
                if index != device {
                    return Err(bad(format!("on cuda:{index}, but the offloader runs on device {device}")));
                }
            }
        }
        if t.hasattr("is_contiguous")? && !t.call_method0("is_contiguous")?.is_truthy()? {
            return Err(bad("not contiguous (pass a contiguous tensor or view)".into()));
        }
        let ptr = t.call_method0("data_ptr")?.extract::<u64>()?;
        let nbytes = attr_int(t, "nbytes").or_else(|| {
            let n = t.call_method0("numel").ok()?.extract::<usize>().ok()?;
            let e = t.call_method0("element_size").ok()?.extract::<usize>().ok()?;
            Some(n * e)
        });
        let rows = t.getattr("shape").ok().and_then(|s| s.get_item(0).ok()).and_then(|d| d.extract::<usize>().ok());
        if let (Some((start, len)), Some(n)) = (storage, nbytes) {
            if ptr < start || (ptr - start) as usize + n > len {
                return Err(bad(format!(
                    "its {n} bytes at {ptr:#x} are not inside its storage ({len} bytes at {start:#x})"
                )));
            }
        }
        return Ok(Seen { ptr, nbytes, rows, storage });
    }
    if let Ok(cai) = t.getattr("__cuda_array_interface__") {
        let cai = cai.cast::<PyDict>().map_err(|_| bad("__cuda_array_interface__ is not a dict".into()))?;
        let data = cai.get_item("data")?.ok_or_else(|| bad("__cuda_array_interface__ has no 'data'".into()))?;
        let data = data.cast::<PyTuple>().map_err(|_| bad("__cuda_array_interface__['data'] is not a tuple".into()))?;
        let ptr = data.get_item(0)?.extract::<u64>()?;
        if data.get_item(1)?.is_truthy()? {
            return Err(bad("read-only (loads write into the KV tensors)".into()));
        }
        let shape: Vec<usize> = cai.get_item("shape")?.ok_or_else(|| bad("no 'shape'".into()))?.extract()?;
        let typestr: String = cai.get_item("typestr")?.ok_or_else(|| bad("no 'typestr'".into()))?.extract()?;
        let item: usize =
            typestr.get(2..).and_then(|s| s.parse().ok()).ok_or_else(|| bad(format!("typestr {typestr:?}")))?;
        if let Some(strides) = cai.get_item("strides")? {
            if !strides.is_none() {
                let strides: Vec<usize> = strides.extract()?;
                let mut want = item;
                for (d, s) in shape.iter().zip(&strides).rev() {
                    if *d > 1 && *s != want {
                        return Err(bad("not C-contiguous".into()));
                    }
                    want *= d;
                }
            }
        }
        let nbytes = shape.iter().product::<usize>() * item;
        return Ok(Seen { ptr, nbytes: Some(nbytes), rows: shape.first().copied(), storage: None });
    }
    Err(bad(format!(
        "{} has neither data_ptr() nor __cuda_array_interface__, and is not a device address",
        t.get_type().name()?
    )))
}

/// Reads a `KvSpec`'s tensors (checked to be a non-empty list of
/// tensor-like objects or addresses when it was built) with its optional
/// `gpu_blocks` and `page_bytes`, on device `device` (`host_ok`: the
/// simulated GPU, which takes CPU tensors).
pub fn parse(
    py: Python<'_>,
    tensors: &[Bound<'_, PyAny>],
    gpu_blocks: Option<usize>,
    page_bytes: Option<usize>,
    device: usize,
    host_ok: bool,
) -> PyResult<External> {
    let mut seen = Vec::new();
    let mut keep = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        seen.push(one(py, i, t, device, host_ok)?);
        keep.push(t.clone().unbind());
    }
    if seen.is_empty() {
        return Err(errors::options(py, "tensors is empty"));
    }
    let blocks = match gpu_blocks.or_else(|| seen.iter().find_map(|s| s.rows)) {
        Some(b) if b > 0 => b,
        _ => return Err(errors::options(py, "give gpu_blocks (no tensor has a shape to take it from)")),
    };
    let mut out = Vec::with_capacity(seen.len());
    for (i, s) in seen.iter().enumerate() {
        let page = match (page_bytes, s.nbytes) {
            (Some(p), Some(n)) if p.checked_mul(blocks).is_none_or(|need| need > n) => {
                return Err(errors::options(
                    py,
                    format!("tensors[{i}]: {blocks} blocks of {p} bytes do not fit in its {n} bytes"),
                ));
            }
            (Some(p), _) => p,
            (None, Some(n)) if n % blocks == 0 && n > 0 => n / blocks,
            (None, Some(n)) => {
                return Err(errors::options(
                    py,
                    format!("tensors[{i}]: its {n} bytes are not {blocks} equal blocks; give page_bytes"),
                ));
            }
            (None, None) => {
                return Err(errors::options(py, format!("tensors[{i}] is a bare address: give page_bytes")))
            }
        };
        out.push((s.ptr, page));
    }
    let host = seen.iter().map(|s| s.storage).collect();
    Ok(External { tensors: out, gpu_blocks: blocks, keep, host })
}

/// The storage ranges `(start, bytes)` merged where they overlap or touch,
/// sorted: each is adopted once.
pub fn merged(ranges: &[(u64, usize)]) -> Vec<(u64, usize)> {
    let mut r: Vec<(u64, u64)> = ranges.iter().map(|&(s, n)| (s, s + n as u64)).collect();
    r.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in r {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out.into_iter().map(|(s, e)| (s, (e - s) as usize)).collect()
}

const KV_SPEC_FIELDS: &[&str] = &["tensors", "gpu_blocks", "page_bytes", "block_factor", "compute_stream"];
const KV_ALLOC_FIELDS: &[&str] = &["tensors", "page_bytes", "gpu_blocks", "block_factor"];

/// `v` as a non-negative int (never a bool) that fits a `usize`.
fn count(py: Python<'_>, class: &str, field: &str, v: &Bound<'_, PyAny>) -> PyResult<usize> {
    int(py, class, field, "an int in [0, 2**64)", v)
}

/// The engine's KV tensors: `kvoffload.KvSpec`, Rust's `KvSpec`. Python's
/// shape: `tensors` are the engine's tensor objects (or bare device
/// addresses), kept alive by the offloader until shutdown; `page_bytes`
/// (one for every tensor; None: each tensor's size over `gpu_blocks`) and
/// `gpu_blocks` (None: the tensors' first dimension) give Rust's
/// `TensorSpec`s once the offloader reads the tensors; `compute_stream` is
/// the stream's raw handle (None: the legacy default stream, or on the
/// simulated GPU a stream of the offloader's own).
///
/// What can be checked without the runtime is checked when the object is
/// built (a list of tensor-like objects or addresses, not empty; the
/// numbers' types; the stream's handle); the rest (each tensor's device,
/// contiguity and size) when the offloader is.
#[pyclass(name = "KvSpec", module = "kvoffload", frozen)]
pub(crate) struct PyKvSpec {
    pub(crate) tensors: Vec<Py<PyAny>>,
    pub(crate) gpu_blocks: Option<usize>,
    pub(crate) page_bytes: Option<usize>,
    pub(crate) block_factor: usize,
    pub(crate) compute_stream: Option<usize>,
}

impl PyKvSpec {
    fn apply(
        base: Option<&PyKvSpec>,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        const C: &str = "KvSpec";
        let mut o = match base {
            Some(b) => PyKvSpec {
                tensors: b.tensors.iter().map(|t| t.clone_ref(py)).collect(),
                gpu_blocks: b.gpu_blocks,
                page_bytes: b.page_bytes,
                block_factor: b.block_factor,
                compute_stream: b.compute_stream,
            },
            None => PyKvSpec {
                tensors: Vec::new(),
                gpu_blocks: None,
                page_bytes: None,
                block_factor: 1,
                compute_stream: None,
            },
        };
        let mut given = base.is_some();
        for (f, v) in arguments(py, C, KV_SPEC_FIELDS, 1, args, kwargs)? {
            match f {
                "tensors" => {
                    o.tensors = tensor_list(py, &v)?;
                    given = true;
                }
                "gpu_blocks" => o.gpu_blocks = opt_int(py, C, f, "an int in [0, 2**64)", &v)?,
                "page_bytes" => o.page_bytes = opt_int(py, C, f, "an int in [0, 2**64)", &v)?,
                "block_factor" => o.block_factor = count(py, C, f, &v)?,
                "compute_stream" => o.compute_stream = stream_handle(py, &v)?,
                _ => unreachable!("KV_SPEC_FIELDS"),
            }
        }
        if !given {
            return Err(errors::options(
                py,
                "KvSpec needs tensors: the engine's KV tensors (kvoffload.KvAlloc(tensors=<count>, ...) lets the \
                 offloader allocate them)",
            ));
        }
        Ok(o)
    }

    /// The tensors as Python objects.
    pub(crate) fn bound<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyAny>> {
        self.tensors.iter().map(|t| t.bind(py).clone()).collect()
    }
}

/// `KvSpec.tensors`: a list of the engine's tensors (objects with
/// `data_ptr()` or `__cuda_array_interface__`) or bare device addresses,
/// not empty.
fn tensor_list(py: Python<'_>, v: &Bound<'_, PyAny>) -> PyResult<Vec<Py<PyAny>>> {
    const WHAT: &str = "KvSpec.tensors must be a list of tensors (one per layer, or K and V each)";
    let tensor_like = |t: &Bound<'_, PyAny>| -> PyResult<bool> {
        Ok(t.hasattr("data_ptr")? || t.hasattr("__cuda_array_interface__")?)
    };
    if v.is_instance_of::<PyInt>() {
        return Err(errors::options(
            py,
            format!(
                "{WHAT}, not {}; for the offloader to allocate them: kv=kvoffload.KvAlloc(tensors=<count>, \
                 page_bytes=..., gpu_blocks=...)",
                shown(v)
            ),
        ));
    }
    if tensor_like(v)? {
        return Err(errors::options(py, format!("{WHAT}, not one tensor")));
    }
    let Ok(items) = v.try_iter() else {
        return Err(errors::options(py, format!("{WHAT}, not {}", shown(v))));
    };
    let mut out = Vec::new();
    for (i, t) in items.enumerate() {
        let t = t?;
        if t.is_instance_of::<PyInt>() && !t.is_instance_of::<PyBool>() {
            if t.extract::<u64>().is_err() {
                return Err(errors::options(
                    py,
                    format!("KvSpec.tensors[{i}]: a device address must be in [0, 2**64), not {}", shown(&t)),
                ));
            }
        } else if !tensor_like(&t)? {
            let ty = t.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
            return Err(errors::options(
                py,
                format!(
                    "KvSpec.tensors[{i}]: {ty} has neither data_ptr() nor __cuda_array_interface__, and is not a \
                     device address"
                ),
            ));
        }
        out.push(t.unbind());
    }
    if out.is_empty() {
        return Err(errors::options(py, "KvSpec.tensors is empty"));
    }
    Ok(out)
}

/// The compute stream's raw handle: None (the default), an int, or an
/// object with `cuda_stream` (a `torch.cuda.Stream`).
fn stream_handle(py: Python<'_>, s: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    if s.is_none() {
        return Ok(None);
    }
    if !s.is_instance_of::<PyBool>() {
        if s.is_instance_of::<PyInt>() {
            if let Ok(v) = s.extract::<usize>() {
                return Ok(Some(v));
            }
        } else if let Ok(v) = s.getattr("cuda_stream").and_then(|v| v.extract::<usize>()) {
            return Ok(Some(v));
        }
    }
    Err(errors::options(
        py,
        format!(
            "KvSpec.compute_stream must be a CUDA stream handle (an int in [0, 2**64)), an object with \
             .cuda_stream (torch.cuda.Stream) or None, not {}",
            shown(s)
        ),
    ))
}

/// Tensor entries compare by value when both are addresses, by identity
/// otherwise (the same tensor objects).
fn same_tensor(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> bool {
    let addr = |t: &Bound<'_, PyAny>| (t.is_instance_of::<PyInt>()).then(|| t.extract::<u64>().ok()).flatten();
    match (addr(a), addr(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a.is(b),
    }
}

#[pymethods]
impl PyKvSpec {
    #[new]
    #[pyo3(signature = (*args, **kwargs))]
    fn new(py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::apply(None, py, args, kwargs)
    }

    /// A copy with the given fields changed (checked as the constructor
    /// checks them).
    #[pyo3(signature = (*args, **kwargs))]
    fn replace(&self, py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::apply(Some(self), py, args, kwargs)
    }

    /// The engine's tensors (or device addresses), as given.
    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyAny>> {
        self.bound(py)
    }

    /// GPU blocks in each tensor (None: the tensors' first dimension).
    #[getter]
    fn gpu_blocks(&self) -> Option<usize> {
        self.gpu_blocks
    }

    /// Bytes of one GPU block of every tensor (None: each tensor's size
    /// over `gpu_blocks`).
    #[getter]
    fn page_bytes(&self) -> Option<usize> {
        self.page_bytes
    }

    /// GPU blocks per host block.
    #[getter]
    fn block_factor(&self) -> usize {
        self.block_factor
    }

    /// The compute stream's raw handle (None: the default).
    #[getter]
    fn compute_stream(&self) -> Option<usize> {
        self.compute_stream
    }

    fn __richcmp__(&self, py: Python<'_>, other: &Bound<'_, PyAny>, op: CompareOp) -> Py<PyAny> {
        let Ok(other) = other.cast::<PyKvSpec>() else { return py.NotImplemented() };
        let o = other.get();
        let same = self.tensors.len() == o.tensors.len()
            && self.tensors.iter().zip(&o.tensors).all(|(a, b)| same_tensor(a.bind(py), b.bind(py)))
            && (self.gpu_blocks, self.page_bytes, self.block_factor, self.compute_stream)
                == (o.gpu_blocks, o.page_bytes, o.block_factor, o.compute_stream);
        let r = match op {
            CompareOp::Eq => same,
            CompareOp::Ne => !same,
            _ => return py.NotImplemented(),
        };
        PyBool::new(py, r).to_owned().into_any().unbind()
    }

    /// Addresses as ints (these read back with `eval`), tensor objects as
    /// `<type at address>` (the tensors themselves cannot be written out).
    fn __repr__(&self, py: Python<'_>) -> String {
        let tensors: Vec<String> = self
            .bound(py)
            .iter()
            .map(|t| match t.is_instance_of::<PyInt>().then(|| t.extract::<u64>().ok()).flatten() {
                Some(a) => a.to_string(),
                None => {
                    let ty = t.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
                    format!("<{ty} at {:#x}>", t.as_ptr() as usize)
                }
            })
            .collect();
        let opt = |v: Option<usize>| v.map_or("None".to_string(), |v| v.to_string());
        format!(
            "kvoffload.KvSpec(tensors=[{}], gpu_blocks={}, page_bytes={}, block_factor={}, compute_stream={})",
            tensors.join(", "),
            opt(self.gpu_blocks),
            opt(self.page_bytes),
            self.block_factor,
            opt(self.compute_stream),
        )
    }
}

/// KV tensors the offloader allocates itself (and frees at shutdown):
/// `kvoffload.KvAlloc`, Rust's `KvAlloc`. `tensors`, `page_bytes` and
/// `gpu_blocks` must be given; `block_factor` defaults to 1. The counts'
/// limits are checked when the offloader is built, before anything is
/// allocated.
#[pyclass(name = "KvAlloc", module = "kvoffload", frozen, eq)]
#[derive(Clone, PartialEq)]
pub(crate) struct PyKvAlloc {
    pub(crate) o: KvAlloc,
}

impl PyKvAlloc {
    fn apply(
        base: Option<KvAlloc>,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        const C: &str = "KvAlloc";
        let (mut tensors, mut page_bytes, mut gpu_blocks) =
            (base.map(|b| b.tensors), base.map(|b| b.page_bytes), base.map(|b| b.gpu_blocks));
        let mut block_factor = base.map_or(1, |b| b.block_factor);
        for (f, v) in arguments(py, C, KV_ALLOC_FIELDS, 0, args, kwargs)? {
            match f {
                "tensors" => tensors = Some(count(py, C, f, &v)?),
                "page_bytes" => page_bytes = Some(count(py, C, f, &v)?),
                "gpu_blocks" => gpu_blocks = Some(count(py, C, f, &v)?),
                "block_factor" => block_factor = count(py, C, f, &v)?,
                _ => unreachable!("KV_ALLOC_FIELDS"),
            }
        }
        match (tensors, page_bytes, gpu_blocks) {
            (Some(tensors), Some(page_bytes), Some(gpu_blocks)) => {
                Ok(PyKvAlloc { o: KvAlloc { tensors, page_bytes, gpu_blocks, block_factor } })
            }
            _ => {
                let missing: Vec<&str> = [("tensors", tensors), ("page_bytes", page_bytes), ("gpu_blocks", gpu_blocks)]
                    .iter()
                    .filter(|(_, v)| v.is_none())
                    .map(|(n, _)| *n)
                    .collect();
                Err(errors::options(
                    py,
                    format!(
                        "KvAlloc needs tensors, page_bytes and gpu_blocks; {} missing (the engine's own tensors: \
                         kvoffload.KvSpec(tensors, ...))",
                        missing.join(", ")
                    ),
                ))
            }
        }
    }
}

#[pymethods]
impl PyKvAlloc {
    #[new]
    #[pyo3(signature = (*args, **kwargs))]
    fn new(py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::apply(None, py, args, kwargs)
    }

    /// A copy with the given fields changed.
    #[pyo3(signature = (*args, **kwargs))]
    fn replace(&self, py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Self::apply(Some(self.o), py, args, kwargs)
    }

    /// Tensors (layers) to allocate.
    #[getter]
    fn tensors(&self) -> usize {
        self.o.tensors
    }

    /// Bytes of one GPU block of each tensor.
    #[getter]
    fn page_bytes(&self) -> usize {
        self.o.page_bytes
    }

    /// GPU blocks in each tensor.
    #[getter]
    fn gpu_blocks(&self) -> usize {
        self.o.gpu_blocks
    }

    /// GPU blocks per host block.
    #[getter]
    fn block_factor(&self) -> usize {
        self.o.block_factor
    }

    fn __repr__(&self) -> String {
        format!(
            "kvoffload.KvAlloc(tensors={}, page_bytes={}, gpu_blocks={}, block_factor={})",
            self.o.tensors, self.o.page_bytes, self.o.gpu_blocks, self.o.block_factor
        )
    }
}

/// What `kv=` gave: the engine's tensors or a count to allocate.
pub(crate) enum Kv<'py> {
    Spec(Bound<'py, PyKvSpec>),
    Alloc(KvAlloc),
}

/// `kv=`: a `KvSpec` or a `KvAlloc` (an `OptionsError` otherwise, or when
/// left out).
pub(crate) fn kv<'py>(py: Python<'py>, class: &str, v: Option<&Bound<'py, PyAny>>) -> PyResult<Kv<'py>> {
    let Some(v) = v.filter(|v| !v.is_none()) else {
        return Err(errors::options(
            py,
            format!(
                "{class} needs kv=: kvoffload.KvSpec(tensors, ...) for the engine's KV tensors, or \
                 kvoffload.KvAlloc(tensors=<count>, page_bytes=..., gpu_blocks=...) to let the offloader allocate \
                 them"
            ),
        ));
    };
    if let Ok(s) = v.cast::<PyKvSpec>() {
        return Ok(Kv::Spec(s.clone()));
    }
    if let Ok(a) = v.cast::<PyKvAlloc>() {
        return Ok(Kv::Alloc(a.get().o));
    }
    Err(errors::options(py, format!("kv must be a kvoffload.KvSpec or a kvoffload.KvAlloc, not {}", shown(v))))
}
