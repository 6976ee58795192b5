//! What an [`super::Offloader`] is built from: one options struct with
//! defaults, and the engine's KV layout described once.

use std::time::Duration;

use crate::manager::PolicyKind;
use crate::pin::PinOptions;
use crate::protocol::agreement::{RankSlots, Transport};
use crate::region::ShmOptions;
use crate::runtime::Stream;
use crate::sync::Arc;
use crate::transfer::{TensorSpec, TransferOptions};

use super::PinObserver;

/// Where the host blocks live.
#[derive(Clone, Debug, Default)]
pub enum RegionSpec {
    /// Private memory of this process (one rank).
    #[default]
    Anonymous,
    /// A region shared by the `ranks` processes of one node: a file in
    /// `options`' directory (/dev/shm by default) that rank 0 creates and the
    /// others join, unlinked as soon as every rank has mapped it. The ranks
    /// agree on the pin state through the region's header before offloading
    /// turns on (P7).
    Shared {
        /// Region name, the same in every rank (the file is
        /// `<dir>/kvoffload-<name>`).
        name: String,
        /// This process's rank, `0..ranks`.
        rank: usize,
        /// Number of ranks sharing the region.
        ranks: usize,
        /// Directory, join deadline and the like.
        options: ShmOptions,
    },
    /// The rows of a node pool (docs/node-pool-design.md 2.1): a region
    /// shared by the engines of a node across launches, created by the first
    /// process to come, opened by every later one and never unlinked by the
    /// library ([`crate::Region::open_persistent`]; `kvoffload pool rm`
    /// removes it). Rank-major as a shared region: each rank maps, reserves
    /// and pins its own share. Its header has no rank words for one launch,
    /// so the ranks of an engine agree on the pin state (P7) through words
    /// given with it, [`OffloaderOptions::agreement_slots`] (the engine's
    /// entry in the pool's index), or through
    /// [`OffloaderOptions::agreement`]: more than one rank with neither is
    /// refused.
    Persistent {
        /// Region name, the same in every engine (the file is
        /// `<dir>/kvoffload-<name>`).
        name: String,
        /// This process's rank, `0..ranks`.
        rank: usize,
        /// Ranks of every engine on the region.
        ranks: usize,
        /// Directory, opening deadline and the like.
        options: ShmOptions,
    },
}

impl RegionSpec {
    /// Number of ranks sharing the region (1 for an anonymous one).
    pub fn ranks(&self) -> usize {
        match self {
            RegionSpec::Anonymous => 1,
            RegionSpec::Shared { ranks, .. } | RegionSpec::Persistent { ranks, .. } => *ranks,
        }
    }

    /// This process's rank (0 for an anonymous region).
    pub fn rank(&self) -> usize {
        match self {
            RegionSpec::Anonymous => 0,
            RegionSpec::Shared { rank, .. } | RegionSpec::Persistent { rank, .. } => *rank,
        }
    }
}

/// The engine's KV cache on the GPU, described once at construction.
///
/// One KV cache group: `tensors` (typically one per layer, or one for K and
/// one for V per layer) each hold `gpu_blocks` blocks of their
/// `page_bytes`; a host block holds `block_factor` consecutive GPU blocks of
/// every tensor.
#[derive(Clone, Debug)]
pub struct KvSpec {
    /// The tensors, each with the device address of its GPU block 0.
    pub tensors: Vec<TensorSpec>,
    /// GPU blocks in every tensor.
    pub gpu_blocks: usize,
    /// GPU blocks per host block (1 unless host blocks are coarser).
    pub block_factor: usize,
    /// The engine's compute stream: stores are ordered after the work it
    /// holds when they are submitted, loads too (a load must not overwrite
    /// GPU blocks that compute still reads).
    pub compute_stream: Stream,
}

impl KvSpec {
    /// Bytes one host block holds: `block_factor` pages of every tensor;
    /// `None` when that overflows (the offloader refuses such a KV cache).
    pub fn host_block_bytes(&self) -> Option<usize> {
        self.tensors.iter().try_fold(0usize, |a, t| a.checked_add(t.page_bytes))?.checked_mul(self.block_factor)
    }
}

/// The KV tensors the offloader allocates itself (and frees at shutdown),
/// for engines and tests that do not bring their own.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KvAlloc {
    /// Tensors (layers).
    pub tensors: usize,
    /// Bytes of one GPU block of each tensor.
    pub page_bytes: usize,
    /// GPU blocks in each tensor.
    pub gpu_blocks: usize,
    /// GPU blocks per host block.
    pub block_factor: usize,
}

/// Everything an [`super::Offloader`] is built from. `Default` gives one
/// anonymous region, background pinning with the default [`PinOptions`],
/// automatic copy backends and LRU eviction; only `host_blocks` must be set.
#[derive(Clone)]
pub struct OffloaderOptions {
    /// Host blocks this rank owns in the region (the engine's slot ids
    /// `0..host_blocks` of [`super::SlotJob`]s, or a
    /// [`super::KeyedOffloader`]'s block manager's slots).
    pub host_blocks: usize,
    /// Anonymous or shared region.
    pub region: RegionSpec,
    /// Pinning: threads, chunk size, pre-fault, capture policy.
    pub pin: PinOptions,
    /// Copy backends and their tables.
    pub transfer: TransferOptions,
    /// Which block a [`super::KeyedOffloader`]'s manager evicts when it
    /// needs a slot.
    pub eviction: PolicyKind,
    /// How long a rank waits for its peers to settle their pin state
    /// through a shared region's header or
    /// [`agreement_slots`](Self::agreement_slots); `None` waits for as long
    /// as it takes. It does not bound an [`agreement`](Self::agreement)
    /// transport: neither its exchange nor this rank's wait for it (the
    /// transport's own timeout does; a shutdown ends the wait at once and
    /// leaves the exchange running on its own thread).
    pub agreement_timeout: Option<Duration>,
    /// Called on the pinning thread before each chunk and once this rank's
    /// own pinning ended (progress, timing); `None` by default.
    pub pin_observer: Option<Arc<dyn PinObserver>>,
    /// The engine's agreement transport, for ranks that share no region
    /// (several nodes): when set, the ranks agree through it (P7) instead
    /// of the shared region's header, whatever the region; its own timeout
    /// bounds the wait ([`agreement_timeout`](Self::agreement_timeout) does
    /// not). See [`Transport`] for its contract.
    pub agreement: Option<Arc<dyn Transport>>,
    /// The ranks' agreement words (P7), where the region has none for this
    /// launch: a persistent region's ranks (a node pool's rows) agree
    /// through their engine's entry in the pool's index
    /// (`kvoffload::internal::pool::agreement::EngineSlots`, made once the
    /// process joined the entry). When set, the ranks agree through these
    /// words instead of a shared region's header, bounded by
    /// [`agreement_timeout`](Self::agreement_timeout); their
    /// [`RankSlots::ranks`] must be the region's ranks, and
    /// [`agreement`](Self::agreement) must be unset (one way to agree).
    /// `None` by default.
    pub agreement_slots: Option<Arc<dyn RankSlots>>,
    /// KV cache groups, for slot jobs only (a [`super::KeyedOffloader`]
    /// refuses them): how many of the
    /// KV tensors (in order) each group has, summing to their number
    /// (vLLM's `group_data_refs`, each group's tensors distinct). `None`
    /// (the default): one group of every tensor. A host slot holds
    /// `block_factor` pages of every tensor, group after group; a slot job
    /// names GPU blocks and slots per group ([`super::SlotJob`]), and
    /// group `g`'s part of a slot touches only group `g`'s tensors.
    pub kv_groups: Option<Vec<usize>>,
}

impl std::fmt::Debug for OffloaderOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloaderOptions")
            .field("host_blocks", &self.host_blocks)
            .field("region", &self.region)
            .field("pin", &self.pin)
            .field("transfer", &self.transfer)
            .field("eviction", &self.eviction)
            .field("agreement_timeout", &self.agreement_timeout)
            .field("agreement", &self.agreement.as_ref().map(|_| "transport"))
            .field("agreement_slots", &self.agreement_slots.as_ref().map(|s| format!("{} ranks", s.ranks())))
            .field("kv_groups", &self.kv_groups)
            .field("pin_observer", &self.pin_observer.as_ref().map(|_| "observer"))
            .finish()
    }
}

impl Default for OffloaderOptions {
    fn default() -> Self {
        OffloaderOptions {
            host_blocks: 0,
            region: RegionSpec::Anonymous,
            pin: PinOptions::default(),
            transfer: TransferOptions::default(),
            eviction: PolicyKind::Lru,
            agreement_timeout: Some(Duration::from_secs(120)),
            pin_observer: None,
            agreement: None,
            agreement_slots: None,
            kv_groups: None,
        }
    }
}

impl OffloaderOptions {
    /// Defaults with `host_blocks` host blocks.
    pub fn with_host_blocks(host_blocks: usize) -> Self {
        OffloaderOptions { host_blocks, ..Self::default() }
    }
}
