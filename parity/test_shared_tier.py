"""SPEC sec. 16: the shared tier (DECISIONS.md "The shared tier").

A store shared by many managers is the coldest tier.  The manager does no I/O: the engine
asks it which ``(key, lc)`` to look up (``shared_candidates``), tells it what the store
holds (``create_kv_cache(shared_hits=...)``), and executes the ``store`` / ``onboard`` ops
that name objects by block key.  Each scenario asserts real outcomes (lengths, pages,
ops, events, stats) on both backends; the store here is a dict, filled by executing a
writer manager's ``store`` ops (``PlaneSim``)."""

from __future__ import annotations

import dataclasses

import pytest
from kvcm import (
    AttentionLayer,
    ConfigError,
    CopyOp,
    KVCacheManagerConfig,
    ReuseProbe,
    ReuseScope,
    SsmLayer,
    Status,
    Tier,
)

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
    toks,
    unchanged,
    win_cfg,
)

SHARED = 3
SHARED_PATH = "/tmp/kvcm-parity-shared"
P = toks(16, base=100)
Q = toks(16, base=200)


def shared(cfg: KVCacheManagerConfig, write: str = "commit", **kw) -> KVCacheManagerConfig:
    """``cfg`` with a shared tier (listed last) and the write policy ``write``."""
    kw.setdefault("shared_namespace", "parity-model")
    return dataclasses.replace(cfg, tiers=[*cfg.tiers, Tier("shared", 0, SHARED_PATH)], shared_write=write, **kw)


def store_op(lc: int, src_tier: int, src_slot: int, key: bytes) -> CopyOp:
    return CopyOp(lc, src_tier, src_slot, SHARED, -1, "store", key=key)


def onboard_op(lc: int, dst_slot: int, key: bytes) -> CopyOp:
    return CopyOp(lc, SHARED, -1, 0, dst_slot, "onboard", key=key)


def written(ops) -> set[tuple[bytes, int]]:
    """What a store holds after executing ``ops``: the ``(key, lc)`` of their store ops."""
    return {(o.key, o.lc) for o in ops if o.reason == "store"}


def page_entries(mgr, tier: int) -> list[dict]:
    return [p for p in snap(mgr)["pages"] if p["tier"] == tier]


def reader(make_manager, cfg, tokens, store: set, **kw):
    """A fresh manager that reuses ``store`` for ``tokens``: candidates, hits, create."""
    mgr = make_manager(cfg)
    hits = [c for c in mgr.shared_candidates(tokens) if c in store]
    return mgr, mgr.create_kv_cache(tokens, shared_hits=hits, **kw)


def written_by(make_manager, cfg, tokens, chunks=None) -> tuple[set, list[CopyOp]]:
    """A writer manager commits ``tokens`` in one request; returns what reached the store
    and every op it drained."""
    w = make_manager(cfg)
    fill(w, tokens, chunks=chunks)
    ops = w.drain_copy_ops()
    return written(ops), ops


# ---------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------


def test_candidates_are_the_full_blocks_past_the_tree_path_with_no_side_effect(make_manager):
    mgr = make_manager(shared(hybrid_cfg()))
    fill(mgr, P[:8])
    mgr.drain_copy_ops()
    mgr.take_events()
    before = snap(mgr)
    k = keys(P[:18])
    # blocks 0, 1 are on the tree path; 2, 3 are candidates; the partial tail is not
    assert mgr.shared_candidates(P[:18]) == [(k[2], 0), (k[2], 1), (k[3], 0), (k[3], 1)]
    assert mgr.shared_candidates(P[:8]) == []
    # another scope has no tree path at all (and probing it creates no root)
    scope = ReuseScope(lora_id=7)
    ks = keys(P[:8], scope)
    assert mgr.shared_candidates(P[:8], scope) == [(ks[0], 0), (ks[0], 1), (ks[1], 0), (ks[1], 1)]
    assert snap(mgr) == before  # no tick, no LRU touch, no root
    # a diverging block ends the tree path
    diverged = P[:4] + Q[:8]
    kd = keys(diverged)
    assert [c[0] for c in mgr.shared_candidates(diverged)] == [kd[1], kd[1], kd[2], kd[2]]


def test_candidates_without_a_shared_tier_are_empty_and_arguments_are_checked(make_manager):
    mgr = make_manager(attn_cfg())
    assert mgr.shared_candidates(P[:12]) == []
    unchanged(mgr, lambda: mgr.shared_candidates("abc"), TypeError)
    unchanged(mgr, lambda: mgr.shared_candidates([1, -1]), ValueError)
    withs = make_manager(shared(attn_cfg()))
    unchanged(withs, lambda: withs.shared_candidates(P[:4], scope=3), TypeError)


# ---------------------------------------------------------------------------------------
# Writing under shared_write="commit"
# ---------------------------------------------------------------------------------------


def test_commit_writes_every_new_full_block_page_and_never_a_partial_one(make_manager):
    w = make_manager(shared(attn_cfg(gpu=6)))
    kv = w.create_kv_cache()
    kv.resume()
    kv.resize(14)
    kv.commit(P[:14])
    k = keys(P[:14])
    assert w.drain_copy_ops() == [store_op(0, 0, i, k[i]) for i in range(3)]
    kv.close()  # the partial tail enters the tree; it is never stored
    assert w.drain_copy_ops() == []
    assert lc_stats(w.stats(), 0)["shared_stores"] == 3
    assert lc_stats(w.stats(), 0)["shared_store_bytes"] == 3 * B  # 1 byte per token
    w.check_invariants()


def test_commit_writes_no_page_a_request_switches_to_or_onboards(make_manager):
    w = make_manager(shared(attn_cfg(gpu=8)))
    fill(w, P[:12])
    assert len(w.drain_copy_ops()) == 3
    # the same tokens again: the blocks exist with gpu pages, the request switches to them
    fill(w, P[:12])
    assert w.drain_copy_ops() == []
    # a reader onboards the three from the store, then commits one new block: one store
    store = written([store_op(0, 0, i, k) for i, k in enumerate(keys(P[:12]))])
    r, kv = reader(make_manager, shared(attn_cfg(gpu=8)), P[:12], store)
    assert kv.resume() and kv.resize(16)
    onboards = r.drain_copy_ops()
    assert [o.reason for o in onboards] == ["onboard"] * 3
    kv.commit(P[12:16])
    k = keys(P[:16])
    assert r.drain_copy_ops() == [store_op(0, 0, 3, k[3])]
    assert lc_stats(r.stats(), 0)["shared_stores"] == 1


def test_commit_writes_the_ssm_snapshot_right_after_its_snapshot_op(make_manager):
    _store, ops = written_by(make_manager, shared(ssm_cfg(gpu=4)), P[:12], chunks=[4, 8])
    k = keys(P[:12])
    # live state in slot 0; a snapshot where each commit ends on a block boundary (blocks 0, 2)
    assert ops == [
        CopyOp(0, 0, 0, 0, 1, "snapshot"), store_op(0, 0, 1, k[0]),
        CopyOp(0, 0, 0, 0, 2, "snapshot"), store_op(0, 0, 2, k[2]),
    ]


def test_hybrid_commit_writes_attention_pages_and_the_boundary_snapshot(make_manager):
    _store, ops = written_by(make_manager, shared(hybrid_cfg()), P[:12])
    k = keys(P[:12])
    assert ops == [
        store_op(0, 0, 0, k[0]), store_op(0, 0, 1, k[1]),
        CopyOp(1, 0, 0, 0, 1, "snapshot"), store_op(1, 0, 1, k[2]),
        store_op(0, 0, 2, k[2]),
    ]


# ---------------------------------------------------------------------------------------
# Writing under shared_write="evict"
# ---------------------------------------------------------------------------------------


def test_evict_writes_a_full_block_page_just_before_eviction_drops_it(make_manager):
    w = make_manager(shared(attn_cfg(gpu=4), write="evict"))
    fill(w, P[:12])
    assert w.drain_copy_ops() == []  # nothing at commit
    kP = keys(P[:12])
    fill(w, Q[:12])  # needs 3 slots: 1 free, then P's blocks 2 and 1 are evicted (deepest first)
    assert w.drain_copy_ops() == [store_op(0, 0, 2, kP[2]), store_op(0, 0, 1, kP[1])]
    assert attached_keys(w) == {kP[0], *keys(Q[:12])}
    assert lc_stats(w.stats(), 0)["shared_stores"] == 2
    w.clear_reusable()  # not an eviction: nothing is written
    assert w.drain_copy_ops() == []
    w.check_invariants()


def test_evict_writes_from_the_tier_it_drops_from(make_manager):
    w = make_manager(shared(attn_cfg(gpu=2, host=1), write="evict"))
    fill(w, P[:8])
    kP = keys(P[:8])
    fill(w, Q[:8])  # P's block 1 goes to host; to make room for block 0 it is dropped there
    assert w.drain_copy_ops() == [CopyOp(0, 0, 1, 1, 0, "offload"), store_op(0, 1, 0, kP[1]),
                                  CopyOp(0, 0, 0, 1, 0, "offload")]
    w.check_invariants()


def test_evict_writes_the_pages_pruning_frees_with_the_victim(make_manager):
    w = make_manager(shared(hybrid_cfg(attn_gpu=3, ssm_gpu=4), write="evict"))
    fill(w, P[:12])  # attention slots 0..2, the snapshot at block 2 in ssm slot 1
    assert [o.reason for o in w.drain_copy_ops()] == ["snapshot"]
    kP = keys(P[:12])
    fill(w, Q[:4])  # block 2's attention page is evicted; its block (and snapshot) pruned
    ops = w.drain_copy_ops()
    assert ops[:2] == [store_op(0, 0, 2, kP[2]), store_op(1, 0, 1, kP[2])]
    assert [o.reason for o in ops[2:]] == ["snapshot"]
    # a reader with only the store reuses the whole prefix: attention pages of blocks 0, 1
    # were never written (still cached in w), so it gets none of them...
    store = written(ops)
    _r, kv = reader(make_manager, shared(hybrid_cfg()), P[:12], store)
    assert kv.num_reused_tokens == 0
    # ...until w evicts them too
    fill(w, Q[4:12])
    store |= written(w.drain_copy_ops())
    assert {(kP[0], 0), (kP[1], 0)} <= store
    _r, kv = reader(make_manager, shared(hybrid_cfg()), P[:12], store)
    assert kv.num_reused_tokens == 12
    w.check_invariants()


def test_evict_never_writes_a_partial_page(make_manager):
    w = make_manager(shared(attn_cfg(gpu=2, host=1), write="evict"))
    kv = w.create_kv_cache()
    kv.resume()
    kv.resize(6)
    kv.commit(P[:6])
    kv.close()  # block 0 full, block 1 partial (2 tokens)
    fill(w, Q[:8])  # the partial page goes to host, then is dropped there for block 0: not written
    assert w.drain_copy_ops() == [CopyOp(0, 0, 1, 1, 0, "offload"), CopyOp(0, 0, 0, 1, 0, "offload")]
    assert lc_stats(w.stats(), 0)["drops"] == 1 and lc_stats(w.stats(), 0)["shared_stores"] == 0


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


# ---------------------------------------------------------------------------------------
# Life of a shared page
# ---------------------------------------------------------------------------------------


def test_shared_pages_are_unlinked_when_their_request_closes_without_resume(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:12])
    k = keys(P[:12])
    r, kv = reader(make_manager, cfg, P[:12], store)
    r.take_events()
    kv.close()
    assert removed(r.take_events()) == [(k[0], 0), (k[1], 0), (k[2], 0)]
    assert snap(r)["pages"] == [] and attached_keys(r) == set()
    assert lc_stats(r.stats(), 0)["drops"] == 0  # no local slot was freed
    r.check_invariants()


def test_two_requests_hold_one_shared_page(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:12])
    r, kv1 = reader(make_manager, cfg, P[:12], store)
    kv2 = r.create_kv_cache(P[:12])  # an ordinary match finds the shared blocks
    assert kv2.num_reused_tokens == 12
    assert [p["holds"] for p in page_entries(r, SHARED)] == [2, 2, 2]
    r.check_invariants()
    kv1.close()  # still used by kv2: kept
    assert [p["holds"] for p in page_entries(r, SHARED)] == [1, 1, 1]
    assert kv2.resume() is True  # onboarded once, for kv2
    assert [o.reason for o in r.drain_copy_ops()] == ["onboard"] * 3
    kv2.close()  # now ordinary gpu pages of the tree: DROPPABLE, kept
    assert attached_keys(r) == set(keys(P[:12]))
    assert all(p["state"] == "DROPPABLE" and p["tier"] == 0 for p in snap(r)["pages"])
    r.check_invariants()


def test_a_suspended_holder_keeps_the_onboarded_page(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:8])
    r, kv1 = reader(make_manager, cfg, P[:8], store)
    kv2 = r.create_kv_cache(P[:8])
    assert kv1.resume()
    r.drain_copy_ops()
    kv1.close()
    assert [(p["tier"], p["state"]) for p in snap(r)["pages"]] == [(0, "HELD"), (0, "HELD")]
    assert kv2.resume()
    assert r.drain_copy_ops() == []  # already on gpu
    r.check_invariants()


# ---------------------------------------------------------------------------------------
# forget_copies
# ---------------------------------------------------------------------------------------


def test_forget_copies_of_store_ops_forgets_nothing(make_manager):
    w = make_manager(shared(attn_cfg(gpu=6)))
    fill(w, P[:12])
    ops = w.drain_copy_ops()
    assert len(ops) == 3
    w.take_events()
    tree = snap(w)["tree"]
    assert w.forget_copies(ops[1:]) == []
    assert snap(w)["tree"] == tree and w.take_events() == []
    assert lc_stats(w.stats(), 0)["lost_pages"] == 0
    assert [op[:7] for op in snap(w)["issued_copy_ops"]] == [ops[0].to_json()]
    unchanged(w, lambda: w.forget_copies(ops[1:2]), ValueError)  # already reported
    w.check_invariants()


def test_a_failed_shared_onboard_rolls_the_request_back_and_rematches_locally(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:12])
    k = keys(P[:12])
    r, kv = reader(make_manager, cfg, P[:12], store)
    assert kv.resume()
    ops = r.drain_copy_ops()
    r.take_events()
    assert r.forget_copies([ops[1]]) == [kv.id]  # block 1's object was gone
    assert kv.status == Status.SUSPENDED and kv.num_committed_tokens == 4
    assert removed(r.take_events())[:2] == [(k[1], 0), (k[2], 0)]
    assert attached_keys(r) == {k[0]}
    assert lc_stats(r.stats(), 0)["lost_pages"] == 1
    r.check_invariants()
    # the engine recomputes from token 4
    assert kv.resume() and kv.resize(12)
    kv.commit(P[4:12])
    assert [o.reason for o in r.drain_copy_ops()] == ["store", "store"]
    r.check_invariants()


def test_a_failed_snapshot_load_loses_the_ssm_state_and_rematches(make_manager):
    cfg = shared(ssm_cfg(gpu=4))
    store, _ = written_by(make_manager, cfg, P[:12])
    r, kv = reader(make_manager, cfg, P[:12], store)
    assert kv.resume()
    ops = r.drain_copy_ops()  # onboard of block 2's snapshot, then its copy into the live state
    r.take_events()
    # CopyError.ops lists the failed load and every op after it
    assert r.forget_copies(ops) == [kv.id]
    assert kv.status == Status.SUSPENDED and kv.num_committed_tokens == 0
    assert snap(r)["tree"] == [n for n in snap(r)["tree"] if n["root"]]  # nothing reusable is left
    assert lc_stats(r.stats(), 0)["lost_pages"] == 2
    r.check_invariants()


def test_window_and_ssm_extension(make_manager):
    cfg = shared(KVCacheManagerConfig(tokens_per_block=B, layers=[AttentionLayer(0, 4, window=5), SsmLayer(1, 16)],
                                      tiers=[Tier("gpu", 16 * 12)], pool_ratio={0: 8.0, 1: 4.0}))
    store, _ = written_by(make_manager, cfg, P[:16])
    k = keys(P[:16])
    assert store == {(k[i], 0) for i in range(4)} | {(k[3], 1)}
    r, kv = reader(make_manager, cfg, P[:16], store)
    assert kv.num_reused_tokens == 16
    # stale at 16 (window 5: blocks ending before token 12): 0..2; held: block 3 and the snapshot
    assert stored(r.take_events()) == [(k[3], 0), (k[3], 1)]
    assert kv.resume()
    assert r.drain_copy_ops() == [onboard_op(0, 0, k[3]), onboard_op(1, 0, k[3]), CopyOp(1, 0, 0, 0, 1, "cow")]
    assert kv.page_indices(0) == [-1, -1, -1, 0]
    r.check_invariants()


def test_forget_copies_checks_the_key_of_an_op(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:8])
    r, kv = reader(make_manager, cfg, P[:8], store)
    assert kv.resume()
    op = r.drain_copy_ops()[0]
    for bad in (dataclasses.replace(op, key=None), dataclasses.replace(op, key=b"\1" * 32),
                dataclasses.replace(op, key=b"short")):
        unchanged(r, lambda bad=bad: r.forget_copies([bad]), ValueError)
    unchanged(r, lambda: r.forget_copies([dataclasses.replace(op, key="ab")]), TypeError)


# ---------------------------------------------------------------------------------------
# Bad input and config
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("hits, exc", [
    (5, TypeError),
    ("ab", TypeError),
    (b"x" * 32, TypeError),
    ([b"x" * 32], TypeError),
    ([(b"x" * 32,)], ValueError),
    ([(b"x" * 32, 0, 1)], ValueError),
    ([(b"x" * 31, 0)], ValueError),
    ([("x" * 32, 0)], TypeError),
    ([(b"x" * 32, 1)], ValueError),
    ([(b"x" * 32, -1)], ValueError),
    ([(b"x" * 32, True)], TypeError),
    ([(b"x" * 32, 0.0)], TypeError),
])
def test_bad_shared_hits_change_nothing(make_manager, hits, exc):
    mgr = make_manager(shared(attn_cfg(gpu=6)))
    fill(mgr, P[:4])
    unchanged(mgr, lambda: mgr.create_kv_cache(P[:12], id="x", shared_hits=hits), exc)
    kv = mgr.create_kv_cache(P[:12], id="x", shared_hits=[(keys(P)[1], 0)])  # the id is still free
    assert kv.num_reused_tokens == 8  # block 0 local, block 1 from the store


def test_shared_hits_without_a_shared_tier_are_refused(make_manager):
    mgr = make_manager(attn_cfg())
    for hits in ([], [(keys(P)[0], 0)]):
        unchanged(mgr, lambda hits=hits: mgr.create_kv_cache(P[:8], shared_hits=hits), ValueError)
    assert mgr.create_kv_cache(P[:8], shared_hits=None).num_reused_tokens == 0


def test_shared_hits_accept_any_iterable_of_pairs(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:8])
    mgr = make_manager(cfg)
    as_lists = [[bytearray(k), lc] for k, lc in store]
    assert mgr.create_kv_cache(P[:8], shared_hits=iter(as_lists)).num_reused_tokens == 8
    assert mgr.create_kv_cache(P[:8], shared_hits=set(store)).num_reused_tokens == 8


def _cfg_error(make_manager, cfg) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        make_manager(cfg)
    return info.value


def test_config_shared_tier_rules(make_manager):
    layers = [AttentionLayer(0, 1)]

    def cfg(*tiers, **kw):
        return KVCacheManagerConfig(tokens_per_block=B, layers=layers, tiers=list(tiers), **kw)

    gpu = Tier("gpu", 16)
    sh = Tier("shared", 0, SHARED_PATH)
    assert _cfg_error(make_manager, cfg(sh, gpu)).field == "tiers"  # listed last
    assert _cfg_error(make_manager, cfg(gpu, sh, Tier("host", 16))).field == "tiers"
    assert _cfg_error(make_manager, cfg(gpu, sh, sh)).field == "tiers"  # at most one
    assert _cfg_error(make_manager, cfg(gpu, Tier("shared", 0))).field == "tiers.path"
    assert _cfg_error(make_manager, cfg(gpu, Tier("shared", 0, ""))).field == "tiers.path"
    assert _cfg_error(make_manager, cfg(gpu, Tier("shared", 0, 5))).field == "tiers.path"
    assert _cfg_error(make_manager, cfg(gpu, Tier("shared", -1, SHARED_PATH))).field == "tiers.quota_bytes"
    assert _cfg_error(make_manager, cfg(Tier("shared", 0, SHARED_PATH))).field == "tiers"  # gpu required
    for bad in ("Commit", "", None, 1):
        assert _cfg_error(make_manager, cfg(gpu, sh, shared_write=bad)).field == "shared_write"
    for bad in ("x" * 257, "é" * 129, None, b"ns", "\ud800"):
        assert _cfg_error(make_manager, cfg(gpu, sh, shared_namespace=bad)).field == "shared_namespace"
    # a shared tier needs a namespace (same-shaped models must not read each other's bytes)
    assert _cfg_error(make_manager, cfg(gpu, sh)).field == "shared_namespace"
    assert _cfg_error(make_manager, cfg(gpu, sh, shared_namespace="")).field == "shared_namespace"
    # checked with or without a shared tier
    assert _cfg_error(make_manager, cfg(gpu, shared_write="later")).field == "shared_write"
    assert _cfg_error(make_manager, cfg(gpu, shared_namespace="x" * 257)).field == "shared_namespace"
    make_manager(cfg(gpu, shared_namespace=""))  # no shared tier: no namespace needed
    # accepted: no slots, any quota (even one too small for a slot), a URL, 256 bytes of namespace
    mgr = make_manager(cfg(gpu, Tier("shared", 1, "mooncake://127.0.0.1:50051?metadata=http://x"),
                           shared_write="evict", shared_namespace="é" * 128))
    assert [t["kind"] for t in mgr.stats()["tiers"]] == ["gpu"]
    assert [p["kind"] for p in snap(mgr)["pools"]] == ["gpu"]
    make_manager(cfg(gpu, Tier("disk", 16, "/tmp/kvcm-parity-disk"), Tier("shared", 0, "file:///tmp/x"),
                     shared_namespace="m"))


# ---------------------------------------------------------------------------------------
# An engine-like run: manager A writes through a dict store, manager B (fresh) reuses it
# ---------------------------------------------------------------------------------------


class PlaneSim:
    """Executes copy ops over slot contents (a stand-in for the data plane): local slots by
    (tier, lc, slot), the shared store by (key, lc)."""

    def __init__(self, store: dict) -> None:
        self.mem: dict[tuple[int, int, int], object] = {}
        self.store = store

    def run(self, ops) -> None:
        for o in ops:
            if o.reason == "store":
                assert o.dst_tier == SHARED and o.dst_slot == -1 and len(o.key) == 32
                self.store[(o.key, o.lc)] = self.mem[(o.src_tier, o.lc, o.src_slot)]
            elif o.src_tier == SHARED:
                assert o.reason == "onboard" and o.src_slot == -1
                self.mem[(o.dst_tier, o.lc, o.dst_slot)] = self.store[(o.key, o.lc)]
            else:
                assert o.key is None
                self.mem[(o.dst_tier, o.lc, o.dst_slot)] = self.mem[(o.src_tier, o.lc, o.src_slot)]


def _prefill(mgr, plane: PlaneSim, kv, tokens) -> None:
    """The engine's prefill: the reused prefix is loaded, the rest computed and committed
    (block contents: the tokens of the block, written where page_indices says)."""
    assert kv.resume() and kv.resize(len(tokens))
    plane.run(mgr.drain_copy_ops())
    start = kv.num_committed_tokens
    idx = kv.page_indices(0)
    for i in range(start // B, -(-len(tokens) // B)):
        plane.mem[(0, 0, idx[i])] = tuple(tokens[i * B:(i + 1) * B])
    kv.commit(tokens[start:])
    plane.run(mgr.drain_copy_ops())


@pytest.mark.parametrize("write", ["commit", "evict"])
def test_engine_like_reuse_across_two_managers(make_manager, write):
    cfg = shared(attn_cfg(gpu=6), write=write)
    objects: dict = {}
    a = make_manager(cfg)
    plane_a = PlaneSim(objects)
    prompts = [P[:12], P[:8] + Q[:8], Q[:16]]
    for t in prompts:
        kv = a.create_kv_cache(t)
        _prefill(a, plane_a, kv, t)
        kv.close()
        plane_a.run(a.drain_copy_ops())
    if write == "evict":  # only evicted pages were written; push the rest out with other work
        kv = a.create_kv_cache()
        _prefill(a, plane_a, kv, toks(24, base=900))
        kv.close()
    # every object holds exactly its block's tokens
    for t in prompts:
        for i, key in enumerate(keys(t)):
            if (key, 0) in objects:
                assert objects[(key, 0)] == tuple(t[i * B:(i + 1) * B])
    assert len(objects) >= 5
    b = make_manager(cfg)
    plane_b = PlaneSim(objects)
    for t in prompts:
        local = b.probe_reuse(t)
        cands = b.shared_candidates(t)
        hits = [c for c in cands if c in objects]
        # full attention: the match runs to the first block neither local nor stored
        run = local // B
        while run < len(t) // B and (keys(t)[run], 0) in objects:
            run += 1
        kv = b.create_kv_cache(t, shared_hits=hits)
        assert kv.num_reused_tokens == max(local, run * B)
        _prefill(b, plane_b, kv, t)
        idx = kv.page_indices(0)
        assert [plane_b.mem[(0, 0, idx[i])] for i in range(len(t) // B)] == [
            tuple(t[i * B:(i + 1) * B]) for i in range(len(t) // B)]
        kv.close()
        b.check_invariants()
    assert lc_stats(b.stats(), 0)["shared_hit_blocks"] >= 5
