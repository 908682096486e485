"""Helpers shared by the command-line tools (``kvcm.cli``, ``kvcm.bench``,
``kvcm.route_cli``): result tables, timing and running one backend's part guarded.

Their own module so that the commands import it rather than each other (no import cycle
between the CLI and the benchmarks it runs)."""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from kvcm._select import BackendUnavailableError

NOT_IMPLEMENTED = "not implemented yet (issue #3)"
ERROR_PREFIX = "error: "


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cols = len(header)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(cols)]
    lines = []
    for r in [header, *rows]:
        cells = [str(r[0]).ljust(widths[0])] + [str(r[i]).rjust(widths[i]) for i in range(1, cols)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def fmt_int(n: int) -> str:
    return f"{n:,}"


def run_guarded(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(result, None)``, or ``(None, why)`` when the backend cannot run it."""
    try:
        return fn(), None
    except NotImplementedError:
        return None, NOT_IMPLEMENTED
    except BackendUnavailableError as e:
        return None, f"unavailable ({str(e).split(':')[0]})"
    except ImportError as e:  # a backend module not written yet
        return None, f"unavailable ({e})"
    except Exception as e:  # noqa: BLE001 - a bug: shown in its column, traceback on stderr
        traceback.print_exc()
        return None, f"{ERROR_PREFIX}{type(e).__name__}"


def exit_code(results: dict[str, Any]) -> int:
    """0 when at least one backend ran and none failed with an unexpected error (a backend
    that is not implemented yet or not built is not an error)."""
    ran = [r for r in results.values() if not isinstance(r, str)]
    crashed = [r for r in results.values() if isinstance(r, str) and r.startswith(ERROR_PREFIX)]
    return 0 if ran and not crashed else 1


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def ratio(py: float | None, cpp: float | None) -> str:
    if py is None or cpp is None or cpp == 0:
        return "n/a"
    return f"{py / cpp:.1f}x"


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in ``lo..hi`` (``hi`` None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} out of range {lo}..{hi if hi is not None else ''}")
        return v

    return parse
