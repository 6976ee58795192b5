//! Construction of an [`Offloader`]: the KV description checked, the region
//! created or joined, the coordinator and pinning prepared, the transfer
//! engine made (and a keyed layer's job book, its block manager).

use std::collections::HashMap;

use super::{
    hook, Geometry, Inner, KeyedBook, KvAlloc, KvSpec, Offloader, OffloaderError, OffloaderOptions, Owned, PinStart,
    Pinner, RegionSpec,
};
use crate::pin::{Agreement, Prepared, RankAgreement, RegionSlots};
use crate::protocol::agreement::RankSlots;
use crate::protocol::{Coordinator, Request};
use crate::region::{page_size, AnonOptions, Layout, Region};
use crate::runtime::{DevicePtr, DriverError, Gate, GpuRuntime, Stream};
use crate::sync::atomic::AtomicBool;
use crate::sync::{self, Arc, Mutex};
use crate::transfer::{GroupSpec, HostPlacement, KvLayout, Lane, TensorSpec, TransferEngine};

/// The KV cache groups of the layout: one of every tensor, or
/// `opts.kv_groups` (slot jobs only: a keyed offloader refuses them before
/// it gets here), each of every GPU block and every host slot.
fn kv_groups(kv: &KvSpec, opts: &OffloaderOptions) -> Result<Vec<GroupSpec>, OffloaderError> {
    let group = |tensors: &[TensorSpec]| GroupSpec {
        tensors: tensors.to_vec(),
        num_gpu_blocks: kv.gpu_blocks,
        num_host_blocks: opts.host_blocks,
    };
    let Some(sizes) = &opts.kv_groups else {
        return Ok(vec![group(&kv.tensors)]);
    };
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

/// The region's layout for host blocks of `block_bytes` bytes (`None`:
/// their size overflowed), every product checked: OptionsError or the
/// layout's own RegionError, never an overflow.
fn region_layout(block_bytes: Option<usize>, opts: &OffloaderOptions) -> Result<Layout, OffloaderError> {
    let page = page_size();
    let slot_bytes = block_bytes.and_then(|b| b.div_ceil(page).checked_mul(page)).ok_or_else(|| {
        OffloaderError::Options(
            "a host block (the tensors' page bytes times block_factor, in whole pages) is larger than memory can be"
                .into(),
        )
    })?;
    Ok(match &opts.region {
        RegionSpec::Anonymous => Layout::new(1, slot_bytes, opts.host_blocks)?,
        RegionSpec::Shared { .. } | RegionSpec::Persistent { .. } => {
            Layout::rank_major(opts.region.ranks(), slot_bytes, opts.host_blocks)?
        }
    })
}

/// How the ranks will agree on the pin state (P7), checked before anything
/// is made: one way at most (a transport or words), words for every rank
/// of the region, and a way for a persistent region of several ranks
/// (its header has no rank words for one launch).
fn check_agreement(opts: &OffloaderOptions) -> Result<(), OffloaderError> {
    let ranks = opts.region.ranks();
    if opts.agreement.is_some() && opts.agreement_slots.is_some() {
        return Err(OffloaderError::Options(
            "OffloaderOptions::agreement and OffloaderOptions::agreement_slots are both set: the ranks agree on \
             the pin state (P7) one way, give one"
                .into(),
        ));
    }
    if let Some(slots) = &opts.agreement_slots {
        if slots.ranks() != ranks {
            return Err(OffloaderError::Options(format!(
                "OffloaderOptions::agreement_slots holds the words of {} ranks; the region has {ranks}: every rank \
                 of the region agrees (P7) through them",
                slots.ranks()
            )));
        }
    }
    if let RegionSpec::Persistent { .. } = &opts.region {
        if ranks > 1 && opts.agreement.is_none() && opts.agreement_slots.is_none() {
            return Err(OffloaderError::Options(format!(
                "a persistent region of {ranks} ranks needs agreement words (OffloaderOptions::agreement_slots: \
                 its engine's entry in the pool's index) or an agreement transport (OffloaderOptions::agreement): \
                 it has no rank words of one launch for the ranks to agree on the pin state (P7)"
            )));
        }
    }
    Ok(())
}

/// The most KV tensors [`Offloader::with_allocated_tensors`] makes (one per
/// layer and K/V: a few thousand in the largest models).
pub(crate) const MAX_KV_TENSORS: usize = 1 << 20;

/// Refuses more than [`MAX_KV_TENSORS`] tensors (checked before the tensor
/// list is allocated).
fn check_tensor_count(tensors: usize) -> Result<(), OffloaderError> {
    if tensors > MAX_KV_TENSORS {
        return Err(OffloaderError::Options(format!("tensors = {tensors}: more than {MAX_KV_TENSORS} KV tensors")));
    }
    Ok(())
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
    /// the engine until [`Offloader::poll_each`] reports the job (or
    /// [`Offloader::wait`] returns for it): the copies are asynchronous.
    pub unsafe fn new(
        rt: Arc<dyn GpuRuntime>,
        kv: KvSpec,
        opts: OffloaderOptions,
    ) -> Result<Offloader, OffloaderError> {
        // SAFETY: forwarded to the caller.
        unsafe { Self::build(rt, kv, opts, Vec::new(), None, false) }
    }

    /// Builds an offloader that allocates its KV tensors itself (`alloc`)
    /// and a compute stream, and frees them at shutdown. The tensors'
    /// device addresses are [`Geometry::tensors`]; the stream is
    /// [`Geometry::compute_stream`].
    pub fn with_allocated_tensors(
        rt: Arc<dyn GpuRuntime>,
        alloc: KvAlloc,
        opts: OffloaderOptions,
    ) -> Result<Offloader, OffloaderError> {
        Self::allocate_and_build(rt, alloc, opts, false)
    }

    /// [`Offloader::with_allocated_tensors`], with the keyed layer's book
    /// when `keyed`.
    pub(crate) fn allocate_and_build(
        rt: Arc<dyn GpuRuntime>,
        alloc: KvAlloc,
        opts: OffloaderOptions,
        keyed: bool,
    ) -> Result<Offloader, OffloaderError> {
        let zero: Vec<&str> = [
            ("tensors", alloc.tensors),
            ("page_bytes", alloc.page_bytes),
            ("gpu_blocks", alloc.gpu_blocks),
            ("block_factor", alloc.block_factor),
        ]
        .into_iter()
        .filter(|(_, v)| *v == 0)
        .map(|(n, _)| n)
        .collect();
        if !zero.is_empty() {
            return Err(OffloaderError::Options(format!(
                "zero-sized KV allocation: KvAlloc.{} must be at least 1 ({alloc:?})",
                zero.join(", KvAlloc.")
            )));
        }
        // The tensor list is allocated before any memory check can see the
        // tensors' bytes (a region whose memory check is off, tiny pages):
        // bound its length (an engine has a few thousand at most).
        check_tensor_count(alloc.tensors)?;
        let bytes = alloc.gpu_blocks.checked_mul(alloc.page_bytes).ok_or_else(|| {
            OffloaderError::Options(format!("{} blocks of {} bytes overflow", alloc.gpu_blocks, alloc.page_bytes))
        })?;
        // Everything is checked before anything is allocated (issue 28,
        // item 5): the tensors' total, and the host region their layout
        // implies, against the memory this process can get (as the region
        // checks itself, only later, after the tensors).
        if bytes.checked_mul(alloc.tensors).is_none() {
            return Err(OffloaderError::Options(format!(
                "{} tensors of {bytes} bytes overflow the address space",
                alloc.tensors
            )));
        }
        if opts.host_blocks == 0 {
            return Err(OffloaderError::Options("host_blocks is 0".into()));
        }
        let block_bytes = alloc.page_bytes.checked_mul(alloc.tensors).and_then(|b| b.checked_mul(alloc.block_factor));
        let layout = region_layout(block_bytes, &opts)?;
        match &opts.region {
            RegionSpec::Anonymous => crate::region::limits::check(layout.data_bytes() as u64)?,
            // The region checks at create (rank 0) the whole region, every
            // rank's share on this node's memory, and at join the joiner's
            // own share, after the tensors; the same check comes first here.
            RegionSpec::Shared { rank, options, .. } if options.check_memory => {
                let needed = if *rank == 0 { layout.data_bytes() } else { layout.bytes_per_rank() };
                crate::region::limits::check(needed as u64)?
            }
            RegionSpec::Shared { .. } => {}
            // Checked by open_persistent when it creates the region; an
            // existing one's pages are in the file system already.
            RegionSpec::Persistent { .. } => {}
        }
        // Allocations before the offloader's coordinator exists: each goes
        // through a coordinator of its own for `rt`, made for that call and
        // gone after it (no window can be open: a window needs a coordinator
        // of `rt`, and while this one lives no other can be made; if one
        // exists, say another offloader on this handle, this is refused).
        let gated = |what: &'static str, f: &mut dyn FnMut(&Gate) -> Result<(), DriverError>| {
            Coordinator::without_region(rt.as_ref(), Default::default())
                .and_then(|c| c.unsafe_call(what, Request::new(), |g| f(g)))
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
        let r = unsafe { Self::build(rt.clone(), kv, opts, tensors.clone(), Some(compute), keyed) };
        if r.is_err() {
            if let Err(e) = rt.stream_destroy(compute) {
                tracing::warn!(error = %e, "destroying the compute stream failed");
            }
            free_all(&tensors);
        }
        r
    }

    /// The offloader, with the keyed layer's job book when `keyed` (its
    /// block manager; otherwise slot jobs).
    ///
    /// # Safety
    /// As for [`Offloader::new`].
    pub(crate) unsafe fn build(
        rt: Arc<dyn GpuRuntime>,
        kv: KvSpec,
        opts: OffloaderOptions,
        owned_tensors: Vec<DevicePtr>,
        owned_compute: Option<Stream>,
        keyed: bool,
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
        if let RegionSpec::Shared { options, .. } | RegionSpec::Persistent { options, .. } = &opts.region {
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
        check_agreement(&opts)?;
        let block_bytes = kv.host_block_bytes();
        let ranks = opts.region.ranks();
        let rank = opts.region.rank();
        // Shared regions are rank-major: each rank's host blocks are
        // contiguous (its own data files), so each rank reserves, pre-faults
        // and registers only its share (`Region::pin_ranges`).
        let layout = region_layout(block_bytes, &opts)?;
        let block_bytes = block_bytes.unwrap_or_default();
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
            RegionSpec::Persistent { name, rank, options, .. } => {
                Region::open_persistent(name, layout, *rank, options)?
            }
        };
        let region = Arc::new(region);
        let prepared = Prepared::new(rt.as_ref(), &region, &opts.pin)?;
        let bytes_total = prepared.bytes();
        // P7: the engine's transport, else the words given (a persistent
        // region's: its engine entry's), else a shared region's header.
        let agreement = if let Some(t) = &opts.agreement {
            Some(RankAgreement::Transport(t.clone()))
        } else if let Some(slots) = &opts.agreement_slots {
            Some(Agreement { slots: slots.clone(), rank, timeout: opts.agreement_timeout }.into())
        } else {
            match (&opts.region, RegionSlots::new(region.clone())) {
                (RegionSpec::Shared { ranks, .. }, Some(slots)) if *ranks > 1 => {
                    let slots: Arc<dyn RankSlots> = sync::arc_dyn(slots, |a| a);
                    Some(Agreement { slots, rank, timeout: opts.agreement_timeout }.into())
                }
                _ => None,
            }
        };
        let coord = prepared.coordinator().clone();
        // This rank's host blocks: block `i` is the rank's chunk `i`.
        let host_base = region.chunk_ptr(rank, 0)?.as_ptr() as usize;
        let groups = kv_groups(&kv, &opts)?;
        let placement = HostPlacement::BlockStrided { stride: layout.chunk_stride() };
        let kv_layout = KvLayout::new(&groups, kv.block_factor, host_base, placement)?;
        // A keyed layer's block manager; slot jobs need none.
        let book = keyed.then(|| KeyedBook::new(&opts)).transpose()?;
        // SAFETY: the host area is this rank's slots of `region`, which the
        // offloader (and the coordinator) hold until the engine is gone;
        // only the engine's DMA touches them (the offloader hands out no
        // reference into the region). The tensors and the compute stream
        // are the caller's contract.
        let engine = unsafe {
            TransferEngine::new(rt.clone(), coord.clone(), kv_layout.clone(), kv.compute_stream, opts.transfer)
        }?;
        let lane_streams = [Lane::Store, Lane::Load, Lane::LoadExpedited].map(|l| engine.lane_stream(l));
        tracing::info!(
            backend = rt.backend(),
            keyed = book.is_some(),
            rank,
            ranks,
            host_blocks = opts.host_blocks,
            block_bytes,
            region_bytes = region.len(),
            "offloader built"
        );
        let host_blocks = kv_layout.num_host_blocks(0);
        Ok(Offloader {
            coord,
            geometry: Geometry { runtime: rt, kv, host_blocks, layout: kv_layout, region, lane_streams },
            pin_start: PinStart {
                prefault: prepared.prefault(),
                observer: opts.pin_observer.clone(),
                agreement,
                bytes_total,
            },
            pinner: Mutex::new(Pinner::NotStarted),
            inner: Mutex::new(Inner { engine: Some(Arc::new(engine)), jobs: HashMap::new(), closed: false, book }),
            owned: Owned { tensors: owned_tensors, compute: owned_compute },
            shutting: Mutex::new(()),
            shut_down: AtomicBool::new(false),
            hook: hook::Hook::new(),
            gated_threads: Mutex::new(Vec::new()),
        })
    }
}

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use super::*;

    // The bound itself: building an offloader of 2**20 tensors to see it
    // accepted would allocate a million tensors (tests/offloader_misuse.rs
    // checks one past it through the constructor).
    #[test]
    fn the_tensor_count_is_bounded_at_max_kv_tensors_inclusive() {
        assert!(check_tensor_count(1).is_ok());
        assert!(check_tensor_count(MAX_KV_TENSORS).is_ok());
        match check_tensor_count(MAX_KV_TENSORS + 1) {
            Err(OffloaderError::Options(m)) => assert!(m.contains("more than 1048576 KV tensors"), "{m}"),
            r => panic!("{r:?}"),
        }
    }
}
