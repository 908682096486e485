"""The block pool: pages, pools, eviction, the tree, copy ops, events and stats (SPEC sec. 4, 5, 8, 9, 15).

C++ twin: ``cpp/core/block_pool.{h,cpp}``.  A ``BlockPool`` owns every piece of state that
is not one request's: the live pages, the slot pools of each (tier, lc) with their counters
and eviction index (``pools.py``), the radix tree (``tree.py``), the logical clock, the
pending copy ops, the event buffer and the stats counters, and the facts derived from the
configuration.  Its methods are the narrow surface a request (``request.py``) works through;
the manager (``manager.py``) owns the ids, the request registries and the lock.  Everything
here is deterministic: no wall clock, no hash-seed or dict-order dependence in what is
observable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvcm.api import (
    GPU,
    SHARED,
    ClearedEvent,
    CopyOp,
    Event,
    KVCacheManagerConfig,
    RemovedEvent,
    StoredBlock,
    StoredEvent,
    TierChangedEvent,
    Token,
    warn_pending_copy_ops,
)
from kvcm.checks import NOTHING_TO_SETTLE, not_in_oldest_drain_error, not_issued_error, quota_refused_error
from kvcm.config import LifeCycle, resolve_config
from kvcm.python_backend.pools import DROPPABLE, NO_NODE, Page, Pool
from kvcm.python_backend.tree import NO_PAGE, RadixTree

_LC_COUNTERS = ("reused_blocks", "missed_blocks", "reused_tokens", "allocated_blocks", "offloads", "offload_bytes",
                "onboards", "onboard_bytes", "drops", "drop_bytes", "cows", "snapshots_taken", "snapshots_skipped",
                "lost_pages", "shared_stores", "shared_store_bytes", "shared_hit_blocks", "relocations")

# the counters a move counts, by reason
_MOVE_COUNTERS = {"offload": ("offloads", "offload_bytes"), "onboard": ("onboards", "onboard_bytes")}

# what can_allocate may override of the gpu pool's counters: (free, held, droppable)
Adjust = tuple[int, int, int]


class RequestMatch(NamedTuple):
    """The match a request created now takes (``BlockPool.match_with_hits``; C++:
    ``RequestMatch`` in block_pool.h)."""

    m: int  # SPEC sec. 6: the match length
    m_before_ssm: int  # the same fixed point without the ssm rule, over the same blocks
    # the tree blocks of the match: the ``ceil(m / B)`` blocks of the ordinary match, or,
    # extended, the whole tree path ``[0, P)`` (the blocks past it are the extension's)
    path: list[int]
    rows: list[list[int]] | None  # extended: the coverage per lc of blocks P, P + 1, ...; else None

# An event is buffered as a plain tuple of its fields at emission, ``(kind, event_id,
# ...)``: ints, bytes and tuples of them, which the cyclic GC stops tracking (a buffer of
# frozen Event objects would make every collection walk it), built into its Event when read.
_STORED, _REMOVED, _TIER_CHANGED, _CLEARED = range(4)
EventRecord = tuple


def built_event(e: EventRecord) -> Event:
    """The :class:`kvcm.api.Event` of a buffered record (see ``BlockPool.emit``)."""
    kind = e[0]
    if kind == _STORED:  # (kind, id, parent key, key, tokens, rows (lc, tier, priority, coverage), partial)
        _, eid, parent, key, tokens, rows, partial = e
        toks = tuple(tokens)
        return StoredEvent(eid, parent, tuple(StoredBlock(key, len(toks), toks, *row) for row in rows), partial)
    if kind == _REMOVED:  # (kind, id, key, lc)
        return RemovedEvent(e[1], (e[2],), e[3])
    if kind == _TIER_CHANGED:  # (kind, id, key, lc, old tier, new tier)
        return TierChangedEvent(*e[1:])
    return ClearedEvent(e[1])  # (kind, id)


class BlockPool:
    """Pages, pools, eviction, the tree, the clock, copy ops, events and stats of one manager."""

    def __init__(self, config: KVCacheManagerConfig) -> None:
        rc = resolve_config(config)
        self.rc = rc
        self.config = config
        self.B = config.tokens_per_block
        self.lcs: tuple[LifeCycle, ...] = rc.life_cycles
        self.attn_lcs = [lc.id for lc in self.lcs if lc.kind == "attn"]
        # sec. 5 pruning: the ordinals below which a block that loses its page of an lc loses
        # its subtree too (full attention: every block; windowed: the sink blocks; ssm: none)
        self.subtree_below = [(1 << 63 if lc.is_full_attention else lc.num_sink_blocks(self.B)) if lc.kind == "attn"
                              else 0 for lc in self.lcs]
        # no windowed attention: no block ever becomes stale (the decode step's fast paths)
        self.full_attention_only = all(lc.window is None for lc in self.lcs if lc.kind == "attn")
        self.ssm_lc: int | None = rc.ssm_lc
        self.num_tiers = len(rc.tier_kinds)
        # pools are indexed by config position; copy ops, events, stats and snapshots
        # report SPEC's tier number by kind (gpu 0, host 1, disk 2): tier_ids maps at that boundary
        self.tier_ids: tuple[int, ...] = rc.tier_ids
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
        self.tree = RadixTree(self.B, self.lcs)
        self.clock = 0  # logical clock (sec. 4): ticks once per state-changing public call
        self.next_page = 0
        self.copy_ops: list[CopyOp] = []
        self.copy_pages: list[int] = []  # serial of the page each pending op fills
        # the ops of the last drain not reported yet, with the page each fills (forget_copies)
        self.issued: list[CopyOp] = []
        self.issued_pages: list[int] = []
        # copy_settlement="explicit" (DECISIONS.md "Asynchronous copies: settle_copies"): the
        # drains not settled yet, oldest first, each (its ops, the page each fills); `issued`
        # stays empty.  unsettled_ops: their ops in all (the warning below counts them)
        self.explicit = rc.explicit_settlement
        self.unsettled: deque[tuple[list[CopyOp], list[int]]] = deque()
        self.unsettled_ops = 0
        # sec. 15: undrained (and, explicit, unsettled) copy ops are a visible bound:
        # stats()["pending_copy_ops"], unsettled_drains, and one PendingCopyOpsWarning when
        # they reach the configured figure (DECISIONS.md)
        self.copy_ops_warn_at = config.pending_copy_ops_warning
        self.copy_ops_warned = False
        self.copy_ops_warn_due = False
        # a full buffer drops its oldest on append by itself (maxlen), counted in emit
        self.max_events = config.max_events
        self.events: deque[EventRecord] = deque(maxlen=config.max_events)
        self.events_dropped = 0
        self.next_event = 0
        self.totals = self._zero_counters()
        self.iteration = self._zero_counters()

    # ------------------------------------------------------------------ clock, match

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def match(self, root: int, tokens: Sequence[Token], keys: list[bytes]) -> tuple[int, int, list[int]]:
        cfg = self.config
        return self.tree.match(root, tokens, keys, cfg.enable_partial_reuse, cfg.reuse_match_backoff)

    def match_shared(self, root: int, keys: list[bytes], hits: set[tuple[bytes, int]]) -> tuple[
            int, int, list[int], list[list[int]]]:
        """DECISIONS.md "The shared tier": the match extended by the store's hits.  The tree
        path ``[0, P)`` (full blocks by key; none under a scope with no root, ``root``
        NO_NODE), then the blocks ``P .. L`` (``L`` the last full block with a hit;
        coverage B per hit lc, else 0), backoff, then the fixed point of SPEC sec. 6 step 3
        with no partial step.  Returns ``(m, m_before_ssm, tree_path, rows)``: ``rows[k]``
        the coverage per lc of block ``P + k``; ``m`` is -1 without a hit."""
        B = self.B
        path = self.tree.key_path(root, keys) if root != NO_NODE else []
        rows = [[B if (keys[i], lc) in hits else 0 for lc in range(len(self.lcs))]
                for i in range(len(path), len(keys))]
        while rows and not any(rows[-1]):
            rows.pop()
        if not rows:
            return -1, -1, path, rows
        m = max(0, (len(path) + len(rows)) * B - self.config.reuse_match_backoff)
        tree = self.tree
        return tree.prune_extended(path, rows, m), tree.prune_extended(path, rows, m, use_ssm=False), path, rows

    def match_with_hits(self, root: int, tokens: Sequence[Token], keys: list[bytes],
                        hits: set[tuple[bytes, int]] | None) -> RequestMatch:
        """SPEC sec. 6 and DECISIONS.md "The shared tier": the match a request created now
        takes (``create_kv_cache``; ``probe_reuse_detail`` reports it).  The ordinary match
        (none under a scope with no root, ``root`` NO_NODE), or, with the store's ``hits``,
        the match extended by them when that is longer.  Pure: it changes nothing."""
        if not tokens:
            return RequestMatch(0, 0, [], None)
        m, mbs, path = self.match(root, tokens, keys) if root != NO_NODE else (0, 0, [])
        if hits is not None:
            m_ext, mbs_ext, tree_path, rows = self.match_shared(root, keys, hits)
            if m_ext > m:
                return RequestMatch(m_ext, mbs_ext, tree_path, rows)
        return RequestMatch(m, mbs, path, None)

    def block_tiers(self, path: list[int], m: int) -> tuple[int, ...]:
        """SPEC sec. 6 ``ReuseProbe.block_tiers``: per full block ``j < m // B`` of a match of
        length ``m`` over the tree blocks ``path`` (past its end: blocks of the shared
        tier's extension), the coldest tier number among the pages a request created with
        this match holds for block ``j`` (``Request.match_and_hold``: attention pages of
        blocks not stale at ``m``; the ssm snapshot of the block ``m`` ends in), or -1 when
        it holds none.  A block of the extension holds shared pages (tier 3).  O(m / B)
        per life cycle; it changes nothing."""
        B = self.B
        last = -(-m // B) - 1  # the block whose snapshot a request holds
        # per lc: (lc, is ssm, its stale range at m); computed once, not per block
        held = [(life.id, life.kind == "ssm", life.stale_range(m, B)) for life in self.lcs]
        pages, nodes, tier_ids = self.pages, self.tree.nodes, self.tier_ids
        out = []
        for j in range(m // B):
            tier = -1
            for lc, ssm, (lo, hi) in held:
                if (j != last) if ssm else (lo <= j < hi):
                    continue
                if j >= len(path):  # the shared tier's extension: a shared page
                    tier = max(tier, SHARED)
                    continue
                tier = max(tier, tier_ids[pages[nodes[path[j]].pages[lc]].tier])
            out.append(tier)
        return tuple(out)

    # --- pages and their users.  Every change of a page's state goes through restate so the
    # pool counters and eviction index never disagree with the derived state (sec. 4).

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

    def restate(self, page: Page, *, locks: int | None = None, holds: int | None = None, node: int | None = None,
                last_used: int | None = None, priority: int | None = None) -> None:
        """Set the fields ``page``'s state and eviction key derive from (its users, its block,
        its LRU time, its priority; None: unchanged) with its pool's counters and eviction
        index kept in step: unindexed under its old state and key, changed, indexed under
        the new ones."""
        pool = None if page.tier == self.shared_pos else self.pools[page.tier][page.lc]  # shared: in no pool
        if pool is not None:
            pool.unindex(page)
        if locks is not None:
            page.locks = locks
        if holds is not None:
            page.holds = holds
        if node is not None:
            page.node = node
        if last_used is not None:
            page.last_used = last_used
        if priority is not None:
            page.priority = priority
        if pool is not None:
            pool.index(page)

    def use(self, page: Page, active: bool, priority: int) -> None:
        """SPEC sec. 4: a request starts using ``page`` (LRU touch, priority raised to the request's)."""
        priority = max(page.priority, priority)
        if active:
            self.restate(page, locks=page.locks + 1, last_used=self.clock, priority=priority)
        else:
            self.restate(page, holds=page.holds + 1, last_used=self.clock, priority=priority)

    def unuse(self, page: Page, active: bool) -> None:
        """SPEC sec. 4: a request stops using ``page``: a private or orphaned page with no user left is
        freed; a tree page becomes DROPPABLE."""
        if active:
            self.restate(page, locks=page.locks - 1, last_used=self.clock)
        else:
            self.restate(page, holds=page.holds - 1, last_used=self.clock)
        if page.locks or page.holds:
            return
        if page.node == NO_NODE:  # a private page nobody uses
            self.free_page(page)
        elif not self.tree.is_attached(page.node):
            self.free_orphan_page(page)
        elif page.tier == self.shared_pos:
            # DECISIONS "The shared tier": a shared page lives only while a request uses it
            self.unlink_committed(page)
            self.free_page(page)

    def set_active(self, page: Page, active: bool) -> None:
        """SPEC sec. 7 suspend/resume: LOCKED <-> HELD without touching LRU."""
        if active:
            self.restate(page, locks=page.locks + 1, holds=page.holds - 1)
        else:
            self.restate(page, locks=page.locks - 1, holds=page.holds + 1)

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

    def can_allocate(self, tier: int, lc: int, n: int, adjust: Adjust | None = None) -> bool:
        """Whether ``n`` pages fit into pool (tier, lc) after eviction, without changing
        anything.  ``adjust`` overrides the gpu pool's (free, held, droppable) counters.
        SPEC sec. 8: what eviction could free, HELD pages only where a colder tier takes them."""
        return self._capacity_of(tier, lc, adjust) >= n

    def _capacity_of(self, tier: int, lc: int, adjust: Adjust | None) -> int:
        pool = self.pools[tier][lc]
        free, held, droppable = pool.nfree, pool.held, pool.droppable
        if adjust is not None and tier == GPU:
            free, held, droppable = adjust
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
        self.add_copy_op(CopyOp(lc, tid[old_tier], old_slot, tid[dst], new_slot, reason, key), page.serial)
        name, bytes_name = _MOVE_COUNTERS[reason]
        self.count_bytes(lc, name, bytes_name, self.lcs[lc].slot_bytes)
        if node is not None and node.attached:
            self.emit(_TIER_CHANGED, node.key, lc, tid[old_tier], tid[dst])

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
        self.emit_removed(key, lc)
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
        self.restate(page, node=NO_NODE)
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

    def drop_all_droppable(self) -> None:
        """SPEC sec. 8 clear_reusable / shutdown: every DROPPABLE page goes, until none is left."""
        progress = True
        while progress:
            progress = False
            for tier_pools in self.pools:
                for pool in tier_pools:
                    while (page := pool.peek(DROPPABLE)) is not None:
                        self.drop(page)
                        progress = True

    # --- quotas at run time (issue 22)

    def check_quota(self, pos: int, q: int, per_lc: Sequence[int]) -> None:
        """SPEC sec. 18: refuse (OutOfPagesError, nothing changed) a quota of ``q`` bytes
        (``per_lc`` slots) for tier position ``pos`` when its LOCKED and HELD pages that must
        stay could not fit; every pool is checked before any changes."""
        for lc, n in enumerate(per_lc):
            pool = self.pools[pos][lc]
            movable = min(pool.held, self._capacity_of(pos + 1, lc, None)) if pos < self.num_tiers - 1 else 0
            need = pool.total - pool.nfree - pool.droppable - movable
            if n < need:
                raise quota_refused_error(self.rc.tier_kinds[pos], q, lc, n, need, pool.locked, pool.held - movable)

    def apply_quota(self, pos: int, q: int, per_lc: Sequence[int]) -> None:
        """SPEC sec. 18: the pools of tier ``pos`` to ``per_lc`` slots (``check_quota`` passed)."""
        for lc, n in enumerate(per_lc):
            self._resize_pool(pos, lc, n)
        self.quotas[pos] = q

    def _resize_pool(self, tier: int, lc: int, n: int) -> None:
        """Pool (tier, lc) to ``n`` slots; shrinking, room was checked by check_quota."""
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
        self.add_copy_op(CopyOp(page.lc, tid, old, tid, page.slot, "relocate"), page.serial)
        self.count(page.lc, "relocations")

    # --- the shared tier's writes (DECISIONS.md "The shared tier")

    def store(self, page: Page, key: bytes) -> None:
        """A ``store`` op: ``page`` (a full-coverage page of the full block ``key``) is
        written to the shared tier.  It fills no page here (forget_copies forgets nothing)."""
        self.add_copy_op(CopyOp(page.lc, self.tier_ids[page.tier], page.slot, SHARED, -1, "store", key), -1)
        self.count_bytes(page.lc, "shared_stores", "shared_store_bytes", self.lcs[page.lc].slot_bytes)

    def store_evicted(self, page: Page) -> None:
        """``shared_write="evict"``: eviction is about to drop ``page``; a full-coverage page
        of a full block is written first."""
        node = self.tree.nodes[page.node]
        if page.coverage == self.B and len(node.tokens) == self.B:
            self.store(page, node.key)

    # --- copy ops

    def copy(self, lc: int, src: Page, dst: Page, reason: str) -> None:
        tid = self.tier_ids
        self.add_copy_op(CopyOp(lc, tid[src.tier], src.slot, tid[dst.tier], dst.slot, reason), dst.serial)

    def add_copy_op(self, op: CopyOp, fills: int) -> None:
        """SPEC sec. 8 copy ops (``fills``: the serial of the page the op fills, -1: none),
        and sec. 15's one warning when the pending ones reach the figure."""
        self.copy_ops.append(op)
        self.copy_pages.append(fills)
        # (the figure grows only here, one op at a time: == catches the crossing)
        if len(self.copy_ops) + self.unsettled_ops == self.copy_ops_warn_at and not self.copy_ops_warned:
            self.copy_ops_warned = self.copy_ops_warn_due = True  # warned once, at the call's end

    def warn_copy_ops(self) -> None:
        """SPEC sec. 15: the one PendingCopyOpsWarning, issued at the end of the public call
        whose op reached the figure (the warning never changes the call's work)."""
        if self.copy_ops_warn_due:
            self.copy_ops_warn_due = False
            warn_pending_copy_ops(self.copy_ops_warn_at, self.explicit)

    def take_copy_ops(self) -> list[CopyOp]:
        """drain_copy_ops: the pending ops; they become the last drain (forget_copies), or,
        with explicit settlement and at least one op, the newest unsettled drain."""
        ops, self.copy_ops = self.copy_ops, []
        pages, self.copy_pages = self.copy_pages, []
        # (copies: the caller owns ``ops``)
        if not self.explicit:
            self.issued, self.issued_pages = list(ops), pages
        elif ops:
            self.unsettled.append((list(ops), pages))
            self.unsettled_ops += len(ops)
        return ops

    def match_issued(self, issued: list[CopyOp], ops: Sequence[CopyOp],
                     refuse: Callable[[int, CopyOp], ValueError]) -> set[int]:
        """SPEC sec. 15: the ops of one drain (``issued``) that ``ops`` name, matched by value
        in order, one issued op per listed op: their indices.  An op with no unmatched equal
        left raises ``refuse(i, op)`` (nothing changed)."""
        pending: dict[CopyOp, list[int]] = {}  # op -> its indices in issued, in order
        for k, iop in enumerate(issued):
            pending.setdefault(iop, []).append(k)
        taken: set[int] = set()
        for i, op in enumerate(ops):
            ks = pending.get(op)
            if not ks:
                raise refuse(i, op)
            taken.add(ks.pop(0))
        return taken

    def live_fills(self, issued_pages: list[int], taken: set[int]) -> list[Page]:
        """The live pages the ``taken`` ops of a drain were to fill, once each, in drain order
        (a page that died meanwhile is skipped)."""
        lost: list[Page] = []
        for k in sorted(taken):
            page = self.pages.get(issued_pages[k])
            if page is not None and page not in lost:
                lost.append(page)
        return lost

    def take_issued(self, ops: Sequence[CopyOp]) -> list[Page]:
        """SPEC sec. 15 forget_copies, the pool's part: ``ops`` (each an unreported op of the
        last drain, else ValueError and nothing changed) are reported; returns the live
        pages they were to fill, once each, in drain order."""
        taken = self.match_issued(self.issued, ops, not_issued_error)
        lost = self.live_fills(self.issued_pages, taken)
        self.issued = [e for k, e in enumerate(self.issued) if k not in taken]
        self.issued_pages = [e for k, e in enumerate(self.issued_pages) if k not in taken]
        return lost

    def settle_oldest(self, failed: Sequence[CopyOp]) -> list[Page]:
        """SPEC sec. 15 settle_copies, the pool's part: the oldest unsettled drain is settled
        with ``failed`` (each an op of that drain, else ValueError and nothing changed; no
        drain: ValueError); returns the live pages the failed ops were to fill, once each,
        in drain order."""
        if not self.unsettled:
            raise ValueError(NOTHING_TO_SETTLE)
        ops, pages = self.unsettled[0]
        lost = self.live_fills(pages, self.match_issued(ops, failed, not_in_oldest_drain_error))
        self.unsettled.popleft()
        self.unsettled_ops -= len(ops)
        return lost

    def forget_pages(self, lost: list[Page]) -> None:
        """SPEC sec. 15: the ``lost`` pages leave their blocks (sec. 5 pruning, ``removed``
        events); those nobody uses are freed.  Their users roll back (the manager)."""
        for page in lost:
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

    # --- events (sec. 9)

    def emit(self, kind: int, *fields: object) -> None:
        """SPEC sec. 9 / 15: buffer an event of ``kind`` with the next event id and
        ``fields`` (its record ``(kind, id, *fields)``, see ``built_event``); the oldest is
        dropped (and counted) when full, and with ``max_events == 0`` the event itself."""
        eid = self.event_id()
        if len(self.events) == self.max_events:  # full (0: always): one is dropped
            self.events_dropped += 1
            if not self.max_events:
                return
        self.events.append((kind, eid, *fields))  # (the oldest leaves by the deque's maxlen)

    def event_id(self) -> int:
        """The next event id (ids count every event, the dropped ones too)."""
        self.next_event += 1
        return self.next_event - 1

    def emit_removed(self, key: bytes, lc: int) -> None:
        """SPEC sec. 9: ``removed`` for a block that lost its last page of ``lc`` or was detached."""
        self.emit(_REMOVED, key, lc)

    def emit_stored(self, node_id: int, lcs: list[int]) -> None:
        """SPEC sec. 9: ``stored`` for a block that just gained (or regained) pages of ``lcs``."""
        if not lcs:
            return
        n = self.tree.nodes[node_id]
        rows = []
        for lc in lcs:
            p = self.pages[n.pages[lc]]
            rows.append((lc, self.tier_ids[p.tier], p.priority, n.coverage[lc]))
        parent = None if n.parent is None else n.parent.key
        # the block's key and tokens (never changed) are shared with the node, not copied
        self.emit(_STORED, parent, n.key, n.tokens, tuple(rows), len(n.tokens) < self.B)

    def emit_cleared(self) -> None:
        """SPEC sec. 9: ``cleared`` (clear_reusable)."""
        self.emit(_CLEARED)

    def built_events(self) -> list[Event]:
        """The buffered events, oldest first."""
        return [built_event(e) for e in self.events]

    def take_events(self) -> list[Event]:
        out = self.built_events()
        self.events.clear()
        return out

    # --- stats (sec. 9)

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

    def take_iteration_stats(self) -> dict:
        view = self.stats_view(self.iteration)
        self.iteration = self._zero_counters()
        return view

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
                    "kind": self.rc.tier_kinds[t],
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

    # ------------------------------------------------------------------ what a request needs

    def stale_range(self, lc: int, history: int) -> tuple[int, int]:
        """SPEC sec. 2: the block ordinals ``[lo, hi)`` of ``lc`` stale at ``history``."""
        return self.lcs[lc].stale_range(history, self.B)
