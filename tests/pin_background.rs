//! Background pinning on the simulated GPU: observable (Pending ->
//! Pinning{done, total} -> Pinned), waitable, cancellable between chunks
//! (stopped inside chunk k by a hold point, never by sleeping).

mod pin_common;

use std::sync::Arc;

use kvoffload::internal::pin::{PinHandle, Prepared};
use kvoffload::internal::runtime::sim::{Hold, HoldPoint};
use kvoffload::{GpuRuntime, PageableReason, PinState, Request, SimRuntime};
use pin_common::{assert_usable, prepared};

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

/// Spawns `p`'s pinner (on `rt`) with its first registration held when it
/// enters: the hold, and the pinner's handle.
fn spawn_held(s: &Arc<SimRuntime>, rt: &Arc<dyn GpuRuntime>, p: &Prepared) -> (Hold, PinHandle) {
    let first = s.hold(HoldPoint::Register);
    (first, p.spawn(rt.clone()))
}

#[test]
fn state_goes_pending_pinning_pinned_and_is_waitable() {
    let (mut r, s, rt, p) = prepared(CHUNKS, CHUNK);
    let coord = p.coordinator().clone();
    assert_eq!(coord.pinning().state(), PinState::Pending);

    let (first, h) = spawn_held(&s, &rt, &p);
    // Another thread waits for the final state meanwhile.
    let c2 = coord.clone();
    let waiter = std::thread::spawn(move || c2.pinning().wait_final(Request::new()).unwrap());

    let hold = stop_inside(&s, first, 0);
    assert_eq!(h.state(), PinState::Pinning { done: 0, total: CHUNKS });
    let next = s.hold(HoldPoint::Register);
    hold.release();
    let hold = stop_inside(&s, next, 0);
    assert_eq!(coord.pinning().state(), PinState::Pinning { done: 1, total: CHUNKS });
    // The caller goes on: its memory is usable while pinning runs.
    assert_eq!(coord.pinning().registered_chunks(), 1);
    hold.release();

    assert_eq!(waiter.join().unwrap(), PinState::Pinned);
    assert_eq!(h.join(), PinState::Pinned);
    assert_eq!(s.registered_ranges(), CHUNKS);
    coord.pinning().unregister_all(rt.as_ref()).unwrap();
    assert_eq!(s.registered_ranges(), 0);
    drop((p, coord));
    assert_usable(&mut r, 2);
}

#[test]
fn cancel_midway_rolls_back_to_pageable() {
    for k in [0, 2, CHUNKS - 1] {
        let (mut r, s, rt, p) = prepared(CHUNKS, CHUNK);
        let (first, h) = spawn_held(&s, &rt, &p);
        let hold = stop_inside(&s, first, k);
        assert_eq!(h.state(), PinState::Pinning { done: k, total: CHUNKS });
        h.cancel();
        // The chunk in flight completes; pinning stops at the next boundary.
        hold.release();
        let st = h.join();
        if k == CHUNKS - 1 {
            // Cancelled inside the last chunk: nothing is left to stop before.
            assert_eq!(st, PinState::Pinned, "cancel after the last boundary");
            p.coordinator().pinning().unregister_all(rt.as_ref()).unwrap();
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
    let (_r, s, rt, p) = prepared(2, CHUNK);
    p.coordinator().pinning().cancel();
    let h = p.spawn(rt.clone());
    assert_eq!(h.join(), PinState::Pageable(PageableReason::Cancelled));
    assert_eq!(s.registered_ranges(), 0);
}

#[test]
fn dropping_the_handle_after_pinning_keeps_the_state() {
    let (_r, s, rt, p) = prepared(2, CHUNK);
    let h = p.spawn(rt.clone());
    assert_eq!(p.coordinator().pinning().wait_final(Request::new()).unwrap(), PinState::Pinned);
    drop(h);
    assert_eq!(p.coordinator().pinning().state(), PinState::Pinned);
    p.coordinator().pinning().unregister_all(rt.as_ref()).unwrap();
    assert_eq!(s.registered_ranges(), 0);
}

#[test]
fn dropping_the_handle_midway_cancels_and_waits_for_the_rollback() {
    let (mut r, s, rt, p) = prepared(CHUNKS, CHUNK);
    let coord = p.coordinator().clone();
    let (first, h) = spawn_held(&s, &rt, &p);
    let hold = stop_inside(&s, first, 1);
    // The registration in flight is let go once the drop below cancelled
    // pinning (the drop then waits for the pinner, which waits for it).
    let releaser = {
        let coord = coord.clone();
        std::thread::spawn(move || {
            while !coord.pinning().cancelled() {
                std::thread::yield_now();
            }
            hold.release();
        })
    };
    drop(h);
    assert_eq!(
        coord.pinning().state(),
        PinState::Pageable(PageableReason::Cancelled),
        "drop returned before the rollback"
    );
    assert_eq!(s.registered_ranges(), 0);
    releaser.join().unwrap();
    drop((p, coord));
    assert_usable(&mut r, 4);
}

/// `PinOutcome::agreed`: the state, unless the ranks did not agree (then
/// why); `Debug` of a `dyn PinObserver` names it (an observer is an
/// engine's, so nothing else of it is shown).
#[test]
fn an_outcome_gives_its_state_or_why_the_ranks_did_not_agree() {
    use kvoffload::{AgreementError, PinObserver, PinOutcome};
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

/// Polls `cond` (on the coordinator's diagnostics) for at most 30 s: the
/// tests below wait for another thread to reach a wait they can see.
fn eventually(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "not within 30 s: {what}");
        std::thread::yield_now();
    }
}

/// A pin hold (an engine's capture phase) holds every registration back:
/// one in flight when it was taken completes, none starts until the hold
/// drops, then pinning goes on to Pinned. Holds nest: pinning resumes when
/// the last one drops, whichever thread drops it.
#[test]
fn a_pin_hold_keeps_registrations_from_starting_until_it_drops() {
    let (mut r, s, rt, p) = prepared(CHUNKS, CHUNK);
    let coord = p.coordinator().clone();
    // Chunk 0's registration in flight when the holds are taken.
    let (first, h) = spawn_held(&s, &rt, &p);
    first.wait_entered();
    let hold_a = coord.pinning().hold();
    let hold_b = coord.pinning().hold();
    assert_eq!(coord.activity().pin_holds, 2);
    let next = s.hold(HoldPoint::Register);
    first.release();
    // Chunk 0 completes; chunk 1 waits for the holds, uncounted as a call.
    eventually("chunk 1 held back", || coord.activity().registrations_held == 1);
    assert_eq!(coord.pinning().state(), PinState::Pinning { done: 1, total: CHUNKS });
    assert_eq!(coord.activity().calls_waiting, 0);
    drop(hold_a);
    assert_eq!(coord.activity().registrations_held, 1, "one hold dropped of two: still held");
    assert_eq!(s.registered_ranges(), 1);
    std::thread::spawn(move || drop(hold_b)).join().unwrap();
    next.wait_entered();
    assert_eq!(coord.activity(), kvoffload::internal::protocol::Activity { calls_in_flight: 1, ..Default::default() });
    next.release();
    assert_eq!(h.join(), PinState::Pinned);
    assert_eq!(s.registered_ranges(), CHUNKS);
    coord.pinning().unregister_all(rt.as_ref()).unwrap();
    drop((p, coord));
    assert_usable(&mut r, 3);
}

/// A hold never holds a shutdown up: cancelling pinning releases the
/// registration it held back, and pinning rolls back to pageable with the
/// hold still alive. The holder's own wait for pinning is refused (it
/// would wait for itself); another thread's wait is not.
#[test]
fn a_pin_hold_gives_way_to_a_cancel_and_refuses_its_holders_wait() {
    let (mut r, _s, rt, p) = prepared(CHUNKS, CHUNK);
    let coord = p.coordinator().clone();
    let hold = coord.pinning().hold();
    let h = p.spawn(rt.clone());
    eventually("chunk 0 held back", || coord.activity().registrations_held == 1);
    assert!(
        matches!(coord.pinning().wait_final(Request::new()), Err(kvoffload::ProtocolError::WouldDeadlock { .. })),
        "the holder's wait for pinning must be refused"
    );
    let c2 = coord.clone();
    let waiter = std::thread::spawn(move || c2.pinning().wait_final(Request::new()).unwrap());
    h.cancel();
    assert_eq!(h.join(), PinState::Pageable(PageableReason::Cancelled));
    assert_eq!(waiter.join().unwrap(), PinState::Pageable(PageableReason::Cancelled));
    assert_eq!(coord.pinning().registered_chunks(), 0);
    drop(hold);
    drop((p, coord));
    assert_usable(&mut r, 4);
}
