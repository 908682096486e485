"""The python backend: the readable reference implementation of SPEC.md.

One file per concept, each mirroring its C++ twin in ``cpp/core/``: ``tree.py`` (radix tree,
matching, pruning), ``pools.py`` (pages, free slots, eviction index and victim choice),
``manager.py`` (page users, moves, events, stats), ``request.py`` (one request's life cycle),
``batch.py`` (batched decode step), ``observe.py`` (snapshot and invariant checks);
``locking.py`` holds the lock decorator the manager and its caches share.
"""

from kvcm.python_backend.manager import PyKVCacheManager
from kvcm.python_backend.request import PyKVCache
from kvcm.python_backend.tree import RadixTree

__all__ = ["PyKVCache", "PyKVCacheManager", "RadixTree"]
