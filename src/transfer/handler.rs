//! The per-lane handler of a transfer engine: its stream, its
//! order-after-compute event, its gather table, staging ring and staging
//! buffers, and its FIFO of jobs in flight ([`Queue`]), and how it is
//! released ([`release_handler`]). Making, polling and waiting for the
//! handlers is `completion.rs`.

use std::collections::VecDeque;
use std::time::Instant;

use crate::protocol::{Coordinator, JobTicket, Request};
use crate::runtime::{Direction, DriverError, Event, GpuRuntime, Stream};
use crate::sync::Mutex;

use super::backend::{Backend, GatherTable};
use super::ids::JobId;
use super::lane::Lane;
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
    /// A timed event recorded on the lane's stream right before the job's
    /// copies (after its wait for the compute stream): with the completion
    /// event, the job's device time. `None` when it could not be made or
    /// recorded (the job is then reported without device time).
    pub(super) start: Option<Event>,
    /// The gather descriptor table's host staging copy: the stream reads it
    /// when it executes the upload, so it lives until the job completes.
    pub(super) staging: Table,
    pub(super) _ticket: JobTicket,
}

#[derive(Default)]
pub(super) struct Queue {
    pub(super) jobs: VecDeque<Pending>,
    /// Timed events (completion and start events of reported jobs), for
    /// reuse.
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
        match coord
            .unsafe_call("dropping the transfer engine", Request::new(), |gate| rt.stream_synchronize(gate, h.stream))
        {
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
    events.extend(jobs.iter().filter_map(|p| p.start));
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
            match coord.unsafe_call("freeing the pinned staging ring", Request::new(), |gate| unsafe {
                rt.mem_free_host(gate, addr)
            }) {
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
        match coord.unsafe_call("freeing the gather descriptor table", Request::new(), |gate| unsafe {
            rt.mem_free(gate, t.ptr)
        }) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "freeing the gather descriptor table failed"),
            Err(e) => tracing::warn!(error = %e, "gather descriptor table leaked (dropped inside a capture window)"),
        }
    }
    if let Err(e) = rt.stream_destroy(h.stream) {
        tracing::warn!(error = %e, "destroying a transfer stream failed");
    }
}
