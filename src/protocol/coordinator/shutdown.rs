//! The coordinator's steps of the shutdown order (P4; the whole order,
//! unregistration included, is `protocol::shutdown`), on one
//! [`ShutdownSteps`] view of a coordinator ([`Coordinator::shutdown_steps`]).
//!
//! Rules (module docs of `coordinator` give the whole set):
//!
//! - Shutdown is refused, with nothing changed, while a window is open or a
//!   registered graph lives, and when asked for twice; the checks and the
//!   change are one critical section, and from then on windows, graphs and
//!   jobs are refused, so none appears after the check (P4).
//! - Pinning is asked to stop only once shutdown is accepted (a refused
//!   shutdown leaves pinning alone, N25).
//! - The drain waits for every admitted job's ticket and for pinning to be
//!   final before anything is unregistered (P4, N2, N10).

use super::{Coordinator, Phase, PinState, ProtocolError};
use crate::protocol::PageableReason;
use crate::rules::Rules;

/// The shutdown order's steps on a coordinator
/// ([`Coordinator::shutdown_steps`]): a thin view (a borrow of the
/// coordinator; every call takes its one lock).
#[derive(Clone, Copy)]
pub struct ShutdownSteps<'a> {
    coord: &'a Coordinator,
}

impl std::fmt::Debug for ShutdownSteps<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShutdownSteps").field("started", &self.started()).finish_non_exhaustive()
    }
}

impl Coordinator {
    /// The steps of the shutdown order on this coordinator: close to new
    /// work, drain, or both at once. [`crate::protocol::shutdown`] runs the
    /// whole order.
    pub fn shutdown_steps(&self) -> ShutdownSteps<'_> {
        ShutdownSteps { coord: self }
    }
}

impl ShutdownSteps<'_> {
    /// First half of shutdown ([`ShutdownSteps::close`], then
    /// [`ShutdownSteps::drain`]): refuses (typed, nothing changed) while a
    /// window is open or registered graphs live; otherwise refuses all new
    /// work, asks pinning to stop, and waits for in-flight jobs and for
    /// pinning to settle. Afterwards the caller unregisters every chunk
    /// ([`Pinning::unregister_all`](super::Pinning::unregister_all)),
    /// unmaps and unlinks.
    pub fn begin(&self) -> Result<(), ProtocolError> {
        self.close()?;
        self.drain();
        Ok(())
    }

    /// Starts shutdown, or refuses it with nothing changed: in one critical
    /// section it checks that shutdown was not asked for before
    /// ([`ProtocolError::AlreadyShutDown`]), that no window is open
    /// ([`ProtocolError::WindowOpen`]) and no registered graph lives
    /// ([`ProtocolError::GraphsAlive`]), and only then refuses new windows,
    /// jobs and graphs and asks pinning to stop. No window or graph can
    /// appear after the check, since both are refused from then on (P4).
    pub fn close(&self) -> Result<(), ProtocolError> {
        let coord = self.coord;
        let mut g = coord.lock();
        match g.phase {
            Phase::Running => {}
            _ => return Err(ProtocolError::AlreadyShutDown),
        }
        let rules = g.rules;
        rules.refusal_changes_nothing(|| g.cancel_pin = true);
        if g.windows_open > 0 {
            return Err(ProtocolError::WindowOpen { open: g.windows_open });
        }
        if rules.shutdown_refuses_live_graphs(|| g.graphs_live > 0) {
            return Err(ProtocolError::GraphsAlive { live: g.graphs_live });
        }
        g.phase = Phase::ShuttingDown;
        g.cancel_pin = true;
        if g.pin == PinState::Pending {
            g.pin = PinState::Pageable(PageableReason::Cancelled);
        }
        coord.shared.cv.notify_all();
        tracing::info!(jobs = g.jobs_in_flight, pin = ?g.pin, "shutdown: closed to new work");
        Ok(())
    }

    /// After [`ShutdownSteps::close`]: waits until every admitted job's
    /// ticket is gone and pinning is final.
    pub fn drain(&self) {
        let coord = self.coord;
        let mut g = coord.lock();
        debug_assert!(g.phase != Phase::Running, "drain before close");
        tracing::info!(jobs = g.jobs_in_flight, pin = ?g.pin, "shutdown: draining");
        let rules = g.rules;
        g = rules.drain_waits_for_jobs(g, |mut g| {
            while g.jobs_in_flight > 0 {
                g = coord.wait(g);
            }
            g
        });
        drop(rules.drain_waits_for_pinning(g, |mut g| {
            while !g.pin.is_final() {
                g = coord.wait(g);
            }
            g
        }));
    }

    /// True once shutdown began.
    pub fn started(&self) -> bool {
        self.coord.lock().phase != Phase::Running
    }
}
