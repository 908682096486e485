"""SPEC sec. 16: the shared tier (DECISIONS.md "The shared tier"): what a manager offers to look
up (``shared_candidates``) and which pages it writes to the store, under ``shared_write="commit"``
(every new full block at commit) and ``"evict"`` (a page just before eviction drops it).
The tier's other scenarios: parity/test_shared_tier.py (which says what the tier is) and
parity/test_shared_tier_reads.py."""

from __future__ import annotations

from kvcm import CopyOp, ReuseScope

from parity.helpers import B, attached_keys, attn_cfg, fill, hybrid_cfg, keys, lc_stats, snap, ssm_cfg, unchanged
from parity.shared_tier_helpers import P, Q, reader, shared, store_op, written, written_by

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
