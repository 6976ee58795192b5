//! [`Offloader`], the slot-addressed core an engine holds, and
//! [`KeyedOffloader`], the block manager's keyed layer on top of it.
//!
//! Built from one [`OffloaderOptions`] and the engine's [`KvSpec`], the core
//! owns the host region (anonymous, or shared by the ranks of a node), the
//! coordinator of the capture-safety protocol, the background pinner and
//! the transfer engine, and speaks the engine's words:
//!
//! - [`Offloader::start`]: background pinning begins (pre-fault, chunked
//!   registration, rollback to pageable memory on any failure; with a shared
//!   region, agreement of every rank before offloading turns on, P7);
//! - [`Offloader::capture_window`]: hold the returned guard around each CUDA
//!   graph capture: no library thread makes a capture-unsafe driver call
//!   while it is open (P1), and with the default policy it opens only once
//!   pinning is final (P2);
//! - [`Offloader::capture_hook`] ([`CaptureHook`]): the same window held
//!   without a guard, per thread and nested, for a hook around a
//!   framework's own capture calls (`torch.cuda.CUDAGraph`); it opens while
//!   pinning runs (waiting at most for the chunk registration in
//!   progress), and jobs submitted while one is open are deferred, never
//!   refused, and submitted when the last one closes (`hook.rs` has the
//!   rules);
//! - [`Offloader::submit`]: a [`SlotJob`] on a [`Lane`] (store, load, or
//!   the expedited load lane of `TransferOptions::expedited_lane`) by the
//!   engine's own job id, GPU block ids and host slot ids (no block
//!   manager: for engines that manage their own host blocks, vLLM's
//!   offloading connector);
//! - [`KeyedOffloader::lookup`], [`KeyedOffloader::store`],
//!   [`KeyedOffloader::load`] by block keys, placed by the block manager
//!   ([`KeyedOffloader`] owns one and a core; everything else is its
//!   [`KeyedOffloader::core`]);
//! - [`Offloader::poll_each`]: finished jobs, already applied to the block
//!   manager of a keyed offloader (a stored key becomes readable only once
//!   its store completed; a loaded key's slot is released once its load
//!   completed, P5);
//! - [`Offloader::pin_progress`] (or a [`PinObserver`] in the options,
//!   called from the pinning thread);
//! - [`Offloader::shutdown`] (also run by `Drop`, whose errors are logged):
//!   refused while a window is open or registered graphs live; drains the
//!   jobs, stops pinning, unregisters, frees what the offloader allocated
//!   (P4).
//!
//! Every wait and window takes a [`Request`]: `Request::new()`
//! blocks until what it waits for happens, `.interruptible(&check)` calls
//! `check` at least every 50 ms and withdraws when it says so (the Python
//! front's Ctrl-C), so each operation exists once (waits.rs has the
//! rules). The waits for jobs also take a `sink` for the completions they
//! take from the engine (an interruptible wait polls; a blocking one takes
//! none). The engine's own capture-unsafe driver calls (allocations,
//! synchronizes) go through [`Offloader::gated`], never around it.
//!
//! ```
//! use kvoffload::{shared, BlockKey, KeyedOffloader, KvAlloc, OffloaderOptions, Request, SimRuntime};
//!
//! # fn main() -> Result<(), kvoffload::OffloaderError> {
//! let rt = shared(SimRuntime::new()); // or CudaRuntime::open(0)?
//! let kv = KvAlloc { tensors: 2, page_bytes: 4096, gpu_blocks: 64, block_factor: 1 };
//! let off = KeyedOffloader::with_allocated_tensors(rt, kv, OffloaderOptions::with_host_blocks(128))?;
//! off.core().start()?; // pinning runs in the background from here
//! {
//!     let _window = off.core().capture_window(Request::new())?; // capture the engine's graphs here
//! }
//! let keys = [BlockKey::new(7, 0), BlockKey::new(8, 0)];
//! let stored = off.store(&keys, &[3, 4])?;
//! off.core().wait_all(Request::new(), &mut drop)?; // blocking: takes no completion
//! let done = off.poll();
//! assert!(done.iter().all(|c| c.error.is_none()));
//! assert_eq!(stored.stored.len(), 2);
//! let job = off.load(&keys, &[10, 11])?;
//! off.core().wait(job, Request::new(), &mut drop)?;
//! off.poll();
//! off.core().shutdown(Request::new(), &mut drop)?;
//! # Ok(()) }
//! ```
//!
//! The files of the module, one concern each:
//!
//! - `mod.rs`: the core type and its lock order, [`Geometry`], pinning,
//!   capture windows, [`GatedCalls`];
//! - `build.rs`: construction ([`Offloader::new`],
//!   [`Offloader::with_allocated_tensors`]): the region, the coordinator
//!   and the transfer engine;
//! - `keyed.rs`: [`KeyedOffloader`]: keyed jobs placed by the block
//!   manager, which the core applies each completion to (its job book,
//!   held by the core as what it is, a `KeyedBook`);
//! - `slots.rs`: [`SlotJob`], [`Offloader::submit`] and the busy-slot
//!   rule;
//! - `shutdown.rs`: [`Offloader::shutdown`] and the drop;
//! - `hook.rs`: [`CaptureHook`]: the capture hook's windows and deferred
//!   jobs;
//! - `waits.rs`: the waits for jobs ([`Offloader::wait`],
//!   [`Offloader::wait_jobs`], [`Offloader::wait_all`]), blocking or
//!   interruptible as their [`Request`] says, and
//!   [`Offloader::poll_each`], which applies completions to a keyed
//!   offloader's block manager;
//! - `request.rs`: how a request reaches the coordinator's waits;
//! - `options.rs`, `error.rs`: the options, the errors.

mod build;
mod error;
mod hook;
mod keyed;
mod options;
mod shutdown;
mod slots;
mod waits;

use std::collections::HashMap;

pub use crate::pin::{PinObserver, PinOutcome};
pub use error::OffloaderError;
pub use hook::CaptureHook;
pub use keyed::{KeyedOffloader, StoreSubmitted};
pub use options::{KvAlloc, KvSpec, OffloaderOptions, RegionSpec};
pub use slots::SlotJob;

use crate::manager::BlockKey;
use crate::pin::{spawn_pinner, Prefault, RankAgreement};
use crate::protocol::{CaptureWindow, Coordinator, GraphToken, PinState, ProtocolError, Request};
use crate::region::Region;
use crate::runtime::{DevicePtr, Direction, DriverError, Gate, GpuRuntime, Stream};
use crate::sync::atomic::AtomicBool;
use crate::sync::{self, thread, Arc, Mutex};
use crate::transfer::{Backend, JobBlocks, JobId, KvLayout, Lane, TransferEngine};
use keyed::KeyedBook;

/// A finished job, as [`Offloader::poll_each`] reports it (already applied to
/// the block manager of a [`KeyedOffloader`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The job.
    pub job: JobId,
    /// Store (`DeviceToHost`) or load (`HostToDevice`).
    pub direction: Direction,
    /// The lane that ran it: [`Lane::Store`], [`Lane::Load`], or
    /// [`Lane::LoadExpedited`] for a job submitted on it.
    pub lane: Lane,
    /// Its keys (none for a job of [`Offloader::submit`]: its id is the
    /// engine's, which knows its slots).
    pub keys: Vec<BlockKey>,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds from submission until completion was seen.
    pub seconds: f64,
    /// Device seconds of its copies, by CUDA's event timer: what a
    /// transfer rate is computed from (`bytes / device_seconds`); `seconds`
    /// also holds the wait for the compute stream, the lane's earlier jobs
    /// and the polling delay. `None` when the job could not be timed (it
    /// failed, or never reached the GPU).
    pub device_seconds: Option<f64>,
    /// The copy backend used.
    pub backend: Backend,
    /// `None` when every byte arrived. A failed store's keys are dropped
    /// (not readable); a failed load's keys stay stored.
    pub error: Option<DriverError>,
    /// Seconds the job waited, admitted, behind a capture hook window
    /// ([`CaptureHook::begin`]) before it was submitted; 0 when it was
    /// submitted at once. Included in `seconds`.
    pub deferred_seconds: f64,
}

/// Pinning progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinProgress {
    /// The state.
    pub state: PinState,
    /// Chunks registered when the state was read (at the same moment).
    pub chunks_done: usize,
    /// Chunks in all.
    pub chunks_total: usize,
    /// Bytes to pin.
    pub bytes_total: usize,
}

/// Where an offloader's blocks are, fixed at construction
/// ([`Offloader::geometry`]): the GPU (its runtime), the KV tensors and
/// their block sizes, the host blocks and the region they live in, the
/// transfer layout, the transfer lanes' streams.
#[derive(Clone)]
pub struct Geometry {
    /// The runtime of the GPU the KV tensors are on (for the engine's own
    /// capture and graph calls on its thread; its capture-unsafe
    /// operations need [`Offloader::gated`]).
    pub runtime: Arc<dyn GpuRuntime>,
    /// The KV description the offloader moves blocks of: the tensors (the
    /// engine's, or those the offloader allocated) with their page bytes,
    /// GPU blocks per tensor, GPU blocks per host block, the compute
    /// stream jobs are ordered after.
    pub kv: KvSpec,
    /// Host blocks of this rank: the slot ids `0..host_blocks` of
    /// [`SlotJob`]s, or a [`KeyedOffloader`]'s block manager's slots.
    pub host_blocks: usize,
    /// The transfer layout (host and device address of every block, per KV
    /// cache group).
    pub layout: KvLayout,
    /// The host region.
    pub region: Arc<Region>,
    /// The transfer handlers' streams, by [`Lane`] (store, load,
    /// expedited load).
    lane_streams: [Option<Stream>; 3],
}

impl std::fmt::Debug for Geometry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Geometry")
            .field("runtime", &self.runtime.backend())
            .field("kv", &self.kv)
            .field("host_blocks", &self.host_blocks)
            .field("layout", &self.layout)
            .field("region", &self.region)
            .field("lane_streams", &self.lane_streams)
            .finish()
    }
}

impl Geometry {
    /// Device addresses of the KV tensors.
    pub fn tensors(&self) -> Vec<DevicePtr> {
        self.kv.tensors.iter().map(|t| t.device_base).collect()
    }

    /// The compute stream jobs are ordered after.
    pub fn compute_stream(&self) -> Stream {
        self.kv.compute_stream
    }

    /// The stream of `lane`'s transfer handler (`None` for the expedited
    /// lane when it was not made); destroyed at shutdown. For diagnostics
    /// and tests that order work against a lane.
    pub fn lane_stream(&self, lane: Lane) -> Option<Stream> {
        match lane {
            Lane::Store => self.lane_streams[0],
            Lane::Load => self.lane_streams[1],
            Lane::LoadExpedited => self.lane_streams[2],
        }
    }
}

enum Pinner {
    NotStarted,
    Running(thread::JoinHandle<PinOutcome>),
    Done(PinOutcome),
}

/// A job in flight, until `poll` reports it.
struct JobSlots {
    direction: Direction,
    /// A slot job's `(group, slot)` pairs (empty for a keyed job).
    slots: Vec<(usize, usize)>,
}

struct Inner {
    engine: Option<Arc<TransferEngine>>,
    jobs: HashMap<JobId, JobSlots>,
    /// New jobs are refused: set by the shutdown, under this lock, before
    /// it drains (so a job is either refused or drained).
    closed: bool,
    /// The keyed layer's book, its block manager (`None`: the engine's own
    /// slot jobs): each job the keyed layer submitted through
    /// [`Jobs::submit`] is applied to it once it ended, under this lock,
    /// in the critical section that removes it from `jobs`.
    book: Option<KeyedBook>,
}

/// What [`Offloader::start`] hands the pinning thread, fixed at
/// construction.
struct PinStart {
    prefault: Arc<dyn Prefault>,
    /// Told of the pinning thread's progress (`OffloaderOptions::pin_observer`).
    observer: Option<Arc<dyn PinObserver>>,
    agreement: Option<RankAgreement>,
    /// Bytes to pin.
    bytes_total: usize,
}

/// What the offloader made itself (`with_allocated_tensors`), freed at
/// shutdown.
struct Owned {
    tensors: Vec<DevicePtr>,
    compute: Option<Stream>,
}

/// The slot-addressed core an engine holds; see the module docs.
///
/// Its locks, always taken in this order (a lock is never taken while a
/// later one is held):
///
/// 1. `shutting`, held by a shutdown for its whole run;
/// 2. `inner` (the jobs and the keyed layer's book) or `pinner` (the
///    pinning thread's handle): never both at once;
/// 3. the capture hook's (`hook.rs`), under `inner`, under `shutting`, or
///    alone;
/// 4. the layers' own (the transfer engine's, the coordinator's), inside
///    their calls.
///
/// `gated_threads` is a leaf: taken alone, nothing taken under it.
pub struct Offloader {
    coord: Arc<Coordinator>,
    /// Where the blocks are; its runtime is the offloader's.
    geometry: Geometry,
    pin_start: PinStart,
    pinner: Mutex<Pinner>,
    inner: Mutex<Inner>,
    owned: Owned,
    /// Serializes shutdowns: held by a shutdown for its whole run, so a
    /// second one waits for the first and is then refused.
    shutting: Mutex<()>,
    /// True once a shutdown passed its refusal point (written under
    /// `shutting`, read without it: `is_shut_down` never waits for a
    /// shutdown in progress).
    shut_down: AtomicBool,
    /// The capture hook's windows and deferred jobs (hook.rs).
    hook: hook::Hook,
    /// Threads inside [`Offloader::gated`]'s closure now: a capture window
    /// they asked for would wait for their own gated call (issue 28, item
    /// 3), so it is refused.
    gated_threads: Mutex<Vec<thread::ThreadId>>,
}

/// The core's jobs under its lock, for the keyed layer: its book, and
/// submission inside the same critical section.
pub(crate) struct Jobs<'a> {
    off: &'a Offloader,
    inner: &'a mut Inner,
}

impl Jobs<'_> {
    /// True once shutdown began (no job is accepted).
    pub(crate) fn closed(&self) -> bool {
        self.inner.closed
    }

    /// The keyed layer's book. Only a [`KeyedOffloader`] calls this, and
    /// its core is always built with a book, which is never taken out.
    pub(crate) fn book(&mut self) -> &mut KeyedBook {
        let Some(b) = self.inner.book.as_mut() else {
            unreachable!("a KeyedOffloader's core is built with its book");
        };
        b
    }

    /// Submits (or defers behind a hook window) the book's job `id`,
    /// recorded as in flight until `poll` reports it to the book.
    pub(crate) fn submit(&mut self, id: JobId, lane: Lane, blocks: &JobBlocks) -> Result<(), OffloaderError> {
        let engine = self.inner.engine.clone().ok_or(OffloaderError::ShutDown)?;
        self.off.submit_or_defer(&engine, id, lane, blocks, None)?;
        self.inner.jobs.insert(id, JobSlots { direction: lane.direction(), slots: Vec::new() });
        Ok(())
    }
}

/// Marks this thread as inside [`Offloader::gated`] while it lives (also
/// when the closure panics).
struct InGated<'a> {
    threads: &'a Mutex<Vec<thread::ThreadId>>,
    me: thread::ThreadId,
}

impl Drop for InGated<'_> {
    fn drop(&mut self) {
        let mut t = sync::lock(self.threads);
        if let Some(i) = t.iter().position(|&id| id == self.me) {
            t.swap_remove(i);
        }
    }
}

impl std::fmt::Debug for Offloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offloader")
            .field("backend", &self.rt().backend())
            .field("region_bytes", &self.geometry.region.len())
            .field("rank", &self.geometry.region.rank())
            .field("pin", &self.coord.pinning().state())
            .finish()
    }
}

impl Offloader {
    // ---- what the engine reads ----

    /// Where the blocks are: the GPU's runtime, the KV tensors, the host
    /// blocks and region, the transfer layout and lanes.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// The runtime of the GPU the offloader moves blocks on.
    fn rt(&self) -> &Arc<dyn GpuRuntime> {
        &self.geometry.runtime
    }

    /// The core's jobs under its lock (the keyed layer's submissions and
    /// lookups).
    pub(crate) fn jobs<R>(&self, f: impl FnOnce(&mut Jobs<'_>) -> R) -> R {
        let mut inner = sync::lock(&self.inner);
        f(&mut Jobs { off: self, inner: &mut inner })
    }

    // ---- pinning ----

    /// Starts background pinning (idempotent). With a shared region the
    /// outcome is published once every rank settled (P7).
    pub fn start(&self) -> Result<(), OffloaderError> {
        let mut p = sync::lock(&self.pinner);
        if !matches!(*p, Pinner::NotStarted) {
            return Ok(());
        }
        if self.coord.shutdown_steps().started() {
            return Err(OffloaderError::ShutDown);
        }
        let ps = &self.pin_start;
        let handle = spawn_pinner(
            self.rt().clone(),
            self.coord.clone(),
            ps.prefault.clone(),
            ps.observer.clone(),
            ps.agreement.clone(),
        );
        *p = Pinner::Running(handle);
        tracing::info!(bytes = ps.bytes_total, "background pinning started");
        Ok(())
    }

    /// Cancels pinning: the pinner stops at the next chunk boundary and
    /// rolls back, or, while it waits for the other ranks in the agreement
    /// (P7), stops waiting at once: it gives the ranks it waited for up, so
    /// they end pageable at once too, and this rank ends
    /// `Pageable(Cancelled)` with
    /// [`AgreementError::Cancelled`](crate::protocol::agreement::AgreementError::Cancelled)
    /// (or `ExchangeCancelled`, through a transport).
    /// A pinning that is already final is not changed. Returns at once;
    /// [`Offloader::wait_pinned`] then returns promptly.
    /// [`Offloader::shutdown`] does the same first.
    pub fn cancel_pinning(&self) {
        self.coord.pinning().cancel();
    }

    /// Holds pinning back while the guard lives: no chunk registration
    /// starts (the one in flight, if any, completes), so an engine's capture
    /// phase, dozens to hundreds of graphs captured back to back, never
    /// waits for a registration nor competes with one (issue 42: vLLM's
    /// graph capture took 8-15 s instead of 4-5 s while a 64 GiB region
    /// pinned). Pre-faulting goes on. Holds nest; pinning resumes when the
    /// last drops (on any thread). [`Offloader::shutdown`] and
    /// [`Offloader::cancel_pinning`] are never held up by a hold, and
    /// [`Offloader::wait_pinned`] on the thread that holds one is refused
    /// ([`ProtocolError::WouldDeadlock`](crate::protocol::ProtocolError)).
    pub fn hold_pinning(&self) -> crate::protocol::PinHold {
        self.coord.pinning().hold()
    }

    /// Pinning now: its state ([`PinProgress::state`]) and how far it got.
    pub fn pin_progress(&self) -> PinProgress {
        // One count for every state, read with it: the chunks registered
        // (while pinning runs, its state's `done`; once Pinned, every
        // chunk; during a rollback or after shutdown, what is left).
        let (state, chunks_done) = self.coord.pinning().snapshot();
        PinProgress {
            state,
            chunks_done,
            chunks_total: self.coord.pinning().chunk_count(),
            bytes_total: self.pin_start.bytes_total,
        }
    }

    /// Waits until pinning is final (and, with a shared region, agreed),
    /// starting it if needed, and returns how it ended. Refused inside the
    /// caller's own capture window with the Interleave policy (it would
    /// never return), and inside [`Offloader::gated`].
    ///
    /// Interruptible ([`Request::interruptible`]): the wait for a final pin
    /// state (which, with ranks that agree, comes only after the
    /// agreement) calls the check at least every 50 ms; interrupted, this
    /// thread stops waiting and the pinner goes on in the background as it
    /// did before the call (it was started by [`Offloader::start`], not by
    /// the wait, and the next `wait_pinned`, [`Offloader::shutdown`] or the
    /// drop joins it, as when nobody waited). The pinner is joined only
    /// once it published that state (its last step), so joining it does
    /// not wait for pinning or the agreement (one exception, as for a
    /// blocking request: pinning cancelled before it began is final at
    /// once, and the pinner still takes part in the agreement before it
    /// ends).
    pub fn wait_pinned(&self, req: Request<'_>) -> Result<PinOutcome, OffloaderError> {
        self.refuse_inside_gated("waiting for pinning inside gated()")?;
        self.start()?;
        self.coord.pinning().wait_final(req)?;
        self.join_pinner()
    }

    /// Joins the pinner (which has published a final state or is about to).
    fn join_pinner(&self) -> Result<PinOutcome, OffloaderError> {
        let mut p = sync::lock(&self.pinner);
        let out = match std::mem::replace(&mut *p, Pinner::NotStarted) {
            Pinner::Running(h) => match h.join() {
                Ok(o) => o,
                Err(_) => {
                    *p = Pinner::Done(PinOutcome { state: self.coord.pinning().state(), agreement: None });
                    return Err(OffloaderError::PinnerPanicked);
                }
            },
            Pinner::Done(o) => o,
            Pinner::NotStarted => PinOutcome { state: self.coord.pinning().state(), agreement: None },
        };
        *p = Pinner::Done(out.clone());
        Ok(out)
    }

    // ---- capture ----

    /// Opens a capture window: capture the engine's graphs while holding the
    /// guard. No library thread makes a capture-unsafe call while it is
    /// open; with the default policy it opens only once pinning is final
    /// (a request made [`Request::interleaved`] opens under the Interleave
    /// rules whatever the policy: it waits at most for the library call in
    /// flight). Interruptible ([`Request::interruptible`]): an interrupted
    /// request never opened and leaves the coordinator as before the call.
    /// For a hook around a framework's capture calls, where no guard can
    /// live: [`Offloader::capture_hook`].
    pub fn capture_window(&self, req: Request<'_>) -> Result<CaptureWindow, OffloaderError> {
        self.refuse_inside_gated("opening a capture window inside gated()")?;
        Ok(self.coord.open_window(req)?)
    }

    /// The capture hook ([`CaptureHook`]): windows held without a guard,
    /// per thread and nested, for a hook that wraps a framework's
    /// `capture_begin`/`capture_end`.
    pub fn capture_hook(&self) -> CaptureHook<'_> {
        CaptureHook::new(self)
    }

    /// [`ProtocolError::WouldDeadlock`] when this thread is inside
    /// [`Offloader::gated`]: a window (or a nested gated call, which waits
    /// for windows that wait for this call) would wait for itself.
    fn refuse_inside_gated(&self, what: &'static str) -> Result<(), OffloaderError> {
        let me = thread::current().id();
        if sync::lock(&self.gated_threads).contains(&me) {
            return Err(ProtocolError::WouldDeadlock { what }.into());
        }
        Ok(())
    }

    /// Runs `f` marked as inside gated (see `gated_threads`).
    fn run_gated<T>(&self, gate: &Gate, f: impl FnOnce(&GatedCalls<'_>) -> T) -> T {
        let me = thread::current().id();
        sync::lock(&self.gated_threads).push(me);
        let _mark = InGated { threads: &self.gated_threads, me };
        f(&GatedCalls { gate, rt: self.rt().as_ref() })
    }

    /// Records that a graph which references the region exists: shutdown
    /// is refused until the token is dropped (drop it after destroying the
    /// graph).
    pub fn register_graph(&self) -> Result<GraphToken, OffloaderError> {
        Ok(self.coord.register_graph()?)
    }

    /// Runs the engine's own capture-unsafe driver calls (allocations,
    /// synchronizes, event queries) on this offloader's runtime at a moment
    /// no capture window is open: `f` gets [`GatedCalls`], those calls and
    /// no others, and runs inside the offloader's gate, so windows wait
    /// until it returns (keep it short: a window opening meanwhile waits for
    /// all of it). Refused inside the caller's own window.
    ///
    /// Interruptible ([`Request::interruptible`]): while it waits for
    /// capture windows to close it calls the check at least every 50 ms
    /// and, when that returns true, returns [`ProtocolError::Interrupted`]
    /// without running `f` (nothing left counted). `f` itself is not
    /// interrupted.
    ///
    /// Inside `f`, opening a capture window ([`Offloader::capture_window`],
    /// [`CaptureHook::begin`]) or a nested `gated` is refused with
    /// [`ProtocolError::WouldDeadlock`]: it would wait for this call.
    pub fn gated<T>(
        &self,
        what: &'static str,
        req: Request<'_>,
        f: impl FnOnce(&GatedCalls<'_>) -> T,
    ) -> Result<T, OffloaderError> {
        self.refuse_inside_gated("gated() inside gated()")?;
        Ok(self.coord.unsafe_call(what, req, |gate| self.run_gated(gate, f))?)
    }

    // ---- completions ----

    /// Jobs submitted and not yet reported by [`Offloader::poll_each`].
    pub fn in_flight(&self) -> usize {
        sync::lock(&self.inner).jobs.len()
    }
}

/// What `off`'s coordinator has open, in flight or waiting right now: a
/// diagnostic of the layer below the offloader (the tests of the
/// interruptible waits check with it that an interrupted wait left nothing
/// counted; the Python test hooks' `activity`), reached through
/// `kvoffload::internal` only, not a call of the engine's API.
pub fn activity(off: &Offloader) -> crate::protocol::Activity {
    off.coord.activity()
}

/// Selects a known-bad variant of the protocol for `off`'s coordinator
/// (negative models only), reached through `kvoffload::internal` as
/// [`activity`] is, not a call of the engine's API.
#[cfg(any(loom, shuttle))]
pub fn set_variant(off: &Offloader, v: crate::protocol::Variant) {
    off.coord.set_variant(v);
}

/// The capture-unsafe driver calls an engine may make through
/// [`Offloader::gated`]: on the offloader's runtime, inside its gate, only
/// while the closure runs (the handle cannot leave it).
pub struct GatedCalls<'a> {
    gate: &'a Gate,
    rt: &'a dyn GpuRuntime,
}

impl GatedCalls<'_> {
    /// `cuMemAlloc` of `bytes` of device memory.
    pub fn mem_alloc(&self, bytes: usize) -> Result<DevicePtr, DriverError> {
        self.rt.mem_alloc(self.gate, bytes)
    }

    /// `cuMemFree`.
    ///
    /// # Safety
    /// As for [`GpuRuntime::mem_free`]: no device work still uses the
    /// allocation, and nothing uses `ptr` afterwards.
    pub unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<(), DriverError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.rt.mem_free(self.gate, ptr) }
    }

    /// `cuMemAllocHost` of `bytes` of page-locked host memory; returns its
    /// address.
    pub fn mem_alloc_host(&self, bytes: usize) -> Result<usize, DriverError> {
        self.rt.mem_alloc_host(self.gate, bytes)
    }

    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// As for [`GpuRuntime::mem_free_host`]: nothing (device work or host
    /// code) uses the memory afterwards.
    pub unsafe fn mem_free_host(&self, addr: usize) -> Result<(), DriverError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.rt.mem_free_host(self.gate, addr) }
    }

    /// `cuStreamSynchronize`.
    pub fn stream_synchronize(&self, stream: Stream) -> Result<(), DriverError> {
        self.rt.stream_synchronize(self.gate, stream)
    }

    /// `cuCtxSynchronize`.
    pub fn ctx_synchronize(&self) -> Result<(), DriverError> {
        self.rt.ctx_synchronize(self.gate)
    }

    /// `cuEventQuery`: true once complete.
    pub fn event_query(&self, event: crate::runtime::Event) -> Result<bool, DriverError> {
        self.rt.event_query(self.gate, event)
    }

    /// `cuEventSynchronize`.
    pub fn event_synchronize(&self, event: crate::runtime::Event) -> Result<(), DriverError> {
        self.rt.event_synchronize(self.gate, event)
    }
}
