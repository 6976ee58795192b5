//! The simulated GPU's state: streams, events, graphs, memory, captures.
//! Everything lives behind one mutex in [`super::SimRuntime`]; this module
//! only holds data and pure lookups. Ordered maps only: loom replays an
//! execution and needs every iteration order to repeat.

use std::collections::{BTreeMap, VecDeque};

use crate::runtime::{CaptureMode, Code, DevicePtr, Kernel};
use crate::sync::thread::ThreadId;
use crate::sync::Arc;

use super::fault::Faults;
use super::memory::HostBudget;

/// Why a call was refused, as the simulated GPU reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The driver entry point refused.
    pub call: &'static str,
    /// The rule that refused it: a measured row ("capture-unsafe: ...") or
    /// the missing one ("no measured row ...").
    pub reason: String,
}

/// Device aliases of registered host memory live above this bit, so a
/// pointer says by itself whether it names device or host memory.
pub(crate) const HOST_ALIAS_BIT: u64 = 1 << 62;
/// First address handed out by the simulated `cuMemAlloc`.
const DEVICE_BASE: DevicePtr = DevicePtr(0x7f00_0000_0000 & !HOST_ALIAS_BIT);

/// One range of simulated device memory.
pub(crate) enum DeviceMem {
    /// Allocated by the simulated `cuMemAlloc`: the sim owns the bytes.
    Owned(Vec<u8>),
    /// The caller's host memory, adopted as device memory in place
    /// (`SimRuntime::adopt_host_memory`): device work reads and writes the
    /// `len` bytes at `addr`, which the caller keeps valid until
    /// `release_adopted`. Not counted in `State::device_used`.
    Adopted { addr: usize, len: usize },
}

impl DeviceMem {
    pub fn len(&self) -> usize {
        match self {
            DeviceMem::Owned(v) => v.len(),
            DeviceMem::Adopted { len, .. } => *len,
        }
    }

    /// The first byte of the range.
    fn base_ptr(&mut self) -> *mut u8 {
        match self {
            DeviceMem::Owned(v) => v.as_mut_ptr(),
            DeviceMem::Adopted { addr, .. } => *addr as *mut u8,
        }
    }
}

/// One unit of stream work.
#[derive(Clone, Debug)]
pub(crate) enum Op {
    HtoD {
        dst: DevicePtr,
        src: usize,
        bytes: usize,
    },
    DtoH {
        dst: usize,
        src: DevicePtr,
        bytes: usize,
    },
    Memset {
        dst: DevicePtr,
        value: u8,
        bytes: usize,
    },
    /// A kernel launch, as `launch` was given it ([`Kernel`]'s docs say what
    /// each does; the spin kernel has no memory effect here). A table is read
    /// when the kernel runs, not at launch.
    Kernel(Kernel),
    /// Wait until `stream` has completed `seq` operations.
    WaitEvent {
        stream: u64,
        seq: u64,
    },
    /// Replay of a captured graph.
    Graph(Arc<GraphBody>),
}

/// What a capture recorded.
#[derive(Debug, Default)]
pub(crate) struct GraphBody {
    pub ops: Vec<Op>,
    /// Host ranges that were registered when the capture recorded a copy
    /// touching them: the graph's device work uses their device mapping.
    pub registered_refs: Vec<(usize, usize)>,
}

pub(crate) struct Capture {
    pub mode: CaptureMode,
    pub owner: ThreadId,
    pub invalidated: bool,
    pub body: GraphBody,
}

/// A stream that joined another stream's capture by waiting on an event
/// recorded in it (cross-stream capture): its work is recorded into the
/// origin's capture until the origin waits on an event recorded on it
/// after its last work (it rejoined).
#[derive(Clone, Debug)]
pub(crate) struct Join {
    /// The stream whose `capture` this stream takes part in.
    pub origin: u64,
    /// Operations recorded on this stream since it joined.
    pub ops: u64,
    /// True when the origin waits on everything this stream recorded.
    pub rejoined: bool,
}

#[derive(Default)]
pub(crate) struct StreamState {
    pub queue: VecDeque<(u64, Op)>,
    pub enqueued: u64,
    pub completed: u64,
    /// A device worker is executing this stream's head operation (taken off
    /// the queue, not yet completed): no other worker takes the next one,
    /// and the device is not idle.
    pub executing: bool,
    /// The capture this stream began (it is the capture's origin).
    pub capture: Option<Capture>,
    /// The capture of another stream this one joined.
    pub joined: Option<Join>,
}

/// Where a record inside a capture was made: a captured event.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct CapturedRecord {
    /// The origin stream of the capture.
    pub origin: u64,
    /// The stream it was recorded on (the origin or a joined stream).
    pub stream: u64,
    /// That stream's recorded operations at the record (a joined stream's
    /// `Join::ops`; 0 on the origin).
    pub at_ops: u64,
}

#[derive(Default)]
pub(crate) struct EventState {
    /// (stream, sequence number) of the last record, if any.
    pub recorded: Option<(u64, u64)>,
    /// Made with timing (`event_create_timed`): the device stamps when its
    /// last record is reached, for `event_elapsed`.
    pub timed: bool,
    /// When the device reached the last record (timed events only).
    pub reached_at: Option<std::time::Instant>,
    /// Set when the last record was made inside a capture (a captured
    /// event: waiting on it joins the capture).
    pub captured: Option<CapturedRecord>,
}

/// Which blocking waits threads are in right now (observable by tests).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Blocked {
    /// `begin_capture` waiting for a running registration.
    BeginCapture,
    /// `host_unregister` (or `mem_free`, or `SimRuntime::release_adopted`)
    /// waiting for the device to go idle.
    Idle,
    /// `stream_synchronize` (or a synchronous copy) waiting for a stream's
    /// work to finish.
    Stream,
}

#[derive(Default)]
pub(crate) struct State {
    next_id: u64,
    next_device: DevicePtr,
    pub streams: BTreeMap<u64, StreamState>,
    /// Destroyed streams whose queued work has not finished: their handles
    /// are invalid (not in `streams`), the device still runs their work and
    /// drops them once it is done, as `cuStreamDestroy` does.
    pub draining: BTreeMap<u64, StreamState>,
    pub events: BTreeMap<u64, EventState>,
    pub graphs: BTreeMap<u64, Arc<GraphBody>>,
    /// Device memory by base address: the sim's own allocations
    /// (`mem_alloc`) and host memory adopted in place
    /// (`SimRuntime::adopt_host_memory`).
    pub device_mem: BTreeMap<DevicePtr, DeviceMem>,
    pub device_limit: usize,
    pub device_used: usize,
    /// The most `device_used` has been (tests: nothing allocated at all).
    pub device_peak: usize,
    pub host_allocs: BTreeMap<usize, Vec<u8>>,
    /// Bytes of `host_allocs`.
    pub host_alloc_used: usize,
    /// Whether the host can back one more allocation (`memory.rs`).
    pub host_budget: HostBudget,
    /// Registered host ranges: start -> length.
    pub registered: BTreeMap<usize, usize>,
    pub registers_running: usize,
    pub thread_modes: Vec<(ThreadId, CaptureMode)>,
    /// Sticky context error (docs/driver-rules.md, "Replay after unregister": 719).
    pub poisoned: Option<Code>,
    /// Copies enqueued for execution whose host side was pageable (not
    /// registered, not from `mem_alloc_host`) when enqueued
    /// ([`SimRuntime::pageable_copies`](super::SimRuntime::pageable_copies)).
    pub pageable_copies: u64,
    pub stop: bool,
    pub blocked: Vec<Blocked>,
    pub faults: Faults,
    /// Successful `host_register` calls since start (observers for models:
    /// the driver's count, not the coordinator's).
    pub registrations_completed: u64,
    /// Async copies enqueued from or to host memory that is not page-locked
    /// (neither registered nor from `mem_alloc_host`): on the real driver
    /// they are staged through the driver's own buffer and do not overlap
    /// the caller (observers: tests check a backend avoids them).
    pub pageable_async_copies: u64,
    /// Calls refused by the capture rules, oldest first (observers).
    pub refusals: Vec<Refusal>,
}

impl State {
    pub fn new(device_limit: usize, host_budget: HostBudget) -> Self {
        State { next_id: 1, next_device: DEVICE_BASE, device_limit, host_budget, ..Default::default() }
    }

    /// Room for `bytes` more of the sim's memory (device or page-locked
    /// host): the host can back them, with everything handed out so far.
    pub fn host_can_back(&mut self, bytes: usize) -> bool {
        let out = self.device_used.saturating_add(self.host_alloc_used);
        self.host_budget.fits(out, bytes)
    }

    pub fn fresh_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Reserves `bytes` of simulated device address space, 256-byte aligned
    /// with a guard gap so adjacent allocations never touch.
    pub fn fresh_device_addr(&mut self, bytes: usize) -> DevicePtr {
        let base = self.next_device;
        let span = (bytes as u64).div_ceil(256) * 256 + 4096;
        self.next_device = DevicePtr(self.next_device.raw() + span);
        base
    }

    /// The host range registered around `[addr, addr+bytes)`, if the whole
    /// range lies inside one registration.
    pub fn registered_range(&self, addr: usize, bytes: usize) -> Option<(usize, usize)> {
        let (&start, &len) = self.registered.range(..=addr).next_back()?;
        let end = addr.checked_add(bytes)?;
        (end <= start + len).then_some((start, len))
    }

    /// True when any registered range overlaps `[addr, addr+bytes)`.
    pub fn overlaps_registration(&self, addr: usize, bytes: usize) -> bool {
        let end = addr.saturating_add(bytes);
        if let Some((&s, &l)) = self.registered.range(..=addr).next_back() {
            if s + l > addr {
                return true;
            }
        }
        self.registered.range(addr..end).next().is_some()
    }

    /// True when `[addr, addr+bytes)` overlaps host memory adopted as device
    /// memory.
    pub fn overlaps_adoption(&self, addr: usize, bytes: usize) -> bool {
        let end = addr.saturating_add(bytes);
        self.device_mem.values().any(|m| match *m {
            DeviceMem::Adopted { addr: a, len } => a < end && addr < a.saturating_add(len),
            DeviceMem::Owned(_) => false,
        })
    }

    /// Raw pointer to `[ptr, ptr+bytes)` of device memory (allocated or
    /// adopted), or of registered host memory through its device alias;
    /// `None` if out of bounds or not (any longer) registered or adopted.
    pub fn device_slice(&mut self, ptr: DevicePtr, bytes: usize) -> Option<*mut u8> {
        if ptr.raw() & HOST_ALIAS_BIT != 0 {
            let addr = (ptr.raw() & !HOST_ALIAS_BIT) as usize;
            return self.registered_range(addr, bytes).map(|_| addr as *mut u8);
        }
        let (&base, mem) = self.device_mem.range_mut(..=ptr).next_back()?;
        let off = usize::try_from(ptr.raw() - base.raw()).ok()?;
        let end = off.checked_add(bytes)?;
        if end > mem.len() {
            return None;
        }
        // Pointer arithmetic inside the range: `off + bytes <= len`.
        Some(mem.base_ptr().wrapping_add(off))
    }

    /// Copies `words` native `u64`s out of device memory (or registered host
    /// memory through its alias) at `ptr`; `None` when out of bounds.
    pub fn read_device_words(&mut self, ptr: DevicePtr, words: usize) -> Option<Vec<u64>> {
        let bytes = words.checked_mul(8)?;
        if bytes == 0 {
            return Some(Vec::new());
        }
        let p = self.device_slice(ptr, bytes)?;
        let mut out = vec![0u64; words];
        // SAFETY: `p..p+bytes` was bounds-checked by `device_slice` against a
        // live allocation (or a registered host range) and the state lock is
        // held, so it is not freed meanwhile; `out` holds exactly `bytes`
        // bytes; byte-wise copy, so `p` needs no alignment.
        unsafe { std::ptr::copy_nonoverlapping(p as *const u8, out.as_mut_ptr() as *mut u8, bytes) };
        Some(out)
    }

    /// True when no stream has work left and nothing runs.
    pub fn idle(&self) -> bool {
        self.streams.values().chain(self.draining.values()).all(|s| s.queue.is_empty() && !s.executing)
    }

    /// A live stream (its handle valid).
    pub fn stream_mut(&mut self, id: u64) -> Option<&mut StreamState> {
        self.streams.get_mut(&id)
    }

    /// A stream the device runs: live, or destroyed with work left.
    pub fn device_stream(&self, id: u64) -> Option<&StreamState> {
        self.streams.get(&id).or_else(|| self.draining.get(&id))
    }

    /// [`State::device_stream`], mutable.
    pub fn device_stream_mut(&mut self, id: u64) -> Option<&mut StreamState> {
        match self.streams.get_mut(&id) {
            Some(s) => Some(s),
            None => self.draining.get_mut(&id),
        }
    }

    /// True when everything enqueued on stream `id` up to `seq` has
    /// executed (a stream that is gone finished all of its work).
    /// The device finished stream `id`'s operations up to `seq`: marks it,
    /// and stamps the timed events whose last record it reached.
    pub fn complete(&mut self, id: u64, seq: u64) {
        if let Some(s) = self.device_stream_mut(id) {
            s.completed = seq;
        }
        let mut now = None;
        for e in self.events.values_mut() {
            if e.timed && e.reached_at.is_none() && matches!(e.recorded, Some((sid, q)) if sid == id && q <= seq) {
                e.reached_at = Some(*now.get_or_insert_with(std::time::Instant::now));
            }
        }
    }

    pub fn reached(&self, id: u64, seq: u64) -> bool {
        self.device_stream(id).is_none_or(|s| s.completed >= seq)
    }

    /// Drops the destroyed streams whose work is done.
    pub fn drop_drained(&mut self) {
        self.draining.retain(|_, s| s.completed < s.enqueued);
    }

    /// The origin stream of the capture stream `id` takes part in: itself
    /// when it began one, the origin when it joined one.
    pub fn capture_origin(&self, id: u64) -> Option<u64> {
        let s = self.streams.get(&id)?;
        if s.capture.is_some() {
            return Some(id);
        }
        let origin = s.joined.as_ref()?.origin;
        self.streams.get(&origin).and_then(|o| o.capture.as_ref()).map(|_| origin)
    }

    pub fn thread_mode(&self, t: ThreadId) -> CaptureMode {
        // A thread that never exchanged its mode is in GLOBAL mode (driver default).
        self.thread_modes.iter().find(|(id, _)| *id == t).map_or(CaptureMode::Global, |(_, m)| *m)
    }

    pub fn set_thread_mode(&mut self, t: ThreadId, mode: CaptureMode) -> CaptureMode {
        let old = self.thread_mode(t);
        match self.thread_modes.iter_mut().find(|(id, _)| *id == t) {
            Some(slot) => slot.1 = mode,
            None => self.thread_modes.push((t, mode)),
        }
        old
    }

    pub fn blocked_count(&self, kind: Blocked) -> usize {
        self.blocked.iter().filter(|b| **b == kind).count()
    }

    pub fn unblock(&mut self, kind: Blocked) {
        if let Some(i) = self.blocked.iter().position(|b| *b == kind) {
            self.blocked.swap_remove(i);
        }
    }
}
