//! Options for creating and joining regions.

use std::path::{Path, PathBuf};
use std::time::Duration;

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

    /// Refuse a region larger than `MemAvailable` (default on): a region
    /// that cannot be resident cannot be pinned.
    pub fn check_memory(mut self, on: bool) -> Self {
        self.check_memory = on;
        self
    }
}

/// Options of [`Region::create`](super::Region::create) and
/// [`Region::join`](super::Region::join). Creator and joiners must agree on
/// `dir`, `huge_pages` (it sets the header size) and `session`.
#[derive(Debug, Clone)]
pub struct ShmOptions {
    pub(crate) dir: PathBuf,
    pub(crate) timeout: Duration,
    pub(crate) wait_for_all: bool,
    pub(crate) force: bool,
    pub(crate) check_memory: bool,
    pub(crate) huge_pages: bool,
    pub(crate) session: u64,
    pub(crate) mode: u32,
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
            mode: 0o600,
        }
    }
}

impl ShmOptions {
    /// Defaults: `/dev/shm`, 60 s timeout, wait for every rank, no force,
    /// MemAvailable checked, no huge pages, session 0, mode 0600.
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

    /// Creator only: refuse a region larger than `MemAvailable` (default on).
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

    /// Permission bits of the created file (default 0600: ranks of one
    /// engine run as one user).
    pub fn mode(mut self, mode: u32) -> Self {
        self.mode = mode;
        self
    }
}
