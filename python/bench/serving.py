#!/usr/bin/env python3
"""A serving benchmark of vLLM with and without KV-cache offloading (issue 42):
a Llama-3-8B-shaped model (``llama3-8b-shape/``, dummy weights), the engine
core in its own process as ``vllm serve`` runs it, vLLM's own
``CPUOffloadingSpec`` beside kvoffload's ``KvoffloadSpec`` and no offloading.

Each engine (spec x host region x repetition) runs in a child process of its
own session; when it ends or times out its whole process group is stopped
(SIGTERM, then SIGKILL: vLLM's engine core outlives a parent that exits),
and the next engine starts only once GPU memory is back to what it was
before the first one (bounded wait, reported when it is not). A warm-up
engine (no offloading, not reported) runs first; the order of the specs
rotates with each repetition. Measured in the child:

- start-up: seconds until ``LLM(...)`` returns (ready); from vLLM's log the
  graph-capture seconds ("Graph capturing finished in N secs", whole
  seconds), the engine's own init and model-load figures; for kvoffload,
  when pinning ended (a probe in the engine core, ``--no-pin-probe`` off);
- (a) long-prompt reuse after GPU eviction: ``--prompts`` prompts of
  ``--prompt-tokens`` random token ids, ``--max-tokens`` greedy tokens.
  Pass 1 computes them (and stores them to the host); the GPU prefix cache
  is reset; pass 2 runs them again (host hits, or recomputed without
  offloading); pass 3 again (GPU prefix cache). Every pass's tokens must
  equal pass 1's;
- (b) mixed: the GPU prefix cache reset again, ``--mixed-new`` prompts never
  seen interleaved with the first half of the old ones: stores and loads at
  once;
- transfers: bytes, jobs and seconds of loads and stores per pass, from
  vLLM's own KV-connector stats (its Prometheus counters
  ``vllm:kv_offload_{load,store}_{bytes,time}``, read in the front-end
  process; the engine core ships them with its outputs), and the prompt
  tokens by source (computed, GPU prefix cache, external = loaded by the
  connector). The seconds are what each spec reports to vLLM per job: the
  job's device time between CUDA events, for vLLM's handler and (since
  ``Completion.device_seconds``, issue 42) for kvoffload.

Results: one line per engine as it ends, ``serving.json`` (every figure,
rewritten after each engine) and ``serving.jsonl`` (one line per engine,
appended) and ``serving.md`` (median [min-max] per spec and region) in
``--out-dir``. ``--budget-s`` stops starting engines that would likely end
past it. Exit status 0 when every engine run was ok, 1 otherwise, 2 when
vLLM is missing.

    PYTHONPATH=/tmp/site:<kvoffload> python3 python/bench/serving.py \\
        --regions 64GiB,96GiB --reps 3 --out-dir gpu-out/serving

``--self-test`` checks the parts that need no GPU (process groups with a
fake engine, GPU-free wait, budget, log parsing, the table) in about a
minute.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import vllm_engine as ve  # noqa: E402  (parse_size, shm_files, mem_available_gib, prompts_of, say)

parse_size, say = ve.parse_size, ve.say
GIB = 1 << 30
SPECS = {
    "none": (None, None),
    "vllm": ("CPUOffloadingSpec", None),
    "kvoffload": ("KvoffloadSpec", "kvoffload.vllm"),
}
PROBE_MODULE, PROBE_SPEC = "serving", "ProbedKvoffloadSpec"
PASSES = ("1 computed", "2 after reset", "3 GPU cache", "4 mixed")


# ------------------------------------------------------------ small helpers


def parse_value(v: str):
    """A --kvo-extra value: JSON where it parses (numbers, true/false, null,
    quoted strings), a size with a unit (``64MiB``) as bytes, else the text."""
    try:
        return json.loads(v)
    except ValueError:
        pass
    if re.fullmatch(r"\d+(\.\d+)?\s*[kmgt]i?b?", v.strip().lower()):
        return parse_size(v)
    return v


def parse_extra(items) -> dict:
    out = {}
    for kv in items or []:
        k, sep, v = kv.partition("=")
        if not sep or not k.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {kv!r}")
        out[k.strip()] = parse_value(v)
    return out


def median_range(values):
    """(median, min, max, n) of the values that are numbers, None if none."""
    xs = [float(x) for x in values if isinstance(x, (int, float)) and not isinstance(x, bool)]
    if not xs:
        return None
    return statistics.median(xs), min(xs), max(xs), len(xs)


def fmt_num(x) -> str:
    if x is None:
        return "-"
    a = abs(round(x, 2))
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def fmt_cell(values) -> str:
    m = median_range(values)
    if m is None:
        return "-"
    med, lo, hi, n = m
    return fmt_num(med) if n == 1 else f"{fmt_num(med)} [{fmt_num(lo)}-{fmt_num(hi)}]"


def rotated(seq, k):
    seq = list(seq)
    if not seq:
        return seq
    k %= len(seq)
    return seq[k:] + seq[:k]


def plan_engines(specs, regions, reps, warmup=True, first_rep=0):
    """The engines in run order: the warm-up, then per repetition every
    spec (rotated by the repetition) at every region (none: one)."""
    plan = []
    if warmup:
        plan.append({"spec": "none", "region": "-", "rep": -1, "warmup": True})
    for rep in range(first_rep, first_rep + reps):
        for spec in rotated(specs, rep):
            for region in regions if spec != "none" else ["-"]:
                plan.append({"spec": spec, "region": region, "rep": rep, "warmup": False})
    return plan


def label_of(job) -> str:
    if job.get("warmup"):
        return "warm-up (none)"
    return f"{job['spec']}:{job['region']} rep {job['rep'] + 1}"


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------ process groups


def group_members(pgid):
    """Live (not zombie) processes of process group ``pgid``, from /proc;
    where /proc cannot be read, [pgid] while the group can be signalled."""
    try:
        names = os.listdir("/proc")
    except OSError:
        names = None
    if names is None:
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    out = []
    for n in names:
        if not n.isdigit():
            continue
        try:
            with open(f"/proc/{n}/stat", "rb") as f:
                s = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = s[s.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            out.append(int(n))
    return out


def wait_group_gone(pgid, proc, seconds):
    end = time.monotonic() + seconds
    while True:
        proc.poll()  # reap the leader once it exits
        left = group_members(pgid)
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.1)


def end_group(proc, grace_s):
    """Stops every process of ``proc``'s session (its process group): SIGTERM,
    up to ``grace_s`` for them to exit, then SIGKILL (10 s more)."""
    pgid = proc.pid  # start_new_session: the child leads its own group
    t = time.monotonic()
    out = {"term_sent": False, "killed": False, "members_left": []}
    left = wait_group_gone(pgid, proc, 0)
    if left:
        out["term_sent"] = True
        out["members_at_term"] = len(left)
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        left = wait_group_gone(pgid, proc, grace_s)
    if left:
        out["killed"] = True
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        left = wait_group_gone(pgid, proc, 10)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    out["members_left"] = left
    out["seconds"] = round(time.monotonic() - t, 3)
    return out


# ------------------------------------------------------------ GPU memory


def gpu_index():
    v = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return v if v.isdigit() else "0"


def fake_pids():
    """Live processes carrying the self-test's marker (the fake engines')."""
    marker = os.environ.get("KVO_SERVING_FAKE_MARKER", "").encode()
    if not marker:
        return []
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if marker not in f.read():
                    continue
            with open(f"/proc/{d}/stat", "rb") as f:
                s = f.read().decode(errors="replace")
            if s[s.rfind(")") + 2 :].split()[0] not in ("Z", "X"):
                out.append(int(d))
        except OSError:
            continue
    return out


def reap_fakes():
    """End of a self-test: waits up to 10 s for its fake engines or servers
    to go, then SIGKILLs those left (a failed check may leave some: this
    test's own, by pid)."""
    deadline = time.monotonic() + 10
    while fake_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in fake_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def fake_gpu_used_mib():
    """--fake: 4096 MiB per live fake engine process."""
    return 4096 * len(fake_pids())


def smi_query(fields, fmt):
    """``nvidia-smi --query-gpu=<fields> --format=<fmt>`` of the engines'
    GPU, run (None when it cannot be: no nvidia-smi, 30 s without an answer)."""
    try:
        return subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", f"--format={fmt}", "-i", gpu_index()],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def gpu_used_mib(fake=False):
    """GPU memory in use (MiB) on the device the engines use: nvidia-smi,
    else torch in a throw-away process (this process never opens CUDA)."""
    if fake:
        return fake_gpu_used_mib()
    p = smi_query("memory.used", "csv,noheader,nounits")
    try:
        if p is not None and p.returncode == 0 and p.stdout.strip():
            return int(float(p.stdout.split()[0]))
    except ValueError:
        pass
    try:
        code = "import torch; f, t = torch.cuda.mem_get_info(); print((t - f) >> 20)"
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
        if p.returncode == 0:
            return int(p.stdout.split()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        pass
    return None


def wait_gpu_free(baseline, slack_mib, timeout_s, fake=False, stop=None):
    """Polls (bounded by ``timeout_s``) until GPU memory in use is at most
    ``baseline + slack_mib``; says how long it waited and whether it was."""
    t = time.monotonic()
    used = gpu_used_mib(fake)
    while used is not None and baseline is not None and used > baseline + slack_mib:
        if time.monotonic() - t >= timeout_s or (stop is not None and stop()):
            break
        time.sleep(1.0 if not fake else 0.2)
        used = gpu_used_mib(fake)
    out = {"waited_s": round(time.monotonic() - t, 2), "used_mib": used, "baseline_mib": baseline}
    if used is None or baseline is None:
        out["free"] = None
        out["why"] = "GPU memory could not be read (no nvidia-smi, no torch)"
    else:
        out["free"] = used <= baseline + slack_mib
    return out


def device_name():
    p = smi_query("name,memory.total,driver_version", "csv,noheader")
    return (p.stdout.strip() or None) if p is not None else None


# ------------------------------------------------------------ log parsing

_RE = {
    "graph": re.compile(r"Graph capturing finished in (\d+(?:\.\d+)?) secs?, took (-?\d+(?:\.\d+)?) GiB"),
    "kv_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "init": re.compile(
        r"init engine \(profile, create kv cache, warmup model\) took (\d+(?:\.\d+)?) s(?: \(compilation: (\d+(?:\.\d+)?) s)?"
    ),
    "load": re.compile(r"Model loading took (\d+(?:\.\d+)?) GiB(?: memory)? and (\d+(?:\.\d+)?) seconds"),
    "xfer": re.compile(r"KV Transfer metrics: (.*)$"),
    "stamp": re.compile(r"\b(?:INFO|WARNING|DEBUG|ERROR)\s+(\d\d-\d\d \d\d:\d\d:\d\d)\b"),
    "kv": re.compile(r"([^\s=,]+(?::\([^)]*\))?)=(-?[0-9.]+(?:[eE][-+]?\d+)?|nan|inf)"),
}


def log_stamp(line, t0_wall):
    """Seconds from ``t0_wall`` to a vLLM log line's time stamp (whole
    seconds, local time, year taken from t0), None without one."""
    m = _RE["stamp"].search(line)
    if not m or t0_wall is None:
        return None
    year = datetime.datetime.fromtimestamp(t0_wall).year
    try:
        t = datetime.datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    return t.timestamp() - t0_wall


def parse_log(text, t0_wall=None):
    """What vLLM's (and the probe's) log lines say: graph capture, KV cache
    size, init and model load, the periodic KV-transfer stats lines (summed:
    each covers the interval since the previous one), probe events."""
    out = {"kv_transfer_log": {}, "kv_transfer_log_lines": 0, "probe": []}
    for line in text.splitlines():
        if "SERVING_PROBE " in line:
            try:
                out["probe"].append(json.loads(line.split("SERVING_PROBE ", 1)[1]))
            except ValueError:
                pass
            continue
        m = _RE["graph"].search(line)
        if m:
            out["graph_capture_s"] = float(m.group(1))
            out["graph_capture_gib"] = float(m.group(2))
            out["graph_capture_end_s"] = log_stamp(line, t0_wall)
            continue
        m = _RE["kv_tokens"].search(line)
        if m:
            out["gpu_kv_tokens"] = int(m.group(1).replace(",", ""))
            continue
        m = _RE["init"].search(line)
        if m:
            out["init_engine_s"] = float(m.group(1))
            out["compile_s"] = float(m.group(2)) if m.group(2) else None
            continue
        m = _RE["load"].search(line)
        if m:
            out["model_load_gib"], out["model_load_s"] = float(m.group(1)), float(m.group(2))
            continue
        m = _RE["xfer"].search(line)
        if m:
            out["kv_transfer_log_lines"] += 1
            for k, v in _RE["kv"].findall(m.group(1)):
                out["kv_transfer_log"][k] = out["kv_transfer_log"].get(k, 0) + float(v)
    return out


def result_from_log(text, job):
    """The child's last RESULT line, else its last RESULT_PARTIAL (marked
    unfinished), else an error with the log's tail."""
    final = partial = None
    for line in text.splitlines():
        if line.startswith("RESULT "):
            final = line[len("RESULT ") :]
        elif line.startswith("RESULT_PARTIAL "):
            partial = line[len("RESULT_PARTIAL ") :]
    for raw, finished in ((final, True), (partial, False)):
        if raw is None:
            continue
        try:
            r = json.loads(raw)
        except ValueError:
            continue
        if not finished:
            r["ok"] = False
            r.setdefault("error", "the engine did not finish (see log); figures up to its last completed pass")
        return r
    return {**job, "ok": False, "error": "no result from the engine: " + "\n".join(text.splitlines()[-15:])}


# ------------------------------------------------------------ the probe (engine core)


def _probed_spec_class():
    """kvoffload's spec, plus one daemon thread per worker that waits for
    pinning to end (as vllm_engine.py's watcher does) and prints when, with
    wall-clock times, on the engine core's stderr (the child's log)."""
    import kvoffload.vllm as kvv

    def line(d):
        sys.stderr.write("SERVING_PROBE " + json.dumps(d) + "\n")
        sys.stderr.flush()

    class ProbedKvoffloadSpec(kvv.KvoffloadSpec):
        def get_worker(self, kv_caches):
            first = self._worker is None
            start = time.time()
            worker = super().get_worker(kv_caches)
            if first:
                off = worker.offloader
                line({"event": "get_worker", "start": start, "end": time.time(), "pid": os.getpid(),
                      "pin_state": str(off.pin_progress.state), "region_bytes": off.region_bytes})

                def watch():
                    d = {"event": "pinned"}
                    try:
                        d["state"] = str(off.wait_pinned().state)
                    except BaseException as e:  # noqa: BLE001 - shut down before pinning ended
                        d["state"], d["error"] = "error", repr(e)
                    d["at"] = time.time()
                    try:
                        p = off.pin_progress
                        d["chunks"] = [p.chunks_done, p.chunks_total]
                    except Exception:  # noqa: BLE001 - the offloader is gone
                        pass
                    line(d)

                threading.Thread(target=watch, name="serving-pin-probe", daemon=True).start()
            return worker

    return ProbedKvoffloadSpec


_PROBED = None


def __getattr__(name):  # vLLM imports spec_module_path "serving" and asks for the class
    global _PROBED
    if name == PROBE_SPEC:
        if _PROBED is None:
            _PROBED = _probed_spec_class()
        return _PROBED
    raise AttributeError(name)


# ------------------------------------------------------------ one engine (child)

_METRIC_PREFIXES = (
    "vllm:kv_offload",
    "vllm:prompt_tokens",
    "vllm:prefix_cache",
    "vllm:external_prefix_cache",
    "vllm:num_preemptions",
)


def metrics_snapshot(llm):
    """vLLM's counters in this (front-end) process: floats straight from the
    Prometheus registry (``llm.get_metrics()`` truncates counters to int,
    which loses the transfer seconds), else from get_metrics()."""
    out = {}
    try:
        from prometheus_client import REGISTRY

        for metric in REGISTRY.collect():
            if not metric.name.startswith(_METRIC_PREFIXES):
                continue
            for s in metric.samples:
                if s.name.endswith(("_created", "_bucket")):
                    continue
                key = s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()) if k in ("source", "transfer_type"))
                out[key] = out.get(key, 0.0) + float(s.value)
        return "prometheus", out
    except Exception as e:  # noqa: BLE001 - fall back to vLLM's reader
        err = repr(e)
    try:
        for m in llm.get_metrics():
            if not m.name.startswith(_METRIC_PREFIXES):
                continue
            labels = getattr(m, "labels", {}) or {}
            lab = "".join(f"[{k}={v}]" for k, v in sorted(labels.items()) if k in ("source", "transfer_type"))
            if hasattr(m, "count"):
                out[m.name + "_count" + lab] = out.get(m.name + "_count" + lab, 0.0) + m.count
                out[m.name + "_sum" + lab] = out.get(m.name + "_sum" + lab, 0.0) + m.sum
            elif hasattr(m, "value"):
                out[m.name + "_total" + lab] = out.get(m.name + "_total" + lab, 0.0) + m.value
        return "get_metrics (int-truncated)", out
    except Exception as e:  # noqa: BLE001 - reported: no stats reachable
        return f"unavailable: {err}; {e!r}", {}


def transfer_figures(before, after, seconds):
    """Per-pass figures from two snapshots."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
    out = {}
    for direction in ("load", "store"):
        b = d.get(f"vllm:kv_offload_{direction}_bytes_total")
        t = d.get(f"vllm:kv_offload_{direction}_time_total")
        n = d.get(f"vllm:kv_offload_{direction}_size_count")
        out[direction] = {
            "bytes": int(b) if b is not None else None,
            "job_seconds": t,
            "jobs": int(n) if n is not None else None,
            "gbps_vllm_stat": b / t / 1e9 if b and t else None,
            "gbps_wall": b / seconds / 1e9 if b and seconds else None,
        }
    tok = {}
    for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        v = d.get(f"vllm:prompt_tokens_by_source_total[source={src}]")
        tok[src] = int(v) if v is not None else None
    out["prompt_tokens"] = tok
    pre = d.get("vllm:num_preemptions_total")
    out["preemptions"] = int(pre) if pre is not None else None
    return out


def compare(outs, ref):
    bad = [i for i, (a, b) in enumerate(zip(outs, ref)) if a != b]
    if len(outs) != len(ref):
        bad.append(min(len(outs), len(ref)))
    return {"mismatches": len(bad), "first_mismatch": bad[0] if bad else None}


def connector_extra(spec, region, cfg):
    """The OffloadingConnector's ``kv_connector_extra_config`` for ``spec``
    over a host region of ``region`` (None for spec ``none``): the spec's
    class and module, ``offload_extra`` and, for kvoffload, ``kvo_extra``
    and the probed spec where ``pin_probe`` asks (serving.py's engines and
    serve_http.py's servers alike)."""
    name, module = SPECS[spec]
    if name is None:
        return None
    extra = {"spec_name": name, "cpu_bytes_to_use": parse_size(region)}
    if module:
        extra["spec_module_path"] = module
    extra.update(cfg.get("offload_extra") or {})
    if spec == "kvoffload":
        extra.update(cfg.get("kvo_extra") or {})
        if cfg.get("pin_probe"):
            extra["spec_name"], extra["spec_module_path"] = PROBE_SPEC, PROBE_MODULE
    return extra


def child_real(cfg):
    os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process, as vllm serve
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_COLOR", "0")
    # The engine core imports the probe by module name (spawned or forked).
    os.environ["PYTHONPATH"] = HERE + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    spec, region = cfg["spec"], cfg["region"]
    res = dict(cfg)

    def emit(tag):
        print(f"{tag} " + json.dumps(res), flush=True)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    res["vllm"] = vllm.__version__
    extra = connector_extra(spec, region, cfg)
    kvt = None
    if extra is not None:
        res["kv_connector_extra_config"] = extra
        kvt = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    kwargs = dict(
        model=cfg["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        gpu_memory_utilization=cfg["gpu_memory_utilization"],
        max_model_len=cfg["max_model_len"],
        enable_prefix_caching=True,
        kv_transfer_config=kvt,
        disable_log_stats=False,  # vLLM's stats (and its KV-connector counters) on
        seed=0,
    )
    if cfg.get("attention"):
        kwargs["attention_backend"] = cfg["attention"]
    res["t0_wall"] = time.time()
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    res["ready_s"] = time.monotonic() - t0
    try:
        res["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
    except AttributeError:
        res["block_size"] = None
    emit("RESULT_PARTIAL")

    with open(os.path.join(cfg["model"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    n, tokens = cfg["prompts"], cfg["prompt_tokens"]
    old = ve.prompts_of(n, tokens, seed=2, vocab=vocab)
    new = ve.prompts_of(cfg["mixed_new"], tokens, seed=3, vocab=vocab)
    sp = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0.0, ignore_eos=True)
    tiny = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    short = ve.prompts_of(1, 8, seed=4, vocab=vocab)[0]  # under one block: nothing to store

    def gen(ps, params=sp):
        t = time.monotonic()
        out = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in out], time.monotonic() - t

    def reset():
        tries = []
        for _ in range(5):
            ok = bool(llm.reset_prefix_cache())
            tries.append(ok)
            if ok:
                break
            gen([short], tiny)  # a step, so that finished requests' blocks are released
        return tries

    src, snap = metrics_snapshot(llm)
    res["metrics_source"] = src
    res["passes"] = {}
    res["resets"] = {}

    def run_pass(name, ps, ref=None):
        nonlocal snap
        outs, secs = gen(ps)
        _, after = metrics_snapshot(llm)
        p = {"seconds": secs, "prompts": len(ps), **transfer_figures(snap, after, secs)}
        if ref is not None:
            p.update(compare(outs, ref))
        snap = after
        res["passes"][name] = p
        emit("RESULT_PARTIAL")
        return outs

    first = run_pass(PASSES[0], old)
    res["resets"]["before pass 2"] = reset()
    run_pass(PASSES[1], old, first)
    run_pass(PASSES[2], old, first)
    res["resets"]["before mixed"] = reset()
    half = old[: n // 2]
    mixed, order = [], []
    for i in range(max(len(half), len(new))):
        if i < len(new):
            mixed.append(new[i])
            order.append(("new", i))
        if i < len(half):
            mixed.append(half[i])
            order.append(("old", i))
    outs, secs = gen(mixed)
    _, after = metrics_snapshot(llm)
    p = {"seconds": secs, "prompts": len(mixed), "new": len(new), "old": len(half),
         **transfer_figures(snap, after, secs)}
    p.update(compare([o for o, (kind, _) in zip(outs, order) if kind == "old"], first[: len(half)]))
    res["passes"][PASSES[3]] = p
    snap = after
    # One short step more, so that transfers finished after the last pass
    # are counted in the totals.
    gen([short], tiny)
    _, end = metrics_snapshot(llm)
    res["totals"] = transfer_figures({}, end, None)
    res["equal"] = all(res["passes"][k].get("mismatches", 0) == 0 for k in PASSES)
    res["resets_ok"] = all(t[-1] for t in res["resets"].values())
    res["kv_bytes_per_token_model"] = kv_bytes_per_token(cfg["model"])
    res["done_s"] = time.monotonic() - t0
    res["ok"] = res["equal"] and res["resets_ok"]
    emit("RESULT")
    shutdown(llm, cfg.get("shutdown_timeout_s", 30))


def kv_bytes_per_token(model):
    try:
        with open(os.path.join(model, "config.json")) as f:
            c = json.load(f)
        head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head * 2
    except (OSError, KeyError, ValueError):
        return None


def shutdown(llm, timeout_s):
    """vLLM's own shutdown of the engine core (kvoffload's worker closes its
    region), bounded: a watchdog ends this process if it hangs; the parent
    then stops the group anyway."""
    threading.Timer(timeout_s + 15, lambda: os._exit(0)).start()
    try:
        llm.llm_engine.engine_core.shutdown(timeout=timeout_s)
    except TypeError:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - the result is out; the parent kills the group
        print(f"serving: engine shutdown failed: {e!r}", flush=True)


# ------------------------------------------------------------ fake engine (self-test)

_FAKE_CORE = r"""
import os, signal, subprocess, sys, time
marker, mode, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "linger":  # memory held a while by a process outside the group
    subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[2]))", marker, str(linger)],
                     start_new_session=True)
end = time.monotonic() + 120
while time.monotonic() < end:
    time.sleep(0.2)
"""


def child_fake(cfg):
    """A stand-in for the engine: an 'engine core' grandchild left running
    (as vLLM's outlives its parent), vLLM-shaped log lines, made-up figures
    (``fake: true``). Modes: ok, stubborn (core ignores SIGTERM), linger
    (holds 'GPU memory' from outside the group), hang, crash."""
    mode = cfg["fake"]
    marker = os.environ.get("KVO_SERVING_FAKE_MARKER", "kvo-serving-fake")
    res = dict(cfg, fake=True, t0_wall=time.time(), vllm="fake")
    core = subprocess.Popen([sys.executable, "-c", _FAKE_CORE, marker, mode, str(cfg.get("fake_linger_s", 2))])
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"(EngineCore pid={core.pid}) INFO {stamp} [kv_cache_utils.py:2177] GPU KV cache size: 412,160 tokens")
    print(f"(EngineCore pid={core.pid}) INFO {stamp} [gpu_model_runner.py:6845] Graph capturing finished in "
          f"{7 + cfg['rep'] % 3} secs, took 0.42 GiB", flush=True)
    if cfg["spec"] == "kvoffload":
        print(f"(EngineCore pid={core.pid}) SERVING_PROBE " + json.dumps(
            {"event": "pinned", "at": res["t0_wall"] + 20 + cfg["rep"], "state": "pinned"}), flush=True)
    time.sleep(cfg.get("fake_duration_s", 0.3))
    base = {"none": 10.0, "vllm": 20.0, "kvoffload": 30.0}[cfg["spec"]] + cfg["rep"]
    res["ready_s"] = base
    res["passes"] = {}
    for i, name in enumerate(PASSES):
        if mode in ("hang", "crash") and i == 1:
            print("RESULT_PARTIAL " + json.dumps(res), flush=True)
            if mode == "crash":
                os._exit(3)
            time.sleep(600)
        b = None if cfg["spec"] == "none" else 1_000_000_000 * (i + 1)
        res["passes"][name] = {"seconds": base + i, "prompts": cfg["prompts"], "mismatches": 0,
                               "load": {"bytes": b, "job_seconds": 0.5 if b else None,
                                        "gbps_vllm_stat": b / 0.5 / 1e9 if b else None},
                               "store": {"bytes": b, "job_seconds": 0.25 if b else None,
                                         "gbps_vllm_stat": b / 0.25 / 1e9 if b else None},
                               "prompt_tokens": {"local_compute": 100, "local_cache_hit": 0,
                                                 "external_kv_transfer": 300 if b else 0}}
    print("INFO 12-02 10:16:00 [metrics.py:103] KV Transfer metrics: vllm:kv_offload_store_bytes=4096, "
          "vllm:kv_offload_store_time=0.5, vllm:kv_offload_store_size_count=2", flush=True)
    res["equal"], res["resets_ok"], res["ok"] = True, True, True
    print("RESULT " + json.dumps(res), flush=True)
    os._exit(0)  # the core is left running: the parent must stop the group


# ------------------------------------------------------------ the parent


class Stop(Exception):
    pass


def child_config(job, args):
    return {
        "spec": job["spec"],
        "region": job["region"],
        "rep": job["rep"],
        "warmup": job["warmup"],
        "model": os.path.abspath(args.model),
        "prompts": args.warmup_prompts if job["warmup"] else args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "mixed_new": (args.warmup_prompts if job["warmup"] else args.mixed_new),
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "attention": args.attention,
        "kvo_extra": args.kvo_extra,
        "offload_extra": args.offload_extra,
        "pin_probe": args.pin_probe,
        "shutdown_timeout_s": args.shutdown_timeout_s,
        "fake": job.get("fake"),
        # in the fake child's command line too, so the self-test finds it
        "fake_marker": os.environ.get("KVO_SERVING_FAKE_MARKER") if job.get("fake") else None,
        "fake_duration_s": args.fake_duration_s,
        "fake_linger_s": args.fake_linger_s,
    }


def run_engine(job, args, log_path, timeout_s, state):
    cfg = child_config(job, args)
    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(cfg)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t = time.monotonic()
    interrupted = timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        state["current"] = proc
        try:
            state["in_wait"] = True
            if not state["stopping"]:
                proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except Stop:
            pass
        finally:
            state["in_wait"] = False
            interrupted = state["stopping"]
            cleanup = end_group(proc, args.kill_grace_s)
            state["current"] = None
    with open(log_path, errors="replace") as f:
        text = f.read()
    r = result_from_log(text, job)
    r.update(label=label_of(job), rep=job["rep"], warmup=job["warmup"], log=log_path, rc=proc.returncode,
             process_s=round(time.monotonic() - t, 2), cleanup=cleanup)
    if timed_out:
        r["ok"] = False
        r["error"] = f"timeout {timeout_s:.0f} s ({r.get('error', 'no final result')})"
    if interrupted:
        r["ok"] = False
        r["error"] = "interrupted by a signal to the benchmark"
    if cleanup["members_left"]:
        r["ok"] = False
        r.setdefault("error", f"processes of the engine's group survived SIGKILL: {cleanup['members_left']}")
    r["log_parsed"] = parse_log(text, r.get("t0_wall"))
    for ev in r["log_parsed"]["probe"]:
        if r.get("t0_wall") is None:
            break
        if ev.get("event") == "pinned":
            r["pinned_s"] = ev["at"] - r["t0_wall"]
            r["pin_state"] = ev.get("state")
        elif ev.get("event") == "get_worker":
            r["get_worker_s"] = [ev["start"] - r["t0_wall"], ev["end"] - r["t0_wall"]]
    kv_tokens = r["log_parsed"].get("gpu_kv_tokens")
    need = (r.get("prompts") or 0) * ((r.get("prompt_tokens") or 0) + (r.get("max_tokens") or 0))
    if kv_tokens and need > kv_tokens:
        r.setdefault("notes", []).append(
            f"the GPU KV cache ({kv_tokens} tokens) holds less than the prompts ({need}): pass 3 recomputes some")
    if r.get("spec") == "kvoffload" and args.pin_probe and not r.get("error") and r.get("pin_state") != "pinned":
        r["ok"] = False
        r["error"] = f"kvoffload's pinning did not end pinned (probe: {r.get('pin_state')})"
    if r.get("spec") in ("vllm", "kvoffload") and not r.get("error"):
        ext = ((r.get("passes") or {}).get(PASSES[1]) or {}).get("prompt_tokens", {}).get("external_kv_transfer")
        if ext == 0:
            r["ok"] = False
            r["error"] = "pass 2 loaded nothing from the host (0 external prompt tokens)"
        elif ext is None:
            r.setdefault("notes", []).append("host hits not verified: vLLM's stats were not reachable")
    if not r.get("error") and r.get("ok") is False:
        why = [f"pass {k!r}: {v['mismatches']} of {v.get('old', v.get('prompts'))} prompts' tokens differ from pass 1's "
               f"(first: prompt {v['first_mismatch']})" for k, v in (r.get("passes") or {}).items() if v.get("mismatches")]
        why += [f"reset_prefix_cache() {k} failed {len(t)} times" for k, t in (r.get("resets") or {}).items()
                if t and not t[-1]]
        r["error"] = "; ".join(why) or "not ok (see the log)"
    return r, interrupted


def engine_line(r):
    p = r.get("passes") or {}

    def s(name):
        v = (p.get(name) or {}).get("seconds")
        return f"{v:6.1f}" if isinstance(v, (int, float)) else "     -"

    lp = r.get("log_parsed") or {}
    g = lp.get("graph_capture_s")
    pin = r.get("pinned_s")
    ready = r.get("ready_s")
    line = (f"{r.get('label', '?'):28} ready {ready if ready is not None else float('nan'):6.1f} s  "
            f"graphs {g if g is not None else float('nan'):4.0f} s  "
            f"pinned {pin if pin is not None else float('nan'):6.1f} s  "
            f"passes {s(PASSES[0])} {s(PASSES[1])} {s(PASSES[2])} mixed {s(PASSES[3])} s  "
            f"{'ok' if r.get('ok') else 'NOT OK'}  (engine {r.get('process_s', 0):.0f} s)")
    return line + line_notes(r, "engine", 600)


def line_notes(r, noun, error_chars):
    """The notes under the line of a result ``r`` of an engine or server
    (``noun``): its error (the last ``error_chars`` characters) and GPU
    memory left in use after it; "" when there are none."""
    notes = ""
    if r.get("error"):
        notes += f"\n    error: {str(r['error'])[-error_chars:]}"
    gf = r.get("gpu_after") or {}
    if gf.get("free") is False:
        notes += (f"\n    GPU memory not free {gf['waited_s']:.0f} s after the {noun}: {gf['used_mib']} MiB used, "
                  f"{gf['baseline_mib']} MiB before the first {noun}")
    return notes


def _get(r, *path):
    for k in path:
        if not isinstance(r, dict):
            return None
        r = r.get(k)
    return r


def _pct(num, *parts):
    if num is None or any(x is None for x in parts) or not sum(parts):
        return None
    return 100.0 * num / sum(parts)


#: The table: column title, figure of one engine.
COLUMNS = [
    ("ready s", lambda r: r.get("ready_s")),
    ("graphs s", lambda r: _get(r, "log_parsed", "graph_capture_s")),
    ("pinned s", lambda r: r.get("pinned_s")),
    ("pass 1 s", lambda r: _get(r, "passes", PASSES[0], "seconds")),
    ("pass 2 s", lambda r: _get(r, "passes", PASSES[1], "seconds")),
    ("pass 3 s", lambda r: _get(r, "passes", PASSES[2], "seconds")),
    ("mixed s", lambda r: _get(r, "passes", PASSES[3], "seconds")),
    ("pass 2 host %", lambda r: _pct(
        _get(r, "passes", PASSES[1], "prompt_tokens", "external_kv_transfer"),
        *[_get(r, "passes", PASSES[1], "prompt_tokens", k) for k in ("local_compute", "local_cache_hit", "external_kv_transfer")])),
    ("pass 2 load GiB", lambda r: _div(_get(r, "passes", PASSES[1], "load", "bytes"), GIB)),
    ("pass 2 load GB/s", lambda r: _get(r, "passes", PASSES[1], "load", "gbps_vllm_stat")),
    ("mixed store GB/s", lambda r: _get(r, "passes", PASSES[3], "store", "gbps_vllm_stat")),
    ("mixed load GB/s", lambda r: _get(r, "passes", PASSES[3], "load", "gbps_vllm_stat")),
]


def _div(a, b):
    return a / b if isinstance(a, (int, float)) and b else None


def table(results, specs_order=None, columns=None, region_key=None):
    """Markdown: one row per spec and region (warm-up left out), each cell
    median [min-max] over the repetitions; ``columns`` (default
    :data:`COLUMNS`) and the regions' order (``region_key``, default by
    size) are serve_http.py's own there."""
    columns = COLUMNS if columns is None else columns
    region_key = region_key or _region_key
    rows = {}
    for r in results:
        if r.get("warmup"):
            continue
        rows.setdefault((r.get("spec"), r.get("region")), []).append(r)
    order = {s: i for i, s in enumerate(specs_order or [])}
    keys = sorted(rows, key=lambda k: (order.get(k[0], len(order)), str(k[0]), region_key(k[1])))
    head = ["spec", "region", "ok"] + [c[0] for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        rs = rows[k]
        cells = [str(k[0]), str(k[1]), f"{sum(1 for r in rs if r.get('ok'))}/{len(rs)}"]
        cells += [fmt_cell([f(r) for r in rs]) for _, f in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _region_key(region):
    try:
        return parse_size(region)
    except ValueError:
        return -1


NOTES = """\
Cells: median [min-max] over the repetitions (all engines that have the figure; `ok` counts the engines
that passed every check). ready: `LLM(...)` returned. graphs: vLLM's "Graph capturing finished in N secs"
(whole seconds). pinned: kvoffload's pinning ended, seconds from `LLM(...)` (probe in the engine core).
Pass 1 computes the prompts (and stores them); pass 2 runs them again after `reset_prefix_cache()` (host
hits, or recomputed with spec none); pass 3 again (GPU prefix cache); mixed: after another reset, new
prompts interleaved with the first half of the old. host %: share of pass 2's prompt tokens loaded by the
connector (vLLM's `prompt_tokens_by_source`). GB/s: bytes over the seconds each spec reports per job to
vLLM's stats: each job's device time between CUDA events for both specs (kvoffload's since its
`Completion.device_seconds`, issue 42; before, submission until completion seen, 10-50x lower rates).
Transfers still in flight when a pass ends are counted in the next pass."""


def problems_md(res, error_chars):
    """The Markdown lines of the results ``res`` that were not ok (their
    errors' first ``error_chars`` characters) and of those that left GPU
    memory in use; none when there are none."""
    out = []
    bad = [r for r in res if not r.get("ok")]
    if bad:
        out += ["", "Not ok:"] + [f"- {r.get('label')}: {str(r.get('error'))[:error_chars]}" for r in bad]
    notfree = [r for r in res if (r.get("gpu_after") or {}).get("free") is False]
    if notfree:
        out += ["", "GPU memory not free after:"] + [
            f"- {r.get('label')}: {r['gpu_after']['used_mib']} MiB used after {r['gpu_after']['waited_s']} s "
            f"(baseline {r['gpu_after']['baseline_mib']} MiB)" for r in notfree]
    return out


def markdown(doc):
    res = doc["engines"]
    first = next((r for r in res if r.get("vllm")), {})
    a = doc.get("config", {})
    out = [
        "# vLLM serving benchmark: offloading specs",
        "",
        f"device: {doc.get('device') or '?'}; vLLM {first.get('vllm', '?')}; model {a.get('model')} (dummy weights); "
        f"{a.get('prompts')} prompts x {a.get('prompt_tokens')} tokens, {a.get('max_tokens')} greedy tokens; "
        f"mixed: {a.get('mixed_new')} new + {(a.get('prompts') or 0) // 2} old; gpu_memory_utilization "
        f"{a.get('gpu_memory_utilization')}; max_model_len {a.get('max_model_len')}; reps {a.get('reps')}"
        + ("; FAKE ENGINES (self-test)" if a.get("fake") else ""),
        "",
        table(res, (a.get("specs") or "").split(",")),
        "",
        NOTES,
    ]
    out += problems_md(res, 300)
    if doc.get("skipped"):
        out += ["", "Skipped (budget or stop):"] + [f"- {s['label']}: {s['why']}" for s in doc["skipped"]]
    stats = {r.get("metrics_source") for r in res if r.get("metrics_source")}
    if stats and stats != {"prometheus"}:
        out += ["", f"vLLM stats source: {', '.join(sorted(stats))}"]
    return "\n".join(out) + "\n"


def host_checks(args, specs, regions):
    warn = []
    mem = ve.mem_available_gib()
    for reg in regions:
        b = parse_size(reg)
        if mem is not None and b / GIB > mem:
            warn.append(f"region {reg} exceeds MemAvailable {mem:.1f} GiB")
        kvo = dict(args.offload_extra or {}, **(args.kvo_extra or {}))
        if "kvoffload" in specs and kvo.get("kvo_region", "shared") == "shared":
            d = kvo.get("kvo_region_dir", "/dev/shm")
            try:
                free = shutil.disk_usage(d).free
                if b > free:
                    warn.append(f"kvoffload region {reg} exceeds free space of {d} ({free / GIB:.1f} GiB): "
                                f"pass --kvo-extra kvo_region=anonymous or remount {d}")
            except OSError:
                pass
    return warn


def run_all(args, hook=None):
    specs = [s for s in args.specs.split(",") if s]
    regions = [r for r in args.regions.split(",") if r]
    for s in specs:
        if s not in SPECS:
            raise SystemExit(f"serving: unknown spec {s!r} (one of {', '.join(SPECS)})")
    for r in regions:
        parse_size(r)
    plan = plan_engines(specs, regions, args.reps, warmup=not args.no_warmup, first_rep=args.first_rep)
    bench = Bench(name="serving", noun="engine", files="serving", schema="kvoffload-serving-1",
                  config_skip=("one", "self_test", "table_from"), warnings=host_checks(args, specs, regions),
                  run=run_engine, line=engine_line, markdown=markdown,
                  log_name=lambda i, job: f"{i:02d}-{job['spec']}-{job['region']}-{rep_name(job)}.log",
                  # A signal raises only out of the wait for an engine
                  # (run_engine then stops its group).
                  raises=lambda state: state["in_wait"])
    return run_plan(args, plan, bench, hook)


def rep_name(job):
    return "warmup" if job["warmup"] else "rep%d" % (job["rep"] + 1)


class Bench:
    """What ``run_plan`` runs, for serving.py (engines) and serve_http.py
    (servers): ``name`` the messages' prefix, ``noun`` what one job starts,
    ``files`` the results' file name (``<files>.json``, ``.jsonl``, ``.md``),
    ``schema`` and ``extra`` (keys after ``device``) of the JSON document,
    ``config_skip`` the arguments it leaves out, ``warnings`` the host
    checks' findings; ``run(job, args, log_path, timeout_s, state)`` ->
    ``(result, interrupted)``, ``line(result)``, ``markdown(doc)``,
    ``log_name(i, job)``; ``raises(state)``: whether a signal raises
    ``Stop`` now (elsewhere the loop sees the flag); ``after(result)``: said
    after its line, or None."""

    def __init__(self, **fields):
        self.extra, self.after = {}, lambda r: None
        self.__dict__.update(fields)


def run_plan(args, plan, b, hook=None):
    """Runs ``plan``'s jobs one after the other (``b``: a :class:`Bench`),
    with ``--fake``, ``--budget-s``, the signals that stop it keeping what
    finished, the GPU-free wait between jobs, and the results rewritten
    after each; returns the JSON document."""
    if args.fake:
        modes = args.fake.split(",")
        for i, job in enumerate(plan):
            job["fake"] = modes[i % len(modes)]
    logs = os.path.join(args.out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    paths = {e: os.path.join(args.out_dir, f"{b.files}.{e}") for e in ("json", "jsonl", "md")}
    fake = bool(args.fake)
    doc = {
        "schema": b.schema,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "config": {k: v for k, v in vars(args).items() if k not in b.config_skip},
        "device": None if fake else device_name(),
        **b.extra,
        "mem_available_gib": ve.mem_available_gib(),
        "warnings": b.warnings,
        "plan": [label_of(j) for j in plan],
        "engines": [],
        "skipped": [],
        "finished": False,
    }
    for w in doc["warnings"]:
        say(f"{b.name}: warning: {w}")
    baseline = gpu_used_mib(fake)
    doc["baseline_gpu_used_mib"] = baseline
    vllm = f"; vLLM {doc['vllm']}" if "vllm" in doc else ""
    say(f"{b.name}: {len(plan)} {b.noun}s ({doc['device'] or 'device ?'}{vllm}; GPU memory in use before: {baseline} MiB); "
        f"results in {args.out_dir}")

    def save():
        write_atomic(paths["json"], json.dumps(doc, indent=1, default=str))
        write_atomic(paths["md"], b.markdown(doc))

    state = {"current": None, "stopping": False, "in_wait": False}

    def on_signal(signum, frame):
        if state["stopping"]:
            return
        state["stopping"] = True
        print(f"{b.name}: signal {signum}: stopping, keeping what finished", file=sys.stderr, flush=True)
        if b.raises(state):
            raise Stop()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    t_start = time.monotonic()
    durations = []
    try:
        save()
        for i, job in enumerate(plan):
            label = label_of(job)
            elapsed = time.monotonic() - t_start
            if state["stopping"]:
                doc["skipped"].append({"label": label, "why": "the benchmark was stopped by a signal"})
                continue
            timeout = args.timeout
            if args.budget_s:
                est = max(durations) if durations else None
                if est is not None and elapsed + est > args.budget_s:
                    doc["skipped"].append({"label": label, "why": f"budget: {elapsed:.1f} s spent + ~{est:.1f} s "
                                           f"(longest {b.noun} so far) > {args.budget_s:g} s"})
                    continue
                timeout = max(1.0, min(timeout, args.budget_s - elapsed + args.budget_grace_s))
            log_path = os.path.join(logs, b.log_name(i, job))
            say(f"== {i + 1}/{len(plan)} {label} (log {log_path})")
            t = time.monotonic()
            shm_before = ve.shm_files()
            r, interrupted = b.run(job, args, log_path, timeout, state)
            r["shm_left"] = {k: v for k, v in ve.shm_files().items() if k not in shm_before}
            if r["shm_left"]:
                r.setdefault("notes", []).append(f"files left in /dev/shm: {r['shm_left']}")
            if not interrupted:
                r["gpu_after"] = wait_gpu_free(baseline, args.gpu_free_slack_mib, args.gpu_free_timeout_s, fake,
                                               stop=lambda: state["stopping"])
            durations.append(time.monotonic() - t)
            r[f"{b.noun}_wall_s"] = round(durations[-1], 2)
            doc["engines"].append(r)
            with open(paths["jsonl"], "a") as f:
                f.write(json.dumps(r, default=str) + "\n")
            save()
            say(b.line(r))
            b.after(r)
            if hook:
                hook(r, paths["json"])
    except Stop:  # only if a signal slipped past the job's own handling
        pass
    finally:
        if state["current"] is not None:
            end_group(state["current"], args.kill_grace_s)
        for s, h in old.items():
            signal.signal(s, h)
        doc["finished"] = not state["stopping"]
        doc["interrupted"] = state["stopping"]
        doc["seconds"] = round(time.monotonic() - t_start, 1)
        save()
    say("\n" + b.markdown(doc))
    for s in doc["skipped"]:
        say(f"{b.name}: skipped {s['label']}: {s['why']}")
    return doc


# ------------------------------------------------------------ self-test

# A stand-in for vLLM's LLM and prometheus_client, for the self-test of
# child_real on the CPU: prompts are "computed" (and stored with
# offloading), found in the "GPU cache" until reset_prefix_cache(), or
# "loaded" from the host; counters as vLLM's Prometheus logger names them.
_STUB_VLLM = r'''
import json, os, sys
import prometheus_client as prom
__version__ = "stub"
KV = 131072


class SamplingParams:
    def __init__(self, max_tokens, temperature=0.0, ignore_eos=False):
        self.max_tokens = max_tokens


class _NS:
    pass


class LLM:
    def __init__(self, model, kv_transfer_config=None, **kw):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and kw["enable_prefix_caching"]
        assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] and not kw["disable_log_stats"]
        self.offload = kv_transfer_config is not None
        if self.offload and kv_transfer_config.kw["kv_connector_extra_config"].get("spec_module_path") == "serving":
            print("(EngineCore pid=1) SERVING_PROBE " + json.dumps({"event": "pinned", "at": __import__("time").time(),
                  "state": "pinned"}), file=sys.stderr, flush=True)
        self.gpu, self.host, self.calls = set(), set(), 0
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):  # registered up front, as vLLM's
            prom.inc("vllm:prompt_tokens_by_source", 0, source=src)
        for d in ("load", "store") if self.offload else ():
            prom.inc(f"vllm:kv_offload_{d}_bytes", 0)
            prom.inc(f"vllm:kv_offload_{d}_time", 0)
            prom.REGISTRY.hists[f"vllm:kv_offload_{d}_size"] = (0, 0.0)
        self.llm_engine = _NS()
        self.llm_engine.vllm_config = _NS()
        self.llm_engine.vllm_config.cache_config = _NS()
        self.llm_engine.vllm_config.cache_config.block_size = 16
        self.llm_engine.engine_core = _NS()
        self.llm_engine.engine_core.shutdown = lambda timeout=None: None

    def generate(self, prompts, sp, use_tqdm=True):
        self.calls += 1
        out = []
        for p in prompts:
            ids = tuple(p["prompt_token_ids"])
            n = len(ids)
            if ids in self.gpu:
                prom.inc("vllm:prompt_tokens_by_source", n, source="local_cache_hit")
            elif self.offload and ids in self.host:
                prom.inc("vllm:prompt_tokens_by_source", n, source="external_kv_transfer")
                prom.inc("vllm:kv_offload_load_bytes", n * KV)
                prom.inc("vllm:kv_offload_load_time", n * KV / 20e9)
                prom.observe("vllm:kv_offload_load_size", n * KV)
            else:
                prom.inc("vllm:prompt_tokens_by_source", n, source="local_compute")
                if self.offload and n >= 16:
                    self.host.add(ids)
                    prom.inc("vllm:kv_offload_store_bytes", n * KV)
                    prom.inc("vllm:kv_offload_store_time", n * KV / 10e9)
                    prom.observe("vllm:kv_offload_store_size", n * KV)
            self.gpu.add(ids)
            toks = [(sum(ids) + i) % 1000 for i in range(sp.max_tokens)]
            if os.environ.get("STUB_FLIP") and self.calls == 2:  # pass 2
                toks[-1] += 1
            r = _NS()
            r.outputs = [_NS()]
            r.outputs[0].token_ids = toks
            out.append(r)
        return out

    def reset_prefix_cache(self):
        self.gpu.clear()
        return True
'''
_STUB_PROM = r'''
class _S:
    def __init__(self, name, labels, value):
        self.name, self.labels, self.value = name, labels, value


class _M:
    def __init__(self, name, samples):
        self.name, self.samples = name, samples


class _Registry:
    def __init__(self):
        self.counters, self.hists = {}, {}

    def collect(self):
        for (name, src), v in sorted(self.counters.items()):
            labels = {"model_name": "m", "engine": "0", **({"source": src} if src else {})}
            yield _M(name, [_S(name + "_total", labels, v), _S(name + "_created", labels, 1.0)])
        for name, (n, total) in sorted(self.hists.items()):
            labels = {"model_name": "m", "engine": "0"}
            yield _M(name, [_S(name + "_count", labels, n), _S(name + "_sum", labels, total),
                            _S(name + "_bucket", dict(labels, le="+Inf"), n)])
        yield _M("python_gc", [_S("python_gc_total", {}, 5)])


REGISTRY = _Registry()


def inc(name, v, source=None):
    REGISTRY.counters[(name, source)] = REGISTRY.counters.get((name, source), 0.0) + v


def observe(name, v):
    n, t = REGISTRY.hists.get(name, (0, 0.0))
    REGISTRY.hists[name] = (n + 1, t + v)
'''


def _stub_tree(root):
    os.makedirs(os.path.join(root, "vllm"))
    with open(os.path.join(root, "vllm", "__init__.py"), "w") as f:
        f.write(_STUB_VLLM)
    with open(os.path.join(root, "vllm", "config.py"), "w") as f:
        f.write("class KVTransferConfig:\n    def __init__(self, **kw):\n        self.kw = kw\n")
    with open(os.path.join(root, "prometheus_client.py"), "w") as f:
        f.write(_STUB_PROM)



def fake_session(name):
    """A self-test's fakes begin: a marker of their own in
    ``KVO_SERVING_FAKE_MARKER`` (``fake_pids`` finds this test's processes
    by it); gives the test's temporary directory."""
    os.environ["KVO_SERVING_FAKE_MARKER"] = f"kvo-{name}-selftest-{os.getpid()}-{random.randrange(1 << 30)}"
    return tempfile.mkdtemp(prefix=f"kvo-{name}-selftest.")


def ended_hook(check, seen, noun):
    """``run_plan``'s hook in a self-test: appends to ``seen`` how many
    results the JSON held when each ``noun``'s (engine's, server's) was
    written, and checks that no fake process outlived it."""

    def hook(r, path):
        with open(path) as f:
            seen.append(len(json.load(f)["engines"]))
        check(fake_gpu_used_mib() == 0 or (r.get("gpu_after") or {}).get("free") is False,
              f"{r['label']}: no fake {noun} process alive after it ended")

    return hook


def sigterm_after_first(cmd, stem, settle_s):
    """Self-test of a signal: runs the benchmark ``cmd``, waits (30 s at
    most) for the first line of ``<stem>.jsonl`` and ``settle_s`` more for
    the next engine or server to be running, sends SIGTERM and gives back
    the ``<stem>.json`` it kept and its output (AssertionError if it does
    not stop within 20 s)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    jp = stem + ".jsonl"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (os.path.exists(jp) and open(jp).read().count("\n") >= 1):
        time.sleep(0.1)
    time.sleep(settle_s)
    proc.send_signal(signal.SIGTERM)
    try:
        text = proc.communicate(timeout=20)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the benchmark did not stop within 20 s of SIGTERM")
    return json.load(open(stem + ".json")), text


def self_test():
    """The parts that need no GPU. Raises AssertionError on the first
    failure; prints 'serving self-test: ok' at the end."""
    checks = []

    def check(cond, what):
        if not cond:
            raise AssertionError(what)
        checks.append(what)

    # Arguments and values.
    a = parse_args(["--kvo-extra", "kvo_pin_threads=4", "--kvo-extra", "kvo_region=anonymous",
                                   "--kvo-extra", "kvo_capture_hook=false", "--kvo-extra", "kvo_staging_bytes=64MiB",
                                   "--regions", "64GiB,96GiB"])
    check(a.kvo_extra == {"kvo_pin_threads": 4, "kvo_region": "anonymous", "kvo_capture_hook": False,
                          "kvo_staging_bytes": 64 << 20}, f"--kvo-extra parsed: {a.kvo_extra}")
    check(a.reps == 3 and a.prompts == 48 and a.prompt_tokens == 4000 and a.gpu_memory_utilization == 0.9,
          "defaults: 3 reps, 48 prompts of 4000 tokens, gpu_memory_utilization 0.9")
    try:
        parse_extra(["novalue"])
        check(False, "KEY without =VALUE refused")
    except argparse.ArgumentTypeError:
        check(True, "KEY without =VALUE refused")
    # Median and table cells.
    check(median_range([3, 1, 2, None, "x"]) == (2, 1, 3, 3), "median [min-max] over numbers only")
    check(fmt_cell([10.0, 12.5, 11.0]) == "11.0 [10.0-12.5]" and fmt_cell([1.234]) == "1.23" and fmt_cell([None]) == "-",
          "cells")
    # Plan: warm-up first, rotation per repetition.
    p = plan_engines(["none", "vllm", "kvoffload"], ["64GiB", "96GiB"], 2)
    check(p[0]["warmup"] and p[0]["spec"] == "none" and len(p) == 1 + 2 * 5, "plan size and warm-up")
    check([j["spec"] for j in p[1:6]] == ["none", "vllm", "vllm", "kvoffload", "kvoffload"]
          and [j["spec"] for j in p[6:]] == ["vllm", "vllm", "kvoffload", "kvoffload", "none"], "specs rotate per rep")
    p = plan_engines(["none", "vllm", "kvoffload"], ["64GiB"], 1, warmup=False, first_rep=2)
    check([j["spec"] for j in p] == ["kvoffload", "none", "vllm"] and label_of(p[0]) == "kvoffload:64GiB rep 3",
          "--first-rep 2: the third repetition's order and number")
    # Log lines as vLLM 0.26 writes them.
    sample = "\n".join([
        "(EngineCore pid=4242) INFO 12-02 10:14:20 [gpu_model_runner.py:5348] Model loading took 14.99 GiB memory and 3.412345 seconds",
        "(EngineCore pid=4242) INFO 12-02 10:14:40 [kv_cache_utils.py:2177] GPU KV cache size: 412,160 tokens",
        "(EngineCore pid=4242) INFO 12-02 10:15:03 [gpu_model_runner.py:6845] Graph capturing finished in 14 secs, took 0.52 GiB",
        "(EngineCore pid=4242) INFO 12-02 10:15:03 [core.py:348] init engine (profile, create kv cache, warmup model) took 41.27 s (compilation: 18.02 s)",
        "INFO 12-02 10:16:00 [metrics.py:103] KV Transfer metrics: vllm:kv_offload_store_bytes=25769803776, "
        "vllm:kv_offload_store_time=1.25, vllm:kv_offload_store_size_count=48, vllm:x:('a', 'b')=3",
        "INFO 12-02 10:16:10 [metrics.py:103] KV Transfer metrics: vllm:kv_offload_store_bytes=4096, vllm:kv_offload_load_time=2.5e-01",
        "(EngineCore pid=4242) SERVING_PROBE {\"event\": \"pinned\", \"at\": 100.5, \"state\": \"pinned\"}",
    ])
    t0 = datetime.datetime(2026, 12, 2, 10, 14, 0).timestamp()
    lp = parse_log(sample, t0)
    check(lp["graph_capture_s"] == 14 and lp["graph_capture_gib"] == 0.52 and lp["graph_capture_end_s"] == 63,
          f"graph capture line: {lp}")
    check(lp["gpu_kv_tokens"] == 412160 and lp["init_engine_s"] == 41.27 and lp["compile_s"] == 18.02
          and lp["model_load_s"] == 3.412345, "KV cache, init and load lines")
    check(lp["kv_transfer_log_lines"] == 2 and lp["kv_transfer_log"]["vllm:kv_offload_store_bytes"] == 25769803776 + 4096
          and lp["kv_transfer_log"]["vllm:kv_offload_load_time"] == 0.25 and lp["kv_transfer_log"]["vllm:x:('a', 'b')"] == 3,
          f"KV transfer lines summed: {lp['kv_transfer_log']}")
    check(lp["probe"] == [{"event": "pinned", "at": 100.5, "state": "pinned"}], "probe line")
    check(result_from_log("x\nRESULT_PARTIAL {\"a\": 1}\n", {})["error"].startswith("the engine did not finish"),
          "a partial result is marked unfinished")
    # Per-pass figures from two snapshots.
    before = {"vllm:kv_offload_load_bytes_total": 1e9, "vllm:kv_offload_load_time_total": 1.0}
    after = {"vllm:kv_offload_load_bytes_total": 3e9, "vllm:kv_offload_load_time_total": 2.0,
             "vllm:kv_offload_load_size_count": 4, "vllm:prompt_tokens_by_source_total[source=external_kv_transfer]": 96}
    tf = transfer_figures(before, after, 4.0)
    check(tf["load"]["bytes"] == 2e9 and tf["load"]["gbps_vllm_stat"] == 2.0 and tf["load"]["gbps_wall"] == 0.5
          and tf["store"]["bytes"] is None and tf["prompt_tokens"]["external_kv_transfer"] == 96, f"figures: {tf}")
    check(compare([[1], [2], [3]], [[1], [9], [3]]) == {"mismatches": 1, "first_mismatch": 1}, "token comparison")

    tmp = fake_session("serving")
    try:
        # Fake engines: a core left running (ok), one that ignores SIGTERM,
        # memory held from outside the group, a hang past the timeout, a crash.
        seen = []
        hook = ended_hook(check, seen, "engine")

        out = os.path.join(tmp, "a")
        args = parse_args([
            "--fake", "ok,stubborn,linger,hang,crash,ok", "--specs", "none,vllm,kvoffload", "--regions", "1GiB,2GiB",
            "--reps", "1", "--timeout", "4", "--kill-grace-s", "1", "--gpu-free-timeout-s", "6",
            "--fake-linger-s", "1.5", "--out-dir", out, "--model", HERE])
        doc = run_all(args, hook)
        e = doc["engines"]
        check(len(e) == 6 and seen == [1, 2, 3, 4, 5, 6], f"every engine in the JSON as soon as it ended: {seen}")
        check([r["label"] for r in e] == ["warm-up (none)", "none:- rep 1", "vllm:1GiB rep 1", "vllm:2GiB rep 1",
                                          "kvoffload:1GiB rep 1", "kvoffload:2GiB rep 1"], "run order")
        check(e[0]["ok"] and e[0]["cleanup"]["term_sent"] and not e[0]["cleanup"]["killed"],
              f"an orphaned core is stopped by SIGTERM to the group: {e[0]['cleanup']}")
        check(e[1]["ok"] and e[1]["cleanup"]["killed"] and not e[1]["cleanup"]["members_left"],
              f"a core that ignores SIGTERM is killed: {e[1]['cleanup']}")
        check(e[2]["ok"] and e[2]["gpu_after"]["free"] and e[2]["gpu_after"]["waited_s"] >= 0.5,
              f"the next engine waits for memory held outside the group: {e[2]['gpu_after']}")
        check(not e[3]["ok"] and "timeout" in e[3]["error"] and PASSES[0] in e[3]["passes"]
              and PASSES[1] not in e[3]["passes"] and e[3]["process_s"] < 4 + 1 + 3,
              f"a hang times out, its finished passes kept: {e[3].get('error')}")
        check(not e[4]["ok"] and e[4]["rc"] == 3 and "did not finish" in e[4]["error"], f"a crash: {e[4].get('error')}")
        check(e[1]["log_parsed"]["graph_capture_s"] == 7 and e[1]["log_parsed"]["gpu_kv_tokens"] == 412160,
              "the fake engine's log parsed")
        check(e[5]["ok"] and abs(e[5]["pinned_s"] - 20) < 1e-6 and e[5]["pin_state"] == "pinned",
              "kvoffload pinned time from the probe")
        check(fake_gpu_used_mib() == 0, "no fake process left at the end")
        md = open(os.path.join(out, "serving.md")).read()
        check("| vllm | 1GiB | 1/1 |" in md and "| vllm | 2GiB | 0/1 |" in md and "| kvoffload | 2GiB | 1/1 |" in md
              and "| none | - | 1/1 |" in md and "warm-up" not in md.split("Not ok")[0] and "FAKE" in md,
              f"the table: a row per spec and region, the warm-up left out\n{md}")
        check(sum(1 for _ in open(os.path.join(out, "serving.jsonl"))) == 6, "one JSONL line per engine")

        # Memory that stays: reported, not waited for forever.
        out = os.path.join(tmp, "b")
        args = parse_args([
            "--fake", "ok,linger", "--specs", "vllm", "--regions", "1GiB", "--reps", "1", "--kill-grace-s", "1",
            "--gpu-free-timeout-s", "1", "--fake-linger-s", "4", "--out-dir", out, "--model", HERE])
        doc = run_all(args)
        g = doc["engines"][1]["gpu_after"]
        check(g["free"] is False and 0.9 <= g["waited_s"] < 3, f"GPU memory not free is reported after the bound: {g}")
        check("GPU memory not free" in open(os.path.join(out, "serving.md")).read(), "and in the markdown")
        deadline = time.monotonic() + 10
        while fake_gpu_used_mib() and time.monotonic() < deadline:
            time.sleep(0.2)

        # Budget: engines of ~1 s each, a budget of 2.5 s.
        out = os.path.join(tmp, "c")
        args = parse_args([
            "--fake", "ok", "--specs", "none,vllm,kvoffload", "--regions", "1GiB,2GiB", "--reps", "2",
            "--fake-duration-s", "0.8", "--kill-grace-s", "1", "--budget-s", "2.5", "--out-dir", out, "--model", HERE])
        doc = run_all(args)
        n_run, n_skip = len(doc["engines"]), len(doc["skipped"])
        check(1 <= n_run < 11 and n_run + n_skip == 11 and "budget" in doc["skipped"][0]["why"],
              f"budget: {n_run} run, {n_skip} skipped")
        check(doc["seconds"] < 2.5 + 2, f"budget kept: {doc['seconds']} s")

        # A signal to the benchmark stops the running engine's group and keeps the JSON.
        out = os.path.join(tmp, "d")
        cmd = [sys.executable, os.path.abspath(__file__), "--fake", "ok,hang", "--specs", "vllm", "--regions", "1GiB",
               "--reps", "2", "--timeout", "60", "--kill-grace-s", "1", "--out-dir", out, "--model", HERE]
        doc, text = sigterm_after_first(cmd, os.path.join(out, "serving"), 1.0)  # 1 s: the hang engine has started
        check(doc["interrupted"] and len(doc["engines"]) == 2 and "interrupted" in doc["engines"][1]["error"]
              and doc["skipped"], f"SIGTERM: the running engine recorded as interrupted, the rest skipped\n{text[-800:]}")
        check(fake_gpu_used_mib() == 0, "SIGTERM: the running engine's group stopped")

        # The real child's passes against a stub vLLM (no GPU): figures per
        # pass from the counters, tokens compared, the table.
        stub = os.path.join(tmp, "stub")
        _stub_tree(stub)
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = stub + (os.pathsep + saved if saved else "")
        try:
            out = os.path.join(tmp, "e")
            args = parse_args(["--specs", "none,vllm,kvoffload", "--regions", "1GiB", "--reps", "1", "--prompts", "6",
                               "--prompt-tokens", "40", "--warmup-prompts", "2", "--gpu-free-timeout-s", "0",
                               "--out-dir", out])
            doc = run_all(args)
            e = {r["label"]: r for r in doc["engines"]}
            check(all(r["ok"] for r in e.values()) and len(e) == 4,
                  f"stub engines ok: {[(k, r.get('error')) for k, r in e.items()]}")
            v = e["vllm:1GiB rep 1"]["passes"]
            check(v[PASSES[0]]["store"]["bytes"] == 6 * 40 * 131072 and v[PASSES[0]]["load"]["bytes"] == 0
                  and v[PASSES[0]]["prompt_tokens"]["local_compute"] == 240, f"pass 1 computes and stores: {v[PASSES[0]]}")
            check(v[PASSES[1]]["prompt_tokens"]["external_kv_transfer"] == 240 and v[PASSES[1]]["load"]["jobs"] == 6
                  and abs(v[PASSES[1]]["load"]["gbps_vllm_stat"] - 20) < 1e-6, f"pass 2 loads: {v[PASSES[1]]}")
            check(v[PASSES[2]]["prompt_tokens"]["local_cache_hit"] == 240 and v[PASSES[2]]["mismatches"] == 0,
                  "pass 3 from the GPU cache")
            check(v[PASSES[3]]["prompts"] == 6 and v[PASSES[3]]["load"]["bytes"] == 3 * 40 * 131072
                  and v[PASSES[3]]["store"]["bytes"] == 3 * 40 * 131072, f"mixed: 3 new stored, 3 old loaded: {v[PASSES[3]]}")
            n = e["none:- rep 1"]["passes"]
            check(n[PASSES[1]]["prompt_tokens"]["local_compute"] == 240 and n[PASSES[1]]["load"]["bytes"] is None,
                  "spec none recomputes pass 2")
            check(e["kvoffload:1GiB rep 1"]["pin_state"] == "pinned"
                  and e["kvoffload:1GiB rep 1"]["kv_connector_extra_config"]["spec_name"] == PROBE_SPEC,
                  "kvoffload runs as the probed spec")
            md = open(os.path.join(out, "serving.md")).read()
            check("| vllm | 1GiB | 1/1 |" in md and "| 100 |" in md, f"stub table\n{md}")
            os.environ["STUB_FLIP"] = "1"
            args = parse_args(["--specs", "vllm", "--regions", "1GiB", "--reps", "1", "--prompts", "4",
                               "--prompt-tokens", "40", "--no-warmup", "--gpu-free-timeout-s", "0",
                               "--out-dir", os.path.join(tmp, "f")])
            r = run_all(args)["engines"][0]
            check(not r["ok"] and r["passes"][PASSES[1]]["mismatches"] == 4 and "4 of 4 prompts' tokens differ" in r["error"],
                  f"tokens that differ from pass 1's fail the engine: {r.get('error')}")
        finally:
            os.environ.pop("STUB_FLIP", None)
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
    finally:
        reap_fakes()
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"serving self-test: ok ({len(checks)} checks)")
    return 0


# ------------------------------------------------------------ main


def bench_parser(doc):
    """The parser of a serving benchmark (this one, serve_http.py) whose
    module docstring is ``doc``, with the options they share first: the
    model and the specs."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(HERE, "llama3-8b-shape"),
                    help="a model directory with config.json (dummy weights; default: the Llama-3-8B shape)")
    ap.add_argument("--specs", default="none,vllm,kvoffload", help="of none, vllm (CPUOffloadingSpec), kvoffload")
    return ap


def add_extra_args(ap, kvo_eg, offload_eg, probe):
    """The options ``parse_extras`` and ``connector_extra`` read: extra
    config for kvoffload's spec and for both offloading specs, and whether
    kvoffload runs as the probed spec (``kvo_eg``, ``offload_eg``, ``probe``:
    the help's examples and its words for the probe)."""
    ap.add_argument("--kvo-extra", action="append", default=None, metavar="KEY=VALUE",
                    help=f"added to kvoffload's kv_connector_extra_config (e.g. {kvo_eg})")
    ap.add_argument("--offload-extra", action="append", default=None, metavar="KEY=VALUE",
                    help=f"added to both offloading specs' extra config{offload_eg}")
    ap.add_argument("--no-pin-probe", dest="pin_probe", action="store_false",
                    help=f"run kvoffload's spec itself, without {probe} when pinning ended")


def add_plan_args(ap, noun, timeout_help):
    """The options ``run_plan`` reads of each ``noun`` (engine, server) it
    runs: its timeout, the budget and the grace of its group's SIGTERM."""
    ap.add_argument("--timeout", type=float, default=900, help=timeout_help)
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"start no {noun} that would likely end past this many seconds (estimate: the longest so far)")
    ap.add_argument("--budget-grace-s", type=float, default=60,
                    help=f"with --budget-s, a{'n' if noun[0] in 'aeiou' else ''} {noun} still running this long past the budget is stopped")
    ap.add_argument("--kill-grace-s", type=float, default=20, help=f"SIGTERM to SIGKILL of a{'n' if noun[0] in 'aeiou' else ''} {noun}'s group")


def build_parser():
    ap = bench_parser(__doc__)
    ap.add_argument("--regions", default="64GiB,96GiB", help="host region sizes (cpu_bytes_to_use)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--first-rep", type=int, default=0,
                    help="number the repetitions (and rotate the specs) from this one: runs split over several "
                    "commands, their tables merged with --table-from")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--mixed-new", type=int, default=None, help="new prompts in the mixed pass (default prompts/2)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--attention", default=None, help="attention_backend for LLM(...) (default: vLLM's)")
    add_extra_args(ap, "kvo_pin_threads=8, kvo_region=anonymous", " (e.g. blocks_per_chunk=16)", "the subclass that reports")
    ap.add_argument("--warmup-prompts", type=int, default=4)
    ap.add_argument("--no-warmup", action="store_true")
    add_plan_args(ap, "engine", "seconds per engine")
    ap.add_argument("--shutdown-timeout-s", type=float, default=30, help="vLLM's own engine shutdown, in the child")
    ap.add_argument("--gpu-free-timeout-s", type=float, default=60)
    ap.add_argument("--gpu-free-slack-mib", type=int, default=1024,
                    help="GPU memory counted as free within this much of the use before the first engine")
    ap.add_argument("--out-dir", default="serving-out")
    ap.add_argument("--table-from", nargs="+", metavar="JSON", help="only print (and write) the table of earlier runs")
    ap.add_argument("--self-test", action="store_true", help="check the parts that need no GPU, then exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--fake", help=argparse.SUPPRESS)
    ap.add_argument("--fake-duration-s", type=float, default=0.3, help=argparse.SUPPRESS)
    ap.add_argument("--fake-linger-s", type=float, default=2.0, help=argparse.SUPPRESS)
    return ap


def parse_args(argv=None):
    """The command line, with the KEY=VALUE lists turned into dicts."""
    args = parse_extras(build_parser().parse_args(argv), "serving")
    if args.mixed_new is None:
        args.mixed_new = args.prompts // 2
    return args


def parse_extras(args, prog):
    """``args`` with their ``--kvo-extra`` and ``--offload-extra``
    KEY=VALUE lists turned into dicts (a bad one exits, in ``prog``'s name)."""
    try:
        args.kvo_extra = parse_extra(args.kvo_extra)
        args.offload_extra = parse_extra(args.offload_extra)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"{prog}: {e}")
    return args


def exit_status(doc):
    """A run's exit status: 0 when it ran an engine (or server), every one
    was ok and nothing interrupted it; 1 otherwise."""
    ran = doc["engines"]
    return 0 if ran and all(r.get("ok") for r in ran) and not doc.get("interrupted") else 1


def importable(specs, name, script):
    """Whether vLLM, PyTorch and (with spec kvoffload) kvoffload import;
    says which do not, and ``script``, the CI script that carries them."""
    import importlib.util

    missing = [m for m in ("vllm", "torch") if importlib.util.find_spec(m) is None]
    if "kvoffload" in specs.split(",") and importlib.util.find_spec("kvoffload") is None:
        missing.append("kvoffload")
    if missing:
        say(f"{name}: {', '.join(missing)} not importable (put the vLLM bundle's site and kvoffload's wheel "
            f"on PYTHONPATH: {script} does)")
    return not missing


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        cfg = json.loads(args.one)
        try:
            if cfg.get("fake"):
                child_fake(cfg)
            else:
                child_real(cfg)
        except BaseException as e:  # noqa: BLE001 - reported to the parent as this engine's failure
            import traceback

            traceback.print_exc()
            print("RESULT " + json.dumps({**cfg, "ok": False, "error": repr(e)[:2000]}), flush=True)
            sys.stdout.flush()
            os._exit(1)  # vLLM's atexit teardown of a failed engine may hang; the parent stops the group
        os._exit(0)
    if args.self_test:
        return self_test()
    if args.table_from:
        engines, cfg, device, skipped = [], {}, None, []
        for path in args.table_from:
            with open(path) as f:
                d = json.load(f)
            engines += d.get("engines", [])
            skipped += d.get("skipped", [])
            cfg = cfg or dict(d.get("config", {}))
            device = device or d.get("device")
        cfg["reps"] = f"{cfg.get('reps')} in each of {len(args.table_from)} runs"
        doc = {"engines": engines, "config": cfg, "device": device, "skipped": skipped}
        text = markdown(doc)
        os.makedirs(args.out_dir, exist_ok=True)
        write_atomic(os.path.join(args.out_dir, "serving-merged.md"), text)
        say(text)
        return 0
    if not args.fake:
        if not importable(args.specs, "serving", "ci/gpu-serving"):
            return 2
        if not os.path.exists(os.path.join(args.model, "config.json")):
            say(f"serving: no config.json in {args.model}")
            return 2
    return exit_status(run_all(args))


if __name__ == "__main__":
    sys.exit(main())
