#!/usr/bin/env python3
"""The seed incident, re-run with PyTorch on a GPU.

An engine pins a large host region (16 GiB by default) in the background to
cut its start-up time, while PyTorch captures CUDA graphs with
``torch.cuda.graph`` in its default (global) capture error mode. Two designs,
each in processes of its own, side by side:

(a) upstream: one ``cudaHostRegister`` of the whole host tensor on a Python
    background thread through ``torch.cuda.cudart()`` (vLLM's reverted
    design), run twice: ``upstream``, the thread starts with the engine,
    before its first capture (the driver holds that capture back until the
    registration returns: a stall as long as the whole pinning); and
    ``upstream-in-capture``, the thread starts while the first capture is
    open, the seed's interleaving (the registration is refused with 900 and
    the capture invalidated; PyTorch reports it when the capture ends). The
    failures PyTorch reports, and the registration's result, are recorded.
(b) kvoffload: ``kvoffload.KeyedOffloader`` over the engine's KV tensors pins in
    the background (chunked, gated) and every ``torch.cuda.graph`` runs
    inside ``off.capture_window()``: every capture succeeds, every replay
    computes the right result, and a store/load round trip through the
    pinned region is checked byte for byte.

Printed for each: start-up (captures done, pinning done), captures and
replays that worked, capture stalls (how long entering a capture took beyond
the engine's own work), the registration's outcome.

    python3 examples/seed_pytorch.py                 # one GPU, 16 GiB
    python3 examples/seed_pytorch.py --ranks 2       # one process per GPU,
                                                     # agreement over gloo
    python3 examples/seed_pytorch.py --region 1GiB --captures 5   # quick

Needs PyTorch with CUDA and the kvoffload wheel (ci/python builds it:
``pip install target/wheels/kvoffload-*.whl``); says so when either is
missing. Exit status: 0 when design (b) had no failure, 1 otherwise, 2 when
the machine cannot run it.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "bench"))
from sizes import GIB, parse_size  # noqa: E402  (the checkout's python/bench/sizes.py)


def need_torch():
    """PyTorch with a CUDA device, or a clear word and exit status 2."""
    try:
        import torch
    except ImportError as e:
        print(f"seed_pytorch: PyTorch is not installed ({e}); this example needs torch with CUDA", flush=True)
        sys.exit(2)
    if not torch.cuda.is_available():
        print(
            f"seed_pytorch: torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False; "
            f"built for CUDA {torch.version.cuda}); this example needs a GPU",
            flush=True,
        )
        sys.exit(2)
    return torch


def need_kvoffload():
    try:
        import kvoffload
    except ImportError as e:
        print(
            f"seed_pytorch: the kvoffload package is not installed ({e}); build it with ci/python and "
            "pip install target/wheels/kvoffload-*.whl",
            flush=True,
        )
        sys.exit(2)
    return kvoffload


# ---------------------------------------------------------------- the engine's captures


class Captures:
    """Graphs captured back to back, as an engine does at start-up: each
    records `nodes` kernels (y += 1) and stays open `hold` seconds (a real
    forward pass takes that long to capture)."""

    def __init__(self, torch, nodes, hold):
        self.torch, self.nodes, self.hold = torch, nodes, hold
        self.x = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
        self.graphs = []  # (graph, output)
        self.failures = []  # what PyTorch reported
        self.stalls = []  # seconds entering the capture took
        self.seconds = []  # whole capture, window included
        self.on_enter = None  # called once inside the next capture

    def one(self, window=None):
        torch = self.torch
        g = torch.cuda.CUDAGraph()
        y = torch.empty_like(self.x)
        t0 = time.perf_counter()
        entered = [None]
        try:
            if window is not None:
                with window():
                    self._capture(g, y, entered)
            else:
                self._capture(g, y, entered)
            self.graphs.append((g, y))
        except Exception as e:  # PyTorch raises when the capture ends invalidated
            self.failures.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}")
        self.seconds.append(time.perf_counter() - t0)
        if entered[0] is not None:
            self.stalls.append(entered[0] - t0)

    def _capture(self, g, y, entered):
        torch = self.torch
        # torch.cuda.graph's default capture_error_mode is "global".
        with torch.cuda.graph(g):
            entered[0] = time.perf_counter()
            if self.on_enter is not None:
                hook, self.on_enter = self.on_enter, None
                hook()
            y.copy_(self.x)
            for _ in range(self.nodes):
                y.add_(1.0)
            time.sleep(self.hold)

    def summary(self, right):
        """The captures' part of a design's result: counts, failures, `right`
        replays (from `replays()`) and the stalls entering them."""
        return dict(
            captures=len(self.seconds),
            captures_ok=len(self.graphs),
            failures=self.failures,
            replays_right=right,
            stall_max=max(self.stalls, default=0.0),
            stall_total=sum(self.stalls),
        )

    def replays(self):
        """Replays every captured graph; how many computed x + nodes."""
        torch = self.torch
        right = 0
        for g, y in self.graphs:
            y.zero_()
            g.replay()
            torch.cuda.synchronize()
            right += bool(torch.equal(y, self.x + self.nodes))
        return right


# ---------------------------------------------------------------- (a) upstream


def run_upstream(args, torch, rank, group, in_capture=False):
    cudart = torch.cuda.cudart()
    host = torch.empty(args.region, dtype=torch.uint8)  # pageable, untouched
    reg = {}
    dev = torch.cuda.current_device()

    def register():
        torch.cuda.set_device(dev)
        t = time.perf_counter()
        rc = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)
        reg.update(rc=int(rc), error=str(cudart.cudaGetErrorString(rc)), seconds=time.perf_counter() - t)
        reg["done_at"] = time.perf_counter()

    caps = Captures(torch, args.nodes, args.hold)
    t0 = time.perf_counter()
    th = threading.Thread(target=register, name="upstream-pin")
    if in_capture:
        # The seed's interleaving: pinning starts while a capture is open.
        def start_inside():
            th.start()
            time.sleep(0.01)  # the registration is under way inside the capture

        caps.on_enter = start_inside
    else:
        th.start()
    while len(caps.seconds) < args.captures:
        caps.one()
    captures_done = time.perf_counter() - t0
    th.join()
    pin_done = reg["done_at"] - t0
    right = caps.replays()
    if reg["rc"] == 0:
        cudart.cudaHostUnregister(host.data_ptr())
    pinned = reg["rc"] == 0
    return dict(
        design="upstream-in-capture" if in_capture else "upstream",
        pin=("pinned" if pinned else f"pageable: cudaHostRegister returned {reg['rc']} ({reg['error']})"),
        pin_seconds=reg["seconds"],
        pin_gbps=(args.region / reg["seconds"] / 1e9) if pinned and reg["seconds"] > 0 else None,
        **caps.summary(right),
        captures_done=captures_done,
        startup=max(captures_done, pin_done),
        agreement=None,
        round_trip=None,
    )


# ---------------------------------------------------------------- (b) kvoffload


def run_kvoffload(args, torch, rank, group):
    kv = need_kvoffload()
    dev = torch.cuda.current_device()
    page = args.page
    layers = 2
    tensors = [torch.zeros((args.gpu_blocks, page), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    host_blocks = max(1, args.region // (layers * page))
    agreement = kv.torch_agreement(group) if group is not None else None
    caps = Captures(torch, args.nodes, args.hold)
    t0 = time.perf_counter()
    off = kv.KeyedOffloader(
        host_blocks,
        kv=kv.KvSpec(tensors, compute_stream=torch.cuda.current_stream().cuda_stream),
        runtime=kv.Runtime("cuda", dev),
        pin=kv.PinOptions(policy=args.policy),
        agreement=agreement,
    )
    built = time.perf_counter() - t0
    off.start()
    waited = []

    def window():
        w = off.capture_window()
        return _Tracked(w, waited)

    while len(caps.seconds) < args.captures:
        caps.one(window)
    captures_done = time.perf_counter() - t0
    out = off.wait_pinned()
    pin_done = time.perf_counter() - t0
    right = caps.replays()

    # Offload works: store blocks, clobber them, load them elsewhere, compare.
    n = min(64, args.gpu_blocks // 2, host_blocks)
    src = [torch.randint(0, 256, (n, page), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    for t, s in zip(tensors, src):
        t[:n].copy_(s)
    keys = [(rank << 32) + i for i in range(n)]
    res = off.store(keys, list(range(n)))
    off.wait_all()
    done = off.poll()
    for t in tensors:
        t[:n].zero_()
    job = off.load(keys, list(range(n, 2 * n)))
    off.wait(job)
    done += off.poll()
    same = all(bool(torch.equal(t[n : 2 * n], s)) for t, s in zip(tensors, src))
    moved = sum(c.bytes for c in done)
    backends = sorted({c.backend for c in done})
    ok = same and len(res.stored) == n and all(c.ok for c in done)
    off.shutdown()
    state = out.state
    err = out.agreement_error
    return dict(
        design="kvoffload",
        pin=str(state) if state.reason is None else f"pageable: {state.message}",
        pin_seconds=pin_done - built,
        pin_gbps=(off.region_bytes / (pin_done - built) / 1e9) if state == "pinned" else None,
        **caps.summary(right),
        chunks_waited_max=max(waited, default=0),
        captures_done=captures_done,
        startup=max(captures_done, pin_done),
        build_seconds=built,
        agreement=None if out.agreed is None else ("agreed" if out.agreed else f"failed: {err}"),
        round_trip=f"{'ok' if ok else 'FAILED'}: {n} keys, {moved} bytes, {'/'.join(backends)}",
        round_trip_ok=ok,
    )


class _Tracked:
    """A capture window that records how many chunks it waited for."""

    def __init__(self, w, waited):
        self.w, self.waited = w, waited

    def __enter__(self):
        self.w.__enter__()
        self.waited.append(self.w.chunks_waited)
        return self

    def __exit__(self, *exc):
        return self.w.__exit__(*exc)


# ---------------------------------------------------------------- one rank (a child process)


def rank_main(args):
    torch = need_torch()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    torch.zeros(1, device="cuda")  # the primary context exists before pinning starts
    group = None
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.new_group(backend="gloo")  # the agreement's own group
    if args.design == "kvoffload":
        r = run_kvoffload(args, torch, rank, group)
    else:
        r = run_upstream(args, torch, rank, group, in_capture=args.design == "upstream-in-capture")
    r.update(rank=rank, device=dev, gpu=torch.cuda.get_device_name(dev), torch=torch.__version__)
    print("SEED-RESULT " + json.dumps(r), flush=True)
    if group is not None:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------- the launcher


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, design):
    """Runs `design` in args.ranks child processes; their results."""
    port = str(free_port())
    procs = []
    for r in range(args.ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--design", design] + args.passthrough
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\n(rank {r} timed out after {args.timeout} s)"
        got = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("SEED-RESULT ")]
        if p.returncode == 2 and not got:
            print(out.strip())
            sys.exit(2)
        if not got or p.returncode != 0:
            tail = "\n".join(out.strip().splitlines()[-25:])
            got = [dict(design=design, rank=r, crashed=f"exit status {p.returncode}", output=tail)]
        results += got
    return results


def fmt_s(v):
    return "-" if v is None else f"{v:.3f} s"


def table(rows_by_design, args):
    cols = []
    for design, rows in rows_by_design:
        for r in rows:
            cols.append((f"{design} r{r.get('rank', 0)}", r))
    lines = [
        ("pinning", lambda r: r.get("pin", "-")),
        ("pinning time", lambda r: fmt_s(r.get("pin_seconds"))
         + (f" ({r['pin_gbps']:.1f} GB/s)" if r.get("pin_gbps") else "")),
        ("ranks agreed", lambda r: r.get("agreement") or "-"),
        ("captures ok / made", lambda r: f"{r.get('captures_ok', 0)} / {r.get('captures', 0)}"),
        ("replays right", lambda r: f"{r.get('replays_right', 0)} / {r.get('captures_ok', 0)}"),
        ("capture stall max", lambda r: fmt_s(r.get("stall_max"))),
        ("capture stall total", lambda r: fmt_s(r.get("stall_total"))),
        ("chunks a window waited (max)", lambda r: str(r.get("chunks_waited_max", "-"))),
        ("captures done at", lambda r: fmt_s(r.get("captures_done"))),
        ("start-up (captures and pinning)", lambda r: fmt_s(r.get("startup"))),
        ("offload round trip", lambda r: r.get("round_trip") or "-"),
    ]
    w0 = max(len(n) for n, _ in lines)
    cells = [[f(r) if "crashed" not in r else r["crashed"] for _, r in cols] for _, f in lines]
    widths = [max(len(c[0]), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print()
    print(f"seed incident with PyTorch: region {args.region / GIB:g} GiB per rank, {args.ranks} rank(s), "
          f"captures hold {args.hold * 1000:.0f} ms, kvoffload policy {args.policy}")
    print(" " * w0 + "  " + "  ".join(c[0].ljust(widths[i]) for i, c in enumerate(cols)))
    for (name, _), row in zip(lines, cells):
        print(name.ljust(w0) + "  " + "  ".join(v.ljust(widths[i]) for i, v in enumerate(row)))
    for label, r in cols:
        for f in r.get("failures", [])[:5]:
            print(f"  {label}: PyTorch reported: {f}")
        if len(r.get("failures", [])) > 5:
            print(f"  {label}: ... {len(r['failures']) - 5} more")
        if "crashed" in r:
            print(f"  {label} crashed; its output ends:\n{r['output']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--region", type=parse_size, default=16 * GIB, help="host region per rank (default 16GiB)")
    ap.add_argument("--captures", type=int, default=20, help="graphs the engine captures at start-up (default 20)")
    ap.add_argument("--hold", type=float, default=0.1, help="seconds each capture stays open (default 0.1)")
    ap.add_argument("--nodes", type=int, default=64, help="kernels per graph (default 64)")
    ap.add_argument("--page", type=parse_size, default=64 << 10, help="bytes of a KV block per layer (default 64KiB)")
    ap.add_argument("--gpu-blocks", type=int, default=1024, help="KV blocks per tensor on the GPU (default 1024)")
    ap.add_argument("--policy", choices=["interleave", "after_pinning"], default="interleave",
                    help="kvoffload's capture policy (default interleave: captures during pinning)")
    ap.add_argument("--ranks", type=int, default=1, help="processes, one per GPU; >1 agree over gloo (default 1)")
    ap.add_argument("--design", choices=["all", "upstream", "upstream-in-capture", "kvoffload"], default="all")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per design run (default 900)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        rank_main(args)
        return
    torch = need_torch()
    need_kvoffload()
    if args.ranks > torch.cuda.device_count():
        print(f"seed_pytorch: note: {args.ranks} ranks on {torch.cuda.device_count()} GPU(s): ranks share GPUs")
    args.passthrough = [a for a in sys.argv[1:] if a != "--child"]
    # The child gets --design from the launcher; drop the user's.
    clean, skip = [], False
    for a in args.passthrough:
        if skip:
            skip = False
            continue
        if a == "--design":
            skip = True
            continue
        if a.startswith("--design="):
            continue
        clean.append(a)
    args.passthrough = clean
    designs = ["upstream", "upstream-in-capture", "kvoffload"] if args.design == "all" else [args.design]
    results = []
    for d in designs:
        print(f"seed_pytorch: running {d} ({args.ranks} rank(s)) ...", flush=True)
        results.append((d, launch(args, d)))
    table(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({d: rows for d, rows in results}, f, indent=2)
    ours = dict(results).get("kvoffload", [])
    bad = [r for r in ours if "crashed" in r or r["failures"] or r["replays_right"] != r["captures_ok"]
           or not r.get("round_trip_ok")]
    if ours:
        print(f"\nkvoffload: {'every capture succeeded and every replay was right' if not bad else 'FAILURES above'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
