"""The python backend: the readable reference implementation of SPEC.md.

One file per concept, each mirroring its C++ twin in ``cpp/core/``: ``tree.py`` (radix tree,
matching, pruning), ``pools.py`` (pages, free slots, eviction index and victim choice),
``block_pool.py`` (``BlockPool``: pages and their users, moves, eviction, copy ops, events,
stats), ``request.py`` (``Request``: one request's life cycle, through the pool only),
``manager.py`` (``PyKVCacheManager``: the facade: ids, registries, lock, entry points),
``batch.py`` (batched decode step), ``observe.py`` (snapshot and invariant checks);
``locking.py`` holds the lock decorator the manager and its caches share.
"""

from kvcm.python_backend.manager import PyKVCacheManager
from kvcm.python_backend.request import PyKVCache, Request
from kvcm.python_backend.tree import RadixTree

__all__ = ["PyKVCache", "PyKVCacheManager", "RadixTree", "Request"]
