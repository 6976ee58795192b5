//! The job bookkeeping of `kvoffload.Offloader` ([`Book`]; its lock
//! discipline is written at the top of offloader.rs) and [`guarded`], the
//! panic guard of the entry points.

use std::collections::{HashMap, VecDeque};

use kvoffload::DriverError;

use super::*;

/// Outcomes of jobs `poll` returned that a `wait` still finds (rule 3).
pub(crate) const COLLECTED_KEPT: usize = 1 << 16;

/// The wrapper's job bookkeeping (offloader.rs, at the top: its lock discipline).
#[derive(Default)]
pub(crate) struct Book {
    /// Completions taken from the engine and not yet returned by `poll`,
    /// in the engine's order: `poll` and the waits (which poll while they
    /// wait, see `Offloader::wait`) put them here, each under
    /// the library's lock, and `poll` returns them all.
    pub(crate) reported: Vec<Completion>,
    /// Outcomes of the jobs `poll` returned, newest last (at most
    /// [`COLLECTED_KEPT`]).
    collected: HashMap<JobId, Option<DriverError>>,
    collected_order: VecDeque<JobId>,
}

impl Book {
    /// Job `id`'s outcome, if some thread took its completion from the
    /// engine (`Some(None)`: it succeeded).
    pub(crate) fn outcome(&self, id: JobId) -> Option<Option<DriverError>> {
        if let Some(c) = self.reported.iter().find(|c| c.job == id) {
            return Some(c.error.clone());
        }
        self.collected.get(&id).cloned()
    }

    /// Everything not yet returned by `poll`, now returned: their outcomes
    /// move to `collected`.
    pub(crate) fn take(&mut self) -> Vec<Completion> {
        let out = std::mem::take(&mut self.reported);
        for c in &out {
            if self.collected.insert(c.job, c.error.clone()).is_none() {
                self.collected_order.push_back(c.job);
            }
        }
        while self.collected_order.len() > COLLECTED_KEPT {
            if let Some(old) = self.collected_order.pop_front() {
                self.collected.remove(&old);
            }
        }
        out
    }

    pub(crate) fn clear(&mut self) {
        *self = Book::default();
    }
}

/// Runs `f`, turning a Rust panic into a `KvoffloadError` (kind `"panic"`):
/// no panic crosses into Python as `PanicException` (which `except
/// Exception` does not catch).
pub(crate) fn guarded<T>(py: Python<'_>, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            Err(errors::panicked(py, &what))
        }
    }
}
