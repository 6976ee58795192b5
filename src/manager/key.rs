//! Block keys and host slot ids.

use std::fmt;

/// Identifies one KV-cache block: the engine's block hash plus the index of
/// the KV-cache group it belongs to (hybrid models keep one group per kind
/// of attention layer; a plain model uses group 0).
///
/// Engines whose block hashes are wider than 64 bits fold them to 64 bits
/// before building a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey {
    /// The engine's hash of the block's tokens (and of its prefix), folded
    /// to 64 bits: equal hashes are the same block.
    pub hash: u64,
    /// The KV-cache group the block belongs to (0 for a plain model); the
    /// same hash in two groups is two blocks.
    pub group: u32,
}

impl BlockKey {
    /// A key for block `hash` in group `group`.
    pub const fn new(hash: u64, group: u32) -> Self {
        Self { hash, group }
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}/g{}", self.hash, self.group)
    }
}

/// Index of one block-sized slot of the host region, in `0..capacity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub u32);

impl SlotId {
    /// The slot index as a `usize`, for pointer math in the region layer.
    pub fn index(self) -> usize {
        // u32 always fits in usize on the 32- and 64-bit targets we build for.
        self.0 as usize
    }
}

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot {}", self.0)
    }
}

/// A key together with the host slot it occupies (or occupied, in an
/// event about a block that left).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // the type's doc says what both fields are
pub struct Placement {
    pub key: BlockKey,
    pub slot: SlotId,
}
