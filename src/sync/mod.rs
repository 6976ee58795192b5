//! The one place production code takes its concurrency primitives from.
//!
//! Normal builds re-export `std`; builds with `RUSTFLAGS="--cfg loom"` re-export
//! [loom](https://docs.rs/loom), so the model checker sees every lock, atomic,
//! condition variable and thread the library uses (tokio's `src/loom/`
//! convention); builds with `RUSTFLAGS="--cfg shuttle"` re-export
//! [shuttle](https://docs.rs/shuttle)'s, the randomized scheduler that runs
//! the same models past loom's bound (docs/PROOFS.md, "Past loom's bound").
//! Code outside this module must not name `std::sync` or `std::thread` for
//! anything that synchronises; `ci/lint` checks it with clippy on a loom
//! build (`ci/lint-loom/clippy.toml`).
//!
//! One more thing differs under loom and shuttle, and it is not concurrency:
//! [`host_fact`] (the core count, the memory headroom, the NUMA topology,
//! read from `/proc` and `/sys`) is read once per process there.

// The one module that names std's primitives (ci/lint-loom/clippy.toml).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

#[cfg(all(loom, shuttle))]
compile_error!("--cfg loom and --cfg shuttle are two model builds: set one of them");

#[cfg(not(any(loom, shuttle)))]
mod imp {
    pub use std::sync::atomic;
    pub use std::sync::{Arc, Condvar, Mutex, MutexGuard, WaitTimeoutResult};
    /// Threads: `std::thread` here, `loom::thread` under `--cfg loom`, so
    /// loom schedules every thread the library spawns (the pinner, the
    /// pre-fault workers, the simulated device).
    pub mod thread {
        pub use std::thread::{available_parallelism, current, spawn, yield_now, Builder, JoinHandle, ThreadId};
    }
    /// Thread-local storage (loom's under `--cfg loom`, one value per loom
    /// thread and execution).
    pub use std::thread_local;
    /// True when the loom model checker drives this build.
    pub const LOOM: bool = false;
    /// True when a model checker (loom or shuttle) drives this build: its
    /// threads are not OS threads, a poll loop must yield to let the others
    /// run, and real time does not pass.
    pub const MODEL: bool = false;
}

#[cfg(any(loom, shuttle))]
mod imp {
    // The model checker of this build: loom, or shuttle (the randomized
    // scheduler); both offer std's names.
    #[cfg(loom)]
    use loom as checker;
    #[cfg(shuttle)]
    use shuttle as checker;

    pub use checker::sync::atomic;
    // Shuttle's `Arc` is std's (shuttle 0.9 does not model reference counts).
    pub use checker::sync::{Arc, Condvar, Mutex, MutexGuard, WaitTimeoutResult};
    /// Threads: the model checker's (`loom::thread`, `shuttle::thread`), so
    /// it schedules every thread the library spawns (the pinner, the
    /// pre-fault workers, the simulated device).
    pub mod thread {
        pub use super::checker::thread::{current, spawn, yield_now, Builder, JoinHandle, ThreadId};
        /// Not a scheduling primitive: the machine's core count, as in std
        /// (read once per process: see [`super::super::host_fact`]).
        pub fn available_parallelism() -> std::io::Result<std::num::NonZeroUsize> {
            super::super::host_fact("available_parallelism", || {
                std::thread::available_parallelism().map_err(|e| (e.kind(), e.to_string()))
            })
            .map_err(|(kind, msg)| std::io::Error::new(kind, msg))
        }
    }
    /// Thread-local storage: the model checker's, one value per model
    /// thread and execution (std's would be shared by every model thread;
    /// under shuttle they all run on one OS thread).
    pub use checker::thread_local;
    /// True when the loom model checker drives this build (false: shuttle
    /// does).
    pub const LOOM: bool = cfg!(loom);
    /// True when a model checker (loom or shuttle) drives this build.
    pub const MODEL: bool = true;
}

pub use imp::*;

/// A fact about the host that the engine reads each time it builds an
/// offloader or a region (the core count, the memory this process can get,
/// the NUMA topology): `read()`, keyed by `key` (the fact and what it was
/// read for).
///
/// Normal builds call `read` every time: the host changes between two
/// offloaders (free memory above all). Under loom the value is read once per
/// process and key, then cloned: every model iteration builds its engine
/// afresh, and those reads of `/proc` and `/sys` were 40 % of a model's time
/// (perf over `p1_hook_a_job_beside_a_hooked_capture_never_disturbs_it`:
/// `available_memory` 24 %, `available_parallelism` 8 %, `Topology::read`
/// 4 %), while the host is not what a model explores (its regions are a few
/// pages, its sizes fixed). Shuttle builds do as loom's, for the same
/// reason.
#[cfg(not(any(loom, shuttle)))]
pub fn host_fact<T>(_key: &str, read: impl FnOnce() -> T) -> T {
    read()
}

/// See the other build's `host_fact`: under loom (and shuttle), read once
/// per process and key (a std lock, not the model checker's: the cache is
/// outside what it explores, like the host itself).
#[cfg(any(loom, shuttle))]
pub fn host_fact<T: Clone + Send + 'static>(key: &str, read: impl FnOnce() -> T) -> T {
    use std::any::{Any, TypeId};
    use std::collections::HashMap;
    type Facts = HashMap<(TypeId, String), Box<dyn Any + Send>>;
    static FACTS: std::sync::OnceLock<std::sync::Mutex<Facts>> = std::sync::OnceLock::new();
    let facts = FACTS.get_or_init(Default::default);
    let k = (TypeId::of::<T>(), key.to_string());
    if let Some(v) = facts.lock().unwrap_or_else(|p| p.into_inner()).get(&k) {
        return v.downcast_ref::<T>().cloned().expect("host_fact: keyed by the value's type");
    }
    // Read outside the lock (a read may take a while; two first readers of
    // one key both read, the second's value is kept: either is the host's).
    let v = read();
    facts.lock().unwrap_or_else(|p| p.into_inner()).insert(k, Box::new(v.clone()));
    v
}

/// The longest an interruptible wait of the library goes without calling
/// its `interrupted` (or cancel) check: the coordinator's waits, the waits
/// for jobs, a shared region's create and join, and [`abandonable`]. Half
/// of the half second the Python front promises for Ctrl-C.
pub const INTERRUPT_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// One slice of an interruptible wait on a condition variable: the wait
/// calls its check once a slice is [over](Slice::over), then starts a new
/// one ([`Slice::start`]), and between two checks waits on the condition
/// variable for the rest of the slice ([`Slice::wait`]).
///
/// Normal builds: a slice is [`INTERRUPT_EVERY`] of the clock, so a wait
/// blocked with no state change calls its check once per slice of time.
/// Model builds (loom, shuttle): time does not pass and a timed wait never
/// times out (it waits for a notification), so a slice is over once its
/// wait was woken: the check may be called after every wake-up at which
/// the wait is still blocked (each one could come a slice of time later),
/// and never without one. A model counts the wake-ups (`wakeups`, model
/// builds only) and the calls of its check, which a wait that spins on its
/// check (no new slice started after a check: N34) makes more of than
/// wake-ups (model/p6_interruptible.rs).
pub struct Slice {
    #[cfg(not(any(loom, shuttle)))]
    start: std::time::Instant,
    #[cfg(any(loom, shuttle))]
    woken: bool,
}

impl Slice {
    /// A slice starting now.
    pub fn start() -> Slice {
        Slice {
            #[cfg(not(any(loom, shuttle)))]
            start: std::time::Instant::now(),
            #[cfg(any(loom, shuttle))]
            woken: false,
        }
    }

    /// Whether the slice is over: [`INTERRUPT_EVERY`] has passed since it
    /// started (model builds: its wait was woken since).
    pub fn over(&self) -> bool {
        #[cfg(not(any(loom, shuttle)))]
        {
            self.start.elapsed() >= INTERRUPT_EVERY
        }
        #[cfg(any(loom, shuttle))]
        {
            self.woken
        }
    }

    /// Waits on `cv` until notified or, at the latest, until the slice is
    /// over (model builds: until notified, which ends the slice and counts
    /// a wake-up of this thread, `wakeups`). The caller re-checks its
    /// condition after it returns, as after [`wait`].
    pub fn wait<'a, T>(&mut self, cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        #[cfg(not(any(loom, shuttle)))]
        {
            wait_timeout(cv, g, INTERRUPT_EVERY.saturating_sub(self.start.elapsed())).0
        }
        #[cfg(any(loom, shuttle))]
        {
            let g = wait(cv, g);
            self.woken = true;
            WAKEUPS.with(|w| w.set(w.get() + 1));
            g
        }
    }
}

#[cfg(any(loom, shuttle))]
self::thread_local! {
    /// Wake-ups of this thread's [`Slice::wait`]s (model builds).
    static WAKEUPS: std::cell::Cell<usize> = std::cell::Cell::new(0);
}

/// Model builds only: how many times a [`Slice::wait`] of the calling
/// thread has returned (this execution's thread: loom's and shuttle's
/// thread-locals are per model thread). A model reads it before and during
/// an interruptible wait to bound the calls of its check by the wake-ups.
#[cfg(any(loom, shuttle))]
pub fn wakeups() -> usize {
    WAKEUPS.with(std::cell::Cell::get)
}

/// Runs `f` on a thread of its own named `name` and waits for its result,
/// checking `cancelled()` at least every [`INTERRUPT_EVERY`]: `None` once
/// `cancelled()` says so, the thread then left to end on its own (its
/// result dropped).
/// For a call the library cannot bound itself (an engine's callback, such
/// as the agreement transport's collective): the caller's wait ends on a
/// cancel, whatever `f` waits for. `f` must hold nothing the caller frees.
/// A panic in `f` is returned as `Some(Err("{name} panicked: .."))`, and so
/// is a thread that could not be started.
///
/// Under loom `f` runs on the calling thread and the cancel is not checked:
/// loom models at most 5 threads and no time (the timed wait this needs),
/// and what its models check is what `f` returns, not how long it takes.
/// Shuttle builds do the same (shuttle models no time either).
#[cfg(not(any(loom, shuttle)))]
pub fn abandonable<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
    cancelled: &dyn Fn() -> bool,
) -> Option<Result<T, String>> {
    /// The result, once `f` ends, and its signal.
    type Slot<T> = (Mutex<Option<Result<T, String>>>, Condvar);
    let slot: Arc<Slot<T>> = Arc::new((Mutex::new(None), Condvar::new()));
    let (put, who) = (slot.clone(), name.to_string());
    let caught = move || {
        // The panic is reported, not lost: the caller would otherwise wait
        // for a cancel.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|e| {
            let msg = e.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| e.downcast_ref::<String>().cloned());
            Err(format!("{who} panicked: {}", msg.unwrap_or_else(|| "?".into())))
        });
        *lock(&put.0) = Some(r);
        put.1.notify_all();
    };
    if let Err(e) = thread::Builder::new().name(name.into()).spawn(caught) {
        return Some(Err(format!("could not start thread {name}: {e}")));
    }
    let mut g = lock(&slot.0);
    loop {
        if let Some(r) = g.take() {
            return Some(r);
        }
        drop(g);
        if cancelled() {
            return None;
        }
        g = lock(&slot.0);
        if g.is_none() {
            g = wait_timeout(&slot.1, g, INTERRUPT_EVERY).0;
        }
    }
}

/// See the other build's `abandonable`: under loom and shuttle, `f` on the
/// calling thread (a panic is the model's).
#[cfg(any(loom, shuttle))]
pub fn abandonable<T: Send + 'static>(
    _name: &str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
    _cancelled: &dyn Fn() -> bool,
) -> Option<Result<T, String>> {
    Some(f())
}

/// Locks a mutex, recovering the data if a thread panicked while holding it.
///
/// Library state stays consistent across a panic because every critical
/// section either completes its update or leaves the state untouched; a
/// poisoned lock therefore carries no extra information we could act on.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Waits on `cv`, recovering from poisoning like [`lock`].
pub fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    match cv.wait(g) {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Waits on `cv` for at most `timeout`, recovering from poisoning like
/// [`lock`]; the flag is true when the wait timed out (under loom and
/// shuttle, which do not model time, it waits for a notification and never
/// times out: shuttle's `Condvar::wait_timeout` is its `wait`).
/// Callers re-check their condition after it returns, as after [`wait`].
pub fn wait_timeout<'a, T>(
    cv: &Condvar,
    g: MutexGuard<'a, T>,
    timeout: std::time::Duration,
) -> (MutexGuard<'a, T>, bool) {
    match cv.wait_timeout(g, timeout) {
        Ok((g, r)) => (g, r.timed_out()),
        Err(p) => {
            let (g, r) = p.into_inner();
            (g, r.timed_out())
        }
    }
}

/// The standard library's `Arc`, whatever the build: the one type that can
/// be coerced to a trait object (loom's `Arc` cannot; see [`arc_dyn`]).
pub type StdArc<T> = std::sync::Arc<T>;

/// `Arc<D>` (a trait object) of `value`, under std, loom and shuttle alike:
/// `coerce` turns the std `Arc` into the trait object; under loom it is then
/// wrapped with `Arc::from_std` (shuttle's `Arc` is std's).
pub fn arc_dyn<T, D: ?Sized>(value: T, coerce: fn(StdArc<T>) -> StdArc<D>) -> Arc<D> {
    let d = coerce(StdArc::new(value));
    #[cfg(not(loom))]
    {
        d
    }
    #[cfg(loom)]
    {
        Arc::from_std(d)
    }
}

/// The calling thread's id (std's or loom's).
pub fn this_thread() -> thread::ThreadId {
    thread::current().id()
}

/// Pause between two polls of a condition that no condition variable can
/// signal (words in memory shared between processes). Under loom and
/// shuttle it yields, which is what a model checker needs to explore a spin
/// loop (shuttle's random scheduler also takes it as a hint to run another
/// thread); otherwise it yields a few times, then sleeps from 50 us up to
/// 2 ms.
pub fn backoff(attempt: u32) {
    #[cfg(any(loom, shuttle))]
    {
        let _ = attempt;
        thread::yield_now();
    }
    #[cfg(not(any(loom, shuttle)))]
    {
        if attempt < 16 {
            thread::yield_now();
        } else {
            let us = 50u64 << (attempt - 16).min(6);
            std::thread::sleep(std::time::Duration::from_micros(us.min(2000)));
        }
    }
}
