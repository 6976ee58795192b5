//! The pre-fault workers' niceness (`Prefaulter::with_nice`,
//! `PinOptions::prefault_nice`): a test binary of its own, so that no other
//! test's workers (named alike) are running while it reads them from /proc;
//! its tests take [`ONE_AT_A_TIME`] for the same reason (`cargo test` runs
//! them on threads of one process). Also the one binary whose log
//! subscriber panics on a worker's warning (a worker that panics before it
//! has placed itself).

mod pin_common;

use kvoffload::internal::pin::{Prefault, PrefaultConfig, Prefaulter};
use kvoffload::internal::region::AnonOptions;
use kvoffload::{page_size, Layout, PrefaultMode, Region};
use pin_common::{returned, settles_after_a_panic, within_on};

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn fresh(bytes: usize) -> Region {
    let l = Layout::new(1, page_size(), bytes / page_size()).unwrap();
    Region::anonymous(l, &AnonOptions::new()).unwrap()
}

/// The niceness (field 19 of /proc/<pid>/task/<tid>/stat) of every thread
/// of this process named `kvo-prefault-*`.
fn prefault_worker_nices() -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = e.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("kvo-prefault-") {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap();
        // After the ")" closing the name: state is field 3, nice field 19.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        out.push(rest.split_whitespace().nth(16).unwrap().parse().unwrap());
    }
    out
}

/// Every worker has placed itself once the first `ensure` returns, also
/// those that took no slice (one page, one slice, four workers): starting
/// the workers waits for each to place itself, so no reader (the caller
/// that reads the placement back, this test) sees a worker still at the
/// spawner's niceness. Repeated, since a worker left unwaited for usually
/// still wins the race to place itself before the caller reads.
#[test]
fn every_worker_is_placed_when_ensure_returns_even_without_a_slice() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let own = rustix::process::getpriority_process(None).unwrap();
    if own >= 19 {
        eprintln!(
            "SKIPPED every_worker_is_placed_when_ensure_returns_even_without_a_slice: the process runs at niceness 19"
        );
        return;
    }
    let want = (own + 5).min(19);
    let r = fresh(page_size());
    for round in 0..50 {
        // SAFETY: the region outlives the pre-faulter (dropped in this round).
        let pf =
            unsafe { Prefaulter::new(PrefaultConfig { threads: 4, mode: PrefaultMode::Populate, huge_pages: false }) }
                .with_nice(want);
        pf.ensure(0, r.as_ptr() as usize, r.len()).unwrap();
        assert_eq!(
            prefault_worker_nices(),
            vec![want; 4],
            "round {round}: a worker not yet placed when ensure returned"
        );
        drop(pf);
    }
}

#[test]
fn workers_raise_their_niceness_and_leave_the_callers_alone() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let own = rustix::process::getpriority_process(None).unwrap();
    if own >= 19 {
        // No niceness above the process's: a worker that never raised its
        // own would pass what follows.
        eprintln!("SKIPPED workers_raise_their_niceness_and_leave_the_callers_alone: the process runs at niceness 19");
        return;
    }
    let r = fresh(8 << 20);
    let want = (own + 7).min(19);
    // SAFETY: the region outlives the pre-faulter (dropped below first).
    let pf = unsafe { Prefaulter::new(PrefaultConfig { threads: 3, mode: PrefaultMode::Populate, huge_pages: false }) }
        .with_nice(want);
    pf.ensure(0, r.as_ptr() as usize, r.len()).unwrap();
    assert_eq!(prefault_worker_nices(), vec![want; 3], "every worker at niceness {want}");
    assert_eq!(rustix::process::getpriority_process(None).unwrap(), own, "the caller's priority is untouched");
    drop(pf);
    // Niceness 0: the workers keep the process's.
    // SAFETY: as above.
    let pf = unsafe { Prefaulter::new(PrefaultConfig { threads: 2, mode: PrefaultMode::Populate, huge_pages: false }) }
        .with_nice(0);
    pf.ensure(0, r.as_ptr() as usize, r.len()).unwrap();
    assert_eq!(prefault_worker_nices(), vec![own; 2]);
    drop(pf);
    // A niceness below the process's: never lowered (which would need
    // privileges a root test run has).
    if own > 0 {
        // SAFETY: as above.
        let pf =
            unsafe { Prefaulter::new(PrefaultConfig { threads: 2, mode: PrefaultMode::Populate, huge_pages: false }) }
                .with_nice(own - 1);
        pf.ensure(0, r.as_ptr() as usize, r.len()).unwrap();
        assert_eq!(prefault_worker_nices(), vec![own; 2], "no worker below the process's niceness {own}");
        drop(pf);
    }
    // Niceness 0 from a thread at a negative niceness: the workers (which
    // start at their creator's niceness) keep it, not raised to 0. Needs
    // CAP_SYS_NICE to set up.
    std::thread::scope(|s| {
        s.spawn(|| {
            let tid = rustix::thread::gettid();
            let low = own.min(0) - 3;
            if let Err(e) = rustix::process::setpriority_process(Some(tid), low) {
                eprintln!("SKIPPED the negative-niceness case: setpriority({low}) refused ({e}): needs CAP_SYS_NICE");
                return;
            }
            // SAFETY: as above.
            let pf = unsafe {
                Prefaulter::new(PrefaultConfig { threads: 2, mode: PrefaultMode::Populate, huge_pages: false })
            }
            .with_nice(0);
            pf.ensure(0, r.as_ptr() as usize, r.len()).unwrap();
            assert_eq!(prefault_worker_nices(), vec![low; 2], "workers keep their creator's niceness {low}");
            drop(pf);
        });
    });
}

/// Armed: [`PanickyWorkers`] panics on a warning a pre-fault worker logs.
static PANIC_ON_WORKER_WARNING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A log subscriber that panics, while [`PANIC_ON_WORKER_WARNING`] is set,
/// on a warning logged by a thread named `kvo-prefault-*`; ignores the rest.
struct PanickyWorkers;

impl tracing::Subscriber for PanickyWorkers {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        let worker = std::thread::current().name().is_some_and(|n| n.starts_with("kvo-prefault-"));
        if worker
            && *e.metadata().level() == tracing::Level::WARN
            && PANIC_ON_WORKER_WARNING.load(std::sync::atomic::Ordering::SeqCst)
        {
            panic!("the test's log subscriber panics on a pre-fault worker's warning");
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// A worker that panics before it has placed itself (its warning that the
/// CPU binding was refused panics in the log subscriber) must not leave
/// the first `ensure` waiting for it to place itself: the `ensure` returns
/// an error naming the panic, and settling returns.
#[test]
fn a_worker_that_panics_before_placing_itself_fails_ensure_instead_of_hanging() {
    use kvoffload::internal::pin::PrefaultError;
    use std::sync::atomic::Ordering::SeqCst;
    use std::sync::Arc;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| tracing::subscriber::set_global_default(PanickyWorkers).unwrap());
    let r = fresh(page_size());
    let (addr, len) = (r.as_ptr() as usize, r.len());
    // SAFETY: the region outlives the pre-faulter: it is leaked below when
    // a call did not return. A CPU no `cpu_set_t` holds: every worker's
    // binding is refused, and logged.
    let pf = Arc::new(
        unsafe { Prefaulter::new(PrefaultConfig { threads: 2, mode: PrefaultMode::Touch, huge_pages: false }) }
            .on_cpus(vec![1 << 20]),
    );
    PANIC_ON_WORKER_WARNING.store(true, SeqCst);
    let got = within_on(&pf, 10, move |pf| pf.ensure_typed(0, addr, len));
    PANIC_ON_WORKER_WARNING.store(false, SeqCst);
    let (got, r) = returned(got, r, "ensure still waits 10 s after its workers panicked before placing themselves");
    match got {
        Err(PrefaultError::PoolBroken { chunk: 0, msg }) => {
            assert!(msg.contains("the test's log subscriber panics"), "{msg}")
        }
        other => panic!("expected PoolBroken, got {other:?}"),
    }
    let r = settles_after_a_panic(&pf, r, "settle still waits 10 s after the workers panicked");
    drop(pf);
    drop(r);
}
