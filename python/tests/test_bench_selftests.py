"""The GPU benchmarks' own checks, run here on the CPU: python/bench/
serving.py and serve_http.py (issue 42) run real vLLM engines only on a GPU
machine, so their process-group handling, GPU-free waits, log and SSE
parsing, tables and budgets are checked by their --self-test against fake
engines and a fake OpenAI server (each check of theirs seen failing on a
deliberate breakage, their commits say which). A self-test that stops
passing fails ci/test instead of a GPU run."""

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")


@pytest.mark.parametrize("script", ["serving.py", "serve_http.py"])
def test_a_gpu_benchmark_passes_its_self_test(script, tmp_path):
    p = subprocess.run(
        [sys.executable, os.path.join(BENCH, script), "--self-test"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and "self-test: ok" in p.stdout, p.stdout[-3000:]
