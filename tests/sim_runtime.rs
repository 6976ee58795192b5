//! The simulated GPU on its own: asynchronous in-order streams, events,
//! capture and replay, fault injection, holds, poisoning.

use kvoffload::internal::protocol::Coordinator;
use kvoffload::internal::runtime::sim::{Blocked, HoldPoint};
use kvoffload::internal::runtime::{Fragment, Gate};
use kvoffload::{
    CaptureMode, CapturePolicy, CaptureStatus, Code, DevicePtr, Direction, GpuRuntime, Request, SimFault, SimRuntime,
    Stream,
};

fn host(bytes: usize, fill: u8) -> Vec<u8> {
    vec![fill; bytes]
}

/// `f` through the gate of a coordinator with no region. These tests drive
/// the simulated GPU directly: no window is opened through the coordinator,
/// so it never holds a call back, and a call made during a capture reaches
/// the runtime as it did before calls needed a gate.
fn gated<T>(rt: &dyn GpuRuntime, f: impl FnOnce(&Gate) -> T) -> T {
    Coordinator::without_region(rt, CapturePolicy::AfterPinning)
        .expect("no other coordinator guards this runtime")
        .unsafe_call("test", Request::new(), f)
        .expect("no window, no refusal")
}

/// `f` on a thread of its own; its result, or the test fails with `hang`
/// when it has not returned after 60 s (the thread is left behind).
fn returns_within_60s<T: Send + 'static>(hang: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    let r = rx.recv_timeout(std::time::Duration::from_secs(60));
    assert!(r.is_ok(), "{hang}");
    t.join().unwrap();
    r.unwrap()
}

/// A simulated GPU, a stream of it, and an allocation of `bytes` there.
fn with_alloc(bytes: usize) -> (std::sync::Arc<SimRuntime>, Stream, DevicePtr) {
    let rt = std::sync::Arc::new(SimRuntime::new());
    let s = rt.stream_create().unwrap();
    let d = gated(&*rt, |gt| rt.mem_alloc(gt, bytes)).unwrap();
    (rt, s, d)
}

#[test]
fn copies_run_in_order_and_events_complete_after_them() {
    let (rt, s, d) = with_alloc(4096);
    let src1 = host(4096, 1);
    let src2 = host(4096, 2);
    let mut out = host(4096, 0);
    let hold = rt.hold(HoldPoint::DeviceOp);
    let e = rt.event_create().unwrap();
    // SAFETY: the buffers outlive the stream synchronize below.
    unsafe {
        rt.copy_htod_async(d, src1.as_ptr() as usize, 4096, s).unwrap();
        rt.copy_htod_async(d, src2.as_ptr() as usize, 4096, s).unwrap();
        rt.copy_dtoh_async(out.as_mut_ptr() as usize, d, 4096, s).unwrap();
    }
    rt.event_record(e, s).unwrap();
    hold.wait_entered();
    assert!(!gated(&*rt, |gt| rt.event_query(gt, e)).unwrap(), "event complete while the first copy is held");
    hold.release();
    gated(&*rt, |gt| rt.event_synchronize(gt, e)).unwrap();
    assert!(gated(&*rt, |gt| rt.event_query(gt, e)).unwrap());
    assert!(out.iter().all(|&b| b == 2), "later copy must win: in-order execution");
}

#[test]
fn stream_wait_event_orders_across_streams() {
    let rt = std::sync::Arc::new(SimRuntime::new());
    let (a, b) = (rt.stream_create().unwrap(), rt.stream_create().unwrap());
    let d = gated(&*rt, |gt| rt.mem_alloc(gt, 64)).unwrap();
    let mut out = host(64, 0);
    let hold = rt.hold(HoldPoint::DeviceOp);
    // SAFETY: `d` is a 64-byte allocation of `rt`, read only by the copy
    // on `b` ordered after this memset.
    unsafe { rt.memset_d8_async(d, 9, 64, a).unwrap() };
    let e = rt.event_create().unwrap();
    rt.event_record(e, a).unwrap();
    rt.stream_wait_event(b, e).unwrap();
    // SAFETY: `out` outlives the synchronize below.
    unsafe { rt.copy_dtoh_async(out.as_mut_ptr() as usize, d, 64, b).unwrap() };
    hold.wait_entered();
    hold.release();
    gated(&*rt, |gt| rt.stream_synchronize(gt, b)).unwrap();
    assert!(out.iter().all(|&x| x == 9), "copy on b ran before the memset on a");
}

#[test]
fn captured_graph_replays_and_registered_replay_after_unregister_poisons() {
    let (rt, s, d) = with_alloc(64);
    let src = host(64, 5);
    // SAFETY: `src` outlives the registration and every replay.
    unsafe { gated(&*rt, |gt| rt.host_register(gt, src.as_ptr() as usize, 64)).unwrap() };
    rt.begin_capture(s, CaptureMode::Global).unwrap();
    assert_eq!(rt.capture_status(s).unwrap(), CaptureStatus::Active);
    // SAFETY: as above.
    unsafe { rt.copy_htod_async(d, src.as_ptr() as usize, 64, s).unwrap() };
    let g = rt.end_capture(s).unwrap();
    rt.graph_launch(g, s).unwrap();
    gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap();
    let mut out = host(64, 0);
    // SAFETY: `out` is writable.
    unsafe { rt.copy_dtoh(out.as_mut_ptr() as usize, d, 64).unwrap() };
    assert!(out.iter().all(|&x| x == 5));
    gated(&*rt, |gt| rt.host_unregister(gt, src.as_ptr() as usize)).unwrap();
    rt.graph_launch(g, s).unwrap();
    assert_eq!(gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap_err().code, Code::LAUNCH_FAILED);
    assert_eq!(gated(&*rt, |gt| rt.mem_alloc(gt, 64)).unwrap_err().code, Code::LAUNCH_FAILED, "poison is sticky");
    assert_eq!(rt.poisoned(), Some(Code::LAUNCH_FAILED));
}

#[test]
fn register_fault_at_kth_call() {
    let rt = std::sync::Arc::new(SimRuntime::new());
    let bufs: Vec<Vec<u8>> = (0..3).map(|_| host(4096, 0)).collect();
    rt.inject(SimFault::Register { nth: 2, code: Code::NOT_SUPPORTED });
    let r: Vec<_> = bufs
        .iter()
        // SAFETY: each buffer outlives its registration (unregistered below).
        .map(|b| unsafe { gated(&*rt, |gt| rt.host_register(gt, b.as_ptr() as usize, 4096)) }.map_err(|e| e.code))
        .collect();
    assert_eq!(r, vec![Ok(()), Err(Code::NOT_SUPPORTED), Ok(())]);
    assert_eq!(rt.registered_ranges(), 2);
    gated(&*rt, |gt| rt.host_unregister(gt, bufs[0].as_ptr() as usize)).unwrap();
    gated(&*rt, |gt| rt.host_unregister(gt, bufs[2].as_ptr() as usize)).unwrap();
    assert_eq!(
        gated(&*rt, |gt| rt.host_unregister(gt, bufs[1].as_ptr() as usize)).unwrap_err().code,
        Code::HOST_MEMORY_NOT_REGISTERED
    );
}

#[test]
fn copy_fault_and_batched_copies() {
    let (rt, s, d) = with_alloc(256);
    let src = host(256, 3);
    rt.inject(SimFault::Copy { nth: 1, code: Code::INVALID_VALUE });
    let frags: Vec<Fragment> = (0..4)
        .map(|i| Fragment { host: src.as_ptr() as usize + i * 64, device: d.offset(i * 64), bytes: 64 })
        .collect();
    // SAFETY: `src` outlives the synchronize below.
    let first = unsafe { rt.copy_batch_async(Direction::HostToDevice, &frags, s) };
    assert_eq!(first.unwrap_err().code, Code::INVALID_VALUE);
    // SAFETY: as above.
    unsafe { rt.copy_batch_async(Direction::HostToDevice, &frags, s).unwrap() };
    gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap();
    let mut out = host(256, 0);
    // SAFETY: `out` is writable.
    unsafe { rt.copy_dtoh(out.as_mut_ptr() as usize, d, 256).unwrap() };
    assert!(out.iter().all(|&x| x == 3));
}

#[test]
fn unregister_waits_for_device_idle() {
    let rt = std::sync::Arc::new(SimRuntime::new());
    let s = rt.stream_create().unwrap();
    let buf = host(64, 0);
    // SAFETY: `buf` outlives its registration.
    unsafe { gated(&*rt, |gt| rt.host_register(gt, buf.as_ptr() as usize, 64)).unwrap() };
    let hold = rt.hold(HoldPoint::DeviceOp);
    // SAFETY: the spin kernel reads and writes no memory.
    unsafe { rt.launch(kvoffload::Kernel::Spin { nanos: 1 }, s).unwrap() };
    hold.wait_entered();
    let (rt2, addr) = (rt.clone(), buf.as_ptr() as usize);
    let t = std::thread::spawn(move || gated(&*rt2, |gt| rt2.host_unregister(gt, addr)));
    rt.wait_blocked(Blocked::Idle, 1);
    assert_eq!(rt.registered_ranges(), 1, "unregistered while the kernel runs");
    hold.release();
    t.join().unwrap().unwrap();
    assert_eq!(rt.registered_ranges(), 0);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let rt = std::sync::Arc::new(SimRuntime::new());
    // SAFETY: zero-length and null ranges are refused before any access.
    assert_eq!(unsafe { gated(&*rt, |gt| rt.host_register(gt, 0, 64)) }.unwrap_err().code, Code::INVALID_VALUE);
    assert_eq!(gated(&*rt, |gt| rt.mem_alloc(gt, 0)).unwrap_err().code, Code::INVALID_VALUE);
    let s = rt.stream_create().unwrap();
    assert_eq!(rt.end_capture(s).unwrap_err().code, Code::ILLEGAL_STATE);
    rt.stream_destroy(s).unwrap();
    assert_eq!(gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap_err().code, Code::INVALID_HANDLE);
    let d = gated(&*rt, |gt| rt.mem_alloc(gt, 64)).unwrap();
    let s = rt.stream_create().unwrap();
    // SAFETY: the runtime refuses the out-of-bounds memset before any write.
    let over = unsafe { rt.memset_d8_async(d, 0, 65, s) };
    assert_eq!(over.unwrap_err().code, Code::INVALID_VALUE, "out of bounds");
}

/// Regression (found by `kvoffload run` with copy faults): a job that failed
/// at enqueue leaves an event wait as the last op of its stream and records
/// its completion event right after it. Retiring that wait must wake the
/// thread synchronizing on the event, or it sleeps forever (the device
/// thread retires the wait after the enqueue woke it, usually after the
/// synchronizing thread went to sleep: repeated to hit that order).
#[test]
fn event_after_a_trailing_wait_completes_and_wakes_its_waiter() {
    let rt = std::sync::Arc::new(SimRuntime::new());
    let (compute, side) = (rt.stream_create().unwrap(), rt.stream_create().unwrap());
    let d = gated(&*rt, |gt| rt.mem_alloc(gt, 4096)).unwrap();
    let src = host(4096, 7);
    let (after, done) = (rt.event_create().unwrap(), rt.event_create().unwrap());
    for _ in 0..2000 {
        // SAFETY: `src` outlives the synchronize below.
        unsafe { rt.copy_htod_async(d, src.as_ptr() as usize, 4096, compute).unwrap() };
        rt.event_record(after, compute).unwrap();
        rt.stream_wait_event(side, after).unwrap();
        rt.event_record(done, side).unwrap();
        gated(&*rt, |gt| rt.event_synchronize(gt, done)).unwrap();
    }
    assert!(gated(&*rt, |gt| rt.event_query(gt, done)).unwrap());
}

/// A wait retired late in the device's pass over the streams can satisfy a
/// wait on a stream it already passed: the device must look again before
/// it sleeps. Streams a, b, c (in the order the device visits them): a
/// waits for b, b only waits for c, c runs a held memset. After the memset
/// the device retires b's wait; a's wait, already passed, is satisfied only
/// then. The staged backend's failed load (model/p5_staged_order.rs) hung
/// this way: a staging stream holding nothing but its wait for the compute
/// stream. A hang fails the test after 60 s.
#[test]
fn a_wait_satisfied_late_in_the_devices_pass_is_retired() {
    let rt = std::sync::Arc::new(SimRuntime::new());
    let (a, b, c) = (rt.stream_create().unwrap(), rt.stream_create().unwrap(), rt.stream_create().unwrap());
    let d = gated(&*rt, |gt| rt.mem_alloc(gt, 64)).unwrap();
    let (ec, eb, ea) = (rt.event_create().unwrap(), rt.event_create().unwrap(), rt.event_create().unwrap());
    let hold = rt.hold(HoldPoint::DeviceOp);
    // SAFETY: `d` is a 64-byte allocation of `rt`.
    unsafe { rt.memset_d8_async(d, 1, 64, c).unwrap() };
    hold.wait_entered();
    rt.event_record(ec, c).unwrap();
    rt.stream_wait_event(b, ec).unwrap();
    rt.event_record(eb, b).unwrap();
    rt.stream_wait_event(a, eb).unwrap();
    rt.event_record(ea, a).unwrap();
    hold.release();
    let rt2 = rt.clone();
    returns_within_60s("the device went to sleep with stream a's wait satisfied but not retired", move || {
        gated(&*rt2, |gt| rt2.event_synchronize(gt, ea))
    })
    .unwrap();
}

/// `cuStreamDestroy` with work queued returns at once; the handle is invalid
/// from then on, and the device still runs the queued work (CUDA driver
/// API documentation). A destroy that waited would hang on the held memset:
/// the test then fails after 60 s.
#[test]
fn stream_destroy_returns_at_once_and_the_device_finishes_the_work() {
    let (rt, s, d) = with_alloc(64);
    let mut out = host(64, 0);
    let e = rt.event_create().unwrap();
    let hold = rt.hold(HoldPoint::DeviceOp);
    // SAFETY: `d` is a 64-byte allocation of `rt`; `out` outlives the
    // event synchronize below.
    unsafe {
        rt.memset_d8_async(d, 5, 64, s).unwrap();
        rt.copy_dtoh_async(out.as_mut_ptr() as usize, d, 64, s).unwrap();
    }
    rt.event_record(e, s).unwrap();
    hold.wait_entered();
    let rt2 = rt.clone();
    returns_within_60s("stream_destroy waited for the stream's queued work", move || rt2.stream_destroy(s)).unwrap();
    // SAFETY: `d` is live; nothing is enqueued (the handle is invalid).
    assert_eq!(unsafe { rt.memset_d8_async(d, 6, 64, s) }.unwrap_err().code, Code::INVALID_HANDLE);
    assert!(!gated(&*rt, |gt| rt.event_query(gt, e)).unwrap(), "the queued work was dropped with the stream");
    hold.release();
    gated(&*rt, |gt| rt.event_synchronize(gt, e)).unwrap();
    assert!(out.iter().all(|&x| x == 5), "the destroyed stream's copy did not run");
    assert_eq!(rt.poisoned(), None);
}

/// With two device workers, one stream's operation held on the device does
/// not hold back another stream's work; the held stream's next operation
/// still waits for it (order per stream). With one worker the same held
/// operation stops the whole device: the test then fails after 60 s.
#[test]
fn two_device_workers_run_two_streams_at_once() {
    use kvoffload::SimConfig;
    let rt = std::sync::Arc::new(SimRuntime::with_config(SimConfig { workers: 2, ..SimConfig::default() }));
    let (a, b) = (rt.stream_create().unwrap(), rt.stream_create().unwrap());
    let d = gated(&*rt, |gt| rt.mem_alloc(gt, 128)).unwrap();
    let (ea, eb) = (rt.event_create().unwrap(), rt.event_create().unwrap());
    let hold = rt.hold(HoldPoint::DeviceOp);
    // SAFETY: `d` is a 128-byte allocation of `rt`: a's memsets write its
    // first half, b's its second.
    unsafe { rt.memset_d8_async(d, 1, 64, a).unwrap() };
    hold.wait_entered();
    unsafe { rt.memset_d8_async(d, 2, 64, a).unwrap() };
    rt.event_record(ea, a).unwrap();
    unsafe { rt.memset_d8_async(d.offset(64), 3, 64, b).unwrap() };
    rt.event_record(eb, b).unwrap();
    let rt2 = rt.clone();
    returns_within_60s("stream b waited behind stream a's held operation", move || {
        gated(&*rt2, |gt| rt2.event_synchronize(gt, eb))
    })
    .unwrap();
    assert!(!gated(&*rt, |gt| rt.event_query(gt, ea)).unwrap(), "stream a ran past its held operation");
    hold.release();
    gated(&*rt, |gt| rt.event_synchronize(gt, ea)).unwrap();
    let mut out = host(128, 0);
    // SAFETY: `out` is a writable buffer of 128 bytes.
    unsafe { rt.copy_dtoh(out.as_mut_ptr() as usize, d, 128) }.unwrap();
    assert!(out[..64].iter().all(|&x| x == 2) && out[64..].iter().all(|&x| x == 3), "{out:?}");
}

#[test]
fn batched_copy_spanning_two_registrations_is_refused() {
    // One copy's host range lies in one registration or in none (the H200
    // answered INVALID_VALUE for staged runs crossing 1 MiB registration
    // chunks, docs/gpu-runs/2026-11-30-duplex-summary.md).
    let rt = std::sync::Arc::new(SimRuntime::new());
    let d = gated(&*rt, |gt| rt.mem_alloc(gt, 3 * 4096)).unwrap();
    let mut buf = memmap2::MmapMut::map_anon(3 * 4096).unwrap();
    let base = buf.as_mut_ptr() as usize;
    // SAFETY: `buf` stays mapped until both ranges are unregistered below.
    unsafe {
        gated(&*rt, |gt| rt.host_register(gt, base, 4096)).unwrap();
        gated(&*rt, |gt| rt.host_register(gt, base + 4096, 4096)).unwrap();
    }
    let s = rt.stream_create().unwrap();
    let copy = |host: usize, bytes: usize| {
        let f = [Fragment { host, device: d, bytes }];
        // SAFETY: `buf` and `d` outlive the copies (synchronized below).
        unsafe { rt.copy_batch_async(Direction::DeviceToHost, &f, s) }.map_err(|e| e.code)
    };
    assert_eq!(copy(base + 100, 4096), Err(Code::INVALID_VALUE), "across two registrations");
    assert_eq!(copy(base + 4096 + 100, 4096), Err(Code::INVALID_VALUE), "registered, then not");
    assert_eq!(copy(base + 100, 3000), Ok(()), "inside one registration");
    assert_eq!(copy(base + 2 * 4096, 4096), Ok(()), "in none (pageable)");
    gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap();
    gated(&*rt, |gt| rt.host_unregister(gt, base)).unwrap();
    gated(&*rt, |gt| rt.host_unregister(gt, base + 4096)).unwrap();
}

/// What this process can get now (`kvoffload::internal::region::limits`),
/// if known; where not, says that the test calling it is skipped.
fn host_available() -> Option<usize> {
    let avail = kvoffload::internal::region::available_memory().map(|b| usize::try_from(b.bytes).unwrap_or(usize::MAX));
    if avail.is_none() {
        eprintln!("skipped: what this process can get is not known here");
    }
    avail
}

/// A simulated GPU whose configured device memory is no limit: only what
/// the host can back (or `host_limit`) bounds its allocations.
fn unbounded_sim(host_limit: Option<usize>) -> SimRuntime {
    use kvoffload::SimConfig;
    SimRuntime::with_config(SimConfig { device_bytes: usize::MAX, host_limit, ..SimConfig::default() })
}

/// Issue 20 item 7: the sim's device memory is host memory, so a request
/// the host cannot back (4 times what this process can get) is
/// OUT_OF_MEMORY at once, as the driver answers past its memory, and
/// changes nothing; before, the allocation aborted the process or handed
/// out pages the OOM killer took back with it. The same for page-locked
/// host memory.
#[test]
fn an_allocation_the_host_cannot_back_is_out_of_memory_at_once() {
    let Some(avail) = host_available() else { return };
    let rt = unbounded_sim(None);
    let huge = avail.saturating_mul(4);
    assert_eq!(gated(&rt, |gt| rt.mem_alloc(gt, huge)).map_err(|e| e.code), Err(Code::OUT_OF_MEMORY));
    assert_eq!(rt.device_bytes_in_use(), 0, "a refused allocation takes nothing");
    assert_eq!(gated(&rt, |gt| rt.mem_alloc_host(gt, huge)).map_err(|e| e.code), Err(Code::OUT_OF_MEMORY));
    assert_eq!(rt.host_allocs_in_use(), 0);
    // The runtime is fine afterwards.
    let d = gated(&rt, |gt| rt.mem_alloc(gt, 4096)).unwrap();
    // SAFETY: `d` was never used by any work.
    gated(&rt, |gt| unsafe { rt.mem_free(gt, d) }).unwrap();
}

/// Many allocations that each fit but together pass what the host can back:
/// the first past it is OUT_OF_MEMORY and the process lives on. The pages
/// are never written (the sim's memory is zero-filled lazily), so the test
/// uses no memory; before, every allocation succeeded.
#[test]
fn allocations_summing_past_what_the_host_can_back_are_out_of_memory() {
    let Some(avail) = host_available() else { return };
    let rt = unbounded_sim(None);
    let chunk = (avail / 8).max(1 << 20);
    let mut got = Vec::new();
    let mut refused = None;
    for _ in 0..32 {
        match gated(&rt, |gt| rt.mem_alloc(gt, chunk)) {
            Ok(p) => got.push(p),
            Err(e) => {
                refused = Some(e.code);
                break;
            }
        }
    }
    let n = got.len();
    assert_eq!(refused, Some(Code::OUT_OF_MEMORY), "{n} allocations of {chunk} bytes (the host can back {avail})");
    assert!(n < 16, "{n} allocations of {chunk} bytes went through (the host can back {avail})");
    assert_eq!(rt.device_bytes_in_use(), n * chunk, "the refused one took nothing");
    for d in got {
        // SAFETY: no work ever used these allocations.
        gated(&rt, |gt| unsafe { rt.mem_free(gt, d) }).unwrap();
    }
    assert_eq!(rt.device_bytes_in_use(), 0);
    gated(&rt, |gt| rt.mem_alloc(gt, chunk)).expect("room again once freed");
}

/// `SimConfig::host_limit` in place of the host's reading: device and
/// page-locked host memory together stay within it, to the byte.
#[test]
fn device_and_page_locked_memory_together_stay_within_the_host_limit() {
    let mib = 1 << 20;
    let rt = unbounded_sim(Some(8 * mib));
    let dev: Vec<_> = (0..6).map(|_| gated(&rt, |gt| rt.mem_alloc(gt, mib)).unwrap()).collect();
    let h = gated(&rt, |gt| rt.mem_alloc_host(gt, 2 * mib)).unwrap();
    assert_eq!(gated(&rt, |gt| rt.mem_alloc(gt, 1)).map_err(|e| e.code), Err(Code::OUT_OF_MEMORY));
    assert_eq!(gated(&rt, |gt| rt.mem_alloc_host(gt, 1)).map_err(|e| e.code), Err(Code::OUT_OF_MEMORY));
    assert_eq!((rt.device_bytes_in_use(), rt.host_allocs_in_use()), (6 * mib, 1));
    // SAFETY: no work ever used `h`.
    gated(&rt, |gt| unsafe { rt.mem_free_host(gt, h) }).unwrap();
    let d = gated(&rt, |gt| rt.mem_alloc(gt, 2 * mib)).expect("the freed host memory is room again");
    for p in dev.into_iter().chain([d]) {
        // SAFETY: no work ever used these allocations.
        gated(&rt, |gt| unsafe { rt.mem_free(gt, p) }).unwrap();
    }
}

/// Host memory owned by a test, handed to the sim by address
/// (`adopt_host_memory`): read only through its raw pointer, after the
/// device work on it was synchronized.
struct HostTensor {
    ptr: *mut u8,
    len: usize,
}

impl HostTensor {
    fn new(len: usize, fill: u8) -> Self {
        let ptr = Box::into_raw(vec![fill; len].into_boxed_slice()) as *mut u8;
        HostTensor { ptr, len }
    }
    fn addr(&self) -> usize {
        self.ptr as usize
    }
    fn bytes(&self) -> Vec<u8> {
        // SAFETY: `ptr..ptr+len` is this tensor's live allocation; callers
        // read it only when no device work on it is queued.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

impl Drop for HostTensor {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` of a boxed slice of `len` bytes.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// Issue 21: host memory adopted as device memory, in place. Copies into
/// the adopted range change the host bytes, copies out of it read them,
/// and it does not count against the device memory (a sim of 4 KiB adopts
/// 1 MiB). Before `adopt_host_memory` existed, a pointer the sim did not
/// allocate was refused at enqueue (INVALID_VALUE), as the last lines
/// check for a released range.
#[test]
fn a_copy_round_trip_through_adopted_memory_changes_the_host_bytes() {
    use kvoffload::SimConfig;
    let rt = std::sync::Arc::new(SimRuntime::with_config(SimConfig { device_bytes: 4096, ..SimConfig::default() }));
    let s = rt.stream_create().unwrap();
    let t = HostTensor::new(1 << 20, 0);
    // SAFETY: `t` outlives the adoption (released below) and is read only
    // after the stream is synchronized.
    let d = unsafe { rt.adopt_host_memory(t.addr(), t.len) }.unwrap();
    assert_eq!(rt.adopted_ranges(), 1);
    assert_eq!(rt.device_bytes_in_use(), 0, "adopted memory is not the sim's device memory");
    let src: Vec<u8> = (0..4096).map(|i| (i * 7 % 251) as u8).collect();
    // SAFETY: `src` outlives the synchronize; the destination is adopted.
    unsafe { rt.copy_htod_async(d.offset(8192), src.as_ptr() as usize, 4096, s).unwrap() };
    gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap();
    let now = t.bytes();
    assert_eq!(&now[8192..8192 + 4096], &src[..], "the copy wrote the host bytes in place");
    assert!(now[..8192].iter().chain(&now[8192 + 4096..]).all(|&b| b == 0), "and nothing else");
    // Back out, asynchronously and synchronously.
    let mut out = host(4096, 0);
    // SAFETY: `out` outlives the synchronize.
    unsafe { rt.copy_dtoh_async(out.as_mut_ptr() as usize, d.offset(8192), 4096, s).unwrap() };
    gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap();
    assert_eq!(out, src);
    let mut sync_out = host(16, 1);
    // SAFETY: `sync_out` is writable for 16 bytes.
    unsafe { rt.copy_dtoh(sync_out.as_mut_ptr() as usize, d, 16).unwrap() };
    assert_eq!(sync_out, host(16, 0));
    rt.release_adopted(d).unwrap();
    assert_eq!(rt.adopted_ranges(), 0);
    // SAFETY: refused before any access: the range is no longer device memory.
    let gone = unsafe { rt.copy_htod_async(d, src.as_ptr() as usize, 16, s) };
    assert_eq!(gone.map_err(|e| e.code), Err(Code::INVALID_VALUE));
}

/// A memset and a kernel (gather, its table in adopted memory too) on
/// adopted memory, run directly and replayed from a captured graph: each
/// writes the host bytes when it runs, and the capture itself writes
/// nothing.
#[test]
fn a_memset_a_kernel_and_a_graph_replay_write_adopted_memory() {
    use kvoffload::Kernel;
    let rt = std::sync::Arc::new(SimRuntime::new());
    let s = rt.stream_create().unwrap();
    let t = HostTensor::new(4096, 0);
    let table = HostTensor::new(24, 0);
    // SAFETY: `t` and `table` outlive their adoptions (released below) and
    // are read only after the device is synchronized.
    let (d, dt) =
        unsafe { (rt.adopt_host_memory(t.addr(), 4096).unwrap(), rt.adopt_host_memory(table.addr(), 24).unwrap()) };
    // SAFETY: `d` is adopted, 4096 bytes.
    unsafe { rt.memset_d8_async(d, 0xAB, 1024, s).unwrap() };
    gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap();
    assert!(t.bytes()[..1024].iter().all(|&b| b == 0xAB) && t.bytes()[1024..].iter().all(|&b| b == 0));

    // The gather kernel copies bytes 0..512 to 2048..2560 (one entry:
    // source, destination, bytes), its table written into adopted memory.
    let entry: Vec<u8> = [d.raw(), d.offset(2048).raw(), 512].iter().flat_map(|w| w.to_ne_bytes()).collect();
    // SAFETY: `entry` is 24 readable bytes; `dt` is adopted, 24 bytes.
    unsafe { rt.copy_htod(dt, entry.as_ptr() as usize, 24).unwrap() };
    assert_eq!(table.bytes(), entry, "the synchronous copy wrote the table's host bytes");
    // SAFETY: the table and every range it names are adopted memory.
    unsafe { rt.launch(Kernel::Gather { table: dt, count: 1 }, s).unwrap() };
    gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap();
    assert!(t.bytes()[2048..2560].iter().all(|&b| b == 0xAB), "the kernel read and wrote adopted memory");

    rt.begin_capture(s, CaptureMode::Global).unwrap();
    // SAFETY: `d` is adopted; recorded, not run.
    unsafe { rt.memset_d8_async(d.offset(3072), 0x5C, 1024, s).unwrap() };
    let g = rt.end_capture(s).unwrap();
    assert!(t.bytes()[3072..].iter().all(|&b| b == 0), "a capture runs nothing");
    rt.graph_launch(g, s).unwrap();
    gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap();
    assert!(t.bytes()[3072..].iter().all(|&b| b == 0x5C), "the replay wrote the host bytes");
    rt.release_adopted(d).unwrap();
    // Replayed after the release, the graph faults as on freed memory.
    rt.graph_launch(g, s).unwrap();
    assert_eq!(gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap_err().code, Code::ILLEGAL_ADDRESS);
    rt.release_adopted(dt).unwrap();
    assert!(t.bytes()[3072..].iter().all(|&b| b == 0x5C));
}

/// A simulated GPU, a stream of it, a zeroed host tensor of `len` bytes,
/// and that tensor adopted as the GPU's memory.
///
/// # Safety
/// As for [`SimRuntime::adopt_host_memory`]: the caller keeps the tensor
/// (whose bytes do not move with it) alive and unread while the GPU may
/// access it, until the adoption is released or the GPU dropped.
unsafe fn adopted_tensor(len: usize) -> (std::sync::Arc<SimRuntime>, Stream, HostTensor, DevicePtr) {
    let rt = std::sync::Arc::new(SimRuntime::new());
    let s = rt.stream_create().unwrap();
    let t = HostTensor::new(len, 0);
    // SAFETY: the caller's promise (above); `t`'s bytes are its own heap
    // allocation, which moving `t` to the caller does not move.
    let d = unsafe { rt.adopt_host_memory(t.addr(), len) }.unwrap();
    (rt, s, t, d)
}

/// `release_adopted` with work on the range queued waits, like `mem_free`,
/// until the device is idle: the held memset still writes the host bytes
/// before the release returns, and nothing touches them after. A pointer
/// that is not an adoption is refused, and `mem_free` refuses an adoption.
#[test]
fn releasing_adopted_memory_waits_for_queued_work() {
    // SAFETY: `t` outlives the adoption; read after the release returned.
    let (rt, s, t, d) = unsafe { adopted_tensor(256) };
    // SAFETY: refused: `d` is not an allocation of the sim.
    assert_eq!(gated(&*rt, |gt| unsafe { rt.mem_free(gt, d) }).unwrap_err().code, Code::INVALID_VALUE);
    let hold = rt.hold(HoldPoint::DeviceOp);
    // SAFETY: `d` is adopted, 256 bytes.
    unsafe { rt.memset_d8_async(d, 7, 256, s).unwrap() };
    hold.wait_entered();
    let rt2 = rt.clone();
    let release = std::thread::spawn(move || rt2.release_adopted(d));
    let waited = rt.wait_blocked_timeout(Blocked::Idle, 1, std::time::Duration::from_secs(5));
    assert!(waited && rt.adopted_ranges() == 1, "released while work on it is queued");
    hold.release();
    release.join().unwrap().unwrap();
    assert_eq!(rt.adopted_ranges(), 0);
    assert!(t.bytes().iter().all(|&b| b == 7), "the queued memset ran before the release returned");
    assert_eq!(rt.release_adopted(d).unwrap_err().code, Code::INVALID_VALUE, "released twice");
    let owned = gated(&*rt, |gt| rt.mem_alloc(gt, 64)).unwrap();
    assert_eq!(rt.release_adopted(owned).unwrap_err().code, Code::INVALID_VALUE, "an allocation is not adopted");
}

/// An access past the end of an adopted range is the fault an access past
/// the end of an allocation is: INVALID_VALUE at enqueue or for a
/// synchronous copy, ILLEGAL_ADDRESS (sticky) from a kernel.
#[test]
fn an_access_past_an_adopted_range_faults_as_past_an_allocation() {
    use kvoffload::Kernel;
    // SAFETY: `t` outlives the adoption and is never accessed by the sim
    // out of its range (the point of the test).
    let (rt, s, t, d) = unsafe { adopted_tensor(4096) };
    let a = gated(&*rt, |gt| rt.mem_alloc(gt, 4096)).unwrap();
    let src = host(64, 1);
    for p in [d, a] {
        // SAFETY: refused before any access (out of range).
        let over = unsafe { rt.copy_htod_async(p.offset(4096 - 32), src.as_ptr() as usize, 64, s) };
        assert_eq!(over.map_err(|e| e.code), Err(Code::INVALID_VALUE), "{p}");
        // SAFETY: as above.
        let over = unsafe { rt.copy_htod(p.offset(4096), src.as_ptr() as usize, 1) };
        assert_eq!(over.map_err(|e| e.code), Err(Code::INVALID_VALUE), "{p}");
        // SAFETY: as above.
        assert_eq!(unsafe { rt.memset_d8_async(p, 0, 4097, s) }.unwrap_err().code, Code::INVALID_VALUE);
    }
    // A kernel's table entry past the end: a device fault.
    let entry: Vec<u8> = [a.raw(), d.offset(4000).raw(), 128].iter().flat_map(|w| w.to_ne_bytes()).collect();
    // SAFETY: `entry` is 24 readable bytes into the allocation `a`.
    unsafe { rt.copy_htod(a, entry.as_ptr() as usize, 24).unwrap() };
    // SAFETY: the entry is checked by the device before any byte moves.
    unsafe { rt.launch(Kernel::Gather { table: a, count: 1 }, s).unwrap() };
    assert_eq!(gated(&*rt, |gt| rt.stream_synchronize(gt, s)).unwrap_err().code, Code::ILLEGAL_ADDRESS);
    assert!(t.bytes().iter().all(|&b| b == 0), "nothing written");
}

/// What `adopt_host_memory` refuses: a null or empty range, one
/// overlapping another adoption or registered host memory; and
/// `host_register` refuses adopted memory.
#[test]
fn bad_adoptions_are_typed_errors() {
    let rt = std::sync::Arc::new(SimRuntime::new());
    let t = HostTensor::new(8192, 0);
    let code = |r: kvoffload::DriverResult<kvoffload::DevicePtr>| r.map(|_| ()).map_err(|e| e.code);
    // SAFETY: refused, or adopted memory of `t`, which outlives the sim.
    unsafe {
        assert_eq!(code(rt.adopt_host_memory(0, 64)), Err(Code::INVALID_VALUE));
        assert_eq!(code(rt.adopt_host_memory(t.addr(), 0)), Err(Code::INVALID_VALUE));
        assert_eq!(code(rt.adopt_host_memory(usize::MAX - 8, 64)), Err(Code::INVALID_VALUE));
        rt.adopt_host_memory(t.addr(), 4096).unwrap();
        assert_eq!(code(rt.adopt_host_memory(t.addr() + 4095, 2)), Err(Code::INVALID_VALUE), "overlaps");
        assert_eq!(
            gated(&*rt, |gt| rt.host_register(gt, t.addr(), 4096)).unwrap_err().code,
            Code::INVALID_VALUE,
            "adopted memory is not host memory to pin"
        );
        gated(&*rt, |gt| rt.host_register(gt, t.addr() + 4096, 4096)).unwrap();
        assert_eq!(code(rt.adopt_host_memory(t.addr() + 4096, 16)), Err(Code::INVALID_VALUE), "registered");
    }
    gated(&*rt, |gt| rt.host_unregister(gt, t.addr() + 4096)).unwrap();
}
