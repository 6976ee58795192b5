//! P8 all-or-nothing: after a registration failure at chunk k (first,
//! middle or last of 3; of 10 under shuttle), every chunk registered before it is unregistered
//! and the region is usable as pageable memory; this holds while the engine
//! captures a graph in a capture window concurrently (Interleave policy).
//!
//! Threads (3): the pinner (`PinHandle`) with the k-th registration failing
//! (`SimFault::Register`, code 2 = out of memory), the engine (main) opening
//! a window and capturing a memset in GLOBAL mode inside it, the sim's
//! device thread. Preemption bound 3.
//!
//! Checked: the capture ends with a graph (the pinner's registrations and
//! its rollback's unregistrations never overlap it); pinning ends
//! `Pageable(OutOfMemory)`; the coordinator says every chunk is
//! unregistered, and so does the driver: the simulated GPU holds no
//! registration and refuses a device alias for every chunk
//! (`cuMemHostGetDevicePointer` fails on memory that is not registered, a
//! check that fails if a chunk stayed registered); an asynchronous copy
//! from the region to the device and back, which needs no registration,
//! moves every byte.
//!
//! Why it holds: `pin_all` on failure at chunk k walks chunks k-1..0 and
//! unregisters each through the coordinator before publishing Pageable;
//! `unregister_chunk` waits for gather users and is gated like any
//! capture-unsafe call, so the window cannot starve it forever (it closes).
//!
//! Negative N7: the rollback forgets all but the last chunk; loom (any
//! interleaving) finds chunks left registered. Negative N11: no capture
//! window (`Variant::NoCaptureWindow`): loom finds a registration or an
//! unregistration of the rollback invalidating the capture.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{capture_memset, fixture, models, Bounds};
use kvoffload::internal::pin::{NoPrefault, PinHandle};
use kvoffload::internal::protocol::{ChunkReg, Variant};
use kvoffload::{CaptureMode, CapturePolicy, Code, PageableReason, PinState, Request, SimFault};

/// Chunks of the region: loom's size, and shuttle's past it.
const CHUNKS: usize = common::sized(3, 10);

fn scenario(variant: Variant, fail_at: u64) {
    let f = fixture(CapturePolicy::Interleave, variant, CHUNKS, 64);
    let rt = f.rt.clone();
    let s = rt.stream_create().unwrap();
    let bytes = CHUNKS * f.chunk;
    let d = f.coord.unsafe_call("alloc", Request::new(), |g| rt.mem_alloc(g, bytes)).unwrap().unwrap();
    f.sim().inject(SimFault::Register { nth: fail_at, code: Code::OUT_OF_MEMORY });
    let pin = PinHandle::spawn(f.rt.clone(), f.coord.clone(), NoPrefault::shared());
    let w = f.coord.open_window(Request::new()).unwrap();
    // SAFETY: `d` is an allocation of `bytes` of the sim, never freed; the
    // memset is only captured.
    let (enq, end) = unsafe { capture_memset(rt.as_ref(), s, CaptureMode::Global, d, 0, bytes) };
    drop(w);
    let state = pin.join();
    assert!(enq.is_ok() && end.is_ok(), "capture invalidated during pinning: enqueue {enq:?}, end {end:?}");
    rt.graph_destroy(end.unwrap()).unwrap();
    assert_eq!(state, PinState::Pageable(PageableReason::OutOfMemory));
    for i in 0..CHUNKS {
        assert_eq!(f.coord.pinning().chunk_reg(i), Some(ChunkReg::Unregistered), "chunk {i} left registered");
    }
    assert_eq!(f.sim().registered_ranges(), 0, "chunk left registered in the driver");
    // Pageable in the driver's eyes: no device alias for any chunk.
    for i in 0..CHUNKS {
        let alias = rt.host_device_ptr(f.base + i * f.chunk);
        assert!(alias.is_err(), "chunk {i} left registered: the driver still maps it ({alias:?})");
    }
    // Usable as pageable memory: an asynchronous copy to the device and
    // back moves every byte.
    // SAFETY: the fixture's memory is leaked, CHUNKS*64 bytes, owned by this model.
    let mem = unsafe { std::slice::from_raw_parts_mut(f.base as *mut u8, bytes) };
    mem.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8 ^ 0x5a);
    let mut back = vec![0u8; bytes];
    // SAFETY: `mem` and `back` live until the stream is synchronized below;
    // `d` holds `bytes`.
    unsafe {
        rt.copy_htod_async(d, f.base, bytes, s).unwrap();
        rt.copy_dtoh_async(back.as_mut_ptr() as usize, d, bytes, s).unwrap();
    }
    f.coord.unsafe_call("sync", Request::new(), |g| rt.stream_synchronize(g, s)).unwrap().unwrap();
    assert_eq!(&back[..], &mem[..], "pageable round trip lost bytes");
}

const B: Bounds = Bounds { property: "P8", threads: 3, preemptions: 3, ci: None };

models! {
    p8_failure_at_first_chunk_rolls_back:
        check("p8_fail_first", B, || scenario(Variant::Production, 1));
    p8_failure_at_middle_chunk_rolls_back:
        check("p8_fail_middle", B, || scenario(Variant::Production, CHUNKS as u64 / 2 + 1));
    p8_failure_at_last_chunk_rolls_back:
        check("p8_fail_last", B, || scenario(Variant::Production, CHUNKS as u64));
    negative_n7_rollback_forgets_earlier_chunks:
        negative("n7_forgetful_rollback", Bounds { property: "N7", ..B },
            "left registered", || scenario(Variant::ForgetfulRollback, CHUNKS as u64));
    negative_n11_pinning_without_capture_windows:
        negative("n11_no_capture_window", Bounds { property: "N11", ..B },
            "capture invalidated", || scenario(Variant::NoCaptureWindow, CHUNKS as u64));
}
