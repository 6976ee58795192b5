//! The abstract GPU runtime: exactly the driver operations the offload code
//! needs, with two implementations.
//!
//! - [`cuda::CudaRuntime`] (normal builds): the CUDA driver API through
//!   cudarc, loaded at run time, so the crate builds with no CUDA installed.
//! - [`sim::SimRuntime`]: a GPU simulated on host memory that follows the
//!   driver rules measured on an H200 (FACTS.md section 1); the runtime that
//!   loom explores and the default where no GPU exists.
//!
//! Every operation returns a [`DriverResult`]: the crate never ignores a
//! driver return code. Operations a FACTS.md row calls *capture-unsafe*
//! (they fail with 900 and invalidate a GLOBAL capture when made from a
//! thread in default mode) are marked so in their docs; library threads must
//! not make them while an engine may be capturing, unless they switched
//! themselves to [`CaptureMode::Relaxed`] and the row says relaxed is safe.

#[cfg(not(loom))]
pub mod cuda;
mod error;
pub mod sim;
mod types;

pub use error::{Code, DriverError, DriverResult, OpenError};
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
/// host memory asynchronously are `unsafe`: the caller promises the memory
/// stays mapped (and, for registration, is not unmapped while registered)
/// until the operation has completed on the device.
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

    /// `cuMemHostRegister`. Capture-unsafe (FACTS 1, row "cuMemHostRegister").
    ///
    /// # Safety
    /// `[addr, addr+len)` is a live mapping that stays mapped until it is
    /// unregistered.
    unsafe fn host_register(&self, addr: usize, len: usize) -> DriverResult<()>;
    /// `cuMemHostUnregister` of a range registered at `addr`. Waits for the
    /// device to go idle. Capture-unsafe (FACTS 1, row "cuMemHostUnregister").
    fn host_unregister(&self, addr: usize) -> DriverResult<()>;
    /// `cuMemHostGetDevicePointer`: the device's alias of registered host
    /// memory (fails with INVALID_VALUE for memory that is not registered).
    fn host_device_ptr(&self, addr: usize) -> DriverResult<DevicePtr>;

    /// `cuMemAlloc`. Capture-unsafe (FACTS 1, row "cuMemAlloc").
    fn mem_alloc(&self, bytes: usize) -> DriverResult<DevicePtr>;
    /// `cuMemFree`.
    fn mem_free(&self, ptr: DevicePtr) -> DriverResult<()>;
    /// `cuMemAllocHost` (page-locked host allocation). Capture-unsafe
    /// (FACTS 1, row "cuMemAllocHost").
    fn mem_alloc_host(&self, bytes: usize) -> DriverResult<usize>;
    /// `cuMemFreeHost`.
    fn mem_free_host(&self, addr: usize) -> DriverResult<()>;

    /// `cuStreamCreate` (non-blocking).
    fn stream_create(&self) -> DriverResult<Stream>;
    /// `cuStreamDestroy`.
    fn stream_destroy(&self, stream: Stream) -> DriverResult<()>;
    /// `cuStreamSynchronize`. Capture-unsafe (FACTS 1, row "cuStreamSynchronize").
    fn stream_synchronize(&self, stream: Stream) -> DriverResult<()>;
    /// `cuCtxSynchronize`. Capture-unsafe even in relaxed mode (FACTS 1, row
    /// "cuCtxSynchronize").
    fn ctx_synchronize(&self) -> DriverResult<()>;
    /// `cuStreamWaitEvent`: later work on `stream` waits for `event`.
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
    /// Synchronous `cuMemcpyHtoD` (FACTS 1: allowed during a capture).
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
    /// driver answers 900 and records nothing (FACTS 3, "cuMemcpyBatchAsync
    /// INSIDE a stream capture"), so never call it on a capturing stream.
    ///
    /// # Safety
    /// As for the single async copies, for every fragment.
    unsafe fn copy_batch_async(&self, dir: Direction, fragments: &[Fragment], stream: Stream) -> DriverResult<()>;
    /// `cuMemsetD8Async`.
    fn memset_d8_async(&self, dst: DevicePtr, value: u8, bytes: usize, stream: Stream) -> DriverResult<()>;
    /// `cuLaunchKernel` of one of the crate's kernels.
    fn launch(&self, kernel: Kernel, stream: Stream) -> DriverResult<()>;

    /// `cuEventCreate` (timing disabled).
    fn event_create(&self) -> DriverResult<Event>;
    /// `cuEventDestroy`.
    fn event_destroy(&self, event: Event) -> DriverResult<()>;
    /// `cuEventRecord`: the event completes when the work enqueued on
    /// `stream` before it does.
    fn event_record(&self, event: Event, stream: Stream) -> DriverResult<()>;
    /// `cuEventQuery`: `Ok(true)` when complete, `Ok(false)` for NOT_READY.
    /// Capture-unsafe (FACTS 1, row "cuEventRecord + cuEventQuery").
    fn event_query(&self, event: Event) -> DriverResult<bool>;
    /// `cuEventSynchronize`. Capture-unsafe (same row as the query).
    fn event_synchronize(&self, event: Event) -> DriverResult<()>;

    /// `cuStreamBeginCapture`. Blocks while another thread's registration is
    /// running (FACTS 1, ordering effects).
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
