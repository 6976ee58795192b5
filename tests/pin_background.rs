//! Background pinning on the simulated GPU: observable (Pending ->
//! Pinning{done, total} -> Pinned), waitable, cancellable between chunks
//! (stopped inside chunk k by a hold point, never by sleeping).

mod pin_common;

use std::sync::Arc;

use kvoffload::internal::pin::Prepared;
use kvoffload::internal::protocol::{PageableReason, PinState};
use kvoffload::internal::runtime::sim::{Hold, HoldPoint, SimRuntime};
use pin_common::{assert_usable, region, sim};

const CHUNKS: usize = 4;
const CHUNK: usize = 1 << 20;

/// Lets registrations 0..k pass one by one and returns the hold that has
/// stopped registration k.
fn stop_inside(s: &Arc<SimRuntime>, first: Hold, k: usize) -> Hold {
    let mut hold = first;
    for _ in 0..k {
        hold.wait_entered();
        let next = s.hold(HoldPoint::Register);
        hold.release();
        hold = next;
    }
    hold.wait_entered();
    hold
}

#[test]
fn state_goes_pending_pinning_pinned_and_is_waitable() {
    let (mut r, opts) = region(CHUNKS, CHUNK);
    let (s, rt) = sim();
    let p = Prepared::new(rt.as_ref(), &r, &opts).unwrap();
    let coord = p.coordinator().clone();
    assert_eq!(coord.pin_state(), PinState::Pending);

    let first = s.hold(HoldPoint::Register);
    let h = p.spawn(rt.clone());
    // Another thread waits for the final state meanwhile.
    let c2 = coord.clone();
    let waiter = std::thread::spawn(move || c2.wait_pin_final().unwrap());

    let hold = stop_inside(&s, first, 0);
    assert_eq!(h.state(), PinState::Pinning { done: 0, total: CHUNKS });
    let next = s.hold(HoldPoint::Register);
    hold.release();
    let hold = stop_inside(&s, next, 0);
    assert_eq!(coord.pin_state(), PinState::Pinning { done: 1, total: CHUNKS });
    // The caller goes on: its memory is usable while pinning runs.
    assert_eq!(coord.registered_chunks(), 1);
    hold.release();

    assert_eq!(waiter.join().unwrap(), PinState::Pinned);
    assert_eq!(h.join(), PinState::Pinned);
    assert_eq!(s.registered_ranges(), CHUNKS);
    coord.unregister_all(rt.as_ref()).unwrap();
    assert_eq!(s.registered_ranges(), 0);
    drop(p);
    drop(coord);
    assert_usable(&mut r, 2);
}

#[test]
fn cancel_midway_rolls_back_to_pageable() {
    for k in [0, 2, CHUNKS - 1] {
        let (mut r, opts) = region(CHUNKS, CHUNK);
        let (s, rt) = sim();
        let p = Prepared::new(rt.as_ref(), &r, &opts).unwrap();
        let first = s.hold(HoldPoint::Register);
        let h = p.spawn(rt.clone());
        let hold = stop_inside(&s, first, k);
        assert_eq!(h.state(), PinState::Pinning { done: k, total: CHUNKS });
        h.cancel();
        // The chunk in flight completes; pinning stops at the next boundary.
        hold.release();
        let st = h.join();
        if k == CHUNKS - 1 {
            // Cancelled inside the last chunk: nothing is left to stop before.
            assert_eq!(st, PinState::Pinned, "cancel after the last boundary");
            p.coordinator().unregister_all(rt.as_ref()).unwrap();
        } else {
            assert_eq!(st, PinState::Pageable(PageableReason::Cancelled), "cancel inside chunk {k}");
        }
        assert_eq!(s.registered_ranges(), 0, "chunk {k}");
        assert_eq!(p.prefaulter().unwrap().workers_running(), 0);
        drop(p);
        assert_usable(&mut r, k as u8);
    }
}

#[test]
fn cancel_before_start_never_registers() {
    let (r, opts) = region(2, CHUNK);
    let (s, rt) = sim();
    let p = Prepared::new(rt.as_ref(), &r, &opts).unwrap();
    p.coordinator().cancel_pinning();
    let h = p.spawn(rt.clone());
    assert_eq!(h.join(), PinState::Pageable(PageableReason::Cancelled));
    assert_eq!(s.registered_ranges(), 0);
}

#[test]
fn dropping_the_handle_after_pinning_keeps_the_state() {
    let (r, opts) = region(2, CHUNK);
    let (s, rt) = sim();
    let p = Prepared::new(rt.as_ref(), &r, &opts).unwrap();
    let h = p.spawn(rt.clone());
    assert_eq!(p.coordinator().wait_pin_final().unwrap(), PinState::Pinned);
    drop(h);
    assert_eq!(p.coordinator().pin_state(), PinState::Pinned);
    p.coordinator().unregister_all(rt.as_ref()).unwrap();
    assert_eq!(s.registered_ranges(), 0);
}

#[test]
fn dropping_the_handle_midway_cancels_and_waits_for_the_rollback() {
    let (mut r, opts) = region(CHUNKS, CHUNK);
    let (s, rt) = sim();
    let p = Prepared::new(rt.as_ref(), &r, &opts).unwrap();
    let coord = p.coordinator().clone();
    let first = s.hold(HoldPoint::Register);
    let h = p.spawn(rt.clone());
    let hold = stop_inside(&s, first, 1);
    // The registration in flight is let go once the drop below cancelled
    // pinning (the drop then waits for the pinner, which waits for it).
    let releaser = {
        let coord = coord.clone();
        std::thread::spawn(move || {
            while !coord.pin_cancelled() {
                std::thread::yield_now();
            }
            hold.release();
        })
    };
    drop(h);
    assert_eq!(coord.pin_state(), PinState::Pageable(PageableReason::Cancelled), "drop returned before the rollback");
    assert_eq!(s.registered_ranges(), 0);
    releaser.join().unwrap();
    drop(p);
    drop(coord);
    assert_usable(&mut r, 4);
}

/// `PinOutcome::agreed`: the state, unless the ranks did not agree (then
/// why); `Debug` of a `dyn PinObserver` names it (an observer is an
/// engine's, so nothing else of it is shown).
#[test]
fn an_outcome_gives_its_state_or_why_the_ranks_did_not_agree() {
    use kvoffload::internal::pin::{PinObserver, PinOutcome};
    use kvoffload::internal::protocol::agreement::AgreementError;
    let pinned = |agreement| PinOutcome { state: PinState::Pinned, agreement };
    assert_eq!(pinned(None).agreed(), Ok(PinState::Pinned), "no agreement asked for");
    assert_eq!(pinned(Some(Ok(()))).agreed(), Ok(PinState::Pinned), "the ranks agreed");
    let died = AgreementError::RankDied { rank: 1 };
    let pageable =
        PinOutcome { state: PinState::Pageable(PageableReason::Cancelled), agreement: Some(Err(died.clone())) };
    assert_eq!(pageable.agreed(), Err(died), "the ranks did not agree");
    struct Quiet;
    impl PinObserver for Quiet {}
    let o: &dyn PinObserver = &Quiet;
    assert_eq!(format!("{o:?}"), "PinObserver");
}
