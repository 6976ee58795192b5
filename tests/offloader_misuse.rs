//! Issue 28 on the library's own API (the Python front's tests are
//! python/tests/test_misuse.py and test_interrupt.py): a capture window or
//! a nested `gated` inside `gated` is refused instead of waiting for
//! itself; the interruptible forms of `capture_begin`, `gated`,
//! `wait_jobs` and `shutdown` stop when their check says so and leave
//! nothing behind; the core of a keyed offloader refuses slot jobs; a KV allocation too
//! large for the process is refused before anything is allocated.
//! Simulated GPU.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvoffload::internal::offloader::activity;
use kvoffload::internal::protocol::Activity;
use kvoffload::internal::runtime::sim::HoldPoint;
use kvoffload::{
    shared, CapturePolicy, JobId, KeyedOffloader, KvAlloc, Lane, Offloader, OffloaderError, OffloaderOptions,
    ProtocolError, Request, SimRuntime, SlotJob,
};
use std::sync::Arc;
use std::thread;

const PAGE: usize = 4096;

fn kv(tensors: usize) -> KvAlloc {
    KvAlloc { tensors, page_bytes: PAGE, gpu_blocks: 4, block_factor: 1 }
}

fn offloader(opts: OffloaderOptions) -> Offloader {
    Offloader::with_allocated_tensors(shared(SimRuntime::new()), kv(1), opts).expect("offloader")
}

/// An offloader of 8 host blocks, started and pinned.
fn pinned() -> Offloader {
    let off = offloader(OffloaderOptions::with_host_blocks(8));
    off.start().unwrap();
    off.wait_pinned(Request::new()).unwrap();
    off
}

fn sim(off: &Offloader) -> &SimRuntime {
    off.geometry().runtime.as_sim().expect("the simulated GPU")
}

/// Spins (yielding) until `cond` holds, 20 s at most: observing a state
/// another thread reaches.
fn until(what: &str, cond: impl Fn() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(20), "never: {what}");
        thread::yield_now();
    }
}

/// An interrupt check that says stop once `stop` is set.
fn check(stop: &AtomicBool) -> impl Fn() -> bool + '_ {
    move || stop.load(Ordering::SeqCst)
}

fn interrupted(r: Result<(), OffloaderError>) -> bool {
    matches!(r, Err(OffloaderError::Protocol(ProtocolError::Interrupted { .. })))
}

fn would_deadlock<T>(r: Result<T, OffloaderError>) -> bool {
    matches!(r, Err(OffloaderError::Protocol(ProtocolError::WouldDeadlock { .. })))
}

#[test]
fn a_window_or_a_nested_gated_inside_gated_is_refused() {
    let off = pinned();
    let never = AtomicBool::new(false);
    // Each of these waited for the gated call it ran inside, for ever.
    assert!(would_deadlock(off.gated("test", Request::new(), |_| off.capture_window(Request::new())).unwrap()));
    assert!(would_deadlock(
        off.gated("test", Request::new(), |_| off.capture_window(Request::new().interruptible(&check(&never))))
            .unwrap()
    ));
    assert!(would_deadlock(off.gated("test", Request::new(), |_| off.capture_hook().begin(Request::new())).unwrap()));
    assert!(would_deadlock(
        off.gated("test", Request::new(), |_| off.gated("nested", Request::new(), |_| ())).unwrap()
    ));
    assert_eq!(off.capture_hook().depth(), 0);
    assert_eq!(activity(&off), Activity::default());
    // Outside gated, all of them work again.
    drop(off.capture_window(Request::new()).unwrap());
    off.capture_hook().begin(Request::new()).unwrap();
    off.capture_hook().end(Request::new()).unwrap();
    assert_eq!(off.gated("test", Request::new(), |_| 7).unwrap(), 7);
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn an_interrupted_capture_begin_opens_nothing() {
    let mut opts = OffloaderOptions::with_host_blocks(8);
    opts.pin.policy = CapturePolicy::Interleave;
    let off = offloader(opts);
    let hold = sim(&off).hold(HoldPoint::Register);
    off.start().unwrap();
    hold.wait_entered(); // a registration in flight: a hook window waits
    let stop = AtomicBool::new(false);
    thread::scope(|s| {
        let begin = s.spawn(|| off.capture_hook().begin(Request::new().interruptible(&check(&stop))));
        until("the hook window waits", || activity(&off).windows_waiting == 1);
        stop.store(true, Ordering::SeqCst);
        assert!(interrupted(begin.join().unwrap()));
    });
    assert_eq!(activity(&off), Activity { calls_in_flight: 1, ..Activity::default() });
    hold.release();
    off.wait_pinned(Request::new()).unwrap();
    off.shutdown(Request::new(), &mut drop).unwrap(); // no window was left open
}

#[test]
fn an_interrupted_gated_runs_nothing() {
    let off = pinned();
    let (opened_tx, opened) = mpsc::channel();
    let (close, close_rx) = mpsc::channel::<()>();
    let stop = AtomicBool::new(false);
    let ran = AtomicBool::new(false);
    thread::scope(|s| {
        let holder = &off;
        s.spawn(move || {
            let w = holder.capture_window(Request::new()).unwrap();
            opened_tx.send(()).unwrap();
            close_rx.recv().unwrap();
            drop(w);
        });
        opened.recv().unwrap();
        let gated = s.spawn(|| {
            off.gated("test", Request::new().interruptible(&check(&stop)), |_| ran.store(true, Ordering::SeqCst))
        });
        until("gated waits", || activity(&off).calls_waiting == 1);
        stop.store(true, Ordering::SeqCst);
        assert!(interrupted(gated.join().unwrap()));
        assert_eq!(activity(&off), Activity { windows_open: 1, ..Activity::default() });
        close.send(()).unwrap();
    });
    assert!(!ran.load(Ordering::SeqCst));
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn interrupted_wait_jobs_and_shutdown_leave_the_job_running() {
    let off = Arc::new(pinned());
    let hold = sim(&off).hold(HoldPoint::DeviceOp);
    off.submit(JobId(7), Lane::Store, &SlotJob::single(&[0], &[0], 0)).unwrap();
    hold.wait_entered();
    let stop = AtomicBool::new(true); // stop at the first check
    let mut sink = Vec::new();
    assert!(interrupted(
        off.wait_jobs(&[JobId(7)], Request::new().interruptible(&check(&stop)), &mut |c| sink.push(c))
    ));
    assert!(interrupted(off.shutdown(Request::new().interruptible(&check(&stop)), &mut |c| sink.push(c))));
    assert!(!off.is_shut_down());
    assert_eq!(off.in_flight(), 1);
    hold.release();
    let never = AtomicBool::new(false);
    off.wait_jobs(&[JobId(7), JobId(99)], Request::new().interruptible(&check(&never)), &mut |c| sink.push(c)).unwrap();
    assert_eq!(sink.iter().map(|c| (c.job, c.error.is_none())).collect::<Vec<_>>(), [(JobId(7), true)]);
    off.shutdown(Request::new().interruptible(&check(&never)), &mut |c| sink.push(c)).unwrap();
    assert!(off.is_shut_down());
}

#[test]
fn the_core_of_a_keyed_offloader_refuses_slot_jobs_and_keyed_refuses_kv_groups() {
    // The type decides what a call may do: a keyed offloader's block
    // manager owns its host slots, so its core takes no slot job (nothing
    // submitted, the manager untouched), and keyed jobs have one group.
    let rt = shared(SimRuntime::new());
    let keyed = KeyedOffloader::with_allocated_tensors(rt, kv(1), OffloaderOptions::with_host_blocks(8)).unwrap();
    let r = keyed.core().submit(JobId(1), Lane::Store, &SlotJob::single(&[0], &[0], 0));
    assert!(matches!(r, Err(OffloaderError::KeyedCore { call: "submit" })), "{r:?}");
    assert_eq!(keyed.core().in_flight(), 0);
    // Its waits are the core's: ids not in flight are skipped.
    keyed.core().wait_jobs(&[JobId(1)], Request::new(), &mut drop).unwrap();
    let never = AtomicBool::new(false);
    keyed.core().wait_jobs(&[JobId(1)], Request::new().interruptible(&check(&never)), &mut |_| {}).unwrap();
    keyed.core().shutdown(Request::new(), &mut drop).unwrap();
    let opts = OffloaderOptions { kv_groups: Some(vec![1]), ..OffloaderOptions::with_host_blocks(8) };
    match KeyedOffloader::with_allocated_tensors(shared(SimRuntime::new()), kv(1), opts) {
        Err(OffloaderError::Options(m)) => assert!(m.contains("kv_groups"), "{m}"),
        r => panic!("kv_groups on a keyed offloader: {r:?}"),
    }
}

#[test]
fn a_kv_allocation_too_large_is_refused_before_anything_is_allocated() {
    let cases = [
        (KvAlloc { tensors: 1 << 63, ..kv(1) }, 8),
        (KvAlloc { tensors: 1 << 40, ..kv(1) }, 8),
        (KvAlloc { tensors: 100_000, ..kv(1) }, 1 << 20),
        (KvAlloc { block_factor: 1 << 62, ..kv(1) }, 8),
        (KvAlloc { page_bytes: 1 << 62, ..kv(4) }, 8),
        (kv(1), 1 << 62),
    ];
    for (alloc, host_blocks) in cases {
        let rt = shared(SimRuntime::new());
        let r = Offloader::with_allocated_tensors(rt.clone(), alloc, OffloaderOptions::with_host_blocks(host_blocks));
        let e = r.expect_err("refused");
        assert!(
            matches!(e, OffloaderError::Options(_) | OffloaderError::Region(_)),
            "{alloc:?}, {host_blocks} host blocks: {e:?}"
        );
        // Not "in use" (an error path frees what it allocated): never
        // allocated at all.
        let sim = rt.as_sim().expect("the simulated GPU");
        assert_eq!(sim.device_bytes_peak(), 0, "{alloc:?}: device memory allocated before the refusal");
    }
}

#[test]
fn a_shared_regions_share_and_the_tensor_count_are_checked_before_any_tensor() {
    use kvoffload::{RegionSpec, ShmOptions};

    let dir = std::env::temp_dir().join(format!("kvoffload-misuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shared_region = |host_blocks| {
        let mut o = OffloaderOptions::with_host_blocks(host_blocks);
        o.region =
            RegionSpec::Shared { name: "misuse".into(), rank: 0, ranks: 1, options: ShmOptions::default().dir(&dir) };
        o
    };
    let cases = [
        // A 1 TiB share (2**40 tensors of one byte): past any machine's memory.
        (KvAlloc { tensors: 1 << 40, page_bytes: 1, gpu_blocks: 1, block_factor: 1 }, shared_region(1)),
        (KvAlloc { tensors: 100_000, ..kv(1) }, shared_region(1 << 20)),
        // More tensors than any engine has, whatever the memory check says.
        (
            KvAlloc { tensors: 1 << 21, page_bytes: 1, gpu_blocks: 1, block_factor: 1 },
            OffloaderOptions::with_host_blocks(1),
        ),
    ];
    for (alloc, opts) in cases {
        let rt = shared(SimRuntime::new());
        let e = Offloader::with_allocated_tensors(rt.clone(), alloc, opts).expect_err("refused");
        assert!(matches!(e, OffloaderError::Options(_) | OffloaderError::Region(_)), "{alloc:?}: {e:?}");
        let sim = rt.as_sim().expect("the simulated GPU");
        assert_eq!(sim.device_bytes_peak(), 0, "{alloc:?}: device memory allocated before the refusal ({e})");
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "no region file made");
    std::fs::remove_dir(&dir).unwrap();
}

#[test]
fn a_shared_regions_memory_check_is_its_share_and_off_when_asked() {
    use kvoffload::internal::region::available_memory;
    use kvoffload::{RegionSpec, ShmOptions};

    let Some(budget) = available_memory() else {
        println!("skipped: this machine does not say how much memory a process can get");
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvoffload-share-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Host blocks of 1 MiB (one tensor of 1 MiB pages); files sized, never
    // reserved or touched (nothing is pinned).
    const MIB: u64 = 1 << 20;
    let alloc = KvAlloc { tensors: 1, page_bytes: MIB as usize, gpu_blocks: 1, block_factor: 1 };
    let shared = |name: &str, ranks, share_bytes: u64, check| {
        let mut o = OffloaderOptions::with_host_blocks((share_bytes / MIB) as usize);
        let options = ShmOptions::default().dir(&dir).reserve(false).wait_for_all(false).check_memory(check);
        o.region = RegionSpec::Shared { name: name.into(), rank: 0, ranks, options };
        o
    };
    // 2 ranks, each share 3/4 of the budget (1.5 times it in all). Rank 0
    // creates the region: its check (Region::create's) is of every share,
    // the node's memory holding them all: refused before any tensor.
    let rt = shared_rt();
    let e = Offloader::with_allocated_tensors(rt.clone(), alloc, shared("both", 2, budget.bytes / 4 * 3, true))
        .expect_err("two shares of 3/4 of the budget");
    assert!(matches!(e, OffloaderError::Region(_)), "{e:?}");
    assert_eq!(rt.as_sim().unwrap().device_bytes_peak(), 0, "a tensor allocated before the refusal ({e})");
    // The files are sized (not reserved): the directory's file system must
    // have room for them (Region::create's other check).
    let st = rustix::fs::statvfs(&dir).unwrap();
    let disk = st.f_bavail * st.f_frsize;
    // Each share half the budget less a little: created.
    let halves = budget.bytes / 2 - (budget.bytes / 8).min(1 << 30);
    if 2 * halves + MIB < disk {
        let opts = shared("halves", 2, halves, true);
        let off = Offloader::with_allocated_tensors(shared_rt(), alloc, opts).expect("two shares within the budget");
        off.shutdown(Request::new(), &mut drop).unwrap();
    } else {
        println!("skipped the shares within the budget: {disk} bytes free in {}", dir.display());
    }
    // One rank of 9/8 of the budget: refused by the check, built without it.
    let over = budget.bytes / 8 * 9;
    let e = Offloader::with_allocated_tensors(shared_rt(), alloc, shared("over", 1, over, true))
        .expect_err("more than the budget");
    assert!(matches!(e, OffloaderError::Region(_)), "{e:?}");
    if over + MIB < disk {
        let opts = shared("unchecked", 1, over, false);
        let off =
            Offloader::with_allocated_tensors(shared_rt(), alloc, opts).expect("check_memory(false) skips the check");
        off.shutdown(Request::new(), &mut drop).unwrap();
    } else {
        println!("skipped check_memory(false): {disk} bytes free in {}", dir.display());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn shared_rt() -> Arc<dyn kvoffload::GpuRuntime> {
    shared(SimRuntime::new())
}

#[test]
fn every_wait_and_shutdown_inside_gated_is_refused() {
    // Each waits for work (a poll through the gate, the pinner's next
    // chunk, the drain) that a window asked for by another thread holds
    // back until this gated call ends: it would wait for itself.
    let off = Arc::new(pinned());
    off.submit(JobId(1), Lane::Store, &SlotJob::single(&[0], &[0], 0)).unwrap();
    let never = AtomicBool::new(false);
    assert!(would_deadlock(
        off.gated("test", Request::new(), |_| off.wait(JobId(1), Request::new(), &mut drop)).unwrap()
    ));
    assert!(would_deadlock(off.gated("test", Request::new(), |_| off.wait_all(Request::new(), &mut drop)).unwrap()));
    assert!(would_deadlock(
        off.gated("test", Request::new(), |_| off.wait_jobs(&[JobId(1)], Request::new(), &mut drop)).unwrap()
    ));
    assert!(would_deadlock(
        off.gated("test", Request::new(), |_| off.wait_jobs(
            &[JobId(1)],
            Request::new().interruptible(&check(&never)),
            &mut |_| {}
        ))
        .unwrap()
    ));
    assert!(would_deadlock(off.gated("test", Request::new(), |_| off.wait_pinned(Request::new())).unwrap()));
    assert!(would_deadlock(off.gated("test", Request::new(), |_| off.shutdown(Request::new(), &mut drop)).unwrap()));
    assert!(would_deadlock(
        off.gated("test", Request::new(), |_| off.shutdown(Request::new().interruptible(&check(&never)), &mut |_| {}))
            .unwrap()
    ));
    assert!(!off.is_shut_down());
    assert_eq!(
        activity(&off),
        Activity { jobs_in_flight: 1, ..Activity::default() },
        "nothing left in flight but the job"
    );
    off.wait_jobs(&[JobId(1)], Request::new(), &mut drop).unwrap();
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn a_panic_in_a_gated_call_ends_the_call() {
    let off = pinned();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        off.gated("test", Request::new(), |_| panic!("the callable"))
    }));
    assert!(r.is_err());
    assert_eq!(activity(&off), Activity::default(), "no call left in flight");
    drop(off.capture_window(Request::new()).expect("a window opens after the panic"));
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn is_shut_down_answers_while_a_shutdown_drains() {
    let off = Arc::new(pinned());
    thread::scope(|s| {
        // Dropped on the way out of this closure, a failure included, so
        // the held shutdown ends and the scope can join it.
        let hold = sim(&off).hold(HoldPoint::DeviceOp);
        off.submit(JobId(7), Lane::Store, &SlotJob::single(&[0], &[0], 0)).unwrap();
        hold.wait_entered();
        let shutting = s.spawn(|| off.shutdown(Request::new(), &mut drop));
        // The shutdown holds its own lock through the drain, held here:
        // asking must not wait for it (the Python front asks with the GIL).
        let asked = s.spawn(|| {
            while !off.is_shut_down() {
                thread::yield_now();
            }
        });
        until("is_shut_down answered while the shutdown drains", || asked.is_finished());
        assert_eq!(off.in_flight(), 1, "still draining");
        hold.release();
        shutting.join().unwrap().unwrap();
    });
}

#[test]
fn an_interruptible_shutdown_is_refused_at_once_while_another_threads_window_is_open() {
    let off = Arc::new(pinned());
    let never = AtomicBool::new(false);
    thread::scope(|s| {
        // Both dropped on the way out of this closure, a failure included:
        // the window closes and the held job ends, so the scope can join.
        let (opened_tx, opened) = mpsc::channel();
        let (close, close_rx) = mpsc::channel::<()>();
        let hold = sim(&off).hold(HoldPoint::DeviceOp);
        off.submit(JobId(3), Lane::Store, &SlotJob::single(&[0], &[0], 0)).unwrap();
        hold.wait_entered();
        let holder = &off;
        s.spawn(move || {
            let w = holder.capture_window(Request::new()).unwrap();
            opened_tx.send(()).unwrap();
            let _ = close_rx.recv();
            drop(w);
        });
        opened.recv().unwrap();
        // The blocking form refuses this at once; the interruptible one
        // drained first, waiting for the window to close.
        let asked = s.spawn(|| off.shutdown(Request::new().interruptible(&check(&never)), &mut |_| {}));
        until("the interruptible shutdown answered", || asked.is_finished());
        let r = asked.join().unwrap();
        assert!(matches!(r, Err(OffloaderError::Protocol(ProtocolError::WindowOpen { open: 1 }))), "{r:?}");
        assert!(!off.is_shut_down());
        close.send(()).unwrap();
        hold.release();
    });
    off.shutdown(Request::new(), &mut drop).unwrap();
}
