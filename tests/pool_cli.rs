//! `kvoffload pool ls | rm` (design 1.4) on pools made by the library in a
//! private /dev/shm directory: what `ls` shows of slots, engines and the
//! fingerprint, and `rm` refusing a pool in use (exit 1, naming the entry
//! and its pid), an untrusted file of it, or a name of another pool's file,
//! then removing the index and region files and nothing else; `ls
//! --reclaim` freeing the entry of an engine (a child process) killed with
//! its marks, which plain `ls` reports dead and leaves.

mod pool_common;
mod region_common;

use std::process::Command;
use std::time::Duration;

use kvoffload::internal::pool::closing::PoolWord;
use kvoffload::internal::pool::engines::{worker, MembersWord, OwnerState, OwnerWord, SCHEDULER};
use kvoffload::internal::pool::file::liveness::{member_of, member_of_self};
use kvoffload::internal::pool::file::{PoolFile, PoolOptions, PublishNote, Wait};
use kvoffload::internal::pool::fingerprint::HashingRecord;
use kvoffload::internal::pool::slot::SlotWord;
use kvoffload::internal::pool::table::{Lookup, Placement, PoolTable};
use kvoffload::internal::pool::words::{Key, PoolWords};
use pool_common::{spec, ChildLines, ShmDir};
use region_common::{block_on_stdin, child_role, write_private, ChildGuard};

const PATIENCE: Duration = Duration::from_secs(20);

fn kvoffload(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvoffload")).args(args).output().expect("run kvoffload");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Registers process `pid` as engine `e`'s scheduler (owner LIVE by it).
fn register(p: &PoolFile, e: u8, pid: u32) {
    let w = p.words();
    let rec = member_of(pid).unwrap();
    w.member_store(e, 0, &rec);
    let owner = OwnerWord { state: OwnerState::Live, generation: 1, pid }.encode();
    assert_eq!(w.owner_cas(e, 0, owner), Ok(0));
    assert_eq!(w.members_cas(e, 0, MembersWord { mask: 1, generation: 0 }.encode()), Ok(0));
}

/// A pool "node" with one slot held, one being written, one engine alive
/// (a `sleep` child, returned) and one whose member exited.
fn busy_pool(d: &ShmDir) -> (PoolFile, std::process::Child) {
    let p = PoolFile::create("node", &spec(), &d.opts()).unwrap();
    let w = p.words();
    assert!(w.slot_cas(0, 0, SlotWord::readable(1, 0b10).encode()).is_ok());
    assert!(w.slot_cas(1, 0, SlotWord::writing(1, 1, 0b1).encode()).is_ok());
    w.publish_store(0, PublishNote { engine: 1, unix_ms: 1_700_000_000_000 });
    let h = HashingRecord::new("sha256", &[1; 32], None).unwrap();
    p.ensure_hashing(&h, Wait::new(Duration::from_secs(5))).unwrap();
    let live = Command::new("sleep").arg("60").spawn().unwrap();
    register(&p, 1, live.id());
    let mut dead = Command::new("sleep").arg("60").spawn().unwrap();
    register(&p, 2, dead.id());
    dead.kill().unwrap();
    dead.wait().unwrap();
    (p, live)
}

#[test]
fn ls_shows_each_pools_shape_fingerprint_slots_and_engines() {
    let d = ShmDir::new("ls");
    let dir = d.path().to_str().unwrap();
    let (code, out, _) = kvoffload(&["pool", "ls", "--dir", dir]);
    assert_eq!(code, 0);
    assert!(out.contains("no kvoffload pools"), "{out}");
    let (_p, mut live) = busy_pool(&d);
    let (code, out, err) = kvoffload(&["pool", "ls", "--dir", dir]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 1, "{out}");
    for want in [
        "node  ready (2 registered)",
        "64 slots (4 sets x 16 ways)",
        "2 ranks x 256 KiB a row",
        "model meta-llama/Llama-3.1-8B-Instruct  dtype bfloat16  block 16,32  world 2  hash sha256",
        "slots free 62 writing 1 readable 1 held 1",
        "engines live 1 sweeping 0 dead 1",
        "last store 2023-11-14T22:13:20Z",
        &format!("(engine 1 (pids {}))", live.id()),
    ] {
        assert!(out.contains(want), "{want:?} not in {out}");
    }
    let (code, out, _) = kvoffload(&["pool", "ls", "--dir", dir, "--json"]);
    assert_eq!(code, 0);
    for want in [
        "\"name\":\"node\"",
        "\"tokens_per_block\":[16,32]",
        "\"hash\":\"sha256\"",
        "\"free\":62,\"writing\":1,\"readable\":1,\"held\":1,\"corrupt\":0",
        &format!(
            "\"engines_live\":[{{\"index\":1,\"pids\":[{}]}}],\"engines_sweeping\":0,\"engines_dead\":1",
            live.id()
        ),
    ] {
        assert!(out.contains(want), "{want:?} not in {out}");
    }
    live.kill().unwrap();
    live.wait().unwrap();
    let (_, out, _) = kvoffload(&["pool", "ls", "--dir", dir]);
    assert!(out.contains("engines live 0 sweeping 0 dead 2"), "{out}");
}

#[test]
fn ls_reports_a_file_it_must_not_read_and_goes_on() {
    use std::os::unix::fs::PermissionsExt;
    let d = ShmDir::new("ls-bad");
    PoolFile::create("good", &spec(), &d.opts()).unwrap();
    let bad = d.index("bad");
    write_private(&bad, &[0u8; 4096]);
    std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (code, out, _) = kvoffload(&["pool", "ls", "--dir", d.path().to_str().unwrap()]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[0].starts_with("bad  unreadable: refusing") && lines[0].contains("mode 0o666"), "{out}");
    assert!(lines[1].starts_with("good  ready"), "{out}");
    assert_eq!(std::fs::metadata(&bad).unwrap().permissions().mode() & 0o777, 0o666, "left alone");
}

/// The rows' region of pool "node" (a persistent region: data files 0 and
/// 1 and the header, made by `Region::open_persistent` and dropped: its
/// files stay), and a file of pool "nodex" beside them.
fn region_files(d: &ShmDir) {
    use kvoffload::internal::region::{FileSplit, Layout, Region, ShmOptions};
    let page = rustix::param::page_size();
    let layout = Layout::rank_major(1, page, 4).unwrap();
    let opts = ShmOptions::new().dir(d.path()).files(FileSplit::Multi { max_file_bytes: 2 * page });
    drop(Region::open_persistent("pool-node", layout, 0, &opts).unwrap());
    write_private(&d.path().join("kvoffload-pool-nodex.0"), b"rows");
}

#[test]
fn rm_refuses_a_pool_in_use_then_removes_its_index_and_region_files_only() {
    let d = ShmDir::new("rm");
    let dir = d.path().to_str().unwrap();
    let (p, mut live) = busy_pool(&d);
    drop(p);
    region_files(&d);
    let before = d.names();
    let (code, out, err) = kvoffload(&["pool", "rm", "node", "--dir", dir]);
    assert_eq!(code, 1, "{out}{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains(&format!("in use by engine 1 (pids {})", live.id())) && err.contains("--force"), "{err}");
    assert_eq!(d.names(), before, "nothing removed");
    live.kill().unwrap();
    live.wait().unwrap();
    let (code, out, err) = kvoffload(&["pool", "rm", "node", "--dir", dir]);
    assert_eq!(code, 0, "{err}");
    let removed: Vec<&str> = out.lines().collect();
    assert_eq!(removed.len(), 4, "{out}");
    assert!(
        removed[0].ends_with("kvoffload-pool-node.0") && removed[3].ends_with("kvoffload-pool-node.index"),
        "{out}"
    );
    assert_eq!(d.names(), ["kvoffload-pool-nodex.0"], "another pool's file stays");
    let (code, _, err) = kvoffload(&["pool", "rm", "node", "--dir", dir]);
    assert_eq!(code, 2);
    assert!(err.contains("no kvoffload pool \"node\""), "{err}");
}

#[test]
fn rm_force_removes_a_pool_in_use() {
    let d = ShmDir::new("rm-force");
    let (_p, mut live) = busy_pool(&d);
    let (code, out, err) = kvoffload(&["pool", "rm", "node", "--dir", d.path().to_str().unwrap(), "--force"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("removed while in use by engine 1") && out.contains("removed "), "{out}{err}");
    assert!(d.names().is_empty(), "{:?}", d.names());
    live.kill().unwrap();
    live.wait().unwrap();
}

/// Pool "node" with its region files, its word set to `word` by a closer
/// that is gone (pid 999,999, whose closer lock nobody holds).
fn closing_pool(d: &ShmDir, removing: bool) {
    let p = PoolFile::create("node", &spec(), &d.opts()).unwrap();
    region_files(d);
    let found = p.pool_word_cas(PoolWord::READY, PoolWord::closing(999_999, removing));
    assert_eq!(found, Ok(PoolWord::READY));
}

/// A remover killed midway (the pool word final, `REMOVING`, its closer lock
/// free, the files still there): `pool rm` finishes the removal, and so
/// does an engine opening the pool, which then makes a fresh one.
#[test]
fn a_removal_whose_remover_is_gone_is_finished_by_rm_or_the_next_opener() {
    let d = ShmDir::new("rm-gone-remover");
    closing_pool(&d, true);
    let (_, out, _) = kvoffload(&["pool", "ls", "--dir", d.path().to_str().unwrap()]);
    assert!(out.contains("node  being removed (by pid 999999)"), "{out}");
    let (code, out, err) = kvoffload(&["pool", "rm", "node", "--dir", d.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(out.lines().count(), 4, "the region's 3 files and the index: {out}");
    assert_eq!(d.names(), ["kvoffload-pool-nodex.0"]);
    let d = ShmDir::new("open-gone-remover");
    closing_pool(&d, true);
    let old = std::fs::metadata(d.path().join("kvoffload-pool-node.index")).unwrap();
    let (p, created) = PoolFile::open_or_create("node", &spec(), &d.opts(), Wait::new(PATIENCE)).unwrap();
    assert!(created, "a fresh pool");
    assert_eq!(p.pool_word(), PoolWord::READY);
    use std::os::unix::fs::MetadataExt;
    let new = std::fs::metadata(d.path().join("kvoffload-pool-node.index")).unwrap();
    assert_ne!(new.ino(), old.ino(), "another index file");
    assert_eq!(d.names(), ["kvoffload-pool-node.index", "kvoffload-pool-nodex.0"], "the old region removed");
}

/// A closer killed while it decided (`CLOSING`, tentative) removed nothing:
/// a joiner undoes its word and joins the pool as it is.
#[test]
fn a_tentative_close_whose_closer_is_gone_is_undone_by_a_joiner() {
    let d = ShmDir::new("join-gone-closer");
    closing_pool(&d, false);
    let (p, created) = PoolFile::open_or_create("node", &spec(), &d.opts(), Wait::new(PATIENCE)).unwrap();
    assert!(!created, "the same pool");
    let t = PoolTable::new(p.words());
    let me = member_of_self().unwrap();
    let lease = t.join_owner(worker(0), &me, &[7; 4]).unwrap();
    assert_eq!(p.pool_word(), PoolWord::READY, "undone");
    t.leave(lease, worker(0), &me).unwrap();
}

/// The close of an engine that leaves a pool not kept
/// (`PoolFile::close_and_remove` without force): refused while another
/// engine is registered (the word back to `READY`), done once it left.
#[test]
fn the_last_engine_to_leave_removes_the_pool_and_not_before() {
    use kvoffload::internal::pool::file::admin::Closed;
    let d = ShmDir::new("close-last");
    let p = PoolFile::create("node", &spec(), &d.opts()).unwrap();
    region_files(&d);
    let t = PoolTable::new(p.words());
    let me = member_of_self().unwrap();
    let a = t.join_owner(worker(0), &me, &[1; 4]).unwrap();
    let b = t.join_owner(worker(0), &me, &[2; 4]).unwrap();
    t.leave(a, worker(0), &me).unwrap();
    match p.close_and_remove(false, Wait::new(PATIENCE)).unwrap() {
        Closed::InUse(entries) => assert_eq!(entries.len(), 1, "{entries:?}"),
        other => panic!("closed with engine {} registered: {other:?}", b.engine),
    }
    assert_eq!(p.pool_word(), PoolWord::READY, "the pool stays");
    assert_eq!(d.names().len(), 5, "{:?}", d.names());
    t.leave(b, worker(0), &me).unwrap();
    match p.close_and_remove(false, Wait::new(PATIENCE)).unwrap() {
        Closed::Removed(r) => assert_eq!(r.files.len(), 4, "{r:?}"),
        other => panic!("not removed with no engine left: {other:?}"),
    }
    assert_eq!(d.names(), ["kvoffload-pool-nodex.0"]);
    let e = t.join_owner(worker(0), &me, &[3; 4]).unwrap_err();
    assert!(e.to_string().contains("being removed"), "a late joiner of the removed pool is refused: {e}");
}

#[test]
fn rm_refuses_an_untrusted_file_of_the_pool_before_removing_anything() {
    use std::os::unix::fs::PermissionsExt;
    let d = ShmDir::new("rm-untrusted");
    PoolFile::create("node", &spec(), &d.opts()).unwrap();
    region_files(&d);
    let data = d.path().join("kvoffload-pool-node.1");
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o644)).unwrap();
    let before = d.names();
    let (code, _, err) = kvoffload(&["pool", "rm", "node", "--dir", d.path().to_str().unwrap(), "--force"]);
    assert_eq!(code, 2);
    assert!(err.contains("kvoffload-pool-node.1") && err.contains("mode 0o644"), "{err}");
    assert_eq!(d.names(), before, "nothing removed");
    // A link under a data file's name is refused the same way, never followed.
    std::fs::remove_file(&data).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", &data).unwrap();
    let (code, _, err) = kvoffload(&["pool", "rm", "node", "--dir", d.path().to_str().unwrap(), "--force"]);
    assert_eq!(code, 2);
    assert!(err.contains("symbolic link"), "{err}");
    assert_eq!(d.names(), before);
    // Refused before anything went, the pool is as it was (`pool::closing`
    // rule 5): ready, and an engine joins it, never stuck "being removed".
    let (code, out, _) = kvoffload(&["pool", "ls", "--dir", d.path().to_str().unwrap()]);
    assert!(code == 0 && out.contains("ready"), "{out}");
    let p = PoolFile::open("node", &PoolOptions::in_dir(d.path()), Wait::new(PATIENCE)).unwrap();
    let t = PoolTable::new(p.words());
    let me = member_of_self().unwrap();
    let lease = t.join_owner(worker(0), &me, &[5; 4]).unwrap();
    t.leave(lease, worker(0), &me).unwrap();
}

#[test]
fn rm_refuses_names_of_another_pools_files() {
    for name in ["node.0", "node.index", "a/b", ""] {
        let (code, _, err) = kvoffload(&["pool", "rm", name]);
        assert_eq!(code, 2, "{name:?}");
        assert!(err.contains("bad pool name"), "{name:?}: {err}");
    }
}

/// The entry of the child engine (does nothing when run as a test): it
/// joins pool "node" of the directory it is given (owner and scheduler),
/// holds the parent's key, claims one of its own, says so and blocks.
#[test]
fn pool_cli_child() {
    let Some((role, dir)) = child_role() else { return };
    assert_eq!(role, "engine");
    let p = PoolFile::open("node", &PoolOptions::in_dir(dir), Wait::new(PATIENCE)).unwrap();
    let t = PoolTable::new(p.words());
    let me = member_of_self().unwrap();
    let lease = t.join_owner(worker(0), &me, &[7; 4]).unwrap();
    assert_eq!(t.join_member(SCHEDULER, &me, &[7; 4]).unwrap(), Some(lease));
    assert!(matches!(t.lookup(lease.engine, &Key::new(b"parent", 0).unwrap()).unwrap(), Lookup::Hit { .. }));
    assert!(matches!(t.claim(lease.engine, &Key::new(b"child", 0).unwrap()).unwrap(), Placement::Claimed { .. }));
    use std::io::Write;
    println!("engine {}", lease.engine);
    let _ = std::io::stdout().flush();
    block_on_stdin();
}

#[test]
fn ls_reports_a_killed_engine_dead_and_ls_reclaim_frees_it() {
    let d = ShmDir::new("reclaim");
    let dir = d.path().to_str().unwrap();
    let p = PoolFile::create("node", &spec(), &d.opts()).unwrap();
    // The parent is a live engine with a published key.
    let t = PoolTable::new(p.words());
    let me = member_of_self().unwrap();
    let lease = t.join_owner(worker(0), &me, &[1; 4]).unwrap();
    let Placement::Claimed { slot, epoch, .. } = t.claim(lease.engine, &Key::new(b"parent", 0).unwrap()).unwrap()
    else {
        panic!("not claimed")
    };
    assert!(!t.complete_rank(lease.engine, slot, epoch, 0).unwrap());
    assert!(t.complete_rank(lease.engine, slot, epoch, 1).unwrap());
    let mut child = ChildGuard::spawn_piped("pool_cli_child", "engine", dir);
    let lines = ChildLines::new(child.child.as_mut().unwrap().stdout.take().unwrap());
    let e: u8 = lines.expect("engine ", PATIENCE)["engine ".len()..].parse().unwrap();
    assert_ne!(e, lease.engine);
    let (code, out, err) = kvoffload(&["pool", "ls", "--dir", dir]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("engines live 2 sweeping 0 dead 0"), "{out}");
    child.kill9();
    // Killed: plain ls reports it dead, and writes nothing.
    let before = std::fs::read(d.index("node")).unwrap();
    let (code, out, err) = kvoffload(&["pool", "ls", "--dir", dir]);
    assert_eq!(code, 0, "{err}");
    for want in ["slots free 62 writing 1 readable 1 held 1", "engines live 1 sweeping 0 dead 1"] {
        assert!(out.contains(want), "{want:?} not in {out}");
    }
    assert!(!out.contains("reclaimed"), "{out}");
    assert!(std::fs::read(d.index("node")).unwrap() == before, "ls wrote the index");
    // --reclaim sweeps it: its hold dropped, its write freed, its entry FREE.
    let (code, out, err) = kvoffload(&["pool", "ls", "--dir", dir, "--reclaim"]);
    assert_eq!(code, 0, "{err}");
    for want in [
        &format!("reclaimed engines {e}") as &str,
        "slots free 63 writing 0 readable 1 held 0",
        "engines live 1 sweeping 0 dead 0",
    ] {
        assert!(out.contains(want), "{want:?} not in {out}");
    }
    assert_eq!(OwnerWord::decode(p.words().owner_load(e)).state, OwnerState::Free);
    assert!(t.check().is_ok());
    // Nothing more to reclaim; the live engine is left.
    let (code, out, err) = kvoffload(&["pool", "ls", "--dir", dir, "--reclaim", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"engines_dead\":0,") && out.contains(",\"reclaimed\":[]}"), "{out}");
    assert_eq!(p.engines().live.len(), 1);
    assert_eq!(OwnerWord::decode(p.words().owner_load(lease.engine)).state, OwnerState::Live);
}
