//! The shared region is this user's alone: a joiner
//! never follows a link planted under a region file's name, and uses only
//! regular files owned by its own user with no group or other permission
//! bits (or, with `ShmOptions::allow_group`, group bits of that one
//! group). A refused file is a typed error naming it and what was wrong,
//! and is left exactly as it was: contents, mode, owner, times.
//!
//! The planted files are shaped so that a joiner without the check would
//! write to them: a header file of the exact size, all zeros (state Init),
//! is mapped by such a joiner, which then times out waiting for the
//! creator, marks it abandoned (a write) and unlinks it.

mod region_common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvoffload::{page_size, FileProblem, FileSplit, Layout, Region, RegionError};
use region_common::{opts, page_rows, small, write_private, ShmGuard, Snapshot, SPLITS};

/// Length of the header file of `l` split as `split` (few data files).
fn header_file_len(l: &Layout, split: FileSplit) -> usize {
    let h = 4096.max(page_size());
    match split {
        FileSplit::Single => l.data_bytes() + h,
        FileSplit::Multi { .. } => h,
    }
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A directory outside the region's, removed on drop: where planted links point.
struct Outside(PathBuf);

impl Outside {
    fn new(tag: &str) -> Outside {
        let d = std::env::temp_dir().join(region_common::unique_name(&format!("outside-{tag}")));
        std::fs::create_dir_all(&d).unwrap();
        Outside(d)
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[track_caller]
fn expect_untrusted(res: Result<Region, RegionError>, path: &Path, want: FileProblem) -> String {
    match res {
        Err(e @ RegionError::UntrustedFile { .. }) => {
            let RegionError::UntrustedFile { path: ref p, ref problem } = e else { unreachable!() };
            assert_eq!(p, path);
            assert_eq!(problem, &want);
            let msg = e.to_string();
            assert!(msg.contains(path.to_str().unwrap()), "{msg}");
            msg
        }
        other => panic!("expected UntrustedFile({want:?}) for {}, got {other:?}", path.display()),
    }
}

#[test]
fn region_joiner_never_follows_a_link_planted_under_the_header_name() {
    for split in SPLITS {
        let g = ShmGuard::new("link-header");
        let out = Outside::new("link-header");
        let l = small(2, 2);
        // The target: what a region header looks like before READY.
        let target = out.0.join("victim");
        write_private(&target, &vec![0u8; header_file_len(&l, split)]);
        std::os::unix::fs::symlink(&target, &g.path).unwrap();
        let (before, link_before) = (Snapshot::of(&target), Snapshot::of(&g.path));
        let res = Region::join(&g.name, l, 1, &opts(300).files(split));
        assert_eq!(Snapshot::of(&target), before, "{split:?}: the link's target was changed; join gave {res:?}");
        assert_eq!(Snapshot::of(&g.path), link_before, "{split:?}: the link was changed; join gave {res:?}");
        let msg = expect_untrusted(res, &g.path, FileProblem::Symlink);
        assert!(msg.contains("symbolic link"), "{msg}");
    }
}

#[test]
fn region_creator_never_writes_through_a_link_planted_under_its_names() {
    let out = Outside::new("link-create");
    let target = out.0.join("victim");
    write_private(&target, b"precious");
    let before = Snapshot::of(&target);
    let (p, l) = page_rows(1, 2);
    let o = opts(1000).files(FileSplit::Multi { max_file_bytes: p });
    // Under the header name, then under a data file's name: O_EXCL refuses
    // a link like any existing name.
    for k in [None, Some(1)] {
        let g = ShmGuard::new("link-create");
        let planted = k.map_or(g.path.clone(), |k| g.data_path(k));
        std::os::unix::fs::symlink(&target, &planted).unwrap();
        match Region::create(&g.name, l, 0, &o) {
            Err(RegionError::AlreadyExists { path }) => assert_eq!(path, planted),
            other => panic!("expected AlreadyExists, got {other:?}"),
        }
        assert_eq!(Snapshot::of(&target), before);
        // force removes the name (the link), never its target.
        let r = Region::create(&g.name, l, 0, &o.clone().force(true)).unwrap();
        g.assert_gone();
        drop(r);
        assert_eq!(Snapshot::of(&target), before);
    }
}

#[test]
fn region_joiner_never_follows_a_link_planted_under_a_data_file_name() {
    let g = ShmGuard::new("link-data");
    let out = Outside::new("link-data");
    let (p, l) = page_rows(2, 2);
    let o = opts(3000).files(FileSplit::Multi { max_file_bytes: p }).wait_for_all(false);
    let creator = Region::create(&g.name, l, 0, &o).unwrap();
    // Data file 2 (rank 1's first) is replaced by a link to a file of the same size.
    let target = out.0.join("victim");
    write_private(&target, &vec![0x5a; p]);
    std::fs::remove_file(g.data_path(2)).unwrap();
    std::os::unix::fs::symlink(&target, g.data_path(2)).unwrap();
    let (before, header_before) = (Snapshot::of(&target), std::fs::read(&g.path).unwrap());
    expect_untrusted(Region::join(&g.name, l, 1, &o), &g.data_path(2), FileProblem::Symlink);
    assert_eq!(Snapshot::of(&target), before, "the link's target was changed");
    // The region is abandoned with the joiner's note (issue 28: the creator
    // then fails at once with the reason), and nothing else is written to
    // the header (no pid claimed) and nothing removed.
    let mut header_after = std::fs::read(&g.path).unwrap();
    let word = |h: &[u8], off: usize| u64::from_ne_bytes(h[off..off + 8].try_into().unwrap());
    assert_eq!(word(&header_after, 64) >> 32, 3, "the join state is Abandoned");
    assert_eq!(word(&header_after, 96), (2u64 << 48) | (1 << 32) | 2, "the note: rank 1 refused data file 2");
    header_after[64..72].copy_from_slice(&header_before[64..72]);
    header_after[96..104].copy_from_slice(&header_before[96..104]);
    assert!(header_after == header_before, "the refused joiner wrote elsewhere in the header");
    assert_eq!(g.files().len(), 5);
    assert_eq!(creator.mapped_ranks(), vec![0]);
    drop(creator);
    // The creator removes its own files; the link is not one of them.
    let left = g.files();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].ends_with(".2"));
    assert_eq!(Snapshot::of(&target), before);
}

#[test]
fn region_joiner_refuses_a_fifo_or_a_directory_under_the_name() {
    let l = small(2, 1);
    // A FIFO of ours with mode 0600: only the file type is wrong.
    let g = ShmGuard::new("fifo");
    let st = std::process::Command::new("mkfifo").arg("-m").arg("600").arg(&g.path).status();
    if !st.is_ok_and(|s| s.success()) {
        println!("skipped the FIFO case: mkfifo failed");
    } else {
        let before = Snapshot::of(&g.path);
        expect_untrusted(Region::join(&g.name, l, 1, &opts(300)), &g.path, FileProblem::NotRegular { kind: "FIFO" });
        assert_eq!(Snapshot::of(&g.path), before);
        std::fs::remove_file(&g.path).unwrap();
    }
    let g = ShmGuard::new("dir");
    std::fs::create_dir(&g.path).unwrap();
    set_mode(&g.path, 0o700);
    let before = Snapshot::of(&g.path);
    let res = Region::join(&g.name, l, 1, &opts(300));
    assert_eq!(Snapshot::of(&g.path), before, "join gave {res:?}");
    std::fs::remove_dir(&g.path).unwrap();
    expect_untrusted(res, &g.path, FileProblem::NotRegular { kind: "directory" });
}

/// Makes `path` a file of `len` zero bytes, mode 0600, owned by uid and
/// gid 65534: created by that user through `setpriv` where it exists,
/// otherwise created by us and given away with `chown` (the same to
/// `fstat`). `Err(why)` when this process cannot do either.
fn foreign_file(path: &Path, len: usize) -> Result<&'static str, String> {
    if euid() != 0 {
        return Err(format!("not root (euid {}): cannot make a file of another user", euid()));
    }
    let setpriv = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c"])
        .arg("umask 077 && head -c \"$1\" /dev/zero > \"$2\"")
        .arg("sh")
        .arg(len.to_string())
        .arg(path)
        .status();
    if setpriv.is_ok_and(|s| s.success()) {
        return Ok("created by uid 65534 through setpriv");
    }
    let _ = std::fs::remove_file(path);
    write_private(path, &vec![0u8; len]);
    std::os::unix::fs::chown(path, Some(65534), Some(65534)).map_err(|e| format!("chown: {e}"))?;
    Ok("created by us, chowned to 65534")
}

#[test]
fn region_joiner_refuses_a_header_of_another_user() {
    for split in SPLITS {
        let g = ShmGuard::new("foreign");
        let l = small(2, 1);
        let how = match foreign_file(&g.path, header_file_len(&l, split)) {
            Ok(how) => how,
            Err(why) => {
                println!("skipped: {why}");
                return;
            }
        };
        let before = Snapshot::of(&g.path);
        assert_eq!((before.uid, before.mode & 0o777), (65534, 0o600), "{how}");
        let res = Region::join(&g.name, l, 1, &opts(300).files(split));
        assert!(g.listed(), "{split:?} ({how}): the file was removed; join gave {res:?}");
        assert_eq!(Snapshot::of(&g.path), before, "{split:?} ({how}): the file was changed; join gave {res:?}");
        let msg = expect_untrusted(
            res,
            &g.path,
            FileProblem::ForeignOwner { uid: 65534, euid: euid(), gid: 65534, allowed_group: None },
        );
        assert!(msg.contains("owned by uid 65534"), "{msg}");
        println!("{split:?}: refused a header {how}: {msg}");
    }
}

#[test]
fn region_joiner_refuses_a_data_file_of_another_user() {
    if euid() != 0 {
        println!("skipped: not root (euid {}): cannot give a file to another user", euid());
        return;
    }
    let g = ShmGuard::new("foreign-data");
    let (p, l) = page_rows(2, 2);
    let o = opts(3000).files(FileSplit::Multi { max_file_bytes: p }).wait_for_all(false);
    let creator = Region::create(&g.name, l, 0, &o).unwrap();
    std::os::unix::fs::chown(g.data_path(3), Some(65534), None).unwrap();
    let gid = Snapshot::of(&g.data_path(3)).gid;
    let before = Snapshot::of(&g.data_path(3));
    expect_untrusted(
        Region::join(&g.name, l, 1, &o),
        &g.data_path(3),
        FileProblem::ForeignOwner { uid: 65534, euid: euid(), gid, allowed_group: None },
    );
    assert_eq!(Snapshot::of(&g.data_path(3)), before);
    assert_eq!(g.files().len(), 5);
    drop(creator);
    g.assert_gone();
}

/// Rank `rank` joining a header file of ours for `l` and `split` whose mode
/// was set to `mode` after it was written: refused for `want`, the file
/// left listed and unchanged; the refusal's message.
fn join_refused_leaving_the_file(
    tag: &str,
    l: Layout,
    rank: usize,
    split: FileSplit,
    mode: u32,
    want: FileProblem,
) -> String {
    let g = ShmGuard::new(tag);
    write_private(&g.path, &vec![0u8; header_file_len(&l, split)]);
    set_mode(&g.path, mode);
    let before = Snapshot::of(&g.path);
    assert_eq!(before.mode & 0o7777, mode, "the test could not set the bits");
    let res = Region::join(&g.name, l, rank, &opts(300).files(split));
    assert!(g.listed(), "{split:?} {mode:o}: the file was removed; join gave {res:?}");
    assert_eq!(Snapshot::of(&g.path), before, "{split:?} {mode:o}: the file was changed; join gave {res:?}");
    expect_untrusted(res, &g.path, want)
}

#[test]
fn region_joiner_refuses_files_that_others_may_read_or_write() {
    for split in SPLITS {
        for mode in [0o666, 0o640, 0o604] {
            let problem = FileProblem::Mode { mode, allowed_group: None };
            let msg = join_refused_leaving_the_file("mode", small(2, 1), 1, split, mode, problem);
            assert!(msg.contains(&format!("mode {mode:#o} has group/other")), "{msg}");
        }
    }
    // A data file opened to everyone after the creator made it.
    let g = ShmGuard::new("mode-data");
    let (p, l) = page_rows(2, 2);
    let o = opts(3000).files(FileSplit::Multi { max_file_bytes: p }).wait_for_all(false);
    let creator = Region::create(&g.name, l, 0, &o).unwrap();
    set_mode(&g.data_path(0), 0o666);
    let before = Snapshot::of(&g.data_path(0));
    expect_untrusted(
        Region::join(&g.name, l, 1, &o),
        &g.data_path(0),
        FileProblem::Mode { mode: 0o666, allowed_group: None },
    );
    assert_eq!(Snapshot::of(&g.data_path(0)), before);
    drop(creator);
    g.assert_gone();
}

/// Issue 28, item 9: a file of ours with set-user-id, set-group-id or sticky
/// bits (which a creator refuses to make) is refused by a joiner and left
/// as it was, not joined and then removed.
#[test]
fn region_joiner_refuses_a_file_with_setuid_setgid_or_sticky_bits_and_leaves_it() {
    for split in SPLITS {
        for mode in [0o2600, 0o4600, 0o1600] {
            let problem = FileProblem::SpecialBits { mode };
            let msg = join_refused_leaving_the_file("special", small(1, 1), 0, split, mode, problem);
            assert!(msg.contains("set-user-id"), "{msg}");
        }
    }
}

/// A group to allow: 65534 when we are root (so it is not our own), our
/// effective gid otherwise (the creator must be a member).
fn a_group() -> u32 {
    if euid() == 0 {
        65534
    } else {
        rustix::process::getegid().as_raw()
    }
}

#[test]
fn region_an_allowed_group_shares_the_region_but_bits_for_others_never() {
    let grp = a_group();
    let (p, l) = page_rows(2, 2);
    let o = opts(3000).files(FileSplit::Multi { max_file_bytes: p }).wait_for_all(false);
    let og = o.clone().allow_group(grp);

    // The creator gives every file the group and mode 0660, whatever the umask.
    let g = ShmGuard::new("group");
    let creator = Region::create(&g.name, l, 0, &og).unwrap();
    for path in [g.path.clone(), g.data_path(0), g.data_path(3)] {
        let s = Snapshot::of(&path);
        assert_eq!((s.mode & 0o777, s.gid, s.uid), (0o660, grp, euid()), "{}", path.display());
    }
    // A joiner that allows no group refuses them...
    expect_untrusted(Region::join(&g.name, l, 1, &o), &g.path, FileProblem::Mode { mode: 0o660, allowed_group: None });
    // ...one that allows the group joins.
    let joiner = Region::join(&g.name, l, 1, &og).unwrap();
    let mut creator = creator;
    creator.wait_all_mapped(Duration::from_secs(3)).unwrap();
    g.assert_gone();
    drop((creator, joiner));

    // Bits for others are refused even of the allowed group's files.
    let g = ShmGuard::new("group-666");
    let creator = Region::create(&g.name, l, 0, &og).unwrap();
    set_mode(&g.path, 0o666);
    let before = Snapshot::of(&g.path);
    let msg = expect_untrusted(
        Region::join(&g.name, l, 1, &og),
        &g.path,
        FileProblem::Mode { mode: 0o666, allowed_group: Some(grp) },
    );
    assert!(msg.contains("0o666") && msg.contains("others"), "{msg}");
    assert_eq!(Snapshot::of(&g.path), before);
    drop(creator);
    g.assert_gone();

    // Group bits of another group are refused (root can give a file any group).
    if euid() == 0 {
        let g = ShmGuard::new("group-other");
        let creator = Region::create(&g.name, l, 0, &og).unwrap();
        std::os::unix::fs::chown(g.data_path(1), None, Some(0)).unwrap();
        // chown may clear bits on some systems: set the mode again.
        set_mode(&g.data_path(1), 0o660);
        let before = Snapshot::of(&g.data_path(1));
        expect_untrusted(
            Region::join(&g.name, l, 1, &og),
            &g.data_path(1),
            FileProblem::WrongGroup { mode: 0o660, gid: 0, allowed_group: grp },
        );
        assert_eq!(Snapshot::of(&g.data_path(1)), before);
        drop(creator);
        g.assert_gone();
    } else {
        println!("skipped the other-group case: not root");
    }
}

#[test]
fn region_creator_refuses_modes_that_joiners_would_refuse() {
    let l = small(1, 1);
    for (mode, grp) in [(0o660, None), (0o666, Some(a_group())), (0o644, None), (0o400, None)] {
        let g = ShmGuard::new("badmode");
        let mut o = opts(300).mode(mode);
        if let Some(grp) = grp {
            o = o.allow_group(grp);
        }
        match Region::create(&g.name, l, 0, &o) {
            Err(e @ RegionError::BadFileMode { .. }) => {
                assert!(e.to_string().contains(&format!("{mode:#o}")), "{e}")
            }
            other => panic!("{mode:o} {grp:?}: expected BadFileMode, got {other:?}"),
        }
        g.assert_gone();
    }
}

#[test]
fn region_joiner_cleaning_up_after_a_dead_creator_removes_only_files_it_would_trust() {
    // A creator died while creating data files: header in state Init with an
    // empty file table. An empty unrecorded data file is taken for one the
    // creator made only if this rank would have accepted it; its name and
    // emptiness alone prove nothing.
    let g = ShmGuard::new("cleanup-trust");
    let (p, l) = page_rows(2, 2);
    let split = FileSplit::Multi { max_file_bytes: p };
    write_private(&g.path, &vec![0u8; 4096.max(p)]);
    write_private(&g.data_path(0), b"");
    set_mode(&g.data_path(0), 0o666);
    write_private(&g.data_path(1), b"");
    let before = Snapshot::of(&g.data_path(0));
    match Region::join(&g.name, l, 1, &opts(200).files(split)) {
        Err(RegionError::JoinTimeout { .. }) => {}
        other => panic!("expected JoinTimeout, got {other:?}"),
    }
    let left = g.files();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].ends_with(".0"), "{left:?}");
    assert_eq!(Snapshot::of(&g.data_path(0)), before);
}
