//! The abstract GPU runtime: exactly the driver operations the offload code
//! needs, with two implementations.
//!
//! - [`cuda::CudaRuntime`] (normal builds): the CUDA driver API through
//!   cudarc, loaded at run time, so the crate builds with no CUDA installed.
//! - [`sim::SimRuntime`]: a GPU simulated on host memory that follows the
//!   driver rules measured on an H200 (docs/driver-rules.md); the runtime that
//!   loom explores and the default where no GPU exists.
//!
//! Every operation returns a [`DriverResult`]: the crate never ignores a
//! driver return code.
//!
//! # The capture rule, as a type
//!
//! A driver call is *capture-unsafe* when, made by one thread while another
//! thread has a GLOBAL stream capture open, it fails with 900 and
//! invalidates that capture. Every such operation of [`GpuRuntime`] takes a
//! [`Gate`]: proof that the call runs inside the gate of the coordinator
//! that guards this runtime handle
//! ([`crate::protocol::Coordinator::unsafe_call`]), which never lets it
//! overlap one of that coordinator's capture windows. Nothing outside the
//! coordinator's module can make a `Gate` (its constructor needs the one
//! gate seal of the process, which that module holds), a runtime handle
//! accepts the gates of the one coordinator bound to it ([`GateBinding`]),
//! and a second coordinator for a bound handle cannot be made. So a
//! capture-unsafe call made anywhere else does not compile, or is refused
//! with [`Code::GATE_REFUSED`]:
//!
//! ```compile_fail,E0061
//! use kvoffload::{GpuRuntime, SimRuntime};
//! let rt = SimRuntime::new();
//! // error: no `Gate` to pass, and none can be made here.
//! let p = rt.mem_alloc(1 << 20);
//! ```
//!
//! ```compile_fail,E0451
//! // error: `Gate` has private fields and no public constructor.
//! let g = kvoffload::internal::runtime::Gate { serial: 1 };
//! ```
//!
//! ```compile_fail,E0603
//! // error: the seal that mints gates is private to the crate.
//! let s = kvoffload::internal::runtime::GateSeal::take();
//! ```
//!
//! The gated operations, each with the measurement that makes it unsafe
//! (docs/driver-rules.md, section 1 rows; "cell" names a conformance
//! scenario of `kvoffload conform`, measured on an H200 and committed in
//! docs/conformance-h200.md): `host_register` and `host_unregister` (rows
//! "cuMemHostRegister", "cuMemHostUnregister"; cells `register`,
//! `unregister`), `mem_alloc` and `mem_alloc_host` (rows "cuMemAlloc",
//! "cuMemAllocHost"), `mem_free` and `mem_free_host` (cells `mem_free`,
//! `mem_free_host`), `stream_synchronize` (row "cuStreamSynchronize", cell
//! `stream_sync_other`), `ctx_synchronize` (row "cuCtxSynchronize", unsafe
//! even relaxed), `event_query` and `event_synchronize` (cells
//! `event_query`, `event_record_query`, `event_sync`).
//!
//! # Operations made without the gate
//!
//! Every other operation takes no gate. Each one a library thread makes was
//! measured safe during another thread's GLOBAL capture, in default and in
//! relaxed mode (the call returned success and the capture ended with a
//! working graph), on a stream that takes no part in that capture:
//!
//! | operation | measured by |
//! |---|---|
//! | `copy_htod_async` | cells `copy_async_pinned`, `copy_async_pageable` |
//! | `copy_htod` | cell `copy_sync_pinned` |
//! | `copy_dtoh_async` | cell `copy_dtoh_async_pinned` |
//! | `copy_dtoh` | cell `copy_sync_dtoh_pinned` |
//! | `copy_batch_async` (on a stream that does not capture) | cell `copy_batch_pinned` |
//! | `memset_d8_async` | cell `memset_async` |
//! | `launch` | cell `launch` |
//! | `event_create`, `event_destroy`, `event_record` | cells `event_create`, `event_destroy`, `event_record` |
//! | `stream_create`, `stream_destroy` | cells `stream_create`, `stream_destroy` |
//! | `stream_wait_event` (neither stream capturing) | cell `stream_wait_event` |
//! | `host_device_ptr` | cell `host_device_ptr` |
//! | `capture_status` (of a stream no other thread captures) | cell `capture_status_other` |
//! | `exchange_capture_mode` | every `cell/*/relaxed`: B switches itself to RELAXED and back during A's capture |
//!
//! (docs/driver-rules.md, section 1, has a row for each with the value
//! measured.)
//!
//! The capture operations themselves (`begin_capture`, `end_capture`) and
//! graphs (`graph_launch`, `graph_destroy`) belong to the thread that
//! captures; no library thread makes them, and nothing measured them made
//! by another thread during a GLOBAL capture.
//!
//! The simulated GPU holds these measurements as one table
//! (`src/runtime/sim/rules.rs`, `MEASURED`, each row citing its
//! measurement) and denies by default: during another thread's GLOBAL
//! capture it refuses every call the table does not list (900, the capture
//! invalidated), and any call touching a stream that takes part in another
//! thread's capture; it also stops the run (a panic) on a capture-unsafe
//! call whose [`Gate`] is not in flight on the calling thread, and refuses
//! one whose gate is of another coordinator, as the CUDA runtime does
//! ([`Code::GATE_REFUSED`]). So the loom models,
//! which run on it, rely on no call being harmless during a capture
//! without a measurement saying so.

#[cfg(not(any(loom, shuttle)))]
pub mod cuda;
mod error;
mod gate;
pub mod pattern;
pub mod sim;
mod types;

pub use error::{Code, DriverError, DriverResult, OpenError};
pub(crate) use gate::{CoordinatorId, GateSeal};
pub use gate::{Gate, GateBinding};
pub use types::{
    CaptureMode, CaptureStatus, DevicePtr, Direction, Event, Fragment, Graph, Kernel, Stream, GATHER_ENTRY_BYTES,
    GATHER_ENTRY_WORDS, PATTERN_ENTRY_BYTES, PATTERN_ENTRY_WORDS,
};

/// A runtime as `Arc<dyn GpuRuntime>` (works under loom too, whose `Arc`
/// cannot coerce to a trait object). [`GpuRuntime::as_sim`] gets the
/// simulated GPU back.
pub fn shared<T: GpuRuntime + 'static>(rt: T) -> crate::sync::Arc<dyn GpuRuntime> {
    fn coerce<T: GpuRuntime + 'static>(a: crate::sync::StdArc<T>) -> crate::sync::StdArc<dyn GpuRuntime> {
        a
    }
    crate::sync::arc_dyn(rt, coerce::<T>)
}

/// The driver operations the offload code needs.
///
/// Host memory is passed as plain addresses. Operations that read or write
/// memory asynchronously are `unsafe`: the caller promises the memory stays
/// mapped or allocated (and, for registration, is not unmapped while
/// registered) until the operation has completed on the device.
/// Capture-unsafe operations take a [`Gate`] (see the module docs).
pub trait GpuRuntime: Send + Sync {
    /// `"sim"` or `"cuda"`.
    fn backend(&self) -> &'static str;
    /// Device and driver, for reports (e.g. "NVIDIA H200, driver 13.0").
    fn describe(&self) -> String;
    /// The simulated GPU behind this runtime, if it is one (tests and
    /// models use its fault injection and observers).
    fn as_sim(&self) -> Option<&sim::SimRuntime> {
        None
    }
    /// Which coordinator's gates this handle accepts (see [`GateBinding`]):
    /// every capture-unsafe operation starts with
    /// `self.gate_binding().check(gate, name)?`.
    fn gate_binding(&self) -> &GateBinding;
    /// The device's PCI bus id as the driver names it (`0000:1B:00.0`),
    /// asked once when the runtime was opened and cached: pinning reads the
    /// GPU's NUMA node from sysfs with it. `None` when unknown (the
    /// simulated GPU). Makes no driver call.
    fn pci_bus_id(&self) -> Option<&str> {
        None
    }

    /// `cuMemHostRegister`. Capture-unsafe (docs/driver-rules.md, row "cuMemHostRegister").
    ///
    /// # Safety
    /// `[addr, addr+len)` is a live mapping that stays mapped until it is
    /// unregistered.
    unsafe fn host_register(&self, gate: &Gate, addr: usize, len: usize) -> DriverResult<()>;
    /// `cuMemHostUnregister` of a range registered at `addr`. Waits for the
    /// device to go idle (row "Unregister waits for the device"). Capture-unsafe
    /// (docs/driver-rules.md, row "cuMemHostUnregister").
    fn host_unregister(&self, gate: &Gate, addr: usize) -> DriverResult<()>;
    /// `cuMemHostGetDevicePointer`: the device's alias of registered host
    /// memory (fails with INVALID_VALUE for memory that is not registered).
    fn host_device_ptr(&self, addr: usize) -> DriverResult<DevicePtr>;

    /// `cuMemAlloc`. Capture-unsafe (docs/driver-rules.md, row "cuMemAlloc").
    fn mem_alloc(&self, gate: &Gate, bytes: usize) -> DriverResult<DevicePtr>;
    /// `cuMemFree`. Capture-unsafe (cell `mem_free`).
    ///
    /// # Safety
    /// No work still queued or running on the device reads or writes the
    /// allocation (a copy, kernel, memset or graph enqueued on it has
    /// completed, or its stream was synchronized), and nothing uses `ptr`
    /// afterwards: the driver may hand the memory out again at once.
    unsafe fn mem_free(&self, gate: &Gate, ptr: DevicePtr) -> DriverResult<()>;
    /// `cuMemAllocHost` (page-locked host allocation). Capture-unsafe
    /// (docs/driver-rules.md, row "cuMemAllocHost").
    fn mem_alloc_host(&self, gate: &Gate, bytes: usize) -> DriverResult<usize>;
    /// `cuMemFreeHost`. Capture-unsafe (cell `mem_free_host`).
    ///
    /// # Safety
    /// No device work still reads or writes the allocation, and no host
    /// code reads, writes or holds a reference into it afterwards: the
    /// memory is unmapped.
    unsafe fn mem_free_host(&self, gate: &Gate, addr: usize) -> DriverResult<()>;

    /// `cuStreamCreate` (non-blocking).
    fn stream_create(&self) -> DriverResult<Stream>;
    /// `cuStreamDestroy`: returns at once, also with work queued; the
    /// handle is invalid from then on and the device still runs that work.
    /// A caller that must know the work is done synchronizes first.
    fn stream_destroy(&self, stream: Stream) -> DriverResult<()>;
    /// `cuStreamSynchronize`. Capture-unsafe (docs/driver-rules.md, row
    /// "cuStreamSynchronize").
    fn stream_synchronize(&self, gate: &Gate, stream: Stream) -> DriverResult<()>;
    /// `cuCtxSynchronize`. Capture-unsafe even in relaxed mode
    /// (docs/driver-rules.md, row "cuCtxSynchronize").
    fn ctx_synchronize(&self, gate: &Gate) -> DriverResult<()>;
    /// `cuStreamWaitEvent`: later work on `stream` waits for `event`. On an
    /// event recorded in a capturing stream, `stream` joins that capture
    /// (its later work is captured, not run) until the origin stream waits
    /// on an event recorded on it after that work; ending the capture
    /// before fails with STREAM_CAPTURE_UNJOINED (904) (CUDA programming
    /// guide, cross-stream dependencies; conformance scenarios
    /// `order/cross_stream_capture_*`).
    fn stream_wait_event(&self, stream: Stream, event: Event) -> DriverResult<()>;

    /// `cuMemcpyHtoDAsync`.
    ///
    /// # Safety
    /// `[src, src+bytes)` is readable until the copy completes.
    unsafe fn copy_htod_async(&self, dst: DevicePtr, src: usize, bytes: usize, stream: Stream) -> DriverResult<()>;
    /// `cuMemcpyDtoHAsync`.
    ///
    /// # Safety
    /// `[dst, dst+bytes)` is writable, and not otherwise accessed, until the
    /// copy completes.
    unsafe fn copy_dtoh_async(&self, dst: usize, src: DevicePtr, bytes: usize, stream: Stream) -> DriverResult<()>;
    /// Synchronous `cuMemcpyHtoD` (allowed during a capture: docs/driver-rules.md,
    /// row "cuMemcpyHtoD").
    ///
    /// # Safety
    /// `[src, src+bytes)` is readable.
    unsafe fn copy_htod(&self, dst: DevicePtr, src: usize, bytes: usize) -> DriverResult<()>;
    /// Synchronous `cuMemcpyDtoH`.
    ///
    /// # Safety
    /// `[dst, dst+bytes)` is writable.
    unsafe fn copy_dtoh(&self, dst: usize, src: DevicePtr, bytes: usize) -> DriverResult<()>;
    /// `cuMemcpyBatchAsync`: every fragment in one call. Inside a capture the
    /// driver answers 900 and records nothing (docs/driver-rules.md, row
    /// "Batched copy inside a capture"; scenario
    /// `order/batch_copy_in_capture_dropped`), so never call it on a capturing
    /// stream.
    ///
    /// # Safety
    /// As for the single async copies, for every fragment.
    unsafe fn copy_batch_async(&self, dir: Direction, fragments: &[Fragment], stream: Stream) -> DriverResult<()>;
    /// `cuMemsetD8Async`.
    ///
    /// # Safety
    /// `[dst, dst+bytes)` is device memory of this runtime (or the alias of
    /// registered host memory) that stays allocated, and is not otherwise
    /// accessed, until the memset completes on the stream.
    unsafe fn memset_d8_async(&self, dst: DevicePtr, value: u8, bytes: usize, stream: Stream) -> DriverResult<()>;
    /// `cuLaunchKernel` of one of the crate's kernels.
    ///
    /// # Safety
    /// Every address the kernel reads or writes (its table and what the
    /// table's entries name, see [`Kernel`]) stays valid, and what it writes
    /// is not otherwise accessed, until the kernel completes on the stream;
    /// host memory it reaches is registered for as long.
    unsafe fn launch(&self, kernel: Kernel, stream: Stream) -> DriverResult<()>;

    /// `cuEventCreate` (timing disabled).
    fn event_create(&self) -> DriverResult<Event>;
    /// `cuEventDestroy`.
    fn event_destroy(&self, event: Event) -> DriverResult<()>;
    /// `cuEventRecord`: the event completes when the work enqueued on
    /// `stream` before it does.
    fn event_record(&self, event: Event, stream: Stream) -> DriverResult<()>;
    /// `cuEventQuery`: `Ok(true)` when complete, `Ok(false)` for NOT_READY.
    /// Capture-unsafe (docs/driver-rules.md, row "cuEventQuery"; cells
    /// `event_query`, `event_record_query`).
    fn event_query(&self, gate: &Gate, event: Event) -> DriverResult<bool>;
    /// `cuEventSynchronize`. Capture-unsafe (cell `event_sync`).
    fn event_synchronize(&self, gate: &Gate, event: Event) -> DriverResult<()>;
    /// `cuEventCreate` with timing enabled: an event that
    /// [`GpuRuntime::event_elapsed`] can read. Costlier to record than
    /// [`GpuRuntime::event_create`]'s, so only the transfer jobs' start and
    /// completion events are made this way. Same row as `cuEventCreate`
    /// (cells `event_create_timed/*` measure the flag).
    fn event_create_timed(&self) -> DriverResult<Event>;
    /// `cuEventElapsedTime_v2`: milliseconds of device time between two
    /// completed events made by [`GpuRuntime::event_create_timed`]
    /// (`NOT_READY` when either is still pending). Takes a `Gate` until its
    /// conformance cells (`event_elapsed/*`) are measured on the H200: a
    /// call with no measured row is capture-unsafe (docs/driver-rules.md).
    fn event_elapsed(&self, gate: &Gate, start: Event, end: Event) -> DriverResult<f32>;

    /// `cuStreamBeginCapture`. Blocks while another thread's registration is
    /// running (docs/driver-rules.md, row "begin_capture waits for a registration").
    fn begin_capture(&self, stream: Stream, mode: CaptureMode) -> DriverResult<()>;
    /// `cuStreamEndCapture` + `cuGraphInstantiate`. An invalidated capture
    /// ends with STREAM_CAPTURE_INVALIDATED and no graph.
    fn end_capture(&self, stream: Stream) -> DriverResult<Graph>;
    /// `cuStreamIsCapturing`.
    fn capture_status(&self, stream: Stream) -> DriverResult<CaptureStatus>;
    /// `cuThreadExchangeStreamCaptureMode` for the calling thread: sets
    /// `mode`, returns the previous one.
    fn exchange_capture_mode(&self, mode: CaptureMode) -> DriverResult<CaptureMode>;
    /// `cuGraphLaunch`.
    fn graph_launch(&self, graph: Graph, stream: Stream) -> DriverResult<()>;
    /// `cuGraphExecDestroy`.
    fn graph_destroy(&self, graph: Graph) -> DriverResult<()>;
}
