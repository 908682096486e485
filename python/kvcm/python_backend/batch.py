"""The batched decode step: ``resize_batch`` / ``commit_batch`` (C++ twin: ``cpp/core/batch.cpp``).

Semantics and check order: ``kvcm.api.KVCacheManager.resize_batch`` / ``commit_batch`` and
DECISIONS.md.  One call does what a loop of the single calls does, in batch order, but runs
every item's check (the single call's ``check_*``) before the first item's work (its
``*_checked`` body).  The manager's methods take its lock and call these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvcm.api import ClosedError, InvalidStateError, KVCache
from kvcm.checks import check_batch_caches, check_counts, check_tokens
from kvcm.python_backend.request import PyKVCache

T = TypeVar("T")


def _at(what: str, i: int, check: Callable[[], T]) -> T:
    """Run one batch item's check; its error names the item (same type, for the caller)."""
    try:
        return check()
    except (ClosedError, InvalidStateError, ValueError, TypeError) as e:
        raise type(e)(f"{what}(): caches[{i}]: {e}") from None


def check_batch(mgr: Any, caches: Any, what: str) -> list[PyKVCache]:
    """Check 1 of the batch calls: the caches, item by item in batch order (each an open
    cache of ``mgr``, none twice)."""
    return check_batch_caches(what, caches, lambda c: isinstance(c, PyKVCache) and c.mgr is mgr,
                              lambda c: c.serial)


def resize_batch(mgr: Any, caches: Sequence[KVCache], capacities: Any, history_lengths: Any) -> list[bool]:
    """SPEC sec. 7 resize, for each cache in batch order, every check first."""
    what = "resize_batch"
    reqs = check_batch(mgr, caches, what)
    n = len(reqs)
    caps = check_counts(capacities, "capacities", n, what)
    hists = [None] * n if history_lengths is None else check_counts(history_lengths, "history_lengths", n, what)
    args = [_at(what, i, lambda r=r, c=c, h=h: r.check_resize(c, h))
            for i, (r, c, h) in enumerate(zip(reqs, caps, hists))]
    # validated as a whole: now the single calls' bodies, in batch order
    return [r.resize_checked(c, h) for r, (c, h) in zip(reqs, args)]


def commit_batch(mgr: Any, caches: Sequence[KVCache], tokens: Any) -> None:
    """SPEC sec. 7 commit of one token per cache, in batch order, every check first."""
    what = "commit_batch"
    reqs = check_batch(mgr, caches, what)
    toks = check_tokens(tokens)
    if len(toks) != len(reqs):
        raise ValueError(f"{what}(): tokens has {len(toks)} items for {len(reqs)} caches")
    for i, r in enumerate(reqs):
        _at(what, i, lambda r=r: r.check_commit(1))
    for r, t in zip(reqs, toks):
        r.commit_checked([t])
