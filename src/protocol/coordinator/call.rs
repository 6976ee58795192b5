//! Capture-unsafe library calls (the pinner's registrations, the transfer
//! engine's event queries and submissions), job admission and the gather
//! kernel's device aliases.
//!
//! Rules (module docs of `coordinator` give the whole set):
//!
//! - A capture-unsafe call runs only inside the gate: it starts only while
//!   no window is open, and, when windows wait too, only on its turn; it is
//!   counted in flight until it returns, so no window opens meanwhile (P1).
//!   The [`Gate`] it gets is made here and nowhere else.
//! - A call's outcome is recorded in the critical section that ends it
//!   (`unsafe_call_then`), so a window that waited for a registration sees
//!   it counted (P2).
//! - A call ends on unwinding too: a panic under the gate drops its count
//!   and hands the turn to windows (P6, N37).
//! - A call inside the caller's own window is a typed error, not a
//!   deadlock (P6); an interrupted wait to start leaves no trace (P6).
//! - Jobs are admitted only before shutdown, and shutdown drains every
//!   admitted job's ticket (P4); the transfer engine submits inside the
//!   gate, so a capture cannot begin between its check of the compute
//!   stream and the event it records there (P1, N9).
//! - The gather kernel gets a chunk's alias only while the chunk is
//!   registered; unregistering waits for the aliases handed out (P3).

use super::{ChunkReg, Coordinator, Phase, ProtocolError, Request, Shared, State, Turn, SEAL};
use crate::rules::Rules;
use crate::runtime::{DevicePtr, Gate};
use crate::sync::{self, Arc, MutexGuard};

/// A capture-unsafe call in flight (`Coordinator::counted`), ended on
/// unwinding: the count drops and windows get their turn.
struct InFlight<'a> {
    shared: &'a Shared,
    armed: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.release(|g| {
                g.unsafe_in_flight -= 1;
                g.turn = Turn::Window;
            });
        }
    }
}

/// A job admitted before shutdown; shutdown waits until every ticket is
/// dropped (the job completed or failed).
#[must_use]
pub struct JobTicket {
    coord: Arc<Shared>,
}

impl Drop for JobTicket {
    fn drop(&mut self) {
        self.coord.release(|g| g.jobs_in_flight -= 1);
    }
}

/// The device alias of registered host memory, valid while held: the chunk
/// cannot start unregistering until the guard is dropped (after the kernel
/// that uses it was enqueued; the driver's unregister then waits for it).
pub struct AliasGuard {
    coord: Arc<Shared>,
    chunk: usize,
    /// Device address of the requested host address.
    pub device: DevicePtr,
}

impl Drop for AliasGuard {
    fn drop(&mut self) {
        self.coord.release(|g| {
            if let Some(c) = g.chunks.get_mut(self.chunk) {
                c.users -= 1;
            }
        });
    }
}

impl Coordinator {
    /// Runs `f`, a capture-unsafe driver call, at a moment no capture window
    /// is open; windows wait for it to return. `f` gets the [`Gate`] that
    /// capture-unsafe operations of the runtime require: this (and
    /// [`Coordinator::try_unsafe_call`]) is the only place one is made.
    ///
    /// With an interruptible `req` ([`Request::interruptible`]), while it
    /// waits to start (a window open, or one whose turn it is) it calls the
    /// check at least every 50 ms with the lock released and, when that
    /// returns true, withdraws (no longer counted as waiting, the windows it
    /// held back woken) and returns [`ProtocolError::Interrupted`]; `f` has
    /// not run. Once `f` runs it is not interrupted (it is the caller's).
    /// The request's other settings do not apply to a call.
    ///
    /// Refused with [`ProtocolError::WouldDeadlock`] inside the caller's own
    /// window (it would wait for itself).
    pub fn unsafe_call<T>(
        &self,
        what: &'static str,
        req: Request<'_>,
        f: impl FnOnce(&Gate) -> T,
    ) -> Result<T, ProtocolError> {
        let Some(interrupted) = req.interrupt() else {
            return self.unsafe_call_then(what, f, |_, _| {});
        };
        let mut g = self.lock();
        if !g.outside_own_window(sync::this_thread()) {
            return Err(ProtocolError::WouldDeadlock { what });
        }
        g.unsafe_waiting += 1;
        let (g2, stopped) = self.wait_while_interruptible(g, |s| !s.unsafe_may_start(), interrupted);
        g = g2;
        g.unsafe_waiting -= 1;
        if stopped {
            // Windows that gave this call its turn may open now.
            self.shared.cv.notify_all();
            return Err(ProtocolError::Interrupted { what });
        }
        Ok(self.counted(g, f, |_, _| {}))
    }

    /// A blocking [`Coordinator::unsafe_call`], then `record` of its
    /// outcome under the lock, in the same critical section that ends the
    /// call: no window opens between the driver call and its record (a
    /// window that waited for a registration sees it counted).
    pub(super) fn unsafe_call_then<T>(
        &self,
        what: &'static str,
        f: impl FnOnce(&Gate) -> T,
        record: impl FnOnce(&mut State, &T),
    ) -> Result<T, ProtocolError> {
        let mut g = self.lock();
        if !g.outside_own_window(sync::this_thread()) {
            return Err(ProtocolError::WouldDeadlock { what });
        }
        g.unsafe_waiting += 1;
        while !g.unsafe_may_start() {
            g = self.wait(g);
        }
        g.unsafe_waiting -= 1;
        Ok(self.counted(g, f, record))
    }

    /// Runs `f` outside the lock, counted as a capture-unsafe call in
    /// flight; `record` gets its outcome under the lock as the call ends.
    pub(super) fn counted<T>(
        &self,
        mut g: MutexGuard<'_, State>,
        f: impl FnOnce(&Gate) -> T,
        record: impl FnOnce(&mut State, &T),
    ) -> T {
        g.unsafe_in_flight += 1;
        let rules = g.rules;
        drop(g);
        // Should `f` unwind (a panic in an engine's callable run under the
        // gate), the call still ends: the count drops and a waiting window
        // gets its turn (P6), instead of every later window waiting for
        // ever on a call that is gone.
        let mut in_flight = InFlight { shared: &self.shared, armed: false };
        rules.unwinding_call_ends(|| in_flight.armed = true);
        // The one place a gate is made: `unsafe_in_flight` counts this call,
        // so no window opens until it returns (P1).
        let gate = Gate::minted(&SEAL, self.shared.id);
        let out = f(&gate);
        drop(gate);
        in_flight.armed = false;
        self.shared.release(|g| {
            record(g, &out);
            g.unsafe_in_flight -= 1;
            g.turn = Turn::Window;
        });
        out
    }

    /// Like [`Coordinator::unsafe_call`] but never waits: `WindowBusy` when
    /// a window is open or about to open (the poller tries again later).
    pub fn try_unsafe_call<T>(&self, f: impl FnOnce(&Gate) -> T) -> Result<T, ProtocolError> {
        let g = self.lock();
        if g.rules.poller_respects_gate(|| g.owns_window(sync::this_thread()) || !g.unsafe_may_start()) {
            return Err(ProtocolError::WindowBusy);
        }
        Ok(self.counted(g, f, |_, _| {}))
    }

    /// Admits a transfer job, unless shutdown has begun.
    pub fn admit_job(&self) -> Result<JobTicket, ProtocolError> {
        let mut g = self.lock();
        if g.phase != Phase::Running {
            return Err(ProtocolError::ShutDown);
        }
        g.jobs_in_flight += 1;
        Ok(JobTicket { coord: self.shared.clone() })
    }

    /// Admits a transfer job and runs `f` with its ticket inside the gate:
    /// at a moment no capture window is open, with none opening until `f`
    /// returns (counted like a capture-unsafe call in flight). Never waits:
    /// [`ProtocolError::ShutDown`] once shutdown has begun,
    /// [`ProtocolError::WindowBusy`] while a window is open or about to open
    /// (or the caller holds one). The transfer engine submits its jobs
    /// through it, so that a capture of the compute stream, which begins
    /// only inside a window, cannot begin between its check of that stream
    /// and the event it records there (`TransferEngine::submit`).
    pub fn admit_job_outside_windows<T>(&self, f: impl FnOnce(&Gate, JobTicket) -> T) -> Result<T, ProtocolError> {
        let mut g = self.lock();
        if g.phase != Phase::Running {
            return Err(ProtocolError::ShutDown);
        }
        if !g.outside_own_window(sync::this_thread()) || !g.unsafe_may_start() {
            return Err(ProtocolError::WindowBusy);
        }
        g.jobs_in_flight += 1;
        let ticket = JobTicket { coord: self.shared.clone() };
        Ok(self.counted(g, |gate| f(gate, ticket), |_, _| {}))
    }

    /// The device alias of `[addr, addr+len)` if it lies in one registered
    /// chunk; the chunk stays registered while the guard lives.
    pub fn acquire_alias(&self, addr: usize, len: usize) -> Option<AliasGuard> {
        let mut g = self.lock();
        let rules = g.rules;
        let i = g.chunks.iter().position(|c| addr >= c.addr && addr + len <= c.addr + c.len)?;
        let c = &mut g.chunks[i];
        let alias = match c.reg {
            ChunkReg::Registered { alias } => Some(alias),
            _ => None,
        };
        let host = c.addr;
        let base = rules.alias_needs_registration(alias, || DevicePtr(host as u64 | (1 << 62)))?;
        c.users += 1;
        let device = base.offset(addr - c.addr);
        Some(AliasGuard { coord: self.shared.clone(), chunk: i, device })
    }
}
