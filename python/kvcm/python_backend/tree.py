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
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

from kvcm.config import LifeCycle

NO_PAGE = -1
NO_NODE = -1


KEY_BYTES = 32  # a key is a sha256 digest (a root's: its scope key)


def compact_tokens(tokens: Sequence) -> bytes | tuple:
    """Tokens as a node keeps them (after its key in ``Node.record``): 4-byte little-endian
    ints (the bytes its key hashes; no object per token, nothing the cyclic GC walks) when
    all are ints, a tuple when digests are among them."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        return tuple(tokens)


def make_record(key: bytes, packed: bytes | tuple) -> bytes | tuple:
    """``Node.record`` of a block: its key, then its ``compact_tokens``: one bytes object
    (a tuple ``(key, *tokens)`` when digests are among the tokens)."""
    assert len(key) == KEY_BYTES, "a key is a sha256 digest"
    return key + packed if type(packed) is bytes else (key, *packed)


def record_key(record: bytes | tuple) -> bytes:
    """The key of a ``Node.record``."""
    return record[:KEY_BYTES] if type(record) is bytes else record[0]


def record_tokens(record: bytes | tuple) -> tuple:
    """The token tuple of a ``Node.record``."""
    if type(record) is bytes:
        return struct.unpack_from(f"<{(len(record) - KEY_BYTES) // 4}I", record, KEY_BYTES)
    return record[1:]


def child_of(n: Node, key: bytes) -> Node | None:
    """The child of ``n`` with ``key`` (``Node.children`` in any of its three forms)."""
    c = n.children
    if c is None:
        return None
    if type(c) is Node:
        return c if c.has_key(key) else None
    return c.get(key)


def children_of(n: Node) -> list[Node]:
    """The children of ``n``, in no particular order."""
    c = n.children
    if c is None:
        return []
    if type(c) is Node:
        return [c]
    return list(c.values())


def _add_child(p: Node, n: Node) -> None:
    c = p.children
    if c is None:
        p.children = n
    elif type(c) is Node:
        p.children = {c.key: c, n.key: n}
    else:
        c[n.key] = n


def _remove_child(p: Node, n: Node) -> None:
    c = p.children
    if type(c) is Node:
        p.children = None
        return
    del c[n.key]
    if len(c) == 1:  # back to the one-child form
        (p.children,) = c.values()


def _lc_error() -> IndexError:
    """A life cycle out of range: the error (and message) of the C++ twin."""
    return IndexError("list index out of range")


def _equal(a: Sequence, b: Sequence) -> bool:
    """Token runs equal (an array and a list or tuple compare by their values)."""
    if type(a) is not type(b):
        a, b = list(a), list(b)
    return a == b


class Node:
    """One block of one scope.  Every field is maintained by RadixTree alone."""

    __slots__ = (
        "children",
        "coverage",
        "id",
        "links",
        "ordinal",
        "pages",
        "parent",
        "record",
        "refs",
    )

    def __init__(self, node_id: int, record: bytes | tuple, ordinal: int, pages: int | tuple,
                 coverage: tuple) -> None:
        self.id = node_id  # creation serial; the canonical order of nodes everywhere
        # the sha256 chain key (a root's: its scope key) and the block's tokens (B for a full
        # block, fewer for a partial one) in one object (make_record): one object header and
        # one slot less per block than a key and a token buffer apart; ``key`` and
        # ``tokens`` read it
        self.record = record
        # None when detached (an orphan) or a root.  A block is attached (reachable from a
        # root) exactly while it has a parent: every link and unlink sets both, so
        # ``attached`` is derived (a slot less per block) but for a root (_Root)
        self.parent: Node | None = None
        # only full blocks have children.  None (a leaf), the Node itself when there is one
        # (a chain, the common case), a dict by key from two on: no dict object per block
        # (see child_of / children_of)
        self.children: Node | dict[bytes, Node] | None = None
        # the children's tokens as a compressed trie: partial matching, covering siblings
        # and prefix siblings walk it instead of scanning siblings.  None while the node
        # has at most one child (a chain, the common case): that child is compared directly
        # (RadixTree._only_child), which saves three objects per block
        # ``index``, ``tnode`` and ``tnext`` (below) live in one _Links object made only
        # while one of them is set: a chain block has none, and saves two slots
        self.links: _Links | None = None
        self.ordinal = ordinal  # block index in the sequence; -1 for a root (is_root)
        # the page handle per life cycle: a tuple of ints replaced by ``put`` (the GC stops
        # tracking it; a node that never had a page shares the tree's all-empty one), but
        # the bare handle when the model has one life cycle (the common one): no 1-tuple
        # (48 bytes) per block.  Read it through page_of / handles
        self.pages = pages
        self.coverage = coverage  # tokens of this block the page covers (0 = none), per lc
        self.refs = 0  # live requests referencing this block

    @property
    def index(self) -> _Trie | None:
        """The children index (a trie; None while at most one child)."""
        x = self.links
        return None if x is None else x.index

    @index.setter
    def index(self, v: _Trie | None) -> None:
        self._set_link("index", v)

    @property
    def tnode(self) -> _Trie | None:
        """Where this block sits in its parent's index."""
        x = self.links
        return None if x is None else x.tnode

    @tnode.setter
    def tnode(self, v: _Trie | None) -> None:
        self._set_link("tnode", v)

    @property
    def tnext(self) -> Node | None:
        """The next sibling with the very same tokens (rare)."""
        x = self.links
        return None if x is None else x.tnext

    @tnext.setter
    def tnext(self, v: Node | None) -> None:
        self._set_link("tnext", v)

    def _set_link(self, name: str, v: object) -> None:
        x = self.links
        if x is None:
            if v is None:
                return
            x = self.links = _Links()
        setattr(x, name, v)
        if x.index is None and x.tnode is None and x.tnext is None:
            self.links = None

    # key, ntok and is_root are derived, not stored: slots (8 bytes each) less per block
    @property
    def key(self) -> bytes:
        r = self.record
        return r[:KEY_BYTES] if type(r) is bytes else r[0]  # record_key

    def has_key(self, key: bytes) -> bool:
        """``self.key == key`` without building the key (the match walk's test)."""
        r = self.record
        return r.startswith(key) and len(key) == KEY_BYTES if type(r) is bytes else r[0] == key

    @property
    def attached(self) -> bool:
        return self.parent is not None

    @property
    def ntok(self) -> int:
        r = self.record
        return (len(r) - KEY_BYTES) // 4 if type(r) is bytes else len(r) - 1

    @property
    def is_root(self) -> bool:
        return self.ordinal < 0

    @property
    def tokens(self) -> Sequence:
        """The block's tokens (ints, or a tuple with digests), decoded from ``record``."""
        r = self.record
        if type(r) is not bytes:
            return r[1:]
        out = array("I", r[KEY_BYTES:])
        if sys.byteorder == "big":
            out.byteswap()
        return out

    def page_of(self, lc: int) -> int:
        """Life cycle ``lc``'s page handle (IndexError for an lc out of range)."""
        p = self.pages
        if type(p) is tuple:
            return p[lc]
        if lc != 0 and lc != -1:  # one life cycle: as a 1-tuple would
            raise IndexError("tuple index out of range")
        return p

    def handles(self) -> tuple:
        """The page handle per life cycle."""
        p = self.pages
        return p if type(p) is tuple else (p,)

    def put(self, lc: int, page: int, coverage: int) -> None:
        """Life cycle ``lc``'s page handle and coverage (the tuples are rebuilt)."""
        p, c = self.pages, self.coverage
        if type(p) is not tuple:  # one life cycle: the bare handle
            if lc != 0 and lc != -1:
                self.page_of(lc)  # (raises as a 1-tuple would)
            self.pages = page
            cov: tuple = (coverage,)
        else:
            if lc < 0:
                lc += len(p)
            self.pages = (*p[:lc], page, *p[lc + 1:])
            cov = (*c[:lc], coverage, *c[lc + 1:])
        self.coverage = _shared_coverage(cov)

    def has_page(self) -> bool:
        p = self.pages
        return any(h != NO_PAGE for h in p) if type(p) is tuple else p != NO_PAGE


class _Root(Node):
    """A scope's root (ordinal -1): attached from its creation until it is detached (only
    the tree's own ``detach`` does that), a flag of its own as it never has a parent."""

    __slots__ = ("root_attached",)

    def __init__(self, node_id: int, record: bytes | tuple, ordinal: int, pages: int | tuple,
                 coverage: tuple) -> None:
        super().__init__(node_id, record, ordinal, pages, coverage)
        self.root_attached = True

    @property
    def attached(self) -> bool:
        return self.root_attached


class _Links:
    """A node's rarely set trie links (Node.index, Node.tnode, Node.tnext)."""

    __slots__ = ("index", "tnext", "tnode")

    def __init__(self) -> None:
        self.index: _Trie | None = None
        self.tnode: _Trie | None = None
        self.tnext: Node | None = None


_COVERAGES: dict[tuple, tuple] = {}  # Node.coverage's shared tuples (bounded)
_MAX_COVERAGES = 4096


def _shared_coverage(cov: tuple) -> tuple:
    """Few coverage tuples exist (full blocks all have the same): one object each."""
    return _COVERAGES.setdefault(cov, cov) if len(_COVERAGES) < _MAX_COVERAGES else cov


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
        self.kids: dict[object, _Trie] | None = None
        self.leaf: Node | None = None
        self.best: Node | None = None
        self.cover: Node | None = None


class _Extension:
    """A block of the shared tier's extension as :meth:`RadixTree.prune_match` reads one:
    its coverage per life cycle."""

    __slots__ = ("coverage",)

    def __init__(self, coverage: list[int]) -> None:
        self.coverage = coverage


def _covers_more(a: Node, b: Node) -> bool:
    """``a`` before ``b`` as a covering sibling: most tokens first, ties by smaller key."""
    return a.ntok > b.ntok or (a.ntok == b.ntok and a.key < b.key)


def _edge_end(q: Sequence, qstart: int, c: _Trie, d: int) -> int:
    """How far (in depth) ``q[qstart:]`` follows the edge into ``c`` from depth ``d``, whose
    first token is known to match: the first mismatch, or where ``q`` or the edge ends."""
    stop = min(c.depth, len(q) - qstart)
    ct = c.rep.tokens
    e = d + 1
    if _equal(ct[e:stop], q[qstart + e:qstart + stop]):
        return stop
    while e < stop and ct[e] == q[qstart + e]:
        e += 1
    return e


def _run(ct: Sequence, q: Sequence, start: int) -> int:
    """The common leading run of ``ct`` and ``q[start:]``."""
    stop = min(len(ct), len(q) - start)
    if _equal(ct[:stop], q[start:start + stop]):
        return stop
    e = 0
    while ct[e] == q[start + e]:
        e += 1
    return e


class RadixTree:
    """Blocks of all scopes.  ``life_cycles``: the model's life cycles, by id."""

    def __init__(self, tokens_per_block: int, life_cycles: Sequence[LifeCycle]) -> None:
        self.B = tokens_per_block
        self.lcs = list(life_cycles)
        self.num_lcs = len(self.lcs)
        self.nodes: dict[int, Node] = {}
        self.roots: dict[bytes, Node] = {}
        self._no_pages = (NO_PAGE,) * self.num_lcs if self.num_lcs != 1 else NO_PAGE  # Node.pages
        self._no_coverage = (0,) * self.num_lcs
        self.next_id = 0

    # ---------------------------------------------------------------- public API

    def root(self, scope_key: bytes) -> int:
        """SPEC sec. 5 / 15: the root of a scope, created on first use (the caller refs it; a root with no
        child and no reference is released by ``unref``, ``prune_upward`` or ``collect``)."""
        node = self.roots.get(scope_key)
        if node is None:
            node = self._new(make_record(scope_key, compact_tokens(())), -1, is_root=True)
            self.roots[scope_key] = node
        return node.id

    def find_root(self, scope_key: bytes) -> int:
        """SPEC sec. 6 / 15: the root of a scope if it exists (a probe allocates nothing)."""
        node = self.roots.get(scope_key)
        return node.id if node is not None else NO_NODE

    def new_block(self, key: bytes, tokens: Sequence, ordinal: int) -> int:
        """A detached block with no pages and no references (caller refs or attaches it)."""
        return self._new(make_record(key, compact_tokens(tokens)), ordinal, is_root=False).id

    def extend(self, p: Node, record: bytes | tuple, ordinal: int, pages: int | tuple, coverage: tuple) -> Node:
        """``new_block`` (of ``make_record``'s ``record``) + ``set_page`` of every lc (the
        handles ``pages``, as ``Node.pages`` keeps them, and their ``coverage``) + ``attach``
        under a block ``p`` without children (a chain grows at its end): attach's trivial
        case, no sibling to detach and no index to update.  Python's commit fast path
        (``PyKVCache._extend_chain``), so it takes and returns nodes, not ids."""
        assert not p.children and p.attached, "extend: parent has children or is detached"
        n = Node(self.next_id, record, ordinal, pages, _shared_coverage(coverage))  # _new
        self.next_id += 1
        self.nodes[n.id] = n
        n.parent = p
        p.children = n
        return n

    def find_existing(self, parent: int, key: bytes, tokens: Sequence) -> int:
        """SPEC sec. 5 find_existing: the child of ``parent`` with ``key``, else a covering sibling (a longer child whose
        tokens start with ``tokens``; most tokens first, ties by smaller key), else -1."""
        p = self.nodes[parent]
        hit = child_of(p, key)
        if hit is not None:
            return hit.id
        if not tokens or len(tokens) >= self.B:  # only a partial block has a covering sibling
            return NO_NODE
        return self._covering(p, tuple(tokens))

    def attach(self, parent: int, node: int) -> list[int]:
        """SPEC sec. 5 attach: link ``node`` under ``parent``.  Shorter partial siblings whose tokens prefix the
        node's are detached; per lc the node adopts a sibling's page where it has none or
        a smaller coverage (the displaced page swaps into the sibling).  Returns the
        detached siblings in key order; the caller frees their unused pages."""
        p, n = self.nodes[parent], self.nodes[node]
        assert n.parent is None and not n.attached and not n.is_root, "attach: node is linked"
        assert child_of(p, n.key) is None, "attach: key already present (use find_existing)"
        detached = sorted(self._index_prefixes(p, n), key=lambda x: x.key)
        for s in detached:
            self._unlink(s)
            for lc in range(self.num_lcs):
                if s.page_of(lc) != NO_PAGE and s.coverage[lc] > n.coverage[lc]:
                    sp, sc = s.page_of(lc), s.coverage[lc]
                    s.put(lc, n.page_of(lc), n.coverage[lc])
                    n.put(lc, sp, sc)
        n.parent = p
        _add_child(p, n)
        self._index_add(p, n)
        return [s.id for s in detached]

    def is_bare_leaf(self, node: int) -> bool:
        """No children and no page: ``remove_subtree`` would list it alone, ``retire_nodes``
        free nothing."""
        n = self.nodes[node]
        return n.children is None and not n.has_page()

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
            if n.children is None:  # a leaf (most are): nothing below, no index
                continue
            kids = sorted(children_of(n), key=lambda x: x.key)
            for k in kids:
                k.parent = None  # (detached: Node.attached)
                k.tnode = k.tnext = None
            n.children = None
            n.index = None
            stack.extend(reversed(kids))
        return out

    def prune_upward(self, node: int) -> list[int]:
        """SPEC sec. 5 pruning: from ``node`` up, detach while attached, childless and pageless."""
        out: list[int] = []
        n: Node | None = self.nodes[node]
        # (a block is attached while it has a parent, Node.attached; a root has none)
        while n is not None and n.parent is not None and not n.children and not n.has_page():
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
        try:
            old = n.page_of(lc)
        except IndexError:
            raise _lc_error() from None
        n.put(lc, page, coverage)
        return old

    def clear_page(self, node: int, lc: int) -> int:
        """Remove the page of ``lc``; returns it (or -1).  May delete a dead orphan."""
        n = self.nodes[node]
        try:
            old = n.page_of(lc)
        except IndexError:
            raise _lc_error() from None
        n.put(lc, NO_PAGE, 0)
        self._maybe_delete(n)
        return old

    def ref(self, node: int) -> None:
        self.nodes[node].refs += 1

    def unref(self, node: int) -> None:
        n = self.nodes[node]
        assert n.refs > 0, "unref: not referenced"
        n.refs -= 1
        # a root, or a detached block (no parent: Node.attached); else _maybe_delete keeps it
        if not n.refs and (n.ordinal < 0 or n.parent is None):
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
        for i in range(n_tok // B):
            child = child_of(node, keys[i])
            if child is None:
                break
            path.append(child)
            node = child
        m = len(path) * B
        if partial and m < n_tok:
            best, run = self._longest_run(node, tokens, m)
            if best is not None:
                path.append(best)
                m += run
        m = max(0, m - backoff)
        m_before_ssm = self.prune_match(path, m, use_ssm=False)
        m = self.prune_match(path, m, use_ssm=True)
        return m, m_before_ssm, [x.id for x in path[: -(-m // B)]]

    def key_path(self, root: int, keys: Sequence[bytes]) -> list[int]:
        """SPEC sec. 6 step 1 without the partial step: the blocks under ``root`` whose keys
        are ``keys[0], keys[1], ...`` (the shared tier's tree path, DECISIONS.md)."""
        node = self.nodes[root]
        out: list[int] = []
        for key in keys:
            child = child_of(node, key)
            if child is None:
                break
            out.append(child.id)
            node = child
        return out

    def prune_extended(self, path: list[int], rows: list[list[int]], m: int) -> int:
        """SPEC sec. 6 step 3 (the ssm rule included) over the tree blocks ``path`` followed
        by blocks not in the tree whose coverage per lc is ``rows[k]`` (the shared tier's
        extension, DECISIONS.md)."""
        return self.prune_match([self.nodes[i] for i in path] + [_Extension(row) for row in rows], m, use_ssm=True)

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
            return self.nodes[node].page_of(lc)
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
                sorted(c.id for c in children_of(n)), list(n.handles()), list(n.coverage), n.refs,
            ])
        return out

    # ---------------------------------------------------------------- helpers

    def _new(self, record: bytes | tuple, ordinal: int, is_root: bool) -> Node:
        assert (ordinal < 0) == is_root, "a root has ordinal -1 (Node.is_root), a block its index"
        node = (_Root if is_root else Node)(self.next_id, record, ordinal, self._no_pages, self._no_coverage)
        self.next_id += 1
        self.nodes[node.id] = node
        return node

    def _unlink(self, n: Node) -> None:
        p = n.parent
        if p is not None:
            _remove_child(p, n)
            if n.links is not None:  # (else it is in no index: Node.tnode)
                self._index_remove(p, n)
        n.parent = None  # (detached: Node.attached)
        if n.ordinal < 0:  # is_root
            n.root_attached = False

    def _release_root_if_unused(self, n: Node) -> None:
        """SPEC sec. 15: no scope is kept forever: a root goes with its last child and its
        last request."""
        if n.refs == 0 and not n.children and not n.has_page() and self.roots.get(n.key) is n:
            del self.roots[n.key]
            del self.nodes[n.id]

    def _maybe_delete(self, n: Node) -> None:
        """Node life time (module docstring): an orphan goes with its last user (sec. 5), an
        unused scope root with its last child and request (sec. 15)."""
        if n.ordinal < 0:  # is_root
            self._release_root_if_unused(n)
            return
        # (a block is detached exactly while it has no parent: Node.attached)
        if n.parent is None and n.refs == 0 and not n.has_page() and n.id in self.nodes:
            if n.children is not None:
                for k in children_of(n):  # only reachable through a detached, dying node
                    k.parent = None  # (detached: Node.attached)
                    k.tnode = k.tnext = None
                    self._maybe_delete(k)
                n.children = None
                n.index = None
            del self.nodes[n.id]

    def _covering(self, p: Node, tokens: tuple) -> int:
        """SPEC sec. 5 find_existing: the covering sibling of a partial block's ``tokens``."""
        if not tokens or len(tokens) >= self.B:
            return NO_NODE
        if p.index is None:
            c = self._only_child(p)
            if c is None or c.ntok <= len(tokens) or _run(c.tokens, tokens, 0) < len(tokens):
                return NO_NODE
            return c.id
        at, d = self._walk(p, tokens, 0)
        if d < len(tokens):
            return NO_NODE
        best = at.cover  # every child below starts with ``tokens``
        return best.id if best.ntok > len(tokens) else NO_NODE

    def _longest_run(self, node: Node, tokens: Sequence, start: int) -> tuple[Node | None, int]:
        # the children below ``at`` are exactly those sharing the longest run ``d``
        if node.index is None:
            c = self._only_child(node)
            d = _run(c.tokens, tokens, start) if c is not None else 0
            return (c, d) if d > 0 else (None, 0)
        at, d = self._walk(node, tokens, start)
        return (at.best, d) if d > 0 else (None, 0)

    # ---------------------------------------------------------------- children index

    def _walk(self, p: Node, q: Sequence, start: int) -> tuple[_Trie | None, int]:
        """Follow ``q[start:]`` down ``p``'s index: ``(at, d)`` where the children below
        ``at`` are exactly those whose common leading run with ``q[start:]`` is ``d``."""
        v = p.index
        if v is None:
            return None, 0
        d = 0
        n = len(q) - start
        while d < n:
            c = v.kids.get(q[start + d]) if v.kids else None
            if c is None:
                break
            e = _edge_end(q, start, c, d)
            if e < c.depth:
                return c, e
            v, d = c, e
        return v, d

    def _only_child(self, p: Node) -> Node | None:
        """The child of ``p`` while ``p`` has no index (it has at most one)."""
        c = p.children
        return c if type(c) is Node else None

    def _index_add(self, p: Node, n: Node) -> None:
        """Put child ``n`` (already in ``p.children``) into ``p``'s trie (SPEC sec. 15: a
        match does not scan siblings); the trie is built when a second child arrives."""
        if p.index is None:
            if type(p.children) is not dict:  # (the one child, or none)
                return
            for c in p.children.values():
                if c is not n:
                    self._index_insert(p, c)
        self._index_insert(p, n)

    def _index_insert(self, p: Node, n: Node) -> None:
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
            c = v.kids.get(tok) if v.kids else None
            if c is None:
                leaf = _Trie(len(t), n, v, tok)
                leaf.leaf = n
                n.tnext = None
                if v.kids is None:
                    v.kids = {}
                v.kids[tok] = leaf
                n.tnode = leaf
                break
            e = _edge_end(t, 0, c, v.depth)
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
        if v is None:
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
        if v.up is None and not v.kids and v.leaf is None:
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
                for k in v.kids.values() if v.kids else ():
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
        if v is None:
            c = self._only_child(p)
            if c is not None and c.ntok < len(t) and _run(c.tokens, t, 0) == c.ntok:
                out.append(c)  # shorter than a block, as it is shorter than ``t``
            return out
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
            c = v.kids.get(t[v.depth]) if v.kids else None
            if c is None or _edge_end(t, 0, c, v.depth) < c.depth:
                return out
            v = c

    def index_leaves(self, node: int) -> list[int]:
        """The children the index of ``node`` holds, sorted (invariant checks)."""
        out: list[int] = []
        n = self.nodes[node]
        if n.index is None:
            return sorted(c.id for c in children_of(n) if c.ntok)
        stack = [n.index]
        while stack:
            v = stack.pop()
            x = v.leaf
            while x is not None:
                out.append(x.id)
                x = x.tnext
            stack.extend(v.kids.values() if v.kids else ())
        return sorted(out)

    def prune_match(self, path: list[Node], m: int, use_ssm: bool) -> int:
        """SPEC sec. 6 step 3: shorten the match length ``m`` along ``path`` to a fixed point.
        ssm: the match ends exactly at a snapshot; attention: every non-stale block below
        ``m`` needs a page covering its matched tokens.  ``use_ssm`` False gives
        ``m_before_ssm`` (step 4)."""
        B = self.B
        while True:
            m0 = m
            for lc, life in enumerate(self.lcs):
                if life.kind == "ssm":
                    if not use_ssm:
                        continue
                    cut = 0
                    for j in range(-(-m // B) - 1, -1, -1):
                        c = path[j].coverage[lc]
                        if 0 < c and j * B + c <= m:
                            cut = j * B + c
                            break
                    m = cut
                    continue
                lo, hi = life.stale_range(m, B)
                for j in range(-(-m // B)):
                    if lo <= j < hi:
                        continue
                    need = min(B, m - j * B)
                    cov = path[j].coverage[lc]
                    if cov < need:
                        m = j * B + cov
                        break
            if m == m0:
                return m


# TREE-READY
