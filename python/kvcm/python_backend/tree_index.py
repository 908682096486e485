"""The radix tree's use by requests: match, hold, insert, scopes, pruning (SPEC sec. 5, 6, 7, 15).

C++ twin: ``cpp/core/tree_index.{h,cpp}``.  ``TreeIndex`` links pages into the tree's
blocks and out of them: it is the home of orphan re-attachment (``parent_for``, the bug
this project exists to get right), of sec. 5 pruning (``unlink_committed``,
``retire_nodes``) and of the ``stored`` / ``removed`` events of blocks.  ``RadixTree``
(``tree.py``) is the data structure underneath; the pages change through ``Pages`` and
what leaves the manager goes through the ``Outbox``.  It never evicts: an insertion that
needs room for a snapshot gets the snapshot page from the block pool
(``BlockPool.insert_block``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from kvcm.api import GPU, SHARED, Token
from kvcm.keys import block_key
from kvcm.python_backend.layout import Layout
from kvcm.python_backend.outbox import Outbox
from kvcm.python_backend.pages import Pages
from kvcm.python_backend.pools import NO_NODE, Page
from kvcm.python_backend.tree import NO_PAGE, RadixTree

# a page about to be freed with a block eviction removes (``Evictor.store_evicted``)
OnFree = Callable[[Page], None] | None


class HeldMatch(NamedTuple):
    """What a request holds after ``TreeIndex.hold_match``: the match length, the blocks it
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
    """The match a request created now takes (``TreeIndex.match_with_hits``; C++:
    ``RequestMatch`` in tree_index.h)."""

    m: int  # SPEC sec. 6: the match length
    m_before_ssm: int  # the same fixed point without the ssm rule, over the same blocks
    # the tree blocks of the match: the ``ceil(m / B)`` blocks of the ordinary match, or,
    # extended, the whole tree path ``[0, P)`` (the blocks past it are the extension's)
    path: list[int]
    rows: list[list[int]] | None  # extended: the coverage per lc of blocks P, P + 1, ...; else None


class TreeIndex:
    """The tree's blocks, the pages linked into them and the references requests hold."""

    def __init__(self, layout: Layout, tree: RadixTree, pages: Pages, outbox: Outbox) -> None:
        self.layout = layout
        self.tree = tree
        self.pages = pages
        self.outbox = outbox

    # ------------------------------------------------------------------ match (sec. 6)

    def match(self, root: int, tokens: Sequence[Token], keys: list[bytes]) -> tuple[int, int, list[int]]:
        layout = self.layout
        return self.tree.match(root, tokens, keys, layout.partial_reuse, layout.reuse_match_backoff)

    def match_shared(self, root: int, keys: list[bytes], hits: set[tuple[bytes, int]]) -> tuple[
            int, int, list[int], list[list[int]]]:
        """DECISIONS.md "The shared tier": the match extended by the store's hits.  The tree
        path ``[0, P)`` (full blocks by key; none under a scope with no root, ``root``
        NO_NODE), then the blocks ``P .. L`` (``L`` the last full block with a hit;
        coverage B per hit lc, else 0), backoff, then the fixed point of SPEC sec. 6 step 3
        with no partial step.  Returns ``(m, m_before_ssm, tree_path, rows)``: ``rows[k]``
        the coverage per lc of block ``P + k``; ``m`` is -1 without a hit."""
        B = self.layout.B
        path = self.tree.key_path(root, keys) if root != NO_NODE else []
        rows = [[B if (keys[i], lc) in hits else 0 for lc in range(len(self.layout.lcs))]
                for i in range(len(path), len(keys))]
        while rows and not any(rows[-1]):
            rows.pop()
        if not rows:
            return -1, -1, path, rows
        m = max(0, (len(path) + len(rows)) * B - self.layout.reuse_match_backoff)
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
        B = self.layout.B
        last = -(-m // B) - 1  # the block whose snapshot a request holds
        # per lc: (lc, is ssm, its stale range at m); computed once, not per block
        held = [(life.id, life.kind == "ssm", life.stale_range(m, B)) for life in self.layout.lcs]
        live, nodes, tier_ids = self.pages.live, self.tree.nodes, self.layout.tier_ids
        out = []
        for j in range(m // B):
            tier = -1
            for lc, ssm, (lo, hi) in held:
                if (j != last) if ssm else (lo <= j < hi):
                    continue
                if j >= len(path):  # the shared tier's extension: a shared page
                    tier = max(tier, SHARED)
                    continue
                tier = max(tier, tier_ids[live[nodes[path[j]].pages[lc]].tier])
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
        tree, pages, layout = self.tree, self.pages, self.layout
        for nid in path:
            tree.ref(nid)
        held: dict[int, list[Page | None]] = {lc: [None] * len(path) for lc in layout.attn_lcs}
        for lc in layout.attn_lcs:
            lo, hi = layout.stale_range(lc, m)
            row = held[lc]
            for j, nid in enumerate(path):
                if lo <= j < hi:
                    continue
                page = pages.page(tree.page(nid, lc))
                pages.use(page, False, priority)
                row[j] = page
        snap = None
        if layout.ssm_lc is not None and m > 0:
            snap = pages.page(tree.page(path[-1], layout.ssm_lc))
            pages.use(snap, False, priority)
        return HeldMatch(m, list(path), held, snap)

    def _insert_shared_blocks(self, root: int, tokens: Sequence[Token], keys: list[bytes], m: int,
                              tree_path: list[int], rows: list[list[int]], priority: int) -> list[int]:
        """DECISIONS.md "The shared tier": the extension's blocks below ``ceil(m / B)`` enter
        the tree at once, with a shared page (tier 3, slot -1) for exactly the pages a
        request created with the match holds: attention pages of blocks non-stale at ``m``,
        and the ssm snapshot of the block ``m`` ends in.  Returns the match path (tree path
        + new blocks)."""
        tree = self.tree
        B = self.layout.B
        nb = -(-m // B)
        path = list(tree_path[:nb])
        parent = path[-1] if path else root
        for i in range(len(tree_path), nb):
            row = rows[i - len(tree_path)]
            nid = tree.new_block(keys[i], tokens[i * B:(i + 1) * B], i)
            for lc, life in enumerate(self.layout.lcs):
                if life.kind == "ssm":
                    held = i == nb - 1
                else:
                    lo, hi = life.stale_range(m, B)
                    held = not lo <= i < hi
                if not held:
                    continue
                assert row[lc] == B, "kvcm bug: the fixed point kept a block without its page"
                page = self.pages.new_shared_page(lc, priority, i)
                tree.set_page(nid, lc, page.serial, B)
                self.pages.restate(page, node=nid)  # (a shared page is in no pool: the field alone)
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
        for lc in self.layout.attn_lcs:
            for p in pages[lc]:
                if p is not None:
                    self.pages.use(p, True, priority)

    def release(self, page: Page, active: bool) -> None:
        """SPEC sec. 4: a request stops using ``page``: a private or orphaned page with no user
        left is freed; a tree page becomes DROPPABLE (a shared one goes: it lives only while
        a request uses it, DECISIONS.md "The shared tier")."""
        self.pages.unuse(page, active)
        if page.locks or page.holds:
            return
        if page.node == NO_NODE:  # a private page nobody uses
            self.pages.free_page(page)
        elif not self.tree.is_attached(page.node):
            self.free_orphan_page(page)
        elif page.tier == self.layout.shared_pos:
            self.unlink_committed(page)
            self.pages.free_page(page)

    def unref(self, node: int) -> None:
        """A request stops referencing tree block ``node`` (or its scope root): a detached
        block, or an unused root, goes with its last reference (sec. 5, 15)."""
        self.tree.unref(node)

    # ------------------------------------------------------------------ tree insertion (sec. 5)

    def lacks_snapshot(self, chain: Chain, i: int, key: bytes, tokens: Sequence[Token],
                       switched: dict[int, int]) -> bool:
        """Whether block ``i`` of ``chain`` (key ``key``) would enter the tree with no ssm
        snapshot covering it: no equivalent block under its parent (the chain's orphans
        re-attached first, ``parent_for``), or one whose snapshot covers less."""
        parent = self.parent_for(chain, i, switched)
        existing = self.tree.find_existing(parent, key, tokens)
        return existing == NO_NODE or self.tree.coverage(existing, self.layout.ssm_lc) < len(tokens)

    def insert_block(self, chain: Chain, i: int, tokens: Sequence[Token], key: bytes, switched: dict[int, int],
                     snap: Page | None, defer_prune: bool = False) -> Inserted:
        """SPEC sec. 5, 7: block ``i`` of a request's ``chain`` (full, or its partial tail; key
        ``key``) into the tree, under the block ``i - 1`` of the chain (its orphaned blocks
        re-attached first, ``parent_for``; ``switched`` the ordinals re-attachment switched
        so far): a new block adopting the request's pages, or the existing equivalent one,
        which takes the request's pages where they cover more (and the request the tree's
        gpu page where the tree's covers as much).  ``snap``: a snapshot page of the
        request's live ssm state for the block (None: none).

        ``defer_prune``: more blocks of this commit follow.  A new block without a page
        stays detached, and pruning its parent chain now would only have the next block
        re-attach the whole chain again (quadratic in the blocks of one pure-ssm commit):
        the chain stays attached until the commit's last block, whose insertion prunes (or
        keeps) it exactly as it would have been (DECISIONS.md)."""
        tree, pages, layout = self.tree, self.pages, self.layout
        ntok = len(tokens)
        parent = self.parent_for(chain, i, switched)
        existing = tree.find_existing(parent, key, tokens)
        ssm = layout.ssm_lc
        # shared_write="commit": a full-coverage page of a full block that becomes a tree
        # page here is written to the shared tier (DECISIONS.md "The shared tier")
        store = layout.store_on_commit and ntok == layout.B
        old = chain.blocks[i] if i < len(chain.blocks) else NO_NODE  # (an ordinal it referenced before)
        if existing == NO_NODE:
            nid = tree.new_block(key, tokens, i)
            for lc in layout.attn_lcs:
                row = chain.pages[lc]
                p = row[i] if i < len(row) else None
                if p is not None:
                    if p.node != NO_NODE:
                        # forks: a shared partial page another user's stop_committing put
                        # into a block that was detached since (so not found): it moves here
                        # (DECISIONS.md "Forks", the tail block of a stop)
                        self.unlink_from_node(p)
                    pages.set_coverage(p, ntok)
                    tree.set_page(nid, lc, p.serial, ntok)
                    pages.set_node(p, nid)  # a used page: its state does not change
                    if store:
                        self.outbox.store(p, key)
            if snap is not None:
                tree.set_page(nid, ssm, snap.serial, ntok)
                pages.restate(snap, node=nid)
            self._move_reference(old, nid)
            if tree.nodes[nid].has_page():
                self.attach(parent, nid)
            elif not defer_prune:
                tree.prune_upward(parent)  # a re-attached chain must not stay childless
            return Inserted(nid, switched, [])
        gained: list[int] = []
        replaced: list[tuple[int, Page]] = []
        active = chain.active
        for lc in layout.attn_lcs:
            row = chain.pages[lc]
            p = row[i] if i < len(row) else None
            if p is None:
                continue
            pages.set_coverage(p, ntok)
            q_handle = tree.page(existing, lc)
            if q_handle == NO_PAGE or tree.coverage(existing, lc) < ntok:
                self._install(existing, lc, p, gained)
                if store:
                    self.outbox.store(p, key)
            else:
                q = pages.page(q_handle)
                if q.tier == GPU:  # the request switches to the tree's page; its index changes
                    pages.use(q, active, chain.priority)
                    replaced.append((lc, q))
                    self.release(p, active)
                # else: the request keeps its page privately (freed at close)
        if snap is not None:
            self._install(existing, ssm, snap, gained)
        self._move_reference(old, existing)
        self.announce_stored(existing, gained)
        return Inserted(existing, switched, replaced)

    def _move_reference(self, old: int, new: int) -> None:
        """A request's ordinal now references ``new`` instead of ``old`` (NO_NODE: none):
        ``new`` is referenced first, so a block referenced by both never dies in between."""
        self.tree.ref(new)
        if old != NO_NODE:
            self.tree.unref(old)

    def key_for(self, chain: Chain, i: int, tokens: Sequence[Token], hint: tuple[bytes | None, bytes] | None,
                ) -> bytes:
        """SPEC sec. 3: the key of block ``i`` of ``chain`` holding ``tokens``: the hash
        done at create (``hint``) when it was chained from the same parent key."""
        parent = self.tree.key(chain.blocks[i - 1] if i > 0 else chain.root)
        if hint is not None and (i == 0 or hint[0] == parent):
            return hint[1]
        return block_key(parent, tokens)

    def parent_for(self, chain: Chain, i: int, switched: dict[int, int]) -> int:
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
        for lc in self.layout.attn_lcs:
            row = chain.pages[lc]
            p = row[j] if j < len(row) else None
            if p is None or p.node != orphan or tree.coverage(existing, lc) >= p.coverage:
                continue
            self._install(existing, lc, p, gained)
        tree.ref(existing)
        switched[j] = existing
        tree.unref(orphan)
        self.announce_stored(existing, gained)

    def _install(self, nid: int, lc: int, p: Page, gained: list[int]) -> None:
        """SPEC sec. 5: make ``p`` (a page a request uses, or a new snapshot) the page of block ``nid`` for
        ``lc`` (a slot keeps only the page with the largest coverage).  ``lc`` joins
        ``gained`` (the caller's ``stored``); a replaced page is first announced ``removed``
        (DECISIONS.md "Tree and events")."""
        tree, pages = self.tree, self.pages
        if p.node != NO_NODE:  # moving from an orphan block
            tree.set_page(p.node, lc, NO_PAGE, 0)
        old = tree.set_page(nid, lc, p.serial, p.coverage)
        if p.locks or p.holds:
            pages.set_node(p, nid)  # a used page: its state does not change
        else:
            pages.restate(p, node=nid)  # a new snapshot page: DROPPABLE from now
        if old == NO_PAGE:
            gained.append(lc)
            return
        q = pages.page(old)
        pages.restate(q, node=NO_NODE)
        self.outbox.emit_removed(tree.key(nid), lc)  # a coverage upgrade: removed now, stored by the caller
        gained.append(lc)
        if q.locks == 0 and q.holds == 0:
            pages.free_page(q)

    def attach(self, parent: int, nid: int) -> None:
        """SPEC sec. 5 attach: link block ``nid`` under ``parent`` and announce it: ``removed`` for every lc the
        detached partial siblings had (adopted pages included), then ``stored``."""
        tree, pages = self.tree, self.pages
        siblings = tree.attach(parent, nid)
        node = tree.nodes[nid]
        if not siblings:  # the common case: nothing detached, nothing swapped, only ``stored``
            self.announce_stored(nid, [lc for lc, h in enumerate(node.pages) if h != NO_PAGE])
            return
        had: dict[int, set[int]] = {sid: set() for sid in siblings}
        for sid in siblings:  # page.node still names the owner from before the swap
            for lc, h in enumerate(tree.nodes[sid].pages):
                if h != NO_PAGE and pages.page(h).node == sid:
                    had[sid].add(lc)
        for lc, h in enumerate(node.pages):
            if h != NO_PAGE and pages.page(h).node in had:
                had[pages.page(h).node].add(lc)
        for sid in siblings:
            for lc in sorted(had[sid]):
                self.outbox.emit_removed(tree.nodes[sid].key, lc)
        for lc in range(len(self.layout.lcs)):  # (the page keeps its state: it only changes block)
            if node.pages[lc] != NO_PAGE:
                pages.set_node(pages.page(node.pages[lc]), nid)
            for sid in siblings:
                h = tree.nodes[sid].pages[lc]
                if h != NO_PAGE:
                    pages.set_node(pages.page(h), sid)
        self.retire_nodes(siblings, announce=False)
        self.announce_stored(nid, [lc for lc in range(len(self.layout.lcs)) if node.pages[lc] != NO_PAGE])

    def announce_stored(self, nid: int, lcs: list[int]) -> None:
        """SPEC sec. 9: ``stored`` for block ``nid``, which just gained (or regained) its pages
        of ``lcs`` (none: no event)."""
        if not lcs:
            return
        n = self.tree.nodes[nid]
        rows = []
        for lc in lcs:
            p = self.pages.page(n.pages[lc])
            rows.append((lc, self.layout.tier_ids[p.tier], p.priority, n.coverage[lc]))
        self.outbox.emit_stored(n, rows)

    # ------------------------------------------------------------------ pages leaving blocks (sec. 5, 15)

    def unlink_committed(self, page: Page, on_free: OnFree = None) -> None:
        """Remove ``page`` from its attached block and prune (sec. 5).  The page itself is
        left to the caller (freed, or kept by its users as an orphan page).  ``on_free``:
        called with each page pruning frees (an eviction's write-back)."""
        node, lc = page.node, page.lc
        tree = self.tree
        n = tree.nodes[node]
        key = n.key
        self.unlink_from_node(page)
        self.outbox.emit_removed(key, lc)
        if n.ordinal < self.layout.subtree_below[lc]:
            parent = n.parent
            if tree.is_bare_leaf(node):
                # the usual victim (a leaf holding no other page): what remove_subtree +
                # retire_nodes do to it, without the lists: it leaves the tree and dies
                # (unless a request still references it), nothing to announce
                tree.detach(node)
                tree.collect(node)
            else:
                self.retire_nodes(tree.remove_subtree(node), on_free=on_free)
            if parent is not None:
                tree.prune_upward(parent.id)
        else:
            tree.prune_upward(node)

    def unlink_from_node(self, page: Page) -> None:
        """``page`` leaves its block's slot (no event, no pruning: the callers do those)."""
        node = page.node
        self.pages.restate(page, node=NO_NODE)
        self.tree.clear_page(node, page.lc)  # may delete a dead orphan node

    def retire_nodes(self, node_ids: list[int], announce: bool = True, on_free: OnFree = None) -> None:
        """SPEC sec. 5 pruning: blocks just detached: announce their pages gone, free the pages nobody uses
        (counted as drops; ``on_free`` called with each first); pages with users stay with the orphan."""
        tree, pages = self.tree, self.pages
        for nid in node_ids:
            n = tree.nodes[nid]
            for lc, h in enumerate(n.pages):
                if h == NO_PAGE:
                    continue
                if announce:
                    self.outbox.emit_removed(n.key, lc)
                page = pages.page(h)
                if page.locks == 0 and page.holds == 0:
                    if on_free is not None:
                        on_free(page)
                    self.outbox.count_bytes(lc, "drops", "drop_bytes", self.layout.lcs[lc].slot_bytes)
                    self.free_orphan_page(page)
            tree.collect(nid)

    def free_orphan_page(self, page: Page) -> None:
        """Free a page nobody uses whose block is detached (or about to be forgotten)."""
        self.unlink_from_node(page)
        self.pages.free_page(page)

    def forget_pages(self, lost: list[Page]) -> None:
        """SPEC sec. 15: the ``lost`` pages leave their blocks (sec. 5 pruning, ``removed``
        events); those nobody uses are freed.  Their users roll back (the manager)."""
        for page in lost:
            if not self.pages.page_alive(page):
                continue  # freed with a subtree an earlier unlink removed
            self.outbox.count(page.lc, "lost_pages")
            if page.node != NO_NODE:
                if self.tree.is_attached(page.node):
                    self.unlink_committed(page)
                else:
                    self.unlink_from_node(page)
                if page.locks == 0 and page.holds == 0:
                    self.pages.free_page(page)
