//! The coordinator: one lock and one condition variable that every party
//! of the capture-safety protocol goes through.
//!
//! Parties: the engine (opens capture windows, registers graphs, submits
//! jobs, shuts down), the pinner (registers and unregisters chunks), the
//! transfer engine (admits jobs, polls events, launches the gather kernel
//! on registered chunks). One `State` under one mutex and one condition
//! variable (`Shared`, this file); the files beside it hold the parties'
//! operations on that state, each with its rules at the top:
//!
//! - `window.rs`: capture windows and graphs ([`Coordinator::open_window`],
//!   [`Coordinator::wait_no_window`], [`Coordinator::register_graph`]);
//! - `call.rs`: capture-unsafe library calls, job admission and the gather
//!   kernel's aliases ([`Coordinator::unsafe_call`],
//!   [`Coordinator::admit_job`], [`Coordinator::acquire_alias`]);
//! - `pinning.rs`: chunk registration, pin holds and the waits for pinning
//!   ([`Coordinator::pinning`], a [`Pinning`] view);
//! - `shutdown.rs`: the shutdown order's steps
//!   ([`Coordinator::shutdown_steps`], a [`ShutdownSteps`] view);
//! - `variant.rs`: the negative models' handles, model builds only
//!   (`Coordinator::set_variant`, `Coordinator::forged_gate`).
//!
//! At each place a negative model breaks one of the rules below, the
//! operations here call the method of `crate::rules::Rules` named for the
//! rule (through `State::rules` under the lock, `Coordinator::rules`
//! outside it), handing it the steps it orders or decides on; outside
//! model builds those are the shipped rules, zero-sized and inlined, and no
//! negative is compiled.
//!
//! Every wait and window takes a [`Request`]: whether a window opens under
//! the Interleave rules, an interrupt check, and (model builds) a hook at
//! the request. The rules, each the argument of a property in
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
//!   ([`Request::interleaved`], the capture hook's): it
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
//! - While a pin hold lives ([`Pinning::hold`]: an engine's
//!   capture phase), no chunk registration starts: at most the one in
//!   flight when it was taken completes. A registration held back waits
//!   uncounted (it takes no window's turn); cancelling pinning releases it
//!   (shutdown is never held up), and a holder's own wait for pinning is a
//!   typed error (P2, model/p2_pin_hold.rs).
//! - A wait asked for with an interruptible request
//!   ([`Request::interruptible`]: [`Coordinator::open_window`],
//!   [`Coordinator::unsafe_call`], [`Coordinator::wait_no_window`],
//!   [`Pinning::wait_final`]) waits for what the blocking request waits
//!   for, on the condition variable in slices of at
//!   most 50 ms, and calls its `interrupted` check between slices with
//!   the lock released (it may take other locks: the Python front takes
//!   the GIL, which Python threads hold while they take this lock). An
//!   interrupted wait leaves no trace: a window request is withdrawn
//!   before it opened (`windows_waiting` back, waiters woken), a pin waiter
//!   uncounted. P1 and P2 are about windows that open, so they are
//!   untouched; for P6 a withdrawn request is a release that wakes the
//!   library calls it held back. A blocking request waits as before. In the
//!   model builds a slice ends at a wake-up of the condition variable
//!   (`sync::Slice`: loom and shuttle model no time), so the models run
//!   the interruptible requests too (model/p6_interruptible.rs).

use crate::rules::{Active, Rules};
use crate::runtime::{CoordinatorId, GateBinding, GateSeal, GpuRuntime};
use crate::sync::{self, thread, Arc, Condvar, Mutex, MutexGuard};

mod call;
mod pinning;
mod shutdown;
#[cfg(any(loom, shuttle))]
mod variant;
mod window;

pub use call::{AliasGuard, JobTicket};
use pinning::Chunk;
pub use pinning::{ChunkReg, PinHold, Pinning};
pub use shutdown::ShutdownSteps;
pub use window::{CaptureWindow, GraphToken};

use super::error::{PinState, ProtocolError};
use super::Request;
use crate::names::named;

/// The process's one gate seal: only this module can make a [`Gate`](crate::runtime::Gate)
/// (`runtime::gate` explains the seal). Taken the first time a coordinator
/// is made; if anything else took it first, that is a bug this panic names
/// at once, in every test that makes a coordinator.
// Not synchronisation between library threads: initialised once, then only
// read (std's, so that loom does not explore its initialisation).
#[allow(clippy::disallowed_types)]
static SEAL: std::sync::LazyLock<GateSeal> =
    std::sync::LazyLock::new(|| GateSeal::take().expect("the gate seal was taken outside the coordinator's module"));

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

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Phase {
    Running,
    /// Shutdown began: new work is refused (it stays so once shutdown
    /// completed: nothing tells the two apart).
    ShuttingDown,
}

struct State {
    policy: CapturePolicy,
    /// The rules the coordinator runs under its lock (`crate::rules`):
    /// [`Shipped`](crate::rules::Shipped), zero-sized, outside model
    /// builds; in them, the variant a model selected
    /// (`Coordinator::set_variant`), as in `Shared::knob`.
    rules: Active,
    pin: PinState,
    cancel_pin: bool,
    /// The threads that took the pin holds alive ([`Pinning::hold`]),
    /// one entry per hold: while any lives, no registration starts.
    pin_holds: Vec<thread::ThreadId>,
    /// Registrations waiting for the pin holds to go.
    registrations_held: usize,
    windows_open: usize,
    window_owners: Vec<thread::ThreadId>,
    windows_waiting: usize,
    /// Window requests counted since the coordinator was made (each one
    /// that got past `open_window_inner`'s checks, opened or not):
    /// [`Coordinator::wait_no_window`] with a `since` ends at a new one.
    window_requests: u64,
    /// Of `windows_waiting`, the requests that open under the Interleave
    /// rules whatever `policy` ([`Request::interleaved`]).
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
    /// Threads in [`Pinning::wait_final`] waiting for pinning.
    pin_waiters: usize,
    /// Threads in [`Pinning::unregister_chunk`] waiting for a chunk's
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
    /// a request with [`Request::interleaved`]).
    fn request_could_open(&self, interleave: bool) -> bool {
        interleave || self.window_could_open()
    }

    /// Whether some waiting request could open by the policy alone (then
    /// library calls take turns with it).
    fn some_request_could_open(&self) -> bool {
        self.interleave_waiting > 0 || self.window_could_open()
    }

    fn window_may_open(&self, interleave: bool) -> bool {
        self.rules.windows_exclude_calls(|| {
            self.unsafe_in_flight == 0
                && self.request_could_open(interleave)
                && (self.unsafe_waiting == 0 || self.turn == Turn::Window)
        })
    }

    fn unsafe_may_start(&self) -> bool {
        self.rules.windows_exclude_calls(|| {
            self.windows_open == 0
                && (self.windows_waiting == 0 || !self.some_request_could_open() || self.turn == Turn::Library)
        })
    }

    /// A library call of thread `me` may go on rather than be refused: it
    /// is not inside its own window (where it would wait for itself).
    fn outside_own_window(&self, me: thread::ThreadId) -> bool {
        self.rules.windows_exclude_calls(|| !self.owns_window(me))
    }

    fn owns_window(&self, me: thread::ThreadId) -> bool {
        self.window_owners.contains(&me)
    }

    /// A registration may not start: pinning is held and not cancelled.
    fn pin_held(&self) -> bool {
        self.rules.registration_heeds_hold(|| !self.pin_holds.is_empty() && !self.cancel_pin)
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
    /// Pin holds alive ([`Pinning::hold`]).
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

    /// A guard's release: changes the state and wakes every waiter
    /// (`Rules::release_wakes`; model/p6_liveness.rs shows each guard's
    /// own wake-up is what releases its waiter).
    fn release(&self, f: impl FnOnce(&mut State)) {
        let mut g = self.lock();
        f(&mut g);
        g.rules.release_wakes(|| self.cv.notify_all());
    }
}

impl Coordinator {
    /// A coordinator with no host memory to register: capture windows, the
    /// gate for capture-unsafe calls, jobs and shutdown, nothing to pin (its
    /// pin state starts `Pending`; [`Pinning::begin`] on no chunks
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
    /// unregistered again (after [`Pinning::unregister_all`], or a
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
                    rules: Active::default(),
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
                g.rules.interrupt_check_starts_slice(|| slice = sync::Slice::start());
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

    /// The rules this coordinator and its parties run (`crate::rules`),
    /// read without the coordinator's lock: the shipped ones outside model
    /// builds, where this is zero-sized.
    pub(crate) fn rules(&self) -> Active {
        self.shared.knob.rules()
    }
}
