"""``python -m kvcm vllm check-config JSON|@FILE``: the vLLM connector's configuration checked
offline, without vLLM, in about a second -- what the connector would refuse, before an
engine start (:mod:`kvcm.integrations.vllm.check`).

``JSON`` is a ``kv_connector_extra_config`` object or a whole ``kv_transfer_config`` (the
object given to ``--kv-transfer-config``; then its connector and ``kv_load_failure_policy``
are checked too), inline or ``@FILE``.  Exit status: 0 valid (a summary on stdout, warnings
on stderr), 2 invalid or unreadable (one line on stderr naming the key).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

HELP = "check a vLLM kv_connector_extra_config (or kv_transfer_config) offline: check-config JSON|@FILE"
ORDER = 80
PROG = "python -m kvcm vllm"


def check_config(argv: Sequence[str]) -> int:
    """``check-config JSON|@FILE``: 0 valid, 2 invalid (one line on stderr)."""
    prog = f"{PROG} check-config"
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                epilog="exit status: 0 valid (a summary; warnings on stderr), 2 invalid or unreadable "
                                "(one line naming the key)")
    p.add_argument("config", help="kv_connector_extra_config or kv_transfer_config as JSON, or @FILE")
    text = p.parse_args(list(argv)).config
    try:
        if text.startswith("@"):
            with open(text[1:], encoding="utf-8") as f:
                text = f.read()
        data = json.loads(text)
    except OSError as e:
        print(f"{prog}: cannot read {text[1:]!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{prog}: not JSON: {e}", file=sys.stderr)
        return 2
    from kvcm.integrations.vllm.check import check, summary  # no vLLM: the settings and their checks

    try:
        settings, warnings = check(data)
    except (ValueError, TypeError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(summary(settings))
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0


SUBCOMMANDS = {"check-config": check_config}


def main(argv: Sequence[str]) -> int:
    """``python -m kvcm vllm SUBCOMMAND ...`` (``check-config``); 2 for anything else."""
    argv = list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    usage = f"usage: {PROG} check-config JSON|@FILE  ({PROG} check-config --help)"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    print(usage, file=sys.stderr)
    return 2
