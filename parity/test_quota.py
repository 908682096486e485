"""SPEC sec. 18 set_quota (DECISIONS.md "Quotas at run time"): growing, shrinking in sec. 8
order, relocation of the survivors of the vanishing slots, refusals that change nothing."""

from __future__ import annotations

import pytest
from kvcm import InvalidStateError, KVCacheManagerConfig, OutOfPagesError, SsmLayer, Tier
from kvcm.api import AttentionLayer

from parity.helpers import (
    DISK,
    DISK_PATH,
    GPU,
    HOST,
    B,
    attn_cfg,
    counts,
    fill,
    hybrid_cfg,
    keys,
    of_kind,
    op,
    ops,
    removed,
    snap,
    tier_changes,
    toks,
    unchanged,
)

SLOT = B  # attn_cfg: one byte per token, a slot is B bytes


def _tier_entry(d: dict, key: str, tier: int) -> dict:
    (entry,) = [t for t in d[key] if t["tier"] == tier]
    return entry


def _active(mgr, n=B):
    kv = mgr.create_kv_cache()
    assert kv.resume() is True
    assert kv.resize(n) is True
    return kv


def test_set_quota_grow_adds_free_slots_at_the_top(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    a = _active(mgr)
    b = _active(mgr)
    assert (a.page_indices(0), b.page_indices(0)) == ([0], [1])
    assert _active(mgr, 0).resize(B) is False  # full
    clock = snap(mgr)["clock"]
    mgr.set_quota("gpu", 5 * SLOT)
    assert counts(mgr) == (5, 3, 2, 0, 0)
    assert ops(mgr) == [] and mgr.take_events() == []
    s = snap(mgr)
    assert s["clock"] == clock + 1
    assert _tier_entry(s, "pools", GPU)["quota_bytes"] == 5 * SLOT
    assert _tier_entry(s, "pools", GPU)["lc"][0]["free_slots"] == [2, 3, 4]
    assert _tier_entry(mgr.stats(), "tiers", GPU)["quota_bytes"] == 5 * SLOT
    c = _active(mgr)
    assert c.page_indices(0) == [2]  # the lowest free slot, one of the new ones
    mgr.check_invariants()


def test_set_quota_shrink_offloads_in_eviction_order_then_relocates(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, host=4))
    fill(mgr, toks(4, 100), priority=90)  # gpu 0
    fill(mgr, toks(4, 200), priority=10)  # gpu 1: first victim (lowest priority)
    fill(mgr, toks(4, 300), priority=50)  # gpu 2: second victim
    kv = _active(mgr)  # gpu 3, LOCKED
    mgr.drain_copy_ops()
    mgr.take_events()
    mgr.set_quota(GPU, 2 * SLOT)
    assert ops(mgr) == [
        op(0, GPU, 1, HOST, 0, "offload"),
        op(0, GPU, 2, HOST, 1, "offload"),
        op(0, GPU, 3, GPU, 1, "relocate"),  # the survivor of slots [2, 4) to the lowest free slot
    ]
    assert tier_changes(mgr.take_events()) == [
        (keys(toks(4, 200))[0], 0, GPU, HOST),
        (keys(toks(4, 300))[0], 0, GPU, HOST),
    ]  # a relocation announces nothing: events name no slot
    assert kv.page_indices(0) == [1]
    assert counts(mgr) == (2, 0, 1, 0, 1)
    assert counts(mgr, HOST) == (4, 2, 0, 0, 2)
    assert mgr.stats()["lc"][0]["relocations"] == 1
    assert mgr.stats()["lc"][0]["offloads"] == 2
    for t in (100, 200, 300):
        assert mgr.probe_reuse(toks(4, t)) == 4  # nothing lost: offloaded, not dropped
    mgr.check_invariants()


def test_set_quota_shrink_of_the_coldest_tier_drops(make_manager):
    mgr = make_manager(attn_cfg(gpu=3))
    fill(mgr, toks(4, 100))
    fill(mgr, toks(4, 200))
    fill(mgr, toks(4, 300))
    mgr.take_events()
    mgr.set_quota("gpu", 1 * SLOT)
    assert ops(mgr) == [op(0, GPU, 2, GPU, 0, "relocate")]
    assert removed(mgr.take_events()) == [(keys(toks(4, 100))[0], 0), (keys(toks(4, 200))[0], 0)]
    assert mgr.probe_reuse(toks(4, 300)) == 4 and mgr.probe_reuse(toks(4, 100)) == 0
    assert mgr.stats()["lc"][0]["drops"] == 2
    assert counts(mgr) == (1, 0, 0, 0, 1)
    mgr.check_invariants()


def test_set_quota_refuses_below_the_locked_pages_and_changes_nothing(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, host=4))
    _active(mgr, 2 * B)  # two LOCKED gpu pages
    fill(mgr, toks(4, 100))
    err = unchanged(mgr, lambda: mgr.set_quota("gpu", 1 * SLOT), OutOfPagesError)
    assert "set_quota('gpu', 4) refused, nothing changed" in str(err) and "2 LOCKED" in str(err)
    mgr.set_quota("gpu", 2 * SLOT)  # exactly the locked pages: the droppable one goes to host
    assert counts(mgr) == (2, 0, 2, 0, 0)
    mgr.check_invariants()


def test_set_quota_held_pages_need_a_colder_tier(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = _active(mgr, 2 * B)
    kv.suspend()  # two HELD gpu pages: no colder tier can take them
    err = unchanged(mgr, lambda: mgr.set_quota("gpu", 1 * SLOT), OutOfPagesError)
    assert "2 HELD that no colder tier can take" in str(err)

    mgr2 = make_manager(attn_cfg(gpu=4, host=1))
    kv2 = _active(mgr2, 2 * B)
    kv2.suspend()
    unchanged(mgr2, lambda: mgr2.set_quota("gpu", 0 * SLOT + 1), ValueError)  # no slot at all
    mgr2.set_quota("gpu", 1 * SLOT)  # one HELD page fits on host
    assert ops(mgr2) == [op(0, GPU, 1, HOST, 0, "offload")]  # the deeper block goes first (sec. 8)
    assert kv2.resume() is False  # one gpu slot cannot hold two pages: all or nothing
    mgr2.set_quota("gpu", 2 * SLOT)
    assert kv2.resume() is True
    assert ops(mgr2) == [op(0, HOST, 0, GPU, 1, "onboard")]
    assert kv2.page_indices(0) == [0, 1]
    mgr2.check_invariants()


def test_set_quota_of_host_offloads_held_pages_to_disk(make_manager):
    cfg = KVCacheManagerConfig(tokens_per_block=B, layers=[AttentionLayer(0, 1)],
                               tiers=[Tier("gpu", 1 * SLOT), Tier("host", 3 * SLOT), Tier("disk", 2 * SLOT, DISK_PATH)])
    mgr = make_manager(cfg)
    fill(mgr, toks(4, 100))  # gpu 0
    fill(mgr, toks(4, 200), priority=90)  # 100 -> host 0
    held = mgr.create_kv_cache(toks(4, 100))  # HELD on host
    assert held.num_committed_tokens == 4
    fill(mgr, toks(4, 300))  # 200 -> host 1
    mgr.drain_copy_ops()
    mgr.take_events()
    mgr.set_quota("host", 1 * SLOT)
    # the HELD page goes first (priority 50 < 90) and can: the disk takes it
    assert ops(mgr) == [op(0, HOST, 0, DISK, 0, "offload"), op(0, HOST, 1, HOST, 0, "relocate")]
    assert tier_changes(mgr.take_events()) == [(keys(toks(4, 100))[0], 0, HOST, DISK)]
    assert counts(mgr, HOST) == (1, 0, 0, 0, 1)
    assert counts(mgr, DISK) == (2, 1, 0, 1, 0)
    unchanged(mgr, lambda: mgr.set_quota(DISK, 0), ValueError)
    assert held.resume() is True  # disk -> gpu in one op
    assert ops(mgr)[-1] == op(0, DISK, 0, GPU, 0, "onboard")
    mgr.check_invariants()


def test_set_quota_splits_by_pool_ratio(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=4))  # 16-byte slots, ratio 2:1
    mgr.set_quota("gpu", 16 * 6)
    s = mgr.stats()
    assert [p["total"] for p in _tier_entry(s, "tiers", GPU)["lc"]] == [4, 2]
    mgr.set_quota("gpu", 16 * 30)
    assert [p["total"] for p in _tier_entry(mgr.stats(), "tiers", GPU)["lc"]] == [20, 10]
    mgr.check_invariants()


def test_set_quota_ssm_live_state_relocates(make_manager):
    mgr = make_manager(KVCacheManagerConfig(tokens_per_block=B, layers=[SsmLayer(0, 16)], tiers=[Tier("gpu", 4 * 16)]))
    kvs = [mgr.create_kv_cache() for _ in range(4)]
    for kv in kvs:
        assert kv.resume() is True
    kvs[0].close()
    kvs[1].close()
    mgr.set_quota("gpu", 2 * 16)
    assert ops(mgr) == [op(0, GPU, 2, GPU, 0, "relocate"), op(0, GPU, 3, GPU, 1, "relocate")]
    assert [kv.page_indices(0) for kv in kvs[2:]] == [[0], [1]]
    mgr.check_invariants()


BAD_TIERS = [("nvme", ValueError), ("shared", ValueError), ("host", ValueError), (1, ValueError), (7, ValueError),
             (-1, ValueError), (1.0, TypeError), (None, TypeError), (b"gpu", TypeError)]
BAD_BYTES = [(-1, ValueError), (2**63, ValueError), (3, ValueError), (1.5, TypeError), ("16", TypeError),
             (None, TypeError), (True, TypeError), (2**31 * SLOT, ValueError)]


@pytest.mark.parametrize(("tier", "exc"), BAD_TIERS, ids=[repr(t) for t, _ in BAD_TIERS])
def test_set_quota_bad_tier_changes_nothing(make_manager, tier, exc):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, toks(4, 100))
    err = unchanged(mgr, lambda: mgr.set_quota(tier, 2 * SLOT), exc)
    assert "set_quota" in str(err)


@pytest.mark.parametrize(("nbytes", "exc"), BAD_BYTES, ids=[repr(b) for b, _ in BAD_BYTES])
def test_set_quota_bad_bytes_changes_nothing(make_manager, nbytes, exc):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, toks(4, 100))
    err = unchanged(mgr, lambda: mgr.set_quota("gpu", nbytes), exc)
    assert "set_quota" in str(err)


def test_set_quota_on_a_shut_down_manager(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    mgr.shutdown()
    unchanged(mgr, lambda: mgr.set_quota("gpu", 8 * SLOT), InvalidStateError)


def test_set_quota_same_quota_only_ticks(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, toks(4, 100))
    before = snap(mgr)
    mgr.set_quota("gpu", 4 * SLOT)
    after = snap(mgr)
    assert after["clock"] == before["clock"] + 1
    assert {k: v for k, v in after.items() if k != "clock"} == {k: v for k, v in before.items() if k != "clock"}
    assert of_kind(mgr.take_events(), "cleared") == []
