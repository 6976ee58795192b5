//! The waits for jobs of an [`Offloader`] ([`Offloader::wait`],
//! [`Offloader::wait_jobs`], [`Offloader::wait_all`]) and
//! [`Offloader::poll_each`]; the rules of a [`Request`] for every wait of
//! the offloader.
//!
//! Each wait takes a [`Request`]. [`Request::new`] blocks until what it
//! waits for happens. [`Request::interruptible`] gives a check,
//! `interrupted`, that the wait calls at least every 50 ms while it waits,
//! never while it holds a lock of the offloader or of its coordinator
//! (`interrupted` may take other locks: the Python front takes the GIL,
//! and Python threads holding the GIL take those locks). When
//! `interrupted` returns true the wait returns
//! [`ProtocolError::Interrupted`] (as [`OffloaderError::Protocol`]) and
//! leaves no trace:
//!
//! - [`Offloader::capture_window`]: the window request is withdrawn
//!   before it opened;
//! - [`Offloader::wait_pinned`]: this thread stops waiting; the pinner
//!   goes on in the background as it did before the call (pinning, or the
//!   ranks' agreement, which it waits for before it publishes a final
//!   state). It was started by [`Offloader::start`], not by the wait, and
//!   the next `wait_pinned`, [`Offloader::shutdown`] or the drop joins it,
//!   as when nobody waited;
//! - [`Offloader::wait`], [`Offloader::wait_jobs`] and
//!   [`Offloader::wait_all`]: the jobs go on on the GPU and stay in
//!   flight; the completions the wait took from the engine went to its
//!   `sink` (see there), the one way they are reported;
//! - [`Offloader::shutdown`]: only its wait for the jobs in flight is
//!   interruptible; interrupted, nothing is shut down;
//! - [`CaptureHook::begin`](super::CaptureHook::begin) and
//!   [`Offloader::gated`]: the window request or the gated call is
//!   withdrawn before it opened or ran;
//! - [`CaptureHook::end`](super::CaptureHook::end) and
//!   [`CaptureHook::abort`](super::CaptureHook::abort) (whose one wait is
//!   the deferred jobs' flush waiting for an engine window of another
//!   thread): the hook window is closed all the same (depth decremented)
//!   and the jobs not yet submitted stay deferred, in order, submitted
//!   once by whoever flushes next (hook.rs).
//!
//! The waits for jobs take a `sink` for the completions they take from
//! the transfer engine. With a blocking request a wait sits in the engine
//! (`cuEventSynchronize`) and takes none: `sink` is not called, and
//! [`Offloader::poll_each`] reports the jobs. With an interruptible
//! request it polls (the engine has no query of one job's completion that
//! leaves the job to be reported), and every completion those polls take,
//! of the jobs waited for and of any other, goes to `sink`, whatever the
//! outcome (interrupted too), exactly as [`Offloader::poll_each`] hands
//! them out: already applied to the block manager, never reported again
//! by a poll, so the caller reports them (the Python front keeps them for
//! its next `poll`). A request that is interruptible but whose check never
//! says so (`Request::new().interruptible(&|| false)`) is the polling
//! form without interruption.
//!
//! Inside [`Offloader::gated`] a capture window, a hook window, a nested
//! `gated`, a wait or a shutdown is refused
//! ([`ProtocolError::WouldDeadlock`]) instead of waiting for itself.
//! docs/blocking-calls.md has the table of every blocking call.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::{Completion, Offloader, OffloaderError};
use crate::protocol::{ProtocolError, Request};
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

impl Offloader {
    /// Blocks until job `id` completed on the GPU. Refused inside the
    /// caller's own window and inside [`Offloader::gated`].
    ///
    /// With a blocking request it waits in the engine
    /// (`cuEventSynchronize`) and returns at once when the job completed;
    /// the job is still reported by [`Offloader::poll_each`]; `sink` is not
    /// called.
    ///
    /// With an interruptible request ([`Request::interruptible`]) it polls
    /// ([`Offloader::poll_each`]: the engine's event queries, through the
    /// coordinator's gate, never while a window is open), first yielding
    /// between polls, then pausing (the pauses grow from 20 us to 0.2 ms),
    /// and while a capture window is open or about to open it waits on the
    /// coordinator for it to close. So it returns up to about 0.2 ms after
    /// the job completed, and it stops when interrupted during a long GPU
    /// job too. Every completion those polls take goes to `sink` (module
    /// docs); a failed job `id` returns [`TransferError::JobFailed`] (its
    /// completion went to `sink` too). A job that another thread's poll
    /// reported while this one waited counts as completed (its outcome
    /// went to that caller).
    ///
    /// Errors: [`OffloaderError::UnknownJob`] when `id` is not in flight,
    /// [`ProtocolError::WouldDeadlock`] inside the caller's own window,
    /// [`OffloaderError::ShutDown`] after shutdown.
    pub fn wait(&self, id: JobId, req: Request<'_>, sink: &mut dyn FnMut(Completion)) -> Result<(), OffloaderError> {
        let Some(interrupted) = req.interrupt() else {
            self.refuse_inside_gated("waiting for a job inside gated()")?;
            let engine = sync::lock(&self.inner).engine.clone().ok_or(OffloaderError::ShutDown)?;
            self.wait_deferred(&engine, Some(&[id]))?;
            return engine.wait(id).map_err(|e| match e {
                TransferError::UnknownJob { id } => OffloaderError::UnknownJob { id },
                e => e.into(),
            });
        };
        {
            let inner = sync::lock(&self.inner);
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
        self.poll_until_reported(&HashSet::from([id]), interrupted, &mut watch)?;
        match failed {
            Some(error) => Err(TransferError::JobFailed { id, error }.into()),
            None => Ok(()),
        }
    }

    /// Blocks until each of `ids` that is in flight completed on the GPU
    /// (vLLM's `OffloadingWorker.wait`): ids never submitted or already
    /// reported are skipped, and failed jobs are reported by
    /// [`Offloader::poll_each`] (or to `sink`), not here. A job deferred
    /// behind a capture hook window is waited for until it is submitted
    /// and done (refused with [`ProtocolError::WouldDeadlock`] when this
    /// thread holds that window). Refused inside the caller's own window.
    /// Blocking or polling, and `sink`, as [`Offloader::wait`].
    pub fn wait_jobs(
        &self,
        ids: &[JobId],
        req: Request<'_>,
        sink: &mut dyn FnMut(Completion),
    ) -> Result<(), OffloaderError> {
        let Some(interrupted) = req.interrupt() else {
            self.refuse_inside_gated("waiting for jobs inside gated()")?;
            let engine = sync::lock(&self.inner).engine.clone().ok_or(OffloaderError::ShutDown)?;
            self.wait_deferred(&engine, Some(ids))?;
            for &id in ids {
                if !sync::lock(&self.inner).jobs.contains_key(&id) {
                    continue;
                }
                match engine.wait(id) {
                    // Reported by another thread's poll since the check, or failed.
                    Ok(()) | Err(TransferError::UnknownJob { .. }) | Err(TransferError::JobFailed { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            return Ok(());
        };
        let ids: HashSet<JobId> = {
            let inner = sync::lock(&self.inner);
            if inner.engine.is_none() {
                return Err(OffloaderError::ShutDown);
            }
            ids.iter().copied().filter(|id| inner.jobs.contains_key(id)).collect()
        };
        if ids.is_empty() {
            return Ok(());
        }
        self.poll_until_reported(&ids, interrupted, sink)
    }

    /// Blocks until every job submitted before the call completed on the
    /// GPU (failed jobs are reported by [`Offloader::poll_each`], or to
    /// `sink`, not here). Refused inside the caller's own window. Blocking
    /// or polling, and `sink`, as [`Offloader::wait`].
    pub fn wait_all(&self, req: Request<'_>, sink: &mut dyn FnMut(Completion)) -> Result<(), OffloaderError> {
        let Some(interrupted) = req.interrupt() else {
            self.refuse_inside_gated("waiting for jobs inside gated()")?;
            let engine = sync::lock(&self.inner).engine.clone().ok_or(OffloaderError::ShutDown)?;
            self.wait_deferred(&engine, None)?;
            return Ok(engine.wait_all()?);
        };
        let ids: HashSet<JobId> = {
            let inner = sync::lock(&self.inner);
            if inner.engine.is_none() {
                return Err(OffloaderError::ShutDown);
            }
            inner.jobs.keys().copied().collect()
        };
        if ids.is_empty() {
            return Ok(());
        }
        self.poll_until_reported(&ids, interrupted, sink)
    }

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
