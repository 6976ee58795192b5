//! P7: ranks agree before offload turns on. Each rank publishes its settled
//! pin outcome in a word of its own (in the shared region's header for
//! ranks in separate processes, so the agreement outlives a rank that
//! dies); a rank turns offload on only once every rank has settled, and if
//! any rank fell back to pageable memory, every rank does.
//!
//! Ranks on several nodes share no region: they agree through a
//! [`Transport`] the engine provides (one collective exchange over its own
//! process group, e.g. torch.distributed with gloo), with [`agree`]'s
//! sibling [`agree_via`].
//!
//! # Rules of the words (and the property each serves)
//!
//! 1. Every word is written once: from [`UNSETTLED`] to a final value, by
//!    a compare-and-swap, never back (P7, agreement: once no word is
//!    unsettled, the words never change again, so every rank that decides
//!    reads the same words and decides the same mode).
//! 2. A rank settles its own word ([`SETTLED_PINNED`] or
//!    [`SETTLED_PAGEABLE`]) before it reads the others' (SeqCst) (P7: no
//!    rank decides without every rank's outcome).
//! 3. A rank that stops waiting (its pinning was cancelled: a shutdown or
//!    [`Pinning::cancel`](super::Pinning::cancel);
//!    its timeout passed; a rank it waits for is dead) gives the words it
//!    waited for up: it writes [`abandoned_by`] itself into every word
//!    still unsettled (rule 1's compare-and-swap, so a rank that settled
//!    meanwhile keeps its outcome). It then reads the words again, all
//!    final now (bounded: the wait ends for this rank at once, P6).
//! 4. An abandoned word means pageable: a rank that finds any word
//!    abandoned ends pageable, and a rank that finds its own word abandoned
//!    when it comes to settle ends pageable at once without waiting (the
//!    peers of a rank that shut down settle at once instead of timing out;
//!    P7 still holds by rule 1: the final words are the same for all).
//! 5. The wait checks the cancel, the timeout and the peers' liveness on
//!    every round, between two reads of the words, and holds no lock while
//!    it waits (the cancel check takes the coordinator's lock for the
//!    check alone); every rank settles within its bound: the agreement's
//!    timeout, or at once after a cancel.
//!
//! The model `model/p7_settles_in_bound.rs` checks rules 1, 3 and 4 with a
//! rank that shuts down during the agreement and a peer that never
//! settles; `model/p7_ranks_agree.rs` checks the agreement itself.

use std::time::{Duration, Instant};

use crate::sync::atomic::{AtomicU32, Ordering};
use crate::sync::{self, Arc};

/// The word of a rank that has not settled yet.
pub const UNSETTLED: u32 = 0;
/// The word of a rank whose region is pinned.
pub const SETTLED_PINNED: u32 = 1;
/// The word of a rank running on pageable memory.
pub const SETTLED_PAGEABLE: u32 = 2;
/// The first word of [`abandoned_by`]: `ABANDONED + r` is the word of a
/// rank that rank `r` gave up waiting for before it settled.
pub const ABANDONED: u32 = 0x100;

/// The word rank `by` writes into the word of a rank it gave up waiting
/// for (rule 3).
pub fn abandoned_by(by: usize) -> u32 {
    ABANDONED.saturating_add(u32::try_from(by).unwrap_or(u32::MAX))
}

/// The rank that abandoned a word, if `word` is an abandoned one.
pub fn abandoner(word: u32) -> Option<usize> {
    word.checked_sub(ABANDONED).map(|r| r as usize)
}

/// One word per rank, visible to every rank.
///
/// Every word holds [`UNSETTLED`], [`SETTLED_PINNED`] or
/// [`SETTLED_PAGEABLE`]. [`agree`] needs loads and stores that are
/// sequentially consistent across ranks (a rank writes its own word before
/// it reads the others'): that is what makes both ranks see the same final
/// words and so choose the same mode (P7).
pub trait RankSlots: Send + Sync {
    /// Number of ranks that must agree; valid ranks are `0..ranks()`.
    fn ranks(&self) -> usize;
    /// The current word of rank `rank` (`rank < ranks()`), read with
    /// sequentially consistent ordering.
    fn load(&self, rank: usize) -> u32;
    /// Sets the word of rank `rank` (`rank < ranks()`) to `value`, with
    /// sequentially consistent ordering. [`agree`] never stores (its words
    /// are written once, by [`RankSlots::compare_exchange`]); for set-ups
    /// and tests.
    fn store(&self, rank: usize, value: u32);
    /// Sets the word of rank `rank` to `new` if it is `current`
    /// (sequentially consistent); returns the word found (`Ok(current)` on
    /// success).
    fn compare_exchange(&self, rank: usize, current: u32, new: u32) -> Result<u32, u32>;
    /// False when rank `rank` is known to be dead (its process is gone).
    fn alive(&self, _rank: usize) -> bool {
        true
    }
}

/// Ranks in one process (threads): plain atomics from the sync facade, so
/// loom explores the agreement.
pub struct LocalSlots {
    words: Vec<AtomicU32>,
}

impl LocalSlots {
    /// Words for `ranks` ranks, all [`UNSETTLED`].
    pub fn new(ranks: usize) -> Self {
        LocalSlots { words: (0..ranks).map(|_| AtomicU32::new(UNSETTLED)).collect() }
    }
}

impl RankSlots for LocalSlots {
    fn ranks(&self) -> usize {
        self.words.len()
    }
    fn load(&self, rank: usize) -> u32 {
        self.words[rank].load(Ordering::SeqCst)
    }
    fn store(&self, rank: usize, value: u32) {
        self.words[rank].store(value, Ordering::SeqCst)
    }
    fn compare_exchange(&self, rank: usize, current: u32, new: u32) -> Result<u32, u32> {
        self.words[rank].compare_exchange(current, new, Ordering::SeqCst, Ordering::SeqCst)
    }
}

/// The mode every rank ends in.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum OffloadMode {
    /// Every rank settled with its region pinned: offload may use pinned
    /// copies and the gather kernel.
    Pinned,
    /// At least one rank settled on pageable memory, so every rank runs
    /// pageable (a pinned rank unregisters its chunks and reports
    /// [`PageableReason::PeerPageable`](super::PageableReason::PeerPageable)).
    Pageable,
}

/// The agreement could not be reached.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgreementError {
    /// The calling rank's index is not below the number of slots; nothing
    /// was published.
    #[error("rank {rank} out of range for {ranks} ranks")]
    RankOutOfRange {
        /// The calling rank's index, as given.
        rank: usize,
        /// Ranks the slots hold ([`RankSlots::ranks`]).
        ranks: usize,
    },
    /// A rank that had not settled is known to be dead
    /// ([`RankSlots::alive`] is false: its process is gone), so it never
    /// will; waiting would hang as upstream's TP peer did (docs/driver-rules.md,
    /// section 2, vLLM #46933).
    #[error("rank {rank} died before it settled its pin state")]
    RankDied {
        /// The dead rank's index (the first dead one among those waited for).
        rank: usize,
    },
    /// The engine's [`Transport`] failed: this rank did not learn every
    /// rank's outcome, so it runs on pageable memory.
    #[error("the agreement transport failed: {message}")]
    Transport {
        /// What the transport reported.
        message: String,
    },
    /// The engine's [`Transport`] returned words that break its contract
    /// (empty, a word that is not a settled outcome, or all pinned while
    /// this rank is pageable): this rank runs on pageable memory.
    #[error(
        "the agreement transport returned {words:?}, which is not every rank's settled outcome (this rank: {mine})"
    )]
    BadExchange {
        /// What the transport returned.
        words: Vec<u32>,
        /// This rank's word.
        mine: u32,
    },
    /// The timeout given to [`agree`] passed before every rank settled;
    /// this rank gave the ranks it waited for up (rule 3), so they end
    /// pageable too.
    #[error("timed out after {millis} ms waiting for ranks {waiting:?} to settle their pin state")]
    Timeout {
        /// The timeout, in milliseconds.
        millis: u64,
        /// The ranks this rank gave up (still unsettled when it did), in
        /// ascending order.
        waiting: Vec<usize>,
    },
    /// This rank's pinning was cancelled (a shutdown, or
    /// `cancel_pinning`) while it waited: it gave the ranks it waited for
    /// up (rule 3) and ends pageable, as they do.
    #[error("cancelled (shutdown) while waiting for ranks {waiting:?} to settle their pin state")]
    Cancelled {
        /// The ranks this rank gave up, in ascending order.
        waiting: Vec<usize>,
    },
    /// This rank's pinning was cancelled (a shutdown, or `cancel_pinning`)
    /// while the engine's [`Transport`] exchanged the ranks' outcomes: this
    /// rank stopped waiting for the exchange and ends pageable (see
    /// [`agree_via`]).
    #[error("cancelled (shutdown) while the agreement transport exchanged the ranks' outcomes")]
    ExchangeCancelled,
    /// This rank's word was not [`UNSETTLED`] when it came to settle, and
    /// not given up by a peer either: another process wrote it (a second
    /// process with this rank, or a damaged header). This rank ends
    /// pageable.
    #[error("rank {rank}'s agreement word was already {found} before it settled (written by another process)")]
    WordTaken {
        /// This rank.
        rank: usize,
        /// The word found.
        found: u32,
    },
    /// Another rank gave up waiting (it shut down, timed out or saw a rank
    /// die) before these ranks settled: every rank ends pageable (rule 4).
    #[error("rank {by} left the agreement (shut down, timed out or saw a rank die) before ranks {ranks:?} settled")]
    Abandoned {
        /// The rank that gave up (the first one found).
        by: usize,
        /// The ranks whose words it gave up, in ascending order (this rank
        /// among them when it came to settle after that).
        ranks: Vec<usize>,
    },
}

/// Publishes this rank's outcome (`pinned`), waits until every rank has
/// settled, and returns the common mode. The wait ends early (see the
/// module's rules 3-5), this rank giving the ranks it waited for up, when
/// `cancelled()` returns true (checked every round; the pinner passes
/// [`Pinning::cancelled`](super::Pinning::cancelled), which a
/// shutdown sets), when `timeout` passed, or when a rank it waits for is
/// dead; every other rank then ends pageable too, at once.
pub fn agree(
    slots: &dyn RankSlots,
    rank: usize,
    pinned: bool,
    timeout: Option<Duration>,
    cancelled: &dyn Fn() -> bool,
) -> Result<OffloadMode, AgreementError> {
    let ranks = slots.ranks();
    if rank >= ranks {
        return Err(AgreementError::RankOutOfRange { rank, ranks });
    }
    // Rule 2 (and 1: written once). A peer may have given this word up
    // already (rule 4): then this rank ends pageable at once.
    let mine = if pinned { SETTLED_PINNED } else { SETTLED_PAGEABLE };
    if let Err(found) = slots.compare_exchange(rank, UNSETTLED, mine) {
        let words: Vec<u32> = (0..ranks).map(|r| slots.load(r)).collect();
        tracing::warn!(rank, found, "this rank's agreement word was written before it settled");
        return Err(match abandoner(found) {
            Some(_) => abandoned(&words).unwrap_or(AgreementError::WordTaken { rank, found }),
            None => AgreementError::WordTaken { rank, found },
        });
    }
    let start = Instant::now();
    let mut attempt = 0u32;
    loop {
        let words: Vec<u32> = (0..ranks).map(|r| slots.load(r)).collect();
        let waiting: Vec<usize> = (0..ranks).filter(|&r| words[r] == UNSETTLED).collect();
        if waiting.is_empty() {
            return verdict(&words, rank);
        }
        // Rule 5: each reason to stop waiting, once a round.
        let stop = if cancelled() {
            Some(AgreementError::Cancelled { waiting: waiting.clone() })
        } else if let Some(&dead) = waiting.iter().find(|&&r| !slots.alive(r)) {
            Some(AgreementError::RankDied { rank: dead })
        } else {
            timeout
                .filter(|t| start.elapsed() >= *t)
                .map(|t| AgreementError::Timeout { millis: t.as_millis() as u64, waiting: waiting.clone() })
        };
        if let Some(e) = stop {
            // Rule 3: give every unsettled word up, then decide on the
            // final words (a rank that settled meanwhile kept its word).
            let mut gave_up = Vec::new();
            for &r in &waiting {
                if slots.compare_exchange(r, UNSETTLED, abandoned_by(rank)).is_ok() {
                    gave_up.push(r);
                }
            }
            let words: Vec<u32> = (0..ranks).map(|r| slots.load(r)).collect();
            if gave_up.is_empty() {
                // Every word was final before this rank gave any up: the
                // ranks settled (agreed), or a peer gave the rest up first,
                // which is then the error (rule 4; not this rank's own
                // reason, which would name no rank).
                return verdict(&words, rank);
            }
            tracing::warn!(rank, error = %e, gave_up = ?gave_up, "stopped waiting for the ranks; every rank ends pageable");
            return Err(match e {
                AgreementError::Cancelled { .. } => AgreementError::Cancelled { waiting: gave_up },
                AgreementError::Timeout { millis, .. } => AgreementError::Timeout { millis, waiting: gave_up },
                e => e,
            });
        }
        crate::sync::backoff(attempt);
        attempt = attempt.saturating_add(1);
    }
}

/// The first abandoned word among `words` (rule 4), as the error a rank
/// reports.
fn abandoned(words: &[u32]) -> Option<AgreementError> {
    let by = words.iter().find_map(|&w| abandoner(w))?;
    let ranks = (0..words.len()).filter(|&r| abandoner(words[r]).is_some()).collect();
    Some(AgreementError::Abandoned { by, ranks })
}

/// The mode of final `words` (none unsettled): Pinned only when every word
/// is [`SETTLED_PINNED`]; an abandoned word is reported (rule 4).
fn verdict(words: &[u32], rank: usize) -> Result<OffloadMode, AgreementError> {
    if let Some(e) = abandoned(words) {
        return Err(e);
    }
    let mode = if words.iter().all(|&w| w == SETTLED_PINNED) { OffloadMode::Pinned } else { OffloadMode::Pageable };
    tracing::info!(rank, ?mode, "ranks agreed");
    Ok(mode)
}

/// An agreement transport the engine provides, for ranks that share no
/// region (ranks on several nodes): one collective exchange of every rank's
/// settled outcome over the engine's own process group (e.g.
/// `torch.distributed` with a gloo group, or any all-gather it has).
///
/// # Contract
///
/// [`Transport::exchange`] is a collective: every rank of the group calls
/// it exactly once, with its own settled word ([`SETTLED_PINNED`] or
/// [`SETTLED_PAGEABLE`]), and it returns only once every rank has
/// contributed its word. It then returns every rank's word (an all-gather,
/// in rank order), or any non-empty list with the same verdict, such as the
/// one-element result of an all-reduce with MAX ([`SETTLED_PAGEABLE`] is the
/// larger word, so one pageable rank makes the maximum pageable). It never
/// returns a list that lacks a rank's contribution. When the exchange
/// cannot complete (a peer died, a connection closed, the transport's own
/// timeout passed) it returns an error.
///
/// Given that contract, every rank that gets `Ok` decides the same mode
/// from the same verdict. A rank whose exchange fails runs on pageable
/// memory and reports [`AgreementError::Transport`]; whether its peers
/// learn of it is the transport's business: a collective that breaks on
/// one rank breaks on all of them (each ends pageable with the error), but
/// no protocol can make ranks agree over a transport that succeeds on some
/// ranks and fails on others. The exchange blocks for as long as the
/// slowest rank's pinning takes; bound it with the transport's own timeout
/// (the offloader's `agreement_timeout` does not bound it).
///
/// The exchange may outlive the offloader's shutdown ([`agree_via`] leaves
/// its thread behind): a transport whose exchange calls into an embedding
/// interpreter must keep that thread out of it once the offloader shut
/// down and once the interpreter exits (the Python front runs its callable
/// on an interpreter thread of its own and enters Python only to start it,
/// behind a gate that its shutdown and an `atexit` function close).
pub trait Transport: Send + Sync {
    /// Exchanges this rank's settled word `mine`; see the trait's contract.
    fn exchange(&self, mine: u32) -> Result<Vec<u32>, String>;
}

/// The mode a transport's exchange gives, checked against the contract.
pub fn decide(words: &[u32], mine: u32) -> Result<OffloadMode, AgreementError> {
    let settled = |w: &u32| *w == SETTLED_PINNED || *w == SETTLED_PAGEABLE;
    let all_pinned = words.iter().all(|&w| w == SETTLED_PINNED);
    if words.is_empty() || !words.iter().all(settled) || (mine == SETTLED_PAGEABLE && all_pinned) {
        return Err(AgreementError::BadExchange { words: words.to_vec(), mine });
    }
    Ok(if all_pinned { OffloadMode::Pinned } else { OffloadMode::Pageable })
}

/// Like [`agree`], through the engine's [`Transport`]: exchanges this
/// rank's outcome (`pinned`) with every rank's and returns the common mode.
///
/// The exchange runs on a thread of its own (`kvo-agree-exchange`,
/// [`sync::abandonable`]) and this rank waits for its result, checking
/// `cancelled()` at least every [`sync::INTERRUPT_EVERY`] (rule 5 for a
/// transport): a shutdown during the exchange ends this rank's agreement at
/// once ([`AgreementError::ExchangeCancelled`], this rank
/// pageable), even when the engine's collective never returns. The exchange
/// is left to end on its own thread; it holds only the transport, and its
/// result is dropped. Its peers learn of it as the transport's collective
/// tells them (its own timeout): a transport cannot be given up from one
/// end, as the region's words can (rule 3).
pub fn agree_via(
    transport: &Arc<dyn Transport>,
    pinned: bool,
    cancelled: &dyn Fn() -> bool,
) -> Result<OffloadMode, AgreementError> {
    let mine = if pinned { SETTLED_PINNED } else { SETTLED_PAGEABLE };
    let t = transport.clone();
    let words = sync::abandonable("kvo-agree-exchange", move || t.exchange(mine), cancelled).ok_or_else(|| {
        tracing::warn!("cancelled (shutdown) during the agreement transport's exchange; this rank ends pageable");
        AgreementError::ExchangeCancelled
    })?;
    let words = words.map_err(|message| AgreementError::Transport { message })?;
    let mode = decide(&words, mine)?;
    tracing::info!(?mode, ranks_reported = words.len(), "ranks agreed through the transport");
    Ok(mode)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::{Condvar, Mutex};

    /// `agree_via` over `t`, never cancelled.
    fn via(t: impl Transport + 'static, pinned: bool) -> Result<OffloadMode, AgreementError> {
        let t: Arc<dyn Transport> = Arc::new(t);
        agree_via(&t, pinned, &|| false)
    }

    /// A collective whose peers never come: blocks until released.
    struct Never(Arc<(Mutex<bool>, Condvar)>);
    impl Transport for Never {
        fn exchange(&self, mine: u32) -> Result<Vec<u32>, String> {
            let mut released = sync::lock(&self.0 .0);
            while !*released {
                released = sync::wait(&self.0 .1, released);
            }
            Ok(vec![mine])
        }
    }
    struct Fixed(Result<Vec<u32>, String>);
    impl Transport for Fixed {
        fn exchange(&self, _mine: u32) -> Result<Vec<u32>, String> {
            self.0.clone()
        }
    }

    /// Rank words with a liveness flag per rank (the region header's pid
    /// check, in process).
    struct Words {
        slots: LocalSlots,
        dead: Vec<usize>,
    }
    impl RankSlots for Words {
        fn ranks(&self) -> usize {
            self.slots.ranks()
        }
        fn load(&self, rank: usize) -> u32 {
            self.slots.load(rank)
        }
        fn store(&self, rank: usize, value: u32) {
            self.slots.store(rank, value)
        }
        fn compare_exchange(&self, rank: usize, current: u32, new: u32) -> Result<u32, u32> {
            self.slots.compare_exchange(rank, current, new)
        }
        fn alive(&self, rank: usize) -> bool {
            !self.dead.contains(&rank)
        }
    }

    /// Never cancelled.
    fn no() -> bool {
        false
    }

    /// Rank words where a peer (rank 1) gives rank 2's word up between the
    /// caller's reading of it and the caller's own compare-and-swap.
    struct PeerGivesUpFirst(LocalSlots);
    impl RankSlots for PeerGivesUpFirst {
        fn ranks(&self) -> usize {
            self.0.ranks()
        }
        fn load(&self, rank: usize) -> u32 {
            self.0.load(rank)
        }
        fn store(&self, rank: usize, value: u32) {
            self.0.store(rank, value)
        }
        fn compare_exchange(&self, rank: usize, current: u32, new: u32) -> Result<u32, u32> {
            if rank == 2 {
                let _ = self.0.compare_exchange(2, UNSETTLED, abandoned_by(1));
            }
            self.0.compare_exchange(rank, current, new)
        }
        fn alive(&self, rank: usize) -> bool {
            self.0.alive(rank)
        }
    }

    /// A rank that stops waiting (here its timeout) after a peer already
    /// gave every unsettled word up reports that (`Abandoned`, rule 4), not
    /// its own reason naming no rank (`Timeout { waiting: [] }`).
    #[test]
    fn a_rank_that_a_peer_beat_to_giving_up_reports_the_peer() {
        let w = PeerGivesUpFirst(LocalSlots::new(3));
        w.store(1, SETTLED_PINNED);
        assert_eq!(
            agree(&w, 0, true, Some(Duration::ZERO), &no),
            Err(AgreementError::Abandoned { by: 1, ranks: vec![2] })
        );
        assert_eq!(w.load(2), abandoned_by(1), "the peer's word stays");
    }

    #[test]
    fn out_of_range_rank_publishes_nothing() {
        let slots = LocalSlots::new(2);
        assert_eq!(agree(&slots, 2, true, None, &no), Err(AgreementError::RankOutOfRange { rank: 2, ranks: 2 }));
        assert_eq!((slots.load(0), slots.load(1)), (UNSETTLED, UNSETTLED));
        // The last valid rank is in range.
        slots.store(0, SETTLED_PINNED);
        assert_eq!(agree(&slots, 1, true, None, &no), Ok(OffloadMode::Pinned));
    }

    #[test]
    fn a_dead_unsettled_rank_is_reported_not_waited_for() {
        let w = Words { slots: LocalSlots::new(3), dead: vec![2] };
        w.store(1, SETTLED_PINNED);
        assert_eq!(agree(&w, 0, true, None, &no), Err(AgreementError::RankDied { rank: 2 }));
        // Its word is given up (rule 3): it can no longer settle pinned.
        assert_eq!(w.load(2), abandoned_by(0));
        // A dead rank that settled before it died does not matter.
        let w = Words { slots: LocalSlots::new(3), dead: vec![2] };
        w.store(1, SETTLED_PINNED);
        w.store(2, SETTLED_PAGEABLE);
        assert_eq!(agree(&w, 0, true, None, &no), Ok(OffloadMode::Pageable));
    }

    #[test]
    fn the_timeout_ends_the_wait_names_the_unsettled_ranks_and_gives_them_up() {
        let slots = LocalSlots::new(3);
        slots.store(1, SETTLED_PINNED);
        let t0 = std::time::Instant::now();
        let r = agree(&slots, 0, true, Some(Duration::from_millis(50)), &no);
        assert_eq!(r, Err(AgreementError::Timeout { millis: 50, waiting: vec![2] }));
        assert!(t0.elapsed() >= Duration::from_millis(50), "gave up before the timeout");
        // The late rank settles pageable at once (rule 4), as rank 0 did.
        assert_eq!(agree(&slots, 2, true, None, &no), Err(AgreementError::Abandoned { by: 0, ranks: vec![2] }));
    }

    /// Issue 28, item 1: a cancel (what a shutdown does) ends the wait for
    /// a peer that never settles, at once, without a timeout; the peers
    /// still waiting settle at once, and a late one finds its word given up.
    #[test]
    fn a_cancel_ends_the_wait_and_the_peers_settle_pageable_at_once() {
        let slots = std::sync::Arc::new(LocalSlots::new(3));
        // Rank 1 waits (no timeout, never cancelled) for rank 2, which never
        // comes until the end.
        let peer = {
            let slots = slots.clone();
            std::thread::spawn(move || agree(slots.as_ref(), 1, true, None, &no))
        };
        // Rank 0 waits until it is cancelled; the cancel comes once rank 1
        // has settled (so both are waiting for rank 2).
        let seen = std::cell::Cell::new(0u32);
        let cancelled = || {
            seen.set(seen.get() + 1);
            slots.load(1) != UNSETTLED
        };
        assert_eq!(
            agree(slots.as_ref(), 0, true, None, &cancelled),
            Err(AgreementError::Cancelled { waiting: vec![2] })
        );
        assert!(seen.get() >= 1);
        assert_eq!(peer.join().unwrap(), Err(AgreementError::Abandoned { by: 0, ranks: vec![2] }));
        assert_eq!(agree(slots.as_ref(), 2, true, None, &no), Err(AgreementError::Abandoned { by: 0, ranks: vec![2] }));
    }

    /// A cancel that comes after every rank settled changes nothing: the
    /// words are final, the mode is the agreed one.
    #[test]
    fn a_cancel_after_every_rank_settled_keeps_the_agreed_mode() {
        let slots = LocalSlots::new(2);
        slots.store(1, SETTLED_PINNED);
        assert_eq!(agree(&slots, 0, true, None, &|| true), Ok(OffloadMode::Pinned));
    }

    #[test]
    fn a_word_written_by_another_process_is_refused() {
        let slots = LocalSlots::new(2);
        slots.store(0, SETTLED_PINNED);
        assert_eq!(agree(&slots, 0, false, None, &no), Err(AgreementError::WordTaken { rank: 0, found: 1 }));
    }

    #[test]
    fn a_rank_settling_before_the_timeout_is_waited_for() {
        let slots = std::sync::Arc::new(LocalSlots::new(2));
        let peer = {
            let slots = slots.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                slots.compare_exchange(1, UNSETTLED, SETTLED_PAGEABLE).unwrap();
            })
        };
        assert_eq!(agree(slots.as_ref(), 0, true, Some(Duration::from_secs(60)), &no), Ok(OffloadMode::Pageable));
        peer.join().unwrap();
    }

    #[test]
    fn transport_verdicts() {
        let (p, g) = (SETTLED_PINNED, SETTLED_PAGEABLE);
        assert_eq!(via(Fixed(Ok(vec![p, p])), true), Ok(OffloadMode::Pinned));
        assert_eq!(via(Fixed(Ok(vec![p, g])), true), Ok(OffloadMode::Pageable));
        // The one-word result of an all-reduce with MAX.
        assert_eq!(via(Fixed(Ok(vec![g])), true), Ok(OffloadMode::Pageable));
        assert_eq!(via(Fixed(Ok(vec![g, p])), false), Ok(OffloadMode::Pageable));
    }

    #[test]
    fn transport_errors_and_broken_contracts() {
        let (p, g) = (SETTLED_PINNED, SETTLED_PAGEABLE);
        assert_eq!(
            via(Fixed(Err("peer gone".into())), true),
            Err(AgreementError::Transport { message: "peer gone".into() })
        );
        assert!(matches!(via(Fixed(Ok(vec![])), true), Err(AgreementError::BadExchange { .. })));
        assert!(matches!(via(Fixed(Ok(vec![p, UNSETTLED])), true), Err(AgreementError::BadExchange { .. })));
        assert!(matches!(via(Fixed(Ok(vec![p, 7])), true), Err(AgreementError::BadExchange { .. })));
        // This rank is pageable, yet every word says pinned: its word is missing.
        assert_eq!(via(Fixed(Ok(vec![p, p])), false), Err(AgreementError::BadExchange { words: vec![p, p], mine: g }));
    }

    #[test]
    fn a_cancel_ends_a_rank_waiting_for_an_exchange_that_never_returns() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let t: Arc<dyn Transport> = Arc::new(Never(gate.clone()));
        let (tx, rx) = std::sync::mpsc::channel();
        let rank = sync::thread::spawn(move || {
            let asked = Instant::now();
            let r = agree_via(&t, true, &|| asked.elapsed() >= Duration::from_millis(120));
            let _ = tx.send((r, asked.elapsed()));
        });
        // The cancel is checked every 50 ms: 5 s is many slices; past it the
        // rank is waiting for the exchange, not for the cancel.
        let got = rx.recv_timeout(Duration::from_secs(5));
        // Release the exchange's thread (and the rank, if it still waits).
        *sync::lock(&gate.0) = true;
        gate.1.notify_all();
        rank.join().unwrap();
        let (r, waited) = got.expect("the rank waited for the exchange for 5 s after its cancel");
        assert_eq!(r, Err(AgreementError::ExchangeCancelled), "after {waited:?}");
    }

    #[test]
    fn a_panicking_transport_is_a_transport_error() {
        struct Panics;
        impl Transport for Panics {
            fn exchange(&self, _mine: u32) -> Result<Vec<u32>, String> {
                panic!("a transport's bug")
            }
        }
        assert_eq!(
            via(Panics, true),
            Err(AgreementError::Transport { message: "kvo-agree-exchange panicked: a transport's bug".into() })
        );
    }
}
