//! The few system calls the region needs that std does not wrap: page size,
//! statvfs, MemAvailable and a sleep between polls.
//!
//! The sleep is libc's `nanosleep` because production code must not name
//! std's thread module (the sync facade rule); the region's polling is a
//! cross-process wait that loom does not model anyway.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// The system page size in bytes (`sysconf(_SC_PAGESIZE)`).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions; it only reads a
    // configuration value.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    // sysconf returns -1 only for unknown names; _SC_PAGESIZE always exists
    // on Linux. Fall back to 4 KiB rather than panic should that ever change.
    if n <= 0 {
        4096
    } else {
        n as usize
    }
}

/// Free bytes an unprivileged user may allocate in the file system holding
/// `dir`: `f_bavail * f_frsize` from statvfs(2).
pub fn fs_available(dir: &Path) -> io::Result<u64> {
    let c = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: statvfs is plain old data; all-zero is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated string alive for the call and `st` is
    // a valid, writable statvfs the kernel fills in.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn mem_available() -> io::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    parse_mem_available(&text)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no parsable MemAvailable line in /proc/meminfo"))
}

/// Parses the `MemAvailable:  N kB` line of a meminfo text.
pub(crate) fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut it = line["MemAvailable:".len()..].split_whitespace();
    let n: u64 = it.next()?.parse().ok()?;
    match it.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// Sleeps for `d` (nanosleep; an interrupted sleep simply returns early,
/// which callers that poll a condition tolerate).
pub fn pause(d: Duration) {
    let ts = libc::timespec {
        tv_sec: d.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `ts` is a valid timespec; the remainder pointer may be null.
    let rc = unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
    if rc != 0 {
        // EINTR: a signal cut the sleep short; the caller re-checks its
        // condition and deadline, so a short sleep is harmless. EFAULT and
        // EINVAL cannot arise from a valid timespec.
        let e = io::Error::last_os_error();
        debug_assert_eq!(e.raw_os_error(), Some(libc::EINTR), "nanosleep: {e}");
    }
}

/// Polls a condition with a growing pause (50 us doubling to 5 ms) until a
/// deadline. Used only for cross-process waits.
pub(crate) struct Backoff {
    deadline: Instant,
    next: Duration,
}

impl Backoff {
    pub(crate) fn new(timeout: Duration) -> Self {
        Backoff {
            deadline: Instant::now().checked_add(timeout).unwrap_or_else(far_future),
            next: Duration::from_micros(50),
        }
    }

    /// Sleeps before the next poll; returns false once the deadline passed.
    pub(crate) fn wait(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.deadline {
            return false;
        }
        pause(self.next.min(self.deadline - now));
        self.next = (self.next * 2).min(Duration::from_millis(5));
        true
    }
}

fn far_future() -> Instant {
    // A deadline ~100 years away stands in for "no timeout".
    Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mem_available() {
        let t = "MemTotal:  100 kB\nMemFree: 5 kB\nMemAvailable:   24356544 kB\n";
        assert_eq!(parse_mem_available(t), Some(24356544 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: x kB\n"), None);
    }

    #[test]
    fn page_size_is_power_of_two() {
        assert!(page_size().is_power_of_two());
    }

    #[test]
    fn statvfs_of_tmp_works() {
        assert!(fs_available(Path::new("/tmp")).is_ok());
        assert!(fs_available(Path::new("/nonexistent-kvoffload-dir")).is_err());
    }
}
