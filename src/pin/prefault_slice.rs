//! Faulting one slice of a chunk in: `madvise(MADV_POPULATE_WRITE)`, or
//! touching one byte per page where the kernel lacks it, without changing
//! memory contents, with the safety argument of every access; the probe
//! of the kernel, the reservation hook run before a slice is touched, and
//! the transparent-huge-page settings. The worker pool that hands the
//! slices out is [`super::prefault`].

use std::ffi::c_void;
use std::io;

use crate::region::page_size;

use super::options::PrefaultMode;

/// Size of a transparent huge page on x86-64 and most arm64 kernels.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Retries of `madvise` on EINTR or EAGAIN before giving up.
const MADVISE_RETRIES: usize = 16;

/// Settings of a [`Prefaulter`](super::Prefaulter).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PrefaultConfig {
    /// Worker threads (at least 1).
    pub threads: usize,
    /// How pages are made resident ([`PrefaultMode::Off`]: not at all).
    pub mode: PrefaultMode,
    /// Huge pages were requested for the memory: slices are 2 MiB aligned
    /// and page touching steps by 2 MiB (then fills the holes).
    pub huge_pages: bool,
}

/// Why pre-faulting a chunk failed. In the engine it becomes
/// [`PageableReason::HostMemory`](crate::protocol::PageableReason::HostMemory).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrefaultError {
    /// The chunk does not start on a page boundary.
    #[error("chunk {chunk}: address {addr:#x} is not a multiple of the page size {page}")]
    Misaligned {
        /// Index of the registration chunk the slice belongs to (0: the region's first).
        chunk: usize,
        /// Start address of the chunk.
        addr: usize,
        /// The page size it must be a multiple of.
        page: usize,
    },
    /// `madvise(MADV_POPULATE_WRITE)` failed with something other than
    /// EINVAL (e.g. ENOMEM: not mapped or out of memory; EFAULT: the backing
    /// file system is full; EHWPOISON).
    #[error("chunk {chunk}: madvise(MADV_POPULATE_WRITE) of {len} bytes at {addr:#x} failed: {msg}")]
    Populate {
        /// Index of the registration chunk the slice belongs to (0: the region's first).
        chunk: usize,
        /// Start of the slice that failed.
        addr: usize,
        /// Bytes of the slice.
        len: usize,
        /// The `errno` the kernel returned (ENOMEM 12, EFAULT 14, ...).
        errno: i32,
        /// The errno's text.
        msg: String,
    },
    /// `mincore` failed while checking which pages touching missed.
    #[error("chunk {chunk}: mincore of {len} bytes at {addr:#x} failed: {msg}")]
    Mincore {
        /// Index of the registration chunk the slice belongs to (0: the region's first).
        chunk: usize,
        /// Start of the slice.
        addr: usize,
        /// Bytes of the slice.
        len: usize,
        /// The errno's text.
        msg: String,
    },
    /// A worker panicked while faulting a slice of the chunk.
    #[error("chunk {chunk}: a pre-fault worker panicked: {msg}")]
    Panicked {
        /// Index of the registration chunk the slice belongs to (0: the region's first).
        chunk: usize,
        /// The panic message.
        msg: String,
    },
    /// Reserving a slice's pages in its file system (the hook of
    /// [`Prefaulter::reserving`](super::Prefaulter::reserving), a shared
    /// region with deferred reservation) failed; the slice was not touched.
    /// For a full file system the text is the region's
    /// [`RegionError::ShmFull`](crate::region::RegionError::ShmFull).
    #[error("chunk {chunk}: reserving {len} bytes at {addr:#x} failed: {msg}")]
    Reserve {
        /// Index of the registration chunk the slice belongs to (0: the region's first).
        chunk: usize,
        /// Start of the slice.
        addr: usize,
        /// Bytes of the slice.
        len: usize,
        /// What the reservation said.
        msg: String,
    },
    /// A worker panicked outside the slices it faults (in the pool's
    /// bookkeeping, the reservation hook, or before it had placed itself):
    /// the pool stopped for good, and every `ensure` waiting for a chunk not
    /// done, or called later, fails with this.
    #[error("chunk {chunk}: the pre-fault pool stopped: a worker panicked outside a slice: {msg}")]
    PoolBroken {
        /// Index of the registration chunk `ensure` was called for.
        chunk: usize,
        /// The panic message.
        msg: String,
    },
    /// Pre-faulting was stopped ([`Prefault::settle`](super::Prefault::settle)) before the chunk
    /// was done.
    #[error("chunk {chunk}: pre-faulting was stopped before the chunk was resident")]
    Stopped {
        /// Index of the registration chunk the slice belongs to (0: the region's first).
        chunk: usize,
    },
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Populate {
    Unknown,
    Works,
    Unsupported,
}

#[derive(Copy, Clone, Debug)]
pub(super) struct Slice {
    pub(super) job: u64,
    pub(super) chunk: usize,
    pub(super) addr: usize,
    pub(super) len: usize,
    /// The data file the slice lies in (plan only).
    pub(super) lane: Option<usize>,
}

/// Reserves `len` bytes at `addr` before they are touched
/// ([`Prefaulter::reserving`](super::Prefaulter::reserving)).
pub type ReserveFn = Box<dyn Fn(usize, usize) -> Result<(), String> + Send + Sync>;

pub(super) fn align(cfg: &PrefaultConfig, huge_bytes: usize) -> usize {
    if cfg.huge_pages {
        huge_bytes.max(page_size())
    } else {
        page_size()
    }
}

pub(super) fn round_down(x: usize, a: usize) -> usize {
    x - x % a
}

/// EINVAL's number (the errors here are kept as raw numbers for reports).
const EINVAL: i32 = rustix::io::Errno::INVAL.raw_os_error();

fn errno_text(e: i32) -> String {
    io::Error::from_raw_os_error(e).to_string()
}

/// `madvise(MADV_POPULATE_WRITE)` of one slice; the errno on failure.
fn populate_write(addr: usize, len: usize) -> Result<(), i32> {
    retry_interrupted(|| {
        // SAFETY: madvise only acts on this process's page tables for the
        // range; MADV_POPULATE_WRITE allocates pages as a write fault would
        // and never changes memory contents. An address range that is not
        // mapped is answered with ENOMEM, not undefined behaviour.
        unsafe { rustix::mm::madvise(addr as *mut c_void, len, rustix::mm::Advice::LinuxPopulateWrite) }
    })
}

/// Calls `call` until it succeeds, fails with an errno other than EINTR or
/// EAGAIN, or has been retried [`MADVISE_RETRIES`] times; the last errno
/// on failure. A seam of its own so that the retry is tested with errors
/// this kernel never returns.
fn retry_interrupted(mut call: impl FnMut() -> rustix::io::Result<()>) -> Result<(), i32> {
    let mut tries = 0;
    loop {
        match call() {
            Ok(()) => return Ok(()),
            Err(e) if (e == rustix::io::Errno::INTR || e == rustix::io::Errno::AGAIN) && tries < MADVISE_RETRIES => {
                tries += 1;
            }
            Err(e) => return Err(e.raw_os_error()),
        }
    }
}

/// `madvise(MADV_NOHUGEPAGE)`: later faults of the range allocate base
/// pages; the errno on failure.
///
/// # Safety
/// `[addr, addr+len)` is a mapping of this process whose owner accepts the
/// advice (it changes no memory contents and no page already present).
pub(super) unsafe fn advise_no_huge(addr: usize, len: usize) -> Result<(), i32> {
    // SAFETY: the caller's contract; madvise acts on this process's VMA
    // flags only, and answers an unmapped range with ENOMEM.
    unsafe { rustix::mm::madvise(addr as *mut c_void, len, rustix::mm::Advice::LinuxNoHugepage) }
        .map_err(|e| e.raw_os_error())
}

/// Faults the page holding `addr` in for writing without changing it.
///
/// # Safety
/// `addr` lies in a live, readable and writable mapping of this process.
unsafe fn touch_byte(addr: usize) {
    // SAFETY: the caller guarantees `addr` is valid for reads and writes;
    // AtomicU8 has the size and alignment (1) of u8. This is not
    // synchronisation (hence core's atomic, not the sync facade's): a
    // compare-exchange of 0 with 0 is a locked read-modify-write, so it
    // faults the page in for writing, and it stores only the value that is
    // already there, so bytes that DMA or another rank write concurrently
    // are never overwritten with stale data.
    let a = unsafe { core::sync::atomic::AtomicU8::from_ptr(addr as *mut u8) };
    let _ = a.compare_exchange(0, 0, core::sync::atomic::Ordering::Relaxed, core::sync::atomic::Ordering::Relaxed);
}

/// Touches one byte per `step` (at `addr` and at every multiple of `step`
/// after it); with `fill_holes`, then every page `mincore` reports absent.
///
/// # Safety
/// `[addr, addr+len)` is a live, readable and writable mapping; `addr` is
/// page aligned.
unsafe fn touch(chunk: usize, addr: usize, len: usize, step: usize, fill_holes: bool) -> Result<(), PrefaultError> {
    let end = addr + len;
    let mut p = addr;
    while p < end {
        // SAFETY: addr <= p < end: inside the range the caller vouches for.
        unsafe { touch_byte(p) };
        p = round_down(p, step) + step;
    }
    if !fill_holes {
        return Ok(());
    }
    let page = page_size();
    let mut resident = vec![0u8; len.div_ceil(page)];
    // SAFETY: `addr` is page aligned and `resident` has one byte for every
    // page of `[addr, addr+len)`.
    if let Err(e) = unsafe { crate::region::mincore(addr, len, &mut resident) } {
        return Err(PrefaultError::Mincore { chunk, addr, len, msg: e.to_string() });
    }
    for (k, r) in resident.iter().enumerate() {
        if r & 1 == 0 {
            // SAFETY: page k of the range, inside it.
            unsafe { touch_byte(addr + k * page) };
        }
    }
    Ok(())
}

/// Makes one slice resident. Returns what it learned about
/// MADV_POPULATE_WRITE, if anything.
///
/// # Safety
/// The slice is a live, readable and writable mapping; its start is page
/// aligned.
unsafe fn run_slice(
    cfg: &PrefaultConfig,
    huge_bytes: usize,
    populate: Populate,
    s: &Slice,
) -> (Result<(), PrefaultError>, Option<Populate>) {
    let step = align(cfg, huge_bytes);
    let fill = step > page_size();
    // SAFETY (both touch calls): the caller's contract for the slice.
    let touch_all = || unsafe { touch(s.chunk, s.addr, s.len, step, fill) };
    match cfg.mode {
        PrefaultMode::Off => (Ok(()), None),
        PrefaultMode::Touch => (touch_all(), None),
        PrefaultMode::Populate if populate == Populate::Unsupported => (touch_all(), None),
        PrefaultMode::Populate => match populate_write(s.addr, s.len) {
            Ok(()) => (Ok(()), (populate == Populate::Unknown).then_some(Populate::Works)),
            // Only when the probe could not run: EINVAL is then taken to
            // mean the kernel lacks the advice. Where the probe showed the
            // kernel has it, EINVAL says something about this mapping (not
            // writable, VM_IO/VM_PFNMAP) and touching would fault: an error.
            Err(e) if e == EINVAL && populate == Populate::Unknown => {
                tracing::info!("madvise(MADV_POPULATE_WRITE) refused with EINVAL (kernel older than 5.14?); touching pages instead");
                (touch_all(), Some(Populate::Unsupported))
            }
            Err(e) => (
                Err(PrefaultError::Populate { chunk: s.chunk, addr: s.addr, len: s.len, errno: e, msg: errno_text(e) }),
                None,
            ),
        },
    }
}

/// Runs one slice, turning a panic into a typed error.
///
/// # Safety
/// As for [`run_slice`].
pub(super) unsafe fn run_slice_caught(
    cfg: &PrefaultConfig,
    reserve: Option<&ReserveFn>,
    huge_bytes: usize,
    populate: Populate,
    s: &Slice,
) -> (Result<(), PrefaultError>, Option<Populate>) {
    // A page touched must have been reserved first (the argument of
    // `region::shm_files`, "Deferred reservation"): the hook runs here, on the
    // thread that faults the slice, before `run_slice` touches any byte of
    // `[s.addr, s.addr + s.len)`, and the slice is skipped (nothing
    // touched) unless it returned success for exactly that range. Slices
    // of one chunk never overlap and a chunk lies in one data file, so
    // every page a worker faults was reserved by that same worker first.
    if let Some(r) = reserve {
        if cfg.mode != PrefaultMode::Off {
            if let Err(msg) = r(s.addr, s.len) {
                return (Err(PrefaultError::Reserve { chunk: s.chunk, addr: s.addr, len: s.len, msg }), None);
            }
        }
    }
    // SAFETY: forwarded contract.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { run_slice(cfg, huge_bytes, populate, s) }))
    {
        Ok(r) => r,
        Err(p) => (Err(PrefaultError::Panicked { chunk: s.chunk, msg: panic_text(&*p) }), None),
    }
}

/// The message a panic was raised with (`panic!("literal")` carries a
/// `&str`, a formatted panic a `String`).
pub(super) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Direct reclaim and compaction stalls plus huge-page faults that fell
/// back to base pages since boot (`allocstall_*`, `compact_stall` and
/// `thp_fault_fallback` of /proc/vmstat, counted system-wide): what grows
/// when faulting transparent huge pages waits for the kernel to free or
/// assemble them (page cache to reclaim, fragmented free memory). None
/// where /proc/vmstat cannot be read or has none of the counters.
pub fn thp_stall_events() -> Option<u64> {
    parse_stall_events(&std::fs::read_to_string("/proc/vmstat").ok()?)
}

fn parse_stall_events(text: &str) -> Option<u64> {
    let mut found = None;
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let Some(key) = it.next() else { continue };
        if key != "compact_stall" && key != "thp_fault_fallback" && !key.starts_with("allocstall") {
            continue;
        }
        if let Some(v) = it.next() {
            *found.get_or_insert(0u64) += v.parse::<u64>().ok()?;
        }
    }
    found
}

/// The selected value of a transparent-huge-page setting, e.g.
/// `thp_setting("enabled")` = `Some("madvise")` for
/// `always [madvise] never` in `/sys/kernel/mm/transparent_hugepage/enabled`.
/// `None` when the file is missing (no THP support) or unreadable.
pub fn thp_setting(name: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/sys/kernel/mm/transparent_hugepage/{name}")).ok()?;
    parse_thp(&text)
}

fn parse_thp(text: &str) -> Option<String> {
    let open = text.find('[')?;
    let close = open + text[open..].find(']')?;
    Some(text[open + 1..close].to_string())
}

/// Whether this kernel knows `MADV_POPULATE_WRITE`, asked once on a page
/// of our own (so that EINVAL later means a bad mapping, not an old kernel).
pub(super) fn probe_populate() -> Populate {
    let page = page_size();
    use rustix::mm::{MapFlags, ProtFlags};
    // SAFETY: a fresh private anonymous mapping at an address of the
    // kernel's choosing; no existing memory is affected.
    let p = match unsafe {
        rustix::mm::mmap_anonymous(std::ptr::null_mut(), page, ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE)
    } {
        Ok(p) => p,
        Err(e) => {
            tracing::debug!(error = %e, "MADV_POPULATE_WRITE probe: mmap failed");
            return Populate::Unknown;
        }
    };
    let r = populate_write(p as usize, page);
    // SAFETY: unmaps exactly the page mapped above, which nothing else uses.
    if let Err(e) = unsafe { rustix::mm::munmap(p, page) } {
        tracing::warn!(error = %e, "MADV_POPULATE_WRITE probe: munmap failed");
    }
    probe_answer(r)
}

/// What the probe's `madvise` answer says of the kernel: it works, it is
/// unknown to the kernel (EINVAL on a page of our own: older than 5.14),
/// or the probe says nothing (any other error).
fn probe_answer(r: Result<(), i32>) -> Populate {
    match r {
        Ok(()) => Populate::Works,
        Err(e) if e == EINVAL => {
            tracing::info!("madvise(MADV_POPULATE_WRITE) is not supported by this kernel (EINVAL); pre-faulting touches pages instead");
            Populate::Unsupported
        }
        Err(e) => {
            tracing::debug!(error = %errno_text(e), "MADV_POPULATE_WRITE probe failed");
            Populate::Unknown
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn stall_events_add_compaction_stalls_and_huge_page_fallbacks() {
        let text = "compact_stall 3\nthp_fault_alloc 99\nthp_fault_fallback 4\nthp_fault_fallback_charge 7\n\
                    allocstall_normal 10\nallocstall_movable 20\ncompact_fail 5\n";
        assert_eq!(parse_stall_events(text), Some(37));
        assert_eq!(parse_stall_events("thp_fault_alloc 1\n"), None);
        assert_eq!(parse_stall_events("compact_stall x\n"), None);
    }

    /// The readers read this machine's files: the same answers as the
    /// parsers on the files read here (the counters only grow between
    /// readings), `None` where a file is missing.
    #[test]
    fn the_readers_read_this_machines_files() {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let thp = read("/sys/kernel/mm/transparent_hugepage/enabled").and_then(|t| parse_thp(&t));
        assert_eq!(thp_setting("enabled"), thp);
        assert_eq!(thp_setting("no-such-setting"), None);
        let before = read("/proc/vmstat").and_then(|t| parse_stall_events(&t));
        let got = thp_stall_events();
        let after = read("/proc/vmstat").and_then(|t| parse_stall_events(&t));
        assert_eq!(got.is_some(), before.is_some());
        if let (Some(b), Some(g), Some(a)) = (before, got, after) {
            assert!(b <= g && g <= a, "{b} <= {g} <= {a}");
        }
        assert_eq!(errno_text(EINVAL), "Invalid argument (os error 22)");
    }

    /// The retry seen with errors this kernel never returns: EINTR and
    /// EAGAIN are retried exactly `MADVISE_RETRIES` times, in any mix,
    /// then reported; any other errno at once; success ends it.
    #[test]
    fn madvise_is_retried_on_eintr_and_eagain_only_and_only_so_often() {
        use rustix::io::Errno;
        for (transient, n, want) in [
            (Errno::INTR, MADVISE_RETRIES, Ok(())),
            (Errno::AGAIN, MADVISE_RETRIES, Ok(())),
            (Errno::INTR, MADVISE_RETRIES + 1, Err(Errno::INTR.raw_os_error())),
            (Errno::AGAIN, MADVISE_RETRIES + 1, Err(Errno::AGAIN.raw_os_error())),
            (Errno::NOMEM, 1, Err(Errno::NOMEM.raw_os_error())),
            (Errno::INVAL, 1, Err(EINVAL)),
        ] {
            let mut calls = 0;
            let got = retry_interrupted(|| {
                calls += 1;
                if calls <= n {
                    Err(transient)
                } else {
                    Ok(())
                }
            });
            assert_eq!(got, want, "{transient:?} {n} times");
            let retried = transient == Errno::INTR || transient == Errno::AGAIN;
            let want_calls = if retried { (n + 1).min(MADVISE_RETRIES + 1) } else { 1 };
            assert_eq!(calls, want_calls, "{transient:?} {n} times: calls");
        }
        // Mixed: EINTR and EAGAIN share one count.
        let mut calls = 0;
        let got = retry_interrupted(|| {
            calls += 1;
            Err(if calls % 2 == 0 { Errno::INTR } else { Errno::AGAIN })
        });
        assert_eq!(calls, MADVISE_RETRIES + 1);
        assert!(got == Err(Errno::INTR.raw_os_error()) || got == Err(Errno::AGAIN.raw_os_error()));
        // A success after a failure of another kind is never reached.
        let mut calls = 0;
        assert_eq!(
            retry_interrupted(|| {
                calls += 1;
                if calls == 1 {
                    Err(Errno::FAULT)
                } else {
                    Ok(())
                }
            }),
            Err(Errno::FAULT.raw_os_error())
        );
        assert_eq!(calls, 1);
    }

    /// The probe's answer: EINVAL (an old kernel) is "unsupported", other
    /// errors say nothing, success is "works".
    #[test]
    fn the_probes_answer_reads_einval_as_an_old_kernel() {
        assert_eq!(probe_answer(Ok(())), Populate::Works);
        assert_eq!(probe_answer(Err(EINVAL)), Populate::Unsupported);
        assert_eq!(probe_answer(Err(rustix::io::Errno::NOMEM.raw_os_error())), Populate::Unknown);
        assert_eq!(probe_answer(Err(rustix::io::Errno::PERM.raw_os_error())), Populate::Unknown);
    }

    #[test]
    fn thp_setting_parses_the_bracketed_choice() {
        assert_eq!(parse_thp("always [madvise] never\n").as_deref(), Some("madvise"));
        assert_eq!(parse_thp("[always] madvise never").as_deref(), Some("always"));
        assert_eq!(parse_thp("nothing"), None);
    }
}
