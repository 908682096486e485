"""SPEC sec. 7 + 10 (+ DECISIONS "Batched decode step"): ``resize_batch`` / ``commit_batch``.

A batch call must leave exactly the state the single calls leave when run in batch order
(two managers driven the two ways, ``snapshot()``, results, copy ops and events compared
after every step), and a bad argument anywhere in a batch must raise the documented error
before anything changes (``snapshot()`` identical), which a loop of single calls does not
do: the last test shows these scenarios catch a batch that validates lazily.
"""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch
from kvcm import ClosedError, InvalidStateError

from parity.helpers import B, attn_cfg, hybrid_cfg, snap, ssm_cfg, toks, unchanged, win_cfg

# ---------------------------------------------------------------------------------------
# the batch and the single calls, side by side
# ---------------------------------------------------------------------------------------

CONTAINERS = {
    "list": list,
    "tuple": tuple,
    "array_i": lambda v: array.array("i", v),
    "array_q": lambda v: array.array("q", v),
    "numpy_int64": lambda v: np.array(v, dtype=np.int64),
    "numpy_int32": lambda v: np.array(v, dtype=np.int32),
    "torch_int64": lambda v: torch.tensor(v, dtype=torch.int64),
    "torch_int32": lambda v: torch.tensor(v, dtype=torch.int32),
}


def start(mgr, prompts: list[list[int]]) -> list:
    """One ACTIVE cache per prompt, its prompt committed (nothing matched: no input)."""
    kvs = []
    for p in prompts:
        kv = mgr.create_kv_cache()
        assert kv.resume() and kv.resize(len(p))
        kv.commit(p)
        kvs.append(kv)
    return kvs


def observe(mgr) -> tuple:
    """Everything observable after a step (the drains are part of the comparison)."""
    return (snap(mgr), [o.to_json() for o in mgr.drain_copy_ops()], [e.to_json() for e in mgr.take_events()])


def decode_twins(make_manager, cfg, prompts, growth, container=list, histories=None, prepare=None) -> list[list[bool]]:
    """Drive two managers through the same decode steps, one with the batch calls, one with
    the single calls in batch order; compare everything after every step.  ``growth[s]``
    is each cache's capacity increase at step ``s``; caches whose resize fails are left out
    of that step's commit (as an engine preempts them); ``prepare(manager)`` runs on both
    first.  Returns each step's results."""
    batched, single = make_manager(cfg), make_manager(cfg)
    for m in (batched, single) if prepare is not None else ():
        prepare(m)
    kb, ks = start(batched, prompts), start(single, prompts)
    assert observe(batched) == observe(single)
    results = []
    for s, grow in enumerate(growth):
        caps = [kv.capacity + grow for kv in kb]
        hist = None if histories is None else [min(kv.history_length + histories[s], c) for kv, c in zip(kb, caps)]
        got = batched.resize_batch(kb, container(caps), None if hist is None else container(hist))
        want = [kv.resize(c, None if hist is None else hist[i]) for i, (kv, c) in enumerate(zip(ks, caps))]
        assert got == want and all(type(r) is bool for r in got)
        assert observe(batched) == observe(single), f"resize step {s}"
        grown = [i for i, ok in enumerate(got) if ok]
        tokens = [(1000 * s + 7 * i) % 50_000 for i in grown]
        batched.commit_batch([kb[i] for i in grown], container(tokens))
        for i, t in zip(grown, tokens):
            ks[i].commit([t])
        assert observe(batched) == observe(single), f"commit step {s}"
        results.append(got)
    batched.check_invariants()
    for a, b in zip(kb, ks):
        assert (a.capacity, a.history_length, a.committed_tokens) == (b.capacity, b.history_length, b.committed_tokens)
    return results


# Prompts of staggered lengths: each step some caches cross a block boundary (allocation,
# tree insertion, ssm snapshot) and others do not.
PROMPTS = [toks(n, base=1000 * (i + 1)) for i, n in enumerate([3, 4, 5, 6, 7, 9])]


def mixed(results: list[list[bool]]) -> bool:
    """Some step where a cache ran out of pages between two that did not."""
    return any(any(not r[i] and any(r[:i]) and any(r[i + 1 :]) for i in range(len(r))) for r in results)


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_decode_steps_equal_single_calls_for_every_container(make_manager, container):
    results = decode_twins(make_manager, attn_cfg(gpu=64), PROMPTS, [1] * 12, CONTAINERS[container])
    assert all(all(r) for r in results)


def test_resize_batch_out_of_pages_mid_batch_undoes_only_that_cache(make_manager):
    # gpu 6 slots: three caches hold one page each; the middle one asks for 3 more (only 3
    # free, 1 taken by the first), the last for one: [True, False, True], as single calls
    mgr = make_manager(attn_cfg(gpu=6))
    a, b, c = start(mgr, [toks(4, 100), toks(2, 200), toks(3, 300)])
    before = snap(mgr)
    assert mgr.resize_batch([a, b, c], [8, 16, 6]) == [True, False, True]
    after = snap(mgr)
    assert after["requests"][1] == before["requests"][1]
    assert (a.capacity, b.capacity, c.capacity) == (8, 2, 6)
    assert after["clock"] == before["clock"] + 2  # one tick per successful resize, none for the False
    # and the same through the twin driver, tight quota, many steps
    results = decode_twins(make_manager, attn_cfg(gpu=9), PROMPTS[:4], [1, 2, 1, 3, 1, B, 1, 1])
    assert mixed(results) and not all(all(r) for r in results)


def test_batch_under_tight_quota_with_host_tier_offloads_like_single_calls(make_manager):
    def tree_first(m) -> None:  # DROPPABLE pages in the tree, to be offloaded / dropped
        kv = m.create_kv_cache()
        assert kv.resume() and kv.resize(12)
        kv.commit(toks(12, 5000))
        kv.close()

    results = decode_twins(make_manager, attn_cfg(gpu=10, host=2), PROMPTS[:3], [1, B, 1, B, 2, 1], prepare=tree_first)
    assert any(not all(r) for r in results)


def test_windowed_attention_batch_with_history_releases_stale_pages(make_manager):
    cfg = win_cfg(gpu=24, window=6, sinks=2)
    results = decode_twins(make_manager, cfg, PROMPTS[:4], [1, 1, B, 1, 1, 2, 1], histories=[1, 0, 3, 1, 0, 2, 1])
    assert all(all(r) for r in results)
    # tight: pages released as stale (history raised) make room for later caches' growth
    growth, histories = [1, 2, 1, B, 1, 2, B], [1, 2, 1, 4, 1, 2, 2]
    assert mixed(decode_twins(make_manager, win_cfg(gpu=6, window=4), PROMPTS[:4], growth, histories=histories))


def test_ssm_and_hybrid_batches_take_snapshots_at_block_ends(make_manager):
    # pure ssm: a commit that ends a block snapshots the live state (a copy op)
    results = decode_twins(make_manager, ssm_cfg(gpu=12), PROMPTS[:5], [1] * 9)
    assert all(all(r) for r in results)
    # hybrid with a window, tight: caches run out of pages mid-batch, compared step by step
    assert mixed(decode_twins(make_manager, hybrid_cfg(attn_gpu=7, ssm_gpu=8, window=5), PROMPTS[:4], [1, 1, 2, 1, B, 1]))


def test_empty_batches_change_nothing(make_manager):
    mgr = make_manager(attn_cfg(gpu=8))
    start(mgr, [toks(3)])
    before = snap(mgr)
    assert mgr.resize_batch([], []) == []
    assert mgr.resize_batch((), np.array([], dtype=np.int64), array.array("q")) == []
    mgr.commit_batch([], [])
    mgr.commit_batch([], torch.tensor([], dtype=torch.int64))
    assert snap(mgr) == before  # no tick either


# ---------------------------------------------------------------------------------------
# bad input: the documented error, nothing changed -- with the bad item LAST, after items
# whose single call would already have changed state
# ---------------------------------------------------------------------------------------


def busy(make_manager, cfg=None):
    """A manager with two ACTIVE caches (room to grow and commit), a SUSPENDED one, a closed
    one, a stopped one and a full one (capacity == committed), plus a cache of another
    manager."""
    mgr = make_manager(cfg or attn_cfg(gpu=16))
    a, b, stopped, full = start(mgr, [toks(3, 100), toks(5, 200), toks(2, 300), toks(4, 400)])
    assert a.resize(6) and b.resize(8)
    stopped.stop_committing()
    suspended = mgr.create_kv_cache(toks(4, 400))
    closed = mgr.create_kv_cache()
    closed.close()
    foreign = start(make_manager(attn_cfg(gpu=4)), [toks(2, 900)])[0]
    return mgr, {"a": a, "b": b, "suspended": suspended, "closed": closed, "stopped": stopped, "full": full,
                 "foreign": foreign}  # fmt: skip


RESIZE_BAD_CACHES = [
    (["a", "b", "a"], ValueError, "caches[2]: the same cache appears twice"),
    (["a", "b", "closed"], ClosedError, "caches[2]: resize() on a closed cache"),
    (["a", "b", "suspended"], InvalidStateError, "caches[2]: resize() needs a ACTIVE cache"),
    (["a", "b", "foreign"], ValueError, "caches[2]: not a cache of this manager"),
    (["a", "b", 7], TypeError, "caches[2] must be a KVCache"),
    (["a", "b", None], TypeError, "caches[2] must be a KVCache"),
]


@pytest.mark.parametrize("names,exc,msg", RESIZE_BAD_CACHES)
def test_resize_batch_rejects_bad_caches_before_any_change(make_manager, names, exc, msg):
    mgr, kv = busy(make_manager)
    caches = [kv[n] if isinstance(n, str) else n for n in names]
    err = unchanged(mgr, lambda: mgr.resize_batch(caches, [9, 12, 20]), exc)
    assert msg in str(err) and str(err).startswith("resize_batch(): ")


@pytest.mark.parametrize("names,exc,msg", [
    (["a", "b", "a"], ValueError, "caches[2]: the same cache appears twice"),
    (["a", "b", "closed"], ClosedError, "caches[2]: commit() on a closed cache"),
    (["a", "b", "suspended"], InvalidStateError, "caches[2]: commit() needs a ACTIVE cache"),
    (["a", "b", "stopped"], InvalidStateError, "caches[2]: commit after stop_committing()"),
    (["a", "b", "full"], ValueError, "caches[2]: commit of 1 tokens exceeds capacity 4 (4 committed)"),
    (["a", "b", "foreign"], ValueError, "caches[2]: not a cache of this manager"),
    (["a", "b", "x"], TypeError, "caches[2] must be a KVCache"),
])  # fmt: skip
def test_commit_batch_rejects_bad_caches_before_any_change(make_manager, names, exc, msg):
    mgr, kv = busy(make_manager)
    caches = [kv.get(n, n) for n in names]
    err = unchanged(mgr, lambda: mgr.commit_batch(caches, [1, 2, 3]), exc)
    assert msg in str(err) and str(err).startswith("commit_batch(): ")


@pytest.mark.parametrize("caches", ["ab", b"ab", None, 5, {"a": 1}, iter([])])
def test_batch_calls_reject_a_caches_argument_that_is_no_sequence(make_manager, caches):
    mgr, _ = busy(make_manager)
    unchanged(mgr, lambda: mgr.resize_batch(caches, []), TypeError)
    unchanged(mgr, lambda: mgr.commit_batch(caches, []), TypeError)


BAD_CAPACITIES = [
    ([9, 12, -1], ValueError),
    ([9, 12, 2.0], TypeError),
    ([9, 12, True], TypeError),
    ([9, 12, "8"], TypeError),
    ([9, 12, None], TypeError),
    ([9, 12, 2**64], ValueError),
    (np.array([9, 12, 20], dtype=np.float64), TypeError),
    (np.array([True, True, True]), TypeError),
    (np.array([9, 12, -1], dtype=np.int64), ValueError),
    (np.array([[9, 12, 20]], dtype=np.int64), TypeError),  # 2-D
    (array.array("q", [9, 12, -1]), ValueError),
    (array.array("d", [9, 12, 20]), TypeError),
    (torch.tensor([9, 12, -1]), ValueError),
    (torch.tensor([9.0, 12.0, 20.0]), TypeError),
    ([9, 12], ValueError),  # length
    ([9, 12, 20, 20], ValueError),
    (np.array([9, 12], dtype=np.int32), ValueError),
    ("abc", TypeError),
    (5, TypeError),
    (None, TypeError),
    ({9, 12, 20}, TypeError),
    ([9, 12, 4], ValueError),  # below the 5 committed tokens of the last cache
]


@pytest.mark.parametrize("capacities,exc", BAD_CAPACITIES, ids=range(len(BAD_CAPACITIES)))
def test_resize_batch_rejects_bad_capacities_before_any_change(make_manager, capacities, exc):
    mgr, kv = busy(make_manager)
    kv["full"].resize(5)
    kv["full"].commit([1])  # 5 committed: a capacity of 4 is below them
    unchanged(mgr, lambda: mgr.resize_batch([kv["a"], kv["b"], kv["full"]], capacities), exc)


@pytest.mark.parametrize("histories,exc,msg", [
    ([6, 8, 4], ValueError, "history_length 4 is below the current history 5"),
    ([6, 8, 30], ValueError, "capacity 20 is below history_length 30"),
    ([6, 8, -1], ValueError, "history_lengths[2] must be >= 0"),
    ([6, 8, 1.5], TypeError, "history_lengths[2] must be an int"),
    ([6, 8], ValueError, "history_lengths has 2 items for 3 caches"),
    (np.array([6, 8, 4], dtype=np.int32), ValueError, "below the current history"),
    ("678", TypeError, "history_lengths must be a list or tuple of ints or an integer array"),
])  # fmt: skip
def test_resize_batch_rejects_bad_history_lengths_before_any_change(make_manager, histories, exc, msg):
    mgr, kv = busy(make_manager)
    kv["full"].resize(5)
    kv["full"].commit([1])
    err = unchanged(mgr, lambda: mgr.resize_batch([kv["a"], kv["b"], kv["full"]], [9, 12, 20], histories), exc)
    assert msg in str(err)


@pytest.mark.parametrize("tokens,exc", [
    ([1, 2, -1], ValueError),
    ([1, 2, 2**31], ValueError),
    ([1, 2, 1.5], TypeError),
    ([1, 2, True], TypeError),
    ([1, 2, None], TypeError),
    ([1, 2, b"\x00" * 31], ValueError),
    (np.array([1, 2, -1], dtype=np.int64), ValueError),
    (torch.tensor([1, 2, 2**31]), ValueError),
    (array.array("i", [1, 2, -5]), ValueError),
    ([1, 2], ValueError),  # length
    ([1, 2, 3, 4], ValueError),
    ("abc", TypeError),
    (7, TypeError),
])  # fmt: skip
def test_commit_batch_rejects_bad_tokens_before_any_change(make_manager, tokens, exc):
    mgr, kv = busy(make_manager)
    unchanged(mgr, lambda: mgr.commit_batch([kv["a"], kv["b"], kv["full"]], tokens), exc)


def test_commit_batch_accepts_digest_tokens(make_manager):
    cfg = attn_cfg(gpu=16)
    batched, single = make_manager(cfg), make_manager(cfg)
    kb, ks = start(batched, PROMPTS[:2]), start(single, PROMPTS[:2])
    for kvs in (kb, ks):
        for kv in kvs:
            assert kv.resize(kv.capacity + 1)
    d = bytes(range(32))
    batched.commit_batch(kb, [d, 5])
    ks[0].commit([d])
    ks[1].commit([5])
    assert observe(batched) == observe(single)
    assert kb[0].committed_tokens[-1] == d


def test_batch_check_order(make_manager):
    """DECISIONS "Batched decode step": caches item by item, then the other arguments'
    containers, items and lengths, then the per-cache state checks."""
    mgr, kv = busy(make_manager)
    a, b, closed, foreign = kv["a"], kv["b"], kv["closed"], kv["foreign"]
    # a repeated cache before a foreign one is reported first, and the other way round
    assert "caches[1]: the same" in str(unchanged(mgr, lambda: mgr.resize_batch([a, a, foreign], [1, 1, 1]), ValueError))
    assert "caches[1]: not a cache" in str(unchanged(mgr, lambda: mgr.resize_batch([a, foreign, a], [1, 1, 1]), ValueError))
    # a bad capacity (argument check) before a closed cache (state check), wherever they are
    unchanged(mgr, lambda: mgr.resize_batch([closed, a], [9, "x"]), TypeError)
    unchanged(mgr, lambda: mgr.resize_batch([closed, a], [9]), ValueError)
    unchanged(mgr, lambda: mgr.commit_batch([closed, b], [1, -1]), ValueError)
    # a bad cache before a bad capacity
    unchanged(mgr, lambda: mgr.resize_batch([a, 3], [9, "x"]), TypeError)
    assert "caches[1]" in str(unchanged(mgr, lambda: mgr.resize_batch([a, 3], [9, "x"]), TypeError))
    # within the state checks: the first cache in batch order
    err = unchanged(mgr, lambda: mgr.resize_batch([a, closed, kv["suspended"]], [2, 9, 9]), ValueError)
    assert "caches[0]: capacity 2 is below the 3 committed tokens" in str(err)


# ---------------------------------------------------------------------------------------
# the scenarios above can fail: a batch that validates lazily (a loop of single calls) is
# caught by them
# ---------------------------------------------------------------------------------------


def lazy_resize_batch(caches, capacities):
    return [c.resize(x) for c, x in zip(caches, capacities)]


def lazy_commit_batch(caches, tokens):
    for c, t in zip(caches, tokens):
        c.commit([t])


def test_scenarios_catch_lazy_validation(make_manager):
    mgr, kv = busy(make_manager)
    a, b = kv["a"], kv["b"]
    for name, exc in (("closed", ClosedError), ("suspended", InvalidStateError)):
        with pytest.raises(AssertionError, match="a failed call changed state"):
            unchanged(mgr, lambda n=name: lazy_resize_batch([a, b, kv[n]], [a.capacity + 9, b.capacity + 9, 20]), exc)
    mgr, kv = busy(make_manager)
    a, b = kv["a"], kv["b"]
    with pytest.raises(AssertionError, match="a failed call changed state"):
        unchanged(mgr, lambda: lazy_commit_batch([a, b, kv["stopped"]], [1, 2, 3]), InvalidStateError)
    # and the real batch calls pass the very same checks
    unchanged(mgr, lambda: mgr.resize_batch([a, b, kv["closed"]], [a.capacity + 9, b.capacity + 9, 20]), ClosedError)
    unchanged(mgr, lambda: mgr.commit_batch([a, b, kv["stopped"]], [1, 2, 3]), InvalidStateError)
