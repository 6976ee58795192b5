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
}
