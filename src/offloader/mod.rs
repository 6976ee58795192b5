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

mod error;
mod hook;
mod observe;
mod options;
mod waits;

use std::collections::{HashMap, HashSet};

pub use error::OffloaderError;
pub use observe::PinObserver;
pub use options::{Addressing, KvAlloc, KvSpec, OffloaderOptions, RegionSpec};

use crate::manager::{BlockKey, BlockManager, Lookup, ManagerConfig, Placement, Skipped};
use crate::pin::{pin_all, pin_all_agreed_by, Agreement, Prefault, Prepared, RankAgreement, RegionSlots};
use crate::protocol::agreement::{AgreementError, RankSlots};
use crate::protocol::{finish_shutdown, CaptureWindow, Coordinator, GraphToken, PinState, ProtocolError};
use crate::region::{page_size, AnonOptions, Layout, Region};
use crate::runtime::{DevicePtr, Direction, DriverError, Gate, GpuRuntime, Stream};
use crate::sync::{self, thread, Arc, Mutex};
use crate::transfer::{
    Backend, GroupSpec, HostPlacement, JobBlocks, JobId, KvLayout, Lane, TensorSpec, TransferEngine, TransferError,
};

/// What a store submission did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreSubmitted {
    /// The job that writes the stored keys, `None` when nothing needed
    /// storing (every key already stored or pending).
    pub job: Option<JobId>,
    /// Keys the job stores (readable once [`Offloader::poll`] reports it).
    pub stored: Vec<BlockKey>,
    /// Keys not stored, and why.
    pub skipped: Vec<Skipped>,
    /// Keys evicted to make room.
    pub evicted: Vec<BlockKey>,
}

/// A slot job over every KV cache group ([`Offloader::store_slot_job`],
/// [`Offloader::load_slot_job`]), in vLLM's shape: its
/// `GPULoadStoreSpec(block_ids, group_sizes, block_indices)` and
/// `CPULoadStoreSpec(chunk_ids)`.
#[derive(Copy, Clone, Debug)]
pub struct SlotJob<'a> {
    /// GPU block ids of every group, group after group.
    pub gpu_blocks: &'a [usize],
    /// GPU blocks of each group in `gpu_blocks`, one per group (0 for a
    /// group the job does not touch).
    pub group_sizes: &'a [usize],
    /// Host slot ids of every group, group after group: group `g` has
    /// `ceil((group_sizes[g] + first_subs[g]) / block_factor)` of them
    /// (none when its size is 0).
    pub slots: &'a [usize],
    /// Per group, the sub-blocks of its first slot before its first GPU
    /// block (vLLM's `block_indices[g] % block_factor`), below
    /// `block_factor`.
    pub first_subs: &'a [usize],
}

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

/// How the pinner ended, once it did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinOutcome {
    /// The final state.
    pub state: PinState,
    /// With a shared region: the agreement, or why it was not reached
    /// (this rank then runs on pageable memory).
    pub agreement: Option<Result<(), AgreementError>>,
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
    closed: bool,
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Down {
    Running,
    Down,
}

/// The one type an engine uses; see the module docs.
pub struct Offloader {
    rt: Arc<dyn GpuRuntime>,
    coord: Arc<Coordinator>,
    region: Arc<Region>,
    kv: KvSpec,
    layout: KvLayout,
    prefault: Arc<dyn Prefault>,
    agreement: Option<RankAgreement>,
    bytes_total: usize,
    addressing: Addressing,
    inner: Mutex<Inner>,
    pinner: Mutex<Pinner>,
    /// Tensors and the compute stream the offloader made, freed at shutdown.
    owned_tensors: Vec<DevicePtr>,
    owned_compute: Option<Stream>,
    down: Mutex<Down>,
    /// The capture hook's windows and deferred jobs (hook.rs).
    hook: hook::Hook,
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

/// The KV cache groups of the layout: one of every tensor, or
/// `opts.kv_groups` (slot addressing only), each of every GPU block and
/// every host slot.
fn kv_groups(kv: &KvSpec, opts: &OffloaderOptions) -> Result<Vec<GroupSpec>, OffloaderError> {
    let group = |tensors: &[TensorSpec]| GroupSpec {
        tensors: tensors.to_vec(),
        num_gpu_blocks: kv.gpu_blocks,
        num_host_blocks: opts.host_blocks,
    };
    let Some(sizes) = &opts.kv_groups else {
        return Ok(vec![group(&kv.tensors)]);
    };
    if opts.addressing != Addressing::Slots {
        return Err(OffloaderError::Options("kv_groups needs Addressing::Slots (keyed jobs have one group)".into()));
    }
    if sizes.is_empty() || sizes.contains(&0) || sizes.iter().sum::<usize>() != kv.tensors.len() {
        return Err(OffloaderError::Options(format!(
            "kv_groups {sizes:?} must be positive tensor counts summing to the {} KV tensors",
            kv.tensors.len()
        )));
    }
    let mut at = 0;
    Ok(sizes
        .iter()
        .map(|&n| {
            at += n;
            group(&kv.tensors[at - n..at])
        })
        .collect())
}

impl Offloader {
    /// Builds an offloader over the engine's own KV tensors (`kv`).
    ///
    /// Creates or joins the region, cuts it into registration chunks, makes
    /// the transfer engine (its streams and tables) and the block manager.
    /// Pinning starts with [`Offloader::start`].
    ///
    /// # Safety
    /// Every tensor of `kv` is a device allocation of `rt` of at least
    /// `gpu_blocks * page_bytes` bytes that stays allocated until this
    /// offloader is shut down (or dropped); `kv.compute_stream` is a stream
    /// of `rt` that lives as long. GPU blocks named in a store are not
    /// written, and GPU blocks named in a load neither read nor written, by
    /// the engine until [`Offloader::poll`] reports the job (or
    /// [`Offloader::wait`] returns for it): the copies are asynchronous.
    pub unsafe fn new(
        rt: Arc<dyn GpuRuntime>,
        kv: KvSpec,
        opts: OffloaderOptions,
    ) -> Result<Offloader, OffloaderError> {
        // SAFETY: forwarded to the caller.
        unsafe { Self::build(rt, kv, opts, Vec::new(), None) }
    }

    /// Builds an offloader that allocates its KV tensors itself (`alloc`)
    /// and a compute stream, and frees them at shutdown. The tensors'
    /// device addresses are [`Offloader::tensors`]; the stream is
    /// [`Offloader::compute_stream`].
    pub fn with_allocated_tensors(
        rt: Arc<dyn GpuRuntime>,
        alloc: KvAlloc,
        opts: OffloaderOptions,
    ) -> Result<Offloader, OffloaderError> {
        if alloc.tensors == 0 || alloc.page_bytes == 0 || alloc.gpu_blocks == 0 {
            return Err(OffloaderError::Options(format!("zero-sized KV allocation: {alloc:?}")));
        }
        let bytes = alloc.gpu_blocks.checked_mul(alloc.page_bytes).ok_or_else(|| {
            OffloaderError::Options(format!("{} blocks of {} bytes overflow", alloc.gpu_blocks, alloc.page_bytes))
        })?;
        // Allocations before the offloader's coordinator exists: each goes
        // through a coordinator of its own for `rt`, made for that call and
        // gone after it (no window can be open: a window needs a coordinator
        // of `rt`, and while this one lives no other can be made; if one
        // exists, say another offloader on this handle, this is refused).
        let gated = |what: &'static str, f: &mut dyn FnMut(&Gate) -> Result<(), DriverError>| {
            Coordinator::without_region(rt.as_ref(), Default::default())
                .and_then(|c| c.unsafe_call(what, |g| f(g)))
                .map_err(OffloaderError::from)
        };
        let free_all = |tensors: &[DevicePtr]| {
            for &p in tensors {
                // SAFETY: allocated above for this offloader and never used
                // by any device work (no job ran: the offloader was not
                // built).
                match gated("freeing a KV tensor", &mut |g| unsafe { rt.mem_free(g, p) }) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!(error = %e, "freeing a KV tensor failed"),
                    Err(e) => tracing::warn!(error = %e, "freeing a KV tensor refused"),
                }
            }
        };
        let mut tensors = Vec::with_capacity(alloc.tensors);
        for _ in 0..alloc.tensors {
            let mut got = None;
            let r = gated("allocating a KV tensor", &mut |g| {
                got = Some(rt.mem_alloc(g, bytes)?);
                Ok(())
            });
            match r.and_then(|r| r.map_err(OffloaderError::driver("allocating a KV tensor"))) {
                Ok(()) => tensors.extend(got),
                Err(e) => {
                    free_all(&tensors);
                    return Err(e);
                }
            }
        }
        let compute = match rt.stream_create() {
            Ok(s) => s,
            Err(e) => {
                free_all(&tensors);
                return Err(OffloaderError::driver("creating the compute stream")(e));
            }
        };
        let kv = KvSpec {
            tensors: tensors.iter().map(|&p| TensorSpec { device_base: p, page_bytes: alloc.page_bytes }).collect(),
            gpu_blocks: alloc.gpu_blocks,
            block_factor: alloc.block_factor,
            compute_stream: compute,
        };
        // SAFETY: the tensors and the stream were made above for this
        // offloader, which frees them at shutdown, after its jobs.
        let r = unsafe { Self::build(rt.clone(), kv, opts, tensors.clone(), Some(compute)) };
        if r.is_err() {
            if let Err(e) = rt.stream_destroy(compute) {
                tracing::warn!(error = %e, "destroying the compute stream failed");
            }
            free_all(&tensors);
        }
        r
    }

    /// # Safety
    /// As for [`Offloader::new`].
    unsafe fn build(
        rt: Arc<dyn GpuRuntime>,
        kv: KvSpec,
        opts: OffloaderOptions,
        owned_tensors: Vec<DevicePtr>,
        owned_compute: Option<Stream>,
    ) -> Result<Offloader, OffloaderError> {
        if kv.tensors.is_empty() || kv.gpu_blocks == 0 || kv.block_factor == 0 {
            return Err(OffloaderError::Options(format!(
                "the KV description needs tensors, GPU blocks and a block factor (got {} tensors, {} GPU blocks, factor {})",
                kv.tensors.len(),
                kv.gpu_blocks,
                kv.block_factor
            )));
        }
        if opts.host_blocks == 0 {
            return Err(OffloaderError::Options("host_blocks is 0".into()));
        }
        // A deferred reservation is made by pinning's pre-fault workers as
        // they reach each page, but the offloader's jobs may touch any host
        // block before pinning settles (on pageable memory); a page of a
        // full file system that nobody reserved would then fault with
        // SIGBUS in a copy. Until jobs reserve what they touch, the
        // offloader takes only regions reserved at create/join.
        if let RegionSpec::Shared { options, .. } = &opts.region {
            if options.reserve && options.defer_reserve {
                return Err(OffloaderError::Options(
                    "ShmOptions::defer_reserve is not accepted by an Offloader: its jobs may touch host blocks \
                     before pinning reserved them (a full file system would fault them with SIGBUS); it is for \
                     `kvoffload bench pin --shared` and callers that pin or call Region::reserve_rest before \
                     touching a page"
                        .into(),
                ));
            }
        }
        let block_bytes = kv.host_block_bytes();
        let page = page_size();
        let slot_bytes = block_bytes.div_ceil(page) * page;
        let ranks = opts.region.ranks();
        let rank = opts.region.rank();
        // Shared regions are rank-major: each rank's host blocks are
        // contiguous (its own data files), so each rank reserves, pre-faults
        // and registers only its share (`Region::pin_ranges`).
        let layout = match &opts.region {
            RegionSpec::Anonymous => Layout::new(1, slot_bytes, opts.host_blocks)?,
            RegionSpec::Shared { .. } => Layout::rank_major(ranks, slot_bytes, opts.host_blocks)?,
        };
        let region = match &opts.region {
            // Huge-page advice comes from the pin options (Prepared::new).
            RegionSpec::Anonymous => Region::anonymous(layout, &AnonOptions::new())?,
            RegionSpec::Shared { name, rank, options, .. } => {
                if *rank == 0 {
                    Region::create(name, layout, 0, options)?
                } else {
                    Region::join(name, layout, *rank, options)?
                }
            }
        };
        let region = Arc::new(region);
        let prepared = Prepared::new(rt.as_ref(), &region, &opts.pin)?;
        let bytes_total = prepared.bytes();
        let agreement = match (&opts.region, RegionSlots::new(region.clone())) {
            _ if opts.agreement.is_some() => opts.agreement.clone().map(RankAgreement::Transport),
            (RegionSpec::Shared { ranks, .. }, Some(slots)) if *ranks > 1 => {
                let slots: Arc<dyn RankSlots> = sync::arc_dyn(slots, |a| a);
                Some(Agreement { slots, rank, timeout: opts.agreement_timeout }.into())
            }
            _ => None,
        };
        let prefault = match &opts.pin_observer {
            Some(o) => observe::observed(prepared.prefault(), o.clone(), prepared.chunks()),
            None => prepared.prefault(),
        };
        let coord = prepared.coordinator().clone();
        // This rank's host blocks: block `i` is the rank's chunk `i`.
        let host_base = region.chunk_ptr(rank, 0)?.as_ptr() as usize;
        let groups = kv_groups(&kv, &opts)?;
        let placement = HostPlacement::BlockStrided { stride: layout.chunk_stride() };
        let kv_layout = KvLayout::new(&groups, kv.block_factor, host_base, placement)?;
        // Slot addressing uses no block manager; `poll` still applies each
        // completion to one (with no keys: nothing changes), so a
        // one-slot manager stands in.
        let manager_slots = match opts.addressing {
            Addressing::Keys => opts.host_blocks,
            Addressing::Slots => 1,
        };
        let manager = BlockManager::new(ManagerConfig::new(manager_slots, opts.eviction))?;
        // SAFETY: the host area is this rank's slots of `region`, which the
        // offloader (and the coordinator) hold until the engine is gone;
        // only the engine's DMA touches them (the offloader hands out no
        // reference into the region). The tensors and the compute stream
        // are the caller's contract.
        let engine = unsafe {
            TransferEngine::new(rt.clone(), coord.clone(), kv_layout.clone(), kv.compute_stream, opts.transfer)
        }?;
        tracing::info!(
            backend = rt.backend(),
            addressing = ?opts.addressing,
            rank,
            ranks,
            host_blocks = opts.host_blocks,
            block_bytes,
            region_bytes = region.len(),
            "offloader built"
        );
        Ok(Offloader {
            rt,
            coord,
            region,
            kv,
            layout: kv_layout,
            prefault,
            agreement,
            bytes_total,
            addressing: opts.addressing,
            inner: Mutex::new(Inner {
                manager,
                engine: Some(Arc::new(engine)),
                jobs: HashMap::new(),
                next_id: JobId(1),
                closed: false,
            }),
            pinner: Mutex::new(Pinner::NotStarted),
            owned_tensors,
            owned_compute,
            down: Mutex::new(Down::Running),
            hook: hook::Hook::new(),
        })
    }

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
        let (rt, coord, prefault, agreement) =
            (self.rt.clone(), self.coord.clone(), self.prefault.clone(), self.agreement.clone());
        let handle = thread::spawn(move || match agreement {
            None => PinOutcome { state: pin_all(rt.as_ref(), &coord, prefault.as_ref()), agreement: None },
            Some(a) => match pin_all_agreed_by(rt.as_ref(), &coord, prefault.as_ref(), &a) {
                Ok(state) => PinOutcome { state, agreement: Some(Ok(())) },
                Err(e) => {
                    tracing::error!(error = %e, "ranks did not agree; this rank runs on pageable memory");
                    PinOutcome { state: coord.pin_state(), agreement: Some(Err(e)) }
                }
            },
        });
        *p = Pinner::Running(handle);
        tracing::info!(bytes = self.bytes_total, "background pinning started");
        Ok(())
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
        Ok(self.coord.open_window()?)
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
    pub fn gated<T>(&self, what: &'static str, f: impl FnOnce(&GatedCalls<'_>) -> T) -> Result<T, OffloaderError> {
        let rt = self.rt.clone();
        Ok(self.coord.unsafe_call(what, |gate| f(&GatedCalls { gate, rt: rt.as_ref() }))?)
    }

    // ---- blocks ----

    /// What the offloader holds of each key (counts as a lookup for the
    /// eviction policy). With [`Addressing::Slots`] no key is ever held:
    /// every key is absent.
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<Lookup> {
        sync::lock(&self.inner).manager.lookup(keys)
    }

    /// Keys stored and readable now.
    pub fn stored_blocks(&self) -> usize {
        sync::lock(&self.inner).manager.len()
    }

    /// Refuses `call` unless the offloader addresses its host blocks by
    /// `want`.
    fn check_addressing(&self, call: &'static str, want: Addressing) -> Result<(), OffloaderError> {
        if self.addressing != want {
            return Err(OffloaderError::WrongAddressing { call, addressing: self.addressing });
        }
        Ok(())
    }

    fn check_gpu_blocks(&self, keys: &[BlockKey], gpu_blocks: &[usize]) -> Result<(), OffloaderError> {
        let factor = self.kv.block_factor;
        let need = keys.len().saturating_mul(factor);
        if gpu_blocks.len() != need {
            return Err(OffloaderError::GpuBlockCount { keys: keys.len(), factor, need, got: gpu_blocks.len() });
        }
        Ok(())
    }

    /// Stores `keys` from GPU blocks `gpu_blocks` (`block_factor` per key,
    /// in key order). Keys already stored or pending are skipped; slots are
    /// freed by eviction when needed (all or nothing). The stored keys
    /// become readable once [`Offloader::poll`] reports the job.
    ///
    /// The store is ordered after the work on the compute stream at this
    /// moment; the engine must not write those GPU blocks until the job is
    /// reported.
    pub fn store(&self, keys: &[BlockKey], gpu_blocks: &[usize]) -> Result<StoreSubmitted, OffloaderError> {
        self.check_addressing("store", Addressing::Keys)?;
        self.check_gpu_blocks(keys, gpu_blocks)?;
        let mut inner = sync::lock(&self.inner);
        if inner.closed {
            return Err(OffloaderError::ShutDown);
        }
        let out = inner.manager.prepare_store(keys)?;
        let evicted: Vec<BlockKey> = out.evicted.iter().map(|p| p.key).collect();
        if out.to_store.is_empty() {
            return Ok(StoreSubmitted { job: None, stored: Vec::new(), skipped: out.skipped, evicted });
        }
        let (gpu, slots, stored) = self.job_blocks(keys, gpu_blocks, &out.to_store);
        let id = inner.next_id;
        inner.next_id = JobId(inner.next_id.0 + 1);
        let engine = inner.engine.clone().ok_or(OffloaderError::ShutDown)?;
        if let Err(e) = self.submit_or_defer(&engine, id, Lane::Store, &JobBlocks::single(gpu, slots), None) {
            if let Err(m) = inner.manager.complete_store(&stored, false) {
                tracing::error!(error = %m, "undoing a refused store failed");
            }
            return Err(e);
        }
        inner.jobs.insert(id, JobKeys { direction: Direction::DeviceToHost, keys: stored.clone(), slots: Vec::new() });
        // N18 (loom builds only): the keys readable at submission.
        #[cfg(loom)]
        if crate::protocol::variant_is!(self.coord, ReadableAtSubmit) {
            let _ = inner.manager.complete_store(&stored, true);
        }
        Ok(StoreSubmitted { job: Some(id), stored, skipped: out.skipped, evicted })
    }

    /// Loads `keys` (each stored and readable) into GPU blocks `gpu_blocks`
    /// (`block_factor` per key, in key order). Their slots cannot be evicted
    /// until [`Offloader::poll`] reports the job.
    ///
    /// The load is ordered after the work on the compute stream at this
    /// moment; the engine must not touch those GPU blocks until the job is
    /// reported.
    pub fn load(&self, keys: &[BlockKey], gpu_blocks: &[usize]) -> Result<JobId, OffloaderError> {
        self.check_addressing("load", Addressing::Keys)?;
        self.check_gpu_blocks(keys, gpu_blocks)?;
        let mut inner = sync::lock(&self.inner);
        if inner.closed {
            return Err(OffloaderError::ShutDown);
        }
        let placements = inner.manager.prepare_load(keys)?;
        let (gpu, slots, _) = self.job_blocks(keys, gpu_blocks, &placements);
        let id = inner.next_id;
        inner.next_id = JobId(inner.next_id.0 + 1);
        let engine = inner.engine.clone().ok_or(OffloaderError::ShutDown)?;
        if let Err(e) = self.submit_or_defer(&engine, id, Lane::Load, &JobBlocks::single(gpu, slots), None) {
            if let Err(m) = inner.manager.complete_load(keys) {
                tracing::error!(error = %m, "undoing a refused load failed");
            }
            return Err(e);
        }
        inner.jobs.insert(id, JobKeys { direction: Direction::HostToDevice, keys: keys.to_vec(), slots: Vec::new() });
        // N19 (loom builds only): the slots released at submission.
        #[cfg(loom)]
        if crate::protocol::variant_is!(self.coord, SlotFreedAtLoadSubmit) {
            let _ = inner.manager.complete_load(keys);
        }
        Ok(id)
    }

    /// Stores GPU blocks `gpu_blocks` into host slots `slots` (the engine's
    /// slot ids, `0..host_blocks()`) as job `id`, the engine's id for it
    /// (with [`Addressing::Slots`] only). The slots' sub-blocks, `f`
    /// (`block_factor`) per slot in `slots` order, receive the GPU blocks
    /// from sub-block `first_sub` of the first slot on (vLLM's
    /// `block_indices[0] % f`): GPU block `i` goes to sub-block
    /// `(first_sub + i) % f` of slot `slots[(first_sub + i) / f]`, every
    /// tensor. So the first and the last slot may be partial (their other
    /// sub-blocks are not written), and
    /// `slots.len() == ceil((gpu_blocks.len() + first_sub) / f)`.
    ///
    /// The store is ordered after the work on the compute stream at this
    /// moment, as a keyed store; [`Offloader::poll`] reports it once (a
    /// [`Completion`] with no keys), with its bytes and seconds, and
    /// [`Offloader::wait`] / [`Offloader::wait_all`] wait for it. Until it
    /// is reported the engine must not write those GPU blocks, and the
    /// offloader refuses any other job on those slots
    /// ([`OffloaderError::SlotBusy`]); the engine still owns its slots
    /// (which slot holds what is its business, not checked). Once it is
    /// reported the slots hold the bytes and may be loaded, or stored
    /// again.
    ///
    /// With several KV cache groups ([`OffloaderOptions::kv_groups`]) use
    /// [`Offloader::store_slot_job`]; here they are refused
    /// ([`OffloaderError::SlotJobShape`]).
    ///
    /// Errors, with nothing submitted: [`OffloaderError::WrongAddressing`]
    /// on a keyed offloader; [`OffloaderError::ShutDown`];
    /// [`OffloaderError::SlotBusy`] (a store on a slot of a job not yet
    /// reported, a load on a slot of a store not yet reported); and from the
    /// transfer engine ([`OffloaderError::Transfer`]):
    /// [`TransferError::JobIdReused`] when `id` was used before (ids are
    /// never reused, reported or not; a refused call uses none),
    /// [`TransferError::FirstSubTooLarge`] (`first_sub >= f`),
    /// [`TransferError::HostCountMismatch`] (the slot count above),
    /// [`TransferError::HostBlockOutOfRange`] /
    /// [`TransferError::GpuBlockOutOfRange`] (the id and the limit),
    /// [`TransferError::RepeatedHostBlock`] /
    /// [`TransferError::RepeatedGpuBlock`] (within the job),
    /// [`TransferError::EmptyJob`], and the refusals every job has
    /// (a capture window open, a capturing compute stream, shutdown).
    ///
    /// [`TransferError::JobIdReused`]: crate::transfer::TransferError::JobIdReused
    /// [`TransferError::FirstSubTooLarge`]: crate::transfer::TransferError::FirstSubTooLarge
    /// [`TransferError::HostCountMismatch`]: crate::transfer::TransferError::HostCountMismatch
    /// [`TransferError::HostBlockOutOfRange`]: crate::transfer::TransferError::HostBlockOutOfRange
    /// [`TransferError::GpuBlockOutOfRange`]: crate::transfer::TransferError::GpuBlockOutOfRange
    /// [`TransferError::RepeatedHostBlock`]: crate::transfer::TransferError::RepeatedHostBlock
    /// [`TransferError::RepeatedGpuBlock`]: crate::transfer::TransferError::RepeatedGpuBlock
    /// [`TransferError::EmptyJob`]: crate::transfer::TransferError::EmptyJob
    pub fn store_slots(
        &self,
        id: JobId,
        gpu_blocks: &[usize],
        slots: &[usize],
        first_sub: usize,
    ) -> Result<(), OffloaderError> {
        let job = SlotJob { gpu_blocks, group_sizes: &[gpu_blocks.len()], slots, first_subs: &[first_sub] };
        self.submit_slots("store_slots", Lane::Store, id, &job)
    }

    /// Loads host slots `slots` into GPU blocks `gpu_blocks` as job `id`
    /// (the engine's id), with [`Addressing::Slots`] only: GPU block `i`
    /// receives sub-block `(first_sub + i) % f` of slot
    /// `slots[(first_sub + i) / f]` (as [`Offloader::store_slots`] placed
    /// it). The slots hold what the engine's last reported store to them
    /// wrote (not checked: the engine owns its slots). Until
    /// [`Offloader::poll`] reports the job the engine must not touch those
    /// GPU blocks, and a store to those slots is refused
    /// ([`OffloaderError::SlotBusy`]; other loads of them are not).
    /// Ordering, reporting, waits and errors as [`Offloader::store_slots`].
    pub fn load_slots(
        &self,
        id: JobId,
        gpu_blocks: &[usize],
        slots: &[usize],
        first_sub: usize,
    ) -> Result<(), OffloaderError> {
        let job = SlotJob { gpu_blocks, group_sizes: &[gpu_blocks.len()], slots, first_subs: &[first_sub] };
        self.submit_slots("load_slots", Lane::Load, id, &job)
    }

    /// [`Offloader::load_slots`] on the expedited lane (vLLM's
    /// `submit_load(..., expedited=True)`): its own stream and completion
    /// FIFO, so it never waits behind regular loads (or stores); like every
    /// job it is ordered after the compute stream, reported by
    /// [`Offloader::poll`] (with [`Lane::LoadExpedited`]; expedited loads
    /// in their submission order), waited for and deferred behind a
    /// capture hook window as any other, and slot-checked as a load.
    /// Needs the lane: `OffloaderOptions::transfer.expedited_lane = true`
    /// (a third transfer handler: a stream, its events, descriptor table,
    /// staging ring and staging memory); without it
    /// [`TransferError::NoExpeditedLane`] (nothing submitted).
    ///
    /// [`TransferError::NoExpeditedLane`]: crate::transfer::TransferError::NoExpeditedLane
    pub fn load_slots_expedited(
        &self,
        id: JobId,
        gpu_blocks: &[usize],
        slots: &[usize],
        first_sub: usize,
    ) -> Result<(), OffloaderError> {
        let job = SlotJob { gpu_blocks, group_sizes: &[gpu_blocks.len()], slots, first_subs: &[first_sub] };
        self.submit_slots("load_slots_expedited", Lane::LoadExpedited, id, &job)
    }

    /// [`Offloader::load_slot_job`] on the expedited lane (see
    /// [`Offloader::load_slots_expedited`]).
    pub fn load_slot_job_expedited(&self, id: JobId, job: &SlotJob<'_>) -> Result<(), OffloaderError> {
        self.submit_slots("load_slot_job_expedited", Lane::LoadExpedited, id, job)
    }

    /// The stream of `lane`'s transfer handler (`None` for the expedited
    /// lane when it was not made, or after shutdown); for diagnostics and
    /// tests that order work against a lane.
    pub fn lane_stream(&self, lane: Lane) -> Option<Stream> {
        sync::lock(&self.inner).engine.as_ref().and_then(|e| e.lane_stream(lane))
    }

    /// [`Offloader::store_slots`] over every KV cache group of an
    /// offloader built with [`OffloaderOptions::kv_groups`] (or its one
    /// group): group `g`'s GPU blocks and slots are its part of
    /// `job.gpu_blocks` and `job.slots`, placed as `store_slots` places
    /// one group's, from sub-block `job.first_subs[g]` of its first slot;
    /// within a slot, group `g` touches only its own tensors' pages.
    /// [`OffloaderError::SlotJobShape`] when `group_sizes` or `first_subs`
    /// has not one entry per group, `gpu_blocks` is not `group_sizes` long
    /// in all, or `slots` not as long as the groups need (with one group:
    /// `HostCountMismatch`, as for `store_slots`); every check of
    /// `store_slots` per group (the errors name the group).
    pub fn store_slot_job(&self, id: JobId, job: &SlotJob<'_>) -> Result<(), OffloaderError> {
        self.submit_slots("store_slot_job", Lane::Store, id, job)
    }

    /// [`Offloader::load_slots`] over every KV cache group, as
    /// [`Offloader::store_slot_job`] stores them.
    pub fn load_slot_job(&self, id: JobId, job: &SlotJob<'_>) -> Result<(), OffloaderError> {
        self.submit_slots("load_slot_job", Lane::Load, id, job)
    }

    /// The job's blocks, group by group (the shape checks of
    /// [`Offloader::store_slot_job`]; the rest is the engine's).
    fn slot_job_blocks(&self, job: &SlotJob<'_>) -> Result<JobBlocks, OffloaderError> {
        let groups = self.layout.num_groups();
        let shape = |what, given, expected| Err(OffloaderError::SlotJobShape { what, given, expected });
        if job.group_sizes.len() != groups {
            return shape("group_sizes entries (one per KV cache group)", job.group_sizes.len(), groups);
        }
        if job.first_subs.len() != groups {
            return shape("first_subs entries (one per KV cache group)", job.first_subs.len(), groups);
        }
        let gpu_total = job.group_sizes.iter().fold(0usize, |a, &n| a.saturating_add(n));
        if job.gpu_blocks.len() != gpu_total {
            return shape("GPU block ids (the sum of group_sizes)", job.gpu_blocks.len(), gpu_total);
        }
        let f = self.kv.block_factor;
        let need: Vec<usize> = job
            .group_sizes
            .iter()
            .zip(job.first_subs)
            .map(|(&n, &s)| if n == 0 { 0 } else { n.saturating_add(s).div_ceil(f) })
            .collect();
        let slots_total = need.iter().fold(0usize, |a, &n| a.saturating_add(n));
        if job.slots.len() != slots_total {
            if groups == 1 {
                // The engine's check names the group, the skip and the need
                // (TransferError::HostCountMismatch).
                return Ok(JobBlocks::single(job.gpu_blocks.to_vec(), job.slots.to_vec()));
            }
            return shape(
                "host slot ids (ceil((size + first_sub) / block_factor) per group)",
                job.slots.len(),
                slots_total,
            );
        }
        let (mut g_at, mut s_at) = (0, 0);
        let mut out = JobBlocks { groups: Vec::with_capacity(groups) };
        for (&n, &h) in job.group_sizes.iter().zip(&need) {
            out.groups.push(crate::transfer::GroupBlocks {
                gpu: job.gpu_blocks[g_at..g_at + n].to_vec(),
                host: job.slots[s_at..s_at + h].to_vec(),
            });
            g_at += n;
            s_at += h;
        }
        Ok(out)
    }

    fn submit_slots(&self, call: &'static str, lane: Lane, id: JobId, job: &SlotJob<'_>) -> Result<(), OffloaderError> {
        let dir = lane.direction();
        self.check_addressing(call, Addressing::Slots)?;
        let blocks = self.slot_job_blocks(job)?;
        let mut inner = sync::lock(&self.inner);
        if inner.closed {
            return Err(OffloaderError::ShutDown);
        }
        let engine = inner.engine.clone().ok_or(OffloaderError::ShutDown)?;
        let slots: Vec<(usize, usize)> =
            blocks.groups.iter().enumerate().flat_map(|(g, b)| b.host.iter().map(move |&s| (g, s))).collect();
        // A store never shares a slot with a job in flight; a load never
        // with a store in flight (loads of one slot may run together).
        // Linear in the slots of the jobs in flight.
        if !inner.jobs.is_empty() {
            let mine: HashSet<(usize, usize)> = slots.iter().copied().collect();
            for (&other, j) in &inner.jobs {
                if dir == Direction::HostToDevice && j.direction == Direction::HostToDevice {
                    continue;
                }
                if let Some(&(group, slot)) = j.slots.iter().find(|gs| mine.contains(gs)) {
                    return Err(OffloaderError::SlotBusy { group, slot, job: other, direction: j.direction });
                }
            }
        }
        // The engine checks the skips, the counts and the ids (range,
        // repeats, the job id never used before) and orders the job after
        // the compute stream, as for a keyed job.
        self.submit_or_defer(&engine, id, lane, &blocks, Some(job.first_subs))?;
        inner.jobs.insert(id, JobKeys { direction: dir, keys: Vec::new(), slots });
        Ok(())
    }

    /// The GPU blocks and host slots of `placements` (a subset of `keys`,
    /// in key order), and their keys.
    fn job_blocks(
        &self,
        keys: &[BlockKey],
        gpu_blocks: &[usize],
        placements: &[Placement],
    ) -> (Vec<usize>, Vec<usize>, Vec<BlockKey>) {
        let f = self.kv.block_factor;
        let at: HashMap<BlockKey, usize> = keys.iter().enumerate().map(|(i, k)| (*k, i)).collect();
        let mut gpu = Vec::with_capacity(placements.len() * f);
        let mut slots = Vec::with_capacity(placements.len());
        let mut ks = Vec::with_capacity(placements.len());
        for p in placements {
            // The manager places only keys of the batch, each once.
            let i = at[&p.key];
            gpu.extend_from_slice(&gpu_blocks[i * f..(i + 1) * f]);
            slots.push(p.slot.index());
            ks.push(p.key);
        }
        (gpu, slots, ks)
    }

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
        let engine = sync::lock(&self.inner).engine.clone().ok_or(OffloaderError::ShutDown)?;
        self.wait_deferred(Some(&[id]))?;
        engine.wait(id).map_err(|e| match e {
            crate::transfer::TransferError::UnknownJob { id } => OffloaderError::UnknownJob { id },
            e => e.into(),
        })
    }

    /// Blocks until each of `ids` that is in flight completed on the GPU
    /// (vLLM's `OffloadingWorker.wait`): ids never submitted or already
    /// reported are skipped, and failed jobs are reported by
    /// [`Offloader::poll`], not here (as [`Offloader::wait_all`]). Refused
    /// inside the caller's own window.
    pub fn wait_jobs(&self, ids: &[JobId]) -> Result<(), OffloaderError> {
        let engine = sync::lock(&self.inner).engine.clone().ok_or(OffloaderError::ShutDown)?;
        self.wait_deferred(Some(ids))?;
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
        Ok(())
    }

    /// Blocks until every job submitted so far completed on the GPU (failed
    /// jobs are reported by [`Offloader::poll`], not here).
    pub fn wait_all(&self) -> Result<(), OffloaderError> {
        let engine = sync::lock(&self.inner).engine.clone().ok_or(OffloaderError::ShutDown)?;
        self.wait_deferred(None)?;
        Ok(engine.wait_all()?)
    }

    // ---- shutdown ----

    /// Shuts down in the protocol's order: refused (typed, nothing changed)
    /// while a capture window is open or registered graphs live; otherwise
    /// refuses new jobs, waits for the jobs in flight and applies them to
    /// the manager, stops pinning at a chunk boundary, unregisters the
    /// region, and frees what the offloader allocated. A second call is
    /// refused with [`ProtocolError::AlreadyShutDown`]. The region is
    /// unmapped (and a shared file's name is long gone) when the offloader
    /// is dropped.
    pub fn shutdown(&self) -> Result<(), OffloaderError> {
        let mut down = sync::lock(&self.down);
        if *down == Down::Down {
            return Err(ProtocolError::AlreadyShutDown.into());
        }
        // Refused here, in one critical section of the coordinator, with
        // nothing changed: no window open, no registered graph alive. From
        // here on the coordinator refuses new windows, graphs and jobs.
        // (N15, loom builds only, keeps the old order: the refusal after the
        // teardown.)
        let old_order = crate::protocol::variant_is!(self.coord, TeardownBeforeRefusal);
        if !old_order {
            // Refused while a capture hook window is open or opening; a
            // flush of deferred jobs in progress ends first, and no hook
            // window begins until the coordinator is closed (hook.rs).
            let hook = self.hook_quiesce()?;
            self.coord.close()?;
            drop(hook);
            *down = Down::Down;
        }
        // Drain: every job in flight completes and is applied.
        let engine = {
            let mut inner = sync::lock(&self.inner);
            inner.closed = true;
            inner.engine.clone()
        };
        let mut drained = Ok(());
        let skip_drain = crate::protocol::variant_is!(self.coord, OffloaderSkipsDrain);
        if let Some(engine) = engine.as_ref().filter(|_| !skip_drain) {
            // No window can open any more (the coordinator is closed), so
            // neither the waits nor the polls are refused.
            drained = engine.wait_all().map_err(OffloaderError::from);
            while engine.in_flight(Direction::DeviceToHost) + engine.in_flight(Direction::HostToDevice) > 0 {
                if self.poll().is_empty() {
                    // Only while a window that opened before `close` is
                    // still open, which `close` refused: cannot happen.
                    self.coord.wait_no_window()?;
                }
            }
        }
        drop(engine);
        // The engine goes before the region is unregistered (its streams,
        // tables and staging ring are freed through the gate).
        let engine = sync::lock(&self.inner).engine.take();
        drop(engine);
        if old_order {
            *down = Down::Down;
            if let Err(e) = self.coord.close() {
                let _ = self.free_owned();
                return Err(e.into());
            }
        }
        let pinner = &self.pinner;
        let mut joined = Ok(());
        let r = finish_shutdown(self.rt.as_ref(), &self.coord, || {
            let mut p = sync::lock(pinner);
            if let Pinner::Running(h) = std::mem::replace(&mut *p, Pinner::NotStarted) {
                match h.join() {
                    Ok(o) => *p = Pinner::Done(o),
                    Err(_) => joined = Err(OffloaderError::PinnerPanicked),
                }
            }
        });
        let freed = self.free_owned();
        r?;
        joined?;
        drained?;
        freed?;
        tracing::info!("offloader shut down");
        Ok(())
    }

    /// Frees the tensors and the compute stream the offloader allocated.
    fn free_owned(&self) -> Result<(), OffloaderError> {
        let mut first = None;
        if let Some(s) = self.owned_compute {
            if let Err(e) = self.rt.stream_destroy(s) {
                first.get_or_insert(OffloaderError::driver("destroying the compute stream")(e));
            }
        }
        for &p in &self.owned_tensors {
            // SAFETY: every job is drained (no copy of the offloader touches
            // the tensor) and no registered graph lives (`close` refused
            // otherwise); the contract of `with_allocated_tensors` is that
            // the engine's own work on them ended before shutdown.
            match self.coord.unsafe_call("freeing a KV tensor", |g| unsafe { self.rt.mem_free(g, p) }) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first.get_or_insert(OffloaderError::driver("freeing a KV tensor")(e));
                }
                Err(e) => {
                    first.get_or_insert(e.into());
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Selects a known-bad variant of the protocol for this offloader
    /// (negative models only).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn set_variant(&self, v: crate::protocol::Variant) {
        self.coord.set_variant(v);
    }

    /// True once [`Offloader::shutdown`] began and was not refused (it then
    /// refuses every later call with `AlreadyShutDown`).
    pub fn is_shut_down(&self) -> bool {
        *sync::lock(&self.down) == Down::Down
    }
}

/// Dropping an offloader that was not shut down runs [`Offloader::shutdown`].
/// When that is refused (a capture window still open, or a registered graph
/// still alive: the graph may be replayed and reads the region and the
/// tensors), the drop leaks on purpose: the region stays mapped and
/// registered (the coordinator keeps it), the tensors the offloader
/// allocated stay allocated, and the pinner finishes on its own; the error
/// is logged. Replaying the graph stays correct; the memory is the
/// process's until it exits.
impl Drop for Offloader {
    fn drop(&mut self) {
        if self.is_shut_down() {
            return;
        }
        if let Err(e) = self.shutdown() {
            tracing::error!(error = %e, "offloader dropped: shutdown failed; registered memory stays mapped (leaked)");
        }
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
