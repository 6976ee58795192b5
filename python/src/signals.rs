//! Python signals as the interruptible waits' check (Ctrl-C).

use super::*;

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
pub(crate) struct Signals {
    pub(crate) raised: Arc<Mutex<Option<PyErr>>>,
}

impl Signals {
    /// True when a signal handler raised (the wait then stops).
    pub(crate) fn check(&self) -> bool {
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
    pub(crate) fn result<T>(&self, py: Python<'_>, r: Result<T, OffloaderError>) -> PyResult<T> {
        if let Some(e) = self.raised.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(e);
        }
        r.map_err(|e| errors::offloader(py, e))
    }
}
