"""Backend selection (sec. 12): a default, then the env override, then validation.

Unlike a warning-only fallback, a bad choice fails loudly: an unknown ``KVCM_BACKEND``
or a missing compiled extension stops the import with a message saying what to do.
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
    pass


def _validate(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise BackendUnavailableError(f"{source}={name!r} is not a kvcm backend; choices: {', '.join(BACKENDS)}")
    return name


def default_backend() -> str:
    value = os.environ.get(ENV_VAR)
    if value is None or value == "":
        return DEFAULT_BACKEND
    return _validate(value, ENV_VAR)


def cpp_extension():
    try:
        from kvcm import _kvcm_cpp
    except ImportError as e:
        raise BackendUnavailableError(f"kvcm backend 'cpp': {BUILD_HINT} ({e})") from e
    return _kvcm_cpp


def manager_class(backend: str | None):
    """The KVCacheManager implementation class of ``backend`` (None → the active default)."""
    from kvcm import backend as active

    name = active if backend is None else _validate(backend, "backend")
    if name == "python":
        from kvcm.python_backend import PyKVCacheManager

        return PyKVCacheManager
    cpp_extension()
    from kvcm.cpp_backend import CppKVCacheManager

    return CppKVCacheManager


def block_keys_impl(backend: str | None):
    from kvcm import backend as active

    name = active if backend is None else _validate(backend, "backend")
    if name == "python":
        from kvcm.keys import block_keys_py

        return block_keys_py
    from kvcm.cpp_backend import block_keys_cpp

    return block_keys_cpp
