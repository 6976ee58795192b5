//! The pool's index file (design 2.1): `kvoffload-pool-<name>.index` in a
//! tmpfs or hugetlbfs directory (default `/dev/shm`; another file system is
//! refused, [`PoolError::NotTmpfs`]), holding the pool page, the
//! fingerprint, the engine table, the set hands and the slot records
//! ([`layout`]). The rows themselves live in the shared region of name
//! `pool-<name>` (`kvoffload-pool-<name>` and its data files), which
//! [`remove`] removes with the index.
//!
//! # Creating and opening
//!
//! The creator makes the file with `O_CREAT | O_EXCL | O_NOFOLLOW` through
//! the region's directory handle (`RegionDir`: never through a link, the
//! mode exact whatever the umask), sizes it, maps it, stores its start
//! time and pid namespace and then the pool word `INIT(pid)` (Release),
//! writes the header and the config part, and publishes `READY(0)` by CAS
//! (AcqRel). An opener opens the name without following links and uses
//! only a regular file of its own user that nobody else may read or write
//! (the region's `Trust`), waits (bounded, interruptible: [`Wait`]) for
//! the file to be sized and `READY`, then checks magic, version, page size,
//! geometry and length ([`PoolError::BadHeader`], [`PoolError::Corrupt`]),
//! the boot id ([`PoolError::OtherBoot`]) and the config part
//! ([`PoolError::Mismatch`] naming the field).
//!
//! A file in `INIT` whose creator is known gone (the oracle on its
//! recorded pid, start time and pid namespace) is half-made: the opener
//! removes it (if the name still names that inode) and creates the pool
//! again. One never sized, or never given its creator's pid, within the
//! wait is removed the same way (its creator died between `open` and the
//! first store, or is stuck there). A `CLOSING` pool has no engine and is
//! never used again: it is removed and created again too.

// Cross-process words on shared memory: `core::sync::atomic`, never the
// sync facade (loom cannot model another process).
#![allow(clippy::disallowed_types)]

pub mod admin;
pub mod layout;
pub mod liveness;
mod parts;
pub mod words;

use core::sync::atomic::Ordering;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use memmap2::MmapOptions;
use tracing::{debug, info, warn};

use self::layout::{Part, PoolState, PoolWord, Sections, MAGIC, MIN_PAGE, VERSION, W};
use self::liveness::{boot_id, boot_id_text, member_of_self, Oracle};
use self::words::{stored_boot, PoolMap, ShmPoolWords};
use super::error::PoolError;
use super::fingerprint::ConfigRecord;
use super::words::{Geometry, Liveness, Member};
use crate::region::hugetlb::HUGETLBFS_MAGIC;
use crate::region::shm::{own_pid_namespace, MAX_NAME_LEN};
use crate::region::{check_create_mode, Backoff, FileMeta, OpenFailure, RegionDir, Trust};

pub use self::admin::{list, remove, EngineCounts, PoolSummary, Removed, SlotCounts};
pub use self::layout::PoolState as State;
pub use self::words::PublishNote;

type Result<T> = std::result::Result<T, PoolError>;

/// `statfs` magic of tmpfs.
pub const TMPFS_MAGIC: u64 = 0x0102_1994;
/// Prefix of a pool's file names.
pub const POOL_PREFIX: &str = "kvoffload-pool-";
/// Suffix of a pool's index file.
pub const INDEX_SUFFIX: &str = ".index";

/// Checks a pool name: the region's rules (non-empty, at most 200 bytes,
/// no `/` or NUL), and no tail that names another pool's file (`.index`,
/// or `.<digits>`, a data file of pool `<name minus the tail>`).
pub fn check_name(name: &str) -> Result<()> {
    let bad = |reason| Err(PoolError::BadName { name: name.to_string(), reason });
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > MAX_NAME_LEN {
        return bad("longer than 200 bytes");
    }
    if name.contains('/') || name.contains('\0') {
        return bad("contains '/' or NUL");
    }
    if name.ends_with(INDEX_SUFFIX) {
        return bad("ends in '.index', which names another pool's index file");
    }
    if let Some((_, tail)) = name.rsplit_once('.') {
        if !tail.is_empty() && tail.bytes().all(|b| b.is_ascii_digit()) {
            return bad("ends in '.<digits>', which names another pool's data file");
        }
    }
    Ok(())
}

/// The index file's name of pool `name`.
pub fn index_name(name: &str) -> String {
    format!("{POOL_PREFIX}{name}{INDEX_SUFFIX}")
}

/// The region name of pool `name`'s rows (`pool-<name>`: files
/// `kvoffload-pool-<name>` and `kvoffload-pool-<name>.<k>`).
pub fn region_name(name: &str) -> String {
    format!("pool-{name}")
}

/// A point of creation, for tests that stop a creator there
/// ([`PoolOptions::observe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolStep {
    /// The file exists (`O_EXCL`), not sized yet.
    Created,
    /// Sized, mapped and `INIT(pid)` stored, the header not written.
    Init,
    /// Header and config written, `READY` not published yet.
    Written,
    /// `READY` published.
    Ready,
}

/// Where a pool lives and how its files are made and trusted.
#[derive(Clone, Debug)]
pub struct PoolOptions {
    /// The directory (a tmpfs or hugetlbfs mount).
    pub dir: PathBuf,
    /// Permission bits of a created file (0o600; group bits need `allow_group`).
    pub mode: u32,
    /// A group whose members may share the files (the region's rule).
    pub allow_group: Option<u32>,
    observer: Option<fn(PoolStep)>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            dir: PathBuf::from(crate::region::DEFAULT_SHM_DIR),
            mode: 0o600,
            allow_group: None,
            observer: None,
        }
    }
}

impl PoolOptions {
    /// The default options in directory `dir`.
    pub fn in_dir(dir: impl Into<PathBuf>) -> Self {
        PoolOptions { dir: dir.into(), ..Self::default() }
    }

    /// Calls `f` at each [`PoolStep`] of a creation.
    pub fn observe(mut self, f: fn(PoolStep)) -> Self {
        self.observer = Some(f);
        self
    }

    fn step(&self, s: PoolStep) {
        if let Some(f) = self.observer {
            f(s);
        }
    }
}

/// How long a wait of the pool may last, and how it is interrupted.
#[derive(Clone, Copy)]
pub struct Wait<'a> {
    /// The bound.
    pub timeout: Duration,
    interrupted: Option<&'a dyn Fn() -> bool>,
}

impl std::fmt::Debug for Wait<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wait")
            .field("timeout", &self.timeout)
            .field("interruptible", &self.interrupted.is_some())
            .finish()
    }
}

impl<'a> Wait<'a> {
    /// A wait of at most `timeout`, not interruptible.
    pub fn new(timeout: Duration) -> Self {
        Wait { timeout, interrupted: None }
    }

    /// A wait of at most `timeout` interrupted as `request` is
    /// ([`crate::protocol::Request::interruptible`]).
    pub fn of(timeout: Duration, request: &crate::protocol::Request<'a>) -> Self {
        Wait { timeout, interrupted: request.interrupt() }
    }

    /// Stops waiting once `interrupted` returns true.
    pub fn interruptible(mut self, interrupted: &'a dyn Fn() -> bool) -> Self {
        self.interrupted = Some(interrupted);
        self
    }

    pub(crate) fn is_interrupted(&self) -> bool {
        self.interrupted.is_some_and(|f| f())
    }
}

/// What an engine's process brings to a pool it creates or opens.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    /// The pool's shape (an existing pool keeps its own; only `ranks` must match).
    pub geometry: Geometry,
    /// Bytes of a row on one rank.
    pub row_bytes: u64,
    /// The config part of the fingerprint.
    pub config: ConfigRecord,
}

/// A pool's index file, mapped.
pub struct PoolFile {
    words: ShmPoolWords,
    name: String,
    path: PathBuf,
    dir: RegionDir,
    file_name: OsString,
    dev: u64,
    ino: u64,
    _file: File,
}

impl std::fmt::Debug for PoolFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolFile").field("path", &self.path).field("geometry", &self.words.geometry).finish()
    }
}

/// Opens the pool's directory and refuses one that is not memory.
fn open_dir(dir: &Path) -> Result<(RegionDir, usize)> {
    let d = RegionDir::open(dir).map_err(|e| PoolError::io("open (directory)", dir, e))?;
    let st = rustix::fs::fstatfs(&d).map_err(|e| PoolError::io("fstatfs", dir, e.into()))?;
    // f_type is signed on some targets: compare its low 32 bits.
    #[allow(clippy::unnecessary_cast)]
    let magic = st.f_type as u64 & 0xffff_ffff;
    if magic != TMPFS_MAGIC && magic != HUGETLBFS_MAGIC {
        return Err(PoolError::NotTmpfs { dir: dir.to_path_buf(), magic });
    }
    let unit = d.hugetlb_page().map_err(|e| PoolError::io("fstatfs", dir, e))?.unwrap_or(0);
    Ok((d, unit))
}

fn page() -> usize {
    MIN_PAGE.max(rustix::param::page_size())
}

fn unix_nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// What an attempt to create found.
enum Created {
    Made(PoolFile),
    /// The name is taken: the directory, and the path for the error.
    Taken(RegionDir, PathBuf),
}

/// What an attempt to open an existing file found.
enum Opened {
    Ready(Box<PoolFile>),
    /// Half-made, closing or never sized: removed (or found gone), or no
    /// such file: create it (in this directory).
    Absent(RegionDir),
}

impl PoolFile {
    /// Creates pool `name` (`O_EXCL`: [`PoolError::AlreadyExists`] if the
    /// name is taken) and publishes it `READY`.
    pub fn create(name: &str, spec: &PoolSpec, opts: &PoolOptions) -> Result<PoolFile> {
        check_name(name)?;
        let (dir, unit) = open_dir(&opts.dir)?;
        match Self::create_in(dir, unit, name, spec, opts)? {
            Created::Made(pool) => Ok(pool),
            Created::Taken(_, path) => Err(PoolError::AlreadyExists { path }),
        }
    }

    /// Opens pool `name` if it exists (waiting for a creator under way,
    /// recreating a half-made one), else creates it; checks this engine's
    /// config and shape against it. Whether this call created it.
    pub fn open_or_create(name: &str, spec: &PoolSpec, opts: &PoolOptions, wait: Wait<'_>) -> Result<(PoolFile, bool)> {
        check_name(name)?;
        spec.config.check()?;
        spec.geometry.check().map_err(|reason| PoolError::BadGeometry { reason })?;
        let (mut dir, unit) = open_dir(&opts.dir)?;
        let mut backoff = Backoff::new(wait.timeout);
        loop {
            match Self::open_ready(dir, unit, name, opts, wait, &mut backoff, true)? {
                Opened::Ready(pool) => {
                    pool.check_spec(spec)?;
                    return Ok((*pool, false));
                }
                Opened::Absent(d) => match Self::create_in(d, unit, name, spec, opts)? {
                    Created::Made(pool) => return Ok((pool, true)),
                    // Another process made it meanwhile: open theirs.
                    Created::Taken(d, _) => dir = d,
                },
            }
        }
    }

    /// Opens pool `name`, waiting for it to be `READY` (a half-made one of
    /// a gone creator is removed, and then [`PoolError::Missing`]). Checks
    /// the header, not the fingerprint.
    pub fn open(name: &str, opts: &PoolOptions, wait: Wait<'_>) -> Result<PoolFile> {
        Self::open_with(name, opts, wait, true)
    }

    /// Opens pool `name` as it is, for `pool ls | rm`: no wait, and nothing
    /// written or removed (a pool not `READY` is [`PoolError::NotReady`]).
    pub fn inspect(name: &str, opts: &PoolOptions) -> Result<PoolFile> {
        Self::open_with(name, opts, Wait::new(Duration::ZERO), false)
    }

    fn open_with(name: &str, opts: &PoolOptions, wait: Wait<'_>, recover: bool) -> Result<PoolFile> {
        check_name(name)?;
        let (dir, unit) = open_dir(&opts.dir)?;
        let mut backoff = Backoff::new(wait.timeout);
        match Self::open_ready(dir, unit, name, opts, wait, &mut backoff, recover)? {
            Opened::Ready(pool) => Ok(*pool),
            Opened::Absent(_) => Err(PoolError::Missing {
                pool: name.into(),
                dir: opts.dir.clone(),
                path: opts.dir.join(index_name(name)),
            }),
        }
    }

    /// Creates the file in `dir`; a name taken gives the directory back.
    fn create_in(dir: RegionDir, unit: usize, name: &str, spec: &PoolSpec, opts: &PoolOptions) -> Result<Created> {
        spec.config.check()?;
        let g = spec.geometry;
        g.check().map_err(|reason| PoolError::BadGeometry { reason })?;
        check_create_mode(opts.mode, opts.allow_group)?;
        let sec = Sections::of(&g, page(), unit)
            .ok_or(PoolError::BadGeometry { reason: "the index file's size overflows" })?;
        let me = member_of_self().map_err(|e| PoolError::io("read", "/proc/self/stat", e))?;
        let boot = boot_id().map_err(|e| PoolError::io("read", liveness::BOOT_ID_PATH, e))?;
        let file_name = OsString::from(index_name(name));
        let path = dir.path_of(&file_name);
        let file = match dir.create_new(&file_name, opts.mode, opts.allow_group) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(Created::Taken(dir, path)),
            Err(e) => return Err(PoolError::io("create", &path, e)),
        };
        Self::made(dir, file, file_name, path, name, spec, opts, (g, sec, me, boot)).map(Created::Made)
    }

    /// The creator's steps after `O_EXCL`.
    #[allow(clippy::too_many_arguments)]
    fn made(
        dir: RegionDir,
        file: File,
        file_name: OsString,
        path: PathBuf,
        name: &str,
        spec: &PoolSpec,
        opts: &PoolOptions,
        (g, sec, me, boot): (Geometry, Sections, Member, [u8; 16]),
    ) -> Result<PoolFile> {
        let meta = match FileMeta::of_file(&file) {
            Ok(m) => m,
            Err(e) => {
                // No inode to compare: nobody can have it yet under O_EXCL.
                let _ = dir.unlink(&file_name);
                return Err(PoolError::io("fstat", &path, e));
            }
        };
        opts.step(PoolStep::Created);
        let remove = |dir: &RegionDir| {
            if let Err(e) = dir.unlink_if_inode(&file_name, meta.dev, meta.ino) {
                warn!(path = %path.display(), error = %e, "could not remove a pool file after a failed create");
            }
        };
        let raw =
            match file.set_len(sec.len as u64).map_err(|e| PoolError::io("ftruncate", &path, e)).and_then(|()| {
                MmapOptions::new().len(sec.len).map_raw(&file).map_err(|e| PoolError::io("mmap", &path, e))
            }) {
                Ok(raw) => raw,
                Err(e) => {
                    remove(&dir);
                    return Err(e);
                }
            };
        let map = PoolMap::new(raw);
        let oracle = Oracle { same_boot: true, own_pidns: own_pid_namespace() };
        let words = ShmPoolWords { map, sec, geometry: g, oracle };
        let pool = PoolFile {
            words,
            name: name.into(),
            path,
            dir,
            file_name: file_name.clone(),
            dev: meta.dev,
            ino: meta.ino,
            _file: file,
        };
        let pg = |w: usize, v: u64| pool.words.map.page(w).store(v, Ordering::Relaxed);
        // The creator's identity first, then INIT(pid) publishes it to an
        // opener judging whether the creator is gone.
        pg(W::CREATOR_START, me.start);
        pg(W::CREATOR_PIDNS, me.pidns);
        pool.words
            .map
            .page(W::STATE)
            .store(PoolWord { state: PoolState::Init, value: me.pid }.encode(), Ordering::Release);
        opts.step(PoolStep::Init);
        pg(W::MAGIC, MAGIC);
        pg(W::VERSION, VERSION);
        pg(W::PAGE, sec.page as u64);
        pg(W::CREATOR_PID, u64::from(me.pid));
        pg(W::CREATED, unix_nanos());
        pg(W::BOOT, u64::from_le_bytes(boot[..8].try_into().expect("8 bytes")));
        pg(W::BOOT + 1, u64::from_le_bytes(boot[8..].try_into().expect("8 bytes")));
        pg(W::SLOTS, g.slots.into());
        pg(W::WAYS, g.ways.into());
        pg(W::RANKS, g.ranks.into());
        pg(W::ENGINES, g.engines.into());
        pg(W::ROW_BYTES, spec.row_bytes);
        pg(W::FILE_BYTES, sec.len as u64);
        pg(W::FP_OFF, sec.fingerprint as u64);
        pg(W::ENGINES_OFF, sec.engines as u64);
        pg(W::HANDS_OFF, sec.hands as u64);
        pg(W::SLOTS_OFF, sec.slots as u64);
        pool.words.write_set_part(Part::Config, &spec.config.encode(), &me);
        opts.step(PoolStep::Written);
        let init = PoolWord { state: PoolState::Init, value: me.pid }.encode();
        let ready = PoolWord { state: PoolState::Ready, value: 0 }.encode();
        if let Err(found) =
            pool.words.map.page(W::STATE).compare_exchange(init, ready, Ordering::AcqRel, Ordering::Acquire)
        {
            // Nobody else writes a file in INIT: it was overwritten.
            return Err(PoolError::Corrupt {
                path: pool.path.clone(),
                what: format!("the pool word became {found:#x} while it was being made"),
            });
        }
        opts.step(PoolStep::Ready);
        info!(path = %pool.path.display(), slots = g.slots, ways = g.ways, ranks = g.ranks, bytes = sec.len, "created pool");
        Ok(pool)
    }

    /// One attempt at opening an existing file and waiting for `READY`;
    /// with `recover`, a file that cannot become `READY` is removed.
    fn open_ready(
        dir: RegionDir,
        unit: usize,
        name: &str,
        opts: &PoolOptions,
        wait: Wait<'_>,
        backoff: &mut Backoff,
        recover: bool,
    ) -> Result<Opened> {
        let trust = Trust::current(opts.allow_group);
        let file_name = OsString::from(index_name(name));
        let path = dir.path_of(&file_name);
        let file = match dir.open_existing(&file_name, &trust) {
            Ok(f) => f,
            Err(OpenFailure::Missing) => return Ok(Opened::Absent(dir)),
            Err(OpenFailure::Untrusted(problem)) => {
                warn!(path = %path.display(), %problem, "refusing an untrusted pool file");
                return Err(PoolError::Untrusted { path, problem });
            }
            Err(OpenFailure::Io(op, e)) => return Err(PoolError::io(op, &path, e)),
        };
        let meta = FileMeta::of_file(&file).map_err(|e| PoolError::io("fstat", &path, e))?;
        let unlink = |dir: RegionDir, why: &str| -> Result<Opened> {
            if !recover {
                return Err(PoolError::NotReady { path: path.clone(), what: why.into() });
            }
            match dir.unlink_if_inode(&file_name, meta.dev, meta.ino) {
                Ok(removed) => {
                    if removed {
                        warn!(path = %path.display(), why, "removed a pool file");
                    }
                    Ok(Opened::Absent(dir))
                }
                Err(e) => Err(PoolError::io("unlink", &path, e)),
            }
        };
        let waiting_for = "the pool's creator to make it READY";
        // Sized by the creator.
        let len = loop {
            let len = FileMeta::of_file(&file).map_err(|e| PoolError::io("fstat", &path, e))?.size;
            if len != 0 {
                break len;
            }
            if !recover {
                return Err(PoolError::NotReady { path, what: "being made, not sized yet".into() });
            }
            if wait.is_interrupted() {
                return Err(PoolError::Interrupted { path, waiting_for: waiting_for.into() });
            }
            if !backoff.wait() {
                // Never sized: its creator died between open and ftruncate.
                return unlink(dir, "never sized by its creator");
            }
        };
        let page = page() as u64;
        if len < page || len > isize::MAX as u64 {
            return Err(PoolError::Corrupt { path, what: format!("its length {len} is not that of a pool index") });
        }
        let raw = MmapOptions::new().len(len as usize).map_raw(&file).map_err(|e| PoolError::io("mmap", &path, e))?;
        let map = PoolMap::new(raw);
        let word = loop {
            let w = PoolWord::decode(map.page(W::STATE).load(Ordering::Acquire));
            match w.state {
                PoolState::Ready => break w,
                PoolState::Closing => return unlink(dir, "closing"),
                PoolState::Invalid => {
                    return Err(PoolError::Corrupt { path, what: format!("pool word {:#x}", w.encode()) });
                }
                PoolState::Init if w.value != 0 => {
                    let creator = Member {
                        pid: w.value,
                        start: map.page(W::CREATOR_START).load(Ordering::Relaxed),
                        pidns: map.page(W::CREATOR_PIDNS).load(Ordering::Relaxed),
                    };
                    let oracle = Oracle { same_boot: true, own_pidns: own_pid_namespace() };
                    if oracle.judge(&creator) == Liveness::Gone {
                        return unlink(dir, "half-made by a creator that is gone");
                    }
                }
                PoolState::Init => {}
            }
            if !recover {
                return Err(PoolError::NotReady { path, what: format!("being made by pid {}", w.value) });
            }
            if wait.is_interrupted() {
                return Err(PoolError::Interrupted { path, waiting_for: waiting_for.into() });
            }
            if !backoff.wait() {
                if w.value == 0 {
                    return unlink(dir, "never given its creator's pid");
                }
                return Err(PoolError::Timeout { path, waiting_for: waiting_for.into(), timeout: wait.timeout });
            }
        };
        debug!(path = %path.display(), ?word, "pool file is ready");
        let pool = Self::checked(map, dir, unit, name, file, meta, &path)?;
        Ok(Opened::Ready(Box::new(pool)))
    }

    /// Checks a `READY` file's header and builds its handle.
    fn checked(
        map: PoolMap,
        dir: RegionDir,
        unit: usize,
        name: &str,
        file: File,
        meta: FileMeta,
        path: &Path,
    ) -> Result<PoolFile> {
        let pg = |w: usize| map.page(w).load(Ordering::Relaxed);
        for (field, expected, found) in [
            ("magic", MAGIC, pg(W::MAGIC)),
            ("version", VERSION, pg(W::VERSION)),
            ("page size", page() as u64, pg(W::PAGE)),
        ] {
            if expected != found {
                return Err(PoolError::BadHeader { path: path.into(), field, expected, found });
            }
        }
        let corrupt = |what: String| PoolError::Corrupt { path: path.into(), what };
        let small = |w: usize, max: u64| {
            let v = pg(w);
            (v <= max).then_some(v).ok_or_else(|| corrupt(format!("header word {w} is {v}, past {max}")))
        };
        let g = Geometry {
            slots: small(W::SLOTS, u32::MAX.into())? as u32,
            ways: small(W::WAYS, u32::MAX.into())? as u32,
            ranks: small(W::RANKS, u8::MAX.into())? as u8,
            engines: small(W::ENGINES, u8::MAX.into())? as u8,
        };
        g.check().map_err(|r| corrupt(format!("its geometry {g:?}: {r}")))?;
        let sec = Sections::of(&g, page(), unit).ok_or_else(|| corrupt(format!("its geometry {g:?} overflows")))?;
        let recorded = [pg(W::FILE_BYTES), pg(W::FP_OFF), pg(W::ENGINES_OFF), pg(W::HANDS_OFF), pg(W::SLOTS_OFF)];
        let computed = [sec.len, sec.fingerprint, sec.engines, sec.hands, sec.slots].map(|v| v as u64);
        if recorded != computed || map.len() != sec.len {
            return Err(corrupt(format!(
                "its sections {recorded:?} and length {} are not those of its geometry ({computed:?})",
                map.len()
            )));
        }
        let boot = boot_id().map_err(|e| PoolError::io("read", liveness::BOOT_ID_PATH, e))?;
        let same_boot = stored_boot(&map) == boot;
        let oracle = Oracle { same_boot, own_pidns: own_pid_namespace() };
        let file_name = OsString::from(index_name(name));
        Ok(PoolFile {
            words: ShmPoolWords { map, sec, geometry: g, oracle },
            name: name.into(),
            path: path.into(),
            dir,
            file_name,
            dev: meta.dev,
            ino: meta.ino,
            _file: file,
        })
    }

    /// Refuses a pool whose config or shape is not this engine's, or which
    /// was made in another boot.
    fn check_spec(&self, spec: &PoolSpec) -> Result<()> {
        if !self.words.oracle.same_boot {
            let boot = boot_id().map_err(|e| PoolError::io("read", liveness::BOOT_ID_PATH, e))?;
            return Err(PoolError::OtherBoot {
                path: self.path.clone(),
                pool_boot: boot_id_text(&stored_boot(&self.words.map)),
                our_boot: boot_id_text(&boot),
            });
        }
        self.check_config(&spec.config)?;
        let g = self.words.geometry;
        for (field, pool, engine) in [
            ("ranks", u64::from(g.ranks), u64::from(spec.geometry.ranks)),
            ("row bytes per rank", self.row_bytes(), spec.row_bytes),
        ] {
            if pool != engine {
                return Err(self.mismatch(field.into(), pool.to_string(), engine.to_string()));
            }
        }
        Ok(())
    }

    pub(crate) fn mismatch(&self, field: String, pool_value: String, engine_value: String) -> PoolError {
        PoolError::Mismatch { pool: self.name.clone(), path: self.path.clone(), field, pool_value, engine_value }
    }

    /// The pool's words (the protocol's [`super::words::PoolWords`]).
    pub fn words(&self) -> &ShmPoolWords {
        &self.words
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The index file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pool's shape.
    pub fn geometry(&self) -> Geometry {
        self.words.geometry
    }

    /// Bytes of a row on one rank.
    pub fn row_bytes(&self) -> u64 {
        self.words.map.page(W::ROW_BYTES).load(Ordering::Relaxed)
    }

    /// The index file's length.
    pub fn file_bytes(&self) -> usize {
        self.words.sec.len
    }

    /// Unix time of creation, in nanoseconds.
    pub fn created_unix_nanos(&self) -> u64 {
        self.words.map.page(W::CREATED).load(Ordering::Relaxed)
    }

    /// Whether the pool was made in this boot.
    pub fn same_boot(&self) -> bool {
        self.words.oracle.same_boot
    }

    /// The pool word (Acquire).
    pub fn pool_word(&self) -> PoolWord {
        PoolWord::decode(self.words.map.page(W::STATE).load(Ordering::Acquire))
    }

    /// CAS of the pool word (AcqRel, Acquire on failure): the protocol's
    /// joins, leaves and `CLOSING`.
    pub fn pool_word_cas(&self, current: PoolWord, new: PoolWord) -> std::result::Result<PoolWord, PoolWord> {
        self.words
            .map
            .page(W::STATE)
            .compare_exchange(current.encode(), new.encode(), Ordering::AcqRel, Ordering::Acquire)
            .map(PoolWord::decode)
            .map_err(PoolWord::decode)
    }

    /// Removes the index file if its name still names this file's inode
    /// (the region's inode-checked unlink); whether it did.
    pub fn unlink_if_ours(&self) -> Result<bool> {
        self.dir
            .unlink_if_inode(&self.file_name, self.dev, self.ino)
            .map_err(|e| PoolError::io("unlink", &self.path, e))
    }
}

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use super::*;
    use crate::region::SHM_PREFIX;

    #[test]
    fn names_follow_the_region_rules_and_never_name_another_pools_file() {
        for ok in ["node", "a.b", "x-1", "v1.2a", &"n".repeat(200)] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("", "empty"),
            (&"n".repeat(201) as &str, "200"),
            ("a/b", "'/'"),
            ("a\0b", "NUL"),
            ("a.index", "index"),
            ("a.0", "data file"),
            ("a.17", "data file"),
        ] {
            let e = check_name(bad).unwrap_err();
            assert!(matches!(e, PoolError::BadName { .. }) && e.to_string().contains(why), "{bad:?}: {e}");
        }
        assert_eq!(index_name("node"), "kvoffload-pool-node.index");
        assert_eq!(format!("{SHM_PREFIX}{}", region_name("node")), "kvoffload-pool-node");
    }
}
