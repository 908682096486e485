"""The pages and the pools of each (tier, life cycle) (SPEC sec. 4, 8, 18).

C++ twin: ``cpp/core/pages.{h,cpp}``.  ``Pages`` owns the live pages (by serial) and the
slot pools (``pools.py``: free slots, the counters of each state, the eviction index), and
is the one writer of a page's fields: every change of what a page's state or eviction key
derive from goes through ``restate``, so the pools' counters and eviction index never
disagree with the derived state (sec. 4).  It reads the tree (``tree.py``) only to know
whether a page's block is attached; it counts and reports through the ``Outbox``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from kvcm.api import GPU, CopyOp
from kvcm.checks import quota_refused_error
from kvcm.python_backend.layout import Layout
from kvcm.python_backend.outbox import Outbox
from kvcm.python_backend.pools import NO_NODE, Page, Pool
from kvcm.python_backend.tree import RadixTree


class Clock:
    """The logical clock (SPEC sec. 4): ticks once per state-changing public call; a page
    is stamped with it when a request starts or stops using it (its LRU time)."""

    def __init__(self) -> None:
        self.now = 0

    def tick(self) -> int:
        self.now += 1
        return self.now


class Budget(NamedTuple):
    """The gpu pool of one life cycle as a request's feasibility checks read it (SPEC sec.
    8, DECISIONS.md "All-or-nothing resume / resize"; ``Pages.budget``)."""

    total: int  # slots
    free: int
    locked: int
    held: int
    droppable: int
    colder: int  # what the colder tiers could take of its HELD pages (0: no colder tier)

    def fits(self, n: int) -> bool:
        """Whether ``n`` new pages fit after eviction: free slots, DROPPABLE pages, and HELD
        pages a colder tier can take."""
        return self.free + self.droppable + min(self.held, self.colder) >= n


class Pages:
    """The live pages of one manager and the slot pools they sit in."""

    def __init__(self, layout: Layout, slots: Sequence[Sequence[int]], quotas: Sequence[int], clock: Clock,
                 tree: RadixTree, outbox: Outbox, evict_key: Callable[[Page], tuple]) -> None:
        self.layout = layout
        self.clock = clock
        self.tree = tree  # read only: whether a page's block is attached
        self.outbox = outbox
        self.live: dict[int, Page] = {}  # live pages by serial (= tree page handle)
        # each pool's eviction index orders its pages by the eviction strategy's key (sec. 8)
        self.pools = [[Pool(t, lc.id, slots[t][lc.id], self.live, evict_key) for lc in layout.lcs]
                      for t in range(layout.num_tiers)]
        self.quotas = list(quotas)  # quota_bytes per local tier (set_quota changes them)
        self.next_page = 0

    # --- reading

    def page(self, serial: int) -> Page:
        """The live page ``serial`` (a tree page handle)."""
        return self.live[serial]

    def page_alive(self, page: Page) -> bool:
        """Whether ``page`` is still live (not freed since it was read)."""
        return self.live.get(page.serial) is page

    def live_pages(self) -> list[Page]:
        """The live pages, by serial."""
        return [self.live[serial] for serial in sorted(self.live)]

    def pool(self, tier: int, lc: int) -> Pool:
        return self.pools[tier][lc]

    # --- pages and their users

    def new_page(self, tier: int, lc: int, coverage: int, priority: int, ordinal: int) -> Page:
        """SPEC sec. 4: a private page in the lowest free slot (the caller made room), no user yet."""
        page = self.make_page(tier, lc, self.pools[tier][lc].take_slot(), coverage, priority, ordinal)
        self.outbox.count(lc, "allocated_blocks")
        return page

    def new_shared_page(self, lc: int, priority: int, ordinal: int) -> Page:
        """DECISIONS.md "The shared tier": a page of a full block in the store (tier 3, no
        slot, in no pool), no user yet; the caller links it into its block."""
        page = self.make_page(self.layout.shared_pos, lc, -1, self.layout.B, priority, ordinal)
        self.outbox.count(lc, "shared_hit_blocks")
        return page

    def make_page(self, tier: int, lc: int, slot: int, coverage: int, priority: int, ordinal: int) -> Page:
        """A page with the next serial, last used now, registered by serial."""
        page = Page(self.next_page, lc, tier, slot, coverage, priority, self.clock.now, ordinal)
        self.next_page += 1
        self.live[page.serial] = page
        return page

    def restate(self, page: Page, *, locks: int | None = None, holds: int | None = None, node: int | None = None,
                last_used: int | None = None, priority: int | None = None) -> None:
        """Set the fields ``page``'s state and eviction key derive from (its users, its block,
        its LRU time, its priority; None: unchanged) with its pool's counters and eviction
        index kept in step: unindexed under its old state and key, changed, indexed under
        the new ones."""
        pool = None if page.tier == self.layout.shared_pos else self.pools[page.tier][page.lc]  # shared: in no pool
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

    def set_node(self, page: Page, node: int) -> None:
        """``page`` changes block where that changes neither its state nor its eviction key:
        a page in use (LOCKED / HELD whatever its block), or a page moving from one block to
        another (DROPPABLE before and after).  Its pool's counters and index stay as they are;
        any other change of ``node`` goes through ``restate``."""
        assert page.locks or page.holds or (page.node != NO_NODE and node != NO_NODE), "set_node changes a state"
        page.node = node

    def use(self, page: Page, active: bool, priority: int) -> None:
        """SPEC sec. 4: a request starts using ``page`` (LRU touch, priority raised to the request's)."""
        priority = max(page.priority, priority)
        if active:
            self.restate(page, locks=page.locks + 1, last_used=self.clock.now, priority=priority)
        else:
            self.restate(page, holds=page.holds + 1, last_used=self.clock.now, priority=priority)

    def unuse(self, page: Page, active: bool) -> None:
        """SPEC sec. 4: a request stops using ``page`` (LRU touch).  What becomes of a page
        nobody uses any more depends on its block: ``TreeIndex.release``."""
        if active:
            self.restate(page, locks=page.locks - 1, last_used=self.clock.now)
        else:
            self.restate(page, holds=page.holds - 1, last_used=self.clock.now)

    def set_active(self, page: Page, active: bool) -> None:
        """SPEC sec. 7 resume / suspend of a page in the gpu tier: HELD -> LOCKED / LOCKED ->
        HELD without touching LRU."""
        if active:
            self.restate(page, locks=page.locks + 1, holds=page.holds - 1)
        else:
            self.restate(page, locks=page.locks - 1, holds=page.holds + 1)

    def set_coverage(self, page: Page, coverage: int) -> None:
        """SPEC sec. 5, 7: the tokens of its block ``page`` covers (no part of its state or
        eviction key)."""
        page.coverage = coverage

    def free_page(self, page: Page) -> None:
        """Its slot back to the pool (SPEC sec. 4: the lowest free slot is handed out next)."""
        if page.tier == self.layout.shared_pos:  # no slot, no pool
            del self.live[page.serial]
            return
        pool = self.pools[page.tier][page.lc]
        pool.unindex(page)
        pool.give_slot(page.slot)
        page.slot = -1
        del self.live[page.serial]

    def move_to(self, page: Page, dst: int) -> tuple[int, int]:
        """SPEC sec. 8: ``page`` to the lowest free slot of tier ``dst`` (the caller made room;
        its state and eviction key are unchanged); returns its old ``(tier, slot)``."""
        lc = page.lc
        dst_pool = self.pools[dst][lc]
        old_tier, old_slot = page.tier, page.slot
        new_slot = dst_pool.take_slot()
        if old_tier != self.layout.shared_pos:  # (a shared page has no slot and is in no pool)
            src_pool = self.pools[old_tier][lc]
            src_pool.unindex(page)
            src_pool.give_slot(old_slot)
        page.tier, page.slot = dst, new_slot
        dst_pool.index(page)
        return old_tier, old_slot

    # --- budgets and quotas

    def budget(self, lc: int, releasing: Iterable[Page] = ()) -> Budget:
        """SPEC sec. 8, the gpu pool of ``lc`` as a feasibility check reads it (changing
        nothing; ``Budget.fits``: what eviction could free, HELD pages only where a colder
        tier takes them).  ``releasing``: pages about to lose one ACTIVE user (a resize's
        releases), counted in the state they will be in."""
        pool = self.pools[GPU][lc]
        free, held, droppable = pool.nfree, pool.held, pool.droppable
        for p in releasing:
            if p.lc != lc or p.locks != 1:
                continue
            if p.node == NO_NODE or not self.tree.is_attached(p.node):  # freed, or kept by a SUSPENDED user
                free += 1 if p.holds == 0 else 0
                held += 1 if p.holds else 0
            elif p.holds:
                held += 1
            else:
                droppable += 1
        colder = self.capacity_of(GPU + 1, lc) if self.layout.num_tiers > 1 else 0
        return Budget(pool.total, free, pool.locked, held, droppable, colder)

    def capacity_of(self, tier: int, lc: int) -> int:
        """The pages pool (tier, lc) could take after eviction (``Budget.fits``'s rule)."""
        pool = self.pools[tier][lc]
        if tier == self.layout.num_tiers - 1:
            return pool.nfree + pool.droppable
        return pool.nfree + pool.droppable + min(pool.held, self.capacity_of(tier + 1, lc))

    def check_quota(self, pos: int, q: int, per_lc: Sequence[int]) -> None:
        """SPEC sec. 18: refuse (OutOfPagesError, nothing changed) a quota of ``q`` bytes
        (``per_lc`` slots) for tier position ``pos`` when its LOCKED and HELD pages that must
        stay could not fit; every pool is checked before any changes."""
        for lc, n in enumerate(per_lc):
            pool = self.pools[pos][lc]
            movable = min(pool.held, self.capacity_of(pos + 1, lc)) if pos < self.layout.num_tiers - 1 else 0
            need = pool.total - pool.nfree - pool.droppable - movable
            if n < need:
                raise quota_refused_error(self.layout.tier_kinds[pos], q, lc, n, need, pool.locked, pool.held - movable)

    def resize_pool(self, tier: int, lc: int, n: int) -> None:
        """SPEC sec. 18: pool (tier, lc) to ``n`` slots.  Shrinking, the caller evicted down to
        at most ``n`` used slots first (``BlockPool.apply_quota``); the survivors of slots
        ``[n, total)`` move down, by slot, each to the lowest free slot."""
        pool = self.pools[tier][lc]
        if n >= pool.total:
            pool.grow(n)
            return
        for page in sorted((p for p in self.live.values() if p.tier == tier and p.lc == lc and p.slot >= n),
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
        tid = self.layout.tier_ids[page.tier]
        self.outbox.add_copy_op(CopyOp(page.lc, tid, old, tid, page.slot, "relocate"), page.serial)
        self.outbox.count(page.lc, "relocations")

    def tier_stats(self) -> list[dict]:
        """SPEC sec. 9: the ``tiers`` part of the stats: each local tier's quota and the
        figures of its pools."""
        return [
            {
                "tier": self.layout.tier_ids[t],
                "kind": self.layout.tier_kinds[t],
                "quota_bytes": self.quotas[t],
                "lc": [
                    {"total": p.total, "free": p.nfree, "locked": p.locked, "held": p.held, "droppable": p.droppable}
                    for p in self.pools[t]
                ],
            }
            for t in range(self.layout.num_tiers)
        ]
