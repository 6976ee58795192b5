//! The node-shared region: a file under /dev/shm mapped by every rank.
//!
//! # Protocol
//!
//! One rank creates the file with `O_CREAT | O_EXCL` (a stale file is
//! reported, never reused), after checking that the file system and the
//! machine's memory can hold it. It sizes the file, maps it, writes the
//! header and publishes `Ready` with its own bit set. The other ranks open
//! the file (waiting for it to appear), wait until it has its full size and
//! the header is `Ready`, check the header against what they expect, and set
//! their bit. The compare-and-swap that sets the last bit also moves the
//! state to `Complete`. See [`super::header`] for the layout.
//!
//! # Unlink once every rank has mapped
//!
//! Whoever observes `Complete` unlinks the file (all of them try; the first
//! `unlink` wins and the rest see it gone), so the file disappears as soon
//! as the last rank has mapped it even if the rank that completed the mask
//! dies before it calls `unlink`. After that the memory lives on only in the
//! ranks' mappings, and the kernel frees it when the last one unmaps or dies.
//!
//! # Kill safety
//!
//! A rank may be killed (SIGKILL) at any point. The survivors never wait
//! without a deadline, and a survivor whose deadline passes moves the state
//! to `Abandoned` (so no late rank can still join) and unlinks the file. A
//! rank that sees `Abandoned` unlinks too (the abandoning rank may have died
//! between its CAS and its unlink). Dropping a region that is still linked
//! abandons and unlinks it. Hence, once every survivor has returned from
//! `create`/`join` (or dropped its region), no file remains, whatever rank
//! died when:
//!
//! - creator dies before creating the file: joiners time out on
//!   [`JoinPhase::FileToAppear`]; there is no file.
//! - creator dies after `open`, before `ftruncate`: joiners time out on
//!   [`JoinPhase::FileToBeSized`] and unlink the empty file.
//! - creator dies before publishing `Ready`: joiners time out on
//!   [`JoinPhase::CreatorToInitialise`], abandon and unlink.
//! - any rank dies before setting its bit: the others time out on
//!   [`JoinPhase::RanksToMap`], abandon and unlink.
//! - any rank dies after setting its bit: the mask still completes when the
//!   others arrive, or they time out; either way they unlink.
//!
//! Only if every rank dies does a file outlive them; the next creator then
//! gets [`RegionError::AlreadyExists`] and may remove it with
//! [`ShmOptions::force`].
//!
//! Unlinking checks that the path still names the inode this rank mapped
//! (device and inode numbers), so a rank never removes a newer file of the
//! same name. A window remains between that check and `unlink(2)`, which
//! matters only if a new run reuses the name while the old one is exiting;
//! use unique names (or [`ShmOptions::session`]) per launch.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use memmap2::{Advice, MmapOptions, MmapRaw};
use tracing::{debug, info, warn};

use super::error::{JoinPhase, RegionError};
use super::header::{full_mask, Fields, Hdr, JoinState, JoinWord, HUGE_HEADER_BYTES, MAGIC, MIN_HEADER_BYTES, VERSION};
use super::layout::Layout;
use super::options::ShmOptions;
use super::sys::{self, Backoff};
use super::{Kind, Region, SHM_PREFIX};

type Result<T> = std::result::Result<T, RegionError>;

/// Longest accepted region name (the file name adds the prefix).
pub const MAX_NAME_LEN: usize = 200;

/// The path of region `name` in `dir`: `dir/kvoffload-<name>`.
///
/// `name` must be non-empty, at most [`MAX_NAME_LEN`] bytes, and contain no
/// `/` or NUL.
pub fn shm_path(dir: &Path, name: &str) -> Result<PathBuf> {
    let bad = |reason| Err(RegionError::BadName { name: name.to_string(), reason });
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > MAX_NAME_LEN {
        return bad("longer than 200 bytes");
    }
    if name.contains('/') || name.contains('\0') {
        return bad("contains '/' or NUL");
    }
    Ok(dir.join(format!("{SHM_PREFIX}{name}")))
}

/// Bytes of the header for these options: one page (at least 4 KiB), or
/// 2 MiB with huge pages.
pub(crate) fn header_bytes(huge_pages: bool) -> usize {
    if huge_pages {
        HUGE_HEADER_BYTES.max(sys::page_size())
    } else {
        MIN_HEADER_BYTES.max(sys::page_size())
    }
}

/// Total file size for a layout: header plus data.
pub(crate) fn total_bytes(layout: &Layout, huge_pages: bool) -> Result<usize> {
    let h = header_bytes(huge_pages);
    layout.data_bytes().checked_add(h).filter(|t| *t <= isize::MAX as usize).ok_or_else(|| RegionError::SizeOverflow {
        what: "region file size",
        detail: format!("{} data bytes + {h} header bytes", layout.data_bytes()),
    })
}

/// The shared-file side of a [`Region`].
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) path: PathBuf,
    /// Kept open for the life of the region (fstat, mmap).
    file: File,
    dev: u64,
    ino: u64,
    /// False once this rank has seen the path gone or renamed to another
    /// inode, or unlinked it itself.
    pub(crate) linked: bool,
    pub(crate) timeout: Duration,
    session: u64,
    wait_for_all: bool,
}

impl Shared {
    fn new(path: PathBuf, file: File, opts: &ShmOptions) -> Result<Self> {
        let md = file.metadata().map_err(|e| RegionError::io("fstat", &path, e))?;
        Ok(Shared {
            path,
            dev: md.dev(),
            ino: md.ino(),
            file,
            linked: true,
            timeout: opts.timeout,
            session: opts.session,
            wait_for_all: opts.wait_for_all,
        })
    }

    /// Unlinks the path if it still names this rank's inode. Returns
    /// whether this call removed it.
    pub(crate) fn unlink_if_ours(&mut self, why: &str) -> Result<bool> {
        if !self.linked {
            return Ok(false);
        }
        match std::fs::symlink_metadata(&self.path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.linked = false;
                return Ok(false);
            }
            Err(e) => return Err(RegionError::io("stat", &self.path, e)),
            Ok(md) if md.dev() != self.dev || md.ino() != self.ino => {
                debug!(path = %self.path.display(), "region path now names another file; not unlinking");
                self.linked = false;
                return Ok(false);
            }
            Ok(_) => {}
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => {
                self.linked = false;
                info!(path = %self.path.display(), why, "unlinked region file");
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.linked = false;
                Ok(false)
            }
            Err(e) => Err(RegionError::io("unlink", &self.path, e)),
        }
    }
}

fn timeout_error(path: &Path, phase: JoinPhase, timeout: Duration, w: Option<JoinWord>, n: usize) -> RegionError {
    let (mapped, missing) = match w {
        Some(w) => (w.mapped(), w.missing(n)),
        None => (Vec::new(), (0..n).collect()),
    };
    RegionError::JoinTimeout { path: path.to_path_buf(), phase, timeout, mapped, missing }
}

impl Region {
    /// Creates the node-shared region `name` (file `dir/kvoffload-<name>`)
    /// as rank `rank` of `layout.num_ranks()`.
    ///
    /// Checks capacity first ([`RegionError::ShmTooSmall`],
    /// [`RegionError::MemoryTooSmall`]), then creates the file with
    /// `O_EXCL` ([`RegionError::AlreadyExists`] unless
    /// [`ShmOptions::force`]). With [`ShmOptions::wait_for_all`] (the
    /// default) it returns once every rank has joined, the file already
    /// unlinked; on timeout it abandons and unlinks the file and returns
    /// [`RegionError::JoinTimeout`]. On any error no file is left.
    pub fn create(name: &str, layout: Layout, rank: usize, opts: &ShmOptions) -> Result<Region> {
        layout.check_rank(rank)?;
        let path = shm_path(&opts.dir, name)?;
        let started = Instant::now();
        let hbytes = header_bytes(opts.huge_pages);
        let total = total_bytes(&layout, opts.huge_pages)?;

        // Capacity, before anything is written.
        let free = sys::fs_available(&opts.dir).map_err(|e| RegionError::io("statvfs", &opts.dir, e))?;
        if total as u64 > free {
            return Err(RegionError::ShmTooSmall { dir: opts.dir.clone(), needed: total as u64, available: free });
        }
        if opts.check_memory {
            let avail = sys::mem_available().map_err(|e| RegionError::io("read", "/proc/meminfo", e))?;
            if total as u64 > avail {
                return Err(RegionError::MemoryTooSmall { needed: total as u64, available: avail });
            }
        }

        let file = open_exclusive(&path, opts)?;
        let mut shared = match Shared::new(path.clone(), file, opts) {
            Ok(s) => s,
            Err(e) => {
                // fstat failed on the file we just created: remove it by
                // name (no inode to compare; nobody else can have it yet
                // under O_EXCL unless it was force-removed meanwhile).
                if let Err(u) = std::fs::remove_file(&path) {
                    warn!(error = %u, path = %path.display(), "could not unlink region file after failed create");
                }
                return Err(e);
            }
        };
        let map = match size_and_map(&shared, total) {
            Ok(m) => m,
            Err(e) => {
                // Nobody can have joined (no READY yet): remove the file.
                if let Err(u) = shared.unlink_if_ours("create failed") {
                    warn!(error = %u, "could not unlink region file after failed create");
                }
                return Err(e);
            }
        };
        let mut region =
            Region { map, data_offset: hbytes, layout, rank, huge_pages_advised: false, kind: Kind::Shared(shared) };
        if opts.huge_pages {
            region.huge_pages_advised = region.try_advise_huge_pages();
        }
        info!(
            path = %region.path_lossy(),
            bytes = total,
            ranks = layout.num_ranks(),
            rank,
            "created shared region"
        );
        region.publish_ready(started)?;
        Ok(region)
    }

    /// Joins the node-shared region `name` as rank `rank`.
    ///
    /// Waits (up to [`ShmOptions::timeout`]) for the file to appear, to get
    /// its full size and to be marked initialised; checks the header against
    /// `layout` and `opts` ([`RegionError::BadHeader`]); sets this rank's
    /// bit. With [`ShmOptions::wait_for_all`] it then waits for the other
    /// ranks like [`Region::create`]. A timeout abandons and unlinks the file.
    pub fn join(name: &str, layout: Layout, rank: usize, opts: &ShmOptions) -> Result<Region> {
        layout.check_rank(rank)?;
        let path = shm_path(&opts.dir, name)?;
        let started = Instant::now();
        let n = layout.num_ranks();
        let hbytes = header_bytes(opts.huge_pages);
        let total = total_bytes(&layout, opts.huge_pages)?;
        let mut backoff = Backoff::new(opts.timeout);

        // Phase 1: the file appears.
        let file = loop {
            match OpenOptions::new().read(true).write(true).open(&path) {
                Ok(f) => break f,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if !backoff.wait() {
                        warn!(path = %path.display(), "join timed out: region file never appeared");
                        return Err(timeout_error(&path, JoinPhase::FileToAppear, opts.timeout, None, n));
                    }
                }
                Err(e) => return Err(RegionError::io("open", &path, e)),
            }
        };
        let mut shared = Shared::new(path, file, opts)?;
        debug!(path = %shared.path.display(), rank, "opened region file");

        // Phase 2: the creator sizes it.
        loop {
            let len = shared.file.metadata().map_err(|e| RegionError::io("fstat", &shared.path, e))?.len();
            if len == total as u64 {
                break;
            }
            if len != 0 {
                return Err(RegionError::BadHeader {
                    path: shared.path.clone(),
                    field: "file size",
                    expected: total as u64,
                    found: len,
                });
            }
            if !backoff.wait() {
                // The creator died between open and ftruncate (or is stuck):
                // nobody else can clean this file up reliably, so we do.
                warn!(path = %shared.path.display(), "join timed out: region file never sized");
                let e = timeout_error(&shared.path, JoinPhase::FileToBeSized, opts.timeout, None, n);
                shared.unlink_if_ours("join timed out before the file was sized")?;
                return Err(e);
            }
        }

        let map = MmapOptions::new()
            .len(total)
            .map_raw(&shared.file)
            .map_err(|e| RegionError::io("mmap", &shared.path, e))?;
        let mut region =
            Region { map, data_offset: hbytes, layout, rank, huge_pages_advised: false, kind: Kind::Shared(shared) };
        // From here on, dropping `region` on an error path abandons the
        // region and unlinks the file; for errors that say the file is not
        // ours to remove (bad header, duplicate rank) `forget_link` first.

        // Phase 3: the creator publishes READY.
        let word = loop {
            let w = region.hdr().load();
            match w.state {
                JoinState::Init => {
                    if !backoff.wait() {
                        warn!(path = %region.path_lossy(), "join timed out: creator never initialised the header");
                        let abandon = region.hdr().update(|w| {
                            (w.state == JoinState::Init).then_some(JoinWord { state: JoinState::Abandoned, ..w })
                        });
                        if let Err(w) = abandon {
                            // The creator published just now: go on with
                            // that word rather than abandon a live region.
                            break w;
                        }
                        let e =
                            timeout_error(region.shared_path(), JoinPhase::CreatorToInitialise, opts.timeout, None, n);
                        region.shared_mut().unlink_if_ours("join timed out before the header was ready")?;
                        return Err(e);
                    }
                }
                _ => break w,
            }
        };
        if word.state == JoinState::Abandoned {
            return Err(region.abandoned_error());
        }
        region.check_header(opts)?;

        // Phase 4: claim our rank's pid word (0 -> pid), then set our bit.
        // Claiming first makes a second process with the same rank fail
        // before it can touch the mask, and lets peers see our pid as soon
        // as our bit is visible.
        let pid = std::process::id();
        // A cross-process header word: core atomics, see `header`.
        if let Err(other) = region.hdr().rank_pids()[rank].compare_exchange(
            0,
            pid,
            core::sync::atomic::Ordering::AcqRel,
            core::sync::atomic::Ordering::Acquire,
        ) {
            debug!(rank, other, "rank already claimed by another process");
            region.forget_link();
            return Err(RegionError::RankAlreadyMapped { path: region.shared_path().to_path_buf(), rank });
        }
        let bit = 1u32 << rank;
        let full = full_mask(n);
        let (_, new) = match region.hdr().update(|w| {
            (w.state == JoinState::Ready && w.mask & bit == 0).then(|| {
                let mask = w.mask | bit;
                let state = if mask == full { JoinState::Complete } else { JoinState::Ready };
                JoinWord { state, mask }
            })
        }) {
            Ok(x) => x,
            Err(w) if w.state == JoinState::Abandoned => return Err(region.abandoned_error()),
            Err(w) if w.mask & bit != 0 => {
                region.forget_link();
                return Err(RegionError::RankAlreadyMapped { path: region.shared_path().to_path_buf(), rank });
            }
            Err(w) => {
                region.forget_link();
                return Err(RegionError::BadHeader {
                    path: region.shared_path().to_path_buf(),
                    field: "join state",
                    expected: JoinWord { state: JoinState::Ready, mask: w.mask }.encode(),
                    found: w.encode(),
                });
            }
        };
        if opts.huge_pages {
            region.huge_pages_advised = region.try_advise_huge_pages();
        }
        info!(path = %region.path_lossy(), rank, mapped = ?new.mapped(), "joined shared region");
        region.after_mapped(new, backoff, started)?;
        Ok(region)
    }

    /// Waits until every rank has mapped the region, then unlinks the file
    /// (a no-op for anonymous regions and once done). On timeout the region
    /// is abandoned, the file unlinked and [`RegionError::JoinTimeout`]
    /// returned; if another rank abandoned it, [`RegionError::Abandoned`].
    pub fn wait_all_mapped(&mut self, timeout: Duration) -> Result<()> {
        if !matches!(self.kind, Kind::Shared(_)) {
            return Ok(());
        }
        self.wait_all(Backoff::new(timeout), timeout)
    }

    /// Abandons the region if some rank has not mapped it yet (so none can
    /// join any more) and unlinks the file if it still names this region.
    /// Returns whether this call removed the file. Ranks that have mapped
    /// the region keep using the memory. A no-op for anonymous regions.
    pub fn unlink_now(&mut self) -> Result<bool> {
        if !matches!(self.kind, Kind::Shared(_)) {
            return Ok(false);
        }
        let abandoned = self
            .hdr()
            .update(|w| {
                matches!(w.state, JoinState::Init | JoinState::Ready)
                    .then_some(JoinWord { state: JoinState::Abandoned, ..w })
            })
            .is_ok();
        if abandoned {
            warn!(path = %self.path_lossy(), rank = self.rank, "abandoning shared region before every rank mapped it");
        }
        self.shared_mut().unlink_if_ours("unlink_now")
    }

    /// Ranks that have mapped the region (all of them for an anonymous one).
    pub fn mapped_ranks(&self) -> Vec<usize> {
        match self.kind {
            Kind::Shared(_) => self.hdr().load().mapped(),
            Kind::Anonymous => (0..self.layout.num_ranks()).collect(),
        }
    }

    // ---- internals ----

    /// The creator's last steps: publish READY with its bit, then wait.
    fn publish_ready(&mut self, started: Instant) -> Result<()> {
        let n = self.layout.num_ranks();
        let bit = 1u32 << self.rank;
        let timeout = self.shared().timeout;
        let fields = Fields {
            magic: MAGIC,
            version: VERSION,
            header_bytes: self.data_offset as u32,
            total_bytes: self.map.len() as u64,
            chunk_bytes: self.layout.chunk_bytes() as u64,
            num_rows: self.layout.num_rows() as u64,
            num_ranks: n as u32,
            creator_rank: self.rank as u32,
            session: self.shared().session,
            creator_pid: std::process::id(),
        };
        let hdr = self.hdr();
        hdr.write_fields(&fields);
        // Cross-process header word (core atomics, see `header`); published
        // by the release CAS below.
        hdr.rank_pids()[self.rank].store(std::process::id(), core::sync::atomic::Ordering::Relaxed);
        let full = full_mask(n);
        let published = hdr.update(|w| {
            (w.state == JoinState::Init).then_some(JoinWord {
                state: if bit == full { JoinState::Complete } else { JoinState::Ready },
                mask: bit,
            })
        });
        match published {
            Ok((_, new)) => self.after_mapped(new, Backoff::new(timeout.saturating_sub(started.elapsed())), started),
            // A joiner timed out waiting for us and abandoned the file.
            Err(_) => Err(self.abandoned_error()),
        }
    }

    /// After this rank set its bit: unlink if complete, else maybe wait.
    fn after_mapped(&mut self, w: JoinWord, backoff: Backoff, started: Instant) -> Result<()> {
        if w.state == JoinState::Complete {
            self.shared_mut().unlink_if_ours("every rank mapped")?;
            return Ok(());
        }
        if self.shared().wait_for_all {
            let timeout = self.shared().timeout;
            self.wait_all(backoff, timeout)?;
            debug!(path = %self.path_lossy(), elapsed = ?started.elapsed(), "every rank mapped");
        }
        Ok(())
    }

    fn wait_all(&mut self, mut backoff: Backoff, timeout: Duration) -> Result<()> {
        loop {
            let w = self.hdr().load();
            match w.state {
                JoinState::Complete => {
                    self.shared_mut().unlink_if_ours("every rank mapped")?;
                    return Ok(());
                }
                JoinState::Abandoned => return Err(self.abandoned_error()),
                _ => {}
            }
            if !backoff.wait() {
                // Abandon unless the last rank arrived meanwhile.
                match self
                    .hdr()
                    .update(|w| (w.state == JoinState::Ready).then_some(JoinWord { state: JoinState::Abandoned, ..w }))
                {
                    Ok((old, _)) => {
                        let n = self.layout.num_ranks();
                        warn!(path = %self.path_lossy(), missing = ?old.missing(n), "timed out waiting for every rank to map the region");
                        let e = timeout_error(self.shared_path(), JoinPhase::RanksToMap, timeout, Some(old), n);
                        self.shared_mut().unlink_if_ours("timed out waiting for ranks")?;
                        return Err(e);
                    }
                    // Complete or Abandoned meanwhile: handled at the top.
                    Err(w) if matches!(w.state, JoinState::Complete | JoinState::Abandoned) => {}
                    Err(w) => {
                        // Init or a foreign value after this rank joined:
                        // the header was overwritten. Leave the file alone.
                        self.forget_link();
                        return Err(RegionError::BadHeader {
                            path: self.shared_path().to_path_buf(),
                            field: "join state",
                            expected: JoinWord { state: JoinState::Ready, mask: w.mask }.encode(),
                            found: w.encode(),
                        });
                    }
                }
            }
        }
    }

    /// The error for a region some rank abandoned; unlinks it too, since
    /// the abandoning rank may have died before it could.
    fn abandoned_error(&mut self) -> RegionError {
        let mapped = self.hdr().load().mapped();
        if let Err(e) = self.shared_mut().unlink_if_ours("region abandoned") {
            warn!(error = %e, "could not unlink abandoned region file");
        }
        RegionError::Abandoned { path: self.shared_path().to_path_buf(), mapped }
    }

    /// Compares the header with what this rank expects.
    fn check_header(&mut self, opts: &ShmOptions) -> Result<()> {
        let f = self.hdr().read_fields();
        let expect: [(&'static str, u64, u64); 8] = [
            ("magic", MAGIC, f.magic),
            ("version", VERSION as u64, f.version as u64),
            ("header_bytes", self.data_offset as u64, f.header_bytes as u64),
            ("total_bytes", self.map.len() as u64, f.total_bytes),
            ("num_ranks", self.layout.num_ranks() as u64, f.num_ranks as u64),
            ("chunk_bytes", self.layout.chunk_bytes() as u64, f.chunk_bytes),
            ("num_rows", self.layout.num_rows() as u64, f.num_rows),
            ("session", opts.session, f.session),
        ];
        for (field, expected, found) in expect {
            if expected != found {
                self.forget_link();
                return Err(RegionError::BadHeader { path: self.shared_path().to_path_buf(), field, expected, found });
            }
        }
        Ok(())
    }

    pub(crate) fn hdr(&self) -> Hdr<'_> {
        debug_assert!(matches!(self.kind, Kind::Shared(_)));
        let base = NonNull::new(self.map.as_mut_ptr()).expect("mmap never returns null");
        // SAFETY: shared regions map header_bytes (>= size_of::<Header>())
        // plus data from a page-aligned base, and the mapping lives as long
        // as `self`, which the returned handle borrows.
        unsafe { Hdr::from_base(base) }
    }

    fn shared(&self) -> &Shared {
        match &self.kind {
            Kind::Shared(s) => s,
            Kind::Anonymous => unreachable!("shared-region method on an anonymous region"),
        }
    }

    fn shared_mut(&mut self) -> &mut Shared {
        match &mut self.kind {
            Kind::Shared(s) => s,
            Kind::Anonymous => unreachable!("shared-region method on an anonymous region"),
        }
    }

    fn shared_path(&self) -> &Path {
        &self.shared().path
    }

    fn path_lossy(&self) -> String {
        self.shared().path.display().to_string()
    }

    /// Marks the file as not ours to remove (it does not match what we
    /// expect), so dropping the region leaves it alone.
    fn forget_link(&mut self) {
        if let Kind::Shared(s) = &mut self.kind {
            s.linked = false;
        }
    }

    /// Drop path for shared regions: abandon if incomplete, then unlink.
    pub(crate) fn drop_shared(&mut self) {
        if !self.shared().linked {
            return;
        }
        if let Err(e) = self.unlink_now() {
            warn!(error = %e, "could not unlink region file on drop");
        }
    }
}

/// `open(O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode)`, removing a stale
/// file first if `force`.
fn open_exclusive(path: &Path, opts: &ShmOptions) -> Result<File> {
    let open = || OpenOptions::new().read(true).write(true).create_new(true).mode(opts.mode).open(path);
    match open() {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            if !opts.force {
                warn!(path = %path.display(), "region file already exists (stale file from a crashed run?)");
                return Err(RegionError::AlreadyExists { path: path.to_path_buf() });
            }
            warn!(path = %path.display(), "force: removing existing region file");
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(RegionError::io("unlink", path, e)),
            }
            open().map_err(|e| {
                if e.kind() == io::ErrorKind::AlreadyExists {
                    RegionError::AlreadyExists { path: path.to_path_buf() }
                } else {
                    RegionError::io("open", path, e)
                }
            })
        }
        Err(e) => Err(RegionError::io("open", path, e)),
    }
}

/// Sizes and maps a freshly created file.
fn size_and_map(shared: &Shared, total: usize) -> Result<MmapRaw> {
    shared.file.set_len(total as u64).map_err(|e| RegionError::io("ftruncate", &shared.path, e))?;
    MmapOptions::new().len(total).map_raw(&shared.file).map_err(|e| RegionError::io("mmap", &shared.path, e))
}

impl Region {
    /// `madvise(MADV_HUGEPAGE)` on the data area; logs and returns false on
    /// refusal.
    pub(crate) fn try_advise_huge_pages(&self) -> bool {
        match self.advise_huge_pages() {
            Ok(()) => true,
            Err(e) => {
                warn!(error = %e, "MADV_HUGEPAGE refused; continuing with base pages");
                false
            }
        }
    }

    /// Applies `advice` to the data area.
    pub(crate) fn advise_data(&self, advice: Advice) -> io::Result<()> {
        self.map.advise_range(advice, self.data_offset, self.layout.data_bytes())
    }
}
