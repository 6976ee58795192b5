"""What each loom model reaches: line coverage of a model build (docs/PROOFS.md,
"What each model reaches").

Builds the positive models (model/*.rs but model/selftest_*) with
RUSTFLAGS="--cfg loom -C instrument-coverage" into target/reach, runs each at
preemption bound --bound K (default 1, through KVO_PREEMPTIONS_MAX; the
#[ignore] negatives are not run), and prints per model the lines of FILES it
reaches, their union, and the functions of FILES no model enters. Reach at
bound k is a lower bound of the reach at the model's full bound.

    ci/model-reach                   # print the table (markdown)
    ci/model-reach --write           # and replace it in docs/PROOFS.md (between the markers)
    ci/model-reach --only 'p7_'      # the models whose name matches this regex
    ci/model-reach --file src/x.rs   # other files than FILES (repeatable)
    ci/model-reach --bound 2         # another preemption bound (--timeout S: a model's limit, 600)

Needs llvm-profdata and llvm-cov: `rustup component add llvm-tools-preview`.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import re
import subprocess
import sys

from kvo_ci import ROOT
from kvo_ci.command import Command

TARGET = os.path.join(ROOT, "target", "reach")
DOC = os.path.join(ROOT, "docs", "PROOFS.md")
BEGIN, END = "<!-- model-reach:begin -->", "<!-- model-reach:end -->"
# The coordinator is a directory of files (one per party): every file of it.
COORDINATOR = sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "src", "protocol", "coordinator", "*.rs")))
FILES = COORDINATOR + ["src/offloader/hook.rs", "src/protocol/agreement.rs",
                       "src/offloader/keyed.rs", "src/manager/store.rs"]


class Opts:
    """The run's flags (set by main from the command line)."""
    bound = "1"
    timeout = 600
# A line on why no model reaches a function (by its name in the list; checked at bound 1 and 2).
NOTES = {
    "CaptureWindow::chunks_waited": "accessor; no model reads it (tests/protocol.rs, the CLI's report do)",
    "PinHold::fmt": "debug formatting",
    "Coordinator::forged_gate": "loom/shuttle builds only, for negative N8",
    "Coordinator::policy": "accessor; no model reads it",
    "refusal_error": "the hook's flush when a deferred job is refused at its submission: no model makes it fail",
    "CaptureHook::fmt": "debug formatting",
    "CaptureHook::depth": "p6_interruptible calls it after an interrupted begin: reached at bound 2, not 1",
    "LocalSlots::store": "`agree` settles by compare-exchange only; negative N32 and unit tests store",
    "KeyedOffloader::new": "the models (and tests/offloader.rs) construct through `with_allocated_tensors`; "
    "the Python front uses it",
    "KeyedOffloader::lookup": "no model looks keys up (tests/offloader_keyed.rs, Python front)",
    "BlockManager::prepare_store": "the keyed layer calls `prepare_store_undoable` (reached); manager tests only",
}


def die(msg):
    sys.exit(f"ci/model-reach: {msg}")


def tool(name):
    sysroot = subprocess.run(["rustc", "--print", "sysroot"], capture_output=True, text=True).stdout.strip()
    found = glob.glob(os.path.join(sysroot, "lib", "rustlib", "*", "bin", name))
    if not found:
        die(f"llvm-tools missing ({name} not in {sysroot}/lib/rustlib/*/bin): "
            "install them with `rustup component add llvm-tools-preview`")
    return found[0]


def build(only):
    models = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "model"))
                    if f.endswith(".rs") and not f.startswith("selftest_") and re.search(only, f[:-3]))
    if not models:
        die(f"no model matches {only!r}")
    # The instrumented build scripts and proc macros write profiles when they run: into target/reach, not ROOT.
    env = dict(os.environ, RUSTFLAGS="--cfg loom -C instrument-coverage",
               LLVM_PROFILE_FILE=os.path.join(TARGET, "build-prof", "%m-%p.profraw"))
    cmd = ["cargo", "test", "--release", "--target-dir", TARGET, "--no-run", "--message-format=json", "--quiet"]
    p = subprocess.run(cmd + [x for m in models for x in ("--test", "model_" + m)], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        die("the instrumented model build failed")
    arts = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    exes = {a["target"]["name"]: a["executable"] for a in arts
            if a.get("executable") and a["target"]["kind"] == ["test"]}
    return {m: exes["model_" + m] for m in models}


def run(model, exe, profdata):
    prof = os.path.join(TARGET, "prof", model)
    [os.remove(f) for f in glob.glob(prof + "-*.profraw")]
    env = dict(os.environ, KVO_PREEMPTIONS_MAX=Opts.bound, LLVM_PROFILE_FILE=prof + "-%p.profraw")
    try:
        p = subprocess.run([exe, "--test-threads=1"], env=env, capture_output=True, text=True, timeout=Opts.timeout)
    except subprocess.TimeoutExpired:
        die(f"{model} ran past {Opts.timeout}s at bound {Opts.bound}: lower --bound")
    if p.returncode != 0:
        die(f"{model} failed at bound {Opts.bound}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    raw = glob.glob(prof + "-*.profraw")
    subprocess.run([profdata, "merge", "-sparse", "-o", prof + ".profdata"] + raw, check=True)
    return prof + ".profdata"


def lcov(cov, profile, exe, files):
    """{file: ({line: count}, {fn line: count})} of one model, from llvm-cov's lcov export."""
    out = subprocess.run([cov, "export", "-format=lcov", "-instr-profile", profile, exe]
                         + [os.path.join(ROOT, f) for f in files], capture_output=True, text=True, check=True).stdout
    got, fline = {}, {}
    for rec in out.splitlines():
        key, _, val = rec.partition(":")
        if key == "SF":
            lines, fns = got.setdefault(os.path.relpath(val, ROOT), ({}, {}))
        elif key == "DA":
            line, count = map(int, val.split(",")[:2])
            lines[line] = lines.get(line, 0) + count
        elif key == "FN":
            fline[val.split(",", 1)[1]] = int(val.split(",")[0])
        elif key == "FNDA":
            count, name = val.split(",", 1)
            fns[fline[name]] = fns.get(fline[name], 0) + int(count)
    return got


FN = re.compile(r'(?:pub(?:\([^)]*\))?\s+)?(?:(?:const|unsafe|async|extern\s+"\w+")\s+)*fn\s+(\w+)')


def fn_name(src, line):
    """The fn starting on `line` of a source file, with its impl's type; None for a closure."""
    text = src[line - 1]
    m, indent = FN.match(text.lstrip()), len(text) - len(text.lstrip())
    if not m:
        return None
    for l in reversed(src[:line - 1] if indent else []):
        if l.strip() and len(l) - len(l.lstrip()) < indent:
            t = re.match(r"\s*(?:unsafe\s+)?impl(?:<.*?>)?\s+(?:[\w:]+(?:<.*?>)?\s+for\s+)?([\w:]+)", l)
            return (t.group(1).split("::")[-1] + "::" if t else "") + m.group(1)
    return m.group(1)


def configure(ap: argparse.ArgumentParser) -> None:
    ap.description = __doc__
    ap.add_argument("--write", action="store_true", help="replace the table in docs/PROOFS.md")
    ap.add_argument("--only", default="", help="regex: the models to run")
    ap.add_argument("--file", action="append", help="a source file to measure (repeatable; default FILES)")
    ap.add_argument("--bound", type=int, default=1, help="the preemption bound (default 1)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds a model may run (default 600)")


def main(a: argparse.Namespace) -> int:
    Opts.bound, Opts.timeout = str(a.bound), a.timeout
    only, files, write = a.only, a.file or FILES, a.write
    if write and (only or a.file or Opts.bound != "1"):
        die("--write takes the whole table: no --only, --file or --bound")
    profdata, cov = tool("llvm-profdata"), tool("llvm-cov")
    exes = build(only)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        profs = dict(zip(exes, pool.map(lambda m: run(m, exes[m], profdata), exes)))
    rows = {m: lcov(cov, profs[m], exes[m], files) for m in exes}
    lines, fns = {f: {} for f in files}, {f: {} for f in files}  # the union: a line reached by any model
    for f, parts in ((f, parts) for got in rows.values() for f, parts in got.items() if f in lines):
        for d, part in zip((lines, fns), parts):
            d[f].update({k: d[f].get(k, 0) + c for k, c in part.items()})
    for f in (f for f in files if not lines[f]):
        die(f"{f} is in no model's coverage: a wrong path, or no model links it")
    pct = lambda ls: f"{100 * sum(c > 0 for c in ls.values()) / len(ls):.0f}%" if ls else "-"
    out = [f"Lines reached at preemption bound {Opts.bound} (`ci/model-reach`; the header gives each file's lines).", "",
           "| model | " + " | ".join(f"`{os.path.basename(f)}` ({len(lines[f])})" for f in files) + " |",
           "|---" * (len(files) + 1) + "|"]
    out += [f"| {m} | " + " | ".join(pct(rows[m].get(f, ({},))[0]) for f in files) + " |" for m in exes]
    out += ["| **union** | " + " | ".join(f"**{pct(lines[f])}**" for f in files) + " |", ""]
    for f in files:
        src = open(os.path.join(ROOT, f)).read().split("\n")
        missing = [(line, fn_name(src, line)) for line, c in sorted(fns[f].items()) if not c and fn_name(src, line)]
        out.append(f"Reached by no model in `{f}`:" + ("" if missing else " none."))
        out += [f"- `{n}` (line {line})" + (f": {NOTES[n]}" if n in NOTES else "") for line, n in missing]
        out.append("")
    table = "\n".join(out).rstrip() + "\n"
    print(table)
    if write:
        doc = open(DOC).read()
        if BEGIN not in doc or END not in doc:
            die(f"docs/PROOFS.md has no {BEGIN} ... {END} markers")
        open(DOC, "w").write(doc.split(BEGIN)[0] + BEGIN + "\n" + table + END + doc.split(END, 1)[1])
    return 0


COMMANDS = [Command("model-reach", "ci/model-reach: the lines each loom model reaches (coverage of a model build)",
                    main, configure)]
