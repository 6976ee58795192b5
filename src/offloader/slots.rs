//! Slot jobs: [`SlotJob`] and [`Offloader::submit`], by the engine's own job
//! ids, GPU block ids and host slot ids, with no block manager (waited for
//! with [`Offloader::wait_jobs`], waits.rs); and the busy-slot rule: a
//! store never shares a slot with a job in flight, a load never with a
//! store in flight.

use std::collections::HashSet;

use super::{JobSlots, Offloader, OffloaderError};
use crate::rules::Rules;
use crate::runtime::Direction;
use crate::sync;
use crate::transfer::{GroupBlocks, JobBlocks, JobId, Lane};

/// One slot job: GPU block ids and the engine's host slot ids (`0..host_blocks`
/// of [`Geometry`](super::Geometry)), of one KV cache group
/// ([`SlotJob::single`]) or of every group ([`SlotJob::groups`], vLLM's
/// `GPULoadStoreSpec(block_ids, group_sizes, block_indices)` and
/// `CPULoadStoreSpec(chunk_ids)`). Submitted with [`Offloader::submit`] on
/// a [`Lane`], which checks its shape against the offloader's groups and
/// block factor.
///
/// Placement, `f` being the block factor: a group's GPU block `i` is
/// sub-block `(first_sub + i) % f` of its slot `slots[(first_sub + i) / f]`
/// (every tensor of the group), so the group has
/// `ceil((gpu_blocks + first_sub) / f)` slots and its first and last slot
/// may be partial (their other sub-blocks are not written or read).
#[derive(Copy, Clone, Debug)]
pub struct SlotJob<'a> {
    gpu_blocks: &'a [usize],
    slots: &'a [usize],
    shape: Shape<'a>,
}

#[derive(Copy, Clone, Debug)]
enum Shape<'a> {
    /// One group, from sub-block `first_sub` of its first slot.
    Single { first_sub: usize },
    /// Every group: sizes and skips, one per group.
    Groups { group_sizes: &'a [usize], first_subs: &'a [usize] },
}

impl<'a> SlotJob<'a> {
    /// GPU blocks `gpu_blocks` and host slots `slots` of an offloader with
    /// one KV cache group, from sub-block `first_sub` of the first slot
    /// (vLLM's `block_indices[0] % f`): `slots.len()` must be
    /// `ceil((gpu_blocks.len() + first_sub) / f)`. On an offloader with
    /// several groups ([`OffloaderOptions::kv_groups`](super::OffloaderOptions::kv_groups))
    /// it is refused ([`OffloaderError::SlotJobShape`]): use
    /// [`SlotJob::groups`].
    pub fn single(gpu_blocks: &'a [usize], slots: &'a [usize], first_sub: usize) -> Self {
        SlotJob { gpu_blocks, slots, shape: Shape::Single { first_sub } }
    }

    /// A job over every KV cache group of an offloader built with
    /// [`OffloaderOptions::kv_groups`](super::OffloaderOptions::kv_groups)
    /// (or its one group): `gpu_blocks` holds every group's GPU block ids,
    /// group after group, `group_sizes[g]` of group `g` (0 for a group the
    /// job does not touch); `slots` every group's host slot ids, group after
    /// group, `ceil((group_sizes[g] + first_subs[g]) / f)` of group `g`
    /// (none when its size is 0); `first_subs[g]` (below `f`) the sub-blocks
    /// of group `g`'s first slot before its first GPU block (vLLM's
    /// `block_indices[g] % f`). Within a slot, group `g` touches only its
    /// own tensors' pages.
    pub fn groups(
        gpu_blocks: &'a [usize],
        group_sizes: &'a [usize],
        slots: &'a [usize],
        first_subs: &'a [usize],
    ) -> Self {
        SlotJob { gpu_blocks, slots, shape: Shape::Groups { group_sizes, first_subs } }
    }

    /// The GPU block ids, group after group.
    pub fn gpu_blocks(&self) -> &'a [usize] {
        self.gpu_blocks
    }

    /// The host slot ids, group after group.
    pub fn slots(&self) -> &'a [usize] {
        self.slots
    }

    /// GPU blocks of each group and the sub-blocks of each group's first
    /// slot before its first GPU block.
    fn sizes_and_skips(&self) -> (Vec<usize>, Vec<usize>) {
        match self.shape {
            Shape::Single { first_sub } => (vec![self.gpu_blocks.len()], vec![first_sub]),
            Shape::Groups { group_sizes, first_subs } => (group_sizes.to_vec(), first_subs.to_vec()),
        }
    }
}

impl Offloader {
    /// Submits slot job `job` as job `id`, the engine's id for it, on
    /// `lane`: [`Lane::Store`] copies its GPU blocks into its host slots,
    /// [`Lane::Load`] its host slots into its GPU blocks (as a store placed
    /// them), [`Lane::LoadExpedited`] the same on the expedited lane (vLLM's
    /// `submit_load(..., expedited=True)`: its own stream and completion
    /// FIFO, so it never waits behind regular loads or stores; needs
    /// `OffloaderOptions::transfer.expedited_lane = true`, otherwise
    /// [`TransferError::NoExpeditedLane`]).
    ///
    /// The job is ordered after the work on the compute stream at this
    /// moment; [`Offloader::poll_each`] reports it once (a
    /// [`Completion`](super::Completion) with no keys, its lane), with its
    /// bytes and seconds, and [`Offloader::wait`] /
    /// [`Offloader::wait_jobs`] / [`Offloader::wait_all`] wait for it.
    /// While a capture hook window is open it is deferred, as any job.
    /// Until it is reported the engine must not touch those GPU blocks
    /// (nor write them, for a store), and the offloader refuses a store to
    /// its slots, and for a store any job on them
    /// ([`OffloaderError::SlotBusy`]; loads of one slot may run together);
    /// the engine still owns its slots (which slot holds what is its
    /// business, not checked). Once a store is reported its slots hold the
    /// bytes and may be loaded, or stored again.
    ///
    /// Errors, with nothing submitted: [`OffloaderError::KeyedCore`] on the
    /// core of a [`KeyedOffloader`](super::KeyedOffloader) (its block
    /// manager owns the slots); [`OffloaderError::ShutDown`];
    /// [`OffloaderError::SlotJobShape`] when the job's lists do not fit the
    /// offloader's groups (a [`SlotJob::single`] on several groups,
    /// `group_sizes` or `first_subs` without one entry per group,
    /// `gpu_blocks` not `group_sizes` long in all, `slots` not as long as
    /// the groups need; with one group a wrong slot count is
    /// `HostCountMismatch`); [`OffloaderError::SlotBusy`]; and from the
    /// transfer engine ([`OffloaderError::Transfer`]), per group, naming it:
    /// [`TransferError::JobIdReused`] when `id` was used before (ids are
    /// never reused, reported or not; a refused call uses none),
    /// [`TransferError::FirstSubTooLarge`] (`first_sub >= f`),
    /// [`TransferError::HostCountMismatch`] (the slot count above),
    /// [`TransferError::HostBlockOutOfRange`] /
    /// [`TransferError::GpuBlockOutOfRange`] (the id and the limit),
    /// [`TransferError::RepeatedHostBlock`] /
    /// [`TransferError::RepeatedGpuBlock`] (within the job),
    /// [`TransferError::EmptyJob`], and the refusals every job has (a
    /// capture window open, a capturing compute stream, shutdown).
    ///
    /// [`TransferError::NoExpeditedLane`]: crate::transfer::TransferError::NoExpeditedLane
    /// [`TransferError::JobIdReused`]: crate::transfer::TransferError::JobIdReused
    /// [`TransferError::FirstSubTooLarge`]: crate::transfer::TransferError::FirstSubTooLarge
    /// [`TransferError::HostCountMismatch`]: crate::transfer::TransferError::HostCountMismatch
    /// [`TransferError::HostBlockOutOfRange`]: crate::transfer::TransferError::HostBlockOutOfRange
    /// [`TransferError::GpuBlockOutOfRange`]: crate::transfer::TransferError::GpuBlockOutOfRange
    /// [`TransferError::RepeatedHostBlock`]: crate::transfer::TransferError::RepeatedHostBlock
    /// [`TransferError::RepeatedGpuBlock`]: crate::transfer::TransferError::RepeatedGpuBlock
    /// [`TransferError::EmptyJob`]: crate::transfer::TransferError::EmptyJob
    pub fn submit(&self, id: JobId, lane: Lane, job: &SlotJob<'_>) -> Result<(), OffloaderError> {
        let dir = lane.direction();
        let (group_sizes, first_subs) = job.sizes_and_skips();
        let blocks = self.slot_job_blocks(job, &group_sizes, &first_subs)?;
        let mut inner = sync::lock(&self.inner);
        if inner.book.is_some() {
            return Err(OffloaderError::KeyedCore { call: "submit" });
        }
        if inner.closed {
            return Err(OffloaderError::ShutDown);
        }
        let engine = inner.engine.clone().ok_or(OffloaderError::ShutDown)?;
        let slots: Vec<(usize, usize)> =
            blocks.groups.iter().enumerate().flat_map(|(g, b)| b.host.iter().map(move |&s| (g, s))).collect();
        // A store never shares a slot with a job in flight; a load never
        // with a store in flight (loads of one slot may run together).
        // Linear in the slots of the jobs in flight. (The rules are asked
        // only with jobs in flight, so a submission beside none reads no
        // model build's knob.)
        if !inner.jobs.is_empty() {
            self.coord.rules().checks_busy_slots(|| {
                let mine: HashSet<(usize, usize)> = slots.iter().copied().collect();
                for (&other, j) in &inner.jobs {
                    if dir == Direction::HostToDevice && j.direction == Direction::HostToDevice {
                        continue;
                    }
                    if let Some(&(group, slot)) = j.slots.iter().find(|gs| mine.contains(gs)) {
                        return Err(OffloaderError::SlotBusy { group, slot, job: other, direction: j.direction });
                    }
                }
                Ok(())
            })?;
        }
        // The engine checks the skips, the counts and the ids (range,
        // repeats, the job id never used before) and orders the job after
        // the compute stream, as for a keyed job.
        self.submit_or_defer(&engine, id, lane, &blocks, Some(&first_subs))?;
        inner.jobs.insert(id, JobSlots { direction: dir, slots });
        Ok(())
    }

    /// The job's blocks, group by group (the shape checks of
    /// [`Offloader::submit`]; the rest is the engine's).
    fn slot_job_blocks(
        &self,
        job: &SlotJob<'_>,
        group_sizes: &[usize],
        first_subs: &[usize],
    ) -> Result<JobBlocks, OffloaderError> {
        let groups = self.geometry.layout.num_groups();
        let shape = |what, given, expected| Err(OffloaderError::SlotJobShape { what, given, expected });
        if group_sizes.len() != groups {
            return shape("group_sizes entries (one per KV cache group)", group_sizes.len(), groups);
        }
        if first_subs.len() != groups {
            return shape("first_subs entries (one per KV cache group)", first_subs.len(), groups);
        }
        let gpu_total = group_sizes.iter().fold(0usize, |a, &n| a.saturating_add(n));
        if job.gpu_blocks.len() != gpu_total {
            return shape("GPU block ids (the sum of group_sizes)", job.gpu_blocks.len(), gpu_total);
        }
        let f = self.geometry.kv.block_factor;
        let need: Vec<usize> = group_sizes
            .iter()
            .zip(first_subs)
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
        for (&n, &h) in group_sizes.iter().zip(&need) {
            out.groups.push(GroupBlocks {
                gpu: job.gpu_blocks[g_at..g_at + n].to_vec(),
                host: job.slots[s_at..s_at + h].to_vec(),
            });
            g_at += n;
            s_at += h;
        }
        Ok(out)
    }
}
