//! The files and mappings of a node-shared region: the header file and
//! the data files it names, how they are opened, reserved and mapped back
//! to back; the rank handshake over the header words is in `shm.rs`
//! ([`super::shm`]).
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
//! the reservation, so the cases of "Kill safety" ([`super::shm`]) cover
//! every kill point up to
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

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};
use tracing::{debug, info, warn};

use super::error::RegionError;
use super::files::{self, FilePlan};
use super::header::{JoinState, JoinWord, HUGE_HEADER_BYTES, MIN_HEADER_BYTES};
use super::hugetlb;
use super::layout::Layout;
use super::mapping::{Mapping, Pieces};
use super::options::{FileSplit, ShmOptions, ShmStep};
use super::sys;
use super::trust::{FileMeta, OpenFailure, RegionDir, Trust};
use super::{Kind, Region};

type Result<T> = std::result::Result<T, RegionError>;

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
pub(super) struct Shape {
    pub(super) plan: Option<FilePlan>,
    pub(super) header_bytes: usize,
    /// Header plus data.
    pub(super) total: usize,
    /// The hugetlbfs page size, when the directory is on hugetlbfs.
    pub(super) hpage: Option<usize>,
}

impl Shape {
    /// The shape in a directory on a file system whose hugetlbfs page is
    /// `hpage` (None: not hugetlbfs). On hugetlbfs the header takes whole
    /// huge pages and every file must be whole huge pages
    /// ([`RegionError::HugePageMisfit`]).
    pub(super) fn of(layout: &Layout, opts: &ShmOptions, hpage: Option<usize>) -> Result<Shape> {
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
    pub(super) fn header_file_len(&self) -> usize {
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
pub(super) struct Linked {
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
    /// The name in the region's directory.
    pub(super) fn name(&self) -> &OsStr {
        &self.name
    }

    /// Device and inode numbers of the file it named when opened.
    pub(super) fn inode(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }

    /// The inode `file` (opened as `name` in `dir`) is, from `fstat`.
    pub(super) fn of(dir: &RegionDir, name: OsString, file: &File) -> Result<Linked> {
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
pub(super) struct DataFile {
    link: Linked,
    /// Its bytes of the data area.
    bytes: std::ops::Range<usize>,
    owner: usize,
    /// Kept open until this rank has reserved it (own files only); with
    /// [`ShmOptions::defer_reserve`], kept for the region's life (every file
    /// this rank's pinning touches) so that pages are reserved as they are
    /// first touched ([`Region::reserve_data`]).
    pub(super) file: Option<File>,
}

/// The shared-file side of a [`Region`].
#[derive(Debug)]
pub(crate) struct Shared {
    /// The header file's path (the region's name).
    pub(crate) path: PathBuf,
    /// The region's directory: every file is reached through it by name.
    pub(super) dir: RegionDir,
    /// Which files this rank accepts ([`trust`]).
    pub(super) trust: Trust,
    /// The header file, kept open for the life of the region (fstat, mmap).
    pub(super) file: File,
    pub(super) header: Linked,
    /// Data files in data-area order (empty with one file).
    pub(super) data: Vec<DataFile>,
    /// Whether the plan has data files.
    multi: bool,
    /// Reservation left to whoever touches the pages
    /// ([`ShmOptions::defer_reserve`], multi-file with reserving on).
    pub(super) deferred: bool,
    /// The hugetlbfs page size when the directory is on hugetlbfs.
    pub(super) hpage: Option<usize>,
    pub(crate) timeout: Duration,
    pub(super) session: u64,
    pub(super) wait_for_all: bool,
    pub(super) opts: ShmOptions,
    /// A persistent region ([`super::persistent`]): how this process got
    /// it, and whether it is published (`Ready`: never unlinked by this
    /// process from then on). None for a create/join region.
    pub(super) persistent: Option<super::persistent::Persist>,
}

impl Shared {
    pub(super) fn new(dir: RegionDir, header: Linked, file: File, opts: &ShmOptions, shape: &Shape) -> Self {
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
            persistent: None,
        }
    }

    /// Whether this process must never unlink the region's files: a
    /// persistent region once published ([`super::persistent`]).
    pub(crate) fn keeps_files(&self) -> bool {
        self.persistent.is_some_and(|p| p.published)
    }

    /// Whether this rank still believes some file of the region is linked.
    pub(crate) fn linked(&self) -> bool {
        self.header.linked || self.data.iter().any(|d| d.link.linked)
    }

    /// Unlinks every file of the region whose path still names the inode
    /// this rank knows: data files first, the header file last (so a file
    /// left by a rank dying midway always has its header beside it).
    /// Returns whether this call removed any. Tries every file even after
    /// an error, and returns the first error. Never for a published
    /// persistent region (a no-op: its files outlive this process).
    pub(crate) fn unlink_if_ours(&mut self, why: &str) -> Result<bool> {
        if self.keeps_files() {
            debug!(path = %self.path.display(), why, "persistent region: its files stay");
            return Ok(false);
        }
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

impl Region {
    /// Creator: creates, records, sizes and maps every data file.
    pub(super) fn create_data_files(&mut self, plan: &FilePlan, opts: &ShmOptions) -> Result<()> {
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
    /// Joiner: opens every data file, checks it against the header's table
    /// and the plan, maps it.
    pub(super) fn open_data_files(&mut self, plan: &FilePlan) -> Result<()> {
        let Mapping::Pieces(pieces) = &self.map else { unreachable!("a multi-file region maps pieces") };
        let hb = self.data_offset;
        let header_dev = self.shared().header.dev;
        let header = header_name(&self.shared().path);
        let mut opened = Vec::with_capacity(plan.files.len());
        // The data file refused, if one was (the region is then abandoned).
        let mut refused = None;
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
                    Err(OpenFailure::Untrusted(problem)) => {
                        refused = Some(k);
                        return Err(Some(dir.untrusted(&name, problem)));
                    }
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
                    refused = Some(k);
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
            // A persistent region is never abandoned by an opener: it is
            // published for good, and only `remove_persistent` takes it
            // apart; the refused file is reported and left as it is.
            Err(Some(e @ (RegionError::BadHeader { .. } | RegionError::UntrustedFile { .. })))
                if self.shared().persistent.is_some() =>
            {
                self.forget_link();
                Err(e)
            }
            Err(Some(e @ (RegionError::BadHeader { .. } | RegionError::UntrustedFile { .. }))) => {
                // The header is this launch's (checked), one of its data
                // files is not usable: no rank can complete the region.
                // Abandon it with a note of why, so the creator and the
                // ranks waiting fail at once with the reason instead of at
                // their timeout; remove nothing here (the refused file is
                // not ours to remove; each rank removes its own files when
                // it sees the region abandoned, by inode).
                if let Some(file) = refused {
                    let note = super::error::AbandonNote {
                        rank: self.rank,
                        reason: super::error::AbandonReason::RefusedDataFile { file },
                    };
                    let _ = self.hdr().abandon_note().compare_exchange(
                        0,
                        note.encode(),
                        core::sync::atomic::Ordering::AcqRel,
                        core::sync::atomic::Ordering::Acquire,
                    );
                    let _ = self.hdr().update(|w| {
                        (w.state == JoinState::Ready).then_some(JoinWord { state: JoinState::Abandoned, ..w })
                    });
                }
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
    pub(super) fn remove_unmapped_data_files(&mut self, count: usize) {
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
    pub(super) fn reserve_own(&mut self) -> Result<()> {
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

    /// Bytes of this rank's own share (its data files, or its share of a
    /// one-file region) that the file system has not allocated yet
    /// (`st_size - st_blocks * 512`, each file's): what reserving or
    /// faulting it still brings into memory.
    pub(super) fn unallocated_own_bytes(&self) -> Result<u64> {
        let s = self.shared();
        let left = |m: FileMeta| m.size.saturating_sub(m.allocated);
        if !s.multi {
            let m = FileMeta::of_file(&s.file).map_err(|e| RegionError::io("fstat", &s.path, e))?;
            return Ok(left(m).min(self.layout.bytes_per_rank() as u64));
        }
        let mut sum = 0u64;
        for d in s.data.iter().filter(|d| d.owner == self.rank) {
            let m = match &d.file {
                Some(f) => FileMeta::of_file(f).map_err(|e| RegionError::io("fstat", &d.link.path, e))?,
                None => match s.dir.lstat(&d.link.name).map_err(|e| RegionError::io("stat", &d.link.path, e))? {
                    Some(m) => m,
                    None => return Err(RegionError::FileMissing { path: d.link.path.clone() }),
                },
            };
            sum = sum.saturating_add(left(m));
        }
        Ok(sum)
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

    /// Bytes of a full data file (0 with one file).
    pub(super) fn file_bytes(&self) -> usize {
        match &self.kind {
            Kind::Shared(s) if s.multi => {
                files::plan(&self.layout, s.opts.files).ok().flatten().map_or(0, |p| p.file_bytes)
            }
            _ => 0,
        }
    }

    pub(super) fn shared(&self) -> &Shared {
        match &self.kind {
            Kind::Shared(s) => s,
            Kind::Anonymous => unreachable!("shared-region method on an anonymous region"),
        }
    }

    pub(super) fn shared_mut(&mut self) -> &mut Shared {
        match &mut self.kind {
            Kind::Shared(s) => s,
            Kind::Anonymous => unreachable!("shared-region method on an anonymous region"),
        }
    }

    pub(super) fn shared_path(&self) -> &Path {
        &self.shared().path
    }

    pub(super) fn path_lossy(&self) -> String {
        self.shared().path.display().to_string()
    }

    /// Marks the files as not ours to remove (they do not match what we
    /// expect), so dropping the region leaves them alone.
    pub(super) fn forget_link(&mut self) {
        if let Kind::Shared(s) = &mut self.kind {
            s.forget();
        }
    }
}

/// The header file's name (the last component of a [`shm_path`]).
pub(super) fn header_name(path: &Path) -> OsString {
    path.file_name().expect("shm_path always ends in the file name").to_owned()
}

/// `openat(dir, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC)`
/// with the options' group and mode, removing a stale file (or link: the
/// name, never its target) first if `force`.
pub(super) fn open_exclusive(dir: &RegionDir, name: &OsStr, opts: &ShmOptions) -> Result<File> {
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
pub(super) fn size_and_map(shared: &Shared, shape: &Shape) -> Result<Mapping> {
    shared.file.set_len(shape.header_file_len() as u64).map_err(|e| RegionError::io("ftruncate", &shared.path, e))?;
    map_existing(shared, shape)
}

/// Maps a sized header file (and reserves the data area behind it).
pub(super) fn map_existing(shared: &Shared, shape: &Shape) -> Result<Mapping> {
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
    pub(super) fn over_shared(map: Mapping, shape: &Shape, layout: Layout, rank: usize, shared: Shared) -> Region {
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
