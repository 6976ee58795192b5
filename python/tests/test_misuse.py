"""Misuse gives a typed error, never a hang, a panic or an abort (issue 28,
items 3, 5, 7 and 10, and a garbage compute stream), naming what was
wrong (issue 43, item 7). Simulated GPU.

The calls that hung or killed the process before the fix run in a child
interpreter with a timeout, so that a regression fails the test instead of
hanging or killing pytest."""

import re
import subprocess
import sys
import textwrap

import pytest

import kvoffload as kv

PAGE = 4096
CHILD_TIMEOUT = 20.0  # s: a child still running then is a hang (it needs about 1 s)


def make(rt, **kw):
    kw.setdefault("kv", kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=4))
    kw.setdefault("pin", kv.PinOptions(threads=1))
    cls = kv.Offloader if kw.pop("slots", False) else kv.KeyedOffloader
    return cls(kw.pop("host_blocks", 8), runtime=rt, **kw)


def child(body):
    """Runs `body` in a fresh interpreter (kvoffload imported as kv, a sim
    runtime as rt); returns (exit status, stdout, stderr)."""
    src = "import kvoffload as kv, resource, sys, time\nrt = kv.Runtime('sim')\n" + textwrap.dedent(body)
    try:
        p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child hung for {CHILD_TIMEOUT} s:\n{body}")
    return p.returncode, p.stdout, p.stderr


# ---- item 3: calls that deadlocked for ever ----


@pytest.mark.parametrize("inner", ["o.capture_window().__enter__()", "o.capture_begin()", "o.gated(lambda: 1)"])
def test_a_window_or_gated_inside_gated_is_refused(inner):
    code, out, err = child(f"""
        o = kv.KeyedOffloader(8, kv=kv.KvAlloc(tensors=1, page_bytes=4096, gpu_blocks=4), runtime=rt, pin=kv.PinOptions(threads=1), start=True)
        o.wait_pinned()
        try:
            o.gated(lambda: {inner})
            print("no error")
        except kv.ProtocolError as e:
            print("refused", e.reason)
        assert o.capture_depth == 0
        with o.capture_window():  # nothing left open or counted
            pass
        o.shutdown()
        print("shut down")
    """)
    assert code == 0, err
    assert out.split("\n")[:2] == ["refused would_deadlock", "shut down"], out + err


# ---- item 5: huge counts ----


@pytest.mark.parametrize(
    "kwargs",
    [
        "kv=kv.KvAlloc(tensors=2**63, page_bytes=4096, gpu_blocks=4)",
        "kv=kv.KvAlloc(tensors=2**40, page_bytes=4096, gpu_blocks=4)",
        "kv=kv.KvAlloc(tensors=100000, page_bytes=4096, gpu_blocks=4), host_blocks=2**20",
        "kv=kv.KvAlloc(tensors=4, page_bytes=2**62, gpu_blocks=4)",
        "kv=kv.KvAlloc(tensors=1, page_bytes=4096, gpu_blocks=2**62)",
        "kv=kv.KvAlloc(tensors=1, page_bytes=4096, gpu_blocks=4), host_blocks=2**62",
        "kv=kv.KvAlloc(tensors=1, page_bytes=4096, gpu_blocks=4, block_factor=2**62)",
        # A shared region's share is checked before the tensors too.
        "kv=kv.KvAlloc(tensors=2**40, page_bytes=1, gpu_blocks=1), host_blocks=1, region=kv.RegionSpec.shared('misuse')",
        "kv=kv.KvAlloc(tensors=100000, page_bytes=4096, gpu_blocks=4), host_blocks=2**20, "
        "region=kv.RegionSpec.shared('misuse')",
        # The engine's tensors (bare addresses) with huge numbers: typed too
        # (on the sim, which takes only CPU tensors, refused as such).
        "kv=kv.KvSpec([1 << 40] * 4, page_bytes=2**62, gpu_blocks=4)",
        "kv=kv.KvSpec([1 << 40], page_bytes=4096, gpu_blocks=2**62)",
    ],
)
def test_huge_counts_are_refused_before_anything_is_allocated(kwargs):
    # The peak resident size the call added (on a GPU machine the process
    # starts far above a machine without one: the driver's mappings).
    code, out, err = child(f"""
        kw = dict({kwargs})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            kv.KeyedOffloader(kw.pop("host_blocks", 8), runtime=rt, pin=kv.PinOptions(threads=1), **kw)
            print("built")
        except BaseException as e:
            print(type(e).__name__, isinstance(e, kv.KvoffloadError), getattr(e, "kind", None))
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    assert code == 0, f"the child died (exit {code}): {err[-2000:]}"
    what, rss_mb = out.split("\n")[:2]
    name, typed, kind = what.split(" ")
    assert typed == "True" and kind != "panic", f"{kwargs}: {what} ({err[-1000:]})"
    assert int(rss_mb) < 200, f"{kwargs}: {rss_mb} MB more resident before the refusal"


# ---- item 7: the driver error's reason ----


def test_driver_error_reason_is_the_code_in_snake_case():
    rt = kv.Runtime("sim")
    with pytest.raises(kv.DriverError) as e:
        make(rt, kv=kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=2**40))
    assert e.value.code_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert e.value.reason == "cuda_error_out_of_memory"


# ---- item 10: calls of the other class ----
# Issue 30 split the class as the library is split: a keyed call on the
# slot-addressed Offloader (or a slot job on a KeyedOffloader) is an
# AttributeError, as in Rust it does not compile.

KEYED_CALLS = ("lookup", "store", "load", "stored_blocks")
SLOT_CALLS = ("store_slots", "load_slots", "store_slot_job", "load_slot_job", "wait_jobs")


def test_each_class_lacks_the_other_ones_calls():
    rt = kv.Runtime("sim")
    keys = make(rt)
    assert [n for n in SLOT_CALLS if hasattr(keys, n)] == []
    with pytest.raises(AttributeError):
        keys.wait_jobs([1])
    keys.shutdown()
    slots = make(kv.Runtime("sim"), slots=True)
    assert [n for n in KEYED_CALLS if hasattr(slots, n)] == []
    with pytest.raises(AttributeError):
        slots.lookup([1])
    slots.shutdown()
    assert [n for n in KEYED_CALLS + SLOT_CALLS if hasattr(kv._OffloaderBase, n)] == []
    with pytest.raises(TypeError):
        kv._OffloaderBase()


# ---- fragile: a compute stream ----
# A stream goes with the engine's tensors only (KvSpec.compute_stream;
# KvAlloc has no such field: the offloader makes its own), and a garbage
# one is refused when the KvSpec is built.


@pytest.mark.parametrize("stream", ["garbage", 12345, object()])
def test_a_stream_with_allocated_tensors_is_refused(stream):
    with pytest.raises(kv.OptionsError, match="KvAlloc has no field \"compute_stream\""):
        kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=4, compute_stream=stream)
    off = make(kv.Runtime("sim"))
    off.shutdown()


@pytest.mark.parametrize("stream", ["garbage", 2**64, -1, 1.0, object(), True])
def test_a_garbage_stream_is_refused(stream):
    with pytest.raises(kv.OptionsError, match="KvSpec.compute_stream must be a CUDA stream handle"):
        kv.KvSpec([1 << 40], page_bytes=PAGE, gpu_blocks=4, compute_stream=stream)


# ---- issue 43, item 7: refusals that named the wrong thing, or none ----


@pytest.mark.parametrize(
    "args, kw, words",
    [
        (("a/b",), {}, "RegionSpec.shared.name must be a file name: bad region name \"a/b\": contains '/' or NUL"),
        (("",), {}, "RegionSpec.shared.name must be a file name: bad region name \"\": empty"),
        (("x" * 201,), {}, "longer than 200 bytes"),
        (("x",), dict(ranks=0), "RegionSpec.shared.ranks must be an int in [1, 32] (the most ranks a region's header"),
        (("x",), dict(ranks=33), "RegionSpec.shared.ranks must be an int in [1, 32]"),
        (("x",), dict(rank=2, ranks=2), "RegionSpec.shared.rank must be below ranks (2): the ranks are 0..1, not 2"),
        (("x",), dict(rank=1), "RegionSpec.shared.rank must be below ranks (1)"),
    ],
)
def test_a_shared_region_spec_is_checked_when_built(args, kw, words):
    with pytest.raises(kv.OptionsError, match=re.escape(words)) as e:
        kv.RegionSpec.shared(*args, **kw)
    assert e.value.kind == "options"
    # The bounds themselves are taken.
    r = kv.RegionSpec.shared("x" * 200, rank=31, ranks=32)
    assert (r.rank, r.ranks) == (31, 32)


def test_a_zero_block_factor_is_refused_by_name():
    with pytest.raises(kv.OptionsError, match=re.escape("KvAlloc.block_factor must be at least 1")) as e:
        make(kv.Runtime("sim"), kv=kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=4, block_factor=0))
    assert e.value.kind == "options"


def test_a_logging_filter_that_does_not_parse_is_refused_naming_the_directive():
    # In a child: a filter taken sets the process's one tracing subscriber.
    code, out, err = child("""
        try:
            kv.enable_logging("warn,not a filter[[[")
            print("taken")
        except ValueError as e:
            print(type(e).__name__, isinstance(e, kv.OptionsError), e.kind)
            print(e)
        print(kv.enable_logging("warn,kvoffload=debug"), kv.enable_logging("info"))
    """)
    assert code == 0, err
    lines = out.split("\n")
    assert lines[0] == "OptionsError True options", out
    assert lines[1].startswith('enable_logging: "not a filter[[[" is not a filter directive ('), out
    assert lines[2] == "True False", "a good filter still sets the subscriber, once: " + out


def test_a_wait_or_window_refused_inside_gated_names_gated_not_a_window():
    o = make(kv.Runtime("sim"), start=True)
    o.wait_pinned()
    for inner in (o.wait_pinned, o.capture_window().__enter__, lambda: o.gated(lambda: 1), o.shutdown):
        with pytest.raises(kv.ProtocolError) as e:
            o.gated(inner)
        assert e.value.reason == "would_deadlock"
        assert "inside gated() would deadlock: gated() holds capture windows back" in str(e.value), e.value
        assert "capture window would deadlock" not in str(e.value) and o.capture_depth == 0, e.value
    # Inside a window, the window is the cause, and is named.
    with o.capture_window():
        with pytest.raises(kv.ProtocolError) as e:
            o.gated(lambda: 1)
    assert str(e.value) == "the engine's own call inside this thread's own open capture window would deadlock"
    o.shutdown()


def test_shut_down_error_has_kind_shut_down_from_every_call():
    o = make(kv.Runtime("sim"), start=True)
    o.wait_pinned()
    o.shutdown()
    # The windows' ShutDownError had kind "protocol" (the Rust error's
    # outer variant), a store's or a wait's "shut_down".
    calls = {
        "capture_window": lambda: o.capture_window().__enter__(),
        "capture_begin": o.capture_begin,
        "store": lambda: o.store([1], [0]),
        "wait_all": o.wait_all,
        "wait_pinned": o.wait_pinned,
        "start": o.start,
    }
    for name, call in calls.items():
        with pytest.raises(kv.ShutDownError) as e:
            call()
        assert (e.value.kind, e.value.reason) == ("shut_down", "shut_down"), (name, e.value)
    with pytest.raises(kv.ShutDownError) as e:
        o.shutdown()
    assert (e.value.kind, e.value.reason) == ("shut_down", "already_shut_down")
