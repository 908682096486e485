"""``python -m kvcm oplog-replay PATH``: replay a ``KVCM_OPLOG`` file on backends
(:func:`kvcm.oplog.replay`) and report the first divergence; ``--minimize OUT`` writes a
shortest log showing it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

HELP = "replay a KVCM_OPLOG file on backends: PATH [--backend python,cpp] (kvcm.oplog)"
ORDER = 40


def main(argv: Sequence[str]) -> int:
    """``python -m kvcm oplog-replay PATH [--backend python,cpp] [--minimize OUT]``;
    exit 0 = no divergence, 1 = divergence, 2 = bad usage / unreadable or malformed log
    (one line on stderr naming the file, the line and the field)."""
    from kvcm._select import BACKENDS
    from kvcm.oplog import LogFormatError, replay
    from kvcm.tools.progress import Progress

    p = argparse.ArgumentParser(
        prog="python -m kvcm oplog-replay",
        description="Replay a kvcm op log (KVCM_OPLOG).",
        epilog="exit status: 0 no divergence, 1 a divergence (printed), 2 bad usage or an unreadable or malformed "
        "log (one line naming the file, line and field)",
    )
    p.add_argument("path")
    p.add_argument("--backend", default="python,cpp", help="comma-separated backends (default: python,cpp)")
    p.add_argument("--no-invariants", action="store_true", help="skip check_invariants() after each step")
    p.add_argument("--minimize", metavar="OUT", help="write a shortest log showing the divergence to OUT")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (shown only when stderr is a terminal, so that a log or a pipe gets the "
                        "one-line error of a bad log and nothing else)")
    a = p.parse_args(list(argv))
    backends = tuple(b.strip() for b in a.backend.split(",") if b.strip())
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        print(f"oplog-replay: unknown backend(s) {bad}; choices: {', '.join(BACKENDS)}", file=sys.stderr)
        return 2

    def bar(total: int) -> Progress:  # on a terminal only (the --no-progress help)
        return Progress(total, ",".join(backends))

    try:
        report = replay(a.path, backends, check_invariants=not a.no_invariants, minimize_divergence=bool(a.minimize),
                        progress=bar if not a.no_progress and sys.stderr.isatty() else None)
    except LogFormatError as e:
        print(f"oplog-replay: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"oplog-replay: {a.path}: {e}", file=sys.stderr)
        return 2
    d = report.divergence
    if d is not None and d.kind == "op":  # an op the log cannot mean (e.g. a cache never created)
        print(f"oplog-replay: {LogFormatError(a.path, d.line, d.detail)}", file=sys.stderr)
        return 2
    print(report)
    if a.minimize and not report.ok:
        if report.minimized is None:
            print("oplog-replay: minimising needs 2+ backends (one backend only diverges from the recording)")
        else:
            with open(a.minimize, "w", encoding="utf-8") as f:
                f.write(report.minimized)
            n = len(report.minimized.splitlines()) - 1
            print(f"minimised: {n} ops -> {a.minimize}")
    return 0 if report.ok else 1
