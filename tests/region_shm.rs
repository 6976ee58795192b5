//! The /dev/shm region within one process: ranks as threads (each with its
//! own mapping), capacity and name errors, stale files, timeouts, header
//! checks. Every test uses a unique name and a guard that removes the file
//! whatever happens; each asserts no file is left.

mod region_common;

use std::time::Duration;

use kvoffload::internal::region::{shm_path, AbandonNote, RegionKind, SHM_PREFIX};
use kvoffload::{
    page_size, AbandonReason, FileSplit, JoinPhase, Layout, Region, RegionError, ShmOptions, DEFAULT_SHM_DIR,
};
use region_common::{opts, page_rows, small, write_private, ShmGuard, SPLITS};

/// Header bytes of a multi-file region with few files: one page.
fn multi_header() -> usize {
    4096.max(page_size())
}

#[test]
fn single_rank_region_is_unlinked_at_create() {
    let g = ShmGuard::new("single");
    assert!(g.path.file_name().unwrap().to_str().unwrap().starts_with(SHM_PREFIX));
    let mut r = Region::create(&g.name, small(1, 2), 0, &opts(1000)).unwrap();
    g.assert_gone();
    assert_eq!(r.kind(), RegionKind::Shared);
    assert!(!r.is_linked());
    assert_eq!(r.path(), Some(g.path.as_path()));
    assert_eq!(r.mapped_ranks(), vec![0]);
    assert_eq!(r.rank_pids().unwrap(), vec![std::process::id()]);
    assert_eq!(r.rank_slots().unwrap().len(), 1);
    assert!(r.as_slice().is_none());
    // The header page precedes the data.
    assert_eq!(r.mapping_range().len(), r.len() + 4096.max(page_size()));
    assert_eq!(r.as_ptr() as usize % page_size(), 0);
    r.own_chunk_mut(1).unwrap().fill(0xab);
    assert!(r.own_chunk(1).unwrap().iter().all(|b| *b == 0xab));
}

#[test]
fn region_ranks_as_threads_see_each_others_writes_and_file_goes() {
    let g = ShmGuard::new("threads");
    let n = 3;
    let l = small(n, 4);
    let regions: Vec<Region> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let name = g.name.clone();
                s.spawn(move || {
                    if rank == 0 {
                        Region::create(&name, l, 0, &opts(10_000))
                    } else {
                        Region::join(&name, l, rank, &opts(10_000))
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    g.assert_gone();
    let mut regions = regions;
    for (rank, r) in regions.iter_mut().enumerate() {
        assert_eq!(r.rank(), rank);
        assert_eq!(r.mapped_ranks(), vec![0, 1, 2]);
        for c in 0..4 {
            r.own_chunk_mut(c).unwrap().fill((rank * 16 + c) as u8);
        }
    }
    let pids = regions[0].rank_pids().unwrap();
    assert_eq!(pids, vec![std::process::id(); 3]);
    // Every mapping sees every rank's chunks.
    for r in &regions {
        for rank in 0..n {
            for c in 0..4 {
                let mut buf = vec![0u8; page_size()];
                r.read_chunk(rank, c, 0, &mut buf).unwrap();
                assert!(buf.iter().all(|b| *b == (rank * 16 + c) as u8));
            }
        }
    }
    // The reserved per-rank words are shared too.
    regions[1].rank_slots().unwrap()[1].store(5, std::sync::atomic::Ordering::Release);
    assert_eq!(regions[2].rank_slots().unwrap()[1].load(std::sync::atomic::Ordering::Acquire), 5);
    drop(regions);
    g.assert_gone();
}

#[test]
fn region_bigger_than_shm_is_typed_and_leaves_no_file() {
    let g = ShmGuard::new("toobig");
    let l = region_common::larger_than_dev_shm();
    match Region::create(&g.name, l, 0, &opts(100)) {
        Err(e @ RegionError::ShmTooSmall { .. }) => {
            let RegionError::ShmTooSmall { needed, available, ref dir } = e else { unreachable!() };
            assert!(needed > available && needed >= l.data_bytes() as u64);
            assert_eq!(dir, std::path::Path::new(DEFAULT_SHM_DIR));
            let msg = e.to_string();
            assert!(msg.contains(&needed.to_string()) && msg.contains(&available.to_string()), "{msg}");
        }
        other => panic!("expected ShmTooSmall, got {other:?}"),
    }
    g.assert_gone();
}

#[test]
fn region_stale_file_is_reported_and_force_replaces_it() {
    let g = ShmGuard::new("stale");
    std::fs::write(&g.path, b"left by a crashed run").unwrap();
    match Region::create(&g.name, small(1, 1), 0, &opts(100)) {
        Err(e @ RegionError::AlreadyExists { .. }) => {
            assert!(e.to_string().contains(g.path.to_str().unwrap()));
        }
        other => panic!("expected AlreadyExists, got {other:?}"),
    }
    assert!(g.listed(), "a refused create must not remove the existing file");
    let r = Region::create(&g.name, small(1, 1), 0, &opts(100).force(true)).unwrap();
    g.assert_gone();
    drop(r);
}

/// Rank 1's join of `g`'s region (layout `l`) times out waiting in
/// `phase`; the ranks it found missing.
fn rank_1_timed_out(g: &ShmGuard, l: Layout, o: &ShmOptions, phase: JoinPhase) -> Vec<usize> {
    match Region::join(&g.name, l, 1, o) {
        Err(RegionError::JoinTimeout { phase: got, missing, .. }) if got == phase => missing,
        other => panic!("expected JoinTimeout in {phase:?}, got {other:?}"),
    }
}

/// The ranks mapped when the region was abandoned, the error `r` must be.
fn abandoned<T: std::fmt::Debug>(r: Result<T, RegionError>) -> Vec<usize> {
    match r {
        Err(RegionError::Abandoned { mapped, .. }) => mapped,
        other => panic!("expected Abandoned, got {other:?}"),
    }
}

#[test]
fn region_join_times_out_when_the_file_never_appears() {
    let g = ShmGuard::new("noappear");
    assert_eq!(rank_1_timed_out(&g, small(2, 1), &opts(100), JoinPhase::FileToAppear), vec![0, 1]);
    g.assert_gone();
}

#[test]
fn region_creator_times_out_and_unlinks_when_a_rank_never_maps() {
    let g = ShmGuard::new("nojoiner");
    match Region::create(&g.name, small(3, 1), 0, &opts(150)) {
        Err(e @ RegionError::JoinTimeout { .. }) => {
            let RegionError::JoinTimeout { phase, ref mapped, ref missing, .. } = e else { unreachable!() };
            assert_eq!(phase, JoinPhase::RanksToMap);
            assert_eq!((mapped.clone(), missing.clone()), (vec![0], vec![1, 2]));
            assert!(e.to_string().contains("no file left behind"));
        }
        other => panic!("expected JoinTimeout, got {other:?}"),
    }
    g.assert_gone();
}

#[test]
fn region_joiner_unlinks_a_file_the_creator_never_sized() {
    // What a creator killed between open(O_EXCL) and ftruncate leaves.
    let g = ShmGuard::new("unsized");
    write_private(&g.path, b"");
    rank_1_timed_out(&g, small(2, 1), &opts(150), JoinPhase::FileToBeSized);
    g.assert_gone();
}

#[test]
fn region_joiner_unlinks_a_file_the_creator_never_initialised() {
    // What a creator killed between ftruncate and publishing READY leaves.
    let g = ShmGuard::new("uninit");
    let l = small(2, 1);
    write_private(&g.path, &vec![0u8; l.data_bytes() + 4096.max(page_size())]);
    rank_1_timed_out(&g, l, &opts(150).files(FileSplit::Single), JoinPhase::CreatorToInitialise);
    g.assert_gone();
}

#[test]
fn region_joiner_removes_the_data_files_of_a_creator_that_died_creating_them() {
    // What a creator killed while creating data files leaves: the header
    // (state Init) with data file 0 recorded in the table, data file 1
    // created but not recorded yet (empty), and no file 2 yet. A file 3 of
    // someone else (not empty, not recorded) must stay.
    use std::os::unix::fs::MetadataExt;
    let g = ShmGuard::new("diedcreating");
    let (p, l) = page_rows(2, 2);
    let split = FileSplit::Multi { max_file_bytes: p }; // 4 files of one page
    write_private(&g.data_path(0), &vec![0u8; p]);
    write_private(&g.data_path(1), b"");
    std::fs::write(g.data_path(3), b"someone else's").unwrap();
    let ino0 = std::fs::metadata(g.data_path(0)).unwrap().ino();
    let mut header = vec![0u8; multi_header()];
    header[384..392].copy_from_slice(&ino0.to_ne_bytes()); // file table, entry 0
    write_private(&g.path, &header);
    match Region::join(&g.name, l, 1, &opts(150).files(split)) {
        Err(RegionError::JoinTimeout { phase: JoinPhase::CreatorToInitialise, .. }) => {}
        other => panic!("expected JoinTimeout, got {other:?}"),
    }
    let left = g.files();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].ends_with(".3"), "{left:?}");
}

#[test]
fn region_header_mismatches_are_typed() {
    for split in SPLITS {
        let g = ShmGuard::new("mismatch");
        let p = page_size();
        let o = |ms| opts(ms).files(split);
        // 2 ranks x 1 page x 2 rows; the creator does not wait for the others.
        let creator = Region::create(&g.name, small(2, 2), 0, &o(5000).wait_for_all(false).session(7)).unwrap();
        assert!(g.listed());
        // Different total size: the one file's size, or the header's record
        // (the header file alone has the same size).
        match (Region::join(&g.name, small(2, 3), 1, &o(200).session(7)), split) {
            (Err(RegionError::BadHeader { field: "file size", expected, found, .. }), FileSplit::Single) => {
                assert_eq!(found as usize, 4 * p + 4096.max(p));
                assert_eq!(expected as usize, 6 * p + 4096.max(p));
            }
            (Err(RegionError::BadHeader { field: "total_bytes", expected, found, .. }), FileSplit::Multi { .. }) => {
                assert_eq!(found as usize, 4 * p + multi_header());
                assert_eq!(expected as usize, 6 * p + multi_header());
            }
            (other, _) => panic!("{split:?}: expected BadHeader(file size / total_bytes), got {other:?}"),
        }
        // Same total, other shape.
        match Region::join(&g.name, small(4, 1), 1, &o(200).session(7)) {
            Err(RegionError::BadHeader { field: "num_ranks", expected: 4, found: 2, .. }) => {}
            other => panic!("{split:?}: expected BadHeader(num_ranks), got {other:?}"),
        }
        // Same sizes, other order.
        if let FileSplit::Multi { .. } = split {
            match Region::join(
                &g.name,
                small(2, 2).with_order(kvoffload::internal::region::Order::RankMajor),
                1,
                &o(200).session(7),
            ) {
                Err(RegionError::BadHeader { field: "order", expected: 1, found: 0, .. }) => {}
                other => panic!("expected BadHeader(order), got {other:?}"),
            }
        }
        // Another launch's session.
        match Region::join(&g.name, small(2, 2), 1, &o(200).session(8)) {
            Err(RegionError::BadHeader { field: "session", expected: 8, found: 7, .. }) => {}
            other => panic!("{split:?}: expected BadHeader(session), got {other:?}"),
        }
        // Rank 0 is the creator's.
        match Region::join(&g.name, small(2, 2), 0, &o(200).session(7)) {
            Err(RegionError::RankAlreadyMapped { rank: 0, .. }) => {}
            other => panic!("{split:?}: expected RankAlreadyMapped, got {other:?}"),
        }
        // None of the refused joiners removed a file or broke the region.
        assert!(g.listed());
        assert_eq!(g.files().len(), if split == FileSplit::Single { 1 } else { 2 });
        let joiner = Region::join(&g.name, small(2, 2), 1, &o(2000).session(7)).unwrap();
        g.assert_gone();
        drop((creator, joiner));
    }
}

#[test]
fn region_foreign_file_with_bad_magic_is_refused_and_left_alone() {
    for split in SPLITS {
        let g = ShmGuard::new("magic");
        let l = small(1, 1);
        let total = match split {
            FileSplit::Single => l.data_bytes() + 4096.max(page_size()),
            FileSplit::Multi { .. } => multi_header(),
        };
        let mut bytes = vec![0u8; total];
        bytes[..8].copy_from_slice(b"NOTOURS!");
        bytes[64 + 4..64 + 8].copy_from_slice(&1u32.to_ne_bytes()); // join state READY
        write_private(&g.path, &bytes);
        match Region::join(&g.name, l, 0, &opts(200).files(split)) {
            Err(RegionError::BadHeader { field: "magic", .. }) => {}
            other => panic!("{split:?}: expected BadHeader(magic), got {other:?}"),
        }
        assert!(g.listed(), "a joiner must not remove a file that is not a region");
    }
}

#[test]
fn region_dropping_or_unlinking_before_all_mapped_abandons() {
    let p = opts(3000).wait_for_all(false);
    // unlink_now: the file goes, the memory stays usable, late joiners fail.
    let g = ShmGuard::new("unlinknow");
    let mut creator = Region::create(&g.name, small(3, 1), 0, &p).unwrap();
    let mut joiner = Region::join(&g.name, small(3, 1), 1, &p).unwrap();
    assert_eq!(creator.mapped_ranks(), vec![0, 1]);
    assert!(creator.unlink_now().unwrap());
    g.assert_gone();
    assert!(!creator.is_linked());
    creator.own_chunk_mut(0).unwrap().fill(3);
    let mut b = [0u8];
    joiner.read_chunk(0, 0, 0, &mut b).unwrap();
    assert_eq!(b[0], 3);
    assert_eq!(abandoned(joiner.wait_all_mapped(Duration::from_secs(2))), vec![0, 1]);
    match Region::join(&g.name, small(3, 1), 2, &opts(100)) {
        Err(RegionError::JoinTimeout { phase: JoinPhase::FileToAppear, .. }) => {}
        other => panic!("expected JoinTimeout, got {other:?}"),
    }
    drop((creator, joiner));

    // Drop of the creator before the others joined.
    let g = ShmGuard::new("dropearly");
    let creator = Region::create(&g.name, small(2, 1), 0, &p).unwrap();
    assert!(g.listed());
    drop(creator);
    g.assert_gone();
}

#[test]
fn region_wait_all_mapped_later() {
    let g = ShmGuard::new("waitlater");
    let p = opts(3000).wait_for_all(false);
    let mut creator = Region::create(&g.name, small(2, 1), 0, &p).unwrap();
    assert!(creator.is_linked());
    let joiner = std::thread::scope(|s| s.spawn(|| Region::join(&g.name, small(2, 1), 1, &p).unwrap()).join().unwrap());
    // The joiner completed the mask and unlinked the file itself.
    g.assert_gone();
    creator.wait_all_mapped(Duration::from_secs(1)).unwrap();
    assert!(!creator.is_linked());
    drop((creator, joiner));
}

#[test]
fn region_huge_page_option_aligns_the_data_to_2mib() {
    let g = ShmGuard::new("huge");
    let l = Layout::new(1, 2 << 20, 1).unwrap();
    let r = Region::create(&g.name, l, 0, &opts(1000).huge_pages(true).files(FileSplit::Single)).unwrap();
    g.assert_gone();
    let base = r.mapping_range().as_ptr() as usize;
    assert_eq!(r.as_ptr() as usize - base, 2 << 20);
    assert_eq!(r.mapping_range().len(), 4 << 20);
    // Data files start at their offset 0: the header stays one page and the
    // data area's address is 2 MiB aligned, with or without the option.
    for huge in [true, false] {
        let g = ShmGuard::new("huge-multi");
        let r = Region::create(&g.name, l, 0, &opts(1000).huge_pages(huge)).unwrap();
        g.assert_gone();
        assert_eq!(r.as_ptr() as usize % (2 << 20), 0);
        assert_eq!(r.as_ptr() as usize - r.mapping_range().as_ptr() as usize, multi_header());
        assert_eq!(r.mapping_range().len(), (2 << 20) + multi_header());
    }
}

#[test]
fn region_bad_names_and_ranks_are_typed() {
    let g = ShmGuard::new("badrank");
    assert!(matches!(
        Region::create(&g.name, small(2, 1), 2, &opts(100)),
        Err(RegionError::RankOutOfRange { rank: 2, num_ranks: 2 })
    ));
    assert!(matches!(
        Region::join(&g.name, small(2, 1), 5, &opts(100)),
        Err(RegionError::RankOutOfRange { rank: 5, num_ranks: 2 })
    ));
    for bad in ["", "a/b", "nul\0", &"x".repeat(201)] {
        assert!(matches!(Region::create(bad, small(1, 1), 0, &opts(100)), Err(RegionError::BadName { .. })));
    }
    assert!(shm_path(std::path::Path::new("/dev/shm"), "ok-name").is_ok());
    g.assert_gone();
}

#[test]
fn region_joiner_seeing_abandoned_unlinks_what_the_abandoner_left() {
    // The abandoning rank may die between its CAS and its unlink. Model the
    // file it leaves with a second hard link to an abandoned region.
    let g = ShmGuard::new("abandoned");
    let left = ShmGuard::new("abandoned-left");
    let p = opts(3000).wait_for_all(false);
    let mut creator = Region::create(&g.name, small(2, 1), 0, &p).unwrap();
    std::fs::hard_link(&g.path, &left.path).unwrap();
    assert!(creator.unlink_now().unwrap());
    g.assert_gone();
    assert!(left.listed());
    assert_eq!(abandoned(Region::join(&left.name, small(2, 1), 1, &opts(1000))), vec![0]);
    left.assert_gone();
    drop(creator);
}

#[test]
fn region_multi_file_rank_major_maps_contiguously_and_every_file_goes() {
    let g = ShmGuard::new("multi");
    let p = page_size();
    let n = 2;
    // Shares of 5 chunks of 2 pages, files of at most 2 chunks: 3 files a rank.
    let l = Layout::rank_major(n, 2 * p, 5).unwrap();
    let o = opts(10_000).files(FileSplit::Multi { max_file_bytes: 4 * p }).wait_for_all(true);
    let mut regions: Vec<Region> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (name, o) = (g.name.clone(), o.clone());
                s.spawn(
                    move || {
                        if rank == 0 {
                            Region::create(&name, l, 0, &o)
                        } else {
                            Region::join(&name, l, rank, &o)
                        }
                    },
                )
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    g.assert_gone();
    assert_eq!(regions[0].file_paths().len(), 1 + 6);
    assert!(regions.iter().all(|r| !r.is_linked()));
    for (rank, r) in regions.iter_mut().enumerate() {
        assert_eq!(r.chunk_ptr(rank, 1).unwrap().as_ptr() as usize - r.as_ptr() as usize, rank * 10 * p + 2 * p);
        for c in 0..5 {
            r.own_chunk_mut(c).unwrap().fill((rank * 16 + c) as u8);
        }
    }
    for r in &regions {
        for rank in 0..n {
            for c in 0..5 {
                let mut buf = vec![0u8; 2 * p];
                r.read_chunk(rank, c, 0, &mut buf).unwrap();
                assert!(buf.iter().all(|b| *b == (rank * 16 + c) as u8), "rank {rank} chunk {c}");
            }
        }
    }
    // Each rank pins its own share: its files' first chunks first.
    for (rank, r) in regions.iter().enumerate() {
        let ranges = r.pin_ranges(2 * p).unwrap();
        let base = r.as_ptr() as usize;
        let got: Vec<(usize, usize, Option<usize>)> =
            ranges.iter().map(|x| ((x.range.as_ptr() as usize - base) / p, x.range.len() / p, x.file)).collect();
        let s = rank * 10;
        let f = rank * 3;
        let want = vec![
            (s, 2, Some(f)),
            (s + 4, 2, Some(f + 1)),
            (s + 8, 2, Some(f + 2)),
            (s + 2, 2, Some(f)),
            (s + 6, 2, Some(f + 1)),
        ];
        assert_eq!(got, want, "rank {rank}");
        let total: usize = ranges.iter().map(|x| x.range.len()).sum();
        assert_eq!(total, l.bytes_per_rank());
        assert!(matches!(r.pin_ranges(p), Err(RegionError::ChunkBoundBelowRow { .. })));
    }
    drop(regions);
    g.assert_gone();
}

#[test]
fn region_multi_file_stale_data_file_is_reported_and_force_replaces_it() {
    let g = ShmGuard::new("stale-data");
    let (p, l) = page_rows(1, 4);
    let o = opts(1000).files(FileSplit::Multi { max_file_bytes: 2 * p });
    std::fs::write(g.data_path(1), b"left by a crashed run").unwrap();
    match Region::create(&g.name, l, 0, &o) {
        Err(RegionError::AlreadyExists { path }) => assert_eq!(path, g.data_path(1)),
        other => panic!("expected AlreadyExists, got {other:?}"),
    }
    // The refused create removed what it had made, and only that.
    assert_eq!(g.files(), vec![format!("{}.1", g.path.file_name().unwrap().to_str().unwrap())]);
    let r = Region::create(&g.name, l, 0, &o.force(true)).unwrap();
    g.assert_gone();
    drop(r);
}

#[test]
fn region_joiner_refuses_a_data_file_that_is_not_the_creators_and_leaves_it() {
    let g = ShmGuard::new("swapped");
    let (p, l) = page_rows(2, 2);
    let o = opts(3000).files(FileSplit::Multi { max_file_bytes: p }).wait_for_all(false);
    let creator = Region::create(&g.name, l, 0, &o).unwrap();
    // Someone replaces data file 2 (rank 1's first) with a file of the same size.
    let other = g.dir.join(format!("{}-other", g.name));
    write_private(&other, &vec![0u8; p]);
    std::fs::rename(&other, g.data_path(2)).unwrap();
    match Region::join(&g.name, l, 1, &o) {
        Err(RegionError::BadHeader { field: "data file inode", .. }) => {}
        other => panic!("expected BadHeader(data file inode), got {other:?}"),
    }
    assert_eq!(g.files().len(), 5, "the refused joiner removed nothing");
    drop(creator);
    // The creator removes its own files; the replaced one is not its own.
    let left = g.files();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].ends_with(".2"));
}

#[test]
fn region_joiner_refuses_a_data_file_of_the_wrong_size_or_a_missing_one() {
    let (p, l) = page_rows(2, 2);
    let o = opts(3000).files(FileSplit::Multi { max_file_bytes: p }).wait_for_all(false);
    // Resized after the creator recorded it: the inode matches, the size not.
    let g = ShmGuard::new("resized");
    let creator = Region::create(&g.name, l, 0, &o).unwrap();
    std::fs::OpenOptions::new().write(true).open(g.data_path(3)).unwrap().set_len(3 * p as u64).unwrap();
    match Region::join(&g.name, l, 1, &o) {
        Err(RegionError::BadHeader { field: "data file size", expected, found, .. }) => {
            assert_eq!((expected, found), (p as u64, 3 * p as u64))
        }
        other => panic!("expected BadHeader(data file size), got {other:?}"),
    }
    assert_eq!(g.files().len(), 5, "the refused joiner removed nothing");
    drop(creator);
    g.assert_gone();
    // Issue 28: the refusing joiner abandons the region with a note of why,
    // so the creator, waiting for every rank, fails at once with the reason
    // (before, it waited its whole join timeout: JoinTimeout here).
    let g = ShmGuard::new("resized-wait");
    let mut creator = Region::create(&g.name, l, 0, &o).unwrap();
    std::fs::OpenOptions::new().write(true).open(g.data_path(3)).unwrap().set_len(3 * p as u64).unwrap();
    assert!(matches!(Region::join(&g.name, l, 1, &o), Err(RegionError::BadHeader { field: "data file size", .. })));
    match creator.wait_all_mapped(Duration::from_secs(5)) {
        Err(e @ RegionError::Abandoned { .. }) => {
            let RegionError::Abandoned { ref by, .. } = e else { unreachable!() };
            assert_eq!(*by, Some(AbandonNote { rank: 1, reason: AbandonReason::RefusedDataFile { file: 3 } }));
            assert!(e.to_string().contains("rank 1 refused data file 3"), "{e}");
        }
        other => panic!("expected Abandoned with the joiner's note, got {other:?}"),
    }
    // The creator removed its own files (every file here is its inode).
    g.assert_gone();
    drop(creator);
    // Removed after the creator made it: the joiner says which, abandons
    // the region and removes what it opened; the creator the rest.
    let g = ShmGuard::new("missing");
    let mut creator = Region::create(&g.name, l, 0, &o).unwrap();
    std::fs::remove_file(g.data_path(1)).unwrap();
    match Region::join(&g.name, l, 1, &o) {
        Err(RegionError::FileMissing { path }) => assert_eq!(path, g.data_path(1)),
        other => panic!("expected FileMissing, got {other:?}"),
    }
    assert_eq!(abandoned(creator.wait_all_mapped(Duration::from_secs(2))), vec![0]);
    g.assert_gone();
    drop(creator);
}

#[test]
fn region_joiner_with_another_file_split_is_refused() {
    let (p, l) = page_rows(2, 4);
    let g = ShmGuard::new("split");
    let o = |bytes| opts(3000).files(FileSplit::Multi { max_file_bytes: bytes }).wait_for_all(false);
    let creator = Region::create(&g.name, l, 0, &o(2 * p)).unwrap(); // 4 files of 2 pages
    match Region::join(&g.name, l, 1, &o(p)) {
        Err(RegionError::BadHeader { field: "num_files", expected: 8, found: 4, .. }) => {}
        other => panic!("expected BadHeader(num_files), got {other:?}"),
    }
    // One file against data files: the header file's size differs.
    match Region::join(&g.name, l, 1, &opts(300).files(FileSplit::Single)) {
        Err(RegionError::BadHeader { field: "file size", .. }) => {}
        other => panic!("expected BadHeader(file size), got {other:?}"),
    }
    assert_eq!(g.files().len(), 5);
    drop(creator);
    g.assert_gone();
    // As many files, cut elsewhere: 3 + 1 pages against 2 + 2.
    let g = ShmGuard::new("split-bytes");
    let creator = Region::create(&g.name, l, 0, &o(3 * p)).unwrap();
    match Region::join(&g.name, l, 1, &o(2 * p)) {
        Err(RegionError::BadHeader { field: "file_bytes", expected, found, .. }) => {
            assert_eq!((expected, found), (2 * p as u64, 3 * p as u64))
        }
        other => panic!("expected BadHeader(file_bytes), got {other:?}"),
    }
    drop(creator);
    g.assert_gone();
}

/// Reads the u32 at `off` of a region's header file.
fn header_u32(path: &std::path::Path, off: u64) -> u32 {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 4];
    std::fs::File::open(path).unwrap().read_exact_at(&mut b, off).unwrap();
    u32::from_ne_bytes(b)
}

/// Reads the u64 at `off` of a region's header file.
fn header_u64(path: &std::path::Path, off: u64) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 8];
    std::fs::File::open(path).unwrap().read_exact_at(&mut b, off).unwrap();
    u64::from_ne_bytes(b)
}

/// Writes `bytes` at `off` of a region's header file (a hostile or broken
/// writer; the creator's mapping sees it).
fn poke(path: &std::path::Path, off: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new().write(true).open(path).unwrap().write_all_at(bytes, off).unwrap();
}

/// The join word at offset 64: state in the high half, mask in the low.
fn join_word(state: u32, mask: u32) -> [u8; 8] {
    (((state as u64) << 32) | mask as u64).to_ne_bytes()
}

/// A region of two ranks (`small(2, 1)`) created as rank 0 under a guard
/// tagged `tag`, split as `split` (the default with `None`), options
/// without waiting for all ranks: the guard, the options, the creator.
fn created_of_two(tag: &str, split: Option<FileSplit>) -> (ShmGuard, ShmOptions, Region) {
    let g = ShmGuard::new(tag);
    let mut o = opts(3000);
    if let Some(split) = split {
        o = o.files(split);
    }
    let o = o.wait_for_all(false);
    let creator = Region::create(&g.name, small(2, 1), 0, &o).unwrap();
    (g, o, creator)
}

/// Issue 28, item 8: a join refused on the join state claims nothing: the
/// pid word of its rank (offset 128 + 4 rank) stays 0, so the real rank
/// joins once the state is right again (before the fix the refused joiner
/// had written its pid first and the real rank got `RankAlreadyMapped`).
#[test]
fn region_join_refused_on_the_join_state_leaves_no_pid_word() {
    for split in SPLITS {
        let (g, o, creator) = created_of_two("pidmark", Some(split));
        // A state no code writes, with the creator's bit.
        poke(&g.path, 64, &join_word(7, 1));
        match Region::join(&g.name, small(2, 1), 1, &o) {
            Err(RegionError::BadHeader { field: "join state", .. }) => {}
            other => panic!("{split:?}: expected BadHeader(join state), got {other:?}"),
        }
        assert_eq!(header_u32(&g.path, 128 + 4), 0, "{split:?}: the refused joiner left its pid word");
        assert!(g.listed(), "{split:?}: the refused joiner removed the files");
        poke(&g.path, 64, &join_word(1, 1));
        let joiner = Region::join(&g.name, small(2, 1), 1, &o).unwrap();
        assert_eq!(joiner.rank_pids().unwrap(), vec![std::process::id(); 2]);
        g.assert_gone();
        drop((creator, joiner));
    }
}

/// Issue 28: `creator_rank` must name one of the region's ranks
/// (creator_rank = 1000 was accepted); refused, the files left alone.
#[test]
fn region_join_refuses_a_creator_rank_out_of_range() {
    let (g, o, creator) = created_of_two("crank", None);
    poke(&g.path, 44, &1000u32.to_ne_bytes());
    match Region::join(&g.name, small(2, 1), 1, &o) {
        Err(e @ RegionError::HeaderOutOfRange { field: "creator_rank", found: 1000, limit: 2, .. }) => {
            assert!(e.to_string().contains("creator_rank is 1000, must be below 2"), "{e}");
        }
        other => panic!("expected HeaderOutOfRange(creator_rank), got {other:?}"),
    }
    assert!(g.listed());
    assert_eq!(header_u32(&g.path, 128 + 4), 0);
    drop(creator);
    g.assert_gone();
}

/// Issue 28: a region whose creator is dead is refused at join with a
/// typed error naming its pid (it was joined, and the failure showed only
/// later), and abandoned and removed: stale, nobody can finish it.
#[test]
fn region_join_refuses_a_region_whose_creator_is_dead() {
    for split in SPLITS {
        let (g, o, creator) = created_of_two("deadcreator", Some(split));
        // A pid that was a process and is gone (reaped).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        poke(&g.path, 56, &dead.to_ne_bytes());
        match Region::join(&g.name, small(2, 1), 1, &o) {
            Err(e @ RegionError::CreatorDied { .. }) => {
                let RegionError::CreatorDied { pid, .. } = e else { unreachable!() };
                assert_eq!(pid, dead);
                assert!(e.to_string().contains(&format!("pid {dead}")), "{e}");
            }
            other => panic!("{split:?}: expected CreatorDied, got {other:?}"),
        }
        g.assert_gone();
        drop(creator);
    }
}

/// Issue 28: a creator's pid means nothing in another pid namespace (two
/// containers that share /dev/shm): a joiner there does not call the
/// creator dead by its pid. The same dead pid as above, with the header
/// naming another namespace: the join goes on.
#[test]
fn region_join_does_not_judge_a_creator_of_another_pid_namespace_by_its_pid() {
    let (g, o, creator) = created_of_two("otherns", None);
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    poke(&g.path, 56, &dead.to_ne_bytes());
    let ns = header_u64(&g.path, 104);
    assert_ne!(ns, 0, "the creator records its pid namespace");
    poke(&g.path, 104, &(ns ^ 1).to_ne_bytes());
    let joiner = Region::join(&g.name, small(2, 1), 1, &o);
    assert!(joiner.is_ok(), "joined: {:?}", joiner.err());
    drop(joiner);
    drop(creator);
    g.assert_gone();
}

// ---- the header parser against hostile headers (issue 28, deliver 6) ----

/// A header field: offset, width in bytes, and the value a valid region of
/// [`fuzz_layout`] made by this process has there.
struct Field {
    off: usize,
    width: usize,
    valid: u64,
}

/// Two ranks, one page each, one row: the joiner is rank 1.
fn fuzz_layout() -> Layout {
    small(2, 1)
}

/// The fields of a valid one-file header of [`fuzz_layout`] whose creator
/// is this process, rank 0 mapped (join word Ready, mask 1).
fn fuzz_fields() -> Vec<Field> {
    let p = page_size() as u64;
    let hb = 4096.max(p);
    let f = |off, width, valid| Field { off, width, valid };
    vec![
        f(0, 8, kvoffload::internal::region::header::MAGIC),
        f(8, 4, kvoffload::internal::region::header::VERSION as u64),
        f(12, 4, hb),
        f(16, 8, hb + 2 * p),
        f(24, 8, p),
        f(32, 8, 1),
        f(40, 4, 2),
        f(44, 4, 0),
        f(48, 8, 0),
        f(56, 4, std::process::id() as u64),
        f(64, 8, 1 << 32 | 1),
        f(72, 8, 0),
        f(80, 8, 0),
        f(88, 8, 0),
        f(96, 8, 0),
        f(128, 4, std::process::id() as u64),
        f(132, 4, 0),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: 256, ..Default::default() })]

    /// Whatever a header says, a joiner returns (within its timeout), never
    /// panics, and gives a typed error or a region that is right: it joins
    /// only a header whose every field is what this rank expects, with a
    /// creator rank below the ranks and a live creator; a header it refuses
    /// as not its own (BadHeader, HeaderOutOfRange, UntrustedFile) is left
    /// byte for byte as it was; and a refused join never leaves its pid in
    /// the header.
    #[test]
    fn region_join_of_a_hostile_header_is_typed_and_leaves_no_mark(
        // Up to two fields made hostile (any bits, a small number, or the
        // valid value off by one); the rest valid, so that a defect in one
        // check is reached.
        mutations in proptest::collection::vec((0usize..17, 0u8..4, proptest::prelude::any::<u64>()), 0..3),
        flips in proptest::collection::vec((0usize..512, proptest::prelude::any::<u8>()), 0..2),
    ) {
        let fields = fuzz_fields();
        let l = fuzz_layout();
        let len = 4096.max(page_size()) + l.data_bytes();
        let mut values: Vec<u64> = fields.iter().map(|f| f.valid).collect();
        for &(i, kind, raw) in &mutations {
            values[i] = match kind {
                0 => raw,
                1 => raw % 40,
                2 => values[i].wrapping_add(1),
                _ => values[i].wrapping_sub(1),
            };
        }
        let mut bytes = vec![0u8; len];
        for (f, v) in fields.iter().zip(&values) {
            bytes[f.off..f.off + f.width].copy_from_slice(&v.to_ne_bytes()[..f.width]);
        }
        for (off, b) in &flips {
            bytes[*off] = *b;
        }
        let g = ShmGuard::new("fuzz");
        write_private(&g.path, &bytes);
        let res = Region::join(&g.name, l, 1, &opts(20).files(FileSplit::Single));
        let after = std::fs::read(&g.path).ok();
        match &res {
            Ok(_) => {
                // Every field the joiner checks was valid.
                let read = |off: usize, width: usize| {
                    let mut b = [0u8; 8];
                    b[..width].copy_from_slice(&bytes[off..off + width]);
                    u64::from_ne_bytes(b)
                };
                for f in fields.iter().filter(|f| ![64, 96, 128, 132].contains(&f.off)) {
                    let found = read(f.off, f.width);
                    if f.off == 44 {
                        proptest::prop_assert!(found < 2, "joined with creator_rank {found}");
                    } else if f.off == 56 {
                        proptest::prop_assert!(found != 0, "joined with no creator pid");
                    } else {
                        proptest::prop_assert_eq!(found, f.valid, "joined with field at {} wrong", f.off);
                    }
                }
            }
            Err(RegionError::BadHeader { .. } | RegionError::HeaderOutOfRange { .. } | RegionError::UntrustedFile { .. }) => {
                proptest::prop_assert!(after.as_deref() == Some(&bytes[..]), "a refused header was changed or removed: {res:?}");
            }
            Err(_) => {}
        }
        if let (Err(_), Some(after)) = (&res, &after) {
            // No pid claimed by the refused rank 1.
            proptest::prop_assert_eq!(&after[132..136], &bytes[132..136], "the refused joiner left its pid word: {:?}", res);
        }
        drop(res);
    }
}
