//! The manager's invariants, checked on demand (tests call this after every
//! step of the state-machine test).

use super::block_manager::BlockManager;

impl BlockManager {
    /// Checks every invariant and describes the first violation:
    /// - no slot is owned twice, and the free list holds exactly the unowned
    ///   slots (so capacity is never exceeded);
    /// - the policy tracks exactly the stored blocks;
    /// - the policy's eviction candidates are exactly the blocks that are
    ///   ready with no readers: a write-pending block or a block being read
    ///   can never be evicted, and a write-pending block is never readable
    ///   (its state says so, and lookup/prepare_load read that state);
    /// - the policy's and the threshold counter's own invariants.
    ///
    /// O(n); meant for tests and debugging.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.slots.check()?;
        let capacity = self.slots.capacity();
        if self.blocks.len() > capacity {
            return Err(format!("{} blocks stored, capacity {capacity}", self.blocks.len()));
        }
        if self.blocks.len() + self.slots.free_count() != capacity {
            return Err(format!(
                "{} blocks + {} free slots != capacity {capacity}",
                self.blocks.len(),
                self.slots.free_count()
            ));
        }
        let mut evictable = 0;
        for (key, block) in &self.blocks {
            if self.slots.owner(block.slot) != Some(*key) {
                return Err(format!(
                    "{key} holds {} but the slot table says it belongs to {:?}",
                    block.slot,
                    self.slots.owner(block.slot)
                ));
            }
            if !self.policy.is_resident(key) {
                return Err(format!("{key} is stored but the policy does not track it"));
            }
            let should = block.state.is_evictable();
            if self.policy.is_candidate(key) != should {
                return Err(format!(
                    "{key} is {} but the policy {} it as an eviction candidate",
                    block.state,
                    if should { "does not list" } else { "lists" }
                ));
            }
            evictable += usize::from(should);
        }
        if self.policy.resident() != self.blocks.len() {
            return Err(format!(
                "policy tracks {} blocks, manager stores {}",
                self.policy.resident(),
                self.blocks.len()
            ));
        }
        if self.policy.candidates() != evictable {
            return Err(format!(
                "policy has {} candidates, {evictable} blocks are evictable",
                self.policy.candidates()
            ));
        }
        self.policy.check_invariants()?;
        self.misses.check()
    }
}
