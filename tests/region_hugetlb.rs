//! A shared region on hugetlbfs (explicit 2 MiB and 1 GiB pages): detected
//! with fstatfs, header and files in whole huge pages, and a pool (or a
//! mount limit) too small for the region is `RegionError::HugePagesTooFew`
//! naming the pool, before any file exists.
//!
//! hugetlbfs is mounted in a private mount namespace (the test re-executes
//! itself under `unshare -m`; skipped, saying so, where that is refused, or
//! where a page size has no pool). The machine's pool is never changed:
//! the region asks for one page more than the pool has free, so the error
//! path runs whatever the pool holds; where it holds a few pages free, a
//! region that fits is made and touched too.

mod region_common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvoffload::internal::region::hugetlb::{Pool, SYSFS_HUGEPAGES};
use kvoffload::internal::region::pages;
use kvoffload::{page_size, FileSplit, Layout, Region, RegionError, ShmOptions};
use region_common::{in_a_private_mount_namespace, ShmGuard};

const CHILD_ENV: &str = "KVOFFLOAD_HUGETLB_CHILD";

fn mount(tag: &str, options: &str) -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("kvo-hugetlb-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let st = Command::new("mount").args(["-t", "hugetlbfs", "-o", options, "kvoffload-test"]).arg(&dir).status();
    if st.is_ok_and(|s| s.success()) {
        Some(dir)
    } else {
        let _ = std::fs::remove_dir(&dir);
        None
    }
}

fn unmount(dir: &Path) {
    let _ = Command::new("umount").arg(dir).status();
    let _ = std::fs::remove_dir(dir);
}

fn opts(dir: &Path) -> ShmOptions {
    ShmOptions::new().dir(dir).timeout(Duration::from_secs(5)).files(FileSplit::Multi { max_file_bytes: 1 << 40 })
}

/// One page size: the too-small pool, a misfit, and (pool permitting) a
/// region that fits.
fn one_page_size(page: usize, label: &str) {
    let pool = match Pool::read(Path::new(SYSFS_HUGEPAGES), page as u64) {
        Ok(p) => p,
        Err(e) => {
            println!("{label}: SKIPPED: no pool of {page}-byte pages here ({e})");
            return;
        }
    };
    let Some(dir) = mount(label, &format!("pagesize={page}")) else {
        println!("{label}: SKIPPED: cannot mount hugetlbfs with pagesize={page}");
        return;
    };
    let g = ShmGuard::in_dir(label, &dir);
    // One data page more than the pool has free, plus the header's page.
    let want = pool.available() + 1;
    let l = Layout::rank_major(1, page, want as usize).unwrap();
    match Region::create(&g.name, l, 0, &opts(&dir)) {
        Err(e @ RegionError::HugePagesTooFew { .. }) => {
            let msg = e.to_string();
            let RegionError::HugePagesTooFew {
                pool: ref p,
                page_bytes,
                needed_pages,
                free_pages,
                total_pages,
                mount_pages,
                ..
            } = e
            else {
                unreachable!()
            };
            assert_eq!((page_bytes, needed_pages), (page as u64, want + 1), "{msg}");
            assert!(free_pages < needed_pages, "{msg}");
            assert_eq!(total_pages, pool.total, "{msg}");
            assert_eq!(mount_pages, None);
            assert!(p.ends_with(format!("hugepages-{}kB", page / 1024)), "{msg}");
            assert!(msg.contains(&p.display().to_string()) && msg.contains(&format!("{free_pages} free")), "{msg}");
        }
        other => panic!("{label}: expected HugePagesTooFew, got {other:?}"),
    }
    g.assert_gone();
    // Files that are not whole huge pages: refused before any file exists.
    let small = Layout::rank_major(1, page_size(), 3).unwrap();
    match Region::create(&g.name, small, 0, &opts(&dir)) {
        Err(RegionError::HugePageMisfit { what: "data file", bytes, page_bytes }) => {
            assert_eq!((bytes, page_bytes), (3 * page_size() as u64, page as u64))
        }
        other => panic!("{label}: expected HugePageMisfit, got {other:?}"),
    }
    g.assert_gone();
    if pool.available() >= 2 && page <= 2 << 20 {
        // Header + one data page: fits.
        let fits = Layout::rank_major(1, page, 1).unwrap();
        let mut r = Region::create(&g.name, fits, 0, &opts(&dir)).unwrap();
        assert_eq!(r.hugetlb_page(), Some(page));
        assert_eq!(r.as_ptr() as usize % page, 0, "data area not on a huge page");
        r.own_chunk_mut(0).unwrap().fill(7);
        let huge = pages::huge_mapped_bytes(r.mapping_range().addr_range()).unwrap();
        assert!(huge >= page as u64, "{label}: smaps counts {huge} hugetlb bytes");
        drop(r);
        println!("{label}: a region that fits: ok");
    } else {
        println!("{label}: pool has {} pages free: the region that fits was not made", pool.available());
    }
    unmount(&dir);
    println!("{label}: ok");
}

/// A mount whose own size= allows one page: a region of two is refused
/// with the mount's limit named, whatever the pool.
fn mount_limit() {
    let page = 2 << 20;
    let Some(dir) = mount("limit", &format!("pagesize={page},size={page}")) else {
        println!("limit: SKIPPED: cannot mount hugetlbfs with size=");
        return;
    };
    let g = ShmGuard::in_dir("limit", &dir);
    let l = Layout::rank_major(1, page, 1).unwrap();
    match Region::create(&g.name, l, 0, &opts(&dir)) {
        Err(RegionError::HugePagesTooFew { mount_pages: Some(1), needed_pages: 2, .. }) => {}
        // An empty pool is reported as well; the limit is named either way.
        other => panic!("limit: expected HugePagesTooFew with the mount's limit, got {other:?}"),
    }
    g.assert_gone();
    unmount(&dir);
    println!("limit: ok");
}

#[test]
fn region_on_hugetlbfs_names_the_pool_and_keeps_huge_page_alignment() {
    if std::env::var_os(CHILD_ENV).is_some() {
        one_page_size(2 << 20, "2MiB");
        one_page_size(1 << 30, "1GiB");
        mount_limit();
        return;
    }
    let test = "region_on_hugetlbfs_names_the_pool_and_keeps_huge_page_alignment";
    let Some((success, text)) = in_a_private_mount_namespace(test, CHILD_ENV, "the hugetlbfs cases") else {
        return;
    };
    assert!(success, "child failed:\n{text}");
    println!("{text}");
}
