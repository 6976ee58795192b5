//! The P7 agreement words of a shared region: [`RankSlots`] over the
//! header's per-rank words, with liveness from the ranks' recorded pids, so
//! the agreement survives (and detects) a rank that dies.

use core::sync::atomic::Ordering;

use crate::protocol::agreement::RankSlots;
use crate::sync::Arc;

use crate::region::Region;

/// The agreement words of a shared (/dev/shm) region.
pub struct RegionSlots {
    region: Arc<Region>,
    ranks: usize,
}

impl RegionSlots {
    /// None for anonymous regions (one process: use `LocalSlots`).
    pub fn new(region: Arc<Region>) -> Option<Self> {
        let ranks = region.rank_slots()?.len();
        Some(RegionSlots { region, ranks })
    }
}

impl RankSlots for RegionSlots {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn load(&self, rank: usize) -> u32 {
        self.region.rank_slots().map_or(0, |s| s[rank].load(Ordering::SeqCst))
    }

    fn store(&self, rank: usize, value: u32) {
        if let Some(s) = self.region.rank_slots() {
            s[rank].store(value, Ordering::SeqCst);
        }
    }

    /// A rank is dead when it recorded a pid and that process is gone.
    fn alive(&self, rank: usize) -> bool {
        let pid = self.region.rank_pids().and_then(|p| p.get(rank).copied()).unwrap_or(0);
        if pid == 0 {
            return true;
        }
        // SAFETY: kill with signal 0 only checks that the process exists.
        let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
        rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
}
