"""kvcm: a KV-cache block manager for LLM inference engines.

Start with :class:`KVCacheManagerConfig` and :class:`KVCacheManager`; a request is a
:class:`KVCache`.  The behaviour contract is ``docs/SPEC.md`` (the "SPEC sec. N" of every
docstring); the choices where it is silent are ``DECISIONS.md``.

``kvcm.backend`` names the active default backend (``KVCM_BACKEND``, default ``cpp``);
``kvcm.BACKENDS`` lists the choices.
"""

from __future__ import annotations

import sys

from kvcm import api
from kvcm._select import (
    BACKENDS,
    BackendUnavailableError,
    block_keys_impl,
    choose_default_backend,
    cli_entry,
    cpp_extension,
)
from kvcm.api import *  # the interface's public names: kvcm.api.__all__, listed once there
from kvcm.api import ReuseScope
from kvcm.config import LifeCycle
from kvcm.construct import install

__version__ = "0.1.0"

install()  # KVCacheManager(...) builds through kvcm.construct (the interface knows no backend)
try:
    backend: str = choose_default_backend()
    if backend == "cpp":
        cpp_extension()  # fail the import loudly, naming KVCM_BACKEND=python and how to build
except BackendUnavailableError as _e:
    # ``python -m kvcm ...`` / ``python -m kvcm.tools.soak``: the package is imported before the
    # command's main() runs, so the command line's rule (exit 2, one line, no traceback) is
    # kept here; any other importer gets the exception.
    _prog = cli_entry()
    if _prog is None:
        raise
    print(f"{_prog}: {_e}", file=sys.stderr)
    raise SystemExit(2) from None


def block_keys(tokens, tokens_per_block: int, scope: ReuseScope | None = None, *, backend: str | None = None) -> list[bytes]:
    """The block keys of ``tokens`` (SPEC sec. 3): one 32-byte SHA-256 key per full or
    partial block of ``tokens_per_block`` tokens, chained from the root key of ``scope``
    (None: the default scope).  The same keys the manager uses and events carry, identical
    on both backends and across processes, so an engine or a router computes them without
    a manager.  ``backend`` picks the implementation (None: ``kvcm.backend``).  Raises
    TypeError / ValueError for bad tokens, block size (1..4096) or scope."""
    return block_keys_impl(backend)(tokens, tokens_per_block, scope)


__all__ = ["BACKENDS", "BackendUnavailableError", "LifeCycle", "backend", "block_keys"]
__all__ += api.__all__
