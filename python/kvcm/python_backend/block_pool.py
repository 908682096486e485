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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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
from kvcm.keys import block_key
from kvcm.python_backend.pools import DROPPABLE, NO_NODE, Page, Pool
from kvcm.python_backend.tree import NO_PAGE, RadixTree

_LC_COUNTERS = ("reused_blocks", "missed_blocks", "reused_tokens", "allocated_blocks", "offloads", "offload_bytes",
                "onboards", "onboard_bytes", "drops", "drop_bytes", "cows", "snapshots_taken", "snapshots_skipped",
                "lost_pages", "shared_stores", "shared_store_bytes", "shared_hit_blocks", "relocations")

# the counters a move counts, by reason
_MOVE_COUNTERS = {"offload": ("offloads", "offload_bytes"), "onboard": ("onboards", "onboard_bytes")}

# the counter each copy op between pages counts (BlockPool.copy)
_COPY_COUNTERS = {"cow": "cows", "snapshot": "snapshots_taken"}


@dataclass(frozen=True, slots=True)
class Layout:
    """The facts of the configuration a request's operations read (SPEC sec. 1, 2): they
    never change, so a request reads them as one value (C++ twin: ``Layout`` in block_pool.h)."""

    B: int  # tokens per block
    lcs: tuple[LifeCycle, ...]
    attn_lcs: tuple[int, ...]  # the attention life cycles, ascending
    ssm_lc: int | None  # the ssm life cycle (at most one)
    # no windowed attention: no block ever becomes stale (the decode step's shortcut)
    full_attention_only: bool
    partial_reuse: bool  # enable_partial_reuse
    max_util_for_resume: float

    def stale_range(self, lc: int, history: int) -> tuple[int, int]:
        """SPEC sec. 2: the block ordinals ``[lo, hi)`` of ``lc`` stale at ``history``."""
        return self.lcs[lc].stale_range(history, self.B)


class Budget(NamedTuple):
    """The gpu pool of one life cycle as a request's feasibility checks read it (SPEC sec.
    8, DECISIONS.md "All-or-nothing resume / resize"; ``BlockPool.budget``)."""

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


class HeldMatch(NamedTuple):
    """What a request holds after ``BlockPool.hold_match``: the match length, the blocks it
    references (ordinal order), its pages per attention lc (None: stale) and the ssm
    snapshot at the match end."""

    m: int
    blocks: list[int]
    pages: dict[int, list[Page | None]]
    snap: Page | None


class Chain(NamedTuple):
    """What ``BlockPool.insert_block`` reads of the request whose block it inserts (it
    changes none of it: the request applies the result, ``Inserted``)."""

    root: int  # its scope's root
    blocks: list[int]  # the tree block it references per ordinal (NO_NODE: none)
    pages: dict[int, list[Page | None]]  # its page table per attention lc
    live: Page | None  # its live ssm state
    priority: int
    active: bool  # ACTIVE (its pages LOCKED), else SUSPENDED (HELD)


class Inserted(NamedTuple):
    """``BlockPool.insert_block``'s result for the request: the block it now references for
    the inserted ordinal, the ordinals of its orphaned chain that re-attachment moved to
    an equivalent block (ordinal -> block), and its pages the insertion replaced by the
    tree's (lc, page) at the inserted ordinal."""

    node: int
    switched: dict[int, int]
    replaced: list[tuple[int, Page]]


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
        # what a request reads of the configuration (the same values, one immutable record)
        self.layout = Layout(self.B, self.lcs, tuple(self.attn_lcs), self.ssm_lc, self.full_attention_only,
                             config.enable_partial_reuse, config.max_util_for_resume)
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

    # ------------------------------------------------------------------ a request's references

    def open_scope(self, root_key: bytes) -> int:
        """SPEC sec. 15: the root of the scope ``root_key``, made on first use, with one more
        reference (each open request holds one, a fork its own)."""
        root = self.tree.root(root_key)
        self.tree.ref(root)
        return root

    def hold_match(self, root: int, tokens: Sequence[Token], keys: list[bytes],
                   hits: set[tuple[bytes, int]] | None, priority: int) -> HeldMatch:
        """SPEC sec. 6, 7 create: the match a request created now takes (``match_with_hits``,
        what probes report), held as a SUSPENDED request holds it: its blocks referenced,
        the pages of its blocks not stale at the match end and the ssm snapshot there used
        (HELD, LRU touched, ``priority`` raised).  With the store's ``hits`` the match may
        extend into the shared tier: its blocks enter the tree here (DECISIONS.md "The
        shared tier")."""
        m, _mbs, path, rows = self.match_with_hits(root, tokens, keys, hits)
        if rows is not None:
            path = self._insert_shared_blocks(root, tokens, keys, m, path, rows, priority)
        tree = self.tree
        for nid in path:
            tree.ref(nid)
        pages: dict[int, list[Page | None]] = {lc: [None] * len(path) for lc in self.attn_lcs}
        for lc in self.attn_lcs:
            lo, hi = self.lcs[lc].stale_range(m, self.B)
            row = pages[lc]
            for j, nid in enumerate(path):
                if lo <= j < hi:
                    continue
                page = self.pages[tree.page(nid, lc)]
                self.use(page, False, priority)
                row[j] = page
        snap = None
        if self.ssm_lc is not None and m > 0:
            snap = self.pages[tree.page(path[-1], self.ssm_lc)]
            self.use(snap, False, priority)
        return HeldMatch(m, list(path), pages, snap)

    def _insert_shared_blocks(self, root: int, tokens: Sequence[Token], keys: list[bytes], m: int,
                              tree_path: list[int], rows: list[list[int]], priority: int) -> list[int]:
        """DECISIONS.md "The shared tier": the extension's blocks below ``ceil(m / B)`` enter
        the tree at once, with a shared page (tier 3, slot -1) for exactly the pages a
        request created with the match holds: attention pages of blocks non-stale at ``m``,
        and the ssm snapshot of the block ``m`` ends in.  Returns the match path (tree path
        + new blocks)."""
        tree = self.tree
        B = self.B
        nb = -(-m // B)
        path = list(tree_path[:nb])
        parent = path[-1] if path else root
        for i in range(len(tree_path), nb):
            row = rows[i - len(tree_path)]
            nid = tree.new_block(keys[i], tokens[i * B:(i + 1) * B], i)
            for lc, life in enumerate(self.lcs):
                if life.kind == "ssm":
                    held = i == nb - 1
                else:
                    lo, hi = life.stale_range(m, B)
                    held = not lo <= i < hi
                if not held:
                    continue
                assert row[lc] == B, "kvcm bug: the fixed point kept a block without its page"
                page = self.new_shared_page(lc, priority, i)
                tree.set_page(nid, lc, page.serial, B)
                self.restate(page, node=nid)  # (a shared page is in no pool: the field alone)
            self.attach(parent, nid)
            path.append(nid)
            parent = nid
        return path

    def hold(self, blocks: Iterable[int], pages: dict[int, list[Page | None]], priority: int) -> None:
        """SPEC sec. 18 fork: a new ACTIVE request takes its own references of ``blocks``
        (NO_NODE skipped) and uses ``pages`` (per attention lc; None skipped), LOCKED."""
        tree = self.tree
        for nid in blocks:
            if nid != NO_NODE:
                tree.ref(nid)
        for lc in self.attn_lcs:
            for p in pages[lc]:
                if p is not None:
                    self.use(p, True, priority)

    # ------------------------------------------------------------------ tree insertion (sec. 5)

    def insert_block(self, chain: Chain, i: int, tokens: Sequence[Token], key_hint: tuple[bytes | None, bytes] | None,
                     want_snapshot: bool, defer_prune: bool = False) -> Inserted:
        """SPEC sec. 5, 7: block ``i`` of a request's ``chain`` (full, or its partial tail)
        into the tree, under the block ``i - 1`` of the chain (its orphaned blocks
        re-attached first, ``parent_for``): a new block adopting the request's pages, or
        the existing equivalent one, which takes the request's pages where they cover more
        (and the request the tree's gpu page where the tree's covers as much).  With
        ``want_snapshot``, the request's live ssm state is copied into a snapshot page first
        when the block has none covering as much.  ``key_hint``: the key hashed at create
        for these tokens, with the parent key it was chained from (None: the scope's root).

        ``defer_prune``: more blocks of this commit follow.  A new block without a page
        stays detached, and pruning its parent chain now would only have the next block
        re-attach the whole chain again (quadratic in the blocks of one pure-ssm commit):
        the chain stays attached until the commit's last block, whose insertion prunes (or
        keeps) it exactly as it would have been (DECISIONS.md)."""
        tree = self.tree
        ntok = len(tokens)
        key = self._key_for(chain, i, tokens, key_hint)
        switched: dict[int, int] = {}
        parent = self._parent_for(chain, i, switched)
        existing = tree.find_existing(parent, key, tokens)
        snap: Page | None = None
        ssm = self.ssm_lc
        # shared_write="commit": a full-coverage page of a full block that becomes a tree
        # page here is written to the shared tier (DECISIONS.md "The shared tier")
        store = self.store_on_commit and ntok == self.B
        if want_snapshot and (existing == NO_NODE or tree.coverage(existing, ssm) < ntok):
            live = chain.live
            if live is None or live.tier != GPU or not self.make_room(GPU, ssm):
                self.count(ssm, "snapshots_skipped")
            else:
                snap = self.new_page(GPU, ssm, ntok, chain.priority, i)
                self.copy(ssm, live, snap, "snapshot")
                if store:
                    self.store(snap, key)
                # eviction may have pruned this request's chain or the existing block
                parent = self._parent_for(chain, i, switched)
                existing = tree.find_existing(parent, key, tokens)
        old = chain.blocks[i] if i < len(chain.blocks) else NO_NODE  # (an ordinal it referenced before)
        if existing == NO_NODE:
            nid = tree.new_block(key, tokens, i)
            for lc in self.attn_lcs:
                pages = chain.pages[lc]
                p = pages[i] if i < len(pages) else None
                if p is not None:
                    if p.node != NO_NODE:
                        # forks: a shared partial page another user's stop_committing put
                        # into a block that was detached since (so not found): it moves here
                        # (DECISIONS.md "Forks", the tail block of a stop)
                        self.unlink_from_node(p)
                    p.coverage = ntok
                    tree.set_page(nid, lc, p.serial, ntok)
                    p.node = nid  # a used page: its state does not depend on the node
                    if store:
                        self.store(p, key)
            if snap is not None:
                tree.set_page(nid, ssm, snap.serial, ntok)
                self.restate(snap, node=nid)
            self._move_reference(old, nid)
            if tree.nodes[nid].has_page():
                self.attach(parent, nid)
            elif not defer_prune:
                tree.prune_upward(parent)  # a re-attached chain must not stay childless
            return Inserted(nid, switched, [])
        gained: list[int] = []
        replaced: list[tuple[int, Page]] = []
        active = chain.active
        for lc in self.attn_lcs:
            pages = chain.pages[lc]
            p = pages[i] if i < len(pages) else None
            if p is None:
                continue
            p.coverage = ntok
            q_handle = tree.page(existing, lc)
            if q_handle == NO_PAGE or tree.coverage(existing, lc) < ntok:
                self._install(existing, lc, p, gained)
                if store:
                    self.store(p, key)
            else:
                q = self.pages[q_handle]
                if q.tier == GPU:  # the request switches to the tree's page; its index changes
                    self.use(q, active, chain.priority)
                    replaced.append((lc, q))
                    self.unuse(p, active)
                # else: the request keeps its page privately (freed at close)
        if snap is not None:
            self._install(existing, ssm, snap, gained)
        self._move_reference(old, existing)
        self.emit_stored(existing, gained)
        return Inserted(existing, switched, replaced)

    def _move_reference(self, old: int, new: int) -> None:
        """A request's ordinal now references ``new`` instead of ``old`` (NO_NODE: none):
        ``new`` is referenced first, so a block referenced by both never dies in between."""
        self.tree.ref(new)
        if old != NO_NODE:
            self.tree.unref(old)

    def _key_for(self, chain: Chain, i: int, tokens: Sequence[Token], hint: tuple[bytes | None, bytes] | None,
                 ) -> bytes:
        """SPEC sec. 3: the key of block ``i`` of ``chain`` holding ``tokens``: the hash
        done at create (``hint``) when it was chained from the same parent key."""
        parent = self.tree.key(chain.blocks[i - 1] if i > 0 else chain.root)
        if hint is not None and (i == 0 or hint[0] == parent):
            return hint[1]
        return block_key(parent, tokens)

    def _parent_for(self, chain: Chain, i: int, switched: dict[int, int]) -> int:
        """SPEC sec. 5: the attached node to insert block ``i`` of ``chain`` under,
        re-attaching the chain's orphaned blocks first (the bug this project exists to
        get right).  An orphan with an equivalent attached block is switched to it
        (``switched``: ordinal -> block, read before ``chain.blocks``)."""
        if i == 0:
            return chain.root
        tree = self.tree
        blocks = chain.blocks
        prev = switched.get(i - 1, blocks[i - 1])
        if tree.is_attached(prev):
            return prev
        k = i - 1
        while k >= 0 and not tree.is_attached(switched.get(k, blocks[k])):
            k -= 1
        parent = chain.root if k < 0 else switched.get(k, blocks[k])
        for j in range(k + 1, i):
            orphan = switched.get(j, blocks[j])
            node = tree.nodes[orphan]
            existing = tree.find_existing(parent, node.key, node.tokens)
            if existing != NO_NODE:
                self._switch_block(chain, j, orphan, existing, switched)
            else:
                self.attach(parent, orphan)
            parent = switched.get(j, blocks[j])
        return parent

    def _switch_block(self, chain: Chain, j: int, orphan: int, existing: int, switched: dict[int, int]) -> None:
        """SPEC sec. 5 re-attachment: another request inserted a block equivalent to the
        chain's orphan ``j`` meanwhile: the chain uses it, its pages moving into it where
        they cover more."""
        tree = self.tree
        gained: list[int] = []
        for lc in self.attn_lcs:
            pages = chain.pages[lc]
            p = pages[j] if j < len(pages) else None
            if p is None or p.node != orphan or tree.coverage(existing, lc) >= p.coverage:
                continue
            self._install(existing, lc, p, gained)
        tree.ref(existing)
        switched[j] = existing
        tree.unref(orphan)
        self.emit_stored(existing, gained)

    def _install(self, nid: int, lc: int, p: Page, gained: list[int]) -> None:
        """SPEC sec. 5: make ``p`` the page of block ``nid`` for ``lc`` (a slot keeps only the
        page with the largest coverage).  ``lc`` joins ``gained`` (the caller's ``stored``);
        a replaced page is first announced ``removed`` (DECISIONS.md "Tree and events")."""
        tree = self.tree
        if p.node != NO_NODE:  # moving from an orphan block
            old_node = p.node
            p.node = NO_NODE
            tree.set_page(old_node, lc, NO_PAGE, 0)
        old = tree.set_page(nid, lc, p.serial, p.coverage)
        if p.locks or p.holds:
            p.node = nid  # a used page: its state does not depend on the node
        else:
            self.restate(p, node=nid)
        if old == NO_PAGE:
            gained.append(lc)
            return
        q = self.pages[old]
        self.restate(q, node=NO_NODE)
        self.emit_removed(tree.key(nid), lc)  # a coverage upgrade: removed now, stored by the caller
        gained.append(lc)
        if q.locks == 0 and q.holds == 0:
            self.free_page(q)

    def attach(self, parent: int, nid: int) -> None:
        """SPEC sec. 5 attach: link block ``nid`` under ``parent`` and announce it: ``removed`` for every lc the
        detached partial siblings had (adopted pages included), then ``stored``."""
        tree = self.tree
        siblings = tree.attach(parent, nid)
        node = tree.nodes[nid]
        if not siblings:  # the common case: nothing detached, nothing swapped, only ``stored``
            self.emit_stored(nid, [lc for lc, h in enumerate(node.pages) if h != NO_PAGE])
            return
        had: dict[int, set[int]] = {sid: set() for sid in siblings}
        for sid in siblings:  # page.node still names the owner from before the swap
            for lc, h in enumerate(tree.nodes[sid].pages):
                if h != NO_PAGE and self.pages[h].node == sid:
                    had[sid].add(lc)
        for lc, h in enumerate(node.pages):
            if h != NO_PAGE and self.pages[h].node in had:
                had[self.pages[h].node].add(lc)
        for sid in siblings:
            for lc in sorted(had[sid]):
                self.emit_removed(tree.nodes[sid].key, lc)
        for lc in range(len(self.lcs)):
            if node.pages[lc] != NO_PAGE:
                self.pages[node.pages[lc]].node = nid
            for sid in siblings:
                h = tree.nodes[sid].pages[lc]
                if h != NO_PAGE:
                    self.pages[h].node = sid
        self.retire_nodes(siblings, announce=False)
        self.emit_stored(nid, [lc for lc in range(len(self.lcs)) if node.pages[lc] != NO_PAGE])

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
        """SPEC sec. 7 resume / suspend: HELD -> LOCKED / LOCKED -> HELD without touching
        LRU.  A page resumed on a colder tier is onboarded first (resume's check promised
        the room)."""
        if active:
            if page.tier != GPU:
                self.ensure_room(GPU, page.lc)
                self.move(page, GPU, "onboard")
            self.restate(page, locks=page.locks + 1, holds=page.holds - 1)
        else:
            self.restate(page, locks=page.locks - 1, holds=page.holds + 1)

    def alloc(self, lc: int, coverage: int, ordinal: int, priority: int, active: bool) -> Page:
        """SPEC sec. 4, 7: a new gpu page private to one request, used in its state (LOCKED
        when it is ACTIVE, else HELD); room is made first (the caller's check promised it)."""
        self.ensure_room(GPU, lc)
        page = self.new_page(GPU, lc, coverage, priority, ordinal)
        self.use(page, active, priority)
        return page

    def set_coverage(self, page: Page, coverage: int) -> None:
        """SPEC sec. 7 commit: the tokens a request wrote into its private ``page`` (no part
        of the page's state or eviction key)."""
        page.coverage = coverage

    def unref(self, node: int) -> None:
        """A request stops referencing tree block ``node`` (or its scope root): a detached
        block, or an unused root, goes with its last reference (sec. 5, 15)."""
        self.tree.unref(node)

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
        colder = self._capacity_of(GPU + 1, lc) if self.num_tiers > 1 else 0
        return Budget(pool.total, free, pool.locked, held, droppable, colder)

    def _capacity_of(self, tier: int, lc: int) -> int:
        """The pages pool (tier, lc) could take after eviction (``Budget.fits``'s rule)."""
        pool = self.pools[tier][lc]
        if tier == self.num_tiers - 1:
            return pool.nfree + pool.droppable
        return pool.nfree + pool.droppable + min(pool.held, self._capacity_of(tier + 1, lc))

    def ensure_room(self, tier: int, lc: int) -> None:
        """``make_room`` where a feasibility check already promised the slot."""
        if not self.make_room(tier, lc):
            raise AssertionError("kvcm bug: a feasibility check passed but eviction found no slot")

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
            movable = min(pool.held, self._capacity_of(pos + 1, lc)) if pos < self.num_tiers - 1 else 0
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
        """SPEC sec. 7, 8: a copy op from ``src`` to ``dst`` (``cow`` or ``snapshot``), counted."""
        tid = self.tier_ids
        self.add_copy_op(CopyOp(lc, tid[src.tier], src.slot, tid[dst.tier], dst.slot, reason), dst.serial)
        self.count(lc, _COPY_COUNTERS[reason])

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
