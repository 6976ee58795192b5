//! Keyed jobs: [`Offloader::lookup`], [`Offloader::store`] and
//! [`Offloader::load`] by block keys, placed by the block manager (a stored
//! key becomes readable, and a loaded key's slot evictable, once
//! [`Offloader::poll`] applies the job).

use std::collections::HashMap;

use super::{Addressing, JobKeys, Offloader, OffloaderError};
use crate::manager::{BlockKey, Lookup, Placement, Skipped};
use crate::runtime::Direction;
use crate::sync;
use crate::transfer::{JobBlocks, JobId, Lane};

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

impl Offloader {
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
        #[cfg(any(loom, shuttle))]
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
        #[cfg(any(loom, shuttle))]
        if crate::protocol::variant_is!(self.coord, SlotFreedAtLoadSubmit) {
            let _ = inner.manager.complete_load(keys);
        }
        Ok(id)
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
}
