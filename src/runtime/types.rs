//! Plain value types shared by every runtime: handles, capture modes,
//! copy fragments.

/// Address in device memory (`CUdeviceptr`), or a host allocation's device
/// alias obtained through [`super::GpuRuntime::host_device_ptr`].
pub type DevicePtr = u64;

macro_rules! handle {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub(crate) u64);
        impl $name {
            /// The opaque number behind the handle (for logs).
            pub fn raw(self) -> u64 { self.0 }
        }
    };
}

handle!(
    /// A stream created by [`super::GpuRuntime::stream_create`].
    Stream
);
handle!(
    /// An event created by [`super::GpuRuntime::event_create`].
    Event
);
handle!(
    /// An instantiated, launchable graph returned by
    /// [`super::GpuRuntime::end_capture`].
    Graph
);

/// `CUstreamCaptureMode`: who else may make capture-unsafe calls while a
/// stream captures (FACTS.md section 1).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// Any thread's unsafe call (unless that thread is relaxed) fails with
    /// 900 and invalidates the capture.
    Global,
    /// Only the capturing thread's own unsafe calls are refused.
    ThreadLocal,
    /// No call is refused because of this capture.
    Relaxed,
}

impl CaptureMode {
    pub fn name(self) -> &'static str {
        match self {
            CaptureMode::Global => "GLOBAL",
            CaptureMode::ThreadLocal => "THREAD_LOCAL",
            CaptureMode::Relaxed => "RELAXED",
        }
    }
}

/// `CUstreamCaptureStatus` of one stream.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CaptureStatus {
    None,
    Active,
    Invalidated,
}

/// Direction of a host/device copy.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Host to device (a load of offloaded blocks).
    HostToDevice,
    /// Device to host (a store).
    DeviceToHost,
}

/// One contiguous piece of a copy: `bytes` from `host`/`device` in the
/// direction of the batch it belongs to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Fragment {
    /// Host address (a plain pointer value, registered or pageable).
    pub host: usize,
    pub device: DevicePtr,
    pub bytes: usize,
}

/// A kernel the offload code launches.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Busy-waits on the GPU for `nanos` nanoseconds. Used by the conformance
    /// suite to have work "running" on the device while another call is made.
    Spin { nanos: u64 },
    /// Copies every fragment of a descriptor table that lives in device
    /// memory at `table`: `count` entries of [`GATHER_ENTRY_WORDS`] native
    /// `u64` words each, `[src, dst, bytes]`, where `src` and `dst` are device
    /// addresses (device memory, or the device alias of registered host
    /// memory from [`super::GpuRuntime::host_device_ptr`]). The table must be
    /// in place when the kernel runs (upload it on the same stream first).
    /// 16-byte vectors when `src`, `dst` and `bytes` are all multiples of 16,
    /// a byte loop otherwise. Reading host memory that is not registered is
    /// a device fault (ILLEGAL_ADDRESS, sticky).
    Gather { table: DevicePtr, count: u32 },
}

/// `u64` words per entry of a [`Kernel::Gather`] descriptor table:
/// source address, destination address, byte count.
pub const GATHER_ENTRY_WORDS: usize = 3;
/// Bytes per entry of a [`Kernel::Gather`] descriptor table.
pub const GATHER_ENTRY_BYTES: usize = GATHER_ENTRY_WORDS * 8;
