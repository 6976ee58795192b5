//! The owner word's process judged by its pid alone, as the pool did
//! before its entry locks (`pool::file::locks`): the negative of the tests
//! that a process of another pid namespace, named in an owner word, is
//! judged alive while it runs; and of the test that a dead member of
//! another pid namespace is swept (the rule before the member locks: never
//! judged, kept for good). Every word is the pool file's; only
//! `hold_entry`, `release_entry`, `named_liveness` and
//! `foreign_member_liveness` are not: no lock, the pid alone.

use kvoffload::internal::pool::file::words::ShmPoolWords;
use kvoffload::internal::pool::words::{by_pid_alone, EntryRole, Geometry, Key, Liveness, Member, PoolWords};

/// A pool file's words without its entry locks.
pub struct PidOnly<'a>(pub &'a ShmPoolWords);

impl PoolWords for PidOnly<'_> {
    fn geometry(&self) -> Geometry {
        self.0.geometry()
    }
    fn slot_load(&self, slot: usize) -> u64 {
        self.0.slot_load(slot)
    }
    fn slot_cas(&self, slot: usize, current: u64, new: u64) -> Result<u64, u64> {
        self.0.slot_cas(slot, current, new)
    }
    fn key_load(&self, slot: usize) -> Key {
        self.0.key_load(slot)
    }
    fn key_store(&self, slot: usize, key: &Key) {
        self.0.key_store(slot, key)
    }
    fn clock_load(&self, slot: usize) -> bool {
        self.0.clock_load(slot)
    }
    fn clock_store(&self, slot: usize, referenced: bool) {
        self.0.clock_store(slot, referenced)
    }
    fn hand_next(&self, set: usize) -> u32 {
        self.0.hand_next(set)
    }
    fn note_writer(&self, slot: usize, engine: u8) {
        self.0.note_writer(slot, engine)
    }
    fn owner_load(&self, engine: u8) -> u64 {
        self.0.owner_load(engine)
    }
    fn owner_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        self.0.owner_cas(engine, current, new)
    }
    fn members_load(&self, engine: u8) -> u64 {
        self.0.members_load(engine)
    }
    fn members_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        self.0.members_cas(engine, current, new)
    }
    fn member_load(&self, engine: u8, member: u8) -> Member {
        self.0.member_load(engine, member)
    }
    fn member_store(&self, engine: u8, member: u8, record: &Member) {
        self.0.member_store(engine, member, record)
    }
    fn engine_id_load(&self, engine: u8) -> [u64; 4] {
        self.0.engine_id_load(engine)
    }
    fn engine_id_store(&self, engine: u8, id: &[u64; 4]) {
        self.0.engine_id_store(engine, id)
    }
    fn agreement_load(&self, engine: u8, rank: u8) -> u32 {
        self.0.agreement_load(engine, rank)
    }
    fn agreement_cas(&self, engine: u8, rank: u8, current: u32, new: u32) -> Result<u32, u32> {
        self.0.agreement_cas(engine, rank, current, new)
    }
    fn agreement_store(&self, engine: u8, rank: u8, value: u32) {
        self.0.agreement_store(engine, rank, value)
    }
    fn liveness(&self, record: &Member) -> Liveness {
        self.0.liveness(record)
    }
    // The rule before the entry locks: no hold, the pid alone.
    fn hold_entry(&self, _engine: u8, _role: EntryRole) -> bool {
        true
    }
    fn release_entry(&self, _engine: u8, _role: EntryRole) {}
    fn named_liveness(&self, _engine: u8, _role: EntryRole, pid: u32, me: &Member) -> Liveness {
        by_pid_alone(self, pid, me)
    }
    fn hold_member(&self, engine: u8) -> bool {
        self.0.hold_member(engine)
    }
    fn release_member(&self, engine: u8) {
        self.0.release_member(engine)
    }
    // The rule before the member locks: a member of another pid namespace
    // is never judged, so a dead one keeps its engine's entry for good.
    fn foreign_member_liveness(&self, _engine: u8) -> Liveness {
        Liveness::Foreign
    }
    fn pool_word_rmw(&self) -> u64 {
        self.0.pool_word_rmw()
    }
    fn pool_word_load(&self) -> u64 {
        self.0.pool_word_load()
    }
    fn pool_word_cas(&self, current: u64, new: u64) -> Result<u64, u64> {
        self.0.pool_word_cas(current, new)
    }
    fn hold_closer(&self) -> bool {
        self.0.hold_closer()
    }
    fn release_closer(&self) {
        self.0.release_closer()
    }
    fn closer_liveness(&self, pid: u32, me: &Member) -> Liveness {
        self.0.closer_liveness(pid, me)
    }
}
