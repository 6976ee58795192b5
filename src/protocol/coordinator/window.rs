//! Capture windows (the engine's) and the graphs captured in them.
//!
//! Rules (module docs of `coordinator` give the whole set):
//!
//! - A window opens only while no capture-unsafe library call is in flight,
//!   and, when library calls wait too, only on its turn (P1; P2: a window
//!   waits for at most one chunk's registration).
//! - With [`CapturePolicy::AfterPinning`](super::CapturePolicy) a window
//!   opens only once pinning is final, unless its request is
//!   [`Request::interleaved`] (P2, and P2 for the capture hook).
//! - A window counts the registrations completed while it waited
//!   ([`CaptureWindow::chunks_waited`], P2); a window request is counted
//!   under the lock, where a model build's [`Request`] hook reads the
//!   simulated driver.
//! - Closing a window hands the turn to library calls (P6: back-to-back
//!   windows do not starve pinning); a window request withdrawn by its
//!   interrupt check wakes the calls it held back (P6).
//! - No window opens, and no graph is registered, once shutdown began; a
//!   thread asking for a second window of its own, or waiting for windows
//!   to close inside its own, gets a typed error (P4, P6).

use super::{Coordinator, Phase, ProtocolError, Request, Shared, State, Turn};
use crate::rules::Rules;
use crate::sync::{self, thread, Arc};

/// An open capture window. The engine captures its graphs while holding
/// one; dropping it closes the window.
#[must_use = "the window closes when this guard is dropped"]
pub struct CaptureWindow {
    coord: Arc<Shared>,
    owner: thread::ThreadId,
    chunks_waited: usize,
}

impl CaptureWindow {
    /// Chunk registrations that completed while this window waited to open
    /// (P2: at most one with the Interleave policy).
    pub fn chunks_waited(&self) -> usize {
        self.chunks_waited
    }
}

impl Drop for CaptureWindow {
    fn drop(&mut self) {
        self.coord.release(|g| {
            g.windows_open -= 1;
            let rules = g.rules;
            rules.closing_window_hands_turn(|| g.turn = Turn::Library);
            if let Some(i) = g.window_owners.iter().position(|t| *t == self.owner) {
                g.window_owners.swap_remove(i);
            }
            tracing::debug!(open = g.windows_open, "capture window closed");
        });
    }
}

/// A graph the engine captured that references the region. Shutdown is
/// refused while one exists; drop it after destroying the graph.
#[must_use]
pub struct GraphToken {
    coord: Arc<Shared>,
}

impl Drop for GraphToken {
    fn drop(&mut self) {
        self.coord.release(|g| g.graphs_live -= 1);
    }
}

impl Coordinator {
    /// Opens a capture window, waiting until the policy allows it and no
    /// capture-unsafe library call is in flight. `req` says how:
    ///
    /// - [`Request::interleaved`]: under the Interleave rules whatever the
    ///   coordinator's policy: it waits only for the capture-unsafe call in
    ///   flight (a chunk's registration, at most one: windows and library
    ///   calls take turns), never for pinning to be final. The capture hook
    ///   (`CaptureHook::begin`) opens its windows so, since a framework
    ///   capture it wraps cannot be told to wait for the whole region.
    /// - [`Request::interruptible`]: calls its check at least every 50 ms
    ///   while it waits (with the lock released, see the module docs) and,
    ///   when it returns true, withdraws the request and returns
    ///   [`ProtocolError::Interrupted`]. A withdrawn request leaves no
    ///   trace: it never opened, it is no longer counted as waiting
    ///   ([`Activity::windows_waiting`](super::Activity::windows_waiting) as
    ///   before the call), and the library calls it held back are woken.
    /// - `Request::noting` (model builds): its hook runs under the
    ///   coordinator's lock at the moment the window asks to open (P2's
    ///   models read the simulated GPU's registration count there, so the
    ///   chunks a window waited for are counted by the driver, not by the
    ///   coordinator).
    ///
    /// Refused with [`ProtocolError::ShutDown`] once shutdown began and
    /// [`ProtocolError::NestedWindow`] inside the caller's own window.
    pub fn open_window(&self, req: Request<'_>) -> Result<CaptureWindow, ProtocolError> {
        let interleave = req.is_interleaved();
        let me = sync::this_thread();
        let mut g = self.lock();
        if g.phase != Phase::Running {
            return Err(ProtocolError::ShutDown);
        }
        if g.owns_window(me) {
            return Err(ProtocolError::NestedWindow);
        }
        g.windows_waiting += 1;
        g.window_requests += 1;
        g.interleave_waiting += usize::from(interleave);
        req.note();
        let completed_at_request = g.chunks_completed;
        self.shared.cv.notify_all();
        let blocked = |s: &State| !s.window_may_open(interleave) && s.phase == Phase::Running;
        let stopped = match req.interrupt() {
            None => {
                while blocked(&g) {
                    g = self.wait(g);
                }
                false
            }
            Some(f) => {
                let (g2, stopped) = self.wait_while_interruptible(g, blocked, f);
                g = g2;
                stopped
            }
        };
        g.windows_waiting -= 1;
        g.interleave_waiting -= usize::from(interleave);
        if stopped {
            // Withdrawn: library calls that deferred to this request may
            // start now.
            self.shared.cv.notify_all();
            tracing::debug!(pin = ?g.pin, "capture window request interrupted before it opened");
            return Err(ProtocolError::Interrupted { what: "a capture window" });
        }
        if g.phase != Phase::Running {
            self.shared.cv.notify_all();
            return Err(ProtocolError::ShutDown);
        }
        g.windows_open += 1;
        g.window_owners.push(me);
        tracing::debug!(open = g.windows_open, pin = ?g.pin, "capture window opened");
        let chunks_waited = g.chunks_completed - completed_at_request;
        Ok(CaptureWindow { coord: self.shared.clone(), owner: me, chunks_waited })
    }

    /// Window requests made so far (a count that only grows), for
    /// [`Coordinator::wait_no_window`]'s `since`: read it before deciding
    /// to wait, under whatever lock orders the requests the caller cares
    /// about (the capture hook reads it under its own lock, which a hook
    /// window's begin takes before it asks to open).
    pub fn window_requests(&self) -> u64 {
        self.lock().window_requests
    }

    /// Blocks until no window is open or waiting to open (for a poller that
    /// got `WindowBusy` and has nothing else to do): `Ok(true)` then.
    ///
    /// With `since` (a [`Coordinator::window_requests`] reading) it ends
    /// also once a window has been requested after that reading:
    /// `Ok(false)` when a request came first (the caller looks again at why
    /// it waited). For the capture hook's flush, which waits for an
    /// engine's window but must not wait for a hook window that begins
    /// meanwhile (that window's close takes the rest of the queue over).
    /// With `None` it returns only `Ok(true)` (or an error).
    ///
    /// With an interruptible `req` it calls the check at least every 50 ms
    /// while it waits (with the lock released) and returns
    /// [`ProtocolError::Interrupted`] when it says so (this wait keeps no
    /// count, so nothing is undone). Refused with
    /// [`ProtocolError::WouldDeadlock`] inside the caller's own window.
    pub fn wait_no_window(&self, req: Request<'_>, since: Option<u64>) -> Result<bool, ProtocolError> {
        let mut g = self.lock();
        if g.owns_window(sync::this_thread()) {
            return Err(ProtocolError::WouldDeadlock { what: "waiting for a transfer" });
        }
        let blocked = |s: &State| !s.unsafe_may_start() && since.is_none_or(|n| s.window_requests == n);
        match req.interrupt() {
            None => {
                while blocked(&g) {
                    g = self.wait(g);
                }
            }
            Some(f) => {
                let (g2, stopped) = self.wait_while_interruptible(g, blocked, f);
                if stopped {
                    return Err(ProtocolError::Interrupted { what: "capture windows to close" });
                }
                g = g2;
            }
        }
        Ok(g.unsafe_may_start())
    }

    /// Records that a graph referencing the region exists.
    pub fn register_graph(&self) -> Result<GraphToken, ProtocolError> {
        let mut g = self.lock();
        if g.phase != Phase::Running {
            return Err(ProtocolError::ShutDown);
        }
        g.graphs_live += 1;
        Ok(GraphToken { coord: self.shared.clone() })
    }
}
