"""kvoffload inside the real vLLM (0.33.0, 0.34.0 and 0.26.0 from
ci/vllm-env's cached environments: ci/python runs this file once per
release), on the simulated GPU, with no GPU anywhere.

What runs here is vLLM's own code: ``OffloadingSpecFactory`` and
``KVConnectorFactory`` load ``kvoffload.vllm.KvoffloadSpec`` from the JSON
config; vLLM's ``Scheduler`` with its ``OffloadingConnector`` (scheduler
role: ``OffloadingConnectorScheduler`` over vLLM's ``CPUOffloadingManager``)
decides every store and load; vLLM's ``OffloadingConnector`` in the worker
role (``OffloadingConnectorWorker``) turns its metadata into
``submit_store`` / ``submit_load`` / ``wait`` / ``get_finished`` calls on
kvoffload's worker; vLLM's ``allocate_kv_cache(device="cpu")`` makes the KV
tensors and ``register_kv_caches`` canonicalizes them. The harness plays
only the model runner's part (``kv_connector_model_runner_mixin``'s call
order, ``ModelRunnerOutput``), and "the forward" writes each computed
block's bytes (a function of the tokens up to it), so every byte that
comes back from the offload tier is compared.

What cannot run without a GPU (covered on the H200, issue 21 item 5):
``torch.cuda.CUDAGraph`` / ``torch.cuda.graph`` and vLLM's
``CUDAGraphWrapper`` / ``capture_model`` (the hook's patch of
``torch.cuda.CUDAGraph`` is checked by identity here; the hook itself runs
on a stand-in graph class in test_hook.py), torch CUDA streams and events,
vLLM's GPU model runner and ``Worker`` (the harness drives the connector
as ``kv_connector_model_runner_mixin`` does), and vLLM's own
``CPUOffloadingWorker`` (it asserts CUDA tensors), the baseline of the
start-up comparison.

Where the releases differ (docs/vllm-interfaces.md section 0), the
harness builds what each release's model runner builds (0.26 has no
``allocate_kv_cache`` and places layers with ``KVCacheTensor.shared_by``;
0.34's ``ModelRunnerOutput`` has no ``req_id_to_index``; the connector's
``get_transfer_results`` where it exists), and the tests of a feature a
release lacks (expedited loads before 0.33, device pointers and failed
results before 0.34) say so when they skip.

Run by ci/python with each environment's python (``KVO_SKIP_VLLM=1``
skips); ``KVO_EXPECT_VLLM`` names the release the environment must have.
"""

import dataclasses

import json
import os
import random
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (ci/python runs this file in ci/vllm-env's venv)")

# vLLM 0.26 picks its CPU platform only in a CPU build of vLLM
# (platforms/__init__.py:162-183), not from VLLM_TARGET_DEVICE as 0.27+ do;
# with no GPU it would resolve to UnspecifiedPlatform, whose configs fail
# ("Failed to infer device type"). Set here, before the config classes are
# imported, and only where it resolved to nothing.
import vllm.platforms as _platforms  # noqa: E402

if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" and type(_platforms.current_platform).__name__ == "UnspecifiedPlatform":
    from vllm.platforms.cpu import CpuPlatform  # noqa: E402

    _platforms._current_platform = CpuPlatform()

import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:  # 0.27+: the model runner's allocator and its layouts
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
    from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402
except ImportError:  # 0.26: one tensor per KVCacheTensor, per layer views
    KVCacheLayout = allocate_kv_cache = None

from types import SimpleNamespace as NS  # noqa: E402

import kvoffload as kv  # noqa: E402
import kvoffload._testing as kt  # noqa: E402
import kvoffload.vllm as kvv  # noqa: E402
from kvoffload import _hook  # noqa: E402

RELEASE = kvv.RELEASE
# 0.26's KVCacheTensor(size, shared_by, offset, block_stride); 0.27+ place
# the layers of one tensor with layers / layer_stride.
OLD_KV_TENSORS = "shared_by" in {f.name for f in dataclasses.fields(KVCacheTensor)}

BS = 16  # tokens per GPU block
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
KV_SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float16)
PAGE = KV_SPEC.page_size_bytes  # 2048

init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BS, sha256_cbor)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(
        json.dumps(
            dict(
                architectures=["LlamaForCausalLM"],
                model_type="llama",
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_hidden_layers=2,
                vocab_size=1000,
                max_position_embeddings=4096,
                torch_dtype="float16",
            )
        )
    )
    return str(d)


def extra_config(**kw):
    e = {
        "spec_name": "KvoffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": 64 * 2 * PAGE * 4,
        "kvo_backend": "sim",
        "kvo_pin_threads": 1,
    }
    e.update(kw)
    return {k: v for k, v in e.items() if v is not None}


def vllm_config(model_dir, extra, num_blocks=64, hash_algo=None):
    # vLLM 0.34's CPU platform refuses a config on x86 without triton-cpu
    # ("vLLM on x86 CPUs requires Triton", platforms/cpu.py:242): it would
    # run the model with Triton kernels. No model runs here (only the
    # scheduler and the connector), so the check is told Triton is there
    # while the config is built, and only then.
    import vllm.triton_utils as triton_utils

    had = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        cfg = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=4096),
            cache_config=CacheConfig(
                block_size=BS,
                enable_prefix_caching=True,
                **({} if hash_algo is None else dict(prefix_caching_hash_algo=hash_algo)),
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
            ),
        )
    finally:
        triton_utils.HAS_TRITON = had
    cfg.cache_config.num_gpu_blocks = num_blocks
    return cfg


def kv_tensor(layers, num_blocks, offset=0, size=None):
    """One ``KVCacheTensor`` holding ``layers`` (each ``PAGE`` bytes a
    block) in this release's form."""
    size = size or len(layers) * PAGE * num_blocks
    if OLD_KV_TENSORS:
        return KVCacheTensor(size=size, shared_by=list(layers), offset=offset)
    return KVCacheTensor(
        size=size,
        layers=list(layers),
        layer_stride=PAGE * num_blocks,
        block_stride=PAGE,
        offset=offset,
    )


def kv_cache_config(num_blocks=64):
    tensors = [kv_tensor([l], num_blocks) for l in LAYERS] if OLD_KV_TENSORS else [kv_tensor(LAYERS, num_blocks)]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(LAYERS, KV_SPEC)]
    )


def allocate(kvc):
    """The KV tensors as the release's model runner makes them, on the CPU:
    0.27+ with vLLM's own allocator; 0.26 (no allocator function) one
    backing allocation with a ``(num_blocks, page)`` view per layer, the
    layers one after the other (as the simulated GPU adopts one range)."""
    if allocate_kv_cache is not None:
        return allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC, [BS])
    layers = [l for g in kvc.kv_cache_groups for l in g.layer_names]
    n = kvc.num_blocks
    backing = torch.zeros(len(layers) * n * PAGE, dtype=torch.int8)
    return {l: backing[i * n * PAGE : (i + 1) * n * PAGE].view(n, PAGE) for i, l in enumerate(layers)}


def model_runner_output(**kw):
    """``ModelRunnerOutput`` with the fields this release has (0.34 has no
    ``req_id_to_index``)."""
    names = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    return ModelRunnerOutput(**{k: v for k, v in kw.items() if k in names})


def connector_output(**kw):
    names = {f.name for f in dataclasses.fields(KVConnectorOutput)}
    return KVConnectorOutput(**{k: v for k, v in kw.items() if k in names})


def block_bytes(tokens, layer):
    """The KV 'the model' computes for the block ending at ``tokens``."""
    return random.Random(hash((layer, tuple(tokens)))).randbytes(PAGE)


class Recorder:
    """The worker's offloader, recording what vLLM's calls became: each
    slot job's arguments and each completion."""

    def __init__(self, off):
        self._off = off
        self.jobs = []  # (call, job, gpu_blocks, group_sizes, slots, first_subs)
        self.completions = []
        self.fail_next_load = False  # the next load is reported failed on the GPU
        self.failing = set()

    def __getattr__(self, name):
        return getattr(self._off, name)

    def store_slot_job(self, job, blocks, sizes, slots, subs):
        self.jobs.append(("store", job, list(blocks), list(sizes), list(slots), list(subs)))
        return self._off.store_slot_job(job, blocks, sizes, slots, subs)

    def load_slot_job(self, job, blocks, sizes, slots, subs, expedited=False):
        self.jobs.append(("load", job, list(blocks), list(sizes), list(slots), list(subs)))
        if self.fail_next_load:
            self.fail_next_load = False
            self.failing.add(job)
        return self._off.load_slot_job(job, blocks, sizes, slots, subs, expedited=expedited)

    def poll(self):
        c = [
            NS(job=x.job, direction=x.direction, error=kv.DriverError("copy failed (injected)"), bytes=0, seconds=0.0)
            if x.job in self.failing
            else x
            for x in self._off.poll()
        ]
        self.completions.extend(c)
        return c


class Engine:
    """vLLM's Scheduler and both connector roles in one process, driven the
    way vLLM's engine core and model runner drive them."""

    def __init__(self, model_dir, extra, num_blocks=64, kvc=None, hash_algo=None):
        self.cfg = vllm_config(model_dir, extra, num_blocks, hash_algo)
        self.kvc = kvc or kv_cache_config(num_blocks)
        self.group_of = {l: g for g, grp in enumerate(self.kvc.kv_cache_groups) for l in grp.layer_names}
        self.worker_conn = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kvc)
        self.kv = allocate(self.kvc)
        t0 = time.monotonic()
        self.worker_conn.register_kv_caches(self.kv)  # -> KvoffloadSpec.get_worker
        self.register_seconds = time.monotonic() - t0
        self.kvw = self.worker_conn.connector_worker.worker
        assert isinstance(self.kvw, kvv.KvoffloadWorker)
        self.pin_state_at_return = self.kvw.offloader.pin_progress.state
        self.off = self.kvw.offloader = Recorder(self.kvw.offloader)
        self.expedited = []
        real_load = self.kvw.submit_load

        def submit_load(job_id, src, dst, expedited=False):
            self.expedited.append(expedited)
            return real_load(job_id, src, dst, expedited)

        self.kvw.submit_load = submit_load
        self.results = []
        real = self.kvw.get_finished

        def recording():
            r = real()
            self.results.extend(r)
            return r

        self.kvw.get_finished = recording
        self.sched = Scheduler(self.cfg, self.kvc, StructuredOutputManager(self.cfg), block_size=BS)
        self.written = {}  # req_id -> logical block indices the forward wrote
        self.block_ids = {}  # req_id -> its GPU block ids (the latest seen)
        self.failed_recving = set()  # requests whose load vLLM saw fail
        self.n = 0

    # ---- the model runner's part

    def block(self, b, layer):
        return self.kv[layer][b].view(torch.uint8).reshape(-1)

    def read(self, b, layer):
        return self.block(b, layer).numpy().tobytes()

    def forward(self, so):
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            end = req.num_computed_tokens  # advanced by schedule()
            start = end - n
            groups = self.sched.kv_cache_manager.get_block_ids(req_id)
            self.block_ids[req_id] = [list(b) for b in groups]
            tokens = req.all_token_ids
            for i in range(start // BS, (end - 1) // BS + 1):
                for layer, g in self.group_of.items():
                    self.written.setdefault((req_id, g), set()).add(i)
                    self.write_block(groups[g][i], layer, tokens[: (i + 1) * BS])

    def write_block(self, b, layer, tokens):
        """What the model computes into GPU block ``b`` of ``layer`` for the
        block ending at ``tokens``."""
        data = block_bytes(tokens, layer)
        self.block(b, layer).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def step(self):
        so = self.sched.schedule()
        w = self.worker_conn
        meta = so.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        sync = getattr(so, "has_sync_kv_loads", False)
        if sync:
            w.start_load_kv(None)
        self.forward(so)
        if not sync:
            w.start_load_kv(None)
        self.sched.update_from_output(so, self.worker_output(w, so))
        return so

    def worker_output(self, w, so):
        """Worker connector ``w``'s end of step ``so``, after the model ran
        and its loads started, as vLLM's model runner reports it: its
        transfers finished (failed loads also kept in ``failed_recving``)."""
        w.wait_for_save()
        if hasattr(w, "get_transfer_results"):  # the model runner's call where it exists
            tr = w.get_transfer_results(so.finished_req_ids)
            finished_sending, finished_recving = tr.finished_sending, tr.finished_recving
            failed_recving = getattr(tr, "failed_recving", set())
        else:
            finished_sending, finished_recving = w.get_finished(so.finished_req_ids)
            failed_recving = set()
        self.failed_recving |= set(failed_recving)
        out = connector_output(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            failed_recving=failed_recving,
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        return model_runner_output(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=out,
        )

    def add(self, prompt, max_tokens=2):
        self.n += 1
        req = Request(
            request_id=f"r{self.n}",
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=HASHER,
        )
        self.sched.add_request(req)
        return req

    def run(self, req, limit=50):
        """Steps until ``req`` finished and the offloader is idle and every
        job reported (waits on the offloader, not on time)."""
        for _ in range(limit):
            self.step()
            self.settle()
            if req.is_finished() and not self.sched.has_requests() and self.idle():
                # Two more steps: stores submitted at a step's start are
                # reported by the next one's get_finished.
                for _ in range(2):
                    self.step()
                    self.settle()
                return
        raise AssertionError(f"{req.request_id} did not finish in {limit} steps")

    def settle(self):
        """Time passing between steps: the worker's queued submissions made
        and its jobs completed (waits, never sleeps)."""
        self.kvw._submitter.wait_idle()
        self.kvw.offloader.wait_all()

    def idle(self):
        cw = self.worker_conn.connector_worker
        return (
            not cw._unsubmitted_store_jobs
            and not self.kvw._submitter.pending
            and self.kvw.offloader.in_flight == 0
        )

    def forget_gpu_cache(self):
        assert self.sched.reset_prefix_cache()
        for t in self.kv.values():
            t.zero_()

    def shutdown(self):
        self.worker_conn.shutdown()
        self.sched.shutdown()


def prompt_of(n_tokens, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 999) for _ in range(n_tokens)]


def check_loaded(eng, req, prompt, group=0):
    """Every block of ``req`` in KV cache group ``group`` that its forward
    did not write (so it came from the offload tier; the null block of a
    sliding window's dropped blocks aside) holds, byte for byte, what the
    first request's forward computed for it. Returns those logical block
    indices."""
    blocks = eng.block_ids[req.request_id][group]
    written = eng.written[(req.request_id, group)]
    loaded = sorted(i for i in range(len(prompt) // BS) if i not in written and blocks[i] != 0)
    for i in loaded:
        for layer, g in eng.group_of.items():
            if g == group:
                got = eng.read(blocks[i], layer)
                assert got == block_bytes(prompt[: (i + 1) * BS], layer), f"block {i} of {layer}"
    return loaded


def round_trip(eng, prompt):
    """Stores ``prompt``'s blocks through vLLM's connector, forgets the GPU
    cache (prefix cache reset, every KV byte zeroed), runs the prompt again:
    its hit is loaded from kvoffload. Returns the logical blocks loaded."""
    a = eng.add(prompt)
    eng.run(a)
    assert eng.results, "stores were reported"
    eng.forget_gpu_cache()
    b = eng.add(prompt)
    eng.run(b)
    return check_loaded(eng, b, prompt)


@pytest.fixture
def engines(model_dir):
    made = []

    def make(num_blocks=64, kvc=None, **kw):
        e = Engine(model_dir, extra_config(**kw), num_blocks, kvc)
        made.append(e)
        return e

    yield make
    for e in made:
        if not e.kvw._shut:
            e.shutdown()


# ---------------------------------------------------------------- loading


def test_the_release_under_test_is_the_one_expected():
    want = os.environ.get("KVO_EXPECT_VLLM")
    if want is None:
        pytest.skip("KVO_EXPECT_VLLM is not set (ci/python sets it for each environment)")
    assert vllm.__version__ == want, f"vLLM {vllm.__version__} imported from {vllm.__file__}, {want} expected"
    assert RELEASE.version == want and RELEASE.supported


def test_what_the_release_has_is_detected():
    """Each feature the adapter keys on, as docs/vllm-interfaces.md section 0
    lists it for the releases under test."""
    mm = kvv._releases.parse(vllm.__version__)
    assert RELEASE.manager_size_arg == ("num_blocks" if mm < (0, 30) else "num_chunks")
    assert (RELEASE.offloading_info is not None) == (mm >= (0, 33))
    assert RELEASE.expedited_loads == (mm >= (0, 33))
    assert RELEASE.device_pointers == (mm >= (0, 34))
    assert RELEASE.failed_results == (mm >= (0, 34))


def test_an_unsupported_release_is_refused_at_import_naming_its_version(monkeypatch):
    import importlib
    import sys

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.delenv(kvv._releases.ANY_VERSION_ENV, raising=False)
    saved = sys.modules.pop("kvoffload.vllm")
    try:
        with pytest.raises(ImportError, match=r"supports vLLM 0.26 to 0.34; vLLM 0.35.0 is installed"):
            importlib.import_module("kvoffload.vllm")
    finally:
        sys.modules["kvoffload.vllm"] = saved


def test_vllm_factory_loads_the_spec_by_name_and_module():
    assert OffloadingSpecFactory.get_spec_cls(extra_config()) is kvv.KvoffloadSpec


def test_both_connector_roles_build_from_the_json_config(model_dir):
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    text = json.dumps(
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra_config()}
    )
    cfg = vllm_config(model_dir, json.loads(text)["kv_connector_extra_config"])
    kvc = kv_cache_config()
    sched_side = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kvc)
    assert isinstance(sched_side.connector_scheduler.manager, CPUOffloadingManager)
    worker_side = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    assert isinstance(worker_side.connector_worker.spec, kvv.KvoffloadSpec)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 4])
def test_round_trips_through_vllms_connector_byte_for_byte(engines, blocks_per_chunk):
    eng = engines(blocks_per_chunk=blocks_per_chunk)
    prompt = prompt_of(8 * BS + 5, blocks_per_chunk)
    loaded = round_trip(eng, prompt)
    assert loaded, "the second request's prefix came from the offload tier"
    assert len(loaded) >= 8 - blocks_per_chunk, loaded
    assert all(r.success and r.transfer_time > 0 for r in eng.results)
    assert {r.transfer_size % (len(LAYERS) * PAGE) for r in eng.results} == {0}, "whole pages of both layers"
    off = eng.kvw.offloader
    assert off.block_factor == blocks_per_chunk and isinstance(off._off, kv.Offloader)
    assert {r.job_id for r in eng.results} == {j[1] for j in off.jobs}, "every job reported"
    assert len(eng.results) == len({r.job_id for r in eng.results}), "each once"
    for r, c in zip(sorted(eng.results, key=lambda r: r.job_id), sorted(off.completions, key=lambda c: c.job)):
        # vLLM's stats divide size by time: the job's device time, which
        # the wait for compute and the polling delay are not part of.
        assert c.device_seconds is not None and 0 < c.device_seconds <= c.seconds, c
        assert (r.transfer_size, r.transfer_time) == (c.bytes, c.device_seconds)
    for call, job, blocks, sizes, slots, subs in off.jobs:
        n = sizes[0]
        assert len(slots) == -(-(n + subs[0]) // blocks_per_chunk), "ceil((n + first_sub) / f) chunks"
        assert [r.transfer_size for r in eng.results if r.job_id == job] == [n * len(LAYERS) * PAGE]


def test_a_hit_whose_first_chunk_is_partial(engines):
    """The GPU cache keeps 2 blocks of a prefix whose chunks hold 4: the
    load starts 2 sub-blocks into its first chunk (vLLM's block_indices)."""
    eng = engines(blocks_per_chunk=4)
    prompt = prompt_of(8 * BS + 5, 11)
    a = eng.add(prompt)
    eng.run(a)
    eng.forget_gpu_cache()
    x = eng.add(prompt[: 2 * BS + 3])  # computes blocks 0, 1 on the GPU again (no full chunk to load)
    eng.run(x)
    assert not [j for j in eng.off.jobs if j[0] == "load"], "x loaded nothing"
    b = eng.add(prompt)
    eng.run(b)
    loads = [j for j in eng.off.jobs if j[0] == "load"]
    assert len(loads) == 1 and loads[0][5] == [2], f"one load from sub-block 2: {loads}"
    assert loads[0][3] == [6] and len(loads[0][4]) == 2, "blocks 2..7 from two chunks"
    loaded = check_loaded(eng, b, prompt)
    assert set(range(2, 8)) <= set(loaded)


def test_expedited_loads_are_waited_for_within_the_step(engines):
    if not RELEASE.expedited_loads:
        pytest.skip(f"vLLM {vllm.__version__} has no expedited (sync) loads (0.33+)")
    eng = engines(blocks_per_chunk=2, sync_load_budget_bytes=1 << 30)
    loaded = round_trip(eng, prompt_of(6 * BS + 1, 12))
    assert loaded and True in eng.expedited, "vLLM asked for an expedited (sync) load"
    lanes = {c.lane for c in eng.off.completions if c.direction == "load"}
    assert "load_expedited" in lanes, f"an expedited load ran on the expedited lane: {lanes}"


def test_eviction_reuses_chunk_ids_and_round_trips_stay_right(engines):
    # Room for 4 chunks of 2 blocks: the second prompt's stores evict the first's.
    eng = engines(blocks_per_chunk=2, cpu_bytes_to_use=4 * 2 * len(LAYERS) * PAGE)
    assert eng.kvw.offloader.host_blocks == 4
    first, second = prompt_of(8 * BS + 1, 13), prompt_of(8 * BS + 1, 14)
    eng.run(eng.add(first))
    eng.run(eng.add(second))
    eng.forget_gpu_cache()
    b = eng.add(second)
    eng.run(b)
    loaded = check_loaded(eng, b, second)
    assert loaded, "the second prompt's blocks came back"
    stored_slots = [s for j in eng.off.jobs if j[0] == "store" for s in j[4]]
    assert max(stored_slots) < 4 and len(stored_slots) > len(set(stored_slots)), "chunk ids reused"


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(cpu_bytes_to_use=None), "cpu_bytes_to_use"),
        (dict(cpu_bytes_to_use=0), "cpu_bytes_to_use"),
        (dict(cpu_bytes_to_use="lots"), "cpu_bytes_to_use"),
        (dict(cpu_bytes_to_use=100), "cpu_bytes_to_use"),
        (dict(kvo_pinning="fast"), "kvo_pinning"),
        (dict(kvo_backend="gpu"), "kvo_backend"),
        (dict(kvo_pin_threads=0), "kvo_pin_threads"),
        (dict(kvo_pin_threads=True), "kvo_pin_threads"),
        (dict(kvo_max_chunk_bytes=-1), "kvo_max_chunk_bytes"),
        (dict(kvo_pin_lookahead_bytes=-1), "kvo_pin_lookahead_bytes"),
        (dict(kvo_huge_fallback_mbps="fast"), "kvo_huge_fallback_mbps"),
        (dict(kvo_pin_nice=20), "kvo_pin_nice"),
        (dict(kvo_prefault="maybe"), "kvo_prefault"),
        (dict(kvo_copy_backend="fast"), "kvo_copy_backend"),
        (dict(kvo_capture_hook="yes"), "kvo_capture_hook"),
        (dict(kvo_region="tmp"), "kvo_region"),
        (dict(kvo_region="anonymous", kvo_region_dir="/tmp"), "kvo_region_dir"),
        (dict(eviction_policy="fifo"), "eviction_policy"),
        (dict(store_threshold=-1), "store_threshold"),
    ],
)
@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_bad_extra_config_values_name_their_key(model_dir, kw, key, role):
    cfg = vllm_config(model_dir, extra_config(**kw))
    r = KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER
    with pytest.raises(ValueError, match=rf"kvoffload.vllm: kv_connector_extra_config\['{key}'\]"):
        KVConnectorFactory.create_connector(cfg, r, kv_cache_config())


def test_the_good_config_of_those_cases_builds(model_dir):
    """The baseline the error cases differ from by one key."""
    cfg = vllm_config(model_dir, extra_config(kvo_region="anonymous", store_threshold=2, kvo_capture_hook=False))
    KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())


# ---------------------------------------------------------------- pinning


def test_get_worker_returns_while_pinning_is_held_and_jobs_run_pageable(engines, monkeypatch):
    holds = []

    def runtime(backend):
        assert backend == "sim"
        rt = kv.Runtime("sim")
        holds.append((rt, kt.sim_hold(rt, "register")))
        return rt

    monkeypatch.setattr(kvv, "_runtime_factory", runtime)
    eng = engines(blocks_per_chunk=2)
    rt, hold = holds[0]
    assert eng.pin_state_at_return.name in ("pending", "pinning"), "get_worker returned before pinning settled"
    hold.wait_entered()  # the pinner is inside a registration, held there
    assert eng.kvw.offloader.pin_progress.state == "pinning"
    prompt = prompt_of(6 * BS + 3, 15)
    assert round_trip(eng, prompt), "loads while pinning is held"
    assert eng.kvw.offloader.pin_progress.state == "pinning", "still held: every job above ran on pageable memory"
    assert eng.off.completions and {c.backend for c in eng.off.completions} == {"per-fragment"}
    assert all(c.ok for c in eng.off.completions)
    queued = eng.kvw.jobs_queued
    assert queued == len(eng.off.jobs), "every job before pinning settled went through the submitter thread"
    hold.release()
    assert eng.kvw.wait_pinned().state == "pinned"
    n = len(eng.off.completions)
    eng.forget_gpu_cache()
    b = eng.add(prompt)
    eng.run(b)
    assert check_loaded(eng, b, prompt)
    assert eng.off.completions[n:], "jobs after pinning"
    assert eng.kvw.jobs_queued == queued, "once pinned, the engine's thread submits directly"


# ---------------------------------------------------------------- hook


def test_the_worker_patches_torchs_graph_class_until_shutdown(engines):
    orig_begin = torch.cuda.CUDAGraph.__dict__["capture_begin"]
    orig_end = torch.cuda.CUDAGraph.__dict__["capture_end"]
    eng = engines()
    assert torch.cuda.CUDAGraph.capture_begin.__kvoffload_hook__
    assert torch.cuda.CUDAGraph.capture_end.__wrapped__ is orig_end
    assert _hook.installed_count() == 1
    eng.shutdown()
    assert torch.cuda.CUDAGraph.__dict__["capture_begin"] is orig_begin
    assert torch.cuda.CUDAGraph.__dict__["capture_end"] is orig_end
    assert _hook.installed_count() == 0


def test_kvo_capture_hook_false_leaves_torch_alone(engines):
    orig_begin = torch.cuda.CUDAGraph.__dict__["capture_begin"]
    engines(kvo_capture_hook=False)
    assert torch.cuda.CUDAGraph.__dict__["capture_begin"] is orig_begin


def test_shutdown_releases_everything(engines):
    eng = engines(kvo_region="anonymous")
    rt = eng.kvw.runtime
    assert kt.sim_adopted_ranges(rt) == 1, "vLLM's KV: one backing allocation, adopted once"
    round_trip(eng, prompt_of(4 * BS + 1, 16))
    eng.shutdown()
    assert kt.sim_adopted_ranges(rt) == 0 and kt.sim_registered_ranges(rt) == 0
    eng.kvw.shutdown()  # idempotent


# ---------------------------------------------------------------- layouts kvoffload refuses


def canonical(refs, pages=(PAGE, PAGE), stride=None):
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    storage = torch.zeros(len(pages) * 8 * max(pages), dtype=torch.int8)
    tensors = []
    for i, p in enumerate(pages):
        st = stride or p
        t = torch.tensor([], dtype=torch.int8).set_(storage.untyped_storage(), i * 8 * max(pages), (8, p), (st, 1))
        tensors.append(CanonicalKVCacheTensor(t, p))
    return CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, b) for i, b in g] for g in refs])


def test_the_layout_maps_groups_in_order():
    ts, sizes = kvv._layout(canonical([[(1, PAGE)], [(0, PAGE)]]))
    assert sizes == [1, 1] and [t.page_size_bytes for t in ts] == [PAGE, PAGE]
    c = canonical([[(1, PAGE)], [(0, PAGE)]])
    ts, _ = kvv._layout(c)
    assert ts[0] is c.tensors[1] and ts[1] is c.tensors[0], "tensors in group order"


@pytest.mark.parametrize(
    "caches, words",
    [
        (lambda: canonical([[(0, PAGE)], [(0, PAGE)]]), "referenced by group 0 and group 1"),
        (lambda: canonical([[(0, PAGE - 64)]]), "unpadded pages smaller than the tensor's"),
        (lambda: canonical([[(0, PAGE)]], stride=2 * PAGE), "block stride 4096 bytes"),
        (lambda: canonical([[(0, PAGE)], []]), "a KV cache group references no tensor"),
    ],
)
def test_layouts_kvoffload_cannot_take_are_refused_clearly(caches, words):
    with pytest.raises(kv.OptionsError, match=words):
        kvv._layout(caches())


def test_a_failed_registration_leaves_every_job_right_on_pageable_memory(engines, monkeypatch):
    def runtime(backend):
        rt = kv.Runtime("sim")
        kt.sim_fail_registration(rt, nth=2)  # the second chunk fails: all rolled back
        return rt

    monkeypatch.setattr(kvv, "_runtime_factory", runtime)
    eng = engines(blocks_per_chunk=2, kvo_max_chunk_bytes=16384)
    outcome = eng.kvw.offloader.wait_pinned()
    assert outcome.state == "pageable" and outcome.state.reason == "not_supported", repr(outcome)  # code 801
    assert round_trip(eng, prompt_of(6 * BS + 3, 17))
    assert {c.backend for c in eng.off.completions} == {"per-fragment"}


def test_pinning_keys_reach_the_offloader(engines, monkeypatch):
    import kvoffload._slotworker as sw

    seen = {}
    real = sw.kvoffload.Offloader

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(sw.kvoffload, "Offloader", spy)
    eng = engines(kvo_pin_lookahead_bytes=0, kvo_huge_fallback_mbps=0, kvo_pin_nice=0, kvo_max_chunk_bytes=16384)
    pin = seen["pin"]
    assert {k: getattr(pin, k) for k in ("lookahead_bytes", "huge_fallback_mbps", "prefault_nice", "max_chunk_bytes")} == {
        "lookahead_bytes": 0,
        "huge_fallback_mbps": 0,
        "prefault_nice": 0,
        "max_chunk_bytes": 16384,
    }, seen
    assert pin.policy == "interleave" and seen["transfer"].expedited_lane, seen
    assert eng.kvw.offloader.wait_pinned().state == "pinned"
    assert round_trip(eng, prompt_of(6 * BS + 3, 17))


def test_two_groups_full_attention_and_sliding_window_share_the_slot_pool(engines):
    """A hybrid model: layer 0 full attention, layer 1 a sliding window of
    3 blocks, each group its own tensor; vLLM's one chunk pool serves both
    (a chunk id holds both groups' parts)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    n = 64
    sw = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=3 * BS)
    kvc = KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=[
            kv_tensor([LAYERS[0]], n, size=2 * PAGE * n),
            kv_tensor([LAYERS[1]], n, offset=PAGE * n, size=2 * PAGE * n),
        ],
        kv_cache_groups=[KVCacheGroupSpec([LAYERS[0]], KV_SPEC), KVCacheGroupSpec([LAYERS[1]], sw)],
    )
    eng = engines(blocks_per_chunk=2, kvc=kvc)
    assert eng.kvw.num_groups == 2
    assert kt.sim_adopted_ranges(eng.kvw.runtime) == 1, "both tensors in vLLM's one backing allocation"
    prompt = prompt_of(8 * BS + 5, 18)
    a = eng.add(prompt)
    eng.run(a)
    (store,) = [j for j in eng.off.jobs if j[0] == "store"]
    assert len(store[3]) == 2 and store[3][0] == 8 and 0 < store[3][1] <= 8, f"both groups: {store}"
    if kvv._releases.parse(vllm.__version__) >= (0, 33):
        # 0.33+ store only the sliding window's blocks of that group (0.26
        # stores all of them).
        assert store[3][1] < 8, f"window-limited: {store}"
    eng.forget_gpu_cache()
    b = eng.add(prompt)
    eng.run(b)
    loads = [j for j in eng.off.jobs if j[0] == "load"]
    assert loads and all(len(j[3]) == 2 for j in loads)
    assert loads[0][3][1] > 0, "the sliding window group's blocks were loaded too"
    full, window = check_loaded(eng, b, prompt, 0), check_loaded(eng, b, prompt, 1)
    assert full and window, (full, window)


def test_only_kvoffload_vllm_imports_vllm_and_torch():
    import subprocess
    import sys

    code = (
        "import sys, kvoffload, kvoffload._hook, kvoffload._slotworker, kvoffload._testing\n"
        "bad = [m for m in ('torch', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "import kvoffload.vllm\n"
        "assert 'vllm' in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_flush_stores_blocks_before_vllm_reallocates_them(engines):
    """vLLM's flush (``jobs_to_flush``): a finished request's store is still
    unsubmitted when its freed blocks are handed to the next request; the
    worker connector submits it and ``wait``s in ``handle_preemptions``,
    before the new request's forward overwrites the blocks. The stored
    bytes must be the first request's (checked by loading them back)."""
    eng = engines(num_blocks=12, blocks_per_chunk=2)
    flushed = []
    real = eng.worker_conn.handle_preemptions

    def handle_preemptions(meta):
        if meta.jobs_to_flush:
            flushed.append(set(meta.jobs_to_flush))
        return real(meta)

    eng.worker_conn.handle_preemptions = handle_preemptions
    events = []
    real_wait, real_forward = eng.kvw.wait, eng.forward

    def wait(ids):
        events.append(("wait", set(ids)))
        return real_wait(ids)

    def forward(so):
        events.append(("forward", set(so.num_scheduled_tokens)))
        return real_forward(so)

    eng.kvw.wait, eng.forward = wait, forward
    first, second = prompt_of(8 * BS + 1, 19), prompt_of(8 * BS + 1, 20)
    a = eng.add(first, max_tokens=1)
    for _ in range(20):  # no settling: jobs run only as vLLM's calls make them
        eng.step()
        if a.is_finished():
            break
    assert a.is_finished()
    b = eng.add(second, max_tokens=1)
    eng.run(b)
    assert flushed, "vLLM flushed the first request's store before reusing its blocks"
    job = next(iter(flushed[0]))
    first_b = events.index(("forward", {b.request_id}))
    assert any(e == "wait" and job in ids for e, ids in events[:first_b]), (
        f"no wait for store {job} before its blocks were overwritten: {events}"
    )
    eng.forget_gpu_cache()
    again = eng.add(first)
    eng.run(again)
    assert check_loaded(eng, again, first), "the first request's blocks, as it computed them"


# ---------------------------------------------------------------- 0.34: device pointers, failed results


def test_jobs_arrive_in_the_form_the_release_passes(engines):
    eng = engines(blocks_per_chunk=2)
    seen = []
    real_store, real_load = eng.kvw.submit_store, eng.kvw.submit_load

    def submit_store(job_id, src, dst):
        seen.append(type(src).__name__)
        return real_store(job_id, src, dst)

    def submit_load(job_id, src, dst, expedited=False):
        seen.append(type(dst).__name__)
        return real_load(job_id, src, dst, expedited)

    eng.kvw.submit_store, eng.kvw.submit_load = submit_store, submit_load
    assert round_trip(eng, prompt_of(6 * BS + 3, 21))
    want = "DevicePointers" if RELEASE.device_pointers else "GPULoadStoreSpec"
    assert seen and set(seen) == {want}, seen


def test_a_failed_load_fails_its_request_or_is_raised_as_the_release_allows(engines):
    eng = engines(blocks_per_chunk=2)
    prompt = prompt_of(6 * BS + 3, 22)
    eng.run(eng.add(prompt))
    eng.forget_gpu_cache()
    eng.off.fail_next_load = True
    b = eng.add(prompt)
    if not RELEASE.failed_results:
        # vLLM before 0.34 asserts success: kvoffload raises the driver's
        # error instead, naming the job, rather than reporting it done.
        with pytest.raises(kv.TransferError, match=r"job \d+ \(load\) failed: copy failed \(injected\)"):
            eng.run(b)
        return
    eng.run(b)  # finishes: vLLM recomputes what the failed load was to bring
    assert b.request_id in eng.failed_recving, "vLLM saw the load fail"
    assert [r.success for r in eng.results if r.job_id in eng.off.failing] == [False]
    assert b.is_finished()
    # The engine goes on: the next round trip loads right.
    eng.forget_gpu_cache()
    c = eng.add(prompt)
    eng.run(c)
    assert check_loaded(eng, c, prompt), "loaded from the host after the failure"


# ---------------------------------------------------------------- pinning held over vLLM's warm-up


def test_a_worker_built_in_initialize_from_config_holds_pinning_until_the_warm_up_ends():
    """vLLM 0.26 - 0.33 build the offloading worker in the GPU worker's
    ``initialize_from_config`` and capture the graphs in the
    ``compile_or_warm_up_model`` that follows: the spec finds that worker on
    the call stack, holds pinning back and wraps that instance's warm-up to
    release it (then unwraps it). Built anywhere else, nothing is held."""

    class Worker:  # vLLM's gpu_worker.Worker, as far as the spec looks
        def initialize_from_config(self, build):
            return build()

        def compile_or_warm_up_model(self):
            return "warmed"

    engine = Worker()
    assert engine.initialize_from_config(kvv._engine_worker_before_warmup) is engine
    assert kvv._engine_worker_before_warmup() is None

    class Slot:  # the worker's side: what SlotWorker records
        def __init__(self):
            self.events = []

        def hold_pinning_until_served(self, why):
            self.events.append("hold")

        def release_pin_hold(self, why):
            self.events.append("release")

    slot = Slot()
    kvv._hold_pinning_over_warmup(slot, engine)
    assert slot.events == ["hold"] and "compile_or_warm_up_model" in vars(engine)
    assert engine.compile_or_warm_up_model() == "warmed"
    assert slot.events == ["hold", "release"] and "compile_or_warm_up_model" not in vars(engine)
    assert "kvo_hold_pinning_for_warmup" in kvv.EXTRA_KEYS
