"""SPEC sec. 5 (+ DECISIONS "Tree and events"): insertion, covering siblings, detaching
partial siblings with page adoption, pruning (subtree removal, upward walk)."""

from __future__ import annotations

from parity.helpers import (
    GPU,
    HOST,
    attached_keys,
    attn_cfg,
    counts,
    fill,
    keys,
    of_kind,
    op,
    ops,
    orphan_keys,
    removed,
    ssm_cfg,
    stored,
    toks,
    tree_nodes,
    win_cfg,
)

P = toks(16, base=100)


def test_commit_inserts_only_full_blocks(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:6])
    k = keys(P[:6])
    assert attached_keys(mgr) == {k[0]}
    assert mgr.probe_reuse(P[:6]) == 4
    assert stored(mgr.take_events()) == [(k[0], 0)]
    mgr.check_invariants()


def test_covering_sibling_is_reused_for_shorter_partial_block(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:8])  # blocks 0, 1 in slots 0, 1
    mgr.take_events()
    mgr.drain_copy_ops()
    b = mgr.create_kv_cache(P[:6])  # match ends inside block 1
    assert b.num_committed_tokens == 6
    assert b.resume() is True
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    assert b.page_indices(0) == [0, 2]
    b.stop_committing()  # tail [P4, P5]: the full block 1 covers it -> no new block
    assert mgr.take_events() == []
    assert attached_keys(mgr) == set(keys(P[:8]))
    b.close()
    assert counts(mgr) == (4, 2, 0, 0, 2)  # b's private copy is gone
    assert len(tree_nodes(mgr)) == 2
    mgr.check_invariants()


def test_longer_block_detaches_shorter_partial_sibling(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:6])  # block 0 slot 0, partial [P4, P5] slot 1
    kp = keys(P[:6])[1]
    k = keys(P[:8])
    assert attached_keys(mgr) == {k[0], kp}
    mgr.take_events()
    mgr.drain_copy_ops()
    b = mgr.create_kv_cache(P[:8])
    assert b.num_committed_tokens == 6
    assert b.resume() is True
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    assert b.resize(8) is True
    b.commit(P[6:8])
    ev = mgr.take_events()
    assert stored(ev) == [(k[1], 0)]
    assert removed(ev) == [(kp, 0)]
    assert attached_keys(mgr) == set(k)
    assert mgr.probe_reuse(P[:6]) == 6  # now through the full block (its page covers more)
    assert mgr.probe_reuse(P[:8]) == 8
    b.close()
    assert counts(mgr) == (4, 2, 0, 0, 2)  # the orphan's page was freed with its last user
    assert len(tree_nodes(mgr)) == 2
    mgr.check_invariants()


def test_detached_partial_sibling_snapshot_adopted_by_longer_block(make_manager):
    mgr = make_manager(ssm_cfg(gpu=8))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(6)
    a.commit(P[:6])
    a.stop_committing()  # snapshot of the partial tail (coverage 2) in slot 1
    a.close()
    assert ops(mgr) == [op(0, GPU, 0, GPU, 1, "snapshot")]
    assert mgr.probe_reuse(P[:12]) == 6
    mgr.take_events()
    b = mgr.create_kv_cache(P[:12])
    assert b.num_committed_tokens == 6
    assert b.resume() is True
    assert ops(mgr) == [op(0, GPU, 1, GPU, 0, "cow")]
    assert b.resize(12)
    b.commit(P[6:12])  # block 1 filled mid-commit (no snapshot of its own), block 2 at the end
    assert ops(mgr) == [op(0, GPU, 0, GPU, 2, "snapshot")]
    k = keys(P[:12])
    assert keys(P[:6])[1] not in attached_keys(mgr)
    assert attached_keys(mgr) == set(k)
    st = stored(mgr.take_events())
    assert (k[1], 0) in st and (k[2], 0) in st
    # block 1 adopted the coverage-2 snapshot: a match may end at P[:6] again
    assert mgr.probe_reuse(P[:6]) == 6
    assert mgr.probe_reuse(P[:8]) == 6
    assert mgr.probe_reuse(P[:12]) == 12
    mgr.check_invariants()


def test_slot_keeps_only_page_with_largest_coverage(make_manager):
    mgr = make_manager(ssm_cfg(gpu=8))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(6)
    a.commit(P[:6])
    a.stop_committing()
    a.close()  # partial block with a coverage-2 snapshot in slot 1
    b = mgr.create_kv_cache(P[:12])
    assert b.resume() and b.resize(12)
    b.commit(P[6:12])  # block 1 adopts the coverage-2 snapshot; block 2 snapshot in slot 2
    b.close()  # live state (slot 0) freed
    mgr.drain_copy_ops()
    k = keys(P[:12])
    adopted = [(b.coverage, b.tier) for e in mgr.take_events() if e.kind == "stored" for b in e.blocks
               if b.key == k[1]]
    assert adopted == [(2, 0)]  # the stored event says the adopted snapshot covers 2 tokens
    c = mgr.create_kv_cache()
    assert c.resume() is True
    assert c.page_indices(0) == [0]
    assert c.resize(8)
    c.commit(P[:8])  # ends at block 1's boundary: coverage 4 > 2 replaces the snapshot
    assert ops(mgr) == [op(0, GPU, 0, GPU, 3, "snapshot")]
    # a coverage upgrade: removed, then stored with the new coverage (DECISIONS "Tree and events")
    ev = [e.to_json() for e in mgr.take_events()]
    for e in ev:
        del e["event_id"]
    assert ev == [
        {"kind": "removed", "keys": [k[1].hex()], "lc": 0},
        {"kind": "stored", "parent_key": k[0].hex(), "partial": False,
         "blocks": [[k[1].hex(), 4, P[4:8], 0, 0, ev[1]["blocks"][0][5], 4]]},
    ]
    assert mgr.probe_reuse(P[:8]) == 8
    d = mgr.create_kv_cache()
    assert d.resume() is True
    assert d.page_indices(0) == [1]  # the replaced snapshot's slot was freed
    e = mgr.create_kv_cache()
    assert e.resume() and e.resize(8)
    e.commit(P[:8])  # block 1 already covered as much: no snapshot
    assert ops(mgr) == []
    mgr.check_invariants()


def _subtree_removal(mgr) -> None:
    """Block 0's tree page is alone on host (priority 10); blocks 1, 2 hang below it with
    pages LOCKED by request b (priority 90) that kept a private copy of block 0."""
    k = keys(P[:12])
    fill(mgr, P[:4], priority=10)  # gpu 0
    r = mgr.create_kv_cache()
    assert r.resume() and r.resize(12)
    assert r.page_indices(0) == [1, 2, 0]
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload")]
    r.close()  # nothing committed: all three pages freed
    mgr.take_events()
    b = mgr.create_kv_cache(priority=90)
    assert b.resume() and b.resize(12)
    assert b.page_indices(0) == [0, 1, 2]
    b.commit(P[:12])  # block 0 exists (page on host): b keeps its own; blocks 1, 2 are new
    assert stored(mgr.take_events()) == [(k[1], 0), (k[2], 0)]
    assert mgr.probe_reuse(P[:12]) == 12
    mgr.clear_reusable()  # drops block 0's page: the whole subtree goes
    ev = mgr.take_events()
    assert sorted(removed(ev)) == sorted([(k[0], 0), (k[1], 0), (k[2], 0)])
    assert len(of_kind(ev, "cleared")) == 1
    assert mgr.probe_reuse(P[:12]) == 0
    assert attached_keys(mgr) == set()
    assert set(orphan_keys(mgr)) >= {k[1], k[2]}
    assert b.page_indices(0) == [0, 1, 2]  # pages of the live request stay alive
    assert counts(mgr, GPU) == (3, 0, 3, 0, 0)
    assert counts(mgr, HOST) == (1, 1, 0, 0, 0)
    mgr.check_invariants()
    b.suspend()
    c = mgr.create_kv_cache()
    assert c.resume() and c.resize(4)  # b's deepest HELD orphan page moves to host
    assert ops(mgr) == [op(0, GPU, 2, HOST, 0, "offload")]
    assert mgr.take_events() == []  # pages of orphan blocks emit no tier_changed
    assert c.page_indices(0) == [2]
    c.close()
    b.close()
    assert counts(mgr, GPU) == (3, 3, 0, 0, 0)  # orphan pages freed with their last user
    assert counts(mgr, HOST) == (1, 1, 0, 0, 0)
    assert tree_nodes(mgr) == []
    assert mgr.take_events() == []  # orphans emit no events
    fill(mgr, P[:12])
    assert stored(mgr.take_events()) == [(x, 0) for x in k]
    mgr.check_invariants()


def test_full_attention_page_drop_removes_whole_subtree(make_manager):
    _subtree_removal(make_manager(attn_cfg(gpu=3, host=1)))


def test_sink_block_page_drop_removes_whole_subtree(make_manager):
    # window 8, 4 sink tokens: block 0 is the sink block; nothing is stale at history 12
    _subtree_removal(make_manager(win_cfg(gpu=3, window=8, sinks=4, host=1)))


def test_upward_walk_prunes_pageless_ancestors(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    fill(mgr, P[:8])  # block 0 has no page, block 1 has the snapshot
    k = keys(P[:8])
    assert stored(mgr.take_events()) == [(k[1], 0)]
    assert attached_keys(mgr) == {k[0], k[1]}
    mgr.clear_reusable()
    assert removed(mgr.take_events()) == [(k[1], 0)]
    assert attached_keys(mgr) == set()
    assert tree_nodes(mgr) == []
    assert mgr.probe_reuse(P[:8]) == 0
    mgr.check_invariants()


def test_windowed_block_without_page_stays_while_it_has_children(make_manager):
    mgr = make_manager(win_cfg(gpu=4, window=4))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(12)
    a.commit(P[:12])
    assert a.resize(12, history_length=12)  # blocks 0, 1 stale -> DROPPABLE in the tree
    assert a.page_indices(0) == [-1, -1, 2]
    mgr.take_events()
    mgr.clear_reusable()
    k = keys(P[:12])
    assert sorted(removed(mgr.take_events())) == sorted([(k[0], 0), (k[1], 0)])
    assert attached_keys(mgr) == set(k)  # pageless but each has a child
    assert mgr.probe_reuse(P[:12]) == 12  # at history 12 blocks 0, 1 are stale
    a.close()
    mgr.clear_reusable()
    assert removed(mgr.take_events()) == [(k[2], 0)]
    assert attached_keys(mgr) == set()  # upward walk removed the pageless chain
    assert tree_nodes(mgr) == []
    mgr.check_invariants()


def test_orphan_nodes_are_listed_only_while_referenced(make_manager):
    mgr = make_manager(ssm_cfg(gpu=2))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(8)
    a.commit(P[:8])  # live 0, snapshot of block 1 in slot 1 (DROPPABLE)
    k = keys(P[:8])
    mgr.clear_reusable()  # snapshot dropped: blocks 0, 1 detached, a still references them
    assert attached_keys(mgr) == set()
    assert sorted(orphan_keys(mgr)) == sorted(k)
    a.close()
    assert tree_nodes(mgr) == []
    mgr.check_invariants()


def test_pageless_committed_block_stays_detached_until_it_becomes_a_parent(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(12)
    kv.commit(P[:6])  # block 0 filled mid-commit: no snapshot, no page at all
    k = keys(P[:8])
    assert attached_keys(mgr) == set()
    assert orphan_keys(mgr) == [k[0]]
    mgr.check_invariants()
    kv.commit(P[6:8])  # block 1 gets a snapshot: block 0 is re-attached as its parent
    assert attached_keys(mgr) == {k[0], k[1]}
    assert orphan_keys(mgr) == []
    assert mgr.probe_reuse(P[:8]) == 8
    mgr.check_invariants()


def test_longer_partial_block_detaches_shorter_partial(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:6])  # block 0 slot 0, partial [P4, P5] slot 1
    kp, kq = keys(P[:6])[1], keys(P[:7])[1]
    mgr.take_events()
    mgr.drain_copy_ops()
    b = mgr.create_kv_cache(P[:7])
    assert b.num_committed_tokens == 6
    assert b.resume() is True
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    assert b.resize(7)
    b.commit(P[6:7])
    b.close()  # tail [P4, P5, P6] (coverage 3) replaces the shorter partial sibling
    ev = mgr.take_events()
    assert removed(ev) == [(kp, 0)]
    assert [(e.partial, [(x.key, x.lc, x.num_tokens) for x in e.blocks]) for e in of_kind(ev, "stored")] == [
        (True, [(kq, 0, 3)])
    ]
    assert attached_keys(mgr) == {keys(P[:4])[0], kq}
    assert mgr.probe_reuse(P[:7]) == 7
    assert mgr.probe_reuse(P[:6]) == 6
    assert counts(mgr) == (4, 2, 0, 0, 2)  # the detached partial's page was freed
    mgr.check_invariants()


def test_reattached_orphan_chain_is_announced_again(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, host=1))
    k = keys(P[:16])
    fill(mgr, P[:4], priority=10)  # gpu 0
    r = mgr.create_kv_cache()
    assert r.resume() and r.resize(16)
    assert r.page_indices(0) == [1, 2, 3, 0]  # block 0's tree page went to host
    r.close()
    b = mgr.create_kv_cache(priority=90)
    assert b.resume() and b.resize(12)
    b.commit(P[:12])  # keeps a private block-0 page (tree page on host)
    mgr.clear_reusable()  # block 0's page dropped: blocks 0-2 detached, b keeps them
    assert attached_keys(mgr) == set()
    mgr.take_events()
    assert b.resize(16)
    b.commit(P[12:16])  # re-attaches its chain (no equivalent blocks exist), then inserts
    st = stored(mgr.take_events())
    assert {(k[1], 0), (k[2], 0), (k[3], 0)} <= set(st)
    assert attached_keys(mgr) == set(k)
    assert orphan_keys(mgr) == []
    mgr.check_invariants()
