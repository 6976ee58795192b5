//! State-machine test of the block manager against a plain reference model.
//!
//! proptest-state-machine generates random sequences of every operation
//! (lookup, touch, prepare/complete store, a store prepared and undone,
//! prepare/complete load, reset),
//! well-formed ones and misuse alike, on a small manager (1 - 8 slots, 16
//! keys) so that eviction, pinning and capacity errors happen often. The
//! reference model keeps everything in `Vec`s and picks victims by linear
//! scans; after every step the test compares every answer (lookups, slots,
//! evictions, skips, errors, events, counters) and checks the invariants:
//! no slot owned twice, no evicted block that was pending or being read,
//! pending blocks never readable, capacity never exceeded
//! (`BlockManager::check_invariants` plus the comparison with the model).
//!
//! `MANAGER_SM_CASES` overrides the number of sequences per policy.

use std::collections::HashMap;
use std::marker::PhantomData;

mod policy_common;
use policy_common::{Arc, Lru, Policy};

use kvoffload::internal::manager::{BlockManager, ManagerConfig, ManagerEvent, PrepareStoreOutput, SlotId};
use kvoffload::{BlockKey, BlockState, Lookup, ManagerError, PolicyKind, SkipReason, Skipped};
use proptest::prelude::*;
use proptest::sample::subsequence;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

// ---------------------------------------------------------------- model --

/// One stored block in the model.
#[derive(Clone, Debug)]
struct MBlock {
    key: BlockKey,
    pending: bool,
    readers: u32,
}

impl MBlock {
    fn state(&self) -> BlockState {
        if self.pending {
            BlockState::WritePending
        } else {
            BlockState::Ready { readers: self.readers }
        }
    }

    fn evictable(&self) -> bool {
        !self.pending && self.readers == 0
    }
}

/// What the model expects the last operation to return.
#[derive(Clone, Debug, PartialEq)]
enum Expected {
    Nothing,
    Lookup(Vec<Lookup>),
    Store(Result<StoreOutcome, ManagerError>),
    Load(Result<Vec<BlockKey>, ManagerError>),
    Unit(Result<(), ManagerError>),
}

/// prepare_store's answer without slots (the model does not pick slots).
#[derive(Clone, Debug, PartialEq)]
struct StoreOutcome {
    to_store: Vec<BlockKey>,
    evicted: Vec<BlockKey>,
    skipped: Vec<Skipped>,
}

/// Event kinds, for comparison without slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Stored,
    Evicted,
    Removed,
}

#[derive(Clone, Debug)]
struct Model {
    capacity: usize,
    policy: PolicyKind,
    threshold: u32,
    tracking_limit: usize,
    blocks: Vec<MBlock>,
    /// LRU order, least recent first.
    lru: Vec<BlockKey>,
    /// ARC lists, least recent first, and the target.
    t1: Vec<BlockKey>,
    t2: Vec<BlockKey>,
    b1: Vec<BlockKey>,
    b2: Vec<BlockKey>,
    p: usize,
    /// Threshold miss counts, least recently missed first.
    misses: Vec<(BlockKey, u32)>,
    last: Expected,
    last_events: Vec<(Ev, BlockKey)>,
    errors: u64,
}

fn remove_key(list: &mut Vec<BlockKey>, key: BlockKey) -> bool {
    match list.iter().position(|k| *k == key) {
        Some(i) => {
            list.remove(i);
            true
        }
        None => false,
    }
}

fn first_duplicate(keys: &[BlockKey]) -> Result<(), ManagerError> {
    for (second, key) in keys.iter().enumerate() {
        if let Some(first) = keys[..second].iter().position(|k| k == key) {
            return Err(ManagerError::DuplicateKey { key: *key, first, second });
        }
    }
    Ok(())
}

impl Model {
    fn new(capacity: usize, policy: PolicyKind, threshold: u32, tracking_limit: usize) -> Self {
        Self {
            capacity,
            policy,
            threshold,
            tracking_limit,
            blocks: Vec::new(),
            lru: Vec::new(),
            t1: Vec::new(),
            t2: Vec::new(),
            b1: Vec::new(),
            b2: Vec::new(),
            p: 0,
            misses: Vec::new(),
            last: Expected::Nothing,
            last_events: Vec::new(),
            errors: 0,
        }
    }

    fn config(&self) -> ManagerConfig {
        ManagerConfig {
            capacity: self.capacity,
            policy: self.policy,
            store_threshold: self.threshold,
            lookup_tracking_limit: self.tracking_limit,
            record_events: true,
        }
    }

    fn block(&self, key: BlockKey) -> Option<&MBlock> {
        self.blocks.iter().find(|b| b.key == key)
    }

    fn block_mut(&mut self, key: BlockKey) -> Option<&mut MBlock> {
        self.blocks.iter_mut().find(|b| b.key == key)
    }

    fn evictable(&self, key: BlockKey) -> bool {
        self.block(key).is_some_and(MBlock::evictable)
    }

    fn keys_where(&self, f: impl Fn(&MBlock) -> bool) -> Vec<BlockKey> {
        self.blocks.iter().filter(|b| f(b)).map(|b| b.key).collect()
    }

    fn misses_of(&self, key: BlockKey) -> u32 {
        self.misses.iter().find(|(k, _)| *k == key).map_or(0, |(_, n)| *n)
    }

    fn fail<T>(&mut self, e: ManagerError) -> Result<T, ManagerError> {
        self.errors += 1;
        Err(e)
    }

    // -- policy, the slow and obvious way --

    fn policy_insert(&mut self, key: BlockKey) {
        match self.policy {
            PolicyKind::Lru => self.lru.push(key),
            PolicyKind::Arc => {
                if self.b1.contains(&key) {
                    let delta = (self.b2.len() / self.b1.len()).max(1);
                    self.p = (self.p + delta).min(self.capacity);
                    remove_key(&mut self.b1, key);
                    self.t2.push(key);
                } else if self.b2.contains(&key) {
                    let delta = (self.b1.len() / self.b2.len()).max(1);
                    self.p = self.p.saturating_sub(delta);
                    remove_key(&mut self.b2, key);
                    self.t2.push(key);
                } else {
                    self.t1.push(key);
                }
                self.trim_ghosts();
            }
        }
    }

    fn policy_touch(&mut self, key: BlockKey, ready: bool) {
        match self.policy {
            PolicyKind::Lru => {
                remove_key(&mut self.lru, key);
                self.lru.push(key);
            }
            PolicyKind::Arc => {
                if remove_key(&mut self.t1, key) {
                    if ready {
                        self.t2.push(key)
                    } else {
                        self.t1.push(key)
                    }
                } else if remove_key(&mut self.t2, key) {
                    self.t2.push(key);
                }
            }
        }
    }

    fn policy_remove(&mut self, key: BlockKey) {
        remove_key(&mut self.lru, key);
        remove_key(&mut self.t1, key);
        remove_key(&mut self.t2, key);
    }

    /// The victim among the evictable blocks not in `protect` (the keys of
    /// the batch being stored).
    fn policy_evict(&mut self, protect: &[BlockKey]) -> Option<BlockKey> {
        let first_evictable =
            |m: &Model, list: &[BlockKey]| list.iter().copied().find(|k| m.evictable(*k) && !protect.contains(k));
        match self.policy {
            PolicyKind::Lru => {
                let key = first_evictable(self, &self.lru)?;
                remove_key(&mut self.lru, key);
                Some(key)
            }
            PolicyKind::Arc => {
                let c1 = first_evictable(self, &self.t1);
                let c2 = first_evictable(self, &self.t2);
                let key = match (c1, c2) {
                    (Some(k), _) if self.t1.len() > self.p || c2.is_none() => {
                        remove_key(&mut self.t1, k);
                        self.b1.push(k);
                        k
                    }
                    (_, Some(k)) => {
                        remove_key(&mut self.t2, k);
                        self.b2.push(k);
                        k
                    }
                    _ => return None,
                };
                self.trim_ghosts();
                Some(key)
            }
        }
    }

    fn trim_ghosts(&mut self) {
        let c = self.capacity;
        while self.t1.len() + self.b1.len() > c && !self.b1.is_empty() {
            self.b1.remove(0);
        }
        while self.t1.len() + self.t2.len() + self.b1.len() + self.b2.len() > 2 * c {
            if !self.b2.is_empty() {
                self.b2.remove(0);
            } else if !self.b1.is_empty() {
                self.b1.remove(0);
            } else {
                break;
            }
        }
    }

    // -- operations --

    fn lookup(&mut self, keys: &[BlockKey]) -> Vec<Lookup> {
        let mut out = Vec::new();
        for &key in keys {
            out.push(match self.block(key) {
                Some(b) if b.pending => Lookup::HitPending,
                Some(_) => Lookup::Hit,
                None => {
                    if self.threshold > 0 {
                        let n = self.misses_of(key).saturating_add(1);
                        self.misses.retain(|(k, _)| *k != key);
                        self.misses.push((key, n));
                        if self.misses.len() > self.tracking_limit {
                            self.misses.remove(0);
                        }
                    }
                    Lookup::Miss
                }
            });
        }
        out
    }

    fn touch(&mut self, keys: &[BlockKey]) {
        for &key in keys.iter().rev() {
            if let Some(b) = self.block(key) {
                let ready = !b.pending;
                self.policy_touch(key, ready);
            }
        }
    }

    fn prepare_store(&mut self, keys: &[BlockKey]) -> Result<StoreOutcome, ManagerError> {
        if let Err(e) = first_duplicate(keys) {
            return self.fail(e);
        }
        let mut out = StoreOutcome { to_store: vec![], evicted: vec![], skipped: vec![] };
        for &key in keys {
            let reason = match self.block(key) {
                Some(b) if b.pending => SkipReason::StorePending,
                Some(_) => SkipReason::AlreadyStored,
                None if self.misses_of(key) < self.threshold => {
                    SkipReason::BelowThreshold { misses: self.misses_of(key), threshold: self.threshold }
                }
                None => {
                    out.to_store.push(key);
                    continue;
                }
            };
            out.skipped.push(Skipped { key, reason });
        }
        let free = self.capacity - self.blocks.len();
        // A key the batch skips as stored is never its victim.
        let evictable = self.blocks.iter().filter(|b| b.evictable() && !keys.contains(&b.key)).count();
        let need = out.to_store.len().saturating_sub(free);
        if need > evictable {
            let requested = out.to_store.len();
            let capacity = self.capacity;
            return self.fail(ManagerError::InsufficientCapacity { requested, free, evictable, capacity });
        }
        for _ in 0..need {
            let victim = self.policy_evict(keys).expect("model: a candidate exists");
            self.blocks.retain(|b| b.key != victim);
            out.evicted.push(victim);
            self.last_events.push((Ev::Evicted, victim));
        }
        for &key in out.to_store.iter().rev() {
            self.blocks.push(MBlock { key, pending: true, readers: 0 });
            self.policy_insert(key);
            self.misses.retain(|(k, _)| *k != key);
        }
        Ok(out)
    }

    fn complete_store(&mut self, keys: &[BlockKey], success: bool) -> Result<(), ManagerError> {
        let check = first_duplicate(keys).and_then(|()| {
            for &key in keys {
                match self.block(key) {
                    None => return Err(ManagerError::NotFound { key }),
                    Some(b) if !b.pending => return Err(ManagerError::NotPending { key, state: b.state() }),
                    Some(_) => {}
                }
            }
            Ok(())
        });
        if let Err(e) = check {
            return self.fail(e);
        }
        for &key in keys {
            if success {
                if let Some(b) = self.block_mut(key) {
                    b.pending = false;
                }
                self.last_events.push((Ev::Stored, key));
            } else {
                self.blocks.retain(|b| b.key != key);
                self.policy_remove(key);
                self.last_events.push((Ev::Removed, key));
            }
        }
        Ok(())
    }

    /// A load's step: refuses a repeated key, a key with no block and a key
    /// whose block `refuse` objects to (all or nothing), then changes each
    /// block's readers by `step`.
    fn load_step(
        &mut self,
        keys: &[BlockKey],
        refuse: impl Fn(BlockKey, &MBlock) -> Option<ManagerError>,
        step: fn(&mut u32),
    ) -> Result<(), ManagerError> {
        let check = first_duplicate(keys).and_then(|()| {
            for &key in keys {
                match self.block(key) {
                    None => return Err(ManagerError::NotFound { key }),
                    Some(b) => {
                        if let Some(e) = refuse(key, b) {
                            return Err(e);
                        }
                    }
                }
            }
            Ok(())
        });
        if let Err(e) = check {
            return self.fail(e);
        }
        for &key in keys {
            if let Some(b) = self.block_mut(key) {
                step(&mut b.readers);
            }
        }
        Ok(())
    }

    fn prepare_load(&mut self, keys: &[BlockKey]) -> Result<Vec<BlockKey>, ManagerError> {
        self.load_step(keys, |key, b| b.pending.then_some(ManagerError::NotReadable { key }), |r| *r += 1)?;
        Ok(keys.to_vec())
    }

    fn complete_load(&mut self, keys: &[BlockKey]) -> Result<(), ManagerError> {
        self.load_step(
            keys,
            |key, b| (b.pending || b.readers == 0).then(|| ManagerError::NoLoadInFlight { key, state: b.state() }),
            |r| *r -= 1,
        )
    }

    fn reset(&mut self) -> Result<(), ManagerError> {
        let pending = self.blocks.iter().filter(|b| b.pending).count();
        let reading = self.blocks.iter().filter(|b| b.readers > 0).count();
        if pending > 0 || reading > 0 {
            return self.fail(ManagerError::Busy { pending, reading });
        }
        let keys: Vec<BlockKey> = self.blocks.iter().map(|b| b.key).collect();
        self.last_events.extend(keys.into_iter().map(|k| (Ev::Removed, k)));
        let fresh = Model::new(self.capacity, self.policy, self.threshold, self.tracking_limit);
        *self = Model { last_events: std::mem::take(&mut self.last_events), errors: self.errors, ..fresh };
        Ok(())
    }
}

// ---------------------------------------------------------- transitions --

#[derive(Clone, Debug)]
enum Op {
    Lookup(Vec<BlockKey>),
    Touch(Vec<BlockKey>),
    PrepareStore(Vec<BlockKey>),
    /// prepare_store_undoable, then undo_store at once: answers as
    /// prepare_store would, and changes nothing (policy state included).
    PrepareStoreUndone(Vec<BlockKey>),
    CompleteStore(Vec<BlockKey>, bool),
    PrepareLoad(Vec<BlockKey>),
    CompleteLoad(Vec<BlockKey>),
    Reset,
}

/// The 16 keys the test uses: 8 hashes in 2 groups.
fn all_keys() -> Vec<BlockKey> {
    (0..8u64).flat_map(|h| (0..2u32).map(move |g| BlockKey::new(h, g))).collect()
}

/// Up to 4 keys: distinct in most batches, with repeats in some (misuse).
fn any_keys() -> BoxedStrategy<Vec<BlockKey>> {
    let any_key = (0u64..8, 0u32..2).prop_map(|(h, g)| BlockKey::new(h, g));
    prop_oneof![
        6 => subsequence(all_keys(), 0..=4).prop_shuffle(),
        1 => prop::collection::vec(any_key, 2..5),
    ]
    .boxed()
}

/// Some of `keys` (at least one; `keys` must not be empty), in any order.
fn some_of(keys: Vec<BlockKey>) -> impl Strategy<Value = Vec<BlockKey>> {
    let n = keys.len();
    subsequence(keys, 1..=n).prop_shuffle()
}

struct ManagerMachine<P>(PhantomData<P>);

impl<P: Policy> ReferenceStateMachine for ManagerMachine<P> {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        let threshold = prop_oneof![3 => Just(0u32), 1 => 1u32..=2];
        (1usize..=8, threshold, 1usize..=6).prop_map(|(c, t, limit)| Model::new(c, P::KIND, t, limit)).boxed()
    }

    fn transitions(m: &Model) -> BoxedStrategy<Op> {
        let pending = m.keys_where(|b| b.pending);
        let ready = m.keys_where(|b| !b.pending);
        let reading = m.keys_where(|b| b.readers > 0);
        let mut ops: Vec<(u32, BoxedStrategy<Op>)> = vec![
            (4, any_keys().prop_map(Op::Lookup).boxed()),
            (4, any_keys().prop_map(Op::Touch).boxed()),
            (5, any_keys().prop_map(Op::PrepareStore).boxed()),
            (2, any_keys().prop_map(Op::PrepareStoreUndone).boxed()),
            // Misuse: completing or loading whatever keys.
            (1, (any_keys(), any::<bool>()).prop_map(|(k, s)| Op::CompleteStore(k, s)).boxed()),
            (1, any_keys().prop_map(Op::PrepareLoad).boxed()),
            (1, any_keys().prop_map(Op::CompleteLoad).boxed()),
            (1, Just(Op::Reset).boxed()),
        ];
        if !pending.is_empty() {
            let success = prop::bool::weighted(0.8);
            let op = (some_of(pending), success).prop_map(|(k, s)| Op::CompleteStore(k, s));
            ops.push((8, op.boxed()));
        }
        if !ready.is_empty() {
            ops.push((3, some_of(ready).prop_map(Op::PrepareLoad).boxed()));
        }
        if !reading.is_empty() {
            ops.push((5, some_of(reading).prop_map(Op::CompleteLoad).boxed()));
        }
        prop::strategy::Union::new_weighted(ops).boxed()
    }

    fn apply(mut m: Model, op: &Op) -> Model {
        m.last_events.clear();
        m.last = match op {
            Op::Lookup(keys) => Expected::Lookup(m.lookup(keys)),
            Op::Touch(keys) => {
                m.touch(keys);
                Expected::Nothing
            }
            Op::PrepareStore(keys) => Expected::Store(m.prepare_store(keys)),
            Op::PrepareStoreUndone(keys) => {
                // The answer of a store made on a copy; only a refusal
                // (counted as an error) leaves a trace.
                let mut probe = m.clone();
                let r = probe.prepare_store(keys);
                m.errors = probe.errors;
                Expected::Store(r)
            }
            Op::CompleteStore(keys, ok) => Expected::Unit(m.complete_store(keys, *ok)),
            Op::PrepareLoad(keys) => Expected::Load(m.prepare_load(keys)),
            Op::CompleteLoad(keys) => Expected::Unit(m.complete_load(keys)),
            Op::Reset => Expected::Unit(m.reset()),
        };
        m
    }
}

// ------------------------------------------------------------ the system --

/// The manager, plus what the test learned of its slots from its answers.
struct Sut {
    mgr: BlockManager,
    slots: HashMap<BlockKey, SlotId>,
    events: [u64; 3],
}

impl Sut {
    fn store(&mut self, keys: &[BlockKey]) -> Result<StoreOutcome, ManagerError> {
        let before: HashMap<BlockKey, BlockState> =
            self.slots.keys().filter_map(|k| Some((*k, self.mgr.state(k)?))).collect();
        let out: PrepareStoreOutput = self.mgr.prepare_store(keys)?;
        // The contract on its own (not only as the model says): skipped and
        // evicted are disjoint, and no key of the batch is a victim.
        for e in &out.evicted {
            assert!(!keys.contains(&e.key), "prepare_store({keys:?}) evicted its own key {}", e.key);
        }
        for e in &out.evicted {
            let state = before.get(&e.key);
            assert_eq!(state, Some(&BlockState::Ready { readers: 0 }), "evicted {} while it was {state:?}", e.key);
            assert_eq!(self.slots.remove(&e.key), Some(e.slot), "evicted {} from the wrong slot", e.key);
        }
        for p in &out.to_store {
            assert!(p.slot.index() < self.mgr.capacity(), "{} out of range", p.slot);
            assert!(!self.slots.values().any(|s| *s == p.slot), "{} given out twice", p.slot);
            self.slots.insert(p.key, p.slot);
        }
        Ok(StoreOutcome {
            to_store: out.to_store.iter().map(|p| p.key).collect(),
            evicted: out.evicted.iter().map(|p| p.key).collect(),
            skipped: out.skipped,
        })
    }

    /// A store prepared and undone at once: the slots the test knows stay.
    fn store_undone(&mut self, keys: &[BlockKey]) -> Result<StoreOutcome, ManagerError> {
        let (out, undo) = self.mgr.prepare_store_undoable(keys)?;
        for e in &out.evicted {
            assert!(!keys.contains(&e.key), "prepare_store_undoable({keys:?}) evicted its own key {}", e.key);
            assert_eq!(self.slots.get(&e.key), Some(&e.slot), "evicted {} from the wrong slot", e.key);
        }
        self.mgr.undo_store(undo).expect("an undo right after its prepare");
        Ok(StoreOutcome {
            to_store: out.to_store.iter().map(|p| p.key).collect(),
            evicted: out.evicted.iter().map(|p| p.key).collect(),
            skipped: out.skipped,
        })
    }

    fn load(&mut self, keys: &[BlockKey]) -> Result<Vec<BlockKey>, ManagerError> {
        let placements = self.mgr.prepare_load(keys)?;
        for p in &placements {
            assert_eq!(self.slots.get(&p.key), Some(&p.slot), "{} loads from the wrong slot", p.key);
        }
        Ok(placements.iter().map(|p| p.key).collect())
    }

    /// Drains the manager's events, checks their slots, returns them sorted
    /// without slots.
    fn events(&mut self, removed_slots: &HashMap<BlockKey, SlotId>) -> Vec<(Ev, BlockKey)> {
        let mut out = Vec::new();
        for e in self.mgr.take_events() {
            let (ev, key, slot) = match e {
                ManagerEvent::Stored { key, slot } => (Ev::Stored, key, slot),
                ManagerEvent::Evicted { key, slot } => (Ev::Evicted, key, slot),
                ManagerEvent::Removed { key, slot, .. } => (Ev::Removed, key, slot),
            };
            let known = self.slots.get(&key).or_else(|| removed_slots.get(&key));
            if ev != Ev::Evicted {
                assert_eq!(known, Some(&slot), "event {e:?} names the wrong slot");
            }
            self.events[ev as usize] += 1;
            out.push((ev, key));
        }
        out.sort();
        out
    }
}

struct ManagerTest<P>(PhantomData<P>);

impl<P: Policy> StateMachineTest for ManagerTest<P> {
    type SystemUnderTest = Sut;
    type Reference = ManagerMachine<P>;

    fn init_test(m: &Model) -> Sut {
        let mgr = BlockManager::new(m.config()).expect("valid config");
        Sut { mgr, slots: HashMap::new(), events: [0; 3] }
    }

    fn apply(mut sut: Sut, m: &Model, op: Op) -> Sut {
        let mut removed = HashMap::new();
        let got = match &op {
            Op::Lookup(keys) => Expected::Lookup(sut.mgr.lookup(keys)),
            Op::Touch(keys) => {
                sut.mgr.touch(keys);
                Expected::Nothing
            }
            Op::PrepareStore(keys) => Expected::Store(sut.store(keys)),
            Op::PrepareStoreUndone(keys) => Expected::Store(sut.store_undone(keys)),
            Op::CompleteStore(keys, ok) => {
                let r = sut.mgr.complete_store(keys, *ok);
                if r.is_ok() && !ok {
                    for k in keys {
                        removed.extend(sut.slots.remove_entry(k));
                    }
                }
                Expected::Unit(r)
            }
            Op::PrepareLoad(keys) => Expected::Load(sut.load(keys)),
            Op::CompleteLoad(keys) => Expected::Unit(sut.mgr.complete_load(keys)),
            Op::Reset => {
                let r = sut.mgr.reset();
                if r.is_ok() {
                    removed.extend(sut.slots.drain());
                }
                Expected::Unit(r)
            }
        };
        assert_eq!(got, m.last, "answer to {op:?} differs from the model");
        let mut want = m.last_events.clone();
        want.sort();
        assert_eq!(sut.events(&removed), want, "events of {op:?} differ from the model");
        sut
    }

    fn check_invariants(sut: &Sut, m: &Model) {
        if let Err(e) = sut.mgr.check_invariants() {
            panic!("invariant broken: {e}");
        }
        let mgr = &sut.mgr;
        assert!(mgr.len() <= mgr.capacity(), "capacity exceeded");
        assert_eq!(mgr.len(), m.blocks.len(), "stored block count");
        assert_eq!(mgr.free_slots(), m.capacity - m.blocks.len(), "free slots");
        assert_eq!(mgr.evictable(), m.blocks.iter().filter(|b| b.evictable()).count(), "evictable");
        assert_eq!(sut.slots.len(), m.blocks.len(), "slots the test knows of");
        for b in &m.blocks {
            assert_eq!(mgr.state(&b.key), Some(b.state()), "state of {}", b.key);
            assert_eq!(mgr.slot(&b.key), sut.slots.get(&b.key).copied(), "slot of {}", b.key);
        }
        let c = mgr.counters();
        assert_eq!([c.stored, c.evicted, c.removed], sut.events, "event counters");
        assert_eq!(c.errors, m.errors, "error counter");
    }
}

prop_state_machine! {
    #![proptest_config(policy_common::sm_config("MANAGER_SM_CASES", 1500, 20_000))]

    /// LRU: random operation sequences agree with the model, invariants hold.
    #[test]
    fn lru_manager_matches_model(sequential 1..80 => ManagerTest<Lru>);

    /// ARC: random operation sequences agree with the model, invariants hold.
    #[test]
    fn arc_manager_matches_model(sequential 1..80 => ManagerTest<Arc>);
}
