//! Persistent regions (`Region::open_persistent`, `Region::remove_persistent`)
//! across real processes: the test binary re-executes itself
//! (`current_exe() <test> --exact`) with an env var naming the child role,
//! as `tests/region_procs.rs` does. A persistent region outlives every
//! handle and process; a later process opens it and reads what an earlier
//! one wrote; a half-made one of a creator killed at any step before
//! `Ready` is made again by the next opener, a live creator's is waited
//! for and never removed; removal never follows a link and removes nothing
//! unless every file passes. Synchronisation is by exit statuses, lines on
//! a child's stdout and bytes on its stdin, never by sleeping.

mod region_common;

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvoffload::internal::region::PersistentOrigin;
use kvoffload::{page_size, FileProblem, FileSplit, JoinPhase, Layout, Region, RegionError, ShmOptions, ShmStep};
use region_common::{block_on_stdin, child_role, write_private, ChildGuard, ShmGuard, Snapshot};

/// Long enough for anything that should happen on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(30);

/// 2 ranks, rank-major shares of 4 one-page chunks, data files of 2 pages:
/// files 0 and 1 are rank 0's, 2 and 3 rank 1's.
fn mlayout() -> Layout {
    Layout::rank_major(2, page_size(), 4).unwrap()
}

fn mopts(timeout: Duration) -> ShmOptions {
    ShmOptions::new().timeout(timeout).files(FileSplit::Multi { max_file_bytes: 2 * page_size() })
}

/// Header file and 4 data files.
const FILES: usize = 5;

fn fill(buf: &mut [u8], seed: u8) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = seed.wrapping_add((i % 251) as u8);
    }
}

/// Writes `seed`'s pattern (plus the chunk index) into every chunk of this rank.
fn write_share(r: &mut Region, seed: u8) {
    for c in 0..r.layout().num_rows() {
        fill(r.own_chunk_mut(c).unwrap(), seed.wrapping_add(c as u8));
    }
}

/// Asserts every chunk of `rank` holds `seed`'s pattern.
#[track_caller]
fn check_share(r: &Region, rank: usize, seed: u8) {
    let mut got = vec![0u8; page_size()];
    let mut want = vec![0u8; page_size()];
    for c in 0..r.layout().num_rows() {
        r.read_chunk(rank, c, 0, &mut got).unwrap();
        fill(&mut want, seed.wrapping_add(c as u8));
        assert!(got == want, "rank {rank}'s chunk {c} does not hold pattern {seed:#x}");
    }
}

/// The counter word at the start of the data area (rank 0's chunk 0).
fn counter(r: &Region) -> &AtomicU64 {
    // SAFETY: the data area is page aligned, at least 8 bytes, and lives as
    // long as the borrow of `r`; every process touches this word only
    // atomically.
    unsafe { &*(r.as_ptr() as *const AtomicU64) }
}

/// A step's name as the child roles spell it (`DataFileCreated1`, `Ready`).
fn step_name(s: ShmStep) -> String {
    match s {
        ShmStep::DataFileCreated { file } => format!("DataFileCreated{file}"),
        other => format!("{other:?}"),
    }
}

/// Options that stop this process at `step` (it prints `at <step>` and
/// blocks until a byte arrives on stdin or it is killed).
fn pause_at(o: ShmOptions, step: &str) -> ShmOptions {
    let step = step.to_string();
    o.observe(move |s| {
        if step_name(s) == step {
            println!("at {step}");
            let _ = std::io::stdout().flush();
            block_on_stdin();
        }
    })
}

fn origin(r: &Region) -> PersistentOrigin {
    r.persistent_origin().expect("a persistent region")
}

fn inode(path: &Path) -> u64 {
    std::fs::symlink_metadata(path).unwrap().ino()
}

/// Bytes the file system has allocated to `path`.
fn allocated(path: &Path) -> u64 {
    std::fs::symlink_metadata(path).unwrap().blocks() * 512
}

/// What a re-executed child does. Panics (non-zero exit) on any failure.
fn run_child(role: &str, name: &str) {
    match role {
        // Rank 0 creates the region, writes its share and exits.
        "write0" => {
            let mut r = Region::open_persistent(name, mlayout(), 0, &mopts(PATIENCE)).unwrap();
            assert_eq!(origin(&r), PersistentOrigin::Created);
            write_share(&mut r, 0xa0);
        }
        // A later rank 0: opens what exists, reads both shares.
        "read0" => {
            let r = Region::open_persistent(name, mlayout(), 0, &mopts(PATIENCE)).unwrap();
            assert_eq!(origin(&r), PersistentOrigin::Opened);
            check_share(&r, 0, 0xa0);
            check_share(&r, 1, 0xb0);
        }
        // A creator stopping at a step (killed there, or let go on).
        r if r.starts_with("create:") => {
            let o = pause_at(mopts(PATIENCE), &r["create:".len()..]);
            let mut r = Region::open_persistent(name, mlayout(), 0, &o).unwrap();
            assert_eq!(origin(&r), PersistentOrigin::Created);
            write_share(&mut r, 0xc0);
            println!("done");
        }
        // Waits for the start byte, then creates or opens as rank `rank`
        // and counts itself in the region.
        r if r.starts_with("race:") => {
            let rank: usize = r["race:".len()..].parse().unwrap();
            block_on_stdin();
            let r = Region::open_persistent(name, mlayout(), rank, &mopts(PATIENCE)).unwrap();
            counter(&r).fetch_add(1, Ordering::AcqRel);
            println!("origin={:?} ino={}", origin(&r), inode(r.path().unwrap()));
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

/// Removes `g`'s region with the library and checks nothing is left.
#[track_caller]
fn remove(g: &ShmGuard, o: &ShmOptions) {
    let listed = g.files();
    let removed = Region::remove_persistent(&g.name, o).unwrap();
    let mut names: Vec<String> =
        removed.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, listed, "removed other files than the region's");
    g.assert_gone();
}

#[test]
fn persistent_region_outlives_every_handle_and_reopens_in_this_process() {
    for (split, files) in [(FileSplit::Single, 1), (FileSplit::Multi { max_file_bytes: 2 * page_size() }, FILES)] {
        let g = ShmGuard::new("keep");
        let o = ShmOptions::new().timeout(PATIENCE).files(split);
        let mut r = Region::open_persistent(&g.name, mlayout(), 0, &o).unwrap();
        assert_eq!(origin(&r), PersistentOrigin::Created);
        write_share(&mut r, 0x10);
        // Nothing a create/join region does at the end removes it.
        r.wait_all_mapped(Duration::from_millis(1)).unwrap();
        assert!(!r.unlink_now().unwrap(), "{split:?}: unlink_now removed a persistent region");
        assert!(r.rank_slots().is_none() && r.rank_pids().is_none(), "no per-launch words offered");
        let before = inode(&g.path);
        drop(r);
        assert_eq!(g.files().len(), files, "{split:?}: files after the last handle dropped: {:?}", g.files());
        // Rank 1 opens it, reads rank 0's bytes and writes its own.
        let mut r1 = Region::open_persistent(&g.name, mlayout(), 1, &o).unwrap();
        assert_eq!(origin(&r1), PersistentOrigin::Opened);
        check_share(&r1, 0, 0x10);
        write_share(&mut r1, 0x20);
        drop(r1);
        let r0 = Region::open_persistent(&g.name, mlayout(), 0, &o).unwrap();
        assert_eq!(origin(&r0), PersistentOrigin::Opened);
        check_share(&r0, 0, 0x10);
        check_share(&r0, 1, 0x20);
        drop(r0);
        assert_eq!(inode(&g.path), before, "{split:?}: the region was made again");
        assert_eq!(g.files().len(), files, "{split:?}");
        let removed = Region::remove_persistent(&g.name, &o).unwrap();
        assert_eq!(removed.len(), files, "{removed:?}");
        assert_eq!(removed.last().unwrap(), &g.path, "the header file goes last");
        g.assert_gone();
        match Region::remove_persistent(&g.name, &o) {
            Err(RegionError::NoSuchRegion { path }) => assert_eq!(path, g.path),
            other => panic!("expected NoSuchRegion, got {other:?}"),
        }
    }
}

#[test]
fn persistent_region_written_by_exited_processes_is_read_by_later_ones() {
    child_dispatch!();
    let test = "persistent_region_written_by_exited_processes_is_read_by_later_ones";
    let g = ShmGuard::new("procs");
    let o = mopts(PATIENCE);
    let status = ChildGuard::spawn(test, "write0", &g.name).wait();
    assert!(status.success(), "the creating child failed: {status:?}");
    assert_eq!(g.files().len(), FILES, "files after the creator exited: {:?}", g.files());
    // Rank 0 reserved its own data files only.
    let len = 2 * page_size() as u64;
    for k in 0..4 {
        let want = if k < 2 { len } else { 0 };
        assert_eq!(allocated(&g.data_path(k)), want, "data file {k} after rank 0 created the region");
    }
    let mut r1 = Region::open_persistent(&g.name, mlayout(), 1, &o).unwrap();
    assert_eq!(origin(&r1), PersistentOrigin::Opened);
    check_share(&r1, 0, 0xa0);
    // Rank 1 reserved its share when it opened.
    assert_eq!(allocated(&g.data_path(2)), len);
    assert_eq!(allocated(&g.data_path(3)), len);
    write_share(&mut r1, 0xb0);
    drop(r1);
    let status = ChildGuard::spawn(test, "read0", &g.name).wait();
    assert!(status.success(), "the reading child failed: {status:?}");
    assert_eq!(g.files().len(), FILES);
    remove(&g, &o);
}

#[test]
fn persistent_region_refuses_a_mismatched_layout_naming_the_field() {
    let g = ShmGuard::new("mismatch");
    let p = page_size();
    let o = mopts(PATIENCE);
    let r = Region::open_persistent(&g.name, mlayout(), 0, &o).unwrap();
    drop(r);
    let header = Snapshot::of(&g.path);
    let cases: Vec<(Layout, ShmOptions, &str, u64, u64)> = vec![
        (Layout::rank_major(4, p, 2).unwrap(), o.clone(), "num_ranks", 4, 2),
        (Layout::rank_major(2, 2 * p, 2).unwrap(), o.clone(), "chunk_bytes", 2 * p as u64, p as u64),
        (Layout::rank_major(2, p, 6).unwrap(), o.clone(), "num_rows", 6, 4),
        (Layout::new(2, p, 4).unwrap(), o.clone(), "order", 0, 1),
        (mlayout(), o.clone().files(FileSplit::Single), "num_files", 0, 4),
        (mlayout(), o.clone().session(7), "session", 7, 0),
    ];
    for (l, o2, field, expected, found) in cases {
        match Region::open_persistent(&g.name, l, 0, &o2) {
            Err(e @ RegionError::BadHeader { .. }) => {
                let RegionError::BadHeader { field: f, expected: x, found: y, ref path } = e else { unreachable!() };
                assert_eq!((f, x, y), (field, expected, found), "{e}");
                assert_eq!(path, &g.path);
                assert!(e.to_string().contains(field), "{e}");
            }
            other => panic!("{field}: expected BadHeader, got {other:?}"),
        }
        assert_eq!(g.files().len(), FILES, "{field}: a refused opener removed files");
    }
    assert_eq!(Snapshot::of(&g.path), header, "a refused opener changed the header file");
    // The create/join protocol does not take it either, nor leave it.
    match Region::join(&g.name, mlayout(), 1, &o) {
        Err(RegionError::BadHeader { field: "magic", .. }) => {}
        other => panic!("join: expected BadHeader(magic), got {other:?}"),
    }
    assert!(matches!(Region::create(&g.name, mlayout(), 0, &o), Err(RegionError::AlreadyExists { .. })));
    assert_eq!(g.files().len(), FILES);
    let r = Region::open_persistent(&g.name, mlayout(), 1, &o).unwrap();
    assert_eq!(origin(&r), PersistentOrigin::Opened);
    drop(r);
    remove(&g, &o);

    // A create/join region of the name is not opened as a persistent one,
    // nor removed by the persistent removal.
    let g = ShmGuard::new("mismatch-join");
    let c = Region::create(&g.name, mlayout(), 0, &o.clone().wait_for_all(false)).unwrap();
    for res in [
        Region::open_persistent(&g.name, mlayout(), 1, &o).map(|_| ()),
        Region::remove_persistent(&g.name, &o).map(|_| ()),
    ] {
        match res {
            Err(RegionError::BadHeader { field: "magic", found, .. }) => {
                assert_eq!(found, u64::from_le_bytes(*b"KVOFLREG"))
            }
            other => panic!("expected BadHeader(magic), got {other:?}"),
        }
        assert_eq!(g.files().len(), FILES);
    }
    drop(c);
    g.assert_gone();
}

#[track_caller]
fn assert_killed(status: std::process::ExitStatus) {
    assert_eq!(status.signal(), Some(libc::SIGKILL), "child status {status:?}");
}

#[test]
fn persistent_region_half_made_by_a_killed_creator_is_made_again() {
    child_dispatch!();
    let test = "persistent_region_half_made_by_a_killed_creator_is_made_again";
    let o = mopts(PATIENCE);
    // Before `Ready` (made again), then after it (kept): the creator
    // reserves its share once it has published, as any opener does.
    for (step, files) in [
        ("HeaderCreated", 1),
        ("DataFileCreated0", 2),
        ("DataFileCreated3", FILES),
        ("Ready", FILES),
        ("Reserving", FILES),
        ("Reserved", FILES),
    ] {
        let g = ShmGuard::new(&step.to_lowercase());
        let mut child = ChildGuard::spawn_piped(test, &format!("create:{step}"), &g.name);
        assert_eq!(child.read_line("at "), format!("at {step}"));
        assert_eq!(g.files().len(), files, "{step}: {:?}", g.files());
        let before = inode(&g.path);
        assert_killed(child.kill9());
        // Well within the timeout: the lock, not the clock, tells that the
        // creator is gone.
        let t = Instant::now();
        let mut r = Region::open_persistent(&g.name, mlayout(), 1, &o).unwrap();
        assert!(t.elapsed() < PATIENCE / 3, "{step}: took {:?}", t.elapsed());
        if matches!(step, "Ready" | "Reserving" | "Reserved") {
            // Killed after publishing: the region is whole and kept.
            assert_eq!(origin(&r), PersistentOrigin::Opened, "{step}");
            assert_eq!(inode(&g.path), before, "{step}: a whole region was made again");
        } else {
            assert_eq!(origin(&r), PersistentOrigin::Created, "{step}: the half-made region was not made again");
            assert_ne!(inode(&g.path), before, "{step}");
        }
        assert_eq!(g.files().len(), FILES, "{step}");
        write_share(&mut r, 0x30);
        check_share(&r, 1, 0x30);
        drop(r);
        if step == "Reserving" {
            // Killed before reserving its share: the next rank 0 does.
            assert_eq!(allocated(&g.data_path(0)), 0, "{step}");
            let r0 = Region::open_persistent(&g.name, mlayout(), 0, &o).unwrap();
            assert_eq!(origin(&r0), PersistentOrigin::Opened);
            assert_eq!(allocated(&g.data_path(0)), 2 * page_size() as u64, "{step}: rank 0's share not reserved");
        }
        remove(&g, &o);
    }
}

#[test]
fn persistent_region_being_made_by_a_live_creator_is_waited_for_never_removed() {
    child_dispatch!();
    let test = "persistent_region_being_made_by_a_live_creator_is_waited_for_never_removed";
    let g = ShmGuard::new("live");
    let mut child = ChildGuard::spawn_piped(test, "create:DataFileCreated0", &g.name);
    assert_eq!(child.read_line("at "), "at DataFileCreated0");
    let before = inode(&g.path);
    // The opener times out waiting for the creator and leaves its files.
    match Region::open_persistent(&g.name, mlayout(), 1, &mopts(Duration::from_millis(300))) {
        Err(RegionError::JoinTimeout { phase: JoinPhase::CreatorToInitialise, .. }) => {}
        other => panic!("expected JoinTimeout(CreatorToInitialise), got {other:?}"),
    }
    // Interrupted likewise, and removal waits for the lock and gives up.
    match Region::open_persistent(&g.name, mlayout(), 1, &mopts(PATIENCE).interrupt(|| true)) {
        Err(RegionError::Interrupted { phase: JoinPhase::CreatorToInitialise, .. }) => {}
        other => panic!("expected Interrupted, got {other:?}"),
    }
    match Region::remove_persistent(&g.name, &mopts(Duration::from_millis(300))) {
        Err(RegionError::PersistentBusy { path, .. }) => assert_eq!(path, g.path),
        other => panic!("expected PersistentBusy, got {other:?}"),
    }
    // A create/join rank of the same name refuses it at once (its timeout
    // would abandon the region and remove the creator's files).
    match Region::join(&g.name, mlayout(), 1, &mopts(Duration::from_millis(300))) {
        Err(RegionError::BadHeader { field: "magic", .. }) => {}
        other => panic!("join: expected BadHeader(magic), got {other:?}"),
    }
    assert_eq!((g.files().len(), inode(&g.path)), (2, before), "a live creator's files were touched");
    // An opener waiting while the creator goes on gets the creator's region.
    let opened = std::thread::scope(|s| {
        let h = s.spawn(|| Region::open_persistent(&g.name, mlayout(), 1, &mopts(PATIENCE)));
        child.child.as_mut().unwrap().stdin.as_mut().unwrap().write_all(b"g").unwrap();
        h.join().unwrap()
    });
    let r = opened.unwrap();
    assert_eq!(origin(&r), PersistentOrigin::Opened);
    assert_eq!(child.read_line("done"), "done");
    check_share(&r, 0, 0xc0);
    assert_eq!(inode(&g.path), before);
    drop(r);
    drop(child);
    remove(&g, &mopts(PATIENCE));
}

#[test]
fn persistent_region_header_of_unknown_maker_is_removed_only_after_the_timeout() {
    // Shorter than a page (never sized), or a page of zeros (sized, no
    // magic): no creator's lock to judge by.
    for len in [0, page_size()] {
        let g = ShmGuard::new("unknown");
        write_private(&g.path, &vec![0u8; len]);
        let timeout = Duration::from_millis(300);
        let t = Instant::now();
        let r = Region::open_persistent(&g.name, mlayout(), 0, &mopts(timeout)).unwrap();
        assert!(t.elapsed() >= timeout, "{len}: removed after {:?}, before the timeout", t.elapsed());
        assert_eq!(origin(&r), PersistentOrigin::Created);
        assert_eq!(g.files().len(), FILES);
        drop(r);
        remove(&g, &mopts(PATIENCE));
    }
}

#[test]
fn persistent_region_racing_processes_end_up_on_one_region() {
    child_dispatch!();
    let test = "persistent_region_racing_processes_end_up_on_one_region";
    for round in 0..4 {
        let g = ShmGuard::new(&format!("race{round}"));
        let n = 4;
        let mut kids: Vec<ChildGuard> =
            (0..n).map(|i| ChildGuard::spawn_piped(test, &format!("race:{}", i % 2), &g.name)).collect();
        for k in &mut kids {
            k.child.as_mut().unwrap().stdin.as_mut().unwrap().write_all(b"g").unwrap();
        }
        let lines: Vec<String> = kids.iter_mut().map(|k| k.read_line("origin=")).collect();
        for k in &mut kids {
            let s = k.wait();
            assert!(s.success(), "round {round}: a racer failed: {s:?}");
        }
        let created = lines.iter().filter(|l| l.starts_with("origin=Created")).count();
        assert_eq!(created, 1, "round {round}: {lines:?}");
        let ino = format!("ino={}", inode(&g.path));
        assert!(lines.iter().all(|l| l.ends_with(&ino)), "round {round}: two regions ({ino}): {lines:?}");
        let r = Region::open_persistent(&g.name, mlayout(), 0, &mopts(PATIENCE)).unwrap();
        assert_eq!(counter(&r).load(Ordering::Acquire), n as u64, "round {round}: not every racer counted here");
        drop(r);
        remove(&g, &mopts(PATIENCE));
    }
}

/// A region made and left by this process, for the removal tests.
fn made(tag: &str) -> ShmGuard {
    let g = ShmGuard::new(tag);
    drop(Region::open_persistent(&g.name, mlayout(), 0, &mopts(PATIENCE)).unwrap());
    assert_eq!(g.files().len(), FILES);
    g
}

#[track_caller]
fn expect_untrusted(res: Result<Vec<std::path::PathBuf>, RegionError>, path: &Path, want: FileProblem) {
    match res {
        Err(RegionError::UntrustedFile { path: p, problem }) => {
            assert_eq!((p.as_path(), problem), (path, want));
        }
        other => panic!("expected UntrustedFile({want:?}) for {}, got {other:?}", path.display()),
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn persistent_region_removal_refuses_links_foreign_modes_and_other_inodes() {
    let o = mopts(PATIENCE);
    let outside = std::env::temp_dir().join(region_common::unique_name("outside"));
    std::fs::create_dir_all(&outside).unwrap();
    let victim = outside.join("victim");
    write_private(&victim, b"precious");
    let precious = Snapshot::of(&victim);

    // A link under the header's name: refused, link and target kept.
    let g = ShmGuard::new("rm-link");
    std::os::unix::fs::symlink(&victim, &g.path).unwrap();
    expect_untrusted(Region::remove_persistent(&g.name, &o), &g.path, FileProblem::Symlink);
    assert!(g.listed() && Snapshot::of(&victim) == precious);
    drop(g);

    // A data file replaced by a link: refused, nothing removed.
    let g = made("rm-datalink");
    std::fs::remove_file(g.data_path(1)).unwrap();
    std::os::unix::fs::symlink(&victim, g.data_path(1)).unwrap();
    expect_untrusted(Region::remove_persistent(&g.name, &o), &g.data_path(1), FileProblem::Symlink);
    assert_eq!(g.files().len(), FILES, "removed something though a file was refused");
    assert!(Snapshot::of(&victim) == precious);
    drop(g);

    // A data file (then the header) that others may read: refused, nothing
    // removed; once put right, removed.
    let g = made("rm-mode");
    for path in [g.data_path(2), g.path.clone()] {
        set_mode(&path, 0o644);
        expect_untrusted(
            Region::remove_persistent(&g.name, &o),
            &path,
            FileProblem::Mode { mode: 0o644, allowed_group: None },
        );
        assert_eq!(g.files().len(), FILES, "removed something though {} was refused", path.display());
        set_mode(&path, 0o600);
    }
    remove(&g, &o);

    // A data file that is not the one the header records (another inode).
    let g = made("rm-inode");
    std::fs::remove_file(g.data_path(3)).unwrap();
    write_private(&g.data_path(3), &vec![0u8; 2 * page_size()]);
    match Region::remove_persistent(&g.name, &o) {
        Err(RegionError::BadHeader { field: "data file inode", path, .. }) => assert_eq!(path, g.data_path(3)),
        other => panic!("expected BadHeader(data file inode), got {other:?}"),
    }
    assert_eq!(g.files().len(), FILES);
    drop(g);
    let _ = std::fs::remove_dir_all(&outside);
}
