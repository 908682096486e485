"""Pages, per-(tier, lc) slot pools, their eviction index and the victim choice (SPEC sec. 4, 8).

C++ twin: ``cpp/core/pools.{h,cpp}``.  ``Pool.victim`` is the one home of sec. 8's order and
of which pages may be evicted (HELD moved only, DROPPABLE moved or dropped, LOCKED never).
"""

from __future__ import annotations

import heapq

LOCKED, HELD, DROPPABLE = "LOCKED", "HELD", "DROPPABLE"
NO_NODE = -1


class Page:
    """One page: one life cycle's data for one block (or one ssm state) in one slot."""

    __slots__ = (
        "coverage",
        "holds",
        "last_used",
        "lc",
        "locks",
        "node",
        "ordinal",
        "priority",
        "serial",
        "slot",
        "tier",
    )

    def __init__(self, serial: int, lc: int, tier: int, slot: int, coverage: int, priority: int,
                 last_used: int, ordinal: int) -> None:
        self.serial = serial  # creation order; also the handle the tree stores; last eviction tie-break
        self.lc = lc
        self.tier = tier
        self.slot = slot
        self.coverage = coverage  # tokens of its block it covers (ssm: exact snapshot position)
        self.priority = priority  # 0..100; max over the requests that created/reused it
        self.last_used = last_used  # manager clock when a request last started/stopped using it
        self.ordinal = ordinal  # block ordinal (eviction order: deeper blocks go first)
        self.node = NO_NODE  # tree node id while committed; -1 for a private (uncommitted) page
        self.locks = 0  # ACTIVE requests using it
        self.holds = 0  # SUSPENDED requests using it

    @property
    def state(self) -> str | None:
        """Derived state (sec. 4); None for a private page between allocation and first use."""
        if self.locks:
            return LOCKED
        if self.holds:
            return HELD
        if self.node != NO_NODE:
            return DROPPABLE
        return None

    def evict_key(self) -> tuple[int, int, int, int]:
        """SPEC sec. 8 eviction order: lower first."""
        return (self.priority, self.last_used, -self.ordinal, self.serial)


# A heap entry is the page's eviction key packed into one int: (priority, last_used,
# 2**32-1 - ordinal, serial), 64 bits a field below the priority but 32 for the ordinal.
# Int order is the tuple order of sec. 8 (every field fits its width: clock and serials
# stay below 2**63; a page's ordinal is at most MAX_REQUEST_BLOCKS = 2**24 but for a
# shared-tier hit's, bounded by an input of 2**32 blocks no process holds), the low field names
# the page, and one int of 167 bits (48 bytes, untracked by the cyclic GC) replaces a
# five-field tuple (~88 bytes); the narrow ordinal keeps it to six 30-bit digits.
_W = 64
_MASK = (1 << _W) - 1
_OW = 32
_OMASK = (1 << _OW) - 1


def _entry(page: Page) -> int:
    return (((page.priority << _W | page.last_used) << _OW | (_OMASK - page.ordinal)) << _W) | page.serial


class Pool:
    """Slots of one life cycle in one tier.

    Free slots sit in a min-heap so allocation is always the lowest free index.  Evictable
    pages sit in two lazy min-heaps by eviction key, one per state: an entry is valid only
    while its page is still in this pool, in that state, with that key (``_entry``
    recomputed from the page), so a key change is a push (O(log n)) and a stale entry is
    dropped when it surfaces.  A page pushed twice with an unchanged key has two equal
    valid entries: harmless (both name the same page; once it leaves, both are stale).
    An entry names its page by serial (``pages``: the manager's live pages by serial).
    """

    def __init__(self, tier: int, lc: int, total: int, pages: dict[int, Page]) -> None:
        self.pages = pages
        self.tier = tier
        self.lc = lc
        self.total = total
        self.free_slots = list(range(total))  # already a valid heap
        self.locked = 0
        self.held = 0
        self.droppable = 0
        self._heaps: dict[str, list[int]] = {HELD: [], DROPPABLE: []}

    @property
    def nfree(self) -> int:
        return len(self.free_slots)

    def take_slot(self) -> int:
        """SPEC sec. 4: the lowest-numbered free slot."""
        return heapq.heappop(self.free_slots)

    def give_slot(self, slot: int) -> None:
        heapq.heappush(self.free_slots, slot)

    def unindex(self, page: Page) -> None:
        """Before a change of ``page``'s state, eviction key or place: it leaves its state's
        count (SPEC sec. 4 states); its heap entry turns stale by the change itself.  The
        state is derived inline (as ``Page.state``): this runs on every page change."""
        if page.locks:
            self.locked -= 1
        elif page.holds:
            self.held -= 1
        elif page.node != NO_NODE:
            self.droppable -= 1

    def index(self, page: Page) -> None:
        """After the change: ``page`` is counted under its new state and, when it is a victim
        candidate (HELD or DROPPABLE), pushed with its new eviction key (SPEC sec. 8)."""
        if page.locks:
            self.locked += 1
            return
        if page.holds:
            self.held += 1
            state = HELD
        elif page.node != NO_NODE:
            self.droppable += 1
            state = DROPPABLE
        else:
            return
        heap = self._heaps[state]
        heapq.heappush(heap, (((page.priority << _W | page.last_used) << _OW | (_OMASK - page.ordinal)) << _W) | page.serial)  # _entry
        if len(heap) > 64 and len(heap) > 4 * (self.held + self.droppable):
            self._compact(state)

    def peek(self, state: str) -> Page | None:
        """The lowest page of ``state`` by eviction key (stale heap entries dropped)."""
        heap = self._heaps[state]
        while heap:
            e = heap[0]
            page = self.pages.get(e & _MASK)
            if page is not None and self._valid(page, e, state):
                return page
            heapq.heappop(heap)
        return None

    def victim(self, movable: bool) -> Page | None:
        """SPEC sec. 8: the page to evict from this pool, the one home of the order and the
        skip rules.  Candidates are the non-LOCKED pages, lowest ``(priority, last_used,
        ordinal desc, serial)`` first.  ``movable``: the victim can go one tier colder, so
        HELD pages qualify; otherwise (the coldest tier, or a colder tier that cannot take
        it) only a DROPPABLE page can go (it is dropped) and HELD ones are skipped."""
        d = self.peek(DROPPABLE)
        if not movable:
            return d
        h = self.peek(HELD)
        if h is None:
            return d
        if d is None:
            return h
        return h if h.evict_key() < d.evict_key() else d

    def _valid(self, page: Page, entry: int, state: str) -> bool:
        if page.tier != self.tier or page.slot < 0 or page.locks or _entry(page) != entry:
            return False
        return state == HELD if page.holds else state == DROPPABLE and page.node != NO_NODE  # Page.state

    def _compact(self, state: str) -> None:
        # a set: equal entries (a page pushed again with an unchanged key) kept once
        pages = self.pages
        heap = [e for e in set(self._heaps[state]) if (e & _MASK) in pages and self._valid(pages[e & _MASK], e, state)]
        heapq.heapify(heap)
        self._heaps[state] = heap


class NoPool:
    """Where a page that is in no pool (a shared-tier page) is indexed: nowhere.  It stands
    in for a Pool where the manager indexes pages by tier position without a test."""

    __slots__ = ()

    def unindex(self, page: Page) -> None:
        pass

    def index(self, page: Page) -> None:
        pass

    def give_slot(self, slot: int) -> None:
        pass
