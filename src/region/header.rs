//! The header at the start of a shared region file.
//!
//! With [`FileSplit::Single`](super::FileSplit::Single) the header occupies
//! the first `header_bytes` of the one file (one page, at least 4 KiB, or
//! 2 MiB when huge pages were asked for so the data area starts on a
//! huge-page boundary); the data area follows. With
//! [`FileSplit::Multi`](super::FileSplit::Multi) the header file holds the
//! header alone (whole pages: the fixed part and the file table) and the
//! data lives in the data files. Layout (native endianness; every rank runs
//! on the same node):
//!
//! | offset | field          | type            | written by / when |
//! |-------:|----------------|-----------------|-------------------|
//! | 0      | `magic`        | u64             | creator, before READY |
//! | 8      | `version`      | u32             | creator, before READY |
//! | 12     | `header_bytes` | u32             | creator, before READY |
//! | 16     | `total_bytes`  | u64             | creator, before READY |
//! | 24     | `chunk_bytes`  | u64             | creator, before READY |
//! | 32     | `num_rows`     | u64             | creator, before READY |
//! | 40     | `num_ranks`    | u32             | creator, before READY |
//! | 44     | `creator_rank` | u32             | creator, before READY |
//! | 48     | `session`      | u64             | creator, before READY |
//! | 56     | `creator_pid`  | u32             | creator, before READY |
//! | 60     | padding        | u32             | |
//! | 64     | `join`         | atomic u64      | every rank, CAS |
//! | 72     | `order`        | u64             | creator, before READY (0 row-interleaved, 1 rank-major) |
//! | 80     | `num_files`    | u64             | creator, before READY (0: one file) |
//! | 88     | `file_bytes`   | u64             | creator, before READY (bytes per data file) |
//! | 96     | `abandon_note` | atomic u64      | a rank that abandons the region for a reason it can name (a refused data file), CAS 0 -> note before it abandons; see [`AbandonNote`](super::error::AbandonNote) |
//! | 104    | `creator_pidns`| u64             | creator, before READY: the inode of its `/proc/self/ns/pid` (its pid namespace; 0 when unknown), so a joiner tells whether `creator_pid` means anything to it |
//! | 112    | reserved       | 2 x u64         | zero |
//! | 128    | `rank_pids`    | 32 x atomic u32 | rank r, CAS 0 -> pid before it sets its bit |
//! | 256    | `rank_slots`   | 32 x atomic u32 | reserved for the P7 agreement |
//! | 384    | file table     | num_files x atomic u64 | creator: data file k's inode, stored right after it created the file and before it sizes it |
//!
//! In a persistent region (magic [`PERSISTENT_MAGIC`],
//! [`super::persistent`]) `join` is `Init` while its creator makes the
//! files, `Ready` once they are all made (for good), `Abandoned` while a
//! half-made or removed one is being taken apart; its mask, `rank_pids`
//! and `rank_slots` are unused (ranks of many engines come and go).
//!
//! `join` packs the whole join protocol into one word so that every
//! transition is a single compare-and-swap: the low 32 bits are the mask of
//! ranks that have mapped the file, the high 32 bits the join state:
//! 0 `Init` (header being written), 1 `Ready` (ranks may join), 2 `Complete`
//! (every rank mapped; unlink), 3 `Abandoned` (a rank gave up; unlink, no
//! more joins). A file fresh from `ftruncate` reads as all zeros, which is
//! `Init` with an empty mask.
//!
//! The atomics here are `core::sync::atomic` on memory shared between
//! processes, not `crate::sync`: this is a cross-process protocol, which
//! loom cannot model (it sees one process), and loom atomics cannot live in
//! an mmap'd file.

// Cross-process words on shared memory: `core::sync::atomic`, never the
// sync facade (loom cannot model another process).
#![allow(clippy::disallowed_types)]

use core::marker::PhantomData;
use core::mem::{offset_of, size_of};
use core::ptr::{addr_of, addr_of_mut, NonNull};
// Cross-process atomics on the shared mapping (see the module comment).
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Most ranks one shared region supports (bits of the join mask).
pub const MAX_RANKS: usize = 32;

/// `b"KVOFLREG"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KVOFLREG");

/// `b"KVOFLPRS"` read as a little-endian u64: the magic of a persistent
/// region ([`Region::open_persistent`](super::Region::open_persistent)).
/// Its creator writes it (and every other field) right after sizing the
/// header file, before any data file exists, so that a half-made region
/// says it is one; a create/join region's creator writes [`MAGIC`] only
/// when it publishes `Ready`. Neither kind opens the other: the magic
/// differs ([`RegionError::BadHeader`](super::RegionError::BadHeader)).
pub const PERSISTENT_MAGIC: u64 = u64::from_le_bytes(*b"KVOFLPRS");

/// Version of the header layout; bumped on any incompatible change
/// (2: order, data files and the file table).
pub const VERSION: u32 = 2;

/// Offset of the file table (data files' inode numbers).
pub(crate) const FILE_TABLE_OFFSET: usize = 384;

/// Smallest header: one 4 KiB page (more on machines with larger pages).
pub const MIN_HEADER_BYTES: usize = 4096;

/// Header size when huge pages are requested: the data area then starts on
/// a 2 MiB boundary of the file, which tmpfs huge pages need.
pub const HUGE_HEADER_BYTES: usize = 2 << 20;

/// The header as laid out in the file. Never referenced as a whole (other
/// processes write parts of it): fields are reached through raw pointers
/// and the atomics through [`Hdr`].
#[repr(C)]
pub(crate) struct Header {
    magic: u64,
    version: u32,
    header_bytes: u32,
    total_bytes: u64,
    chunk_bytes: u64,
    num_rows: u64,
    num_ranks: u32,
    creator_rank: u32,
    session: u64,
    creator_pid: u32,
    _pad: u32,
    join: AtomicU64,
    order: u64,
    num_files: u64,
    file_bytes: u64,
    abandon_note: AtomicU64,
    creator_pidns: u64,
    _reserved: [u64; 2],
    rank_pids: [AtomicU32; MAX_RANKS],
    rank_slots: [AtomicU32; MAX_RANKS],
}

const _: () = {
    assert!(offset_of!(Header, magic) == 0);
    assert!(offset_of!(Header, version) == 8);
    assert!(offset_of!(Header, header_bytes) == 12);
    assert!(offset_of!(Header, total_bytes) == 16);
    assert!(offset_of!(Header, chunk_bytes) == 24);
    assert!(offset_of!(Header, num_rows) == 32);
    assert!(offset_of!(Header, num_ranks) == 40);
    assert!(offset_of!(Header, creator_rank) == 44);
    assert!(offset_of!(Header, session) == 48);
    assert!(offset_of!(Header, creator_pid) == 56);
    assert!(offset_of!(Header, join) == 64);
    assert!(offset_of!(Header, order) == 72);
    assert!(offset_of!(Header, num_files) == 80);
    assert!(offset_of!(Header, file_bytes) == 88);
    assert!(offset_of!(Header, abandon_note) == 96);
    assert!(offset_of!(Header, creator_pidns) == 104);
    assert!(offset_of!(Header, rank_pids) == 128);
    assert!(offset_of!(Header, rank_slots) == 256);
    assert!(size_of::<Header>() == 384);
    assert!(size_of::<Header>() == FILE_TABLE_OFFSET);
    assert!(size_of::<Header>() <= MIN_HEADER_BYTES);
    assert!(MAX_RANKS <= 32); // the mask is the low half of `join`
};

/// The immutable fields the creator writes before marking the file READY.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fields {
    pub magic: u64,
    pub version: u32,
    pub header_bytes: u32,
    pub total_bytes: u64,
    pub chunk_bytes: u64,
    pub num_rows: u64,
    pub num_ranks: u32,
    pub creator_rank: u32,
    pub session: u64,
    pub creator_pid: u32,
    pub creator_pidns: u64,
    pub order: u64,
    pub num_files: u64,
    pub file_bytes: u64,
}

/// Where the file is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JoinState {
    /// Created and sized; the header is being written. Zero: a fresh file.
    Init,
    /// Header written; ranks may map and set their bit.
    Ready,
    /// Every rank set its bit; whoever sees this unlinks the file.
    Complete,
    /// Some rank gave up (timeout, drop, `unlink_now`); nobody may join.
    Abandoned,
    /// A value no version of this code writes.
    Unknown(u32),
}

impl JoinState {
    fn code(self) -> u32 {
        match self {
            JoinState::Init => 0,
            JoinState::Ready => 1,
            JoinState::Complete => 2,
            JoinState::Abandoned => 3,
            JoinState::Unknown(c) => c,
        }
    }
    fn from_code(c: u32) -> Self {
        match c {
            0 => JoinState::Init,
            1 => JoinState::Ready,
            2 => JoinState::Complete,
            3 => JoinState::Abandoned,
            c => JoinState::Unknown(c),
        }
    }
}

/// A decoded `join` word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct JoinWord {
    pub state: JoinState,
    pub mask: u32,
}

impl JoinWord {
    pub fn decode(w: u64) -> Self {
        JoinWord { state: JoinState::from_code((w >> 32) as u32), mask: w as u32 }
    }
    pub fn encode(self) -> u64 {
        ((self.state.code() as u64) << 32) | self.mask as u64
    }
    /// Ranks whose bit is set, ascending.
    pub fn mapped(self) -> Vec<usize> {
        (0..MAX_RANKS).filter(|r| self.mask & (1 << r) != 0).collect()
    }
    /// Ranks below `num_ranks` whose bit is clear, ascending.
    pub fn missing(self, num_ranks: usize) -> Vec<usize> {
        (0..num_ranks.min(MAX_RANKS)).filter(|r| self.mask & (1 << r) == 0).collect()
    }
}

/// The mask with the low `num_ranks` bits set.
pub(crate) fn full_mask(num_ranks: usize) -> u32 {
    debug_assert!((1..=MAX_RANKS).contains(&num_ranks));
    if num_ranks >= 32 {
        u32::MAX
    } else {
        (1u32 << num_ranks) - 1
    }
}

/// A handle on the header of a live mapping.
#[derive(Clone, Copy)]
pub(crate) struct Hdr<'a> {
    ptr: NonNull<Header>,
    /// Entries of the file table that fit in the mapped header.
    table: usize,
    _map: PhantomData<&'a ()>,
}

impl<'a> Hdr<'a> {
    /// # Safety
    /// `base` must be the start of a mapping of at least `header_bytes`
    /// (>= `size_of::<Header>()`) bytes that stays mapped for `'a`; it is
    /// page aligned, hence aligned for `Header` and the file table.
    pub unsafe fn from_base(base: NonNull<u8>, header_bytes: usize) -> Self {
        debug_assert!(header_bytes >= size_of::<Header>());
        Hdr { ptr: base.cast(), table: header_bytes.saturating_sub(FILE_TABLE_OFFSET) / 8, _map: PhantomData }
    }

    /// The file table: data file k's inode number (0: not created yet),
    /// as many entries as the mapped header holds.
    pub fn file_inodes(&self) -> &'a [AtomicU64] {
        // SAFETY: the table starts at FILE_TABLE_OFFSET (8-byte aligned on a
        // page-aligned base) and `table` entries fit inside the mapped
        // header (constructor contract); the entries are only ever accessed
        // atomically by every process; the mapping lives for 'a.
        unsafe {
            std::slice::from_raw_parts(
                self.ptr.as_ptr().cast::<u8>().add(FILE_TABLE_OFFSET).cast::<AtomicU64>(),
                self.table,
            )
        }
    }

    /// Writes the immutable fields. Only the creator calls this, before it
    /// publishes READY with a release CAS on `join`.
    pub fn write_fields(&self, f: &Fields) {
        let h = self.ptr.as_ptr();
        // SAFETY: `h` points to a live, aligned Header (constructor
        // contract). Only plain fields are written, through raw pointers (no
        // reference to the whole header is formed), and no other rank reads
        // them before it observes READY, which is published after this.
        unsafe {
            addr_of_mut!((*h).magic).write_volatile(f.magic);
            addr_of_mut!((*h).version).write_volatile(f.version);
            addr_of_mut!((*h).header_bytes).write_volatile(f.header_bytes);
            addr_of_mut!((*h).total_bytes).write_volatile(f.total_bytes);
            addr_of_mut!((*h).chunk_bytes).write_volatile(f.chunk_bytes);
            addr_of_mut!((*h).num_rows).write_volatile(f.num_rows);
            addr_of_mut!((*h).num_ranks).write_volatile(f.num_ranks);
            addr_of_mut!((*h).creator_rank).write_volatile(f.creator_rank);
            addr_of_mut!((*h).session).write_volatile(f.session);
            addr_of_mut!((*h).creator_pid).write_volatile(f.creator_pid);
            addr_of_mut!((*h).creator_pidns).write_volatile(f.creator_pidns);
            addr_of_mut!((*h).order).write_volatile(f.order);
            addr_of_mut!((*h).num_files).write_volatile(f.num_files);
            addr_of_mut!((*h).file_bytes).write_volatile(f.file_bytes);
        }
    }

    /// Reads the immutable fields. Meaningful once `join` was read as READY
    /// or later with acquire ordering.
    pub fn read_fields(&self) -> Fields {
        let h = self.ptr.as_ptr();
        // SAFETY: `h` points to a live, aligned Header. Volatile reads of
        // plain integers through raw pointers: any bit pattern is a valid
        // integer, and after the acquire load of READY the creator no longer
        // writes them.
        unsafe {
            Fields {
                magic: addr_of!((*h).magic).read_volatile(),
                version: addr_of!((*h).version).read_volatile(),
                header_bytes: addr_of!((*h).header_bytes).read_volatile(),
                total_bytes: addr_of!((*h).total_bytes).read_volatile(),
                chunk_bytes: addr_of!((*h).chunk_bytes).read_volatile(),
                num_rows: addr_of!((*h).num_rows).read_volatile(),
                num_ranks: addr_of!((*h).num_ranks).read_volatile(),
                creator_rank: addr_of!((*h).creator_rank).read_volatile(),
                session: addr_of!((*h).session).read_volatile(),
                creator_pid: addr_of!((*h).creator_pid).read_volatile(),
                creator_pidns: addr_of!((*h).creator_pidns).read_volatile(),
                order: addr_of!((*h).order).read_volatile(),
                num_files: addr_of!((*h).num_files).read_volatile(),
                file_bytes: addr_of!((*h).file_bytes).read_volatile(),
            }
        }
    }

    /// The join word.
    pub fn join(&self) -> &'a AtomicU64 {
        // SAFETY: the field lies inside the live mapping for 'a, is 8-byte
        // aligned (offset 64 of a page-aligned base) and is only ever
        // accessed atomically by every process.
        unsafe { &*addr_of!((*self.ptr.as_ptr()).join) }
    }

    /// Per-rank process ids (0 until the rank maps the file).
    pub fn rank_pids(&self) -> &'a [AtomicU32; MAX_RANKS] {
        // SAFETY: as for `join`: inside the mapping, aligned, atomic-only.
        unsafe { &*addr_of!((*self.ptr.as_ptr()).rank_pids) }
    }

    /// Why a rank abandoned the region, when it could name it (0: not
    /// recorded); see [`AbandonNote`](super::error::AbandonNote).
    pub fn abandon_note(&self) -> &'a AtomicU64 {
        // SAFETY: as for `join`: inside the mapping, 8-byte aligned (offset
        // 96 of a page-aligned base), atomic-only.
        unsafe { &*addr_of!((*self.ptr.as_ptr()).abandon_note) }
    }

    /// Per-rank words reserved for the P7 cross-rank agreement.
    pub fn rank_slots(&self) -> &'a [AtomicU32; MAX_RANKS] {
        // SAFETY: as for `join`: inside the mapping, aligned, atomic-only.
        unsafe { &*addr_of!((*self.ptr.as_ptr()).rank_slots) }
    }

    /// The join word, decoded (acquire).
    pub fn load(&self) -> JoinWord {
        JoinWord::decode(self.join().load(Ordering::Acquire))
    }

    /// Applies `f` to the join word in a CAS loop until it succeeds or `f`
    /// declines (returns `None`). Returns the word before and after on
    /// success, or the word `f` declined on failure.
    pub fn update(&self, mut f: impl FnMut(JoinWord) -> Option<JoinWord>) -> Result<(JoinWord, JoinWord), JoinWord> {
        let j = self.join();
        let mut cur = j.load(Ordering::Acquire);
        loop {
            let old = JoinWord::decode(cur);
            let Some(new) = f(old) else {
                return Err(old);
            };
            match j.compare_exchange_weak(cur, new.encode(), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok((old, new)),
                Err(actual) => cur = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_word_round_trips() {
        for state in
            [JoinState::Init, JoinState::Ready, JoinState::Complete, JoinState::Abandoned, JoinState::Unknown(77)]
        {
            for mask in [0u32, 1, 0x8000_0001, u32::MAX] {
                let w = JoinWord { state, mask };
                assert_eq!(JoinWord::decode(w.encode()), w);
            }
        }
        assert_eq!(JoinWord::decode(0).state, JoinState::Init);
    }

    #[test]
    fn masks() {
        assert_eq!(full_mask(1), 1);
        assert_eq!(full_mask(3), 0b111);
        assert_eq!(full_mask(32), u32::MAX);
        let w = JoinWord { state: JoinState::Ready, mask: 0b101 };
        assert_eq!(w.mapped(), vec![0, 2]);
        assert_eq!(w.missing(4), vec![1, 3]);
    }
}
