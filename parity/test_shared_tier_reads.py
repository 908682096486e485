"""SPEC sec. 16: reading from the shared tier (DECISIONS.md "The shared tier"): a request's
match extended past the local tree by the store's hits (full attention, windows, ssm
snapshots, hybrids, backoff), and probes given the store's hits (what create would take, on
which tiers, bad hits refused).  The tier's other scenarios: parity/test_shared_tier.py
(which says what the tier is) and parity/test_shared_tier_writes.py."""

from __future__ import annotations

import pytest
from kvcm import AttentionLayer, CopyOp, KVCacheManagerConfig, ReuseProbe, SsmLayer, Tier

from parity.helpers import (
    B,
    attached_keys,
    attn_cfg,
    fill,
    hybrid_cfg,
    keys,
    lc_stats,
    of_kind,
    probe_then_create,
    removed,
    snap,
    ssm_cfg,
    stored,
    stored_blocks,
    tier_changes,
    unchanged,
    win_cfg,
)
from parity.shared_tier_helpers import SHARED, P, Q, onboard_op, page_entries, reader, shared, written_by

# ---------------------------------------------------------------------------------------
# Reading: the extended match
# ---------------------------------------------------------------------------------------


def test_full_attention_extension_inserts_shared_pages_and_resume_onboards_them(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:12])
    r, kv = reader(make_manager, cfg, P[:13], store)
    k = keys(P[:12])
    assert kv.num_reused_tokens == 12 and kv.num_committed_tokens == 12
    events = r.take_events()
    assert [(b.key, b.lc, b.tier, b.coverage) for b in stored_blocks(events)] == [(k[i], 0, SHARED, B) for i in range(3)]
    assert [e.parent_key for e in of_kind(events, "stored")][1:] == k[:2]
    pages = page_entries(r, SHARED)
    assert [(p["slot"], p["state"], p["coverage"], p["holds"]) for p in pages] == [(-1, "HELD", B, 1)] * 3
    assert snap(r)["pools"][0]["lc"][0]["free"] == 6  # shared pages take no slot
    assert lc_stats(r.stats(), 0)["shared_hit_blocks"] == 3
    assert r.probe_reuse(P[:12]) == 12  # the blocks are in the tree, on the shared tier
    r.check_invariants()
    assert kv.resume() is True
    assert r.drain_copy_ops() == [onboard_op(0, i, k[i]) for i in range(3)]
    assert tier_changes(r.take_events()) == [(k[i], 0, SHARED, 0) for i in range(3)]
    assert page_entries(r, SHARED) == []
    assert kv.resize(13) and kv.page_indices(0) == [0, 1, 2, 3]
    assert lc_stats(r.stats(), 0)["onboards"] == 3
    r.check_invariants()


def test_windowed_extension_holds_only_the_window_and_needs_no_stale_block(make_manager):
    cfg = shared(win_cfg(gpu=4, window=4))
    store, _ = written_by(make_manager, cfg, P[:16])
    k = keys(P[:16])
    assert store == {(k[i], 0) for i in range(4)}
    r, kv = reader(make_manager, cfg, P[:16], store)
    assert kv.num_reused_tokens == 16
    # blocks 0..2 are stale at 16: inserted without a page, no stored event
    assert stored(r.take_events()) == [(k[3], 0)]
    assert [p["ordinal"] for p in page_entries(r, SHARED)] == [3]
    assert attached_keys(r) == set(k)
    r.check_invariants()
    # only the last block in the store: the same match (the stale ones are not needed)
    _r2, kv2 = reader(make_manager, cfg, P[:16], {(k[3], 0)})
    assert kv2.num_reused_tokens == 16
    # the store ends at block 1: the match ends there (block 0 stale at 8)
    r3, kv3 = reader(make_manager, cfg, P[:16], {(k[1], 0)})
    assert kv3.num_reused_tokens == 8
    assert [p["ordinal"] for p in page_entries(r3, SHARED)] == [1]
    r3.check_invariants()


def test_pure_ssm_extension_ends_at_the_last_stored_snapshot(make_manager):
    cfg = shared(ssm_cfg(gpu=4))
    store, _ = written_by(make_manager, cfg, P[:12], chunks=[4, 8])
    k = keys(P[:12])
    assert store == {(k[0], 0), (k[2], 0)}
    r, kv = reader(make_manager, cfg, P[:14], store)
    assert kv.num_reused_tokens == 12
    assert stored(r.take_events()) == [(k[2], 0)]  # blocks 0, 1 inserted without a page
    assert [p["ordinal"] for p in page_entries(r, SHARED)] == [2]
    r.check_invariants()
    assert kv.resume() is True
    # the snapshot is onboarded, then copied into the fresh live state
    assert r.drain_copy_ops() == [onboard_op(0, 0, k[2]), CopyOp(0, 0, 0, 0, 1, "cow")]
    assert kv.page_indices(0) == [1]
    r.check_invariants()
    # with only block 0's snapshot stored the match ends there
    _r2, kv2 = reader(make_manager, cfg, P[:14], {(k[0], 0)})
    assert kv2.num_reused_tokens == 4


def test_hybrid_extension_holds_attention_pages_and_the_snapshot_at_the_end(make_manager):
    cfg = shared(hybrid_cfg())
    store, _ = written_by(make_manager, cfg, P[:12])
    k = keys(P[:12])
    r, kv = reader(make_manager, cfg, P[:12], store)
    assert kv.num_reused_tokens == 12
    assert stored(r.take_events()) == [(k[0], 0), (k[1], 0), (k[2], 0), (k[2], 1)]
    assert lc_stats(r.stats(), 0)["shared_hit_blocks"] == 3
    assert lc_stats(r.stats(), 1)["shared_hit_blocks"] == 1
    assert kv.resume() is True
    ops = r.drain_copy_ops()
    assert ops[:4] == [onboard_op(0, 0, k[0]), onboard_op(0, 1, k[1]), onboard_op(0, 2, k[2]),
                       onboard_op(1, 0, k[2])]
    assert ops[4:] == [CopyOp(1, 0, 0, 0, 1, "cow")]  # live state in slot 1
    r.check_invariants()
    # without the snapshot at block 2 the attention hits alone do not extend a hybrid match
    r2, kv2 = reader(make_manager, cfg, P[:12], store - {(k[2], 1)})
    assert kv2.num_reused_tokens == 0
    assert page_entries(r2, SHARED) == [] and r2.take_events() == []


def test_extension_is_not_taken_when_not_longer_than_the_local_match(make_manager):
    cfg = shared(hybrid_cfg())
    mgr = make_manager(cfg)
    fill(mgr, P[:8])  # local: blocks 0, 1 with a snapshot at block 1
    mgr.take_events()
    k = keys(P[:12])
    # block 2's snapshot only: attention has no page there, so the match stays at 8
    kv = mgr.create_kv_cache(P[:12], shared_hits=[(k[2], 1)])
    assert kv.num_reused_tokens == 8
    assert mgr.take_events() == [] and page_entries(mgr, SHARED) == []
    assert lc_stats(mgr.stats(), 1)["shared_hit_blocks"] == 0
    # hits that are no candidates (blocks on the tree path) are ignored
    kv2 = mgr.create_kv_cache(P[:8], shared_hits=[(k[0], 0), (k[1], 1), (b"\0" * 32, 0)])
    assert kv2.num_reused_tokens == 8 and page_entries(mgr, SHARED) == []
    mgr.check_invariants()


def test_extension_beyond_a_partial_local_match(make_manager):
    cfg = shared(attn_cfg(gpu=8))
    mgr = make_manager(cfg)
    kv = mgr.create_kv_cache()
    kv.resume()
    kv.resize(10)
    kv.commit(P[:10])
    kv.close()  # local: blocks 0, 1 and a partial block of 2 tokens
    assert mgr.probe_reuse(P[:12]) == 10
    mgr.drain_copy_ops()
    k = keys(P[:12])
    mgr.take_events()
    kv = mgr.create_kv_cache(P[:12], shared_hits=[(k[2], 0)])
    assert kv.num_reused_tokens == 12  # longer than the partial match: taken
    assert [p["ordinal"] for p in page_entries(mgr, SHARED)] == [2]
    # the full block replaces the partial one it covers (sec. 5 attach): its slot is freed
    events = mgr.take_events()
    assert removed(events) == [(keys(P[:10])[2], 0)] and stored(events) == [(k[2], 0)]
    assert kv.resume()
    assert mgr.drain_copy_ops() == [onboard_op(0, 2, k[2])]
    mgr.check_invariants()


def test_backoff_applies_to_the_extended_match(make_manager):
    cfg = shared(attn_cfg(gpu=6), reuse_match_backoff=2)
    store, _ = written_by(make_manager, cfg, P[:12])
    k = keys(P[:12])
    r, kv = reader(make_manager, cfg, P[:12], store)
    assert kv.num_reused_tokens == 10  # ends inside block 2: copied on write at resume
    assert len(page_entries(r, SHARED)) == 3
    assert kv.resume() is True
    assert r.drain_copy_ops() == [onboard_op(0, 0, k[0]), onboard_op(0, 1, k[1]), onboard_op(0, 2, k[2]),
                                  CopyOp(0, 0, 2, 0, 3, "cow")]
    assert kv.page_indices(0) == [0, 1, 3]
    r.check_invariants()


# ---------------------------------------------------------------------------------------
# Probing with the store's hits (SPEC sec. 6): what create would take, where it lives
# ---------------------------------------------------------------------------------------


def test_probe_with_hits_answers_what_create_takes_and_creates_nothing(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:12])
    r = make_manager(cfg)  # a fresh instance: no scope root, no block
    before = snap(r)
    hits = [c for c in r.shared_candidates(P[:13]) if c in store]
    assert r.probe_reuse_detail(P[:13]) == ReuseProbe(0, 0, ())  # without the store's answer
    assert r.probe_reuse_detail(P[:13], shared_hits=hits) == ReuseProbe(12, 12, (SHARED,) * 3)
    assert r.probe_reuse(P[:13], shared_hits=hits) == 12
    for _ in range(3):  # vLLM asks every step while the request waits: nothing moves
        assert r.probe_reuse_detail(P[:13], shared_hits=iter(hits)).num_tokens == 12
    assert snap(r) == before  # no tick, no root, no node, no page, no event, no stats
    probe, kv = probe_then_create(r, P[:13], shared_hits=hits)
    assert probe.block_tiers == (SHARED,) * 3
    assert kv.page_indices(0) == [0, 1, 2]
    # now in the tree, on gpu: the same probe needs the store no more
    assert r.probe_reuse_detail(P[:13]) == ReuseProbe(12, 12, (0, 0, 0))


def test_probe_tiers_of_a_match_local_on_gpu_and_host_then_in_the_store(make_manager):
    cfg = shared(attn_cfg(gpu=4, host=2))
    store, _ = written_by(make_manager, shared(attn_cfg(gpu=6)), P[:16])
    mgr = make_manager(cfg)
    fill(mgr, P[:8])
    fill(mgr, Q[:12])  # P's block 1 goes to host
    mgr.drain_copy_ops()
    hits = [c for c in mgr.shared_candidates(P[:16]) if c in store]
    k = keys(P[:16])
    assert hits == [(k[2], 0), (k[3], 0)]  # blocks 0, 1 are on the tree path: never looked up
    assert mgr.probe_reuse_detail(P[:16]) == ReuseProbe(8, 8, (0, 1))
    probe, _kv = probe_then_create(mgr, P[:16], shared_hits=hits)
    assert probe == ReuseProbe(16, 16, (0, 1, SHARED, SHARED))


def test_probe_with_hits_that_do_not_connect_to_the_tree_path(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    k = keys(P[:16])
    gap = {(k[2], 0), (k[3], 0)}  # the store lacks block 1
    mgr = make_manager(cfg)
    fill(mgr, P[:4])  # block 0 local
    hits = [c for c in mgr.shared_candidates(P[:16]) if c in gap]
    assert hits == [(k[2], 0), (k[3], 0)]
    # full attention stops at block 1: no longer than the local match, which is taken
    probe, _kv = probe_then_create(mgr, P[:16], shared_hits=hits)
    assert probe == ReuseProbe(4, 4, (0,))
    assert page_entries(mgr, SHARED) == []
    # a fresh instance: the store's run does not start at block 0
    fresh = make_manager(cfg)
    hits = [c for c in fresh.shared_candidates(P[:16]) if c in gap]
    probe, _kv = probe_then_create(fresh, P[:16], shared_hits=hits)
    assert probe == ReuseProbe(0, 0, ())


def _window_ssm(**kw) -> KVCacheManagerConfig:
    """Windowed attention with a sink block (lc 0: window 4, 4 sink tokens) and ssm (lc 1)."""
    return shared(KVCacheManagerConfig(tokens_per_block=B, layers=[AttentionLayer(0, 4, window=4, sink_tokens=4),
                                                                   SsmLayer(1, 16)],
                                       tiers=[Tier("gpu", 16 * 16)], **kw))


def test_probe_tiers_of_a_windowed_hybrid_extension(make_manager):
    cfg = _window_ssm()
    store, _ = written_by(make_manager, cfg, P[:16], chunks=[8, 8])  # snapshots at 8 and 16
    k = keys(P[:16])
    assert store == {(k[i], 0) for i in range(4)} | {(k[1], 1), (k[3], 1)}
    mgr = make_manager(cfg)
    # at 16 blocks 1, 2 are stale (no page held), the sink block and block 3 are; the
    # snapshot at block 3 too
    hits = [c for c in mgr.shared_candidates(P[:16]) if c in store]
    assert mgr.probe_reuse_detail(P[:16], shared_hits=hits) == ReuseProbe(16, 16, (SHARED, -1, -1, SHARED))
    # without the snapshot at 16 the match ends at the one at 8 (the fixed point shortens it)
    fewer = [c for c in hits if c != (k[3], 1)]
    assert mgr.probe_reuse_detail(P[:16], shared_hits=fewer) == ReuseProbe(8, 16, (SHARED, SHARED))
    # without the sink block's page nothing is reusable: the ordinary (empty) match is taken
    assert mgr.probe_reuse_detail(P[:16], shared_hits=[c for c in hits if c != (k[0], 0)]) == ReuseProbe(0, 0, ())
    probe_then_create(mgr, P[:16], shared_hits=fewer)
    mgr2 = make_manager(cfg)
    fill(mgr2, P[:4])  # block 0 local (with its snapshot)
    hits2 = [c for c in mgr2.shared_candidates(P[:16]) if c in store]
    probe, _kv = probe_then_create(mgr2, P[:16], shared_hits=hits2)
    assert probe == ReuseProbe(16, 16, (0, -1, -1, SHARED))


@pytest.mark.parametrize("partial", [True, False])
def test_probe_with_hits_beyond_a_partial_local_match(make_manager, partial):
    cfg = shared(attn_cfg(gpu=8, enable_partial_reuse=partial))
    mgr = make_manager(cfg)
    kv = mgr.create_kv_cache()
    kv.resume()
    kv.resize(10)
    kv.commit(P[:10])
    kv.close()  # local: blocks 0, 1 (and, with partial reuse, a partial block of 2 tokens)
    k = keys(P[:12])
    assert mgr.probe_reuse_detail(P[:12]) == ReuseProbe(10 if partial else 8, 10 if partial else 8, (0, 0))
    probe, _kv = probe_then_create(mgr, P[:12], shared_hits=[(k[2], 0)])
    assert probe == ReuseProbe(12, 12, (0, 0, SHARED))


def test_probe_sees_shared_pages_another_request_holds(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:12])
    r, _kv1 = reader(make_manager, cfg, P[:12], store)  # shared pages in the tree, held by kv1
    assert r.probe_reuse_detail(P[:12]) == ReuseProbe(12, 12, (SHARED,) * 3)
    probe, _kv2 = probe_then_create(r, P[:12])  # no hits needed: the blocks are on the tree path
    assert probe.block_tiers == (SHARED,) * 3


@pytest.mark.parametrize("hits, exc", [
    (5, TypeError),
    ("ab", TypeError),
    ([b"x" * 32], TypeError),
    ([(b"x" * 32,)], ValueError),
    ([(b"x" * 31, 0)], ValueError),
    ([("x" * 32, 0)], TypeError),
    ([(b"x" * 32, 1)], ValueError),
    ([(b"x" * 32, True)], TypeError),
])
def test_bad_shared_hits_on_a_probe_fail_as_on_create_and_change_nothing(make_manager, hits, exc):
    mgr = make_manager(shared(attn_cfg(gpu=6)))
    fill(mgr, P[:4])
    on_create = unchanged(mgr, lambda: mgr.create_kv_cache(P[:12], shared_hits=hits), exc)
    for probe in (mgr.probe_reuse_detail, mgr.probe_reuse):
        on_probe = unchanged(mgr, lambda probe=probe: probe(P[:12], shared_hits=hits), exc)
        assert str(on_probe) == str(on_create)


def test_a_probe_with_hits_but_no_shared_tier_is_refused(make_manager):
    mgr = make_manager(attn_cfg())
    fill(mgr, P[:4])
    for hits in ([], [(keys(P)[0], 0)]):
        err = unchanged(mgr, lambda hits=hits: mgr.probe_reuse_detail(P[:8], shared_hits=hits), ValueError)
        assert "no shared tier" in str(err)
    assert mgr.probe_reuse_detail(P[:8], shared_hits=None) == ReuseProbe(4, 4, (0,))
