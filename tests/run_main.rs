//! `kvoffload run` end to end on the simulated GPU: the default run, ranks
//! killed during pinning and during transfers, injected copy and
//! registration faults, bad options. Each run starts rank processes of the
//! real binary and checks the summary, the exit status, and that no region
//! file is left in /dev/shm.
//!
//! Exit statuses (src/cli/run.rs): 0 when every rank not killed on request
//! finished clean (a requested kill is an expected outcome); 1 when a block
//! was corrupted or lost, a rank failed unexpectedly or the file remained;
//! 2 for bad options.

use std::process::{Command, Output};

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

/// No /dev/shm file of the run whose parent had `pid`.
fn assert_no_file(pid: u32, out: &str) {
    let prefix = format!("kvoffload-run-{pid}-");
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().to_string()).collect())
        .unwrap_or_default();
    assert!(!left.iter().any(|n| n.starts_with(&prefix)), "region file left: {left:?}\n{out}");
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
    assert!(out.contains("rank 1: killed (SIGKILL at pinning), as asked"), "{out}");
    assert!(out.contains("agreement failed: rank 1 died before it settled its pin state"), "{out}");
    assert!(out.contains("state Pageable(PeerPageable)"), "{out}");
    assert_clean(&out);
    assert_no_file(pid, &out);
}

#[test]
fn rank_killed_during_transfers_the_survivor_finishes() {
    let (rc, out, pid) = run(&["--kill-rank", "0", "--kill-at", "transfers", "--jobs", "600"]);
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains("rank 0: killed (SIGKILL at transfers), as asked"), "{out}");
    assert!(out.contains("rank 1: pinning"), "{out}");
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
        let (rc, out, _) = run(args);
        assert_eq!(rc, 2, "{args:?}: {out}");
        assert_eq!(out.lines().count(), 1, "{args:?}: {out}");
        assert!(out.starts_with("kvoffload: "), "{args:?}: {out}");
    }
    let out = Command::new(BIN).args(["run", "--backend", "cuda", "--fault-copy-every", "3"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("need the simulated GPU"));
}
