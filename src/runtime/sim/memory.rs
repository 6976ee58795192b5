//! Whether this host can back a simulated allocation.
//!
//! The simulated GPU's device memory (`cuMemAlloc`) and its page-locked host
//! memory (`cuMemAllocHost`) are host memory of this process. The configured
//! device size ([`super::SimConfig::device_bytes`], 64 GiB by default) can be
//! more than this host can give, and an allocation past what the host can
//! back used to be handed out anyway: the allocator either aborted the
//! process or gave lazily zeroed pages that the OOM killer reclaimed, with
//! the process, once they were written. The sim now answers such a request
//! the way the driver answers one past its memory, with a typed
//! `CUDA_ERROR_OUT_OF_MEMORY`
//! (docs/driver-rules.md, "Allocation past the memory there is"):
//!
//! - the request plus everything the sim has handed out and not freed
//!   (device and page-locked host memory together) must fit in what this
//!   process can get, [`crate::region::limits::available_memory`]
//!   (`MemAvailable` and every cgroup headroom); every byte handed out is
//!   counted, written yet or not, since the program may write all of it;
//! - the memory itself comes from [`zeroed`], which reports an allocator
//!   refusal instead of aborting.
//!
//! The reading is cached: a request well inside it (up to half) is decided
//! without reading /proc; a larger one re-reads first when the sim has
//! handed out a notable share of the reading since it was taken, or when
//! the cached reading would refuse it (a refusal is always confirmed by a
//! fresh reading). When nothing is known (no /proc) the host is not checked.
//! Under loom the host is never read (models stay deterministic and cheap);
//! [`super::SimConfig::host_limit`] replaces the reading with a fixed figure
//! (tests), in every build.
//!
//! Every byte the sim hands out counts, but `MemAvailable` also falls as
//! the sim's pages are written: a sim whose memory is mostly written is
//! refused before the host is full. That errs towards a typed error, never
//! towards the OOM killer.

/// What the process can get, as the sim last read it.
#[derive(Debug, Default)]
pub(crate) struct HostBudget {
    /// A fixed figure in place of the host's reading (`SimConfig::host_limit`).
    fixed: Option<usize>,
    /// The last reading: `None` before the first, `Some(None)` when nothing
    /// is known.
    cached: Option<Option<usize>>,
    /// What the sim had handed out when `cached` was read.
    out_at_reading: usize,
    /// Readings so far (tests check the cache).
    pub readings: u64,
}

impl HostBudget {
    pub fn new(fixed: Option<usize>) -> Self {
        HostBudget { fixed, ..Default::default() }
    }

    /// True when `bytes` more, with `out` bytes handed out already, fit in
    /// what the process can get (or when that is not known).
    pub fn fits(&mut self, out: usize, bytes: usize) -> bool {
        let Some(need) = out.checked_add(bytes) else {
            return false;
        };
        if let Some(fixed) = self.fixed {
            return need <= fixed;
        }
        let stale = match self.cached {
            None => true,
            // Nothing known: not checked, and not read again.
            Some(None) => return true,
            Some(Some(avail)) => {
                let since = out.saturating_sub(self.out_at_reading);
                need > avail || (need > avail / 2 && since > avail / 8)
            }
        };
        if stale {
            self.cached = Some(read_host());
            self.out_at_reading = out;
            self.readings += 1;
        }
        match self.cached {
            Some(Some(avail)) => need <= avail,
            _ => true,
        }
    }
}

/// What this process can get now, in bytes; `None` when nothing is known.
#[cfg(not(any(loom, shuttle)))]
fn read_host() -> Option<usize> {
    let b = crate::region::limits::available_memory()?;
    tracing::debug!(bytes = b.bytes, limit = %b.source, "sim: read what the host can back");
    Some(usize::try_from(b.bytes).unwrap_or(usize::MAX))
}

/// Under loom the host is not read (see the module docs).
#[cfg(any(loom, shuttle))]
fn read_host() -> Option<usize> {
    None
}

/// `bytes` zero bytes (`bytes > 0`), or `None` when the allocator refuses.
///
/// The same allocator call as `vec![0u8; bytes]` (`alloc_zeroed`, calloc:
/// fresh pages the kernel zero-fills when first touched, so a large
/// allocation costs nothing until written) with its failure reported
/// instead of aborting the process. `Vec::try_reserve_exact` is fallible
/// too, but the bytes would then have to be written to be initialised,
/// touching every page of the allocation at once.
pub(crate) fn zeroed(bytes: usize) -> Option<Vec<u8>> {
    if bytes == 0 {
        return None;
    }
    let layout = std::alloc::Layout::array::<u8>(bytes).ok()?;
    // SAFETY: the layout has a non-zero size (checked above).
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` was allocated by the global allocator with the layout of
    // `bytes` `u8`s (alignment 1, size `bytes`), which is the layout of a
    // `Vec<u8>` of capacity `bytes`; all `bytes` of it are initialised
    // (zeroed); ownership passes to the vector, which frees it with the
    // same layout.
    Some(unsafe { Vec::from_raw_parts(p, bytes, bytes) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_figure_bounds_everything_handed_out() {
        let mut b = HostBudget::new(Some(100));
        assert!(b.fits(0, 100));
        assert!(!b.fits(0, 101));
        assert!(b.fits(60, 40));
        assert!(!b.fits(60, 41));
        assert!(!b.fits(usize::MAX, 1));
        assert_eq!(b.readings, 0, "a fixed figure reads nothing");
    }

    #[cfg(not(any(loom, shuttle)))]
    #[test]
    fn the_host_is_read_once_for_small_requests_and_again_near_the_reading() {
        let Some(avail) = read_host() else {
            return;
        };
        let mut b = HostBudget::new(None);
        assert!(b.fits(0, 4096));
        assert!(b.fits(4096, 4096));
        assert_eq!(b.readings, 1, "small requests use the cached reading");
        assert!(!b.fits(0, avail.saturating_mul(4)));
        assert_eq!(b.readings, 2, "a refusal is confirmed by a fresh reading");
    }

    #[test]
    fn zeroed_is_zero_and_refuses_what_no_allocator_can_give() {
        let v = zeroed(1 << 20).unwrap();
        assert_eq!(v.len(), 1 << 20);
        assert!(v.iter().all(|&b| b == 0));
        assert!(zeroed(0).is_none());
        assert!(zeroed(isize::MAX as usize + 1).is_none(), "larger than any layout");
    }
}
