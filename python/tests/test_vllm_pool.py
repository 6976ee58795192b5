"""kvoffload's node pool (``kvo_pool``, docs/node-pool-design.md) inside the
real vLLM (0.26, 0.33, 0.34 from ci/vllm-env's cached environments: ci/python
runs this file once per release, as test_vllm.py), on the simulated GPU.

vLLM's own ``Scheduler`` and ``OffloadingConnector`` (both roles) drive
:class:`kvoffload.vllm.pool.PoolManager` and the pool-aware worker; the
harness is test_vllm.py's (``Engine``: the model runner's part, every
loaded byte compared). Here:

- the ``kvo_pool`` settings and their refusals (design 1.1), and the
  ``NONE_HASH`` rule of the release (design 1.2), against what vLLM's own
  ``init_none_hash`` sets;
- one engine on an in-process pool (``kvoffload._testing.local_pool``):
  round trips byte for byte through vLLM's scheduler, the holds and writes
  the manager keeps (none left once idle), the worker's checks of the slot
  words at submit and its rank bits at completion, the pool's invariants;
- engines on a pool file and its rows' persistent region: one engine's
  round trip and fingerprint parts, another tag refused by field; two
  engines in two processes, the second loading byte for byte what the
  first computed, the first killed mid-load and swept by the second;
- an engine of two ranks on a pool file (:class:`TPEngine`: a worker
  connector per rank in one process, their outputs aggregated by vLLM's
  own ``KVOutputAggregator``, as its executors do): its ranks agree on the
  pin state through their engine entry's words (both pinned; one rank
  failing to pin, both pageable), and every rank's share of every loaded
  block comes back byte for byte.
"""

import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (ci/python runs this file in ci/vllm-env's venv)")

import test_vllm as tv  # noqa: E402  (the harness; sets vLLM's platform up)
from child_lines import ChildLines  # noqa: E402
from test_vllm import BS, Engine, check_loaded, extra_config, kv_cache_config, model_dir, prompt_of  # noqa: E402,F401

import vllm  # noqa: E402
import vllm.v1.core.kv_cache_utils as kcu  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name, sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash  # noqa: E402

import kvoffload as kv  # noqa: E402
import kvoffload._testing as kt  # noqa: E402
import kvoffload.vllm as kvv  # noqa: E402
from kvoffload import _vllm_releases as rel  # noqa: E402
from kvoffload.vllm import pool as kvp  # noqa: E402

MM = rel.parse(vllm.__version__)
HAS_RESOLVE = hasattr(kcu, "resolve_none_hash_seed")


def computable(algo):
    """Whether this environment can compute ``algo`` (vLLM's xxhash needs
    the optional ``xxhash`` module)."""
    try:
        get_hash_fn_by_name(algo)(b"probe")
    except ModuleNotFoundError:
        return False
    return True


@pytest.fixture(autouse=True)
def none_hash_restored():
    """Each test may set PYTHONHASHSEED and init vLLM's NONE_HASH; the
    module's sha256_cbor NONE_HASH (test_vllm's) comes back after."""
    saved = getattr(kcu, "NONE_HASH", None)
    yield
    if saved is not None:
        kcu.NONE_HASH = saved


# ---------------------------------------------------------------- settings (design 1.1)


def settings(**kw):
    return kvv._Settings(extra_config(**kw))


def test_pool_keys_parse_with_their_defaults():
    s = settings(kvo_pool="node")
    assert (s.pool, s.pool_bytes, s.pool_keep, s.pool_tag) == ("node", s.cpu_bytes_to_use, True, "")
    s = settings(kvo_pool="node", kvo_pool_bytes="4096", kvo_pool_keep="true", kvo_pool_tag="rev-7")
    assert (s.pool_bytes, s.pool_keep, s.pool_tag) == (4096, True, "rev-7")
    assert settings(kvo_pool="node", kvo_pool_keep=False).pool_keep is False
    assert settings().pool is None


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(kvo_pool=""), "kvo_pool"),
        (dict(kvo_pool="a/b"), "kvo_pool"),
        (dict(kvo_pool="a\0b"), "kvo_pool"),
        (dict(kvo_pool="n" * 201), "kvo_pool"),
        (dict(kvo_pool=7), "kvo_pool"),
        (dict(kvo_pool="node", kvo_region="anonymous"), "kvo_region"),
        (dict(kvo_pool="node", eviction_policy="arc"), "eviction_policy"),
        (dict(kvo_pool="node", cache_policy_module_path="my.policy"), "cache_policy_module_path"),
        (dict(kvo_pool="node", store_threshold=2), "store_threshold"),
        (dict(kvo_pool="node", kvo_pool_bytes=0), "kvo_pool_bytes"),
        (dict(kvo_pool="node", kvo_pool_keep="maybe"), "kvo_pool_keep"),
        (dict(kvo_pool="node", kvo_pool_tag=3), "kvo_pool_tag"),
        (dict(kvo_pool_bytes=4096), "kvo_pool_bytes"),
        (dict(kvo_pool_tag="x"), "kvo_pool_tag"),
        (dict(kvo_pool_keep=False), "kvo_pool_keep"),
    ],
)
def test_what_a_pool_cannot_take_is_refused_naming_the_key(kw, key):
    with pytest.raises(ValueError, match=rf"kvoffload.vllm: kv_connector_extra_config\['{key}'\]"):
        settings(**kw)


def test_the_longest_pool_name_and_an_explicit_lru_are_taken():
    settings(kvo_pool="n" * 200, eviction_policy="lru", store_threshold=0)


# ---------------------------------------------------------------- NONE_HASH (design 1.2)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_the_predicted_none_hash_is_the_one_vllm_sets(monkeypatch, algo):
    """With PYTHONHASHSEED set, every release derives NONE_HASH from it:
    the prediction is exactly what ``init_none_hash`` sets."""
    if not computable(algo):
        pytest.skip(f"{algo} needs the xxhash module, not installed in this environment")
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    nh = rel.none_hash(algo)
    assert nh.source == "PYTHONHASHSEED" and nh.value is not None
    init_none_hash(get_hash_fn_by_name(algo))
    assert bytes(kcu.NONE_HASH) == nh.value
    assert nh.require("node", vllm.__version__) == nh.value
    assert nh.python == (tuple(__import__("sys").version_info[:2]) if algo in ("sha256", "xxhash") else None)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_the_seed_rule_of_the_release_without_pythonhashseed(monkeypatch, algo):
    """0.33+ (``resolve_none_hash_seed``): sha256* from vLLM's fixed seed,
    xxhash* random; 0.26: random for every algorithm. The detection is by
    attribute; this checks it agrees with the release notes of design 1.2."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert HAS_RESOLVE == (MM >= (0, 33))
    nh = rel.none_hash(algo)
    fixed = HAS_RESOLVE and algo.startswith("sha256")
    if fixed:
        assert nh.source == "vLLM's fixed seed"
        init_none_hash(get_hash_fn_by_name(algo))
        assert bytes(kcu.NONE_HASH) == nh.value
    else:
        assert nh.value is None and nh.source == "random"
        with pytest.raises(rel.RandomNoneHash, match="set PYTHONHASHSEED") as e:
            nh.require("node", vllm.__version__)
        assert isinstance(e.value, ValueError)
        advice = "use prefix_caching_hash_algo 'sha256' or 'sha256_cbor'"
        assert (advice in str(e.value)) == HAS_RESOLVE, "sha256 is the advice only where it is seeded"
        if not computable(algo):
            return
        # What vLLM itself does: two processes' NONE_HASH differ.
        init_none_hash(get_hash_fn_by_name(algo))
        first = bytes(kcu.NONE_HASH)
        init_none_hash(get_hash_fn_by_name(algo))
        assert bytes(kcu.NONE_HASH) != first


# ---------------------------------------------------------------- one engine on an in-process pool


@pytest.fixture
def local_pool(monkeypatch):
    """kvoffload.vllm's pool opener and region replaced for one process:
    an in-process pool (the scheduler's and the workers' Pool objects on
    one set of words) and the engine's own shared region for the rows. A
    second engine in this process would need the pool's kept region."""
    made = {}

    def opener(spec, rank):
        slots, ways = spec.pool_geometry
        if "pool" not in made:
            made["pool"] = p = kt.local_pool(slots, ways=ways, ranks=spec.config.parallel.world_size)
            made["pools"] = [p]
            return p
        p = kt.local_pool_attach(made["pool"])
        made["pools"].append(p)
        return p

    def region(spec):
        cfg = spec.config
        return kv.RegionSpec.shared(f"vllm-{cfg.engine_id}", rank=cfg.parallel.rank, ranks=cfg.parallel.world_size)

    monkeypatch.setattr(kvv, "_pool_opener", opener)
    monkeypatch.setattr(kvv, "_pool_region", region)
    return made


def pool_engine(model_dir, algo="sha256_cbor", **kw):
    eng = Engine(model_dir, extra_config(kvo_pool="test", **kw), hash_algo=algo)
    # EngineCore's order: the scheduler is built, then init_none_hash.
    init_none_hash(get_hash_fn_by_name(algo))
    return eng


@pytest.fixture
def seeded(monkeypatch):
    # 0.26 seeds NONE_HASH from PYTHONHASHSEED only.
    monkeypatch.setenv("PYTHONHASHSEED", "46")


def test_get_manager_returns_the_pool_manager_and_the_worker_joins_the_same_engine(model_dir, local_pool, seeded):
    eng = pool_engine(model_dir)
    try:
        mgr = eng.sched.connector.connector_scheduler.manager
        assert isinstance(mgr, kvp.PoolManager)
        worker_pool, sched_pool = local_pool["pools"]
        assert eng.kvw.pool is worker_pool
        assert worker_pool.engine == sched_pool.engine == mgr.pool.engine
        assert (worker_pool.member, sched_pool.member) == (1, 0)
        assert eng.kvw.offloader.host_blocks == worker_pool.slots
    finally:
        eng.shutdown()


def run_and_reload(eng, prompt):
    a = eng.add(prompt)
    eng.run(a)
    eng.forget_gpu_cache()
    b = eng.add(prompt)
    eng.run(b)
    return check_loaded(eng, b, prompt)


def assert_idle(mgr, st):
    """An idle engine's manager (``st``: its stats): no hold, no write
    left, every store published and readable, the pool's invariants."""
    assert st["held_slots"] == 0 and st["writes"] == 0
    c = st["census"]
    assert c["writing"] == 0 and c["held"] == 0 and c["readable"] == st["stores"]
    mgr.pool.check()


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_round_trips_through_the_pool_byte_for_byte(model_dir, local_pool, seeded, blocks_per_chunk):
    eng = pool_engine(model_dir, blocks_per_chunk=blocks_per_chunk)
    try:
        mgr = eng.sched.connector.connector_scheduler.manager
        prompt = prompt_of(6 * BS + 3, seed=blocks_per_chunk)
        loaded = run_and_reload(eng, prompt)
        assert loaded, "the second request loaded its prefix from the pool"
        st = mgr.stats()
        assert st["stores"] > 0 and st["hits"] > 0 and st["loads"] > 0
        assert st["late_holds"] == 0, "prepare_load named only keys held since this step's lookups (design 3.1)"
        assert_idle(mgr, st)
    finally:
        eng.shutdown()


def test_the_worker_refuses_a_load_of_a_slot_the_engine_does_not_hold(model_dir, local_pool, seeded):
    """The check at submit (design 3.2): a load spec naming a readable
    slot at a stale epoch, or one not held, is a PoolStateError (a failed
    job where the release takes one, raised before)."""
    eng = pool_engine(model_dir)
    try:
        prompt = prompt_of(3 * BS, seed=9)
        a = eng.add(prompt)
        eng.run(a)
        mgr = eng.sched.connector.connector_scheduler.manager
        w = eng.kvw
        slot = next(s for s in range(mgr.pool.slots) if (mgr.pool.slot_word(s) >> 32) & 3 == 2)
        epoch = mgr.pool.slot_word(slot) >> 39
        gpu = NSpec(block_ids=[1], group_sizes=[1], block_indices=[0])
        for bad in (kvp.PoolLoadStoreSpec([slot], [epoch]), kvp.PoolLoadStoreSpec([slot], [epoch + 1])):
            if w.failed_results:
                w.submit_load(900, bad, gpu)
                (r,) = [r for r in w.get_finished() if r.job_id == 900]
                assert not r.success
            else:
                with pytest.raises(kv.PoolStateError):
                    w.submit_load(900, bad, gpu)
        # Held by this engine at its epoch: accepted.
        assert mgr.pool.lookup([mgr.pool.slot_key(slot)])[0][:3] == ("hit", slot, epoch)
        w.pool.check_held([slot], [epoch])
        mgr.pool.release([slot], [epoch])
    finally:
        eng.shutdown()


class NSpec:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_a_random_none_hash_is_refused_when_the_scheduler_is_built(model_dir, local_pool, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    algo = "sha256_cbor" if not HAS_RESOLVE else "xxhash_cbor"
    cfg = tv.vllm_config(model_dir, extra_config(kvo_pool="test"), hash_algo=algo)
    with pytest.raises(rel.RandomNoneHash, match="PYTHONHASHSEED"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_a_none_hash_other_than_predicted_is_refused_at_the_first_lookup(model_dir, local_pool, seeded):
    eng = pool_engine(model_dir)
    try:
        init_none_hash(sha256_cbor)  # seeded the same: equal
        kcu.NONE_HASH = kcu.BlockHash(bytes(32))  # an engine that seeded otherwise
        a = eng.add(prompt_of(4 * BS, seed=3))
        with pytest.raises(rel.RandomNoneHash, match="not the one predicted"):
            eng.step()
        del a
    finally:
        eng.shutdown()


# ---------------------------------------------------------------- engines on a pool file


def stable_block_bytes(tokens, layer):
    """test_vllm's ``block_bytes`` without Python's ``hash`` (randomized per
    process): engines in two processes compute the same KV for the same
    tokens, as the same model would."""
    import hashlib
    import random

    seed = hashlib.sha256(repr((layer, tuple(tokens))).encode()).digest()
    return random.Random(seed).randbytes(tv.PAGE)


@pytest.fixture
def pool_name(monkeypatch):
    """A pool file and its rows' persistent region (``pool-<name>``), both
    removed after the test (``Pool.remove``: ``kvoffload pool rm``)."""
    monkeypatch.setattr(tv, "block_bytes", stable_block_bytes)
    name = f"test-vllm-{os.getpid()}-{os.urandom(4).hex()}"
    yield name
    try:
        kv.Pool.remove(name, force=True)
    except kv.PoolError:
        pass


def test_one_engine_on_a_pool_file_round_trips_and_fills_the_fingerprint(model_dir, pool_name, seeded):
    eng = Engine(model_dir, extra_config(kvo_pool=pool_name), hash_algo="sha256_cbor")
    init_none_hash(sha256_cbor)
    try:
        mgr = eng.sched.connector.connector_scheduler.manager
        assert mgr.pool.path == f"/dev/shm/kvoffload-pool-{pool_name}.index"
        assert eng.kvw.pool.path == mgr.pool.path and eng.kvw.pool.engine == mgr.pool.engine
        prompt = prompt_of(5 * BS, seed=11)
        assert run_and_reload(eng, prompt)
        assert mgr.stats()["late_holds"] == 0
        # The parts the scheduler and the worker filled: another engine of
        # another hash seed, or another layout, is refused by field.
        with pytest.raises(kv.PoolMismatchError) as e:
            mgr.pool.ensure_hashing("sha256_cbor", bytes(32))
        assert e.value.field == "NONE_HASH"
        with pytest.raises(kv.PoolMismatchError) as e:
            eng.kvw.pool.ensure_layout(0, [tv.PAGE])
        assert e.value.field == "rank 0 tensor count"
    finally:
        eng.shutdown()


def test_an_engine_of_a_pool_not_kept_removes_it_when_it_leaves_and_the_next_makes_a_fresh_one(
    model_dir, pool_name, seeded
):
    """``kvo_pool_keep: false``: the engine's shutdown (scheduler and
    worker leave; the last removes it) removes the pool's index and rows;
    the next engine on the name makes a fresh pool (a miss, then its own
    store round-trips)."""
    index = f"/dev/shm/kvoffload-pool-{pool_name}.index"
    rows = f"/dev/shm/kvoffload-pool-{pool_name}"
    eng = Engine(model_dir, extra_config(kvo_pool=pool_name, kvo_pool_keep=False), hash_algo="sha256_cbor")
    init_none_hash(sha256_cbor)
    try:
        prompt = prompt_of(5 * BS, seed=12)
        assert run_and_reload(eng, prompt)
        assert os.path.exists(index) and os.path.exists(rows)
    finally:
        eng.shutdown()
    assert not os.path.exists(index) and not os.path.exists(rows), os.listdir("/dev/shm")
    eng = Engine(model_dir, extra_config(kvo_pool=pool_name), hash_algo="sha256_cbor")
    try:
        mgr = eng.sched.connector.connector_scheduler.manager
        assert mgr.pool.census()["readable"] == 0, "a fresh pool"
        assert run_and_reload(eng, prompt)
    finally:
        eng.shutdown()
    assert os.path.exists(index), "kept (the default)"


def test_an_engine_of_another_tag_is_refused_by_the_pool_file(model_dir, pool_name, seeded):
    eng = Engine(model_dir, extra_config(kvo_pool=pool_name), hash_algo="sha256_cbor")
    eng.shutdown()
    other = extra_config(kvo_pool=pool_name, kvo_pool_tag="fine-tune-2")
    cfg = tv.vllm_config(model_dir, other, hash_algo="sha256_cbor")
    kvc = kv_cache_config()
    conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    with pytest.raises(kv.PoolMismatchError) as e:
        conn.register_kv_caches(tv.allocate(kvc))  # -> get_worker opens the pool
    assert (e.value.field, e.value.pool_value, e.value.engine_value) == ("kvo_pool_tag", "", "fine-tune-2")


CHILD_ENGINE = """
import os, sys
sys.path.insert(0, {tests!r})
import test_vllm_pool as tp
tp.tv.block_bytes = tp.stable_block_bytes
eng = tp.Engine({model_dir!r}, tp.extra_config(kvo_pool={name!r}), hash_algo="sha256_cbor")
tp.init_none_hash(tp.sha256_cbor)
mgr = eng.sched.connector.connector_scheduler.manager
prompt = tp.prompt_of({tokens}, seed={seed})
a = eng.add(prompt)
eng.run(a)
print("KVO-TEST stored", mgr.pool.engine, mgr.stats()["stores"], flush=True)
sys.stdin.readline()
# Mid-load: the same prompt again, its prefix on the host; the scheduler
# looks it up and prepares its load (holds taken), the workers never run.
eng.forget_gpu_cache()
eng.add(prompt)
eng.sched.schedule()
print("KVO-TEST loading", mgr.stats()["held_slots"], flush=True)
sys.stdin.readline()
"""


def test_a_second_engine_process_loads_what_the_first_computed_and_sweeps_it_killed_mid_load(
    model_dir, pool_name, seeded
):
    """Two engines in two processes on one pool (its index file and its
    rows' persistent region), each vLLM's real scheduler and connector on
    the simulated GPU: the second loads, byte for byte, the prefix the
    first computed (the same block hashes: NONE_HASH from PYTHONHASHSEED
    on 0.26, vLLM's fixed seed on 0.33+); the first, killed while it holds
    blocks for a load, is swept by the second: its holds gone, its
    published blocks kept and still loaded right, and the second's own
    round trips right."""
    import signal
    import subprocess
    import sys
    import tempfile

    tokens = 6 * BS
    script = CHILD_ENGINE.format(
        tests=os.path.dirname(os.path.abspath(__file__)), model_dir=model_dir, name=pool_name, tokens=tokens, seed=21
    )
    # Its log to a file: a pipe nobody reads while it runs could fill up.
    log_file = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True
    )

    def log_tail():
        log_file.seek(0)
        return log_file.read()[-4000:]

    lines = ChildLines(child.stdout)

    def expect(word, timeout=120.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.next(deadline)
            except TimeoutError:
                child.kill()
                raise AssertionError(f"no {word!r} from the child engine in {timeout} s: {log_tail()}") from None
            if line is None:
                child.wait(timeout=10)
                raise AssertionError(f"the child engine exited ({child.returncode}): {log_tail()}")
            if not line.startswith("KVO-TEST "):
                continue  # vLLM's own log lines (0.26 logs to stdout)
            got, *rest = line.split()[1:]
            assert got == word, line
            return [int(x) for x in rest]

    try:
        first, stored = expect("stored")
        assert stored > 0
        prompt = prompt_of(tokens, seed=21)
        eng = Engine(model_dir, extra_config(kvo_pool=pool_name), hash_algo="sha256_cbor")
        init_none_hash(sha256_cbor)
        try:
            mgr = eng.sched.connector.connector_scheduler.manager
            assert mgr.pool.engine != first
            # The first engine's prefix, from the pool into this engine's GPU.
            b = eng.add(prompt)
            eng.run(b)
            loaded = check_loaded(eng, b, prompt)
            assert len(loaded) >= tokens // BS - 1, (loaded, mgr.stats())
            assert mgr.counters["hits"] >= len(loaded) and mgr.counters["late_holds"] == 0

            # The first engine, mid-load, holds its blocks: nothing of it is
            # swept while it lives; killed, all of it is.
            child.stdin.write("go\n")
            child.stdin.flush()
            (held,) = expect("loading")
            assert held > 0
            assert mgr.pool.census()["held"] == held
            assert mgr.sweep() == [], "nothing swept while it lives"
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            assert mgr.sweep() == [first]
            c = mgr.pool.census()
            assert c["held"] == 0 and c["writing"] == 0
            assert c["readable"] >= stored, "the dead engine's published blocks stay"
            # Still loaded right, and this engine's own blocks too.
            eng.forget_gpu_cache()
            again = eng.add(prompt)
            eng.run(again)
            assert len(check_loaded(eng, again, prompt)) >= len(loaded)
            eng.forget_gpu_cache()
            assert run_and_reload(eng, prompt_of(4 * BS, seed=22))
            mgr.pool.check()
        finally:
            eng.shutdown()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        for f in (child.stdin, child.stdout, log_file):
            f.close()


# ---------------------------------------------------------------- an engine of two ranks on a pool file


def rank_bytes(tokens, layer, rank):
    """What rank ``rank``'s share of the model computes for the block ending
    at ``tokens`` (each rank its own bytes, as tensor-parallel shards are)."""
    return tv.block_bytes(tokens, (layer, rank))


class TPEngine(Engine):
    """An engine of ``ranks`` tensor-parallel ranks in one process: vLLM's
    ``Scheduler`` and one worker connector per rank (its own KV tensors and
    ``KvoffloadWorker``, built from the config that rank's process has:
    ``parallel_config.rank``), rank 0's first (it makes the pool's entry, the
    other ranks join it). Each step binds the scheduler's metadata to every
    worker, as the executor broadcasts it, and hands the scheduler what
    vLLM's ``KVOutputAggregator`` makes of the workers' outputs (a transfer
    is finished once every rank reported it)."""

    def __init__(self, model_dir, extra, ranks=2, num_blocks=64, hash_algo=None):
        self.cfg = tv.vllm_config(model_dir, extra, num_blocks, hash_algo)
        par = self.cfg.parallel_config
        par.tensor_parallel_size = par.world_size = ranks
        self.kvc = kv_cache_config(num_blocks)
        self.group_of = {l: g for g, grp in enumerate(self.kvc.kv_cache_groups) for l in grp.layer_names}
        self.conns, self.kvs = [], []
        try:
            for r in range(ranks):
                par.rank = r
                conn = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kvc)
                self.conns.append(conn)
                self.kvs.append(tv.allocate(self.kvc))
                conn.register_kv_caches(self.kvs[-1])  # -> KvoffloadSpec.get_worker
        except BaseException:
            for c in self.conns:
                c.shutdown()
            raise
        finally:
            par.rank = 0
        self.workers = [c.connector_worker.worker for c in self.conns]
        self.aggregator = KVOutputAggregator.from_connector(self.conns[0], ranks)
        self.sched = tv.Scheduler(self.cfg, self.kvc, tv.StructuredOutputManager(self.cfg), block_size=BS)
        self.written, self.block_ids, self.failed_recving, self.n = {}, {}, set(), 0

    def write_block(self, b, layer, tokens):
        # Every rank's share of the block, each into its own KV tensors.
        for r, kvt in enumerate(self.kvs):
            data = bytearray(rank_bytes(tokens, layer, r))
            kvt[layer][b].view(tv.torch.uint8).reshape(-1).copy_(tv.torch.frombuffer(data, dtype=tv.torch.uint8))

    def step(self):
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        for w in self.conns:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
        sync = getattr(so, "has_sync_kv_loads", False)
        if sync:
            for w in self.conns:
                w.start_load_kv(None)
        self.forward(so)
        outputs = []
        for w in self.conns:
            if not sync:
                w.start_load_kv(None)
            outputs.append(self.worker_output(w, so))
        self.sched.update_from_output(so, self.aggregator.aggregate(outputs))
        return so

    def settle(self):
        for w in self.workers:
            w._submitter.wait_idle()
            w.offloader.wait_all()

    def idle(self):
        return all(
            not c.connector_worker._unsubmitted_store_jobs and not w._submitter.pending and w.offloader.in_flight == 0
            for c, w in zip(self.conns, self.workers)
        )

    def forget_gpu_cache(self):
        assert self.sched.reset_prefix_cache()
        for kvt in self.kvs:
            for t in kvt.values():
                t.zero_()

    def shutdown(self):
        for c in self.conns:
            c.shutdown()
        self.sched.shutdown()


def check_loaded_on_every_rank(eng, req, prompt, group=0):
    """``check_loaded`` for every rank: each rank's blocks of ``req`` its
    forward did not write hold that rank's bytes. The blocks checked."""
    blocks = eng.block_ids[req.request_id][group]
    written = eng.written[(req.request_id, group)]
    loaded = sorted(i for i in range(len(prompt) // BS) if i not in written and blocks[i] != 0)
    for r, kvt in enumerate(eng.kvs):
        for i in loaded:
            for layer, g in eng.group_of.items():
                if g == group:
                    got = kvt[layer][blocks[i]].view(tv.torch.uint8).reshape(-1).numpy().tobytes()
                    assert got == rank_bytes(prompt[: (i + 1) * BS], layer, r), f"rank {r}, block {i} of {layer}"
    return loaded


@pytest.mark.parametrize("rank1_pins", [True, False])
def test_an_engine_of_two_ranks_on_a_pool_file_agrees_and_round_trips_byte_for_byte(
    model_dir, pool_name, seeded, monkeypatch, rank1_pins
):
    """Both ranks pinned (or, rank 1's registration failing, both pageable:
    one mode for the engine, P7), agreed through the engine entry's words
    (the rows' persistent region has no rank words); every rank's share of
    the prefix stored and loaded back byte for byte, its slots published
    by the last rank's bit and nothing left held or being written."""
    runtimes = []

    def runtime(backend):
        rt = kv.Runtime(backend)
        if len(runtimes) == 1 and not rank1_pins:
            kt.sim_fail_registration(rt, nth=1, code=801)
        runtimes.append(rt)
        return rt

    monkeypatch.setattr(kvv, "_runtime_factory", runtime)
    eng = TPEngine(model_dir, extra_config(kvo_pool=pool_name), hash_algo="sha256_cbor")
    init_none_hash(sha256_cbor)
    try:
        mgr = eng.sched.connector.connector_scheduler.manager
        pools = [w.pool for w in eng.workers]
        assert [p.member for p in pools] == [1, 2] and {p.engine for p in pools} == {mgr.pool.engine}
        assert pools[0].ranks == 2 and [w.pool_rank for w in eng.workers] == [0, 1]
        outcomes = [w.offloader.wait_pinned() for w in eng.workers]
        want = [("pinned", None), ("pinned", None)] if rank1_pins else [
            ("pageable", "peer_pageable"),
            ("pageable", "not_supported"),
        ]
        assert [(o.state.name, o.state.reason) for o in outcomes] == want, outcomes
        assert [o.agreed for o in outcomes] == [True, True]
        prompt = prompt_of(6 * BS + 5, seed=31)
        a = eng.add(prompt)
        eng.run(a)
        eng.forget_gpu_cache()
        b = eng.add(prompt)
        eng.run(b)
        loaded = check_loaded_on_every_rank(eng, b, prompt)
        assert loaded, "the second request loaded its prefix from the pool"
        st = mgr.stats()
        assert st["stores"] > 0 and st["hits"] > 0 and st["loads"] > 0 and st["stores_abandoned"] == 0
        assert_idle(mgr, st)
    finally:
        eng.shutdown()
