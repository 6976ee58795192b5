//! Making and opening the index file (the module docs of `super`, "Creating
//! and opening"): the creator's steps after `O_EXCL`, an opener's wait for
//! `READY` and its recovery of a half-made file, and the header's checks.

// Cross-process words on shared memory: `core::sync::atomic`, never the
// sync facade (loom cannot model another process).
#![allow(clippy::disallowed_types)]

use core::sync::atomic::Ordering;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::MmapOptions;
use tracing::{debug, info, warn};

use super::layout::{Part, PoolState, PoolWord, Sections, MAGIC, VERSION, W};
use super::liveness::{self, boot_id, boot_id_text, member_of_self, Oracle};
use super::locks::EntryLocks;
use super::words::{stored_boot, PoolMap, ShmPoolWords};
use super::{index_name, page, unix_nanos, PoolFile, PoolOptions, PoolSpec, PoolStep, Wait};
use crate::internal::pool::error::PoolError;
use crate::internal::pool::words::{Geometry, Liveness, Member};
use crate::region::shm::own_pid_namespace;
use crate::region::{check_create_mode, Backoff, FileMeta, OpenFailure, RegionDir, Trust};
use crate::sync::Arc;

type Result<T> = std::result::Result<T, PoolError>;

/// What an attempt to create found.
pub(super) enum Created {
    Made(PoolFile),
    /// The name is taken: the directory, and the path for the error.
    Taken(RegionDir, PathBuf),
}

/// What an attempt to open an existing file found.
pub(super) enum Opened {
    Ready(Box<PoolFile>),
    /// Half-made, closing or never sized: removed (or found gone), or no
    /// such file: create it (in this directory).
    Absent(RegionDir),
}

impl PoolFile {
    /// Creates the file in `dir`; a name taken gives the directory back.
    pub(super) fn create_in(
        dir: RegionDir,
        unit: usize,
        name: &str,
        spec: &PoolSpec,
        opts: &PoolOptions,
    ) -> Result<Created> {
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
        let made = file
            .set_len(sec.len as u64)
            .map_err(|e| PoolError::io("ftruncate", &path, e))
            .and_then(|()| MmapOptions::new().len(sec.len).map_raw(&file).map_err(|e| PoolError::io("mmap", &path, e)))
            .and_then(|raw| Ok((raw, file.try_clone().map_err(|e| PoolError::io("dup", &path, e))?)));
        let (raw, dup) = match made {
            Ok(made) => made,
            Err(e) => {
                remove(&dir);
                return Err(e);
            }
        };
        let map = PoolMap::new(raw);
        let oracle = Oracle { same_boot: true, own_pidns: own_pid_namespace() };
        let words = Arc::new(ShmPoolWords { map, sec, geometry: g, oracle, locks: EntryLocks::new(dup) });
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
    pub(super) fn open_ready(
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
                // `pool::closing`: a tentative close may yet keep the pool
                // (a join meets it and waits); a removal is waited for, and
                // a fresh pool made once its index file is gone. `pool ls |
                // rm` take it as it is (rm takes a dead remover's place).
                PoolState::Closing => {
                    let c = w.closer().expect("a CLOSING word names its closer");
                    if !recover || !c.removing {
                        break w;
                    }
                    let probe = EntryLocks::new(file.try_clone().map_err(|e| PoolError::io("dup", &path, e))?);
                    if probe.probe_closer() == Liveness::Gone {
                        // Its remover is gone: this opener finishes the removal.
                        break w;
                    }
                    if wait.is_interrupted() {
                        return Err(PoolError::Interrupted {
                            path,
                            waiting_for: format!("pid {} to remove the pool", c.pid),
                        });
                    }
                    if !backoff.wait() {
                        return Err(PoolError::Timeout {
                            path,
                            waiting_for: format!("pid {} to remove the pool", c.pid),
                            timeout: wait.timeout,
                        });
                    }
                    // Look again (the caller comes back here while the file
                    // is there: its create finds the name taken).
                    return Ok(Opened::Absent(dir));
                }
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
        if recover && word.is_removing() {
            // A remover gone midway: its removal finished here.
            warn!(path = %path.display(), ?word, "finishing the removal of a pool whose remover is gone");
            pool.close_and_remove(true, wait)?;
            let (dir, _) = super::open_dir(&opts.dir)?;
            return Ok(Opened::Absent(dir));
        }
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
            words: Arc::new(ShmPoolWords {
                map,
                sec,
                geometry: g,
                oracle,
                locks: EntryLocks::new(file.try_clone().map_err(|e| PoolError::io("dup", path, e))?),
            }),
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
    pub(super) fn check_spec(&self, spec: &PoolSpec) -> Result<()> {
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
}
