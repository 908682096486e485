"""The manager: the facade of the python backend (SPEC sec. 7 to 11, 15, 18).

C++ twin: ``cpp/core/manager.{h,cpp}``.  A ``PyKVCacheManager`` owns the ids, the request
registries and the lock, and holds one ``BlockPool`` (``block_pool.py``: pages, pools,
eviction, the tree, the clock, copy ops, events, stats) that it hands to each ``Request``
(``request.py``: one request's life cycle).  Its entry points check their arguments and
call into the pool and the requests; the batched decode step is in ``batch.py``, snapshot
and invariant checks in ``observe.py``.  Everything here is deterministic: no wall clock,
no hash-seed or dict-order dependence in what is observable.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvcm.api import (
    CopyOp,
    Event,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    ReuseProbe,
    ReuseScope,
    Token,
)
from kvcm.checks import (
    FORGET_IN_EXPLICIT,
    SETTLE_IN_DRAIN,
    check_cache_id,
    check_copy_ops,
    check_priority,
    check_scope,
    check_shared_hits,
    check_tokens,
    check_tokens_packed,
    default_cache_id,
    shut_down_error,
    still_open_error,
)
from kvcm.config import LifeCycle, resolve_quota
from kvcm.keys import chain_keys, scope_root_key
from kvcm.python_backend import batch, observe
from kvcm.python_backend.block_pool import NO_NODE, BlockPool
from kvcm.python_backend.locking import serialized
from kvcm.python_backend.pools import Page
from kvcm.python_backend.request import Request


class PyKVCacheManager(KVCacheManager):
    backend_name = "python"

    def __init__(self, config: KVCacheManagerConfig, *, backend: str | None = None) -> None:
        # ``backend`` arrives when built through kvcm.KVCacheManager(config, backend=...)
        self.pool = BlockPool(config)
        self._config = config
        self.next_request = 0  # creation serial of requests; also the default request id
        self.requests: dict[int, Request] = {}  # serial -> live (not closed) cache
        self.open_ids: set[int | str] = set()  # ids of the open caches
        self.is_shutdown = False
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ public API

    @property
    def config(self) -> KVCacheManagerConfig:
        return self._config

    @property
    def life_cycles(self) -> tuple[LifeCycle, ...]:
        return self.pool.layout.lcs

    @serialized
    def _create_kv_cache(self, input_tokens: Sequence[Token] | None, scope: ReuseScope | None, priority: int | None,
                         id: int | str | None, shared_hits: Any) -> Request:
        """SPEC sec. 7 create_kv_cache: match once and hold the match, SUSPENDED.  With
        ``shared_hits`` the match may extend into the shared tier (DECISIONS.md "The shared tier")."""
        # the tokens are read first: any Python code they run (tolist, __iter__) runs
        # before this call looks at any state (DECISIONS "Tokens")
        tokens, packed = check_tokens_packed(() if input_tokens is None else input_tokens, "input_tokens")
        scope = check_scope(scope)
        prio = check_priority(priority, self._config.default_priority)
        cache_id = check_cache_id(id)
        hits = check_shared_hits(shared_hits, len(self.pool.layout.lcs), self.pool.layout.has_shared)
        if cache_id is not None and cache_id in self.open_ids:
            raise ValueError(f"id {cache_id!r} is already used by an open cache")
        if self.is_shutdown:
            raise shut_down_error()
        serial, cache_id = self.new_request(cache_id)
        cache = Request(self.pool, self, serial, cache_id, tokens, packed, scope, prio,
                        None if hits is None else set(hits))
        self.pool.outbox.record_match(len(tokens), cache.num_reused_tokens)  # (hit-rate stats: creates only)
        self.register(cache)
        return cache

    @serialized
    def probe_reuse(self, tokens: Sequence[Token], scope: ReuseScope | None = None, shared_hits: Any = None) -> int:
        return self._probe(tokens, scope, shared_hits, False).num_tokens

    @serialized
    def probe_reuse_detail(self, tokens: Sequence[Token], scope: ReuseScope | None = None,
                           shared_hits: Any = None) -> ReuseProbe:
        """SPEC sec. 6 probe_reuse: the match ``create_kv_cache`` would take now
        (``BlockPool.match_with_hits``, the shared tier's hits included) and the tiers of
        what it would hold, with no side effect (no tick, no LRU touch, no stats, no node)."""
        return self._probe(tokens, scope, shared_hits, True)

    def _probe(self, tokens: Any, scope: Any, shared_hits: Any, with_tiers: bool) -> ReuseProbe:
        """The probes' work; ``probe_reuse`` leaves the tiers out (``block_tiers`` ()): it
        reports only the length."""
        toks = check_tokens(tokens)
        scope = check_scope(scope)
        pool = self.pool
        hits = check_shared_hits(shared_hits, len(pool.layout.lcs), pool.layout.has_shared)
        root_key = scope_root_key(scope)  # nothing is kept for a scope (sec. 15)
        root = pool.tree.find_root(root_key)
        if not toks or (root == NO_NODE and hits is None):
            return ReuseProbe(0, 0)
        keys = chain_keys(root_key, toks[: len(toks) // pool.layout.B * pool.layout.B], pool.layout.B)
        m, mbs, path, _rows = pool.tree_index.match_with_hits(root, toks, keys, None if hits is None else set(hits))
        return ReuseProbe(m, mbs, pool.tree_index.block_tiers(path, m) if with_tiers else ())

    @serialized
    def shared_candidates(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> list[tuple[bytes, int]]:
        """DECISIONS.md "The shared tier": the ``(key, lc)`` the engine looks up in the store
        for ``tokens``: every full block past the tree path and every life cycle, by block
        then lc.  No side effect (no tick); [] without a shared tier."""
        toks = check_tokens(tokens)
        scope = check_scope(scope)
        pool = self.pool
        if not pool.layout.has_shared:
            return []
        root_key = scope_root_key(scope)
        keys = chain_keys(root_key, toks[: len(toks) // pool.layout.B * pool.layout.B], pool.layout.B)
        root = pool.tree.find_root(root_key)
        start = 0 if root == NO_NODE else len(pool.tree.key_path(root, keys))
        return [(keys[i], lc) for i in range(start, len(keys)) for lc in range(len(pool.layout.lcs))]

    # ---------------------------------------------------------------- batched decode step

    @serialized
    def resize_batch(self, caches: Sequence[KVCache], capacities: Any, history_lengths: Any = None) -> list[bool]:
        return batch.resize_batch(self.pool, caches, capacities, history_lengths)

    @serialized
    def commit_batch(self, caches: Sequence[KVCache], tokens: Any) -> None:
        batch.commit_batch(self.pool, caches, tokens)

    @serialized
    def drain_copy_ops(self) -> list[CopyOp]:
        return self.pool.outbox.take_copy_ops()

    @serialized
    def forget_copies(self, ops: Sequence[CopyOp]) -> list[int | str]:
        """SPEC sec. 15 failed copies (contract: kvcm.api.KVCacheManager.forget_copies)."""
        ops = check_copy_ops(ops)
        pool = self.pool
        if pool.outbox.explicit:
            raise ValueError(FORGET_IN_EXPLICIT)
        lost = pool.outbox.take_issued(ops, pool.pages.live)  # (checks every op first: ValueError, nothing changed)
        return self.roll_back_lost(lost) if ops else []

    @serialized
    def settle_copies(self, failed: Sequence[CopyOp] = ()) -> list[int | str]:
        """SPEC sec. 15, DECISIONS.md "Asynchronous copies: settle_copies" (contract:
        kvcm.api.KVCacheManager.settle_copies): the oldest unsettled drain is settled."""
        failed = check_copy_ops(failed, "settle_copies", "failed")
        pool = self.pool
        if not pool.outbox.explicit:
            raise ValueError(SETTLE_IN_DRAIN)
        lost = pool.outbox.settle_oldest(failed, pool.pages.live)  # (checks a drain and every op first: ValueError, nothing changed)
        return self.roll_back_lost(lost) if failed else []

    @property
    def unsettled_drains(self) -> int:
        return self.pool.outbox.unsettled_drains()

    def roll_back_lost(self, lost: list[Page]) -> list[int | str]:
        """SPEC sec. 15, the manager's part of a failure report (forget_copies,
        settle_copies): the clock ticks, the ``lost`` pages are forgotten and every open
        request that uses one is rolled back; returns their ids in creation order."""
        pool = self.pool
        pool.tick()
        lost_serials = {p.serial for p in lost}
        # the caches that use a lost page, and where each rolls back to (before any change)
        resets = []
        for serial in sorted(self.requests):
            r = self.requests[serial]
            point = r.rollback_point(lost_serials)
            if point is not None:
                resets.append((r, point))
        pool.tree_index.forget_pages(lost)
        for r, point in resets:
            r.roll_back(point)
        return [r.id for r, _ in resets]

    @serialized
    def clear_reusable(self) -> None:
        """SPEC sec. 8: drop every DROPPABLE page and prune the tree."""
        if self.is_shutdown:
            raise shut_down_error()
        pool = self.pool
        pool.tick()
        pool.evictor.drop_all_droppable()
        pool.outbox.emit_cleared()

    @serialized
    def shutdown(self) -> None:
        """SPEC sec. 8: needs every cache closed; drops what is reusable."""
        if self.requests:
            raise still_open_error(len(self.requests))
        if self.is_shutdown:
            return
        self.pool.tick()
        self.pool.evictor.drop_all_droppable()
        self.is_shutdown = True

    # ------------------------------------------------ quotas at run time (issue 22)

    @serialized
    def set_quota(self, tier: str | int, quota_bytes: int) -> None:
        """SPEC sec. 18, DECISIONS.md "Quotas at run time": resize the pools of ``tier``
        to what ``quota_bytes`` gives (split as at construction).  Growing adds slots at
        the top; shrinking evicts in sec. 8 order until the pages fit, then relocates the
        pages of the vanishing top slots into the lowest free ones (``relocate`` ops).
        Refused (OutOfPagesError, nothing changed) when the LOCKED and HELD pages that
        must stay could not fit."""
        pool = self.pool
        pos, q, per_lc = resolve_quota(pool.rc, tier, quota_bytes)
        if self.is_shutdown:
            raise shut_down_error()
        pool.pages.check_quota(pos, q, per_lc)
        pool.tick()
        pool.apply_quota(pos, q, per_lc)

    @serialized
    def stats(self) -> dict:
        return self.pool.stats_view(self.pool.outbox.totals)

    @serialized
    def take_iteration_stats(self) -> dict:
        return self.pool.take_iteration_stats()

    @serialized
    def take_events(self) -> list[Event]:
        return self.pool.outbox.take_events()

    @serialized
    def snapshot(self) -> dict:
        return observe.snapshot(self.pool, self.requests, self.next_request, self.is_shutdown)

    @serialized
    def check_invariants(self) -> None:
        observe.check_invariants(self.pool, self.requests)

    # ------------------------------------------------------------------ the registries

    def new_request(self, cache_id: int | str | None) -> tuple[int, int | str]:
        """A new request (created or forked): the clock ticks; its serial, and its id
        (``cache_id``, or the default one from the serial)."""
        self.pool.tick()
        serial = self.next_request
        self.next_request += 1
        return serial, default_cache_id(serial, self.open_ids) if cache_id is None else cache_id

    def register(self, r: Request) -> None:
        """``r`` (created or forked) is open: registered by serial and id."""
        self.requests[r.serial] = r
        self.open_ids.add(r.id)

    def fork_request(self, parent: Request, cache_id: int | str | None) -> Request:
        """SPEC sec. 18 fork, the registries' part (``Owner.fork_request``): the id is free,
        the parent's checks pass, then the child gets its serial and is registered."""
        if cache_id is not None and cache_id in self.open_ids:
            raise ValueError(f"id {cache_id!r} is already used by an open cache")
        copies = parent.check_fork()
        serial, cache_id = self.new_request(cache_id)
        child = parent.fork_checked(serial, cache_id, copies)
        self.register(child)
        return child

    def forget_request(self, r: Request) -> None:
        """``Owner.forget_request``: ``r`` closed and leaves the registries."""
        del self.requests[r.serial]
        self.open_ids.discard(r.id)
