//! Limits checked before work: a region larger than the
//! memory this process can get (the smaller of MemAvailable and its
//! cgroup's limit minus usage) is `RegionError::MemoryTooSmall`, naming the
//! bytes asked for, the bytes available and where that limit came from,
//! before any file is created or reserved and any page touched. The tests
//! print how long the refusal took (not asserted: wall-clock varies).

mod region_common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvoffload::internal::region::{fs_available, mem_available, AnonOptions, LimitSource, Order};
use kvoffload::{page_size, Layout, Region, RegionError, ShmOptions};
use region_common::ShmGuard;

/// A layout of about `bytes` (one rank or `ranks` ranks, rank-major, 2 MiB chunks).
fn layout_of(bytes: u64, ranks: usize) -> Layout {
    let chunk = 2 << 20;
    let rows = (bytes / (chunk as u64 * ranks as u64)).max(1) as usize;
    Layout::rank_major(ranks, chunk, rows).unwrap()
}

#[track_caller]
fn expect_too_small(res: Result<Region, RegionError>, needed_bytes: u64) -> (u64, LimitSource) {
    match res {
        Err(e @ RegionError::MemoryTooSmall { .. }) => {
            let RegionError::MemoryTooSmall { needed, available, ref limit } = e else { unreachable!() };
            assert_eq!(needed, needed_bytes);
            assert!(needed > available, "{needed} > {available}");
            let msg = e.to_string();
            for part in [needed.to_string(), available.to_string(), limit.to_string()] {
                assert!(msg.contains(&part), "{msg:?} does not name {part:?}");
            }
            (available, limit.clone())
        }
        Err(e) => panic!("expected MemoryTooSmall, got {e:?}"),
        Ok(_) => panic!("a region of {needed_bytes} bytes was made"),
    }
}

#[test]
fn region_anonymous_twice_the_memory_is_refused_at_once() {
    let avail = mem_available().unwrap();
    let l = layout_of(2 * avail, 1);
    let t = Instant::now();
    let res = Region::anonymous(l, &AnonOptions::new());
    let dt = t.elapsed();
    let (available, limit) = expect_too_small(res, l.data_bytes() as u64);
    assert!(available <= avail + (avail / 10), "{available} vs MemAvailable {avail}");
    println!(
        "anonymous region of {} bytes (2 x MemAvailable) refused in {dt:?}: {available} bytes available ({limit})",
        l.data_bytes()
    );
    // The escape hatch skips the check: whatever happens then is not MemoryTooSmall.
    let unchecked = Region::anonymous(l, &AnonOptions::new().check_memory(false));
    assert!(!matches!(unchecked, Err(RegionError::MemoryTooSmall { .. })), "{unchecked:?}");
}

/// Creates and joins a region of twice MemAvailable in `dir` (a file
/// system with room for it) and checks both are refused before any file
/// exists, then that `check_memory(false)` creates it (nothing reserved or
/// touched).
fn shared_twice_the_memory_in(dir: &Path) {
    let avail = mem_available().unwrap();
    let l = layout_of(2 * avail, 2);
    let listing = || std::fs::read_dir(dir).unwrap().count();
    assert_eq!(listing(), 0, "{} is not empty to start with", dir.display());
    let g = ShmGuard::in_dir("twice", dir);
    let o = ShmOptions::new().dir(dir).timeout(Duration::from_secs(60));

    let t = Instant::now();
    let res = Region::create(&g.name, l, 0, &o);
    let dt = t.elapsed();
    let header = 4096.max(page_size()) as u64;
    let (available, limit) = expect_too_small(res, l.data_bytes() as u64 + header);
    assert_eq!(listing(), 0, "a refused create left files in {}", dir.display());
    println!(
        "shared create of {} bytes (2 x MemAvailable) in {} refused in {dt:?}: {available} bytes available ({limit})",
        l.data_bytes(),
        dir.display()
    );

    // A joiner checks its own share (here: twice MemAvailable, of a region
    // of four times) before it waits for the file (a 60 s timeout).
    let l4 = layout_of(4 * avail, 2);
    let t = Instant::now();
    let res = Region::join(&g.name, l4, 1, &o);
    let dt = t.elapsed();
    expect_too_small(res, l4.bytes_per_rank() as u64);
    assert!(dt < Duration::from_secs(30), "the joiner waited for the file ({dt:?}) instead of refusing at once");
    assert_eq!(listing(), 0);
    println!("shared join of a {}-byte share (2 x MemAvailable) refused in {dt:?}", l4.bytes_per_rank());

    // The escape hatch: created (files sized, nothing reserved or touched).
    let r = Region::create(&g.name, l, 0, &o.clone().check_memory(false).reserve(false).wait_for_all(false)).unwrap();
    assert!(listing() > 0);
    drop(r);
    assert_eq!(listing(), 0, "dropping the region left files");
    println!("shared-twice: ok");
}

#[test]
fn region_shared_twice_the_memory_is_refused_at_once_and_leaves_no_file() {
    if let Some(dir) = std::env::var_os("KVOFFLOAD_BIG_TMPFS_CHILD") {
        // In a private mount namespace: a tmpfs four times MemAvailable
        // (tmpfs sizes are not checked against memory when mounted).
        let dir = PathBuf::from(dir);
        let size = 4 * mem_available().unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "kvoffload-test"])
            .arg(&dir)
            .status();
        assert!(st.as_ref().is_ok_and(|s| s.success()), "mount tmpfs: {st:?}");
        shared_twice_the_memory_in(&dir);
        let _ = Command::new("umount").arg(&dir).status();
        return;
    }
    // /dev/shm is smaller than twice the memory (its capacity check would
    // refuse first): use a tmpfs of our own in a mount namespace, or else a
    // disk directory with room.
    let dir = std::env::temp_dir().join(region_common::unique_name("big-tmpfs"));
    std::fs::create_dir_all(&dir).unwrap();
    let ns = Command::new("unshare").args(["-m", "true"]).status().is_ok_and(|s| s.success());
    if ns {
        let out = Command::new("unshare")
            .args(["-m", "--propagation", "private"])
            .arg(std::env::current_exe().unwrap())
            .args(["region_shared_twice_the_memory_is_refused_at_once_and_leaves_no_file", "--exact", "--nocapture"])
            .env("KVOFFLOAD_BIG_TMPFS_CHILD", &dir)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        let _ = std::fs::remove_dir(&dir);
        assert!(out.status.success() && text.contains("shared-twice: ok"), "child failed:\n{text}");
        for l in text.lines().filter(|l| l.starts_with("shared")) {
            println!("{l}");
        }
        return;
    }
    let need = 2 * mem_available().unwrap() + (1 << 30);
    if fs_available(&dir).unwrap() < need {
        let _ = std::fs::remove_dir(&dir);
        println!("skipped: no mount namespace (unshare -m) and {} has less than {need} bytes free", dir.display());
        return;
    }
    shared_twice_the_memory_in(&dir);
    let _ = std::fs::remove_dir(&dir);
}

/// This process's memory cgroup directory and its limit file's name, if
/// the cgroup file system is where it usually is.
fn own_memory_cgroup() -> Option<(PathBuf, &'static str)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for l in text.lines() {
        let mut it = l.splitn(3, ':');
        let (_, ctl, path) = (it.next()?, it.next()?, it.next()?);
        if ctl.split(',').any(|c| c == "memory") {
            return Some((
                Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/')),
                "memory.limit_in_bytes",
            ));
        }
    }
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let root = Path::new("/sys/fs/cgroup");
    let ctl = std::fs::read_to_string(root.join("cgroup.controllers")).ok()?;
    ctl.split_whitespace().any(|c| c == "memory").then(|| (root.join(path.trim_start_matches('/')), "memory.max"))
}

#[test]
fn region_a_cgroup_limit_below_memavailable_is_the_one_named() {
    const MIB: u64 = 1 << 20;
    if let Some(limit_file) = std::env::var_os("KVOFFLOAD_CGROUP_CHILD") {
        // In a cgroup limited to 256 MiB.
        let l = layout_of(512 * MIB, 1);
        let t = Instant::now();
        let res = Region::anonymous(l, &AnonOptions::new());
        let dt = t.elapsed();
        let (available, limit) = expect_too_small(res, l.data_bytes() as u64);
        assert_eq!(limit, LimitSource::Cgroup { limit_file: PathBuf::from(limit_file) });
        assert!(available <= 256 * MIB);
        println!("cgroup: 512 MiB refused in {dt:?}: {available} bytes available ({limit})");
        // What fits is made (nothing touched).
        Region::anonymous(layout_of(64 * MIB, 1), &AnonOptions::new()).unwrap();
        println!("cgroup: ok");
        return;
    }
    let Some((own, limit_name)) = own_memory_cgroup() else {
        println!("skipped: no memory cgroup found for this process");
        return;
    };
    let cg = own.join(region_common::unique_name("limit"));
    if let Err(e) = std::fs::create_dir(&cg) {
        println!("skipped: cannot make a cgroup under {} ({e})", own.display());
        return;
    }
    // Ok(child output, whether it passed) or Err(why the test cannot run here).
    let res = (|| -> Result<(String, bool), String> {
        std::fs::write(cg.join(limit_name), (256 * MIB).to_string()).map_err(|e| format!("set the limit: {e}"))?;
        let out = Command::new("sh")
            .arg("-c")
            .arg("echo $$ > \"$1/cgroup.procs\" && exec \"$2\" region_a_cgroup_limit_below_memavailable_is_the_one_named --exact --nocapture")
            .arg("sh")
            .arg(&cg)
            .arg(std::env::current_exe().unwrap())
            .env("KVOFFLOAD_CGROUP_CHILD", cg.join(limit_name))
            .output()
            .map_err(|e| format!("spawn: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        if !out.status.success() && text.contains("cgroup.procs") {
            return Err(format!("cannot move a process into {}: {text}", cg.display()));
        }
        Ok((text.clone(), out.status.success() && text.contains("cgroup: ok")))
    })();
    // The child has exited: the cgroup is empty and can go (before any assertion).
    let rm = std::fs::remove_dir(&cg);
    match res {
        Ok((text, passed)) => {
            assert!(passed, "child failed:\n{text}");
            for l in text.lines().filter(|l| l.starts_with("cgroup:")) {
                println!("{l}");
            }
            rm.unwrap();
        }
        Err(why) => println!("skipped: {why}"),
    }
}

#[test]
fn region_order_does_not_change_what_a_joiner_checks() {
    // A row-interleaved one-file region: a joiner checks its share too.
    let avail = mem_available().unwrap();
    let l = layout_of(3 * avail, 2).with_order(Order::RowInterleaved);
    let g = ShmGuard::new("thrice-rows");
    let o = ShmOptions::new().files(kvoffload::FileSplit::Single).timeout(Duration::from_secs(60));
    let share = l.bytes_per_rank() as u64;
    if share <= kvoffload::internal::region::available_memory().unwrap().bytes {
        println!("skipped: half of 3 x MemAvailable fits now");
        return;
    }
    let t = Instant::now();
    expect_too_small(Region::join(&g.name, l, 1, &o), share);
    println!("row-interleaved join refused in {:?}", t.elapsed());
    g.assert_gone();
}
