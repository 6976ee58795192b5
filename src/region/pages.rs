//! Which pages back a shared region: what the file system of its directory
//! promises (the tmpfs `huge=` mount option) and what a mapping got (the
//! `ShmemPmdMapped` / `FilePmdMapped` bytes of /proc/self/smaps).
//!
//! Why it matters: pinning pays per page. On the H200 machine
//! (docs/gpu-runs/2026-11-29-run7-pin-probe.md) pre-faulting 16 GiB of a
//! /dev/shm file with 4 KiB pages ran at 4-5 GB/s, the same file on a tmpfs
//! mounted with `huge=always` at 39-44 GB/s. /dev/shm is usually mounted
//! without `huge=` and its pages then follow nothing we can advise (the
//! machine's `shmem_enabled` governs only the kernel's internal mount).

use std::ops::Range;
use std::path::{Path, PathBuf};

/// The mount holding a directory, as /proc/self/mounts lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    /// Mount point.
    pub point: PathBuf,
    /// File system type (`tmpfs`, `hugetlbfs`, ...).
    pub fstype: String,
    /// The mount options, comma separated.
    pub options: String,
}

impl Mount {
    /// The value of option `key=` (e.g. `huge` for tmpfs), if set.
    pub fn option(&self, key: &str) -> Option<&str> {
        self.options.split(',').find_map(|o| o.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
    }

    /// What pages a region file in this mount gets, in words: e.g.
    /// `tmpfs, huge=always: 2 MiB pages` or `tmpfs without huge=: 4 KiB pages`.
    pub fn pages(&self) -> String {
        match (self.fstype.as_str(), self.option("huge")) {
            ("hugetlbfs", _) => {
                format!("hugetlbfs (pagesize {}): huge pages", self.option("pagesize").unwrap_or("default"))
            }
            ("tmpfs", Some(h @ ("always" | "within_size"))) => format!("tmpfs, huge={h}: 2 MiB pages where possible"),
            ("tmpfs", Some("advise")) => "tmpfs, huge=advise: 2 MiB pages with --pin-huge-pages on".into(),
            ("tmpfs", Some(h)) => format!("tmpfs, huge={h}: 4 KiB pages"),
            ("tmpfs", None) => "tmpfs without huge=: 4 KiB pages".into(),
            (t, _) => t.to_string(),
        }
    }

    /// True when the mount gives 4 KiB pages whatever we advise: tmpfs with
    /// `huge=never` or without `huge=`.
    pub fn small_pages_only(&self) -> bool {
        self.fstype == "tmpfs" && matches!(self.option("huge"), None | Some("never" | "deny"))
    }
}

/// The mount holding `dir` (the longest mount point that is a prefix of its
/// canonical path; the last such line wins, as the kernel stacks mounts).
/// None when /proc/self/mounts is unreadable or `dir` does not exist.
pub fn mount_of(dir: &Path) -> Option<Mount> {
    let dir = dir.canonicalize().ok()?;
    let text = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mount_in(&text, &dir)
}

fn unescape(s: &str) -> String {
    // /proc/mounts escapes space, tab, newline and backslash as \ooo.
    let mut out = String::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v as char);
            i += 4;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

fn mount_in(text: &str, dir: &Path) -> Option<Mount> {
    let mut best: Option<Mount> = None;
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let (Some(_src), Some(point), Some(fstype), Some(options)) = (f.next(), f.next(), f.next(), f.next()) else {
            continue;
        };
        let point = PathBuf::from(unescape(point));
        if !dir.starts_with(&point) {
            continue;
        }
        if best.as_ref().is_none_or(|b| point.as_os_str().len() >= b.point.as_os_str().len()) {
            best = Some(Mount { point, fstype: fstype.to_string(), options: options.to_string() });
        }
    }
    best
}

/// Bytes of `range` mapped with huge pages, from the `ShmemPmdMapped` and
/// `FilePmdMapped` lines of /proc/self/smaps (transparent huge pages of
/// tmpfs and files) and `Shared_Hugetlb` / `Private_Hugetlb` (hugetlbfs, 2
/// MiB or 1 GiB pages, which the other lines never count), over the
/// mappings that lie inside `range`. None when smaps is unreadable.
pub fn huge_mapped_bytes(range: Range<usize>) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps").ok()?;
    Some(huge_in(&text, range))
}

fn huge_in(text: &str, range: Range<usize>) -> u64 {
    let mut inside = false;
    let mut total = 0u64;
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = a >= range.start && b <= range.end;
                continue;
            }
        }
        if !inside {
            continue;
        }
        for key in ["ShmemPmdMapped:", "FilePmdMapped:", "Shared_Hugetlb:", "Private_Hugetlb:"] {
            if let Some(v) = line.strip_prefix(key) {
                let kb: u64 = v.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0);
                total += kb * 1024;
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS: &str = "\
tmpfs /dev/shm tmpfs rw,relatime,size=131981020k 0 0
kvo /tmp/kvo tmpfs rw,relatime,size=41943040k,huge=always 0 0
/dev/root / ext4 rw 0 0
weird /mnt/a\\040b tmpfs rw,huge=advise 0 0
";

    #[test]
    fn the_longest_mount_point_wins_and_huge_is_read() {
        let m = mount_in(MOUNTS, Path::new("/dev/shm")).unwrap();
        assert_eq!((m.fstype.as_str(), m.option("huge")), ("tmpfs", None));
        assert!(m.small_pages_only());
        assert_eq!(m.pages(), "tmpfs without huge=: 4 KiB pages");
        let m = mount_in(MOUNTS, Path::new("/tmp/kvo/sub")).unwrap();
        assert_eq!(m.option("huge"), Some("always"));
        assert!(!m.small_pages_only());
        assert_eq!(mount_in(MOUNTS, Path::new("/tmp")).unwrap().point, PathBuf::from("/"));
        assert_eq!(mount_in(MOUNTS, Path::new("/mnt/a b")).unwrap().option("huge"), Some("advise"));
    }

    #[test]
    fn huge_bytes_count_only_mappings_inside_the_range() {
        let smaps = "\
7f0000000000-7f0000400000 rw-s 00000000 00:1a 12 /tmp/kvo/kvoffload-x
Size:               4096 kB
ShmemPmdMapped:     4096 kB
FilePmdMapped:         0 kB
7f0000400000-7f0000800000 rw-s 00400000 00:1a 12 /tmp/kvo/kvoffload-x
ShmemPmdMapped:     2048 kB
7f0000800000-7f0000c00000 rw-p 00000000 00:00 0
ShmemPmdMapped:     4096 kB
";
        assert_eq!(huge_in(smaps, 0x7f00_0000_0000..0x7f00_0080_0000), 6 << 20);
        assert_eq!(huge_in(smaps, 0x7f00_0040_0000..0x7f00_0080_0000), 2 << 20);
        assert_eq!(huge_in(smaps, 0..1), 0);
        // hugetlbfs: counted under *_Hugetlb only.
        let smaps = "\
7f0040000000-7f0080000000 rw-s 00000000 00:2b 7 /mnt/huge1g/kvoffload-x.0
Size:            1048576 kB
ShmemPmdMapped:        0 kB
Shared_Hugetlb:  1048576 kB
Private_Hugetlb:       0 kB
7f0080000000-7f0080400000 rw-s 00000000 00:2c 9 /mnt/huge2m/kvoffload-y.0
Shared_Hugetlb:     2048 kB
Private_Hugetlb:    2048 kB
";
        assert_eq!(huge_in(smaps, 0x7f00_4000_0000..0x7f00_8000_0000), 1 << 30);
        assert_eq!(huge_in(smaps, 0x7f00_4000_0000..0x7f00_8040_0000), (1 << 30) + (4 << 20));
    }

    #[test]
    fn this_process_can_read_its_mounts_and_smaps() {
        assert!(mount_of(Path::new("/")).is_some());
        assert!(huge_mapped_bytes(0..usize::MAX).is_some());
    }
}
