"""kvcm: a KV-cache block manager for LLM inference engines.

``kvcm.backend`` names the active default backend (``KVCM_BACKEND``, default ``cpp``).
"""

from __future__ import annotations

import sys

from kvcm._select import (
    BACKENDS,
    BackendUnavailableError,
    block_keys_impl,
    choose_default_backend,
    cli_entry,
    cpp_extension,
)
from kvcm.api import (
    AttentionLayer,
    ClearedEvent,
    ClosedError,
    ConfigError,
    CopyError,
    CopyOp,
    CopyRun,
    Event,
    InvalidStateError,
    InvariantError,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    KvcmError,
    OutOfPagesError,
    RemovedEvent,
    ReuseProbe,
    ReuseScope,
    SsmLayer,
    Status,
    StoredBlock,
    StoredEvent,
    Tier,
    TierChangedEvent,
)
from kvcm.config import LifeCycle
from kvcm.construct import install

__version__ = "0.1.0"

install()  # KVCacheManager(...) builds through kvcm.construct (the interface knows no backend)
try:
    backend: str = choose_default_backend()
    if backend == "cpp":
        cpp_extension()  # fail the import loudly, naming KVCM_BACKEND=python and how to build
except BackendUnavailableError as _e:
    # ``python -m kvcm ...`` / ``python -m kvcm.engine``: the package is imported before the
    # command's main() runs, so the command line's rule (exit 2, one line, no traceback) is
    # kept here; any other importer gets the exception.
    _prog = cli_entry()
    if _prog is None:
        raise
    print(f"{_prog}: {_e}", file=sys.stderr)
    raise SystemExit(2) from None


def block_keys(tokens, tokens_per_block: int, scope: ReuseScope | None = None, *, backend: str | None = None) -> list[bytes]:
    """One SHA-256 key per full or partial block of ``tokens`` (sec. 3)."""
    return block_keys_impl(backend)(tokens, tokens_per_block, scope)


__all__ = [
    "BACKENDS",
    "AttentionLayer",
    "BackendUnavailableError",
    "ClearedEvent",
    "ClosedError",
    "ConfigError",
    "CopyError",
    "CopyOp",
    "CopyRun",
    "Event",
    "InvalidStateError",
    "InvariantError",
    "KVCache",
    "KVCacheManager",
    "KVCacheManagerConfig",
    "KvcmError",
    "LifeCycle",
    "OutOfPagesError",
    "RemovedEvent",
    "ReuseProbe",
    "ReuseScope",
    "SsmLayer",
    "Status",
    "StoredBlock",
    "StoredEvent",
    "Tier",
    "TierChangedEvent",
    "backend",
    "block_keys",
]
