//! Where the time of pinning a shared region goes, measured apart.
//!
//! `cargo run --release --example pin_probe -- [GiB] [threads]`
//! (`KVO_PROBE_DIR`: directory of the shared files, default /dev/shm;
//! `KVO_PROBE_ONLY`: run only the cases whose name contains it).
//!
//! For each kind of memory (anonymous with 4 KiB pages or transparent huge
//! pages; one /dev/shm file; several files side by side or interleaved in
//! segments, to spread the page-cache work over inodes; a memfd, with and
//! without MFD_HUGETLB (which needs reserved hugetlb pages); files pre-allocated
//! with fallocate; MADV_POPULATE_READ instead of WRITE; other registration
//! call sizes; and a few runs on memory the VM has had time to hand back to
//! its host, "COLD") it maps the size and times apart:
//! - pre-faulting with `threads` threads (one stripe each);
//! - registering the faulted memory from one thread in chunk-sized calls;
//! - unregistering.
//!
//! A diagnostic for the pinning speed of `kvoffload run` on /dev/shm; the
//! H200 figures and what they decided are in
//! docs/gpu-runs/2026-11-29-run7-pin-probe.md. It needs a GPU.

use std::ffi::CString;
use std::time::Instant;

use kvoffload::internal::protocol::{CapturePolicy, Coordinator};
use kvoffload::internal::runtime::cuda::CudaRuntime;
use kvoffload::internal::runtime::GpuRuntime;
use kvoffload::Request;

const GIB: usize = 1 << 30;
const MADV_POPULATE_WRITE: libc::c_int = 23;

struct Mapping {
    addr: usize,
    len: usize,
    fds: Vec<libc::c_int>,
    paths: Vec<CString>,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `addr..addr+len` is a mapping this probe made and no longer uses.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
        for &fd in &self.fds {
            // SAFETY: fds this probe opened.
            unsafe { libc::close(fd) };
        }
        for p in &self.paths {
            // SAFETY: a NUL-terminated path this probe created.
            unsafe { libc::unlink(p.as_ptr()) };
        }
    }
}

fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn map_anon(len: usize, huge: bool) -> Result<Mapping, String> {
    // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_err("mmap anon"));
    }
    let advice = if huge { libc::MADV_HUGEPAGE } else { libc::MADV_NOHUGEPAGE };
    // SAFETY: advice on the mapping made above.
    unsafe { libc::madvise(p, len, advice) };
    Ok(Mapping { addr: p as usize, len, fds: vec![], paths: vec![] })
}

/// `files` files of `len / files` bytes each, mapped into one reserved
/// range in segments of `seg` bytes dealt round-robin over the files
/// (`seg == len / files`: side by side); memfds when `memfd` is Some(flags),
/// /dev/shm files otherwise.
fn map_files(len: usize, files: usize, seg: usize, memfd: Option<libc::c_uint>) -> Result<Mapping, String> {
    let part = len / files;
    // SAFETY: reserve an address range; the files are mapped over it with MAP_FIXED.
    let base = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if base == libc::MAP_FAILED {
        return Err(os_err("mmap reserve"));
    }
    let mut m = Mapping { addr: base as usize, len, fds: vec![], paths: vec![] };
    for i in 0..files {
        let dir = std::env::var("KVO_PROBE_DIR").unwrap_or_else(|_| "/dev/shm".into());
        let name = CString::new(format!("{dir}/kvo-probe-{}-{i}", std::process::id())).unwrap();
        let fd = match memfd {
            Some(flags) => {
                let n = CString::new("kvo-probe").unwrap();
                // SAFETY: a NUL-terminated name.
                unsafe { libc::memfd_create(n.as_ptr(), flags) }
            }
            None => {
                // SAFETY: a NUL-terminated path.
                let fd = unsafe { libc::open(name.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600) };
                if fd >= 0 {
                    m.paths.push(name);
                }
                fd
            }
        };
        if fd < 0 {
            return Err(os_err("open/memfd_create"));
        }
        m.fds.push(fd);
        // SAFETY: fd is open.
        if unsafe { libc::ftruncate(fd, part as libc::off_t) } != 0 {
            return Err(os_err("ftruncate"));
        }
    }
    for s in 0..len / seg {
        let (file, foff) = (s % files, (s / files) * seg);
        let at = (m.addr + s * seg) as *mut libc::c_void;
        // SAFETY: `at..at+seg` lies in the reservation above.
        let p = unsafe {
            libc::mmap(
                at,
                seg,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                m.fds[file],
                foff as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap file"));
        }
    }
    Ok(m)
}

fn on_threads(threads: usize, f: impl Fn(usize) -> Result<(), String> + Sync) -> Result<f64, String> {
    let t = Instant::now();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|k| {
                let f = &f;
                s.spawn(move || f(k))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Result<Vec<_>, _>>()
    })?;
    Ok(t.elapsed().as_secs_f64())
}

/// Pre-faults `m` with `threads` threads, one contiguous stripe each.
fn populate(m: &Mapping, threads: usize, advice: libc::c_int) -> Result<f64, String> {
    let stripe = (m.len / threads).next_multiple_of(2 << 20);
    on_threads(threads, |i| {
        let (a, end) = (m.addr + i * stripe, m.addr + m.len);
        if a >= end {
            return Ok(());
        }
        // SAFETY: a range inside the mapping.
        match unsafe { libc::madvise(a as *mut libc::c_void, stripe.min(end - a), advice) } {
            0 => Ok(()),
            _ => Err(os_err("MADV_POPULATE")),
        }
    })
}

/// fallocate of every file, one thread per file.
fn fallocate(m: &Mapping) -> Result<f64, String> {
    let part = m.len / m.fds.len();
    on_threads(m.fds.len(), |i| {
        // SAFETY: an open fd of this probe.
        match unsafe { libc::fallocate(m.fds[i], 0, 0, part as libc::off_t) } {
            0 => Ok(()),
            _ => Err(os_err("fallocate")),
        }
    })
}

/// Registers `m` in `chunk`-byte calls from one thread, then unregisters.
///
/// The calls go through the gate of a coordinator of the probe's own (the
/// runtime asks for one); it has no region and the probe captures nothing,
/// so it never holds a call back.
fn register(rt: &CudaRuntime, m: &Mapping, chunk: usize) -> Result<(f64, f64), String> {
    let coord = Coordinator::without_region(rt, CapturePolicy::AfterPinning).map_err(|e| e.to_string())?;
    let gated = |f: &dyn Fn(&kvoffload::internal::runtime::Gate) -> kvoffload::internal::runtime::DriverResult<()>| {
        coord.unsafe_call("pin probe", Request::new(), f).map_err(|e| e.to_string())?.map_err(|e| e.to_string())
    };
    let n = m.len.div_ceil(chunk);
    let t = Instant::now();
    for c in 0..n {
        let len = chunk.min(m.len - c * chunk);
        // SAFETY: a mapped range that stays mapped until unregistered: below,
        // or, should a registration fail, right here.
        let r = gated(&|g| unsafe { rt.host_register(g, m.addr + c * chunk, len) });
        if let Err(e) = r {
            for done in (0..c).rev() {
                if let Err(u) = gated(&|g| rt.host_unregister(g, m.addr + done * chunk)) {
                    // Unmapping registered memory is what the driver forbids.
                    eprintln!("pin_probe: undoing a registration failed ({u}) after {e}; aborting");
                    std::process::abort();
                }
            }
            return Err(e);
        }
    }
    let reg = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for c in 0..n {
        if let Err(e) = gated(&|g| rt.host_unregister(g, m.addr + c * chunk)) {
            eprintln!("pin_probe: unregistering failed ({e}); aborting rather than unmapping registered memory");
            std::process::abort();
        }
    }
    Ok((reg, t.elapsed().as_secs_f64()))
}

/// Maps, pre-faults and unmaps `len` bytes of anonymous memory, so the
/// machine (a VM that hands freed memory back to its host) has it backed.
fn warm_up(len: usize, threads: usize) -> Result<f64, String> {
    let m = map_anon(len, true)?;
    populate(&m, threads, MADV_POPULATE_WRITE)
}

struct Case {
    name: &'static str,
    make: Box<dyn Fn() -> Result<Mapping, String>>,
    fallocate: bool,
    advice: libc::c_int,
    chunk: usize,
    cold: bool,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let gib: usize = args.first().map_or(16, |s| s.parse().expect("GiB"));
    let threads: usize = args.get(1).map_or(16, |s| s.parse().expect("threads"));
    let len = gib * GIB;
    let rt = match CudaRuntime::open(0) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pin_probe: skipped, no GPU ({e})");
            return;
        }
    };
    println!("pin_probe: {} ; {gib} GiB, {threads} threads", rt.describe());
    let mib = 1usize << 20;
    let c = |name, make: Box<dyn Fn() -> Result<Mapping, String>>| Case {
        name,
        make,
        fallocate: false,
        advice: MADV_POPULATE_WRITE,
        chunk: 256 * mib,
        cold: false,
    };
    let t = threads;
    let only: Option<String> = std::env::var("KVO_PROBE_ONLY").ok();
    let cases = vec![
        c("anon THP", Box::new(move || map_anon(len, true))),
        c("anon 4K", Box::new(move || map_anon(len, false))),
        c("shm 1 file", Box::new(move || map_files(len, 1, len, None))),
        c("shm T files side by side", Box::new(move || map_files(len, t, len / t, None))),
        c("shm T files, 2 MiB segments", Box::new(move || map_files(len, t, 2 * mib, None))),
        c("shm T files, 16 MiB segments", Box::new(move || map_files(len, t, 16 * mib, None))),
        c("shm 4T files, 16 MiB segments", Box::new(move || map_files(len, 4 * t, 16 * mib, None))),
        c("memfd", Box::new(move || map_files(len, 1, len, Some(0)))),
        c("memfd MFD_HUGETLB", Box::new(move || map_files(len, 1, len, Some(libc::MFD_HUGETLB)))),
        Case {
            fallocate: true,
            ..c("shm T files side by side, fallocate", Box::new(move || map_files(len, t, len / t, None)))
        },
        Case {
            advice: 22,
            ..c("shm T files side by side, POPULATE_READ", Box::new(move || map_files(len, t, len / t, None)))
        },
        Case {
            chunk: mib,
            ..c("shm T files side by side, 1 MiB calls", Box::new(move || map_files(len, t, len / t, None)))
        },
        Case {
            chunk: 4 * GIB,
            ..c("shm T files side by side, 4 GiB calls", Box::new(move || map_files(len, t, len / t, None)))
        },
        Case {
            cold: true,
            ..c("COLD shm T files, 16 MiB segments", Box::new(move || map_files(len, t, 16 * mib, None)))
        },
        Case { cold: true, ..c("COLD shm 1 file", Box::new(move || map_files(len, 1, len, None))) },
        Case { cold: true, ..c("COLD anon THP", Box::new(move || map_anon(len, true))) },
    ];
    println!(
        "{:<44} {:>7} {:>7} {:>7} {:>8} {:>6} {:>8} {:>6} {:>7}",
        "memory", "warm s", "falloc", "fault s", "GB/s", "chunk", "reg s", "GB/s", "unreg s"
    );
    for case in cases {
        if only.as_ref().is_some_and(|o| !case.name.contains(o.as_str())) {
            continue;
        }
        let warm = if case.cold {
            // Diagnostic only: give the VM time to hand freed memory back.
            std::thread::sleep(std::time::Duration::from_secs(10));
            0.0
        } else {
            match warm_up(len, threads) {
                Ok(s) => s,
                Err(e) => {
                    println!("{:<44} warm-up failed: {e}", case.name);
                    continue;
                }
            }
        };
        let r = (|| {
            let m = (case.make)()?;
            let fa = if case.fallocate { fallocate(&m)? } else { 0.0 };
            let fault = populate(&m, threads, case.advice)?;
            let (reg, unreg) = register(&rt, &m, case.chunk)?;
            Ok::<_, String>((fa, fault, reg, unreg))
        })();
        let gbs = |s: f64| len as f64 / s / 1e9;
        match r {
            Ok((fa, fault, reg, unreg)) => println!(
                "{:<44} {warm:>7.3} {fa:>7.3} {fault:>7.3} {:>8.2} {:>5}M {reg:>8.3} {:>6.1} {unreg:>7.3}",
                case.name,
                gbs(fa + fault),
                case.chunk >> 20,
                gbs(reg)
            ),
            Err(e) => println!("{:<44} failed: {e}", case.name),
        }
    }
}
