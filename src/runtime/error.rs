//! Driver result codes and the typed errors of the runtime layer.

use std::fmt;

/// A CUDA driver result code (`CUresult`), as returned by the real driver and
/// reproduced by the simulated GPU. Only the codes this crate reasons about
/// have names; any other value is carried through unchanged.
#[derive(Copy, Clone, PartialEq, Eq, Hash)]
pub struct Code(pub u32);

impl Code {
    /// `CUDA_SUCCESS`: the call succeeded. Never carried by a
    /// [`DriverError`].
    pub const SUCCESS: Code = Code(0);
    /// `CUDA_ERROR_INVALID_VALUE`: an argument is out of range, e.g. a
    /// zero-byte allocation or registration, an address that is not (the
    /// start of) an allocation of this runtime, or an empty batched copy.
    pub const INVALID_VALUE: Code = Code(1);
    /// `CUDA_ERROR_OUT_OF_MEMORY`: the driver could not get the memory for
    /// an allocation or a host registration. A registration failing with it
    /// ends pinning pageable with
    /// [`PageableReason::OutOfMemory`](crate::protocol::PageableReason::OutOfMemory)
    /// (or `MemlockLimit` when RLIMIT_MEMLOCK explains it).
    pub const OUT_OF_MEMORY: Code = Code(2);
    /// `CUDA_ERROR_NO_DEVICE`: the driver loaded but sees no CUDA device
    /// (reported when opening the runtime, see [`OpenError::Device`]).
    pub const NO_DEVICE: Code = Code(100);
    /// `CUDA_ERROR_INVALID_HANDLE`: a stream, event or graph that this
    /// runtime does not know (never created, or already destroyed), or a
    /// kernel whose module did not load.
    pub const INVALID_HANDLE: Code = Code(400);
    /// `CUDA_ERROR_NOT_READY`: the work an event waits for has not completed
    /// yet. Not an error for the crate:
    /// [`GpuRuntime::event_query`](super::GpuRuntime::event_query) turns it
    /// into `Ok(false)`.
    pub const NOT_READY: Code = Code(600);
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`: a kernel or copy touched an address
    /// that is neither device memory nor the device alias of registered host
    /// memory (e.g. the gather kernel reading unregistered host memory, what
    /// P3 rules out and negative N4 provokes). Sticky: the context is
    /// poisoned and every later call fails.
    pub const ILLEGAL_ADDRESS: Code = Code(700);
    /// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`: `host_register` of a
    /// range that overlaps memory already registered.
    pub const HOST_MEMORY_ALREADY_REGISTERED: Code = Code(712);
    /// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`: `host_unregister` of an
    /// address that does not start a registration.
    pub const HOST_MEMORY_NOT_REGISTERED: Code = Code(713);
    /// `CUDA_ERROR_MISALIGNED_ADDRESS`: a kernel accessed memory at an
    /// address not aligned for the access (e.g. a pattern table not 8-byte
    /// aligned). A device fault: sticky, like [`Code::ILLEGAL_ADDRESS`].
    pub const MISALIGNED_ADDRESS: Code = Code(716);
    /// `CUDA_ERROR_LAUNCH_FAILED`: work failed on the device.
    /// docs/driver-rules.md, row "Replay after unregister": replaying a graph that copies from host memory
    /// unregistered since its capture returns OK at launch and 719 at the
    /// next synchronize, sticky for the whole process (what P4 rules out and
    /// negative N5 provokes).
    pub const LAUNCH_FAILED: Code = Code(719);
    /// `CUDA_ERROR_NOT_SUPPORTED`: the operation is not supported here, e.g.
    /// host registration under Confidential Computing at every size (vLLM
    /// #55428; docs/driver-rules.md, row "Not supported under Confidential
    /// Computing"); pinning then ends pageable with
    /// [`PageableReason::NotSupported`](crate::protocol::PageableReason::NotSupported).
    pub const NOT_SUPPORTED: Code = Code(801);
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`: a capture-unsafe call made
    /// while another thread holds a GLOBAL capture (docs/driver-rules.md,
    /// section 1 and row "Refused call"; it also invalidates that capture,
    /// which P1 rules out), or a batched copy on a capturing stream (row
    /// "Batched copy inside a capture": the capture stays valid but records
    /// nothing).
    pub const STREAM_CAPTURE_UNSUPPORTED: Code = Code(900);
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`: the capture was invalidated
    /// by an earlier 900; `end_capture` returns it and no graph
    /// (docs/driver-rules.md, row "Refused call").
    pub const STREAM_CAPTURE_INVALIDATED: Code = Code(901);
    /// `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`: the capture sequence contains a
    /// fork that was not joined to the primary stream: `end_capture` on the
    /// origin stream while a stream that joined the capture (by waiting on
    /// an event recorded in it) has work the origin does not wait for
    /// (CUDA driver API docs, `cuStreamEndCapture`; conformance scenario
    /// `order/cross_stream_capture_unjoined`).
    pub const STREAM_CAPTURE_UNJOINED: Code = Code(904);
    /// `CUDA_ERROR_CAPTURED_EVENT`: the operation is not permitted on an
    /// event last recorded in a capturing stream (CUDA driver API docs);
    /// the simulated GPU answers it for queries and synchronizes of such an
    /// event, and for waits on one whose capture has ended.
    pub const CAPTURED_EVENT: Code = Code(907);
    /// `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`: a GLOBAL or THREAD_LOCAL
    /// capture ended by a thread other than the one that began it.
    pub const STREAM_CAPTURE_WRONG_THREAD: Code = Code(908);
    /// `CUDA_ERROR_ILLEGAL_STATE`: the call does not fit the object's state;
    /// the simulated GPU answers it for beginning a capture on a stream that
    /// already captures, ending one on a stream that does not, and
    /// destroying a capturing stream.
    pub const ILLEGAL_STATE: Code = Code(401);
    /// Not a driver code (the driver's codes stay below 1000): the runtime
    /// refused a capture-unsafe call whose [`Gate`](super::Gate) came from
    /// another coordinator than the one bound to this runtime handle, or
    /// came while no coordinator is bound (see `runtime::gate`). Nothing
    /// reached the driver.
    pub const GATE_REFUSED: Code = Code(10_000);

    /// The driver's name for the code, or `"CUDA_ERROR_OTHER"` for a code
    /// without a constant here (the number is in the `Debug` and `Display`
    /// forms).
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "CUDA_SUCCESS",
            1 => "CUDA_ERROR_INVALID_VALUE",
            2 => "CUDA_ERROR_OUT_OF_MEMORY",
            100 => "CUDA_ERROR_NO_DEVICE",
            400 => "CUDA_ERROR_INVALID_HANDLE",
            401 => "CUDA_ERROR_ILLEGAL_STATE",
            600 => "CUDA_ERROR_NOT_READY",
            700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
            712 => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
            713 => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
            716 => "CUDA_ERROR_MISALIGNED_ADDRESS",
            719 => "CUDA_ERROR_LAUNCH_FAILED",
            801 => "CUDA_ERROR_NOT_SUPPORTED",
            900 => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            901 => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
            904 => "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
            907 => "CUDA_ERROR_CAPTURED_EVENT",
            908 => "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
            10_000 => "KVOFFLOAD_GATE_REFUSED",
            _ => "CUDA_ERROR_OTHER",
        }
    }
}

impl fmt::Debug for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.0, self.name())
    }
}

/// A driver call that returned something other than success.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {code}")]
pub struct DriverError {
    /// The driver entry point, e.g. `"cuMemHostRegister"`.
    pub call: &'static str,
    /// The result code the call returned (never [`Code::SUCCESS`]).
    pub code: Code,
}

impl DriverError {
    /// The failure of driver entry point `call` with result `code`.
    pub fn new(call: &'static str, code: Code) -> Self {
        DriverError { call, code }
    }
}

/// Result of one driver operation.
pub type DriverResult<T> = Result<T, DriverError>;

/// Errors from opening a runtime (before any driver operation).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// No CUDA driver library (libcuda.so.1) could be loaded on this machine.
    #[error("no CUDA driver found: libcuda.so.1 could not be loaded (is the NVIDIA driver installed, and is its folder on the loader path?)")]
    NoDriver,
    /// The driver loaded but initialisation or device selection failed.
    #[error("CUDA device {ordinal} could not be opened: {source}")]
    Device {
        /// The CUDA device ordinal asked for (0 is the first device the
        /// process sees, after `CUDA_VISIBLE_DEVICES`); 0 when counting the
        /// devices failed.
        ordinal: usize,
        /// The driver call that failed (`cuInit`, `cuDeviceGet`,
        /// `cuDevicePrimaryCtxRetain`, `cuCtxSetCurrent`, loading the spin
        /// kernel, ...) with its code, e.g. [`Code::NO_DEVICE`].
        #[source]
        source: DriverError,
    },
}
