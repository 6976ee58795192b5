//! How the offloader's [`Request`]s reach its coordinator: the one place
//! that maps a request (interleave, an interrupt check, the model builds'
//! at-request note) onto the coordinator's waits. Every wait and window
//! that takes a request goes through these four functions (the capture
//! hook's flush also hands the request's check to
//! `Coordinator::wait_no_window_or_request`), so a change of the
//! coordinator's calls is a change here, and in that one call.

use crate::protocol::{CaptureWindow, Coordinator, PinState, ProtocolError, Request};
use crate::runtime::Gate;

/// Opens a capture window as `req` asks: under the Interleave rules when
/// `interleave` (the capture hook's windows) or the request says so,
/// otherwise under the coordinator's policy; interruptible when the
/// request has a check. In model builds a request that is not
/// interruptible runs its at-request note under the coordinator's lock.
pub(super) fn open_window(
    coord: &Coordinator,
    req: Request<'_>,
    interleave: bool,
) -> Result<CaptureWindow, ProtocolError> {
    let interleave = interleave || req.is_interleaved();
    match (req.interrupt(), interleave) {
        (Some(f), false) => coord.open_window_interruptible(f),
        (Some(f), true) => coord.open_window_interleaved_interruptible(f),
        #[cfg(any(loom, shuttle))]
        (None, false) => coord.open_window_noting(|| req.note()),
        #[cfg(any(loom, shuttle))]
        (None, true) => coord.open_window_interleaved_noting(|| req.note()),
        #[cfg(not(any(loom, shuttle)))]
        (None, false) => coord.open_window(),
        #[cfg(not(any(loom, shuttle)))]
        (None, true) => coord.open_window_interleaved(),
    }
}

// A request carries an at-request note only in model builds, where the
// arms above run it under the coordinator's lock; this names it in the
// other builds too, so that they do not flag it unused (until the
// coordinator takes requests itself and runs the note there).
#[cfg(not(any(loom, shuttle)))]
const _: fn(&Request<'static>) = Request::note;

/// Runs `f`, a capture-unsafe call, once no window holds it back,
/// interruptibly while it waits to start when the request has a check.
pub(super) fn unsafe_call<T>(
    coord: &Coordinator,
    what: &'static str,
    req: Request<'_>,
    f: impl FnOnce(&Gate) -> T,
) -> Result<T, ProtocolError> {
    match req.interrupt() {
        None => coord.unsafe_call(what, f),
        Some(i) => coord.unsafe_call_interruptible(what, i, f),
    }
}

/// Waits until pinning is final, interruptibly when the request has a
/// check.
pub(super) fn wait_pin_final(coord: &Coordinator, req: Request<'_>) -> Result<PinState, ProtocolError> {
    match req.interrupt() {
        None => coord.wait_pin_final(),
        Some(f) => coord.wait_pin_final_interruptible(f),
    }
}

/// Waits until no window is open or waiting to open, interruptibly when
/// the request has a check.
pub(super) fn wait_no_window(coord: &Coordinator, req: Request<'_>) -> Result<(), ProtocolError> {
    match req.interrupt() {
        None => coord.wait_no_window(),
        Some(f) => coord.wait_no_window_interruptible(f),
    }
}
