//! Per-block state and the answers of a lookup.

use std::fmt;

use super::key::SlotId;
use crate::names::named;

/// Where a stored block is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// A slot is reserved and the store (GPU -> host) is in flight: the block
    /// cannot be read, and cannot be evicted.
    WritePending,
    /// The store completed: the block can be read. `readers` loads are in
    /// flight; while it is above zero the block cannot be evicted.
    Ready {
        /// Number of prepared and not yet completed loads.
        readers: u32,
    },
}

impl BlockState {
    /// Whether the policy may evict a block in this state.
    pub fn is_evictable(self) -> bool {
        matches!(self, BlockState::Ready { readers: 0 })
    }
}

impl fmt::Display for BlockState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockState::WritePending => f.write_str("write-pending"),
            BlockState::Ready { readers: 0 } => f.write_str("ready"),
            BlockState::Ready { readers } => write!(f, "ready with {readers} readers"),
        }
    }
}

/// A resident block: its slot and its state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub(crate) slot: SlotId,
    pub(crate) state: BlockState,
}

/// The answer of [`BlockManager::lookup`](super::BlockManager::lookup) for one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lookup {
    /// Not stored.
    Miss,
    /// Stored and readable.
    Hit,
    /// Stored, but its store has not completed: ask again later.
    HitPending,
}

named!(Lookup, "lookup answer" {
    Hit => "hit",
    Miss => "miss",
    HitPending => "hit_pending",
});

impl Lookup {
    /// Number of leading [`Lookup::Hit`] answers: how many blocks of a prefix
    /// can be loaded now.
    pub fn leading_hits(answers: &[Lookup]) -> usize {
        answers.iter().take_while(|a| **a == Lookup::Hit).count()
    }
}
