"""Runs a command with a deadline, so that a hang fails CI by name.

    ci/deadline SECONDS NAME -- CMD [ARGS...]
    ci/deadline --self-test

The command's output passes through byte for byte. When it is still
running after SECONDS, its whole process group is killed and the step fails
with exit status 124, naming the step and, from the output, every Rust test
that libtest reported as running for over 60 seconds and that was not seen
to finish. libtest prints "test NAME has been running for over 60 seconds"
in its pretty and terse (--quiet) formats, and only when it runs tests on
more than one thread (the default on a machine with two or more cores; not
with --test-threads=1). A hang in a test of the library (a job that is never
reported, a window that never opens: docs/mutants.md lists mutants seen only
as hangs) then ends the run at the deadline with that test's name, instead
of at CI's own time limit with none. Otherwise the command's exit status is
ours. SIGINT, SIGTERM or SIGHUP to this script kill the command's process
group too, and the script exits with 128 + the signal.

The deadline counts from the command's start: give it a command whose
build is done (ci/test builds first, outside the deadline).

--self-test checks it in about 3 s: a command that announces a slow test
and then sleeps past a 2 s deadline must be killed, reported with that
test's name and status 124; a quick command's output (bytes that are not
UTF-8 included) and exit status must pass through; a SIGTERM to ci/deadline
must end the command too, and give status 143.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import List

from kvo_ci import self_cmd
from kvo_ci.command import Command

LONG = re.compile(r"test (.+?) has been running for over \d+ seconds")
# libtest's lines for a finished test: "test NAME ... ok" (pretty format;
# the terse format of --quiet prints a dot, so there every test that ran
# for over 60 s is named).
DONE = re.compile(r"^test (.+?) \.\.\. ")


def kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(seconds: float, name: str, cmd: List[str], out=None) -> int:
    out = out if out is not None else sys.stdout.buffer
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    long_running, finished = [], set()

    def on_signal(sig, _frame):
        kill_group(p)
        out.write(f"ci/deadline: {name}: got signal {sig}, killed the command\n".encode())
        out.flush()
        os._exit(128 + sig)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)

    def pump():
        for raw in iter(p.stdout.readline, b""):
            out.write(raw)
            out.flush()
            line = raw.decode(errors="replace")
            m = LONG.search(line)
            if m and m.group(1) not in long_running:
                long_running.append(m.group(1))
            m = DONE.match(line)
            if m:
                finished.add(m.group(1))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        rc = p.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        kill_group(p)
        p.wait()
        t.join(timeout=30)
        still = [n for n in long_running if n not in finished]
        lines = [f"ci/deadline: {name} still running after {seconds} s: killed"]
        lines += [f"ci/deadline: hung test (over 60 s, not seen to finish): {n}" for n in still]
        if not still:
            lines.append("ci/deadline: no test named itself as long-running (a hang outside libtest, or one under 60 s)")
        out.write(("\n".join(lines) + "\n").encode())
        out.flush()
        return 124
    # The pipe closes when every process holding it has exited.
    t.join(timeout=30)
    return rc


def self_test() -> int:
    import io

    buf = io.BytesIO()
    slow = [
        sys.executable,
        "-c",
        "import sys, time; print('test a::quick ... ok'); "
        "print('test src/a.rs - f (line 3) has been running for over 60 seconds'); sys.stdout.flush(); time.sleep(30)",
    ]
    t0 = time.monotonic()
    rc = run(2, "self-test hang", slow, buf)
    took = time.monotonic() - t0
    text = buf.getvalue().decode()
    bad = []
    if rc != 124:
        bad.append(f"a hanging command gave status {rc}, not 124")
    if "hung test (over 60 s, not seen to finish): src/a.rs - f (line 3)\n" not in text:
        bad.append("the hung test was not named")
    if "a::quick" in text.split("ci/deadline:", 1)[-1]:
        bad.append("a finished test was named as hung")
    if took > 10:
        bad.append(f"the hanging command was killed only after {took:.1f} s")
    buf = io.BytesIO()
    quick = "import sys; sys.stdout.buffer.write(b'hello \\xff\\n'); raise SystemExit(3)"
    rc = run(30, "self-test quick", [sys.executable, "-c", quick], buf)
    if rc != 3 or buf.getvalue() != b"hello \xff\n":
        bad.append(f"a quick command: status {rc}, output {buf.getvalue()!r} (want 3, b'hello \\xff\\n')")
    # A signal to this script takes the command down with it.
    me = self_cmd("deadline", "60", "self-test signal", "--", "sh", "-c", "echo $$; exec sleep 30")
    d = subprocess.Popen(me, stdout=subprocess.PIPE)
    child = int(d.stdout.readline())
    d.send_signal(signal.SIGTERM)
    rc = d.wait(timeout=10)
    d.stdout.close()
    if rc != 128 + signal.SIGTERM:
        bad.append(f"SIGTERM to ci/deadline gave status {rc}, not {128 + signal.SIGTERM}")
    def gone(pid):
        # Exited: no /proc entry, or a zombie not reaped yet.
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (FileNotFoundError, ProcessLookupError):
            return True

    for _ in range(100):
        if gone(child):
            break
        time.sleep(0.02)  # SIGKILL's delivery is asynchronous; 2 s at most
    else:
        bad.append(f"the command (pid {child}) outlived a SIGTERM to ci/deadline")
        os.kill(child, signal.SIGKILL)
    for b in bad:
        print(f"ci/deadline --self-test: FAILED: {b}")
    if bad:
        return 1
    print(
        f"ci/deadline --self-test: ok (a hang killed after {took:.1f} s and named; a quick command passed through; "
        "a SIGTERM took the command down)"
    )
    return 0


def main(argv: List[str]) -> int:
    if argv == ["--self-test"]:
        return self_test()
    if len(argv) < 4 or argv[2] != "--":
        sys.exit(__doc__)
    return run(float(argv[0]), argv[1], argv[3:])


COMMANDS = [Command("deadline", "ci/deadline SECONDS NAME -- CMD...: a command with a deadline; --self-test", main)]
