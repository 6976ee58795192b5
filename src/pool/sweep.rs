//! Engines joining and leaving the pool, and the sweep of a dead engine's
//! marks (design 2.4, 3 "Join", 3.6).
//!
//! An engine is an entry of the table; its index is its bit in reader
//! masks and the writer field of a `WRITING` word. Its first worker (rank
//! 0's, the *owner*) claims a `FREE` entry; the other ranks and the
//! scheduler register in its members word. The rules, each with the
//! property it serves (PL4: a process killed at any step leaves the pool
//! usable):
//!
//! 1. A member's record (pid, start time, pid namespace) is stored before
//!    its bit's CAS, and read after the members word: the oracle judges
//!    what the member wrote.
//! 2. An entry is dead when every member in its mask, and its owner, is
//!    gone; a member of another pid namespace, which its record cannot
//!    judge, is judged by the entry's member holds (rule 8).
//! 3. A sweep takes the entry first (owner CAS `LIVE -> RECLAIMING(me)`),
//!    then seals the members word (its generation moves on, so a late
//!    registration fails) and judges again; one member alive undoes the
//!    take. A `RECLAIMING` entry whose sweeper is gone is taken over.
//! 4. Each slot is reclaimed by CAS on the word read: a dead writer's slot
//!    goes to `FREE`, never `READABLE` (nothing half-written is served); a
//!    dead holder's bit is cleared, other engines' bits kept.
//! 5. The entry returns to `FREE` only after every slot's pass, so an engine
//!    given its index later finds no stale mark; every step is a CAS
//!    conditional on the word read, so a sweep cut by its own death, or run
//!    twice, is safe.
//! 6. The owner resets the entry's agreement words (P7, one per rank:
//!    [`super::agreement`]) to `UNSETTLED` after its claim and before its
//!    member bit, so its engine's ranks agree on words of this tenure,
//!    never on the outcome a previous engine of the entry left there (each
//!    word is written once per tenure: a settled or abandoned word of the
//!    last tenure would end a rank pageable, or worse, count as its peer's
//!    settled outcome).
//! 7. A process takes the entry's hold for its role
//!    ([`PoolWords::hold_entry`]) before the CAS that puts its pid in the
//!    owner word, and keeps it while the word names it (the owner until its
//!    leave clears its member bit, a sweeper until the entry is `FREE` or
//!    the take undone): the
//!    owner word's process is judged by its hold
//!    ([`PoolWords::named_liveness`]), which on a pool file is a kernel
//!    lock, never by a pid another pid namespace or a reuse could confuse.
//! 8. Every member takes its entry's member hold
//!    ([`PoolWords::hold_member`]) before the CAS that sets its bit, and
//!    gives it back after its leave clears the bit. A member whose record
//!    cannot be judged (another pid namespace: [`Liveness::Foreign`]) is
//!    judged by the entry's member holds
//!    ([`PoolWords::foreign_member_liveness`]): none held, every member of
//!    the entry is gone, whatever its namespace, so an engine of another
//!    container that died is swept from ours, not kept for good.

use thiserror::Error;

use super::closing::PoolWord;
use super::engines::{MembersWord, OwnerState, OwnerWord, MEMBER_MASK};
use super::slot::{SlotError, SlotState, SlotWord};
use super::table::PoolTable;
use super::words::{EntryRole, Liveness, Member, PoolWords};
use crate::protocol::agreement::UNSETTLED;
use crate::rules::Rules;

/// An engine's place in the table: its index and the owner generation it
/// joined at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The entry's index: the engine's bit and writer field.
    pub engine: u8,
    /// The owner word's generation of this engine's tenure.
    pub generation: u32,
}

/// Why an engine could not join.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum JoinError {
    /// Every entry is taken by a live engine.
    #[error("the pool's {entries} engine entries are all taken by live engines (owner pids {owners:?})")]
    EnginesFull {
        /// Entries in the table.
        entries: u8,
        /// The owner pid of each taken entry.
        owners: Vec<u32>,
    },
    /// A word of the table that this version never writes.
    #[error("engine entry {engine} has a corrupt owner word {word:#018x}")]
    Corrupt {
        /// The entry.
        engine: u8,
        /// The raw owner word.
        word: u64,
    },
    /// A slot word this version never writes, met by the sweep.
    #[error(transparent)]
    Slot(#[from] SlotError),
    /// The pool is being closed or removed (`pool::closing` rule 1): the
    /// join was left; open the pool again.
    #[error("{}", closing_text(*word))]
    Closing {
        /// The pool word the join found.
        word: u64,
    },
    /// The member hold (rule 8) could not be taken: the call that takes it
    /// failed (logged).
    #[error("cannot take the member hold of engine entry {engine} (a kernel lock of the index file; see the log)")]
    MemberHold {
        /// The entry.
        engine: u8,
    },
    /// A member index past the scheduler and 32 ranks.
    #[error("member {member} is out of range (0 the scheduler, 1 + r rank r's worker, r < 32)")]
    MemberOutOfRange {
        /// The index given.
        member: u8,
    },
}

fn closing_text(word: u64) -> String {
    use super::closing::PoolWord;
    match PoolWord::decode(word).closer() {
        Some(c) if c.removing => {
            format!("the pool is being removed by pid {}: open it again (a fresh pool is made once it is gone)", c.pid)
        }
        Some(c) => format!("the pool is being closed by pid {} (it may stay): open it again", c.pid),
        None => format!("the pool word {word:#018x} is not READY: open the pool again"),
    }
}

/// Where a sweep is; the sweep asks its observer at each step whether to go
/// on (a model or a crash test stops it there, as a process killed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SweepStep {
    /// The entry is taken (`RECLAIMING`, this sweeper's pid).
    Taken,
    /// The members word is sealed and every member judged gone.
    Sealed,
    /// Slot `n`'s word is reclaimed.
    Slot(u32),
    /// The members word is cleared; the entry is about to be `FREE`.
    Cleared,
}

/// How a sweep of one entry ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Swept {
    /// The entry's marks are gone and the entry is `FREE`.
    Freed,
    /// The entry is not dead (a member lives or cannot be judged), or is
    /// not `LIVE`/`RECLAIMING` by a dead sweeper: nothing done (or the take
    /// undone).
    NotDead,
    /// Another process changed the entry first (it sweeps it, or it moved).
    Raced,
    /// The observer stopped the sweep at a step (a model's death).
    Stopped,
}

/// Passes of `join_owner` over the entries while a `FREE` one's hold was
/// taken by another process.
const JOIN_PASSES: u32 = 3;

fn bit(member: u8) -> Result<u64, JoinError> {
    if u64::from(member) >= 33 {
        return Err(JoinError::MemberOutOfRange { member });
    }
    Ok(1 << member)
}

impl<W: PoolWords> PoolTable<W> {
    /// The owner (rank 0's worker, member `member`) joins: dead entries are
    /// swept, then a `FREE` entry is claimed, its engine id written and the
    /// owner's member bit set.
    pub fn join_owner(&self, member: u8, me: &Member, engine_id: &[u64; 4]) -> Result<Lease, JoinError> {
        let mine = bit(member)?;
        self.sweep_dead(me, &mut |_| true)?;
        let words = self.words();
        let mut owners = Vec::new();
        // A FREE entry whose hold another process has (a claimer racing
        // this one, whose CAS may yet fail) is tried again on the next
        // pass, a few passes at most.
        let mut passes = 0;
        let mut contended = true;
        while contended && passes < JOIN_PASSES {
            passes += 1;
            contended = false;
            owners.clear();
            for engine in 0..self.geometry().engines {
                let raw = words.owner_load(engine);
                let o = OwnerWord::decode(raw);
                match o.state {
                    OwnerState::Free => {}
                    OwnerState::Invalid => return Err(JoinError::Corrupt { engine, word: raw }),
                    OwnerState::Live | OwnerState::Reclaiming => {
                        owners.push(o.pid);
                        continue;
                    }
                }
                // Rule 7: the owner's hold before the CAS that names it.
                if !words.hold_entry(engine, EntryRole::Owner) {
                    contended = true;
                    owners.push(OwnerWord::decode(words.owner_load(engine)).pid);
                    continue;
                }
                // Rule 8: the member hold before the bit (taken before the
                // claim, so a failure leaves nothing to undo).
                if !words.hold_member(engine) {
                    words.release_entry(engine, EntryRole::Owner);
                    return Err(JoinError::MemberHold { engine });
                }
                let generation = OwnerWord::next_generation(o.generation);
                let live = OwnerWord { state: OwnerState::Live, generation, pid: me.pid };
                if words.owner_cas(engine, raw, live.encode()).is_err() {
                    words.release_member(engine);
                    words.release_entry(engine, EntryRole::Owner);
                    owners.push(OwnerWord::decode(words.owner_load(engine)).pid);
                    continue;
                }
                // Rule 6: fresh agreement words for this tenure. The reset
                // comes before the owner's member bit, and every other member
                // registers only once it sees that bit (join_member: an
                // Acquire load of the members word, which the bit's CAS below
                // releases), so it sees the reset words before it settles its
                // own (SeqCst, after its registration). No rank of a previous
                // tenure writes them any more: that engine was swept (every
                // member gone) or every member left, and a worker leaves only
                // once its offloader's shutdown joined the pinner that agrees.
                for rank in 0..self.geometry().ranks {
                    words.agreement_store(engine, rank, UNSETTLED);
                }
                // Rule 1: the id and the record before the bit.
                words.engine_id_store(engine, engine_id);
                words.member_store(engine, member, me);
                let mut cur = words.members_load(engine);
                loop {
                    let m = MembersWord::decode(cur);
                    let new = MembersWord { mask: mine, generation: MembersWord::next_generation(m.generation) };
                    match words.members_cas(engine, cur, new.encode()) {
                        // `pool::closing` rule 1: a closer at work is seen.
                        Ok(_) => return self.check_open(Lease { engine, generation }, member, me),
                        Err(found) => cur = found,
                    }
                }
            }
        }
        Err(JoinError::EnginesFull { entries: self.geometry().engines, owners })
    }

    /// Another member (a rank's worker, the scheduler) registers with the
    /// live entry whose owner wrote `engine_id`. `Ok(None)` while no such
    /// entry is live yet: the caller polls, bounded and interruptible.
    ///
    /// A member's join meets a close as the owner's does (`pool::closing`
    /// rule 1): it reads the pool word after its bit's CAS and leaves if
    /// the pool is not `READY` ([`JoinError::Closing`]); and a pool being
    /// removed is refused before it looks for its entry, so a member that
    /// polls a pool removed under it learns it at once and opens the name
    /// again, where its owner joins the fresh pool.
    pub fn join_member(&self, member: u8, me: &Member, engine_id: &[u64; 4]) -> Result<Option<Lease>, JoinError> {
        let mine = bit(member)?;
        let words = self.words();
        let checks = self.rules().members_check_closing();
        let word = words.pool_word_load();
        if checks && PoolWord::decode(word).is_removing() {
            return Err(JoinError::Closing { word });
        }
        for engine in 0..self.geometry().engines {
            let o = OwnerWord::decode(words.owner_load(engine));
            if o.state != OwnerState::Live {
                continue;
            }
            // The owner's bit published its id (rule 1).
            let mut cur = words.members_load(engine);
            if cur & MEMBER_MASK == 0 || words.engine_id_load(engine) != *engine_id {
                continue;
            }
            // Rule 8: the member hold before the bit.
            if !words.hold_member(engine) {
                return Err(JoinError::MemberHold { engine });
            }
            words.member_store(engine, member, me);
            loop {
                let m = MembersWord::decode(cur);
                let new = MembersWord { mask: m.mask | mine, generation: m.generation };
                match words.members_cas(engine, cur, new.encode()) {
                    Ok(_) => {
                        // A seal may have come between the owner read and
                        // this CAS only if the generation moved, which the
                        // CAS expected not to: the entry is still ours.
                        // `pool::closing` rule 1: a closer at work is seen.
                        let lease = Lease { engine, generation: o.generation };
                        return if checks { self.check_open(lease, member, me).map(Some) } else { Ok(Some(lease)) };
                    }
                    Err(found) => {
                        if MembersWord::decode(found).generation != m.generation {
                            // Sealed by a sweep: judged with the others.
                            words.release_member(engine);
                            return Ok(None);
                        }
                        cur = found;
                    }
                }
            }
        }
        Ok(None)
    }

    /// Member `member` of `lease` leaves: its bit is cleared; the last to
    /// leave reclaims the entry's marks and frees it (rules 3-5). Its holds
    /// should be released and its writes abandoned or published first; any
    /// left are reclaimed here.
    pub fn leave(&self, lease: Lease, member: u8, me: &Member) -> Result<(), JoinError> {
        self.leave_observed(lease, member, me, &mut |_| true).map(|_| ())
    }

    /// [`PoolTable::leave`], asking `step` at each step of the last
    /// leaver's reclaim ([`SweepStep`]: the entry taken, sealed, each slot,
    /// the members cleared) whether to go on, as [`PoolTable::sweep_engine`]
    /// does (a crash test stops it there). False when `step` stopped it;
    /// the entry is then `RECLAIMING` by this process, which a sweep takes
    /// over once it is gone.
    pub fn leave_observed(
        &self,
        lease: Lease,
        member: u8,
        me: &Member,
        step: &mut dyn FnMut(SweepStep) -> bool,
    ) -> Result<bool, JoinError> {
        let mine = bit(member)?;
        let words = self.words();
        let engine = lease.engine;
        // A lease of an ended tenure (the entry freed, whose generation
        // then moved on, perhaps claimed again) leaves nothing: a bit of
        // its member there is the new tenure's. (The Rust API lets a
        // `Lease`, which is `Copy`, be used again; Python's `Pool` cannot.
        // A second leave racing the entry's free and a new claim between
        // this check and the CAS below is not caught.)
        if OwnerWord::decode(words.owner_load(engine)).generation != lease.generation {
            return Ok(true);
        }
        let mut cur = words.members_load(engine);
        let last = loop {
            let m = MembersWord::decode(cur);
            if m.mask & mine == 0 {
                // Left already (a second leave; a live member's bit is
                // cleared by nobody else: a sweep undoes its take when one
                // lives): its holds were given back then, and the handle's
                // holds for its other members stay.
                return Ok(true);
            }
            let new = MembersWord { mask: m.mask & !mine, generation: m.generation };
            match words.members_cas(engine, cur, new.encode()) {
                Ok(_) => break (new.mask == 0).then_some(new),
                Err(found) => cur = found,
            }
        };
        // Its member bit is cleared: the owner's hold ends with its tenure
        // (rule 7; a no-op for the other members), before the entry can be
        // freed, so a claimer never finds a FREE entry still held. Judged
        // from here by the other members' records, or, with none left, by
        // the hold given back: gone, which a sweep may act on (every member
        // has left).
        words.release_entry(engine, EntryRole::Owner);
        // Rule 8: its member hold with its bit.
        words.release_member(engine);
        let Some(empty) = last else { return Ok(true) };
        let raw = words.owner_load(engine);
        let o = OwnerWord::decode(raw);
        if o.state != OwnerState::Live || o.generation != lease.generation {
            return Ok(true);
        }
        // Rule 7: the sweeper's hold before the CAS that names it; held
        // by another process, that one reclaims the entry.
        if !words.hold_entry(engine, EntryRole::Sweeper) {
            return Ok(true);
        }
        let taken = OwnerWord { state: OwnerState::Reclaiming, generation: o.generation, pid: me.pid };
        if words.owner_cas(engine, raw, taken.encode()).is_err() {
            words.release_entry(engine, EntryRole::Sweeper);
            return Ok(true);
        }
        if !step(SweepStep::Taken) {
            return Ok(false);
        }
        let sealed = MembersWord { mask: 0, generation: MembersWord::next_generation(empty.generation) };
        if words.members_cas(engine, empty.encode(), sealed.encode()).is_err() {
            // A member registered meanwhile: the entry stays its engine's.
            let _ = words.owner_cas(engine, taken.encode(), raw);
            words.release_entry(engine, EntryRole::Sweeper);
            return Ok(true);
        }
        if !step(SweepStep::Sealed) || !self.reclaim_held(engine, step)? || !step(SweepStep::Cleared) {
            return Ok(false);
        }
        self.free_entry(engine, taken);
        words.release_entry(engine, EntryRole::Sweeper);
        Ok(true)
    }

    /// Sweeps every dead entry (rule 2); returns the entries freed.
    pub fn sweep_dead(&self, me: &Member, step: &mut dyn FnMut(SweepStep) -> bool) -> Result<Vec<u8>, SlotError> {
        let mut freed = Vec::new();
        for engine in 0..self.geometry().engines {
            if self.sweep_engine(engine, me, step)? == Swept::Freed {
                freed.push(engine);
            }
        }
        Ok(freed)
    }

    /// The liveness of an entry's members (and its owner): `Gone` only when
    /// every one is gone (rule 2).
    fn judge(&self, engine: u8, mask: u64, owner_pid: u32, me: &Member) -> Liveness {
        let words = self.words();
        let mut owner_judged = false;
        for member in 0..33u8 {
            if mask & (1 << member) == 0 {
                continue;
            }
            let record = words.member_load(engine, member);
            owner_judged |= record.pid == owner_pid;
            match words.liveness(&record) {
                Liveness::Gone => {}
                // Rule 8: by the entry's member holds.
                Liveness::Foreign => match words.foreign_member_liveness(engine) {
                    Liveness::Gone => {}
                    other => return other,
                },
                other => return other,
            }
        }
        if !owner_judged && owner_pid != 0 {
            // Only the pid is known (its record is not in the mask): judged
            // by its hold (rule 7).
            return words.named_liveness(engine, EntryRole::Owner, owner_pid, me);
        }
        Liveness::Gone
    }

    /// Sweeps entry `engine` if it is dead (rules 2-5), asking `step` at
    /// each step whether to go on.
    pub fn sweep_engine(
        &self,
        engine: u8,
        me: &Member,
        step: &mut dyn FnMut(SweepStep) -> bool,
    ) -> Result<Swept, SlotError> {
        let words = self.words();
        let raw = words.owner_load(engine);
        let o = OwnerWord::decode(raw);
        let m = MembersWord::decode(words.members_load(engine));
        let dead = match o.state {
            OwnerState::Free | OwnerState::Invalid => false,
            OwnerState::Live => self.judge(engine, m.mask, o.pid, me) == Liveness::Gone,
            OwnerState::Reclaiming => {
                o.pid != me.pid && words.named_liveness(engine, EntryRole::Sweeper, o.pid, me) == Liveness::Gone
            }
        };
        if !dead {
            return Ok(Swept::NotDead);
        }
        // Rule 7: the sweeper's hold before the CAS that names it (a
        // process that took it since the judgment sweeps the entry itself).
        if !words.hold_entry(engine, EntryRole::Sweeper) {
            return Ok(Swept::Raced);
        }
        let taken = OwnerWord { state: OwnerState::Reclaiming, generation: o.generation, pid: me.pid };
        if words.owner_cas(engine, raw, taken.encode()).is_err() {
            words.release_entry(engine, EntryRole::Sweeper);
            return Ok(Swept::Raced);
        }
        if !step(SweepStep::Taken) {
            return Ok(Swept::Stopped);
        }
        // Seal: a registration expecting the old generation fails.
        let mut cur = words.members_load(engine);
        let sealed = loop {
            let m = MembersWord::decode(cur);
            let new = MembersWord { mask: m.mask, generation: MembersWord::next_generation(m.generation) };
            match words.members_cas(engine, cur, new.encode()) {
                Ok(_) => break new,
                Err(found) => cur = found,
            }
        };
        let owner_pid = words.member_load(engine, 1).pid;
        if self.judge(engine, sealed.mask, 0, me) != Liveness::Gone {
            // Undo the take: the entry is its engine's (its owner is rank
            // 0's worker, member 1).
            let live = OwnerWord { state: OwnerState::Live, generation: o.generation, pid: owner_pid };
            let _ = words.owner_cas(engine, taken.encode(), live.encode());
            words.release_entry(engine, EntryRole::Sweeper);
            return Ok(Swept::NotDead);
        }
        if !step(SweepStep::Sealed) {
            return Ok(Swept::Stopped);
        }
        if !self.reclaim_held(engine, step)? {
            return Ok(Swept::Stopped);
        }
        let mut cur = words.members_load(engine);
        loop {
            let m = MembersWord::decode(cur);
            let cleared = MembersWord { mask: 0, generation: m.generation };
            match words.members_cas(engine, cur, cleared.encode()) {
                Ok(_) => break,
                Err(found) => cur = found,
            }
        }
        if !step(SweepStep::Cleared) {
            return Ok(Swept::Stopped);
        }
        let freed = self.free_entry(engine, taken);
        words.release_entry(engine, EntryRole::Sweeper);
        Ok(if freed { Swept::Freed } else { Swept::Raced })
    }

    fn free_entry(&self, engine: u8, taken: OwnerWord) -> bool {
        let free =
            OwnerWord { state: OwnerState::Free, generation: OwnerWord::next_generation(taken.generation), pid: 0 };
        self.words().owner_cas(engine, taken.encode(), free.encode()).is_ok()
    }

    /// [`Self::reclaim_slots`] by the holder of entry `dead`'s sweeper
    /// hold, which a corrupt slot word's error gives back: the entry stays
    /// `RECLAIMING`, for another process to try rather than stuck while
    /// this one lives (rule 7).
    fn reclaim_held(&self, dead: u8, step: &mut dyn FnMut(SweepStep) -> bool) -> Result<bool, SlotError> {
        let r = self.reclaim_slots(dead, step);
        if r.is_err() {
            self.words().release_entry(dead, EntryRole::Sweeper);
        }
        r
    }

    /// Rule 4 over every slot; false when `step` stopped it.
    fn reclaim_slots(&self, dead: u8, step: &mut dyn FnMut(SweepStep) -> bool) -> Result<bool, SlotError> {
        let words = self.words();
        let rules = self.rules();
        for slot in 0..self.geometry().slots {
            let read = words.slot_load(slot as usize);
            let w = SlotWord::decode(read);
            let target = |w: SlotWord| -> Result<SlotWord, SlotError> {
                let freed = w.reclaim(dead)?;
                Ok(if w.state() == SlotState::Writing && w.engine() == dead {
                    rules.sweep_frees_dead_writes(freed, SlotWord::readable(w.epoch(), 0))
                } else {
                    freed
                })
            };
            let new = target(w)?;
            if new != w {
                rules.sweeps_by_cas(
                    || -> Result<(), SlotError> {
                        let mut cur = read;
                        loop {
                            let new = target(SlotWord::decode(cur))?;
                            if new.encode() == cur {
                                return Ok(());
                            }
                            match words.slot_cas(slot as usize, cur, new.encode()) {
                                Ok(_) => return Ok(()),
                                Err(found) => cur = found,
                            }
                        }
                    },
                    || {
                        // The word computed from the first read, set
                        // whatever it is now.
                        let mut cur = words.slot_load(slot as usize);
                        while let Err(found) = words.slot_cas(slot as usize, cur, new.encode()) {
                            cur = found;
                        }
                        Ok(())
                    },
                )?;
            }
            if !step(SweepStep::Slot(slot)) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}
