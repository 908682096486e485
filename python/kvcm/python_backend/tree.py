"""The radix tree of committed blocks (SPEC sec. 5) and the match walk (sec. 6).

Nodes are addressed by int ids (creation order, never reused) and pages by int handles
the manager owns, so the C++ port (``kvcm._kvcm_cpp.RadixTree``) has the same surface and
the two can be compared step by step.  The tree knows page *presence and coverage*, not
tiers or states: those belong to the manager.

Node life time: a node exists while it is attached (roots always are), while a request
references it (``ref``/``unref``), or while it still holds a page.  Anything else is
deleted at once, so orphans disappear with their last user.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcm.config import stale_range

NO_PAGE = -1
NO_NODE = -1


class Node:
    """One block of one scope.  Every field is maintained by RadixTree alone."""

    __slots__ = (
        "attached",
        "by_first",
        "children",
        "coverage",
        "id",
        "is_root",
        "key",
        "ordinal",
        "pages",
        "parent",
        "refs",
        "tokens",
    )

    def __init__(self, node_id: int, key: bytes, tokens: tuple, ordinal: int, num_lcs: int, is_root: bool) -> None:
        self.id = node_id  # creation serial; the canonical order of nodes everywhere
        self.key = key  # sha256 chain key (a root's key is its scope key)
        self.parent: Node | None = None  # None when detached (an orphan) or a root
        self.children: dict[bytes, Node] = {}  # only full blocks have children
        # children grouped by first token: partial matching and covering-sibling search
        # only ever look at children that share the first token, so they never scan all.
        self.by_first: dict[object, list[Node]] = {}
        self.tokens = tokens  # B tokens for a full block, fewer for a partial one
        self.ordinal = ordinal  # block index in the sequence; -1 for a root
        self.is_root = is_root
        self.attached = is_root  # reachable from a root
        self.pages = [NO_PAGE] * num_lcs  # page handle per life cycle
        self.coverage = [0] * num_lcs  # tokens of this block the page covers (0 = none)
        self.refs = 0  # live requests referencing this block

    def has_page(self) -> bool:
        return any(p != NO_PAGE for p in self.pages)


class RadixTree:
    """Blocks of all scopes.  ``life_cycles``: ``(kind, window, sinks)`` per lc id, kind in
    {"attn", "ssm"}, window ``None`` for full attention."""

    def __init__(self, tokens_per_block: int, life_cycles: Sequence[tuple[str, int | None, int]]) -> None:
        self.B = tokens_per_block
        self.lcs = [(k, w, s) for k, w, s in life_cycles]
        self.num_lcs = len(self.lcs)
        self.nodes: dict[int, Node] = {}
        self.roots: dict[bytes, Node] = {}
        self.next_id = 0

    # ---------------------------------------------------------------- public API

    def root(self, scope_key: bytes) -> int:
        """The root of a scope, created on first use."""
        node = self.roots.get(scope_key)
        if node is None:
            node = self._new(scope_key, (), -1, is_root=True)
            self.roots[scope_key] = node
        return node.id

    def new_block(self, key: bytes, tokens: Sequence, ordinal: int) -> int:
        """A detached block with no pages and no references (caller refs or attaches it)."""
        return self._new(key, tuple(tokens), ordinal, is_root=False).id

    def find_existing(self, parent: int, key: bytes, tokens: Sequence) -> int:
        """The child of ``parent`` with ``key``, else a covering sibling (a longer child whose
        tokens start with ``tokens``; most tokens first, ties by smaller key), else -1."""
        p = self.nodes[parent]
        hit = p.children.get(key)
        if hit is not None:
            return hit.id
        return self._covering(p, tuple(tokens))

    def attach(self, parent: int, node: int) -> list[int]:
        """Link ``node`` under ``parent``.  Shorter partial siblings whose tokens prefix the
        node's are detached; per lc the node adopts a sibling's page where it has none or
        a smaller coverage (the displaced page swaps into the sibling).  Returns the
        detached siblings in key order; the caller frees their unused pages."""
        p, n = self.nodes[parent], self.nodes[node]
        assert n.parent is None and not n.attached and not n.is_root, "attach: node is linked"
        assert n.key not in p.children, "attach: key already present (use find_existing)"
        detached: list[Node] = []
        if n.tokens:
            for s in sorted(p.by_first.get(n.tokens[0], ()), key=lambda x: x.key):
                if len(s.tokens) < len(n.tokens) and len(s.tokens) < self.B and n.tokens[: len(s.tokens)] == s.tokens:
                    detached.append(s)
        for s in detached:
            self._unlink(s)
            for lc in range(self.num_lcs):
                if s.pages[lc] != NO_PAGE and s.coverage[lc] > n.coverage[lc]:
                    n.pages[lc], s.pages[lc] = s.pages[lc], n.pages[lc]
                    n.coverage[lc], s.coverage[lc] = s.coverage[lc], n.coverage[lc]
        n.parent = p
        n.attached = True
        p.children[n.key] = n
        if n.tokens:
            p.by_first.setdefault(n.tokens[0], []).append(n)
        return [s.id for s in detached]

    def detach(self, node: int) -> None:
        """Unlink ``node`` from its parent (it keeps its children links); the caller frees
        its unused pages and then calls :meth:`collect`."""
        self._unlink(self.nodes[node])

    def remove_subtree(self, node: int) -> list[int]:
        """Detach ``node`` and every descendant (pre-order, children by key); each detached
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
                k.parent = None
                k.attached = False
            n.children.clear()
            n.by_first.clear()
            stack.extend(reversed(kids))
        return out

    def prune_upward(self, node: int) -> list[int]:
        """From ``node`` up: detach while attached, childless and pageless (sec. 5)."""
        out: list[int] = []
        n: Node | None = self.nodes[node]
        while n is not None and n.attached and not n.is_root and not n.children and not n.has_page():
            parent = n.parent
            self._unlink(n)
            out.append(n.id)
            self._maybe_delete(n)  # pageless: nothing for the caller to free first
            n = parent
        return out

    def set_page(self, node: int, lc: int, page: int, coverage: int) -> int:
        """Install ``page`` for ``lc``; returns the page it replaced (or -1)."""
        n = self.nodes[node]
        old = n.pages[lc]
        n.pages[lc] = page
        n.coverage[lc] = coverage
        return old

    def clear_page(self, node: int, lc: int) -> int:
        """Remove the page of ``lc``; returns it (or -1).  May delete a dead orphan."""
        n = self.nodes[node]
        old = n.pages[lc]
        n.pages[lc] = NO_PAGE
        n.coverage[lc] = 0
        self._maybe_delete(n)
        return old

    def ref(self, node: int) -> None:
        self.nodes[node].refs += 1

    def unref(self, node: int) -> None:
        n = self.nodes[node]
        assert n.refs > 0, "unref: not referenced"
        n.refs -= 1
        self._maybe_delete(n)

    def collect(self, node: int) -> None:
        """Delete ``node`` if nothing keeps it (after the caller freed its orphan pages)."""
        n = self.nodes.get(node)
        if n is not None:
            self._maybe_delete(n)

    def match(self, root: int, tokens: Sequence, keys: Sequence[bytes], partial: bool, backoff: int,
              ) -> tuple[int, int, list[int]]:
        """Match ``tokens`` (``keys``: at least the full-block keys) under ``root``.
        Returns ``(m, m_before_ssm, path)`` where ``path`` holds the ``ceil(m / B)``
        matched block ids (sec. 6)."""
        B = self.B
        n_tok = len(tokens)
        node = self.nodes[root]
        path: list[Node] = []
        for i in range(n_tok // B):
            child = node.children.get(keys[i])
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
        m_before_ssm = self._fixed_point(path, m, use_ssm=False)
        m = self._fixed_point(path, m, use_ssm=True)
        return m, m_before_ssm, [x.id for x in path[: -(-m // B)]]

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
        return self.nodes[node].pages[lc]

    def coverage(self, node: int, lc: int) -> int:
        return self.nodes[node].coverage[lc]

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

    def _new(self, key: bytes, tokens: tuple, ordinal: int, is_root: bool) -> Node:
        node = Node(self.next_id, key, tokens, ordinal, self.num_lcs, is_root)
        self.next_id += 1
        self.nodes[node.id] = node
        return node

    def _unlink(self, n: Node) -> None:
        p = n.parent
        if p is not None:
            del p.children[n.key]
            group = p.by_first[n.tokens[0]]
            group.remove(n)
            if not group:
                del p.by_first[n.tokens[0]]
        n.parent = None
        n.attached = False

    def _maybe_delete(self, n: Node) -> None:
        if not n.attached and not n.is_root and n.refs == 0 and not n.has_page() and n.id in self.nodes:
            for k in n.children.values():  # only reachable through a detached, dying node
                k.parent = None
                k.attached = False
                self._maybe_delete(k)
            n.children.clear()
            n.by_first.clear()
            del self.nodes[n.id]

    def _covering(self, p: Node, tokens: tuple) -> int:
        if not tokens or len(tokens) >= self.B:
            return NO_NODE
        best: Node | None = None
        for s in p.by_first.get(tokens[0], ()):
            if (len(s.tokens) > len(tokens) and s.tokens[: len(tokens)] == tokens
                    and (best is None or (len(s.tokens), _neg(s.key)) > (len(best.tokens), _neg(best.key)))):
                best = s
        return best.id if best is not None else NO_NODE

    def _longest_run(self, node: Node, tokens: Sequence, start: int) -> tuple[Node | None, int]:
        best: Node | None = None
        best_run = 0
        for c in node.by_first.get(tokens[start], ()):
            limit = min(len(c.tokens), len(tokens) - start)
            run = 0
            ct = c.tokens
            while run < limit and ct[run] == tokens[start + run]:
                run += 1
            if run > best_run or (run == best_run and best is not None and c.key < best.key):
                best, best_run = c, run
        return best, best_run

    def _fixed_point(self, path: list[Node], m: int, use_ssm: bool) -> int:
        B = self.B
        while True:
            m0 = m
            for lc, (kind, window, sinks) in enumerate(self.lcs):
                if kind == "ssm":
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
                lo, hi = _stale(window, sinks, m, B)
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


def _stale(window: int | None, sinks: int, history: int, B: int) -> tuple[int, int]:
    """Stale block ordinals ``[lo, hi)`` of a windowed lc at ``history`` (sec. 7)."""
    return stale_range(window, sinks, history, B)  # the one formula: kvcm.config


def _neg(key: bytes) -> bytes:
    # "ties by smaller key" inside a max(): invert every byte
    return bytes(255 - b for b in key)


# TREE-READY
