"""Byte sizes on the command line (``16GiB``, ``512MiB``, ``64k``, a plain
number of bytes), one parser for the benchmarks and the examples that take
them: ``python/bench/startup.py``, ``python/examples/h200_vllm_worker.py``
and ``examples/seed_pytorch.py`` import it from the repository checkout.
(``vllm_engine.py`` keeps its own, more lenient one: ``64MB``, ``1T``, as
its command lines have always taken.)"""

import argparse

GIB = 1 << 30


def parse_size(s: str) -> int:
    """``s`` as bytes: a number with an optional unit k/KiB, m/MiB, g/GiB
    (powers of 1024, any case); anything else is an ``argparse`` type error."""
    units = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": GIB, "gib": GIB, "": 1}
    t = s.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    if unit not in units or not num:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 16GiB, 512MiB)")
    return int(float(num) * units[unit])
