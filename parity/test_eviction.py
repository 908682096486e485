"""SPEC sec. 8 (+ DECISIONS "All-or-nothing", "Eviction details"): eviction, tiers, copy ops."""

from __future__ import annotations

from kvcm import InvalidStateError, Status

from parity.helpers import (
    DISK,
    GPU,
    HOST,
    attn_cfg,
    counts,
    fill,
    keys,
    lc_stats,
    of_kind,
    op,
    ops,
    removed,
    stored_blocks,
    tier_changes,
    toks,
    unchanged,
)

P = toks(8, base=100)
Q = toks(8, base=200)
R = toks(8, base=300)


def _new_page(mgr, n=4, priority=None):
    kv = mgr.create_kv_cache(priority=priority)
    assert kv.resume() is True
    assert kv.resize(n) is True
    return kv


def test_eviction_drops_lowest_priority_first(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    fill(mgr, P[:4], priority=80)  # slot 0
    fill(mgr, Q[:4], priority=20)  # slot 1, more recent but lower priority
    mgr.take_events()
    c = _new_page(mgr)
    assert c.page_indices(0) == [1]
    assert mgr.probe_reuse(P[:4]) == 4 and mgr.probe_reuse(Q[:4]) == 0
    assert removed(mgr.take_events()) == [(keys(Q[:4])[0], 0)]
    assert ops(mgr) == []  # gpu is the coldest tier: dropped, no copy
    mgr.check_invariants()


def test_eviction_drops_least_recently_used_first(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    fill(mgr, P[:4])  # slot 0, older
    fill(mgr, Q[:4])  # slot 1
    c = _new_page(mgr)
    assert c.page_indices(0) == [0]
    assert mgr.probe_reuse(P[:4]) == 0 and mgr.probe_reuse(Q[:4]) == 4
    mgr.check_invariants()


def test_eviction_prefers_deeper_block_on_tie(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    fill(mgr, P[:8])  # both pages released by the same close: same priority and last_used
    c = _new_page(mgr)
    assert c.page_indices(0) == [1]  # block 1 (ordinal desc) goes first
    assert mgr.probe_reuse(P[:8]) == 4
    assert c.resize(8) is True
    assert c.page_indices(0) == [1, 0]
    assert mgr.probe_reuse(P[:8]) == 0
    mgr.check_invariants()


def test_reuse_raises_page_priority(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    fill(mgr, P[:4], priority=10)  # slot 0
    d = mgr.create_kv_cache(P[:4], priority=90)  # reuses the page: its priority becomes 90
    assert d.num_reused_tokens == 4
    d.close()
    fill(mgr, Q[:4], priority=50)  # slot 1, most recent
    c = _new_page(mgr, priority=50)
    assert c.page_indices(0) == [1]
    assert mgr.probe_reuse(P[:4]) == 4 and mgr.probe_reuse(Q[:4]) == 0
    mgr.check_invariants()


def test_reuse_refreshes_lru(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    fill(mgr, P[:4])  # slot 0
    fill(mgr, Q[:4])  # slot 1
    d = mgr.create_kv_cache(P[:4])  # starts (and then stops) using P's page
    d.close()
    c = _new_page(mgr)
    assert c.page_indices(0) == [1]
    assert mgr.probe_reuse(P[:4]) == 4 and mgr.probe_reuse(Q[:4]) == 0
    mgr.check_invariants()


def test_probe_does_not_refresh_lru(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    fill(mgr, P[:4])  # slot 0
    fill(mgr, Q[:4])  # slot 1
    assert mgr.probe_reuse(P[:4]) == 4
    assert mgr.probe_reuse_detail(P[:4]).num_tokens == 4
    c = _new_page(mgr)
    assert c.page_indices(0) == [0]  # P is still the least recently used
    mgr.check_invariants()


def test_offload_cascades_gpu_host_disk_with_copy_ops(make_manager):
    mgr = make_manager(attn_cfg(gpu=1, host=1, disk=1))
    kp, kq = keys(P[:4])[0], keys(Q[:4])[0]
    fill(mgr, P[:4])  # gpu 0
    fill(mgr, Q[:4])  # P: gpu 0 -> host 0
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload")]
    assert tier_changes(mgr.take_events()) == [(kp, 0, GPU, HOST)]
    c = _new_page(mgr)
    # Q must go to host, which is full: P moves host -> disk first, then Q gpu -> host
    assert ops(mgr) == [op(0, HOST, 0, DISK, 0, "offload"), op(0, GPU, 0, HOST, 0, "offload")]
    assert tier_changes(mgr.take_events()) == [(kp, 0, HOST, DISK), (kq, 0, GPU, HOST)]
    assert c.page_indices(0) == [0]
    assert mgr.probe_reuse(P[:4]) == 4 and mgr.probe_reuse(Q[:4]) == 4  # any tier counts
    assert counts(mgr, GPU) == (1, 0, 1, 0, 0)
    assert counts(mgr, HOST) == (1, 0, 0, 0, 1)
    assert counts(mgr, DISK) == (1, 0, 0, 0, 1)
    st = lc_stats(mgr.stats(), 0)
    assert (st["offloads"], st["offload_bytes"], st["drops"]) == (3, 12, 0)
    mgr.check_invariants()


def test_onboard_from_disk_goes_straight_to_gpu(make_manager):
    mgr = make_manager(attn_cfg(gpu=1, host=1, disk=1))
    fill(mgr, P[:4])
    fill(mgr, Q[:4])
    c = _new_page(mgr)
    c.close()  # nothing committed: gpu 0 free again
    mgr.drain_copy_ops()
    mgr.take_events()
    d = mgr.create_kv_cache(P[:4])
    assert d.num_committed_tokens == 4
    assert d.resume() is True
    assert ops(mgr) == [op(0, DISK, 0, GPU, 0, "onboard")]
    assert tier_changes(mgr.take_events()) == [(keys(P[:4])[0], 0, DISK, GPU)]
    assert d.page_indices(0) == [0]
    st = lc_stats(mgr.stats(), 0)
    assert (st["onboards"], st["onboard_bytes"]) == (1, 4)
    mgr.check_invariants()


def test_drop_at_coldest_tier_prunes_block(make_manager):
    mgr = make_manager(attn_cfg(gpu=1, host=1))
    fill(mgr, P[:4])
    fill(mgr, Q[:4])  # P -> host
    mgr.drain_copy_ops()
    mgr.take_events()
    _new_page(mgr)  # Q -> host, P dropped from host (coldest)
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload")]
    ev = mgr.take_events()
    assert removed(ev) == [(keys(P[:4])[0], 0)]
    assert tier_changes(ev) == [(keys(Q[:4])[0], 0, GPU, HOST)]
    assert mgr.probe_reuse(P[:4]) == 0 and mgr.probe_reuse(Q[:4]) == 4
    assert lc_stats(mgr.stats(), 0)["drops"] == 1
    mgr.check_invariants()


def test_held_pages_are_never_dropped(make_manager):
    mgr = make_manager(attn_cfg(gpu=1))
    a = _new_page(mgr)
    a.commit(P[:4])
    a.suspend()
    b = mgr.create_kv_cache()
    assert b.resume() is True
    before = mgr.snapshot()
    assert b.resize(4) is False
    assert mgr.snapshot() == before
    assert mgr.probe_reuse(P[:4]) == 4
    mgr.check_invariants()


def test_held_page_skipped_for_droppable_at_coldest_tier(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    a = _new_page(mgr)
    a.commit(P[:4])
    a.suspend()  # HELD, least recently used
    fill(mgr, Q[:4])  # DROPPABLE in slot 1
    c = _new_page(mgr)
    assert c.page_indices(0) == [1]
    assert mgr.probe_reuse(P[:4]) == 4 and mgr.probe_reuse(Q[:4]) == 0
    mgr.check_invariants()


def test_held_pages_move_colder_and_uncommitted_pages_too(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=2))
    a = _new_page(mgr, n=8)
    a.commit(P[:6])  # block 0 committed (slot 0), block 1 uncommitted (slot 1)
    a.suspend()
    assert counts(mgr) == (2, 0, 0, 2, 0)
    b = _new_page(mgr, n=8)
    assert ops(mgr) == [op(0, GPU, 1, HOST, 0, "offload"), op(0, GPU, 0, HOST, 1, "offload")]
    assert b.page_indices(0) == [1, 0]
    assert counts(mgr, HOST) == (2, 0, 0, 2, 0)
    assert tier_changes(mgr.take_events()) == [(keys(P[:4])[0], 0, GPU, HOST)]  # committed page only
    b.close()
    assert a.resume() is True
    assert sorted(o[2] for o in ops(mgr)) == [0, 1]
    assert a.page_indices(0) in ([0, 1], [1, 0])
    a.commit(P[6:8])
    assert mgr.probe_reuse(P[:8]) == 8
    mgr.check_invariants()


def test_resume_false_when_gpu_slots_run_out(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=2))
    fill(mgr, P[:8])
    a = mgr.create_kv_cache(P[:8])  # HELD on gpu 0, 1
    b = _new_page(mgr, n=8)  # pushes a's pages to host
    mgr.drain_copy_ops()
    before = mgr.snapshot()
    assert a.resume() is False
    assert mgr.snapshot() == before
    assert a.status is Status.SUSPENDED
    b.suspend()  # now b's pages can move to host... but host is full of a's HELD pages
    before = mgr.snapshot()
    assert a.resume() is False
    assert mgr.snapshot() == before
    b.close()
    assert a.resume() is True
    mgr.check_invariants()


def test_resume_false_when_max_util_exceeded(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, max_util_for_resume=0.5))
    a = _new_page(mgr, n=8)
    a.commit(P[:8])
    a.suspend()
    b = mgr.create_kv_cache(P[:8])
    assert b.resume() is True  # 2 LOCKED <= 0.5 * 4
    b.suspend()
    d = _new_page(mgr)  # 1 LOCKED (resize is not limited by max_util)
    before = mgr.snapshot()
    assert b.resume() is False  # 3 LOCKED > 2
    assert mgr.snapshot() == before
    assert b.status is Status.SUSPENDED
    d.close()
    assert b.resume() is True
    mgr.check_invariants()


def test_slot_freed_by_offload_is_destination_of_later_onboard(make_manager):
    mgr = make_manager(attn_cfg(gpu=1, host=2))
    fill(mgr, P[:4])  # gpu 0
    a = _new_page(mgr)  # P -> host 0; a's page gpu 0
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload")]
    a.suspend()
    b = mgr.create_kv_cache(P[:4])
    assert b.resume() is True
    assert ops(mgr) == [op(0, GPU, 0, HOST, 1, "offload"), op(0, HOST, 0, GPU, 0, "onboard")]
    assert b.page_indices(0) == [0]
    mgr.check_invariants()


def test_copy_ops_accumulate_in_order_until_drained(make_manager):
    mgr = make_manager(attn_cfg(gpu=1, host=2))
    fill(mgr, P[:4])
    fill(mgr, Q[:4])  # P -> host 0
    fill(mgr, R[:4])  # Q -> host 1
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload"), op(0, GPU, 0, HOST, 1, "offload")]
    assert mgr.drain_copy_ops() == []
    mgr.check_invariants()


def test_clear_reusable_drops_only_droppable_pages(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:4])  # DROPPABLE slot 0
    b = _new_page(mgr, n=8)
    b.commit(Q[:8])
    b.suspend()  # HELD slots 1, 2
    c = _new_page(mgr)  # LOCKED slot 3
    mgr.take_events()
    mgr.clear_reusable()
    ev = mgr.take_events()
    assert removed(ev) == [(keys(P[:4])[0], 0)]
    assert sorted(e.kind for e in ev) == ["cleared", "removed"]
    assert mgr.probe_reuse(P[:4]) == 0 and mgr.probe_reuse(Q[:8]) == 8
    assert counts(mgr) == (4, 1, 1, 2, 0)
    assert c.page_indices(0) == [3]
    assert lc_stats(mgr.stats(), 0)["drops"] == 1
    mgr.check_invariants()


def test_clear_reusable_clears_every_tier(make_manager):
    mgr = make_manager(attn_cfg(gpu=1, host=1, disk=1))
    fill(mgr, P[:4])
    fill(mgr, Q[:4])
    fill(mgr, R[:4])  # P on disk, Q on host, R on gpu
    mgr.clear_reusable()
    assert mgr.probe_reuse(P[:4]) == mgr.probe_reuse(Q[:4]) == mgr.probe_reuse(R[:4]) == 0
    for tier in (GPU, HOST, DISK):
        assert counts(mgr, tier) == (1, 1, 0, 0, 0)
    ev = mgr.take_events()
    assert sorted(removed(ev)) == sorted((keys(t[:4])[0], 0) for t in (P, Q, R))
    assert len(of_kind(ev, "cleared")) == 1
    mgr.check_invariants()


def test_shutdown_requires_all_caches_closed(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:4])
    kv = mgr.create_kv_cache(P[:4])
    unchanged(mgr, mgr.shutdown, InvalidStateError)
    kv.close()
    mgr.shutdown()
    mgr.check_invariants()


def test_lower_priority_page_offloaded_then_dropped_first(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=1))
    fill(mgr, P[:4], priority=30)  # slot 0
    fill(mgr, Q[:4], priority=70)  # slot 1
    _new_page(mgr)  # P (lower priority) -> host 0
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload")]
    _new_page(mgr)  # Q must go to host: P (host, DROPPABLE, coldest) is dropped first
    assert ops(mgr) == [op(0, GPU, 1, HOST, 0, "offload")]
    assert mgr.probe_reuse(P[:4]) == 0 and mgr.probe_reuse(Q[:4]) == 4
    mgr.check_invariants()


def test_droppable_victim_dropped_when_colder_tier_cannot_take_it(make_manager):
    mgr = make_manager(attn_cfg(gpu=1, host=1))
    a = _new_page(mgr)
    a.commit(P[:4])
    a.suspend()
    x = _new_page(mgr)  # a's HELD page -> host 0 (host is now full of a HELD page)
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload")]
    x.commit(Q[:4])
    x.close()  # Q's page DROPPABLE on gpu 0
    mgr.take_events()
    c = _new_page(mgr)  # Q cannot move to host (only a HELD page there): dropped instead
    assert ops(mgr) == []
    assert removed(mgr.take_events()) == [(keys(Q[:4])[0], 0)]
    assert c.page_indices(0) == [0]
    assert mgr.probe_reuse(Q[:4]) == 0 and mgr.probe_reuse(P[:4]) == 4
    mgr.check_invariants()


def test_held_victim_skipped_when_colder_tier_is_full(make_manager):
    mgr = make_manager(attn_cfg(gpu=1, host=1))
    a = _new_page(mgr)
    a.commit(P[:4])
    a.suspend()
    x = _new_page(mgr)  # a's page -> host 0
    x.commit(Q[:4])
    x.suspend()  # x's page HELD on gpu; host full of a's HELD page
    mgr.drain_copy_ops()
    c = mgr.create_kv_cache()
    assert c.resume() is True
    before = mgr.snapshot()
    assert c.resize(4) is False
    assert mgr.snapshot() == before
    mgr.check_invariants()


def test_resume_locks_pages_on_gpu_before_onboarding(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=2))
    fill(mgr, P[:8])  # gpu 0, 1
    fill(mgr, Q[:4], priority=90)  # P's block 1 -> host 0; Q's page gpu 1 (priority 90)
    assert ops(mgr) == [op(0, GPU, 1, HOST, 0, "offload")]
    b = mgr.create_kv_cache(P[:8])  # holds block 0 (gpu 0, priority 50) and block 1 (host 0)
    assert b.resume() is True
    # block 0 is LOCKED first, so the (higher-priority) Q page is the only victim
    assert ops(mgr) == [op(0, GPU, 1, HOST, 1, "offload"), op(0, HOST, 0, GPU, 1, "onboard")]
    assert b.page_indices(0) == [0, 1]
    assert mgr.probe_reuse(Q[:4]) == 4
    mgr.check_invariants()


def test_resume_onboards_before_copy_on_write(make_manager):
    mgr = make_manager(attn_cfg(gpu=3, host=2))
    fill(mgr, P[:6])  # block 0 gpu 0, partial [P4, P5] gpu 1
    r = _new_page(mgr, n=12)  # pushes the partial (ordinal 1) then block 0 to host
    assert r.page_indices(0) == [2, 1, 0]
    assert ops(mgr) == [op(0, GPU, 1, HOST, 0, "offload"), op(0, GPU, 0, HOST, 1, "offload")]
    r.close()
    b = mgr.create_kv_cache(P[:5] + [9])
    assert b.num_committed_tokens == 5
    assert b.resume() is True
    got = ops(mgr)
    assert [g[5] for g in got] == ["onboard", "onboard", "cow"]
    dst = {g[2]: g[4] for g in got[:2]}  # host slot -> gpu slot
    assert sorted(dst.values()) == [0, 1]
    assert got[2] == op(0, GPU, dst[0], GPU, 2, "cow")  # copies the onboarded partial page
    assert b.page_indices(0) == [dst[1], 2]
    mgr.check_invariants()


def _page_tiers(mgr) -> list[int]:
    return [p["tier"] for p in mgr.snapshot()["pages"]]


def test_gpu_disk_config_reports_disk_as_tier_2(make_manager):
    """SPEC sec. 1 numbers tiers by kind (DECISIONS "Tier numbers"): with no host tier the
    disk tier is still 2 in copy ops, events, stats and snapshot(), never its position 1."""
    mgr = make_manager(attn_cfg(gpu=1, disk=2))
    kp, kq = keys(P[:4])[0], keys(Q[:4])[0]
    fill(mgr, P[:4])  # gpu 0
    assert [b.tier for b in stored_blocks(mgr.take_events())] == [GPU]
    fill(mgr, Q[:4])  # P: gpu 0 -> disk 0
    assert ops(mgr) == [op(0, GPU, 0, DISK, 0, "offload")]
    ev = mgr.take_events()
    assert tier_changes(ev) == [(kp, 0, GPU, DISK)]
    assert [b.tier for b in stored_blocks(ev)] == [GPU]  # Q's block
    assert [t["tier"] for t in mgr.stats()["tiers"]] == [GPU, DISK]
    assert [t["kind"] for t in mgr.stats()["tiers"]] == ["gpu", "disk"]
    snap = mgr.snapshot()
    assert [(t["tier"], t["kind"]) for t in snap["pools"]] == [(GPU, "gpu"), (DISK, "disk")]
    assert sorted(_page_tiers(mgr)) == [GPU, DISK]
    assert counts(mgr, DISK) == (2, 1, 0, 0, 1)
    d = mgr.create_kv_cache(P[:4])  # P onboards disk -> gpu; Q goes gpu -> disk first
    assert d.resume() is True
    assert ops(mgr) == [op(0, GPU, 0, DISK, 1, "offload"), op(0, DISK, 0, GPU, 0, "onboard")]
    assert tier_changes(mgr.take_events()) == [(kq, 0, GPU, DISK), (kp, 0, DISK, GPU)]
    assert sorted(_page_tiers(mgr)) == [GPU, DISK]
    mgr.check_invariants()


def test_gpu_host_disk_config_tier_numbers_unchanged(make_manager):
    """With every tier present, SPEC's numbers are the config positions: 0, 1, 2."""
    mgr = make_manager(attn_cfg(gpu=1, host=1, disk=1))
    fill(mgr, P[:4])
    fill(mgr, Q[:4])
    fill(mgr, R[:4])  # P: host -> disk, Q: gpu -> host
    assert ops(mgr) == [op(0, GPU, 0, HOST, 0, "offload"), op(0, HOST, 0, DISK, 0, "offload"),
                        op(0, GPU, 0, HOST, 0, "offload")]  # fmt: skip
    assert [(t["tier"], t["kind"]) for t in mgr.stats()["tiers"]] == [(GPU, "gpu"), (HOST, "host"), (DISK, "disk")]
    assert [(t["tier"], t["kind"]) for t in mgr.snapshot()["pools"]] == [(GPU, "gpu"), (HOST, "host"), (DISK, "disk")]
    assert sorted(_page_tiers(mgr)) == [GPU, HOST, DISK]
    assert [counts(mgr, t)[4] for t in (GPU, HOST, DISK)] == [1, 1, 1]
    mgr.check_invariants()
