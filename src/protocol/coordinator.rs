//! The coordinator: one lock and one condition variable that every party
//! of the capture-safety protocol goes through.
//!
//! Parties: the engine (opens capture windows, registers graphs, submits
//! jobs, shuts down), the pinner (registers and unregisters chunks), the
//! transfer engine (admits jobs, polls events, launches the gather kernel
//! on registered chunks). The rules, each the argument of a property in
//! docs/PROOFS.md:
//!
//! - A capture-unsafe driver call by the library ([`Coordinator::unsafe_call`])
//!   starts only while no window is open, and a window opens only while no
//!   such call is in flight (P1). Windows
//!   and library calls take turns when both wait, so a window waits for at
//!   most one chunk's registration (P2, Interleave) and back-to-back
//!   windows cannot starve pinning.
//! - A chunk's registration or unregistration is recorded in the critical
//!   section that ends its call, so no window opens between the driver call
//!   and its record: a window counts exactly the registrations it waited
//!   for ([`CaptureWindow::chunks_waited`], P2).
//! - With [`CapturePolicy::AfterPinning`] a window opens only once pinning
//!   is final (P2), except a window asked for with the Interleave policy
//!   ([`Coordinator::open_window_interleaved`], the capture hook's): it
//!   opens under the Interleave rules whatever the coordinator's policy,
//!   and while it waits, library calls take turns with it as with any
//!   Interleave window (P2 for the hook).
//! - The gather kernel gets a chunk's device alias only while the chunk is
//!   registered, and unregistering a chunk waits for those users (P3).
//! - Shutdown refuses while a window is open or registered graphs live,
//!   then refuses new work, drains jobs and stops pinning before anything
//!   is unregistered (P4).
//! - Waiting for pinning inside one's own window under Interleave is a
//!   typed error, not a deadlock (P6).
//! - While a pin hold lives ([`Coordinator::hold_pinning`]: an engine's
//!   capture phase), no chunk registration starts: at most the one in
//!   flight when it was taken completes. A registration held back waits
//!   uncounted (it takes no window's turn); cancelling pinning releases it
//!   (shutdown is never held up), and a holder's own wait for pinning is a
//!   typed error (P2, model/p2_pin_hold.rs).
//! - The interruptible waits ([`Coordinator::open_window_interruptible`],
//!   [`Coordinator::wait_pin_final_interruptible`],
//!   [`Coordinator::wait_no_window_interruptible`]) wait for what their
//!   blocking forms wait for, on the condition variable in slices of at
//!   most 50 ms, and call their `interrupted` check between slices with
//!   the lock released (it may take other locks: the Python front takes
//!   the GIL, which Python threads hold while they take this lock). An
//!   interrupted wait leaves no trace: a window request is withdrawn
//!   before it opened (`windows_waiting` back, waiters woken), a pin waiter
//!   uncounted. P1 and P2 are about windows that open, so they are
//!   untouched; for P6 a withdrawn request is a release that wakes the
//!   library calls it held back. The blocking forms are unchanged. In the
//!   model builds a slice ends at a wake-up of the condition variable
//!   (`sync::Slice`: loom and shuttle model no time), so the models run
//!   the interruptible forms too (model/p6_interruptible.rs).

#[cfg(any(loom, shuttle))]
use crate::rules::negatives::Variant;
use crate::runtime::{CoordinatorId, DevicePtr, DriverError, Gate, GateBinding, GateSeal, GpuRuntime};
use crate::sync::{self, thread, Arc, Condvar, Mutex, MutexGuard};

/// `bad!(state, Name)`: true when the coordinator's state `state` runs the
/// known-bad variant `Variant::Name` of a negative model. Model builds only
/// (`--cfg loom` or `--cfg shuttle`):
/// elsewhere it is `false` and the variant does not exist, so no negative
/// model's knob is compiled into the engine's build.
#[cfg(any(loom, shuttle))]
macro_rules! bad {
    ($g:expr, $v:ident) => {
        $g.variant == Variant::$v
    };
}
#[cfg(not(any(loom, shuttle)))]
macro_rules! bad {
    ($g:expr, $v:ident) => {
        false
    };
}

/// `variant_is!(coord, Name)`: [`Coordinator::is`] of `Variant::Name` in
/// model builds (loom, shuttle), `false` (and not compiled) elsewhere; for the other
/// modules' negative-model knobs.
#[cfg(any(loom, shuttle))]
macro_rules! variant_is {
    ($c:expr, $v:ident) => {
        $c.is($crate::protocol::Variant::$v)
    };
}
#[cfg(not(any(loom, shuttle)))]
macro_rules! variant_is {
    ($c:expr, $v:ident) => {
        false
    };
}
pub(crate) use variant_is;

/// The process's one gate seal: only this module can make a [`Gate`]
/// (`runtime::gate` explains the seal). Taken the first time a coordinator
/// is made; if anything else took it first, that is a bug this panic names
/// at once, in every test that makes a coordinator.
// Not synchronisation between library threads: initialised once, then only
// read (std's, so that loom does not explore its initialisation).
#[allow(clippy::disallowed_types)]
static SEAL: std::sync::LazyLock<GateSeal> =
    std::sync::LazyLock::new(|| GateSeal::take().expect("the gate seal was taken outside the coordinator's module"));

use super::error::{PinState, ProtocolError};
use crate::names::named;

/// When capture windows may open.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum CapturePolicy {
    /// Only once pinning reached a final state (Pinned or Pageable).
    #[default]
    AfterPinning,
    /// While pinning runs too: the pinner stops at the next chunk boundary
    /// and resumes when the window closes.
    Interleave,
}

named!(CapturePolicy, "capture policy" {
    AfterPinning => "after_pinning",
    Interleave => "interleave",
});

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
    /// current ones to drop their [`AliasGuard`]s (P3). A chunk whose
    /// unregister call failed stays here (still registered in the driver,
    /// refused to new users) until a retry succeeds.
    Unregistering,
}

#[derive(Debug)]
struct Chunk {
    addr: usize,
    len: usize,
    reg: ChunkReg,
    /// Gather launches between their registration check and their enqueue.
    users: usize,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Phase {
    Running,
    /// Shutdown began: new work is refused (it stays so once shutdown
    /// completed: nothing tells the two apart).
    ShuttingDown,
}

struct State {
    policy: CapturePolicy,
    /// The negative model's knob (model builds only, `bad!`).
    #[cfg(any(loom, shuttle))]
    variant: Variant,
    pin: PinState,
    cancel_pin: bool,
    /// The threads that took the pin holds alive ([`Coordinator::hold_pinning`]),
    /// one entry per hold: while any lives, no registration starts.
    pin_holds: Vec<thread::ThreadId>,
    /// Registrations waiting for the pin holds to go.
    registrations_held: usize,
    windows_open: usize,
    window_owners: Vec<thread::ThreadId>,
    windows_waiting: usize,
    /// Window requests counted since the coordinator was made (each one
    /// that got past `open_window_inner`'s checks, opened or not):
    /// [`Coordinator::wait_no_window_or_request`] ends at a new one.
    window_requests: u64,
    /// Of `windows_waiting`, the requests that open under the Interleave
    /// rules whatever `policy` ([`Coordinator::open_window_interleaved`]).
    interleave_waiting: usize,
    unsafe_in_flight: usize,
    /// Capture-unsafe library calls waiting to start.
    unsafe_waiting: usize,
    /// Who goes first when a window and a library call both wait: windows
    /// and library calls take turns, so neither starves the other (an
    /// engine capturing back to back cannot stall pinning for good).
    turn: Turn,
    /// Chunk registrations completed since start (windows report how many
    /// they waited for).
    chunks_completed: usize,
    jobs_in_flight: usize,
    graphs_live: usize,
    /// Threads in [`Coordinator::wait_pin_final`] waiting for pinning.
    pin_waiters: usize,
    /// Threads in [`Coordinator::unregister_chunk`] waiting for a chunk's
    /// alias users.
    unregisters_waiting: usize,
    phase: Phase,
    chunks: Vec<Chunk>,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Turn {
    Window,
    Library,
}

impl State {
    fn window_could_open(&self) -> bool {
        self.policy == CapturePolicy::Interleave || self.pin.is_final()
    }

    /// Whether a request could open now, by the policy alone (`interleave`:
    /// a request of [`Coordinator::open_window_interleaved`]).
    fn request_could_open(&self, interleave: bool) -> bool {
        interleave || self.window_could_open()
    }

    /// Whether some waiting request could open by the policy alone (then
    /// library calls take turns with it).
    fn some_request_could_open(&self) -> bool {
        self.interleave_waiting > 0 || self.window_could_open()
    }

    fn window_may_open(&self, interleave: bool) -> bool {
        if bad!(self, NoCaptureWindow) {
            return true;
        }
        self.unsafe_in_flight == 0
            && self.request_could_open(interleave)
            && (self.unsafe_waiting == 0 || self.turn == Turn::Window)
    }

    fn unsafe_may_start(&self) -> bool {
        if bad!(self, NoCaptureWindow) {
            return true;
        }
        self.windows_open == 0
            && (self.windows_waiting == 0 || !self.some_request_could_open() || self.turn == Turn::Library)
    }

    fn owns_window(&self, me: thread::ThreadId) -> bool {
        self.window_owners.contains(&me)
    }

    /// A registration may not start: pinning is held and not cancelled
    /// (N31 ignores the hold).
    fn pin_held(&self) -> bool {
        !self.pin_holds.is_empty() && !self.cancel_pin && !bad!(self, PinIgnoresHold)
    }
}

/// What is open, in flight or waiting in a coordinator at one moment
/// ([`Coordinator::activity`]; diagnostics, and tests that must know a
/// thread is waiting before they let it go).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Activity {
    /// Capture windows open.
    pub windows_open: usize,
    /// Capture windows waiting to open.
    pub windows_waiting: usize,
    /// Capture-unsafe library calls in flight (inside the gate).
    pub calls_in_flight: usize,
    /// Capture-unsafe library calls waiting to start.
    pub calls_waiting: usize,
    /// Threads waiting for pinning to be final.
    pub pin_waiters: usize,
    /// Transfer jobs admitted and not yet finished (their tickets live).
    pub jobs_in_flight: usize,
    /// Graphs registered and not yet dropped.
    pub graphs_live: usize,
    /// Device aliases of chunks handed out and not yet dropped.
    pub alias_users: usize,
    /// Unregistrations waiting for a chunk's alias users to drop theirs.
    pub unregisters_waiting: usize,
    /// Pin holds alive ([`Coordinator::hold_pinning`]).
    pub pin_holds: usize,
    /// Chunk registrations held back by them (waiting, uncounted in
    /// `calls_waiting`).
    pub registrations_held: usize,
}

/// Shared by every thread of one offloader (`Arc<Coordinator>`).
pub struct Coordinator {
    shared: Arc<Shared>,
}

/// What keeps the chunks' memory mapped (for a region, the region itself).
pub type KeepAlive = Box<dyn std::any::Any + Send + Sync>;

/// The lock and condition variable; guards keep their own reference.
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    /// This coordinator's identity: its gates carry it, and `rt` accepts
    /// only those while this coordinator lives (bound in
    /// `Coordinator::new`, released in `Drop`).
    id: CoordinatorId,
    binding: GateBinding,
    /// The rules this coordinator runs ([`Coordinator::rules`]), readable
    /// outside the lock (`crate::rules::Knob`: nothing outside model builds).
    knob: crate::rules::Knob,
    /// Dropped with the last reference to the coordinator or its guards,
    /// unless a chunk is still registered then (see `Drop`).
    keep_alive: Option<KeepAlive>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let registered = self.lock().chunks.iter().filter(|c| c.reg != ChunkReg::Unregistered).count();
        if registered > 0 {
            if let Some(k) = self.keep_alive.take() {
                // The driver still holds registrations of this memory:
                // unmapping it under them is what the coordinator's contract
                // forbids, so the memory stays mapped (leaked) instead.
                tracing::error!(registered, "coordinator dropped with chunks still registered (no shutdown?); leaking the memory so it stays mapped");
                std::mem::forget(k);
            }
        }
        // No gate of this coordinator is left (each holds a borrow of a
        // guard or of the coordinator): the runtime may take another one.
        self.binding.release(self.id);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        sync::lock(&self.state)
    }

    /// Changes the state and wakes every waiter.
    fn update<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut g = self.lock();
        let r = f(&mut g);
        self.cv.notify_all();
        r
    }

    /// A guard's release: changes the state and wakes every waiter (N17,
    /// loom builds only, forgets the wake-up; model/p6_liveness.rs shows
    /// each guard's own wake-up is what releases its waiter).
    fn release(&self, f: impl FnOnce(&mut State)) {
        let mut g = self.lock();
        f(&mut g);
        if !bad!(g, SilentRelease) {
            self.cv.notify_all();
        }
    }
}

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
            if !bad!(g, WindowKeepsTurn) {
                g.turn = Turn::Library;
            }
            if let Some(i) = g.window_owners.iter().position(|t| *t == self.owner) {
                g.window_owners.swap_remove(i);
            }
            tracing::debug!(open = g.windows_open, "capture window closed");
        });
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

/// A pin hold ([`Coordinator::hold_pinning`]): no chunk registration starts
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
    /// A coordinator with no host memory to register: capture windows, the
    /// gate for capture-unsafe calls, jobs and shutdown, nothing to pin (its
    /// pin state starts `Pending`; [`Coordinator::pin_begin`] on no chunks
    /// pins nothing). For tools and tests that need the gate alone.
    ///
    /// Refused with [`ProtocolError::RuntimeGuarded`] while another
    /// coordinator guards `rt` (see [`Coordinator::new`]).
    pub fn without_region(rt: &dyn GpuRuntime, policy: CapturePolicy) -> Result<Arc<Self>, ProtocolError> {
        // SAFETY: no chunks, so nothing is ever registered.
        unsafe { Self::new(rt, policy, &[], None) }
    }

    /// A coordinator for a region cut into `chunks` (address, length) pieces,
    /// the units of registration, guarding runtime handle `rt`: from now on
    /// `rt` accepts the gates of this coordinator and no other, until this
    /// coordinator and every guard it handed out are gone. Refused with
    /// [`ProtocolError::RuntimeGuarded`] while another coordinator guards
    /// `rt`: one runtime handle has one coordinator, so no capture-unsafe
    /// call on it can run outside the gate of the coordinator whose windows
    /// the engine opens.
    ///
    /// `keep_alive` (for example an `Arc` of the region the chunks lie in)
    /// is held until the coordinator and every guard it handed out are
    /// gone, and is leaked (never dropped) if a chunk is still registered
    /// then.
    ///
    /// # Safety
    /// Every chunk is a live mapping of readable and writable host memory
    /// that stays mapped while the coordinator may register it: for as long
    /// as `keep_alive` lives, or, with `None`, until every chunk is
    /// unregistered again (after [`Coordinator::unregister_all`], or a
    /// shutdown, returned `Ok`). [`crate::pin::Prepared`] makes its
    /// coordinator with the region as `keep_alive`; use it rather than this.
    pub unsafe fn new(
        rt: &dyn GpuRuntime,
        policy: CapturePolicy,
        chunks: &[(usize, usize)],
        keep_alive: Option<KeepAlive>,
    ) -> Result<Arc<Self>, ProtocolError> {
        let id = CoordinatorId::fresh(&SEAL);
        if rt.gate_binding().bind(id).is_err() {
            return Err(ProtocolError::RuntimeGuarded { backend: rt.backend() });
        }
        Ok(Arc::new(Coordinator {
            shared: Arc::new(Shared {
                knob: crate::rules::Knob::default(),
                state: Mutex::new(State {
                    policy,
                    #[cfg(any(loom, shuttle))]
                    variant: Variant::Production,
                    pin: PinState::Pending,
                    cancel_pin: false,
                    pin_holds: Vec::new(),
                    registrations_held: 0,
                    windows_open: 0,
                    window_owners: Vec::new(),
                    windows_waiting: 0,
                    window_requests: 0,
                    interleave_waiting: 0,
                    unsafe_in_flight: 0,
                    unsafe_waiting: 0,
                    turn: Turn::Window,
                    chunks_completed: 0,
                    jobs_in_flight: 0,
                    graphs_live: 0,
                    pin_waiters: 0,
                    unregisters_waiting: 0,
                    phase: Phase::Running,
                    chunks: chunks
                        .iter()
                        .map(|&(addr, len)| Chunk { addr, len, reg: ChunkReg::Unregistered, users: 0 })
                        .collect(),
                }),
                cv: Condvar::new(),
                id,
                binding: rt.gate_binding().clone(),
                keep_alive,
            }),
        }))
    }

    /// A gate of this coordinator that its gate did not make (not in flight
    /// on any thread): loom builds only, for negative N8, which shows the
    /// simulated GPU stops a call made with it.
    #[cfg(any(loom, shuttle))]
    #[doc(hidden)]
    pub fn forged_gate(&self) -> Gate {
        Gate::unrecorded(&SEAL, self.shared.id)
    }

    /// Selects a known-bad variant (negative models only).
    #[cfg(any(loom, shuttle))]
    pub fn set_variant(&self, v: Variant) {
        self.lock().variant = v;
        self.shared.knob.set(v);
        // The binding of this coordinator's runtime handle runs the same
        // rules (N27's), as it admits gates without asking the coordinator.
        self.shared.binding.set_rules(v);
    }

    /// The rules this coordinator and its parties run (`crate::rules`):
    /// the shipped ones outside model builds, where this is zero-sized.
    pub(crate) fn rules(&self) -> crate::rules::Active {
        self.shared.knob.rules()
    }

    /// True when this coordinator runs variant `v` (loom builds only: the
    /// other modules ask through `variant_is!`, which is `false` elsewhere).
    #[cfg(any(loom, shuttle))]
    pub fn is(&self, v: Variant) -> bool {
        // Not the state's lock: a schedule point under loom (see `knob`).
        self.shared.knob.rules() == v
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }

    fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        sync::wait(&self.shared.cv, g)
    }

    /// Waits while `blocked` holds, like a loop of [`Coordinator::wait`],
    /// but on the condition variable in slices of at most
    /// [`INTERRUPT_EVERY`](crate::sync::INTERRUPT_EVERY) ([`sync::Slice`]),
    /// calling `interrupted` once a slice has passed since the last call
    /// (never before the first slice: a wait that ends sooner never calls
    /// it), once per slice: in model builds, where a slice ends at a
    /// wake-up, at most once per wake-up of the condition variable
    /// (model/p6_interruptible.rs; N34 spins). `interrupted` runs with the lock released:
    /// it may take other locks (the Python front takes the GIL, and a
    /// Python thread holding the GIL may be waiting for this lock), so
    /// calling it under the lock could deadlock. Returns the guard and true
    /// when `interrupted` said to stop (the caller then undoes its
    /// bookkeeping under that guard), false once `blocked` is false.
    fn wait_while_interruptible<'a>(
        &'a self,
        mut g: MutexGuard<'a, State>,
        blocked: impl Fn(&State) -> bool,
        interrupted: &dyn Fn() -> bool,
    ) -> (MutexGuard<'a, State>, bool) {
        let mut slice = sync::Slice::start();
        while blocked(&g) {
            if slice.over() {
                drop(g);
                let stop = interrupted();
                g = self.lock();
                if stop {
                    return (g, true);
                }
                // N34 (model builds only): no new slice, so the check is
                // called on every turn of the loop, without waiting.
                if !bad!(g, CheckWithoutNewSlice) {
                    slice = sync::Slice::start();
                }
                continue;
            }
            g = slice.wait(&self.shared.cv, g);
        }
        (g, false)
    }

    /// What is open, in flight or waiting right now.
    pub fn activity(&self) -> Activity {
        let g = self.lock();
        Activity {
            windows_open: g.windows_open,
            windows_waiting: g.windows_waiting,
            calls_in_flight: g.unsafe_in_flight,
            calls_waiting: g.unsafe_waiting,
            pin_waiters: g.pin_waiters,
            jobs_in_flight: g.jobs_in_flight,
            graphs_live: g.graphs_live,
            alias_users: g.chunks.iter().map(|c| c.users).sum(),
            unregisters_waiting: g.unregisters_waiting,
            pin_holds: g.pin_holds.len(),
            registrations_held: g.registrations_held,
        }
    }

    /// When capture windows may open, as fixed at construction.
    pub fn policy(&self) -> CapturePolicy {
        self.lock().policy
    }

    // ---- capture windows (engine) ----

    /// Opens a capture window, waiting until the policy allows it and no
    /// capture-unsafe library call is in flight.
    pub fn open_window(&self) -> Result<CaptureWindow, ProtocolError> {
        self.open_window_inner(|| {}, None, false)
    }

    /// [`Coordinator::open_window`] under the Interleave rules whatever the
    /// coordinator's policy: it waits only for the capture-unsafe call in
    /// flight (a chunk's registration, at most one: windows and library
    /// calls take turns), never for pinning to be final. The capture hook
    /// (`CaptureHook::begin`) opens its windows so, since a framework
    /// capture it wraps cannot be told to wait for the whole region.
    pub fn open_window_interleaved(&self) -> Result<CaptureWindow, ProtocolError> {
        self.open_window_inner(|| {}, None, true)
    }

    /// [`Coordinator::open_window_interleaved`], calling `at_request` under
    /// the lock as the request is counted (loom builds only, as
    /// [`Coordinator::open_window_noting`]).
    #[cfg(any(loom, shuttle))]
    pub fn open_window_interleaved_noting(&self, at_request: impl FnOnce()) -> Result<CaptureWindow, ProtocolError> {
        self.open_window_inner(at_request, None, true)
    }

    /// [`Coordinator::open_window`], calling `at_request` under the
    /// coordinator's lock at the moment the window asks to open (loom
    /// builds only: P2's model reads the simulated GPU's registration count
    /// there, so the chunks a window waited for are counted by the driver,
    /// not by the coordinator).
    #[cfg(any(loom, shuttle))]
    pub fn open_window_noting(&self, at_request: impl FnOnce()) -> Result<CaptureWindow, ProtocolError> {
        self.open_window_inner(at_request, None, false)
    }

    /// [`Coordinator::open_window`], interruptible: waits the same way, but
    /// calls `interrupted` at least every 50 ms while it waits (with the
    /// lock released, see the module docs) and, when it returns true,
    /// withdraws the request and returns [`ProtocolError::Interrupted`]. A
    /// withdrawn request leaves no trace: it never opened, it is no longer
    /// counted as waiting ([`Activity::windows_waiting`] as before the
    /// call), and the library calls it held back are woken.
    pub fn open_window_interruptible(&self, interrupted: &dyn Fn() -> bool) -> Result<CaptureWindow, ProtocolError> {
        self.open_window_inner(|| {}, Some(interrupted), false)
    }

    /// [`Coordinator::open_window_interleaved`], interruptible as
    /// [`Coordinator::open_window_interruptible`] (the capture hook's begin
    /// from the Python front: Ctrl-C withdraws the request, nothing opened).
    pub fn open_window_interleaved_interruptible(
        &self,
        interrupted: &dyn Fn() -> bool,
    ) -> Result<CaptureWindow, ProtocolError> {
        self.open_window_inner(|| {}, Some(interrupted), true)
    }

    /// Opens a window: `at_request` runs under the lock as the request is
    /// counted; the wait blocks, or with `interrupted` waits in slices and
    /// withdraws the request when it says so; `interleave` opens it under
    /// the Interleave rules whatever the policy.
    fn open_window_inner(
        &self,
        at_request: impl FnOnce(),
        interrupted: Option<&dyn Fn() -> bool>,
        interleave: bool,
    ) -> Result<CaptureWindow, ProtocolError> {
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
        at_request();
        let completed_at_request = g.chunks_completed;
        self.shared.cv.notify_all();
        let blocked = |s: &State| !s.window_may_open(interleave) && s.phase == Phase::Running;
        let stopped = match interrupted {
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

    /// Windows open right now.
    pub fn windows_open(&self) -> usize {
        self.lock().windows_open
    }

    // ---- capture-unsafe library calls ----

    /// Runs `f`, a capture-unsafe driver call, at a moment no capture window
    /// is open; windows wait for it to return. `f` gets the [`Gate`] that
    /// capture-unsafe operations of the runtime require: this (and
    /// [`Coordinator::try_unsafe_call`]) is the only place one is made.
    ///
    /// Refused with [`ProtocolError::WouldDeadlock`] inside the caller's own
    /// window (it would wait for itself).
    pub fn unsafe_call<T>(&self, what: &'static str, f: impl FnOnce(&Gate) -> T) -> Result<T, ProtocolError> {
        self.unsafe_call_then(what, f, |_, _| {})
    }

    /// [`Coordinator::unsafe_call`], interruptible: while it waits to start
    /// (a window open, or one whose turn it is) it calls `interrupted` at
    /// least every 50 ms with the lock released and, when that returns
    /// true, withdraws (no longer counted as waiting, the windows it held
    /// back woken) and returns [`ProtocolError::Interrupted`]; `f` has not
    /// run. Once `f` runs it is not interrupted (it is the caller's).
    pub fn unsafe_call_interruptible<T>(
        &self,
        what: &'static str,
        interrupted: &dyn Fn() -> bool,
        f: impl FnOnce(&Gate) -> T,
    ) -> Result<T, ProtocolError> {
        let mut g = self.lock();
        if g.owns_window(sync::this_thread()) && !bad!(g, NoCaptureWindow) {
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

    /// [`Coordinator::unsafe_call`], then `record` of its outcome under the
    /// lock, in the same critical section that ends the call: no window
    /// opens between the driver call and its record (a window that waited
    /// for a registration sees it counted).
    fn unsafe_call_then<T>(
        &self,
        what: &'static str,
        f: impl FnOnce(&Gate) -> T,
        record: impl FnOnce(&mut State, &T),
    ) -> Result<T, ProtocolError> {
        let mut g = self.lock();
        if g.owns_window(sync::this_thread()) && !bad!(g, NoCaptureWindow) {
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
    fn counted<T>(
        &self,
        mut g: MutexGuard<'_, State>,
        f: impl FnOnce(&Gate) -> T,
        record: impl FnOnce(&mut State, &T),
    ) -> T {
        g.unsafe_in_flight += 1;
        // N37 (model builds only): the guard below is never armed, so an
        // unwinding call stays counted.
        let leak = bad!(g, PanicUnderGateLeaks);
        drop(g);
        // Should `f` unwind (a panic in an engine's callable run under the
        // gate), the call still ends: the count drops and a waiting window
        // gets its turn (P6), instead of every later window waiting for
        // ever on a call that is gone.
        let mut in_flight = InFlight { shared: &self.shared, armed: !leak };
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
        let bypass = bad!(g, UngatedPoller);
        if !bypass && (g.owns_window(sync::this_thread()) || !g.unsafe_may_start()) {
            return Err(ProtocolError::WindowBusy);
        }
        Ok(self.counted(g, f, |_, _| {}))
    }

    /// Blocks until no window is open or waiting to open (for a poller that
    /// got `WindowBusy` and has nothing else to do).
    pub fn wait_no_window(&self) -> Result<(), ProtocolError> {
        let mut g = self.lock();
        if g.owns_window(sync::this_thread()) {
            return Err(ProtocolError::WouldDeadlock { what: "waiting for a transfer" });
        }
        while !g.unsafe_may_start() {
            g = self.wait(g);
        }
        Ok(())
    }

    /// Window requests made so far (a count that only grows), for
    /// [`Coordinator::wait_no_window_or_request`]: read it before deciding
    /// to wait, under whatever lock orders the requests the caller cares
    /// about (the capture hook reads it under its own lock, which a hook
    /// window's begin takes before it asks to open).
    pub fn window_requests(&self) -> u64 {
        self.lock().window_requests
    }

    /// [`Coordinator::wait_no_window`], ending also once a window has been
    /// requested after `since` (a [`Coordinator::window_requests`] reading):
    /// `Ok(true)` when no window holds library calls back, `Ok(false)` when
    /// a request came first (the caller looks again at why it waited). For
    /// the capture hook's flush, which waits for an engine's window but must
    /// not wait for a hook window that begins meanwhile (that window's close
    /// takes the rest of the queue over). With `interrupted`, it waits as
    /// [`Coordinator::wait_no_window_interruptible`].
    pub fn wait_no_window_or_request(
        &self,
        since: u64,
        interrupted: Option<&dyn Fn() -> bool>,
    ) -> Result<bool, ProtocolError> {
        let mut g = self.lock();
        if g.owns_window(sync::this_thread()) {
            return Err(ProtocolError::WouldDeadlock { what: "waiting for a transfer" });
        }
        let blocked = |s: &State| !s.unsafe_may_start() && s.window_requests == since;
        match interrupted {
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

    /// [`Coordinator::wait_no_window`], interruptible: calls `interrupted`
    /// at least every 50 ms while it waits (with the lock released) and
    /// returns [`ProtocolError::Interrupted`] when it says so (this wait
    /// keeps no count, so nothing is undone).
    pub fn wait_no_window_interruptible(&self, interrupted: &dyn Fn() -> bool) -> Result<(), ProtocolError> {
        let g = self.lock();
        if g.owns_window(sync::this_thread()) {
            return Err(ProtocolError::WouldDeadlock { what: "waiting for a transfer" });
        }
        let (_g, stopped) = self.wait_while_interruptible(g, |s| !s.unsafe_may_start(), interrupted);
        if stopped {
            return Err(ProtocolError::Interrupted { what: "capture windows to close" });
        }
        Ok(())
    }

    // ---- pinning (pinner) ----

    /// Pin state right now.
    pub fn pin_state(&self) -> PinState {
        self.lock().pin.clone()
    }

    /// Number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.lock().chunks.len()
    }

    /// Address and length of chunk `i`.
    pub fn chunk_range(&self, i: usize) -> (usize, usize) {
        let g = self.lock();
        (g.chunks[i].addr, g.chunks[i].len)
    }

    /// Registration state of chunk `i`.
    pub fn chunk_reg(&self, i: usize) -> Option<ChunkReg> {
        self.lock().chunks.get(i).map(|c| c.reg)
    }

    /// Chunks registered right now.
    pub fn registered_chunks(&self) -> usize {
        Self::registered(&self.lock())
    }

    /// The pinning state and the chunks registered, read at one moment (a
    /// progress report whose count agrees with its state).
    pub fn pin_snapshot(&self) -> (PinState, usize) {
        let g = self.lock();
        (g.pin.clone(), Self::registered(&g))
    }

    fn registered(g: &State) -> usize {
        g.chunks.iter().filter(|c| matches!(c.reg, ChunkReg::Registered { .. })).count()
    }

    /// Pinning starts; returns false if it was cancelled before starting.
    pub fn pin_begin(&self) -> bool {
        let mut g = self.lock();
        if g.cancel_pin || g.pin != PinState::Pending {
            return false;
        }
        g.pin = PinState::Pinning { done: 0, total: g.chunks.len() };
        self.shared.cv.notify_all();
        true
    }

    /// True once a cancel (or shutdown) asked pinning to stop.
    pub fn pin_cancelled(&self) -> bool {
        self.lock().cancel_pin
    }

    /// Asks pinning to stop at the next chunk boundary and roll back.
    pub fn cancel_pinning(&self) {
        self.shared.update(|g| g.cancel_pin = true);
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
    pub fn hold_pinning(&self) -> PinHold {
        let me = sync::this_thread();
        self.shared.update(|g| g.pin_holds.push(me));
        tracing::debug!("pinning held back");
        PinHold { shared: self.shared.clone(), owner: me }
    }

    /// Registers chunk `i` (and looks up its device alias) as a
    /// capture-unsafe call, once no pin hold lives
    /// ([`Coordinator::hold_pinning`]); a registration held back and then
    /// released by a cancel of pinning is [`ProtocolError::Interrupted`]
    /// (never started).
    pub fn register_chunk(&self, rt: &dyn GpuRuntime, i: usize) -> Result<Result<(), DriverError>, ProtocolError> {
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
        let mut g = self.lock();
        if g.owns_window(sync::this_thread()) && !bad!(g, NoCaptureWindow) {
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
                g = self.wait(g);
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
            g = self.wait(g);
            g.unsafe_waiting -= 1;
        }
        Ok(self.counted(g, register, record).map(|_| ()))
    }

    /// Unregisters chunk `i`: no new gather users from now on, waits for
    /// the current ones, then unregisters as a capture-unsafe call.
    pub fn unregister_chunk(&self, rt: &dyn GpuRuntime, i: usize) -> Result<Result<(), DriverError>, ProtocolError> {
        let addr = {
            let mut g = self.lock();
            if g.chunks[i].reg == ChunkReg::Unregistered {
                return Ok(Ok(()));
            }
            g.chunks[i].reg = ChunkReg::Unregistering;
            g.unregisters_waiting += 1;
            while g.chunks[i].users > 0 {
                g = self.wait(g);
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
        self.unsafe_call_then("unregistering a chunk", |gate| rt.host_unregister(gate, addr), record)
    }

    /// Pinning reached its final state.
    pub fn pin_finish(&self, state: PinState) {
        debug_assert!(state.is_final());
        tracing::info!(?state, "pinning finished");
        self.shared.update(|g| g.pin = state);
    }

    /// Blocks until pinning is final. Inside one's own window with the
    /// Interleave policy that would never return: typed error instead.
    pub fn wait_pin_final(&self) -> Result<PinState, ProtocolError> {
        let mut g = self.lock();
        if g.owns_window(sync::this_thread()) && !g.pin.is_final() && !bad!(g, WaitInsideWindow) {
            return Err(ProtocolError::WouldDeadlock { what: "waiting for pinning" });
        }
        if g.pin_holds.contains(&sync::this_thread()) && !g.pin.is_final() {
            return Err(ProtocolError::WouldDeadlock { what: "waiting for pinning while this thread holds it back" });
        }
        g.pin_waiters += 1;
        while !g.pin.is_final() {
            g = self.wait(g);
        }
        g.pin_waiters -= 1;
        Ok(g.pin.clone())
    }

    /// [`Coordinator::wait_pin_final`], interruptible: calls `interrupted`
    /// at least every 50 ms while it waits (with the lock released) and,
    /// when it says so, stops counting itself as a pin waiter
    /// ([`Activity::pin_waiters`] as before the call) and returns
    /// [`ProtocolError::Interrupted`]. Pinning goes on (this only waits for
    /// it). Refused like the blocking form inside one's own window.
    pub fn wait_pin_final_interruptible(&self, interrupted: &dyn Fn() -> bool) -> Result<PinState, ProtocolError> {
        let mut g = self.lock();
        if g.owns_window(sync::this_thread()) && !g.pin.is_final() && !bad!(g, WaitInsideWindow) {
            return Err(ProtocolError::WouldDeadlock { what: "waiting for pinning" });
        }
        if g.pin_holds.contains(&sync::this_thread()) && !g.pin.is_final() {
            return Err(ProtocolError::WouldDeadlock { what: "waiting for pinning while this thread holds it back" });
        }
        g.pin_waiters += 1;
        let (mut g, stopped) = self.wait_while_interruptible(g, |s| !s.pin.is_final(), interrupted);
        g.pin_waiters -= 1;
        if stopped {
            self.shared.cv.notify_all();
            return Err(ProtocolError::Interrupted { what: "pinning" });
        }
        Ok(g.pin.clone())
    }

    // ---- gather kernel (transfer engine) ----

    /// The device alias of `[addr, addr+len)` if it lies in one registered
    /// chunk; the chunk stays registered while the guard lives.
    pub fn acquire_alias(&self, addr: usize, len: usize) -> Option<AliasGuard> {
        let mut g = self.lock();
        let unchecked = bad!(g, UncheckedGather);
        let i = g.chunks.iter().position(|c| addr >= c.addr && addr + len <= c.addr + c.len)?;
        let c = &mut g.chunks[i];
        let base = match c.reg {
            ChunkReg::Registered { alias } => alias,
            // N4: hand out the host address as if it were registered.
            _ if unchecked => DevicePtr(c.addr as u64 | (1 << 62)),
            _ => return None,
        };
        c.users += 1;
        let device = base.offset(addr - c.addr);
        Some(AliasGuard { coord: self.shared.clone(), chunk: i, device })
    }

    // ---- jobs, graphs, shutdown (engine) ----

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
        if !bad!(g, NoCaptureWindow) && (g.owns_window(sync::this_thread()) || !g.unsafe_may_start()) {
            return Err(ProtocolError::WindowBusy);
        }
        g.jobs_in_flight += 1;
        let ticket = JobTicket { coord: self.shared.clone() };
        Ok(self.counted(g, |gate| f(gate, ticket), |_, _| {}))
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

    /// First half of shutdown ([`Coordinator::close`], then
    /// [`Coordinator::drain`]): refuses (typed, nothing changed) while a
    /// window is open or registered graphs live; otherwise refuses all new
    /// work, asks pinning to stop, and waits for in-flight jobs and for
    /// pinning to settle. Afterwards the caller unregisters every chunk
    /// ([`Coordinator::unregister_all`]), unmaps and unlinks.
    pub fn begin_shutdown(&self) -> Result<(), ProtocolError> {
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
        let mut g = self.lock();
        match g.phase {
            Phase::Running => {}
            _ => return Err(ProtocolError::AlreadyShutDown),
        }
        if bad!(g, RefusalCancelsPinning) {
            g.cancel_pin = true;
        }
        if g.windows_open > 0 {
            return Err(ProtocolError::WindowOpen { open: g.windows_open });
        }
        if g.graphs_live > 0 && !bad!(g, IgnoreLiveGraphs) {
            return Err(ProtocolError::GraphsAlive { live: g.graphs_live });
        }
        g.phase = Phase::ShuttingDown;
        g.cancel_pin = true;
        if g.pin == PinState::Pending {
            g.pin = PinState::Pageable(super::PageableReason::Cancelled);
        }
        self.shared.cv.notify_all();
        tracing::info!(jobs = g.jobs_in_flight, pin = ?g.pin, "shutdown: closed to new work");
        Ok(())
    }

    /// After [`Coordinator::close`]: waits until every admitted job's ticket
    /// is gone and pinning is final.
    pub fn drain(&self) {
        let mut g = self.lock();
        debug_assert!(g.phase != Phase::Running, "drain before close");
        tracing::info!(jobs = g.jobs_in_flight, pin = ?g.pin, "shutdown: draining");
        if !bad!(g, NoDrainBeforeUnregister) {
            while g.jobs_in_flight > 0 {
                g = self.wait(g);
            }
        }
        if !bad!(g, ShutdownSkipsPinWait) {
            while !g.pin.is_final() {
                g = self.wait(g);
            }
        }
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

    /// True once shutdown began.
    pub fn shutting_down(&self) -> bool {
        self.lock().phase != Phase::Running
    }
}
