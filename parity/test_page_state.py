"""SPEC sec. 4: page ownership and the derived states LOCKED / HELD / DROPPABLE,
priority and last_used (observed through stats() slot counts and eviction choices)."""

from __future__ import annotations

from parity.helpers import GPU, HOST, attn_cfg, counts, fill, op, ops, ssm_cfg, toks

P = toks(8, base=100)
Q = toks(8, base=200)


def test_active_request_pages_are_locked(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    assert counts(mgr) == (4, 2, 2, 0, 0)  # uncommitted pages
    kv.commit(P[:8])
    assert counts(mgr) == (4, 2, 2, 0, 0)  # committed pages still used by the request
    mgr.check_invariants()


def test_suspended_request_pages_are_held(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:5])
    kv.suspend()
    assert counts(mgr) == (4, 2, 0, 2, 0)
    mgr.check_invariants()


def test_tree_only_pages_are_droppable(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:8])
    assert counts(mgr) == (4, 2, 0, 0, 2)
    mgr.check_invariants()


def test_page_used_by_active_and_suspended_requests_is_locked(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:8])
    a = mgr.create_kv_cache(P[:8])
    b = mgr.create_kv_cache(P[:4])
    assert counts(mgr) == (4, 2, 0, 2, 0)
    assert b.resume()
    assert counts(mgr) == (4, 2, 1, 1, 0)  # block 0 LOCKED (b active), block 1 HELD (a only)
    b.close()
    assert counts(mgr) == (4, 2, 0, 2, 0)
    a.close()
    assert counts(mgr) == (4, 2, 0, 0, 2)
    mgr.check_invariants()


def test_live_ssm_state_locked_held_then_freed(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert counts(mgr) == (4, 4, 0, 0, 0)
    assert kv.resume()
    assert counts(mgr) == (4, 3, 1, 0, 0)
    kv.suspend()
    assert counts(mgr) == (4, 3, 0, 1, 0)
    kv.close()
    assert counts(mgr) == (4, 4, 0, 0, 0)
    mgr.check_invariants()


def test_ssm_snapshot_is_droppable_at_once(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:4])
    assert counts(mgr) == (4, 2, 1, 0, 1)  # live LOCKED, snapshot owned by the tree alone
    kv.suspend()
    assert counts(mgr) == (4, 2, 0, 1, 1)
    mgr.check_invariants()


def test_locked_pages_are_never_moved_or_dropped(make_manager):
    mgr = make_manager(attn_cfg(gpu=1, host=1))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(4)
    a.commit(P[:4])
    b = mgr.create_kv_cache()
    assert b.resume()
    before = mgr.snapshot()
    assert b.resize(4) is False
    assert mgr.snapshot() == before
    assert ops(mgr) == []
    assert counts(mgr, GPU) == (1, 0, 1, 0, 0)
    mgr.check_invariants()


def test_committing_an_existing_block_raises_its_page_priority(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    fill(mgr, P[:4], priority=10)  # slot 0, priority 10
    b = mgr.create_kv_cache(priority=90)
    assert b.resume() and b.resize(4)
    b.commit(P[:4])  # switches to the tree page: priority 90
    b.close()
    fill(mgr, Q[:4], priority=50)  # slot 1
    c = mgr.create_kv_cache()
    assert c.resume() and c.resize(4)
    assert c.page_indices(0) == [1]
    assert mgr.probe_reuse(P[:4]) == 4 and mgr.probe_reuse(Q[:4]) == 0
    mgr.check_invariants()


def test_suspend_and_resume_do_not_touch_last_used(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=1))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(4)
    a.commit(P[:4])
    a.suspend()
    fill(mgr, Q[:4])  # slot 1, DROPPABLE, used later than a's page
    assert a.resume() is True
    a.suspend()
    c = mgr.create_kv_cache()
    assert c.resume() and c.resize(4)
    # a's HELD page is the least recently used: it moves to host (it cannot be dropped)
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload")]
    assert c.page_indices(0) == [0]
    assert mgr.probe_reuse(Q[:4]) == 4
    mgr.check_invariants()


def test_lowest_free_slot_is_handed_out_first(make_manager):
    mgr = make_manager(attn_cfg(gpu=6))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(24)
    assert a.page_indices(0) == [0, 1, 2, 3, 4, 5]
    assert a.resize(8)
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(8)
    assert b.page_indices(0) == [2, 3]
    b.close()
    assert a.resize(20)
    assert a.page_indices(0) == [0, 1, 2, 3, 4]
    mgr.check_invariants()


def test_create_holds_only_non_stale_window_pages(make_manager):
    from parity.helpers import win_cfg

    mgr = make_manager(win_cfg(gpu=4, window=4))
    fill(mgr, toks(12, base=100))
    assert counts(mgr) == (4, 1, 0, 0, 3)
    kv = mgr.create_kv_cache(toks(12, base=100))
    assert kv.num_committed_tokens == 12
    assert counts(mgr) == (4, 1, 0, 1, 2)  # history 12: blocks 0, 1 stale, only block 2 held
    assert kv.resume() is True
    assert counts(mgr) == (4, 1, 1, 0, 2)
    assert kv.page_indices(0) == [-1, -1, 2]
    mgr.check_invariants()


def test_create_holds_only_the_snapshot_at_the_match_end(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    fill(mgr, P[:8], chunks=[4, 4])  # snapshots of block 0 (slot 1) and block 1 (slot 2)
    assert ops(mgr) == [op(0, GPU, 0, GPU, 1, "snapshot"), op(0, GPU, 0, GPU, 2, "snapshot")]
    assert counts(mgr) == (4, 2, 0, 0, 2)
    kv = mgr.create_kv_cache(P[:8])
    assert counts(mgr) == (4, 2, 0, 1, 1)
    assert kv.resume() is True
    assert ops(mgr) == [op(0, GPU, 2, GPU, 0, "cow")]
    mgr.check_invariants()
