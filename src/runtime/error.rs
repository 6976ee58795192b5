//! Driver result codes and the typed errors of the runtime layer.

use std::fmt;

/// A CUDA driver result code (`CUresult`), as returned by the real driver and
/// reproduced by the simulated GPU. Only the codes this crate reasons about
/// have names; any other value is carried through unchanged.
#[derive(Copy, Clone, PartialEq, Eq, Hash)]
pub struct Code(pub u32);

impl Code {
    pub const SUCCESS: Code = Code(0);
    pub const INVALID_VALUE: Code = Code(1);
    pub const OUT_OF_MEMORY: Code = Code(2);
    pub const NO_DEVICE: Code = Code(100);
    pub const INVALID_HANDLE: Code = Code(400);
    pub const NOT_READY: Code = Code(600);
    pub const ILLEGAL_ADDRESS: Code = Code(700);
    pub const HOST_MEMORY_ALREADY_REGISTERED: Code = Code(712);
    pub const HOST_MEMORY_NOT_REGISTERED: Code = Code(713);
    pub const MISALIGNED_ADDRESS: Code = Code(716);
    pub const LAUNCH_FAILED: Code = Code(719);
    pub const NOT_SUPPORTED: Code = Code(801);
    pub const STREAM_CAPTURE_UNSUPPORTED: Code = Code(900);
    pub const STREAM_CAPTURE_INVALIDATED: Code = Code(901);
    pub const STREAM_CAPTURE_WRONG_THREAD: Code = Code(908);
    pub const ILLEGAL_STATE: Code = Code(401);

    /// The driver's name for the code, or `"CUDA_ERROR_<n>"` for others.
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
            908 => "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
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
    pub code: Code,
}

impl DriverError {
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
        ordinal: usize,
        #[source]
        source: DriverError,
    },
}
