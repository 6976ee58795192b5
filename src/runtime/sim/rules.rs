//! The capture rules of the real driver, as the simulated GPU applies them.
//! Each rule names the FACTS.md row it reproduces; the conformance suite
//! (`kvoffload conform`) re-measures every one on a real GPU.

use crate::runtime::{CaptureMode, Code};
use crate::sync::thread::ThreadId;

use super::state::State;

/// The driver calls that stream capture restricts.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum UnsafeCall {
    /// FACTS 1, row "cuMemHostRegister": 900 and invalidation in default
    /// mode, allowed in relaxed mode.
    Register,
    /// FACTS 1, row "cuMemHostUnregister": same as register.
    Unregister,
    /// FACTS 1, row "cuEventRecord + cuEventQuery": the query is refused
    /// (event_record itself is not). Event synchronize is treated the same.
    EventWait,
    /// FACTS 1, row "cuStreamSynchronize(other stream)".
    StreamSync,
    /// FACTS 1, rows "cuMemAlloc" and "cuMemAllocHost"; cuMemFree and
    /// cuMemFreeHost the same (conformance cells `mem_free` and
    /// `mem_free_host`, H200 2026-11-30: 900 and invalidation in default
    /// mode, allowed relaxed).
    Alloc,
    /// FACTS 1, row "cuCtxSynchronize": refused even in relaxed mode.
    CtxSync,
}

/// Applies the capture rules to a call made by thread `me`.
///
/// The driver's rule (CUDA programming guide, "cudaStreamCaptureMode", and
/// FACTS 1): a thread in GLOBAL mode (the default) may not make an unsafe
/// call while any other thread has a GLOBAL capture open, or while it has a
/// non-relaxed capture of its own; a thread in THREAD_LOCAL mode only while
/// it has a non-relaxed capture of its own; a RELAXED thread always may.
/// A refused call fails with 900 and invalidates the captures that refused
/// it. `cuCtxSynchronize` is refused during any capture, whatever the mode
/// (FACTS 1, row "cuCtxSynchronize", relaxed column).
pub(crate) fn check(st: &mut State, me: ThreadId, call: UnsafeCall) -> Result<(), Code> {
    let my_mode = st.thread_mode(me);
    let mut refused = false;
    for s in st.streams.values_mut() {
        let Some(c) = s.capture.as_mut() else {
            continue;
        };
        if c.invalidated {
            continue;
        }
        let own = c.owner == me;
        let hit = match call {
            UnsafeCall::CtxSync => true,
            _ => match my_mode {
                CaptureMode::Relaxed => false,
                CaptureMode::ThreadLocal => own && c.mode != CaptureMode::Relaxed,
                CaptureMode::Global => {
                    (own && c.mode != CaptureMode::Relaxed) || (!own && c.mode == CaptureMode::Global)
                }
            },
        };
        if hit {
            c.invalidated = true;
            refused = true;
        }
    }
    if refused {
        tracing::debug!(?call, ?me, "sim: capture-unsafe call refused (900), capture invalidated");
        Err(Code::STREAM_CAPTURE_UNSUPPORTED)
    } else {
        Ok(())
    }
}
