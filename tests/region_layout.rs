//! Pointer/offset math of the region layout, checked against a plain
//! reference that lays the rows out one slot at a time; plus the typed
//! errors for zero and misaligned sizes.

use std::collections::BTreeMap;

use kvoffload::internal::region::{AnonOptions, Location, Order, RowSpan};
use kvoffload::{page_size, Layout, Region, RegionError, MAX_RANKS};
use proptest::prelude::*;

/// The reference: walk rows, then slots, handing out `chunk` bytes each.
struct Reference {
    /// (rank, chunk) -> start offset
    start: BTreeMap<(usize, usize), usize>,
    rows: Vec<std::ops::Range<usize>>,
    total: usize,
}

fn reference(ranks: usize, chunk: usize, rows: usize) -> Reference {
    let mut start = BTreeMap::new();
    let mut row_ranges = Vec::new();
    let mut off = 0;
    for row in 0..rows {
        let row_start = off;
        for rank in 0..ranks {
            start.insert((rank, row), off);
            off += chunk;
        }
        row_ranges.push(row_start..off);
    }
    Reference { start, rows: row_ranges, total: off }
}

/// The owner of byte `off` by linear search in the reference.
fn ref_locate(r: &Reference, chunk: usize, off: usize) -> Option<Location> {
    r.start.iter().find_map(|(&(rank, row), &s)| {
        (off >= s && off < s + chunk).then(|| Location { row, rank, offset_in_chunk: off - s })
    })
}

fn shapes() -> impl Strategy<Value = (usize, usize, usize, usize)> {
    // (ranks, chunk, rows, align)
    (1usize..=8, 1usize..=4, 1usize..=12, 0u32..=13).prop_map(|(n, k, r, a)| {
        let align = 1usize << a;
        (n, k * align, r, align)
    })
}

/// The rank-major reference: walk ranks, then their chunks.
fn reference_rank_major(ranks: usize, chunk: usize, rows: usize) -> BTreeMap<(usize, usize), usize> {
    let mut start = BTreeMap::new();
    let mut off = 0;
    for rank in 0..ranks {
        for c in 0..rows {
            start.insert((rank, c), off);
            off += chunk;
        }
    }
    start
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn region_rank_major_offsets_match_reference((n, chunk, rows, align) in shapes(), pick in any::<prop::sample::Index>()) {
        let l = Layout::with_alignment(n, chunk, rows, align).unwrap().with_order(Order::RankMajor);
        let r = reference_rank_major(n, chunk, rows);
        prop_assert_eq!(l.order(), Order::RankMajor);
        prop_assert_eq!(l.data_bytes(), n * rows * chunk);
        prop_assert_eq!(l.chunk_stride(), chunk);
        for (&(rank, c), &s) in &r {
            prop_assert_eq!(l.rank_chunk_offset(rank, c).unwrap(), s);
            prop_assert_eq!(l.rank_view(rank).unwrap().chunk_range(c).unwrap(), s..s + chunk);
        }
        for rank in 0..n {
            let share = l.rank_share(rank).unwrap();
            prop_assert_eq!(share.clone(), rank * rows * chunk..(rank + 1) * rows * chunk);
            let got: Vec<_> = l.rank_view(rank).unwrap().chunks().collect();
            let want: Vec<_> = (0..rows).map(|c| r[&(rank, c)]..r[&(rank, c)] + chunk).collect();
            prop_assert_eq!(got, want);
        }
        let off = pick.index(l.data_bytes());
        let loc = l.locate(off).unwrap();
        prop_assert_eq!(l.rank_chunk_offset(loc.rank, loc.row).unwrap() + loc.offset_in_chunk, off);
        // Rows are not contiguous with several ranks; a rank's share is not
        // contiguous in the row-interleaved order.
        let row_interleaved = Layout::with_alignment(n, chunk, rows, align).unwrap();
        prop_assert_eq!(row_interleaved.chunk_stride(), n * chunk);
        if n > 1 {
            prop_assert!(matches!(l.row_range(0), Err(RegionError::NotContiguous { what: "a row", .. })), "row_range");
            prop_assert!(matches!(l.rows_range(0..1), Err(RegionError::NotContiguous { .. })), "rows_range");
            prop_assert!(matches!(l.row_aligned_chunks(usize::MAX), Err(RegionError::NotContiguous { .. })), "row_aligned_chunks");
            prop_assert!(matches!(
                row_interleaved.rank_share(0),
                Err(RegionError::NotContiguous { what: "a rank's share", .. })
            ), "rank_share");
        } else {
            prop_assert_eq!(l.row_range(0).unwrap(), 0..chunk);
            prop_assert_eq!(row_interleaved.rank_share(0).unwrap(), 0..l.data_bytes());
        }
        prop_assert!(matches!(l.rank_share(n), Err(RegionError::RankOutOfRange { .. })), "rank_share out of range");
    }

    #[test]
    fn region_offsets_match_reference((n, chunk, rows, align) in shapes()) {
        let l = Layout::with_alignment(n, chunk, rows, align).unwrap();
        let r = reference(n, chunk, rows);
        prop_assert_eq!(l.data_bytes(), r.total);
        prop_assert_eq!(l.row_bytes(), n * chunk);
        prop_assert_eq!(l.bytes_per_rank(), rows * chunk);
        prop_assert_eq!(l.chunks_per_rank(), rows);
        for (&(rank, c), &s) in &r.start {
            prop_assert_eq!(l.rank_chunk_offset(rank, c).unwrap(), s);
            prop_assert_eq!(l.rank_chunk_range(rank, c).unwrap(), s..s + chunk);
            prop_assert_eq!(l.rank_view(rank).unwrap().chunk_offset(c).unwrap(), s);
        }
        for (row, rr) in r.rows.iter().enumerate() {
            prop_assert_eq!(l.row_range(row).unwrap(), rr.clone());
        }
        // Per-rank views list exactly that rank's chunks, in order.
        for rank in 0..n {
            let v = l.rank_view(rank).unwrap();
            let got: Vec<_> = v.chunks().collect();
            let want: Vec<_> = (0..rows).map(|c| r.start[&(rank, c)]..r.start[&(rank, c)] + chunk).collect();
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn region_out_of_range_is_typed((n, chunk, rows, align) in shapes(), extra in 0usize..5) {
        let l = Layout::with_alignment(n, chunk, rows, align).unwrap();
        let rank_oob = matches!(
            l.rank_chunk_offset(n + extra, 0),
            Err(RegionError::RankOutOfRange { rank, num_ranks }) if rank == n + extra && num_ranks == n
        );
        prop_assert!(rank_oob);
        let row_oob = matches!(
            l.rank_chunk_offset(0, rows + extra),
            Err(RegionError::RowOutOfRange { index, num_rows }) if index == rows + extra && num_rows == rows
        );
        prop_assert!(row_oob);
        prop_assert!(matches!(l.row_range(rows + extra), Err(RegionError::RowOutOfRange { .. })), "unexpected result");
        prop_assert!(matches!(l.rank_view(n + extra), Err(RegionError::RankOutOfRange { .. })), "unexpected result");
        prop_assert!(matches!(l.locate(l.data_bytes() + extra), Err(RegionError::RangeOutOfBounds { .. })), "unexpected result");
        prop_assert!(matches!(l.rows_range(0..rows + 1 + extra), Err(RegionError::RangeOutOfBounds { .. })), "unexpected result");
    }

    #[test]
    fn region_locate_inverts((n, chunk, rows, align) in shapes(), pick in any::<prop::sample::Index>()) {
        let l = Layout::with_alignment(n, chunk, rows, align).unwrap();
        let r = reference(n, chunk, rows);
        let off = pick.index(l.data_bytes());
        let loc = l.locate(off).unwrap();
        prop_assert_eq!(Some(loc), ref_locate(&r, chunk, off));
        prop_assert_eq!(l.rank_chunk_offset(loc.rank, loc.row).unwrap() + loc.offset_in_chunk, off);
    }

    #[test]
    fn region_rows_range_is_union_of_rows((n, chunk, rows, align) in shapes(), a in 0usize..13, b in 0usize..13) {
        let l = Layout::with_alignment(n, chunk, rows, align).unwrap();
        let (a, b) = (a.min(rows), b.min(rows));
        let (lo, hi) = (a.min(b), a.max(b));
        let got = l.rows_range(lo..hi).unwrap();
        let r = reference(n, chunk, rows);
        let want = if lo == hi { lo * n * chunk..lo * n * chunk } else { r.rows[lo].start..r.rows[hi - 1].end };
        prop_assert_eq!(got, want);
    }

    #[test]
    fn region_row_aligned_chunks_tile_the_area((n, chunk, rows, align) in shapes(), max_rows in 1usize..6, slack in 0usize..4096) {
        let l = Layout::with_alignment(n, chunk, rows, align).unwrap();
        let max = max_rows * l.row_bytes() + slack.min(l.row_bytes() - 1);
        let spans: Vec<RowSpan> = l.row_aligned_chunks(max).unwrap().collect();
        prop_assert_eq!(spans.len(), rows.div_ceil(max_rows));
        prop_assert_eq!(l.row_aligned_chunks(max).unwrap().len(), spans.len());
        let mut next_row = 0;
        for s in &spans {
            prop_assert_eq!(s.rows.start, next_row);
            prop_assert!(s.rows.end > s.rows.start);
            prop_assert!(s.bytes.len() <= max);
            prop_assert_eq!(s.bytes.clone(), l.rows_range(s.rows.clone()).unwrap());
            next_row = s.rows.end;
        }
        prop_assert_eq!(next_row, rows);
        let below = l.row_bytes() - 1;
        let refused = matches!(
            l.row_aligned_chunks(below),
            Err(RegionError::ChunkBoundBelowRow { max_bytes, row_bytes }) if max_bytes == below && row_bytes == l.row_bytes()
        );
        prop_assert!(refused);
    }

    #[test]
    fn region_huge_values_give_typed_errors_not_panics(n in 1usize..=MAX_RANKS, chunk_pages in 1usize..1 << 20, rows in 1usize..usize::MAX) {
        let chunk = chunk_pages * page_size();
        match Layout::new(n, chunk, rows) {
            Ok(l) => {
                prop_assert_eq!(l.data_bytes() as u128, n as u128 * chunk as u128 * rows as u128);
                prop_assert!(l.data_bytes() <= isize::MAX as usize);
            }
            Err(RegionError::SizeOverflow { .. }) => {
                prop_assert!(n as u128 * chunk as u128 * rows as u128 > isize::MAX as u128);
            }
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }
}

proptest! {
    // Each case maps a real region: fewer cases.
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Region pointers agree with layout offsets, and every chunk is its own
    /// memory: tag every chunk through `chunk_ptr`, read all back.
    #[test]
    fn region_pointers_match_layout(n in 1usize..=4, k in 1usize..=2, rows in 1usize..=6) {
        let l = Layout::new(n, k * page_size(), rows).unwrap();
        let region = Region::anonymous(l, &AnonOptions::new()).unwrap();
        let base = region.as_ptr() as usize;
        prop_assert_eq!(base % page_size(), 0);
        prop_assert_eq!(region.len(), l.data_bytes());
        prop_assert_eq!(region.raw_range().addr_range(), base..base + l.data_bytes());
        for rank in 0..n {
            for c in 0..rows {
                let p = region.chunk_ptr(rank, c).unwrap();
                prop_assert_eq!(p.as_ptr() as usize, base + l.rank_chunk_offset(rank, c).unwrap());
                // SAFETY: p points at a chunk of chunk_bytes >= 2 inside the live region.
                unsafe {
                    p.as_ptr().write(rank as u8);
                    p.as_ptr().add(l.chunk_bytes() - 1).write(c as u8);
                }
            }
            let row = region.rows_raw(0..rows).unwrap();
            prop_assert_eq!(row.len(), l.data_bytes());
        }
        for rank in 0..n {
            for c in 0..rows {
                let mut first = [0u8; 1];
                let mut last = [0u8; 1];
                region.read_chunk(rank, c, 0, &mut first).unwrap();
                region.read_chunk(rank, c, l.chunk_bytes() - 1, &mut last).unwrap();
                prop_assert_eq!((first[0], last[0]), (rank as u8, c as u8));
            }
        }
        prop_assert!(matches!(
            region.read_chunk(0, 0, l.chunk_bytes(), &mut [0u8; 1]),
            Err(RegionError::RangeOutOfBounds { .. })
        ), "unexpected result");
        prop_assert!(matches!(region.raw_subrange(0..l.data_bytes() + 1), Err(RegionError::RangeOutOfBounds { .. })), "unexpected result");
    }
}

#[test]
fn region_zero_sizes_are_typed_errors() {
    let p = page_size();
    assert!(matches!(Layout::new(0, p, 1), Err(RegionError::ZeroSize { what: "num_ranks" })));
    assert!(matches!(Layout::new(1, 0, 1), Err(RegionError::ZeroSize { what: "chunk_bytes" })));
    assert!(matches!(Layout::new(1, p, 0), Err(RegionError::ZeroSize { what: "num_rows" })));
    assert!(matches!(Layout::from_bytes_per_rank(1, 0, p), Err(RegionError::ZeroSize { what: "bytes_per_rank" })));
    assert!(matches!(Layout::from_bytes_per_rank(1, p, 0), Err(RegionError::ZeroSize { what: "chunk_bytes" })));
}

#[test]
fn region_misaligned_sizes_name_value_and_alignment() {
    let p = page_size();
    match Layout::new(2, p + 512, 4) {
        Err(e @ RegionError::Misaligned { what: "chunk_bytes", value, align }) => {
            assert_eq!((value, align), ((p + 512) as u64, p as u64));
            let msg = e.to_string();
            assert!(msg.contains(&(p + 512).to_string()) && msg.contains(&p.to_string()), "{msg}");
        }
        other => panic!("expected Misaligned, got {other:?}"),
    }
    match Layout::from_bytes_per_rank(2, 3 * p, 2 * p) {
        Err(RegionError::Misaligned { what: "bytes_per_rank", value, align }) => {
            assert_eq!((value, align), ((3 * p) as u64, (2 * p) as u64));
        }
        other => panic!("expected Misaligned, got {other:?}"),
    }
    let l = Layout::from_bytes_per_rank(2, 6 * p, 2 * p).unwrap();
    assert_eq!((l.num_rows(), l.chunk_bytes(), l.row_bytes()), (3, 2 * p, 4 * p));
}

#[test]
fn region_too_many_ranks_is_typed() {
    assert!(matches!(
        Layout::new(MAX_RANKS + 1, page_size(), 1),
        Err(RegionError::TooManyRanks { num_ranks, max }) if num_ranks == MAX_RANKS + 1 && max == MAX_RANKS
    ));
    assert!(Layout::new(MAX_RANKS, page_size(), 1).is_ok());
}
