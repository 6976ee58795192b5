//! P8 all-or-nothing: after a registration failure at chunk k (first,
//! middle or last of 3), every chunk registered before it is unregistered
//! and the region is usable as pageable memory; this holds while a capture
//! window opens and closes concurrently (Interleave policy).
//!
//! Threads (3): the pinner (`PinHandle`) with the k-th registration failing
//! (`SimFault::Register`, code 2 = out of memory), the engine (main) opening
//! a window, the sim's device thread. Preemption bound 3.
//!
//! Why it holds: `pin_all` on failure at chunk k walks chunks k-1..0 and
//! unregisters each through the coordinator before publishing Pageable;
//! `unregister_chunk` waits for gather users and is gated like any
//! capture-unsafe call, so the window cannot starve it forever (it closes).
//!
//! Negative N7: the rollback forgets all but the last chunk; loom (any
//! interleaving) finds chunks left registered.

#![cfg(loom)]

#[path = "common/mod.rs"]
mod common;

use common::{check, fixture, negative, Bounds};
use kvoffload::pin::{NoPrefault, PinHandle};
use kvoffload::protocol::{CapturePolicy, ChunkReg, PageableReason, PinState, Variant};
use kvoffload::runtime::sim::SimFault;
use kvoffload::runtime::Code;

fn scenario(variant: Variant, fail_at: u64) {
    let f = fixture(CapturePolicy::Interleave, variant, 3, 64);
    f.sim().inject(SimFault::Register { nth: fail_at, code: Code::OUT_OF_MEMORY });
    let pin = PinHandle::spawn(f.rt.clone(), f.coord.clone(), NoPrefault::shared());
    let w = f.coord.open_window().unwrap();
    drop(w);
    let state = pin.join();
    assert_eq!(state, PinState::Pageable(PageableReason::OutOfMemory));
    for i in 0..3 {
        assert_eq!(f.coord.chunk_reg(i), Some(ChunkReg::Unregistered), "chunk {i} left registered");
    }
    assert_eq!(f.sim().registered_ranges(), 0, "chunk left registered in the driver");
    // Usable as pageable memory: write and read every byte.
    // SAFETY: the fixture's memory is leaked, 3*64 bytes, owned by this model.
    let mem = unsafe { std::slice::from_raw_parts_mut(f.base as *mut u8, 3 * f.chunk) };
    mem.fill(7);
    assert!(mem.iter().all(|&b| b == 7));
}

const B: Bounds = Bounds { property: "P8", threads: 3, preemptions: 3 };

#[test]
fn p8_failure_at_first_chunk_rolls_back() {
    check("p8_fail_first", B, || scenario(Variant::Production, 1));
}

#[test]
fn p8_failure_at_middle_chunk_rolls_back() {
    check("p8_fail_middle", B, || scenario(Variant::Production, 2));
}

#[test]
fn p8_failure_at_last_chunk_rolls_back() {
    check("p8_fail_last", B, || scenario(Variant::Production, 3));
}

#[test]
#[ignore = "negative model: run by ci/prove, must fail"]
fn negative_n7_rollback_forgets_earlier_chunks() {
    negative("n7_forgetful_rollback", Bounds { property: "N7", ..B }, "left registered", || {
        scenario(Variant::ForgetfulRollback, 3)
    });
}
