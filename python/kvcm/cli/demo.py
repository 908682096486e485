"""``python -m kvcm demo``: the reference engine on a built-in workload through each backend
(reuse, copies, exactness against the no-cache run): :mod:`kvcm.tools.demo`, which parses
its own arguments."""

from __future__ import annotations

from collections.abc import Sequence

HELP = "reference engine on a multi-turn workload: reuse, copies, exactness per backend (kvcm.tools.demo)"
ORDER = 50
RECORDS = True


def main(argv: Sequence[str]) -> int:
    """``python -m kvcm demo ...``: the exit status of :func:`kvcm.tools.demo.main`."""
    from kvcm.tools.demo import main as demo

    return demo(list(argv))
