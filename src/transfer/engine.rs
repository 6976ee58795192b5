//! The transfer engine: a store handler (GPU to host) and a load handler
//! (host to GPU), each with its own stream and FIFO of jobs, and with
//! [`TransferOptions::expedited_lane`] a third, for expedited loads
//! ([`Lane::LoadExpedited`]: its own stream, so it never waits behind the
//! regular loads; it still waits for the compute stream like every job).
//!
//! A job, at [`TransferEngine::submit`]:
//! 1. is checked and expanded ([`super::KvLayout::expand`]), admitted by the
//!    coordinator (refused once shutdown began; the ticket rides with the
//!    job until it is reported) and its id recorded (never reused);
//! 2. is ordered after the compute stream's pending work: an event recorded
//!    on the compute stream, waited for by the handler's stream;
//! 3. is enqueued by one backend ([`super::select`]) and closed by a
//!    completion event recorded on the handler's stream.
//!
//! [`TransferEngine::poll_finished`] queries completion events only through
//! [`Coordinator::try_unsafe_call`] (a query while the engine captures in
//! GLOBAL mode would invalidate its capture: docs/driver-rules.md, row
//! "cuEventQuery") and reports jobs in
//! submission order per direction, each exactly once, failed ones included.
//! Descriptor tables (in the handler's page-locked staging ring, or on the
//! heap when the ring is full: see the `ring` module) and admission tickets
//! live in the job until it is reported.

use std::time::Instant;

use crate::protocol::{Coordinator, JobTicket, ProtocolError};
use crate::rules::Rules;
use crate::runtime::{CaptureStatus, Direction, Event, GpuRuntime, Stream};
use crate::sync::{self, Arc, Mutex};

use super::backend::{Backend, BackendChoice};
use super::chunks::Chunks;
use super::error::TransferError;
use super::handler::{release_handler, Completion, Handler, Pending};
use super::ids::{IdSet, JobId};
use super::lane::Lane;
use super::layout::{Expansion, JobBlocks, KvLayout};
use super::options::TransferOptions;
use super::ring::Table;

/// The store, load and (optionally) expedited-load handlers of one
/// offloader (see the module docs).
pub struct TransferEngine {
    pub(super) rt: Arc<dyn GpuRuntime>,
    pub(super) coord: Arc<Coordinator>,
    layout: KvLayout,
    pub(super) opts: TransferOptions,
    compute: Stream,
    pub(super) chunks: Chunks,
    ids: Mutex<IdSet>,
    /// Indexed by [`Lane::index`]: store, load, and the expedited loads'
    /// when [`TransferOptions::expedited_lane`] is set.
    pub(super) handlers: Vec<Handler>,
}

impl TransferEngine {
    /// Creates the handlers (store, load, and the expedited loads' with
    /// [`TransferOptions::expedited_lane`]): a stream each, their events
    /// and, when the gather kernel may be used, a device descriptor table
    /// per handler (allocated as a capture-unsafe call through the
    /// coordinator).
    ///
    /// # Safety
    /// For as long as the engine has jobs in flight: the layout's host area
    /// (`host_base .. host_base + host_bytes`) stays mapped, and no Rust
    /// reference reads (during a store) or writes (during a load or store)
    /// the blocks a job touches; every tensor's device range is a live
    /// allocation of `rt`. The coordinator's chunks describe host memory
    /// that stays mapped while registered.
    pub unsafe fn new(
        rt: Arc<dyn GpuRuntime>,
        coord: Arc<Coordinator>,
        layout: KvLayout,
        compute: Stream,
        opts: TransferOptions,
    ) -> Result<Self, TransferError> {
        let wants_gather = matches!(opts.backend, BackendChoice::Auto | BackendChoice::Force(Backend::Gather));
        let wants_staged = matches!(opts.backend, BackendChoice::Auto | BackendChoice::Force(Backend::Staged))
            && opts.staging_bytes > 0;
        let chunks = Chunks::of(&coord);
        let lanes: &[Lane] = if opts.expedited_lane {
            &[Lane::Store, Lane::Load, Lane::LoadExpedited]
        } else {
            &[Lane::Store, Lane::Load]
        };
        let mut made: Vec<Handler> = Vec::with_capacity(lanes.len());
        for &lane in lanes {
            match Self::make_handler(&*rt, &coord, lane, wants_gather, wants_staged, &opts) {
                Ok(h) => made.push(h),
                Err(e) => {
                    for h in made {
                        release_handler(&*rt, &coord, h);
                    }
                    return Err(e);
                }
            }
        }
        debug_assert!(made.iter().enumerate().all(|(i, h)| h.lane.index() == i));
        Ok(TransferEngine {
            rt,
            coord,
            layout,
            opts,
            compute,
            chunks,
            ids: Mutex::new(IdSet::default()),
            handlers: made,
        })
    }

    /// The layout the engine moves blocks of.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The engine's options.
    pub fn options(&self) -> &TransferOptions {
        &self.opts
    }

    /// The stream of the regular handler for `dir` (diagnostics and tests).
    pub fn stream(&self, dir: Direction) -> Stream {
        self.handlers[Lane::of(dir).index()].stream
    }

    /// The stream of `lane`'s handler, `None` for an expedited lane that
    /// was not made (diagnostics and tests).
    pub fn lane_stream(&self, lane: Lane) -> Option<Stream> {
        self.handlers.get(lane.index()).map(|h| h.stream)
    }

    /// Jobs of `dir` submitted and not yet reported (every lane of `dir`).
    pub fn in_flight(&self, dir: Direction) -> usize {
        self.handlers.iter().filter(|h| h.dir == dir).map(|h| sync::lock(&h.q).jobs.len()).sum()
    }

    /// Submits a store (GPU to host) of `job`. See [`TransferEngine::submit`].
    pub fn store(&self, id: JobId, job: &JobBlocks) -> Result<(), TransferError> {
        self.submit(id, Direction::DeviceToHost, job)
    }

    /// Submits a load (host to GPU) of `job`. See [`TransferEngine::submit`].
    pub fn load(&self, id: JobId, job: &JobBlocks) -> Result<(), TransferError> {
        self.submit(id, Direction::HostToDevice, job)
    }

    /// Submits job `id` in direction `dir`.
    ///
    /// `Err` means the job was not accepted (bad ids or counts, a reused
    /// id, shutdown, a capture window open or about to open, a capturing
    /// compute stream) and will not be reported. `Ok` means it will be
    /// reported exactly once by [`TransferEngine::poll_finished`], failed
    /// if a driver call failed while enqueueing it or on the device.
    ///
    /// # Why submitting cannot race a capture of the compute stream
    ///
    /// The job is ordered after the compute stream's pending work by an
    /// event recorded on the compute stream and waited for by the handler's
    /// stream. Were the compute stream capturing at that record, the event
    /// would be a captured event and the wait would pull the handler's
    /// stream into the capture (cross-stream capture): the job's copies
    /// would be recorded into the engine's graph instead of running, and
    /// the engine's `end_capture` would fail with STREAM_CAPTURE_UNJOINED
    /// (904). Checking the status first and recording afterwards (what
    /// this function did before it moved inside the gate) is check-then-act: a capture can
    /// begin in between. Recording first and reading the outcome from the
    /// returned error does not work either: a record inside a capture
    /// succeeds. So the check, the record and the wait run inside the
    /// coordinator's gate ([`Coordinator::admit_job_outside_windows`]): no
    /// capture window is open and none opens until they are done, and the
    /// engine captures only inside its windows (the contract of
    /// [`Coordinator::open_window`] and `Offloader::capture_window`, the
    /// premise of P1). The status check stays, for a capture begun outside
    /// any window, which it still refuses when it is already running.
    /// The gate is tried, never waited for: a submit while a window is open
    /// is refused ([`TransferError::CaptureWindowOpen`]) rather than blocked,
    /// as the caller may hold locks the window's owner needs.
    pub fn submit(&self, id: JobId, dir: Direction, job: &JobBlocks) -> Result<(), TransferError> {
        let exp = self.layout.expand(id, job)?;
        self.submit_expanded(id, Lane::of(dir), &exp)
    }

    /// [`TransferEngine::submit`] on `lane` (with `first_subs`: the skip of
    /// each group's first host block, [`KvLayout::expand_skipping`]: the
    /// first and the last host block may be partial);
    /// [`TransferError::NoExpeditedLane`]
    /// for [`Lane::LoadExpedited`] on an engine made without it. Everything
    /// else as `submit`: jobs of one lane are enqueued, complete and are
    /// reported in submission order; lanes do not wait for each other.
    pub fn submit_lane(
        &self,
        id: JobId,
        lane: Lane,
        job: &JobBlocks,
        first_subs: Option<&[usize]>,
    ) -> Result<(), TransferError> {
        if self.handlers.get(lane.index()).is_none() {
            return Err(TransferError::NoExpeditedLane { id });
        }
        let exp = match first_subs {
            Some(s) => self.layout.expand_skipping(id, job, s)?,
            None => self.layout.expand(id, job)?,
        };
        self.submit_expanded(id, lane, &exp)
    }

    fn submit_expanded(&self, id: JobId, lane: Lane, exp: &Expansion) -> Result<(), TransferError> {
        self.coord.rules().accept_inside_gate(
            |ticket| self.accept(id, lane, exp, ticket),
            || self.coord.admit_job().map_err(|_| Err(TransferError::ShutDown { id })),
            |accept| match self.coord.admit_job_outside_windows(|_inside, ticket| accept(ticket)) {
                Ok(r) => r,
                Err(ProtocolError::ShutDown) => Err(TransferError::ShutDown { id }),
                Err(_) => Err(TransferError::CaptureWindowOpen { id }),
            },
        )
    }

    /// The body of [`TransferEngine::submit`] once the job is admitted:
    /// the compute stream's check, the job's id, and its enqueue.
    fn accept(&self, id: JobId, lane: Lane, exp: &Expansion, ticket: JobTicket) -> Result<(), TransferError> {
        // cuStreamIsCapturing of a stream no other thread captures is
        // measured capture-safe (cell capture_status_other).
        if self.rt.capture_status(self.compute)? != CaptureStatus::None {
            return Err(TransferError::ComputeCapturing { id });
        }
        if !sync::lock(&self.ids).insert(id) {
            return Err(TransferError::JobIdReused { id });
        }
        let h = &self.handlers[lane.index()];
        let dir = h.dir;
        let other_busy = self.other_busy(h);
        // The queue lock is held while enqueueing, so queue order is stream
        // order.
        let mut q = sync::lock(&h.q);
        let mut p = Pending {
            id,
            done: Completion::Immediate,
            error: None,
            bytes: exp.bytes,
            fragments: exp.fragments.len(),
            backend: Backend::PerFragment,
            submitted: Instant::now(),
            start: None,
            staging: Table::None,
            _ticket: ticket,
        };
        let done = match q.spare.pop() {
            Some(e) => Ok(e),
            None => self.rt.event_create_timed(),
        };
        match done {
            Err(e) => p.error = Some(e),
            Ok(done) => {
                let mut enqueued_any = false;
                let r = self
                    .rt
                    .event_record(h.after_compute, self.compute)
                    .and_then(|()| self.rt.stream_wait_event(h.stream, h.after_compute));
                match r {
                    Err(e) => p.error = Some(e),
                    Ok(()) => {
                        // The job's device time starts here: after its wait
                        // for the compute stream, before its first copy. Not
                        // fatal when it fails: the job is then untimed.
                        p.start = self.record_start(h, &mut q.spare);
                        enqueued_any = true;
                        let (backend, staging, r) = self.enqueue(h, &mut q.ring, exp, other_busy);
                        p.backend = backend;
                        p.staging = staging;
                        p.error = r.err();
                    }
                }
                if !enqueued_any {
                    q.spare.push(done);
                    q.spare.extend(p.start.take());
                } else {
                    match self.rt.event_record(done, h.stream) {
                        Ok(()) => p.done = Completion::Event(done),
                        Err(e) => {
                            tracing::warn!(job = id.0, error = %e, "recording a completion event failed; the job completes with its stream");
                            p.error.get_or_insert(e);
                            p.done = Completion::Stream;
                            q.spare.push(done);
                        }
                    }
                }
            }
        }
        if let Some(e) = &p.error {
            tracing::warn!(job = id.0, ?dir, error = %e, "transfer job failed at enqueue");
        } else {
            tracing::debug!(job = id.0, ?dir, bytes = p.bytes, fragments = p.fragments, backend = %p.backend, pinned_table = p.staging.pinned(), "transfer job enqueued");
        }
        q.jobs.push_back(p);
        Ok(())
    }

    /// A timed event (a spare one, or a new one) recorded on `h`'s stream;
    /// `None`, with the event kept for reuse, when the driver refuses.
    fn record_start(&self, h: &Handler, spare: &mut Vec<Event>) -> Option<Event> {
        let ev = match spare.pop() {
            Some(e) => e,
            None => match self.rt.event_create_timed() {
                Ok(e) => e,
                Err(e) => {
                    tracing::debug!(error = %e, "no start event: the job is reported without device time");
                    return None;
                }
            },
        };
        match self.rt.event_record(ev, h.stream) {
            Ok(()) => Some(ev),
            Err(e) => {
                tracing::debug!(error = %e, "recording a start event failed: the job is reported without device time");
                spare.push(ev);
                None
            }
        }
    }
}
