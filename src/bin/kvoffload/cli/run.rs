//! `kvoffload run`: the main job. The parent process spawns one process per
//! rank (this binary again, with hidden `--as-rank`), reads their marker
//! lines (progress bars on stderr; phase lines on stdout when stderr is not
//! a terminal), kills a rank where a fault test asks, and prints the
//! summary. Library part: `crate::run`.
//!
//! Lifecycle: the ranks die with the parent (`PR_SET_PDEATHSIG`, see
//! `crate::run::lifecycle`). When a rank fails (a `KVO-ERROR` line) the
//! others are killed at once: they would only wait for it. On SIGINT or
//! SIGTERM the parent forwards SIGTERM to the ranks, which stop issuing
//! work, drain it, shut their offloaders down and report; it waits for them
//! up to [`STOP_GRACE`] (then SIGKILL; a second signal kills at once),
//! prints the summary it has and removes the region file if one is left.
//!
//! Exit status: 0 when every rank that was not killed on request finished
//! with every loaded block verified, none corrupted, none lost, and no
//! region file left; 1 when a block was corrupted or lost, a rank failed or
//! died unexpectedly, or the region file remained; 2 for bad options or an
//! unusable environment; 128 + the signal's number when SIGINT or SIGTERM
//! stopped the run.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, Pid, Signal};
use signal_hook::consts::{SIGINT, SIGTERM};

use crate::run::metrics::{Intervals, Latencies, Throughput};
use crate::run::report::{self, field, RankReport};
use crate::run::{lifecycle, run_rank, KillAt, RunConfig};
use clap::ValueEnum;
use kvoffload::internal::region::{pages, shm_path};
use kvoffload::internal::runtime::cuda::CudaRuntime;
use kvoffload::internal::sync::{self, thread, Arc, Condvar, Mutex};
use kvoffload::units::{fmt_bytes, parse_size};

use super::backend::{self, BackendArg};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum KillAtArg {
    /// In the middle of pinning (the rank stops before its middle chunk).
    Pinning,
    /// In the middle of the workload, with jobs in flight.
    Transfers,
}

impl From<KillAtArg> for KillAt {
    fn from(k: KillAtArg) -> Self {
        match k {
            KillAtArg::Pinning => KillAt::Pinning,
            KillAtArg::Transfers => KillAt::Transfers,
        }
    }
}

/// Where `kvoffload run` puts its ranks.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum RankGpus {
    /// Rank r on GPU r mod the number of visible GPUs.
    Spread,
    /// Every rank on GPU 0.
    Same,
}

/// Options of `kvoffload run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// GPU runtime: the real GPU when a driver is present, the simulated GPU otherwise.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Rank processes sharing the region.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Shared host region (all ranks together), rounded down to whole rows.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    region: usize,
    /// KV tensors (layers) per rank.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Bytes of one GPU block of one layer.
    #[arg(long, default_value = "16KiB", value_parser = parse_size)]
    page_bytes: usize,
    /// GPU blocks per host block.
    #[arg(long, default_value_t = 1)]
    block_factor: usize,
    /// GPU blocks per KV tensor.
    #[arg(long, default_value_t = 256)]
    gpu_blocks: usize,
    /// Requests per rank (each loads its leading hits and stores its misses).
    #[arg(long, default_value_t = 2000)]
    jobs: usize,
    /// Consecutive keys (host blocks) per request.
    #[arg(long, default_value_t = 4)]
    blocks_per_job: usize,
    /// Distinct keys per rank.
    #[arg(long, default_value_t = 2048)]
    keys: usize,
    /// Zipf exponent of the key choice (0 = uniform).
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Blocks stored first, keys 0.. in order (stores alone), before the Zipf requests; at most --keys.
    #[arg(long, default_value_t = 0)]
    prefill_blocks: usize,
    /// Transfer jobs in flight per rank, at most (loads being verified do not count; the GPU blocks they hold bound them).
    #[arg(long, default_value_t = 8)]
    inflight: usize,
    /// Graphs each rank captures through capture windows.
    #[arg(long, default_value_t = 8)]
    graphs: usize,
    /// Each rank's own start-up work (a compute loop) while pinning runs, in ms.
    #[arg(long, default_value_t = 300)]
    startup_ms: u64,
    /// Pre-fault threads per rank [default: every core].
    #[arg(long)]
    pin_threads: Option<usize>,
    /// Bound of one registration call [default: an eighth of the region, at most the library default, 256MiB].
    #[arg(long, value_parser = parse_size)]
    pin_chunk: Option<usize>,
    /// Huge-page advice for the shared region: auto (library default: none
    /// for /dev/shm), on (madvise MADV_HUGEPAGE; effective where
    /// /sys/kernel/mm/transparent_hugepage/shmem_enabled allows), off.
    #[arg(long, value_enum, default_value_t = HugeArg::Auto)]
    pin_huge_pages: HugeArg,
    /// Directory of the region file. /dev/shm usually has 4 KiB pages (no
    /// huge= mount option), which limit pinning to a few GB/s; a tmpfs
    /// mounted with huge=always (mount -t tmpfs -o huge=always,size=... none DIR)
    /// gives 2 MiB pages.
    #[arg(long, default_value = "/dev/shm")]
    region_dir: std::path::PathBuf,
    /// Seed of the key choice (rank r uses seed + r).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How long ranks wait for each other (joining, agreeing), in seconds.
    #[arg(long, default_value_t = 120)]
    rank_timeout_s: u64,
    /// Fault test: SIGKILL this rank ...
    #[arg(long)]
    kill_rank: Option<usize>,
    /// ... at this point (the rank stops there and announces it; the parent kills it).
    #[arg(long, value_enum, default_value_t = KillAtArg::Transfers)]
    kill_at: KillAtArg,
    /// Simulated GPU: about every K-th async copy fails (the failed jobs are reported).
    #[arg(long)]
    fault_copy_every: Option<u64>,
    /// Simulated GPU: the K-th registration call fails with 801 (the rank falls back to pageable; P7 makes all do).
    #[arg(long)]
    fault_register_at: Option<u64>,
    /// Only this rank gets the injected faults [default: every rank].
    #[arg(long)]
    fault_rank: Option<usize>,
    #[arg(long, hide = true)]
    as_rank: Option<usize>,
    #[arg(long, hide = true)]
    region_name: Option<String>,
    #[arg(long, hide = true, value_enum)]
    rank_backend: Option<BackendArg>,
    #[arg(long, hide = true)]
    rank_device: Option<usize>,
    /// Which GPU each rank uses: spread (rank r on GPU r mod the number of
    /// visible GPUs, as a tensor-parallel engine places its ranks) or same
    /// (every rank on GPU 0, sharing its PCIe link and time-slicing it).
    #[arg(long, value_enum, default_value_t = RankGpus::Spread)]
    rank_gpus: RankGpus,
    #[arg(long, hide = true, value_enum)]
    pause_at: Option<KillAtArg>,
    /// The parent's pid, for a rank to check it was not orphaned at birth.
    #[arg(long, hide = true)]
    parent_pid: Option<u32>,
}

/// How long the parent waits for its ranks after forwarding SIGTERM to
/// them, before it SIGKILLs those left.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

fn signal_name(sig: i32) -> &'static str {
    match sig {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

impl Args {
    fn config(&self) -> RunConfig {
        RunConfig {
            ranks: self.ranks,
            region_bytes: self.region,
            layers: self.layers,
            page_bytes: self.page_bytes,
            block_factor: self.block_factor,
            gpu_blocks: self.gpu_blocks,
            jobs: self.jobs,
            blocks_per_job: self.blocks_per_job,
            keys: self.keys,
            zipf: self.zipf,
            inflight: self.inflight,
            prefill_blocks: self.prefill_blocks,
            graphs: self.graphs,
            graph_nodes: 16,
            startup: Duration::from_millis(self.startup_ms),
            pin_threads: self.pin_threads,
            pin_chunk: self.pin_chunk,
            pin_huge_pages: match self.pin_huge_pages {
                HugeArg::Auto => kvoffload::internal::pin::HugePages::Auto,
                HugeArg::On => kvoffload::internal::pin::HugePages::On,
                HugeArg::Off => kvoffload::internal::pin::HugePages::Off,
            },
            region_dir: self.region_dir.clone(),
            seed: self.seed,
            rank_timeout: Duration::from_secs(self.rank_timeout_s),
            kill_rank: self.kill_rank,
            kill_at: self.kill_at.into(),
            fault_copy_every: self.fault_copy_every,
            fault_register_at: self.fault_register_at,
            fault_rank: self.fault_rank,
        }
    }
}

pub fn run(a: Args, verbose: u8) -> Result<i32, String> {
    let cfg = a.config();
    if let Some(rank) = a.as_rank {
        return run_as_rank(&a, &cfg, rank);
    }
    let d = cfg.validate().map_err(|e| e.to_string())?;
    let (backend, why) = match a.backend {
        BackendArg::Sim => (BackendArg::Sim, "asked for"),
        BackendArg::Cuda => (BackendArg::Cuda, "asked for"),
        BackendArg::Auto if CudaRuntime::driver_present() => (BackendArg::Cuda, "auto: a CUDA driver is present"),
        BackendArg::Auto => (BackendArg::Sim, "auto: no CUDA driver found"),
    };
    if backend == BackendArg::Cuda && (cfg.fault_copy_every.is_some() || cfg.fault_register_at.is_some()) {
        return Err("--fault-copy-every and --fault-register-at need the simulated GPU (--backend sim)".into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable to start ranks: {e}"))?;
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let name = format!("run-{}-{nonce}", std::process::id());
    if !cfg.region_dir.is_dir() {
        return Err(format!("--region-dir {}: not a directory", cfg.region_dir.display()));
    }
    let path = shm_path(&cfg.region_dir, &name).map_err(|e| e.to_string())?;
    let bname = if backend == BackendArg::Cuda { "cuda" } else { "sim" };
    let devices: Vec<usize> = match (backend, a.rank_gpus) {
        (BackendArg::Cuda, RankGpus::Spread) => {
            let n = CudaRuntime::device_count().map_err(|e| e.to_string())?.max(1);
            (0..cfg.ranks).map(|r| r % n).collect()
        }
        _ => vec![0; cfg.ranks],
    };
    let gpus_line = if backend != BackendArg::Cuda {
        "the simulated GPU".to_string()
    } else if devices.iter().all(|&d| d == 0) {
        "GPU 0 (shared: the ranks time-slice it and its PCIe link)".to_string()
    } else {
        format!("GPUs {}", devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","))
    };
    println!(
        "kvoffload run: {} ranks on {bname} ({why}); region {} ({} host blocks of {} per rank, {} pages of {} x {} layers); \
         {} requests per rank of {} blocks over {} keys (zipf {}), {} in flight",
        cfg.ranks,
        fmt_bytes(d.layout.data_bytes()),
        d.host_blocks,
        fmt_bytes(d.block_bytes),
        cfg.block_factor,
        fmt_bytes(cfg.page_bytes),
        cfg.layers,
        cfg.jobs,
        cfg.blocks_per_job,
        cfg.keys,
        cfg.zipf,
        cfg.inflight,
    );
    println!("ranks on {gpus_line}");
    match pages::mount_of(&cfg.region_dir) {
        Some(m) => {
            println!("region dir: {} ({})", cfg.region_dir.display(), m.pages());
            if m.small_pages_only() && backend == BackendArg::Cuda {
                println!(
                    "note: 4 KiB pages: the region is data files, each rank faulting and registering only its \
                     share (27 GB/s for 16 GiB on two H200s; one file pinned at 3-4 GB/s); a tmpfs mounted \
                     with huge=always (--region-dir) also gives 2 MiB pages"
                );
            }
        }
        None => println!("region dir: {} (mount unknown)", cfg.region_dir.display()),
    }
    if let Some(r) = cfg.kill_rank {
        println!("fault test: rank {r} is SIGKILLed at {}", cfg.kill_at.name());
    }
    if cfg.fault_copy_every.is_some() || cfg.fault_register_at.is_some() {
        let who = cfg.fault_rank.map_or("every rank".to_string(), |r| format!("rank {r}"));
        println!(
            "fault injection on {who}: copy fault every {} copies, registration fault at call {}",
            cfg.fault_copy_every.map_or("-".into(), |k| k.to_string()),
            cfg.fault_register_at.map_or("-".into(), |k| k.to_string())
        );
    }

    // SIGINT and SIGTERM become events of the loop below (signal-hook's
    // thread reads them from its self-pipe), from before the first rank.
    let events = Arc::new(Events { q: Mutex::new(VecDeque::new()), cv: Condvar::new() });
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .map_err(|e| format!("installing the SIGINT/SIGTERM handlers: {e}"))?;
    let signals_handle = signals.handle();
    let signal_thread = {
        let ev = events.clone();
        thread::spawn(move || {
            for sig in signals.forever() {
                ev.push(Event::Signal(sig));
            }
        })
    };

    // Spawn the ranks (from this thread, which lives until the run ends:
    // a rank's PR_SET_PDEATHSIG fires when the thread that spawned it ends).
    let passthrough: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let mut children: Vec<Child> = Vec::with_capacity(cfg.ranks);
    let mut stdins: Vec<Option<ChildStdin>> = Vec::with_capacity(cfg.ranks);
    let mut readers = Vec::new();
    let t0 = Instant::now();
    let me = std::process::id().to_string();
    for (r, dev) in devices.iter().enumerate() {
        let mut cmd = Command::new(&exe);
        cmd.args(&passthrough)
            .args(["--as-rank", &r.to_string(), "--region-name", &name, "--rank-backend", bname])
            .args(["--rank-device", &dev.to_string(), "--parent-pid", &me])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if cfg.kill_rank == Some(r) {
            cmd.args(["--pause-at", cfg.kill_at.name()]);
        }
        if std::env::var_os("KVOFFLOAD_LOG").is_none() && verbose == 0 {
            // Injected faults make every failed job a warning; the summary counts them.
            cmd.env("KVOFFLOAD_LOG", "error");
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                signals_handle.close();
                return Err(format!("starting rank {r}: {e}"));
            }
        };
        let out = child.stdout.take();
        stdins.push(child.stdin.take());
        children.push(child);
        let ev = events.clone();
        if let Some(out) = out {
            readers.push(thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    match line {
                        Ok(l) => ev.push(Event::Line(r, l)),
                        Err(_) => break,
                    }
                }
                ev.push(Event::Closed(r));
            }));
        }
    }
    println!(
        "rank pids: {}",
        children.iter().enumerate().map(|(r, c)| format!("rank {r} pid {}", c.id())).collect::<Vec<_>>().join(", ")
    );

    // Follow them.
    let bars = Bars::new(cfg.ranks);
    let mut reports: Vec<Option<RankReport>> = vec![None; cfg.ranks];
    let mut errors: Vec<Option<String>> = vec![None; cfg.ranks];
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; cfg.ranks];
    let mut killed: Vec<bool> = vec![false; cfg.ranks];
    // Ranks stopped because another rank failed.
    let mut aborted: Vec<bool> = vec![false; cfg.ranks];
    let mut lat = Latencies::default();
    let mut per_rank_lat: Vec<Latencies> = vec![Latencies::default(); cfg.ranks];
    let mut notes: Vec<String> = Vec::new();
    // Busy intervals of every rank by "<direction>-<stage>" (store-mixed, load-sweep, ...).
    let mut busy: std::collections::BTreeMap<String, Intervals> = std::collections::BTreeMap::new();
    // SIGINT/SIGTERM received (the first one's number), and ranks SIGKILLed
    // because they outlived STOP_GRACE (or a second signal).
    let mut interrupted: Option<i32> = None;
    let mut overdue: Vec<bool> = vec![false; cfg.ranks];
    let mut open = readers.len();
    while open > 0 {
        let (r, line) = match events.pop() {
            Event::Line(r, line) => (r, line),
            Event::Closed(r) => {
                open -= 1;
                statuses[r] = children[r].wait().ok();
                bars.done(r);
                continue;
            }
            Event::Signal(sig) => {
                let live: Vec<usize> =
                    (0..cfg.ranks).filter(|&o| statuses[o].is_none() && !killed[o] && !overdue[o]).collect();
                if interrupted.is_none() {
                    interrupted = Some(sig);
                    bars.println(&format!(
                        "{} {:.2} s into the run: stopping the ranks (SIGTERM); waiting up to {} s",
                        signal_name(sig),
                        t0.elapsed().as_secs_f64(),
                        STOP_GRACE.as_secs()
                    ));
                    for &o in &live {
                        // Not reaped yet, so the pid is still this child's.
                        if let Err(e) = kill_process(Pid::from_child(&children[o]), Signal::TERM) {
                            bars.println(&format!("rank {o}: SIGTERM failed: {e}"));
                        }
                    }
                    let ev = events.clone();
                    thread::spawn(move || {
                        std::thread::sleep(STOP_GRACE);
                        ev.push(Event::Deadline);
                    });
                } else {
                    bars.println(&format!("{} again: killing the ranks left (SIGKILL)", signal_name(sig)));
                    for o in live {
                        let _ = children[o].kill();
                        overdue[o] = true;
                    }
                }
                continue;
            }
            Event::Deadline => {
                for o in 0..cfg.ranks {
                    if statuses[o].is_none() && !killed[o] && !overdue[o] {
                        bars.println(&format!("rank {o}: still running after {} s: SIGKILL", STOP_GRACE.as_secs()));
                        let _ = children[o].kill();
                        overdue[o] = true;
                    }
                }
                continue;
            }
        };
        if line.starts_with(report::PHASE) {
            bars.phase(r, field(&line, "phase").unwrap_or("?"), t0.elapsed().as_secs_f64());
        } else if line.starts_with(report::PROGRESS) {
            let n = |k| field(&line, k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            bars.progress(r, field(&line, "phase").unwrap_or("?"), n("done"), n("total"));
        } else if line.starts_with(report::PAUSE) {
            if cfg.kill_rank == Some(r) && !killed[r] {
                // SIGKILL (std's Child::kill), then reap at once so the
                // peers' liveness check (kill(pid, 0)) sees it gone.
                let _ = children[r].kill();
                statuses[r] = children[r].wait().ok();
                killed[r] = true;
                bars.println(&format!(
                    "rank {r}: SIGKILL at {} (as asked), {:.2} s into the run",
                    field(&line, "at").unwrap_or("?"),
                    t0.elapsed().as_secs_f64()
                ));
            } else if let Some(Some(s)) = stdins.get_mut(r) {
                let _ = writeln!(s);
            }
        } else if line.starts_with(report::BUSY) {
            match report::parse_busy_line(&line) {
                Ok((dir, iv)) => busy.entry(dir).or_default().extend(&iv),
                Err(e) => bars.println(&format!("rank {r}: unreadable busy line: {e}")),
            }
        } else if line.starts_with(report::LATENCY) {
            let mut l = Latencies::default();
            if report::parse_latency_line(&line, &mut l).is_ok() {
                lat.extend(&l);
                per_rank_lat[r].extend(&l);
            }
        } else if line.starts_with(report::RESULT) {
            match RankReport::parse(&line) {
                Ok(rep) => reports[r] = Some(rep),
                Err(e) => errors[r] = Some(format!("unreadable result: {e}")),
            }
        } else if line.starts_with(report::ERROR) {
            errors[r] = Some(
                line.split_once(' ').and_then(|(_, m)| m.split_once(' ')).map_or(line.clone(), |(_, m)| m.to_string()),
            );
            // One rank failed: the others would only wait for it (to join,
            // to agree) until their rank timeout. End the run now: SIGKILL
            // the others and reap them; the region file (if any) is removed
            // below whatever happened. (Not when the run was interrupted:
            // the others are stopping in order.)
            for (o, c) in children.iter_mut().enumerate() {
                if o != r && statuses[o].is_none() && !killed[o] && interrupted.is_none() {
                    let _ = c.kill();
                    statuses[o] = c.wait().ok();
                    aborted[o] = true;
                }
            }
            bars.println(&format!(
                "rank {r} failed {:.2} s into the run; the other ranks were stopped",
                t0.elapsed().as_secs_f64()
            ));
        } else if line.starts_with(report::NOTE) {
            let msg = line.split_once(' ').map_or(line.as_str(), |(_, m)| m).to_string();
            bars.println(&format!("note: {msg}"));
            notes.push(msg);
        } else {
            bars.println(&line);
        }
    }
    drop(stdins);
    for h in readers {
        let _ = h.join();
    }
    signals_handle.close();
    let _ = signal_thread.join();
    bars.clear();
    let wall = t0.elapsed().as_secs_f64();

    // The region file must be gone whatever happened.
    let left = path.exists();
    if left {
        let _ = std::fs::remove_file(&path);
    }

    // Summary.
    let mut ok = true;
    let mut tot = RankReport::default();
    let (mut store, mut load) = (Throughput::default(), Throughput::default());
    let (mut prefill, mut sweep) = (Throughput::default(), Throughput::default());
    for r in 0..cfg.ranks {
        match (&reports[r], killed[r]) {
            (_, true) => println!("rank {r}: killed (SIGKILL at {}), as asked", cfg.kill_at.name()),
            (Some(rep), false) => {
                print_rank(rep, &per_rank_lat[r]);
                ok &= rep.clean();
                tot.requests += rep.requests;
                tot.stores += rep.stores;
                tot.loads += rep.loads;
                tot.lookups += rep.lookups;
                tot.hits += rep.hits;
                tot.blocks_verified += rep.blocks_verified;
                tot.blocks_corrupted += rep.blocks_corrupted;
                tot.blocks_lost += rep.blocks_lost;
                tot.sweep_blocks += rep.sweep_blocks;
                tot.jobs_failed += rep.jobs_failed;
                tot.graphs_failed += rep.graphs_failed;
                store.add(rep.store.bytes, rep.store.seconds);
                load.add(rep.load.bytes, rep.load.seconds);
                prefill.add(rep.prefill_store.bytes, rep.prefill_store.seconds);
                sweep.add(rep.sweep_load.bytes, rep.sweep_load.seconds);
            }
            (None, false) if aborted[r] && errors[r].is_none() => {
                ok = false;
                println!("rank {r}: stopped (another rank failed)");
            }
            (None, false) if overdue[r] => {
                ok = false;
                println!("rank {r}: no result (SIGKILLed: still running {} s after SIGTERM)", STOP_GRACE.as_secs());
            }
            (None, false) => {
                ok = false;
                let why = errors[r].clone().unwrap_or_else(|| match statuses[r] {
                    Some(s) => format!("exited without a result ({s})"),
                    None => "exited without a result".into(),
                });
                println!("rank {r}: FAILED: {why}");
            }
        }
    }
    let finished = reports.iter().filter(|r| r.is_some()).count();
    let failed = (0..cfg.ranks).any(|r| reports[r].is_none() && !killed[r]);
    if let (Some(sig), 0) = (interrupted, tot.stores + tot.loads) {
        // Stopped before any transfer: the rank lines above (if any) are
        // all it measured, no table of zeros.
        println!("region file left: {}", if left { "YES (removed now)" } else { "no" });
        println!(
            "result: INTERRUPTED by {} after {wall:.2} s, before any transfer ({finished} of {} ranks reported)",
            signal_name(sig),
            cfg.ranks
        );
        return Ok(128 + sig);
    }
    if failed && interrupted.is_none() {
        // No figures from a failed run: the errors above are what it says.
        println!("region file left: {}", if left { "YES (removed now)" } else { "no" });
        println!("result: FAILED");
        return Ok(1);
    }
    println!(
        "total: {} requests, {} stores, {} loads over {finished} rank(s) in {wall:.2} s; hit rate {:.1}%; \
         store {:.2} GB/s, load {:.2} GB/s (bytes / summed busy time per rank); job latency p50 {} p99 {}",
        tot.requests,
        tot.stores,
        tot.loads,
        100.0 * tot.hit_rate(),
        store.gbps(),
        load.gbps(),
        fmt_us(lat.percentile(50.0)),
        fmt_us(lat.percentile(99.0)),
    );
    // "-" where a stage moved nothing (no --prefill-blocks, say).
    let rate = |bytes: u64, gbps: f64| if bytes > 0 { format!("{gbps:.2} GB/s") } else { "-".to_string() };
    println!(
        "one direction at a time: stores alone (prefill) {}, loads alone (final sweep) {} (bytes / summed busy time per rank)",
        rate(prefill.bytes, prefill.gbps()),
        rate(sweep.bytes, sweep.gbps()),
    );
    if finished > 1 {
        let union = |k: &str| busy.get(k).map_or(0.0, Intervals::union);
        let gbps =
            |bytes: u64, k: &str| rate(bytes, Throughput { bytes, seconds: union(k), ..Default::default() }.gbps());
        println!(
            "all ranks together (every rank's bytes / time with a job of that kind in flight on any rank): \
             requests: store {}, load {} ({:.3} s, {:.3} s); stores alone {}, loads alone {}",
            gbps(store.bytes, "store-mixed"),
            gbps(load.bytes, "load-mixed"),
            union("store-mixed"),
            union("load-mixed"),
            gbps(prefill.bytes, "store-prefill"),
            gbps(sweep.bytes, "load-sweep"),
        );
    }
    println!(
        "blocks: {} verified ({} in the final sweep), {} corrupted, {} lost; jobs failed (injected faults): {}",
        tot.blocks_verified, tot.sweep_blocks, tot.blocks_corrupted, tot.blocks_lost, tot.jobs_failed
    );
    println!("region file left: {}", if left { "YES (removed now)" } else { "no" });
    if let Some(sig) = interrupted {
        println!(
            "result: INTERRUPTED by {} after {wall:.2} s: {} of {} ranks reported; {} blocks verified, {} corrupted, {} lost",
            signal_name(sig),
            finished,
            cfg.ranks,
            tot.blocks_verified,
            tot.blocks_corrupted,
            tot.blocks_lost
        );
        return Ok(128 + sig);
    }
    ok &= !left && finished > 0;
    if ok {
        println!("result: ok, every loaded block verified ({} blocks), 0 corrupted, 0 lost", tot.blocks_verified);
        Ok(0)
    } else {
        println!("result: FAILED");
        Ok(1)
    }
}

fn fmt_us(s: f64) -> String {
    if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.0} us", s * 1e6)
    }
}

fn print_rank(r: &RankReport, lat: &Latencies) {
    if r.interrupted {
        println!("rank {}: stopped early on request (SIGINT/SIGTERM); its figures cover the work until then", r.rank);
        if r.pin_state.is_empty() {
            // Stopped before pinning settled: shutdown cancelled it.
            println!("rank {}: stopped before its pin state settled (pinning cancelled)", r.rank);
            return;
        }
    }
    println!(
        "rank {}: pinning {} took {:.3} s ({:.2} GB/s, {:.0}% in 2 MiB pages); state {}; agreement {} after {:.3} s",
        r.rank,
        fmt_bytes(r.region_bytes as usize),
        r.pin_seconds,
        r.pin_gbps(),
        100.0 * r.huge_bytes as f64 / (r.region_bytes.max(1)) as f64,
        r.pin_state,
        r.agreement,
        r.agreed_seconds
    );
    println!(
        "  capture: {} windows, waited {:.3} s in total, {:.3} s at most ({} chunk registrations meanwhile); graphs {} ok, {} failed",
        r.windows, r.window_wait_total, r.window_wait_max, r.chunks_waited, r.graphs_ok, r.graphs_failed
    );
    if r.interrupted && r.stores + r.loads == 0 {
        println!("  stopped before its first transfer");
        return;
    }
    if r.prefill_store.bytes > 0 {
        println!(
            "  prefill: {} stored in {:.2} s at {:.2} GB/s (stores alone)",
            fmt_bytes(r.prefill_store.bytes as usize),
            r.prefill_seconds,
            r.prefill_store.gbps()
        );
    }
    println!(
        "  workload: {} requests in {:.2} s; {} stores {} at {:.2} GB/s ({:.1} in flight on average while any; {}), {} loads {} at {:.2} GB/s ({:.1} in flight; {}); hit rate {:.1}%; {} evictions; latency p50 {} p99 {}",
        r.requests,
        r.workload_seconds,
        r.stores,
        fmt_bytes(r.store.bytes as usize),
        r.store.gbps(),
        r.store.mean_in_flight(),
        report::backend_mix(&r.store_backends),
        r.loads,
        fmt_bytes(r.load.bytes as usize),
        r.load.gbps(),
        r.load.mean_in_flight(),
        report::backend_mix(&r.load_backends),
        100.0 * r.hit_rate(),
        r.evictions,
        fmt_us(lat.percentile(50.0)),
        fmt_us(lat.percentile(99.0)),
    );
    println!(
        "  blocks: {} verified ({} in the final sweep, loaded at {:.2} GB/s alone), {} corrupted, {} lost; jobs failed: {} ({} stores, {} loads)",
        r.blocks_verified,
        r.sweep_blocks,
        r.sweep_load.gbps(),
        r.blocks_corrupted,
        r.blocks_lost,
        r.jobs_failed,
        r.stores_failed,
        r.loads_failed
    );
}

/// A rank process: die with the parent, stop on SIGINT/SIGTERM, open the
/// runtime it was told, run, print the result.
fn run_as_rank(a: &Args, cfg: &RunConfig, rank: usize) -> Result<i32, String> {
    let fail = |e: &dyn std::fmt::Display| {
        crate::run::rank::emit(&format!("{} rank={rank} {e}", report::ERROR));
        Ok(1)
    };
    if let Some(parent) = a.parent_pid {
        if let Err(e) = lifecycle::die_with_parent(parent) {
            return fail(&e);
        }
    }
    let stop = match lifecycle::Stop::install() {
        Ok(s) => s,
        Err(e) => return fail(&format!("installing the SIGINT/SIGTERM handlers: {e}")),
    };
    let name = a.region_name.as_deref().ok_or("--as-rank needs --region-name")?;
    let b = match a.rank_backend {
        Some(BackendArg::Cuda) => BackendArg::Cuda,
        _ => BackendArg::Sim,
    };
    let opened = match (b, a.rank_device) {
        (BackendArg::Cuda, Some(d)) => {
            CudaRuntime::open(d).map(kvoffload::internal::runtime::shared).map_err(|e| e.to_string())
        }
        _ => backend::open(b),
    };
    let rt = match opened {
        Ok(rt) => rt,
        Err(e) => {
            crate::run::rank::emit(&format!("{} rank={rank} {e}", report::ERROR));
            return Ok(1);
        }
    };
    match run_rank(cfg, rank, name, rt, a.pause_at.map(Into::into), stop) {
        Ok(rep) => {
            crate::run::rank::emit(&rep.to_line());
            Ok(0)
        }
        Err(e) => {
            crate::run::rank::emit(&format!("{} rank={rank} {e}", report::ERROR));
            Ok(1)
        }
    }
}

/// What the parent's loop reacts to.
enum Event {
    /// A line of rank r's stdout.
    Line(usize, String),
    /// Rank r's stdout closed (it exited).
    Closed(usize),
    /// SIGINT or SIGTERM reached the parent.
    Signal(i32),
    /// STOP_GRACE passed since the first signal.
    Deadline,
}

/// Lines from the ranks' stdout readers, signals, the deadline.
struct Events {
    q: Mutex<VecDeque<Event>>,
    cv: Condvar,
}

impl Events {
    fn push(&self, e: Event) {
        sync::lock(&self.q).push_back(e);
        self.cv.notify_all();
    }

    fn pop(&self) -> Event {
        let mut g = sync::lock(&self.q);
        loop {
            if let Some(e) = g.pop_front() {
                return e;
            }
            g = sync::wait(&self.cv, g);
        }
    }
}

/// One progress bar per rank on stderr (hidden when stderr is not a terminal).
struct Bars {
    multi: indicatif::MultiProgress,
    bars: Vec<indicatif::ProgressBar>,
}

impl Bars {
    fn new(ranks: usize) -> Self {
        let multi = indicatif::MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::stderr());
        let style = indicatif::ProgressStyle::with_template(
            "rank {prefix:<3} {msg:<10} [{bar:30}] {pos:>7}/{len:<7} {elapsed_precise}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> ");
        let bars = (0..ranks)
            .map(|r| {
                let b = multi.add(indicatif::ProgressBar::new(0));
                b.set_style(style.clone());
                b.set_prefix(r.to_string());
                b.set_message("starting");
                b
            })
            .collect();
        Bars { multi, bars }
    }

    /// Rank r entered `phase`, `at` seconds into the run (a line of its
    /// own when the bars are hidden: logs keep the phases' times).
    fn phase(&self, r: usize, phase: &str, at: f64) {
        if let Some(b) = self.bars.get(r) {
            b.set_message(phase.to_string());
        }
        if self.multi.is_hidden() {
            println!("rank {r} -> {phase} ({at:.2} s)");
        }
    }

    fn progress(&self, r: usize, phase: &str, done: u64, total: u64) {
        if let Some(b) = self.bars.get(r) {
            b.set_message(phase.to_string());
            b.set_length(total);
            b.set_position(done);
        }
    }

    fn done(&self, r: usize) {
        if let Some(b) = self.bars.get(r) {
            b.set_message("exited");
            b.abandon();
        }
    }

    fn println(&self, line: &str) {
        if self.multi.is_hidden() {
            println!("{line}");
        } else {
            let _ = self.multi.println(line);
        }
    }

    fn clear(&self) {
        let _ = self.multi.clear();
    }
}

/// `--pin-huge-pages`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HugeArg {
    Auto,
    On,
    Off,
}
