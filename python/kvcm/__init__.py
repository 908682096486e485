"""kvcm: a KV-cache block manager for LLM inference engines.

``kvcm.backend`` names the active default backend (``KVCM_BACKEND``, default ``cpp``).
"""

from __future__ import annotations

from kvcm._select import BACKENDS, BackendUnavailableError, cpp_extension, default_backend
from kvcm.api import (
    AttentionLayer,
    ClearedEvent,
    ClosedError,
    ConfigError,
    CopyError,
    CopyOp,
    Event,
    InvalidStateError,
    InvariantError,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    KvcmError,
    LifeCycle,
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

__version__ = "0.1.0"

backend: str = default_backend()
if backend == "cpp":
    cpp_extension()  # fail the import loudly, naming KVCM_BACKEND=python and how to build


def block_keys(tokens, tokens_per_block: int, scope: ReuseScope | None = None, *, backend: str | None = None) -> list[bytes]:
    """One SHA-256 key per full or partial block of ``tokens`` (sec. 3)."""
    from kvcm._select import block_keys_impl

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
