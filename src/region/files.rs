//! The data files of a multi-file shared region
//! ([`FileSplit::Multi`](super::FileSplit::Multi)): which bytes of the data
//! area each holds and which rank owns it, their names, the header size
//! that holds their table, and reserving their pages with `fallocate`.

use std::fs::File;
use std::io;
use std::ops::Range;

use super::error::RegionError;
use super::header::{FILE_TABLE_OFFSET, MIN_HEADER_BYTES};
use super::layout::{Layout, Order};
use super::options::{FileSplit, MAX_FILES};
use super::sys;
use crate::sync::thread;

type Result<T> = std::result::Result<T, RegionError>;

/// One data file: the bytes of the data area it holds and its owner, the
/// rank that reserves it and whose pinning pre-faults it first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileSpec {
    pub bytes: Range<usize>,
    pub owner: usize,
}

/// The data files of a region, in data-area order (file k maps right
/// after file k-1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FilePlan {
    pub files: Vec<FileSpec>,
    /// Bytes of a full file (the last file of a rank or of the area may be shorter).
    pub file_bytes: usize,
}

/// The data files `split` gives `layout`; `None` for one file.
///
/// Rank-major: each rank's share is cut into files of whole chunks, owned
/// by that rank. Row-interleaved: the data area is cut into files of whole
/// rows, owned round-robin (file k by rank k mod N).
pub(crate) fn plan(layout: &Layout, split: FileSplit) -> Result<Option<FilePlan>> {
    let FileSplit::Multi { max_file_bytes } = split else {
        return Ok(None);
    };
    if max_file_bytes == 0 {
        return Err(RegionError::ZeroSize { what: "max_file_bytes" });
    }
    let n = layout.num_ranks();
    // (bytes to cut into files, the owner of every file of them: None = round-robin)
    type Spans = Vec<(Range<usize>, Option<usize>)>;
    let (unit, spans): (usize, Spans) = match layout.order() {
        Order::RankMajor => (
            layout.chunk_bytes(),
            (0..n).map(|r| (layout.rank_share(r).expect("rank-major shares are contiguous"), Some(r))).collect(),
        ),
        Order::RowInterleaved => (layout.row_bytes(), vec![(0..layout.data_bytes(), None)]),
    };
    let file_bytes = (max_file_bytes / unit).max(1) * unit;
    let count: usize = spans.iter().map(|(s, _)| s.len().div_ceil(file_bytes)).sum();
    if count > MAX_FILES {
        return Err(RegionError::TooManyFiles { files: count, file_bytes, limit: MAX_FILES });
    }
    let mut files = Vec::with_capacity(count);
    for (span, owner) in spans {
        let mut s = span.start;
        while s < span.end {
            let e = (s + file_bytes).min(span.end);
            let owner = owner.unwrap_or(files.len() % n);
            files.push(FileSpec { bytes: s..e, owner });
            s = e;
        }
    }
    Ok(Some(FilePlan { files, file_bytes }))
}

/// Header bytes of a multi-file region of `num_files` files: the fixed
/// header and the file table, in whole pages.
pub(crate) fn header_bytes(num_files: usize) -> usize {
    let page = MIN_HEADER_BYTES.max(sys::page_size());
    (FILE_TABLE_OFFSET + 8 * num_files).next_multiple_of(page)
}

/// Name of data file `k` of the region whose header file is named
/// `header`: `<header>.<k>`.
pub(crate) fn data_name(header: &std::ffi::OsStr, k: usize) -> std::ffi::OsString {
    let mut s = header.to_owned();
    s.push(format!(".{k}"));
    s
}

/// Why reserving failed: the file (index into the list given) and the error.
pub(crate) struct ReserveFailure {
    pub index: usize,
    pub error: io::Error,
    /// Bytes of the list not reserved when the workers stopped.
    pub unreserved: u64,
}

/// One worker's outcome: bytes reserved, first failure (index, error).
type Outcome = (u64, Option<(usize, io::Error)>);

/// Reserves a list of `(index, file, len)` in order; stops at the first error.
fn reserve_list(list: Vec<(usize, File, u64)>) -> Outcome {
    let mut done = 0;
    for (i, f, len) in list {
        match rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, len) {
            Ok(()) => done += len,
            Err(e) if e == rustix::io::Errno::OPNOTSUPP => {
                tracing::warn!("fallocate is not supported here; region pages are allocated on first touch");
                done += len;
            }
            Err(e) => return (done, Some((i, e.into()))),
        }
    }
    (done, None)
}

/// `fallocate(fd, 0, 0, len)` of every `(file, len)`, on up to `threads`
/// threads (files dealt round-robin; the calling thread takes one share).
/// A file system that does not support it (EOPNOTSUPP) is logged and
/// skipped: the pages are then allocated on first touch, as with
/// `ftruncate` alone. Each thread stops at its first other error. A thread
/// that cannot be started fails the reservation (index `usize::MAX`).
pub(crate) fn reserve(files: Vec<(File, u64)>, threads: usize) -> std::result::Result<(), ReserveFailure> {
    let total: u64 = files.iter().map(|(_, l)| l).sum();
    let threads = threads.clamp(1, files.len().max(1));
    let mut lists: Vec<Vec<(usize, File, u64)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, (f, len)) in files.into_iter().enumerate() {
        lists[i % threads].push((i, f, len));
    }
    let mut lists = lists.into_iter();
    let first = lists.next().unwrap_or_default();
    let mut handles = Vec::new();
    let mut outcomes: Vec<Outcome> = Vec::new();
    for (k, list) in lists.enumerate() {
        let b = thread::Builder::new().name(format!("kvo-reserve-{}", k + 1)).stack_size(64 << 10);
        match b.spawn(move || reserve_list(list)) {
            Ok(h) => handles.push(h),
            Err(e) => outcomes.push((0, Some((usize::MAX, e)))),
        }
    }
    outcomes.push(reserve_list(first));
    for h in handles {
        outcomes
            .push(h.join().unwrap_or_else(|_| (0, Some((usize::MAX, io::Error::other("a reserve thread panicked"))))));
    }
    let done: u64 = outcomes.iter().map(|o| o.0).sum();
    match outcomes.into_iter().find_map(|o| o.1) {
        None => Ok(()),
        Some((index, error)) => Err(ReserveFailure { index, error, unreserved: total.saturating_sub(done) }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_major_files_hold_whole_chunks_of_one_rank() {
        let p = sys::page_size();
        let l = Layout::rank_major(2, 2 * p, 5).unwrap(); // shares of 10 pages
        let pl = plan(&l, FileSplit::Multi { max_file_bytes: 5 * p }).unwrap().unwrap();
        assert_eq!(pl.file_bytes, 4 * p); // rounded down to whole chunks
        let got: Vec<(Range<usize>, usize)> = pl.files.iter().map(|f| (f.bytes.clone(), f.owner)).collect();
        let want = vec![
            (0..4 * p, 0),
            (4 * p..8 * p, 0),
            (8 * p..10 * p, 0),
            (10 * p..14 * p, 1),
            (14 * p..18 * p, 1),
            (18 * p..20 * p, 1),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn row_interleaved_files_hold_whole_rows_owned_round_robin() {
        let p = sys::page_size();
        let l = Layout::new(2, p, 5).unwrap(); // rows of 2 pages
        let pl = plan(&l, FileSplit::Multi { max_file_bytes: p }).unwrap().unwrap();
        assert_eq!(pl.file_bytes, 2 * p); // at least one row
        assert_eq!(pl.files.len(), 5);
        assert_eq!(pl.files.iter().map(|f| f.owner).collect::<Vec<_>>(), vec![0, 1, 0, 1, 0]);
        assert!(plan(&l, FileSplit::Single).unwrap().is_none());
    }

    #[test]
    fn too_many_files_and_zero_size_are_typed() {
        let p = sys::page_size();
        let l = Layout::rank_major(1, p, MAX_FILES + 1).unwrap();
        match plan(&l, FileSplit::Multi { max_file_bytes: p }) {
            Err(RegionError::TooManyFiles { files, file_bytes, limit }) => {
                assert_eq!((files, file_bytes, limit), (MAX_FILES + 1, p, MAX_FILES))
            }
            other => panic!("expected TooManyFiles, got {other:?}"),
        }
        assert!(plan(&l, FileSplit::Multi { max_file_bytes: 2 * p }).is_ok());
        assert!(matches!(
            plan(&l, FileSplit::Multi { max_file_bytes: 0 }),
            Err(RegionError::ZeroSize { what: "max_file_bytes" })
        ));
    }

    #[test]
    fn header_holds_the_table_in_whole_pages() {
        let page = MIN_HEADER_BYTES.max(sys::page_size());
        assert_eq!(header_bytes(1), page);
        assert_eq!(header_bytes((page - FILE_TABLE_OFFSET) / 8), page);
        assert_eq!(header_bytes((page - FILE_TABLE_OFFSET) / 8 + 1), 2 * page);
        assert_eq!(data_name(std::ffi::OsStr::new("kvoffload-x"), 7), std::ffi::OsString::from("kvoffload-x.7"));
    }
}
