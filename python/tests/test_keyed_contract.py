"""The keyed layer's contract (issue 43) through ``kvoffload.KeyedOffloader``
on the simulated GPU, checked by hypothesis:

(a) a call that raises changes nothing: no key evicted, no slot taken (a
    store refused inside a capture window or for an out-of-range GPU block
    used to evict readable keys and report nothing);
(b) ``skipped`` and ``evicted`` of one store are disjoint, and every key
    evicted is in ``evicted`` (a store used to report a key
    ``already_stored`` and evict it);
(c) a key reported stored is loadable, once ``poll`` reported its store,
    until a store reports it evicted.

``KeyedContract`` is a ``RuleBasedStateMachine`` against a plain model of
keys and slots (LRU and ARC): the model says which calls succeed, what a
store stores and skips, how many keys it evicts and which may go; it takes
the victims from the store's own report, and after every step ``lookup`` of
every key must say what the model holds. ``test_threads_keep_the_contract``
runs several threads storing (some inside capture windows or with an
out-of-range block), loading and polling disjoint or overlapping keys at
once, then checks (b) per call and (a) and (c) as one account: a key is
held at the end exactly when its stores reported outnumber its evictions
reported. A few seconds in a release build; ``KVO_CONTRACT_EXAMPLES``
overrides the number of examples."""

import os
import threading

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

import kvoffload as kv  # noqa: E402

PAGE = 4096
GPU_BLOCKS = 8
OUT_OF_RANGE = GPU_BLOCKS + 3
KEYS = 10
EXAMPLES = int(os.environ.get("KVO_CONTRACT_EXAMPLES", "60"))


def make(host_blocks, eviction):
    off = kv.KeyedOffloader(
        host_blocks,
        kv=kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=GPU_BLOCKS),
        runtime=kv.Runtime("sim"),
        pin=kv.PinOptions(threads=1),
        eviction=eviction,
        start=True,
    )
    off.wait_pinned()  # capture windows open once pinning is final
    return off


def key(h):
    return (h, 0)


def blocks(n, bad):
    return [OUT_OF_RANGE if i == bad else i for i in range(n)]


def call(off, method, keys, gpu, window):
    """``off.method(keys, gpu)``, inside a capture window if asked; returns
    ``(result, None)`` or ``(None, (error class, reason))``."""
    try:
        if window:
            with off.capture_window():
                return getattr(off, method)(keys, gpu), None
        return getattr(off, method)(keys, gpu), None
    except kv.KvoffloadError as e:
        return None, (type(e), e.reason)


WINDOW = (kv.TransferError, "capture_window_open")
RANGE = (kv.OptionsError, "gpu_block_out_of_range")


#: Up to 4 distinct keys; a repeated key in some batches.
batches = st.one_of(
    st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=4, unique=True),
    st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=4, unique=True),
    st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=4, unique=True),
    st.lists(st.integers(0, KEYS - 1), min_size=0, max_size=3),
)
#: The batch index of an out-of-range GPU block, in some calls.
bad_block = st.sampled_from([None] * 5 + [0, 1, 2])
#: Made inside a capture window, in some calls.
in_window = st.sampled_from([False] * 4 + [True])


class KeyedContract(RuleBasedStateMachine):
    eviction = "lru"

    @initialize(capacity=st.integers(1, 8))
    def build(self, capacity):
        self.capacity = capacity
        self.off = make(capacity, self.eviction)
        self.pending = set()  # stores submitted, not yet reported by poll
        self.ready = {}  # readable keys -> loads in flight

    def teardown(self):
        if hasattr(self, "off"):
            self.off.shutdown()

    @rule(hashes=batches, bad=bad_block, window=in_window)
    def store(self, hashes, bad, window):
        got, err = call(self.off, "store", [key(h) for h in hashes], blocks(len(hashes), bad), window)
        event(f"store: {err[1] if err else 'ok'}")
        if len(set(hashes)) != len(hashes):
            assert err == (kv.ManagerError, "duplicate_key"), err
            return
        admitted = [h for h in hashes if h not in self.pending and h not in self.ready]
        skipped = [(key(h), "store_pending" if h in self.pending else "already_stored") for h in hashes if h not in admitted]
        free = self.capacity - len(self.pending) - len(self.ready)
        # (b): only keys outside the batch, ready and unread, may go.
        may_evict = {h for h, r in self.ready.items() if r == 0 and h not in hashes}
        evict = max(0, len(admitted) - free)
        if evict > len(may_evict):
            assert err == (kv.ManagerError, "insufficient_capacity"), err
            return
        if bad is not None and bad < len(hashes) and hashes[bad] in admitted:
            assert err == RANGE, err  # (a): checked by the invariant
            return
        if admitted and window:
            assert err == WINDOW, err
            return
        assert err is None, f"store {hashes} (bad {bad}, window {window}) raised {err}"
        assert got.stored == [key(h) for h in admitted]
        assert got.skipped == skipped
        evicted = [k for k, _ in got.evicted]
        assert not set(evicted) & {k for k, _ in got.skipped}, f"skipped and evicted {got}"
        assert len(evicted) == evict and set(evicted) <= may_evict, f"evicted {evicted}, may go {may_evict}"
        if evicted:
            event("store: evicted")
        if skipped:
            event("store: skipped")
        for h in evicted:
            del self.ready[h]
        self.pending.update(admitted)

    @rule(data=st.data(), window=in_window, bad=bad_block)
    def load(self, data, window, bad):
        ready = sorted(self.ready)
        hashes = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3, unique=True)) if ready else []
        # A key not stored now and then: refused, changing nothing.
        if not ready or data.draw(st.sampled_from([False] * 4 + [True])):
            hashes = hashes + [data.draw(st.integers(0, KEYS - 1).filter(lambda h: h not in hashes))]
        got, err = call(self.off, "load", [key(h) for h in hashes], blocks(len(hashes), bad), window)
        event(f"load: {err[1] if err else 'ok'}")
        if any(h not in self.ready for h in hashes):
            assert err is not None and err[0] is kv.ManagerError, err
        elif not hashes:
            assert err == (kv.OptionsError, "empty_job"), err
        elif bad is not None and bad < len(hashes):
            assert err == RANGE, err
        elif window:
            assert err == WINDOW, err
        else:
            assert err is None, err
            for h in hashes:
                self.ready[h] += 1

    @rule()
    def settle(self):
        self.off.wait_all()
        for c in self.off.poll():
            assert c.ok, c
        for h in self.pending:
            self.ready[h] = 0
        self.pending.clear()
        for h in self.ready:
            self.ready[h] = 0

    @invariant()
    def lookup_says_what_the_model_holds(self):
        if not hasattr(self, "off"):
            return
        want = ["hit_pending" if h in self.pending else "hit" if h in self.ready else "miss" for h in range(KEYS)]
        assert self.off.lookup([key(h) for h in range(KEYS)]) == want
        assert self.off.stored_blocks == len(self.pending) + len(self.ready)


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)


class KeyedContractArc(KeyedContract):
    eviction = "arc"


TestKeyedContractLru = KeyedContract.TestCase
TestKeyedContractLru.settings = SETTINGS
TestKeyedContractArc = KeyedContractArc.TestCase
TestKeyedContractArc.settings = SETTINGS


# ------------------------------------------------------------- threads --

THREADS = 4

store_op = st.tuples(
    st.just("store"),
    st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True),
    st.one_of(st.none(), st.integers(0, 2)),
    st.booleans(),
)
load_op = st.tuples(st.just("load"), st.lists(st.integers(0, 7), min_size=1, max_size=2, unique=True), st.none(), st.booleans())
poll_op = st.tuples(st.just("poll"), st.just([]), st.none(), st.just(False))
ops = st.lists(st.one_of(store_op, store_op, load_op, poll_op), min_size=1, max_size=12)


@settings(max_examples=max(10, EXAMPLES // 2), deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    eviction=st.sampled_from(["lru", "arc"]),
    host_blocks=st.integers(2, 8),
    overlap=st.booleans(),
    plans=st.lists(ops, min_size=THREADS, max_size=THREADS),
)
def test_threads_keep_the_contract(eviction, host_blocks, overlap, plans):
    off = make(host_blocks, eviction)
    # Overlapping: every thread on keys 0-7; disjoint: thread t on its own 8.
    base = [0 if overlap else 100 * t for t in range(THREADS)]
    reports, errors, start = [], [], threading.Barrier(THREADS)

    def run(t):
        mine = []
        try:
            start.wait()
            for op, hashes, bad, window in plans[t]:
                keys = [key(base[t] + h) for h in hashes]
                if op == "poll":
                    off.poll()
                    continue
                got, err = call(off, op, keys, blocks(len(keys), bad), window)
                if err is not None:
                    # A refusal must be one of these, and changes nothing.
                    assert err[0] in (kv.ManagerError, kv.TransferError, kv.OptionsError), err
                elif op == "store":
                    stored, evicted = set(got.stored), set(got.evicted)
                    skipped = {k for k, _ in got.skipped}
                    assert not skipped & evicted, f"skipped and evicted {got}"
                    assert stored | skipped == set(keys) and not stored & skipped, got
                    mine.append((got.stored, got.evicted))
        except BaseException as e:  # re-raised by the main thread
            errors.append(e)
        reports.extend(mine)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        off.wait_all()
        for c in off.poll():
            assert c.ok, c
        # (a) and (c) as one account: each key's stores reported minus its
        # evictions reported is 1 for a key held now, 0 for one not held.
        net = {}
        for stored, evicted in reports:
            for k in stored:
                net[k] = net.get(k, 0) + 1
            for k in evicted:
                net[k] = net.get(k, 0) - 1
        every = sorted({key(b + h) for b in base for h in range(8)})
        held = {k for k, l in zip(every, off.lookup(every)) if l == "hit"}
        assert all(n in (0, 1) for n in net.values()), net
        assert held == {k for k, n in net.items() if n == 1}, f"held {sorted(held)}, reported {net}"
        assert off.stored_blocks == len(held) <= host_blocks
    finally:
        off.shutdown()
