//! The small result classes (`PinState`, `PinProgress`, `PinOutcome`,
//! `StoreSubmitted`, `Completion`) and the conversions into them.

use super::*;

pub(crate) fn key_out(py: Python<'_>, k: BlockKey) -> PyResult<Bound<'_, PyTuple>> {
    PyTuple::new(py, [k.hash.into_pyobject(py)?.into_any(), k.group.into_pyobject(py)?.into_any()])
}

pub(crate) fn keys_out<'py>(py: Python<'py>, keys: &[BlockKey]) -> PyResult<Vec<Bound<'py, PyTuple>>> {
    keys.iter().map(|k| key_out(py, *k)).collect()
}

/// A pin state: `name` is `"pending"`, `"pinning"`, `"pinned"` or
/// `"pageable"`; `reason` says why a pageable region is (e.g.
/// `"not_supported"`, `"peer_pageable"`), `message` in words.
#[pyclass(name = "PinState", module = "kvoffload", frozen, get_all)]
pub(crate) struct PyPinState {
    pub(crate) name: &'static str,
    pub(crate) done: Option<usize>,
    pub(crate) total: Option<usize>,
    pub(crate) reason: Option<String>,
    pub(crate) message: Option<String>,
}

impl PyPinState {
    pub(crate) fn from(s: &PinState) -> Self {
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
    pub(crate) fn is_final(&self) -> bool {
        matches!(self.name, "pinned" | "pageable")
    }

    pub(crate) fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
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

    pub(crate) fn __hash__(&self) -> u64 {
        self.name.len() as u64
    }

    pub(crate) fn __str__(&self) -> String {
        self.name.to_string()
    }

    pub(crate) fn __repr__(&self) -> String {
        match (self.name, &self.reason, self.done) {
            ("pageable", Some(r), _) => format!("PinState('pageable', reason={r:?})"),
            ("pinning", _, Some(d)) => format!("PinState('pinning', {d}/{})", self.total.unwrap_or(0)),
            (n, _, _) => format!("PinState({n:?})"),
        }
    }
}

/// Pinning progress.
#[pyclass(name = "PinProgress", module = "kvoffload", frozen, get_all)]
pub(crate) struct PyPinProgress {
    pub(crate) state: Py<PyPinState>,
    pub(crate) chunks_done: usize,
    pub(crate) chunks_total: usize,
    pub(crate) bytes_total: usize,
}

#[pymethods]
impl PyPinProgress {
    pub(crate) fn __repr__(&self) -> String {
        format!("PinProgress({}/{} chunks, {} bytes)", self.chunks_done, self.chunks_total, self.bytes_total)
    }
}

/// How pinning ended: the final `state`, and `agreement_error` (an
/// `AgreementError`, not raised) when ranks had to agree and could not
/// (this rank then runs on pageable memory).
#[pyclass(name = "PinOutcome", module = "kvoffload", frozen, get_all)]
pub(crate) struct PyPinOutcome {
    pub(crate) state: Py<PyPinState>,
    pub(crate) agreed: Option<bool>,
    pub(crate) agreement_error: Option<Py<PyAny>>,
}

#[pymethods]
impl PyPinOutcome {
    pub(crate) fn __repr__(&self, py: Python<'_>) -> String {
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
pub(crate) struct PyStoreSubmitted {
    pub(crate) job: Option<u64>,
    pub(crate) stored: Py<PyAny>,
    pub(crate) skipped: Py<PyAny>,
    pub(crate) evicted: Py<PyAny>,
}

#[pymethods]
impl PyStoreSubmitted {
    pub(crate) fn __repr__(&self, py: Python<'_>) -> String {
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
/// behind a capture hook window (0 when not deferred); `device_seconds`
/// the device time of its copies by CUDA's event timer (None when it could
/// not be timed), what a rate is computed from; `lane` is the
/// handler that ran it: `"store"`, `"load"` or `"load_expedited"` (an
/// expedited load on its own stream, `TransferOptions(expedited_lane=True)`); `error` is
/// None when every byte arrived, else a `DriverError` (not raised).
#[pyclass(name = "Completion", module = "kvoffload", frozen, get_all)]
pub(crate) struct PyCompletion {
    pub(crate) job: u64,
    pub(crate) direction: &'static str,
    pub(crate) lane: &'static str,
    pub(crate) keys: Py<PyAny>,
    pub(crate) bytes: u64,
    pub(crate) seconds: f64,
    pub(crate) deferred_seconds: f64,
    pub(crate) device_seconds: Option<f64>,
    pub(crate) backend: &'static str,
    pub(crate) error: Option<Py<PyAny>>,
}

#[pymethods]
impl PyCompletion {
    /// True when the job moved every byte.
    #[getter]
    pub(crate) fn ok(&self) -> bool {
        self.error.is_none()
    }

    pub(crate) fn __repr__(&self) -> String {
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

pub(crate) fn completion(py: Python<'_>, c: Completion) -> PyResult<PyCompletion> {
    Ok(PyCompletion {
        job: c.job.0,
        direction: c.direction.name(),
        lane: c.lane.name(),
        keys: keys_out(py, &c.keys)?.into_pyobject(py)?.into_any().unbind(),
        bytes: c.bytes,
        seconds: c.seconds,
        deferred_seconds: c.deferred_seconds,
        device_seconds: c.device_seconds,
        backend: c.backend.name(),
        error: c.error.map(|e| errors::driver(py, "the job failed", e).into_value(py).into_any()),
    })
}
