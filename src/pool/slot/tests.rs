//! Unit tests of the slot word: each transition and each of its refusals.

use super::*;

const E: u8 = 4;
const R: u8 = 2;

fn err(r: Result<Step, SlotError>) -> SlotError {
    r.expect_err("the transition applied")
}

#[test]
fn word_round_trips_and_zero_is_free_epoch_0() {
    assert_eq!(SlotWord::ZERO.state(), SlotState::Free);
    assert_eq!(SlotWord::ZERO.epoch(), 0);
    assert_eq!(SlotWord::free(0), SlotWord::ZERO);
    let w = SlotWord::writing(31, (1 << EPOCH_BITS) - 1, 0x8000_0001);
    assert_eq!((w.state(), w.engine(), w.epoch(), w.payload()), (SlotState::Writing, 31, (1 << 25) - 1, 0x8000_0001));
    assert_eq!(SlotWord::decode(w.encode()), w);
    assert_eq!(w.encode() >> 63, 1, "the epoch's top bit is bit 63");
    let r = SlotWord::readable(7, u32::MAX);
    assert_eq!((r.state(), r.engine(), r.epoch(), r.payload()), (SlotState::Readable, 0, 7, u32::MAX));
    assert_eq!(SlotWord::decode(3 << 32).state(), SlotState::Invalid);
    assert_eq!(SlotWord::next_epoch((1 << EPOCH_BITS) - 1), 0);
}

#[test]
fn check_states_the_one_word_invariants() {
    assert_eq!(SlotWord::ZERO.check(E, R), Ok(()));
    assert_eq!(SlotWord::writing(3, 1, 0b01).check(E, R), Ok(()));
    assert_eq!(SlotWord::readable(1, 0b1111).check(E, R), Ok(()));
    assert_eq!(SlotWord::decode(3 << 32).check(E, R), Err(SlotError::Corrupt { word: 3 << 32 }));
    let inv = |w: SlotWord| matches!(w.check(E, R), Err(SlotError::Invariant { .. }));
    assert!(inv(SlotWord::decode(1)), "FREE with a payload");
    assert!(inv(SlotWord::decode(1 << ENGINE_SHIFT)), "FREE with a writer");
    assert!(inv(SlotWord::decode(SlotWord::readable(0, 0).encode() | 1 << ENGINE_SHIFT)), "READABLE with a writer");
    assert!(inv(SlotWord::writing(E, 1, 0)), "writer past the engine count");
    assert!(inv(SlotWord::writing(0, 1, 0b100)), "rank past the rank count");
    assert!(inv(SlotWord::writing(0, 1, 0b11)), "WRITING with every rank");
    assert!(inv(SlotWord::readable(1, 1 << E)), "holder past the engine count");
    assert_eq!(SlotWord::ZERO.check(0, R), Err(SlotError::EngineOutOfRange { engine: 0 }));
    assert_eq!(SlotWord::ZERO.check(E, 33), Err(SlotError::RankOutOfRange { rank: 0, ranks: 33 }));
    assert_eq!(SlotWord::writing(31, 0, u32::MAX >> 1).check(32, 32), Ok(()));
}

#[test]
fn claim_only_from_free_and_moves_the_epoch() {
    let c = SlotCell::default();
    let s = c.claim(2).unwrap();
    assert_eq!((s.old, s.new), (SlotWord::ZERO, SlotWord::writing(2, 1, 0)));
    assert_eq!(err(c.claim(1)), SlotError::WrongState { expected: SlotState::Free, found: SlotState::Writing });
    let c = SlotCell::new(SlotWord::readable(5, 0));
    assert_eq!(err(c.claim(1)), SlotError::WrongState { expected: SlotState::Free, found: SlotState::Readable });
    let c = SlotCell::new(SlotWord::free((1 << EPOCH_BITS) - 1));
    assert_eq!(c.claim(0).unwrap().new, SlotWord::writing(0, 0, 0), "the epoch wraps");
    assert_eq!(err(SlotCell::default().claim(32)), SlotError::EngineOutOfRange { engine: 32 });
    let c = SlotCell::new(SlotWord::decode(3 << 32));
    assert_eq!(err(c.claim(0)), SlotError::Corrupt { word: 3 << 32 });
    assert_eq!(c.load().encode(), 3 << 32, "a corrupt word is left alone");
}

#[test]
fn ranks_complete_then_the_last_publishes() {
    let c = SlotCell::new(SlotWord::writing(1, 9, 0));
    assert_eq!(c.complete_rank(1, 9, 1, 3).unwrap().new, SlotWord::writing(1, 9, 0b010));
    assert_eq!(err(c.complete_rank(1, 9, 1, 3)), SlotError::RankAlreadyDone { rank: 1 });
    assert_eq!(err(c.complete_rank(0, 9, 0, 3)), SlotError::OtherWriter { engine: 0, writer: 1 });
    assert_eq!(err(c.complete_rank(1, 8, 0, 3)), SlotError::EpochMoved { expected: 8, found: 9 });
    assert_eq!(err(c.complete_rank(1, 9, 3, 3)), SlotError::RankOutOfRange { rank: 3, ranks: 3 });
    assert_eq!(err(c.complete_rank(1, 9, 0, 0)), SlotError::RankOutOfRange { rank: 0, ranks: 0 });
    assert_eq!(c.complete_rank(1, 9, 0, 3).unwrap().new, SlotWord::writing(1, 9, 0b011));
    assert_eq!(c.complete_rank(1, 9, 2, 3).unwrap().new, SlotWord::readable(9, 0));
    assert_eq!(
        err(c.complete_rank(1, 9, 2, 3)),
        SlotError::WrongState { expected: SlotState::Writing, found: SlotState::Readable }
    );
    // One rank publishes at once; 32 ranks need every bit.
    let c = SlotCell::new(SlotWord::writing(0, 1, 0));
    assert_eq!(c.complete_rank(0, 1, 0, 1).unwrap().new, SlotWord::readable(1, 0));
    let c = SlotCell::new(SlotWord::writing(0, 1, u32::MAX >> 1));
    assert_eq!(c.complete_rank(0, 1, 31, 32).unwrap().new, SlotWord::readable(1, 0));
}

#[test]
fn abandon_frees_its_own_write_only() {
    let c = SlotCell::new(SlotWord::writing(3, 4, 0b1));
    assert_eq!(err(c.abandon(2, 4)), SlotError::OtherWriter { engine: 2, writer: 3 });
    assert_eq!(err(c.abandon(3, 5)), SlotError::EpochMoved { expected: 5, found: 4 });
    assert_eq!(c.abandon(3, 4).unwrap().new, SlotWord::free(4));
    assert_eq!(err(c.abandon(3, 4)), SlotError::WrongState { expected: SlotState::Writing, found: SlotState::Free });
}

#[test]
fn hold_and_release_set_and_clear_one_bit() {
    let c = SlotCell::new(SlotWord::readable(6, 0));
    assert_eq!(c.hold(0, 6).unwrap().new, SlotWord::readable(6, 0b1));
    let again = c.hold(0, 6).unwrap();
    assert_eq!(again.old, again.new, "an engine's second hold leaves the word");
    assert_eq!(c.hold(31, 6).unwrap().new, SlotWord::readable(6, 0x8000_0001));
    assert_eq!(err(c.hold(1, 5)), SlotError::EpochMoved { expected: 5, found: 6 });
    assert_eq!(err(c.release(1, 6)), SlotError::NotHeld { engine: 1 });
    assert_eq!(err(c.release(0, 7)), SlotError::EpochMoved { expected: 7, found: 6 });
    assert_eq!(c.release(0, 6).unwrap().new, SlotWord::readable(6, 0x8000_0000));
    let w = SlotCell::new(SlotWord::writing(0, 1, 0));
    assert_eq!(err(w.hold(0, 1)), SlotError::WrongState { expected: SlotState::Readable, found: SlotState::Writing });
    assert_eq!(
        err(w.release(0, 1)),
        SlotError::WrongState { expected: SlotState::Readable, found: SlotState::Writing }
    );
}

#[test]
fn evict_only_unheld_readable_keeping_the_epoch() {
    let c = SlotCell::new(SlotWord::readable(12, 0b100));
    assert_eq!(err(c.evict(12)), SlotError::Held { holders: 0b100 });
    c.release(2, 12).unwrap();
    assert_eq!(err(c.evict(11)), SlotError::EpochMoved { expected: 11, found: 12 });
    assert_eq!(c.evict(12).unwrap().new, SlotWord::free(12));
    assert_eq!(err(c.evict(12)), SlotError::WrongState { expected: SlotState::Readable, found: SlotState::Free });
    let w = SlotCell::new(SlotWord::writing(0, 1, 0));
    assert_eq!(err(w.evict(1)), SlotError::WrongState { expected: SlotState::Readable, found: SlotState::Writing });
}

#[test]
fn reclaim_drops_only_the_dead_engines_marks() {
    let c = SlotCell::new(SlotWord::writing(5, 3, 0b1));
    let s = c.reclaim(4).unwrap();
    assert_eq!(s.old, s.new, "another writer's slot is left");
    assert_eq!(c.reclaim(5).unwrap().new, SlotWord::free(3), "a dead writer's slot is freed, never published");
    let c = SlotCell::new(SlotWord::readable(3, 0b110));
    assert_eq!(c.reclaim(1).unwrap().new, SlotWord::readable(3, 0b100));
    let s = c.reclaim(1).unwrap();
    assert_eq!(s.old, s.new, "a sweep run twice changes nothing more");
    let c = SlotCell::default();
    let s = c.reclaim(0).unwrap();
    assert_eq!(s.old, s.new);
    let c = SlotCell::new(SlotWord::decode(3 << 32));
    assert_eq!(err(c.reclaim(0)), SlotError::Corrupt { word: 3 << 32 });
}

/// Threads racing on one word: of many claimers exactly one wins; holds by
/// distinct engines all land (a lost CAS retries with the word it found).
#[test]
fn racing_claims_one_wins_and_racing_holds_all_land() {
    use crate::sync::{thread, Arc};
    for _ in 0..50 {
        let c = Arc::new(SlotCell::default());
        let claims: Vec<_> = (0..8u8)
            .map(|e| {
                let c = Arc::clone(&c);
                thread::spawn(move || c.claim(e).is_ok())
            })
            .collect();
        let won = claims.into_iter().map(|h| h.join().expect("a claimer panicked")).filter(|w| *w).count();
        assert_eq!(won, 1, "two writers claimed one slot");
        assert_eq!(c.load().epoch(), 1);

        let c = Arc::new(SlotCell::new(SlotWord::readable(1, 0)));
        let holds: Vec<_> = (0..MAX_ENGINES)
            .map(|e| {
                let c = Arc::clone(&c);
                thread::spawn(move || c.hold(e, 1).map(|_| ()))
            })
            .collect();
        for h in holds {
            h.join().expect("a holder panicked").expect("a hold was refused");
        }
        assert_eq!(c.load(), SlotWord::readable(1, u32::MAX));
    }
}
