"""kvo_ci: kvoffload's CI as one program (issue 44, item 4).

Every script under ci/ is a few lines that run `python3 -B ci/kvo_ci SUB
ARGS...`; this package holds their logic, one subcommand each (`ci/kvo_ci
--help` lists them, `ci/kvo_ci SUB --help` gives a subcommand's flags):

    test            ci/test: every test of a machine with the Rust toolchain (rust.py)
    lint            ci/lint: rustfmt, clippy (plain, loom, shuttle), rustdoc (rust.py)
    test-limits     ci/test-limits: nextest under per-test limits, doc tests (rust.py)
    deadline        ci/deadline: a command with a deadline, a hang named (deadline.py)
    soak            ci/soak: a million jobs on the simulated GPU (rust.py)
    build-gpu-bin   ci/build-gpu-bin: what ci/gpu needs, into gpu-bin/ (rust.py)
    prove           ci/prove: the loom and shuttle proofs (prove.py)
    mutants         ci/mutants: mutation testing of the verified core (mutants.py)
    model-reach     ci/model-reach: what each loom model reaches (reach.py)
    python          ci/python: the wheel and its tests, vLLM's releases (pyenv.py)
    vllm-env        ci/vllm-env: the cached vLLM environments (pyenv.py)
    gpu             ci/gpu: the GPU suite, on the GPU machine (gpu.py)
    gpu-skips       ci/gpu-skips: the GPU tests that skipped, from ci/gpu's logs (gpu.py)
    gpu-pin-probe   ci/gpu-pin-probe: pinning candidates explored (gpu.py)
    gpu-serving     ci/gpu-serving: the serving benchmark (gpu.py)
    gpu-serve-http  ci/gpu-serve-http: `vllm serve` over HTTP (gpu.py)
    gpu-pool        ci/gpu-pool: two engines and a restart on one node pool (gpu.py)
    selftest        the argument parsers and this table checked against the code (selftest.py)

The GPU subcommands run on a machine with python3 (3.12) and no Rust; the
others where the Rust toolchain is (python3 3.11 on CI). Standard library
only, Python 3.9 or later.

Settings: the environment variables the program reads, all of them (the
self-test fails when the code reads one that is not in SETTINGS, or SETTINGS
holds one that no code reads, or this table or ci/README.md's differs from
SETTINGS). Everything else that a run chooses is a flag of its subcommand.

| setting | read by | default | what |
|---|---|---|---|
| OUT | gpu, gpu-serving, gpu-serve-http, gpu-pool | gpu-out | the folder of the GPU runs' logs and tables |
| PYTHON | python, vllm-env | python3 | the interpreter that makes the virtual environments |
| KVO_BIN | gpu, gpu-serving, gpu-serve-http, gpu-pool | gpu-bin | the folder ci/build-gpu-bin filled (binaries, the wheel) |
| KVO_EXPECT_GPU | gpu | 1 | a GPU is expected: a GPU test that skips fails (exported to the tests, which read it too) |
| KVO_VLLM_SITE | gpu, gpu-serving, gpu-serve-http, gpu-pool | - | an unpacked site folder where vLLM imports from |
| KVO_VLLM_BUNDLE | gpu, gpu-serving, gpu-serve-http, gpu-pool | shared/vllm-0.26-h200 (serving) | the shared vLLM bundle (its folder or site.tar.xz), unpacked to /tmp/site once |
| KVO_VLLM_VENV | vllm-env, python | ~/.cache/kvoffload/vllm-0.33.0-venv | where vLLM 0.33's cached venv lives (overlays beside it) |
| KVO_VLLM_VERSIONS | python | 0.33.0 0.34.0 0.26.0 | the vLLM releases test_vllm.py runs against |
| KVO_SKIP_VLLM | python | 0 | 1: the vLLM tests are skipped, saying so |
| KVO_SERVE_WHEELS | gpu-serve-http | $KVO_BIN/serve-wheels | the wheels `vllm serve` needs beyond the bundle |

Set for the programs CI runs, not read here (CHILD_SETTINGS; the models of
model/common/mod.rs and the tests read them): KVO_PROVE_BOUND,
KVO_PREEMPTIONS_MAX, KVO_SHUTTLE_ITERATIONS, KVO_SHUTTLE_PCT,
KVO_SHUTTLE_REPLAY (ci/prove, ci/mutants, ci/model-reach set them per run),
KVO_SHUTTLE_SEED (a shuttle run's seed, passed through), KVO_EXPECT_VLLM
(test_vllm.py: the release it must find), KVO_STRESS_SECONDS
(test_threads.py's stress time, passed through).
"""
from __future__ import annotations

import os
import sys
from typing import Dict, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.dirname(os.path.abspath(__file__))

# name: (default shown in the table, subcommands that read it, what)
SETTINGS: Dict[str, Tuple[str, str, str]] = {
    "OUT": ("gpu-out", "gpu, gpu-serving, gpu-serve-http, gpu-pool", "the folder of the GPU runs' logs and tables"),
    "PYTHON": ("python3", "python, vllm-env", "the interpreter that makes the virtual environments"),
    "KVO_BIN": ("gpu-bin", "gpu, gpu-serving, gpu-serve-http, gpu-pool",
                "the folder ci/build-gpu-bin filled (binaries, the wheel)"),
    "KVO_EXPECT_GPU": ("1", "gpu", "a GPU is expected: a GPU test that skips fails "
                       "(exported to the tests, which read it too)"),
    "KVO_VLLM_SITE": ("-", "gpu, gpu-serving, gpu-serve-http, gpu-pool", "an unpacked site folder where vLLM imports from"),
    "KVO_VLLM_BUNDLE": ("shared/vllm-0.26-h200 (serving)", "gpu, gpu-serving, gpu-serve-http, gpu-pool",
                        "the shared vLLM bundle (its folder or site.tar.xz), unpacked to /tmp/site once"),
    "KVO_VLLM_VENV": ("~/.cache/kvoffload/vllm-0.33.0-venv", "vllm-env, python",
                      "where vLLM 0.33's cached venv lives (overlays beside it)"),
    "KVO_VLLM_VERSIONS": ("0.33.0 0.34.0 0.26.0", "python", "the vLLM releases test_vllm.py runs against"),
    "KVO_SKIP_VLLM": ("0", "python", "1: the vLLM tests are skipped, saying so"),
    "KVO_SERVE_WHEELS": ("$KVO_BIN/serve-wheels", "gpu-serve-http", "the wheels `vllm serve` needs beyond the bundle"),
}

# Set (or passed through) for the models and tests CI runs; read by them, not here.
CHILD_SETTINGS = ("KVO_PROVE_BOUND", "KVO_PREEMPTIONS_MAX", "KVO_SHUTTLE_ITERATIONS", "KVO_SHUTTLE_PCT",
                  "KVO_SHUTTLE_REPLAY", "KVO_SHUTTLE_SEED", "KVO_EXPECT_VLLM", "KVO_STRESS_SECONDS")

# Standard variables of the tools CI drives, read to pass them on or extend them.
STANDARD = ("RUSTFLAGS", "CARGO_TERM_COLOR", "CARGO_TARGET_DIR", "PYTHONPATH", "LD_LIBRARY_PATH", "TMPDIR",
            "PIP_INDEX_URL", "HOME")


def setting(name: str, default: Optional[str] = None) -> Optional[str]:
    """The value of CI setting `name` (one of SETTINGS), or `default`."""
    if name not in SETTINGS:
        raise KeyError(f"kvo_ci: {name} is not a CI setting (SETTINGS in ci/kvo_ci/__init__.py)")
    return os.environ.get(name, default)


def self_cmd(sub: str, *args: str) -> list:
    """The command line that runs subcommand `sub` of this program."""
    return [sys.executable, "-B", PKG, sub, *args]


def say(prefix: str, msg: str, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    stream.write(f"{prefix}: {msg}\n")
    stream.flush()
