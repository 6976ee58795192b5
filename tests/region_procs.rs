//! The /dev/shm region across real processes: the test binary re-executes
//! itself (`current_exe() <test> --exact`) with an env var naming the child
//! role. Ranks are killed with SIGKILL at several points; after the
//! survivors return no file may remain. Synchronisation is by polling shared
//! state with a deadline and by waiting for exit statuses, never by sleeping.

mod region_common;

use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use kvoffload::region::{page_size, JoinPhase, Layout, Region, RegionError, ShmOptions};
use region_common::{block_on_stdin, child_role, poll_until, ChildGuard, ShmGuard};

/// Long enough for anything that should happen on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(30);

fn layout(n: usize) -> Layout {
    Layout::new(n, page_size(), 2).unwrap()
}

fn opts(timeout: Duration) -> ShmOptions {
    ShmOptions::new().timeout(timeout)
}

/// The flag word at the start of `rank`'s chunk 1.
fn flag(r: &Region, rank: usize) -> &AtomicU32 {
    let p = r.chunk_ptr(rank, 1).unwrap();
    // SAFETY: chunk 1 of `rank` is page aligned, at least 4 bytes, inside the
    // live mapping borrowed by the returned reference, and every process
    // accesses this word only atomically.
    unsafe { &*(p.as_ptr() as *const AtomicU32) }
}

fn fill_pattern(buf: &mut [u8], seed: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = seed.wrapping_add((i % 251) as u8);
    }
}

fn check_pattern(r: &Region, rank: usize, seed: u8) {
    let mut buf = vec![0u8; page_size()];
    r.read_chunk(rank, 0, 0, &mut buf).unwrap();
    let mut want = vec![0u8; page_size()];
    fill_pattern(&mut want, seed);
    assert!(buf == want, "rank {rank}'s chunk does not hold its pattern");
}

/// What a re-executed child does. Panics (non-zero exit) on any failure.
fn run_child(role: &str, name: &str) {
    match role {
        // Rank 1 of 2: join, wait for rank 0's data, check it, answer.
        "share" => {
            let mut r = Region::join(name, layout(2), 1, &opts(PATIENCE)).unwrap();
            assert!(!r.is_linked());
            assert!(poll_until(PATIENCE, || flag(&r, 0).load(Ordering::Acquire) == 1));
            check_pattern(&r, 0, 0xa0);
            fill_pattern(r.own_chunk_mut(0).unwrap(), 0xb0);
            flag(&r, 1).store(1, Ordering::Release);
        }
        // Blocks before joining: killed before it ever maps.
        "block-then-join" => {
            block_on_stdin();
            let _ = Region::join(name, layout(3), 1, &opts(PATIENCE));
        }
        // Rank 1 of 3: maps, then waits inside join for rank 2 (killed there).
        "join-then-wait" => {
            let _ = Region::join(name, layout(3), 1, &opts(PATIENCE));
            block_on_stdin();
        }
        // Rank 0 of 2 or 3: creates and waits for the others (killed there).
        "create-2" | "create-3" => {
            let n = if role == "create-2" { 2 } else { 3 };
            let _ = Region::create(name, layout(n), 0, &opts(PATIENCE));
            block_on_stdin();
        }
        other => panic!("unknown child role {other}"),
    }
}

macro_rules! child_dispatch {
    () => {
        if let Some((role, name)) = child_role() {
            return run_child(&role, &name);
        }
    };
}

#[track_caller]
fn assert_killed(status: std::process::ExitStatus) {
    assert_eq!(status.signal(), Some(libc::SIGKILL), "child status {status:?}");
}

#[test]
fn two_processes_share_one_region() {
    child_dispatch!();
    let g = ShmGuard::new("share");
    let mut child = ChildGuard::spawn("two_processes_share_one_region", "share", &g.name);
    let mut r = Region::create(&g.name, layout(2), 0, &opts(PATIENCE)).unwrap();
    // Both ranks mapped: the file is already gone.
    g.assert_gone();
    assert_eq!(r.mapped_ranks(), vec![0, 1]);
    let pids = r.rank_pids().unwrap();
    assert_eq!(pids, vec![std::process::id(), child.pid() as u32]);
    fill_pattern(r.own_chunk_mut(0).unwrap(), 0xa0);
    flag(&r, 0).store(1, Ordering::Release);
    assert!(poll_until(PATIENCE, || flag(&r, 1).load(Ordering::Acquire) == 1), "child never answered");
    check_pattern(&r, 1, 0xb0);
    let status = child.wait();
    assert!(status.success(), "child failed: {status:?}");
    // The child's writes outlive its mapping.
    check_pattern(&r, 1, 0xb0);
    drop(r);
    g.assert_gone();
}

#[test]
fn region_joiner_killed_before_mapping_leaves_no_file() {
    child_dispatch!();
    let g = ShmGuard::new("killbefore");
    let mut creator = Region::create(&g.name, layout(3), 0, &opts(PATIENCE).wait_for_all(false)).unwrap();
    let mut child = ChildGuard::spawn("region_joiner_killed_before_mapping_leaves_no_file", "block-then-join", &g.name);
    assert_killed(child.kill9());
    assert_eq!(creator.mapped_ranks(), vec![0]);
    match creator.wait_all_mapped(Duration::from_millis(300)) {
        Err(RegionError::JoinTimeout { phase: JoinPhase::RanksToMap, missing, .. }) => {
            assert_eq!(missing, vec![1, 2]);
        }
        other => panic!("expected JoinTimeout, got {other:?}"),
    }
    g.assert_gone();
}

/// Rank 1 (a child) maps and is killed while waiting for rank 2.
fn kill_rank1_after_it_mapped(g: &ShmGuard, test: &str) -> Region {
    let creator = Region::create(&g.name, layout(3), 0, &opts(PATIENCE).wait_for_all(false)).unwrap();
    let mut child = ChildGuard::spawn(test, "join-then-wait", &g.name);
    assert!(poll_until(PATIENCE, || creator.mapped_ranks() == vec![0, 1]), "child never mapped");
    assert_killed(child.kill9());
    creator
}

#[test]
fn region_joiner_killed_after_mapping_survivor_times_out_leaves_no_file() {
    child_dispatch!();
    let g = ShmGuard::new("killafter");
    let mut creator =
        kill_rank1_after_it_mapped(&g, "region_joiner_killed_after_mapping_survivor_times_out_leaves_no_file");
    assert!(g.listed());
    match creator.wait_all_mapped(Duration::from_millis(300)) {
        Err(RegionError::JoinTimeout { phase: JoinPhase::RanksToMap, mapped, missing, .. }) => {
            assert_eq!((mapped, missing), (vec![0, 1], vec![2]));
        }
        other => panic!("expected JoinTimeout, got {other:?}"),
    }
    g.assert_gone();
}

#[test]
fn region_joiner_killed_after_mapping_last_rank_completes_and_unlinks() {
    child_dispatch!();
    let g = ShmGuard::new("killafter2");
    let mut creator =
        kill_rank1_after_it_mapped(&g, "region_joiner_killed_after_mapping_last_rank_completes_and_unlinks");
    // The dead rank's bit stays set; the last live rank completes the mask.
    let last = Region::join(&g.name, layout(3), 2, &opts(PATIENCE)).unwrap();
    g.assert_gone();
    creator.wait_all_mapped(Duration::from_millis(300)).unwrap();
    assert_eq!(last.mapped_ranks(), vec![0, 1, 2]);
    drop((creator, last));
    g.assert_gone();
}

#[test]
fn region_creator_killed_after_ready_survivor_times_out_leaves_no_file() {
    child_dispatch!();
    let g = ShmGuard::new("killcreator");
    let mut child =
        ChildGuard::spawn("region_creator_killed_after_ready_survivor_times_out_leaves_no_file", "create-3", &g.name);
    let mut joiner = Region::join(&g.name, layout(3), 1, &opts(PATIENCE).wait_for_all(false)).unwrap();
    assert_eq!(joiner.mapped_ranks(), vec![0, 1]);
    assert_killed(child.kill9());
    match joiner.wait_all_mapped(Duration::from_millis(300)) {
        Err(RegionError::JoinTimeout { phase: JoinPhase::RanksToMap, missing, .. }) => assert_eq!(missing, vec![2]),
        other => panic!("expected JoinTimeout, got {other:?}"),
    }
    g.assert_gone();
}

/// Reads the join state of the file (high half of the word at offset 64),
/// if the file is already that long.
fn file_join_state(path: &std::path::Path) -> Option<u32> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut b = [0u8; 72];
    f.read_exact(&mut b).ok()?;
    Some(u32::from_ne_bytes(b[68..72].try_into().unwrap()))
}

#[test]
fn region_creator_killed_at_any_observed_point_leaves_no_file() {
    child_dispatch!();
    // Kill points: right after spawn (before or after it created the file),
    // once the file exists (sized or not), once the header is READY.
    for point in ["spawned", "exists", "ready"] {
        let g = ShmGuard::new(point);
        let mut child =
            ChildGuard::spawn("region_creator_killed_at_any_observed_point_leaves_no_file", "create-2", &g.name);
        match point {
            "spawned" => {}
            "exists" => assert!(poll_until(PATIENCE, || g.path.exists()), "file never appeared"),
            _ => assert!(poll_until(PATIENCE, || file_join_state(&g.path) == Some(1)), "never ready"),
        }
        let status = child.kill9();
        // The child cannot have finished on its own: it waits for rank 1.
        assert_killed(status);
        // The survivor joins; whatever point the creator died at, it
        // returns (joined and completed, or timed out) and no file remains.
        let res = Region::join(&g.name, layout(2), 1, &opts(Duration::from_millis(300)));
        match (&res, point) {
            (Ok(r), _) => assert_eq!(r.mapped_ranks(), vec![0, 1]),
            (Err(RegionError::JoinTimeout { .. }), "spawned" | "exists") => {}
            (Err(e), _) => panic!("kill point {point}: unexpected {e:?}"),
        }
        if point == "ready" {
            assert!(res.is_ok(), "a READY region must still be joinable");
        }
        drop(res);
        g.assert_gone();
    }
}
