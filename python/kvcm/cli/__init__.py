"""``python -m kvcm COMMAND ...``: the command line, one module per command.

``python -m kvcm --help`` lists the commands (``info``, ``replay``, ``bench``,
``oplog-replay``, ``demo``, ``events``, ``route``, ...); ``python -m kvcm COMMAND --help``
gives each one's options, and each module's docstring says what it does.

Exit status (every command): 0 success; 1 a failure the command reports -- a backend that
raised an unexpected error (``replay``, ``bench``), a divergence (``oplog-replay``), outputs
that differ from the no-cache run (``demo``); 2 bad usage or bad input -- an option out of
range, an unreadable or malformed trace or op log (one line on stderr naming the file, the
line and the field, never a traceback), an unusable ``--device``, an empty replay.

Adding a command is adding one module here, ``kvcm/cli/<name>.py`` (a ``-`` of the command
is a ``_`` of the module: ``oplog-replay`` is :mod:`kvcm.cli.oplog_replay`), that defines::

    HELP = "one line for python -m kvcm --help"
    ORDER = 80         # where the line stands in that list (ascending)
    RECORDS = True     # optional: it builds managers (a KVCM_OPLOG it cannot record to is refused first)
    def main(argv: list[str]) -> int: ...   # the arguments after the command; the exit status

A command module imports only the standard library and light kvcm modules at its top (the
help list imports every one); what it runs (the tools, the optional extras) it imports in
``main``.  This module knows no command by name.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

PROG = "python -m kvcm"


def command_names() -> list[str]:
    """Every command, as typed (``oplog-replay``), from the modules of this package."""
    return [m.name.replace("_", "-") for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]


def command(name: str) -> ModuleType:
    """The module of command ``name``."""
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m kvcm`` parser: the list of commands (``--help``) and the errors of a
    command line that names none; each command parses its own arguments."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="kvcm: a KV-cache block manager",
        epilog="exit status: 0 success; 1 a failure the command reports (a backend error, a divergence, a "
        "mismatch); 2 bad usage or bad input (one line naming the file, line and field). "
        "See each command's --help.",
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for name, module in sorted(((n, command(n)) for n in command_names()), key=lambda nm: (nm[1].ORDER, nm[0])):
        sub.add_parser(name, help=module.HELP, add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcm ...``: run the command ``argv`` (default ``sys.argv[1:]``) names and
    return its exit status (0 success, 1 a reported failure, 2 bad usage or bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in command_names():
        module = command(argv[0])
        if getattr(module, "RECORDS", False) and not {"-h", "--help"} & set(argv):
            from kvcm.tools.cmdline import oplog_unusable

            why = oplog_unusable(f"{PROG} {argv[0]}")
            if why is not None:
                print(why, file=sys.stderr)
                return 2
        return module.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)  # --help, or an error naming the commands: both exit here
    if args.cmd is None:
        parser.print_help()
        return 2
    return main([args.cmd, *args.args])  # a command after options (``python -m kvcm -- info``)
