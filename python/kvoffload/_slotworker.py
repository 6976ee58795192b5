"""The worker half of kvoffload's vLLM integration, free of vLLM:
``kvoffload.vllm.KvoffloadWorker`` is this class with vLLM's
``OffloadingWorker`` as a second base, and the H200 run of issue 21
(``python/examples/h200_vllm_worker.py``) drives this class directly, the
way vLLM's connector drives the worker, where vLLM's wheel is not
installed.

Inputs are duck-typed as vLLM 0.26 - 0.34 give them: ``kv_caches`` with
``tensors[i].tensor`` / ``.page_size_bytes`` and
``group_data_refs[g][j].tensor_idx`` / ``.page_size_bytes`` (vLLM's
``CanonicalKVCaches``); the GPU side of a job either as block ids
(``block_ids``, ``group_sizes``, ``block_indices``: ``GPULoadStoreSpec``,
up to 0.33) or as device addresses (``ptrs``, ``sizes``,
``group_block_counts``, ``group_data_ref_counts``, ``block_indices``:
0.34's ``DevicePointers``, mapped back to block ids of the registered
tensors and checked); the host side as ``block_ids`` (the chunk ids of
``CPULoadStoreSpec``).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import kvoffload

log = logging.getLogger("kvoffload.vllm")


def _error(cls: type, message: str, kind: str, reason: Optional[str] = None) -> BaseException:
    """A kvoffload exception raised here, with the ``kind`` and ``reason``
    the package's own (raised by its Rust part) carry."""
    e = cls(message)
    e.kind, e.reason = kind, reason
    return e


def _options_error(message: str) -> BaseException:
    return _error(kvoffload.OptionsError, message, "options")


def layout(kv_caches: Any) -> Tuple[List[Any], List[int]]:
    """vLLM's canonical KV caches as the offloader's tensors and groups: the
    tensors in group order, and how many each group has. Refuses (with
    ``kvoffload.OptionsError``) what the slot layout cannot take yet."""
    order: List[int] = []
    sizes: List[int] = []
    seen: Dict[int, int] = {}
    for g, refs in enumerate(kv_caches.group_data_refs):
        for r in refs:
            if r.tensor_idx in seen:
                raise _options_error(
                    f"kvoffload.vllm: KV tensor {r.tensor_idx} is referenced by group {seen[r.tensor_idx]} and "
                    f"group {g}: KV cache groups that share a tensor (hybrid overlays, packed layouts) are not "
                    "supported yet"
                )
            seen[r.tensor_idx] = g
            t = kv_caches.tensors[r.tensor_idx]
            if r.page_size_bytes != t.page_size_bytes:
                raise _options_error(
                    f"kvoffload.vllm: group {g} moves {r.page_size_bytes} bytes of tensor {r.tensor_idx}'s "
                    f"{t.page_size_bytes}-byte pages: unpadded pages smaller than the tensor's are not supported yet"
                )
            if t.tensor.stride(0) * t.tensor.element_size() != t.page_size_bytes:
                raise _options_error(
                    f"kvoffload.vllm: KV tensor {r.tensor_idx} has block stride "
                    f"{t.tensor.stride(0) * t.tensor.element_size()} bytes for {t.page_size_bytes}-byte pages: "
                    "only one page per block row (stride == page) is supported"
                )
            order.append(r.tensor_idx)
        sizes.append(len(refs))
    if any(n == 0 for n in sizes):
        raise _options_error(f"kvoffload.vllm: a KV cache group references no tensor ({sizes})")
    if not order:
        raise _options_error("kvoffload.vllm: no KV cache group references a tensor")
    return [kv_caches.tensors[i] for i in order], sizes


_U64 = 1 << 64
_I64 = 1 << 63


def _ints(spec: str, field: str, values: Any, end: int, array: bool = False) -> Any:
    """``spec.field`` of vLLM's job spec as a list of ints (``array``: a
    ``uint64`` numpy array; DevicePointers only, which needs numpy), each in
    ``[0, end)``, given as a 1-D numpy array of an integer dtype or a
    sequence of ints (numpy integers too). Anything else (a bool or a
    float, which ``int()`` truncated and ``%`` wrapped when negative, before)
    or a value out of range (an ``OverflowError`` naming nothing, before) is
    a ``kvoffload.OptionsError`` naming the field and the value."""
    try:
        import numpy as np
    except ImportError:  # vLLM 0.26 - 0.33 hand Python lists; 0.34 needs numpy
        np = None

    def bad(what: str) -> Exception:
        sep = "" if what.startswith("[") else " "
        return _options_error(f"kvoffload.vllm: {spec}.{field}{sep}{what}")

    if np is not None and isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":  # "b" (bool), "f", "c", "O", ... are not ints
            raise bad(f"must hold ints in [0, {end}), not {values.dtype} values")
        if values.ndim != 1:
            raise bad(f"must be one-dimensional, not of shape {values.shape}")
        # min and max as Python ints: exact for every integer dtype.
        if values.size and (int(values.min()) < 0 or int(values.max()) >= end):
            i, v = next((i, v) for i, v in enumerate(values.tolist()) if not 0 <= v < end)
            raise bad(f"[{i}] = {v} is out of range: it must be in [0, {end})")
        return values.astype(np.uint64) if array else values.tolist()
    try:
        items = list(values)
    except TypeError:
        raise bad(f"must be a sequence of ints, not {type(values).__name__}") from None
    int_types = (int,) if np is None else (int, np.integer)
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, int_types):  # numpy's bool_ is no np.integer
            raise bad(f"[{i}] must be an int in [0, {end}), not {v!r} ({type(v).__name__})")
        if not 0 <= int(v) < end:
            raise bad(f"[{i}] = {int(v)} is out of range: it must be in [0, {end})")
    out = [int(v) for v in items]
    return np.array(out, dtype=np.uint64) if array else out


class _Submitter:
    """Submissions that must not block the engine's thread: until pinning
    is ``pinned`` (and for good if it ends pageable), a job's copies may
    touch pageable host memory, which the driver copies synchronously for
    the submitting thread (measured on the H200: a load submit of 3 MiB took
    99 ms while a 64 GiB region pinned). Such jobs are queued here and
    submitted, in order, by one thread; once pinning is ``pinned`` and the
    queue is empty, the caller's thread submits directly (an async enqueue).
    A job that waited here is ordered after the compute stream's work at
    its actual submission, a later point, which vLLM's contract allows (a
    pending store's blocks are fenced, a load's destination is unused until
    reported). Errors of queued submissions are raised by :meth:`check`."""

    def __init__(self, off: Any):
        self.off = off
        self.cv = threading.Condition()
        self.queue: Deque[Tuple[Callable[..., None], int, tuple]] = collections.deque()
        self.pending: Set[int] = set()
        self.errors: List[Tuple[int, BaseException]] = []
        self.queued_total = 0
        self.closed = False
        # Started now, not at the first queued job: a thread's start maps
        # its stack, which waits for the process's memory-map lock that the
        # pinner's pre-fault holds (30 ms seen on the H200 for the first
        # submission, made inside a graph capture).
        self.thread = threading.Thread(target=self._run, name="kvoffload-submit", daemon=True)
        self.thread.start()
        # Set once pinning is "pinned" (final), by a watcher blocked in
        # wait_pinned (GIL released): the engine's thread never asks the
        # offloader's coordinator (whose lock a registration in progress
        # can hold for a while) on a submission.
        self.pinned = False
        self.watcher = threading.Thread(target=self._watch, name="kvoffload-pin-watch", daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        try:
            state = self.off.wait_pinned().state
        except BaseException:  # noqa: BLE001 - shut down meanwhile: stays queued
            return
        if state == "pinned":
            with self.cv:
                self.pinned = True

    def submit(self, call: Callable[..., None], job_id: int, args: tuple) -> None:
        with self.cv:
            if self.closed:
                raise _error(kvoffload.ShutDownError, "kvoffload.vllm: the worker is shut down", "shut_down", "shut_down")
            if not self.queue and self.pinned:
                direct = True
            else:
                direct = False
                self.queue.append((call, job_id, args))
                self.pending.add(job_id)
                self.queued_total += 1
                self.cv.notify_all()
        if direct:
            call(job_id, *args)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.closed:
                    self.cv.wait()
                if not self.queue:
                    return
                call, job_id, args = self.queue[0]
            try:
                call(job_id, *args)
            except BaseException as e:  # noqa: BLE001 - raised on the engine's thread by check()
                with self.cv:
                    self.errors.append((job_id, e))
            with self.cv:
                self.queue.popleft()
                self.pending.discard(job_id)
                self.cv.notify_all()

    def check(self) -> None:
        """Raises the first error a queued submission met (for a vLLM with
        no failure path: a job that was never submitted would hang its
        request)."""
        with self.cv:
            if self.errors:
                job_id, e = self.errors.pop(0)
                raise e

    def take_errors(self) -> List[Tuple[int, BaseException]]:
        """The errors queued submissions met since the last call, each once
        (for a vLLM that takes failed results)."""
        with self.cv:
            errors, self.errors = self.errors, []
        return errors

    def wait_submitted(self, ids: Set[int]) -> None:
        """Blocks until none of ``ids`` waits in the queue."""
        with self.cv:
            while self.pending & ids:
                self.cv.wait()

    def wait_idle(self) -> None:
        """Blocks until the queue is empty (everything queued submitted)."""
        with self.cv:
            while self.queue:
                self.cv.wait()

    def close(self) -> None:
        """Submits what is queued, then stops the thread."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.thread.join()


class SlotWorker:
    """vLLM's worker interface (``submit_store``, ``submit_load``,
    ``get_finished``, ``wait``, ``shutdown``) on a slot-addressed
    :class:`kvoffload.Offloader`: chunk id ``c`` is host slot ``c``, vLLM's
    job ids are the offloader's, ``first_sub`` of group ``g`` is
    ``block_indices[g] % blocks_per_chunk``.

    Construction maps the region and starts pinning on the offloader's
    own thread (``start=True``), then returns: it never waits for pinning.
    Until pinning is ``pinned``, submissions go through a thread of their
    own (:class:`_Submitter`), so they never block the engine's thread.
    With ``capture_hook`` every CUDA graph capture of the process
    (``torch.cuda.CUDAGraph``) runs in a capture window of this offloader
    until :meth:`shutdown`. ``result(job_id, success, size, seconds)`` makes
    what :meth:`get_finished` returns (vLLM's ``TransferResult``), with the
    job's device seconds (``Completion.device_seconds``) as its time.

    A job that fails (at submission, in the submitter thread, or on the
    GPU) is raised by the next :meth:`get_finished` or :meth:`wait`, or,
    with ``failed_results`` (vLLM 0.34+, whose connector fails the request
    of a failed load and drops the chunks of a failed store), reported
    once as ``result(job_id, success=False)`` and logged: the engine goes
    on."""

    def __init__(
        self,
        kv_caches: Any,
        *,
        num_slots: int,
        blocks_per_chunk: int,
        runtime: "kvoffload.Runtime",
        options: Optional[Dict[str, Any]] = None,
        capture_hook: bool = True,
        stream: Any = None,
        result: Callable[..., Any] = None,
        hook_class: Optional[type] = None,
        failed_results: bool = False,
        pool: Any = None,
        pool_rank: int = 0,
    ):
        tensors, sizes = layout(kv_caches)
        # vLLM's tensor_idx of each, in the same (group) order: messages
        # name a tensor as vLLM does.
        self._tensor_ids = [r.tensor_idx for refs in kv_caches.group_data_refs for r in refs]
        self.num_groups = len(sizes)
        self._refs_per_group = sizes
        # Per tensor, in group order: (address, block stride in bytes, page
        # bytes, blocks) to map device pointers back to block ids.
        self._tensor_rows = [
            (t.tensor.data_ptr(), t.tensor.stride(0) * t.tensor.element_size(), t.page_size_bytes, t.tensor.shape[0])
            for t in tensors
        ]
        self.failed_results = failed_results
        # A node pool (kvoffload.Pool, joined as this rank's worker): host
        # slots are its slots, each job's host side names their epochs.
        self.pool = pool
        self.pool_rank = pool_rank
        # kvo_pool_keep false: the last engine to leave removes the pool
        # (the vLLM worker sets it from its settings).
        self.pool_keep = True
        # Store jobs on the pool: job id -> (slots, epochs), whose rank bit
        # get_finished sets when the job completes.
        self._pool_stores: Dict[int, Tuple[List[int], List[int]]] = {}
        # Jobs that failed before reaching the GPU, reported by get_finished.
        self._failed: List[Tuple[int, BaseException]] = []
        self._failed_lock = threading.Lock()
        self.blocks_per_chunk = blocks_per_chunk
        self.runtime = runtime
        self._result = result if result is not None else _Result
        kw: Dict[str, Any] = dict(options or {})
        if stream is None and runtime.backend == "cuda":
            import torch

            stream = torch.cuda.current_stream().cuda_stream
        kw.update(
            kv=kvoffload.KvSpec(
                [t.tensor for t in tensors], block_factor=blocks_per_chunk, compute_stream=stream
            ),
            runtime=runtime,
            kv_groups=sizes,
            # Windows of lexical capture_window() calls also open while
            # pinning runs (the hook's always do).
            pin=(kw.get("pin") or kvoffload.PinOptions()).replace(policy="interleave"),
            # vLLM's expedited (synchronous) loads on a stream of their own,
            # never behind the regular loads it is not waiting for.
            transfer=(kw.get("transfer") or kvoffload.TransferOptions()).replace(expedited_lane=True),
        )
        t0 = time.monotonic()
        self.offloader = kvoffload.Offloader(num_slots, start=True, **kw)
        self.setup_seconds = time.monotonic() - t0
        self._submitter = _Submitter(self.offloader)
        self._hook = None
        if capture_hook:
            from . import _hook

            self._hook = _hook.install(self.offloader, hook_class)
        self._shut = False
        # A pin hold over the engine's warm-up and graph capture
        # (hold_pinning_until_served); released once, by whichever comes
        # first: the warm-up's end, the first job, shutdown.
        self._pin_hold: Any = None
        self._pin_hold_lock = threading.Lock()
        self._pin_hold_since = 0.0
        #: Seconds pinning was held back (None: never held).
        self.pin_held_seconds: Optional[float] = None

    def hold_pinning_until_served(self, why: str) -> None:
        """Holds pinning back (``Offloader.hold_pinning``) until
        :meth:`release_pin_hold`, the first submitted job or
        :meth:`shutdown`, whichever comes first: an engine that builds this
        worker before it warms up and captures its graphs (vLLM 0.26 - 0.33)
        captures without a registration beside it. A registration in
        flight completes; pre-faulting goes on."""
        with self._pin_hold_lock:
            if self._pin_hold is None and not self._shut:
                self._pin_hold = self.offloader.hold_pinning()
                self._pin_hold_since = time.monotonic()
                log.info("kvoffload.vllm: pinning held back: %s", why)

    def release_pin_hold(self, why: str) -> None:
        """Lets pinning go on if :meth:`hold_pinning_until_served` held it
        (idempotent)."""
        with self._pin_hold_lock:
            hold, self._pin_hold = self._pin_hold, None
            if hold is None:
                return
            hold.release()
            self.pin_held_seconds = time.monotonic() - self._pin_hold_since
        log.info("kvoffload.vllm: pinning resumed after %.1f s held back (%s)", self.pin_held_seconds, why)

    def _job(self, gpu: Any, chunks: Any):
        f = self.blocks_per_chunk
        if hasattr(gpu, "ptrs"):
            blocks, sizes, indices = self._from_pointers(gpu)
        elif all(hasattr(gpu, a) for a in ("block_ids", "group_sizes", "block_indices")):
            blocks, sizes = gpu.block_ids, list(gpu.group_sizes)
            indices = _ints("GPULoadStoreSpec", "block_indices", gpu.block_indices, _I64)
        else:
            raise TypeError(
                f"kvoffload.vllm: expected a GPULoadStoreSpec or DevicePointers, got {type(gpu).__name__}"
            )
        return blocks, sizes, chunks.block_ids, [i % f for i in indices]

    def _from_pointers(self, dp: Any):
        """vLLM 0.34's ``DevicePointers`` (per group, per data ref, per block:
        ``ptrs[i]`` = the ref's tensor address + block id * block stride,
        ``sizes[i]`` = the ref's page bytes) as block ids per group, checked
        against the tensors this worker registered: every field ints (numpy
        arrays of an integer dtype, or sequences of ints; never a bool or a
        float) in range (pointers and sizes in [0, 2**64), counts and block
        indices in [0, 2**63)), every pointer a whole block of its tensor,
        every ref of a group the same blocks, every size a whole page.
        Anything else is a ``kvoffload.OptionsError`` (a ``ValueError``)
        naming the field, and the tensor by vLLM's ``tensor_idx`` (the
        offloader can only copy the tensors it was given)."""
        import numpy as np

        counts = _ints("DevicePointers", "group_block_counts", dp.group_block_counts, _I64)
        refs = _ints("DevicePointers", "group_data_ref_counts", dp.group_data_ref_counts, _I64)
        indices = _ints("DevicePointers", "block_indices", dp.block_indices, _I64)
        if refs != self._refs_per_group or len(indices) != len(counts):
            raise _options_error(
                f"kvoffload.vllm: device pointers for {len(counts)} groups of {refs} data refs "
                f"({len(indices)} block indices); this worker registered groups of {self._refs_per_group}"
            )
        ptrs = _ints("DevicePointers", "ptrs", dp.ptrs, _U64, array=True)
        sizes = _ints("DevicePointers", "sizes", dp.sizes, _U64, array=True)
        total = sum(n * r for n, r in zip(counts, refs))
        if ptrs.shape != (total,) or sizes.shape != (total,):
            raise _options_error(
                f"kvoffload.vllm: {ptrs.size} device pointers and {sizes.size} sizes for {total} copies "
                f"(blocks per group {counts} x data refs {refs})"
            )
        blocks = []
        op = 0
        t = 0
        for g, (n, r) in enumerate(zip(counts, refs)):
            if n == 0:
                t += r
                continue
            base, stride, _, rows = self._tensor_rows[t]
            delta = ptrs[op : op + n] - np.uint64(base)  # wraps for a pointer below base: out of range below
            ids = delta // np.uint64(stride)
            if np.any(delta % np.uint64(stride)) or np.any(ids >= np.uint64(rows)):
                raise _options_error(
                    f"kvoffload.vllm: a device pointer of group {g} is not a block of KV tensor "
                    f"{self._tensor_ids[t]} ({rows} blocks of {stride} bytes at {base:#x}): "
                    f"{[hex(int(p)) for p in ptrs[op : op + n][:4]]}"
                )
            for j in range(r):
                base_j, stride_j, page_j, _ = self._tensor_rows[t + j]
                seg = slice(op + j * n, op + (j + 1) * n)
                if not np.array_equal(ptrs[seg], np.uint64(base_j) + ids * np.uint64(stride_j)):
                    raise _options_error(
                        f"kvoffload.vllm: data ref {j} of group {g} points at other blocks than data ref 0 "
                        f"(or outside KV tensor {self._tensor_ids[t + j]})"
                    )
                if np.any(sizes[seg] != np.uint64(page_j)):
                    raise _options_error(
                        f"kvoffload.vllm: data ref {j} of group {g} (KV tensor {self._tensor_ids[t + j]}) copies "
                        f"{sorted(set(int(x) for x in sizes[seg]))} bytes per block; its tensor's pages are "
                        f"{page_j} bytes"
                    )
            blocks.append(ids.astype(np.int64))
            op += n * r
            t += r
        flat = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
        return flat, counts, indices

    def _submit(self, job_id: int, make: Callable[[], Tuple[Callable[..., None], tuple]]) -> bool:
        if self._pin_hold is not None:
            self.release_pin_hold("the engine submitted its first job")
        try:
            call, args = make()
            self._submitter.submit(call, job_id, args)
        except Exception as e:  # noqa: BLE001 - reported as a failed result where vLLM takes one
            if not self.failed_results:
                raise
            with self._failed_lock:
                self._failed.append((job_id, e))
        return True

    def _pool_slots(self, host: Any) -> Tuple[List[int], List[int]]:
        """The pool slots and epochs a job's host side names."""
        epochs = getattr(host, "epochs", None)
        if epochs is None:
            raise _options_error(
                f"kvoffload.vllm: a job on the node pool needs its slots' epochs (a PoolLoadStoreSpec), "
                f"not a {type(host).__name__}"
            )
        slots = _ints("PoolLoadStoreSpec", "block_ids", host.block_ids, self.pool.slots)
        epochs = _ints("PoolLoadStoreSpec", "epochs", epochs, 1 << 32)
        if len(epochs) != len(slots):
            raise _options_error(f"kvoffload.vllm: {len(slots)} pool slots and {len(epochs)} epochs")
        return slots, epochs

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        def make():
            job = self._job(src_spec, dst_spec)
            if self.pool is not None:
                # Design 3.3: the slots are this engine's to write, at the
                # epochs the scheduler claimed them at.
                slots, epochs = self._pool_slots(dst_spec)
                self.pool.check_writing(slots, epochs)
                self._pool_stores[job_id] = (slots, epochs)
            return self.offloader.store_slot_job, job

        return self._submit(job_id, make)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        # Expedited loads (vLLM waits for them with wait()) run on the
        # expedited lane's own stream, never behind a regular load.
        def make():
            load = self.offloader.load_slot_job
            job = self._job(dst_spec, src_spec)
            if self.pool is not None:
                # Design 3.2: readable at the epochs looked up, held by
                # this engine (no other engine can evict them meanwhile).
                self.pool.check_held(*self._pool_slots(src_spec))
            return (functools.partial(load, expedited=True) if expedited else load), job

        return self._submit(job_id, make)

    def get_finished(self) -> List[Any]:
        out = []
        if self.failed_results:
            with self._failed_lock:
                failed, self._failed = self._failed, []
            for job_id, e in failed + self._submitter.take_errors():
                self._pool_stores.pop(job_id, None)
                out.append(self._failed_result(job_id, "submission", e))
        else:
            self._submitter.check()
        for c in self.offloader.poll():
            written = self._pool_stores.pop(c.job, None)
            if c.error is not None:
                if not self.failed_results:
                    # This vLLM has no failure path (a False success is a
                    # bare assert): the driver's error, raised, beats both
                    # that and reporting the job as done.
                    raise kvoffload.TransferError(
                        f"kvoffload.vllm: job {c.job} ({c.direction}) failed: {c.error}"
                    ) from c.error
                out.append(self._failed_result(c.job, c.direction, c.error))
                continue
            # vLLM's offload stats divide transfer_size by transfer_time: the
            # job's device time (CUDA's event timer), not the time from
            # submission until the poll saw it, which counts the wait for
            # the compute stream and the polling interval (10-50x less GB/s
            # than the copies ran at, on the H100).
            secs = c.device_seconds if c.device_seconds is not None else c.seconds
            if written is not None:
                # This rank's bytes of each slot are complete (its copy's
                # completion observed): its bit, before vLLM hears of the
                # job; the last rank's bit publishes the slot (design 3.3).
                self.pool.complete_rank(written[0], written[1], self.pool_rank)
            out.append(self._result(job_id=c.job, success=True, transfer_size=c.bytes, transfer_time=secs))
        return out

    def _failed_result(self, job_id: int, what: str, error: BaseException) -> Any:
        log.error("kvoffload.vllm: job %d (%s) failed (reported as failed): %s", job_id, what, error)
        return self._result(job_id=job_id, success=False, transfer_size=None, transfer_time=None)

    def wait(self, job_ids: Any) -> None:
        ids = {int(j) for j in job_ids}
        self._submitter.wait_submitted(ids)
        if not self.failed_results:
            self._submitter.check()
        # Failed jobs are left to get_finished; ids never submitted are
        # skipped by wait_jobs.
        self.offloader.wait_jobs(ids)

    def wait_pinned(self) -> Any:
        """Waits until pinning is final and the worker saw it (submissions
        are the caller's from then on if it is ``pinned``); returns the
        offloader's ``PinOutcome``."""
        outcome = self.offloader.wait_pinned()
        self._submitter.watcher.join()
        return outcome

    @property
    def jobs_queued(self) -> int:
        """Jobs that went through the submitter thread so far (submitted
        before pinning was ``pinned``)."""
        return self._submitter.queued_total

    def shutdown(self) -> None:
        """Removes the capture hook, then shuts the offloader down (drains
        the jobs, stops pinning, unregisters, releases). Idempotent."""
        if self._shut:
            return
        self.release_pin_hold("shutdown")
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._submitter.close()
        try:
            self.offloader.shutdown()
        finally:
            if self.pool is not None:
                # The last member of the engine to leave reclaims its marks.
                self.pool.leave()
                if not self.pool_keep:
                    close_pool_if_unused(self.pool)
            self._shut = True


def close_pool_if_unused(pool: "kvoffload.Pool") -> None:
    """After ``pool.leave()`` of an engine started with ``kvo_pool_keep:
    false``: removes the pool if no engine is registered on it any more
    (the last to leave removes it; ``Pool.close_if_unused``). A failure is
    logged, not raised: the engine is shutting down, and the pool is left
    as it is (``kvoffload pool rm`` removes it)."""
    try:
        removed = pool.close_if_unused()
    except Exception as e:  # noqa: BLE001 - shutdown goes on; the pool stays
        log.warning("kvoffload.vllm: pool %r not removed at shutdown: %s", pool.name, e)
        return
    if removed is None:
        log.info("kvoffload.vllm: pool %r stays: another engine uses it or removes it", pool.name)
    else:
        log.info("kvoffload.vllm: removed pool %r (kvo_pool_keep false, the last engine left): %s", pool.name, removed)


class _Result:
    """vLLM's ``TransferResult`` where vLLM is not installed."""

    __slots__ = ("job_id", "success", "transfer_size", "transfer_time")

    def __init__(self, job_id: int, success: bool, transfer_size: Optional[int], transfer_time: Optional[float]):
        self.job_id, self.success, self.transfer_size, self.transfer_time = job_id, success, transfer_size, transfer_time

    def __repr__(self) -> str:
        return f"TransferResult({self.job_id}, {self.success}, {self.transfer_size}, {self.transfer_time})"
