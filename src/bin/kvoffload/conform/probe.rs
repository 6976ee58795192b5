//! Observation helpers for the conformance scenarios: host buffers, a
//! logical clock that orders call returns across threads, and a
//! registration kept "running" long enough for another thread to act.
//!
//! On the simulated GPU a registration is held at a hold point and released
//! once the other thread is seen blocked, so every scenario is
//! deterministic. On a real GPU the registration is of 8 GiB of untouched
//! memory (seconds of page pinning: docs/driver-rules.md, row "One
//! registration of untouched pages"); the harness learns that it is
//! running from the registering thread's kernel CPU time in
//! /proc/self/task/TID/stat, never from a sleep.
//!
//! Scenarios make capture-unsafe calls while another thread captures, on
//! purpose: what the driver does then is what they measure. The runtime
//! asks every such call for a [`Gate`], which only a coordinator hands out;
//! each scenario makes a coordinator of its own with no region
//! ([`scenario_coordinator`]). It knows nothing of the scenarios' captures
//! (they are opened on the runtime directly, not through its windows), so
//! it never holds a call back: the calls reach the driver exactly when the
//! scenario makes them.

use std::time::{Duration, Instant};

use kvoffload::internal::protocol::{CapturePolicy, Coordinator};
use kvoffload::internal::runtime::sim::{Blocked, Hold, HoldPoint, SimRuntime};
use kvoffload::internal::runtime::{DriverError, DriverResult, Gate, GpuRuntime};
use kvoffload::internal::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::Request;

/// The runtime a scenario runs on, with what the harness needs to steer it.
#[derive(Clone)]
pub enum Target {
    Sim(Arc<SimRuntime>),
    Real(Arc<dyn GpuRuntime>),
}

impl Target {
    pub fn rt(&self) -> Arc<dyn GpuRuntime> {
        match self {
            Target::Sim(s) => s.clone(),
            Target::Real(r) => r.clone(),
        }
    }
}

/// A scenario's own coordinator for `rt`, for the gate of its
/// capture-unsafe calls (see the module docs): no region, and no capture
/// window ever opened through it, so its gate never waits and never
/// refuses. One scenario runs at a time, so no other coordinator guards
/// `rt` (if one did, that is the scenario's error).
pub fn scenario_coordinator(rt: &dyn GpuRuntime) -> Result<Arc<Coordinator>, String> {
    Coordinator::without_region(rt, CapturePolicy::AfterPinning).map_err(|e| format!("the scenario's coordinator: {e}"))
}

/// `f` through `coord`'s gate; the coordinator's refusal (none is expected:
/// see [`scenario_coordinator`]) as the scenario's error.
pub fn gate<T>(coord: &Coordinator, what: &'static str, f: impl FnOnce(&Gate) -> T) -> Result<T, String> {
    coord.unsafe_call(what, Request::new(), f).map_err(|e| format!("{what}: {e}"))
}

/// [`gate`] of a driver call whose failure is the scenario's error too.
pub fn gated<T>(
    coord: &Coordinator,
    what: &'static str,
    f: impl FnOnce(&Gate) -> DriverResult<T>,
) -> Result<T, String> {
    gate(coord, what, f)?.map_err(|e: DriverError| format!("{what}: {e}"))
}

static CLOCK: AtomicU64 = AtomicU64::new(1);

/// A tick of the logical clock: a later tick means "returned later".
pub fn tick() -> u64 {
    CLOCK.fetch_add(1, Ordering::SeqCst)
}

/// Page-aligned anonymous host memory, touched so it is resident.
pub struct HostBuf {
    map: memmap2::MmapMut,
}

impl HostBuf {
    pub fn new(bytes: usize, fill: u8) -> Result<Self, String> {
        let mut map = memmap2::MmapMut::map_anon(bytes).map_err(|e| format!("mmap of {bytes} bytes: {e}"))?;
        map.fill(fill);
        Ok(HostBuf { map })
    }

    /// Untouched anonymous memory (registration has to fault every page).
    pub fn untouched(bytes: usize) -> Result<Self, String> {
        let map = memmap2::MmapMut::map_anon(bytes).map_err(|e| format!("mmap of {bytes} bytes: {e}"))?;
        Ok(HostBuf { map })
    }

    pub fn addr(&self) -> usize {
        self.map.as_ptr() as usize
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub fn fill(&mut self, v: u8) {
        self.map.fill(v);
    }
}

/// What the registering thread returns: the registration's result (or the
/// gate's refusal), its return tick, its duration.
type Registered = (Result<DriverResult<()>, String>, u64, Duration);

/// A registration running on its own thread.
pub struct LongRegister {
    target: Target,
    coord: Arc<Coordinator>,
    hold: Option<Hold>,
    tid: Arc<AtomicI64>,
    handle: Option<thread::JoinHandle<Registered>>,
    buf: Arc<HostBuf>,
    registered: bool,
}

/// Bytes the real-GPU long registration pins: several seconds on an H200.
const REAL_LONG_BYTES: usize = 8 << 30;

impl LongRegister {
    /// Starts registering a fresh buffer on a new thread, through the gate
    /// of `coord` (the scenario's own, see the module docs: the registration
    /// is meant to overlap the scenario's capture).
    pub fn start(target: &Target, coord: &Arc<Coordinator>) -> Result<Self, String> {
        let (bytes, hold) = match target {
            Target::Sim(s) => (1 << 20, Some(s.hold(HoldPoint::Register))),
            Target::Real(_) => (REAL_LONG_BYTES, None),
        };
        let buf = Arc::new(HostBuf::untouched(bytes)?);
        let tid = Arc::new(AtomicI64::new(0));
        let (rt, c, b, t) = (target.rt(), coord.clone(), buf.clone(), tid.clone());
        let handle = thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            t.store(i64::from(unsafe { libc::gettid() }), Ordering::SeqCst);
            let start = Instant::now();
            let r = gate(&c, "the long registration", |g| {
                // SAFETY: `b` keeps the mapping alive for the whole scenario,
                // and the scenario unregisters it before dropping the
                // LongRegister.
                unsafe { rt.host_register(g, b.addr(), b.len()) }
            });
            (r, tick(), start.elapsed())
        });
        let coord = coord.clone();
        Ok(LongRegister { target: target.clone(), coord, hold, tid, handle: Some(handle), buf, registered: false })
    }

    /// Returns once the registration is under way inside the driver.
    pub fn wait_running(&self) -> Result<(), String> {
        if let Some(h) = &self.hold {
            h.wait_entered();
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let tid = loop {
            let t = self.tid.load(Ordering::SeqCst);
            if t != 0 {
                break t;
            }
            if Instant::now() > deadline {
                return Err("registering thread did not start".into());
            }
            thread::yield_now();
        };
        let base = kernel_ticks(tid).unwrap_or(0);
        // Two clock ticks (20 ms at 100 Hz) of kernel time spent pinning.
        loop {
            match kernel_ticks(tid) {
                Some(t) if t >= base + 2 => return Ok(()),
                Some(_) => {}
                None => return Err("registering thread ended before it was seen running".into()),
            }
            if Instant::now() > deadline {
                return Err("registration never showed kernel time".into());
            }
            thread::yield_now();
        }
    }

    /// On the simulated GPU: releases the held registration once `n` threads
    /// are blocked in `kind` (from a helper thread, since the caller is about
    /// to block). On a real GPU the registration ends by itself.
    pub fn release_when(&mut self, kind: Blocked) {
        release_hold_when(&self.target, self.hold.take(), kind);
    }

    /// Releases a held registration at once (simulated GPU).
    pub fn release(&mut self) {
        if let Some(h) = self.hold.take() {
            h.release();
        }
    }

    /// Waits for the registration: its result, its return tick, its duration.
    pub fn join(&mut self) -> Result<(DriverResult<()>, u64, Duration), String> {
        // A hold still armed here is no longer needed by the scenario.
        self.release();
        let h = self.handle.take().ok_or("joined twice")?;
        let (r, t, d) = h.join().map_err(|_| "registering thread panicked".to_string())?;
        let r = r?;
        self.registered = r.is_ok();
        Ok((r, t, d))
    }

    /// Unregisters the buffer if the registration succeeded. Call it once
    /// no capture is open any more (unregister is capture-unsafe).
    pub fn unregister(self) -> Result<(), String> {
        if self.registered {
            let rt = self.target.rt();
            gated(&self.coord, "cleanup", |g| rt.host_unregister(g, self.buf.addr()))?;
        }
        Ok(())
    }
}

/// Kernel CPU time (stime) of thread `tid`, in clock ticks.
fn kernel_ticks(tid: i64) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    let tail = &s[s.rfind(')')? + 1..];
    // Fields after the command name start at field 3 (state); stime is 15.
    tail.split_whitespace().nth(12)?.parse().ok()
}

/// On the simulated GPU, releases `hold` from a helper thread once a thread
/// is blocked in `kind` (or after 10 s, when the scenario will report the
/// mismatch); on a real GPU there is no hold and nothing to do.
pub fn release_hold_when(target: &Target, hold: Option<Hold>, kind: Blocked) {
    if let (Target::Sim(s), Some(h)) = (target, hold) {
        let s = s.clone();
        thread::spawn(move || {
            s.wait_blocked_timeout(kind, 1, Duration::from_secs(10));
            h.release();
        });
    }
}
