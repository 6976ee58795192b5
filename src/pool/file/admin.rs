//! What `kvoffload pool ls | rm` do (design 1.4): a pool's summary, the
//! pools of a directory, and removing one.
//!
//! Listing writes nothing: it opens each index file as an opener does
//! (never through a link, only a trusted file), maps it and reads its words.
//! Unless asked to reclaim: then each pool's dead engine entries are swept
//! first (design 3.6), by this process as the sweeper, and the entries
//! freed are reported.
//! Removing checks first, removes after: the index file and every region
//! file of the pool (`kvoffload-pool-<name>` and its data files
//! `kvoffload-pool-<name>.<k>`) must be files this user may use (the
//! region's `Trust`, on `fstatat` without following), and without `force`
//! no engine entry may be `LIVE` with a member alive (or of another pid
//! namespace, which cannot be judged). Then data files, the region's header
//! file and the index file go, in that order, each only if its name still
//! names the inode that was checked.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::layout::PoolState;
use super::liveness::member_of_self;
use super::{check_name, index_name, open_dir, region_name, PoolFile, PoolOptions, INDEX_SUFFIX, POOL_PREFIX};
use crate::internal::pool::engines::{MembersWord, OwnerState, OwnerWord};
use crate::internal::pool::error::{LiveEntry, PoolError};
use crate::internal::pool::fingerprint::{ConfigRecord, HashingRecord};
use crate::internal::pool::slot::{SlotState, SlotWord};
use crate::internal::pool::table::PoolTable;
use crate::internal::pool::words::{EntryRole, Liveness, Member, PoolWords};
use crate::region::{FileMeta, RegionDir, Trust};

type Result<T> = std::result::Result<T, PoolError>;

/// Slots by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotCounts {
    /// `FREE`.
    pub free: u64,
    /// `WRITING`.
    pub writing: u64,
    /// `READABLE` (held or not).
    pub readable: u64,
    /// `READABLE` and held by at least one engine.
    pub held: u64,
    /// State code 3 (corrupt).
    pub corrupt: u64,
}

/// Engine entries by what their members are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineCounts {
    /// `LIVE` entries with a member alive or of another pid namespace.
    pub live: Vec<LiveEntry>,
    /// `RECLAIMING` entries whose sweeper (or last leaving member) is at
    /// work: its pid, judged by its entry lock.
    pub sweeping: Vec<LiveEntry>,
    /// `LIVE` entries every member of which is gone, `RECLAIMING` ones
    /// whose sweeper is gone, and corrupt ones.
    pub dead: u32,
}

/// What `pool ls` shows of one pool.
#[derive(Clone, Debug)]
pub struct PoolSummary {
    /// The pool's name.
    pub name: String,
    /// Its index file.
    pub path: PathBuf,
    /// The index file's length.
    pub index_bytes: u64,
    /// Its state.
    pub state: PoolState,
    /// `READY`: registered engines.
    pub registered: u32,
    /// Slots, ways and ranks.
    pub geometry: crate::internal::pool::words::Geometry,
    /// Bytes of a row per rank.
    pub row_bytes: u64,
    /// The config part.
    pub config: ConfigRecord,
    /// The hashing part, once a scheduler filled it.
    pub hashing: Option<HashingRecord>,
    /// Slots by state.
    pub slots: SlotCounts,
    /// Engines live and dead.
    pub engines: EngineCounts,
    /// Unix time of creation, nanoseconds.
    pub created_unix_nanos: u64,
    /// Unix time of the last store, milliseconds.
    pub last_store_unix_ms: Option<u64>,
    /// Made in this boot.
    pub same_boot: bool,
    /// The entries a reclaim freed before this summary was taken (`None`:
    /// no reclaim was asked).
    pub reclaimed: Option<Vec<u8>>,
}

impl PoolFile {
    /// Sweeps every dead engine entry (design 3.6: its slot marks dropped,
    /// a dead writer's slots freed, the entry `FREE`) as a sweeper of this
    /// process's own record; the entries freed. A live entry, or one
    /// another live process is sweeping, is left as it is.
    pub fn reclaim(&self) -> Result<Vec<u8>> {
        let me = member_of_self().map_err(|e| PoolError::io("read", "/proc/self/stat", e))?;
        Ok(PoolTable::new(self.words()).sweep_dead(&me, &mut |_| true)?)
    }

    /// The entries that are `LIVE` with a member alive or unjudgeable, and
    /// how many are dead.
    pub fn engines(&self) -> EngineCounts {
        let w = self.words();
        let mut out = EngineCounts::default();
        // The owner word's process is judged by its entry lock
        // (`pool::file::locks`), which needs no record of ours.
        let me = Member::default();
        for e in 0..w.geometry().engines {
            let owner = OwnerWord::decode(w.owner_load(e));
            match owner.state {
                OwnerState::Free => continue,
                OwnerState::Reclaiming => {
                    if w.named_liveness(e, EntryRole::Sweeper, owner.pid, &me) == Liveness::Gone {
                        out.dead += 1;
                    } else {
                        out.sweeping.push(LiveEntry { index: e, pids: vec![owner.pid] });
                    }
                    continue;
                }
                OwnerState::Invalid => {
                    out.dead += 1;
                    continue;
                }
                OwnerState::Live => {}
            }
            let mask = MembersWord::decode(w.members_load(e)).mask;
            let mut pids = Vec::new();
            for m in 0..crate::internal::pool::words::MEMBERS as u8 {
                if mask & (1 << m) != 0 {
                    let rec = w.member_load(e, m);
                    if w.liveness(&rec) != Liveness::Gone {
                        pids.push(rec.pid);
                    }
                }
            }
            // Claimed, no member registered yet: the claimer, by its lock.
            if mask == 0 && w.named_liveness(e, EntryRole::Owner, owner.pid, &me) != Liveness::Gone {
                pids.push(owner.pid);
            }
            if pids.is_empty() {
                out.dead += 1;
            } else {
                out.live.push(LiveEntry { index: e, pids });
            }
        }
        out
    }

    /// Slots by state.
    pub fn slot_counts(&self) -> SlotCounts {
        let w = self.words();
        let mut c = SlotCounts::default();
        for s in 0..w.geometry().slots as usize {
            let word = SlotWord::decode(w.slot_load(s));
            match word.state() {
                SlotState::Free => c.free += 1,
                SlotState::Writing => c.writing += 1,
                SlotState::Readable => {
                    c.readable += 1;
                    c.held += u64::from(word.payload() != 0);
                }
                SlotState::Invalid => c.corrupt += 1,
            }
        }
        c
    }

    /// What `pool ls` shows of it.
    pub fn summary(&self) -> Result<PoolSummary> {
        let word = self.pool_word();
        let w = self.words();
        let last = (0..w.geometry().slots as usize).filter_map(|s| w.publish_load(s)).map(|n| n.unix_ms).max();
        Ok(PoolSummary {
            name: self.name().into(),
            path: self.path().into(),
            index_bytes: self.file_bytes() as u64,
            state: word.state,
            registered: if word.state == PoolState::Ready { word.value } else { 0 },
            geometry: self.geometry(),
            row_bytes: self.row_bytes(),
            config: self.config()?,
            hashing: self.hashing()?,
            slots: self.slot_counts(),
            engines: self.engines(),
            created_unix_nanos: self.created_unix_nanos(),
            last_store_unix_ms: last,
            same_boot: self.same_boot(),
            reclaimed: None,
        })
    }
}

/// The pools of `dir` (names of their index files, sorted), each with its
/// summary or why it could not be read. Waits for none: a pool being made
/// is reported as not ready. Writes nothing.
pub fn list(dir: &Path) -> Result<Vec<(String, Result<PoolSummary>)>> {
    list_with(dir, false)
}

/// [`list`], and with `reclaim` each readable pool's dead entries swept
/// first ([`PoolFile::reclaim`]), the entries freed in its summary's
/// `reclaimed`.
pub fn list_with(dir: &Path, reclaim: bool) -> Result<Vec<(String, Result<PoolSummary>)>> {
    let (_, _) = open_dir(dir)?;
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| PoolError::io("read directory", dir, e))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = e.file_name().into_string().ok()?;
            Some(n.strip_prefix(POOL_PREFIX)?.strip_suffix(INDEX_SUFFIX)?.to_string())
        })
        .filter(|n| check_name(n).is_ok())
        .collect();
    names.sort();
    let opts = PoolOptions::in_dir(dir);
    Ok(names
        .into_iter()
        .map(|n| {
            let s = PoolFile::inspect(&n, &opts).and_then(|p| {
                let reclaimed = if reclaim { Some(p.reclaim()?) } else { None };
                Ok(PoolSummary { reclaimed, ..p.summary()? })
            });
            (n, s)
        })
        .collect())
}

/// What [`remove`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// The files removed, in order.
    pub files: Vec<PathBuf>,
    /// `LIVE` entries that `force` overrode.
    pub forced_over: Vec<LiveEntry>,
}

/// Removes pool `name` from `dir`: see the module docs. Refuses while an
/// engine is `LIVE` with a member alive ([`PoolError::InUse`]) unless
/// `force`; refuses any untrusted file of it before removing anything.
pub fn remove(dir: &Path, name: &str, force: bool) -> Result<Removed> {
    check_name(name)?;
    let opts = PoolOptions::in_dir(dir);
    let rdir = RegionDir::open(dir).map_err(|e| PoolError::io("open (directory)", dir, e))?;
    let trust = Trust::current(opts.allow_group);
    let index = OsString::from(index_name(name));
    let mut forced_over = Vec::new();
    // The index: opened as an opener does; its engines judged.
    let index_meta = match PoolFile::inspect(name, &opts) {
        Ok(pool) => {
            let counts = pool.engines();
            let live: Vec<LiveEntry> = counts.live.into_iter().chain(counts.sweeping).collect();
            if !live.is_empty() {
                if !force {
                    return Err(PoolError::InUse { pool: name.into(), path: pool.path().into(), entries: live });
                }
                forced_over = live;
            }
            Some((pool.dev, pool.ino))
        }
        Err(PoolError::Missing { .. }) => None,
        // A file being made, corrupt or of another version: only with force.
        Err(e @ (PoolError::Corrupt { .. } | PoolError::BadHeader { .. } | PoolError::NotReady { .. })) => {
            if !force {
                return Err(e);
            }
            lstat_trusted(&rdir, &trust, &index)?.map(|m| (m.dev, m.ino))
        }
        Err(e) => return Err(e),
    };
    // The rows' region: removed by the region's own rule (every file
    // checked before any is removed, inode-checked unlinks, under the lock
    // its creator holds while it makes it), before the index.
    let ropts = crate::region::ShmOptions::new().dir(dir).timeout(std::time::Duration::from_secs(10));
    let region = match crate::region::Region::remove_persistent(&region_name(name), &ropts) {
        Ok(paths) => paths,
        Err(crate::region::RegionError::NoSuchRegion { .. }) => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    if index_meta.is_none() && region.is_empty() {
        return Err(PoolError::Missing { pool: name.into(), dir: dir.into(), path: rdir.path_of(&index) });
    }
    let mut removed = Removed { forced_over, files: region };
    let mut unlink = |n: &OsString, dev: u64, ino: u64| -> Result<()> {
        let path = rdir.path_of(n);
        if rdir.unlink_if_inode(n, dev, ino).map_err(|e| PoolError::io("unlink", &path, e))? {
            removed.files.push(path);
        }
        Ok(())
    };
    if let Some((dev, ino)) = index_meta {
        unlink(&index, dev, ino)?;
    }
    tracing::info!(pool = name, files = removed.files.len(), force, "removed pool");
    Ok(removed)
}

/// `fstatat` of `name` without following, checked against `trust`; `None`
/// if there is no such name.
fn lstat_trusted(dir: &RegionDir, trust: &Trust, name: &OsString) -> Result<Option<FileMeta>> {
    let path = dir.path_of(name);
    match dir.lstat(name).map_err(|e| PoolError::io("stat", &path, e))? {
        None => Ok(None),
        Some(m) => match trust.check(&m) {
            Ok(()) => Ok(Some(m)),
            Err(problem) => Err(PoolError::Untrusted { path, problem }),
        },
    }
}
