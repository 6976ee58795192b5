//! Typed errors of the node pool: its name, its directory, its index file
//! and the fingerprint an engine must match (design 1.3, 2.1). Every error
//! names the pool's file, and what to do where there is something to do.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use super::slot::SlotError;
use crate::region::{FileProblem, RegionError};

/// One engine entry that keeps a pool in use ([`PoolError::InUse`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveEntry {
    /// The entry's index (the engine's bit in slot reader masks).
    pub index: u8,
    /// Pids of its members that live (or cannot be judged: another pid
    /// namespace), and the owner's pid if no member is registered yet.
    pub pids: Vec<u32>,
}

impl std::fmt::Display for LiveEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pids: Vec<String> = self.pids.iter().map(u32::to_string).collect();
        write!(f, "engine {} (pids {})", self.index, pids.join(", "))
    }
}

/// Errors of the node pool's file and fingerprint.
#[derive(Debug, Error)]
pub enum PoolError {
    /// A pool name the files cannot carry.
    #[error("bad pool name {name:?}: {reason}")]
    BadName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The pool's directory is not memory (tmpfs or hugetlbfs).
    #[error(
        "{} is not a tmpfs or hugetlbfs mount (file system magic {magic:#x}): the pool is memory; \
         name a tmpfs directory such as /dev/shm (kvo_region_dir)",
        dir.display()
    )]
    NotTmpfs {
        /// The directory.
        dir: PathBuf,
        /// Its `statfs` magic.
        magic: u64,
    },
    /// A system call on a pool file or its directory failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// The call.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A file under the pool's name that this process must not use (not a
    /// regular file of this user with no group or other bits); left as it
    /// was.
    #[error("refusing {}: {problem}", path.display())]
    Untrusted {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        problem: FileProblem,
    },
    /// No pool of this name in the directory.
    #[error("no kvoffload pool {pool:?} in {} (no {})", dir.display(), path.display())]
    Missing {
        /// The pool's name.
        pool: String,
        /// The directory.
        dir: PathBuf,
        /// The index file looked for.
        path: PathBuf,
    },
    /// `create` found the name taken.
    #[error("{} already exists", path.display())]
    AlreadyExists {
        /// The index file.
        path: PathBuf,
    },
    /// A header field that is not what this version writes (magic,
    /// version, page size).
    #[error(
        "{}: {field} is {found:#x}, expected {expected:#x}: not a pool index of this kvoffload version; \
         remove it (kvoffload pool rm --force NAME) and start again",
        path.display()
    )]
    BadHeader {
        /// The file.
        path: PathBuf,
        /// The field.
        field: &'static str,
        /// What this version writes.
        expected: u64,
        /// What the file holds.
        found: u64,
    },
    /// A value no correct writer leaves (a state code 3, an out-of-range
    /// length, a size that does not match the geometry); left alone.
    #[error("{} is corrupt: {what}; remove it (kvoffload pool rm)", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What was found.
        what: String,
    },
    /// The pool holds KV of another meaning than this engine's (design 1.3).
    #[error(
        "kvoffload pool '{pool}' ({}) holds KV of {field} '{pool_value}'; this engine's is '{engine_value}': \
         name another pool (kvo_pool) or remove this one (kvoffload pool rm {pool})",
        path.display()
    )]
    Mismatch {
        /// The pool's name.
        pool: String,
        /// Its index file.
        path: PathBuf,
        /// The field that differs.
        field: String,
        /// The pool's value.
        pool_value: String,
        /// This engine's value.
        engine_value: String,
    },
    /// A fingerprint string longer than its record holds.
    #[error("{field} is {len} bytes; a pool records at most {max}")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The record's capacity.
        max: usize,
    },
    /// More items (groups, tensors) than a fingerprint record holds.
    #[error("{count} {what}; a pool records at most {max}")]
    TooMany {
        /// What is counted.
        what: &'static str,
        /// How many were given.
        count: usize,
        /// The record's capacity.
        max: usize,
    },
    /// A shape that cannot be a pool's.
    #[error("bad pool geometry: {reason}")]
    BadGeometry {
        /// Why.
        reason: &'static str,
    },
    /// A pool file that is not `READY` (being made, half-made or closing),
    /// seen by `pool ls | rm`, which neither wait nor recover.
    #[error("{}: not ready: {what}", path.display())]
    NotReady {
        /// The file.
        path: PathBuf,
        /// Its state.
        what: String,
    },
    /// A bounded wait ran out.
    #[error("{}: timed out after {timeout:?} waiting for {waiting_for}", path.display())]
    Timeout {
        /// The file.
        path: PathBuf,
        /// What was awaited.
        waiting_for: String,
        /// The bound.
        timeout: Duration,
    },
    /// A wait was interrupted by the caller's check.
    #[error("{}: interrupted waiting for {waiting_for}", path.display())]
    Interrupted {
        /// The file.
        path: PathBuf,
        /// What was awaited.
        waiting_for: String,
    },
    /// The pool was made in another boot of this machine: every process it
    /// records is gone.
    #[error(
        "{} was made in another boot ({pool_boot}; this one is {our_boot}): remove it (kvoffload pool rm)",
        path.display()
    )]
    OtherBoot {
        /// The file.
        path: PathBuf,
        /// The pool's boot id.
        pool_boot: String,
        /// This boot's id.
        our_boot: String,
    },
    /// `pool rm` without `--force` while engines use the pool.
    #[error(
        "kvoffload pool '{pool}' ({}) is in use by {}: stop them first, or remove it anyway with --force \
         (running engines keep their mappings)",
        path.display(),
        entries.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    InUse {
        /// The pool's name.
        pool: String,
        /// Its index file.
        path: PathBuf,
        /// The live entries.
        entries: Vec<LiveEntry>,
    },
    /// A slot word that breaks the slot rules.
    #[error(transparent)]
    Slot(#[from] SlotError),
    /// An error of the region layer (file modes, the data files).
    #[error(transparent)]
    Region(#[from] RegionError),
}

impl PoolError {
    /// An [`PoolError::Io`] of `op` on `path`.
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> PoolError {
        PoolError::Io { op, path: path.into(), source }
    }
}
