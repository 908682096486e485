"""SPEC sec. 15 (memory bounded by configuration, cost that does not grow with the wrong
thing): the parity side of issue 8 items 8-11.  Each scenario runs on both backends."""

from __future__ import annotations

import warnings

import pytest
from kvcm import ConfigError, ReuseScope
from kvcm.api import PendingCopyOpsWarning

from parity.helpers import attn_cfg, fill, keys, ops, toks


def _pending(mgr) -> int:
    return mgr.stats()["pending_copy_ops"]


# ---------------------------------------------------------------- item 9: undrained copy ops


def test_undrained_copy_ops_pile_up_silently(make_manager):
    """Pending copy ops are a stat, and reaching the configured figure warns once (after
    the call that reached it, which takes full effect)."""
    mgr = make_manager(attn_cfg(gpu=2, host=16, pending_copy_ops_warning=3))
    assert _pending(mgr) == 0
    seen = []
    for i in range(6):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            fill(mgr, toks(8, base=100 * (i + 1)))  # 2 blocks: each new request offloads 2
        seen.append([(x.category, str(x.message)) for x in w if issubclass(x.category, PendingCopyOpsWarning)])
        assert _pending(mgr) == 2 * i
        assert mgr.take_iteration_stats()["pending_copy_ops"] == 2 * i  # a current figure
    # the 3rd op arrived during the 3rd fill (ops 3 and 4): exactly one warning, there
    assert [len(s) for s in seen] == [0, 0, 1, 0, 0, 0]
    assert "3 copy ops are pending" in seen[2][0][1]
    assert len(ops(mgr)) == 10
    assert _pending(mgr) == 0
    mgr.check_invariants()


def test_pending_copy_ops_warning_zero_never_warns(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=16, pending_copy_ops_warning=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingCopyOpsWarning)
        for i in range(4):
            fill(mgr, toks(8, base=100 * (i + 1)))
    assert _pending(mgr) == 6


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, True, None])
def test_pending_copy_ops_warning_is_validated(make_manager, bad):
    with pytest.raises(ConfigError, match="pending_copy_ops_warning"):
        make_manager(attn_cfg(pending_copy_ops_warning=bad))


# ---------------------------------------------------------------- item 8: one root per scope


def _roots(mgr) -> list[dict]:
    return [n for n in mgr.snapshot()["tree"] if n["root"]]


def test_every_distinct_scope_leaves_a_root_forever(make_manager):
    """A scope root with nothing under it and no open request is released (sec. 15)."""
    mgr = make_manager(attn_cfg(gpu=64))
    for salt in range(20):
        kv = mgr.create_kv_cache(toks(6), scope=ReuseScope(salt=salt))
        cached = max(0, salt - 10)  # scopes with committed blocks so far
        assert len(_roots(mgr)) == cached + 1  # the open request keeps its root
        if salt < 10:
            kv.close()  # nothing committed: the root goes with the request
            assert _roots(mgr) == []
            continue
        assert kv.resume() and kv.resize(6)
        kv.commit(toks(6))
        kv.close()  # the cached blocks keep the root
    roots = _roots(mgr)
    assert len(roots) == 10 and all(r["children"] and r["refs"] == 0 for r in roots)
    mgr.clear_reusable()  # nothing cached: no root left
    assert mgr.snapshot()["tree"] == []
    mgr.check_invariants()
    # a scope used again gets a fresh root (a new node id on both backends)
    kv = mgr.create_kv_cache(toks(6), scope=ReuseScope(salt=3))
    (root,) = _roots(mgr)
    assert root["refs"] == 1 and root["id"] == mgr.snapshot()["next"]["node"] - 1
    kv.close()
    assert _roots(mgr) == []


def test_scope_root_released_when_eviction_empties_it(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    fill(mgr, toks(8, base=100), close=True)  # 2 blocks fill the gpu
    before = _roots(mgr)
    assert len(before) == 1
    fill(mgr, toks(8, base=200), close=True)  # evicts both blocks of the first request
    # (same default scope: the root stays, holding the new blocks)
    assert [r["id"] for r in _roots(mgr)] == [before[0]["id"]]
    kv = mgr.create_kv_cache(None, scope=ReuseScope(lora_id=1))
    assert kv.resume() and kv.resize(8)
    kv.commit(toks(8, base=400))  # evicts the default scope's last blocks
    kv.close()
    ids = {r["id"] for r in _roots(mgr)}
    assert before[0]["id"] not in ids and len(ids) == 1
    mgr.check_invariants()


def test_probe_with_a_new_scope_allocates_nothing(make_manager):
    mgr = make_manager(attn_cfg(gpu=8))
    fill(mgr, toks(8))
    snap = mgr.snapshot()
    for salt in range(50):
        assert mgr.probe_reuse(toks(8), ReuseScope(salt=salt)) == 0
        assert mgr.probe_reuse_detail(toks(8), ReuseScope(lora_id=salt)).num_tokens == 0
    assert mgr.snapshot() == snap


# ---------------------------------------------------------------- item 11: fan-out under one block


def _node_key(mgr, node_id) -> bytes:
    (node,) = [n for n in mgr.snapshot()["tree"] if n["id"] == node_id]
    return bytes.fromhex(node["key"])


def test_fan_out_ties_go_to_the_smallest_key(make_manager):
    """Many continuations of one block share their first token: the partial match takes
    the child with the longest common run, ties to the smallest key; a partial tail's
    covering sibling is the one with most tokens, ties to the smallest key."""
    mgr = make_manager(attn_cfg(gpu=200))
    system = toks(4, base=1)
    full = [[9, 1000 + i, 7, 7] for i in range(40)]
    part = [[9, 2000 + i] for i in range(40)]
    for cont in full + part:
        kv = mgr.create_kv_cache(None)
        assert kv.resume() and kv.resize(8)
        kv.commit(system + cont)
        kv.close()  # a partial continuation enters the tree as a partial block
    parent = keys(system)[0]
    full_keys = [keys(system + c)[1] for c in full]
    part_keys = [keys(system + c)[1] for c in part]
    assert len({n["id"] for n in mgr.snapshot()["tree"]}) == 1 + 1 + 80  # root, system, fan-out
    # partial match: [9, 5] shares one token with all 80: the smallest key wins
    kv = mgr.create_kv_cache(system + [9, 5])
    assert kv.num_reused_tokens == 5
    (req,) = mgr.snapshot()["requests"]
    assert _node_key(mgr, req["blocks"][1]) == min(full_keys + part_keys)
    kv.close()
    # a longer run beats a smaller key: 2 tokens into part[7], 3 into full[3]
    assert mgr.probe_reuse(system + [9, 2007, 7]) == 6
    assert mgr.probe_reuse(system + [9, 1003, 7, 8]) == 7
    # covering sibling of the tail [9]: the full continuations (4 tokens) beat the partial
    # ones (2 tokens); among them the smallest key
    kv = mgr.create_kv_cache(None)
    assert kv.resume() and kv.resize(5)
    kv.commit(system + [9])
    kv.stop_committing()
    (req,) = mgr.snapshot()["requests"]
    assert _node_key(mgr, req["blocks"][1]) == min(full_keys)
    kv.close()
    (system_node,) = [n for n in mgr.snapshot()["tree"] if n["key"] == parent.hex()]
    assert len(system_node["children"]) == 80
    mgr.check_invariants()
