//! Checks shared by the batch operations.

use std::collections::HashMap;

use super::block_manager::BlockManager;
use super::error::ManagerError;
use super::key::BlockKey;
use super::state::BlockState;

/// Refuses a batch that names a key twice, reporting the first repeat.
pub(crate) fn check_unique(keys: &[BlockKey]) -> Result<(), ManagerError> {
    if keys.len() < 2 {
        return Ok(());
    }
    let mut first_at: HashMap<BlockKey, usize> = HashMap::with_capacity(keys.len());
    for (second, key) in keys.iter().enumerate() {
        if let Some(&first) = first_at.get(key) {
            return Err(ManagerError::DuplicateKey { key: *key, first, second });
        }
        first_at.insert(*key, second);
    }
    Ok(())
}

impl BlockManager {
    /// Refuses a batch that names a key twice ([`check_unique`]) or a key
    /// with no block ([`ManagerError::NotFound`]), or whose block's state
    /// `allowed` refuses; the first offending key is named.
    pub(crate) fn check_each(
        &self,
        keys: &[BlockKey],
        allowed: impl Fn(BlockKey, BlockState) -> Result<(), ManagerError>,
    ) -> Result<(), ManagerError> {
        check_unique(keys)?;
        for &key in keys {
            match self.blocks.get(&key) {
                None => return Err(ManagerError::NotFound { key }),
                Some(b) => allowed(key, b.state)?,
            }
        }
        Ok(())
    }
}
