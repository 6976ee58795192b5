"""kvoffload._slotworker.SlotWorker, the vLLM-free worker that
kvoffload.vllm.KvoffloadWorker is made of (and that the H200 run drives
without vLLM), on the simulated GPU with stand-ins for vLLM's specs and
canonical KV caches. test_vllm.py drives the same class through vLLM."""

import random
import threading
from types import SimpleNamespace as NS

import pytest

import kvoffload as kv
from kvoffload import _slotworker

from test_slots import PAGE, fill, kv_tensors, zero


def caches(tensors, groups):
    return NS(
        tensors=[NS(tensor=t, page_size_bytes=t.page) for t in tensors],
        group_data_refs=[[NS(tensor_idx=i, page_size_bytes=PAGE) for i in g] for g in groups],
    )


def gpu(block_ids, group_sizes, block_indices):
    return NS(block_ids=block_ids, group_sizes=group_sizes, block_indices=block_indices)


def chunks(ids):
    return NS(block_ids=ids)


class Graph:
    def capture_begin(self):
        pass

    def capture_end(self):
        pass


def test_a_store_and_a_load_in_vllms_shapes_with_two_groups():
    ts = kv_tensors(3)
    orig = Graph.__dict__["capture_begin"]
    w = _slotworker.SlotWorker(
        caches(ts, [[2], [0, 1]]), num_slots=8, blocks_per_chunk=2, runtime=kv.Runtime("sim"),
        options=dict(pin_threads=1), hook_class=Graph,
    )
    assert w.offloader.addressing == "slots" and w.num_groups == 2
    assert Graph.capture_begin.__kvoffload_hook__ and Graph.capture_begin.__wrapped__ is orig
    want = fill(ts, range(8), random.Random(9))
    # Group 0 (tensor 2): logical blocks 3, 4 -> chunk 1 from sub-block 1, chunk 2;
    # group 1 (tensors 0, 1): logical blocks 0..2 -> chunks 5, 6 (the last partial).
    assert w.submit_store(10, gpu([1, 2, 4, 5, 6], [2, 3], [3, 0]), chunks([1, 2, 5, 6]))
    w.wait({10, 99})
    (r,) = w.get_finished()
    assert (r.job_id, r.success, r.transfer_size) == (10, True, (2 + 3 * 2) * PAGE) and r.transfer_time > 0
    zero(ts)
    assert w.submit_load(11, chunks([1, 2, 5, 6]), gpu([9, 10, 11, 12, 13], [2, 3], [3, 0]), expedited=True)
    w.wait([11])
    assert [r.job_id for r in w.get_finished()] == [11]
    assert [ts[2].block(b) for b in (9, 10)] == [want[(2, 1)], want[(2, 2)]]
    for t in (0, 1):
        assert [ts[t].block(b) for b in (11, 12, 13)] == [want[(t, b)] for b in (4, 5, 6)]
    w.shutdown()
    assert Graph.__dict__["capture_begin"] is orig, "the hook is removed at shutdown"
    w.shutdown()  # idempotent


def test_a_spec_of_the_wrong_kind_is_a_type_error():
    w = _slotworker.SlotWorker(
        caches(kv_tensors(1), [[0]]), num_slots=4, blocks_per_chunk=1, runtime=kv.Runtime("sim"),
        capture_hook=False,
    )
    with pytest.raises(TypeError, match="expected a GPULoadStoreSpec, got SimpleNamespace"):
        w.submit_store(1, chunks([0]), chunks([0]))
    w.shutdown()


def test_bad_ids_from_the_engine_are_raised_not_reported_false():
    w = _slotworker.SlotWorker(
        caches(kv_tensors(1), [[0]]), num_slots=4, blocks_per_chunk=1, runtime=kv.Runtime("sim"),
        capture_hook=False,
    )
    w.wait_pinned()  # pinned: submissions are the caller's, errors raised at once
    with pytest.raises(kv.OptionsError, match="out of range"):
        w.submit_store(1, gpu([0], [1], [0]), chunks([4]))
    w.submit_store(2, gpu([0], [1], [0]), chunks([0]))
    with pytest.raises(kv.TransferError, match="already used"):
        w.submit_store(2, gpu([1], [1], [0]), chunks([1]))
    w.shutdown()


class Gated:
    """The worker's offloader with slot submissions held at a gate, noting
    which thread made each."""

    def __init__(self, off):
        self._off = off
        self.gate = threading.Event()
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._off, name)

    def store_slot_job(self, job, *a):
        self.calls.append((job, threading.get_ident()))
        self.gate.wait(10)
        return self._off.store_slot_job(job, *a)

    def load_slot_job(self, job, *a):
        self.calls.append((job, threading.get_ident()))
        self.gate.wait(10)
        return self._off.load_slot_job(job, *a)


def test_before_pinning_settles_submissions_never_block_the_engines_thread():
    import kvoffload._testing as kt

    rt = kv.Runtime("sim")
    ts = kv_tensors(1)
    with kt.sim_hold(rt, "register") as hold:
        w = _slotworker.SlotWorker(
            caches(ts, [[0]]), num_slots=8, blocks_per_chunk=1, runtime=rt, options=dict(pin_threads=1),
            capture_hook=False,
        )
        hold.wait_entered()
        assert w.offloader.pin_state == "pinning"
        real = w.offloader
        g = w.offloader = Gated(real)
        want = fill(ts, [0, 1], random.Random(10))
        # Held at the gate, as a pageable copy holds its thread: both calls
        # return at once, and the thread submits them in order.
        assert w.submit_store(1, gpu([0], [1], [0]), chunks([3]))
        assert w.submit_store(2, gpu([1], [1], [0]), chunks([4]))
        assert w.jobs_queued == 2
        done = threading.Event()
        t = threading.Thread(target=lambda: (w.wait({1, 2}), done.set()))
        t.start()
        assert not done.wait(0.3), "wait() waits for jobs still queued"
        g.gate.set()
        t.join(10)
        assert done.is_set()
        assert [j for j, _ in g.calls] == [1, 2], "in submission order"
        assert all(th != threading.get_ident() for _, th in g.calls), "made by the submitter thread"
        assert sorted(r.job_id for r in w.get_finished()) == [1, 2]
        # A queued submission the offloader refuses is raised by get_finished.
        w.submit_store(3, gpu([2], [1], [0]), chunks([8]))
        w._submitter.wait_idle()
        with pytest.raises(kv.OptionsError, match="out of range"):
            w.get_finished()
    assert w.wait_pinned().state == "pinned"
    zero(ts)
    w.submit_load(4, chunks([3, 4]), gpu([5, 6], [2], [0]))
    assert g.calls[-1] == (4, threading.get_ident()), "pinned: the engine's thread submits directly"
    assert w.jobs_queued == 3
    w.wait([4])
    w.get_finished()
    assert [ts[0].block(5), ts[0].block(6)] == [want[(0, 0)], want[(0, 1)]]
    w.shutdown()
