//! Options of the pinning pipeline and their typed errors.

use crate::protocol::CapturePolicy;

pub use super::numa::NumaPolicy;
use crate::names::named;
use crate::region::RegionError;

/// Default bound of one registration call: 256 MiB.
///
/// Smaller than the 4 GiB the issue allows because pre-faulting of chunk
/// i+1 overlaps the registration of chunk i: the parts that do not overlap
/// (faulting the first chunk, registering the last) shrink with the chunk,
/// and a capture window under [`CapturePolicy::Interleave`] waits for at most
/// one chunk. Measured on the H200 (docs/gpu-runs/2026-11-29-run3-*), 16
/// GiB of untouched memory, 16 threads, huge pages, median of 3:
/// 256 MiB chunks 28.3 GB/s, 1 GiB 21.9 GB/s (17.9 - 24.9), 4 GiB 26.6
/// GB/s, against 2.1 - 2.7 GB/s for one register call.
pub const DEFAULT_MAX_CHUNK_BYTES: usize = 256 << 20;

/// Hard cap of one registration call: 64 GiB, the bound vLLM adopted after
/// a single registration of 512 GiB or more failed with out-of-memory
/// (vLLM #51080/#51081; docs/driver-rules.md, row "Registration size
/// cap"). [`PinOptions::validate`] refuses more.
pub const MAX_CHUNK_LIMIT: usize = 64 << 30;

/// Default [`PinOptions::lookahead_bytes`]: unbounded, every chunk is
/// queued for pre-faulting once the first is resident. With the next chunk
/// only, a registration that runs long leaves the pre-fault workers idle
/// and one that runs short waits for them: the pipeline then reaches the
/// slower of each pair of chunks, not the slower stage. Anonymous memory
/// faulted early costs nothing extra (all of it is pinned anyway). Measured
/// on the H200 (docs/gpu-runs/2026-12-02-pin-probe/): with 12 threads and
/// the whole region queued, 40.7 GB/s at 16 GiB and 41.7 at 64 GiB, above
/// the 36.1 and 40.1 GB/s bound of the stages measured apart with 16; in
/// the committed run (docs/gpu-runs/2026-12-02-pin-sizes/call3/, median of
/// three) 36.3 and 36.4 GB/s, 100 - 104% of its stage bound.
pub const DEFAULT_LOOKAHEAD_BYTES: usize = usize::MAX;

/// Default [`PinOptions::huge_fallback_mbps`]: 1000 MB/s per worker. Below
/// that (12 GB/s with 12 workers) and with the kernel stalling in reclaim
/// or compaction, 4 KiB pages are faster: pre-faulting and registering
/// them ran at 17 - 24 GB/s end to end at 16 - 96 GiB on the H200
/// (docs/gpu-runs/2026-12-02-pin-sizes/), while healthy huge-page slices
/// fault at 2 - 8 GB/s per worker and the collapse near the memory limit
/// ran at 0.1 - 0.23 GB/s per worker. A slow first touch of a virtual
/// machine's memory (0.1 - 0.5 GB/s per worker, no stall counted) does not
/// trip it: 4 KiB pages are no faster there.
pub const DEFAULT_HUGE_FALLBACK_MBPS: u32 = 1000;

/// Default [`PinOptions::prefault_nice`]: 10. Pinning runs behind an
/// engine's start-up (weights, graph captures): at niceness 10 the workers
/// get about a tenth of a core's time where an engine thread at 0 wants it
/// and all of an idle core, so an idle machine pins as fast as before and
/// a busy one keeps its cores for the engine (the registering thread, at
/// the process's niceness, is never starved by its own workers either).
/// Not yet measured on the H200: the runs of 2026-12-02 ran the workers at
/// niceness 0; `python/bench/startup.py --pin-nice 0,10,19` measures the
/// trade.
pub const DEFAULT_PREFAULT_NICE: i32 = 10;

/// The default number of pre-fault threads on `cores` cores: three in
/// four (at least 1), leaving the rest to the registering thread and the
/// driver's own work. On the H200's 16 cores (docs/gpu-runs/2026-12-02-pin-probe/),
/// whole region queued: 16 threads 27.0 - 32.2 GB/s, 15 threads 35.9 -
/// 36.0, 12 threads 40.7 - 41.7 (16 and 64 GiB); 8 threads 36.8 against
/// 16 threads' 33.9 at 96 GiB. With all 16 cores faulting, registration
/// (and the driver's threads) wait for a core. In the committed run
/// (docs/gpu-runs/2026-12-02-pin-sizes/call3/, median of three, same run):
/// 36.3 and 36.4 GB/s at 16 and 64 GiB against 34.7 and 37.8 for the
/// defaults before (16 threads, next chunk only): within each other's
/// spread there, 25 - 29% ahead in the probe.
pub fn default_threads(cores: usize) -> usize {
    (cores - cores / 4).max(1)
}

/// Most pre-fault threads accepted (a typo guard, not a tuning limit).
pub const MAX_THREADS: usize = 1024;

/// Transparent huge pages for the region before it is pre-faulted.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum HugePages {
    /// On for anonymous regions (docs/driver-rules.md, row "Pre-fault
    /// threads and huge pages": 16 pre-fault threads reach 26.7 -
    /// 28.1 GB/s end to end with huge pages against 11 - 12 without); off
    /// for shared /dev/shm regions, whose huge pages depend on the tmpfs
    /// mount (`huge=`), usually `never` on /dev/shm.
    #[default]
    Auto,
    /// `madvise(MADV_HUGEPAGE)` on the region whatever its kind.
    On,
    /// No advice: the kernel's default (`/sys/kernel/mm/transparent_hugepage/enabled`).
    Off,
}

named!(HugePages, "huge-page setting" {
    Auto => "auto",
    On => "on",
    Off => "off",
});

/// How pages are made resident before registration.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum PrefaultMode {
    /// `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+); where the kernel does
    /// not know it (EINVAL, detected once per pre-faulter), one write access
    /// per page instead.
    #[default]
    Populate,
    /// One write access per page (per 2 MiB with huge pages, then every
    /// page that is still not resident), never madvise. The access is an
    /// atomic compare-exchange of a byte with itself: it faults the page in
    /// for writing without changing memory that DMA or other ranks may be
    /// writing meanwhile.
    Touch,
    /// No pre-faulting: the driver faults the pages during registration
    /// (upstream's behaviour; 2.2 - 3.2 GB/s on the H200).
    Off,
}

named!(PrefaultMode, "pre-fault mode" {
    Populate => "populate",
    Touch => "touch",
    Off => "off",
});

/// Options of [`prepare`](super::prepare) and [`Prepared`](super::Prepared).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinOptions {
    /// Pre-fault threads (default: [`default_threads`] of
    /// `available_parallelism`, three in four of the cores this process may
    /// run on). At least 1, at most [`MAX_THREADS`].
    pub threads: usize,
    /// Huge pages (default [`HugePages::Auto`]).
    pub huge_pages: HugePages,
    /// Bound of one registration call in bytes: chunks are whole rows of the
    /// layout, at most this long (default [`DEFAULT_MAX_CHUNK_BYTES`], at
    /// most [`MAX_CHUNK_LIMIT`], at least one row).
    pub max_chunk_bytes: usize,
    /// How pages are made resident (default [`PrefaultMode::Populate`]).
    pub prefault: PrefaultMode,
    /// When capture windows may open while pinning runs.
    pub policy: CapturePolicy,
    /// NUMA placement of the pre-fault threads and the region's pages
    /// (default [`NumaPolicy::Auto`]: the GPU's node when sysfs names one and
    /// it can hold the bytes to pin; see [`crate::pin::numa`]).
    pub numa: NumaPolicy,
    /// Bytes the pre-fault workers may fault ahead of the chunk being
    /// registered (default [`DEFAULT_LOOKAHEAD_BYTES`]; at least the next
    /// chunk is always faulted ahead). A shared region's chunks are all
    /// queued at once whatever this says (the plan of its data files).
    pub lookahead_bytes: usize,
    /// Falling back from transparent huge pages to 4 KiB pages when
    /// faulting huge pages stalls: when recent slices were faulted in at
    /// under this many MB/s per pre-fault worker, the rest of the region is
    /// advised `MADV_NOHUGEPAGE` (default [`DEFAULT_HUGE_FALLBACK_MBPS`];
    /// 0: never). Anonymous regions with huge pages only.
    pub huge_fallback_mbps: u32,
    /// Niceness the pre-fault workers raise themselves to (default
    /// [`DEFAULT_PREFAULT_NICE`]; 0: the process's own; at most 19). Only
    /// raised, never lowered below the process's own.
    pub prefault_nice: i32,
    /// The sysfs tree the NUMA topology is read from (default `/sys`,
    /// [`crate::pin::numa::SYSFS_ROOT`]; tests point it at a described
    /// topology).
    pub numa_sysfs_root: std::path::PathBuf,
}

/// The number of cores this process may run on (1 if unknown).
pub fn available_cores() -> usize {
    crate::sync::thread::available_parallelism().map_or(1, |n| n.get())
}

impl Default for PinOptions {
    fn default() -> Self {
        PinOptions {
            threads: default_threads(available_cores()),
            huge_pages: HugePages::Auto,
            max_chunk_bytes: DEFAULT_MAX_CHUNK_BYTES,
            prefault: PrefaultMode::Populate,
            policy: CapturePolicy::AfterPinning,
            numa: NumaPolicy::Auto,
            lookahead_bytes: DEFAULT_LOOKAHEAD_BYTES,
            huge_fallback_mbps: DEFAULT_HUGE_FALLBACK_MBPS,
            prefault_nice: DEFAULT_PREFAULT_NICE,
            numa_sysfs_root: super::numa::SYSFS_ROOT.into(),
        }
    }
}

impl PinOptions {
    /// The defaults (see the fields).
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`PinOptions::threads`].
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = n;
        self
    }

    /// Sets [`PinOptions::huge_pages`].
    pub fn huge_pages(mut self, h: HugePages) -> Self {
        self.huge_pages = h;
        self
    }

    /// Sets [`PinOptions::max_chunk_bytes`].
    pub fn max_chunk_bytes(mut self, bytes: usize) -> Self {
        self.max_chunk_bytes = bytes;
        self
    }

    /// Sets [`PinOptions::prefault`].
    pub fn prefault(mut self, m: PrefaultMode) -> Self {
        self.prefault = m;
        self
    }

    /// Sets [`PinOptions::policy`].
    pub fn policy(mut self, p: CapturePolicy) -> Self {
        self.policy = p;
        self
    }

    /// Sets [`PinOptions::numa`].
    pub fn numa(mut self, n: NumaPolicy) -> Self {
        self.numa = n;
        self
    }

    /// Sets [`PinOptions::lookahead_bytes`].
    pub fn lookahead_bytes(mut self, bytes: usize) -> Self {
        self.lookahead_bytes = bytes;
        self
    }

    /// Sets [`PinOptions::huge_fallback_mbps`].
    pub fn huge_fallback_mbps(mut self, mbps: u32) -> Self {
        self.huge_fallback_mbps = mbps;
        self
    }

    /// Sets [`PinOptions::prefault_nice`].
    pub fn prefault_nice(mut self, nice: i32) -> Self {
        self.prefault_nice = nice;
        self
    }

    /// Sets [`PinOptions::numa_sysfs_root`].
    pub fn numa_sysfs_root(mut self, root: impl Into<std::path::PathBuf>) -> Self {
        self.numa_sysfs_root = root.into();
        self
    }

    /// Checks every value against its limit (the row bound is checked
    /// against the region's layout later, in [`prepare`](super::prepare)).
    pub fn validate(&self) -> Result<(), PinError> {
        if self.threads == 0 {
            return Err(PinError::ZeroSize { what: "threads" });
        }
        if self.threads > MAX_THREADS {
            return Err(PinError::TooLarge { what: "threads", value: self.threads as u64, limit: MAX_THREADS as u64 });
        }
        if !(0..=19).contains(&self.prefault_nice) {
            return Err(PinError::OutOfRange {
                what: "prefault_nice",
                value: self.prefault_nice as i64,
                min: 0,
                max: 19,
            });
        }
        if self.max_chunk_bytes == 0 {
            return Err(PinError::ZeroSize { what: "max_chunk_bytes" });
        }
        if self.max_chunk_bytes > MAX_CHUNK_LIMIT {
            return Err(PinError::TooLarge {
                what: "max_chunk_bytes",
                value: self.max_chunk_bytes as u64,
                limit: MAX_CHUNK_LIMIT as u64,
            });
        }
        Ok(())
    }
}

/// Errors of setting pinning up (before any registration; failures of the
/// registration itself end in [`PinState::Pageable`](crate::protocol::PinState)
/// with a typed reason instead).
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// A count or size that must be positive was zero.
    #[error("{what} is zero; it must be at least 1")]
    ZeroSize {
        /// Which option.
        what: &'static str,
    },
    /// A value above its limit.
    #[error("{what} = {value} exceeds the limit of {limit}")]
    TooLarge {
        /// Which option.
        what: &'static str,
        /// The value given.
        value: u64,
        /// The largest value accepted.
        limit: u64,
    },
    /// A value outside its range.
    #[error("{what} = {value} is outside {min} ..= {max}")]
    OutOfRange {
        /// Which option.
        what: &'static str,
        /// The value given.
        value: i64,
        /// The smallest value accepted.
        min: i64,
        /// The largest value accepted.
        max: i64,
    },
    /// The region refused (layout, capacity, chunk bound below one row ...).
    #[error(transparent)]
    Region(#[from] RegionError),
    /// The runtime handle is guarded by another coordinator
    /// ([`ProtocolError::RuntimeGuarded`](crate::protocol::ProtocolError::RuntimeGuarded)).
    #[error(transparent)]
    Protocol(#[from] crate::protocol::ProtocolError),
}
