"""kvoffload._slotworker.SlotWorker, the vLLM-free worker that
kvoffload.vllm.KvoffloadWorker is made of (and that the H200 run drives
without vLLM), on the simulated GPU with stand-ins for vLLM's specs and
canonical KV caches. test_vllm.py drives the same class through vLLM."""

import random
import re
import threading
from types import SimpleNamespace as NS

import numpy as np  # vLLM's DevicePointers are numpy arrays (ci/python installs numpy)
import pytest

import kvoffload as kv
import kvoffload._testing as kt
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
        options=dict(pin=kv.PinOptions(threads=1)), hook_class=Graph,
    )
    assert type(w.offloader) is kv.Offloader and w.num_groups == 2
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
    with pytest.raises(TypeError, match="expected a GPULoadStoreSpec or DevicePointers, got SimpleNamespace"):
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


def one_group_worker(rt, ts, pin=None, **kw):
    """A worker over ``ts`` as one group on ``rt``: 8 slots, a block per
    chunk, one pre-fault thread (or ``pin``), no capture hook."""
    pin = pin or kv.PinOptions(threads=1)
    return _slotworker.SlotWorker(
        caches(ts, [[0]]), num_slots=8, blocks_per_chunk=1, runtime=rt, options=dict(pin=pin), capture_hook=False, **kw
    )


def test_before_pinning_settles_submissions_never_block_the_engines_thread():
    rt = kv.Runtime("sim")
    ts = kv_tensors(1)
    with kt.sim_hold(rt, "register") as hold:
        w = one_group_worker(rt, ts)
        hold.wait_entered()
        assert w.offloader.pin_progress.state == "pinning"
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


# ---------------------------------------------------------------- vLLM 0.34: device pointers, failed results


def pointers(ts, groups, block_ids, group_sizes, block_indices, nudge=None):
    """vLLM 0.34's ``DevicePointers`` for a job, as its connector resolves
    them (``pointer_utils.resolve_device_pointers``): per group, per data
    ref, per block, the tensor's address + block id * stride(0), and the
    page bytes. ``nudge(i, ptr)`` changes pointer ``i``."""
    ptrs, sizes = [], []
    at = 0
    for g, n in zip(groups, group_sizes):
        ids = block_ids[at : at + n]
        for t in g:
            for b in ids:
                ptrs.append(ts[t].data_ptr() + b * ts[t].stride(0))
                sizes.append(PAGE)
        at += n
    if nudge is not None:
        ptrs = [nudge(i, p) for i, p in enumerate(ptrs)]
    return NS(
        ptrs=np.array(ptrs, dtype=np.uint64),
        sizes=np.array(sizes, dtype=np.uint64),
        group_block_counts=tuple(group_sizes),
        group_data_ref_counts=tuple(len(g) for g in groups),
        block_indices=tuple(block_indices),
    )


def pinned_worker(ts, groups, failed_results=False, **kw):
    w = _slotworker.SlotWorker(
        caches(ts, groups), num_slots=8, blocks_per_chunk=2, runtime=kv.Runtime("sim"),
        options=dict(pin=kv.PinOptions(threads=1)), capture_hook=False, failed_results=failed_results, **kw,
    )
    w.wait_pinned()
    return w


def test_device_pointers_move_the_same_blocks_as_block_ids():
    ts = kv_tensors(3)
    groups = [[2], [0, 1]]
    w = pinned_worker(ts, groups)
    want = fill(ts, range(8), random.Random(11))
    # As the first test: group 0 blocks 1, 2 from logical block 3; group 1 blocks 4..6 from 0.
    assert w.submit_store(10, pointers(ts, groups, [1, 2, 4, 5, 6], [2, 3], [3, 0]), chunks([1, 2, 5, 6]))
    w.wait({10})
    (r,) = w.get_finished()
    assert (r.job_id, r.success, r.transfer_size) == (10, True, (2 + 3 * 2) * PAGE)
    zero(ts)
    assert w.submit_load(11, chunks([1, 2, 5, 6]), pointers(ts, groups, [9, 10, 11, 12, 13], [2, 3], [3, 0]))
    w.wait({11})
    assert [r.job_id for r in w.get_finished()] == [11]
    assert [ts[2].block(b) for b in (9, 10)] == [want[(2, 1)], want[(2, 2)]]
    for t in (0, 1):
        assert [ts[t].block(b) for b in (11, 12, 13)] == [want[(t, b)] for b in (4, 5, 6)]
    # A group with no blocks in this job (vLLM skips it when resolving).
    assert w.submit_store(12, pointers(ts, groups, [3], [0, 1], [0, 6]), chunks([3]))
    w.wait({12})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(12, True)]
    w.shutdown()


@pytest.mark.parametrize(
    "nudge, words",
    [
        (lambda i, p: p + 1 if i == 0 else p, "not a block of KV tensor"),
        (lambda i, p: p - 3 * PAGE if i == 0 else p, "not a block of KV tensor"),  # below the tensor
        (lambda i, p: p + 64 * PAGE * 1000 if i == 0 else p, "not a block of KV tensor"),
        # Exactly one block past the tensor's end (block 1 + 15 of 16):
        # refused here, as an OptionsError naming it, not by the Rust check
        # (issue 45, item 8).
        (lambda i, p: p + 15 * PAGE if i == 0 else p, "not a block of KV tensor 2 \\(16 blocks"),
        (lambda i, p: p + PAGE if i == 3 else p, "data ref 1 of group 1 points at other blocks"),
    ],
)
def test_device_pointers_outside_the_registered_blocks_are_refused_naming_them(nudge, words):
    ts = kv_tensors(3)
    groups = [[2], [0, 1]]
    w = pinned_worker(ts, groups)
    with pytest.raises(ValueError, match=words):
        w.submit_store(1, pointers(ts, groups, [1, 2, 4], [2, 1], [0, 0], nudge=nudge), chunks([0, 1]))
    bad_sizes = pointers(ts, groups, [1], [1, 0], [0, 0])
    bad_sizes.sizes[0] = PAGE - 8
    with pytest.raises(ValueError, match=f"copies \\[{PAGE - 8}\\] bytes per block; its tensor's pages are {PAGE}"):
        w.submit_store(2, bad_sizes, chunks([0]))
    wrong_groups = pointers(ts, [[2], [0]], [1, 2], [1, 1], [0, 0])
    with pytest.raises(ValueError, match="this worker registered groups of \\[1, 2\\]"):
        w.submit_store(3, wrong_groups, chunks([0, 1]))
    w.shutdown()


def with_field(dp, field, value):
    """``dp`` with ``field`` replaced (``value(old)``)."""
    return NS(**{**vars(dp), field: value(getattr(dp, field))})


# Issue 43 item 7: each of these was taken (floats truncated, bools as 0/1,
# negative block indices taken modulo blocks_per_chunk: the job ran, on
# other blocks than vLLM meant) or refused with an OverflowError naming
# nothing (negative or 2**64 pointers).
@pytest.mark.parametrize(
    "field, value, words",
    [
        ("ptrs", lambda a: a.astype(np.float64), "DevicePointers.ptrs must hold ints in [0, 2**64), not float64 values"),
        ("ptrs", lambda a: [float(p) for p in a], "DevicePointers.ptrs[0] must be an int in [0, 2**64), not "),
        ("ptrs", lambda a: [-1] + a.tolist()[1:], "DevicePointers.ptrs[0] = -1 is out of range: it must be in [0, 2**64)"),
        ("ptrs", lambda a: a.tolist()[:-1] + [2**64], "DevicePointers.ptrs[3] = 18446744073709551616 is out of range"),
        ("ptrs", lambda a: a.astype(np.bool_), "DevicePointers.ptrs must hold ints in [0, 2**64), not bool values"),
        ("sizes", lambda a: a.astype(np.float32), "DevicePointers.sizes must hold ints in [0, 2**64), not float32 values"),
        ("sizes", lambda a: [np.float64(x) for x in a], "DevicePointers.sizes[0] must be an int in [0, 2**64), not "),
        ("group_block_counts", lambda c: (2.0, 1), "DevicePointers.group_block_counts[0] must be an int in [0, 2**63), not 2.0 (float)"),
        ("group_data_ref_counts", lambda c: (True, 2), "DevicePointers.group_data_ref_counts[0] must be an int in [0, 2**63), not True (bool)"),
        ("block_indices", lambda b: (-2, 0), "DevicePointers.block_indices[0] = -2 is out of range: it must be in [0, 2**63)"),
        ("block_indices", lambda b: (-1, 0), "DevicePointers.block_indices[0] = -1 is out of range"),
        ("block_indices", lambda b: (3.7, 0), "DevicePointers.block_indices[0] must be an int in [0, 2**63), not 3.7 (float)"),
        ("block_indices", lambda b: (2.0, 0), "DevicePointers.block_indices[0] must be an int in [0, 2**63), not 2.0 (float)"),
        ("block_indices", lambda b: (False, 0), "DevicePointers.block_indices[0] must be an int in [0, 2**63), not False (bool)"),
        ("block_indices", lambda b: (np.float64(0), 0), "DevicePointers.block_indices[0] must be an int in [0, 2**63), not "),
        ("block_indices", lambda b: np.array([0.0, 0.0]), "DevicePointers.block_indices must hold ints in [0, 2**63), not float64"),
        ("block_indices", lambda b: 0, "DevicePointers.block_indices must be a sequence of ints, not int"),
    ],
)
def test_device_pointers_of_other_types_or_out_of_range_are_refused_naming_the_field(field, value, words):
    ts = kv_tensors(3)
    groups = [[2], [0, 1]]
    w = pinned_worker(ts, groups)
    # Group 0: blocks 1, 2 of tensor 2; group 1: block 4 of tensors 0, 1 (4 copies).
    good = pointers(ts, groups, [1, 2, 4], [2, 1], [0, 0])
    bad = with_field(good, field, value)
    words = words.replace("2**64", str(2**64)).replace("2**63", str(2**63))
    with pytest.raises(kv.OptionsError, match=re.escape(words)) as e:
        w.submit_store(1, bad, chunks([0, 1]))
    assert isinstance(e.value, ValueError) and e.value.kind == "options"
    # Integer numpy arrays of any integer dtype, numpy integers and ints
    # are taken (as vLLM gives them: uint64 arrays, tuples of ints).
    for job, ok in enumerate(
        (
            with_field(good, "ptrs", lambda a: a.astype(np.int64)),
            with_field(good, "sizes", lambda a: [int(x) for x in a]),
            with_field(good, "block_indices", lambda b: (np.int32(2), np.uint64(4))),
            with_field(good, "group_block_counts", lambda c: np.array(c, dtype=np.int16)),
        ),
        start=2,
    ):
        assert w.submit_store(job, ok, chunks([0, 1]))
        w.wait({job})
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(job, True)]
    w.shutdown()


def test_a_block_index_of_a_gpu_load_store_spec_must_be_a_non_negative_int():
    w = pinned_worker(kv_tensors(1), [[0]])
    for bad, words in [((-1,), "[0] = -1 is out of range"), ((1.0,), "[0] must be an int in [0, ")]:
        with pytest.raises(kv.OptionsError, match=re.escape("GPULoadStoreSpec.block_indices" + words)):
            w.submit_store(1, gpu([0], [1], bad), chunks([0]))
    w.shutdown()


@pytest.mark.parametrize(
    "nudge, words",
    [
        # Group 0 is vLLM's tensor 2 (the worker's first); data ref 1 of
        # group 1 is vLLM's tensor 1 (the worker's third).
        (lambda i, p: p + 1 if i == 0 else p, "not a block of KV tensor 2 ("),
        (lambda i, p: p + PAGE if i == 3 else p, "points at other blocks than data ref 0 (or outside KV tensor 1)"),
    ],
)
def test_a_refused_device_pointer_names_the_tensor_by_vllms_tensor_idx(nudge, words):
    ts = kv_tensors(3)
    groups = [[2], [0, 1]]
    w = pinned_worker(ts, groups)
    with pytest.raises(kv.OptionsError, match=re.escape(words)):
        w.submit_store(1, pointers(ts, groups, [1, 2, 4], [2, 1], [0, 0], nudge=nudge), chunks([0, 1]))
    bad_sizes = pointers(ts, groups, [1, 4], [1, 1], [0, 0])
    bad_sizes.sizes[2] = PAGE - 8  # group 1's data ref 1: vLLM's tensor 1
    with pytest.raises(kv.OptionsError, match=re.escape("data ref 1 of group 1 (KV tensor 1) copies")):
        w.submit_store(2, bad_sizes, chunks([0, 1]))
    w.shutdown()


def test_a_submission_after_shutdown_is_a_shut_down_error_of_kind_shut_down():
    w = pinned_worker(kv_tensors(1), [[0]])
    w.shutdown()
    with pytest.raises(kv.ShutDownError) as e:
        w.submit_store(1, gpu([0], [1], [0]), chunks([0]))
    assert (e.value.kind, e.value.reason) == ("shut_down", "shut_down")


def test_with_failed_results_a_refused_job_is_reported_failed_once_and_the_worker_goes_on():
    ts = kv_tensors(3)
    groups = [[2], [0, 1]]
    w = pinned_worker(ts, groups, failed_results=True)
    bad = pointers(ts, groups, [1, 2, 4], [2, 1], [0, 0], nudge=lambda i, p: p + 1 if i == 0 else p)
    assert w.submit_store(1, bad, chunks([0, 1])) is True, "vLLM 0.34 asserts a submission's True"
    assert w.submit_store(2, gpu([0], [1, 0], [0, 0]), chunks([9])) is True, "slot 9 is out of range"
    w.wait({1, 2})  # failed jobs are not waited for, nor raised
    res = sorted(w.get_finished(), key=lambda r: r.job_id)
    assert [(r.job_id, r.success, r.transfer_size) for r in res] == [(1, False, None), (2, False, None)]
    assert w.get_finished() == [], "each failure reported once"
    want = fill(ts, range(8), random.Random(12))
    assert w.submit_store(3, pointers(ts, groups, [5, 6], [1, 1], [0, 0]), chunks([4, 5]))
    w.wait({3})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(3, True)]
    zero(ts)
    w.submit_load(4, chunks([4, 5]), pointers(ts, groups, [7, 7], [1, 1], [0, 0]))
    w.wait({4})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(4, True)]
    assert ts[2].block(7) == want[(2, 5)] and ts[0].block(7) == want[(0, 6)] and ts[1].block(7) == want[(1, 6)]
    w.shutdown()


class FailingPoll:
    """The worker's offloader, reporting job ``job`` failed on the GPU."""

    def __init__(self, off, job):
        self._off, self.job = off, job

    def __getattr__(self, name):
        return getattr(self._off, name)

    def poll(self):
        out = []
        for c in self._off.poll():
            if c.job == self.job:
                c = NS(job=c.job, direction=c.direction, error=kv.DriverError("copy failed (injected)"), bytes=0, seconds=0.0)
            out.append(c)
        return out


@pytest.mark.parametrize("failed_results", [False, True])
def test_a_job_that_fails_on_the_gpu_is_raised_or_reported_failed(failed_results):
    ts = kv_tensors(1)
    w = pinned_worker(ts, [[0]], failed_results=failed_results)
    w.offloader = FailingPoll(w.offloader, job=1)
    w.submit_store(1, gpu([0], [1], [0]), chunks([0]))
    w.submit_store(2, gpu([1], [1], [0]), chunks([1]))
    w.wait({1, 2})
    if failed_results:
        res = sorted(w.get_finished(), key=lambda r: r.job_id)
        assert [(r.job_id, r.success) for r in res] == [(1, False), (2, True)]
    else:
        with pytest.raises(kv.TransferError, match=r"job 1 \(store\) failed: copy failed \(injected\)"):
            w.get_finished()
    w.shutdown()


def test_with_failed_results_a_queued_submission_that_fails_is_reported_failed():
    rt = kv.Runtime("sim")
    ts = kv_tensors(1)
    with kt.sim_hold(rt, "register") as hold:
        w = one_group_worker(rt, ts, failed_results=True)
        hold.wait_entered()
        w.submit_store(1, gpu([0], [1], [0]), chunks([8]))  # queued (pinning): refused in the thread
        w.submit_store(2, gpu([1], [1], [0]), chunks([1]))
        assert w.jobs_queued == 2
        w.wait({1, 2})
        w._submitter.wait_idle()
        w.offloader.wait_all()
        res = sorted(w.get_finished(), key=lambda r: r.job_id)
        assert [(r.job_id, r.success) for r in res] == [(1, False), (2, True)]
    w.shutdown()


# ---------------------------------------------------------------- a pin hold over the engine's warm-up


def test_a_pin_hold_until_served_ends_at_the_first_job_or_release():
    from test_sim import eventually

    for end in ("job", "release", "shutdown"):
        rt = kv.Runtime("sim")
        ts = kv_tensors(1)
        # Chunk 0's registration held in the sim, so the hold below comes
        # before the next one (two chunks: 8 slots, 4 per chunk).
        with kt.sim_hold(rt, "register") as reg:
            w = one_group_worker(rt, ts, pin=kv.PinOptions(threads=1, max_chunk_bytes=4 * 4096))
            reg.wait_entered()
            w.hold_pinning_until_served("the test's warm-up")
        eventually(f"{end}: chunk 1 held back", lambda: kt.activity(w.offloader)["registrations_held"] == 1)
        assert w.offloader.pin_progress.chunks_done == 1 and w.pin_held_seconds is None
        if end == "job":
            fill(ts, [0], random.Random(3))
            assert w.submit_store(1, gpu([0], [1], [0]), chunks([0]))
        elif end == "release":
            w.release_pin_hold("the test's warm-up ended")
        else:
            w.shutdown()
            assert w.pin_held_seconds is not None
            continue
        assert w.pin_held_seconds is not None and kt.activity(w.offloader)["pin_holds"] == 0
        assert w.wait_pinned().state == "pinned"
        w.shutdown()
