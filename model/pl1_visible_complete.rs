//! PL1 visible only when complete (docs/node-pool-design.md 3.3, 4): a
//! `HIT` reads, for every rank, the tag of its key; so a slot is readable
//! only once every rank's bytes are written, and those bytes happen before
//! the reader's copy.
//!
//! Scenario: engine A's scheduler (main) claims key K in a pool of one
//! slot (`PoolTable::claim`), then its two rank threads each write their
//! row of the slot (a loom `UnsafeCell` holding `tag(K, epoch, rank)`,
//! `model/common/pool.rs`) and complete (`PoolTable::complete_rank`: the
//! last one's CAS publishes), while engine B's scheduler looks K up
//! (`PoolTable::lookup`) and, on a hit, reads every rank's row and
//! releases. After the threads: B loads K (a hit), and the pool is
//! quiescent (`PoolTable::check`, no hold left). Threads: main (A's
//! scheduler), A's two ranks, B: 4. Bound 3 (in ci/test too). Shuttle's size
//! (docs/PROOFS.md "Past loom's bound"): 3 ranks, 2 readers (6 threads).
//!
//! Checked (the record of `model/common/pool.rs`): on a hit every rank's
//! completion CAS is recorded before the read ("served half-written: read a
//! rank's bytes before they were written"), every row holds its tag, and
//! the read of each row's cell is ordered after its write (loom's causality
//! check: "Causality violation"); a rank never writes into a slot already
//! published at its epoch; exactly one rank's CAS publishes.
//!
//! Why it holds (src/pool/table.rs rule 1): the slot word turns `READABLE`
//! only in the CAS that sets the last rank's bit; each rank writes its row
//! before its own CAS (AcqRel), the CASes form one release sequence on the
//! word, and the reader's hold CAS (AcqRel) reads from the publish, so every
//! rank's write happens before the reader's copy.
//!
//! Negatives:
//! - N39 (`Variant::PublishOnAnyRank`: the first rank's bit publishes) ->
//!   "read a rank's bytes before they were written" (a rank writes, or
//!   completes, into a slot already readable; or a hit finds a rank's
//!   completion missing).
//! - N47 (model-local: the publish CAS with Relaxed ordering, through
//!   `Options::publish_relaxed`; every other CAS AcqRel) -> loom's
//!   "Causality violation": the reader's copy races the last rank's write.
//!   Loom only: shuttle runs every atomic sequentially consistent and has
//!   no causality check, so the bug has no effect there.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::pool::{join_all, key, Engine, Options, Pool};
use common::{models, sized, Bounds};
use kvoffload::internal::pool::table::Placement;
use kvoffload::internal::pool::words::Geometry;
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{thread, Arc};

/// A's ranks and B's readers: loom's size, then shuttle's.
const RANKS: u8 = sized(2, 3) as u8;
const READERS: usize = sized(1, 2);

fn scenario(variant: Variant, opts: Options) {
    let g = Geometry { slots: 1, ways: 1, ranks: RANKS, engines: 1 + READERS as u8 };
    let pool = Pool::new(g, opts);
    join_all(&pool);
    let k = key(7);
    let readers: Vec<_> = (1..=READERS)
        .map(|i| {
            let b = Engine::new(&pool, i as u8, variant);
            thread::spawn(move || b.load(&k))
        })
        .collect();
    // A's scheduler claims K; its ranks write and complete.
    let a = Arc::new(Engine::new(&pool, 0, variant));
    let Placement::Claimed { slot, epoch, evicted: None } = a.claim(&k) else { panic!("the pool's one slot is free") };
    let ranks: Vec<_> = (0..RANKS)
        .map(|r| {
            let a = a.clone();
            thread::spawn(move || {
                a.write_rank(&k, slot, epoch, r);
                a.complete(slot, epoch, r)
            })
        })
        .collect();
    let published = ranks.into_iter().map(|h| h.join().unwrap()).filter(|&p| p).count();
    assert_eq!(published, 1, "one rank's CAS publishes the slot");
    for h in readers {
        h.join().unwrap();
    }
    let b = Engine::new(&pool, 1, variant);
    assert!(b.load(&k), "K is readable once every rank completed");
    Pool::check_quiescent(&pool, &[]);
}

/// Bound 3 (under a second both in ci/test and in `--full`: no ci/test bound).
const B: Bounds = Bounds { property: "PL1", threads: 4, preemptions: 3, ci: None };
const N: Bounds = Bounds { property: "N39", threads: 4, preemptions: 2, ci: None };

models! {
    pl1_a_hit_reads_every_ranks_bytes:
        check("pl1_visible_complete", B, || scenario(Variant::Production, Options::default()));
    negative_n39_pl1_publish_on_any_rank:
        negative("n39_publish_on_any_rank", N, "read a rank's bytes before they were written",
            || scenario(Variant::PublishOnAnyRank, Options::default()));
    #[cfg(loom)]
    negative_n47_pl1_publish_relaxed:
        negative("n47_publish_relaxed", Bounds { property: "N47", ..N }, "Causality violation",
            || scenario(Variant::Production, Options { publish_relaxed: true, ..Options::default() }));
}
