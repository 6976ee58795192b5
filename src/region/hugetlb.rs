//! Explicit huge pages: a shared region whose directory is on hugetlbfs.
//!
//! What changes there (and only there):
//! - every file length and every mapping offset must be a multiple of the
//!   file system's page size (2 MiB or 1 GiB), so the header takes one
//!   whole huge page and the data area is aligned to one (`round_header`,
//!   `check_fit`, `Pieces::reserve_aligned`'s alignment);
//! - the pages come from the kernel's pool
//!   (`/sys/kernel/mm/hugepages/hugepages-<kB>kB`), not from `MemAvailable`
//!   or a tmpfs size: the capacity check reads the pool ([`Pool`]), and a
//!   reservation (`fallocate`, or the reservation `mmap` makes) that finds
//!   it exhausted is [`RegionError::HugePagesTooFew`] naming the pool, its
//!   size and its free pages;
//! - transparent huge pages do not apply (`MADV_HUGEPAGE` is skipped), and
//!   /proc/self/smaps counts the mapping under `Shared_Hugetlb`
//!   ([`super::pages`]).
//!
//! Detection: `fstatfs` of the region's directory, `f_type ==
//! HUGETLBFS_MAGIC`, the page size from `f_bsize` (what hugetlbfs reports:
//! its huge page size).

use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use super::error::RegionError;

/// `f_type` of hugetlbfs (linux/magic.h).
pub const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// Where the kernel describes its huge page pools.
pub const SYSFS_HUGEPAGES: &str = "/sys/kernel/mm/hugepages";

/// The huge page size of the file system of `dir` if it is hugetlbfs
/// (`fstatfs`: `f_type`, `f_bsize`), None for any other file system.
pub(crate) fn page_of(dir: impl AsFd) -> io::Result<Option<usize>> {
    let st = rustix::fs::fstatfs(dir)?;
    Ok(classify(st.f_type as u64, st.f_bsize as u64))
}

/// `(f_type, f_bsize)` to the huge page size, if hugetlbfs.
fn classify(f_type: u64, f_bsize: u64) -> Option<usize> {
    // f_type is a signed field on some targets: compare its low 32 bits.
    (f_type & 0xffff_ffff == HUGETLBFS_MAGIC && f_bsize > 0).then_some(f_bsize as usize)
}

/// A huge page pool of one page size, as sysfs describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    /// Its directory, e.g. `/sys/kernel/mm/hugepages/hugepages-2048kB`.
    pub dir: PathBuf,
    /// Bytes of one page.
    pub page_bytes: u64,
    /// `nr_hugepages`: pages in the pool.
    pub total: u64,
    /// `free_hugepages`: pages not faulted by anyone.
    pub free: u64,
    /// `resv_hugepages`: free pages promised to mappings already.
    pub reserved: u64,
}

impl Pool {
    /// The pool of `page_bytes` pages under `root` (normally
    /// [`SYSFS_HUGEPAGES`]).
    pub fn read(root: &Path, page_bytes: u64) -> io::Result<Pool> {
        let dir = root.join(format!("hugepages-{}kB", page_bytes / 1024));
        let num = |name: &str| -> io::Result<u64> {
            let t = std::fs::read_to_string(dir.join(name))?;
            t.trim().parse().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{name}: {e}")))
        };
        Ok(Pool {
            total: num("nr_hugepages")?,
            free: num("free_hugepages")?,
            reserved: num("resv_hugepages")?,
            dir,
            page_bytes,
        })
    }

    /// Pages a new mapping can still get: free and not promised.
    pub fn available(&self) -> u64 {
        self.free.saturating_sub(self.reserved)
    }

    /// The error for a region of `needed` bytes in `dir` that this pool
    /// (or the mount's own limit, `mount_pages`) cannot hold.
    pub(crate) fn too_few(&self, dir: &Path, needed: u64, mount_pages: Option<u64>) -> RegionError {
        RegionError::HugePagesTooFew {
            dir: dir.to_path_buf(),
            pool: self.dir.clone(),
            page_bytes: self.page_bytes,
            needed_pages: needed.div_ceil(self.page_bytes.max(1)),
            free_pages: self.available(),
            total_pages: self.total,
            mount_pages,
        }
    }
}

/// Pages the hugetlbfs mount itself still allows (its `size=`), from
/// `statvfs`; None when the mount sets no limit (hugetlbfs then reports 0
/// blocks).
pub(crate) fn mount_pages(blocks: u64, avail: u64) -> Option<u64> {
    (blocks > 0).then_some(avail)
}

/// The capacity check of a region of `needed` bytes on hugetlbfs with
/// pages of `page` bytes: the pool (under `root`) must have that many pages
/// available, and the mount's own limit (`mount_pages`) too.
pub(crate) fn check_capacity(
    dir: &Path,
    root: &Path,
    page: usize,
    needed: u64,
    mount_pages: Option<u64>,
) -> Result<(), RegionError> {
    let pool = Pool::read(root, page as u64).map_err(|e| RegionError::io("read huge page pool", root, e))?;
    let pages = needed.div_ceil(page as u64);
    if pages > pool.available() || mount_pages.is_some_and(|m| pages > m) {
        return Err(pool.too_few(dir, needed, mount_pages));
    }
    Ok(())
}

/// The header of a region on hugetlbfs takes whole huge pages (mappings
/// and file lengths are multiples of the page): `bytes` rounded up.
pub(crate) fn round_header(bytes: usize, page: Option<usize>) -> usize {
    match page {
        Some(p) => bytes.next_multiple_of(p),
        None => bytes,
    }
}

/// Every length of `lens` (data file lengths, or the one file's) must be a
/// multiple of the huge page: [`RegionError::HugePageMisfit`] naming the
/// first that is not.
pub(crate) fn check_fit(lens: impl IntoIterator<Item = (usize, &'static str)>, page: usize) -> Result<(), RegionError> {
    for (bytes, what) in lens {
        if bytes % page != 0 {
            return Err(RegionError::HugePageMisfit { what, bytes: bytes as u64, page_bytes: page as u64 });
        }
    }
    Ok(())
}

/// Alignment of a region's data area: a transparent huge page at least,
/// the file system's page on hugetlbfs (1 GiB pages need 1 GiB).
pub(crate) fn data_align(page: Option<usize>) -> usize {
    super::mapping::DATA_ALIGN.max(page.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const GIB: usize = 1 << 30;

    #[test]
    fn only_hugetlbfs_gives_a_page_size() {
        assert_eq!(classify(HUGETLBFS_MAGIC, 2 * MIB as u64), Some(2 * MIB));
        // Sign-extended as a signed f_type would be.
        assert_eq!(classify(0xffff_ffff_9584_58f6, GIB as u64), Some(GIB));
        assert_eq!(classify(0x0102_1994, 4096), None); // tmpfs
        assert_eq!(classify(HUGETLBFS_MAGIC, 0), None);
    }

    #[test]
    fn the_header_takes_one_huge_page_and_files_must_fit() {
        assert_eq!(round_header(4096, None), 4096);
        assert_eq!(round_header(4096, Some(2 * MIB)), 2 * MIB);
        assert_eq!(round_header(2 * MIB + 4096, Some(2 * MIB)), 4 * MIB);
        assert_eq!(round_header(8192, Some(GIB)), GIB);
        assert!(check_fit([(256 * MIB, "data file"), (2 * MIB, "data file")], 2 * MIB).is_ok());
        match check_fit([(256 * MIB, "data file"), (3 * MIB, "last data file")], 2 * MIB) {
            Err(RegionError::HugePageMisfit { what, bytes, page_bytes }) => {
                assert_eq!((what, bytes, page_bytes), ("last data file", 3 * MIB as u64, 2 * MIB as u64))
            }
            other => panic!("expected HugePageMisfit, got {other:?}"),
        }
        assert!(check_fit([(256 * MIB, "data file")], GIB).is_err());
        assert_eq!(data_align(None), 2 * MIB);
        assert_eq!(data_align(Some(2 * MIB)), 2 * MIB);
        assert_eq!(data_align(Some(GIB)), GIB);
    }

    fn fake_pool(root: &Path, kb: u64, nr: u64, free: u64, resv: u64) {
        let d = root.join(format!("hugepages-{kb}kB"));
        std::fs::create_dir_all(&d).unwrap();
        for (n, v) in [("nr_hugepages", nr), ("free_hugepages", free), ("resv_hugepages", resv)] {
            std::fs::write(d.join(n), format!("{v}\n")).unwrap();
        }
    }

    #[test]
    fn the_pool_is_read_and_an_empty_or_small_one_is_named() {
        let root = std::env::temp_dir().join(format!("kvo-hugepool-{}", std::process::id()));
        fake_pool(&root, 2048, 10, 6, 2);
        fake_pool(&root, 1048576, 0, 0, 0);
        let p = Pool::read(&root, 2 * MIB as u64).unwrap();
        assert_eq!((p.total, p.free, p.reserved, p.available()), (10, 6, 2, 4));
        let dir = Path::new("/mnt/huge");
        assert!(check_capacity(dir, &root, 2 * MIB, 4 * 2 * MIB as u64, None).is_ok());
        // Five pages of four available: named with the pool's numbers.
        match check_capacity(dir, &root, 2 * MIB, 9 * MIB as u64, None) {
            Err(e @ RegionError::HugePagesTooFew { .. }) => {
                let msg = e.to_string();
                let RegionError::HugePagesTooFew { needed_pages, free_pages, total_pages, ref pool, .. } = e else {
                    unreachable!()
                };
                assert_eq!((needed_pages, free_pages, total_pages), (5, 4, 10));
                assert!(pool.ends_with("hugepages-2048kB"), "{}", pool.display());
                assert!(msg.contains("hugepages-2048kB") && msg.contains("5 pages") && msg.contains("4 free"), "{msg}");
            }
            other => panic!("expected HugePagesTooFew, got {other:?}"),
        }
        // The mount's own limit binds too.
        assert!(matches!(
            check_capacity(dir, &root, 2 * MIB, 4 * 2 * MIB as u64, Some(3)),
            Err(RegionError::HugePagesTooFew { mount_pages: Some(3), .. })
        ));
        // An empty 1 GiB pool.
        assert!(matches!(
            check_capacity(dir, &root, GIB, 1, None),
            Err(RegionError::HugePagesTooFew { free_pages: 0, total_pages: 0, needed_pages: 1, .. })
        ));
        // No such pool: an I/O error naming the root.
        assert!(matches!(check_capacity(dir, &root, 4 * MIB, 1, None), Err(RegionError::Io { .. })));
        assert_eq!(mount_pages(0, 0), None);
        assert_eq!(mount_pages(8, 3), Some(3));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
