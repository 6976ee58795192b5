//! The node-shared region: files under /dev/shm mapped by every rank.
//!
//! # Files
//!
//! [`FileSplit::Single`]: one file `kvoffload-<name>`, the header page and
//! then the data area. [`FileSplit::Multi`] (the default): the header file
//! `kvoffload-<name>` holds the header alone (with a table of the data
//! files' inode numbers), and the data lives in data files
//! `kvoffload-<name>.<k>`, each holding whole chunks of one rank
//! (rank-major layout) or whole rows (row-interleaved), mapped back to back
//! right behind the header in one reserved address range, so the data area
//! is contiguous either way. Why several files: pre-faulting a tmpfs file
//! is bound by that file's page cache (one file: 4-5 GB/s with 16 threads
//! on the H200 machine; 16 files: 14 GB/s), and a rank that owns its files
//! reserves and faults only those.
//!
//! # Protocol
//!
//! One rank creates the header file with `O_CREAT | O_EXCL | O_NOFOLLOW`
//! (a stale file, or a link planted under the name, is reported, never
//! reused or followed), after checking that the file system and the memory
//! this process can get ([`super::limits`]) can hold the whole region. It
//! sizes and maps it, then (multi-file) creates each data file the same
//! way, records its inode in the header's file table, sizes and maps it.
//! It writes the header and publishes `Ready`. The other ranks open the
//! header file (waiting for it to appear; never through a link, and only a
//! regular file of their own user that nobody else may read or write, see
//! [`ShmOptions::allow_group`] and [`RegionError::UntrustedFile`]), wait
//! until it has its full size and the header is `Ready`, check the header
//! against what they expect, open each data file (with the same checks)
//! and check its inode against the table and its size against the plan,
//! and map it. Every file is reached by name through one descriptor of the
//! region's directory, opened once per rank.
//! Each rank then claims its pid word, reserves its own data files
//! (`fallocate`, [`ShmOptions::reserve`], multi-file only) and sets its bit.
//! With one file, or reserving off, the creator publishes `Ready` with its
//! bit already set (nothing to reserve); otherwise it publishes `Ready`
//! first, so every rank reserves its files at the same time, and sets its
//! bit like the joiners. The compare-and-swap that sets the last bit also
//! moves the state to `Complete`. See [`super::header`] for the layout.
//!
//! # Unlink once every rank has mapped
//!
//! Whoever observes `Complete` unlinks every file (all of them try; the
//! first `unlink` wins and the rest see it gone; data files first, the
//! header file last), so the files disappear as soon as the last rank has
//! mapped them even if the rank that completed the mask dies before it
//! calls `unlink`. After that the memory lives on only in the ranks'
//! mappings, and the kernel frees it when the last one unmaps or dies.
//! Pre-faulting, registering and transferring all happen after `Complete`
//! (the region is returned only then, or, without
//! [`ShmOptions::wait_for_all`], before it but still linked: see below),
//! so a rank killed during them leaves no file: there is none left.
//!
//! # Kill safety
//!
//! A rank may be killed (SIGKILL) at any point. The survivors never wait
//! without a deadline, and a survivor whose deadline passes moves the state
//! to `Abandoned` (so no late rank can still join) and unlinks every file
//! it knows. A rank that sees `Abandoned` unlinks too (the abandoning rank
//! may have died between its CAS and its unlinks). Dropping a region that
//! is still linked abandons and unlinks it. Hence, once every survivor has
//! returned from `create`/`join` (or dropped its region), no file remains,
//! whatever rank died when ([`ShmStep`] names the steps the tests kill at):
//!
//! - creator dies before creating the header file: joiners time out on
//!   [`JoinPhase::FileToAppear`]; there is no file.
//! - creator dies after `open`, before `ftruncate` of the header file:
//!   joiners time out on [`JoinPhase::FileToBeSized`] and unlink the empty
//!   file. No data file exists yet (they are created after the header file
//!   is sized).
//! - creator dies while creating data files (after
//!   [`ShmStep::HeaderCreated`], between [`ShmStep::DataFileCreated`]s):
//!   joiners time out on [`JoinPhase::CreatorToInitialise`], abandon, and
//!   remove the header file and every data file the table names (path
//!   still naming that inode), plus a data file whose inode is not in the
//!   table yet if it is empty: the creator records the inode right after
//!   `open(O_EXCL)` and before sizing the file, so an unrecorded file is
//!   one it died between those two calls.
//! - creator dies after writing the table, before publishing `Ready`: as
//!   the previous case.
//! - any rank dies after `Ready`, before setting its bit (while opening and
//!   mapping the data files, or reserving its own, [`ShmStep::FilesMapped`],
//!   [`ShmStep::Reserving`], [`ShmStep::Reserved`]; the creator included
//!   when it reserves): the others time out on [`JoinPhase::RanksToMap`],
//!   abandon and unlink every file (each of them has mapped all of them).
//! - any rank dies after setting its bit: the mask still completes when the
//!   others arrive, or they time out; either way they unlink.
//! - any rank dies during pre-faulting, registering or transferring: the
//!   files were unlinked at `Complete`, before any of those.
//!
//! A file system that fills up while a rank reserves its files (after the
//! capacity check, when another process writes to it meanwhile) fails that
//! rank with [`RegionError::ShmFull`]; it abandons the region and removes
//! every file, and the others see [`RegionError::Abandoned`]. Once every
//! rank has reserved its files, no fault of the region can fail for lack
//! of space.
//!
//! # Deferred reservation ([`ShmOptions::defer_reserve`])
//!
//! The rank sets its bit without reserving: the creator publishes `Ready`
//! with its bit set, a joiner sets its bit right after claiming its pid
//! word. It keeps the descriptors of the data files it will touch, and
//! reserves a range of them ([`Region::reserve_data`]) right before the
//! first touch; pinning's pre-fault workers do it per slice, so reserving
//! runs beside pre-faulting and registering instead of before them.
//!
//! Kill safety is unchanged: the steps before the bit are today's minus
//! the reservation, so the cases above cover every kill point up to
//! `Complete`, and reserving happens on descriptors of files that are
//! unlinked by then (or, without [`ShmOptions::wait_for_all`], that the
//! unlink at `Complete` removes); no step creates a file, so a rank killed
//! while reserving leaves none.
//!
//! A full file system: why no fault of the region can fail for lack of
//! space (SIGBUS, or EFAULT from pre-faulting). A page of a data file is
//! backed once `fallocate` of a range holding it returned success (tmpfs
//! allocates a folio for every index of the range and charges it to the
//! mount, undoing them all on failure), and stays backed while the file
//! lives (nothing here punches holes). Pinning touches only pages of the
//! slices its pre-fault workers fault, and each worker reserves its slice
//! on its own thread before it faults or touches any byte of it
//! ([`crate::pin::prefault`]); a slice whose reservation fails is not
//! touched, pre-faulting fails with the [`RegionError::ShmFull`] text and
//! pinning ends pageable before registering that chunk (a registration
//! faults only pages its pre-fault made resident; without pre-faulting,
//! pinning reserves this rank's files whole before it starts). Every other
//! touch must follow [`Region::reserve_rest`]: pinning calls it itself when
//! it ends before ensuring every chunk (failed or cancelled: the region is
//! then used pageable), and logs the typed error if it fails; a caller
//! that does not pin calls it first and, on the typed error, drops the
//! region. The region is not abandoned then (every rank may have
//! mapped it, the files are gone already); the other ranks learn of it
//! through the pin agreement, which fails for them.
//!
//! Only if every rank dies does a file outlive them; the next creator then
//! gets [`RegionError::AlreadyExists`] and may remove it with
//! [`ShmOptions::force`] (which also removes stale data files as it meets
//! them).
//!
//! Unlinking checks that the path still names the inode this rank mapped
//! (device and inode numbers), so a rank never removes a newer file of the
//! same name. A window remains between that check and `unlink(2)`, which
//! matters only if a new run reuses the name while the old one is exiting;
//! use unique names (or [`ShmOptions::session`]) per launch. One more
//! window: a creator slower than a joiner's whole timeout that creates a
//! data file after that joiner gave up and cleaned up, and is killed before
//! it checks the state again (it checks after every file), leaves that file.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};
use tracing::{debug, info, warn};

use super::error::{JoinPhase, RegionError};
use super::files::{self, FilePlan};
use super::header::{full_mask, Fields, Hdr, JoinState, JoinWord, HUGE_HEADER_BYTES, MAGIC, MIN_HEADER_BYTES, VERSION};
use super::hugetlb;
use super::layout::Layout;
use super::limits;
use super::mapping::{Mapping, Pieces};
use super::options::{FileSplit, ShmOptions, ShmStep};
use super::sys::{self, Backoff};
use super::trust::{self, FileMeta, OpenFailure, RegionDir, Trust};
use super::{Kind, Region, SHM_PREFIX};

type Result<T> = std::result::Result<T, RegionError>;

/// Longest accepted region name (the file name adds the prefix).
pub const MAX_NAME_LEN: usize = 200;

/// The path of region `name` in `dir`: `dir/kvoffload-<name>` (the header
/// file; data files add `.<k>`).
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

/// Bytes of the header of a one-file region: one page (at least 4 KiB), or
/// 2 MiB with huge pages.
pub(crate) fn header_bytes(huge_pages: bool) -> usize {
    if huge_pages {
        HUGE_HEADER_BYTES.max(sys::page_size())
    } else {
        MIN_HEADER_BYTES.max(sys::page_size())
    }
}

/// What `opts` and `layout` make of a region: its data files (None: one
/// file) and its header size.
struct Shape {
    plan: Option<FilePlan>,
    header_bytes: usize,
    /// Header plus data.
    total: usize,
    /// The hugetlbfs page size, when the directory is on hugetlbfs.
    hpage: Option<usize>,
}

impl Shape {
    /// The shape in a directory on a file system whose hugetlbfs page is
    /// `hpage` (None: not hugetlbfs). On hugetlbfs the header takes whole
    /// huge pages and every file must be whole huge pages
    /// ([`RegionError::HugePageMisfit`]).
    fn of(layout: &Layout, opts: &ShmOptions, hpage: Option<usize>) -> Result<Shape> {
        let plan = files::plan(layout, opts.files)?;
        let header_bytes = match &plan {
            None => header_bytes(opts.huge_pages),
            Some(p) => files::header_bytes(p.files.len()),
        };
        let header_bytes = hugetlb::round_header(header_bytes, hpage);
        let total = total_bytes(layout, header_bytes)?;
        if let Some(page) = hpage {
            match &plan {
                None => hugetlb::check_fit([(total, "region file")], page)?,
                Some(p) => hugetlb::check_fit(p.files.iter().map(|f| (f.bytes.len(), "data file")), page)?,
            }
        }
        Ok(Shape { plan, header_bytes, total, hpage })
    }

    /// Length of the header file: the whole region with one file, the
    /// header alone with data files.
    fn header_file_len(&self) -> usize {
        if self.plan.is_some() {
            self.header_bytes
        } else {
            self.total
        }
    }
}

/// Total size for a layout: header plus data.
pub(crate) fn total_bytes(layout: &Layout, header_bytes: usize) -> Result<usize> {
    let h = header_bytes;
    layout.data_bytes().checked_add(h).filter(|t| *t <= isize::MAX as usize).ok_or_else(|| RegionError::SizeOverflow {
        what: "region file size",
        detail: format!("{} data bytes + {h} header bytes", layout.data_bytes()),
    })
}

/// A file of the region this rank has open or mapped: its name in the
/// region's directory and the inode it named, so that unlinking removes
/// only that inode.
#[derive(Debug)]
struct Linked {
    /// The name's path, for messages.
    path: PathBuf,
    /// The name in the region's directory.
    name: OsString,
    dev: u64,
    ino: u64,
    /// False once this rank has seen the name gone or renamed to another
    /// inode, or unlinked it itself.
    linked: bool,
}

impl Linked {
    /// The inode `file` (opened as `name` in `dir`) is, from `fstat`.
    fn of(dir: &RegionDir, name: OsString, file: &File) -> Result<Linked> {
        let path = dir.path_of(&name);
        let m = FileMeta::of_file(file).map_err(|e| RegionError::io("fstat", &path, e))?;
        Ok(Linked { path, name, dev: m.dev, ino: m.ino, linked: true })
    }

    /// Unlinks the name if it still names this inode (`fstatat` without
    /// following, then `unlinkat`). Returns whether this call removed it.
    fn unlink_if_ours(&mut self, dir: &RegionDir, why: &str) -> Result<bool> {
        if !self.linked {
            return Ok(false);
        }
        match dir.lstat(&self.name) {
            Ok(None) => {
                self.linked = false;
                return Ok(false);
            }
            Err(e) => return Err(RegionError::io("stat", &self.path, e)),
            Ok(Some(m)) if m.dev != self.dev || m.ino != self.ino => {
                debug!(path = %self.path.display(), "region path now names another file; not unlinking");
                self.linked = false;
                return Ok(false);
            }
            Ok(Some(_)) => {}
        }
        match dir.unlink(&self.name) {
            Ok(true) => {
                self.linked = false;
                debug!(path = %self.path.display(), why, "unlinked region file");
                Ok(true)
            }
            Ok(false) => {
                self.linked = false;
                Ok(false)
            }
            Err(e) => Err(RegionError::io("unlink", &self.path, e)),
        }
    }
}

/// A data file as this rank mapped it.
#[derive(Debug)]
struct DataFile {
    link: Linked,
    /// Its bytes of the data area.
    bytes: std::ops::Range<usize>,
    owner: usize,
    /// Kept open until this rank has reserved it (own files only); with
    /// [`ShmOptions::defer_reserve`], kept for the region's life (every file
    /// this rank's pinning touches) so that pages are reserved as they are
    /// first touched ([`Region::reserve_data`]).
    file: Option<File>,
}

/// The shared-file side of a [`Region`].
#[derive(Debug)]
pub(crate) struct Shared {
    /// The header file's path (the region's name).
    pub(crate) path: PathBuf,
    /// The region's directory: every file is reached through it by name.
    dir: RegionDir,
    /// Which files this rank accepts ([`trust`]).
    trust: Trust,
    /// The header file, kept open for the life of the region (fstat, mmap).
    file: File,
    header: Linked,
    /// Data files in data-area order (empty with one file).
    data: Vec<DataFile>,
    /// Whether the plan has data files.
    multi: bool,
    /// Reservation left to whoever touches the pages
    /// ([`ShmOptions::defer_reserve`], multi-file with reserving on).
    deferred: bool,
    /// The hugetlbfs page size when the directory is on hugetlbfs.
    hpage: Option<usize>,
    pub(crate) timeout: Duration,
    session: u64,
    wait_for_all: bool,
    opts: ShmOptions,
}

impl Shared {
    fn new(dir: RegionDir, header: Linked, file: File, opts: &ShmOptions, shape: &Shape) -> Self {
        let multi = shape.plan.is_some();
        Shared {
            path: header.path.clone(),
            dir,
            trust: Trust::current(opts.allow_group),
            file,
            header,
            data: Vec::new(),
            multi,
            deferred: multi && opts.reserve && opts.defer_reserve,
            hpage: shape.hpage,
            timeout: opts.timeout,
            session: opts.session,
            wait_for_all: opts.wait_for_all,
            opts: opts.clone(),
        }
    }

    /// Whether this rank still believes some file of the region is linked.
    pub(crate) fn linked(&self) -> bool {
        self.header.linked || self.data.iter().any(|d| d.link.linked)
    }

    /// Unlinks every file of the region whose path still names the inode
    /// this rank knows: data files first, the header file last (so a file
    /// left by a rank dying midway always has its header beside it).
    /// Returns whether this call removed any. Tries every file even after
    /// an error, and returns the first error.
    pub(crate) fn unlink_if_ours(&mut self, why: &str) -> Result<bool> {
        let mut removed = false;
        let mut first_err = None;
        let dir = &self.dir;
        for d in &mut self.data {
            match d.link.unlink_if_ours(dir, why) {
                Ok(r) => removed |= r,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match self.header.unlink_if_ours(dir, why) {
            Ok(r) => removed |= r,
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
        if removed {
            info!(path = %self.path.display(), files = 1 + self.data.len(), why, "unlinked region files");
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(removed),
        }
    }

    /// Marks every file as not ours to remove.
    fn forget(&mut self) {
        self.header.linked = false;
        for d in &mut self.data {
            d.link.linked = false;
        }
    }
}

fn interrupted_error(path: &Path, phase: JoinPhase) -> RegionError {
    info!(path = %path.display(), %phase, "wait interrupted; giving the region up");
    RegionError::Interrupted { path: path.to_path_buf(), phase }
}

fn timeout_error(path: &Path, phase: JoinPhase, timeout: Duration, w: Option<JoinWord>, n: usize) -> RegionError {
    let (mapped, missing) = match w {
        Some(w) => (w.mapped(), w.missing(n)),
        None => (Vec::new(), (0..n).collect()),
    };
    RegionError::JoinTimeout { path: path.to_path_buf(), phase, timeout, mapped, missing }
}

impl Region {
    /// Creates the node-shared region `name` (header file
    /// `dir/kvoffload-<name>`, data files `dir/kvoffload-<name>.<k>` unless
    /// [`FileSplit::Single`]) as rank `rank` of `layout.num_ranks()`.
    ///
    /// Checks the files' mode ([`RegionError::BadFileMode`]) and capacity
    /// first: the file system's free space ([`RegionError::ShmTooSmall`])
    /// and the memory this process can get ([`RegionError::MemoryTooSmall`],
    /// [`ShmOptions::check_memory`]), before any file exists; then creates
    /// every file with `O_EXCL | O_NOFOLLOW` in the directory opened once
    /// ([`RegionError::AlreadyExists`], a symbolic link under the name
    /// included, unless [`ShmOptions::force`], which removes the name, never
    /// a link's target) and reserves this rank's data files
    /// ([`RegionError::ShmFull`]). With [`ShmOptions::wait_for_all`] (the
    /// default) it returns once every rank has joined, the files already
    /// unlinked; on timeout it abandons the region, unlinks the files and
    /// returns [`RegionError::JoinTimeout`]. On any error no file is left.
    pub fn create(name: &str, layout: Layout, rank: usize, opts: &ShmOptions) -> Result<Region> {
        layout.check_rank(rank)?;
        let path = shm_path(&opts.dir, name)?;
        trust::check_create_mode(opts.file_mode(), opts.allow_group)?;
        let started = Instant::now();
        let dir = RegionDir::open(&opts.dir).map_err(|e| RegionError::io("open (directory)", &opts.dir, e))?;
        let hpage = dir.hugetlb_page().map_err(|e| RegionError::io("fstatfs", &opts.dir, e))?;
        let shape = Shape::of(&layout, opts, hpage)?;
        let total = shape.total;

        // Capacity, before anything is written.
        if let Some(page) = hpage {
            // Huge pages come from the kernel's pool, not from MemAvailable
            // (which already excludes the pool) or a tmpfs size.
            let (blocks, avail) = dir.blocks().map_err(|e| RegionError::io("statvfs", &opts.dir, e))?;
            let root = Path::new(hugetlb::SYSFS_HUGEPAGES);
            hugetlb::check_capacity(&opts.dir, root, page, total as u64, hugetlb::mount_pages(blocks, avail))?;
        } else {
            let free = dir.available().map_err(|e| RegionError::io("statvfs", &opts.dir, e))?;
            if total as u64 > free {
                return Err(RegionError::ShmTooSmall { dir: opts.dir.clone(), needed: total as u64, available: free });
            }
        }
        if opts.check_memory && hpage.is_none() {
            // The whole region: the node's memory must hold every rank's
            // share (tmpfs pages are memory).
            limits::check(total as u64)?;
        }

        let file_name = header_name(&path);
        let file = open_exclusive(&dir, &file_name, opts)?;
        let header = match Linked::of(&dir, file_name.clone(), &file) {
            Ok(l) => l,
            Err(e) => {
                // fstat failed on the file we just created: remove it by
                // name (no inode to compare; nobody else can have it yet
                // under O_EXCL unless it was force-removed meanwhile).
                if let Err(u) = dir.unlink(&file_name) {
                    warn!(error = %u, path = %path.display(), "could not unlink region file after failed create");
                }
                return Err(e);
            }
        };
        let mut shared = Shared::new(dir, header, file, opts, &shape);
        let map = match size_and_map(&shared, &shape) {
            Ok(m) => m,
            Err(e) => {
                // Nobody can have joined (no READY yet): remove the file.
                if let Err(u) = shared.unlink_if_ours("create failed") {
                    warn!(error = %u, "could not unlink region file after failed create");
                }
                return Err(e);
            }
        };
        let mut region = Region::over_shared(map, &shape, layout, rank, shared);
        // From here on, dropping `region` on an error path abandons the
        // region and unlinks every file it has created.
        opts.step(ShmStep::HeaderCreated);
        if let Some(plan) = &shape.plan {
            region.create_data_files(plan, opts)?;
        }
        if opts.huge_pages && hpage.is_none() {
            region.huge_pages_advised = region.try_advise_huge_pages();
        }
        info!(
            path = %region.path_lossy(),
            bytes = total,
            files = 1 + region.shared().data.len(),
            ranks = layout.num_ranks(),
            rank,
            "created shared region"
        );
        region.publish_ready(started)?;
        Ok(region)
    }

    /// Creator: creates, records, sizes and maps every data file.
    fn create_data_files(&mut self, plan: &FilePlan, opts: &ShmOptions) -> Result<()> {
        let Mapping::Pieces(pieces) = &self.map else { unreachable!("a multi-file region maps pieces") };
        let hb = self.data_offset;
        let mut made = Vec::with_capacity(plan.files.len());
        let header = header_name(&self.shared().path);
        for (k, spec) in plan.files.iter().enumerate() {
            let name = files::data_name(&header, k);
            let dir = &self.shared().dir;
            let path = dir.path_of(&name);
            let file = match open_exclusive(dir, &name, opts) {
                Ok(f) => f,
                Err(e) => {
                    self.shared_mut().data.append(&mut made);
                    return Err(e);
                }
            };
            let link = match Linked::of(dir, name.clone(), &file) {
                Ok(l) => l,
                Err(e) => {
                    // As for the header: no inode to compare, remove by name.
                    let _ = dir.unlink(&name);
                    self.shared_mut().data.append(&mut made);
                    return Err(e);
                }
            };
            // Record the inode before sizing (the kill argument relies on
            // it: an unrecorded data file is always empty).
            self.hdr().file_inodes()[k].store(link.ino, core::sync::atomic::Ordering::Release);
            let len = spec.bytes.len();
            let mapped = file.set_len(len as u64).map_err(|e| RegionError::io("ftruncate", &path, e)).and_then(|()| {
                pieces.map_file(hb + spec.bytes.start, len, &file).map_err(|e| mmap_error(self.shared(), &path, e, len))
            });
            let keep = self.keeps_file(spec.owner).then_some(file);
            made.push(DataFile { link, bytes: spec.bytes.clone(), owner: spec.owner, file: keep });
            if let Err(e) = mapped {
                self.shared_mut().data.append(&mut made);
                return Err(e);
            }
            opts.step(ShmStep::DataFileCreated { file: k });
            // A joiner that timed out meanwhile abandoned the region; stop
            // creating files (each is one more to clean up).
            if self.hdr().load().state == JoinState::Abandoned {
                self.shared_mut().data.append(&mut made);
                return Err(self.abandoned_error());
            }
        }
        self.shared_mut().data = made;
        Ok(())
    }

    /// Joins the node-shared region `name` as rank `rank`.
    ///
    /// Checks first that this rank's share fits in the memory this process
    /// can get ([`RegionError::MemoryTooSmall`], [`ShmOptions::check_memory`]).
    /// Waits (up to [`ShmOptions::timeout`]) for the header file to appear,
    /// opens it and every data file without following links and refuses
    /// any that is not a regular file of this user that nobody else may
    /// read or write ([`RegionError::UntrustedFile`], leaving it as it was;
    /// see [`ShmOptions::allow_group`]), waits for the header file to get
    /// its full size and to be marked initialised; checks the header
    /// against `layout` and `opts` ([`RegionError::BadHeader`]); opens,
    /// checks and maps the data files; reserves this rank's own
    /// ([`RegionError::ShmFull`]); sets this rank's bit. With
    /// [`ShmOptions::wait_for_all`] it then waits for the other ranks like
    /// [`Region::create`]. A timeout abandons the region and unlinks the files.
    pub fn join(name: &str, layout: Layout, rank: usize, opts: &ShmOptions) -> Result<Region> {
        layout.check_rank(rank)?;
        let path = shm_path(&opts.dir, name)?;
        let started = Instant::now();
        let n = layout.num_ranks();
        // The plan alone (the memory check needs no more); the shape in the
        // directory's file system is made once the directory is open.
        let plan_only = Shape::of(&layout, opts, None)?;
        let on_hugetlbfs =
            rustix::fs::statfs(&opts.dir).is_ok_and(|st| st.f_type as u64 & 0xffff_ffff == hugetlb::HUGETLBFS_MAGIC);
        if opts.check_memory && !on_hugetlbfs {
            // What this rank brings in itself, before it waits for anything.
            limits::check(rank_bytes(&layout, plan_only.plan.as_ref(), rank))?;
        }
        let mut backoff = Backoff::new(opts.timeout);
        // An interrupt gives up as the timeout does, at the same points.
        let mut interrupt = opts.interrupt_check();
        let trust = Trust::current(opts.allow_group);
        let file_name = header_name(&path);
        let never_appeared = |path: &Path| {
            warn!(path = %path.display(), "join timed out: region file never appeared");
            timeout_error(path, JoinPhase::FileToAppear, opts.timeout, None, n)
        };

        // Phase 1: the directory and the file appear.
        let dir = loop {
            match RegionDir::open(&opts.dir) {
                Ok(d) => break d,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if interrupt.due() {
                        return Err(interrupted_error(&path, JoinPhase::FileToAppear));
                    }
                    if !backoff.wait() {
                        return Err(never_appeared(&path));
                    }
                }
                Err(e) => return Err(RegionError::io("open (directory)", &opts.dir, e)),
            }
        };
        let hpage = dir.hugetlb_page().map_err(|e| RegionError::io("fstatfs", &opts.dir, e))?;
        let shape = Shape::of(&layout, opts, hpage)?;
        let file_len = shape.header_file_len();
        let file = loop {
            match dir.open_existing(&file_name, &trust) {
                Ok(f) => break f,
                Err(OpenFailure::Missing) => {
                    if interrupt.due() {
                        return Err(interrupted_error(&path, JoinPhase::FileToAppear));
                    }
                    if !backoff.wait() {
                        return Err(never_appeared(&path));
                    }
                }
                Err(OpenFailure::Untrusted(problem)) => return Err(dir.untrusted(&file_name, problem)),
                // With an allowed group, a creator of another user gives the
                // file its group and mode right after creating it (0600).
                Err(OpenFailure::Io(op, e))
                    if e.kind() == io::ErrorKind::PermissionDenied && opts.allow_group.is_some() =>
                {
                    if interrupt.due() {
                        return Err(interrupted_error(&path, JoinPhase::FileToAppear));
                    }
                    if !backoff.wait() {
                        return Err(RegionError::io(op, &path, e));
                    }
                }
                Err(OpenFailure::Io(op, e)) => return Err(RegionError::io(op, &path, e)),
            }
        };
        let header = Linked::of(&dir, file_name, &file)?;
        let mut shared = Shared::new(dir, header, file, opts, &shape);
        debug!(path = %shared.path.display(), rank, "opened region file");

        // Phase 2: the creator sizes it.
        loop {
            let len = shared.file.metadata().map_err(|e| RegionError::io("fstat", &shared.path, e))?.len();
            if len == file_len as u64 {
                break;
            }
            if len != 0 {
                return Err(RegionError::BadHeader {
                    path: shared.path.clone(),
                    field: "file size",
                    expected: file_len as u64,
                    found: len,
                });
            }
            if interrupt.due() {
                // Given up as on a timeout (below): this rank leaves, and
                // the creator, if it lives, removes its own data files when
                // its wait for the ranks ends.
                let e = interrupted_error(&shared.path, JoinPhase::FileToBeSized);
                shared.unlink_if_ours("join interrupted before the file was sized")?;
                return Err(e);
            }
            if !backoff.wait() {
                // The creator died between open and ftruncate (or is stuck):
                // nobody else can clean this file up reliably, so we do. No
                // data file exists yet: they are made after this size is set.
                warn!(path = %shared.path.display(), "join timed out: region file never sized");
                let e = timeout_error(&shared.path, JoinPhase::FileToBeSized, opts.timeout, None, n);
                shared.unlink_if_ours("join timed out before the file was sized")?;
                return Err(e);
            }
        }

        let map = map_existing(&shared, &shape)?;
        let mut region = Region::over_shared(map, &shape, layout, rank, shared);
        // From here on, dropping `region` on an error path abandons the
        // region and unlinks the files; for errors that say the files are
        // not ours to remove (bad header, duplicate rank) `forget_link` first.

        // Phase 3: the creator publishes READY.
        let word = loop {
            let w = region.hdr().load();
            match w.state {
                JoinState::Init => {
                    if interrupt.due() {
                        // Given up as on a timeout (below), whether or not
                        // the creator published meanwhile: abandoned, so no
                        // rank joins it any more, and every file removed.
                        let _ = region.hdr().update(|w| {
                            matches!(w.state, JoinState::Init | JoinState::Ready)
                                .then_some(JoinWord { state: JoinState::Abandoned, ..w })
                        });
                        let e = interrupted_error(region.shared_path(), JoinPhase::CreatorToInitialise);
                        if let Some(plan) = &shape.plan {
                            region.remove_unmapped_data_files(plan.files.len());
                        }
                        region.shared_mut().unlink_if_ours("join interrupted before the header was ready")?;
                        return Err(e);
                    }
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
                        if let Some(plan) = &shape.plan {
                            region.remove_unmapped_data_files(plan.files.len());
                        }
                        region.shared_mut().unlink_if_ours("join timed out before the header was ready")?;
                        return Err(e);
                    }
                }
                _ => break w,
            }
        };
        if word.state == JoinState::Abandoned {
            if let Some(plan) = &shape.plan {
                // The abandoning rank may have died before removing the
                // data files; this rank has not opened them.
                region.remove_unmapped_data_files(plan.files.len());
            }
            return Err(region.abandoned_error());
        }
        region.check_header(opts)?;
        if let Some(plan) = &shape.plan {
            region.open_data_files(plan)?;
            opts.step(ShmStep::FilesMapped);
        }

        // Phase 4: claim our rank's pid word (0 -> pid), reserve our files,
        // then set our bit. Claiming first makes a second process with the
        // same rank fail before it can touch the mask or the files, and
        // lets peers see our pid as soon as our bit is visible.
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
        if !region.shared().deferred {
            region.reserve_own()?;
        }
        let new = region.set_bit()?;
        if opts.huge_pages && region.shared().hpage.is_none() {
            region.huge_pages_advised = region.try_advise_huge_pages();
        }
        info!(path = %region.path_lossy(), rank, mapped = ?new.mapped(), "joined shared region");
        region.after_mapped(new, backoff, started)?;
        Ok(region)
    }

    /// Joiner: opens every data file, checks it against the header's table
    /// and the plan, maps it.
    fn open_data_files(&mut self, plan: &FilePlan) -> Result<()> {
        let Mapping::Pieces(pieces) = &self.map else { unreachable!("a multi-file region maps pieces") };
        let hb = self.data_offset;
        let header_dev = self.shared().header.dev;
        let header = header_name(&self.shared().path);
        let mut opened = Vec::with_capacity(plan.files.len());
        let res = (|| {
            for (k, spec) in plan.files.iter().enumerate() {
                let name = files::data_name(&header, k);
                let (dir, trust) = (&self.shared().dir, &self.shared().trust);
                let path = dir.path_of(&name);
                let file = match dir.open_existing(&name, trust) {
                    Ok(f) => f,
                    Err(OpenFailure::Missing) => {
                        if self.hdr().load().state == JoinState::Abandoned {
                            return Err(None);
                        }
                        return Err(Some(RegionError::FileMissing { path }));
                    }
                    // Not a file this rank may use: not ours to remove either.
                    Err(OpenFailure::Untrusted(problem)) => return Err(Some(dir.untrusted(&name, problem))),
                    Err(OpenFailure::Io(op, e)) => return Err(Some(RegionError::io(op, &path, e))),
                };
                let md = FileMeta::of_file(&file).map_err(|e| Some(RegionError::io("fstat", &path, e)))?;
                let want = self.hdr().file_inodes()[k].load(core::sync::atomic::Ordering::Acquire);
                let bad = if md.dev != header_dev || md.ino != want {
                    Some(("data file inode", want, md.ino))
                } else if md.size != spec.bytes.len() as u64 {
                    Some(("data file size", spec.bytes.len() as u64, md.size))
                } else {
                    None
                };
                if let Some((field, expected, found)) = bad {
                    // Not the file the creator made: not ours to remove.
                    return Err(Some(RegionError::BadHeader { path, field, expected, found }));
                }
                let link = Linked { path: path.clone(), name, dev: md.dev, ino: md.ino, linked: true };
                pieces
                    .map_file(hb + spec.bytes.start, spec.bytes.len(), &file)
                    .map_err(|e| Some(mmap_error(self.shared(), &path, e, spec.bytes.len())))?;
                let keep = self.keeps_file(spec.owner).then_some(file);
                opened.push(DataFile { link, bytes: spec.bytes.clone(), owner: spec.owner, file: keep });
            }
            Ok(())
        })();
        self.shared_mut().data = opened;
        match res {
            Ok(()) => Ok(()),
            Err(None) => Err(self.abandoned_error()),
            Err(Some(e @ (RegionError::BadHeader { .. } | RegionError::UntrustedFile { .. }))) => {
                // Nothing is written (no abandon) and nothing removed: the
                // creator times out and removes its own files.
                self.forget_link();
                Err(e)
            }
            Err(Some(e)) => Err(e),
        }
    }

    /// Joiner whose creator died before READY: removes the data files the
    /// header's table names (if the path still names that inode) and any
    /// data file not in the table yet that is empty (the creator died
    /// between creating it and recording it). Errors are logged: this is
    /// best-effort cleanup on a path that already fails.
    fn remove_unmapped_data_files(&mut self, count: usize) {
        let header_dev = self.shared().header.dev;
        let header = header_name(&self.shared().path);
        for k in 0..count {
            let name = files::data_name(&header, k);
            let (dir, trust) = (&self.shared().dir, &self.shared().trust);
            let path = dir.path_of(&name);
            let ino = self.hdr().file_inodes().get(k).map_or(0, |i| i.load(core::sync::atomic::Ordering::Acquire));
            let md = match dir.lstat(&name) {
                Ok(Some(md)) => md,
                Ok(None) => continue,
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "cannot stat a data file of an abandoned region");
                    continue;
                }
            };
            // A recorded inode is the creator's file; an unrecorded one is
            // taken for the creator's only if it is empty and a file this
            // rank would have accepted (its name alone proves nothing).
            let ours = md.dev == header_dev
                && (if ino != 0 { md.ino == ino } else { md.size == 0 && trust.check(&md).is_ok() });
            if !ours {
                continue;
            }
            match dir.unlink(&name) {
                Ok(true) => debug!(path = %path.display(), "removed a data file of an abandoned region"),
                Ok(false) => {}
                Err(e) => warn!(path = %path.display(), error = %e, "cannot remove a data file of an abandoned region"),
            }
        }
    }

    /// Reserves (`fallocate`) this rank's own data files, if it kept them
    /// open for that ([`ShmOptions::reserve`]).
    fn reserve_own(&mut self) -> Result<()> {
        let own: Vec<(usize, File, u64)> = self
            .shared_mut()
            .data
            .iter_mut()
            .enumerate()
            .filter_map(|(k, d)| d.file.take().map(|f| (k, f, d.bytes.len() as u64)))
            .collect();
        if own.is_empty() {
            return Ok(());
        }
        let opts = self.shared().opts.clone();
        opts.step(ShmStep::Reserving);
        let threads = opts.threads.unwrap_or_else(|| {
            let cores = crate::sync::thread::available_parallelism().map_or(1, |c| c.get());
            (cores / self.layout.num_ranks()).max(1)
        });
        let t = Instant::now();
        let bytes: u64 = own.iter().map(|o| o.2).sum();
        let index: Vec<usize> = own.iter().map(|o| o.0).collect();
        let res = files::reserve(own.into_iter().map(|(_, f, l)| (f, l)).collect(), threads);
        if let Err(fail) = res {
            let path = index
                .get(fail.index)
                .map(|&k| self.shared().data[k].link.path.clone())
                .unwrap_or_else(|| self.shared().path.clone());
            let e = self.reserve_error(path, fail.error, fail.unreserved);
            // Dropping the region (the caller returns this error) abandons
            // it and unlinks every file.
            return Err(e);
        }
        let secs = t.elapsed().as_secs_f64();
        info!(
            rank = self.rank,
            files = index.len(),
            bytes,
            threads,
            seconds = format_args!("{secs:.3}"),
            gbps = format_args!("{:.2}", bytes as f64 / secs.max(1e-9) / 1e9),
            "reserved this rank's data files"
        );
        opts.step(ShmStep::Reserved);
        Ok(())
    }

    /// The error of a failed `fallocate` of `path` with `needed` bytes left
    /// to reserve: [`RegionError::ShmFull`] for ENOSPC, else the I/O error.
    fn reserve_error(&self, path: PathBuf, error: io::Error, needed: u64) -> RegionError {
        let errno = error.raw_os_error();
        let no_space = errno == Some(rustix::io::Errno::NOSPC.raw_os_error());
        if let (Some(page), true) = (self.shared().hpage, no_space) {
            // hugetlbfs: the pool ran out (someone took pages after the
            // capacity check). Name the pool as it is now.
            let root = Path::new(hugetlb::SYSFS_HUGEPAGES);
            match hugetlb::Pool::read(root, page as u64) {
                Ok(pool) => {
                    warn!(path = %path.display(), needed, free = pool.available(), "huge page pool exhausted while reserving the region");
                    return pool.too_few(&self.shared().opts.dir, needed, None);
                }
                Err(e) => warn!(error = %e, "cannot read the huge page pool after ENOSPC"),
            }
        }
        if no_space {
            let available = self.shared().dir.available().unwrap_or(0);
            warn!(path = %path.display(), needed, available, "file system full while reserving the region");
            RegionError::ShmFull { path, needed, available }
        } else {
            RegionError::io("fallocate", path, error)
        }
    }

    /// Whether this rank keeps data file descriptors of `owner`'s files
    /// open past mapping them: to reserve them in `create`/`join` (its own
    /// files), or, with deferred reservation, to reserve as pages are first
    /// touched (every file its pinning touches: its own with a rank-major
    /// layout, all of them with a row-interleaved one).
    fn keeps_file(&self, owner: usize) -> bool {
        let s = self.shared();
        if !s.opts.reserve {
            return false;
        }
        owner == self.rank || (s.deferred && self.layout.order() == super::layout::Order::RowInterleaved)
    }

    /// The huge page size of the region's hugetlbfs directory (None: not
    /// hugetlbfs, or anonymous).
    pub fn hugetlb_page(&self) -> Option<usize> {
        match &self.kind {
            Kind::Shared(s) => s.hpage,
            Kind::Anonymous => None,
        }
    }

    /// Whether `create`/`join` left this rank's reservation to whoever
    /// touches the pages ([`ShmOptions::defer_reserve`]): pinning reserves
    /// what it pre-faults ([`Region::reserve_data`]); anything else must
    /// call [`Region::reserve_rest`] before touching a page.
    pub fn reservation_deferred(&self) -> bool {
        matches!(&self.kind, Kind::Shared(s) if s.deferred)
    }

    /// Reserves (`fallocate`) the pages of data-area bytes `range` in every
    /// data file this rank holds open for deferred reservation (a no-op
    /// where reservation is not deferred: the pages were reserved by
    /// `create`/`join`, or reserving is off, or there is one file). Safe to
    /// call again and from several threads at once (`fallocate` of pages
    /// already allocated allocates nothing). A file system without room is
    /// [`RegionError::ShmFull`] naming the file, the bytes of `range` in it
    /// and the space left; pages it could not reserve stay unallocated, and
    /// must not be touched.
    pub fn reserve_data(&self, range: std::ops::Range<usize>) -> Result<()> {
        let Kind::Shared(s) = &self.kind else { return Ok(()) };
        if !s.deferred || range.is_empty() {
            return Ok(());
        }
        // Data files are in data-area order, back to back.
        let first = s.data.partition_point(|d| d.bytes.end <= range.start);
        for d in &s.data[first..] {
            if d.bytes.start >= range.end {
                break;
            }
            let Some(f) = &d.file else { continue };
            let from = range.start.max(d.bytes.start);
            let to = range.end.min(d.bytes.end);
            let (off, len) = ((from - d.bytes.start) as u64, (to - from) as u64);
            match rustix::fs::fallocate(f, rustix::fs::FallocateFlags::empty(), off, len) {
                Ok(()) => {}
                // As in `files::reserve`: pages then come from faults.
                Err(e) if e == rustix::io::Errno::OPNOTSUPP => {}
                Err(e) => return Err(self.reserve_error(d.link.path.clone(), e.into(), len)),
            }
        }
        Ok(())
    }

    /// [`Region::reserve_data`] for the addresses `addr..addr + len` (they
    /// must lie in the data area: [`RegionError::RangeOutOfBounds`] otherwise).
    pub fn reserve_addr(&self, addr: usize, len: usize) -> Result<()> {
        let base = self.as_ptr() as usize;
        let in_area = addr.checked_sub(base).and_then(|s| s.checked_add(len).map(|e| (s, e)));
        match in_area {
            Some((s, e)) if e <= self.layout.data_bytes() => self.reserve_data(s..e),
            _ => {
                let start = addr.wrapping_sub(base);
                Err(RegionError::RangeOutOfBounds {
                    start,
                    end: start.wrapping_add(len),
                    limit: self.layout.data_bytes(),
                })
            }
        }
    }

    /// With deferred reservation: reserves every data file this rank holds
    /// open, whole, on the reserve threads ([`ShmOptions::threads`]), as
    /// `create`/`join` would have. The call that makes every page this
    /// rank may touch safe to touch when pinning did not reserve it (ended
    /// pageable, or never ran). [`RegionError::ShmFull`] when the file
    /// system is full. A no-op without deferred reservation.
    pub fn reserve_rest(&self) -> Result<()> {
        let Kind::Shared(s) = &self.kind else { return Ok(()) };
        if !s.deferred {
            return Ok(());
        }
        let mut own = Vec::new();
        let mut index = Vec::new();
        for (k, d) in s.data.iter().enumerate() {
            if let Some(f) = &d.file {
                let dup = f.try_clone().map_err(|e| RegionError::io("dup", &d.link.path, e))?;
                own.push((dup, d.bytes.len() as u64));
                index.push(k);
            }
        }
        if own.is_empty() {
            return Ok(());
        }
        let threads = s.opts.threads.unwrap_or_else(|| {
            let cores = crate::sync::thread::available_parallelism().map_or(1, |c| c.get());
            (cores / self.layout.num_ranks()).max(1)
        });
        files::reserve(own, threads).map_err(|fail| {
            let path = index.get(fail.index).map(|&k| s.data[k].link.path.clone()).unwrap_or_else(|| s.path.clone());
            self.reserve_error(path, fail.error, fail.unreserved)
        })
    }

    /// Sets this rank's bit (after READY); the CAS that sets the last bit
    /// moves the state to COMPLETE.
    fn set_bit(&mut self) -> Result<JoinWord> {
        let rank = self.rank;
        let bit = 1u32 << rank;
        let full = full_mask(self.layout.num_ranks());
        let res = self.hdr().update(|w| {
            (w.state == JoinState::Ready && w.mask & bit == 0).then(|| {
                let mask = w.mask | bit;
                let state = if mask == full { JoinState::Complete } else { JoinState::Ready };
                JoinWord { state, mask }
            })
        });
        match res {
            Ok((_, new)) => {
                self.shared().opts.step(ShmStep::Mapped);
                Ok(new)
            }
            Err(w) if w.state == JoinState::Abandoned => Err(self.abandoned_error()),
            Err(w) if w.mask & bit != 0 => {
                self.forget_link();
                Err(RegionError::RankAlreadyMapped { path: self.shared_path().to_path_buf(), rank })
            }
            Err(w) => {
                self.forget_link();
                Err(RegionError::BadHeader {
                    path: self.shared_path().to_path_buf(),
                    field: "join state",
                    expected: JoinWord { state: JoinState::Ready, mask: w.mask }.encode(),
                    found: w.encode(),
                })
            }
        }
    }

    /// Waits until every rank has mapped the region, then unlinks the files
    /// (a no-op for anonymous regions and once done). On timeout the region
    /// is abandoned, the files unlinked and [`RegionError::JoinTimeout`]
    /// returned; if another rank abandoned it, [`RegionError::Abandoned`].
    pub fn wait_all_mapped(&mut self, timeout: Duration) -> Result<()> {
        if !matches!(self.kind, Kind::Shared(_)) {
            return Ok(());
        }
        self.wait_all(Backoff::new(timeout), timeout)
    }

    /// Abandons the region if some rank has not mapped it yet (so none can
    /// join any more) and unlinks every file that still names this region.
    /// Returns whether this call removed a file. Ranks that have mapped the
    /// region keep using the memory. A no-op for anonymous regions.
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

    /// The paths of the region's files: the header file, then the data
    /// files (empty for an anonymous region). They may already be unlinked.
    pub fn file_paths(&self) -> Vec<PathBuf> {
        match &self.kind {
            Kind::Shared(s) => {
                std::iter::once(s.path.clone()).chain(s.data.iter().map(|d| d.link.path.clone())).collect()
            }
            Kind::Anonymous => Vec::new(),
        }
    }

    /// Data-area byte ranges of the region's data files and the rank that
    /// owns each, in data-area order (empty with one file or anonymous).
    pub(crate) fn data_files(&self) -> Vec<(std::ops::Range<usize>, usize)> {
        match &self.kind {
            Kind::Shared(s) => s.data.iter().map(|d| (d.bytes.clone(), d.owner)).collect(),
            Kind::Anonymous => Vec::new(),
        }
    }

    // ---- internals ----

    /// The creator's last steps: publish READY (with its bit when it has
    /// nothing to reserve), reserve its files and set its bit, then wait.
    fn publish_ready(&mut self, started: Instant) -> Result<()> {
        let n = self.layout.num_ranks();
        let bit = 1u32 << self.rank;
        let timeout = self.shared().timeout;
        let reserve_first = !self.shared().deferred && self.shared().data.iter().any(|d| d.file.is_some());
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
            order: self.layout.order().code(),
            num_files: self.shared().data.len() as u64,
            file_bytes: self.file_bytes() as u64,
        };
        let hdr = self.hdr();
        hdr.write_fields(&fields);
        // Cross-process header word (core atomics, see `header`); published
        // by the release CAS below.
        hdr.rank_pids()[self.rank].store(std::process::id(), core::sync::atomic::Ordering::Relaxed);
        let full = full_mask(n);
        let mask = if reserve_first { 0 } else { bit };
        let published = hdr.update(|w| {
            (w.state == JoinState::Init)
                .then_some(JoinWord { state: if mask == full { JoinState::Complete } else { JoinState::Ready }, mask })
        });
        let new = match published {
            Ok((_, new)) => new,
            // A joiner timed out waiting for us and abandoned the region.
            Err(_) => return Err(self.abandoned_error()),
        };
        self.shared().opts.step(ShmStep::Ready);
        let new = if reserve_first {
            self.reserve_own()?;
            self.set_bit()?
        } else {
            self.shared().opts.step(ShmStep::Mapped);
            new
        };
        self.after_mapped(new, Backoff::new(timeout.saturating_sub(started.elapsed())), started)
    }

    /// Bytes of a full data file (0 with one file).
    fn file_bytes(&self) -> usize {
        match &self.kind {
            Kind::Shared(s) if s.multi => {
                files::plan(&self.layout, s.opts.files).ok().flatten().map_or(0, |p| p.file_bytes)
            }
            _ => 0,
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
        let mut interrupt = self.shared().opts.interrupt_check();
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
            if interrupt.due() {
                // Given up as on a timeout (below), even if the last rank
                // arrived meanwhile (the caller is told it was interrupted,
                // whatever the region did): abandoned unless complete, and
                // every file removed.
                let old = self
                    .hdr()
                    .update(|w| (w.state == JoinState::Ready).then_some(JoinWord { state: JoinState::Abandoned, ..w }));
                if let Err(w) = old {
                    if !matches!(w.state, JoinState::Complete | JoinState::Abandoned) {
                        // Overwritten, as below: leave the files alone.
                        self.forget_link();
                    }
                }
                let e = interrupted_error(self.shared_path(), JoinPhase::RanksToMap);
                self.shared_mut().unlink_if_ours("interrupted waiting for ranks")?;
                return Err(e);
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
                        // the header was overwritten. Leave the files alone.
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
        let (num_files, file_bytes) = match files::plan(&self.layout, opts.files)? {
            Some(p) => (p.files.len() as u64, p.file_bytes as u64),
            None => (0, 0),
        };
        let expect: [(&'static str, u64, u64); 11] = [
            ("magic", MAGIC, f.magic),
            ("version", VERSION as u64, f.version as u64),
            ("header_bytes", self.data_offset as u64, f.header_bytes as u64),
            ("total_bytes", self.map.len() as u64, f.total_bytes),
            ("num_ranks", self.layout.num_ranks() as u64, f.num_ranks as u64),
            ("chunk_bytes", self.layout.chunk_bytes() as u64, f.chunk_bytes),
            ("num_rows", self.layout.num_rows() as u64, f.num_rows),
            ("order", self.layout.order().code(), f.order),
            ("num_files", num_files, f.num_files),
            ("file_bytes", file_bytes, f.file_bytes),
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
        // SAFETY: shared regions map header_bytes (= data_offset, >=
        // size_of::<Header>(), whole pages) from a page-aligned base, and
        // the mapping lives as long as `self`, which the returned handle
        // borrows.
        unsafe { Hdr::from_base(base, self.data_offset) }
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

    /// Marks the files as not ours to remove (they do not match what we
    /// expect), so dropping the region leaves them alone.
    fn forget_link(&mut self) {
        if let Kind::Shared(s) = &mut self.kind {
            s.forget();
        }
    }

    /// Drop path for shared regions: abandon if incomplete, then unlink.
    pub(crate) fn drop_shared(&mut self) {
        if !self.shared().linked() {
            return;
        }
        if let Err(e) = self.unlink_now() {
            warn!(error = %e, "could not unlink region files on drop");
        }
    }
}

/// The header file's name (the last component of a [`shm_path`]).
fn header_name(path: &Path) -> OsString {
    path.file_name().expect("shm_path always ends in the file name").to_owned()
}

/// Bytes rank `rank` brings into memory itself: its own data files (it
/// reserves them), or its share of a one-file region.
fn rank_bytes(layout: &Layout, plan: Option<&FilePlan>, rank: usize) -> u64 {
    match plan {
        Some(p) => p.files.iter().filter(|f| f.owner == rank).map(|f| f.bytes.len() as u64).sum(),
        None => layout.bytes_per_rank() as u64,
    }
}

/// `openat(dir, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC)`
/// with the options' group and mode, removing a stale file (or link: the
/// name, never its target) first if `force`.
fn open_exclusive(dir: &RegionDir, name: &OsStr, opts: &ShmOptions) -> Result<File> {
    let path = dir.path_of(name);
    let path = path.as_path();
    let open = || dir.create_new(name, opts.file_mode(), opts.allow_group);
    match open() {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            if !opts.force {
                warn!(path = %path.display(), "region file already exists (stale file from a crashed run?)");
                return Err(RegionError::AlreadyExists { path: path.to_path_buf() });
            }
            warn!(path = %path.display(), "force: removing existing region file");
            dir.unlink(name).map_err(|e| RegionError::io("unlink", path, e))?;
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

/// The error of a failed shared `mmap` of `len` bytes of `path`: on
/// hugetlbfs ENOMEM means the pool cannot back the mapping (a shared
/// hugetlb mapping reserves its pages when it is made, so no later fault
/// can find the pool empty), [`RegionError::HugePagesTooFew`]; otherwise
/// the I/O error.
fn mmap_error(shared: &Shared, path: &Path, e: io::Error, len: usize) -> RegionError {
    if let (Some(page), Some(libc::ENOMEM)) = (shared.hpage, e.raw_os_error()) {
        if let Ok(pool) = hugetlb::Pool::read(Path::new(hugetlb::SYSFS_HUGEPAGES), page as u64) {
            return pool.too_few(&shared.opts.dir, len as u64, None);
        }
    }
    RegionError::io("mmap", path, e)
}

/// Sizes and maps a freshly created header file: the whole region with one
/// file, the header into a reservation for the data files otherwise.
fn size_and_map(shared: &Shared, shape: &Shape) -> Result<Mapping> {
    shared.file.set_len(shape.header_file_len() as u64).map_err(|e| RegionError::io("ftruncate", &shared.path, e))?;
    map_existing(shared, shape)
}

/// Maps a sized header file (and reserves the data area behind it).
fn map_existing(shared: &Shared, shape: &Shape) -> Result<Mapping> {
    if shape.plan.is_none() {
        let map: MmapRaw = MmapOptions::new()
            .len(shape.total)
            .map_raw(&shared.file)
            .map_err(|e| mmap_error(shared, &shared.path, e, shape.total))?;
        return Ok(Mapping::Raw(map));
    }
    let data = shape.total - shape.header_bytes;
    let align = hugetlb::data_align(shape.hpage);
    let pieces = Pieces::reserve_aligned(shape.header_bytes, data, align)
        .map_err(|e| RegionError::io("mmap (reserve)", &shared.path, e))?;
    pieces
        .map_file(0, shape.header_bytes, &shared.file)
        .map_err(|e| mmap_error(shared, &shared.path, e, shape.header_bytes))?;
    Ok(Mapping::Pieces(pieces))
}

impl Region {
    /// A shared region over `map` (header first, data after it), before
    /// any rank bit is set: what `create` and `join` build alike.
    fn over_shared(map: Mapping, shape: &Shape, layout: Layout, rank: usize, shared: Shared) -> Region {
        Region {
            map,
            data_offset: shape.header_bytes,
            layout,
            rank,
            huge_pages_advised: false,
            kind: Kind::Shared(Box::new(shared)),
        }
    }

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

    /// `madvise(MADV_HUGEPAGE)` on the data area.
    pub(crate) fn advise_data_huge(&self) -> io::Result<()> {
        self.map.advise_huge(self.data_offset, self.layout.data_bytes())
    }
}

impl FileSplit {
    /// In words, for reports: `one file` or `data files of at most 256 MiB`.
    pub fn describe(&self) -> String {
        match self {
            FileSplit::Single => "one file".into(),
            FileSplit::Multi { max_file_bytes } => {
                format!("data files of at most {}", crate::units::fmt_bytes(*max_file_bytes))
            }
        }
    }
}
