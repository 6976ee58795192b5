//! An engine of a pool model: its scheduler's and ranks' tables, each over
//! a view of its own, and the steps the models take with them (lookup,
//! read, release, claim, a rank's write and completion, store, load, sweep,
//! death), each checked against the record (`super`'s module docs).

use kvoffload::internal::pool::engines::SCHEDULER;
use kvoffload::internal::pool::slot::{SlotState, SlotWord};
use kvoffload::internal::pool::sweep::SweepStep;
use kvoffload::internal::pool::table::{Lookup, Placement, PoolTable};
use kvoffload::internal::pool::words::{Key, LocalPoolWords, Member};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::Arc;

use super::{tag, Pool, View, Who};

/// One engine of a model: its scheduler's and each rank's table over the
/// pool (each a view of its own, so the record knows who calls).
pub struct Engine {
    pub index: u8,
    pool: Arc<Pool>,
    sched: PoolTable<View>,
    ranks: Vec<PoolTable<View>>,
}

/// What [`Engine::store`] did for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// Claimed, every rank's row written and completed: published.
    Published { slot: u32, epoch: u32 },
    /// Readable or being written already.
    Present,
    /// Its set had no claimable slot.
    Skipped,
}

impl Engine {
    /// Engine `index` of `pool` running `variant` (it joined already: see
    /// [`join_all`]).
    pub fn new(pool: &Arc<Pool>, index: u8, variant: Variant) -> Engine {
        Self::with_views(pool, index, variant, false)
    }

    /// [`Engine::new`] whose scheduler's liveness oracle lies (says every
    /// other process is gone).
    pub fn lying(pool: &Arc<Pool>, index: u8, variant: Variant) -> Engine {
        Self::with_views(pool, index, variant, true)
    }

    fn with_views(pool: &Arc<Pool>, index: u8, variant: Variant, lying: bool) -> Engine {
        let table = |v: View| {
            let t = PoolTable::new(v);
            t.set_variant(variant);
            t
        };
        let sched =
            if lying { View::lying(pool, Who::Scheduler(index)) } else { View::new(pool, Who::Scheduler(index)) };
        Engine {
            index,
            pool: pool.clone(),
            sched: table(sched),
            ranks: (0..pool.geometry.ranks).map(|r| table(View::new(pool, Who::Rank(index, r)))).collect(),
        }
    }

    /// The scheduler's table.
    pub fn table(&self) -> &PoolTable<View> {
        &self.sched
    }

    /// The scheduler's process record.
    pub fn me(&self) -> Member {
        LocalPoolWords::process(self.pool.pid(self.index, SCHEDULER))
    }

    /// Looks `key` up: `Some((slot, epoch))` on a hit (held).
    pub fn lookup(&self, key: &Key) -> Option<(u32, u32)> {
        match self.sched.lookup(self.index, key).expect("lookup") {
            Lookup::Hit { slot, epoch, .. } => Some((slot, epoch)),
            Lookup::Pending | Lookup::Miss => None,
        }
    }

    /// Reads every rank's row of a hit on `key` (slot `slot` at `epoch`),
    /// checking each holds `key`'s tag (see the module docs).
    pub fn read(&self, key: &Key, slot: u32, epoch: u32) {
        let ranks = self.pool.geometry.ranks;
        {
            let rec = self.pool.record();
            let w = SlotWord::decode(rec.word[slot as usize]);
            assert!(
                w.state() == SlotState::Readable && w.epoch() == epoch,
                "overwritten while held: engine {} reads slot {slot} held at epoch {epoch}, now {w:?}",
                self.index
            );
            let all = (1u32 << ranks) - 1;
            let done = rec.done[slot as usize];
            assert!(
                done == all,
                "served half-written: read a rank's bytes before they were written (engine {} reads slot {slot} at \
                 epoch {epoch}, ranks complete {done:#b})",
                self.index
            );
            for r in 0..ranks {
                let found = rec.shadow[slot as usize * ranks as usize + r as usize];
                assert!(
                    found == tag(key, epoch, r),
                    "served another key's bytes: engine {} reads {key:?} in slot {slot} at epoch {epoch}, rank {r}'s \
                     row holds {found:#x}, not {:#x}",
                    self.index,
                    tag(key, epoch, r)
                );
            }
        }
        for r in 0..ranks {
            let v = self.pool.row_read(slot, r);
            assert_eq!(v, tag(key, epoch, r), "rank {r}'s row of slot {slot} read another value than its shadow");
        }
    }

    /// Ends the hold of `slot` at `epoch`.
    pub fn release(&self, slot: u32, epoch: u32) {
        if let Err(e) = self.sched.release(self.index, slot, epoch) {
            panic!("lost a live engine's hold: engine {}'s release of slot {slot} at epoch {epoch}: {e}", self.index);
        }
    }

    /// Looks `key` up and, on a hit, reads it and releases it: whether it hit.
    pub fn load(&self, key: &Key) -> bool {
        match self.lookup(key) {
            Some((slot, epoch)) => {
                self.read(key, slot, epoch);
                self.release(slot, epoch);
                true
            }
            None => false,
        }
    }

    /// Claims a slot for `key`; a claim outside the key's two sets is a
    /// failure.
    pub fn claim(&self, key: &Key) -> Placement {
        let p = self.sched.claim(self.index, key).expect("claim");
        match p {
            Placement::Claimed { slot, epoch, evicted } => {
                let g = self.pool.geometry;
                assert!(
                    key.in_set(g.sets(), slot / g.ways),
                    "key outside its sets: {key:?} of sets {:?} claimed slot {slot} (set {})",
                    key.sets(g.sets()),
                    slot / g.ways
                );
                Placement::Claimed { slot, epoch: self.pool.epoch(epoch), evicted }
            }
            other => other,
        }
    }

    /// Rank `rank` writes its row of `key` in `slot` at `epoch` (the checks
    /// of the module docs first).
    pub fn write_rank(&self, key: &Key, slot: u32, epoch: u32, rank: u8) {
        {
            let rec = self.pool.record();
            let w = SlotWord::decode(rec.word[slot as usize]);
            assert!(
                !(w.state() == SlotState::Readable && w.epoch() == epoch),
                "slot {slot} was published at epoch {epoch} before rank {rank} wrote: a hit would read a rank's bytes \
                 before they were written"
            );
            assert!(
                w.state() == SlotState::Writing && w.engine() == self.index && w.epoch() == epoch,
                "two writers in one slot: engine {} rank {rank} writes slot {slot} at epoch {epoch}, the word is {w:?}",
                self.index
            );
            if let Some(h) = rec.holds.iter().find(|h| h.1 == slot) {
                panic!(
                    "overwritten while held: engine {} rank {rank} writes slot {slot} held by engine {} at epoch {}",
                    self.index, h.0, h.2
                );
            }
        }
        self.pool.row_write(slot, rank, tag(key, epoch, rank));
    }

    /// Rank `rank` completes its bytes of `slot` at `epoch`: whether it
    /// published.
    pub fn complete(&self, slot: u32, epoch: u32, rank: u8) -> bool {
        match self.ranks[rank as usize].complete_rank(self.index, slot, epoch, rank) {
            Ok(published) => published,
            Err(e) => {
                let w = self.pool.recorded(slot);
                assert!(
                    !(w.state() == SlotState::Readable && w.epoch() == epoch),
                    "slot {slot} was published at epoch {epoch} before rank {rank} completed: a hit could read a \
                     rank's bytes before they were written"
                );
                panic!("engine {} rank {rank}'s completion of slot {slot} at epoch {epoch}: {e} ({w:?})", self.index)
            }
        }
    }

    /// Stores `key`: claims, every rank writes and completes (rank 0
    /// first).
    pub fn store(&self, key: &Key) -> Stored {
        match self.claim(key) {
            Placement::Claimed { slot, epoch, .. } => {
                for r in 0..self.pool.geometry.ranks {
                    self.write_rank(key, slot, epoch, r);
                    let published = self.complete(slot, epoch, r);
                    assert_eq!(published, r + 1 == self.pool.geometry.ranks, "rank {r}'s completion");
                }
                Stored::Published { slot, epoch }
            }
            Placement::Present => Stored::Present,
            Placement::Skipped => Stored::Skipped,
        }
    }

    /// Sweeps every dead entry, stopping where `step` says (a sweeper's
    /// death): the entries freed.
    pub fn sweep(&self, step: &mut dyn FnMut(SweepStep) -> bool) -> Vec<u8> {
        self.sched.sweep_dead(&self.me(), step).expect("sweep")
    }

    /// The engine's processes die: its model thread returns after this;
    /// the holds it took are gone with it and the oracle says `Gone` of
    /// every member.
    pub fn die(&self) {
        self.pool.record().holds.retain(|h| h.0 != self.index);
        for m in 0..=self.pool.geometry.ranks {
            self.pool.words.kill(self.pool.pid(self.index, m));
        }
    }
}
