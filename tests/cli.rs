//! The command line: bad input gives one clear line and a non-zero exit,
//! never a panic.

use std::process::Command;

fn kvoffload(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvoffload")).args(args).output().expect("run kvoffload");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn unknown_backend_is_one_line() {
    let (code, _, err) = kvoffload(&["conform", "--backend", "gpu"]);
    assert_eq!(code, 2);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("gpu") && err.contains("sim"), "{err}");
}

#[test]
fn unknown_command_is_one_line() {
    let (code, _, err) = kvoffload(&["fly"]);
    assert_eq!(code, 2);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn missing_driver_is_one_line() {
    if kvoffload::internal::runtime::cuda::CudaRuntime::driver_present() {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "SKIPPED missing_driver_is_one_line: a CUDA driver is present");
        return;
    }
    let (code, out, err) = kvoffload(&["conform", "--backend", "cuda"]);
    assert_eq!(code, 2);
    assert!(out.is_empty());
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("no CUDA driver"), "{err}");
}

#[test]
fn conform_on_the_simulated_gpu_passes() {
    let (code, out, _) = kvoffload(&["conform", "--only", "cell/register"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("0 mismatches"), "{out}");
}

#[test]
fn bench_manager_rejects_bad_capacity() {
    let (code, _, err) = kvoffload(&["bench", "manager", "--capacity", "0"]);
    assert_eq!(code, 2);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn bench_pin_shared_runs_on_the_simulated_gpu_and_leaves_no_file() {
    let (code, out, err) = kvoffload(&[
        "bench",
        "pin",
        "--shared",
        "--backend",
        "sim",
        "--ranks",
        "1,2",
        "--size",
        "64MiB",
        "--variants",
        "old,new,new-noreserve,rows",
        "--no-warmup",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    for v in ["old ", "new ", "new-noreserve ", "rows "] {
        assert_eq!(out.lines().filter(|l| l.starts_with(v) && l.contains("ok (")).count(), 2, "{v}: {out}");
    }
    assert!(out.contains("64 MiB x 2 rank(s): old"), "{out}");
    assert!(out.contains("simulated GPU"), "{out}");
    assert!(!out.contains("FAILED"), "{out}");
}

#[test]
fn bench_pin_shared_rejects_bad_shapes_in_one_line() {
    // 3 ranks x 2 MiB slots do not divide 64 MiB.
    let (code, _, err) =
        kvoffload(&["bench", "pin", "--shared", "--backend", "sim", "--ranks", "3", "--size", "64MiB", "--no-warmup"]);
    assert_eq!(code, 2);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("not a positive multiple"), "{err}");
    let (code, _, err) = kvoffload(&["bench", "pin", "--shared", "--backend", "sim", "--variants", "nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown variant"), "{err}");
    let (code, _, err) = kvoffload(&["bench", "pin", "--size", "1GiB,2GiB", "--backend", "sim"]);
    assert_eq!(code, 2);
    assert!(err.contains("one size"), "{err}");
}
