//! The engine table (design 2.4): 32 entries, each an owner word, a
//! members word and one record per member (the scheduler, each rank's
//! worker). An entry's index is the engine's bit in slot reader masks and
//! the writer field of a `WRITING` word.
//!
//! | word | bits |
//! |---|---|
//! | owner | 0-31 pid (the claimer's in `LIVE`, the sweeper's in `RECLAIMING`), 32-61 generation (30 bits), 62-63 state: 0 `FREE`, 1 `LIVE`, 2 `RECLAIMING`, 3 invalid |
//! | members | 0-32 mask (bit 0 the scheduler, bit `1 + r` rank `r`'s worker), 33-56 generation (24 bits), 57-63 zero |

/// An entry's owner state (bits 62-63 of the owner word).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerState {
    /// Unused: a joining engine may claim it.
    Free,
    /// An engine's: its members read and write the pool.
    Live,
    /// Being swept by the process whose pid the word names.
    Reclaiming,
    /// Code 3: never written by this version.
    Invalid,
}

/// The owner word of an entry, by value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnerWord {
    /// The entry's state.
    pub state: OwnerState,
    /// Moves on at every claim and every return to `FREE` (30 bits, wraps).
    pub generation: u32,
    /// The claimer's pid (`LIVE`), the sweeper's (`RECLAIMING`), 0 when `FREE`.
    pub pid: u32,
}

const GEN30: u64 = (1 << 30) - 1;
const GEN24: u64 = (1 << 24) - 1;
/// Bits of the members mask: the scheduler and 32 ranks.
pub const MEMBER_MASK: u64 = (1 << 33) - 1;

impl OwnerWord {
    /// Decodes a raw owner word.
    pub fn decode(raw: u64) -> OwnerWord {
        let state = match raw >> 62 {
            0 => OwnerState::Free,
            1 => OwnerState::Live,
            2 => OwnerState::Reclaiming,
            _ => OwnerState::Invalid,
        };
        OwnerWord { state, generation: ((raw >> 32) & GEN30) as u32, pid: raw as u32 }
    }

    /// Encodes this word (the generation taken modulo 2^30).
    pub fn encode(self) -> u64 {
        let state: u64 = match self.state {
            OwnerState::Free => 0,
            OwnerState::Live => 1,
            OwnerState::Reclaiming => 2,
            OwnerState::Invalid => 3,
        };
        (state << 62) | ((u64::from(self.generation) & GEN30) << 32) | u64::from(self.pid)
    }

    /// The generation after `generation` (modulo 2^30).
    pub fn next_generation(generation: u32) -> u32 {
        ((u64::from(generation) + 1) & GEN30) as u32
    }
}

/// The members word of an entry, by value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MembersWord {
    /// Bit 0 the scheduler, bit `1 + r` rank `r`'s worker.
    pub mask: u64,
    /// Moves on at every seal (a sweep's) and every reset (24 bits, wraps):
    /// a registration expecting an older generation fails.
    pub generation: u32,
}

impl MembersWord {
    /// Decodes a raw members word.
    pub fn decode(raw: u64) -> MembersWord {
        MembersWord { mask: raw & MEMBER_MASK, generation: ((raw >> 33) & GEN24) as u32 }
    }

    /// Encodes this word (mask bits past 32 dropped, generation modulo 2^24).
    pub fn encode(self) -> u64 {
        (self.mask & MEMBER_MASK) | ((u64::from(self.generation) & GEN24) << 33)
    }

    /// The generation after `generation` (modulo 2^24).
    pub fn next_generation(generation: u32) -> u32 {
        ((u64::from(generation) + 1) & GEN24) as u32
    }
}

/// The member index of the scheduler.
pub const SCHEDULER: u8 = 0;

/// The member index of rank `rank`'s worker.
pub fn worker(rank: u8) -> u8 {
    1 + rank
}

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        for state in [OwnerState::Free, OwnerState::Live, OwnerState::Reclaiming, OwnerState::Invalid] {
            let w = OwnerWord { state, generation: GEN30 as u32, pid: u32::MAX };
            assert_eq!(OwnerWord::decode(w.encode()), w);
        }
        assert_eq!(OwnerWord::decode(0), OwnerWord { state: OwnerState::Free, generation: 0, pid: 0 });
        assert_eq!(OwnerWord::next_generation(GEN30 as u32), 0);
        let m = MembersWord { mask: MEMBER_MASK, generation: GEN24 as u32 };
        assert_eq!(MembersWord::decode(m.encode()), m);
        assert_eq!(MembersWord::decode(m.encode()).encode() >> 57, 0);
        assert_eq!(MembersWord::next_generation(GEN24 as u32), 0);
        assert_eq!(worker(31), 32);
    }
}
