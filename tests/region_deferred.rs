//! Deferred reservation of a shared region (`ShmOptions::defer_reserve`):
//! create/join reserve nothing, pinning's pre-fault workers reserve each
//! slice before faulting it, and a full file system is the typed
//! `RegionError::ShmFull` (from the pre-fault step and from
//! `Region::reserve_rest`), never a SIGBUS.
//!
//! Space is read from the file system's own counters, so every case runs
//! on a tmpfs of its own size, mounted in a private mount namespace: the
//! test re-executes itself under `unshare -m` (skipped, saying so, where
//! that is not allowed).

mod region_common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kvoffload::internal::pin::Prepared;
use kvoffload::internal::region::fs_available;
use kvoffload::{
    page_size, Code, FileSplit, Layout, PageableReason, PinError, PinOptions, PinState, PrefaultMode, Region,
    RegionError, ShmOptions, SimFault, SimRuntime,
};
use region_common::{in_a_private_mount_namespace, ShmGuard};

const MIB: usize = 1 << 20;
const CHILD_ENV: &str = "KVOFFLOAD_DEFERRED_CHILD";

/// A tmpfs of `size` at a fresh directory (inside the child's namespace).
fn tmpfs(tag: &str, size: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvo-defer-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let st =
        Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "kvoffload-test"]).arg(&dir).status();
    assert!(st.as_ref().is_ok_and(|s| s.success()), "mount tmpfs: {st:?}");
    dir
}

fn unmount(dir: &Path) {
    let _ = Command::new("umount").arg(dir).status();
    let _ = std::fs::remove_dir(dir);
}

/// Two ranks, rank-major shares of 1 MiB in data files of 256 KiB (4 a rank).
fn layout() -> Layout {
    Layout::rank_major(2, page_size(), MIB / page_size()).unwrap()
}

fn opts(dir: &Path, defer: bool) -> ShmOptions {
    ShmOptions::new()
        .dir(dir)
        .timeout(Duration::from_secs(10))
        .check_memory(false)
        .files(FileSplit::Multi { max_file_bytes: MIB / 4 })
        .defer_reserve(defer)
}

/// Creator (not waiting) and joiner in this one process.
fn both(g: &ShmGuard, o: &ShmOptions) -> (Region, Region) {
    let c = Region::create(&g.name, layout(), 0, &o.clone().wait_for_all(false)).unwrap();
    let j = Region::join(&g.name, layout(), 1, o).unwrap();
    (c, j)
}

fn used(dir: &Path, before: u64) -> u64 {
    before - fs_available(dir).unwrap()
}

/// Upfront: create/join reserve both shares. Deferred: they reserve
/// nothing; `reserve_data` reserves exactly the range asked for, pinning
/// reserves (and faults) the rank's share, `reserve_rest` the rest.
fn reserve_moves_out_of_create_and_join() {
    let dir = tmpfs("room", "16m");
    let before = fs_available(&dir).unwrap();
    {
        let g = ShmGuard::in_dir("upfront", &dir);
        let (c, j) = both(&g, &opts(&dir, false));
        assert!(!c.reservation_deferred() && !j.reservation_deferred());
        assert!(used(&dir, before) >= 2 * MIB as u64, "upfront used {}", used(&dir, before));
        g.assert_gone();
    }
    assert!(used(&dir, before) < MIB as u64 / 4, "space not given back: {}", used(&dir, before));
    let g = ShmGuard::in_dir("deferred", &dir);
    let (c, j) = both(&g, &opts(&dir, true));
    assert!(c.reservation_deferred() && j.reservation_deferred());
    let header = used(&dir, before);
    assert!(header < MIB as u64 / 4, "deferred create/join reserved {header} bytes");
    g.assert_gone();
    // Rank 0's first 64 KiB: exactly that.
    c.reserve_data(0..64 << 10).unwrap();
    assert_eq!(used(&dir, before) - header, 64 << 10);
    // Again: nothing more (already allocated).
    c.reserve_data(0..64 << 10).unwrap();
    assert_eq!(used(&dir, before) - header, 64 << 10);
    // Rank 1's share is not in rank 0's files: rank 0 holds none of them.
    c.reserve_data(MIB..2 * MIB).unwrap();
    assert_eq!(used(&dir, before) - header, 64 << 10);
    // Out of the data area: typed.
    match c.reserve_addr(c.as_ptr() as usize + 2 * MIB - 4096, 8192) {
        Err(RegionError::RangeOutOfBounds { start, end, limit }) => {
            assert_eq!((start, end, limit), (2 * MIB - 4096, 2 * MIB + 4096, 2 * MIB))
        }
        other => panic!("expected RangeOutOfBounds, got {other:?}"),
    }
    // Rank 1 pins its share: the pre-fault workers reserve it as they go.
    let j = Arc::new(j);
    let rt = SimRuntime::new();
    let p = Prepared::new(&rt, &j, &PinOptions::default().threads(2).max_chunk_bytes(MIB / 4)).unwrap();
    assert_eq!(p.pin(&rt), PinState::Pinned);
    assert_eq!(used(&dir, before) - header, (64 << 10) + MIB as u64);
    // Rank 0's pinning fails at its first registration: it ends pageable,
    // and settling reserved the rest of its files (the region stays in
    // use, pageable, so every page it may touch must be reserved).
    let c = Arc::new(c);
    let rt0 = SimRuntime::new();
    rt0.inject(SimFault::Register { nth: 1, code: Code(999) });
    let opts0 = PinOptions::default().threads(1).max_chunk_bytes(MIB / 4);
    let p0 = Prepared::new(&rt0, &c, &opts0).unwrap();
    assert!(matches!(p0.pin(&rt0), PinState::Pageable(PageableReason::Driver(_))));
    assert_eq!(used(&dir, before) - header, 2 * MIB as u64, "the failed pin left pages unreserved");
    // Reserving again finds everything reserved.
    c.reserve_rest().unwrap();
    assert_eq!(used(&dir, before) - header, 2 * MIB as u64);
    drop(p0);
    drop(p);
    drop(j);
    drop(c);
    g.assert_gone();
    unmount(&dir);
    println!("room: ok");
}

/// A tmpfs that fills up after create/join: rank 1's pinning fails in the
/// pre-fault step with the region's ShmFull text (its reservation of a
/// slice failed, the slice was not touched: this process is alive, no
/// SIGBUS and no EFAULT from faulting), `reserve_rest` is ShmFull typed,
/// and pinning without pre-faulting refuses before registering.
fn full_file_system_is_typed() {
    let dir = tmpfs("full", "4m");
    let g = ShmGuard::in_dir("full", &dir);
    let (c, j) = both(&g, &opts(&dir, true));
    g.assert_gone();
    // Nearly everything left goes to a filler.
    let free = fs_available(&dir).unwrap() as usize;
    std::fs::write(dir.join("filler"), vec![1u8; free - MIB / 2]).unwrap();
    let j = Arc::new(j);
    let rt = SimRuntime::new();
    let p = Prepared::new(&rt, &j, &PinOptions::default().threads(2).max_chunk_bytes(MIB / 4)).unwrap();
    match p.pin(&rt) {
        PinState::Pageable(PageableReason::HostMemory(msg)) => {
            assert!(msg.contains("reserving") && msg.contains("no space to reserve"), "{msg}");
        }
        other => panic!("expected Pageable(HostMemory) from the reservation, got {other:?}"),
    }
    drop(p);
    match j.reserve_rest() {
        Err(e @ RegionError::ShmFull { .. }) => {
            let RegionError::ShmFull { ref path, needed, available } = e else { unreachable!() };
            assert!(path.starts_with(&dir), "{}", path.display());
            assert!(needed > available, "needed {needed}, available {available}");
        }
        other => panic!("expected ShmFull, got {other:?}"),
    }
    let no_prefault = PinOptions::default().prefault(PrefaultMode::Off).max_chunk_bytes(MIB / 4);
    match Prepared::new(&SimRuntime::new(), &j, &no_prefault) {
        Err(PinError::Region(RegionError::ShmFull { .. })) => {}
        other => panic!("expected ShmFull before registering without pre-faulting, got {other:?}"),
    }
    drop(j);
    drop(c);
    g.assert_gone();
    std::fs::remove_file(dir.join("filler")).unwrap();
    unmount(&dir);
    println!("full: ok");
}

#[test]
fn region_deferred_reservation_in_a_private_tmpfs() {
    if std::env::var_os(CHILD_ENV).is_some() {
        reserve_moves_out_of_create_and_join();
        full_file_system_is_typed();
        return;
    }
    let test = "region_deferred_reservation_in_a_private_tmpfs";
    let Some((success, text)) = in_a_private_mount_namespace(test, CHILD_ENV, "the deferred-reservation cases") else {
        return;
    };
    assert!(success && text.contains("room: ok") && text.contains("full: ok"), "child failed:\n{text}");
}
