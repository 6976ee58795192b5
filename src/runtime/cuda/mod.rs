//! The real GPU: the CUDA driver API through cudarc's raw `sys` layer,
//! loaded at run time (`dynamic-loading`), so the crate builds and its tests
//! run on machines with no CUDA. Every return code is checked and traced at
//! debug level with its result.
//!
//! # Sharing the device with an engine (PyTorch)
//!
//! [`CudaRuntime::open`] retains the device's *primary* context
//! (`cuDevicePrimaryCtxRetain`), the one the CUDA runtime API and so
//! PyTorch use: device pointers of the engine's tensors (`data_ptr()`) and
//! its streams (`torch.cuda.current_stream().cuda_stream`) are valid here
//! as they are. Every call first makes that context current on the calling
//! thread if another one is (`cuCtxGetCurrent`; the runtime API of a
//! process using one device has the same one current, so nothing changes
//! for it). An engine's raw stream becomes a [`Stream`] of this runtime
//! with [`CudaRuntime::adopt_stream`] (unsafe: the stream stays the
//! engine's, see its contract).

mod ptx;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::c_void;

use cudarc::driver::sys;

use crate::runtime::{
    CaptureMode, CaptureStatus, Code, DevicePtr, Direction, DriverError, DriverResult, Event, Fragment, Gate,
    GateBinding, GpuRuntime, Graph, Kernel, OpenError, Stream,
};
use crate::sync::{self, Mutex};

fn check(call: &'static str, r: sys::CUresult) -> DriverResult<()> {
    let code = Code(r as u32);
    if code == Code::SUCCESS {
        tracing::debug!(call, "cuda driver call ok");
        Ok(())
    } else {
        tracing::debug!(call, %code, "cuda driver call failed");
        Err(DriverError::new(call, code))
    }
}

fn mode_to_sys(m: CaptureMode) -> sys::CUstreamCaptureMode {
    match m {
        CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

fn mode_from_sys(m: sys::CUstreamCaptureMode) -> CaptureMode {
    match m {
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
    }
}

/// Driver handles by the crate's opaque ids; an unknown id is a typed
/// INVALID_HANDLE error instead of a wild pointer handed to the driver.
#[derive(Default)]
struct Handles {
    next: u64,
    streams: BTreeMap<u64, usize>,
    events: BTreeMap<u64, usize>,
    graphs: BTreeMap<u64, usize>,
    /// Streams adopted from the engine ([`CudaRuntime::adopt_stream`]):
    /// never destroyed by this runtime.
    adopted: BTreeSet<u64>,
}

impl Handles {
    fn insert(&mut self, pick: fn(&mut Handles) -> &mut BTreeMap<u64, usize>, raw: usize) -> u64 {
        self.next += 1;
        let id = self.next;
        pick(self).insert(id, raw);
        id
    }
}

/// The CUDA driver on one device (its primary context).
pub struct CudaRuntime {
    ordinal: usize,
    device: sys::CUdevice,
    ctx: usize,
    spin_fn: usize,
    /// The gather kernel, or why it could not be loaded (a launch then
    /// reports that error; the rest of the runtime works without it).
    gather_fn: Result<usize, DriverError>,
    /// The pattern kernels, each loaded the same way as the gather kernel.
    pattern_fill_fn: Result<usize, DriverError>,
    pattern_check_fn: Result<usize, DriverError>,
    handles: Mutex<Handles>,
    /// Whose gates the capture-unsafe operations accept.
    binding: GateBinding,
    /// Multiprocessors of the device (the gather kernel's grid).
    sm_count: u32,
    name: String,
    driver_version: i32,
    /// `cuDeviceGetPCIBusId`, asked in `open` (see there).
    pci_bus_id: Option<String>,
}

// SAFETY: the raw context and function handles are plain driver handles that
// the driver allows any thread to use once the context is current there
// (`bind` makes it current on every calling thread); all mutable state is
// behind a Mutex.
unsafe impl Send for CudaRuntime {}
// SAFETY: as above.
unsafe impl Sync for CudaRuntime {}

fn invalid(call: &'static str) -> DriverError {
    DriverError::new(call, Code::INVALID_HANDLE)
}

impl CudaRuntime {
    /// True when libcuda can be loaded on this machine.
    pub fn driver_present() -> bool {
        // SAFETY: only tries to dlopen the driver library; no driver call.
        unsafe { sys::is_culib_present() }
    }

    /// How many CUDA devices this process sees (cuDeviceGetCount).
    pub fn device_count() -> Result<usize, OpenError> {
        if !Self::driver_present() {
            return Err(OpenError::NoDriver);
        }
        let dev_err = |source| OpenError::Device { ordinal: 0, source };
        // SAFETY: cuInit takes no pointers; the driver library is present.
        check("cuInit", unsafe { sys::cuInit(0) }).map_err(dev_err)?;
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer for the call's duration.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) }).map_err(dev_err)?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Opens device `ordinal`: loads the driver, initialises it, retains
    /// the primary context and loads the crate's kernels.
    pub fn open(ordinal: usize) -> Result<Self, OpenError> {
        if !Self::driver_present() {
            return Err(OpenError::NoDriver);
        }
        let dev_err = |source| OpenError::Device { ordinal, source };
        // SAFETY: cuInit takes no pointers; the driver library is present.
        check("cuInit", unsafe { sys::cuInit(0) }).map_err(dev_err)?;
        let mut device: sys::CUdevice = 0;
        let ord = i32::try_from(ordinal).map_err(|_| dev_err(DriverError::new("cuDeviceGet", Code::INVALID_VALUE)))?;
        // SAFETY: `device` is a valid out-pointer for the call's duration.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut device, ord) }).map_err(dev_err)?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; `device` came from cuDeviceGet.
        check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) })
            .map_err(dev_err)?;
        let mut name_buf = [0 as std::ffi::c_char; 128];
        // SAFETY: the buffer holds 128 bytes, the length we pass.
        check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(name_buf.as_mut_ptr(), 128, device) })
            .map_err(dev_err)?;
        // SAFETY: the driver wrote a NUL-terminated string into the buffer.
        let name = unsafe { std::ffi::CStr::from_ptr(name_buf.as_ptr()) }.to_string_lossy().into_owned();
        let mut sms = 0;
        // SAFETY: valid out-pointer; `device` came from cuDeviceGet.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut sms,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                device,
            )
        })
        .map_err(dev_err)?;
        // The PCI bus id (pinning reads the GPU's NUMA node from sysfs with
        // it). cuDeviceGetPCIBusId has no measured conformance row, so it is
        // treated as capture-unsafe: it is called only here, in `open`,
        // before this runtime exists and so before any capture can, and the
        // answer is cached (`GpuRuntime::pci_bus_id` makes no driver call).
        // A failure only leaves the id unknown (no NUMA placement).
        let mut bus_buf = [0 as std::ffi::c_char; 64];
        // SAFETY: the buffer holds 64 bytes, the length we pass; `device`
        // came from cuDeviceGet.
        let pci_bus_id =
            match check("cuDeviceGetPCIBusId", unsafe { sys::cuDeviceGetPCIBusId(bus_buf.as_mut_ptr(), 64, device) }) {
                // SAFETY: on success the driver wrote a NUL-terminated string
                // into the buffer.
                Ok(()) => Some(unsafe { std::ffi::CStr::from_ptr(bus_buf.as_ptr()) }.to_string_lossy().into_owned()),
                Err(e) => {
                    tracing::info!(error = %e, "the GPU's PCI bus id is unknown; no NUMA placement");
                    None
                }
            };
        let mut driver_version = 0;
        // SAFETY: valid out-pointer.
        check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut driver_version) }).map_err(dev_err)?;
        let mut rt = CudaRuntime {
            ordinal,
            device,
            ctx: ctx as usize,
            spin_fn: 0,
            gather_fn: Err(DriverError::new("cuModuleLoadDataEx", Code::INVALID_HANDLE)),
            pattern_fill_fn: Err(DriverError::new("cuModuleLoadDataEx", Code::INVALID_HANDLE)),
            pattern_check_fn: Err(DriverError::new("cuModuleLoadDataEx", Code::INVALID_HANDLE)),
            handles: Mutex::new(Handles::default()),
            binding: GateBinding::new(),
            sm_count: u32::try_from(sms).unwrap_or(1).max(1),
            name,
            driver_version,
            pci_bus_id,
        };
        rt.bind().map_err(dev_err)?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: PTX is a NUL-terminated string that lives for 'static.
        check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, ptx::SPIN.as_ptr() as *const c_void) })
            .map_err(dev_err)?;
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: `module` was just loaded; the name is NUL-terminated.
        check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut f, module, c"kvo_spin".as_ptr()) })
            .map_err(dev_err)?;
        rt.spin_fn = f as usize;
        rt.gather_fn = load_function(ptx::GATHER, c"kvo_gather");
        if let Err(e) = &rt.gather_fn {
            tracing::warn!(error = %e, "the gather kernel could not be loaded; gather copies will fail");
        }
        rt.pattern_fill_fn = load_function(ptx::PATTERN_FILL, c"kvo_pattern_fill");
        rt.pattern_check_fn = load_function(ptx::PATTERN_CHECK, c"kvo_pattern_check");
        for (f, name) in [(&rt.pattern_fill_fn, "fill"), (&rt.pattern_check_fn, "check")] {
            if let Err(e) = f {
                tracing::warn!(error = %e, kernel = name, "a pattern kernel could not be loaded; its launches will fail");
            }
        }
        tracing::info!(device = %rt.name, ordinal, driver = driver_version, "cuda runtime opened");
        Ok(rt)
    }

    /// The driver version as the driver reports it (e.g. 13000).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// Makes the primary context current on the calling thread unless it
    /// is already (the engine, e.g. PyTorch's runtime API, may have made
    /// another device's current on a thread it shares with us, so the
    /// driver is asked, not a cache). Capture-safe: it touches no stream.
    fn bind(&self) -> DriverResult<()> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; reads the calling thread's context.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if cur as usize == self.ctx {
            return Ok(());
        }
        // SAFETY: `ctx` is the primary context retained in `open` and
        // released only in Drop.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx as sys::CUcontext) })
    }

    /// Makes an engine's stream usable as a [`Stream`] of this runtime (for
    /// example PyTorch's `torch.cuda.current_stream().cuda_stream`, the
    /// compute stream an offloader orders its jobs after). `raw` 0 is the
    /// legacy default stream. [`GpuRuntime::stream_destroy`] of the handle
    /// only forgets it: the stream stays the engine's.
    ///
    /// # Safety
    /// `raw` is a `CUstream` (`cudaStream_t`) of this device's primary
    /// context, or 0, and stays alive until the handle is given back with
    /// `stream_destroy` and no work this runtime enqueued on it or ordered
    /// after it is pending (for an offloader: until it is shut down).
    pub unsafe fn adopt_stream(&self, raw: usize) -> Stream {
        let mut h = sync::lock(&self.handles);
        let id = h.insert(|h| &mut h.streams, raw);
        h.adopted.insert(id);
        Stream(id)
    }

    /// `cuEventCreate` with `flags`, the event kept in the handle table.
    fn event_create_flags(&self, flags: sys::CUevent_flags) -> DriverResult<Event> {
        self.bind()?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, flags as u32) })?;
        let id = sync::lock(&self.handles).insert(|h| &mut h.events, e as usize);
        Ok(Event(id))
    }

    fn stream_raw(&self, s: Stream, call: &'static str) -> DriverResult<sys::CUstream> {
        self.bind()?;
        let h = sync::lock(&self.handles);
        h.streams.get(&s.0).map(|&p| p as sys::CUstream).ok_or_else(|| invalid(call))
    }

    fn event_raw(&self, e: Event, call: &'static str) -> DriverResult<sys::CUevent> {
        self.bind()?;
        let h = sync::lock(&self.handles);
        h.events.get(&e.0).map(|&p| p as sys::CUevent).ok_or_else(|| invalid(call))
    }

    fn graph_raw(&self, g: Graph, call: &'static str) -> DriverResult<sys::CUgraphExec> {
        self.bind()?;
        let h = sync::lock(&self.handles);
        h.graphs.get(&g.0).map(|&p| p as sys::CUgraphExec).ok_or_else(|| invalid(call))
    }
}

/// Loads one PTX module and looks up `name` in it. A JIT failure is traced
/// at warn level with the driver's error log (what a hand-written PTX
/// mistake needs to be found on the GPU machine).
fn load_function(ptx_text: &'static str, name: &std::ffi::CStr) -> DriverResult<usize> {
    const LOG: usize = 4096;
    let mut log = vec![0u8; LOG];
    let mut opts = [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    let mut vals = [log.as_mut_ptr() as *mut c_void, LOG as *mut c_void];
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: the PTX text is NUL-terminated and 'static; the options array
    // and the values array have 2 entries each, as passed; the log buffer
    // holds LOG bytes, the size given, and outlives the call (the size
    // option's value is an integer carried in a pointer, as the API says).
    let r = check("cuModuleLoadDataEx", unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            ptx_text.as_ptr() as *const c_void,
            2,
            opts.as_mut_ptr(),
            vals.as_mut_ptr(),
        )
    });
    if let Err(e) = r {
        let end = log.iter().position(|&b| b == 0).unwrap_or(LOG);
        tracing::warn!(kernel = ?name, error = %e, log = %String::from_utf8_lossy(&log[..end]), "PTX JIT failed");
        return Err(e);
    }
    let mut f: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: `module` was just loaded; the name is NUL-terminated.
    check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut f, module, name.as_ptr()) })?;
    Ok(f as usize)
}

/// Launches a pattern kernel over `count` table entries: one block per
/// entry up to [`ptx::PATTERN_MAX_BLOCKS`], [`ptx::PATTERN_THREADS`] each.
///
/// # Safety
/// `f` is a loaded pattern kernel whose parameters `args` points to, in
/// order and with the kernel's types, for the duration of the call.
unsafe fn launch_pattern(f: usize, count: u32, s: sys::CUstream, args: &mut [*mut c_void]) -> DriverResult<()> {
    let blocks = count.min(ptx::PATTERN_MAX_BLOCKS);
    // SAFETY: the caller's contract: `f` and `args` match; the driver copies
    // the parameters at launch, so they need not outlive the call.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            f as sys::CUfunction,
            blocks,
            1,
            1,
            ptx::PATTERN_THREADS,
            1,
            1,
            0,
            s,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}

impl Drop for CudaRuntime {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `open`; handles created
        // through this runtime are not used after it is dropped.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        if let Err(e) = check("cuDevicePrimaryCtxRelease", r) {
            tracing::warn!(error = %e, "releasing the primary context failed");
        }
    }
}

impl GpuRuntime for CudaRuntime {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn gate_binding(&self) -> &GateBinding {
        &self.binding
    }

    fn pci_bus_id(&self) -> Option<&str> {
        self.pci_bus_id.as_deref()
    }

    fn describe(&self) -> String {
        format!(
            "{} (device {}), CUDA driver API {}.{}",
            self.name,
            self.ordinal,
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }

    unsafe fn host_register(&self, gate: &Gate, addr: usize, len: usize) -> DriverResult<()> {
        self.binding.check(gate, "cuMemHostRegister")?;
        self.bind()?;
        // SAFETY: the caller guarantees `[addr, addr+len)` is a live mapping
        // that stays mapped while registered.
        check("cuMemHostRegister", unsafe { sys::cuMemHostRegister_v2(addr as *mut c_void, len, 0) })
    }

    fn host_unregister(&self, gate: &Gate, addr: usize) -> DriverResult<()> {
        self.binding.check(gate, "cuMemHostUnregister")?;
        self.bind()?;
        // SAFETY: the driver checks `addr` against its registrations and
        // answers 713 for anything else; no memory is dereferenced here.
        check("cuMemHostUnregister", unsafe { sys::cuMemHostUnregister(addr as *mut c_void) })
    }

    fn host_device_ptr(&self, addr: usize) -> DriverResult<DevicePtr> {
        self.bind()?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the driver validates `addr`.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut p, addr as *mut c_void, 0)
        })?;
        Ok(DevicePtr(p))
    }

    fn mem_alloc(&self, gate: &Gate, bytes: usize) -> DriverResult<DevicePtr> {
        self.binding.check(gate, "cuMemAlloc")?;
        self.bind()?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, bytes) })?;
        Ok(DevicePtr(p))
    }

    unsafe fn mem_free(&self, gate: &Gate, ptr: DevicePtr) -> DriverResult<()> {
        self.binding.check(gate, "cuMemFree")?;
        self.bind()?;
        // SAFETY: the driver validates `ptr` against its allocations; the
        // caller promises no device work still uses it (the contract).
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr.raw()) })
    }

    fn mem_alloc_host(&self, gate: &Gate, bytes: usize) -> DriverResult<usize> {
        self.binding.check(gate, "cuMemAllocHost")?;
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuMemAllocHost", unsafe { sys::cuMemAllocHost_v2(&mut p, bytes) })?;
        Ok(p as usize)
    }

    unsafe fn mem_free_host(&self, gate: &Gate, addr: usize) -> DriverResult<()> {
        self.binding.check(gate, "cuMemFreeHost")?;
        self.bind()?;
        // SAFETY: the driver validates `addr` against its host allocations;
        // the caller promises nothing uses the memory afterwards.
        check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(addr as *mut c_void) })
    }

    fn stream_create(&self) -> DriverResult<Stream> {
        self.bind()?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer.
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, flags) })?;
        let id = sync::lock(&self.handles).insert(|h| &mut h.streams, s as usize);
        Ok(Stream(id))
    }

    fn stream_destroy(&self, stream: Stream) -> DriverResult<()> {
        let s = self.stream_raw(stream, "cuStreamDestroy")?;
        {
            let mut h = sync::lock(&self.handles);
            if h.adopted.remove(&stream.0) {
                // The engine's stream: forgotten, not destroyed.
                h.streams.remove(&stream.0);
                return Ok(());
            }
        }
        // SAFETY: `s` is a live stream created by this runtime.
        check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(s) })?;
        sync::lock(&self.handles).streams.remove(&stream.0);
        Ok(())
    }

    fn stream_synchronize(&self, gate: &Gate, stream: Stream) -> DriverResult<()> {
        self.binding.check(gate, "cuStreamSynchronize")?;
        let s = self.stream_raw(stream, "cuStreamSynchronize")?;
        // SAFETY: live stream.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(s) })
    }

    fn ctx_synchronize(&self, gate: &Gate) -> DriverResult<()> {
        self.binding.check(gate, "cuCtxSynchronize")?;
        self.bind()?;
        // SAFETY: no arguments; the context is current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> DriverResult<()> {
        let s = self.stream_raw(stream, "cuStreamWaitEvent")?;
        let e = self.event_raw(event, "cuStreamWaitEvent")?;
        // SAFETY: live stream and event.
        check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(s, e, 0) })
    }

    unsafe fn copy_htod_async(&self, dst: DevicePtr, src: usize, bytes: usize, stream: Stream) -> DriverResult<()> {
        let s = self.stream_raw(stream, "cuMemcpyHtoDAsync")?;
        // SAFETY: the caller keeps `src..src+bytes` readable until the copy
        // completes; the driver validates `dst`.
        check("cuMemcpyHtoDAsync", unsafe { sys::cuMemcpyHtoDAsync_v2(dst.raw(), src as *const c_void, bytes, s) })
    }

    unsafe fn copy_dtoh_async(&self, dst: usize, src: DevicePtr, bytes: usize, stream: Stream) -> DriverResult<()> {
        let s = self.stream_raw(stream, "cuMemcpyDtoHAsync")?;
        // SAFETY: the caller keeps `dst..dst+bytes` writable and untouched
        // until the copy completes.
        check("cuMemcpyDtoHAsync", unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src.raw(), bytes, s) })
    }

    unsafe fn copy_htod(&self, dst: DevicePtr, src: usize, bytes: usize) -> DriverResult<()> {
        self.bind()?;
        // SAFETY: the caller guarantees `src..src+bytes` is readable.
        check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(dst.raw(), src as *const c_void, bytes) })
    }

    unsafe fn copy_dtoh(&self, dst: usize, src: DevicePtr, bytes: usize) -> DriverResult<()> {
        self.bind()?;
        // SAFETY: the caller guarantees `dst..dst+bytes` is writable.
        check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(dst as *mut c_void, src.raw(), bytes) })
    }

    unsafe fn copy_batch_async(&self, dir: Direction, fragments: &[Fragment], stream: Stream) -> DriverResult<()> {
        let s = self.stream_raw(stream, "cuMemcpyBatchAsync")?;
        if fragments.is_empty() {
            return Err(DriverError::new("cuMemcpyBatchAsync", Code::INVALID_VALUE));
        }
        let host = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, id: 0 };
        let dev =
            sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: self.ordinal as i32 };
        let (mut dsts, mut srcs): (Vec<sys::CUdeviceptr>, Vec<sys::CUdeviceptr>) = match dir {
            Direction::HostToDevice => fragments.iter().map(|f| (f.device.raw(), f.host as u64)).unzip(),
            Direction::DeviceToHost => fragments.iter().map(|f| (f.host as u64, f.device.raw())).unzip(),
        };
        let mut sizes: Vec<usize> = fragments.iter().map(|f| f.bytes).collect();
        let (src_loc, dst_loc) = match dir {
            Direction::HostToDevice => (host, dev),
            Direction::DeviceToHost => (dev, host),
        };
        let mut attrs = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: src_loc,
            dstLocHint: dst_loc,
            flags: 0,
        }];
        let mut idx = [0usize];
        // SAFETY: the arrays have `fragments.len()` entries each and outlive
        // the call; one attribute applies from index 0; the caller keeps
        // every host range valid until the copies complete.
        check("cuMemcpyBatchAsync", unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                fragments.len(),
                attrs.as_mut_ptr(),
                idx.as_mut_ptr(),
                1,
                s,
            )
        })
    }

    unsafe fn memset_d8_async(&self, dst: DevicePtr, value: u8, bytes: usize, stream: Stream) -> DriverResult<()> {
        let s = self.stream_raw(stream, "cuMemsetD8Async")?;
        // SAFETY: the driver validates `dst`; live stream.
        check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(dst.raw(), value, bytes, s) })
    }

    unsafe fn launch(&self, kernel: Kernel, stream: Stream) -> DriverResult<()> {
        let s = self.stream_raw(stream, "cuLaunchKernel")?;
        match kernel {
            Kernel::Spin { nanos } => {
                let mut ns = nanos;
                let mut args = [&mut ns as *mut u64 as *mut c_void];
                // SAFETY: `spin_fn` takes one u64 parameter, which `args`
                // points to for the duration of the call (the driver copies
                // parameters at launch).
                check("cuLaunchKernel", unsafe {
                    sys::cuLaunchKernel(
                        self.spin_fn as sys::CUfunction,
                        1,
                        1,
                        1,
                        1,
                        1,
                        1,
                        0,
                        s,
                        args.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                })
            }
            Kernel::PatternFill { table, count } => {
                let f = self.pattern_fill_fn.clone()?;
                if count == 0 {
                    return Ok(());
                }
                let (mut t, mut n) = (table.raw(), count);
                let mut args = [&mut t as *mut u64 as *mut c_void, &mut n as *mut u32 as *mut c_void];
                // SAFETY: `kvo_pattern_fill` takes (u64, u32), which `args`
                // points to for the duration of the call (the driver copies
                // the parameters at launch). The kernel dereferences the
                // table and its entries on the device only; a bad address
                // there is a device fault the next synchronize reports, not
                // host UB.
                unsafe { launch_pattern(f, count, s, &mut args) }
            }
            Kernel::PatternCheck { table, count, out } => {
                let f = self.pattern_check_fn.clone()?;
                if count == 0 {
                    return Ok(());
                }
                let (mut t, mut n, mut o) = (table.raw(), count, out.raw());
                let mut args = [
                    &mut t as *mut u64 as *mut c_void,
                    &mut n as *mut u32 as *mut c_void,
                    &mut o as *mut u64 as *mut c_void,
                ];
                // SAFETY: `kvo_pattern_check` takes (u64, u32, u64), which
                // `args` points to for the duration of the call; device-side
                // addresses as for the fill.
                unsafe { launch_pattern(f, count, s, &mut args) }
            }
            Kernel::Gather { table, count } => {
                let f = self.gather_fn.clone()?;
                if count == 0 {
                    return Ok(());
                }
                let mut t = table.raw();
                let mut n = count;
                let mut args = [&mut t as *mut u64 as *mut c_void, &mut n as *mut u32 as *mut c_void];
                let blocks = count.min(self.sm_count * ptx::GATHER_BLOCKS_PER_SM);
                // SAFETY: `kvo_gather` takes (u64, u32), which `args` points
                // to for the duration of the call (the driver copies the
                // parameters at launch). The kernel dereferences the table
                // and its entries on the device only; a bad address there is
                // a device fault the next synchronize reports, not host UB.
                check("cuLaunchKernel", unsafe {
                    sys::cuLaunchKernel(
                        f as sys::CUfunction,
                        blocks,
                        1,
                        1,
                        ptx::GATHER_THREADS,
                        1,
                        1,
                        0,
                        s,
                        args.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                })
            }
        }
    }

    fn event_create(&self) -> DriverResult<Event> {
        self.event_create_flags(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    fn event_create_timed(&self) -> DriverResult<Event> {
        self.event_create_flags(sys::CUevent_flags::CU_EVENT_DEFAULT)
    }

    fn event_elapsed(&self, gate: &Gate, start: Event, end: Event) -> DriverResult<f32> {
        self.binding.check(gate, "cuEventElapsedTime")?;
        let s = self.event_raw(start, "cuEventElapsedTime")?;
        let e = self.event_raw(end, "cuEventElapsedTime")?;
        let mut ms = 0f32;
        // SAFETY: two live events of this runtime, a valid out-pointer.
        check("cuEventElapsedTime", unsafe { sys::cuEventElapsedTime_v2(&mut ms, s, e) })?;
        Ok(ms)
    }

    fn event_destroy(&self, event: Event) -> DriverResult<()> {
        let e = self.event_raw(event, "cuEventDestroy")?;
        // SAFETY: live event created by this runtime.
        check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(e) })?;
        sync::lock(&self.handles).events.remove(&event.0);
        Ok(())
    }

    fn event_record(&self, event: Event, stream: Stream) -> DriverResult<()> {
        let e = self.event_raw(event, "cuEventRecord")?;
        let s = self.stream_raw(stream, "cuEventRecord")?;
        // SAFETY: live event and stream.
        check("cuEventRecord", unsafe { sys::cuEventRecord(e, s) })
    }

    fn event_query(&self, gate: &Gate, event: Event) -> DriverResult<bool> {
        self.binding.check(gate, "cuEventQuery")?;
        let e = self.event_raw(event, "cuEventQuery")?;
        // SAFETY: live event.
        match check("cuEventQuery", unsafe { sys::cuEventQuery(e) }) {
            Ok(()) => Ok(true),
            Err(err) if err.code == Code::NOT_READY => Ok(false),
            Err(err) => Err(err),
        }
    }

    fn event_synchronize(&self, gate: &Gate, event: Event) -> DriverResult<()> {
        self.binding.check(gate, "cuEventSynchronize")?;
        let e = self.event_raw(event, "cuEventSynchronize")?;
        // SAFETY: live event.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(e) })
    }

    fn begin_capture(&self, stream: Stream, mode: CaptureMode) -> DriverResult<()> {
        let s = self.stream_raw(stream, "cuStreamBeginCapture")?;
        // SAFETY: live stream.
        check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(s, mode_to_sys(mode)) })
    }

    fn end_capture(&self, stream: Stream) -> DriverResult<Graph> {
        let s = self.stream_raw(stream, "cuStreamEndCapture")?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: live stream, valid out-pointer.
        check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(s, &mut graph) })?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` was just produced by the driver.
        let inst = check("cuGraphInstantiate", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) });
        // SAFETY: the instantiated graph does not need the template graph.
        let destroy = check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) });
        inst?;
        destroy?;
        let id = sync::lock(&self.handles).insert(|h| &mut h.graphs, exec as usize);
        Ok(Graph(id))
    }

    fn capture_status(&self, stream: Stream) -> DriverResult<CaptureStatus> {
        let s = self.stream_raw(stream, "cuStreamIsCapturing")?;
        let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: live stream, valid out-pointer.
        check("cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(s, &mut st) })?;
        Ok(match st {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active,
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => CaptureStatus::Invalidated,
        })
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> DriverResult<CaptureMode> {
        self.bind()?;
        let mut m = mode_to_sys(mode);
        // SAFETY: valid in/out pointer.
        check("cuThreadExchangeStreamCaptureMode", unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) })?;
        Ok(mode_from_sys(m))
    }

    fn graph_launch(&self, graph: Graph, stream: Stream) -> DriverResult<()> {
        let g = self.graph_raw(graph, "cuGraphLaunch")?;
        let s = self.stream_raw(stream, "cuGraphLaunch")?;
        // SAFETY: live graph exec and stream.
        check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(g, s) })
    }

    fn graph_destroy(&self, graph: Graph) -> DriverResult<()> {
        let g = self.graph_raw(graph, "cuGraphExecDestroy")?;
        // SAFETY: live graph exec created by this runtime.
        check("cuGraphExecDestroy", unsafe { sys::cuGraphExecDestroy(g) })?;
        sync::lock(&self.handles).graphs.remove(&graph.0);
        Ok(())
    }
}
