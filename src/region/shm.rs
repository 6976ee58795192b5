//! The node-shared region: files under /dev/shm mapped by every rank.
//!
//! This file is the rank handshake: the create/join protocol over the
//! header words, the waits for the ranks, the unlink once every rank has
//! mapped, and what a rank does when another died. The files and their
//! mappings (the data files, their reservation, deferred or not, and the
//! address range they are mapped into back to back) are in `shm_files.rs`.
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
//! - the creator dies after `Ready`: a rank that reaches the header after
//!   that finds the creator's pid gone and refuses the region at once
//!   ([`RegionError::CreatorDied`]), abandons it and removes every file
//!   (the ranks already waiting then see `Abandoned`); it does not join a
//!   region whose agreement could only fail later.
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

use std::io;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::error::{JoinPhase, RegionError};
use super::files::{self, FilePlan};
use super::header::{full_mask, Fields, Hdr, JoinState, JoinWord, MAGIC, PERSISTENT_MAGIC, VERSION};
use super::hugetlb;
use super::layout::Layout;
use super::limits;
use super::options::{ShmOptions, ShmStep};
use super::shm_files::{header_name, map_existing, open_exclusive, size_and_map, Linked, Shape, Shared};
use super::sys::Backoff;
use super::trust::{self, OpenFailure, RegionDir, Trust};
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
    if let Some(reason) = name_problem(name) {
        return Err(RegionError::BadName { name: name.to_string(), reason });
    }
    Ok(dir.join(format!("{SHM_PREFIX}{name}")))
}

/// What is wrong with `name` as a region's (or a pool's) file name, if
/// anything: empty, longer than [`MAX_NAME_LEN`] bytes, or holding `/` or
/// NUL. [`shm_path`] and the pool's names share this rule.
pub(crate) fn name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("empty")
    } else if name.len() > MAX_NAME_LEN {
        Some("longer than 200 bytes")
    } else if name.contains('/') || name.contains('\0') {
        Some("contains '/' or NUL")
    } else {
        None
    }
}

/// The creator's capacity checks, before any file exists: the huge page
/// pool on hugetlbfs, else the file system's free space
/// ([`RegionError::ShmTooSmall`]) and, with [`ShmOptions::check_memory`],
/// the memory this process can get, for the whole region of `total` bytes.
pub(super) fn check_capacity(dir: &RegionDir, opts: &ShmOptions, hpage: Option<usize>, total: usize) -> Result<()> {
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
    Ok(())
}

pub(super) fn interrupted_error(path: &Path, phase: JoinPhase) -> RegionError {
    info!(path = %path.display(), %phase, "wait interrupted; giving the region up");
    RegionError::Interrupted { path: path.to_path_buf(), phase }
}

pub(super) fn timeout_error(
    path: &Path,
    phase: JoinPhase,
    timeout: Duration,
    w: Option<JoinWord>,
    n: usize,
) -> RegionError {
    let (mapped, missing) = match w {
        Some(w) => (w.mapped(), w.missing(n)),
        None => (Vec::new(), (0..n).collect()),
    };
    RegionError::JoinTimeout { path: path.to_path_buf(), phase, timeout, mapped, missing }
}

impl Region {
    /// Creates the node-shared region `name` (header file
    /// `dir/kvoffload-<name>`, data files `dir/kvoffload-<name>.<k>` unless
    /// [`FileSplit::Single`](super::FileSplit::Single)) as rank `rank` of
    /// `layout.num_ranks()`.
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
        check_capacity(&dir, opts, hpage, total)?;

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
                JoinState::Init if region.hdr().read_fields().magic == PERSISTENT_MAGIC => {
                    // A persistent region being made (its creator writes
                    // every field before any data file; read before
                    // `Ready`, a write in progress reads as some other
                    // value, never as the whole magic): not a launch's
                    // region; refused at once and left alone (a timeout
                    // here would abandon and remove a live creator's files).
                    region.forget_link();
                    return Err(RegionError::BadHeader {
                        path: region.shared_path().to_path_buf(),
                        field: "magic",
                        expected: MAGIC,
                        found: PERSISTENT_MAGIC,
                    });
                }
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
        let (creator_pid, creator_pidns) = {
            let f = region.hdr().read_fields();
            (f.creator_pid, f.creator_pidns)
        };
        if creator_known_gone(creator_pid, creator_pidns, own_pid_namespace()) {
            // A region whose creator is gone is stale: refused, abandoned
            // (its surviving ranks fail fast instead of waiting for a rank
            // that will never come) and removed, files of ours that nobody
            // can finish: the data files here, the header file by the drop.
            let _ = region.hdr().update(|w| {
                matches!(w.state, JoinState::Init | JoinState::Ready)
                    .then_some(JoinWord { state: JoinState::Abandoned, ..w })
            });
            if let Some(plan) = &shape.plan {
                region.remove_unmapped_data_files(plan.files.len());
            }
            warn!(path = %region.path_lossy(), creator_pid, "refusing a region whose creator is gone");
            return Err(RegionError::CreatorDied { path: region.shared_path().to_path_buf(), pid: creator_pid });
        }
        if let Some(plan) = &shape.plan {
            region.open_data_files(plan)?;
            opts.step(ShmStep::FilesMapped);
        }

        // Phase 4: claim our rank's pid word (0 -> pid), reserve our files,
        // then set our bit. Claiming first makes a second process with the
        // same rank fail before it can touch the mask or the files, and
        // lets peers see our pid as soon as our bit is visible.
        // The join state is checked before the pid word is claimed, so a
        // join refused here leaves no mark in the header (a claimed pid word
        // would make the real rank fail later with `RankAlreadyMapped`).
        region.check_joinable()?;
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
        let new = match region.set_bit() {
            Ok(new) => new,
            Err(e) => {
                // The state changed since `check_joinable` (abandoned, or
                // overwritten): give the pid word back (0 again, only if it
                // is still ours), so this refused join leaves no mark.
                let _ = region.hdr().rank_pids()[rank].compare_exchange(
                    pid,
                    0,
                    core::sync::atomic::Ordering::AcqRel,
                    core::sync::atomic::Ordering::Acquire,
                );
                return Err(e);
            }
        };
        if opts.huge_pages && region.shared().hpage.is_none() {
            region.huge_pages_advised = region.try_advise_huge_pages();
        }
        info!(path = %region.path_lossy(), rank, mapped = ?new.mapped(), "joined shared region");
        region.after_mapped(new, backoff, started)?;
        Ok(region)
    }

    /// Refuses, before this rank claims anything in the header, a join
    /// word it could not set its bit in: a state other than `Ready`
    /// ([`RegionError::BadHeader`], the files left alone; `Abandoned` is
    /// [`RegionError::Abandoned`]) or its bit already set
    /// ([`RegionError::RankAlreadyMapped`]).
    fn check_joinable(&mut self) -> Result<()> {
        let w = self.hdr().load();
        let bit = 1u32 << self.rank;
        match w.state {
            JoinState::Ready if w.mask & bit == 0 => Ok(()),
            JoinState::Abandoned => Err(self.abandoned_error()),
            JoinState::Ready => {
                self.forget_link();
                Err(RegionError::RankAlreadyMapped { path: self.shared_path().to_path_buf(), rank: self.rank })
            }
            _ => Err(self.not_ready(w)),
        }
    }

    /// The join word `w` is neither READY nor one this rank can explain:
    /// forgets the link and names the word found.
    fn not_ready(&mut self, w: JoinWord) -> RegionError {
        self.forget_link();
        RegionError::BadHeader {
            path: self.shared_path().to_path_buf(),
            field: "join state",
            expected: JoinWord { state: JoinState::Ready, mask: w.mask }.encode(),
            found: w.encode(),
        }
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
            Err(w) => Err(self.not_ready(w)),
        }
    }

    /// Waits until every rank has mapped the region, then unlinks the files
    /// (a no-op for anonymous regions and once done). On timeout the region
    /// is abandoned, the files unlinked and [`RegionError::JoinTimeout`]
    /// returned; if another rank abandoned it, [`RegionError::Abandoned`].
    /// A no-op for a persistent region ([`Region::open_persistent`]: no
    /// rank waits for another, and its files stay).
    pub fn wait_all_mapped(&mut self, timeout: Duration) -> Result<()> {
        if !matches!(self.kind, Kind::Shared(_)) || self.persistent_origin().is_some() {
            return Ok(());
        }
        self.wait_all(Backoff::new(timeout), timeout)
    }

    /// Abandons the region if some rank has not mapped it yet (so none can
    /// join any more) and unlinks every file that still names this region.
    /// Returns whether this call removed a file. Ranks that have mapped the
    /// region keep using the memory. A no-op for anonymous regions and for
    /// a published persistent region (its files outlive every process;
    /// [`Region::remove_persistent`] removes them).
    pub fn unlink_now(&mut self) -> Result<bool> {
        if !matches!(self.kind, Kind::Shared(_)) || self.shared().keeps_files() {
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

    /// Ranks that have mapped the region (all of them for an anonymous one;
    /// none recorded for a persistent one, whose ranks set no bit).
    pub fn mapped_ranks(&self) -> Vec<usize> {
        match self.kind {
            Kind::Shared(_) => self.hdr().load().mapped(),
            Kind::Anonymous => (0..self.layout.num_ranks()).collect(),
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
            creator_pidns: own_pid_namespace().unwrap_or(0),
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
    pub(super) fn abandoned_error(&mut self) -> RegionError {
        let mapped = self.hdr().load().mapped();
        if let Err(e) = self.shared_mut().unlink_if_ours("region abandoned") {
            warn!(error = %e, "could not unlink abandoned region file");
        }
        let by =
            super::error::AbandonNote::decode(self.hdr().abandon_note().load(core::sync::atomic::Ordering::Acquire));
        RegionError::Abandoned { path: self.shared_path().to_path_buf(), mapped, by }
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
        // The creator's rank is one of the region's ranks.
        let ranks = self.layout.num_ranks() as u64;
        if f.creator_rank as u64 >= ranks {
            self.forget_link();
            return Err(RegionError::HeaderOutOfRange {
                path: self.shared_path().to_path_buf(),
                field: "creator_rank",
                found: f.creator_rank as u64,
                limit: ranks,
            });
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

    /// Drop path for shared regions: abandon if incomplete, then unlink
    /// (never a published persistent region's files).
    pub(crate) fn drop_shared(&mut self) {
        if !self.shared().linked() || self.shared().keeps_files() {
            return;
        }
        if let Err(e) = self.unlink_now() {
            warn!(error = %e, "could not unlink region files on drop");
        }
    }
}

/// This process's pid namespace: the inode of `/proc/self/ns/pid` (a link
/// the kernel makes, to the namespace's nsfs inode); `None` without /proc.
pub(crate) fn own_pid_namespace() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// Whether the region's creator (`pid` in pid namespace `pidns`, 0 when its
/// header does not say) is known to be gone, seen from a joiner in pid
/// namespace `mine`. A pid means something only in its own namespace, and
/// ranks in two containers that share `/dev/shm` have two: then, or when
/// this process cannot read its own namespace, nothing is known (logged)
/// and the join goes on, its timeouts bounding a creator that is in fact
/// gone.
pub(crate) fn creator_known_gone(pid: u32, pidns: u64, mine: Option<u64>) -> bool {
    if pidns != 0 && mine != Some(pidns) {
        tracing::debug!(
            pid,
            creator_pidns = pidns,
            own_pidns = ?mine,
            "the region's creator is in another pid namespace: its liveness is not checked by pid"
        );
        return false;
    }
    process_gone(pid)
}

/// Whether process `pid` is known to be gone: 0 (no process records it)
/// or `kill(pid, 0)` failing with `ESRCH` (`EPERM` means it exists under
/// another user). Only for a pid of this process's pid namespace
/// ([`creator_known_gone`]).
pub(crate) fn process_gone(pid: u32) -> bool {
    match i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) {
        Some(p) => matches!(rustix::process::test_kill_process(p), Err(rustix::io::Errno::SRCH)),
        None => true,
    }
}

/// Bytes rank `rank` brings into memory itself: its own data files (it
/// reserves them), or its share of a one-file region.
pub(super) fn rank_bytes(layout: &Layout, plan: Option<&FilePlan>, rank: usize) -> u64 {
    match plan {
        Some(p) => p.files.iter().filter(|f| f.owner == rank).map(|f| f.bytes.len() as u64).sum(),
        None => layout.bytes_per_rank() as u64,
    }
}

#[cfg(test)]
mod pid_namespace_tests {
    use super::*;

    /// A pid that was a process and is gone (reaped).
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    fn a_dead_creator_is_known_gone_only_in_our_pid_namespace() {
        let dead = dead_pid();
        let mine = own_pid_namespace();
        assert!(mine.is_some(), "this test needs /proc");
        // Ours, or a header that does not say (0): judged by pid.
        assert!(creator_known_gone(dead, mine.unwrap(), mine));
        assert!(creator_known_gone(dead, 0, mine));
        assert!(!creator_known_gone(std::process::id(), mine.unwrap(), mine));
        // Another namespace, or ours unknown: nothing known, not gone.
        assert!(!creator_known_gone(dead, mine.unwrap() ^ 1, mine));
        assert!(!creator_known_gone(dead, mine.unwrap(), None));
    }
}
