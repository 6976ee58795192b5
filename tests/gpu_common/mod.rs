//! Shared by the GPU tests: open device 0, or say on the real stderr (not
//! captured by the test harness) that the test was skipped and why.

use kvoffload::protocol::{CapturePolicy, Coordinator};
use kvoffload::runtime::cuda::CudaRuntime;
use kvoffload::runtime::Gate;

/// `f` through the gate of a coordinator with no region: the tests drive
/// the runtime directly and open no window through it, so it never holds a
/// call back (a call made during a capture reaches the driver as before).
#[allow(dead_code)]
pub fn gated<T>(f: impl FnOnce(&Gate) -> T) -> T {
    Coordinator::without_region(CapturePolicy::AfterPinning).unsafe_call("test", f).expect("no window, no refusal")
}

/// Says on the real stderr that `test` was skipped.
pub fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// Device 0, or None (after saying so) where no driver or device exists.
pub fn gpu(test: &str) -> Option<CudaRuntime> {
    if !CudaRuntime::driver_present() {
        skipped(test, "no CUDA driver on this machine");
        return None;
    }
    match CudaRuntime::open(0) {
        Ok(rt) => Some(rt),
        Err(e) => {
            skipped(test, &e.to_string());
            None
        }
    }
}
