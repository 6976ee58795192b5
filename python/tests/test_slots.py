"""Slot-addressed offloaders (``kvoffload.Offloader``: the engine picks host
slots and job ids, vLLM's shape) on the simulated GPU, with the engine's
KV tensors in host memory: CPU tensors whose storage the offloader adopts
as simulated device memory. No PyTorch here: the tensors are stand-ins
with torch's surface (``data_ptr()``, ``device.type``, ``untyped_storage()``,
``shape``, ``nbytes``); ``test_vllm.py`` runs the same path on real torch
tensors. Every byte is compared."""

import ctypes
import random
import threading

import pytest

import kvoffload as kv
import kvoffload._testing as kt

PAGE = 256
ROWS = 16


class Storage:
    """torch.UntypedStorage as far as the offloader looks."""

    def __init__(self, n):
        self.buf = (ctypes.c_uint8 * n)()

    def data_ptr(self):
        return ctypes.addressof(self.buf)

    def nbytes(self):
        return len(self.buf)


class Device:
    def __init__(self, type_, index=None):
        self.type = type_
        self.index = index


class CpuTensor:
    """A ``(rows, page)`` int8 CPU tensor at ``offset`` in ``storage``."""

    def __init__(self, storage, offset=0, rows=ROWS, page=PAGE, device="cpu"):
        self.storage, self.offset, self.page = storage, offset, page
        self.shape = (rows, page)
        self.nbytes = rows * page
        self.device = Device(device)

    def data_ptr(self):
        return self.storage.data_ptr() + self.offset

    def is_contiguous(self):
        return True

    def stride(self, dim):
        return (self.page, 1)[dim]

    def element_size(self):
        return 1

    def untyped_storage(self):
        return self.storage

    def block(self, b):
        return ctypes.string_at(self.data_ptr() + b * self.page, self.page)

    def write(self, b, data):
        assert len(data) == self.page
        ctypes.memmove(self.data_ptr() + b * self.page, data, self.page)


def kv_tensors(n, shared=True):
    """``n`` tensors, all views of one storage (as vLLM's) or one each."""
    if shared:
        st = Storage(n * ROWS * PAGE)
        return [CpuTensor(st, i * ROWS * PAGE) for i in range(n)]
    return [CpuTensor(Storage(ROWS * PAGE)) for _ in range(n)]


def fill(tensors, blocks, rng):
    want = {}
    for t_i, t in enumerate(tensors):
        for b in blocks:
            data = rng.randbytes(PAGE)
            t.write(b, data)
            want[(t_i, b)] = data
    return want


def zero(tensors):
    for t in tensors:
        ctypes.memset(t.data_ptr(), 0, t.nbytes)


@pytest.fixture
def rt():
    return kv.Runtime("sim")


def slot_offloader(rt, tensors, host_slots=8, **kw):
    """An Offloader over `tensors`; KvSpec's fields among `kw` go to it."""
    spec = {f: kw.pop(f) for f in ("gpu_blocks", "page_bytes", "block_factor", "compute_stream") if f in kw}
    kw.setdefault("pin", kv.PinOptions(threads=1))
    return kv.Offloader(host_slots, kv=kv.KvSpec(tensors, **spec), runtime=rt, **kw)


def test_a_round_trip_through_chosen_slots_on_adopted_cpu_tensors(rt):
    ts = kv_tensors(2)
    off = slot_offloader(rt, ts, start=True)
    assert type(off) is kv.Offloader and off.host_blocks == 8
    assert kt.sim_adopted_ranges(rt) == 1, "two views of one storage: one adoption"
    assert off.tensor_addresses[1] - off.tensor_addresses[0] == ROWS * PAGE
    assert off.tensor_addresses[0] != ts[0].data_ptr(), "a device address of the sim"
    want = fill(ts, [1, 2, 3], random.Random(1))
    off.store_slots(7, [1, 2, 3], [5, 0, 6])
    off.wait_jobs([7])
    (c,) = off.poll()
    assert (c.job, c.direction, c.keys, c.ok) == (7, "store", [], True)
    assert c.bytes == 3 * 2 * PAGE and c.seconds > 0
    zero(ts)
    off.load_slots(8, [9, 10, 11], [5, 0, 6])
    off.wait_jobs([8, 12345])  # an id never submitted is skipped
    (c,) = off.poll()
    assert (c.job, c.direction, c.bytes) == (8, "load", 3 * 2 * PAGE)
    for t_i, t in enumerate(ts):
        for b_src, b_dst in zip([1, 2, 3], [9, 10, 11]):
            assert t.block(b_dst) == want[(t_i, b_src)], (t_i, b_dst)
        for b in set(range(ROWS)) - {9, 10, 11}:
            assert t.block(b) == bytes(PAGE), f"untouched block {b} of tensor {t_i}"
    off.shutdown()
    assert kt.sim_adopted_ranges(rt) == 0, "released at shutdown"


def test_separate_storages_are_adopted_one_each_and_released(rt):
    ts = kv_tensors(3, shared=False)
    off = slot_offloader(rt, ts)
    assert kt.sim_adopted_ranges(rt) == 3
    off.shutdown()
    assert kt.sim_adopted_ranges(rt) == 0


def test_a_keyed_offloader_takes_cpu_tensors_too(rt):
    ts = kv_tensors(1)
    off = kv.KeyedOffloader(4, kv=kv.KvSpec(ts), runtime=rt, pin=kv.PinOptions(threads=1), start=True)
    want = fill(ts, [4], random.Random(2))
    off.store([11], [4])
    off.wait_all()
    off.poll()
    zero(ts)
    off.wait(off.load([11], [0]))
    off.poll()
    assert ts[0].block(0) == want[(0, 4)]
    off.shutdown()
    assert kt.sim_adopted_ranges(rt) == 0


def test_first_sub_places_a_partial_first_and_last_slot(rt):
    ts = kv_tensors(1)
    off = slot_offloader(rt, ts, block_factor=4, host_slots=4, start=True)
    rng = random.Random(3)
    want = fill(ts, [0, 1, 2, 3, 4, 5], rng)
    # Sub-blocks 1..3 of slot 2 and 0..2 of slot 3.
    off.store_slots(0, [0, 1, 2, 3, 4, 5], [2, 3], first_sub=1)
    off.wait_jobs([0])
    off.poll()
    zero(ts)
    # The whole of slot 3 back: sub-blocks 0, 1, 2 are blocks 3, 4, 5;
    # sub-block 3 was never written (zero host memory).
    off.load_slots(1, [8, 9, 10, 11], [3], first_sub=0)
    # Sub-blocks 2, 3 of slot 2: blocks 1, 2.
    off.load_slots(2, [12, 13], [2], first_sub=2)
    off.wait_jobs([1, 2])
    assert sorted(c.job for c in off.poll()) == [1, 2]
    t = ts[0]
    assert [t.block(b) for b in (8, 9, 10)] == [want[(0, b)] for b in (3, 4, 5)]
    assert t.block(11) == bytes(PAGE)
    assert [t.block(b) for b in (12, 13)] == [want[(0, 1)], want[(0, 2)]]
    off.shutdown()


def test_two_groups_share_slot_ids_and_touch_only_their_tensors(rt):
    ts = kv_tensors(3)  # group 0: tensors 0, 1; group 1: tensor 2
    off = slot_offloader(rt, ts, kv_groups=[2, 1], block_factor=2, start=True)
    want = fill(ts, range(ROWS), random.Random(4))
    # Group 0: blocks 0..3 into slots 0, 1; group 1: blocks 5, 6 from
    # sub-block 1 into slots 1, 2 (slot 1 shared, different parts).
    off.store_slot_job(40, [0, 1, 2, 3, 5, 6], [4, 2], [0, 1, 1, 2], [0, 1])
    off.wait_jobs([40])
    (c,) = off.poll()
    assert c.bytes == (4 * 2 + 2) * PAGE
    zero(ts)
    off.load_slot_job(41, [8, 9, 10, 11, 12, 13], [4, 2], [0, 1, 1, 2], [0, 1])
    off.wait_jobs([41])
    off.poll()
    for t_i in (0, 1):
        assert [ts[t_i].block(b) for b in (8, 9, 10, 11)] == [want[(t_i, b)] for b in (0, 1, 2, 3)]
        assert ts[t_i].block(12) == bytes(PAGE) and ts[t_i].block(13) == bytes(PAGE)
    assert [ts[2].block(b) for b in (12, 13)] == [want[(2, 5)], want[(2, 6)]]
    assert all(ts[2].block(b) == bytes(PAGE) for b in (8, 9, 10, 11))
    off.shutdown()


def test_numpy_like_id_arrays_are_taken_through_tolist(rt):
    class Ids:
        def __init__(self, v):
            self.v = v

        def tolist(self):
            return list(self.v)

    ts = kv_tensors(1)
    off = slot_offloader(rt, ts, start=True)
    want = fill(ts, [2], random.Random(5))
    off.store_slots(1, Ids([2]), Ids([3]))
    off.wait_jobs(Ids([1]))
    off.poll()
    zero(ts)
    off.load_slots(2, Ids([0]), Ids([3]))
    off.wait_jobs({2})
    off.poll()
    assert ts[0].block(0) == want[(0, 2)]
    off.shutdown()


# ---------------------------------------------------------------- errors


def test_a_reused_job_id_is_a_transfer_error(rt):
    off = slot_offloader(rt, kv_tensors(1), start=True)
    off.store_slots(3, [0], [0])
    off.wait_jobs([3])
    off.poll()
    with pytest.raises(kv.TransferError, match="job id 3 was already used") as e:
        off.load_slots(3, [1], [0])
    assert (e.value.kind, e.value.reason) == ("transfer", "job_id_reused")
    off.shutdown()


def test_a_busy_slot_is_a_transfer_error_until_poll_reports_the_job(rt):
    off = slot_offloader(rt, kv_tensors(1), start=True)
    off.wait_pinned()
    with kt.sim_hold(rt, "device_op") as hold:
        off.store_slots(1, [0], [4])
        hold.wait_entered()
        with pytest.raises(kv.TransferError, match="host slot 4 of group 0 is in use by job 1") as e:
            off.load_slots(2, [1], [4])
        assert e.value.kind == "slot_busy"
        with pytest.raises(kv.TransferError) as e:
            off.store_slots(3, [1], [4])
        assert e.value.kind == "slot_busy"
    off.wait_jobs([1])
    off.poll()
    off.load_slots(4, [1], [4])  # reported: readable now
    off.wait_jobs([4])
    off.shutdown()


def test_wait_jobs_waits_for_a_held_job_and_skips_the_rest(rt):
    off = slot_offloader(rt, kv_tensors(1), start=True)
    off.wait_pinned()
    done = threading.Event()
    with kt.sim_hold(rt, "device_op") as hold:
        off.store_slots(1, [0], [0])
        hold.wait_entered()
        off.wait_jobs([99, 100])  # none in flight: returns with the job held
        t = threading.Thread(target=lambda: (off.wait_jobs([99, 1]), done.set()))
        t.start()
        assert not done.wait(0.3), "wait_jobs returned while the job's copy was held"
    t.join(10)
    assert done.is_set()
    assert [c.job for c in off.poll()] == [1]
    off.shutdown()


def test_slot_job_shape_errors_are_options_errors(rt):
    off = slot_offloader(rt, kv_tensors(2), kv_groups=[1, 1], block_factor=2)
    with pytest.raises(kv.OptionsError, match="group_sizes entries") as e:
        off.store_slot_job(1, [0], [1], [0], [0])
    assert e.value.kind == "slot_job_shape"
    with pytest.raises(kv.OptionsError, match="host slot ids"):
        off.store_slot_job(1, [0, 1], [1, 1], [0], [0, 0])
    with pytest.raises(kv.OptionsError, match="first_sub 2 skips a whole host block") as e:
        off.store_slot_job(1, [0, 1], [1, 1], [0, 1, 0], [2, 0])
    assert e.value.reason == "first_sub_too_large"
    with pytest.raises(kv.OptionsError, match="a host slot id must be a non-negative int"):
        off.store_slot_job(1, [0, 1], [1, 1], [0, -1], [0, 0])
    off.shutdown()


def test_a_wrong_slot_count_names_the_need(rt):
    off = slot_offloader(rt, kv_tensors(1), block_factor=2)
    with pytest.raises(kv.OptionsError, match=r"3 GPU block\(s\) from sub-block 1 need 2 host block") as e:
        off.store_slots(1, [0, 1, 2], [0], first_sub=1)
    assert e.value.reason == "host_count_mismatch"
    with pytest.raises(kv.OptionsError, match="out of range"):
        off.store_slots(1, [0], [8])
    off.shutdown()


def test_the_constructors_refuse_what_their_class_cannot_do(rt):
    # The calls of the other class are missing (test_misuse.py); here the
    # arguments: addressing= is gone (the class decides), and each class
    # takes only its own arguments: kv_groups the slot-addressed Offloader,
    # eviction the KeyedOffloader (the other's is refused naming it).
    one = kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=4)
    with pytest.raises(kv.OptionsError, match=r"Offloader got unknown keyword arguments: addressing \(now the class"):
        kv.Offloader(4, kv=one, runtime=rt, addressing="slots")
    with pytest.raises(kv.OptionsError, match="KeyedOffloader got unknown keyword arguments: addressing"):
        kv.KeyedOffloader(4, kv=one, runtime=rt, addressing="keys")
    with pytest.raises(kv.OptionsError, match=r"kv_groups \(now kvoffload.Offloader\(kv_groups=...\): a KeyedOffloader's") as e:
        kv.KeyedOffloader(4, kv=one.replace(tensors=2), runtime=rt, kv_groups=[1, 1])
    assert e.value.kind == "options"
    with pytest.raises(kv.OptionsError, match=r"eviction \(now kvoffload.KeyedOffloader\(eviction=...\)") as e:
        kv.Offloader(4, kv=one, runtime=rt, eviction="arc")
    assert e.value.kind == "options"
    assert kt.sim_adopted_ranges(rt) == 0


def test_the_sim_refuses_tensors_it_cannot_adopt(rt):
    with pytest.raises(kv.OptionsError, match=r"tensors\[1\] is not a CPU tensor: the simulated GPU takes CPU"):
        slot_offloader(rt, [CpuTensor(Storage(ROWS * PAGE)), CpuTensor(Storage(ROWS * PAGE), device="cuda")])
    with pytest.raises(kv.OptionsError, match=r"tensors\[0\] is not a CPU tensor"):
        slot_offloader(rt, [12345], page_bytes=PAGE, gpu_blocks=ROWS)
    st = Storage(ROWS * PAGE)
    with pytest.raises(kv.OptionsError, match=r"tensors\[0\]: its 4096 bytes at .* are not inside its storage"):
        slot_offloader(rt, [CpuTensor(st, offset=PAGE)])
    with pytest.raises(kv.OptionsError, match="no stream 999 on this simulated GPU"):
        slot_offloader(rt, [CpuTensor(st)], compute_stream=999)
    assert kt.sim_adopted_ranges(rt) == 0, "a refused construction releases its adoptions"


def test_a_cpu_tensor_is_refused_off_the_sim():
    # No CUDA runtime is needed to see the refusal: without a GPU the
    # runtime cannot open, and the tensors are checked before it is used.
    if not kv.cuda_driver_present():
        with pytest.raises(kv.KvoffloadError):
            kv.Offloader(4, kv=kv.KvSpec([CpuTensor(Storage(ROWS * PAGE))]), runtime=kv.Runtime("cuda"))
        return
    with pytest.raises(kv.OptionsError, match="a cpu tensor; the KV cache must be in GPU memory"):
        kv.Offloader(4, kv=kv.KvSpec([CpuTensor(Storage(ROWS * PAGE))]), runtime=kv.Runtime("cuda"))


def test_the_adopted_tensors_stay_alive_until_shutdown(rt):
    import gc
    import weakref

    st = Storage(ROWS * PAGE)
    off = slot_offloader(rt, [CpuTensor(st)])
    gone = weakref.ref(st)
    del st
    gc.collect()
    assert gone() is not None, "the offloader keeps its tensors (and their storage) alive"
    off.shutdown()
    gc.collect()
    assert gone() is None


def test_an_expedited_load_runs_on_its_own_lane_and_moves_every_byte(rt):
    ts = kv_tensors(2)
    off = slot_offloader(rt, ts, start=True, transfer=kv.TransferOptions(expedited_lane=True))
    want = fill(ts, [1, 2], random.Random(7))
    off.store_slots(1, [1, 2], [3, 4])
    off.wait_jobs([1])
    (c,) = off.poll()
    assert c.lane == "store"
    zero(ts)
    off.load_slots(2, [5, 6], [3, 4], expedited=True)
    off.load_slot_job(3, [7], [1], [3], [0], expedited=True)
    off.wait_jobs([2, 3])
    done = {c.job: c for c in off.poll()}
    assert {j: (c.direction, c.lane, c.ok) for j, c in done.items()} == {
        2: ("load", "load_expedited", True),
        3: ("load", "load_expedited", True),
    }
    for t_i, t in enumerate(ts):
        assert t.block(5) == want[(t_i, 1)] and t.block(6) == want[(t_i, 2)]
        assert t.block(7) == want[(t_i, 1)]
    off.load_slots(4, [8], [4])
    off.wait_jobs([4])
    (c,) = off.poll()
    assert c.lane == "load", "a regular load stays on the load lane"
    off.shutdown()


def test_an_expedited_load_without_the_lane_is_refused(rt):
    ts = kv_tensors(1)
    off = slot_offloader(rt, ts, start=True)
    off.store_slots(1, [1], [0])
    off.wait_jobs([1])
    off.poll()
    with pytest.raises(kv.TransferError) as e:
        off.load_slots(2, [2], [0], expedited=True)
    assert e.value.reason == "no_expedited_lane", (e.value.kind, e.value.reason)
    off.shutdown()
