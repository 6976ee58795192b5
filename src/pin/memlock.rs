//! The locked-memory limit (RLIMIT_MEMLOCK) and what it explains.
//!
//! The CUDA driver pins host memory without `mlock`, so a low limit does not
//! stop registration by itself; it is reported up front for information,
//! and when a registration then fails with out-of-memory (2) the limit is
//! the likelier cause and the typed reason says so
//! ([`PageableReason::MemlockLimit`]).

use crate::protocol::PageableReason;

/// The soft RLIMIT_MEMLOCK in bytes; `None` when unlimited.
pub fn memlock_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Memlock).current
}

/// Notes in tracing when the limit is finite and below `needed` bytes.
/// Returns the limit when it is.
pub fn note_limit(needed: u64) -> Option<u64> {
    note_limit_with(needed, memlock_limit())
}

/// [`note_limit`] with the limit given (`None` = unlimited).
pub fn note_limit_with(needed: u64, limit: Option<u64>) -> Option<u64> {
    let limit = limit?;
    if limit < needed {
        tracing::info!(
            limit,
            needed,
            "RLIMIT_MEMLOCK is below the region size; the CUDA driver pins without mlock, \
             so this matters only if registration fails with out-of-memory"
        );
        Some(limit)
    } else {
        None
    }
}

/// Refines the reason a registration failed with, given the region size:
/// `OutOfMemory` becomes `MemlockLimit` when the current limit is finite
/// and below `needed`. Other reasons pass through.
pub fn refine(reason: PageableReason, needed: u64) -> PageableReason {
    match reason {
        PageableReason::OutOfMemory => refine_with(PageableReason::OutOfMemory, needed, memlock_limit()),
        other => other,
    }
}

/// [`refine`] with the limit given (`None` = unlimited).
pub fn refine_with(reason: PageableReason, needed: u64, limit: Option<u64>) -> PageableReason {
    match (reason, limit) {
        (PageableReason::OutOfMemory, Some(limit)) if limit < needed => PageableReason::MemlockLimit { limit, needed },
        (r, _) => r,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn oom_below_the_limit_becomes_memlock() {
        let r = refine_with(PageableReason::OutOfMemory, 100, Some(10));
        assert_eq!(r, PageableReason::MemlockLimit { limit: 10, needed: 100 });
        assert!(r.to_string().contains("10 bytes allowed, 100 needed"), "{r}");
    }

    #[test]
    fn a_limit_is_noted_only_below_the_region() {
        assert_eq!(note_limit_with(100, Some(99)), Some(99));
        assert_eq!(note_limit_with(100, Some(100)), None, "a region of exactly the limit fits");
        assert_eq!(note_limit_with(100, None), None, "unlimited");
        assert_eq!(note_limit_with(0, Some(0)), None);
    }

    #[test]
    fn other_cases_pass_through() {
        assert_eq!(refine_with(PageableReason::OutOfMemory, 100, None), PageableReason::OutOfMemory);
        assert_eq!(refine_with(PageableReason::OutOfMemory, 100, Some(100)), PageableReason::OutOfMemory);
        assert_eq!(refine_with(PageableReason::NotSupported, 100, Some(1)), PageableReason::NotSupported);
    }
}
