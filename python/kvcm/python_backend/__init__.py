"""The python backend: the readable reference implementation of SPEC.md."""

from kvcm.python_backend.cache import PyKVCache
from kvcm.python_backend.manager import PyKVCacheManager
from kvcm.python_backend.tree import RadixTree

__all__ = ["PyKVCache", "PyKVCacheManager", "RadixTree"]
