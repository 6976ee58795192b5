"""ci/gpu's self-check (ci/gpu-skips): on a machine that should have a GPU,
a skipped GPU test fails the suite; a test that is not a GPU test (the
vLLM tests where vLLM is not installed, the simulated-GPU tests) does not.
Logs as ci/gpu writes them."""

import pathlib
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "ci" / "gpu-skips"


def skips(tmp_path, logs):
    paths = []
    for name, text in logs.items():
        p = tmp_path / name
        p.write_text(text)
        paths.append(str(p))
    r = subprocess.run([str(SCRIPT), *paths], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


PYTEST_LOG = """\
........s.....s
SKIPPED [1] ../python/tests/test_vllm.py:44: vLLM is not installed here (ci/python runs this file in ci/vllm-env's venv)
SKIPPED [2] ../python/tests/test_sim.py:12: needs two ranks
"""


@pytest.mark.skipif(not SCRIPT.exists(), reason="run from the repository (ci/ is not beside python/tests)")
def test_only_gpu_tests_that_skipped_are_named(tmp_path):
    assert skips(tmp_path, {"pytest-gpu.log": PYTEST_LOG, "test-gpu_runtime.log": "test ok\n"}) == []
    got = skips(
        tmp_path,
        {
            "pytest-gpu.log": PYTEST_LOG + "SKIPPED [3] ../python/tests/test_gpu.py:30: no CUDA device\n",
            "test-transfer_gpu.log": "SKIPPED round_trip_on_the_gpu: no libcuda\n",
            "memcheck-gpu_pattern.log": "",
            "bench-pin.log": "SKIPPED something that is not a test\n",
        },
    )
    assert got == [
        "pytest-gpu: ../python/tests/test_gpu.py",
        "test-transfer_gpu: round_trip_on_the_gpu",
    ], got
