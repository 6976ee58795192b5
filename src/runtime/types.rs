//! Plain value types shared by every runtime: handles, capture modes,
//! copy fragments.

use crate::names::named;

/// Address in device memory (`CUdeviceptr`), or a host allocation's device
/// alias obtained through [`super::GpuRuntime::host_device_ptr`].
///
/// A newtype so that a device address cannot be passed where a host address
/// (`usize`) or a byte count is expected, or the other way round; the
/// arithmetic the crate needs is explicit ([`DevicePtr::offset`],
/// [`DevicePtr::checked_offset`]). Displayed as hex (`0x...`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null device pointer (0).
    pub const NULL: DevicePtr = DevicePtr(0);

    /// The pointer for the raw `CUdeviceptr` value `raw`.
    pub const fn from_raw(raw: u64) -> DevicePtr {
        DevicePtr(raw)
    }

    /// The raw `CUdeviceptr` value.
    pub const fn raw(self) -> u64 {
        self.0
    }

    /// The address `bytes` past this one (wrapping like the `u64` addition
    /// it replaces: panics on overflow in debug builds).
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0 + bytes as u64)
    }

    /// The address `bytes` past this one; `None` on overflow.
    pub fn checked_offset(self, bytes: usize) -> Option<DevicePtr> {
        u64::try_from(bytes).ok().and_then(|b| self.0.checked_add(b)).map(DevicePtr)
    }
}

impl std::fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl std::fmt::LowerHex for DevicePtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::LowerHex::fmt(&self.0, f)
    }
}

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
/// stream captures (docs/driver-rules.md, row "Capture modes").
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
    /// The mode's name without the driver's prefix (`CU_STREAM_CAPTURE_MODE_`),
    /// e.g. `"GLOBAL"`, for logs and reports.
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
    /// The stream is not capturing: work enqueued on it runs.
    None,
    /// The stream is capturing: work enqueued on it is recorded into the
    /// graph, not run.
    Active,
    /// The stream is capturing, but the capture was invalidated (by a
    /// capture-unsafe call refused with 900, docs/driver-rules.md, row
    /// "Refused call"): ending it
    /// returns STREAM_CAPTURE_INVALIDATED (901) and no graph.
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

named!(Direction, "direction" {
    DeviceToHost => "store",
    HostToDevice => "load",
});

/// One contiguous piece of a copy: `bytes` from `host`/`device` in the
/// direction of the batch it belongs to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Fragment {
    /// Host address (a plain pointer value, registered or pageable).
    pub host: usize,
    /// Device address of the piece (`CUdeviceptr` into device memory, e.g.
    /// a page of a GPU KV block).
    pub device: DevicePtr,
    /// Length of the piece in bytes (the same on both sides).
    pub bytes: usize,
}

/// A kernel the offload code launches.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Busy-waits on the GPU for `nanos` nanoseconds. Used by the conformance
    /// suite to have work "running" on the device while another call is made.
    Spin {
        /// How long the kernel busy-waits, in nanoseconds.
        nanos: u64,
    },
    /// Copies every fragment of a descriptor table that lives in device
    /// memory at `table`: `count` entries of [`GATHER_ENTRY_WORDS`] native
    /// `u64` words each, `[src, dst, bytes]`, where `src` and `dst` are device
    /// addresses (device memory, or the device alias of registered host
    /// memory from [`super::GpuRuntime::host_device_ptr`]). The table must be
    /// in place when the kernel runs (upload it on the same stream first).
    /// 16-byte vectors when `src`, `dst` and `bytes` are all multiples of 16,
    /// a byte loop otherwise. Reading host memory that is not registered is
    /// a device fault (ILLEGAL_ADDRESS, sticky).
    Gather {
        /// Device address of the descriptor table (device memory).
        table: DevicePtr,
        /// Entries in the table (fragments to copy).
        count: u32,
    },
    /// Writes checkable data ([`crate::runtime::pattern`]) for workloads and tests.
    /// The table at `table` (device memory, 8-byte aligned, in place when
    /// the kernel runs: upload it on the same stream first) holds `count` entries of [`PATTERN_ENTRY_WORDS`]
    /// native `u64` words, `[dst, key, first_word, bytes]`: entry `i` writes
    /// words `first_word, first_word + 1, ...` of the contents of `key`
    /// (`crate::runtime::pattern::fill_from`) to `bytes` bytes at `dst` (device memory
    /// or the alias of registered host memory).
    ///
    /// Any `dst` and any `bytes` are allowed: a last piece shorter than 8
    /// bytes gets the prefix of its word, exactly as `fill_from` does; an
    /// 8-byte aligned `dst` is written with 8-byte stores, any other byte by
    /// byte (slower). An entry of 0 bytes touches nothing. A bad address is a
    /// device fault (ILLEGAL_ADDRESS, sticky), as for [`Kernel::Gather`].
    PatternFill {
        /// Device address of the `[dst, key, first_word, bytes]` table
        /// (device memory, 8-byte aligned).
        table: DevicePtr,
        /// Entries in the table.
        count: u32,
    },
    /// Checks data written as by [`Kernel::PatternFill`]: the table has the
    /// same layout with `src` in place of `dst`. For entry `i` the kernel
    /// adds to the `u32` at `out + 4 i` the number of 8-byte words of the
    /// range that differ from the pattern (a last shorter piece counts as
    /// one word); an entry that matches adds nothing and need not touch
    /// `out`. `out` (device memory, 4-byte aligned, `4 count` bytes) must be
    /// zeroed by the caller first, on the same stream (`memset_d8_async`).
    /// The count is exact for entries under 2^32 words (32 GiB) and wraps
    /// modulo 2^32 beyond. Any `src` alignment and length, as for the fill.
    PatternCheck {
        /// Device address of the `[src, key, first_word, bytes]` table
        /// (device memory, 8-byte aligned).
        table: DevicePtr,
        /// Entries in the table.
        count: u32,
        /// Device address of `count` `u32` mismatch counters, one per entry
        /// (device memory, 4-byte aligned, zeroed by the caller first).
        out: DevicePtr,
    },
}

/// `u64` words per entry of a [`Kernel::Gather`] descriptor table:
/// source address, destination address, byte count.
pub const GATHER_ENTRY_WORDS: usize = 3;
/// Bytes per entry of a [`Kernel::Gather`] descriptor table.
pub const GATHER_ENTRY_BYTES: usize = GATHER_ENTRY_WORDS * 8;

/// `u64` words per entry of a [`Kernel::PatternFill`] or
/// [`Kernel::PatternCheck`] table: address, key, first word, byte count.
pub const PATTERN_ENTRY_WORDS: usize = 4;
/// Bytes per entry of a pattern table.
pub const PATTERN_ENTRY_BYTES: usize = PATTERN_ENTRY_WORDS * 8;
