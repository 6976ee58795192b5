//! The cuda backend on a real GPU (skipped, with a message, without one):
//! copies, capture and replay, and chunked pinning through the coordinator.

use kvoffload::internal::pin::{pin_all, NoPrefault};
use kvoffload::internal::protocol::Coordinator;
use kvoffload::{CaptureMode, CapturePolicy, DevicePtr, GpuRuntime, PinState};

#[path = "gpu_common/mod.rs"]
mod gpu_common;
use gpu_common::{gated, gpu};

#[test]
fn gpu_copy_round_trip_and_graph_replay() {
    let Some(rt) = gpu("gpu_copy_round_trip_and_graph_replay") else { return };
    let n = 1 << 20;
    let s = rt.stream_create().unwrap();
    let d = gated(&rt, |gt| rt.mem_alloc(gt, n)).unwrap();
    let src: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    let mut out = vec![0u8; n];
    // SAFETY: both buffers outlive the synchronize below.
    unsafe {
        rt.copy_htod_async(d, src.as_ptr() as usize, n, s).unwrap();
        rt.copy_dtoh_async(out.as_mut_ptr() as usize, d, n, s).unwrap();
    }
    gated(&rt, |gt| rt.stream_synchronize(gt, s)).unwrap();
    assert_eq!(src, out);

    rt.begin_capture(s, CaptureMode::Global).unwrap();
    // SAFETY: `d` is an allocation of `n` bytes, read back after the replay
    // is synchronized and freed after the graph is destroyed.
    unsafe { rt.memset_d8_async(d, 0x5a, n, s).unwrap() };
    let g = rt.end_capture(s).unwrap();
    rt.graph_launch(g, s).unwrap();
    gated(&rt, |gt| rt.stream_synchronize(gt, s)).unwrap();
    // SAFETY: `out` is writable.
    unsafe { rt.copy_dtoh(out.as_mut_ptr() as usize, d, n).unwrap() };
    assert!(out.iter().all(|&b| b == 0x5a));
    rt.graph_destroy(g).unwrap();
    // SAFETY: the replay was synchronized and the graph is destroyed.
    gated(&rt, |gt| unsafe { rt.mem_free(gt, d) }).unwrap();
    rt.stream_destroy(s).unwrap();
}

#[test]
fn gpu_chunked_pinning_and_rollback_free_shutdown() {
    let Some(rt) = gpu("gpu_chunked_pinning_and_rollback_free_shutdown") else { return };
    let chunk = 64 << 20;
    let mut mem = memmap2::MmapMut::map_anon(4 * chunk).unwrap();
    mem.fill(1);
    let base = mem.as_ptr() as usize;
    let ranges: Vec<_> = (0..4).map(|i| (base + i * chunk, chunk)).collect();
    // SAFETY: the ranges are pieces of `mem` (read-write), which the
    // coordinator holds.
    let coord = unsafe { Coordinator::new(&rt, CapturePolicy::AfterPinning, &ranges, Some(Box::new(mem))) }.unwrap();
    assert_eq!(pin_all(&rt, &coord, &NoPrefault), PinState::Pinned);
    let alias = coord.acquire_alias(base + chunk, 4096).expect("alias of a registered chunk");
    assert_ne!(alias.device, DevicePtr::NULL);
    drop(alias);
    kvoffload::internal::protocol::shutdown(&rt, &coord, || {}).unwrap();
    assert_eq!(coord.pinning().registered_chunks(), 0);
}
