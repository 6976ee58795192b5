//! Persistent regions: a node-shared region that outlives every process
//! that maps it, for the node pool's rows (docs/node-pool-design.md 2.1
//! and 6). Engines started later open and map it again; its pages are
//! still in tmpfs, so nothing is faulted anew.
//!
//! # Why an entry point of its own
//!
//! [`Region::open_persistent`], not an option of `create`/`join`: those two
//! are a handshake of the ranks of one launch (one creator, the others
//! join, every rank sets its bit, the files go at `Complete`), and almost
//! every step of it is wrong for a region that engines of many launches
//! map at different times: there is no creator decided in advance (the
//! first process to come creates, whatever its rank), no rank waits for
//! another, no bit or pid word is claimed (two engines each have a rank
//! 0), and nothing is ever unlinked by the library. A flag would have
//! left each of those steps with two meanings; one call with one meaning
//! (create-or-open) is simpler to read and to check. The files, their
//! trust checks, the header layout, the data files, their reservation and
//! mapping are the same code as `create`/`join` (`shm_files.rs`).
//!
//! # Protocol
//!
//! A persistent region's header has its own magic ([`PERSISTENT_MAGIC`]),
//! so neither kind opens the other. Its `join` word is `Init` while it is
//! being made, `Ready` once it is (for good), `Abandoned` while a half-made
//! or removed one is being taken apart; the mask is unused.
//!
//! Creating (no header file under the name):
//! 1. the capacity checks of `create` (file system, memory, huge pages);
//! 2. the header file with `O_CREAT | O_EXCL | O_NOFOLLOW` (a process that
//!    loses this race opens the winner's region instead);
//! 3. `flock(LOCK_EX | LOCK_NB)` on it, held until `Ready`: the lock is how
//!    an opener tells a live creator from a dead one (the kernel drops it
//!    when the process dies, whatever its pid namespace, and a pid can be
//!    reused; only this user can open the file to lock it). If the lock is
//!    taken, or the name no longer names the file once it is held, a
//!    cleaner judged the fresh file dead and removes it: start over;
//! 4. size and map the header, write every field (magic included) at
//!    once: a half-made region says it is one before any data file exists;
//! 5. each data file as `create` makes it (inode recorded before sizing);
//! 6. publish `Ready` (release CAS `Init -> Ready`), then drop the lock;
//! 7. reserve this rank's own data files (unless deferred), as any opener
//!    does: the other ranks of its engine, waiting for `Ready`, reserve
//!    theirs at the same time (as with `create`, which also publishes
//!    before reserving). A reservation that fails ([`RegionError::ShmFull`])
//!    fails this call and leaves the region whole; the next opener of
//!    this rank reserves again.
//!
//! Any failure before 6 takes the files apart as `create` does (abandon,
//! then unlink what this process made, by inode); from 6 on the files are
//! never unlinked by this process: not on drop, not by
//! [`Region::unlink_now`].
//!
//! Opening (a header file found): open it with the trust checks of `join`
//! (regular file, this user's, mode, never through a link); if it holds a
//! whole page, map it and read the `join` word:
//! - `Ready`: compare the header with this process's layout and options,
//!   field by field ([`RegionError::BadHeader`] naming the first that
//!   differs: ranks, slot bytes, rows, order, files, ...); the file size;
//!   open each data file (trust checks, inode against the table, size) and
//!   map it; check that the name still names the header mapped (else look
//!   again: it was removed and made anew meanwhile); check that this
//!   rank's bytes not yet allocated fit in memory; reserve this rank's own
//!   data files (`fallocate` of allocated tmpfs ranges allocates nothing);
//! - `Init` or `Abandoned` (half-made, or being taken apart): try the
//!   lock. Held by another: its creator (or a cleaner) lives; wait, bounded
//!   by [`ShmOptions::timeout`] and interruptible ([`ShmOptions::interrupt`]),
//!   and look again. Taken: re-read under the lock (`Ready` meanwhile: open
//!   it); with [`PERSISTENT_MAGIC`] its creator is gone, so mark it
//!   `Abandoned`, remove its files (below) and create it again. A header
//!   without a magic yet (its creator died within the few instructions
//!   between sizing and writing it, or a create/join region of the same
//!   name is being created, which takes no lock) is removed only once this
//!   process's timeout has passed, as `join` removes a header never sized.
//!   A header file shorter than a page (not sized yet) is treated the same.
//!
//! Removing ([`Region::remove_persistent`], and the cleaning above) holds
//! the lock, so no creator is at work and no other cleaner either; checks
//! every file first (never through a link: `fstatat(AT_SYMLINK_NOFOLLOW)`;
//! the trust checks; a data file's inode against the table, or, when the
//! table has none yet, an empty file), and removes nothing if one fails;
//! marks the header `Abandoned` (openers that mapped it see it going);
//! unlinks the data files, then the header, each only if its name still
//! names the inode checked. While the lock is held and the header still
//! has its name, nobody can create a new region of that name (its header
//! comes first, `O_EXCL`), so no new file is removed by mistake.
//!
//! # Kill safety
//!
//! A creator killed at any step before `Ready` ([`ShmStep::HeaderCreated`],
//! [`ShmStep::DataFileCreated`]) leaves a half-made region whose lock is
//! free; the next opener removes it and creates the region again. Killed
//! after `Ready` ([`ShmStep::Ready`], [`ShmStep::Reserving`],
//! [`ShmStep::Reserved`]): the region is whole, and openers use it (the
//! next opener of that rank reserves what it had not). An opener killed
//! anywhere leaves nothing to undo: it claims no word and makes no file. A
//! cleaner killed midway leaves the header `Abandoned` (or gone, with no
//! data file left): the next opener finishes the removal. A remaining
//! window is the one of `join` (`shm.rs`): between the check of a name's
//! inode and `unlink(2)`, which only a process outside this protocol can
//! use (it would have to remove and remake the file by hand).

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::time::Instant;

use tracing::{debug, info, warn};

use super::error::{JoinPhase, RegionError};
use super::header::{Fields, JoinState, JoinWord, PERSISTENT_MAGIC, VERSION};
use super::layout::Layout;
use super::limits;
use super::options::{ShmOptions, ShmStep};
use super::persistent_remove::{lock, remove_locked, still_names, HeaderView};
use super::shm::{self, interrupted_error, own_pid_namespace, shm_path, timeout_error};
use super::shm_files::{header_name, map_existing, size_and_map, Linked, Shape, Shared};
use super::sys::Backoff;
use super::trust::{self, FileMeta, OpenFailure, RegionDir, Trust};
use super::{Kind, Region};

type Result<T> = std::result::Result<T, RegionError>;

/// How this process came to hold a persistent region
/// ([`Region::persistent_origin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PersistentOrigin {
    /// It found no region and made every file.
    Created,
    /// It opened a region another process (or an earlier handle) made.
    Opened,
}

/// The persistent side of a shared region.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Persist {
    pub(crate) origin: PersistentOrigin,
    /// `Ready` was published (or seen): the files are never unlinked by
    /// this process from then on.
    pub(crate) published: bool,
}

/// What one look at the name gave.
enum Attempt {
    Done(Region),
    /// The name changed meanwhile (another process created it first, a
    /// half-made one was removed, it was taken apart): look again now.
    Retry,
    /// Another live process is at work on it: look again after a pause.
    Wait(JoinPhase),
}

/// Retries allowed once the timeout has passed (each follows progress by
/// some process: a region removed or made); then the timeout error.
const LATE_RETRIES: usize = 4;

impl Region {
    /// Creates or opens the persistent region `name` (header file
    /// `dir/kvoffload-<name>`, data files `dir/kvoffload-<name>.<k>`) as
    /// rank `rank` of `layout.num_ranks()`: a region whose files outlive
    /// every process, removed only by [`Region::remove_persistent`]. See
    /// [`super::persistent`] for the protocol and its kill safety.
    ///
    /// If there is none, this process creates every file (the checks and
    /// errors of [`Region::create`]: capacity, `O_EXCL | O_NOFOLLOW`,
    /// mode), publishes it and reserves its own share; if there is one, it
    /// opens and checks every file as [`Region::join`] does
    /// ([`RegionError::UntrustedFile`]), refuses a header that does not
    /// match `layout` and `opts` naming the field
    /// ([`RegionError::BadHeader`]), and reserves its own share (a no-op
    /// where its pages are allocated already). A half-made region is waited
    /// for (bounded by [`ShmOptions::timeout`],
    /// [`RegionError::JoinTimeout`]; [`ShmOptions::interrupt`]) or, if its
    /// creator is gone, removed and made again. No rank waits for another
    /// and none sets a bit: ranks and engines come and go.
    ///
    /// Options as for `create`/`join`, except: [`ShmOptions::force`] is
    /// ignored (an existing file may be the region itself);
    /// [`ShmOptions::wait_for_all`] means nothing; with
    /// [`ShmOptions::check_memory`] the creator checks the whole region and
    /// an opener the bytes of its own share not yet allocated. The region's
    /// header words for the ranks' pin agreement are not offered
    /// ([`Region::rank_slots`] is None): they would be shared by every
    /// engine that ever opened it.
    pub fn open_persistent(name: &str, layout: Layout, rank: usize, opts: &ShmOptions) -> Result<Region> {
        layout.check_rank(rank)?;
        let path = shm_path(&opts.dir, name)?;
        trust::check_create_mode(opts.file_mode(), opts.allow_group)?;
        // Never remove an existing file by force: it may be the region.
        let opts = &opts.clone().force(false);
        let dir = RegionDir::open(&opts.dir).map_err(|e| RegionError::io("open (directory)", &opts.dir, e))?;
        let hpage = dir.hugetlb_page().map_err(|e| RegionError::io("fstatfs", &opts.dir, e))?;
        let shape = Shape::of(&layout, opts, hpage)?;
        let cx =
            Cx { name: header_name(&path), path, layout, rank, opts, shape, trust: Trust::current(opts.allow_group) };
        let mut backoff = Backoff::new(opts.timeout);
        let mut interrupt = opts.interrupt_check();
        let started = Instant::now();
        let mut late = 0;
        loop {
            let past = started.elapsed() >= opts.timeout;
            match cx.attempt(&dir, past)? {
                Attempt::Done(r) => return Ok(r),
                Attempt::Retry if past => {
                    late += 1;
                    if late > LATE_RETRIES {
                        return Err(cx.timed_out(JoinPhase::CreatorToInitialise));
                    }
                }
                Attempt::Retry => {}
                Attempt::Wait(phase) => {
                    if interrupt.due() {
                        return Err(interrupted_error(&cx.path, phase));
                    }
                    if !backoff.wait() && past {
                        // One more look once the deadline passed (a
                        // half-made region of unknown maker is removed
                        // then), then the timeout.
                        return Err(cx.timed_out(phase));
                    }
                }
            }
        }
    }

    /// How this process got the region, for a persistent region
    /// ([`Region::open_persistent`]); None for any other.
    pub fn persistent_origin(&self) -> Option<PersistentOrigin> {
        match &self.kind {
            Kind::Shared(s) => s.persistent.map(|p| p.origin),
            Kind::Anonymous => None,
        }
    }
}

/// What one `open_persistent` call knows.
struct Cx<'a> {
    name: OsString,
    path: PathBuf,
    layout: Layout,
    rank: usize,
    opts: &'a ShmOptions,
    shape: Shape,
    trust: Trust,
}

impl Cx<'_> {
    fn timed_out(&self, phase: JoinPhase) -> RegionError {
        warn!(path = %self.path.display(), %phase, "timed out opening a persistent region");
        timeout_error(&self.path, phase, self.opts.timeout, None, self.layout.num_ranks())
    }

    /// One look at the name: create, open, or wait.
    fn attempt(&self, dir: &RegionDir, past: bool) -> Result<Attempt> {
        match dir.open_existing(&self.name, &self.trust) {
            Ok(file) => self.open(dir, file, past),
            Err(OpenFailure::Missing) => self.create(dir),
            Err(OpenFailure::Untrusted(problem)) => Err(dir.untrusted(&self.name, problem)),
            // With an allowed group, a creator of another user gives the
            // file its group and mode right after creating it (0600).
            Err(OpenFailure::Io(_, e))
                if e.kind() == io::ErrorKind::PermissionDenied && self.opts.allow_group.is_some() =>
            {
                Ok(Attempt::Wait(JoinPhase::FileToAppear))
            }
            Err(OpenFailure::Io(op, e)) => Err(RegionError::io(op, &self.path, e)),
        }
    }

    /// The fields this process's header has.
    fn fields(&self) -> Fields {
        let (num_files, file_bytes) =
            self.shape.plan.as_ref().map_or((0, 0), |p| (p.files.len() as u64, p.file_bytes as u64));
        Fields {
            magic: PERSISTENT_MAGIC,
            version: VERSION,
            header_bytes: self.shape.header_bytes as u32,
            total_bytes: self.shape.total as u64,
            chunk_bytes: self.layout.chunk_bytes() as u64,
            num_rows: self.layout.num_rows() as u64,
            num_ranks: self.layout.num_ranks() as u32,
            creator_rank: self.rank as u32,
            session: self.opts.session,
            creator_pid: std::process::id(),
            creator_pidns: own_pid_namespace().unwrap_or(0),
            order: self.layout.order().code(),
            num_files,
            file_bytes,
        }
    }

    /// Compares a `Ready` header with this process's: what the bytes
    /// mean first (ranks, slot bytes, rows, order), then how they are
    /// split and sized, so a refusal names the field the user set.
    fn check_fields(&self, f: &Fields) -> Result<()> {
        let want = self.fields();
        let expect: [(&'static str, u64, u64); 10] = [
            ("version", want.version as u64, f.version as u64),
            ("num_ranks", want.num_ranks as u64, f.num_ranks as u64),
            ("chunk_bytes", want.chunk_bytes, f.chunk_bytes),
            ("num_rows", want.num_rows, f.num_rows),
            ("order", want.order, f.order),
            ("num_files", want.num_files, f.num_files),
            ("file_bytes", want.file_bytes, f.file_bytes),
            ("header_bytes", want.header_bytes as u64, f.header_bytes as u64),
            ("total_bytes", want.total_bytes, f.total_bytes),
            ("session", want.session, f.session),
        ];
        for (field, expected, found) in expect {
            if expected != found {
                warn!(path = %self.path.display(), field, expected, found, "persistent region does not match");
                return Err(RegionError::BadHeader { path: self.path.clone(), field, expected, found });
            }
        }
        // Any rank may have created it; it is one of the region's ranks.
        if f.creator_rank >= want.num_ranks {
            return Err(RegionError::HeaderOutOfRange {
                path: self.path.clone(),
                field: "creator_rank",
                found: f.creator_rank as u64,
                limit: want.num_ranks as u64,
            });
        }
        Ok(())
    }

    /// No header file: create the region.
    fn create(&self, dir: &RegionDir) -> Result<Attempt> {
        if let Err(e) = shm::check_capacity(dir, self.opts, self.shape.hpage, self.shape.total) {
            // Another process may have created it since we looked (its
            // reservation is what no longer fits): open that one.
            if dir.lstat(&self.name).is_ok_and(|m| m.is_some()) {
                return Ok(Attempt::Retry);
            }
            return Err(e);
        }
        let file = match dir.create_new(&self.name, self.opts.file_mode(), self.opts.allow_group) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                debug!(path = %self.path.display(), "another process created the persistent region first");
                return Ok(Attempt::Retry);
            }
            Err(e) => return Err(RegionError::io("open", &self.path, e)),
        };
        if !lock(&file, &self.path)? {
            // A cleaner took this fresh file for a dead creator's (it
            // holds the lock and removes it): start over.
            return Ok(Attempt::Retry);
        }
        let header = match Linked::of(dir, self.name.clone(), &file) {
            Ok(l) => l,
            Err(e) => {
                // As in `create`: no inode to compare; we hold the lock,
                // so no cleaner has removed and remade the name.
                if let Err(u) = dir.unlink(&self.name) {
                    warn!(error = %u, path = %self.path.display(), "could not unlink region file after failed create");
                }
                return Err(e);
            }
        };
        if !still_names(dir, &header)? {
            return Ok(Attempt::Retry);
        }
        let dir = dir.try_clone().map_err(|e| RegionError::io("dup (directory)", &self.opts.dir, e))?;
        let mut shared = Shared::new(dir, header, file, self.opts, &self.shape);
        shared.persistent = Some(Persist { origin: PersistentOrigin::Created, published: false });
        let map = match size_and_map(&shared, &self.shape) {
            Ok(m) => m,
            Err(e) => {
                if let Err(u) = shared.unlink_if_ours("create failed") {
                    warn!(error = %u, "could not unlink region file after failed create");
                }
                return Err(e);
            }
        };
        let mut region = Region::over_shared(map, &self.shape, self.layout, self.rank, shared);
        // From here on, dropping `region` on an error path abandons it and
        // unlinks every file this process made (it is not published).
        region.hdr().write_fields(&self.fields());
        self.opts.step(ShmStep::HeaderCreated);
        if let Some(plan) = &self.shape.plan {
            region.create_data_files(plan, self.opts)?;
        }
        let published = region
            .hdr()
            .update(|w| (w.state == JoinState::Init).then_some(JoinWord { state: JoinState::Ready, mask: 0 }));
        if published.is_err() {
            // Only a holder of the lock abandons a persistent region, and
            // we hold it: something outside the protocol wrote the header.
            return Err(region.abandoned_error());
        }
        region.shared_mut().persistent = Some(Persist { origin: PersistentOrigin::Created, published: true });
        if let Err(e) = trust::unlock(&region.shared().file) {
            // Harmless but for `remove_persistent`, which then waits until
            // this process closes the file.
            warn!(error = %e, path = %self.path.display(), "could not drop the creation lock");
        }
        self.opts.step(ShmStep::Ready);
        info!(
            path = %self.path.display(),
            bytes = self.shape.total,
            files = 1 + region.shared().data.len(),
            ranks = self.layout.num_ranks(),
            rank = self.rank,
            "created persistent region"
        );
        // Published: from here on an error leaves the files (a whole
        // region), as for an opener.
        if !region.shared().deferred {
            region.reserve_own()?;
        }
        if self.opts.huge_pages && self.shape.hpage.is_none() {
            region.huge_pages_advised = region.try_advise_huge_pages();
        }
        Ok(Attempt::Done(region))
    }

    /// A header file found: open it, or wait for it, or remove a dead
    /// creator's half-made one.
    fn open(&self, dir: &RegionDir, file: File, past: bool) -> Result<Attempt> {
        let header = Linked::of(dir, self.name.clone(), &file)?;
        let view = HeaderView::map(&file, &self.path)?;
        let Some(v) = view else { return self.half_made(dir, &file, &header, JoinPhase::FileToBeSized, past) };
        let w = v.hdr().load();
        match w.state {
            JoinState::Ready => {}
            JoinState::Init | JoinState::Abandoned => {
                return self.half_made(dir, &file, &header, JoinPhase::CreatorToInitialise, past)
            }
            _ => {}
        }
        // Read after the acquire load of `Ready`: written before it.
        let f = v.hdr().read_fields();
        if f.magic != PERSISTENT_MAGIC {
            return Err(RegionError::BadHeader {
                path: self.path.clone(),
                field: "magic",
                expected: PERSISTENT_MAGIC,
                found: f.magic,
            });
        }
        if w.state != JoinState::Ready {
            return Err(RegionError::BadHeader {
                path: self.path.clone(),
                field: "join state",
                expected: JoinWord { state: JoinState::Ready, mask: 0 }.encode(),
                found: w.encode(),
            });
        }
        self.check_fields(&f)?;
        drop(v);
        let len = FileMeta::of_file(&file).map_err(|e| RegionError::io("fstat", &self.path, e))?.size;
        let want = self.shape.header_file_len() as u64;
        if len != want {
            return Err(RegionError::BadHeader {
                path: self.path.clone(),
                field: "file size",
                expected: want,
                found: len,
            });
        }
        let dir2 = dir.try_clone().map_err(|e| RegionError::io("dup (directory)", &self.opts.dir, e))?;
        let mut shared = Shared::new(dir2, header, file, self.opts, &self.shape);
        // Published: this process never unlinks it, whatever fails below.
        shared.persistent = Some(Persist { origin: PersistentOrigin::Opened, published: true });
        let map = map_existing(&shared, &self.shape)?;
        let mut region = Region::over_shared(map, &self.shape, self.layout, self.rank, shared);
        if let Some(plan) = &self.shape.plan {
            match region.open_data_files(plan) {
                Ok(()) => {}
                // Being taken apart (a data file gone already): look again.
                Err(RegionError::Abandoned { .. }) => return Ok(Attempt::Retry),
                Err(e) => return Err(e),
            }
            self.opts.step(ShmStep::FilesMapped);
        }
        if !still_names(dir, &region.shared().header)? || region.hdr().load().state != JoinState::Ready {
            debug!(path = %self.path.display(), "persistent region removed while opening it; looking again");
            return Ok(Attempt::Retry);
        }
        if self.opts.check_memory && self.shape.hpage.is_none() {
            // What this rank brings into memory itself: its share's pages
            // not allocated yet (none once an earlier engine reserved them).
            limits::check(region.unallocated_own_bytes()?)?;
        }
        if !region.shared().deferred {
            region.reserve_own()?;
        }
        if self.opts.huge_pages && self.shape.hpage.is_none() {
            region.huge_pages_advised = region.try_advise_huge_pages();
        }
        info!(path = %self.path.display(), rank = self.rank, "opened persistent region");
        Ok(Attempt::Done(region))
    }

    /// A header that is not `Ready` (or not sized): wait while its lock is
    /// held; else, under the lock, open it if it became ready, remove it
    /// if its creator is gone, or wait for the timeout if its maker is
    /// unknown (no magic yet).
    fn half_made(
        &self,
        dir: &RegionDir,
        file: &File,
        header: &Linked,
        phase: JoinPhase,
        past: bool,
    ) -> Result<Attempt> {
        if !lock(file, &self.path)? {
            return Ok(Attempt::Wait(phase));
        }
        // Held (until `file` closes): no creator or cleaner is at work on
        // this file. Look again under the lock.
        if !still_names(dir, header)? {
            return Ok(Attempt::Retry);
        }
        let view = HeaderView::map(file, &self.path)?;
        let magic = match &view {
            Some(v) if v.hdr().load().state == JoinState::Ready => return Ok(Attempt::Retry),
            Some(v) => v.hdr().read_fields().magic,
            None => 0,
        };
        match magic {
            PERSISTENT_MAGIC => {}
            // Unknown maker: removed only once our timeout has passed.
            0 if past => {}
            0 => return Ok(Attempt::Wait(phase)),
            found => {
                return Err(RegionError::BadHeader {
                    path: self.path.clone(),
                    field: "magic",
                    expected: PERSISTENT_MAGIC,
                    found,
                })
            }
        }
        warn!(path = %self.path.display(), "removing a half-made persistent region whose creator is gone");
        remove_locked(dir, header, &self.trust, view.as_ref())?;
        Ok(Attempt::Retry)
    }
}
