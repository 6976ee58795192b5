//! The fingerprint's parts on the mapping (design 1.3): write-once records
//! behind a state word `UNSET -> FILLING(pid) -> SET`
//! ([`crate::internal::pool::fingerprint::PartWord`]).
//!
//! Filling: the CAS `UNSET(g) -> FILLING(g, pid)` (AcqRel) elects the
//! filler; it stores its record (pid, start time, pid namespace, Relaxed)
//! and then the tag, the `FILLING` word it belongs to (Release), then the
//! record's words (Relaxed), and publishes with the CAS `FILLING(g, pid) ->
//! SET(g)` (AcqRel). A reader loads the state (Acquire) and reads the
//! record only in `SET`.
//!
//! A `FILLING` part is judged by its filler's record once the tag names
//! that word (Acquire: the record is then visible): gone, the part is reset
//! by the CAS `FILLING(g, pid) -> UNSET(g + 1)`, and the filler, if it
//! lived after all, finds its `SET` CAS failing and starts over. Before the
//! tag is stored (a few stores after the electing CAS) the filler is not
//! judged; a tagless part still there when the wait runs out is judged by
//! `kill(pid, 0)` alone, and reset once if that pid is gone.

// Cross-process words on shared memory: `core::sync::atomic`, never the
// sync facade (loom cannot model another process).
#![allow(clippy::disallowed_types)]

use core::sync::atomic::Ordering;

use super::layout::{part_offset, Part, PART_HEADER_WORDS};
use super::liveness::member_of_self;
use super::words::ShmPoolWords;
use super::{PoolFile, Wait};
use crate::internal::pool::error::PoolError;
use crate::internal::pool::fingerprint::{
    first_difference, ConfigRecord, HashingRecord, LayoutRecord, PartState, PartWord,
};
use crate::internal::pool::words::{Liveness, Member};
use crate::region::shm::process_gone;
use crate::region::Backoff;

type Result<T> = std::result::Result<T, PoolError>;

const STATE: usize = 0;
const TAG: usize = 1;
const PID: usize = 2;
const START: usize = 3;
const PIDNS: usize = 4;

impl ShmPoolWords {
    fn part_word_at(&self, p: Part, w: usize) -> &core::sync::atomic::AtomicU64 {
        self.map.u64_at(self.sec.fingerprint + part_offset(p) + 8 * w)
    }

    /// Part `p`'s state word (Acquire).
    pub fn part_word(&self, p: Part) -> PartWord {
        PartWord::decode(self.part_word_at(p, STATE).load(Ordering::Acquire))
    }

    fn read_record(&self, p: Part) -> Vec<u64> {
        (0..p.record_words()).map(|i| self.part_word_at(p, PART_HEADER_WORDS + i).load(Ordering::Relaxed)).collect()
    }

    fn write_record(&self, p: Part, record: &[u64], me: &Member, tag: u64) {
        assert_eq!(record.len(), p.record_words(), "a record of {p:?}");
        self.part_word_at(p, PID).store(u64::from(me.pid), Ordering::Relaxed);
        self.part_word_at(p, START).store(me.start, Ordering::Relaxed);
        self.part_word_at(p, PIDNS).store(me.pidns, Ordering::Relaxed);
        self.part_word_at(p, TAG).store(tag, Ordering::Release);
        for (i, w) in record.iter().enumerate() {
            self.part_word_at(p, PART_HEADER_WORDS + i).store(*w, Ordering::Relaxed);
        }
    }

    /// The creator's config, written before `READY` (which publishes it):
    /// the part `SET` at generation 0 without an election.
    pub(crate) fn write_set_part(&self, p: Part, record: &[u64], me: &Member) {
        let filling = PartWord { state: PartState::Filling, generation: 0, pid: me.pid }.encode();
        self.write_record(p, record, me, filling);
        let set = PartWord { state: PartState::Set, generation: 0, pid: 0 }.encode();
        self.part_word_at(p, STATE).store(set, Ordering::Relaxed);
    }

    /// Part `p`'s record if it is `SET`.
    pub(crate) fn set_record(&self, p: Part) -> Result<Option<Vec<u64>>> {
        let w = self.part_word(p);
        match w.state {
            PartState::Set => Ok(Some(self.read_record(p))),
            PartState::Invalid => Err(PoolError::Corrupt {
                path: Default::default(),
                what: format!("{} has state word {:#x}", p.describe(), w.encode()),
            }),
            _ => Ok(None),
        }
    }

    /// Whether the filler of `raw` (a `FILLING` word) is gone; `None`
    /// before its tag is stored (not judged).
    fn filler_gone(&self, p: Part, raw: u64) -> Option<bool> {
        if self.part_word_at(p, TAG).load(Ordering::Acquire) != raw {
            return None;
        }
        let filler = Member {
            pid: self.part_word_at(p, PID).load(Ordering::Relaxed) as u32,
            start: self.part_word_at(p, START).load(Ordering::Relaxed),
            pidns: self.part_word_at(p, PIDNS).load(Ordering::Relaxed),
        };
        Some(self.oracle.judge(&filler) == Liveness::Gone)
    }

    /// Fills part `p` with `record` if it is unset, else waits for its
    /// filler (bounded by `wait`); returns the record `SET` in it and
    /// whether this call wrote it.
    pub(crate) fn ensure_part(
        &self,
        p: Part,
        record: &[u64],
        wait: Wait<'_>,
        path: &std::path::Path,
    ) -> Result<(Vec<u64>, bool)> {
        let me = member_of_self().map_err(|e| PoolError::io("read", "/proc/self/stat", e))?;
        let state = self.part_word_at(p, STATE);
        let mut backoff = Backoff::new(wait.timeout);
        let mut extended = false;
        loop {
            let raw = state.load(Ordering::Acquire);
            let w = PartWord::decode(raw);
            let reset =
                PartWord { state: PartState::Unset, generation: PartWord::next_generation(w.generation), pid: 0 };
            match w.state {
                PartState::Set => return Ok((self.read_record(p), false)),
                PartState::Invalid => {
                    return Err(PoolError::Corrupt {
                        path: path.into(),
                        what: format!("{} has state word {raw:#x}", p.describe()),
                    })
                }
                PartState::Unset => {
                    let filling =
                        PartWord { state: PartState::Filling, generation: w.generation, pid: me.pid }.encode();
                    if state.compare_exchange(raw, filling, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                        self.write_record(p, record, &me, filling);
                        let set = PartWord { state: PartState::Set, generation: w.generation, pid: 0 }.encode();
                        if state.compare_exchange(filling, set, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                            tracing::debug!(part = ?p, "filled a fingerprint part");
                            return Ok((record.to_vec(), true));
                        }
                        // Reset meanwhile (judged gone): start over.
                    }
                    continue;
                }
                PartState::Filling => {
                    if self.filler_gone(p, raw) == Some(true) {
                        tracing::info!(part = ?p, pid = w.pid, "resetting a fingerprint part whose filler is gone");
                        let _ = state.compare_exchange(raw, reset.encode(), Ordering::AcqRel, Ordering::Acquire);
                        continue;
                    }
                }
            }
            let waiting_for = format!("{} to be filled by pid {}", p.describe(), w.pid);
            if wait.is_interrupted() {
                return Err(PoolError::Interrupted { path: path.into(), waiting_for });
            }
            if !backoff.wait() {
                // A filler that never stored its tag within the whole wait,
                // whose pid is gone: reset once, and wait once more.
                if !extended && self.filler_gone(p, raw).is_none() && process_gone(w.pid) {
                    let _ = state.compare_exchange(raw, reset.encode(), Ordering::AcqRel, Ordering::Acquire);
                    extended = true;
                    backoff = Backoff::new(wait.timeout);
                    continue;
                }
                return Err(PoolError::Timeout { path: path.into(), waiting_for, timeout: wait.timeout });
            }
        }
    }
}

impl PoolFile {
    fn part_corrupt(&self, p: Part, what: String) -> PoolError {
        PoolError::Corrupt { path: self.path.clone(), what: format!("{}: {what}", p.describe()) }
    }

    fn set_or_corrupt(&self, p: Part) -> Result<Option<Vec<u64>>> {
        self.words.set_record(p).map_err(|e| match e {
            PoolError::Corrupt { what, .. } => PoolError::Corrupt { path: self.path.clone(), what },
            e => e,
        })
    }

    /// The config part (`SET` by the creator before `READY`).
    pub fn config(&self) -> Result<ConfigRecord> {
        let words = self
            .set_or_corrupt(Part::Config)?
            .ok_or_else(|| self.part_corrupt(Part::Config, "not set in a READY pool".into()))?;
        ConfigRecord::decode(&words).map_err(|what| self.part_corrupt(Part::Config, what))
    }

    /// Refuses a pool whose config is not `engine`'s, naming the first
    /// field that differs ([`PoolError::Mismatch`]).
    pub fn check_config(&self, engine: &ConfigRecord) -> Result<()> {
        let pool = self.config()?;
        match first_difference(&pool.fields(), &engine.fields()) {
            Some((field, p, e)) => Err(self.mismatch(field, p, e)),
            None => Ok(()),
        }
    }

    /// The hashing part, if a scheduler filled it.
    pub fn hashing(&self) -> Result<Option<HashingRecord>> {
        match self.set_or_corrupt(Part::Hashing)? {
            None => Ok(None),
            Some(w) => HashingRecord::decode(&w).map(Some).map_err(|what| self.part_corrupt(Part::Hashing, what)),
        }
    }

    /// Rank `rank`'s layout part, if its first worker filled it.
    pub fn layout(&self, rank: u8) -> Result<Option<LayoutRecord>> {
        let p = self.layout_part(rank)?;
        match self.set_or_corrupt(p)? {
            None => Ok(None),
            Some(w) => LayoutRecord::decode(&w).map(Some).map_err(|what| self.part_corrupt(p, what)),
        }
    }

    fn layout_part(&self, rank: u8) -> Result<Part> {
        if rank >= self.geometry().ranks {
            return Err(PoolError::BadGeometry { reason: "a layout part of a rank past the pool's ranks" });
        }
        Ok(Part::Layout(rank))
    }

    /// A scheduler's check (design 1.3): fills the hashing part with
    /// `engine`'s if it is unset, else compares. Whether this call filled it.
    pub fn ensure_hashing(&self, engine: &HashingRecord, wait: Wait<'_>) -> Result<bool> {
        let (words, filled) = self.words.ensure_part(Part::Hashing, &engine.encode(), wait, &self.path)?;
        let pool = HashingRecord::decode(&words).map_err(|what| self.part_corrupt(Part::Hashing, what))?;
        match first_difference(&pool.fields(), &engine.fields()) {
            Some((field, p, e)) => Err(self.mismatch(field, p, e)),
            None => Ok(filled),
        }
    }

    /// A worker's check of rank `rank` (design 1.3): fills the rank's
    /// layout part if it is unset, else compares. Whether this call filled it.
    pub fn ensure_layout(&self, rank: u8, engine: &LayoutRecord, wait: Wait<'_>) -> Result<bool> {
        engine.check()?;
        let p = self.layout_part(rank)?;
        let (words, filled) = self.words.ensure_part(p, &engine.encode(), wait, &self.path)?;
        let pool = LayoutRecord::decode(&words).map_err(|what| self.part_corrupt(p, what))?;
        match first_difference(&pool.fields(rank), &engine.fields(rank)) {
            Some((field, pv, e)) => Err(self.mismatch(field, pv, e)),
            None => Ok(filled),
        }
    }
}

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::internal::pool::file::liveness::member_of;
    use crate::internal::pool::file::{PoolOptions, PoolSpec};
    use crate::internal::pool::fingerprint::{FixedStr, GroupRecord};
    use crate::internal::pool::words::Geometry;

    /// A private directory on /dev/shm, removed on drop.
    struct Dir(std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn pool(tag: &str) -> (Dir, PoolFile) {
        let d = std::path::PathBuf::from(format!("/dev/shm/kvo-parts-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir(&d).unwrap();
        let config = crate::internal::pool::fingerprint::ConfigRecord {
            model: FixedStr::new("model", "m").unwrap(),
            kv_dtype: FixedStr::new("dtype", "bfloat16").unwrap(),
            tag: FixedStr::new("kvo_pool_tag", "").unwrap(),
            groups: vec![GroupRecord { tokens_per_block: 16, layer_names_sha256: [1; 32] }],
            tokens_per_hash: 16,
            blocks_per_chunk: 1,
            bytes_per_block: 4096,
            world_size: 1,
            tp_size: 1,
            pp_size: 1,
            pcp_size: 1,
            dcp_size: 1,
            kv_cache_layout: FixedStr::new("kv_cache_layout", "NHD").unwrap(),
            replicated_layout: false,
        };
        let spec =
            PoolSpec { geometry: Geometry { slots: 16, ways: 16, ranks: 1, engines: 2 }, row_bytes: 4096, config };
        let p = PoolFile::create("parts", &spec, &PoolOptions::in_dir(&d)).unwrap();
        (Dir(d), p)
    }

    /// A pid that was a process and is gone (reaped), with its record.
    fn dead_member() -> Member {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let m = member_of(child.id()).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        m
    }

    /// Puts the hashing part in FILLING by `filler`, with its tag (or without).
    fn forge_filling(p: &PoolFile, filler: &Member, tagged: bool) -> u64 {
        let w = p.words();
        let filling = PartWord { state: PartState::Filling, generation: 0, pid: filler.pid }.encode();
        w.part_word_at(Part::Hashing, STATE).store(filling, Ordering::Release);
        if tagged {
            w.write_record(Part::Hashing, &vec![0; Part::Hashing.record_words()], filler, filling);
        }
        filling
    }

    fn hashing() -> HashingRecord {
        HashingRecord::new("sha256", &[9; 32], Some((3, 12))).unwrap()
    }

    #[test]
    fn a_part_whose_filler_is_gone_is_reset_and_filled_again() {
        let (_d, p) = pool("gone");
        forge_filling(&p, &dead_member(), true);
        let t = Instant::now();
        assert!(p.ensure_hashing(&hashing(), Wait::new(Duration::from_secs(30))).unwrap(), "filled by this call");
        assert!(t.elapsed() < Duration::from_secs(10), "judged gone, not waited out: {:?}", t.elapsed());
        let w = p.words().part_word(Part::Hashing);
        assert_eq!((w.state, w.generation), (PartState::Set, 1), "reset once (generation 1), then set");
        assert_eq!(p.hashing().unwrap(), Some(hashing()));
    }

    #[test]
    fn a_part_whose_filler_lives_is_waited_for_and_never_reset() {
        let (_d, p) = pool("alive");
        let me = member_of_self().unwrap();
        let filling = forge_filling(&p, &me, true);
        let e = p.ensure_hashing(&hashing(), Wait::new(Duration::from_millis(200))).unwrap_err();
        assert!(matches!(e, PoolError::Timeout { .. }), "{e}");
        assert_eq!(p.words().part_word_at(Part::Hashing, STATE).load(Ordering::Acquire), filling, "left as it was");
        // The same filler with another start time (its pid reused): gone.
        forge_filling(&p, &Member { start: me.start + 1, ..me }, true);
        assert!(p.ensure_hashing(&hashing(), Wait::new(Duration::from_secs(30))).unwrap());
    }

    #[test]
    fn an_untagged_filler_is_judged_only_when_the_wait_runs_out_and_only_by_its_pid() {
        let (_d, p) = pool("untagged");
        // Alive (ourselves): never reset.
        let filling = forge_filling(&p, &member_of_self().unwrap(), false);
        let e = p.ensure_hashing(&hashing(), Wait::new(Duration::from_millis(200))).unwrap_err();
        assert!(matches!(e, PoolError::Timeout { .. }), "{e}");
        assert_eq!(p.words().part_word_at(Part::Hashing, STATE).load(Ordering::Acquire), filling);
        // Gone: reset after the first wait, filled within the second.
        forge_filling(&p, &dead_member(), false);
        assert!(p.ensure_hashing(&hashing(), Wait::new(Duration::from_millis(200))).unwrap());
    }

    #[test]
    fn parts_are_written_once_and_compared_after() {
        let (_d, p) = pool("once");
        assert_eq!(p.hashing().unwrap(), None);
        assert!(p.ensure_hashing(&hashing(), Wait::new(Duration::from_secs(1))).unwrap());
        assert!(!p.ensure_hashing(&hashing(), Wait::new(Duration::from_secs(1))).unwrap(), "already set");
        let other = HashingRecord::new("sha256_cbor", &[9; 32], None).unwrap();
        let e = p.ensure_hashing(&other, Wait::new(Duration::from_secs(1))).unwrap_err();
        assert!(matches!(&e, PoolError::Mismatch { field, .. } if field == "hash algorithm"), "{e}");
        assert_eq!(p.hashing().unwrap(), Some(hashing()), "a refused engine wrote nothing");
    }
}
