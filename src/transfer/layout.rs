//! Where every KV block lives, on the GPU and in host memory, and the
//! expansion of a job's block ids into copy fragments.
//!
//! - GPU side: each KV cache *group* has tensors (one per layer, or per
//!   shared K/V tensor), each seen as `[num_gpu_blocks, page_bytes]`: GPU
//!   block `g` of tensor `t` is `page_bytes(t)` bytes at
//!   `device_base(t) + g * page_bytes(t)`.
//! - Host side: each group has `num_host_blocks` *host blocks* (the issue's
//!   host chunks, upstream's CPU blocks). A host block holds
//!   `block_size_factor` GPU blocks of every tensor of its group
//!   (upstream's `block_size_factor`). Sub-block `j` of host block `b` for
//!   tensor `t` sits at `host_base(t) + b * host_stride(t) + j * page_bytes(t)`;
//!   [`HostPlacement`] decides the bases and strides.
//! - A job names, per group, GPU block ids and host block ids. Only the
//!   first host block may be partial: with `h` host blocks and `n` GPU
//!   blocks, the first `h * factor - n` sub-blocks of the first host block
//!   are skipped (upstream's `skip_count`), so `n` lies in
//!   `(h-1)*factor+1 ..= h*factor`.
//!
//! - [`KvLayout::expand_skipping`] takes the skip per group instead
//!   (vLLM's `block_indices`): `n` GPU blocks go to sub-blocks
//!   `first_sub .. first_sub + n` of the group's `h` host blocks, so the
//!   first and the last host block may be partial and
//!   `h == ceil((n + first_sub) / factor)`. With `first_sub` 0 and full
//!   host blocks both rules agree; otherwise they differ (the derived skip
//!   fills the last host block, vLLM's may leave it partial).
//!
//! [`KvLayout::expand`] turns a job into `(host, device, bytes)` fragments,
//! tensor by tensor in job order, merging each fragment into the previous
//! one when both sides are contiguous.

use crate::runtime::{DevicePtr, Fragment};

use super::error::{LayoutError, TransferError};
use super::JobId;

/// One GPU tensor, seen as `[num_gpu_blocks, page_bytes]`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Device address of GPU block 0.
    pub device_base: DevicePtr,
    /// Bytes of one GPU block of this tensor.
    pub page_bytes: usize,
}

/// One KV cache group: its tensors and its GPU and host block counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// The group's tensors (every layer, or every shared tensor).
    pub tensors: Vec<TensorSpec>,
    /// GPU blocks in every tensor of the group.
    pub num_gpu_blocks: usize,
    /// Host blocks the group owns in host memory.
    pub num_host_blocks: usize,
}

/// How host blocks are laid out in host memory. Groups follow each other
/// from the layout's host base, in order.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum HostPlacement {
    /// Per tensor, one host area of `num_host_blocks * factor` pages, like a
    /// CPU mirror of the GPU tensor (upstream's CPU tensors). Consecutive
    /// host blocks of one tensor are contiguous.
    #[default]
    TensorMajor,
    /// Per host block, one contiguous span holding `factor` pages of every
    /// tensor of the group, tensor after tensor (one manager slot per host
    /// block).
    BlockMajor,
    /// Like [`HostPlacement::BlockMajor`] (each host block one contiguous
    /// span of `factor` pages of every tensor, tensor after tensor), but
    /// host block `b` of every group starts `b * stride` bytes after the
    /// group's first block: the blocks of one rank in a shared region,
    /// one per row (stride = the row's bytes). Groups sit side by side at
    /// the start of each stride, in order, so `stride` must hold one host
    /// block of every group ([`LayoutError::StrideTooSmall`] otherwise).
    BlockStrided {
        /// Bytes from one host block to the next.
        stride: usize,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct TensorLayout {
    device_base: DevicePtr,
    page_bytes: usize,
    host_base: usize,
    host_stride: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct GroupLayout {
    tensors: Vec<TensorLayout>,
    num_gpu_blocks: usize,
    num_host_blocks: usize,
}

/// The block ids of one job for one KV cache group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupBlocks {
    /// GPU block ids, in transfer order.
    pub gpu: Vec<usize>,
    /// Host block ids; GPU block `i` goes to sub-block `i + skip` of this
    /// list's concatenated sub-blocks (see the module docs).
    pub host: Vec<usize>,
}

/// The blocks of one job, one entry per KV cache group of the layout.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobBlocks {
    /// Per group, in the layout's group order.
    pub groups: Vec<GroupBlocks>,
}

impl JobBlocks {
    /// A job for a layout with a single KV cache group.
    pub fn single(gpu: Vec<usize>, host: Vec<usize>) -> Self {
        JobBlocks { groups: vec![GroupBlocks { gpu, host }] }
    }
}

/// A job expanded into copy fragments.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Expansion {
    /// Fragments after merging, in transfer order.
    pub fragments: Vec<Fragment>,
    /// Total bytes of the fragments.
    pub bytes: u64,
}

/// Where every block of every group lives (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    groups: Vec<GroupLayout>,
    factor: usize,
    host_base: usize,
    host_bytes: usize,
    placement: HostPlacement,
}

/// Tensors of a block-placed group: each host block is one span holding
/// `factor` pages of every tensor, tensor after tensor, from `start`;
/// blocks repeat every `stride` bytes. The caller checked that the span
/// (`factor` x the tensors' page bytes) fits, so no offset here overflows.
fn block_interleaved(tensors: &[TensorSpec], start: usize, factor: usize, stride: usize) -> Vec<TensorLayout> {
    let mut off = 0usize;
    tensors
        .iter()
        .map(|t| {
            let l = TensorLayout {
                device_base: t.device_base,
                page_bytes: t.page_bytes,
                host_base: start + off,
                host_stride: stride,
            };
            off += t.page_bytes * factor;
            l
        })
        .collect()
}

fn overflow(what: &'static str, detail: String) -> LayoutError {
    LayoutError::Overflow { what, detail }
}

impl KvLayout {
    /// A layout of `groups`, `block_size_factor` GPU blocks per host block,
    /// host blocks placed from `host_base` by `placement`. Checks every
    /// size for zero and every address computation for overflow.
    pub fn new(
        groups: &[GroupSpec],
        block_size_factor: usize,
        host_base: usize,
        placement: HostPlacement,
    ) -> Result<Self, LayoutError> {
        if groups.is_empty() {
            return Err(LayoutError::NoGroups);
        }
        if block_size_factor == 0 {
            return Err(LayoutError::Zero { what: "block_size_factor" });
        }
        let f = block_size_factor;
        let mut cursor = host_base;
        // BlockStrided: the end of the furthest host block of any group.
        let mut strided_end = host_base;
        let mut out = Vec::with_capacity(groups.len());
        for (gi, g) in groups.iter().enumerate() {
            if g.tensors.is_empty() {
                return Err(LayoutError::NoTensors { group: gi });
            }
            if g.num_gpu_blocks == 0 {
                return Err(LayoutError::Zero { what: "num_gpu_blocks" });
            }
            if g.num_host_blocks == 0 {
                return Err(LayoutError::Zero { what: "num_host_blocks" });
            }
            let mut sum_pages = 0usize;
            for t in &g.tensors {
                if t.page_bytes == 0 {
                    return Err(LayoutError::Zero { what: "page_bytes" });
                }
                (t.page_bytes as u64)
                    .checked_mul(g.num_gpu_blocks as u64)
                    .and_then(|n| n.checked_add(t.device_base.raw()))
                    .ok_or_else(|| overflow("device tensor end", format!("{t:?} x {} blocks", g.num_gpu_blocks)))?;
                sum_pages = sum_pages
                    .checked_add(t.page_bytes)
                    .ok_or_else(|| overflow("host block size", format!("group {gi}")))?;
            }
            let pages_per_tensor = g
                .num_host_blocks
                .checked_mul(f)
                .ok_or_else(|| overflow("host sub-blocks", format!("{} x {f}", g.num_host_blocks)))?;
            let tensors = match placement {
                HostPlacement::TensorMajor => {
                    let mut tensors = Vec::with_capacity(g.tensors.len());
                    for t in &g.tensors {
                        let stride =
                            t.page_bytes.checked_mul(f).ok_or_else(|| overflow("host stride", format!("{t:?}")))?;
                        let area = pages_per_tensor
                            .checked_mul(t.page_bytes)
                            .ok_or_else(|| overflow("host area", format!("{t:?}")))?;
                        tensors.push(TensorLayout {
                            device_base: t.device_base,
                            page_bytes: t.page_bytes,
                            host_base: cursor,
                            host_stride: stride,
                        });
                        cursor = cursor.checked_add(area).ok_or_else(|| overflow("host end", format!("group {gi}")))?;
                    }
                    tensors
                }
                HostPlacement::BlockMajor => {
                    let block =
                        sum_pages.checked_mul(f).ok_or_else(|| overflow("host block", format!("group {gi}")))?;
                    let area = block
                        .checked_mul(g.num_host_blocks)
                        .ok_or_else(|| overflow("host area", format!("group {gi}")))?;
                    let end = cursor.checked_add(area).ok_or_else(|| overflow("host end", format!("group {gi}")))?;
                    let tensors = block_interleaved(&g.tensors, cursor, f, block);
                    cursor = end;
                    tensors
                }
                HostPlacement::BlockStrided { stride } => {
                    let block =
                        sum_pages.checked_mul(f).ok_or_else(|| overflow("host block", format!("group {gi}")))?;
                    // Group `gi`'s blocks start at `cursor` (after the blocks
                    // of the groups before it) and repeat every `stride`.
                    let used = cursor - host_base;
                    let needed =
                        used.checked_add(block).ok_or_else(|| overflow("host block", format!("group {gi}")))?;
                    if needed > stride {
                        return Err(LayoutError::StrideTooSmall { stride, needed });
                    }
                    let last = (g.num_host_blocks - 1)
                        .checked_mul(stride)
                        .and_then(|o| o.checked_add(cursor))
                        .and_then(|o| o.checked_add(block))
                        .ok_or_else(|| overflow("host end", format!("group {gi}")))?;
                    strided_end = strided_end.max(last);
                    let tensors = block_interleaved(&g.tensors, cursor, f, stride);
                    cursor += block;
                    tensors
                }
            };
            out.push(GroupLayout { tensors, num_gpu_blocks: g.num_gpu_blocks, num_host_blocks: g.num_host_blocks });
        }
        if let HostPlacement::BlockStrided { .. } = placement {
            cursor = strided_end;
        }
        if cursor > isize::MAX as usize {
            return Err(overflow("host end", format!("{cursor:#x} beyond isize::MAX")));
        }
        Ok(KvLayout { groups: out, factor: f, host_base, host_bytes: cursor - host_base, placement })
    }

    /// GPU blocks per host block.
    pub fn block_size_factor(&self) -> usize {
        self.factor
    }

    /// First host address of the layout.
    pub fn host_base(&self) -> usize {
        self.host_base
    }

    /// Bytes of host memory the layout spans from [`KvLayout::host_base`].
    pub fn host_bytes(&self) -> usize {
        self.host_bytes
    }

    /// How host blocks are placed.
    pub fn placement(&self) -> HostPlacement {
        self.placement
    }

    /// Number of KV cache groups.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// GPU blocks of group `g`.
    pub fn num_gpu_blocks(&self, g: usize) -> usize {
        self.groups[g].num_gpu_blocks
    }

    /// Host blocks of group `g`.
    pub fn num_host_blocks(&self, g: usize) -> usize {
        self.groups[g].num_host_blocks
    }

    /// Host address of sub-block `j` of host block `b` for tensor `t` of
    /// group `g` (no range check beyond the indexing of `g` and `t`).
    pub fn host_addr(&self, g: usize, t: usize, b: usize, j: usize) -> usize {
        let t = &self.groups[g].tensors[t];
        t.host_base + b * t.host_stride + j * t.page_bytes
    }

    /// Device address of GPU block `block` of tensor `t` of group `g`.
    pub fn device_addr(&self, g: usize, t: usize, block: usize) -> DevicePtr {
        let t = &self.groups[g].tensors[t];
        DevicePtr(t.device_base.raw() + (block as u64) * (t.page_bytes as u64))
    }

    /// Checks `job` against the layout (typed errors for every bad id or
    /// count) and expands it into merged fragments.
    pub fn expand(&self, id: JobId, job: &JobBlocks) -> Result<Expansion, TransferError> {
        self.expand_with(id, job, None)
    }

    /// [`KvLayout::expand`] with the skip of each group's first host block
    /// given (`first_subs[g]`, one per group; see the module docs):
    /// [`TransferError::FirstSubTooLarge`] when one is `factor` or more,
    /// [`TransferError::HostCountMismatch`] when a group's host blocks are
    /// not exactly `ceil((gpu + first_sub) / factor)`, the other checks as
    /// for `expand`.
    pub fn expand_skipping(
        &self,
        id: JobId,
        job: &JobBlocks,
        first_subs: &[usize],
    ) -> Result<Expansion, TransferError> {
        if first_subs.len() != self.groups.len() {
            return Err(TransferError::GroupCount { given: first_subs.len(), expected: self.groups.len() });
        }
        self.expand_with(id, job, Some(first_subs))
    }

    fn expand_with(
        &self,
        id: JobId,
        job: &JobBlocks,
        first_subs: Option<&[usize]>,
    ) -> Result<Expansion, TransferError> {
        if job.groups.len() != self.groups.len() {
            return Err(TransferError::GroupCount { given: job.groups.len(), expected: self.groups.len() });
        }
        let mut skips = Vec::with_capacity(job.groups.len());
        for (gi, (gb, gl)) in job.groups.iter().zip(&self.groups).enumerate() {
            skips.push(self.check_group(gi, gb, gl, first_subs.map(|s| s[gi]))?);
        }
        let pages: usize = job.groups.iter().zip(&self.groups).map(|(gb, gl)| gb.gpu.len() * gl.tensors.len()).sum();
        let mut out = Expansion { fragments: Vec::with_capacity(pages), bytes: 0 };
        for (gi, (gb, gl)) in job.groups.iter().zip(&self.groups).enumerate() {
            let skip = skips[gi];
            for (ti, t) in gl.tensors.iter().enumerate() {
                for (i, &gpu) in gb.gpu.iter().enumerate() {
                    let s = i + skip;
                    let host = self.host_addr(gi, ti, gb.host[s / self.factor], s % self.factor);
                    let device = DevicePtr(t.device_base.raw() + (gpu as u64) * (t.page_bytes as u64));
                    push_merged(&mut out.fragments, Fragment { host, device, bytes: t.page_bytes });
                    out.bytes += t.page_bytes as u64;
                }
            }
        }
        if out.fragments.is_empty() {
            return Err(TransferError::EmptyJob { id });
        }
        Ok(out)
    }

    /// Validates one group of a job; returns its skip count (`first_sub`
    /// when given, else derived).
    fn check_group(
        &self,
        gi: usize,
        gb: &GroupBlocks,
        gl: &GroupLayout,
        first_sub: Option<usize>,
    ) -> Result<usize, TransferError> {
        let f = self.factor;
        let (n, h) = (gb.gpu.len(), gb.host.len());
        if let Some(s) = first_sub {
            if s >= f {
                return Err(TransferError::FirstSubTooLarge { group: gi, first_sub: s, factor: f });
            }
        }
        if n == 0 && h == 0 {
            return Ok(0);
        }
        let skip = match first_sub {
            None => {
                let max = h.saturating_mul(f);
                let min = if h == 0 { 1 } else { (h - 1).saturating_mul(f) + 1 };
                if n < min || n > max {
                    return Err(TransferError::BlockCountMismatch { group: gi, gpu: n, host: h, factor: f, min, max });
                }
                max - n
            }
            Some(s) => {
                // s < f, so n + s cannot overflow past n + f.
                let need = if n == 0 { 0 } else { n.saturating_add(s).div_ceil(f) };
                if h != need {
                    return Err(TransferError::HostCountMismatch {
                        group: gi,
                        gpu: n,
                        host: h,
                        first_sub: s,
                        factor: f,
                        need,
                    });
                }
                s
            }
        };
        if let Some(&block) = gb.gpu.iter().find(|&&b| b >= gl.num_gpu_blocks) {
            return Err(TransferError::GpuBlockOutOfRange { group: gi, block, num_blocks: gl.num_gpu_blocks });
        }
        if let Some(&block) = gb.host.iter().find(|&&b| b >= gl.num_host_blocks) {
            return Err(TransferError::HostBlockOutOfRange { group: gi, block, num_blocks: gl.num_host_blocks });
        }
        if let Some(block) = first_repeat(&gb.gpu, gl.num_gpu_blocks) {
            return Err(TransferError::RepeatedGpuBlock { group: gi, block });
        }
        if let Some(block) = first_repeat(&gb.host, gl.num_host_blocks) {
            return Err(TransferError::RepeatedHostBlock { group: gi, block });
        }
        Ok(skip)
    }
}

/// An id that appears more than once in `ids` (all below `universe`), if
/// any: a bitmap when the job is dense enough for one to be cheap (the
/// bench's 65536-block jobs), a sort otherwise.
fn first_repeat(ids: &[usize], universe: usize) -> Option<usize> {
    if ids.len() < 2 {
        return None;
    }
    if universe / 64 <= ids.len().saturating_mul(4) {
        let mut seen = vec![0u64; universe.div_ceil(64)];
        for &b in ids {
            let (w, bit) = (b / 64, 1u64 << (b % 64));
            if seen[w] & bit != 0 {
                return Some(b);
            }
            seen[w] |= bit;
        }
        return None;
    }
    let mut v = ids.to_vec();
    v.sort_unstable();
    v.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// Appends `f`, or extends the last fragment when `f` continues it on both
/// the host and the device side.
fn push_merged(out: &mut Vec<Fragment>, f: Fragment) {
    if let Some(last) = out.last_mut() {
        if last.host + last.bytes == f.host && last.device.offset(last.bytes) == f.device {
            last.bytes += f.bytes;
            return;
        }
    }
    out.push(f);
}

/// Merges adjacent fragments of `frags` the way [`KvLayout::expand`] does
/// (for references and tests).
pub fn merge_adjacent(frags: &[Fragment]) -> Vec<Fragment> {
    let mut out = Vec::with_capacity(frags.len());
    for &f in frags {
        push_merged(&mut out, f);
    }
    out
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn one(pages: &[usize], f: usize, placement: HostPlacement) -> KvLayout {
        let tensors = pages
            .iter()
            .enumerate()
            .map(|(i, &p)| TensorSpec { device_base: DevicePtr((i as u64 + 1) << 32), page_bytes: p })
            .collect();
        KvLayout::new(&[GroupSpec { tensors, num_gpu_blocks: 8, num_host_blocks: 4 }], f, 0x1000, placement).unwrap()
    }

    #[test]
    fn partial_first_host_block_skips_leading_sub_blocks() {
        let l = one(&[16], 4, HostPlacement::TensorMajor);
        // 6 GPU blocks into 2 host blocks of 4: skip 2 of host block 3.
        let e = l.expand(JobId(1), &JobBlocks::single(vec![0, 1, 2, 3, 4, 5], vec![3, 0])).unwrap();
        assert_eq!(e.bytes, 96);
        assert_eq!(
            e.fragments,
            vec![
                Fragment { host: 0x1000 + 3 * 64 + 2 * 16, device: DevicePtr(1 << 32), bytes: 32 },
                Fragment { host: 0x1000, device: DevicePtr((1 << 32) + 32), bytes: 64 },
            ]
        );
    }

    #[test]
    fn explicit_skip_leaves_first_and_last_host_block_partial() {
        let l = one(&[16], 4, HostPlacement::TensorMajor);
        // 3 GPU blocks from sub-block 2: 2 of host block 3, 1 of host block 0.
        let e = l.expand_skipping(JobId(1), &JobBlocks::single(vec![0, 1, 2], vec![3, 0]), &[2]).unwrap();
        assert_eq!(e.bytes, 48);
        assert_eq!(
            e.fragments,
            vec![
                Fragment { host: 0x1000 + 3 * 64 + 2 * 16, device: DevicePtr(1 << 32), bytes: 32 },
                Fragment { host: 0x1000, device: DevicePtr((1 << 32) + 32), bytes: 16 },
            ]
        );
        // The derived rule refuses the same job: there only the first host
        // block may be partial.
        let d = l.expand(JobId(1), &JobBlocks::single(vec![0, 1, 2], vec![3, 0])).unwrap_err();
        assert!(matches!(d, TransferError::BlockCountMismatch { min: 5, max: 8, .. }), "{d:?}");
        let e = |g: Vec<usize>, h: Vec<usize>, s: usize| {
            l.expand_skipping(JobId(7), &JobBlocks::single(g, h), &[s]).unwrap_err()
        };
        assert!(matches!(e(vec![0], vec![0], 4), TransferError::FirstSubTooLarge { first_sub: 4, factor: 4, .. }));
        assert!(matches!(e(vec![0, 1, 2], vec![0], 2), TransferError::HostCountMismatch { need: 2, host: 1, .. }));
        assert!(matches!(e(vec![0], vec![0, 1], 0), TransferError::HostCountMismatch { need: 1, host: 2, .. }));
        assert!(matches!(e(vec![], vec![], 0), TransferError::EmptyJob { id: JobId(7) }));
        assert!(matches!(
            l.expand_skipping(JobId(1), &JobBlocks::single(vec![0], vec![0]), &[]).unwrap_err(),
            TransferError::GroupCount { given: 0, expected: 1 }
        ));
    }

    #[test]
    fn block_major_places_tensors_inside_each_host_block() {
        let l = one(&[16, 32], 2, HostPlacement::BlockMajor);
        assert_eq!(l.host_bytes(), 4 * 2 * 48);
        assert_eq!(l.host_addr(0, 1, 1, 1), 0x1000 + 96 + 32 + 32);
    }

    #[test]
    fn typed_errors() {
        let l = one(&[16], 2, HostPlacement::TensorMajor);
        let e = |g: Vec<usize>, h: Vec<usize>| l.expand(JobId(7), &JobBlocks::single(g, h)).unwrap_err();
        assert!(matches!(e(vec![8], vec![0]), TransferError::GpuBlockOutOfRange { block: 8, .. }));
        assert!(matches!(e(vec![0], vec![4]), TransferError::HostBlockOutOfRange { block: 4, .. }));
        assert!(matches!(e(vec![1, 1], vec![0]), TransferError::RepeatedGpuBlock { block: 1, .. }));
        assert!(matches!(e(vec![1, 2, 3], vec![0, 0]), TransferError::RepeatedHostBlock { block: 0, .. }));
        assert!(matches!(e(vec![1, 2, 3], vec![0]), TransferError::BlockCountMismatch { min: 1, max: 2, .. }));
        assert!(matches!(e(vec![1], vec![0, 1]), TransferError::BlockCountMismatch { min: 3, max: 4, .. }));
        assert!(matches!(e(vec![], vec![]), TransferError::EmptyJob { id: JobId(7) }));
        assert!(matches!(
            l.expand(JobId(1), &JobBlocks::default()).unwrap_err(),
            TransferError::GroupCount { given: 0, expected: 1 }
        ));
    }

    #[test]
    fn layout_errors() {
        let t = TensorSpec { device_base: DevicePtr(0), page_bytes: 16 };
        let g = GroupSpec { tensors: vec![t], num_gpu_blocks: 1, num_host_blocks: 1 };
        assert_eq!(KvLayout::new(&[], 1, 0, HostPlacement::TensorMajor), Err(LayoutError::NoGroups));
        assert_eq!(
            KvLayout::new(std::slice::from_ref(&g), 0, 0, HostPlacement::TensorMajor),
            Err(LayoutError::Zero { what: "block_size_factor" })
        );
        let mut z = g.clone();
        z.tensors[0].page_bytes = 0;
        assert_eq!(
            KvLayout::new(&[z], 1, 0, HostPlacement::TensorMajor),
            Err(LayoutError::Zero { what: "page_bytes" })
        );
        let mut big = g;
        big.num_host_blocks = usize::MAX / 2;
        assert!(matches!(KvLayout::new(&[big], 4, 0, HostPlacement::BlockMajor), Err(LayoutError::Overflow { .. })));
    }
}
