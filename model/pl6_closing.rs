//! PL6 a pool is removed only while no engine is registered on it, and no
//! engine stays registered on a pool that was removed; of engines that all
//! leave a pool not kept, the last removes it (docs/node-pool-design.md 1.1,
//! 1.4; src/pool/closing.rs).
//!
//! The production protocol (`PoolTable::join_owner`, `leave`,
//! `close_waiting`) over `LocalPoolWords`; a removal is the closer's
//! `Close::Remove` (the files' removal itself is the region's, and its
//! inode checks the crash tests'). Three scenarios, each a pool of two engine
//! entries, one rank, two slots:
//!
//! - `join`: an engine joins (its owner claims an entry, the join meeting a
//!   tentative close waits and tries again, one meeting a removal gives up
//!   to open a fresh pool) while `pool rm` without `--force` closes. After
//!   both: not both "removed" and "registered" ("an engine registered on a
//!   removed pool"); and one of the two ("neither removed nor joined").
//! - `member`: as `join`, with the engine's scheduler registering beside
//!   its owner (it polls for the owner's entry, twice at most; one meeting
//!   a tentative close polls again, one meeting a removal gives up as the
//!   owner does). After all: no process of the engine registered on a
//!   removed pool, the scheduler included (the owner may have claimed
//!   after the closer's scan and left on its check while the scheduler
//!   joined its entry).
//! - `leave`: two registered engines leave at once, each then closing (as
//!   `kvo_pool_keep: false` does after its leave). After both: the pool
//!   was removed ("every engine left a pool not kept, and it stayed").
//!
//! Threads: main and two (`member`: three): 3-4. Bound 3 (`ci/test`: 2).
//!
//! Why it holds (src/pool/closing.rs rules 1-4): the joiner's claim is
//! followed by a read-modify-write of the pool word and the closer's owner
//! loads by its CAS of that word, so whichever comes second sees the other;
//! the closer decides after a tentative word, so a claim after its scan
//! meets that word; a closer waits while another decides.
//!
//! Negatives: N50 (`Variant::CloseWithoutTentative`: the owner words read,
//! then the word set final), N51 (`Variant::JoinIgnoresClosing`) and N53
//! (`Variant::JoinLoadsWord`: the join's check a plain Acquire load, which
//! loom lets read `READY` after the closer's CAS while the closer's loads
//! miss the claim) -> "an engine registered on a removed pool"; N54
//! (`Variant::MembersIgnoreClosing`: the scheduler's join takes no notice
//! of the word, the owner's does) -> "a member registered on a removed
//! pool", in `member`; N52 (`Variant::CloserGivesUp`: a
//! closer that finds another at work ends) -> "every engine left a pool not
//! kept, and it stayed".

#![cfg(any(loom, shuttle))]
#![allow(clippy::disallowed_types)]

#[path = "common/mod.rs"]
mod common;

use std::sync::Mutex;

use common::{models, Bounds};
use kvoffload::internal::pool::closing::Close;
use kvoffload::internal::pool::sweep::JoinError;
use kvoffload::internal::pool::table::PoolTable;
use kvoffload::internal::pool::words::{Geometry, LocalPoolWords, PoolWords};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{thread, Arc};

const G: Geometry = Geometry { slots: 2, ways: 2, ranks: 1, engines: 2 };
/// Rank 0's worker: the owner.
const OWNER: u8 = 1;

/// The scheduler: a member of the owner's entry.
const SCHEDULER: u8 = 0;
/// The scheduler's polls for the owner's entry.
const POLLS: usize = 2;

/// What the model threads did.
#[derive(Default)]
struct Record {
    removed: u32,
    registered: bool,
    member: bool,
}

/// Whether a refused join met a removal (then it opens a fresh pool: not
/// this one's engine) rather than a tentative close (it tries again).
fn removing(word: u64) -> bool {
    kvoffload::internal::pool::closing::PoolWord::decode(word).is_removing()
}

fn table(words: &LocalPoolWords, variant: Variant) -> PoolTable<&LocalPoolWords> {
    let t = PoolTable::new(words);
    t.set_variant(variant);
    t
}

/// The close of process `pid`, waiting (by yielding) while another closer
/// decides; a removal noted.
fn close(words: &LocalPoolWords, variant: Variant, pid: u32, record: &Mutex<Record>) {
    let t = table(words, variant);
    let me = LocalPoolWords::process(pid);
    let closed = t
        .close_waiting(
            &me,
            false,
            &mut |_| {
                thread::yield_now();
                true
            },
            &mut |_| true,
        )
        .expect("a READY pool");
    if let Close::Remove { over } = closed {
        assert!(over.is_empty(), "no force, nothing gone over");
        record.lock().unwrap().removed += 1;
        t.words().release_closer();
    }
}

/// The owner (process 1) joins, trying again after a tentative close.
fn owner(words: Arc<LocalPoolWords>, record: Arc<Mutex<Record>>, variant: Variant) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let t = table(&words, variant);
        let me = LocalPoolWords::process(1);
        loop {
            match t.join_owner(OWNER, &me, &[7; 4]) {
                Ok(_) => {
                    record.lock().unwrap().registered = true;
                    return;
                }
                Err(JoinError::Closing { word }) if removing(word) => return,
                Err(JoinError::Closing { .. }) => thread::yield_now(),
                Err(e) => panic!("join: {e}"),
            }
        }
    })
}

fn join(variant: Variant) {
    let words = Arc::new(LocalPoolWords::new(G, 4));
    let record = Arc::new(Mutex::new(Record::default()));
    let joiner = owner(words.clone(), record.clone(), variant);
    close(&words, variant, 3, &record);
    joiner.join().unwrap();
    let r = record.lock().unwrap();
    assert!(!(r.removed > 0 && r.registered), "an engine registered on a removed pool");
    assert!(r.removed > 0 || r.registered, "neither removed nor joined");
}

fn member(variant: Variant) {
    let words = Arc::new(LocalPoolWords::new(G, 4));
    let record = Arc::new(Mutex::new(Record::default()));
    let joiner = owner(words.clone(), record.clone(), variant);
    let scheduler = {
        let (words, record) = (words.clone(), record.clone());
        thread::spawn(move || {
            let t = table(&words, variant);
            let me = LocalPoolWords::process(2);
            for _ in 0..POLLS {
                match t.join_member(SCHEDULER, &me, &[7; 4]) {
                    Ok(Some(_)) => {
                        record.lock().unwrap().member = true;
                        return;
                    }
                    Err(JoinError::Closing { word }) if removing(word) => return,
                    Ok(None) | Err(JoinError::Closing { .. }) => thread::yield_now(),
                    Err(e) => panic!("join_member: {e}"),
                }
            }
        })
    };
    close(&words, variant, 3, &record);
    joiner.join().unwrap();
    scheduler.join().unwrap();
    let r = record.lock().unwrap();
    assert!(!(r.removed > 0 && r.member), "a member registered on a removed pool");
    assert!(!(r.removed > 0 && r.registered), "an engine registered on a removed pool");
}

fn leave(variant: Variant) {
    let words = Arc::new(LocalPoolWords::new(G, 4));
    let record = Arc::new(Mutex::new(Record::default()));
    let leases: Vec<_> = (1..=2u32)
        .map(|pid| {
            let t = table(&words, variant);
            (pid, t.join_owner(OWNER, &LocalPoolWords::process(pid), &[pid as u64; 4]).expect("a free entry"))
        })
        .collect();
    let threads: Vec<_> = leases
        .into_iter()
        .map(|(pid, lease)| {
            let (words, record) = (words.clone(), record.clone());
            thread::spawn(move || {
                let t = table(&words, variant);
                t.leave(lease, OWNER, &LocalPoolWords::process(pid)).expect("leave");
                close(&words, variant, pid, &record);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let r = record.lock().unwrap();
    assert!(r.removed == 1, "every engine left a pool not kept, and it stayed (removed {} times)", r.removed);
}

const B: Bounds = Bounds { property: "PL6", threads: 3, preemptions: 3, ci: None }.ci_at(2);
const N: Bounds = Bounds { property: "N50", threads: 3, preemptions: 2, ci: None };
/// `member`: main, the owner, the scheduler.
const BM: Bounds = Bounds { threads: 4, ..B };

models! {
    pl6_a_join_and_a_close_never_both_win:
        check("pl6_join", B, || join(Variant::Production));
    pl6_a_member_never_stays_on_a_removed_pool:
        check("pl6_member", BM, || member(Variant::Production));
    pl6_the_last_engine_to_leave_removes_the_pool:
        check("pl6_leave", B, || leave(Variant::Production));
    negative_n50_pl6_close_without_tentative:
        negative("n50_close_without_tentative", N, "an engine registered on a removed pool",
            || join(Variant::CloseWithoutTentative));
    negative_n51_pl6_join_ignores_closing:
        negative("n51_join_ignores_closing", Bounds { property: "N51", ..N }, "an engine registered on a removed pool",
            || join(Variant::JoinIgnoresClosing));
    // Loom only: shuttle runs sequentially consistent schedules, where a
    // load reads the latest store, so the store-buffer outcome never comes.
    #[cfg(loom)]
    negative_n53_pl6_join_loads_word:
        negative("n53_join_loads_word", Bounds { property: "N53", ..N }, "an engine registered on a removed pool",
            || join(Variant::JoinLoadsWord));
    negative_n54_pl6_members_ignore_closing:
        negative("n54_members_ignore_closing", Bounds { property: "N54", threads: 4, ..N }, "a member registered on a removed pool",
            || member(Variant::MembersIgnoreClosing));
    negative_n52_pl6_closer_gives_up:
        negative("n52_closer_gives_up", Bounds { property: "N52", ..N },
            "every engine left a pool not kept, and it stayed", || leave(Variant::CloserGivesUp));
}
