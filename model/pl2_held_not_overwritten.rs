//! PL2 a held slot is never overwritten or evicted (docs/node-pool-design.md
//! 3.1, 3.5, 3.7, 4); and a hold serves the key it was taken for, even when
//! the slot's epoch came back to the value the lookup read (ABA).
//!
//! Scenario: a pool of one set of one way, one rank per engine, epochs one
//! bit wide (`Options::epoch_bits`, model-only: a claim's epoch is taken
//! modulo 2, so two claims bring a slot's word back to the value a lookup
//! read: design 3.7's ABA in two claims instead of 2^25). Setup: A stores K
//! (published). Then B looks K up and, on a hit, reads its row and releases
//! (`PoolTable::lookup`, `release`), while A stores K2 then K3 into the same
//! set (`PoolTable::claim`: the set is full, so CLOCK eviction; the row
//! written, the rank's completion publishing). Threads: main, A, B: 3.
//! Bound 3, 2 in ci/test. Shuttle's size: A stores 4 keys, two readers look
//! K up (4 threads).
//!
//! Checked (the record of `model/common/pool.rs`): no claim of a word
//! with holders ("overwritten while held"), no row written while a living
//! reader holds its slot (the same), and a hit's row holds the tag of the
//! key looked up, at the hold's epoch ("served another key's bytes"); every
//! row read ordered after its write (loom's causality check); B's release
//! succeeds; at the end no hold is left and every word is valid.
//!
//! Why it holds (src/pool/table.rs rules 2 and 3): a hold is the engine's
//! bit in the `READABLE` word, and every claim (eviction included) is a CAS
//! expecting a word with no bits, so while B's bit is set no claim
//! succeeds; B compares the key again once its bit is set, and with its bit
//! set the key cannot change, so a match is exact whatever the epoch's
//! width: a CAS that succeeded on a word come back to the value it read
//! (another key, same epoch) is caught there and released.
//!
//! Negatives:
//! - N40 (`Variant::EvictIgnoresReaders`: eviction takes a held slot) ->
//!   "overwritten while held".
//! - N41 (`Variant::NoRecheck`: no compare under the hold; reachable with
//!   the one-bit epoch: B reads K's key words, A stores K2 and K3, B's hold
//!   CAS succeeds on the word come back) -> "served another key's bytes".

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::pool::{join_all, key, Engine, Options, Pool, Stored};
use common::{models, sized, Bounds};
use kvoffload::internal::pool::words::Geometry;
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::thread;

/// Keys A stores after K, and B's readers: loom's size, then shuttle's.
const STORES: usize = sized(2, 4);
const READERS: usize = sized(1, 2);

fn scenario(variant: Variant) {
    let g = Geometry { slots: 1, ways: 1, ranks: 1, engines: 1 + READERS as u8 };
    let pool = Pool::new(g, Options { epoch_bits: Some(1), ..Options::default() });
    join_all(&pool);
    let k = key(1);
    let a = Engine::new(&pool, 0, variant);
    assert!(matches!(a.store(&k), Stored::Published { .. }), "the one slot is free");
    let readers: Vec<_> = (1..=READERS)
        .map(|i| {
            let b = Engine::new(&pool, i as u8, variant);
            thread::spawn(move || b.load(&k))
        })
        .collect();
    let writer = thread::spawn(move || {
        for i in 0..STORES {
            // Skipped while a reader holds the slot.
            let _ = a.store(&key(2 + i as u8));
        }
    });
    writer.join().unwrap();
    for h in readers {
        h.join().unwrap();
    }
    Pool::check_quiescent(&pool, &[]);
}

/// Full bound 3, 2 in ci/test.
const B: Bounds = Bounds { property: "PL2", threads: 3, preemptions: 3, ci: None }.ci_at(2);
const N: Bounds = Bounds { property: "N40", threads: 3, preemptions: 2, ci: None };

models! {
    pl2_a_held_slot_is_never_overwritten:
        check("pl2_held_not_overwritten", B, || scenario(Variant::Production));
    negative_n40_pl2_evict_ignores_readers:
        negative("n40_evict_ignores_readers", N, "overwritten while held",
            || scenario(Variant::EvictIgnoresReaders));
    negative_n41_pl2_no_recheck_under_the_hold:
        negative("n41_no_recheck", Bounds { property: "N41", ..N }, "served another key's bytes",
            || scenario(Variant::NoRecheck));
}
