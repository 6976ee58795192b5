//! [`Offloader`]: the one type an engine holds.
//!
//! Built from one [`OffloaderOptions`] and the engine's [`KvSpec`], it owns
//! the host region (anonymous, or shared by the ranks of a node), the
//! coordinator of the capture-safety protocol, the background pinner, the
//! transfer engine and the block manager, and speaks the engine's words:
//!
//! - [`Offloader::start`]: background pinning begins (pre-fault, chunked
//!   registration, rollback to pageable memory on any failure; with a shared
//!   region, agreement of every rank before offloading turns on, P7);
//! - [`Offloader::capture_window`]: hold the returned guard around each CUDA
//!   graph capture: no library thread makes a capture-unsafe driver call
//!   while it is open (P1), and with the default policy it opens only once
//!   pinning is final (P2);
//! - [`Offloader::capture_begin`], [`Offloader::capture_end`],
//!   [`Offloader::capture_abort`]: the same window held without a guard,
//!   per thread and nested, for a hook around a framework's own capture
//!   calls (`torch.cuda.CUDAGraph`); it opens while pinning runs (waiting
//!   at most for the chunk registration in progress), and jobs submitted
//!   while one is open are deferred, never refused, and submitted when the
//!   last one closes (`hook.rs` has the rules);
//! - [`Offloader::lookup`], [`Offloader::store`], [`Offloader::load`] by
//!   block keys and the engine's GPU block ids; or, for an engine that
//!   manages its own host blocks (built with [`Addressing::Slots`], e.g.
//!   [`OffloaderOptions::with_host_slots`]), [`Offloader::store_slots`] and
//!   [`Offloader::load_slots`] by its own job ids, GPU block ids and host
//!   slot ids (no block manager; the two kinds never mix on one offloader),
//!   and [`Offloader::load_slots_expedited`] on a lane of its own (with
//!   `TransferOptions::expedited_lane`);
//! - [`Offloader::poll`]: finished jobs, already applied to the block
//!   manager (a stored key becomes readable only once its store completed;
//!   a loaded key's slot is released once its load completed, P5);
//! - [`Offloader::pin_state`] and [`Offloader::pin_progress`] (or a
//!   [`PinObserver`] in the options, called from the pinning thread);
//! - [`Offloader::shutdown`] (also run by `Drop`, whose errors are logged):
//!   refused while a window is open or registered graphs live; drains the
//!   jobs, stops pinning, unregisters, frees what the offloader allocated
//!   (P4).
//!
//! The engine's own capture-unsafe driver calls (allocations, synchronizes)
//! go through [`Offloader::gated`], never around it.
//!
//! ```
//! use kvoffload::{shared, BlockKey, KvAlloc, Offloader, OffloaderOptions, SimRuntime};
//!
//! # fn main() -> Result<(), kvoffload::OffloaderError> {
//! let rt = shared(SimRuntime::new()); // or CudaRuntime::open(0)?
//! let kv = KvAlloc { tensors: 2, page_bytes: 4096, gpu_blocks: 64, block_factor: 1 };
//! let off = Offloader::with_allocated_tensors(rt, kv, OffloaderOptions::with_host_blocks(128))?;
//! off.start()?; // pinning runs in the background from here
//! {
//!     let _window = off.capture_window()?; // capture the engine's graphs here
//! }
//! let keys = [BlockKey::new(7, 0), BlockKey::new(8, 0)];
//! let stored = off.store(&keys, &[3, 4])?;
//! off.wait_all()?;
//! let done = off.poll();
//! assert!(done.iter().all(|c| c.error.is_none()));
//! assert_eq!(stored.stored.len(), 2);
//! let job = off.load(&keys, &[10, 11])?;
//! off.wait(job)?;
//! off.poll();
//! off.shutdown()?;
//! # Ok(()) }
//! ```
//!
//! The files of the module, one concern each:
//!
//! - `mod.rs`: the type, what the engine reads, pinning, capture windows,
//!   [`Offloader::poll`] and the waits, [`GatedCalls`];
//! - `build.rs`: construction ([`Offloader::new`],
//!   [`Offloader::with_allocated_tensors`]): the region, the coordinator,
//!   the transfer engine and the block manager;
//! - `keyed.rs`: keyed jobs ([`Offloader::lookup`], [`Offloader::store`],
//!   [`Offloader::load`]) placed by the block manager;
//! - `slots.rs`: the slot-addressed API ([`Offloader::store_slots`],
//!   [`Offloader::load_slots`], [`SlotJob`], [`Offloader::wait_jobs`]) and
//!   its busy-slot rule;
//! - `shutdown.rs`: [`Offloader::shutdown`] and the drop;
//! - `hook.rs`: the capture hook's windows and deferred jobs;
//! - `waits.rs`: the interruptible waits and [`Offloader::poll_each`],
//!   which applies completions to the block manager;
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
pub use keyed::StoreSubmitted;
pub use options::{Addressing, KvAlloc, KvSpec, OffloaderOptions, RegionSpec};
pub use slots::SlotJob;

use crate::manager::{BlockKey, BlockManager};
use crate::pin::{spawn_pinner, Prefault, RankAgreement};
use crate::protocol::{CaptureWindow, Coordinator, GraphToken, PinState, ProtocolError};
use crate::region::Region;
use crate::runtime::{DevicePtr, Direction, DriverError, Gate, GpuRuntime, Stream};
use crate::sync::atomic::AtomicBool;
use crate::sync::{self, thread, Arc, Mutex};
use crate::transfer::{Backend, JobId, KvLayout, Lane, TransferEngine};

/// A finished job, as [`Offloader::poll`] reports it (already applied to
/// the block manager).
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The job.
    pub job: JobId,
    /// Store (`DeviceToHost`) or load (`HostToDevice`).
    pub direction: Direction,
    /// The lane that ran it: [`Lane::Store`], [`Lane::Load`], or
    /// [`Lane::LoadExpedited`] for [`Offloader::load_slots_expedited`] and
    /// [`Offloader::load_slot_job_expedited`].
    pub lane: Lane,
    /// Its keys (none for a job of [`Offloader::store_slots`] or
    /// [`Offloader::load_slots`]: its id is the engine's, which knows its
    /// slots).
    pub keys: Vec<BlockKey>,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds from submission until completion was seen.
    pub seconds: f64,
    /// The copy backend used.
    pub backend: Backend,
    /// `None` when every byte arrived. A failed store's keys are dropped
    /// (not readable); a failed load's keys stay stored.
    pub error: Option<DriverError>,
    /// Seconds the job waited, admitted, behind a capture hook window
    /// ([`Offloader::capture_begin`]) before it was submitted; 0 when it
    /// was submitted at once. Included in `seconds`.
    pub deferred_seconds: f64,
}

/// Pinning progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinProgress {
    /// The state.
    pub state: PinState,
    /// Chunks registered.
    pub chunks_done: usize,
    /// Chunks in all.
    pub chunks_total: usize,
    /// Bytes to pin.
    pub bytes_total: usize,
}

enum Pinner {
    NotStarted,
    Running(thread::JoinHandle<PinOutcome>),
    Done(PinOutcome),
}

struct JobKeys {
    direction: Direction,
    keys: Vec<BlockKey>,
    /// A slot job's `(group, slot)` pairs (empty for keyed jobs), until
    /// `poll` reports it.
    slots: Vec<(usize, usize)>,
}

struct Inner {
    manager: BlockManager,
    engine: Option<Arc<TransferEngine>>,
    jobs: HashMap<JobId, JobKeys>,
    next_id: JobId,
    /// New jobs are refused: set by the shutdown, under this lock, before
    /// it drains (so a job is either refused or drained).
    closed: bool,
}

/// The one type an engine uses; see the module docs.
pub struct Offloader {
    rt: Arc<dyn GpuRuntime>,
    coord: Arc<Coordinator>,
    region: Arc<Region>,
    kv: KvSpec,
    layout: KvLayout,
    prefault: Arc<dyn Prefault>,
    /// Told of the pinning thread's progress (`OffloaderOptions::pin_observer`).
    pin_observer: Option<Arc<dyn PinObserver>>,
    agreement: Option<RankAgreement>,
    bytes_total: usize,
    addressing: Addressing,
    inner: Mutex<Inner>,
    pinner: Mutex<Pinner>,
    /// Tensors and the compute stream the offloader made, freed at shutdown.
    owned_tensors: Vec<DevicePtr>,
    owned_compute: Option<Stream>,
    /// Shut down: true once a shutdown passed its refusal point. The lock
    /// is held by a shutdown for its whole run, so a second one waits for
    /// the first and is refused.
    shut_down: Mutex<bool>,
    /// `shut_down`'s value, read without its lock (`is_shut_down`).
    shut: AtomicBool,
    /// The capture hook's windows and deferred jobs (hook.rs).
    hook: hook::Hook,
    /// Threads inside [`Offloader::gated`]'s closure now: a capture window
    /// they asked for would wait for their own gated call (issue 28, item
    /// 3), so it is refused.
    gated_threads: Mutex<Vec<thread::ThreadId>>,
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
            .field("backend", &self.rt.backend())
            .field("region_bytes", &self.region.len())
            .field("rank", &self.region.rank())
            .field("pin", &self.coord.pin_state())
            .finish()
    }
}

impl Offloader {
    // ---- what the engine reads ----

    /// The runtime (for capture and graph calls of the engine's own thread;
    /// its capture-unsafe operations need [`Offloader::gated`]).
    pub fn runtime(&self) -> &Arc<dyn GpuRuntime> {
        &self.rt
    }

    /// The KV description the offloader moves blocks of.
    pub fn kv(&self) -> &KvSpec {
        &self.kv
    }

    /// Device addresses of the KV tensors (the engine's, or those the
    /// offloader allocated).
    pub fn tensors(&self) -> Vec<DevicePtr> {
        self.kv.tensors.iter().map(|t| t.device_base).collect()
    }

    /// The compute stream jobs are ordered after.
    pub fn compute_stream(&self) -> Stream {
        self.kv.compute_stream
    }

    /// The transfer layout (host and device address of every block).
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The host region.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// How host blocks are addressed (keys or the engine's slot ids).
    pub fn addressing(&self) -> Addressing {
        self.addressing
    }

    /// Host blocks of this rank: the block manager's slots, or the slot ids
    /// `0..host_blocks()` of [`Addressing::Slots`].
    pub fn host_blocks(&self) -> usize {
        self.layout.num_host_blocks(0)
    }

    /// The stream of `lane`'s transfer handler (`None` for the expedited
    /// lane when it was not made, or after shutdown); for diagnostics and
    /// tests that order work against a lane.
    pub fn lane_stream(&self, lane: Lane) -> Option<Stream> {
        sync::lock(&self.inner).engine.as_ref().and_then(|e| e.lane_stream(lane))
    }

    // ---- pinning ----

    /// Starts background pinning (idempotent). With a shared region the
    /// outcome is published once every rank settled (P7).
    pub fn start(&self) -> Result<(), OffloaderError> {
        let mut p = sync::lock(&self.pinner);
        if !matches!(*p, Pinner::NotStarted) {
            return Ok(());
        }
        if self.coord.shutting_down() {
            return Err(OffloaderError::ShutDown);
        }
        let handle = spawn_pinner(
            self.rt.clone(),
            self.coord.clone(),
            self.prefault.clone(),
            self.pin_observer.clone(),
            self.agreement.clone(),
        );
        *p = Pinner::Running(handle);
        tracing::info!(bytes = self.bytes_total, "background pinning started");
        Ok(())
    }

    /// Cancels pinning: the pinner stops at the next chunk boundary and
    /// rolls back, or, while it waits for the other ranks in the agreement
    /// (P7), stops waiting at once: it gives the ranks it waited for up, so
    /// they end pageable at once too, and this rank ends
    /// `Pageable(Cancelled)` or `Pageable(PeerPageable)` with
    /// [`AgreementError::Cancelled`](crate::protocol::agreement::AgreementError::Cancelled).
    /// A pinning that is already final is not changed. Returns at once;
    /// [`Offloader::wait_pinned`] then returns promptly.
    /// [`Offloader::shutdown`] does the same first.
    pub fn cancel_pinning(&self) {
        self.coord.cancel_pinning();
    }

    /// The pin state now.
    pub fn pin_state(&self) -> PinState {
        self.coord.pin_state()
    }

    /// Pinning progress now.
    pub fn pin_progress(&self) -> PinProgress {
        let state = self.coord.pin_state();
        let total = self.coord.chunk_count();
        let done = match &state {
            PinState::Pinning { done, .. } => *done,
            PinState::Pinned => total,
            _ => self.coord.registered_chunks(),
        };
        PinProgress { state, chunks_done: done, chunks_total: total, bytes_total: self.bytes_total }
    }

    /// Waits until pinning is final (and, with a shared region, agreed),
    /// starting it if needed, and returns how it ended. Refused inside the
    /// caller's own capture window with the Interleave policy (it would
    /// never return).
    pub fn wait_pinned(&self) -> Result<PinOutcome, OffloaderError> {
        self.refuse_inside_gated("waiting for pinning inside gated()")?;
        self.start()?;
        self.coord.wait_pin_final()?;
        self.join_pinner()
    }

    /// Joins the pinner (which has published a final state or is about to).
    fn join_pinner(&self) -> Result<PinOutcome, OffloaderError> {
        let mut p = sync::lock(&self.pinner);
        let out = match std::mem::replace(&mut *p, Pinner::NotStarted) {
            Pinner::Running(h) => match h.join() {
                Ok(o) => o,
                Err(_) => {
                    *p = Pinner::Done(PinOutcome { state: self.coord.pin_state(), agreement: None });
                    return Err(OffloaderError::PinnerPanicked);
                }
            },
            Pinner::Done(o) => o,
            Pinner::NotStarted => PinOutcome { state: self.coord.pin_state(), agreement: None },
        };
        *p = Pinner::Done(out.clone());
        Ok(out)
    }

    // ---- capture ----

    /// Opens a capture window: capture the engine's graphs while holding the
    /// guard. No library thread makes a capture-unsafe call while it is
    /// open; with the default policy it opens only once pinning is final.
    pub fn capture_window(&self) -> Result<CaptureWindow, OffloaderError> {
        self.refuse_inside_gated("opening a capture window inside gated()")?;
        Ok(self.coord.open_window()?)
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
        f(&GatedCalls { gate, rt: self.rt.as_ref() })
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
    /// Inside `f`, opening a capture window ([`Offloader::capture_window`],
    /// [`Offloader::capture_begin`]) or a nested `gated` is refused with
    /// [`ProtocolError::WouldDeadlock`]: it would wait for this call.
    pub fn gated<T>(&self, what: &'static str, f: impl FnOnce(&GatedCalls<'_>) -> T) -> Result<T, OffloaderError> {
        self.refuse_inside_gated("gated() inside gated()")?;
        Ok(self.coord.unsafe_call(what, |gate| self.run_gated(gate, f))?)
    }

    /// [`Offloader::gated`], interruptible: while it waits for capture
    /// windows to close it calls `interrupted` at least every 50 ms and,
    /// when that returns true, returns [`ProtocolError::Interrupted`]
    /// without running `f` (nothing left counted). `f` itself is not
    /// interrupted.
    pub fn gated_interruptible<T>(
        &self,
        what: &'static str,
        interrupted: &dyn Fn() -> bool,
        f: impl FnOnce(&GatedCalls<'_>) -> T,
    ) -> Result<T, OffloaderError> {
        self.refuse_inside_gated("gated() inside gated()")?;
        Ok(self.coord.unsafe_call_interruptible(what, interrupted, |gate| self.run_gated(gate, f))?)
    }

    /// Refuses `call` unless the offloader addresses its host blocks by
    /// `want`.
    fn check_addressing(&self, call: &'static str, want: Addressing) -> Result<(), OffloaderError> {
        if self.addressing != want {
            return Err(OffloaderError::WrongAddressing { call, addressing: self.addressing });
        }
        Ok(())
    }

    // ---- completions ----

    /// Jobs that finished since the last call, in submission order per
    /// direction, each reported once, already applied to the block manager.
    /// Never blocks on the GPU and never makes a capture-unsafe call while a
    /// window is open (it then returns what it found so far).
    pub fn poll(&self) -> Vec<Completion> {
        let mut out = Vec::new();
        self.poll_each(&mut |c| out.push(c));
        out
    }

    /// Jobs submitted and not yet reported by [`Offloader::poll`].
    pub fn in_flight(&self) -> usize {
        sync::lock(&self.inner).jobs.len()
    }

    /// Blocks until job `id` completed on the GPU (it is still reported by
    /// [`Offloader::poll`]). Refused inside the caller's own window.
    pub fn wait(&self, id: JobId) -> Result<(), OffloaderError> {
        self.refuse_inside_gated("waiting for a job inside gated()")?;
        let engine = sync::lock(&self.inner).engine.clone().ok_or(OffloaderError::ShutDown)?;
        self.wait_deferred(Some(&[id]))?;
        engine.wait(id).map_err(|e| match e {
            crate::transfer::TransferError::UnknownJob { id } => OffloaderError::UnknownJob { id },
            e => e.into(),
        })
    }

    /// Blocks until every job submitted so far completed on the GPU (failed
    /// jobs are reported by [`Offloader::poll`], not here).
    pub fn wait_all(&self) -> Result<(), OffloaderError> {
        self.refuse_inside_gated("waiting for jobs inside gated()")?;
        let engine = sync::lock(&self.inner).engine.clone().ok_or(OffloaderError::ShutDown)?;
        self.wait_deferred(None)?;
        Ok(engine.wait_all()?)
    }
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
