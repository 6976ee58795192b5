//! Settings of `kvoffload run` and the sizes derived from them, with every
//! bad value refused as a typed error naming the value and its limit.

use std::time::Duration;

use kvoffload::{page_size, Layout, DEFAULT_FILE_BYTES, MAX_FILES, MAX_RANKS};

/// Where the parent SIGKILLs a rank (fault tests).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KillAt {
    /// During the join of the shared region (the rank pauses before it
    /// creates or joins it, announces it, and the parent kills it there).
    Join,
    /// In the middle of pinning (the rank pauses before registering its
    /// middle chunk, announces it, and the parent kills it there).
    Pinning,
    /// In the middle of the workload, with jobs in flight.
    Transfers,
}

impl KillAt {
    pub fn name(self) -> &'static str {
        match self {
            KillAt::Join => "join",
            KillAt::Pinning => "pinning",
            KillAt::Transfers => "transfers",
        }
    }
}

/// Everything a run is made of (the CLI's options; see `kvoffload run --help`).
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    /// Rank processes sharing the region.
    pub ranks: usize,
    /// Bytes of the shared region's data area (all ranks together); rounded
    /// down to whole rows.
    pub region_bytes: usize,
    /// KV tensors (layers) per rank on the GPU.
    pub layers: usize,
    /// Bytes of one GPU block of one layer.
    pub page_bytes: usize,
    /// GPU blocks per host block (upstream's block_size_factor).
    pub block_factor: usize,
    /// GPU blocks per tensor.
    pub gpu_blocks: usize,
    /// Requests per rank.
    pub jobs: usize,
    /// Host blocks (keys) per request.
    pub blocks_per_job: usize,
    /// Distinct keys per rank.
    pub keys: usize,
    /// Zipf exponent of the key choice (0 = uniform).
    pub zipf: f64,
    /// Blocks stored before the Zipf requests, keys 0.. in order (stores
    /// alone: each direction's rate alone is then measured too, with the
    /// final sweep's loads); at most `keys`.
    pub prefill_blocks: usize,
    /// Transfer jobs in flight per rank, at most (loads being verified do
    /// not count: the GPU blocks they hold bound them).
    pub inflight: usize,
    /// Graphs captured through capture windows at start-up.
    pub graphs: usize,
    /// Memsets per captured graph.
    pub graph_nodes: usize,
    /// Simulated start-up work (a compute loop) while pinning runs.
    pub startup: Duration,
    /// Pre-fault threads per rank (None: the library default, every core).
    pub pin_threads: Option<usize>,
    /// Bound of one registration call (None: about an eighth of the region,
    /// at least one row, at most the library default).
    pub pin_chunk: Option<usize>,
    /// Huge-page advice for the region (the library default, Auto, leaves
    /// /dev/shm regions alone: their huge pages depend on the machine's
    /// shmem THP setting).
    pub pin_huge_pages: kvoffload::HugePages,
    /// Directory of the region file (default /dev/shm). A tmpfs mounted
    /// with `huge=always` gives the region 2 MiB pages, which pin several
    /// times faster than /dev/shm's usual 4 KiB pages ([`kvoffload::Region::huge_mapped_bytes`]).
    pub region_dir: std::path::PathBuf,
    /// Seed of the key choice (rank r uses seed + r).
    pub seed: u64,
    /// How long ranks wait for each other (joining the region, agreeing).
    pub rank_timeout: Duration,
    /// Kill this rank (fault test) ...
    pub kill_rank: Option<usize>,
    /// ... at this point.
    pub kill_at: KillAt,
    /// Simulated GPU only: every K-th async copy enqueue fails.
    pub fault_copy_every: Option<u64>,
    /// Simulated GPU only: the K-th registration call fails (801).
    pub fault_register_at: Option<u64>,
    /// Ranks the faults apply to (None: every rank).
    pub fault_rank: Option<usize>,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            ranks: 2,
            region_bytes: 64 << 20,
            layers: 4,
            page_bytes: 16 << 10,
            block_factor: 1,
            gpu_blocks: 256,
            jobs: 2000,
            blocks_per_job: 4,
            keys: 2048,
            zipf: 1.0,
            prefill_blocks: 0,
            inflight: 8,
            graphs: 8,
            graph_nodes: 16,
            startup: Duration::from_millis(300),
            pin_threads: None,
            pin_chunk: None,
            pin_huge_pages: kvoffload::HugePages::Auto,
            region_dir: std::path::PathBuf::from(kvoffload::DEFAULT_SHM_DIR),
            seed: 1,
            rank_timeout: Duration::from_secs(120),
            kill_rank: None,
            kill_at: KillAt::Transfers,
            fault_copy_every: None,
            fault_register_at: None,
            fault_rank: None,
        }
    }
}

/// A setting refused before anything starts.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{what} is zero; it must be at least 1")]
    Zero { what: &'static str },
    #[error("{what} = {value} exceeds the limit of {limit}")]
    TooLarge { what: &'static str, value: u64, limit: u64 },
    #[error("{what} = {value} is below the minimum of {min} ({why})")]
    TooSmall { what: &'static str, value: u64, min: u64, why: &'static str },
    #[error("{what} = {value} is not a multiple of {of} ({why})")]
    NotMultiple { what: &'static str, value: u64, of: u64, why: &'static str },
    #[error("{what} = {value} is not a finite number >= 0")]
    BadNumber { what: &'static str, value: f64 },
    #[error("{0}")]
    Other(String),
}

/// The sizes a valid configuration gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Derived {
    /// The region's layout: `rows` rows of `ranks` slots of `slot_bytes`.
    pub layout: Layout,
    /// Bytes of one host block as the transfer layout fills it.
    pub block_bytes: usize,
    /// Host blocks per rank (= rows = manager capacity).
    pub host_blocks: usize,
    /// Bound of one registration call.
    pub pin_chunk: usize,
}

impl RunConfig {
    /// Checks every value and derives the region's shape.
    pub fn validate(&self) -> Result<Derived, ConfigError> {
        let zero = |v: usize, what| if v == 0 { Err(ConfigError::Zero { what }) } else { Ok(()) };
        zero(self.ranks, "ranks")?;
        zero(self.region_bytes, "region")?;
        zero(self.layers, "layers")?;
        zero(self.page_bytes, "page-bytes")?;
        zero(self.block_factor, "block-factor")?;
        zero(self.gpu_blocks, "gpu-blocks")?;
        zero(self.jobs, "jobs")?;
        zero(self.blocks_per_job, "blocks-per-job")?;
        zero(self.keys, "keys")?;
        zero(self.inflight, "inflight")?;
        if self.page_bytes % 8 != 0 {
            return Err(ConfigError::NotMultiple {
                what: "page-bytes",
                value: self.page_bytes as u64,
                of: 8,
                why: "the pattern kernels write and check a block's pages in 8-byte words",
            });
        }
        if self.prefill_blocks > self.keys {
            return Err(ConfigError::TooLarge {
                what: "prefill-blocks",
                value: self.prefill_blocks as u64,
                limit: self.keys as u64,
            });
        }
        if self.blocks_per_job > self.keys {
            return Err(ConfigError::TooLarge {
                what: "blocks-per-job",
                value: self.blocks_per_job as u64,
                limit: self.keys as u64,
            });
        }
        if self.ranks > MAX_RANKS {
            return Err(ConfigError::TooLarge { what: "ranks", value: self.ranks as u64, limit: MAX_RANKS as u64 });
        }
        if !self.zipf.is_finite() || self.zipf < 0.0 {
            return Err(ConfigError::BadNumber { what: "zipf", value: self.zipf });
        }
        const MAX_KEYS: usize = 1 << 26;
        if self.keys > MAX_KEYS {
            return Err(ConfigError::TooLarge { what: "keys", value: self.keys as u64, limit: MAX_KEYS as u64 });
        }
        if self.layers > 4096 {
            return Err(ConfigError::TooLarge { what: "layers", value: self.layers as u64, limit: 4096 });
        }
        if let Some(r) = self.kill_rank {
            if r >= self.ranks {
                return Err(ConfigError::TooLarge { what: "kill-rank", value: r as u64, limit: self.ranks as u64 - 1 });
            }
        }
        if let Some(r) = self.fault_rank {
            if r >= self.ranks {
                return Err(ConfigError::TooLarge {
                    what: "fault-rank",
                    value: r as u64,
                    limit: self.ranks as u64 - 1,
                });
            }
        }
        if self.fault_copy_every == Some(0) {
            return Err(ConfigError::Zero { what: "fault-copy-every" });
        }
        if self.fault_register_at == Some(0) {
            return Err(ConfigError::Zero { what: "fault-register-at" });
        }
        if self.pin_threads == Some(0) {
            return Err(ConfigError::Zero { what: "pin-threads" });
        }
        // The region is data files of at most DEFAULT_FILE_BYTES, at most
        // MAX_FILES of them (1 TiB): a larger --region is refused here,
        // naming the option and that limit, not deep in the layout.
        let max_region = (MAX_FILES as u64).saturating_mul(DEFAULT_FILE_BYTES as u64);
        if self.region_bytes as u64 > max_region {
            return Err(ConfigError::TooLarge { what: "region", value: self.region_bytes as u64, limit: max_region });
        }
        let overflow = || ConfigError::Other("the block size overflows (layers x page-bytes x block-factor)".into());
        let block_bytes = self
            .layers
            .checked_mul(self.page_bytes)
            .and_then(|b| b.checked_mul(self.block_factor))
            .ok_or_else(overflow)?;
        let page = page_size();
        let slot_bytes = block_bytes.checked_next_multiple_of(page).ok_or_else(overflow)?;
        let row = slot_bytes.checked_mul(self.ranks).ok_or_else(overflow)?;
        let rows = self.region_bytes / row;
        // A request's blocks must fit next to the others in flight, and the
        // manager must always be able to evict for a new request.
        let min_rows = self.blocks_per_job.saturating_mul(2) as u64;
        if (rows as u64) < min_rows {
            return Err(ConfigError::TooSmall {
                what: "region",
                value: self.region_bytes as u64,
                min: min_rows.saturating_mul(row as u64),
                why: "two requests' host blocks per rank",
            });
        }
        let gpu_needed = self.blocks_per_job.checked_mul(self.block_factor).ok_or_else(overflow)?;
        if self.gpu_blocks < gpu_needed {
            return Err(ConfigError::TooSmall {
                what: "gpu-blocks",
                value: self.gpu_blocks as u64,
                min: gpu_needed as u64,
                why: "one request's GPU blocks (blocks-per-job x block-factor)",
            });
        }
        self.gpu_blocks.checked_mul(self.page_bytes).ok_or_else(overflow)?;
        let layout = Layout::new(self.ranks, slot_bytes, rows).map_err(|e| ConfigError::Other(e.to_string()))?;
        let pin_chunk = match self.pin_chunk {
            Some(0) => return Err(ConfigError::Zero { what: "pin-chunk" }),
            Some(c) if c < row => {
                return Err(ConfigError::TooSmall {
                    what: "pin-chunk",
                    value: c as u64,
                    min: row as u64,
                    why: "one row of the region",
                })
            }
            Some(c) => c,
            None => (layout.data_bytes() / 8).clamp(row, kvoffload::DEFAULT_MAX_CHUNK_BYTES.max(row)),
        };
        Ok(Derived { layout, block_bytes, host_blocks: rows, pin_chunk })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_typed() {
        let d = RunConfig::default().validate().unwrap();
        assert_eq!(d.block_bytes, 64 << 10);
        assert_eq!(d.host_blocks, 512);
        let bad = RunConfig { ranks: 0, ..RunConfig::default() };
        assert_eq!(bad.validate().unwrap_err(), ConfigError::Zero { what: "ranks" });
        let bad = RunConfig { region_bytes: 4096, ..RunConfig::default() };
        assert!(matches!(bad.validate().unwrap_err(), ConfigError::TooSmall { what: "region", .. }));
        let bad = RunConfig { zipf: f64::NAN, ..RunConfig::default() };
        assert!(matches!(bad.validate().unwrap_err(), ConfigError::BadNumber { .. }));
        let bad = RunConfig { page_bytes: 1001, ..RunConfig::default() };
        assert!(matches!(bad.validate().unwrap_err(), ConfigError::NotMultiple { what: "page-bytes", of: 8, .. }));
        let bad = RunConfig { kill_rank: Some(2), ..RunConfig::default() };
        assert!(matches!(bad.validate().unwrap_err(), ConfigError::TooLarge { what: "kill-rank", .. }));
    }
}
