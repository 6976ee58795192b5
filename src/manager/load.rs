//! prepare_load and complete_load: reader counts that pin blocks.

use super::block_manager::BlockManager;
use super::error::ManagerError;
use super::key::{BlockKey, Placement, SlotId};
use super::state::BlockState;

impl BlockManager {
    /// Starts loads of `keys`: each gains a reader, which keeps it from
    /// eviction until [`complete_load`](Self::complete_load). Returns the
    /// slots to read, in batch order. Every key must be ready, else nothing
    /// changes and the first offending key is named
    /// ([`ManagerError::NotFound`], [`ManagerError::NotReadable`]).
    pub fn prepare_load(&mut self, keys: &[BlockKey]) -> Result<Vec<Placement>, ManagerError> {
        self.epoch = self.epoch.wrapping_add(1);
        if let Err(e) = self.check_loadable(keys) {
            return self.refuse(e);
        }
        let mut placements = Vec::with_capacity(keys.len());
        for &key in keys {
            if let Some(slot) = self.count_reader(key, true) {
                placements.push(Placement { key, slot });
            }
        }
        self.events.counters.loads_prepared += keys.len() as u64;
        Ok(placements)
    }

    /// Ends loads of `keys`: each loses a reader, and becomes evictable again
    /// when it has none left. Every key must have a load in flight, else
    /// nothing changes and the first offending key is named
    /// ([`ManagerError::NotFound`], [`ManagerError::NoLoadInFlight`]).
    pub fn complete_load(&mut self, keys: &[BlockKey]) -> Result<(), ManagerError> {
        self.epoch = self.epoch.wrapping_add(1);
        if let Err(e) = self.check_reading(keys) {
            return self.refuse(e);
        }
        for &key in keys {
            self.count_reader(key, false);
        }
        self.events.counters.loads_completed += keys.len() as u64;
        Ok(())
    }

    fn check_loadable(&self, keys: &[BlockKey]) -> Result<(), ManagerError> {
        self.check_each(keys, |key, state| match state {
            BlockState::WritePending => Err(ManagerError::NotReadable { key }),
            BlockState::Ready { readers: u32::MAX } => Err(ManagerError::TooManyReaders { key, limit: u32::MAX }),
            BlockState::Ready { .. } => Ok(()),
        })
    }

    fn check_reading(&self, keys: &[BlockKey]) -> Result<(), ManagerError> {
        self.check_each(keys, |key, state| match state {
            BlockState::Ready { readers } if readers > 0 => Ok(()),
            state => Err(ManagerError::NoLoadInFlight { key, state }),
        })
    }

    /// One reader more (`more`) or fewer of `key`'s block when it is ready:
    /// not evictable while it has a reader, evictable again once its last
    /// one ends. Its slot; `None` when there is no such block.
    fn count_reader(&mut self, key: BlockKey, more: bool) -> Option<SlotId> {
        let block = self.blocks.get_mut(&key)?;
        if let BlockState::Ready { readers } = &mut block.state {
            *readers = if more { readers.saturating_add(1) } else { readers.saturating_sub(1) };
            if *readers == u32::from(more) {
                self.policy.set_candidate(key, !more);
            }
        }
        Some(block.slot)
    }
}
