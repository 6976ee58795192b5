//! The registration loop: chunk by chunk through the coordinator, with
//! cancellation between chunks and all-or-nothing rollback (P8).

use std::time::Duration;

use crate::protocol::agreement::{agree, agree_via, AgreementError, OffloadMode, RankSlots, Transport};
use crate::protocol::{Coordinator, PageableReason, PinState};
use crate::rules::Rules;
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

/// Watches pinning from the pinning thread: the registration loop calls it
/// before each chunk and once it settled. An [`Offloader`]'s background
/// pinner reports to the one in `OffloaderOptions::pin_observer`.
///
/// Its methods run on the pinning thread, and pinning waits while one runs:
/// keep them short (a progress display, a timestamp). A test may block in
/// [`PinObserver::before_chunk`] to hold pinning at a chunk boundary (a
/// capture window that waits for pinning then waits as long).
///
/// [`Offloader`]: crate::offloader::Offloader
pub trait PinObserver: Send + Sync {
    /// Chunk `index` (of `total`, counted from 0) is about to be made
    /// resident and registered.
    fn before_chunk(&self, _index: usize, _total: usize) {}
    /// This rank's own pinning ended: every chunk registered, or pinning
    /// failed or was cancelled and is about to roll back. Called once,
    /// after pre-faulting stopped ([`Prefault::settle`]), before any
    /// rollback and, with a shared region, before the agreement with the
    /// other ranks; not called when pinning was cancelled before it began.
    fn settled(&self) {}
}

impl std::fmt::Debug for dyn PinObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PinObserver")
    }
}

/// How a pinner ended ([`pin_with`], the thread of [`spawn_pinner`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinOutcome {
    /// The final state.
    pub state: PinState,
    /// With a shared region: the agreement, or why it was not reached
    /// (this rank then runs on pageable memory).
    pub agreement: Option<Result<(), AgreementError>>,
}

impl PinOutcome {
    /// The final state, or why the ranks did not agree.
    pub fn agreed(self) -> Result<PinState, AgreementError> {
        match self.agreement {
            Some(Err(e)) => Err(e),
            _ => Ok(self.state),
        }
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
///   [`Pinning::cancel`](crate::protocol::Pinning::cancel)).
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
    pin_alone(rt, coord, Steps { prefault, observer: None })
}

/// What the registration loop calls besides the coordinator: the
/// pre-faulter, and who watches.
#[derive(Clone, Copy)]
struct Steps<'a> {
    prefault: &'a dyn Prefault,
    observer: Option<&'a dyn PinObserver>,
}

impl Steps<'_> {
    fn before_chunk(&self, i: usize, n: usize) {
        if let Some(o) = self.observer {
            o.before_chunk(i, n);
        }
    }

    /// [`Prefault::settle`], then [`PinObserver::settled`].
    fn settle(&self) {
        self.prefault.settle();
        if let Some(o) = self.observer {
            o.settled();
        }
    }
}

/// [`pin_all`] with `steps`.
fn pin_alone(rt: &dyn GpuRuntime, coord: &Coordinator, steps: Steps<'_>) -> PinState {
    if let Err(settled) = begin(coord) {
        return settled;
    }
    let state = match pin_chunks(rt, coord, steps) {
        Ok(()) => PinState::Pinned,
        Err(reason) => PinState::Pageable(reason),
    };
    publish(coord, state)
}

/// Like [`pin_all`], but the outcome is published only once every rank of
/// `agreement` has settled; if any rank ended pageable, this one unregisters
/// its chunks and ends `Pageable(PeerPageable)` too. An agreement that
/// cannot be reached (a rank died, timeout, pinning cancelled by a shutdown
/// or [`Pinning::cancel`](crate::protocol::Pinning::cancel) while this rank waited, a peer that
/// gave up) leaves this rank pageable, at once, and is returned as the
/// error (its reason `PeerPageable`, but `Cancelled` when this rank's own
/// cancel ended the wait); the ranks this one waited for then end pageable
/// too (see [`agree`]).
pub fn pin_all_agreed(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    prefault: &dyn Prefault,
    agreement: &Agreement,
) -> Result<PinState, AgreementError> {
    pin_agreed(rt, coord, Steps { prefault, observer: None }, agreement)
}

/// [`pin_all_agreed`] with `steps`.
fn pin_agreed(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    steps: Steps<'_>,
    agreement: &Agreement,
) -> Result<PinState, AgreementError> {
    // The wait ends when pinning is cancelled (a shutdown closes the
    // coordinator, which cancels pinning).
    let cancelled = || coord.rules().agreement_heeds_cancel(coord.pinning().cancelled());
    pin_then_agree(rt, coord, steps, |pinned| {
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
    pin_agreed_by(rt, coord, Steps { prefault, observer: None }, agreement)
}

/// [`pin_all_agreed_by`] with `steps`.
fn pin_agreed_by(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    steps: Steps<'_>,
    agreement: &RankAgreement,
) -> Result<PinState, AgreementError> {
    match agreement {
        RankAgreement::Slots(a) => pin_agreed(rt, coord, steps, a),
        RankAgreement::Transport(t) => {
            let cancelled = || coord.pinning().cancelled();
            pin_then_agree(rt, coord, steps, |pinned| agree_via(t, pinned, &cancelled))
        }
    }
}

/// Pins every chunk of `coord` on the calling thread, reporting to
/// `observer`: [`pin_all`] without an agreement, [`pin_all_agreed_by`] with
/// one (an agreement error is returned in the outcome; the state is then
/// pageable). What the thread of [`spawn_pinner`] runs.
pub fn pin_with(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    prefault: &dyn Prefault,
    observer: Option<&dyn PinObserver>,
    agreement: Option<&RankAgreement>,
) -> PinOutcome {
    let steps = Steps { prefault, observer };
    match agreement {
        None => PinOutcome { state: pin_alone(rt, coord, steps), agreement: None },
        Some(a) => match pin_agreed_by(rt, coord, steps, a) {
            Ok(state) => PinOutcome { state, agreement: Some(Ok(())) },
            Err(e) => PinOutcome { state: coord.pinning().state(), agreement: Some(Err(e)) },
        },
    }
}

/// Starts [`pin_with`] on a new thread: the one way the library pins in the
/// background ([`PinHandle`], `Offloader::start`), so the models that drive
/// a [`PinHandle`] drive the thread an engine gets. An agreement error is
/// logged.
pub fn spawn_pinner(
    rt: Arc<dyn GpuRuntime>,
    coord: Arc<Coordinator>,
    prefault: Arc<dyn Prefault>,
    observer: Option<Arc<dyn PinObserver>>,
    agreement: Option<RankAgreement>,
) -> thread::JoinHandle<PinOutcome> {
    thread::spawn(move || {
        let out = pin_with(rt.as_ref(), &coord, prefault.as_ref(), observer.as_deref(), agreement.as_ref());
        if let Some(Err(e)) = &out.agreement {
            tracing::error!(error = %e, "ranks did not agree; this rank runs on pageable memory");
        }
        out
    })
}

/// Pins locally, then lets `agree` (this rank's outcome in, the common mode
/// out) decide before anything is published.
fn pin_then_agree(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    steps: Steps<'_>,
    agree: impl FnOnce(bool) -> Result<OffloadMode, AgreementError>,
) -> Result<PinState, AgreementError> {
    let local = match begin(coord) {
        Ok(()) => pin_chunks(rt, coord, steps),
        Err(PinState::Pageable(reason)) => Err(reason),
        Err(_) => Ok(()),
    };
    let mode = coord.rules().agree_before_publishing(local.is_ok(), || coord.pinning().finish(PinState::Pinned), agree);
    let state = match (&local, &mode) {
        (Ok(()), Ok(OffloadMode::Pinned)) => PinState::Pinned,
        (Err(reason), _) => PinState::Pageable(reason.clone()),
        (Ok(()), _) => {
            if let Err(e) = coord.pinning().unregister_all(rt) {
                tracing::error!(error = %e, "falling back to pageable: unregister failed");
            }
            // This rank's own cancel (its shutdown, or `cancel_pinning`)
            // ended the agreement: its own reason, not a peer's outcome.
            let own = matches!(mode, Err(AgreementError::Cancelled { .. } | AgreementError::ExchangeCancelled));
            PinState::Pageable(if own { PageableReason::Cancelled } else { PageableReason::PeerPageable })
        }
    };
    let state = publish(coord, state);
    mode.map(|_| state)
}

/// Moves Pending to Pinning; otherwise the state pinning already has
/// (cancelled before it started, or pinned before).
fn begin(coord: &Coordinator) -> Result<(), PinState> {
    if coord.pinning().begin() {
        return Ok(());
    }
    let s = coord.pinning().state();
    if s.is_final() {
        Err(s)
    } else {
        Err(publish(coord, PinState::Pageable(PageableReason::Cancelled)))
    }
}

fn publish(coord: &Coordinator, state: PinState) -> PinState {
    coord.pinning().finish(state.clone());
    state
}

/// The registration loop (after [`begin`]) without publishing: Ok when
/// every chunk is registered, otherwise the reason after a full rollback.
fn pin_chunks(rt: &dyn GpuRuntime, coord: &Coordinator, steps: Steps<'_>) -> Result<(), PageableReason> {
    let prefault = steps.prefault;
    let n = coord.pinning().chunk_count();
    let span = tracing::info_span!("pin", chunks = n);
    let _e = span.enter();
    let started = std::time::Instant::now();
    let ahead = prefault.lookahead_bytes();
    // Chunks `..next` were hinted (or are being ensured); `queued`: bytes of
    // the hinted chunks after the current one.
    let mut next = 0usize;
    let mut queued = 0usize;
    for i in 0..n {
        if coord.pinning().cancelled() {
            return Err(rollback(rt, coord, steps, i, PageableReason::Cancelled));
        }
        let (addr, len) = coord.pinning().chunk_range(i);
        steps.before_chunk(i, n);
        if let Err(e) = prefault.ensure(i, addr, len) {
            return Err(rollback(rt, coord, steps, i, PageableReason::HostMemory(e)));
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
            let (a, l) = coord.pinning().chunk_range(next);
            prefault.hint(next, a, l);
            queued += l;
            next += 1;
        }
        match coord.pinning().register_chunk(rt, i) {
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
                    let total: u64 = (0..n).map(|j| coord.pinning().chunk_range(j).1 as u64).sum();
                    reason = super::memlock::refine(reason, total);
                }
                return Err(rollback(rt, coord, steps, i, reason));
            }
            Err(e) => {
                tracing::warn!(chunk = i, error = %e, "registration refused; rolling back");
                return Err(rollback(rt, coord, steps, i, PageableReason::Cancelled));
            }
        }
    }
    steps.settle();
    Ok(())
}

/// Stops pre-faulting (and tells the observer), unregisters chunks
/// `0..failed` (last first); returns `reason`.
fn rollback(
    rt: &dyn GpuRuntime,
    coord: &Coordinator,
    steps: Steps<'_>,
    failed: usize,
    reason: PageableReason,
) -> PageableReason {
    steps.settle();
    coord.rules().roll_back_all(failed, |j| match coord.pinning().unregister_chunk(rt, j) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(chunk = j, error = %e, "rollback: unregister failed"),
        Err(e) => tracing::error!(chunk = j, error = %e, "rollback: unregister refused"),
    });
    reason
}

/// Pinning running on its own thread while the caller goes on. Its state
/// is observable and waitable through the coordinator
/// ([`Coordinator::pinning`]: [`Pinning::state`](crate::protocol::Pinning::state),
/// [`Pinning::wait_final`](crate::protocol::Pinning::wait_final)).
pub struct PinHandle {
    coord: Arc<Coordinator>,
    thread: Option<thread::JoinHandle<PinOutcome>>,
}

impl PinHandle {
    /// Starts [`pin_all`] on a new thread ([`spawn_pinner`]).
    pub fn spawn(rt: Arc<dyn GpuRuntime>, coord: Arc<Coordinator>, prefault: Arc<dyn Prefault>) -> PinHandle {
        Self::spawn_with(rt, coord, prefault, None)
    }

    /// Starts [`pin_all`], or [`pin_all_agreed`] when ranks must agree, on
    /// a new thread ([`spawn_pinner`]). An agreement error is logged; the
    /// state ends Pageable.
    pub fn spawn_with(
        rt: Arc<dyn GpuRuntime>,
        coord: Arc<Coordinator>,
        prefault: Arc<dyn Prefault>,
        agreement: Option<Agreement>,
    ) -> PinHandle {
        let thread = spawn_pinner(rt, coord.clone(), prefault, None, agreement.map(RankAgreement::from));
        PinHandle { coord, thread: Some(thread) }
    }

    /// The current state.
    pub fn state(&self) -> PinState {
        self.coord.pinning().state()
    }

    /// Asks the pinner to stop at the next chunk boundary and roll back.
    pub fn cancel(&self) {
        self.coord.pinning().cancel();
    }

    /// Waits for the pinning thread and returns its final state.
    pub fn join(mut self) -> PinState {
        self.join_inner()
    }

    fn join_inner(&mut self) -> PinState {
        match self.thread.take() {
            Some(t) => t.join().map(|o| o.state).unwrap_or_else(|_| {
                let s = PinState::Pageable(PageableReason::HostMemory("pinning thread panicked".into()));
                self.coord.pinning().finish(s.clone());
                s
            }),
            None => self.coord.pinning().state(),
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
            self.coord.pinning().cancel();
            self.join_inner();
        }
    }
}
