#!/usr/bin/env python3
"""A real vLLM engine with kvoffload as its offloading spec, beside vLLM's
own ``CPUOffloadingSpec`` on the same engine and sizes (issue 31 item 3).

Each configuration (spec x host region x attention backend) builds one
``vllm.LLM`` in a process of its own (``--one``), CUDA graphs on
(``enforce_eager=False``), with ``kv_transfer_config`` naming the spec,
and measures:

- start-up: seconds from ``LLM(...)`` to the engine (ready) and to the
  first generated token; when ``get_worker`` ran and how long it took (where
  vLLM's own spec pins, synchronously); the graph captures (count, first
  and last) and, for kvoffload, when pinning ended, how many captures
  began while it ran and the longest a capture waited for its window;
- generation: ``--prompts`` prompts of ``--prompt-tokens`` token ids, greedy,
  ``--max-tokens`` each: pass 1 computes them (and stores their blocks to
  the host, evicting the oldest once the region is full); pass 2 re-runs
  the last ``--reuse`` prompts served from the GPU prefix cache; the GPU
  prefix cache is reset; pass 3 re-runs them served from blocks loaded
  back from the host; pass 4 (cache reset again) re-runs the first
  ``--reuse`` prompts, evicted from a small region. Every pass's tokens must
  equal pass 1's;
- transfers: jobs, bytes and blocks stored and loaded, and GB/s as vLLM's
  stats count it (bytes over the device seconds of each job's
  ``TransferResult``).

The parent prints one table and writes every figure with ``--json``. Exit
status 0 when every engine was built, every pass equal and, for kvoffload,
pinning completed (``pinned``); 1 otherwise; 2 when vLLM or CUDA is missing.

    PYTHONPATH=/tmp/site:<kvoffload> python3 python/bench/vllm_engine.py \\
        --model ../shared/vllm-0.26-h200/model --specs kvoffload,vllm \\
        --regions 4GiB,64GiB --attention FLASH_ATTN,TRITON_ATTN --json engine.json

The engine is vLLM's (0.26 on the H200 machine: ``../shared/vllm-0.26-h200``,
a 2-layer Llama with dummy weights, token-id prompts); the environment it
needs is set here (``VLLM_USE_FLASHINFER_SAMPLER=0``,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine and worker in this process, so
the worker can be observed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time

GIB = 1 << 30
SPECS = {
    "kvoffload": ("KvoffloadSpec", "kvoffload.vllm"),
    "vllm": ("CPUOffloadingSpec", None),
    "none": (None, None),  # no offloading: the engine's own start-up, the baseline of both
}


def parse_size(s: str) -> int:
    t = s.strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": GIB, "t": 1 << 40}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def say(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- one engine


class Observed:
    """What the wrappers saw, with times relative to ``t0`` (``LLM(...)``)."""

    def __init__(self):
        self.t0 = None
        self.lock = threading.Lock()
        self.get_worker = None  # (start, end)
        self.worker = None
        self.captures = []  # (begin, seconds in begin, pin state at begin)
        self.capture_errors = []
        self.pinned_at = None
        self.pinned = threading.Event()
        self.pin_state = None
        self.block_bytes = None
        self.jobs = {}  # job id -> ("store" | "load", submitted at)
        # (bytes, seconds the spec reported, success, submitted at, reported at)
        self.results = {"store": [], "load": []}

    def now(self):
        return time.monotonic() - self.t0


def observe(obs: Observed, spec: str):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

    real_register = OffloadingConnectorWorker.register_kv_caches

    def register_kv_caches(self, *a, **kw):
        t = obs.now()
        r = real_register(self, *a, **kw)
        obs.get_worker = (t, obs.now())
        watch(obs, self.worker, spec)
        return r

    OffloadingConnectorWorker.register_kv_caches = register_kv_caches

    # The bytes of one GPU block over every KV tensor, from what get_worker
    # receives (vLLM's CanonicalKVCaches), to count blocks moved.
    if spec == "kvoffload":
        import kvoffload.vllm as kvv

        spec_cls = kvv.KvoffloadSpec
    else:
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as spec_cls
    real_get_worker = spec_cls.get_worker

    def get_worker(self, kv_caches):
        obs.block_bytes = sum(t.page_size_bytes for t in kv_caches.tensors)
        return real_get_worker(self, kv_caches)

    spec_cls.get_worker = get_worker

    # Captures, timed outermost: installed after the worker (whose capture
    # hook wraps the class in get_worker), so a capture's begin includes
    # the wait for its window.
    def wrap_captures():
        if getattr(obs, "captures_wrapped", False):
            return
        obs.captures_wrapped = True
        cls = torch.cuda.CUDAGraph
        begin, end = cls.capture_begin, cls.capture_end

        def capture_begin(graph, *a, **kw):
            t = obs.now()
            off = getattr(obs.worker, "offloader", None)
            state = str(off.pin_progress.state) if off is not None else None
            try:
                r = begin(graph, *a, **kw)
            except BaseException as e:
                obs.capture_errors.append(repr(e))
                raise
            obs.captures.append((t, obs.now() - t, state))
            return r

        def capture_end(graph, *a, **kw):
            try:
                return end(graph, *a, **kw)
            except BaseException as e:
                obs.capture_errors.append(repr(e))
                raise

        cls.capture_begin, cls.capture_end = capture_begin, capture_end

    obs.wrap_captures = wrap_captures


def observe_captures_only(obs: Observed):
    """No offloading: the captures, timed the same way (installed before
    the engine, so nothing else wraps them)."""
    import torch

    cls = torch.cuda.CUDAGraph
    begin = cls.capture_begin

    def capture_begin(graph, *a, **kw):
        t = obs.now()
        r = begin(graph, *a, **kw)
        obs.captures.append((t, obs.now() - t, None))
        return r

    cls.capture_begin = capture_begin


def watch(obs: Observed, worker, spec: str):
    """Records the worker's transfers (and, for kvoffload, when pinning
    ends), then times the graph captures from outside its hook."""
    obs.worker = worker
    real_store, real_load, real_finished = worker.submit_store, worker.submit_load, worker.get_finished

    def submit_store(job_id, *a, **kw):
        obs.jobs[job_id] = ("store", obs.now())
        return real_store(job_id, *a, **kw)

    def submit_load(job_id, *a, **kw):
        obs.jobs[job_id] = ("load", obs.now())
        return real_load(job_id, *a, **kw)

    def get_finished():
        out = real_finished()
        now = obs.now()
        for r in out:
            d, t = obs.jobs.pop(r.job_id, ("?", now))
            obs.results.setdefault(d, []).append(
                (r.transfer_size or 0, r.transfer_time or 0.0, bool(r.success), t, now)
            )
        return out

    worker.submit_store, worker.submit_load, worker.get_finished = submit_store, submit_load, get_finished
    if spec == "kvoffload":
        off = worker.offloader

        def pinned():
            try:
                outcome = off.wait_pinned()
                obs.pin_state = str(outcome.state)
            except BaseException as e:  # noqa: BLE001 - shut down before pinning ended
                obs.pin_state = f"error: {e!r}"
            obs.pinned_at = obs.now()
            obs.pinned.set()

        threading.Thread(target=pinned, name="bench-pin-watch", daemon=True).start()
    obs.wrap_captures()


def busy_seconds(spans):
    """The length of the union of ``(start, end)`` intervals: the time at
    least one job of a direction was in flight (submitted, not yet
    reported)."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def prompts_of(n, tokens, seed, vocab=32000):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(tokens)] for _ in range(n)]


def run_one(args) -> dict:
    spec, region, attention = args.one.split(":")
    if spec not in SPECS:
        raise ValueError(f"unknown spec {spec!r} (one of {', '.join(SPECS)})")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    obs = Observed()
    name, module = SPECS[spec]
    extra = None
    if name is not None:
        observe(obs, spec)
        extra = {"spec_name": name, "cpu_bytes_to_use": parse_size(region)}
        if module:
            extra["spec_module_path"] = module
        for kv in args.extra or []:
            k, _, v = kv.partition("=")
            extra[k] = json.loads(v) if v[:1] in "0123456789[{tf\"" else v
    else:
        observe_captures_only(obs)
    out = {
        "spec": spec,
        "region": region,
        "region_bytes": parse_size(region) if name is not None else 0,
        "attention": attention,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "extra": extra,
    }
    kvt = None
    if extra is not None:
        kvt = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    obs.t0 = time.monotonic()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=False,
        attention_backend=attention,
        kv_transfer_config=kvt,
        kv_cache_memory_bytes=parse_size(args.gpu_kv),
        max_model_len=args.max_model_len,
        enable_prefix_caching=True,
        seed=0,
    )
    out["ready_s"] = obs.now()
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = prompts_of(1, 64, seed=1)[0]
    llm.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)
    out["first_token_s"] = obs.now()
    out["get_worker_s"] = obs.get_worker
    caps = obs.captures
    out["captures"] = len(caps)
    out["capture_errors"] = obs.capture_errors
    out["captures_first_last_s"] = (caps[0][0], caps[-1][0] + caps[-1][1]) if caps else None
    out["capture_begin_max_s"] = max((c[1] for c in caps), default=None)
    if spec == "kvoffload":
        off = obs.worker.offloader
        # Pinning may still run after the first token: the watcher thread
        # records when it ends (bounded by the bench's own timeout).
        obs.pinned.wait(timeout=args.timeout)
        out["pinned_s"] = obs.pinned_at
        out["pin_state"] = obs.pin_state
        out["captures_while_pinning"] = sum(1 for c in caps if c[2] not in ("pinned", "pageable", None))
        out["host_slots"] = off.host_blocks
        out["region_bytes_mapped"] = off.region_bytes
        out["jobs_queued_before_pinned"] = obs.worker.jobs_queued

    # Generation: computed, from the GPU cache, from the host, evicted.
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = prompts_of(args.prompts, args.prompt_tokens, seed=2)

    def gen(ps):
        t = time.monotonic()
        before = {d: len(v) for d, v in obs.results.items()}
        res = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        toks = [list(r.outputs[0].token_ids) for r in res]
        moved = {d: obs.results[d][before.get(d, 0) :] for d in obs.results}
        return toks, time.monotonic() - t, moved

    def summary(moved, secs):
        row = {"seconds": secs}
        for d in ("store", "load"):
            rs = moved.get(d, [])
            b = sum(r[0] for r in rs)
            row[d] = {"jobs": len(rs), "bytes": b, "failed": sum(1 for r in rs if not r[2])}
        return row

    passes = {}
    k = args.reuse
    o1, s, m = gen(prompts)
    passes["1 computed"] = summary(m, s)
    o2, s, m = gen(prompts[-k:])
    passes["2 GPU cache"] = summary(m, s)
    passes["2 GPU cache"]["equal"] = o2 == o1[-k:]
    reset = llm.reset_prefix_cache()
    o3, s, m = gen(prompts[-k:])
    passes["3 host"] = summary(m, s)
    passes["3 host"]["equal"] = o3 == o1[-k:]
    passes["3 host"]["reset"] = reset
    reset = llm.reset_prefix_cache()
    o4, s, m = gen(prompts[:k])
    passes["4 first prompts"] = summary(m, s)
    passes["4 first prompts"]["equal"] = o4 == o1[:k]
    passes["4 first prompts"]["reset"] = reset
    out["passes"] = passes
    out["equal"] = all(p.get("equal", True) for p in passes.values())
    out["block_bytes"] = obs.block_bytes
    # Copy speeds, two ways: over the time jobs of a direction were in
    # flight (submitted by vLLM's connector until get_finished reported
    # them: the same measure for both specs, at the engine's step
    # granularity), and as each spec reports them to vLLM's stats (bytes
    # over the sum of TransferResult.transfer_time: vLLM's handler reports
    # the device time between its start and end events, kvoffload the time
    # from submission until the completion was seen).
    for d in ("store", "load"):
        rs = [r for r in obs.results.get(d, []) if r[2]]
        b, t = sum(r[0] for r in rs), sum(r[1] for r in rs)
        busy = busy_seconds([(r[3], r[4]) for r in rs])
        lat = sorted(r[4] - r[3] for r in rs)
        out[f"{d}_jobs"] = len(rs)
        out[f"{d}_bytes"] = b
        out[f"{d}_busy_s"] = busy
        out[f"{d}_gbps"] = b / busy / 1e9 if busy > 0 else None
        out[f"{d}_reported_gbps"] = b / t / 1e9 if t > 0 else None
        out[f"{d}_latency_ms_p50_p99"] = (lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.99)] * 1e3) if lat else None
        out[f"{d}_failed"] = sum(1 for r in obs.results.get(d, []) if not r[2])
    try:
        out["tokens_per_block"] = llm.llm_engine.vllm_config.cache_config.block_size
    except AttributeError:
        out["tokens_per_block"] = None
    out["ok"] = (
        out["equal"]
        and not out["capture_errors"]
        and out["captures"] > 0
        and (spec != "kvoffload" or out["pin_state"] == "pinned")
        and (spec == "none" or out["passes"]["3 host"]["load"]["jobs"] > 0)
        and out["load_failed"] == 0
        and out["store_failed"] == 0
    )
    t = time.monotonic()
    try:
        del llm
        import gc

        gc.collect()
    except Exception as e:  # noqa: BLE001 - reported, the figures above stand
        out["teardown_error"] = repr(e)
    out["teardown_s"] = time.monotonic() - t
    return out


def shm_files():
    """/dev/shm entries and their sizes (a region left behind would hold
    the next engine's memory)."""
    try:
        return {e.name: e.stat(follow_symlinks=False).st_size for e in os.scandir("/dev/shm")}
    except OSError:
        return {}


def mem_available_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


# ---------------------------------------------------------------- the table


def row(r):
    head = f"{r.get('label', '')}{r['spec']:9} {r['region']:>6} {r['attention']:11}"
    if "error" in r:
        return f"{head} FAILED: {r['error'][-300:]}"
    gw = r["get_worker_s"]
    gw = f"{gw[1] - gw[0]:6.2f} s" if gw else "     - "
    pin = f"{r['pinned_s']:5.1f}" if r.get("pinned_s") is not None else "    -"
    caps = r["captures_first_last_s"]
    caps = f"{caps[0]:5.1f}-{caps[1]:5.1f} s" if caps else "-"
    p3 = r["passes"]["3 host"]["load"]
    p4 = r["passes"]["4 first prompts"]["load"]
    bb = r.get("block_bytes")

    def gbps(d):
        v, rep = r.get(f"{d}_gbps"), r.get(f"{d}_reported_gbps")
        return f"{v or 0:5.1f} ({rep or 0:5.1f})" if r["spec"] != "none" else "    -        "

    return (
        f"{head} ready {r['ready_s']:5.1f} s  1st token {r['first_token_s']:5.1f} s  get_worker {gw}  "
        f"pinned {pin} s  {r['captures']} captures {caps} (while pinning {r.get('captures_while_pinning', '-')}, "
        f"longest begin {(r['capture_begin_max_s'] or 0) * 1e3:.1f} ms)  store {gbps('store')} GB/s  "
        f"load {gbps('load')} GB/s  blocks loaded: pass 3 {p3['bytes'] // bb if bb else '-'}, pass 4 "
        f"{p4['bytes'] // bb if bb else '-'}  equal {r['equal']}  {'ok' if r['ok'] else 'NOT OK'}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "../../../shared/vllm-0.26-h200/model"))
    ap.add_argument("--specs", default="kvoffload,vllm")
    ap.add_argument("--regions", default="4GiB,64GiB")
    ap.add_argument("--attention", default="FLASH_ATTN,TRITON_ATTN")
    ap.add_argument("--prompts", type=int, default=1200)
    ap.add_argument("--prompt-tokens", type=int, default=1984)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--reuse", type=int, default=100, help="prompts re-run in passes 2-4")
    ap.add_argument("--gpu-kv", default="2GiB", help="the GPU KV cache (kv_cache_memory_bytes)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--extra", action="append", help="KEY=VALUE added to kv_connector_extra_config")
    ap.add_argument("--timeout", type=float, default=400, help="seconds per engine")
    ap.add_argument(
        "--warmup",
        default="none:-:FLASH_ATTN",
        help="SPEC:REGION:ATTENTION run first and reported apart (a fresh machine compiles and JITs: its "
        "first engine pays for it), '' for none",
    )
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        try:
            r = run_one(args)
        except BaseException as e:  # noqa: BLE001 - reported to the parent as this engine's failure
            import traceback

            traceback.print_exc()
            spec, region, attention = args.one.split(":")
            r = {"spec": spec, "region": region, "attention": attention, "error": repr(e), "ok": False}
        print("RESULT " + json.dumps(r), flush=True)
        os._exit(0 if r.get("ok") else 1)  # skip vLLM's atexit teardown of a failed engine
    try:
        import torch

        if not torch.cuda.is_available():
            say("vllm_engine: no CUDA device (torch.cuda.is_available() is False)")
            return 2
        import vllm  # noqa: F401
    except ImportError as e:
        say(f"vllm_engine: {e} (put vLLM on PYTHONPATH, e.g. the shared 0.26 bundle unpacked to /tmp/site)")
        return 2
    configs = []
    if args.warmup:
        configs.append(("warm-up ", args.warmup))
    for attention in args.attention.split(","):
        for spec in args.specs.split(","):
            for region in args.regions.split(",") if spec != "none" else ["-"]:
                configs.append(("", f"{spec}:{region}:{attention}"))
    results = []
    for label, one in configs:
        spec, region, attention = one.split(":")
        rest = list(sys.argv[1:])
        if "--json" in rest:
            i = rest.index("--json")
            del rest[i : i + 2]
        cmd = [sys.executable, __file__, "--one", one] + rest
        if label:
            cmd += ["--prompts", str(min(args.prompts, 50))]  # the warm-up's figures are its start-up alone
        say(f"== {label}{one} (MemAvailable {mem_available_gib():.1f} GiB)")
        shm_before = shm_files()
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            text = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            text += "\nRESULT " + json.dumps(
                {"spec": spec, "region": region, "attention": attention, "error": f"timeout {args.timeout} s", "ok": False}
            )
        lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
        if lines:
            r = json.loads(lines[-1][len("RESULT ") :])
        else:
            r = {"spec": spec, "region": region, "attention": attention, "error": text[-2000:], "ok": False}
        r["label"] = label
        r["process_s"] = time.monotonic() - t
        r["log_tail"] = [l for l in text.splitlines() if not l.startswith("RESULT ")][-40:]
        r["shm_left"] = {k: v for k, v in shm_files().items() if k not in shm_before}
        if r["shm_left"]:
            r["ok"] = False
            r.setdefault("error", f"files left in /dev/shm: {r['shm_left']}")
        results.append(r)
        say(row(r))
        if not r.get("ok"):
            say("\n".join(r["log_tail"][-25:]))
    say("\n== summary")
    for r in results:
        say(row(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
