//! A GPU simulated on host memory, faithful to the driver rules measured on
//! an H200 (docs/driver-rules.md).
//!
//! - Streams execute asynchronously and in order on a device thread
//!   (`device.rs`); events complete when the work recorded before them does.
//! - Capture records stream work into a graph that can be replayed; the
//!   capture rules of `rules.rs` decide which calls fail with 900 and
//!   invalidate a capture. They deny by default: during another thread's
//!   GLOBAL capture, a call without a measured row in `rules::MEASURED`
//!   is refused, as is any call on a stream taking part in another
//!   thread's capture; every refusal names its rule
//!   ([`SimRuntime::refusals`]).
//! - A stream waiting on an event recorded in a capture joins it; ending
//!   the capture while a joined stream has not rejoined fails with 904.
//! - A capture-unsafe call whose `Gate` is not in flight on the calling
//!   thread (not made by the coordinator's gate) stops the program with
//!   "capture-unsafe call outside the gate: `<call>`".
//! - `begin_capture` blocks while a registration runs (enqueues onto a
//!   capturing stream do not: measured, docs/facts-deltas.md); `host_unregister` waits for the device to go idle;
//!   replaying a graph whose registered host memory was unregistered
//!   poisons the context with 719; a batched copy inside a capture returns
//!   900 and is silently absent from the graph.
//! - Host memory the caller owns can be adopted as device memory in place
//!   ([`SimRuntime::adopt_host_memory`], not a driver call: for tests of
//!   engines whose tensors are CPU tensors); device work on it reads and
//!   writes those host bytes; [`SimRuntime::release_adopted`] waits for the
//!   device like `mem_free`.
//! - Faults ([`SimFault`]) and hold points ([`Hold`]) let tests fail a
//!   registration or copy and stop a call mid-way, deterministically.
//!
//! All state sits behind one mutex and one condition variable from
//! [`crate::sync`], so the same code runs under loom.

mod controls;
mod device;
mod fault;
mod memory;
mod rules;
mod state;

pub use controls::Hold;
pub use fault::{HoldPoint, SimFault};
pub use state::Blocked;
pub use state::Refusal;

use crate::runtime::{
    CaptureMode, CaptureStatus, Code, DevicePtr, Direction, DriverError, DriverResult, Event, Fragment, Gate,
    GateBinding, GpuRuntime, Graph, Kernel, Stream,
};
use crate::sync::{self, thread, Arc, Condvar, Mutex, MutexGuard};

use fault::HoldSlot;
use rules::Call;
use state::{Capture, CapturedRecord, DeviceMem, EventState, GraphBody, Join, Op, State, StreamState, HOST_ALIAS_BIT};

/// What [`GpuRuntime::describe`] says of every simulated GPU.
pub const DESCRIPTION: &str = "simulated GPU (driver rules of docs/driver-rules.md)";

/// Settings of a simulated GPU.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Device memory the simulated `cuMemAlloc` hands out before it answers
    /// OUT_OF_MEMORY. Memory is allocated lazily (zeroed pages). The sim
    /// also answers OUT_OF_MEMORY, from `cuMemAlloc` and `cuMemAllocHost`,
    /// where this host cannot back the request: its device and page-locked
    /// host memory are host memory of this process, and together they stay
    /// within what the process can get
    /// ([`crate::region::limits::available_memory`], read at allocation
    /// time and cached; not read under loom).
    pub device_bytes: usize,
    /// What the process can get, in bytes, in place of the host's reading:
    /// a fixed bound on the sim's device and page-locked host memory
    /// together (tests use it to reach the host's limit without using the
    /// memory). `None` (the default): the host's reading.
    pub host_limit: Option<usize>,
    /// Device workers: threads that each take the next ready operation of
    /// any stream whose previous operation has finished. With 1 (the
    /// default) the device runs one operation at a time, and when several
    /// streams have work ready the oldest stream goes first. With 2 or more,
    /// operations of different streams run at the same time and finish in
    /// any order, as on a GPU, and loom explores those orders too (each
    /// worker is one more thread for loom; a [`HoldPoint::DeviceOp`] hold
    /// then stops one worker, not the device). The memory actions of two
    /// operations never overlap in time (the sim's device memory is host
    /// memory, where two streams writing the same bytes would be a data
    /// race of the sim itself).
    pub workers: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig { device_bytes: 64 << 30, host_limit: None, workers: 1 }
    }
}

pub(crate) struct Inner {
    state: Mutex<State>,
    cv: Condvar,
    /// Held while the sim reads or writes its device memory outside the
    /// state lock (std builds only, see [`Inner::touching_memory`]).
    #[cfg(not(any(loom, shuttle)))]
    exec: Mutex<()>,
}

/// What [`Inner::touching_memory`] returns under loom: nothing to hold.
#[cfg(any(loom, shuttle))]
pub(crate) struct NoGuard;

impl Inner {
    /// Taken, after the state lock when both are, around every read or
    /// write of the sim's device memory by a device worker (its tables and
    /// its memory actions) or a synchronous copy. Operations of two streams
    /// may touch the same bytes: on a GPU a race in the program, here (the
    /// sim's device memory is host memory) a data race of the sim itself,
    /// reachable with several workers (`SimConfig::workers`) even through
    /// a safe `graph_launch`. So the memory actions of two operations never
    /// overlap in time; workers still take, finish and complete operations
    /// in any order. Under loom the threads never run at once (an action
    /// has no loom operation in it, so it is atomic there) and the lock
    /// would only add interleavings: it is left out.
    #[cfg(not(any(loom, shuttle)))]
    pub(crate) fn touching_memory(&self) -> MutexGuard<'_, ()> {
        sync::lock(&self.exec)
    }

    /// See the std build's `touching_memory`.
    #[cfg(any(loom, shuttle))]
    pub(crate) fn touching_memory(&self) -> NoGuard {
        NoGuard
    }

    /// Stops at `point` if a hold is armed there, until it is released.
    fn hold_at<'a>(&self, mut g: MutexGuard<'a, State>, point: HoldPoint) -> MutexGuard<'a, State> {
        if let Some(id) = g.faults.enter_hold(point) {
            self.cv.notify_all();
            while !g.faults.hold(id).is_none_or(|h| h.released) {
                g = sync::wait(&self.cv, g);
            }
            g.faults.holds.retain(|h| h.id != id);
        }
        g
    }

    /// Waits until `cond` holds, counted as blocked in `kind` meanwhile.
    fn wait_until<'a>(
        &self,
        mut g: MutexGuard<'a, State>,
        kind: Blocked,
        cond: impl Fn(&State) -> bool,
    ) -> MutexGuard<'a, State> {
        if cond(&g) {
            return g;
        }
        g.blocked.push(kind);
        self.cv.notify_all();
        while !cond(&g) {
            g = sync::wait(&self.cv, g);
        }
        g.unblock(kind);
        g
    }
}

/// The simulated GPU, through one runtime handle. Dropping the last handle
/// on the device stops its device threads.
pub struct SimRuntime {
    inner: Arc<Inner>,
    device: Arc<DeviceThreads>,
    /// Whose gates the capture-unsafe operations of this handle accept.
    binding: GateBinding,
}

/// The device's worker threads, stopped and joined when the last handle on
/// the device is gone.
struct DeviceThreads {
    inner: Arc<Inner>,
    workers: Mutex<Vec<thread::JoinHandle<()>>>,
}

fn traced<T: std::fmt::Debug>(call: &'static str, r: Result<T, Code>) -> DriverResult<T> {
    match r {
        Ok(v) => {
            tracing::debug!(call, result = ?v, "sim driver call");
            Ok(v)
        }
        Err(code) => {
            tracing::debug!(call, %code, "sim driver call failed");
            Err(DriverError::new(call, code))
        }
    }
}

fn live(st: &State) -> Result<(), Code> {
    match st.poisoned {
        Some(c) => Err(c),
        None => Ok(()),
    }
}

impl SimRuntime {
    /// A simulated GPU with default settings.
    pub fn new() -> Self {
        Self::with_config(SimConfig::default())
    }

    /// A simulated GPU with the settings of `cfg`. Starts the simulated
    /// device's worker threads (from the sync facade, so loom schedules
    /// them; at least one); they run until the runtime is dropped.
    pub fn with_config(cfg: SimConfig) -> Self {
        let inner = Arc::new(Inner {
            state: Mutex::new(State::new(cfg.device_bytes, memory::HostBudget::new(cfg.host_limit))),
            cv: Condvar::new(),
            #[cfg(not(any(loom, shuttle)))]
            exec: Mutex::new(()),
        });
        let workers = (0..cfg.workers.max(1))
            .map(|_| {
                let worker = inner.clone();
                thread::spawn(move || device::run(worker))
            })
            .collect();
        let device = Arc::new(DeviceThreads { inner: inner.clone(), workers: Mutex::new(workers) });
        SimRuntime { inner, device, binding: GateBinding::new() }
    }

    /// Another runtime handle on the same simulated device, as a second
    /// engine process (a rank of the node) opens its own: the same memory,
    /// streams, registrations and capture rules, but its own gate binding,
    /// so it takes a coordinator of its own. (Capture rules are shared
    /// across handles, which is stricter than two processes on a real GPU.)
    pub fn another_handle(&self) -> SimRuntime {
        SimRuntime { inner: self.inner.clone(), device: self.device.clone(), binding: GateBinding::new() }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        sync::lock(&self.inner.state)
    }

    /// Starts a driver call: takes the lock, fails with the sticky error of
    /// a poisoned context, and applies the capture rules to `call`, which
    /// touches the streams `touched` (`rules::check`).
    fn enter(&self, call: Call, touched: &[Stream]) -> Result<MutexGuard<'_, State>, Code> {
        let mut g = self.state();
        live(&g)?;
        let ids: Vec<u64> = touched.iter().map(|s| s.0).collect();
        apply_rules(&mut g, call, &ids)?;
        Ok(g)
    }

    /// Starts an allocation `call` (`cuMemAlloc`, `cuMemAllocHost`) of
    /// `bytes`: [`Self::enter`], then `bytes` of zeroed memory, refused as
    /// the driver refuses: none asked, INVALID_VALUE; past what `fits` allows
    /// or what this host can back (docs/driver-rules.md, "Allocation past
    /// the memory there is"), OUT_OF_MEMORY, nothing changed.
    fn enter_alloc(
        &self,
        call: Call,
        bytes: usize,
        fits: impl FnOnce(&State) -> bool,
    ) -> Result<(MutexGuard<'_, State>, Vec<u8>), Code> {
        let mut g = self.enter(call, &[])?;
        if bytes == 0 {
            return Err(Code::INVALID_VALUE);
        }
        if !fits(&g) || !g.host_can_back(bytes) {
            return Err(Code::OUT_OF_MEMORY);
        }
        let mem = memory::zeroed(bytes).ok_or(Code::OUT_OF_MEMORY)?;
        Ok((g, mem))
    }

    /// A capture-unsafe call must come with a gate in flight on the calling
    /// thread (`Gate::in_flight_here`): the coordinator's gate, not a forged
    /// one. Failing this is a bug in the model or the library, not a driver
    /// behaviour, so the simulated GPU stops the run. A gate of another
    /// coordinator than the one bound to this runtime is refused
    /// (`Code::GATE_REFUSED`), as the CUDA runtime refuses it, before
    /// anything else happens.
    fn gated(&self, gate: &Gate, call: Call) -> DriverResult<()> {
        if !gate.in_flight_here() {
            panic!("capture-unsafe call outside the gate: {}", call.driver_name());
        }
        self.binding.check(gate, call.driver_name())
    }

    /// `cuMemFree` and `cuMemFreeHost`: gated; INVALID_VALUE unless `owns`
    /// says the pointer is one this call frees; then it waits until the
    /// device is idle (docs/driver-rules.md, row "Free waits for the
    /// device": a free never pulls memory from under queued work) and
    /// `release`s the memory.
    fn free_when_idle(
        &self,
        gate: &Gate,
        call: Call,
        owns: impl Fn(&State) -> bool,
        release: impl FnOnce(&mut State),
    ) -> DriverResult<()> {
        self.gated(gate, call)?;
        let r = (|| {
            let g = self.enter(call, &[])?;
            if !owns(&g) {
                return Err(Code::INVALID_VALUE);
            }
            let mut g = self.inner.wait_until(g, Blocked::Idle, State::idle);
            release(&mut g);
            Ok(())
        })();
        traced(call.driver_name(), r)
    }

    /// Adds `op` to `stream`: executed later by the device, or recorded into
    /// the stream's capture.
    fn enqueue<'a>(&'a self, mut g: MutexGuard<'a, State>, stream: Stream, op: Op) -> Result<(), Code> {
        g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?;
        if let Some(origin) = g.capture_origin(stream.0) {
            // An enqueue onto a THREAD_LOCAL or RELAXED capture does not
            // block while another thread registers (docs/driver-rules.md,
            // row "Registration beside a THREAD_LOCAL or RELAXED capture",
            // measured against the fact sheet: docs/facts-deltas.md). Work on a stream that joined a capture is
            // recorded into the origin's capture (cross-stream capture).
            let refs = host_ref(&g, &op);
            let c = g.stream_mut(origin).and_then(|s| s.capture.as_mut()).ok_or(Code::INVALID_HANDLE)?;
            if c.invalidated {
                return Err(Code::STREAM_CAPTURE_INVALIDATED);
            }
            c.body.registered_refs.extend(refs);
            c.body.ops.push(op);
            if let Some(j) = g.stream_mut(stream.0).and_then(|s| s.joined.as_mut()) {
                j.ops += 1;
                j.rejoined = false;
            }
            return Ok(());
        }
        g.queue_op(stream.0, op)?;
        self.inner.cv.notify_all();
        Ok(())
    }

    fn check_device(g: &mut State, ptr: DevicePtr, bytes: usize) -> Result<(), Code> {
        if bytes == 0 || g.device_slice(ptr, bytes).is_none() {
            return Err(Code::INVALID_VALUE);
        }
        Ok(())
    }

    fn copy_async(&self, call: Call, op: Op, stream: Stream) -> Result<(), Code> {
        let mut g = self.enter(call, &[stream])?;
        if let Some(code) = g.faults.on_copy() {
            return Err(code);
        }
        let host = match op {
            Op::HtoD { dst, src, bytes } => {
                Self::check_device(&mut g, dst, bytes)?;
                Some((src, bytes))
            }
            Op::DtoH { dst, src, bytes } => {
                Self::check_device(&mut g, src, bytes)?;
                Some((dst, bytes))
            }
            _ => None,
        };
        if let Some((addr, bytes)) = host {
            if bytes > 0 && g.registered_range(addr, bytes).is_none() {
                g.pageable_async_copies += 1;
            }
        }
        self.enqueue(g, stream, op)
    }

    /// `cuEventCreate`: a new event in state `st`.
    fn new_event(&self, st: EventState) -> DriverResult<Event> {
        let r = (|| {
            let mut g = self.enter(Call::EventCreate, &[])?;
            let id = g.fresh_id();
            g.events.insert(id, st);
            Ok(Event(id))
        })();
        traced("cuEventCreate", r)
    }

    /// Destroys a handle (`call`, traced as `name`): `remove` takes it out
    /// of its table, `None` when the table has no such handle
    /// (INVALID_HANDLE).
    fn destroy(
        &self,
        call: Call,
        name: &'static str,
        remove: impl FnOnce(&mut State) -> Option<()>,
    ) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(call, &[])?;
            remove(&mut g).ok_or(Code::INVALID_HANDLE)
        })();
        traced(name, r)
    }

    /// Waits until `stream` has finished everything enqueued so far,
    /// counted as blocked in [`Blocked::Stream`] meanwhile.
    fn drain<'a>(&'a self, g: MutexGuard<'a, State>, stream: u64) -> MutexGuard<'a, State> {
        self.inner
            .wait_until(g, Blocked::Stream, |st| st.device_stream(stream).is_none_or(|s| s.completed >= s.enqueued))
    }
}

impl Default for SimRuntime {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for DeviceThreads {
    fn drop(&mut self) {
        {
            let mut g = sync::lock(&self.inner.state);
            g.stop = true;
            self.inner.cv.notify_all();
        }
        for h in std::mem::take(&mut *sync::lock(&self.workers)) {
            // A device thread only exits its loop; a panic there is a bug in
            // the simulator that the join surfaces in tests.
            if h.join().is_err() {
                tracing::error!("sim: device thread panicked");
            }
        }
    }
}

/// Host ranges an operation touches that are registered right now (a
/// captured graph depends on them staying registered).
fn host_ref(st: &State, op: &Op) -> Option<(usize, usize)> {
    match *op {
        Op::HtoD { src, bytes, .. } => st.registered_range(src, bytes),
        Op::DtoH { dst, bytes, .. } => st.registered_range(dst, bytes),
        _ => None,
    }
}

impl State {
    /// Counts `op` in [`State::pageable_copies`] if it is a copy whose host
    /// side is not page-locked now.
    fn count_pageable(&mut self, op: &Op) {
        if matches!(op, Op::HtoD { .. } | Op::DtoH { .. }) && host_ref(self, op).is_none() {
            self.pageable_copies += 1;
        }
    }

    /// Appends `op` to the queue of `stream` (INVALID_HANDLE when there is
    /// no such stream), counted by [`State::count_pageable`] first.
    fn queue_op(&mut self, stream: u64, op: Op) -> Result<(), Code> {
        self.count_pageable(&op);
        let s = self.stream_mut(stream).ok_or(Code::INVALID_HANDLE)?;
        s.enqueued += 1;
        let seq = s.enqueued;
        s.queue.push_back((seq, op));
        Ok(())
    }
}

/// [`rules::check`], with the refusal recorded for [`SimRuntime::refusals`]
/// and turned into the driver's code (900).
fn apply_rules(g: &mut State, call: Call, touched: &[u64]) -> Result<(), Code> {
    match rules::check(g, sync::this_thread(), call, touched) {
        Ok(()) => Ok(()),
        Err(r) => {
            g.refusals.push(r);
            Err(rules::REFUSED)
        }
    }
}

impl GpuRuntime for SimRuntime {
    fn backend(&self) -> &'static str {
        "sim"
    }

    fn describe(&self) -> String {
        DESCRIPTION.to_string()
    }

    fn as_sim(&self) -> Option<&SimRuntime> {
        Some(self)
    }

    fn gate_binding(&self) -> &GateBinding {
        &self.binding
    }

    unsafe fn host_register(&self, gate: &Gate, addr: usize, len: usize) -> DriverResult<()> {
        self.gated(gate, Call::HostRegister)?;
        let r = (|| {
            let mut g = self.state();
            live(&g)?;
            if addr == 0 || len == 0 {
                return Err(Code::INVALID_VALUE);
            }
            if let Some(code) = g.faults.on_register() {
                return Err(code);
            }
            apply_rules(&mut g, Call::HostRegister, &[])?;
            if g.overlaps_registration(addr, len) {
                return Err(Code::HOST_MEMORY_ALREADY_REGISTERED);
            }
            // Adopted host memory is device memory now
            // (`SimRuntime::adopt_host_memory`): not host memory to pin.
            if g.overlaps_adoption(addr, len) {
                return Err(Code::INVALID_VALUE);
            }
            g.registers_running += 1;
            g = self.inner.hold_at(g, HoldPoint::Register);
            // The lock is let go while the pages are "pinned", as in the real
            // driver: other threads (a capture starting) run meanwhile.
            drop(g);
            let mut g = self.state();
            g.registers_running -= 1;
            g.registered.insert(addr, len);
            g.registrations_completed += 1;
            self.inner.cv.notify_all();
            Ok(())
        })();
        traced("cuMemHostRegister", r)
    }

    fn host_unregister(&self, gate: &Gate, addr: usize) -> DriverResult<()> {
        self.gated(gate, Call::HostUnregister)?;
        let r = (|| {
            let g = self.enter(Call::HostUnregister, &[])?;
            if !g.registered.contains_key(&addr) || g.host_allocs.contains_key(&addr) {
                return Err(Code::HOST_MEMORY_NOT_REGISTERED);
            }
            // Unregister waits for the device to go idle (docs/driver-rules.md,
            // row "Unregister waits for the device": 1.000 s behind a 1 s
            // kernel).
            let mut g = self.inner.wait_until(g, Blocked::Idle, State::idle);
            g.registered.remove(&addr);
            self.inner.cv.notify_all();
            Ok(())
        })();
        traced("cuMemHostUnregister", r)
    }

    fn host_device_ptr(&self, addr: usize) -> DriverResult<DevicePtr> {
        let r = (|| {
            let g = self.enter(Call::HostDevicePtr, &[])?;
            g.registered_range(addr, 1).ok_or(Code::INVALID_VALUE)?;
            Ok(DevicePtr(HOST_ALIAS_BIT | addr as u64))
        })();
        traced("cuMemHostGetDevicePointer", r)
    }

    fn mem_alloc(&self, gate: &Gate, bytes: usize) -> DriverResult<DevicePtr> {
        self.gated(gate, Call::MemAlloc)?;
        let r = (|| {
            // Past the configured device memory too.
            let fits = |g: &State| g.device_used.saturating_add(bytes) <= g.device_limit;
            let (mut g, mem) = self.enter_alloc(Call::MemAlloc, bytes, fits)?;
            let p = g.fresh_device_addr(bytes);
            g.device_mem.insert(p, DeviceMem::Owned(mem));
            g.device_used += bytes;
            g.device_peak = g.device_peak.max(g.device_used);
            Ok(p)
        })();
        traced("cuMemAlloc", r)
    }

    unsafe fn mem_free(&self, gate: &Gate, ptr: DevicePtr) -> DriverResult<()> {
        // Adopted host memory is not the driver's to free
        // (`SimRuntime::release_adopted` ends it).
        let owns = |st: &State| matches!(st.device_mem.get(&ptr), Some(DeviceMem::Owned(_)));
        self.free_when_idle(gate, Call::MemFree, owns, |st| {
            let freed = st.device_mem.remove(&ptr).map_or(0, |m| m.len());
            st.device_used -= freed;
        })
    }

    fn mem_alloc_host(&self, gate: &Gate, bytes: usize) -> DriverResult<usize> {
        self.gated(gate, Call::MemAllocHost)?;
        let r = (|| {
            let (mut g, mut buf) = self.enter_alloc(Call::MemAllocHost, bytes, |_| true)?;
            let addr = buf.as_mut_ptr() as usize;
            g.host_allocs.insert(addr, buf);
            g.host_alloc_used += bytes;
            g.registered.insert(addr, bytes);
            Ok(addr)
        })();
        traced("cuMemAllocHost", r)
    }

    unsafe fn mem_free_host(&self, gate: &Gate, addr: usize) -> DriverResult<()> {
        let owns = |st: &State| st.host_allocs.contains_key(&addr);
        self.free_when_idle(gate, Call::MemFreeHost, owns, |st| {
            st.registered.remove(&addr);
            let freed = st.host_allocs.remove(&addr).map_or(0, |m| m.len());
            st.host_alloc_used -= freed;
        })
    }

    fn stream_create(&self) -> DriverResult<Stream> {
        let r = (|| {
            let mut g = self.enter(Call::StreamCreate, &[])?;
            let id = g.fresh_id();
            g.streams.insert(id, StreamState::default());
            Ok(Stream(id))
        })();
        traced("cuStreamCreate", r)
    }

    fn stream_destroy(&self, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(Call::StreamDestroy, &[stream])?;
            let s = g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?;
            if s.capture.is_some() || s.joined.is_some() {
                return Err(Code::ILLEGAL_STATE);
            }
            // cuStreamDestroy: "in case the device is still doing work in the
            // stream, the function will return immediately and the resources
            // associated with it will be released automatically once the
            // device has completed all work". The handle is invalid at once;
            // the device finishes the queued work (`State::draining`).
            if let Some(s) = g.streams.remove(&stream.0).filter(|s| s.completed < s.enqueued) {
                g.draining.insert(stream.0, s);
            }
            Ok(())
        })();
        traced("cuStreamDestroy", r)
    }

    fn stream_synchronize(&self, gate: &Gate, stream: Stream) -> DriverResult<()> {
        self.gated(gate, Call::StreamSynchronize)?;
        let r = (|| {
            let g = self.enter(Call::StreamSynchronize, &[stream])?;
            if !g.streams.contains_key(&stream.0) {
                return Err(Code::INVALID_HANDLE);
            }
            let g = self.drain(g, stream.0);
            live(&g)
        })();
        traced("cuStreamSynchronize", r)
    }

    fn ctx_synchronize(&self, gate: &Gate) -> DriverResult<()> {
        self.gated(gate, Call::CtxSynchronize)?;
        let r = (|| {
            let g = self.enter(Call::CtxSynchronize, &[])?;
            let g = self.inner.wait_until(g, Blocked::Idle, State::idle);
            live(&g)
        })();
        traced("cuCtxSynchronize", r)
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.state();
            live(&g)?;
            let e = g.events.get(&event.0).ok_or(Code::INVALID_HANDLE)?;
            let (recorded, captured) = (e.recorded, e.captured);
            // The streams this wait touches: the waiting one, and for a
            // captured event the stream it was recorded on (an event
            // recorded outside a capture is a plain marker of work, whatever
            // its stream does since).
            let touched: Vec<u64> = std::iter::once(stream.0).chain(captured.map(|c| c.stream)).collect();
            apply_rules(&mut g, Call::StreamWaitEvent, &touched)?;
            g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?;
            if let Some(c) = captured {
                return join_capture(&mut g, stream.0, c);
            }
            match recorded {
                // An event never recorded is complete: nothing to wait for.
                None => Ok(()),
                Some((s, seq)) => self.enqueue(g, stream, Op::WaitEvent { stream: s, seq }),
            }
        })();
        traced("cuStreamWaitEvent", r)
    }

    unsafe fn copy_htod_async(&self, dst: DevicePtr, src: usize, bytes: usize, stream: Stream) -> DriverResult<()> {
        traced("cuMemcpyHtoDAsync", self.copy_async(Call::CopyHtodAsync, Op::HtoD { dst, src, bytes }, stream))
    }

    unsafe fn copy_dtoh_async(&self, dst: usize, src: DevicePtr, bytes: usize, stream: Stream) -> DriverResult<()> {
        traced("cuMemcpyDtoHAsync", self.copy_async(Call::CopyDtohAsync, Op::DtoH { dst, src, bytes }, stream))
    }

    unsafe fn copy_htod(&self, dst: DevicePtr, src: usize, bytes: usize) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(Call::CopyHtod, &[])?;
            let d = g.device_slice(dst, bytes).ok_or(Code::INVALID_VALUE)?;
            let _mem = self.inner.touching_memory();
            // SAFETY: `d` is a bounds-checked live device range (the lock is
            // held, so it cannot be freed meanwhile); the caller promised
            // `src..src+bytes` is readable.
            unsafe { std::ptr::copy(src as *const u8, d, bytes) };
            Ok(())
        })();
        traced("cuMemcpyHtoD", r)
    }

    unsafe fn copy_dtoh(&self, dst: usize, src: DevicePtr, bytes: usize) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(Call::CopyDtoh, &[])?;
            let s = g.device_slice(src, bytes).ok_or(Code::INVALID_VALUE)?;
            let _mem = self.inner.touching_memory();
            // SAFETY: as in copy_htod, with the roles of host and device swapped.
            unsafe { std::ptr::copy(s as *const u8, dst as *mut u8, bytes) };
            Ok(())
        })();
        traced("cuMemcpyDtoH", r)
    }

    unsafe fn copy_batch_async(&self, dir: Direction, fragments: &[Fragment], stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(Call::CopyBatchAsync, &[stream])?;
            if fragments.is_empty() {
                return Err(Code::INVALID_VALUE);
            }
            if let Some(code) = g.faults.on_copy() {
                return Err(code);
            }
            g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?;
            if g.capture_origin(stream.0).is_some() {
                // cuMemcpyBatchAsync inside a capture returns 900, the capture
                // stays valid and the graph copies nothing (docs/driver-rules.md,
                // row "Batched copy inside a capture").
                return Err(Code::STREAM_CAPTURE_UNSUPPORTED);
            }
            for f in fragments {
                Self::check_device(&mut g, f.device, f.bytes)?;
                // A copy's host range lies in one registration or in none:
                // on the H200 (driver 580, CUDA 13.0) cuMemcpyBatchAsync
                // answered INVALID_VALUE for a staged job whose host runs
                // crossed from one 1 MiB registration into the next
                // (docs/gpu-runs/2026-11-30-duplex-summary.md), and the CUDA
                // documentation refuses copies spanning registered and
                // unregistered memory with the same code.
                if g.overlaps_registration(f.host, f.bytes) && g.registered_range(f.host, f.bytes).is_none() {
                    return Err(Code::INVALID_VALUE);
                }
            }
            for f in fragments {
                let op = match dir {
                    Direction::HostToDevice => Op::HtoD { dst: f.device, src: f.host, bytes: f.bytes },
                    Direction::DeviceToHost => Op::DtoH { dst: f.host, src: f.device, bytes: f.bytes },
                };
                g.queue_op(stream.0, op)?;
            }
            self.inner.cv.notify_all();
            Ok(())
        })();
        traced("cuMemcpyBatchAsync", r)
    }

    unsafe fn memset_d8_async(&self, dst: DevicePtr, value: u8, bytes: usize, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(Call::MemsetAsync, &[stream])?;
            Self::check_device(&mut g, dst, bytes)?;
            self.enqueue(g, stream, Op::Memset { dst, value, bytes })
        })();
        traced("cuMemsetD8Async", r)
    }

    unsafe fn launch(&self, kernel: Kernel, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(Call::Launch, &[stream])?;
            self.enqueue(g, stream, Op::Kernel(kernel))
        })();
        traced("cuLaunchKernel", r)
    }

    fn event_create(&self) -> DriverResult<Event> {
        self.new_event(EventState::default())
    }

    fn event_create_timed(&self) -> DriverResult<Event> {
        self.new_event(EventState { timed: true, ..EventState::default() })
    }

    fn event_elapsed(&self, gate: &Gate, start: Event, end: Event) -> DriverResult<f32> {
        self.gated(gate, Call::EventElapsedTime)?;
        let r = (|| {
            let g = self.enter(Call::EventElapsedTime, &[])?;
            // As the driver: an event made without timing, or never
            // recorded, is INVALID_HANDLE; one not yet reached NOT_READY.
            let at = |e: Event| -> Result<std::time::Instant, Code> {
                let st = g.events.get(&e.0).ok_or(Code::INVALID_HANDLE)?;
                if !st.timed || st.recorded.is_none() || st.captured.is_some() {
                    return Err(Code::INVALID_HANDLE);
                }
                if !event_done(&g, e)? {
                    return Err(Code::NOT_READY);
                }
                // Recorded on a stream that had already reached the record.
                Ok(st.reached_at.unwrap_or_else(std::time::Instant::now))
            };
            let (a, b) = (at(start)?, at(end)?);
            let ms = if b >= a { (b - a).as_secs_f64() * 1e3 } else { -((a - b).as_secs_f64() * 1e3) };
            Ok(ms as f32)
        })();
        traced("cuEventElapsedTime", r)
    }

    fn event_destroy(&self, event: Event) -> DriverResult<()> {
        self.destroy(Call::EventDestroy, "cuEventDestroy", |g| g.events.remove(&event.0).map(drop))
    }

    fn event_record(&self, event: Event, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(Call::EventRecord, &[stream])?;
            if !g.events.contains_key(&event.0) {
                return Err(Code::INVALID_HANDLE);
            }
            let s = g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?;
            let enqueued = s.enqueued;
            let at_ops = s.joined.as_ref().map_or(0, |j| j.ops);
            // Inside a capture a record becomes a captured event: it marks
            // the capture's work so far on this stream, and waiting on it
            // joins the capture (cross-stream capture); it says nothing of
            // work that runs.
            let captured = g.capture_origin(stream.0).map(|origin| CapturedRecord { origin, stream: stream.0, at_ops });
            // A record on a stream with nothing pending is reached at once
            // (a timed event's stamp is now); otherwise the device stamps it.
            let reached_now = g.reached(stream.0, enqueued).then(std::time::Instant::now);
            if let Some(e) = g.events.get_mut(&event.0) {
                match captured {
                    Some(c) => e.captured = Some(c),
                    None => {
                        e.recorded = Some((stream.0, enqueued));
                        e.captured = None;
                        e.reached_at = reached_now.filter(|_| e.timed);
                    }
                }
            }
            Ok(())
        })();
        traced("cuEventRecord", r)
    }

    fn event_query(&self, gate: &Gate, event: Event) -> DriverResult<bool> {
        self.gated(gate, Call::EventQuery)?;
        let r = (|| {
            let g = self.enter(Call::EventQuery, &[])?;
            event_done(&g, event)
        })();
        traced("cuEventQuery", r)
    }

    fn event_synchronize(&self, gate: &Gate, event: Event) -> DriverResult<()> {
        self.gated(gate, Call::EventSynchronize)?;
        let r = (|| {
            let mut g = self.enter(Call::EventSynchronize, &[])?;
            while !event_done(&g, event)? {
                g = sync::wait(&self.inner.cv, g);
            }
            live(&g)
        })();
        traced("cuEventSynchronize", r)
    }

    fn begin_capture(&self, stream: Stream, mode: CaptureMode) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(Call::BeginCapture, &[stream])?;
            // begin_capture blocks while another thread's register runs, then
            // succeeds (docs/driver-rules.md, row "begin_capture waits for a
            // registration").
            let mut g = self.inner.wait_until(g, Blocked::BeginCapture, |st| st.registers_running == 0);
            let s = g.stream_mut(stream.0).ok_or(Code::INVALID_HANDLE)?;
            if s.capture.is_some() || s.joined.is_some() {
                return Err(Code::ILLEGAL_STATE);
            }
            s.capture =
                Some(Capture { mode, owner: sync::this_thread(), invalidated: false, body: GraphBody::default() });
            Ok(())
        })();
        traced("cuStreamBeginCapture", r)
    }

    fn end_capture(&self, stream: Stream) -> DriverResult<Graph> {
        let r = (|| {
            // A thread other than the capturing one is refused by the rules
            // (no measured row: 900, the capture invalidated); the driver's
            // documented answer there, STREAM_CAPTURE_WRONG_THREAD (908), is
            // never measured, so the sim does not rely on it.
            let mut g = self.enter(Call::EndCapture, &[stream])?;
            let s = g.stream_mut(stream.0).ok_or(Code::INVALID_HANDLE)?;
            let c = s.capture.take().ok_or(Code::ILLEGAL_STATE)?;
            // Every stream that joined this capture leaves it now; one that
            // has work the origin does not wait for fails the whole capture
            // (CUDA driver docs: CUDA_ERROR_STREAM_CAPTURE_UNJOINED, 904).
            let mut unjoined = false;
            for st in g.streams.values_mut() {
                if let Some(j) = st.joined.take_if(|j| j.origin == stream.0) {
                    unjoined |= !j.rejoined;
                }
            }
            if c.invalidated {
                // An invalidated capture ends with 901 and no graph
                // (docs/driver-rules.md, row "Refused call").
                return Err(Code::STREAM_CAPTURE_INVALIDATED);
            }
            if unjoined {
                return Err(Code::STREAM_CAPTURE_UNJOINED);
            }
            let id = g.fresh_id();
            g.graphs.insert(id, Arc::new(c.body));
            self.inner.cv.notify_all();
            Ok(Graph(id))
        })();
        traced("cuStreamEndCapture", r)
    }

    fn capture_status(&self, stream: Stream) -> DriverResult<CaptureStatus> {
        let r = (|| {
            let g = self.enter(Call::CaptureStatus, &[stream])?;
            g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?;
            let capture = g.capture_origin(stream.0).and_then(|o| g.streams.get(&o)).and_then(|o| o.capture.as_ref());
            Ok(match capture {
                None => CaptureStatus::None,
                Some(c) if c.invalidated => CaptureStatus::Invalidated,
                Some(_) => CaptureStatus::Active,
            })
        })();
        traced("cuStreamIsCapturing", r)
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> DriverResult<CaptureMode> {
        let r = (|| {
            let mut g = self.enter(Call::ExchangeCaptureMode, &[])?;
            Ok(g.set_thread_mode(sync::this_thread(), mode))
        })();
        traced("cuThreadExchangeStreamCaptureMode", r)
    }

    fn graph_launch(&self, graph: Graph, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(Call::GraphLaunch, &[stream])?;
            let body = g.graphs.get(&graph.0).ok_or(Code::INVALID_HANDLE)?.clone();
            // The launch itself succeeds even if the graph's host memory was
            // unregistered; the fault shows at the next synchronize
            // (docs/driver-rules.md, row "Replay after unregister").
            self.enqueue(g, stream, Op::Graph(body))
        })();
        traced("cuGraphLaunch", r)
    }

    fn graph_destroy(&self, graph: Graph) -> DriverResult<()> {
        self.destroy(Call::GraphDestroy, "cuGraphExecDestroy", |g| g.graphs.remove(&graph.0).map(drop))
    }
}

/// `stream` waits on an event recorded inside a capture (CUDA programming
/// guide, "Cross-stream dependencies and events"): a stream outside any
/// capture joins it (its later work is recorded into the capture, not run);
/// the origin waiting on a record made on a joined stream after all of that
/// stream's work rejoins it. A wait on a captured event whose capture has
/// ended is refused (CAPTURED_EVENT, 907), as is merging two captures.
fn join_capture(g: &mut State, stream: u64, c: CapturedRecord) -> Result<(), Code> {
    let live = g.streams.get(&c.origin).is_some_and(|o| o.capture.is_some());
    if !live {
        return Err(Code::CAPTURED_EVENT);
    }
    match g.capture_origin(stream) {
        None => {
            let s = g.stream_mut(stream).ok_or(Code::INVALID_HANDLE)?;
            s.joined = Some(Join { origin: c.origin, ops: 0, rejoined: false });
            Ok(())
        }
        Some(o) if o == c.origin => {
            if stream == c.origin && c.stream != c.origin {
                if let Some(j) = g.stream_mut(c.stream).and_then(|s| s.joined.as_mut()) {
                    if j.ops == c.at_ops {
                        j.rejoined = true;
                    }
                }
            }
            Ok(())
        }
        // Two captures would merge (CUDA_ERROR_STREAM_CAPTURE_MERGE, 902).
        Some(_) => Err(Code::ILLEGAL_STATE),
    }
}

fn event_done(st: &State, event: Event) -> Result<bool, Code> {
    let e = st.events.get(&event.0).ok_or(Code::INVALID_HANDLE)?;
    if e.captured.is_some() {
        return Err(Code::CAPTURED_EVENT);
    }
    Ok(match e.recorded {
        None => true,
        Some((s, seq)) => st.reached(s, seq),
    })
}

#[cfg(test)]
mod tests {
    use super::rules::{self, Call};
    use super::*;
    use crate::protocol::{CapturePolicy, Coordinator, Request};

    /// Default deny: `cuGraphLaunch` has no measured row, so made by thread
    /// B while thread A holds a GLOBAL capture it is refused with 900, A's
    /// capture is invalidated (A's end: 901), and the refusal names the
    /// missing row. Were `cuGraphLaunch` listed in `rules::MEASURED`, the
    /// launch would go through and this test would fail.
    #[test]
    fn an_unmeasured_call_during_another_threads_global_capture_is_refused() {
        assert!(rules::row(Call::GraphLaunch).is_none(), "cuGraphLaunch has no measured row");
        let rt = crate::runtime::shared(SimRuntime::new());
        let coord = Coordinator::without_region(rt.as_ref(), CapturePolicy::AfterPinning).unwrap();
        let (a, b) = (rt.stream_create().unwrap(), rt.stream_create().unwrap());
        let d = coord.unsafe_call("test", Request::new(), |g| rt.mem_alloc(g, 64)).unwrap().unwrap();
        // B's graph, captured while no other capture is open.
        rt.begin_capture(b, CaptureMode::Global).unwrap();
        // SAFETY: `d` is a 64-byte allocation of `rt`, never freed.
        unsafe { rt.memset_d8_async(d, 1, 64, b) }.unwrap();
        let graph = rt.end_capture(b).unwrap();

        rt.begin_capture(a, CaptureMode::Global).unwrap();
        let rt2 = rt.clone();
        let launched = thread::spawn(move || rt2.graph_launch(graph, b)).join().unwrap();
        assert_eq!(launched.map_err(|e| e.code), Err(Code::STREAM_CAPTURE_UNSUPPORTED));
        assert_eq!(rt.end_capture(a).map_err(|e| e.code), Err(Code::STREAM_CAPTURE_INVALIDATED));
        let refusals = rt.as_sim().unwrap().refusals();
        assert_eq!(refusals.len(), 1, "{refusals:?}");
        assert_eq!(refusals[0].call, "cuGraphLaunch");
        assert!(refusals[0].reason.contains("no measured row"), "{refusals:?}");

        // A measured call (cuEventCreate, cells event_create/*) goes through
        // during the same kind of capture.
        rt.begin_capture(a, CaptureMode::Global).unwrap();
        let rt2 = rt.clone();
        thread::spawn(move || rt2.event_create()).join().unwrap().unwrap();
        rt.graph_destroy(rt.end_capture(a).unwrap()).unwrap();
    }

    /// The calls taking a `Gate` are exactly the rows measured unsafe.
    #[test]
    fn the_gated_calls_are_the_unsafe_rows() {
        let unsafe_rows: Vec<&str> =
            rules::MEASURED.iter().filter(|r| r.effect != rules::Effect::Safe).map(|r| r.call.driver_name()).collect();
        let mut got = unsafe_rows.clone();
        got.sort_unstable();
        let mut want = vec![
            "cuMemHostRegister",
            "cuMemHostUnregister",
            "cuEventQuery",
            "cuEventSynchronize",
            "cuStreamSynchronize",
            "cuCtxSynchronize",
            "cuMemAlloc",
            "cuMemAllocHost",
            "cuMemFree",
            "cuMemFreeHost",
        ];
        want.sort_unstable();
        assert_eq!(got, want);
    }

    /// Cross-stream capture: a stream waiting on an event recorded in a
    /// capture joins it (its work is captured, not run); ending the origin
    /// capture while it has not rejoined fails with 904.
    #[test]
    fn a_joined_stream_that_did_not_rejoin_fails_the_capture() {
        let rt = crate::runtime::shared(SimRuntime::new());
        let coord = Coordinator::without_region(rt.as_ref(), CapturePolicy::AfterPinning).unwrap();
        let (o, x) = (rt.stream_create().unwrap(), rt.stream_create().unwrap());
        let d = coord.unsafe_call("test", Request::new(), |g| rt.mem_alloc(g, 64)).unwrap().unwrap();
        let e = rt.event_create().unwrap();
        rt.begin_capture(o, CaptureMode::Global).unwrap();
        rt.event_record(e, o).unwrap();
        rt.stream_wait_event(x, e).unwrap();
        assert_eq!(rt.capture_status(x).unwrap(), CaptureStatus::Active);
        // SAFETY: `d` is a 64-byte allocation of `rt`, never freed.
        unsafe { rt.memset_d8_async(d, 1, 64, x) }.unwrap();
        assert_eq!(rt.end_capture(o).map_err(|e| e.code), Err(Code::STREAM_CAPTURE_UNJOINED));
        assert_eq!(rt.capture_status(x).unwrap(), CaptureStatus::None);
        rt.stream_destroy(x).unwrap();
    }
}
