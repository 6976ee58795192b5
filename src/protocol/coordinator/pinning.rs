//! Pinning as the coordinator sees it: the pinner's calls (begin, register
//! and unregister chunks, finish), the engine's (cancel, hold, wait for the
//! final state) and the read-only views of the chunks, all on one
//! [`Pinning`] view of a coordinator ([`Coordinator::pinning`]).
//!
//! Rules (module docs of `coordinator` give the whole set):
//!
//! - A chunk's registration and unregistration are capture-unsafe calls
//!   under the gate (P1), recorded in the critical section that ends them
//!   (P2: a window counts the registrations it waited for).
//! - Unregistering a chunk first refuses new gather users, then waits for
//!   the current ones (P3); a failed unregistration leaves the chunk
//!   refused to users and a retry unregisters it.
//! - While a pin hold lives no registration starts; a registration held
//!   back waits uncounted (it takes no window's turn), and a cancel of
//!   pinning releases it without starting it (P2, model/p2_pin_hold.rs).
//! - Waiting for pinning inside one's own window, or while one's own pin
//!   hold lives, is a typed error, not a deadlock (P6); an interrupted
//!   wait is uncounted again (P6).

use super::{Coordinator, PinState, ProtocolError, Request, Shared, State};
use crate::rules::Rules;
use crate::runtime::{DevicePtr, DriverError, Gate, GpuRuntime};
use crate::sync::{self, thread, Arc};

/// Registration state of one chunk of the region.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ChunkReg {
    /// Not registered with the driver (before pinning registers it, or
    /// after a rollback or shutdown unregistered it): its memory is pageable
    /// and the gather kernel gets no alias for it (P3).
    Unregistered,
    /// Registered with the driver; the gather kernel may get its alias
    /// through [`Coordinator::acquire_alias`].
    Registered {
        /// The device's alias of the chunk's first byte
        /// (`cuMemHostGetDevicePointer`, see
        /// [`GpuRuntime::host_device_ptr`]); byte `k` of the chunk is at
        /// `alias + k` on the device.
        alias: DevicePtr,
    },
    /// Being unregistered: no new users; unregistering waits for the
    /// current ones to drop their [`AliasGuard`](super::AliasGuard)s (P3). A chunk whose
    /// unregister call failed stays here (still registered in the driver,
    /// refused to new users) until a retry succeeds.
    Unregistering,
}

#[derive(Debug)]
pub(super) struct Chunk {
    pub(super) addr: usize,
    pub(super) len: usize,
    pub(super) reg: ChunkReg,
    /// Gather launches between their registration check and their enqueue.
    pub(super) users: usize,
}

/// A pin hold ([`Pinning::hold`]): no chunk registration starts
/// while it lives. Dropping it (on any thread) lets pinning go on.
#[must_use = "pinning resumes as soon as the hold is dropped"]
pub struct PinHold {
    shared: Arc<Shared>,
    owner: thread::ThreadId,
}

impl Drop for PinHold {
    fn drop(&mut self) {
        let owner = self.owner;
        self.shared.release(|g| {
            if let Some(i) = g.pin_holds.iter().position(|t| *t == owner) {
                g.pin_holds.swap_remove(i);
            }
        });
        tracing::debug!("pin hold released");
    }
}

impl std::fmt::Debug for PinHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinHold").finish_non_exhaustive()
    }
}

/// Pinning of a coordinator's chunks ([`Coordinator::pinning`]): a thin
/// view (a borrow of the coordinator; every call takes its one lock) that
/// groups the pinner's calls, the engine's and the read-only views.
#[derive(Clone, Copy)]
pub struct Pinning<'a> {
    coord: &'a Coordinator,
}

impl std::fmt::Debug for Pinning<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pinning").field("state", &self.state()).finish_non_exhaustive()
    }
}

impl Coordinator {
    /// Pinning of this coordinator's chunks: begin, register, unregister
    /// and finish (the pinner), cancel, hold and wait (the engine), and the
    /// chunks' state.
    pub fn pinning(&self) -> Pinning<'_> {
        Pinning { coord: self }
    }
}

impl Pinning<'_> {
    // ---- views ----

    /// Pin state right now.
    pub fn state(&self) -> PinState {
        self.coord.lock().pin.clone()
    }

    /// The pinning state and the chunks registered, read at one moment (a
    /// progress report whose count agrees with its state).
    pub fn snapshot(&self) -> (PinState, usize) {
        let g = self.coord.lock();
        (g.pin.clone(), registered(&g))
    }

    /// Number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.coord.lock().chunks.len()
    }

    /// Address and length of chunk `i`.
    pub fn chunk_range(&self, i: usize) -> (usize, usize) {
        let g = self.coord.lock();
        (g.chunks[i].addr, g.chunks[i].len)
    }

    /// Registration state of chunk `i`.
    pub fn chunk_reg(&self, i: usize) -> Option<ChunkReg> {
        self.coord.lock().chunks.get(i).map(|c| c.reg)
    }

    /// Chunks registered right now.
    pub fn registered_chunks(&self) -> usize {
        registered(&self.coord.lock())
    }

    // ---- the pinner ----

    /// Pinning starts; returns false if it was cancelled before starting.
    pub fn begin(&self) -> bool {
        let mut g = self.coord.lock();
        if g.cancel_pin || g.pin != PinState::Pending {
            return false;
        }
        g.pin = PinState::Pinning { done: 0, total: g.chunks.len() };
        self.coord.shared.cv.notify_all();
        true
    }

    /// True once a cancel (or shutdown) asked pinning to stop.
    pub fn cancelled(&self) -> bool {
        self.coord.lock().cancel_pin
    }

    /// Registers chunk `i` (and looks up its device alias) as a
    /// capture-unsafe call, once no pin hold lives ([`Pinning::hold`]); a
    /// registration held back and then released by a cancel of pinning is
    /// [`ProtocolError::Interrupted`] (never started).
    pub fn register_chunk(&self, rt: &dyn GpuRuntime, i: usize) -> Result<Result<(), DriverError>, ProtocolError> {
        let coord = self.coord;
        let (addr, len) = self.chunk_range(i);
        let register = |gate: &Gate| {
            // SAFETY: chunks are live mappings that stay mapped while they
            // may be registered (the contract of `Coordinator::new`).
            unsafe { rt.host_register(gate, addr, len) }?;
            match rt.host_device_ptr(addr) {
                Ok(alias) => Ok(alias),
                Err(e) => {
                    // Keep all-or-nothing per chunk: undo this registration.
                    if let Err(u) = rt.host_unregister(gate, addr) {
                        tracing::warn!(error = %u, "unregister after a failed alias lookup failed too");
                    }
                    Err(e)
                }
            }
        };
        let record = |g: &mut State, r: &Result<DevicePtr, DriverError>| {
            if let Ok(alias) = r {
                g.chunks[i].reg = ChunkReg::Registered { alias: *alias };
                g.chunks_completed += 1;
                if let PinState::Pinning { done, .. } = &mut g.pin {
                    *done += 1;
                }
            }
        };
        let what = "registering a chunk";
        let mut g = coord.lock();
        if !g.outside_own_window(sync::this_thread()) {
            return Err(ProtocolError::WouldDeadlock { what });
        }
        // As `unsafe_call_then`, but while pinning is held the call waits
        // uncounted: counted, it could take the turn from a window that
        // waits while the hold keeps it from starting.
        loop {
            let mut held = false;
            while g.pin_held() {
                held = true;
                g.registrations_held += 1;
                g = coord.wait(g);
                g.registrations_held -= 1;
            }
            // Held back, then released by a cancel: the registration never
            // starts (the pinner rolls back), rather than register a chunk
            // a shutdown is about to unregister.
            if held && g.cancel_pin {
                return Err(ProtocolError::Interrupted { what });
            }
            if g.unsafe_may_start() {
                break;
            }
            g.unsafe_waiting += 1;
            g = coord.wait(g);
            g.unsafe_waiting -= 1;
        }
        Ok(coord.counted(g, register, record).map(|_| ()))
    }

    /// Unregisters chunk `i`: no new gather users from now on, waits for
    /// the current ones, then unregisters as a capture-unsafe call.
    pub fn unregister_chunk(&self, rt: &dyn GpuRuntime, i: usize) -> Result<Result<(), DriverError>, ProtocolError> {
        let coord = self.coord;
        let addr = {
            let mut g = coord.lock();
            if g.chunks[i].reg == ChunkReg::Unregistered {
                return Ok(Ok(()));
            }
            g.chunks[i].reg = ChunkReg::Unregistering;
            g.unregisters_waiting += 1;
            while g.chunks[i].users > 0 {
                g = coord.wait(g);
            }
            g.unregisters_waiting -= 1;
            g.chunks[i].addr
        };
        // On failure the chunk stays Unregistering: still registered in the
        // driver, refused to gather users, and a retry unregisters it.
        let record = |g: &mut State, r: &Result<(), DriverError>| {
            if r.is_ok() {
                g.chunks[i].reg = ChunkReg::Unregistered;
            }
        };
        coord.unsafe_call_then("unregistering a chunk", |gate| rt.host_unregister(gate, addr), record)
    }

    /// Unregisters every registered chunk, last first (rollback and
    /// shutdown). Returns the first driver error, after trying them all.
    pub fn unregister_all(&self, rt: &dyn GpuRuntime) -> Result<(), DriverError> {
        let n = self.chunk_count();
        let mut first = None;
        for i in (0..n).rev() {
            match self.unregister_chunk(rt, i) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first.get_or_insert(e);
                }
                Err(p) => {
                    // Only reachable when called from inside a window.
                    tracing::error!(error = %p, "unregister_all refused");
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Pinning reached its final state.
    pub fn finish(&self, state: PinState) {
        debug_assert!(state.is_final());
        tracing::info!(?state, "pinning finished");
        self.coord.shared.update(|g| g.pin = state);
    }

    // ---- the engine ----

    /// Asks pinning to stop at the next chunk boundary and roll back.
    pub fn cancel(&self) {
        self.coord.shared.update(|g| g.cancel_pin = true);
    }

    /// Holds pinning back until the guard drops: no chunk registration
    /// starts meanwhile (one in flight completes), so an engine's capture
    /// phase (vLLM captures 50-200 graphs back to back) meets no
    /// registration: each capture window would otherwise wait for the
    /// registration in flight, and the kernel's work of pinning competes
    /// with the captures (graph capture 8-15 s instead of 4-5 s with a
    /// 64 GiB region, issue 42). Holds nest (pinning resumes when the last
    /// drops) and may be dropped on any thread. Cancelling pinning (a
    /// shutdown) ends the hold's effect at once; the thread that holds
    /// pinning back is refused a wait for pinning
    /// ([`ProtocolError::WouldDeadlock`]).
    pub fn hold(&self) -> PinHold {
        let me = sync::this_thread();
        self.coord.shared.update(|g| g.pin_holds.push(me));
        tracing::debug!("pinning held back");
        PinHold { shared: self.coord.shared.clone(), owner: me }
    }

    /// Blocks until pinning is final. Inside one's own window with the
    /// Interleave policy that would never return, and neither would it
    /// while this thread holds pinning back: typed errors instead
    /// ([`ProtocolError::WouldDeadlock`]).
    ///
    /// With an interruptible `req` it calls the check at least every 50 ms
    /// while it waits (with the lock released) and, when it says so, stops
    /// counting itself as a pin waiter
    /// ([`Activity::pin_waiters`](super::Activity::pin_waiters) as before
    /// the call) and returns [`ProtocolError::Interrupted`]. Pinning goes on
    /// (this only waits for it).
    pub fn wait_final(&self, req: Request<'_>) -> Result<PinState, ProtocolError> {
        let coord = self.coord;
        let mut g = coord.lock();
        if g.rules.refuses_pin_wait_in_own_window(|| g.owns_window(sync::this_thread()) && !g.pin.is_final()) {
            return Err(ProtocolError::WouldDeadlock { what: "waiting for pinning" });
        }
        if g.pin_holds.contains(&sync::this_thread()) && !g.pin.is_final() {
            return Err(ProtocolError::WouldDeadlock { what: "waiting for pinning while this thread holds it back" });
        }
        g.pin_waiters += 1;
        match req.interrupt() {
            None => {
                while !g.pin.is_final() {
                    g = coord.wait(g);
                }
                g.pin_waiters -= 1;
            }
            Some(f) => {
                let (g2, stopped) = coord.wait_while_interruptible(g, |s| !s.pin.is_final(), f);
                g = g2;
                g.pin_waiters -= 1;
                if stopped {
                    coord.shared.cv.notify_all();
                    return Err(ProtocolError::Interrupted { what: "pinning" });
                }
            }
        }
        Ok(g.pin.clone())
    }
}

/// Chunks registered in `g`.
fn registered(g: &State) -> usize {
    g.chunks.iter().filter(|c| matches!(c.reg, ChunkReg::Registered { .. })).count()
}
