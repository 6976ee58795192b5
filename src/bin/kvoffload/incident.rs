//! The seed incident, reproduced (`kvoffload incident`): a large host region
//! is pinned on a background thread while the engine captures CUDA graphs in
//! GLOBAL mode, back to back, as an engine does at start-up.
//!
//! - `Upstream` is vLLM #45850's design (negative model N1): a thread
//!   registers the region chunk by chunk, with no capture window; any
//!   registration that lands inside a capture fails with 900 and
//!   invalidates that capture (end_capture -> 901).
//! - `Windowed` is ours: the pinner goes through the coordinator and every
//!   capture happens inside a capture window (policy AfterPinning: the
//!   engine's captures wait until pinning settled).
//! - `Interleaved` is ours with policy Interleave: captures happen during
//!   pinning; the pinner pauses at chunk boundaries for them.
//!
//! After capturing, the last graph (which copies offloaded data from the
//! region into device memory) is replayed and the device bytes are checked.

use std::time::{Duration, Instant};

use kvoffload::internal::pin::{NoPrefault, PinHandle, Prefault};
use kvoffload::internal::protocol::{CapturePolicy, Coordinator, KeepAlive};
use kvoffload::internal::runtime::{CaptureMode, Code, DevicePtr, DriverResult, Gate, GpuRuntime, Graph, Stream};
use kvoffload::internal::sync::atomic::{AtomicBool, Ordering};
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::Request;

/// Which design pins the region.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Design {
    Upstream,
    Windowed,
    Interleaved,
}

impl Design {
    pub fn name(self) -> &'static str {
        match self {
            Design::Upstream => "upstream (background register, no window)",
            Design::Windowed => "kvoffload, AfterPinning windows",
            Design::Interleaved => "kvoffload, Interleave windows",
        }
    }
}

/// Settings of one run.
#[derive(Clone, Debug)]
pub struct IncidentConfig {
    pub region_bytes: usize,
    /// Registration unit (upstream registered tensor by tensor).
    pub chunk_bytes: usize,
    /// Graphs to capture at least (the engine keeps capturing while
    /// pinning runs, up to `max_captures`).
    pub min_captures: usize,
    pub max_captures: usize,
    /// Memsets per captured graph (capture work) at least.
    pub nodes_per_graph: usize,
    /// How long each capture stays open, enqueuing work (a model's forward
    /// pass takes tens to hundreds of milliseconds to capture; a short
    /// capture rarely meets a registration).
    pub capture: Duration,
}

impl Default for IncidentConfig {
    fn default() -> Self {
        IncidentConfig {
            region_bytes: 16 << 30,
            chunk_bytes: 256 << 20,
            min_captures: 20,
            max_captures: 100_000,
            nodes_per_graph: 64,
            capture: Duration::from_millis(100),
        }
    }
}

/// What one run saw.
#[derive(Clone, Debug, Default)]
pub struct IncidentReport {
    pub design: String,
    pub captures: usize,
    pub captures_ok: usize,
    /// end_capture / enqueue failure codes, with how often each was seen.
    pub capture_errors: Vec<(Code, usize)>,
    pub registrations_failed: Vec<(Code, usize)>,
    pub pin_state: String,
    pub pin_seconds: f64,
    pub capture_wait_seconds: f64,
    pub replay: String,
    /// When things happened, seconds from the start of pinning.
    pub timeline: Timeline,
}

/// The run's interleaving, for the picture (`kvoffload incident --svg`):
/// spans in seconds from the start of pinning. Registrations and windows
/// are sampled from the coordinator's activity (`Coordinator::activity`,
/// every [`SAMPLE`]; in this run the only capture-unsafe library calls are
/// the chunk registrations, upstream's included, which go through a gate
/// too), captures are timed by the engine loop itself.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub registrations: Vec<(f64, f64)>,
    pub windows: Vec<(f64, f64)>,
    /// (start, end, the capture ended with a graph).
    pub captures: Vec<(f64, f64, bool)>,
    /// Samples taken (the sampler's own resolution is the run's length over
    /// this).
    pub samples: usize,
}

/// How often the timeline's sampler reads the coordinator's activity.
pub const SAMPLE: Duration = Duration::from_micros(200);

/// Samples `coord`'s activity until `stop`, turning "a gated call in flight"
/// and "a window open" into spans from `t0`.
fn sample(coord: &Coordinator, t0: Instant, stop: &AtomicBool) -> Timeline {
    let mut tl = Timeline::default();
    let (mut reg_from, mut win_from): (Option<f64>, Option<f64>) = (None, None);
    loop {
        let done = stop.load(Ordering::SeqCst);
        let a = coord.activity();
        let t = t0.elapsed().as_secs_f64();
        tl.samples += 1;
        span(a.calls_in_flight > 0, t, &mut reg_from, &mut tl.registrations);
        span(a.windows_open > 0, t, &mut win_from, &mut tl.windows);
        if done {
            break;
        }
        // A sampling period, not a synchronisation: nothing waits on it.
        std::thread::sleep(SAMPLE);
    }
    let t = t0.elapsed().as_secs_f64();
    if let Some(f) = reg_from {
        tl.registrations.push((f, t));
    }
    if let Some(f) = win_from {
        tl.windows.push((f, t));
    }
    tl
}

/// One sample at `t` of a condition that is `on`: a span starts (`from`)
/// where it turns on, and ends (pushed onto `spans`) where it turns off.
fn span(on: bool, t: f64, from: &mut Option<f64>, spans: &mut Vec<(f64, f64)>) {
    match (on, *from) {
        (true, None) => *from = Some(t),
        (false, Some(f)) => {
            spans.push((f, t));
            *from = None;
        }
        _ => {}
    }
}

impl IncidentReport {
    /// True when every capture succeeded and the replay read the right data.
    pub fn clean(&self) -> bool {
        self.captures_ok == self.captures && self.capture_errors.is_empty() && self.replay == "verified"
    }
}

impl std::fmt::Display for IncidentReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let codes = |v: &[(Code, usize)]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.iter().map(|(c, n)| format!("{}x {}", n, c)).collect::<Vec<_>>().join(", ")
            }
        };
        writeln!(f, "design: {}", self.design)?;
        writeln!(
            f,
            "  captures: {} attempted, {} ok; capture errors: {}",
            self.captures,
            self.captures_ok,
            codes(&self.capture_errors)
        )?;
        writeln!(f, "  registrations failed: {}", codes(&self.registrations_failed))?;
        writeln!(
            f,
            "  pinning: {}; run took {:.2} s; engine waited {:.2} s for capture windows",
            self.pin_state, self.pin_seconds, self.capture_wait_seconds
        )?;
        write!(f, "  replay of the last graph: {}", self.replay)
    }
}

fn count(v: &mut Vec<(Code, usize)>, c: Code) {
    match v.iter_mut().find(|(k, _)| *k == c) {
        Some((_, n)) => *n += 1,
        None => v.push((c, 1)),
    }
}

/// Runs one design on `rt` over a fresh, untouched anonymous region.
pub fn run(rt: Arc<dyn GpuRuntime>, design: Design, cfg: &IncidentConfig) -> Result<IncidentReport, String> {
    let mut map =
        memmap2::MmapMut::map_anon(cfg.region_bytes).map_err(|e| format!("mmap {} bytes: {e}", cfg.region_bytes))?;
    let base = map.as_mut_ptr() as usize;
    let chunk = cfg.chunk_bytes.min(cfg.region_bytes).max(1);
    let chunks: Vec<(usize, usize)> = (0..cfg.region_bytes.div_ceil(chunk))
        .map(|i| (base + i * chunk, chunk.min(cfg.region_bytes - i * chunk)))
        .collect();
    // The offloaded data the graphs copy: the first 1 MiB (touching it
    // before pinning is what an engine's earlier stores would do).
    let probe = (1usize << 20).min(cfg.region_bytes);
    for (i, b) in map[..probe].iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let map = Arc::new(map);
    let e = |what: &'static str| move |err: kvoffload::internal::runtime::DriverError| format!("{what}: {err}");
    let windowed = design != Design::Upstream;

    // The design's coordinator. Ours registers the region's chunks through
    // it and captures only inside its windows. Upstream's has no region and
    // no window is ever opened through it: its registering thread goes
    // through this coordinator's gate, which therefore never holds a
    // registration back, and registers in the middle of the engine's
    // captures exactly as upstream did (the failure this reproduces).
    let coord = if windowed {
        let policy = if design == Design::Windowed { CapturePolicy::AfterPinning } else { CapturePolicy::Interleave };
        let keep: KeepAlive = Box::new(map.clone());
        // SAFETY: the chunks are pieces of `map`, a read-write anonymous
        // mapping that the coordinator keeps mapped (`keep`) while it lives.
        unsafe { Coordinator::new(rt.as_ref(), policy, &chunks, Some(keep)) }
    } else {
        Coordinator::without_region(rt.as_ref(), CapturePolicy::AfterPinning)
    }
    .map_err(|e| format!("the coordinator: {e}"))?;
    // Upstream's registrations are made behind the coordinator's back, so
    // nothing else keeps the region mapped while they last: this does, and
    // leaks it unless every one of them was undone (at the end of the run).
    let mut keep_mapped = KeepMapped(if windowed { None } else { Some(map.clone()) });
    let s = rt.stream_create().map_err(e("stream"))?;
    let d = gated(&coord, "alloc", |g| rt.mem_alloc(g, probe))?;
    let scratch = gated(&coord, "alloc", |g| rt.mem_alloc(g, 1 << 20))?;
    let mut report = IncidentReport { design: design.name().to_string(), ..Default::default() };

    let t0 = Instant::now();
    let done = Arc::new(AtomicBool::new(false));
    let sampling = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (c, st) = (coord.clone(), sampling.clone());
        thread::spawn(move || sample(&c, t0, &st))
    };
    let (pinner, upstream) = if windowed {
        let pf: Arc<dyn Prefault> = NoPrefault::shared();
        (Some(PinHandle::spawn(rt.clone(), coord.clone(), pf)), None)
    } else {
        let (rt2, coord2, map2, done2, list) = (rt.clone(), coord.clone(), map.clone(), done.clone(), chunks.clone());
        let h = thread::spawn(move || {
            let mut failed = Vec::new();
            for (addr, len) in list {
                // No capture window: the gate of a coordinator that knows
                // nothing of the engine's captures (see above).
                let r = coord2.unsafe_call("registering a chunk (upstream)", Request::new(), |g| {
                    // SAFETY: the chunk is a piece of `map2`'s mapping, which
                    // stays mapped while this thread runs (`map2`) and, after
                    // it, until every registration is undone (`keep_mapped`).
                    unsafe { rt2.host_register(g, addr, len) }
                });
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(err)) => failed.push((addr, err.code)),
                    // Never: no window is opened through this coordinator.
                    Err(_) => failed.push((addr, Code::ILLEGAL_STATE)),
                }
            }
            drop(map2);
            done2.store(true, Ordering::SeqCst);
            failed
        });
        (None, Some(h))
    };

    // The engine: capture graphs back to back while pinning runs.
    let mut last: Option<Graph> = None;
    let mut wait = Duration::ZERO;
    while report.captures < cfg.min_captures
        || (report.captures < cfg.max_captures && !pin_done(&coord, windowed, &done))
    {
        let tw = Instant::now();
        let window = if windowed {
            Some(coord.open_window(Request::new()).map_err(|err| format!("capture window: {err}"))?)
        } else {
            None
        };
        wait += tw.elapsed();
        report.captures += 1;
        let c0 = t0.elapsed().as_secs_f64();
        let captured = capture_one(rt.as_ref(), s, d, scratch, base, probe, cfg.nodes_per_graph, cfg.capture);
        report.timeline.captures.push((c0, t0.elapsed().as_secs_f64(), captured.is_ok()));
        match captured {
            Ok(g) => {
                report.captures_ok += 1;
                if let Some(old) = last.replace(g) {
                    rt.graph_destroy(old).map_err(e("graph destroy"))?;
                }
            }
            Err(code) => count(&mut report.capture_errors, code),
        }
        drop(window);
    }
    report.capture_wait_seconds = wait.as_secs_f64();

    // Pinning result.
    let registered: Vec<(usize, usize)> = match (pinner, upstream) {
        (Some(p), _) => {
            let st = p.join();
            report.pin_state = format!("{st:?}");
            Vec::new()
        }
        (None, Some(h)) => {
            let failed = h.join().map_err(|_| "pin thread panicked".to_string())?;
            for (_, c) in &failed {
                count(&mut report.registrations_failed, *c);
            }
            report.pin_state = if failed.is_empty() {
                "Pinned".into()
            } else {
                format!("{} of {} chunks failed", failed.len(), chunks.len())
            };
            chunks.iter().copied().filter(|(a, _)| !failed.iter().any(|(f, _)| f == a)).collect()
        }
        _ => Vec::new(),
    };
    report.pin_seconds = t0.elapsed().as_secs_f64();
    sampling.store(true, Ordering::SeqCst);
    let captures = std::mem::take(&mut report.timeline.captures);
    report.timeline = sampler.join().map_err(|_| "timeline sampler panicked".to_string())?;
    report.timeline.captures = captures;

    // Replay the last good graph and check the offloaded data arrived.
    report.replay = match last {
        None => "no graph to replay".into(),
        Some(g) => {
            // SAFETY: `d` is a device allocation of `probe` bytes that only
            // this stream writes; the stream is synchronized just below,
            // before `d` is read back or freed.
            unsafe { rt.memset_d8_async(d, 0, probe, s) }.map_err(e("memset"))?;
            let launched = rt.graph_launch(g, s);
            let synced = coord
                .unsafe_call("sync", Request::new(), |gt| rt.stream_synchronize(gt, s))
                .map_err(|err| format!("{err}"))?;
            let verdict = match launched.and(synced) {
                Err(err) => format!("replay failed: {err}"),
                Ok(()) => {
                    let mut out = vec![0u8; probe];
                    // SAFETY: `out` is a writable buffer of `probe` bytes.
                    unsafe { rt.copy_dtoh(out.as_mut_ptr() as usize, d, probe) }.map_err(e("read back"))?;
                    if out[..] == map[..probe] {
                        "verified".into()
                    } else {
                        "WRONG DATA".into()
                    }
                }
            };
            rt.graph_destroy(g).map_err(e("graph destroy"))?;
            verdict
        }
    };

    // Undo every registration before the region is unmapped.
    if windowed {
        kvoffload::internal::protocol::shutdown(rt.as_ref(), &coord, || {})
            .map_err(|err| format!("shutdown: {err}"))?;
    } else {
        gated(&coord, "sync", |g| rt.ctx_synchronize(g))?;
        for (a, _) in registered.iter().rev() {
            gated(&coord, "unregister", |g| rt.host_unregister(g, *a))?;
        }
        keep_mapped.release();
    }
    // SAFETY: the context was synchronized above and the graphs are destroyed; the memory is not used again.
    gated(&coord, "free", |g| unsafe { rt.mem_free(g, d) })?;
    // SAFETY: the context was synchronized above and the graphs are destroyed; the memory is not used again.
    gated(&coord, "free", |g| unsafe { rt.mem_free(g, scratch) })?;
    rt.stream_destroy(s).map_err(e("stream destroy"))?;
    drop(coord);
    drop(map);
    Ok(report)
}

/// `f` through `coord`'s gate; the coordinator's refusal and the driver's
/// error both as the run's error, naming `what`.
fn gated<T>(coord: &Coordinator, what: &'static str, f: impl FnOnce(&Gate) -> DriverResult<T>) -> Result<T, String> {
    coord
        .unsafe_call(what, Request::new(), f)
        .map_err(|err| format!("{what}: {err}"))?
        .map_err(|err| format!("{what}: {err}"))
}

/// Keeps upstream's region mapped (leaks it) when a run ends before its
/// registrations were undone; [`KeepMapped::release`] once they were.
struct KeepMapped(Option<Arc<memmap2::MmapMut>>);

impl KeepMapped {
    fn release(&mut self) {
        self.0 = None;
    }
}

impl Drop for KeepMapped {
    fn drop(&mut self) {
        if let Some(m) = self.0.take() {
            tracing::warn!("upstream's registrations were not all undone; leaving the region mapped");
            std::mem::forget(m);
        }
    }
}

fn pin_done(coord: &Coordinator, windowed: bool, done: &AtomicBool) -> bool {
    if windowed {
        coord.pinning().state().is_final()
    } else {
        done.load(Ordering::SeqCst)
    }
}

/// One capture in GLOBAL mode, open for at least `open_for`: memsets (at
/// least `nodes`) and a copy of the offloaded data from the region.
/// Returns the graph or the first failure code.
#[allow(clippy::too_many_arguments)]
fn capture_one(
    rt: &dyn GpuRuntime,
    s: Stream,
    d: DevicePtr,
    scratch: DevicePtr,
    src: usize,
    bytes: usize,
    nodes: usize,
    open_for: Duration,
) -> Result<Graph, Code> {
    rt.begin_capture(s, CaptureMode::Global).map_err(|e| e.code)?;
    let mut first_err = None;
    let t = Instant::now();
    let mut i = 0usize;
    while i < nodes || t.elapsed() < open_for {
        // SAFETY: `scratch` is a device allocation of 1 MiB that nothing
        // else writes; `run` frees it only after the last graph was replayed
        // (stream synchronized) and every graph destroyed.
        if let Err(e) = unsafe { rt.memset_d8_async(scratch, i as u8, 4096, s) } {
            first_err.get_or_insert(e.code);
            break;
        }
        i += 1;
    }
    if first_err.is_none() {
        // SAFETY: the region outlives every replay of this graph (run()
        // destroys the graphs before unmapping).
        if let Err(e) = unsafe { rt.copy_htod_async(d, src, bytes, s) } {
            first_err.get_or_insert(e.code);
        }
    }
    let end = rt.end_capture(s);
    match (end, first_err) {
        (Ok(g), None) => Ok(g),
        (Ok(g), Some(c)) => {
            let _ = rt.graph_destroy(g);
            Err(c)
        }
        (Err(e), _) => Err(e.code),
    }
}
