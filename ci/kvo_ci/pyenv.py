"""The Python package's tests (ci/python) and the cached vLLM environments
they run in (ci/vllm-env).

ci/python: the Python package on a machine with only the Rust toolchain and python3:
  1. a virtual environment under target/python-venv (PYTHON -m venv),
     with maturin, pytest and hypothesis (python/tests/test_fuzz.py)
     and numpy (vLLM 0.34's DevicePointers) installed by pip when missing,
  2. the wheel built by maturin in release (abi3: one wheel for CPython
     3.9+) into target/wheels/, and installed into the environment,
  3. pytest on python/tests (the simulated GPU; GPU tests skip themselves
     without CUDA and PyTorch; test_vllm.py skips itself without vLLM);
     test_threads.py's stress test runs KVO_STRESS_SECONDS (default 3 s;
     issue 28's acceptance run is KVO_STRESS_SECONDS=20),
  4. python/tests/test_vllm.py and test_vllm_pool.py (the node pool)
     against the real vLLM releases of
     KVO_VLLM_VERSIONS (default "0.33.0 0.34.0 0.26.0"), each in
     ci/vllm-env's cached environment (0.33.0 a venv: created the first
     time, 3-6 minutes and 9.4 GB, reused after; 0.34.0 and 0.26.0
     overlays on it, about 10 s each the first time), the wheel installed
     there with --no-deps, on the simulated GPU. KVO_SKIP_VLLM=1 skips
     this step (saying so); if ci/vllm-env fails (no network, no disk),
     the step fails with its message.
A few minutes on 2 cores.
  ci/python --setup   steps 1 and 4's installs only (the venv's packages, and
                      ci/vllm-env's environments for KVO_VLLM_VERSIONS), with
                      their progress; nothing is built or tested. ci/test runs
                      it before ci/python, outside ci/python's deadline: on a
                      new machine the installs take minutes (vLLM 0.33's venv
                      434 s on 2 busy cores) and are not a hang; the deadline
                      bounds the build and the tests only.

ci/vllm-env: cached environments with vLLM from PyPI for the CPU tests of
kvoffload.vllm (issues 21, 31): created once, reused after.
  ci/vllm-env [--version V]           create the environment of vLLM V if
                                      needed; print its python
  ci/vllm-env [--version V] --check   the same, then import vLLM's
                                      offloading spec and connector classes
                                      and print the versions
V is 0.33.0 (the default), 0.34.0 or 0.26.0. 0.33.0 is a virtual
environment with vllm==0.33.0 and its dependencies (torch 2.14). The others
are overlays on it: that release's wheel alone (pip --no-deps --target,
about 10 s and 0.3 GB of download), put first on PYTHONPATH by a `python`
wrapper in the overlay, which is what is printed. An overlay is how these
releases install at all here: vllm 0.34.0 pins flashinfer-python==0.7.3,
which the package index does not serve (flashinfer is used on GPUs only),
and 0.26.0 pins torch 2.11; 0.34's other pins are met by 0.33's venv, and
the offloading classes of both import on the CPU with torch 2.14 (no
compiled vLLM kernel is loaded on the CPU).
Where: KVO_VLLM_VENV (default ~/.cache/kvoffload/vllm-0.33.0-venv; outside
target/, so `cargo clean` keeps it), overlays beside it (vllm-V-overlay). A
stamp file in each records a completed install; one without it (an
interrupted install) is removed and installed again, never trusted.
Cost the first time: 3 to 6 minutes and 9.4 GB (vLLM 0.33.0 with torch
2.14.0+cu130 and its CUDA libraries; measured 187 s on a 2-core machine
with a fast link), plus pip's download cache where pip keeps one. Later
runs take a second (--check: about 8 s, the imports). An install that
fails is removed at once; one that was killed has no stamp and is removed
and redone by the next run. No GPU is needed: vLLM's offloading classes
import on the CPU. --need-gb (free space required before an install,
default 14), --progress-s (seconds between progress lines during an
install, default 30). Progress goes to stderr; the last line on stdout is
the environment's python.
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, List, Optional

from kvo_ci import ROOT, setting
from kvo_ci.command import Command

BASE_VERSION = "0.33.0"
OVERLAYS = ("0.34.0", "0.26.0")
DEFAULT_VERSIONS = "0.33.0 0.34.0 0.26.0"
STAMP_NAME = ".kvoffload-install-complete"
QUIET_PIP = ["--quiet", "--disable-pip-version-check"]
# Waits for another install's lock: the base venv takes minutes, an overlay seconds.
VENV_LOCK_S, OVERLAY_LOCK_S = 1800, 600

CHECK_IMPORTS = '''
import importlib, platform, sys
want = sys.argv[1]
import vllm
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker, TransferResult)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
conn = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector")
OffloadingConnector = conn.OffloadingConnector
importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker")
if vllm.__version__ != want:
    sys.exit(f"vllm {vllm.__version__} installed, {want} expected")
print(f"python {platform.python_version()}  vllm {vllm.__version__}  torch {torch.__version__} "
      f"(CUDA build {torch.version.cuda}, GPU visible: {torch.cuda.is_available()})")
print(f"vllm from {vllm.__file__}; OffloadingConnector {OffloadingConnector.__module__}")
'''


class VllmEnvError(Exception):
    """An environment could not be made or does not import; the message says why."""


def say(msg: str) -> None:
    sys.stderr.write(f"ci/vllm-env: {msg}\n")
    sys.stderr.flush()


def du(path: str) -> str:
    p = subprocess.run(["du", "-sh", path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return p.stdout.split("\t")[0] if p.stdout else "?"


def free_gb(path: str) -> int:
    """Free GiB on the filesystem holding `path` (or its nearest existing parent)."""
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // (1 << 30)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def py_version(py: str) -> str:
    p = subprocess.run([py, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.stdout.strip()


def lock(path: str, seconds: int) -> IO:
    """Holds an exclusive lock on `path` (one install at a time: two CI steps
    starting at once wait for each other), waiting at most `seconds`."""
    f = open(path, "w")
    end = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() > end:
                raise VllmEnvError(f"another ci/vllm-env holds {path} for over {seconds // 60} minutes")
            time.sleep(1)


class Heartbeat:
    """While pip runs: every `every` seconds, one line on stderr with the time
    so far, the size of what is installed so far and pip's last step
    ("Collecting torch", "Downloading ... (900 MB)", "Installing collected
    packages"), so that a long first install reads as progress, not a hang."""
    STEP = re.compile(r"^ *(Collecting|Downloading|Installing|Building|Using cached)")

    def __init__(self, what: str, log: str, folder: str, every: float) -> None:
        self.what, self.log, self.folder, self.every = what, log, folder, every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.beat, daemon=True)

    def __enter__(self) -> "Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        self.thread.join()

    def beat(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(self.every):
            try:
                with open(self.log, errors="replace") as f:
                    steps = [l for l in f if self.STEP.match(l)]
            except OSError:
                steps = []
            last = steps[-1].rstrip("\n")[:120].lstrip() if steps else "starting"
            say(f"still installing {self.what}: {int(time.monotonic() - t0)} s, {du(self.folder)} in "
                f"{self.folder}; pip: {last}")


class VllmEnv:
    """The environment of one vLLM release (the base venv or an overlay on it)."""

    def __init__(self, version: str, need_gb: int = 14, progress_s: float = 30) -> None:
        if version != BASE_VERSION and version not in OVERLAYS:
            raise VllmEnvError(f"no environment for vllm {version} (known: {BASE_VERSION} {' '.join(OVERLAYS)})")
        self.version, self.need_gb, self.progress_s = version, need_gb, progress_s
        self.py = setting("PYTHON", "python3")
        self.venv = setting("KVO_VLLM_VENV") or os.path.join(
            os.path.expanduser("~"), ".cache", "kvoffload", f"vllm-{BASE_VERSION}-venv")
        self.vpy = os.path.join(self.venv, "bin", "python")
        self.stamp = os.path.join(self.venv, STAMP_NAME)
        self.overlay = os.path.join(os.path.dirname(self.venv), f"vllm-{version}-overlay")

    def check_imports(self, python: str, version: str, out: Optional[IO] = None) -> bool:
        """The imports the tests rely on; prints the versions (to `out`)."""
        return subprocess.run([python, "-", version], input=CHECK_IMPORTS, text=True,
                              stdout=out or sys.stdout).returncode == 0

    def pip_logged(self, args: List[str], what: str, folder: str, echo: Optional[re.Pattern] = None):
        """Runs pip with its output in a log (lines matching `echo` also on
        stderr, cut at 200 characters) and a heartbeat; (exit status, log text)."""
        fd, log = tempfile.mkstemp()
        try:
            with os.fdopen(fd, "w") as f, Heartbeat(what, log, folder, self.progress_s):
                p = subprocess.Popen([self.vpy, "-m", "pip", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace")
                for line in p.stdout:
                    f.write(line)
                    f.flush()
                    if echo is not None and echo.match(line):
                        sys.stderr.write(line.rstrip("\n")[:200] + "\n")
                rc = p.wait()
            with open(log, errors="replace") as f:
                return rc, f.read()
        finally:
            os.unlink(log)

    def ensure(self, check: bool = False) -> str:
        """The environment's python, after installing what is missing."""
        parent = os.path.dirname(self.venv)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError:
            raise VllmEnvError(f"cannot create {parent}")
        with lock(self.venv + ".lock", VENV_LOCK_S):
            if os.path.isfile(self.stamp) and os.access(self.vpy, os.X_OK):
                with open(self.stamp) as f:
                    say(f"reusing {self.venv} ({f.readline().strip()})")
            else:
                self.install()
            # pytest runs the tests; environments stamped before it was part of
            # the install get it here (a small download).
            if subprocess.run([self.vpy, "-c", "import pytest"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode != 0:
                say(f"installing pytest into {self.venv}")
                if subprocess.run([self.vpy, "-m", "pip", "install", *QUIET_PIP, "pytest"],
                                  stdout=sys.stderr).returncode != 0:
                    raise VllmEnvError(f"installing pytest into {self.venv} failed (no network?); "
                                       "the environment itself is fine")
            if self.version == BASE_VERSION:
                if check and not self.check_imports(self.vpy, self.version):
                    raise VllmEnvError(f"the environment at {self.venv} does not import vLLM's offloading classes "
                                       "(remove it to install again)")
                return self.vpy
            with lock(self.overlay + ".lock", OVERLAY_LOCK_S):
                wrapper = os.path.join(self.overlay, "python")
                stamp = os.path.join(self.overlay, STAMP_NAME)
                if os.path.isfile(stamp) and os.access(wrapper, os.X_OK):
                    with open(stamp) as f:
                        say(f"reusing {self.overlay} ({f.readline().strip()})")
                else:
                    self.install_overlay()
                if check and not self.check_imports(wrapper, self.version):
                    raise VllmEnvError(f"the overlay at {self.overlay} does not import vLLM's offloading classes "
                                       "(remove it to install again)")
                return wrapper

    def install_overlay(self) -> None:
        """vllm==version on the base venv: the wheel alone, first on
        PYTHONPATH through the wrapper overlay/python."""
        t0, v, ov = time.monotonic(), self.version, self.overlay
        if os.path.exists(ov):
            say(f"{ov} has no completed install (interrupted?): removing it and installing again")
            shutil.rmtree(ov)
        os.makedirs(ov)
        say(f"installing vllm=={v} (the wheel alone, --no-deps) into {ov}/site")
        rc, log = self.pip_logged(["install", "--disable-pip-version-check", "--progress-bar", "off", "--no-deps",
                                   "--no-compile", "--target", f"{ov}/site", f"vllm=={v}"],
                                  f"vllm=={v} (overlay)", ov)
        if rc != 0:
            sys.stderr.write("".join(log.splitlines(True)[-20:]))
            shutil.rmtree(ov)
            raise VllmEnvError(f"pip could not install vllm=={v} (its last lines are above; no network?); "
                               "the overlay was removed")
        wrapper = os.path.join(ov, "python")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\n# vllm {v} first, over {self.venv} (made by ci/vllm-env).\n'
                    f'PYTHONPATH="{ov}/site${{PYTHONPATH:+:$PYTHONPATH}}" exec "{self.vpy}" "$@"\n')
        os.chmod(wrapper, 0o755)
        say("checking the imports")
        if not self.check_imports(wrapper, v, sys.stderr):
            shutil.rmtree(ov)
            raise VllmEnvError(f"vllm {v} installed over {BASE_VERSION}'s venv but its offloading classes do not "
                               "import (see above); the overlay was removed")
        secs = int(time.monotonic() - t0)
        with open(os.path.join(ov, STAMP_NAME), "w") as f:
            f.write(f"vllm=={v}\nover={self.venv}\nseconds={secs}\ndate={now()}\n")
        say(f"installed in {secs} s, {du(ov)} in {ov}")

    def install(self) -> None:
        venv, parent = self.venv, os.path.dirname(self.venv)
        if os.path.exists(venv):
            say(f"{venv} has no completed install (interrupted?): removing it and installing again")
            shutil.rmtree(venv)
        have = free_gb(parent)
        if have < self.need_gb:
            raise VllmEnvError(
                f"not enough disk space: {have} GiB free in {parent}, {self.need_gb} GiB needed (the environment "
                "takes about 9.4 GB, pip's downloads and unpacking the rest); free some space, or point "
                "KVO_VLLM_VENV elsewhere")
        tmp = os.environ.get("TMPDIR", "/tmp")
        have = free_gb(tmp)
        if have < 4:
            raise VllmEnvError(f"not enough disk space in {tmp} (pip unpacks wheels there): {have} GiB free, "
                               "4 GiB needed; set TMPDIR to a larger filesystem")
        if shutil.which(self.py) is None:
            raise VllmEnvError(f"no '{self.py}' (set PYTHON to a python3 of 3.11 or later)")
        if subprocess.run([self.py, "-c", "import sys; sys.exit(sys.version_info < (3, 11))"]).returncode != 0:
            raise VllmEnvError(f"{py_version(self.py)} is too old for vllm {BASE_VERSION} (it needs 3.11 to 3.14; "
                               "set PYTHON)")
        say(f"creating {venv} with {py_version(self.py)}")
        if subprocess.run([self.py, "-m", "venv", venv]).returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise VllmEnvError(f"'{self.py} -m venv' failed (on Debian: apt-get install python3-venv)")
        # Reach the index first, so that no network is one clear message.
        say(f"asking the package index for vllm=={BASE_VERSION}")
        p = subprocess.run([self.vpy, "-m", "pip", "index", "versions", "vllm"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace")
        shown = [l for l in p.stdout.splitlines() if "experimental command" not in l]
        if p.returncode != 0:
            sys.stderr.write("".join(l + "\n" for l in shown[-5:]))
            shutil.rmtree(venv)
            raise VllmEnvError(
                "no network: the package index could not be reached for vllm (pip's message above; index: "
                f"{os.environ.get('PIP_INDEX_URL', 'https://pypi.org/simple')}); run ci/vllm-env where PyPI is "
                f"reachable, or copy a finished environment (with its stamp) to {venv}")
        if not re.search(r"(^|[ ,])" + re.escape(BASE_VERSION) + r"(,|$| )", p.stdout, re.M):
            sys.stderr.write("".join(l[:300] + "\n" for l in shown))
            shutil.rmtree(venv)
            raise VllmEnvError(f"the package index has no vllm {BASE_VERSION} (its versions are above)")
        say(f"installing vllm=={BASE_VERSION} (3 to 6 minutes and 9.4 GB the first time)")
        t0 = time.monotonic()
        rc, log = self.pip_logged(["install", "--disable-pip-version-check", "--progress-bar", "off",
                                   f"vllm=={BASE_VERSION}", "pytest"], f"vllm=={BASE_VERSION}", venv,
                                  re.compile(r"^(Collecting vllm|Successfully installed)"))
        if rc != 0 or not re.search(r"^Successfully installed", log, re.M):
            sys.stderr.write("".join(log.splitlines(True)[-30:]))
            why = "pip failed (its last lines are above)"
            if re.search("No space left on device", log, re.I):
                why = (f"the disk filled up during the install: {free_gb(parent)} GiB free now in {parent}, "
                       f"{self.need_gb} GiB needed")
            elif re.search("Failed to establish a new connection|Temporary failure in name resolution|"
                           "Network is unreachable|Read timed out|ConnectionError|ProxyError|IncompleteRead", log, re.I):
                why = "the network failed during the install (no network?)"
            elif re.search("No matching distribution", log, re.I):
                why = (f"pip found no matching distribution for vllm {BASE_VERSION} or one of its dependencies "
                       f"(no network, or this python, {py_version(self.vpy)}, or platform is not supported)")
            shutil.rmtree(venv)
            raise VllmEnvError(f"{why}; the unfinished environment was removed (run ci/vllm-env again to retry)")
        say("checking the imports")
        if not self.check_imports(self.vpy, BASE_VERSION, sys.stderr):
            shutil.rmtree(venv)
            raise VllmEnvError("vllm installed but its offloading classes do not import (see above); the "
                               "environment was removed")
        secs = int(time.monotonic() - t0)
        with open(self.stamp, "w") as f:
            f.write(f"vllm=={BASE_VERSION}\npython={py_version(self.vpy)}\nseconds={secs}\ndate={now()}\n")
        say(f"installed in {secs} s, {du(venv)} in {venv}")


def vllm_env(ns: argparse.Namespace) -> int:
    try:
        py = VllmEnv(ns.version, ns.need_gb, ns.progress_s).ensure(ns.check)
    except VllmEnvError as e:
        say(str(e))
        return 2 if str(e).startswith("no environment for") else 1
    print(py, flush=True)
    return 0


def configure_vllm_env(p: argparse.ArgumentParser) -> None:
    p.description = "ci/vllm-env" + __doc__.split("\nci/vllm-env", 1)[1]
    p.add_argument("--version", default=BASE_VERSION, help=f"{BASE_VERSION} (default), {' or '.join(OVERLAYS)}")
    p.add_argument("--check", action="store_true", help="import vLLM's offloading classes, print the versions")
    p.add_argument("--need-gb", type=int, default=14, help="free GiB required before an install (default 14)")
    p.add_argument("--progress-s", type=float, default=30, help="seconds between progress lines (default 30)")


def pip_quiet(vpy: str, *args: str) -> None:
    if subprocess.run([vpy, "-m", "pip", "install", *QUIET_PIP, *args]).returncode != 0:
        raise SystemExit(1)


def imports(vpy: str, mods: str) -> bool:
    return subprocess.run([vpy, "-c", f"import {mods}"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def python(ns: argparse.Namespace) -> int:
    os.chdir(ROOT)
    os.environ.setdefault("CARGO_TERM_COLOR", "never")
    py = setting("PYTHON", "python3")
    venv = "target/python-venv"
    vpy, maturin = f"{venv}/bin/python", f"{venv}/bin/maturin"
    versions = (setting("KVO_VLLM_VERSIONS") or DEFAULT_VERSIONS).split()
    skip_vllm = setting("KVO_SKIP_VLLM", "0") == "1"

    print(f"== 1/4 virtual environment ({venv})", flush=True)
    if not os.access(vpy, os.X_OK):
        if subprocess.run([py, "-m", "venv", venv]).returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            print(f"ci/python: '{py} -m venv' failed (on Debian: apt-get install python3-venv)", file=sys.stderr)
            return 1
    if not (imports(vpy, "maturin") and subprocess.run([maturin, "--version"], stdout=subprocess.DEVNULL,
                                                        stderr=subprocess.DEVNULL).returncode == 0):
        pip_quiet(vpy, "maturin>=1.9.4,<2")
    if not imports(vpy, "pytest, hypothesis"):
        pip_quiet(vpy, "pytest", "hypothesis")
    # numpy: the tests of vLLM 0.34's DevicePointers (test_slotworker.py).
    if not imports(vpy, "numpy"):
        pip_quiet(vpy, "numpy")
    run([maturin, "--version"])

    if ns.setup:
        if skip_vllm:
            print("ci/python --setup: KVO_SKIP_VLLM=1: no vLLM environment prepared")
            return 0
        for v in versions:
            t0 = time.monotonic()
            try:
                VllmEnv(v).ensure()
            except VllmEnvError as e:
                say(str(e))
                print(f"ci/python --setup: ci/vllm-env --version {v} failed (its message is above); the vLLM tests "
                      "cannot run (KVO_SKIP_VLLM=1 skips them)", file=sys.stderr)
                return 1
            print(f"ci/python --setup: vLLM {v}'s environment ready ({int(time.monotonic() - t0)} s)", flush=True)
        return 0

    print("== 2/4 wheel (maturin build --release)", flush=True)
    shutil.rmtree("target/wheels", ignore_errors=True)
    # A stale extension from `maturin develop` would shadow the wheel for
    # anything run from python/.
    for f in glob.glob("python/kvoffload/_native*.so"):
        os.remove(f)
    run([f"../{maturin}", "build", "--release", "--strip", "--quiet", "--out", "../target/wheels",
         "--interpreter", f"../{vpy}"], cwd="python")
    run(["ls", "target/wheels/"])
    wheels = sorted(glob.glob("target/wheels/kvoffload-*.whl"))
    pip_quiet(vpy, "--force-reinstall", "--no-deps", *wheels)

    print("== 3/4 pytest", flush=True)
    # Run from outside the source tree so the installed wheel is what is tested.
    run(["python-venv/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "../python/tests"], cwd="target")

    print(f"== 4/4 vLLM {' '.join(versions)} (python/tests/test_vllm.py, test_vllm_pool.py in ci/vllm-env's "
          "environments)", flush=True)
    if skip_vllm:
        print("ci/python: KVO_SKIP_VLLM=1: the vLLM tests (python/tests/test_vllm.py) are SKIPPED")
        return 0
    installed = False
    for v in versions:
        try:
            vllm_py = VllmEnv(v).ensure()
        except VllmEnvError as e:
            say(str(e))
            print(f"ci/python: ci/vllm-env --version {v} failed (its message is above); the vLLM tests cannot run "
                  "(KVO_SKIP_VLLM=1 skips them)", file=sys.stderr)
            return 1
        # One base venv under every overlay: the wheel goes in once.
        if not installed:
            pip_quiet(vllm_py, "--no-deps", "--force-reinstall", *wheels)
            installed = True
        print(f"-- vLLM {v}", flush=True)
        run([vllm_py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "../python/tests/test_vllm.py",
             "../python/tests/test_vllm_pool.py"], cwd="target",
            env=dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", KVO_EXPECT_VLLM=v))
    return 0


def run(cmd: List[str], cwd: Optional[str] = None, env: Optional[dict] = None) -> None:
    """Runs `cmd`; its failure ends this program with its exit status (set -e)."""
    sys.stdout.flush()
    rc = subprocess.run(cmd, cwd=cwd, env=env).returncode
    if rc != 0:
        raise SystemExit(rc)


def configure_python(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\nci/vllm-env:", 1)[0]
    p.add_argument("--setup", action="store_true", help="the installs only (the venv's packages, vLLM's "
                   "environments for KVO_VLLM_VERSIONS)")


COMMANDS = [
    Command("python", "ci/python [--setup]: the wheel built and tested, against vLLM's releases too", python,
            configure_python),
    Command("vllm-env", "ci/vllm-env [--version V] [--check]: the cached vLLM environment of release V",
            vllm_env, configure_vllm_env),
]
