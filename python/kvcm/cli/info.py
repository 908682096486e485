"""``python -m kvcm info``: the version, the active backend, the cpp extension and its
build, the Python and numpy versions, the shipped trace."""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Sequence

HELP = "active backend, version, cpp extension and build details"
ORDER = 10


def main(argv: Sequence[str]) -> int:
    """``python -m kvcm info``: version, active backend, the cpp extension and its build; exit status 0
    (2: bad usage)."""
    argparse.ArgumentParser(prog="python -m kvcm info").parse_args(list(argv))
    import kvcm
    from kvcm._select import ENV_VAR

    env = os.environ.get(ENV_VAR)
    print(f"kvcm {kvcm.__version__}")
    print(f"backend: {kvcm.backend} ({ENV_VAR}={env})" if env else f"backend: {kvcm.backend} (default)")
    print(f"backends: {', '.join(kvcm.BACKENDS)}")
    try:
        ext = kvcm.cpp_extension()
    except ImportError as e:
        print("cpp extension: not importable")
        print(f"  {e}")
    else:
        print(f"cpp extension: importable ({getattr(ext, '__file__', '?')})")
        build_info = getattr(ext, "build_info", None)
        if callable(build_info):
            try:
                info = build_info()
            except Exception as e:  # noqa: BLE001 - diagnostics only
                print(f"  build_info() failed: {e!r}")
            else:
                if isinstance(info, dict):
                    for k, v in info.items():
                        print(f"  {k}: {v}")
                else:
                    print(f"  {info}")
        else:
            print("  (no build_info())")
    print(f"python: {platform.python_version()} ({platform.python_implementation()}, {platform.machine()})")
    try:
        import numpy

        print(f"numpy: {numpy.__version__}")
    except ImportError:
        print("numpy: not installed (optional)")
    from kvcm.tools.trace import load_trace, shipped_trace_path

    try:
        n = len(load_trace())
        print(f"shipped trace: {shipped_trace_path()} ({n} requests)")
    except (OSError, ValueError) as e:
        print(f"shipped trace: unreadable ({e})")
    return 0

