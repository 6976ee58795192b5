//! [`KeyedOffloader`]: jobs by block keys ([`KeyedOffloader::lookup`],
//! [`KeyedOffloader::store`], [`KeyedOffloader::load`]) placed by a block
//! manager, over a core [`Offloader`].
//!
//! The manager is the core's job book (`KeyedBook`, which the core holds
//! as what it is, no trait object): it lives under the core's job lock,
//! so a keyed submission (the manager's prepare, the core's submission,
//! the manager's undo when the core refuses) is one critical section, as
//! is a poll's removal of a job and its application to the manager: a
//! stored key becomes readable, and a loaded key's slot
//! evictable, only once [`KeyedOffloader::poll`] (or a wait that polls, or
//! shutdown's drain) applies the job (P5).

use std::collections::HashMap;

use super::{Completion, KvAlloc, KvSpec, Offloader, OffloaderError, OffloaderOptions};
use crate::manager::{BlockKey, BlockManager, Lookup, ManagerConfig, Placement, Skipped};
use crate::rules::Rules;
use crate::runtime::{Direction, GpuRuntime};
use crate::sync::Arc;
use crate::transfer::{JobBlocks, JobId, Lane};

/// What a store submission did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreSubmitted {
    /// The job that writes the stored keys, `None` when nothing needed
    /// storing (every key already stored or pending).
    pub job: Option<JobId>,
    /// Keys the job stores (readable once [`KeyedOffloader::poll`] reports it).
    pub stored: Vec<BlockKey>,
    /// Keys not stored, and why.
    pub skipped: Vec<Skipped>,
    /// Keys evicted to make room.
    pub evicted: Vec<BlockKey>,
}

/// The block manager and the keys of each keyed job in flight, under the
/// core's job lock (the core's `Inner::book`).
pub(crate) struct KeyedBook {
    manager: BlockManager,
    keys: HashMap<JobId, Vec<BlockKey>>,
    next_id: JobId,
}

impl KeyedBook {
    /// The book of a keyed offloader (made where the core would make
    /// nothing, once the options passed the core's checks): a manager of
    /// the options' host blocks and eviction policy.
    pub(super) fn new(opts: &OffloaderOptions) -> Result<KeyedBook, OffloaderError> {
        let manager = BlockManager::new(ManagerConfig::new(opts.host_blocks, opts.eviction))?;
        Ok(KeyedBook { manager, keys: HashMap::new(), next_id: JobId(1) })
    }

    /// Job `id` ended (`succeeded`: every byte arrived): applies it to the
    /// manager (a stored key readable, a loaded key's slot released) and
    /// returns its keys. Called by the core's poll, under its job lock, in
    /// the critical section that removes the job from its jobs.
    pub(super) fn finished(&mut self, id: JobId, direction: Direction, succeeded: bool) -> Vec<BlockKey> {
        let keys = self.keys.remove(&id).unwrap_or_default();
        let applied = match direction {
            Direction::DeviceToHost => self.manager.complete_store(&keys, succeeded),
            Direction::HostToDevice => self.manager.complete_load(&keys),
        };
        if let Err(e) = applied {
            tracing::error!(job = id.0, error = %e, "applying a finished job to the block manager failed");
        }
        keys
    }
}

/// Keyed jobs refuse several KV cache groups (one group of every tensor).
fn check_options(opts: &OffloaderOptions) -> Result<(), OffloaderError> {
    if opts.kv_groups.is_some() {
        return Err(OffloaderError::Options(
            "kv_groups is for slot jobs (Offloader::submit): a KeyedOffloader's jobs have one group".into(),
        ));
    }
    Ok(())
}

/// An offloader whose host blocks are placed by a block manager, by block
/// keys: [`KeyedOffloader::lookup`], [`KeyedOffloader::store`],
/// [`KeyedOffloader::load`], [`KeyedOffloader::poll`]. Everything else
/// (pinning, capture windows, waits, shutdown, the geometry) is its core's,
/// [`KeyedOffloader::core`]; the core's [`Offloader::submit`] is refused on
/// it ([`OffloaderError::KeyedCore`]: the manager owns the host slots).
/// Dropping it drops the core, which shuts down.
#[derive(Debug)]
pub struct KeyedOffloader {
    core: Offloader,
}

impl KeyedOffloader {
    /// [`Offloader::new`] with a block manager of `opts.host_blocks` slots
    /// and `opts.eviction`; `opts.kv_groups` is refused
    /// ([`OffloaderError::Options`]).
    ///
    /// # Safety
    /// As for [`Offloader::new`].
    pub unsafe fn new(
        rt: Arc<dyn GpuRuntime>,
        kv: KvSpec,
        opts: OffloaderOptions,
    ) -> Result<KeyedOffloader, OffloaderError> {
        check_options(&opts)?;
        // SAFETY: forwarded to the caller.
        let core = unsafe { Offloader::build(rt, kv, opts, Vec::new(), None, true) }?;
        Ok(KeyedOffloader { core })
    }

    /// [`Offloader::with_allocated_tensors`] with a block manager, as
    /// [`KeyedOffloader::new`].
    pub fn with_allocated_tensors(
        rt: Arc<dyn GpuRuntime>,
        alloc: KvAlloc,
        opts: OffloaderOptions,
    ) -> Result<KeyedOffloader, OffloaderError> {
        check_options(&opts)?;
        let core = Offloader::allocate_and_build(rt, alloc, opts, true)?;
        Ok(KeyedOffloader { core })
    }

    /// The core: pinning, capture windows and the hook, gated calls, the
    /// waits (completions they take are applied to the block manager, as
    /// by [`KeyedOffloader::poll`]), shutdown, the geometry.
    pub fn core(&self) -> &Offloader {
        &self.core
    }

    /// What the offloader holds of each key (counts as a lookup for the
    /// eviction policy).
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<Lookup> {
        self.core.jobs(|j| j.book().manager.lookup(keys))
    }

    /// Keys stored and readable now.
    pub fn stored_blocks(&self) -> usize {
        self.core.jobs(|j| j.book().manager.len())
    }

    /// Jobs that finished since the last call, each with its keys,
    /// already applied to the block manager ([`Offloader::poll_each`],
    /// collected).
    pub fn poll(&self) -> Vec<Completion> {
        let mut out = Vec::new();
        self.core.poll_each(&mut |c| out.push(c));
        out
    }

    fn check_gpu_blocks(&self, keys: &[BlockKey], gpu_blocks: &[usize]) -> Result<(), OffloaderError> {
        let factor = self.core.geometry.kv.block_factor;
        let need = keys.len().saturating_mul(factor);
        if gpu_blocks.len() != need {
            return Err(OffloaderError::GpuBlockCount { keys: keys.len(), factor, need, got: gpu_blocks.len() });
        }
        Ok(())
    }

    /// Stores `keys` from GPU blocks `gpu_blocks` (`block_factor` per key,
    /// in key order). Keys already stored or pending are skipped; slots are
    /// freed by eviction when needed (all or nothing). The stored keys
    /// become readable once [`KeyedOffloader::poll`] reports the job.
    ///
    /// The contract, which an engine that keeps its own view of what the
    /// offloader holds relies on:
    /// - a call that returns an error changes nothing: no key evicted, no
    ///   slot taken, the eviction policy as it was (a submission refused
    ///   after the block manager placed the keys, inside a capture window
    ///   or for an out-of-range GPU block, is undone with its evictions,
    ///   the block manager's `undo_store`);
    /// - `skipped` and `evicted` of one call are disjoint (a key of `keys`
    ///   is never evicted by the same call), and every key evicted is in
    ///   `evicted`;
    /// - a key in `stored` is loadable once its job is reported, until a
    ///   later call reports it in `evicted` (or its store fails, reported
    ///   by `poll`).
    ///
    /// The store is ordered after the work on the compute stream at this
    /// moment; the engine must not write those GPU blocks until the job is
    /// reported.
    pub fn store(&self, keys: &[BlockKey], gpu_blocks: &[usize]) -> Result<StoreSubmitted, OffloaderError> {
        self.check_gpu_blocks(keys, gpu_blocks)?;
        self.core.jobs(|j| {
            if j.closed() {
                return Err(OffloaderError::ShutDown);
            }
            let book = j.book();
            let (out, undo) = book.manager.prepare_store_undoable(keys)?;
            let evicted: Vec<BlockKey> = out.evicted.iter().map(|p| p.key).collect();
            if out.to_store.is_empty() {
                return Ok(StoreSubmitted { job: None, stored: Vec::new(), skipped: out.skipped, evicted });
            }
            let (gpu, slots, stored) = self.job_blocks(keys, gpu_blocks, &out.to_store);
            let id = book.next_id;
            book.next_id = JobId(id.0 + 1);
            if let Err(e) = j.submit(id, Lane::Store, &JobBlocks::single(gpu, slots)) {
                // Contract (a): the refused call changes nothing. Its
                // evictions are taken back with the rest (the victims are
                // readable again, the policy as before), so the engine,
                // which gets no `evicted` list from a raising call, still
                // agrees with the offloader. Nothing touched the manager
                // since the prepare: it is under this same lock.
                self.core.coord.rules().refused_store_undoes_evictions(
                    j,
                    |j| {
                        if let Err(m) = j.book().manager.undo_store(undo) {
                            tracing::error!(error = %m, "undoing a refused store failed");
                        }
                    },
                    |j| {
                        let _ = j.book().manager.complete_store(&stored, false);
                    },
                );
                return Err(e);
            }
            let book = j.book();
            book.keys.insert(id, stored.clone());
            // Readable once `poll` reports the job completed, not now.
            self.core.coord.rules().readable_at_completion(|| {
                let _ = book.manager.complete_store(&stored, true);
            });
            Ok(StoreSubmitted { job: Some(id), stored, skipped: out.skipped, evicted })
        })
    }

    /// Loads `keys` (each stored and readable) into GPU blocks `gpu_blocks`
    /// (`block_factor` per key, in key order). Their slots cannot be evicted
    /// until [`KeyedOffloader::poll`] reports the job.
    ///
    /// The load is ordered after the work on the compute stream at this
    /// moment; the engine must not touch those GPU blocks until the job is
    /// reported.
    pub fn load(&self, keys: &[BlockKey], gpu_blocks: &[usize]) -> Result<JobId, OffloaderError> {
        self.check_gpu_blocks(keys, gpu_blocks)?;
        self.core.jobs(|j| {
            if j.closed() {
                return Err(OffloaderError::ShutDown);
            }
            let book = j.book();
            let placements = book.manager.prepare_load(keys)?;
            let (gpu, slots, _) = self.job_blocks(keys, gpu_blocks, &placements);
            let id = book.next_id;
            book.next_id = JobId(id.0 + 1);
            if let Err(e) = j.submit(id, Lane::Load, &JobBlocks::single(gpu, slots)) {
                if let Err(m) = j.book().manager.complete_load(keys) {
                    tracing::error!(error = %m, "undoing a refused load failed");
                }
                return Err(e);
            }
            let book = j.book();
            book.keys.insert(id, keys.to_vec());
            // The slots stay held until `poll` reports the job, not now.
            self.core.coord.rules().slots_held_until_load_done(|| {
                let _ = book.manager.complete_load(keys);
            });
            Ok(id)
        })
    }

    /// The GPU blocks and host slots of `placements` (a subset of `keys`,
    /// in key order), and their keys.
    fn job_blocks(
        &self,
        keys: &[BlockKey],
        gpu_blocks: &[usize],
        placements: &[Placement],
    ) -> (Vec<usize>, Vec<usize>, Vec<BlockKey>) {
        let f = self.core.geometry.kv.block_factor;
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
}
