//! prepare_load and complete_load: reader counts that pin blocks.

use super::batch::check_unique;
use super::block_manager::BlockManager;
use super::error::ManagerError;
use super::key::{BlockKey, Placement};
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
            let Some(block) = self.blocks.get_mut(&key) else {
                continue;
            };
            if let BlockState::Ready { readers } = &mut block.state {
                *readers = readers.saturating_add(1);
                if *readers == 1 {
                    self.policy.set_candidate(key, false);
                }
            }
            placements.push(Placement { key, slot: block.slot });
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
            let Some(block) = self.blocks.get_mut(&key) else {
                continue;
            };
            if let BlockState::Ready { readers } = &mut block.state {
                *readers = readers.saturating_sub(1);
                if *readers == 0 {
                    self.policy.set_candidate(key, true);
                }
            }
        }
        self.events.counters.loads_completed += keys.len() as u64;
        Ok(())
    }

    fn check_loadable(&self, keys: &[BlockKey]) -> Result<(), ManagerError> {
        check_unique(keys)?;
        for &key in keys {
            match self.blocks.get(&key).map(|b| b.state) {
                None => return Err(ManagerError::NotFound { key }),
                Some(BlockState::WritePending) => return Err(ManagerError::NotReadable { key }),
                Some(BlockState::Ready { readers: u32::MAX }) => {
                    return Err(ManagerError::TooManyReaders { key, limit: u32::MAX })
                }
                Some(BlockState::Ready { .. }) => {}
            }
        }
        Ok(())
    }

    fn check_reading(&self, keys: &[BlockKey]) -> Result<(), ManagerError> {
        check_unique(keys)?;
        for &key in keys {
            match self.blocks.get(&key).map(|b| b.state) {
                None => return Err(ManagerError::NotFound { key }),
                Some(BlockState::Ready { readers }) if readers > 0 => {}
                Some(state) => return Err(ManagerError::NoLoadInFlight { key, state }),
            }
        }
        Ok(())
    }
}
