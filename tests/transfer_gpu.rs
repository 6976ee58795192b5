//! The transfer engine on a real GPU: the simulated-GPU correctness tests
//! again (every byte, both directions, every backend), the gather kernel's
//! vector and byte paths and its multi-launch tables, the staged backend in
//! many chunks on two streams and the automatic choice of it while the
//! other direction is busy, the fallback on unregistered memory, and
//! ordering after compute.
//!
//! Every test prints "SKIPPED <test>: <why>" and passes when no CUDA driver
//! is present or device 0 cannot be opened, and fails with the reason
//! instead where `KVO_EXPECT_GPU` is set (ci/gpu). Run on a GPU machine (and under
//! `compute-sanitizer --tool memcheck`) from binaries built by ci/build-gpu-bin:
//!   gpu-bin/tests/transfer_gpu --test-threads=1

#[path = "transfer_common/mod.rs"]
mod common;
#[path = "gpu_common/mod.rs"]
mod gpu_common;

use std::sync::Arc;

use common::{gated, opts, random_case, simple, Pin, Rig, Rng, Shape, DIRS};
use kvoffload::internal::transfer::JobBlocks;
use kvoffload::{Backend, BackendChoice, Direction, GpuRuntime, HostPlacement, JobId, Kernel, TransferOptions};

/// Device 0 for `test`, or None after saying it was skipped; fails the
/// test instead where a GPU is expected (`KVO_EXPECT_GPU`, see
/// tests/gpu_common/mod.rs).
fn gpu(test: &str) -> Option<Arc<dyn GpuRuntime>> {
    gpu_common::gpu(test).map(|rt| Arc::new(rt) as Arc<dyn GpuRuntime>)
}

fn random_layouts(rt: &Arc<dyn GpuRuntime>, choice: BackendChoice, expect: Option<Backend>, seed: u64) {
    let mut rng = Rng(seed);
    for case in 0..12 {
        random_case(rt.clone(), &mut rng, case, choice, expect, seed);
    }
    gated(&**rt, |gt| rt.ctx_synchronize(gt)).expect("context healthy");
}

/// A job of 20 of the rig's 24 blocks drawn by `rng` in each direction,
/// every byte checked, and each run by `backend`.
fn each_direction_by(rig: &mut Rig, mut rng: Rng, backend: Backend) {
    for dir in DIRS {
        let res = rig.run_checked(dir, &JobBlocks::single(rng.distinct(24, 20), rng.distinct(24, 20)), 7);
        assert_eq!(res.backend, backend);
    }
}

#[test]
fn gpu_every_byte_every_backend() {
    let Some(rt) = gpu("gpu_every_byte_every_backend") else { return };
    println!("device: {}", rt.describe());
    random_layouts(&rt, BackendChoice::Force(Backend::PerFragment), Some(Backend::PerFragment), 11);
    random_layouts(&rt, BackendChoice::Force(Backend::Batched), Some(Backend::Batched), 12);
    random_layouts(&rt, BackendChoice::Force(Backend::Gather), Some(Backend::Gather), 13);
    random_layouts(&rt, BackendChoice::Force(Backend::Staged), Some(Backend::Staged), 15);
    random_layouts(&rt, BackendChoice::Auto, None, 14);
}

/// `layers` tensors of `page`-byte pages, `blocks` blocks, block major.
fn block_major(layers: usize, page: usize, blocks: usize) -> Shape {
    Shape { groups: vec![(vec![page; layers], blocks, blocks)], factor: 1, placement: HostPlacement::BlockMajor }
}

#[test]
fn gpu_staged_in_many_chunks_at_kv_sizes() {
    let Some(rt) = gpu("gpu_staged_in_many_chunks_at_kv_sizes") else { return };
    // 8 layers of 32 KiB pages (host blocks of 256 KiB), 20 of 24 blocks a
    // job: in one chunk (default staging), in chunks of 4 pages alternating
    // between the two streams, and with 32 KiB + 8 pages (the kernel's byte
    // path, runs cut inside pages).
    for (page, staging) in [(32 << 10, 16 << 20), (32 << 10, 256 << 10), ((32 << 10) + 8, 256 << 10)] {
        let o = TransferOptions { staging_bytes: staging, ..opts(BackendChoice::Force(Backend::Staged)) };
        let mut rig = Rig::new(rt.clone(), block_major(8, page, 24), o, Pin::Registered);
        each_direction_by(&mut rig, Rng(page as u64 ^ staging as u64), Backend::Staged);
    }
    gated(&*rt, |gt| rt.ctx_synchronize(gt)).expect("context healthy");
}

#[test]
fn gpu_auto_stages_while_the_other_direction_is_busy() {
    let Some(rt) = gpu("gpu_auto_stages_while_the_other_direction_is_busy") else { return };
    // Host runs of 8 x 32 KiB: a load alone takes the gather kernel; a store
    // submitted while it is in flight (unreported) is staged.
    let mut rig = Rig::new(rt.clone(), block_major(8, 32 << 10, 16), opts(BackendChoice::Auto), Pin::Registered);
    rig.fill(3);
    let (host_before, dev_before) = (rig.host.to_vec(), rig.device_snapshot());
    let load = JobBlocks::single(vec![0, 5, 9], vec![4, 1, 12]);
    let store = JobBlocks::single(vec![2, 7, 11, 3], vec![0, 8, 3, 15]);
    rig.engine().load(JobId(1), &load).unwrap();
    rig.engine().store(JobId(2), &store).unwrap();
    rig.engine().wait_all().unwrap();
    let mut res = Vec::new();
    while res.len() < 2 {
        res.extend(rig.engine().poll_finished());
    }
    res.sort_by_key(|r| r.id);
    assert!(res.iter().all(|r| r.succeeded()), "{res:?}");
    assert_eq!((res[0].backend, res[1].backend), (Backend::Gather, Backend::Staged));
    let dev_after = rig.device_snapshot();
    for (dir, job) in [(Direction::HostToDevice, &load), (Direction::DeviceToHost, &store)] {
        for (g, t, b, off, p) in rig.shape.pages(job) {
            let (want, got) = match dir {
                Direction::HostToDevice => (&host_before[off..off + p], &dev_after[g][t][b * p..(b + 1) * p]),
                Direction::DeviceToHost => (&dev_before[g][t][b * p..(b + 1) * p], &rig.host[off..off + p]),
            };
            assert!(want == got, "{dir:?}: block {b} tensor {t} differs");
        }
    }
    rig.gated(|gt| rt.ctx_synchronize(gt)).expect("context healthy");
}

#[test]
fn gpu_gather_vector_and_byte_paths_at_kv_sizes() {
    let Some(rt) = gpu("gpu_gather_vector_and_byte_paths_at_kv_sizes") else { return };
    // 32 KiB pages (vector path), and a 32 KiB + 8 page (byte path), many
    // fragments per block of the grid; plus a 3-entry table (many launches).
    for (page, entries) in [(32 << 10, 1 << 16), ((32 << 10) + 8, 1 << 16), (4096, 3)] {
        let o = TransferOptions { gather_table_entries: entries, ..opts(BackendChoice::Force(Backend::Gather)) };
        let mut rig = Rig::new(rt.clone(), simple(2, page, 24), o, Pin::Registered);
        each_direction_by(&mut rig, Rng(page as u64), Backend::Gather);
    }
    gated(&*rt, |gt| rt.ctx_synchronize(gt)).expect("context healthy");
}

#[test]
fn gpu_gather_never_runs_on_unregistered_memory() {
    let Some(rt) = gpu("gpu_gather_never_runs_on_unregistered_memory") else { return };
    for choice in [BackendChoice::Force(Backend::Gather), BackendChoice::Auto] {
        let mut rig = Rig::new(rt.clone(), simple(2, 16 << 10, 16), opts(choice), Pin::Unregistered);
        for dir in DIRS {
            let res = rig.run_checked(dir, &JobBlocks::single(vec![3, 9, 1], vec![7, 2, 0]), 3);
            assert_eq!(res.backend, Backend::PerFragment);
        }
    }
    // A gather kernel on pageable memory would have faulted the context.
    gated(&*rt, |gt| rt.ctx_synchronize(gt)).expect("context healthy");
}

#[test]
fn gpu_store_is_ordered_after_compute() {
    let Some(rt) = gpu("gpu_store_is_ordered_after_compute") else { return };
    let page = 1 << 20;
    let mut rig = Rig::new(rt.clone(), simple(1, page, 8), opts(BackendChoice::Auto), Pin::Registered);
    rig.fill(1);
    let tensor = rig.tensors[0][0];
    // 50 ms of spinning, then the memset, on the compute stream; the store
    // must wait for both.
    // SAFETY: the spin kernel touches no memory; the memset writes the rig's
    // tensor of 8 pages, which outlives the store waited for below.
    unsafe {
        rt.launch(Kernel::Spin { nanos: 50_000_000 }, rig.compute).unwrap();
        rt.memset_d8_async(tensor, 0xab, 8 * page, rig.compute).unwrap();
    }
    rig.engine().store(JobId(100), &JobBlocks::single((0..8).collect(), vec![7, 6, 5, 4, 3, 2, 1, 0])).unwrap();
    rig.engine().wait(JobId(100)).unwrap();
    assert!(rig.poll_until(JobId(100)).iter().all(|r| r.succeeded()));
    assert!(rig.host[..8 * page].iter().all(|&b| b == 0xab), "the store did not see the compute stream's memset");
}
