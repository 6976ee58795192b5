"""kvoffload inside vLLM (0.26 to 0.34): an out-of-tree offloading spec.

vLLM loads it by name from its ``--kv-transfer-config``::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "KvoffloadSpec",
                                   "spec_module_path": "kvoffload.vllm",
                                   "cpu_bytes_to_use": 68719476736}}

The scheduler side is vLLM's own ``CPUOffloadingManager`` (lookup, prepare
and complete store/load, touch, events, eviction, its policies), which
hands out chunk ids; the worker side is :class:`KvoffloadWorker`, a
slot-addressed :class:`kvoffload.Offloader` whose host slots are those
chunk ids. The worker starts pinning its host region in the background and
returns from ``get_worker`` at once; until pinning settles, jobs run on
pageable memory (the engine only offers the fast copy backends for memory
that is registered), so they never fail.

This is the only module of the package that imports vLLM (and with it
torch): ``import kvoffload`` stays free of both. The design is
``docs/vllm-spec-design.md``; the vLLM facts it rests on are in
``docs/vllm-interfaces.md``. What differs between the releases is decided
in one place, :mod:`kvoffload._vllm_releases`; importing this module in a
release outside 0.26 - 0.34 raises ``ImportError`` naming the version.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import sys
from typing import Any, Callable, Dict, Optional, Tuple

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

import kvoffload
from kvoffload import _slotworker
from kvoffload import _vllm_releases as _releases

__all__ = ["KvoffloadSpec", "KvoffloadWorker", "EXTRA_KEYS", "RELEASE"]

log = logging.getLogger("kvoffload.vllm")

#: What the installed vLLM has (:class:`kvoffload._vllm_releases.Release`);
#: an unsupported release raised ``ImportError`` above.
RELEASE: _releases.Release = _releases.detect()
if not RELEASE.supported:
    log.warning(
        "kvoffload.vllm: vLLM %s is outside the supported releases (%s); loaded because %s=1",
        RELEASE.version,
        _releases.supported_text(),
        _releases.ANY_VERSION_ENV,
    )

#: The ``kv_connector_extra_config`` keys kvoffload adds, with what each
#: accepts (all optional). vLLM's own keys (``spec_name``,
#: ``spec_module_path``, ``blocks_per_chunk``, ``block_size``,
#: ``offload_prompt_only``, ``sync_load_budget_bytes``,
#: ``self_describing_kv_events``) and the CPU manager's (``cpu_bytes_to_use``,
#: ``eviction_policy``, ``cache_policy_module_path``, ``store_threshold``,
#: ``max_tracker_size``) keep their vLLM meaning.
EXTRA_KEYS: Dict[str, str] = {
    "kvo_backend": "'auto' (CUDA where a device is visible), 'cuda' or 'sim' (the simulated GPU, for tests)",
    "kvo_region": "'shared' (one /dev/shm file per engine, each rank pins its own share) or 'anonymous'",
    "kvo_region_dir": "directory of the shared region's file (default /dev/shm)",
    "kvo_pin_threads": "pre-fault threads, a positive int",
    "kvo_max_chunk_bytes": "bytes per host registration call, a positive int",
    "kvo_prefault": "'populate', 'touch' or 'off'",
    "kvo_huge_pages": "'auto', 'on' or 'off'",
    "kvo_pin_lookahead_bytes": "bytes pre-faulted ahead of the chunk being registered, an int >= 0 (default: all)",
    "kvo_huge_fallback_mbps": "4 KiB pages once huge pages fault below this MB/s per thread with the kernel "
    "stalling, an int >= 0 (default 1000, 0: never)",
    "kvo_pin_nice": "niceness of the pre-fault threads, an int 0 - 19 (default 10: they yield cores to the engine)",
    "kvo_copy_backend": "'auto' (the only choice that is right before pinning settles), "
    "'per-fragment', 'batched', 'gather' or 'staged'",
    "kvo_staging_bytes": "device staging bytes per direction, an int >= 0",
    "kvo_capture_hook": "true (default): every CUDA graph capture in the worker's process runs in a capture window",
    "kvo_hold_pinning_for_warmup": "true (default): where vLLM builds the worker before its warm-up and graph "
    "capture (0.26 - 0.33), no registration starts until they end (or the first job)",
    "kvo_pool": "the node pool's name (docs/node-pool-design.md): every engine naming it shares one host KV "
    "pool in kvo_region_dir; non-empty, at most 200 bytes, no '/' or NUL",
    "kvo_pool_bytes": "bytes of a pool this engine creates, a positive int (default cpu_bytes_to_use); an existing "
    "pool keeps its size",
    "kvo_pool_keep": "true (default): the pool stays until 'kvoffload pool rm'; false: an engine that leaves it "
    "removes it if no other engine is registered on it (the last to leave)",
    "kvo_pool_tag": "a string every engine on the pool must give alike (default ''): what the fingerprint cannot "
    "see, such as a checkpoint revision",
}

#: The keys that apply only with ``kvo_pool``.
POOL_KEYS = ("kvo_pool_bytes", "kvo_pool_keep", "kvo_pool_tag")
#: A pool name's longest (the files are ``kvoffload-pool-<name>*``).
POOL_NAME_BYTES = 200

_CHOICES = {
    "kvo_backend": ("auto", "cuda", "sim"),
    "kvo_region": ("shared", "anonymous"),
    "kvo_prefault": ("populate", "touch", "off"),
    "kvo_huge_pages": ("auto", "on", "off"),
    "kvo_copy_backend": ("auto", "per-fragment", "batched", "gather", "staged"),
    "eviction_policy": ("lru", "arc"),
}

# Tests only: a callable returning the Runtime a worker runs on (so a test
# can arm the simulated GPU's hold points before pinning starts). Not API.
_runtime_factory: Optional[Callable[[str], "kvoffload.Runtime"]] = None

# Tests only: a callable ``(spec, rank)`` returning the (unjoined)
# kvoffload.Pool a process of the engine uses (rank None: the scheduler),
# and one ``(spec)`` returning the RegionSpec of the pool's rows. Not API.
_pool_opener: Optional[Callable[["KvoffloadSpec", Optional[int]], "kvoffload.Pool"]] = None
_pool_region: Optional[Callable[["KvoffloadSpec"], "kvoffload.RegionSpec"]] = None

#: Slots per set of a pool this engine creates (design 2.3).
POOL_WAYS = 16
#: Seconds a scheduler or a rank's worker waits for its engine's entry
#: (rank 0's worker makes it, before them in every supported release).
POOL_JOIN_TIMEOUT_S = 60.0
# Opens of a pool found being removed before the join gives up (each waits
# for the removal, bounded by POOL_JOIN_TIMEOUT_S).
POOL_OPEN_ATTEMPTS = 3


def _bad(key: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"kvoffload.vllm: kv_connector_extra_config[{key!r}] = {value!r}: {accepted}")


def _int(extra: Dict[str, Any], key: str, default: Optional[int], minimum: int) -> Optional[int]:
    if key not in extra or extra[key] is None:
        return default
    v = extra[key]
    if isinstance(v, bool):
        raise _bad(key, v, f"expected an int >= {minimum}")
    if isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            raise _bad(key, extra[key], f"expected an int >= {minimum}") from None
    elif isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int):
        raise _bad(key, extra[key], f"expected an int >= {minimum}")
    if v < minimum:
        raise _bad(key, extra[key], f"expected an int >= {minimum}")
    return v


def _choice(extra: Dict[str, Any], key: str, default: str) -> str:
    v = extra.get(key, default)
    if v not in _CHOICES[key]:
        raise _bad(key, v, "expected one of " + ", ".join(repr(c) for c in _CHOICES[key]))
    return v


def _bool(extra: Dict[str, Any], key: str, default: bool) -> bool:
    v = extra.get(key, default)
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise _bad(key, v, "expected true or false")


class _Settings:
    """``kv_connector_extra_config``, checked (the same in every process)."""

    def __init__(self, extra: Dict[str, Any]):
        unknown = sorted(k for k in extra if k.startswith("kvo_") and k not in EXTRA_KEYS)
        if unknown:
            raise _bad(unknown[0], extra[unknown[0]], "not a kvoffload key; the keys are " + ", ".join(EXTRA_KEYS))
        if "cpu_bytes_to_use" not in extra:
            raise ValueError(
                "kvoffload.vllm: kv_connector_extra_config['cpu_bytes_to_use'] is missing: "
                "the host bytes to offload to (all ranks of the engine together), a positive int"
            )
        self.cpu_bytes_to_use = _int(extra, "cpu_bytes_to_use", None, 1)
        if _bool(extra, "canonical_layout", False):
            raise _bad("canonical_layout", extra["canonical_layout"], "not supported by kvoffload (use false)")
        self.cache_policy_module_path = extra.get("cache_policy_module_path")
        if self.cache_policy_module_path is None:
            self.eviction_policy = _choice(extra, "eviction_policy", "lru")
        else:
            self.eviction_policy = extra.get("eviction_policy", "lru")
        self.store_threshold = _int(extra, "store_threshold", 0, 0)
        self.max_tracker_size = _int(extra, "max_tracker_size", 64_000, 1)
        self.backend = _choice(extra, "kvo_backend", "auto")
        self.region = _choice(extra, "kvo_region", "shared")
        self.region_dir = extra.get("kvo_region_dir")
        if self.region_dir is not None and not isinstance(self.region_dir, str):
            raise _bad("kvo_region_dir", self.region_dir, "expected a directory path (a string)")
        if self.region_dir is not None and self.region != "shared":
            raise _bad("kvo_region_dir", self.region_dir, "applies to kvo_region 'shared' only")
        self.pin_threads = _int(extra, "kvo_pin_threads", None, 1)
        self.max_chunk_bytes = _int(extra, "kvo_max_chunk_bytes", None, 1)
        self.prefault = _choice(extra, "kvo_prefault", "populate")
        self.huge_pages = _choice(extra, "kvo_huge_pages", "auto")
        self.pin_lookahead_bytes = _int(extra, "kvo_pin_lookahead_bytes", None, 0)
        self.huge_fallback_mbps = _int(extra, "kvo_huge_fallback_mbps", None, 0)
        self.pin_nice = _int(extra, "kvo_pin_nice", None, 0)
        if self.pin_nice is not None and self.pin_nice > 19:
            raise _bad("kvo_pin_nice", extra["kvo_pin_nice"], "expected an int from 0 to 19")
        self.copy_backend = _choice(extra, "kvo_copy_backend", "auto")
        self.staging_bytes = _int(extra, "kvo_staging_bytes", None, 0)
        self.capture_hook = _bool(extra, "kvo_capture_hook", True)
        self.hold_pinning_for_warmup = _bool(extra, "kvo_hold_pinning_for_warmup", True)
        self._pool_settings(extra)
        if self.copy_backend != "auto":
            log.warning(
                "kvoffload.vllm: kvo_copy_backend=%r is for benchmarks: before pinning settles (or if it ends "
                "pageable) only 'auto' is guaranteed to pick a backend that is right on pageable memory",
                self.copy_backend,
            )


    def _pool_settings(self, extra: Dict[str, Any]) -> None:
        """``kvo_pool`` and its keys (design 1.1), with what the pool
        cannot take refused by key."""
        self.pool: Optional[str] = extra.get("kvo_pool")
        if self.pool is None:
            given = [k for k in POOL_KEYS if extra.get(k) is not None]
            if given:
                raise _bad(given[0], extra[given[0]], "applies with kvo_pool only (set kvo_pool to name the pool)")
            self.pool_bytes = None
            self.pool_keep = True
            self.pool_tag = ""
            return
        name = self.pool
        if not isinstance(name, str) or not name:
            raise _bad("kvo_pool", name, "expected a pool name (a non-empty string)")
        if "/" in name or "\0" in name or len(name.encode()) > POOL_NAME_BYTES:
            raise _bad(
                "kvo_pool", name, f"a pool name has at most {POOL_NAME_BYTES} bytes and no '/' or NUL (it names files)"
            )
        self.pool_bytes = _int(extra, "kvo_pool_bytes", self.cpu_bytes_to_use, 1)
        # False: the last engine to leave removes the pool (src/pool/closing.rs).
        self.pool_keep = _bool(extra, "kvo_pool_keep", True)
        tag = extra.get("kvo_pool_tag", "")
        if tag is None:
            tag = ""
        if not isinstance(tag, str):
            raise _bad("kvo_pool_tag", tag, "expected a string")
        self.pool_tag = tag
        # What the pool cannot take (design 1.1): its memory is shared, its
        # eviction is CLOCK in shared memory.
        if self.region != "shared":
            raise _bad("kvo_region", self.region, "kvo_pool needs kvo_region 'shared' (the pool is a shared file)")
        if extra.get("eviction_policy", "lru") != "lru":
            raise _bad(
                "eviction_policy",
                extra["eviction_policy"],
                "kvo_pool evicts by CLOCK in shared memory; an in-process policy cannot see the other engines "
                "(leave it unset or 'lru')",
            )
        if self.cache_policy_module_path is not None:
            raise _bad(
                "cache_policy_module_path",
                self.cache_policy_module_path,
                "kvo_pool evicts by CLOCK in shared memory; a custom policy cannot see the other engines",
            )
        if self.store_threshold:
            raise _bad(
                "store_threshold", self.store_threshold, "kvo_pool stores on first sight (a threshold counts per engine)"
            )


class KvoffloadSpec(OffloadingSpec):
    """vLLM's offloading spec for kvoffload (``spec_name: KvoffloadSpec``,
    ``spec_module_path: kvoffload.vllm``). Built in the scheduler and in
    every worker: ``__init__`` only checks the config and sizes the tier."""

    @classmethod
    def build_metric_definitions(cls, extra_config: Dict[str, Any]) -> Dict[str, OffloadingMetricMetadata]:
        # The manager is vLLM's CPU manager: its metrics.
        return CPUOffloadingSpec.build_metric_definitions(extra_config)

    @classmethod
    def config_info_keys(cls, extra_config: Dict[str, Any]) -> tuple:
        # vLLM 0.33+ asks for the labels of its config-info metric; earlier
        # releases have neither the metric nor this method.
        keys = getattr(CPUOffloadingSpec, "config_info_keys", None)
        return keys(extra_config) if keys is not None else ()

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.settings = _Settings(self.extra_config)
        world = config.parallel.world_size
        self.num_chunks = 0
        self.kv_bytes_per_chunk = 0
        if config.worker_kv_bytes_per_block > 0 and world > 0:
            # vLLM's CPU spec's sizing, so that the scheduler and every
            # worker get the same number of chunks from the config alone.
            row = config.worker_kv_bytes_per_block * world * self.blocks_per_chunk
            row = -(-row // mmap.PAGESIZE) * mmap.PAGESIZE
            self.kv_bytes_per_chunk = row
            self.num_chunks = self.settings.cpu_bytes_to_use // row
            if self.num_chunks == 0:
                raise _bad(
                    "cpu_bytes_to_use",
                    self.extra_config["cpu_bytes_to_use"],
                    f"holds no chunk of {row} bytes ({self.blocks_per_chunk} blocks of "
                    f"{config.worker_kv_bytes_per_block} bytes on each of {world} ranks, page-rounded)",
                )
        info = RELEASE.offloading_info
        self.cpu_info = info.from_config(config, self.num_chunks, self.kv_bytes_per_chunk) if info else None
        self._manager: Optional[OffloadingManager] = None
        self._worker: Optional[KvoffloadWorker] = None
        self.pool_geometry: Optional[Tuple[int, int]] = None
        self.pool_hash_algo: Optional[str] = None
        if self.settings.pool is not None:
            self.pool_geometry = _pool_geometry(self)
            # The hash algorithm is not in OffloadingConfig: read it from
            # the VllmConfig the connector is being built with.
            self.pool_hash_algo = _hash_algo_on_stack()

    def get_manager(self) -> OffloadingManager:
        if self._manager is None and self.settings.pool is not None:
            self._manager = _pool_manager(self)
        if self._manager is None:
            s = self.settings
            self._manager = RELEASE.manager(
                CPUOffloadingManager,
                self.num_chunks,
                cache_policy=s.eviction_policy,
                cache_policy_module_path=s.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=s.store_threshold,
                max_tracker_size=s.max_tracker_size,
                info=self.cpu_info,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvoffloadWorker(self, kv_caches)
        return self._worker


def _pool_geometry(spec: "KvoffloadSpec") -> Tuple[int, int]:
    """(slots, ways) of a pool this engine would create: ``kvo_pool_bytes``
    in rows of ``kv_bytes_per_chunk`` (all ranks), whole sets of
    :data:`POOL_WAYS` (one set of every row of a smaller pool)."""
    s = spec.settings
    if spec.kv_bytes_per_chunk == 0:
        return (0, 0)
    rows = s.pool_bytes // spec.kv_bytes_per_chunk
    ways = min(POOL_WAYS, rows)
    if ways == 0:
        raise _bad(
            "kvo_pool_bytes", s.pool_bytes, f"holds no row of {spec.kv_bytes_per_chunk} bytes (all ranks' share)"
        )
    return (rows - rows % ways, ways)


def _hash_algo_on_stack() -> Optional[str]:
    """``prefix_caching_hash_algo`` of the VllmConfig being built into a
    connector: found on the call stack (``OffloadingConnector.__init__``
    has it as ``vllm_config`` in every supported release), as
    :func:`_engine_worker_before_warmup` finds the engine's worker. None
    when no frame has one (a spec built outside a connector)."""
    f = sys._getframe(1)
    while f is not None:
        cfg = f.f_locals.get("vllm_config")
        algo = getattr(getattr(cfg, "cache_config", None), "prefix_caching_hash_algo", None)
        if isinstance(algo, str):
            return algo
        f = f.f_back
    return None


def pool_config(config: OffloadingConfig, tag: str) -> Dict[str, Any]:
    """The fingerprint's config part (design 1.3) of this engine: what
    every process of it knows from ``OffloadingConfig``. Fields a release
    lacks (0.26 has no ``kv_cache_layout`` or ``replicated_layout``) take
    the value they mean there."""
    p = config.parallel
    return dict(
        model=config.model.name,
        kv_dtype=str(config.model.dtype),
        tag=tag,
        groups=[
            (g.tokens_per_block, hashlib.sha256("\n".join(g.layer_names).encode()).digest()) for g in config.groups
        ],
        tokens_per_hash=config.cache.tokens_per_hash,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        bytes_per_block=config.worker_kv_bytes_per_block,
        world_size=p.world_size,
        tp_size=p.tp_size,
        pp_size=p.pp_size,
        pcp_size=p.pcp_size,
        dcp_size=p.dcp_size,
        kv_cache_layout=str(getattr(config, "kv_cache_layout", None) or ""),
        replicated_layout=bool(getattr(config, "replicated_layout", False)),
    )


def _open_pool(spec: "KvoffloadSpec", rank: Optional[int]) -> "kvoffload.Pool":
    """The pool a process of this engine uses, not joined yet: rank
    ``rank``'s worker creates it if absent (with this engine's shape and
    config part); the scheduler (``rank`` None) opens it (its workers made
    or opened it before) and checks the config part."""
    if _pool_opener is not None:
        return _pool_opener(spec, rank)
    s = spec.settings
    cfg = pool_config(spec.config, s.pool_tag)
    if rank is None:
        return kvoffload.Pool.open(s.pool, dir=s.region_dir, config=cfg, timeout=POOL_JOIN_TIMEOUT_S)
    slots, ways = spec.pool_geometry
    return kvoffload.Pool.open(
        s.pool,
        dir=s.region_dir,
        config=cfg,
        create=dict(
            slots=slots,
            ways=ways,
            ranks=spec.config.parallel.world_size,
            row_bytes=spec.kv_bytes_per_chunk // max(spec.config.parallel.world_size, 1),
        ),
        timeout=POOL_JOIN_TIMEOUT_S,
    )


def _open_joined_pool(spec: "KvoffloadSpec", kv_caches: Any) -> "kvoffload.Pool":
    """This rank's worker's pool, opened (created if absent), its layout
    checked and its engine joined (:func:`_joined_reopening`)."""
    cfg = spec.config

    def prepare(pool: "kvoffload.Pool") -> None:
        if pool.path is not None:
            tensors, _ = _slotworker.layout(kv_caches)
            pool.ensure_layout(cfg.parallel.rank, [t.page_size_bytes for t in tensors], timeout=POOL_JOIN_TIMEOUT_S)

    return _joined_reopening(spec, cfg.parallel.rank, prepare)


def _joined_reopening(
    spec: "KvoffloadSpec", rank: Optional[int], prepare: Callable[["kvoffload.Pool"], None]
) -> "kvoffload.Pool":
    """The pool of rank ``rank``'s worker (None: the scheduler), opened,
    ``prepare``d (its layout or hashing checked) and joined. A pool found
    being removed (a last engine of ``kvo_pool_keep: false`` leaving, or
    ``kvoffload pool rm``; the join's error kind ``"closing"``, which every
    member of the engine meets) is opened again, up to
    ``POOL_OPEN_ATTEMPTS`` times: once its files are gone, rank 0 makes a
    fresh one and the others join it there (src/pool/closing.rs)."""
    for attempt in range(POOL_OPEN_ATTEMPTS):
        pool = _open_pool(spec, rank)
        try:
            prepare(pool)
            pool.join(spec.config.engine_id, rank=rank, timeout=POOL_JOIN_TIMEOUT_S)
            return pool
        except kvoffload.PoolError as e:
            pool.leave()
            if getattr(e, "kind", None) != "closing" or attempt + 1 == POOL_OPEN_ATTEMPTS:
                raise
            log.info("kvoffload.vllm: pool %r is being removed; opening it again (%s)", spec.settings.pool, e)
        except BaseException:
            pool.leave()
            raise
    raise AssertionError("unreachable: the last attempt raises")


def _pool_region_spec(spec: "KvoffloadSpec") -> "kvoffload.RegionSpec":
    """The region of the pool's rows: ``pool-<name>`` in the pool's
    directory, created by the first engine's ranks and kept (never
    unlinked) for the engines after it."""
    if _pool_region is not None:
        return _pool_region(spec)
    s = spec.settings
    cfg = spec.config
    return kvoffload.RegionSpec.persistent(
        f"pool-{s.pool}",
        rank=cfg.parallel.rank,
        ranks=cfg.parallel.world_size,
        options=kvoffload.ShmOptions(dir=s.region_dir),
    )


def _pool_manager(spec: "KvoffloadSpec") -> OffloadingManager:
    """The scheduler's :class:`PoolManager` (design 5): the hash seed rule
    checked first (design 1.2), then the pool opened, its hashing part
    filled or compared, and the engine's entry joined."""
    from .pool import PoolManager

    s = spec.settings
    algo = spec.pool_hash_algo
    if algo is None:
        raise _bad(
            "kvo_pool",
            s.pool,
            "the engine's prefix_caching_hash_algo was not found (no VllmConfig on the stack of the spec's "
            "construction): the pool cannot check that its engines share block hashes",
        )
    nh = _releases.none_hash(algo)
    value = nh.require(s.pool, RELEASE.version)

    def prepare(pool: "kvoffload.Pool") -> None:
        if pool.path is not None:  # a pool file (not a test's in-process pool)
            pool.ensure_hashing(algo, value, nh.python, timeout=POOL_JOIN_TIMEOUT_S)

    pool = _joined_reopening(spec, None, prepare)
    info = RELEASE.offloading_info
    cpu_info = info.from_config(spec.config, pool.slots, spec.kv_bytes_per_chunk) if info else None
    log.info(
        "kvoffload.vllm: pool %r: %d slots of %d ways, engine %d; NONE_HASH from %s (%s)",
        s.pool,
        pool.slots,
        pool.ways,
        pool.engine,
        nh.source,
        algo,
    )
    return PoolManager(
        pool,
        enable_events=spec.kv_events_config.enable_kv_cache_events,
        none_hash=value,
        info=cpu_info,
        pool_name=s.pool,
        keep=s.pool_keep,
    )


def _engine_worker_before_warmup() -> Any:
    """vLLM's GPU worker when it is building this spec's worker before its
    warm-up and graph capture, else None. Found on the call stack, from what
    the installed vLLM does rather than its version: a frame of
    ``initialize_from_config`` (vLLM 0.26 - 0.33 register the KV caches, and
    so build the offloading worker, there; the executor then calls
    ``compile_or_warm_up_model``, where the graphs are captured) whose
    ``self`` has ``compile_or_warm_up_model``. vLLM 0.34 with its extensible
    KV cache builds the connector after the warm-up: no such frame."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "initialize_from_config":
            w = f.f_locals.get("self")
            if w is not None and callable(getattr(type(w), "compile_or_warm_up_model", None)):
                return w
        f = f.f_back
    return None


def _hold_pinning_over_warmup(worker: "KvoffloadWorker", engine_worker: Any) -> None:
    """Holds ``worker``'s pinning back until ``engine_worker``'s
    ``compile_or_warm_up_model`` returns (wrapped on that instance only, and
    unwrapped when it ran), or the first job, or shutdown. Graph capture
    with a 64 GiB region pinning beside it took 8 - 15 s instead of 4 - 5 s
    on an 8B-shaped model (issue 42): each capture window waited for the
    registration in flight."""
    original = engine_worker.compile_or_warm_up_model

    def compile_or_warm_up_model(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            try:
                del engine_worker.compile_or_warm_up_model
            except AttributeError:
                pass
            worker.release_pin_hold("vLLM's warm-up and graph capture ended")

    engine_worker.compile_or_warm_up_model = compile_or_warm_up_model
    worker.hold_pinning_until_served("vLLM warms up and captures its graphs next")


# The worker's mapping, kept free of vLLM in kvoffload._slotworker (the
# H200 run drives it without vLLM's wheel); re-exported for the tests.
_layout = _slotworker.layout


class KvoffloadWorker(_slotworker.SlotWorker, OffloadingWorker):
    """vLLM's ``OffloadingWorker`` on a slot-addressed kvoffload
    ``Offloader`` (:class:`kvoffload._slotworker.SlotWorker`): chunk id ``c``
    of vLLM's manager is host slot ``c``; vLLM's job ids are the
    offloader's. The GPU side of a job is whatever the release passes
    (``GPULoadStoreSpec`` block ids, or 0.34's ``DevicePointers``); a failed
    job is reported as ``TransferResult(success=False)`` where the release
    accepts that (0.34+) and raised where it would crash on it."""

    def __init__(self, spec: KvoffloadSpec, kv_caches: CanonicalKVCaches):
        s = spec.settings
        cfg = spec.config
        if _runtime_factory is not None:
            runtime = _runtime_factory(s.backend)
        else:
            runtime = kvoffload.Runtime(s.backend)
        options: Dict[str, Any] = dict(
            pin=kvoffload.PinOptions(
                threads=s.pin_threads,
                max_chunk_bytes=s.max_chunk_bytes,
                prefault=s.prefault,
                huge_pages=s.huge_pages,
                lookahead_bytes=s.pin_lookahead_bytes,
                huge_fallback_mbps=s.huge_fallback_mbps,
                prefault_nice=s.pin_nice,
            ),
            transfer=kvoffload.TransferOptions(backend=s.copy_backend, staging_bytes=s.staging_bytes),
        )
        num_slots = spec.num_chunks
        pool = None
        if s.pool is not None:
            # The pool's rows are the region; its index the slots (design 5).
            pool = _open_joined_pool(spec, kv_caches)
            num_slots = pool.slots
            options["region"] = _pool_region_spec(spec)
            if cfg.parallel.world_size > 1:
                # P7: the ranks agree on pinning through their engine
                # entry's words (the pool's rows, a persistent region, have
                # no rank words of one launch); this worker joined as its
                # rank, so the words are this tenure's (reset by rank 0's
                # claim before any other rank could join).
                options["agreement"] = pool
        elif s.region == "shared":
            options["region"] = kvoffload.RegionSpec.shared(
                f"vllm-{cfg.engine_id}",
                rank=cfg.parallel.rank,
                ranks=cfg.parallel.world_size,
                options=kvoffload.ShmOptions(dir=s.region_dir),
            )
        try:
            self._init_slots(spec, kv_caches, num_slots, runtime, options, pool)
            self.pool_keep = s.pool_keep
        except BaseException:
            if pool is not None:
                pool.leave()
            raise
        engine_worker = _engine_worker_before_warmup() if s.hold_pinning_for_warmup else None
        if engine_worker is not None:
            _hold_pinning_over_warmup(self, engine_worker)
        log.info(
            "kvoffload.vllm: %d host slots of %d blocks, region %d bytes (%s), set up in %.3f s; pinning in the "
            "background (%s)",
            num_slots,
            spec.blocks_per_chunk,
            self.offloader.region_bytes,
            f"pool {s.pool!r}" if pool is not None else s.region,
            self.setup_seconds,
            self.offloader.pin_progress.state,
        )

    def _init_slots(self, spec: KvoffloadSpec, kv_caches: Any, num_slots: int, runtime: Any, options: Any, pool: Any):
        s = spec.settings
        cfg = spec.config
        _slotworker.SlotWorker.__init__(
            self,
            kv_caches,
            num_slots=num_slots,
            blocks_per_chunk=spec.blocks_per_chunk,
            runtime=runtime,
            options=options,
            capture_hook=s.capture_hook,
            result=TransferResult,
            failed_results=RELEASE.failed_results,
            pool=pool,
            pool_rank=cfg.parallel.rank,
        )
