"""kvoffload's copies from Python against what an engine author writes with
PyTorch alone, in one run, on the same blocks (issue: "the Python path at
torch's speed or better").

The KV cache: ``--tensors`` tensors of ``--gpu-blocks`` blocks of
``--page-kib`` KiB each on the GPU (one tensor per layer and K/V, as vLLM
keeps them). A job moves ``--blocks-per-job`` GPU blocks, chosen at random
(the engine's blocks are scattered), to or from as many consecutive host
slots. Three ways, each timed over ``--jobs`` jobs submitted back to back,
after a warm-up of the same jobs, repeated ``--repeats`` times (median and
spread printed):

- kvoffload: an ``Offloader`` in slot mode on the engine's own tensors
  (``store_slots``/``load_slots``, then ``wait_jobs``), its region pinned in
  the background and waited for before timing; the copy path is
  ``Completion.backend``.
- torch: per tensor, ``index_select`` of the job's blocks into a contiguous
  GPU tensor, then ``copy_(non_blocking=True)`` into pinned host memory
  (``pin_memory=True``); loads the other way, a non-blocking copy to the
  GPU, then ``index_copy_`` into the KV tensor. Stores on one CUDA stream,
  loads on another.
- both ways at once: stores of one half of the blocks while loads of the
  other half run (kvoffload: interleaved submissions; torch: its two
  streams), GB/s of both directions' bytes.

Every round trip is verified: after the timed runs the blocks stored are
zeroed on the GPU, loaded back, and compared byte for byte with what was
stored, for both sides; a mismatch fails the run (exit 1). ``--self-test``
shows the check failing: it flips one byte of the expected data and must
see the mismatch reported.

GPU memory each side uses beyond the KV tensors: torch's caching allocator
peak (its index_select buffers), and for kvoffload the drop in free device
memory (``torch.cuda.mem_get_info``) from building the offloader to the end
(its staging buffers and gather tables, allocated by the driver).

Usage (on a GPU machine; prints a table and writes ``--json``):

    python3 python/bench/copies.py --json $OUT/copies.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List


def _need_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("copies.py: needs PyTorch (pip install torch)")
    import torch

    return torch


def median_spread(xs: List[float]) -> Dict[str, float]:
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "runs": len(xs),
    }


class Shape:
    def __init__(self, a: argparse.Namespace):
        self.tensors = a.tensors
        self.gpu_blocks = a.gpu_blocks
        self.page = a.page_kib << 10
        self.bpj = a.blocks_per_job
        self.jobs = a.jobs
        # Host slots: one per block a timed pass moves (jobs of distinct
        # slots, so no slot is busy when the next job is submitted).
        self.host_blocks = a.jobs * a.blocks_per_job
        if self.bpj * 2 > self.gpu_blocks:
            sys.exit("copies.py: --blocks-per-job must be at most half of --gpu-blocks")

    def job_bytes(self) -> int:
        return self.bpj * self.tensors * self.page


def make_jobs(torch, shape: Shape, seed: int):
    """Per job: the GPU blocks (random, distinct within the job; the first
    half of the jobs from the lower half of the GPU blocks, the second half
    from the upper half, so the both-ways pass never loads into a block it
    stores from), the same ids as a GPU tensor (an engine keeps its block
    tables on the GPU; building one per job would time a host copy), and the
    job's host slots (consecutive, distinct across jobs)."""
    g = torch.Generator().manual_seed(seed)
    jobs = []
    half = shape.gpu_blocks // 2
    for j in range(shape.jobs):
        base = 0 if j < shape.jobs // 2 else half
        blocks = (torch.randperm(half, generator=g)[: shape.bpj] + base).tolist()
        slots = list(range(j * shape.bpj, (j + 1) * shape.bpj))
        jobs.append((blocks, slots, torch.tensor(blocks, device="cuda")))
    return jobs


class KvoffloadSide:
    name = "kvoffload"

    def __init__(self, torch, kvoffload, kv, shape: Shape, stream):
        self.torch = torch
        self.shape = shape
        free0 = torch.cuda.mem_get_info()[0]
        self.off = kvoffload.Offloader(
            shape.host_blocks,
            kv=kvoffload.KvSpec(kv, compute_stream=stream),
            start=True,
        )
        t0 = time.perf_counter()
        outcome = self.off.wait_pinned()
        self.pin_seconds = time.perf_counter() - t0
        self.pin_state = str(outcome.state.name)
        self.free0 = free0
        self.next_job = 1
        self.backends: Dict[str, int] = {}

    def _id(self) -> int:
        j = self.next_job
        self.next_job += 1
        return j

    def _drain(self, ids: List[int]) -> None:
        self.off.wait_jobs(ids)
        for c in self.off.poll():
            if c.error is not None:
                raise RuntimeError(f"kvoffload job {c.job} failed: {c.error}")
            self.backends[c.backend] = self.backends.get(c.backend, 0) + 1

    def _jobs(self, submits) -> None:
        """Submits each (store_slots or load_slots, GPU blocks, slots) as a
        job of its own, in order, then waits for them all."""
        ids = []
        for submit, blocks, slots in submits:
            j = self._id()
            submit(j, blocks, slots)
            ids.append(j)
        self._drain(ids)

    def store(self, jobs) -> None:
        self._jobs((self.off.store_slots, blocks, slots) for blocks, slots, _ in jobs)

    def load(self, jobs) -> None:
        self._jobs((self.off.load_slots, blocks, slots) for blocks, slots, _ in jobs)

    def both(self, stores, loads) -> None:
        st, ld = self.off.store_slots, self.off.load_slots
        self._jobs(x for (sb, ss, _), (lb, ls, _) in zip(stores, loads) for x in ((st, sb, ss), (ld, lb, ls)))

    def gpu_bytes(self) -> int:
        return max(0, self.free0 - self.torch.cuda.mem_get_info()[0])

    def close(self) -> None:
        self.off.shutdown()


class TorchSide:
    name = "torch"

    def __init__(self, torch, kv, shape: Shape):
        self.torch = torch
        self.kv = kv
        self.shape = shape
        self.host = [
            torch.empty((shape.host_blocks, shape.page), dtype=torch.uint8, pin_memory=True)
            for _ in range(shape.tensors)
        ]
        self.s_store = torch.cuda.Stream()
        self.s_load = torch.cuda.Stream()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.backends = {"index_select + copy_ / copy_ + index_copy_": 0}

    def _each_on(self, stream, jobs, copy):
        """Enqueues ``copy(GPU tensor, its host rows of the job's slots, GPU
        block ids)`` on ``stream`` for each job and tensor; each gives back
        the temporary it copied through."""
        with self.torch.cuda.stream(stream):
            for _, slots, idx in jobs:
                s0 = slots[0]
                for t, h in zip(self.kv, self.host):
                    tmp = copy(t, h[s0 : s0 + len(slots)], idx)
                    # The caching allocator must not hand tmp's memory to
                    # another stream before the copy read it.
                    tmp.record_stream(stream)

    def _store_on(self, stream, jobs):
        def store(t, rows, idx):
            tmp = t.index_select(0, idx)
            rows.copy_(tmp, non_blocking=True)
            return tmp

        self._each_on(stream, jobs, store)

    def _load_on(self, stream, jobs):
        def load(t, rows, idx):
            tmp = rows.to("cuda", non_blocking=True)
            t.index_copy_(0, idx, tmp)
            return tmp

        self._each_on(stream, jobs, load)

    def store(self, jobs) -> None:
        self._store_on(self.s_store, jobs)
        self.s_store.synchronize()

    def load(self, jobs) -> None:
        self._load_on(self.s_load, jobs)
        self.s_load.synchronize()

    def both(self, stores, loads) -> None:
        self._store_on(self.s_store, stores)
        self._load_on(self.s_load, loads)
        self.s_store.synchronize()
        self.s_load.synchronize()

    def gpu_bytes(self) -> int:
        return max(0, self.torch.cuda.max_memory_allocated() - self.base)

    def close(self) -> None:
        pass


def timed(f: Callable[[], None], torch) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def verify(torch, side, kv, jobs, flip: bool) -> int:
    """Stores the jobs' blocks, zeroes them on the GPU, loads them back,
    and counts the blocks that differ from what was stored."""
    expected = [t.clone() for t in kv]
    side.store(jobs)
    torch.cuda.synchronize()
    for t in kv:
        for _, _, idx in jobs:
            t[idx] = 0
    torch.cuda.synchronize()
    side.load(jobs)
    torch.cuda.synchronize()
    if flip:
        b0 = jobs[0][0][0]
        expected[0][b0, 0] ^= 0xFF
    bad = 0
    for _, _, idx in jobs:
        for t, e in zip(kv, expected):
            bad += int((t.index_select(0, idx) != e.index_select(0, idx)).any(dim=1).sum().item())
    return bad


def run_side(torch, side, shape: Shape, jobs, repeats: int) -> Dict[str, object]:
    half = len(jobs) // 2
    stores, loads = jobs[:half], jobs[half:]
    jb = shape.job_bytes()
    res: Dict[str, object] = {}
    # Host slots of the load passes hold data: store every job once first.
    side.store(jobs)
    for what, f, nbytes in [
        ("store", lambda: side.store(jobs), jb * len(jobs)),
        ("load", lambda: side.load(jobs), jb * len(jobs)),
        ("both", lambda: side.both(stores, loads), jb * (len(stores) + len(loads))),
    ]:
        warm = timed(f, torch)
        runs = [nbytes / timed(f, torch) / 1e9 for _ in range(repeats)]
        res[what] = {"warmup_gbps": nbytes / warm / 1e9, **median_spread(runs)}
    res["gpu_bytes"] = side.gpu_bytes()
    res["backends"] = dict(side.backends)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=64, help="KV tensors (layers x K/V)")
    p.add_argument("--gpu-blocks", type=int, default=2048)
    p.add_argument("--page-kib", type=int, default=32, help="bytes of one block in one tensor, KiB")
    p.add_argument("--blocks-per-job", type=int, default=32)
    p.add_argument("--jobs", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--self-test", action="store_true", help="show the round-trip check failing")
    a = p.parse_args(argv)
    torch = _need_torch()
    if not torch.cuda.is_available():
        print("copies.py: skipped: no CUDA device visible to PyTorch")
        return 0 if not a.self_test else 1
    import kvoffload

    shape = Shape(a)
    kv = [
        torch.randint(0, 256, (shape.gpu_blocks, shape.page), dtype=torch.uint8, device="cuda")
        for _ in range(shape.tensors)
    ]
    jobs = make_jobs(torch, shape, a.seed)
    stream = torch.cuda.current_stream()
    print(
        f"copies.py: {shape.tensors} tensors x {shape.gpu_blocks} blocks of {shape.page >> 10} KiB on "
        f"{torch.cuda.get_device_name()}; jobs of {shape.bpj} random blocks "
        f"({shape.job_bytes() / 2**20:.1f} MiB), {shape.jobs} per pass, {a.repeats} repeats after a warm-up"
    )
    out: Dict[str, object] = {"shape": vars(a)}
    failed = False
    for make in (lambda: KvoffloadSide(torch, kvoffload, kv, shape, stream), lambda: TorchSide(torch, kv, shape)):
        side = make()
        try:
            if a.self_test:
                bad = verify(torch, side, kv, jobs[:2], flip=True)
                print(f"self-test {side.name}: {bad} mismatching block(s) with one expected byte flipped")
                failed |= bad == 0
                continue
            r = run_side(torch, side, shape, jobs, a.repeats)
            bad = verify(torch, side, kv, jobs, flip=False)
            r["blocks_mismatching"] = bad
            failed |= bad != 0
            if isinstance(side, KvoffloadSide):
                r["pin_state"] = side.pin_state
                r["pin_seconds"] = side.pin_seconds
            out[side.name] = r
        finally:
            side.close()
    if a.self_test:
        print("self-test:", "FAILED (a flipped byte went unseen)" if failed else "ok (the check sees a flipped byte)")
        return 1 if failed else 0
    print(f"{'':10} {'store GB/s':>22} {'load GB/s':>22} {'both GB/s':>22} {'GPU memory':>12} mismatches")
    for name in ("kvoffload", "torch"):
        r = out[name]

        def cell(k):
            c = r[k]
            return f"{c['median']:6.2f} ({c['min']:.2f}-{c['max']:.2f})"

        print(
            f"{name:10} {cell('store'):>22} {cell('load'):>22} {cell('both'):>22} "
            f"{r['gpu_bytes'] / 2**20:9.1f} MiB {r['blocks_mismatching']}"
        )
    k, t = out["kvoffload"], out["torch"]
    ahead = {d: k[d]["median"] > t[d]["median"] for d in ("store", "load", "both")}
    out["kvoffload_ahead"] = ahead
    print("kvoffload ahead of torch:", ", ".join(f"{d} {'yes' if v else 'NO'}" for d, v in ahead.items()))
    print("kvoffload copy paths:", k["backends"], "pin state", k.get("pin_state"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    if failed:
        print("copies.py: FAILED: a round trip did not give back the bytes stored")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
