//! PL3 two writers never share a slot (docs/node-pool-design.md 3.4, 4): at
//! most one claim succeeds per slot and epoch, and no two engines write one
//! row.
//!
//! Scenario: a pool of one set of two ways, one rank per engine. Setup:
//! engine 0 stores K0 and holds it (`PoolTable::lookup`), so one slot is
//! left free. Then engines 1, 2 and 3 each store a key of their own into
//! the set at once (`PoolTable::claim`: the last free slot, then CLOCK over
//! the held slot and the one another claimed), and the one whose claim
//! succeeded writes its row. After the threads: exactly one claim
//! succeeded; its writer's rank completes (publishing) and its key loads;
//! engine 0 still reads K0 and releases. The writer publishes only after
//! the race, so that a loser's CLOCK finds the slot being written (an
//! eviction of a published slot racing a claim is PL5's). Threads: main,
//! three engines: 4. Bound 3, 2 in ci/test. Shuttle's size: 5 engines
//! claim the last free slot of a set of three ways (6 threads).
//!
//! Checked (the record of `model/common/pool.rs`): every claim CAS
//! expects a word nobody writes, at an epoch not claimed before ("two
//! writers in one slot"); every row is written by the engine whose claim
//! the slot's word names ("two writers in one slot"); no row written while
//! a living engine holds the slot ("overwritten while held"); some engine's
//! claim of the free slot succeeded; every row read ordered after its write
//! (loom's causality check).
//!
//! Why it holds (src/pool/table.rs rule 4): a claim is one CAS from the word
//! its decision read (`FREE`, or `READABLE` with no holders) to `WRITING(me,
//! epoch + 1)`; of two claimers that read the same word one CAS fails, and
//! the loser decides again on the word found, which no claim expects.
//!
//! Negative: N42 (`Variant::ClaimByStore`: the claim sets the word whatever
//! it became since the decision) -> "two writers in one slot".

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::pool::{join_all, key, Engine, Options, Pool, Stored};
use common::{models, sized, Bounds};
use kvoffload::internal::pool::table::Placement;
use kvoffload::internal::pool::words::Geometry;
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::thread;

/// Engines racing for the slot, and the set's ways: loom's size, then
/// shuttle's.
const CLAIMERS: usize = sized(3, 5);
const WAYS: u32 = sized(2, 3) as u32;

fn scenario(variant: Variant) {
    let g = Geometry { slots: WAYS, ways: WAYS, ranks: 1, engines: 1 + CLAIMERS as u8 };
    let pool = Pool::new(g, Options::default());
    join_all(&pool);
    // Every way but one held: engine 0's keys.
    let holder = Engine::new(&pool, 0, variant);
    let held: Vec<_> = (0..WAYS - 1)
        .map(|i| {
            let k = key(100 + i as u8);
            assert!(matches!(holder.store(&k), Stored::Published { .. }));
            let (slot, epoch) = holder.lookup(&k).expect("a key just stored");
            (k, slot, epoch)
        })
        .collect();
    let claimers: Vec<_> = (1..=CLAIMERS)
        .map(|i| {
            let e = Engine::new(&pool, i as u8, variant);
            thread::spawn(move || {
                let k = key(i as u8);
                let p = e.claim(&k);
                if let Placement::Claimed { slot, epoch, .. } = p {
                    e.write_rank(&k, slot, epoch, 0);
                }
                (e, p)
            })
        })
        .collect();
    let placed: Vec<(Engine, Placement)> = claimers.into_iter().map(|h| h.join().unwrap()).collect();
    let claimed: Vec<_> = placed
        .iter()
        .filter_map(|(e, p)| match p {
            Placement::Claimed { slot, epoch, .. } => Some((e, *slot, *epoch)),
            _ => None,
        })
        .collect();
    let found: Vec<_> = placed.iter().map(|(_, p)| p).collect();
    assert_eq!(claimed.len(), 1, "one claim of the free slot succeeds: {found:?}");
    // The writer publishes; its key loads, with its row.
    let (writer, slot, epoch) = claimed[0];
    assert!(writer.complete(slot, epoch, 0), "the one rank's completion publishes");
    assert!(holder.load(&key(writer.index)), "the key published loads");
    for (k, slot, epoch) in &held {
        holder.read(k, *slot, *epoch);
        holder.release(*slot, *epoch);
    }
    Pool::check_quiescent(&pool, &[]);
}

/// Full bound 3, 2 in ci/test.
const B: Bounds = Bounds { property: "PL3", threads: 4, preemptions: 3, ci: None }.ci_at(2);

models! {
    pl3_one_writer_per_slot_and_epoch:
        check("pl3_one_writer", B, || scenario(Variant::Production));
    negative_n42_pl3_claim_by_store:
        negative("n42_claim_by_store", Bounds { property: "N42", preemptions: 2, ..B }, "two writers in one slot",
            || scenario(Variant::ClaimByStore));
}
