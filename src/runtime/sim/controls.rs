//! The simulated GPU's test controls: fault injection, hold points, waits
//! for blocked threads, observers of its state (registrations, device
//! memory, copies, refusals), and the adoption of host memory as device
//! memory for engines whose tensors live on the CPU.
//!
//! None of these is a CUDA driver call and none has a counterpart on a real
//! GPU: they exist for the crate's tests, loom models and tools, and for
//! the Python test hooks (`kvoffload._testing`). They make no capture-unsafe
//! driver call, need no `Gate` and are never refused by the capture rules.
//! An engine's code uses none of them (they are hidden from the crate's
//! docs, beside `kvoffload::internal`).

use super::*;

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

#[doc(hidden)]
impl SimRuntime {
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
    #[cfg(not(any(loom, shuttle)))]
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

    /// Copies enqueued for execution (not captured) whose host side was
    /// pageable when enqueued: neither registered nor from `mem_alloc_host`.
    /// A job of a pinned region that copies pageable memory ran after its
    /// chunks were unregistered (model/p4_shutdown.rs).
    pub fn pageable_copies(&self) -> u64 {
        sync::lock(&self.inner.state).pageable_copies
    }

    /// Bytes of device memory allocated and not freed (leak checks).
    pub fn device_bytes_in_use(&self) -> usize {
        sync::lock(&self.inner.state).device_used
    }

    /// The most device memory this runtime has had allocated at once
    /// (checks that something was never allocated, even if freed since).
    pub fn device_bytes_peak(&self) -> usize {
        sync::lock(&self.inner.state).device_peak
    }

    /// Host ranges adopted as device memory and not released
    /// ([`SimRuntime::adopt_host_memory`]; leak checks).
    pub fn adopted_ranges(&self) -> usize {
        sync::lock(&self.inner.state).device_mem.values().filter(|m| matches!(m, DeviceMem::Adopted { .. })).count()
    }

    /// Makes `len` bytes of the caller's host memory at `addr` simulated
    /// device memory, in place: every device operation of the sim on the
    /// returned range (`copy_*`, `memset_d8_async`, kernels, and graph
    /// replays of captured ones) reads and writes those host bytes directly,
    /// and the sim's checks treat it as an allocation of `len` bytes (an
    /// access past its end is the same fault as past the end of a
    /// `mem_alloc`: INVALID_VALUE from an enqueue or a synchronous copy,
    /// ILLEGAL_ADDRESS from a kernel's table entry, sticky).
    ///
    /// **Not a CUDA driver call**: it exists only on the simulated GPU, for
    /// tests of engines whose tensors are host (CPU) tensors, such as vLLM
    /// 0.33 on a machine with no GPU. No capture rule applies to
    /// it and no `Gate` is needed. The range does not count against
    /// [`SimConfig::device_bytes`] or the host limit
    /// ([`SimRuntime::device_bytes_in_use`] does not include it); it gets a
    /// device address of its own (256-byte aligned, like `cuMemAlloc`'s),
    /// not `addr`. `mem_free` refuses it (INVALID_VALUE); end it with
    /// [`SimRuntime::release_adopted`].
    ///
    /// Errors: INVALID_VALUE for a null `addr`, a zero `len`, a range that
    /// wraps, overlaps another adopted range or host memory registered with
    /// the sim (`host_register`, `mem_alloc_host`); `host_register` of
    /// adopted memory is INVALID_VALUE too. A poisoned context answers its
    /// sticky error.
    ///
    /// # Safety
    /// `addr..addr+len` is memory the caller owns, readable and writable,
    /// and stays valid until [`SimRuntime::release_adopted`] has returned
    /// `Ok` (or the last handle on this device is dropped); the caller does
    /// not read or write it while device work on it is queued or running
    /// (as for any device memory: synchronize first).
    pub unsafe fn adopt_host_memory(&self, addr: usize, len: usize) -> DriverResult<DevicePtr> {
        let r = (|| {
            let mut g = self.state();
            live(&g)?;
            if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
                return Err(Code::INVALID_VALUE);
            }
            if g.overlaps_adoption(addr, len) || g.overlaps_registration(addr, len) {
                return Err(Code::INVALID_VALUE);
            }
            let p = g.fresh_device_addr(len);
            g.device_mem.insert(p, DeviceMem::Adopted { addr, len });
            Ok(p)
        })();
        traced("sim_adopt_host_memory", r)
    }

    /// Ends an adoption made by [`SimRuntime::adopt_host_memory`] (`ptr` is
    /// the pointer it returned): waits, like the sim's `mem_free` and the
    /// driver's `cuMemFree`, until the device is idle (no queued or running
    /// work on any stream; counted as [`Blocked::Idle`] meanwhile), then
    /// forgets the range, so that once it returns `Ok` the sim never
    /// touches the caller's memory again and the caller may free it. Work
    /// enqueued on the range afterwards, or a graph captured on it and
    /// replayed afterwards, faults as on freed device memory.
    ///
    /// Not a driver call (see `adopt_host_memory`): no capture rule applies,
    /// and it ends the adoption in a poisoned context too (the device still
    /// drains there, touching no memory). INVALID_VALUE when `ptr` is not
    /// the base of an adopted range (an allocation of `mem_alloc`
    /// included), nothing changed.
    pub fn release_adopted(&self, ptr: DevicePtr) -> DriverResult<()> {
        let r = (|| {
            let g = self.state();
            if !matches!(g.device_mem.get(&ptr), Some(DeviceMem::Adopted { .. })) {
                return Err(Code::INVALID_VALUE);
            }
            let mut g = self.inner.wait_until(g, Blocked::Idle, State::idle);
            // Another thread may have released it while this one waited.
            match g.device_mem.get(&ptr) {
                Some(DeviceMem::Adopted { .. }) => {
                    g.device_mem.remove(&ptr);
                    Ok(())
                }
                _ => Err(Code::INVALID_VALUE),
            }
        })();
        traced("sim_release_adopted", r)
    }

    /// The handle of stream `raw` ([`Stream::raw`]) of this device, if it
    /// is live (tests that hold streams as numbers, such as the Python
    /// test hooks).
    pub fn stream_by_raw(&self, raw: u64) -> Option<Stream> {
        self.state().streams.contains_key(&raw).then_some(Stream(raw))
    }

    /// The handle of graph `raw` ([`Graph::raw`]) of this device, if it is
    /// live (see [`SimRuntime::stream_by_raw`]).
    pub fn graph_by_raw(&self, raw: u64) -> Option<Graph> {
        self.state().graphs.contains_key(&raw).then_some(Graph(raw))
    }

    /// Page-locked host allocations (`mem_alloc_host`) not freed.
    pub fn host_allocs_in_use(&self) -> usize {
        sync::lock(&self.inner.state).host_allocs.len()
    }

    /// Registrations running in the driver right now.
    pub fn registers_running(&self) -> usize {
        sync::lock(&self.inner.state).registers_running
    }

    /// Async copy enqueues so far, single or batched (tests check that a
    /// backend makes no copy it should not, such as a table upload).
    pub fn copy_enqueues(&self) -> u64 {
        sync::lock(&self.inner.state).faults.copy_calls()
    }

    /// Single async copies (`copy_htod_async`, `copy_dtoh_async`) so far
    /// whose host side is not page-locked (neither registered nor from
    /// `mem_alloc_host`, which the sim records as registered).
    pub fn pageable_async_copies(&self) -> u64 {
        sync::lock(&self.inner.state).pageable_async_copies
    }

    /// Successful `host_register` calls so far: the driver's own count
    /// (models compare it with what the coordinator claims).
    pub fn registrations_completed(&self) -> u64 {
        sync::lock(&self.inner.state).registrations_completed
    }

    /// Every call refused by the capture rules so far, oldest first, with
    /// the rule (the measured row, or the missing one) that refused it.
    pub fn refusals(&self) -> Vec<Refusal> {
        sync::lock(&self.inner.state).refusals.clone()
    }

    /// The driver entry points of the measured table
    /// (`src/runtime/sim/rules.rs`): the calls the simulated GPU lets
    /// through during another thread's GLOBAL capture when their row says
    /// so; every other call is refused there.
    pub fn measured_calls() -> Vec<&'static str> {
        rules::MEASURED.iter().map(|r| r.call.driver_name()).collect()
    }

    /// The sticky context error, if the context is poisoned.
    pub fn poisoned(&self) -> Option<Code> {
        sync::lock(&self.inner.state).poisoned
    }
}
