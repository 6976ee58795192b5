//! Options for creating and joining regions.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::sync::StdArc;

/// Default upper bound of one data file of a [`FileSplit::Multi`] region:
/// 256 MiB. Small enough that a rank's share spans many files (pre-fault
/// workers each fault their own file: one tmpfs file's page cache is what
/// bounds faulting, docs/gpu-runs/2026-11-29-run7-pin-probe.md), large
/// enough that a 1 TiB region stays within [`MAX_FILES`].
pub const DEFAULT_FILE_BYTES: usize = 256 << 20;

/// Most data files one region may have (each rank maps every file: one
/// mapping each, and one open descriptor while joining).
pub const MAX_FILES: usize = 4096;

/// How a shared region's memory is split into files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileSplit {
    /// One file, `kvoffload-<name>`: the header page, then the data area
    /// (the original layout). Every page of the region goes through this one
    /// file's page cache, which bounds pre-faulting at about 4-5 GB/s on the
    /// H200 machine whatever the number of threads.
    Single,
    /// A header file `kvoffload-<name>` (the header alone) and data files
    /// `kvoffload-<name>.<k>` of at most `max_file_bytes` each, mapped back to
    /// back behind the header in one reserved address range, so the data
    /// area is as contiguous as with [`FileSplit::Single`]. In a rank-major
    /// layout each file holds whole chunks of one rank (each rank owns its
    /// files: it reserves and pre-faults only those); in a row-interleaved
    /// layout whole rows.
    Multi {
        /// Upper bound of one data file (rounded down to whole chunks or
        /// rows; at least one).
        max_file_bytes: usize,
    },
}

impl Default for FileSplit {
    fn default() -> Self {
        FileSplit::Multi { max_file_bytes: DEFAULT_FILE_BYTES }
    }
}

/// A step of creating or joining a shared region (or creating or opening a
/// persistent one: `HeaderCreated`, `DataFileCreated` and `Ready` when it
/// creates, `FilesMapped` when it opens, `Reserving` and `Reserved` when it
/// reserves its share; no `Mapped`), reported to
/// [`ShmOptions::observe`] as this rank passes it (for progress, tracing,
/// and the tests that kill a rank at each step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShmStep {
    /// Creator: the header file exists, is sized and mapped; state `Init`.
    HeaderCreated,
    /// Creator: data file `file` exists under its name, its inode is in the
    /// header, it is sized and mapped.
    DataFileCreated {
        /// Index of the data file.
        file: usize,
    },
    /// Creator: the header is written and `Ready` published.
    Ready,
    /// Joiner: every data file is open, checked against the header and
    /// mapped; the rank's pid is not claimed yet.
    FilesMapped,
    /// This rank is about to reserve (`fallocate`) the pages of its own
    /// data files.
    Reserving,
    /// This rank's data files are reserved; its bit is not set yet.
    Reserved,
    /// This rank's bit is set (it has mapped the whole region).
    Mapped,
}

/// A callback for [`ShmStep`]s.
pub type ShmObserver = StdArc<dyn Fn(ShmStep) + Send + Sync>;

/// The check of [`ShmOptions::interrupt`]: true means stop waiting.
pub type ShmInterrupt = StdArc<dyn Fn() -> bool + Send + Sync>;

/// The longest a wait of `create` or `join` goes without calling the
/// options' interrupt check (it polls every 5 ms at most, and calls the
/// check once this much time passed since the last call).
pub use crate::sync::INTERRUPT_EVERY;

/// Options of [`Region::anonymous`](super::Region::anonymous).
#[derive(Debug, Clone)]
pub struct AnonOptions {
    pub(crate) huge_pages: bool,
    pub(crate) check_memory: bool,
}

impl Default for AnonOptions {
    fn default() -> Self {
        AnonOptions { huge_pages: false, check_memory: true }
    }
}

impl AnonOptions {
    /// Defaults: no huge-page advice, MemAvailable checked.
    pub fn new() -> Self {
        Self::default()
    }

    /// Advise transparent huge pages (`madvise(MADV_HUGEPAGE)`) on the
    /// mapping. Effective when `/sys/kernel/mm/transparent_hugepage/enabled`
    /// is `madvise` or `always`; a refusal is logged, not fatal (see
    /// [`Region::huge_pages_advised`](super::Region::huge_pages_advised)).
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// Refuse a region larger than the memory this process can get
    /// (default on): the smaller of `MemAvailable` and its cgroup's limit
    /// minus usage ([`limits`](super::limits)), checked before anything is
    /// mapped; a region that cannot be resident cannot be pinned. The
    /// refusal is [`RegionError::MemoryTooSmall`](super::RegionError::MemoryTooSmall).
    ///
    /// Escape hatch: off skips the check, for a caller that knows better
    /// (memory freed by the time the region is touched, overcommit on
    /// purpose, a benchmark measuring the failure itself). A region that
    /// does not fit then fails later and worse: the pinning fails or the
    /// process is killed by the OOM killer while faulting it.
    pub fn check_memory(mut self, on: bool) -> Self {
        self.check_memory = on;
        self
    }
}

/// Options of [`Region::create`](super::Region::create) and
/// [`Region::join`](super::Region::join). Creator and joiners must agree on
/// `dir`, `huge_pages` (it sets the header size) and `session`. Also of
/// [`Region::open_persistent`](super::Region::open_persistent) (where
/// `force` and `wait_for_all` mean nothing) and
/// [`Region::remove_persistent`](super::Region::remove_persistent) (`dir`,
/// `allow_group`, `timeout`, `interrupt`).
#[derive(Clone)]
pub struct ShmOptions {
    pub(crate) dir: PathBuf,
    pub(crate) timeout: Duration,
    pub(crate) wait_for_all: bool,
    pub(crate) force: bool,
    pub(crate) check_memory: bool,
    pub(crate) huge_pages: bool,
    pub(crate) session: u64,
    pub(crate) mode: Option<u32>,
    pub(crate) allow_group: Option<u32>,
    pub(crate) files: FileSplit,
    pub(crate) reserve: bool,
    pub(crate) defer_reserve: bool,
    pub(crate) threads: Option<usize>,
    pub(crate) observer: Option<ShmObserver>,
    pub(crate) interrupt: Option<ShmInterrupt>,
}

impl std::fmt::Debug for ShmOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmOptions")
            .field("dir", &self.dir)
            .field("timeout", &self.timeout)
            .field("wait_for_all", &self.wait_for_all)
            .field("force", &self.force)
            .field("check_memory", &self.check_memory)
            .field("huge_pages", &self.huge_pages)
            .field("session", &self.session)
            .field("mode", &format_args!("{:o}", self.file_mode()))
            .field("allow_group", &self.allow_group)
            .field("files", &self.files)
            .field("reserve", &self.reserve)
            .field("defer_reserve", &self.defer_reserve)
            .field("threads", &self.threads)
            .field("observer", &self.observer.is_some())
            .field("interrupt", &self.interrupt.is_some())
            .finish()
    }
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            dir: PathBuf::from(super::DEFAULT_SHM_DIR),
            timeout: Duration::from_secs(60),
            wait_for_all: true,
            force: false,
            check_memory: true,
            huge_pages: false,
            session: 0,
            mode: None,
            allow_group: None,
            files: FileSplit::default(),
            reserve: true,
            defer_reserve: false,
            threads: None,
            observer: None,
            interrupt: None,
        }
    }
}

impl ShmOptions {
    /// Defaults: `/dev/shm`, 60 s timeout, wait for every rank, no force,
    /// memory checked, no huge pages, session 0, mode 0600 (files this
    /// user's alone, no group allowed), data files
    /// of at most [`DEFAULT_FILE_BYTES`] ([`FileSplit::Multi`]), pages
    /// reserved, reserve threads from the cores.
    pub fn new() -> Self {
        Self::default()
    }

    /// Directory of the region file (default `/dev/shm`; must be a tmpfs
    /// for the memory to be shared without a backing disk).
    pub fn dir(mut self, dir: impl AsRef<Path>) -> Self {
        self.dir = dir.as_ref().to_path_buf();
        self
    }

    /// How long `create`/`join` may wait in total (for the file, for the
    /// creator, for every rank). On expiry the rank abandons the region,
    /// unlinks the file and returns [`RegionError::JoinTimeout`](super::RegionError::JoinTimeout).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Whether `create`/`join` return only once every rank has mapped the
    /// file (default true: a barrier, after which the file is unlinked).
    /// With false, call [`Region::wait_all_mapped`](super::Region::wait_all_mapped)
    /// later; dropping the region before every rank mapped abandons it.
    pub fn wait_for_all(mut self, on: bool) -> Self {
        self.wait_for_all = on;
        self
    }

    /// Creator only: remove an existing file of the same name first (a
    /// stale file from a crashed run). Without it, an existing file gives
    /// [`RegionError::AlreadyExists`](super::RegionError::AlreadyExists).
    pub fn force(mut self, on: bool) -> Self {
        self.force = on;
        self
    }

    /// Refuse a region larger than the memory this process can get
    /// (default on): the smaller of `MemAvailable` and its cgroup's limit
    /// minus usage ([`limits`](super::limits)), checked before any file is
    /// created, opened or reserved and any page touched;
    /// [`RegionError::MemoryTooSmall`](super::RegionError::MemoryTooSmall)
    /// otherwise. The creator checks the whole region (header and data: the
    /// node's memory must hold it all; the file system's free space is
    /// checked too, [`RegionError::ShmTooSmall`](super::RegionError::ShmTooSmall)),
    /// a joiner the bytes it brings in itself (its own data files, or its
    /// share of a one-file region), before it waits for the creator.
    ///
    /// Escape hatch: off skips the memory check (not the file-system one),
    /// for a caller that knows better (memory freed by the time the region
    /// is touched, a benchmark of the failure itself). A region that does
    /// not fit then fails later and worse: reserving fails, or the process
    /// is killed by the OOM killer while faulting the region.
    pub fn check_memory(mut self, on: bool) -> Self {
        self.check_memory = on;
        self
    }

    /// Ask for huge pages: the header grows to 2 MiB so the data area
    /// starts on a huge-page boundary of the file, and the mapping gets
    /// `madvise(MADV_HUGEPAGE)`. On tmpfs whether huge pages are used
    /// depends on the mount's `huge=` option (`/dev/shm` is usually mounted
    /// `huge=never`; `huge=advise` or `always` honour the request).
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// A number every rank of one launch agrees on (e.g. from the launcher;
    /// default 0). The creator records it and joiners refuse a file with
    /// another session with [`RegionError::BadHeader`](super::RegionError::BadHeader),
    /// so a stale file of the same name is never joined by mistake.
    pub fn session(mut self, session: u64) -> Self {
        self.session = session;
        self
    }

    /// Permission bits of the created files (default 0600, or 0660 with
    /// [`ShmOptions::allow_group`]), set exactly (`fchmod` after creating:
    /// the umask does not change them). Bits that joiners would refuse
    /// (any for others; for the group without an allowed group; owner
    /// without read and write) make `create` fail with
    /// [`RegionError::BadFileMode`](super::RegionError::BadFileMode) before
    /// any file is made.
    pub fn mode(mut self, mode: u32) -> Self {
        self.mode = Some(mode);
        self
    }

    /// Lets the ranks of one engine run as different users of group `gid`
    /// (default: none; the region is this user's alone).
    ///
    /// The creator gives every file this group (`fchown`, so the creating
    /// user must be a member, or root) and mode 0660 unless
    /// [`ShmOptions::mode`] says otherwise. A joiner then accepts a file
    /// with group read/write bits if, and only if, its group is `gid`, and
    /// a file owned by another user only if its group is `gid` (only a
    /// member of the group, or root, can make such a file). Permission bits
    /// for others are never accepted; without this option a joiner accepts
    /// only regular files owned by its own effective uid with no group or
    /// other bits ([`RegionError::UntrustedFile`](super::RegionError::UntrustedFile)
    /// otherwise). Creator and joiners should agree on it.
    pub fn allow_group(mut self, gid: u32) -> Self {
        self.allow_group = Some(gid);
        self
    }

    /// The mode the creator gives its files.
    pub(crate) fn file_mode(&self) -> u32 {
        self.mode.unwrap_or(if self.allow_group.is_some() { 0o660 } else { 0o600 })
    }

    /// How the region is split into files (default [`FileSplit::Multi`] with
    /// [`DEFAULT_FILE_BYTES`]; [`FileSplit::Single`] is the one-file layout).
    /// Creator and joiners must agree ([`RegionError::BadHeader`](super::RegionError::BadHeader) otherwise).
    pub fn files(mut self, split: FileSplit) -> Self {
        self.files = split;
        self
    }

    /// [`FileSplit::Multi`] only: reserve each rank's own data files with
    /// `fallocate(2)` before the rank sets its bit (default on). The pages
    /// are then allocated in the file system, so a file system that fills
    /// up later cannot make a fault of the region fail (SIGBUS, or EFAULT
    /// from pre-faulting), and one that fills up while reserving is
    /// [`RegionError::ShmFull`](super::RegionError::ShmFull), the region
    /// abandoned and every file removed. Reserving allocates the pages
    /// without zeroing them (tmpfs zeroes on first access), so it moves part
    /// of the faulting cost into creating or joining.
    pub fn reserve(mut self, on: bool) -> Self {
        self.reserve = on;
        self
    }

    /// With [`ShmOptions::reserve`] on: leave the reservation out of
    /// `create`/`join` (default off). The rank sets its bit without
    /// reserving, keeps the descriptors of the data files it will touch
    /// (its own with a rank-major layout, every file with a row-interleaved
    /// one: up to [`MAX_FILES`] descriptors, mind RLIMIT_NOFILE), and every page is reserved by whoever touches it first:
    /// pinning's pre-fault workers reserve each slice (`fallocate` of that
    /// range) right before faulting it, so reserving overlaps pre-faulting
    /// and registering instead of preceding them. The promise is the same
    /// as with upfront reservation for every page pinning made resident;
    /// pinning that ends before ensuring every chunk (pageable) reserves the
    /// rest itself ([`Region::reserve_rest`](super::Region::reserve_rest),
    /// an error logged); a caller that does not pin must call `reserve_rest`
    /// before touching a page. A full file system is then
    /// [`RegionError::ShmFull`](super::RegionError::ShmFull) from
    /// `reserve_rest` or from the pre-fault step (pinning ends pageable,
    /// and the other ranks' agreement fails), not from `create`/`join`;
    /// the files are already unlinked then, so nothing is left either way.
    /// Creator and joiners may differ (it changes only what this rank does).
    pub fn defer_reserve(mut self, on: bool) -> Self {
        self.defer_reserve = on;
        self
    }

    /// Threads that reserve a rank's data files (default: the cores this
    /// process may use divided by the number of ranks, at least 1; never
    /// more than the rank's files).
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = Some(n.max(1));
        self
    }

    /// Calls `f` at each [`ShmStep`] this rank passes, on the thread that
    /// creates or joins. It runs inside the protocol: it must return, and
    /// a rank that dies inside it is one more kill point the protocol
    /// covers.
    pub fn observe(mut self, f: impl Fn(ShmStep) + Send + Sync + 'static) -> Self {
        // A shared callback, not a synchronisation primitive: std's `Arc`
        // under loom too (the region layer runs outside loom's model: its
        // waits are on other processes).
        #[allow(clippy::disallowed_methods)]
        let f: ShmObserver = StdArc::new(f);
        self.observer = Some(f);
        self
    }

    /// Makes the waits of `create` and `join` interruptible: while this rank
    /// waits (for the directory and the header file to appear, for the
    /// creator to size and initialise it, for every rank to map the region,
    /// also in [`Region::wait_all_mapped`](super::Region::wait_all_mapped))
    /// it calls `f` at least every [`INTERRUPT_EVERY`] (not before the
    /// first 50 ms of a wait, and never while it holds anything another
    /// thread of this process could be waiting for). When `f` returns true
    /// the rank gives the region up exactly as its timeout would have (an
    /// interrupt is a timeout that came early): it abandons the region if it
    /// had the header mapped and removes the files it would remove on a
    /// timeout (a joiner that found no file removes nothing: it never
    /// creates one), and returns [`RegionError::Interrupted`](super::RegionError::Interrupted).
    /// The Python front passes a check of Python's pending signals, so that
    /// Ctrl-C stops a join at once.
    pub fn interrupt(mut self, f: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        // A shared callback, as for `observe`.
        #[allow(clippy::disallowed_methods)]
        let f: ShmInterrupt = StdArc::new(f);
        self.interrupt = Some(f);
        self
    }

    /// A fresh rate-limited view of the interrupt check, for one wait.
    pub(crate) fn interrupt_check(&self) -> InterruptCheck {
        InterruptCheck { check: self.interrupt.clone(), last: Instant::now() }
    }

    pub(crate) fn step(&self, s: ShmStep) {
        tracing::debug!(step = ?s, "shared region step");
        if let Some(f) = &self.observer {
            f(s);
        }
    }
}

/// The options' interrupt check as one wait uses it: [`InterruptCheck::due`]
/// calls it at most every [`INTERRUPT_EVERY`].
pub(crate) struct InterruptCheck {
    check: Option<ShmInterrupt>,
    last: Instant,
}

impl InterruptCheck {
    /// Between two polls of a wait: true once the check said to stop
    /// (called only when [`INTERRUPT_EVERY`] passed since the last call, or
    /// since this wait began).
    pub(crate) fn due(&mut self) -> bool {
        let Some(f) = &self.check else { return false };
        if self.last.elapsed() < INTERRUPT_EVERY {
            return false;
        }
        let stop = f();
        self.last = Instant::now();
        stop
    }
}
