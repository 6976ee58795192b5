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
mod locks;
mod open;
mod parts;
pub mod words;

use core::sync::atomic::Ordering;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use self::layout::{PoolWord, MIN_PAGE, W};
use self::open::{Created, Opened};
use self::words::ShmPoolWords;
use super::error::PoolError;
use super::fingerprint::ConfigRecord;
use super::words::Geometry;
use crate::region::hugetlb::HUGETLBFS_MAGIC;
use crate::region::shm::name_problem;
use crate::region::{Backoff, RegionDir};
use crate::sync::Arc;

pub use self::admin::{list, list_with, remove, EngineCounts, PoolSummary, Removed, SlotCounts};
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
    if let Some(reason) = name_problem(name) {
        return bad(reason);
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
    /// Shared with the views that outlive a borrow of the file (an
    /// engine's agreement words handed to its offloader: [`PoolFile::shared_words`]);
    /// the mapping lives while any holds it.
    words: Arc<ShmPoolWords>,
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

    pub(crate) fn mismatch(&self, field: String, pool_value: String, engine_value: String) -> PoolError {
        PoolError::Mismatch { pool: self.name.clone(), path: self.path.clone(), field, pool_value, engine_value }
    }

    /// The pool's words (the protocol's [`super::words::PoolWords`]).
    pub fn words(&self) -> &ShmPoolWords {
        &self.words
    }

    /// The pool's words, shared: for a view that must own them (an
    /// engine's agreement words, [`super::agreement::EngineSlots`], which
    /// its offloader holds). The mapping stays while a holder lives, after
    /// this file is dropped too.
    pub fn shared_words(&self) -> Arc<ShmPoolWords> {
        self.words.clone()
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
