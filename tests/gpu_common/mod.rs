//! Shared by the GPU tests: open device 0, or say why it cannot be opened.
//!
//! What happens when device 0 cannot be opened (no driver library, or
//! `CudaRuntime::open(0)` fails) is decided by the environment variable
//! `KVO_EXPECT_GPU` ([`EXPECT_GPU_VAR`]):
//!
//! - unset, empty or `0` (ci/test, machines with no GPU): the test says
//!   `SKIPPED <test>: <why>` on the real stderr (not captured by the test
//!   harness) and passes;
//! - anything else (ci/gpu exports `KVO_EXPECT_GPU=1`: a GPU is expected
//!   there): the test FAILS (panics) with the reason: for a missing driver,
//!   which library could not be loaded and the loader's error; for an open
//!   error, that error as the driver reported it. A GPU machine whose driver
//!   set-up is broken then fails the suite instead of skipping it green.
//!
//! python/tests/test_gpu.py follows the same rule (pytest.fail instead of
//! skip when the variable is set).

use kvoffload::internal::protocol::Coordinator;
use kvoffload::internal::runtime::Gate;
use kvoffload::{CapturePolicy, CudaRuntime, GpuRuntime, Request};

/// `f` through the gate of a coordinator with no region: the tests drive
/// the runtime directly and open no window through it, so it never holds a
/// call back (a call made during a capture reaches the driver as before).
#[allow(dead_code)]
pub fn gated<T>(rt: &dyn GpuRuntime, f: impl FnOnce(&Gate) -> T) -> T {
    Coordinator::without_region(rt, CapturePolicy::AfterPinning)
        .expect("no other coordinator guards this runtime")
        .unsafe_call("test", Request::new(), f)
        .expect("no window, no refusal")
}

/// The variable that says a GPU is expected (see the module docs).
pub const EXPECT_GPU_VAR: &str = "KVO_EXPECT_GPU";

/// True when [`EXPECT_GPU_VAR`] is set to anything but empty or `0`.
pub fn expect_gpu() -> bool {
    std::env::var_os(EXPECT_GPU_VAR).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Device 0 cannot be opened for `test`, because of `why`: fails the test
/// where a GPU is expected, otherwise says on the real stderr that `test`
/// was skipped (and passes).
pub fn unavailable(test: &str, why: &str) {
    if expect_gpu() {
        panic!("{test}: {EXPECT_GPU_VAR} is set (a GPU is expected here) but device 0 cannot be opened: {why}");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why} (set {EXPECT_GPU_VAR}=1 to fail instead)");
}

/// Why the driver library is missing: the loader's error for the driver's
/// soname, and the names cudarc tries (`CudaRuntime::driver_present` is
/// true when any of them loads).
fn no_driver() -> String {
    let soname = "libcuda.so.1";
    let c = std::ffi::CString::new(soname).expect("no NUL in the name");
    // SAFETY: `c` is a NUL-terminated string that outlives the call; a
    // handle that comes back is closed at once, and dlerror's string is
    // copied before any other dl call on this thread.
    let loader = unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if h.is_null() {
            let e = libc::dlerror();
            if e.is_null() {
                "no error text".to_string()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        } else {
            libc::dlclose(h);
            "it loads now, but none of the names below did a moment ago".to_string()
        }
    };
    let mut names = cudarc::get_lib_name_candidates("cuda");
    names.sort();
    names.dedup();
    format!(
        "no CUDA driver on this machine: the driver library {soname} cannot be loaded ({loader}); \
         none of the {} names cudarc tries loads either ({}); LD_LIBRARY_PATH={:?}",
        names.len(),
        names.join(", "),
        std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
    )
}

/// Device 0, or None where no driver or device exists (after saying so;
/// under [`EXPECT_GPU_VAR`] the test fails instead, see the module docs).
pub fn gpu(test: &str) -> Option<CudaRuntime> {
    if !CudaRuntime::driver_present() {
        unavailable(test, &no_driver());
        return None;
    }
    match CudaRuntime::open(0) {
        Ok(rt) => Some(rt),
        Err(e) => {
            unavailable(test, &format!("CudaRuntime::open(0) failed: {e}"));
            None
        }
    }
}
