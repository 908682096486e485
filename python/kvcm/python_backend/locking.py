"""The manager lock around public calls (SPEC sec. 10), shared by the manager and its caches.

A module of its own so that ``manager.py`` (which creates requests) and ``request.py``
(whose calls take the same lock) import it, and not each other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from kvcm.api import warn_pending_copy_ops

F = TypeVar("F", bound=Callable[..., Any])


def serialized(method: F) -> F:
    """SPEC sec. 10: run a public call under the manager's lock.  One scheduler thread is the
    intended use, but concurrent calls must never interleave half-way.  ``self`` is the
    manager, or a cache (whose ``mgr`` is its manager)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        mgr = getattr(self, "mgr", self)
        with mgr.lock:
            result = method(self, *args, **kwargs)
            if mgr.copy_ops_warn_due:  # after the call's work: the warning never changes it (sec. 15)
                mgr.copy_ops_warn_due = False
                warn_pending_copy_ops(mgr.copy_ops_warn_at)
            return result

    return wrapper  # type: ignore[return-value]
