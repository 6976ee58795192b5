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

    fn compare_exchange(&self, rank: usize, current: u32, new: u32) -> Result<u32, u32> {
        match self.region.rank_slots() {
            Some(s) => s[rank].compare_exchange(current, new, Ordering::SeqCst, Ordering::SeqCst),
            None => Err(0),
        }
    }

    /// A rank is dead when it recorded a pid and that process is gone.
    fn alive(&self, rank: usize) -> bool {
        let pid = self.region.rank_pids().and_then(|p| p.get(rank).copied()).unwrap_or(0);
        if pid == 0 {
            return true;
        }
        // kill(pid, 0): only ESRCH says the process is gone (EPERM means
        // it exists under another user).
        match rustix::process::Pid::from_raw(pid as i32) {
            Some(p) => !matches!(rustix::process::test_kill_process(p), Err(rustix::io::Errno::SRCH)),
            None => true,
        }
    }
}
