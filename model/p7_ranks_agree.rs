//! P7 ranks agree: offload turns on for a rank only once every rank has
//! settled its pin state, and a failure on one rank leads all ranks to the
//! same mode.
//!
//! Threads (4): two ranks, each pinning its own 2-chunk region through its
//! own coordinator with `pin_all_agreed` over shared rank words
//! (`LocalSlots`, the in-process twin of the region header's words); rank
//! 1's registration fails at its first or second chunk, or never; the
//! model's main thread; the sim's device thread (one simulated GPU serves
//! both ranks). Preemption bound 2.
//!
//! Checked: both ranks end in the same mode (Pinned only if neither
//! failed); when a rank's agreement returns, the other rank's word is
//! settled; a rank that ends pageable has no chunk registered.
//!
//! Why it holds: a rank writes its settled word before reading the others'
//! (SeqCst), and decides only once it has read every word settled; both
//! read the same final words, so both compute the same mode; a pinned rank
//! told "pageable" unregisters everything before publishing.

#![cfg(loom)]

#[path = "common/mod.rs"]
mod common;

use common::{check, Bounds};
use kvoffload::pin::{pin_all_agreed, Agreement, NoPrefault};
use kvoffload::protocol::agreement::{LocalSlots, RankSlots, UNSETTLED};
use kvoffload::protocol::{CapturePolicy, Coordinator, PinState};
use kvoffload::runtime::sim::{SimFault, SimRuntime};
use kvoffload::runtime::{shared, Code};
use kvoffload::sync::{arc_dyn, thread, StdArc};

fn scenario(rank1_fails_at: Option<u64>) {
    let rt = shared(SimRuntime::new());
    let slots = arc_dyn(LocalSlots::new(2), |a: StdArc<LocalSlots>| -> StdArc<dyn RankSlots> { a });
    if let Some(nth) = rank1_fails_at {
        // Registration calls of both ranks interleave; the k-th overall call
        // fails, which lands on either rank: both cases must agree.
        rt.as_sim().unwrap().inject(SimFault::Register { nth, code: Code::NOT_SUPPORTED });
    }
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let mem: &'static mut [u8] = Box::leak(vec![0u8; 128].into_boxed_slice());
            let base = mem.as_mut_ptr() as usize;
            // SAFETY: both chunks are pieces of `mem`, leaked read-write
            // memory that lives (mapped) forever.
            let coord = unsafe { Coordinator::new(CapturePolicy::AfterPinning, &[(base, 64), (base + 64, 64)], None) };
            let (rt, slots, c) = (rt.clone(), slots.clone(), coord.clone());
            let h = thread::spawn(move || {
                let a = Agreement { slots: slots.clone(), rank, timeout: None };
                let r = pin_all_agreed(rt.as_ref(), &c, &NoPrefault, &a).unwrap();
                assert_ne!(slots.load(1 - rank), UNSETTLED, "rank {rank} decided before rank {} settled", 1 - rank);
                r
            });
            (coord, h)
        })
        .collect();
    let mut states = Vec::new();
    for (coord, h) in ranks {
        let s = h.join().unwrap();
        if s != PinState::Pinned {
            assert_eq!(coord.registered_chunks(), 0, "pageable rank left chunks registered");
        }
        states.push(s);
    }
    let pinned: Vec<bool> = states.iter().map(|s| *s == PinState::Pinned).collect();
    assert_eq!(pinned[0], pinned[1], "ranks disagree: {states:?}");
    assert_eq!(pinned[0], rank1_fails_at.is_none(), "mode wrong: {states:?}");
}

const B: Bounds = Bounds { property: "P7", threads: 4, preemptions: 2 };

#[test]
fn p7_all_pinned_when_no_rank_fails() {
    check("p7_no_failure", B, || scenario(None));
}

#[test]
fn p7_one_failure_makes_all_pageable() {
    check("p7_failure_first_call", B, || scenario(Some(1)));
}

#[test]
fn p7_late_failure_makes_all_pageable() {
    check("p7_failure_last_call", B, || scenario(Some(4)));
}
