//! Where a `kvoffload.Pool`'s words live ([`AnyWords`]): a pool file's
//! mapping, or the in-process words of `kvoffload._testing.local_pool`
//! ([`LocalPool`]); the protocol (`PoolTable`) runs over either, and so
//! does the ranks' pin agreement through an engine's entry
//! ([`agreement_slots`]).

use kvoffload::internal::pool::agreement::EngineSlots;
use kvoffload::internal::pool::file::PoolFile;
use kvoffload::internal::pool::words::{EntryRole, Geometry, Key, Liveness, LocalPoolWords, Member, PoolWords};
use kvoffload::RankSlots;

use super::*;

/// Where a pool's words live: a pool file's mapping, or (tests) the sync
/// facade's atomics shared by the `Pool` objects of one process.
#[derive(Clone)]
pub(crate) enum AnyWords {
    /// A pool file's mapping (`Pool.open`).
    Shm(Arc<PoolFile>),
    /// In-process words (`kvoffload._testing.local_pool`): each `Pool`
    /// object is a "process" with its own pid index.
    Local(Arc<LocalPool>),
}

/// In-process words and the pids handed out so far (tests).
pub(crate) struct LocalPool {
    pub(crate) words: LocalPoolWords,
    next_pid: std::sync::atomic::AtomicU32,
    processes: u32,
}

impl LocalPool {
    /// Pools of `geometry` with room for `processes` `Pool` objects.
    pub(crate) fn new(geometry: Geometry, processes: u32) -> LocalPool {
        LocalPool {
            words: LocalPoolWords::new(geometry, processes as usize),
            next_pid: std::sync::atomic::AtomicU32::new(1),
            processes,
        }
    }

    /// The record of a new "process" (pids 1, 2, ...), None past `processes`.
    pub(crate) fn process(&self) -> Option<Member> {
        let pid = self.next_pid.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (pid <= self.processes).then(|| LocalPoolWords::process(pid))
    }
}

macro_rules! each {
    ($self:ident, $w:ident => $e:expr) => {
        match $self {
            AnyWords::Shm(f) => {
                let $w = f.words();
                $e
            }
            AnyWords::Local(l) => {
                let $w = &l.words;
                $e
            }
        }
    };
}

impl PoolWords for AnyWords {
    fn geometry(&self) -> Geometry {
        each!(self, w => w.geometry())
    }
    fn slot_load(&self, slot: usize) -> u64 {
        each!(self, w => w.slot_load(slot))
    }
    fn slot_cas(&self, slot: usize, current: u64, new: u64) -> Result<u64, u64> {
        each!(self, w => w.slot_cas(slot, current, new))
    }
    fn key_load(&self, slot: usize) -> Key {
        each!(self, w => w.key_load(slot))
    }
    fn key_store(&self, slot: usize, key: &Key) {
        each!(self, w => w.key_store(slot, key))
    }
    fn clock_load(&self, slot: usize) -> bool {
        each!(self, w => w.clock_load(slot))
    }
    fn clock_store(&self, slot: usize, referenced: bool) {
        each!(self, w => w.clock_store(slot, referenced))
    }
    fn hand_next(&self, set: usize) -> u32 {
        each!(self, w => w.hand_next(set))
    }
    fn owner_load(&self, engine: u8) -> u64 {
        each!(self, w => w.owner_load(engine))
    }
    fn owner_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        each!(self, w => w.owner_cas(engine, current, new))
    }
    fn members_load(&self, engine: u8) -> u64 {
        each!(self, w => w.members_load(engine))
    }
    fn members_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        each!(self, w => w.members_cas(engine, current, new))
    }
    fn member_load(&self, engine: u8, member: u8) -> Member {
        each!(self, w => w.member_load(engine, member))
    }
    fn member_store(&self, engine: u8, member: u8, record: &Member) {
        each!(self, w => w.member_store(engine, member, record))
    }
    fn engine_id_load(&self, engine: u8) -> [u64; 4] {
        each!(self, w => w.engine_id_load(engine))
    }
    fn engine_id_store(&self, engine: u8, id: &[u64; 4]) {
        each!(self, w => w.engine_id_store(engine, id))
    }
    fn note_writer(&self, slot: usize, engine: u8) {
        each!(self, w => w.note_writer(slot, engine))
    }
    fn agreement_load(&self, engine: u8, rank: u8) -> u32 {
        each!(self, w => w.agreement_load(engine, rank))
    }
    fn agreement_cas(&self, engine: u8, rank: u8, current: u32, new: u32) -> Result<u32, u32> {
        each!(self, w => w.agreement_cas(engine, rank, current, new))
    }
    fn agreement_store(&self, engine: u8, rank: u8, value: u32) {
        each!(self, w => w.agreement_store(engine, rank, value))
    }
    fn liveness(&self, record: &Member) -> Liveness {
        each!(self, w => w.liveness(record))
    }
    fn hold_entry(&self, engine: u8, role: EntryRole) -> bool {
        each!(self, w => w.hold_entry(engine, role))
    }
    fn release_entry(&self, engine: u8, role: EntryRole) {
        each!(self, w => w.release_entry(engine, role))
    }
    fn named_liveness(&self, engine: u8, role: EntryRole, pid: u32, me: &Member) -> Liveness {
        each!(self, w => w.named_liveness(engine, role, pid, me))
    }
    fn hold_member(&self, engine: u8) -> bool {
        each!(self, w => w.hold_member(engine))
    }
    fn release_member(&self, engine: u8) {
        each!(self, w => w.release_member(engine))
    }
    fn foreign_member_liveness(&self, engine: u8) -> Liveness {
        each!(self, w => w.foreign_member_liveness(engine))
    }
    fn pool_word_rmw(&self) -> u64 {
        each!(self, w => w.pool_word_rmw())
    }
    fn pool_word_load(&self) -> u64 {
        each!(self, w => w.pool_word_load())
    }
    fn pool_word_cas(&self, current: u64, new: u64) -> Result<u64, u64> {
        each!(self, w => w.pool_word_cas(current, new))
    }
    fn hold_closer(&self) -> bool {
        each!(self, w => w.hold_closer())
    }
    fn release_closer(&self) {
        each!(self, w => w.release_closer())
    }
    fn closer_liveness(&self, pid: u32, me: &Member) -> Liveness {
        each!(self, w => w.closer_liveness(pid, me))
    }
}

/// The agreement words (P7) of the engine a process joined (`joined`: its
/// engine index and member, None before `join`) on pool `name`'s `words`,
/// its entry's (`EngineSlots`), for the offloader of rank `rank` of the
/// pool's rows (`Offloader(..., agreement=pool)`): the process must have
/// joined as that rank's worker, so the words are its tenure's (the owner
/// reset them before any other rank could join).
pub(crate) fn agreement_slots(
    py: Python<'_>,
    words: &AnyWords,
    name: &str,
    joined: Option<(u8, u8)>,
    rank: usize,
) -> PyResult<Arc<dyn RankSlots>> {
    let shown = |m: u8| if m == 0 { "the scheduler".to_string() } else { format!("rank {}'s worker", m - 1) };
    let (engine, member) = joined.ok_or_else(|| {
        errors::options(
            py,
            format!(
                "agreement=pool {name:?}: this process has not joined it; join it as rank {rank}'s worker first \
                 (Pool.join(engine_id, rank={rank})): the ranks agree through their engine's entry"
            ),
        )
    })?;
    if usize::from(member) != rank + 1 {
        return Err(errors::options(
            py,
            format!(
                "agreement=pool {name:?}: this process joined it as {}, not as rank {rank}'s worker (the region's rank)",
                shown(member)
            ),
        ));
    }
    let words: Arc<dyn PoolWords> = Arc::new(words.clone());
    let slots = EngineSlots::new(words, engine)
        .ok_or_else(|| errors::options(py, format!("agreement=pool {name:?}: no entry {engine}")))?;
    Ok(Arc::new(slots))
}
