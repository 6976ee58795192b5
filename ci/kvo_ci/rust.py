"""The subcommands of a machine with the Rust toolchain: test (ci/test), lint,
test-limits, soak and build-gpu-bin.

ci/test: every test, on a machine with only the Rust toolchain (no GPU needed):
  1. ci/lint: rustfmt, clippy with warnings as errors (the capture rule:
     only the coordinator makes a Gate; the sync-facade rule on a loom
     build), rustdoc without warnings,
  2. unit, integration and property tests (GPU tests skip themselves),
     by cargo-nextest under per-test time limits (ci/test-limits: a test
     still running after 2 minutes is killed and named; the doc tests
     after, by cargo test --doc),
  3. the conformance suite on the simulated GPU, and the Python package
     (ci/python: wheel built, installed in a venv, pytest on the sim),
  4. the self-tests of this program (argument parsing, the settings table:
     `ci/kvo_ci selftest`, a second), of ci/prove's checker (a negative that
     fails for another reason than it declares must be refused, N1 must be
     caught), of ci/deadline (a hang is killed and named, a quick command
     passes) and of the per-test limit (ci/test-limits: a test that never
     ends is killed and named),
  5. the loom proofs (ci/prove; the loom build of step 4 is reused: the
     eleven models whose full bound takes 20-130 s run at a lower ci/test
     bound, docs/PROOFS.md "Two depths"; ci/prove --full runs them at
     their full bound, which is what docs/proof-table.md records), then
     shuttle's quick pass (ci/prove --shuttle-quick: every model at the
     sizes past loom's bound, 300 random and 300 PCT schedules each, 100 s
     on 2 cores with its build; ci/prove --full runs 20000 each).
Step 3 runs under ci/deadline, after its builds and installs (ci/python
--setup: on a new machine with no ~/.cache/kvoffload, vLLM's environments
take minutes to download and are not a hang; they print their progress):
a hang fails the step at its deadline (nextest bounds each test of step 2,
ci/prove each model). Each step's time is printed when it ends and all of
them at the end.
CI runs exactly this (.ci/run). 18.6 and 20.0 minutes on 2 cores in two
fresh clones (1116 s at 3ae91ff, 1203 s at b0fd3a0; the vLLM environments
of ci/vllm-env already cached), before step 5's loom pass ran the slow
models at their ci/test bound: that pass went from about 450 s to 143-160 s
(81 models at 816dcc3). Since: 1176 s (19.6 minutes) in a fresh clone at
7010b71 with nothing beside it (loom pass 149 s in the run before).
On a new machine (empty ~/.cache/kvoffload and CARGO_HOME, a fresh clone
at a181792, other builds beside it): passed in 1330 s (22.2 minutes), of
which 253 s the installs of ci/python --setup (vLLM 0.33's venv 199 s);
at 902b649, before the installs left the deadline, the same start failed
at ci/python's 900 s deadline after 490 s of installing (issue 43, item 5).

ci/lint: the habits of a careful Rust project, each one a gate of ci/test:
  1. formatting (rustfmt.toml),
  2. clippy on every target of the workspace (the library, the CLI, the
     Python package's extension) with warnings as errors,
  3. clippy on a loom build of the library with ci/lint-loom/clippy.toml:
     the sync-facade rule (no std::sync / std::thread primitive outside
     src/sync; under loom the facade's types are loom's, so only a bypass
     is flagged),
  4. clippy on a shuttle build of the library (the third facade build:
     its cfg(shuttle) code compiles without a warning),
  5. the library's docs build without a warning (missing docs and broken
     links included), twice: with `kvoffload::internal` documented (rustc's
     missing_docs skips the hidden module, so only this pass checks the
     layers' docs), then as an engine sees them (target/doc).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import List

from kvo_ci import ROOT, deadline, self_cmd
from kvo_ci.command import Command

# ci/python's deadline (its wheel build and tests; the installs run before
# it) and the conformance suite's: a hang fails the step there.
PYTHON_DEADLINE_S = 900
CONFORM_DEADLINE_S = 300
# The doc tests' deadline (nextest does not run them, so no per-test limit).
DOC_TESTS_DEADLINE_S = 300
# ci/test-limits --self-test: the never-ending test must be killed within this.
LIMIT_SELF_TEST_S = 60


def cargo_env() -> None:
    os.chdir(ROOT)
    os.environ.setdefault("CARGO_TERM_COLOR", "never")


class Steps:
    """ci/test's steps: each one's time printed when it ends and all of them
    at the end (on failure too), so a slow machine shows where its minutes went."""

    def __init__(self) -> None:
        self.times: List[str] = []
        self.t_all = time.monotonic()

    def timed(self, name: str, cmd: List[str]) -> None:
        t0 = time.monotonic()
        rc = subprocess.run(cmd).returncode
        line = f"{int(time.monotonic() - t0):6d} s  {name}" + ("" if rc == 0 else f"  (FAILED, exit {rc})")
        self.times.append(line)
        print("-- " + (line[1:] if line.startswith(" ") else line), flush=True)
        if rc != 0:
            raise SystemExit(rc)

    def summary(self) -> None:
        print("== ci/test: time per step")
        for t in self.times:
            print(t)
        print(f"{int(time.monotonic() - self.t_all):6d} s  in all", flush=True)


def ci(name: str) -> str:
    return os.path.join("ci", name)


def test(_ns: argparse.Namespace) -> int:
    cargo_env()
    s = Steps()
    try:
        print("== 1/5 lint: fmt, clippy, doc", flush=True)
        s.timed("lint", [ci("lint")])
        print("== 2/5 cargo nextest (per-test time limits), then the doc tests", flush=True)
        s.timed("nextest and doc tests", [ci("test-limits")])
        print("== 3/5 conformance on the simulated GPU; the Python package", flush=True)
        s.timed("build", ["cargo", "build", "--quiet"])
        s.timed("conformance on the sim", [ci("deadline"), str(CONFORM_DEADLINE_S), "conformance on the sim", "--",
                                           "cargo", "run", "--quiet", "--", "conform", "--backend", "sim"])
        # The installs (the Python venv's packages, vLLM's environments:
        # minutes on a new machine) run before the deadline, with their
        # progress; the deadline bounds the wheel build and the tests only.
        s.timed("python installs (ci/python --setup)", [ci("python"), "--setup"])
        s.timed("ci/python", [ci("deadline"), str(PYTHON_DEADLINE_S), "ci/python (its wheel build included)", "--",
                              ci("python")])
        print("== 4/5 the self-tests of the proof checker and of the deadline", flush=True)
        s.timed("kvo_ci self-test", self_cmd("selftest"))
        s.timed("prove self-test", [ci("prove"), "--self-test"])
        s.timed("deadline self-test", [ci("deadline"), "--self-test"])
        s.timed("test-limits self-test", [ci("test-limits"), "--self-test"])
        print("== 5/5 loom proofs, then shuttle's quick pass", flush=True)
        s.timed("loom proofs", [ci("prove")])
        s.timed("shuttle quick pass", [ci("prove"), "--shuttle-quick"])
        print("ci/test: all passed", flush=True)
    finally:
        s.summary()
    return 0


def sh(cmd: List[str], env: dict = None, cwd: str = None) -> None:
    """Runs `cmd`; its failure ends this program with its exit status (set -e)."""
    rc = subprocess.run(cmd, env=env, cwd=cwd).returncode
    if rc != 0:
        raise SystemExit(rc)


def lint(_ns: argparse.Namespace) -> int:
    cargo_env()
    rustflags = os.environ.get("RUSTFLAGS", "")
    print("-- rustfmt", flush=True)
    sh(["cargo", "fmt", "--all", "--check"])
    print("-- clippy (all targets)", flush=True)
    sh(["cargo", "clippy", "--workspace", "--all-targets", "--quiet", "--", "-D", "warnings"])
    print("-- clippy (loom build of the library: the sync-facade rule)", flush=True)
    sh(["cargo", "clippy", "--lib", "--quiet", "--target-dir", "target/loom", "--", "-D", "warnings"],
       dict(os.environ, CLIPPY_CONF_DIR="ci/lint-loom", RUSTFLAGS=f"{rustflags} --cfg loom"))
    print("-- clippy (shuttle build of the library: its cfg(shuttle) code warning-free)", flush=True)
    # Not the facade rule (loom's pass checks it; under shuttle the facade's Arc
    # is std's, which ci/lint-loom/clippy.toml would flag everywhere).
    sh(["cargo", "clippy", "--lib", "--quiet", "--target-dir", "target/shuttle", "--", "-D", "warnings"],
       dict(os.environ, RUSTFLAGS=f"{rustflags} --cfg shuttle"))
    print("-- rustdoc (the layers under kvoffload::internal, then the engine's view)", flush=True)
    sh(["cargo", "doc", "--no-deps", "--lib", "--quiet"],
       dict(os.environ, RUSTDOCFLAGS="-D warnings --cfg kvo_document_internal"))
    sh(["cargo", "doc", "--no-deps", "--lib", "--quiet"], dict(os.environ, RUSTDOCFLAGS="-D warnings"))
    print("ci/lint: ok", flush=True)
    return 0


def test_limits(argv: List[str]) -> int:
    """ci/test-limits [nextest args]: every plain test by cargo-nextest under
    the limits of .config/nextest.toml (a test still running after 2 minutes
    is killed and named TIMEOUT; the others go on), then the doc tests, which
    nextest does not run, by cargo test --doc under ci/deadline.
    ci/test-limits --self-test: tests/time_limit.rs's test that never ends,
    alone under the limit-self-test profile (2 s), must be killed, reported
    as TIMEOUT by its name, and fail the run, within 60 s.
    Installs cargo-nextest (cargo install --locked) when cargo has none."""
    os.chdir(ROOT)
    if argv[:1] in (["-h"], ["--help"]):
        print(test_limits.__doc__)
        return 0
    if subprocess.run(["cargo", "nextest", "--version"], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL).returncode != 0:
        print("ci/test-limits: cargo-nextest is missing; installing it (cargo install --locked cargo-nextest)",
              flush=True)
        sh(["cargo", "install", "--locked", "--quiet", "cargo-nextest"])
    if argv[:1] == ["--self-test"]:
        return limits_self_test()
    sh(["cargo", "nextest", "run", "--cargo-quiet", "--no-run"])
    sh(["cargo", "nextest", "run", "--cargo-quiet", "--no-fail-fast", *argv])
    return deadline.run(DOC_TESTS_DEADLINE_S, "doc tests", ["cargo", "test", "--quiet", "--doc"])


def limits_self_test() -> int:
    name = "a_wait_that_never_ends_is_killed_and_named"
    sh(["cargo", "nextest", "run", "--cargo-quiet", "--no-run", "--test", "time_limit"])
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        rc = subprocess.run(["timeout", str(LIMIT_SELF_TEST_S), "cargo", "nextest", "run", "--cargo-quiet",
                             "--profile", "limit-self-test", "--test", "time_limit", "--run-ignored", "only",
                             "-E", f"test(={name})"], stdout=log, stderr=subprocess.STDOUT).returncode
        log.seek(0)
        text = log.read().decode(errors="replace")
    took = int(time.monotonic() - start)
    why = None
    if rc == 0:
        why = "the test that never ends passed"
    elif rc == 124:
        why = f"nextest did not kill it within {LIMIT_SELF_TEST_S} s"
    elif not re.search(f"TIMEOUT.*{name}", text):
        why = f"no TIMEOUT line naming {name}"
    if why:
        sys.stdout.write(text)
        print(f"ci/test-limits --self-test: FAILED: {why}")
        return 1
    print(f"ci/test-limits --self-test: ok (the test that never ends was killed and named TIMEOUT after {took} s, "
          f"exit {rc})")
    return 0


def soak(argv: List[str]) -> int:
    """ci/soak [extra kvoffload run options]: a soak of `kvoffload run` on the
    simulated GPU: at least a million transfer jobs (stores + loads over both
    ranks) with copy faults injected about every 1000 copies, every loaded
    block checked byte for byte, then every block still held loaded and
    checked. Not part of ci/test (it takes minutes). Last line: "soak: N
    jobs, L lost, C corrupted"; exit 0 only when N >= 1000000 and L = C = 0
    and the run itself succeeded."""
    cargo_env()
    if subprocess.run(["cargo", "build", "--release", "--quiet"]).returncode != 0:
        return 2
    exe = os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "release", "kvoffload")
    start = time.monotonic()
    # Small blocks (2 layers x 4 KiB), one block per request: each request is
    # one store or one load (or none while its key's store is in flight).
    p = subprocess.Popen([exe, "run", "--backend", "sim", "--ranks", "2", "--region", "64MiB", "--layers", "2",
                          "--page-bytes", "4KiB", "--blocks-per-job", "1", "--keys", "20000", "--zipf", "0.9",
                          "--jobs", "600000", "--inflight", "16", "--graphs", "2", "--startup-ms", "0",
                          "--fault-copy-every", "1000", *argv], stdout=subprocess.PIPE, text=True)
    lines = []
    for line in p.stdout:
        sys.stdout.write(line)
        lines.append(line)
    rc = p.wait()
    secs = int(time.monotonic() - start)

    def number(prefix: str, word: str):
        for line in lines:
            if line.startswith(prefix):
                m = re.search(rf" ([0-9]+) {word}", line)
                return int(m.group(1)) if m else None
        return None

    stores, loads = number("total:", "stores"), number("total:", "loads")
    lost, corrupted = number("blocks:", "lost"), number("blocks:", "corrupted")
    jobs = (stores or 0) + (loads or 0)
    print(f"soak: run exit status {rc}, {secs} s")
    print(f"soak: {jobs} jobs, {'?' if lost is None else lost} lost, "
          f"{'?' if corrupted is None else corrupted} corrupted", flush=True)
    return 0 if rc == 0 and jobs >= 1000000 and lost == 0 and corrupted == 0 else 1


def is_gpu_test(name: str) -> bool:
    """The GPU test binaries (tests/gpu_*.rs, tests/*_gpu.rs, and
    tests/offloader.rs, whose round trip runs on the GPU too; the others
    need no GPU and run in ci/test)."""
    return name.startswith("gpu_") or name.endswith("_gpu") or name == "offloader"


def build_gpu_bin(ns: argparse.Namespace) -> int:
    """Builds everything ci/gpu needs into OUT_DIR (default gpu-bin/, ignored
    by git): the release CLI, the GPU test binaries and the wheel, all from
    the tree as it is now (the wheel by maturin from ci/python's venv:
    `KVO_SKIP_VLLM=1 ci/python --setup` makes it; --no-wheel leaves the
    wheel out). Run it on a machine with the Rust toolchain; carry the
    folder to the GPU machine, which has none."""
    cargo_env()
    out = ns.out_dir
    venv = "target/python-venv"
    maturin, vpy = os.path.abspath(f"{venv}/bin/maturin"), os.path.abspath(f"{venv}/bin/python")
    if not ns.no_wheel and not os.access(maturin, os.X_OK):
        # A wheel ci/python built earlier may predate the tree: once the GPU
        # run of 2026-12-07 measured such a wheel's engines, not HEAD's.
        print(f"ci/build-gpu-bin: no maturin in {venv}: run `KVO_SKIP_VLLM=1 ci/python --setup` first "
              "(or --no-wheel to leave the Python package out)", file=sys.stderr)
        return 1
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(out, "tests"))
    sh(["cargo", "build", "--release", "--quiet"])
    shutil.copy("target/release/kvoffload", out)
    # cargo prints one JSON line per artifact.
    p = subprocess.run(["cargo", "test", "--release", "--no-run", "--message-format=json", "--quiet"],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in p.stdout.splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        exe, name = m.get("executable"), m.get("target", {}).get("name", "")
        if m.get("reason") == "compiler-artifact" and exe and m["target"]["kind"] == ["test"] and is_gpu_test(name):
            shutil.copy(exe, os.path.join(out, "tests", name))
    if ns.no_wheel:
        print("ci/build-gpu-bin: --no-wheel: ci/gpu will skip the Python part", flush=True)
    else:
        # The wheel of this tree, straight into OUT_DIR (never target/wheels'
        # copy, which ci/python made from whatever the tree was then).
        for f in glob.glob("python/kvoffload/_native*.so"):
            os.remove(f)
        sh([maturin, "build", "--release", "--strip", "--quiet", "--out", os.path.abspath(out),
            "--interpreter", vpy], cwd="python")
    # Debug info is not needed on the GPU machine; it would not fit the carry limit.
    tests = sorted(os.path.join(out, "tests", t) for t in os.listdir(os.path.join(out, "tests")))
    sh(["strip", os.path.join(out, "kvoffload"), *tests])
    sh(["du", "-sh", out])
    sh(["ls", "-1", out, os.path.join(out, "tests")])
    return 0


def configure_build_gpu_bin(p: argparse.ArgumentParser) -> None:
    p.description = build_gpu_bin.__doc__
    p.add_argument("out_dir", nargs="?", default="gpu-bin", metavar="OUT_DIR", help="default gpu-bin")
    p.add_argument("--no-wheel", action="store_true", help="leave the wheel out (ci/gpu skips the Python part)")


def configure_none(p: argparse.ArgumentParser) -> None:
    p.description = (__doc__.split("\n\nci/lint")[0] if p.prog.endswith("test")
                     else "ci/lint" + __doc__.split("\n\nci/lint", 1)[1])


COMMANDS = [
    Command("test", "ci/test: every test of a machine with the Rust toolchain (what CI runs)", test, configure_none),
    Command("lint", "ci/lint: rustfmt, clippy (all targets, loom, shuttle), rustdoc", lint, configure_none),
    Command("test-limits", "ci/test-limits [--self-test | nextest args]: nextest under per-test limits, "
            "then the doc tests", test_limits),
    Command("soak", "ci/soak [kvoffload run options]: a million jobs with faults on the simulated GPU", soak),
    Command("build-gpu-bin", "ci/build-gpu-bin [OUT_DIR]: the release CLI, GPU test binaries and the wheel "
            "for ci/gpu", build_gpu_bin, configure_build_gpu_bin),
]
