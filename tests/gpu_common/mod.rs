//! Shared by the GPU tests: open device 0, or say on the real stderr (not
//! captured by the test harness) that the test was skipped and why.

use kvoffload::runtime::cuda::CudaRuntime;

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
