//! The pre-faulter on its own: every page resident (and faulted for
//! writing) after `ensure`, for 1..4 threads, huge pages on and off,
//! MADV_POPULATE_WRITE and page touching; the pipeline (hint, then ensure);
//! settle stops everything; typed errors.

mod pin_common;

use kvoffload::internal::pin::{Prefault, PrefaultConfig, PrefaultError, Prefaulter, ReserveFn};
use kvoffload::internal::region::AnonOptions;
use kvoffload::{page_size, Layout, PrefaultMode, Region};
use pin_common::{not_resident, not_written, returned, settles_after_a_panic, within_on};

/// A fresh anonymous region of `bytes`, with huge-page advice if asked.
fn fresh(bytes: usize, huge: bool) -> Region {
    let l = Layout::new(1, page_size(), bytes / page_size()).unwrap();
    Region::anonymous(l, &AnonOptions::new().huge_pages(huge)).unwrap()
}

/// A fresh region of `bytes` (base pages) and its address.
fn fresh_at(bytes: usize) -> (Region, usize) {
    let r = fresh(bytes, false);
    let base = r.as_ptr() as usize;
    (r, base)
}

/// A fresh region of `n` base pages: the page size, the region, its
/// address.
fn pages(n: usize) -> (usize, Region, usize) {
    let p = page_size();
    let (r, base) = fresh_at(n * p);
    (p, r, base)
}

fn prefaulter(threads: usize, mode: PrefaultMode, huge: bool) -> Prefaulter {
    // SAFETY: every test keeps the region it passes alive until the
    // pre-faulter was settled or dropped.
    unsafe { Prefaulter::new(PrefaultConfig { threads, mode, huge_pages: huge }) }
}

/// A pre-faulter of two workers touching base pages, with `plan` and the
/// reservation hook `hook` (run before each slice).
///
/// # Safety
/// As for [`Prefaulter::reserving`]: the memory of every chunk it is given
/// stays mapped until it was settled or dropped.
unsafe fn touching_two(plan: Vec<kvoffload::internal::pin::PlannedChunk>, hook: ReserveFn) -> Prefaulter {
    let cfg = PrefaultConfig { threads: 2, mode: PrefaultMode::Touch, huge_pages: false };
    // SAFETY: the caller's promise (above).
    unsafe { Prefaulter::reserving(cfg, plan, Some(hook), None) }
}

/// A pre-faulter of base pages with `plan` (queued at its first `ensure`).
fn planned(threads: usize, mode: PrefaultMode, plan: Vec<kvoffload::internal::pin::PlannedChunk>) -> Prefaulter {
    // SAFETY: as for `prefaulter`, for the plan's chunks too.
    unsafe { Prefaulter::with_plan(PrefaultConfig { threads, mode, huge_pages: false }, plan) }
}

#[test]
fn every_page_is_resident_after_ensure() {
    // 8 MiB plus 3 pages: whole huge pages and a ragged tail.
    let bytes = (8 << 20) + 3 * page_size();
    for mode in [PrefaultMode::Populate, PrefaultMode::Touch] {
        for huge in [false, true] {
            for threads in 1..=4 {
                let r = fresh(bytes, huge);
                let (addr, len) = (r.as_ptr() as usize, r.len());
                assert_eq!(not_resident(addr, len), len / page_size(), "fresh memory starts untouched");
                let pf = prefaulter(threads, mode, huge);
                pf.ensure(0, addr, len).unwrap();
                let what = format!("mode {mode:?}, huge {huge}, threads {threads}");
                assert_eq!(not_resident(addr, len), 0, "{what}: pages missing after ensure");
                assert_eq!(not_written(addr, len), 0, "{what}: pages not faulted for writing");
                assert_eq!(pf.stats().bytes, len as u64, "{what}");
                assert!(r.as_slice().unwrap().iter().all(|b| *b == 0), "{what}: contents unchanged");
                drop(pf);
            }
        }
    }
}

#[test]
fn touching_keeps_what_was_written() {
    // Pre-faulting memory that already holds data (a shared region another
    // rank wrote, or memory written during background pinning) changes nothing.
    let mut r = fresh(4 << 20, true);
    let s = r.as_mut_slice().unwrap();
    for (i, b) in s.iter_mut().enumerate().step_by(4097) {
        *b = (i % 251) as u8 + 1;
    }
    let before = r.as_slice().unwrap().to_vec();
    for mode in [PrefaultMode::Touch, PrefaultMode::Populate] {
        let pf = prefaulter(3, mode, true);
        pf.ensure(0, r.as_ptr() as usize, r.len()).unwrap();
    }
    assert_eq!(r.as_slice().unwrap(), &before[..]);
}

#[test]
fn hint_faults_ahead_and_ensure_waits_for_it() {
    let r = fresh(16 << 20, true);
    let base = r.as_ptr() as usize;
    let half = r.len() / 2;
    let pf = prefaulter(2, PrefaultMode::Populate, true);
    pf.ensure(0, base, half).unwrap();
    pf.hint(1, base + half, half);
    pf.hint(1, base + half, half); // a repeated hint is one job
    pf.ensure(1, base + half, half).unwrap();
    assert_eq!(not_resident(base, r.len()), 0);
    assert_eq!(pf.stats().bytes, r.len() as u64);
    assert_eq!(pf.workers_running(), 2);
    pf.settle();
    assert_eq!(pf.workers_running(), 0, "settle joins the workers");
    // Usable again after settling: workers restart on demand.
    pf.ensure(2, base, half).unwrap();
    assert_eq!(pf.workers_running(), 2);
}

#[test]
fn a_chunk_hinted_far_ahead_is_faulted_once() {
    // One worker, FIFO: chunks 1..=4 are hinted (a lookahead of four
    // chunks), then `ensure(0)` queues chunk 0 behind them, so when it
    // returns the hinted chunks are done. Their `ensure` must find them
    // done, not fault them again: every byte counted exactly once.
    let (r, base) = fresh_at(20 << 20);
    let chunk = 4 << 20;
    let pf = prefaulter(1, PrefaultMode::Populate, false);
    for i in 1..=4 {
        pf.hint(i, base + i * chunk, chunk);
    }
    pf.ensure(0, base, chunk).unwrap();
    assert_eq!(pf.stats().bytes, r.len() as u64, "the hinted chunks ran before chunk 0");
    for i in 1..=4 {
        pf.ensure(i, base + i * chunk, chunk).unwrap();
    }
    assert_eq!(pf.stats().bytes, r.len() as u64, "a hinted chunk was faulted again at its ensure");
    assert_eq!(not_resident(base, r.len()), 0);
}

#[test]
fn settle_stops_hinted_work_and_returns() {
    let r = fresh(64 << 20, false);
    let pf = prefaulter(1, PrefaultMode::Touch, false);
    pf.hint(7, r.as_ptr() as usize, r.len());
    pf.settle();
    assert_eq!(pf.workers_running(), 0);
    // Whatever ran finished; what did not start was dropped. The region can
    // now be unmapped safely.
    let done = pf.stats().bytes;
    assert!(done <= r.len() as u64);
    drop(r);
}

#[test]
fn zero_length_and_misaligned_chunks() {
    let pf = prefaulter(2, PrefaultMode::Populate, false);
    pf.ensure(0, 0x10000, 0).unwrap();
    assert_eq!(pf.workers_running(), 0, "nothing to do starts no thread");
    let p = page_size();
    match pf.ensure_typed(4, 3 * p + 8, p) {
        Err(PrefaultError::Misaligned { chunk: 4, addr, page }) => assert_eq!((addr, page), (3 * p + 8, p)),
        other => panic!("expected Misaligned, got {other:?}"),
    }
    // The trait's String error carries the same text.
    let e = pf.ensure(4, 3 * p + 8, p).unwrap_err();
    assert!(e.contains("not a multiple of the page size"), "{e}");
    // A hint of either is dropped (`ensure` reports the misaligned one):
    // no worker starts for it.
    let r = fresh(1 << 20, false);
    pf.hint(5, r.as_ptr() as usize, 0);
    pf.hint(6, r.as_ptr() as usize + 8, p);
    assert_eq!(pf.workers_running(), 0, "a hint of nothing, or misaligned, starts no thread");
}

#[test]
fn mode_off_does_nothing() {
    let r = fresh(1 << 20, false);
    let pf = prefaulter(2, PrefaultMode::Off, false);
    pf.hint(0, r.as_ptr() as usize, r.len());
    pf.ensure(0, r.as_ptr() as usize, r.len()).unwrap();
    assert_eq!(not_resident(r.as_ptr() as usize, r.len()), r.len() / page_size());
    assert_eq!(pf.workers_running(), 0);
}

#[test]
fn populate_write_is_reported() {
    let pf = prefaulter(1, PrefaultMode::Populate, false);
    // This crate targets Linux >= 5.14 in CI; either answer is valid, but
    // it must have been probed.
    assert!(pf.stats().populate_write.is_some());
    // From Linux 5.14 on the kernel has it, and the probe must find it.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let release = release.trim();
    let mut v = release.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse::<u32>().ok());
    if (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (5, 14) {
        assert_eq!(pf.stats().populate_write, Some(true), "Linux {release}");
    }
    assert_eq!(prefaulter(1, PrefaultMode::Touch, false).stats().populate_write, None);
}

#[test]
fn a_plan_is_queued_whole_and_each_chunk_faulted_once() {
    use kvoffload::internal::pin::PlannedChunk;
    // 8 chunks of 2 MiB over 4 lanes (data files), in registration order.
    let (r, base) = fresh_at(16 << 20);
    let c = 2 << 20;
    let plan: Vec<PlannedChunk> =
        (0..8).map(|i| PlannedChunk { chunk: i, addr: base + i * c, len: c, lane: i % 4 }).collect();
    let pf = planned(3, PrefaultMode::Populate, plan);
    assert_eq!(pf.workers_running(), 0, "nothing starts before the first ensure");
    // The first ensure queues every chunk; the later ones find them done or
    // running, and no chunk is faulted twice.
    for i in 0..8 {
        pf.ensure(i, base + i * c, c).unwrap();
        assert_eq!(not_resident(base + i * c, c), 0, "chunk {i}");
    }
    assert_eq!(pf.stats().bytes, r.len() as u64, "every byte faulted once");
    // A chunk that is not in the plan is faulted as without one.
    let r2 = fresh(4 << 20, false);
    pf.ensure(9, r2.as_ptr() as usize, r2.len()).unwrap();
    assert_eq!(not_resident(r2.as_ptr() as usize, r2.len()), 0);
    pf.settle();
    assert_eq!(pf.workers_running(), 0);
    drop(pf);
}

/// The plan is queued at the first `ensure`, ahead of the chunk that
/// `ensure` asks for when that chunk is not in the plan: with one worker
/// (slices taken in order) every planned chunk is resident when the first
/// `ensure` returns. A planned chunk that is empty or not page aligned is
/// skipped, never touched (its own `ensure` reports it).
#[test]
fn the_plan_runs_ahead_of_the_first_ensure_and_skips_what_it_cannot_fault() {
    use kvoffload::internal::pin::PlannedChunk;
    let c = 2 << 20;
    let (r, base) = fresh_at(6 * c);
    let mut plan: Vec<PlannedChunk> =
        (1..=3).map(|i| PlannedChunk { chunk: i, addr: base + i * c, len: c, lane: i }).collect();
    // Chunk 4 starts inside a page, chunk 5 is empty.
    plan.push(PlannedChunk { chunk: 4, addr: base + 4 * c + 64, len: c - 64, lane: 4 });
    plan.push(PlannedChunk { chunk: 5, addr: base + 5 * c, len: 0, lane: 5 });
    let pf = planned(1, PrefaultMode::Touch, plan);
    pf.ensure(0, base, c).unwrap();
    assert_eq!(not_resident(base, 4 * c), 0, "a planned chunk was not faulted ahead of chunk 0");
    assert_eq!(pf.stats().bytes, 4 * c as u64, "chunks 0 to 3, each once");
    assert_eq!(
        not_resident(base + 4 * c, 2 * c),
        2 * c / page_size(),
        "a misaligned or empty planned chunk was touched"
    );
    assert!(matches!(pf.ensure_typed(4, base + 4 * c + 64, c - 64), Err(PrefaultError::Misaligned { chunk: 4, .. })));
    pf.settle();
    drop(pf);
    drop(r);
}

/// Idle workers spread over a plan's lanes (its data files): a worker takes
/// the first slice whose lane no other worker runs. Two workers, chunks 0
/// and 1 on lane 0, 2 and 3 on lane 1: the first slice each worker starts
/// is on a lane of its own (the reservation hook holds the first worker's
/// slice until the second has started one, at most 30 s).
#[test]
fn idle_workers_take_slices_of_lanes_no_other_worker_runs() {
    use kvoffload::internal::pin::PlannedChunk;
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::{Duration, Instant};
    let c = 2 << 20;
    let (r, base) = fresh_at(4 * c);
    let plan: Vec<PlannedChunk> =
        (0..4).map(|i| PlannedChunk { chunk: i, addr: base + i * c, len: c, lane: i / 2 }).collect();
    let started = Arc::new((Mutex::new(Vec::<usize>::new()), Condvar::new()));
    let hook = {
        let started = started.clone();
        Box::new(move |addr: usize, _len: usize| {
            let (seen, cv) = &*started;
            let mut g = seen.lock().unwrap();
            g.push(addr);
            cv.notify_all();
            let deadline = Instant::now() + Duration::from_secs(30);
            while g.len() < 2 && Instant::now() < deadline {
                g = cv.wait_timeout(g, Duration::from_millis(100)).unwrap().0;
            }
            Ok(())
        })
    };
    // SAFETY: the region outlives the pre-faulter (settled and dropped first).
    let pf = unsafe { touching_two(plan, hook) };
    pf.ensure(0, base, c).unwrap();
    // Either worker may reach the hook first: the lanes, in order.
    let mut lanes: Vec<usize> = started.0.lock().unwrap()[..2].iter().map(|a| (a - base) / c / 2).collect();
    lanes.sort_unstable();
    assert_eq!(lanes, [0, 1], "the first slices the two workers started, by lane");
    for i in 1..4 {
        pf.ensure(i, base + i * c, c).unwrap();
    }
    assert_eq!(not_resident(base, r.len()), 0);
    pf.settle();
    drop(pf);
    drop(r);
}

/// Two threads ensure two chunks at once: each gets its own chunk's
/// outcome. Chunk 1's only slice is held in the reservation hook until
/// chunk 0's `ensure` has returned, then refused: its `ensure` must report
/// the refusal (the first `ensure` to return must not drop the other's job,
/// pending or finished).
#[test]
fn concurrent_ensures_each_get_their_own_outcome() {
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    let (p, r, base) = pages(2);
    let (entered_tx, entered) = mpsc::channel::<()>();
    let (go_tx, go) = mpsc::channel::<()>();
    let (entered_tx, go) = (Mutex::new(entered_tx), Mutex::new(go));
    let hook = Box::new(move |addr: usize, _len: usize| {
        if addr != base + p {
            return Ok(());
        }
        entered_tx.lock().unwrap().send(()).unwrap();
        // Bounded: a test that fails elsewhere lets the worker go.
        let _ = go.lock().unwrap().recv_timeout(Duration::from_secs(30));
        Err("refused by the test".to_string())
    });
    // SAFETY: the region outlives the pre-faulter (dropped first).
    let pf = Arc::new(unsafe { touching_two(Vec::new(), hook) });
    let second = {
        let pf = pf.clone();
        std::thread::spawn(move || pf.ensure_typed(1, base + p, p))
    };
    entered.recv_timeout(Duration::from_secs(30)).expect("chunk 1's slice never reached the hook");
    pf.ensure_typed(0, base, p).unwrap();
    go_tx.send(()).unwrap();
    let got = second.join().unwrap();
    assert!(matches!(got, Err(PrefaultError::Reserve { chunk: 1, .. })), "chunk 1's ensure returned {got:?}");
    assert_eq!(not_resident(base, p), 0);
    assert_eq!(not_resident(base + p, p), 1, "the refused slice was touched");
    pf.settle();
    drop(pf);
    drop(r);
}

/// A worker that panics outside the slice it faults (here in the
/// reservation hook, which runs before the slice's own panic guard) stops
/// the pool: the `ensure` waiting for that chunk returns an error naming
/// the panic instead of waiting for ever, a later `ensure` fails at once,
/// and settling (joining the workers) returns.
#[test]
fn a_worker_panic_outside_a_slice_fails_ensure_instead_of_hanging() {
    use std::sync::Arc;
    let (p, r, base) = pages(4);
    let hook: kvoffload::internal::pin::ReserveFn = Box::new(|_, _| panic!("reservation hook exploded (test)"));
    // SAFETY: the region outlives the pre-faulter: it is leaked below when
    // a call did not return (a worker might still reach it).
    let pf = Arc::new(unsafe { touching_two(Vec::new(), hook) });
    let (first, r) = returned(
        within_on(&pf, 10, move |pf| pf.ensure_typed(2, base, 2 * p)),
        r,
        "ensure still waits 10 s after a worker panicked",
    );
    match first {
        Err(PrefaultError::PoolBroken { chunk: 2, msg }) => {
            assert!(msg.contains("reservation hook exploded (test)"), "{msg}")
        }
        other => panic!("expected PoolBroken for chunk 2, got {other:?}"),
    }
    let later = within_on(&pf, 10, move |pf| pf.ensure_typed(3, base + 2 * p, 2 * p));
    assert!(matches!(later, Some(Err(PrefaultError::PoolBroken { chunk: 3, .. }))), "a later ensure: {later:?}");
    let r = settles_after_a_panic(&pf, r, "settle still waits 10 s after a worker panicked");
    assert_eq!(not_resident(base, 4 * p), 4, "a page was touched though its reservation panicked");
    drop(pf);
    drop(r);
}

#[test]
fn settle_drops_the_rest_of_a_plan() {
    use kvoffload::internal::pin::PlannedChunk;
    let (r, base) = fresh_at(64 << 20);
    let c = 4 << 20;
    let plan: Vec<PlannedChunk> =
        (0..16).map(|i| PlannedChunk { chunk: i, addr: base + i * c, len: c, lane: i }).collect();
    let pf = planned(1, PrefaultMode::Touch, plan);
    pf.ensure(0, base, c).unwrap();
    pf.settle();
    assert_eq!(pf.workers_running(), 0);
    assert!(pf.stats().bytes <= r.len() as u64);
    drop(pf);
    drop(r);
}

#[test]
fn slices_follow_the_huge_page_size_given() {
    // 16 MiB with 4 threads: 2 MiB huge pages give 4 slices of 4 MiB; a
    // region on hugetlbfs with (say) 8 MiB pages must give whole pages to
    // each worker: 2 slices. Without huge pages the page size rules.
    // Slices are cut at multiples of the page in addresses (a hugetlbfs
    // data area starts on one): use a window that starts on 8 MiB.
    let len = 16 << 20;
    for (huge, page, slices) in [(true, None, 4), (true, Some(8 << 20), 2), (false, Some(8 << 20), 4)] {
        let r = fresh(len + (8 << 20), huge);
        let addr = (r.as_ptr() as usize).next_multiple_of(8 << 20);
        let cfg = PrefaultConfig { threads: 4, mode: PrefaultMode::Populate, huge_pages: huge };
        // SAFETY: the region outlives the pre-faulter (dropped first).
        let pf = unsafe { Prefaulter::reserving(cfg, Vec::new(), None, page) };
        pf.ensure(0, addr, len).unwrap();
        assert_eq!(pf.stats().slices, slices, "huge {huge}, page {page:?}");
        assert_eq!(not_resident(addr, len), 0);
        drop(pf);
    }
}

#[test]
fn a_failed_reservation_skips_the_slice_untouched() {
    // The reservation hook refuses the second half: those pages are never
    // faulted, and the chunk fails with the hook's text.
    let r = fresh(8 << 20, false);
    let (addr, len) = (r.as_ptr() as usize, r.len());
    let half = addr + len / 2;
    let cfg = PrefaultConfig { threads: 2, mode: PrefaultMode::Populate, huge_pages: false };
    let hook: kvoffload::internal::pin::ReserveFn =
        Box::new(move |a, l| if a + l > half { Err("no space (test)".into()) } else { Ok(()) });
    // SAFETY: the region outlives the pre-faulter (dropped first).
    let pf = unsafe { Prefaulter::reserving(cfg, Vec::new(), Some(hook), None) };
    match pf.ensure_typed(3, addr, len) {
        Err(PrefaultError::Reserve { chunk: 3, msg, .. }) => assert_eq!(msg, "no space (test)"),
        other => panic!("expected Reserve, got {other:?}"),
    }
    // Only slices faulted are timed (the rates that judge the huge-page
    // fallback): a refused one took no time to fault.
    let st = pf.stats();
    let timed: u64 = st.slice_gbps.iter().sum();
    assert!(timed >= 1 && timed < st.slices, "{timed} of {} slices timed, one of them refused", st.slices);
    drop(pf);
    assert_eq!(not_resident(half, len / 2), len / 2 / page_size(), "a refused slice was touched");
    assert_eq!(not_resident(addr, len / 2), 0);
}

/// This process's virtual size in bytes (`/proc/self/statm`'s first field).
fn virtual_size() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().next().unwrap().parse::<u64>().unwrap() * page_size() as u64
}

/// The child of `a_chunk_is_faulted_on_the_callers_thread_when_no_worker_can_start`:
/// with the address-space limit just above what is mapped, no worker's
/// stack can be mapped, so no worker starts and `ensure` faults the chunk
/// itself.
fn no_worker_child() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let r = fresh(8 << 20, false);
    let (addr, len) = (r.as_ptr() as usize, r.len());
    let pf = prefaulter(2, PrefaultMode::Populate, false);
    let old = getrlimit(Resource::As);
    // 64 KiB of room: less than one worker's stack (256 KiB and a guard
    // page), enough for the few small allocations of the inline path.
    let room = virtual_size() + (64 << 10);
    setrlimit(Resource::As, Rlimit { current: Some(room), maximum: old.maximum }).unwrap();
    let res = pf.ensure(0, addr, len);
    let running = pf.workers_running();
    setrlimit(Resource::As, old).unwrap();
    res.unwrap();
    assert_eq!(running, 0, "a worker started under the limit: the case did not happen");
    assert_eq!(not_resident(addr, len), 0, "pages missing after ensure");
    assert_eq!(not_written(addr, len), 0, "pages not faulted for writing");
    assert_eq!(pf.stats().bytes, len as u64);
    println!("inline: ok");
}

/// No worker thread can be spawned (a real failure: the address space is
/// full): `ensure` still faults every page of the chunk, on the caller's
/// thread. Run in a child process, since the limit is the process's.
#[test]
fn a_chunk_is_faulted_on_the_callers_thread_when_no_worker_can_start() {
    if std::env::var_os("KVOFFLOAD_NO_WORKER_CHILD").is_some() {
        return no_worker_child();
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "a_chunk_is_faulted_on_the_callers_thread_when_no_worker_can_start",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KVOFFLOAD_NO_WORKER_CHILD", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("inline: ok"), "child failed:\n{text}");
}
