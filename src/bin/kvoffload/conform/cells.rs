//! The cells of the fact sheet's capture table, and one cell per further driver
//! call that a library thread makes: thread A captures in GLOBAL mode on its
//! own stream, thread B makes one call (in default mode, or after switching
//! itself to RELAXED), then A enqueues one more operation and ends the
//! capture.
//!
//! The first ten calls are the fact sheet's rows (the H200 probe's; marked
//! "probe" in docs/driver-rules.md, section 1). The rest are every
//! other call the library makes, each alone (an event record without the
//! query, a free without an allocation): their rows are this suite's own
//! measurements, committed in docs/conformance-h200.md.
//!
//! Observed format: `B=<result> A-enqueue=<result> end=<result>` where a
//! result is `ok` or the driver code.
//!
//! B's capture-unsafe calls go through the gate of the cell's own
//! coordinator, which knows nothing of A's capture and so lets them run
//! during it: making them there is the point (see [`super::probe`]).

use kvoffload::internal::protocol::Coordinator;
use kvoffload::internal::runtime::{CaptureMode, DevicePtr, Direction, Event, Fragment, GpuRuntime, Kernel, Stream};
use kvoffload::internal::sync::{thread, Arc};

use super::probe::{gate, scenario_coordinator, HostBuf, Target};
use super::{code, Observed, Scenario};

/// Bytes each copy in a cell moves.
const COPY: usize = 1 << 20;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Call {
    Register,
    Unregister,
    CopyPinned,
    CopyPageable,
    EventQuery,
    StreamSync,
    CtxSync,
    MemAlloc,
    MemAllocHost,
    CopySyncPinned,
    EventRecord,
    EventQuery1,
    EventSync,
    EventCreate,
    EventDestroy,
    StreamCreate,
    StreamDestroy,
    StreamWaitEvent,
    Launch,
    Memset,
    CopyBatch,
    CopyDtohPinned,
    CopySyncDtoh,
    MemFree,
    MemFreeHost,
    HostDevicePtr,
    CaptureStatusOther,
    EventCreateTimed,
    EventElapsed,
}

/// (call, id, the row's description (docs/driver-rules.md, section 1), refused
/// in default mode, refused in relaxed mode)
const TABLE: &[(Call, &str, &str, bool, bool)] = &[
    (Call::Register, "register", "cuMemHostRegister", true, false),
    (Call::Unregister, "unregister", "cuMemHostUnregister", true, false),
    (Call::CopyPinned, "copy_async_pinned", "cuMemcpyHtoDAsync on another stream, pinned src", false, false),
    (Call::CopyPageable, "copy_async_pageable", "cuMemcpyHtoDAsync on another stream, pageable src", false, false),
    (Call::EventQuery, "event_record_query", "cuEventRecord + cuEventQuery on another stream", true, false),
    (Call::StreamSync, "stream_sync_other", "cuStreamSynchronize(other stream)", true, false),
    (Call::CtxSync, "ctx_sync", "cuCtxSynchronize", true, true),
    (Call::MemAlloc, "mem_alloc", "cuMemAlloc", true, false),
    (Call::MemAllocHost, "mem_alloc_host", "cuMemAllocHost", true, false),
    (Call::CopySyncPinned, "copy_sync_pinned", "synchronous cuMemcpyHtoD, pinned src", false, false),
    // Measured by this suite (docs/conformance-h200.md), each call alone.
    (Call::EventRecord, "event_record", "cuEventRecord alone, another stream", false, false),
    (Call::EventQuery1, "event_query", "cuEventQuery alone, event recorded before the capture", true, false),
    (Call::EventSync, "event_sync", "cuEventSynchronize alone, event recorded before the capture", true, false),
    (Call::EventCreate, "event_create", "cuEventCreate", false, false),
    (Call::EventDestroy, "event_destroy", "cuEventDestroy", false, false),
    (Call::StreamCreate, "stream_create", "cuStreamCreate", false, false),
    (Call::StreamDestroy, "stream_destroy", "cuStreamDestroy of an idle stream", false, false),
    (Call::StreamWaitEvent, "stream_wait_event", "cuStreamWaitEvent, both streams outside the capture", false, false),
    (Call::Launch, "launch", "cuLaunchKernel on another stream", false, false),
    (Call::Memset, "memset_async", "cuMemsetD8Async on another stream", false, false),
    (Call::CopyBatch, "copy_batch_pinned", "cuMemcpyBatchAsync on another stream, pinned src", false, false),
    (Call::CopyDtohPinned, "copy_dtoh_async_pinned", "cuMemcpyDtoHAsync on another stream, pinned dst", false, false),
    (Call::CopySyncDtoh, "copy_sync_dtoh_pinned", "synchronous cuMemcpyDtoH, pinned dst", false, false),
    (Call::MemFree, "mem_free", "cuMemFree", true, false),
    (Call::MemFreeHost, "mem_free_host", "cuMemFreeHost", true, false),
    (Call::HostDevicePtr, "host_device_ptr", "cuMemHostGetDevicePointer", false, false),
    (Call::CaptureStatusOther, "capture_status_other", "cuStreamIsCapturing of another stream", false, false),
    // The transfer jobs' device time (issue 42): a timed event, and the
    // time between two timed events complete before the capture. The
    // elapsed time is expected refused in both modes until it is measured
    // (the sim denies an unmeasured call in both; the library gates it).
    (Call::EventCreateTimed, "event_create_timed", "cuEventCreate with timing", false, false),
    (Call::EventElapsed, "event_elapsed", "cuEventElapsedTime_v2, events recorded before the capture", true, true),
];

fn expected(refused: bool) -> String {
    if refused {
        // docs/driver-rules.md, row "Refused call": 900
        // STREAM_CAPTURE_UNSUPPORTED, A's capture invalidated (end_capture ->
        // 901, no graph); A's next enqueue meets the invalidated capture
        // (901).
        "B=900 A-enqueue=901 end=901".into()
    } else {
        "B=ok A-enqueue=ok end=ok".into()
    }
}

pub(super) fn scenarios() -> Vec<Scenario> {
    let mut v = Vec::new();
    for &(call, id, row, refused_default, refused_relaxed) in TABLE {
        for (relaxed, refused) in [(false, refused_default), (true, refused_relaxed)] {
            v.push(Scenario {
                id: format!("cell/{id}/{}", if relaxed { "relaxed" } else { "default" }),
                facts: row,
                expected: expected(refused),
                run: Box::new(move |t| run_cell(t, call, relaxed)),
                poisons: false,
            });
        }
    }
    v
}

/// Resources of one cell, released in `cleanup` whatever happened.
struct Fixture {
    rt: Arc<dyn GpuRuntime>,
    /// The cell's own coordinator: the gate of its capture-unsafe calls.
    coord: Arc<Coordinator>,
    s1: Stream,
    s2: Stream,
    d1: DevicePtr,
    d2: DevicePtr,
    pinned: HostBuf,
    pageable: HostBuf,
    /// Made before the capture for the cells whose call consumes or waits
    /// on something: a third stream, an event recorded on `s2` (complete
    /// before the capture begins), a device and a page-locked allocation.
    s3: Stream,
    ev: Event,
    d3: DevicePtr,
    h3: usize,
    /// Two timed events recorded on `s2`, complete before the capture.
    timed: (Event, Event),
}

impl Fixture {
    fn new(rt: Arc<dyn GpuRuntime>) -> Result<Self, String> {
        let e = |e: kvoffload::internal::runtime::DriverError| format!("setup: {e}");
        let coord = scenario_coordinator(rt.as_ref())?;
        let c = &coord;
        let pinned = HostBuf::new(4 * COPY, 1)?;
        let pageable = HostBuf::new(4 * COPY, 2)?;
        let s1 = rt.stream_create().map_err(e)?;
        let s2 = rt.stream_create().map_err(e)?;
        let d1 = gate(c, "setup", |g| rt.mem_alloc(g, COPY))?.map_err(e)?;
        let d2 = gate(c, "setup", |g| rt.mem_alloc(g, COPY))?.map_err(e)?;
        gate(c, "setup", |g| {
            // SAFETY: `pinned` lives in the fixture, which unregisters it in
            // cleanup before dropping it.
            unsafe { rt.host_register(g, pinned.addr(), pinned.len()) }
        })?
        .map_err(e)?;
        let s3 = rt.stream_create().map_err(e)?;
        let ev = rt.event_create().map_err(e)?;
        rt.event_record(ev, s2).map_err(e)?;
        let d3 = gate(c, "setup", |g| rt.mem_alloc(g, COPY))?.map_err(e)?;
        let h3 = gate(c, "setup", |g| rt.mem_alloc_host(g, COPY))?.map_err(e)?;
        let timed = (rt.event_create_timed().map_err(e)?, rt.event_create_timed().map_err(e)?);
        rt.event_record(timed.0, s2).map_err(e)?;
        // SAFETY: `d2` is the fixture's device buffer of COPY bytes.
        unsafe { rt.memset_d8_async(d2, 3, COPY, s2) }.map_err(e)?;
        rt.event_record(timed.1, s2).map_err(e)?;
        gate(c, "setup", |g| rt.ctx_synchronize(g))?.map_err(e)?;
        Ok(Fixture { rt, coord, s1, s2, d1, d2, pinned, pageable, s3, ev, d3, h3, timed })
    }

    /// Releases everything. A registration may already be gone (the
    /// unregister cell) or added (the register cell): 713 is expected there.
    fn cleanup(self, left: &Leftover) -> Result<(), String> {
        let rt = &self.rt;
        let c = &self.coord;
        let mut errs = Vec::new();
        let mut note = |r: kvoffload::internal::runtime::DriverResult<()>, allow_713: bool| {
            if let Err(e) = r {
                if !(allow_713 && e.code == kvoffload::internal::runtime::Code::HOST_MEMORY_NOT_REGISTERED) {
                    errs.push(e.to_string());
                }
            }
        };
        note(gate(c, "cleanup", |g| rt.ctx_synchronize(g))?, false);
        // SAFETY (each free below): the context was synchronized just above,
        // so no device work of the cell uses the memory any more, and the
        // fixture is consumed: nothing uses it afterwards.
        note(gate(c, "cleanup", |g| rt.host_unregister(g, self.pinned.addr()))?, true);
        note(gate(c, "cleanup", |g| rt.host_unregister(g, self.pageable.addr()))?, true);
        if let Some(p) = left.device {
            note(gate(c, "cleanup", |g| unsafe { rt.mem_free(g, p) })?, false);
        }
        if let Some(h) = left.host {
            note(gate(c, "cleanup", |g| unsafe { rt.mem_free_host(g, h) })?, false);
        }
        if let Some(e) = left.event {
            note(rt.event_destroy(e), false);
        }
        if let Some(s) = left.stream {
            note(rt.stream_destroy(s), false);
        }
        // What B consumed is gone when its call succeeded.
        if !left.consumed_event {
            note(rt.event_destroy(self.ev), false);
        }
        if !left.consumed_stream {
            note(rt.stream_destroy(self.s3), false);
        }
        if !left.consumed_device {
            note(gate(c, "cleanup", |g| unsafe { rt.mem_free(g, self.d3) })?, false);
        }
        if !left.consumed_host {
            note(gate(c, "cleanup", |g| unsafe { rt.mem_free_host(g, self.h3) })?, false);
        }
        note(gate(c, "cleanup", |g| unsafe { rt.mem_free(g, self.d1) })?, false);
        note(gate(c, "cleanup", |g| unsafe { rt.mem_free(g, self.d2) })?, false);
        note(rt.event_destroy(self.timed.0), false);
        note(rt.event_destroy(self.timed.1), false);
        note(rt.stream_destroy(self.s1), false);
        note(rt.stream_destroy(self.s2), false);
        if errs.is_empty() {
            Ok(())
        } else {
            Err(format!("cleanup: {}", errs.join("; ")))
        }
    }
}

/// What B's call produced that needs releasing afterwards.
#[derive(Default)]
struct Leftover {
    device: Option<DevicePtr>,
    host: Option<usize>,
    event: Option<Event>,
    stream: Option<Stream>,
    consumed_event: bool,
    consumed_stream: bool,
    consumed_device: bool,
    consumed_host: bool,
}

fn run_cell(t: &Target, call: Call, relaxed: bool) -> Result<Observed, String> {
    let rt = t.rt();
    let f = Fixture::new(rt.clone())?;
    rt.begin_capture(f.s1, CaptureMode::Global).map_err(|e| format!("begin_capture: {e}"))?;

    let (b_rt, b_coord, s2, d2, pinned, pageable) =
        (rt.clone(), f.coord.clone(), f.s2, f.d2, f.pinned.addr(), f.pageable.addr());
    let (s3, ev, d3, h3, timed) = (f.s3, f.ev, f.d3, f.h3, f.timed);
    let pageable_len = f.pageable.len();
    let b = thread::spawn(move || {
        let rt = b_rt;
        let prev = if relaxed { Some(rt.exchange_capture_mode(CaptureMode::Relaxed)) } else { None };
        let mut left = Leftover::default();
        // B's one call, inside the gate of the cell's coordinator, which lets
        // it run during A's capture (see the module docs); the ungated calls
        // are made in the same place, so every cell's B is alike.
        let r = gate(&b_coord, "B's call", |gate| -> kvoffload::internal::runtime::DriverResult<()> {
            match call {
                // SAFETY: the fixture's pageable buffer outlives the cell and is
                // unregistered in cleanup.
                Call::Register => unsafe { rt.host_register(gate, pageable, pageable_len) },
                Call::Unregister => rt.host_unregister(gate, pinned),
                // SAFETY: source buffers live in the fixture until cleanup, which
                // synchronizes the context first.
                Call::CopyPinned => unsafe { rt.copy_htod_async(d2, pinned, COPY, s2) },
                // SAFETY: as above.
                Call::CopyPageable => unsafe { rt.copy_htod_async(d2, pageable, COPY, s2) },
                Call::EventQuery => rt.event_create().and_then(|e| {
                    left.event = Some(e);
                    rt.event_record(e, s2)?;
                    rt.event_query(gate, e).map(|_| ())
                }),
                Call::StreamSync => rt.stream_synchronize(gate, s2),
                Call::CtxSync => rt.ctx_synchronize(gate),
                Call::MemAlloc => rt.mem_alloc(gate, COPY).map(|p| left.device = Some(p)),
                Call::MemAllocHost => rt.mem_alloc_host(gate, COPY).map(|h| left.host = Some(h)),
                // SAFETY: the pinned buffer is readable for the fixture's life.
                Call::CopySyncPinned => unsafe { rt.copy_htod(d2, pinned, COPY) },
                Call::EventRecord => rt.event_record(ev, s2),
                Call::EventQuery1 => rt.event_query(gate, ev).map(|_| ()),
                Call::EventSync => rt.event_synchronize(gate, ev),
                Call::EventCreate => rt.event_create().map(|e| left.event = Some(e)),
                Call::EventDestroy => rt.event_destroy(ev).map(|()| left.consumed_event = true),
                Call::StreamCreate => rt.stream_create().map(|s| left.stream = Some(s)),
                Call::StreamDestroy => rt.stream_destroy(s3).map(|()| left.consumed_stream = true),
                Call::StreamWaitEvent => rt.stream_wait_event(s3, ev),
                // SAFETY: the spin kernel reads and writes no memory.
                Call::Launch => unsafe { rt.launch(Kernel::Spin { nanos: 1_000 }, s2) },
                // SAFETY: `d2` is the fixture's device buffer of COPY bytes, freed
                // in cleanup after the context is synchronized.
                Call::Memset => unsafe { rt.memset_d8_async(d2, 7, COPY, s2) },
                // SAFETY: as for the single async copies.
                Call::CopyBatch => unsafe {
                    rt.copy_batch_async(
                        Direction::HostToDevice,
                        &[Fragment { host: pinned, device: d2, bytes: COPY }],
                        s2,
                    )
                },
                // SAFETY: the pinned buffer is writable and read by nobody until
                // cleanup, which synchronizes the context first.
                Call::CopyDtohPinned => unsafe { rt.copy_dtoh_async(pinned, d2, COPY, s2) },
                // SAFETY: as above, synchronously.
                Call::CopySyncDtoh => unsafe { rt.copy_dtoh(pinned, d2, COPY) },
                // SAFETY: `d3` and `h3` were made for this cell and no work
                // ever used them; a freed one is marked consumed so that
                // cleanup does not free it again.
                Call::MemFree => unsafe { rt.mem_free(gate, d3) }.map(|()| left.consumed_device = true),
                // SAFETY: as above.
                Call::MemFreeHost => unsafe { rt.mem_free_host(gate, h3) }.map(|()| left.consumed_host = true),
                Call::HostDevicePtr => rt.host_device_ptr(pinned).map(|_| ()),
                Call::CaptureStatusOther => rt.capture_status(s2).map(|_| ()),
                Call::EventCreateTimed => rt.event_create_timed().map(|e| left.event = Some(e)),
                Call::EventElapsed => rt.event_elapsed(gate, timed.0, timed.1).map(|_| ()),
            }
        });
        let restore = match prev {
            Some(Ok(m)) => rt.exchange_capture_mode(m).map(|_| ()),
            Some(Err(e)) => Err(e),
            None => Ok(()),
        };
        (r, restore, left)
    });
    let (b_result, restore, left) = b.join().map_err(|_| "thread B panicked".to_string())?;
    restore.map_err(|e| format!("B's capture mode exchange: {e}"))?;

    // SAFETY: `d1` is the fixture's device buffer of COPY bytes; the memset
    // is captured, not run, and its graph is destroyed below, unlaunched.
    let a_enqueue = unsafe { rt.memset_d8_async(f.d1, 1, COPY, f.s1) };
    let end = rt.end_capture(f.s1);
    let mut cleanup_errs = Vec::new();
    if let Ok(g) = &end {
        if let Err(e) = rt.graph_destroy(*g) {
            cleanup_errs.push(e.to_string());
        }
    }
    f.cleanup(&left)?;
    let b_result = b_result?;
    let outcome = format!("B={} A-enqueue={} end={}", code(&b_result), code(&a_enqueue), code(&end));
    if !cleanup_errs.is_empty() {
        return Err(cleanup_errs.join("; "));
    }
    Ok(Observed::new(outcome))
}
