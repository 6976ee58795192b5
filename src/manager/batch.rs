//! Checks shared by the batch operations.

use std::collections::HashMap;

use super::error::ManagerError;
use super::key::BlockKey;

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
