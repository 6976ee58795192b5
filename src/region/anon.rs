//! The anonymous region: private memory of one process.

use memmap2::{MmapOptions, MmapRaw};

use super::mapping::Mapping;
use tracing::info;

use super::error::RegionError;
use super::layout::Layout;
use super::limits;
use super::options::AnonOptions;
use super::{Kind, Region};

impl Region {
    /// Maps `layout.data_bytes()` of private anonymous memory, as rank 0.
    ///
    /// Fails with [`RegionError::MemoryTooSmall`] if the region exceeds the
    /// memory this process can get (`MemAvailable`, its cgroup's limit
    /// minus usage: [`limits`]), before anything is mapped
    /// (unless [`AnonOptions::check_memory`] is off), or
    /// [`RegionError::Io`] if `mmap` fails. Pages are not touched: the
    /// pinning layer pre-faults them.
    pub fn anonymous(layout: Layout, opts: &AnonOptions) -> Result<Region, RegionError> {
        Self::anonymous_as(layout, 0, opts)
    }

    /// Like [`Region::anonymous`] with this process acting as rank `rank`
    /// of the layout (a single process driving several ranks' slots).
    pub fn anonymous_as(layout: Layout, rank: usize, opts: &AnonOptions) -> Result<Region, RegionError> {
        layout.check_rank(rank)?;
        let len = layout.data_bytes();
        if opts.check_memory {
            limits::check(len as u64)?;
        }
        let map = MmapOptions::new().len(len).map_anon().map_err(|e| RegionError::io("mmap", "<anonymous>", e))?;
        let mut region = Region {
            map: Mapping::Raw(MmapRaw::from(map)),
            data_offset: 0,
            layout,
            rank,
            huge_pages_advised: false,
            kind: Kind::Anonymous,
        };
        if opts.huge_pages {
            region.huge_pages_advised = region.try_advise_huge_pages();
        }
        info!(bytes = len, huge_pages = region.huge_pages_advised, "mapped anonymous region");
        Ok(region)
    }
}
