//! Shared by every model: runs a model under loom with an explicit
//! preemption bound (`--cfg loom`), or under shuttle's random scheduler for
//! a number of schedules (`--cfg shuttle`), and reports what was explored in
//! one machine-readable line that `ci/prove` turns into the proof table;
//! builds the usual fixture (a simulated GPU and a coordinator over a small
//! host region).

#![allow(dead_code)]

pub mod offloader;
pub mod pool;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use kvoffload::internal::pin::{NoPrefault, PinHandle};
use kvoffload::internal::protocol::{Coordinator, Variant};
use kvoffload::internal::sync::Arc;
use kvoffload::{
    shared, CaptureMode, CapturePolicy, CaptureWindow, DevicePtr, DriverResult, GpuRuntime, Graph, Request, SimRuntime,
    Stream,
};

/// What a model explores, stated next to the model and printed in the table.
pub struct Bounds {
    /// Property name as in docs/PROOFS.md ("P1", "N3", or a sim rule "S1").
    pub property: &'static str,
    /// Threads in the model, the simulated GPU's device thread included.
    pub threads: usize,
    /// Loom's preemption bound: the model's full bound, what the proof
    /// table's interleaving counts are of (`ci/prove --full`).
    pub preemptions: usize,
    /// `Some(k)`: the lower bound `ci/test` runs this model at, because its
    /// full bound does not fit ci/test's time on 2 cores (issue 29: the
    /// README's test command within 20 minutes). `ci/prove` runs it at `k`
    /// (it sets `KVO_PROVE_BOUND=ci`), `ci/prove --full` at `preemptions`.
    /// `None`: the full bound everywhere. A negative always runs at its
    /// own `preemptions` ([`negative`] ignores this).
    pub ci: Option<usize>,
}

impl Bounds {
    /// These bounds, run at `k` preemptions by `ci/test` and at
    /// `preemptions` by `ci/prove --full` ([`Bounds::ci`]).
    pub const fn ci_at(self, k: usize) -> Bounds {
        assert!(k < self.preemptions, "a model's ci/test bound is below its full bound");
        Bounds { ci: Some(k), ..self }
    }

    /// The bound this run explores: `ci` when `KVO_PROVE_BOUND=ci` is set
    /// (`ci/prove` without `--full`), else `preemptions`.
    fn in_this_run(&self) -> usize {
        match (std::env::var("KVO_PROVE_BOUND").as_deref(), self.ci) {
            (Ok("ci"), Some(k)) => k,
            (Ok("ci" | "full") | Err(_), _) => self.preemptions,
            (Ok(other), _) => panic!("KVO_PROVE_BOUND={other}: `ci` or `full`"),
        }
    }
}

static ITER: AtomicUsize = AtomicUsize::new(0);

/// The prefix of the machine-readable lines (`LOOM-REPORT`, `SHUTTLE-REPORT`,
/// ...): which checker ran the model, so ci/prove reads each build's own.
#[cfg(loom)]
pub const MARK: &str = "LOOM";
#[cfg(shuttle)]
pub const MARK: &str = "SHUTTLE";

/// A scenario's size: `loom` in loom builds (the size the proof table's
/// interleaving counts are of: never change it without re-running
/// ci/prove), `shuttle` in shuttle builds, which run the same scenario past
/// what loom can explore (docs/PROOFS.md, "Past loom's bound").
pub const fn sized(loom: usize, shuttle: usize) -> usize {
    if cfg!(shuttle) {
        shuttle
    } else {
        loom
    }
}

/// Runs `f` in every interleaving loom explores under `b`, then prints
/// `LOOM-REPORT model=.. property=.. threads=.. preemptions=.. full=.. ci=.. iterations=.. seconds=..`
/// (`preemptions`: the bound explored; `full`: the model's full bound;
/// `ci`: its [`Bounds::ci`] bound, `-` if none).
///
/// `KVO_PREEMPTIONS_MAX=k` in the environment lowers the bound to at most
/// `k` (the report says the bound used). Only `ci/mutants` sets it, for its
/// screening round: a failure found under a lower bound is a real failing
/// interleaving, and what passes the screen is run again at the model's own
/// bound. `ci/prove` never sets it (and refuses to run when it is set).
#[cfg(loom)]
pub fn check<F>(name: &str, mut b: Bounds, f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    let (full, ci) = (b.preemptions, b.ci.map_or_else(|| "-".to_string(), |k| k.to_string()));
    b.preemptions = b.in_this_run();
    if let Some(max) = std::env::var("KVO_PREEMPTIONS_MAX").ok().and_then(|v| v.parse::<usize>().ok()) {
        b.preemptions = b.preemptions.min(max);
    }
    ITER.store(0, Ordering::SeqCst);
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(b.preemptions);
    builder.max_threads = b.threads.max(2);
    let t = Instant::now();
    builder.check(move || {
        ITER.fetch_add(1, Ordering::Relaxed);
        f()
    });
    println!(
        "LOOM-REPORT model={name} property={} threads={} preemptions={} full={full} ci={ci} iterations={} seconds={:.2}",
        b.property,
        b.threads,
        b.preemptions,
        ITER.load(Ordering::SeqCst),
        t.elapsed().as_secs_f64()
    );
}

/// Schedules a shuttle run tries when `KVO_SHUTTLE_ITERATIONS` is not set.
#[cfg(shuttle)]
pub const SHUTTLE_DEFAULT_SCHEDULES: usize = 50;

/// The most threads one schedule had (the model's main thread included), and
/// the most scheduling steps one took, over the schedules of a shuttle run.
#[cfg(shuttle)]
static THREADS: AtomicUsize = AtomicUsize::new(0);
#[cfg(shuttle)]
static STEPS: AtomicUsize = AtomicUsize::new(0);

/// Runs `f` under shuttle's random scheduler, then prints
/// `SHUTTLE-REPORT model=.. property=.. threads=.. steps=.. schedules=.. seed=.. seconds=..`
/// (`threads`: the most one schedule had, counted; `steps`: the most
/// scheduling decisions one took). `b`'s preemption bound is loom's and
/// means nothing here: each schedule picks a random runnable thread at every
/// scheduling point (lock, atomic, condition variable, spawn, join, yield),
/// with no bound on preemptions.
///
/// - `KVO_SHUTTLE_ITERATIONS=n`: the schedules to try (default
///   [`SHUTTLE_DEFAULT_SCHEDULES`]); ci/prove sets it (quick pass, `--full`).
/// - `KVO_SHUTTLE_SEED=s`: the seed of the run's random scheduler (default:
///   a fresh one, printed on a `SHUTTLE-START` line before the first
///   schedule, so a run is reproducible: the same seed tries the same
///   schedules).
/// - `KVO_SHUTTLE_PCT=d`: after the random schedules, as many of shuttle's
///   PCT scheduler (probabilistic concurrency testing: `d` random priority
///   changes a schedule), seeded alike; it finds bugs of few preemptions
///   that uniformly random schedules rarely hit (N13: caught within 6 PCT
///   schedules, not in 50000 random ones). ci/prove sets `d` = 3.
/// - `KVO_SHUTTLE_REPLAY=<schedule>`: replays one schedule instead, as
///   shuttle printed it after a failure ("failing schedule: .."), or the path
///   of a file holding it (ci/prove saves each failing schedule to one).
#[cfg(shuttle)]
pub fn check<F>(name: &str, b: Bounds, f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    use shuttle::scheduler::{PctScheduler, RandomScheduler, ReplayScheduler};
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let schedules = env("KVO_SHUTTLE_ITERATIONS").map_or(SHUTTLE_DEFAULT_SCHEDULES, |v| {
        v.trim().parse().expect("KVO_SHUTTLE_ITERATIONS: a number of schedules")
    });
    let seed = env("KVO_SHUTTLE_SEED").map_or_else(fresh_seed, |v| v.trim().parse().expect("KVO_SHUTTLE_SEED: a u64"));
    ITER.store(0, Ordering::SeqCst);
    THREADS.store(0, Ordering::SeqCst);
    STEPS.store(0, Ordering::SeqCst);
    let body = move || {
        ITER.fetch_add(1, Ordering::Relaxed);
        f();
        // Task ids count up from the main thread's 0: a thread spawned now
        // gets the number of threads this schedule had.
        let probe = shuttle::thread::spawn(shuttle::current::get_current_task).join().unwrap();
        THREADS.fetch_max(probe.map_or(0, usize::from), Ordering::Relaxed);
        STEPS.fetch_max(shuttle::current::context_switches(), Ordering::Relaxed);
    };
    let mut config = shuttle::Config::new();
    // The library's frames (tracing, the sim's tables) need more than
    // shuttle's 60 KiB default.
    config.stack_size = 1 << 20;
    config.silence_warnings = true;
    // Stop at the first panic: the schedule printed then is the whole of
    // what a replay needs (scheduling on while the panicking thread unwinds
    // would take steps the printed schedule lacks). Not in a model that
    // catches a panic of its own ([`catches_its_own_panics`]): its unwinding
    // passes scheduling points (a guard's release), which would stop it.
    config.ungraceful_shutdown_config.immediately_return_on_panic = !CATCHES_PANICS.load(Ordering::SeqCst);
    let t = Instant::now();
    let replay = env("KVO_SHUTTLE_REPLAY");
    let pct: Option<usize> = env("KVO_SHUTTLE_PCT").map(|d| d.trim().parse().expect("KVO_SHUTTLE_PCT: a bug depth"));
    let body = std::sync::Arc::new(body);
    let run = |sched: Box<dyn shuttle::scheduler::Scheduler + Send>| {
        let body = body.clone();
        shuttle::Runner::new(sched, config.clone()).run(move || body())
    };
    let ran = if let Some(r) = &replay {
        println!("SHUTTLE-START model={name} replay=1");
        let sched = if std::path::Path::new(r.trim()).is_file() {
            ReplayScheduler::new_from_file(r.trim()).expect("KVO_SHUTTLE_REPLAY: a readable schedule file")
        } else {
            ReplayScheduler::new_from_encoded(r.trim())
        };
        run(Box::new(sched))
    } else {
        println!("SHUTTLE-START model={name} seed={seed} schedules={schedules} scheduler=random");
        let mut ran = run(Box::new(RandomScheduler::new_from_seed(seed, schedules)));
        if let Some(depth) = pct {
            println!("SHUTTLE-START model={name} seed={seed} schedules={schedules} scheduler=pct{depth}");
            ran += run(Box::new(PctScheduler::new_from_seed(seed, depth, schedules)));
        }
        ran
    };
    println!(
        "SHUTTLE-REPORT model={name} property={} threads={} steps={} schedules={ran} seed={} seconds={:.2}",
        b.property,
        THREADS.load(Ordering::SeqCst),
        STEPS.load(Ordering::SeqCst),
        if replay.is_some() { "replay".to_string() } else { seed.to_string() },
        t.elapsed().as_secs_f64()
    );
}

/// A seed for a shuttle run nobody gave one: std's per-process hash keys
/// (random), folded with the time.
#[cfg(shuttle)]
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// Set by [`catches_its_own_panics`].
static CATCHES_PANICS: AtomicBool = AtomicBool::new(false);

/// Says that the model about to run catches a panic of its own (raised with
/// `std::panic::resume_unwind`, which runs no panic hook, so a negative's
/// hook does not take it for the failure) whose unwinding passes
/// scheduling points: under shuttle a schedule then goes on while a
/// thread unwinds, instead of stopping at the first panic (a failure's
/// printed schedule may then lack the steps after it: replay it with the
/// model's seed, `KVO_SHUTTLE_SEED`). Nothing under loom, which lets an
/// execution go on through a caught panic.
pub fn catches_its_own_panics() {
    CATCHES_PANICS.store(true, Ordering::SeqCst);
}

/// Set by the first panic of a negative model; later panics (while
/// unwinding, or loom's own after the model's) are not the reason.
static FAILED: AtomicBool = AtomicBool::new(false);

/// `s` on one line: backslash, newline, carriage return and tab escaped as
/// `\\`, `\n`, `\r`, `\t` (ci/prove undoes this).
pub fn one_line(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out
}

/// The message a panic was raised with: `panic!("literal")` carries a
/// `&str`, a formatted panic (assertions, loom's "deadlock; threads = ..")
/// a `String`.
fn payload_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<panic payload is not a string>".to_string()
    }
}

/// A negative model: the production code with one known-bad `variant`.
/// Declares the failure it must end in (`reason`, a substring of loom's or
/// the assertion's message; several, separated by ` || `, when the bug can
/// show in more than one way) on a
/// `LOOM-EXPECT model=.. property=.. threads=.. preemptions=.. reason=..`
/// line. The first panic, whichever thread raises it (an assertion in the
/// model, in a model thread, or loom's own: "deadlock; threads = ..",
/// "Model exceeded maximum number of branches", a leak), is recorded from
/// the panic hook as
/// `LOOM-CAUGHT iterations=..` and
/// `LOOM-FAILED at=<file:line:col> reason=<the panic message>`,
/// printed before anything else can abort the process (a loom deadlock
/// may). Both reasons are printed last on their line, escaped onto it
/// with [`one_line`]. ci/prove runs each negative in a child process and
/// requires the declared reason in the recorded one, the LOOM-FAILED line.
pub fn negative<F>(name: &str, mut b: Bounds, reason: &str, f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    // A negative's catch is stated at its own bound, in every run.
    b.ci = None;
    // Shuttle says loom's two failures of its own in its words.
    #[cfg(shuttle)]
    let reason = match reason {
        "deadlock; threads" => "deadlock!",
        "Model exceeded maximum number of branches" => "exceeded max_steps bound",
        r => r,
    };
    println!(
        "{MARK}-EXPECT model={name} property={} threads={} preemptions={} reason={}",
        b.property,
        b.threads,
        b.preemptions,
        one_line(reason)
    );
    FAILED.store(false, Ordering::SeqCst);
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !FAILED.swap(true, Ordering::SeqCst) {
            let at = info
                .location()
                .map_or_else(|| "?".to_string(), |l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
            println!("{MARK}-CAUGHT iterations={}", ITER.load(Ordering::SeqCst));
            println!("{MARK}-FAILED at={} reason={}", at.replace(' ', "%20"), one_line(&payload_text(info.payload())));
        }
        prev(info);
    }));
    check(name, b, f);
}

/// Declares a model file's tests, one entry a test, in the form of the call
/// it makes:
///
/// ```ignore
/// models! {
///     p4_shutdown_drains_jobs_before_unmap:
///         check("p4_with_job", B, || with_job(Variant::Production));
///     negative_n2_unregister_before_draining_transfers:
///         negative("n2_no_drain", N2, "after the region was unmapped", || with_job(Variant::NoDrainBeforeUnregister));
/// }
/// ```
///
/// `name: check(..);` is a positive model, `#[test] fn name() { check(..) }`;
/// `name: negative(..);` a negative one, also `#[ignore]`d: ci/prove runs
/// it in a child process of its own and it must fail for its reason (its
/// name starts with `negative_`, as ci/prove tells the two apart by it).
/// Doc comments and attributes before an entry go to its test.
#[allow(unused_macros)] // not by ci/prove's self-test, whose negative is another kind
macro_rules! models {
    () => {};
    ($(#[$meta:meta])* $test:ident: check($($arg:tt)*); $($rest:tt)*) => {
        $(#[$meta])*
        #[test]
        fn $test() {
            $crate::common::check($($arg)*)
        }
        $crate::common::models!($($rest)*);
    };
    ($(#[$meta:meta])* $test:ident: negative($($arg:tt)*); $($rest:tt)*) => {
        $(#[$meta])*
        #[test]
        #[ignore = "negative model: run by ci/prove, must fail"]
        fn $test() {
            $crate::common::negative($($arg)*)
        }
        $crate::common::models!($($rest)*);
    };
}
#[allow(unused_imports)]
pub(crate) use models;

/// A simulated GPU and a coordinator over `chunks` chunks of `chunk` bytes
/// of leaked (so `'static`) host memory.
pub struct Fixture {
    pub rt: Arc<dyn GpuRuntime>,
    pub coord: Arc<Coordinator>,
    pub base: usize,
    pub chunk: usize,
}

impl Fixture {
    /// The simulated GPU behind `rt`.
    pub fn sim(&self) -> &SimRuntime {
        self.rt.as_sim().expect("fixture runs on the simulated GPU")
    }
}

pub fn fixture(policy: CapturePolicy, variant: Variant, chunks: usize, chunk: usize) -> Fixture {
    fixture_on(SimRuntime::new(), policy, variant, chunks, chunk)
}

/// [`fixture`] on the simulated GPU `sim` (one made with more device
/// workers, say).
pub fn fixture_on(sim: SimRuntime, policy: CapturePolicy, variant: Variant, chunks: usize, chunk: usize) -> Fixture {
    let mem: &'static mut [u8] = Box::leak(vec![0u8; chunks * chunk].into_boxed_slice());
    let base = mem.as_mut_ptr() as usize;
    let ranges: Vec<(usize, usize)> = (0..chunks).map(|i| (base + i * chunk, chunk)).collect();
    let rt = shared(sim);
    // SAFETY: the chunks are pieces of `mem`, leaked read-write memory that
    // lives (mapped) forever: no keep-alive needed.
    let coord = unsafe { Coordinator::new(rt.as_ref(), policy, &ranges, None) }.unwrap();
    coord.set_variant(variant);
    Fixture { rt, coord, base, chunk }
}

/// What [`engine_with_compute`] builds: the engine, its KV tensor on the
/// device, and the compute stream its jobs are ordered after.
pub type EngineParts = (kvoffload::internal::transfer::TransferEngine, DevicePtr, Stream);

/// A transfer engine over the fixture: one KV group with one tensor of
/// `gpu_blocks` GPU blocks of `page` bytes, host blocks filling the
/// fixture's region (one page each), on a compute stream of its own.
pub fn engine(
    f: &Fixture,
    chunks: usize,
    page: usize,
    gpu_blocks: usize,
    backend: kvoffload::BackendChoice,
) -> (kvoffload::internal::transfer::TransferEngine, DevicePtr) {
    let (e, dev, _) = engine_with_compute(f, chunks, page, gpu_blocks, backend);
    (e, dev)
}

/// [`engine`], also returning the compute stream its jobs are ordered
/// after (the stream the engine thread of a model captures).
pub fn engine_with_compute(
    f: &Fixture,
    chunks: usize,
    page: usize,
    gpu_blocks: usize,
    backend: kvoffload::BackendChoice,
) -> EngineParts {
    // Gather tables staged on the heap, not in the page-locked ring: the
    // ring's allocation and free (two more driver calls, the free waiting
    // for the device) made P5's model take 435 s instead of about 32 s. Both
    // go through `Coordinator::unsafe_call` like the device table's, and
    // the ring itself is tested on the simulated GPU (tests/transfer_sim.rs).
    // Likewise no device staging buffers: the staged backend's two streams
    // are model-checked by model/p5_staged_order.rs, which asks for them.
    let opts = kvoffload::TransferOptions { backend, staging_ring_entries: 0, staging_bytes: 0, ..Default::default() };
    engine_with_options(f, chunks, page, gpu_blocks, opts)
}

/// [`engine_with_compute`] with the engine's options given.
pub fn engine_with_options(
    f: &Fixture,
    chunks: usize,
    page: usize,
    gpu_blocks: usize,
    opts: kvoffload::TransferOptions,
) -> EngineParts {
    use kvoffload::internal::transfer::TransferEngine;
    use kvoffload::{GroupSpec, HostPlacement, KvLayout, TensorSpec};
    // On the main thread, before the model's threads start.
    let dev = f
        .coord
        .unsafe_call("allocating the model's KV tensor", Request::new(), |g| f.rt.mem_alloc(g, gpu_blocks * page));
    let dev = dev.unwrap().unwrap();
    let compute = f.rt.stream_create().unwrap();
    let group = GroupSpec {
        tensors: vec![TensorSpec { device_base: dev, page_bytes: page }],
        num_gpu_blocks: gpu_blocks,
        num_host_blocks: chunks * f.chunk / page,
    };
    let layout = KvLayout::new(&[group], 1, f.base, HostPlacement::TensorMajor).unwrap();
    // SAFETY: the fixture's host memory is leaked (lives forever) and is
    // touched below only by the engine's jobs or after they completed; the
    // device tensor is a live allocation of the fixture's runtime.
    let e = unsafe { TransferEngine::new(f.rt.clone(), f.coord.clone(), layout, compute, opts) }.unwrap();
    (e, dev, compute)
}

/// Rank `rank`'s engine process of a multi-rank model: its runtime handle
/// on the simulated GPU of `rt` (rank 0 `rt` itself, another rank a handle
/// of its own on the one device, and so a coordinator of its own) and its
/// coordinator (policy AfterPinning) over `chunks` chunks of 64 bytes of
/// leaked host memory.
pub fn rank_coordinator(
    rt: &Arc<dyn GpuRuntime>,
    rank: usize,
    chunks: usize,
) -> (Arc<dyn GpuRuntime>, Arc<Coordinator>) {
    let mem: &'static mut [u8] = Box::leak(vec![0u8; chunks * 64].into_boxed_slice());
    let base = mem.as_mut_ptr() as usize;
    let ranges: Vec<(usize, usize)> = (0..chunks).map(|i| (base + i * 64, 64)).collect();
    let rt = if rank == 0 { rt.clone() } else { shared(rt.as_sim().unwrap().another_handle()) };
    // SAFETY: the chunks are pieces of `mem`, leaked read-write memory that
    // lives (mapped) forever.
    let coord = unsafe { Coordinator::new(rt.as_ref(), CapturePolicy::AfterPinning, &ranges, None) }.unwrap();
    (rt, coord)
}

/// A capture of a memset on `s` in `mode`: begins it (which must succeed),
/// enqueues `bytes` bytes of `value` at `d`, ends it; returns what the
/// enqueue and the end returned (an invalidated capture ends with an error).
/// The caller holds whatever window the capture needs around this call.
///
/// # Safety
///
/// `d` is an allocation of `rt`'s device of at least `bytes` bytes that
/// nothing frees while the graph lives (the memset is only captured).
pub unsafe fn capture_memset(
    rt: &dyn GpuRuntime,
    s: Stream,
    mode: CaptureMode,
    d: DevicePtr,
    value: u8,
    bytes: usize,
) -> (DriverResult<()>, DriverResult<Graph>) {
    rt.begin_capture(s, mode).unwrap();
    // SAFETY: the caller's promise on `d`.
    let enq = unsafe { rt.memset_d8_async(d, value, bytes, s) };
    (enq, rt.end_capture(s))
}

/// What P2's capture models start from: a [`fixture`] of `policy` (3
/// chunks of 64 bytes), the engine's stream and a 64-byte allocation of the
/// sim (made through the coordinator), and the pinner spawned.
pub fn pinning_under(policy: CapturePolicy) -> (Fixture, Arc<dyn GpuRuntime>, Stream, DevicePtr, PinHandle) {
    let f = fixture(policy, Variant::Production, 3, 64);
    let rt = f.rt.clone();
    let s = rt.stream_create().unwrap();
    let d = f.coord.unsafe_call("alloc", Request::new(), |g| rt.mem_alloc(g, 64)).unwrap().unwrap();
    let pin = PinHandle::spawn(rt.clone(), f.coord.clone(), NoPrefault::shared());
    (f, rt, s, d, pin)
}

/// A [`fixture`] under the Interleave policy over `chunks` chunks of 64
/// bytes, with the pinner spawned: the fixture and the pinner's handle.
pub fn pinning_interleaved(variant: Variant, chunks: usize) -> (Fixture, PinHandle) {
    let f = fixture(CapturePolicy::Interleave, variant, chunks, 64);
    let pin = PinHandle::spawn(f.rt.clone(), f.coord.clone(), NoPrefault::shared());
    (f, pin)
}

/// Opens the window `req` asks for, noting the registrations the simulated
/// GPU completed when the window asked to open (under the coordinator's
/// lock, by the hook of `Request::noting`) and when it opened: the window,
/// then the two counts.
pub fn window_counting_registrations(f: &Fixture, req: Request<'_>) -> (CaptureWindow, u64, u64) {
    let at_request = std::cell::Cell::new(None);
    let note = || at_request.set(Some(f.sim().registrations_completed()));
    let w = f.coord.open_window(req.noting(&note)).unwrap();
    let at_request = at_request.get().expect("the window asked to open");
    let at_open = f.sim().registrations_completed();
    (w, at_request, at_open)
}

/// The window (`window` names it) that asked to open when `at_request`
/// registrations had completed and opened at `at_open` waited for at most
/// one of them.
#[track_caller]
pub fn waited_at_most_one(window: &str, at_request: u64, at_open: u64) {
    assert!(
        at_open - at_request <= 1,
        "{window} waited for {} registrations (counted by the simulated GPU)",
        at_open - at_request
    );
}

/// The fixture's host memory as bytes.
pub fn host(f: &Fixture, len: usize) -> &'static mut [u8] {
    // SAFETY: leaked memory of at least `len` bytes owned by the model;
    // callers access it only while no job touching it is in flight.
    unsafe { std::slice::from_raw_parts_mut(f.base as *mut u8, len) }
}

/// A flag one model thread sets and others wait for (a blocking wait: one
/// that never ends is loom's deadlock, not a spin).
#[derive(Default)]
pub struct Flag {
    set: kvoffload::internal::sync::Mutex<bool>,
    cv: kvoffload::internal::sync::Condvar,
}

impl Flag {
    pub fn set(&self) {
        *kvoffload::internal::sync::lock(&self.set) = true;
        self.cv.notify_all();
    }

    pub fn wait(&self) {
        let mut g = kvoffload::internal::sync::lock(&self.set);
        while !*g {
            g = kvoffload::internal::sync::wait(&self.cv, g);
        }
    }
}
