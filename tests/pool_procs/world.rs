//! The world of the crash tests (tests/pool_procs.rs): a pool file of 16
//! slots in 4 sets of 4 ways, 2 ranks, 4 engine entries, in a private
//! /dev/shm directory; beside it a data file of one 64-byte row per slot and
//! rank, mapped by every process, where a writer rank writes its key's
//! pattern before its completion bit; engine B (the parent: its owner, rank
//! 1's worker and scheduler are this process) with keys published in every
//! set and one of each set held; and the checks run after a crash, each
//! returning what it found broken (so a negative can show it failing).

use std::fs::OpenOptions;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use kvoffload::internal::pool::engines::{worker, MembersWord, OwnerState, OwnerWord, SCHEDULER};
use kvoffload::internal::pool::file::liveness::member_of_self;
use kvoffload::internal::pool::file::words::ShmPoolWords;
use kvoffload::internal::pool::file::{PoolFile, PoolSpec};
use kvoffload::internal::pool::slot::{SlotState, SlotWord};
use kvoffload::internal::pool::sweep::Lease;
use kvoffload::internal::pool::table::{Lookup, Placement, PoolTable};
use kvoffload::internal::pool::words::{Geometry, Key, Member, PoolWords};
use memmap2::MmapRaw;

use crate::pool_common::{spec, ShmDir};
use crate::region_common::write_private;

/// The pool's shape: small enough that a set fills (CLOCK runs).
pub const GEOMETRY: Geometry = Geometry { slots: 16, ways: 4, ranks: 2, engines: 4 };
/// Sets of [`GEOMETRY`].
pub const SETS: u32 = 4;
/// Words of a row (64 bytes) on one rank.
pub const ROW_WORDS: usize = 8;
/// The pool's name in the test's directory.
pub const POOL: &str = "node";
/// The data file's name in the test's directory.
pub const ROWS_FILE: &str = "rows";

/// Key `n` of set `set` for the engine tagged `tag` (`b'A'` the child's,
/// `b'B'` the parent's, `b'N'` the survivor's new ones), both of whose two
/// sets are `set`, so the tests decide where every key goes: the first set
/// is the first hash byte (the other bytes of the first word are multiples
/// of 256), the fifth byte is the first that makes the second one `set`.
pub fn key(tag: u8, set: u32, n: u8) -> Key {
    (0..=u8::MAX)
        .map(|j| Key::new(&[set as u8, n, tag, 0x5A, j], 0).unwrap())
        .find(|k| k.sets(SETS) == [set, set])
        .expect("one fifth byte in 256 makes both sets the same")
}

/// Word `i` of rank `rank`'s row of `key` written at `epoch`.
pub fn pattern(key: &Key, epoch: u32, rank: u8, i: usize) -> u64 {
    let mut x = key.hash[0]
        ^ key.hash[1].rotate_left(11)
        ^ key.hash[2].rotate_left(23)
        ^ key.hash[3].rotate_left(37)
        ^ key.meta().rotate_left(47)
        ^ (u64::from(epoch) << 40)
        ^ (u64::from(rank) << 32)
        ^ ((i as u64) << 24);
    // splitmix64's finaliser: neighbouring inputs give unrelated words.
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The data file, mapped: row (slot, rank) at `(slot * ranks + rank) * 64`.
pub struct Rows {
    map: MmapRaw,
}

impl Rows {
    fn bytes() -> usize {
        GEOMETRY.slots as usize * GEOMETRY.ranks as usize * ROW_WORDS * 8
    }

    /// Makes the data file (zeros, mode 0600, `O_EXCL`) in `dir` and maps it.
    pub fn create(dir: &Path) -> Rows {
        write_private(&dir.join(ROWS_FILE), &vec![0; Self::bytes()]);
        Self::open(dir)
    }

    /// Maps the data file of `dir`: opened without following a link, and
    /// used only as a regular file of this user that nobody else may use,
    /// of the expected length.
    pub fn open(dir: &Path) -> Rows {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let path = dir.join(ROWS_FILE);
        let f = OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW).open(&path).unwrap();
        let m = f.metadata().unwrap();
        assert!(
            m.file_type().is_file()
                && m.uid() == rustix::process::getuid().as_raw()
                && m.mode() & 0o077 == 0
                && m.len() == Self::bytes() as u64,
            "{} is not the data file this test made: {m:?}",
            path.display()
        );
        Rows { map: MmapRaw::map_raw(&f).unwrap() }
    }

    fn word(&self, slot: u32, rank: u8, i: usize) -> &AtomicU64 {
        let off = ((slot as usize * GEOMETRY.ranks as usize + rank as usize) * ROW_WORDS + i) * 8;
        assert!(i < ROW_WORDS && off + 8 <= self.map.len(), "row word out of the map");
        // SAFETY: the mapping starts on a page boundary and `off` is a
        // multiple of 8 (aligned for a u64); the word is inside the mapping
        // (checked above), which lives as long as `self`, borrowed by the
        // reference; every process reaches the rows only through atomics.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(off).cast::<u64>()) }
    }

    /// Writes the first `words` words of rank `rank`'s row of `key` at
    /// `epoch` into slot `slot` (Relaxed: the completion CAS orders them).
    pub fn write(&self, slot: u32, rank: u8, key: &Key, epoch: u32, words: usize) {
        for i in 0..words {
            self.word(slot, rank, i).store(pattern(key, epoch, rank, i), Ordering::Relaxed);
        }
    }

    /// Whether rank `rank`'s row of slot `slot` is exactly `key`'s at `epoch`.
    pub fn holds(&self, slot: u32, rank: u8, key: &Key, epoch: u32) -> bool {
        (0..ROW_WORDS).all(|i| self.word(slot, rank, i).load(Ordering::Relaxed) == pattern(key, epoch, rank, i))
    }
}

/// The lease of an engine whose members are all process `me`: its owner
/// (rank 0's worker) and, if `all`, rank 1's worker and its scheduler.
pub fn join(words: &ShmPoolWords, me: &Member, id: [u64; 4], all: bool) -> Lease {
    let t = PoolTable::new(words);
    let lease = t.join_owner(worker(0), me, &id).unwrap();
    if all {
        for m in [worker(1), SCHEDULER] {
            assert_eq!(t.join_member(m, me, &id).unwrap(), Some(lease), "member {m} joins");
        }
    }
    lease
}

/// An engine at work: the protocol over the pool's words, and the rows.
pub struct Engine<'a> {
    pub table: PoolTable<&'a ShmPoolWords>,
    pub lease: Lease,
    pub rows: &'a Rows,
}

impl<'a> Engine<'a> {
    pub fn new(words: &'a ShmPoolWords, lease: Lease, rows: &'a Rows) -> Engine<'a> {
        Engine { table: PoolTable::new(words), lease, rows }
    }

    /// The engine's index.
    pub fn e(&self) -> u8 {
        self.lease.engine
    }

    /// Claims a slot for `key` (it must be claimable).
    pub fn claim(&self, key: &Key) -> (u32, u32) {
        match self.table.claim(self.e(), key).unwrap() {
            Placement::Claimed { slot, epoch, .. } => (slot, epoch),
            other => panic!("engine {} could not claim {key:?}: {other:?}", self.e()),
        }
    }

    /// Rank `rank` writes its whole row, then sets its completion bit;
    /// whether that published the slot.
    pub fn complete(&self, slot: u32, epoch: u32, key: &Key, rank: u8) -> bool {
        self.table.check_writing(self.e(), slot, epoch).unwrap();
        self.rows.write(slot, rank, key, epoch, ROW_WORDS);
        self.table.complete_rank(self.e(), slot, epoch, rank).unwrap()
    }

    /// Stores `key` (design 3.3): claimed, every rank's row written and
    /// completed, the last completion publishing. `Ok(None)` if it is
    /// present already; an error if its set had no claimable slot.
    pub fn store(&self, key: &Key) -> Result<Option<(u32, u32)>, String> {
        match self.table.claim(self.e(), key).map_err(|e| e.to_string())? {
            Placement::Claimed { slot, epoch, .. } => {
                for r in 0..GEOMETRY.ranks {
                    let published = self.complete(slot, epoch, key, r);
                    assert_eq!(published, r + 1 == GEOMETRY.ranks, "published at the last rank only");
                }
                Ok(Some((slot, epoch)))
            }
            Placement::Present => Ok(None),
            Placement::Skipped => Err(format!("engine {} skipped {key:?}: its set had no claimable slot", self.e())),
        }
    }

    /// Looks `key` up and, on a hit, checks every rank's row before a load
    /// would copy it: (slot, epoch, whether this lookup set the bit).
    pub fn load(&self, key: &Key) -> Result<(u32, u32, bool), String> {
        match self.table.lookup(self.e(), key).map_err(|e| e.to_string())? {
            Lookup::Hit { slot, epoch, fresh } => {
                self.table.check_held(self.e(), slot, epoch).map_err(|e| e.to_string())?;
                for r in 0..GEOMETRY.ranks {
                    if !self.rows.holds(slot, r, key, epoch) {
                        return Err(format!("slot {slot} served {key:?} with rank {r}'s row not its bytes (I1)"));
                    }
                }
                Ok((slot, epoch, fresh))
            }
            other => Err(format!("engine {} looked {key:?} up: {other:?}", self.e())),
        }
    }
}

/// The parent's world: the pool, the rows, and engine B with its holds.
pub struct World {
    pub pool: PoolFile,
    pub rows: Rows,
    /// This process's record: B's members and the sweeper's.
    pub me: Member,
    pub b: Lease,
    /// B's holds: key, slot, epoch.
    pub holds: Vec<(Key, u32, u32)>,
    /// The directory (last: removed after the mappings are gone).
    pub dir: ShmDir,
}

impl World {
    /// A pool in a directory of its own, with B joined, keys `B(s, 0)` and
    /// `B(s, 1)` published in every set `s`, and every `B(s, 0)` held.
    pub fn new(tag: &str) -> World {
        let dir = ShmDir::new(tag);
        let spec = PoolSpec { geometry: GEOMETRY, ..spec() };
        let pool = PoolFile::create(POOL, &spec, &dir.opts()).unwrap();
        let rows = Rows::create(dir.path());
        let me = member_of_self().unwrap();
        let b = join(pool.words(), &me, [0xB; 4], true);
        let mut w = World { pool, rows, me, b, holds: vec![], dir };
        let holds = {
            let eng = w.engine();
            let mut holds = vec![];
            for s in 0..SETS {
                for n in 0..2 {
                    eng.store(&key(b'B', s, n)).unwrap().expect("claimed");
                }
                let (slot, epoch, fresh) = eng.load(&key(b'B', s, 0)).unwrap();
                assert!(fresh);
                holds.push((key(b'B', s, 0), slot, epoch));
            }
            holds
        };
        w.holds = holds;
        w
    }

    /// Engine B.
    pub fn engine(&self) -> Engine<'_> {
        Engine::new(self.pool.words(), self.b, &self.rows)
    }

    pub fn words(&self) -> &ShmPoolWords {
        self.pool.words()
    }

    pub fn word(&self, slot: u32) -> SlotWord {
        SlotWord::decode(self.words().slot_load(slot as usize))
    }

    pub fn owner(&self, e: u8) -> OwnerWord {
        OwnerWord::decode(self.words().owner_load(e))
    }

    pub fn members(&self, e: u8) -> MembersWord {
        MembersWord::decode(self.words().members_load(e))
    }

    /// The slot holding `key` (readable or being written), if any.
    pub fn slot_of(&self, key: &Key) -> Option<u32> {
        key.sets(SETS)
            .into_iter()
            .flat_map(|set| set * GEOMETRY.ways..(set + 1) * GEOMETRY.ways)
            .find(|&s| self.word(s).state() != SlotState::Free && self.words().key_load(s as usize) == *key)
    }

    /// The slots that carry a mark of engine `e` (its bit, or it as the
    /// writer), with their words.
    pub fn marks(&self, e: u8) -> Vec<(u32, SlotWord)> {
        (0..GEOMETRY.slots)
            .map(|s| (s, self.word(s)))
            .filter(|(_, w)| match w.state() {
                SlotState::Writing => w.engine() == e,
                SlotState::Readable => w.payload() & (1 << e) != 0,
                _ => false,
            })
            .collect()
    }

    /// Sweeps every dead entry as this process; the entries freed.
    pub fn sweep(&self) -> Vec<u8> {
        PoolTable::new(self.words()).sweep_dead(&self.me, &mut |_| true).unwrap()
    }

    /// What a sweep of dead engine `dead` must have left, given the marks
    /// it had (`before`) and keys it was writing (`half`), with
    /// [`World::invariants`]: its entry `FREE`; each `WRITING` slot of it
    /// `FREE` at its epoch, each of its bits cleared and nothing else
    /// changed; a lookup of each half-written key a miss.
    pub fn swept(&self, dead: u8, before: &[(u32, SlotWord)], half: &[Key]) -> Vec<String> {
        let mut out = Vec::new();
        let o = self.owner(dead);
        if o.state != OwnerState::Free {
            out.push(format!("entry {dead} of the dead engine is {:?}, not FREE", o.state));
        }
        for &(slot, was) in before {
            let want = was.reclaim(dead).unwrap();
            let now = self.word(slot);
            if now != want {
                out.push(format!("slot {slot} was {was:?}, is {now:?}: expected {want:?}"));
            }
        }
        let eng = self.engine();
        for k in half {
            match eng.table.lookup(self.b.engine, k).unwrap() {
                Lookup::Miss => {}
                found => {
                    if let Lookup::Hit { slot, epoch, fresh: true } = found {
                        eng.table.release(self.b.engine, slot, epoch).unwrap();
                    }
                    out.push(format!("a lookup of the half-written key {k:?} found {found:?}, not a miss (I1)"));
                }
            }
        }
        out.extend(self.invariants());
        out
    }

    /// The invariants of a quiescent pool (design 3.9): I4, every mark's
    /// entry `LIVE` or `RECLAIMING`; I1, every `READABLE` slot's rows are
    /// its key's at its epoch on every rank; I2, B's holds are as B took
    /// them; I5 and each word's own, `PoolTable::check`.
    pub fn invariants(&self) -> Vec<String> {
        let mut out = Vec::new();
        let marked = |e: u8, slot: u32, w: SlotWord, out: &mut Vec<String>| {
            let o = self.owner(e);
            if !matches!(o.state, OwnerState::Live | OwnerState::Reclaiming) {
                out.push(format!("slot {slot} ({w:?}) marks engine {e}, whose entry is {:?} (I4)", o.state));
            }
        };
        for slot in 0..GEOMETRY.slots {
            let w = self.word(slot);
            match w.state() {
                SlotState::Writing => marked(w.engine(), slot, w, &mut out),
                SlotState::Readable => {
                    for e in (0..GEOMETRY.engines).filter(|e| w.payload() & (1 << e) != 0) {
                        marked(e, slot, w, &mut out);
                    }
                    let k = self.words().key_load(slot as usize);
                    for r in 0..GEOMETRY.ranks {
                        if !self.rows.holds(slot, r, &k, w.epoch()) {
                            out.push(format!(
                                "slot {slot} is READABLE ({w:?}) but rank {r}'s row is not {k:?}'s bytes (I1)"
                            ));
                        }
                    }
                }
                _ => {}
            }
        }
        for (k, slot, epoch) in &self.holds {
            let w = self.word(*slot);
            let ok = w.state() == SlotState::Readable
                && w.epoch() == *epoch
                && w.payload() & (1 << self.b.engine) != 0
                && self.words().key_load(*slot as usize) == *k;
            if !ok {
                out.push(format!("B's hold of {k:?} in slot {slot} at epoch {epoch} is gone: {w:?} (I2)"));
            }
        }
        if let Err((slot, e)) = PoolTable::new(self.words()).check() {
            out.push(format!("check: slot {slot}: {e}"));
        }
        out
    }

    /// The survivor goes on: in every set it stores and loads the child's
    /// key and two new ones (a set fills, so CLOCK evicts what nobody
    /// holds), each load checking every rank's row; then the invariants.
    pub fn survive(&self) {
        let eng = self.engine();
        for s in 0..SETS {
            for k in [key(b'A', s, 0), key(b'N', s, 0), key(b'N', s, 1)] {
                eng.store(&k).unwrap_or_else(|e| panic!("the survivor cannot store: {e}"));
                let (slot, epoch, fresh) = eng.load(&k).unwrap_or_else(|e| panic!("the survivor cannot load: {e}"));
                if fresh {
                    eng.table.release(self.b.engine, slot, epoch).unwrap();
                }
            }
        }
        let broken = self.invariants();
        assert!(broken.is_empty(), "after the survivor's stores: {broken:#?}");
    }
}
