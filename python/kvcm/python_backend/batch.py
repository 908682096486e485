"""The batched decode step: ``resize_batch`` / ``commit_batch`` (C++ twin: ``cpp/core/batch.cpp``).

Semantics and check order: ``kvcm.api.KVCacheManager.resize_batch`` / ``commit_batch`` and
DECISIONS.md.  One call does what a loop of the single calls does, in batch order, but runs
every item's check (the single call's ``check_*``) before the first item's work (its
``*_checked`` body).  The manager's methods take its lock and call these with its pool: a
batch item must be an open request of that pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcm.api import ClosedError, InvalidStateError, KVCache
from kvcm.checks import check_batch_caches, check_counts, check_tokens
from kvcm.python_backend.block_pool import BlockPool
from kvcm.python_backend.request import Request

# what a batch item's check raises; the batch call re-raises it naming the item
_ITEM_ERRORS = (ClosedError, InvalidStateError, ValueError, TypeError)


def _item_error(what: str, i: int, e: Exception) -> Exception:
    """The error of batch item ``i``'s check, naming the item (same type, for the caller).
    The checks run in one loop inside one ``try`` (a call per item would cost more than
    the checks)."""
    return type(e)(f"{what}(): caches[{i}]: {e}")


def check_batch(pool: BlockPool, caches: Any, what: str) -> list[Request]:
    """Check 1 of the batch calls: the caches, item by item in batch order (each an open
    cache of the manager whose pool is ``pool``, none twice)."""
    # ``type(c) is`` first: an ABC isinstance per item costs more than the rest of the check
    return check_batch_caches(what, caches, lambda c: (type(c) is Request or isinstance(c, Request)) and c.pool is pool,
                              lambda c: c.serial)


def resize_batch(pool: BlockPool, caches: Sequence[KVCache], capacities: Any, history_lengths: Any) -> list[bool]:
    """SPEC sec. 7 resize, for each cache in batch order, every check first."""
    what = "resize_batch"
    reqs = check_batch(pool, caches, what)
    n = len(reqs)
    caps = check_counts(capacities, "capacities", n, what)
    hists = [None] * n if history_lengths is None else check_counts(history_lengths, "history_lengths", n, what)
    args = []
    i = 0
    try:
        for i, (r, c, h) in enumerate(zip(reqs, caps, hists)):
            args.append(r.check_resize(c, h))
    except _ITEM_ERRORS as e:
        raise _item_error(what, i, e) from None
    # validated as a whole: now the single calls' bodies, in batch order
    return [r.resize_checked(c, h) for r, (c, h) in zip(reqs, args)]


def commit_batch(pool: BlockPool, caches: Sequence[KVCache], tokens: Any) -> None:
    """SPEC sec. 7 commit of one token per cache, in batch order, every check first."""
    what = "commit_batch"
    reqs = check_batch(pool, caches, what)
    toks = check_tokens(tokens)
    if len(toks) != len(reqs):
        raise ValueError(f"{what}(): tokens has {len(toks)} items for {len(reqs)} caches")
    i = 0
    try:
        for i, r in enumerate(reqs):
            r.check_commit(1)
    except _ITEM_ERRORS as e:
        raise _item_error(what, i, e) from None
    for r, t in zip(reqs, toks):
        r.commit_checked([t])
