"""Differential test: the python RadixTree (reference) and its C++ port in lockstep.

A Hypothesis state machine applies the same random operation to both trees, including
bad and edge operations (unknown node ids, an lc out of range, attaching a linked node,
a duplicate key, unref below zero, too few keys for a match), and after every step
compares the return value or the raised error (type and message) and the canonical
``dump()`` of both trees.  A divergence prints the shortest op sequence that shows it.

Inputs stay in the domain the manager uses: keys are 32 bytes, a block has 1..B tokens
(ints or 32-byte digests), coverage is in 0..B and lc is never negative (tree.py would
index from the end; the C++ tree raises IndexError).
"""

from __future__ import annotations

import hashlib

import pytest

_kvcm_cpp_testing = pytest.importorskip("kvcm._kvcm_cpp_testing")
tree_mod = pytest.importorskip("kvcm.python_backend.tree")

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvcm.config import LifeCycle

PyTree = tree_mod.RadixTree
CppTree = _kvcm_cpp_testing.RadixTree

KEYS = [hashlib.sha256(bytes([i])).digest() for i in range(6)]
SCOPE_KEYS = [hashlib.sha256(b"scope" + bytes([i])).digest() for i in range(2)]
DIGESTS = [hashlib.sha256(b"digest" + bytes([i])).digest() for i in range(2)]
# Few distinct tokens so that prefixes, covering siblings and partial runs collide often.
TOKEN = st.one_of(st.integers(0, 2), st.sampled_from(DIGESTS))

PRESETS = [
    [("attn", None, 0)],
    [("ssm", None, 0)],
    [("attn", None, 0), ("ssm", None, 0)],
    [("attn", 3, 2), ("ssm", None, 0)],
    [("attn", None, 0), ("attn", 5, 0), ("ssm", None, 0)],
    [("attn", 2, 0)],
]


def _life_cycles(preset):
    """The python tree takes the life-cycle type; the C++ binding its (kind, window, sinks)."""
    return [LifeCycle(i, k, w, s, 0, ()) for i, (k, w, s) in enumerate(preset)]


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except (KeyError, IndexError, AssertionError) as e:
        return ("raise", type(e).__name__, repr(e.args))


class TreeLockstep(RuleBasedStateMachine):
    # index_threshold: both trees scan up to that many children and index more in a trie;
    # 0 and 2 drive the tries through building, growing, shrinking and dropping them with
    # the few keys drawn here.
    @initialize(B=st.integers(1, 4), preset=st.sampled_from(PRESETS), index_threshold=st.sampled_from([0, 2, 16]))
    def setup(self, B, preset, index_threshold):
        self.B = B
        self.lcs = preset
        self.py = PyTree(B, _life_cycles(preset), index_threshold)
        self.cc = CppTree(B, preset, index_threshold)
        self.next_page = 100
        root = self.both("root", SCOPE_KEYS[0])[1]
        self.both("ref", root)  # as the manager refs the root of an open request's scope

    # ---------------------------------------------------------------- helpers

    def both(self, name, *args):
        a = _outcome(getattr(self.py, name), *args)
        b = _outcome(getattr(self.cc, name), *args)
        if name == "match" and a[0] == "ok" and b[0] == "ok":
            a = ("ok", tuple(a[1][:2]) + (list(a[1][2]),))
            b = ("ok", tuple(b[1][:2]) + (list(b[1][2]),))
        assert a == b, f"{name}{args}: python {a!r} != cpp {b!r}"
        return a

    def node(self, data):
        """Mostly a live node (attached ones first, so trees grow deep), sometimes an unknown id."""
        live = sorted(self.py.nodes)
        attached = [i for i in live if self.py.nodes[i].attached]
        unknown = st.integers(-1, self.py.next_id + 1)
        choices = [unknown]
        if live:
            choices.append(st.sampled_from(live))
        if attached:
            choices += [st.sampled_from(attached)] * 3
        return data.draw(st.one_of(*choices), label="node")

    def lc(self, data):
        return data.draw(st.integers(0, len(self.lcs)), label="lc")  # len(lcs) is out of range

    def block_tokens(self, data):
        n = data.draw(st.one_of(st.just(self.B), st.integers(1, self.B)), label="n_tokens")
        return data.draw(st.lists(TOKEN, min_size=n, max_size=n), label="tokens")

    # ---------------------------------------------------------------- mutations

    @rule(i=st.integers(0, len(SCOPE_KEYS) - 1))
    def root(self, i):
        self.both("root", SCOPE_KEYS[i])

    @rule(data=st.data(), key=st.sampled_from(KEYS), ordinal=st.integers(0, 5))
    def new_block(self, data, key, ordinal):
        self.both("new_block", key, self.block_tokens(data), ordinal)

    @rule(data=st.data())
    def new_block_and_attach(self, data):
        # The common path: find_existing, else a new block attached under the parent.
        parent = self.node(data)
        key = data.draw(st.sampled_from(KEYS), label="key")
        toks = self.block_tokens(data)
        found = self.both("find_existing", parent, key, toks)
        if found[0] == "ok" and found[1] == -1:
            nid = self.both("new_block", key, toks, data.draw(st.integers(0, 5), label="ordinal"))[1]
            self.both("attach", parent, nid)

    @rule(data=st.data(), depth=st.integers(1, 3))
    def grow(self, data, depth):
        self._grow(data, depth)

    # Hypothesis picks rules uniformly: a second rule doubles the weight of building deep
    # trees, and of querying them (below), which is where the two trees can disagree.
    @rule(data=st.data(), depth=st.integers(1, 3))
    def grow_more(self, data, depth):
        self._grow(data, depth)

    def _grow(self, data, depth):
        # Extend an attached node by a chain of blocks with pages, the way commits do, so
        # matches walk deep and the fixed point has coverage to cut on.
        attached = sorted(i for i, n in self.py.nodes.items() if n.attached or n.is_root)
        if not attached:  # every root was released (unused scopes leave nothing behind)
            attached = [self.both("root", SCOPE_KEYS[0])[1]]
        parent = data.draw(st.sampled_from(attached), label="parent")
        for d in range(depth):
            key = data.draw(st.sampled_from(KEYS), label="key")
            n = self.B if d < depth - 1 else data.draw(st.sampled_from([self.B, self.B, 1]), label="n")
            toks = data.draw(st.lists(TOKEN, min_size=n, max_size=n), label="tokens")
            found = self.both("find_existing", parent, key, toks)[1]
            if found == -1:
                found = self.both("new_block", key, toks, data.draw(st.integers(0, 5), label="ordinal"))[1]
                self.both("attach", parent, found)
            for lc in range(len(self.lcs)):
                cov = data.draw(st.sampled_from([n, n, n, 0, max(0, n - 1)]), label="coverage")
                if cov:
                    self.next_page += 1
                    self.both("set_page", found, lc, self.next_page, cov)
            if data.draw(st.booleans(), label="ref"):
                self.both("ref", found)  # a request now references the block
            parent = found
            if len(self.py.nodes[found].tokens) < self.B:
                break

    @rule(data=st.data())
    def find_existing(self, data):
        toks = data.draw(st.lists(TOKEN, max_size=self.B + 1), label="tokens")
        self.both("find_existing", self.node(data), data.draw(st.sampled_from(KEYS), label="key"), toks)

    @rule(data=st.data())
    def attach(self, data):
        self.both("attach", self.node(data), self.node(data))

    @rule(data=st.data())
    def detach(self, data):
        self.both("detach", self.node(data))

    @rule(data=st.data())
    def remove_subtree(self, data):
        self.both("remove_subtree", self.node(data))

    @rule(data=st.data())
    def prune_upward(self, data):
        self.both("prune_upward", self.node(data))

    @rule(data=st.data(), page=st.one_of(st.integers(0, 30), st.just(-1)))
    def set_page(self, data, page):
        cov = data.draw(st.integers(0, self.B), label="coverage")
        self.both("set_page", self.node(data), self.lc(data), page, cov)

    @rule(data=st.data())
    def clear_page(self, data):
        self.both("clear_page", self.node(data), self.lc(data))

    @rule(data=st.data())
    def ref(self, data):
        self.both("ref", self.node(data))

    @rule(data=st.data())
    def unref(self, data):
        self.both("unref", self.node(data))

    @rule(data=st.data())
    def collect(self, data):
        self.both("collect", self.node(data))

    # ---------------------------------------------------------------- match and queries

    @rule(data=st.data(), partial=st.booleans(), backoff=st.integers(0, 3))
    def match_guided(self, data, partial, backoff):
        self._match_guided(data, partial, backoff)

    def _match_guided(self, data, partial, backoff):
        # Query the tokens of an existing chain (so the walk goes deep), then perturb it.
        live = sorted(self.py.nodes)
        deep = [i for i in live if self.py.nodes[i].attached and not self.py.nodes[i].is_root]
        if not live:
            return
        n = self.py.nodes[data.draw(st.sampled_from(deep or live), label="chain_end")]
        chain = []
        seen = set()
        while n.parent is not None and n.id not in seen:  # attach() can build a cycle of orphans
            seen.add(n.id)
            chain.append(n)
            n = n.parent
        chain.reverse()
        tokens = [t for c in chain for t in c.tokens]
        keys = [c.key for c in chain]
        cut = data.draw(st.integers(0, min(len(tokens), 2)), label="cut")
        tokens = tokens[: len(tokens) - cut] + data.draw(st.lists(TOKEN, max_size=self.B), label="extra")
        # Usually enough keys for every full block of the query; sometimes too few (IndexError).
        need = max(0, len(tokens) // self.B - len(keys))
        lo = need if data.draw(st.integers(0, 4), label="short_keys") else 0
        keys += data.draw(st.lists(st.sampled_from(KEYS), min_size=lo, max_size=need + 1), label="extra_keys")
        self.both("match", n.id, tokens, keys, partial, backoff)

    @rule(data=st.data(), partial=st.booleans(), backoff=st.integers(0, 3))
    def match_guided_more(self, data, partial, backoff):
        self._match_guided(data, partial, backoff)

    @rule(data=st.data(), partial=st.booleans(), backoff=st.integers(0, 3))
    def match_random(self, data, partial, backoff):
        tokens = data.draw(st.lists(TOKEN, max_size=3 * self.B), label="tokens")
        keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=len(tokens) // self.B + 1), label="keys")
        self.both("match", self.node(data), tokens, keys, partial, backoff)

    @rule(data=st.data())
    def queries(self, data):
        nid = self.node(data)
        lc = self.lc(data)
        for name, args in (
            ("parent", (nid,)),
            ("is_attached", (nid,)),
            ("exists", (nid,)),
            ("key", (nid,)),
            ("page", (nid, lc)),
            ("coverage", (nid, lc)),
        ):
            self.both(name, *args)

    @invariant()
    def same_dump(self):
        if hasattr(self, "py"):
            assert self.py.dump() == self.cc.dump()


TreeLockstep.TestCase.settings = settings(
    derandomize=True,
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_tree_lockstep = TreeLockstep.TestCase


def test_tree_basic_shapes():
    """A hand-written scenario: partial sibling adoption, covering siblings, matching."""
    preset = [("attn", None, 0), ("ssm", None, 0)]
    for t in (PyTree(2, _life_cycles(preset)), CppTree(2, preset)):
        r = t.root(SCOPE_KEYS[0])
        a = t.new_block(KEYS[0], [1, 2], 0)
        assert t.attach(r, a) == []
        t.set_page(a, 0, 10, 2)
        t.set_page(a, 1, 11, 2)
        p = t.new_block(KEYS[1], [5], 1)
        assert t.attach(a, p) == []
        t.set_page(p, 0, 12, 1)
        assert t.find_existing(a, KEYS[2], [5]) == -1  # same length is no covering sibling
        full = t.new_block(KEYS[2], [5, 6], 1)
        assert t.attach(a, full) == [p]  # the shorter partial sibling is detached ...
        assert t.page(full, 0) == 12 and t.page(p, 0) == -1  # ... and its page adopted
        assert not t.exists(p) or t.page(p, 0) == -1
        t.collect(p)
        assert not t.exists(p)
        assert t.find_existing(a, KEYS[3], [5]) == full  # covering sibling
        m, mbs, path = t.match(r, [1, 2, 5, 6], [KEYS[0], KEYS[2]], True, 0)
        assert (m, mbs, list(path)) == (2, 3, [a])  # the snapshot at 2 bounds the match
