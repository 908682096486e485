"""The manager: page users, moves, eviction, copy ops, events and stats (SPEC sec. 4, 8, 9, 15).

C++ twin: ``cpp/core/manager.{h,cpp}``.  One request's life cycle lives in ``request.py``,
the batched decode step in ``batch.py``, the radix tree in ``tree.py``, slot pools and the
victim choice in ``pools.py``, snapshot and invariant checks in ``observe.py``.  Everything
here is deterministic: no wall clock, no hash-seed or dict-order dependence in what is
observable.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvcm.api import (
    GPU,
    SHARED,
    ClearedEvent,
    CopyOp,
    Event,
    InvariantError,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    RemovedEvent,
    ReuseProbe,
    ReuseScope,
    StoredBlock,
    StoredEvent,
    TierChangedEvent,
    Token,
)
from kvcm.checks import (
    check_cache_id,
    check_copy_ops,
    check_priority,
    check_scope,
    check_shared_hits,
    check_tokens,
    check_tokens_packed,
    default_cache_id,
    quota_refused_error,
    shut_down_error,
    still_open_error,
)
from kvcm.config import resolve_config, resolve_quota
from kvcm.keys import chain_keys, scope_root_key
from kvcm.python_backend import batch, observe
from kvcm.python_backend.locking import serialized
from kvcm.python_backend.pools import DROPPABLE, NO_NODE, NoPool, Page, Pool
from kvcm.python_backend.request import PyKVCache
from kvcm.python_backend.tree import NO_PAGE, Node, RadixTree

_LC_COUNTERS = ("reused_blocks", "missed_blocks", "reused_tokens", "allocated_blocks", "offloads", "offload_bytes",
                "onboards", "onboard_bytes", "drops", "drop_bytes", "cows", "snapshots_taken", "snapshots_skipped",
                "lost_pages", "shared_stores", "shared_store_bytes", "shared_hit_blocks", "relocations")


def _removed_event(event_id: int, key: bytes, lc: int) -> RemovedEvent:
    return RemovedEvent(event_id, (key,), lc)


def _stored_event(event_id: int, parent: bytes | None, key: bytes, tokens: Sequence,
                  rows: Sequence[tuple[int, int, int, int]], partial: bool) -> StoredEvent:
    """A ``stored`` event from what :meth:`PyKVCacheManager.emit_stored` recorded: the
    block's parent key (None: no parent), key and tokens (``Node.tokens``), ``rows`` (lc,
    tier, priority, coverage) per lc."""
    toks = tuple(tokens)
    return StoredEvent(event_id, parent,
                       tuple(StoredBlock(key, len(toks), toks, lc, tier, prio, cov) for lc, tier, prio, cov in rows),
                       partial)


def _copy_op_setters() -> tuple[Callable[[CopyOp, Any], None], ...]:
    # CopyOp is a frozen slots dataclass: its __init__ goes through object.__setattr__ per
    # field (~0.6 us, one op per evicted page); its slot descriptors set the same fields in
    # half the time (as the cpp bindings fill them).  The result is an ordinary CopyOp.
    return tuple(getattr(CopyOp, f.name).__set__ for f in dataclasses.fields(CopyOp))


_SET_LC, _SET_SRC_TIER, _SET_SRC_SLOT, _SET_DST_TIER, _SET_DST_SLOT, _SET_REASON, _SET_KEY = _copy_op_setters()


def _copy_op(lc: int, src_tier: int, src_slot: int, dst_tier: int, dst_slot: int, reason: str,
             key: bytes | None = None) -> CopyOp:
    """``CopyOp(lc, src_tier, src_slot, dst_tier, dst_slot, reason, key)`` (see _copy_op_setters)."""
    op = object.__new__(CopyOp)
    _SET_LC(op, lc)
    _SET_SRC_TIER(op, src_tier)
    _SET_SRC_SLOT(op, src_slot)
    _SET_DST_TIER(op, dst_tier)
    _SET_DST_SLOT(op, dst_slot)
    _SET_REASON(op, reason)
    _SET_KEY(op, key)
    return op


_MAX_STORED_ROWS = 4096  # emit_stored's shared rows kept at most (then it starts over)

# the counters a move counts, by reason
_MOVE_COUNTERS = {"offload": ("offloads", "offload_bytes"), "onboard": ("onboards", "onboard_bytes")}

# the events emit_lazy keeps as tuples, by kind
_STORED, _REMOVED, _TIER_CHANGED = 0, 1, 2
_LAZY_EVENTS: tuple[Callable[..., Event], ...] = (_stored_event, _removed_event, TierChangedEvent)


class PyKVCacheManager(KVCacheManager):
    backend_name = "python"

    def __init__(self, config: KVCacheManagerConfig, *, backend: str | None = None) -> None:
        # ``backend`` arrives when built through kvcm.KVCacheManager(config, backend=...)
        rc = resolve_config(config)
        self._rc = rc
        self._config = config
        self.B = config.tokens_per_block
        self.lcs = rc.life_cycles
        self.attn_lcs = [lc.id for lc in self.lcs if lc.kind == "attn"]
        # sec. 5 pruning: the ordinals below which a block that loses its page of an lc loses
        # its subtree too (full attention: every block; windowed: the sink blocks; ssm: none)
        self.subtree_below = [(1 << 63 if lc.is_full_attention else lc.num_sink_blocks(self.B)) if lc.kind == "attn"
                              else 0 for lc in self.lcs]
        # no windowed attention: no block ever becomes stale (the decode step's fast paths)
        self.full_attention_only = all(lc.window is None for lc in self.lcs if lc.kind == "attn")
        self.ssm_lc = rc.ssm_lc
        self.num_tiers = len(rc.tier_kinds)
        # pools are indexed by config position; copy ops, events, stats and snapshots
        # report SPEC's tier number by kind (gpu 0, host 1, disk 2): tier_ids maps at that boundary
        self.tier_ids = rc.tier_ids
        # the shared tier (DECISIONS.md "The shared tier"): a shared page's ``tier`` is the
        # position after the local tiers; it has no slot (-1) and is in no pool
        self.has_shared = rc.has_shared
        self.shared_write_evict = rc.has_shared and rc.shared_write_evict
        self.shared_pos = self.num_tiers
        self.store_on_commit = self.has_shared and not self.shared_write_evict
        self.evicting = False  # shared_write="evict": an eviction drop is running (retire_nodes writes too)
        if self.has_shared:
            self.tier_ids = (*rc.tier_ids, SHARED)
        self.pages: dict[int, Page] = {}  # live pages by serial (= tree page handle)
        self.pools = [[Pool(t, lc.id, rc.slots[t][lc.id], self.pages) for lc in self.lcs] for t in range(self.num_tiers)]
        self.quotas = list(rc.quotas)  # quota_bytes per local tier (set_quota changes them)
        # the pools by a page's tier position, the shared tier's included (its pages are in
        # no pool: NoPool): the written-out restates index pages without a test for it
        self.page_pools = [*self.pools, [NoPool()] * len(self.lcs)]
        self.tree = RadixTree(self.B, self.lcs)
        self.clock = 0  # logical clock (sec. 4): ticks once per state-changing public call
        self.next_page = 0
        self.next_request = 0  # creation serial of requests; also the default request id
        self.requests: dict[int, PyKVCache] = {}  # serial -> live (not closed) cache
        self.open_ids: set[int | str] = set()  # ids of the open caches
        self.copy_ops: list[CopyOp] = []
        self.copy_pages: list[int] = []  # serial of the page each pending op fills
        # the ops of the last drain not reported yet, with the page each fills (forget_copies)
        # (two lists, not a list of pairs: a drain makes no object per op)
        self.issued: list[CopyOp] = []
        self.issued_pages: list[int] = []
        # sec. 15: undrained copy ops are a visible bound: stats()["pending_copy_ops"] and one
        # PendingCopyOpsWarning when they reach the configured figure (DECISIONS.md)
        self.copy_ops_warn_at = config.pending_copy_ops_warning
        self.copy_ops_warned = False
        self.copy_ops_warn_due = False
        # Events, or the tuples emit_lazy keeps (built when read); a full buffer drops its
        # oldest on append by itself (maxlen), counted in emit / _event_slot
        self.max_events = config.max_events
        self.events: deque[Event | tuple] = deque(maxlen=config.max_events)
        self.events_dropped = 0
        self._stored_rows: dict[int, tuple] = {}  # emit_stored's shared one-lc rows
        self.next_event = 0
        self.is_shutdown = False
        self.totals = self._zero_counters()
        self.iteration = self._zero_counters()
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ public API

    @property
    def config(self) -> KVCacheManagerConfig:
        return self._config

    @property
    def life_cycles(self):
        return self.lcs

    @serialized
    def create_kv_cache(self, input_tokens: Sequence[Token] | None = None, scope: ReuseScope | None = None,
                        priority: int | None = None, id: int | str | None = None,
                        shared_hits: Any = None) -> PyKVCache:
        """SPEC sec. 7 create_kv_cache: match once and hold the match, SUSPENDED.  With
        ``shared_hits`` the match may extend into the shared tier (DECISIONS.md "The shared tier")."""
        # the tokens are read first: any Python code they run (tolist, __iter__) runs
        # before this call looks at any state (DECISIONS "Tokens")
        tokens, packed = check_tokens_packed(() if input_tokens is None else input_tokens, "input_tokens")
        scope = check_scope(scope)
        prio = check_priority(priority, self._config.default_priority)
        cache_id = check_cache_id(id)
        hits = check_shared_hits(shared_hits, len(self.lcs), self.has_shared)
        if cache_id is not None and cache_id in self.open_ids:
            raise ValueError(f"id {cache_id!r} is already used by an open cache")
        if self.is_shutdown:
            raise shut_down_error()
        serial, cache_id = self.new_request(cache_id)
        cache = PyKVCache(self, serial, cache_id, tokens, packed, scope, prio, None if hits is None else set(hits))
        self.open_ids.add(cache_id)
        return cache

    def probe_reuse(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> int:
        return self.probe_reuse_detail(tokens, scope).num_tokens

    @serialized
    def probe_reuse_detail(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> ReuseProbe:
        """SPEC sec. 6 probe_reuse: the match with no side effect (no tick, no LRU touch, no stats)."""
        toks = check_tokens(tokens)
        scope = check_scope(scope)
        root_key = scope_root_key(scope)  # nothing is kept for a scope (sec. 15)
        root = self.tree.find_root(root_key)
        if root == NO_NODE or not toks:
            return ReuseProbe(0, 0)
        keys = chain_keys(root_key, toks[: len(toks) // self.B * self.B], self.B)
        m, mbs, _path = self.match(root, toks, keys)
        return ReuseProbe(m, mbs)

    @serialized
    def shared_candidates(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> list[tuple[bytes, int]]:
        """DECISIONS.md "The shared tier": the ``(key, lc)`` the engine looks up in the store
        for ``tokens``: every full block past the tree path and every life cycle, by block
        then lc.  No side effect (no tick); [] without a shared tier."""
        toks = check_tokens(tokens)
        scope = check_scope(scope)
        if not self.has_shared:
            return []
        root_key = scope_root_key(scope)
        keys = chain_keys(root_key, toks[: len(toks) // self.B * self.B], self.B)
        root = self.tree.find_root(root_key)
        start = 0 if root == NO_NODE else len(self.tree.key_path(root, keys))
        return [(keys[i], lc) for i in range(start, len(keys)) for lc in range(len(self.lcs))]

    def match_shared(self, root: int, keys: list[bytes], hits: set[tuple[bytes, int]]) -> tuple[int, list[int],
                                                                                              list[list[int]]]:
        """DECISIONS.md "The shared tier": the match extended by the store's hits.  The tree
        path ``[0, P)`` (full blocks by key), then the blocks ``P .. L`` (``L`` the last full
        block with a hit; coverage B per hit lc, else 0), backoff, then the fixed point of
        SPEC sec. 6 step 3 with no partial step.  Returns ``(m, tree_path, rows)``:
        ``rows[k]`` the coverage per lc of block ``P + k``; ``m`` is -1 without a hit."""
        B = self.B
        path = self.tree.key_path(root, keys)
        rows = [[B if (keys[i], lc) in hits else 0 for lc in range(len(self.lcs))]
                for i in range(len(path), len(keys))]
        while rows and not any(rows[-1]):
            rows.pop()
        if not rows:
            return -1, path, rows
        m = max(0, (len(path) + len(rows)) * B - self._config.reuse_match_backoff)
        return self.tree.prune_extended(path, rows, m), path, rows

    # ---------------------------------------------------------------- batched decode step

    @serialized
    def resize_batch(self, caches: Sequence[KVCache], capacities: Any, history_lengths: Any = None) -> list[bool]:
        return batch.resize_batch(self, caches, capacities, history_lengths)

    @serialized
    def commit_batch(self, caches: Sequence[KVCache], tokens: Any) -> None:
        batch.commit_batch(self, caches, tokens)

    @serialized
    def drain_copy_ops(self) -> list[CopyOp]:
        ops, self.copy_ops = self.copy_ops, []
        pages, self.copy_pages = self.copy_pages, []
        self.issued, self.issued_pages = list(ops), pages  # (a copy: the caller owns ``ops``)
        return ops

    @serialized
    def forget_copies(self, ops: Sequence[CopyOp]) -> list[int | str]:
        """SPEC sec. 15 failed copies (contract: kvcm.api.KVCacheManager.forget_copies)."""
        ops = check_copy_ops(ops)
        pending: dict[CopyOp, list[int]] = {}  # op -> its indices in self.issued, in order
        for k, iop in enumerate(self.issued):
            pending.setdefault(iop, []).append(k)
        taken: set[int] = set()  # indices into self.issued, one per reported op
        for i, op in enumerate(ops):
            ks = pending.get(op)
            if not ks:
                raise ValueError(f"forget_copies(): ops[{i}] {op.to_json()} is not an unreported op of the "
                                 "last drain_copy_ops()")
            taken.add(ks.pop(0))
        if not taken:
            return []
        self.tick()
        lost: list[Page] = []
        for k in sorted(taken):
            page = self.pages.get(self.issued_pages[k])
            if page is not None and page not in lost:
                lost.append(page)
        self.issued = [e for k, e in enumerate(self.issued) if k not in taken]
        self.issued_pages = [e for k, e in enumerate(self.issued_pages) if k not in taken]
        lost_serials = {p.serial for p in lost}
        # the caches that use a lost page, and where each rolls back to (before any change)
        resets = []
        for serial in sorted(self.requests):
            r = self.requests[serial]
            point = r.rollback_point(lost_serials)
            if point is not None:
                resets.append((r, point))
        for page in lost:  # unlink lost committed pages (sec. 5 pruning, removed events)
            if self.pages.get(page.serial) is not page:
                continue  # freed with a subtree an earlier unlink removed
            self.count(page.lc, "lost_pages")
            if page.node != NO_NODE:
                if self.tree.is_attached(page.node):
                    self.unlink_committed(page)
                else:
                    self.unlink_from_node(page)
                if page.locks == 0 and page.holds == 0:
                    self.free_page(page)
        for r, point in resets:
            r.roll_back(point)
        return [r.id for r, _ in resets]

    @serialized
    def clear_reusable(self) -> None:
        """SPEC sec. 8: drop every DROPPABLE page and prune the tree."""
        if self.is_shutdown:
            raise shut_down_error()
        self.tick()
        self._drop_all_droppable()
        self.emit(ClearedEvent(self.event_id()))

    @serialized
    def shutdown(self) -> None:
        """SPEC sec. 8: needs every cache closed; drops what is reusable."""
        if self.requests:
            raise still_open_error(len(self.requests))
        if self.is_shutdown:
            return
        self.tick()
        self._drop_all_droppable()
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
        pos, q, per_lc = resolve_quota(self._rc, tier, quota_bytes)
        if self.is_shutdown:
            raise shut_down_error()
        for lc, n in enumerate(per_lc):  # every pool is checked before any changes
            pool = self.pools[pos][lc]
            movable = min(pool.held, self._capacity_of(pos + 1, lc, None)) if pos < self.num_tiers - 1 else 0
            need = pool.total - pool.nfree - pool.droppable - movable
            if n < need:
                raise quota_refused_error(self._rc.tier_kinds[pos], q, lc, n, need, pool.locked, pool.held - movable)
        self.tick()
        for lc, n in enumerate(per_lc):
            self._resize_pool(pos, lc, n)
        self.quotas[pos] = q

    def _resize_pool(self, tier: int, lc: int, n: int) -> None:
        """Pool (tier, lc) to ``n`` slots; shrinking, room was checked by set_quota."""
        pool = self.pools[tier][lc]
        if n >= pool.total:
            pool.grow(n)
            return
        while pool.total - pool.nfree > n:  # evict what must go, in the usual order (sec. 8)
            if not self.evict_one(tier, lc):
                raise AssertionError(f"kvcm bug: set_quota found no victim in pool ({tier}, {lc})")
        # the survivors of slots [n, total) move down, by slot, each to the lowest free slot
        for page in sorted((p for p in self.pages.values() if p.tier == tier and p.lc == lc and p.slot >= n),
                           key=lambda p: p.slot):
            self.relocate(page)
        pool.shrink(n)

    def relocate(self, page: Page) -> None:
        """Move ``page`` to the lowest free slot of its own pool (a ``relocate`` op; its
        state, eviction key and events are unchanged: events name no slot)."""
        pool = self.pools[page.tier][page.lc]
        old = page.slot
        page.slot = pool.take_slot()
        pool.give_slot(old)
        tid = self.tier_ids[page.tier]
        self._add_copy_op(_copy_op(page.lc, tid, old, tid, page.slot, "relocate"))
        self.copy_pages.append(page.serial)
        self.count(page.lc, "relocations")

    @serialized
    def stats(self) -> dict:
        return self.stats_view(self.totals)

    @serialized
    def take_iteration_stats(self) -> dict:
        view = self.stats_view(self.iteration)
        self.iteration = self._zero_counters()
        return view

    @serialized
    def take_events(self) -> list[Event]:
        out = self.built_events()
        self.events.clear()
        return out

    def built_events(self) -> list[Event]:
        """The buffered events as Event objects, oldest first (see :meth:`emit_lazy`)."""
        return [e if isinstance(e, Event) else _LAZY_EVENTS[e[0]](*e[1:]) for e in self.events]

    @serialized
    def snapshot(self) -> dict:
        return observe.snapshot(self)

    @serialized
    def check_invariants(self) -> None:
        observe.check_invariants(self)

    # ------------------------------------------------------------------ services for caches

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def new_request(self, cache_id: Any) -> tuple[int, Any]:
        """A new request (created or forked): the clock ticks; its serial, and its id
        (``cache_id``, or the default one from the serial)."""
        self.tick()
        serial = self.next_request
        self.next_request += 1
        return serial, default_cache_id(serial, self.open_ids) if cache_id is None else cache_id

    def match(self, root: int, tokens: list, keys: list[bytes]) -> tuple[int, int, list[int]]:
        cfg = self._config
        return self.tree.match(root, tokens, keys, cfg.enable_partial_reuse, cfg.reuse_match_backoff)

    # --- page users.  Every change of a page's state goes through restate so the pool
    # counters and eviction heaps never disagree with the derived state (sec. 4).

    def new_page(self, tier: int, lc: int, coverage: int, priority: int, ordinal: int) -> Page:
        """SPEC sec. 4: a private page in the lowest free slot (the caller made room), no user yet."""
        page = self.make_page(tier, lc, self.pools[tier][lc].take_slot(), coverage, priority, ordinal)
        self.count(lc, "allocated_blocks")
        return page

    def new_shared_page(self, lc: int, priority: int, ordinal: int) -> Page:
        """DECISIONS.md "The shared tier": a page of a full block in the store (tier 3, no
        slot, in no pool), no user yet; the caller links it into its block."""
        page = self.make_page(self.shared_pos, lc, -1, self.B, priority, ordinal)
        self.count(lc, "shared_hit_blocks")
        return page

    def make_page(self, tier: int, lc: int, slot: int, coverage: int, priority: int, ordinal: int) -> Page:
        """A page with the next serial, last used now, registered by serial."""
        page = Page(self.next_page, lc, tier, slot, coverage, priority, self.clock, ordinal)
        self.next_page += 1
        self.pages[page.serial] = page
        return page

    # use / unuse / set_active are restate with the change written inline: they run per
    # page of every request, and a closure per call costs more than the change itself.

    def use(self, page: Page, active: bool, priority: int) -> None:
        """SPEC sec. 4: a request starts using ``page`` (LRU touch, priority raised to the request's)."""
        pool = self.page_pools[page.tier][page.lc]
        pool.unindex(page)
        if active:
            page.locks += 1
        else:
            page.holds += 1
        page.last_used = self.clock
        page.priority = max(page.priority, priority)
        pool.index(page)

    def unuse(self, page: Page, active: bool) -> None:
        """SPEC sec. 4: a request stops using ``page``: a private or orphaned page with no user left is
        freed; a tree page becomes DROPPABLE."""
        pool = self.page_pools[page.tier][page.lc]
        pool.unindex(page)
        if active:
            page.locks -= 1
        else:
            page.holds -= 1
        page.last_used = self.clock
        unused = page.locks == 0 and page.holds == 0
        if unused and page.node == NO_NODE:  # a private page nobody uses: freed (free_page, unindexed)
            pool.give_slot(page.slot)
            page.slot = -1
            del self.pages[page.serial]
            return
        pool.index(page)
        if unused:
            attached = self.tree.nodes[page.node].attached  # (tree.is_attached)
            if page.tier == self.shared_pos and attached:
                # DECISIONS "The shared tier": a shared page lives only while a request uses it
                self.unlink_committed(page)
                self.free_page(page)
            elif not attached:
                self.free_orphan_page(page)

    def set_active(self, page: Page, active: bool) -> None:
        """SPEC sec. 7 suspend/resume: LOCKED <-> HELD without touching LRU."""
        pool = self.page_pools[page.tier][page.lc]
        pool.unindex(page)
        if active:
            page.holds -= 1
            page.locks += 1
        else:
            page.locks -= 1
            page.holds += 1
        pool.index(page)

    def restate(self, page: Page, change: Callable[[], None]) -> None:
        """Apply ``change`` to ``page`` with its pool's counters and eviction index kept in step."""
        if page.tier == self.shared_pos:  # a shared page is in no pool
            change()
            return
        pool = self.pools[page.tier][page.lc]
        pool.unindex(page)
        change()
        pool.index(page)

    def free_page(self, page: Page) -> None:
        """Its slot back to the pool (SPEC sec. 4: the lowest free slot is handed out next)."""
        if page.tier == self.shared_pos:  # no slot, no pool
            del self.pages[page.serial]
            return
        pool = self.pools[page.tier][page.lc]
        pool.unindex(page)
        pool.give_slot(page.slot)
        page.slot = -1
        del self.pages[page.serial]

    # --- eviction (sec. 8)

    def can_allocate(self, tier: int, lc: int, n: int, adjust: dict | None = None) -> bool:
        """Whether ``n`` pages fit into pool (tier, lc) after eviction, without changing
        anything.  ``adjust`` overrides the gpu pool's (free, held, droppable) counters.
        SPEC sec. 8: what eviction could free, HELD pages only where a colder tier takes them."""
        return self._capacity_of(tier, lc, adjust) >= n

    def _capacity_of(self, tier: int, lc: int, adjust: dict | None) -> int:
        pool = self.pools[tier][lc]
        free, held, droppable = pool.nfree, pool.held, pool.droppable
        if adjust is not None and tier == GPU:
            free, held, droppable = adjust["free"], adjust["held"], adjust["droppable"]
        if tier == self.num_tiers - 1:
            return free + droppable
        return free + droppable + min(held, self._capacity_of(tier + 1, lc, None))

    def make_room(self, tier: int, lc: int) -> bool:
        """SPEC sec. 8: ensure pool (tier, lc) has a free slot, evicting one victim if needed:
        moved one tier colder (which may evict there first), else dropped (``Pool.victim``
        holds the order and which pages may go)."""
        pool = self.pools[tier][lc]
        if pool.free_slots:  # (nfree)
            return True
        return self.evict_one(tier, lc)

    def evict_one(self, tier: int, lc: int) -> bool:
        """SPEC sec. 8: free one more slot of pool (tier, lc) by evicting its first victim
        (make_room when it is full; set_quota's shrink with free slots left).  False:
        nothing could go, nothing changed."""
        pool = self.pools[tier][lc]
        nfree = pool.nfree
        if tier < self.num_tiers - 1:
            victim = pool.victim(movable=True)
            if victim is None:
                return False
            if self.make_room(tier + 1, lc):
                if pool.nfree > nfree:  # a drop down there removed a subtree and freed a slot here
                    return True
                self.move(victim, tier + 1, "offload")
                return True
            # the colder tier cannot take it (and nothing changed): only a drop is left
        victim = pool.victim(movable=False)
        if victim is None:
            return False
        if self.shared_write_evict:
            self.store_evicted(victim)
        self.evicting = self.shared_write_evict
        self.drop(victim)
        self.evicting = False
        return True

    def move(self, page: Page, dst: int, reason: str) -> None:
        """SPEC sec. 8: move ``page`` to a free slot of tier ``dst`` (the caller made room), with
        its copy op (offload / onboard) and ``tier_changed`` event.  A shared page (no slot,
        no pool) is onboarded by an op naming its object by block key (DECISIONS.md)."""
        lc = page.lc
        dst_pool = self.pools[dst][lc]
        old_tier, old_slot = page.tier, page.slot
        new_slot = dst_pool.take_slot()
        node = self.tree.nodes[page.node] if page.node != NO_NODE else None
        key = None
        if old_tier == self.shared_pos:
            key = node.key
        else:
            src_pool = self.pools[old_tier][lc]
            src_pool.unindex(page)
            src_pool.give_slot(old_slot)
        page.tier, page.slot = dst, new_slot
        dst_pool.index(page)
        tid = self.tier_ids
        self._add_copy_op(_copy_op(lc, tid[old_tier], old_slot, tid[dst], new_slot, reason, key))
        self.copy_pages.append(page.serial)
        name, bytes_name = _MOVE_COUNTERS[reason]
        self.count_bytes(lc, name, bytes_name, self.lcs[lc].slot_bytes)
        if node is not None and node.attached:
            eid = self._event_slot()  # emit_lazy without its argument tuple (one per moved page)
            if eid >= 0:
                self.events.append((_TIER_CHANGED, eid, node.key if key is None else key, lc, tid[old_tier], tid[dst]))

    def drop(self, page: Page) -> None:
        """SPEC sec. 8: drop a DROPPABLE page: unlink it from its block, prune, free its slot."""
        assert page.node != NO_NODE and not page.locks and not page.holds, "drop: not DROPPABLE"  # Page.state
        self.count_bytes(page.lc, "drops", "drop_bytes", self.lcs[page.lc].slot_bytes)
        self.unlink_committed(page)
        self.free_page(page)

    def unlink_committed(self, page: Page) -> None:
        """Remove ``page`` from its attached block and prune (sec. 5).  The page itself is
        left to the caller (freed, or kept by its users as an orphan page)."""
        node, lc = page.node, page.lc
        n = self.tree.nodes[node]
        key = n.key
        self.unlink_from_node(page)
        self.emit_lazy(_REMOVED, key, lc)  # emit_removed
        if n.ordinal < self.subtree_below[lc]:
            parent = n.parent
            if self.tree.is_bare_leaf(node):
                # the usual victim (a leaf holding no other page): what remove_subtree +
                # retire_nodes do to it, without the lists: it leaves the tree and dies
                # (unless a request still references it), nothing to announce
                self.tree.detach(node)
                self.tree.collect(node)
            else:
                self.retire_nodes(self.tree.remove_subtree(node))
            if parent is not None:
                self.tree.prune_upward(parent.id)
        else:
            self.tree.prune_upward(node)

    def unlink_from_node(self, page: Page) -> None:
        """``page`` leaves its block's slot (no event, no pruning: the callers do those)."""
        node = page.node
        pool = self.page_pools[page.tier][page.lc]  # restate, written out
        pool.unindex(page)
        page.node = NO_NODE
        pool.index(page)
        self.tree.clear_page(node, page.lc)  # may delete a dead orphan node

    def retire_nodes(self, node_ids: list[int], announce: bool = True) -> None:
        """SPEC sec. 5 pruning: blocks just detached: announce their pages gone, free the pages nobody uses
        (counted as drops); pages with users stay with the orphan."""
        for nid in node_ids:
            n = self.tree.nodes[nid]
            for lc, h in enumerate(n.pages):
                if h == NO_PAGE:
                    continue
                if announce:
                    self.emit_removed(n.key, lc)
                page = self.pages[h]
                if page.locks == 0 and page.holds == 0:
                    if self.evicting:  # freed with an evicted page: written back too
                        self.store_evicted(page)
                    self.count_bytes(lc, "drops", "drop_bytes", self.lcs[lc].slot_bytes)
                    self.free_orphan_page(page)
            self.tree.collect(nid)

    def free_orphan_page(self, page: Page) -> None:
        """Free a page nobody uses whose block is detached (or about to be forgotten)."""
        self.unlink_from_node(page)
        self.free_page(page)

    def _drop_all_droppable(self) -> None:
        """SPEC sec. 8 clear_reusable / shutdown: every DROPPABLE page goes, until none is left."""
        progress = True
        while progress:
            progress = False
            for tier_pools in self.pools:
                for pool in tier_pools:
                    while (page := pool.peek(DROPPABLE)) is not None:
                        self.drop(page)
                        progress = True

    # --- the shared tier's writes (DECISIONS.md "The shared tier")

    def store(self, page: Page, key: bytes) -> None:
        """A ``store`` op: ``page`` (a full-coverage page of the full block ``key``) is
        written to the shared tier.  It fills no page here (forget_copies forgets nothing)."""
        self._add_copy_op(_copy_op(page.lc, self.tier_ids[page.tier], page.slot, SHARED, -1, "store", key))
        self.copy_pages.append(-1)
        self.count_bytes(page.lc, "shared_stores", "shared_store_bytes", self.lcs[page.lc].slot_bytes)

    def store_evicted(self, page: Page) -> None:
        """``shared_write="evict"``: eviction is about to drop ``page``; a full-coverage page
        of a full block is written first."""
        node = self.tree.nodes[page.node]
        if page.coverage == self.B and len(node.tokens) == self.B:
            self.store(page, node.key)

    # --- copy ops, events

    def copy(self, lc: int, src: Page, dst: Page, reason: str) -> None:
        tid = self.tier_ids
        self._add_copy_op(_copy_op(lc, tid[src.tier], src.slot, tid[dst.tier], dst.slot, reason))
        self.copy_pages.append(dst.serial)

    def _add_copy_op(self, op: CopyOp) -> None:
        """SPEC sec. 8 copy ops, and sec. 15's one warning when the pending ones reach the figure."""
        self.copy_ops.append(op)
        if len(self.copy_ops) == self.copy_ops_warn_at and not self.copy_ops_warned:
            self.copy_ops_warned = self.copy_ops_warn_due = True  # warned once, at the call's end

    def emit(self, event: Event | tuple) -> None:
        """SPEC sec. 9 / 15: buffer ``event``; the oldest is dropped (and counted) when full."""
        if len(self.events) == self.max_events:  # full (0: always): one is dropped
            self.events_dropped += 1
            if not self.max_events:
                return
        self.events.append(event)  # (the oldest leaves by the deque's maxlen)

    def emit_lazy(self, kind: int, *args: Any) -> None:
        """:meth:`emit` of ``_LAZY_EVENTS[kind](event_id, *args)``, kept as a plain tuple and
        built only when taken or snapshotted (most events are never read; a frozen dataclass
        per block is the costliest thing a commit would build).  ``args`` are the values at
        emission, ints, bytes and tuples of them only: the record is no object the cyclic
        GC tracks, so the event buffer does not make the collector run more often."""
        eid = self._event_slot()
        if eid >= 0:
            self.events.append((kind, eid, *args))

    def _event_slot(self) -> int:
        """The next event's id, with room made for it in the buffer (:meth:`emit` written
        out: the oldest dropped and counted when full); -1 when ``max_events`` is 0 (the
        event is counted dropped at once and nothing needs gathering)."""
        eid = self.next_event
        self.next_event += 1
        if len(self.events) == self.max_events:  # full (0: always): one is dropped
            self.events_dropped += 1
            if not self.max_events:
                return -1
        return eid  # (the caller's append drops the oldest by the deque's maxlen)

    def event_id(self) -> int:
        self.next_event += 1
        return self.next_event - 1

    def emit_removed(self, key: bytes, lc: int) -> None:
        """SPEC sec. 9: ``removed`` for a block that lost its last page of ``lc`` or was detached."""
        eid = self._event_slot()  # emit_lazy without its argument tuple (one per dropped page)
        if eid >= 0:
            self.events.append((_REMOVED, eid, key, lc))

    def emit_stored(self, node_id: int, lcs: list[int]) -> None:
        """SPEC sec. 9: ``stored`` for a block that just gained (or regained) pages of ``lcs``."""
        if lcs:
            self.emit_stored_node(self.tree.nodes[node_id], lcs)

    def emit_stored_node(self, n: Node, lcs: list[int]) -> None:
        """:meth:`emit_stored` of the block ``n``, ``lcs`` not empty."""
        eid = self.next_event  # _event_slot written out: this runs once per committed block
        self.next_event += 1
        if len(self.events) == self.max_events:  # full (0: always): one is dropped
            self.events_dropped += 1
            if not self.max_events:  # nothing to gather
                return
        parent = n.parent.key if n.parent is not None else None
        pages, tid = self.pages, self.tier_ids
        if len(lcs) == 1:  # the common case without a generator (one frame less per block)
            lc = lcs[0]
            p = pages[n.pages[lc]]
            tier, prio, cov = tid[p.tier], p.priority, n.coverage[lc]
            # few distinct rows exist (a full block's are all alike): one shared object
            # each (two tuples less per event for the collector to count), found by the
            # row's fields packed into an int (tier 0..3, priority 0..100, coverage <= 4096)
            k = (((lc << 2 | tier) << 7 | prio) << 13) | cov
            rows: tuple | None = self._stored_rows.get(k)
            if rows is None:
                if len(self._stored_rows) >= _MAX_STORED_ROWS:
                    self._stored_rows.clear()
                rows = self._stored_rows[k] = ((lc, tier, prio, cov),)
        else:
            rows = tuple((lc, tid[pages[n.pages[lc]].tier], pages[n.pages[lc]].priority, n.coverage[lc])
                         for lc in lcs)
        # the node's key and tokens, shared with the node (never changed): nothing built per event
        self.events.append((_STORED, eid, parent, n.key, n.tokens, rows, len(n.tokens) < self.B))

    # --- stats

    def _zero_counters(self) -> dict:
        return {"requests": 0, "query_tokens": 0, "reused_tokens": 0,
                "lc": [dict.fromkeys(_LC_COUNTERS, 0) for _ in self.lcs]}

    def count(self, lc: int, name: str, n: int = 1) -> None:
        self.totals["lc"][lc][name] += n
        self.iteration["lc"][lc][name] += n

    def count_bytes(self, lc: int, name: str, bytes_name: str, nbytes: int) -> None:
        """``count(lc, name)`` and ``count(lc, bytes_name, nbytes)`` in one call (per evicted page)."""
        t, i = self.totals["lc"][lc], self.iteration["lc"][lc]
        t[name] += 1
        t[bytes_name] += nbytes
        i[name] += 1
        i[bytes_name] += nbytes

    def record_match(self, n_query: int, m: int) -> None:
        """Hit-rate stats count attention life cycles only (sec. 9)."""
        B = self.B
        for c in (self.totals, self.iteration):
            c["requests"] += 1
            c["query_tokens"] += n_query
            c["reused_tokens"] += m
            for lc in self.attn_lcs:
                d = c["lc"][lc]
                d["reused_tokens"] += m
                d["reused_blocks"] += -(-m // B)
                d["missed_blocks"] += -(-n_query // B) - -(-m // B)

    def stats_view(self, counters: dict) -> dict:
        """SPEC sec. 9: the stats dict of ``counters`` (cumulative or this iteration's)."""
        return {
            "requests": counters["requests"],
            "query_tokens": counters["query_tokens"],
            "reused_tokens": counters["reused_tokens"],
            "lc": [dict(c) for c in counters["lc"]],
            "tiers": [
                {
                    "tier": self.tier_ids[t],
                    "kind": self._rc.tier_kinds[t],
                    "quota_bytes": self.quotas[t],
                    "lc": [
                        {"total": p.total, "free": p.nfree, "locked": p.locked, "held": p.held,
                         "droppable": p.droppable}
                        for p in self.pools[t]
                    ],
                }
                for t in range(self.num_tiers)
            ],
            "events_dropped": self.events_dropped,
            "pending_copy_ops": len(self.copy_ops),
        }

    def check(self, cond: bool, message: str) -> None:
        if not cond:
            raise InvariantError(message)
