//! The slot-addressed API ([`Addressing::Slots`]): jobs by the engine's own
//! job ids, GPU block ids and host slot ids, with no block manager
//! ([`Offloader::store_slots`], [`Offloader::load_slots`], their expedited
//! and multi-group forms, [`Offloader::wait_jobs`]), and the busy-slot rule:
//! a store never shares a slot with a job in flight, a load never with a
//! store in flight.

use std::collections::HashSet;

use super::{Addressing, JobKeys, Offloader, OffloaderError};
use crate::runtime::Direction;
use crate::sync;
use crate::transfer::{JobBlocks, JobId, Lane, TransferError};

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

impl Offloader {
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
    /// [`Completion`](super::Completion) with no keys), with its bytes and seconds, and
    /// [`Offloader::wait`] / [`Offloader::wait_all`] wait for it. Until it
    /// is reported the engine must not write those GPU blocks, and the
    /// offloader refuses any other job on those slots
    /// ([`OffloaderError::SlotBusy`]); the engine still owns its slots
    /// (which slot holds what is its business, not checked). Once it is
    /// reported the slots hold the bytes and may be loaded, or stored
    /// again.
    ///
    /// With several KV cache groups ([`OffloaderOptions::kv_groups`](super::OffloaderOptions::kv_groups)) use
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

    /// [`Offloader::store_slots`] over every KV cache group of an
    /// offloader built with [`OffloaderOptions::kv_groups`](super::OffloaderOptions::kv_groups) (or its one
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

    /// Blocks until each of `ids` that is in flight completed on the GPU
    /// (vLLM's `OffloadingWorker.wait`): ids never submitted or already
    /// reported are skipped, and failed jobs are reported by
    /// [`Offloader::poll`], not here (as [`Offloader::wait_all`]). Refused
    /// inside the caller's own window.
    pub fn wait_jobs(&self, ids: &[JobId]) -> Result<(), OffloaderError> {
        self.check_addressing("wait_jobs", Addressing::Slots)?;
        self.refuse_inside_gated("waiting for jobs inside gated()")?;
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
}
