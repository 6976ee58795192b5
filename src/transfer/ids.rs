//! Job ids and the set of ids an engine has seen.

use std::collections::BTreeMap;

/// Identifies one transfer job; unique over an engine's lifetime.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub u64);

impl JobId {
    /// The next id (`None` past `u64::MAX`).
    pub fn checked_next(self) -> Option<JobId> {
        self.0.checked_add(1).map(JobId)
    }
}

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The ids used so far, as disjoint closed intervals (start -> end): ids
/// that grow by one per job stay one interval, so the set stays small
/// however long the engine runs.
#[derive(Debug, Default)]
pub(crate) struct IdSet {
    runs: BTreeMap<JobId, JobId>,
}

impl IdSet {
    /// True when `id` was inserted before.
    pub fn contains(&self, id: JobId) -> bool {
        self.runs.range(..=id).next_back().is_some_and(|(_, &end)| id <= end)
    }

    /// Inserts `id`; false (and no change) when it was already there.
    pub fn insert(&mut self, id: JobId) -> bool {
        if self.contains(id) {
            return false;
        }
        let mut start = id;
        let mut end = id;
        if let Some((&s, &e)) = self.runs.range(..id).next_back() {
            if e.checked_next() == Some(id) {
                start = s;
                self.runs.remove(&s);
            }
        }
        if let Some(next) = id.checked_next() {
            if let Some(e) = self.runs.remove(&next) {
                end = e;
            }
        }
        self.runs.insert(start, end);
        true
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_stay_one_run() {
        let mut s = IdSet::default();
        for id in 0..1000 {
            assert!(s.insert(JobId(id)));
        }
        assert_eq!(s.runs.iter().collect::<Vec<_>>(), [(&JobId(0), &JobId(999))]);
        assert!(!s.insert(JobId(17)));
        assert!(!s.contains(JobId(1000)));
    }

    /// An id prints as its number, as the errors that name it show it.
    #[test]
    fn an_id_prints_as_its_number() {
        assert_eq!(JobId(42).to_string(), "42");
        assert_eq!(format!("{:>4}", JobId(7)), "   7", "the formatter's options apply");
        let e = crate::transfer::TransferError::EmptyJob { id: JobId(u64::MAX) };
        assert_eq!(e.to_string(), format!("job {} moves no block", u64::MAX));
    }

    #[test]
    fn gaps_merge_when_filled() {
        let mut s = IdSet::default();
        for id in [5, 7, 9, u64::MAX, 0] {
            assert!(s.insert(JobId(id)));
        }
        assert_eq!(s.runs.len(), 5);
        assert!(s.insert(JobId(6)));
        assert_eq!(s.runs.len(), 4);
        assert!(s.insert(JobId(8)));
        assert_eq!(s.runs.len(), 3);
        for id in [0, 5, 6, 7, 8, 9, u64::MAX] {
            assert!(s.contains(JobId(id)), "{id}");
        }
        for id in [1, 4, 10, u64::MAX - 1] {
            assert!(!s.contains(JobId(id)), "{id}");
        }
    }
}
