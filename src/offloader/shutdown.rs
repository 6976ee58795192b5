//! [`Offloader::shutdown`] in the protocol's order, and the drop that runs
//! it.

use super::{Completion, Offloader, OffloaderError, Pinner};
use crate::protocol::{finish_shutdown, ProtocolError, Request};
use crate::rules::Rules;
use crate::runtime::Direction;
use crate::sync;
use crate::sync::atomic::Ordering;

impl Offloader {
    /// Shuts down in the protocol's order: refused (typed, nothing changed)
    /// while a capture window is open or registered graphs live; otherwise
    /// refuses new jobs, waits for the jobs in flight and applies them to
    /// the manager, stops pinning at a chunk boundary, unregisters the
    /// region, and frees what the offloader allocated. A second call is
    /// refused with [`ProtocolError::AlreadyShutDown`]. The region is
    /// unmapped (and a shared file's name is long gone) when the offloader
    /// is dropped.
    ///
    /// With a blocking request, `sink` is not called: the drain's
    /// completions are applied to the manager and not reported.
    ///
    /// With an interruptible request ([`Request::interruptible`]) it first
    /// waits, interruptibly, for the jobs in flight (as
    /// [`Offloader::wait_all`], handing what it takes to `sink`);
    /// interrupted there, it returns [`ProtocolError::Interrupted`] with
    /// nothing changed (the offloader still runs, its jobs go on). Then it
    /// shuts down as with a blocking request, whose drain then waits at
    /// most for jobs submitted meanwhile by other threads. Not interrupted
    /// after that point: the rest (stopping the pinner at a chunk boundary,
    /// unregistering, freeing) is bounded by a chunk's registration and the
    /// driver calls.
    pub fn shutdown(&self, req: Request<'_>, sink: &mut dyn FnMut(Completion)) -> Result<(), OffloaderError> {
        if req.interrupt().is_some() {
            self.drain_first(req, sink)?;
        }
        self.shut_down_now()
    }

    /// The interruptible shutdown's first step: the jobs in flight waited
    /// for, interruptibly, their completions handed to `sink`.
    fn drain_first(&self, req: Request<'_>, sink: &mut dyn FnMut(Completion)) -> Result<(), OffloaderError> {
        self.refuse_inside_gated("shutting down inside gated()")?;
        if self.is_shut_down() {
            return Err(ProtocolError::AlreadyShutDown.into());
        }
        // Refused at once, as the blocking form refuses, when a window is
        // open or a registered graph lives: the drain below would wait for
        // that window first. (One that opens after this check is refused
        // by the shutdown after the drain, as before.)
        let a = self.coord.activity();
        if a.windows_open > 0 {
            return Err(ProtocolError::WindowOpen { open: a.windows_open }.into());
        }
        if a.graphs_live > 0 {
            return Err(ProtocolError::GraphsAlive { live: a.graphs_live }.into());
        }
        // Any other outcome (a window of this thread's, shut down
        // meanwhile) is for the shutdown itself to refuse or report.
        match self.wait_all(req, sink) {
            Err(e @ OffloaderError::Protocol(ProtocolError::Interrupted { .. })) => Err(e),
            _ => Ok(()),
        }
    }

    /// The shutdown itself (a blocking request's; also the drop's).
    fn shut_down_now(&self) -> Result<(), OffloaderError> {
        self.refuse_inside_gated("shutting down inside gated()")?;
        let _shutting = sync::lock(&self.shutting);
        if self.shut_down.load(Ordering::SeqCst) {
            return Err(ProtocolError::AlreadyShutDown.into());
        }
        let rules = self.coord.rules();
        let mut drained = Ok(());
        rules.refuses_before_teardown(
            // Refused here, in one critical section of the coordinator,
            // with nothing changed: no window open, no registered graph
            // alive. From here on the coordinator refuses new windows,
            // graphs and jobs.
            || -> Result<(), OffloaderError> {
                // Refused while a capture hook window is open or opening; a
                // flush of deferred jobs in progress ends first, and no hook
                // window begins until the coordinator is closed (hook.rs).
                let hook = self.hook_quiesce()?;
                self.coord.shutdown_steps().close()?;
                drop(hook);
                self.shut_down.store(true, Ordering::SeqCst);
                Ok(())
            },
            || {
                // Drain: every job in flight completes and is applied.
                let engine = {
                    let mut inner = sync::lock(&self.inner);
                    inner.closed = true;
                    inner.engine.clone()
                };
                if let Some(engine) = engine.as_ref() {
                    rules.offloader_drains(|| -> Result<(), OffloaderError> {
                        // No window can open any more (the coordinator is
                        // closed), so neither the waits nor the polls are
                        // refused.
                        drained = engine.wait_all().map_err(OffloaderError::from);
                        let in_flight =
                            || engine.in_flight(Direction::DeviceToHost) + engine.in_flight(Direction::HostToDevice);
                        while in_flight() > 0 {
                            if self.poll_each(&mut drop) == 0 {
                                // Only while a window that opened before
                                // `close` is still open, which `close`
                                // refused: cannot happen.
                                self.coord.wait_no_window(Request::new(), None)?;
                            }
                        }
                        Ok(())
                    })?;
                }
                drop(engine);
                // The engine goes before the region is unregistered (its
                // streams, tables and staging ring are freed through the
                // gate).
                let engine = sync::lock(&self.inner).engine.take();
                drop(engine);
                Ok(())
            },
            // The coordinator asked after the teardown (the rule's order
            // reversed), the tensors freed when it refuses.
            || {
                self.shut_down.store(true, Ordering::SeqCst);
                self.coord.shutdown_steps().close().map_err(|e| {
                    let _ = self.free_owned();
                    e.into()
                })
            },
        )?;
        let pinner = &self.pinner;
        let mut joined = Ok(());
        let r = finish_shutdown(self.rt().as_ref(), &self.coord, || {
            let mut p = sync::lock(pinner);
            if let Pinner::Running(h) = std::mem::replace(&mut *p, Pinner::NotStarted) {
                match h.join() {
                    Ok(o) => *p = Pinner::Done(o),
                    Err(_) => joined = Err(OffloaderError::PinnerPanicked),
                }
            }
        });
        let freed = self.free_owned();
        r?;
        joined?;
        drained?;
        freed?;
        tracing::info!("offloader shut down");
        Ok(())
    }

    /// Frees the tensors and the compute stream the offloader allocated.
    fn free_owned(&self) -> Result<(), OffloaderError> {
        let mut first = None;
        if let Some(s) = self.owned.compute {
            if let Err(e) = self.rt().stream_destroy(s) {
                first.get_or_insert(OffloaderError::driver("destroying the compute stream")(e));
            }
        }
        for &p in &self.owned.tensors {
            // SAFETY: every job is drained (no copy of the offloader touches
            // the tensor) and no registered graph lives (`close` refused
            // otherwise); the contract of `with_allocated_tensors` is that
            // the engine's own work on them ended before shutdown.
            match self.coord.unsafe_call("freeing a KV tensor", Request::new(), |g| unsafe { self.rt().mem_free(g, p) })
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first.get_or_insert(OffloaderError::driver("freeing a KV tensor")(e));
                }
                Err(e) => {
                    first.get_or_insert(e.into());
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// True once [`Offloader::shutdown`] began and was not refused (it then
    /// refuses every later call with `AlreadyShutDown`).
    /// Never blocks: a shutdown in progress holds its lock for its whole
    /// run (the drain, the pinner's join), and a caller asking this, the
    /// Python front with the GIL held, must not wait for it.
    pub fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::SeqCst)
    }
}

/// Dropping an offloader that was not shut down runs [`Offloader::shutdown`].
/// When that is refused (a capture window still open, or a registered graph
/// still alive: the graph may be replayed and reads the region and the
/// tensors), the drop leaks on purpose: the region stays mapped and
/// registered (the coordinator keeps it), the tensors the offloader
/// allocated stay allocated, and the pinner finishes on its own; the error
/// is logged. Replaying the graph stays correct; the memory is the
/// process's until it exits.
impl Drop for Offloader {
    fn drop(&mut self) {
        if self.is_shut_down() {
            return;
        }
        if let Err(e) = self.shut_down_now() {
            tracing::error!(error = %e, "offloader dropped: shutdown failed; registered memory stays mapped (leaked)");
        }
    }
}
