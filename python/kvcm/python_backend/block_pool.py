"""The block pool: the parts that hold what is not one request's, put together (SPEC sec. 4, 5, 8, 9, 15).

C++ twin: ``cpp/core/block_pool.{h,cpp}``.  A ``BlockPool`` owns the logical clock and
the parts, each with one job, and wires each to the parts it needs (constructor
injection; each knows only what it is given, none knows one above it):

* ``layout`` (``layout.py``, ``Layout``): the configuration's facts, read-only;
* ``outbox`` (``outbox.py``, ``Outbox``): what leaves the manager: copy ops, events, stats;
* ``pages`` (``pages.py``, ``Pages``): the live pages and the slot pools of each (tier,
  lc), the one writer of a page's fields;
* ``tree_index`` (``tree_index.py``, ``TreeIndex``): the radix tree (``tree.py``) as
  requests use it: match, hold, insert, re-attachment, pruning;
* ``evictor`` (``evictor.py``, ``Evictor``): room in the pools, by its strategy's order
  (``LruStrategy``, SPEC sec. 8).

Its own methods are only the operations that span parts (``alloc``: room, then a page).
A request (``request.py``) calls the parts; the manager (``manager.py``) owns the ids,
the request registries and the lock.  Everything here is deterministic: no wall clock,
no hash-seed or dict-order dependence in what is observable.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcm.api import GPU, KVCacheManagerConfig, Token
from kvcm.config import resolve_config
from kvcm.python_backend.evictor import EvictionStrategy, Evictor, LruStrategy
from kvcm.python_backend.layout import Layout
from kvcm.python_backend.outbox import Outbox
from kvcm.python_backend.pages import Clock, Pages
from kvcm.python_backend.pools import NO_NODE, Page
from kvcm.python_backend.tree import RadixTree
from kvcm.python_backend.tree_index import Chain, Inserted, TreeIndex

__all__ = ["NO_NODE", "BlockPool", "Chain", "Inserted", "Page"]


class BlockPool:
    """The clock and the parts of one manager (pages, tree index, evictor, outbox)."""

    def __init__(self, config: KVCacheManagerConfig, strategy: EvictionStrategy | None = None) -> None:
        rc = resolve_config(config)
        self.rc = rc
        self.config = config
        self.layout = Layout.of(rc)
        self.clock = Clock()  # logical clock (sec. 4): ticks once per state-changing public call
        self.tree = RadixTree(self.layout.B, self.layout.lcs)
        strategy = strategy if strategy is not None else LruStrategy()
        self.outbox = Outbox(self.layout, config, rc.explicit_settlement)
        self.pages = Pages(self.layout, rc.slots, rc.quotas, self.clock, self.tree, self.outbox, strategy.key)
        self.tree_index = TreeIndex(self.layout, self.tree, self.pages, self.outbox)
        self.evictor = Evictor(self.layout, self.pages, self.tree_index, self.outbox, strategy)

    def tick(self) -> int:
        """The clock ticks (once per state-changing public call)."""
        return self.clock.tick()

    # --- operations that span parts

    def alloc(self, lc: int, coverage: int, ordinal: int, priority: int, active: bool) -> Page:
        """SPEC sec. 4, 7: a new gpu page private to one request, used in its state (LOCKED
        when it is ACTIVE, else HELD); room is made first (the caller's check promised it)."""
        self.evictor.ensure_room(GPU, lc)
        page = self.pages.new_page(GPU, lc, coverage, priority, ordinal)
        self.pages.use(page, active, priority)
        return page

    def set_active(self, page: Page, active: bool) -> None:
        """SPEC sec. 7 resume / suspend: HELD -> LOCKED / LOCKED -> HELD without touching
        LRU.  A page resumed on a colder tier is onboarded first (resume's check promised
        the room)."""
        if active and page.tier != GPU:
            self.evictor.ensure_room(GPU, page.lc)
            self.evictor.move(page, GPU, "onboard")
        self.pages.set_active(page, active)

    def insert_block(self, chain: Chain, i: int, tokens: Sequence[Token], key_hint: tuple[bytes | None, bytes] | None,
                     want_snapshot: bool, defer_prune: bool = False) -> Inserted:
        """SPEC sec. 5, 7: block ``i`` of a request's ``chain`` into the tree
        (``TreeIndex.insert_block``).  With ``want_snapshot``, the request's live ssm state
        is first copied into a snapshot page when the block would have none covering as
        much (room made by eviction, which may prune the chain: the tree index looks for
        the block's parent again).  ``key_hint``: the key hashed at create for these
        tokens, with the parent key it was chained from (None: the scope's root)."""
        ti = self.tree_index
        key = ti.key_for(chain, i, tokens, key_hint)
        switched: dict[int, int] = {}
        snap = None
        if want_snapshot and ti.lacks_snapshot(chain, i, key, tokens, switched):
            snap = self._snapshot(chain, i, len(tokens), key)
        return ti.insert_block(chain, i, tokens, key, switched, snap, defer_prune)

    def _snapshot(self, chain: Chain, i: int, ntok: int, key: bytes) -> Page | None:
        """SPEC sec. 7: a snapshot page of block ``i`` (``ntok`` tokens, key ``key``) filled
        from ``chain``'s live ssm state, or None (counted skipped) when the state is not on
        the gpu or no room can be made."""
        layout, outbox = self.layout, self.outbox
        ssm = layout.ssm_lc
        live = chain.live
        if live is None or live.tier != GPU or not self.evictor.make_room(GPU, ssm):
            outbox.count(ssm, "snapshots_skipped")
            return None
        snap = self.pages.new_page(GPU, ssm, ntok, chain.priority, i)
        outbox.copy(ssm, live, snap, "snapshot")
        if layout.store_on_commit and ntok == layout.B:  # shared_write="commit"
            outbox.store(snap, key)
        return snap

    def apply_quota(self, pos: int, q: int, per_lc: Sequence[int]) -> None:
        """SPEC sec. 18: the pools of tier ``pos`` to ``per_lc`` slots (``Pages.check_quota``
        passed): shrinking, what must go is evicted first, in the usual order (sec. 8)."""
        for lc, n in enumerate(per_lc):
            pool = self.pages.pool(pos, lc)
            while pool.total - pool.nfree > n:
                if not self.evictor.evict_one(pos, lc):
                    raise AssertionError(f"kvcm bug: set_quota found no victim in pool ({pos}, {lc})")
            self.pages.resize_pool(pos, lc, n)
        self.pages.quotas[pos] = q

    def stats_view(self, counters: dict) -> dict:
        """SPEC sec. 9: the stats dict of ``counters`` (cumulative or this iteration's) with
        the pools' figures now."""
        return self.outbox.stats_view(counters, self.pages.tier_stats())

    def take_iteration_stats(self) -> dict:
        return self.outbox.take_iteration_stats(self.pages.tier_stats())
