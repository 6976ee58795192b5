//! The node pool's models (PL1-PL5, docs/PROOFS.md "The node pool"): a pool
//! of `LocalPoolWords` seen by each model thread through a [`View`] (a
//! `PoolWords` that knows which process calls it), rows of bytes the model
//! threads write and read, and the record the checks judge against.
//!
//! - **Rows.** Each slot has one row per rank, holding a tag `tag(key,
//!   epoch, rank)`. Under loom a row is a `loom::cell::UnsafeCell`, so an
//!   access that no happens-before edge orders against the last write is
//!   loom's "Causality violation"; under shuttle (no causality check) the
//!   tag alone. Beside each row the record keeps its *shadow*, the value it
//!   holds in the order the model ran, so a reader finds a wrong tag before
//!   it touches the cell.
//! - **The record** (a std mutex: no schedule point, so loom and shuttle
//!   explore only the pool's own words; each update is made right after
//!   the successful compare-and-swap it notes, with no schedule point
//!   between, so for the checker the two are one step): a mirror of every
//!   slot and owner word, the last claim of each slot, the ranks that
//!   completed their bytes by their own CAS, and the holds of the model
//!   threads that live (taken by a hold CAS of their engine, dropped by
//!   its release CAS or its death).
//! - **The checks**, each with the reason a negative declares:
//!   - a claim of a word some engine writes, or at an epoch already
//!     claimed: "two writers in one slot" (PL3);
//!   - a claim of a word with holders: "overwritten while held" (PL2);
//!   - a row written while a live model thread holds its slot:
//!     "overwritten while held" (PL2, PL4);
//!   - a row written by a rank into a slot already published at its epoch:
//!     "read a rank's bytes before they were written" (PL1);
//!   - a hit read with a rank's completion missing: "served half-written:
//!     read a rank's bytes before they were written" (PL1, PL4);
//!   - a hit read whose row holds another key's tag: "served another key's
//!     bytes" (PL2);
//!   - a hold bit of engine `E` cleared by anyone but `E` while `E`'s entry
//!     is not being swept (`RECLAIMING`), or a release of a hold that
//!     fails: "lost a live engine's hold" (PL4);
//!   - a claim into a slot outside its key's set: "key outside its set"
//!     (PL5);
//!   - a skip where the model knows a slot was claimable: "skipped with a
//!     claimable slot" (PL5, in the model).
//!
//! Model-only knobs (no production change): a narrow epoch
//! ([`Options::epoch_bits`]: every word a CAS writes has its epoch taken
//! modulo `2^bits`, and the epochs the model passes back are too, as a pool
//! with that width would hand them out), so design 3.7's ABA is reachable
//! in a handful of claims; and the publish CAS with Relaxed ordering
//! ([`Options::publish_relaxed`]: the slot words then live here, every
//! other CAS AcqRel as `LocalPoolWords`' own), the negative of PL1's
//! ordering half; and a lying liveness oracle ([`View::lying`]).

#![allow(clippy::disallowed_types)]

mod engine;
#[allow(unused_imports)] // not every model names both
pub use engine::{Engine, Stored};

use std::sync::{Mutex, MutexGuard};

use kvoffload::internal::pool::engines::{worker, OwnerState, OwnerWord, SCHEDULER};
use kvoffload::internal::pool::slot::{SlotState, SlotWord};
use kvoffload::internal::pool::table::PoolTable;
use kvoffload::internal::pool::words::{
    by_pid_alone, EntryRole, Geometry, Key, Liveness, LocalPoolWords, Member, PoolWords,
};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::atomic::{AtomicU64, Ordering};
use kvoffload::internal::sync::Arc;

/// The model-only knobs of a pool (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// `Some(b)`: epochs are `b` bits wide (modulo `2^b`).
    pub epoch_bits: Option<u32>,
    /// The CAS that publishes a slot (`WRITING` to `READABLE`) is Relaxed.
    pub publish_relaxed: bool,
    /// Processes beyond the engines' members (standalone sweepers): their
    /// pids follow the engines'.
    pub extra_processes: u32,
}

/// A key of one byte `b` (its set is `b mod sets`).
pub fn key(b: u8) -> Key {
    Key::new(&[b], 0).expect("a one-byte key")
}

/// The `i`-th one-byte key (by value, [`key`]) whose two sets
/// ([`Key::sets`]) are `sets` in a pool of `n` sets: a model decides where
/// its keys may go.
pub fn key_in(n: u32, sets: [u32; 2], i: usize) -> Key {
    (0..=u8::MAX).map(key).filter(|k| k.sets(n) == sets).nth(i).expect("enough one-byte keys of those sets")
}

/// What rank `rank`'s row of `key`'s slot holds once written at `epoch`.
pub fn tag(key: &Key, epoch: u32, rank: u8) -> u64 {
    (key.hash[0] << 40) | (u64::from(epoch) << 8) | (u64::from(rank) + 1)
}

/// Who calls the pool's words through a view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Who {
    /// Engine `e`'s scheduler (lookup, hold, release, claim; a sweep it runs).
    Scheduler(u8),
    /// Engine `e`'s rank `r` worker (its row, its completion).
    Rank(u8, u8),
    /// A process of no engine (a standalone sweeper, `pool ls --reclaim`).
    Process(u32),
}

struct Record {
    /// Each slot word as the last successful CAS left it.
    word: Vec<u64>,
    /// Each owner word likewise.
    owner: Vec<u64>,
    /// The last claim of each slot: (engine, epoch).
    claim: Vec<Option<(u8, u32)>>,
    /// The ranks that completed the slot's last claim by their own CAS.
    done: Vec<u32>,
    /// The holds the living model threads took: (engine, slot, epoch).
    holds: Vec<(u8, u32, u32)>,
    /// Each row's value, in the order the model ran (slot * ranks + rank).
    shadow: Vec<u64>,
}

/// The rows of the pool's data: one per slot and rank.
struct Rows {
    #[cfg(loom)]
    cells: Vec<loom::cell::UnsafeCell<u64>>,
}

// SAFETY: every access to a cell goes through loom's `UnsafeCell::with` or
// `with_mut`, which check it against the cell's last write and panic
// ("Causality violation") on an access no happens-before edge orders; loom
// runs one model thread at a time, so no two accesses overlap in fact.
#[cfg(loom)]
unsafe impl Sync for Rows {}

/// A pool for a model: the production words, the rows and the record.
pub struct Pool {
    pub words: LocalPoolWords,
    geometry: Geometry,
    opts: Options,
    /// The slot words when `publish_relaxed` (else `words`' own).
    own_slots: Vec<AtomicU64>,
    /// Each slot's key, as one word (see [`View`]'s `key_load`).
    keys: Vec<AtomicU64>,
    rows: Rows,
    record: Mutex<Record>,
}

impl Pool {
    /// A pool of `geometry`, every engine's members alive.
    pub fn new(geometry: Geometry, opts: Options) -> Arc<Pool> {
        let members = u32::from(geometry.engines) * (1 + u32::from(geometry.ranks));
        let slots = geometry.slots as usize;
        let rows = slots * geometry.ranks as usize;
        Arc::new(Pool {
            words: LocalPoolWords::new(geometry, (members + opts.extra_processes) as usize),
            geometry,
            opts,
            own_slots: if opts.publish_relaxed { (0..slots).map(|_| AtomicU64::new(0)).collect() } else { Vec::new() },
            keys: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            rows: Rows {
                #[cfg(loom)]
                cells: (0..rows).map(|_| loom::cell::UnsafeCell::new(0)).collect(),
            },
            record: Mutex::new(Record {
                word: vec![0; slots],
                owner: vec![0; geometry.engines as usize],
                claim: vec![None; slots],
                done: vec![0; slots],
                holds: Vec::new(),
                shadow: vec![0; rows],
            }),
        })
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn record(&self) -> MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The pid of engine `engine`'s member `member` (0 the scheduler, 1 + r
    /// rank r's worker).
    pub fn pid(&self, engine: u8, member: u8) -> u32 {
        1 + u32::from(engine) * (1 + u32::from(self.geometry.ranks)) + u32::from(member)
    }

    /// The pid of standalone process `i` (a sweeper of no engine).
    pub fn extra_pid(&self, i: u32) -> u32 {
        1 + u32::from(self.geometry.engines) * (1 + u32::from(self.geometry.ranks)) + i
    }

    /// The engine whose member has `pid`, if any.
    fn engine_of(&self, pid: u32) -> Option<u8> {
        let per = 1 + u32::from(self.geometry.ranks);
        let e = pid.checked_sub(1)? / per;
        (e < u32::from(self.geometry.engines)).then_some(e as u8)
    }

    /// `epoch` as this pool's epochs are (modulo `2^epoch_bits`).
    pub fn epoch(&self, epoch: u32) -> u32 {
        match self.opts.epoch_bits {
            Some(b) => epoch & ((1 << b) - 1),
            None => epoch,
        }
    }

    fn narrow(&self, raw: u64) -> u64 {
        let w = SlotWord::decode(raw);
        let e = self.epoch(w.epoch());
        match w.state() {
            SlotState::Free => SlotWord::free(e),
            SlotState::Writing => SlotWord::writing(w.engine(), e, w.payload()),
            SlotState::Readable => SlotWord::readable(e, w.payload()),
            SlotState::Invalid => w,
        }
        .encode()
    }

    /// The word of `slot` as the record has it (no schedule point).
    pub fn recorded(&self, slot: u32) -> SlotWord {
        SlotWord::decode(self.record().word[slot as usize])
    }

    /// Notes a successful CAS of `slot` from `cur` to `new` by `who`, and
    /// checks it (see the module docs).
    fn note_cas(&self, who: Who, slot: usize, cur: u64, new: u64) {
        let (old, nw) = (SlotWord::decode(cur), SlotWord::decode(new));
        let mut rec = self.record();
        rec.word[slot] = new;
        let same_write = old.state() == SlotState::Writing && old.engine() == nw.engine() && old.epoch() == nw.epoch();
        if nw.state() == SlotState::Writing && !same_write {
            if old.state() == SlotState::Writing {
                panic!(
                    "two writers in one slot: engine {} claimed slot {slot} at epoch {} while engine {} wrote it",
                    nw.engine(),
                    nw.epoch(),
                    old.engine()
                );
            }
            if let Some((e, ep)) = rec.claim[slot] {
                assert!(
                    ep != nw.epoch(),
                    "two writers in one slot: engines {e} and {} both claimed slot {slot} at epoch {ep}",
                    nw.engine()
                );
            }
            if old.state() == SlotState::Readable && old.payload() != 0 {
                panic!(
                    "overwritten while held: engine {} claimed slot {slot} held by engines {:#x}",
                    nw.engine(),
                    old.payload()
                );
            }
            rec.claim[slot] = Some((nw.engine(), nw.epoch()));
            rec.done[slot] = 0;
        }
        if same_write || (old.state() == SlotState::Writing && nw.state() == SlotState::Readable) {
            if let Who::Rank(e, r) = who {
                if e == old.engine() && old.epoch() == nw.epoch() {
                    rec.done[slot] |= 1 << r;
                }
            }
        }
        if old.state() == SlotState::Readable {
            let kept = if nw.state() == SlotState::Readable { nw.payload() } else { 0 };
            let removed = old.payload() & !kept;
            for e in (0..32u8).filter(|e| removed & (1 << e) != 0) {
                if who == Who::Scheduler(e) {
                    rec.holds.retain(|h| !(h.0 == e && h.1 == slot as u32));
                } else if nw.state() == SlotState::Readable {
                    let entry = OwnerWord::decode(rec.owner[e as usize]);
                    assert!(
                        entry.state == OwnerState::Reclaiming,
                        "lost a live engine's hold: {who:?} cleared engine {e}'s bit of slot {slot} ({old:?} -> {nw:?}) \
                         while its entry is {:?}",
                        entry.state
                    );
                }
            }
            let added = kept & !old.payload();
            if let Who::Scheduler(e) = who {
                if added == 1 << e {
                    rec.holds.push((e, slot as u32, nw.epoch()));
                }
            }
        }
    }
}

/// A process's view of the pool's words: `LocalPoolWords`, with every CAS
/// noted and checked in the record.
pub struct View {
    pool: Arc<Pool>,
    who: Who,
    /// The oracle says `Gone` of every process but this view's engine's
    /// own (a model-local bad oracle, PL4's negative).
    lying: bool,
}

impl View {
    pub fn new(pool: &Arc<Pool>, who: Who) -> View {
        View { pool: pool.clone(), who, lying: false }
    }

    /// A view whose liveness oracle says every other process is gone.
    pub fn lying(pool: &Arc<Pool>, who: Who) -> View {
        View { pool: pool.clone(), who, lying: true }
    }

    fn own_engine(&self) -> Option<u8> {
        match self.who {
            Who::Scheduler(e) | Who::Rank(e, _) => Some(e),
            Who::Process(_) => None,
        }
    }
}

impl PoolWords for View {
    fn geometry(&self) -> Geometry {
        self.pool.geometry
    }
    fn slot_load(&self, slot: usize) -> u64 {
        if self.pool.opts.publish_relaxed {
            self.pool.own_slots[slot].load(Ordering::Acquire)
        } else {
            self.pool.words.slot_load(slot)
        }
    }
    fn slot_cas(&self, slot: usize, current: u64, new: u64) -> Result<u64, u64> {
        let new = self.pool.narrow(new);
        let r = if self.pool.opts.publish_relaxed {
            let publish = SlotWord::decode(current).state() == SlotState::Writing
                && SlotWord::decode(new).state() == SlotState::Readable;
            // The negative: the CAS that publishes orders nothing.
            let (ok, fail) =
                if publish { (Ordering::Relaxed, Ordering::Relaxed) } else { (Ordering::AcqRel, Ordering::Acquire) };
            self.pool.own_slots[slot].compare_exchange(current, new, ok, fail)
        } else {
            self.pool.words.slot_cas(slot, current, new)
        };
        if r.is_ok() {
            self.pool.note_cas(self.who, slot, current, new);
        }
        r
    }
    // The key words as one word: the models' keys are one-byte hashes
    // (`key`), whose other four words are the same for every key; as five
    // atomics, loom would explore which of several equal stores each load
    // reads (a model of two or three claims of one slot did not end within
    // ten minutes). The one word keeps the words' contract: Relaxed,
    // ordered by the state word. What it leaves out: a read torn between two
    // keys' words, which the hold's compare under its bit makes harmless as
    // it does any stale read (design 3.1 step 3).
    fn key_load(&self, slot: usize) -> Key {
        match self.pool.keys[slot].load(Ordering::Relaxed) {
            0 => Key::default(),
            v => key((v - 1) as u8),
        }
    }
    fn key_store(&self, slot: usize, k: &Key) {
        assert!(k.len == 1 && k.group == 0 && k.hash[1..] == [0, 0, 0], "the models' keys are one-byte hashes: {k:?}");
        self.pool.keys[slot].store(k.hash[0] + 1, Ordering::Relaxed)
    }
    fn clock_load(&self, slot: usize) -> bool {
        self.pool.words.clock_load(slot)
    }
    fn clock_store(&self, slot: usize, referenced: bool) {
        self.pool.words.clock_store(slot, referenced)
    }
    fn hand_next(&self, set: usize) -> u32 {
        self.pool.words.hand_next(set)
    }
    // The writer note is never decided on (`PoolWords::note_writer`), and
    // the model's record already notes every claim at its CAS
    // (`note_cas`): as an atomic store it would only add interleavings
    // that no property reads, so the models keep no note.
    fn note_writer(&self, _slot: usize, _engine: u8) {}
    fn owner_load(&self, engine: u8) -> u64 {
        self.pool.words.owner_load(engine)
    }
    fn owner_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        let r = self.pool.words.owner_cas(engine, current, new);
        if r.is_ok() {
            self.pool.record().owner[engine as usize] = new;
        }
        r
    }
    fn members_load(&self, engine: u8) -> u64 {
        self.pool.words.members_load(engine)
    }
    fn members_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        self.pool.words.members_cas(engine, current, new)
    }
    fn member_load(&self, engine: u8, member: u8) -> Member {
        self.pool.words.member_load(engine, member)
    }
    fn member_store(&self, engine: u8, member: u8, record: &Member) {
        self.pool.words.member_store(engine, member, record)
    }
    fn engine_id_load(&self, engine: u8) -> [u64; 4] {
        self.pool.words.engine_id_load(engine)
    }
    fn engine_id_store(&self, engine: u8, id: &[u64; 4]) {
        self.pool.words.engine_id_store(engine, id)
    }
    fn agreement_load(&self, engine: u8, rank: u8) -> u32 {
        self.pool.words.agreement_load(engine, rank)
    }
    fn agreement_cas(&self, engine: u8, rank: u8, current: u32, new: u32) -> Result<u32, u32> {
        self.pool.words.agreement_cas(engine, rank, current, new)
    }
    fn agreement_store(&self, engine: u8, rank: u8, value: u32) {
        self.pool.words.agreement_store(engine, rank, value)
    }
    fn liveness(&self, record: &Member) -> Liveness {
        if self.lying && self.pool.engine_of(record.pid) != self.own_engine() {
            return Liveness::Gone;
        }
        self.pool.words.liveness(record)
    }
    // The models' oracle is exact for every process (one namespace, no
    // reused pid): the owner word's pid alone says whether its process
    // lives (and the lying oracle lies about it too). What a pool file's
    // entry locks give across pid namespaces, the models assume
    // (tests/pool_procs.rs checks the locks with real processes).
    fn hold_entry(&self, _engine: u8, _role: EntryRole) -> bool {
        true
    }
    fn release_entry(&self, _engine: u8, _role: EntryRole) {}
    fn named_liveness(&self, _engine: u8, _role: EntryRole, pid: u32, me: &Member) -> Liveness {
        by_pid_alone(self, pid, me)
    }
    fn hold_member(&self, engine: u8) -> bool {
        self.pool.words.hold_member(engine)
    }
    fn release_member(&self, engine: u8) {
        self.pool.words.release_member(engine)
    }
    fn foreign_member_liveness(&self, engine: u8) -> Liveness {
        self.pool.words.foreign_member_liveness(engine)
    }
    fn pool_word_rmw(&self) -> u64 {
        self.pool.words.pool_word_rmw()
    }
    fn pool_word_load(&self) -> u64 {
        self.pool.words.pool_word_load()
    }
    fn pool_word_cas(&self, current: u64, new: u64) -> Result<u64, u64> {
        self.pool.words.pool_word_cas(current, new)
    }
    fn hold_closer(&self) -> bool {
        self.pool.words.hold_closer()
    }
    fn release_closer(&self) {
        self.pool.words.release_closer()
    }
    fn closer_liveness(&self, pid: u32, me: &Member) -> Liveness {
        self.pool.words.closer_liveness(pid, me)
    }
}

impl Pool {
    fn row_write(&self, slot: u32, rank: u8, v: u64) {
        let i = slot as usize * self.geometry.ranks as usize + rank as usize;
        self.record().shadow[i] = v;
        #[cfg(loom)]
        // SAFETY: `v` is a plain `u64`; loom checks the access (see `Rows`).
        self.rows.cells[i].with_mut(|p| unsafe { *p = v });
    }

    fn row_read(&self, slot: u32, rank: u8) -> u64 {
        let i = slot as usize * self.geometry.ranks as usize + rank as usize;
        #[cfg(loom)]
        {
            // SAFETY: as in `row_write`.
            self.rows.cells[i].with(|p| unsafe { *p })
        }
        #[cfg(not(loom))]
        {
            self.record().shadow[i]
        }
    }

    /// A sweeper process of no engine (pid [`Pool::extra_pid`] `i`): its
    /// table.
    pub fn sweeper(pool: &Arc<Pool>, i: u32, variant: Variant) -> (PoolTable<View>, Member) {
        let t = PoolTable::new(View::new(pool, Who::Process(pool.extra_pid(i))));
        t.set_variant(variant);
        (t, LocalPoolWords::process(pool.extra_pid(i)))
    }

    /// The final state's checks, on a quiescent pool: every word's own
    /// invariants and I5 (`PoolTable::check`); no mark of an engine in
    /// `dead`; no hold left by the living model threads.
    pub fn check_quiescent(pool: &Arc<Pool>, dead: &[u8]) {
        let this = pool.as_ref();
        let t = PoolTable::new(View::new(pool, Who::Process(0)));
        if let Err((slot, e)) = t.check() {
            panic!("slot {slot} breaks an invariant: {e}");
        }
        for slot in 0..this.geometry.slots {
            let w = SlotWord::decode(t.words().slot_load(slot as usize));
            for &d in dead {
                assert!(
                    !(w.state() == SlotState::Writing && w.engine() == d
                        || w.state() == SlotState::Readable && w.payload() & (1 << d) != 0),
                    "a mark of dead engine {d} is left after the sweeps: slot {slot} is {w:?}"
                );
            }
            assert!(
                !(w.state() == SlotState::Readable && w.payload() != 0),
                "slot {slot} is still held after every thread released: {w:?}"
            );
        }
        for &d in dead {
            let o = OwnerWord::decode(this.words.owner_load(d));
            assert_eq!(o.state, OwnerState::Free, "dead engine {d}'s entry is {o:?} after the sweeps");
        }
        let holds = this.record().holds.clone();
        assert!(holds.is_empty(), "holds left by the living threads: {holds:?}");
    }
}

/// Every engine of `pool` joins (on the model's main thread, before its
/// threads start): rank 0's worker claims entry `e` in order, the other
/// ranks and the scheduler register.
pub fn join_all(pool: &Arc<Pool>) {
    let g = pool.geometry;
    for e in 0..g.engines {
        let id = [u64::from(e) + 1, 0, 0, 0];
        let t = PoolTable::new(View::new(pool, Who::Rank(e, 0)));
        let me = |m: u8| LocalPoolWords::process(pool.pid(e, m));
        let lease = t.join_owner(worker(0), &me(worker(0)), &id).expect("join_owner");
        assert_eq!(lease.engine, e, "engines take the entries in order");
        for m in (1..g.ranks).map(worker).chain([SCHEDULER]) {
            let l = t.join_member(m, &me(m), &id).expect("join_member");
            assert_eq!(l.map(|l| l.engine), Some(e));
        }
    }
}
