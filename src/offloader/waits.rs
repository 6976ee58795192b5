//! [`Interruptible`]: the waits of an [`Offloader`], interruptible (for
//! Ctrl-C during a wait of the Python front), and [`Offloader::poll_each`].
//!
//! [`Offloader::interruptible`] takes a check, `interrupted`, and returns a
//! view with the offloader's waits. Each waits for what its blocking form
//! waits for and calls `interrupted` at least every 50 ms while it waits,
//! never while it holds a lock of the offloader or of its coordinator
//! (`interrupted` may take other locks: the Python front takes the GIL,
//! and Python threads holding the GIL take those locks). When
//! `interrupted` returns true the wait returns
//! [`ProtocolError::Interrupted`] (as [`OffloaderError::Protocol`]) and
//! leaves no trace:
//!
//! - [`Interruptible::capture_window`]: the window request is withdrawn
//!   before it opened
//!   ([`Coordinator::open_window`](crate::protocol::Coordinator::open_window) with
//!   [`Request::interruptible`](crate::protocol::Request::interruptible));
//! - [`Interruptible::wait_pinned`]: this thread stops waiting; the pinner
//!   goes on in the background as it did before the call (pinning, or the
//!   ranks' agreement, which it waits for before it publishes a final
//!   state). It was started by [`Offloader::start`], not by the wait, and
//!   the next `wait_pinned`, [`Offloader::shutdown`] or the drop joins it,
//!   as when nobody waited;
//! - [`Interruptible::wait`] and [`Interruptible::wait_all`]: the jobs go
//!   on on the GPU and stay in flight; the completions the wait took from
//!   the engine went to its `sink` (see there), the one way they are
//!   reported;
//! - [`Interruptible::wait_jobs`]: as `wait_all`;
//! - [`Interruptible::shutdown`]: only its wait for the jobs in flight is
//!   interruptible; interrupted, nothing is shut down;
//! - [`Interruptible::capture_hook`]'s [`CaptureHook::begin`] and
//!   [`Interruptible::gated`]: the window request or the gated call is
//!   withdrawn before it opened or ran;
//! - [`Interruptible::capture_hook`]'s [`CaptureHook::end`] and
//!   [`CaptureHook::abort`] (whose one wait is the deferred jobs' flush
//!   waiting for an engine window of another thread): the hook window is
//!   closed all the same (depth decremented) and the jobs not yet
//!   submitted stay deferred, in order, submitted once by whoever flushes
//!   next (hook.rs).
//!
//! The blocking forms are unchanged, except that a capture window, a hook
//! window or a nested `gated` asked for inside `gated` is refused
//! ([`ProtocolError::WouldDeadlock`]) instead of waiting for itself.
//! docs/blocking-calls.md has the table of every blocking call.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::{CaptureHook, Completion, GatedCalls, Offloader, OffloaderError, PinOutcome};
use crate::protocol::{CaptureWindow, ProtocolError, Request};
use crate::sync;
use crate::transfer::{JobId, TransferError};

// The longest a wait for jobs goes without calling `interrupted`.
use crate::sync::INTERRUPT_EVERY;

/// Polls of a job wait that only yield before the pauses begin.
const SPIN_POLLS: u32 = 32;

/// The longest pause between two polls of a job wait.
const MAX_PAUSE: Duration = Duration::from_micros(200);

/// The pause before poll `attempt + 1` of a job wait: a completion on the
/// GPU signals no condition variable, so the wait polls. The first
/// [`SPIN_POLLS`] polls only yield (a short job is seen within
/// microseconds, as `cuEventSynchronize` spinning would see it), then the
/// pauses double from 20 us to [`MAX_PAUSE`] (so a long job is seen at
/// most about 0.2 ms late, for a few thousand cheap polls a second).
/// Under loom: a yield, which is what loom needs to explore a poll loop.
fn pause(attempt: u32) {
    if sync::MODEL || attempt < SPIN_POLLS {
        sync::thread::yield_now();
        return;
    }
    let doublings = ((attempt - SPIN_POLLS) / 4).min(8);
    let pause = Duration::from_micros(20u64 << doublings).min(MAX_PAUSE);
    std::thread::sleep(pause);
}

/// The waits of an [`Offloader`], interruptible by a check
/// ([`Offloader::interruptible`]; module docs): the one interruptible form
/// of each.
#[derive(Copy, Clone)]
pub struct Interruptible<'a> {
    off: &'a Offloader,
    interrupted: &'a dyn Fn() -> bool,
}

impl std::fmt::Debug for Interruptible<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Interruptible")
    }
}

impl<'a> Interruptible<'a> {
    pub(super) fn new(off: &'a Offloader, interrupted: &'a dyn Fn() -> bool) -> Self {
        Interruptible { off, interrupted }
    }

    /// [`Offloader::capture_window`], interruptible (see the module docs):
    /// an interrupted request never opened and leaves the coordinator as
    /// before the call.
    pub fn capture_window(&self) -> Result<CaptureWindow, OffloaderError> {
        self.off.capture_window_with(Some(self.interrupted))
    }

    /// [`Offloader::capture_hook`], whose [`CaptureHook::begin`],
    /// [`CaptureHook::end`] and [`CaptureHook::abort`] are interruptible:
    /// an interrupted begin opened nothing (depth unchanged), as a refused
    /// begin leaves it; an interrupted end or abort closed the window
    /// (depth decremented) and left the jobs it did not submit deferred,
    /// in order.
    pub fn capture_hook(&self) -> CaptureHook<'a> {
        CaptureHook::new(self.off, Some(self.interrupted))
    }

    /// [`Offloader::gated`], interruptible: while it waits for capture
    /// windows to close it calls the check at least every 50 ms and, when
    /// that returns true, returns [`ProtocolError::Interrupted`] without
    /// running `f` (nothing left counted). `f` itself is not interrupted.
    pub fn gated<T>(&self, what: &'static str, f: impl FnOnce(&GatedCalls<'_>) -> T) -> Result<T, OffloaderError> {
        self.off.gated_with(what, Some(self.interrupted), f)
    }

    /// [`Offloader::wait_pinned`], interruptible (see the module docs): the
    /// wait for a final pin state (which, with ranks that agree, comes only
    /// after the agreement) calls `interrupted` at least every 50 ms; the
    /// pinner is joined only once it published that state (its last step),
    /// so joining it does not wait for pinning or the agreement (one
    /// exception, as for the blocking form: pinning cancelled before it
    /// began is final at once, and the pinner still takes part in the
    /// agreement before it ends). On an interruption the pinner goes on and
    /// nothing is joined.
    pub fn wait_pinned(&self) -> Result<PinOutcome, OffloaderError> {
        self.off.wait_pinned_with(Some(self.interrupted))
    }

    /// [`Offloader::wait`], interruptible: returns once job `id` completed
    /// on the GPU ([`TransferError::JobFailed`] if it failed), calling
    /// `interrupted` at least every 50 ms while it waits.
    ///
    /// The transfer engine has no query of one job's completion that leaves
    /// the job to be reported, so this one polls: [`Offloader::poll_each`]
    /// (the engine's event queries, through the coordinator's gate, never
    /// while a window is open), first yielding between polls, then pausing
    /// (a completion on the GPU signals no condition variable; the pauses
    /// grow from 20 us to 0.2 ms), and while a capture window is open or
    /// about to open it waits on the coordinator for it to close
    /// ([`Coordinator::wait_no_window`](crate::protocol::Coordinator::wait_no_window), interruptible).
    /// So it returns up to about 0.2 ms after the job completed (the
    /// blocking form: at once), and it stops when interrupted during a long
    /// GPU job too (the blocking form sits in `cuEventSynchronize`).
    ///
    /// Every completion those polls take from the engine, of this job and
    /// of any other, goes to `sink`, whatever the outcome (interrupted too),
    /// exactly as [`Offloader::poll_each`] hands them out: already applied
    /// to the block manager, never reported again by a poll, so the caller
    /// reports them (the Python front keeps them for its next `poll`).
    ///
    /// Errors as the blocking form: [`OffloaderError::UnknownJob`] when `id`
    /// is not in flight, [`ProtocolError::WouldDeadlock`] inside the
    /// caller's own window, [`OffloaderError::ShutDown`] after shutdown. A
    /// job that another thread's poll reported while this one waited counts
    /// as completed (its outcome went to that caller).
    pub fn wait(&self, id: JobId, sink: &mut dyn FnMut(Completion)) -> Result<(), OffloaderError> {
        {
            let inner = sync::lock(&self.off.inner);
            if inner.engine.is_none() {
                return Err(OffloaderError::ShutDown);
            }
            if !inner.jobs.contains_key(&id) {
                return Err(OffloaderError::UnknownJob { id });
            }
        }
        let mut failed = None;
        let mut watch = |c: Completion| {
            if c.job == id {
                failed = c.error.clone();
            }
            sink(c)
        };
        self.off.poll_until_reported(&HashSet::from([id]), self.interrupted, &mut watch)?;
        match failed {
            Some(error) => Err(TransferError::JobFailed { id, error }.into()),
            None => Ok(()),
        }
    }

    /// [`Offloader::wait_all`], interruptible: returns once every job
    /// submitted before the call completed on the GPU (failed jobs are not
    /// errors here, as in the blocking form). Polls like
    /// [`Interruptible::wait`], and hands what it takes from the
    /// engine to `sink` the same way.
    pub fn wait_all(&self, sink: &mut dyn FnMut(Completion)) -> Result<(), OffloaderError> {
        let ids: HashSet<JobId> = {
            let inner = sync::lock(&self.off.inner);
            if inner.engine.is_none() {
                return Err(OffloaderError::ShutDown);
            }
            inner.jobs.keys().copied().collect()
        };
        if ids.is_empty() {
            return Ok(());
        }
        self.off.poll_until_reported(&ids, self.interrupted, sink)
    }

    /// [`Offloader::wait_jobs`], interruptible: returns once each of `ids`
    /// that is in flight at the call completed on the GPU (ids never
    /// submitted or already reported are skipped; failed jobs are not errors
    /// here, `poll` reports them). Polls like
    /// [`Interruptible::wait`] and hands what it takes from the
    /// engine to `sink` the same way; a job deferred behind a capture hook
    /// window is waited for until it is submitted and done (refused with
    /// [`ProtocolError::WouldDeadlock`] when this thread holds that window).
    pub fn wait_jobs(&self, ids: &[JobId], sink: &mut dyn FnMut(Completion)) -> Result<(), OffloaderError> {
        let ids: HashSet<JobId> = {
            let inner = sync::lock(&self.off.inner);
            if inner.engine.is_none() {
                return Err(OffloaderError::ShutDown);
            }
            ids.iter().copied().filter(|id| inner.jobs.contains_key(id)).collect()
        };
        if ids.is_empty() {
            return Ok(());
        }
        self.off.poll_until_reported(&ids, self.interrupted, sink)
    }

    /// [`Offloader::shutdown`], interruptible: first waits, interruptibly,
    /// for the jobs in flight (as [`Interruptible::wait_all`],
    /// handing what it takes to `sink`); interrupted there, it returns
    /// [`ProtocolError::Interrupted`] with nothing changed (the offloader
    /// still runs, its jobs go on). Then it shuts down as the blocking form,
    /// whose drain then waits at most for jobs submitted meanwhile by other
    /// threads. Not interrupted after that point: the rest (stopping the
    /// pinner at a chunk boundary, unregistering, freeing) is bounded by a
    /// chunk's registration and the driver calls.
    pub fn shutdown(&self, sink: &mut dyn FnMut(Completion)) -> Result<(), OffloaderError> {
        let off = self.off;
        off.refuse_inside_gated("shutting down inside gated()")?;
        if off.is_shut_down() {
            return Err(ProtocolError::AlreadyShutDown.into());
        }
        // Refused at once, as the blocking form refuses, when a window is
        // open or a registered graph lives: the drain below would wait for
        // that window first. (One that opens after this check is refused
        // by the shutdown after the drain, as before.)
        let a = off.coord.activity();
        if a.windows_open > 0 {
            return Err(ProtocolError::WindowOpen { open: a.windows_open }.into());
        }
        if a.graphs_live > 0 {
            return Err(ProtocolError::GraphsAlive { live: a.graphs_live }.into());
        }
        // Any other outcome (a window of this thread's, shut down
        // meanwhile) is for the shutdown itself to refuse or report.
        if let Err(e @ OffloaderError::Protocol(ProtocolError::Interrupted { .. })) = self.wait_all(sink) {
            return Err(e);
        }
        off.shutdown()
    }
}

impl Offloader {
    /// Hands each job that finished since the last call to `sink` (vLLM's
    /// `get_finished`; `KeyedOffloader::poll` collects them in a list), in
    /// submission order per direction, each reported once, each applied to
    /// a keyed offloader's block manager and handed out under the
    /// offloader's lock (so completions reach the sinks of concurrent
    /// callers in the engine's order: a caller that keeps them in one list
    /// for later, as the Python front does, keeps poll's order). Never
    /// blocks on the GPU and never makes a capture-unsafe call while a
    /// window is open (it then hands out what it found so far). `sink` must not block
    /// or take a lock that a thread may hold while it calls the offloader
    /// (the GIL, say). Returns how many it handed out.
    pub fn poll_each(&self, sink: &mut dyn FnMut(Completion)) -> usize {
        let mut inner = sync::lock(&self.inner);
        let Some(engine) = inner.engine.clone() else {
            return 0;
        };
        let mut n = 0;
        // Deferred jobs no flush submitted (an interrupted close left them)
        // are submitted first, if no hook window is open; then those the
        // engine refused when they were submitted after their window:
        // reported failed, before the engine's (they were submitted earlier
        // than anything the engine holds now).
        for c in self.flush_and_take_refused(&engine) {
            let Some(job) = inner.jobs.remove(&c.job) else {
                tracing::error!(job = c.job.0, "a deferred job was refused that the offloader did not submit");
                continue;
            };
            let keys = match inner.book.as_mut() {
                Some(book) => book.finished(c.job, job.direction, false),
                None => Vec::new(),
            };
            sink(Completion { keys, ..c });
            n += 1;
        }
        for r in engine.poll_finished() {
            let Some(job) = inner.jobs.remove(&r.id) else {
                tracing::error!(job = r.id.0, "a job was reported that the offloader did not submit");
                continue;
            };
            let keys = match inner.book.as_mut() {
                Some(book) => book.finished(r.id, job.direction, r.succeeded()),
                None => Vec::new(),
            };
            let deferred_seconds = self.take_deferred_seconds(r.id);
            sink(Completion {
                job: r.id,
                direction: r.direction,
                lane: r.lane,
                keys,
                bytes: r.bytes,
                seconds: r.seconds + deferred_seconds,
                device_seconds: r.device_seconds,
                backend: r.backend,
                error: r.error,
                deferred_seconds,
            });
            n += 1;
        }
        n
    }

    /// Polls until none of `ids` is in flight any more (reported by these
    /// polls, or by another thread's), handing what the polls report to
    /// `sink`.
    fn poll_until_reported(
        &self,
        ids: &HashSet<JobId>,
        interrupted: &dyn Fn() -> bool,
        sink: &mut dyn FnMut(Completion),
    ) -> Result<(), OffloaderError> {
        self.refuse_inside_gated("waiting for jobs inside gated()")?;
        let mut attempt = 0u32;
        let mut checked = Instant::now();
        loop {
            self.poll_each(sink);
            let left = {
                let inner = sync::lock(&self.inner);
                ids.iter().any(|id| inner.jobs.contains_key(id))
            };
            if !left {
                return Ok(());
            }
            // A window open or about to open holds the event queries back:
            // wait for it to close (refused inside the caller's own window,
            // which would never close while it waits).
            self.coord.wait_no_window(Request::new().interruptible(interrupted), None)?;
            if checked.elapsed() >= INTERRUPT_EVERY {
                if interrupted() {
                    return Err(ProtocolError::Interrupted { what: "a transfer" }.into());
                }
                checked = Instant::now();
            }
            pause(attempt);
            attempt = attempt.saturating_add(1);
        }
    }
}
