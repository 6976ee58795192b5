//! What `kvoffload pool ls | rm` do (design 1.4): a pool's summary, the
//! pools of a directory, and removing one.
//!
//! Listing writes nothing: it opens each index file as an opener does
//! (never through a link, only a trusted file), maps it and reads its words.
//! Unless asked to reclaim: then each pool's dead engine entries are swept
//! first (design 3.6), by this process as the sweeper, and the entries
//! freed are reported.
//! Removing ([`remove`], and [`PoolFile::close_and_remove`], which the last
//! engine leaving a pool not kept runs) closes the pool first
//! (`pool::closing`: dead engines swept, then, without `force`, removed
//! only while no engine is registered, atomically with respect to a joiner),
//! then checks before it removes: every region file of the pool
//! (`kvoffload-pool-<name>` and its data files `kvoffload-pool-<name>.<k>`)
//! must be a file this user may use (the region's `Trust`, on `fstatat`
//! without following). Then data files, the region's header file and the
//! index file go, in that order, each only if its name still names the
//! inode that was checked. A pool whose file cannot be read as one (being
//! made, corrupt, another version) has no word to close by: `force` only.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::layout::{PoolState, PoolWord};
use super::liveness::member_of_self;
use super::{check_name, index_name, open_dir, region_name, PoolFile, PoolOptions, Wait, INDEX_SUFFIX, POOL_PREFIX};
use crate::internal::pool::closing::Close;
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
    /// Engine entries taken (not `FREE`): engines registered, being swept,
    /// or dead and not swept yet.
    pub registered: u32,
    /// `CLOSING`: the closer the pool word names.
    pub closer: Option<crate::internal::pool::closing::Closer>,
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
                    let judged = match w.liveness(&rec) {
                        // `pool::sweep` rule 8: by the entry's member holds.
                        Liveness::Foreign => w.foreign_member_liveness(e),
                        other => other,
                    };
                    if judged != Liveness::Gone {
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
            registered: (0..w.geometry().engines)
                .filter(|&e| OwnerWord::decode(w.owner_load(e)).state != OwnerState::Free)
                .count() as u32,
            closer: word.closer(),
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

/// How [`PoolFile::close_and_remove`] ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Closed {
    /// The pool's files are removed (or were already gone: `files` empty).
    Removed(Removed),
    /// Engines are registered: the pool stays. The entries, with the pids
    /// judged alive (none for an entry whose members could not be judged).
    InUse(Vec<LiveEntry>),
    /// Another process removes it (the pid the pool word names).
    ByAnother(u32),
}

impl PoolFile {
    /// Closes the pool and removes its files (`pool::closing`): dead
    /// engines are swept first; then, unless `force`, the pool is removed
    /// only if no engine is registered, atomically with respect to engines
    /// joining (a joiner that meets the close leaves and opens the pool
    /// again, a fresh one once this is gone). Waits, bounded by `wait`,
    /// while another closer decides. What `pool rm` and the last engine
    /// leaving a pool not kept (`kvo_pool_keep: false`) run.
    pub fn close_and_remove(&self, force: bool, wait: Wait<'_>) -> Result<Closed> {
        self.close_and_remove_observed(force, wait, &mut |_| ())
    }

    /// [`PoolFile::close_and_remove`], telling `step` each step of the
    /// close it reaches (a crash test stops the process there).
    pub fn close_and_remove_observed(
        &self,
        force: bool,
        wait: Wait<'_>,
        step: &mut dyn FnMut(crate::internal::pool::closing::CloseStep),
    ) -> Result<Closed> {
        let me = member_of_self().map_err(|e| PoolError::io("read", "/proc/self/stat", e))?;
        let table = PoolTable::new(self.words());
        table.sweep_dead(&me, &mut |_| true)?;
        let mut backoff = crate::region::Backoff::new(wait.timeout);
        let mut waited = None;
        let close = table.close_waiting(
            &me,
            force,
            &mut |c| {
                waited = Some(c.pid);
                !wait.is_interrupted() && backoff.wait()
            },
            &mut |s| {
                step(s);
                true
            },
        );
        let close = close.map_err(|e| PoolError::Corrupt { path: self.path().into(), what: e.to_string() })?;
        match close {
            Close::Remove { over } => {
                let over = self.entries_named(&over);
                let mut untouched = true;
                let removed = self.remove_files(&mut untouched);
                if let (Err(e), true) = (&removed, untouched) {
                    // `pool::closing` rule 5: refused before it removed
                    // anything, the removal is given up: the pool is usable.
                    let mine = PoolWord::closing(me.pid, true).encode();
                    let back = self.words().pool_word_cas(mine, PoolWord::READY.encode()).is_ok();
                    tracing::warn!(pool = self.name(), back, "removal refused before any file went: {e}");
                }
                self.words().release_closer();
                let mut removed = removed?;
                removed.forced_over = over;
                tracing::info!(pool = self.name(), files = removed.files.len(), force, "removed pool");
                Ok(Closed::Removed(removed))
            }
            Close::InUse(entries) => Ok(Closed::InUse(self.entries_named(&entries))),
            Close::Busy(c) if c.removing => Ok(Closed::ByAnother(c.pid)),
            Close::Busy(_) | Close::Stopped => {
                let waiting_for = format!("pid {} to close the pool", waited.unwrap_or(0));
                if wait.is_interrupted() {
                    return Err(PoolError::Interrupted { path: self.path().into(), waiting_for });
                }
                Err(PoolError::Timeout { path: self.path().into(), waiting_for, timeout: wait.timeout })
            }
        }
    }

    /// Entries `entries` with the pids [`PoolFile::engines`] judges alive.
    fn entries_named(&self, entries: &[u8]) -> Vec<LiveEntry> {
        let counts = self.engines();
        let judged: Vec<LiveEntry> = counts.live.into_iter().chain(counts.sweeping).collect();
        entries
            .iter()
            .map(|&e| judged.iter().find(|l| l.index == e).cloned().unwrap_or(LiveEntry { index: e, pids: Vec::new() }))
            .collect()
    }

    /// Under the closer's hold, with the word `REMOVING(me)`: the rows'
    /// region (by the region's own rule: every file checked before any is
    /// removed, inode-checked unlinks, under the lock its creator holds
    /// while it makes it), then the index file, if its name still names
    /// this file (else a closer before this one removed it all, and a new
    /// pool of the name may be there: nothing is touched). `untouched` is
    /// left true while nothing was removed (nor the region marked): after
    /// an error, the pool is then as it was.
    fn remove_files(&self, untouched: &mut bool) -> Result<Removed> {
        let mut removed = Removed::default();
        match self.dir.lstat(&self.file_name).map_err(|e| PoolError::io("stat", self.path(), e))? {
            Some(m) if m.dev == self.dev && m.ino == self.ino => {}
            _ => return Ok(removed),
        }
        let dir = self.path().parent().unwrap_or(Path::new("/"));
        let ropts = crate::region::ShmOptions::new().dir(dir).timeout(std::time::Duration::from_secs(10));
        match crate::region::Region::remove_persistent(&region_name(self.name()), &ropts) {
            Ok(paths) => removed.files = paths,
            Err(crate::region::RegionError::NoSuchRegion { .. }) => {}
            Err(e) => {
                *untouched = e.removed_nothing();
                return Err(e.into());
            }
        }
        *untouched = removed.files.is_empty();
        if self.unlink_if_ours()? {
            removed.files.push(self.path().into());
        }
        Ok(removed)
    }
}

/// Removes pool `name` from `dir`: see the module docs. Refuses while an
/// engine is registered ([`PoolError::InUse`]) unless `force`; refuses any
/// untrusted file of it before removing anything. A pool that another
/// process is removing is waited for (10 s at most).
pub fn remove(dir: &Path, name: &str, force: bool) -> Result<Removed> {
    check_name(name)?;
    let opts = PoolOptions::in_dir(dir);
    let rdir = RegionDir::open(dir).map_err(|e| PoolError::io("open (directory)", dir, e))?;
    let trust = Trust::current(opts.allow_group);
    let index = OsString::from(index_name(name));
    let wait = Wait::new(std::time::Duration::from_secs(10));
    // The index: opened as an opener does, closed by the protocol.
    let index_meta = match PoolFile::inspect(name, &opts) {
        Ok(pool) => {
            return match pool.close_and_remove(force, wait)? {
                Closed::Removed(r) if r.files.is_empty() => {
                    Err(PoolError::Missing { pool: name.into(), dir: dir.into(), path: pool.path().into() })
                }
                Closed::Removed(r) => Ok(r),
                Closed::InUse(entries) => {
                    Err(PoolError::InUse { pool: name.into(), path: pool.path().into(), entries })
                }
                Closed::ByAnother(pid) => {
                    Err(PoolError::NotReady { path: pool.path().into(), what: format!("being removed by pid {pid}") })
                }
            };
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
    // No pool word to close by: the rows' region by its own rule, then the
    // index file by the inode checked.
    let ropts = crate::region::ShmOptions::new().dir(dir).timeout(std::time::Duration::from_secs(10));
    let region = match crate::region::Region::remove_persistent(&region_name(name), &ropts) {
        Ok(paths) => paths,
        Err(crate::region::RegionError::NoSuchRegion { .. }) => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    if index_meta.is_none() && region.is_empty() {
        return Err(PoolError::Missing { pool: name.into(), dir: dir.into(), path: rdir.path_of(&index) });
    }
    let mut removed = Removed { forced_over: Vec::new(), files: region };
    if let Some((dev, ino)) = index_meta {
        let path = rdir.path_of(&index);
        if rdir.unlink_if_inode(&index, dev, ino).map_err(|e| PoolError::io("unlink", &path, e))? {
            removed.files.push(path);
        }
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
