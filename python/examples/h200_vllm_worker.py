#!/usr/bin/env python3
"""Issue 21 item 5 on a GPU: kvoffload's vLLM worker and capture hook under
real ``torch.cuda.graph`` captures while the host region pins in the
background, beside vLLM 0.33's synchronous start-up for the same region.

vLLM's wheel is not needed (too large to carry to the GPU machine): the
worker is ``kvoffload._slotworker.SlotWorker``, the class
``kvoffload.vllm.KvoffloadWorker`` is made of, driven the way vLLM's
``OffloadingConnectorWorker`` drives it (``submit_store`` / ``submit_load``
with vLLM's spec shapes, ``get_finished`` each step, ``wait`` for
expedited loads), on KV tensors shaped as vLLM's canonical ones
(``(num_blocks, page)`` int8 per layer).

For each region size, in one process, one after the other:

(a) vLLM 0.33's start-up path (``cpu/shared_offload_region.py`` and
    ``cpu/gpu_worker.py: pin_mmap_region``): map the region, pre-fault it
    with ``MADV_POPULATE_WRITE``, then ``cudaHostRegister`` in row-aligned
    chunks of at most 64 GiB through ``torch.cuda.cudart()``; all before the
    first capture. Timed; unregistered and unmapped after.
(b) kvoffload: ``SlotWorker(...)`` (what ``get_worker`` builds) returns with
    pinning started in the background; then at once, as vLLM's
    ``capture_model`` would, ``--captures`` graphs are captured with
    ``torch.cuda.graph`` (no window code: the worker's hook wraps
    ``torch.cuda.CUDAGraph``), each replayed and checked; store/load round
    trips (vLLM's shapes, first chunk partial too) run between captures and
    inside one capture (deferred until it ends), every byte compared, until
    pinning settles; then round trips on the pinned region.

Printed (and written with --json): (a)'s pre-fault and registration
seconds; (b)'s return from the constructor, captures done, pinning done,
pin state at each capture, captures/replays right, round trips right and
their copy backends.

    python3 python/examples/h200_vllm_worker.py --sizes 16GiB,64GiB --json h200-vllm.json

Needs PyTorch with CUDA and the kvoffload wheel on the path. Exit status 0
when every capture, replay and round trip of (b) was right, 1 otherwise, 2
when the machine cannot run it.
"""

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
from types import SimpleNamespace as NS

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from sizes import GIB, parse_size  # noqa: E402  (the checkout's python/bench/sizes.py)

MADV_POPULATE_WRITE = 23



def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- (a) vLLM 0.33


def vllm_sync_startup(torch, size, row):
    """vLLM 0.33's synchronous path for one worker owning the whole region:
    mmap, MADV_POPULATE_WRITE, cudaHostRegister in row-aligned chunks of at
    most 64 GiB (pin_mmap_region's whole-region branch)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    t0 = time.monotonic()
    m = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    buf = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(buf)
    if libc.madvise(addr, size, MADV_POPULATE_WRITE) != 0:
        # vLLM writes one byte per page where the advice is unsupported.
        for off in range(0, size, mmap.PAGESIZE):
            m[off] = 0
    t_fault = time.monotonic() - t0
    cudart = torch.cuda.cudart()
    max_chunk = (64 * GIB // row) * row
    t1 = time.monotonic()
    done = []
    err = None
    for start in range(0, size, max_chunk):
        n = min(max_chunk, size - start)
        r = cudart.cudaHostRegister(addr + start, n, 0)
        code = r[0] if isinstance(r, tuple) else r
        if int(code) != 0:
            err = f"cudaHostRegister({n}) returned {code}"
            break
        done.append(start)
    t_reg = time.monotonic() - t1
    for start in done:
        cudart.cudaHostUnregister(addr + start)
    del buf
    m.close()
    return {"prefault_s": t_fault, "register_s": t_reg, "startup_s": t_fault + t_reg, "chunks": len(done), "error": err}


# ---------------------------------------------------------------- (b) kvoffload


class TimedHook:
    """The offloader as the capture hook sees it, timing its begin (how long
    a capture waited for its window)."""

    def __init__(self, off):
        self._off, self.begin_s = off, []

    def capture_begin(self):
        t = time.monotonic()
        self._off.capture_begin()
        self.begin_s.append(time.monotonic() - t)

    def __getattr__(self, name):
        return getattr(self._off, name)


class Steps:
    """vLLM's worker connector, as far as this run needs it: job ids from
    one counter, stores and loads in vLLM's spec shapes, results polled."""

    def __init__(self, w, bpc):
        self.w, self.bpc, self.next_id = w, bpc, 0
        self.results = {}
        self.submit_s = []  # (direction, seconds the submit call took, pin state)
        self.trip_s = []  # (pin state, store submit..reported, load submit..reported)

    def job(self):
        self.next_id += 1
        return self.next_id

    def store(self, gpu_blocks, first_index, chunks):
        j = self.job()
        t = time.monotonic()
        assert self.w.submit_store(
            j, NS(block_ids=gpu_blocks, group_sizes=[len(gpu_blocks)], block_indices=[first_index]),
            NS(block_ids=chunks),
        )
        self.submit_s.append(("store", time.monotonic() - t, str(self.w.offloader.pin_progress.state)))
        return j

    def load(self, chunks, gpu_blocks, first_index, expedited=False):
        j = self.job()
        t = time.monotonic()
        assert self.w.submit_load(
            j, NS(block_ids=chunks),
            NS(block_ids=gpu_blocks, group_sizes=[len(gpu_blocks)], block_indices=[first_index]), expedited,
        )
        self.submit_s.append(("load", time.monotonic() - t, str(self.w.offloader.pin_progress.state)))
        return j

    def finish(self, ids):
        self.w.wait(set(ids))
        while not all(i in self.results for i in ids):
            for r in self.w.get_finished():
                assert r.success, r
                self.results[r.job_id] = r
            self.w.wait(set(ids))


def round_trip(torch, steps, kv, slots_free, rng_seed, pin_state):
    """A store of 2 chunks' worth of blocks from logical index 1 (so the
    first chunk is partial), the GPU blocks zeroed, a load back into other
    blocks (expedited), every byte compared."""
    bpc = steps.bpc
    n = 2 * bpc - 1 if bpc > 1 else 2
    g = torch.Generator(device="cuda").manual_seed(rng_seed)
    src = list(range(0, n))
    dst = list(range(kv[0].shape[0] - n, kv[0].shape[0]))
    for t in kv:
        t[src] = torch.randint(-128, 127, (n, t.shape[1]), dtype=torch.int8, device="cuda", generator=g)
    want = [t[src].clone() for t in kv]
    first = 1 % bpc
    need = -(-(n + first) // bpc)
    chunks = [slots_free.pop() for _ in range(need)]
    t0 = time.monotonic()
    sj = steps.store(src, first + bpc * 3, chunks)  # logical index 3*bpc+1: first_sub = 1
    steps.finish([sj])
    t1 = time.monotonic()
    for t in kv:
        t[src] = 0
    lj = steps.load(chunks, dst, first + bpc * 3, expedited=True)
    steps.finish([lj])
    t2 = time.monotonic()
    torch.cuda.synchronize()
    ok = all(torch.equal(t[dst], w) for t, w in zip(kv, want))
    slots_free.extend(chunks)
    steps.trip_s.append((pin_state, t1 - t0, t2 - t1))
    return ok, pin_state


def kvoffload_startup(torch, kvoffload, size, args):
    from kvoffload import _slotworker

    L, page, bpc, blocks = args.layers, args.page_bytes, args.blocks_per_chunk, args.gpu_blocks
    slot_bytes = -(-(L * page * bpc) // mmap.PAGESIZE) * mmap.PAGESIZE
    num_slots = size // slot_bytes
    storage = torch.empty(L * blocks * page, dtype=torch.int8, device="cuda")  # one backing allocation, as vLLM's
    kv = [storage[i * blocks * page:(i + 1) * blocks * page].view(blocks, page) for i in range(L)]
    caches = NS(
        tensors=[NS(tensor=t, page_size_bytes=page) for t in kv],
        group_data_refs=[[NS(tensor_idx=i, page_size_bytes=page) for i in range(L)]],
    )
    options = dict(pin=kvoffload.PinOptions(threads=args.pin_threads))
    if args.region == "shared":
        options["region"] = kvoffload.RegionSpec.shared(f"kvo-h200-{os.getpid()}", rank=0, ranks=1)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    w = _slotworker.SlotWorker(
        caches, num_slots=num_slots, blocks_per_chunk=bpc, runtime=kvoffload.Runtime("cuda"), options=options
    )
    t_return = time.monotonic() - t0
    off = w.offloader
    from kvoffload import _hook

    timed = TimedHook(off)
    patch = _hook._patches[torch.cuda.CUDAGraph]
    patch.offloaders[patch.offloaders.index(off)] = timed
    steps = Steps(w, bpc)
    slots_free = list(range(num_slots))
    out = {"return_s": t_return, "region_bytes": off.region_bytes, "slots": num_slots, "captures": []}

    # The engine's captures, at once, as capture_model after get_worker.
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    trips = []
    captures_ok = replays_ok = 0
    for i in range(args.captures):
        y = torch.empty_like(x)
        gph = torch.cuda.CUDAGraph()
        state = str(off.pin_progress.state)
        p = off.pin_progress
        tb = time.monotonic()
        deferred = None
        n_begins = len(timed.begin_s)
        try:
            with torch.cuda.graph(gph):
                t_in = time.monotonic()
                y.copy_(x * 2 + i)
                if i == 1:
                    # A store submitted inside the capture: deferred by the
                    # hook, run when the capture ends.
                    deferred = steps.store([blocks // 2], 0, [slots_free.pop()])
                t_body = time.monotonic()
            captures_ok += 1
        except Exception as e:  # an invalidated capture is what this run looks for
            out["captures"].append({"i": i, "error": repr(e)})
            continue
        enter_s = time.monotonic() - tb
        gph.replay()
        torch.cuda.synchronize()
        right = torch.equal(y, x * 2 + i)
        replays_ok += right
        out["captures"].append(
            {"i": i, "pin_state": state, "chunks_done": p.chunks_done, "chunks_total": p.chunks_total,
             "seconds": enter_s, "enter_s": t_in - tb, "exit_s": tb + enter_s - t_body,
             "hook_begin_s": timed.begin_s[n_begins] if len(timed.begin_s) > n_begins else None,
             "replay_right": right}
        )
        if deferred is not None:
            steps.finish([deferred])
            out["deferred_store_seconds"] = steps.results[deferred].transfer_time
        if i % 4 == 3:
            trips.append(round_trip(torch, steps, kv, slots_free, i, str(off.pin_progress.state)))
    out["captures_done_s"] = time.monotonic() - t0
    # Round trips until pinning settles (pageable copies until then).
    while not off.pin_progress.state.is_final and len(trips) < 10_000:
        trips.append(round_trip(torch, steps, kv, slots_free, len(trips), str(off.pin_progress.state)))
    outcome = w.wait_pinned()
    out["pinned_s"] = time.monotonic() - t0
    out["pin_final"] = repr(outcome.state)
    for k in range(4):
        trips.append(round_trip(torch, steps, kv, slots_free, 10_000 + k, str(off.pin_progress.state)))
    out["captures_ok"] = captures_ok
    out["replays_ok"] = replays_ok
    out["round_trips"] = len(trips)
    out["round_trips_right"] = sum(ok for ok, _ in trips)
    out["round_trips_before_pinned"] = sum(1 for _, s in trips if s != "pinned")
    out["hook_begin_s"] = timed.begin_s
    out["submit_s"] = steps.submit_s
    out["trip_s"] = steps.trip_s
    before = [t for _, t, st in steps.submit_s if st != "pinned"]
    after = [t for _, t, st in steps.submit_s if st == "pinned"]
    out["submit_max_before_pinned_s"] = max(before) if before else None
    out["submit_max_pinned_s"] = max(after) if after else None
    out["hook_begin_max_s"] = max(timed.begin_s) if timed.begin_s else None
    patch.offloaders[patch.offloaders.index(timed)] = off
    w.shutdown()
    del kv, storage
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16GiB,64GiB", help="region sizes, comma separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-bytes", type=parse_size, default=32 << 10)
    ap.add_argument("--blocks-per-chunk", type=int, default=2)
    ap.add_argument("--gpu-blocks", type=int, default=2048)
    ap.add_argument("--captures", type=int, default=32)
    ap.add_argument("--pin-threads", type=int, default=8)
    ap.add_argument("--region", choices=["anonymous", "shared"], default="anonymous")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        log("h200_vllm_worker: no PyTorch here")
        return 2
    if not torch.cuda.is_available():
        log("h200_vllm_worker: no CUDA device visible to PyTorch")
        return 2
    try:
        import kvoffload
    except ImportError:
        log("h200_vllm_worker: kvoffload is not installed (ci/python builds target/wheels/kvoffload-*.whl)")
        return 2
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": vars(args), "sizes": {}}
    good = True
    for s in args.sizes.split(","):
        size = parse_size(s)
        row = -(-(args.layers * args.page_bytes * args.blocks_per_chunk) // mmap.PAGESIZE) * mmap.PAGESIZE
        size = size // row * row
        r = {}
        if not args.skip_baseline:
            log(f"== {s}: vLLM 0.33 synchronous start-up (pre-fault + chunked cudaHostRegister)")
            r["vllm_sync"] = vllm_sync_startup(torch, size, row)
            log(json.dumps(r["vllm_sync"]))
        log(f"== {s}: kvoffload worker, pinning in the background, captures at once")
        r["kvoffload"] = k = kvoffload_startup(torch, kvoffload, size, args)
        log(json.dumps({key: v for key, v in k.items() if key not in ("captures", "submit_s", "hook_begin_s", "trip_s")}))
        ok = (
            k["captures_ok"] == args.captures
            and k["replays_ok"] == args.captures
            and k["round_trips_right"] == k["round_trips"]
        )
        good &= ok
        log(f"   {'OK' if ok else 'FAILED'}: captures {k['captures_ok']}/{args.captures}, replays right "
            f"{k['replays_ok']}, round trips right {k['round_trips_right']}/{k['round_trips']} "
            f"({k['round_trips_before_pinned']} before pinning settled); start-up: kvoffload returned in "
            f"{k['return_s']:.3f} s, captures done at {k['captures_done_s']:.2f} s, pinned at {k['pinned_s']:.2f} s"
            + (f"; vLLM 0.33 synchronous {r['vllm_sync']['startup_s']:.2f} s" if "vllm_sync" in r else ""))
        report["sizes"][s] = r
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
