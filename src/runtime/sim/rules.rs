//! The capture rules of the real driver, as the simulated GPU applies them,
//! and the one table of driver calls whose behaviour during another
//! thread's capture was measured.
//!
//! **Default deny.** A call is let through during another thread's GLOBAL
//! capture only when [`MEASURED`] lists it with a measurement that says it
//! is safe there (the conformance cells of `kvoffload conform`, measured on
//! an H200 and committed in docs/conformance-h200.md; each row is a row of
//! docs/driver-rules.md, section 1, with the value measured). A call the table does not list is refused
//! with 900 and invalidates that capture, whatever the calling thread's
//! mode, and the refusal names the missing row (trace event and
//! [`super::SimRuntime::refusals`]). So is any call that touches a stream
//! taking part in another thread's capture (the capturing stream itself, or
//! a stream joined to it): every cell measured its call on a stream outside
//! the capture, and nothing measured a thread working on another thread's
//! capture. A model that passes on the sim therefore never relied on a call
//! being harmless during a capture without a measurement saying so.
//!
//! The capturing thread's own calls are not restricted by this table: its
//! enqueues onto its capturing streams are the capture itself, and its
//! capture-unsafe calls follow the driver's mode rules ([`check`]).

use crate::runtime::{CaptureMode, Code};
use crate::sync::thread::ThreadId;

use super::state::{Refusal, State};

/// Every driver call of the runtime trait, by its driver entry point.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    HostRegister,
    HostUnregister,
    HostDevicePtr,
    MemAlloc,
    MemFree,
    MemAllocHost,
    MemFreeHost,
    StreamCreate,
    StreamDestroy,
    StreamSynchronize,
    CtxSynchronize,
    StreamWaitEvent,
    CopyHtodAsync,
    CopyDtohAsync,
    CopyHtod,
    CopyDtoh,
    CopyBatchAsync,
    MemsetAsync,
    Launch,
    EventCreate,
    EventDestroy,
    EventRecord,
    EventQuery,
    EventSynchronize,
    EventElapsedTime,
    BeginCapture,
    EndCapture,
    CaptureStatus,
    ExchangeCaptureMode,
    GraphLaunch,
    GraphDestroy,
}

impl Call {
    /// The driver entry point (what traces and errors name).
    pub(crate) fn driver_name(self) -> &'static str {
        match self {
            Call::HostRegister => "cuMemHostRegister",
            Call::HostUnregister => "cuMemHostUnregister",
            Call::HostDevicePtr => "cuMemHostGetDevicePointer",
            Call::MemAlloc => "cuMemAlloc",
            Call::MemFree => "cuMemFree",
            Call::MemAllocHost => "cuMemAllocHost",
            Call::MemFreeHost => "cuMemFreeHost",
            Call::StreamCreate => "cuStreamCreate",
            Call::StreamDestroy => "cuStreamDestroy",
            Call::StreamSynchronize => "cuStreamSynchronize",
            Call::CtxSynchronize => "cuCtxSynchronize",
            Call::StreamWaitEvent => "cuStreamWaitEvent",
            Call::CopyHtodAsync => "cuMemcpyHtoDAsync",
            Call::CopyDtohAsync => "cuMemcpyDtoHAsync",
            Call::CopyHtod => "cuMemcpyHtoD",
            Call::CopyDtoh => "cuMemcpyDtoH",
            Call::CopyBatchAsync => "cuMemcpyBatchAsync",
            Call::MemsetAsync => "cuMemsetD8Async",
            Call::Launch => "cuLaunchKernel",
            Call::EventCreate => "cuEventCreate",
            Call::EventDestroy => "cuEventDestroy",
            Call::EventRecord => "cuEventRecord",
            Call::EventQuery => "cuEventQuery",
            Call::EventSynchronize => "cuEventSynchronize",
            Call::EventElapsedTime => "cuEventElapsedTime",
            Call::BeginCapture => "cuStreamBeginCapture",
            Call::EndCapture => "cuStreamEndCapture",
            Call::CaptureStatus => "cuStreamIsCapturing",
            Call::ExchangeCaptureMode => "cuThreadExchangeStreamCaptureMode",
            Call::GraphLaunch => "cuGraphLaunch",
            Call::GraphDestroy => "cuGraphExecDestroy",
        }
    }
}

/// What a measurement says a call does when made by one thread while
/// another thread has a GLOBAL capture open.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Succeeds and leaves the capture working, in default and in relaxed
    /// mode.
    Safe,
    /// Fails with 900 and invalidates the capture in default (GLOBAL) mode;
    /// allowed in relaxed mode. Capture-unsafe: the runtime trait asks for a
    /// `Gate`.
    Unsafe,
    /// Fails with 900 and invalidates the capture even in relaxed mode.
    UnsafeEvenRelaxed,
}

/// One measured row.
pub(crate) struct Row {
    pub call: Call,
    pub effect: Effect,
    /// Where it was measured: conformance cells (docs/conformance-h200.md, measured on
    /// the H200) and the row of docs/driver-rules.md.
    pub measured: &'static str,
}

/// The driver calls measured during another thread's GLOBAL capture, with
/// the measurement. Every call not listed here is denied during another
/// thread's GLOBAL capture (module docs). The calls taking a `Gate` in the
/// runtime trait are exactly the `Unsafe` and `UnsafeEvenRelaxed` rows.
///
/// Not listed, for want of a measurement: `cuStreamBeginCapture`,
/// `cuStreamEndCapture`, `cuGraphLaunch`, `cuGraphExecDestroy` (made by a
/// thread other than the capturing one).
pub(crate) const MEASURED: &[Row] = &[
    Row {
        call: Call::HostRegister,
        effect: Effect::Unsafe,
        measured: "cells register/default, register/relaxed (docs/driver-rules.md, row \"cuMemHostRegister\")",
    },
    Row {
        call: Call::HostUnregister,
        effect: Effect::Unsafe,
        measured: "cells unregister/default, unregister/relaxed (docs/driver-rules.md, row \"cuMemHostUnregister\")",
    },
    Row {
        call: Call::EventQuery,
        effect: Effect::Unsafe,
        measured: "cells event_record_query/*, event_query/* (docs/driver-rules.md, row \"cuEventQuery\")",
    },
    Row {
        call: Call::EventSynchronize,
        effect: Effect::Unsafe,
        measured: "cells event_sync/default, event_sync/relaxed",
    },
    Row {
        call: Call::StreamSynchronize,
        effect: Effect::Unsafe,
        measured: "cells stream_sync_other/* (docs/driver-rules.md, row \"cuStreamSynchronize\")",
    },
    Row {
        call: Call::CtxSynchronize,
        effect: Effect::UnsafeEvenRelaxed,
        measured: "cells ctx_sync/default, ctx_sync/relaxed (docs/driver-rules.md, row \"cuCtxSynchronize\")",
    },
    Row {
        call: Call::MemAlloc,
        effect: Effect::Unsafe,
        measured: "cells mem_alloc/* (docs/driver-rules.md, row \"cuMemAlloc\")",
    },
    Row {
        call: Call::MemAllocHost,
        effect: Effect::Unsafe,
        measured: "cells mem_alloc_host/* (docs/driver-rules.md, row \"cuMemAllocHost\")",
    },
    Row { call: Call::MemFree, effect: Effect::Unsafe, measured: "cells mem_free/default, mem_free/relaxed" },
    Row {
        call: Call::MemFreeHost,
        effect: Effect::Unsafe,
        measured: "cells mem_free_host/default, mem_free_host/relaxed",
    },
    Row {
        call: Call::CopyHtodAsync,
        effect: Effect::Safe,
        measured: "cells copy_async_pinned/*, copy_async_pageable/* (docs/driver-rules.md, row \"cuMemcpyHtoDAsync\")",
    },
    Row {
        call: Call::CopyHtod,
        effect: Effect::Safe,
        measured: "cells copy_sync_pinned/* (docs/driver-rules.md, row \"cuMemcpyHtoD\")",
    },
    Row { call: Call::CopyDtohAsync, effect: Effect::Safe, measured: "cells copy_dtoh_async_pinned/*" },
    Row { call: Call::CopyDtoh, effect: Effect::Safe, measured: "cells copy_sync_dtoh_pinned/*" },
    Row { call: Call::CopyBatchAsync, effect: Effect::Safe, measured: "cells copy_batch_pinned/*" },
    Row { call: Call::MemsetAsync, effect: Effect::Safe, measured: "cells memset_async/*" },
    Row { call: Call::Launch, effect: Effect::Safe, measured: "cells launch/*" },
    Row { call: Call::EventCreate, effect: Effect::Safe, measured: "cells event_create/*" },
    Row { call: Call::EventDestroy, effect: Effect::Safe, measured: "cells event_destroy/*" },
    Row { call: Call::EventRecord, effect: Effect::Safe, measured: "cells event_record/*" },
    Row { call: Call::StreamCreate, effect: Effect::Safe, measured: "cells stream_create/*" },
    Row { call: Call::StreamDestroy, effect: Effect::Safe, measured: "cells stream_destroy/* (an idle stream)" },
    Row {
        call: Call::StreamWaitEvent,
        effect: Effect::Safe,
        measured: "cells stream_wait_event/* (both streams outside the capture)",
    },
    Row { call: Call::HostDevicePtr, effect: Effect::Safe, measured: "cells host_device_ptr/*" },
    Row { call: Call::CaptureStatus, effect: Effect::Safe, measured: "cells capture_status_other/* (another stream)" },
    // Not a cell of its own: in every `cell/*/relaxed` scenario thread B
    // switches itself to RELAXED (from GLOBAL mode) and back while A's
    // GLOBAL capture is open, and A's capture ended with a graph in every
    // relaxed cell whose own call is safe relaxed (H200, docs/conformance-h200.md).
    Row {
        call: Call::ExchangeCaptureMode,
        effect: Effect::Safe,
        measured: "cells */relaxed (B switches to RELAXED and back during A's capture)",
    },
];

/// The measured row of `call`, if any.
pub(crate) fn row(call: Call) -> Option<&'static Row> {
    MEASURED.iter().find(|r| r.call == call)
}

/// Applies the capture rules to `call` made by thread `me` that touches
/// the streams `touched` (stream ids; the target stream, and for an event
/// wait the stream the event was recorded on).
///
/// 1. A touched stream taking part in another thread's capture (its
///    origin stream or a stream joined to it): no row measures that; 900,
///    and that capture is invalidated.
/// 2. A call with no row in [`MEASURED`]: 900 and invalidation of every
///    other thread's GLOBAL capture open now, whatever `me`'s mode.
/// 3. A capture-unsafe row (the driver's rule, CUDA programming guide,
///    "cudaStreamCaptureMode"; docs/driver-rules.md, row "Capture modes"):
///    a thread in GLOBAL mode (the default) may not make it while any
///    other thread has a GLOBAL capture open, or while it has a non-relaxed
///    capture of its own; a thread in THREAD_LOCAL mode only while it has a non-relaxed capture of its own;
///    a RELAXED thread always may, except for `cuCtxSynchronize`, refused
///    during any capture whatever the mode (cell `ctx_sync/relaxed`).
///
/// A refused call fails with 900 and invalidates the captures that refused
/// it; the refusal is returned for the trace.
pub(crate) fn check(st: &mut State, me: ThreadId, call: Call, touched: &[u64]) -> Result<(), Refusal> {
    let measured = row(call);
    let my_mode = st.thread_mode(me);
    let mut reason: Option<String> = None;
    // 1. Work on another thread's capture.
    for &sid in touched {
        let Some(origin) = st.capture_origin(sid) else { continue };
        let Some(c) = st.streams.get_mut(&origin).and_then(|s| s.capture.as_mut()) else { continue };
        if c.owner != me && !c.invalidated {
            c.invalidated = true;
            reason.get_or_insert_with(|| {
                format!(
                    "no measured row for {} on a stream taking part in another thread's {} capture (every cell measured its call on a stream outside the capture)",
                    call.driver_name(),
                    c.mode.name()
                )
            });
        }
    }
    for s in st.streams.values_mut() {
        let Some(c) = s.capture.as_mut() else {
            continue;
        };
        if c.invalidated {
            continue;
        }
        let own = c.owner == me;
        let hit = match measured.map(|r| r.effect) {
            // 2. Default deny.
            None => !own && c.mode == CaptureMode::Global,
            Some(Effect::Safe) => false,
            // 3. The driver's mode rules.
            Some(Effect::UnsafeEvenRelaxed) => true,
            Some(Effect::Unsafe) => match my_mode {
                CaptureMode::Relaxed => false,
                CaptureMode::ThreadLocal => own && c.mode != CaptureMode::Relaxed,
                CaptureMode::Global => {
                    (own && c.mode != CaptureMode::Relaxed) || (!own && c.mode == CaptureMode::Global)
                }
            },
        };
        if hit {
            c.invalidated = true;
            reason.get_or_insert_with(|| match measured {
                None => format!(
                    "no measured row for {} during another thread's GLOBAL capture (default deny, src/runtime/sim/rules.rs MEASURED)",
                    call.driver_name()
                ),
                Some(r) => format!("capture-unsafe in {} mode ({})", my_mode.name(), r.measured),
            });
        }
    }
    match reason {
        None => Ok(()),
        Some(reason) => {
            let refusal = Refusal { call: call.driver_name(), reason };
            tracing::debug!(call = refusal.call, reason = %refusal.reason, ?me, "sim: call refused (900), capture invalidated");
            Err(refusal)
        }
    }
}

/// The code a refused call fails with (docs/driver-rules.md, row "Refused
/// call").
pub(crate) const REFUSED: Code = Code::STREAM_CAPTURE_UNSUPPORTED;
