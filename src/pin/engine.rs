//! The registration loop: chunk by chunk through the coordinator, with
//! cancellation between chunks and all-or-nothing rollback (P8).

use std::time::Duration;

use crate::protocol::agreement::{agree, agree_via, AgreementError, OffloadMode, RankSlots, Transport};
use crate::protocol::{Coordinator, PageableReason, PinState};
use crate::runtime::GpuRuntime;
use crate::sync::{thread, Arc};

/// Makes a chunk's pages resident before it is registered (registration of
/// touched pages is several times faster than of untouched ones:
/// docs/driver-rules.md, rows "One registration of untouched pages" and
/// "Registration of resident pages").
pub trait Prefault: Send + Sync {
    /// Returns once chunk `i` (`len` bytes at `addr`) is resident.
    fn ensure(&self, i: usize, addr: usize, len: usize) -> Result<(), String>;
    /// Chunk `i` comes later, after the one being registered: an
    /// implementation may start faulting it in the background. The loop
    /// hints the next chunk, and further chunks while the hinted bytes
    /// ahead of the current chunk are below [`Prefault::lookahead_bytes`],
    /// each chunk once and in order.
    fn hint(&self, _i: usize, _addr: usize, _len: usize) {}
    /// The registration loop hints chunks until the bytes hinted ahead of
    /// the chunk being registered reach this (0: only the next chunk). A
    /// required method, so that a wrapper cannot silently drop its inner
    /// pre-faulter's lookahead.
    fn lookahead_bytes(&self) -> usize;
    /// Pinning is over (pinned, failed or cancelled): stop background work
    /// (drop what did not start, wait for what runs) and release threads.
    /// The registration loop calls it before the outcome is published, so
    /// no pre-faulting touches the region once the state is final.
    fn settle(&self) {}
}

/// No pre-faulting: the driver faults pages itself during registration.
pub struct NoPrefault;

impl NoPrefault {
    /// As a shared trait object, ready for [`PinHandle::spawn`].
    pub fn shared() -> Arc<dyn Prefault> {
        crate::sync::arc_dyn(NoPrefault, |a: crate::sync::StdArc<NoPrefault>| -> crate::sync::StdArc<dyn Prefault> {
            a
        })
    }
}

impl Prefault for NoPrefault {
    fn ensure(&self, _i: usize, _addr: usize, _len: usize) -> Result<(), String> {
        Ok(())
    }
    fn lookahead_bytes(&self) -> usize {
        0
    }
}

/// Ranks that must agree on the outcome before it is published (P7).
#[derive(Clone)]
pub struct Agreement {
    /// The ranks' agreement words: the shared region's header for ranks in
    /// separate processes ([`RegionSlots`](crate::pin::RegionSlots)), or
    /// [`LocalSlots`](crate::protocol::agreement::LocalSlots) for ranks that
    /// are threads of one process.
    pub slots: Arc<dyn RankSlots>,
    /// This rank's index among the slots (`0..slots.ranks()`).
    pub rank: usize,
    /// How long to wait for the other ranks to settle once this one has;
    /// `None` waits until every rank settles or one is found dead. When it
    /// passes, this rank ends pageable and
    /// [`AgreementError::Timeout`] is returned.
    pub timeout: Option<Duration>,
}

/// How the ranks agree on the outcome (P7): through words in the shared
/// region's header (one node), or through a transport the engine provides
/// (ranks on several nodes).
#[derive(Clone)]
pub enum RankAgreement {
    /// The ranks' words ([`Agreement`]).
    Slots(Agreement),
    /// One collective exchange over the engine's process group; see the
    /// contract of [`Transport`].
    Transport(Arc<dyn Transport>),
}

impl From<Agreement> for RankAgreement {
    fn from(a: Agreement) -> Self {
        RankAgreement::Slots(a)
    }
}

/// Pins every chunk of `coord` on the calling thread and returns the final
/// state (also published through the coordinator).
///
/// - Between chunks it stops if pinning was cancelled (shutdown or
///   [`Coordinator::cancel_pinning`]).
/// - Each registration is a capture-unsafe call made through the
///   coordinator, so it never overlaps a capture window.
/// - On any failure at chunk k, chunks k-1 .. 0 are unregistered, last
///   first, and the region continues on pageable memory with the reason
///   (out-of-memory is reported as the memlock limit when RLIMIT_MEMLOCK
///   is finite and below the region size, see [`super::memlock`]).
/// - Before the outcome is published [`Prefault::settle`] stops
///   pre-faulting, so none outlives pinning.
/// - Each registered chunk is a tracing event (info): chunks done of
///   total, bytes so far, GB/s so far.
pub fn pin_all(rt: &dyn GpuRuntime, coord: &Coordinator, prefault: &dyn Prefault) -> PinState {
    if let Err(settled) = begin(coord) {
        return settled;
    }
    let state = match pin_chunks(rt, coord, prefault) {
        Ok(()) => PinState::Pinned,
        Err(reason) => PinState::Pageable(reason),
    };
    publish(coord, state)
}

/// Like [`pin_all`], but the outcome is published only once every rank of
/// `agreement` has settled; if any rank ended pageable, this one unregisters
/// its chunks and ends `Pageable(PeerPageable)` too. An agreement that
/// cannot be reached (a rank died, timeout, pinning cancelled by a shutdown
/// or [`Coordinator::cancel_pinning`] while this rank waited, a peer that
/// gave up) leaves this rank pageable, at once, and is returned as the
/// error; the ranks this one waited for then end pageable too (see
/// [`agree`]).
pub fn pin_all_agreed(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    prefault: &dyn Prefault,
    agreement: &Agreement,
) -> Result<PinState, AgreementError> {
    // The wait ends when pinning is cancelled (a shutdown closes the
    // coordinator, which cancels pinning), N23 aside.
    let cancelled = || coord.pin_cancelled() && !crate::protocol::variant_is!(coord, AgreementIgnoresCancel);
    pin_then_agree(rt, coord, prefault, |pinned| {
        agree(agreement.slots.as_ref(), agreement.rank, pinned, agreement.timeout, &cancelled)
    })
}

/// [`pin_all_agreed`] with either way of agreeing: the region's words, or
/// the engine's [`Transport`] (a transport error leaves this rank pageable
/// and is returned, as a timeout is).
pub fn pin_all_agreed_by(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    prefault: &dyn Prefault,
    agreement: &RankAgreement,
) -> Result<PinState, AgreementError> {
    match agreement {
        RankAgreement::Slots(a) => pin_all_agreed(rt, coord, prefault, a),
        RankAgreement::Transport(t) => {
            let cancelled = || coord.pin_cancelled();
            pin_then_agree(rt, coord, prefault, |pinned| agree_via(t, pinned, &cancelled))
        }
    }
}

/// Pins locally, then lets `agree` (this rank's outcome in, the common mode
/// out) decide before anything is published.
fn pin_then_agree(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    prefault: &dyn Prefault,
    agree: impl FnOnce(bool) -> Result<OffloadMode, AgreementError>,
) -> Result<PinState, AgreementError> {
    let local = match begin(coord) {
        Ok(()) => pin_chunks(rt, coord, prefault),
        Err(PinState::Pageable(reason)) => Err(reason),
        Err(_) => Ok(()),
    };
    if local.is_ok() && crate::protocol::variant_is!(coord, PublishBeforeAgreement) {
        // N8: offload turns on for this rank before the ranks agreed.
        coord.pin_finish(PinState::Pinned);
    }
    let mode = agree(local.is_ok());
    let state = match (&local, &mode) {
        (Ok(()), Ok(OffloadMode::Pinned)) => PinState::Pinned,
        (Err(reason), _) => PinState::Pageable(reason.clone()),
        (Ok(()), _) => {
            if let Err(e) = coord.unregister_all(rt) {
                tracing::error!(error = %e, "falling back to pageable: unregister failed");
            }
            PinState::Pageable(PageableReason::PeerPageable)
        }
    };
    let state = publish(coord, state);
    mode.map(|_| state)
}

/// Moves Pending to Pinning; otherwise the state pinning already has
/// (cancelled before it started, or pinned before).
fn begin(coord: &Coordinator) -> Result<(), PinState> {
    if coord.pin_begin() {
        return Ok(());
    }
    let s = coord.pin_state();
    if s.is_final() {
        Err(s)
    } else {
        Err(publish(coord, PinState::Pageable(PageableReason::Cancelled)))
    }
}

fn publish(coord: &Coordinator, state: PinState) -> PinState {
    coord.pin_finish(state.clone());
    state
}

/// The registration loop (after [`begin`]) without publishing: Ok when
/// every chunk is registered, otherwise the reason after a full rollback.
fn pin_chunks(rt: &dyn GpuRuntime, coord: &Coordinator, prefault: &dyn Prefault) -> Result<(), PageableReason> {
    let n = coord.chunk_count();
    let span = tracing::info_span!("pin", chunks = n);
    let _e = span.enter();
    let started = std::time::Instant::now();
    let ahead = prefault.lookahead_bytes();
    // Chunks `..next` were hinted (or are being ensured); `queued`: bytes of
    // the hinted chunks after the current one.
    let mut next = 0usize;
    let mut queued = 0usize;
    for i in 0..n {
        if coord.pin_cancelled() {
            return Err(rollback(rt, coord, prefault, i, PageableReason::Cancelled));
        }
        let (addr, len) = coord.chunk_range(i);
        if let Err(e) = prefault.ensure(i, addr, len) {
            return Err(rollback(rt, coord, prefault, i, PageableReason::HostMemory(e)));
        }
        if i < next {
            queued = queued.saturating_sub(len);
        } else {
            next = i + 1;
        }
        // The next chunk always; more while the bytes hinted ahead are
        // below the lookahead, so the pre-fault workers stay busy while a
        // registration runs long (the pipeline then approaches the slower
        // stage instead of the slower of each pair of chunks).
        while next < n && (next == i + 1 || queued < ahead) {
            let (a, l) = coord.chunk_range(next);
            prefault.hint(next, a, l);
            queued += l;
            next += 1;
        }
        match coord.register_chunk(rt, i) {
            Ok(Ok(())) => {
                // Progress: the chunk and the time since pinning began (the
                // rate is the reader's: the chunks are listed in order).
                let secs = started.elapsed().as_secs_f64();
                tracing::info!(done = i + 1, of = n, chunk_bytes = len, secs, "chunk registered");
            }
            Ok(Err(e)) => {
                tracing::warn!(chunk = i, error = %e, "registration failed; rolling back to pageable memory");
                let mut reason = PageableReason::from_driver(e);
                if reason == PageableReason::OutOfMemory {
                    let total: u64 = (0..n).map(|j| coord.chunk_range(j).1 as u64).sum();
                    reason = super::memlock::refine(reason, total);
                }
                return Err(rollback(rt, coord, prefault, i, reason));
            }
            Err(e) => {
                tracing::warn!(chunk = i, error = %e, "registration refused; rolling back");
                return Err(rollback(rt, coord, prefault, i, PageableReason::Cancelled));
            }
        }
    }
    prefault.settle();
    Ok(())
}

/// Stops pre-faulting, unregisters chunks `0..failed` (last first);
/// returns `reason`.
fn rollback(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    prefault: &dyn Prefault,
    failed: usize,
    reason: PageableReason,
) -> PageableReason {
    prefault.settle();
    let order: Vec<usize> = if crate::protocol::variant_is!(coord, ForgetfulRollback) {
        // N7: only the chunk registered last is undone.
        failed.checked_sub(1).into_iter().collect()
    } else {
        (0..failed).rev().collect()
    };
    for j in order {
        match coord.unregister_chunk(rt, j) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(chunk = j, error = %e, "rollback: unregister failed"),
            Err(e) => tracing::error!(chunk = j, error = %e, "rollback: unregister refused"),
        }
    }
    reason
}

/// Pinning running on its own thread while the caller goes on. Its state
/// is observable and waitable through the coordinator
/// ([`Coordinator::pin_state`], [`Coordinator::wait_pin_final`]).
pub struct PinHandle {
    coord: Arc<Coordinator>,
    thread: Option<thread::JoinHandle<PinState>>,
}

impl PinHandle {
    /// Starts [`pin_all`] on a new thread.
    pub fn spawn(rt: Arc<dyn GpuRuntime>, coord: Arc<Coordinator>, prefault: Arc<dyn Prefault>) -> PinHandle {
        Self::spawn_with(rt, coord, prefault, None)
    }

    /// Starts [`pin_all`], or [`pin_all_agreed`] when ranks must agree, on
    /// a new thread. An agreement error is logged; the state ends Pageable.
    pub fn spawn_with(
        rt: Arc<dyn GpuRuntime>,
        coord: Arc<Coordinator>,
        prefault: Arc<dyn Prefault>,
        agreement: Option<Agreement>,
    ) -> PinHandle {
        let c = coord.clone();
        let thread = thread::spawn(move || match &agreement {
            None => pin_all(rt.as_ref(), &c, prefault.as_ref()),
            Some(a) => pin_all_agreed(rt.as_ref(), &c, prefault.as_ref(), a).unwrap_or_else(|e| {
                tracing::error!(error = %e, "ranks did not agree; running pageable");
                c.pin_state()
            }),
        });
        PinHandle { coord, thread: Some(thread) }
    }

    /// The current state.
    pub fn state(&self) -> PinState {
        self.coord.pin_state()
    }

    /// Asks the pinner to stop at the next chunk boundary and roll back.
    pub fn cancel(&self) {
        self.coord.cancel_pinning();
    }

    /// Waits for the pinning thread and returns its final state.
    pub fn join(mut self) -> PinState {
        self.join_inner()
    }

    fn join_inner(&mut self) -> PinState {
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|_| {
                let s = PinState::Pageable(PageableReason::HostMemory("pinning thread panicked".into()));
                self.coord.pin_finish(s.clone());
                s
            }),
            None => self.coord.pin_state(),
        }
    }
}

impl Drop for PinHandle {
    /// A handle dropped early cancels pinning and waits for the rollback,
    /// so no registration outlives its owner unnoticed. (Cancelling pinning
    /// that is already final changes nothing: only the start of pinning and
    /// the registration loop read the request.)
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.coord.cancel_pinning();
            self.join_inner();
        }
    }
}
