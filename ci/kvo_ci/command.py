"""`Command`: one subcommand of ci/kvo_ci, as each command module declares
its own (`COMMANDS`) and `cli` collects them; its own module, so that the
command modules import it without importing `cli`, which imports them."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class Command:
    """One subcommand. `configure` adds its flags to its parser; a command
    without one (None) takes its arguments raw, as a list: they are passed
    on to the program it runs (ci/soak, ci/gpu-serving...) or parsed by it
    (ci/deadline's `SECONDS NAME -- CMD`)."""
    name: str
    help: str
    run: Callable
    configure: Optional[Callable[[argparse.ArgumentParser], None]] = None
