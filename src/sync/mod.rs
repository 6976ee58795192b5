//! The one place production code takes its concurrency primitives from.
//!
//! Normal builds re-export `std`; builds with `RUSTFLAGS="--cfg loom"` re-export
//! [loom](https://docs.rs/loom), so the model checker sees every lock, atomic,
//! condition variable and thread the library uses (tokio's `src/loom/`
//! convention). Code outside this module must not name `std::sync` or
//! `std::thread` for anything that synchronises; `ci/test` greps for it.

// The one module that names std's primitives (ci/lint-loom/clippy.toml).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

#[cfg(not(loom))]
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
}

#[cfg(loom)]
mod imp {
    pub use loom::sync::atomic;
    pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard, WaitTimeoutResult};
    /// Threads: `loom::thread`, so loom schedules every thread the library
    /// spawns (the pinner, the pre-fault workers, the simulated device).
    pub mod thread {
        pub use loom::thread::{current, spawn, yield_now, Builder, JoinHandle, ThreadId};
        /// Not a scheduling primitive: the machine's core count, as in std.
        pub use std::thread::available_parallelism;
    }
    /// Thread-local storage: loom's, one value per loom thread and
    /// execution (std's would be shared by every loom thread).
    pub use loom::thread_local;
    /// True when the loom model checker drives this build.
    pub const LOOM: bool = true;
}

pub use imp::*;

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
/// [`lock`]; the flag is true when the wait timed out (under loom, which
/// does not model time, it waits for a notification and never times out).
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

/// `Arc<D>` (a trait object) of `value`, under std and loom alike: `coerce`
/// turns the std `Arc` into the trait object; under loom it is then wrapped
/// with `Arc::from_std`.
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
/// signal (words in memory shared between processes). Under loom it yields,
/// which is what loom needs to explore a spin loop; otherwise it yields a
/// few times, then sleeps from 50 us up to 2 ms.
pub fn backoff(attempt: u32) {
    #[cfg(loom)]
    {
        let _ = attempt;
        thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        if attempt < 16 {
            thread::yield_now();
        } else {
            let us = 50u64 << (attempt - 16).min(6);
            std::thread::sleep(std::time::Duration::from_micros(us.min(2000)));
        }
    }
}
