"""Interpreter exit is safe whatever kvoffload's threads are doing (issue
43, items 1 and 4). Simulated GPU.

Each case runs in child interpreters with a timeout, so that an abort
fails the test with the child's exit status and stderr, and a hang fails it
once the timeout passes (the child is killed), never hanging pytest.

Item 1: a shutdown that succeeded while the `agreement=` callable still
ran, then the interpreter's exit, aborted the process (`Fatal Python error:
PyGILState_Release: thread state ... must be current`, SIGABRT, exit 134)
when the callable's thread came back into Python during finalisation: the
callable ran on a thread of the library, whose Rust frames unwound as
CPython ended it. Each exit case runs KVO_EXIT_RUNS times (default 20),
a few children at a time.

Item 4: dropping a capture window that another thread left open, after
the offloader was dropped, hung for ever: the window held the offloader's
last reference, and the offloader's drop waited for that very window.
"""

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

RUNS = int(os.environ.get("KVO_EXIT_RUNS", "20"))
CHILD_TIMEOUT = 20.0  # s: a child still running then is a hang (it needs about 1 s)
PARALLEL = 4

# The child of item 1: the callable is entered, the offloader shuts down
# while it runs (it waits for `release`), and only then does the callable
# go on, for 0.3 s, as the interpreter exits: spinning (taking and dropping
# the GIL), or sleeping with the GIL released (as gloo does), or sleeping
# while the interpreter's finalisation is slow (a module whose teardown
# spins for 0.6 s, as a big import's teardown takes its time).
AGREEMENT_CHILD = """
import os, sys, threading, time, types
import kvoffload as kv

case = sys.argv[1]
entered, release = threading.Event(), threading.Event()

def agree(mine):
    entered.set()
    release.wait()
    t = time.monotonic()
    if case == "spin":
        while time.monotonic() - t < 0.3:
            pass
    else:
        time.sleep(0.3)
    return [mine]

rt = kv.Runtime("sim")
off = kv.KeyedOffloader(
    64, kv=kv.KvAlloc(tensors=2, page_bytes=4096, gpu_blocks=32), runtime=rt, agreement=agree, start=True
)
assert entered.wait(30), "the agreement callable was never called"
off.shutdown()
print("shut down", off.pin_progress.state.reason, flush=True)
release.set()

if case == "slow_exit":
    class SlowTeardown:
        def __del__(self, mono=time.monotonic):
            t = mono()
            while mono() - t < 0.6:
                pass

    m = types.ModuleType("kvo_slow_teardown")
    m.keep = SlowTeardown()
    sys.modules[m.__name__] = m
    del m
"""


def run_child(src, *args):
    """(exit status, stdout, stderr) of `src` in a fresh interpreter; a
    child that outlives CHILD_TIMEOUT is killed and reported as a hang."""
    try:
        p = subprocess.run(
            [sys.executable, "-c", src, *args], capture_output=True, text=True, timeout=CHILD_TIMEOUT
        )
    except subprocess.TimeoutExpired as e:
        return None, e.stdout or "", f"hung for {CHILD_TIMEOUT} s (killed)"
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("case", ["spin", "sleep", "slow_exit"])
def test_exit_while_the_agreement_callable_runs_after_shutdown(case):
    src = textwrap.dedent(AGREEMENT_CHILD)
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(lambda _: run_child(src, case), range(RUNS)))
    bad = [(code, err) for code, out, err in results if code != 0 or "Fatal Python error" in err]
    assert not bad, f"{len(bad)} of {RUNS} exits failed; first: status {bad[0][0]}\n{bad[0][1][-2000:]}"
    for code, out, err in results:
        assert out.startswith("shut down "), out + err  # while the callable ran


# The child of item 4: a thread opens a window and leaves it open; the
# offloader is dropped (its shutdown refused: the window is open), then the
# window (which now holds the offloader's last reference) on `dropper`.
WINDOW_CHILD = """
import sys, threading
import kvoffload as kv
import kvoffload._testing as kt

opener, dropper = sys.argv[1], sys.argv[2]
rt = kv.Runtime("sim")
off = kv.KeyedOffloader(64, kv=kv.KvAlloc(tensors=2, page_bytes=4096, gpu_blocks=32), runtime=rt, start=True)
off.wait_pinned()
box = []

def on(where, f):
    if where == "main":
        f()
    else:
        t = threading.Thread(target=f)
        t.start()
        t.join()

def open_window():
    w = off.capture_window()
    w.__enter__()
    box.append(w)

on(opener, open_window)
del off
print("offloader dropped", flush=True)
on(dropper, lambda: box.clear())
print("window dropped", kt.sim_registered_ranges(rt), kt.sim_device_bytes_in_use(rt), flush=True)
"""


@pytest.mark.parametrize("opener,dropper", [("main", "main"), ("thread", "main"), ("main", "thread")])
def test_dropping_a_window_left_open_after_the_offloader_ends(opener, dropper):
    code, out, err = run_child(textwrap.dedent(WINDOW_CHILD), opener, dropper)
    assert code == 0, f"status {code}: {out}{err}"
    # The window closed, then the offloader shut down: nothing registered
    # or allocated is left.
    assert out.splitlines() == ["offloader dropped", "window dropped 0 0"], out + err
