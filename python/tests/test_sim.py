"""The Python front on the simulated GPU: no GPU, no PyTorch needed."""

import os
import threading
import time

import pytest

import kvoffload as kv
import kvoffload._testing as kt

PAGE = 4096
BLOCKS = 64


@pytest.fixture
def rt():
    """One simulated GPU per test, so its counters show leaks."""
    return kv.Runtime("sim")


#: Two tensors of BLOCKS blocks of PAGE bytes, allocated by the offloader.
ALLOC = kv.KvAlloc(tensors=2, page_bytes=PAGE, gpu_blocks=BLOCKS)


def make(rt, host_blocks=128, **kw):
    kw.setdefault("kv", ALLOC)
    return kv.KeyedOffloader(host_blocks, runtime=rt, **kw)


def assert_nothing_leaked(rt):
    assert kt.sim_device_bytes_in_use(rt) == 0
    assert kt.sim_registered_ranges(rt) == 0


def fill(off, blocks):
    """Random pages into `blocks` of every tensor; returns them by (tensor, block)."""
    data = {}
    for t in range(len(off.tensor_addresses)):
        for b in blocks:
            data[t, b] = os.urandom(off.page_bytes[t])
            kt.write_block(off, t, b, data[t, b])
    return data


# ---- construction ----


def test_construction_with_defaults(rt):
    off = make(rt)
    assert off.runtime.backend == "sim"
    assert off.gpu_blocks == BLOCKS
    assert off.page_bytes == [PAGE, PAGE]
    assert off.block_factor == 1
    assert len(off.tensor_addresses) == 2
    assert off.region_bytes >= 128 * 2 * PAGE
    assert off.pin_progress.state == "pending"
    assert off.pin_progress.state.name == "pending" and not off.pin_progress.state.is_final
    p = off.pin_progress
    assert p.chunks_done == 0 and p.chunks_total >= 1 and p.bytes_total >= 128 * 2 * PAGE
    # The KV tensors and the engine's gather tables.
    assert kt.sim_device_bytes_in_use(rt) >= 2 * BLOCKS * PAGE
    assert "Offloader" in repr(off) and "sim" in repr(off)
    off.shutdown()
    assert off.is_shut_down
    assert_nothing_leaked(rt)


def test_default_runtime_is_auto():
    # runtime=None: Runtime("auto") (the sim here, without a GPU).
    if kv.cuda_driver_present():
        pytest.skip("a CUDA driver is present: auto may pick it")
    off = kv.KeyedOffloader(16, kv=kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=8), pin=kv.PinOptions(threads=1))
    assert off.runtime.backend == "sim" and off.runtime.device == 0
    off.shutdown()


def test_start_pins_in_the_background(rt):
    off = make(rt, start=True)
    out = off.wait_pinned()
    assert out.state == "pinned" and out.agreed is None and out.agreement_error is None
    assert off.pin_progress.chunks_done == off.pin_progress.chunks_total
    assert kt.sim_registered_ranges(rt) >= 1
    off.shutdown()
    assert_nothing_leaked(rt)


@pytest.mark.parametrize("lookahead, fallback, nice", [(0, 0, 0), (1 << 20, 1, 19), (None, None, None)])
def test_pinning_options_of_the_pipeline_pin(rt, lookahead, fallback, nice):
    # The next chunk only / a small lookahead with the fallback at 1 MB/s /
    # the defaults: each pins every chunk (several: 64 KiB chunks).
    off = make(
        rt,
        start=True,
        pin=kv.PinOptions(
            max_chunk_bytes=1 << 16, lookahead_bytes=lookahead, huge_fallback_mbps=fallback, prefault_nice=nice
        ),
    )
    assert off.wait_pinned().state == "pinned"
    assert off.pin_progress.chunks_total > 4
    assert off.pin_progress.chunks_done == off.pin_progress.chunks_total
    off.shutdown()
    assert_nothing_leaked(rt)


def test_negative_pinning_options_are_refused(rt):
    for kw in (dict(lookahead_bytes=-1), dict(huge_fallback_mbps=-1)):
        with pytest.raises(kv.OptionsError) as e:
            kv.PinOptions(**kw)
        assert e.value.kind == "options" and next(iter(kw)) in str(e.value)
    assert_nothing_leaked(rt)


def test_context_manager_shuts_down(rt):
    with make(rt) as off:
        off.start()
        off.wait_pinned()
    assert off.is_shut_down
    assert_nothing_leaked(rt)


def test_dropping_the_offloader_shuts_it_down(rt):
    off = make(rt, start=True)
    off.wait_pinned()
    del off
    assert_nothing_leaked(rt)


# ---- bad arguments: clear exceptions, nothing leaked ----


@pytest.mark.parametrize(
    "kw, kind, words",
    [
        (dict(host_blocks=0), "options", "host_blocks"),
        (dict(kv=ALLOC.replace(tensors=0)), "options", "zero-sized"),
        (dict(kv=ALLOC.replace(page_bytes=0)), "options", "zero-sized"),
        (dict(kv=None), "options", "KeyedOffloader needs kv=: kvoffload.KvSpec(tensors, ...)"),
        (dict(kv=2), "options", "kv must be a kvoffload.KvSpec or a kvoffload.KvAlloc, not 2 (int)"),
        (dict(tensors=2), "options", "tensors (now kv=kvoffload.KvSpec(tensors, ...) for the engine's tensors"),
        (dict(stream=0), "options", "stream (now kv=kvoffload.KvSpec(..., compute_stream=...))"),
        (dict(kv_groups=[1, 1]), "options", "kv_groups (now kvoffload.Offloader(kv_groups=...)"),
        (dict(eviction="random"), "options", "eviction"),
        (dict(region="shared"), "options", "region must be a kvoffload.RegionSpec"),
        (dict(pin=dict(threads=1)), "options", "pin must be a kvoffload.PinOptions"),
        (dict(transfer=kv.PinOptions()), "options", "transfer must be a kvoffload.TransferOptions"),
        (dict(pin_threads=1), "options", "pin_threads (now pin=kvoffload.PinOptions(threads=...))"),
        (dict(ranks=2), "options", "ranks (now region=kvoffload.RegionSpec.shared(name, ranks=...))"),
        (dict(no_such_argument=1), "options", "unknown keyword arguments: no_such_argument"),
        (dict(agreement=42), "options", "callable"),
        (dict(agreement_timeout=-1.0), "options", "agreement_timeout"),
    ],
)
def test_bad_arguments_raise_options_error(rt, kw, kind, words):
    host_blocks = kw.pop("host_blocks", 128)
    with pytest.raises(kv.OptionsError) as e:
        make(rt, host_blocks, **kw)
    assert isinstance(e.value, kv.KvoffloadError)
    assert e.value.kind == kind
    assert words in str(e.value)
    assert_nothing_leaked(rt)


@pytest.mark.parametrize(
    "make_it, kind, words",
    [
        (lambda: kv.PinOptions(prefault="sometimes"), "options", "PinOptions.prefault must be one of"),
        (lambda: kv.PinOptions(huge_pages="maybe"), "options", "PinOptions.huge_pages"),
        (lambda: kv.PinOptions(policy="never"), "options", "PinOptions.policy"),
        (lambda: kv.PinOptions(threads=0), "pin", "threads"),
        (lambda: kv.PinOptions(max_chunk_bytes=0), "pin", "max_chunk_bytes"),
        (lambda: kv.PinOptions(prefault_nice=20), "pin", "prefault_nice"),
        (lambda: kv.TransferOptions(backend="carrier-pigeon"), "options", "TransferOptions.backend"),
        (lambda: kv.TransferOptions(duplex_linger=-0.5), "options", "duplex_linger"),
        (lambda: kv.TransferOptions(duplex_linger=1e20), "options", "duplex_linger"),
        (lambda: kv.ShmOptions(timeout=-1), "options", "ShmOptions.timeout"),
        (lambda: kv.RegionSpec.shared(), "options", "needs a name"),
        (lambda: kv.RegionSpec.shared("x", options=dict(dir="/tmp")), "options", "options must be a kvoffload.ShmOptions"),
        # Issue 30: an unknown field and a wrong type are OptionsErrors too
        # (never TypeError), naming the class and its fields.
        (lambda: kv.PinOptions(pin_threads=1), "options", "PinOptions has no field \"pin_threads\"; its fields are threads,"),
        (lambda: kv.TransferOptions(copy_backend="auto"), "options", "TransferOptions has no field"),
        (lambda: kv.ShmOptions(region_dir="/tmp"), "options", "ShmOptions has no field"),
        (lambda: kv.RegionSpec.shared("x", rnak=1), "options", "RegionSpec.shared has no field"),
        (lambda: kv.PinOptions(threads="2"), "options", "PinOptions.threads must be an int >= 1 or None, not '2' (str)"),
        (lambda: kv.PinOptions(threads=True), "options", "PinOptions.threads must be"),
        (lambda: kv.PinOptions(threads=2.0), "options", "PinOptions.threads must be"),
        (lambda: kv.PinOptions(lookahead_bytes=2**64), "options", "PinOptions.lookahead_bytes must be"),
        (lambda: kv.TransferOptions(expedited_lane=1), "options", "TransferOptions.expedited_lane must be a bool"),
        (lambda: kv.ShmOptions(check_memory="no"), "options", "ShmOptions.check_memory must be a bool"),
        (lambda: kv.ShmOptions(allow_group=True), "options", "ShmOptions.allow_group must be"),
        (lambda: kv.RegionSpec.shared(42), "options", "name must be a str"),
        (lambda: kv.RegionSpec.shared("x", rank=-1), "options", "RegionSpec.shared.rank must be"),
        (lambda: kv.PinOptions(1), "options", "PinOptions takes keyword arguments only"),
        (lambda: kv.PinOptions().replace(policy=None), "options", "PinOptions.policy"),
        # The KV description's classes, as the others.
        (lambda: kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=4, compute_stream=0), "options",
         "KvAlloc has no field \"compute_stream\"; its fields are tensors, page_bytes, gpu_blocks, block_factor"),
        (lambda: kv.KvAlloc(1, PAGE, 4), "options", "KvAlloc takes keyword arguments only"),
        (lambda: kv.KvAlloc(tensors="2", page_bytes=PAGE, gpu_blocks=4), "options",
         "KvAlloc.tensors must be an int in [0, 2**64), not '2' (str)"),
        (lambda: kv.KvAlloc(tensors=-1, page_bytes=PAGE, gpu_blocks=4), "options", "KvAlloc.tensors must be"),
        (lambda: kv.KvAlloc(tensors=True, page_bytes=PAGE, gpu_blocks=4), "options", "KvAlloc.tensors must be"),
        (lambda: kv.KvAlloc(tensors=1, page_bytes=2**64, gpu_blocks=4), "options", "KvAlloc.page_bytes must be"),
        (lambda: kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=4).replace(block_factor=None), "options",
         "KvAlloc.block_factor must be"),
        (lambda: kv.KvSpec([1], compute_stream="garbage"), "options",
         "KvSpec.compute_stream must be a CUDA stream handle (an int in [0, 2**64)), an object with .cuda_stream"),
        (lambda: kv.KvSpec([1], compute_stream=object()), "options", "KvSpec.compute_stream must be"),
        (lambda: kv.KvSpec([1], compute_stream=True), "options", "KvSpec.compute_stream must be"),
        (lambda: kv.KvSpec([1], compute_stream=-1), "options", "KvSpec.compute_stream must be"),
        (lambda: kv.KvSpec([1], block_factor=1.5), "options", "KvSpec.block_factor must be"),
        (lambda: kv.KvSpec([1], gpu_blocks="4"), "options", "KvSpec.gpu_blocks must be"),
        (lambda: kv.KvSpec([True]), "options", "KvSpec.tensors[0]: bool has neither data_ptr()"),
        (lambda: kv.KvSpec([1, -1]), "options", "KvSpec.tensors[1]: a device address must be in [0, 2**64), not -1"),
        (lambda: kv.KvSpec([1], [2]), "options", "KvSpec takes at most 1 positional argument(s) (tensors), 2 given"),
        (lambda: kv.KvSpec([1], tensors=[2]), "options", "KvSpec: tensors given twice"),
        (lambda: kv.KvSpec([1], stream=0), "options", "KvSpec has no field \"stream\""),
        (lambda: kv.KvSpec(None), "options", "KvSpec.tensors must be a list of tensors"),
    ],
)
def test_bad_option_objects_raise_options_error(make_it, kind, words):
    with pytest.raises(kv.OptionsError) as e:
        make_it()
    assert e.value.kind == kind
    assert words in str(e.value), str(e.value)


def test_option_objects_have_rusts_defaults_and_compare_by_value(tmp_path):
    pin = kv.PinOptions()
    assert pin.threads >= 1 and pin.max_chunk_bytes == 256 << 20 and pin.lookahead_bytes is None
    assert (pin.prefault, pin.huge_pages, pin.policy) == ("populate", "auto", "after_pinning")
    assert (pin.huge_fallback_mbps, pin.prefault_nice) == (1000, 10)
    # None is the default for a numeric field, as the old flat arguments had it.
    assert kv.PinOptions(threads=None, prefault_nice=None) == pin
    assert pin.replace(policy="interleave") == kv.PinOptions(policy="interleave") != pin
    assert eval(repr(pin.replace(lookahead_bytes=0)), {"kvoffload": kv}) == pin.replace(lookahead_bytes=0)
    t = kv.TransferOptions()
    assert (t.backend, t.staging_bytes, t.duplex_linger, t.expedited_lane) == ("auto", 32 << 20, 0.02, False)
    assert eval(repr(t), {"kvoffload": kv}) == t and t != kv.TransferOptions(expedited_lane=True)
    shm = kv.ShmOptions()
    assert (shm.dir, shm.timeout, shm.check_memory, shm.allow_group) == ("/dev/shm", 60.0, True, None)
    assert kv.ShmOptions(dir=tmp_path).dir == str(tmp_path)
    r = kv.RegionSpec.shared("it's", rank=1, ranks=2, options=kv.ShmOptions(dir=tmp_path, timeout=5))
    assert (r.kind, r.name, r.rank, r.ranks, r.options.timeout) == ("shared", "it's", 1, 2, 5.0)
    assert eval(repr(r), {"kvoffload": kv}) == r
    a = kv.RegionSpec()
    assert a == kv.RegionSpec.anonymous() != r and (a.kind, a.name, a.rank, a.ranks, a.options) == (
        "anonymous", None, 0, 1, None
    )
    assert repr(a) == "kvoffload.RegionSpec.anonymous()"
    assert pin != t and (pin == object()) is False


def test_kv_objects_compare_by_value_and_read_back():
    a = kv.KvAlloc(tensors=2, page_bytes=PAGE, gpu_blocks=8)
    assert (a.tensors, a.page_bytes, a.gpu_blocks, a.block_factor) == (2, PAGE, 8, 1)
    assert a == kv.KvAlloc(gpu_blocks=8, page_bytes=PAGE, tensors=2) != a.replace(block_factor=2)
    assert eval(repr(a), {"kvoffload": kv}) == a
    assert repr(a) == f"kvoffload.KvAlloc(tensors=2, page_bytes={PAGE}, gpu_blocks=8, block_factor=1)"

    class T:  # a tensor-like object
        def data_ptr(self):
            return 4096

    class S:  # a torch.cuda.Stream-like object
        cuda_stream = 7

    ta, tb = T(), T()
    s = kv.KvSpec([ta, tb], compute_stream=7)
    assert s.tensors[0] is ta and s.tensors[1] is tb
    assert (s.gpu_blocks, s.page_bytes, s.block_factor, s.compute_stream) == (None, None, 1, 7)
    # Tensor objects compare by identity, the stream by its handle.
    assert s == kv.KvSpec(tensors=(ta, tb), compute_stream=S()) != kv.KvSpec([tb, ta], compute_stream=7)
    assert s.replace(block_factor=2) == kv.KvSpec([ta, tb], block_factor=2, compute_stream=7) != s
    assert s.replace(compute_stream=None).compute_stream is None
    assert repr(s).startswith("kvoffload.KvSpec(tensors=[<T at 0x") and repr(s).endswith(
        "], gpu_blocks=None, page_bytes=None, block_factor=1, compute_stream=7)"
    )
    # Bare addresses read back with eval.
    addrs = kv.KvSpec([1 << 40, 1 << 41], gpu_blocks=4, page_bytes=PAGE, block_factor=2)
    assert eval(repr(addrs), {"kvoffload": kv}) == addrs
    assert (s == a) is False and (s != a) is True and (a == s) is False


def test_tensor_arguments(rt):
    with pytest.raises(kv.OptionsError, match="KvAlloc needs tensors, page_bytes and gpu_blocks; page_bytes, gpu_blocks missing"):
        kv.KvAlloc(tensors=2)
    with pytest.raises(kv.OptionsError, match=r"KvSpec.tensors\[0\]: object has neither data_ptr"):
        kv.KvSpec([object()])
    with pytest.raises(kv.OptionsError, match="KvSpec.tensors is empty"):
        kv.KvSpec([])
    with pytest.raises(kv.OptionsError, match=r"not 2 \(int\); for the offloader to allocate them: kv=kvoffload.KvAlloc"):
        kv.KvSpec(2)
    with pytest.raises(kv.OptionsError, match="KvSpec needs tensors"):
        kv.KvSpec(gpu_blocks=4)
    # A bare address needs page_bytes, known only when the offloader reads it.
    with pytest.raises(kv.OptionsError, match="is a bare address: give page_bytes"):
        kv.KeyedOffloader(16, kv=kv.KvSpec([1 << 40], gpu_blocks=4), runtime=rt)

    class Cai:  # a CUDA array interface object, as CuPy gives
        __cuda_array_interface__ = {"data": (1 << 40, False), "shape": (BLOCKS, 256), "typestr": "<f2", "version": 3}

    # The simulated GPU cannot reach an engine's memory.
    with pytest.raises(kv.OptionsError, match="CUDA backend"):
        kv.KeyedOffloader(16, kv=kv.KvSpec([Cai()]), runtime=rt)

    class ReadOnly:
        __cuda_array_interface__ = {"data": (1 << 40, True), "shape": (8,), "typestr": "<f4", "version": 3}

    with pytest.raises(kv.OptionsError, match="read-only"):
        kv.KeyedOffloader(16, kv=kv.KvSpec([ReadOnly()]), runtime=rt)

    class Strided:
        __cuda_array_interface__ = {
            "data": (1 << 40, False),
            "shape": (8, 4),
            "typestr": "<f4",
            "strides": (32, 4),
            "version": 3,
        }

    with pytest.raises(kv.OptionsError, match="contiguous"):
        kv.KeyedOffloader(16, kv=kv.KvSpec([Strided()]), runtime=rt)

    class Cpu:  # looks like a CPU torch tensor
        class device:
            type = "cpu"
            index = None

        def data_ptr(self):
            return 4096

    # The simulated GPU takes CPU tensors (test_slots.py), by their storage.
    with pytest.raises(kv.OptionsError, match="a CPU tensor without untyped_storage"):
        kv.KeyedOffloader(16, kv=kv.KvSpec([Cpu()]), runtime=rt)
    assert_nothing_leaked(rt)


def test_shared_region_file_is_gone(rt, tmp_path):
    off = make(rt, region=kv.RegionSpec.shared(f"t{os.getpid()}", options=kv.ShmOptions(dir=tmp_path)), start=True)
    # One rank: the file is unlinked as soon as it is mapped.
    assert os.listdir(tmp_path) == []
    assert off.wait_pinned().state == "pinned"
    off.shutdown()
    assert os.listdir(tmp_path) == []
    assert_nothing_leaked(rt)


def test_region_that_exists_raises_region_error(rt, tmp_path):
    name = f"busy{os.getpid()}"
    (tmp_path / f"kvoffload-{name}").write_bytes(b"someone else's")
    with pytest.raises(kv.RegionError) as e:
        make(rt, region=kv.RegionSpec.shared(name, options=kv.ShmOptions(dir=tmp_path)))
    assert e.value.kind == "region" and e.value.reason == "already_exists"
    # Not ours: left alone; nothing else made.
    assert os.listdir(tmp_path) == [f"kvoffload-{name}"]
    assert_nothing_leaked(rt)


def test_region_directory_missing(rt, tmp_path):
    with pytest.raises(kv.RegionError):
        make(rt, region=kv.RegionSpec.shared("x", options=kv.ShmOptions(dir=tmp_path / "no-such-dir")))
    assert_nothing_leaked(rt)


# ---- capture windows ----


def test_capture_window_is_a_context_manager(rt):
    off = make(rt, start=True)
    off.wait_pinned()
    w = off.capture_window()
    assert not w.is_open
    with w as entered:
        assert entered is w and w.is_open
        with pytest.raises(kv.ProtocolError) as e:
            with off.capture_window():
                pass
        assert e.value.reason == "nested_window"
        # Shutdown is refused while a window is open, and changes nothing.
        with pytest.raises(kv.ProtocolError) as e:
            off.shutdown()
        assert e.value.reason == "window_open"
        assert not off.is_shut_down
    assert not w.is_open
    # After pinning is final (default policy): it waited for no chunk.
    assert w.chunks_waited == 0
    off.shutdown()
    assert_nothing_leaked(rt)


def test_window_waits_for_pinning_with_the_gil_released(rt):
    """With the default policy a window opens only once pinning is final;
    entering it waits without holding the GIL (this thread keeps running)."""
    off = make(rt)
    opened = threading.Event()

    def capture():
        with off.capture_window():
            assert off.pin_progress.state.is_final
            opened.set()

    t = threading.Thread(target=capture)
    t.start()
    time.sleep(0.2)
    assert not opened.is_set(), "a window opened before pinning started"
    off.start()
    t.join(10)
    assert opened.is_set()
    off.shutdown()
    assert_nothing_leaked(rt)


def test_window_closes_on_an_exception(rt):
    off = make(rt, start=True)
    with pytest.raises(RuntimeError):
        with off.capture_window():
            raise RuntimeError("capture failed")
    off.shutdown()  # not refused: the window closed


def test_gated_runs_the_engines_call(rt):
    off = make(rt, start=True)
    assert off.gated(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        off.gated(lambda: 1 / 0)
    off.shutdown()


# ---- store and load ----


def test_round_trip_byte_for_byte(rt):
    off = make(rt, start=True)
    off.wait_pinned()
    data = fill(off, range(4))
    keys = [11, (12, 0), (13, 5), -14]
    res = off.store(keys, [0, 1, 2, 3])
    assert res.job is not None
    assert res.stored == [(11, 0), (12, 0), (13, 5), ((-14) % 2**64, 0)]
    assert res.skipped == [] and res.evicted == []
    assert off.in_flight == 1
    off.wait_all()
    done = off.poll()
    assert [(c.job, c.direction, c.ok) for c in done] == [(res.job, "store", True)]
    assert done[0].bytes == 4 * 2 * PAGE and done[0].keys == res.stored
    assert off.lookup(keys + [99]) == ["hit"] * 4 + ["miss"]
    assert off.stored_blocks == 4
    # Storing again skips them.
    again = off.store(keys[:1], [0])
    assert again.job is None and again.skipped == [((11, 0), "already_stored")]
    # Clobber the source blocks, load into other blocks, compare.
    for t in range(2):
        for b in range(4):
            kt.write_block(off, t, b, bytes(PAGE))
    job = off.load(list(reversed(keys)), [40, 41, 42, 43])
    off.wait(job)
    done = off.poll()
    assert [(c.job, c.direction, c.ok) for c in done] == [(job, "load", True)]
    for t in range(2):
        for i, b in enumerate([43, 42, 41, 40]):
            assert kt.read_block(off, t, b) == data[t, i], f"tensor {t}, block {b}"
    assert off.in_flight == 0
    off.shutdown()
    assert_nothing_leaked(rt)


@pytest.mark.parametrize("staging_bytes, used", [(None, "staged"), (1 << 20, "staged"), (0, "per-fragment")])
def test_staged_backend_by_name(rt, staging_bytes, used):
    # Forced staged: both directions through device staging memory; with
    # no staging memory the job falls back to per-fragment copies.
    transfer = kv.TransferOptions(backend="staged", staging_bytes=staging_bytes, duplex_linger=0.0)
    off = make(rt, start=True, transfer=transfer)
    off.wait_pinned()
    data = fill(off, [0, 3, 5])
    off.store([1, 2, 3], [0, 3, 5])
    off.wait_all()
    done = off.poll()
    for t in range(2):
        for b in [0, 3, 5]:
            kt.write_block(off, t, b, bytes(PAGE))
    job = off.load([3, 1, 2], [9, 10, 11])
    off.wait(job)
    done += off.poll()
    assert [(c.direction, c.ok, c.backend) for c in done] == [("store", True, used), ("load", True, used)]
    for t in range(2):
        for b, src in [(9, 5), (10, 0), (11, 3)]:
            assert kt.read_block(off, t, b) == data[t, src], f"tensor {t}, block {b}"
    off.shutdown()
    assert_nothing_leaked(rt)


def test_round_trip_on_pageable_memory(rt):
    kt.sim_fail_registration(rt, nth=1, code=801)
    off = make(rt, start=True)
    out = off.wait_pinned()
    assert out.state == "pageable" and out.state.reason == "not_supported"
    assert "801" in out.state.message
    data = fill(off, [5])
    off.store([7], [5])
    off.wait_all()
    assert all(c.ok for c in off.poll())
    job = off.load([7], [6])
    off.wait(job)
    off.poll()
    assert kt.read_block(off, 0, 6) == data[0, 5]
    assert kt.read_block(off, 1, 6) == data[1, 5]
    off.shutdown()
    assert_nothing_leaked(rt)


def test_eviction_when_full(rt):
    off = make(rt, host_blocks=2, start=True)
    off.store([1, 2], [0, 1])
    off.wait_all()
    off.poll()
    res = off.store([3], [2])
    assert len(res.evicted) == 1 and res.evicted[0] in [(1, 0), (2, 0)]
    off.wait_all()
    off.poll()
    gone = res.evicted[0][0]
    assert off.lookup([gone, 3 - gone, 3]) == ["miss", "hit", "hit"]
    off.shutdown()


def test_bad_jobs(rt):
    off = make(rt, start=True, kv=ALLOC.replace(block_factor=2))
    with pytest.raises(kv.OptionsError) as e:
        off.store([1], [0])
    assert e.value.kind == "gpu_block_count"
    with pytest.raises(kv.ManagerError):
        off.load([1], [0, 1])  # never stored
    with pytest.raises(kv.OptionsError):
        off.store([1], [0, BLOCKS])  # out of range
    # The refused store left nothing pending.
    assert off.lookup([1]) == ["miss"] and off.in_flight == 0
    with pytest.raises(kv.OptionsError, match="GPU block id"):
        off.store([1], [0, -1])
    with pytest.raises(kv.OptionsError, match="group"):
        off.store([(1, -1)], [0, 1])
    with pytest.raises(kv.OptionsError, match="pair"):
        off.store([(1, 2, 3)], [0, 1])
    with pytest.raises(kv.TransferError) as e:
        off.wait(12345)
    assert e.value.kind == "unknown_job"
    with pytest.raises(kv.OptionsError):
        kt.read_block(off, 2, 0)
    with pytest.raises(kv.OptionsError):
        kt.write_block(off, 0, 0, b"short")
    off.shutdown()
    assert_nothing_leaked(rt)


# ---- shutdown ----


def test_use_after_shutdown(rt):
    off = make(rt, start=True)
    off.store([1], [0])
    off.shutdown()  # drains the store first
    assert off.is_shut_down
    for call in (
        lambda: off.store([2], [1]),
        lambda: off.load([1], [1]),
        lambda: off.wait_all(),
        lambda: off.shutdown(),
        lambda: off.capture_window().__enter__(),
        lambda: off.start(),
    ):
        with pytest.raises(kv.ShutDownError) as e:
            call()
        assert isinstance(e.value, kv.ProtocolError)
    assert off.poll() == []
    assert_nothing_leaked(rt)


def test_shutdown_during_pinning(rt):
    off = make(rt, host_blocks=256, pin=kv.PinOptions(max_chunk_bytes=2 * PAGE), start=True)
    off.shutdown()
    assert off.pin_progress.state.is_final
    assert_nothing_leaked(rt)


# ---- agreement in one process (the transport's contract) ----


def test_agreement_transport_all_pinned(rt):
    seen = []

    def transport(mine):
        seen.append(mine)
        return [mine, kv.SETTLED_PINNED]

    off = make(rt, agreement=transport, start=True)
    out = off.wait_pinned()
    assert out.state == "pinned" and out.agreed is True and out.agreement_error is None
    assert seen == [kv.SETTLED_PINNED]
    off.shutdown()


def test_agreement_peer_pageable(rt):
    off = make(rt, agreement=lambda mine: kv.SETTLED_PAGEABLE, start=True)  # an all-reduce's MAX
    out = off.wait_pinned()
    assert out.state == "pageable" and out.state.reason == "peer_pageable" and out.agreed is True
    assert off.pin_progress.chunks_done == 0  # every chunk unregistered again
    off.shutdown()
    assert_nothing_leaked(rt)


def test_agreement_transport_error_leaves_this_rank_pageable(rt):
    def broken(mine):
        raise ConnectionError("peer gone")

    off = make(rt, agreement=broken, start=True)
    out = off.wait_pinned()
    assert out.state == "pageable" and out.agreed is False
    err = out.agreement_error
    assert isinstance(err, kv.AgreementError) and err.kind == "transport"
    assert "ConnectionError" in str(err) and "peer gone" in str(err)
    assert off.pin_progress.chunks_done == 0
    off.shutdown()
    assert_nothing_leaked(rt)


@pytest.mark.parametrize("answer", [[], [0, 1], [1, 9], "pinned", None])
def test_agreement_transport_breaking_its_contract(rt, answer):
    off = make(rt, agreement=lambda mine: answer, start=True)
    out = off.wait_pinned()
    assert out.state == "pageable" and out.agreed is False
    assert out.agreement_error.kind in ("bad_exchange", "transport")
    off.shutdown()


def test_logging_can_be_enabled():
    assert kv.enable_logging("warn") in (True, False)


# ---- pin holds (an engine's capture phase) ----


def eventually(what, cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.001)


def test_a_pin_hold_keeps_registrations_back_until_released(rt):
    off = make(rt)
    h = off.hold_pinning()
    assert h.is_held and repr(h) == "PinHold(held)"
    off.start()
    eventually("the first registration held back", lambda: kt.activity(off)["registrations_held"] == 1)
    assert off.pin_progress.chunks_done == 0
    assert kt.activity(off)["pin_holds"] == 1
    # The holder waiting for pinning would wait for itself.
    with pytest.raises(kv.ProtocolError) as e:
        off.wait_pinned()
    assert e.value.reason == "would_deadlock"
    h.release()
    h.release()  # idempotent
    assert not h.is_held and kt.activity(off)["pin_holds"] == 0
    assert off.wait_pinned().state == "pinned"
    with off.hold_pinning() as h2:
        assert h2.is_held and kt.activity(off)["pin_holds"] == 1
    assert not h2.is_held and kt.activity(off)["pin_holds"] == 0
    off.shutdown()
    assert_nothing_leaked(rt)


def test_a_shutdown_is_not_held_up_by_a_pin_hold(rt):
    off = make(rt)
    h = off.hold_pinning()
    off.start()
    eventually("the first registration held back", lambda: kt.activity(off)["registrations_held"] == 1)
    off.shutdown()
    assert off.pin_progress.state == "pageable" and h.is_held
    h.release()
    assert_nothing_leaked(rt)
