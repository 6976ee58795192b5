//! Completions: building the engine's handlers, polling their completion
//! events (every query through the coordinator's gate), waiting for jobs,
//! and the engine's drop (the handlers released after their jobs).

use std::time::Instant;

use crate::protocol::{Coordinator, Request};
use crate::runtime::{Direction, Event, GpuRuntime, Stream, GATHER_ENTRY_BYTES, GATHER_ENTRY_WORDS};
use crate::sync::{self, Mutex};

use super::backend::GatherTable;
use super::engine::TransferEngine;
use super::error::TransferError;
use super::handler::{release_handler, Completion, Handler, Queue};
use super::ids::JobId;
use super::lane::{JobResult, Lane};
use super::options::TransferOptions;
use super::ring::Ring;
use super::staged::Staging;

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
            match coord
                .unsafe_call("allocating the gather descriptor table", Request::new(), |gate| rt.mem_alloc(gate, bytes))
            {
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
                match coord.unsafe_call("allocating the pinned staging ring", Request::new(), |gate| {
                    rt.mem_alloc_host(gate, words * 8)
                }) {
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
            let start = head.start;
            let mut device_ms = None;
            let outcome = match head.done {
                Completion::Immediate => Ok(()),
                // Queried, and once complete timed, in one gated call
                // (cuEventElapsedTime has no measured row yet: gated).
                Completion::Event(ev) => match self.coord.try_unsafe_call(|gate| {
                    let done = self.rt.event_query(gate, ev)?;
                    if done {
                        device_ms = start.and_then(|s| match self.rt.event_elapsed(gate, s, ev) {
                            Ok(ms) => Some(ms),
                            Err(e) => {
                                tracing::debug!(error = %e, "timing a job's events failed: reported without device time");
                                None
                            }
                        });
                    }
                    Ok(done)
                }) {
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
            q.spare.extend(p.start);
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
                device_seconds: device_ms.filter(|ms| error.is_none() && *ms >= 0.0).map(|ms| f64::from(ms) / 1e3),
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
            Completion::Event(ev) => self
                .coord
                .unsafe_call("waiting for a transfer", Request::new(), |gate| self.rt.event_synchronize(gate, ev))?,
            Completion::Stream => self.coord.unsafe_call("waiting for a transfer", Request::new(), |gate| {
                self.rt.stream_synchronize(gate, stream)
            })?,
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
