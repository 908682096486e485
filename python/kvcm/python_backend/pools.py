"""Pages, per-(tier, lc) slot pools and their eviction index (SPEC sec. 4, 8).

C++ twin: ``cpp/core/pools.{h,cpp}``.  A pool indexes its HELD and DROPPABLE pages by the
eviction strategy's key (``evictor.py``: ``LruStrategy`` holds sec. 8's order and which
pages may be evicted); only ``pages.py`` changes a page or a pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

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
        "next",
        "node",
        "ordinal",
        "prev",
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
        # the neighbours on its pool's eviction list (_Index) while it is on it
        self.prev: Page | None = None
        self.next: Page | None = None

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


EvictEntry = tuple[tuple, int]  # a heap entry of _Index: (eviction key, serial)


class _Index:
    """The HELD (or the DROPPABLE) pages of one pool in eviction order (C++: EvictIndex).

    Pages mostly arrive in order: a page released now carries the newest last_used, and
    the pages a call releases together come by ascending ordinal, i.e. each sorts just
    before the previous one.  So they go on a list threaded through the pages
    (``Page.prev`` / ``Page.next``, as vLLM's free-block queue): appended at the tail, or
    inserted just before ``run``, in O(1) without an object per page.  Any other arrival
    (a page suspended with an old last_used, a lower priority than the tail's) goes into
    ``heap``, a lazy min-heap of ``(evict_key, serial)`` entries: an entry is valid only while
    its page is still in this pool, in this state, with that key (recomputed), so it turns
    stale by the page's change itself and is dropped when it surfaces.  The next victim is the smaller
    of the two heads.  Invariants: the list is sorted by key; every page from ``run`` to
    ``tail`` has the tail's last_used."""

    __slots__ = ("head", "heap", "run", "tail")

    def __init__(self) -> None:
        self.head: Page | None = None
        self.tail: Page | None = None
        self.run: Page | None = None
        self.heap: list[EvictEntry] = []

    def insert(self, page: Page, before: Page | None) -> None:
        """Link ``page`` into the list just before ``before`` (None: at the tail)."""
        after = before.prev if before is not None else self.tail
        page.prev = after
        page.next = before
        if after is not None:
            after.next = page
        else:
            self.head = page
        if before is not None:
            before.prev = page
        else:
            self.tail = page

    def remove(self, page: Page) -> None:
        """Unlink ``page`` if it is on the list (a heap entry of it needs nothing: stale)."""
        prev, nxt = page.prev, page.next
        if prev is None and self.head is not page:
            return  # not on the list
        if prev is not None:
            prev.next = nxt
        else:
            self.head = nxt
        if nxt is not None:
            nxt.prev = prev
        else:
            self.tail = prev
        if self.run is page:  # [run, tail] keeps one last_used: step run forward, or onto the new tail
            self.run = nxt if nxt is not None else self.tail
        page.prev = page.next = None


class Pool:
    """Slots of one life cycle in one tier.

    Free slots sit in a min-heap so allocation is always the lowest free index.  Evictable
    pages sit in one ``_Index`` per state (HELD, DROPPABLE).  An index entry of a page in
    the heap names its page by serial (``pages``: the manager's live pages by serial).
    """

    def __init__(self, tier: int, lc: int, total: int, pages: dict[int, Page], key: Callable[[Page], tuple]) -> None:
        self.pages = pages
        self.key = key  # the eviction order (EvictionStrategy.key): lower goes first
        self.tier = tier
        self.lc = lc
        self.total = total
        self.free_slots = list(range(total))  # already a valid heap
        self.locked = 0
        self.held = 0
        self.droppable = 0
        self.held_index = _Index()
        self.droppable_index = _Index()

    @property
    def nfree(self) -> int:
        return len(self.free_slots)

    def take_slot(self) -> int:
        """SPEC sec. 4: the lowest-numbered free slot."""
        return heapq.heappop(self.free_slots)

    def give_slot(self, slot: int) -> None:
        heapq.heappush(self.free_slots, slot)

    def grow(self, n: int) -> None:
        """set_quota: slots ``[total, n)`` join the free slots (DECISIONS.md "Quotas at
        run time"); each is larger than every slot in the heap, so it stays a heap."""
        self.free_slots.extend(range(self.total, n))
        self.total = n

    def shrink(self, n: int) -> None:
        """set_quota: slots ``[n, total)`` go; the caller emptied them."""
        kept = [s for s in self.free_slots if s < n]
        assert len(self.free_slots) - len(kept) == self.total - n, "kvcm bug: shrink of a used slot"
        heapq.heapify(kept)
        self.free_slots = kept
        self.total = n

    def unindex(self, page: Page) -> None:
        """Before a change of ``page``'s state, eviction key or place: it leaves its state's
        count (SPEC sec. 4 states) and its index."""
        state = page.state
        if state == LOCKED:
            self.locked -= 1
        elif state == HELD:
            self.held -= 1
            self.held_index.remove(page)
        elif state == DROPPABLE:
            self.droppable -= 1
            self.droppable_index.remove(page)

    def index(self, page: Page) -> None:
        """After the change: ``page`` is counted under its new state and, when it is a victim
        candidate (HELD or DROPPABLE), indexed with its new eviction key (SPEC sec. 8)."""
        state = page.state
        if state == LOCKED:
            self.locked += 1
            return
        if state == HELD:
            self.held += 1
            ix = self.held_index
        elif state == DROPPABLE:
            self.droppable += 1
            ix = self.droppable_index
        else:
            return
        # (the two list cases exclude each other; the run's is tested first as the pages a
        # call releases together all but the first take it)
        key = self.key(page)
        r = ix.run
        if r is not None and r.last_used == page.last_used and key < self.key(r) and (
                r.prev is None or self.key(r.prev) < key):
            ix.insert(page, r)  # just before the tail's run
            ix.run = page
            return
        tail = ix.tail
        if tail is None or self.key(tail) < key:  # the newest: appended
            if tail is None or tail.last_used != page.last_used:
                ix.run = page
            ix.insert(page, None)
            return
        heap = ix.heap
        heapq.heappush(heap, (key, page.serial))
        if len(heap) > 64 and len(heap) > 4 * (self.held + self.droppable):
            self._compact(ix, HELD if ix is self.held_index else DROPPABLE)

    def peek(self, state: str) -> Page | None:
        """The lowest page of ``state`` by eviction key (stale heap entries dropped)."""
        ix = self.held_index if state == HELD else self.droppable_index
        heap = ix.heap
        first = ix.head
        while heap:
            key, serial = heap[0]
            page = self.pages.get(serial)
            if page is not None and self._valid(page, key, state):
                return page if first is None or key < self.key(first) else first
            heapq.heappop(heap)
        return first

    def _valid(self, page: Page, key: tuple[int, int, int, int], state: str) -> bool:
        """A heap entry of ``page`` with ``key`` still stands for it in ``state``'s index."""
        return (page.tier == self.tier and page.slot >= 0 and page.state == state
                and self.key(page) == key)

    def _compact(self, ix: _Index, state: str) -> None:
        """Drop the stale heap entries once they outnumber the pages by far (a set: equal
        entries, a page pushed again with an unchanged key, kept once)."""
        pages = self.pages
        heap = [e for e in set(ix.heap) if e[1] in pages and self._valid(pages[e[1]], e[0], state)]
        heapq.heapify(heap)
        ix.heap = heap
