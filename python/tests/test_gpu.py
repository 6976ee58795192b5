"""The Python front on a real GPU with PyTorch: skipped without torch or a
CUDA device (run on the H200 machine: pytest -m gpu python/tests).

KVO_EXPECT_GPU, as for the Rust GPU tests (tests/gpu_common/mod.rs): set to
anything but empty or "0" (ci/gpu exports KVO_EXPECT_GPU=1, a GPU is
expected there), every test here fails with the reason (pytest.fail, shown
as an error at setup) instead of skipping when torch or its CUDA device is
missing."""

import os
import threading

import pytest

import kvoffload as kv
import kvoffload._testing as kt

EXPECT_GPU = os.environ.get("KVO_EXPECT_GPU", "") not in ("", "0")


def _torch_and_why_not():
    """torch (or None), and why the GPU tests cannot run (None: they can)."""
    try:
        import torch
    except ImportError as e:
        return None, f"no PyTorch ({e})"
    if torch.cuda.is_available():
        return torch, None
    try:  # is_available() says no more; init() raises the driver's reason
        torch.cuda.init()
        detail = "torch.cuda.init() raised nothing"
    except Exception as e:  # noqa: BLE001 - any reason is the message
        detail = f"torch.cuda.init(): {type(e).__name__}: {e}"
    return torch, f"no CUDA device visible to torch ({detail}; torch {torch.__version__}, CUDA {torch.version.cuda})"


torch, WHY_NO_GPU = _torch_and_why_not()
pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _gpu_or_skip():
    """Runs before the other fixtures: skips, or fails under KVO_EXPECT_GPU."""
    if WHY_NO_GPU is not None:
        if EXPECT_GPU:
            pytest.fail(f"KVO_EXPECT_GPU is set (a GPU is expected here) but {WHY_NO_GPU}", pytrace=False)
        pytest.skip(WHY_NO_GPU)


PAGE = 32 << 10
BLOCKS = 256


@pytest.fixture
def kv_tensors():
    torch.cuda.set_device(0)
    return [torch.zeros((BLOCKS, PAGE), dtype=torch.uint8, device="cuda:0") for _ in range(2)]


def make(tensors, stream=None, **kw):
    if stream is None:
        stream = torch.cuda.current_stream().cuda_stream
    return kv.KeyedOffloader(256, kv=kv.KvSpec(tensors, compute_stream=stream), runtime=kv.Runtime("cuda", 0), **kw)


def test_torch_tensors_and_stream(kv_tensors):
    off = make(kv_tensors, start=True)
    assert off.runtime.backend == "cuda"
    assert off.gpu_blocks == BLOCKS and off.page_bytes == [PAGE, PAGE]
    assert off.tensor_addresses == [t.data_ptr() for t in kv_tensors]
    assert off.wait_pinned().state == "pinned"
    off.shutdown()


@pytest.mark.parametrize("copy_backend", ["auto", "staged", "gather"])
def test_round_trip_through_torch(kv_tensors, copy_backend):
    off = make(kv_tensors, start=True, transfer=kv.TransferOptions(backend=copy_backend))
    off.wait_pinned()
    n = 32
    src = [torch.randint(0, 256, (n, PAGE), dtype=torch.uint8, device="cuda") for _ in kv_tensors]
    for t, s in zip(kv_tensors, src):
        t[:n].copy_(s)  # on the compute stream: the store is ordered after it
    res = off.store(list(range(n)), list(range(n)))
    assert len(res.stored) == n
    off.wait_all()
    done = off.poll()
    for t in kv_tensors:
        t[:n].zero_()
    job = off.load(list(range(n)), list(range(100, 100 + n)))
    off.wait(job)
    done += off.poll()
    assert [(c.direction, c.ok) for c in done] == [("store", True), ("load", True)]
    if copy_backend != "auto":
        assert [c.backend for c in done] == [copy_backend] * 2
    for t, s in zip(kv_tensors, src):
        assert torch.equal(t[100 : 100 + n], s)
    # The offloader's test helpers see the same bytes.
    assert kt.read_block(off, 0, 100) == bytes(src[0][0].cpu().numpy().tobytes())
    off.shutdown()


def test_capture_window_around_torch_graphs_while_pinning(kv_tensors):
    """Captures in GLOBAL mode while pinning runs (Interleave policy): none
    is invalidated, every replay is right."""
    off = kv.KeyedOffloader(
        8192,  # 512 MiB of host blocks: pinning takes a while
        kv=kv.KvSpec(kv_tensors, compute_stream=torch.cuda.current_stream().cuda_stream),
        runtime=kv.Runtime("cuda"),
        pin=kv.PinOptions(policy="interleave", max_chunk_bytes=32 << 20),
    )
    off.start()
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    graphs = []
    for _ in range(10):
        g, y = torch.cuda.CUDAGraph(), torch.empty_like(x)
        with off.capture_window(), torch.cuda.graph(g):
            y.copy_(x)
            for _ in range(16):
                y.add_(1.0)
        graphs.append((g, y))
    assert off.wait_pinned().state == "pinned"
    for g, y in graphs:
        y.zero_()
        g.replay()
    torch.cuda.synchronize()
    for _, y in graphs:
        assert torch.equal(y, x + 16)
    off.shutdown()


def test_agreement_over_a_callable_on_gpu(kv_tensors):
    calls = []
    off = make(kv_tensors, agreement=lambda mine: calls.append(mine) or [mine], start=True)
    out = off.wait_pinned()
    assert out.state == "pinned" and out.agreed and calls == [kv.SETTLED_PINNED]
    off.shutdown()


def test_bad_tensors_on_gpu():
    cpu = torch.zeros((BLOCKS, PAGE), dtype=torch.uint8)
    with pytest.raises(kv.OptionsError, match="cpu tensor"):
        kv.KeyedOffloader(16, kv=kv.KvSpec([cpu]), runtime=kv.Runtime("cuda"))
    strided = torch.zeros((BLOCKS, 2 * PAGE), dtype=torch.uint8, device="cuda")[:, :PAGE]
    with pytest.raises(kv.OptionsError, match="contiguous"):
        kv.KeyedOffloader(16, kv=kv.KvSpec([strided]), runtime=kv.Runtime("cuda"))
    t = torch.zeros((BLOCKS, PAGE), dtype=torch.uint8, device="cuda")
    with pytest.raises(kv.OptionsError, match="do not fit"):
        kv.KeyedOffloader(16, kv=kv.KvSpec([t], page_bytes=2 * PAGE), runtime=kv.Runtime("cuda"))
    with pytest.raises(kv.OptionsError, match="compute_stream"):
        kv.KeyedOffloader(16, kv=kv.KvSpec([t], compute_stream="default"), runtime=kv.Runtime("cuda"))


def test_a_side_stream_as_compute_stream(kv_tensors):
    s = torch.cuda.Stream()
    off = make(kv_tensors, stream=s, start=True)  # an object with .cuda_stream
    off.wait_pinned()
    with torch.cuda.stream(s):
        kv_tensors[0][0].fill_(7)
        kv_tensors[1][0].fill_(9)
        off.store([1], [0])
    off.wait_all()
    off.poll()
    job = off.load([1], [5])
    off.wait(job)
    off.poll()
    assert int(kv_tensors[0][5].min()) == 7 and int(kv_tensors[1][5].max()) == 9
    off.shutdown()


def test_gil_is_released_while_a_window_waits(kv_tensors):
    off = make(kv_tensors)  # not started: an after_pinning window waits
    opened = threading.Event()

    def capture():
        with off.capture_window():
            opened.set()

    t = threading.Thread(target=capture)
    t.start()
    assert not opened.wait(0.2)
    off.start()
    t.join(30)
    assert opened.is_set()
    off.shutdown()
