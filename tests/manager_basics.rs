//! Example-based tests of the block manager: the life of a block, every
//! misuse error, the store threshold, events, and the two policies.

use kvoffload::internal::manager::{BlockManager, ManagerConfig, ManagerEvent, RemoveReason, SlotId};
use kvoffload::{BlockKey, BlockState, Lookup, ManagerError, PolicyKind, SkipReason, Skipped};

fn k(h: u64) -> BlockKey {
    BlockKey::new(h, 0)
}

fn manager(capacity: usize, policy: PolicyKind) -> BlockManager {
    let mut cfg = ManagerConfig::new(capacity, policy);
    cfg.record_events = true;
    BlockManager::new(cfg).expect("valid config")
}

/// Stores `keys` and completes the stores; returns the evicted keys.
fn store(m: &mut BlockManager, keys: &[BlockKey]) -> Vec<BlockKey> {
    let out = m.prepare_store(keys).expect("prepare_store");
    let stored: Vec<BlockKey> = out.to_store.iter().map(|p| p.key).collect();
    m.complete_store(&stored, true).expect("complete_store");
    m.check_invariants().expect("invariants");
    out.evicted.iter().map(|p| p.key).collect()
}

#[test]
fn manager_block_life_store_lookup_load() {
    let mut m = manager(2, PolicyKind::Lru);
    assert_eq!(m.lookup(&[k(1)]), vec![Lookup::Miss]);
    let out = m.prepare_store(&[k(1), k(2)]).unwrap();
    assert_eq!(out.to_store.len(), 2);
    assert_ne!(out.to_store[0].slot, out.to_store[1].slot);
    assert_eq!(m.lookup(&[k(1), k(3)]), vec![Lookup::HitPending, Lookup::Miss]);
    assert_eq!(m.prepare_load(&[k(1)]), Err(ManagerError::NotReadable { key: k(1) }));
    m.complete_store(&[k(1), k(2)], true).unwrap();
    assert_eq!(m.lookup(&[k(1), k(2)]), vec![Lookup::Hit, Lookup::Hit]);
    assert_eq!(Lookup::leading_hits(&m.lookup(&[k(1), k(3), k(2)])), 1);
    let slots = m.prepare_load(&[k(2)]).unwrap();
    assert_eq!(slots[0].slot, out.to_store[1].slot);
    assert_eq!(m.state(&k(2)), Some(BlockState::Ready { readers: 1 }));
    m.complete_load(&[k(2)]).unwrap();
    assert_eq!(m.state(&k(2)), Some(BlockState::Ready { readers: 0 }));
    m.check_invariants().unwrap();
}

#[test]
fn manager_misuse_is_a_typed_error_and_changes_nothing() {
    let mut m = manager(2, PolicyKind::Arc);
    assert_eq!(m.complete_store(&[k(1)], true), Err(ManagerError::NotFound { key: k(1) }));
    m.prepare_store(&[k(1)]).unwrap();
    m.complete_store(&[k(1)], true).unwrap();
    let ready = BlockState::Ready { readers: 0 };
    assert_eq!(m.complete_store(&[k(1)], true), Err(ManagerError::NotPending { key: k(1), state: ready }));
    assert_eq!(m.complete_load(&[k(1)]), Err(ManagerError::NoLoadInFlight { key: k(1), state: ready }));
    assert_eq!(m.prepare_load(&[k(9)]), Err(ManagerError::NotFound { key: k(9) }));
    assert_eq!(m.prepare_load(&[k(1), k(1)]), Err(ManagerError::DuplicateKey { key: k(1), first: 0, second: 1 }));
    // A batch with one bad key changes nothing, even for its good keys.
    m.prepare_store(&[k(2)]).unwrap();
    assert_eq!(m.complete_store(&[k(2), k(1)], true), Err(ManagerError::NotPending { key: k(1), state: ready }));
    assert_eq!(m.state(&k(2)), Some(BlockState::WritePending));
    assert_eq!(m.counters().errors, 6);
    m.check_invariants().unwrap();
}

#[test]
fn manager_never_evicts_pending_or_read_blocks() {
    let mut m = manager(2, PolicyKind::Lru);
    store(&mut m, &[k(1)]);
    m.prepare_load(&[k(1)]).unwrap();
    m.prepare_store(&[k(2)]).unwrap(); // pending
    let err = m.prepare_store(&[k(3)]).unwrap_err();
    assert_eq!(err, ManagerError::InsufficientCapacity { requested: 1, free: 0, evictable: 0, capacity: 2 });
    assert!(err.to_string().contains("cannot store 1 blocks"));
    m.complete_load(&[k(1)]).unwrap();
    let out = m.prepare_store(&[k(3)]).unwrap();
    assert_eq!(out.evicted.iter().map(|p| p.key).collect::<Vec<_>>(), vec![k(1)]);
    assert_eq!(out.to_store[0].slot, out.evicted[0].slot);
    m.check_invariants().unwrap();
}

#[test]
fn manager_skips_present_keys_and_frees_failed_stores() {
    let mut m = manager(3, PolicyKind::Lru);
    store(&mut m, &[k(1)]);
    m.prepare_store(&[k(2)]).unwrap();
    let out = m.prepare_store(&[k(1), k(2), k(3)]).unwrap();
    assert_eq!(out.to_store.iter().map(|p| p.key).collect::<Vec<_>>(), vec![k(3)]);
    assert_eq!(
        out.skipped,
        vec![
            Skipped { key: k(1), reason: SkipReason::AlreadyStored },
            Skipped { key: k(2), reason: SkipReason::StorePending },
        ]
    );
    let slot2 = m.slot(&k(2)).unwrap();
    m.complete_store(&[k(2)], false).unwrap();
    assert_eq!(m.lookup(&[k(2)]), vec![Lookup::Miss]);
    assert_eq!(m.free_slots(), 1);
    let events = m.take_events();
    assert_eq!(
        events.last(),
        Some(&ManagerEvent::Removed { key: k(2), slot: slot2, reason: RemoveReason::StoreFailed })
    );
    m.check_invariants().unwrap();
}

#[test]
fn manager_store_threshold_counts_misses() {
    let mut cfg = ManagerConfig::new(4, PolicyKind::Lru);
    cfg.store_threshold = 2;
    let mut m = BlockManager::new(cfg).unwrap();
    m.lookup(&[k(1)]);
    let out = m.prepare_store(&[k(1)]).unwrap();
    assert_eq!(out.skipped[0].reason, SkipReason::BelowThreshold { misses: 1, threshold: 2 });
    m.lookup(&[k(1)]);
    assert_eq!(m.prepare_store(&[k(1)]).unwrap().to_store.len(), 1);
    assert_eq!(m.counters().stores_skipped_threshold, 1);
    m.check_invariants().unwrap();
}

#[test]
fn manager_reset_waits_for_transfers_then_clears() {
    let mut m = manager(3, PolicyKind::Arc);
    store(&mut m, &[k(1), k(2)]);
    m.prepare_load(&[k(1)]).unwrap();
    m.prepare_store(&[k(3)]).unwrap();
    assert_eq!(m.reset(), Err(ManagerError::Busy { pending: 1, reading: 1 }));
    m.complete_load(&[k(1)]).unwrap();
    m.complete_store(&[k(3)], true).unwrap();
    m.take_events();
    m.reset().unwrap();
    assert!(m.is_empty());
    assert_eq!(m.free_slots(), 3);
    let removed = m.take_events();
    assert_eq!(removed.len(), 3);
    assert!(removed.iter().all(|e| matches!(e, ManagerEvent::Removed { reason: RemoveReason::Reset, .. })));
    assert_eq!(m.counters().resets, 1);
    m.check_invariants().unwrap();
}

#[test]
fn manager_lru_evicts_least_recently_touched_first_key_most_recent() {
    let mut m = manager(3, PolicyKind::Lru);
    store(&mut m, &[k(1), k(2), k(3)]); // k(1) most recent within the batch
    assert_eq!(store(&mut m, &[k(4)]), vec![k(3)]);
    m.touch(&[k(2)]);
    assert_eq!(store(&mut m, &[k(5)]), vec![k(1)]);
}

#[test]
fn manager_arc_keeps_reused_blocks_through_a_scan() {
    let mut m = manager(4, PolicyKind::Arc);
    store(&mut m, &[k(1), k(2)]);
    m.touch(&[k(1), k(2)]); // second use: promoted to T2
    for scan in 100..120 {
        store(&mut m, &[k(scan)]);
    }
    assert_eq!(m.lookup(&[k(1), k(2)]), vec![Lookup::Hit, Lookup::Hit]);

    let mut l = manager(4, PolicyKind::Lru);
    store(&mut l, &[k(1), k(2)]);
    l.touch(&[k(1), k(2)]);
    for scan in 100..120 {
        store(&mut l, &[k(scan)]);
    }
    assert_eq!(l.lookup(&[k(1), k(2)]), vec![Lookup::Miss, Lookup::Miss]);
}

#[test]
fn manager_bad_config_is_a_typed_error() {
    let zero = BlockManager::new(ManagerConfig::new(0, PolicyKind::Lru));
    assert_eq!(zero.unwrap_err(), ManagerError::ZeroCapacity);
    let mut cfg = ManagerConfig::new(4, PolicyKind::Arc);
    cfg.store_threshold = 1;
    cfg.lookup_tracking_limit = 0;
    assert_eq!(BlockManager::new(cfg).unwrap_err(), ManagerError::ZeroTrackingLimit { threshold: 1 });
    let m = manager(1, PolicyKind::Arc);
    assert_eq!(m.slot(&k(1)), None::<SlotId>);
    assert_eq!(m.policy_kind(), PolicyKind::Arc);
}

/// Issue 43, item 3, at the manager: stores of [0,3,1] and [0,1,4] fill 4
/// slots; prepare_store([0,1,2]) skips 0 and 1 as stored and must not evict
/// either (it used to evict 1, the least recently used): it evicts 3.
#[test]
fn manager_never_evicts_a_key_its_batch_skips_as_stored() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let mut m = manager(4, policy);
        store(&mut m, &[k(0), k(3), k(1)]);
        store(&mut m, &[k(0), k(1), k(4)]);
        let out = m.prepare_store(&[k(0), k(1), k(2)]).unwrap();
        let stored = SkipReason::AlreadyStored;
        let want = [Skipped { key: k(0), reason: stored }, Skipped { key: k(1), reason: stored }];
        assert_eq!(out.skipped, want, "{policy:?}");
        assert_eq!(out.evicted.iter().map(|p| p.key).collect::<Vec<_>>(), [k(3)], "{policy:?}");
        m.complete_store(&[k(2)], true).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(m.prepare_load(&[k(0), k(1)]).map(|p| p.len()), Ok(2), "{policy:?}");
        // With only its own keys to evict, a batch is refused, changing nothing.
        let e = m.prepare_store(&[k(0), k(1), k(2), k(4), k(5)]).unwrap_err();
        assert!(matches!(e, ManagerError::InsufficientCapacity { evictable: 0, .. }), "{policy:?}: {e:?}");
        m.check_invariants().unwrap();
    }
}

/// A store prepared and undone is as if never made: a manager that did so
/// and a twin that did not answer every later call alike, slots and events
/// included (the free list's order, the policy's order, ARC's ghosts and
/// target: with 1 and 2 in T2, 5 in T1 and 3, 4 ghosts in B1, the undone
/// store of [6, 3] evicts 5 and 1 and re-admits 3 from B1, which raises the
/// target; had the target stayed raised, the next store would evict 1 from
/// T2 instead of 5 from T1).
#[test]
fn manager_undo_store_is_as_if_never_made() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let (mut m, mut twin) = (manager(3, policy), manager(3, policy));
        for mg in [&mut m, &mut twin] {
            for batch in [&[k(1)][..], &[k(2)], &[k(3)]] {
                store(mg, batch);
            }
            mg.touch(&[k(2), k(1)]);
            store(mg, &[k(4)]);
            store(mg, &[k(5)]);
            mg.take_events();
        }
        let (out, undo) = m.prepare_store_undoable(&[k(6), k(3)]).unwrap();
        assert_eq!(out.to_store.len(), 2, "{policy:?}");
        assert_eq!(out.evicted.len(), 2, "{policy:?}");
        m.undo_store(undo).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(m.take_events(), vec![], "{policy:?}: the undone evictions left no event");
        assert_eq!(m.counters(), twin.counters(), "{policy:?}");
        for batch in [&[k(6)][..], &[k(3)], &[k(1), k(2)], &[k(2), k(7)], &[k(1)], &[k(8), k(9)]] {
            let (a, b) = (m.prepare_store(batch), twin.prepare_store(batch));
            assert_eq!(a, b, "{policy:?}: store {batch:?}");
            let stored: Vec<BlockKey> = a.unwrap().to_store.iter().map(|p| p.key).collect();
            m.complete_store(&stored, true).unwrap();
            twin.complete_store(&stored, true).unwrap();
            assert_eq!(m.take_events(), twin.take_events(), "{policy:?}: events of {batch:?}");
        }
        m.check_invariants().unwrap();
    }
}

/// An undo is exact only right after its prepare: after any other call it
/// is refused, and changes nothing.
#[test]
fn manager_undo_store_after_another_call_is_refused() {
    let mut m = manager(1, PolicyKind::Lru);
    store(&mut m, &[k(1)]);
    let (_, undo) = m.prepare_store_undoable(&[k(2)]).unwrap();
    m.lookup(&[k(2)]);
    let e = m.undo_store(undo).unwrap_err();
    assert!(matches!(e, ManagerError::Internal(_)), "{e:?}");
    assert_eq!(m.state(&k(2)), Some(BlockState::WritePending));
    assert_eq!(m.state(&k(1)), None);
    m.check_invariants().unwrap();
}
