//! One rank of `kvoffload run`: an engine-like process that holds one
//! [`Offloader`] over a region shared with its peers, as a real engine would.
//!
//! 1. builds the offloader: its KV tensors and compute stream, the shared
//!    region (rank 0 creates it, the others join; the file is unlinked as
//!    soon as every rank has mapped it), the transfer engine and the block
//!    manager;
//! 2. starts background pinning (`Offloader::start`; with the P7 agreement
//!    of every rank), watched by a [`PinObserver`] (progress lines, this
//!    rank's own pin time, the fault tests' pause);
//! 3. runs its own start-up work (a compute loop) meanwhile;
//! 4. captures graphs in GLOBAL mode inside `Offloader::capture_window`s;
//! 5. waits for the agreed pin state (`Offloader::wait_pinned`), then runs
//!    requests by keys and GPU block ids (`lookup`, `store`, `load`, `poll`,
//!    `wait`): each picks `blocks_per_job` consecutive keys (Zipf), loads
//!    the leading hits and stores the misses, each stored block's pattern
//!    written into its GPU blocks by the pattern-fill kernel on the compute
//!    stream first; every page of every loaded block is checked on the GPU
//!    by the pattern-check kernel, driven by a verifier thread
//!    (`workload.rs`, `verify.rs`);
//! 6. loads and checks every block the offloader still holds (the sweep);
//! 7. destroys its graphs and shuts the offloader down (jobs drained,
//!    pinning stopped, the region unregistered), then unmaps the region.
//!
//! SIGINT or SIGTERM (also sent by the kernel when the parent dies) stops
//! it between steps, or stops issuing work in step 5 and drains what is in
//! flight; it skips to step 7 and still reports what it measured.
//!
//! It speaks to the parent through stdout lines (`report::PHASE`, ...).

use std::time::{Duration, Instant};

use kvoffload::Request;
use kvoffload::{
    pattern, AgreementError, CaptureMode, Code, DevicePtr, DriverError, GpuRuntime, Graph, GraphToken, KeyedOffloader,
    KvAlloc, Offloader, OffloaderOptions, PinObserver, PinOptions, PinState, RegionSpec, ShmOptions, SimFault, Stream,
};
use std::sync::{Arc, Mutex};

use super::lock;

use super::config::{KillAt, RunConfig};
use super::error::{drv, gated, RankError};
use super::lifecycle::Stop;
use super::parent::{emit, pause, phase, progress};
use super::report::{RankReport, NOTE};
use super::workload::{workload, RankWorkload};

/// Watches the offloader's pinner: reports progress per chunk, pauses where
/// the fault test asks, and notes when this rank's own pinning ended.
struct PinProbe {
    rank: usize,
    pause: bool,
    started: Mutex<Option<Instant>>,
    local_done: Mutex<Option<Duration>>,
}

impl PinObserver for PinProbe {
    fn before_chunk(&self, index: usize, total: usize) {
        progress(self.rank, "pinning", index, total);
        if self.pause && index == total / 2 {
            pause(self.rank, KillAt::Pinning);
        }
    }

    fn settled(&self) {
        let started = *lock(&self.started);
        if let Some(t) = started {
            lock(&self.local_done).get_or_insert(t.elapsed());
        }
    }
}

/// The graphs a rank captured, and what they were captured with.
struct Captures {
    stream: Stream,
    scratch: DevicePtr,
    graphs: Vec<(Graph, GraphToken)>,
}

impl Captures {
    /// Destroys the graphs (then their tokens: shutdown is refused while
    /// any lives), frees the scratch buffer and the stream.
    fn release(self, off: &Offloader) -> Result<(), RankError> {
        let rt = &off.geometry().runtime;
        let mut first = None;
        for (g, token) in self.graphs {
            if let Err(e) = rt.graph_destroy(g) {
                first.get_or_insert(drv("destroying a graph")(e));
            }
            drop(token);
        }
        // SAFETY: the graphs that used the scratch buffer are destroyed
        // (above) after their replays were synchronized; nothing else uses it.
        if let Err(e) = gated(off, "freeing the capture scratch buffer", |c| unsafe { c.mem_free(self.scratch) }) {
            first.get_or_insert(e);
        }
        if let Err(e) = rt.stream_destroy(self.stream) {
            first.get_or_insert(drv("destroying the capture stream")(e));
        }
        first.map_or(Ok(()), Err)
    }
}

/// Runs rank `rank` of `cfg` on `rt` with the region `region_name`;
/// `pause_at` makes it stop where a fault test kills it; `stop` ends it
/// early (SIGINT, SIGTERM).
pub fn run_rank(
    cfg: &RunConfig,
    rank: usize,
    region_name: &str,
    rt: Arc<dyn GpuRuntime>,
    pause_at: Option<KillAt>,
    stop: Stop,
) -> Result<RankReport, RankError> {
    let d = cfg.validate()?;
    let mut rep = RankReport { rank, backend: rt.backend().to_string(), ..Default::default() };

    // 1. The offloader: KV tensors, shared region, engine, manager.
    phase(rank, "region");
    if pause_at == Some(KillAt::Join) {
        pause(rank, KillAt::Join);
    }
    let probe = Arc::new(PinProbe {
        rank,
        pause: pause_at == Some(KillAt::Pinning),
        started: Mutex::new(None),
        local_done: Mutex::new(None),
    });
    let mut pin = PinOptions::default().max_chunk_bytes(d.pin_chunk).huge_pages(cfg.pin_huge_pages);
    if let Some(t) = cfg.pin_threads {
        pin = pin.threads(t);
    }
    let observer: Arc<dyn PinObserver> = probe.clone();
    let opts = OffloaderOptions {
        region: RegionSpec::Shared {
            name: region_name.to_string(),
            rank,
            ranks: cfg.ranks,
            // SIGINT/SIGTERM (the parent's, or the kernel's when the parent
            // dies) end the join at once: the rank abandons the region and
            // removes its files instead of waiting its rank timeout.
            options: ShmOptions::new()
                .timeout(cfg.rank_timeout)
                .dir(&cfg.region_dir)
                .interrupt(move || stop.requested()),
        },
        pin,
        agreement_timeout: Some(cfg.rank_timeout),
        pin_observer: Some(observer),
        ..OffloaderOptions::with_host_blocks(d.host_blocks)
    };
    let kv = KvAlloc {
        tensors: cfg.layers,
        page_bytes: cfg.page_bytes,
        gpu_blocks: cfg.gpu_blocks,
        block_factor: cfg.block_factor,
    };
    let off = Arc::new(KeyedOffloader::with_allocated_tensors(rt.clone(), kv, opts)?);
    rep.region_bytes = off.core().geometry().region.len() as u64;

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

    // 2. Background pinning, with the agreement of every rank.
    phase(rank, "pinning");
    let started = Instant::now();
    *lock(&probe.started) = Some(started);
    let mut captures = None;
    let result = off.core().start().map_err(RankError::from).and_then(|()| {
        startup(cfg, rank, stop);
        captures = Some(capture(cfg, rank, off.core(), &mut rep, stop)?);
        if agree(rank, off.core(), &probe, started, &mut rep, stop)? {
            let ctx = RankWorkload { cfg, rank, off: &off, rearm: &rearm, pause_at, stop };
            workload(&ctx, &mut rep)?;
        }
        Ok(())
    });
    rep.interrupted = stop.requested();

    // 7. Shutdown: graphs first, then the offloader's (jobs drained,
    // pinning stopped, the region unregistered), even when a step failed.
    phase(rank, "shutdown");
    let released = captures.map_or(Ok(()), |c| c.release(off.core()));
    let down = off.core().shutdown(Request::new(), &mut drop);
    result?;
    released?;
    down?;
    // The last holder: the region is unmapped here.
    drop(off);
    Ok(rep)
}

/// Step 3: the engine's own start-up work, overlapping pinning.
fn startup(cfg: &RunConfig, rank: usize, stop: Stop) {
    phase(rank, "startup");
    let t = Instant::now();
    let mut buf = vec![0u8; 64 << 10];
    let mut n = 0u64;
    while t.elapsed() < cfg.startup && !stop.requested() {
        pattern::fill(n, &mut buf);
        n += 1;
    }
    std::hint::black_box(&buf);
}

/// Step 4: graph capture inside capture windows (GLOBAL mode), each graph
/// registered with the offloader, then replayed once.
fn capture(
    cfg: &RunConfig,
    rank: usize,
    off: &Offloader,
    rep: &mut RankReport,
    stop: Stop,
) -> Result<Captures, RankError> {
    phase(rank, "capture");
    let rt = &off.geometry().runtime;
    let stream = rt.stream_create().map_err(drv("creating the capture stream"))?;
    let scratch = match gated(off, "allocating the capture scratch buffer", |c| c.mem_alloc(1 << 20)) {
        Ok(p) => p,
        Err(e) => {
            let _ = rt.stream_destroy(stream);
            return Err(e);
        }
    };
    let mut c = Captures { stream, scratch, graphs: Vec::new() };
    let r = (|| {
        for _ in 0..cfg.graphs {
            if stop.requested() {
                break;
            }
            let t = Instant::now();
            let window = off.capture_window(Request::new())?;
            let waited = t.elapsed().as_secs_f64();
            rep.windows += 1;
            rep.window_wait_total += waited;
            rep.window_wait_max = rep.window_wait_max.max(waited);
            rep.chunks_waited += window.chunks_waited() as u64;
            let captured = capture_one(rt.as_ref(), stream, scratch, cfg.graph_nodes);
            drop(window);
            match captured {
                Ok(g) => {
                    // The token first: a graph without one would not hold
                    // shutdown back.
                    match off.register_graph() {
                        Ok(token) => c.graphs.push((g, token)),
                        Err(e) => {
                            let _ = rt.graph_destroy(g);
                            return Err(e.into());
                        }
                    }
                    rep.graphs_ok += 1;
                }
                Err(e) => {
                    tracing::error!(rank, error = %e, "graph capture failed");
                    rep.graphs_failed += 1;
                }
            }
        }
        for (g, _) in &c.graphs {
            rt.graph_launch(*g, stream).map_err(drv("replaying a graph"))?;
        }
        gated(off, "replaying the graphs", |c| c.stream_synchronize(stream))
    })();
    match r {
        Ok(()) => Ok(c),
        Err(e) => {
            if let Err(r) = c.release(off) {
                tracing::warn!(rank, error = %r, "releasing the captures failed");
            }
            Err(e)
        }
    }
}

/// Step 5a: waits for the agreed pin state and records it; false when the rank
/// was asked to stop meanwhile (shutdown then cancels pinning).
fn agree(
    rank: usize,
    off: &Offloader,
    probe: &PinProbe,
    started: Instant,
    rep: &mut RankReport,
    stop: Stop,
) -> Result<bool, RankError> {
    phase(rank, "agree");
    while !off.pin_progress().state.is_final() {
        if stop.requested() {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let outcome = off.wait_pinned(Request::new())?;
    rep.agreed_seconds = started.elapsed().as_secs_f64();
    rep.huge_bytes = off.geometry().region.huge_mapped_bytes().unwrap_or(0);
    rep.pin_seconds = lock(&probe.local_done).map_or(rep.agreed_seconds, |d| d.as_secs_f64());
    rep.pin_state = format!("{:?}", outcome.state).replace(' ', "");
    rep.agreement = match &outcome.agreement {
        None | Some(Ok(())) if outcome.state == PinState::Pinned => "pinned".into(),
        None | Some(Ok(())) => "pageable".into(),
        Some(Err(
            e @ (AgreementError::RankDied { .. } | AgreementError::Timeout { .. } | AgreementError::Abandoned { .. }),
        )) => {
            emit(&format!("{NOTE} rank={rank} agreement not reached ({e}); this rank runs on pageable memory"));
            format!("failed: {e}")
        }
        Some(Err(e)) => format!("failed: {e}"),
    };
    Ok(!stop.requested())
}

/// One GLOBAL-mode capture of `nodes` memsets into `scratch`.
fn capture_one(rt: &dyn GpuRuntime, s: Stream, scratch: DevicePtr, nodes: usize) -> Result<Graph, DriverError> {
    rt.begin_capture(s, CaptureMode::Global)?;
    let mut first = None;
    for i in 0..nodes {
        // SAFETY: `scratch` is a 1 MiB device allocation of `rt`; nothing
        // else writes it, and it is freed only after every graph captured
        // into it was replayed, synchronized and destroyed
        // (`Captures::release`), or, for a failed capture, destroyed here.
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
