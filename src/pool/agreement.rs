//! P7 for an engine on a node pool: its ranks agree on the pin state
//! (pinned or pageable, `crate::protocol::agreement`) through words of its
//! engine entry ([`EngineSlots`]), since the pool's rows (a persistent
//! region, kept across launches) have no rank words of one launch.
//!
//! Each entry has one agreement word per rank (`u32`, SeqCst, as
//! [`RankSlots`] requires). They are fresh for each tenure: the owner (rank
//! 0's worker) resets them to [`UNSETTLED`](crate::protocol::agreement::UNSETTLED)
//! after its claim and before its member bit, and the other ranks register
//! (so build their view) only once they see that bit ([`super::sweep`],
//! rule 6). A rank's liveness is its member record's, judged by the pool's
//! oracle: a rank whose member bit is not set yet counts alive (it may
//! still come: the agreement's timeout bounds the wait for it), one whose
//! recorded process is gone is dead, and the agreement stops waiting for it
//! at once (`AgreementError::RankDied`).

use super::engines::{worker, MembersWord};
use super::words::{Liveness, PoolWords};
use crate::protocol::agreement::RankSlots;
use crate::sync::Arc;

/// The agreement words of one engine entry of a pool: a [`RankSlots`] for
/// the engine's ranks (the pool's `ranks`), for the offloader of each of
/// its workers (`OffloaderOptions::agreement_slots`).
///
/// Build it once the process joined the entry (its lease's engine index):
/// before that, the words may still be a previous tenure's.
pub struct EngineSlots {
    words: Arc<dyn PoolWords>,
    engine: u8,
    ranks: u8,
}

impl EngineSlots {
    /// The words of entry `engine` of the pool `words` (`None` when
    /// `engine` is not an entry of its geometry).
    pub fn new(words: Arc<dyn PoolWords>, engine: u8) -> Option<EngineSlots> {
        let g = words.geometry();
        (engine < g.engines).then_some(EngineSlots { words, engine, ranks: g.ranks })
    }

    /// The entry's index.
    pub fn engine(&self) -> u8 {
        self.engine
    }

    fn rank(&self, rank: usize) -> u8 {
        assert!(rank < self.ranks as usize, "rank {rank} out of range for {} ranks", self.ranks);
        rank as u8
    }
}

impl RankSlots for EngineSlots {
    fn ranks(&self) -> usize {
        self.ranks as usize
    }

    fn load(&self, rank: usize) -> u32 {
        self.words.agreement_load(self.engine, self.rank(rank))
    }

    fn store(&self, rank: usize, value: u32) {
        self.words.agreement_store(self.engine, self.rank(rank), value)
    }

    fn compare_exchange(&self, rank: usize, current: u32, new: u32) -> Result<u32, u32> {
        self.words.agreement_cas(self.engine, self.rank(rank), current, new)
    }

    /// Dead only when the rank registered (its member bit is set) and its
    /// recorded process is gone; unregistered, or of another pid namespace
    /// (it cannot be judged), it counts alive.
    fn alive(&self, rank: usize) -> bool {
        let member = worker(self.rank(rank));
        let mask = MembersWord::decode(self.words.members_load(self.engine)).mask;
        if mask & (1 << member) == 0 {
            return true;
        }
        let record = self.words.member_load(self.engine, member);
        self.words.liveness(&record) != Liveness::Gone
    }
}

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::internal::pool::sweep::Lease;
    use crate::internal::pool::table::PoolTable;
    use crate::internal::pool::words::{Geometry, LocalPoolWords};
    use crate::protocol::agreement::{
        abandoned_by, agree, AgreementError, OffloadMode, SETTLED_PAGEABLE, SETTLED_PINNED, UNSETTLED,
    };

    const G: Geometry = Geometry { slots: 16, ways: 16, ranks: 2, engines: 2 };
    const ID: [u64; 4] = [7; 4];

    fn no() -> bool {
        false
    }

    fn pool() -> Arc<LocalPoolWords> {
        Arc::new(LocalPoolWords::new(G, 8))
    }

    /// Engine `id` joined on `words`: rank 0 (pid `p0`, the owner) and
    /// rank 1 (pid `p1`) registered; its lease.
    fn join_both(words: &Arc<LocalPoolWords>, id: [u64; 4], p0: u32, p1: u32) -> Lease {
        let t = PoolTable::new(words.as_ref());
        let lease = t.join_owner(worker(0), &LocalPoolWords::process(p0), &id).unwrap();
        let other = t.join_member(worker(1), &LocalPoolWords::process(p1), &id).unwrap().unwrap();
        assert_eq!(other, lease);
        lease
    }

    fn slots(words: &Arc<LocalPoolWords>, engine: u8) -> EngineSlots {
        let w: Arc<dyn PoolWords> = words.clone();
        EngineSlots::new(w, engine).unwrap()
    }

    #[test]
    fn the_ranks_of_an_entry_agree_through_its_words() {
        let words = pool();
        let lease = join_both(&words, ID, 1, 2);
        let s = slots(&words, lease.engine);
        assert_eq!(s.ranks(), 2);
        let peer = std::thread::spawn({
            let s = slots(&words, lease.engine);
            move || agree(&s, 1, true, Some(Duration::from_secs(30)), &no)
        });
        assert_eq!(agree(&s, 0, true, Some(Duration::from_secs(30)), &no), Ok(OffloadMode::Pinned));
        assert_eq!(peer.join().unwrap(), Ok(OffloadMode::Pinned));
        // Another entry's words are its own.
        let t = PoolTable::new(words.as_ref());
        let b = t.join_owner(worker(0), &LocalPoolWords::process(3), &[8; 4]).unwrap();
        assert_ne!(b.engine, lease.engine);
        assert_eq!((words.agreement_load(b.engine, 0), words.agreement_load(b.engine, 1)), (UNSETTLED, UNSETTLED));
    }

    #[test]
    fn an_entry_out_of_the_geometry_has_no_words() {
        let words: Arc<dyn PoolWords> = pool();
        assert!(EngineSlots::new(words, G.engines).is_none());
    }

    /// A registered rank whose process is gone is dead: the survivor stops
    /// waiting at once and gives its word up; an unregistered one counts
    /// alive (the timeout bounds the wait).
    #[test]
    fn a_dead_registered_rank_is_reported_and_an_unregistered_one_waited_for() {
        let words = pool();
        let lease = join_both(&words, ID, 1, 2);
        let s = slots(&words, lease.engine);
        assert!(s.alive(0) && s.alive(1));
        words.kill(2);
        assert!(!s.alive(1));
        assert_eq!(agree(&s, 0, true, None, &no), Err(AgreementError::RankDied { rank: 1 }));
        assert_eq!(words.agreement_load(lease.engine, 1), abandoned_by(0));

        // Rank 1 never registered: alive until the timeout.
        let words = pool();
        let t = PoolTable::new(words.as_ref());
        let lease = t.join_owner(worker(0), &LocalPoolWords::process(1), &ID).unwrap();
        let s = slots(&words, lease.engine);
        words.kill(2);
        assert!(s.alive(1), "not registered: it may still come");
        assert_eq!(
            agree(&s, 0, true, Some(Duration::from_millis(50)), &no),
            Err(AgreementError::Timeout { millis: 50, waiting: vec![1] })
        );
    }

    /// Rule 6 of the sweep: a later tenure of the entry agrees on fresh
    /// words, whatever the last one left (here rank 1 pageable, rank 0 a
    /// word given up): both ranks pinned agree pinned.
    #[test]
    fn a_later_tenure_of_the_entry_agrees_on_fresh_words() {
        let words = pool();
        let first = join_both(&words, ID, 1, 2);
        let s = slots(&words, first.engine);
        s.store(0, abandoned_by(1));
        s.store(1, SETTLED_PAGEABLE);
        let t = PoolTable::new(words.as_ref());
        for (member, pid) in [(worker(1), 2), (worker(0), 1)] {
            t.leave(first, member, &LocalPoolWords::process(pid)).unwrap();
        }
        let second = join_both(&words, [9; 4], 3, 4);
        assert_eq!(second.engine, first.engine, "the same entry, a new tenure");
        assert_ne!(second.generation, first.generation);
        let s = slots(&words, second.engine);
        let peer = std::thread::spawn({
            let s = slots(&words, second.engine);
            move || agree(&s, 1, true, Some(Duration::from_secs(30)), &no)
        });
        assert_eq!(agree(&s, 0, true, Some(Duration::from_secs(30)), &no), Ok(OffloadMode::Pinned));
        assert_eq!(peer.join().unwrap(), Ok(OffloadMode::Pinned));
        assert_eq!(words.agreement_load(second.engine, 1), SETTLED_PINNED);
    }
}
