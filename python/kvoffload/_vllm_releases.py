"""The vLLM releases ``kvoffload.vllm`` runs in, and every way they differ.

This module is the only place that knows one release from another; the
spec (``kvoffload.vllm``) and the worker (``kvoffload._slotworker``) ask it.
It imports vLLM only in :func:`detect` (its version checks run without it).
Each difference is detected from the installed vLLM itself (a signature, a
class, a method), not from the version number, so that a patch release or
a backport is handled by what it actually has; the version number only
decides whether the release is supported at all. The facts, with the
lines of vLLM they come from, are in ``docs/vllm-interfaces.md``:

==============================  ==========  ==========  ======  ==============
what                            0.26-0.29   0.30-0.32   0.33    0.34
==============================  ==========  ==========  ======  ==============
``CPUOffloadingManager`` size   num_blocks  num_chunks  same    same
``cache_policy_module_path``    0.27+       yes         yes     yes
``CPUOffloadingInfo``, labels   no          no          yes     yes
``submit_load(expedited=)``     no          no          yes     yes
GPU side of a job               block ids   block ids   same    DevicePointers
``TransferResult(success=0)``   crashes     crashes     same    accepted
``NONE_HASH`` seed (unseeded)   random      not read    fixed*  fixed*
==============================  ==========  ==========  ======  ==============

(*) ``sha256`` and ``sha256_cbor`` from vLLM's fixed seed, ``xxhash*``
random: :func:`none_hash` asks the release's ``resolve_none_hash_seed``
where it has one (0.26 has none: its seed is PYTHONHASHSEED or random).
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

#: The first and last vLLM releases (major, minor) kvoffload.vllm supports.
FIRST: Tuple[int, int] = (0, 26)
LAST: Tuple[int, int] = (0, 34)
#: Where each supported line was tested (README "Use with vLLM").
TESTED = {
    (0, 26): "CPU (ci/test) and a real engine on the H200 (ci/gpu)",
    (0, 33): "CPU (ci/test)",
    (0, 34): "CPU (ci/test)",
}
#: Set to 1 to load in a vLLM outside [FIRST, LAST] anyway (at your risk:
#: the interfaces may have moved again; a warning is logged).
ANY_VERSION_ENV = "KVO_VLLM_ANY_VERSION"


class UnsupportedRelease(ImportError):
    """The installed vLLM is outside the releases kvoffload.vllm supports."""


def parse(version: str) -> Tuple[int, int]:
    """``(major, minor)`` of a vLLM version string (``0.34.0``,
    ``0.33.1rc1``, ``0.34.0.dev12+gabc``); ``ValueError`` if it has none."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def supported_text() -> str:
    return f"{FIRST[0]}.{FIRST[1]} to {LAST[0]}.{LAST[1]}"


def check_version(version: str, env: Optional[Dict[str, str]] = None) -> bool:
    """Raises :class:`UnsupportedRelease`, naming ``version``, when it is
    outside the supported releases (unless ``KVO_VLLM_ANY_VERSION=1``:
    then returns False, for a warning). True when supported."""
    env = os.environ if env is None else env
    try:
        mm = parse(version)
    except ValueError:
        mm = None
    if mm is not None and FIRST <= mm <= LAST:
        return True
    if env.get(ANY_VERSION_ENV) == "1":
        return False
    raise UnsupportedRelease(
        f"kvoffload.vllm supports vLLM {supported_text()}; vLLM {version} is installed. "
        f"Install a supported release, or set {ANY_VERSION_ENV}=1 to try this one anyway "
        "(its offloading interfaces may differ: see docs/vllm-interfaces.md)"
    )


@dataclass(frozen=True)
class Release:
    """What the installed vLLM has, as the spec and the worker need it."""

    version: str
    #: The name of ``CPUOffloadingManager``'s size argument.
    manager_size_arg: str
    #: Every keyword ``CPUOffloadingManager.__init__`` takes.
    manager_args: frozenset
    #: ``CPUOffloadingInfo`` (0.33+), the manager's config-info labels.
    offloading_info: Optional[type]
    #: ``OffloadingWorker.submit_load`` takes ``expedited`` (0.33+).
    expedited_loads: bool
    #: ``submit_store`` / ``submit_load`` get ``DevicePointers`` (0.34+).
    device_pointers: bool
    #: The connector accepts ``TransferResult(success=False)`` (0.34+): a
    #: failed load fails its request, a failed store drops its chunks.
    #: Before, it asserts success, so a failure is raised instead.
    failed_results: bool
    #: False when loaded past the supported range with ANY_VERSION_ENV.
    supported: bool = True

    def manager(self, cls: Any, num_chunks: int, **kw: Any) -> Any:
        """``cls(...)`` (vLLM's ``CPUOffloadingManager``) with the size under
        this release's name and only the keywords it takes; a keyword it
        lacks but the config set (not None) is an error naming the key."""
        args = {self.manager_size_arg: num_chunks}
        for key, value in kw.items():
            if key in self.manager_args:
                args[key] = value
            elif value is not None:
                raise ValueError(
                    f"kvoffload.vllm: kv_connector_extra_config[{key!r}] = {value!r}: "
                    f"not supported by vLLM {self.version}'s CPU manager"
                )
        return cls(**args)


def detect() -> Release:
    """The installed vLLM's :class:`Release` (imports vLLM). Raises
    :class:`UnsupportedRelease` for a release outside the supported range."""
    import vllm
    import vllm.v1.kv_offload.base as base
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    version = getattr(vllm, "__version__", "unknown")
    supported = check_version(version)
    params = inspect.signature(CPUOffloadingManager.__init__).parameters
    size = next((n for n in ("num_chunks", "num_blocks") if n in params), None)
    if size is None:
        raise UnsupportedRelease(
            f"kvoffload.vllm: vLLM {version}'s CPUOffloadingManager takes neither num_chunks nor num_blocks "
            f"({', '.join(params)}): not a release kvoffload.vllm knows"
        )
    try:
        from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
    except ImportError:
        CPUOffloadingInfo = None
    load_params = inspect.signature(base.OffloadingWorker.submit_load).parameters
    return Release(
        version=version,
        manager_size_arg=size,
        manager_args=frozenset(n for n in params if n not in ("self", size)),
        offloading_info=CPUOffloadingInfo,
        expedited_loads="expedited" in load_params,
        device_pointers=hasattr(base, "DevicePointers"),
        failed_results=hasattr(OffloadingConnectorWorker, "take_failed_recving"),
        supported=supported,
    )


#: The ``prefix_caching_hash_algo`` values whose input is a pickle (their
#: hashes differ between Python versions: the pool's fingerprint records
#: Python's major.minor for them, design 1.3).
PICKLING_HASHES = frozenset({"sha256", "xxhash"})


class RandomNoneHash(ValueError):
    """The engines' ``NONE_HASH`` would be random per process: no two
    engines would share a block hash, so a pool is refused (design 1.2)."""


@dataclass(frozen=True)
class NoneHash:
    """``NONE_HASH`` as the installed vLLM will compute it for one hash
    algorithm (design 1.2): the seed rule read from the release itself."""

    #: ``prefix_caching_hash_algo``.
    algorithm: str
    #: The bytes ``init_none_hash`` will set, or None where they are random.
    value: Optional[bytes]
    #: Where the seed comes from: ``"PYTHONHASHSEED"``, ``"vLLM's fixed
    #: seed"`` or ``"random"``.
    source: str
    #: Whether this release derives a fixed seed for some algorithms when
    #: PYTHONHASHSEED is unset (0.33+: ``resolve_none_hash_seed``).
    fixed_seed_release: bool

    @property
    def python(self) -> Optional[Tuple[int, int]]:
        """Python's (major, minor) where the algorithm pickles, else None."""
        import sys

        return tuple(sys.version_info[:2]) if self.algorithm in PICKLING_HASHES else None  # type: ignore[return-value]

    def require(self, pool: str, version: str) -> bytes:
        """The value, or :class:`RandomNoneHash` saying what to set."""
        if self.value is not None:
            return self.value
        if self.fixed_seed_release:
            fix = (
                "set PYTHONHASHSEED to one value for every engine on the pool, or use "
                "prefix_caching_hash_algo 'sha256' or 'sha256_cbor' (seeded from vLLM's fixed seed)"
            )
        else:
            fix = f"set PYTHONHASHSEED to one value for every engine on the pool (vLLM {version} has no fixed seed)"
        raise RandomNoneHash(
            f"kvoffload.vllm: kv_connector_extra_config['kvo_pool'] = {pool!r}: vLLM {version} draws NONE_HASH at "
            f"random in each process with prefix_caching_hash_algo {self.algorithm!r} and PYTHONHASHSEED unset, so "
            f"no two engines would compute the same block hashes and the pool would never hit: {fix}"
        )


def none_hash(algorithm: str) -> NoneHash:
    """What the installed vLLM's ``init_none_hash(get_hash_fn_by_name(
    algorithm))`` will set, decided from the release itself (design 1.2):
    where ``kv_cache_utils`` has ``resolve_none_hash_seed`` (0.33+), that
    function is asked twice for the seed (a random seed differs between
    two calls: ``os.urandom``); where it has not (0.26), the seed is
    PYTHONHASHSEED and, unset, ``NONE_HASH`` is random bytes. Reads the
    environment now: call it in the process whose engine computes the
    hashes (the engine core, where the scheduler runs)."""
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.utils.hashing import get_hash_fn_by_name

    fn = get_hash_fn_by_name(algorithm)
    resolve = getattr(kcu, "resolve_none_hash_seed", None)
    if resolve is not None:
        seed, again = resolve(fn), resolve(fn)
        if seed != again:
            return NoneHash(algorithm, None, "random", True)
        source = "PYTHONHASHSEED" if os.environ.get("PYTHONHASHSEED") is not None else "vLLM's fixed seed"
        return NoneHash(algorithm, bytes(fn(seed)), source, True)
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        return NoneHash(algorithm, None, "random", False)
    return NoneHash(algorithm, bytes(fn(seed)), "PYTHONHASHSEED", False)


def cpu_medium() -> Any:
    """The CPU tier's medium in an ``OffloadingEvent``: ``Medium.CPU``
    (0.33+, an enum of ``kv_offload/base.py``) or the string of
    ``distributed/kv_events.py``'s ``MEDIUM_CPU`` (0.26)."""
    import vllm.v1.kv_offload.base as base

    medium = getattr(base, "Medium", None)
    if medium is not None:
        return medium.CPU
    from vllm.distributed.kv_events import MEDIUM_CPU

    return MEDIUM_CPU


def host_hit_source() -> Any:
    """``CacheHitSource.HOST`` (0.33+: where a hit's KV came from, asked
    by ``get_load_source``), or None where the release has no such class
    (it then never asks)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource.HOST


def pool_stats(census: Dict[str, int], slots: int, skipped: int) -> Any:
    """The CPU tier's gauges (``CPUOffloadingMetrics``, declared by the
    spec's ``build_metric_definitions``) of a pool's census: the fraction
    of slots held by reads or being written (the node's, every engine's),
    and of each alone. ``skipped`` is not reported: vLLM declares its
    counter only with a store threshold, which a pool refuses."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as M

    stats = OffloadingConnectorStats()
    write = census["writing"] / slots if slots else 0.0
    read = census["held"] / slots if slots else 0.0
    stats.set_gauge(M.CPU_CACHE_USAGE_PERC, write + read)
    stats.set_gauge(M.CPU_CACHE_WRITE_USAGE_PERC, write)
    stats.set_gauge(M.CPU_CACHE_READ_USAGE_PERC, read)
    return stats
