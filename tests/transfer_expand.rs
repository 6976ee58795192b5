//! Expansion of jobs into fragments, with merging, against a plain
//! reference (one fragment per page, host offsets computed from the
//! placement's definition), over random layouts and jobs.

#[path = "transfer_common/mod.rs"]
mod common;

use common::{Rng, Shape};
use kvoffload::internal::runtime::Fragment;
use kvoffload::internal::transfer::{merge_adjacent, JobBlocks};
use kvoffload::{DevicePtr, GroupSpec, JobId, KvLayout, TensorSpec, TransferError};
use proptest::prelude::*;

/// The layout of `shape` with host base `host_base` and tensors placed in
/// device memory back to back from `dev_base` (so merges across tensors
/// and blocks happen too), or with gaps.
fn layout(shape: &Shape, host_base: usize, dev_base: u64, gaps: bool) -> (KvLayout, Vec<Vec<u64>>) {
    let mut next = dev_base;
    let mut bases = Vec::new();
    let specs: Vec<GroupSpec> = shape
        .groups
        .iter()
        .map(|(pages, ng, nh)| {
            let mut b = Vec::new();
            let tensors = pages
                .iter()
                .map(|&p| {
                    let t = TensorSpec { device_base: DevicePtr(next), page_bytes: p };
                    b.push(next);
                    next += (p * ng) as u64 + if gaps { 4096 } else { 0 };
                    t
                })
                .collect();
            bases.push(b);
            GroupSpec { tensors, num_gpu_blocks: *ng, num_host_blocks: *nh }
        })
        .collect();
    (KvLayout::new(&specs, shape.factor, host_base, shape.placement).unwrap(), bases)
}

fn reference(shape: &Shape, job: &JobBlocks, host_base: usize, bases: &[Vec<u64>]) -> Vec<Fragment> {
    shape
        .pages(job)
        .into_iter()
        .map(|(g, t, gpu, off, p)| Fragment {
            host: host_base + off,
            device: DevicePtr(bases[g][t] + (gpu * p) as u64),
            bytes: p,
        })
        .collect()
}

/// Applies fragments to a byte map: host offset -> device address.
fn byte_map(frags: &[Fragment], host_base: usize) -> std::collections::BTreeMap<usize, DevicePtr> {
    let mut m = std::collections::BTreeMap::new();
    for f in frags {
        for k in 0..f.bytes {
            assert!(m.insert(f.host - host_base + k, f.device.offset(k)).is_none(), "host byte written twice");
        }
    }
    m
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn expansion_matches_reference(seed in any::<u64>(), host_base in 0usize..1 << 40, gaps in any::<bool>()) {
        let mut rng = Rng(seed);
        let shape = Shape::random(&mut rng);
        let (l, bases) = layout(&shape, host_base, 1 << 44, gaps);
        prop_assert_eq!(l.host_bytes(), shape.host_bytes());
        // The accessors give back what the layout was built from.
        prop_assert_eq!(l.block_size_factor(), shape.factor);
        prop_assert_eq!(l.host_base(), host_base);
        prop_assert_eq!(l.placement(), shape.placement);
        prop_assert_eq!(l.num_groups(), shape.groups.len());
        for (g, (pages, ng, nh)) in shape.groups.iter().enumerate() {
            prop_assert_eq!(l.num_gpu_blocks(g), *ng);
            prop_assert_eq!(l.num_host_blocks(g), *nh);
            // A GPU block's address is its tensor's base plus one page per block before it.
            for (t, &p) in pages.iter().enumerate() {
                let b = rng.range(0, *ng);
                prop_assert_eq!(l.device_addr(g, t, b), DevicePtr(bases[g][t] + (b * p) as u64));
            }
        }
        for _ in 0..4 {
            let job = shape.random_job(&mut rng);
            let got = l.expand(JobId(1), &job).unwrap();
            let plain = reference(&shape, &job, host_base, &bases);
            // Same bytes, each host byte from the same device byte.
            prop_assert_eq!(got.bytes, plain.iter().map(|f| f.bytes as u64).sum::<u64>());
            prop_assert_eq!(byte_map(&got.fragments, host_base), byte_map(&plain, host_base));
            // Exactly the greedy merge of the plain list: nothing merged that
            // is not adjacent on both sides, nothing adjacent left unmerged.
            prop_assert_eq!(&got.fragments, &merge_adjacent(&plain));
            for w in got.fragments.windows(2) {
                prop_assert!(!(w[0].host + w[0].bytes == w[1].host && w[0].device.offset(w[0].bytes) == w[1].device));
            }
            prop_assert!(got.fragments.len() <= plain.len());
        }
    }

    #[test]
    fn bad_ids_are_typed_errors(seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let shape = Shape::random(&mut rng);
        let (l, _) = layout(&shape, 1 << 30, 1 << 44, false);
        let job = shape.random_job(&mut rng);
        let g = job.groups.iter().position(|g| !g.gpu.is_empty()).unwrap();
        let (_, ng, nh) = shape.groups[g];

        let mut bad = job.clone();
        bad.groups[g].gpu[0] = ng + rng.range(0, 5);
        let gpu_block = bad.groups[g].gpu[0];
        prop_assert_eq!(l.expand(JobId(1), &bad).unwrap_err(),
            TransferError::GpuBlockOutOfRange { group: g, block: gpu_block, num_blocks: ng });

        let mut bad = job.clone();
        bad.groups[g].host[0] = nh + rng.range(0, 5);
        let host_block = bad.groups[g].host[0];
        prop_assert_eq!(l.expand(JobId(1), &bad).unwrap_err(),
            TransferError::HostBlockOutOfRange { group: g, block: host_block, num_blocks: nh });

        if job.groups[g].gpu.len() >= 2 {
            let mut bad = job.clone();
            bad.groups[g].gpu[1] = bad.groups[g].gpu[0];
            let block = bad.groups[g].gpu[0];
            prop_assert_eq!(l.expand(JobId(1), &bad).unwrap_err(), TransferError::RepeatedGpuBlock { group: g, block });
        }
        if job.groups[g].host.len() >= 2 {
            let mut bad = job.clone();
            bad.groups[g].host[1] = bad.groups[g].host[0];
            let block = bad.groups[g].host[0];
            prop_assert_eq!(l.expand(JobId(1), &bad).unwrap_err(), TransferError::RepeatedHostBlock { group: g, block });
        }
        let mut bad = job.clone();
        bad.groups[g].host.push(usize::MAX);
        let is_mismatch = matches!(l.expand(JobId(1), &bad).unwrap_err(), TransferError::BlockCountMismatch { .. });
        prop_assert!(is_mismatch);
    }
}

#[test]
fn large_runs_merge_across_blocks() {
    // One tensor, tensor-major: blocks 0..8 into host blocks 0..2 of 4 are
    // one contiguous run on both sides.
    let shape = Shape { groups: vec![(vec![4096], 8, 2)], factor: 4, placement: kvoffload::HostPlacement::TensorMajor };
    let (l, bases) = layout(&shape, 1 << 30, 1 << 44, false);
    let e = l.expand(JobId(1), &JobBlocks::single((0..8).collect(), vec![0, 1])).unwrap();
    assert_eq!(e.fragments, vec![Fragment { host: 1 << 30, device: DevicePtr(bases[0][0]), bytes: 8 * 4096 }]);
}

#[test]
fn strided_blocks_sit_one_per_stride_and_refuse_a_short_stride() {
    use kvoffload::{HostPlacement, LayoutError};
    // Two tensors of 4 KiB pages, factor 1: a host block is 8 KiB; with a
    // 16 KiB stride (two ranks' slots in a row) block b is at b * 16 KiB.
    let shape = Shape {
        groups: vec![(vec![4096, 4096], 8, 4)],
        factor: 1,
        placement: HostPlacement::BlockStrided { stride: 16384 },
    };
    let (l, bases) = layout(&shape, 1 << 30, 1 << 44, false);
    assert_eq!(l.host_bytes(), 3 * 16384 + 8192);
    assert_eq!(l.host_addr(0, 1, 2, 0), (1 << 30) + 2 * 16384 + 4096);
    let e = l.expand(JobId(1), &JobBlocks::single(vec![0, 1], vec![2, 3])).unwrap();
    // Consecutive GPU blocks of one tensor go to blocks one stride apart: no merge.
    assert_eq!(e.fragments.len(), 4);
    assert_eq!(e.fragments[0], Fragment { host: (1 << 30) + 2 * 16384, device: DevicePtr(bases[0][0]), bytes: 4096 });
    let short = kvoffload::KvLayout::new(
        &[GroupSpec {
            tensors: vec![TensorSpec { device_base: DevicePtr(0), page_bytes: 4096 }; 2],
            num_gpu_blocks: 1,
            num_host_blocks: 1,
        }],
        1,
        0,
        HostPlacement::BlockStrided { stride: 4096 },
    );
    assert_eq!(short.unwrap_err(), LayoutError::StrideTooSmall { stride: 4096, needed: 8192 });
}

/// A group whose GPU blocks or host blocks are empty while the other is
/// not is a count mismatch, not an empty group (which is allowed).
#[test]
fn one_sided_groups_are_count_mismatches() {
    use kvoffload::internal::transfer::GroupBlocks;
    use kvoffload::HostPlacement;
    let shape =
        Shape { groups: vec![(vec![64], 8, 4), (vec![32], 8, 4)], factor: 2, placement: HostPlacement::TensorMajor };
    let (l, _) = layout(&shape, 1 << 30, 1 << 44, false);
    let job = |g1: GroupBlocks| JobBlocks { groups: vec![GroupBlocks { gpu: vec![0, 1], host: vec![0] }, g1] };
    // Both sides empty: that group moves nothing, the other still moves.
    assert_eq!(l.expand(JobId(1), &job(GroupBlocks { gpu: vec![], host: vec![] })).unwrap().bytes, 2 * 64);
    assert_eq!(
        l.expand(JobId(1), &job(GroupBlocks { gpu: vec![], host: vec![2] })).unwrap_err(),
        TransferError::BlockCountMismatch { group: 1, gpu: 0, host: 1, factor: 2, min: 1, max: 2 }
    );
    assert_eq!(
        l.expand(JobId(1), &job(GroupBlocks { gpu: vec![3], host: vec![] })).unwrap_err(),
        TransferError::BlockCountMismatch { group: 1, gpu: 1, host: 0, factor: 2, min: 1, max: 0 }
    );
    assert_eq!(
        l.expand_skipping(JobId(1), &job(GroupBlocks { gpu: vec![], host: vec![2] }), &[0, 1]).unwrap_err(),
        TransferError::HostCountMismatch { group: 1, gpu: 0, host: 1, first_sub: 1, factor: 2, need: 0 }
    );
}

/// Repeats are found the same way whichever search a job's density picks
/// (a bitmap over the blocks, or a sort for a few ids among many blocks).
#[test]
fn repeats_are_found_in_sparse_and_dense_jobs() {
    use kvoffload::HostPlacement;
    for blocks in [16usize, 1 << 16] {
        let shape =
            Shape { groups: vec![(vec![64], blocks, blocks)], factor: 1, placement: HostPlacement::TensorMajor };
        let (l, _) = layout(&shape, 1 << 30, 1 << 44, false);
        let hi = blocks - 1;
        let ok = l.expand(JobId(1), &JobBlocks::single(vec![hi, 3], vec![5, hi]));
        assert_eq!(ok.map(|e| e.bytes), Ok(2 * 64), "{blocks} blocks: distinct ids refused");
        assert_eq!(
            l.expand(JobId(1), &JobBlocks::single(vec![hi, 3, hi], vec![0, 1, 2])).unwrap_err(),
            TransferError::RepeatedGpuBlock { group: 0, block: hi },
            "{blocks} blocks"
        );
        assert_eq!(
            l.expand(JobId(1), &JobBlocks::single(vec![0, 1, 2], vec![4, hi, 4])).unwrap_err(),
            TransferError::RepeatedHostBlock { group: 0, block: 4 },
            "{blocks} blocks"
        );
    }
}
