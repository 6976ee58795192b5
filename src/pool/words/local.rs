//! [`LocalPoolWords`]: the pool's words as atomics of the `sync` facade,
//! for the models (loom, shuttle) and the unit tests (the module docs of
//! `super` give the orderings every implementation keeps).

use crate::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use super::{by_pid_alone, EntryRole, Geometry, Key, Liveness, Member, PoolWords, MEMBERS};

/// The pool's words as atomics of the `sync` facade, for the models and
/// unit tests: a process is a thread, whose pid is an index into the
/// liveness flags ([`LocalPoolWords::kill`] marks one dead).
pub struct LocalPoolWords {
    geometry: Geometry,
    slots: Vec<AtomicU64>,
    keys: Vec<[AtomicU64; 5]>,
    clock: Vec<AtomicBool>,
    writers: Vec<AtomicU32>,
    hands: Vec<AtomicU32>,
    owners: Vec<AtomicU64>,
    members: Vec<AtomicU64>,
    records: Vec<[AtomicU64; 3]>,
    ids: Vec<[AtomicU64; 4]>,
    /// `ranks` agreement words per entry (only the ranks the geometry has:
    /// the models stay small).
    agreements: Vec<AtomicU32>,
    alive: Vec<AtomicBool>,
    /// The pool word, `READY` from the start.
    pool: AtomicU64,
}

impl LocalPoolWords {
    /// A fresh pool of `geometry` (every word zero: every slot `FREE` at
    /// epoch 0, every entry `FREE`), with `processes` pids (1..=processes),
    /// all alive. Pid 0 means "none".
    pub fn new(geometry: Geometry, processes: usize) -> Self {
        assert!(geometry.check().is_ok(), "bad geometry {geometry:?}");
        let slots = geometry.slots as usize;
        let engines = geometry.engines as usize;
        let z = || AtomicU64::new(0);
        LocalPoolWords {
            geometry,
            slots: (0..slots).map(|_| z()).collect(),
            keys: (0..slots).map(|_| [z(), z(), z(), z(), z()]).collect(),
            clock: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            writers: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            hands: (0..geometry.sets()).map(|_| AtomicU32::new(0)).collect(),
            owners: (0..engines).map(|_| z()).collect(),
            members: (0..engines).map(|_| z()).collect(),
            records: (0..engines * MEMBERS).map(|_| [z(), z(), z()]).collect(),
            ids: (0..engines).map(|_| [z(), z(), z(), z()]).collect(),
            agreements: (0..engines * geometry.ranks as usize).map(|_| AtomicU32::new(0)).collect(),
            alive: (0..=processes).map(|_| AtomicBool::new(true)).collect(),
            pool: AtomicU64::new(crate::internal::pool::closing::PoolWord::READY.encode()),
        }
    }

    /// The record of a process of this pool: pid `pid`, start time 1, this
    /// pid namespace (1).
    pub fn process(pid: u32) -> Member {
        Member { pid, start: 1, pidns: 1 }
    }

    /// The engine that last claimed slot `slot` (its note), if any.
    pub fn writer(&self, slot: usize) -> Option<u8> {
        match self.writers[slot].load(Ordering::Relaxed) {
            0 => None,
            e => Some((e - 1) as u8),
        }
    }

    /// Marks process `pid` dead (it returned at a step of its choosing):
    /// from now on the oracle says `Gone`.
    pub fn kill(&self, pid: u32) {
        self.alive[pid as usize].store(false, Ordering::Release);
    }

    fn agreement(&self, engine: u8, rank: u8) -> &AtomicU32 {
        assert!(rank < self.geometry.ranks, "rank {rank} out of range");
        &self.agreements[engine as usize * self.geometry.ranks as usize + rank as usize]
    }
}

impl PoolWords for LocalPoolWords {
    fn geometry(&self) -> Geometry {
        self.geometry
    }
    fn slot_load(&self, slot: usize) -> u64 {
        self.slots[slot].load(Ordering::Acquire)
    }
    fn slot_cas(&self, slot: usize, current: u64, new: u64) -> Result<u64, u64> {
        self.slots[slot].compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }
    fn key_load(&self, slot: usize) -> Key {
        let k = &self.keys[slot];
        let w = |i: usize| k[i].load(Ordering::Relaxed);
        Key::from_words([w(0), w(1), w(2), w(3)], w(4))
    }
    fn key_store(&self, slot: usize, key: &Key) {
        let k = &self.keys[slot];
        for (i, w) in key.hash.iter().enumerate() {
            k[i].store(*w, Ordering::Relaxed);
        }
        k[4].store(key.meta(), Ordering::Relaxed);
    }
    fn clock_load(&self, slot: usize) -> bool {
        self.clock[slot].load(Ordering::Relaxed)
    }
    fn clock_store(&self, slot: usize, referenced: bool) {
        self.clock[slot].store(referenced, Ordering::Relaxed)
    }
    fn hand_next(&self, set: usize) -> u32 {
        self.hands[set].fetch_add(1, Ordering::Relaxed)
    }
    fn note_writer(&self, slot: usize, engine: u8) {
        self.writers[slot].store(u32::from(engine) + 1, Ordering::Relaxed)
    }
    fn owner_load(&self, engine: u8) -> u64 {
        self.owners[engine as usize].load(Ordering::Acquire)
    }
    fn owner_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        self.owners[engine as usize].compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }
    fn members_load(&self, engine: u8) -> u64 {
        self.members[engine as usize].load(Ordering::Acquire)
    }
    fn members_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        self.members[engine as usize].compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }
    fn member_load(&self, engine: u8, member: u8) -> Member {
        let r = &self.records[engine as usize * MEMBERS + member as usize];
        Member {
            pid: r[0].load(Ordering::Relaxed) as u32,
            start: r[1].load(Ordering::Relaxed),
            pidns: r[2].load(Ordering::Relaxed),
        }
    }
    fn member_store(&self, engine: u8, member: u8, record: &Member) {
        let r = &self.records[engine as usize * MEMBERS + member as usize];
        r[0].store(u64::from(record.pid), Ordering::Relaxed);
        r[1].store(record.start, Ordering::Relaxed);
        r[2].store(record.pidns, Ordering::Relaxed);
    }
    fn engine_id_load(&self, engine: u8) -> [u64; 4] {
        let r = &self.ids[engine as usize];
        [0, 1, 2, 3].map(|i| r[i].load(Ordering::Relaxed))
    }
    fn engine_id_store(&self, engine: u8, id: &[u64; 4]) {
        let r = &self.ids[engine as usize];
        for (i, w) in id.iter().enumerate() {
            r[i].store(*w, Ordering::Relaxed);
        }
    }
    fn agreement_load(&self, engine: u8, rank: u8) -> u32 {
        self.agreement(engine, rank).load(Ordering::SeqCst)
    }
    fn agreement_cas(&self, engine: u8, rank: u8, current: u32, new: u32) -> Result<u32, u32> {
        self.agreement(engine, rank).compare_exchange(current, new, Ordering::SeqCst, Ordering::SeqCst)
    }
    fn agreement_store(&self, engine: u8, rank: u8, value: u32) {
        self.agreement(engine, rank).store(value, Ordering::SeqCst)
    }
    fn liveness(&self, record: &Member) -> Liveness {
        if record.pidns != 1 {
            return Liveness::Foreign;
        }
        match self.alive.get(record.pid as usize) {
            Some(a) if a.load(Ordering::Acquire) => Liveness::Alive,
            _ => Liveness::Gone,
        }
    }
    // Every process of these words shares one namespace: the pid is exact.
    fn hold_entry(&self, _engine: u8, _role: EntryRole) -> bool {
        true
    }
    fn release_entry(&self, _engine: u8, _role: EntryRole) {}
    fn named_liveness(&self, _engine: u8, _role: EntryRole, pid: u32, me: &Member) -> Liveness {
        by_pid_alone(self, pid, me)
    }
    fn hold_member(&self, _engine: u8) -> bool {
        true
    }
    fn release_member(&self, _engine: u8) {}
    fn foreign_member_liveness(&self, _engine: u8) -> Liveness {
        Liveness::Foreign
    }
    fn pool_word_rmw(&self) -> u64 {
        self.pool.fetch_add(0, Ordering::AcqRel)
    }
    fn pool_word_load(&self) -> u64 {
        self.pool.load(Ordering::Acquire)
    }
    fn pool_word_cas(&self, current: u64, new: u64) -> Result<u64, u64> {
        self.pool.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }
    fn hold_closer(&self) -> bool {
        true
    }
    fn release_closer(&self) {}
    fn closer_liveness(&self, pid: u32, me: &Member) -> Liveness {
        by_pid_alone(self, pid, me)
    }
}
