//! A GPU simulated on host memory, faithful to the driver rules measured on
//! an H200 (FACTS.md section 1).
//!
//! - Streams execute asynchronously and in order on a device thread
//!   (`device.rs`); events complete when the work recorded before them does.
//! - Capture records stream work into a graph that can be replayed; the
//!   capture rules of `rules.rs` decide which calls fail with 900 and
//!   invalidate a capture.
//! - `begin_capture` blocks while a registration runs (enqueues onto a
//!   capturing stream do not: measured, docs/facts-deltas.md); `host_unregister` waits for the device to go idle;
//!   replaying a graph whose registered host memory was unregistered
//!   poisons the context with 719; a batched copy inside a capture returns
//!   900 and is silently absent from the graph.
//! - Faults ([`SimFault`]) and hold points ([`Hold`]) let tests fail a
//!   registration or copy and stop a call mid-way, deterministically.
//!
//! All state sits behind one mutex and one condition variable from
//! [`crate::sync`], so the same code runs under loom.

mod device;
mod fault;
mod rules;
mod state;

pub use fault::{HoldPoint, SimFault};
pub use state::Blocked;

use crate::runtime::{
    CaptureMode, CaptureStatus, Code, DevicePtr, Direction, DriverError, DriverResult, Event, Fragment, Gate,
    GpuRuntime, Graph, Kernel, Stream,
};
use crate::sync::{self, thread, Arc, Condvar, Mutex, MutexGuard};

use fault::HoldSlot;
use rules::UnsafeCall;
use state::{Capture, EventState, GraphBody, Op, State, StreamState, HOST_ALIAS_BIT};

/// What [`GpuRuntime::describe`] says of every simulated GPU.
pub const DESCRIPTION: &str = "simulated GPU (driver rules of FACTS.md section 1)";

/// Settings of a simulated GPU.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Device memory the simulated `cuMemAlloc` hands out before it answers
    /// OUT_OF_MEMORY. Memory is allocated lazily (zeroed pages).
    pub device_bytes: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig { device_bytes: 64 << 30 }
    }
}

pub(crate) struct Inner {
    state: Mutex<State>,
    cv: Condvar,
}

impl Inner {
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

/// The simulated GPU. Dropping it stops its device thread.
pub struct SimRuntime {
    inner: Arc<Inner>,
    device: Mutex<Option<thread::JoinHandle<()>>>,
}

/// A hold point armed by [`SimRuntime::hold`]: the next call reaching the
/// point stops there until [`Hold::release`] (or drop).
pub struct Hold {
    inner: Arc<Inner>,
    id: u64,
}

impl Hold {
    /// Blocks until a call has reached the hold point.
    pub fn wait_entered(&self) {
        let mut g = sync::lock(&self.inner.state);
        while !g.faults.hold(self.id).is_none_or(|h| h.entered) {
            g = sync::wait(&self.inner.cv, g);
        }
    }

    /// Lets the held call continue (or disarms the hold if none arrived).
    pub fn release(&self) {
        let mut g = sync::lock(&self.inner.state);
        match g.faults.holds.iter_mut().find(|h| h.id == self.id) {
            Some(h) if h.entered => h.released = true,
            Some(_) => g.faults.holds.retain(|h| h.id != self.id),
            None => {}
        }
        self.inner.cv.notify_all();
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.release();
    }
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

fn me() -> thread::ThreadId {
    thread::current().id()
}

impl SimRuntime {
    /// A simulated GPU with default settings.
    pub fn new() -> Self {
        Self::with_config(SimConfig::default())
    }

    /// A simulated GPU with the settings of `cfg`. Starts the simulated
    /// device's worker thread (from the sync facade, so loom schedules it);
    /// it runs until the runtime is dropped.
    pub fn with_config(cfg: SimConfig) -> Self {
        let inner = Arc::new(Inner { state: Mutex::new(State::new(cfg.device_bytes)), cv: Condvar::new() });
        let worker = inner.clone();
        let handle = thread::spawn(move || device::run(worker));
        SimRuntime { inner, device: Mutex::new(Some(handle)) }
    }

    /// Injects a fault (see [`SimFault`]).
    pub fn inject(&self, fault: SimFault) {
        sync::lock(&self.inner.state).faults.inject(fault);
    }

    /// Arms a hold at `point`.
    pub fn hold(&self, point: HoldPoint) -> Hold {
        let mut g = sync::lock(&self.inner.state);
        let id = g.fresh_id();
        g.faults.holds.push(HoldSlot { id, point, entered: false, released: false });
        Hold { inner: self.inner.clone(), id }
    }

    /// Blocks until at least `n` threads are blocked in `kind`.
    pub fn wait_blocked(&self, kind: Blocked, n: usize) {
        let mut g = sync::lock(&self.inner.state);
        while g.blocked_count(kind) < n {
            g = sync::wait(&self.inner.cv, g);
        }
    }

    /// Like [`SimRuntime::wait_blocked`], giving up after `timeout`; true
    /// when the threads were seen blocked.
    #[cfg(not(loom))]
    pub fn wait_blocked_timeout(&self, kind: Blocked, n: usize, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut g = sync::lock(&self.inner.state);
        while g.blocked_count(kind) < n {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            g = match self.inner.cv.wait_timeout(g, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    /// Blocks until every enqueued operation of every stream has executed
    /// (an observer for tests; it makes no driver call and is never refused).
    pub fn wait_device_idle(&self) {
        let mut g = sync::lock(&self.inner.state);
        while !g.idle() {
            g = sync::wait(&self.inner.cv, g);
        }
    }

    /// Number of threads blocked in `kind` right now.
    pub fn blocked(&self, kind: Blocked) -> usize {
        sync::lock(&self.inner.state).blocked_count(kind)
    }

    /// True when `[addr, addr+bytes)` lies inside one registered range.
    pub fn is_registered(&self, addr: usize, bytes: usize) -> bool {
        sync::lock(&self.inner.state).registered_range(addr, bytes).is_some()
    }

    /// Number of registered host ranges.
    pub fn registered_ranges(&self) -> usize {
        sync::lock(&self.inner.state).registered.len()
    }

    /// Bytes of device memory allocated and not freed (leak checks).
    pub fn device_bytes_in_use(&self) -> usize {
        sync::lock(&self.inner.state).device_used
    }

    /// Page-locked host allocations (`mem_alloc_host`) not freed.
    pub fn host_allocs_in_use(&self) -> usize {
        sync::lock(&self.inner.state).host_allocs.len()
    }

    /// Registrations running in the driver right now.
    pub fn registers_running(&self) -> usize {
        sync::lock(&self.inner.state).registers_running
    }

    /// The sticky context error, if the context is poisoned.
    pub fn poisoned(&self) -> Option<Code> {
        sync::lock(&self.inner.state).poisoned
    }

    fn state(&self) -> MutexGuard<'_, State> {
        sync::lock(&self.inner.state)
    }

    /// Starts a driver call: takes the lock, fails with the sticky error of
    /// a poisoned context, and applies the capture rules to `call`.
    fn enter(&self, call: Option<UnsafeCall>) -> Result<MutexGuard<'_, State>, Code> {
        let mut g = self.state();
        live(&g)?;
        if let Some(c) = call {
            rules::check(&mut g, me(), c)?;
        }
        Ok(g)
    }

    /// Adds `op` to `stream`: executed later by the device, or recorded into
    /// the stream's capture.
    fn enqueue<'a>(&'a self, mut g: MutexGuard<'a, State>, stream: Stream, op: Op) -> Result<(), Code> {
        let capturing = g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?.capture.is_some();
        if capturing {
            // FACTS 1 said an enqueue onto a THREAD_LOCAL or RELAXED capture
            // blocks while another thread registers; the H200 conformance
            // run showed it does not (docs/facts-deltas.md), so it does not
            // block here either.
            let refs = host_ref(&g, &op);
            let c = g.stream_mut(stream.0).and_then(|s| s.capture.as_mut()).ok_or(Code::INVALID_HANDLE)?;
            if c.invalidated {
                return Err(Code::STREAM_CAPTURE_INVALIDATED);
            }
            c.body.registered_refs.extend(refs);
            c.body.ops.push(op);
            return Ok(());
        }
        let s = g.stream_mut(stream.0).ok_or(Code::INVALID_HANDLE)?;
        s.enqueued += 1;
        let seq = s.enqueued;
        s.queue.push_back((seq, op));
        self.inner.cv.notify_all();
        Ok(())
    }

    fn check_device(g: &mut State, ptr: DevicePtr, bytes: usize) -> Result<(), Code> {
        if bytes == 0 || g.device_slice(ptr, bytes).is_none() {
            return Err(Code::INVALID_VALUE);
        }
        Ok(())
    }

    fn copy_async(&self, op: Op, stream: Stream) -> Result<(), Code> {
        let mut g = self.enter(None)?;
        if let Some(code) = g.faults.on_copy() {
            return Err(code);
        }
        match op {
            Op::HtoD { dst, bytes, .. } => Self::check_device(&mut g, dst, bytes)?,
            Op::DtoH { src, bytes, .. } => Self::check_device(&mut g, src, bytes)?,
            _ => {}
        }
        self.enqueue(g, stream, op)
    }

    /// Waits until `stream` has finished everything enqueued so far.
    fn drain<'a>(&'a self, g: MutexGuard<'a, State>, stream: u64) -> MutexGuard<'a, State> {
        let inner = &self.inner;
        let mut g = g;
        while g.streams.get(&stream).is_some_and(|s| s.completed < s.enqueued) {
            g = sync::wait(&inner.cv, g);
        }
        g
    }
}

impl Default for SimRuntime {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for SimRuntime {
    fn drop(&mut self) {
        {
            let mut g = self.state();
            g.stop = true;
            self.inner.cv.notify_all();
        }
        if let Some(h) = sync::lock(&self.device).take() {
            // The device thread only exits its loop; a panic there is a bug
            // in the simulator that the join surfaces in tests.
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

    unsafe fn host_register(&self, _gate: &Gate, addr: usize, len: usize) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(None)?;
            if addr == 0 || len == 0 {
                return Err(Code::INVALID_VALUE);
            }
            if let Some(code) = g.faults.on_register() {
                return Err(code);
            }
            rules::check(&mut g, me(), UnsafeCall::Register)?;
            if g.overlaps_registration(addr, len) {
                return Err(Code::HOST_MEMORY_ALREADY_REGISTERED);
            }
            g.registers_running += 1;
            g = self.inner.hold_at(g, HoldPoint::Register);
            // The lock is let go while the pages are "pinned", as in the real
            // driver: other threads (a capture starting) run meanwhile.
            drop(g);
            let mut g = self.state();
            g.registers_running -= 1;
            g.registered.insert(addr, len);
            self.inner.cv.notify_all();
            Ok(())
        })();
        traced("cuMemHostRegister", r)
    }

    fn host_unregister(&self, _gate: &Gate, addr: usize) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(Some(UnsafeCall::Unregister))?;
            if !g.registered.contains_key(&addr) || g.host_allocs.contains_key(&addr) {
                return Err(Code::HOST_MEMORY_NOT_REGISTERED);
            }
            // FACTS 1, other driver facts: unregister waits for the device to
            // go idle (1.8 s behind a running 1.8 s kernel).
            let mut g = self.inner.wait_until(g, Blocked::Idle, State::idle);
            g.registered.remove(&addr);
            self.inner.cv.notify_all();
            Ok(())
        })();
        traced("cuMemHostUnregister", r)
    }

    fn host_device_ptr(&self, addr: usize) -> DriverResult<DevicePtr> {
        let r = (|| {
            let g = self.enter(None)?;
            g.registered_range(addr, 1).ok_or(Code::INVALID_VALUE)?;
            Ok(HOST_ALIAS_BIT | addr as u64)
        })();
        traced("cuMemHostGetDevicePointer", r)
    }

    fn mem_alloc(&self, _gate: &Gate, bytes: usize) -> DriverResult<DevicePtr> {
        let r = (|| {
            let mut g = self.enter(Some(UnsafeCall::Alloc))?;
            if bytes == 0 {
                return Err(Code::INVALID_VALUE);
            }
            if g.device_used.saturating_add(bytes) > g.device_limit {
                return Err(Code::OUT_OF_MEMORY);
            }
            let p = g.fresh_device_addr(bytes);
            g.device_mem.insert(p, vec![0u8; bytes]);
            g.device_used += bytes;
            Ok(p)
        })();
        traced("cuMemAlloc", r)
    }

    fn mem_free(&self, _gate: &Gate, ptr: DevicePtr) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(Some(UnsafeCall::Alloc))?;
            if !g.device_mem.contains_key(&ptr) {
                return Err(Code::INVALID_VALUE);
            }
            let mut g = self.inner.wait_until(g, Blocked::Idle, State::idle);
            let freed = g.device_mem.remove(&ptr).map_or(0, |m| m.len());
            g.device_used -= freed;
            Ok(())
        })();
        traced("cuMemFree", r)
    }

    fn mem_alloc_host(&self, _gate: &Gate, bytes: usize) -> DriverResult<usize> {
        let r = (|| {
            let mut g = self.enter(Some(UnsafeCall::Alloc))?;
            if bytes == 0 {
                return Err(Code::INVALID_VALUE);
            }
            let mut buf = vec![0u8; bytes];
            let addr = buf.as_mut_ptr() as usize;
            g.host_allocs.insert(addr, buf);
            g.registered.insert(addr, bytes);
            Ok(addr)
        })();
        traced("cuMemAllocHost", r)
    }

    fn mem_free_host(&self, _gate: &Gate, addr: usize) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(Some(UnsafeCall::Alloc))?;
            if !g.host_allocs.contains_key(&addr) {
                return Err(Code::INVALID_VALUE);
            }
            let mut g = self.inner.wait_until(g, Blocked::Idle, State::idle);
            g.registered.remove(&addr);
            g.host_allocs.remove(&addr);
            Ok(())
        })();
        traced("cuMemFreeHost", r)
    }

    fn stream_create(&self) -> DriverResult<Stream> {
        let r = (|| {
            let mut g = self.enter(None)?;
            let id = g.fresh_id();
            g.streams.insert(id, StreamState::default());
            Ok(Stream(id))
        })();
        traced("cuStreamCreate", r)
    }

    fn stream_destroy(&self, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(None)?;
            let s = g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?;
            if s.capture.is_some() {
                return Err(Code::ILLEGAL_STATE);
            }
            // The driver lets queued work finish before releasing the stream.
            let mut g = self.drain(g, stream.0);
            g.streams.remove(&stream.0);
            Ok(())
        })();
        traced("cuStreamDestroy", r)
    }

    fn stream_synchronize(&self, _gate: &Gate, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(Some(UnsafeCall::StreamSync))?;
            if !g.streams.contains_key(&stream.0) {
                return Err(Code::INVALID_HANDLE);
            }
            let g = self.drain(g, stream.0);
            live(&g)
        })();
        traced("cuStreamSynchronize", r)
    }

    fn ctx_synchronize(&self, _gate: &Gate) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(Some(UnsafeCall::CtxSync))?;
            let g = self.inner.wait_until(g, Blocked::Idle, State::idle);
            live(&g)
        })();
        traced("cuCtxSynchronize", r)
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(None)?;
            let recorded = g.events.get(&event.0).ok_or(Code::INVALID_HANDLE)?.recorded;
            match recorded {
                // An event never recorded is complete: nothing to wait for.
                None => Ok(()),
                Some((s, seq)) => self.enqueue(g, stream, Op::WaitEvent { stream: s, seq }),
            }
        })();
        traced("cuStreamWaitEvent", r)
    }

    unsafe fn copy_htod_async(&self, dst: DevicePtr, src: usize, bytes: usize, stream: Stream) -> DriverResult<()> {
        traced("cuMemcpyHtoDAsync", self.copy_async(Op::HtoD { dst, src, bytes }, stream))
    }

    unsafe fn copy_dtoh_async(&self, dst: usize, src: DevicePtr, bytes: usize, stream: Stream) -> DriverResult<()> {
        traced("cuMemcpyDtoHAsync", self.copy_async(Op::DtoH { dst, src, bytes }, stream))
    }

    unsafe fn copy_htod(&self, dst: DevicePtr, src: usize, bytes: usize) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(None)?;
            let d = g.device_slice(dst, bytes).ok_or(Code::INVALID_VALUE)?;
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
            let mut g = self.enter(None)?;
            let s = g.device_slice(src, bytes).ok_or(Code::INVALID_VALUE)?;
            // SAFETY: as in copy_htod, with the roles of host and device swapped.
            unsafe { std::ptr::copy(s as *const u8, dst as *mut u8, bytes) };
            Ok(())
        })();
        traced("cuMemcpyDtoH", r)
    }

    unsafe fn copy_batch_async(&self, dir: Direction, fragments: &[Fragment], stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(None)?;
            if fragments.is_empty() {
                return Err(Code::INVALID_VALUE);
            }
            if let Some(code) = g.faults.on_copy() {
                return Err(code);
            }
            let capturing = g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?.capture.is_some();
            if capturing {
                // FACTS 3: cuMemcpyBatchAsync inside a capture returns 900,
                // the capture stays valid and the graph copies nothing.
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
                let s = g.stream_mut(stream.0).ok_or(Code::INVALID_HANDLE)?;
                s.enqueued += 1;
                let seq = s.enqueued;
                s.queue.push_back((seq, op));
            }
            self.inner.cv.notify_all();
            Ok(())
        })();
        traced("cuMemcpyBatchAsync", r)
    }

    unsafe fn memset_d8_async(&self, dst: DevicePtr, value: u8, bytes: usize, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(None)?;
            Self::check_device(&mut g, dst, bytes)?;
            self.enqueue(g, stream, Op::Memset { dst, value, bytes })
        })();
        traced("cuMemsetD8Async", r)
    }

    unsafe fn launch(&self, kernel: Kernel, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(None)?;
            match kernel {
                Kernel::Spin { .. } => self.enqueue(g, stream, Op::Spin),
                Kernel::Gather { table, count } => self.enqueue(g, stream, Op::Gather { table, count }),
                Kernel::PatternFill { table, count } => self.enqueue(g, stream, Op::PatternFill { table, count }),
                Kernel::PatternCheck { table, count, out } => {
                    self.enqueue(g, stream, Op::PatternCheck { table, count, out })
                }
            }
        })();
        traced("cuLaunchKernel", r)
    }

    fn event_create(&self) -> DriverResult<Event> {
        let r = (|| {
            let mut g = self.enter(None)?;
            let id = g.fresh_id();
            g.events.insert(id, EventState { recorded: None });
            Ok(Event(id))
        })();
        traced("cuEventCreate", r)
    }

    fn event_destroy(&self, event: Event) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(None)?;
            g.events.remove(&event.0).map(|_| ()).ok_or(Code::INVALID_HANDLE)
        })();
        traced("cuEventDestroy", r)
    }

    fn event_record(&self, event: Event, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(None)?;
            if !g.events.contains_key(&event.0) {
                return Err(Code::INVALID_HANDLE);
            }
            let s = g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?;
            // Inside a capture a record becomes a graph node; the sim keeps
            // the event unrecorded (the offload code never records there).
            let at = if s.capture.is_some() { None } else { Some((stream.0, s.enqueued)) };
            if let Some(e) = g.events.get_mut(&event.0) {
                e.recorded = at;
            }
            Ok(())
        })();
        traced("cuEventRecord", r)
    }

    fn event_query(&self, _gate: &Gate, event: Event) -> DriverResult<bool> {
        let r = (|| {
            let g = self.enter(Some(UnsafeCall::EventWait))?;
            event_done(&g, event)
        })();
        traced("cuEventQuery", r)
    }

    fn event_synchronize(&self, _gate: &Gate, event: Event) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(Some(UnsafeCall::EventWait))?;
            while !event_done(&g, event)? {
                g = sync::wait(&self.inner.cv, g);
            }
            live(&g)
        })();
        traced("cuEventSynchronize", r)
    }

    fn begin_capture(&self, stream: Stream, mode: CaptureMode) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(None)?;
            // FACTS 1, ordering: begin_capture blocks while another thread's
            // register runs, then succeeds.
            let mut g = self.inner.wait_until(g, Blocked::BeginCapture, |st| st.registers_running == 0);
            let s = g.stream_mut(stream.0).ok_or(Code::INVALID_HANDLE)?;
            if s.capture.is_some() {
                return Err(Code::ILLEGAL_STATE);
            }
            s.capture = Some(Capture { mode, owner: me(), invalidated: false, body: GraphBody::default() });
            Ok(())
        })();
        traced("cuStreamBeginCapture", r)
    }

    fn end_capture(&self, stream: Stream) -> DriverResult<Graph> {
        let r = (|| {
            let mut g = self.enter(None)?;
            let s = g.stream_mut(stream.0).ok_or(Code::INVALID_HANDLE)?;
            let c = s.capture.as_ref().ok_or(Code::ILLEGAL_STATE)?;
            if c.mode != CaptureMode::Relaxed && c.owner != me() {
                return Err(Code::STREAM_CAPTURE_WRONG_THREAD);
            }
            let c = s.capture.take().ok_or(Code::ILLEGAL_STATE)?;
            if c.invalidated {
                // FACTS 1: an invalidated capture ends with 901 and no graph.
                return Err(Code::STREAM_CAPTURE_INVALIDATED);
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
            let g = self.enter(None)?;
            let s = g.streams.get(&stream.0).ok_or(Code::INVALID_HANDLE)?;
            Ok(match &s.capture {
                None => CaptureStatus::None,
                Some(c) if c.invalidated => CaptureStatus::Invalidated,
                Some(_) => CaptureStatus::Active,
            })
        })();
        traced("cuStreamIsCapturing", r)
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> DriverResult<CaptureMode> {
        let r = (|| {
            let mut g = self.enter(None)?;
            Ok(g.set_thread_mode(me(), mode))
        })();
        traced("cuThreadExchangeStreamCaptureMode", r)
    }

    fn graph_launch(&self, graph: Graph, stream: Stream) -> DriverResult<()> {
        let r = (|| {
            let g = self.enter(None)?;
            let body = g.graphs.get(&graph.0).ok_or(Code::INVALID_HANDLE)?.clone();
            // The launch itself succeeds even if the graph's host memory was
            // unregistered; the fault shows at the next synchronize (FACTS 1).
            self.enqueue(g, stream, Op::Graph(body))
        })();
        traced("cuGraphLaunch", r)
    }

    fn graph_destroy(&self, graph: Graph) -> DriverResult<()> {
        let r = (|| {
            let mut g = self.enter(None)?;
            g.graphs.remove(&graph.0).map(|_| ()).ok_or(Code::INVALID_HANDLE)
        })();
        traced("cuGraphExecDestroy", r)
    }
}

fn event_done(st: &State, event: Event) -> Result<bool, Code> {
    let e = st.events.get(&event.0).ok_or(Code::INVALID_HANDLE)?;
    Ok(match e.recorded {
        None => true,
        Some((s, seq)) => st.streams.get(&s).is_none_or(|s| s.completed >= seq),
    })
}
