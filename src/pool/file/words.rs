//! The pool's words on the mapping of its index file: [`ShmPoolWords`],
//! the [`PoolWords`] the protocol runs on between processes.
//!
//! Every word is reached as a `core::sync::atomic` view of the mapping
//! (loom cannot model another process, and its atomics cannot live in an
//! mmap'd file), with the orderings `words.rs` documents: slot state,
//! owner and members words Acquire loads and AcqRel compare-and-swaps
//! (Acquire on failure); key words, member records and the engine id
//! Relaxed; CLOCK words and hands Relaxed; an entry's agreement words
//! SeqCst (P7's rule 2).

// Cross-process words on shared memory: `core::sync::atomic`, never the
// sync facade (loom cannot model another process).
#![allow(clippy::disallowed_types)]

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::MmapRaw;

use super::layout::{member_offset, Sections, AGREEMENT_OFFSET, ENGINE_BYTES, ENGINE_ID_OFFSET, SLOT_BYTES, W};
use super::liveness::Oracle;
use super::locks::EntryLocks;
use crate::internal::pool::words::{EntryRole, Geometry, Key, Liveness, Member, PoolWords};

/// The shared mapping of an index file, word by word.
pub(crate) struct PoolMap {
    raw: MmapRaw,
}

impl PoolMap {
    pub(crate) fn new(raw: MmapRaw) -> PoolMap {
        PoolMap { raw }
    }

    /// The mapping's length.
    pub(crate) fn len(&self) -> usize {
        self.raw.len()
    }

    /// The word at byte `off`.
    ///
    /// # Panics
    /// If `off` is not a multiple of 8 or the word is not inside the
    /// mapping (the callers' offsets come from [`Sections`] checked against
    /// the mapping's length, so this is a bug, never a file's content).
    pub(crate) fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(
            off % 8 == 0 && off.checked_add(8).is_some_and(|end| end <= self.raw.len()),
            "word {off:#x} out of the map"
        );
        // SAFETY: the mapping starts on a page boundary and `off` is a
        // multiple of 8, so the pointer is aligned for a u64; the 8 bytes
        // are inside the mapping (checked above); the mapping lives as long
        // as `self`, which the returned reference borrows; every process
        // reaches pool words only through atomics (no non-atomic access of
        // these bytes is ever made through this mapping).
        unsafe { AtomicU64::from_ptr(self.raw.as_mut_ptr().add(off).cast::<u64>()) }
    }

    /// The `u32` at byte `off` (a set hand, an agreement word).
    pub(crate) fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(
            off % 4 == 0 && off.checked_add(4).is_some_and(|end| end <= self.raw.len()),
            "word {off:#x} out of the map"
        );
        // SAFETY: as for `u64_at`: page-aligned base and `off` a multiple of
        // 4 (aligned), in bounds (checked), borrowed from `self`, which owns
        // the mapping; only atomic accesses.
        unsafe { AtomicU32::from_ptr(self.raw.as_mut_ptr().add(off).cast::<u32>()) }
    }

    /// Pool page word `w` ([`W`]).
    pub(crate) fn page(&self, w: usize) -> &AtomicU64 {
        self.u64_at(8 * w)
    }
}

/// A pool's words on its index file's mapping, and its liveness oracle.
pub struct ShmPoolWords {
    pub(crate) map: PoolMap,
    pub(crate) sec: Sections,
    pub(crate) geometry: Geometry,
    pub(crate) oracle: Oracle,
    /// This handle's entry locks (its own descriptor of the index file).
    pub(crate) locks: EntryLocks,
}

/// The writer and time of a slot's last claim (its record's last word;
/// stored by [`PoolWords::note_writer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishNote {
    /// The writing engine's index.
    pub engine: u8,
    /// Unix time of the claim, in milliseconds (56 bits).
    pub unix_ms: u64,
}

impl PublishNote {
    /// The word: `engine + 1` in bits 0-7 (0: never claimed), the time in 8-63.
    pub fn encode(self) -> u64 {
        (self.unix_ms << 8) | ((u64::from(self.engine) + 1) & 0xff)
    }
    /// The note of a word; `None` for a slot never claimed.
    pub fn decode(raw: u64) -> Option<PublishNote> {
        let e = (raw & 0xff) as u8;
        (e != 0).then(|| PublishNote { engine: e - 1, unix_ms: raw >> 8 })
    }
}

impl ShmPoolWords {
    fn slot_word(&self, slot: usize, word: usize) -> &AtomicU64 {
        assert!(slot < self.geometry.slots as usize, "slot {slot} out of range");
        self.map.u64_at(self.sec.slots + slot * SLOT_BYTES + 8 * word)
    }

    fn entry_word(&self, engine: u8, off: usize) -> &AtomicU64 {
        assert!(engine < self.geometry.engines, "engine {engine} out of range");
        self.map.u64_at(self.sec.engines + engine as usize * ENGINE_BYTES + off)
    }

    /// Rank `rank`'s agreement word of entry `engine`.
    fn agreement_word(&self, engine: u8, rank: u8) -> &AtomicU32 {
        assert!(engine < self.geometry.engines, "engine {engine} out of range");
        assert!(rank < self.geometry.ranks, "rank {rank} out of range");
        self.map.u32_at(self.sec.engines + engine as usize * ENGINE_BYTES + AGREEMENT_OFFSET + 4 * rank as usize)
    }

    /// The oracle this mapping judges members with.
    pub fn oracle(&self) -> Oracle {
        self.oracle
    }

    /// Slot `slot`'s writer note (Relaxed: for `pool ls`).
    pub fn publish_load(&self, slot: usize) -> Option<PublishNote> {
        PublishNote::decode(self.slot_word(slot, 7).load(Ordering::Relaxed))
    }

    /// Stores slot `slot`'s writer note (Relaxed; the claimer, before any
    /// rank publishes).
    pub fn publish_store(&self, slot: usize, note: PublishNote) {
        self.slot_word(slot, 7).store(note.encode(), Ordering::Relaxed)
    }
}

impl PoolWords for ShmPoolWords {
    fn geometry(&self) -> Geometry {
        self.geometry
    }
    fn slot_load(&self, slot: usize) -> u64 {
        self.slot_word(slot, 0).load(Ordering::Acquire)
    }
    fn slot_cas(&self, slot: usize, current: u64, new: u64) -> Result<u64, u64> {
        self.slot_word(slot, 0).compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }
    fn key_load(&self, slot: usize) -> Key {
        let w = |i: usize| self.slot_word(slot, 1 + i).load(Ordering::Relaxed);
        Key::from_words([w(0), w(1), w(2), w(3)], w(4))
    }
    fn key_store(&self, slot: usize, key: &Key) {
        for (i, w) in key.hash.iter().enumerate() {
            self.slot_word(slot, 1 + i).store(*w, Ordering::Relaxed);
        }
        self.slot_word(slot, 5).store(key.meta(), Ordering::Relaxed);
    }
    fn clock_load(&self, slot: usize) -> bool {
        self.slot_word(slot, 6).load(Ordering::Relaxed) != 0
    }
    fn clock_store(&self, slot: usize, referenced: bool) {
        self.slot_word(slot, 6).store(u64::from(referenced), Ordering::Relaxed)
    }
    fn hand_next(&self, set: usize) -> u32 {
        assert!(set < self.geometry.sets() as usize, "set {set} out of range");
        self.map.u32_at(self.sec.hands + 4 * set).fetch_add(1, Ordering::Relaxed)
    }
    fn note_writer(&self, slot: usize, engine: u8) {
        let unix_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        self.publish_store(slot, PublishNote { engine, unix_ms });
    }
    fn owner_load(&self, engine: u8) -> u64 {
        self.entry_word(engine, 0).load(Ordering::Acquire)
    }
    fn owner_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        self.entry_word(engine, 0).compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }
    fn members_load(&self, engine: u8) -> u64 {
        self.entry_word(engine, 8).load(Ordering::Acquire)
    }
    fn members_cas(&self, engine: u8, current: u64, new: u64) -> Result<u64, u64> {
        self.entry_word(engine, 8).compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }
    fn member_load(&self, engine: u8, member: u8) -> Member {
        assert!((member as usize) < crate::internal::pool::words::MEMBERS, "member {member} out of range");
        let at = member_offset(member as usize);
        let w = |i: usize| self.entry_word(engine, at + 8 * i).load(Ordering::Relaxed);
        Member { pid: w(0) as u32, start: w(1), pidns: w(2) }
    }
    fn member_store(&self, engine: u8, member: u8, record: &Member) {
        assert!((member as usize) < crate::internal::pool::words::MEMBERS, "member {member} out of range");
        let at = member_offset(member as usize);
        self.entry_word(engine, at).store(u64::from(record.pid), Ordering::Relaxed);
        self.entry_word(engine, at + 8).store(record.start, Ordering::Relaxed);
        self.entry_word(engine, at + 16).store(record.pidns, Ordering::Relaxed);
    }
    fn engine_id_load(&self, engine: u8) -> [u64; 4] {
        [0, 1, 2, 3].map(|i| self.entry_word(engine, ENGINE_ID_OFFSET + 8 * i).load(Ordering::Relaxed))
    }
    fn engine_id_store(&self, engine: u8, id: &[u64; 4]) {
        for (i, w) in id.iter().enumerate() {
            self.entry_word(engine, ENGINE_ID_OFFSET + 8 * i).store(*w, Ordering::Relaxed);
        }
    }
    fn agreement_load(&self, engine: u8, rank: u8) -> u32 {
        self.agreement_word(engine, rank).load(Ordering::SeqCst)
    }
    fn agreement_cas(&self, engine: u8, rank: u8, current: u32, new: u32) -> Result<u32, u32> {
        self.agreement_word(engine, rank).compare_exchange(current, new, Ordering::SeqCst, Ordering::SeqCst)
    }
    fn agreement_store(&self, engine: u8, rank: u8, value: u32) {
        self.agreement_word(engine, rank).store(value, Ordering::SeqCst)
    }
    fn liveness(&self, record: &Member) -> Liveness {
        self.oracle.judge(record)
    }
    fn hold_entry(&self, engine: u8, role: EntryRole) -> bool {
        self.locks.hold(engine, role)
    }
    fn release_entry(&self, engine: u8, role: EntryRole) {
        self.locks.release(engine, role)
    }
    fn named_liveness(&self, engine: u8, role: EntryRole, _pid: u32, _me: &Member) -> Liveness {
        if !self.oracle.same_boot {
            return Liveness::Gone;
        }
        self.locks.probe(engine, role)
    }
    fn hold_member(&self, engine: u8) -> bool {
        self.locks.hold_member(engine)
    }
    fn release_member(&self, engine: u8) {
        self.locks.release_member(engine)
    }
    fn foreign_member_liveness(&self, engine: u8) -> Liveness {
        if !self.oracle.same_boot {
            return Liveness::Gone;
        }
        self.locks.probe_members(engine)
    }
    fn pool_word_rmw(&self) -> u64 {
        self.map.page(W::STATE).fetch_add(0, Ordering::AcqRel)
    }
    fn pool_word_load(&self) -> u64 {
        self.map.page(W::STATE).load(Ordering::Acquire)
    }
    fn pool_word_cas(&self, current: u64, new: u64) -> Result<u64, u64> {
        self.map.page(W::STATE).compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }
    fn hold_closer(&self) -> bool {
        self.locks.hold_closer()
    }
    fn release_closer(&self) {
        self.locks.release_closer()
    }
    fn closer_liveness(&self, _pid: u32, _me: &Member) -> Liveness {
        if !self.oracle.same_boot {
            return Liveness::Gone;
        }
        self.locks.probe_closer()
    }
}

/// The boot id stored in the pool page.
pub(crate) fn stored_boot(map: &PoolMap) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&map.page(W::BOOT).load(Ordering::Relaxed).to_le_bytes());
    b[8..].copy_from_slice(&map.page(W::BOOT + 1).load(Ordering::Relaxed).to_le_bytes());
    b
}

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use super::*;

    #[test]
    fn publish_notes_round_trip() {
        let n = PublishNote { engine: 31, unix_ms: 1_700_000_000_000 };
        assert_eq!(PublishNote::decode(n.encode()), Some(n));
        assert_eq!(PublishNote::decode(0), None);
        assert_eq!(PublishNote::decode(PublishNote { engine: 0, unix_ms: 5 }.encode()).unwrap().engine, 0);
    }
}
