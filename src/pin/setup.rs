//! From a region and options to a coordinator and a pre-faulter.

use crate::protocol::{Coordinator, PinState};
use crate::region::{Region, RegionKind};
use crate::runtime::GpuRuntime;
use crate::sync::{Arc, Mutex};

use super::engine::{pin_all, NoPrefault, PinHandle, Prefault};
use super::memlock;
use super::numa::{self, Placement};
use super::options::{available_cores, HugePages, PinError, PinOptions, PrefaultMode};
use super::prefault::{PlannedChunk, PrefaultConfig, Prefaulter};

/// Everything pinning a region needs, made by [`Prepared::new`]: the
/// coordinator with the region's row-aligned chunks, and the pre-faulter.
///
/// The coordinator holds the region (an `Arc`) for as long as it or any of
/// its guards live, and never lets it go while a chunk is still registered
/// (it leaks it then), so nothing can unmap the region under a registration,
/// a pre-faulting thread or a transfer.
pub struct Prepared {
    coord: Arc<Coordinator>,
    prefaulter: Option<Arc<Prefaulter>>,
    /// A shared region with deferred reservation: what settling reserves
    /// when pinning did not ensure every chunk.
    rest: Option<Arc<Rest>>,
    huge_pages: bool,
    bytes: usize,
    memlock_limit: Option<u64>,
    options: PinOptions,
    placement: Placement,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("chunks", &self.chunks())
            .field("bytes", &self.bytes)
            .field("huge_pages", &self.huge_pages)
            .field("memlock_limit", &self.memlock_limit)
            .field("placement", &self.placement)
            .field("options", &self.options)
            .finish()
    }
}

impl Prepared {
    /// Validates `opts`, cuts what this rank pins into registration units of
    /// at most `opts.max_chunk_bytes` ([`Region::pin_ranges`]: the whole data
    /// area in runs of whole rows, or with a multi-file rank-major shared
    /// region only this rank's share), notes a low RLIMIT_MEMLOCK in
    /// tracing, applies huge-page advice ([`HugePages::Auto`]: anonymous
    /// regions only; a refusal is logged and pinning goes on with base
    /// pages) and makes the pre-faulter (with the chunks' data files as its
    /// plan for a multi-file region, [`Prefaulter::with_plan`]). For a shared
    /// region the pre-fault threads are at most the cores divided by its
    /// ranks (they all pin at once).
    ///
    /// NUMA ([`PinOptions::numa`], [`numa::place`] on [`PinOptions::numa_sysfs_root`] with the
    /// runtime's PCI bus id): when a node is chosen, every chunk gets
    /// `mbind(MPOL_PREFERRED)` for it here, before any page of it is
    /// faulted, and the pre-fault workers run on its CPUs (at most as many
    /// workers as it has CPUs); otherwise the typed reason is logged and
    /// kept ([`Prepared::placement`]). Pages already resident (a shared
    /// region's files reserved by create/join) stay where they are; with
    /// deferred reservation ([`crate::region::ShmOptions::defer_reserve`])
    /// the pre-fault workers reserve each slice right before faulting it
    /// ([`Prefaulter::reserving`]), after the binding, and without
    /// pre-faulting the rank's files are reserved here, before anything is
    /// registered ([`PinError::Region`] with `ShmFull` when the file system
    /// is full). A region on hugetlbfs gets no huge-page advice; its slices
    /// are cut on its huge pages.
    ///
    /// Typed errors: [`PinError::ZeroSize`], [`PinError::TooLarge`], [`PinError::OutOfRange`] for the
    /// options, [`PinError::Region`] with
    /// [`RegionError::ChunkBoundBelowRow`](crate::region::RegionError::ChunkBoundBelowRow)
    /// when the bound is below one row (one chunk when rank-major),
    /// [`PinError::Protocol`] when another coordinator guards `rt` (the
    /// coordinator made here guards it from now on).
    pub fn new(rt: &dyn GpuRuntime, region: &Arc<Region>, opts: &PinOptions) -> Result<Prepared, PinError> {
        opts.validate()?;
        let ranges = region.pin_ranges(opts.max_chunk_bytes)?;
        let chunks: Vec<(usize, usize)> = ranges.iter().map(|r| (r.range.as_ptr() as usize, r.range.len())).collect();
        let plan: Vec<PlannedChunk> = ranges
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                r.file.map(|lane| PlannedChunk { chunk: i, addr: r.range.as_ptr() as usize, len: r.range.len(), lane })
            })
            .collect();
        let bytes: usize = chunks.iter().map(|c| c.1).sum();
        let memlock_limit = memlock::note_limit(bytes as u64);
        // hugetlbfs: the pages are huge whatever we advise (transparent huge
        // pages do not apply there); slices are cut on huge pages.
        let hugetlb = region.hugetlb_page().is_some();
        let want_huge = !hugetlb
            && match opts.huge_pages {
                HugePages::Auto => region.kind() == RegionKind::Anonymous,
                HugePages::On => true,
                HugePages::Off => false,
            };
        let advised = want_huge
            && match region.advise_huge_pages() {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "MADV_HUGEPAGE refused; pre-faulting base pages");
                    false
                }
            };
        let huge_pages = advised || region.huge_pages_advised() || hugetlb;
        // The ranks of a shared region pin at the same time on one node:
        // each takes its share of the cores (measured that way on the H200,
        // docs/gpu-runs/2026-11-30-shm-pin.md).
        let threads = match region.kind() {
            RegionKind::Shared => opts.threads.min((available_cores() / region.layout().num_ranks()).max(1)),
            RegionKind::Anonymous => opts.threads,
        };
        let placement = numa::place(opts.numa, &opts.numa_sysfs_root, rt.pci_bus_id(), bytes as u64);
        let placement = numa::apply_pages(placement, &chunks);
        placement.log(bytes as u64);
        let threads = match placement.cpus().len() {
            0 => threads,
            n => threads.min(n),
        };
        // A shared region whose reservation was left to the first touch
        // (ShmOptions::defer_reserve): the pre-fault workers reserve each
        // slice before faulting it; without pre-faulting, the driver's
        // registration would fault unreserved pages, so everything this
        // rank may touch is reserved here, first.
        let deferred = region.reservation_deferred();
        if deferred && opts.prefault == PrefaultMode::Off {
            region.reserve_rest()?;
        }
        let prefaulter = match opts.prefault {
            PrefaultMode::Off => None,
            mode => {
                let cfg = PrefaultConfig { threads, mode, huge_pages };
                let reserve: Option<super::prefault::ReserveFn> = deferred.then(|| {
                    let r = region.clone();
                    let f: super::prefault::ReserveFn =
                        Box::new(move |addr, len| r.reserve_addr(addr, len).map_err(|e| e.to_string()));
                    f
                });
                // SAFETY: the pre-faulter only ever gets this region's chunks
                // (the plan and the coordinator's ranges, from `pin_all`,
                // are both `pin_ranges` of this region; `pin_all` holds the
                // coordinator, which holds the region); `pin_all` settles the
                // pre-faulter before it publishes a final state, so no slice
                // runs once pinning is over. The region's memory is
                // read-write.
                let pf = unsafe { Prefaulter::reserving(cfg, plan, reserve, region.hugetlb_page()) }
                    .on_cpus(placement.cpus().to_vec())
                    .with_lookahead(opts.lookahead_bytes)
                    .with_nice(opts.prefault_nice);
                // The huge-page fallback: anonymous regions whose huge pages
                // are transparent ones this pinning advised.
                let pf = match span_of(&chunks) {
                    Some((start, len)) if advised && region.kind() == RegionKind::Anonymous => {
                        // SAFETY: the span covers this region's chunks only
                        // (its `pin_ranges`, contiguous in the anonymous
                        // mapping), which stays mapped while the coordinator
                        // holds the region, and `pin_all` settles the
                        // pre-faulter before a final state; the advice undoes
                        // this pinning's own `MADV_HUGEPAGE` for pages not
                        // faulted yet.
                        unsafe { pf.with_huge_fallback(opts.huge_fallback_mbps, start, len) }
                    }
                    _ => pf,
                };
                Some(Arc::new(pf))
            }
        };
        let keep: crate::protocol::KeepAlive = Box::new(region.clone());
        // SAFETY: the chunks are `pin_ranges` of `region`'s mapping (read-write),
        // which stays mapped while the coordinator holds `keep`.
        let coord = unsafe { Coordinator::new(rt, opts.policy, &chunks, Some(keep)) }?;
        tracing::info!(
            chunks = chunks.len(),
            bytes,
            max_chunk_bytes = opts.max_chunk_bytes,
            threads,
            lookahead_bytes = opts.lookahead_bytes,
            huge_fallback_mbps = opts.huge_fallback_mbps,
            prefault_nice = opts.prefault_nice,
            huge_pages,
            prefault = ?opts.prefault,
            populate_write = ?prefaulter.as_ref().and_then(|p| p.stats().populate_write),
            numa = %placement,
            "pinning prepared"
        );
        let rest = (deferred && prefaulter.is_some())
            .then(|| Arc::new(Rest { region: region.clone(), ensured: Mutex::new(vec![false; chunks.len()]) }));
        Ok(Prepared { coord, prefaulter, rest, huge_pages, bytes, memlock_limit, options: opts.clone(), placement })
    }

    /// The coordinator (capture windows, pin state, chunk registrations).
    pub fn coordinator(&self) -> &Arc<Coordinator> {
        &self.coord
    }

    /// The pre-faulter, unless pre-faulting is off.
    pub fn prefaulter(&self) -> Option<&Arc<Prefaulter>> {
        self.prefaulter.as_ref()
    }

    /// The pre-faulter as the engine takes it ([`NoPrefault`] when off).
    pub fn prefault(&self) -> Arc<dyn Prefault> {
        match &self.prefaulter {
            Some(p) => {
                crate::sync::arc_dyn(PrefaultThenReserve { prefaulter: p.clone(), rest: self.rest.clone() }, |a| a)
            }
            None => NoPrefault::shared(),
        }
    }

    /// Whether huge pages were advised on the region (by these options or
    /// when it was made).
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// Number of registration chunks.
    pub fn chunks(&self) -> usize {
        self.coord.pinning().chunk_count()
    }

    /// Bytes to pin: the region's data area, or this rank's share of it
    /// ([`Region::pin_ranges`]).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// RLIMIT_MEMLOCK when it is finite and below the region size.
    pub fn memlock_limit(&self) -> Option<u64> {
        self.memlock_limit
    }

    /// The NUMA placement in effect: the node the pages are preferred on and
    /// the pre-fault workers' CPUs, or why nothing was placed.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The options it was made with.
    pub fn options(&self) -> &PinOptions {
        &self.options
    }

    /// Pins on the calling thread ([`pin_all`]) and returns the final state.
    pub fn pin(&self, rt: &dyn GpuRuntime) -> PinState {
        pin_all(rt, &self.coord, self.prefault().as_ref())
    }

    /// Pins on a background thread ([`PinHandle`]): the state is observable
    /// and waitable through the handle or the coordinator.
    pub fn spawn(&self, rt: Arc<dyn GpuRuntime>) -> PinHandle {
        PinHandle::spawn(rt, self.coord.clone(), self.prefault())
    }

    /// The coordinator and the pre-faulter, for [`pin_all`] or [`PinHandle::spawn`].
    pub fn into_parts(self) -> (Arc<Coordinator>, Arc<dyn Prefault>) {
        let p = self.prefault();
        (self.coord, p)
    }
}

/// The first byte and length of the range from the lowest chunk to the end
/// of the highest (None without chunks).
fn span_of(chunks: &[(usize, usize)]) -> Option<(usize, usize)> {
    let start = chunks.iter().map(|c| c.0).min()?;
    let end = chunks.iter().map(|c| c.0 + c.1).max()?;
    Some((start, end - start))
}

/// [`Prepared::new`], returning the coordinator (which holds the region)
/// and the pre-faulter.
pub fn prepare(
    rt: &dyn GpuRuntime,
    region: &Arc<Region>,
    opts: &PinOptions,
) -> Result<(Arc<Coordinator>, Arc<dyn Prefault>), PinError> {
    Ok(Prepared::new(rt, region, opts)?.into_parts())
}

/// Deferred reservation: which chunks pinning ensured (reserved and made
/// resident), so that settling can reserve the rest when pinning ended
/// before ensuring them all (failed, cancelled): the region then stays in
/// use pageable, and every page this rank may touch must be reserved
/// (`Region::reserve_rest`).
struct Rest {
    region: Arc<Region>,
    ensured: Mutex<Vec<bool>>,
}

/// The prepared pre-faulter as the registration loop takes it (a trait
/// object of its own: loom's `Arc` cannot coerce); with deferred
/// reservation it notes the chunks it ensured and, when pinning settles
/// before ensuring them all, reserves the rest.
struct PrefaultThenReserve {
    prefaulter: Arc<Prefaulter>,
    /// `Some` with deferred reservation only.
    rest: Option<Arc<Rest>>,
}

impl Prefault for PrefaultThenReserve {
    fn ensure(&self, i: usize, addr: usize, len: usize) -> Result<(), String> {
        let r = self.prefaulter.ensure(i, addr, len);
        if let (Ok(()), Some(rest)) = (&r, &self.rest) {
            if let Some(e) = crate::sync::lock(&rest.ensured).get_mut(i) {
                *e = true;
            }
        }
        r
    }
    fn hint(&self, i: usize, addr: usize, len: usize) {
        self.prefaulter.hint(i, addr, len)
    }
    fn lookahead_bytes(&self) -> usize {
        self.prefaulter.lookahead_bytes()
    }
    fn settle(&self) {
        self.prefaulter.settle();
        let Some(rest) = &self.rest else { return };
        // Every chunk ensured (pinned): every page this rank touches was
        // reserved by the pre-fault workers; nothing more to do (and
        // nothing to walk on the success path).
        if crate::sync::lock(&rest.ensured).iter().all(|e| *e) {
            return;
        }
        match rest.region.reserve_rest() {
            Ok(()) => tracing::info!("pinning ended early: reserved the rest of this rank's data files"),
            Err(e) => tracing::error!(
                error = %e,
                "pinning ended early and the rest of the region cannot be reserved: its unreserved pages must not be touched"
            ),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::span_of;

    /// The huge-page fallback's range: from the lowest chunk's first byte to
    /// the end of the highest, in whatever order the chunks come.
    #[test]
    fn a_span_runs_from_the_lowest_chunk_to_the_end_of_the_highest() {
        assert_eq!(span_of(&[]), None);
        assert_eq!(span_of(&[(4096, 8192)]), Some((4096, 8192)));
        assert_eq!(span_of(&[(20_000, 500), (4096, 100), (12_000, 3000)]), Some((4096, 20_500 - 4096)));
    }
}
