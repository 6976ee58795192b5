//! The transfer engine on a real GPU: the simulated-GPU correctness tests
//! again (every byte, both directions, every backend), the gather kernel's
//! vector and byte paths and its multi-launch tables, the fallback on
//! unregistered memory, and ordering after compute.
//!
//! Every test prints "skipped: no GPU" and passes when no CUDA driver is
//! present or device 0 cannot be opened. Run on a GPU machine (and under
//! `compute-sanitizer --tool memcheck`) from binaries built by ci/build-gpu-bin:
//!   gpu-bin/tests/transfer_gpu --test-threads=1

#[path = "transfer_common/mod.rs"]
mod common;

use std::sync::Arc;

use common::{gated, opts, random_case, simple, Pin, Rig, Rng, DIRS};
use kvoffload::runtime::cuda::CudaRuntime;
use kvoffload::runtime::{GpuRuntime, Kernel};
use kvoffload::transfer::{Backend, BackendChoice, JobBlocks, TransferOptions};

/// Says on the real stderr (the test harness captures println) that the
/// GPU tests were skipped.
fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED transfer_gpu: no GPU ({why})");
}

fn gpu() -> Option<Arc<dyn GpuRuntime>> {
    if !CudaRuntime::driver_present() {
        skipped("no CUDA driver");
        return None;
    }
    match CudaRuntime::open(0) {
        Ok(rt) => Some(Arc::new(rt)),
        Err(e) => {
            skipped(&e.to_string());
            None
        }
    }
}

fn random_layouts(rt: &Arc<dyn GpuRuntime>, choice: BackendChoice, expect: Option<Backend>, seed: u64) {
    let mut rng = Rng(seed);
    for case in 0..12 {
        random_case(rt.clone(), &mut rng, case, choice, expect, seed);
    }
    gated(|gt| rt.ctx_synchronize(gt)).expect("context healthy");
}

#[test]
fn gpu_every_byte_every_backend() {
    let Some(rt) = gpu() else { return };
    println!("device: {}", rt.describe());
    random_layouts(&rt, BackendChoice::Force(Backend::PerFragment), Some(Backend::PerFragment), 11);
    random_layouts(&rt, BackendChoice::Force(Backend::Batched), Some(Backend::Batched), 12);
    random_layouts(&rt, BackendChoice::Force(Backend::Gather), Some(Backend::Gather), 13);
    random_layouts(&rt, BackendChoice::Auto, None, 14);
}

#[test]
fn gpu_gather_vector_and_byte_paths_at_kv_sizes() {
    let Some(rt) = gpu() else { return };
    // 32 KiB pages (vector path), and a 32 KiB + 8 page (byte path), many
    // fragments per block of the grid; plus a 3-entry table (many launches).
    for (page, entries) in [(32 << 10, 1 << 16), ((32 << 10) + 8, 1 << 16), (4096, 3)] {
        let o = TransferOptions { gather_table_entries: entries, ..opts(BackendChoice::Force(Backend::Gather)) };
        let mut rig = Rig::new(rt.clone(), simple(2, page, 24), o, Pin::Registered);
        let mut rng = Rng(page as u64);
        for dir in DIRS {
            let res = rig.run_checked(dir, &JobBlocks::single(rng.distinct(24, 20), rng.distinct(24, 20)), 7);
            assert_eq!(res.backend, Backend::Gather);
        }
    }
    gated(|gt| rt.ctx_synchronize(gt)).expect("context healthy");
}

#[test]
fn gpu_gather_never_runs_on_unregistered_memory() {
    let Some(rt) = gpu() else { return };
    for choice in [BackendChoice::Force(Backend::Gather), BackendChoice::Auto] {
        let mut rig = Rig::new(rt.clone(), simple(2, 16 << 10, 16), opts(choice), Pin::Unregistered);
        for dir in DIRS {
            let res = rig.run_checked(dir, &JobBlocks::single(vec![3, 9, 1], vec![7, 2, 0]), 3);
            assert_eq!(res.backend, Backend::PerFragment);
        }
    }
    // A gather kernel on pageable memory would have faulted the context.
    gated(|gt| rt.ctx_synchronize(gt)).expect("context healthy");
}

#[test]
fn gpu_store_is_ordered_after_compute() {
    let Some(rt) = gpu() else { return };
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
    rig.engine().store(100, &JobBlocks::single((0..8).collect(), vec![7, 6, 5, 4, 3, 2, 1, 0])).unwrap();
    rig.engine().wait(100).unwrap();
    assert!(rig.poll_until(100).iter().all(|r| r.succeeded()));
    assert!(rig.host[..8 * page].iter().all(|&b| b == 0xab), "the store did not see the compute stream's memset");
}
