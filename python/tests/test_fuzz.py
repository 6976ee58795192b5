"""A property test of the Python API (issue 28, deliverable 6): hypothesis
generates huge, negative and NaN numbers, wrong types, calls after
shutdown and several threads waiting. After every call the process is
alive (the test still runs: an abort would end it), the error, if any, is
typed (a kvoffload error that is not a caught panic, or TypeError /
ValueError / OverflowError from the argument conversion) and, while the
offloader runs, a round trip (store, wait, load, wait) moves the bytes
exactly. Simulated GPU; about 20 s in a release build."""

import itertools
import math
import os
import threading

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvoffload as kv  # noqa: E402
import kvoffload._testing as kt  # noqa: E402

PAGE = 4096
GPU_BLOCKS = 8
ALLOWED = (kv.KvoffloadError, TypeError, ValueError, OverflowError)
#: KVO_FUZZ_EXAMPLES: examples per test (300: a few seconds in a release build).
SETTINGS = settings(
    max_examples=int(os.environ.get("KVO_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)

HUGE = [2**31, 2**32, 2**40, 2**62, 2**63, 2**63 - 1, 2**64 - 1, 2**64, 2**64 + 1, 10**30]
NEGATIVE = [-1, -2, -(2**31), -(2**63), -(2**64)]
ints = st.one_of(st.integers(0, 8), st.sampled_from(HUGE + NEGATIVE))
floats = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e300, -0.0]), st.floats(0, 5))
junk = st.sampled_from(["x", "", b"\0", None, [], [None], {}, object(), 1.5, math.nan, [2**70], [-1], (1, 2, 3)])
values = st.one_of(ints, floats, junk)
id_lists = st.one_of(st.lists(ints, max_size=4), junk)
keys = st.one_of(st.lists(st.one_of(ints, st.tuples(ints, ints)), max_size=4), junk)


def check_error(e):
    """`e` is one of the documented error types, and not a caught panic."""
    assert isinstance(e, ALLOWED), f"untyped error {type(e).__name__}: {e}"
    if isinstance(e, kv.KvoffloadError):
        assert e.kind != "panic", f"a Rust panic: {e}"


def call(f, *args, **kw):
    """Calls `f`; returns its result, or None after checking its error."""
    try:
        return f(*args, **kw)
    except BaseException as e:  # PanicException is a BaseException
        check_error(e)
        return None


class RoundTrip:
    counter = itertools.count(1 << 50)

    @classmethod
    def check(cls, off):
        """While `off` runs: a fresh key stored from block 0 and loaded into
        block 1 comes back byte for byte; after shutdown every call is
        refused with ShutDownError."""
        if off.is_shut_down:
            with pytest.raises(kv.ShutDownError):
                off.store([1], [0])
            return
        key = next(cls.counter)
        page = off.page_bytes[0]
        data = (key.to_bytes(8, "little") * (page // 8 + 1))[:page]
        kt.write_block(off, 0, 0, data)
        kt.write_block(off, 0, 1, b"\0" * page)
        r = off.store([key], [0])
        off.wait(r.job)
        off.wait(off.load([key], [1]))
        assert kt.read_block(off, 0, 1) == data


OPTIONS = [
    "host_blocks", "kv", "runtime", "region", "pin", "transfer", "eviction", "agreement", "agreement_timeout",
    "kv_groups", "start",
    # Arguments gone since issue 30, refused naming where they went.
    "addressing", "pin_threads", "tensors", "stream",
]
#: The option classes' fields (issue 30): hostile values raise OptionsError
#: when the object is built, and the offloader gets only valid objects.
FIELDS = {
    kv.PinOptions: [
        "threads", "max_chunk_bytes", "prefault", "huge_pages", "lookahead_bytes", "huge_fallback_mbps",
        "prefault_nice", "policy", "no_such_field",
    ],
    kv.TransferOptions: ["backend", "staging_bytes", "duplex_linger", "expedited_lane", "no_such_field"],
    kv.ShmOptions: ["dir", "timeout", "check_memory", "allow_group", "no_such_field"],
    kv.KvAlloc: ["tensors", "page_bytes", "gpu_blocks", "block_factor", "no_such_field"],
    kv.KvSpec: ["tensors", "gpu_blocks", "page_bytes", "block_factor", "compute_stream", "no_such_field"],
}
option_objects = st.sampled_from(sorted(FIELDS, key=lambda c: c.__name__)).flatmap(
    lambda c: st.tuples(st.just(c), st.dictionaries(st.sampled_from(FIELDS[c]), values, min_size=1, max_size=3))
)


@SETTINGS
@given(made=option_objects)
def test_option_objects_with_hostile_fields(made):
    cls, fields = made
    try:
        o = cls(**fields)
    except BaseException as e:
        # Wrong types and unknown fields too: typed, never TypeError.
        assert isinstance(e, kv.OptionsError) and e.kind in ("options", "pin"), f"{type(e).__name__}: {e}"
        return
    assert o == cls(**fields) and o == eval(repr(o), {"kvoffload": kv})
    for name in fields:
        getattr(o, name)


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(OPTIONS), values, min_size=1, max_size=3), keyed=st.booleans())
def test_construction_with_hostile_options(changes, keyed):
    kw = dict(host_blocks=8, kv=kv.KvAlloc(tensors=2, gpu_blocks=GPU_BLOCKS, page_bytes=PAGE), runtime=kv.Runtime("sim"))
    kw["pin"] = kv.PinOptions(threads=1)
    kw.update(changes)
    host_blocks = kw.pop("host_blocks")
    off = call(kv.KeyedOffloader if keyed else kv.Offloader, host_blocks, **kw)
    if off is None:
        return
    try:
        call(off.start)
        call(off.wait_pinned)
        if keyed and off.block_factor == 1 and off.gpu_blocks >= 2:
            RoundTrip.check(off)
    finally:
        call(off.shutdown)
    assert off.is_shut_down


ACTIONS = [
    "store", "load", "wait", "wait_all", "wait_jobs", "poll", "lookup", "gated", "capture",
    "hook", "threads", "shutdown", "start", "wait_pinned",
]


@SETTINGS
@given(steps=st.lists(st.tuples(st.sampled_from(ACTIONS), id_lists, keys, values), min_size=1, max_size=8))
def test_calls_with_hostile_arguments(steps):
    # Started: a capture window of the default policy waits for pinning,
    # which nothing else would start.
    off = kv.KeyedOffloader(
        16, kv=kv.KvAlloc(tensors=1, gpu_blocks=GPU_BLOCKS, page_bytes=PAGE), runtime=kv.Runtime("sim"),
        pin=kv.PinOptions(threads=1), start=True,
    )
    slots = []  # the slot-addressed Offloader of wait_jobs, made at its first
    try:
        for action, ids, ks, v in steps:
            if action == "store":
                call(off.store, ks, ids)
            elif action == "load":
                call(off.load, ks, ids)
            elif action == "wait":
                call(off.wait, v)
            elif action == "wait_all":
                call(off.wait_all)
            elif action == "wait_jobs":
                if not slots:
                    slots.append(kv.Offloader(
                        16, kv=kv.KvAlloc(tensors=1, gpu_blocks=GPU_BLOCKS, page_bytes=PAGE),
                        runtime=kv.Runtime("sim"), pin=kv.PinOptions(threads=1),
                    ))
                call(slots[0].wait_jobs, ids)
            elif action == "poll":
                call(off.poll)
            elif action == "lookup":
                call(off.lookup, ks)
            elif action == "gated":
                call(off.gated, v if callable(v) else (lambda: v))
            elif action == "capture":
                w = call(off.capture_window)
                if w is not None and call(w.__enter__) is not None:
                    call(w.__exit__, None, None, None)
            elif action == "hook":
                if call(off.capture_begin) is None and off.capture_depth > 0:
                    call(off.capture_end)
                assert off.capture_depth == 0
            elif action == "threads":
                several_threads_wait(off)
            elif action == "shutdown":
                call(off.shutdown)
            elif action == "start":
                call(off.start)
            elif action == "wait_pinned":
                call(off.wait_pinned)
            RoundTrip.check(off)
    finally:
        call(off.shutdown)
        for o in slots:
            call(o.shutdown)


def several_threads_wait(off):
    """A job, waited for by four threads at once, then by this one: every
    wait returns (its result), none raises."""
    if off.is_shut_down:
        return
    key = next(RoundTrip.counter)
    job = off.store([key], [2]).job
    errors = []

    def waiter():
        try:
            off.wait(job)
            off.poll()
        except Exception as e:  # asserted below
            errors.append(e)

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    off.wait(job)
    assert errors == []
