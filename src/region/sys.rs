//! The few system calls the region needs that std does not wrap: page size
//! and statvfs (through rustix), a sleep between polls of
//! words shared with other processes, and `mincore(2)`, the crate's one raw
//! system call (no maintained wrapper covers it; its safety argument is on
//! [`mincore`]).

use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

/// The system page size in bytes.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

/// Free bytes an unprivileged user may allocate in the file system holding
/// `dir`: `f_bavail * f_frsize` from statvfs(2).
pub fn fs_available(dir: &Path) -> io::Result<u64> {
    let st = rustix::fs::statvfs(dir)?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Sleeps for `d` between two polls of a condition that only another
/// process can change (no condition variable can signal it; loom does not
/// model other processes).
pub fn pause(d: Duration) {
    std::thread::sleep(d);
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

/// `mincore(2)`: one byte a page of `[addr, addr+len)` into `resident`, bit
/// 0 set where the page is resident.
///
/// # Safety
/// `addr` is page aligned and `resident` holds at least one byte for every
/// page of the range (`len.div_ceil(page_size())`), which the kernel writes;
/// the range itself is only inspected (an unmapped one is ENOMEM, not
/// undefined behaviour).
pub(crate) unsafe fn mincore(addr: usize, len: usize, resident: &mut [u8]) -> io::Result<()> {
    assert!(resident.len() >= len.div_ceil(page_size()), "mincore: vector too short");
    // SAFETY: the caller's contract; the vector's length is checked above.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, resident.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
