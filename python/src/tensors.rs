//! The engine's KV tensors, as Python gives them (a `kvoffload.KvSpec`'s
//! `tensors`, read when the offloader is built).
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

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors;

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
