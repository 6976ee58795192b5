"""The subcommands, their parsers and the dispatch (`ci/kvo_ci --help`)."""
from __future__ import annotations

import argparse
from typing import Dict, List

from kvo_ci.command import Command


def commands() -> Dict[str, Command]:
    from kvo_ci import deadline, gpu, mutants, prove, pyenv, reach, rust, selftest

    found: Dict[str, Command] = {}
    for mod in (rust, deadline, prove, mutants, reach, pyenv, gpu, selftest):
        for c in mod.COMMANDS:
            if c.name in found:
                raise ValueError(f"kvo_ci: two subcommands named {c.name}")
            found[c.name] = c
    return found


def parser(cmds: Dict[str, Command]) -> argparse.ArgumentParser:
    import kvo_ci

    ap = argparse.ArgumentParser(prog="ci/kvo_ci", description=kvo_ci.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="SUB")
    sub.required = True
    for c in cmds.values():
        p = sub.add_parser(c.name, prog=f"ci/{c.name}", help=c.help, description=c.help,
                           add_help=c.configure is not None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if c.configure is not None:
            c.configure(p)
        p.set_defaults(cmd=c)
    return ap


def main(argv: List[str]) -> int:
    cmds = commands()
    if argv and argv[0] in cmds and cmds[argv[0]].configure is None:
        return int(cmds[argv[0]].run(argv[1:]) or 0)
    ns = parser(cmds).parse_args(argv)
    # The registry travels with the arguments (the self-test checks it), so
    # no command module imports this one, which imports them all.
    ns.registry = (cmds, parser)
    return int(ns.cmd.run(ns) or 0)
