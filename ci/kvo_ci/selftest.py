"""`ci/kvo_ci selftest`: this program checked against itself, in about a
second, with nothing built or run (ci/test runs it in step 4):

  1. every subcommand's parser: the command lines the docs use parse to the
     values meant, and wrong ones are refused;
  2. the settings: every environment variable the code reads through
     `setting()` is in SETTINGS and every one of SETTINGS is read; no other
     KVO_* name appears in the code but the CHILD_SETTINGS it sets for the
     models and tests; nothing reads os.environ for a KVO_* name directly;
  3. the tables: the package docstring's and ci/README.md's settings tables
     list exactly SETTINGS, with the same columns;
  4. the scripts: every ci/ script is under 60 lines and runs one
     subcommand of this program, and every subcommand but this one has its
     script.
"""
from __future__ import annotations

import argparse
import os
import re
from typing import Dict, List, Tuple

import kvo_ci
from kvo_ci import CHILD_SETTINGS, PKG, ROOT, SETTINGS
from kvo_ci.command import Command

SCRIPT_MAX_LINES = 60

# (argv, the parsed values it must give); argv must parse.
GOOD: List[Tuple[List[str], Dict[str, object]]] = [
    (["test"], {}),
    (["lint"], {}),
    (["prove"], {"filter": None, "full": False, "shuttle_quick": False, "jobs": 0, "timeout": 600}),
    (["prove", "--self-test"], {"self_test": True}),
    (["prove", "p2_", "--shuttle-quick"], {"filter": "p2_", "shuttle_quick": True}),
    (["prove", "--full", "--write-docs", "--jobs", "3"], {"full": True, "write_docs": True, "jobs": 3}),
    (["prove", "--shuttle-replay", "negative_n1", "target/x.schedule"],
     {"shuttle_replay": ["negative_n1", "target/x.schedule"]}),
    (["mutants", "--sets"], {"sets": True, "set": None}),
    (["mutants", "coordinator", "--screen", "2", "--pass", "models", "--timeout", "300"],
     {"set": "coordinator", "screen": 2, "pass_": "models", "timeout": 300, "plain_timeout": 0, "nice": 10}),
    (["mutants", "pin-prefault", "--shard", "1/4", "--re", "foo", "--out", "x", "--skip-baseline"],
     {"shard": "1/4", "re": "foo", "out": "x", "skip_baseline": True}),
    (["model-reach", "--write"], {"write": True, "bound": 1, "timeout": 600}),
    (["model-reach", "--only", "p7_", "--file", "src/a.rs", "--file", "src/b.rs", "--bound", "2"],
     {"only": "p7_", "file": ["src/a.rs", "src/b.rs"], "bound": 2}),
    (["python"], {"setup": False}),
    (["python", "--setup"], {"setup": True}),
    (["vllm-env"], {"version": "0.33.0", "check": False, "need_gb": 14, "progress_s": 30}),
    (["vllm-env", "--version", "0.26.0", "--check"], {"version": "0.26.0", "check": True}),
    (["gpu"], {"only": "tests memcheck conform incident bench run python vllm", "step_timeout": 900,
               "benches": "pin pin-shared transfer", "vllm_pytest": True, "pin_size": "16GiB"}),
    (["gpu", "--only", "vllm", "--no-vllm-pytest", "--vllm-engine-args", "--regions 64GiB"],
     {"only": "vllm", "vllm_pytest": False, "vllm_engine_args": "--regions 64GiB"}),
    (["gpu", "--only", "bench", "--benches", "pin-sizes", "--pin-candidates", ""],
     {"benches": "pin-sizes", "pin_candidates": ""}),
    (["gpu-skips", "a.log", "b.log"], {"logs": ["a.log", "b.log"]}),
    (["gpu-pin-probe", "gpu-bin/kvoffload", "out", "--big", ""], {"bin": "gpu-bin/kvoffload", "big": ""}),
    (["build-gpu-bin"], {"out_dir": "gpu-bin"}),
    (["build-gpu-bin", "elsewhere"], {"out_dir": "elsewhere"}),
    (["selftest"], {}),
]
# argv that must be refused (argparse's exit status 2).
BAD: List[List[str]] = [
    ["no-such-command"],
    ["prove", "--shuttle", "--shuttle-quick"],
    ["prove", "--jobs", "many"],
    ["prove", "--shuttle-replay", "only-a-name"],
    ["mutants", "coordinator", "--pass", "neither"],
    ["gpu", "--step-timeout", "soon"],
    ["gpu-pin-probe", "only-bin"],
    ["lint", "--unknown"],
    ["vllm-env", "--version"],
]
# Raw-argument commands: their arguments go to what they run (or to their own parse).
RAW = {"deadline", "test-limits", "soak", "gpu-serving", "gpu-serve-http", "gpu-pool"}


class Refused(Exception):
    pass


def parse(ap: argparse.ArgumentParser, argv: List[str]) -> argparse.Namespace:
    import contextlib
    import io

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return ap.parse_args(argv)
    except SystemExit as e:
        raise Refused(f"exit {e.code}")


def check_parsers(cmds: Dict[str, Command], parser) -> List[str]:
    bad = []
    ap = parser(cmds)
    raw = {n for n, c in cmds.items() if c.configure is None}
    if raw != RAW:
        bad.append(f"the raw-argument commands are {sorted(raw)}, expected {sorted(RAW)}")
    for argv, want in GOOD:
        try:
            ns = parse(ap, argv)
        except Refused as e:
            bad.append(f"{argv} was refused ({e})")
            continue
        if ns.cmd.name != argv[0]:
            bad.append(f"{argv} ran {ns.cmd.name}")
        for k, v in want.items():
            if getattr(ns, k, "<missing>") != v:
                bad.append(f"{argv}: {k} = {getattr(ns, k, '<missing>')!r}, expected {v!r}")
    for argv in BAD:
        try:
            parse(ap, argv)
            bad.append(f"{argv} was accepted")
        except Refused:
            pass
    parsed = {argv[0] for argv, _ in GOOD}
    for name in cmds:
        if name not in parsed and name not in RAW:
            bad.append(f"subcommand {name} has no command line in GOOD")
    return bad


def sources() -> Dict[str, str]:
    out = {}
    for f in sorted(os.listdir(PKG)):
        if f.endswith(".py"):
            with open(os.path.join(PKG, f)) as fh:
                out[f] = fh.read()
    return out


def table_rows(text: str, where: str) -> Tuple[Dict[str, Tuple[str, str, str]], List[str]]:
    """The rows of the settings table in `text` (the one headed `| setting |`)."""
    rows, bad = {}, []
    lines = text.splitlines()
    try:
        start = next(i for i, l in enumerate(lines) if l.strip().startswith("| setting |"))
    except StopIteration:
        return {}, [f"{where}: no settings table (a line starting '| setting |')"]
    for l in lines[start + 2:]:
        if not l.strip().startswith("|"):
            break
        cells = [c.strip() for c in l.strip().strip("|").split("|")]
        if len(cells) != 4:
            bad.append(f"{where}: row {l!r} has {len(cells)} cells, not 4")
            continue
        rows[cells[0].strip("`")] = (cells[2], cells[1], cells[3])
    return rows, bad


def check_settings() -> List[str]:
    bad = []
    src = sources()
    code = "\n".join(src.values())
    read = set(re.findall(r'\bsetting\(\s*"(\w+)"', code))
    for n in sorted(read - set(SETTINGS)):
        bad.append(f"the code reads {n} through setting() but SETTINGS has no {n}")
    for n in sorted(set(SETTINGS) - read):
        bad.append(f"SETTINGS holds {n} but no code reads it through setting()")
    named = set(re.findall(r"\bKVO_[A-Z0-9_]+", code))
    for n in sorted(named - set(SETTINGS) - set(CHILD_SETTINGS)):
        bad.append(f"{n} appears in ci/kvo_ci but is neither in SETTINGS nor in CHILD_SETTINGS")
    for n in sorted(set(CHILD_SETTINGS) - named - {"KVO_SHUTTLE_SEED", "KVO_STRESS_SECONDS"}):
        bad.append(f"CHILD_SETTINGS holds {n} but no code sets or checks it")
    for f, text in src.items():
        reads = r'os\.environ\[\s*"(\w+)"\s*\](?!\s*=[^=])|os\.(?:environ\.get|getenv)\(\s*"(\w+)"'
        for m in re.finditer(reads, text):
            name = m.group(1) or m.group(2)
            if name in SETTINGS:
                bad.append(f"{f} reads {name} from os.environ directly, not through setting()")
            elif name not in kvo_ci.STANDARD and name not in CHILD_SETTINGS:
                bad.append(f"{f} reads {name}, which is in no list of ci/kvo_ci/__init__.py")
    for where, text in (("ci/kvo_ci/__init__.py's docstring", kvo_ci.__doc__),
                        ("ci/README.md", open(os.path.join(ROOT, "ci", "README.md")).read())):
        rows, errs = table_rows(text, where)
        bad += errs
        if set(rows) != set(SETTINGS):
            bad.append(f"{where}: its table lists {sorted(rows)}, SETTINGS {sorted(SETTINGS)}")
        for n, row in rows.items():
            if n in SETTINGS and row != SETTINGS[n]:
                bad.append(f"{where}: row {n} is {row}, SETTINGS has {SETTINGS[n]}")
    if len(SETTINGS) > 10:
        bad.append(f"{len(SETTINGS)} settings: at most 10 (issue 44; make the rest flags)")
    return bad


def check_scripts(cmds: Dict[str, Command]) -> List[str]:
    bad = []
    ci = os.path.join(ROOT, "ci")
    seen = set()
    for f in sorted(os.listdir(ci)):
        path = os.path.join(ci, f)
        if not os.path.isfile(path) or f.endswith(".md"):
            continue
        with open(path) as fh:
            text = fh.read()
        n = text.count("\n")
        if n >= SCRIPT_MAX_LINES:
            bad.append(f"ci/{f} has {n} lines (under {SCRIPT_MAX_LINES})")
        m = re.search(r'^exec python3 -B "\$\(dirname "\$0"\)/kvo_ci" ([\w-]+) "\$@"$', text, re.M)
        if not m:
            bad.append(f"ci/{f} does not exec `python3 -B \"$(dirname \"$0\")/kvo_ci\" SUB \"$@\"`")
        elif m.group(1) not in cmds:
            bad.append(f"ci/{f} runs subcommand {m.group(1)}, which does not exist")
        elif m.group(1) != f:
            bad.append(f"ci/{f} runs subcommand {m.group(1)}, not {f}")
        else:
            seen.add(f)
        if not os.access(path, os.X_OK):
            bad.append(f"ci/{f} is not executable")
    for name in sorted(set(cmds) - seen - {"selftest"}):
        bad.append(f"subcommand {name} has no script ci/{name}")
    return bad


def selftest(ns: argparse.Namespace) -> int:
    cmds, parser = ns.registry  # set by cli.main
    checks = [("parsers", check_parsers(cmds, parser)), ("settings", check_settings()), ("scripts", check_scripts(cmds))]
    failed = 0
    for name, bad in checks:
        for b in bad:
            print(f"ci/kvo_ci selftest: {name}: FAILED: {b}")
        failed += len(bad)
    if failed:
        return 1
    print(f"ci/kvo_ci selftest: ok ({len(GOOD)} command lines parsed, {len(BAD)} refused; {len(SETTINGS)} settings "
          f"in the code and both tables; {len(cmds) - 1} scripts, each under {SCRIPT_MAX_LINES} lines)")
    return 0


def configure(p: argparse.ArgumentParser) -> None:
    p.description = __doc__


COMMANDS = [Command("selftest", "the parsers, the settings table and the ci/ scripts checked against the code",
                    selftest, configure)]
