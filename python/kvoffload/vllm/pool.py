"""The node pool's scheduler side (docs/node-pool-design.md, section 5):
:class:`PoolManager`, vLLM's ``OffloadingManager`` over a
:class:`kvoffload.Pool`, for every release ``kvoffload.vllm`` supports
(0.26 - 0.34).

The index lives in the pool, next to the bytes: every engine naming the
pool sees the same keys. This manager keeps only what is private to its
engine (design 3.1 - 3.3):

- **holds**, counted per ``(slot, epoch)``: the engine's bit in a slot's
  word is set by the first hold (a ``lookup`` hit) and cleared by the
  pool when the last one ends. A lookup's hold is kept for the step (the
  ``lookup`` HIT then ``prepare_load`` sequence vLLM runs under its
  ``lock``) and taken over by ``prepare_load``, which keeps it until
  ``complete_load``; holds no ``prepare_load`` took end at
  ``on_schedule_end`` (and ``on_request_finished``).
- **writes**: the slots ``prepare_store`` claimed, per request and key,
  until ``complete_store``. The workers publish them (each rank's bit, the
  last one makes the slot readable); ``complete_store`` abandons a slot
  still being written (a rank's copy failed: vLLM 0.34 passes
  ``success=False``), whose bytes were never visible.

Chunk ids are slot indices: the specs are :class:`PoolLoadStoreSpec`
(vLLM's ``CPULoadStoreSpec`` with the slots' epochs), so a worker checks
each slot's word before it copies (``Pool.check_held``,
``Pool.check_writing``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

import kvoffload
from kvoffload import _vllm_releases as _releases
from kvoffload._slotworker import close_pool_if_unused as close_if_unused

log = logging.getLogger("kvoffload.vllm")

Slot = Tuple[int, int]  # (slot index, epoch)

#: The counters of :meth:`PoolManager.stats`: lookups that hit (each a
#: hold), were pending (this engine writes the key) or missed; slots loaded,
#: of which held by prepare_load itself rather than taken over from a
#: lookup of the step (``late_holds``); keys claimed for a store, found
#: present, skipped (their set full of held or written slots); evictions;
#: stores abandoned at completion.
COUNTERS = (
    "hits",
    "pending",
    "misses",
    "loads",
    "late_holds",
    "stores",
    "stores_present",
    "stores_skipped",
    "evictions",
    "stores_abandoned",
)

# How often, at most, on_schedule_end sweeps dead engines after a store
# skipped keys (their sets full of marks a dead engine may have left).
SWEEP_EVERY_S = 1.0


class PoolLoadStoreSpec(CPULoadStoreSpec):
    """vLLM's ``CPULoadStoreSpec`` whose chunk ids (``block_ids``) are pool
    slots, with each slot's ``epochs`` (the epoch the scheduler held or
    claimed it at), so that a worker checks, before it copies, that the
    slot is still the one the scheduler meant."""

    def __init__(self, slots: Sequence[int], epochs: Sequence[int]):
        super().__init__(list(slots))
        if len(epochs) != len(slots):
            raise ValueError(f"kvoffload.vllm: {len(slots)} pool slots and {len(epochs)} epochs")
        self.epochs = [int(e) for e in epochs]

    def __repr__(self) -> str:
        return f"PoolLoadStoreSpec(slots={list(self.block_ids)}, epochs={self.epochs})"


class PoolManager(OffloadingManager):
    """vLLM's offloading manager over a node pool (see the module docs).

    ``pool`` is this engine's scheduler's :class:`kvoffload.Pool`, joined
    already (``Pool.join(engine_id)``, after the engine's workers). Its
    ``slots`` are the chunk ids. ``none_hash`` is the ``NONE_HASH`` the
    spec predicted (design 1.2): the first ``lookup`` compares vLLM's own
    with it, and a difference is refused before any hit is served.
    ``info`` is the release's config-info record (0.33+), or None."""

    def __init__(
        self,
        pool: "kvoffload.Pool",
        *,
        enable_events: bool = False,
        none_hash: Optional[bytes] = None,
        info: Any = None,
        pool_name: Optional[str] = None,
        keep: bool = True,
    ):
        if pool.engine is None:
            raise ValueError("kvoffload.vllm: PoolManager needs a Pool that joined its engine")
        self.pool = pool
        self.pool_name = pool_name or pool.name
        # kvo_pool_keep false: the last engine to leave removes the pool.
        self.keep = keep
        self.medium = _releases.cpu_medium()
        self.events: Optional[List[OffloadingEvent]] = [] if enable_events else None
        self.none_hash = none_hash
        self._none_hash_checked = none_hash is None
        self.info = info
        # Private hold counts per (slot, epoch): the engine's bit is set
        # while the count is positive (invariant I6).
        self._holds: Dict[Slot, int] = {}
        # Holds of this step's lookups, per request and key (oldest first),
        # until prepare_load takes them over or the step ends.
        self._looked: Dict[str, Dict[bytes, List[Slot]]] = {}
        # Holds of loads in flight, per request and key, until complete_load.
        self._loading: Dict[str, Dict[bytes, List[Slot]]] = {}
        # Writes in flight: per request, key -> (slot, epoch).
        self._writing: Dict[str, Dict[bytes, Slot]] = {}
        # What a cache reset left in flight, ended once vLLM says the
        # workers reported every flushed job (on_reset_flushed, 0.33+).
        self._parked_holds: List[Slot] = []
        self._parked_writes: List[Slot] = []
        self._skipped_since_sweep = 0
        self._last_sweep = 0.0
        self._shut = False
        #: Counters since the manager was made (tests, logs).
        self.counters: Dict[str, int] = defaultdict(int)
        for name in COUNTERS:
            self.counters[name] = 0
        self._stats_skipped = 0

    # ---------------------------------------------------------------- holds

    def _hold(self, slot: int, epoch: int) -> None:
        k = (slot, epoch)
        self._holds[k] = self._holds.get(k, 0) + 1

    def _unhold(self, s: Slot) -> None:
        n = self._holds.get(s, 0)
        if n <= 0:
            raise RuntimeError(f"kvoffload.vllm: pool slot {s[0]} (epoch {s[1]}) released but not held")
        if n == 1:
            del self._holds[s]
            self.pool.release([s[0]], [s[1]])
        else:
            self._holds[s] = n - 1

    def _unhold_all(self, by_key: Dict[bytes, List[Slot]]) -> None:
        for slots in by_key.values():
            for s in slots:
                self._unhold(s)

    def _check_none_hash(self) -> None:
        """vLLM's ``NONE_HASH`` (set by ``init_none_hash`` after the
        scheduler was built) against the spec's prediction."""
        import vllm.v1.core.kv_cache_utils as kcu

        actual = getattr(kcu, "NONE_HASH", None)
        if actual is None:
            raise _releases.RandomNoneHash(
                f"kvoffload.vllm: kv_connector_extra_config['kvo_pool'] = {self.pool_name!r}: vLLM's NONE_HASH is "
                "not set at the first lookup (init_none_hash did not run): the pool's block hashes cannot be checked"
            )
        if bytes(actual) != self.none_hash:
            raise _releases.RandomNoneHash(
                f"kvoffload.vllm: kv_connector_extra_config['kvo_pool'] = {self.pool_name!r}: vLLM's NONE_HASH "
                f"({bytes(actual).hex()[:16]}...) is not the one predicted from the config "
                f"({self.none_hash.hex()[:16]}...): the engines on the pool would not share block hashes. Set "
                "PYTHONHASHSEED to one value for every engine, and the same prefix_caching_hash_algo"
            )
        self._none_hash_checked = True

    # ---------------------------------------------------------------- vLLM's calls

    def lookup(self, key: Any, req_context: Any) -> Any:
        if not self._none_hash_checked:
            self._check_none_hash()
        kind, slot, epoch, _fresh = self.pool.lookup([bytes(key)])[0]
        if kind == "hit":
            self._hold(slot, epoch)
            self._looked.setdefault(req_context.req_id, {}).setdefault(bytes(key), []).append((slot, epoch))
            self.counters["hits"] += 1
            return LookupResult.HIT
        if kind == "pending":
            self.counters["pending"] += 1
            return LookupResult.HIT_PENDING
        self.counters["misses"] += 1
        return LookupResult.MISS

    def get_load_source(self, key: Any, req_context: Any) -> Any:
        # 0.33+ only (a release without it never calls it).
        return _releases.host_hit_source()

    def prepare_load(self, keys: Any, req_context: Any) -> PoolLoadStoreSpec:
        req = req_context.req_id
        looked = self._looked.get(req, {})
        loading = self._loading.setdefault(req, {})
        slots: List[int] = []
        epochs: List[int] = []
        for key in keys:
            key = bytes(key)
            held = looked.get(key)
            if held:
                s = held.pop(0)
                if not held:
                    del looked[key]
            else:
                # A key not looked up (and held) in this step: held now if
                # it is still readable. vLLM loads in the step it looked
                # up (design 7.2); the count shows whether a release does
                # otherwise.
                kind, slot, epoch, _ = self.pool.lookup([key])[0]
                if kind != "hit":
                    raise RuntimeError(
                        f"kvoffload.vllm: prepare_load of a key this engine holds no lookup of, and that is not "
                        f"readable in pool {self.pool_name!r} ({kind}): request {req}"
                    )
                self._hold(slot, epoch)
                s = (slot, epoch)
                self.counters["late_holds"] += 1
            loading.setdefault(key, []).append(s)
            slots.append(s[0])
            epochs.append(s[1])
        if not looked:
            self._looked.pop(req, None)
        self.counters["loads"] += len(slots)
        return PoolLoadStoreSpec(slots, epochs)

    def touch(self, keys: Any, req_context: Any) -> None:
        req = req_context.req_id
        slots = []
        for by_key in (self._looked.get(req, {}), self._loading.get(req, {})):
            for key in keys:
                slots.extend(s for s, _ in by_key.get(bytes(key), ()))
        if slots:
            self.pool.touch(slots)

    def complete_load(self, keys: Any, req_context: Any) -> None:
        loading = self._loading.get(req_context.req_id)
        if loading is None:
            return  # a load of before a cache reset (its holds parked)
        for key in keys:
            held = loading.get(bytes(key))
            if not held:
                continue
            self._unhold(held.pop(0))
            if not held:
                del loading[bytes(key)]
        if not loading:
            del self._loading[req_context.req_id]

    def prepare_store(self, keys: Any, req_context: Any) -> PrepareStoreOutput:
        if not self._none_hash_checked:
            self._check_none_hash()
        keys = [bytes(k) for k in keys]
        writing = self._writing.setdefault(req_context.req_id, {})
        to_store: List[bytes] = []
        slots: List[int] = []
        epochs: List[int] = []
        evicted: List[bytes] = []
        for key, (kind, slot, epoch, gone) in zip(keys, self.pool.claim(keys)):
            if kind == "claimed":
                to_store.append(key)
                slots.append(slot)
                epochs.append(epoch)
                writing[key] = (slot, epoch)
                if gone is not None:
                    evicted.append(gone)
            elif kind == "skipped":
                self._skipped_since_sweep += 1
                self._stats_skipped += 1
                self.counters["stores_skipped"] += 1
            else:
                self.counters["stores_present"] += 1
        if not writing:
            del self._writing[req_context.req_id]
        self.counters["stores"] += len(to_store)
        self.counters["evictions"] += len(evicted)
        if evicted and self.events is not None:
            self.events.append(OffloadingEvent(keys=evicted, medium=self.medium, removed=True))
        return PrepareStoreOutput(
            keys_to_store=to_store, store_spec=PoolLoadStoreSpec(slots, epochs), evicted_keys=evicted
        )

    def _finish_write(self, s: Slot) -> bool:
        """Ends this engine's write of ``s``: True when it is published
        (readable at its epoch, or published and since reused), False
        when it was still being written and is abandoned now."""
        try:
            abandoned = self.pool.abandon([s[0]], [s[1]])[0]
        except kvoffload.PoolStateError:
            # The epoch moved or another engine writes it: only a claim
            # moves an epoch, and no claim takes a slot this engine
            # writes, so it was published, then evicted and claimed again.
            return True
        return not abandoned

    def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> None:
        writing = self._writing.get(req_context.req_id)
        if writing is None:
            return  # a store of before a cache reset (parked)
        stored: List[bytes] = []
        removed: List[bytes] = []
        for key in keys:
            s = writing.pop(bytes(key), None)
            if s is None:
                continue
            if self._finish_write(s):
                stored.append(bytes(key))
            else:
                removed.append(bytes(key))
                if success:
                    log.warning(
                        "kvoffload.vllm: pool %r slot %d (epoch %d) was still being written when its store completed;"
                        " abandoned",
                        self.pool_name,
                        s[0],
                        s[1],
                    )
        if not writing:
            del self._writing[req_context.req_id]
        self.counters["stores_abandoned"] += len(removed)
        if self.events is not None:
            if stored:
                self.events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False))

    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: Any) -> None:
        # Loads and stores in flight keep theirs until complete_*.
        looked = self._looked.pop(req_context.req_id, None)
        if looked:
            self._unhold_all(looked)

    def on_schedule_end(self, context: Any) -> None:
        looked, self._looked = self._looked, {}
        for by_key in looked.values():
            self._unhold_all(by_key)
        if self._skipped_since_sweep and time.monotonic() - self._last_sweep >= SWEEP_EVERY_S:
            self.sweep()

    def sweep(self) -> List[int]:
        """Sweeps dead engines' marks (design 3.6); returns the entries freed."""
        self._skipped_since_sweep = 0
        self._last_sweep = time.monotonic()
        freed = self.pool.sweep()
        if freed:
            log.info("kvoffload.vllm: pool %r: swept dead engines %s", self.pool_name, freed)
        return freed

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return
        events, self.events = self.events, []
        yield from events

    def reset_cache(self) -> None:
        # Readable blocks stay: they belong to the pool's fingerprint, not
        # to this engine. Holds of this step end now; loads and stores in
        # flight are flushed by vLLM, so theirs end at on_reset_flushed.
        looked, self._looked = self._looked, {}
        for by_key in looked.values():
            self._unhold_all(by_key)
        for by_key in self._loading.values():
            for slots in by_key.values():
                self._parked_holds.extend(slots)
        self._loading = {}
        for by_key in self._writing.values():
            self._parked_writes.extend(by_key.values())
        self._writing = {}

    def on_reset_flushed(self) -> None:
        # 0.33+: every job the reset flushed was reported by every worker.
        holds, self._parked_holds = self._parked_holds, []
        for s in holds:
            self._unhold(s)
        writes, self._parked_writes = self._parked_writes, []
        for s in writes:
            self._finish_write(s)

    def has_pending_work(self) -> bool:
        return False

    def get_stats(self) -> Any:
        return _releases.pool_stats(self.pool.census(), self.pool.slots, self._take_skipped())

    def _take_skipped(self) -> int:
        n, self._stats_skipped = self._stats_skipped, 0
        return n

    def config_info(self) -> Sequence[Any]:
        return [self.info.as_config_info()] if self.info is not None else [{}]

    def stats(self) -> Dict[str, Any]:
        """This engine's counters, its holds and writes, and the pool's
        census (tests, logs)."""
        return dict(
            self.counters,
            held_slots=len(self._holds),
            writes=sum(len(w) for w in self._writing.values()),
            census=self.pool.census(),
        )

    def shutdown(self) -> None:
        """Ends every hold and write of this engine (writes still being
        written are abandoned) and leaves the pool. Idempotent."""
        if self._shut:
            return
        self._shut = True
        try:
            for s in list(self._holds):
                self.pool.release([s[0]], [s[1]])
            self._holds.clear()
            for by_key in self._writing.values():
                for s in by_key.values():
                    self._finish_write(s)
            for s in self._parked_writes:
                self._finish_write(s)
            self._looked, self._loading, self._writing = {}, {}, {}
            self._parked_holds, self._parked_writes = [], []
        finally:
            self.pool.leave()
            if not self.keep:
                close_if_unused(self.pool)
