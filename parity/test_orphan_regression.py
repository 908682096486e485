"""SPEC sec. 5 / 13: the orphaned radix-tree block regression (upstream nvbug 6625710).

Upstream scenario: request A commits a prefix ending on a block boundary (so an ssm
snapshot is taken and handed to the tree, DROPPABLE at once), suspends while its tail
block is still a leaf; churn requests under a tight gpu ssm quota evict that unheld
snapshot; pruning then detaches blocks A still references.  A resumes and commits: its
chain must be re-attached (or switched to an equivalent block) so the new block lands in
the tree and A's prefix is reusable again.

Each variant asserts its precondition (the snapshot really was evicted) so it cannot pass
vacuously, and the post-state (the prefix is reusable again), not just "no crash"."""

from __future__ import annotations

from parity.helpers import (
    GPU,
    attached_keys,
    fill,
    hybrid_cfg,
    keys,
    of_kind,
    op,
    ops,
    orphan_keys,
    removed,
    ssm_cfg,
    stored,
    toks,
)

P = toks(16, base=100)  # request A's prompt and continuation
CHURN = [toks(8, base=1000 * (i + 1)) for i in range(3)]


def _start_a(mgr, ssm_lc: int):
    a = mgr.create_kv_cache(P[:8])
    assert a.resume() is True
    assert a.resize(8) is True
    a.commit(P[:8])  # ends on a block boundary: snapshot of block 1 (its tail, a leaf)
    assert [o for o in ops(mgr) if o[0] == ssm_lc] == [op(ssm_lc, GPU, 0, GPU, 1, "snapshot")]
    assert mgr.probe_reuse(P[:8]) == 8
    a.suspend()
    return a


def _churn(mgr, ssm_lc: int) -> None:
    for t in CHURN:
        fill(mgr, t)  # each churn snapshot needs the single free-able slot
    got = [o for o in ops(mgr) if o[0] == ssm_lc]
    assert got == [op(ssm_lc, GPU, 2, GPU, 1, "snapshot")] * len(CHURN)


def test_orphaned_block_regression_pure_ssm(make_manager):
    mgr = make_manager(ssm_cfg(gpu=3))  # live A (slot 0), snapshot (slot 1), one spare
    a = _start_a(mgr, 0)
    mgr.take_events()
    _churn(mgr, 0)
    k = keys(P[:16])
    # precondition: A's snapshot really was evicted, and with it A's (pure-ssm) blocks
    assert mgr.probe_reuse_detail(P[:8]).num_tokens < 8
    assert mgr.probe_reuse(P[:8]) == 0
    assert (k[1], 0) in removed(mgr.take_events())
    assert not ({k[0], k[1]} & attached_keys(mgr))
    assert sorted(orphan_keys(mgr)) == sorted(k[:2])
    mgr.check_invariants()

    assert a.resume() is True
    assert a.resize(12) is True
    a.commit(P[8:12])  # uses the orphaned block 1 as parent: re-attach, then insert
    assert ops(mgr) == [op(0, GPU, 0, GPU, 2, "snapshot")]
    # post-state: the committed prefix is reusable again
    assert mgr.probe_reuse(P[:12]) == 12
    assert mgr.probe_reuse(P[:8]) == 0  # block 1's snapshot is gone for good
    assert attached_keys(mgr) >= set(k[:3])
    assert orphan_keys(mgr) == []
    assert (k[2], 0) in stored(mgr.take_events())
    assert a.resize(16)
    a.commit(P[12:16])
    assert mgr.probe_reuse(P[:16]) == 16
    a.close()
    assert mgr.probe_reuse(P[:16]) == 16
    mgr.check_invariants()


def test_orphaned_block_regression_hybrid(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=3))
    a = _start_a(mgr, 1)
    _churn(mgr, 1)
    k = keys(P[:12])
    # precondition: the attention pages survive (A holds them), only the snapshot is gone
    d = mgr.probe_reuse_detail(P[:8])
    assert d.num_tokens_before_ssm == 8
    assert d.num_tokens < 8
    assert (k[1], 1) in removed(mgr.take_events())
    assert {k[0], k[1]} <= attached_keys(mgr)  # attention pages keep the blocks attached
    mgr.check_invariants()

    assert a.resume() is True
    assert a.resize(12) is True
    # lc 0 slots 2-7 hold the three churn prefixes; the oldest churn's block 1 (slot 3) goes
    assert a.page_indices(0) == [0, 1, 3]
    a.commit(P[8:12])
    assert ops(mgr) == [op(1, GPU, 0, GPU, 2, "snapshot")]
    assert mgr.probe_reuse(P[:12]) == 12
    assert mgr.probe_reuse_detail(P[:8]).num_tokens_before_ssm == 8
    assert sorted(stored(mgr.take_events())) == sorted([(k[2], 0), (k[2], 1)])
    a.close()
    assert mgr.probe_reuse(P[:12]) == 12
    mgr.check_invariants()


def test_orphaned_block_switches_to_concurrently_committed_equivalent(make_manager):
    mgr = make_manager(ssm_cfg(gpu=3))
    a = _start_a(mgr, 0)
    fill(mgr, CHURN[0])  # evicts A's snapshot: A's blocks are orphans
    assert mgr.probe_reuse(P[:8]) == 0
    k = keys(P[:12])
    mgr.drain_copy_ops()
    # B commits the same prefix while A's blocks are orphaned: new, equivalent blocks
    fill(mgr, P[:8])
    assert ops(mgr) == [op(0, GPU, 2, GPU, 1, "snapshot")]  # churn snapshot evicted
    assert mgr.probe_reuse(P[:8]) == 8
    assert sorted(orphan_keys(mgr)) == sorted(k[:2])  # A still holds its own orphans
    mgr.take_events()
    assert a.resume() is True
    assert a.resize(12)
    a.commit(P[8:12])  # re-attachment finds B's blocks and switches to them
    assert ops(mgr) == [op(0, GPU, 0, GPU, 2, "snapshot")]
    ev = mgr.take_events()
    assert removed(ev) == []  # B's snapshot is untouched
    assert stored(ev) == [(k[2], 0)]
    assert all(e.kind == "stored" for e in ev)
    assert mgr.probe_reuse(P[:8]) == 8
    assert mgr.probe_reuse(P[:12]) == 12
    assert orphan_keys(mgr) == []  # A's old orphans are no longer referenced
    assert attached_keys(mgr) == set(k)
    a.close()
    assert mgr.probe_reuse(P[:12]) == 12
    mgr.check_invariants()


def test_orphaned_block_regression_while_request_active(make_manager):
    """Same bug without suspending: A stays ACTIVE (its live state LOCKED) while a
    concurrent request's snapshot evicts A's unheld snapshot."""
    mgr = make_manager(ssm_cfg(gpu=3))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(12)
    a.commit(P[:8])
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(8)
    b.commit(CHURN[0])  # slots: 0 A live, 1 A's snapshot, 2 B live -> A's snapshot evicted
    assert ops(mgr)[-1] == op(0, GPU, 2, GPU, 1, "snapshot")
    assert mgr.probe_reuse(P[:8]) == 0
    b.close()
    a.commit(P[8:12])
    assert mgr.probe_reuse(P[:12]) == 12
    assert len(of_kind(mgr.take_events(), "stored")) >= 1
    a.close()
    mgr.check_invariants()
