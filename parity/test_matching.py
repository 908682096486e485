"""SPEC sec. 6: matching (full blocks, partial reuse, backoff, ssm rule, windowed stale
blocks, fixed point) and the side-effect-free probes."""

from __future__ import annotations

from kvcm import ReuseProbe, ReuseScope

from parity.helpers import (
    DISK,
    GPU,
    HOST,
    attn_cfg,
    fill,
    hybrid_cfg,
    keys,
    op,
    ops,
    probe_then_create,
    snap,
    ssm_cfg,
    toks,
    win_cfg,
)

P = toks(16, base=100)
Q = toks(16, base=200)


def test_full_block_match_without_partial_reuse(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, enable_partial_reuse=False))
    fill(mgr, P[:8])
    assert mgr.probe_reuse(P[:8]) == 8
    assert mgr.probe_reuse(P[:7]) == 4  # block 1 is not a full-key match
    assert mgr.probe_reuse(P[:3]) == 0
    assert mgr.probe_reuse(P[:8] + [1, 2]) == 8
    assert mgr.probe_reuse(P[:4] + [1, 2, 3, 4]) == 4
    kv = mgr.create_kv_cache(P[:7])
    assert kv.num_committed_tokens == 4 and kv.num_reused_tokens == 4
    mgr.check_invariants()


def test_partial_reuse_takes_longest_common_run(make_manager):
    mgr = make_manager(attn_cfg(gpu=8))
    fill(mgr, P[:8])  # block 1 = P4 P5 P6 P7
    fill(mgr, P[:4] + [P[4], P[5], 900, 901])  # sibling sharing two tokens
    assert mgr.probe_reuse(P[:4] + [P[4], P[5], P[6], 555]) == 7
    assert mgr.probe_reuse(P[:4] + [P[4], P[5], 900]) == 7
    assert mgr.probe_reuse(P[:4] + [P[4], 77]) == 5
    assert mgr.probe_reuse(P[:4] + [P[4], P[5], 0, 0, 0]) == 6
    mgr.check_invariants()


def test_partial_reuse_tie_broken_by_smaller_key(make_manager):
    mgr = make_manager(attn_cfg(gpu=8))
    x = P[:4] + [P[4], P[5], 900, 901]
    y = P[:4] + [P[4], P[5], 800, 801]
    fill(mgr, x)  # block 0 slot 0, x's block 1 slot 1
    fill(mgr, y)  # slots 2, 3 allocated; block 0 switches to slot 0 -> y's block 1 in slot 3
    mgr.drain_copy_ops()
    query = P[:4] + [P[4], P[5], 0, 0]
    assert mgr.probe_reuse(query) == 6
    kv = mgr.create_kv_cache(query)
    assert kv.resume() is True
    src = 1 if keys(x)[1] < keys(y)[1] else 3
    assert ops(mgr) == [op(0, GPU, src, GPU, 2, "cow")]
    mgr.check_invariants()


def test_partial_reuse_needs_one_common_token(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:8])
    assert mgr.probe_reuse(P[:4] + [999, P[5]]) == 4
    assert mgr.probe_reuse([999] + P[1:8]) == 0
    assert mgr.probe_reuse(P[:1]) == 1
    mgr.check_invariants()


def test_backoff_subtracts_tokens(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, reuse_match_backoff=3))
    fill(mgr, P[:8])
    mgr.drain_copy_ops()
    assert mgr.probe_reuse(P[:8]) == 5
    assert mgr.probe_reuse(P[:4]) == 1
    assert mgr.probe_reuse(P[:3]) == 0
    kv = mgr.create_kv_cache(P[:8])
    assert kv.num_committed_tokens == 5
    assert kv.resume() is True
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]  # the match ends inside block 1
    assert kv.page_indices(0) == [0, 2]
    mgr.check_invariants()


def test_backoff_is_applied_before_ssm_rule(make_manager):
    mgr = make_manager(ssm_cfg(gpu=8, reuse_match_backoff=1))
    fill(mgr, P[:8], chunks=[4, 4])  # snapshots at 4 and 8
    assert mgr.probe_reuse(P[:8]) == 4  # 8 - 1 = 7 -> last snapshot at or before 7
    assert mgr.probe_reuse(P[:4]) == 0
    assert mgr.probe_reuse(P[:8] + [1]) == 4
    mgr.check_invariants()


def test_ssm_match_ends_exactly_at_a_snapshot(make_manager):
    mgr = make_manager(ssm_cfg(gpu=8))
    fill(mgr, P[:12], chunks=[4, 8])  # snapshots at 4 and 12 (block 1 filled mid-commit)
    assert mgr.probe_reuse(P[:12]) == 12
    assert mgr.probe_reuse(P[:11]) == 4
    assert mgr.probe_reuse(P[:8]) == 4
    assert mgr.probe_reuse(P[:5]) == 4
    assert mgr.probe_reuse(P[:3]) == 0
    assert mgr.probe_reuse_detail(P[:11]) == ReuseProbe(4, 11, (GPU,))  # the snapshot at 4
    kv = mgr.create_kv_cache(P[:11])
    assert kv.num_committed_tokens == 4
    mgr.check_invariants()


def test_windowed_stale_blocks_need_no_page(make_manager):
    mgr = make_manager(win_cfg(gpu=4, window=4))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(8)
    a.commit(P[:8])
    assert a.resize(12)  # block 0 stale at history 8 -> DROPPABLE
    mgr.clear_reusable()  # block 0 loses its page
    assert mgr.probe_reuse(P[:8]) == 8  # history 8: block 0 stale, block 1 has its page
    assert mgr.probe_reuse(P[:7]) == 7  # history 7: stale [0, (8 - 4) // 4) = [0, 1)
    assert mgr.probe_reuse(P[:6]) == 0  # history 6: block 0 needed, no page -> cut to 0
    assert mgr.probe_reuse(P[:4]) == 0
    mgr.check_invariants()


def test_match_prunes_to_fixed_point_across_ssm_and_window(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=4, ssm_gpu=4, window=4))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(16)
    a.commit(P[:8])  # snapshot at 8 (block 1)
    a.commit(P[8:13])  # block 2 filled mid-commit: no snapshot
    assert a.resize(16, history_length=13)  # stale [0, 2): blocks 0, 1 -> DROPPABLE
    assert a.page_indices(0) == [-1, -1, 2, 3]
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(8)  # evicts the window pages of blocks 0 and 1
    assert sorted(b.page_indices(0)) == [0, 1]
    # attention alone: history 12, blocks 0-1 stale, block 2 has its page -> 12.
    # ssm -> 8; window at 8 needs block 1 -> 4; ssm at 4: no snapshot -> 0.
    assert mgr.probe_reuse_detail(P[:12]) == ReuseProbe(0, 12)
    assert mgr.probe_reuse_detail(P[:13]) == ReuseProbe(0, 12)
    mgr.check_invariants()


def test_probe_detail_separates_ssm_from_attention(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=4))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(8)
    a.commit(P[:6])  # block 0 inserted without a snapshot
    assert mgr.probe_reuse_detail(P[:6]) == ReuseProbe(0, 4)
    assert mgr.probe_reuse_detail(P[:8]) == ReuseProbe(0, 4)
    a.commit(P[6:8])  # ends at 8: snapshot of block 1
    assert mgr.probe_reuse_detail(P[:8]) == ReuseProbe(8, 8, (GPU, GPU))
    assert mgr.probe_reuse_detail(P[:7]) == ReuseProbe(0, 7)
    assert mgr.probe_reuse(P[:8]) == 8
    mgr.check_invariants()


def test_probe_has_no_side_effects(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=2))
    fill(mgr, P[:8])
    fill(mgr, Q[:4])  # P's block 1 offloaded to host
    kv = mgr.create_kv_cache(Q[:4])
    before = snap(mgr)
    stats_before = mgr.stats()
    for t in (P[:8], P[:6], Q[:8], [], P[:8] + Q[:3]):
        mgr.probe_reuse(t)
        mgr.probe_reuse_detail(t)
        mgr.probe_reuse(t, ReuseScope(lora_id=1))
    assert snap(mgr) == before
    assert mgr.stats() == stats_before
    assert mgr.probe_reuse(P[:8]) == 8  # host pages count as reusable
    assert kv.num_committed_tokens == 4
    mgr.check_invariants()


def test_probe_empty_tree_and_empty_tokens(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))
    assert mgr.probe_reuse(P[:8]) == 0
    assert mgr.probe_reuse([]) == 0
    assert mgr.probe_reuse_detail([]) == ReuseProbe(0, 0)
    fill(mgr, P[:4])
    assert mgr.probe_reuse([]) == 0
    assert mgr.probe_reuse(P[:4], ReuseScope(salt=9)) == 0
    mgr.check_invariants()


def test_match_of_digest_tokens(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    d1, d2 = bytes([1]) * 32, bytes([2]) * 32
    t = [1, d1, 2, d2, 3, 4]
    fill(mgr, t)
    assert mgr.probe_reuse(t) == 6
    assert mgr.probe_reuse([1, d1, 2, d1]) == 3  # partial reuse inside block 0
    kv = mgr.create_kv_cache(t + [d2])
    assert kv.committed_tokens == t
    mgr.check_invariants()


def test_windowed_match_cut_repeats_until_fixed_point(make_manager):
    mgr = make_manager(win_cfg(gpu=4, window=4, sinks=4))  # nsink = 1
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(16)
    a.commit(P[:16])
    assert a.resize(16, history_length=16)  # stale [1, (17 - 4) // 4) = [1, 3)
    assert a.page_indices(0) == [0, -1, -1, 3]
    mgr.clear_reusable()  # blocks 1, 2 lose their pages (no subtree removal: not sinks)
    assert mgr.probe_reuse(P[:16]) == 16  # sink block 0 and block 3 have pages
    # history 12: block 2 needed -> 8; history 8: block 1 needed -> 4; sink block 0 ok
    assert mgr.probe_reuse_detail(P[:12]) == ReuseProbe(4, 4, (GPU,))  # the sink block
    assert mgr.probe_reuse(P[:13]) == 4
    assert mgr.probe_reuse(P[:15]) == 15  # history 15: stale [1, 3) again
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------
# The probe as an engine's scheduler uses it (vLLM's connector): where each block lives
# ---------------------------------------------------------------------------------------

R = toks(16, base=300)


def test_probe_tiers_follow_offloads_to_host_and_disk(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=1, disk=2))
    fill(mgr, P[:8])
    assert mgr.probe_reuse_detail(P[:8]) == ReuseProbe(8, 8, (GPU, GPU))
    fill(mgr, Q[:8])  # P's block 1 to host, then on to disk to make room for P's block 0
    assert mgr.probe_reuse_detail(P[:8]) == ReuseProbe(8, 8, (HOST, DISK))
    assert mgr.probe_reuse_detail(P[:6]) == ReuseProbe(6, 6, (HOST,))  # full blocks only
    assert mgr.probe_reuse_detail(Q[:8] + R[:4]) == ReuseProbe(8, 8, (GPU, GPU))
    assert mgr.probe_reuse_detail(R[:8]) == ReuseProbe(0, 0, ())
    probe, kv = probe_then_create(mgr, P[:8])
    assert probe.block_tiers == (HOST, DISK)
    assert kv.page_indices(0) == [0, 1]


def test_probe_tiers_of_a_match_partly_on_host(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=2))
    fill(mgr, P[:8])
    fill(mgr, Q[:4])  # P's block 1 offloaded to host
    probe, _kv = probe_then_create(mgr, P[:8] + R[:2])
    assert probe == ReuseProbe(8, 8, (GPU, HOST))


def test_probe_tiers_skip_stale_windowed_blocks(make_manager):
    mgr = make_manager(win_cfg(gpu=4, window=4, sinks=4, host=4))  # nsink = 1
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(16)
    a.commit(P[:16])  # stale at 16: [1, 3), released (in the tree, DROPPABLE)
    a.close()
    assert mgr.probe_reuse_detail(P[:16]) == ReuseProbe(16, 16, (GPU, -1, -1, GPU))
    fill(mgr, Q[:8])  # the stale pages of blocks 1 and 2 (used longest ago) go to host
    assert {p["ordinal"] for p in snap(mgr)["pages"] if p["tier"] == HOST} == {1, 2}
    # their pages are not held at 16: the match needs nothing from host
    assert mgr.probe_reuse_detail(P[:16]) == ReuseProbe(16, 16, (GPU, -1, -1, GPU))
    # at 12 block 2 is in the window: held, from host
    assert mgr.probe_reuse_detail(P[:12]) == ReuseProbe(12, 12, (GPU, -1, HOST))
    _probe, kv = probe_then_create(mgr, P[:16])  # resume onboards nothing
    kv.close()
    probe, _kv = probe_then_create(mgr, P[:12])  # resume onboards block 2 from host
    assert probe.block_tiers == (GPU, -1, HOST)


def test_probe_tiers_of_pure_ssm_count_only_the_snapshot_at_the_match_end(make_manager):
    mgr = make_manager(ssm_cfg(gpu=3, host=2))
    fill(mgr, P[:12], chunks=[4, 8])  # snapshots at 4 (block 0) and 12 (block 2)
    assert mgr.probe_reuse_detail(P[:12]) == ReuseProbe(12, 12, (-1, -1, GPU))
    assert mgr.probe_reuse_detail(P[:11]) == ReuseProbe(4, 11, (GPU,))
    fill(mgr, Q[:4])  # its snapshot needs a slot: the older snapshot (block 0) goes to host
    assert mgr.probe_reuse_detail(P[:8]) == ReuseProbe(4, 8, (HOST,))
    probe, _kv = probe_then_create(mgr, P[:12])
    assert probe == ReuseProbe(12, 12, (-1, -1, GPU))
    probe, _kv = probe_then_create(mgr, P[:5])
    assert probe == ReuseProbe(4, 5, (HOST,))


def test_probe_tiers_when_the_fixed_point_shortens_a_hybrid_match(make_manager):
    cfg = hybrid_cfg(attn_gpu=4, ssm_gpu=4, window=4)
    mgr = make_manager(cfg)
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(16)
    a.commit(P[:4])  # snapshot at 4
    a.commit(P[4:8])  # snapshot at 8
    a.commit(P[8:13])  # no snapshot
    assert a.resize(16, history_length=13)  # stale [0, 2): released
    a.close()  # the tail (1 token) enters the tree with a snapshot at 13
    # at 13 blocks 0 and 1 are stale: no page held for them; the tail's snapshot is no full block
    assert mgr.probe_reuse_detail(P[:13]) == ReuseProbe(13, 13, (-1, -1, GPU))
    # at 12: the last snapshot at or below is 8, where the window needs block 1 (0 is stale)
    assert mgr.probe_reuse_detail(P[:12]) == ReuseProbe(8, 12, (-1, GPU))
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(8)  # the stale pages of blocks 0, 1 are dropped for it
    b.close()
    # 12 -> 8 (ssm) -> 4 (block 1's window page is gone) -> 0 (block 0's too)
    assert mgr.probe_reuse_detail(P[:12]) == ReuseProbe(0, 12, ())
    probe, _kv = probe_then_create(mgr, P[:13])
    assert probe == ReuseProbe(13, 13, (-1, -1, GPU))


def test_probe_tiers_with_partial_reuse_on_and_off(make_manager):
    for partial in (True, False):
        mgr = make_manager(attn_cfg(gpu=3, host=2, enable_partial_reuse=partial))
        kv = mgr.create_kv_cache()
        assert kv.resume() and kv.resize(6)
        kv.commit(P[:6])
        kv.close()  # block 0 full; with partial reuse, block 1 partial (2 tokens) in the tree
        fill(mgr, Q[:8])  # the partial page (the deeper block) goes to host
        assert [p["ordinal"] for p in snap(mgr)["pages"] if p["tier"] == HOST] == ([1] if partial else [])
        probe, kv = probe_then_create(mgr, P[:8])
        if partial:
            # the match ends inside block 1: only full blocks are reported, and resume
            # loads the partial page from host (then copies it on write)
            assert probe == ReuseProbe(6, 6, (GPU,))
            assert kv.page_indices(0)[0] == 0
        else:
            assert probe == ReuseProbe(4, 4, (GPU,))
