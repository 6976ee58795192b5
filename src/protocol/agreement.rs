//! P7: ranks agree before offload turns on. Each rank publishes its settled
//! pin outcome in a word of its own (in the shared region's header for
//! ranks in separate processes, so the agreement outlives a rank that
//! dies); a rank turns offload on only once every rank has settled, and if
//! any rank fell back to pageable memory, every rank does.

use std::time::{Duration, Instant};

use crate::sync::atomic::{AtomicU32, Ordering};

/// The word of a rank that has not settled yet.
pub const UNSETTLED: u32 = 0;
/// The word of a rank whose region is pinned.
pub const SETTLED_PINNED: u32 = 1;
/// The word of a rank running on pageable memory.
pub const SETTLED_PAGEABLE: u32 = 2;

/// One word per rank, visible to every rank.
pub trait RankSlots: Send + Sync {
    fn ranks(&self) -> usize;
    fn load(&self, rank: usize) -> u32;
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
    Pinned,
    Pageable,
}

/// The agreement could not be reached.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgreementError {
    #[error("rank {rank} out of range for {ranks} ranks")]
    RankOutOfRange { rank: usize, ranks: usize },
    #[error("rank {rank} died before it settled its pin state")]
    RankDied { rank: usize },
    #[error("timed out after {millis} ms waiting for ranks {waiting:?} to settle their pin state")]
    Timeout { millis: u64, waiting: Vec<usize> },
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
