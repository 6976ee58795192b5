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

use std::collections::VecDeque;
use std::time::Instant;

use crate::protocol::{AliasGuard, ChunkReg, Coordinator, JobTicket, ProtocolError};
use crate::runtime::{
    CaptureStatus, DevicePtr, Direction, DriverError, DriverResult, Event, GpuRuntime, Stream, GATHER_ENTRY_BYTES,
    GATHER_ENTRY_WORDS,
};
use crate::sync::{self, Arc, Mutex};

use super::backend::{self, Backend, BackendChoice, GatherTable};
use super::chunks::Chunks;
use super::error::TransferError;
use super::ids::{IdSet, JobId};
use super::layout::{Expansion, JobBlocks, KvLayout};
use super::ring::{Ring, Table};
use super::select::{candidates, may_stage, AutoThresholds, Situation};
use super::staged::{Plan, Staging};

/// Settings of a [`TransferEngine`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TransferOptions {
    /// Backend for every job: automatic, or forced.
    pub backend: BackendChoice,
    /// Sizes at which the automatic choice switches backend.
    pub thresholds: AutoThresholds,
    /// Entries of each handler's device descriptor table for the gather
    /// kernel; a job with more fragments launches the kernel once per
    /// table-full (uploads and launches alternate on the handler's stream).
    pub gather_table_entries: usize,
    /// Entries of each handler's page-locked staging ring, where jobs write
    /// their descriptor tables so that uploads do not synchronize the
    /// stream (0: tables in pageable memory; a job that finds the ring full
    /// uses pageable memory too).
    pub staging_ring_entries: usize,
    /// Bytes of each handler's device staging memory for the staged
    /// backend ([`Backend::Staged`]): two buffers of half each, so one
    /// chunk's kernel overlaps the previous chunk's copies (0: no staged
    /// backend). Allocated at creation when the backend choice may use it.
    /// The default, 32 MiB, holds a 16 MiB job in one half: on the H200 it
    /// gave both ways at once 45.3 - 45.6 GB/s for the slower direction at
    /// 16 KiB fragments, against 43.5 - 44.5 with 16 MiB
    /// (docs/gpu-runs/2026-12-01-duplex-linger/).
    pub staging_bytes: usize,
    /// A third handler for expedited loads ([`Lane::LoadExpedited`]), with
    /// its own stream, completion FIFO, descriptor table, staging ring and
    /// staging memory (the cost of one more load handler). `false` (the
    /// default): an expedited load is refused
    /// ([`TransferError::NoExpeditedLane`]).
    pub expedited_lane: bool,
}

/// Which handler, with its own stream and FIFO, runs a job.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Stores (GPU to host).
    Store,
    /// Loads (host to GPU).
    Load,
    /// Expedited loads (host to GPU) on a stream of their own
    /// ([`TransferOptions::expedited_lane`]): never behind a regular load.
    LoadExpedited,
}

impl Lane {
    /// The lane of a regular job of `dir`.
    pub fn of(dir: Direction) -> Lane {
        match dir {
            Direction::DeviceToHost => Lane::Store,
            Direction::HostToDevice => Lane::Load,
        }
    }

    /// The direction its copies go.
    pub fn direction(self) -> Direction {
        match self {
            Lane::Store => Direction::DeviceToHost,
            Lane::Load | Lane::LoadExpedited => Direction::HostToDevice,
        }
    }

    fn index(self) -> usize {
        match self {
            Lane::Store => STORE,
            Lane::Load => LOAD,
            Lane::LoadExpedited => EXPEDITED,
        }
    }
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            backend: BackendChoice::Auto,
            thresholds: AutoThresholds::default(),
            gather_table_entries: 1 << 13,
            staging_ring_entries: 1 << 15,
            staging_bytes: 32 << 20,
            expedited_lane: false,
        }
    }
}

/// What became of one job, reported once by [`TransferEngine::poll_finished`].
#[derive(Clone, Debug, PartialEq)]
pub struct JobResult {
    /// The job's id.
    pub id: JobId,
    /// Store (`DeviceToHost`) or load (`HostToDevice`).
    pub direction: Direction,
    /// The lane that ran it.
    pub lane: Lane,
    /// Bytes the job moves.
    pub bytes: u64,
    /// Fragments after merging.
    pub fragments: usize,
    /// Seconds from submission until completion was observed (an upper
    /// bound on the transfer time: it includes the wait for compute and
    /// the polling delay).
    pub seconds: f64,
    /// The backend that enqueued the job.
    pub backend: Backend,
    /// `None` when every byte arrived; otherwise the driver error that
    /// failed the job (at enqueue or on the device).
    pub error: Option<DriverError>,
}

impl JobResult {
    /// True when the job completed without error.
    pub fn succeeded(&self) -> bool {
        self.error.is_none()
    }
}

/// How a job's completion is observed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Completion {
    /// Nothing was enqueued (it failed before its first copy).
    Immediate,
    /// Its completion event, recorded after its copies.
    Event(Event),
    /// Recording the completion event failed after copies were enqueued:
    /// the whole stream is synchronized before the job is reported.
    Stream,
}

struct Pending {
    id: JobId,
    done: Completion,
    error: Option<DriverError>,
    bytes: u64,
    fragments: usize,
    backend: Backend,
    submitted: Instant,
    /// The gather descriptor table's host staging copy: the stream reads it
    /// when it executes the upload, so it lives until the job completes.
    staging: Table,
    _ticket: JobTicket,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Pending>,
    /// Completion events of reported jobs, for reuse.
    spare: Vec<Event>,
    /// Ranges of the handler's staging ring held by jobs in `jobs`.
    ring: Ring,
    /// When `jobs` last became empty (see [`AutoThresholds::duplex_linger`]).
    idle_since: Option<Instant>,
}

struct Handler {
    lane: Lane,
    dir: Direction,
    stream: Stream,
    /// Recorded on the compute stream at each submission, waited for by
    /// `stream` (re-recording is safe: a wait binds to the work recorded
    /// when it is issued).
    after_compute: Event,
    table: Option<GatherTable>,
    /// The page-locked staging ring: address and capacity in words.
    ring: Option<(usize, usize)>,
    /// Device staging buffers of the staged backend.
    staged: Option<Staging>,
    q: Mutex<Queue>,
}

/// The store, load and (optionally) expedited-load handlers of one
/// offloader (see the module docs).
pub struct TransferEngine {
    rt: Arc<dyn GpuRuntime>,
    coord: Arc<Coordinator>,
    layout: KvLayout,
    opts: TransferOptions,
    compute: Stream,
    chunks: Chunks,
    ids: Mutex<IdSet>,
    /// Indexed by [`Lane::index`]: store, load, and the expedited loads'
    /// when [`TransferOptions::expedited_lane`] is set.
    handlers: Vec<Handler>,
    /// The coordinator runs [`Variant::RacySubmit`] (negative N9; always
    /// false outside loom builds).
    racy_submit: bool,
}

const STORE: usize = 0;
const LOAD: usize = 1;
const EXPEDITED: usize = 2;

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
        let racy_submit = crate::protocol::variant_is!(coord, RacySubmit);
        Ok(TransferEngine {
            rt,
            coord,
            layout,
            opts,
            compute,
            chunks,
            ids: Mutex::new(IdSet::default()),
            handlers: made,
            racy_submit,
        })
    }

    fn make_handler(
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

    /// [`TransferEngine::submit`] with the skip of each group's first host
    /// block given ([`KvLayout::expand_skipping`]: the first and the last
    /// host block may be partial). Everything else as `submit`.
    pub fn submit_skipping(
        &self,
        id: JobId,
        dir: Direction,
        job: &JobBlocks,
        first_subs: &[usize],
    ) -> Result<(), TransferError> {
        let exp = self.layout.expand_skipping(id, job, first_subs)?;
        self.submit_expanded(id, Lane::of(dir), &exp)
    }

    /// [`TransferEngine::submit`] on `lane` (with `first_subs`:
    /// [`TransferEngine::submit_skipping`]); [`TransferError::NoExpeditedLane`]
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
        if self.racy_submit {
            // N9 (loom builds only): the submit as it was before it moved inside the gate, outside
            // the gate.
            let ticket = self.coord.admit_job().map_err(|_| TransferError::ShutDown { id })?;
            return self.accept(id, lane, exp, ticket);
        }
        match self.coord.admit_job_outside_windows(|_inside, ticket| self.accept(id, lane, exp, ticket)) {
            Ok(r) => r,
            Err(ProtocolError::ShutDown) => Err(TransferError::ShutDown { id }),
            Err(_) => Err(TransferError::CaptureWindowOpen { id }),
        }
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
            staging: Table::None,
            _ticket: ticket,
        };
        let done = match q.spare.pop() {
            Some(e) => Ok(e),
            None => self.rt.event_create(),
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
                        enqueued_any = true;
                        let (backend, staging, r) = self.enqueue(h, &mut q.ring, exp, other_busy);
                        p.backend = backend;
                        p.staging = staging;
                        p.error = r.err();
                    }
                }
                if !enqueued_any {
                    q.spare.push(done);
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

    /// True when the other direction's handler has jobs in flight, or its
    /// last one was reported less than `duplex_linger` ago (only asked, and
    /// its queue only locked, when `h` can stage: the automatic choice
    /// stages then; see [`super::select`]). Called without `h`'s queue
    /// lock, so no two queue locks are ever held together.
    fn other_busy(&self, h: &Handler) -> bool {
        if h.staged.is_none() || self.opts.backend != BackendChoice::Auto {
            return false;
        }
        self.handlers.iter().filter(|o| o.dir != h.dir).any(|o| {
            let other = sync::lock(&o.q);
            !other.jobs.is_empty() || other.idle_since.is_some_and(|t| t.elapsed() < self.opts.thresholds.duplex_linger)
        })
    }

    /// Enqueues the fragments with the first allowed backend.
    fn enqueue(
        &self,
        h: &Handler,
        ring: &mut Ring,
        exp: &Expansion,
        other_busy: bool,
    ) -> (Backend, Table, DriverResult<()>) {
        let capturing = match self.rt.capture_status(h.stream) {
            Ok(CaptureStatus::None) => false,
            Ok(_) => true,
            Err(e) => return (Backend::PerFragment, Table::None, Err(e)),
        };
        let frags = &exp.fragments;
        let touched = self.touched_chunks(exp);
        let pinned = touched.as_ref().is_some_and(|t| self.all_registered(t));
        let mean_bytes = exp.bytes / frags.len().max(1) as u64;
        // The staged plan (host runs) only where staging could be chosen.
        let plan = match &h.staged {
            Some(st)
                if !capturing
                    && may_stage(self.opts.backend, &self.opts.thresholds, mean_bytes, pinned, other_busy) =>
            {
                // Runs end where a registration chunk ends: one copy may not
                // span two registrations.
                let chunk_end = |a: usize| {
                    self.chunks.locate(a).map_or(usize::MAX, |pos| {
                        let c = self.chunks.get(pos);
                        c.addr + c.len
                    })
                };
                Some(Plan::new(frags, st.half, st.entries, chunk_end))
            }
            _ => None,
        };
        let staged_run_bytes = plan.as_ref().map(Plan::mean_run_bytes);
        let sit = Situation { mean_bytes, capturing, pinned, other_busy, staged_run_bytes };
        for b in candidates(self.opts.backend, &self.opts.thresholds, sit) {
            match b {
                Backend::Staged => {
                    if let (Some(st), Some(plan)) = (&h.staged, &plan) {
                        debug_assert!(!capturing);
                        let (staging, r) = self.staged(h, st, ring, plan);
                        return (Backend::Staged, staging, r);
                    }
                }
                Backend::Gather => {
                    if let Some((staging, r)) = self.try_gather(h, ring, exp, touched.as_deref()) {
                        return (Backend::Gather, staging, r);
                    }
                }
                Backend::Batched => {
                    debug_assert!(!capturing);
                    // SAFETY: the engine's contract (TransferEngine::new)
                    // keeps every host and device range valid while jobs are
                    // in flight; the job is reported only after its
                    // completion event, recorded after these copies.
                    let r = match touched.as_ref().filter(|t| t.len() > 1) {
                        // A merged fragment may cross from one registration
                        // chunk into the next; one batched copy may not span
                        // two registrations (see `super::staged::Plan::new`).
                        Some(_) => {
                            let mut cut = Vec::with_capacity(frags.len() + self.chunks.len());
                            for f in frags {
                                self.chunks.split(*f, |_, piece| cut.push(piece));
                            }
                            unsafe { backend::batched(&*self.rt, h.dir, &cut, h.stream) }
                        }
                        None => unsafe { backend::batched(&*self.rt, h.dir, frags, h.stream) },
                    };
                    return (Backend::Batched, Table::None, r);
                }
                Backend::PerFragment => {
                    // SAFETY: as for the batched copy.
                    let r = unsafe { backend::per_fragment(&*self.rt, h.dir, frags, h.stream) };
                    return (Backend::PerFragment, Table::None, r);
                }
            }
        }
        unreachable!("candidates always end with PerFragment")
    }

    /// Positions (in `self.chunks`) of the chunks the job's host ranges
    /// touch, each once; `None` if a byte lies outside every chunk.
    fn touched_chunks(&self, exp: &Expansion) -> Option<Vec<usize>> {
        let mut seen = vec![false; self.chunks.len()];
        let mut out = Vec::new();
        for f in &exp.fragments {
            let inside = self.chunks.split(*f, |pos, _| {
                if !seen[pos] {
                    seen[pos] = true;
                    out.push(pos);
                }
            });
            if !inside {
                return None;
            }
        }
        Some(out)
    }

    /// True when every chunk in `touched` has completed registration (a
    /// snapshot: it only steers the choice between copy backends, which are
    /// safe on any memory; the gather kernel checks again under guard).
    fn all_registered(&self, touched: &[usize]) -> bool {
        touched
            .iter()
            .all(|&pos| matches!(self.coord.chunk_reg(self.chunks.get(pos).index), Some(ChunkReg::Registered { .. })))
    }

    /// The gather path: an alias guard for every chunk the job touches
    /// (none -> `None`, the caller falls back), the descriptor table
    /// encoded from those aliases, uploaded and launched; the guards are
    /// dropped once the launches are enqueued (an unregister then waits for
    /// the device: docs/driver-rules.md, row "Unregister waits for the
    /// device").
    fn try_gather(
        &self,
        h: &Handler,
        ring: &mut Ring,
        exp: &Expansion,
        touched: Option<&[usize]>,
    ) -> Option<(Table, DriverResult<()>)> {
        let table = h.table?;
        let touched = touched?;
        // One guard per chunk the job touches; `alias[pos]` is the device
        // address of that chunk's first byte while its guard is held.
        let mut guards: Vec<AliasGuard> = Vec::with_capacity(touched.len());
        let mut alias: Vec<DevicePtr> = vec![DevicePtr::NULL; self.chunks.len()];
        for &pos in touched {
            let c = self.chunks.get(pos);
            match self.coord.acquire_alias(c.addr, c.len) {
                Some(g) => {
                    alias[pos] = g.device;
                    guards.push(g);
                }
                None => {
                    tracing::debug!(chunk = c.index, "gather refused: chunk not registered; falling back");
                    return None;
                }
            }
        }
        // Every piece lies in a touched chunk (same split as touched_chunks).
        // The table is built and launched a table-full at a time, so the
        // GPU copies the first fragments while the host encodes the next
        // ones. The capacity covers every entry (a fragment gains one entry
        // per chunk boundary it crosses), so the buffer never moves while
        // the stream may still read an earlier piece.
        let per = table.entries.max(1) * GATHER_ENTRY_WORDS;
        let cap = (exp.fragments.len() + self.chunks.len()) * GATHER_ENTRY_WORDS;
        // In the pinned ring when it has room (a handler without a ring has
        // a zero-capacity one, which never does), else on the heap.
        let mut staging = match (h.ring, ring.alloc(cap)) {
            (Some((addr, _)), Some(start)) => {
                // SAFETY: `start + cap` is within the ring's words, so the
                // offset stays inside the one allocation at `addr`.
                Table::Pinned { ptr: unsafe { (addr as *mut u64).add(start) }, start, cap, len: 0 }
            }
            _ => Table::Heap(Vec::with_capacity(cap)),
        };
        let mut launched = 0;
        let mut r = Ok(());
        for f in &exp.fragments {
            self.chunks.split(*f, |pos, piece| {
                let host = alias[pos].offset(piece.host - self.chunks.get(pos).addr);
                staging.push(backend::entry(h.dir, piece, host));
            });
            if r.is_ok() && staging.len() - launched >= per {
                // SAFETY: as below, for the piece `launched..launched+per`.
                r = unsafe { backend::gather(&*self.rt, table, staging.words(launched, launched + per), h.stream) };
                launched += per;
            }
        }
        // SAFETY: `staging` (a heap vector that never grows past its
        // capacity, or this job's range of the pinned ring) moves into the
        // job and lives, unchanged, until it is reported, after its
        // completion event; every host address in the table is the alias of
        // a chunk whose guard is held until the launches are enqueued
        // (unregistering then waits for the device); host and device ranges
        // are valid by the engine's contract.
        if r.is_ok() && staging.len() > launched {
            r = unsafe { backend::gather(&*self.rt, table, staging.words(launched, staging.len()), h.stream) };
        }
        drop(guards);
        Some((staging, r))
    }

    /// The staged path: the plan's entries encoded into the pinned ring (or
    /// the heap), then chunk after chunk on the handler's two streams
    /// ([`super::staged`]).
    fn staged(&self, h: &Handler, st: &Staging, ring: &mut Ring, plan: &Plan) -> (Table, DriverResult<()>) {
        let cap = plan.pieces.len() * GATHER_ENTRY_WORDS;
        let mut table = match (h.ring, ring.alloc(cap)) {
            (Some((addr, _)), Some(start)) => {
                // SAFETY: `start + cap` is within the ring's words, so the
                // offset stays inside the one allocation at `addr`.
                Table::Pinned { ptr: unsafe { (addr as *mut u64).add(start) }, start, cap, len: 0 }
            }
            _ => Table::Heap(Vec::with_capacity(cap)),
        };
        let first = st.first_stream();
        for e in st.entries(h.dir, plan, first) {
            table.push(e);
        }
        // SAFETY: `table` moves into the job and lives, unchanged, until
        // the job is reported, after its completion event (recorded on the
        // handler's stream after it joined both staging streams); the
        // kernels touch device memory only (the job's pages, the handler's
        // staging buffers) and the table (in the ring, which lives until
        // the engine is dropped); host ranges are valid by the engine's
        // contract.
        let r = unsafe {
            st.enqueue(
                &*self.rt,
                &self.coord,
                h.dir,
                plan,
                table.words(0, table.len()),
                first,
                h.stream,
                h.after_compute,
            )
        };
        (table, r)
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
fn release_handler(rt: &dyn GpuRuntime, coord: &Coordinator, h: Handler) {
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
