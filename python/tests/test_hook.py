"""The capture hook (kvoffload._hook over Offloader.capture_begin /
capture_end / capture_abort) on the simulated GPU, with a stand-in graph
class whose capture_begin/capture_end play a CUDA graph capture on the sim
(GLOBAL mode, the rules enforced against the pinner and the copies):
``torch.cuda.CUDAGraph`` cannot be made without a GPU, so the real class is
only checked by identity (test_vllm.py). No PyTorch needed here."""

import random
import threading

import pytest

import kvoffload as kv
import kvoffload._testing as kt
from kvoffload import _hook

from test_slots import PAGE, fill, kv_tensors, zero


class Graph:
    """torch.cuda.CUDAGraph's two methods, on the sim: a capture of
    ``stream`` in ``capture_error_mode`` (global by default, as
    ``torch.cuda.graph``)."""

    rt = None
    stream = None

    def __init__(self):
        self.graph = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        kt.sim_begin_capture(self.rt, self.stream, capture_error_mode)

    def capture_end(self):
        self.graph = kt.sim_end_capture(self.rt, self.stream)

    def replay(self):
        kt.sim_graph_launch(self.rt, self.graph, self.stream)


@pytest.fixture
def setup():
    rt = kv.Runtime("sim")
    stream = kt.sim_stream(rt)
    cls = type("G", (Graph,), {"rt": rt, "stream": stream})
    ts = kv_tensors(1)
    off = kv.Offloader(
        8, kv=kv.KvSpec(ts, compute_stream=stream), runtime=rt,
        pin=kv.PinOptions(threads=1, policy="interleave"),
    )
    yield rt, stream, cls, ts, off
    if not off.is_shut_down:
        off.shutdown()


def capturing(off, cls):
    """The hook installed for ``off`` on ``cls``, and a graph of ``cls``
    whose capture has begun (its hook window open)."""
    h = _hook.install(off, cls)
    g = cls()
    g.capture_begin()
    return h, g


def test_install_patches_and_remove_restores(setup):
    rt, stream, cls, ts, off = setup
    begin, end = cls.__dict__.get("capture_begin"), cls.__dict__.get("capture_end")
    assert begin is None and end is None, "inherited from Graph"
    h = _hook.install(off, cls)
    assert cls.capture_begin is not Graph.capture_begin and cls.capture_begin.__kvoffload_hook__
    assert _hook.installed_count(cls) == 1
    h.remove()
    assert "capture_begin" not in cls.__dict__ and cls.capture_begin is Graph.capture_begin
    assert cls.capture_end is Graph.capture_end
    h.remove()  # idempotent
    assert _hook.installed_count(cls) == 0


def test_each_capture_opens_and_closes_one_window_and_jobs_inside_are_deferred(setup):
    rt, stream, cls, ts, off = setup
    off.start()
    off.wait_pinned()
    h = _hook.install(off, cls)
    want = fill(ts, [0, 1], random.Random(7))
    g = cls()
    g.capture_begin()
    assert off.capture_depth == 1 and kt.activity(off)["windows_open"] == 1
    kt.sim_memset(rt, off.tensor_addresses[0] + 15 * PAGE, 0x5A, PAGE, stream)  # the captured work
    off.store_slots(1, [0, 1], [3, 4])  # inside the capture: deferred, not captured
    off.store_slots(2, [1], [5])
    assert off.deferred_jobs == 2 and off.poll() == []
    g.capture_end()  # no DriverError: the capture was not invalidated
    assert off.capture_depth == 0 and kt.activity(off)["windows_open"] == 0
    assert kt.sim_refusals(rt) == []
    off.wait_jobs([1, 2])
    done = off.poll()
    assert [c.job for c in done] == [1, 2], "in submission order"
    assert all(c.ok and c.deferred_seconds > 0 and c.seconds >= c.deferred_seconds for c in done)
    assert ts[0].block(15) == bytes(PAGE), "captured, not run"
    g.replay()
    kt.sim_wait_idle(rt)
    assert ts[0].block(15) == bytes([0x5A]) * PAGE, "the replay runs the captured memset"
    zero(ts)
    off.load_slots(3, [8, 9], [3, 4])
    off.wait_jobs([3])
    off.poll()
    assert [ts[0].block(8), ts[0].block(9)] == [want[(0, 0)], want[(0, 1)]]
    h.remove()
    off.shutdown()


def test_without_the_hook_a_job_inside_a_global_capture_is_refused(setup):
    """What the hook prevents: the store's order event would be recorded on
    the capturing stream."""
    rt, stream, cls, ts, off = setup
    off.start()
    off.wait_pinned()
    g = cls()
    g.capture_begin()
    with pytest.raises(kv.TransferError) as e:
        off.store_slots(1, [0], [0])
    assert e.value.reason == "compute_capturing"
    g.capture_end()


def test_nested_begins_open_one_window(setup):
    rt, stream, cls, ts, off = setup
    h = _hook.install(off, cls)
    off.capture_begin()  # an outer begin of the same thread (another graph's)
    g = cls()
    g.capture_begin()
    assert off.capture_depth == 2 and kt.activity(off)["windows_open"] == 1
    g.capture_end()
    assert off.capture_depth == 1 and kt.activity(off)["windows_open"] == 1
    off.capture_end()
    assert off.capture_depth == 0 and kt.activity(off)["windows_open"] == 0
    h.remove()


def test_a_failing_capture_begin_aborts_and_a_failing_end_still_closes(setup):
    rt, stream, cls, ts, off = setup
    h = _hook.install(off, cls)
    g = cls()
    with pytest.raises(kv.OptionsError, match="mode"):
        g.capture_begin(capture_error_mode="nonsense")  # the framework's begin raises
    assert off.capture_depth == 0 and kt.activity(off)["windows_open"] == 0
    with pytest.raises(kv.DriverError):
        g.capture_end()  # no capture began: the framework's end raises; no window was ours
    h.remove()

    class FailingEnd(cls):
        def capture_end(self):  # the capture ends, then instantiation fails
            super().capture_end()
            raise RuntimeError("instantiate failed")

    h = _hook.install(off, FailingEnd)
    g = FailingEnd()
    g.capture_begin()
    assert off.capture_depth == 1
    with pytest.raises(RuntimeError, match="instantiate failed"):
        g.capture_end()
    assert off.capture_depth == 0 and kt.activity(off)["windows_open"] == 0
    h.remove()


def test_two_offloaders_share_one_patch(setup):
    rt, stream, cls, ts, off = setup
    rt2 = kv.Runtime("sim")
    off2 = kv.Offloader(4, kv=kv.KvSpec(kv_tensors(1)), runtime=rt2, pin=kv.PinOptions(threads=1))
    h1 = _hook.install(off, cls)
    patched = cls.capture_begin
    h2 = _hook.install(off2, cls)
    assert cls.capture_begin is patched and _hook.installed_count(cls) == 2
    g = cls()
    g.capture_begin()
    assert off.capture_depth == 1 and off2.capture_depth == 1
    g.capture_end()
    assert off.capture_depth == 0 and off2.capture_depth == 0
    h1.remove()
    assert cls.capture_begin is patched, "still installed for off2"
    g.capture_begin()
    assert off.capture_depth == 0 and off2.capture_depth == 1
    g.capture_end()
    h2.remove()
    assert "capture_begin" not in cls.__dict__
    off2.shutdown()


def test_a_wrapper_installed_after_ours_stays_and_ours_passes_through(setup):
    rt, stream, cls, ts, off = setup
    h = _hook.install(off, cls)
    ours = cls.capture_begin
    calls = []

    def theirs(self, *a, **k):
        calls.append("theirs")
        return ours(self, *a, **k)

    cls.capture_begin = theirs
    h.remove()
    assert cls.capture_begin is theirs, "someone else's wrapper is left alone"
    g = cls()
    g.capture_begin()
    assert calls == ["theirs"] and off.capture_depth == 0, "ours only passes through"
    g.capture_end()


def test_a_graph_dropped_during_capture_closes_its_window(setup):
    import gc

    rt, stream, cls, ts, off = setup
    h, g = capturing(off, cls)
    assert off.capture_depth == 1
    del g
    gc.collect()
    assert off.capture_depth == 0 and kt.activity(off)["windows_open"] == 0
    kt.sim_end_capture(rt, stream)  # the sim's capture itself, ended by hand
    h.remove()


def test_shutdown_is_refused_while_a_hook_window_is_open(setup):
    rt, stream, cls, ts, off = setup
    h, g = capturing(off, cls)
    with pytest.raises(kv.ProtocolError):
        off.shutdown()
    g.capture_end()
    h.remove()
    off.shutdown()


def test_a_hook_window_waits_for_one_registration_not_for_pinning(setup):
    rt, stream, cls, ts, off0 = setup
    off0.shutdown()
    rt = kv.Runtime("sim")
    stream = kt.sim_stream(rt)
    cls = type("G2", (Graph,), {"rt": rt, "stream": stream})
    # 64 slots of one 256-byte page rounded to 4 KiB pages: 8 chunks of 32 KiB.
    off = kv.Offloader(
        64, kv=kv.KvSpec(kv_tensors(1), compute_stream=stream), runtime=rt,
        pin=kv.PinOptions(threads=1, max_chunk_bytes=32768),
    )
    h = _hook.install(off, cls)
    opened, go = threading.Event(), threading.Event()
    errors = []

    def capture():
        g = cls()
        try:
            g.capture_begin()
            opened.set()
            go.wait(10)
            g.capture_end()  # on the thread that began (the depth is per thread)
        except BaseException as e:
            errors.append(e)
            opened.set()

    with kt.sim_hold(rt, "register") as hold:
        off.start()
        hold.wait_entered()
        t = threading.Thread(target=capture)
        t.start()
        assert not opened.wait(0.3), "the window waits for the registration in flight"
    assert opened.wait(10) and errors == []
    p = off.pin_progress
    assert p.chunks_done < p.chunks_total, f"pinning paused mid-way ({p}), not awaited"
    assert off.pin_progress.state == "pinning"
    assert kt.activity(off)["windows_open"] == 1
    go.set()
    t.join(10)
    assert errors == [] and kt.activity(off)["windows_open"] == 0
    assert off.wait_pinned().state == "pinned", "pinning resumes after the window"
    assert kt.sim_refusals(rt) == []
    h.remove()
    off.shutdown()
