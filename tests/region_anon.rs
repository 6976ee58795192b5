//! The anonymous region: mapping, slices, huge-page advice, memory check.

use kvoffload::internal::region::{mem_available, AnonOptions, RegionKind};
use kvoffload::{page_size, Layout, Region, RegionError};

#[test]
fn anonymous_region_is_zeroed_aligned_and_writable() {
    let p = page_size();
    let l = Layout::new(2, p, 3).unwrap();
    let mut r = Region::anonymous(l, &AnonOptions::new()).unwrap();
    assert_eq!(r.kind(), RegionKind::Anonymous);
    assert_eq!(r.len(), 6 * p);
    assert!(!r.is_empty());
    assert_eq!(r.as_ptr() as usize % p, 0);
    assert_eq!(r.mapping_range(), r.raw_range());
    assert!(r.path().is_none() && !r.is_linked());
    assert!(r.rank_slots().is_none());
    assert_eq!(r.mapped_ranks(), vec![0, 1]);
    assert!(r.as_slice().unwrap().iter().all(|b| *b == 0));
    r.own_chunk_mut(2).unwrap().fill(7);
    let off = l.rank_chunk_offset(0, 2).unwrap();
    let all = r.as_slice().unwrap();
    assert!(all[off..off + p].iter().all(|b| *b == 7));
    assert_eq!(all.iter().filter(|b| **b == 7).count(), p);
    assert!(matches!(r.own_chunk(3), Err(RegionError::RowOutOfRange { index: 3, num_rows: 3 })));
    // unlink_now and wait_all_mapped are no-ops here.
    assert!(!r.unlink_now().unwrap());
    r.wait_all_mapped(std::time::Duration::ZERO).unwrap();
}

#[test]
fn region_anonymous_as_other_rank() {
    let l = Layout::new(4, page_size(), 1).unwrap();
    let mut r = Region::anonymous_as(l, 3, &AnonOptions::new()).unwrap();
    assert_eq!(r.rank(), 3);
    r.own_chunk_mut(0).unwrap()[0] = 9;
    let mut b = [0u8];
    r.read_chunk(3, 0, 0, &mut b).unwrap();
    assert_eq!(b[0], 9);
    assert!(matches!(
        Region::anonymous_as(l, 4, &AnonOptions::new()),
        Err(RegionError::RankOutOfRange { rank: 4, num_ranks: 4 })
    ));
}

#[test]
fn region_huge_page_advice_is_applied_or_reported() {
    // 4 MiB so a 2 MiB page fits; THP may be off on the test machine, in
    // which case the advice is refused and reported, not fatal.
    let l = Layout::new(1, 2 << 20, 2).unwrap();
    let r = Region::anonymous(l, &AnonOptions::new().huge_pages(true)).unwrap();
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if thp.contains("[madvise]") || thp.contains("[always]") {
        assert!(r.huge_pages_advised());
        r.advise_huge_pages().unwrap();
    }
}

#[test]
fn region_bigger_than_memory_is_typed() {
    let avail = mem_available().unwrap();
    let p = page_size() as u64;
    let rows = (avail / p + 1024) as usize;
    let l = Layout::new(1, page_size(), rows).unwrap();
    match Region::anonymous(l, &AnonOptions::new()) {
        Err(e @ RegionError::MemoryTooSmall { needed, available, .. }) => {
            assert_eq!(needed, l.data_bytes() as u64);
            assert!(needed > available);
            let msg = e.to_string();
            assert!(msg.contains(&needed.to_string()) && msg.contains(&available.to_string()), "{msg}");
        }
        other => panic!("expected MemoryTooSmall, got {other:?}"),
    }
}

#[test]
fn region_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Region>();
    send_sync::<kvoffload::RawRange>();
    send_sync::<RegionError>();
}
