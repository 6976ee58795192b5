//! The keyed layer's contract (issue 43), through `KeyedOffloader`'s public
//! API on the simulated GPU:
//!
//! (a) a call that raises changes nothing: no key evicted, no slot taken,
//!     the eviction policy's state as it was (a refused store inside a
//!     capture window, or for an out-of-range GPU block, used to evict
//!     readable keys and report nothing);
//! (b) the `skipped` and `evicted` of one store are disjoint, and every
//!     evicted key is reported (a store used to report a key
//!     `already_stored` and evict it);
//! (c) a key reported stored is loadable (once its store is reported
//!     done) until a store reports it evicted.
//!
//! The exact sequences of the issue, then a proptest state machine against
//! a plain model of keys and slots (LRU and ARC, refusals included: stores
//! and loads inside a capture window, out-of-range GPU blocks, duplicate
//! keys, no room). The model decides on its own which calls succeed, what
//! each store stores and skips, how many keys it evicts and which keys may
//! go; the victims themselves it takes from an oracle, a `BlockManager`
//! fed only the calls that succeeded (itself checked against a plain
//! policy model in manager_state_machine.rs): so a refused call that moved
//! the policy's state (its order, ARC's ghosts and target) shows up as a
//! later victim that differs. `KEYED_SM_CASES` overrides the number of
//! sequences per policy.

use std::collections::{BTreeMap, BTreeSet};
use std::marker::PhantomData;

mod policy_common;
use policy_common::{Arc, Lru, Policy};

use kvoffload::internal::manager::{BlockManager, ManagerConfig};
use kvoffload::{
    shared, BlockKey, KeyedOffloader, KvAlloc, Lookup, ManagerError, OffloaderError, OffloaderOptions, PolicyKind,
    Request, SimRuntime, SkipReason, StoreSubmitted, TransferError,
};
use proptest::prelude::*;
use proptest::sample::subsequence;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

const PAGE: usize = 4096;
const GPU_BLOCKS: usize = 8;
/// A GPU block id past the KV tensors' end.
const OUT_OF_RANGE: usize = GPU_BLOCKS + 3;

fn offloader(host_blocks: usize, policy: PolicyKind) -> KeyedOffloader {
    let mut opts = OffloaderOptions::with_host_blocks(host_blocks);
    opts.eviction = policy;
    let kv = KvAlloc { tensors: 1, page_bytes: PAGE, gpu_blocks: GPU_BLOCKS, block_factor: 1 };
    let off = KeyedOffloader::with_allocated_tensors(shared(SimRuntime::new()), kv, opts)
        .expect("offloader on the simulated GPU");
    // Capture windows open once pinning is final.
    off.core().wait_pinned(Request::new()).expect("pinning");
    off
}

fn keys(hashes: &[u64]) -> Vec<BlockKey> {
    hashes.iter().map(|&h| BlockKey::new(h, 0)).collect()
}

/// Waits for every job and applies them all.
fn settle(off: &KeyedOffloader) {
    off.core().wait_all(Request::new(), &mut drop).expect("wait_all");
    for c in off.poll() {
        assert!(c.error.is_none(), "job {:?} failed: {:?}", c.job, c.error);
    }
}

fn store_settled(off: &KeyedOffloader, hashes: &[u64], gpu: &[usize]) -> StoreSubmitted {
    let r = off.store(&keys(hashes), gpu).expect("store");
    settle(off);
    r
}

fn hits(off: &KeyedOffloader, hashes: &[u64]) -> usize {
    off.lookup(&keys(hashes)).iter().filter(|l| **l == Lookup::Hit).count()
}

fn is_window_refusal(e: &OffloaderError) -> bool {
    matches!(e, OffloaderError::Transfer(TransferError::CaptureWindowOpen { .. }))
}

fn is_range_refusal(e: &OffloaderError) -> bool {
    matches!(e, OffloaderError::Transfer(TransferError::GpuBlockOutOfRange { .. }))
}

// ------------------------------------------------- the sequences --

/// Item 2: a store refused inside a capture window used to evict one of the
/// three readable keys of a full 3-slot pool (3 hits became 2) and report
/// nothing. Now the keys stay, and the store made after the window evicts
/// what it would have evicted had the refused one never been made.
#[test]
fn a_store_refused_inside_a_capture_window_changes_nothing() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let off = offloader(3, policy);
        store_settled(&off, &[0, 1, 2], &[0, 1, 2]);
        assert_eq!(hits(&off, &[0, 1, 2]), 3);
        {
            let _w = off.core().capture_window(Request::new()).expect("window");
            let e = off.store(&keys(&[3]), &[3]).expect_err("a store inside a capture window");
            assert!(is_window_refusal(&e), "{policy:?}: {e:?}");
        }
        assert_eq!(hits(&off, &[0, 1, 2]), 3, "{policy:?}: a refused store evicted a readable key");
        assert_eq!(off.stored_blocks(), 3, "{policy:?}");
        // The first key of a batch is the most recent: 2 goes first.
        let r = store_settled(&off, &[3], &[3]);
        assert_eq!(r.evicted, keys(&[2]), "{policy:?}");
        assert_eq!(off.lookup(&keys(&[0, 1, 2, 3])), [Lookup::Hit, Lookup::Hit, Lookup::Miss, Lookup::Hit]);
    }
}

/// Item 2, the other refusal: a GPU block past the tensors' end.
#[test]
fn a_store_refused_for_an_out_of_range_gpu_block_changes_nothing() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let off = offloader(3, policy);
        store_settled(&off, &[0, 1, 2], &[0, 1, 2]);
        let e = off.store(&keys(&[3]), &[OUT_OF_RANGE]).expect_err("an out-of-range GPU block");
        assert!(is_range_refusal(&e), "{policy:?}: {e:?}");
        assert_eq!(hits(&off, &[0, 1, 2]), 3, "{policy:?}: a refused store evicted a readable key");
        assert_eq!(off.stored_blocks(), 3, "{policy:?}");
        let r = store_settled(&off, &[3], &[3]);
        assert_eq!(r.evicted, keys(&[2]), "{policy:?}");
    }
}

/// Item 2: eight refused stores (of two new keys each, both refusals in
/// turn) into a full 16-block pool used to leave 14 of its 16 keys.
#[test]
fn eight_refused_stores_into_a_full_pool_leave_it_full() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let off = offloader(16, policy);
        let full: Vec<u64> = (0..16).collect();
        for chunk in full.chunks(4) {
            store_settled(&off, chunk, &[0, 1, 2, 3]);
        }
        assert_eq!(hits(&off, &full), 16);
        for i in 0..8u64 {
            let new = keys(&[100 + 2 * i, 101 + 2 * i]);
            let e = if i % 2 == 0 {
                let _w = off.core().capture_window(Request::new()).expect("window");
                off.store(&new, &[4, 5]).expect_err("inside a window")
            } else {
                off.store(&new, &[4, OUT_OF_RANGE]).expect_err("out of range")
            };
            assert!(is_window_refusal(&e) || is_range_refusal(&e), "{policy:?}: {e:?}");
        }
        assert_eq!(hits(&off, &full), 16, "{policy:?}: refused stores evicted readable keys");
        assert_eq!(off.stored_blocks(), 16, "{policy:?}");
    }
}

/// A refused load changes nothing either: its keys stay evictable (a
/// later store can still evict them) and readable.
#[test]
fn a_load_refused_inside_a_capture_window_changes_nothing() {
    let off = offloader(2, PolicyKind::Lru);
    store_settled(&off, &[0, 1], &[0, 1]);
    {
        let _w = off.core().capture_window(Request::new()).expect("window");
        let e = off.load(&keys(&[0, 1]), &[2, 3]).expect_err("a load inside a capture window");
        assert!(is_window_refusal(&e), "{e:?}");
    }
    let r = store_settled(&off, &[2, 3], &[2, 3]);
    assert_eq!(r.evicted.len(), 2, "the refused load left its keys pinned");
}

/// Item 3: stores of [0,3,1] and [0,1,4] fill a 4-slot pool; a store of
/// [0,1,2] used to report 0 and 1 `already_stored` and evict 1 (the least
/// recently used), which a load then did not find. Keys the store skips as
/// stored are kept out of its evictions: 3 goes.
#[test]
fn a_key_skipped_as_already_stored_is_not_evicted_by_the_same_store() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let off = offloader(4, policy);
        store_settled(&off, &[0, 3, 1], &[0, 1, 2]);
        store_settled(&off, &[0, 1, 4], &[0, 1, 2]);
        let r = store_settled(&off, &[0, 1, 2], &[0, 1, 3]);
        let skipped: Vec<(BlockKey, SkipReason)> = r.skipped.iter().map(|s| (s.key, s.reason)).collect();
        let stored = SkipReason::AlreadyStored;
        assert_eq!(skipped, [(BlockKey::new(0, 0), stored), (BlockKey::new(1, 0), stored)], "{policy:?}");
        assert_eq!(r.evicted, keys(&[3]), "{policy:?}: skipped {skipped:?}");
        assert_eq!(r.stored, keys(&[2]), "{policy:?}");
        let job = off.load(&keys(&[0, 1, 2, 4]), &[4, 5, 6, 7]).expect("every key but 3 loads");
        off.core().wait(job, Request::new(), &mut drop).unwrap();
        settle(&off);
    }
}

/// Item 3, where no other key can go: a full 2-slot pool holding 0 and 1,
/// a store of [0, 1, 2] is refused for capacity (changing nothing) rather
/// than evict a key it reports stored.
#[test]
fn a_store_that_could_only_evict_its_own_keys_is_refused() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let off = offloader(2, policy);
        store_settled(&off, &[0, 1], &[0, 1]);
        let e = off.store(&keys(&[0, 1, 2]), &[0, 1, 2]).expect_err("no room but its own keys");
        assert!(
            matches!(e, OffloaderError::Manager(ManagerError::InsufficientCapacity { evictable: 0, .. })),
            "{policy:?}: {e:?}"
        );
        assert_eq!(hits(&off, &[0, 1]), 2, "{policy:?}");
        let r = store_settled(&off, &[0, 2], &[0, 2]);
        assert_eq!(r.evicted, keys(&[1]), "{policy:?}");
    }
}

// -------------------------------------------------- the state machine --

/// The keys of the state machine: 10 hashes in group 0.
const HASHES: u64 = 10;

/// What the model says of one operation.
#[derive(Clone, Debug, PartialEq)]
enum Want {
    Nothing,
    /// The store is refused with this kind of error; nothing changes.
    StoreRefused(Refusal),
    /// The store succeeds: these keys stored, these skipped, `evicted`
    /// (the oracle's victims, in order) evicted; only keys of `may_evict`
    /// may go.
    Stored {
        stored: Vec<u64>,
        skipped: Vec<(u64, SkipReason)>,
        evicted: Vec<u64>,
        may_evict: BTreeSet<u64>,
    },
    LoadRefused(Refusal),
    Loaded,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    Duplicate,
    Capacity,
    NotReadable,
    /// A load of no keys (an empty job).
    Empty,
    Window,
    Range,
}

fn refusal(e: &OffloaderError) -> Option<Refusal> {
    Some(match e {
        OffloaderError::Manager(ManagerError::DuplicateKey { .. }) => Refusal::Duplicate,
        OffloaderError::Manager(ManagerError::InsufficientCapacity { .. }) => Refusal::Capacity,
        OffloaderError::Manager(ManagerError::NotFound { .. } | ManagerError::NotReadable { .. }) => {
            Refusal::NotReadable
        }
        OffloaderError::Transfer(TransferError::EmptyJob { .. }) => Refusal::Empty,
        e if is_window_refusal(e) => Refusal::Window,
        e if is_range_refusal(e) => Refusal::Range,
        _ => return None,
    })
}

#[derive(Clone, Debug)]
enum Op {
    /// A store; `bad` puts an out-of-range GPU block at that batch index;
    /// `window`: made inside a capture window.
    Store {
        hashes: Vec<u64>,
        bad: Option<usize>,
        window: bool,
    },
    Load {
        hashes: Vec<u64>,
        bad: Option<usize>,
        window: bool,
    },
    /// wait_all, then poll.
    Settle,
}

/// A call that succeeded, as the oracle replays it.
#[derive(Clone, Debug)]
enum Done {
    Store(Vec<u64>),
    Load(Vec<u64>),
    Settle,
}

/// Keys and slots, the plain way.
#[derive(Clone, Debug)]
struct Model {
    capacity: usize,
    policy: PolicyKind,
    /// Stores submitted, not yet reported.
    pending: BTreeSet<u64>,
    /// Readable keys and their loads in flight.
    ready: BTreeMap<u64, u32>,
    /// The calls that succeeded, for the oracle.
    done: Vec<Done>,
    want: Want,
}

fn duplicated(hashes: &[u64]) -> bool {
    hashes.iter().collect::<BTreeSet<_>>().len() != hashes.len()
}

impl Model {
    /// A block manager fed the calls that succeeded (rebuilt each time:
    /// the model must stay a plain value).
    fn oracle(&self) -> BlockManager {
        let mut m = BlockManager::new(ManagerConfig::new(self.capacity, self.policy)).expect("oracle");
        let mut jobs: Vec<(bool, Vec<BlockKey>)> = Vec::new();
        for d in &self.done {
            match d {
                Done::Store(h) => {
                    let out = m.prepare_store(&keys(h)).expect("oracle store");
                    jobs.push((true, out.to_store.iter().map(|p| p.key).collect()));
                }
                Done::Load(h) => {
                    m.prepare_load(&keys(h)).expect("oracle load");
                    jobs.push((false, keys(h)));
                }
                Done::Settle => {
                    for (store, ks) in jobs.drain(..) {
                        if ks.is_empty() {
                            continue;
                        }
                        if store { m.complete_store(&ks, true) } else { m.complete_load(&ks) }.expect("oracle settle");
                    }
                }
            }
        }
        m
    }

    fn store(&mut self, hashes: &[u64], bad: Option<usize>, window: bool) -> Want {
        if duplicated(hashes) {
            return Want::StoreRefused(Refusal::Duplicate);
        }
        let (mut stored, mut skipped) = (Vec::new(), Vec::new());
        let mut bad_admitted = false;
        for (i, &h) in hashes.iter().enumerate() {
            if self.pending.contains(&h) {
                skipped.push((h, SkipReason::StorePending));
            } else if self.ready.contains_key(&h) {
                skipped.push((h, SkipReason::AlreadyStored));
            } else {
                stored.push(h);
                bad_admitted |= bad == Some(i);
            }
        }
        let free = self.capacity - self.pending.len() - self.ready.len();
        // Contract (b): no key of the batch is a victim.
        let may_evict: BTreeSet<u64> =
            self.ready.iter().filter(|(h, r)| **r == 0 && !hashes.contains(h)).map(|(h, _)| *h).collect();
        let evict = stored.len().saturating_sub(free);
        if evict > may_evict.len() {
            return Want::StoreRefused(Refusal::Capacity);
        }
        if !stored.is_empty() {
            // Contract (a): a submission refused changes nothing.
            if bad_admitted {
                return Want::StoreRefused(Refusal::Range);
            }
            if window {
                return Want::StoreRefused(Refusal::Window);
            }
        }
        let out = self.oracle().prepare_store(&keys(hashes)).expect("the oracle stores what the model stores");
        let evicted: Vec<u64> = out.evicted.iter().map(|p| p.key.hash).collect();
        assert_eq!(evicted.len(), evict, "the oracle evicts as many keys as the model");
        for h in &evicted {
            self.ready.remove(h);
        }
        self.pending.extend(&stored);
        self.done.push(Done::Store(hashes.to_vec()));
        Want::Stored { stored, skipped, evicted, may_evict }
    }

    fn load(&mut self, hashes: &[u64], bad: Option<usize>, window: bool) -> Want {
        if duplicated(hashes) {
            return Want::LoadRefused(Refusal::Duplicate);
        }
        if hashes.iter().any(|h| !self.ready.contains_key(h)) {
            return Want::LoadRefused(Refusal::NotReadable);
        }
        if hashes.is_empty() {
            return Want::LoadRefused(Refusal::Empty);
        }
        if bad.is_some() {
            return Want::LoadRefused(Refusal::Range);
        }
        if window {
            return Want::LoadRefused(Refusal::Window);
        }
        for h in hashes {
            *self.ready.entry(*h).or_default() += 1;
        }
        self.done.push(Done::Load(hashes.to_vec()));
        Want::Loaded
    }

    fn settle(&mut self) {
        for h in std::mem::take(&mut self.pending) {
            self.ready.insert(h, 0);
        }
        for r in self.ready.values_mut() {
            *r = 0;
        }
        self.done.push(Done::Settle);
    }
}

struct KeyedMachine<P>(PhantomData<P>);

/// Up to 4 hashes, distinct in most batches.
fn batch() -> BoxedStrategy<Vec<u64>> {
    prop_oneof![
        8 => subsequence((0..HASHES).collect::<Vec<_>>(), 0..=4).prop_shuffle(),
        1 => prop::collection::vec(0..HASHES, 2..4),
    ]
    .boxed()
}

/// A batch, an out-of-range GPU block in some (at a batch index), a
/// capture window around some.
fn submission() -> impl Strategy<Value = (Vec<u64>, Option<usize>, bool)> {
    (batch(), prop::option::weighted(0.15, 0usize..4), prop::bool::weighted(0.15)).prop_map(|(h, bad, window)| {
        let bad = bad.filter(|i| *i < h.len());
        (h, bad, window)
    })
}

impl<P: Policy> ReferenceStateMachine for KeyedMachine<P> {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        (1usize..=6)
            .prop_map(|capacity| Model {
                capacity,
                policy: P::KIND,
                pending: BTreeSet::new(),
                ready: BTreeMap::new(),
                done: Vec::new(),
                want: Want::Nothing,
            })
            .boxed()
    }

    fn transitions(m: &Model) -> BoxedStrategy<Op> {
        let ready: Vec<u64> = m.ready.keys().copied().collect();
        let mut ops: Vec<(u32, BoxedStrategy<Op>)> = vec![
            (6, submission().prop_map(|(hashes, bad, window)| Op::Store { hashes, bad, window }).boxed()),
            (1, submission().prop_map(|(hashes, bad, window)| Op::Load { hashes, bad, window }).boxed()),
            (3, Just(Op::Settle).boxed()),
        ];
        if !ready.is_empty() {
            let n = ready.len();
            let load = (subsequence(ready, 1..=n.min(4)).prop_shuffle(), prop::bool::weighted(0.1))
                .prop_map(|(hashes, window)| Op::Load { hashes, bad: None, window });
            ops.push((3, load.boxed()));
        }
        prop::strategy::Union::new_weighted(ops).boxed()
    }

    fn apply(mut m: Model, op: &Op) -> Model {
        m.want = match op {
            Op::Store { hashes, bad, window } => m.store(hashes, *bad, *window),
            Op::Load { hashes, bad, window } => m.load(hashes, *bad, *window),
            Op::Settle => {
                m.settle();
                Want::Nothing
            }
        };
        m
    }
}

/// The offloader under test.
struct Sut {
    off: KeyedOffloader,
}

fn gpu_blocks(n: usize, bad: Option<usize>) -> Vec<usize> {
    (0..n).map(|i| if bad == Some(i) { OUT_OF_RANGE } else { i }).collect()
}

fn hashes_of(keys: &[BlockKey]) -> Vec<u64> {
    keys.iter().map(|k| k.hash).collect()
}

impl Sut {
    fn store(&mut self, hashes: &[u64], bad: Option<usize>, window: bool, want: &Want) {
        let got = self.call(hashes, bad, window, |off, ks, gpu| off.store(ks, gpu));
        match (got, want) {
            (Err(e), Want::StoreRefused(r)) => assert_eq!(refusal(&e), Some(*r), "store {hashes:?} refused: {e:?}"),
            (Ok(got), Want::Stored { stored, skipped, evicted: victims, may_evict }) => {
                let got_skipped: Vec<(u64, SkipReason)> = got.skipped.iter().map(|s| (s.key.hash, s.reason)).collect();
                let evicted = hashes_of(&got.evicted);
                // Contract (b), stated on its own.
                for s in &got_skipped {
                    assert!(!evicted.contains(&s.0), "store {hashes:?} skipped {} and evicted it", s.0);
                }
                assert_eq!(hashes_of(&got.stored), *stored, "stored by {hashes:?}");
                assert_eq!(got_skipped, *skipped, "skipped by {hashes:?}");
                assert_eq!(got.job.is_some(), !stored.is_empty(), "job of {hashes:?}");
                for h in &evicted {
                    assert!(may_evict.contains(h), "store {hashes:?} evicted {h}, which it may not");
                }
                // The oracle saw every call that succeeded and none other:
                // a refusal that moved the policy shows as another victim.
                assert_eq!(evicted, *victims, "victims of store {hashes:?}");
            }
            (got, want) => panic!("store {hashes:?} (bad {bad:?}, window {window}): got {got:?}, want {want:?}"),
        }
    }

    fn load(&mut self, hashes: &[u64], bad: Option<usize>, window: bool, want: &Want) {
        let got = self.call(hashes, bad, window, |off, ks, gpu| off.load(ks, gpu));
        match (got, want) {
            (Err(e), Want::LoadRefused(r)) => assert_eq!(refusal(&e), Some(*r), "load {hashes:?} refused: {e:?}"),
            (Ok(_), Want::Loaded) => {}
            (got, want) => panic!("load {hashes:?} (bad {bad:?}, window {window}): got {got:?}, want {want:?}"),
        }
    }

    /// `call` with the keys of `hashes` and as many GPU blocks (block `bad`
    /// out of range), inside a capture window if `window`, else outside any.
    fn call<T>(
        &self,
        hashes: &[u64],
        bad: Option<usize>,
        window: bool,
        call: impl FnOnce(&KeyedOffloader, &[BlockKey], &[usize]) -> T,
    ) -> T {
        let (ks, gpu) = (keys(hashes), gpu_blocks(hashes.len(), bad));
        let _w = window.then(|| self.off.core().capture_window(Request::new()).expect("window"));
        call(&self.off, &ks, &gpu)
    }

    fn settle(&mut self) {
        self.off.core().wait_all(Request::new(), &mut drop).expect("wait_all");
        for c in self.off.poll() {
            assert!(c.error.is_none(), "job {:?} failed: {:?}", c.job, c.error);
        }
    }
}

struct KeyedTest<P>(PhantomData<P>);

impl<P: Policy> StateMachineTest for KeyedTest<P> {
    type SystemUnderTest = Sut;
    type Reference = KeyedMachine<P>;

    fn init_test(m: &Model) -> Sut {
        Sut { off: offloader(m.capacity, m.policy) }
    }

    fn apply(mut sut: Sut, m: &Model, op: Op) -> Sut {
        match &op {
            Op::Store { hashes, bad, window } => sut.store(hashes, *bad, *window, &m.want),
            Op::Load { hashes, bad, window } => sut.load(hashes, *bad, *window, &m.want),
            Op::Settle => sut.settle(),
        }
        sut
    }

    /// Contracts (a) and (c): every key the model holds is what lookup
    /// says (a refused call took none away, a stored key stays readable
    /// until reported evicted), and nothing else is held.
    fn check_invariants(sut: &Sut, m: &Model) {
        let all: Vec<u64> = (0..HASHES).collect();
        let want: Vec<Lookup> = all
            .iter()
            .map(|h| {
                if m.pending.contains(h) {
                    Lookup::HitPending
                } else if m.ready.contains_key(h) {
                    Lookup::Hit
                } else {
                    Lookup::Miss
                }
            })
            .collect();
        assert_eq!(sut.off.lookup(&keys(&all)), want, "lookup of every key");
        assert_eq!(sut.off.stored_blocks(), m.pending.len() + m.ready.len(), "slots taken");
    }
}

prop_state_machine! {
    #![proptest_config(policy_common::sm_config("KEYED_SM_CASES", 256, 4_000))]

    /// LRU: the keyed layer keeps its contract and the twin's victims.
    #[test]
    fn lru_keyed_offloader_keeps_its_contract(sequential 1..40 => KeyedTest<Lru>);

    /// ARC: the keyed layer keeps its contract and the twin's victims.
    #[test]
    fn arc_keyed_offloader_keeps_its_contract(sequential 1..40 => KeyedTest<Arc>);
}
