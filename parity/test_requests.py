"""SPEC sec. 7 (+ DECISIONS "API shape", "Status rules"): the request life cycle."""

from __future__ import annotations

import numpy as np
import pytest
from kvcm import ClosedError, InvalidStateError, Status

from parity.helpers import (
    GPU,
    HOST,
    attn_cfg,
    counts,
    fill,
    keys,
    of_kind,
    op,
    ops,
    removed,
    snap,
    ssm_cfg,
    stored,
    toks,
    win_cfg,
)

P = toks(16, base=100)


def test_create_matches_once_and_starts_suspended(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, default_priority=70))
    fill(mgr, P[:8])
    kv = mgr.create_kv_cache(P[:8] + [7, 8])
    assert kv.status is Status.SUSPENDED
    assert kv.num_committed_tokens == 8
    assert kv.committed_tokens == P[:8]
    assert kv.history_length == 8 and kv.capacity == 8
    assert kv.num_reused_tokens == 8
    assert kv.priority == 70
    assert mgr.drain_copy_ops() == []
    mgr.check_invariants()


def test_create_without_tokens_is_empty(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.status is Status.SUSPENDED
    assert (kv.capacity, kv.history_length, kv.num_committed_tokens, kv.num_reused_tokens) == (0, 0, 0, 0)
    assert kv.committed_tokens == []
    assert kv.resume() is True
    assert kv.status is Status.ACTIVE
    assert kv.page_indices(0) == []
    mgr.check_invariants()


def test_request_ids_default_to_counter_and_custom_ids_are_kept(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    a = mgr.create_kv_cache()
    b = mgr.create_kv_cache()
    assert (a.id, b.id) == (0, 1)
    c = mgr.create_kv_cache(id="req-x")
    d = mgr.create_kv_cache(id=77)
    assert (c.id, d.id) == ("req-x", 77)
    c.close()
    e = mgr.create_kv_cache(id="req-x")  # the closed cache's id may be reused
    assert e.id == "req-x"
    mgr.check_invariants()


def test_priority_defaults_to_config_and_is_kept(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, default_priority=33))
    assert mgr.create_kv_cache().priority == 33
    assert mgr.create_kv_cache(priority=0).priority == 0
    assert mgr.create_kv_cache(priority=100).priority == 100
    mgr.check_invariants()


def test_resume_locks_matched_pages_already_on_gpu_without_copies(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:8])  # tree pages in gpu slots 0, 1
    mgr.drain_copy_ops()
    kv = mgr.create_kv_cache(P[:8])
    assert counts(mgr) == (4, 2, 0, 2, 0)  # matched pages HELD by the suspended request
    assert kv.resume() is True
    assert counts(mgr) == (4, 2, 2, 0, 0)
    assert ops(mgr) == []
    assert kv.page_indices(0) == [0, 1]
    mgr.check_invariants()


def test_resume_copy_on_write_for_match_inside_a_block(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:6])  # block 0 -> slot 0; partial tail [P4, P5] -> slot 1 (coverage 2)
    mgr.drain_copy_ops()
    kv = mgr.create_kv_cache(P[:5] + [999])
    assert kv.num_committed_tokens == 5 and kv.committed_tokens == P[:5]
    assert kv.capacity == kv.history_length == 5
    assert kv.resume() is True
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]  # private copy in the lowest free slot
    assert kv.page_indices(0) == [0, 2]
    assert kv.resize(8) is True
    assert ops(mgr) == []
    kv.commit([999, 1000, 1001])
    k = keys(P[:5] + [999, 1000, 1001])
    assert stored(mgr.take_events())[-1] == (k[1], 0)
    assert mgr.probe_reuse(P[:6]) == 6  # the original partial block is untouched
    assert mgr.probe_reuse(P[:5] + [999, 1000, 1001]) == 8
    mgr.check_invariants()


def test_resume_copy_on_write_from_ssm_snapshot(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    fill(mgr, P[:8])  # live state slot 0, snapshot of block 1 -> slot 1; close frees slot 0
    assert ops(mgr) == [op(0, GPU, 0, GPU, 1, "snapshot")]
    kv = mgr.create_kv_cache(P[:12])
    assert kv.num_committed_tokens == 8
    assert kv.resume() is True
    assert kv.page_indices(0) == [0]  # live state in the lowest free slot
    assert ops(mgr) == [op(0, GPU, 1, GPU, 0, "cow")]
    mgr.check_invariants()


def test_suspend_makes_pages_held_and_resume_relocks_them(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume()
    assert kv.resize(8)
    kv.commit(P[:6])
    assert counts(mgr) == (4, 2, 2, 0, 0)
    kv.suspend()
    assert kv.status is Status.SUSPENDED
    assert counts(mgr) == (4, 2, 0, 2, 0)
    assert kv.resume() is True
    assert counts(mgr) == (4, 2, 2, 0, 0)
    assert kv.page_indices(0) == [0, 1]
    assert ops(mgr) == []
    mgr.check_invariants()


def test_resume_onboards_held_pages_from_host(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=2))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(8)
    a.commit(P[:8])
    a.suspend()
    k = keys(P[:8])
    mgr.take_events()
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(8) is True
    # both HELD pages have the same priority and last_used -> block 1 (ordinal desc) goes first
    assert ops(mgr) == [op(0, GPU, 1, HOST, 0, "offload"), op(0, GPU, 0, HOST, 1, "offload")]
    assert b.page_indices(0) == [1, 0]
    assert [e.kind for e in mgr.take_events()] == ["tier_changed", "tier_changed"]
    assert a.resume() is False  # gpu fully LOCKED by b
    b.close()
    assert a.resume() is True
    got = ops(mgr)
    assert sorted((o[0], o[1], o[2], o[3], o[5]) for o in got) == [
        (0, HOST, 0, GPU, "onboard"),
        (0, HOST, 1, GPU, "onboard"),
    ]
    dst = {o[2]: o[4] for o in got}  # host slot -> gpu slot
    assert a.page_indices(0) == [dst[1], dst[0]]
    assert sorted(dst.values()) == [0, 1]
    changes = [(e.key, e.old_tier, e.new_tier) for e in of_kind(mgr.take_events(), "tier_changed")]
    assert sorted(changes) == sorted([(k[0], HOST, GPU), (k[1], HOST, GPU)])
    assert counts(mgr, HOST) == (2, 2, 0, 0, 0)
    mgr.check_invariants()


def test_resize_grow_and_shrink_use_lowest_free_slot(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(12)
    assert a.page_indices(0) == [0, 1, 2]
    assert a.resize(4) is True
    assert a.page_indices(0) == [0]
    assert a.capacity == 4
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(4)
    assert b.page_indices(0) == [1]
    assert a.resize(12) is True
    assert a.page_indices(0) == [0, 2, 3]
    assert counts(mgr) == (4, 0, 4, 0, 0)
    mgr.check_invariants()


def test_resize_returns_false_on_out_of_pages_and_changes_nothing(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(4)
    before = mgr.snapshot()
    assert kv.resize(12) is False
    assert mgr.snapshot() == before
    assert kv.capacity == 4 and kv.page_indices(0) == [0]
    assert kv.resize(8) is True
    assert kv.page_indices(0) == [0, 1]
    mgr.check_invariants()


def test_resize_releases_stale_window_pages_to_tree(make_manager):
    mgr = make_manager(win_cfg(gpu=4, window=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:8])
    assert kv.history_length == 8
    assert kv.resize(12) is True  # history 8: stale [0, (9 - 4) // 4) = [0, 1)
    assert kv.page_indices(0) == [-1, 1, 2]
    assert counts(mgr) == (4, 1, 2, 0, 1)  # block 0's page stays in the tree, DROPPABLE
    assert mgr.probe_reuse(P[:8]) == 8
    assert kv.resize(12, history_length=12) is True  # stale [0, 2)
    assert kv.page_indices(0) == [-1, -1, 2]
    assert kv.history_length == 12
    assert counts(mgr) == (4, 1, 1, 0, 2)
    mgr.check_invariants()


def test_commit_inserts_new_blocks_and_raises_history(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache(priority=60)
    assert kv.resume() and kv.resize(12)
    kv.commit(P[:3])
    assert kv.num_committed_tokens == 3 and kv.history_length == 3
    assert mgr.take_events() == []
    kv.commit(P[3:9])
    assert kv.history_length == 9 and kv.committed_tokens == P[:9]
    k = keys(P[:8])
    ev = mgr.take_events()
    assert stored(ev) == [(k[0], 0), (k[1], 0)]
    blocks = [b for e in of_kind(ev, "stored") for b in e.blocks]
    assert [(b.tier, b.priority, b.tokens) for b in blocks] == [(GPU, 60, tuple(P[:4])), (GPU, 60, tuple(P[4:8]))]
    assert mgr.probe_reuse(P[:12]) == 8
    mgr.check_invariants()


def test_commit_of_existing_block_switches_to_tree_page_on_gpu(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:4])  # tree page in slot 0, DROPPABLE
    mgr.take_events()
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(4)
    assert b.page_indices(0) == [1]
    b.commit(P[:4])
    assert b.page_indices(0) == [0]  # switched to the tree page, own page freed
    assert mgr.take_events() == []
    assert counts(mgr) == (4, 3, 1, 0, 0)
    c = mgr.create_kv_cache()
    assert c.resume() and c.resize(4)
    assert c.page_indices(0) == [1]
    mgr.check_invariants()


def test_commit_of_existing_block_installs_page_when_tree_has_none(make_manager):
    mgr = make_manager(win_cfg(gpu=4, window=4))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(8)
    a.commit(P[:8])
    assert a.resize(12) and a.page_indices(0) == [-1, 1, 2]
    mgr.clear_reusable()  # drops block 0's (stale, DROPPABLE) page; block 0 stays: it has a child
    k = keys(P[:8])
    assert (k[0], 0) in removed(mgr.take_events())
    assert mgr.probe_reuse(P[:4]) == 0
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(8)
    assert b.page_indices(0) == [0, 3]
    b.commit(P[:8])
    assert stored(mgr.take_events()) == [(k[0], 0)]  # b's page installed; block 1 already has one
    assert b.page_indices(0)[1] == 1  # switched to a's LOCKED tree page of block 1
    assert mgr.probe_reuse(P[:4]) == 4
    c = mgr.create_kv_cache()
    assert c.resume() and c.resize(4)
    assert c.page_indices(0) == [3]  # b's own block-1 page was freed
    mgr.check_invariants()


def test_commit_of_existing_block_off_gpu_keeps_private_page(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=2))
    fill(mgr, P[:4])  # tree page gpu 0
    r = mgr.create_kv_cache()
    assert r.resume() and r.resize(8)
    assert r.page_indices(0) == [1, 0]
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload")]
    r.close()  # nothing committed: both pages freed
    mgr.take_events()
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(4)
    assert b.page_indices(0) == [0]
    b.commit(P[:4])  # tree page is on host -> b keeps its own page privately
    assert b.page_indices(0) == [0]
    assert mgr.take_events() == []
    assert counts(mgr, HOST) == (2, 1, 0, 0, 1)
    b.close()  # the private page is freed
    assert counts(mgr, GPU) == (2, 2, 0, 0, 0)
    c = mgr.create_kv_cache(P[:4])
    assert c.num_committed_tokens == 4
    assert c.resume() is True
    assert ops(mgr) == [op(0, HOST, 0, GPU, 0, "onboard")]
    assert c.page_indices(0) == [0]
    mgr.check_invariants()


def test_ssm_snapshot_only_when_commit_ends_at_block_boundary(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(12)
    assert kv.page_indices(0) == [0]
    kv.commit(P[:6])  # block 0 filled in the middle of the commit: no snapshot
    assert ops(mgr) == []
    kv.commit(P[6:8])  # ends at 8: block 1 gets a snapshot
    assert ops(mgr) == [op(0, GPU, 0, GPU, 1, "snapshot")]
    assert mgr.probe_reuse(P[:8]) == 8
    assert mgr.probe_reuse(P[:4]) == 0
    kv.commit(P[8:10])
    kv.commit(P[10:12])
    assert ops(mgr) == [op(0, GPU, 0, GPU, 2, "snapshot")]
    assert mgr.probe_reuse(P[:12]) == 12
    assert mgr.probe_reuse(P[:11]) == 8
    assert counts(mgr) == (4, 1, 1, 0, 2)  # live state LOCKED, snapshots DROPPABLE at once
    mgr.check_invariants()


def test_blocks_filled_mid_commit_get_no_snapshot(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(12)
    kv.commit(P[:12])
    assert ops(mgr) == [op(0, GPU, 0, GPU, 1, "snapshot")]
    assert mgr.probe_reuse(P[:4]) == 0
    assert mgr.probe_reuse(P[:8]) == 0
    assert mgr.probe_reuse(P[:12]) == 12
    mgr.check_invariants()


def test_no_snapshot_when_block_already_covered(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    fill(mgr, P[:8])  # snapshot of block 1 in slot 1
    assert ops(mgr) == [op(0, GPU, 0, GPU, 1, "snapshot")]
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:8])
    assert ops(mgr) == []
    assert mgr.stats()["lc"][0]["snapshots_taken"] == 1
    assert mgr.stats()["lc"][0]["snapshots_skipped"] == 0
    mgr.check_invariants()


def test_snapshot_skipped_and_counted_when_no_slot(make_manager):
    mgr = make_manager(ssm_cfg(gpu=1))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:4])  # the only slot holds the LOCKED live state
    assert ops(mgr) == []
    assert mgr.stats()["lc"][0]["snapshots_skipped"] == 1
    assert mgr.stats()["lc"][0]["snapshots_taken"] == 0
    assert mgr.probe_reuse(P[:4]) == 0
    kv.commit(P[4:8])
    assert mgr.stats()["lc"][0]["snapshots_skipped"] == 2
    mgr.check_invariants()


def test_stop_committing_inserts_partial_tail(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:6])
    mgr.take_events()
    assert mgr.probe_reuse(P[:6]) == 4
    kv.stop_committing()
    ev = of_kind(mgr.take_events(), "stored")
    k = keys(P[:6])
    assert [(e.partial, [(b.key, b.lc, b.tokens) for b in e.blocks]) for e in ev] == [(True, [(k[1], 0, (P[4], P[5]))])]
    assert mgr.probe_reuse(P[:6]) == 6
    assert mgr.probe_reuse(P[:5] + [5]) == 5
    assert kv.status is Status.ACTIVE
    assert kv.page_indices(0) == [0, 1]
    with pytest.raises(InvalidStateError):
        kv.commit([1])
    mgr.check_invariants()


def test_stop_committing_snapshots_live_state_with_tail_coverage(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(6)
    kv.commit(P[:6])
    assert ops(mgr) == []
    kv.stop_committing()
    assert ops(mgr) == [op(0, GPU, 0, GPU, 1, "snapshot")]
    ev = of_kind(mgr.take_events(), "stored")
    assert [(b.key, b.lc) for e in ev if e.partial for b in e.blocks] == [(keys(P[:6])[1], 0)]
    assert mgr.probe_reuse(P[:6]) == 6
    assert mgr.probe_reuse(P[:6] + [1, 2]) == 6
    assert mgr.probe_reuse(P[:5]) == 0  # the snapshot sits at position 6, past the match
    mgr.check_invariants()


def test_stop_committing_without_partial_reuse_inserts_nothing(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, enable_partial_reuse=False))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:6])
    mgr.take_events()
    kv.stop_committing()
    assert mgr.take_events() == []
    assert mgr.probe_reuse(P[:6]) == 4
    kv.close()
    assert counts(mgr) == (4, 3, 0, 0, 1)  # the uncommitted tail page is freed
    mgr.check_invariants()


def test_close_releases_everything_and_is_idempotent(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(12)
    kv.commit(P[:6])
    assert counts(mgr) == (4, 1, 3, 0, 0)
    kv.close()
    assert kv.status is Status.CLOSED
    # block 0 and the partial tail stay in the tree; the unused third page is freed
    assert counts(mgr) == (4, 2, 0, 0, 2)
    assert mgr.probe_reuse(P[:6]) == 6
    before = mgr.snapshot()
    kv.close()
    assert mgr.snapshot() == before
    mgr.check_invariants()


def test_close_of_suspended_cache_releases_held_pages(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:8])
    kv = mgr.create_kv_cache(P[:8])
    assert counts(mgr) == (4, 2, 0, 2, 0)
    kv.close()
    assert counts(mgr) == (4, 2, 0, 0, 2)
    mgr.check_invariants()


def test_page_indices_into_writes_numpy_int32(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(12)
    out = np.full(5, -7, dtype=np.int32)
    assert kv.page_indices_into(0, out) == 3
    assert out[:3].tolist() == [0, 1, 2]
    exact = np.zeros(3, dtype=np.int32)
    assert kv.page_indices_into(0, exact) == 3
    assert exact.tolist() == [0, 1, 2]
    mgr.check_invariants()


def test_page_indices_minus_one_for_stale_window_blocks(make_manager):
    mgr = make_manager(win_cfg(gpu=8, window=5, sinks=2))
    # nsink = ceil(2 / 4) = 1; stale at history h: [1, max(1, (h + 1 - 5) // 4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(16)
    kv.commit(P[:13])
    assert kv.resize(16, history_length=13) is True  # stale [1, (14 - 5) // 4) = [1, 2)
    assert kv.page_indices(0) == [0, -1, 2, 3]
    assert kv.resize(20, history_length=16) is True  # stale [1, (17 - 5) // 4) = [1, 3)
    # block 2's page stays in the tree (DROPPABLE): the new block 4 gets the lowest free slot
    assert kv.page_indices(0) == [0, -1, -1, 3, 4]
    out = np.zeros(8, dtype=np.int32)
    assert kv.page_indices_into(0, out) == 5
    assert out[:5].tolist() == [0, -1, -1, 3, 4]
    mgr.check_invariants()


def test_ssm_page_indices_is_the_live_slot(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    a = mgr.create_kv_cache()
    assert a.resume()
    b = mgr.create_kv_cache()
    assert b.resume()
    assert a.page_indices(0) == [0]
    assert b.page_indices(0) == [1]
    assert b.resize(40) is True  # ssm has no per-block pages
    assert b.page_indices(0) == [1]
    out = np.zeros(1, dtype=np.int32)
    assert b.page_indices_into(0, out) == 1 and out.tolist() == [1]
    mgr.check_invariants()


def test_copy_on_write_only_on_first_resume(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:6])
    mgr.drain_copy_ops()
    kv = mgr.create_kv_cache(P[:5])
    assert kv.resume() is True
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    kv.suspend()
    assert kv.resume() is True
    assert ops(mgr) == []
    assert kv.page_indices(0) == [0, 2]
    mgr.check_invariants()


def test_stop_committing_while_suspended_commits_tail_where_it_is(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=2))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(8)
    a.commit(P[:6])
    a.suspend()
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(8)  # both of a's HELD pages go to host
    assert counts(mgr, HOST) == (2, 0, 0, 2, 0)
    mgr.take_events()
    a.stop_committing()
    ev = of_kind(mgr.take_events(), "stored")
    assert [(e.partial, [(b_.key, b_.tier) for b_ in e.blocks]) for e in ev] == [(True, [(keys(P[:6])[1], HOST)])]
    assert mgr.probe_reuse(P[:6]) == 6
    mgr.check_invariants()


def test_stop_committing_while_suspended_skips_snapshot_of_offloaded_live_state(make_manager):
    mgr = make_manager(ssm_cfg(gpu=1, host=1))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(6)
    a.commit(P[:6])
    a.suspend()
    b = mgr.create_kv_cache()
    assert b.resume() is True  # a's live state (HELD) -> host
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload")]
    a.stop_committing()
    assert ops(mgr) == []
    assert mgr.stats()["lc"][0]["snapshots_skipped"] == 1
    assert mgr.probe_reuse(P[:6]) == 0
    b.close()
    assert a.resume() is True
    assert ops(mgr) == [op(0, HOST, 0, GPU, 0, "onboard")]
    mgr.check_invariants()


def test_resize_reuses_pages_it_releases_as_stale(make_manager):
    mgr = make_manager(win_cfg(gpu=3, window=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(12)
    kv.commit(P[:12])
    assert kv.page_indices(0) == [-1, -1, 2]  # stale at history 12 -> -1
    mgr.take_events()
    # history 12: blocks 0, 1 become stale; their pages are released first, then the
    # deeper one (same priority and last_used) is dropped to make room for block 3
    assert kv.resize(16) is True
    assert kv.page_indices(0) == [-1, -1, 2, 1]
    assert removed(mgr.take_events()) == [(keys(P[:8])[1], 0)]
    assert mgr.probe_reuse(P[:12]) == 12
    mgr.check_invariants()


def test_numpy_and_array_tokens_are_accepted(make_manager):
    from array import array

    mgr = make_manager(attn_cfg(gpu=8))
    fill(mgr, P[:8])
    a = mgr.create_kv_cache(np.array(P[:8], dtype=np.int64))
    assert a.num_committed_tokens == 8 and a.committed_tokens == P[:8]
    assert all(type(t) is int for t in a.committed_tokens)
    b = mgr.create_kv_cache(array("i", P[:6]))
    assert b.num_committed_tokens == 6
    assert mgr.probe_reuse(np.array(P[:8], dtype=np.int32)) == 8
    assert b.resume() and b.resize(12)
    b.commit(np.array(P[6:12], dtype=np.int32))
    assert b.committed_tokens == P[:12]
    assert mgr.probe_reuse(P[:12]) == 12
    mgr.check_invariants()


def _prompt_run(mgr, prompt, how: str, partial_at: int):
    """One request committing ``prompt`` (partly matched) either as token lists or through
    commit_input; returns what an engine and an observer see."""
    kv = mgr.create_kv_cache(prompt)
    assert kv.resume() and kv.resize(len(prompt) + 2)
    c = kv.num_committed_tokens
    if how == "tokens":
        kv.commit(prompt[c:partial_at])
        kv.commit(prompt[partial_at:])
    else:
        kv.commit_input(partial_at - c)
        kv.commit_input()
    kv.commit([5, 6])  # decode after the prompt: a plain commit continues where it ended
    out = (kv.committed_tokens, kv.history_length, mgr.take_events(), mgr.drain_copy_ops(), kv.page_indices(0))
    kv.close()
    return out, snap(mgr)


def test_commit_input_is_commit_of_the_input_tokens(make_manager):
    """DECISIONS "commit_input": the same state, events and snapshots as committing the
    same tokens by list (a reused prefix, a mid-block split, a decode continuation)."""
    runs = []
    for how in ("tokens", "input"):
        mgr = make_manager(attn_cfg(gpu=16))
        fill(mgr, P[:6])  # a partial match: copy-on-write of block 1
        runs.append(_prompt_run(mgr, P[:14], how, partial_at=9))
    assert runs[0] == runs[1]


def test_commit_input_checks_change_nothing(make_manager):
    mgr = make_manager(attn_cfg(gpu=8))
    kv = mgr.create_kv_cache(P[:6])
    with pytest.raises(InvalidStateError, match=r"commit_input\(\) needs a ACTIVE cache"):
        kv.commit_input(1)
    assert kv.resume() and kv.resize(5)
    before = snap(mgr)
    for bad, exc, msg in [
        (-1, ValueError, "n must be >= 0"),
        ("2", TypeError, "n must be an int, got str"),
        (True, TypeError, "n must be an int, got bool"),
        (6, ValueError, r"commit of 6 tokens exceeds capacity 5 \(0 committed\)"),
        (None, ValueError, r"commit of 6 tokens exceeds capacity 5"),
    ]:
        with pytest.raises(exc, match=msg):
            kv.commit_input(bad)
        assert snap(mgr) == before
    assert kv.resize(8)
    with pytest.raises(ValueError, match=r"commit_input of 7 tokens exceeds the input \(6 input tokens, 0 committed\)"):
        kv.commit_input(7)
    kv.commit_input(4)
    kv.commit_input()
    assert kv.committed_tokens == P[:6]
    kv.commit_input()  # nothing left: a no-op
    kv.commit_input(0)
    assert kv.num_committed_tokens == 6
    kv.stop_committing()
    with pytest.raises(InvalidStateError, match=r"commit after stop_committing\(\)"):
        kv.commit_input(0)
    kv.close()
    with pytest.raises(ClosedError, match=r"commit_input\(\) on a closed cache"):
        kv.commit_input(1)
    with pytest.raises(TypeError):
        kv.commit_input("x")  # the argument is checked first, even on a closed cache
    mgr.check_invariants()
