//! P7b every rank settles within its bound, also when a rank shuts down
//! during the agreement: a rank whose pinning is cancelled (what
//! `Offloader::shutdown` does first, through `ShutdownSteps::close`) stops
//! waiting for the other ranks at once, and the ranks still waiting, none
//! of which has a timeout, settle at once too, in the same mode.
//!
//! Threads (4): ranks 0 and 1, each pinning its own 1-chunk region through
//! its own coordinator with `pin_all_agreed` over three shared rank words
//! (`LocalSlots`), neither with a timeout; rank 2 never settles while they
//! run (a silent peer); the model's main thread, which shuts rank 0 down
//! (`close`) at whatever moment loom picks, joins both ranks, and then
//! lets rank 2 come late; the sim's device thread. Preemption bound 2.
//!
//! Checked: both ranks return (with no timeout, only rank 0's shutdown
//! ends the waits: a rank that kept waiting would spin until loom's branch
//! bound); rank 0 reports `Cancelled` having given rank 2 up, rank 1
//! `Abandoned` by rank 0 (its own word or rank 2's); both end pageable with no chunk registered; the
//! late rank 2 ends pageable at once (`Abandoned` by rank 0), without
//! waiting.
//!
//! Why it holds (src/protocol/agreement.rs, rules 1, 3-5): the wait checks
//! the cancel every round; a rank that stops waiting writes "given up by
//! me" into every word still unsettled, by compare-and-swap, so the words
//! become final and never change again; a rank that reads a given-up word
//! ends pageable, and one that finds its own word given up ends pageable
//! without waiting. Every rank reads the same final words.
//!
//! Negative N23: the wait ignores the cancel (`Variant::AgreementIgnoresCancel`,
//! the agreement before issue 28): rank 0 waits for rank 2 for ever; caught
//! as loom's "Model exceeded maximum number of branches" (a spin that never
//! ends).

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{models, rank_coordinator, Bounds};
use kvoffload::internal::pin::{pin_all_agreed, Agreement, NoPrefault};
use kvoffload::internal::protocol::agreement::{agree, LocalSlots, RankSlots};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{arc_dyn, thread, StdArc};
use kvoffload::{shared, AgreementError, PinState, SimRuntime};

fn scenario(variant: Variant) {
    let rt = shared(SimRuntime::new());
    let slots = arc_dyn(LocalSlots::new(3), |a: StdArc<LocalSlots>| -> StdArc<dyn RankSlots> { a });
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let (rt, coord) = rank_coordinator(&rt, rank, 1);
            coord.set_variant(variant);
            let (rt, slots, c) = (rt.clone(), slots.clone(), coord.clone());
            let h = thread::spawn(move || {
                let a = Agreement { slots, rank, timeout: None };
                pin_all_agreed(rt.as_ref(), &c, &NoPrefault, &a)
            });
            (coord, h)
        })
        .collect();
    // Rank 0 shuts down, at any moment: before, during or after its own
    // pinning, before or after rank 1 settled.
    ranks[0].0.shutdown_steps().close().unwrap();
    let mut results = Vec::new();
    for (rank, (coord, h)) in ranks.into_iter().enumerate() {
        let r = h.join().unwrap();
        let state = coord.pinning().state();
        assert!(matches!(state, PinState::Pageable(_)), "rank {rank} ended {state:?} although rank 2 never settled");
        assert_eq!(coord.pinning().registered_chunks(), 0, "rank {rank} left its chunk registered");
        results.push(r);
    }
    match &results[0] {
        Err(AgreementError::Cancelled { waiting }) if waiting.contains(&2) => {}
        r => panic!("rank 0 (shut down) returned {r:?}, not Cancelled with rank 2 given up"),
    }
    // Rank 1 finds rank 2's word given up, or its own (when rank 0 gave it
    // up before rank 1 settled; it may read the words before rank 0 got
    // to rank 2's).
    match &results[1] {
        Err(AgreementError::Abandoned { by: 0, ranks }) if !ranks.is_empty() => {}
        r => panic!("rank 1 returned {r:?}, not Abandoned by rank 0"),
    }
    // The silent rank comes late: it settles at once, pageable, told why.
    match agree(slots.as_ref(), 2, true, None, &|| false) {
        Err(AgreementError::Abandoned { by: 0, ranks }) if ranks.contains(&2) => {}
        r => panic!("the late rank 2 returned {r:?}, not Abandoned by rank 0"),
    }
}

const B: Bounds = Bounds { property: "P7", threads: 4, preemptions: 2, ci: None };

models! {
    p7_a_rank_shutting_down_during_the_agreement_ends_every_wait:
        check("p7_settles_in_bound", B, || scenario(Variant::Production));
    negative_n23_p7_agreement_ignores_the_cancel:
        negative("n23_agreement_ignores_cancel", Bounds { property: "N23", ..B },
            "Model exceeded maximum number of branches", || scenario(Variant::AgreementIgnoresCancel));
}
