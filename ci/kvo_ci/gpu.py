"""The GPU machine's subcommands (python3, no Rust toolchain, no network):
gpu, gpu-skips, gpu-pin-probe, gpu-serving and gpu-serve-http.

ci/gpu: the GPU suite, from binaries built beforehand by ci/build-gpu-bin
(KVO_BIN, default gpu-bin/). Runs every GPU test binary, the conformance
suite on the cuda backend, and the benchmarks; writes logs to OUT (default
gpu-out/) and prints a summary last. Exit status: non-zero when any step
failed.

    ci/build-gpu-bin && <copy the tree with gpu-bin/ to the GPU machine> && ci/gpu

--only picks parts (tests memcheck conform incident bench run python vllm;
serving only when named: the serving benchmark, --serving-args); --run-args,
--pin-size, --incident-size, --benches and --huge-tmpfs-size set sizes
(--benches pin-sizes with --pin-sizes and --pin-candidates, pin-shared with
--pin-shared-sizes, --pin-shared-ranks and --pin-shared-repeat, pin-hugetlb
with --pin-hugetlb-size, pin-pressure with --pressure-size,
--pressure-states, --pressure-cache and --pressure-dir); --step-timeout
bounds each step (seconds, default 900).

The vllm part runs where vLLM is importable: from KVO_VLLM_SITE (a folder put
first on PYTHONPATH, e.g. /tmp/site), or unpacked there from KVO_VLLM_BUNDLE
(the shared bundle's site.tar.xz, e.g. ../shared/vllm-0.26-h200/site.tar.xz;
its model/ beside it, or --vllm-model); elsewhere it says why it is skipped.
It runs python/tests/test_vllm.py against that vLLM (the simulated GPU) and
python/bench/vllm_engine.py: real vLLM engines with kvoffload's spec and
vLLM's own (--vllm-engine-args, default: both specs, 4 GiB, FLASH_ATTN, 300
prompts; the committed run of issue 31 passes its own); --no-vllm-pytest
leaves the tests out (they need no GPU: ci/test runs them against 0.26, 0.33
and 0.34).

KVO_EXPECT_GPU (exported here as 1 unless already set): a GPU is expected.
Under it a GPU test that cannot open device 0 (no libcuda, or
CudaRuntime::open failing: a broken driver set-up) FAILS with the driver's
error instead of printing "SKIPPED <test>: <why>" and passing (Rust:
tests/gpu_common/mod.rs; Python: python/tests/test_gpu.py, pytest.fail
instead of skip). Belt and braces: a last self-check step fails, naming
them, if any test of this run still says SKIPPED. KVO_EXPECT_GPU=0 ci/gpu
gives the skipping behaviour back (e.g. to try the script on a machine with
no GPU).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import List, Optional

from kvo_ci import ROOT, setting
from kvo_ci.command import Command

PARTS = "tests memcheck conform incident bench run python vllm"
BENCHES = "pin pin-shared transfer"
RUN_ARGS = ("--ranks 2 --region 16GiB --layers 32 --page-bytes 32KiB --blocks-per-job 16 --gpu-blocks 4096 "
            "--keys 100000 --jobs 4000 --prefill-blocks 8192")
VLLM_ENGINE_ARGS = "--regions 4GiB --attention FLASH_ATTN --prompts 300"
SERVING_ARGS = "--regions 64GiB --reps 1"
PIN_CANDIDATES = "threads=16,lookahead=0,nice=0;threads=16"
PROBE_CANDIDATES = ("lookahead=all;lookahead=2GiB;threads=15,lookahead=all;threads=12,lookahead=all;"
                    "prefault=touch,lookahead=all;chunk=64MiB,lookahead=all;chunk=1GiB,lookahead=all")
PROBE_BIG_CANDIDATES = "lookahead=all,fallback=300;threads=8,lookahead=all"
BUNDLE = "shared/vllm-0.26-h200"


def iec(size: str) -> int:
    """Bytes of a size as numfmt --from=iec reads it ("40GiB", "16G", "2M")."""
    m = re.fullmatch(r"([0-9.]+)([KMGTPE]?)(i?B)?", size.strip())
    if not m:
        raise ValueError(f"not a size: {size}")
    return int(float(m.group(1)) * 1024 ** (" KMGTPE".index(m.group(2) or " ")))


def can_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def first_wheel(folder: str) -> Optional[str]:
    found = sorted(glob.glob(os.path.join(folder, "kvoffload-*.whl")))
    return found[0] if found else None


def unpack(bundle: str, dest: str = "/tmp") -> bool:
    try:
        with tarfile.open(bundle) as t:
            t.extractall(dest, filter="fully_trusted")
        return True
    except (OSError, tarfile.TarError) as e:
        print(f"{bundle}: {e}", file=sys.stderr)
        return False


class Suite:
    """ci/gpu's steps: each one's log in OUT, its result a summary line."""

    def __init__(self, out: str, step_timeout: int) -> None:
        self.out, self.step_timeout = out, step_timeout
        self.summary: List[str] = []
        self.fail = False
        self.logs: List[str] = []  # the logs this run wrote (the self-check reads only those)

    def step(self, name: str, log: str, cmd: List[str], env: Optional[dict] = None) -> int:
        path = os.path.join(self.out, log)
        self.logs.append(path)
        t0 = time.monotonic()
        with open(path, "wb") as f:
            rc = subprocess.run(["timeout", str(self.step_timeout), *cmd], stdout=f, stderr=subprocess.STDOUT,
                                env=env).returncode
        if rc == 124:
            with open(path, "a") as f:
                f.write(f"ci/gpu: {name} stopped after {self.step_timeout} s (--step-timeout)\n")
        dt = f"{time.monotonic() - t0:.1f}"
        if rc == 0:
            self.summary.append(f"PASS  {name} ({dt}s) -> {path}")
        else:
            self.summary.append(f"FAIL  {name} rc={rc} ({dt}s) -> {path}")
            self.fail = True
        with open(path, "rb") as f:
            tail = f.read().decode(errors="replace").splitlines()[-3:]
        for line in tail:
            print(f"  [{name}] {line}")
        sys.stdout.flush()
        return rc


def gpu(ns: argparse.Namespace) -> int:
    os.chdir(ROOT)
    bin_ = setting("KVO_BIN", "gpu-bin")
    out = setting("OUT", "gpu-out")
    kvo = os.path.join(bin_, "kvoffload")
    os.makedirs(out, exist_ok=True)
    os.environ["LD_LIBRARY_PATH"] = os.environ.get("LD_LIBRARY_PATH", "") + ":/usr/local/cuda/lib64"
    # Exported for the GPU tests, which read it too (tests/gpu_common, test_gpu.py).
    ev = setting("KVO_EXPECT_GPU") or "1"
    os.environ["KVO_EXPECT_GPU"] = ev
    only = ns.only.replace(",", " ").split()
    want = only.__contains__
    s = Suite(out, ns.step_timeout)

    # The CLI and test binaries are needed by every part but python and vllm
    # (which need only the wheel ci/build-gpu-bin copies beside them).
    if any(want(p) for p in ("tests", "memcheck", "conform", "incident", "bench", "run")) and \
            not os.access(kvo, os.X_OK):
        print(f"ci/gpu: {kvo} missing: run ci/build-gpu-bin first")
        return 2
    with open(os.path.join(out, "device.txt"), "w") as f:
        subprocess.run("nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true",
                       shell=True, stdout=f, stderr=subprocess.STDOUT)
    with open(os.path.join(out, "device.txt")) as f:
        print(f"device: {f.read().rstrip(chr(10))}", flush=True)

    # 1. GPU test binaries (ci/build-gpu-bin copies tests/gpu_*.rs, tests/*_gpu.rs
    #    and tests/offloader.rs).
    if want("tests"):
        for t in sorted(glob.glob(os.path.join(bin_, "tests", "*"))):
            if os.access(t, os.X_OK) and os.path.isfile(t):
                b = os.path.basename(t)
                s.step(f"test {b}", f"test-{b}.log", [t, "--test-threads=1"])
    # 2. The tests that launch the crate's kernels once more under compute-sanitizer memcheck.
    for t in ("transfer_gpu", "gpu_pattern"):
        exe = os.path.join(bin_, "tests", t)
        if want("memcheck") and shutil.which("compute-sanitizer") and os.access(exe, os.X_OK):
            s.step(f"memcheck {t}", f"memcheck-{t}.log",
                   ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", exe, "--test-threads=1"])
    # 3. Conformance of the real driver against docs/driver-rules.md (the
    #    poisoning scenario runs last in its process).
    if want("conform"):
        s.step("conform cuda", "conform-cuda.log",
               [kvo, "conform", "--backend", "cuda", "--markdown", os.path.join(out, "conformance-cuda.md")])
    # 4. The seed incident: upstream's design against the capture window.
    if want("incident"):
        s.step("incident", "incident.log", [kvo, "incident", "--backend", "cuda", "--size", ns.incident_size])
    # 5. Benchmarks, each against its baseline in the same run.
    for b in (ns.benches.replace(",", " ").split() if want("bench") else []):
        bench(s, ns, kvo, out, b)
    # 6. The main job on the real GPU, its region in /dev/shm.
    run_args = ns.run_args.split()
    if want("run"):
        s.step("run", "run.log", [kvo, "run", "--backend", "cuda", *run_args])
    # 7. The same with the region on a tmpfs mounted with huge=always (2 MiB
    #    pages), mounted in a private mount namespace that ends with the step, so
    #    the machine's mounts stay as they are. Needs root (or user namespaces).
    if not want("run"):
        pass
    elif can_unshare():
        huge_dir = tempfile.mkdtemp(prefix="kvoffload-huge.", dir="/tmp")
        s.step("run (huge-page tmpfs)", "run-huge-tmpfs.log", [
            "unshare", "-m", "sh", "-c",
            f"mount -t tmpfs -o huge=always,size={ns.huge_tmpfs_size} kvoffload-huge '{huge_dir}' && "
            f"exec '{kvo}' run --backend cuda --region-dir '{huge_dir}' {' '.join(run_args)}"])
        rmdir(huge_dir)
    else:
        s.summary.append("SKIP  run (huge-page tmpfs): cannot make a private mount namespace here "
                         "(needs root or user namespaces)")
    # 8. The Python package with PyTorch: its GPU tests, and the seed incident
    #    re-run with torch.cuda.graph (examples/seed_pytorch.py; --seed-args,
    #    e.g. "--ranks 2" on a machine with two GPUs).
    if want("python"):
        python_part(s, bin_, out, ns.seed_args.split())
    # 9. vLLM: its tests and real engines, where vLLM is importable.
    if want("vllm"):
        vllm_part(s, ns, bin_, out)
    # 9b. The serving benchmark (issue 42): the 8B-shaped model served by vLLM
    #     with no offloading, vLLM's own tier and kvoffload's (ci/gpu-serving;
    #     --serving-args, default one repetition at 64 GiB). Not in the
    #     default parts: it takes minutes an engine (--only serving).
    if want("serving"):
        s.step("serving benchmark", "serving-console.log",
               ["env", f"OUT={out}", "ci/gpu-serving", *ns.serving_args.split()])
    # 10. Self-check: where a GPU is expected, no GPU test of this run skipped
    #    (gpu-skips: the Rust GPU binaries and python/tests/test_gpu.py; the
    #    other Python tests run on the simulated GPU, and test_vllm.py skips
    #    itself where vLLM is not installed: the vllm part above says whether
    #    it ran).
    if ev != "0":
        skipped = skips(s.logs)
        if skipped:
            s.summary.append(f"FAIL  self-check: KVO_EXPECT_GPU={ev} but {len(skipped)} test(s) skipped: "
                             + ", ".join(skipped))
            s.fail = True
        else:
            s.summary.append(f"PASS  self-check: KVO_EXPECT_GPU={ev} and no test skipped")
    else:
        s.summary.append(f"SKIP  self-check: KVO_EXPECT_GPU={ev} (GPU tests may skip)")
    print()
    print("== ci/gpu summary ==")
    for line in s.summary:
        print(line)
    print("some GPU steps FAILED" if s.fail else "all GPU steps passed", flush=True)
    return 1 if s.fail else 0


def rmdir(d: str) -> None:
    try:
        os.rmdir(d)
    except OSError:
        pass


def bench(s: Suite, ns: argparse.Namespace, kvo: str, out: str, b: str) -> None:
    pin = [kvo, "bench", "pin", "--backend", "cuda"]
    if b == "pin":
        s.step("bench pin", "bench-pin.log", [*pin, "--size", ns.pin_size, "--repeat", "3"])
    elif b == "pin-shared":
        # The shared /dev/shm region from 1 and 2 ranks: today's one-file path,
        # data files reserved in create/join (new) and reserved by the pre-fault
        # workers as they go (overlap), end to end, three repeats, in one run.
        s.step("bench pin --shared", "bench-pin-shared.log",
               [kvo, "bench", "pin", "--shared", "--backend", "cuda", "--size", ns.pin_shared_sizes,
                "--ranks", ns.pin_shared_ranks, "--chunk", "64MiB", "--variants", "old,new,overlap",
                "--repeat", str(ns.pin_shared_repeat), "--svg", out])
    elif b == "transfer":
        # Scattered host pages and host blocks of 32 pages (the staged backend
        # both ways at once, issue #15), every backend, in one run.
        s.step("bench transfer", "bench-transfer.log",
               [kvo, "bench", "transfer", "--backend", "cuda", "--layers", "1,32"])
    elif b == "pin-sizes":
        # Pinning at several sizes (issue 22 item 1): per size its first touch
        # apart, then 3 rounds of the one call, the defaults, the stages apart
        # (their bound) and the defaults with 4 KiB pages; medians, spread,
        # vmstat (THP faults, fallbacks, compaction stalls), the picture and a
        # per-chunk timeline per size in OUT. Not in the default list (96 GiB
        # alone takes about 10 minutes on the H200). --pin-candidates:
        # ';'-separated --candidate specs run in every round beside the
        # defaults (default: the defaults before issue 22, 16 threads at the
        # process's niceness and the next chunk only, so the change is measured
        # in the same run; and every core pre-faulting at niceness 10).
        cands = [x for c in ns.pin_candidates.split(";") if c for x in ("--candidate", c)]
        s.step("bench pin --sizes", "bench-pin-sizes.log", [*pin, "--sizes", ns.pin_sizes, "--svg", out, *cands])
    elif b == "pin-pressure":
        pressure(s, ns, pin)
    elif b == "pin-hugetlb":
        hugetlb(s, ns, kvo)
    else:
        s.step(f"bench {b}", f"bench-{b}.log", [kvo, "bench", b])


def meminfo(keys: str) -> str:
    with open("/proc/meminfo") as f:
        return "".join(l for l in f if re.match(rf"^({keys})", l))


def pressure(s: Suite, ns: argparse.Namespace, pin: List[str]) -> None:
    """--pressure-size (96GiB) in the states where huge pages come slowly
    (issue 22 item 1: the collapse near the memory limit), one run per
    configuration and state (a run changes the state): huge pages without
    the 4 KiB fallback, the defaults (fallback on), 4 KiB pages. States
    (--pressure-states): after-one-call, right after one registration of
    untouched memory freed its 4 KiB pages (an engine restarting after
    another one); page-cache, beside a page cache that leaves no room (an
    engine's weights cached): a file of --pressure-cache (40GiB) under
    --pressure-dir (/var/tmp), read back before each run."""
    pf = os.path.join(ns.pressure_dir, "kvoffload-pressure.bin")
    for state in ns.pressure_states.replace(",", " ").split():
        pre: List[str] = []
        if state == "after-one-call":
            pre = ["--after-one-call"]
        elif state == "page-cache":
            pcache = ns.pressure_cache
            pcache = pcache[:-1] if pcache.endswith("B") else pcache
            pcache = pcache[:-1] if pcache.endswith("i") else pcache
            s.step(f"page cache {pcache}", "pressure-cache.log", [
                "sh", "-c", f"df -h {os.path.dirname(pf)} && dd if=/dev/zero of='{pf}' bs=64M "
                f"count={iec(pcache) // 67108864} status=none && grep -E '^(MemFree|Cached|MemAvailable)' /proc/meminfo"])
        else:
            print(f"ci/gpu: unknown --pressure-states entry {state}")
            s.fail = True
            continue
        for spec in ("fallback=0", "", "huge=off"):
            tag = f"{state}-{(spec or 'defaults').replace('=', '-')}"
            if state == "page-cache":
                subprocess.run(["cat", pf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(os.path.join(s.out, f"pressure-meminfo-{tag}.txt"), "w") as f:
                f.write(meminfo("MemFree|Cached"))
            s.step(f"bench pin {ns.pressure_size} [{tag}]", f"bench-pin-pressure-{tag}.log",
                   [*pin, "--sizes", ns.pressure_size, "--once", *pre, *(["--candidate", spec] if spec else [])])
    try:
        os.remove(pf)
    except OSError:
        pass


def hugetlb(s: Suite, ns: argparse.Namespace, kvo: str) -> None:
    """The shared region on hugetlbfs (2 MiB pages, issue 22 item 4), mounted
    in a private mount namespace like the huge-page tmpfs of step 7; only
    where the pool has the pages free (the pool is never changed here)."""
    hsize = ns.pin_hugetlb_size
    pool = "/sys/kernel/mm/hugepages/hugepages-2048kB"

    def read(name: str, default: str = "0") -> str:
        try:
            with open(os.path.join(pool, name)) as f:
                return f.read().strip()
        except OSError:
            return default

    hnum = hsize[:-1] if hsize.endswith("B") else hsize
    hnum = hnum[:-1] if hnum.endswith("i") else hnum
    need = iec(hnum) // 2097152 + 1
    free = int(read("free_hugepages")) - int(read("resv_hugepages"))
    if not can_unshare():
        s.summary.append("SKIP  bench pin --shared (hugetlbfs): cannot make a private mount namespace here")
    elif free < need:
        s.summary.append(f"SKIP  bench pin --shared (hugetlbfs): the 2 MiB pool has {free} pages free, {hsize} needs "
                         f"{need} (nr_hugepages {read('nr_hugepages', '?')}; not changed here)")
    else:
        hdir = tempfile.mkdtemp(prefix="kvoffload-hugetlb.", dir="/tmp")
        s.step("bench pin --shared (hugetlbfs)", "bench-pin-hugetlb.log", [
            "unshare", "-m", "sh", "-c",
            f"mount -t hugetlbfs -o pagesize=2M kvoffload-hugetlb '{hdir}' && "
            f"exec '{kvo}' bench pin --shared --backend cuda --dir '{hdir}' --size '{hsize}' --ranks 1 "
            "--chunk 64MiB --variants new,overlap --repeat 3"])
        rmdir(hdir)


def pip_target(whl_and_more: List[str], log: str, extra: Optional[List[str]] = None,
               prefix: str = "kvoffload-py.") -> Optional[str]:
    """pip-installs wheels (no dependencies) into a new temporary folder; the
    folder, or None when pip failed (its output in `log`)."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    with open(log, "w") as f:
        rc = subprocess.run(["python3", "-m", "pip", "install", "--quiet", "--no-deps", *(extra or []),
                             "--target", d, *whl_and_more], stdout=f, stderr=subprocess.STDOUT).returncode
    return d if rc == 0 else None


def python_part(s: Suite, bin_: str, out: str, seed_args: List[str]) -> None:
    whl = first_wheel(bin_)
    if not whl:
        s.summary.append(f"SKIP  python: no wheel in {bin_} (ci/python, then ci/build-gpu-bin)")
    elif subprocess.run(["python3", "-c", "import torch"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL).returncode != 0:
        s.summary.append("SKIP  python: no PyTorch on this machine")
    else:
        pyd = tempfile.mkdtemp(prefix="kvoffload-py.", dir="/tmp")
        with open(os.path.join(out, "pip.log"), "w") as f:
            subprocess.run(["python3", "-m", "pip", "install", "--quiet", "--no-deps", "--target", pyd, whl],
                           stdout=f, stderr=subprocess.STDOUT)
        s.step("pytest (GPU)", "pytest-gpu.log",
               ["env", f"PYTHONPATH={pyd}", "python3", "-m", "pytest", "-q", "-rs", "python/tests"])
        s.step("seed_pytorch", "seed-pytorch.log",
               ["env", f"PYTHONPATH={pyd}", "python3", "examples/seed_pytorch.py", "--json",
                os.path.join(out, "seed-pytorch.json"), *seed_args])


def vllm_part(s: Suite, ns: argparse.Namespace, bin_: str, out: str) -> None:
    vsite = setting("KVO_VLLM_SITE", "")
    bundle = setting("KVO_VLLM_BUNDLE", "")
    if not vsite and bundle:
        vsite = "/tmp/site"
        if not os.path.isdir(os.path.join(vsite, "vllm")):
            s.step("unpack vLLM bundle", "vllm-unpack.log", ["python3", "-c",
                   'import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="fully_trusted")',
                   bundle, "/tmp"])
    vmodel = ns.vllm_model or os.path.join(os.path.dirname(bundle or "/nonexistent/x"), "model")
    whl = first_wheel(bin_)
    pp = os.environ.get("PYTHONPATH", "")
    if not whl:
        s.summary.append(f"SKIP  vllm: no wheel in {bin_} (ci/python, then ci/build-gpu-bin)")
        return
    with open(os.path.join(out, "vllm-import.log"), "w") as f:
        p = subprocess.run(["python3", "-c", "import vllm; print(vllm.__version__)"], stdout=subprocess.PIPE,
                           stderr=f, text=True,
                           env=dict(os.environ, PYTHONPATH=":".join(x for x in (vsite, pp) if x)))
    if p.returncode != 0:
        with open(os.path.join(out, "vllm-import.log")) as f:
            last = (f.read().splitlines() or [""])[-1]
        s.summary.append(f"SKIP  vllm: vLLM is not importable here (set KVO_VLLM_SITE or KVO_VLLM_BUNDLE; {last})")
        return
    vver = p.stdout.strip()
    vpyd = tempfile.mkdtemp(prefix="kvoffload-vllm-py.", dir="/tmp")
    with open(os.path.join(out, "pip-vllm.log"), "w") as f:
        subprocess.run(["python3", "-m", "pip", "install", "--quiet", "--no-deps", "--target", vpyd, whl],
                       stdout=f, stderr=subprocess.STDOUT)
    vpath = ":".join(x for x in (vpyd, vsite, pp) if x)
    if ns.vllm_pytest:
        s.step(f"pytest vLLM {vver} (sim)", "pytest-vllm.log",
               ["env", f"PYTHONPATH={vpath}", f"KVO_EXPECT_VLLM={vver}", "python3", "-m", "pytest", "-q", "-rs",
                "python/tests/test_vllm.py"])
    else:
        s.summary.append(f"SKIP  pytest vLLM {vver} (sim): --no-vllm-pytest")
    if os.path.isdir(vmodel):
        s.step(f"vLLM {vver} engines", "vllm-engine.log",
               ["env", f"PYTHONPATH={vpath}", "PYTHONUNBUFFERED=1", "python3", "python/bench/vllm_engine.py",
                "--model", vmodel, "--json", os.path.join(out, "vllm-engine.json"), *ns.vllm_engine_args.split()])
    else:
        s.summary.append(f"SKIP  vLLM engines: no model config at {vmodel} (--vllm-model)")


def configure_gpu(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n", 1)[1]
    a = p.add_argument
    a("--only", default=PARTS, help=f"the parts to run, space- or comma-separated (default: {PARTS}; "
      "serving only when named)")
    a("--step-timeout", type=int, default=900, help="seconds a step may run (default 900)")
    a("--run-args", default=RUN_ARGS, help="`kvoffload run`'s options (default: %(default)s)")
    a("--incident-size", default="16GiB", help="default %(default)s")
    a("--benches", default=BENCHES, help="the benchmarks (default: %(default)s; also pin-sizes, pin-pressure, "
      "pin-hugetlb, or any `kvoffload bench` name)")
    a("--pin-size", default="16GiB", help="bench pin's size (default %(default)s)")
    a("--pin-shared-sizes", default="16GiB,64GiB", help="default %(default)s")
    a("--pin-shared-ranks", default="1,2", help="default %(default)s")
    a("--pin-shared-repeat", type=int, default=3, help="default %(default)s")
    a("--pin-sizes", default="16GiB,64GiB,96GiB", help="pin-sizes' sizes (default %(default)s)")
    a("--pin-candidates", default=PIN_CANDIDATES, help="pin-sizes' ';'-separated candidates (default "
      "%(default)s; empty: none)")
    a("--pin-hugetlb-size", default="16GiB", help="default %(default)s")
    a("--pressure-size", default="96GiB", help="default %(default)s")
    a("--pressure-states", default="after-one-call page-cache", help="default %(default)s")
    a("--pressure-cache", default="40GiB", help="default %(default)s")
    a("--pressure-dir", default="/var/tmp", help="default %(default)s")
    a("--huge-tmpfs-size", default="24g", help="the huge-page tmpfs of step 7 (default %(default)s)")
    a("--seed-args", default="", help="examples/seed_pytorch.py's options, e.g. '--ranks 2'")
    a("--vllm-model", default="", help="the model config of the vLLM engines (default: model/ beside "
      "KVO_VLLM_BUNDLE)")
    a("--vllm-engine-args", default=VLLM_ENGINE_ARGS, help="python/bench/vllm_engine.py's options "
      "(default: %(default)s)")
    a("--no-vllm-pytest", dest="vllm_pytest", action="store_false", help="leave test_vllm.py out of the vllm part")
    a("--serving-args", default=SERVING_ARGS, help="ci/gpu-serving's options (default: %(default)s)")


SKIP_RUST = re.compile(r"SKIPPED [^ :]*")
SKIP_PYTEST = re.compile(r"SKIPPED \[[0-9]*\] [^ :]*test_gpu\.py")


def skips(logs: List[str]) -> List[str]:
    """The GPU tests that skipped, from ci/gpu's logs: "LOG: TEST" each (LOG
    without .log), sorted, none twice. Only GPU tests count:
      test-*.log, memcheck-*.log  the Rust GPU test binaries ("SKIPPED <test>: <why>")
      pytest-gpu.log              python/tests/test_gpu.py only (pytest -rs:
                                  "SKIPPED [n] <file>:<line>: <why>"); the other
                                  Python tests run on the simulated GPU, and
                                  test_vllm.py skips itself where vLLM is not
                                  installed, which ci/gpu's vllm part reports
    Other logs are ignored."""
    found = set()
    for log in logs:
        base = os.path.basename(log)
        name = base[:-4] if base.endswith(".log") else base
        if re.fullmatch(r"(test|memcheck)-.*\.log", base):
            pattern, cut = SKIP_RUST, re.compile(r"^SKIPPED ")
        elif base == "pytest-gpu.log":
            pattern, cut = SKIP_PYTEST, re.compile(r"^SKIPPED \[[0-9]*\] ")
        else:
            continue
        try:
            with open(log, "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError as e:
            print(f"ci/gpu-skips: {e}", file=sys.stderr)
            continue
        found.update(f"{name}: {cut.sub('', m)}" for m in pattern.findall(text))
    return sorted(found)


def gpu_skips(ns: argparse.Namespace) -> int:
    for line in skips(ns.logs):
        print(line)
    return 0


def gpu_pin_probe(ns: argparse.Namespace) -> int:
    """Explores pinning candidates on the GPU machine (issue 22 item 1): the
    machine's memory facts, then `bench pin --sizes --probe` (one round per
    size, no one-call baseline) with candidate configurations beside the
    defaults, the stage split and 4 KiB pages. Figures of a probe decide what
    the committed `bench pin --sizes` run (ci/gpu --benches pin-sizes)
    measures; they are not that run."""
    exe, out = ns.bin, ns.out
    os.makedirs(out, exist_ok=True)
    memory = os.path.join(out, "memory.txt")

    def facts(title: str) -> None:
        with open(memory, "a") as f:
            f.write(f"== {title} ({time.strftime('%H:%M:%S', time.gmtime())})\n")
            f.write(meminfo("MemTotal|MemFree|MemAvailable|Cached|AnonPages|AnonHugePages|Unevictable|Mlocked|"
                            "HugePages_Total|HugePages_Free"))
            with open("/proc/vmstat") as v:
                f.write("".join(l for l in v if re.match(
                    r"^(thp_fault_alloc|thp_fault_fallback|compact_stall|compact_fail|compact_success|pgmajfault)", l)))

    machine = r"""
echo "nproc $(nproc)"; uname -r
for f in enabled defrag khugepaged/defrag shmem_enabled; do
  echo "thp $f: $(cat /sys/kernel/mm/transparent_hugepage/$f 2>/dev/null)"
done
echo "page_reporting_order: $(cat /sys/module/page_reporting/parameters/page_reporting_order 2>/dev/null || echo none)"
echo "virtio drivers: $(ls /sys/bus/virtio/drivers 2>/dev/null | tr '\n' ' ')"
echo "balloon devices: $(ls /sys/bus/virtio/drivers/virtio_balloon 2>/dev/null | tr '\n' ' ')"
cat /proc/sys/vm/compaction_proactiveness /proc/sys/vm/extfrag_threshold /proc/sys/vm/watermark_scale_factor /proc/sys/vm/min_free_kbytes 2>/dev/null | paste -sd' ' | sed 's/^/proactiveness extfrag watermark_scale min_free_kbytes: /'
lscpu | grep -E 'Model name|Socket|NUMA node|Thread'
cat /proc/buddyinfo
"""
    with open(os.path.join(out, "machine.txt"), "w") as f:
        subprocess.run(["bash", "-c", machine], stdout=f, stderr=subprocess.STDOUT)

    def probe(name: str, sizes: str, candidates: str) -> None:
        args = [x for c in candidates.split(";") if c for x in ("--candidate", c)]
        facts(f"before {name}")
        with open(os.path.join(out, f"{name}.txt"), "w") as o, open(os.path.join(out, f"{name}.log"), "w") as e:
            rc = subprocess.run(["timeout", str(ns.timeout), exe, "bench", "pin", "--backend", "cuda", "--sizes",
                                 sizes, "--probe", *args], stdout=o, stderr=e).returncode
        print(f"{name}: rc {rc}", flush=True)
        with open(os.path.join(out, "summary.txt"), "a") as f:
            f.write(f"{name}: rc {rc}\n")
        facts(f"after {name}")
        with open(memory, "a") as f, open("/proc/buddyinfo") as b:
            f.write(b.read())

    probe("probe-main", ns.sizes, ns.candidates)
    if ns.big:
        probe("probe-big", ns.big, ns.big_candidates)
    return 0


def configure_pin_probe(p: argparse.ArgumentParser) -> None:
    p.description = gpu_pin_probe.__doc__
    p.add_argument("bin", metavar="BIN", help="the release kvoffload")
    p.add_argument("out", metavar="OUT", help="the folder of its files")
    p.add_argument("--sizes", default="16GiB,64GiB", help="the main probe's sizes (default %(default)s)")
    p.add_argument("--candidates", default=PROBE_CANDIDATES, help="the main probe's ';'-separated candidates")
    p.add_argument("--big", default="96GiB", help="the big probe's size (default %(default)s; empty: skip it)")
    p.add_argument("--big-candidates", default=PROBE_BIG_CANDIDATES, help="the big probe's candidates")
    p.add_argument("--timeout", type=int, default=280, help="seconds a probe may run (default %(default)s)")


def serve(prog: str, script: str, sub: str, log: str, argv: List[str], with_wheels: bool) -> int:
    """ci/gpu-serving and ci/gpu-serve-http: vLLM from KVO_VLLM_SITE or the
    bundle (unpacked to /tmp/site once), the wheel of KVO_BIN pip-installed
    into a temporary folder (with KVO_SERVE_WHEELS for `vllm serve`), this
    console teed into OUT/LOG, then `script` in this process's place (a
    signal reaches it, and it stops its servers' group)."""
    os.chdir(ROOT)
    out = setting("OUT", "gpu-out")
    os.makedirs(os.path.join(out, sub), exist_ok=True)
    sys.stdout.flush()
    tee = subprocess.Popen(["tee", "-a", os.path.join(out, log)], stdin=subprocess.PIPE)
    os.dup2(tee.stdin.fileno(), 1)
    os.dup2(tee.stdin.fileno(), 2)
    tee.stdin.close()

    def say(msg: str) -> None:
        print(f"{prog}: {msg}", flush=True)

    vsite = setting("KVO_VLLM_SITE", "")
    if not vsite:
        bundle = setting("KVO_VLLM_BUNDLE", "")
        if not bundle:
            bundle = BUNDLE if os.path.exists(BUNDLE) else os.path.join("..", BUNDLE)
        if os.path.isdir(bundle):
            bundle = os.path.join(bundle, "site.tar.xz")
        if not os.path.isfile(bundle):
            say(f"no vLLM bundle at {bundle} (KVO_VLLM_BUNDLE, KVO_VLLM_SITE)")
            return 2
        vsite = "/tmp/site"
        if not os.path.isdir(os.path.join(vsite, "vllm")):
            say(f"unpacking {bundle} to /tmp")
            if not unpack(bundle):
                return 2
    bin_ = setting("KVO_BIN", "gpu-bin")
    whl = first_wheel(bin_)
    if not whl:
        say(f"no kvoffload wheel in {bin_} (ci/python, then ci/build-gpu-bin)")
        return 2
    extra: List[str] = []
    if with_wheels:
        wheels = setting("KVO_SERVE_WHEELS") or os.path.join(bin_, "serve-wheels")
        extra = sorted(glob.glob(os.path.join(wheels, "*.whl")))
        if not extra:
            say(f"no wheels in {wheels} (KVO_SERVE_WHEELS): vllm serve may lack modules")
    pip_log = os.path.join(out, sub, "pip.log")
    pyd = pip_target([whl, *extra], pip_log, ["--no-index"] if with_wheels else [],
                     prefix=f"kvoffload-{sub}-py.")
    if pyd is None:
        with open(pip_log) as f:
            tail = " ".join(f.read().splitlines()[-2:])
        say(f"pip install failed: {tail}" if with_wheels else f"pip install of {whl} failed: {tail}")
        return 2
    if with_wheels:
        say(f"vLLM from {vsite}, kvoffload from {whl}, {len(extra)} wheels from {wheels}")
    else:
        say(f"vLLM from {vsite}, kvoffload from {whl}")
    sys.stdout.flush()
    subprocess.run("nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader "
                   "|| true", shell=True)
    if not with_wheels:
        subprocess.run("df -h /dev/shm | tail -n 1", shell=True)
    subprocess.run(["grep", "-E", "^(MemTotal|MemAvailable)", "/proc/meminfo"])
    pp = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=f"{vsite}:{pyd}" + (f":{pp}" if pp else ""), PYTHONUNBUFFERED="1")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe("python3", ["python3", script, "--out-dir", os.path.join(out, sub), *argv], env)
    return 2  # not reached: exec replaces this process


def gpu_serving(argv: List[str]) -> int:
    """ci/gpu-serving [serving.py args...] (after ci/build-gpu-bin): the serving
    benchmark (issue 42): vLLM 0.26 from the shared bundle with no offloading,
    vLLM's CPUOffloadingSpec and kvoffload's spec, a Llama-3-8B-shaped model
    with dummy weights (python/bench/serving.py; its arguments are passed
    through, e.g. --reps 1 --budget-s 540 --regions 64GiB). vLLM:
    KVO_VLLM_SITE, else the bundle KVO_VLLM_BUNDLE (its folder or its
    site.tar.xz; default shared/vllm-0.26-h200 of the repository, else
    ../shared/vllm-0.26-h200) unpacked to /tmp/site once. Output in OUT
    (default gpu-out/): serving/ (serving.md, serving.json, serving.jsonl,
    logs/ of every engine) and serving.log (this console). Exit status:
    serving.py's (2: vLLM, the wheel or the bundle missing)."""
    return serve("ci/gpu-serving", "python/bench/serving.py", "serving", "serving.log", argv, False)


def gpu_serve_http(argv: List[str]) -> int:
    """ci/gpu-serve-http [serve_http.py args...] (after ci/build-gpu-bin): the
    OpenAI server as users run it (issue 42, deliverable 6): `vllm serve` from
    the shared vLLM 0.26 bundle on the Llama-3-8B-shaped config, with no
    offloading, vLLM's CPUOffloadingSpec and kvoffload's spec, and a streaming
    HTTP client (python/bench/serve_http.py; its arguments are passed through,
    e.g. --reps 1 --budget-s 540 --region 64GiB). vLLM: as ci/gpu-serving.
    What `vllm serve` needs beyond the bundle and the GPU image (uvicorn,
    prometheus-fastapi-instrumentator, model-hosting-container-standards,
    jmespath, watchfiles): every wheel in KVO_SERVE_WHEELS (default
    $KVO_BIN/serve-wheels), pip-installed with kvoffload's into a temporary
    folder; serve_http.py names what is still missing. Output in OUT (default
    gpu-out/): serve-http/ (serve-http.md, .json, .jsonl, logs/ of every
    server) and serve-http.log (this console). Exit status: serve_http.py's
    (2: vLLM, the wheel, the bundle or a module of `vllm serve` missing)."""
    return serve("ci/gpu-serve-http", "python/bench/serve_http.py", "serve-http", "serve-http.log", argv, True)


def gpu_pool(argv: List[str]) -> int:
    """ci/gpu-pool [pool_run.py args...] (after ci/build-gpu-bin): the node
    pool on the GPU (issue 46): two vLLM 0.26 engines of the 8B shape on one
    kvoffload pool at once, then one restarted on the pool they left
    (python/bench/pool_run.py; its arguments are passed through, e.g.
    --region 64GiB --budget-s 540). vLLM: as ci/gpu-serving; `kvoffload pool
    ls|rm` from KVO_BIN. Output in OUT (default gpu-out/): pool/ (pool.md,
    pool.json, each engine's log) and pool.log (this console). Exit status:
    pool_run.py's (2: vLLM, the wheel or the bundle missing)."""
    cli = os.path.abspath(os.path.join(ROOT, setting("KVO_BIN", "gpu-bin"), "kvoffload"))
    return serve("ci/gpu-pool", "python/bench/pool_run.py", "pool", "pool.log", ["--kvoffload-bin", cli, *argv], False)


def configure_skips(p: argparse.ArgumentParser) -> None:
    p.description = skips.__doc__
    p.add_argument("logs", nargs="*", metavar="LOG")


COMMANDS = [
    Command("gpu", "ci/gpu: the GPU suite (tests, memcheck, conformance, benchmarks, Python, vLLM)", gpu,
            configure_gpu),
    Command("gpu-skips", "ci/gpu-skips LOG...: the GPU tests that skipped, from ci/gpu's logs", gpu_skips,
            configure_skips),
    Command("gpu-pin-probe", "ci/gpu-pin-probe BIN OUT: pinning candidates explored", gpu_pin_probe,
            configure_pin_probe),
    Command("gpu-serving", gpu_serving.__doc__.split(":")[0] + ": the serving benchmark (args to serving.py)",
            gpu_serving),
    Command("gpu-pool", gpu_pool.__doc__.split(":")[0] + ": two engines and a restart on one node pool (args "
            "to pool_run.py)", gpu_pool),
    Command("gpu-serve-http", gpu_serve_http.__doc__.split(":")[0] + ": `vllm serve` over HTTP (args to "
            "serve_http.py)", gpu_serve_http),
]
