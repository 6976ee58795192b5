//! The ranks' agreement over a Python callable (`agreement=`).
//!
//! # Interpreter exit (issue 43, item 1)
//!
//! The callable may still run when the offloader shut down (a shutdown
//! stops waiting for the exchange at once, [`agree_via`]) and when the
//! interpreter exits. A thread the library made (not a Python thread) must
//! then not be in Python: once finalisation began, CPython 3.11 to 3.13 end
//! a thread that takes the GIL with `pthread_exit`, whose unwinding runs
//! the Rust frames' destructors (PyO3's `PyGILState_Release` among them:
//! `Fatal Python error: PyGILState_Release: thread state ... must be
//! current`, SIGABRT), and CPython 3.14 hangs it (then a shutdown that
//! joins it never returns). So:
//!
//! 1. The callable runs on a Python daemon thread of its own
//!    (`kvo-agree-callable`), started by [`RUNNER`]'s pure Python `start`:
//!    no Rust frame lies between that thread's start and the callable's
//!    return, so at exit it ends as every Python daemon thread does (CPython
//!    ends or parks it when it next takes the GIL). The result comes back
//!    through `done`, a Rust function that takes words already checked in
//!    Python and never releases the GIL (no bytecode runs in it).
//! 2. The library's exchange thread (`kvo-agree-exchange`) is in Python
//!    only to start that thread, and only through the [`Gate`]: it marks
//!    itself `starting` under the gate's lock unless the gate is closed. The
//!    offloader's shutdown (and its drop) closes the gate after the library
//!    shut down, and an `atexit` function closes every gate before
//!    finalisation begins; closing waits, GIL released, until no start is in
//!    progress (a start needs only the GIL and `Thread.start`). After that,
//!    no thread of kvoffload enters Python for this transport.
//! 3. The exchange thread then waits for `done` or for the gate to close,
//!    whichever comes first, without the GIL.
//!
//! The callable itself is never bounded by kvoffload (`agreement_timeout`
//! included): the transport's own timeout (the process group's) bounds it.

use super::*;
use std::sync::{Condvar, Weak};
use std::thread::ThreadId;

/// The Python half of [`PyTransport`]: `start(f, mine, entered, done)`
/// runs `f(mine)` on a daemon thread and reports through `entered()` (as
/// it begins) and `done(words, None)` or `done(None, message)`, with the
/// words checked here (ints in 0..2**32), so `done` runs no bytecode.
const RUNNER: &std::ffi::CStr = cr#"
import operator
import threading


def _words(r):
    try:
        words = [operator.index(r)]
    except TypeError:
        if isinstance(r, (str, bytes, bytearray)):
            raise
        words = [operator.index(w) for w in r]
    if not all(0 <= w < 2**32 for w in words):
        raise ValueError("a word out of range")
    return words


def _shown(e):
    try:
        return f"{type(e).__name__}: {e}"
    except BaseException:
        return type(e).__name__


def _run(f, mine, entered, done):
    entered()
    try:
        r = f(mine)
    except BaseException as e:
        done(None, "the agreement callable raised " + _shown(e))
        return
    try:
        words = _words(r)
    except BaseException:
        try:
            shown = repr(r)
        except BaseException:
            shown = "?"
        done(None, f"the agreement callable returned {shown}, not an int or a list of ints")
        return
    done(words, None)


def start(f, mine, entered, done):
    threading.Thread(
        target=_run, args=(f, mine, entered, done), name="kvo-agree-callable", daemon=True
    ).start()
"#;

/// Where the exchange stands, under [`Gate`]'s lock.
#[derive(Default)]
struct State {
    /// No thread of kvoffload may enter Python for this transport any more
    /// (the offloader shut down, or the interpreter is exiting).
    closed: bool,
    /// The exchange thread is in Python, starting the callable's thread.
    starting: bool,
    /// What the callable's thread reported (`done`).
    outcome: Option<Result<Vec<u32>, String>>,
    /// The thread running the callable, from its start to its `done`.
    caller: Option<ThreadId>,
}

/// The transport's gate to Python (module docs, rules 2 and 3).
#[derive(Default)]
pub(crate) struct Gate {
    state: Mutex<State>,
    cv: Condvar,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, g: std::sync::MutexGuard<'a, State>) -> std::sync::MutexGuard<'a, State> {
        self.cv.wait(g).unwrap_or_else(|p| p.into_inner())
    }

    /// Closes the gate: no thread of kvoffload enters Python for this
    /// transport after this returns. Waits while the exchange thread starts
    /// the callable's thread; call it with the GIL released (that start
    /// needs it, and nothing else: `Thread.start` waits only for the new
    /// thread to run). A waiting exchange ends (its result is an error,
    /// dropped by a shutdown that stopped waiting for it).
    pub(crate) fn close(&self) {
        let mut g = self.lock();
        g.closed = true;
        self.cv.notify_all();
        while g.starting {
            g = self.wait(g);
        }
    }

    /// True on the thread that runs the agreement callable, while it runs:
    /// a wait there for this offloader's pinning would wait for itself.
    pub(crate) fn on_caller_thread(&self) -> bool {
        self.lock().caller == Some(std::thread::current().id())
    }

    /// `done`: the callable's outcome (its thread holds the GIL; this takes
    /// the gate's lock only, which no holder keeps across a wait for the GIL).
    fn finish(&self, outcome: Result<Vec<u32>, String>) {
        let mut g = self.lock();
        g.outcome = Some(outcome);
        g.caller = None;
        self.cv.notify_all();
    }
}

/// Gates of live transports, closed by [`close_all_at_exit`].
static GATES: Mutex<Vec<Weak<Gate>>> = Mutex::new(Vec::new());

/// Closes every live gate: an `atexit` function, run before the
/// interpreter's finalisation begins (after its non-daemon threads were
/// joined).
fn close_all_at_exit(py: Python<'_>) {
    let gates: Vec<Arc<Gate>> = std::mem::take(&mut *GATES.lock().unwrap_or_else(|p| p.into_inner()))
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    py.detach(|| gates.iter().for_each(|g| g.close()));
}

/// Registers [`close_all_at_exit`] with `atexit`, once per process.
fn register_at_exit(py: Python<'_>) -> PyResult<()> {
    static REGISTERED: pyo3::sync::PyOnceLock<()> = pyo3::sync::PyOnceLock::new();
    REGISTERED
        .get_or_try_init(py, || {
            let f = pyo3::types::PyCFunction::new_closure(
                py,
                Some(c"_kvoffload_close_agreements"),
                None,
                |args: &Bound<'_, PyTuple>, _kw: Option<&Bound<'_, PyDict>>| close_all_at_exit(args.py()),
            )?;
            py.import("atexit")?.call_method1("register", (f,))?;
            Ok::<(), PyErr>(())
        })
        .map(|_| ())
}

/// The agreement transport backed by a Python callable: `f(mine) ->
/// list[int] | int` (an all-gather of every rank's word, or the result of
/// an all-reduce with MAX). Called once, on a Python daemon thread of its
/// own (`kvo-agree-callable`), which the library's exchange thread
/// (`kvo-agree-exchange`, which a shutdown does not wait for: see
/// `agree_via`) starts and then waits for (module docs).
pub(crate) struct PyTransport {
    f: Py<PyAny>,
    pub(crate) gate: Arc<Gate>,
}

impl PyTransport {
    /// A transport over `f`, its gate closed at interpreter exit.
    pub(crate) fn new(py: Python<'_>, f: Py<PyAny>) -> PyResult<Self> {
        register_at_exit(py)?;
        let gate = Arc::new(Gate::default());
        let mut gates = GATES.lock().unwrap_or_else(|p| p.into_inner());
        gates.retain(|g| g.strong_count() > 0);
        gates.push(Arc::downgrade(&gate));
        Ok(PyTransport { f, gate })
    }

    /// Starts the callable's thread (GIL held).
    fn start(&self, py: Python<'_>, mine: u32) -> PyResult<()> {
        static RUNNER_MODULE: pyo3::sync::PyOnceLock<Py<PyModule>> = pyo3::sync::PyOnceLock::new();
        let runner = RUNNER_MODULE.get_or_try_init(py, || {
            PyModule::from_code(py, RUNNER, c"kvoffload/_agreement_runner.py", c"kvoffload._agreement_runner")
                .map(Bound::unbind)
        })?;
        let (g1, g2) = (self.gate.clone(), self.gate.clone());
        let entered = pyo3::types::PyCFunction::new_closure(
            py,
            Some(c"entered"),
            None,
            move |_a: &Bound<'_, PyTuple>, _k: Option<&Bound<'_, PyDict>>| {
                g1.lock().caller = Some(std::thread::current().id());
            },
        )?;
        let done = pyo3::types::PyCFunction::new_closure(
            py,
            Some(c"done"),
            None,
            move |a: &Bound<'_, PyTuple>, _k: Option<&Bound<'_, PyDict>>| -> PyResult<()> {
                // A list of ints in range, or a str (checked in RUNNER):
                // extracted without running bytecode.
                let (words, message): (Option<Vec<u32>>, Option<String>) = a.extract()?;
                g2.finish(words.ok_or_else(|| message.unwrap_or_else(|| "no outcome".into())));
                Ok(())
            },
        )?;
        runner.bind(py).call_method1("start", (self.f.clone_ref(py), mine, entered, done))?;
        Ok(())
    }
}

impl Transport for PyTransport {
    fn exchange(&self, mine: u32) -> Result<Vec<u32>, String> {
        {
            let mut g = self.gate.lock();
            if g.closed {
                return Err("the offloader shut down (or the interpreter is exiting) before the agreement callable \
                            was called"
                    .into());
            }
            g.starting = true;
        }
        // Not closed, and `close` waits until `starting` is false again: the
        // interpreter is not finalising (the atexit close runs first).
        let started = Python::attach(|py| self.start(py, mine).map_err(|e| e.to_string()));
        let mut g = self.gate.lock();
        g.starting = false;
        self.gate.cv.notify_all();
        if let Err(e) = started {
            return Err(format!("could not start the agreement callable's thread: {e}"));
        }
        loop {
            if let Some(r) = g.outcome.take() {
                return r;
            }
            if g.closed {
                return Err("the offloader shut down while the agreement callable ran".into());
            }
            g = self.gate.wait(g);
        }
    }
}
