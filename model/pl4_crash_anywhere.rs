//! PL4 a process killed at any step leaves the pool usable
//! (docs/node-pool-design.md 3.6, 4): after the sweeps no mark of the dead
//! engine remains (no `WRITING` word of it, no bit of it, its entry
//! `FREE`), nothing half-written is served, and every key is storable and
//! loadable after.
//!
//! A process dies by returning at a chosen step: its model thread stops
//! there and the liveness oracle says `Gone` of it from then on
//! (`LocalPoolWords::kill`); its holds die with it (the record of
//! `model/common/pool.rs` forgets them).
//!
//! Scenario 1, one test per step engine A dies at (`Death`): a pool of two
//! sets of one way, two ranks per engine (A's thread is its scheduler and
//! both its ranks), three engines A, B, C joined (`join_owner`,
//! `join_member`). Setup: C stores K0 (set 0). Then, at once:
//! - A stores KA (set 1) and dies after its claim, after rank 0's bit,
//!   holding K0 (after publishing KA), or mid-release (holding K0 and KA,
//!   KA released, K0 not);
//! - C waits for A's death, sweeps (`sweep_dead`), stores KC and K6 (set 0:
//!   each evicts what the set holds unless it is held; two, so that a
//!   second chance a lookup gives during the first store's CLOCK steps
//!   cannot spare K0 from both), and says it is done;
//! - B looks K0 up and, on a hit, reads it, waits for C, reads it again and
//!   releases; then, once the other readers are done, stores and loads
//!   KA, K0 and KC, each stored then loaded at once. Under shuttle two more
//!   readers (engines 3, 4) hold K0 across the sweep the same way, and each
//!   reader loads K0 four times first (holds spread over the run, racing
//!   the sweep's pass: N44 was caught in 9 of 12 quick passes with one
//!   reader, in every one since).
//!
//! Threads: main, A, B, C: 4 (6 under shuttle).
//!
//! Scenario 2, one test per step the first sweeper dies at (`SweepStep`:
//! taken, sealed, after slot 0, cleared): A dies after rank 0's bit
//! (during setup); sweeper S1 (a process of no engine, as `pool ls
//! --reclaim`) sweeps A's entry (`sweep_engine`) and dies at the step (its
//! `step` observer says stop, then its pid is killed); sweeper S2 waits for S1's death and sweeps
//! (taking over the entry S1 left `RECLAIMING`); B, meanwhile, holds and
//! reads K0 as above, waits for S2, then stores and loads every key.
//! Threads: main, S1, S2, B: 4 (6 under shuttle).
//!
//! Bound 3, 2 in ci/test, for each test (8 tests; at 3 about 60 s for an
//! engine's death, 7 s for a sweeper's); the negatives at 2. Shuttle: the
//! same scenarios, and `pl4_shuttle_random_kills` (shuttle only, the
//! design's size: 4 engines of 3 ranks, 2 sets of 4 ways, 24 keys, each
//! engine and the sweeper killed at a random step with probability 1/4).
//!
//! Checked, besides the record's checks (`model/common/pool.rs`): a hit
//! never finds a rank's completion missing ("served half-written"); a hold
//! bit of a living engine is never cleared by another process ("lost a
//! live engine's hold"), and every release succeeds; no row written while
//! a living engine holds its slot ("overwritten while held"); after the
//! threads (`Pool::check_quiescent`): no mark of the dead engine, its entry
//! `FREE`, every word valid, no hold left.
//!
//! Why it holds (src/pool/sweep.rs rules 2-5): the sweep takes the entry,
//! seals its members and judges every one gone before it touches a slot;
//! it frees a dead writer's slot (never publishes it: readable needs every
//! rank's own bit) and clears a dead holder's bit by CAS on the word it
//! read, so a bit set meanwhile by a living engine fails the CAS and is
//! kept; the entry is `FREE` only after every slot's pass, and a sweep cut
//! by its sweeper's death is taken over (`RECLAIMING` by a dead pid), every
//! step conditional on the word read.
//!
//! Negatives:
//! - N43 (`Variant::ReclaimPublishes`: the sweep publishes a dead writer's
//!   slot), A dead after rank 0's bit -> "served half-written".
//! - N44 (`Variant::SweepStores`: the sweep stores a word computed from a
//!   stale read), A dead holding K0 -> "lost a live engine's hold" (B's
//!   bit, set between the sweep's read and its store, wiped).
//! - N48 (model-local: C's liveness oracle says `Gone` of every process of
//!   another engine, B included), A dead holding K0 -> "overwritten while
//!   held" (C sweeps B's hold away, then its stores evict K0 under B's
//!   read: the sweep's CAS is right for the engine it was told is dead).

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::pool::{join_all, key, Engine, Options, Pool, Stored};
use common::{models, sized, Bounds, Flag};
use kvoffload::internal::pool::sweep::{SweepStep, Swept};
use kvoffload::internal::pool::table::Placement;
use kvoffload::internal::pool::words::{Geometry, Key};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{thread, Arc};

/// Where engine A dies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Death {
    /// After its claim of KA (`WRITING`, no rank's bit).
    AfterClaim,
    /// After rank 0's row and bit (`WRITING`, rank 0 complete).
    AfterRank0,
    /// After publishing KA, holding K0.
    Holding,
    /// Holding K0 and KA, after KA's release, before K0's.
    MidRelease,
}

const A: u8 = 0;
const B: u8 = 1;
const C: u8 = 2;

fn k0() -> Key {
    key(2)
}
fn ka() -> Key {
    key(1)
}
fn kc() -> Key {
    key(4)
}

/// Engines holding K0 across the sweep (B and, under shuttle, two more:
/// more chances for a hold to race the sweep's pass over K0's slot).
const READERS: usize = sized(1, 3);
/// Loads of K0 each reader makes before the hold it keeps across the sweep
/// (under shuttle: holds spread over the run, racing the sweep's pass).
const ROUNDS: usize = sized(0, 4);

fn geometry() -> Geometry {
    Geometry { slots: 2, ways: 1, ranks: 2, engines: 2 + READERS as u8 }
}

/// B (engine 1, which stores and loads every key at the end) and the other
/// readers (engines 3..), each on a thread of its own.
fn readers(pool: &Arc<Pool>, variant: Variant, swept: &Arc<Flag>) -> Vec<thread::JoinHandle<()>> {
    let done: Arc<Vec<Arc<Flag>>> = Arc::new((0..READERS).map(|_| Arc::new(Flag::default())).collect());
    (0..READERS)
        .map(|i| {
            let e = if i == 0 { B } else { 2 + i as u8 };
            let (b, swept, done) = (Engine::new(pool, e, variant), swept.clone(), done.clone());
            thread::spawn(move || {
                let others = (i == 0).then(|| &done[1..]);
                b_run(&b, &swept, others, &done[i])
            })
        })
        .collect()
}

/// Engine A's run until it dies at `death`.
fn a_until(a: &Engine, death: Death) {
    let ka = ka();
    let Placement::Claimed { slot, epoch, .. } = a.claim(&ka) else { panic!("KA's set is free") };
    if death == Death::AfterClaim {
        return;
    }
    a.write_rank(&ka, slot, epoch, 0);
    a.complete(slot, epoch, 0);
    if death == Death::AfterRank0 {
        return;
    }
    a.write_rank(&ka, slot, epoch, 1);
    a.complete(slot, epoch, 1);
    let Some((s0, e0)) = a.lookup(&k0()) else { return };
    a.read(&k0(), s0, e0);
    if death == Death::Holding {
        return;
    }
    if let Some((sa, ea)) = a.lookup(&ka) {
        a.read(&ka, sa, ea);
        a.release(sa, ea);
    }
}

/// B: holds K0 (if it hits) across the sweep; then, if `others` is
/// `Some` (B, engine 1), waits for the other readers to be done and stores
/// and loads every key; else (another reader) says it is done.
fn b_run(b: &Engine, swept: &Flag, others: Option<&[Arc<Flag>]>, done: &Flag) {
    (0..ROUNDS).for_each(|_| {
        b.load(&k0());
    });
    match b.lookup(&k0()) {
        Some((slot, epoch)) => {
            b.read(&k0(), slot, epoch);
            swept.wait();
            b.read(&k0(), slot, epoch);
            b.release(slot, epoch);
        }
        None => swept.wait(),
    }
    let Some(others) = others else {
        done.set();
        return;
    };
    for o in others {
        o.wait();
    }
    for k in [ka(), k0(), kc()] {
        let s = b.store(&k);
        assert!(s != Stored::Skipped, "{k:?} skipped once the dead engine was swept");
        assert!(b.load(&k), "{k:?} not loadable right after its store ({s:?})");
    }
}

fn scenario(death: Death, variant: Variant, lying_oracle: bool) {
    let pool = Pool::new(geometry(), Options::default());
    join_all(&pool);
    let a = Engine::new(&pool, A, variant);
    let c = if lying_oracle { Engine::lying(&pool, C, variant) } else { Engine::new(&pool, C, variant) };
    assert!(matches!(c.store(&k0()), Stored::Published { .. }));
    let (dead, swept) = (Arc::new(Flag::default()), Arc::new(Flag::default()));
    let ta = {
        let dead = dead.clone();
        thread::spawn(move || {
            a_until(&a, death);
            a.die();
            dead.set();
        })
    };
    let tc = {
        let (dead, swept) = (dead.clone(), swept.clone());
        thread::spawn(move || {
            dead.wait();
            let freed = c.sweep(&mut |_| true);
            assert!(freed.contains(&A), "the dead engine's entry is freed by the sweep: {freed:?}");
            // Two keys of set 0: the first may spend its CLOCK steps on a
            // second chance a lookup gave meanwhile, the second then takes
            // an unheld K0.
            let _ = c.store(&kc());
            let _ = c.store(&key(6));
            swept.set();
        })
    };
    let tb = readers(&pool, variant, &swept);
    for t in [ta, tc].into_iter().chain(tb) {
        t.join().unwrap();
    }
    Pool::check_quiescent(&pool, &[A]);
}

/// Scenario 2: A dead after rank 0's bit; S1 dies at `stop`; S2 finishes.
fn sweeper_dies(stop: SweepStep, variant: Variant) {
    let pool = Pool::new(geometry(), Options { extra_processes: 2, ..Options::default() });
    join_all(&pool);
    let a = Engine::new(&pool, A, variant);
    assert!(matches!(Engine::new(&pool, C, variant).store(&k0()), Stored::Published { .. }));
    a_until(&a, Death::AfterRank0);
    a.die();
    let (s1, s1_me) = Pool::sweeper(&pool, 0, variant);
    let (s2, s2_me) = Pool::sweeper(&pool, 1, variant);
    let (s1_dead, swept) = (Arc::new(Flag::default()), Arc::new(Flag::default()));
    let t1 = {
        let (pool, s1_dead) = (pool.clone(), s1_dead.clone());
        thread::spawn(move || {
            let swept = s1.sweep_engine(A, &s1_me, &mut |s| s != stop).expect("sweep");
            assert_eq!(swept, Swept::Stopped, "the first sweeper stops at {stop:?}");
            pool.words.kill(s1_me.pid);
            s1_dead.set();
        })
    };
    let t2 = {
        let swept = swept.clone();
        thread::spawn(move || {
            s1_dead.wait();
            let freed = s2.sweep_dead(&s2_me, &mut |_| true).expect("sweep");
            assert_eq!(freed, vec![A], "the second sweeper frees the dead engine's entry");
            swept.set();
        })
    };
    let tb = readers(&pool, variant, &swept);
    for t in [t1, t2].into_iter().chain(tb) {
        t.join().unwrap();
    }
    Pool::check_quiescent(&pool, &[A]);
}

/// Full bound 3, 2 in ci/test; the negatives at 2.
const BOUND: Bounds = Bounds { property: "PL4", threads: 4, preemptions: 3, ci: None }.ci_at(2);
const N: Bounds = Bounds { property: "N43", threads: 4, preemptions: 2, ci: None };

models! {
    pl4_engine_dies_after_its_claim:
        check("pl4_after_claim", BOUND, || scenario(Death::AfterClaim, Variant::Production, false));
    pl4_engine_dies_after_rank_0s_bit:
        check("pl4_after_rank0", BOUND, || scenario(Death::AfterRank0, Variant::Production, false));
    pl4_engine_dies_holding:
        check("pl4_holding", BOUND, || scenario(Death::Holding, Variant::Production, false));
    pl4_engine_dies_mid_release:
        check("pl4_mid_release", BOUND, || scenario(Death::MidRelease, Variant::Production, false));
    pl4_sweeper_dies_after_taking_the_entry:
        check("pl4_sweeper_taken", BOUND, || sweeper_dies(SweepStep::Taken, Variant::Production));
    pl4_sweeper_dies_after_sealing:
        check("pl4_sweeper_sealed", BOUND, || sweeper_dies(SweepStep::Sealed, Variant::Production));
    pl4_sweeper_dies_after_a_slot:
        check("pl4_sweeper_slot", BOUND, || sweeper_dies(SweepStep::Slot(0), Variant::Production));
    pl4_sweeper_dies_after_clearing:
        check("pl4_sweeper_cleared", BOUND, || sweeper_dies(SweepStep::Cleared, Variant::Production));
    negative_n43_pl4_reclaim_publishes:
        negative("n43_reclaim_publishes", N, "served half-written",
            || scenario(Death::AfterRank0, Variant::ReclaimPublishes, false));
    negative_n44_pl4_sweep_stores:
        negative("n44_sweep_stores", Bounds { property: "N44", ..N }, "lost a live engine's hold",
            || scenario(Death::Holding, Variant::SweepStores, false));
    negative_n48_pl4_oracle_says_a_live_engine_is_gone:
        negative("n48_lying_oracle", Bounds { property: "N48", ..N },
            "overwritten while held",
            || scenario(Death::Holding, Variant::Production, true));
    #[cfg(shuttle)]
    pl4_shuttle_random_kills:
        check("pl4_random_kills", Bounds { property: "PL4", threads: 6, preemptions: 0, ci: None },
            random_kills::run);
}

/// The design's shuttle size (docs/node-pool-design.md 4): 4 engines of 3
/// ranks, 2 sets of 4 ways, 24 keys; each engine, and the sweeper, killed
/// at a random step with probability 1/4 (shuttle's random numbers, so a
/// schedule's replay kills the same ones at the same steps).
#[cfg(shuttle)]
mod random_kills {
    use super::*;
    use shuttle::rand::{thread_rng, RngCore};

    const ENGINES: u8 = 4;
    const RANKS: u8 = 3;
    const KEYS: u8 = 24;
    /// Keys each engine stores then loads: 8 of the 24, overlapping its
    /// neighbours'.
    const MINE: u8 = 8;
    /// An engine's steps: per key a claim, and per rank a write and a
    /// completion; per key a lookup and a read.
    const STEPS: u64 = MINE as u64 * (1 + 2 * RANKS as u64) + 2 * MINE as u64;

    /// `Some(step)` with probability 1/4: where a process dies.
    fn death(steps: u64) -> Option<u64> {
        let mut rng = thread_rng();
        (rng.next_u64() % 4 == 0).then(|| rng.next_u64() % steps)
    }

    fn engine_run(e: &Engine) -> bool {
        let die_at = death(STEPS);
        let mut step = 0;
        let mut live = || {
            step += 1;
            Some(step - 1) != die_at
        };
        let keys: Vec<Key> = (0..MINE).map(|i| key((e.index * 6 + i) % KEYS)).collect();
        for k in &keys {
            if !live() {
                return false;
            }
            if let Placement::Claimed { slot, epoch, .. } = e.claim(k) {
                for r in 0..RANKS {
                    if !live() {
                        return false;
                    }
                    e.write_rank(k, slot, epoch, r);
                    if !live() {
                        return false;
                    }
                    e.complete(slot, epoch, r);
                }
            }
        }
        for k in &keys {
            if !live() {
                return false;
            }
            if let Some((slot, epoch)) = e.lookup(k) {
                if !live() {
                    return false;
                }
                e.read(k, slot, epoch);
                e.release(slot, epoch);
            }
        }
        true
    }

    pub fn run() {
        let g = Geometry { slots: 8, ways: 4, ranks: RANKS, engines: ENGINES };
        let pool = Pool::new(g, Options { extra_processes: 2, ..Options::default() });
        join_all(&pool);
        let engines: Vec<_> = (0..ENGINES)
            .map(|e| {
                let eng = Engine::new(&pool, e, Variant::Production);
                thread::spawn(move || {
                    let lived = engine_run(&eng);
                    if !lived {
                        eng.die();
                    }
                    (eng.index, lived)
                })
            })
            .collect();
        let (sweeper, me) = Pool::sweeper(&pool, 0, Variant::Production);
        let sweeps = {
            let pool = pool.clone();
            thread::spawn(move || {
                // Three rounds over the entries (`sweep_dead`, entry by
                // entry, so that a sweeper stopped at a step of one entry
                // touches no other); a death at a random step of them.
                let die_at = death(3 * 12);
                let mut step = 0;
                for _ in 0..3 {
                    for entry in 0..ENGINES {
                        let swept = sweeper
                            .sweep_engine(entry, &me, &mut |_| {
                                step += 1;
                                Some(step - 1) != die_at
                            })
                            .expect("sweep");
                        if swept == Swept::Stopped {
                            pool.words.kill(me.pid);
                            return;
                        }
                    }
                    thread::yield_now();
                }
            })
        };
        let dead: Vec<u8> =
            engines.into_iter().map(|t| t.join().unwrap()).filter(|&(_, lived)| !lived).map(|(e, _)| e).collect();
        sweeps.join().unwrap();
        // A living process sweeps what is left; then every key is storable
        // and loadable.
        let (last, me) = Pool::sweeper(&pool, 1, Variant::Production);
        last.sweep_dead(&me, &mut |_| true).expect("sweep");
        Pool::check_quiescent(&pool, &dead);
        let e = Engine::new(&pool, 0, Variant::Production);
        for b in 0..KEYS {
            let k = key(b);
            let s = e.store(&k);
            assert!(s != Stored::Skipped, "{k:?} skipped after the sweeps");
            assert!(e.load(&k), "{k:?} not loadable right after its store ({s:?})");
        }
    }
}
