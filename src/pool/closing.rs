//! Closing a pool (design 1.1 and 1.4): removing it only while no engine is
//! registered, whether `kvoffload pool rm` asks or the last engine of a
//! pool not kept (`kvo_pool_keep: false`) leaves.
//!
//! The pool word (the index file's pool page) is `INIT(creator pid)` while
//! the pool is made, `READY` once it is, and `CLOSING(closer pid)` while a
//! closer decides, then `CLOSING(closer pid | REMOVING)` once it has decided
//! and removes the files. An engine is registered while its entry's owner
//! word is not `FREE` (its owner, rank 0's worker, claimed it; the other
//! ranks and the scheduler are members of that entry). The rules, each with
//! the property it serves (PL6: a pool is removed only while no engine is
//! registered on it, unless forced, and no engine stays registered on a
//! pool that was removed; the last of engines that all leave a pool not kept
//! removes it):
//!
//! 1. A joiner (the owner after its claim, any other member after its
//!    bit) reads the pool word by a read-modify-write
//!    ([`PoolWords::pool_word_rmw`]), and goes on only if it is `READY`;
//!    else it leaves its entry and joins again once the close is undone,
//!    or, the pool being removed, opens the name again (an open waits
//!    while a removal's closer lives, [`PoolTable::closer`]). A closer
//!    changes the word by CAS before it reads the owner words. Of a claim
//!    (or a member's bit) and a close, whichever of the two pool-word
//!    operations comes second in the word's order sees the other: the
//!    joiner's read finds `CLOSING`, or the closer's CAS reads what the
//!    joiner's read-modify-write released, so its owner-word loads
//!    (Acquire) come after the claim (a member's bit comes after the
//!    owner's claim it read, so the closer finds that entry taken). A
//!    plain load by the joiner would not do: nothing would order it
//!    against the closer's CAS (the store-buffer pattern).
//! 2. The decision is tentative first: `READY -> CLOSING(me)`, then every
//!    owner word; one not `FREE` (and no `force`) puts the word back to
//!    `READY` and the pool stays. Only with none does the closer CAS to
//!    `REMOVING(me)`, final: from there the files go (the rows' region,
//!    then the index file, each by inode), undone only if refused before
//!    any went (rule 5). A closer that scanned first and then changed the
//!    word would remove a pool an engine joined between the two.
//! 3. A closer holds the pool's closer hold ([`PoolWords::hold_closer`],
//!    on a file a kernel lock) before the CAS that names it and until the
//!    word is back to `READY` or the files are gone, so a closer killed
//!    midway is told from one at work ([`PoolWords::closer_liveness`]).
//!    One found gone while tentative is undone (`CLOSING -> READY`, by a
//!    closer or a joiner: it removed nothing); one found gone while
//!    `REMOVING` is taken over (`REMOVING(it) -> REMOVING(me)`), and the
//!    taker finishes the removal (on a file, only if the index name still
//!    names the file it holds: else the removal finished, and a new pool
//!    may be under the name).
//! 4. A closer that finds another closer alive waits for it and tries again
//!    (bounded by its caller): of two last engines leaving at once, the one
//!    whose tentative close saw the other's entry puts the word back, and
//!    the other, trying again, finds no entry and removes the pool.
//! 5. A removal refused before it removed anything (a file of the pool
//!    that fails the trust checks, a region lock held past its wait) puts
//!    the word back from `REMOVING(me)` to `READY` before the closer's
//!    hold goes: nothing was removed, so the pool stays usable, as for a
//!    close that found an engine. One that removed a file is final: a
//!    later closer takes it over (rule 3).

use thiserror::Error;

use super::engines::{OwnerState, OwnerWord};
use super::sweep::{JoinError, Lease};
use super::table::PoolTable;
use super::words::{Liveness, Member, PoolWords};
use crate::rules::Rules;

/// The pool's state (bits 62-63 of the pool word).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolState {
    /// Being made by the creator (the word's low half: its pid; 0 before
    /// it wrote it). Zero: a file fresh from `ftruncate`.
    Init,
    /// Made: engines may join.
    Ready,
    /// A closer decides (the low half: its pid), or removes the pool
    /// ([`REMOVING`] set).
    Closing,
    /// Code 3: never written by this version.
    Invalid,
}

/// The bit of a `CLOSING` word's low half that marks the closer's decision
/// final: the pool's files are being removed.
pub const REMOVING: u32 = 1 << 31;

/// The pool word, by value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolWord {
    /// The state.
    pub state: PoolState,
    /// `Init`: the creator's pid; `Closing`: the closer's pid, with
    /// [`REMOVING`] once final; else 0.
    pub value: u32,
}

impl PoolWord {
    /// `READY`.
    pub const READY: PoolWord = PoolWord { state: PoolState::Ready, value: 0 };

    /// Decodes a raw pool word.
    pub fn decode(raw: u64) -> PoolWord {
        let state = match raw >> 62 {
            0 => PoolState::Init,
            1 => PoolState::Ready,
            2 => PoolState::Closing,
            _ => PoolState::Invalid,
        };
        PoolWord { state, value: raw as u32 }
    }

    /// Encodes it.
    pub fn encode(self) -> u64 {
        let s: u64 = match self.state {
            PoolState::Init => 0,
            PoolState::Ready => 1,
            PoolState::Closing => 2,
            PoolState::Invalid => 3,
        };
        (s << 62) | u64::from(self.value)
    }

    /// `CLOSING` by `pid`, final when `removing`.
    pub fn closing(pid: u32, removing: bool) -> PoolWord {
        PoolWord { state: PoolState::Closing, value: (pid & !REMOVING) | if removing { REMOVING } else { 0 } }
    }

    /// The closer a `CLOSING` word names.
    pub fn closer(self) -> Option<Closer> {
        (self.state == PoolState::Closing)
            .then_some(Closer { pid: self.value & !REMOVING, removing: self.value & REMOVING != 0 })
    }

    /// A closer has decided: the pool's files are being removed (a join
    /// that meets it opens the name again; a tentative close is waited for).
    pub fn is_removing(self) -> bool {
        self.closer().is_some_and(|c| c.removing)
    }
}

/// A closer at work, as the pool word names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Closer {
    /// Its pid (in its own pid namespace).
    pub pid: u32,
    /// Decided: the pool's files are being removed.
    pub removing: bool,
}

/// Where a close is; its observer says whether to go on (a model or a crash
/// test stops it there, as a process killed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseStep {
    /// The word is `CLOSING(me)`, tentative.
    Tentative,
    /// The word is `REMOVING(me)`: the caller removes the files next.
    Decided,
}

/// How a close ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Close {
    /// The word is `REMOVING(me)` and this process holds the closer's hold:
    /// the caller removes the pool's files, then gives the hold back
    /// ([`PoolWords::release_closer`]). The entries registered that `force`
    /// went over.
    Remove {
        /// Entries not `FREE` at the decision (empty without `force`).
        over: Vec<u8>,
    },
    /// Entries not `FREE`: the word is back to `READY`, the pool stays.
    InUse(Vec<u8>),
    /// Another closer that lives is at work: wait and try again.
    Busy(Closer),
    /// The observer stopped it at a step (the word stays as it left it,
    /// this process's hold with it: judged gone once it is).
    Stopped,
}

/// The pool word is neither `READY` nor `CLOSING`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("the pool word {word:#018x} is neither READY nor CLOSING")]
pub struct NotReady {
    /// The raw word.
    pub word: u64,
}

/// Compare-and-swaps lost to other closers before a close gives up with
/// [`Close::Busy`] (each loss is another process's progress).
const CLOSE_PASSES: u32 = 8;

impl<W: PoolWords> PoolTable<W> {
    /// The closer the pool word names now, if any (an open or a join that
    /// found the pool closing waits while it lives).
    pub fn closer(&self) -> Option<Closer> {
        PoolWord::decode(self.words().pool_word_rmw()).closer()
    }

    /// Rule 1, after a join: the pool word read by a read-modify-write; on
    /// anything but `READY`, the lease is left and the join refused
    /// ([`JoinError::Closing`]).
    pub(crate) fn check_open(&self, lease: Lease, member: u8, me: &Member) -> Result<Lease, JoinError> {
        if !self.rules().joins_check_closing() {
            return Ok(lease);
        }
        let words = self.words();
        let read =
            || if self.rules().join_reads_word_by_rmw() { words.pool_word_rmw() } else { words.pool_word_load() };
        let mut raw = read();
        // Rule 3: a tentative close whose closer is gone is undone here
        // too, or nobody would (it removed nothing).
        if let Some(c) = PoolWord::decode(raw).closer().filter(|c| !c.removing && !self.closer_lives(*c, me)) {
            if words.hold_closer() {
                let _ = words.pool_word_cas(raw, PoolWord::READY.encode());
                words.release_closer();
                tracing::warn!(closer = c.pid, "undid the tentative close of a closer that is gone");
            }
            raw = read();
        }
        if PoolWord::decode(raw).state == PoolState::Ready {
            return Ok(lease);
        }
        self.leave(lease, member, me)?;
        Err(JoinError::Closing { word: raw })
    }

    /// Whether process `pid`, named by the word as its closer, lives.
    fn closer_lives(&self, c: Closer, me: &Member) -> bool {
        self.words().closer_liveness(c.pid, me) != Liveness::Gone
    }

    /// One attempt to close the pool (rules 2-4) as `me`; the entries not
    /// `FREE` keep it unless `force`. [`Close::Remove`]: the caller removes
    /// the files and gives back the closer's hold. Dead engines should be
    /// swept first ([`PoolTable::sweep_dead`]): their entries count as
    /// registered.
    pub fn close(&self, me: &Member, force: bool, step: &mut dyn FnMut(CloseStep) -> bool) -> Result<Close, NotReady> {
        let words = self.words();
        let rules = self.rules();
        for _ in 0..CLOSE_PASSES {
            let raw = words.pool_word_rmw();
            let w = PoolWord::decode(raw);
            match w.state {
                PoolState::Init | PoolState::Invalid => return Err(NotReady { word: raw }),
                PoolState::Closing => {
                    let c = w.closer().expect("a CLOSING word names its closer");
                    if self.closer_lives(c, me) {
                        return Ok(Close::Busy(c));
                    }
                    // Rule 3: a dead closer's tentative close is undone, its
                    // removal taken over.
                    if !words.hold_closer() {
                        return Ok(Close::Busy(c));
                    }
                    let next = if c.removing { PoolWord::closing(me.pid, true) } else { PoolWord::READY };
                    if words.pool_word_cas(raw, next.encode()).is_err() || !c.removing {
                        words.release_closer();
                        continue;
                    }
                    if !step(CloseStep::Decided) {
                        return Ok(Close::Stopped);
                    }
                    return Ok(Close::Remove { over: Vec::new() });
                }
                PoolState::Ready => {}
            }
            if !words.hold_closer() {
                return Ok(Close::Busy(Closer { pid: 0, removing: false }));
            }
            let tentative = rules.closes_tentatively();
            if tentative {
                let mine = PoolWord::closing(me.pid, false).encode();
                if words.pool_word_cas(raw, mine).is_err() {
                    words.release_closer();
                    continue;
                }
                if !step(CloseStep::Tentative) {
                    return Ok(Close::Stopped);
                }
            }
            let in_use: Vec<u8> = (0..self.geometry().engines)
                .filter(|&e| OwnerWord::decode(words.owner_load(e)).state != OwnerState::Free)
                .collect();
            let from = if tentative { PoolWord::closing(me.pid, false).encode() } else { raw };
            if !in_use.is_empty() && !force {
                if tentative {
                    // Only this holder changes its own tentative word while
                    // it lives (rule 3), so this CAS does not fail.
                    let _ = words.pool_word_cas(from, PoolWord::READY.encode());
                }
                words.release_closer();
                return Ok(Close::InUse(in_use));
            }
            if words.pool_word_cas(from, PoolWord::closing(me.pid, true).encode()).is_err() {
                words.release_closer();
                continue;
            }
            if !step(CloseStep::Decided) {
                return Ok(Close::Stopped);
            }
            return Ok(Close::Remove { over: in_use });
        }
        let c = PoolWord::decode(words.pool_word_rmw()).closer().unwrap_or(Closer { pid: 0, removing: false });
        Ok(Close::Busy(c))
    }
}

impl<W: PoolWords> PoolTable<W> {
    /// [`PoolTable::close`], waiting (rule 4) while another closer that
    /// lives decides: `wait` is called each time (false: give up, with
    /// [`Close::Busy`]). A closer found removing ends it too
    /// ([`Close::Busy`] with `removing`): the pool is going.
    pub fn close_waiting(
        &self,
        me: &Member,
        force: bool,
        wait: &mut dyn FnMut(Closer) -> bool,
        step: &mut dyn FnMut(CloseStep) -> bool,
    ) -> Result<Close, NotReady> {
        loop {
            match self.close(me, force, step)? {
                Close::Busy(c) if !c.removing && self.rules().waits_for_closer() && wait(c) => continue,
                other => return Ok(other),
            }
        }
    }
}

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use super::*;
    use crate::internal::pool::engines::MembersWord;
    use crate::internal::pool::words::{Geometry, LocalPoolWords};

    fn table() -> PoolTable<LocalPoolWords> {
        PoolTable::new(LocalPoolWords::new(Geometry { slots: 4, ways: 2, ranks: 1, engines: 2 }, 4))
    }

    #[test]
    fn pool_words_round_trip_and_name_their_closer() {
        for state in [PoolState::Init, PoolState::Ready, PoolState::Closing, PoolState::Invalid] {
            let w = PoolWord { state, value: u32::MAX };
            assert_eq!(PoolWord::decode(w.encode()), w);
        }
        assert_eq!(PoolWord::decode(0), PoolWord { state: PoolState::Init, value: 0 });
        let c = PoolWord::decode(PoolWord::closing(4_194_303, true).encode()).closer();
        assert_eq!(c, Some(Closer { pid: 4_194_303, removing: true }));
        assert_eq!(PoolWord::closing(7, false).closer(), Some(Closer { pid: 7, removing: false }));
        assert_eq!(PoolWord::READY.closer(), None);
    }

    /// A registered engine keeps the pool (the word back to `READY`); gone,
    /// the pool is removed; `force` goes over it; a join meeting a closer
    /// leaves and is refused.
    #[test]
    fn a_close_removes_only_an_unused_pool_unless_forced() {
        let t = table();
        let me = LocalPoolWords::process(1);
        let lease = t.join_owner(1, &LocalPoolWords::process(2), &[9; 4]).unwrap();
        assert_eq!(t.close(&me, false, &mut |_| true), Ok(Close::InUse(vec![lease.engine])));
        assert_eq!(PoolWord::decode(t.words().pool_word_rmw()), PoolWord::READY, "put back");
        assert_eq!(t.close(&me, true, &mut |_| true), Ok(Close::Remove { over: vec![lease.engine] }));
        t.words().release_closer();
        let closer = t.closer().unwrap();
        assert_eq!(closer, Closer { pid: 1, removing: true });
        let e = t.join_owner(1, &LocalPoolWords::process(3), &[8; 4]).unwrap_err();
        assert!(matches!(e, JoinError::Closing { .. }), "{e}");
        assert!(e.to_string().contains("being removed"), "{e}");
        let other = 1 - lease.engine;
        let state = OwnerWord::decode(t.words().owner_load(other)).state;
        assert_eq!(state, OwnerState::Free, "the refused joiner left its entry");
    }

    /// A member (the scheduler, a rank past 0) meets a close as the owner
    /// does: a tentative one makes it leave its bit (it polls again), a
    /// removal refuses it at once, even with no entry to join. (Without
    /// the member's check, N54, `model/pl6_closing.rs`'s `member` finds it
    /// registered on a removed pool.)
    #[test]
    fn a_member_meeting_a_close_leaves_and_one_of_a_removed_pool_is_refused() {
        let scheduler = LocalPoolWords::process(3);
        let owner = LocalPoolWords::process(2);
        let members = |t: &PoolTable<LocalPoolWords>, e: u8| MembersWord::decode(t.words().members_load(e)).mask;
        let t = table();
        let lease = t.join_owner(1, &owner, &[9; 4]).unwrap();
        // A closer (alive) between its tentative word and its scan.
        let closer = LocalPoolWords::process(1);
        assert_eq!(t.close(&closer, false, &mut |s| s != CloseStep::Tentative), Ok(Close::Stopped));
        let tentative = t.words().pool_word_rmw();
        let r = t.join_member(0, &scheduler, &[9; 4]);
        assert!(matches!(r, Err(JoinError::Closing { word }) if word == tentative), "{r:?}");
        assert_eq!(members(&t, lease.engine), 1 << 1, "the scheduler's bit left");
        // Undone: it joins.
        t.words().pool_word_cas(tentative, PoolWord::READY.encode()).unwrap();
        t.words().release_closer();
        assert_eq!(t.join_member(0, &scheduler, &[9; 4]), Ok(Some(lease)));
        assert_eq!(members(&t, lease.engine), 0b11);
        t.leave(lease, 0, &scheduler).unwrap();
        t.leave(lease, 1, &owner).unwrap();
        assert_eq!(t.close(&closer, false, &mut |_| true), Ok(Close::Remove { over: vec![] }));
        // Removed: refused before any entry is looked for.
        let e = t.join_member(0, &scheduler, &[9; 4]).unwrap_err();
        assert!(matches!(e, JoinError::Closing { .. }) && e.to_string().contains("being removed"), "{e}");
    }

    /// A closer killed while tentative is undone; killed while removing, is
    /// taken over.
    #[test]
    fn a_dead_closer_is_undone_or_taken_over() {
        let t = table();
        let (dead, me) = (LocalPoolWords::process(1), LocalPoolWords::process(2));
        assert_eq!(t.close(&dead, false, &mut |s| s != CloseStep::Tentative), Ok(Close::Stopped));
        assert_eq!(t.close(&me, false, &mut |_| true), Ok(Close::Busy(Closer { pid: 1, removing: false })));
        t.words().kill(1);
        assert_eq!(t.close(&me, false, &mut |_| true), Ok(Close::Remove { over: vec![] }), "undone, then closed");
        let t = table();
        assert_eq!(t.close(&dead, false, &mut |s| s != CloseStep::Decided), Ok(Close::Stopped));
        t.words().kill(1);
        assert_eq!(t.close(&me, false, &mut |_| true), Ok(Close::Remove { over: vec![] }), "taken over");
        assert_eq!(t.closer(), Some(Closer { pid: 2, removing: true }));
        // Undone, the close decides afresh: an engine that joined is seen.
        let t = table();
        let engine = t.join_owner(1, &LocalPoolWords::process(3), &[9; 4]).unwrap().engine;
        assert_eq!(t.close(&dead, false, &mut |s| s != CloseStep::Tentative), Ok(Close::Stopped));
        t.words().kill(1);
        assert_eq!(t.close(&me, false, &mut |_| true), Ok(Close::InUse(vec![engine])), "undone, then in use");
        assert_eq!(PoolWord::decode(t.words().pool_word_rmw()), PoolWord::READY);
    }

    /// `close_waiting` waits while a closer that lives is tentative (and
    /// decides once it is gone), gives up when `wait` says so, and never
    /// waits for a removal: the pool is going.
    #[test]
    fn a_close_waits_for_a_tentative_closer_but_not_for_a_removal() {
        let (other, me) = (LocalPoolWords::process(1), LocalPoolWords::process(2));
        let t = table();
        assert_eq!(t.close(&other, false, &mut |s| s != CloseStep::Tentative), Ok(Close::Stopped));
        let mut waits = 0;
        let closed = t.close_waiting(
            &me,
            false,
            &mut |c| {
                assert_eq!(c, Closer { pid: 1, removing: false });
                waits += 1;
                // The other closer ends after the second wait.
                if waits == 2 {
                    t.words().kill(1);
                }
                true
            },
            &mut |_| true,
        );
        assert_eq!((closed, waits), (Ok(Close::Remove { over: vec![] }), 2));
        t.words().release_closer();
        let t = table();
        assert_eq!(t.close(&other, false, &mut |s| s != CloseStep::Tentative), Ok(Close::Stopped));
        let gave_up = t.close_waiting(&me, false, &mut |_| false, &mut |_| true);
        assert_eq!(gave_up, Ok(Close::Busy(Closer { pid: 1, removing: false })));
        let t = table();
        assert_eq!(t.close(&other, false, &mut |s| s != CloseStep::Decided), Ok(Close::Stopped));
        let mut asked = false;
        let going = t.close_waiting(
            &me,
            false,
            &mut |_| {
                asked = true;
                false
            },
            &mut |_| true,
        );
        assert_eq!((going, asked), (Ok(Close::Busy(Closer { pid: 1, removing: true })), false));
    }
}
