"""The store factory: the shared tier's ``path`` (a directory, ``file:///dir`` or
``mooncake://host:port?metadata=url``) to a :class:`~kvcm.dataplane.store.SharedStore`.
Imports the Mooncake client only when a ``mooncake://`` location asks for it.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from kvcm.dataplane.store import FileStore, SharedStore, parse_timeout


def open_store(location: str, quota_bytes: int = 0, timeout_s: float | None = None) -> SharedStore:
    """The store a shared tier's ``path`` names: ``mooncake://host:port?metadata=<url>``
    (:class:`kvcm.dataplane.mooncake_store.MooncakeStore`), ``file:///dir[?timeout_s=S]`` or a plain
    directory.  ``timeout_s`` (both kinds): the data plane's deadline for one store call
    (default :data:`kvcm.dataplane.store.DEFAULT_TIMEOUT_S`; 0: none); Mooncake's set-up is
    bounded by it too (the argument ``timeout_s``, else the location's)."""
    if not isinstance(location, str) or not location:
        raise ValueError("the shared tier needs a path: a directory, file:///dir or mooncake://host:port?metadata=url")
    if location.startswith("mooncake://"):
        from kvcm.dataplane.mooncake_store import MooncakeStore  # only when asked for: an optional dependency

        return MooncakeStore.from_url(location, segment_bytes=quota_bytes, setup_timeout_s=timeout_s)
    timeout = None
    if location.startswith("file://"):
        path, _, q = location[len("file://"):].partition("?")
        query = parse_qs(q, keep_blank_values=True)
        if set(query) - {"timeout_s"}:
            raise ValueError(f"{location!r}: unknown parameters {sorted(set(query) - {'timeout_s'})}")
        if "timeout_s" in query:
            timeout = parse_timeout(query["timeout_s"][-1], location)
        location = path
    elif "://" in location:
        raise ValueError(f"unknown shared store {location!r}: use a directory, file:///dir or "
                         "mooncake://host:port?metadata=url")
    store = FileStore(location, quota_bytes)
    if timeout is not None:
        store.timeout_s = timeout
    return store
