//! One rank of `kvoffload run`: an engine-like process that shares the
//! region with its peers.
//!
//! 1. creates (rank 0) or joins the shared region; the file is unlinked as
//!    soon as every rank has mapped it;
//! 2. starts background pinning of the whole region through its own
//!    coordinator, with the P7 agreement over the region header's words;
//! 3. runs its own start-up work (a compute loop) meanwhile;
//! 4. captures graphs in GLOBAL mode through capture windows;
//! 5. waits for the agreed pin state, then runs requests: each picks
//!    `blocks_per_job` consecutive keys (Zipf), loads the leading hits and
//!    stores the misses (each block's pattern written into its GPU blocks
//!    by the pattern-fill kernel on the compute stream first, so stores
//!    must be ordered after compute); every page of every loaded block is
//!    checked on the GPU by the pattern-check kernel, driven by a verifier
//!    thread (`workload.rs`, `verify.rs`);
//! 6. loads and checks every block the manager still holds (the sweep);
//! 7. shuts down in the protocol's order and unmaps the region.
//!
//! It speaks to the parent through stdout lines (`report::PHASE`, ...).

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use kvoffload::manager::ManagerError;
use kvoffload::pin::RegionSlots;
use kvoffload::pin::{pin_all_agreed, Agreement, PinError, PinOptions, Prefault, Prepared};
use kvoffload::protocol::agreement::{AgreementError, RankSlots};
use kvoffload::protocol::{shutdown, Coordinator, GraphToken, PinState, ProtocolError, ShutdownError};
use kvoffload::region::pages;
use kvoffload::region::{Region, RegionError, ShmOptions};
use kvoffload::runtime::pattern;
use kvoffload::runtime::sim::SimFault;
use kvoffload::runtime::{CaptureMode, Code, DevicePtr, DriverError, DriverResult, Gate, GpuRuntime, Graph, Stream};
use kvoffload::sync::{self, thread, Arc, Mutex};
use kvoffload::transfer::TransferError;

use super::config::{ConfigError, KillAt, RunConfig};
use super::report::{RankReport, NOTE, PAUSE, PHASE, PROGRESS};
use super::workload::workload;

/// Why a rank stopped before its report.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("region: {0}")]
    Region(#[from] RegionError),
    #[error("pinning set-up: {0}")]
    Pin(#[from] PinError),
    #[error("protocol: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("{what}: {error}")]
    Driver { what: &'static str, error: DriverError },
    #[error("transfer: {0}")]
    Transfer(#[from] TransferError),
    #[error("block manager: {0}")]
    Manager(#[from] ManagerError),
    #[error("shutdown: {0}")]
    Shutdown(#[from] ShutdownError),
    #[error("{0}")]
    Other(String),
}

pub(super) fn drv(what: &'static str) -> impl FnOnce(DriverError) -> RankError {
    move |error| RankError::Driver { what, error }
}

/// `f`, a capture-unsafe driver call, through the gate of the rank's
/// coordinator (it waits while a capture window is open); the coordinator's
/// refusal and the driver's error both become a [`RankError`] naming `what`.
pub(super) fn gated<T>(
    coord: &Coordinator,
    what: &'static str,
    f: impl FnOnce(&Gate) -> DriverResult<T>,
) -> Result<T, RankError> {
    coord.unsafe_call(what, f)?.map_err(drv(what))
}

/// Writes one line on stdout for the parent, flushed at once.
pub fn emit(line: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{line}");
    let _ = o.flush();
}

pub(super) fn phase(rank: usize, p: &str) {
    emit(&format!("{PHASE} rank={rank} phase={p}"));
}

pub(super) fn progress(rank: usize, p: &str, done: usize, total: usize) {
    emit(&format!("{PROGRESS} rank={rank} phase={p} done={done} total={total}"));
}

/// Announces a pause point and blocks until the parent writes a line or
/// closes stdin (the parent SIGKILLs the rank here in the fault tests; if
/// the parent is gone, stdin reaches EOF and the rank goes on).
pub(super) fn pause(rank: usize, at: KillAt) {
    emit(&format!("{PAUSE} rank={rank} at={}", at.name()));
    let mut s = String::new();
    let _ = std::io::stdin().lock().read_line(&mut s);
}

/// Wraps the pre-faulter: reports progress per chunk, pauses where the
/// fault test asks, and notes when this rank's own pinning ended.
struct PinProbe {
    inner: Arc<dyn Prefault>,
    rank: usize,
    total: usize,
    pause_at: Option<usize>,
    started: Instant,
    local_done: Mutex<Option<Duration>>,
}

impl Prefault for PinProbe {
    fn ensure(&self, i: usize, addr: usize, len: usize) -> Result<(), String> {
        progress(self.rank, "pinning", i, self.total);
        if self.pause_at == Some(i) {
            pause(self.rank, KillAt::Pinning);
        }
        self.inner.ensure(i, addr, len)
    }

    fn hint(&self, i: usize, addr: usize, len: usize) {
        self.inner.hint(i, addr, len)
    }

    fn settle(&self) {
        self.inner.settle();
        sync::lock(&self.local_done).get_or_insert(self.started.elapsed());
    }
}

/// Runs rank `rank` of `cfg` on `rt` with the region `region_name`;
/// `pause_at` makes it stop where a fault test kills it.
pub fn run_rank(
    cfg: &RunConfig,
    rank: usize,
    region_name: &str,
    rt: Arc<dyn GpuRuntime>,
    pause_at: Option<KillAt>,
) -> Result<RankReport, RankError> {
    let d = cfg.validate()?;
    let mut rep = RankReport { rank, backend: rt.backend().to_string(), ..Default::default() };

    // 1. The region.
    phase(rank, "region");
    let opts = ShmOptions::new().timeout(cfg.rank_timeout).dir(&cfg.region_dir);
    let region = if rank == 0 {
        Region::create(region_name, d.layout, 0, &opts)?
    } else {
        Region::join(region_name, d.layout, rank, &opts)?
    };
    let region = Arc::new(region);
    rep.region_bytes = region.len() as u64;

    // Faults (simulated GPU only; the parent refuses them elsewhere).
    let faulty = cfg.fault_rank.is_none_or(|r| r == rank);
    if faulty {
        if let Some(sim) = rt.as_sim() {
            if let Some(k) = cfg.fault_register_at {
                sim.inject(SimFault::Register { nth: k, code: Code::NOT_SUPPORTED });
            }
            if let Some(k) = cfg.fault_copy_every {
                sim.inject(SimFault::Copy { nth: k, code: Code::INVALID_VALUE });
            }
        }
    }
    let copy_fault = if faulty { cfg.fault_copy_every } else { None };
    let rearm = |rt: &dyn GpuRuntime| {
        if let (Some(k), Some(sim)) = (copy_fault, rt.as_sim()) {
            sim.inject(SimFault::Copy { nth: k, code: Code::INVALID_VALUE });
        }
    };

    // 2. Background pinning with the agreement.
    phase(rank, "pinning");
    let mut popts = PinOptions::default().max_chunk_bytes(d.pin_chunk).huge_pages(cfg.pin_huge_pages);
    if let Some(t) = cfg.pin_threads {
        popts = popts.threads(t);
    }
    let prepared = Prepared::new(&region, &popts)?;
    let chunks = prepared.chunks();
    let (coord, prefault) = prepared.into_parts();
    let started = Instant::now();
    let probe = Arc::new(PinProbe {
        inner: prefault,
        rank,
        total: chunks,
        pause_at: (pause_at == Some(KillAt::Pinning)).then_some(chunks / 2),
        started,
        local_done: Mutex::new(None),
    });
    let slots: Arc<dyn RankSlots> = match RegionSlots::new(region.clone()) {
        Some(s) => Arc::new(s),
        None => return Err(RankError::Other("the run's region is not shared".into())),
    };
    let agreement = Agreement { slots, rank, timeout: Some(cfg.rank_timeout) };
    let pinner = {
        let (rt, coord, probe) = (rt.clone(), coord.clone(), probe.clone());
        thread::spawn(move || pin_all_agreed(rt.as_ref(), &coord, probe.as_ref(), &agreement))
    };

    // 3. The engine's own start-up work, overlapping pinning.
    phase(rank, "startup");
    let t = Instant::now();
    let mut buf = vec![0u8; 64 << 10];
    let mut n = 0u64;
    while t.elapsed() < cfg.startup {
        pattern::fill(n, &mut buf);
        n += 1;
    }
    std::hint::black_box(&buf);

    // 4. Graph capture through capture windows (GLOBAL mode).
    phase(rank, "capture");
    let cstream = rt.stream_create().map_err(drv("creating the capture stream"))?;
    let scratch = gated(&coord, "allocating the capture scratch buffer", |g| rt.mem_alloc(g, 1 << 20))?;
    let mut graphs: Vec<(Graph, GraphToken)> = Vec::new();
    for _ in 0..cfg.graphs {
        let t = Instant::now();
        let window = coord.open_window()?;
        let waited = t.elapsed().as_secs_f64();
        rep.windows += 1;
        rep.window_wait_total += waited;
        rep.window_wait_max = rep.window_wait_max.max(waited);
        rep.chunks_waited += window.chunks_waited() as u64;
        match capture_one(rt.as_ref(), cstream, scratch, cfg.graph_nodes) {
            Ok(g) => {
                drop(window);
                graphs.push((g, coord.register_graph()?));
                rep.graphs_ok += 1;
            }
            Err(e) => {
                drop(window);
                tracing::error!(rank, error = %e, "graph capture failed");
                rep.graphs_failed += 1;
            }
        }
    }
    for (g, _) in &graphs {
        rt.graph_launch(*g, cstream).map_err(drv("replaying a graph"))?;
    }
    gated(&coord, "replaying the graphs", |g| rt.stream_synchronize(g, cstream))?;

    // 5a. The agreed pin state.
    phase(rank, "agree");
    let state = coord.wait_pin_final()?;
    let agreed = pinner.join().map_err(|_| RankError::Other("the pinning thread panicked".into()))?;
    rep.agreed_seconds = started.elapsed().as_secs_f64();
    rep.huge_bytes = pages::huge_mapped_bytes(region.mapping_range().addr_range()).unwrap_or(0);
    rep.pin_seconds = sync::lock(&probe.local_done).map_or(rep.agreed_seconds, |d| d.as_secs_f64());
    rep.pin_state = format!("{state:?}").replace(' ', "");
    rep.agreement = match &agreed {
        Ok(PinState::Pinned) => "pinned".into(),
        Ok(_) => "pageable".into(),
        Err(e @ AgreementError::RankDied { .. }) | Err(e @ AgreementError::Timeout { .. }) => {
            emit(&format!("{NOTE} rank={rank} agreement not reached ({e}); this rank runs on pageable memory"));
            format!("failed: {e}")
        }
        Err(e) => format!("failed: {e}"),
    };
    drop(probe);

    // 5b. GPU tensors, the transfer engine, the manager, the verifier.
    let mut tensors: Vec<DevicePtr> = Vec::with_capacity(cfg.layers);
    let alloc = (|| {
        for _ in 0..cfg.layers {
            tensors.push(gated(&coord, "allocating the GPU KV tensors", |g| {
                rt.mem_alloc(g, cfg.gpu_blocks * cfg.page_bytes)
            })?);
        }
        Ok(())
    })();
    let result =
        alloc.and_then(|()| workload(cfg, &d, rank, &rt, &coord, &region, &tensors, &rearm, &mut rep, pause_at));
    for p in tensors {
        if let Err(e) = gated(&coord, "freeing a KV tensor", |g| rt.mem_free(g, p)) {
            tracing::warn!(error = %e, "freeing a KV tensor failed");
        }
    }

    // 7. Shutdown: graphs first, then the protocol's order, then unmap.
    phase(rank, "shutdown");
    for (g, token) in graphs {
        rt.graph_destroy(g).map_err(drv("destroying a graph"))?;
        drop(token);
    }
    gated(&coord, "freeing the capture scratch buffer", |g| rt.mem_free(g, scratch))?;
    rt.stream_destroy(cstream).map_err(drv("destroying the capture stream"))?;
    // Unregister even when the workload failed: the region is unmapped next.
    let down = shutdown(rt.as_ref(), &coord, || {});
    result?;
    down?;
    drop(coord);
    drop(region);
    Ok(rep)
}

/// One GLOBAL-mode capture of `nodes` memsets into `scratch`.
fn capture_one(rt: &dyn GpuRuntime, s: Stream, scratch: DevicePtr, nodes: usize) -> Result<Graph, DriverError> {
    rt.begin_capture(s, CaptureMode::Global)?;
    let mut first = None;
    for i in 0..nodes {
        // SAFETY: `scratch` is a 1 MiB device allocation of `rt`; nothing
        // else writes it, and it is freed only after every graph captured
        // into it was replayed, synchronized and destroyed (`run_rank`), or,
        // for a failed capture, destroyed here.
        if let Err(e) = unsafe { rt.memset_d8_async(scratch, i as u8, 1 << 20, s) } {
            first = Some(e);
            break;
        }
    }
    let g = rt.end_capture(s)?;
    match first {
        None => Ok(g),
        Some(e) => {
            let _ = rt.graph_destroy(g);
            Err(e)
        }
    }
}
