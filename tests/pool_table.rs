//! The node pool's protocol (src/pool/table.rs, src/pool/sweep.rs) driven
//! by random sequences of engine operations, one at a time, against a
//! reference model of the slots; then the joins, leaves and sweeps of the
//! engine table. Concurrency is the models' (model/pl*.rs); this checks
//! what each step must do.
//!
//! After every step the table's words equal the model's (state, key,
//! writer, ranks done, holders) and `PoolTable::check` holds. The
//! properties each step states: a lookup hits exactly a readable key of
//! its set, and holds it; a claim takes a free slot of the key's set when
//! there is one, else evicts a readable slot no engine holds, else skips;
//! it never takes a held or written slot; a slot is readable only after
//! every rank's completion; a killed engine's marks are gone after a sweep
//! and every other engine's stay.

#![cfg(not(any(loom, shuttle)))]

use std::collections::BTreeMap;

use kvoffload::internal::pool::engines::{OwnerState, OwnerWord};
use kvoffload::internal::pool::slot::{SlotState, SlotWord};
use kvoffload::internal::pool::sweep::{JoinError, Lease, SweepStep, Swept};
use kvoffload::internal::pool::table::{Lookup, Placement, PoolTable};
use kvoffload::internal::pool::words::{Geometry, Key, LocalPoolWords, Member, PoolWords};
use proptest::prelude::*;

const RANKS: u8 = 2;
const ENGINES: usize = 3;
const SETS: u32 = 2;
const WAYS: u32 = 3;
const KEYS: u8 = 10;

fn key(k: u8) -> Key {
    Key::new(&[k, 0xA5, k], 0).unwrap()
}

#[derive(Clone, Debug, PartialEq)]
enum Model {
    Free,
    Writing { engine: u8, key: u8, done: u32 },
    Readable { key: u8, holders: BTreeMap<u8, u32> },
}

#[derive(Clone, Debug)]
enum Op {
    Lookup(usize, u8),
    Claim(usize, u8),
    Complete(usize, usize, u8),
    Abandon(usize, usize),
    Release(usize, usize),
    Touch(usize),
    Kill(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let e = 0..ENGINES;
    prop_oneof![
        4 => (e.clone(), 0..KEYS).prop_map(|(e, k)| Op::Lookup(e, k)),
        4 => (e.clone(), 0..KEYS).prop_map(|(e, k)| Op::Claim(e, k)),
        4 => (e.clone(), 0..8usize, 0..RANKS).prop_map(|(e, i, r)| Op::Complete(e, i, r)),
        1 => (e.clone(), 0..8usize).prop_map(|(e, i)| Op::Abandon(e, i)),
        3 => (e.clone(), 0..8usize).prop_map(|(e, i)| Op::Release(e, i)),
        1 => (0..(SETS * WAYS) as usize).prop_map(Op::Touch),
        1 => e.prop_map(Op::Kill),
    ]
}

/// One engine: its lease, pids (owner = rank 0's worker, rank 1's, the
/// scheduler), its writes in flight and its holds (slot, epoch).
struct Engine {
    lease: Lease,
    pids: [u32; 3],
    writes: Vec<(u32, u32)>,
    holds: Vec<(u32, u32)>,
}

struct World {
    table: PoolTable<LocalPoolWords>,
    model: Vec<Model>,
    engines: Vec<Engine>,
    next_pid: u32,
    sweeper: Member,
}

const ID: fn(usize, u32) -> [u64; 4] = |e, gen| [e as u64, u64::from(gen), 7, 7];

impl World {
    fn new() -> World {
        let g = Geometry { slots: SETS * WAYS, ways: WAYS, ranks: RANKS, engines: ENGINES as u8 + 1 };
        let table = PoolTable::new(LocalPoolWords::new(g, 400));
        let sweeper = LocalPoolWords::process(1);
        let mut w =
            World { table, model: vec![Model::Free; (SETS * WAYS) as usize], engines: vec![], next_pid: 2, sweeper };
        for e in 0..ENGINES {
            let eng = w.join(e);
            w.engines.push(eng);
        }
        w
    }

    fn join(&mut self, e: usize) -> Engine {
        let pids = [self.next_pid, self.next_pid + 1, self.next_pid + 2];
        self.next_pid += 3;
        let id = ID(e, pids[0]);
        let owner = LocalPoolWords::process(pids[0]);
        let lease = self.table.join_owner(1, &owner, &id).expect("an entry is free");
        let r1 = self.table.join_member(2, &LocalPoolWords::process(pids[1]), &id).unwrap();
        let s = self.table.join_member(0, &LocalPoolWords::process(pids[2]), &id).unwrap();
        assert_eq!((r1, s), (Some(lease), Some(lease)));
        Engine { lease, pids, writes: vec![], holds: vec![] }
    }

    fn idx(&self, e: usize) -> u8 {
        self.engines[e].lease.engine
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Lookup(e, k) => self.lookup(e, k),
            Op::Claim(e, k) => self.claim(e, k),
            Op::Complete(e, i, r) => self.complete(e, i, r),
            Op::Abandon(e, i) => self.abandon(e, i),
            Op::Release(e, i) => self.release(e, i),
            Op::Touch(s) => self.table.touch(s as u32),
            Op::Kill(e) => self.kill(e),
        }
        self.compare();
    }

    /// The key's two sets, first then second (one where both are one).
    fn sets(k: u8) -> Vec<usize> {
        let [a, b] = key(k).sets(SETS).map(|s| s as usize);
        if a == b {
            vec![a]
        } else {
            vec![a, b]
        }
    }

    /// The slots of the key's sets, in the order the table scans them.
    fn set_slots(k: u8) -> impl Iterator<Item = usize> + Clone {
        let ways = WAYS as usize;
        Self::sets(k).into_iter().flat_map(move |set| set * ways..(set + 1) * ways)
    }

    fn lookup(&mut self, e: usize, k: u8) {
        let me = self.idx(e);
        let got = self.table.lookup(me, &key(k)).unwrap();
        let readable = Self::set_slots(k).find(|&s| matches!(&self.model[s], Model::Readable { key, .. } if *key == k));
        let pending = Self::set_slots(k)
            .any(|s| matches!(&self.model[s], Model::Writing { engine, key, .. } if *key == k && *engine == me));
        match (got, readable) {
            (Lookup::Hit { slot, epoch, fresh }, Some(s)) => {
                assert_eq!(slot as usize, s, "hit in another slot than the key's");
                let Model::Readable { holders, .. } = &mut self.model[s] else { unreachable!() };
                let count = holders.entry(me).or_insert(0);
                assert_eq!(fresh, *count == 0, "fresh exactly when the engine held it not");
                *count += 1;
                self.engines[e].holds.push((slot, epoch));
            }
            (Lookup::Pending, None) => assert!(pending, "pending without this engine writing the key"),
            (Lookup::Miss, None) => assert!(!pending, "a miss for the engine's own write"),
            (got, model) => panic!("lookup of {k} by {me}: {got:?}, the model's readable slot {model:?}"),
        }
    }

    fn claim(&mut self, e: usize, k: u8) {
        let me = self.idx(e);
        let before = self.model.clone();
        let got = self.table.claim(me, &key(k)).unwrap();
        let slots = Self::set_slots(k);
        let present = slots.clone().any(|s| match &before[s] {
            Model::Writing { key, .. } | Model::Readable { key, .. } => *key == k,
            Model::Free => false,
        });
        let free = slots.clone().any(|s| before[s] == Model::Free);
        let victim = |s: usize| matches!(&before[s], Model::Readable { holders, .. } if holders.is_empty());
        let evictable = slots.clone().any(victim);
        match got {
            Placement::Present => assert!(present, "present for an absent key"),
            Placement::Skipped => {
                assert!(!present && !free && !evictable, "skipped with a claimable slot: {before:?}")
            }
            Placement::Claimed { slot, epoch, evicted } => {
                let s = slot as usize;
                assert!(
                    !present && slots.clone().any(|x| x == s),
                    "claimed slot {s} outside the sets or a present key"
                );
                match (&before[s], evicted) {
                    (Model::Free, None) => {
                        // In the emptier of the two sets (the first on a tie).
                        let ways = WAYS as usize;
                        let free_in =
                            |set: usize| (set * ways..(set + 1) * ways).filter(|&x| before[x] == Model::Free).count();
                        let sets = Self::sets(k);
                        let want = match sets[..] {
                            [a, b] if free_in(b) > free_in(a) => b,
                            _ => sets[0],
                        };
                        assert_eq!(s / ways, want, "a free slot claimed in the fuller set: {before:?}");
                    }
                    (Model::Readable { key: old, holders }, Some(ev)) => {
                        assert!(!free, "evicted with a free slot in the set");
                        assert!(holders.is_empty(), "evicted a held slot");
                        assert_eq!(ev, key(*old));
                    }
                    (m, ev) => panic!("claimed {m:?} reporting eviction {ev:?}"),
                }
                self.model[s] = Model::Writing { engine: me, key: k, done: 0 };
                self.engines[e].writes.push((slot, epoch));
            }
        }
    }

    fn complete(&mut self, e: usize, i: usize, r: u8) {
        let me = self.idx(e);
        let Some(&(slot, epoch)) = self.engines[e].writes.get(i % self.engines[e].writes.len().max(1)) else { return };
        let s = slot as usize;
        let got = self.table.complete_rank(me, slot, epoch, r);
        match &mut self.model[s] {
            Model::Writing { engine, key, done } if *engine == me && *done & (1 << r) == 0 => {
                let published = got.expect("a rank of the writer completes");
                *done |= 1 << r;
                assert_eq!(published, *done == (1 << RANKS) - 1, "published before every rank, or not at the last");
                if published {
                    let k = *key;
                    self.model[s] = Model::Readable { key: k, holders: BTreeMap::new() };
                    self.engines[e].writes.retain(|w| *w != (slot, epoch));
                }
            }
            m => assert!(got.is_err(), "completion on {m:?} applied"),
        }
    }

    fn abandon(&mut self, e: usize, i: usize) {
        let me = self.idx(e);
        let Some(&(slot, epoch)) = self.engines[e].writes.get(i % self.engines[e].writes.len().max(1)) else { return };
        let got = self.table.abandon(me, slot, epoch).expect("the writer abandons its write");
        assert!(got);
        self.model[slot as usize] = Model::Free;
        self.engines[e].writes.retain(|w| *w != (slot, epoch));
    }

    fn release(&mut self, e: usize, i: usize) {
        let me = self.idx(e);
        let n = self.engines[e].holds.len();
        if n == 0 {
            return;
        }
        let (slot, epoch) = self.engines[e].holds.remove(i % n);
        let Model::Readable { holders, .. } = &mut self.model[slot as usize] else {
            panic!("a hold on a slot not readable")
        };
        let count = holders.get_mut(&me).expect("the model holds it");
        *count -= 1;
        if *count == 0 {
            holders.remove(&me);
            self.table.release(me, slot, epoch).unwrap();
        } else {
            // Only the private count moves; the word keeps the bit.
            self.table.check_held(me, slot, epoch).unwrap();
        }
    }

    fn kill(&mut self, e: usize) {
        let me = self.idx(e);
        for pid in self.engines[e].pids {
            self.table.words().kill(pid);
        }
        let swept = self.table.sweep_dead(&self.sweeper, &mut |_| true).unwrap();
        assert_eq!(swept, vec![me], "exactly the dead engine is swept");
        for m in &mut self.model {
            match m {
                Model::Writing { engine, .. } if *engine == me => *m = Model::Free,
                Model::Readable { holders, .. } => {
                    holders.remove(&me);
                }
                _ => {}
            }
        }
        let eng = self.join(e);
        self.engines[e] = eng;
    }

    fn compare(&self) {
        self.table.check().unwrap();
        let words = self.table.words();
        for (s, m) in self.model.iter().enumerate() {
            let w = SlotWord::decode(words.slot_load(s));
            match m {
                Model::Free => assert_eq!(w.state(), SlotState::Free, "slot {s}"),
                Model::Writing { engine, key: k, done } => {
                    assert_eq!((w.state(), w.engine(), w.payload()), (SlotState::Writing, *engine, *done), "slot {s}");
                    assert_eq!(words.key_load(s), key(*k));
                }
                Model::Readable { key: k, holders } => {
                    let mask = holders.keys().fold(0u32, |m, e| m | 1 << e);
                    assert_eq!((w.state(), w.payload()), (SlotState::Readable, mask), "slot {s}");
                    assert_eq!(words.key_load(s), key(*k));
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_table_follows_its_model(ops in prop::collection::vec(op(), 1..120)) {
        let mut w = World::new();
        for op in &ops {
            w.apply(op);
        }
    }
}

#[test]
fn a_full_set_of_held_slots_skips_and_a_released_one_is_evicted() {
    let mut w = World::new();
    // Keys both of whose sets are set 0: three fill it (3 ways), each
    // published and held by engine 0; set 1 stays empty.
    let ks: Vec<u8> = (0..=u8::MAX).filter(|&k| key(k).sets(SETS) == [0, 0]).take(4).collect();
    for &k in &ks[..3] {
        w.apply(&Op::Claim(1, k));
        w.apply(&Op::Complete(1, 0, 0));
        w.apply(&Op::Complete(1, 0, 1));
        w.apply(&Op::Lookup(0, k));
    }
    assert_eq!(w.table.claim(w.idx(2), &key(ks[3])).unwrap(), Placement::Skipped);
    // Released, with the CLOCK bits the lookups set: the second pass takes it.
    w.apply(&Op::Release(0, 0));
    let got = w.table.claim(w.idx(2), &key(ks[3])).unwrap();
    assert!(matches!(got, Placement::Claimed { evicted: Some(k), .. } if k == key(ks[0])), "{got:?}");
}

/// Two-choice hashing (design 2.3): keys whose first set is full go to
/// their second set while it has room, without evicting; a key is found
/// in either set. The pool before it (its first set only: N49's rule)
/// evicted the first set's keys here.
#[test]
fn a_key_whose_first_set_is_full_goes_to_its_second_without_evicting() {
    let mut w = World::new();
    let ks: Vec<u8> = (0..=u8::MAX).filter(|&k| key(k).sets(SETS) == [0, 1]).take(2 * WAYS as usize).collect();
    for &k in &ks {
        w.apply(&Op::Claim(1, k));
        w.apply(&Op::Complete(1, 0, 0));
        w.apply(&Op::Complete(1, 0, 1));
    }
    let c = w.table.census();
    assert_eq!((c.readable, c.free), (2 * WAYS, 0), "every key stored, none evicted");
    for &k in &ks {
        assert!(matches!(w.table.lookup(w.idx(0), &key(k)).unwrap(), Lookup::Hit { .. }), "key {k} lost");
    }
    w.table.check().unwrap();
}

/// The negative of the model comparison: a claim that evicts a held slot
/// (the word rewritten behind the table's back) is reported by `compare`.
#[test]
#[should_panic(expected = "slot")]
fn the_comparison_catches_a_held_slot_overwritten() {
    let mut w = World::new();
    w.apply(&Op::Claim(1, 0));
    w.apply(&Op::Complete(1, 0, 0));
    w.apply(&Op::Complete(1, 0, 1));
    w.apply(&Op::Lookup(0, 0));
    let s = World::set_slots(0).find(|&s| w.model[s] != Model::Free).unwrap();
    let cur = w.table.words().slot_load(s);
    let bad = SlotWord::writing(2, SlotWord::decode(cur).epoch() + 1, 0);
    w.table.words().slot_cas(s, cur, bad.encode()).unwrap();
    w.compare();
}

#[test]
fn a_33rd_engine_is_refused_naming_the_live_ones() {
    let g = Geometry { slots: 4, ways: 4, ranks: 1, engines: 2 };
    let t = PoolTable::new(LocalPoolWords::new(g, 8));
    for pid in [1, 2] {
        t.join_owner(1, &LocalPoolWords::process(pid), &[pid.into(), 0, 0, 0]).unwrap();
    }
    let err = t.join_owner(1, &LocalPoolWords::process(3), &[3, 0, 0, 0]).unwrap_err();
    assert_eq!(err, JoinError::EnginesFull { entries: 2, owners: vec![1, 2] });
    // One owner dies: its entry is swept at the next join and reused.
    t.words().kill(1);
    let lease = t.join_owner(1, &LocalPoolWords::process(3), &[3, 0, 0, 0]).unwrap();
    assert_eq!(lease.engine, 0);
}

#[test]
fn an_entry_with_one_live_member_is_not_swept() {
    let g = Geometry { slots: 4, ways: 4, ranks: 2, engines: 2 };
    let t = PoolTable::new(LocalPoolWords::new(g, 8));
    let id = [9, 9, 9, 9];
    let lease = t.join_owner(1, &LocalPoolWords::process(1), &id).unwrap();
    t.join_member(2, &LocalPoolWords::process(2), &id).unwrap().unwrap();
    let k = Key::new(&[4], 0).unwrap();
    let Placement::Claimed { slot, epoch, .. } = t.claim(lease.engine, &k).unwrap() else { panic!() };
    t.words().kill(1);
    let me = LocalPoolWords::process(5);
    assert_eq!(t.sweep_engine(lease.engine, &me, &mut |_| true).unwrap(), Swept::NotDead);
    t.check_writing(lease.engine, slot, epoch).unwrap();
    assert_eq!(OwnerWord::decode(t.words().owner_load(lease.engine)).state, OwnerState::Live);
    t.words().kill(2);
    assert_eq!(t.sweep_engine(lease.engine, &me, &mut |_| true).unwrap(), Swept::Freed);
    assert_eq!(SlotWord::decode(t.words().slot_load(slot as usize)).state(), SlotState::Free);
}

#[test]
fn a_sweep_cut_at_any_step_is_finished_by_the_next_sweeper() {
    for stop_at in 0..8 {
        let g = Geometry { slots: 4, ways: 4, ranks: 2, engines: 2 };
        let t = PoolTable::new(LocalPoolWords::new(g, 8));
        let (a, b) = ([1, 0, 0, 0], [2, 0, 0, 0]);
        let la = t.join_owner(1, &LocalPoolWords::process(1), &a).unwrap();
        let lb = t.join_owner(1, &LocalPoolWords::process(2), &b).unwrap();
        let (k1, k2) = (Key::new(&[1], 0).unwrap(), Key::new(&[2], 0).unwrap());
        // B publishes k1; A and B hold it; A writes k2 half-way.
        let Placement::Claimed { slot: s1, epoch: e1, .. } = t.claim(lb.engine, &k1).unwrap() else { panic!() };
        t.complete_rank(lb.engine, s1, e1, 0).unwrap();
        assert!(t.complete_rank(lb.engine, s1, e1, 1).unwrap());
        assert!(matches!(t.lookup(la.engine, &k1).unwrap(), Lookup::Hit { .. }));
        assert!(matches!(t.lookup(lb.engine, &k1).unwrap(), Lookup::Hit { .. }));
        let Placement::Claimed { slot: s2, epoch: e2, .. } = t.claim(la.engine, &k2).unwrap() else { panic!() };
        t.complete_rank(la.engine, s2, e2, 0).unwrap();
        t.words().kill(1);
        // Sweeper 3 dies after `stop_at` steps; sweeper 4 takes over.
        let mut n = 0;
        let first = t.sweep_engine(la.engine, &LocalPoolWords::process(3), &mut |_: SweepStep| {
            n += 1;
            n <= stop_at
        });
        if first.unwrap() == Swept::Stopped {
            t.words().kill(3);
        }
        t.sweep_dead(&LocalPoolWords::process(4), &mut |_| true).unwrap();
        assert_eq!(OwnerWord::decode(t.words().owner_load(la.engine)).state, OwnerState::Free, "stop at {stop_at}");
        assert_eq!(SlotWord::decode(t.words().slot_load(s2 as usize)).state(), SlotState::Free, "half-written freed");
        let w1 = SlotWord::decode(t.words().slot_load(s1 as usize));
        assert_eq!((w1.state(), w1.payload()), (SlotState::Readable, 1 << lb.engine), "B's hold kept, A's gone");
        assert_eq!(t.lookup(lb.engine, &k2).unwrap(), Lookup::Miss, "nothing half-written served");
        t.check().unwrap();
    }
}
