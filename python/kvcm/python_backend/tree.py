"""The radix tree of committed blocks (SPEC sec. 5), the match walk and its pruning (sec. 6).

C++ twin: ``cpp/core/tree.{h,cpp}``.

Nodes are addressed by int ids (creation order, never reused) and pages by int handles
the manager owns, so the C++ port (``kvcm._kvcm_cpp_testing.RadixTree``) has the same surface and
the two can be compared step by step.  The tree knows page *presence and coverage*, not
tiers or states: those belong to the manager.

Node life time: a node exists while it is attached, while a request references it
(``ref``/``unref``), or while it still holds a page.  Anything else is deleted at once, so
orphans disappear with their last user.  A root lives while it has a child or a reference
(the manager refs the root of each open request's scope): an unused scope leaves nothing
behind (SPEC sec. 15).

This is the executable statement of the rules (DECISIONS.md "The Python wing is the
executable specification"): plain objects, each rule in one place.  What stays beyond the
plain data is algorithmic: a parent's children are found by key in a dict, and by tokens
by scanning them while they are few and in a trie (``_Trie``) from ``index_threshold`` on,
as the C++ twin does, so no walk costs more with the number of siblings or blocks.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvcm.config import LifeCycle
from kvcm.matching import fixed_point, rules_of

NO_PAGE = -1
NO_NODE = -1
INDEX_THRESHOLD = 16  # a parent with more children indexes them in a trie (C++: kIndexBuild)


Tokens = Sequence  # a block's tokens as the tree keeps them (``token_seq``)


def token_seq(tokens: Sequence) -> Tokens:
    """A block's (or a query's) tokens as the tree keeps and compares them: ints in an
    ``array("I")``, a tuple when digests are among them.  Not a tuple of ints: an int
    object per token is ten times the memory of the token itself, and a replay of the
    shipped trace ran ~1.9x slower and ~2.7x bigger with it (DECISIONS.md, issue 21).
    Compare two of them with ``_run`` (an array never equals a tuple)."""
    try:
        return array("I", tokens)
    except TypeError:  # a digest (bytes) among them
        return tuple(tokens)


def _lc_error() -> IndexError:
    """A life cycle out of range: the error (and message) of the C++ twin."""
    return IndexError("list index out of range")


class Node:
    """One block of one scope (or a scope's root).  Every field is maintained by RadixTree alone."""

    __slots__ = ("attached", "children", "coverage", "id", "index", "key", "ordinal", "pages", "parent", "refs",
                 "tnext", "tnode", "tokens")

    def __init__(self, node_id: int, key: bytes, tokens: Tokens, ordinal: int, pages: tuple[int, ...],
                 coverage: tuple[int, ...]) -> None:
        self.id = node_id  # creation serial; the canonical order of nodes everywhere
        self.key = key  # the sha256 chain key (a root's: its scope key)
        self.tokens = tokens  # token_seq: B tokens for a full block, fewer for a partial one, none for a root
        self.ordinal = ordinal  # block index in the sequence; -1 for a root
        # reachable from a root (a root: from its creation until the tree detaches it).  A
        # block is attached exactly while it has a parent; the children of a detached block
        # keep their links and their flag until it dies (_maybe_delete) or is removed
        # with them (remove_subtree)
        self.attached = ordinal < 0
        self.parent: Node | None = None  # None when detached (an orphan) or a root
        self.children: dict[bytes, Node] = {}  # by key; only full blocks and roots have any
        # the children with tokens as a trie (partial matching, covering and prefix
        # siblings walk it instead of scanning the siblings); None while they are few
        # (RadixTree.index_threshold)
        self.index: _Trie | None = None
        self.tnode: _Trie | None = None  # where this block sits in its parent's index
        self.tnext: Node | None = None  # the next sibling with the very same tokens (rare)
        # per life cycle: the page handle (NO_PAGE: none) and the tokens of this block that
        # page covers (0: none); rows replaced whole by RadixTree.set_page, never changed
        # in place, so a pageless node can share the tree's ``no_pages`` rows
        self.pages = pages
        self.coverage = coverage
        self.refs = 0  # live requests referencing this block

    @property
    def is_root(self) -> bool:
        return self.ordinal < 0

    def has_page(self) -> bool:
        return self.pages.count(NO_PAGE) != len(self.pages)


class _Trie:
    """A node of a parent's children index: a compressed trie over the children's token
    sequences (SPEC sec. 5 find_existing, sec. 6 step 1).  ``depth`` tokens of prefix, spelled
    by ``rep.tokens[:depth]`` (any child below); ``leaf`` is the child whose tokens end here
    (more of them, linked by ``Node.tnext``, when siblings with different keys share tokens).
    Aggregates over the children below: ``best`` the smallest key, ``cover`` the most tokens
    (ties: smaller key).  Every node but the root has a leaf or two kids, so a parent with
    n children has fewer than 2n trie nodes, and a walk costs O(tokens), not O(siblings)."""

    __slots__ = ("best", "cover", "depth", "kids", "leaf", "rep", "tok", "up")

    def __init__(self, depth: int, rep: Node | None, up: _Trie | None, tok: object) -> None:
        self.depth = depth
        self.rep = rep
        self.up = up  # None for the root
        self.tok = tok  # the first token of the edge from ``up`` (the key in up.kids)
        self.kids: dict[object, _Trie] = {}
        self.leaf: Node | None = None
        self.best: Node | None = None
        self.cover: Node | None = None


def _covers_more(a: Node, b: Node) -> bool:
    """``a`` before ``b`` as a covering sibling: most tokens first, ties by smaller key."""
    return len(a.tokens) > len(b.tokens) or (len(a.tokens) == len(b.tokens) and a.key < b.key)


def _run(a: Tokens, b: Tokens) -> int:
    """The common leading run of two token sequences (``token_seq``)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the whole run at once (the common case; same kinds only)
        return n
    e = 0
    while e < n and a[e] == b[e]:
        e += 1
    return e


def _edge_end(q: Tokens, c: _Trie, d: int) -> int:
    """How far (in depth) ``q`` follows the edge into ``c`` from depth ``d``, whose first
    token is known to match: the first mismatch, or where ``q`` or the edge ends."""
    stop = min(c.depth, len(q))
    ct = c.rep.tokens
    e = d + 1
    if ct[e:stop] == q[e:stop]:  # the whole edge at once (the common case; same kinds only)
        return stop
    while e < stop and ct[e] == q[e]:
        e += 1
    return e


class RadixTree:
    """Blocks of all scopes.  ``life_cycles``: the model's life cycles, by id.
    ``index_threshold``: a parent with more children than this indexes them in a trie, and
    drops it again at half that (the default suits the manager; tests lower it to drive
    the trie hard, on both twins)."""

    def __init__(self, tokens_per_block: int, life_cycles: Sequence[LifeCycle],
                 index_threshold: int = INDEX_THRESHOLD) -> None:
        self.B = tokens_per_block
        self.index_build = index_threshold
        self.index_drop = index_threshold // 2
        self.lcs = list(life_cycles)
        self.num_lcs = len(self.lcs)
        self.rules = rules_of(self.lcs)  # what the sec. 6 fixed point needs of them
        self.no_pages = (NO_PAGE,) * self.num_lcs  # Node.pages and Node.coverage of a pageless node
        self.no_coverage = (0,) * self.num_lcs
        self.nodes: dict[int, Node] = {}
        self.roots: dict[bytes, Node] = {}
        self.next_id = 0

    # ---------------------------------------------------------------- public API

    def root(self, scope_key: bytes) -> int:
        """SPEC sec. 5 / 15: the root of a scope, created on first use (the caller refs it; a root with no
        child and no reference is released by ``unref``, ``prune_upward`` or ``collect``)."""
        node = self.roots.get(scope_key)
        if node is None:
            node = self._new(scope_key, token_seq(()), -1)
            self.roots[scope_key] = node
        return node.id

    def find_root(self, scope_key: bytes) -> int:
        """SPEC sec. 6 / 15: the root of a scope if it exists (a probe allocates nothing)."""
        node = self.roots.get(scope_key)
        return node.id if node is not None else NO_NODE

    def new_block(self, key: bytes, tokens: Sequence, ordinal: int) -> int:
        """A detached block with no pages and no references (caller refs or attaches it)."""
        assert ordinal >= 0, "a root has ordinal -1 (Node.is_root), a block its index"
        return self._new(key, token_seq(tokens), ordinal).id

    def find_existing(self, parent: int, key: bytes, tokens: Sequence) -> int:
        """SPEC sec. 5 find_existing: the child of ``parent`` with ``key``, else a covering sibling (a longer child whose
        tokens start with ``tokens``; most tokens first, ties by smaller key), else -1."""
        p = self.nodes[parent]
        hit = p.children.get(key)
        if hit is not None:
            return hit.id
        if not 0 < len(tokens) < self.B:  # only a partial block has a covering sibling
            return NO_NODE
        return self._covering(p, token_seq(tokens))

    def attach(self, parent: int, node: int) -> list[int]:
        """SPEC sec. 5 attach: link ``node`` under ``parent``.  Shorter partial siblings whose tokens prefix the
        node's are detached; per lc the node adopts a sibling's page where it has none or
        a smaller coverage (the displaced page swaps into the sibling).  Returns the
        detached siblings in key order; the caller frees their unused pages."""
        p, n = self.nodes[parent], self.nodes[node]
        assert n.parent is None and not n.attached and not n.is_root, "attach: node is linked"
        assert n.key not in p.children, "attach: key already present (use find_existing)"
        if not p.children:  # no sibling to detach or swap pages with: the link alone
            self._link(p, n)
            return []
        detached = sorted(self._index_prefixes(p, n), key=lambda x: x.key)
        for s in detached:
            self._unlink(s)
            for lc in range(self.num_lcs):
                if s.pages[lc] != NO_PAGE and s.coverage[lc] > n.coverage[lc]:
                    sp, sc = s.pages[lc], s.coverage[lc]
                    self.set_page(s.id, lc, n.pages[lc], n.coverage[lc])
                    self.set_page(n.id, lc, sp, sc)
        self._link(p, n)
        return [s.id for s in detached]

    def is_bare_leaf(self, node: int) -> bool:
        """No children and no page: ``remove_subtree`` would list it alone, ``retire_nodes``
        free nothing."""
        n = self.nodes[node]
        return not n.children and not n.has_page()

    def detach(self, node: int) -> None:
        """Unlink ``node`` from its parent (it keeps its children links); the caller frees
        its unused pages and then calls :meth:`collect`."""
        self._unlink(self.nodes[node])

    def remove_subtree(self, node: int) -> list[int]:
        """SPEC sec. 5 pruning (full attention, sink blocks): detach ``node`` and every descendant (pre-order, children by key); each detached
        node loses its children links.  Returns the detached ids; the caller frees their
        unused pages and then calls :meth:`collect` on each."""
        out: list[int] = []
        top = self.nodes[node]
        self._unlink(top)
        stack = [top]
        while stack:
            n = stack.pop()
            out.append(n.id)
            kids = sorted(n.children.values(), key=lambda x: x.key)
            for k in kids:
                self._forget_parent(k)
            n.children = {}
            n.index = None
            stack.extend(reversed(kids))
        return out

    def prune_upward(self, node: int) -> list[int]:
        """SPEC sec. 5 pruning: from ``node`` up, detach while attached, childless and pageless."""
        out: list[int] = []
        n: Node | None = self.nodes[node]
        while n is not None and n.attached and not n.is_root and not n.children and not n.has_page():
            parent = n.parent
            self._unlink(n)
            out.append(n.id)
            self._maybe_delete(n)  # pageless: nothing for the caller to free first
            n = parent
        if n is not None and n.is_root:
            self._maybe_delete(n)  # an unused root goes too (not listed: it is no block)
        return out

    def set_page(self, node: int, lc: int, page: int, coverage: int) -> int:
        """Install ``page`` for ``lc``; returns the page it replaced (or -1)."""
        n = self.nodes[node]
        pages, covered = list(n.pages), list(n.coverage)
        try:
            old = pages[lc]
        except IndexError:
            raise _lc_error() from None
        pages[lc], covered[lc] = page, coverage  # (a negative lc counts from the end, as the read)
        n.pages, n.coverage = tuple(pages), tuple(covered)
        return old

    def clear_page(self, node: int, lc: int) -> int:
        """Remove the page of ``lc``; returns it (or -1).  May delete a dead orphan."""
        old = self.set_page(node, lc, NO_PAGE, 0)
        self._maybe_delete(self.nodes[node])
        return old

    def ref(self, node: int) -> None:
        self.nodes[node].refs += 1

    def unref(self, node: int) -> None:
        n = self.nodes[node]
        assert n.refs > 0, "unref: not referenced"
        n.refs -= 1
        if n.refs == 0:
            self._maybe_delete(n)

    def collect(self, node: int) -> None:
        """Delete ``node`` if nothing keeps it (after the caller freed its orphan pages)."""
        n = self.nodes.get(node)
        if n is not None:
            self._maybe_delete(n)

    def match(self, root: int, tokens: Sequence, keys: Sequence[bytes], partial: bool, backoff: int,
              ) -> tuple[int, int, list[int]]:
        """SPEC sec. 6: match ``tokens`` (``keys``: at least the full-block keys) under ``root``.
        Returns ``(m, m_before_ssm, path)`` where ``path`` holds the ``ceil(m / B)``
        matched block ids (sec. 6)."""
        B = self.B
        n_tok = len(tokens)
        node = self.nodes[root]
        path: list[Node] = []
        for i in range(n_tok // B):  # step 1: full blocks by key
            child = node.children.get(keys[i])
            if child is None:
                break
            path.append(child)
            node = child
        m = len(path) * B
        if partial and m < n_tok:  # step 1: the child sharing the longest run of the rest
            best, run = self._longest_run(node, token_seq(tokens[m:m + B]))
            if best is not None:
                path.append(best)
                m += run
        m = max(0, m - backoff)  # step 2
        m_before_ssm = self.prune_match(path, m, use_ssm=False)  # steps 3 and 4
        m = self.prune_match(path, m, use_ssm=True)
        return m, m_before_ssm, [x.id for x in path[: -(-m // B)]]

    def key_path(self, root: int, keys: Sequence[bytes]) -> list[int]:
        """SPEC sec. 6 step 1 without the partial step: the blocks under ``root`` whose keys
        are ``keys[0], keys[1], ...`` (the shared tier's tree path, DECISIONS.md)."""
        node = self.nodes[root]
        out: list[int] = []
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            out.append(child.id)
            node = child
        return out

    def prune_match(self, path: list[Node], m: int, use_ssm: bool) -> int:
        """SPEC sec. 6 step 3 over the blocks ``path``: :func:`kvcm.matching.fixed_point`
        of their coverages.  ``use_ssm`` False gives ``m_before_ssm`` (step 4)."""
        return fixed_point(m, self.B, self.rules, [n.coverage for n in path], use_ssm)

    def prune_extended(self, path: list[int], rows: list[list[int]], m: int, use_ssm: bool = True) -> int:
        """SPEC sec. 6 step 3 over the tree blocks ``path`` followed by blocks not in the
        tree whose coverage per lc is ``rows[k]`` (the shared tier's extension,
        DECISIONS.md).  ``use_ssm`` False gives ``m_before_ssm`` (step 4)."""
        return fixed_point(m, self.B, self.rules, [self.nodes[i].coverage for i in path] + list(rows), use_ssm)

    # ---------------------------------------------------------------- queries

    def parent(self, node: int) -> int:
        p = self.nodes[node].parent
        return p.id if p is not None else NO_NODE

    def is_attached(self, node: int) -> bool:
        return self.nodes[node].attached

    def exists(self, node: int) -> bool:
        return node in self.nodes

    def key(self, node: int) -> bytes:
        return self.nodes[node].key

    def page(self, node: int, lc: int) -> int:
        try:
            return self.nodes[node].pages[lc]
        except IndexError:
            raise _lc_error() from None

    def coverage(self, node: int, lc: int) -> int:
        try:
            return self.nodes[node].coverage[lc]
        except IndexError:
            raise _lc_error() from None

    def dump(self) -> list:
        """Canonical picture: every live node by id."""
        out = []
        for i in sorted(self.nodes):
            n = self.nodes[i]
            out.append([
                n.id, n.key.hex(), n.parent.id if n.parent is not None else NO_NODE, n.attached, n.is_root,
                n.ordinal, [t if isinstance(t, int) else t.hex() for t in n.tokens],
                sorted(c.id for c in n.children.values()), list(n.pages), list(n.coverage), n.refs,
            ])
        return out

    # ---------------------------------------------------------------- helpers

    def _new(self, key: bytes, tokens: Tokens, ordinal: int, pages: tuple[int, ...] | None = None,
             coverage: tuple[int, ...] | None = None) -> Node:
        """A node with the next id; with no pages unless ``pages`` and ``coverage`` are given."""
        if pages is None or coverage is None:
            pages, coverage = self.no_pages, self.no_coverage
        node = Node(self.next_id, key, tokens, ordinal, pages, coverage)
        self.next_id += 1
        self.nodes[node.id] = node
        return node

    def _link(self, p: Node, n: Node) -> None:
        """Make ``n`` a child of ``p`` (and attached with it), in ``p``'s index."""
        n.parent = p
        n.attached = True
        p.children[n.key] = n
        if p.index is not None:
            self._index_add(p, n)
        elif len(p.children) > self.index_build:  # many now: index them all
            for c in p.children.values():
                self._index_add(p, c)

    def _unlink(self, n: Node) -> None:
        """Take ``n`` from its parent (a root: only its flag): it is detached."""
        p = n.parent
        if p is not None:
            del p.children[n.key]
            if p.index is not None:
                if len(p.children) <= self.index_drop:  # few again: scanned
                    self._index_clear(p)
                    n.tnode = n.tnext = None
                else:
                    self._index_remove(p, n)
        n.parent = None
        n.attached = False

    def _index_clear(self, p: Node) -> None:
        """Drop ``p``'s index (its children are scanned from now on)."""
        p.index = None
        for c in p.children.values():
            c.tnode = c.tnext = None

    def _forget_parent(self, k: Node) -> None:
        """``k``'s parent drops all its children at once (it dies, or a subtree goes):
        ``k`` is detached, and its parent's index goes as a whole."""
        k.parent = None
        k.attached = False
        k.tnode = k.tnext = None

    def _release_root_if_unused(self, n: Node) -> None:
        """SPEC sec. 15: no scope is kept forever: a root goes with its last child and its
        last request."""
        if n.refs == 0 and not n.children and not n.has_page() and self.roots.get(n.key) is n:
            del self.roots[n.key]
            del self.nodes[n.id]

    def _maybe_delete(self, n: Node) -> None:
        """Node life time (module docstring): an orphan goes with its last user (sec. 5), an
        unused scope root with its last child and request (sec. 15)."""
        if n.is_root:
            self._release_root_if_unused(n)
            return
        if not n.attached and n.refs == 0 and not n.has_page() and n.id in self.nodes:
            for k in list(n.children.values()):  # only reachable through a detached, dying node
                self._forget_parent(k)
                self._maybe_delete(k)
            n.children = {}
            n.index = None
            del self.nodes[n.id]

    def _covering(self, p: Node, tokens: Tokens) -> int:
        """SPEC sec. 5 find_existing: the covering sibling of a partial block's ``tokens``."""
        if p.index is None:  # few children: the longest that starts with ``tokens``
            best = None
            for c in p.children.values():
                if len(c.tokens) > len(tokens) and _run(c.tokens, tokens) == len(tokens) and (
                        best is None or _covers_more(c, best)):
                    best = c
            return best.id if best is not None else NO_NODE
        at, d = self._walk(p, tokens)
        if at is None or d < len(tokens):
            return NO_NODE
        best = at.cover  # every child below starts with ``tokens``
        return best.id if len(best.tokens) > len(tokens) else NO_NODE

    def _longest_run(self, node: Node, q: Tokens) -> tuple[Node | None, int]:
        """SPEC sec. 6 step 1's partial step: the child of ``node`` sharing the longest
        leading run with ``q`` (ties: the smallest key), and that run; ``(None, 0)`` when
        none shares a token."""
        if node.index is None:  # few children: each one's run
            best, run = None, 0
            for c in node.children.values():
                r = _run(c.tokens, q)
                if r > run or (r == run and r > 0 and c.key < best.key):
                    best, run = c, r
            return best, run
        at, d = self._walk(node, q)  # the children below ``at`` share exactly ``d``
        return (at.best, d) if d > 0 else (None, 0)

    # ---------------------------------------------------------------- children index

    def _walk(self, p: Node, q: Tokens) -> tuple[_Trie | None, int]:
        """Follow ``q`` down ``p``'s index: ``(at, d)`` where the children below ``at`` are
        exactly those whose common leading run with ``q`` is ``d``."""
        v = p.index
        if v is None:
            return None, 0
        d = 0
        while d < len(q):
            c = v.kids.get(q[d])
            if c is None:
                break
            e = _edge_end(q, c, d)
            if e < c.depth:
                return c, e
            v, d = c, e
        return v, d

    def _index_add(self, p: Node, n: Node) -> None:
        """Put child ``n`` (already in ``p.children``) into ``p``'s trie (SPEC sec. 15: a
        match does not scan siblings).  A child without tokens has no place in it."""
        t = n.tokens
        if not t:
            return
        if p.index is None:
            p.index = _Trie(0, None, None, None)
        v = p.index
        while True:
            if v.depth == len(t):
                n.tnext = v.leaf
                v.leaf = n
                n.tnode = v
                break
            tok = t[v.depth]
            c = v.kids.get(tok)
            if c is None:
                leaf = _Trie(len(t), n, v, tok)
                leaf.leaf = n
                n.tnext = None
                v.kids[tok] = leaf
                n.tnode = leaf
                break
            e = _edge_end(t, c, v.depth)
            if e == c.depth:
                v = c
                continue
            mid = _Trie(e, c.rep, v, tok)  # split the edge where ``t`` leaves it
            ct = c.rep.tokens[e]
            mid.kids = {ct: c}
            mid.best, mid.cover = c.best, c.cover
            c.up, c.tok = mid, ct
            v.kids[tok] = mid
            v = mid
        x = n.tnode
        while x is not None:
            if x.best is None or n.key < x.best.key:
                x.best = n
            if x.cover is None or _covers_more(n, x.cover):
                x.cover = n
            x = x.up

    def _index_remove(self, p: Node, n: Node) -> None:
        """Take child ``n`` out of ``p``'s trie, merging and re-labelling what it named."""
        v = n.tnode
        if v is None:  # (a child without tokens is in no index)
            return
        n.tnode = None
        if v.leaf is n:
            v.leaf = n.tnext
        else:
            x = v.leaf
            while x.tnext is not n:
                x = x.tnext
            x.tnext = n.tnext
        n.tnext = None
        if v.leaf is None and not v.kids and v.up is not None:  # a bare leaf: drop it
            up = v.up
            del up.kids[v.tok]
            v = up
        if v.up is not None and v.leaf is None and len(v.kids) == 1:  # one kid left: merge
            (only,) = v.kids.values()
            only.up, only.tok = v.up, v.tok
            v.up.kids[v.tok] = only
            v = v.up
        if v.up is None and not v.kids and v.leaf is None:  # the last indexed child went
            p.index = None
            return
        while v is not None:  # aggregates and labels that named ``n``
            if v.best is n or v.cover is n:
                best = cover = v.leaf
                x = v.leaf.tnext if v.leaf is not None else None
                while x is not None:
                    if x.key < best.key:
                        best = x
                    if _covers_more(x, cover):
                        cover = x
                    x = x.tnext
                for k in v.kids.values():
                    if best is None or k.best.key < best.key:
                        best = k.best
                    if cover is None or _covers_more(k.cover, cover):
                        cover = k.cover
                v.best, v.cover = best, cover
            if v.rep is n:
                v.rep = v.best
            v = v.up

    def _index_prefixes(self, p: Node, n: Node) -> list[Node]:
        """SPEC sec. 5 attach: partial children whose tokens are a proper prefix of ``n``'s."""
        out: list[Node] = []
        t = n.tokens
        v = p.index
        if v is None:  # few children: each one's tokens
            return [c for c in p.children.values() if 0 < len(c.tokens) < len(t) and _run(c.tokens, t) == len(c.tokens)]
        if not t:
            return out
        while True:
            if v.depth < len(t) and v.depth < self.B:
                x = v.leaf
                while x is not None:
                    out.append(x)
                    x = x.tnext
            if v.depth >= len(t):
                return out
            c = v.kids.get(t[v.depth])
            if c is None or _edge_end(t, c, v.depth) < c.depth:
                return out
            v = c

    def index_leaves(self, node: int) -> list[int]:
        """The children the index of ``node`` holds, sorted (invariant checks)."""
        out: list[int] = []
        n = self.nodes[node]
        if n.index is None:  # (the walks scan the children themselves)
            return sorted(c.id for c in n.children.values() if c.tokens)
        stack = [n.index]
        while stack:
            v = stack.pop()
            x = v.leaf
            while x is not None:
                out.append(x.id)
                x = x.tnext
            stack.extend(v.kids.values())
        return sorted(out)

