"""How much background pinning slows an engine's own start-up work, and
what pinning's thread count trades against it (issue: "the engine's
start-up keeps its speed").

The engine's start-up work, the same in every configuration:

- weights: a CPU-bound, memory-bound stand-in for loading weights: a
  pageable host tensor of ``--weights`` bytes is filled on the CPU
  (``torch.Tensor.uniform_``, PyTorch's intra-op threads) and copied to the
  GPU, ``--weight-rounds`` times;
- captures: ``--captures`` CUDA graphs of ``--matmuls`` matmuls of
  ``--dim`` x ``--dim`` floats each (each followed by a tanh, so values stay
  bounded), captured with ``torch.cuda.graph`` in
  its default (global) mode inside ``off.capture_window()`` (policy
  ``interleave``: a window waits for at most one chunk, never for the
  whole region), then each replayed once and checked against an eager run.

Configurations: ``none`` (no offloader: the engine alone), then for each
``--pin-threads`` value and each ``--pin-nice`` niceness of those threads
(default 10, the library's: they take the cores the engine leaves idle) an offloader over a region of ``--region`` bytes
whose pinning starts just before the start-up work (``start()``) and runs
behind it, and last ``vllm-sync``: vLLM 0.33's synchronous chunked
registration of a region of the same size (``cudaHostRegister`` through
``torch.cuda.cudart()``, chunks of at most 64 GiB) before the same work,
its total including the registration. For each: the weights' and the captures' seconds (median of
``--repeats`` runs, each in a fresh offloader), the slowdown against
``none``, pinning's own time (from ``start()`` to pinned) and whether it
ended before the start-up work did (hidden behind it).

Every capture's replay is checked; a wrong replay or an invalidated capture
fails the run (exit 1). ``--self-test`` shows the replay check failing: it
perturbs one expected value and must see the mismatch.

    python3 python/bench/startup.py --region 16GiB --json startup-16.json
    python3 python/bench/startup.py --region 64GiB --pin-threads 16,8,4,2
    python3 python/bench/startup.py --region 64GiB --pin-threads 12 --pin-nice 0,10,19
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from sizes import GIB, parse_size  # noqa: E402


def engine_startup(torch, a, off, self_test: bool) -> Dict[str, float]:
    """The engine's start-up work; returns its parts' seconds and the
    number of captures whose replay was wrong."""
    t0 = time.perf_counter()
    host = torch.empty(a.weights // 4, dtype=torch.float32)
    for _ in range(a.weight_rounds):
        host.uniform_()
        dev = host.to("cuda")
        del dev
    torch.cuda.synchronize()
    t_weights = time.perf_counter() - t0

    t1 = time.perf_counter()
    x = torch.randn(a.dim, a.dim, device="cuda") / a.dim**0.5
    # Warm-up on a side stream before capturing, as PyTorch asks (the first
    # matmul of a process creates cuBLAS's handle and workspace: allocations
    # a GLOBAL capture refuses, the engine's own capture-unsafe calls).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.tanh(x @ x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for _ in range(a.captures):
        g = torch.cuda.CUDAGraph()
        y = torch.empty_like(x)
        if off is not None:
            with off.capture_window(), torch.cuda.graph(g):
                y.copy_(x)
                for _ in range(a.matmuls):
                    y = torch.tanh(y @ x)
        else:
            with torch.cuda.graph(g):
                y.copy_(x)
                for _ in range(a.matmuls):
                    y = torch.tanh(y @ x)
        graphs.append((g, y))
    torch.cuda.synchronize()
    t_captures = time.perf_counter() - t1

    # Replays against an eager run of the same work.
    want = x.clone()
    for _ in range(a.matmuls):
        want = torch.tanh(want @ x)
    if self_test:
        want[0, 0] += 1.0
    bad = 0
    for g, y in graphs:
        g.replay()
        torch.cuda.synchronize()
        if not torch.allclose(y, want, rtol=1e-3, atol=1e-5):
            bad += 1
    return {"weights": t_weights, "captures": t_captures, "total": t_weights + t_captures, "bad_replays": bad}


def sync_run(torch, a) -> Dict[str, object]:
    """vLLM 0.33's start-up: the region registered synchronously first
    (``cudaHostRegister`` through ``torch.cuda.cudart()``, one call per
    chunk of at most 64 GiB, as its CPU offloading worker does), then the
    engine's work."""
    t0 = time.perf_counter()
    region = torch.empty(a.region, dtype=torch.uint8)
    rt = torch.cuda.cudart()
    base, left, chunks = region.data_ptr(), a.region, []
    while left > 0:
        n = min(left, 64 * GIB)
        err = rt.cudaHostRegister(base + (a.region - left), n, 0)
        if int(err) != 0:
            for c, m in chunks:
                rt.cudaHostUnregister(c)
            raise RuntimeError(f"cudaHostRegister of {n} bytes failed: {err}")
        chunks.append((base + (a.region - left), n))
        left -= n
    t_pinned = time.perf_counter()
    r: Dict[str, object] = engine_startup(torch, a, None, False)
    r["pin_seconds"] = t_pinned - t0
    r["pin_state"] = "pinned"
    r["pin_hidden"] = False
    r["total"] = float(r["total"]) + (t_pinned - t0)
    for c, _ in chunks:
        err = rt.cudaHostUnregister(c)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostUnregister failed: {err}")
    del region
    return r


def one_run(torch, kvoffload, a, cfg, kv) -> Dict[str, object]:
    """``cfg``: None (the engine alone), 0 (vLLM's synchronous
    registration first) or (pinning threads, their niceness)."""
    if cfg == 0:
        return sync_run(torch, a)
    threads, nice = cfg if cfg is not None else (None, None)
    off = None
    t_start = time.perf_counter()
    if threads is not None:
        off = kvoffload.KeyedOffloader(
            a.region // (len(kv) * kv[0][0].nbytes),
            kv=kvoffload.KvSpec(kv, compute_stream=torch.cuda.current_stream()),
            pin=kvoffload.PinOptions(policy="interleave", threads=threads, prefault_nice=nice),
        )
        t_start = time.perf_counter()
        off.start()
    # Pinning's end, seen by a thread blocked in wait_pinned (it releases
    # the GIL while it waits), so a pinning hidden behind the work still
    # gets its own time.
    seen: Dict[str, object] = {}

    def watch():
        seen["outcome"] = off.wait_pinned()
        seen["at"] = time.perf_counter()

    watcher = threading.Thread(target=watch) if off is not None else None
    if watcher is not None:
        watcher.start()
    r: Dict[str, object] = engine_startup(torch, a, off, a.self_test)
    t_work_end = time.perf_counter()
    if off is not None:
        watcher.join()
        outcome, t_pinned = seen["outcome"], float(seen["at"])
        r["pin_state"] = str(outcome.state.name)
        r["pin_seconds"] = t_pinned - t_start
        r["pin_hidden"] = t_pinned <= t_work_end
        r["region_bytes"] = off.region_bytes
        off.shutdown()
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--region", type=parse_size, default=16 * GIB)
    p.add_argument("--pin-threads", default="16,8,4,2", help="comma-separated pinning thread counts")
    p.add_argument("--pin-nice", default="10",
                   help="comma-separated niceness of the pinning threads (each with every thread count; 0: the engine's)")
    p.add_argument("--weights", type=parse_size, default=2 * GIB)
    p.add_argument("--weight-rounds", type=int, default=2)
    p.add_argument("--captures", type=int, default=8)
    p.add_argument("--matmuls", type=int, default=64)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-sync", dest="sync", action="store_false",
                   help="leave out vLLM's synchronous registration (the baseline)")
    p.add_argument("--json")
    p.add_argument("--self-test", action="store_true", help="show the replay check failing")
    a = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("startup.py: needs PyTorch")
        return 2
    if not torch.cuda.is_available():
        print("startup.py: skipped: no CUDA device visible to PyTorch")
        return 0 if not a.self_test else 1
    import kvoffload

    # The offloader's KV tensors: 2 of 256 blocks of 1 MiB (the region's
    # size is what matters here, not the GPU side).
    kv = [torch.zeros((256, 1 << 20), dtype=torch.uint8, device="cuda") for _ in range(2)]
    if a.self_test:
        r = one_run(torch, kvoffload, a, None, kv)
        ok = r["bad_replays"] == a.captures
        print(f"self-test: {r['bad_replays']} of {a.captures} replays seen wrong with one expected value perturbed:",
              "ok" if ok else "FAILED")
        return 0 if ok else 1

    # None: the engine alone; 0: vLLM's synchronous registration first;
    # (n, k): kvoffload pinning with n threads at niceness k behind the work.
    nices = [int(n) for n in a.pin_nice.split(",") if n]
    pinned = [(int(t), n) for t in a.pin_threads.split(",") if t for n in nices]
    threads: List[object] = [None] + pinned + ([0] if a.sync else [])
    # Warm-up: the engine's work once, and one pinning of the region (a
    # fresh machine's first touches of its memory are slow).
    one_run(torch, kvoffload, a, threads[1] if len(threads) > 1 else None, kv)
    print(
        f"startup.py: region {a.region / GIB:.0f} GiB; weights {a.weights / GIB:.1f} GiB x {a.weight_rounds}, "
        f"{a.captures} captures of {a.matmuls} matmuls {a.dim}^2; {a.repeats} repeats after a warm-up"
    )
    rows = {}
    failed = False
    for t in threads:
        runs = [one_run(torch, kvoffload, a, t, kv) for _ in range(a.repeats)]
        name = "none" if t is None else ("vllm-sync" if t == 0 else f"{t[0]} threads nice {t[1]}")
        med = lambda k: statistics.median(float(r[k]) for r in runs)  # noqa: E731
        row = {k: med(k) for k in ("weights", "captures", "total")}
        row["runs"] = runs
        bad = sum(int(r["bad_replays"]) for r in runs)
        failed |= bad != 0
        if t is not None:
            # (vllm-sync: pinning before the work, never hidden.)
            row["pin_seconds"] = med("pin_seconds")
            row["pin_gbps"] = a.region / row["pin_seconds"] / 1e9
            row["pin_hidden"] = sum(bool(r["pin_hidden"]) for r in runs)
            row["pin_states"] = sorted({str(r["pin_state"]) for r in runs})
        rows[name] = row
    base = rows["none"]
    print(f"{'':20} {'weights s':>10} {'captures s':>11} {'total s':>8} {'slowdown':>9} {'pinning s':>10} {'GB/s':>6} hidden")
    for name, r in rows.items():
        slow = r["total"] / base["total"]
        r["slowdown"] = slow
        extra = ""
        if name != "none":
            extra = f"{r['pin_seconds']:10.2f} {r['pin_gbps']:6.1f} {r['pin_hidden']}/{a.repeats} {r['pin_states']}"
        print(f"{name:20} {r['weights']:10.3f} {r['captures']:11.3f} {r['total']:8.3f} {slow:8.2f}x {extra}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items()}, "rows": rows}, f, indent=2, default=str)
    if failed:
        print("startup.py: FAILED: a replay was wrong")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
