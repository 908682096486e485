"""Backend selection (sec. 12): a default, then the env override, then validation.

Unlike a warning-only fallback, a bad choice fails loudly: an unknown ``KVCM_BACKEND``
or a missing compiled extension stops the import with a message saying what to do.

This is the only module that imports the backends (``kvcm.python_backend``,
``kvcm.cpp_backend``); :mod:`kvcm.construct` wires it behind ``KVCacheManager(...)``.
Backends are imported when first chosen, so the cpp one (which needs the compiled
extension) is only imported where it is used.
"""

from __future__ import annotations

import os

DEFAULT_BACKEND = "cpp"
BACKENDS = ("cpp", "python")
ENV_VAR = "KVCM_BACKEND"

BUILD_HINT = (
    "the compiled extension kvcm._kvcm_cpp is not importable. Build it with "
    "`pip install .` (or `pip install --no-build-isolation -e .` for development), "
    "or select the reference backend with KVCM_BACKEND=python."
)


class BackendUnavailableError(ImportError):
    """The chosen backend cannot be used (SPEC sec. 12): ``KVCM_BACKEND`` or ``backend=``
    names no backend (the message lists the choices), or ``cpp`` is chosen and the
    compiled extension is not importable (the message says how to build it or to select
    ``KVCM_BACKEND=python``)."""


def _validate(name: str, source: str) -> str:
    if name not in BACKENDS:
        hint = f" (did you mean {name.lower()!r}? names are lower case)" if name.lower() in BACKENDS else ""
        raise BackendUnavailableError(
            f"{source}={name!r} is not a kvcm backend; choices: {', '.join(BACKENDS)}{hint}"
        )
    return name


def default_backend() -> str:
    value = os.environ.get(ENV_VAR)
    if value is None or value == "":
        return DEFAULT_BACKEND
    return _validate(value, ENV_VAR)


# The active default backend (``kvcm.backend``): chosen once, when ``import kvcm`` runs
# (kvcm/__init__.py calls choose_default_backend), and held here rather than read back
# from the kvcm package, which imports this module.
_active: str = DEFAULT_BACKEND


def choose_default_backend() -> str:
    """Read ``KVCM_BACKEND`` (sec. 12) and make it the default of every later call that
    passes no backend; returns it."""
    global _active
    _active = default_backend()
    return _active


def _chosen(backend: str | None) -> str:
    return _active if backend is None else _validate(backend, "backend")


def cli_entry() -> str | None:
    """``"python -m kvcm"`` (or ``"python -m kvcm.tools.soak"``, ...) while Python is still
    locating a kvcm module given to ``-m`` -- i.e. ``import kvcm`` is running as the first
    step of a kvcm command, not inside a program that imports kvcm; otherwise None.  While
    ``-m`` locates its module ``sys.argv[0]`` is ``"-m"``; ``sys.orig_argv`` names it."""
    import sys

    if sys.argv[:1] != ["-m"]:
        return None
    args = list(getattr(sys, "orig_argv", []))[1:]
    for i, a in enumerate(args):
        name = args[i + 1] if a == "-m" and i + 1 < len(args) else (a[2:] if a.startswith("-m") and len(a) > 2 else None)
        if name is not None:
            return f"python -m {name}" if name == "kvcm" or name.startswith("kvcm.") else None
    return None


def cpp_extension():
    """The compiled core ``kvcm._kvcm_cpp`` (loaded by name, as in :mod:`kvcm.cpp_backend`), or
    :class:`BackendUnavailableError` saying how to build it."""
    import importlib

    try:
        _kvcm_cpp = importlib.import_module("kvcm._kvcm_cpp")
    except ImportError as e:
        raise BackendUnavailableError(f"kvcm backend 'cpp': {BUILD_HINT} ({e})") from e
    return _kvcm_cpp


def manager_class(backend: str | None):
    """The KVCacheManager implementation class of ``backend`` (None → the active default)."""
    name = _chosen(backend)
    if name == "python":
        from kvcm.python_backend import PyKVCacheManager

        return PyKVCacheManager
    cpp_extension()
    from kvcm.cpp_backend import CppKVCacheManager

    return CppKVCacheManager


def block_keys_impl(backend: str | None):
    """``kvcm.block_keys`` of ``backend`` (None → the active default)."""
    name = _chosen(backend)
    if name == "python":
        from kvcm.keys import block_keys_py

        return block_keys_py
    from kvcm.cpp_backend import block_keys_cpp

    return block_keys_cpp
