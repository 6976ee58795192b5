//! Where everything is in a pool's index file (design 2.1): page-aligned
//! sections, every field a `u64` word (`u32` for the set hands) reached as
//! an atomic on the mapping.
//!
//! | section | what |
//! |---|---|
//! | pool page | the words of [`W`]: magic `KVOFPOOL`, version, page size, the pool word ([`PoolWord`]), creator, creation time, boot id, geometry, row bytes per rank, file length and the sections' offsets |
//! | fingerprint | config, hashing and one layout part per rank (32), each [`PART_HEADER_WORDS`] words (state, tag, filler's pid, start, pid namespace) and its record, each at a 64-byte boundary |
//! | engine table | 32 entries of 1 KiB: owner word, members word, 33 member records of 3 words (pid, start, pid namespace), the engine-id digest (4 words), 32 `u32` agreement words (one per rank, P7) |
//! | set hands | one `u32` per set |
//! | slot records | 64 bytes per slot: state word, 5 key words, CLOCK word, publisher and time |

use crate::internal::pool::fingerprint::{CONFIG_WORDS, HASHING_WORDS, LAYOUT_WORDS};
use crate::internal::pool::slot::{MAX_ENGINES, MAX_RANKS};
use crate::internal::pool::words::{Geometry, MEMBERS};

/// `b"KVOFPOOL"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KVOFPOOL");
/// Version of the index layout; bumped on any incompatible change.
/// 2: a key lives in either of two sets (`Key::sets`); an engine of
/// version 1 would miss, and `check` as corrupt, the keys in second sets.
/// 3: the closing protocol (`pool::closing`: a tentative `CLOSING`, which
/// an engine of version 2 took for a removal and unlinked the index under
/// the engines using it) and the member holds (`pool::sweep` rule 8: a
/// sweeper of version 3 would judge a version-2 engine of another pid
/// namespace, which takes none, gone while it runs).
pub const VERSION: u64 = 3;
/// The smallest page the sections are aligned to.
pub const MIN_PAGE: usize = 4096;

/// Word indices of the pool page (byte offset: 8 times the index).
pub struct W;

#[allow(missing_docs)]
impl W {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 1;
    pub const PAGE: usize = 2;
    /// The pool word ([`PoolWord`]).
    pub const STATE: usize = 3;
    pub const CREATOR_START: usize = 4;
    pub const CREATOR_PIDNS: usize = 5;
    /// Unix time of creation, nanoseconds.
    pub const CREATED: usize = 6;
    /// The boot id's 16 bytes, little-endian in two words.
    pub const BOOT: usize = 7;
    pub const SLOTS: usize = 9;
    pub const WAYS: usize = 10;
    pub const RANKS: usize = 11;
    pub const ENGINES: usize = 12;
    pub const ROW_BYTES: usize = 13;
    pub const FILE_BYTES: usize = 14;
    pub const FP_OFF: usize = 15;
    pub const ENGINES_OFF: usize = 16;
    pub const HANDS_OFF: usize = 17;
    pub const SLOTS_OFF: usize = 18;
    pub const CREATOR_PID: usize = 19;
}

/// Words of a fingerprint part before its record: state, tag (the
/// `FILLING` word its filler's record belongs to, stored after the record),
/// the filler's pid, start time, pid namespace.
pub const PART_HEADER_WORDS: usize = 5;
/// Bytes of an engine entry.
pub const ENGINE_BYTES: usize = 1024;
/// Bytes of a slot record.
pub const SLOT_BYTES: usize = 64;

/// A fingerprint part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The config part (the creator's, before `READY`).
    Config,
    /// The hashing part (the first scheduler's).
    Hashing,
    /// Rank `r`'s layout part (its first worker's).
    Layout(u8),
}

impl Part {
    /// Words of its record.
    pub fn record_words(self) -> usize {
        match self {
            Part::Config => CONFIG_WORDS,
            Part::Hashing => HASHING_WORDS,
            Part::Layout(_) => LAYOUT_WORDS,
        }
    }

    /// What it is called in messages.
    pub fn describe(self) -> String {
        match self {
            Part::Config => "the fingerprint's config part".into(),
            Part::Hashing => "the fingerprint's hashing part".into(),
            Part::Layout(r) => format!("the fingerprint's layout part of rank {r}"),
        }
    }
}

fn part_bytes(p: Part) -> usize {
    (8 * (PART_HEADER_WORDS + p.record_words())).next_multiple_of(64)
}

/// Offset of part `p` inside the fingerprint section.
pub(crate) fn part_offset(p: Part) -> usize {
    let config = part_bytes(Part::Config);
    let hashing = part_bytes(Part::Hashing);
    match p {
        Part::Config => 0,
        Part::Hashing => config,
        Part::Layout(r) => config + hashing + r as usize * part_bytes(Part::Layout(0)),
    }
}

/// Bytes of the fingerprint section's contents.
fn fingerprint_bytes() -> usize {
    part_offset(Part::Layout(MAX_RANKS))
}

/// Offset of member `m`'s record in an engine entry.
pub(crate) const fn member_offset(m: usize) -> usize {
    16 + 24 * m
}
/// Offset of the engine-id digest in an engine entry.
pub(crate) const ENGINE_ID_OFFSET: usize = member_offset(MEMBERS);
/// Offset of the agreement words in an engine entry: one `u32` per rank,
/// the words of the P7 pin agreement of the entry's engine (bytes that
/// version 1 files made before them held zero, [`UNSETTLED`]; the owner
/// resets them at every claim anyway).
///
/// [`UNSETTLED`]: crate::protocol::agreement::UNSETTLED
pub(crate) const AGREEMENT_OFFSET: usize = ENGINE_ID_OFFSET + 32;

const _: () = assert!(ENGINE_ID_OFFSET + 32 <= AGREEMENT_OFFSET);
const _: () = assert!(AGREEMENT_OFFSET % 4 == 0);
const _: () = assert!(AGREEMENT_OFFSET + 4 * MAX_RANKS as usize <= ENGINE_BYTES);
const _: () = assert!(8 * (W::CREATOR_PID + 1) <= MIN_PAGE);

/// The sections of an index file of one geometry on one page size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sections {
    /// Page size the sections are aligned to.
    pub page: usize,
    /// Offset of the fingerprint.
    pub fingerprint: usize,
    /// Offset of the engine table.
    pub engines: usize,
    /// Offset of the set hands.
    pub hands: usize,
    /// Offset of the slot records.
    pub slots: usize,
    /// The file's length (whole pages, whole huge pages on hugetlbfs).
    pub len: usize,
}

impl Sections {
    /// The sections of `g` on pages of `page` bytes, the file rounded up to
    /// `file_unit` (the hugetlbfs page, or `page`). `None` on overflow.
    pub fn of(g: &Geometry, page: usize, file_unit: usize) -> Option<Sections> {
        let up = |n: usize| n.checked_next_multiple_of(page);
        let fingerprint = page;
        let engines = fingerprint.checked_add(up(fingerprint_bytes())?)?;
        let hands = engines.checked_add(up(MAX_ENGINES as usize * ENGINE_BYTES)?)?;
        let slots = hands.checked_add(up(4 * g.sets() as usize)?)?;
        let end = slots.checked_add(up((g.slots as usize).checked_mul(SLOT_BYTES)?)?)?;
        let len = end.checked_next_multiple_of(file_unit.max(page))?;
        (len <= isize::MAX as usize).then_some(Sections { page, fingerprint, engines, hands, slots, len })
    }
}

// The pool word's encoding is the closing protocol's (`pool::closing`),
// which the models run too.
pub use crate::internal::pool::closing::{PoolState, PoolWord};

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use super::*;

    #[test]
    fn sections_are_page_aligned_and_disjoint() {
        let g = Geometry { slots: 32768, ways: 16, ranks: 8, engines: 32 };
        let s = Sections::of(&g, 4096, 4096).unwrap();
        for off in [s.fingerprint, s.engines, s.hands, s.slots, s.len] {
            assert_eq!(off % 4096, 0);
        }
        assert!(s.engines - s.fingerprint >= fingerprint_bytes());
        assert_eq!(s.hands - s.engines, 32 * 1024);
        assert!(s.slots - s.hands >= 4 * 2048);
        assert_eq!(s.len - s.slots, 32768 * 64, "2 MiB of records for 32,768 slots");
        let huge = Sections::of(&g, 4096, 2 << 20).unwrap();
        assert_eq!(huge.len % (2 << 20), 0);
        assert!(Sections::of(&Geometry { slots: u32::MAX, ways: 1, ranks: 1, engines: 1 }, 4096, 4096).is_some());
    }

    #[test]
    fn parts_do_not_overlap() {
        assert!(part_offset(Part::Hashing) >= 8 * (PART_HEADER_WORDS + CONFIG_WORDS));
        assert!(part_offset(Part::Layout(0)) >= part_offset(Part::Hashing) + 8 * (PART_HEADER_WORDS + HASHING_WORDS));
        assert!(part_offset(Part::Layout(1)) >= part_offset(Part::Layout(0)) + 8 * (PART_HEADER_WORDS + LAYOUT_WORDS));
    }
}
