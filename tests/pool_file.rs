//! The pool's index file (design 2.1, 1.3, 3.6): made and opened again,
//! its words one memory across mappings and processes; every config field
//! a refusal names; the region's trust rules on its name (a link, another
//! user's file, group or other bits, a FIFO); a directory that is not
//! memory; a half-made file of a creator that died, recovered; and the
//! liveness oracle on real processes (exited, zombie, running, pid reused,
//! a pid alone).
//!
//! Children re-execute this binary (`pool_child`, the role in
//! `KVOFFLOAD_REGION_TEST_ROLE`, `dir|name` in `KVOFFLOAD_REGION_TEST_NAME`);
//! synchronisation is by their output and exit status, never by sleeping.

mod pool_common;
mod region_common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::{Duration, Instant};

use kvoffload::internal::pool::error::PoolError;
use kvoffload::internal::pool::file::layout::{PoolState, VERSION, W};
use kvoffload::internal::pool::file::liveness::{member_of, Oracle};
use kvoffload::internal::pool::file::{PoolFile, PoolOptions, PoolSpec, PoolStep, Wait, TMPFS_MAGIC};
use kvoffload::internal::pool::fingerprint::{ConfigRecord, GroupRecord, HashingRecord, LayoutRecord};
use kvoffload::internal::pool::table::{Lookup, Placement, PoolTable};
use kvoffload::internal::pool::words::{Key, Liveness, Member, PoolWords};
use kvoffload::FileProblem;
use pool_common::{config, s, spec, ShmDir};
use region_common::{block_on_stdin, child_role, poll_until, write_private, ChildGuard, Snapshot};

const PATIENCE: Duration = Duration::from_secs(30);

fn wait() -> Wait<'static> {
    Wait::new(PATIENCE)
}

/// What a re-executed child does; a failure is a non-zero exit.
fn run_child(role: &str, arg: &str) {
    let (dir, name) = arg.split_once('|').unwrap();
    let opts = PoolOptions::in_dir(dir);
    match role {
        // Opens the pool, checks the parent's words, writes its own, exits.
        "share" => {
            let p = PoolFile::open(name, &opts, wait()).unwrap();
            let w = p.words();
            assert_eq!(w.slot_load(1), 0x1111, "the parent's slot word");
            assert_eq!(w.key_load(1), Key::new(b"parent", 7).unwrap());
            assert_eq!(w.slot_cas(2, 0, 0x2222), Ok(0));
            w.key_store(2, &Key::new(b"child", 9).unwrap());
            w.member_store(3, 5, &Member { pid: 42, start: 43, pidns: 44 });
            assert_eq!(w.owner_cas(3, 0, 0x4000_0000_0000_0001), Ok(0));
        }
        // Creates the pool and stops before READY (killed there).
        "create-stop-written" => {
            let o = opts.observe(|s| stop_at(s, PoolStep::Written));
            let _ = PoolFile::create(name, &spec(), &o);
        }
        // Creates the pool and stops before sizing it (killed there).
        "create-stop-created" => {
            let o = opts.observe(|s| stop_at(s, PoolStep::Created));
            let _ = PoolFile::create(name, &spec(), &o);
        }
        // Joins as an engine, holds the parent's key, says so, and blocks
        // (killed there: its hold is left for a sweep).
        "hold" => {
            let p = PoolFile::open(name, &opts, wait()).unwrap();
            let t = PoolTable::new(p.words());
            let me = member_of(std::process::id()).unwrap();
            let lease = t.join_owner(0, &me, &[5; 4]).unwrap();
            let hit = t.lookup(lease.engine, &Key::new(b"block", 0).unwrap()).unwrap();
            assert!(matches!(hit, Lookup::Hit { fresh: true, .. }), "{hit:?}");
            use std::io::Write;
            println!("held by engine {}", lease.engine);
            let _ = std::io::stdout().flush();
            block_on_stdin();
        }
        other => panic!("unknown role {other}"),
    }
}

fn stop_at(step: PoolStep, at: PoolStep) {
    if step == at {
        use std::io::Write;
        println!("at {step:?}");
        let _ = std::io::stdout().flush();
        block_on_stdin();
    }
}

/// The entry of every child (does nothing when run as a test).
#[test]
fn pool_child() {
    if let Some((role, arg)) = child_role() {
        run_child(&role, &arg);
    }
}

fn child(role: &str, d: &ShmDir, name: &str, piped: bool) -> ChildGuard {
    let arg = format!("{}|{name}", d.path().display());
    if piped {
        ChildGuard::spawn_piped("pool_child", role, &arg)
    } else {
        ChildGuard::spawn("pool_child", role, &arg)
    }
}

#[test]
fn created_pool_reopens_with_the_same_words_in_two_mappings() {
    let d = ShmDir::new("reopen");
    let (a, created) = PoolFile::open_or_create("node", &spec(), &d.opts(), wait()).unwrap();
    assert!(created);
    assert_eq!(d.names(), ["kvoffload-pool-node.index"]);
    assert_eq!(a.pool_word().state, PoolState::Ready);
    let (b, created) = PoolFile::open_or_create("node", &spec(), &d.opts(), wait()).unwrap();
    assert!(!created, "the second opener joins the first's pool");
    assert_eq!(b.geometry(), spec().geometry);
    assert_eq!(b.row_bytes(), spec().row_bytes);
    assert_eq!(b.config().unwrap(), config());
    let (wa, wb) = (a.words(), b.words());
    // Every kind of word, written through one mapping, read through the other.
    assert_eq!(wa.slot_cas(63, 0, 0xdead), Ok(0));
    assert_eq!(wb.slot_load(63), 0xdead);
    assert_eq!(wb.slot_cas(63, 0, 1), Err(0xdead), "a CAS on the other mapping sees the word");
    let k = Key::new(&[5; 32], 3).unwrap();
    wa.key_store(63, &k);
    assert_eq!(wb.key_load(63), k);
    wa.clock_store(5, true);
    assert!(wb.clock_load(5) && !wb.clock_load(4));
    assert_eq!((wa.hand_next(3), wb.hand_next(3), wa.hand_next(2)), (0, 1, 0));
    assert_eq!(wa.owner_cas(3, 0, 7), Ok(0));
    assert_eq!(wb.owner_load(3), 7);
    assert_eq!(wb.members_cas(3, 0, 9), Ok(0));
    assert_eq!(wa.members_load(3), 9);
    let m = Member { pid: 1, start: 2, pidns: 3 };
    wa.member_store(3, 32, &m);
    assert_eq!(wb.member_load(3, 32), m);
    assert_eq!(wb.member_load(3, 31), Member::default());
    wa.engine_id_store(3, &[1, 2, 3, 4]);
    assert_eq!(wb.engine_id_load(3), [1, 2, 3, 4]);
    assert_eq!(wb.engine_id_load(2), [0; 4]);
}

#[test]
fn two_processes_share_the_words() {
    let d = ShmDir::new("procs");
    let p = PoolFile::create("node", &spec(), &d.opts()).unwrap();
    let w = p.words();
    assert_eq!(w.slot_cas(1, 0, 0x1111), Ok(0));
    w.key_store(1, &Key::new(b"parent", 7).unwrap());
    let status = child("share", &d, "node", false).wait();
    assert!(status.success(), "child: {status:?}");
    assert_eq!(w.slot_load(2), 0x2222);
    assert_eq!(w.key_load(2), Key::new(b"child", 9).unwrap());
    assert_eq!(w.member_load(3, 5), Member { pid: 42, start: 43, pidns: 44 });
    assert_eq!(w.owner_load(3), 0x4000_0000_0000_0001);
}

/// Every config field, changed alone, and the name the refusal gives it.
fn config_variants() -> Vec<(&'static str, ConfigRecord)> {
    let v = |f: &dyn Fn(&mut ConfigRecord)| {
        let mut c = config();
        f(&mut c);
        c
    };
    vec![
        ("model", v(&|c| c.model = s("model", "Qwen/Qwen3-8B"))),
        ("dtype", v(&|c| c.kv_dtype = s("dtype", "float16"))),
        ("kvo_pool_tag", v(&|c| c.tag = s("kvo_pool_tag", "rev-b"))),
        ("groups", v(&|c| c.groups.truncate(1))),
        ("group 1 tokens_per_block", v(&|c| c.groups[1].tokens_per_block = 64)),
        ("group 0 layer_names (SHA-256)", v(&|c| c.groups[0].layer_names_sha256[31] ^= 1)),
        ("tokens_per_hash", v(&|c| c.tokens_per_hash = 32)),
        ("blocks_per_chunk", v(&|c| c.blocks_per_chunk = 8)),
        ("worker_kv_bytes_per_block", v(&|c| c.bytes_per_block = 32768)),
        ("world_size", v(&|c| c.world_size = 4)),
        ("tp_size", v(&|c| c.tp_size = 1)),
        ("pp_size", v(&|c| c.pp_size = 2)),
        ("pcp_size", v(&|c| c.pcp_size = 2)),
        ("dcp_size", v(&|c| c.dcp_size = 2)),
        ("kv_cache_layout", v(&|c| c.kv_cache_layout = s("kv_cache_layout", "HND"))),
        ("replicated_layout", v(&|c| c.replicated_layout = true)),
    ]
}

#[test]
fn every_config_field_that_differs_is_refused_by_name() {
    let d = ShmDir::new("mismatch");
    PoolFile::create("node", &spec(), &d.opts()).unwrap();
    // The control: the same config opens (so the refusals below are the fields').
    assert!(PoolFile::open_or_create("node", &spec(), &d.opts(), wait()).is_ok());
    let variants = config_variants();
    assert_eq!(variants.len(), config().fields().len() - 2 * 2 + 2, "one variant per field (per-group fields once)");
    for (field, c) in variants {
        let sp = PoolSpec { config: c, ..spec() };
        match PoolFile::open_or_create("node", &sp, &d.opts(), wait()) {
            Err(e @ PoolError::Mismatch { .. }) => {
                let PoolError::Mismatch { field: ref f, ref pool, ref pool_value, ref engine_value, .. } = e else {
                    unreachable!()
                };
                assert_eq!((f.as_str(), pool.as_str()), (field, "node"), "{e}");
                assert_ne!(pool_value, engine_value);
                let msg = e.to_string();
                assert!(
                    msg.contains(&format!("holds KV of {field} '{pool_value}'; this engine's is '{engine_value}'")),
                    "{msg}"
                );
            }
            other => panic!("{field}: expected a mismatch, got {other:?}"),
        }
    }
    // The shape beside the config.
    for (field, sp) in [
        (
            "ranks",
            PoolSpec { geometry: kvoffload::internal::pool::words::Geometry { ranks: 4, ..spec().geometry }, ..spec() },
        ),
        ("row bytes per rank", PoolSpec { row_bytes: 1, ..spec() }),
    ] {
        let e = PoolFile::open_or_create("node", &sp, &d.opts(), wait()).unwrap_err();
        assert!(matches!(&e, PoolError::Mismatch { field: f, .. } if f == field), "{field}: {e}");
    }
    assert_eq!(d.names(), ["kvoffload-pool-node.index"], "refusals remove nothing");
}

#[test]
fn the_dtype_refusal_reads_as_the_design_says() {
    let d = ShmDir::new("message");
    PoolFile::create("node", &spec(), &d.opts()).unwrap();
    let sp = PoolSpec { config: ConfigRecord { kv_dtype: s("dtype", "float16"), ..config() }, ..spec() };
    let e = PoolFile::open_or_create("node", &sp, &d.opts(), wait()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "kvoffload pool 'node' ({}) holds KV of dtype 'bfloat16'; this engine's is 'float16': \
             name another pool (kvo_pool) or remove this one (kvoffload pool rm node)",
            d.index("node").display()
        )
    );
}

#[test]
fn hashing_and_layout_parts_are_filled_once_then_compared_by_field() {
    let d = ShmDir::new("parts");
    let p = PoolFile::create("node", &spec(), &d.opts()).unwrap();
    let q = PoolFile::open("node", &d.opts(), wait()).unwrap();
    let h = HashingRecord::new("sha256", &[3; 32], Some((3, 12))).unwrap();
    assert!(p.ensure_hashing(&h, wait()).unwrap(), "the first scheduler fills it");
    assert!(!q.ensure_hashing(&h, wait()).unwrap(), "the next one compares");
    for (field, other) in [
        ("hash algorithm", HashingRecord::new("sha256_cbor", &[3; 32], Some((3, 12))).unwrap()),
        ("NONE_HASH", HashingRecord::new("sha256", &[4; 32], Some((3, 12))).unwrap()),
        ("Python version", HashingRecord::new("sha256", &[3; 32], Some((3, 11))).unwrap()),
    ] {
        let e = q.ensure_hashing(&other, wait()).unwrap_err();
        assert!(matches!(&e, PoolError::Mismatch { field: f, .. } if f == field), "{field}: {e}");
    }
    let l = LayoutRecord { page_sizes: vec![4096, 8192] };
    assert!(p.ensure_layout(0, &l, wait()).unwrap());
    assert!(!q.ensure_layout(0, &l, wait()).unwrap());
    assert!(q.ensure_layout(1, &LayoutRecord { page_sizes: vec![1] }, wait()).unwrap(), "each rank its own");
    for (field, other) in [
        ("rank 0 tensor count", LayoutRecord { page_sizes: vec![4096] }),
        ("rank 0 tensor 1 page_size_bytes", LayoutRecord { page_sizes: vec![4096, 4096] }),
    ] {
        let e = q.ensure_layout(0, &other, wait()).unwrap_err();
        assert!(matches!(&e, PoolError::Mismatch { field: f, .. } if f == field), "{field}: {e}");
    }
    assert!(matches!(q.ensure_layout(2, &l, wait()), Err(PoolError::BadGeometry { .. })), "rank past the pool's");
}

#[test]
fn over_long_strings_and_too_many_groups_are_refused_typed() {
    let e = kvoffload::internal::pool::fingerprint::FixedStr::<256>::new("model", &"m".repeat(257)).unwrap_err();
    assert!(matches!(e, PoolError::TooLong { field: "model", len: 257, max: 256 }), "{e}");
    let d = ShmDir::new("toomany");
    let c =
        ConfigRecord { groups: vec![GroupRecord { tokens_per_block: 1, layer_names_sha256: [0; 32] }; 17], ..config() };
    let e = PoolFile::create("node", &PoolSpec { config: c, ..spec() }, &d.opts()).unwrap_err();
    assert!(matches!(e, PoolError::TooMany { count: 17, max: 16, .. }), "{e}");
    assert!(d.names().is_empty(), "nothing made");
}

/// Plants `make(path)` under pool "node"'s index name and expects an open
/// to refuse it with `want`, leaving it as it was.
fn refused(tag: &str, make: impl FnOnce(&Path), want: FileProblem) {
    let d = ShmDir::new(tag);
    let path = d.index("node");
    make(&path);
    let before = Snapshot::of(&path);
    let res = PoolFile::open_or_create("node", &spec(), &d.opts(), Wait::new(Duration::from_millis(300)));
    assert_eq!(Snapshot::of(&path), before, "{tag}: changed; open gave {res:?}");
    match res {
        Err(PoolError::Untrusted { path: p, problem }) => {
            assert_eq!((p, problem), (path, want), "{tag}");
        }
        other => panic!("{tag}: expected Untrusted({want:?}), got {other:?}"),
    }
}

fn index_bytes() -> usize {
    let d = ShmDir::new("size");
    PoolFile::create("x", &spec(), &d.opts()).unwrap().file_bytes()
}

#[test]
fn untrusted_files_under_the_index_name_are_refused_and_left_alone() {
    let len = index_bytes();
    let outside = std::env::temp_dir().join(format!("kvo-pool-victim-{}", std::process::id()));
    let _ = std::fs::remove_file(&outside);
    write_private(&outside, &vec![0u8; len]);
    refused("link", |p| std::os::unix::fs::symlink(&outside, p).unwrap(), FileProblem::Symlink);
    let _ = std::fs::remove_file(&outside);
    refused(
        "mode",
        |p| {
            use std::os::unix::fs::PermissionsExt;
            write_private(p, &vec![0u8; len]);
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o644)).unwrap();
        },
        FileProblem::Mode { mode: 0o644, allowed_group: None },
    );
    refused(
        "fifo",
        |p| assert!(std::process::Command::new("mkfifo").arg(p).status().unwrap().success()),
        FileProblem::NotRegular { kind: "FIFO" },
    );
    let euid = rustix::process::geteuid().as_raw();
    if euid != 0 {
        println!("skipped the foreign-owner case: not root (euid {euid})");
        return;
    }
    refused(
        "foreign",
        |p| {
            write_private(p, &vec![0u8; len]);
            std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
        },
        FileProblem::ForeignOwner { uid: 65534, euid, gid: 65534, allowed_group: None },
    );
}

#[test]
fn a_directory_that_is_not_memory_is_refused() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("kvo-pool-disk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let magic = rustix::fs::statfs(&dir).unwrap().f_type as u64 & 0xffff_ffff;
    if magic == TMPFS_MAGIC {
        println!("skipped: {} is on tmpfs here", dir.display());
        return;
    }
    let e = PoolFile::open_or_create("node", &spec(), &PoolOptions::in_dir(&dir), wait()).unwrap_err();
    assert!(matches!(&e, PoolError::NotTmpfs { magic: m, .. } if *m == magic), "{e}");
    assert!(e.to_string().contains("not a tmpfs or hugetlbfs mount"), "{e}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "nothing made");
    std::fs::remove_dir(&dir).unwrap();
    // The control: /dev/shm is accepted.
    let d = ShmDir::new("memory");
    assert!(PoolFile::open_or_create("node", &spec(), &d.opts(), wait()).is_ok());
}

fn inode(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).unwrap().ino()
}

#[test]
fn a_half_made_file_is_waited_for_while_its_creator_lives_and_remade_once_it_is_gone() {
    let d = ShmDir::new("halfmade");
    let mut c = child("create-stop-written", &d, "node", true);
    c.read_line("at Written");
    let half = inode(&d.index("node"));
    // Alive, stopped before READY: an opener waits and times out, leaving it.
    let e = PoolFile::open_or_create("node", &spec(), &d.opts(), Wait::new(Duration::from_millis(300))).unwrap_err();
    assert!(matches!(e, PoolError::Timeout { .. }), "{e}");
    assert_eq!(inode(&d.index("node")), half, "a live creator's file is left alone");
    // Interruptible: the check stops the wait at once.
    let stop = || true;
    let e = PoolFile::open_or_create("node", &spec(), &d.opts(), wait().interruptible(&stop)).unwrap_err();
    assert!(matches!(e, PoolError::Interrupted { .. }), "{e}");
    assert_eq!(c.kill9().signal(), Some(libc::SIGKILL));
    // Gone: removed and made again, well before the wait's end.
    let t = Instant::now();
    let (p, created) = PoolFile::open_or_create("node", &spec(), &d.opts(), wait()).unwrap();
    assert!(created && t.elapsed() < PATIENCE / 2, "{:?}", t.elapsed());
    assert_ne!(inode(&d.index("node")), half);
    assert_eq!(p.pool_word().state, PoolState::Ready);
}

#[test]
fn a_file_its_creator_never_sized_is_remade_after_the_wait() {
    let d = ShmDir::new("unsized");
    let mut c = child("create-stop-created", &d, "node", true);
    c.read_line("at Created");
    let half = inode(&d.index("node"));
    assert_eq!(std::fs::metadata(d.index("node")).unwrap().len(), 0);
    c.kill9();
    let (_, created) =
        PoolFile::open_or_create("node", &spec(), &d.opts(), Wait::new(Duration::from_millis(300))).unwrap();
    assert!(created);
    assert_ne!(inode(&d.index("node")), half);
}

#[test]
fn a_pool_of_another_boot_is_refused() {
    use std::os::unix::fs::FileExt;
    let d = ShmDir::new("boot");
    drop(PoolFile::create("node", &spec(), &d.opts()).unwrap());
    let f = std::fs::OpenOptions::new().write(true).open(d.index("node")).unwrap();
    f.write_at(&[0xab; 16], 8 * W::BOOT as u64).unwrap();
    let e = PoolFile::open_or_create("node", &spec(), &d.opts(), wait()).unwrap_err();
    assert!(matches!(e, PoolError::OtherBoot { .. }), "{e}");
    assert!(e.to_string().contains("abababab-abab"), "{e}");
    // Its members are all gone to its oracle, a live one included.
    let p = PoolFile::open("node", &d.opts(), wait()).unwrap();
    let me = member_of(std::process::id()).unwrap();
    assert_eq!(p.words().liveness(&me), Liveness::Gone);
}

/// A pool of an earlier layout (version 1: one set per key; 2: before the
/// closing protocol and the member holds) is refused by field, never used
/// by rules its engines do not follow.
#[test]
fn a_pool_of_another_layout_version_is_refused_naming_the_field() {
    use std::os::unix::fs::FileExt;
    assert_eq!(VERSION, 3);
    let d = ShmDir::new("version");
    drop(PoolFile::create("node", &spec(), &d.opts()).unwrap());
    let f = std::fs::OpenOptions::new().write(true).open(d.index("node")).unwrap();
    for old in [1u64, 2] {
        f.write_at(&old.to_le_bytes(), 8 * W::VERSION as u64).unwrap();
        let e = PoolFile::open_or_create("node", &spec(), &d.opts(), wait()).unwrap_err();
        assert!(matches!(e, PoolError::BadHeader { field: "version", expected: 3, found, .. } if found == old), "{e}");
        assert!(e.to_string().contains("kvoffload pool rm --force"), "{e}");
    }
}

#[test]
fn the_oracle_tells_exited_zombie_reused_and_foreign_processes_from_live_ones() {
    let d = ShmDir::new("oracle");
    let p = PoolFile::create("node", &spec(), &d.opts()).unwrap();
    let w = p.words();
    // Running.
    let mut live = std::process::Command::new("sleep").arg("60").spawn().unwrap();
    let rec = member_of(live.id()).unwrap();
    assert_eq!(w.liveness(&rec), Liveness::Alive);
    // The same pid with another start time: reused, gone.
    assert_eq!(w.liveness(&Member { start: rec.start + 1, ..rec }), Liveness::Gone);
    // The pid alone (an owner word's claimer or sweeper, start time 0):
    // judged by the pid, alive while it runs.
    let pid_only = Member { start: 0, ..rec };
    assert_eq!(w.liveness(&pid_only), Liveness::Alive);
    // Another pid namespace: not judged.
    assert_eq!(w.liveness(&Member { pidns: rec.pidns ^ 1, ..rec }), Liveness::Foreign);
    // Another boot: gone.
    let other_boot = Oracle { same_boot: false, ..w.oracle() };
    assert_eq!(other_boot.judge(&rec), Liveness::Gone);
    // A zombie: kill(pid, 0) still finds it, the oracle does not count it.
    let pid = live.id();
    live.kill().unwrap();
    assert!(poll_until(PATIENCE, || std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s[s.rfind(')').unwrap() + 2..].starts_with('Z'))));
    let p_raw = rustix::process::Pid::from_raw(pid as i32).unwrap();
    assert!(rustix::process::test_kill_process(p_raw).is_ok(), "kill(pid, 0) alone says it lives");
    assert_eq!(w.liveness(&rec), Liveness::Gone, "zombie");
    assert_eq!(w.liveness(&pid_only), Liveness::Gone, "zombie, by its pid");
    // Reaped: gone.
    live.wait().unwrap();
    assert_eq!(w.liveness(&rec), Liveness::Gone, "exited");
    assert_eq!(w.liveness(&pid_only), Liveness::Gone, "exited, by its pid");
    // This process: alive.
    assert_eq!(w.liveness(&member_of(std::process::id()).unwrap()), Liveness::Alive);
}

#[test]
fn the_protocol_runs_over_the_file_between_processes_and_sweeps_a_dead_engine() {
    let d = ShmDir::new("protocol");
    let p = PoolFile::create("node", &spec(), &d.opts()).unwrap();
    let t = PoolTable::new(p.words());
    let me = member_of(std::process::id()).unwrap();
    let lease = t.join_owner(0, &me, &[1, 2, 3, 4]).unwrap();
    let key = Key::new(b"block", 0).unwrap();
    let Placement::Claimed { slot, epoch, .. } = t.claim(lease.engine, &key).unwrap() else { panic!("not claimed") };
    assert!(!t.complete_rank(lease.engine, slot, epoch, 0).unwrap());
    assert!(t.complete_rank(lease.engine, slot, epoch, 1).unwrap(), "the last rank publishes");
    let mut c = child("hold", &d, "node", true);
    let line = c.read_line("held by engine");
    assert_ne!(line, format!("held by engine {}", lease.engine));
    assert_eq!((p.slot_counts().held, p.engines().live.len()), (1, 2), "{line}");
    // Alive: nothing to sweep.
    assert!(t.sweep_dead(&me, &mut |_| true).unwrap().is_empty());
    c.kill9();
    // Gone (the oracle on its recorded pid and start time): its hold is swept.
    assert_eq!(t.sweep_dead(&me, &mut |_| true).unwrap().len(), 1);
    let counts = p.slot_counts();
    assert_eq!((counts.readable, counts.held), (1, 0));
    assert_eq!((p.engines().live.len(), p.engines().dead), (1, 0));
    assert!(t.check().is_ok());
}

/// A member that leaves twice (the Rust API lets a `Lease`, which is
/// `Copy`, be used again) gives back its member hold once: the second
/// leave finds its bit clear and touches nothing, so the hold another
/// member of the same handle still needs (its owner) stays, and an engine
/// of this process stays alive to a judge of another pid namespace.
#[test]
fn a_second_leave_of_a_member_keeps_the_holds_of_the_others() {
    let d = ShmDir::new("leave-twice");
    let p = PoolFile::create("node", &spec(), &d.opts()).unwrap();
    let judge = PoolFile::open("node", &d.opts(), wait()).unwrap();
    let t = PoolTable::new(p.words());
    let me = kvoffload::internal::pool::file::liveness::member_of_self().unwrap();
    let lease = t.join_owner(1, &me, &[3; 4]).unwrap();
    assert_eq!(t.join_member(0, &me, &[3; 4]).unwrap(), Some(lease));
    t.leave(lease, 0, &me).unwrap();
    t.leave(lease, 0, &me).unwrap();
    assert_eq!(judge.words().foreign_member_liveness(lease.engine), Liveness::Alive, "the owner is still a member");
    t.leave(lease, 1, &me).unwrap();
    assert_eq!(judge.words().foreign_member_liveness(lease.engine), Liveness::Gone);
    // A lease of an ended tenure, used after this handle claimed the entry
    // again, leaves the new tenure's bit and holds alone.
    let again = t.join_owner(1, &me, &[4; 4]).unwrap();
    assert_eq!(again.engine, lease.engine);
    t.leave(lease, 1, &me).unwrap();
    let members = kvoffload::internal::pool::engines::MembersWord::decode(p.words().members_load(again.engine));
    assert_eq!(members.mask, 1 << 1, "the new tenure's owner is still a member");
    assert_eq!(judge.words().foreign_member_liveness(again.engine), Liveness::Alive);
    t.leave(again, 1, &me).unwrap();
    assert_eq!(judge.words().foreign_member_liveness(again.engine), Liveness::Gone);
}
