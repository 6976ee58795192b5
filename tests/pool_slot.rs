//! State-machine test of the node pool's slot word (docs/node-pool-design.md
//! 2.2 and 3) against a plain reference model.
//!
//! proptest-state-machine generates random sequences of every transition
//! (claim, a rank's bytes complete, abandon, hold, release, evict, reclaim
//! of a dead engine's marks) by three engines of three ranks, with the
//! slot's current epoch or a stale one, and engines and ranks out of range
//! now and then, on one `SlotCell`. The model keeps the state as an enum
//! with sets of ranks and holders; after every step the test compares the
//! answer (the word left, or the exact refusal) and the word with the
//! model, runs `SlotWord::check`, and checks the properties of each step:
//! two writers never hold one slot (a claim succeeds only from `FREE`), a
//! held slot is never evicted or claimed, a slot is `READABLE` only after
//! every rank's bit, every claim moves the epoch and nothing else does.
//! `properties_catch_an_evict_that_ignores_holders` shows the property
//! check can fail: the same random driver on a wrong evict is caught.
//!
//! `POOL_SLOT_SM_CASES` overrides the number of sequences.

use std::collections::BTreeSet;

mod policy_common;

use kvoffload::internal::pool::slot::{SlotCell, SlotError, SlotState, SlotWord, MAX_ENGINES};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

/// Engines and ranks of the pool under test.
const ENGINES: u8 = 3;
const RANKS: u8 = 3;
const ALL_RANKS: u32 = 0b111;

/// Which epoch an operation names: the slot's current one, or another
/// (stale: the slot was claimed since).
#[derive(Clone, Copy, Debug)]
enum Ep {
    Current,
    Other,
}

impl Ep {
    fn resolve(self, current: u32) -> u32 {
        match self {
            Ep::Current => current,
            Ep::Other => SlotWord::next_epoch(current),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Claim(u8),
    Complete(u8, Ep, u8),
    Abandon(u8, Ep),
    Hold(u8, Ep),
    Release(u8, Ep),
    Evict(Ep),
    Reclaim(u8),
}

fn engine() -> impl Strategy<Value = u8> {
    prop_oneof![12 => 0..ENGINES, 1 => Just(MAX_ENGINES)]
}

fn rank() -> impl Strategy<Value = u8> {
    prop_oneof![12 => 0..RANKS, 1 => Just(RANKS)]
}

fn ep() -> impl Strategy<Value = Ep> {
    prop_oneof![6 => Just(Ep::Current), 1 => Just(Ep::Other)]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => engine().prop_map(Op::Claim),
        8 => (engine(), ep(), rank()).prop_map(|(e, p, r)| Op::Complete(e, p, r)),
        1 => (engine(), ep()).prop_map(|(e, p)| Op::Abandon(e, p)),
        4 => (engine(), ep()).prop_map(|(e, p)| Op::Hold(e, p)),
        4 => (engine(), ep()).prop_map(|(e, p)| Op::Release(e, p)),
        3 => ep().prop_map(Op::Evict),
        1 => engine().prop_map(Op::Reclaim),
    ]
}

// ---------------------------------------------------------------- model --

#[derive(Clone, Debug, PartialEq)]
enum M {
    Free { epoch: u32 },
    Writing { engine: u8, epoch: u32, done: BTreeSet<u8> },
    Readable { epoch: u32, holders: BTreeSet<u8> },
}

impl M {
    fn epoch(&self) -> u32 {
        match self {
            M::Free { epoch } | M::Writing { epoch, .. } | M::Readable { epoch, .. } => *epoch,
        }
    }

    fn state(&self) -> SlotState {
        match self {
            M::Free { .. } => SlotState::Free,
            M::Writing { .. } => SlotState::Writing,
            M::Readable { .. } => SlotState::Readable,
        }
    }

    fn expect(&self, expected: SlotState, epoch: Option<u32>) -> Result<(), SlotError> {
        if self.state() != expected {
            return Err(SlotError::WrongState { expected, found: self.state() });
        }
        match epoch {
            Some(e) if e != self.epoch() => Err(SlotError::EpochMoved { expected: e, found: self.epoch() }),
            _ => Ok(()),
        }
    }
}

fn in_range(engine: u8) -> Result<(), SlotError> {
    if engine >= MAX_ENGINES {
        return Err(SlotError::EngineOutOfRange { engine });
    }
    Ok(())
}

/// The model's transition: the new state, or the refusal the slot must give.
fn model_apply(m: &M, op: Op) -> Result<M, SlotError> {
    let cur = m.epoch();
    match op {
        Op::Claim(e) => {
            in_range(e)?;
            m.expect(SlotState::Free, None)?;
            Ok(M::Writing { engine: e, epoch: (cur + 1) % (1 << 25), done: BTreeSet::new() })
        }
        Op::Complete(e, p, r) => {
            if r >= RANKS {
                return Err(SlotError::RankOutOfRange { rank: r, ranks: RANKS });
            }
            in_range(e)?;
            let given = p.resolve(cur);
            m.expect(SlotState::Writing, Some(given))?;
            let M::Writing { engine, epoch, done } = m else { unreachable!() };
            if *engine != e {
                return Err(SlotError::OtherWriter { engine: e, writer: *engine });
            }
            if done.contains(&r) {
                return Err(SlotError::RankAlreadyDone { rank: r });
            }
            let mut done = done.clone();
            done.insert(r);
            Ok(if done.len() == RANKS as usize {
                M::Readable { epoch: *epoch, holders: BTreeSet::new() }
            } else {
                M::Writing { engine: e, epoch: *epoch, done }
            })
        }
        Op::Abandon(e, p) => {
            in_range(e)?;
            m.expect(SlotState::Writing, Some(p.resolve(cur)))?;
            let M::Writing { engine, .. } = m else { unreachable!() };
            if *engine != e {
                return Err(SlotError::OtherWriter { engine: e, writer: *engine });
            }
            Ok(M::Free { epoch: cur })
        }
        Op::Hold(e, p) => {
            in_range(e)?;
            m.expect(SlotState::Readable, Some(p.resolve(cur)))?;
            let M::Readable { holders, .. } = m else { unreachable!() };
            let mut holders = holders.clone();
            holders.insert(e);
            Ok(M::Readable { epoch: cur, holders })
        }
        Op::Release(e, p) => {
            in_range(e)?;
            m.expect(SlotState::Readable, Some(p.resolve(cur)))?;
            let M::Readable { holders, .. } = m else { unreachable!() };
            let mut holders = holders.clone();
            if !holders.remove(&e) {
                return Err(SlotError::NotHeld { engine: e });
            }
            Ok(M::Readable { epoch: cur, holders })
        }
        Op::Evict(p) => {
            m.expect(SlotState::Readable, Some(p.resolve(cur)))?;
            let M::Readable { holders, .. } = m else { unreachable!() };
            if !holders.is_empty() {
                return Err(SlotError::Held { holders: mask(holders) });
            }
            Ok(M::Free { epoch: cur })
        }
        Op::Reclaim(e) => {
            in_range(e)?;
            Ok(match m {
                M::Writing { engine, .. } if *engine == e => M::Free { epoch: cur },
                M::Readable { holders, .. } => {
                    let mut holders = holders.clone();
                    holders.remove(&e);
                    M::Readable { epoch: cur, holders }
                }
                other => other.clone(),
            })
        }
    }
}

fn mask(set: &BTreeSet<u8>) -> u32 {
    set.iter().fold(0, |m, b| m | 1 << b)
}

/// The word the model's state stands for, field by field.
fn model_matches(m: &M, w: SlotWord) -> Result<(), String> {
    let (engine, payload) = match m {
        M::Free { .. } => (0, 0),
        M::Writing { engine, done, .. } => (*engine, mask(done)),
        M::Readable { holders, .. } => (0, mask(holders)),
    };
    let want = (m.state(), engine, payload, m.epoch());
    let got = (w.state(), w.engine(), w.payload(), w.epoch());
    if want != got {
        return Err(format!("word {w:?} is not the model's {m:?}"));
    }
    Ok(())
}

// ----------------------------------------------------------- properties --

/// The properties of one step from `old` to `new`; `done` is the mask of
/// ranks whose completion was accepted at `old`'s write (0 outside a write),
/// `completing` the rank this step completed, if it did.
fn step_properties(old: SlotWord, new: SlotWord, done: u32, completing: Option<u8>) -> Result<(), String> {
    new.check(ENGINES, RANKS).map_err(|e| format!("check failed after {old:?} -> {new:?}: {e}"))?;
    let claim = new.state() == SlotState::Writing && (old.state() != SlotState::Writing || old.epoch() != new.epoch());
    if claim && old.state() != SlotState::Free {
        return Err(format!("a claim from {old:?}: two writers, or a live slot taken ({new:?})"));
    }
    if claim && new.epoch() != SlotWord::next_epoch(old.epoch()) {
        return Err(format!("a claim that does not move the epoch by one: {old:?} -> {new:?}"));
    }
    if !claim && new.epoch() != old.epoch() {
        return Err(format!("the epoch moved without a claim: {old:?} -> {new:?}"));
    }
    if old.state() == SlotState::Readable && old.payload() != 0 && new.state() != SlotState::Readable {
        return Err(format!("a held slot left READABLE: {old:?} -> {new:?}"));
    }
    if old.state() == SlotState::Writing && new.state() == SlotState::Readable {
        let all = done | completing.map_or(0, |r| 1 << r);
        if all != ALL_RANKS {
            return Err(format!("published with ranks {all:#b} complete: {old:?} -> {new:?}"));
        }
    }
    if old.state() == SlotState::Free && new.state() == SlotState::Readable {
        return Err(format!("READABLE without a write: {old:?} -> {new:?}"));
    }
    Ok(())
}

/// Tracks the ranks accepted for the current write, for the publish property.
#[derive(Default, Debug)]
struct Done {
    mask: u32,
}

impl Done {
    /// Checks one applied step and moves the record on.
    fn step(&mut self, op: Op, old: SlotWord, new: SlotWord) -> Result<(), String> {
        let completing = match op {
            Op::Complete(_, _, r) if old != new => Some(r),
            _ => None,
        };
        step_properties(old, new, self.mask, completing)?;
        self.mask = match new.state() {
            SlotState::Writing => self.mask | completing.map_or(0, |r| 1 << r),
            _ => 0,
        };
        if new.state() == SlotState::Writing && old.state() != SlotState::Writing {
            self.mask = 0;
        }
        Ok(())
    }
}

fn cell_apply(c: &SlotCell, op: Op) -> Result<(SlotWord, SlotWord), SlotError> {
    let cur = c.load().epoch();
    let s = match op {
        Op::Claim(e) => c.claim(e),
        Op::Complete(e, p, r) => c.complete_rank(e, p.resolve(cur), r, RANKS),
        Op::Abandon(e, p) => c.abandon(e, p.resolve(cur)),
        Op::Hold(e, p) => c.hold(e, p.resolve(cur)),
        Op::Release(e, p) => c.release(e, p.resolve(cur)),
        Op::Evict(p) => c.evict(p.resolve(cur)),
        Op::Reclaim(e) => c.reclaim(e),
    }?;
    Ok((s.old, s.new))
}

// -------------------------------------------------------- state machine --

#[derive(Clone, Debug)]
struct Ref {
    slot: M,
    last: Result<M, SlotError>,
}

impl ReferenceStateMachine for Ref {
    type State = Ref;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Self::State> {
        let free = M::Free { epoch: 0 };
        Just(Ref { slot: free.clone(), last: Ok(free) }).boxed()
    }

    fn transitions(_: &Self::State) -> BoxedStrategy<Op> {
        op().boxed()
    }

    fn apply(mut state: Self::State, op: &Op) -> Self::State {
        state.last = model_apply(&state.slot, *op);
        if let Ok(m) = &state.last {
            state.slot = m.clone();
        }
        state
    }
}

struct Sut {
    cell: SlotCell,
    done: Done,
}

impl StateMachineTest for Sut {
    type SystemUnderTest = Sut;
    type Reference = Ref;

    fn init_test(_: &Ref) -> Sut {
        Sut { cell: SlotCell::default(), done: Done::default() }
    }

    fn apply(mut sut: Sut, model: &Ref, op: Op) -> Sut {
        let before = sut.cell.load();
        let got = cell_apply(&sut.cell, op);
        let after = sut.cell.load();
        match (&got, &model.last) {
            (Ok((old, new)), Ok(m)) => {
                assert_eq!(*old, before, "{op:?}: the step's old word is not the word before");
                assert_eq!(*new, after, "{op:?}: the step's new word is not the word after");
                model_matches(m, *new).unwrap_or_else(|e| panic!("{op:?}: {e}"));
            }
            (Err(e), Err(want)) => {
                assert_eq!(e, want, "{op:?}: refused for another reason than the model's");
                assert_eq!(after, before, "{op:?}: a refused transition changed the word");
            }
            _ => panic!("{op:?} from {before:?}: slot answered {got:?}, model {:?}", model.last),
        }
        sut.done.step(op, before, after).unwrap_or_else(|e| panic!("{op:?}: {e}"));
        sut
    }

    fn check_invariants(sut: &Sut, model: &Ref) {
        let w = sut.cell.load();
        w.check(ENGINES, RANKS).unwrap_or_else(|e| panic!("check: {e}"));
        model_matches(&model.slot, w).unwrap_or_else(|e| panic!("{e}"));
    }
}

prop_state_machine! {
    #![proptest_config(policy_common::sm_config("POOL_SLOT_SM_CASES", 2000, 20_000))]

    /// Random transition sequences by three engines of three ranks agree
    /// with the model; check() and the step properties hold after each.
    #[test]
    fn slot_word_matches_model(sequential 1..120 => Sut);
}

// ------------------------------------- the properties can fail (negative) --

/// One transition as a pure function of the word (`SlotCell` applies these
/// same functions by CAS).
type Transition = fn(SlotWord, Op) -> Result<SlotWord, SlotError>;

fn pure_apply(w: SlotWord, op: Op) -> Result<SlotWord, SlotError> {
    let cur = w.epoch();
    match op {
        Op::Claim(e) => w.claim(e),
        Op::Complete(e, p, r) => w.complete_rank(e, p.resolve(cur), r, RANKS),
        Op::Abandon(e, p) => w.abandon(e, p.resolve(cur)),
        Op::Hold(e, p) => w.hold(e, p.resolve(cur)),
        Op::Release(e, p) => w.release(e, p.resolve(cur)),
        Op::Evict(p) => w.evict(p.resolve(cur)),
        Op::Reclaim(e) => w.reclaim(e),
    }
}

/// A wrong evict: frees a `READABLE` slot at its epoch even while held.
fn evict_ignoring_holders(w: SlotWord, op: Op) -> Result<SlotWord, SlotError> {
    match op {
        Op::Evict(p) if w.state() == SlotState::Readable && w.epoch() == p.resolve(w.epoch()) => {
            Ok(SlotWord::free(w.epoch()))
        }
        _ => pure_apply(w, op),
    }
}

/// Runs random sequences through `apply`, checking the step properties
/// (not the model) after each step.
fn run_properties(apply: Transition, cases: u32) -> Result<(), String> {
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    runner
        .run(&proptest::collection::vec(op(), 1..120), |ops| {
            let mut w = SlotWord::ZERO;
            let mut done = Done::default();
            for op in ops {
                if let Ok(new) = apply(w, op) {
                    done.step(op, w, new).map_err(TestCaseError::fail)?;
                    w = new;
                }
            }
            Ok(())
        })
        .map_err(|e| e.to_string())
}

#[test]
fn properties_hold_for_the_shipped_transitions() {
    run_properties(pure_apply, 500).unwrap();
}

#[test]
fn properties_catch_an_evict_that_ignores_holders() {
    let err = run_properties(evict_ignoring_holders, 500).expect_err("the wrong evict was not caught");
    assert!(err.contains("a held slot left READABLE"), "caught for another reason: {err}");
}
