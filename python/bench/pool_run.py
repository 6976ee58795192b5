#!/usr/bin/env python3
"""The node pool on the GPU (issue 46, Deliver 5): vLLM engines of the
serving benchmark's 8B shape (``llama3-8b-shape/``, dummy weights, the
engine core in its own process) sharing one kvoffload pool
(``kvo_pool``), each with a share of the GPU's memory.

Phases, each engine a child process in a session of its own whose group is
ended after it (serving.py's ``end_group``):

1. **A** starts on a fresh pool (its ready time: creating and pinning the
   pool), computes ``--prompts`` prompts (pass ``A computes``: the pool
   stores them) and stays up.
2. **B** starts beside A on the same pool (ready time on a pool that
   exists), runs the same prompts (``B over A's prompts``: host hits from
   the blocks A stored, served by B's own copies) and then as many prompts
   never seen (``B recomputes``: the recompute baseline in the same
   engine). B's tokens must equal A's.
3. A and B end. **A again** starts on the pool they left (ready time on an
   existing pool, its pages in tmpfs), runs A's prompts
   (``restart over old prompts``: host hits) and new ones
   (``restart recomputes``).
4. The pool is listed and removed (``kvoffload pool ls``, ``pool rm``).

Results: ``pool.json`` and ``pool.md`` (one table: each engine's ready
time, each pass's seconds, prompt tokens by source, load/store bytes) in
``--out-dir``; exit 0 when every engine ran, tokens matched and the
host-hit passes loaded from the pool, 1 otherwise, 2 without vLLM.

    PYTHONPATH=<site>:<kvoffload> python3 python/bench/pool_run.py \\
        --region 64GiB --out-dir gpu-out/pool
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import serving as sv  # noqa: E402
import vllm_engine as ve  # noqa: E402

say = ve.say
TAG = "POOLRUN"


def digest(outs):
    return [hashlib.sha256(json.dumps(o).encode()).hexdigest()[:16] for o in outs]


# ------------------------------------------------------------ one engine (child)


def child(cfg):
    """One engine: ready, then each pass of ``cfg['passes']`` (name, prompt
    seed); between passes the GPU prefix cache is reset so every pass reads
    the host or recomputes. With ``hold_file`` it then waits (bounded) until
    that file exists before it shuts down."""
    os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_COLOR", "0")
    res = {"engine": cfg["engine"], "passes": {}}

    def emit(event):
        print(f"{TAG} {json.dumps({'event': event, **res})}", flush=True)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    res["vllm"] = vllm.__version__
    extra = {
        "spec_name": "KvoffloadSpec",
        "spec_module_path": "kvoffload.vllm",
        "cpu_bytes_to_use": ve.parse_size(cfg["region"]),
        "kvo_pool": cfg["pool"],
        **cfg.get("kvo_extra", {}),
    }
    res["kv_connector_extra_config"] = extra
    kvt = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    t0 = time.monotonic()
    llm = LLM(
        model=cfg["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        gpu_memory_utilization=cfg["gpu_memory_utilization"],
        max_model_len=cfg["max_model_len"],
        enable_prefix_caching=True,
        kv_transfer_config=kvt,
        disable_log_stats=False,
        seed=0,
    )
    res["ready_s"] = time.monotonic() - t0
    emit("ready")
    with open(os.path.join(cfg["model"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    sp = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0.0, ignore_eos=True)
    tiny = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    short = ve.prompts_of(1, 8, seed=4, vocab=vocab)[0]

    def gen(ps, params=sp):
        t = time.monotonic()
        out = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in out], time.monotonic() - t

    def reset():
        for _ in range(5):
            if llm.reset_prefix_cache():
                return True
            gen([short], tiny)
        return False

    _, snap = sv.metrics_snapshot(llm)
    for name, seed in cfg["passes"]:
        res["resets_ok"] = reset() and res.get("resets_ok", True)
        ps = ve.prompts_of(cfg["prompts"], cfg["prompt_tokens"], seed=seed, vocab=vocab)
        outs, secs = gen(ps)
        gen([short], tiny)  # transfers finished after the pass are counted in it
        _, after = sv.metrics_snapshot(llm)
        res["passes"][name] = {"seed": seed, "seconds": secs, "digests": digest(outs),
                               **sv.transfer_figures(snap, after, secs)}
        snap = after
        emit(f"pass {name}")
    res["done_s"] = time.monotonic() - t0
    emit("done")
    hold = cfg.get("hold_file")
    if hold:
        end = time.monotonic() + cfg.get("hold_s", 600)
        while not os.path.exists(hold) and time.monotonic() < end:
            time.sleep(0.2)  # a poll of a file another process writes, bounded
    sv.shutdown(llm, cfg.get("shutdown_timeout_s", 30))


# ------------------------------------------------------------ the phases (parent)


def start(cfg, log_path):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)]
    # Engines on one pool must hash blocks alike: vLLM 0.26 draws NONE_HASH
    # at random unless PYTHONHASHSEED is set (kvoffload refuses the pool
    # then), so every engine of the run gets the same seed.
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED=os.environ.get("PYTHONHASHSEED", "0"))
    env["PYTHONPATH"] = HERE + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return proc, log


def events(log_path):
    out = []
    with open(log_path, errors="replace") as f:
        for line in f:
            if line.startswith(TAG + " "):
                try:
                    out.append(json.loads(line[len(TAG) + 1:]))
                except json.JSONDecodeError:
                    pass
    return out


def wait_event(proc, log_path, event, deadline):
    """Polls the child's log until it reports ``event``; None if it exits or
    the deadline passes first."""
    while time.monotonic() < deadline:
        for ev in events(log_path):
            if ev.get("event") == event:
                return ev
        if proc.poll() is not None:
            return None
        time.sleep(0.5)
    return None


def last_result(log_path):
    evs = events(log_path)
    return evs[-1] if evs else {}


def pool_cmd(args, *words):
    try:
        p = subprocess.run([args.kvoffload_bin, "pool", *words], capture_output=True, text=True, timeout=120)
        return {"cmd": " ".join(["kvoffload", "pool", *words]), "rc": p.returncode, "out": p.stdout[-4000:],
                "err": p.stderr[-2000:]}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"cmd": " ".join(["kvoffload", "pool", *words]), "error": repr(e)}


def run(args):
    os.makedirs(args.out_dir, exist_ok=True)
    t_end = time.monotonic() + args.budget_s
    base = {
        "model": os.path.abspath(args.model), "region": args.region, "pool": args.pool_name,
        "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
        "kvo_extra": args.kvo_extra,
    }
    doc = {"args": vars(args), "device": sv.device_name(), "engines": {}, "problems": []}
    hold = os.path.join(args.out_dir, "release-a")
    if os.path.exists(hold):
        os.unlink(hold)
    doc["pool_before"] = pool_cmd(args, "ls")
    # 1. A on a fresh pool, kept up.
    a_cfg = dict(base, engine="A", passes=[["A computes", 2]], hold_file=hold)
    a, a_log = start(a_cfg, os.path.join(args.out_dir, "A.log"))
    b = None
    try:
        if wait_event(a, a_log.name, "done", t_end) is None:
            doc["problems"].append("A did not finish its pass")
        else:
            # 2. B beside A.
            b_cfg = dict(base, engine="B", passes=[["B over A's prompts", 2], ["B recomputes", 5]])
            b, b_log = start(b_cfg, os.path.join(args.out_dir, "B.log"))
            if wait_event(b, b_log.name, "done", t_end) is None:
                doc["problems"].append("B did not finish its passes")
    finally:
        with open(hold, "w"):
            pass
        doc["cleanup_A"] = sv.end_group(a, args.kill_grace_s)
        if b is not None:
            doc["cleanup_B"] = sv.end_group(b, args.kill_grace_s)
    doc["engines"]["A"] = last_result(os.path.join(args.out_dir, "A.log"))
    if b is not None:
        doc["engines"]["B"] = last_result(os.path.join(args.out_dir, "B.log"))
    doc["pool_between"] = pool_cmd(args, "ls")
    # 3. A again, on the pool left behind.
    if time.monotonic() < t_end:
        r_cfg = dict(base, engine="A again", passes=[["restart over old prompts", 2], ["restart recomputes", 7]])
        r, _ = start(r_cfg, os.path.join(args.out_dir, "restart.log"))
        try:
            if wait_event(r, os.path.join(args.out_dir, "restart.log"), "done", t_end) is None:
                doc["problems"].append("the restarted engine did not finish its passes")
        finally:
            doc["cleanup_restart"] = sv.end_group(r, args.kill_grace_s)
        doc["engines"]["A again"] = last_result(os.path.join(args.out_dir, "restart.log"))
    else:
        doc["problems"].append("no time left for the restart")
    # 4. The pool listed and removed.
    doc["pool_after"] = pool_cmd(args, "ls")
    if not args.keep_pool:
        doc["pool_rm"] = pool_cmd(args, "rm", args.pool_name)
    judge(doc)
    with open(os.path.join(args.out_dir, "pool.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out_dir, "pool.md"), "w") as f:
        f.write(markdown(doc))
    say(markdown(doc))
    return 0 if not doc["problems"] else 1


def judge(doc):
    eng = doc["engines"]
    ref = ((eng.get("A") or {}).get("passes") or {}).get("A computes", {}).get("digests")
    for name, passname in (("B", "B over A's prompts"), ("A again", "restart over old prompts")):
        p = ((eng.get(name) or {}).get("passes") or {}).get(passname)
        if not p:
            continue
        if ref and p.get("digests") != ref:
            bad = sum(1 for x, y in zip(p["digests"], ref) if x != y)
            doc["problems"].append(f"{name}: {bad} of {len(ref)} prompts' tokens differ from A's")
        ext = (p.get("prompt_tokens") or {}).get("external_kv_transfer")
        if not ext:
            doc["problems"].append(f"{name}: {passname!r} loaded nothing from the pool (external tokens {ext})")


def markdown(doc):
    rows = ["| engine | ready s | pass | seconds | tokens computed / GPU hit / from pool | loaded GB | stored GB |",
            "|---|---|---|---|---|---|---|"]
    for name, r in doc["engines"].items():
        for pname, p in (r.get("passes") or {}).items():
            tok = p.get("prompt_tokens") or {}
            gb = lambda d: f"{(p.get(d) or {}).get('bytes') / 1e9:.1f}" if (p.get(d) or {}).get("bytes") else "-"  # noqa: E731
            rows.append(f"| {name} | {r.get('ready_s', float('nan')):.1f} | {pname} | {p['seconds']:.2f} | "
                        f"{tok.get('local_compute')} / {tok.get('local_cache_hit')} / {tok.get('external_kv_transfer')} | "
                        f"{gb('load')} | {gb('store')} |")
    out = [f"# kvoffload node pool on {doc.get('device')}", "", *rows, ""]
    if doc["problems"]:
        out += ["Problems:", *[f"- {p}" for p in doc["problems"]], ""]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=os.path.join(HERE, "llama3-8b-shape"))
    ap.add_argument("--region", default="64GiB", help="the pool's size (cpu_bytes_to_use)")
    ap.add_argument("--pool-name", default=f"bench-{os.getpid()}")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.42,
                    help="each engine's share (two run at once)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kvo-extra", action="append", default=[], metavar="KEY=VALUE",
                    help="more kv_connector_extra_config for every engine")
    ap.add_argument("--kill-grace-s", type=float, default=20)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--keep-pool", action="store_true", help="leave the pool for a later run")
    ap.add_argument("--out-dir", default="pool-out")
    ap.add_argument("--kvoffload-bin", default="kvoffload", help="the CLI, for `pool ls` and `pool rm`")
    args = ap.parse_args(argv)
    args.kvo_extra = sv.parse_extra(args.kvo_extra)
    if args.child:
        child(json.loads(args.child))
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        say("pool_run: vLLM is not importable here (set PYTHONPATH to a vLLM site)")
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
