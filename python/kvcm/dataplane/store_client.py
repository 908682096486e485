"""The shared tier without pools: :class:`StoreClient`, the store's batched existence query
for a side that decides what to load but moves no bytes (vLLM's scheduler asks it once per
tensor-parallel rank, each rank naming its objects with its rank; the consumer's hand-over
wait polls it).  Same store, object names, deadline and fault rules as a
:class:`~kvcm.dataplane.DataPlane`'s shared tier (both use the shared-tier I/O part), and no
pool, staging buffer or disk file: it never reads or writes a page.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcm.api import KVCacheManagerConfig
from kvcm.config import resolve_config
from kvcm.dataplane.shared_io import SharedIO
from kvcm.dataplane.store import ObjectCodec, SharedStore


class StoreClient:
    """The shared tier of ``config`` (its objects named by ``config.shared_namespace``) for
    existence queries only.  ``store``, ``shared_timeout_s``, ``shared_secret``: as
    :class:`~kvcm.dataplane.DataPlane`'s.  A config without a shared tier gives a client with
    no store (``shared`` None: nothing to ask)."""

    def __init__(self, config: KVCacheManagerConfig, *, store: SharedStore | None = None,
                 shared_timeout_s: float | None = None, shared_secret: bytes | str | None = None) -> None:
        self.config = config
        # pools=None, stats=None: lookups never touch a pool or count a copy
        self._io = SharedIO(config, resolve_config(config), None, None, store=store, timeout_s=shared_timeout_s,
                            secret=shared_secret)

    def shared_lookup(self, candidates: Iterable[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """The ``(key, lc)`` pairs of ``candidates`` (``mgr.shared_candidates``) whose objects
        the store holds: one batched existence query.  A store that cannot answer counts as
        empty (``shared_stats["lookup_errors"]``)."""
        return self._io.lookup(candidates)

    @property
    def shared(self) -> SharedStore | None:
        """The shared tier's store (None: no shared tier, or closed)."""
        return self._io.store

    @property
    def codec(self) -> ObjectCodec | None:
        """How objects are named, framed and authenticated (None: no shared tier)."""
        return self._io.codec

    @property
    def shared_timeout_s(self) -> float:
        """The deadline of one store call (0: none)."""
        return self._io.timeout_s

    @property
    def shared_stats(self) -> dict[str, int]:
        """The lookups' counters (``lookups``, ``lookup_names``, ``lookup_hits``,
        ``lookup_errors``, ``timeouts``; the others stay 0)."""
        return self._io.stats

    def close(self) -> None:
        """Release the store (idempotent; a store given as ``store=`` stays open)."""
        self._io.close()


__all__ = ["StoreClient"]
