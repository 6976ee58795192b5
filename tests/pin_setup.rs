//! Setting pinning up: typed errors for zero, misaligned and too large
//! values, row-aligned chunks, huge-page defaults, a region larger than
//! /dev/shm, and one /dev/shm region pinned by two ranks.

mod pin_common;
mod region_common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use kvoffload::internal::pin::{prepare, Prepared, MAX_CHUNK_LIMIT};
use kvoffload::internal::region::AnonOptions;
use kvoffload::{
    page_size, GpuRuntime, HugePages, Layout, PinError, PinOptions, PinState, Region, RegionError, ShmOptions,
    SimRuntime, DEFAULT_MAX_CHUNK_BYTES,
};
use pin_common::region;
use region_common::ShmGuard;

#[test]
fn defaults_are_documented_values() {
    let o = PinOptions::default();
    assert_eq!(o.max_chunk_bytes, DEFAULT_MAX_CHUNK_BYTES);
    const { assert!(DEFAULT_MAX_CHUNK_BYTES <= 4 << 30 && MAX_CHUNK_LIMIT < 512 << 30) };
    assert_eq!(o.threads, std::thread::available_parallelism().unwrap().get());
    assert_eq!(o.huge_pages, HugePages::Auto);
    o.validate().unwrap();
}

#[test]
fn zero_and_too_large_options_are_typed() {
    let (r, _) = region(2, 1 << 20);
    let cases =
        [(PinOptions::default().threads(0), "threads"), (PinOptions::default().max_chunk_bytes(0), "max_chunk_bytes")];
    for (o, what) in cases {
        match Prepared::new(&SimRuntime::new(), &r, &o) {
            Err(PinError::ZeroSize { what: w }) => assert_eq!(w, what),
            other => panic!("expected ZeroSize {what}, got {other:?}"),
        }
    }
    // Never one call of 512 GiB or more.
    for bad in [512usize << 30, MAX_CHUNK_LIMIT + 1] {
        match prepare(&SimRuntime::new(), &r, &PinOptions::default().max_chunk_bytes(bad)) {
            Err(e @ PinError::TooLarge { .. }) => {
                let PinError::TooLarge { what, value, limit } = e else { unreachable!() };
                assert_eq!((what, value, limit), ("max_chunk_bytes", bad as u64, MAX_CHUNK_LIMIT as u64));
            }
            Err(e) => panic!("expected TooLarge, got {e:?}"),
            Ok(_) => panic!("expected TooLarge, got a coordinator"),
        }
    }
    match Prepared::new(&SimRuntime::new(), &r, &PinOptions::default().threads(100_000)) {
        Err(PinError::TooLarge { what: "threads", .. }) => {}
        other => panic!("expected TooLarge threads, got {other:?}"),
    }
}

#[test]
fn chunk_bound_below_one_row_is_typed() {
    let p = page_size();
    let l = Layout::new(3, 2 * p, 4).unwrap(); // rows of 6 pages
    let r = Arc::new(Region::anonymous(l, &AnonOptions::new()).unwrap());
    match Prepared::new(&SimRuntime::new(), &r, &PinOptions::default().max_chunk_bytes(5 * p)) {
        Err(PinError::Region(RegionError::ChunkBoundBelowRow { max_bytes, row_bytes })) => {
            assert_eq!((max_bytes, row_bytes), (5 * p, 6 * p))
        }
        other => panic!("expected ChunkBoundBelowRow, got {other:?}"),
    }
}

#[test]
fn zero_and_misaligned_region_sizes_are_typed_before_pinning() {
    // A region cannot be zero-sized or misaligned: the layout refuses, and
    // the error converts into the pinning error unchanged.
    let zero: Result<Layout, PinError> = Layout::new(1, page_size(), 0).map_err(PinError::from);
    assert!(matches!(zero, Err(PinError::Region(RegionError::ZeroSize { what: "num_rows" }))));
    let mis: Result<Layout, PinError> = Layout::new(1, page_size() + 1, 4).map_err(PinError::from);
    match mis {
        Err(PinError::Region(RegionError::Misaligned { what, value, align })) => {
            assert_eq!((what, value, align), ("chunk_bytes", page_size() as u64 + 1, page_size() as u64))
        }
        other => panic!("expected Misaligned, got {other:?}"),
    }
    let e = Layout::from_bytes_per_rank(1, 0, page_size()).map_err(PinError::from).unwrap_err();
    assert!(e.to_string().contains("bytes_per_rank is zero"), "{e}");
}

#[test]
fn chunks_are_whole_rows_within_the_bound_and_cover_the_region() {
    let p = page_size();
    let l = Layout::new(3, 2 * p, 50).unwrap(); // rows of 6 pages
    let r = Arc::new(Region::anonymous(l, &AnonOptions::new()).unwrap());
    let max = 25 * p; // 4 rows per chunk (24 pages)
    let (coord, _pf) = prepare(&SimRuntime::new(), &r, &PinOptions::default().max_chunk_bytes(max)).unwrap();
    let n = coord.pinning().chunk_count();
    assert_eq!(n, 50usize.div_ceil(4));
    let mut next = r.as_ptr() as usize;
    for i in 0..n {
        let (a, len) = coord.pinning().chunk_range(i);
        assert_eq!(a, next);
        assert!(len <= max && len % l.row_bytes() == 0, "chunk {i}: {len} bytes");
        next = a + len;
    }
    assert_eq!(next, r.as_ptr() as usize + r.len());
    assert_eq!(coord.pinning().state(), PinState::Pending);
}

#[test]
fn huge_pages_auto_is_on_for_anonymous_off_for_shared() {
    let (r, o) = region(2, 2 << 20);
    let p = Prepared::new(&SimRuntime::new(), &r, &o).unwrap();
    // The advice is accepted wherever THP is compiled in.
    assert_eq!(p.huge_pages(), kvoffload::internal::pin::thp_setting("enabled").is_some());
    let p = Prepared::new(&SimRuntime::new(), &r, &o.clone().huge_pages(HugePages::Off)).unwrap();
    assert!(!p.huge_pages());

    let g = ShmGuard::new("pin-auto-huge");
    let s = Arc::new(Region::create(&g.name, Layout::new(1, page_size(), 16).unwrap(), 0, &ShmOptions::new()).unwrap());
    let p = Prepared::new(&SimRuntime::new(), &s, &PinOptions::default()).unwrap();
    assert!(!p.huge_pages(), "shared regions get no advice by default");
    drop(p);
    drop(s);
    g.assert_gone();
}

/// What an engine does: create or join, then prepare.
fn shm_setup(name: &str, layout: Layout) -> Result<(Arc<Region>, Prepared), PinError> {
    let r = Arc::new(Region::create(name, layout, 0, &ShmOptions::new().timeout(Duration::from_millis(200)))?);
    let p = Prepared::new(&SimRuntime::new(), &r, &PinOptions::default())?;
    Ok((r, p))
}

#[test]
fn region_larger_than_dev_shm_is_a_typed_error_and_leaves_no_file() {
    let g = ShmGuard::new("pin-toobig");
    let l = region_common::larger_than_dev_shm();
    match shm_setup(&g.name, l) {
        Err(PinError::Region(RegionError::ShmTooSmall { needed, available, .. })) => {
            assert!(needed > available, "{needed} > {available}")
        }
        Err(e) => panic!("expected ShmTooSmall, got {e:?}"),
        Ok(_) => panic!("a region larger than /dev/shm was created"),
    }
    g.assert_gone();
}

/// Runs `body` as rank 0 and rank 1 of the shared region `g.name`, each on
/// its own thread with its own simulated GPU (rank 0 creates the region,
/// rank 1 joins it); then checks that no region file is left.
fn as_two_ranks<F>(g: &ShmGuard, layout: Layout, opts: &ShmOptions, body: F)
where
    F: Fn(usize, Arc<Region>, Arc<SimRuntime>, Arc<dyn GpuRuntime>) + Clone + Send + 'static,
{
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let (name, opts, body) = (g.name.clone(), opts.clone(), body.clone());
            std::thread::spawn(move || {
                let r = Arc::new(if rank == 0 {
                    Region::create(&name, layout, 0, &opts).unwrap()
                } else {
                    Region::join(&name, layout, 1, &opts).unwrap()
                });
                let sim = Arc::new(SimRuntime::new());
                let rt: Arc<dyn GpuRuntime> = sim.clone();
                body(rank, r, sim, rt);
            })
        })
        .collect();
    for t in ranks {
        t.join().unwrap();
    }
    g.assert_gone();
}

#[test]
fn shared_region_pinned_by_two_ranks_sees_both_ranks_writes() {
    let g = ShmGuard::new("pin-two-ranks");
    let p = page_size();
    let layout = Layout::new(2, 4 * p, 8).unwrap(); // 8 rows of 2 x 4 pages
    let barrier = Arc::new(Barrier::new(2));
    let opts = ShmOptions::new().timeout(Duration::from_secs(10));
    as_two_ranks(&g, layout, &opts, move |rank, r, sim, rt| {
        let prep =
            Prepared::new(rt.as_ref(), &r, &PinOptions::default().max_chunk_bytes(3 * layout.row_bytes())).unwrap();
        // The 8 rows are one data file: units of at most a quarter of
        // it (2 rows), below the bound of 3 rows.
        assert_eq!(prep.chunks(), 4);
        let st = prep.spawn(rt.clone()).join();
        assert_eq!(st, PinState::Pinned, "rank {rank}");
        assert_eq!(sim.registered_ranges(), 4);
        // The coordinator holds the region now: this rank writes its own
        // chunks through their pointers (`own_chunk_mut` needs the only
        // reference).
        for c in 0..layout.num_rows() {
            let at = r.chunk_ptr(rank, c).unwrap();
            // SAFETY: rank `rank`'s chunk `c`: `layout.chunk_bytes()`
            // bytes of the live mapping (`r`), written by this rank
            // alone and borrowed by nothing meanwhile.
            unsafe { std::ptr::write_bytes(at.as_ptr(), (rank * 16 + c) as u8 + 1, layout.chunk_bytes()) };
        }
        barrier.wait();
        let other = 1 - rank;
        let mut buf = vec![0u8; 4 * p];
        for c in 0..layout.num_rows() {
            r.read_chunk(other, c, 0, &mut buf).unwrap();
            assert!(buf.iter().all(|b| *b == (other * 16 + c) as u8 + 1), "rank {rank} reads rank {other}'s chunk {c}");
        }
        barrier.wait();
        prep.coordinator().pinning().unregister_all(rt.as_ref()).unwrap();
        assert_eq!(sim.registered_ranges(), 0);
        drop(prep);
        drop(r);
    });
}

#[test]
fn shared_rank_major_region_pins_only_its_own_share() {
    use kvoffload::FileSplit;
    let g = ShmGuard::new("pin-share");
    let p = page_size();
    // Shares of 8 chunks of 2 pages, data files of 4 chunks: 2 files a rank.
    let layout = Layout::rank_major(2, 2 * p, 8).unwrap();
    let opts = ShmOptions::new().timeout(Duration::from_secs(10)).files(FileSplit::Multi { max_file_bytes: 8 * p });
    as_two_ranks(&g, layout, &opts, move |rank, r, sim, rt| {
        let prep = Prepared::new(rt.as_ref(), &r, &PinOptions::default().max_chunk_bytes(4 * p)).unwrap();
        assert_eq!(prep.bytes(), layout.bytes_per_rank(), "rank {rank}");
        // Units of at most a quarter file (2 pages here) and of the bound.
        assert_eq!(prep.chunks(), 8, "rank {rank}");
        let cores = std::thread::available_parallelism().unwrap().get();
        let threads = prep.prefaulter().unwrap().config().threads;
        assert_eq!(threads, (cores / 2).max(1), "ranks share the cores");
        assert_eq!(prep.spawn(rt.clone()).join(), PinState::Pinned);
        let base = r.as_ptr() as usize;
        let share = layout.rank_share(rank).unwrap();
        let other = layout.rank_share(1 - rank).unwrap();
        for c in (share.start..share.end).step_by(2 * p) {
            assert!(sim.is_registered(base + c, 2 * p), "rank {rank}: own chunk at {c}");
        }
        for c in (other.start..other.end).step_by(2 * p) {
            assert!(!sim.is_registered(base + c, 1), "rank {rank}: the other rank's chunk at {c}");
        }
        prep.coordinator().pinning().unregister_all(rt.as_ref()).unwrap();
        drop(prep);
        drop(r);
    });
}

/// Three pre-fault threads in four cores, never none, and the default
/// options take that share of this machine's cores.
#[test]
fn default_threads_are_three_in_four_cores() {
    use kvoffload::internal::pin::{available_cores, default_threads};
    let got: Vec<usize> = [0, 1, 2, 3, 4, 8, 16, 17, 128].into_iter().map(default_threads).collect();
    assert_eq!(got, [1, 1, 2, 3, 3, 6, 12, 13, 96]);
    assert_eq!(PinOptions::default().threads, default_threads(available_cores()));
}

/// Each setter sets its own field and leaves the others, and every limit
/// is inclusive: the largest value allowed validates.
#[test]
fn setters_set_their_field_and_limits_are_inclusive() {
    use kvoffload::internal::pin::MAX_THREADS;
    use kvoffload::CapturePolicy;
    let d = PinOptions::default();
    let o = d
        .clone()
        .policy(CapturePolicy::Interleave)
        .lookahead_bytes(3 << 20)
        .huge_fallback_mbps(700)
        .prefault_nice(7)
        .threads(5)
        .max_chunk_bytes(8 << 20);
    assert_eq!(
        (o.policy, o.lookahead_bytes, o.huge_fallback_mbps, o.prefault_nice, o.threads, o.max_chunk_bytes),
        (CapturePolicy::Interleave, 3 << 20, 700, 7, 5, 8 << 20)
    );
    assert_eq!((o.huge_pages, o.prefault, o.numa), (d.huge_pages, d.prefault, d.numa));
    d.clone().threads(MAX_THREADS).max_chunk_bytes(MAX_CHUNK_LIMIT).prefault_nice(19).validate().unwrap();
    d.clone().prefault_nice(0).validate().unwrap();
    assert!(d.clone().prefault_nice(20).validate().is_err());
}

/// What `Prepared` hands on: the options it was made with, a `Debug` that
/// names its parts, and a pre-faulter that passes the lookahead and the
/// hints through to the pool.
#[test]
fn prepared_hands_on_its_options_and_its_prefaulters_hints() {
    let (r, opts) = region(2, 1 << 20);
    let opts = opts.lookahead_bytes(3 << 20).threads(2);
    let p = Prepared::new(&SimRuntime::new(), &r, &opts).unwrap();
    assert_eq!(p.options(), &opts);
    let dbg = format!("{p:?}");
    assert!(
        dbg.starts_with("Prepared") && dbg.contains("chunks: 2") && dbg.contains("lookahead_bytes: 3145728"),
        "{dbg}"
    );
    let pf = p.prefault();
    assert_eq!(pf.lookahead_bytes(), 3 << 20);
    assert_eq!(p.prefaulter().unwrap().workers_running(), 0, "no worker before the first chunk is hinted");
    let (addr, len) = p.coordinator().pinning().chunk_range(1);
    pf.hint(1, addr, len);
    assert_eq!(p.prefaulter().unwrap().workers_running(), 2, "the hint started the pool");
    pf.settle();
}
