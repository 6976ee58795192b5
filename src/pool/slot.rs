//! A slot's state word (docs/node-pool-design.md 2.2) and its transitions
//! (design 3), each one CAS on one `u64`.
//!
//! | bits | field |
//! |---|---|
//! | 0-31 | payload: in `WRITING` the mask of ranks whose bytes are complete, in `READABLE` the mask of engines holding it, 0 in `FREE` |
//! | 32-33 | state: 0 `FREE`, 1 `WRITING`, 2 `READABLE`, 3 not written by this version (refused as corrupt) |
//! | 34-38 | engine: the writer's index in `WRITING`, 0 otherwise |
//! | 39-63 | epoch (25 bits): incremented by every claim, kept by every other transition |
//!
//! A zero word is `FREE` at epoch 0. [`SlotWord`] encodes and decodes the
//! word and computes each transition as a pure function (the new word, or
//! why it does not apply); [`SlotCell`] applies one to an atomic word from
//! the `sync` facade (so loom and shuttle can drive it), retrying a lost CAS
//! with the word it found.
//!
//! Orderings (design 3.8): every CAS is AcqRel on success and Acquire on
//! failure, every load Acquire. Acquire, because a decision reads what the
//! previous writer of the word published (a reader's hold needs the
//! writer's key words and bytes, a claim needs the last holder's finished
//! copy); Release, because each transition publishes what its process did
//! before it (the last rank's copy and the key words before `READABLE`, a
//! reader's finished copy before its release and so before the next claim).
//! Every decision is about this one word, so the single modification order
//! of its RMWs is all the protocol needs: no SeqCst.

use thiserror::Error;

use crate::sync::atomic::{AtomicU64, Ordering};

/// Engines a pool can have: the payload is a 32-bit mask and the writer
/// field 5 bits.
pub const MAX_ENGINES: u8 = 32;
/// Ranks an engine can have: the payload is a 32-bit mask.
pub const MAX_RANKS: u8 = 32;
/// The epoch's width in bits; it wraps modulo `2^EPOCH_BITS` (design 3.7).
pub const EPOCH_BITS: u32 = 25;

const PAYLOAD_MASK: u64 = 0xFFFF_FFFF;
const STATE_SHIFT: u32 = 32;
const STATE_MASK: u64 = 0b11;
const ENGINE_SHIFT: u32 = 34;
const ENGINE_MASK: u64 = 0b1_1111;
const EPOCH_SHIFT: u32 = 39;
const EPOCH_MASK: u64 = (1 << EPOCH_BITS) - 1;

/// A slot's state (bits 32-33 of its word).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Empty: claimable.
    Free,
    /// Claimed by one engine, whose ranks are copying its bytes in.
    Writing,
    /// Published: every rank's bytes are complete; engines may hold it.
    Readable,
    /// Code 3: not written by this version, refused as corrupt.
    Invalid,
}

/// Why a transition did not apply, or why a word breaks an invariant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum SlotError {
    /// The word's state is code 3, which this version never writes.
    #[error("slot word {word:#018x} has state 3: corrupt, left alone")]
    Corrupt {
        /// The raw word found.
        word: u64,
    },
    /// The slot is not in the state the transition starts from.
    #[error("slot is {found:?}, the transition needs {expected:?}")]
    WrongState {
        /// The state the transition starts from.
        expected: SlotState,
        /// The state found.
        found: SlotState,
    },
    /// The slot was claimed again since the caller read its epoch.
    #[error("slot epoch moved: expected {expected}, found {found}")]
    EpochMoved {
        /// The epoch the caller holds.
        expected: u32,
        /// The slot's epoch now.
        found: u32,
    },
    /// The slot is being written by another engine.
    #[error("slot is written by engine {writer}, not engine {engine}")]
    OtherWriter {
        /// The engine that asked.
        engine: u8,
        /// The slot's writer.
        writer: u8,
    },
    /// The slot is held by engines (their mask), so it cannot be evicted.
    #[error("slot is held by engines {holders:#x}")]
    Held {
        /// The holders' mask.
        holders: u32,
    },
    /// A release by an engine whose bit is not set.
    #[error("engine {engine} does not hold the slot")]
    NotHeld {
        /// The engine that asked.
        engine: u8,
    },
    /// A rank reported its bytes complete twice.
    #[error("rank {rank}'s bytes are already complete")]
    RankAlreadyDone {
        /// The rank.
        rank: u8,
    },
    /// An engine index at or past [`MAX_ENGINES`].
    #[error("engine index {engine} is out of range (at most {MAX_ENGINES} engines)")]
    EngineOutOfRange {
        /// The index given.
        engine: u8,
    },
    /// A rank at or past the engine's rank count, or a rank count outside
    /// 1..=[`MAX_RANKS`].
    #[error("rank {rank} is out of range for {ranks} ranks (at most {MAX_RANKS})")]
    RankOutOfRange {
        /// The rank given.
        rank: u8,
        /// The rank count given.
        ranks: u8,
    },
    /// A word that breaks an invariant of design 3.9 (found by [`SlotWord::check`]).
    #[error("slot word {word:#018x} breaks an invariant: {what}")]
    Invariant {
        /// The raw word.
        word: u64,
        /// The invariant broken.
        what: &'static str,
    },
}

/// One slot's state word (design 2.2), by value.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotWord(u64);

impl std::fmt::Debug for SlotWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotWord")
            .field("state", &self.state())
            .field("payload", &format_args!("{:#x}", self.payload()))
            .field("engine", &self.engine())
            .field("epoch", &self.epoch())
            .finish()
    }
}

fn engine_bit(engine: u8) -> Result<u32, SlotError> {
    if engine >= MAX_ENGINES {
        return Err(SlotError::EngineOutOfRange { engine });
    }
    Ok(1 << engine)
}

/// The mask of `ranks` ranks (every rank's bit), refusing a count outside
/// 1..=[`MAX_RANKS`].
fn all_ranks(ranks: u8) -> Result<u32, SlotError> {
    if ranks == 0 || ranks > MAX_RANKS {
        return Err(SlotError::RankOutOfRange { rank: 0, ranks });
    }
    Ok(if ranks == 32 { u32::MAX } else { (1u32 << ranks) - 1 })
}

impl SlotWord {
    /// `FREE` at epoch 0: the zero word.
    pub const ZERO: SlotWord = SlotWord(0);

    /// The word from its raw bits (any bits: [`SlotWord::check`] judges them).
    pub const fn decode(raw: u64) -> Self {
        SlotWord(raw)
    }

    /// The raw bits.
    pub const fn encode(self) -> u64 {
        self.0
    }

    fn pack(state: u64, payload: u32, engine: u8, epoch: u32) -> Self {
        debug_assert!(u64::from(engine) <= ENGINE_MASK && u64::from(epoch) <= EPOCH_MASK);
        SlotWord(
            u64::from(payload)
                | (state << STATE_SHIFT)
                | ((u64::from(engine) & ENGINE_MASK) << ENGINE_SHIFT)
                | ((u64::from(epoch) & EPOCH_MASK) << EPOCH_SHIFT),
        )
    }

    /// `FREE` at `epoch` (taken modulo `2^EPOCH_BITS`).
    pub fn free(epoch: u32) -> Self {
        Self::pack(0, 0, 0, epoch & EPOCH_MASK as u32)
    }

    /// `WRITING` by `engine` (taken modulo 32) at `epoch`, with the ranks
    /// of `done` complete.
    pub fn writing(engine: u8, epoch: u32, done: u32) -> Self {
        Self::pack(1, done, engine & ENGINE_MASK as u8, epoch & EPOCH_MASK as u32)
    }

    /// `READABLE` at `epoch`, held by the engines of `holders`.
    pub fn readable(epoch: u32, holders: u32) -> Self {
        Self::pack(2, holders, 0, epoch & EPOCH_MASK as u32)
    }

    /// The state field.
    pub fn state(self) -> SlotState {
        match (self.0 >> STATE_SHIFT) & STATE_MASK {
            0 => SlotState::Free,
            1 => SlotState::Writing,
            2 => SlotState::Readable,
            _ => SlotState::Invalid,
        }
    }

    /// The payload: completed ranks in `WRITING`, holders in `READABLE`.
    pub fn payload(self) -> u32 {
        (self.0 & PAYLOAD_MASK) as u32
    }

    /// The engine field (the writer in `WRITING`).
    pub fn engine(self) -> u8 {
        ((self.0 >> ENGINE_SHIFT) & ENGINE_MASK) as u8
    }

    /// The epoch.
    pub fn epoch(self) -> u32 {
        ((self.0 >> EPOCH_SHIFT) & EPOCH_MASK) as u32
    }

    /// The epoch after `epoch`'s claim (wrapping at `2^EPOCH_BITS`).
    pub fn next_epoch(epoch: u32) -> u32 {
        epoch.wrapping_add(1) & EPOCH_MASK as u32
    }

    /// The invariants of design 3.9 that one word can break, for a pool of
    /// `engines` engines of `ranks` ranks: state 3 is corrupt; `FREE` has
    /// payload 0; only `WRITING` names a writer, and a writer below
    /// `engines`; a `WRITING` mask within `ranks` and never every rank (the
    /// last rank's CAS publishes); a `READABLE` mask within `engines`.
    pub fn check(self, engines: u8, ranks: u8) -> Result<(), SlotError> {
        let bad = |what| Err(SlotError::Invariant { word: self.0, what });
        if engines == 0 || engines > MAX_ENGINES {
            return Err(SlotError::EngineOutOfRange { engine: engines });
        }
        let all = all_ranks(ranks)?;
        let engine_mask = if engines == 32 { u32::MAX } else { (1u32 << engines) - 1 };
        match self.state() {
            SlotState::Invalid => Err(SlotError::Corrupt { word: self.0 }),
            SlotState::Free if self.payload() != 0 => bad("FREE with a payload"),
            SlotState::Free | SlotState::Readable if self.engine() != 0 => bad("a writer outside WRITING"),
            SlotState::Free => Ok(()),
            SlotState::Writing if self.engine() >= engines => bad("a writer past the engine count"),
            SlotState::Writing if self.payload() & !all != 0 => bad("a rank bit past the rank count"),
            SlotState::Writing if self.payload() == all => bad("WRITING with every rank complete"),
            SlotState::Writing => Ok(()),
            SlotState::Readable if self.payload() & !engine_mask != 0 => bad("a holder past the engine count"),
            SlotState::Readable => Ok(()),
        }
    }

    fn expect(self, expected: SlotState) -> Result<(), SlotError> {
        match self.state() {
            SlotState::Invalid => Err(SlotError::Corrupt { word: self.0 }),
            s if s == expected => Ok(()),
            found => Err(SlotError::WrongState { expected, found }),
        }
    }

    fn expect_epoch(self, expected: u32) -> Result<(), SlotError> {
        match self.epoch() {
            found if found == expected & EPOCH_MASK as u32 => Ok(()),
            found => Err(SlotError::EpochMoved { expected, found }),
        }
    }

    fn expect_writer(self, engine: u8, epoch: u32) -> Result<(), SlotError> {
        engine_bit(engine)?;
        self.expect(SlotState::Writing)?;
        self.expect_epoch(epoch)?;
        match self.engine() {
            writer if writer == engine => Ok(()),
            writer => Err(SlotError::OtherWriter { engine, writer }),
        }
    }

    /// Claim (design 3.3 step 1): `FREE(e) -> WRITING(engine, e + 1, no
    /// ranks)`. Only a `FREE` word is claimed, so of two claimers one fails
    /// (3.4).
    pub fn claim(self, engine: u8) -> Result<SlotWord, SlotError> {
        engine_bit(engine)?;
        self.expect(SlotState::Free)?;
        Ok(Self::writing(engine, Self::next_epoch(self.epoch()), 0))
    }

    /// Rank `rank` of `ranks` finished its bytes (design 3.3 step 2):
    /// `WRITING(engine, epoch, m) -> WRITING(engine, epoch, m | rank)`, or,
    /// when that is every rank, publish: `-> READABLE(epoch, no holders)`.
    pub fn complete_rank(self, engine: u8, epoch: u32, rank: u8, ranks: u8) -> Result<SlotWord, SlotError> {
        let all = all_ranks(ranks)?;
        if rank >= ranks {
            return Err(SlotError::RankOutOfRange { rank, ranks });
        }
        self.expect_writer(engine, epoch)?;
        let bit = 1u32 << rank;
        if self.payload() & bit != 0 {
            return Err(SlotError::RankAlreadyDone { rank });
        }
        let done = self.payload() | bit;
        Ok(if done == all { Self::readable(self.epoch(), 0) } else { Self::writing(engine, self.epoch(), done) })
    }

    /// Abandon a write whose copy failed (design 3.3 step 3):
    /// `WRITING(engine, epoch, *) -> FREE(epoch)`.
    pub fn abandon(self, engine: u8, epoch: u32) -> Result<SlotWord, SlotError> {
        self.expect_writer(engine, epoch)?;
        Ok(Self::free(self.epoch()))
    }

    /// Hold by `engine` (design 3.1 step 2): `READABLE(m, epoch) ->
    /// READABLE(m | engine, epoch)`; a bit already set leaves the word as it
    /// is (only the engine's private count grows).
    pub fn hold(self, engine: u8, epoch: u32) -> Result<SlotWord, SlotError> {
        let bit = engine_bit(engine)?;
        self.expect(SlotState::Readable)?;
        self.expect_epoch(epoch)?;
        Ok(Self::readable(self.epoch(), self.payload() | bit))
    }

    /// Release by `engine` (design 3.2): `READABLE(m, epoch) ->
    /// READABLE(m & !engine, epoch)`, refused if its bit is not set.
    pub fn release(self, engine: u8, epoch: u32) -> Result<SlotWord, SlotError> {
        let bit = engine_bit(engine)?;
        self.expect(SlotState::Readable)?;
        self.expect_epoch(epoch)?;
        if self.payload() & bit == 0 {
            return Err(SlotError::NotHeld { engine });
        }
        Ok(Self::readable(self.epoch(), self.payload() & !bit))
    }

    /// Evict (design 3.5): `READABLE(no holders, epoch) -> FREE(epoch)`,
    /// refused while any engine holds it.
    pub fn evict(self, epoch: u32) -> Result<SlotWord, SlotError> {
        self.expect(SlotState::Readable)?;
        self.expect_epoch(epoch)?;
        if self.payload() != 0 {
            return Err(SlotError::Held { holders: self.payload() });
        }
        Ok(Self::free(self.epoch()))
    }

    /// Claim by eviction, fused (design 3.5): `READABLE(no holders, epoch)
    /// -> WRITING(engine, epoch + 1, no ranks)`, one CAS, so there is no
    /// half-evicted state; refused while any engine holds it.
    pub fn take(self, engine: u8, epoch: u32) -> Result<SlotWord, SlotError> {
        engine_bit(engine)?;
        self.expect(SlotState::Readable)?;
        self.expect_epoch(epoch)?;
        if self.payload() != 0 {
            return Err(SlotError::Held { holders: self.payload() });
        }
        Ok(Self::writing(engine, Self::next_epoch(self.epoch()), 0))
    }

    /// Reclaim a dead engine's marks (design 3.6 step 2): `WRITING(dead, e,
    /// *) -> FREE(e)`; `READABLE` with `dead`'s bit -> the same word without
    /// it. Any other word is left as it is (a sweep run twice is safe).
    pub fn reclaim(self, dead: u8) -> Result<SlotWord, SlotError> {
        let bit = engine_bit(dead)?;
        Ok(match self.state() {
            SlotState::Invalid => return Err(SlotError::Corrupt { word: self.0 }),
            SlotState::Writing if self.engine() == dead => Self::free(self.epoch()),
            SlotState::Readable => Self::readable(self.epoch(), self.payload() & !bit),
            SlotState::Free | SlotState::Writing => self,
        })
    }
}

/// One applied transition: the word found and the word left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// The word the successful CAS replaced (or the word read, when the
    /// transition left it unchanged).
    pub old: SlotWord,
    /// The word now in the slot.
    pub new: SlotWord,
}

/// A slot's state word in memory: an atomic `u64` of the `sync` facade.
#[derive(Debug)]
pub struct SlotCell {
    word: AtomicU64,
}

impl Default for SlotCell {
    fn default() -> Self {
        Self::new(SlotWord::ZERO)
    }
}

impl SlotCell {
    /// A cell holding `word`.
    pub fn new(word: SlotWord) -> Self {
        Self { word: AtomicU64::new(word.encode()) }
    }

    /// The word now (Acquire: a decision on it sees what its last writer
    /// published, design 3.8).
    pub fn load(&self) -> SlotWord {
        SlotWord::decode(self.word.load(Ordering::Acquire))
    }

    /// Applies `f` by CAS, retrying with the word found when the CAS is
    /// lost (another process made progress). A word `f` leaves unchanged is
    /// not written.
    fn update(&self, f: impl Fn(SlotWord) -> Result<SlotWord, SlotError>) -> Result<Step, SlotError> {
        // Acquire: see what the word's last writer published (design 3.8).
        let mut cur = self.word.load(Ordering::Acquire);
        loop {
            let old = SlotWord::decode(cur);
            let new = f(old)?;
            if new == old {
                return Ok(Step { old, new });
            }
            // AcqRel on success: Release publishes this process's work
            // before the transition (a rank's bytes and the key words
            // before READABLE, a finished copy before a release), Acquire
            // sees the previous writer's. Acquire on failure: the word
            // found is decided on again.
            match self.word.compare_exchange_weak(cur, new.encode(), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(Step { old, new }),
                Err(found) => cur = found,
            }
        }
    }

    /// [`SlotWord::claim`] by CAS.
    pub fn claim(&self, engine: u8) -> Result<Step, SlotError> {
        self.update(|w| w.claim(engine))
    }

    /// [`SlotWord::complete_rank`] by CAS; `new.state()` says whether this
    /// rank published.
    pub fn complete_rank(&self, engine: u8, epoch: u32, rank: u8, ranks: u8) -> Result<Step, SlotError> {
        self.update(|w| w.complete_rank(engine, epoch, rank, ranks))
    }

    /// [`SlotWord::abandon`] by CAS.
    pub fn abandon(&self, engine: u8, epoch: u32) -> Result<Step, SlotError> {
        self.update(|w| w.abandon(engine, epoch))
    }

    /// [`SlotWord::hold`] by CAS; `old == new` when the engine already held it.
    pub fn hold(&self, engine: u8, epoch: u32) -> Result<Step, SlotError> {
        self.update(|w| w.hold(engine, epoch))
    }

    /// [`SlotWord::release`] by CAS.
    pub fn release(&self, engine: u8, epoch: u32) -> Result<Step, SlotError> {
        self.update(|w| w.release(engine, epoch))
    }

    /// [`SlotWord::evict`] by CAS.
    pub fn evict(&self, epoch: u32) -> Result<Step, SlotError> {
        self.update(|w| w.evict(epoch))
    }

    /// [`SlotWord::reclaim`] by CAS; `old == new` when `dead` had no mark.
    pub fn reclaim(&self, dead: u8) -> Result<Step, SlotError> {
        self.update(|w| w.reclaim(dead))
    }
}

// Unit tests of each transition and refusal (tests/pool_slot.rs drives
// random sequences against a model).
#[cfg(all(test, not(any(loom, shuttle))))]
mod tests;
