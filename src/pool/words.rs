//! Where the pool's words live (design 4): the protocol of
//! [`super::table`] and [`super::engines`] is written once over
//! [`PoolWords`], the loads and compare-and-swaps of the slot, key, CLOCK,
//! hand and engine-table words, plus a liveness oracle. Two implementations:
//!
//! - the mapping of a pool file (`super::file`): `core` atomics on shared
//!   memory, liveness from `/proc` and `kill(pid, 0)`;
//! - [`LocalPoolWords`]: atomics of the `sync` facade, so loom and shuttle
//!   explore the protocol (a process is a thread, its death a flag).
//!
//! Orderings are the trait's contract (design 3.8), so every implementation
//! gives the same ones: slot state, owner and members words are loaded with
//! Acquire and changed by CAS with AcqRel (Acquire on failure); key words,
//! member records and the engine id are Relaxed, ordered by the state,
//! members or owner word that a transition publishes them with; CLOCK bits
//! and hands are Relaxed hints. The agreement words of an entry (P7, one
//! per rank: [`super::agreement`]) are SeqCst, as
//! [`RankSlots`](crate::protocol::agreement::RankSlots) requires: a rank
//! stores its own word and then loads its peers'.

use super::slot::{MAX_ENGINES, MAX_RANKS};

mod local;
pub use local::LocalPoolWords;

/// A pool's shape: slots, ways per set, ranks per engine, engine entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Slots (rows of the data, records of the index): a multiple of `ways`.
    pub slots: u32,
    /// Slots per set (`W`, design 2.3).
    pub ways: u32,
    /// Ranks of every engine on this pool (tensor-parallel size x ...):
    /// each rank holds its share of every row.
    pub ranks: u8,
    /// Engine entries (at most [`MAX_ENGINES`]).
    pub engines: u8,
}

impl Geometry {
    /// Sets: `slots / ways`.
    pub fn sets(&self) -> u32 {
        self.slots / self.ways
    }

    /// Why this shape cannot be a pool's, if it cannot.
    pub fn check(&self) -> Result<(), &'static str> {
        if self.ways == 0 || self.slots == 0 || self.slots % self.ways != 0 {
            return Err("slots must be a positive multiple of ways");
        }
        if self.ranks == 0 || self.ranks > MAX_RANKS {
            return Err("ranks must be 1..=32");
        }
        if self.engines == 0 || self.engines > MAX_ENGINES {
            return Err("engines must be 1..=32");
        }
        Ok(())
    }
}

/// A key: vLLM's block hash (up to 32 bytes) and its KV-cache group, as
/// five words (design 2.2). Equal keys under one fingerprint name equal
/// bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Key {
    /// The hash bytes, little-endian in four words, zero past `len`.
    pub hash: [u64; 4],
    /// The KV-cache group index.
    pub group: u32,
    /// How many hash bytes are meaningful (1..=32); 0 only in an unwritten
    /// key.
    pub len: u8,
}

impl Key {
    /// The key of `hash` (1 to 32 bytes) in `group`; `None` for an empty or
    /// longer hash.
    pub fn new(hash: &[u8], group: u32) -> Option<Key> {
        if hash.is_empty() || hash.len() > 32 {
            return None;
        }
        let mut bytes = [0u8; 32];
        bytes[..hash.len()].copy_from_slice(hash);
        let mut words = [0u64; 4];
        for (i, w) in words.iter_mut().enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            *w = u64::from_le_bytes(b);
        }
        Some(Key { hash: words, group, len: hash.len() as u8 })
    }

    /// The hash bytes.
    pub fn hash_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32);
        for w in self.hash {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.truncate(self.len as usize);
        out
    }

    /// The fifth word: `len` in bits 32-39, `group` in bits 0-31.
    pub fn meta(&self) -> u64 {
        (u64::from(self.len) << 32) | u64::from(self.group)
    }

    /// The key of four hash words and a meta word (as [`Key::meta`] makes).
    pub fn from_words(hash: [u64; 4], meta: u64) -> Key {
        Key { hash, group: meta as u32, len: (meta >> 32) as u8 }
    }

    /// The two sets this key may live in, in a pool of `sets` sets
    /// (design 2.3): the first is the first 8 hash bytes, little-endian,
    /// mod `sets`; the second the four hash words folded and mixed
    /// (SplitMix64's finalizer, so a short hash spreads too), mod `sets`.
    /// The two are the same set for about one key in `sets`.
    pub fn sets(&self, sets: u32) -> [u32; 2] {
        let n = u64::from(sets.max(1));
        let folded = self.hash[0] ^ self.hash[1] ^ self.hash[2] ^ self.hash[3];
        [(self.hash[0] % n) as u32, (mix64(folded) % n) as u32]
    }

    /// Whether `set` is one of this key's two sets ([`Key::sets`]).
    pub fn in_set(&self, sets: u32, set: u32) -> bool {
        self.sets(sets).contains(&set)
    }
}

/// SplitMix64's finalizer: every input bit moves about half the output's.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One member of an engine entry (the scheduler or a rank's worker): the
/// process whose death the liveness oracle judges (design 2.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Member {
    /// Its pid (0: none recorded).
    pub pid: u32,
    /// Its start time (field 22 of `/proc/<pid>/stat`), so a reused pid is
    /// told apart; 0 when only the pid is known (an owner word's claimer or
    /// sweeper), judged by the pid alone.
    pub start: u64,
    /// The inode of its pid namespace.
    pub pidns: u64,
}

/// What the liveness oracle says of a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// The process runs (or cannot be judged dead).
    Alive,
    /// The process is gone: exited, a zombie, its pid reused, another boot.
    Gone,
    /// The process is of another pid namespace: it cannot be judged.
    Foreign,
}

/// Which process an owner word names (design 3.6): its claimer in `LIVE`,
/// its sweeper in `RECLAIMING`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryRole {
    /// The claimer (the engine's owner, rank 0's worker).
    Owner = 0,
    /// A sweeper, or the last member leaving, reclaiming the entry.
    Sweeper = 1,
}

/// The pool's words (see the module docs for the orderings each method
/// must give). Indices are in range: `slot < slots`, `set < sets`,
/// `engine < engines`, `member <= 32` (0 the scheduler, `1 + r` rank `r`).
pub trait PoolWords: Send + Sync {
    /// The pool's shape.
    fn geometry(&self) -> Geometry;

    /// Slot `slot`'s state word (Acquire).
    fn slot_load(&self, slot: usize) -> u64;
    /// Sets slot `slot`'s state word to `new` if it is `current` (AcqRel,
    /// Acquire on failure); the word found, `Ok(current)` on success.
    fn slot_cas(&self, slot: usize, current: u64, new: u64) -> Result<u64, u64>;
    /// Slot `slot`'s key words (Relaxed).
    fn key_load(&self, slot: usize) -> Key;
    /// Stores slot `slot`'s key words (Relaxed): only its writer, between
    /// its claim and its publish.
    fn key_store(&self, slot: usize, key: &Key);
    /// Slot `slot`'s CLOCK bit (Relaxed: a hint).
    fn clock_load(&self, slot: usize) -> bool;
    /// Sets or clears slot `slot`'s CLOCK bit (Relaxed).
    fn clock_store(&self, slot: usize, referenced: bool);
    /// Set `set`'s CLOCK hand, moved on by one (`fetch_add`, Relaxed).
    fn hand_next(&self, set: usize) -> u32;
    /// Notes that `engine` claimed slot `slot` to write it, with the time
    /// where the words keep one (Relaxed: for `pool ls` and stats, never
    /// decided on).
    fn note_writer(&self, slot: usize, engine: u8);

    /// Engine entry `engine`'s owner word (Acquire).
    fn owner_load(&self, engine: u8) -> u64;
    /// CAS of the owner word (AcqRel, Acquire on failure).
    fn owner_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64>;
    /// Engine entry `engine`'s members word (Acquire).
    fn members_load(&self, engine: u8) -> u64;
    /// CAS of the members word (AcqRel, Acquire on failure).
    fn members_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64>;
    /// Member `member`'s record (Relaxed; read after the members word).
    fn member_load(&self, engine: u8, member: u8) -> Member;
    /// Stores member `member`'s record (Relaxed; before its bit's CAS).
    fn member_store(&self, engine: u8, member: u8, record: &Member);
    /// The digest of the engine id the entry's owner wrote (Relaxed).
    fn engine_id_load(&self, engine: u8) -> [u64; 4];
    /// Stores the entry's engine-id digest (Relaxed; before the owner's
    /// member bit).
    fn engine_id_store(&self, engine: u8, id: &[u64; 4]);
    /// Rank `rank`'s agreement word of entry `engine` (SeqCst; `rank <
    /// ranks`).
    fn agreement_load(&self, engine: u8, rank: u8) -> u32;
    /// CAS of rank `rank`'s agreement word (SeqCst, SeqCst on failure); the
    /// word found, `Ok(current)` on success.
    fn agreement_cas(&self, engine: u8, rank: u8, current: u32, new: u32) -> Result<u32, u32>;
    /// Stores rank `rank`'s agreement word (SeqCst): the owner's reset of
    /// every word at its claim, before its member bit.
    fn agreement_store(&self, engine: u8, rank: u8, value: u32);

    /// Whether `record`'s process lives (the oracle of design 3.6).
    fn liveness(&self, record: &Member) -> Liveness;

    /// Takes this handle's hold on entry `engine` as `role`, before the CAS
    /// that puts its pid in the owner word: the owner's kept until its
    /// leave clears its member bit, a sweeper's until the entry is `FREE` or the
    /// take undone. False when another process holds it: the caller leaves
    /// the entry alone. A pool file's are kernel locks
    /// (`pool::file::locks`); words whose processes all share one pid
    /// namespace (the models', [`LocalPoolWords`]) need none: always true.
    /// No default: every words type says how it judges the owner word.
    fn hold_entry(&self, engine: u8, role: EntryRole) -> bool;

    /// Gives back this handle's hold on entry `engine` as `role`, if it has
    /// one.
    fn release_entry(&self, engine: u8, role: EntryRole);

    /// Whether the process entry `engine`'s owner word names as `role`
    /// (pid `pid`) lives: on a pool file, whether its entry lock is still
    /// held, which no pid namespace or reused pid confuses; where every
    /// process shares one namespace, its pid ([`by_pid_alone`]).
    fn named_liveness(&self, engine: u8, role: EntryRole, pid: u32, me: &Member) -> Liveness;

    /// Takes this process's member hold on entry `engine` (rule 8 of
    /// [`super::sweep`]), before the CAS that sets its member bit: on a
    /// pool file a shared kernel lock on the entry's member byte, counted
    /// per handle (members of one engine in one process share it); false
    /// when it cannot be taken (the join fails). Where every process shares
    /// one pid namespace, none is needed: always true.
    fn hold_member(&self, engine: u8) -> bool;

    /// Gives back one member hold on entry `engine` that this handle took,
    /// after the member's bit is cleared.
    fn release_member(&self, engine: u8);

    /// Whether a member of entry `engine` that its record cannot judge
    /// (another pid namespace: [`Liveness::Foreign`]) may live: on a pool
    /// file, whether any process holds a member hold of the entry (`Gone`
    /// when none does: every member is gone, whatever its namespace); where
    /// every process shares one namespace it is never asked, and answers
    /// `Foreign` (kept, the safe side).
    fn foreign_member_liveness(&self, engine: u8) -> Liveness;

    /// The pool word ([`super::closing::PoolWord`]), read by a
    /// read-modify-write that leaves it as it is (`fetch_add(0)`, AcqRel):
    /// the latest value in the word's order, so a joiner's claim before it
    /// and a closer's CAS on it are ordered one way or the other
    /// ([`super::closing`] rule 1).
    fn pool_word_rmw(&self) -> u64;

    /// The pool word by a plain load (Acquire): for what only reports it
    /// (`pool ls`), never for the join's check, which a load would not
    /// order against a closer's CAS (N53).
    fn pool_word_load(&self) -> u64;

    /// CAS of the pool word (AcqRel, Acquire on failure).
    fn pool_word_cas(&self, current: u64, new: u64) -> Result<u64, u64>;

    /// Takes the pool's closer hold without waiting ([`super::closing`]
    /// rule 3): on a pool file a kernel lock, as [`PoolWords::hold_entry`];
    /// false when another process or thread holds it. Where every process
    /// shares one pid namespace, none is needed: always true.
    fn hold_closer(&self) -> bool;

    /// Gives back this handle's closer hold, if it has it.
    fn release_closer(&self);

    /// Whether the closer the pool word names (pid `pid`) lives: on a pool
    /// file, whether the closer hold is held; else its pid
    /// ([`by_pid_alone`]).
    fn closer_liveness(&self, pid: u32, me: &Member) -> Liveness;
}

/// The owner word's process judged by its pid alone, in `me`'s namespace
/// (start time unknown): exact only where every process shares that
/// namespace (the models, [`LocalPoolWords`]); a pool file judges by its
/// entry locks instead.
pub fn by_pid_alone<W: PoolWords + ?Sized>(words: &W, pid: u32, me: &Member) -> Liveness {
    words.liveness(&Member { pid, start: 0, pidns: me.pidns })
}

/// Members an entry can have: the scheduler and one worker per rank.
pub const MEMBERS: usize = 1 + MAX_RANKS as usize;

/// A borrowed pool's words are its words: a `PoolTable<&ShmPoolWords>`
/// runs the protocol over a mapping that its pool file owns.
impl<T: PoolWords + ?Sized> PoolWords for &T {
    fn geometry(&self) -> Geometry {
        (**self).geometry()
    }
    fn slot_load(&self, slot: usize) -> u64 {
        (**self).slot_load(slot)
    }
    fn slot_cas(&self, slot: usize, current: u64, new: u64) -> Result<u64, u64> {
        (**self).slot_cas(slot, current, new)
    }
    fn key_load(&self, slot: usize) -> Key {
        (**self).key_load(slot)
    }
    fn key_store(&self, slot: usize, key: &Key) {
        (**self).key_store(slot, key)
    }
    fn clock_load(&self, slot: usize) -> bool {
        (**self).clock_load(slot)
    }
    fn clock_store(&self, slot: usize, referenced: bool) {
        (**self).clock_store(slot, referenced)
    }
    fn hand_next(&self, set: usize) -> u32 {
        (**self).hand_next(set)
    }
    fn note_writer(&self, slot: usize, engine: u8) {
        (**self).note_writer(slot, engine)
    }
    fn owner_load(&self, engine: u8) -> u64 {
        (**self).owner_load(engine)
    }
    fn owner_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        (**self).owner_cas(engine, current, new)
    }
    fn members_load(&self, engine: u8) -> u64 {
        (**self).members_load(engine)
    }
    fn members_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        (**self).members_cas(engine, current, new)
    }
    fn member_load(&self, engine: u8, member: u8) -> Member {
        (**self).member_load(engine, member)
    }
    fn member_store(&self, engine: u8, member: u8, record: &Member) {
        (**self).member_store(engine, member, record)
    }
    fn engine_id_load(&self, engine: u8) -> [u64; 4] {
        (**self).engine_id_load(engine)
    }
    fn engine_id_store(&self, engine: u8, id: &[u64; 4]) {
        (**self).engine_id_store(engine, id)
    }
    fn agreement_load(&self, engine: u8, rank: u8) -> u32 {
        (**self).agreement_load(engine, rank)
    }
    fn agreement_cas(&self, engine: u8, rank: u8, current: u32, new: u32) -> Result<u32, u32> {
        (**self).agreement_cas(engine, rank, current, new)
    }
    fn agreement_store(&self, engine: u8, rank: u8, value: u32) {
        (**self).agreement_store(engine, rank, value)
    }
    fn liveness(&self, record: &Member) -> Liveness {
        (**self).liveness(record)
    }
    fn hold_entry(&self, engine: u8, role: EntryRole) -> bool {
        (**self).hold_entry(engine, role)
    }
    fn release_entry(&self, engine: u8, role: EntryRole) {
        (**self).release_entry(engine, role)
    }
    fn named_liveness(&self, engine: u8, role: EntryRole, pid: u32, me: &Member) -> Liveness {
        (**self).named_liveness(engine, role, pid, me)
    }
    fn hold_member(&self, engine: u8) -> bool {
        (**self).hold_member(engine)
    }
    fn release_member(&self, engine: u8) {
        (**self).release_member(engine)
    }
    fn foreign_member_liveness(&self, engine: u8) -> Liveness {
        (**self).foreign_member_liveness(engine)
    }
    fn pool_word_rmw(&self) -> u64 {
        (**self).pool_word_rmw()
    }
    fn pool_word_load(&self) -> u64 {
        (**self).pool_word_load()
    }
    fn pool_word_cas(&self, current: u64, new: u64) -> Result<u64, u64> {
        (**self).pool_word_cas(current, new)
    }
    fn hold_closer(&self) -> bool {
        (**self).hold_closer()
    }
    fn release_closer(&self) {
        (**self).release_closer()
    }
    fn closer_liveness(&self, pid: u32, me: &Member) -> Liveness {
        (**self).closer_liveness(pid, me)
    }
}
