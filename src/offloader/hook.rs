//! The capture hook: capture windows held by the offloader itself, for a
//! hook that wraps a framework's `capture_begin`/`capture_end` (PyTorch's
//! `torch.cuda.CUDAGraph`), where no lexical guard can live.
//!
//! The rules, each part of P1/P2/P4/P6 in docs/PROOFS.md:
//!
//! - Depth is per thread. [`CaptureHook::begin`] at depth 0 opens a
//!   capture window under the Interleave rules, whatever the offloader's
//!   [`CapturePolicy`](crate::protocol::CapturePolicy) and whatever its
//!   [`Request`] says ([`Request::interleaved`]):
//!   it waits at most for the capture-unsafe library call in flight (one
//!   chunk's registration, or one job submission), never for pinning.
//!   Deeper begins only count. [`CaptureHook::end`] at depth 1 closes
//!   the window; [`CaptureHook::abort`] does the same for a capture
//!   whose framework begin failed after the hook's begin succeeded.
//! - While a hook window is open or opening on any thread, or deferred
//!   jobs wait, every job submitted (keyed or slot) is checked as a direct
//!   submission is, admitted ([`JobTicket`], so shutdown drains it) and
//!   queued: never refused for the window, never submitted inside it, so
//!   no capture-unsafe call of the job's (the order event, the copies)
//!   lands in a capture (P1).
//! - The thread whose close leaves no hook window open submits the queue,
//!   first in first out, after its window closed and outside every window;
//!   each submission runs under the hook's lock, so a window that begins
//!   meanwhile waits for that one submission and the rest stay queued for
//!   its own close. A submission refused because an engine's own
//!   (lexical) window is open waits for it and is retried; a hook window
//!   that begins during that wait ends it, the rest left queued for that
//!   window's close
//!   ([`Coordinator::wait_no_window`](crate::protocol::Coordinator::wait_no_window) with a `since`),
//!   so a close never waits for another thread's hook window (P6: a
//!   thread may hold its hook window until another's close returns).
//! - That wait is the close's only wait for another thread, and an
//!   interruptible close (an end or abort with
//!   [`Request::interruptible`]) stops it: the window is closed all the
//!   same (the capture is over), and the refused job and those after it
//!   stay queued, in order. So may
//!   a flush find the queue with no hook window open: whoever flushes next
//!   submits it, first in first out, each job once (it leaves the queue in
//!   the critical section that submits it): the next close, a blocking
//!   wait for a deferred job, and, never waiting (an engine window that
//!   refuses a job leaves it and the rest queued), a refused or
//!   interrupted begin, [`Offloader::poll_each`] (and the interruptible waits'
//!   polls), the next submission (before its own, which keeps its place
//!   after them) and shutdown.
//! - A wait ([`Offloader::wait`], [`Offloader::wait_jobs`],
//!   [`Offloader::wait_all`]) for a deferred job by the thread holding a
//!   hook window is refused with [`ProtocolError::WouldDeadlock`] (the job
//!   cannot start before that thread's close); from any other thread it
//!   waits until the job was submitted, then for the job, submitting the
//!   queue itself whenever no hook window is open (refused,
//!   `WouldDeadlock`, when a job of it is refused for this thread's own
//!   engine window, which would never close while it waits).
//! - Shutdown is refused ([`ProtocolError::WindowOpen`]) while a hook
//!   window is open or opening, waits for a flush in progress, submits
//!   what is still queued (refused, `WindowOpen`, when an engine window
//!   refuses a job of it), and closes the coordinator under the hook's
//!   lock, so no window can begin between the check and the close;
//!   deferred jobs are therefore all submitted before it drains (P4).
//!
//! Lock order: the offloader's `inner`, then the hook's, then the
//! coordinator's. A deferred job's order point is its submission after the
//! window: the compute stream's work at that moment, later than at the
//! call (safe for engines that leave a job's GPU blocks alone until it is
//! reported, the contract of [`Offloader::new`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

use super::{Completion, Offloader, OffloaderError};
use crate::protocol::{CaptureWindow, JobTicket, ProtocolError, Request};
use crate::rules::Rules;
use crate::runtime::{Code, DriverError};
use crate::sync::{self, thread, Arc, Condvar, Mutex, MutexGuard};
use crate::transfer::{Backend, JobBlocks, JobId, Lane, TransferEngine, TransferError};

/// The hook's state and the condition variable its waiters wait on.
pub(super) struct Hook {
    state: Mutex<HookState>,
    cv: Condvar,
}

#[derive(Default)]
pub(super) struct HookState {
    /// One per thread with a hook window open or opening.
    windows: Vec<HookWindow>,
    /// Jobs admitted while a hook window was open, oldest first.
    queue: VecDeque<Deferred>,
    /// Threads submitting the queue right now.
    flushing: usize,
    /// Deferred jobs submitted, until `poll` reports them: seconds queued.
    deferred_for: HashMap<JobId, f64>,
    /// Deferred jobs the engine refused at their submission, reported
    /// failed by the next `poll`.
    failed: Vec<Completion>,
    /// Every job id submitted or deferred (a deferred id is not the
    /// engine's yet, so the engine's own check cannot see it).
    ids: UsedIds,
}

impl Hook {
    pub(super) fn new() -> Self {
        Hook { state: Mutex::new(HookState::default()), cv: Condvar::new() }
    }
}

struct HookWindow {
    owner: thread::ThreadId,
    depth: usize,
    /// `None` while the window waits to open.
    window: Option<CaptureWindow>,
    since: Instant,
}

/// A job admitted and queued behind a hook window.
struct Deferred {
    id: JobId,
    lane: Lane,
    blocks: JobBlocks,
    /// Slot jobs' skips (`None`: a keyed job, the engine derives them).
    first_subs: Option<Vec<usize>>,
    bytes: u64,
    queued_at: Instant,
    /// Held until the engine admitted the job with its own ticket.
    _ticket: JobTicket,
}

/// Job ids used so far, as disjoint closed intervals (start -> end): ids
/// that grow by one stay one interval.
#[derive(Default)]
struct UsedIds {
    runs: BTreeMap<u64, u64>,
}

impl UsedIds {
    fn contains(&self, id: JobId) -> bool {
        self.runs.range(..=id.0).next_back().is_some_and(|(_, &end)| id.0 <= end)
    }

    /// Inserts `id` (not yet contained).
    fn insert(&mut self, id: JobId) {
        let id = id.0;
        let below = self.runs.range(..id).next_back().map(|(&s, &e)| (s, e));
        let above = id.checked_add(1).and_then(|n| self.runs.get(&n).map(|&e| (n, e)));
        match (below.filter(|&(_, e)| e.checked_add(1) == Some(id)), above) {
            (Some((s, _)), Some((n, e))) => {
                self.runs.remove(&n);
                self.runs.insert(s, e);
            }
            (Some((s, _)), None) => {
                self.runs.insert(s, id);
            }
            (None, Some((n, e))) => {
                self.runs.remove(&n);
                self.runs.insert(id, e);
            }
            (None, None) => {
                self.runs.insert(id, id);
            }
        }
    }
}

/// What a flush does when an engine's own (lexical) window refuses a
/// deferred job's submission.
#[derive(Clone, Copy)]
enum AtEngineWindow<'a> {
    /// Stops: that job and those after it stay queued, in order, for the
    /// next flush (the calls that never wait: poll, a submission,
    /// shutdown).
    Stop,
    /// Waits for the engine's windows to close, without the hook's lock,
    /// then retries; interruptibly when the request has a check (a hook
    /// close, a blocking wait for a deferred job).
    Wait(Request<'a>),
}

/// The error a deferred job refused at its submission is reported with
/// (`Completion::error` is a driver error): the driver's own when the
/// engine's enqueue failed, otherwise `ILLEGAL_STATE` named after the
/// refusal's step.
fn refusal_error(e: &TransferError) -> DriverError {
    match e {
        TransferError::Driver(d) => d.clone(),
        TransferError::ComputeCapturing { .. } => {
            DriverError::new("kvoffload: deferred job (compute stream capturing)", Code::STREAM_CAPTURE_UNSUPPORTED)
        }
        _ => DriverError::new("kvoffload: deferred job refused at its submission", Code::ILLEGAL_STATE),
    }
}

/// The capture hook of an [`Offloader`] ([`Offloader::capture_hook`]):
/// capture windows the offloader holds itself, per thread and nested, for a
/// hook that wraps a framework's capture calls (module docs). Its
/// [`CaptureHook::begin`], [`CaptureHook::end`] and [`CaptureHook::abort`]
/// take a [`Request`], interruptible when it has a check.
#[derive(Copy, Clone)]
pub struct CaptureHook<'a> {
    off: &'a Offloader,
}

impl std::fmt::Debug for CaptureHook<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureHook").finish_non_exhaustive()
    }
}

impl<'a> CaptureHook<'a> {
    pub(super) fn new(off: &'a Offloader) -> Self {
        CaptureHook { off }
    }

    /// Opens this thread's hook window (depth 0 -> 1), or counts a nested
    /// begin (depth n -> n + 1, nothing else). For a hook wrapping a
    /// framework's capture begin: call it before the framework's begin, and
    /// [`CaptureHook::end`] after its end (or [`CaptureHook::abort`] if its
    /// begin failed), on the same thread: depth is per thread.
    ///
    /// The window opens under the Interleave rules whatever
    /// `PinOptions::capture_policy` (and whether or not `req` is
    /// [`Request::interleaved`]): it waits at most for the library call
    /// in flight (one chunk's registration, or one job submission), never
    /// for pinning to finish; pinning pauses at its next chunk boundary
    /// until the window closes. While it is open no library thread of this
    /// offloader makes a capture-unsafe driver call (P1), and jobs
    /// submitted on any thread are deferred (module docs).
    ///
    /// Interruptible ([`Request::interruptible`]): while the window waits
    /// to open it calls the check at least every 50 ms and, when that
    /// returns true, withdraws the request and returns
    /// [`ProtocolError::Interrupted`] with nothing open (depth unchanged),
    /// as a refused begin leaves it.
    ///
    /// Errors (depth unchanged, nothing open): [`ProtocolError::ShutDown`]
    /// after shutdown began, [`ProtocolError::NestedWindow`] when this
    /// thread holds a window of [`Offloader::capture_window`].
    pub fn begin(&self, req: Request<'_>) -> Result<(), OffloaderError> {
        self.off.hook_begin(req)
    }

    /// Closes this thread's hook window (depth 1 -> 0), or uncounts a
    /// nested begin (depth n -> n - 1). Once no hook window is open on any
    /// thread, the deferred jobs are submitted, in the order they were
    /// submitted, on this thread and outside every window (async enqueues:
    /// this returns once they are enqueued, not completed). A job refused
    /// because an engine's own window ([`Offloader::capture_window`],
    /// another thread's) is open waits for that window to close.
    ///
    /// Interruptible ([`Request::interruptible`]): that wait calls the
    /// check at least every 50 ms and, when it returns true,
    /// returns [`ProtocolError::Interrupted`] with the window closed all
    /// the same (depth decremented: the capture is over either way) and
    /// the jobs not yet submitted still deferred, in order, for whoever
    /// flushes next (the next close, [`Offloader::poll_each`], the next
    /// submission, a wait for one of them, shutdown; module docs).
    ///
    /// Call it after the framework's capture end, also when that end
    /// failed (the capture is over either way). Error:
    /// [`OffloaderError::HookNotOpen`] when this thread's depth is 0
    /// (nothing changed).
    pub fn end(&self, req: Request<'_>) -> Result<(), OffloaderError> {
        self.off.hook_close("capture_end", req)
    }

    /// What [`CaptureHook::end`] does, for a capture whose framework begin
    /// failed after [`CaptureHook::begin`] succeeded (the hook's
    /// `begin(); try: framework_begin() except: abort(); raise`),
    /// interruptible as `end`. Error: [`OffloaderError::HookNotOpen`] when
    /// this thread's depth is 0.
    pub fn abort(&self, req: Request<'_>) -> Result<(), OffloaderError> {
        self.off.coord.rules().abort_closes_window(|| self.off.hook_close("capture_abort", req))
    }

    /// This thread's hook depth: begins not yet matched by an end or an
    /// abort.
    pub fn depth(&self) -> usize {
        let me = sync::this_thread();
        sync::lock(&self.off.hook.state).windows.iter().find(|w| w.owner == me).map_or(0, |w| w.depth)
    }

    /// Jobs deferred behind a hook window and not yet submitted.
    pub fn deferred_jobs(&self) -> usize {
        sync::lock(&self.off.hook.state).queue.len()
    }
}

impl Offloader {
    fn hook_begin(&self, req: Request<'_>) -> Result<(), OffloaderError> {
        // Inside `gated` the window would wait for this thread's own call.
        self.refuse_inside_gated("opening a capture hook window inside gated()")?;
        let me = sync::this_thread();
        {
            let mut h = sync::lock(&self.hook.state);
            if let Some(w) = h.windows.iter_mut().find(|w| w.owner == me) {
                w.depth += 1;
                tracing::trace!(depth = w.depth, "capture hook: nested begin");
                return Ok(());
            }
            h.windows.push(HookWindow { owner: me, depth: 1, window: None, since: Instant::now() });
        }
        let span = tracing::debug_span!("capture_hook_begin").entered();
        // Outside the hook's lock: jobs submitted meanwhile are deferred.
        let opened = self.coord.open_window(req.interleaved());
        let engine = sync::lock(&self.inner).engine.clone();
        let mut h = sync::lock(&self.hook.state);
        let Some(i) = h.windows.iter().position(|w| w.owner == me) else {
            // Only this thread removes its entry.
            unreachable!("capture hook: the opening window's entry vanished");
        };
        match opened {
            Ok(w) => {
                tracing::debug!(
                    chunks_waited = w.chunks_waited(),
                    waited_s = h.windows[i].since.elapsed().as_secs_f64(),
                    "capture hook window opened"
                );
                h.windows[i].window = Some(w);
                h.windows[i].since = Instant::now();
                Ok(())
            }
            Err(e) => {
                h.windows.swap_remove(i);
                tracing::warn!(error = %e, "capture hook window refused");
                self.hook.cv.notify_all();
                drop(span);
                // The jobs deferred behind this request are submitted as a
                // close would, but never waiting: an interrupted begin's
                // check has had its say, so the rest (an engine window
                // refused one) is left for whoever flushes next.
                // (Never waiting, it returns no error.)
                self.coord.rules().refused_begin_flushes(|| {
                    let _ = self.flush_if_last(h, engine.as_deref(), AtEngineWindow::Stop);
                });
                Err(e.into())
            }
        }
    }

    fn hook_close(&self, call: &'static str, req: Request<'_>) -> Result<(), OffloaderError> {
        let me = sync::this_thread();
        let engine = sync::lock(&self.inner).engine.clone();
        let mut h = sync::lock(&self.hook.state);
        let Some(i) = h.windows.iter().position(|w| w.owner == me && w.window.is_some()) else {
            return Err(OffloaderError::HookNotOpen { call });
        };
        if h.windows[i].depth > 1 {
            h.windows[i].depth -= 1;
            tracing::trace!(depth = h.windows[i].depth, call, "capture hook: nested end");
            return Ok(());
        }
        // The deferred jobs go once the window closed (below), not inside
        // it: the flush handed over here is the one the rule does not run.
        let rules = self.coord.rules();
        h = rules.hook_flushes_after_close(h, |h| match engine.as_deref() {
            Some(e) => self.flush(h, e, Some(me), AtEngineWindow::Stop).0,
            None => h,
        });
        let Some(i) = h.windows.iter().position(|w| w.owner == me) else {
            unreachable!("capture hook: this thread's window vanished");
        };
        let w = h.windows.swap_remove(i);
        let held_s = w.since.elapsed().as_secs_f64();
        // The coordinator's window closes here (its lock inside the hook's).
        drop(w.window);
        tracing::debug!(call, held_s, deferred = h.queue.len(), "capture hook window closed");
        self.hook.cv.notify_all();
        // The window is closed whatever the flush's outcome: interrupted,
        // the jobs it did not submit stay queued, in order (module docs).
        rules.hook_close_flushes(call == "capture_abort", || {
            self.flush_if_last(h, engine.as_deref(), AtEngineWindow::Wait(req)).map_err(|e| {
                tracing::debug!(call, error = %e, "capture hook: window closed, deferred jobs left queued");
                e.into()
            })
        })
    }

    /// Submits the deferred jobs when no hook window is open any more; an
    /// engine window that refuses one is met as `at_window` says.
    fn flush_if_last(
        &self,
        h: MutexGuard<'_, HookState>,
        engine: Option<&TransferEngine>,
        at_window: AtEngineWindow<'_>,
    ) -> Result<(), ProtocolError> {
        if !h.windows.is_empty() || h.queue.is_empty() {
            return Ok(());
        }
        match engine {
            Some(e) => self.flush(h, e, None, at_window).1,
            // Shutdown waits for the hook to be idle before it takes the
            // engine, so this cannot happen.
            None => {
                tracing::error!(jobs = h.queue.len(), "capture hook: deferred jobs left after the engine was dropped");
                Ok(())
            }
        }
    }

    /// Submits the queue, oldest first, each under the hook's lock, until
    /// it is empty or a hook window (other than `inside`'s, N21 only) is
    /// open or opening again; a job an engine window refuses is handled as
    /// `at_window` says. Returns the lock and, when a wait for an engine
    /// window ended the flush (interrupted, or refused inside this
    /// thread's own window), its error; the jobs not submitted stay
    /// queued, in order, either way.
    fn flush<'a>(
        &'a self,
        mut h: MutexGuard<'a, HookState>,
        engine: &TransferEngine,
        inside: Option<thread::ThreadId>,
        at_window: AtEngineWindow<'_>,
    ) -> (MutexGuard<'a, HookState>, Result<(), ProtocolError>) {
        let span = tracing::debug_span!("capture_hook_flush", jobs = h.queue.len()).entered();
        h.flushing += 1;
        let mut submitted = 0usize;
        let mut outcome = Ok(());
        loop {
            if h.windows.iter().any(|w| Some(w.owner) != inside) {
                break;
            }
            let Some(d) = h.queue.pop_front() else { break };
            let r = engine.submit_lane(d.id, d.lane, &d.blocks, d.first_subs.as_deref());
            let queued_s = d.queued_at.elapsed().as_secs_f64();
            match r {
                Ok(()) => {
                    h.deferred_for.insert(d.id, queued_s);
                    submitted += 1;
                }
                Err(TransferError::CaptureWindowOpen { .. }) if inside.is_none() => {
                    // An engine's own window (no hook window is open): back
                    // to the head of the queue, not submitted, not failed.
                    h.queue.push_front(d);
                    let AtEngineWindow::Wait(req) = at_window else { break };
                    // Wait for it without the hook's lock, then look again.
                    // The wait also ends at a window requested after this
                    // point, read under the hook's lock: a hook window's
                    // begin marks itself under that lock before it asks the
                    // coordinator, so one that begins during the wait is
                    // seen below and takes the rest over (a close never
                    // waits for another thread's hook window).
                    let since = self.coord.window_requests();
                    drop(h);
                    let waited = self
                        .coord
                        .rules()
                        .flush_wait_ends_at_request(since, |since| self.coord.wait_no_window(req, since));
                    h = sync::lock(&self.hook.state);
                    if let Err(e) = waited {
                        // Interrupted, or inside this thread's own window
                        // (which would never close while it waits).
                        outcome = Err(e);
                        break;
                    }
                    continue;
                }
                Err(e) => {
                    tracing::error!(job = d.id.0, error = %e, "capture hook: a deferred job was refused at its submission; reported failed");
                    h.failed.push(Completion {
                        job: d.id,
                        direction: d.lane.direction(),
                        lane: d.lane,
                        keys: Vec::new(),
                        bytes: d.bytes,
                        seconds: queued_s,
                        device_seconds: None,
                        backend: Backend::PerFragment,
                        error: Some(refusal_error(&e)),
                        deferred_seconds: queued_s,
                    });
                }
            }
            // `d`'s ticket goes here, after the engine took its own.
            drop(d);
            self.hook.cv.notify_all();
        }
        h.flushing -= 1;
        tracing::debug!(submitted, left = h.queue.len(), "capture hook: deferred jobs submitted");
        self.hook.cv.notify_all();
        drop(span);
        (h, outcome)
    }

    /// Submits job `id` to `engine` now, or defers it while a hook window
    /// is open or opening or deferred jobs wait (module docs). Called under
    /// the offloader's `inner` lock; the checks are the engine's in both
    /// cases (a deferred job's id, ranges, counts and skips are checked
    /// now, its compute-stream order at its submission).
    pub(super) fn submit_or_defer(
        &self,
        engine: &TransferEngine,
        id: JobId,
        lane: Lane,
        blocks: &JobBlocks,
        first_subs: Option<&[usize]>,
    ) -> Result<(), OffloaderError> {
        let mut h = sync::lock(&self.hook.state);
        if h.ids.contains(id) {
            return Err(TransferError::JobIdReused { id }.into());
        }
        if h.windows.is_empty() && !h.queue.is_empty() {
            // Deferred jobs that no flush submitted (an interrupted close
            // left them): theirs first, never waiting, so this job keeps
            // its place after them.
            h = self.flush(h, engine, None, AtEngineWindow::Stop).0;
        }
        if h.windows.is_empty() && h.queue.is_empty() {
            // Under the hook's lock: no hook window begins until this
            // submission returned, so a refusal here is for an engine's
            // own window (as before the hook existed).
            engine.submit_lane(id, lane, blocks, first_subs)?;
            h.ids.insert(id);
            return Ok(());
        }
        if engine.lane_stream(lane).is_none() {
            return Err(TransferError::NoExpeditedLane { id }.into());
        }
        let exp = match first_subs {
            Some(s) => self.geometry.layout.expand_skipping(id, blocks, s)?,
            None => self.geometry.layout.expand(id, blocks)?,
        };
        let ticket = self.coord.admit_job().map_err(|e| match e {
            ProtocolError::ShutDown => OffloaderError::ShutDown,
            e => e.into(),
        })?;
        h.ids.insert(id);
        h.queue.push_back(Deferred {
            id,
            lane,
            blocks: blocks.clone(),
            first_subs: first_subs.map(<[usize]>::to_vec),
            bytes: exp.bytes,
            queued_at: Instant::now(),
            _ticket: ticket,
        });
        tracing::debug!(job = id.0, ?lane, queued = h.queue.len(), "job deferred behind a capture hook window");
        Ok(())
    }

    /// Blocks while any of `ids` (every deferred job: `None`) waits in the
    /// queue; [`ProtocolError::WouldDeadlock`] when one does and this
    /// thread holds a hook window. While no hook window is open it submits
    /// the queue itself (beside a flush in progress, if any: each job
    /// leaves the queue in the critical section that submits it), waiting
    /// for an engine window that refuses a job, so a queue an interrupted
    /// close left is not waited for in vain; `WouldDeadlock` when that
    /// window is this thread's (the flush in progress would wait for it,
    /// and this wait for the flush, for ever).
    pub(super) fn wait_deferred(&self, engine: &TransferEngine, ids: Option<&[JobId]>) -> Result<(), OffloaderError> {
        let me = sync::this_thread();
        let mut h = sync::lock(&self.hook.state);
        loop {
            let pending = h.queue.iter().any(|d| ids.is_none_or(|ids| ids.contains(&d.id)));
            if !pending {
                return Ok(());
            }
            if self.coord.rules().refuses_wait_for_own_deferred(|| h.windows.iter().any(|w| w.owner == me)) {
                return Err(ProtocolError::WouldDeadlock {
                    what: "waiting for a job deferred behind this thread's capture hook window",
                }
                .into());
            }
            if h.windows.is_empty() {
                let (g, r) = self.flush(h, engine, None, AtEngineWindow::Wait(Request::new()));
                h = g;
                r?;
                // Empty, or a hook window began: look again.
                continue;
            }
            h = sync::wait(&self.hook.cv, h);
        }
    }

    /// For `poll`, under the `inner` lock: submits the deferred jobs no
    /// flush submitted, if no hook window is open (never waiting: an
    /// engine window that refuses one leaves it and the rest queued), and
    /// returns the deferred jobs the engine refused at their submission
    /// (each reported once, failed).
    pub(super) fn flush_and_take_refused(&self, engine: &TransferEngine) -> Vec<Completion> {
        let mut h = sync::lock(&self.hook.state);
        if h.windows.is_empty() && !h.queue.is_empty() {
            h = self.flush(h, engine, None, AtEngineWindow::Stop).0;
        }
        std::mem::take(&mut h.failed)
    }

    /// For `poll`: the seconds job `id` spent deferred (0 when it was not).
    pub(super) fn take_deferred_seconds(&self, id: JobId) -> f64 {
        sync::lock(&self.hook.state).deferred_for.remove(&id).unwrap_or(0.0)
    }

    /// For shutdown: refuses while a hook window is open or opening, waits
    /// for a flush in progress, submits what is still queued (never
    /// waiting: refused, `WindowOpen`, while an engine window refuses a job
    /// of it), and returns the hook's lock, to be held while the
    /// coordinator closes (so no hook window begins in between).
    pub(super) fn hook_quiesce(&self) -> Result<MutexGuard<'_, HookState>, OffloaderError> {
        let mut h = sync::lock(&self.hook.state);
        let mut engine: Option<Arc<TransferEngine>> = None;
        loop {
            if !h.windows.is_empty() {
                return Err(ProtocolError::WindowOpen { open: h.windows.len() }.into());
            }
            if h.flushing == 0 && h.queue.is_empty() {
                return Ok(h);
            }
            if h.flushing == 0 {
                // Left by an interrupted close. The engine is taken under
                // the `inner` lock, which comes before the hook's.
                let Some(e) = engine.as_deref() else {
                    drop(h);
                    engine = sync::lock(&self.inner).engine.clone();
                    if engine.is_none() {
                        // Taken by a shutdown, which quiesced first: the
                        // queue is empty by now.
                        return Err(ProtocolError::AlreadyShutDown.into());
                    }
                    h = sync::lock(&self.hook.state);
                    continue;
                };
                h = self.flush(h, e, None, AtEngineWindow::Stop).0;
                if !h.queue.is_empty() {
                    // An engine window refused a job: `close` would refuse
                    // for that window anyway (it may have closed since:
                    // then flush again).
                    self.refuse_while_windows_open()?;
                }
                continue;
            }
            // A flush waits only for engine windows to close (and ends at a
            // hook window's request, which the check above refuses), which
            // `close` refuses anyway: refuse now rather than wait for one
            // (it may be this thread's).
            self.refuse_while_windows_open()?;
            h = sync::wait(&self.hook.cv, h);
        }
    }

    /// For `hook_quiesce`: [`ProtocolError::WindowOpen`] when a capture
    /// window is open, naming the windows counted (read once: a refusal
    /// names what it saw, never `open: 0`).
    fn refuse_while_windows_open(&self) -> Result<(), OffloaderError> {
        match self.coord.activity().windows_open {
            0 => Ok(()),
            open => Err(ProtocolError::WindowOpen { open }.into()),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::UsedIds;
    use crate::transfer::JobId;

    #[test]
    fn used_ids_merge_into_runs_and_answer_membership() {
        let mut ids = UsedIds::default();
        for id in [5, 7, 6, 1, 3, 2, 10] {
            assert!(!ids.contains(JobId(id)), "{id} before its insert");
            ids.insert(JobId(id));
            assert!(ids.contains(JobId(id)), "{id} after its insert");
        }
        // 1-3 and 5-7 merged from both sides, 10 alone.
        assert_eq!(ids.runs.iter().map(|(&s, &e)| (s, e)).collect::<Vec<_>>(), [(1, 3), (5, 7), (10, 10)]);
        for id in [0, 4, 8, 9, 11] {
            assert!(!ids.contains(JobId(id)), "{id} never inserted");
        }
        ids.insert(JobId(4));
        ids.insert(JobId(u64::MAX));
        assert_eq!(
            ids.runs.iter().map(|(&s, &e)| (s, e)).collect::<Vec<_>>(),
            [(1, 7), (10, 10), (u64::MAX, u64::MAX)]
        );
    }
}
