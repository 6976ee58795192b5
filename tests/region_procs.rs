//! The /dev/shm region across real processes: the test binary re-executes
//! itself (`current_exe() <test> --exact`) with an env var naming the child
//! role. Ranks are killed with SIGKILL at several points; after the
//! survivors return no file may remain. Synchronisation is by polling shared
//! state with a deadline and by waiting for exit statuses, never by sleeping.

mod region_common;

use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use kvoffload::internal::pin::{pin_with, Agreement, Prepared, RegionSlots};
use kvoffload::internal::protocol::agreement::RankSlots;
use kvoffload::{
    page_size, AgreementError, FileSplit, JoinPhase, Layout, PinObserver, PinOptions, PinState, Region, RegionError,
    ShmOptions, ShmStep, SimRuntime,
};
use region_common::{block_on_stdin, child_role, poll_until, ChildGuard, ShmGuard};

/// Long enough for anything that should happen on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(30);

fn layout(n: usize) -> Layout {
    Layout::new(n, page_size(), 2).unwrap()
}

fn opts(timeout: Duration) -> ShmOptions {
    ShmOptions::new().timeout(timeout)
}

/// The one-file layout these tests were written for (their kill points
/// assume the creator sets its bit when it publishes READY).
fn single(timeout: Duration) -> ShmOptions {
    opts(timeout).files(FileSplit::Single)
}

/// A multi-file region of 2 ranks: rank-major shares of 4 pages in data
/// files of 2 pages (4 files, 2 a rank).
fn mlayout() -> Layout {
    Layout::rank_major(2, page_size(), 4).unwrap()
}

fn mopts(timeout: Duration) -> ShmOptions {
    opts(timeout).files(FileSplit::Multi { max_file_bytes: 2 * page_size() })
}

/// A step's name as the child roles spell it (`DataFileCreated1`, `Ready`).
fn step_name(s: ShmStep) -> String {
    match s {
        ShmStep::DataFileCreated { file } => format!("DataFileCreated{file}"),
        other => format!("{other:?}"),
    }
}

/// Options that stop this process at `step` (it prints `at <step>` and
/// blocks until killed).
fn pause_at(o: ShmOptions, step: &str) -> ShmOptions {
    let step = step.to_string();
    o.observe(move |s| {
        if step_name(s) == step {
            use std::io::Write;
            println!("at {step}");
            let _ = std::io::stdout().flush();
            block_on_stdin();
        }
    })
}

/// Stops this process at chunk `at` (prints `at chunk`).
struct PauseAt {
    at: Option<usize>,
}

impl PinObserver for PauseAt {
    fn before_chunk(&self, i: usize, _total: usize) {
        if self.at == Some(i) {
            use std::io::Write;
            println!("at chunk {i}");
            let _ = std::io::stdout().flush();
            block_on_stdin();
        }
    }
}

/// Pins `region` on a simulated GPU with the agreement of its ranks,
/// stopping at chunk `pause` if given.
fn pin_agreed(
    region: &kvoffload::internal::sync::Arc<Region>,
    pause: Option<usize>,
) -> Result<PinState, AgreementError> {
    let rt = SimRuntime::new();
    let prepared = Prepared::new(&rt, region, &PinOptions::default().threads(1).max_chunk_bytes(page_size())).unwrap();
    assert_eq!(prepared.chunks(), 4, "a rank's share is 4 chunks of one page");
    let (coord, prefault) = prepared.into_parts();
    let pause = PauseAt { at: pause };
    let slots: kvoffload::internal::sync::Arc<dyn RankSlots> =
        kvoffload::internal::sync::Arc::new(RegionSlots::new(region.clone()).unwrap());
    let agreement = Agreement { slots, rank: region.rank(), timeout: Some(PATIENCE) };
    let r = pin_with(&rt, &coord, prefault.as_ref(), Some(&pause), Some(&agreement.into())).agreed();
    if coord.pinning().registered_chunks() > 0 {
        coord.pinning().unregister_all(&rt).unwrap();
    }
    r
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
            let _ = Region::create(name, layout(n), 0, &single(PATIENCE));
            block_on_stdin();
        }
        // Multi-file creator (rank 0 of 2) stopping at a step.
        r if r.starts_with("mcreate:") => {
            let o = pause_at(mopts(PATIENCE), &r["mcreate:".len()..]);
            let _ = Region::create(name, mlayout(), 0, &o);
            block_on_stdin();
        }
        // Multi-file joiner (rank 1 of 2) stopping at a step.
        r if r.starts_with("mjoin:") => {
            let o = pause_at(mopts(PATIENCE), &r["mjoin:".len()..]);
            let _ = Region::join(name, mlayout(), 1, &o);
            block_on_stdin();
        }
        // Multi-file joiner (rank 1 of 2) that pins its share and stops
        // pre-faulting chunk 0 (`prefault`), after registering chunks 0 and
        // 1 (`registering`), or once pinned and agreed (`pinned`: the
        // transfer phase).
        // Multi-file joiner with deferred reservation stopping at a step.
        r if r.starts_with("mjoind:") => {
            let o = pause_at(mopts(PATIENCE).defer_reserve(true), &r["mjoind:".len()..]);
            let _ = Region::join(name, mlayout(), 1, &o);
            block_on_stdin();
        }
        // As `mpin:`, with deferred reservation (`mpind:`): pre-faulting
        // reserves as it goes.
        r if r.starts_with("mpin:") || r.starts_with("mpind:") => {
            let deferred = r.starts_with("mpind:");
            let o = mopts(PATIENCE).defer_reserve(deferred);
            let region = kvoffload::internal::sync::Arc::new(Region::join(name, mlayout(), 1, &o).unwrap());
            assert_eq!(region.reservation_deferred(), deferred);
            let pause = match r.split_once(':').map_or("", |p| p.1) {
                "prefault" => Some(0),
                "registering" => Some(2),
                _ => None,
            };
            let state = pin_agreed(&region, pause).unwrap();
            assert_eq!(state, PinState::Pinned);
            use std::io::Write;
            println!("at pinned");
            let _ = std::io::stdout().flush();
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

/// Rank 1 (a child) maps and is killed while waiting for rank 2; the
/// region's guard (tagged `tag`) and its creator.
fn kill_rank1_after_it_mapped(tag: &str, test: &str) -> (ShmGuard, Region) {
    let g = ShmGuard::new(tag);
    let creator = Region::create(&g.name, layout(3), 0, &opts(PATIENCE).wait_for_all(false)).unwrap();
    let mut child = ChildGuard::spawn(test, "join-then-wait", &g.name);
    assert!(poll_until(PATIENCE, || creator.mapped_ranks() == vec![0, 1]), "child never mapped");
    assert_killed(child.kill9());
    (g, creator)
}

/// `r`'s wait for every rank to map times out (300 ms) waiting for ranks
/// to map: the ranks mapped and those missing.
fn ranks_timed_out(r: &mut Region) -> (Vec<usize>, Vec<usize>) {
    match r.wait_all_mapped(Duration::from_millis(300)) {
        Err(RegionError::JoinTimeout { phase: JoinPhase::RanksToMap, mapped, missing, .. }) => (mapped, missing),
        other => panic!("expected JoinTimeout, got {other:?}"),
    }
}

#[test]
fn region_joiner_killed_after_mapping_survivor_times_out_leaves_no_file() {
    child_dispatch!();
    let (g, mut creator) =
        kill_rank1_after_it_mapped("killafter", "region_joiner_killed_after_mapping_survivor_times_out_leaves_no_file");
    assert!(g.listed());
    assert_eq!(ranks_timed_out(&mut creator), (vec![0, 1], vec![2]));
    g.assert_gone();
}

#[test]
fn region_joiner_killed_after_mapping_last_rank_completes_and_unlinks() {
    child_dispatch!();
    let (g, mut creator) =
        kill_rank1_after_it_mapped("killafter2", "region_joiner_killed_after_mapping_last_rank_completes_and_unlinks");
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
    let mut joiner = Region::join(&g.name, layout(3), 1, &single(PATIENCE).wait_for_all(false)).unwrap();
    assert_eq!(joiner.mapped_ranks(), vec![0, 1]);
    assert_killed(child.kill9());
    assert_eq!(ranks_timed_out(&mut joiner).1, vec![2]);
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
        let creator_pid = child.child.as_ref().unwrap().id();
        let status = child.kill9();
        // The child cannot have finished on its own: it waits for rank 1.
        assert_killed(status);
        // The survivor joins; whatever point the creator died at, it
        // returns (timed out before READY; refused after it: the creator
        // is dead, issue 28) and no file remains.
        let res = Region::join(&g.name, layout(2), 1, &single(Duration::from_millis(300)));
        match (&res, point) {
            (Err(RegionError::JoinTimeout { .. }), "spawned" | "exists") => {}
            (Err(RegionError::CreatorDied { pid, .. }), _) => assert_eq!(*pid, creator_pid),
            (r, _) => panic!("kill point {point}: unexpected {r:?}"),
        }
        if point == "ready" {
            assert!(
                matches!(res, Err(RegionError::CreatorDied { .. })),
                "a READY region whose creator is dead is refused"
            );
        }
        drop(res);
        g.assert_gone();
    }
}

// ---- multi-file regions: a kill at every step of every rank ----

#[test]
fn region_multi_creator_killed_at_each_step_leaves_no_file() {
    child_dispatch!();
    let test = "region_multi_creator_killed_at_each_step_leaves_no_file";
    // Before READY the survivor waits for the creator to initialise; after
    // it, for the creator's bit (set only once it reserved its files).
    for (step, phase, files) in [
        ("HeaderCreated", JoinPhase::CreatorToInitialise, 1),
        ("DataFileCreated0", JoinPhase::CreatorToInitialise, 2),
        ("DataFileCreated2", JoinPhase::CreatorToInitialise, 4),
        ("Ready", JoinPhase::RanksToMap, 5),
        ("Reserving", JoinPhase::RanksToMap, 5),
        ("Reserved", JoinPhase::RanksToMap, 5),
    ] {
        let g = ShmGuard::new(&step.to_lowercase());
        let mut child = ChildGuard::spawn_piped(test, &format!("mcreate:{step}"), &g.name);
        assert_eq!(child.read_line("at "), format!("at {step}"));
        assert_eq!(g.files().len(), files, "{step}: {:?}", g.files());
        assert_killed(child.kill9());
        // Before READY the survivor times out; after it, the header names
        // the dead creator and the join is refused at once (issue 28).
        match Region::join(&g.name, mlayout(), 1, &mopts(Duration::from_millis(300))) {
            Err(RegionError::JoinTimeout { phase: p, .. }) if p == phase && phase != JoinPhase::RanksToMap => {}
            Err(RegionError::CreatorDied { .. }) if phase == JoinPhase::RanksToMap => {}
            other => panic!("{step}: expected JoinTimeout({phase:?}) or CreatorDied after READY, got {other:?}"),
        }
        g.assert_gone();
    }
}

#[test]
fn region_multi_joiner_killed_at_each_step_leaves_no_file() {
    child_dispatch!();
    let test = "region_multi_joiner_killed_at_each_step_leaves_no_file";
    let steps = ["FilesMapped", "Reserving", "Reserved", "Mapped"];
    joiner_killed_at_each_step(test, "mjoin", "", &steps, &mopts(PATIENCE).wait_for_all(false));
}

/// A joiner (child role `role`, its region named `prefix` and the step)
/// killed at each of `steps`, the creator's region made with `o`: the
/// creator's wait for every rank sees the joiner's bit if it died after
/// setting it (Mapped), else times out missing rank 1; no file is left
/// either way, before and after the creator drops.
fn joiner_killed_at_each_step(test: &str, role: &str, prefix: &str, steps: &[&str], o: &ShmOptions) {
    for &step in steps {
        let g = ShmGuard::new(&format!("{prefix}{}", step.to_lowercase()));
        let mut creator = Region::create(&g.name, mlayout(), 0, o).unwrap();
        assert_eq!(creator.mapped_ranks(), vec![0]);
        let mut child = ChildGuard::spawn_piped(test, &format!("{role}:{step}"), &g.name);
        assert_eq!(child.read_line("at "), format!("at {step}"));
        assert_killed(child.kill9());
        match (step, creator.wait_all_mapped(Duration::from_millis(300))) {
            // The joiner set the last bit and died before unlinking: the
            // creator sees COMPLETE and unlinks.
            ("Mapped", Ok(())) => assert_eq!(creator.mapped_ranks(), vec![0, 1]),
            (_, Err(RegionError::JoinTimeout { phase: JoinPhase::RanksToMap, missing, .. })) if step != "Mapped" => {
                assert_eq!(missing, vec![1], "{step}")
            }
            (_, other) => panic!("{step}: unexpected {other:?}"),
        }
        g.assert_gone();
        drop(creator);
        g.assert_gone();
    }
}

#[test]
fn region_multi_deferred_joiner_killed_at_each_step_leaves_no_file() {
    child_dispatch!();
    let test = "region_multi_deferred_joiner_killed_at_each_step_leaves_no_file";
    // With the reservation deferred the joiner passes no Reserving step:
    // files mapped, then its bit (Mapped) right after its pid word.
    let o = mopts(PATIENCE).defer_reserve(true).wait_for_all(false);
    joiner_killed_at_each_step(test, "mjoind", "d", &["FilesMapped", "Mapped"], &o);
}

#[test]
fn region_multi_deferred_rank_killed_while_pinning_leaves_no_file() {
    child_dispatch!();
    let test = "region_multi_deferred_rank_killed_while_pinning_leaves_no_file";
    // Killed while its pre-fault workers reserve and fault chunk 0, or
    // after registering two chunks: the files were unlinked at COMPLETE,
    // before either; the survivor's agreement sees the dead rank.
    for point in ["prefault", "registering"] {
        let g = ShmGuard::new(&format!("d{point}"));
        let mut child = ChildGuard::spawn_piped(test, &format!("mpind:{point}"), &g.name);
        let o = mopts(PATIENCE).defer_reserve(true);
        let region = kvoffload::internal::sync::Arc::new(Region::create(&g.name, mlayout(), 0, &o).unwrap());
        g.assert_gone();
        survivor_of_a_kill_while_pinning(&mut child, &region, point);
        g.assert_gone();
        drop(region);
        g.assert_gone();
    }
}

/// Rank 1 (`child`) killed once it reached a chunk of its pinning (at
/// `point`): rank 0's agreement over `region` sees the dead rank; it ends
/// pageable.
fn survivor_of_a_kill_while_pinning(
    child: &mut ChildGuard,
    region: &kvoffload::internal::sync::Arc<Region>,
    point: &str,
) {
    assert!(child.read_line("at ").starts_with("at chunk"));
    assert_killed(child.kill9());
    match pin_agreed(region, None) {
        Err(AgreementError::RankDied { rank: 1 }) => {}
        other => panic!("{point}: expected RankDied, got {other:?}"),
    }
}

#[test]
fn region_multi_rank_killed_while_pinning_or_transferring_leaves_no_file() {
    child_dispatch!();
    let test = "region_multi_rank_killed_while_pinning_or_transferring_leaves_no_file";
    for point in ["prefault", "registering", "pinned"] {
        let g = ShmGuard::new(point);
        let mut child = ChildGuard::spawn_piped(test, &format!("mpin:{point}"), &g.name);
        let region =
            kvoffload::internal::sync::Arc::new(Region::create(&g.name, mlayout(), 0, &mopts(PATIENCE)).unwrap());
        // Every rank mapped: the files went before any pinning started.
        g.assert_gone();
        if point == "pinned" {
            // Both ranks pin and agree; the child is killed afterwards, while
            // it would be transferring.
            let state = std::thread::scope(|s| {
                let h = s.spawn(|| pin_agreed(&region, None));
                assert_eq!(child.read_line("at "), "at pinned");
                h.join().unwrap()
            });
            assert_eq!(state.unwrap(), PinState::Pinned);
            assert_killed(child.kill9());
        } else {
            survivor_of_a_kill_while_pinning(&mut child, &region, point);
        }
        g.assert_gone();
        drop(region);
        g.assert_gone();
    }
}

// ---- a file system that fills up while the ranks reserve ----

/// In a private mount namespace: a 4 MiB tmpfs, a region of 2 ranks x 1 MiB
/// that fits when it is created; a filler then takes most of what is left,
/// so rank 1's reservation fails.
fn full_tmpfs_child() {
    let dir = std::env::temp_dir().join(format!("kvo-full-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "kvoffload-test"])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(st.success(), "mount tmpfs: {st}");
    let g = ShmGuard::in_dir("full", &dir);
    let mib = 1 << 20;
    let l = Layout::rank_major(2, page_size(), mib / page_size()).unwrap();
    let o = mopts(Duration::from_secs(5)).dir(&dir).check_memory(false);
    let mut creator = Region::create(&g.name, l, 0, &o.clone().wait_for_all(false)).unwrap();
    assert_eq!(g.files().len(), 1 + 2 * (mib / (2 * page_size())));
    // Rank 0's megabyte is reserved; about 3 MiB are left: take 2.5.
    std::fs::write(dir.join("filler"), vec![1u8; 5 * mib / 2]).unwrap();
    match Region::join(&g.name, l, 1, &o) {
        Err(e @ RegionError::ShmFull { .. }) => {
            let RegionError::ShmFull { ref path, needed, available } = e else { unreachable!() };
            assert!(path.starts_with(&dir), "{}", path.display());
            assert!(needed > available && needed <= mib as u64, "needed {needed}, available {available}");
            let msg = e.to_string();
            assert!(msg.contains(&needed.to_string()) && msg.contains(&available.to_string()), "{msg}");
        }
        other => panic!("expected ShmFull, got {other:?}"),
    }
    // The failing rank abandoned the region and removed every file.
    g.assert_gone();
    match creator.wait_all_mapped(Duration::from_secs(5)) {
        Err(RegionError::Abandoned { mapped, .. }) => assert_eq!(mapped, vec![0]),
        other => panic!("expected Abandoned, got {other:?}"),
    }
    drop(creator);
    g.assert_gone();
    std::fs::remove_file(dir.join("filler")).unwrap();
    let _ = std::process::Command::new("umount").arg(&dir).status();
    let _ = std::fs::remove_dir(&dir);
    println!("full-tmpfs: ok");
}

#[test]
fn region_multi_reserve_on_a_full_file_system_is_typed_and_leaves_no_file() {
    if std::env::var_os("KVOFFLOAD_FULL_TMPFS_CHILD").is_some() {
        return full_tmpfs_child();
    }
    // A tmpfs whose size the test sets needs a mount namespace of our own
    // (root, or user namespaces): re-run this test inside one.
    let ok = std::process::Command::new("unshare").args(["-m", "true"]).status().is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIPPED: cannot make a private mount namespace here (unshare -m); the full-tmpfs case did not run");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("unshare")
        .args(["-m", "--propagation", "private"])
        .arg(exe)
        .args(["region_multi_reserve_on_a_full_file_system_is_typed_and_leaves_no_file", "--exact", "--nocapture"])
        .env("KVOFFLOAD_FULL_TMPFS_CHILD", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("full-tmpfs: ok"), "child failed:\n{text}");
}
