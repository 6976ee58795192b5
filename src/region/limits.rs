//! How much memory this process can get, checked before a region is made
//! (limits checked before work).
//!
//! What a process can get is the smaller of
//! - `MemAvailable` of `/proc/meminfo` (the whole machine), and
//! - for every cgroup of the process's memory hierarchy, from its own up to
//!   the root of the mount: the cgroup's limit minus what it uses now
//!   (cgroup v2: `memory.max` and `memory.current`; v1:
//!   `memory.limit_in_bytes` and `memory.usage_in_bytes`). A limit of
//!   `max` (v2) or the v1 "unlimited" value (about 2^63) is no limit.
//!   Usage counts the cgroup's reclaimable file cache too; its inactive part
//!   (`inactive_file`, v1 `total_inactive_file`, of `memory.stat`) is taken
//!   off, as the kernel reclaims it before it fails an allocation. tmpfs
//!   pages (a shared region's) are not file cache: they count in full.
//!
//! A number that cannot be read (no /proc, no cgroup mount, a file missing)
//! is no limit known from that source, logged; if nothing at all is known
//! the check is skipped with a warning rather than refusing every region.
//!
//! The parsing is split into pure functions over the files' text, unit
//! tested below on sample contents; [`available_memory`] reads the files.

use std::fmt;
use std::path::{Path, PathBuf};

use tracing::{debug, info, warn};

use super::error::RegionError;

/// `/proc/meminfo`.
pub const MEMINFO: &str = "/proc/meminfo";

/// Where the number a region was checked against came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitSource {
    /// `MemAvailable` of `/proc/meminfo`.
    MemAvailable,
    /// A cgroup's limit minus its usage; the path of the limit file
    /// (`.../memory.max`, or `.../memory.limit_in_bytes` with cgroup v1).
    Cgroup {
        /// The limit file.
        limit_file: PathBuf,
    },
}

impl fmt::Display for LimitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitSource::MemAvailable => write!(f, "MemAvailable of {MEMINFO}"),
            LimitSource::Cgroup { limit_file } => {
                write!(f, "the cgroup limit {} minus the cgroup's usage", limit_file.display())
            }
        }
    }
}

/// The memory this process can get now, and which limit says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryBudget {
    /// Bytes.
    pub bytes: u64,
    /// The limit that gave the number (the smallest of those known).
    pub source: LimitSource,
}

/// A cgroup limit file's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupLimit {
    /// `max`, or the v1 "unlimited" value.
    Unlimited,
    /// A limit in bytes.
    Bytes(u64),
}

/// v1 writes "unlimited" as `PAGE_COUNTER_MAX * page size` (about 2^63,
/// 9223372036854771712 with 4 KiB pages); anything from 2^62 on is no limit.
const V1_UNLIMITED_FROM: u64 = 1 << 62;

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn mem_available() -> std::io::Result<u64> {
    let text = std::fs::read_to_string(MEMINFO)?;
    parse_mem_available(&text).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "no parsable MemAvailable line in /proc/meminfo")
    })
}

/// Parses the `MemAvailable:  N kB` line of a meminfo text.
pub fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut it = line["MemAvailable:".len()..].split_whitespace();
    let n: u64 = it.next()?.parse().ok()?;
    match it.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// Parses a limit file (`memory.max`: `max` or a number; v1
/// `memory.limit_in_bytes`: a number, about 2^63 for no limit).
pub fn parse_limit(text: &str) -> Option<CgroupLimit> {
    let t = text.trim();
    if t == "max" {
        return Some(CgroupLimit::Unlimited);
    }
    let n: u64 = t.parse().ok()?;
    Some(if n >= V1_UNLIMITED_FROM { CgroupLimit::Unlimited } else { CgroupLimit::Bytes(n) })
}

/// Parses a usage file (`memory.current`, `memory.usage_in_bytes`): a number.
pub fn parse_usage(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// The value of `key` in a `memory.stat` text (`key value` lines).
pub fn parse_stat(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key)).then(|| it.next()?.parse().ok()).flatten()
    })
}

/// A cgroup version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// The unified hierarchy.
    V2,
    /// The v1 `memory` controller.
    V1,
}

impl CgroupVersion {
    fn limit_file(self) -> &'static str {
        match self {
            CgroupVersion::V2 => "memory.max",
            CgroupVersion::V1 => "memory.limit_in_bytes",
        }
    }

    fn usage_file(self) -> &'static str {
        match self {
            CgroupVersion::V2 => "memory.current",
            CgroupVersion::V1 => "memory.usage_in_bytes",
        }
    }

    fn inactive_file_key(self) -> &'static str {
        match self {
            CgroupVersion::V2 => "inactive_file",
            CgroupVersion::V1 => "total_inactive_file",
        }
    }
}

/// The process's cgroup path of `version` from a `/proc/self/cgroup` text
/// (`0::/path` for v2; `N:...memory...:/path` for the v1 memory controller).
pub fn parse_proc_cgroup(text: &str, version: CgroupVersion) -> Option<String> {
    text.lines().find_map(|l| {
        let mut it = l.splitn(3, ':');
        let (id, controllers, path) = (it.next()?, it.next()?, it.next()?);
        let hit = match version {
            CgroupVersion::V2 => id == "0" && controllers.is_empty(),
            CgroupVersion::V1 => controllers.split(',').any(|c| c == "memory"),
        };
        hit.then(|| path.to_string())
    })
}

/// A cgroup file system mount of `/proc/self/mountinfo`: the cgroup its
/// root shows and where it is mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMount {
    /// The cgroup path the mount's root is (`/` unless the mount shows a
    /// sub-tree, as in some containers).
    pub root: String,
    /// Where it is mounted.
    pub mount_point: PathBuf,
}

/// The mount of `version`'s hierarchy in a `/proc/self/mountinfo` text
/// (`cgroup2` file system; or `cgroup` with the `memory` super option).
pub fn parse_mountinfo(text: &str, version: CgroupVersion) -> Option<CgroupMount> {
    text.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let f: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        let (root, mount_point) = (f.get(3)?, f.get(4)?);
        let (fstype, super_opts) = (r.first()?, r.get(2).copied().unwrap_or(""));
        let hit = match version {
            CgroupVersion::V2 => *fstype == "cgroup2",
            CgroupVersion::V1 => *fstype == "cgroup" && super_opts.split(',').any(|o| o == "memory"),
        };
        hit.then(|| CgroupMount { root: unescape(root), mount_point: PathBuf::from(unescape(mount_point)) })
    })
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let oct = std::str::from_utf8(&b[i + 1..i + 4]).ok().and_then(|o| u8::from_str_radix(o, 8).ok());
            if let Some(v) = oct {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The directories of the process's cgroup and its ancestors, leaf first,
/// down to the mount point: `None` when the cgroup is not under the mount's
/// root (not visible here).
pub fn cgroup_dirs(mount: &CgroupMount, cgroup: &str) -> Option<Vec<PathBuf>> {
    let root = mount.root.trim_end_matches('/');
    let rel = cgroup.strip_prefix(root)?;
    if !(rel.is_empty() || rel.starts_with('/')) {
        return None;
    }
    let parts: Vec<&str> = rel.split('/').filter(|p| !p.is_empty() && *p != ".").collect();
    if parts.contains(&"..") {
        return None;
    }
    let mut dirs = Vec::with_capacity(parts.len() + 1);
    let mut d = mount.mount_point.clone();
    dirs.push(d.clone());
    for p in parts {
        d.push(p);
        dirs.push(d.clone());
    }
    dirs.reverse();
    Some(dirs)
}

/// The smallest headroom (limit minus usage, less inactive file cache) of
/// the cgroups `dirs`, reading files through `read`; `None` when no level
/// has a limit (or its files cannot be read).
pub fn cgroup_headroom(
    dirs: &[PathBuf],
    version: CgroupVersion,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Option<MemoryBudget> {
    let mut best: Option<MemoryBudget> = None;
    for d in dirs {
        let limit_file = d.join(version.limit_file());
        let Some(text) = read(&limit_file) else {
            continue;
        };
        let limit = match parse_limit(&text) {
            Some(CgroupLimit::Bytes(n)) => n,
            Some(CgroupLimit::Unlimited) => continue,
            None => {
                debug!(file = %limit_file.display(), "unparsable cgroup memory limit; ignored");
                continue;
            }
        };
        let usage_file = d.join(version.usage_file());
        let Some(usage) = read(&usage_file).and_then(|t| parse_usage(&t)) else {
            // A limit without a readable usage: the limit itself is what
            // is known (an upper bound of the headroom).
            debug!(file = %usage_file.display(), "cgroup memory usage unreadable; using the limit alone");
            let b = MemoryBudget { bytes: limit, source: LimitSource::Cgroup { limit_file } };
            best = Some(min_budget(best, b));
            continue;
        };
        let inactive =
            read(&d.join("memory.stat")).and_then(|t| parse_stat(&t, version.inactive_file_key())).unwrap_or(0);
        let used = usage.saturating_sub(inactive);
        let b = MemoryBudget { bytes: limit.saturating_sub(used), source: LimitSource::Cgroup { limit_file } };
        best = Some(min_budget(best, b));
    }
    best
}

fn min_budget(a: Option<MemoryBudget>, b: MemoryBudget) -> MemoryBudget {
    match a {
        Some(a) if a.bytes <= b.bytes => a,
        _ => b,
    }
}

/// The smallest of what the texts of `/proc/meminfo`, `/proc/self/cgroup`,
/// `/proc/self/mountinfo` and the cgroup files (through `read`) allow:
/// [`available_memory`] with its inputs given, for tests.
pub fn budget_from(
    meminfo: Option<&str>,
    proc_cgroup: Option<&str>,
    mountinfo: Option<&str>,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Option<MemoryBudget> {
    let mut best = match meminfo.and_then(parse_mem_available) {
        Some(bytes) => Some(MemoryBudget { bytes, source: LimitSource::MemAvailable }),
        None => {
            warn!("no MemAvailable in {MEMINFO}; the machine's free memory is not known");
            None
        }
    };
    let mut cgroup_known = false;
    for version in [CgroupVersion::V2, CgroupVersion::V1] {
        let cg = proc_cgroup.and_then(|t| parse_proc_cgroup(t, version));
        let mount = mountinfo.and_then(|t| parse_mountinfo(t, version));
        let (Some(cg), Some(mount)) = (cg, mount) else {
            continue;
        };
        let Some(dirs) = cgroup_dirs(&mount, &cg) else {
            debug!(cgroup = %cg, root = %mount.root, "the cgroup is not under its mount's root; its limit is not known");
            continue;
        };
        if let Some(b) = cgroup_headroom(&dirs, version, read) {
            cgroup_known = true;
            best = Some(min_budget(best, b));
        }
    }
    if !cgroup_known {
        info!(
            "no cgroup memory limit found (no limit set, or its files unreadable); checking against MemAvailable alone"
        );
    }
    best
}

/// What this process can get now: the smallest of `MemAvailable` and every
/// cgroup headroom known (see the module documentation). `None` (logged)
/// when none is known.
/// (Read once per process under loom: [`crate::sync::host_fact`].)
pub fn available_memory() -> Option<MemoryBudget> {
    crate::sync::host_fact("available_memory", read_available_memory)
}

fn read_available_memory() -> Option<MemoryBudget> {
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let meminfo = read(Path::new(MEMINFO));
    let proc_cgroup = read(Path::new("/proc/self/cgroup"));
    let mountinfo = read(Path::new("/proc/self/mountinfo"));
    budget_from(meminfo.as_deref(), proc_cgroup.as_deref(), mountinfo.as_deref(), &read)
}

/// Refuses `needed` bytes with [`RegionError::MemoryTooSmall`] if it is more
/// than [`available_memory`]; a no-op (logged) when nothing is known.
pub(crate) fn check(needed: u64) -> Result<(), RegionError> {
    match available_memory() {
        Some(b) if needed > b.bytes => {
            warn!(needed, available = b.bytes, limit = %b.source, "region larger than the memory this process can get");
            Err(RegionError::MemoryTooSmall { needed, available: b.bytes, limit: b.source })
        }
        Some(b) => {
            debug!(needed, available = b.bytes, limit = %b.source, "region fits in memory");
            Ok(())
        }
        None => {
            warn!(needed, "cannot tell how much memory this process can get; the region is not checked");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn fake(files: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let m: HashMap<PathBuf, String> = files.iter().map(|(p, t)| (PathBuf::from(p), t.to_string())).collect();
        move |p: &Path| m.get(p).cloned()
    }

    const MEMINFO_24G: &str = "MemTotal:  24683584 kB\nMemFree: 5 kB\nMemAvailable:   23767292 kB\n";
    const AVAIL: u64 = 23767292 * 1024;

    #[test]
    fn parses_mem_available() {
        assert_eq!(parse_mem_available(MEMINFO_24G), Some(AVAIL));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: x kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: 7 MB\n"), None);
    }

    #[test]
    fn parses_limits_v2_max_a_number_and_v1_unlimited() {
        assert_eq!(parse_limit("max\n"), Some(CgroupLimit::Unlimited));
        assert_eq!(parse_limit("8589934592\n"), Some(CgroupLimit::Bytes(8 << 30)));
        assert_eq!(parse_limit("9223372036854771712\n"), Some(CgroupLimit::Unlimited)); // v1, 4 KiB pages
        assert_eq!(parse_limit("9223372036854710272\n"), Some(CgroupLimit::Unlimited)); // v1, 64 KiB pages
        assert_eq!(parse_limit(""), None);
        assert_eq!(parse_limit("lots"), None);
        assert_eq!(parse_usage("3604480\n"), Some(3604480));
        let stat = "anon 100\nfile 5000\ninactive_file 4096\nactive_file 10\n";
        assert_eq!(parse_stat(stat, "inactive_file"), Some(4096));
        assert_eq!(parse_stat(stat, "total_inactive_file"), None);
    }

    #[test]
    fn parses_proc_cgroup_and_mountinfo() {
        let v1 = "9:name=systemd:/\n4:memory:/process_api/b34e\n2:cpu,cpuacct:/\n0::/\n";
        assert_eq!(parse_proc_cgroup(v1, CgroupVersion::V1).as_deref(), Some("/process_api/b34e"));
        assert_eq!(parse_proc_cgroup(v1, CgroupVersion::V2).as_deref(), Some("/"));
        let v2 = "0::/user.slice/user-1000.slice/session-2.scope\n";
        assert_eq!(
            parse_proc_cgroup(v2, CgroupVersion::V2).as_deref(),
            Some("/user.slice/user-1000.slice/session-2.scope")
        );
        assert_eq!(parse_proc_cgroup(v2, CgroupVersion::V1), None);
        let mi = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                  35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
                  36 31 0:33 / /sys/fs/cgroup/memory\\040x rw - cgroup cgroup rw,devices\n\
                  41 31 0:38 /kube /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n";
        assert_eq!(
            parse_mountinfo(mi, CgroupVersion::V1),
            Some(CgroupMount { root: "/".into(), mount_point: "/sys/fs/cgroup/memory".into() })
        );
        assert_eq!(
            parse_mountinfo(mi, CgroupVersion::V2),
            Some(CgroupMount { root: "/kube".into(), mount_point: "/sys/fs/cgroup/unified".into() })
        );
        assert_eq!(parse_mountinfo("", CgroupVersion::V2), None);
        assert_eq!(unescape("/a\\040b"), "/a b");
    }

    #[test]
    fn cgroup_dirs_walk_up_to_the_mount_and_strip_its_root() {
        let m = CgroupMount { root: "/".into(), mount_point: "/sys/fs/cgroup".into() };
        assert_eq!(
            cgroup_dirs(&m, "/a/b").unwrap(),
            vec![PathBuf::from("/sys/fs/cgroup/a/b"), "/sys/fs/cgroup/a".into(), "/sys/fs/cgroup".into()]
        );
        assert_eq!(cgroup_dirs(&m, "/").unwrap(), vec![PathBuf::from("/sys/fs/cgroup")]);
        let m = CgroupMount { root: "/docker/abc".into(), mount_point: "/sys/fs/cgroup".into() };
        assert_eq!(cgroup_dirs(&m, "/docker/abc").unwrap(), vec![PathBuf::from("/sys/fs/cgroup")]);
        assert_eq!(
            cgroup_dirs(&m, "/docker/abc/x").unwrap(),
            vec![PathBuf::from("/sys/fs/cgroup/x"), "/sys/fs/cgroup".into()]
        );
        assert_eq!(cgroup_dirs(&m, "/docker/abcd"), None);
        assert_eq!(cgroup_dirs(&m, "/other"), None);
    }

    #[test]
    fn v2_number_is_the_limit_minus_usage_less_inactive_file() {
        let mi = "41 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let read = fake(&[
            ("/sys/fs/cgroup/job/memory.max", "1073741824\n"),
            ("/sys/fs/cgroup/job/memory.current", "209715200\n"),
            ("/sys/fs/cgroup/job/memory.stat", "anon 1\ninactive_file 104857600\n"),
            ("/sys/fs/cgroup/memory.max", "max\n"),
        ]);
        let b = budget_from(Some(MEMINFO_24G), Some("0::/job\n"), Some(mi), &read).unwrap();
        assert_eq!(b.bytes, (1 << 30) - (100 << 20));
        assert_eq!(b.source, LimitSource::Cgroup { limit_file: "/sys/fs/cgroup/job/memory.max".into() });
        assert!(b.source.to_string().contains("/sys/fs/cgroup/job/memory.max"));
    }

    #[test]
    fn an_ancestor_with_less_headroom_wins_and_over_use_is_zero() {
        let mi = "41 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let read = fake(&[
            ("/sys/fs/cgroup/a/b/memory.max", "max\n"),
            ("/sys/fs/cgroup/a/memory.max", "4096\n"),
            ("/sys/fs/cgroup/a/memory.current", "8192\n"),
        ]);
        let b = budget_from(Some(MEMINFO_24G), Some("0::/a/b\n"), Some(mi), &read).unwrap();
        assert_eq!(
            b,
            MemoryBudget { bytes: 0, source: LimitSource::Cgroup { limit_file: "/sys/fs/cgroup/a/memory.max".into() } }
        );
    }

    #[test]
    fn v1_limit_and_usage() {
        let mi = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        let cg = "4:memory:/job\n0::/\n";
        let read = fake(&[
            ("/sys/fs/cgroup/memory/job/memory.limit_in_bytes", "2147483648\n"),
            ("/sys/fs/cgroup/memory/job/memory.usage_in_bytes", "1073741824\n"),
            ("/sys/fs/cgroup/memory/job/memory.stat", "cache 5\ntotal_inactive_file 536870912\n"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"),
        ]);
        let b = budget_from(Some(MEMINFO_24G), Some(cg), Some(mi), &read).unwrap();
        assert_eq!(b.bytes, (2 << 30) - (512 << 20));
        assert_eq!(
            b.source,
            LimitSource::Cgroup { limit_file: "/sys/fs/cgroup/memory/job/memory.limit_in_bytes".into() }
        );
    }

    #[test]
    fn no_limit_or_missing_files_leave_mem_available() {
        let mi = "41 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        // "max" everywhere.
        let read = fake(&[("/sys/fs/cgroup/job/memory.max", "max\n")]);
        let b = budget_from(Some(MEMINFO_24G), Some("0::/job\n"), Some(mi), &read).unwrap();
        assert_eq!(b, MemoryBudget { bytes: AVAIL, source: LimitSource::MemAvailable });
        // No cgroup files at all, no mountinfo, no /proc/self/cgroup.
        let none = fake(&[]);
        assert_eq!(budget_from(Some(MEMINFO_24G), Some("0::/job\n"), Some(mi), &none).unwrap().bytes, AVAIL);
        assert_eq!(budget_from(Some(MEMINFO_24G), None, None, &none).unwrap().bytes, AVAIL);
        // A cgroup limit above MemAvailable: MemAvailable is the smaller.
        let big =
            fake(&[("/sys/fs/cgroup/job/memory.max", "1099511627776\n"), ("/sys/fs/cgroup/job/memory.current", "0\n")]);
        assert_eq!(
            budget_from(Some(MEMINFO_24G), Some("0::/job\n"), Some(mi), &big).unwrap().source,
            LimitSource::MemAvailable
        );
        // Nothing known at all.
        assert_eq!(budget_from(None, None, None, &none), None);
        // No meminfo, but a cgroup limit.
        let lim = fake(&[("/sys/fs/cgroup/job/memory.max", "4096\n"), ("/sys/fs/cgroup/job/memory.current", "0\n")]);
        assert_eq!(budget_from(None, Some("0::/job\n"), Some(mi), &lim).unwrap().bytes, 4096);
    }

    #[test]
    fn this_machine_has_a_budget() {
        let b = available_memory().expect("Linux has /proc/meminfo");
        assert!(b.bytes > 0);
    }
}
