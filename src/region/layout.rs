//! Per-rank layout of the region's data area and its offset arithmetic.
//!
//! Every rank owns `chunks_per_rank` chunks ("slots") of `chunk_bytes`.
//! Two orders place them ([`Order`]):
//!
//! - **row-interleaved** ([`Layout::new`], upstream's layout): the data area
//!   is a sequence of *rows*; each row holds one slot per rank, so a row is
//!   `num_ranks * chunk_bytes` bytes and rank `r`'s chunk `i` lives in row
//!   `i`, slot `r`. A row is the natural registration unit ("row-aligned
//!   chunks") when every rank registers the whole region.
//!
//! ```text
//!            slot 0      slot 1           slot R-1
//! row 0   | r0 c0     | r1 c0     | ... | rR-1 c0     |
//! row 1   | r0 c1     | r1 c1     | ... | rR-1 c1     |
//! ...
//! ```
//!
//! - **rank-major** ([`Layout::rank_major`]): rank `r`'s chunks are
//!   contiguous, its share [`Layout::rank_share`] is
//!   `r * bytes_per_rank .. (r + 1) * bytes_per_rank`, and chunk `i` of
//!   rank `r` starts at `r * bytes_per_rank + i * chunk_bytes`. A rank then
//!   pre-faults and registers only its own share (the bytes its GPU reads
//!   and writes), which is what makes pinning a shared region scale with
//!   the ranks. A "row" (chunk `i` of every rank) is not contiguous here, so
//!   the row-range methods refuse rank-major layouts with more than one rank
//!   ([`RegionError::NotContiguous`]).
//!
//! Code that walks one rank's chunks by address uses
//! [`Layout::chunk_stride`] (the distance between a rank's consecutive
//! chunks: `row_bytes` row-interleaved, `chunk_bytes` rank-major).
//!
//! All offsets here are relative to the start of the data area (the
//! region's [`as_ptr`](super::Region::as_ptr)), never to the file.

use std::ops::Range;

use super::error::RegionError;
use super::sys::page_size;
use super::MAX_RANKS;

type Result<T> = std::result::Result<T, RegionError>;

/// How the ranks' chunks are placed in the data area (see the module
/// documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Order {
    /// Rank `r`'s chunk `i` in row `i`, slot `r` (upstream's layout).
    #[default]
    RowInterleaved,
    /// Rank `r`'s chunks contiguous: its share first, then rank `r + 1`'s.
    RankMajor,
}

impl Order {
    /// The code recorded in a shared region's header.
    pub(crate) fn code(self) -> u64 {
        match self {
            Order::RowInterleaved => 0,
            Order::RankMajor => 1,
        }
    }
}

/// The shape of the data area: how many ranks, rows and bytes per chunk,
/// and their [`Order`].
///
/// Every constructor validates the sizes: nothing zero, `chunk_bytes` a
/// multiple of the page size (so every chunk, every rank's slot and every
/// row starts on a page), no overflow, at most [`MAX_RANKS`] ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    num_ranks: usize,
    chunk_bytes: usize,
    num_rows: usize,
    row_bytes: usize,
    data_bytes: usize,
    order: Order,
}

/// Where a byte offset of the data area falls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// The row, which is also the chunk index within the rank.
    pub row: usize,
    /// The rank whose slot holds the byte.
    pub rank: usize,
    /// Offset of the byte inside that rank's chunk.
    pub offset_in_chunk: usize,
}

/// A run of whole rows: one registration unit of [`Layout::row_aligned_chunks`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowSpan {
    /// The rows covered.
    pub rows: Range<usize>,
    /// The bytes covered, relative to the data area.
    pub bytes: Range<usize>,
}

impl Layout {
    /// A layout of `num_rows` rows, each with `num_ranks` slots of
    /// `chunk_bytes`; `chunk_bytes` must be a multiple of the page size.
    pub fn new(num_ranks: usize, chunk_bytes: usize, num_rows: usize) -> Result<Self> {
        Self::with_alignment(num_ranks, chunk_bytes, num_rows, page_size())
    }

    /// Like [`Layout::new`] with `bytes_per_rank` given instead of a row
    /// count; it must be a multiple of `chunk_bytes`.
    pub fn from_bytes_per_rank(num_ranks: usize, bytes_per_rank: usize, chunk_bytes: usize) -> Result<Self> {
        if bytes_per_rank == 0 {
            return Err(RegionError::ZeroSize { what: "bytes_per_rank" });
        }
        if chunk_bytes == 0 {
            return Err(RegionError::ZeroSize { what: "chunk_bytes" });
        }
        if bytes_per_rank % chunk_bytes != 0 {
            return Err(RegionError::Misaligned {
                what: "bytes_per_rank",
                value: bytes_per_rank as u64,
                align: chunk_bytes as u64,
            });
        }
        Self::new(num_ranks, chunk_bytes, bytes_per_rank / chunk_bytes)
    }

    /// A rank-major layout ([`Order::RankMajor`]): `num_ranks` shares of
    /// `chunks_per_rank` chunks of `chunk_bytes` (a multiple of the page
    /// size), rank `r`'s share contiguous. Same sizes and checks as
    /// [`Layout::new`]; only the placement differs.
    pub fn rank_major(num_ranks: usize, chunk_bytes: usize, chunks_per_rank: usize) -> Result<Self> {
        Ok(Self::new(num_ranks, chunk_bytes, chunks_per_rank)?.with_order(Order::RankMajor))
    }

    /// The same sizes placed in `order`.
    pub fn with_order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    /// Like [`Layout::new`] with an explicit chunk alignment instead of the
    /// page size (a power of two). Regions are always built from page-aligned
    /// layouts; this exists for arithmetic that is not tied to the machine.
    pub fn with_alignment(num_ranks: usize, chunk_bytes: usize, num_rows: usize, align: usize) -> Result<Self> {
        if num_ranks == 0 {
            return Err(RegionError::ZeroSize { what: "num_ranks" });
        }
        if num_ranks > MAX_RANKS {
            return Err(RegionError::TooManyRanks { num_ranks, max: MAX_RANKS });
        }
        if chunk_bytes == 0 {
            return Err(RegionError::ZeroSize { what: "chunk_bytes" });
        }
        if num_rows == 0 {
            return Err(RegionError::ZeroSize { what: "num_rows" });
        }
        if align == 0 || !align.is_power_of_two() {
            return Err(RegionError::Misaligned { what: "alignment", value: align as u64, align: 2 });
        }
        if chunk_bytes % align != 0 {
            return Err(RegionError::Misaligned {
                what: "chunk_bytes",
                value: chunk_bytes as u64,
                align: align as u64,
            });
        }
        let row_bytes = num_ranks.checked_mul(chunk_bytes).ok_or_else(|| RegionError::SizeOverflow {
            what: "row_bytes",
            detail: format!("{num_ranks} ranks * {chunk_bytes} bytes"),
        })?;
        let data_bytes = row_bytes.checked_mul(num_rows).ok_or_else(|| RegionError::SizeOverflow {
            what: "data_bytes",
            detail: format!("{num_rows} rows * {row_bytes} bytes"),
        })?;
        // Offsets are handed to mmap, pointer arithmetic and u64 headers:
        // keep them within isize so `ptr.add` is always defined.
        if data_bytes > isize::MAX as usize {
            return Err(RegionError::SizeOverflow {
                what: "data_bytes",
                detail: format!("{data_bytes} bytes exceeds isize::MAX"),
            });
        }
        Ok(Layout { num_ranks, chunk_bytes, num_rows, row_bytes, data_bytes, order: Order::RowInterleaved })
    }

    /// How the chunks are placed.
    pub fn order(&self) -> Order {
        self.order
    }

    /// Distance in bytes between a rank's chunk `i` and chunk `i + 1`:
    /// `row_bytes` row-interleaved, `chunk_bytes` rank-major.
    pub fn chunk_stride(&self) -> usize {
        match self.order {
            Order::RowInterleaved => self.row_bytes,
            Order::RankMajor => self.chunk_bytes,
        }
    }

    /// Rank `rank`'s share as one contiguous byte range, when it is one:
    /// always in a rank-major layout, and in a row-interleaved layout of one
    /// rank (the whole area). Fails with [`RegionError::NotContiguous`]
    /// otherwise.
    pub fn rank_share(&self, rank: usize) -> Result<Range<usize>> {
        self.check_rank(rank)?;
        match self.order {
            Order::RankMajor => {
                let b = self.bytes_per_rank();
                Ok(rank * b..(rank + 1) * b)
            }
            Order::RowInterleaved if self.num_ranks == 1 => Ok(0..self.data_bytes),
            Order::RowInterleaved => Err(RegionError::NotContiguous {
                what: "a rank's share",
                order: "row-interleaved",
                num_ranks: self.num_ranks,
            }),
        }
    }

    /// Whether rows are contiguous (row-interleaved, or a single rank).
    fn rows_contiguous(&self) -> Result<()> {
        if self.order == Order::RankMajor && self.num_ranks > 1 {
            return Err(RegionError::NotContiguous { what: "a row", order: "rank-major", num_ranks: self.num_ranks });
        }
        Ok(())
    }

    /// Number of ranks (slots per row).
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }

    /// Bytes of one rank's chunk (one slot).
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Number of rows, which is also the number of chunks per rank.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }

    /// Number of chunks each rank owns (= [`Layout::num_rows`]).
    pub fn chunks_per_rank(&self) -> usize {
        self.num_rows
    }

    /// Bytes of one row: `num_ranks * chunk_bytes`.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Bytes each rank owns: `num_rows * chunk_bytes`.
    pub fn bytes_per_rank(&self) -> usize {
        // Cannot overflow: it is at most data_bytes.
        self.num_rows * self.chunk_bytes
    }

    /// Bytes of the whole data area: `num_rows * row_bytes`.
    pub fn data_bytes(&self) -> usize {
        self.data_bytes
    }

    /// Checks that `rank` is one of this layout's ranks.
    pub fn check_rank(&self, rank: usize) -> Result<()> {
        if rank < self.num_ranks {
            Ok(())
        } else {
            Err(RegionError::RankOutOfRange { rank, num_ranks: self.num_ranks })
        }
    }

    /// Checks that `row` (or chunk index) is one of this layout's rows.
    pub fn check_row(&self, row: usize) -> Result<()> {
        if row < self.num_rows {
            Ok(())
        } else {
            Err(RegionError::RowOutOfRange { index: row, num_rows: self.num_rows })
        }
    }

    /// Offset of rank `rank`'s chunk `chunk`: `chunk * row_bytes + rank *
    /// chunk_bytes` row-interleaved, `rank * bytes_per_rank + chunk *
    /// chunk_bytes` rank-major.
    pub fn rank_chunk_offset(&self, rank: usize, chunk: usize) -> Result<usize> {
        self.check_rank(rank)?;
        self.check_row(chunk)?;
        // Both indices are in range, so the result is below data_bytes.
        Ok(self.offset_unchecked(rank, chunk))
    }

    fn offset_unchecked(&self, rank: usize, chunk: usize) -> usize {
        match self.order {
            Order::RowInterleaved => chunk * self.row_bytes + rank * self.chunk_bytes,
            Order::RankMajor => rank * self.bytes_per_rank() + chunk * self.chunk_bytes,
        }
    }

    /// Byte range of rank `rank`'s chunk `chunk`.
    pub fn rank_chunk_range(&self, rank: usize, chunk: usize) -> Result<Range<usize>> {
        let start = self.rank_chunk_offset(rank, chunk)?;
        Ok(start..start + self.chunk_bytes)
    }

    /// Byte range of row `row` (all ranks' chunk `row`). Rank-major layouts
    /// of several ranks have no contiguous rows ([`RegionError::NotContiguous`]).
    pub fn row_range(&self, row: usize) -> Result<Range<usize>> {
        self.check_row(row)?;
        self.rows_contiguous()?;
        let start = row * self.row_bytes;
        Ok(start..start + self.row_bytes)
    }

    /// Byte range of the rows `rows` (may be empty; must lie within the
    /// layout). Rank-major layouts of several ranks have no contiguous rows
    /// ([`RegionError::NotContiguous`]).
    pub fn rows_range(&self, rows: Range<usize>) -> Result<Range<usize>> {
        if rows.start > rows.end || rows.end > self.num_rows {
            return Err(RegionError::RangeOutOfBounds { start: rows.start, end: rows.end, limit: self.num_rows });
        }
        self.rows_contiguous()?;
        Ok(rows.start * self.row_bytes..rows.end * self.row_bytes)
    }

    /// Which row, rank and in-chunk offset a data-area byte offset falls in.
    pub fn locate(&self, offset: usize) -> Result<Location> {
        if offset >= self.data_bytes {
            return Err(RegionError::RangeOutOfBounds {
                start: offset,
                end: offset.saturating_add(1),
                limit: self.data_bytes,
            });
        }
        match self.order {
            Order::RowInterleaved => {
                let row = offset / self.row_bytes;
                let in_row = offset % self.row_bytes;
                Ok(Location { row, rank: in_row / self.chunk_bytes, offset_in_chunk: in_row % self.chunk_bytes })
            }
            Order::RankMajor => {
                let per_rank = self.bytes_per_rank();
                let in_share = offset % per_rank;
                Ok(Location {
                    row: in_share / self.chunk_bytes,
                    rank: offset / per_rank,
                    offset_in_chunk: in_share % self.chunk_bytes,
                })
            }
        }
    }

    /// The view of one rank's chunks.
    pub fn rank_view(&self, rank: usize) -> Result<RankView> {
        self.check_rank(rank)?;
        Ok(RankView { layout: *self, rank })
    }

    /// Splits the data area into runs of whole rows of at most `max_bytes`
    /// each (the last run may be shorter): the units a pinning engine
    /// registers one at a time. Fails if `max_bytes` is below one row, or
    /// for a rank-major layout of several ranks (no contiguous rows; use
    /// [`Region::pin_ranges`](super::Region::pin_ranges)).
    pub fn row_aligned_chunks(&self, max_bytes: usize) -> Result<RowChunks> {
        self.rows_contiguous()?;
        if max_bytes < self.row_bytes {
            return Err(RegionError::ChunkBoundBelowRow { max_bytes, row_bytes: self.row_bytes });
        }
        Ok(RowChunks {
            row_bytes: self.row_bytes,
            rows_per_span: max_bytes / self.row_bytes,
            num_rows: self.num_rows,
            next_row: 0,
        })
    }
}

/// One rank's chunks of a [`Layout`]: chunk `i` is row `i`, slot `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankView {
    layout: Layout,
    rank: usize,
}

impl RankView {
    /// The rank viewed.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The layout the view belongs to.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Number of chunks of this rank.
    pub fn num_chunks(&self) -> usize {
        self.layout.num_rows
    }

    /// Offset of this rank's chunk `chunk` in the data area.
    pub fn chunk_offset(&self, chunk: usize) -> Result<usize> {
        self.layout.rank_chunk_offset(self.rank, chunk)
    }

    /// Byte range of this rank's chunk `chunk` in the data area.
    pub fn chunk_range(&self, chunk: usize) -> Result<Range<usize>> {
        self.layout.rank_chunk_range(self.rank, chunk)
    }

    /// Byte ranges of all of this rank's chunks, in chunk order.
    pub fn chunks(&self) -> impl ExactSizeIterator<Item = Range<usize>> + '_ {
        let (l, cb, r) = (self.layout, self.layout.chunk_bytes, self.rank);
        (0..self.layout.num_rows).map(move |i| {
            let s = l.offset_unchecked(r, i);
            s..s + cb
        })
    }
}

/// Iterator of [`RowSpan`]s from [`Layout::row_aligned_chunks`].
#[derive(Debug, Clone)]
pub struct RowChunks {
    row_bytes: usize,
    rows_per_span: usize,
    num_rows: usize,
    next_row: usize,
}

impl Iterator for RowChunks {
    type Item = RowSpan;

    fn next(&mut self) -> Option<RowSpan> {
        if self.next_row >= self.num_rows {
            return None;
        }
        let start = self.next_row;
        let end = start + self.rows_per_span.min(self.num_rows - start);
        self.next_row = end;
        Some(RowSpan { rows: start..end, bytes: start * self.row_bytes..end * self.row_bytes })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.num_rows - self.next_row).div_ceil(self.rows_per_span);
        (left, Some(left))
    }
}

impl ExactSizeIterator for RowChunks {}
