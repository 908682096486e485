"""Backend construction: what ``kvcm.KVCacheManager(config, backend=None)`` builds.

The interface (:mod:`kvcm.api`) knows no backend; ``import kvcm`` calls :func:`install`,
which registers :func:`new_manager` as the factory behind ``KVCacheManager.__new__``.  It picks
the implementation with :mod:`kvcm._select` (the only module that imports the backends,
sec. 12) and, when ``KVCM_OPLOG`` is set, wraps it in the op log's recording proxy
(sec. 11).  ``isinstance(m, kvcm.KVCacheManager)`` holds for every result: the backends
and the proxy all subclass it.
"""

from __future__ import annotations

from typing import Any

from kvcm._select import manager_class
from kvcm.api import KVCacheManager, KVCacheManagerConfig, register_manager_factory


def new_manager(config: KVCacheManagerConfig | None = None, *args: Any, backend: str | None = None,
                **kw: Any) -> KVCacheManager:
    """An *uninitialised* manager of ``backend`` (None: ``kvcm.backend``) for
    ``KVCacheManager.__new__`` to return; Python then runs its ``__init__(config, ...,
    backend=...)``.  With ``KVCM_OPLOG`` set it is a recording proxy whose ``__init__``
    builds the real manager."""
    # imported on first use, as before the split: `import kvcm` does not load the op log
    from kvcm.oplog.record import maybe_wrap_class

    impl = maybe_wrap_class(manager_class(backend))
    return impl.__new__(impl, config, *args, **kw)


def install() -> None:
    """Make ``kvcm.KVCacheManager(...)`` build through :func:`new_manager`."""
    register_manager_factory(new_manager)


__all__ = ["install", "new_manager"]
