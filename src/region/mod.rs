//! The host region: anonymous or /dev/shm shared mapping.
//!
//! Two kinds, one type ([`Region`]):
//! - **anonymous** ([`Region::anonymous`]): private memory of one process;
//! - **shared** ([`Region::create`] / [`Region::join`]): files under
//!   /dev/shm that the ranks of one node map together: the header file
//!   `kvoffload-<name>` and, by default ([`FileSplit::Multi`]), data files
//!   `kvoffload-<name>.<k>` mapped back to back behind it in one reserved
//!   address range (or one file holding both, [`FileSplit::Single`]). The
//!   creator makes them with `O_EXCL` after checking /dev/shm's free space
//!   and the memory this process can get ([`limits`]); joiners open them
//!   without following links and use only files of their own user that
//!   nobody else may read or write ([`ShmOptions::allow_group`] for ranks
//!   of different users, [`RegionError::UntrustedFile`] otherwise); they
//!   wait (with a deadline) until they are
//!   sized and initialised; each rank reserves its own data files; the files
//!   are unlinked as soon as every rank has mapped them, and no rank killed
//!   at any point leaves one behind once the survivors return (see [`shm`]
//!   for the protocol and the argument);
//! - **persistent** ([`Region::open_persistent`], [`Region::remove_persistent`]):
//!   the same files, created by the first process to come and opened by
//!   every later one, never unlinked by the library (see [`persistent`]).
//!
//! Both kinds share the per-rank [`Layout`]: rows of `num_ranks` slots of
//! `chunk_bytes` (rank `r`'s chunk `i` at row `i`, slot `r`), or rank-major
//! (rank `r`'s chunks contiguous, [`Layout::rank_major`]). Offsets are
//! relative to the data area, which starts at [`Region::as_ptr`] and is
//! contiguous whatever the files; a shared region also carries a header
//! before it ([`header`]). [`Region::pin_ranges`] says what this rank
//! registers: with a multi-file rank-major region only its own share.
//!
//! Memory of a region is written by DMA and by other processes, outside
//! Rust's view, so the main interface is raw: [`Region::as_ptr`],
//! [`Region::raw_range`], [`Region::chunk_ptr`]. Safe slices exist where
//! they are sound: a rank's own chunks through `&mut self`, the whole area
//! of an anonymous region, and copies out of any chunk.
//!
//! This layer uses no in-process synchronisation; the only atomics are the
//! cross-process words of the shared header (`core::sync::atomic`, see
//! [`header`]), and the only threads reserve a rank's data files and are
//! joined before `create`/`join` returns. It builds unchanged under
//! `--cfg loom`.

mod anon;
pub mod error;
mod files;
pub mod header;
pub mod hugetlb;
pub mod layout;
pub mod limits;
mod mapping;
pub mod options;
pub mod pages;
pub mod persistent;
mod persistent_remove;
pub mod shm;
mod shm_files;
mod sys;
mod trust;

use std::io;
use std::ops::Range;
use std::path::Path;
use std::ptr::NonNull;

use mapping::Mapping;

pub use error::{AbandonNote, AbandonReason, FileProblem, JoinPhase, RegionError};
pub use header::MAX_RANKS;
pub use layout::{Layout, Location, Order, RankView, RowChunks, RowSpan};
pub use limits::{available_memory, mem_available, LimitSource, MemoryBudget};
pub use options::{AnonOptions, FileSplit, ShmObserver, ShmOptions, ShmStep, DEFAULT_FILE_BYTES, MAX_FILES};
pub use persistent::PersistentOrigin;
pub use shm::shm_path;
pub(crate) use sys::mincore;
// The pool's index file (`crate::pool::file`) is made, opened, trusted and
// removed with the region's own helpers.
pub(crate) use sys::Backoff;
pub use sys::{fs_available, page_size};
pub(crate) use trust::{check_create_mode, FileMeta, OpenFailure, RegionDir, Trust};

/// Where shared regions live unless [`ShmOptions::dir`] says otherwise.
pub const DEFAULT_SHM_DIR: &str = "/dev/shm";

/// Prefix of every region file name (what a leak check greps for).
pub const SHM_PREFIX: &str = "kvoffload-";

type Result<T> = std::result::Result<T, RegionError>;

/// Which kind of memory backs a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionKind {
    /// Private anonymous memory of this process.
    Anonymous,
    /// A /dev/shm file shared by the ranks of one node.
    Shared,
}

#[derive(Debug)]
enum Kind {
    Anonymous,
    Shared(Box<shm_files::Shared>),
}

/// A raw address range inside a region's mapping: what a pinning engine
/// registers or pre-faults.
///
/// It is an address and a length, nothing more: it does not keep the
/// mapping alive, and using it after the region is dropped is the caller's
/// bug. It is `Send` and `Sync` (an address may travel to worker threads;
/// dereferencing it is `unsafe` anyway).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawRange {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: RawRange is a plain address and length; it grants no access by
// itself (every dereference goes through an unsafe raw pointer whose caller
// must uphold validity), so sharing or sending it between threads is sound.
unsafe impl Send for RawRange {}
// SAFETY: see the Send impl; `&RawRange` only exposes copies of the address.
unsafe impl Sync for RawRange {}

impl RawRange {
    /// First byte of the range.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// First byte of the range, non-null.
    pub fn as_non_null(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address range as integers, `start..end`.
    pub fn addr_range(&self) -> Range<usize> {
        let s = self.ptr.as_ptr() as usize;
        s..s + self.len
    }
}

/// Registration units per data file, at least ([`Region::pin_ranges`]).
pub const UNITS_PER_FILE: usize = 4;

/// One registration unit of what this rank pins ([`Region::pin_ranges`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinRange {
    /// The bytes to register (page aligned, whole chunks or whole rows).
    pub range: RawRange,
    /// The data file the bytes lie in, for a multi-file shared region
    /// (pre-faulting spreads its workers over files); `None` otherwise.
    pub file: Option<usize>,
}

/// A mapped host region: anonymous or a shared /dev/shm file. See the
/// module documentation.
///
/// Dropping it unmaps the memory; a shared region that is still linked is
/// first abandoned (ranks that have not joined yet fail) and unlinked.
#[derive(Debug)]
pub struct Region {
    map: Mapping,
    /// Offset of the data area in the mapping (the header size; 0 when anonymous).
    data_offset: usize,
    layout: Layout,
    rank: usize,
    huge_pages_advised: bool,
    kind: Kind,
}

impl Region {
    /// The layout of the data area.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// This process's rank (0 for an anonymous region unless given otherwise).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Anonymous or shared.
    pub fn kind(&self) -> RegionKind {
        match self.kind {
            Kind::Anonymous => RegionKind::Anonymous,
            Kind::Shared(_) => RegionKind::Shared,
        }
    }

    /// The file's path for a shared region (it may already be unlinked).
    pub fn path(&self) -> Option<&Path> {
        match &self.kind {
            Kind::Shared(s) => Some(&s.path),
            Kind::Anonymous => None,
        }
    }

    /// Whether this rank still believes some file of the shared region is
    /// linked (false for anonymous regions and once the files were seen
    /// removed).
    pub fn is_linked(&self) -> bool {
        match &self.kind {
            Kind::Shared(s) => s.linked(),
            Kind::Anonymous => false,
        }
    }

    /// Start of the data area (page aligned).
    ///
    /// The memory may be written concurrently by DMA, by this process
    /// through [`Region::as_mut_ptr`] and, for a shared region, by other
    /// processes; reading it through this pointer is the caller's contract.
    pub fn as_ptr(&self) -> *const u8 {
        self.as_mut_ptr().cast_const()
    }

    /// Start of the data area, for writing (like a cell: the region hands
    /// out write access through `&self` because DMA engines and other
    /// processes write it anyway). Writing while a slice from
    /// [`Region::own_chunk`] or [`Region::as_slice`] overlapping it is alive
    /// is undefined behaviour.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        // SAFETY: data_offset <= map.len() (header size of a mapping that
        // includes it, or 0), so the result stays inside the mapping.
        unsafe { self.map.as_mut_ptr().add(self.data_offset) }
    }

    /// Bytes of the data area (= `layout().data_bytes()`).
    pub fn len(&self) -> usize {
        self.layout.data_bytes()
    }

    /// Always false: layouts are never empty. Present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The data area as a raw range (what pinning registers).
    pub fn raw_range(&self) -> RawRange {
        RawRange { ptr: self.data_ptr(), len: self.len() }
    }

    /// The whole mapping, header page included (what pre-faulting may
    /// touch; equal to [`Region::raw_range`] for anonymous regions).
    pub fn mapping_range(&self) -> RawRange {
        RawRange { ptr: NonNull::new(self.map.as_mut_ptr()).expect("mmap never returns null"), len: self.map.len() }
    }

    /// Bytes of the whole mapping that transparent huge pages back now
    /// (`/proc/self/smaps`; `None` where it cannot be read).
    pub fn huge_mapped_bytes(&self) -> Option<u64> {
        pages::huge_mapped_bytes(self.mapping_range().addr_range())
    }

    /// A sub-range of the data area, `bytes` relative to [`Region::as_ptr`].
    pub fn raw_subrange(&self, bytes: Range<usize>) -> Result<RawRange> {
        if bytes.start > bytes.end || bytes.end > self.len() {
            return Err(RegionError::RangeOutOfBounds { start: bytes.start, end: bytes.end, limit: self.len() });
        }
        // SAFETY: bytes.start <= len, so the pointer stays within (or one
        // past the end of) the data area of the live mapping.
        let ptr = unsafe { self.data_ptr().add(bytes.start) };
        Ok(RawRange { ptr, len: bytes.end - bytes.start })
    }

    /// The raw range of rows `rows` (a registration unit).
    pub fn rows_raw(&self, rows: Range<usize>) -> Result<RawRange> {
        self.raw_subrange(self.layout.rows_range(rows)?)
    }

    /// What this rank registers, cut into units of at most `max_bytes`, in
    /// the order to register them:
    ///
    /// With data files a unit is also at most a quarter of a file
    /// ([`UNITS_PER_FILE`]): the first registration waits for the first unit
    /// of a file to be faulted by one worker, so smaller units start the
    /// registrations sooner (H200, 16 GiB, one rank: 22.4 GB/s with 64 MiB
    /// units against 18.0 with 256 MiB, docs/gpu-runs/2026-11-30-shm-pin.md).
    ///
    /// - a multi-file shared region, rank-major layout: this rank's share
    ///   alone (the slots its GPU reads and writes), its own data files cut
    ///   into whole chunks, the files' first units first (unit 0 of every
    ///   file, then unit 1, ...), so pre-fault workers that each take a
    ///   file of their own finish units in the order they are registered;
    /// - a multi-file shared region, row-interleaved layout: the whole data
    ///   area (every rank's slots interleave), cut into whole rows per file
    ///   and ordered the same way, starting at file `rank * files / ranks`,
    ///   so that the ranks fault different files first;
    /// - a one-file shared region: this rank's share in a rank-major layout,
    ///   the whole area in runs of whole rows otherwise (as
    ///   [`Layout::row_aligned_chunks`]);
    /// - an anonymous region: the whole area (one process drives every
    ///   rank's slots), in runs of whole rows, or of whole chunks when rank-major.
    ///
    /// Fails with [`RegionError::ChunkBoundBelowRow`] when `max_bytes` is
    /// below one unit (a row, or a chunk in a rank-major layout).
    pub fn pin_ranges(&self, max_bytes: usize) -> Result<Vec<PinRange>> {
        let l = &self.layout;
        let unit = match l.order() {
            Order::RowInterleaved => l.row_bytes(),
            Order::RankMajor => l.chunk_bytes(),
        };
        if max_bytes < unit {
            return Err(RegionError::ChunkBoundBelowRow { max_bytes, row_bytes: unit });
        }
        let files = self.data_files();
        let mut per = max_bytes / unit * unit;
        if let Some(longest) = files.iter().map(|f| f.0.len()).max() {
            // A quarter of a file at most (whole units, at least one).
            per = per.min((longest / UNITS_PER_FILE / unit).max(1) * unit);
        }
        let cut = |r: Range<usize>| -> Vec<Range<usize>> {
            (r.start..r.end).step_by(per).map(|s| s..(s + per).min(r.end)).collect()
        };
        let mut out: Vec<(Range<usize>, Option<usize>)> = Vec::new();
        if files.is_empty() {
            let whole = match (self.kind(), l.order()) {
                (RegionKind::Shared, Order::RankMajor) => l.rank_share(self.rank)?,
                _ => 0..l.data_bytes(),
            };
            out.extend(cut(whole).into_iter().map(|r| (r, None)));
        } else {
            let mut mine: Vec<usize> = match l.order() {
                Order::RankMajor => (0..files.len()).filter(|&k| files[k].1 == self.rank).collect(),
                Order::RowInterleaved => (0..files.len()).collect(),
            };
            if l.order() == Order::RowInterleaved {
                mine.rotate_left(self.rank * files.len() / l.num_ranks());
            }
            let pieces: Vec<Vec<Range<usize>>> = mine.iter().map(|&k| cut(files[k].0.clone())).collect();
            let rounds = pieces.iter().map(Vec::len).max().unwrap_or(0);
            for j in 0..rounds {
                for (i, p) in pieces.iter().enumerate() {
                    if let Some(r) = p.get(j) {
                        out.push((r.clone(), Some(mine[i])));
                    }
                }
            }
        }
        out.into_iter().map(|(r, file)| Ok(PinRange { range: self.raw_subrange(r)?, file })).collect()
    }

    /// Pointer to rank `rank`'s chunk `chunk`.
    pub fn chunk_ptr(&self, rank: usize, chunk: usize) -> Result<NonNull<u8>> {
        let off = self.layout.rank_chunk_offset(rank, chunk)?;
        // SAFETY: the offset is inside the data area (checked by the layout).
        Ok(unsafe { self.data_ptr().add(off) })
    }

    /// This rank's view of the layout.
    pub fn own_view(&self) -> RankView {
        self.layout.rank_view(self.rank).expect("the rank was checked when the region was made")
    }

    /// This rank's chunk `chunk`, read-only.
    ///
    /// Sound as long as no other rank writes this rank's slots (the layout's
    /// ownership rule) and this process writes them only through
    /// [`Region::own_chunk_mut`] or raw pointers not used while the slice
    /// lives.
    pub fn own_chunk(&self, chunk: usize) -> Result<&[u8]> {
        let r = self.layout.rank_chunk_range(self.rank, chunk)?;
        // SAFETY: the range is inside the live mapping (layout-checked) and
        // initialised (mmap memory is zero-filled); by the ownership rule no
        // other process writes it, and `&self` ties the slice to the mapping.
        Ok(unsafe { std::slice::from_raw_parts(self.data_ptr().as_ptr().add(r.start), r.len()) })
    }

    /// This rank's chunk `chunk`, writable.
    pub fn own_chunk_mut(&mut self, chunk: usize) -> Result<&mut [u8]> {
        let r = self.layout.rank_chunk_range(self.rank, chunk)?;
        // SAFETY: as for `own_chunk`; `&mut self` excludes every other safe
        // borrow of the region in this process.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.data_ptr().as_ptr().add(r.start), r.len()) })
    }

    /// Copies `dst.len()` bytes at `offset` of rank `rank`'s chunk `chunk`
    /// into `dst` (any rank, e.g. to read what a peer wrote). Bytes that a
    /// peer writes during the copy may be seen old or new.
    pub fn read_chunk(&self, rank: usize, chunk: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        let r = self.layout.rank_chunk_range(rank, chunk)?;
        let end = offset.checked_add(dst.len()).filter(|e| *e <= r.len());
        if end.is_none() {
            return Err(RegionError::RangeOutOfBounds {
                start: offset,
                end: offset.saturating_add(dst.len()),
                limit: r.len(),
            });
        }
        // SAFETY: the source range lies inside the live mapping (checked
        // above); `dst` is a distinct exclusive borrow, so they do not
        // overlap. Concurrent writes by another process can only make bytes
        // old or new (u8 has no invalid values).
        unsafe {
            std::ptr::copy_nonoverlapping(self.data_ptr().as_ptr().add(r.start + offset), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// The whole data area of an anonymous region (None for shared regions,
    /// which other processes write).
    pub fn as_slice(&self) -> Option<&[u8]> {
        match self.kind {
            // SAFETY: the data area is inside the live mapping, zero-filled
            // at creation, private to this process; see `as_mut_ptr` for the
            // caller's contract on raw writes.
            Kind::Anonymous => Some(unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }),
            Kind::Shared(_) => None,
        }
    }

    /// The whole data area of an anonymous region, writable (None for
    /// shared regions).
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        match self.kind {
            // SAFETY: as for `as_slice`; `&mut self` excludes other borrows.
            Kind::Anonymous => Some(unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len()) }),
            Kind::Shared(_) => None,
        }
    }

    /// The per-rank words of the shared header, one per rank, all zero at
    /// creation. **Reserved for the P7 cross-rank agreement** (each rank
    /// publishes its pin state in its word); no other layer may use them.
    /// These are `core::sync::atomic` words on shared memory (cross-process,
    /// outside loom). None for anonymous regions, and for persistent ones
    /// ([`Region::open_persistent`]): engines of many launches map those,
    /// each with its own rank 0, and words written by an earlier engine
    /// would read as this one's agreement.
    #[allow(clippy::disallowed_types)] // cross-process words, see above
    pub fn rank_slots(&self) -> Option<&[core::sync::atomic::AtomicU32]> {
        match &self.kind {
            Kind::Shared(s) if s.persistent.is_none() => Some(&self.hdr().rank_slots()[..self.layout.num_ranks()]),
            _ => None,
        }
    }

    /// Process ids the ranks recorded when they mapped the region (0 = not
    /// yet). None for anonymous regions, and for persistent ones (no rank
    /// claims a pid word there).
    pub fn rank_pids(&self) -> Option<Vec<u32>> {
        match &self.kind {
            Kind::Shared(s) if s.persistent.is_some() => None,
            Kind::Shared(_) => Some(
                self.hdr().rank_pids()[..self.layout.num_ranks()]
                    .iter()
                    .map(|p| p.load(core::sync::atomic::Ordering::Acquire))
                    .collect(),
            ),
            Kind::Anonymous => None,
        }
    }

    /// Whether `madvise(MADV_HUGEPAGE)` was requested and accepted.
    pub fn huge_pages_advised(&self) -> bool {
        self.huge_pages_advised
    }

    /// Requests transparent huge pages for the data area
    /// (`madvise(MADV_HUGEPAGE)`). For anonymous memory this takes effect
    /// when THP is `madvise` or `always`; for a /dev/shm file it depends on
    /// the tmpfs mount's `huge=` option (and a 2 MiB-aligned data area, see
    /// [`ShmOptions::huge_pages`]).
    pub fn advise_huge_pages(&self) -> Result<()> {
        self.advise_data_huge().map_err(|e| self.io_err("madvise(MADV_HUGEPAGE)", e))
    }

    fn data_ptr(&self) -> NonNull<u8> {
        NonNull::new(self.as_mut_ptr()).expect("mmap never returns null")
    }

    fn io_err(&self, op: &'static str, e: io::Error) -> RegionError {
        RegionError::io(op, self.path().map(Path::to_path_buf).unwrap_or_else(|| "<anonymous>".into()), e)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if matches!(self.kind, Kind::Shared(_)) {
            self.drop_shared();
        }
    }
}
