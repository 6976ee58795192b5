//! The parent while its ranks run: spawns them, reads their lines (progress
//! bars, phases, pauses, results, errors), forwards SIGINT/SIGTERM, kills a
//! rank where a fault test asks or when another failed, and collects what
//! each reported.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::Instant;

use rustix::process::{kill_process, Pid, Signal};
use signal_hook::consts::{SIGINT, SIGTERM};

use kvoffload::internal::sync::{self, thread, Arc, Condvar, Mutex};

use crate::run::metrics::{Intervals, Latencies};
use crate::run::report::{self, field, RankReport};
use crate::run::RunConfig;

use super::preflight::Plan;
use super::{signal_name, STOP_GRACE};

/// What the ranks reported, and how each ended.
pub(super) struct Outcome {
    pub reports: Vec<Option<RankReport>>,
    /// A rank's error line, or why its result could not be read.
    pub errors: Vec<Option<String>>,
    pub statuses: Vec<Option<ExitStatus>>,
    /// SIGKILLed on request (the fault test).
    pub killed: Vec<bool>,
    /// Stopped because another rank failed.
    pub aborted: Vec<bool>,
    /// SIGKILLed because they outlived STOP_GRACE (or a second signal).
    pub overdue: Vec<bool>,
    /// Job latencies of every rank together, and of each rank.
    pub lat: Latencies,
    pub per_rank_lat: Vec<Latencies>,
    /// Busy intervals of every rank by "<direction>-<stage>" (store-mixed, load-sweep, ...).
    pub busy: BTreeMap<String, Intervals>,
    /// The first SIGINT/SIGTERM received, if any.
    pub interrupted: Option<i32>,
    /// Seconds from the first spawn to the last rank's exit.
    pub wall: f64,
    /// The region file was still there after the ranks ended (removed now).
    pub left: bool,
}

/// Runs the ranks of `plan` to their end and collects their reports; the
/// region file is removed whatever happened.
pub(super) fn supervise(cfg: &RunConfig, plan: &Plan, verbose: u8) -> Result<Outcome, String> {
    let Plan { exe, name, path, devices, bname, .. } = plan;
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
        let mut cmd = Command::new(exe);
        cmd.args(&passthrough)
            .args(["--as-rank", &r.to_string(), "--region-name", name, "--rank-backend", bname])
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
    let mut busy: BTreeMap<String, Intervals> = BTreeMap::new();
    // SIGINT/SIGTERM received (the first one's number), and ranks SIGKILLed
    // because they outlived STOP_GRACE (or a second signal).
    let mut interrupted: Option<i32> = None;
    let mut overdue: Vec<bool> = vec![false; cfg.ranks];
    // The last phase each rank announced (None: none yet).
    let mut phases: Vec<Option<String>> = vec![None; cfg.ranks];
    let mut open = readers.len();
    while open > 0 {
        let (r, line) = match events.pop() {
            Event::Line(r, line) => (r, line),
            Event::Closed(r) => {
                open -= 1;
                statuses[r] = children[r].wait().ok();
                bars.done(r);
                // A rank that exited without a word (killed from outside,
                // crashed) during the join: the others would wait for it
                // until their rank timeout.
                let unexplained = reports[r].is_none() && errors[r].is_none() && !killed[r] && !aborted[r];
                if unexplained && !overdue[r] && interrupted.is_none() && in_join(&phases[r]) {
                    let why = statuses[r].map_or("exited".to_string(), |s| format!("exited ({s})"));
                    stop_others(&mut children, &mut statuses, &killed, &mut aborted, r);
                    bars.println(&format!(
                        "rank {r} {why} during the join, {:.2} s into the run; the other ranks were stopped",
                        t0.elapsed().as_secs_f64()
                    ));
                }
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
            phases[r] = field(&line, "phase").map(str::to_string);
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
                if interrupted.is_none() && in_join(&phases[r]) {
                    // Killed before it mapped the region: no rank can
                    // complete the join; the others would only wait for it.
                    stop_others(&mut children, &mut statuses, &killed, &mut aborted, r);
                    bars.println(&format!(
                        "rank {r} died during the join, {:.2} s into the run; the other ranks were stopped",
                        t0.elapsed().as_secs_f64()
                    ));
                }
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
            if interrupted.is_none() {
                stop_others(&mut children, &mut statuses, &killed, &mut aborted, r);
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

    // The region's files must be gone whatever happened (ranks SIGKILLed
    // during the join leave the header file and their data files).
    let files = region_files(path);
    let left = !files.is_empty();
    for f in &files {
        // remove_file never follows a link: it removes the name.
        let _ = std::fs::remove_file(f);
    }

    Ok(Outcome {
        reports,
        errors,
        statuses,
        killed,
        aborted,
        overdue,
        lat,
        per_rank_lat,
        busy,
        interrupted,
        wall,
        left,
    })
}

/// The region's files left in its directory: the header file `path` and
/// its data files `<path>.<k>` (names only; links are not followed).
fn region_files(path: &std::path::Path) -> Vec<std::path::PathBuf> {
    let (Some(dir), Some(base)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return Vec::new();
    };
    let dotted = format!("{base}.");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n == base || n.strip_prefix(&dotted).is_some_and(|k| k.parse::<usize>().is_ok()))
        .map(|n| dir.join(n))
        .collect()
}

/// True while a rank that announced `phase` last has not mapped the
/// region yet (it announces "region" before it creates or joins it, and
/// the next phase once every rank mapped it).
fn in_join(phase: &Option<String>) -> bool {
    phase.as_deref().is_none_or(|p| p == "region")
}

/// SIGKILLs and reaps every rank but `r` that is still running (not
/// killed on request): they would only wait for `r` until their rank
/// timeout. Marks them aborted.
fn stop_others(
    children: &mut [Child],
    statuses: &mut [Option<ExitStatus>],
    killed: &[bool],
    aborted: &mut [bool],
    r: usize,
) {
    for (o, c) in children.iter_mut().enumerate() {
        if o != r && statuses[o].is_none() && !killed[o] {
            let _ = c.kill();
            statuses[o] = c.wait().ok();
            aborted[o] = true;
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
