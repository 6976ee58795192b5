//! The fixed set of host slots: who owns each, and which are free.

use super::error::ManagerError;
use super::key::{BlockKey, SlotId};

/// Slot ownership. Free slots are handed out lowest id first at start, then
/// most recently freed first.
#[derive(Clone, Debug)]
pub(crate) struct SlotTable {
    owners: Vec<Option<BlockKey>>,
    free: Vec<SlotId>,
}

impl SlotTable {
    /// A table of `capacity` free slots.
    pub(crate) fn new(capacity: usize) -> Result<Self, ManagerError> {
        let limit = u32::MAX as usize;
        if capacity == 0 {
            return Err(ManagerError::ZeroCapacity);
        }
        if capacity > limit {
            return Err(ManagerError::CapacityTooLarge { requested: capacity, limit });
        }
        let oom = |_| ManagerError::OutOfMemory { capacity };
        let mut owners = Vec::new();
        owners.try_reserve_exact(capacity).map_err(oom)?;
        owners.resize(capacity, None);
        let mut free = Vec::new();
        free.try_reserve_exact(capacity).map_err(oom)?;
        let mut table = Self { owners, free };
        table.clear();
        Ok(table)
    }

    pub(crate) fn capacity(&self) -> usize {
        self.owners.len()
    }

    pub(crate) fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Takes a free slot for `key`.
    pub(crate) fn allocate(&mut self, key: BlockKey) -> Option<SlotId> {
        let slot = self.free.pop()?;
        if let Some(owner) = self.owners.get_mut(slot.index()) {
            *owner = Some(key);
        }
        Some(slot)
    }

    /// Returns `slot` to the free list.
    pub(crate) fn release(&mut self, slot: SlotId) {
        if let Some(owner) = self.owners.get_mut(slot.index()) {
            if owner.take().is_some() {
                self.free.push(slot);
            }
        }
    }

    /// Undoes [`allocate`](Self::allocate) of `slot`: free again, on top
    /// of the free list (undoing allocations last first restores the list).
    pub(crate) fn unallocate(&mut self, slot: SlotId) {
        self.release(slot);
    }

    /// Undoes [`release`](Self::release) of `slot`, owned by `key`: the
    /// slot must be on top of the free list (undoing releases last first,
    /// after the allocations that followed them). Returns false, changing
    /// nothing, when it is not.
    pub(crate) fn unrelease(&mut self, slot: SlotId, key: BlockKey) -> bool {
        if self.free.last() != Some(&slot) {
            return false;
        }
        let Some(owner) = self.owners.get_mut(slot.index()) else {
            return false;
        };
        self.free.pop();
        *owner = Some(key);
        true
    }

    /// Frees every slot.
    pub(crate) fn clear(&mut self) {
        self.owners.fill(None);
        self.free.clear();
        // new() checked capacity <= u32::MAX, so every id fits.
        let capacity = self.owners.len() as u32;
        self.free.extend((0..capacity).rev().map(SlotId));
    }

    /// The owner of `slot`, if any.
    pub(crate) fn owner(&self, slot: SlotId) -> Option<BlockKey> {
        self.owners.get(slot.index()).copied().flatten()
    }

    /// Checks that the free list holds exactly the unowned slots, once each.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut seen = vec![false; self.owners.len()];
        for slot in &self.free {
            match seen.get_mut(slot.index()) {
                None => return Err(format!("free {slot} is out of range 0..{}", self.owners.len())),
                Some(true) => return Err(format!("{slot} is on the free list twice")),
                Some(s) => *s = true,
            }
            if let Some(owner) = self.owner(*slot) {
                return Err(format!("{slot} is free but owned by {owner}"));
            }
        }
        let owned = self.owners.iter().filter(|o| o.is_some()).count();
        if owned + self.free.len() != self.owners.len() {
            return Err(format!("{owned} owned + {} free slots != capacity {}", self.free.len(), self.owners.len()));
        }
        Ok(())
    }
}
