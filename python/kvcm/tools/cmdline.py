"""The command-line helpers every ``main()`` shares (the commands of :mod:`kvcm.cli`, the
tools' own, the reference engine's): argparse types, result tables, timing, running one
backend's part guarded, and the one-line refusals (a missing extra, torch or op-log path).

A leaf of the tools (it imports nothing of the tools, the command line, the fleet, the
engine or the data plane), so that every command imports it rather than each other."""

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
    """``rows`` under ``header`` as aligned text columns (the first left-aligned, the rest right)."""
    cols = len(header)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(cols)]
    lines = []
    for r in [header, *rows]:
        cells = [str(r[0]).ljust(widths[0])] + [str(r[i]).rjust(widths[i]) for i in range(1, cols)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def fmt_int(n: int) -> str:
    """``n`` with thousands separators."""
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
    """The fastest of ``repeat`` timed calls of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def ratio(py: float | None, cpp: float | None) -> str:
    """``py / cpp`` as ``"N.Nx"``, or ``"n/a"`` when either is missing or ``cpp`` is 0."""
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
        if hi is None and v < lo:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {v}")
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} out of range {lo}..{hi}")
        return v

    return parse


def backend_arg(text: str) -> str:
    """An argparse type: one kvcm backend name (``python`` or ``cpp``)."""
    from kvcm._select import BACKENDS

    if text not in BACKENDS:
        hint = " (names are lower case)" if text.lower() in BACKENDS else ""
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; choices: {', '.join(BACKENDS)}{hint}")
    return text


def backend_list(text: str) -> list[str]:
    """An argparse type: one or more kvcm backend names, comma-separated (``python,cpp``)."""
    names = [b.strip() for b in text.split(",") if b.strip()]
    if not names:
        raise argparse.ArgumentTypeError("at least one backend")
    from kvcm._select import BACKENDS

    for b in names:
        if b not in BACKENDS:
            raise argparse.ArgumentTypeError(f"unknown backend {b!r}; choices: {', '.join(BACKENDS)}")
    return names


def names_in(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: one or more of ``choices``, comma-separated, in the order given
    (``what`` names them in the error: "workload", "configuration")."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0] if bad else text!r}; "
                                             f"choices: {', '.join(choices)}")
        return names
    return parse


def finite_in(lo: float, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in ``lo..hi`` (``lo_open``: ``> lo``)."""
    import math

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(v) or v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
            bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return v

    return parse


def writable_file(prog: str, option: str, path: str) -> str | None:
    """Why ``path`` cannot be written (its directory missing or not writable, a directory
    itself), as one line naming ``option``; None when it can.  Checked before a long run,
    so a bad path is not found after it."""
    import os

    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{prog}: {option} {path}: is a directory"
    if not os.path.isdir(where):
        return f"{prog}: {option} {path}: no such directory {where}"
    if not os.access(where, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{prog}: {option} {path}: not writable"
    return None


# The optional dependencies of each command, the extra that installs them.
EXTRAS = {"zmq": "events", "msgspec": "events", "matplotlib": "route", "fastapi": "proxy", "uvicorn": "proxy",
          "httpx": "proxy"}
# Each extra's packages (pyproject.toml): installing them directly does not rebuild kvcm.
EXTRA_PACKAGES = {"events": "pyzmq msgspec", "route": "pyzmq msgspec matplotlib",
                  "proxy": "fastapi uvicorn httpx pyzmq msgspec"}


def missing_extra(prog: str, e: ImportError, extra: str | None = None) -> str | None:
    """One line naming the extra to install (``extra``, or the one that brings the
    module) when ``e`` is a missing optional dependency of kvcm (None for any other
    import error)."""
    name = (getattr(e, "name", None) or "").split(".")[0]
    if name not in EXTRAS:
        return None
    extra = extra or EXTRAS[name]
    return (f"{prog}: needs the {name!r} module, from the {extra!r} extra: pip install 'kvcm[{extra}]' "
            f"(or 'kvcm[all]'; into an installed kvcm without rebuilding it: pip install {EXTRA_PACKAGES[extra]})")


def oplog_unusable(prog: str) -> str | None:
    """One line when ``KVCM_OPLOG`` is set to a path the op log cannot use (a missing
    directory, ``/proc``, a symlink, ...): checked before a command builds managers, so
    it is a usage error rather than an error in each backend's column."""
    import os

    if not os.environ.get("KVCM_OPLOG"):
        return None
    from kvcm.oplog.record import check_env_path

    why = check_env_path()
    return None if why is None else f"{prog}: {why}"


TORCH_HINT = "pip install torch==2.13.0 (the pinned CPU build; a plain `torch` pulls a multi-GB CUDA build)"


def torch_missing(prog: str) -> str | None:
    """One line when torch (the data plane's pools, the reference engine) is not
    installed; None when it imports."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return f"{prog}: needs torch: {TORCH_HINT}"
    return None
