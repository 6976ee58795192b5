//! `kvoffload run` end to end on the simulated GPU: the default run, ranks
//! killed during pinning and during transfers, injected copy and
//! registration faults, bad options, a rank that cannot create the region,
//! SIGTERM and SIGKILL to the parent. Each run starts rank processes of the
//! real binary and checks the summary, the exit status, and that no region
//! file is left in /dev/shm.
//!
//! Exit statuses (src/cli/run.rs): 0 when every rank not killed on request
//! finished clean (a requested kill is an expected outcome); 1 when a block
//! was corrupted or lost, a rank failed unexpectedly or the file remained;
//! 2 for bad options; 128 + the signal for a run stopped by SIGINT/SIGTERM.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kvoffload");

fn run(args: &[&str]) -> (i32, String, u32) {
    let child = Command::new(BIN)
        .arg("run")
        .args(["--backend", "sim"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start kvoffload");
    let pid = child.id();
    let Output { status, stdout, stderr } = child.wait_with_output().expect("wait");
    let out = String::from_utf8_lossy(&stdout).to_string() + &String::from_utf8_lossy(&stderr);
    (status.code().unwrap_or(-1), out, pid)
}

/// The files in /dev/shm of the region that the run of parent `pid` made.
fn region_files(pid: u32) -> Vec<String> {
    let prefix = format!("kvoffload-run-{pid}-");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

/// No /dev/shm file of the run whose parent had `pid`.
fn assert_no_file(pid: u32, out: &str) {
    let left = region_files(pid);
    assert!(left.is_empty(), "region file left: {left:?}\n{out}");
    assert!(out.contains("region file left: no"), "{out}");
}

/// The number before `word` in the line starting with `line_start`.
fn count(out: &str, line_start: &str, word: &str) -> u64 {
    let line =
        out.lines().find(|l| l.starts_with(line_start)).unwrap_or_else(|| panic!("no {line_start:?} line in\n{out}"));
    let i = line.find(word).unwrap_or_else(|| panic!("no {word:?} in {line:?}"));
    line[..i]
        .split_whitespace()
        .last()
        .and_then(|n| n.trim_start_matches('(').parse().ok())
        .unwrap_or_else(|| panic!("no count before {word:?} in {line:?}"))
}

fn assert_clean(out: &str) {
    assert_eq!(count(out, "blocks:", "corrupted"), 0, "{out}");
    assert_eq!(count(out, "blocks:", "lost"), 0, "{out}");
    assert!(count(out, "blocks:", "verified") > 0, "{out}");
    assert!(out.contains("result: ok, every loaded block verified"), "{out}");
}

/// Asserts that `out` contains each of `what`.
fn says(out: &str, what: &[&str]) {
    for w in what {
        assert!(out.contains(w), "{w:?} missing from: {out}");
    }
}

/// Runs with `args`, which must be refused before any rank starts: exit
/// status 2 and one line naming the program. That line.
fn refused_in_one_line(args: &[&str]) -> String {
    let (rc, out, _) = run(args);
    assert_eq!(rc, 2, "{args:?}: {out}");
    assert_eq!(out.lines().count(), 1, "{args:?}: {out}");
    assert!(out.starts_with("kvoffload: "), "{args:?}: {out}");
    out
}

#[test]
fn default_run_verifies_every_block() {
    let (rc, out, pid) = run(&[]);
    assert_eq!(rc, 0, "{out}");
    assert_clean(&out);
    assert_eq!(out.matches("state Pinned; agreement pinned").count(), 2, "{out}");
    assert!(count(&out, "blocks:", "in the final sweep") > 0, "{out}");
    assert!(out.contains("graphs 8 ok, 0 failed"), "{out}");
    // The ranks' busy intervals reached the parent: a positive rate over
    // the union of both ranks' busy time, each way.
    let line = out.lines().find(|l| l.starts_with("all ranks together")).unwrap_or_else(|| panic!("{out}"));
    assert!(rate(line, "store ") > 0.0 && rate(line, "load ") > 0.0, "{line}");
    assert!(line.contains("stores alone -, loads alone "), "no prefill by default: {line}");
    assert!(out.contains("ranks on the simulated GPU"), "{out}");
    assert_no_file(pid, &out);
}

#[test]
fn rank_killed_during_pinning_the_survivor_runs_pageable_and_finishes() {
    let (rc, out, pid) = run(&["--kill-rank", "1", "--kill-at", "pinning", "--jobs", "600"]);
    assert_eq!(rc, 0, "{out}");
    says(
        &out,
        &[
            "rank 1: killed (SIGKILL at pinning), as asked",
            "agreement failed: rank 1 died before it settled its pin state",
            "state Pageable(PeerPageable)",
        ],
    );
    assert_clean(&out);
    assert_no_file(pid, &out);
}

#[test]
fn rank_killed_during_transfers_the_survivor_finishes() {
    let (rc, out, pid) = run(&["--kill-rank", "0", "--kill-at", "transfers", "--jobs", "600"]);
    assert_eq!(rc, 0, "{out}");
    says(&out, &["rank 0: killed (SIGKILL at transfers), as asked", "rank 1: pinning"]);
    assert_clean(&out);
    assert_no_file(pid, &out);
}

#[test]
fn copy_faults_fail_jobs_but_never_corrupt_or_lose_a_block() {
    let (rc, out, pid) = run(&["--fault-copy-every", "40", "--jobs", "1000"]);
    assert_eq!(rc, 0, "{out}");
    let failed: u64 = out
        .lines()
        .find(|l| l.starts_with("blocks:"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(failed > 0, "no injected failure reported\n{out}");
    assert_clean(&out);
    assert_no_file(pid, &out);
}

#[test]
fn register_fault_on_one_rank_makes_every_rank_pageable() {
    let (rc, out, pid) =
        run(&["--fault-register-at", "2", "--fault-rank", "1", "--pin-chunk", "4MiB", "--jobs", "600"]);
    assert_eq!(rc, 0, "{out}");
    assert!(
        out.contains("rank 0: pinning") && out.contains("state Pageable(PeerPageable); agreement pageable"),
        "{out}"
    );
    assert!(out.contains("state Pageable(NotSupported); agreement pageable"), "{out}");
    assert_clean(&out);
    assert_no_file(pid, &out);
}

/// The number after `what` in `line` (a rate such as "store 1.25 GB/s").
fn rate(line: &str, what: &str) -> f64 {
    let at = line.find(what).unwrap_or_else(|| panic!("no {what:?} in {line}")) + what.len();
    line[at..].split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{line}"))
}

#[test]
fn prefill_stores_alone_then_the_sweep_loads_alone_and_each_is_measured() {
    let (rc, out, pid) = run(&["--prefill-blocks", "256"]);
    assert_eq!(rc, 0, "{out}");
    assert_clean(&out);
    assert_eq!(out.matches("  prefill: 16 MiB stored").count(), 2, "{out}");
    let line = out.lines().find(|l| l.starts_with("one direction at a time")).unwrap_or_else(|| panic!("{out}"));
    assert!(rate(line, "(prefill) ") > 0.0 && rate(line, "(final sweep) ") > 0.0, "{line}");
    assert_no_file(pid, &out);
    let (rc, out, _) = run(&["--prefill-blocks", "4096", "--keys", "2048"]);
    assert_eq!(rc, 2, "{out}");
    assert!(out.contains("prefill-blocks = 4096 exceeds the limit of 2048"), "{out}");
}

#[test]
fn region_dir_puts_the_region_elsewhere_and_leaves_nothing_there() {
    let dir = std::env::temp_dir().join(format!("kvoffload-region-dir-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (rc, out, _) = run(&["--region-dir", dir.to_str().unwrap()]);
    assert_eq!(rc, 0, "{out}");
    assert_clean(&out);
    assert!(out.contains(&format!("region dir: {}", dir.display())), "{out}");
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(left.is_empty(), "left in {}: {left:?}\n{out}", dir.display());
    std::fs::remove_dir(&dir).unwrap();
}

#[test]
fn bad_options_are_one_line_and_exit_2() {
    for args in [
        &["--ranks", "0"][..],
        &["--region", "0"],
        &["--page-bytes", "0"],
        &["--page-bytes", "1001"],
        &["--jobs", "0"],
        &["--blocks-per-job", "9", "--keys", "8"],
        &["--kill-rank", "2"],
        &["--region", "64KiB"],
        &["--zipf", "-1"],
        &["--ranks", "100000"],
        &["--region-dir", "/nonexistent-kvoffload-dir"],
    ] {
        refused_in_one_line(args);
    }
    // Issue 28: a directory that holds no files (it failed in the ranks,
    // exit status 1), and a region past the 1 TiB of data files (it named
    // the layout's data_bytes and isize::MAX, or failed in the ranks): the
    // option is named, not an internal field.
    for args in [
        &["--region-dir", "/proc"][..],
        &["--region-dir", "/sys"],
        &["--region", "18446744073709551615"],
        &["--region", "9223372036854775807"],
    ] {
        let out = refused_in_one_line(args);
        assert!(out.contains(args[0].trim_start_matches("--")), "{args:?}: {out}");
        assert!(!out.contains("data_bytes") && !out.contains("isize"), "{args:?}: {out}");
    }
    let (_, out, _) = run(&["--region", "18446744073709551615"]);
    assert!(out.contains("region = 18446744073709551615 exceeds the limit of 1099511627776"), "{out}");
    let out = Command::new(BIN).args(["run", "--backend", "cuda", "--fault-copy-every", "3"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("need the simulated GPU"));
}

#[test]
fn a_rank_that_cannot_create_its_region_ends_the_run_at_once_with_its_error() {
    // Larger than /dev/shm anywhere and than this machine's memory; and a
    // directory with no free space. For 1 TiB both ranks refuse at once
    // (rank 0 finds /dev/shm too small before creating the region; rank 1
    // finds its 512 GiB share larger than the memory it can get before
    // joining), so either may report first, or both: a rank that does not
    // refuse is stopped.
    for (args, whys) in [(&["--region", "1TiB"][..], &["does not fit in /dev/shm", "this process can get"][..])] {
        let t = Instant::now();
        let (rc, out, pid) = run(args);
        let secs = t.elapsed().as_secs_f64();
        println!("{args:?}: the run failed after {secs:.2} s");
        assert_eq!(rc, 1, "{args:?}: {out}");
        let failed: Vec<usize> =
            (0..2).filter(|r| out.contains(&format!("rank {r}: FAILED: host region: region of"))).collect();
        assert!(!failed.is_empty(), "{args:?}: a rank reports the region's error: {out}");
        assert!(whys.iter().any(|w| out.contains(w)), "{args:?}: {out}");
        // Each rank either refused the region itself (both may, at once,
        // before the parent stops the other) or was stopped.
        for r in (0..2).filter(|r| !failed.contains(r)) {
            assert!(out.contains(&format!("rank {r}: stopped (another rank failed)")), "{args:?}: {out}");
        }
        // The error, not a table of zeros.
        assert!(!out.contains("total:") && !out.lines().any(|l| l.starts_with("blocks:")), "{args:?}: {out}");
        assert!(out.contains("result: FAILED"), "{args:?}: {out}");
        // Rank 1 would wait for the region for its 120 s rank timeout: the
        // parent ended it instead (a generous bound for a loaded machine).
        assert!(secs < 20.0, "{args:?}: {secs:.2} s\n{out}");
        if args[0] == "--region" {
            assert_no_file(pid, &out);
        }
    }
}

/// A run in the background; its stdout and stderr lines are collected as
/// they come.
struct Background {
    child: Child,
    out: Arc<Mutex<String>>,
}

impl Background {
    fn start(args: &[&str]) -> Background {
        let mut child = Command::new(BIN)
            .arg("run")
            .args(["--backend", "sim"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kvoffload");
        let out = Arc::new(Mutex::new(String::new()));
        let stdout = child.stdout.take().unwrap();
        let o = out.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let mut g = o.lock().unwrap();
                g.push_str(&line);
                g.push('\n');
            }
        });
        // Ranks inherit stderr: it stays open until the last rank is gone,
        // so it is read apart and never waited for.
        let mut stderr = child.stderr.take().unwrap();
        let o = out.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                o.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Background { child, out }
    }

    fn output(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    /// Waits until `f` holds for the output so far.
    fn wait_for(&self, what: &str, f: impl Fn(&str) -> bool) {
        let t = Instant::now();
        while !f(&self.output()) {
            assert!(t.elapsed() < Duration::from_secs(120), "no {what} after 120 s:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The rank pids the parent printed (`rank pids: rank 0 pid N, ...`).
    fn rank_pids(&self) -> Vec<u32> {
        let out = self.output();
        let line = out.lines().find(|l| l.starts_with("rank pids:")).unwrap_or_else(|| panic!("no pids:\n{out}"));
        line.split(", ").map(|p| p.rsplit(' ').next().unwrap().parse().unwrap()).collect()
    }

    /// Waits for the parent to exit (at most `limit`).
    fn wait(&mut self, limit: Duration) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                // Let the reader take the last lines.
                std::thread::sleep(Duration::from_millis(100));
                return s;
            }
            assert!(t.elapsed() < limit, "the parent did not exit within {limit:?}:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// True while `pid` is a running (not zombie) rank process of this binary.
fn rank_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()).unwrap_or("?");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    state != "Z" && String::from_utf8_lossy(&cmdline).contains("--as-rank")
}

/// Waits until every rank of `pids` is gone; returns how long it took.
fn wait_ranks_gone(pids: &[u32], limit: Duration, out: &dyn Fn() -> String) -> f64 {
    let t = Instant::now();
    while pids.iter().any(|&p| rank_alive(p)) {
        assert!(t.elapsed() < limit, "ranks {pids:?} still alive after {limit:?}:\n{}", out());
        std::thread::sleep(Duration::from_millis(10));
    }
    t.elapsed().as_secs_f64()
}

/// Sends `sig` to `pid`.
fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid this test spawned; no memory is involved.
    let r = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(r, 0, "kill({pid}, {sig}) failed");
}

/// A run of a million requests per rank (still running long after) with
/// both ranks in their workload and then a moment for jobs to be in
/// flight; its two rank pids.
fn mid_workload() -> (Background, Vec<u32>) {
    let bg = Background::start(&["--jobs", "1000000"]);
    bg.wait_for("workload of both ranks", |o| o.contains("rank 0 -> workload") && o.contains("rank 1 -> workload"));
    std::thread::sleep(Duration::from_millis(300));
    let pids = bg.rank_pids();
    assert_eq!(pids.len(), 2);
    (bg, pids)
}

#[test]
fn sigterm_to_the_parent_stops_every_rank_in_order_and_prints_the_summary() {
    let (mut bg, pids) = mid_workload();
    let t = Instant::now();
    signal(bg.child.id(), libc::SIGTERM);
    let status = bg.wait(Duration::from_secs(60));
    let secs = t.elapsed().as_secs_f64();
    let out = bg.output();
    println!("SIGTERM: the parent exited {secs:.2} s after it");
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{out}");
    // Every rank reaped by the parent (no rank SIGKILLed at the deadline).
    for p in &pids {
        assert!(!rank_alive(*p), "rank {p} alive\n{out}");
    }
    assert!(out.contains("SIGTERM") && out.contains("stopping the ranks (SIGTERM)"), "{out}");
    assert!(!out.contains("SIGKILL"), "{out}");
    // Each rank stopped issuing work, drained it, shut down and reported.
    assert_eq!(out.matches("stopped early on request").count(), 2, "{out}");
    assert_eq!(out.matches("-> shutdown").count(), 2, "{out}");
    assert!(out.contains("result: INTERRUPTED by SIGTERM") && out.contains("2 of 2 ranks reported"), "{out}");
    assert_eq!(count(&out, "blocks:", "corrupted"), 0, "{out}");
    assert_eq!(count(&out, "blocks:", "lost"), 0, "{out}");
    assert!(count(&out, "blocks:", "verified") > 0, "{out}");
    assert!(out.contains("workload: ") && out.contains("total: "), "{out}");
    assert_no_file(bg.child.id(), &out);
}

#[test]
fn sigkill_to_the_parent_ends_every_rank_and_leaves_no_region_file() {
    let (mut bg, pids) = mid_workload();
    let parent = bg.child.id();
    bg.child.kill().unwrap();
    bg.child.wait().unwrap();
    // PR_SET_PDEATHSIG: each rank gets SIGTERM, drains, shuts down, exits.
    let secs = wait_ranks_gone(&pids, Duration::from_secs(60), &|| bg.output());
    println!("SIGKILL to the parent: every rank gone {secs:.2} s later");
    let left = region_files(parent);
    assert!(left.is_empty(), "region file left: {left:?}\n{}", bg.output());
}

/// Issue 28: a rank that dies during the join (SIGKILLed before it maps the
/// region) ends the run at once: the parent stops the others, which would
/// wait for it until their rank timeout (120 s by default; 600 s here, so a
/// run that ends at all before the test's own limit ended through the
/// parent), and removes every file of the region.
#[test]
fn a_rank_killed_during_the_join_ends_the_run_at_once() {
    for rank in ["0", "1"] {
        let t = Instant::now();
        let mut bg = Background::start(&["--kill-rank", rank, "--kill-at", "join", "--rank-timeout-s", "600"]);
        let status = bg.wait(Duration::from_secs(60));
        let out = bg.output();
        println!("rank {rank} killed during the join: the run ended after {:.2} s", t.elapsed().as_secs_f64());
        assert_eq!(status.code(), Some(1), "{out}");
        assert!(out.contains(&format!("rank {rank} died during the join")), "{out}");
        let other = if rank == "0" { 1 } else { 0 };
        assert!(out.contains(&format!("rank {other}: stopped (another rank failed)")), "{out}");
        assert!(out.contains("result: FAILED"), "{out}");
        let pid = bg.child.id();
        let left = region_files(pid);
        assert!(left.is_empty(), "left: {left:?}\n{out}");
    }
}
