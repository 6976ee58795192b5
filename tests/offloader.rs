//! An engine written against `KeyedOffloader` alone, on the simulated GPU (and
//! the same round trip on a real GPU where one exists): blocks written into
//! GPU blocks, stored, loaded back into other GPU blocks and compared byte
//! for byte, with GLOBAL graph captures inside capture windows while jobs
//! are in flight; bad inputs; shutdown; two ranks sharing a region.

#[path = "gpu_common/mod.rs"]
mod gpu_common;

use std::time::Duration;

use kvoffload::internal::runtime::sim::HoldPoint;
use kvoffload::internal::sync::atomic::{AtomicUsize, Ordering};
use kvoffload::internal::sync::{self, thread, Arc, Condvar, Mutex};
use kvoffload::{
    pattern, shared, BlockKey, CaptureMode, Direction, DriverError, Event, GatedCalls, GpuRuntime, KeyedOffloader,
    KvAlloc, Lookup, OffloaderError, OffloaderOptions, PinObserver, PinState, ProtocolError, RegionSpec, Request,
    ShmOptions, SimRuntime, Stream,
};

const PAGE: usize = 4096;

fn kv() -> KvAlloc {
    KvAlloc { tensors: 3, page_bytes: PAGE, gpu_blocks: 32, block_factor: 2 }
}

fn offloader(host_blocks: usize) -> KeyedOffloader {
    offloader_on(shared(SimRuntime::new()), host_blocks)
}

fn offloader_on(rt: Arc<dyn GpuRuntime>, host_blocks: usize) -> KeyedOffloader {
    let mut opts = OffloaderOptions::with_host_blocks(host_blocks);
    // Small chunks, so pinning takes several registrations.
    opts.pin = opts.pin.max_chunk_bytes(4 * 3 * 2 * PAGE);
    KeyedOffloader::with_allocated_tensors(rt, kv(), opts).expect("offloader on the simulated GPU")
}

/// Writes the contents of `key` (page by page) into GPU blocks `gpu` of
/// every tensor, through the runtime the offloader hands out.
fn write_blocks(off: &KeyedOffloader, key: u64, gpu: &[usize]) {
    let rt = &off.core().geometry().runtime;
    for (t, base) in off.core().geometry().tensors().into_iter().enumerate() {
        for (j, &b) in gpu.iter().enumerate() {
            let mut buf = vec![0u8; PAGE];
            pattern::fill(key * 1000 + (t * 16 + j) as u64, &mut buf);
            // SAFETY: `buf` is readable for the synchronous copy; the
            // destination is GPU block `b` of a tensor of the offloader.
            unsafe { rt.copy_htod(base.offset(b * PAGE), buf.as_ptr() as usize, PAGE) }.unwrap();
        }
    }
}

/// Checks GPU blocks `gpu` against `key`'s contents; returns the pages
/// that differ.
fn check_blocks(off: &KeyedOffloader, key: u64, gpu: &[usize]) -> usize {
    let rt = &off.core().geometry().runtime;
    let mut bad = 0;
    for (t, base) in off.core().geometry().tensors().into_iter().enumerate() {
        for (j, &b) in gpu.iter().enumerate() {
            let mut got = vec![0u8; PAGE];
            // SAFETY: `got` is writable for the synchronous copy.
            unsafe { rt.copy_dtoh(got.as_mut_ptr() as usize, base.offset(b * PAGE), PAGE) }.unwrap();
            let mut want = vec![0u8; PAGE];
            pattern::fill(key * 1000 + (t * 16 + j) as u64, &mut want);
            bad += usize::from(got != want);
        }
    }
    bad
}

/// One GLOBAL capture of a memset inside a capture window; returns whether
/// the graph came out (the library never invalidates it, P1).
fn capture_in_window(off: &KeyedOffloader) -> bool {
    let rt = &off.core().geometry().runtime;
    let s = rt.stream_create().unwrap();
    let scratch = off.core().gated("scratch", Request::new(), |calls| calls.mem_alloc(4096)).unwrap().unwrap();
    let ok = {
        let _w = off.core().capture_window(Request::new()).unwrap();
        rt.begin_capture(s, CaptureMode::Global).unwrap();
        // SAFETY: `scratch` lives until freed below, after the graph is gone.
        let enq = unsafe { rt.memset_d8_async(scratch, 1, 4096, s) };
        let end = rt.end_capture(s);
        match end {
            Ok(g) => {
                rt.graph_destroy(g).unwrap();
                enq.is_ok()
            }
            Err(_) => false,
        }
    };
    // SAFETY: the graph that used `scratch` is destroyed and its capture
    // never ran; nothing uses it afterwards.
    off.core().gated("scratch", Request::new(), |calls| unsafe { calls.mem_free(scratch) }).unwrap().unwrap();
    rt.stream_destroy(s).unwrap();
    ok
}

#[test]
fn store_load_round_trip_through_capture_windows() {
    round_trip(offloader(16));
}

#[test]
fn gpu_store_load_round_trip_through_capture_windows() {
    let Some(rt) = gpu_common::gpu("gpu_store_load_round_trip_through_capture_windows") else {
        return;
    };
    round_trip(offloader_on(shared(rt), 16));
}

fn round_trip(off: KeyedOffloader) {
    off.core().start().unwrap();
    let keys: Vec<BlockKey> = (0..4).map(|k| BlockKey::new(k, 0)).collect();
    // GPU blocks 2k, 2k+1 hold key k (block factor 2).
    let gpu: Vec<usize> = (0..8).collect();
    for k in 0..4u64 {
        write_blocks(&off, k, &gpu[2 * k as usize..2 * k as usize + 2]);
    }
    let st = off.store(&keys, &gpu).unwrap();
    assert_eq!(st.stored, keys);
    // Readable only once the store is reported.
    assert_eq!(off.lookup(&keys), [Lookup::HitPending; 4]);
    assert_eq!(off.lookup(&[BlockKey::new(9, 0)]), [Lookup::Miss]);
    assert!(capture_in_window(&off), "a capture inside a window was invalidated");
    off.core().wait_all(Request::new(), &mut drop).unwrap();
    let done = off.poll();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].direction, Direction::DeviceToHost);
    assert!(done[0].error.is_none(), "{:?}", done[0].error);
    assert_eq!(off.lookup(&keys), [Lookup::Hit; 4]);
    assert_eq!(off.stored_blocks(), 4);
    assert_eq!(off.core().pin_progress().state, off.core().wait_pinned(Request::new()).unwrap().state);
    // Load into other GPU blocks, with a capture in between.
    let dst: Vec<usize> = (16..24).collect();
    let job = off.load(&keys, &dst).unwrap();
    assert!(capture_in_window(&off), "a capture inside a window was invalidated");
    off.core().wait(job, Request::new(), &mut drop).unwrap();
    let done = off.poll();
    assert_eq!(done.len(), 1);
    assert!(done[0].error.is_none());
    for k in 0..4u64 {
        assert_eq!(check_blocks(&off, k, &dst[2 * k as usize..2 * k as usize + 2]), 0, "key {k} corrupted");
    }
    assert_eq!(off.core().in_flight(), 0);
    off.core().shutdown(Request::new(), &mut drop).unwrap();
    assert!(off.core().is_shut_down());
}

#[test]
fn pinning_reaches_pinned_and_reports_progress() {
    let off = offloader(16);
    assert_eq!(off.core().pin_progress().state, PinState::Pending);
    let p = off.core().pin_progress();
    assert!(p.chunks_total >= 2, "{p:?}");
    let out = off.core().wait_pinned(Request::new()).unwrap();
    assert_eq!(out.state, PinState::Pinned);
    assert_eq!(out.agreement, None);
    let p = off.core().pin_progress();
    assert_eq!(p.chunks_done, p.chunks_total);
    off.core().shutdown(Request::new(), &mut drop).unwrap();
}

/// Records what the pinner reports, and holds it at one chunk until told.
#[derive(Default)]
struct Recorder {
    chunks: Mutex<Vec<(usize, usize)>>,
    settled: AtomicUsize,
    hold_at: Option<usize>,
    release: Mutex<bool>,
    cv: Condvar,
}

impl PinObserver for Recorder {
    fn before_chunk(&self, index: usize, total: usize) {
        sync::lock(&self.chunks).push((index, total));
        if self.hold_at == Some(index) {
            let mut go = sync::lock(&self.release);
            while !*go {
                go = sync::wait(&self.cv, go);
            }
        }
    }

    fn settled(&self) {
        self.settled.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_pin_observer_sees_every_chunk_and_the_end_and_can_hold_pinning() {
    let rec = Arc::new(Recorder { hold_at: Some(1), ..Default::default() });
    let mut opts = OffloaderOptions::with_host_blocks(16);
    opts.pin = opts.pin.max_chunk_bytes(4 * 3 * 2 * PAGE);
    opts.pin_observer = Some(rec.clone());
    let off = KeyedOffloader::with_allocated_tensors(shared(SimRuntime::new()), kv(), opts).unwrap();
    let total = off.core().pin_progress().chunks_total;
    assert!(total >= 3, "{total} chunks");
    off.core().start().unwrap();
    // Held before chunk 1: chunk 0 registered, pinning not final.
    let t = std::time::Instant::now();
    while sync::lock(&rec.chunks).len() < 2 {
        assert!(t.elapsed() < Duration::from_secs(20), "the observer saw {:?}", sync::lock(&rec.chunks));
        thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(50));
    let state = off.core().pin_progress().state;
    assert!(matches!(state, PinState::Pinning { .. }), "{state:?}");
    assert_eq!(rec.settled.load(Ordering::SeqCst), 0);
    *sync::lock(&rec.release) = true;
    rec.cv.notify_all();
    assert_eq!(off.core().wait_pinned(Request::new()).unwrap().state, PinState::Pinned);
    let seen = sync::lock(&rec.chunks).clone();
    assert_eq!(seen, (0..total).map(|i| (i, total)).collect::<Vec<_>>());
    assert_eq!(rec.settled.load(Ordering::SeqCst), 1);
    off.core().shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn bad_inputs_are_typed_errors() {
    let off = offloader(4);
    let k = [BlockKey::new(1, 0)];
    match off.store(&k, &[1]) {
        Err(OffloaderError::GpuBlockCount { keys: 1, factor: 2, need: 2, got: 1 }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(off.load(&k, &[1, 2]), Err(OffloaderError::Manager(_))), "load of a missing key");
    // Two keys on the same key twice in one batch.
    assert!(matches!(off.store(&[k[0], k[0]], &[1, 2, 3, 4]), Err(OffloaderError::Manager(_))));
    // Shutdown is refused (nothing changed) while a window is open.
    off.core().wait_pinned(Request::new()).unwrap();
    let w = off.core().capture_window(Request::new()).unwrap();
    assert!(matches!(
        off.core().shutdown(Request::new(), &mut drop),
        Err(OffloaderError::Protocol(ProtocolError::WindowOpen { open: 1 }))
    ));
    drop(w);
    assert!(off.store(&k, &[1, 2]).is_ok());
    off.core().shutdown(Request::new(), &mut drop).unwrap();
    assert!(matches!(
        off.core().shutdown(Request::new(), &mut drop),
        Err(OffloaderError::Protocol(ProtocolError::AlreadyShutDown))
    ));
    assert!(matches!(off.store(&k, &[3, 4]), Err(OffloaderError::ShutDown)));
    assert!(matches!(
        off.core().capture_window(Request::new()),
        Err(OffloaderError::Protocol(ProtocolError::ShutDown))
    ));
    assert!(off.poll().is_empty());
}

#[test]
fn zero_sizes_are_refused() {
    let rt = shared(SimRuntime::new());
    let e =
        KeyedOffloader::with_allocated_tensors(rt.clone(), kv(), OffloaderOptions::with_host_blocks(0)).unwrap_err();
    assert!(matches!(e, OffloaderError::Options(_)), "{e:?}");
    // Each size of the allocation, zero alone: refused by name, before any
    // device memory (a later check would refuse some of them too, after
    // allocating tensors of zero bytes, or with a message about the layout).
    for alloc in [KvAlloc { tensors: 0, ..kv() }, KvAlloc { page_bytes: 0, ..kv() }, KvAlloc { gpu_blocks: 0, ..kv() }]
    {
        match KeyedOffloader::with_allocated_tensors(rt.clone(), alloc, OffloaderOptions::with_host_blocks(4)) {
            Err(OffloaderError::Options(m)) => assert!(m.contains("zero-sized KV allocation"), "{alloc:?}: {m}"),
            r => panic!("{alloc:?}: {:?}", r.map(|_| ())),
        }
    }
    assert_eq!(rt.as_sim().unwrap().device_bytes_peak(), 0, "device memory allocated before a refusal");
    // Nothing leaked on the simulated GPU: every failed build freed its tensors.
    assert_eq!(rt.as_sim().unwrap().device_bytes_in_use(), 0);
}

#[test]
fn drop_without_shutdown_shuts_down() {
    let rt = shared(SimRuntime::new());
    {
        let off =
            KeyedOffloader::with_allocated_tensors(rt.clone(), kv(), OffloaderOptions::with_host_blocks(8)).unwrap();
        off.core().wait_pinned(Request::new()).unwrap();
        off.store(&[BlockKey::new(5, 0)], &[0, 1]).unwrap();
    }
    let sim = rt.as_sim().unwrap();
    assert_eq!(sim.device_bytes_in_use(), 0, "tensors, tables freed");
    assert_eq!(sim.registered_ranges(), 0, "region unregistered");
    assert_eq!(sim.host_allocs_in_use(), 0, "staging rings freed");
}

#[test]
fn an_offloader_refuses_a_region_whose_reservation_is_deferred() {
    let rt = shared(SimRuntime::new());
    let mut opts = OffloaderOptions::with_host_blocks(8);
    let name = format!("offloader-defer-{}", std::process::id());
    opts.region = RegionSpec::Shared { name, rank: 0, ranks: 1, options: ShmOptions::new().defer_reserve(true) };
    match KeyedOffloader::with_allocated_tensors(rt.clone(), kv(), opts) {
        Err(OffloaderError::Options(m)) => assert!(m.contains("defer_reserve") && m.contains("SIGBUS"), "{m}"),
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("a deferred reservation was accepted"),
    }
    // Refused before anything was made: no tensors, no region file.
    assert_eq!(rt.as_sim().unwrap().device_bytes_in_use(), 0);
}

#[test]
fn two_ranks_share_a_region_and_agree() {
    let name = format!("offloader-test-{}", std::process::id());
    // Both ranks store into their block 0 before either loads back: were
    // their shares one (a rank's host blocks found at another's place),
    // the second store would overwrite the first.
    let stored = Arc::new(std::sync::Barrier::new(2));
    let run = move |rank: usize| {
        let name = name.clone();
        let stored = stored.clone();
        thread::spawn(move || {
            let rt = shared(SimRuntime::new());
            let opts = rank_of_two(name, rank);
            let off = KeyedOffloader::with_allocated_tensors(rt, kv(), opts).unwrap();
            let out = off.core().wait_pinned(Request::new()).unwrap();
            let k = BlockKey::new(rank as u64, 0);
            write_blocks(&off, 100 + rank as u64, &[0, 1]);
            off.store(&[k], &[0, 1]).unwrap();
            off.core().wait_all(Request::new(), &mut drop).unwrap();
            off.poll();
            stored.wait();
            let j = off.load(&[k], &[4, 5]).unwrap();
            off.core().wait(j, Request::new(), &mut drop).unwrap();
            off.poll();
            let bad = check_blocks(&off, 100 + rank as u64, &[4, 5]);
            let linked = off.core().geometry().region.is_linked();
            off.core().shutdown(Request::new(), &mut drop).unwrap();
            (out, bad, linked)
        })
    };
    let (a, b) = (run(0), run(1));
    for (out, bad, linked) in [a.join().unwrap(), b.join().unwrap()] {
        assert_eq!(out.state, PinState::Pinned);
        assert_eq!(out.agreement, Some(Ok(())));
        assert_eq!(bad, 0, "a rank's blocks were corrupted by the other's");
        assert!(!linked, "the region file is unlinked once both ranks mapped it");
    }
}

/// Options of 8 host blocks for `rank` of 2 sharing the region `name`.
fn rank_of_two(name: String, rank: usize) -> OffloaderOptions {
    let mut opts = OffloaderOptions::with_host_blocks(8);
    opts.region =
        RegionSpec::Shared { name, rank, ranks: 2, options: ShmOptions::new().timeout(Duration::from_secs(30)) };
    opts
}

/// Tells a channel when this rank's own pinning settled (before the
/// agreement).
struct SettledSignal(std::sync::Mutex<std::sync::mpsc::Sender<()>>);
impl PinObserver for SettledSignal {
    fn settled(&self) {
        let _ = self.0.lock().unwrap().send(());
    }
}

/// Two ranks of the shared region `name` (an agreement far longer than any
/// test: only a shutdown or a cancel can end a wait in it), rank 0 started
/// and done with its own pinning, so waiting in the agreement for rank 1,
/// which has not started pinning.
fn rank0_waiting_for_rank1(name: &str) -> (KeyedOffloader, KeyedOffloader) {
    let (tx, rx) = std::sync::mpsc::channel();
    let make = |rank: usize, observer: Option<Arc<dyn PinObserver>>| {
        let name = name.to_string();
        thread::spawn(move || {
            let mut opts = rank_of_two(name, rank);
            opts.agreement_timeout = Some(Duration::from_secs(600));
            opts.pin_observer = observer;
            KeyedOffloader::with_allocated_tensors(shared(SimRuntime::new()), kv(), opts).unwrap()
        })
    };
    let observer: Arc<dyn PinObserver> =
        sync::arc_dyn(SettledSignal(std::sync::Mutex::new(tx)), |a| -> sync::StdArc<dyn PinObserver> { a });
    let (a, b) = (make(0, Some(observer)), make(1, None));
    let (r0, r1) = (a.join().unwrap(), b.join().unwrap());
    r0.core().start().unwrap();
    rx.recv_timeout(Duration::from_secs(60)).expect("rank 0 never finished its own pinning");
    (r0, r1)
}

/// Issue 28, item 1: `shutdown` during the agreement, with a peer that
/// never settles, ends the agreement for this rank at once (before: it
/// waited the agreement timeout, then reported `Timeout`), and tells the
/// peer: when it comes to settle it ends pageable at once, naming the rank
/// that left (before: it found rank 0 settled and turned offload on alone).
#[test]
fn shutdown_during_the_agreement_ends_it_and_the_peer_settles_pageable_at_once() {
    use kvoffload::AgreementError;
    let (r0, r1) = rank0_waiting_for_rank1(&format!("offloader-leave-{}", std::process::id()));
    let t = std::time::Instant::now();
    r0.core().shutdown(Request::new(), &mut drop).unwrap();
    let took = t.elapsed();
    println!("shutdown during the agreement returned in {} ms", took.as_millis());
    let out0 = r0.core().wait_pinned(Request::new()).unwrap();
    assert_eq!(out0.agreement, Some(Err(AgreementError::Cancelled { waiting: vec![1] })), "{out0:?}");
    assert!(matches!(out0.state, PinState::Pageable(_)), "{out0:?}");
    // The peer comes later: it settles pageable at once, told why.
    let out1 = r1.core().wait_pinned(Request::new()).unwrap();
    assert_eq!(out1.agreement, Some(Err(AgreementError::Abandoned { by: 0, ranks: vec![1] })), "{out1:?}");
    assert!(matches!(out1.state, PinState::Pageable(_)), "{out1:?}");
    r1.core().shutdown(Request::new(), &mut drop).unwrap();
}

/// Issue 28, item 1: `cancel_pinning` (an engine's call to stop waiting for
/// its peers without shutting down; the Python front does not make it: its
/// Ctrl-C in `wait_pinned` leaves pinning and the agreement running, and
/// its shutdown ends both) ends this rank's wait in the agreement for a
/// peer that never settles; `wait_pinned` then returns at once.
#[test]
fn cancel_pinning_ends_the_wait_in_the_agreement() {
    use kvoffload::AgreementError;
    let (r0, r1) = rank0_waiting_for_rank1(&format!("offloader-cancel-{}", std::process::id()));
    r0.core().cancel_pinning();
    let out0 = r0.core().wait_pinned(Request::new()).unwrap();
    assert_eq!(out0.agreement, Some(Err(AgreementError::Cancelled { waiting: vec![1] })), "{out0:?}");
    assert_eq!(out0.state, PinState::Pageable(kvoffload::PageableReason::Cancelled));
    // No chunk stays registered on the cancelled rank.
    assert_eq!(r0.core().pin_progress().chunks_done, 0);
    r0.core().shutdown(Request::new(), &mut drop).unwrap();
    r1.core().shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn the_offloader_its_options_and_geometry_print_what_they_hold() {
    let off = offloader(4);
    let core = format!("{:?}", off.core());
    for field in ["Offloader", "backend: \"sim\"", "region_bytes", "rank: 0", "pin:"] {
        assert!(core.contains(field), "{field} missing from {core}");
    }
    let mut opts = OffloaderOptions::with_host_blocks(4);
    opts.kv_groups = Some(vec![2, 1]);
    let opts = format!("{opts:?}");
    for field in
        ["OffloaderOptions", "host_blocks: 4", "region: Anonymous", "kv_groups: Some([2, 1])", "pin_observer: None"]
    {
        assert!(opts.contains(field), "{field} missing from {opts}");
    }
    let geometry = format!("{:?}", off.core().geometry());
    for field in ["Geometry", "runtime: \"sim\"", "host_blocks: 4", "layout", "region", "lane_streams"] {
        assert!(geometry.contains(field), "{field} missing from {geometry}");
    }
    off.core().shutdown(Request::new(), &mut drop).unwrap();
}

/// One of the synchronizing calls of `GatedCalls`, on stream `s` whose work
/// ends with event `ev`.
type SyncCall = fn(&GatedCalls<'_>, Stream, Event) -> Result<(), DriverError>;

#[test]
fn the_gated_calls_reach_the_runtime() {
    let sim = SimRuntime::new();
    let device = sim.another_handle();
    let off = offloader_on(shared(sim), 4);
    let core = off.core();
    let rt = core.geometry().runtime.clone();
    // Page-locked host memory: an address the runtime freed again.
    let host = core.gated("host", Request::new(), |c| c.mem_alloc_host(PAGE)).unwrap().unwrap();
    // SAFETY: nothing used the allocation.
    core.gated("host", Request::new(), |c| unsafe { c.mem_free_host(host) })
        .unwrap()
        .expect("the address mem_alloc_host gave");
    let scratch = core.gated("scratch", Request::new(), |c| c.mem_alloc(PAGE)).unwrap().unwrap();
    let s = rt.stream_create().unwrap();
    let ev = rt.event_create().unwrap();
    let done = |what| core.gated(what, Request::new(), |c| c.event_query(ev)).unwrap().unwrap();
    let calls: [(&str, SyncCall); 3] = [
        ("stream_synchronize", |c, s, _| c.stream_synchronize(s)),
        ("ctx_synchronize", |c, _, _| c.ctx_synchronize()),
        ("event_synchronize", |c, _, ev| c.event_synchronize(ev)),
    ];
    for (what, sync) in calls {
        // A memset held on the device until 100 ms from now, the event
        // recorded after it.
        let hold = device.hold(HoldPoint::DeviceOp);
        // SAFETY: `scratch` is this test's allocation, used by nothing else.
        unsafe { rt.memset_d8_async(scratch, 1, PAGE, s) }.unwrap();
        rt.event_record(ev, s).unwrap();
        hold.wait_entered();
        assert!(!done("query"), "{what}: the event completed while its stream's work was held");
        let release = thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            hold.release();
        });
        core.gated(what, Request::new(), |c| sync(c, s, ev)).unwrap().unwrap();
        assert!(done("query"), "{what} returned before the stream's work completed");
        release.join().unwrap();
    }
    rt.event_destroy(ev).unwrap();
    rt.stream_destroy(s).unwrap();
    // SAFETY: the stream that used `scratch` was synchronized.
    core.gated("scratch", Request::new(), |c| unsafe { c.mem_free(scratch) }).unwrap().unwrap();
    off.core().shutdown(Request::new(), &mut drop).unwrap();
}
