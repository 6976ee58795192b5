//! The pool's index protocol (design 3.1 - 3.5): lookup and hold, load
//! checks and release, claim (from a `FREE` slot, or by CLOCK eviction fused
//! with the claim), each rank's completion (the last one publishes), and
//! abandon; written once over [`PoolWords`], so the same code runs on a
//! pool file's mapping and, under loom and shuttle, on the sync facade.
//!
//! The slot array *is* the hash table: a key lives only in the `ways` slots
//! of its two sets ([`Key::sets`]; two-choice hashing, design 2.3: with one
//! set per key, sets overflowed at 73% full on the GPU run, 2026-12-07).
//! Every step is one CAS on one slot's state
//! word, retried with the word it found (a lost CAS means another process
//! made progress). The rules, each with the property it serves
//! (docs/node-pool-design.md 3.9, docs/PROOFS.md PL1-PL5):
//!
//! 1. A slot is `READABLE` only after every rank's bytes are complete: the
//!    CAS that sets the last rank's bit publishes (PL1, I1).
//! 2. A hold is a bit of the engine in the `READABLE` word; a claim, by
//!    eviction too, expects a word with no bits: a held slot is never
//!    overwritten (PL2, I2).
//! 3. A hold compares the key again once its bit is set: while a bit is
//!    set no claim can happen, so the read is exact whatever the epoch's
//!    width (design 3.7; PL2).
//! 4. A claim is a CAS from `FREE` or unheld `READABLE` to `WRITING(me,
//!    epoch + 1)`: of two claimers one fails (PL3, I3).
//! 5. A key is claimed only in its two sets (in the one with more `FREE`
//!    slots first), a lost CAS is decided again on the word found, and two
//!    full sets skip the key after `2 * ways` CLOCK steps in each without a
//!    claim: nothing outside them is evicted, nothing held is evicted, and
//!    a key with a `FREE` slot in either set never skips (PL5, I5).

use super::slot::{SlotError, SlotState, SlotWord};
use super::words::{Geometry, Key, PoolWords};
use crate::rules::{Knob, Rules};

/// What [`PoolTable::lookup`] found for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Readable and now held by the engine (its bit set; `fresh` when this
    /// call set it, false when the engine held it already).
    Hit {
        /// The slot.
        slot: u32,
        /// Its epoch, which every later step on the hold names.
        epoch: u32,
        /// Whether this lookup set the engine's bit.
        fresh: bool,
    },
    /// Being written by this engine: vLLM defers the request.
    Pending,
    /// Not readable here (absent, or being written by another engine).
    Miss,
}

/// What [`PoolTable::claim`] did for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Claimed: the engine writes slot `slot` at epoch `epoch`;
    /// `evicted` is the key the claim evicted, if any.
    Claimed {
        /// The slot.
        slot: u32,
        /// The new epoch.
        epoch: u32,
        /// The readable key this claim took the slot from.
        evicted: Option<Key>,
    },
    /// The key is readable or being written already: nothing to store.
    Present,
    /// Neither of its two sets has a claimable slot (every slot held or
    /// being written): left out, nothing changed.
    Skipped,
}

/// The index protocol over a pool's words (see the module docs).
pub struct PoolTable<W> {
    words: W,
    geometry: Geometry,
    knob: Knob,
}

impl<W: PoolWords> PoolTable<W> {
    /// The protocol over `words`.
    pub fn new(words: W) -> Self {
        let geometry = words.geometry();
        PoolTable { words, geometry, knob: Knob::default() }
    }

    /// The words.
    pub fn words(&self) -> &W {
        &self.words
    }

    /// The pool's shape.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Selects the negative variant the table runs (a model, before its
    /// threads start). Model builds only.
    #[cfg(any(loom, shuttle))]
    pub fn set_variant(&self, v: crate::protocol::Variant) {
        self.knob.set(v)
    }

    /// The rules this table runs (the shipped ones outside model builds).
    pub(crate) fn rules(&self) -> crate::rules::Active {
        self.knob.rules()
    }

    fn word(&self, slot: u32) -> SlotWord {
        SlotWord::decode(self.words.slot_load(slot as usize))
    }

    fn cas(&self, slot: u32, old: SlotWord, new: SlotWord) -> Result<(), SlotWord> {
        self.words.slot_cas(slot as usize, old.encode(), new.encode()).map(|_| ()).map_err(SlotWord::decode)
    }

    /// The slots of `key`'s two sets, or of every set where a negative
    /// says so.
    fn sets_of(&self, key: &Key) -> Candidates {
        let g = self.geometry;
        let [a, b] = key.sets(g.sets()).map(|s| s * g.ways..(s + 1) * g.ways);
        let two = a != b && self.knob.rules().claims_in_two_sets();
        let own = Candidates { ranges: [a, b], n: if two { 2 } else { 1 } };
        let every = Candidates { ranges: [0..g.slots, 0..0], n: 1 };
        self.knob.rules().evicts_within_set(own, every)
    }

    fn check_slot(&self, slot: u32) -> Result<(), SlotError> {
        if slot >= self.geometry.slots {
            return Err(SlotError::Invariant { word: u64::from(slot), what: "a slot index past the pool" });
        }
        Ok(())
    }

    /// Looks `key` up for `engine` and, if readable, holds it (design 3.1):
    /// its bit is set in the slot's word, the key compared again under the
    /// hold, the slot's CLOCK bit set.
    pub fn lookup(&self, engine: u8, key: &Key) -> Result<Lookup, SlotError> {
        let mut pending = false;
        for slot in self.sets_of(key).slots() {
            let mut w = self.word(slot);
            loop {
                match w.state() {
                    SlotState::Invalid => return Err(SlotError::Corrupt { word: w.encode() }),
                    SlotState::Free => break,
                    SlotState::Writing => {
                        // This engine's scheduler stored the key words
                        // itself, so for its own write the read is exact.
                        if w.engine() == engine && self.words.key_load(slot as usize) == *key {
                            pending = true;
                        }
                        break;
                    }
                    SlotState::Readable => {}
                }
                if self.words.key_load(slot as usize) != *key {
                    break;
                }
                let held = w.hold(engine, w.epoch())?;
                if held != w {
                    if let Err(found) = self.cas(slot, w, held) {
                        // Decide again on the word found: a new epoch is
                        // another key's, a new holder's bit is harmless.
                        w = found;
                        continue;
                    }
                }
                let fresh = held != w;
                // Rule 3: under the hold no claim can happen, so this
                // read is exact.
                if !self.knob.rules().hold_rechecks_key(|| self.words.key_load(slot as usize) == *key) {
                    if fresh {
                        self.release(engine, slot, w.epoch())?;
                    }
                    break;
                }
                self.words.clock_store(slot as usize, true);
                return Ok(Lookup::Hit { slot, epoch: w.epoch(), fresh });
            }
        }
        Ok(if pending { Lookup::Pending } else { Lookup::Miss })
    }

    /// Ends `engine`'s hold of `slot` at `epoch` (its last private hold):
    /// its bit is cleared (design 3.2; Release: its finished copy happens
    /// before any later claim).
    pub fn release(&self, engine: u8, slot: u32, epoch: u32) -> Result<(), SlotError> {
        self.check_slot(slot)?;
        let mut w = self.word(slot);
        loop {
            let new = w.release(engine, epoch)?;
            match self.cas(slot, w, new) {
                Ok(()) => return Ok(()),
                Err(found) => w = found,
            }
        }
    }

    /// Before a load is submitted (design 3.2): `slot` is `READABLE` at
    /// `epoch` with `engine`'s bit set.
    pub fn check_held(&self, engine: u8, slot: u32, epoch: u32) -> Result<(), SlotError> {
        self.check_slot(slot)?;
        let w = self.word(slot);
        // A release computed on the word checks state, epoch and bit.
        w.release(engine, epoch).map(|_| ())
    }

    /// Before a store is submitted (design 3.3 step 2): `slot` is being
    /// written by `engine` at `epoch`.
    pub fn check_writing(&self, engine: u8, slot: u32, epoch: u32) -> Result<(), SlotError> {
        self.check_slot(slot)?;
        self.word(slot).abandon(engine, epoch).map(|_| ())
    }

    /// Claims a slot for `key` in its two sets (design 3.3 step 1, 3.5):
    /// skipped if the key is readable or written already; else a `FREE`
    /// slot, in the set with more of them first; else CLOCK from each set's
    /// hand in turn, taking an unheld readable slot whose second chance is
    /// spent by the claim's own CAS. The key words are stored after the
    /// claim, before any rank publishes.
    pub fn claim(&self, engine: u8, key: &Key) -> Result<Placement, SlotError> {
        let mut cands = self.sets_of(key);
        // A key present (readable, or being written by anyone) is skipped;
        // the same pass counts each set's FREE slots (a hint).
        let mut free = [0u32; 2];
        for (i, range) in cands.ranges[..cands.n].iter().enumerate() {
            for slot in range.clone() {
                let w = self.word(slot);
                match w.state() {
                    SlotState::Invalid => return Err(SlotError::Corrupt { word: w.encode() }),
                    SlotState::Free => free[i] += 1,
                    SlotState::Writing | SlotState::Readable => {
                        if self.words.key_load(slot as usize) == *key {
                            return Ok(Placement::Present);
                        }
                    }
                }
            }
        }
        // A FREE slot, the emptier set first (two-choice hashing keeps the
        // sets level); a lost CAS is decided again on the word found
        // (rule 5).
        if free[1] > free[0] {
            cands.ranges.swap(0, 1);
        }
        for slot in cands.slots() {
            let mut w = self.word(slot);
            while w.state() == SlotState::Free {
                let new = w.claim(engine)?;
                match self.knob.rules().claims_by_cas(
                    || self.cas(slot, w, new),
                    || {
                        self.store_word(slot, new);
                        Ok(())
                    },
                ) {
                    Ok(()) => return Ok(self.claimed(slot, new, key, None)),
                    Err(found) if self.knob.rules().retries_lost_claim() => w = found,
                    Err(_) => return Ok(Placement::Skipped),
                }
            }
        }
        // CLOCK: at most 2 * ways steps from each set's hand, the sets in
        // turn.
        let ways = cands.ranges[0].len() as u32;
        for step in 0..2 * ways * cands.n as u32 {
            let range = &cands.ranges[step as usize % cands.n];
            let set = (range.start / self.geometry.ways) as usize;
            let slot = range.start + self.words.hand_next(set) % ways;
            let mut w = self.word(slot);
            loop {
                if w.state() != SlotState::Readable {
                    break;
                }
                let unheld = w.payload() == 0;
                if !self.knob.rules().evicts_only_unheld(unheld) {
                    break;
                }
                if self.words.clock_load(slot as usize) {
                    // Second chance.
                    self.words.clock_store(slot as usize, false);
                    break;
                }
                // The old key is stable while the word is unchanged, which
                // the CAS's expected word (its epoch) checks.
                let old = self.words.key_load(slot as usize);
                let new = SlotWord::writing(engine, SlotWord::next_epoch(w.epoch()), 0);
                if unheld {
                    debug_assert_eq!(w.take(engine, w.epoch()), Ok(new));
                }
                match self.cas(slot, w, new) {
                    Ok(()) => return Ok(self.claimed(slot, new, key, Some(old))),
                    Err(found) if self.knob.rules().retries_lost_claim() => w = found,
                    Err(_) => return Ok(Placement::Skipped),
                }
            }
        }
        Ok(Placement::Skipped)
    }

    fn claimed(&self, slot: u32, new: SlotWord, key: &Key, evicted: Option<Key>) -> Placement {
        self.words.key_store(slot as usize, key);
        self.words.note_writer(slot as usize, new.engine());
        self.words.clock_store(slot as usize, false);
        Placement::Claimed { slot, epoch: new.epoch(), evicted }
    }

    /// Sets a slot's word whatever it holds (a negative's "store"): a CAS
    /// loop on the word found each time, so no transition is checked.
    fn store_word(&self, slot: u32, new: SlotWord) {
        let mut cur = self.words.slot_load(slot as usize);
        while let Err(found) = self.words.slot_cas(slot as usize, cur, new.encode()) {
            cur = found;
        }
    }

    /// Rank `rank`'s bytes of `slot` are complete (design 3.3 step 2): its
    /// bit is set; the CAS that sets the last one publishes the slot
    /// `READABLE` (rule 1). Returns whether this call published.
    pub fn complete_rank(&self, engine: u8, slot: u32, epoch: u32, rank: u8) -> Result<bool, SlotError> {
        self.check_slot(slot)?;
        let ranks = self.geometry.ranks;
        let mut w = self.word(slot);
        loop {
            let next = w.complete_rank(engine, epoch, rank, ranks)?;
            let new = match self.knob.rules().publishes_when_complete(next.state() == SlotState::Readable) {
                true => SlotWord::readable(w.epoch(), 0),
                false => next,
            };
            match self.cas(slot, w, new) {
                Ok(()) => return Ok(new.state() == SlotState::Readable),
                Err(found) => w = found,
            }
        }
    }

    /// Abandons `engine`'s write of `slot` at `epoch` (a rank's copy
    /// failed, design 3.3 step 3): back to `FREE`, its partial bytes never
    /// visible. A slot already `READABLE` (every rank completed) is left.
    pub fn abandon(&self, engine: u8, slot: u32, epoch: u32) -> Result<bool, SlotError> {
        self.check_slot(slot)?;
        let mut w = self.word(slot);
        loop {
            if w.state() == SlotState::Readable && w.epoch() == epoch {
                return Ok(false);
            }
            let new = w.abandon(engine, epoch)?;
            match self.cas(slot, w, new) {
                Ok(()) => return Ok(true),
                Err(found) => w = found,
            }
        }
    }

    /// Sets `slot`'s CLOCK bit (vLLM's `touch`: recently used).
    pub fn touch(&self, slot: u32) {
        if slot < self.geometry.slots {
            self.words.clock_store(slot as usize, true);
        }
    }

    /// Counts of the slots by state, and of the held ones (for `pool ls`
    /// and stats).
    pub fn census(&self) -> Census {
        let mut c = Census::default();
        for slot in 0..self.geometry.slots {
            let w = self.word(slot);
            match w.state() {
                SlotState::Free => c.free += 1,
                SlotState::Writing => c.writing += 1,
                SlotState::Readable if w.payload() != 0 => {
                    c.readable += 1;
                    c.held += 1
                }
                SlotState::Readable => c.readable += 1,
                SlotState::Invalid => c.corrupt += 1,
            }
        }
        c
    }

    /// The invariants one can read off the words of a quiescent pool
    /// (design 3.9): every word's own ([`SlotWord::check`]), and I5: a
    /// slot that is not `FREE` holds a key one of whose two sets it is in.
    /// Returns the first broken one with its slot.
    pub fn check(&self) -> Result<(), (u32, SlotError)> {
        let g = self.geometry;
        for slot in 0..g.slots {
            let w = self.word(slot);
            w.check(g.engines, g.ranks).map_err(|e| (slot, e))?;
            if w.state() != SlotState::Free {
                let key = self.words.key_load(slot as usize);
                if !key.in_set(g.sets(), slot / g.ways) {
                    return Err((slot, SlotError::Invariant { word: w.encode(), what: "a key outside its set" }));
                }
            }
        }
        Ok(())
    }
}

/// The slots a key may be in: its two sets' (one range where both are the
/// same set), or every slot (N45's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Candidates {
    ranges: [std::ops::Range<u32>; 2],
    n: usize,
}

impl Candidates {
    /// The slots, the first range's first.
    fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranges[..self.n].iter().flat_map(|r| r.clone())
    }
}

/// Slots by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    /// `FREE` slots.
    pub free: u32,
    /// `WRITING` slots.
    pub writing: u32,
    /// `READABLE` slots (held ones included).
    pub readable: u32,
    /// `READABLE` slots some engine holds.
    pub held: u32,
    /// Slots in state 3.
    pub corrupt: u32,
}
