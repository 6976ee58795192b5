#!/usr/bin/env python3
"""The OpenAI server as users run it (issue 42, deliverable 6): ``vllm serve``
on the Llama-3-8B-shaped config (``llama3-8b-shape/``, dummy weights, no
tokenizer) with no offloading, vLLM's ``CPUOffloadingSpec`` or kvoffload's
``KvoffloadSpec``, and a real HTTP client on the reuse workload of
``serving.py``.

Each server (spec x repetition, one host region) is ``python3 -m
vllm.entrypoints.cli.main serve`` (the ``vllm`` console script's code;
``--entry api_server`` runs ``vllm.entrypoints.openai.api_server``) in a
session of its own, on a free port of 127.0.0.1, with ``--load-format dummy
--skip-tokenizer-init --enable-prefix-caching --kv-transfer-config <json>``
and ``VLLM_SERVER_DEV_MODE=1`` (for ``POST /reset_prefix_cache``). Ready is
the first ``GET /health`` answered 200 (polled, bounded by
``--ready-timeout-s``). At the end its whole process group is stopped
(SIGTERM, then SIGKILL: the engine core is the API server's child) and the
next server starts once GPU memory is back to what it was before the first
(bounded wait, reported when it is not). A warm-up server (no offloading, a
few prompts, not reported) runs first unless ``--no-warmup``.

The client is the standard library's ``http.client``: ``--concurrency``
requests in flight at once (threads), each ``POST /v1/completions`` with
``{"prompt": [token ids], "max_tokens": 8, "temperature": 0, "stream":
true, "ignore_eos": true, "return_token_ids": true, "stream_options":
{"include_usage": true}}``; the server streams Server-Sent Events. TTFT of
a request: from just before it is sent to the arrival of the first event
that carries a generated token (vLLM sends no event before the first token;
with ``return_token_ids`` that event also carries the prompt's ids). The
final usage event gives the prompt tokens found cached (GPU prefix cache or
loaded by the connector; ``--enable-prompt-tokens-details``).

Workload per server: ``--prompts`` prompts of ``--prompt-tokens`` random
token ids (``serving.py``'s generator and seed, so the prompts are the
same). Pass 1 computes them (and stores them to the host); the GPU prefix
cache is reset (``POST /reset_prefix_cache``, retried after a one-token
request while offloading still holds blocks); pass 2 runs them again (host
hits, or recomputed with spec none); pass 3 again (GPU prefix cache). Per
pass: wall seconds, TTFT per request (median, p90, max), tokens compared
with pass 1's, and from the server's ``GET /metrics`` (vLLM's Prometheus
counters) the prompt tokens by source and the bytes and seconds of loads
and stores.

Results: a line per server as it ends; ``serve-http.json`` (every figure,
rewritten after each server), ``serve-http.jsonl`` (a line per server) and
``serve-http.md`` (median [min-max] per spec) in ``--out-dir``; server
logs in ``logs/``. ``--budget-s`` starts no server that would likely end
past it. Exit status 0 when every server was ok, 1 otherwise, 2 when
something ``vllm serve`` needs is missing (named, with what to carry).

    PYTHONPATH=/tmp/site:<kvoffload and the serve wheels> \\
        python3 python/bench/serve_http.py --reps 1 --budget-s 540

``--self-test`` checks what needs no GPU (an in-process fake OpenAI server
for the client, SSE parsing and metrics; fake servers in their own sessions
for process groups, GPU-free wait, budget, signals; the table) in about a
minute.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import importlib.util
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import serving as sv  # noqa: E402  (process groups, GPU-free wait, log parsing, cells, specs)
import vllm_engine as ve  # noqa: E402  (prompts_of, parse_size, say)

parse_size, say = ve.parse_size, ve.say
GIB = sv.GIB
SPECS = sv.SPECS
label_of, _get = sv.label_of, sv._get
PASSES = ("1 computed", "2 after reset", "3 GPU cache")
PREFIX = "serve-http"

#: What ``vllm serve`` (0.26) imports beyond ``vllm.LLM``, and what carries
#: it: module -> distribution. The first five are in neither the vLLM bundle
#: nor the GPU machine's image (as listed 2026-11-17); the rest are there and
#: checked all the same.
SERVE_NEEDS = {
    "uvicorn": "uvicorn (py3-none-any; needs click, h11)",
    "prometheus_fastapi_instrumentator": "prometheus-fastapi-instrumentator>=8.0.0 (py3-none-any)",
    "model_hosting_container_standards": "model-hosting-container-standards (py3-none-any; needs jmespath)",
    "jmespath": "jmespath (py3-none-any)",
    "watchfiles": "watchfiles (cp310-abi3 manylinux x86_64; needs anyio)",
    "fastapi": "fastapi (in the vLLM bundle)",
    "starlette": "starlette (in the vLLM bundle)",
    "openai": "openai (in the vLLM bundle)",
    "uvloop": "uvloop (in the GPU image)",
    "h11": "h11 (in the GPU image)",
    "click": "click (in the GPU image)",
    "anyio": "anyio (in the GPU image)",
    "prometheus_client": "prometheus-client (in the GPU image)",
}
_NO_MODULE = re.compile(r"No module named '([^']+)'")


def missing_modules(names=None):
    """The modules of ``SERVE_NEEDS`` (or ``names``) not importable here."""
    out = []
    for m in names or SERVE_NEEDS:
        try:
            if importlib.util.find_spec(m) is None:
                out.append(m)
        except (ImportError, ValueError):
            out.append(m)
    return out


def carry_message(missing):
    return ("vllm serve needs modules not importable here: "
            + "; ".join(f"{m} <- {SERVE_NEEDS.get(m, m)}" for m in missing)
            + ". The GPU machine cannot download: carry these wheels (pip download --no-deps --only-binary=:all: "
            "--python-version 3.12 --platform manylinux2014_x86_64) in gpu-bin/serve-wheels/ (or KVO_SERVE_WHEELS); "
            "ci/gpu-serve-http installs them")


# ------------------------------------------------------------ small helpers


def free_port(host="127.0.0.1"):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def nearest_rank(xs, q):
    """The q-quantile (0 < q <= 1) by nearest rank: the smallest value with at
    least q of the values at or below it."""
    xs = sorted(xs)
    if not xs:
        return None
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def summary(xs):
    xs = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    if not xs:
        return {"n": 0, "median": None, "p90": None, "max": None, "min": None}
    return {"n": len(xs), "median": statistics.median(xs), "p90": nearest_rank(xs, 0.9), "max": max(xs),
            "min": min(xs)}


# ------------------------------------------------------------ SSE and metrics


def sse_events(readline):
    """The events of a Server-Sent-Events stream read with ``readline()``
    (bytes, b"" at the end): each event's data lines joined by newlines;
    comments, other fields and empty events left out. Lines end in LF or
    CRLF; an event not closed by a blank line is still given at the end."""
    data = []
    while True:
        raw = readline()
        if not raw:
            if data:
                yield "\n".join(data)
            return
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
            data = []
            continue
        if line.startswith(":"):
            continue
        field, sep, value = line.partition(":")
        if not sep:
            field, value = line, ""
        elif value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)


_PROM_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_PROM_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text):
    """vLLM's counters from the Prometheus text of ``GET /metrics``, keyed as
    ``serving.metrics_snapshot`` keys them (name plus ``[source=...]`` or
    ``[transfer_type=...]``, other labels summed over), so that
    ``serving.transfer_figures`` reads them."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(_PROM_LABEL.findall(m.group(2) or "")), m.group(3)
        if not name.startswith(sv._METRIC_PREFIXES) or name.endswith(("_created", "_bucket")):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        key = name + "".join(f"[{k}={v2}]" for k, v2 in sorted(labels.items()) if k in ("source", "transfer_type"))
        out[key] = out.get(key, 0.0) + v
    return out


# ------------------------------------------------------------ the HTTP client


def http_call(host, port, method, path, body=None, timeout=30.0):
    """One plain request; (status, body text). Raises OSError or
    http.client.HTTPException on a connection failure."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", errors="replace")
    finally:
        conn.close()


def completion_body(model, prompt, max_tokens):
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}


def stream_completion(host, port, model, prompt, max_tokens, timeout_s, deadline=None):
    """One streaming ``POST /v1/completions``: TTFT (first event carrying a
    generated token), the generated token ids, the usage. Every read is
    bounded by ``timeout_s`` and the whole request by ``deadline``
    (monotonic); an error is reported in the result, never raised."""
    out = {"ok": False, "tokens": [], "ttft_s": None, "first_event_s": None, "latency_s": None, "events": 0,
           "cached_tokens": None, "prompt_tokens": None, "status": None}
    body = json.dumps(completion_body(model, prompt, max_tokens)).encode()
    t0 = time.monotonic()
    left = timeout_s if deadline is None else max(0.1, min(timeout_s, deadline - t0))
    conn = http.client.HTTPConnection(host, port, timeout=left)
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        r = conn.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {r.read(2000).decode('utf-8', errors='replace')}"
            return out
        done = False
        for data in sse_events(r.readline):
            now = time.monotonic()
            if deadline is not None and now > deadline:
                out["error"] = "deadline passed while streaming"
                return out
            if out["first_event_s"] is None:
                out["first_event_s"] = now - t0
            out["events"] += 1
            if data.strip() == "[DONE]":
                done = True
                break
            try:
                ev = json.loads(data)
            except ValueError:
                out["error"] = f"not JSON: {data[:200]!r}"
                return out
            if "error" in ev and not ev.get("choices"):
                out["error"] = f"error event: {json.dumps(ev)[:300]}"
                return out
            for ch in ev.get("choices") or []:
                ids = ch.get("token_ids") or []
                if (ids or ch.get("text")) and out["ttft_s"] is None:
                    out["ttft_s"] = now - t0
                out["tokens"].extend(ids)
                if ch.get("finish_reason"):
                    out["finish_reason"] = ch["finish_reason"]
            u = ev.get("usage")
            if u:
                out["prompt_tokens"] = u.get("prompt_tokens")
                out["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        out["latency_s"] = time.monotonic() - t0
        if not done:
            out["error"] = "the stream ended without [DONE]"
        elif len(out["tokens"]) != max_tokens:
            out["error"] = f"{len(out['tokens'])} tokens, {max_tokens} asked for"
        else:
            out["ok"] = True
        return out
    except (OSError, http.client.HTTPException) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        conn.close()


def run_pass(host, port, model, prompts, concurrency, max_tokens, timeout_s, deadline, stop=None):
    """The prompts through ``concurrency`` threads, each sending its next
    prompt when its previous one ends. Per prompt (in order) the request's
    result; the pass's wall seconds (first send to last end)."""
    results = [None] * len(prompts)
    nxt = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker():
        while not (stop and stop()) and time.monotonic() < deadline:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            results[i] = stream_completion(host, port, model, prompts[i], max_tokens, timeout_s, deadline)

    threads = [threading.Thread(target=worker, name=f"serve-http-client-{k}", daemon=True)
               for k in range(max(1, min(concurrency, len(prompts))))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + timeout_s + 5)
    wall = time.monotonic() - t0
    alive = sum(t.is_alive() for t in threads)
    for i, r in enumerate(results):
        if r is None:
            results[i] = {"ok": False, "tokens": [], "ttft_s": None, "error": "not sent (deadline or stop)"}
    return results, wall, alive


def pass_figures(results, wall, ref=None):
    ttft = [r.get("ttft_s") for r in results]
    p = {"seconds": wall, "requests": len(results), "ok_requests": sum(1 for r in results if r.get("ok")),
         "ttft_s": ttft, "ttft": summary(ttft), "latency": summary([r.get("latency_s") for r in results]),
         "cached_tokens": [r.get("cached_tokens") for r in results],
         "prompt_tokens_sum": sum(r.get("prompt_tokens") or 0 for r in results)}
    c = [x for x in p["cached_tokens"] if isinstance(x, int)]
    p["cached_tokens_sum"] = sum(c) if c else None
    errs = [f"prompt {i}: {r.get('error')}" for i, r in enumerate(results) if not r.get("ok")]
    if errs:
        p["errors"] = errs[:5]
        p["error_count"] = len(errs)
    if ref is not None:
        p.update(sv.compare([r.get("tokens") for r in results], ref))
    return p


# ------------------------------------------------------------ one server


def kv_transfer_config(spec, region, cfg):
    extra = sv.connector_extra(spec, region, cfg)
    if extra is None:
        return None
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def served_name(model):
    return os.path.basename(os.path.normpath(model)) or "model"


def server_command(cfg, port):
    """The server's argv: ``vllm serve`` (or the api_server module) with the
    flags of the brief; in --fake mode this script's fake server, which
    parses the same flags."""
    model = os.path.abspath(cfg["model"])
    flags = [model, "--served-model-name", served_name(model), "--host", cfg["host"], "--port", str(port),
             "--load-format", "dummy", "--skip-tokenizer-init", "--enable-prefix-caching",
             "--max-model-len", str(cfg["max_model_len"]), "--gpu-memory-utilization", str(cfg["gpu_memory_utilization"]),
             "--seed", "0", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    kvt = kv_transfer_config(cfg["spec"], cfg["region"], cfg)
    if kvt is not None:
        flags += ["--kv-transfer-config", json.dumps(kvt)]
    flags += list(cfg.get("server_args") or [])
    if cfg.get("fake"):
        marker = os.environ.get("KVO_SERVING_FAKE_MARKER", "kvo-serving-fake")
        return [sys.executable, os.path.abspath(__file__), "--fake-server", cfg["fake"], marker, "serve"] + flags
    if cfg.get("entry") == "api_server":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"] + flags
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"] + flags


def server_env(cfg):
    env = dict(os.environ)
    env.update(VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1", VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_COLOR="0",
               PYTHONUNBUFFERED="1")
    # The engine core imports the pinning probe by module name (serving.py).
    env["PYTHONPATH"] = HERE + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def wait_ready(host, port, proc, timeout_s, stop=None):
    """Polls ``GET /health`` until 200 (ready: seconds), the server exits, or
    ``timeout_s``; (ready seconds or None, why not)."""
    t0 = time.monotonic()
    last = "no answer"
    while True:
        if stop and stop():
            return None, "stopped"
        if proc.poll() is not None:
            return None, f"the server exited (status {proc.returncode}) before it was ready"
        try:
            status, _ = http_call(host, port, "GET", "/health", timeout=5)
            if status == 200:
                return time.monotonic() - t0, None
            last = f"HTTP {status}"
        except (OSError, http.client.HTTPException) as e:
            last = type(e).__name__
        if time.monotonic() - t0 >= timeout_s:
            return None, f"not ready within {timeout_s:.0f} s (last /health: {last})"
        time.sleep(0.5)


def reset_prefix_cache(host, port, model, tries):
    """``POST /reset_prefix_cache`` until it succeeds, at most ``tries``
    times; between tries a one-token request (a step of the engine, so that
    blocks held by finished requests or transfers are released)."""
    out = []
    for _ in range(tries):
        try:
            status, text = http_call(host, port, "POST", "/reset_prefix_cache", timeout=60)
            ok = status == 200 and bool(json.loads(text or "{}").get("success", False))
            out.append(ok if status == 200 else f"HTTP {status}")
        except (OSError, http.client.HTTPException, ValueError) as e:
            out.append(f"{type(e).__name__}: {e}")
            ok = False
        if ok:
            break
        stream_completion(host, port, model, [7, 8, 9, 10, 11, 12, 13, 14], 1, 60)
    return out


def scrape(host, port):
    try:
        status, text = http_call(host, port, "GET", "/metrics", timeout=30)
        return parse_prometheus(text) if status == 200 else None
    except (OSError, http.client.HTTPException):
        return None


def workload(cfg, host, port, deadline, stop, res):
    """The three passes against a ready server; figures into ``res``."""
    model = served_name(cfg["model"])
    with open(os.path.join(cfg["model"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = ve.prompts_of(cfg["prompts"], cfg["prompt_tokens"], seed=2, vocab=vocab)  # serving.py's "old"
    res["passes"], res["resets"] = {}, {}
    res["metrics_source"] = "unavailable"
    first = None
    for i, name in enumerate(PASSES):
        if i == 1:
            res["resets"]["before pass 2"] = reset_prefix_cache(host, port, model, cfg["reset_tries"])
        # After the reset (its one-token requests are not the pass's).
        # Transfers still in flight at a pass's end count in the next pass.
        snap = scrape(host, port)
        results, wall, alive = run_pass(host, port, model, prompts, cfg["concurrency"], cfg["max_tokens"],
                                        cfg["request_timeout_s"], deadline, stop)
        p = pass_figures(results, wall, None if first is None else first)
        if alive:
            p["client_threads_left"] = alive
        after = scrape(host, port)
        if snap is not None and after is not None:
            p.update(sv.transfer_figures(snap, after, wall))
            res["metrics_source"] = "GET /metrics"
        res["passes"][name] = p
        if first is None:
            first = [r.get("tokens") for r in results]
        if (stop and stop()) or time.monotonic() > deadline:
            break


def check(r):
    """ok and the first reason it is not."""
    why = []
    if r.get("ready_s") is None:
        why.append(r.get("ready_error") or "not ready")
    passes = r.get("passes") or {}
    for name in PASSES:
        p = passes.get(name)
        if p is None:
            if r.get("ready_s") is not None:
                why.append(f"pass {name!r} did not run")
            continue
        if p.get("error_count"):
            why.append(f"pass {name!r}: {p['error_count']} of {p['requests']} requests failed ({p['errors'][0]})")
        if p.get("mismatches"):
            why.append(f"pass {name!r}: {p['mismatches']} of {p['requests']} prompts' tokens differ from pass 1's "
                       f"(first: prompt {p['first_mismatch']})")
    for k, t in (r.get("resets") or {}).items():
        if t and t[-1] is not True:
            why.append(f"reset_prefix_cache {k} failed {len(t)} times ({t[-1]})")
    p2 = passes.get(PASSES[1]) or {}
    if r.get("spec") in ("vllm", "kvoffload") and p2 and not why:
        ext = (p2.get("prompt_tokens") or {}).get("external_kv_transfer")
        if ext == 0:
            why.append("pass 2 loaded nothing from the host (0 external prompt tokens)")
        elif ext is None:
            r.setdefault("notes", []).append("host hits not verified: vLLM's /metrics not read")
    return not why, "; ".join(why)


def run_server(job, args, log_path, timeout_s, state):
    """One server: start, ready, workload, stop the group. The result."""
    cfg = child_config(job, args)
    port = free_port(args.host)
    cmd = server_command(cfg, port)
    res = {k: v for k, v in cfg.items() if k not in ("kvo_extra", "offload_extra")}
    res.update(label=label_of(job), rep=job["rep"], warmup=job["warmup"], log=log_path, port=port, argv=cmd[1:],
               kv_transfer_config=kv_transfer_config(cfg["spec"], cfg["region"], cfg))
    t = time.monotonic()
    deadline = t + timeout_s
    stop = lambda: state["stopping"]  # noqa: E731
    interrupted = False
    proc = None
    with open(log_path, "w") as log:
        try:
            res["t0_wall"] = time.time()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=server_env(cfg), start_new_session=True)
            state["current"] = proc
            ready, why = wait_ready(args.host, port, proc, min(args.ready_timeout_s, timeout_s), stop)
            res["ready_s"] = ready
            if why:
                res["ready_error"] = why
            else:
                workload(cfg, args.host, port, deadline, stop, res)
        except sv.Stop:
            interrupted = True
        finally:
            state["current"] = None  # a signal from here on only sets the flag
            interrupted = interrupted or state["stopping"]
            if proc is not None:
                res["cleanup"] = sv.end_group(proc, args.kill_grace_s)
                res["rc"] = proc.returncode
    res["process_s"] = round(time.monotonic() - t, 2)
    with open(log_path, errors="replace") as f:
        text = f.read()
    res["log_parsed"] = sv.parse_log(text, res.get("t0_wall"))
    for ev in res["log_parsed"]["probe"]:
        if ev.get("event") == "pinned" and res.get("t0_wall") is not None:
            res["pinned_s"] = ev["at"] - res["t0_wall"]
            res["pin_state"] = ev.get("state")
    res["ok"], res["error"] = check(res)
    if not res["error"]:
        res.pop("error")
    miss = sorted(set(_NO_MODULE.findall(text)))
    if miss and res.get("ready_s") is None:
        res["missing_modules"] = miss
        res["error"] = carry_message(miss) + f" (from the server's log; {res.get('error', '')})"
    elif res.get("ready_s") is None:
        res["error"] = f"{res.get('error')}; log tail: " + " | ".join(text.splitlines()[-8:])[-1500:]
    if time.monotonic() > deadline and res.get("ready_s") is not None and len(res.get("passes") or {}) < len(PASSES):
        res["ok"] = False
        res["error"] = f"timeout {timeout_s:.0f} s ({res.get('error', 'passes unfinished')})"
    if interrupted:
        res["ok"] = False
        res["error"] = "interrupted by a signal to the benchmark"
    if (res.get("cleanup") or {}).get("members_left"):
        res["ok"] = False
        res["error"] = f"processes of the server's group survived SIGKILL: {res['cleanup']['members_left']}"
    if res.get("spec") == "kvoffload" and args.pin_probe and res.get("ok"):
        if res.get("pin_state") is None:
            res.setdefault("notes", []).append("kvoffload's pinning had not ended when the server was stopped")
        elif res["pin_state"] != "pinned":
            res["ok"] = False
            res["error"] = f"kvoffload's pinning did not end pinned (probe: {res['pin_state']})"
    kv_tokens = res["log_parsed"].get("gpu_kv_tokens")
    need = (cfg["prompts"] or 0) * (cfg["prompt_tokens"] + cfg["max_tokens"])
    if kv_tokens and need > kv_tokens:
        res.setdefault("notes", []).append(
            f"the GPU KV cache ({kv_tokens} tokens) holds less than the prompts ({need}): pass 3 recomputes some")
    return res, interrupted


# ------------------------------------------------------------ plan, lines, table


def plan_servers(specs, region, reps, warmup=True):
    """The warm-up, then per repetition every spec (rotated by the repetition)."""
    return sv.plan_engines(specs, [region], reps, warmup=warmup)


def child_config(job, args):
    return {
        "spec": job["spec"], "region": job["region"], "rep": job["rep"], "warmup": job["warmup"],
        "model": os.path.abspath(args.model),
        "prompts": args.warmup_prompts if job["warmup"] else args.prompts,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
        "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
        "kvo_extra": args.kvo_extra, "offload_extra": args.offload_extra, "pin_probe": args.pin_probe,
        "server_args": args.server_arg or [], "entry": args.entry, "host": args.host,
        "request_timeout_s": args.request_timeout_s, "reset_tries": args.reset_tries,
        "fake": job.get("fake"),
    }


def server_line(r):
    p = r.get("passes") or {}

    def s(name, *path):
        v = _get(p, name, *path)
        return f"{v:6.2f}" if isinstance(v, (int, float)) else "     -"

    ready = r.get("ready_s")
    line = (f"{r.get('label', '?'):26} ready {ready if ready is not None else float('nan'):6.1f} s  "
            f"passes {s(PASSES[0], 'seconds')} {s(PASSES[1], 'seconds')} {s(PASSES[2], 'seconds')} s  "
            f"TTFT median {s(PASSES[0], 'ttft', 'median')} {s(PASSES[1], 'ttft', 'median')} "
            f"{s(PASSES[2], 'ttft', 'median')} s  pass 2 p90/max {s(PASSES[1], 'ttft', 'p90')}/"
            f"{s(PASSES[1], 'ttft', 'max')} s  {'ok' if r.get('ok') else 'NOT OK'}  (server {r.get('process_s', 0):.0f} s)")
    return line + sv.line_notes(r, "server", 800)


def _host_pct(r, name):
    t = _get(r, "passes", name, "prompt_tokens") or {}
    return sv._pct(t.get("external_kv_transfer"), *[t.get(k) for k in ("local_compute", "local_cache_hit",
                                                                        "external_kv_transfer")])


def _cached_pct(r, name):
    p = _get(r, "passes", name) or {}
    c, n = p.get("cached_tokens_sum"), p.get("prompt_tokens_sum")
    return 100.0 * c / n if c is not None and n else None


COLUMNS = [
    ("ready s", lambda r: r.get("ready_s")),
    ("pinned s", lambda r: r.get("pinned_s")),
    ("pass 1 s", lambda r: _get(r, "passes", PASSES[0], "seconds")),
    ("pass 2 s", lambda r: _get(r, "passes", PASSES[1], "seconds")),
    ("pass 3 s", lambda r: _get(r, "passes", PASSES[2], "seconds")),
    ("TTFT 1 med s", lambda r: _get(r, "passes", PASSES[0], "ttft", "median")),
    ("TTFT 2 med s", lambda r: _get(r, "passes", PASSES[1], "ttft", "median")),
    ("TTFT 2 p90 s", lambda r: _get(r, "passes", PASSES[1], "ttft", "p90")),
    ("TTFT 2 max s", lambda r: _get(r, "passes", PASSES[1], "ttft", "max")),
    ("TTFT 3 med s", lambda r: _get(r, "passes", PASSES[2], "ttft", "median")),
    ("pass 2 host %", lambda r: _host_pct(r, PASSES[1])),
    ("pass 2 cached %", lambda r: _cached_pct(r, PASSES[1])),
    ("pass 2 load GiB", lambda r: sv._div(_get(r, "passes", PASSES[1], "load", "bytes"), GIB)),
]


def table(results, specs_order=None):
    return sv.table(results, specs_order, COLUMNS, str)


def verdict(results):
    """Pass 2's TTFT (median over the servers of each one's median) of each
    offloading spec against spec none's recompute, from ok servers only."""
    med = {}
    for r in results:
        v = _get(r, "passes", PASSES[1], "ttft", "median")
        if not r.get("warmup") and r.get("ok") and isinstance(v, (int, float)):
            med.setdefault(r["spec"], []).append(v)
    med = {k: statistics.median(v) for k, v in med.items()}
    if "none" not in med:
        return []
    out = []
    for s in ("kvoffload", "vllm"):
        if s in med:
            a, b = med[s], med["none"]
            word = "faster" if a < b else "NOT faster"
            out.append(f"pass 2 TTFT median: {s} (host hits) {sv.fmt_num(a)} s vs none (recompute) "
                       f"{sv.fmt_num(b)} s: {word} ({b / a:.2f}x)" if a else f"{s}: 0 s")
    return out


NOTES = """\
Cells: median [min-max] over the repetitions (`ok` counts the servers that passed every check). ready: first
`GET /health` answered 200, from the server's start. pinned: kvoffload's pinning ended (probe in the engine
core), from the server's start. Pass 1 computes the prompts (and stores them); pass 2 runs them again after
`POST /reset_prefix_cache` (host hits, or recomputed with spec none); pass 3 again (GPU prefix cache). TTFT:
from sending a request to the first streamed event carrying a token, with `concurrency` requests in flight;
med/p90/max over a pass's requests. host %: share of pass 2's prompt tokens loaded by the connector (vLLM's
`prompt_tokens_by_source` from `/metrics`); cached %: share of pass 2's prompt tokens the server reported
cached (usage `prompt_tokens_details.cached_tokens`: GPU prefix cache plus loaded)."""


def markdown(doc):
    res = doc["engines"]
    a = doc.get("config", {})
    out = [
        "# vLLM OpenAI server (`vllm serve`) with an HTTP client: offloading specs",
        "",
        f"device: {doc.get('device') or '?'}; vLLM {doc.get('vllm') or '?'}; model {a.get('model')} (dummy weights, "
        f"token-id prompts); {a.get('prompts')} prompts x {a.get('prompt_tokens')} tokens, {a.get('max_tokens')} "
        f"tokens each (greedy, streamed), {a.get('concurrency')} in flight; region {a.get('region')}; "
        f"gpu_memory_utilization {a.get('gpu_memory_utilization')}; max_model_len {a.get('max_model_len')}; "
        f"reps {a.get('reps')}" + ("; FAKE SERVERS (self-test)" if a.get("fake") else ""),
        "",
        table(res, (a.get("specs") or "").split(",")),
        "",
    ]
    v = verdict(res)
    if v:
        out += [f"- {x}" for x in v] + [""]
    out.append(NOTES)
    out += sv.problems_md(res, 400)
    notes = [f"- {r.get('label')}: {n}" for r in res for n in r.get("notes") or []]
    if notes:
        out += ["", "Notes:"] + notes
    if doc.get("skipped"):
        out += ["", "Skipped (budget or stop):"] + [f"- {s['label']}: {s['why']}" for s in doc["skipped"]]
    return "\n".join(out) + "\n"


def vllm_version(fake):
    if fake:
        return "fake"
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def run_all(args, hook=None):
    specs = [s for s in args.specs.split(",") if s]
    for s in specs:
        if s not in SPECS:
            raise SystemExit(f"serve_http: unknown spec {s!r} (one of {', '.join(SPECS)})")
    parse_size(args.region)
    plan = plan_servers(specs, args.region, args.reps, warmup=not args.no_warmup)

    def after(r):
        if r.get("missing_modules"):
            say("serve_http: " + carry_message(r["missing_modules"]))

    bench = sv.Bench(name="serve_http", noun="server", files=PREFIX, schema="kvoffload-serve-http-1",
                     extra={"vllm": vllm_version(bool(args.fake))}, config_skip=("self_test", "fake_server"),
                     warnings=sv.host_checks(argparse.Namespace(offload_extra=args.offload_extra,
                                                                kvo_extra=args.kvo_extra), specs, [args.region]),
                     run=run_server, line=server_line, markdown=markdown, after=after,
                     log_name=lambda i, job: f"{i:02d}-{job['spec']}-{sv.rep_name(job)}.log",
                     # A signal raises only while a server runs (run_server
                     # then stops its group).
                     raises=lambda state: state["current"] is not None)
    return sv.run_plan(args, plan, bench, hook)


# ------------------------------------------------------------ fake OpenAI server (self-test)


class FakeVllm:
    """A stand-in for ``vllm serve``'s HTTP side: ``/health``,
    ``/v1/completions`` (streamed as vLLM 0.26 streams it, in chunked
    transfer encoding with events cut across chunks), ``/reset_prefix_cache``
    (only with VLLM_SERVER_DEV_MODE=1; refused after a computed prompt until
    a short request steps the engine, as vLLM refuses while transfers hold
    blocks), ``/metrics`` (vLLM's counter names). A prompt is
    "computed", found in the "GPU cache" until a reset, or "loaded" from the
    host when offloading; each with its own delay before the first token.
    Modes: ok, flip (pass 2's last token changed), nohost (offloading that
    loads nothing), stall (never streams a first token)."""

    DELAYS = {"compute": 0.06, "host": 0.015, "gpu": 0.003}

    def __init__(self, name, offload, mode="ok", dev_mode=True):
        self.name, self.offload, self.mode, self.dev_mode = name, offload, mode, dev_mode
        self.gpu, self.host, self.lock = set(), set(), threading.Lock()
        self.counters = {}
        self.seen = {}
        self.held = False  # blocks held by stores in flight: a reset fails until a step releases them
        self.bodies = []
        self.inflight = self.max_inflight = 0
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):  # up front, as vLLM registers them
            self.inc("vllm:prompt_tokens_by_source_total", 0, source=src)

    def inc(self, name, v, **labels):
        key = (name, tuple(sorted(labels.items())))
        self.counters[key] = self.counters.get(key, 0.0) + v

    def metrics_text(self):
        lines = ["# HELP python_gc_objects_collected_total x", "python_gc_objects_collected_total{generation=\"0\"} 5.0"]
        with self.lock:
            items = sorted(self.counters.items())
        for (name, labels), v in items:
            lab = ",".join(['engine="0"', f'model_name="{self.name}"'] + [f'{k}="{x}"' for k, x in labels])
            lines += [f"# TYPE {name} counter", f"{name}{{{lab}}} {v!r}"]
            if name.endswith("_total"):
                lines.append(f"{name[:-6]}_created{{{lab}}} 1.7e9")
        return "\n".join(lines) + "\n"

    def complete(self, body):
        """(delay, tokens, cached) of one request, or raises ValueError."""
        if body.get("model") != self.name:
            raise ValueError(f"The model `{body.get('model')}` does not exist.")
        ids = body.get("prompt")
        if not (isinstance(ids, list) and ids and all(isinstance(x, int) and x >= 0 for x in ids)):
            raise ValueError("prompt: a list of token ids expected")
        if not (body.get("stream") and body.get("ignore_eos") and body.get("return_token_ids")):
            raise ValueError("stream, ignore_eos and return_token_ids expected")
        key, n = tuple(ids), len(ids)
        with self.lock:
            self.seen[key] = self.seen.get(key, 0) + 1
            if key in self.gpu:
                src, cached = "gpu", n - 1
                self.inc("vllm:prompt_tokens_by_source_total", n - 1, source="local_cache_hit")
                self.inc("vllm:prompt_tokens_by_source_total", 1, source="local_compute")
            elif self.offload and key in self.host and self.mode != "nohost":
                src, cached = "host", n - 1
                self.inc("vllm:prompt_tokens_by_source_total", n - 1, source="external_kv_transfer")
                self.inc("vllm:prompt_tokens_by_source_total", 1, source="local_compute")
                self.inc("vllm:kv_offload_load_bytes_total", n * 131072)
                self.inc("vllm:kv_offload_load_time_total", n * 131072 / 20e9)
                self.inc("vllm:kv_offload_load_size_count", 1)
            else:
                src, cached = "compute", 0
                self.inc("vllm:prompt_tokens_by_source_total", n, source="local_compute")
                self.held = n >= 16  # a full block computed: stored (held) or, if shorter, a step that releases
                if self.offload and n >= 16:
                    self.host.add(key)
                    self.inc("vllm:kv_offload_store_bytes_total", n * 131072)
                    self.inc("vllm:kv_offload_store_time_total", n * 131072 / 10e9)
                    self.inc("vllm:kv_offload_store_size_count", 1)
            self.gpu.add(key)
            second = self.seen[key] == 2
        toks = [(sum(ids) * 31 + i) % 1000 for i in range(int(body.get("max_tokens") or 16))]
        if self.mode == "flip" and second:
            toks[-1] += 1
        return self.DELAYS[src], toks, cached

    def reset(self):
        with self.lock:
            if self.held:
                return False  # as vLLM's while transfers hold blocks: the caller steps the engine and retries
            self.gpu.clear()
            return True

    def handler(self):
        fake = self

        class H(__import__("http.server").server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def send(self, status, text, ctype="application/json"):
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self.send(200, "")
                elif self.path == "/metrics":
                    self.send(200, fake.metrics_text(), "text/plain; version=0.0.4")
                else:
                    self.send(404, json.dumps({"detail": "Not Found"}))

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                if self.path.startswith("/reset_prefix_cache") and fake.dev_mode:
                    self.send(200, json.dumps({"success": fake.reset()}))
                    return
                if self.path != "/v1/completions":
                    self.send(404, json.dumps({"detail": "Not Found"}))
                    return
                try:
                    body = json.loads(raw)
                    fake.bodies.append({k: v for k, v in body.items() if k != "prompt"})
                    delay, toks, cached = fake.complete(body)
                except ValueError as e:
                    self.send(400, json.dumps({"error": {"message": str(e), "type": "BadRequestError"}}))
                    return
                with fake.lock:
                    fake.inflight += 1
                    fake.max_inflight = max(fake.max_inflight, fake.inflight)
                ended = []

                def end():
                    # Once, before [DONE]: the client sends its next request
                    # as soon as it reads [DONE], which may come before this
                    # handler's thread runs again (counted after it, a
                    # client of 3 threads showed 4 requests in flight).
                    with fake.lock:
                        if not ended:
                            ended.append(True)
                            fake.inflight -= 1

                try:
                    self.stream(body, delay, toks, cached, end)
                finally:
                    end()

            def stream(self, body, delay, toks, cached, end):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def chunk(b):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
                    self.wfile.flush()

                if fake.mode == "stall":
                    time.sleep(30)
                    return
                rid = "cmpl-fake"
                # An event without a token before the first token's (vLLM
                # 0.26 sends none; others may): not the first token.
                chunk(("data: " + json.dumps({"id": rid, "object": "text_completion", "created": 1, "model": fake.name,
                                              "choices": [{"index": 0, "text": "", "token_ids": []}]}) + "\n\n").encode())
                time.sleep(delay)
                for i, t in enumerate(toks):
                    ch = {"index": 0, "text": "", "logprobs": None,
                          "finish_reason": "length" if i == len(toks) - 1 else None, "token_ids": [t]}
                    if i == 0:
                        ch["prompt_token_ids"] = body["prompt"]
                    ev = ("data: " + json.dumps({"id": rid, "object": "text_completion", "created": 1,
                                                 "model": fake.name, "choices": [ch]}) + "\n\n").encode()
                    cut = len(ev) // 2  # an event across two HTTP chunks
                    chunk(ev[:cut])
                    chunk(ev[cut:])
                    if i == 0:
                        chunk(b": a comment line\r\n\r\n")
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(toks),
                         "total_tokens": len(body["prompt"]) + len(toks), "prompt_tokens_details": {"cached_tokens": cached}}
                chunk(("data: " + json.dumps({"id": rid, "object": "text_completion", "created": 1, "model": fake.name,
                                              "choices": [], "usage": usage}) + "\n\n").encode())
                end()
                chunk(b"data: [DONE]\n\n")
                chunk(b"")

        return H

    def start(self, host="127.0.0.1", port=0):
        """Serves from a daemon thread; returns (server, port)."""
        from http.server import ThreadingHTTPServer

        srv = ThreadingHTTPServer((host, port), self.handler())
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return srv, srv.server_address[1]


def fake_server_main(argv):
    """``--fake-server MODE MARKER serve MODEL <vllm serve flags>``: parses
    the flags this script gives ``vllm serve`` (unknown ones are an error, as
    in vLLM), leaves an 'engine core' grandchild running in its group (as
    vLLM's), prints vLLM-shaped log lines and serves FakeVllm. Modes: those
    of FakeVllm, plus stubborn (ignores SIGTERM), linger ('GPU memory' held a
    while outside the group), nomodule (fails as a missing wheel would),
    pinfail (the pinning probe reports an error)."""
    mode, marker = argv[0], argv[1]
    assert argv[2] == "serve"
    ap = argparse.ArgumentParser(prog="fake vllm serve")
    ap.add_argument("model")
    for f in ("--served-model-name", "--host", "--load-format", "--kv-transfer-config", "--attention-backend"):
        ap.add_argument(f)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--gpu-memory-utilization", type=float)
    ap.add_argument("--seed", type=int)
    for f in ("--skip-tokenizer-init", "--enable-prefix-caching", "--enable-prompt-tokens-details",
              "--disable-uvicorn-access-log"):
        ap.add_argument(f, action="store_true")
    a = ap.parse_args(argv[3:])
    if mode == "nomodule":
        print("Traceback (most recent call last):\nModuleNotFoundError: No module named 'uvicorn'", flush=True)
        sys.exit(1)
    assert a.load_format == "dummy" and a.skip_tokenizer_init and a.enable_prefix_caching and a.enable_prompt_tokens_details
    assert os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") == "0" and os.environ.get("HF_HUB_OFFLINE") == "1"
    kvt = json.loads(a.kv_transfer_config) if a.kv_transfer_config else None
    core_mode = mode if mode in ("stubborn", "linger") else "ok"
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    core = subprocess.Popen([sys.executable, "-c", sv._FAKE_CORE, marker, core_mode, "3"])
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"(EngineCore pid={core.pid}) INFO {stamp} [kv_cache_utils.py:2177] GPU KV cache size: 412,160 tokens")
    print(f"(EngineCore pid={core.pid}) INFO {stamp} [gpu_model_runner.py:6845] Graph capturing finished in 9 secs, "
          "took 0.42 GiB", flush=True)
    extra = (kvt or {}).get("kv_connector_extra_config") or {}
    if extra.get("spec_module_path") == sv.PROBE_MODULE:
        print(f"(EngineCore pid={core.pid}) SERVING_PROBE " + json.dumps(
            {"event": "pinned", "at": time.time() + 0.5, "state": "error" if mode == "pinfail" else "pinned"}),
            flush=True)
    time.sleep(0.4)  # start-up: /health refuses connections meanwhile
    fv = FakeVllm(a.served_model_name, kvt is not None, mode if mode in ("flip", "nohost", "stall") else "ok",
                  dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") == "1")
    fv.start(a.host, a.port)
    print(f"INFO {stamp} [launcher.py:46] Route: /v1/completions, Methods: POST\nINFO:     Application startup complete.",
          flush=True)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        time.sleep(0.5)
    return 0


# ------------------------------------------------------------ self-test


def self_test():
    checks = []

    def check(cond, what):
        if not cond:
            raise AssertionError(what)
        checks.append(what)

    a = parse_args([])
    check(a.reps == 1 and a.prompts == 48 and a.prompt_tokens == 4000 and a.concurrency == 8 and a.region == "64GiB"
          and a.max_tokens == 8, "defaults: 1 rep, 48 prompts of 4000 tokens, 8 in flight, 64GiB")
    # Quantiles and summaries.
    check(nearest_rank(list(range(1, 11)), 0.9) == 9 and nearest_rank([5], 0.9) == 5 and nearest_rank([], 0.5) is None,
          "p90 by nearest rank")
    s = summary([0.3, None, 0.1, 0.2, "x"])
    check(s["n"] == 3 and s["median"] == 0.2 and s["max"] == 0.3 and s["p90"] == 0.3, f"summary: {s}")
    # SSE: CRLF and LF, comments, fields, multi-line data, no final blank line.
    stream = (b": hello\r\n\r\nevent: x\r\ndata: {\"a\": 1}\r\n\r\ndata: l1\ndata:l2\nid: 3\n\n\n"
              b"retry: 5\n\ndata: [DONE]")
    ev = list(sse_events(io.BytesIO(stream).readline))
    check(ev == ['{"a": 1}', "l1\nl2", "[DONE]"], f"SSE events: {ev}")
    # Prometheus text as vLLM's /metrics writes it.
    prom = "\n".join([
        "# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source",
        "# TYPE vllm:prompt_tokens_by_source_total counter",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 4000.0',
        'vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_compute"} 96.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 3.84e+04',
        'vllm:prompt_tokens_by_source_created{engine="0",model_name="m",source="local_compute"} 1.7e9',
        'vllm:kv_offload_load_bytes_total{engine="0",model_name="m"} 2e9',
        'vllm:kv_offload_load_time_total{engine="0",model_name="m"} 1.0',
        'vllm:kv_offload_load_size_count{engine="0",model_name="m"} 4',
        'vllm:kv_offload_load_size_bucket{engine="0",le="+Inf",model_name="m"} 4',
        'vllm:x{a="q\\"uote"} NaN',
        'python_gc_objects_collected_total{generation="0"} 5.0',
    ])
    pm = parse_prometheus(prom)
    check(pm == {"vllm:prompt_tokens_by_source_total[source=local_compute]": 4096.0,
                 "vllm:prompt_tokens_by_source_total[source=external_kv_transfer]": 38400.0,
                 "vllm:kv_offload_load_bytes_total": 2e9, "vllm:kv_offload_load_time_total": 1.0,
                 "vllm:kv_offload_load_size_count": 4.0}, f"/metrics parsed: {pm}")
    tf = sv.transfer_figures({}, pm, 4.0)
    check(tf["load"]["bytes"] == 2e9 and tf["load"]["jobs"] == 4 and tf["prompt_tokens"]["external_kv_transfer"] == 38400,
          f"and read by serving.transfer_figures: {tf}")
    # The command line vllm serve gets.
    cfg = child_config({"spec": "kvoffload", "region": "64GiB", "rep": 0, "warmup": False}, a)
    cmd = server_command(cfg, 12345)
    check(cmd[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"] and cmd[4] == os.path.abspath(a.model)
          and "--skip-tokenizer-init" in cmd and cmd[cmd.index("--load-format") + 1] == "dummy"
          and cmd[cmd.index("--port") + 1] == "12345" and cmd[cmd.index("--max-model-len") + 1] == "8192",
          f"vllm serve's flags: {cmd}")
    kvt = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    check(kvt["kv_connector"] == "OffloadingConnector" and kvt["kv_connector_extra_config"]["cpu_bytes_to_use"] == 64 * GIB
          and kvt["kv_connector_extra_config"]["spec_name"] == sv.PROBE_SPEC, f"the KV transfer config: {kvt}")
    a2 = parse_args(["--no-pin-probe", "--entry", "api_server", "--kvo-extra", "kvo_pin_threads=8"])
    cmd = server_command(child_config({"spec": "kvoffload", "region": "1GiB", "rep": 0, "warmup": False}, a2), 1)
    kvt = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    check(cmd[2] == "vllm.entrypoints.openai.api_server" and cmd[3] == "--model"
          and kvt == {"spec_name": "KvoffloadSpec", "spec_module_path": "kvoffload.vllm", "cpu_bytes_to_use": GIB,
                      "kvo_pin_threads": 8}, f"--entry api_server, --no-pin-probe, --kvo-extra: {cmd[:4]} {kvt}")
    cmd = server_command(child_config({"spec": "none", "region": "-", "rep": 0, "warmup": True}, a), 1)
    check("--kv-transfer-config" not in cmd, "spec none: no KV transfer config")
    env = server_env(cfg)
    check(env.get("VLLM_SERVER_DEV_MODE") == "1" and env.get("VLLM_USE_FLASHINFER_SAMPLER") == "0"
          and env.get("HF_HUB_OFFLINE") == "1" and env["PYTHONPATH"].split(os.pathsep)[0] == HERE, "the server's environment")
    check(missing_modules(["json", "no_such_module_kvo"]) == ["no_such_module_kvo"]
          and "no_such_module_kvo <- no_such_module_kvo" in carry_message(["no_such_module_kvo"]), "missing modules named")

    # The verdict line: ok servers only, median over the servers.
    def fr(spec, med, ok=True):
        return {"spec": spec, "ok": ok, "passes": {PASSES[1]: {"ttft": {"median": med}}}}

    v = verdict([fr("none", 2.0), fr("none", 4.0), fr("kvoffload", 0.5), fr("kvoffload", 9.0, ok=False), fr("vllm", 3.5)])
    check(v == ["pass 2 TTFT median: kvoffload (host hits) 0.50 s vs none (recompute) 3.00 s: faster (6.00x)",
                "pass 2 TTFT median: vllm (host hits) 3.50 s vs none (recompute) 3.00 s: NOT faster (0.86x)"],
          f"verdict: {v}")
    check(verdict([fr("kvoffload", 0.5)]) == [], "no verdict without spec none")

    # The client against an in-process fake server.
    fv = FakeVllm("m", offload=True)
    srv, port = fv.start()
    try:
        prompts = ve.prompts_of(6, 40, seed=2, vocab=1000)
        dl = time.monotonic() + 30
        r1, w1, alive = run_pass("127.0.0.1", port, "m", prompts, 3, 8, 10, dl)
        p1 = pass_figures(r1, w1)
        check(alive == 0 and p1["ok_requests"] == 6 and all(len(r["tokens"]) == 8 for r in r1)
              and all(r["ttft_s"] >= FakeVllm.DELAYS["compute"] for r in r1) and p1["cached_tokens_sum"] == 0
              and p1["prompt_tokens_sum"] == 240, f"pass 1 computed, streamed: {p1}")
        check(all(r["first_event_s"] < FakeVllm.DELAYS["compute"] <= r["ttft_s"] and r["events"] == 1 + 8 + 2 for r in r1),
              "TTFT at the first event carrying a token, not the first event; an event per token, usage, [DONE]")
        check(fv.bodies[0] == {"model": "m", "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True,
                               "return_token_ids": True, "stream_options": {"include_usage": True}}, f"the body: {fv.bodies[0]}")
        check(fv.max_inflight == 3, f"3 requests in flight at once: {fv.max_inflight}")
        rs = reset_prefix_cache("127.0.0.1", port, "m", 3)
        check(rs == [False, True], f"reset retried after a refusal: {rs}")
        r2, w2, _ = run_pass("127.0.0.1", port, "m", prompts, 3, 8, 10, dl)
        p2 = pass_figures(r2, w2, [r["tokens"] for r in r1])
        check(p2["mismatches"] == 0 and p2["cached_tokens_sum"] == 6 * 39 and len(p2["ttft_s"]) == 6
              and all(r["ttft_s"] >= FakeVllm.DELAYS["host"] for r in r2), f"pass 2 from the host: {p2}")
        m = parse_prometheus(http_call("127.0.0.1", port, "GET", "/metrics")[1])
        check(m["vllm:prompt_tokens_by_source_total[source=external_kv_transfer]"] == 6 * 39
              and m["vllm:kv_offload_store_bytes_total"] == 240 * 131072, f"the fake's /metrics: {m}")
        bad = stream_completion("127.0.0.1", port, "other", [1, 2, 3], 8, 10)
        check(not bad["ok"] and bad["status"] == 400 and "does not exist" in bad["error"], f"HTTP 400 reported: {bad}")
        fv.mode = "stall"
        t = time.monotonic()
        st = stream_completion("127.0.0.1", port, "m", [1, 2, 3], 8, 0.5)
        check(not st["ok"] and "timed out" in st["error"] and time.monotonic() - t < 3, f"a stalled stream times out: {st}")
        t = time.monotonic()
        rr, _, _ = run_pass("127.0.0.1", port, "m", prompts, 2, 8, 5, time.monotonic() + 0.5)
        check(all(not r["ok"] for r in rr) and time.monotonic() - t < 4 and
              sum(1 for r in rr if r["error"].startswith("not sent")) >= 4, "a pass is bounded by its deadline")
        fv.mode = "ok"
        fv.dev_mode = False
        rs = reset_prefix_cache("127.0.0.1", port, "m", 2)
        check(rs == ["HTTP 404", "HTTP 404"], f"no dev mode: /reset_prefix_cache is 404: {rs}")
    finally:
        srv.shutdown()
        srv.server_close()
    dead = stream_completion("127.0.0.1", free_port(), "m", [1], 8, 2)
    check(not dead["ok"] and "ConnectionRefused" in dead["error"], f"no server: {dead['error']}")

    tmp = sv.fake_session("serve-http")
    try:
        seen = []
        hook = sv.ended_hook(check, seen, "server")

        base = ["--prompts", "6", "--prompt-tokens", "40", "--concurrency", "3", "--warmup-prompts", "2",
                "--kill-grace-s", "1", "--region", "1GiB", "--model", os.path.join(HERE, "llama3-8b-shape")]
        out = os.path.join(tmp, "a")
        args = parse_args(["--fake", "ok,ok,stubborn,linger", "--reps", "1", "--gpu-free-timeout-s", "8",
                           "--out-dir", out] + base)
        doc = run_all(args, hook)
        e = doc["engines"]
        check(len(e) == 4 and seen == [1, 2, 3, 4], f"every server in the JSON as soon as it ended: {seen}")
        check([r["label"] for r in e] == ["warm-up (none)", "none:- rep 1", "vllm:1GiB rep 1", "kvoffload:1GiB rep 1"],
              f"run order: {[r['label'] for r in e]}")
        check(all(r["ok"] for r in e), f"fake servers ok: {[(r['label'], r.get('error')) for r in e]}")
        check(all(r["ready_s"] >= 0.4 for r in e), "ready only once /health answers")
        check(e[0]["cleanup"]["term_sent"] and not e[0]["cleanup"]["killed"] and e[0]["cleanup"]["members_at_term"] == 2,
              f"the server and its core stopped by SIGTERM to the group: {e[0]['cleanup']}")
        check(e[2]["cleanup"]["killed"] and not e[2]["cleanup"]["members_left"],
              f"a server that ignores SIGTERM is killed: {e[2]['cleanup']}")
        check(e[3]["gpu_after"]["free"] and e[3]["gpu_after"]["waited_s"] >= 1,
              f"waits for memory held outside the group: {e[3]['gpu_after']}")
        n, k = e[1]["passes"], e[3]["passes"]
        check(n[PASSES[1]]["prompt_tokens"]["local_compute"] == 240 and n[PASSES[1]]["cached_tokens_sum"] == 0
              and n[PASSES[1]]["ttft"]["median"] >= FakeVllm.DELAYS["compute"], "spec none recomputes pass 2")
        check(k[PASSES[1]]["prompt_tokens"]["external_kv_transfer"] == 6 * 39 and k[PASSES[1]]["load"]["jobs"] == 6
              and k[PASSES[0]]["store"]["bytes"] == 240 * 131072 and k[PASSES[1]]["mismatches"] == 0
              and k[PASSES[2]]["prompt_tokens"]["local_cache_hit"] == 6 * 39, f"kvoffload: stores, host hits, GPU hits: {k}")
        check(len(k[PASSES[1]]["ttft_s"]) == 6 and all(x >= FakeVllm.DELAYS["host"] for x in k[PASSES[1]]["ttft_s"]),
              "per-request TTFTs kept")
        check(e[3]["pin_state"] == "pinned" and e[3]["pinned_s"] > 0 and e[2]["log_parsed"]["graph_capture_s"] == 9,
              "the pinning probe and vLLM's log lines read")
        md = open(os.path.join(out, "serve-http.md")).read()
        check("| none | - | 1/1 |" in md and "| kvoffload | 1GiB | 1/1 |" in md and "FAKE" in md
              and "warm-up" not in md and "kvoffload (host hits)" in md, f"the table\n{md}")
        check(sum(1 for _ in open(os.path.join(out, "serve-http.jsonl"))) == 4, "one JSONL line per server")
        check(sv.fake_gpu_used_mib() == 0, "no fake process left")

        # Failures: tokens that differ, no host hits, a missing wheel, a
        # stalled stream past the server's time limit.
        out = os.path.join(tmp, "b")
        args = parse_args(["--fake", "flip,nohost,nomodule", "--specs", "kvoffload,vllm,none", "--no-warmup",
                           "--gpu-free-timeout-s", "3", "--out-dir", out] + base)
        doc = run_all(args)
        e = {r["label"]: r for r in doc["engines"]}
        f, nh, nm = e["kvoffload:1GiB rep 1"], e["vllm:1GiB rep 1"], e["none:- rep 1"]
        check(not f["ok"] and "6 of 6 prompts' tokens differ" in f["error"], f"flip: {f.get('error')}")
        check(not nh["ok"] and "loaded nothing from the host" in nh["error"], f"nohost: {nh.get('error')}")
        check(not nm["ok"] and nm.get("missing_modules") == ["uvicorn"] and "uvicorn <- uvicorn" in nm["error"],
              f"a missing module named: {nm.get('error')}")
        check(sv.fake_gpu_used_mib() == 0, "no fake process left after failures")
        args = parse_args(["--fake", "pinfail", "--specs", "kvoffload", "--no-warmup", "--out-dir",
                           os.path.join(tmp, "b2")] + base)
        r = run_all(args)["engines"][0]
        check(not r["ok"] and "did not end pinned (probe: error)" in r["error"], f"pinning failed: {r.get('error')}")
        out = os.path.join(tmp, "c")
        args = parse_args(["--fake", "stall", "--specs", "none", "--no-warmup", "--timeout", "3",
                           "--request-timeout-s", "30", "--out-dir", out] + base)
        t = time.monotonic()
        r = run_all(args)["engines"][0]
        check(not r["ok"] and "timeout 3 s" in r["error"] and time.monotonic() - t < 3 + 8,
              f"a server past its time limit is stopped: {r.get('error')}")

        # Budget: servers of ~1.5 s, a budget of 2 s.
        out = os.path.join(tmp, "d")
        args = parse_args(["--fake", "ok", "--reps", "2", "--budget-s", "2", "--out-dir", out] + base)
        doc = run_all(args)
        n_run, n_skip = len(doc["engines"]), len(doc["skipped"])
        check(1 <= n_run < 7 and n_run + n_skip == 7 and "budget" in doc["skipped"][0]["why"],
              f"budget: {n_run} run, {n_skip} skipped")

        # A signal to the benchmark stops the running server's group and keeps the JSON.
        out = os.path.join(tmp, "e")
        cmd = [sys.executable, os.path.abspath(__file__), "--fake", "ok,stall", "--specs", "vllm", "--reps", "2",
               "--no-warmup", "--timeout", "60", "--request-timeout-s", "60", "--out-dir", out] + base
        doc, text = sv.sigterm_after_first(cmd, os.path.join(out, "serve-http"), 1.5)  # 1.5 s: the stalled server is up
        check(doc["interrupted"] and len(doc["engines"]) == 2 and "interrupted" in doc["engines"][1]["error"]
              and doc["engines"][0]["ok"], f"SIGTERM: the running server recorded as interrupted\n{text[-800:]}")
        check(sv.fake_gpu_used_mib() == 0, "SIGTERM: the running server's group stopped")
    finally:
        sv.reap_fakes()
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"serve_http self-test: ok ({len(checks)} checks)")
    return 0


# ------------------------------------------------------------ main


def build_parser():
    ap = sv.bench_parser(__doc__)
    ap.add_argument("--region", default="64GiB", help="host region (cpu_bytes_to_use) of the offloading specs")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=8192)
    sv.add_extra_args(ap, "kvo_pin_threads=8", "", "serving.py's probe of")
    ap.add_argument("--server-arg", action="append", default=None, metavar="ARG",
                    help="passed to vllm serve as is (repeat; e.g. --server-arg=--attention-backend=TRITON_ATTN)")
    ap.add_argument("--entry", choices=("serve", "api_server"), default="serve",
                    help="vllm.entrypoints.cli.main serve (vllm serve) or vllm.entrypoints.openai.api_server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--warmup-prompts", type=int, default=4)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--ready-timeout-s", type=float, default=300, help="for GET /health to answer 200")
    ap.add_argument("--request-timeout-s", type=float, default=300, help="each read of a request's response")
    ap.add_argument("--reset-tries", type=int, default=10)
    sv.add_plan_args(ap, "server", "seconds per server, start to end of pass 3")
    ap.add_argument("--gpu-free-timeout-s", type=float, default=60)
    ap.add_argument("--gpu-free-slack-mib", type=int, default=1024)
    ap.add_argument("--out-dir", default="serve-http-out")
    ap.add_argument("--self-test", action="store_true", help="check the parts that need no GPU, then exit")
    ap.add_argument("--fake", help=argparse.SUPPRESS)
    return ap


def parse_args(argv=None):
    return sv.parse_extras(build_parser().parse_args(argv), "serve_http")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--fake-server"]:
        return fake_server_main(argv[1:])
    args = parse_args(argv)
    if args.self_test:
        return self_test()
    if not args.fake:
        if not sv.importable(args.specs, "serve_http", "ci/gpu-serve-http"):
            return 2
        miss = missing_modules()
        if miss:
            say("serve_http: " + carry_message(miss))
            return 2
        if not os.path.exists(os.path.join(args.model, "config.json")):
            say(f"serve_http: no config.json in {args.model}")
            return 2
    doc = run_all(args)
    if any(r.get("missing_modules") for r in doc["engines"]):
        return 2
    return sv.exit_status(doc)


if __name__ == "__main__":
    sys.exit(main())
