//! Eviction policies behind one trait.
//!
//! A policy orders the resident blocks and picks victims; the manager owns
//! block states and slots and tells the policy which blocks are eviction
//! *candidates* (ready and not being read). A policy evicts only candidates,
//! so a write-pending block or a block with readers is never chosen.
//!
//! Within a batch, the manager inserts and touches keys last to first, so the
//! first key of a batch ends up most recently used: for a prefix of blocks,
//! the earlier blocks are worth more, since the later ones are useless
//! without them.

mod arc;
mod lru;
pub(crate) mod recency;

pub use arc::ArcPolicy;
pub use lru::LruPolicy;

use super::config::PolicyKind;
use super::key::BlockKey;

/// An eviction policy. All operations are O(log n) in the number of keys the
/// policy tracks.
pub trait EvictionPolicy: std::fmt::Debug + Send {
    /// Which policy this is.
    fn kind(&self) -> PolicyKind;
    /// A new block was given a slot (it is write-pending: not a candidate).
    fn insert(&mut self, key: BlockKey);
    /// A resident block was used; `ready` says whether its store completed.
    fn touch(&mut self, key: BlockKey, ready: bool);
    /// The block became (or stopped being) an eviction candidate.
    fn set_candidate(&mut self, key: BlockKey, candidate: bool);
    /// The block left without eviction (failed store, reset): forget it
    /// without remembering it as evicted.
    fn remove(&mut self, key: BlockKey);
    /// Chooses, removes and returns a victim among the candidates.
    fn evict(&mut self) -> Option<BlockKey>;
    /// Number of candidates.
    fn candidates(&self) -> usize;
    /// Number of resident blocks the policy tracks.
    fn resident(&self) -> usize;
    /// Whether `key` is resident (tracked as a stored or pending block).
    fn is_resident(&self, key: &BlockKey) -> bool;
    /// Whether `key` is resident and a candidate.
    fn is_candidate(&self, key: &BlockKey) -> bool;
    /// Forgets everything, history included.
    fn clear(&mut self);
    /// Checks the policy's own invariants.
    fn check_invariants(&self) -> Result<(), String>;
    /// Starts remembering what each change replaces, so that
    /// [`undo`](Self::undo) can put the policy back as it is now (a journal
    /// in progress is dropped).
    fn begin_undo(&mut self);
    /// Stops remembering; returns what [`undo`](Self::undo) needs.
    fn end_undo(&mut self) -> PolicyUndo;
    /// Puts the policy back exactly as it was at [`begin_undo`](Self::begin_undo)
    /// (order, candidates, ARC's ghosts and target). Valid only while the
    /// policy has not changed since [`end_undo`](Self::end_undo); an undo of
    /// another policy kind is refused, changing nothing.
    fn undo(&mut self, undo: PolicyUndo) -> Result<(), String>;
}

/// What an [`EvictionPolicy`] needs to undo the changes of one journal
/// ([`EvictionPolicy::end_undo`]); opaque.
#[derive(Clone, Debug)]
pub struct PolicyUndo(pub(crate) UndoOf);

#[derive(Clone, Debug)]
pub(crate) enum UndoOf {
    Lru(recency::RecencyUndo<BlockKey>),
    Arc { target: usize, lists: Box<[recency::RecencyUndo<BlockKey>; 4]> },
}

/// Builds the policy `kind` for a manager of `capacity` slots.
pub fn new_policy(kind: PolicyKind, capacity: usize) -> Box<dyn EvictionPolicy> {
    match kind {
        PolicyKind::Lru => Box::new(LruPolicy::default()),
        PolicyKind::Arc => Box::new(ArcPolicy::new(capacity)),
    }
}
