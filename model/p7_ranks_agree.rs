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
//!
//! # Across nodes: the engine's transport
//!
//! The same two ranks agree through a `Transport` (`pin_all_agreed_by`
//! with `RankAgreement::Transport`) implemented here with loom's mutex and
//! condition variable as a collective all-gather: a rank deposits its word
//! and waits until every rank has; a rank whose transport breaks marks the
//! exchange broken and every waiting rank's exchange fails too, as a
//! collective does. Scenarios: no failure; one rank's registration failing
//! (first or fourth call overall); rank 1's transport failing before it
//! contributes. Checked, besides the above: the main thread, looking at any
//! moment, never sees a rank Pinned before every rank contributed its word
//! (offload turns on only after the exchange); with a transport error both
//! ranks end pageable, report `AgreementError::Transport` and hold no chunk.
//!
//! Negative N13: a rank that publishes its own outcome before the exchange
//! (`Variant::PublishBeforeAgreement`); caught as "turned offload on before
//! every rank".

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{models, rank_coordinator, Bounds};
use kvoffload::internal::pin::{pin_all_agreed, pin_all_agreed_by, Agreement, NoPrefault, RankAgreement};
use kvoffload::internal::protocol::agreement::{LocalSlots, RankSlots, UNSETTLED};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{self, arc_dyn, thread, Arc, Condvar, Mutex, StdArc};
use kvoffload::{shared, AgreementError, Code, PinState, SimFault, SimRuntime, Transport};

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
            let (rt, coord) = rank_coordinator(&rt, rank, 2);
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
            assert_eq!(coord.pinning().registered_chunks(), 0, "pageable rank left chunks registered");
        }
        states.push(s);
    }
    let pinned: Vec<bool> = states.iter().map(|s| *s == PinState::Pinned).collect();
    assert_eq!(pinned[0], pinned[1], "ranks disagree: {states:?}");
    assert_eq!(pinned[0], rank1_fails_at.is_none(), "mode wrong: {states:?}");
}

const B: Bounds = Bounds { property: "P7", threads: 4, preemptions: 2, ci: None };

models! {
    p7_all_pinned_when_no_rank_fails:
        check("p7_no_failure", B, || scenario(None));
    p7_one_failure_makes_all_pageable:
        check("p7_failure_first_call", B, || scenario(Some(1)));
    p7_late_failure_makes_all_pageable:
        check("p7_failure_last_call", B, || scenario(Some(4)));
}

// ---- across nodes: the engine's transport ----

/// A collective all-gather over loom primitives: the contract of
/// `Transport` (returns only once every rank contributed; a broken
/// exchange fails for every rank still in it).
struct Exchange {
    state: Mutex<ExState>,
    cv: Condvar,
}

struct ExState {
    words: Vec<Option<u32>>,
    broken: bool,
}

impl Exchange {
    fn contributed(&self) -> bool {
        sync::lock(&self.state).words.iter().all(Option::is_some)
    }
}

/// One rank's end of the exchange; `breaks` makes its call fail before it
/// contributes (its process group broke).
struct RankEnd {
    ex: Arc<Exchange>,
    rank: usize,
    breaks: bool,
}

impl Transport for RankEnd {
    fn exchange(&self, mine: u32) -> Result<Vec<u32>, String> {
        let mut g = sync::lock(&self.ex.state);
        if self.breaks {
            g.broken = true;
            self.ex.cv.notify_all();
            return Err(format!("rank {}: the process group broke", self.rank));
        }
        g.words[self.rank] = Some(mine);
        self.ex.cv.notify_all();
        loop {
            if let Some(all) = g.words.iter().copied().collect::<Option<Vec<u32>>>() {
                return Ok(all);
            }
            if g.broken {
                return Err(format!("rank {}: a peer's exchange broke", self.rank));
            }
            g = sync::wait(&self.ex.cv, g);
        }
    }
}

#[derive(Copy, Clone, PartialEq)]
enum Fault {
    None,
    /// The n-th registration call overall fails (on either rank).
    Register(u64),
    /// Rank 1's transport breaks before it contributes.
    Transport,
}

fn transport_scenario(fault: Fault, variant: Variant) {
    let rt = shared(SimRuntime::new());
    if let Fault::Register(nth) = fault {
        rt.as_sim().unwrap().inject(SimFault::Register { nth, code: Code::NOT_SUPPORTED });
    }
    let ex =
        Arc::new(Exchange { state: Mutex::new(ExState { words: vec![None; 2], broken: false }), cv: Condvar::new() });
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let (rt, coord) = rank_coordinator(&rt, rank, 2);
            coord.set_variant(variant);
            let end = RankEnd { ex: ex.clone(), rank, breaks: fault == Fault::Transport && rank == 1 };
            let t: Arc<dyn Transport> = arc_dyn(end, |a: StdArc<RankEnd>| -> StdArc<dyn Transport> { a });
            let (rt, c) = (rt.clone(), coord.clone());
            let h =
                thread::spawn(move || pin_all_agreed_by(rt.as_ref(), &c, &NoPrefault, &RankAgreement::Transport(t)));
            (coord, h)
        })
        .collect();
    // The main thread looks once, at whatever moment loom picks: a rank
    // already Pinned means every rank contributed (or the exchange broke
    // with no rank pinned).
    for (r, (coord, _)) in ranks.iter().enumerate() {
        if coord.pinning().state() == PinState::Pinned {
            assert!(ex.contributed(), "rank {r} turned offload on before every rank settled");
        }
    }
    let mut states = Vec::new();
    for (coord, h) in ranks {
        let r = h.join().unwrap();
        let s = coord.pinning().state();
        match (&r, fault) {
            (Err(AgreementError::Transport { .. }), Fault::Transport) => {}
            (Ok(st), f) if f != Fault::Transport => assert_eq!(*st, s),
            (r, _) => panic!("unexpected agreement result {r:?} with the fault injected"),
        }
        if s != PinState::Pinned {
            assert_eq!(coord.pinning().registered_chunks(), 0, "pageable rank left chunks registered");
        }
        states.push(s);
    }
    let pinned: Vec<bool> = states.iter().map(|s| *s == PinState::Pinned).collect();
    assert_eq!(pinned[0], pinned[1], "ranks disagree: {states:?}");
    assert_eq!(pinned[0], fault == Fault::None, "mode wrong: {states:?}");
}

models! {
    p7_transport_all_pinned_when_no_rank_fails:
        check("p7_transport_no_failure", B, || transport_scenario(Fault::None, Variant::Production));
    p7_transport_one_failure_makes_all_pageable:
        check("p7_transport_failure_first_call", B, || transport_scenario(Fault::Register(1), Variant::Production));
    p7_transport_late_failure_makes_all_pageable:
        check("p7_transport_failure_last_call", B, || transport_scenario(Fault::Register(4), Variant::Production));
    p7_transport_error_makes_all_pageable:
        check("p7_transport_error", B, || transport_scenario(Fault::Transport, Variant::Production));
    negative_n13_p7_rank_publishes_before_exchange:
        negative("n13_publish_before_exchange", Bounds { property: "N13", ..B },
            "turned offload on before every rank", || transport_scenario(Fault::None, Variant::PublishBeforeAgreement));
}
