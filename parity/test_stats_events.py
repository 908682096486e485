"""SPEC sec. 9: stats (cumulative vs iteration, per-tier slot counts) and events."""

from __future__ import annotations

import itertools

from parity.helpers import (
    GPU,
    HOST,
    attn_cfg,
    counts,
    fill,
    hybrid_cfg,
    keys,
    lc_stats,
    of_kind,
    pool,
    removed,
    stored,
    stored_blocks,
    tier_changes,
    toks,
)

P = toks(16, base=100)
Q = toks(16, base=200)


def test_reuse_stats_count_attention_life_cycles_only(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=4))
    fill(mgr, P[:8])  # snapshot at 8
    mgr.take_iteration_stats()
    kv = mgr.create_kv_cache(P[:12])  # 3 query blocks, 2 reused
    assert kv.num_reused_tokens == 8
    st = mgr.stats()
    attn = lc_stats(st, 0)
    assert (attn["reused_blocks"], attn["missed_blocks"], attn["reused_tokens"]) == (2, 1, 8)
    ssm = lc_stats(st, 1)
    assert (ssm["reused_blocks"], ssm["missed_blocks"], ssm["reused_tokens"]) == (0, 0, 0)
    mgr.check_invariants()


def test_iteration_stats_reset_while_cumulative_stats_keep_counting(make_manager):
    mgr = make_manager(attn_cfg(gpu=8))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(12)
    it = mgr.take_iteration_stats()
    assert lc_stats(it, 0)["allocated_blocks"] == 3
    assert lc_stats(mgr.take_iteration_stats(), 0)["allocated_blocks"] == 0
    assert a.resize(16)
    assert lc_stats(mgr.take_iteration_stats(), 0)["allocated_blocks"] == 1
    assert lc_stats(mgr.stats(), 0)["allocated_blocks"] == 4
    # slot counts are a picture of now in both views
    assert pool(mgr.take_iteration_stats(), GPU, 0) == pool(mgr.stats(), GPU, 0)
    mgr.check_invariants()


def test_per_tier_slot_counts_follow_page_states(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, host=2))
    assert counts(mgr, GPU) == (4, 4, 0, 0, 0)
    assert counts(mgr, HOST) == (2, 2, 0, 0, 0)
    fill(mgr, P[:4])  # DROPPABLE
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(8)  # LOCKED x2
    b = mgr.create_kv_cache(P[:4])  # HELD x1 (the DROPPABLE page)
    assert counts(mgr, GPU) == (4, 1, 2, 1, 0)
    c = mgr.create_kv_cache()
    assert c.resume() and c.resize(4)  # takes the last free slot
    assert counts(mgr, GPU) == (4, 0, 3, 1, 0)
    b.close()
    assert counts(mgr, GPU) == (4, 0, 3, 0, 1)
    d = mgr.create_kv_cache()
    assert d.resume() and d.resize(4)  # P's page -> host
    assert counts(mgr, GPU) == (4, 0, 4, 0, 0)
    assert counts(mgr, HOST) == (2, 1, 0, 0, 1)
    mgr.check_invariants()


def test_stored_events_carry_key_tokens_lc_tier_priority(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=4))
    kv = mgr.create_kv_cache(priority=77)
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:8])  # ssm snapshot only for block 1
    k = keys(P[:8])
    ev = mgr.take_events()
    assert sorted(stored(ev)) == sorted([(k[0], 0), (k[1], 0), (k[1], 1)])
    for b in stored_blocks(ev):
        i = k.index(b.key)
        assert b.tokens == tuple(P[4 * i : 4 * i + 4])
        assert (b.tier, b.priority, b.coverage) == (GPU, 77, 4)
    assert all(e.partial is False for e in of_kind(ev, "stored"))
    parents = {b.key: e.parent_key for e in of_kind(ev, "stored") for b in e.blocks}
    assert parents[k[1]] == k[0]
    mgr.check_invariants()


def test_partial_blocks_announced_as_partial_stored(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:7])
    k = keys(P[:7])
    ev = of_kind(mgr.take_events(), "stored")
    got = [(e.partial, b.key, b.num_tokens, b.tokens) for e in ev for b in e.blocks]
    assert got == [(False, k[0], 4, tuple(P[:4])), (True, k[1], 3, tuple(P[4:7]))]
    assert ev[1].parent_key == k[0]
    mgr.check_invariants()


def test_event_ids_increase_monotonically(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=1))
    fill(mgr, P[:4])
    ids = [e.event_id for e in mgr.take_events()]
    fill(mgr, Q[:4])  # second gpu slot
    fill(mgr, P[4:12])  # P -> host, Q -> host (P dropped), two new blocks
    mgr.clear_reusable()
    ev = mgr.take_events()
    ids += [e.event_id for e in ev]
    assert {"stored", "tier_changed", "removed", "cleared"} <= {e.kind for e in ev}
    assert all(b == a + 1 for a, b in itertools.pairwise(ids))
    assert mgr.take_events() == []
    fill(mgr, Q[:4])
    assert mgr.take_events()[0].event_id == ids[-1] + 1
    mgr.check_invariants()


def test_removed_event_when_block_loses_its_last_page(make_manager):
    mgr = make_manager(attn_cfg(gpu=1))
    fill(mgr, P[:4])
    mgr.take_events()
    fill(mgr, Q[:4])  # P's only page dropped
    ev = mgr.take_events()
    assert [e.kind for e in ev] == ["removed", "stored"]
    assert removed(ev) == [(keys(P[:4])[0], 0)]
    mgr.check_invariants()


def test_tier_changed_events_on_offload_and_onboard(make_manager):
    mgr = make_manager(attn_cfg(gpu=1, host=1))
    kp = keys(P[:4])[0]
    fill(mgr, P[:4])
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(4)
    a.close()
    assert tier_changes(mgr.take_events()) == [(kp, 0, GPU, HOST)]
    b = mgr.create_kv_cache(P[:4])
    assert b.resume()
    assert tier_changes(mgr.take_events()) == [(kp, 0, HOST, GPU)]
    mgr.check_invariants()


def test_cleared_event_on_clear_reusable(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    mgr.clear_reusable()
    assert [e.kind for e in mgr.take_events()] == ["cleared"]
    fill(mgr, P[:4])
    mgr.take_events()
    mgr.clear_reusable()
    ev = mgr.take_events()
    assert sorted(e.kind for e in ev) == ["cleared", "removed"]  # relative order unspecified
    assert removed(ev) == [(keys(P[:4])[0], 0)]
    mgr.check_invariants()


def test_max_events_drops_oldest_and_counts(make_manager):
    mgr = make_manager(attn_cfg(gpu=8, max_events=2))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(16)
    for i in range(4):
        kv.commit(P[4 * i : 4 * i + 4])  # one stored event per block
    k = keys(P[:16])
    ev = mgr.take_events()
    assert stored(ev) == [(k[2], 0), (k[3], 0)]
    assert ev[1].event_id == ev[0].event_id + 1
    assert mgr.stats()["events_dropped"] == 2
    fill(mgr, Q[:4])
    ev2 = mgr.take_events()
    assert stored(ev2) == [(keys(Q[:4])[0], 0)]
    assert ev2[0].event_id == ev[1].event_id + 1  # ids keep counting over dropped events
    mgr.check_invariants()


def test_max_events_zero_buffers_nothing(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, max_events=0))
    fill(mgr, P[:4])
    mgr.clear_reusable()
    assert mgr.take_events() == []
    assert mgr.stats()["events_dropped"] == 3
    mgr.check_invariants()


def test_event_json_is_serialisable(make_manager):
    import json

    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, [1, bytes([9]) * 32, 3, 4, 5])
    mgr.clear_reusable()
    ev = mgr.take_events()
    data = json.loads(json.dumps([e.to_json() for e in ev]))
    assert [d["kind"] for d in data] == [e.kind for e in ev]
    assert [d["event_id"] for d in data] == [e.event_id for e in ev]
    blocks = [blk for d in data if d["kind"] == "stored" for blk in d["blocks"]]
    assert blocks and all(len(blk) == 7 for blk in blocks)  # [key, num_tokens, tokens, lc, tier, priority, coverage]
    assert [blk[6] for blk in blocks] == [blk[1] for blk in blocks]  # each page covers its whole block here
    mgr.check_invariants()


def test_stored_and_removed_events_mirror_the_tree(make_manager):
    from kvcm import AttentionLayer, KVCacheManagerConfig, SsmLayer, Tier

    from parity.helpers import announced

    cfg = KVCacheManagerConfig(
        tokens_per_block=4,
        layers=[AttentionLayer(0, 1), AttentionLayer(1, 1, window=4), SsmLayer(2, 4)],
        tiers=[Tier("gpu", 12 * 5), Tier("host", 12 * 2)],
    )
    mgr = make_manager(cfg)
    believed: set = set()
    kinds_seen = set()

    def consume():
        for e in mgr.take_events():
            kinds_seen.add(e.kind)
            if e.kind == "stored":
                for b in e.blocks:
                    assert (b.key, b.lc) not in believed, "stored twice without removed"
                    believed.add((b.key, b.lc))
            elif e.kind == "removed":
                for k in e.keys:
                    assert (k, e.lc) in believed, "removed without stored"
                    believed.discard((k, e.lc))
        assert believed == announced(mgr)
        mgr.check_invariants()

    base = toks(20, base=100)
    live = []
    for i in range(8):
        prompt = base[: 5 + 2 * i] if i % 3 else toks(6 + i, base=500 + 50 * i)
        kv = mgr.create_kv_cache(prompt, priority=30 + 10 * (i % 3))
        consume()
        if kv.resume():
            if kv.resize(len(prompt) + 1):
                kv.commit(prompt[kv.num_committed_tokens :])
                consume()
                if kv.resize(len(prompt) + 4, history_length=len(prompt) + 1):
                    consume()
            if i % 2:
                kv.suspend()
        consume()
        live.append(kv)
        if len(live) > 2:
            live.pop(0).close()
            consume()
        if i == 5:
            mgr.clear_reusable()
            consume()
    for kv in live:
        kv.close()
        consume()
    mgr.clear_reusable()
    consume()
    assert believed == set()
    assert {"stored", "removed", "cleared"} <= kinds_seen
    mgr.check_invariants()
