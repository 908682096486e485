"""The manager lock around public calls (SPEC sec. 10), shared by the manager and its caches.

A module of its own so that ``manager.py`` (which creates requests) and ``request.py``
(whose calls take the same lock) import it, and not each other.  It knows neither: it uses
the ``lock`` and the ``pool`` (a ``BlockPool``) that both hold.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def serialized(method: F) -> F:
    """SPEC sec. 10: run a public call under the manager's lock.  One scheduler thread is the
    intended use, but concurrent calls must never interleave half-way.  ``self`` is the
    manager or a cache: each has the manager's ``lock`` and its ``pool``."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            result = method(self, *args, **kwargs)
            self.pool.outbox.warn_copy_ops()  # after the call's work: the warning never changes it (sec. 15)
            return result

    return wrapper  # type: ignore[return-value]
