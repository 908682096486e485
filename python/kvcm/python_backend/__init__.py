"""The python backend: the readable reference implementation of SPEC.md.

One file per concept, each mirroring its C++ twin in ``cpp/core/``: ``tree.py`` (radix tree,
matching, pruning), ``pools.py`` (page records, free slots, the eviction index),
``block_pool.py`` (``BlockPool``: the composition of its parts, each in its own file:
``layout.py`` the configuration's facts, ``pages.py`` pages and their users,
``tree_index.py`` the tree as requests use it, ``evictor.py`` eviction and its strategy,
``outbox.py`` copy ops, events and stats), ``request.py`` (``Request``: one request's life cycle, through the pool only),
``manager.py`` (``PyKVCacheManager``: the facade: ids, registries, lock, entry points),
``batch.py`` (batched decode step), ``observe.py`` (snapshot and invariant checks);
``locking.py`` holds the lock decorator the manager and its caches share.
"""

from kvcm.python_backend.manager import PyKVCacheManager
from kvcm.python_backend.request import PyKVCache, Request
from kvcm.python_backend.tree import RadixTree

__all__ = ["PyKVCache", "PyKVCacheManager", "RadixTree", "Request"]
