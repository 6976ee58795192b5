"""Mutation testing of the verified core (issue #12 item 5): cargo-mutants
over one file set at a time, with the loom models that docs/PROOFS.md's
"what a change must re-run" table names for the file, plus the plain tests
that exercise the code the models do not reach (code compiled out of loom
builds, error paths no model drives). Not part of ci/test (hours on 2
cores); the results are recorded by hand in docs/mutants.md.

    ci/mutants SET                 # run the set (both passes, see below)
    ci/mutants SET --list          # list its mutants, run nothing
    ci/mutants SET --summary       # per file: its mutants now, by result so far
    ci/mutants SET --retest-timeouts  # --iterate tests earlier timeouts again (by
                                   # default they count as caught and are skipped)
    ci/mutants SET --shard 1/4     # one shard of its mutants (cargo-mutants --shard)
    ci/mutants SET --fresh         # forget earlier sittings' results for SET
    ci/mutants SET --pass plain    # only pass 1 (or --pass models: only pass 2)
    ci/mutants SET --skip-baseline # no unmutated run first (ci/prove passes on
                                   # the unmutated tree; saves one full model run)
    ci/mutants SET --re REGEX      # only mutants whose name (file:line:col: what)
                                   # matches (cargo-mutants --re)
    ci/mutants SET --out NAME      # results in target/mutants/NAME, not .../SET (a
                                   # second run alongside, e.g. the models pass on
                                   # what the plain pass has already left)
    ci/mutants SET --screen K      # models pass with every model's preemption bound
                                   # capped at K (KVO_PREEMPTIONS_MAX): a mutant a
                                   # model fails under the cap is caught (a real
                                   # failing interleaving); what survives the screen
                                   # must then go through the models at their own
                                   # bounds (the same command without --screen)
    ci/mutants --sets              # the sets, their files, tests and models

Builds go to target dirs of their own (target/mutants/build-plain and
build-loom): the copy's package has the same artifact names as this
worktree's, so sharing target/ or target/loom with a cargo test run here
would let one overwrite the other's test binary between build and run.

Each set runs in two passes, each a `cargo mutants` run over the set's
files in a copy of the tree (cargo-mutants' default: this worktree is never
mutated):

  1. plain:  `cargo test` (Cargo.toml's `mutants` profile, the test profile
             without debug info; `mutants-checked`, optimised with the test
             profile's debug assertions and overflow checks, for the sets in
             PLAIN_RELEASE) of the set's plain tests,
  2. models: the set's loom models, `RUSTFLAGS="--cfg loom" cargo test
     --profile mutants-release --test model_...` (ci/prove's build, with
     no debug info; only the positive models: negatives are #[ignore]d and ci/prove's
     business).

Pass 2 runs with --iterate on pass 1's results, so a mutant the plain tests
caught (or that did not compile) is not rebuilt under loom: the per-mutant
loom rebuild is what costs on 2 cores. A mutant is caught when either pass
catches it. Results accumulate in target/mutants/SET/mutants.out (caught.txt,
missed.txt, timeout.txt, unviable.txt; previously_caught.txt holds what
earlier runs caught); every run after the first continues with --iterate, so
a later sitting picks up where the last one stopped (--fresh starts over).
A set whose loom models list is empty has only pass 1, and vice versa.

cargo-mutants is installed with `cargo install cargo-mutants --locked` when
missing. Flags: --timeout S (seconds a mutant's models may run, default
900: P3 and P5 take 110 s and 90 s on an idle 2-core machine),
--plain-timeout S (the same for the plain tests, default 20, 30 for the
transfer sets, whose plain tests run optimised),
--nice N (default 10: everything runs under nice, with room above it
for tests/pin_nice.rs, whose workers must be seen raising their niceness:
at 19 there is none, and lower_priority's mutants survived). One mutant at a
time: the passes name one target dir, which two jobs would share.
"""
from __future__ import annotations

import argparse
import fcntl
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

from kvo_ci import ROOT
from kvo_ci.command import Command

OUT = os.path.join(ROOT, "target", "mutants")

ALL_MODELS = ["model_capture_invalidation", "model_p1_capture_isolation", "model_p1_transfer_during_capture",
              "model_p1_gate_binding", "model_p1_hook", "model_p6_hook_flush", "model_p2_pin_before_capture",
              "model_p2_hook_interleave",
              "model_p3_gather_registered", "model_p4_shutdown", "model_p4_offloader", "model_p5_no_lost_work",
              "model_p5_offloader", "model_p5_staged_order", "model_p5_slot_jobs", "model_p6_no_deadlock",
              "model_p6_liveness", "model_p7_ranks_agree", "model_p7_settles_in_bound", "model_p8_all_or_nothing",
              "model_f1_prefault_pool"]


def files(d, names):
    return [f"src/{d}/{n}.rs" for n in names]


def tests(*names):
    return sum((["--test", n] for n in names), [])


PIN_MODELS = ["model_p1_capture_isolation", "model_p2_pin_before_capture", "model_p4_shutdown",
              "model_p6_no_deadlock", "model_p7_ranks_agree", "model_p8_all_or_nothing", "model_f1_prefault_pool"]
TRANSFER_MODELS = ["model_p1_capture_isolation", "model_p1_transfer_during_capture", "model_p3_gather_registered",
                   "model_p4_shutdown", "model_p5_no_lost_work", "model_p5_staged_order", "model_p6_no_deadlock"]
OFFLOADER_MODELS = ["model_p4_offloader", "model_p5_offloader", "model_p1_hook", "model_p6_hook_flush",
                    "model_p5_slot_jobs", "model_p2_hook_interleave"]
OFFLOADER_TESTS = tests("offloader", "offloader_hook", "offloader_misuse", "offloader_slots", "offloader_trust")

# name: (files, plain cargo-test selection, filter for the plain test binaries, loom models)
# The models follow docs/PROOFS.md "What a change must re-run"; the plain
# tests are those that drive the file's code outside the models. The sets
# cover every file of src/protocol, src/offloader, src/pin and src/transfer
# (issue #29 item 3); the first five are the files of issue #12's sittings.
SETS = {
    "shutdown": (["src/protocol/shutdown.rs"], tests("protocol"), None,
                 ["model_p4_shutdown", "model_p6_no_deadlock"]),
    "agreement": (["src/protocol/agreement.rs"], ["--lib"], "protocol::agreement",
                  ["model_p7_ranks_agree", "model_p7_settles_in_bound"]),
    "coordinator": (sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "src/protocol/coordinator/*.rs"))), ["--lib"] + tests("protocol", "protocol_interrupt"), None, ALL_MODELS),
    "protocol-errors": (files("protocol", ["error", "mod"]), tests("protocol", "protocol_interrupt"), None, []),
    # tests/offloader.rs: the observer's calls and two ranks agreeing, which
    # the pin_* tests do not drive.
    "pin-engine": (["src/pin/engine.rs"], tests("pin_rollback", "pin_background", "pin_memlock", "offloader"), None,
                   PIN_MODELS),
    # The pin_* tests that make a pre-faulter through pinning's setup: its
    # workers' CPUs (pin_numa) and niceness (pin_nice), its lookahead and
    # hints (pin_setup), a pinning thread cancelled while it faults
    # (pin_background).
    "pin-prefault": (files("pin", ["prefault", "prefault_rates", "prefault_slice"]),
                     ["--lib"] + tests("pin_prefault", "pin_rollback", "pin_setup", "pin_numa", "pin_nice",
                                       "pin_background"), None, ["model_f1_prefault_pool"]),
    # tests/offloader.rs and region_procs.rs: ranks that agree through the
    # region's slots (region_slots.rs), in threads and in processes (one
    # killed), which the pin_* tests do not share.
    "pin-setup": (files("pin", ["memlock", "numa", "options", "setup", "region_slots", "mod"]),
                  ["--lib"] + tests("pin_setup", "pin_numa", "pin_memlock", "pin_background", "pin_rollback", "pin_nice",
                                    "offloader", "region_procs"),
                  None, PIN_MODELS),
    # The offloader's two test files drive the lanes (`submit_lane`,
    # `lane_stream`: slot jobs, the expedited lane), which transfer_sim does not.
    "transfer-engine": (["src/transfer/engine.rs"], tests("transfer_sim", "offloader_slots", "offloader_hook"), None,
                        TRANSFER_MODELS),
    "transfer-staged": (files("transfer", ["staged", "ring", "lane"]), ["--lib"] + tests("transfer_sim"), None,
                        ["model_p5_staged_order", "model_p3_gather_registered", "model_p5_no_lost_work"]),
    "transfer-jobs": (files("transfer", ["completion", "enqueue", "handler", "backend", "select", "chunks", "ids",
                                         "options", "mod", "error"]),
                      ["--lib"] + tests("transfer_sim") + OFFLOADER_TESTS, None, TRANSFER_MODELS),
    # The offloader reads the layout's accessors (its slots, its build) and
    # runs every job through the engine's validation and completion.
    "transfer-layout": (files("transfer", ["layout"]),
                        ["--lib"] + tests("transfer_sim", "transfer_expand") + OFFLOADER_TESTS, None,
                        ["model_p3_gather_registered"]),
    "offloader": (files("offloader", ["mod", "build", "options", "error"]), ["--lib"] + OFFLOADER_TESTS, None,
                  OFFLOADER_MODELS),
    "offloader-hook": (files("offloader", ["hook"]), ["--lib"] + OFFLOADER_TESTS, None, OFFLOADER_MODELS),
    "offloader-slots": (files("offloader", ["slots", "keyed"]), OFFLOADER_TESTS, None,
                        ["model_p5_slot_jobs", "model_p5_offloader"]),
    "offloader-waits": (files("offloader", ["waits", "shutdown"]), OFFLOADER_TESTS, None, OFFLOADER_MODELS),
    # The node pool's closing protocol and the kernel locks that judge its
    # processes: the unit tests of both, the CLI's and the crash tests'
    # closers, dead removers and foreign members; PL6 for the protocol.
    "pool-closing": (["src/pool/closing.rs", "src/pool/file/locks.rs"], ["--lib"] + tests("pool_cli", "pool_procs"),
                     None, ["model_pl6_closing"]),
}

# Sets whose plain tests run optimised (`mutants-checked`: incremental, with
# debug assertions and overflow checks, as ci/test's dev-profile tests; the
# ring's out-of-order release is a debug_assert, which plain release hid): the
# random layouts of tests/transfer_sim.rs take about 40 s in the dev profile
# on 2 shared cores, a few seconds optimised.
PLAIN_RELEASE = {"transfer-engine", "transfer-staged", "transfer-jobs", "transfer-layout"}
# Plain-pass test timeouts (seconds) other than the default 20.
PLAIN_TIMEOUT = {"transfer-engine": 30, "transfer-staged": 30, "transfer-jobs": 30, "transfer-layout": 30}


def ensure_tool():
    if subprocess.run(["cargo", "mutants", "--version"], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL).returncode != 0:
        print("ci/mutants: installing cargo-mutants (cargo install cargo-mutants --locked)", flush=True)
        subprocess.run(nice() + ["cargo", "install", "cargo-mutants", "--locked"], check=True)


class Opts:
    """The run's flags (set by main from the command line)."""
    nice = 10
    retest_timeouts = False


def nice():
    return ["nice", "-n", str(Opts.nice)]


def mutants_cmd(files, out_dir, iterate, extra, timeout):
    # Unit tests' own helpers (in `mod tests` under cfg(all(test, not(loom))),
    # which cargo-mutants does not recognise as test code) are not mutated.
    cmd = nice() + ["cargo", "mutants", "--output", out_dir, "--no-shuffle", "--jobs", "1", "--exclude-re", "tests::",
                    "--timeout", timeout, "--build-timeout", "1800"]
    for f in files:
        cmd += ["--file", f]
    if iterate:
        cmd.append("--iterate")
        if not Opts.retest_timeouts:
            skip_timeouts(out_dir)
    return cmd + extra


def skip_timeouts(out_dir):
    """A timeout counts as caught (nextest's per-test limit fails ci/test on
    it, docs/mutants.md): --iterate does not test it again unless
    --retest-timeouts is given (each costs the whole timeout)."""
    out = os.path.join(out_dir, "mutants.out")
    timed_out = count(out_dir, "timeout.txt")
    if timed_out:
        with open(os.path.join(out, "previously_caught.txt"), "a") as f:
            for m in timed_out:
                f.write(m + "\n")


def has_results(out_dir):
    return os.path.isdir(os.path.join(out_dir, "mutants.out"))


def run(cmd, env=None):
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.time()
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    print(f"ci/mutants: exit {rc} after {time.time() - t0:.0f} s", flush=True)
    # cargo-mutants: 0 all caught, 2 some missed, 3 some timed out; others are failures.
    if rc not in (0, 2, 3):
        sys.exit(f"ci/mutants: cargo mutants failed (exit {rc})")
    return rc


def run_pass(cmd, env, out_dir):
    """One cargo-mutants pass; its results go into history.txt however it
    ends (done, failed, or stopped by SIGINT/SIGTERM: cargo-mutants writes
    each outcome as it happens, so a stopped pass keeps what it tested)."""
    try:
        run(cmd, env)
    finally:
        record_history(out_dir)


def stop_on_sigterm():
    """SIGTERM ends ci/mutants as Ctrl-C does (subprocess.run then kills
    cargo-mutants and waits for it), so run_pass still records."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


def count(out_dir, name):
    p = os.path.join(out_dir, "mutants.out", name)
    if not os.path.exists(p):
        return []
    with open(p) as f:
        return [l.rstrip("\n") for l in f if l.strip()]


RESULT_FILES = (("unviable", "unviable.txt"), ("caught", "caught.txt"), ("timeout", "timeout.txt"),
                ("missed", "missed.txt"))


def record_history(out_dir):
    """Appends this run's results to out_dir/history.txt ("kind name" lines):
    cargo-mutants keeps only the last two runs (mutants.out, .old), and
    --iterate folds caught and unviable into previously_caught.txt."""
    with open(os.path.join(out_dir, "history.txt"), "a") as f:
        for kind, fname in RESULT_FILES:
            for m in count(out_dir, fname):
                f.write(f"{kind} {m}\n")


def history(out_dir):
    p = os.path.join(out_dir, "history.txt")
    if not os.path.exists(p):
        return []
    return [tuple(l.rstrip("\n").split(" ", 1)) for l in open(p) if " " in l]


def summary(files, out_dir):
    """Per file, the set's mutants as the tree has them now, by their
    results so far in out_dir (this run's and the last one's lists, and
    what --iterate carried): a name that an edit moved, and that no run has
    tested since, is "not tested"."""
    listed = subprocess.run(["cargo", "mutants", "--list", "--exclude-re", "tests::"]
                            + sum((["--file", f] for f in files), []),
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout.splitlines()
    seen = {}
    # Every run's results, oldest first: a caught or unviable result stands
    # (unviable over caught: --iterate lists both as previously caught);
    # otherwise the latest result of a name wins.
    for kind, m in history(out_dir):
        if kind == "unviable" or seen.get(m) not in ("caught", "unviable"):
            seen[m] = kind
    kinds = ["caught", "timeout", "unviable", "missed", "not tested"]
    rows = {}
    for m in listed:
        f = m.split(":", 1)[0]
        rows.setdefault(f, {k: 0 for k in kinds})[seen.get(m, "not tested")] += 1
    print("| file | mutants | caught | caught by a hang (timeout) | unviable | missed | not tested |")
    print("|---|---|---|---|---|---|---|")
    for f, r in rows.items():
        print(f"| {f} | {sum(r.values())} | " + " | ".join(str(r[k]) for k in kinds) + " |")
    for m in listed:
        if seen.get(m, "not tested") in ("missed", "not tested"):
            print(f"  {seen.get(m, 'not tested').upper():11} {m}")


def main(ns: argparse.Namespace) -> int:
    if ns.sets:
        for name, (files, plain, filt, models) in SETS.items():
            print(f"{name}: {' '.join(files)}\n  plain: cargo test {' '.join(plain)}"
                  f"{' -- ' + filt if filt else ''}\n  models: {' '.join(models) or '-'}")
        return 0
    if ns.set is None:
        print(__doc__)
        return 0
    name = ns.set
    if name not in SETS:
        sys.exit(f"ci/mutants: unknown set {name!r} (ci/mutants --sets)")
    Opts.nice, Opts.retest_timeouts = ns.nice, ns.retest_timeouts
    files, plain, filt, models = SETS[name]
    out_dir = os.path.join(OUT, ns.out or name)
    extra = []
    if ns.fresh and os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    if ns.re:
        extra += ["--re", ns.re]
    if ns.skip_baseline:
        extra += ["--baseline", "skip"]
    if ns.shard:
        extra += ["--shard", ns.shard]
    only = ns.pass_
    ensure_tool()
    if ns.list:
        subprocess.run(["cargo", "mutants", "--list", "--exclude-re", "tests::"] + sum((["--file", f] for f in files), []),
                       cwd=ROOT, check=True)
        return 0
    if ns.summary:
        summary(files, out_dir)
        return 0

    os.makedirs(out_dir, exist_ok=True)
    # One run at a time: every set builds in the same two target dirs, so a
    # second run would overwrite the first one's test binaries with another
    # mutant's between build and test (and its cargo waits for the lock,
    # which cargo-mutants reports as a timeout). Seen: two sets run at once
    # reported 17 timeouts that were cargo's lock.
    lock = open(os.path.join(OUT, "run.lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("ci/mutants: another ci/mutants run holds target/mutants/run.lock; waiting for it", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
    stop_on_sigterm()
    t0 = time.time()
    # Pass 1: the plain tests.
    if plain and only in (None, "plain"):
        # The plain tests take a second; a mutant that makes one hang
        # (a lost wake-up) is a timeout after 20 s, not after the models' limit.
        cmd = mutants_cmd(files, out_dir, has_results(out_dir), extra,
                          str(ns.plain_timeout or PLAIN_TIMEOUT.get(name, 20)))
        cmd += ["--cargo-arg=--target-dir=" + os.path.join(OUT, "build-plain")]
        cmd += ["--cargo-arg=" + a for a in plain]
        if filt:
            cmd += ["--cargo-test-arg=--", "--cargo-test-arg=" + filt]
        env = dict(os.environ)
        env.pop("RUSTFLAGS", None)
        cmd.append("--profile=" + ("mutants-checked" if name in PLAIN_RELEASE else "mutants"))
        run_pass(cmd, env, out_dir)
    # Pass 2: the loom models, on what pass 1 left.
    if models and only in (None, "models"):
        cmd = mutants_cmd(files, out_dir, has_results(out_dir), extra, str(ns.timeout))
        cmd += ["--profile=mutants-release", "--cargo-arg=--target-dir=" + os.path.join(OUT, "build-loom")]
        for m in models:
            cmd += ["--cargo-arg=--test", "--cargo-arg=" + m]
        env = dict(os.environ, RUSTFLAGS=(os.environ.get("RUSTFLAGS", "") + " --cfg loom").strip())
        env.pop("KVO_PREEMPTIONS_MAX", None)
        if ns.screen is not None:
            env["KVO_PREEMPTIONS_MAX"] = str(ns.screen)
            print(f"ci/mutants: screening round, preemption bounds capped at {env['KVO_PREEMPTIONS_MAX']}", flush=True)
        # Only the library changes between mutants: Cargo.toml's
        # mutants-release profile rebuilds it incrementally, without debug info.
        run_pass(cmd, env, out_dir)
    caught = count(out_dir, "caught.txt") + count(out_dir, "previously_caught.txt")
    missed, timeout, unviable = (count(out_dir, n) for n in ("missed.txt", "timeout.txt", "unviable.txt"))
    print(f"\nci/mutants {name}: {len(caught)} caught, {len(missed)} missed, {len(timeout)} timed out, "
          f"{len(unviable)} unviable, this run {time.time() - t0:.0f} s; results in {out_dir}/mutants.out")
    for m in missed:
        print("  MISSED  " + m)
    for m in timeout:
        print("  TIMEOUT " + m)




def configure(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("set", nargs="?", metavar="SET", help="the file set (--sets lists them)")
    p.add_argument("--sets", action="store_true", help="the sets, their files, tests and models")
    p.add_argument("--list", action="store_true", help="list the set's mutants, run nothing")
    p.add_argument("--summary", action="store_true", help="per file: its mutants now, by result so far")
    p.add_argument("--retest-timeouts", action="store_true", help="test earlier timeouts again")
    p.add_argument("--shard", help="K/N: one shard of the set's mutants")
    p.add_argument("--fresh", action="store_true", help="forget earlier sittings' results for SET")
    p.add_argument("--pass", dest="pass_", choices=("plain", "models"), help="only this pass")
    p.add_argument("--skip-baseline", action="store_true", help="no unmutated run first")
    p.add_argument("--re", help="only mutants whose name matches REGEX")
    p.add_argument("--out", help="results in target/mutants/OUT, not .../SET")
    p.add_argument("--screen", type=int, metavar="K", help="models pass with every bound capped at K")
    p.add_argument("--timeout", type=int, default=900, help="seconds a mutant's models may run (default 900)")
    p.add_argument("--plain-timeout", type=int, default=0,
                   help="seconds a mutant's plain tests may run (default 20; 30 for the transfer sets)")
    p.add_argument("--nice", type=int, default=10, help="niceness of everything it runs (default 10)")


COMMANDS = [Command("mutants", "ci/mutants SET: mutation testing of the verified core (cargo-mutants)", main,
                    configure)]
