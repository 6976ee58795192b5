"""The loom proofs: every model under model/ in release under --cfg loom;
and the same models under shuttle's random scheduler (--cfg shuttle), at
sizes past loom's bound (docs/PROOFS.md, "Past loom's bound: shuttle").

Positive models (P1-P8, F1, the node pool's PL1-PL6 and the simulated GPU's rules) must pass in every
interleaving explored; negative models (N1-N54 in 58 tests, test names
starting with "negative_", marked #[ignore]) must be caught: each runs in
its own child process (a loom deadlock aborts the process) and must fail
with the reason it declares. Prints one row a model and writes the table as markdown to
target/prove/table.md (and to docs/proof-table.md with --write-docs).

A negative is judged by the reason it actually failed with: the panic hook
of model/common/mod.rs records the first panic's message on a LOOM-FAILED
line, and the declared reason (LOOM-EXPECT) must be a substring of that
message. Nothing else in the output counts (the LOOM-EXPECT line itself
carries the declared reason). A negative that fails for another reason is
"NOT CAUGHT (failed for another reason: <actual>)".

    ci/prove                 # everything, --jobs N at a time (default: the
                             # cores this process may use), longest first;
                             # a model whose full bound does not fit ci/test's
                             # time runs at its lower ci/test bound
                             # (model/common's Bounds::ci; the table says so)
    ci/prove p2_             # only models whose test name or file contains "p2_"
    ci/prove --self-test     # the checker's own test: a negative failing for
                             # another reason than declared must be refused,
                             # N1 and N47 (loom's causality check) caught

Shuttle (built into target/shuttle; a model's output lines are SHUTTLE-*,
judged as loom's; its table is the second one of docs/proof-table.md):

    ci/prove --shuttle-quick [filter]   # every model, 300 random schedules
                                        # (--schedules N), then as many PCT
                                        # ones: ci/test
    ci/prove --shuttle [filter]         # every model, 20000 random + 20000
                                        # PCT (--schedules N)
    ci/prove --full [filter]            # the loom table with every model at
                                        # its full bound, then --shuttle
                                        # (docs/proof-table.md is this run's)
    ci/prove --shuttle-replay NAME SCHEDULE
                                        # model NAME (its test's name) on one
                                        # schedule: a file or the string shuttle
                                        # printed ("failing schedule:")

A shuttle run's seed is fresh each time and printed (the table's seed
column); KVO_SHUTTLE_SEED=s (read by the models, model/common/mod.rs) runs
the same schedules again. --timeout S bounds each model (default 600 s). A failing
schedule (a positive's failure, or the catch of a negative) is saved to
target/prove/shuttle/NAME.schedule and the command that replays it printed.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time

from kvo_ci import ROOT
from kvo_ci.command import Command

TARGET = os.path.join(ROOT, "target", "loom")
SHUTTLE_TARGET = os.path.join(ROOT, "target", "shuttle")
SHUTTLE_QUICK = 300  # ci/test's pass: 100 s on 2 cores with its build
SHUTTLE_FULL = 20000  # --full and --shuttle
# Each model runs its schedules under shuttle's uniformly random scheduler,
# then as many under PCT at this depth (model/common/mod.rs says why: the
# bugs the negatives plant need at most 3 ordering points; fixed, so that
# every table is comparable).
SHUTTLE_PCT = 3
SCHEDULES = os.path.join(ROOT, "target", "prove", "shuttle")
# docs/proof-table.md: the loom table, then this section (shuttle's table).
SHUTTLE_SECTION = "## Past loom's bound: shuttle"


class Opts:
    """The run's flags (set by main from the command line)."""
    # Seconds a model may run (--timeout).
    timeout = 600
    # --full: every loom model at its full preemption bound, then shuttle's
    # long pass; without it, the models with a ci/test bound run at that bound.
    full = False
    # Models run in parallel, one process each (loom is single-threaded): --jobs.
    jobs = max(1, len(os.sched_getaffinity(0)))


def previous_seconds(cells_per_row=8):
    """Seconds per model in the committed table (docs/proof-table.md), to
    start the longest first; empty when there is none. Loom's rows have 8
    cells, shuttle's 9 (the seconds last in both)."""
    try:
        text = open(os.path.join(ROOT, "docs", "proof-table.md")).read()
    except OSError:
        return {}
    secs = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == cells_per_row:
            try:
                secs[cells[1]] = float(cells[-1])
            except ValueError:
                pass
    return secs


def build(cfg="loom"):
    env = dict(os.environ, RUSTFLAGS=(os.environ.get("RUSTFLAGS", "") + f" --cfg {cfg}").strip())
    target = TARGET if cfg == "loom" else SHUTTLE_TARGET
    cmd = ["cargo", "test", "--release", "--target-dir", target, "--no-run", "--message-format=json", "--quiet"]
    for t in sorted(os.listdir(os.path.join(ROOT, "model"))):
        if t.endswith(".rs"):
            cmd += ["--test", "model_" + t[:-3]]
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        sys.exit(f"ci/prove: {cfg} build failed")
    exes = {}
    for line in p.stdout.splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
            exes[m["target"]["name"]] = (m["executable"], m["target"]["src_path"])
    return exes


def list_tests(exe, ignored):
    args = [exe, "--list", "--format", "terse"] + (["--ignored"] if ignored else [])
    out = subprocess.run(args, stdout=subprocess.PIPE, text=True).stdout
    return [l.split(":")[0] for l in out.splitlines() if l.endswith(": test")]


SELFTEST_PREFIX = "model_selftest_"  # test targets run only by --self-test


def kv(line):
    return dict(re.findall(r"(\w+)=(\S+)", line))


def unescape(s):
    """Undoes model/common/mod.rs one_line()."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r", "t": "\t"}.get(m.group(1), m.group(1)), s)


def fields(line):
    """key=value pairs of a marker line; `reason=` comes last and runs to the
    end of the line (escaped onto it), so it is split off first."""
    head, sep, reason = line.partition(" reason=")
    d = kv(head)
    if sep:
        d["reason"] = unescape(reason)
    return d


def marked(out, marker):
    """Fields of every line carrying `marker` (the test harness may print its
    own text before it on the same line)."""
    return [fields(l[l.index(marker):]) for l in out.splitlines() if marker in l]


def short(text, start=None, limit=100):
    """First line of a panic message, at most `limit` characters; with
    `start` (the end of the declared reason in it), cut at the first ': ',
    '; ' or ' = ' after it (assertion details, loom's thread list)."""
    text = text.split("\n")[0]
    cuts = [i for i in (text.find(s, start) for s in (": ", "; ", " = ")) if i >= 0] if start is not None else []
    if cuts:
        text = text[:min(cuts)]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def where(failed):
    """file:line of the first panic, the file without its directories."""
    at = failed.get("at", "?").replace("%20", " ")
    parts = at.rsplit(":", 2)
    return f"{os.path.basename(parts[0])}:{parts[1]}" if len(parts) == 3 else at


def judge_negative(out, rc, mark="LOOM"):
    """(ok, result) of a negative model: ok only when it failed and the first
    recorded failure (LOOM-FAILED, or SHUTTLE-FAILED under shuttle) contains
    the declared reason."""
    exp, failed = marked(out, f"{mark}-EXPECT"), marked(out, f"{mark}-FAILED")
    want = exp[0].get("reason") if exp else None
    if rc is None:
        return False, "NOT CAUGHT (timeout)"
    if want is None:
        return False, f"NOT CAUGHT (no {mark}-EXPECT line: not a negative model)"
    if rc == 0:
        return False, "NOT CAUGHT (the model passed)"
    if not failed or "reason" not in failed[0]:
        return False, f"NOT CAUGHT (exit status {rc} without a recorded panic)"
    actual = failed[0]["reason"]
    # A negative may declare several reasons, separated by " || " (a bug
    # that shows in more than one way): any of them will do.
    found = [(actual.find(w), w) for w in want.split(" || ") if actual.find(w) >= 0]
    i, want = found[0] if found else (-1, want)
    if i < 0:
        return False, f"NOT CAUGHT (failed for another reason: {short(actual)} at {where(failed[0])})"
    return True, f"caught: {short(actual, i + len(want))} at {where(failed[0])}"


def run_one(exe, name, negative, env=None):
    args = [exe, "--exact", name, "--nocapture", "--test-threads=1"] + (["--ignored"] if negative else [])
    t0 = time.time()
    try:
        p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=Opts.timeout,
                           env=dict(os.environ, **(env or {})))
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), None
    return out, rc, time.time() - t0


def self_test(exes):
    """The checker on three negatives: one that fails for another reason than
    it declares (must be refused), N1 (must be caught) and N47, whose
    failure is loom's own causality check, raised inside loom (must be
    recorded and caught)."""
    cases = [("model_selftest_wrong_reason", "selftest_wrong_reason_must_not_be_caught", False),
             ("model_p1_capture_isolation", "negative_n1_upstream_background_pin_without_window", True),
             ("model_pl1_visible_complete", "negative_n47_pl1_publish_relaxed", True)]
    bad = 0
    for target, name, must_catch in cases:
        out, rc, secs = run_one(exes[target][0], name, True)
        ok, result = judge_negative(out, rc)
        good = ok if must_catch else (not ok and result.startswith("NOT CAUGHT (failed for another reason: "))
        want = "caught" if must_catch else "NOT CAUGHT, another reason"
        print(f"{name:<58} {result}  [required: {want}: {'yes' if good else 'NO'}] {secs:.1f}s", flush=True)
        if not good:
            bad += 1
            sys.stdout.write(f"--- output of {name} ---\n{out[-4000:]}\n")
    # The ci/test bound: a model with one (Bounds::ci) must explore it, and
    # no more, in ci/test's run, and report its full bound beside it.
    name = "p1_hook_a_job_beside_a_hooked_capture_never_disturbs_it"
    out, rc, secs = run_one(exes["model_p1_hook"][0], name, False, {"KVO_PROVE_BOUND": "ci"})
    rep = (marked(out, "LOOM-REPORT") or [{}])[0]
    good = rc == 0 and rep.get("ci") not in (None, "-") and rep.get("preemptions") == rep.get("ci") != rep.get("full")
    print(f"{name:<58} explored {rep.get('preemptions', '?')} preemptions (ci {rep.get('ci', '?')}, "
          f"full {rep.get('full', '?')})  [required: the ci/test bound, below the full one: {'yes' if good else 'NO'}] {secs:.1f}s")
    if not good:
        bad += 1
        sys.stdout.write(f"--- output of {name} ---\n{out[-4000:]}\n")
    if bad:
        sys.exit(f"ci/prove --self-test: {bad} of {len(cases) + 1} cases judged wrongly")
    print(f"ci/prove --self-test: the checker refused the wrong reason, caught N1 and N47 (loom's causality "
          f"check) and ran a model at its ci/test bound ({len(cases) + 1} of {len(cases) + 1})")


def models(exes, only):
    """Every model to run, in the table's order (file, positives, negatives):
    (exe, file, test name, negative)."""
    todo = []
    for target, (exe, src) in sorted(exes.items()):
        if target.startswith(SELFTEST_PREFIX):
            continue
        rel = os.path.relpath(src, ROOT)
        for negative in (False, True):
            for name in list_tests(exe, negative):
                if negative != name.startswith("negative_"):
                    continue
                if only and only not in name and only not in rel:
                    continue
                todo.append((exe, rel, name, negative))
    return todo


def run_all(todo, past, env, judge):
    """Runs the models of `todo`, Opts.jobs at a time, the longest first (by the
    seconds of the committed table, `past`) so the last to start are short
    ones; `judge(i, out, rc, secs)` makes a table row and says whether it is
    as required. Returns (rows, number not as required)."""
    order = sorted(range(len(todo)), key=lambda i: -past.get(todo[i][2], 1e9))
    rows, bad = [None] * len(todo), 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=Opts.jobs) as pool:
        futures = {pool.submit(run_one, todo[i][0], todo[i][2], todo[i][3], env): i for i in order}
        for fut in concurrent.futures.as_completed(futures):
            i = futures[fut]
            out, rc, secs = fut.result()
            ok, rows[i] = judge(i, out, rc, secs)
            if not ok:
                bad += 1
                sys.stdout.write(f"--- output of {todo[i][2]} ---\n{out[-4000:]}\n")
            print(f"{rows[i][0]:<4} {todo[i][2]:<58} {rows[i][-2]:<40} {secs:6.1f}s", flush=True)
    return rows, bad


def markdown(head, rows):
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return md + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]


def print_table(head, rows):
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    print()
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
    for r in rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)))


def write_section(path, shuttle, text):
    """Writes loom's table (the file's head) or shuttle's (its section at the
    end) into `path`, keeping the other one as it was."""
    try:
        old = open(path).read()
    except OSError:
        old = ""
    at = old.find("\n" + SHUTTLE_SECTION)
    loom_part, shuttle_part = (old[:at], old[at + 1:]) if at >= 0 else (old, "")
    if shuttle:
        shuttle_part = text
    else:
        loom_part = text
    with open(path, "w") as f:
        f.write(loom_part.rstrip("\n") + "\n" + ("\n" + shuttle_part.rstrip("\n") + "\n" if shuttle_part else ""))


def bound_cell(info):
    """The table's preemption bound: the one explored, and for a model with
    a lower ci/test bound (model/common's `Bounds::ci`) the other one."""
    p, full, ci = info.get("preemptions", "?"), info.get("full"), info.get("ci", "-")
    if full is not None and p != full:
        return f"{p} (ci/test; full: {full})"
    if ci not in ("-", None):
        return f"{p} (ci/test: {ci})"
    return p


def prove_loom(only, write_docs, t_all, selftest=False):
    exes = build("loom")
    if selftest:
        self_test(exes)
        return 0
    todo = models(exes, only)
    print(f"ci/prove: {len(todo)} models, {Opts.jobs} at a time", flush=True)

    def judge(i, out, rc, secs):
        exe, rel, name, negative = todo[i]
        rep, exp, caught = marked(out, "LOOM-REPORT"), marked(out, "LOOM-EXPECT"), marked(out, "LOOM-CAUGHT")
        info = (rep or exp or [{}])[0]
        iters = info.get("iterations") or (caught[0].get("iterations") if caught else "-")
        if not negative:
            ok = rc == 0 and bool(rep)
            result = "verified" if ok else ("TIMEOUT" if rc is None else "FAILED")
        else:
            ok, result = judge_negative(out, rc)
        return ok, [info.get("property", "?"), name, rel, info.get("threads", "?"),
                    bound_cell(info), str(iters), result, f"{secs:.1f}"]

    # ci/test's run explores the lower bound of the models that have one
    # (model/common's Bounds::ci); --full explores every model's full bound.
    depth = "full" if Opts.full else "ci"
    rows, bad = run_all(todo, previous_seconds(8), {"KVO_PROVE_BOUND": depth}, judge)
    head = ["property", "model", "file", "threads", "preemption bound", "interleavings", "result", "seconds"]
    total = time.time() - t_all
    md = markdown(head, rows)
    md.append(f"\n{len(rows)} models, {bad} not as required, {total:.0f} s in all (build included, {Opts.jobs} at a time), "
              + ("every model at its full bound (ci/prove --full)." if Opts.full else
                 "at ci/test's bounds (ci/prove: a model marked \"ci/test; full: k\" ran below its full bound k)."))
    os.makedirs(os.path.join(ROOT, "target", "prove"), exist_ok=True)
    for path in [os.path.join(ROOT, "target", "prove", "table.md")] + ([os.path.join(ROOT, "docs", "proof-table.md")] if write_docs else []):
        write_section(path, False, "# Proof table (ci/prove)\n\n" + "\n".join(md) + "\n")
    print_table(head, rows)
    print(f"\nci/prove: {len(rows) - bad} passed, {bad} failed ({total:.0f} s); table in target/prove/table.md")
    if not rows:
        sys.exit("ci/prove: no model ran")
    return bad


def failing_schedule(out):
    """The schedule shuttle printed after the first failure ('failing
    schedule:' then the string between two lines of one double quote, which
    it may wrap), or None."""
    m = re.search(r'failing schedule:\n"\n(.*?)\n"', out, re.S)
    return m.group(1).replace("\n", "").strip() if m else None


def prove_shuttle(only, schedules, write_docs, t_all):
    exes = build("shuttle")
    todo = models(exes, only)
    print(f"ci/prove: shuttle, {len(todo)} models, {schedules} schedules each, {Opts.jobs} at a time", flush=True)
    os.makedirs(SCHEDULES, exist_ok=True)
    replays = []

    def judge(i, out, rc, secs):
        exe, rel, name, negative = todo[i]
        rep, exp, start = marked(out, "SHUTTLE-REPORT"), marked(out, "SHUTTLE-EXPECT"), marked(out, "SHUTTLE-START")
        caught = marked(out, "SHUTTLE-CAUGHT")
        info = (rep or exp or [{}])[0]
        # The seed, and for a catch the scheduler that made it (the last started).
        seed = (start[0].get("seed") if start else None) or "?"
        if not negative:
            ok = rc == 0 and bool(rep)
            result = "passed" if ok else ("TIMEOUT" if rc is None else "FAILED")
            ran = info.get("schedules", "-") if ok else (caught[0].get("iterations", "?") if caught else "?")
        else:
            ok, result = judge_negative(out, rc, "SHUTTLE")
            ran = caught[0].get("iterations", "?") if caught else str(2 * schedules)
            if caught and start:
                ran += f" ({start[-1].get('scheduler', '?')})"
        sched = failing_schedule(out)
        if sched:
            path = os.path.join(SCHEDULES, name + ".schedule")
            with open(path, "w") as f:
                f.write(sched + "\n")
            replays.append(f"ci/prove --shuttle-replay {name} {os.path.relpath(path, ROOT)}")
        return ok, [info.get("property", "?"), name, rel, info.get("threads", "-"), info.get("steps", "-"),
                    str(ran), seed, result, f"{secs:.1f}"]

    env = {"KVO_SHUTTLE_ITERATIONS": str(schedules), "KVO_SHUTTLE_PCT": str(SHUTTLE_PCT)}
    rows, bad = run_all(todo, previous_seconds(9), env, judge)
    head = ["property", "model", "file", "threads", "steps", "schedules", "seed", "result", "seconds"]
    total = time.time() - t_all
    md = [SHUTTLE_SECTION, "",
          "The same models under shuttle's random scheduler at the sizes `common::sized` gives them "
          "(docs/PROOFS.md), each on `schedules` uniformly random schedules then as many PCT ones "
          f"(depth {SHUTTLE_PCT}); threads and steps are the most one schedule had; a negative's "
          "schedules are those run until it was caught (and the scheduler that caught it).", ""] + markdown(head, rows)
    md.append(f"\n{len(rows)} models, {bad} not as required, {schedules} random and {schedules} PCT schedules a model, "
              f"{total:.0f} s in all (build included, {Opts.jobs} at a time).")
    os.makedirs(os.path.join(ROOT, "target", "prove"), exist_ok=True)
    for path in [os.path.join(ROOT, "target", "prove", "shuttle-table.md")] + ([os.path.join(ROOT, "docs", "proof-table.md")] if write_docs else []):
        write_section(path, True, "\n".join(md) + "\n")
    print_table(head, rows)
    if replays:
        print("\nfailing schedules (a negative's catch, or a failure), each replayed by:")
        for r in replays:
            print("  " + r)
    print(f"\nci/prove: shuttle: {len(rows) - bad} passed, {bad} failed ({total:.0f} s); table in target/prove/shuttle-table.md")
    if not rows:
        sys.exit("ci/prove: no model ran")
    return bad


def replay(name, schedule):
    """Runs model `name` under shuttle on one schedule (a file or the string)."""
    exes = build("shuttle")
    hits = [(exe, rel, n, neg) for (exe, rel, n, neg) in models(exes, None) if n == name]
    if not hits:
        sys.exit(f"ci/prove: no model named {name}")
    exe, rel, name, negative = hits[0]
    if os.path.isfile(schedule):
        schedule = os.path.abspath(schedule)
    out, rc, secs = run_one(exe, name, negative, {"KVO_SHUTTLE_REPLAY": schedule})
    sys.stdout.write(out)
    failed = marked(out, "SHUTTLE-FAILED")
    what = f"failed: {short(failed[0].get('reason', '?'))} at {where(failed[0])}" if failed else (
        "passed" if rc == 0 else f"exit status {rc}")
    print(f"\nci/prove: replayed {name} ({rel}) on one schedule: {what} ({secs:.1f} s)")
    return 0


def main(ns: argparse.Namespace) -> int:
    Opts.timeout, Opts.full = ns.timeout, ns.full
    if ns.jobs:
        Opts.jobs = ns.jobs
    if "KVO_PREEMPTIONS_MAX" in os.environ:
        # ci/mutants' screening cap: the proofs run at each model's own bound.
        sys.exit("ci/prove: KVO_PREEMPTIONS_MAX is set; unset it (the models' bounds are what ci/prove proves)")
    if any(k in os.environ for k in ("KVO_SHUTTLE_REPLAY", "KVO_SHUTTLE_ITERATIONS", "KVO_SHUTTLE_PCT")):
        sys.exit("ci/prove: KVO_SHUTTLE_REPLAY / _ITERATIONS / _PCT are set; unset them (ci/prove sets them per run)")
    if ns.shuttle_replay:
        return replay(*ns.shuttle_replay)
    only = ns.filter
    t_all = time.time()
    bad = 0
    if not ns.shuttle and not ns.shuttle_quick:
        bad += prove_loom(only, ns.write_docs, t_all, ns.self_test)
        if ns.self_test:
            return 0
    if ns.shuttle_quick:
        bad += prove_shuttle(only, ns.schedules or SHUTTLE_QUICK, ns.write_docs, time.time())
    elif ns.shuttle or ns.full:
        bad += prove_shuttle(only, ns.schedules or SHUTTLE_FULL, ns.write_docs, time.time())
    return 1 if bad else 0


def configure(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("filter", nargs="?", help="only models whose test name or file contains this")
    p.add_argument("--self-test", action="store_true", help="the checker's own test")
    p.add_argument("--full", action="store_true", help="every loom model at its full bound, then --shuttle")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--shuttle", action="store_true", help=f"shuttle only, {SHUTTLE_FULL} schedules a scheduler")
    mode.add_argument("--shuttle-quick", action="store_true",
                      help=f"shuttle only, {SHUTTLE_QUICK} schedules a scheduler (ci/test)")
    mode.add_argument("--shuttle-replay", nargs=2, metavar=("NAME", "SCHEDULE"),
                      help="model NAME under shuttle on one schedule (a file or the printed string)")
    p.add_argument("--write-docs", action="store_true", help="write the table into docs/proof-table.md too")
    p.add_argument("--jobs", type=int, default=0, help="models at a time (default: the cores this process may use)")
    p.add_argument("--timeout", type=int, default=Opts.timeout, help="seconds a model may run (default %(default)s)")
    p.add_argument("--schedules", type=int, default=0,
                   help=f"shuttle's random (and PCT) schedules a model (default {SHUTTLE_QUICK} quick, "
                        f"{SHUTTLE_FULL} otherwise)")


COMMANDS = [Command("prove", "ci/prove: the loom proofs and shuttle's passes, every negative caught for its reason",
                    main, configure)]
