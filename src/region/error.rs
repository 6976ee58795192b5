//! Typed errors of the region layer.
//!
//! Every error names the offending value and the limit it broke, so that a
//! log line alone says what to change.

use std::path::PathBuf;
use std::time::Duration;

pub use super::limits::LimitSource;

/// What a joining or creating rank was waiting for when its timeout expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinPhase {
    /// The region file did not appear in the directory.
    FileToAppear,
    /// The file appeared but the creator never gave it its full size.
    FileToBeSized,
    /// The file had its size but the creator never marked it initialised.
    CreatorToInitialise,
    /// This rank had mapped the region but some other ranks never did.
    RanksToMap,
}

impl std::fmt::Display for JoinPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            JoinPhase::FileToAppear => "the region file to appear",
            JoinPhase::FileToBeSized => "the creator to size the region file",
            JoinPhase::CreatorToInitialise => "the creator to initialise the header",
            JoinPhase::RanksToMap => "every rank to map the region",
        })
    }
}

/// What made a region file untrusted ([`RegionError::UntrustedFile`]).
/// Every check is made on the open descriptor (or, for a name that cannot
/// be opened safely, on the name itself without following it), never on a
/// path that could be swapped between the check and the use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileProblem {
    /// The name is a symbolic link (never followed).
    Symlink,
    /// Not a regular file.
    NotRegular {
        /// What it is instead: `directory`, `FIFO`, `socket`, ...
        kind: &'static str,
    },
    /// Owned by another user (and, with an allowed group, not of that group).
    ForeignOwner {
        /// The file's owner.
        uid: u32,
        /// This process's effective uid.
        euid: u32,
        /// The file's group.
        gid: u32,
        /// The allowed group, if any.
        allowed_group: Option<u32>,
    },
    /// Permission bits for others, or for the group when no group is allowed.
    Mode {
        /// The file's permission bits.
        mode: u32,
        /// The allowed group, if any (then group bits of that group are fine).
        allowed_group: Option<u32>,
    },
    /// Set-user-id, set-group-id or sticky bits (`0o7000`), which a
    /// creator never sets ([`RegionError::BadFileMode`] refuses them).
    SpecialBits {
        /// The file's permission bits.
        mode: u32,
    },
    /// Group permission bits, but the file's group is not the allowed one.
    WrongGroup {
        /// The file's permission bits.
        mode: u32,
        /// The file's group.
        gid: u32,
        /// The group id `ShmOptions::allow_group` allows.
        allowed_group: u32,
    },
}

impl std::fmt::Display for FileProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileProblem::Symlink => {
                f.write_str("it is a symbolic link (region files are never followed through links)")
            }
            FileProblem::NotRegular { kind } => write!(f, "it is a {kind}, not a regular file"),
            FileProblem::ForeignOwner { uid, euid, gid, allowed_group } => {
                write!(f, "owned by uid {uid}, not us (uid {euid})")?;
                if let Some(g) = allowed_group {
                    write!(f, ", and its group {gid} is not the allowed group {g}")?;
                }
                Ok(())
            }
            FileProblem::Mode { mode, allowed_group: None } => {
                write!(f, "mode {mode:#o} has group/other permission bits (the region must be this user's alone)")
            }
            FileProblem::Mode { mode, allowed_group: Some(g) } => {
                write!(f, "mode {mode:#o} has permission bits for others (only group {g} may share the region)")
            }
            FileProblem::SpecialBits { mode } => {
                write!(f, "mode {mode:#o} has set-user-id, set-group-id or sticky bits, which a creator never sets")
            }
            FileProblem::WrongGroup { mode, gid, allowed_group } => {
                write!(f, "mode {mode:#o} has group permission bits but its group is {gid}, not the allowed group {allowed_group}")
            }
        }
    }
}

/// Errors of the host region: bad sizes, capacity, the shared-file protocol
/// and the system calls behind it.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// A size that must be positive was zero.
    #[error("{what} is zero; it must be at least 1")]
    ZeroSize {
        /// Which size (e.g. `chunk_bytes`).
        what: &'static str,
    },

    /// A size or offset was not a multiple of the alignment it needs.
    #[error("{what} = {value} is not a multiple of {align} (the required alignment)")]
    Misaligned {
        /// Which size (e.g. `chunk_bytes`).
        what: &'static str,
        /// The value given.
        value: u64,
        /// The alignment it must be a multiple of.
        align: u64,
    },

    /// A size computation overflowed `usize`.
    #[error("{what} overflows: {detail}")]
    SizeOverflow {
        /// Which size.
        what: &'static str,
        /// The operands, for the log.
        detail: String,
    },

    /// More ranks than the shared header has room for.
    #[error("num_ranks = {num_ranks} exceeds the maximum of {max} ranks per region")]
    TooManyRanks {
        /// The number of ranks asked for.
        num_ranks: usize,
        /// The largest number supported ([`super::MAX_RANKS`]).
        max: usize,
    },

    /// A rank index at or beyond the number of ranks.
    #[error("rank {rank} is out of range: the region has {num_ranks} ranks (0..{num_ranks})")]
    RankOutOfRange {
        /// The rank index the caller gave.
        rank: usize,
        /// The number of ranks of the layout.
        num_ranks: usize,
    },

    /// A chunk (row) index at or beyond the number of chunks per rank.
    #[error("chunk/row {index} is out of range: the region has {num_rows} rows (0..{num_rows})")]
    RowOutOfRange {
        /// The chunk or row index given.
        index: usize,
        /// The number of rows (= chunks per rank).
        num_rows: usize,
    },

    /// A byte range that does not fit inside the region or chunk.
    #[error("byte range {start}..{end} is out of range: the limit is {limit} bytes")]
    RangeOutOfBounds {
        /// Start of the range asked for.
        start: usize,
        /// End (exclusive) of the range asked for.
        end: usize,
        /// The size it must fit in.
        limit: usize,
    },

    /// A registration chunk bound smaller than one row (rows cannot be split).
    #[error("maximum registration chunk of {max_bytes} bytes is smaller than one row of {row_bytes} bytes")]
    ChunkBoundBelowRow {
        /// The bound asked for.
        max_bytes: usize,
        /// The size of one row.
        row_bytes: usize,
    },

    /// A contiguous range asked of a layout whose order does not have one
    /// (a row of a rank-major layout, a rank's share of a row-interleaved one).
    #[error("{what} is not contiguous in a {order} layout of {num_ranks} ranks")]
    NotContiguous {
        /// What was asked for.
        what: &'static str,
        /// The layout's order.
        order: &'static str,
        /// Its number of ranks.
        num_ranks: usize,
    },

    /// A shared region split into more data files than allowed.
    #[error("the region would need {files} data files of at most {file_bytes} bytes; the limit is {limit} files (raise the file size)")]
    TooManyFiles {
        /// Data files the split needs.
        files: usize,
        /// Bytes per file asked for.
        file_bytes: usize,
        /// The most files a region may have ([`super::MAX_FILES`]).
        limit: usize,
    },

    /// Reserving a data file's pages (`fallocate`) ran out of space: the
    /// file system filled up after the capacity check (another process
    /// wrote to it meanwhile). From `create`/`join`: the region was
    /// abandoned and every file removed. With deferred reservation
    /// ([`ShmOptions::defer_reserve`](super::ShmOptions::defer_reserve)),
    /// from pinning or [`Region::reserve_rest`](super::Region::reserve_rest):
    /// the files were unlinked already, and the pages not reserved must not
    /// be touched (drop the region).
    #[error("{path}: no space to reserve {needed} bytes ({available} bytes free in its file system now); no file of the region is left, and its unreserved pages must not be touched")]
    ShmFull {
        /// The data file being reserved.
        path: PathBuf,
        /// Bytes this rank still had to reserve when it failed.
        needed: u64,
        /// Bytes free for an unprivileged user right after the failure.
        available: u64,
    },

    /// A data file that the header says exists could not be opened: another
    /// rank abandoned the region and removed it, or something else did.
    #[error("data file {path} of the region is missing (removed by another rank or process)")]
    FileMissing {
        /// The data file's path.
        path: PathBuf,
    },

    /// A region name that cannot be a single file name.
    #[error("bad region name {name:?}: {reason}")]
    BadName {
        /// The region name the caller gave.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },

    /// The shared-memory file system has less free space than the region needs.
    #[error("region of {needed} bytes does not fit in {dir}: only {available} bytes free")]
    ShmTooSmall {
        /// The directory checked (normally `/dev/shm`).
        dir: PathBuf,
        /// Bytes the region needs (header included).
        needed: u64,
        /// Bytes free for an unprivileged user (`f_bavail * f_frsize`).
        available: u64,
    },

    /// The region needs more memory than this process can get: the
    /// smaller of `MemAvailable` and its cgroup's limit minus usage
    /// ([`super::limits`]). Checked before any file is created or reserved
    /// and any page touched; `check_memory(false)` of the options skips it.
    #[error("region of {needed} bytes exceeds the {available} bytes this process can get ({limit}); nothing was created or touched (check_memory(false) skips this check)")]
    MemoryTooSmall {
        /// Bytes the region (or, for a joining rank, this rank's share) needs.
        needed: u64,
        /// Bytes this process can get.
        available: u64,
        /// Where that number came from.
        limit: LimitSource,
    },

    /// A file of the shared region that this rank will not join through: a
    /// symbolic link, not a regular file, owned by another user, or with
    /// permission bits that let others read or write it. Nothing was
    /// written to it and it was left as it was (contents, mode, times).
    #[error("{path}: refusing to use this region file: {problem}; nothing was written and the file was left as it is")]
    UntrustedFile {
        /// The file (as named in the region's directory).
        path: PathBuf,
        /// What was wrong with it.
        problem: FileProblem,
    },

    /// The permission bits asked for the region's files
    /// ([`ShmOptions::mode`](super::ShmOptions::mode)) are ones that joiners
    /// would refuse, or the allowed group is not a group.
    #[error("file mode {mode:#o} for the region files is refused: {reason}")]
    BadFileMode {
        /// The mode asked for.
        mode: u32,
        /// The allowed group, if any ([`ShmOptions::allow_group`](super::ShmOptions::allow_group)).
        allow_group: Option<u32>,
        /// Why.
        reason: &'static str,
    },

    /// The region file already exists: a stale file from a crashed run, or
    /// another run using the same name.
    #[error("{path} already exists (stale file from a crashed run, or a name in use); remove it or create with force")]
    AlreadyExists {
        /// The file's path.
        path: PathBuf,
    },

    /// [`Region::remove_persistent`](super::Region::remove_persistent): no
    /// file of that name is in the directory.
    #[error("no region {path}: nothing to remove")]
    NoSuchRegion {
        /// The header file's path.
        path: PathBuf,
    },

    /// A persistent region's lock stayed held for the whole timeout: a
    /// live process is creating it, or taking it apart. Nothing was
    /// changed.
    #[error("{path} is being created or removed by another live process (its lock stayed held for {timeout:?}); nothing was changed, try again")]
    PersistentBusy {
        /// The header file's path.
        path: PathBuf,
        /// How long this process waited for the lock.
        timeout: Duration,
    },

    /// A rank's timeout expired while it waited; the region was abandoned
    /// and its file unlinked (if there was one).
    #[error("timed out after {timeout:?} waiting for {phase} of {path} (ranks mapped: {mapped:?}, missing: {missing:?}); no file left behind")]
    JoinTimeout {
        /// The region's header file.
        path: PathBuf,
        /// What the rank was waiting for.
        phase: JoinPhase,
        /// The timeout that expired.
        timeout: Duration,
        /// Ranks that had mapped the region (empty when the header was not readable).
        mapped: Vec<usize>,
        /// Ranks that had not.
        missing: Vec<usize>,
    },

    /// The interrupt check of the options ([`ShmOptions::interrupt`](super::ShmOptions::interrupt))
    /// said to stop while this rank waited (Ctrl-C in the Python front).
    /// The rank gave the region up as its timeout would have: abandoned it
    /// if it had the header mapped, and removed the files a timeout
    /// removes (none for a joiner that found no file).
    #[error("interrupted while waiting for {phase} of {path}; no file left behind")]
    Interrupted {
        /// The region's header file.
        path: PathBuf,
        /// What the rank was waiting for.
        phase: JoinPhase,
    },

    /// Another rank gave the region up (timeout, drop, a refused file)
    /// before every rank mapped it.
    #[error("{path} was abandoned by another rank before every rank mapped it (ranks mapped: {mapped:?}){}", by.as_ref().map_or(String::new(), |n| format!(": {n}")))]
    Abandoned {
        /// The region's header file.
        path: PathBuf,
        /// Ranks that had mapped the region.
        mapped: Vec<usize>,
        /// Why, when the abandoning rank recorded it in the header.
        by: Option<AbandonNote>,
    },

    /// The file's header does not match what this rank expects.
    #[error("bad header in {path}: {field} is {found}, expected {expected}")]
    BadHeader {
        /// The region's header file.
        path: PathBuf,
        /// The mismatching field (`magic`, `version`, `file size`, ...).
        field: &'static str,
        /// The value this rank expected.
        expected: u64,
        /// The value found in the file.
        found: u64,
    },

    /// A header field is outside what any creator writes.
    #[error("bad header in {path}: {field} is {found}, must be below {limit}")]
    HeaderOutOfRange {
        /// The region's header file.
        path: PathBuf,
        /// The field (`creator_rank`).
        field: &'static str,
        /// The value found in the file.
        found: u64,
        /// The bound it must stay below.
        limit: u64,
    },

    /// The process that created the region is gone: the region is stale
    /// (left by a launch whose creator died), so this rank does not join
    /// it; the joiner abandons it and removes its files.
    #[error("{path} is stale: its creator (pid {pid}) is gone")]
    CreatorDied {
        /// The region's header file.
        path: PathBuf,
        /// The creator's recorded pid (0: none recorded).
        pid: u32,
    },

    /// This rank's bit was already set in the header: two processes claim
    /// the same rank, or the file is stale.
    #[error("rank {rank} has already mapped {path} (duplicate rank or stale file)")]
    RankAlreadyMapped {
        /// The region's header file.
        path: PathBuf,
        /// The rank's index, `0..ranks`.
        rank: usize,
    },

    /// The region's directory is on hugetlbfs and its huge page pool (or
    /// the mount's own `size=` limit) has fewer pages than the region needs.
    #[error("{dir} is hugetlbfs with pages of {page_bytes} bytes: the region needs {needed_pages} pages, the pool {pool} has {free_pages} free (not reserved) of {total_pages} (nr_hugepages){}; grow the pool (vm.nr_hugepages, as root) or make the region smaller", mount_pages.map_or(String::new(), |m| format!(", the mount allows {m} more")))]
    HugePagesTooFew {
        /// The region's directory.
        dir: PathBuf,
        /// The pool's sysfs directory, e.g. `/sys/kernel/mm/hugepages/hugepages-2048kB`.
        pool: PathBuf,
        /// Bytes of one huge page.
        page_bytes: u64,
        /// Pages the region (header included) needs.
        needed_pages: u64,
        /// Pages free and not reserved in the pool when checked.
        free_pages: u64,
        /// Pages in the pool (`nr_hugepages`).
        total_pages: u64,
        /// Pages the mount's `size=` still allows, if it sets one.
        mount_pages: Option<u64>,
    },

    /// A length that must be whole huge pages on hugetlbfs is not.
    #[error("{what} of {bytes} bytes is not a multiple of the hugetlbfs page of {page_bytes} bytes (choose sizes, slots and file bounds in whole huge pages)")]
    HugePageMisfit {
        /// Which length (`data file`, `region file`, ...).
        what: &'static str,
        /// Bytes of the file.
        bytes: u64,
        /// The huge page size.
        page_bytes: u64,
    },

    /// A system call failed.
    #[error("{op} failed on {path}: {source}")]
    Io {
        /// The operation (`open`, `ftruncate`, `mmap`, `statvfs`, ...).
        op: &'static str,
        /// The path it was applied to (the region file, or `/proc/meminfo`, or `<anonymous>`).
        path: PathBuf,
        /// The `std::io::Error` of the call (its errno).
        #[source]
        source: std::io::Error,
    },
}

impl RegionError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        RegionError::Io { op, path: path.into(), source }
    }
}

/// Why a rank abandoned a shared region, as it recorded it in the header
/// (`abandon_note`, offset 96) before it abandoned, so the ranks waiting
/// learn the reason at once instead of timing out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbandonNote {
    /// The rank that abandoned the region.
    pub rank: usize,
    /// What it refused.
    pub reason: AbandonReason,
}

/// What a rank refused when it abandoned a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbandonReason {
    /// Data file `file` was not one it could use (not the creator's inode,
    /// the wrong size, or untrusted: see that rank's own error).
    RefusedDataFile {
        /// The data file's index (`<header>.<file>`).
        file: usize,
    },
    /// A note this version does not know.
    Unknown(u64),
}

impl AbandonNote {
    /// The header word: `(rank + 1) << 48 | kind << 32 | detail` (0 is no
    /// note).
    pub(crate) fn encode(self) -> u64 {
        let (kind, detail) = match self.reason {
            AbandonReason::RefusedDataFile { file } => (1u64, file as u64 & 0xffff_ffff),
            AbandonReason::Unknown(w) => return w,
        };
        ((self.rank as u64 + 1) << 48) | (kind << 32) | detail
    }

    /// The note a header word holds (None for 0).
    pub(crate) fn decode(w: u64) -> Option<AbandonNote> {
        let rank = (w >> 48).checked_sub(1)? as usize;
        let reason = match (w >> 32) & 0xffff {
            1 => AbandonReason::RefusedDataFile { file: (w & 0xffff_ffff) as usize },
            _ => AbandonReason::Unknown(w),
        };
        Some(AbandonNote { rank, reason })
    }
}

impl std::fmt::Display for AbandonNote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.reason {
            AbandonReason::RefusedDataFile { file } => {
                write!(f, "rank {} refused data file {file} (see that rank's error)", self.rank)
            }
            AbandonReason::Unknown(w) => write!(f, "rank {} left note {w:#x}", self.rank),
        }
    }
}
