//! The ordering effects and other driver facts (docs/driver-rules.md,
//! section 3), beyond the table of cells: blocking between registration and capture, unregister
//! waiting for the device, graph replay semantics, the batched copy lost
//! inside a capture, and the sticky poison after replaying a graph whose
//! host memory was unregistered; cross-stream capture (a stream joining a
//! capture by waiting on an event recorded in it) and `cuStreamDestroy` of
//! a busy stream, whose expected values came from the CUDA documentation
//! and were confirmed on the H200 (docs/conformance-h200.md).
//!
//! Each scenario's capture-unsafe calls go through the gate of a coordinator
//! of its own, which knows nothing of the scenario's captures and so never
//! holds a call back (see [`super::probe`]).

use std::time::Instant;

use kvoffload::internal::protocol::Coordinator;
use kvoffload::internal::runtime::sim::{Blocked, HoldPoint};
use kvoffload::internal::runtime::{
    CaptureMode, CaptureStatus, DevicePtr, Direction, DriverError, Fragment, GpuRuntime, Kernel, Stream,
};
use kvoffload::internal::sync::Arc;

use super::probe::{gate, gated, release_hold_when, scenario_coordinator, tick, HostBuf, LongRegister, Target};
use super::{code, Observed, Scenario};

/// What a scenario starts with: its runtime, a coordinator of its own, a
/// stream and device memory.
type Started = (Arc<dyn GpuRuntime>, Arc<Coordinator>, Stream, DevicePtr);

/// A scenario's start, with `bytes` of device memory (ended by
/// [`free_and_destroy`]).
fn start(t: &Target, bytes: usize) -> Result<Started, String> {
    let rt = t.rt();
    let c = scenario_coordinator(rt.as_ref())?;
    let s = rt.stream_create().map_err(de("stream"))?;
    let d = gated(&c, "alloc", |g| rt.mem_alloc(g, bytes))?;
    Ok((rt, c, s, d))
}

/// A scenario's end: frees its device memory `d` and destroys its stream `s`.
///
/// # Safety
///
/// The scenario is over: its replays were synchronized or never ran, its
/// graphs are destroyed, and `d` is not used again.
unsafe fn free_and_destroy(c: &Coordinator, rt: &dyn GpuRuntime, d: DevicePtr, s: Stream) -> Result<(), String> {
    // SAFETY: the caller's contract (above): nothing uses `d` any more.
    gated(c, "free", |g| unsafe { rt.mem_free(g, d) })?;
    rt.stream_destroy(s).map_err(de("stream_destroy"))
}

fn de(what: &'static str) -> impl Fn(DriverError) -> String {
    move |e| format!("{what}: {e}")
}

/// `sim` bytes on the simulated GPU, `real` on a real one.
fn size(t: &Target, sim: usize, real: usize) -> usize {
    match t {
        Target::Sim(_) => sim,
        Target::Real(_) => real,
    }
}

fn after(a: u64, b: u64) -> &'static str {
    if a > b {
        "after-register"
    } else {
        "before-register"
    }
}

pub(super) fn scenarios() -> Vec<Scenario> {
    let mk =
        |id: &str, facts: &'static str, expected: &str, poisons: bool, run: fn(&Target) -> Result<Observed, String>| {
            Scenario { id: id.to_string(), facts, expected: expected.to_string(), run: Box::new(run), poisons }
        };
    vec![
        mk(
            "order/begin_capture_waits_for_register",
            "ordering: register running, then begin_capture (any mode) blocks until it returns",
            "register=ok begin=ok begin-returned=after-register end=ok",
            false,
            begin_waits_for_register,
        ),
        // The fact sheet said A's next enqueue blocks until B's register
        // returns. Measured on the H200 (docs/facts-deltas.md): a
        // cuMemsetD8Async into cuMemAlloc memory does not block; the sim
        // follows the driver (docs/driver-rules.md, row "Registration beside
        // a THREAD_LOCAL or RELAXED capture").
        mk(
            "order/thread_local_capture_register_runs_beside",
            "ordering: THREAD_LOCAL capture open, B registers: B ok (enqueue not blocked, measured)",
            "register=ok enqueue=ok enqueue-returned=before-register end=ok",
            false,
            |t| enqueue_beside_register(t, CaptureMode::ThreadLocal),
        ),
        mk(
            "order/relaxed_capture_register_runs_beside",
            "ordering: RELAXED capture open, B registers: B ok (enqueue not blocked, measured)",
            "register=ok enqueue=ok enqueue-returned=before-register end=ok",
            false,
            |t| enqueue_beside_register(t, CaptureMode::Relaxed),
        ),
        mk(
            "order/unregister_waits_for_kernel",
            "cuMemHostUnregister waits for the device to go idle (running kernel)",
            "before=not-ready unregister=ok after=complete",
            false,
            |t| unregister_waits(t, true),
        ),
        mk(
            "order/unregister_waits_for_copy",
            "cuMemHostUnregister waits for the device to go idle (running copy)",
            "before=not-ready unregister=ok after=complete",
            false,
            |t| unregister_waits(t, false),
        ),
        // The CUDA driver API documentation of cuStreamDestroy: with work
        // still queued it returns at once, and the stream's resources are
        // released once the device has completed that work. Measured on the
        // H200: returned in 43 us (docs/gpu-runs/2026-12-01-destroy-conform/).
        mk(
            "order/stream_destroy_returns_with_work_queued",
            "cuStreamDestroy of a stream with a running kernel returns at once; the kernel still completes",
            "destroy=ok after-destroy=not-ready sync=ok",
            false,
            destroy_busy_stream,
        ),
        mk(
            "order/pageable_capture_reads_at_replay",
            "async copies from pageable memory can be captured; replay reads the memory at replay time",
            "capture=ok replay=ok device-holds=new",
            false,
            pageable_replay,
        ),
        mk(
            "order/batch_copy_in_capture_dropped",
            "cuMemcpyBatchAsync inside a capture: 900, end_capture succeeds, replay copies nothing",
            "batch=900 end=ok replay=ok device-holds=old",
            false,
            batch_in_capture,
        ),
        // Expected values from the CUDA documentation (programming guide,
        // "Cross-stream dependencies and events"; driver API,
        // cuStreamEndCapture and CUDA_ERROR_STREAM_CAPTURE_UNJOINED),
        // confirmed on the H200 (docs/gpu-runs/2026-12-01-final-x2/): the
        // transfer engine's submit relies on this to explain why it records
        // its ordering event inside the gate.
        mk(
            "order/cross_stream_capture_unjoined",
            "cross-stream capture: waiting on an event recorded in a capture joins it; end without rejoin -> 904",
            "join=ok x-status=active x-enqueue=ok end=904 x-work=not-run",
            false,
            |t| cross_stream(t, false),
        ),
        mk(
            "order/cross_stream_capture_rejoined",
            "cross-stream capture: a joined stream's work is captured, not run; after rejoin end ok, replay runs it",
            "join=ok x-status=active x-enqueue=ok end=ok x-after=none before-replay=not-run replay=ok x-work=replayed",
            false,
            |t| cross_stream(t, true),
        ),
        mk(
            "order/replay_after_unregister_poisons",
            "graph replayed after its registered host memory was unregistered: launch OK, sync 719, sticky",
            "unregister=ok launch=ok sync=719 next-call=719",
            true,
            replay_after_unregister,
        ),
    ]
}

fn begin_waits_for_register(t: &Target) -> Result<Observed, String> {
    let (rt, ref c, s, d) = start(t, 4096)?;
    let mut reg = LongRegister::start(t, c)?;
    reg.wait_running()?;
    reg.release_when(Blocked::BeginCapture);
    let t0 = Instant::now();
    let begin = rt.begin_capture(s, CaptureMode::Global);
    let (begin_tick, begin_wait) = (tick(), t0.elapsed());
    // The simulated GPU says whether the registration was still running when
    // begin_capture returned; comparing the two threads' return ticks would
    // race, as both wake when the registration completes. On a real GPU the
    // registration runs for seconds, so the ticks are far apart.
    let sim_still_running = match t {
        Target::Sim(sim) => Some(sim.registers_running() > 0),
        Target::Real(_) => None,
    };
    let (reg_result, reg_tick, reg_dur) = reg.join()?;
    let returned = match sim_still_running {
        Some(true) => "before-register",
        Some(false) => "after-register",
        None => after(begin_tick, reg_tick),
    };
    let end = if begin.is_ok() {
        // SAFETY: `d` is a 4096-byte device allocation, freed below after
        // the graph is destroyed unlaunched (the memset is only captured).
        let _ = unsafe { rt.memset_d8_async(d, 0, 4096, s) };
        rt.end_capture(s)
    } else {
        Err(DriverError::new("cuStreamEndCapture", kvoffload::internal::runtime::Code::ILLEGAL_STATE))
    };
    if let Ok(g) = &end {
        rt.graph_destroy(*g).map_err(de("graph_destroy"))?;
    }
    reg.unregister()?;
    // SAFETY: the scenario is over: its replays were synchronized or never ran, its graphs are destroyed, and the memory is not used again.
    unsafe { free_and_destroy(c, rt.as_ref(), d, s) }?;
    Ok(Observed::new(format!(
        "register={} begin={} begin-returned={} end={}",
        code(&reg_result),
        code(&begin),
        returned,
        code(&end)
    ))
    .with_detail(format!(
        "register {:.2}s, begin_capture waited {:.2}s",
        reg_dur.as_secs_f64(),
        begin_wait.as_secs_f64()
    )))
}

fn enqueue_beside_register(t: &Target, mode: CaptureMode) -> Result<Observed, String> {
    let (rt, ref c, s, d) = start(t, 4096)?;
    rt.begin_capture(s, mode).map_err(de("begin_capture"))?;
    let mut reg = LongRegister::start(t, c)?;
    let running = reg.wait_running();
    let t0 = Instant::now();
    // SAFETY: `d` is a 4096-byte device allocation, freed below after the
    // graph is destroyed unlaunched (the memset is only captured).
    let enq = unsafe { rt.memset_d8_async(d, 0, 4096, s) };
    let (enq_tick, enq_wait) = (tick(), t0.elapsed());
    // On the simulated GPU the register is held until now; a real one
    // finishes by itself.
    reg.release();
    let (reg_result, reg_tick, reg_dur) = reg.join()?;
    let end = rt.end_capture(s);
    if let Ok(g) = &end {
        rt.graph_destroy(*g).map_err(de("graph_destroy"))?;
    }
    reg.unregister()?;
    // SAFETY: the scenario is over: its replays were synchronized or never ran, its graphs are destroyed, and the memory is not used again.
    unsafe { free_and_destroy(c, rt.as_ref(), d, s) }?;
    running?;
    Ok(Observed::new(format!(
        "register={} enqueue={} enqueue-returned={} end={}",
        code(&reg_result),
        code(&enq),
        after(enq_tick, reg_tick),
        code(&end)
    ))
    .with_detail(format!("register {:.2}s, enqueue waited {:.2}s", reg_dur.as_secs_f64(), enq_wait.as_secs_f64())))
}

fn unregister_waits(t: &Target, kernel: bool) -> Result<Observed, String> {
    let rt = t.rt();
    let c = &scenario_coordinator(rt.as_ref())?;
    let s = rt.stream_create().map_err(de("stream"))?;
    let e = rt.event_create().map_err(de("event"))?;
    let small = HostBuf::new(2 << 20, 3)?;
    gated(c, "register", |g| {
        // SAFETY: `small` outlives its registration (unregistered below).
        unsafe { rt.host_register(g, small.addr(), small.len()) }
    })?;
    let hold = match t {
        Target::Sim(sim) => Some(sim.hold(HoldPoint::DeviceOp)),
        Target::Real(_) => None,
    };
    // The device work: a 1 s kernel, or a 2 GiB copy from pinned memory.
    let copy_bytes = size(t, 1 << 20, 2 << 30);
    let mut copy_src = None;
    let mut dev = None;
    if kernel {
        // SAFETY: the spin kernel reads and writes no memory.
        unsafe { rt.launch(Kernel::Spin { nanos: 1_000_000_000 }, s) }.map_err(de("launch"))?;
    } else {
        let src = HostBuf::new(copy_bytes, 9)?;
        gated(c, "register src", |g| {
            // SAFETY: `src` lives until after the stream is synchronized below.
            unsafe { rt.host_register(g, src.addr(), src.len()) }
        })?;
        let d = gated(c, "alloc", |g| rt.mem_alloc(g, copy_bytes))?;
        // SAFETY: as above.
        unsafe { rt.copy_htod_async(d, src.addr(), copy_bytes, s) }.map_err(de("copy"))?;
        copy_src = Some(src);
        dev = Some(d);
    }
    rt.event_record(e, s).map_err(de("event_record"))?;
    if let Some(h) = &hold {
        h.wait_entered();
    }
    let before = gated(c, "query before", |g| rt.event_query(g, e))?;
    release_hold_when(t, hold, Blocked::Idle);
    let t0 = Instant::now();
    let un = gate(c, "unregister", |g| rt.host_unregister(g, small.addr()))?;
    let took = t0.elapsed();
    let after_done = gated(c, "query after", |g| rt.event_query(g, e))?;
    gated(c, "sync", |g| rt.stream_synchronize(g, s))?;
    if let Some(src) = &copy_src {
        gated(c, "unregister src", |g| rt.host_unregister(g, src.addr()))?;
    }
    if let Some(d) = dev {
        // SAFETY: the scenario is over: its replays were synchronized or never ran, its graphs are destroyed, and the memory is not used again.
        gated(c, "free", |g| unsafe { rt.mem_free(g, d) })?;
    }
    rt.event_destroy(e).map_err(de("event_destroy"))?;
    rt.stream_destroy(s).map_err(de("stream_destroy"))?;
    Ok(Observed::new(format!(
        "before={} unregister={} after={}",
        if before { "complete" } else { "not-ready" },
        code(&un),
        if after_done { "complete" } else { "not-ready" }
    ))
    .with_detail(format!("unregister took {:.3}s", took.as_secs_f64())))
}

fn destroy_busy_stream(t: &Target) -> Result<Observed, String> {
    let rt = t.rt();
    let c = &scenario_coordinator(rt.as_ref())?;
    let s = rt.stream_create().map_err(de("stream"))?;
    let e = rt.event_create().map_err(de("event"))?;
    let hold = match t {
        Target::Sim(sim) => Some(sim.hold(HoldPoint::DeviceOp)),
        Target::Real(_) => None,
    };
    // SAFETY: the spin kernel reads and writes no memory.
    unsafe { rt.launch(Kernel::Spin { nanos: 1_000_000_000 }, s) }.map_err(de("launch"))?;
    rt.event_record(e, s).map_err(de("event_record"))?;
    if let Some(h) = &hold {
        h.wait_entered();
    }
    // The destroy runs on a thread of its own: one that waited for the
    // kernel (held, on the sim) would never return; it is then reported as
    // blocked after 10 s and the kernel let go.
    let (tx, rx) = std::sync::mpsc::channel();
    let destroyer = {
        let rt = rt.clone();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let r = rt.stream_destroy(s);
            let _ = tx.send((r, t0.elapsed()));
        })
    };
    let (destroyed, took, after) = match rx.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok((r, took)) => (
            code(&r),
            format!("{:.6}s", took.as_secs_f64()),
            gated(c, "query after destroy", |g| rt.event_query(g, e))?,
        ),
        Err(_) => ("blocked".to_string(), "more than 10 s".to_string(), false),
    };
    if let Some(h) = hold {
        h.release();
    }
    destroyer.join().map_err(|_| "the destroying thread panicked".to_string())?;
    let sync = gate(c, "sync", |g| rt.event_synchronize(g, e))?;
    rt.event_destroy(e).map_err(de("event_destroy"))?;
    Ok(Observed::new(format!(
        "destroy={destroyed} after-destroy={} sync={}",
        if after { "complete" } else { "not-ready" },
        code(&sync)
    ))
    .with_detail(format!("destroy took {took}")))
}

/// Reads `bytes` of device memory back: `"new"` when every byte is `new`,
/// `"old"` when every byte is `old`, `"mixed"` otherwise.
fn read_device(rt: &Arc<dyn GpuRuntime>, d: DevicePtr, bytes: usize, new: u8, old: u8) -> Result<&'static str, String> {
    let out = HostBuf::new(bytes, 0xEE)?;
    // SAFETY: `out` is a live, writable buffer of `bytes` bytes.
    unsafe { rt.copy_dtoh(out.addr(), d, bytes) }.map_err(de("read back"))?;
    Ok(if out.bytes().iter().all(|&b| b == new) {
        "new"
    } else if out.bytes().iter().all(|&b| b == old) {
        "old"
    } else {
        "mixed"
    })
}

fn pageable_replay(t: &Target) -> Result<Observed, String> {
    let bytes = 1 << 20;
    let (rt, ref c, s, d) = start(t, bytes)?;
    let mut src = HostBuf::new(bytes, 1)?;
    rt.begin_capture(s, CaptureMode::Global).map_err(de("begin_capture"))?;
    // SAFETY: `src` outlives every replay of the graph (destroyed below).
    let cap = unsafe { rt.copy_htod_async(d, src.addr(), bytes, s) };
    let end = rt.end_capture(s);
    let mut replay = Err(DriverError::new("cuGraphLaunch", kvoffload::internal::runtime::Code::ILLEGAL_STATE));
    let mut holds = "none";
    if let Ok(g) = end {
        src.fill(2);
        replay = match rt.graph_launch(g, s) {
            Ok(()) => gate(c, "sync", |gt| rt.stream_synchronize(gt, s))?,
            Err(e) => Err(e),
        };
        holds = read_device(&rt, d, bytes, 2, 1)?;
        rt.graph_destroy(g).map_err(de("graph_destroy"))?;
    }
    // SAFETY: the scenario is over: its replays were synchronized or never ran, its graphs are destroyed, and the memory is not used again.
    unsafe { free_and_destroy(c, rt.as_ref(), d, s) }?;
    let capture = if cap.is_ok() && end.is_ok() { "ok".to_string() } else { format!("{}/{}", code(&cap), code(&end)) };
    Ok(Observed::new(format!("capture={capture} replay={} device-holds={holds}", code(&replay))))
}

fn batch_in_capture(t: &Target) -> Result<Observed, String> {
    let frag = 64 << 10;
    let bytes = 2 * frag;
    let (rt, ref c, s, d) = start(t, bytes)?;
    // SAFETY: `d` is a device allocation of `bytes`, synchronized just below.
    unsafe { rt.memset_d8_async(d, 0, bytes, s) }.map_err(de("memset"))?;
    gated(c, "sync", |g| rt.stream_synchronize(g, s))?;
    let src = HostBuf::new(bytes, 7)?;
    gated(c, "register", |g| {
        // SAFETY: `src` outlives its registration (unregistered below).
        unsafe { rt.host_register(g, src.addr(), src.len()) }
    })?;
    let frags: Vec<Fragment> =
        (0..2).map(|i| Fragment { host: src.addr() + i * frag, device: d.offset(i * frag), bytes: frag }).collect();
    rt.begin_capture(s, CaptureMode::Global).map_err(de("begin_capture"))?;
    // SAFETY: `src` stays registered and alive until after the replay.
    let batch = unsafe { rt.copy_batch_async(Direction::HostToDevice, &frags, s) };
    let end = rt.end_capture(s);
    let mut replay = Err(DriverError::new("cuGraphLaunch", kvoffload::internal::runtime::Code::ILLEGAL_STATE));
    let mut holds = "none";
    if let Ok(g) = &end {
        replay = match rt.graph_launch(*g, s) {
            Ok(()) => gate(c, "sync", |gt| rt.stream_synchronize(gt, s))?,
            Err(e) => Err(e),
        };
        holds = read_device(&rt, d, bytes, 7, 0)?;
        rt.graph_destroy(*g).map_err(de("graph_destroy"))?;
    }
    gated(c, "unregister", |g| rt.host_unregister(g, src.addr()))?;
    // SAFETY: the scenario is over: its replays were synchronized or never ran, its graphs are destroyed, and the memory is not used again.
    unsafe { free_and_destroy(c, rt.as_ref(), d, s) }?;
    Ok(Observed::new(format!(
        "batch={} end={} replay={} device-holds={holds}",
        code(&batch),
        code(&end),
        code(&replay)
    )))
}

fn replay_after_unregister(t: &Target) -> Result<Observed, String> {
    let bytes = 1 << 20;
    let (rt, ref c, s, d) = start(t, bytes)?;
    let src = HostBuf::new(bytes, 5)?;
    gated(c, "register", |g| {
        // SAFETY: `src` lives until the end of the function, past every use.
        unsafe { rt.host_register(g, src.addr(), src.len()) }
    })?;
    rt.begin_capture(s, CaptureMode::Global).map_err(de("begin_capture"))?;
    // SAFETY: as above.
    unsafe { rt.copy_htod_async(d, src.addr(), bytes, s) }.map_err(de("captured copy"))?;
    let g = rt.end_capture(s).map_err(de("end_capture"))?;
    let un = gate(c, "unregister", |gt| rt.host_unregister(gt, src.addr()))?;
    let launch = rt.graph_launch(g, s);
    let sync = gate(c, "sync", |gt| rt.stream_synchronize(gt, s))?;
    let next = gate(c, "next call", |gt| rt.mem_alloc(gt, 4096))?;
    // The context is poisoned now (if the driver behaves as
    // docs/driver-rules.md, row "Replay after unregister", says):
    // nothing more can be released; the process (or the simulated GPU) ends.
    Ok(Observed::new(format!(
        "unregister={} launch={} sync={} next-call={}",
        code(&un),
        code(&launch),
        code(&sync),
        code(&next)
    ))
    .with_detail("context left poisoned".to_string()))
}

/// Cross-stream capture, all on one thread: the origin stream captures in
/// GLOBAL mode, records an event; a second stream X waits on it (joins the
/// capture) and enqueues a memset. With `rejoin`, X records an event that
/// the origin waits on before the capture ends, and the graph is replayed.
/// Whether X's memset ran is read back from device memory.
fn cross_stream(t: &Target, rejoin: bool) -> Result<Observed, String> {
    let rt = t.rt();
    let c = &scenario_coordinator(rt.as_ref())?;
    let bytes = 4096;
    let (o, x) = (rt.stream_create().map_err(de("stream"))?, rt.stream_create().map_err(de("stream"))?);
    let (e, e2) = (rt.event_create().map_err(de("event"))?, rt.event_create().map_err(de("event"))?);
    let d_o = gated(c, "alloc", |g| rt.mem_alloc(g, bytes))?;
    let d_x = gated(c, "alloc", |g| rt.mem_alloc(g, bytes))?;
    // SAFETY: both are device allocations of `bytes`, synchronized below and
    // freed at the end, after every graph is destroyed.
    unsafe { rt.memset_d8_async(d_x, 0, bytes, o) }.map_err(de("memset"))?;
    gated(c, "sync", |g| rt.stream_synchronize(g, o))?;

    rt.begin_capture(o, CaptureMode::Global).map_err(de("begin_capture"))?;
    // SAFETY: as above; the memsets are captured, run only by a replay.
    let _ = unsafe { rt.memset_d8_async(d_o, 1, bytes, o) };
    rt.event_record(e, o).map_err(de("event_record"))?;
    let join = rt.stream_wait_event(x, e);
    let x_status = rt.capture_status(x);
    // SAFETY: as above.
    let x_enqueue = unsafe { rt.memset_d8_async(d_x, 2, bytes, x) };
    if rejoin {
        rt.event_record(e2, x).map_err(de("event_record on X"))?;
        rt.stream_wait_event(o, e2).map_err(de("origin waits for X"))?;
    }
    let end = rt.end_capture(o);
    let x_after = rt.capture_status(x);
    // On a driver that left X capturing after a failed end, end X's part so
    // the scenario can clean up (reported in the detail).
    let mut detail = format!("X after end: {}", status_name(&x_after));
    if matches!(x_after, Ok(CaptureStatus::Active) | Ok(CaptureStatus::Invalidated)) {
        let r = rt.end_capture(x);
        detail.push_str(&format!(", end_capture(X): {}", code(&r)));
        if let Ok(g) = r {
            let _ = rt.graph_destroy(g);
        }
    }
    gated(c, "sync", |g| rt.stream_synchronize(g, x))?;
    let before = read_device(&rt, d_x, bytes, 2, 0)?;
    let mut replay = String::new();
    if let Ok(g) = &end {
        let r = match rt.graph_launch(*g, o) {
            Ok(()) => gate(c, "sync", |gt| rt.stream_synchronize(gt, o))?,
            Err(err) => Err(err),
        };
        let after = read_device(&rt, d_x, bytes, 2, 0)?;
        replay = format!(" replay={} x-work={}", code(&r), if after == "new" { "replayed" } else { after });
        rt.graph_destroy(*g).map_err(de("graph_destroy"))?;
    }
    // SAFETY: the scenario is over: its replays were synchronized or never ran, its graphs are destroyed, and the memory is not used again.
    gated(c, "free", |g| unsafe { rt.mem_free(g, d_o) })?;
    // SAFETY: the scenario is over: its replays were synchronized or never ran, its graphs are destroyed, and the memory is not used again.
    gated(c, "free", |g| unsafe { rt.mem_free(g, d_x) })?;
    rt.event_destroy(e).map_err(de("event_destroy"))?;
    rt.event_destroy(e2).map_err(de("event_destroy"))?;
    rt.stream_destroy(o).map_err(de("stream_destroy"))?;
    rt.stream_destroy(x).map_err(de("stream_destroy"))?;
    let work = if before == "old" { "not-run" } else { before };
    let outcome = if end.is_ok() {
        format!(
            "join={} x-status={} x-enqueue={} end=ok x-after={} before-replay={work}{replay}",
            code(&join),
            status_name(&x_status),
            code(&x_enqueue),
            status_name(&x_after)
        )
    } else {
        format!(
            "join={} x-status={} x-enqueue={} end={} x-work={work}",
            code(&join),
            status_name(&x_status),
            code(&x_enqueue),
            code(&end)
        )
    };
    Ok(Observed::new(outcome).with_detail(detail))
}

fn status_name(s: &kvoffload::internal::runtime::DriverResult<CaptureStatus>) -> String {
    match s {
        Ok(CaptureStatus::None) => "none".into(),
        Ok(CaptureStatus::Active) => "active".into(),
        Ok(CaptureStatus::Invalidated) => "invalidated".into(),
        Err(e) => e.code.0.to_string(),
    }
}
