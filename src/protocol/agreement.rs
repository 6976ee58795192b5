//! P7: ranks agree before offload turns on. Each rank publishes its settled
//! pin outcome in a word of its own (in the shared region's header for
//! ranks in separate processes, so the agreement outlives a rank that
//! dies); a rank turns offload on only once every rank has settled, and if
//! any rank fell back to pageable memory, every rank does.
//!
//! Ranks on several nodes share no region: they agree through a
//! [`Transport`] the engine provides (one collective exchange over its own
//! process group, e.g. torch.distributed with gloo), with [`agree_via`].

use std::time::{Duration, Instant};

use crate::sync::atomic::{AtomicU32, Ordering};

/// The word of a rank that has not settled yet.
pub const UNSETTLED: u32 = 0;
/// The word of a rank whose region is pinned.
pub const SETTLED_PINNED: u32 = 1;
/// The word of a rank running on pageable memory.
pub const SETTLED_PAGEABLE: u32 = 2;

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
    /// sequentially consistent ordering. Each rank stores only its own word.
    fn store(&self, rank: usize, value: u32);
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
    /// The timeout given to [`agree`] passed before every rank settled.
    #[error("timed out after {millis} ms waiting for ranks {waiting:?} to settle their pin state")]
    Timeout {
        /// The timeout, in milliseconds.
        millis: u64,
        /// The ranks still unsettled at the last look, in ascending order.
        waiting: Vec<usize>,
    },
}

/// Publishes this rank's outcome (`pinned`), waits until every rank has
/// settled (or one died, or `timeout` passed), and returns the common mode.
pub fn agree(
    slots: &dyn RankSlots,
    rank: usize,
    pinned: bool,
    timeout: Option<Duration>,
) -> Result<OffloadMode, AgreementError> {
    let ranks = slots.ranks();
    if rank >= ranks {
        return Err(AgreementError::RankOutOfRange { rank, ranks });
    }
    slots.store(rank, if pinned { SETTLED_PINNED } else { SETTLED_PAGEABLE });
    let start = Instant::now();
    let mut attempt = 0u32;
    loop {
        let words: Vec<u32> = (0..ranks).map(|r| slots.load(r)).collect();
        let waiting: Vec<usize> = (0..ranks).filter(|&r| words[r] == UNSETTLED).collect();
        if waiting.is_empty() {
            let mode =
                if words.iter().all(|&w| w == SETTLED_PINNED) { OffloadMode::Pinned } else { OffloadMode::Pageable };
            tracing::info!(rank, ?mode, "ranks agreed");
            return Ok(mode);
        }
        if let Some(&dead) = waiting.iter().find(|&&r| !slots.alive(r)) {
            return Err(AgreementError::RankDied { rank: dead });
        }
        if let Some(t) = timeout {
            if start.elapsed() >= t {
                return Err(AgreementError::Timeout { millis: t.as_millis() as u64, waiting });
            }
        }
        crate::sync::backoff(attempt);
        attempt = attempt.saturating_add(1);
    }
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
/// slowest rank's pinning takes; bound it with the transport's own timeout.
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
pub fn agree_via(transport: &dyn Transport, pinned: bool) -> Result<OffloadMode, AgreementError> {
    let mine = if pinned { SETTLED_PINNED } else { SETTLED_PAGEABLE };
    let words = transport.exchange(mine).map_err(|message| AgreementError::Transport { message })?;
    let mode = decide(&words, mine)?;
    tracing::info!(?mode, ranks_reported = words.len(), "ranks agreed through the transport");
    Ok(mode)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

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
        fn alive(&self, rank: usize) -> bool {
            !self.dead.contains(&rank)
        }
    }

    #[test]
    fn out_of_range_rank_publishes_nothing() {
        let slots = LocalSlots::new(2);
        assert_eq!(agree(&slots, 2, true, None), Err(AgreementError::RankOutOfRange { rank: 2, ranks: 2 }));
        assert_eq!((slots.load(0), slots.load(1)), (UNSETTLED, UNSETTLED));
        // The last valid rank is in range.
        slots.store(0, SETTLED_PINNED);
        assert_eq!(agree(&slots, 1, true, None), Ok(OffloadMode::Pinned));
    }

    #[test]
    fn a_dead_unsettled_rank_is_reported_not_waited_for() {
        let w = Words { slots: LocalSlots::new(3), dead: vec![2] };
        w.store(1, SETTLED_PINNED);
        assert_eq!(agree(&w, 0, true, None), Err(AgreementError::RankDied { rank: 2 }));
        // A dead rank that settled before it died does not matter.
        w.store(2, SETTLED_PAGEABLE);
        assert_eq!(agree(&w, 0, true, None), Ok(OffloadMode::Pageable));
    }

    #[test]
    fn the_timeout_ends_the_wait_and_names_the_unsettled_ranks() {
        let slots = LocalSlots::new(3);
        slots.store(1, SETTLED_PINNED);
        let t0 = std::time::Instant::now();
        let r = agree(&slots, 0, true, Some(Duration::from_millis(50)));
        assert_eq!(r, Err(AgreementError::Timeout { millis: 50, waiting: vec![2] }));
        assert!(t0.elapsed() >= Duration::from_millis(50), "gave up before the timeout");
    }

    #[test]
    fn a_rank_settling_before_the_timeout_is_waited_for() {
        let slots = std::sync::Arc::new(LocalSlots::new(2));
        let peer = {
            let slots = slots.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                slots.store(1, SETTLED_PAGEABLE);
            })
        };
        assert_eq!(agree(slots.as_ref(), 0, true, Some(Duration::from_secs(60))), Ok(OffloadMode::Pageable));
        peer.join().unwrap();
    }

    #[test]
    fn transport_verdicts() {
        let (p, g) = (SETTLED_PINNED, SETTLED_PAGEABLE);
        assert_eq!(agree_via(&Fixed(Ok(vec![p, p])), true), Ok(OffloadMode::Pinned));
        assert_eq!(agree_via(&Fixed(Ok(vec![p, g])), true), Ok(OffloadMode::Pageable));
        // The one-word result of an all-reduce with MAX.
        assert_eq!(agree_via(&Fixed(Ok(vec![g])), true), Ok(OffloadMode::Pageable));
        assert_eq!(agree_via(&Fixed(Ok(vec![g, p])), false), Ok(OffloadMode::Pageable));
    }

    #[test]
    fn transport_errors_and_broken_contracts() {
        let (p, g) = (SETTLED_PINNED, SETTLED_PAGEABLE);
        assert_eq!(
            agree_via(&Fixed(Err("peer gone".into())), true),
            Err(AgreementError::Transport { message: "peer gone".into() })
        );
        assert!(matches!(agree_via(&Fixed(Ok(vec![])), true), Err(AgreementError::BadExchange { .. })));
        assert!(matches!(agree_via(&Fixed(Ok(vec![p, UNSETTLED])), true), Err(AgreementError::BadExchange { .. })));
        assert!(matches!(agree_via(&Fixed(Ok(vec![p, 7])), true), Err(AgreementError::BadExchange { .. })));
        // This rank is pageable, yet every word says pinned: its word is missing.
        assert_eq!(
            agree_via(&Fixed(Ok(vec![p, p])), false),
            Err(AgreementError::BadExchange { words: vec![p, p], mine: g })
        );
    }
}
