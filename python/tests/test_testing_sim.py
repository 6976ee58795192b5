"""The simulated GPU's test hooks for engines whose tensors are host memory
(issue 21): host memory adopted as device memory in place, streams,
captures and graphs, refusals. No GPU, numpy or PyTorch needed: buffers are
ctypes arrays, "tensors" small stand-ins with data_ptr() or
__array_interface__."""

import ctypes
import gc
import threading
import time
import weakref

import pytest

import kvoffload as kv
import kvoffload._testing as kt


@pytest.fixture
def rt():
    return kv.Runtime("sim")


def buffer(n, fill=0):
    b = (ctypes.c_uint8 * n)()
    ctypes.memset(b, fill, n)
    return b


class FakeTensor:
    """A CPU tensor as far as sim_adopt looks: data_ptr() and device.type."""

    class device:
        type = "cpu"

    def __init__(self, n):
        self.buf = buffer(n)

    def data_ptr(self):
        return ctypes.addressof(self.buf)


class FakeArray:
    """A numpy array as far as sim_adopt looks: __array_interface__."""

    def __init__(self, n, readonly=False):
        self.buf = buffer(n)
        self.__array_interface__ = {"data": (ctypes.addressof(self.buf), readonly), "shape": (n,), "typestr": "|u1"}


def test_a_memset_on_adopted_memory_writes_the_host_bytes(rt):
    b = buffer(8192)
    d = kt.sim_adopt(rt, ctypes.addressof(b), 8192)
    assert d != ctypes.addressof(b), "a device address of its own"
    assert kt.sim_adopted_ranges(rt) == 1
    assert kt.sim_device_bytes_in_use(rt) == 0, "adopted memory is not the sim's device memory"
    s = kt.sim_stream(rt)
    kt.sim_memset(rt, d + 4096, 0xAB, 1024, s)
    kt.sim_wait_idle(rt)
    got = bytes(b)
    assert got[4096:5120] == b"\xab" * 1024
    assert got[:4096] == bytes(4096) and got[5120:] == bytes(8192 - 5120)
    kt.sim_release_adopted(rt, d)
    assert kt.sim_adopted_ranges(rt) == 0
    # Released: the address is no longer device memory.
    with pytest.raises(kv.DriverError) as e:
        kt.sim_memset(rt, d, 1, 16, s)
    assert e.value.code == 1
    assert bytes(b)[:16] == bytes(16)
    kt.sim_stream_destroy(rt, s)


@pytest.mark.parametrize("make", [FakeTensor, FakeArray], ids=["data_ptr", "array_interface"])
def test_an_adopted_object_is_kept_alive_until_released(rt, make):
    t = make(256)
    buf = t.buf
    d = kt.sim_adopt(rt, t, 256)
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is not None, "the owner of adopted memory must stay alive"
    s = kt.sim_stream(rt)
    kt.sim_memset(rt, d, 9, 256, s)
    kt.sim_wait_idle(rt)
    assert bytes(buf) == b"\x09" * 256
    kt.sim_release_adopted(rt, d)
    gc.collect()
    assert ref() is None, "released: let go"


def test_what_sim_adopt_refuses(rt):
    with pytest.raises(ValueError, match="read-only"):
        kt.sim_adopt(rt, FakeArray(64, readonly=True), 64)
    with pytest.raises(TypeError, match="data_ptr"):
        kt.sim_adopt(rt, b"bytes", 5)
    with pytest.raises(TypeError):
        kt.sim_adopt(rt, True, 1)
    b = buffer(128)
    with pytest.raises(kv.DriverError) as e:
        kt.sim_adopt(rt, 0, 64)
    assert e.value.code == 1
    with pytest.raises(kv.DriverError):
        kt.sim_adopt(rt, ctypes.addressof(b), 0)
    d = kt.sim_adopt(rt, ctypes.addressof(b), 128)
    with pytest.raises(kv.DriverError, match="INVALID_VALUE"):
        kt.sim_adopt(rt, ctypes.addressof(b) + 64, 8)
    with pytest.raises(kv.DriverError):
        kt.sim_release_adopted(rt, d + 1)
    kt.sim_release_adopted(rt, d)
    with pytest.raises(kv.DriverError):
        kt.sim_release_adopted(rt, d)


def test_an_access_past_the_end_faults(rt):
    b = buffer(4096)
    d = kt.sim_adopt(rt, ctypes.addressof(b), 4096)
    s = kt.sim_stream(rt)
    with pytest.raises(kv.DriverError) as e:
        kt.sim_memset(rt, d + 4000, 1, 97, s)
    assert e.value.code == 1 and e.value.call == "cuMemsetD8Async"
    kt.sim_memset(rt, d + 4000, 1, 96, s)
    kt.sim_wait_idle(rt)
    assert bytes(b)[4000:] == b"\x01" * 96 and bytes(b)[:4000] == bytes(4000)
    kt.sim_release_adopted(rt, d)


def test_a_captured_memset_writes_adopted_memory_when_replayed(rt):
    b = buffer(1024)
    d = kt.sim_adopt(rt, ctypes.addressof(b), 1024)
    s = kt.sim_stream(rt)
    kt.sim_begin_capture(rt, s, "global")
    kt.sim_memset(rt, d, 0x5C, 1024, s)
    kt.sim_launch_spin(rt, s)
    g = kt.sim_end_capture(rt, s)
    kt.sim_wait_idle(rt)
    assert bytes(b) == bytes(1024), "a capture runs nothing"
    kt.sim_graph_launch(rt, g, s)
    kt.sim_wait_idle(rt)
    assert bytes(b) == b"\x5c" * 1024, "the replay wrote the host bytes"
    kt.sim_graph_destroy(rt, g)
    with pytest.raises(kv.OptionsError, match="no graph"):
        kt.sim_graph_launch(rt, g, s)
    kt.sim_release_adopted(rt, d)
    assert kt.sim_refusals(rt) == []


def test_capture_errors_are_typed(rt):
    s = kt.sim_stream(rt)
    with pytest.raises(kv.OptionsError, match="mode"):
        kt.sim_begin_capture(rt, s, "sideways")
    with pytest.raises(kv.OptionsError, match="no stream"):
        kt.sim_begin_capture(rt, s + 1000, "global")
    with pytest.raises(kv.DriverError):
        kt.sim_end_capture(rt, s)  # not capturing
    kt.sim_begin_capture(rt, s, "thread_local")
    with pytest.raises(kv.DriverError):
        kt.sim_begin_capture(rt, s, "global")  # capturing already
    kt.sim_graph_destroy(rt, kt.sim_end_capture(rt, s))


def test_a_refused_call_is_listed_and_invalidates_the_capture(rt):
    a, b = kt.sim_stream(rt), kt.sim_stream(rt)
    kt.sim_begin_capture(rt, b, "global")
    kt.sim_launch_spin(rt, b)
    graph = kt.sim_end_capture(rt, b)
    kt.sim_begin_capture(rt, a, "global")
    errors = []

    def launch():
        try:
            kt.sim_graph_launch(rt, graph, b)
        except kv.DriverError as e:
            errors.append(e)

    t = threading.Thread(target=launch)
    t.start()
    t.join()
    assert [e.code for e in errors] == [900]
    with pytest.raises(kv.DriverError) as e:
        kt.sim_end_capture(rt, a)
    assert e.value.code == 901
    refusals = kt.sim_refusals(rt)
    assert len(refusals) == 1 and refusals[0]["call"] == "cuGraphLaunch", refusals
    assert "no measured row" in refusals[0]["reason"]


def test_releasing_waits_for_queued_work(rt):
    b = buffer(256)
    d = kt.sim_adopt(rt, ctypes.addressof(b), 256)
    s = kt.sim_stream(rt)
    done = []
    with kt.sim_hold(rt, "device_op") as hold:
        kt.sim_memset(rt, d, 7, 256, s)
        hold.wait_entered()
        t = threading.Thread(target=lambda: done.append(kt.sim_release_adopted(rt, d)))
        t.start()
        time.sleep(0.2)
        assert t.is_alive() and not done, "released while work on it is queued"
        assert kt.sim_adopted_ranges(rt) == 1
    t.join(10)
    assert done == [None]
    assert bytes(b) == b"\x07" * 256, "the queued memset ran before the release returned"
    assert kt.sim_adopted_ranges(rt) == 0


def test_the_hooks_refuse_a_runtime_that_is_not_the_sim():
    with pytest.raises(TypeError):
        kt.sim_stream(object())
    try:
        cuda = kv.Runtime("cuda")
    except Exception:  # no GPU or no driver here
        pytest.skip("no CUDA runtime here to refuse")
    for call in (
        lambda: kt.sim_adopt(cuda, 4096, 64),
        lambda: kt.sim_release_adopted(cuda, 1),
        lambda: kt.sim_stream(cuda),
        lambda: kt.sim_begin_capture(cuda, 1),
        lambda: kt.sim_end_capture(cuda, 1),
        lambda: kt.sim_refusals(cuda),
    ):
        with pytest.raises(kv.OptionsError, match="simulated GPU"):
            call()
