//! The per-lane handler of a [`TransferEngine`]: its stream, its
//! order-after-compute event, its gather table, staging ring and staging
//! buffers, and its FIFO of jobs in flight ([`Queue`]); how it is made,
//! polled ([`TransferEngine::poll_finished`]: every event query through
//! [`Coordinator::try_unsafe_call`]), waited for, and released when the
//! engine drops.

use std::collections::VecDeque;
use std::time::Instant;

use crate::protocol::{Coordinator, JobTicket};
use crate::runtime::{Direction, DriverError, Event, GpuRuntime, Stream, GATHER_ENTRY_BYTES, GATHER_ENTRY_WORDS};
use crate::sync::{self, Mutex};

use super::backend::{Backend, GatherTable};
use super::engine::{JobResult, Lane, TransferEngine, TransferOptions};
use super::error::TransferError;
use super::ids::JobId;
use super::ring::{Ring, Table};
use super::staged::Staging;

/// How a job's completion is observed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Completion {
    /// Nothing was enqueued (it failed before its first copy).
    Immediate,
    /// Its completion event, recorded after its copies.
    Event(Event),
    /// Recording the completion event failed after copies were enqueued:
    /// the whole stream is synchronized before the job is reported.
    Stream,
}

pub(super) struct Pending {
    pub(super) id: JobId,
    pub(super) done: Completion,
    pub(super) error: Option<DriverError>,
    pub(super) bytes: u64,
    pub(super) fragments: usize,
    pub(super) backend: Backend,
    pub(super) submitted: Instant,
    /// The gather descriptor table's host staging copy: the stream reads it
    /// when it executes the upload, so it lives until the job completes.
    pub(super) staging: Table,
    pub(super) _ticket: JobTicket,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) jobs: VecDeque<Pending>,
    /// Completion events of reported jobs, for reuse.
    pub(super) spare: Vec<Event>,
    /// Ranges of the handler's staging ring held by jobs in `jobs`.
    pub(super) ring: Ring,
    /// When `jobs` last became empty (see [`AutoThresholds::duplex_linger`]).
    pub(super) idle_since: Option<Instant>,
}

pub(super) struct Handler {
    pub(super) lane: Lane,
    pub(super) dir: Direction,
    pub(super) stream: Stream,
    /// Recorded on the compute stream at each submission, waited for by
    /// `stream` (re-recording is safe: a wait binds to the work recorded
    /// when it is issued).
    pub(super) after_compute: Event,
    pub(super) table: Option<GatherTable>,
    /// The page-locked staging ring: address and capacity in words.
    pub(super) ring: Option<(usize, usize)>,
    /// Device staging buffers of the staged backend.
    pub(super) staged: Option<Staging>,
    pub(super) q: Mutex<Queue>,
}

impl TransferEngine {
    pub(super) fn make_handler(
        rt: &dyn GpuRuntime,
        coord: &Coordinator,
        lane: Lane,
        gather: bool,
        staged: bool,
        opts: &TransferOptions,
    ) -> Result<Handler, TransferError> {
        let (entries, ring_entries) = (opts.gather_table_entries, opts.staging_ring_entries);
        let stream = rt.stream_create()?;
        let after_compute = match rt.event_create() {
            Ok(e) => e,
            Err(e) => {
                if let Err(d) = rt.stream_destroy(stream) {
                    tracing::warn!(error = %d, "destroying a transfer stream after a failed set-up failed");
                }
                return Err(e.into());
            }
        };
        let mut h = Handler {
            lane,
            dir: lane.direction(),
            stream,
            after_compute,
            table: None,
            ring: None,
            staged: None,
            q: Mutex::new(Queue::default()),
        };
        if staged {
            match Staging::create(rt, coord, opts.staging_bytes, entries) {
                Ok(st) => h.staged = st,
                Err(e) => {
                    release_handler(rt, coord, h);
                    return Err(e);
                }
            }
        }
        if gather {
            // The kernel counts fragments in u32 and strides by the grid size.
            let entries = entries.clamp(1, 1 << 31);
            let bytes = entries * GATHER_ENTRY_BYTES;
            match coord.unsafe_call("allocating the gather descriptor table", |gate| rt.mem_alloc(gate, bytes)) {
                Ok(Ok(ptr)) => h.table = Some(GatherTable { ptr, entries }),
                Ok(Err(e)) => {
                    release_handler(rt, coord, h);
                    return Err(e.into());
                }
                Err(e) => {
                    release_handler(rt, coord, h);
                    return Err(e.into());
                }
            }
        }
        if gather || h.staged.is_some() {
            let words = ring_entries.saturating_mul(GATHER_ENTRY_WORDS);
            if words > 0 {
                match coord.unsafe_call("allocating the pinned staging ring", |gate| rt.mem_alloc_host(gate, words * 8))
                {
                    Ok(Ok(addr)) => {
                        h.ring = Some((addr, words));
                        if let Some(st) = h.staged.as_mut() {
                            st.use_ring(rt, addr, words * 8);
                        }
                        h.q = Mutex::new(Queue { ring: Ring::new(words), ..Queue::default() });
                    }
                    // Not fatal: tables then live in pageable memory.
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "no pinned staging ring; gather uploads will synchronize their stream")
                    }
                    Err(e) => {
                        release_handler(rt, coord, h);
                        return Err(e.into());
                    }
                }
            }
        }
        Ok(h)
    }

    /// Jobs that finished since the last call, in submission order per
    /// direction (stores first, then loads), each reported exactly once.
    ///
    /// Never blocks on the GPU and never makes a capture-unsafe call while a
    /// capture window is open: every event query goes through
    /// [`Coordinator::try_unsafe_call`], and when that says a window is busy
    /// the call returns what it already found.
    pub fn poll_finished(&self) -> Vec<JobResult> {
        let mut out = Vec::new();
        for h in &self.handlers {
            if !self.poll_handler(h, &mut out) {
                break;
            }
        }
        out
    }

    /// Reports the finished head of `h`'s queue; false when a window is
    /// open (stop polling).
    fn poll_handler(&self, h: &Handler, out: &mut Vec<JobResult>) -> bool {
        let mut q = sync::lock(&h.q);
        loop {
            let Some(head) = q.jobs.front() else { return true };
            let outcome = match head.done {
                Completion::Immediate => Ok(()),
                Completion::Event(ev) => match self.coord.try_unsafe_call(|gate| self.rt.event_query(gate, ev)) {
                    Err(_) => return false,
                    Ok(Ok(true)) => Ok(()),
                    Ok(Ok(false)) => return true,
                    Ok(Err(e)) => Err(e),
                },
                Completion::Stream => {
                    match self.coord.try_unsafe_call(|gate| self.rt.stream_synchronize(gate, h.stream)) {
                        Err(_) => return false,
                        Ok(r) => r,
                    }
                }
            };
            let Some(p) = q.jobs.pop_front() else { return true };
            if q.jobs.is_empty() {
                q.idle_since = Some(Instant::now());
            }
            if let Completion::Event(ev) = p.done {
                q.spare.push(ev);
            }
            if let Some(start) = p.staging.ring_start() {
                q.ring.release(start);
            }
            let error = p.error.clone().or(outcome.err());
            if let Some(e) = &error {
                tracing::warn!(job = p.id.0, error = %e, "transfer job failed");
            }
            out.push(JobResult {
                id: p.id,
                direction: h.dir,
                lane: h.lane,
                bytes: p.bytes,
                fragments: p.fragments,
                seconds: p.submitted.elapsed().as_secs_f64(),
                backend: p.backend,
                error,
            });
            // `p` drops here: its staging buffer and its ticket go now.
        }
    }

    /// Blocks until job `id` completed on the GPU. Its result is still
    /// reported (once) by [`TransferEngine::poll_finished`].
    ///
    /// Errors: [`TransferError::UnknownJob`] when it is not in flight (never
    /// submitted, or already reported); [`TransferError::JobFailed`] when it
    /// failed; [`TransferError::Protocol`] when called inside the caller's
    /// own capture window (a blocking, capture-unsafe wait there would
    /// deadlock).
    pub fn wait(&self, id: JobId) -> Result<(), TransferError> {
        let found = self.handlers.iter().find_map(|h| {
            let q = sync::lock(&h.q);
            q.jobs.iter().find(|p| p.id == id).map(|p| (h.stream, p.done, p.error.clone()))
        });
        let Some((stream, done, error)) = found else {
            return Err(TransferError::UnknownJob { id });
        };
        // A completed job's event may be reused by a later job meanwhile;
        // then this waits for that later job too, never less.
        let r = match done {
            Completion::Immediate => Ok(()),
            Completion::Event(ev) => {
                self.coord.unsafe_call("waiting for a transfer", |gate| self.rt.event_synchronize(gate, ev))?
            }
            Completion::Stream => {
                self.coord.unsafe_call("waiting for a transfer", |gate| self.rt.stream_synchronize(gate, stream))?
            }
        };
        match error.or(r.err()) {
            Some(error) => Err(TransferError::JobFailed { id, error }),
            None => Ok(()),
        }
    }

    /// Blocks until every job submitted so far has completed on the GPU
    /// (results still come from [`TransferEngine::poll_finished`]). Failed
    /// jobs are not errors here; a refused wait (inside the caller's own
    /// capture window) is.
    pub fn wait_all(&self) -> Result<(), TransferError> {
        for h in &self.handlers {
            let last = sync::lock(&h.q).jobs.back().map(|p| p.id);
            if let Some(id) = last {
                match self.wait(id) {
                    Ok(()) | Err(TransferError::JobFailed { .. }) | Err(TransferError::UnknownJob { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }
}

/// Destroys what a handler owns; waits for its stream first when jobs are
/// still in flight (their staging buffers and host memory are in use).
pub(super) fn release_handler(rt: &dyn GpuRuntime, coord: &Coordinator, h: Handler) {
    let q = match h.q.into_inner() {
        Ok(q) => q,
        Err(p) => p.into_inner(),
    };
    let mut jobs = q.jobs;
    let mut ring_in_use = false;
    if !jobs.is_empty() {
        match coord.unsafe_call("dropping the transfer engine", |gate| rt.stream_synchronize(gate, h.stream)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "synchronizing a transfer stream at drop failed"),
            Err(e) => {
                // Inside the caller's own window: the copies may still run,
                // so their staging buffers must outlive them: leak them.
                tracing::error!(error = %e, jobs = jobs.len(), "transfer engine dropped with jobs in flight inside a capture window; leaking their descriptor buffers");
                for p in jobs.iter_mut() {
                    std::mem::forget(std::mem::take(&mut p.staging));
                }
                ring_in_use = true;
            }
        }
    }
    if let Some(st) = h.staged {
        // Jobs in flight and the handler's stream not waited for: the second
        // stream may still run too.
        st.release(rt, coord, ring_in_use);
    }
    let mut events: Vec<Event> = q.spare;
    events.extend(jobs.iter().filter_map(|p| match p.done {
        Completion::Event(e) => Some(e),
        _ => None,
    }));
    events.push(h.after_compute);
    drop(jobs);
    for e in events {
        if let Err(err) = rt.event_destroy(e) {
            tracing::warn!(error = %err, "destroying a transfer event failed");
        }
    }
    if let Some((addr, _)) = h.ring {
        if ring_in_use {
            tracing::error!("pinned staging ring leaked (engine dropped with jobs in flight inside a capture window)");
        } else {
            // SAFETY: no job is in flight, or the handler's stream was
            // synchronized above, so no copy reads the ring any more (and
            // the staged streams were settled by `st.release`); the jobs
            // holding tables in it are dropped; nothing else points into it.
            match coord.unsafe_call("freeing the pinned staging ring", |gate| unsafe { rt.mem_free_host(gate, addr) }) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "freeing the pinned staging ring failed"),
                Err(e) => tracing::warn!(error = %e, "pinned staging ring leaked (dropped inside a capture window)"),
            }
        }
    }
    if let Some(t) = h.table.filter(|_| !ring_in_use) {
        // SAFETY: as for the ring: no gather kernel of this handler is still
        // queued or running (no job in flight, or the stream synchronized);
        // with jobs left running (`ring_in_use`) the table is leaked instead.
        match coord.unsafe_call("freeing the gather descriptor table", |gate| unsafe { rt.mem_free(gate, t.ptr) }) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "freeing the gather descriptor table failed"),
            Err(e) => tracing::warn!(error = %e, "gather descriptor table leaked (dropped inside a capture window)"),
        }
    }
    if let Err(e) = rt.stream_destroy(h.stream) {
        tracing::warn!(error = %e, "destroying a transfer stream failed");
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        let placeholder = || Handler {
            lane: Lane::Store,
            dir: Direction::DeviceToHost,
            stream: Stream(0),
            after_compute: Event(0),
            table: None,
            ring: None,
            staged: None,
            q: Mutex::new(Queue::default()),
        };
        for i in 0..self.handlers.len() {
            let h = std::mem::replace(&mut self.handlers[i], placeholder());
            release_handler(&*self.rt, &self.coord, h);
        }
    }
}
