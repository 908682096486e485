"""Eviction: making room in a pool, moving pages between tiers, dropping them (SPEC sec. 8).

C++ twin: ``cpp/core/evictor.{h,cpp}``.  The ``Evictor`` makes room; which page goes is its
strategy's choice (``EvictionStrategy``, after SGLang's): ``LruStrategy`` is sec. 8's order,
the default and the only one shipped.  The pools' eviction indexes (``pools.py``) keep
their pages in the strategy's ``key`` order, so a victim is found without a scan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvcm.api import CopyOp
from kvcm.python_backend.layout import Layout
from kvcm.python_backend.outbox import Outbox
from kvcm.python_backend.pages import Pages
from kvcm.python_backend.pools import DROPPABLE, HELD, NO_NODE, Page, Pool
from kvcm.python_backend.tree_index import TreeIndex

# the counters a move counts, by reason
_MOVE_COUNTERS = {"offload": ("offloads", "offload_bytes"), "onboard": ("onboards", "onboard_bytes")}


class EvictionStrategy(ABC):
    """Which page of a pool goes first (SPEC sec. 8): an order on pages (``key``, lower goes
    first; the pools index their pages by it) and the choice of a victim from a pool."""

    @abstractmethod
    def key(self, page: Page) -> tuple:
        """The eviction order: lower goes first; distinct pages have distinct keys."""

    @abstractmethod
    def victim(self, pool: Pool, movable: bool) -> Page | None:
        """The page to evict from ``pool`` (None: none may go).  ``movable``: the victim can
        go one tier colder, so a HELD page may be chosen; otherwise only a DROPPABLE one."""


class LruStrategy(EvictionStrategy):
    """SPEC sec. 8's order: lowest priority, then least recently used, then the deepest block
    (its descendants are useless without it), then the oldest page."""

    def key(self, page: Page) -> tuple[int, int, int, int]:
        """SPEC sec. 8 eviction order, the one statement of it: lower goes first.  Serials are
        unique, so keys are too."""
        return (page.priority, page.last_used, -page.ordinal, page.serial)

    def victim(self, pool: Pool, movable: bool) -> Page | None:
        """SPEC sec. 8: the page to evict from ``pool``, the one home of the skip rules.
        Candidates are the non-LOCKED pages, lowest key first.  ``movable``: the victim can
        go one tier colder, so HELD pages qualify; otherwise (the coldest tier, or a colder
        tier that cannot take it) only a DROPPABLE page can go (it is dropped) and HELD
        ones are skipped."""
        d = pool.peek(DROPPABLE)
        if not movable:
            return d
        h = pool.peek(HELD)
        if h is None:
            return d
        if d is None:
            return h
        return h if self.key(h) < self.key(d) else d


class Evictor:
    """Room in the pools: victims chosen by ``strategy``, moved one tier colder or dropped."""

    def __init__(self, layout: Layout, pages: Pages, tree_index: TreeIndex, outbox: Outbox,
                 strategy: EvictionStrategy) -> None:
        self.layout = layout
        self.pages = pages
        self.tree_index = tree_index
        self.outbox = outbox
        self.strategy = strategy

    def ensure_room(self, tier: int, lc: int) -> None:
        """``make_room`` where a feasibility check already promised the slot."""
        if not self.make_room(tier, lc):
            raise AssertionError("kvcm bug: a feasibility check passed but eviction found no slot")

    def make_room(self, tier: int, lc: int) -> bool:
        """SPEC sec. 8: ensure pool (tier, lc) has a free slot, evicting one victim if needed:
        moved one tier colder (which may evict there first), else dropped (the strategy
        holds the order and which pages may go)."""
        if self.pages.pool(tier, lc).free_slots:  # (nfree)
            return True
        return self.evict_one(tier, lc)

    def evict_one(self, tier: int, lc: int) -> bool:
        """SPEC sec. 8: free one more slot of pool (tier, lc) by evicting its first victim
        (make_room when it is full; set_quota's shrink with free slots left).  False:
        nothing could go, nothing changed."""
        pool = self.pages.pool(tier, lc)
        nfree = pool.nfree
        if tier < self.layout.num_tiers - 1:
            victim = self.strategy.victim(pool, movable=True)
            if victim is None:
                return False
            if self.make_room(tier + 1, lc):
                if pool.nfree > nfree:  # a drop down there removed a subtree and freed a slot here
                    return True
                self.move(victim, tier + 1, "offload")
                return True
            # the colder tier cannot take it (and nothing changed): only a drop is left
        victim = self.strategy.victim(pool, movable=False)
        if victim is None:
            return False
        if self.layout.shared_write_evict:
            self.store_evicted(victim)
            self.drop(victim, write_back=True)
        else:
            self.drop(victim)
        return True

    def move(self, page: Page, dst: int, reason: str) -> None:
        """SPEC sec. 8: move ``page`` to a free slot of tier ``dst`` (the caller made room), with
        its copy op (offload / onboard) and ``tier_changed`` event.  A shared page (no slot,
        no pool) is onboarded by an op naming its object by block key (DECISIONS.md)."""
        lc = page.lc
        tree = self.tree_index.tree
        node = tree.nodes[page.node] if page.node != NO_NODE else None
        key = node.key if page.tier == self.layout.shared_pos else None
        old_tier, old_slot = self.pages.move_to(page, dst)
        tid = self.layout.tier_ids
        self.outbox.add_copy_op(CopyOp(lc, tid[old_tier], old_slot, tid[dst], page.slot, reason, key), page.serial)
        name, bytes_name = _MOVE_COUNTERS[reason]
        self.outbox.count_bytes(lc, name, bytes_name, self.layout.lcs[lc].slot_bytes)
        if node is not None and node.attached:
            self.outbox.emit_tier_changed(node.key, lc, tid[old_tier], tid[dst])

    def drop(self, page: Page, write_back: bool = False) -> None:
        """SPEC sec. 8: drop a DROPPABLE page: unlink it from its block, prune, free its slot.
        ``write_back`` (shared_write="evict"): the pages pruning frees with it are written
        to the shared tier first (``store_evicted``)."""
        assert page.node != NO_NODE and not page.locks and not page.holds, "drop: not DROPPABLE"  # Page.state
        self.outbox.count_bytes(page.lc, "drops", "drop_bytes", self.layout.lcs[page.lc].slot_bytes)
        self.tree_index.unlink_committed(page, self.store_evicted if write_back else None)
        self.pages.free_page(page)

    def drop_all_droppable(self) -> None:
        """SPEC sec. 8 clear_reusable / shutdown: every DROPPABLE page goes, until none is left."""
        progress = True
        while progress:
            progress = False
            for tier_pools in self.pages.pools:
                for pool in tier_pools:
                    while (page := pool.peek(DROPPABLE)) is not None:
                        self.drop(page)
                        progress = True

    def store_evicted(self, page: Page) -> None:
        """``shared_write="evict"``: eviction is about to drop ``page``; a full-coverage page
        of a full block is written first."""
        node = self.tree_index.tree.nodes[page.node]
        B = self.layout.B
        if page.coverage == B and len(node.tokens) == B:
            self.outbox.store(page, node.key)
