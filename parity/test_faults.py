"""SPEC sec. 15: a copy that did not complete is reported with ``forget_copies`` and the
manager forgets exactly the pages it was meant to fill (DECISIONS.md "Failed copies").

One scenario per op reason (offload of a DROPPABLE / HELD / private page, onboard,
copy-on-write of an attention page and of an ssm snapshot, snapshot), the roll-back of
the requests that used a lost page (shared pages, windowed layers, the live ssm state),
and bad input (nothing changes)."""

from __future__ import annotations

import pytest
from kvcm import AttentionLayer, CopyOp, KVCacheManagerConfig, Status, Tier

from parity.helpers import (
    GPU,
    HOST,
    B,
    attached_keys,
    attn_cfg,
    fill,
    hybrid_cfg,
    keys,
    lc_stats,
    removed,
    snap,
    ssm_cfg,
    stored,
    toks,
    unchanged,
)

P = toks(12, base=100)
Q = toks(12, base=200)
R = toks(12, base=300)


def _only(ops, reason, **fields) -> CopyOp:
    """The single drained op with ``reason`` (and the given field values)."""
    hits = [o for o in ops if o.reason == reason and all(getattr(o, k) == v for k, v in fields.items())]
    assert len(hits) == 1, (reason, fields, ops)
    return hits[0]


def test_failed_offload_of_a_droppable_page_forgets_its_block(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=4))
    fill(mgr, P[:8])
    mgr.drain_copy_ops()
    fill(mgr, Q[:8])  # evicts P's two pages to host
    ops = mgr.drain_copy_ops()
    assert [o.reason for o in ops] == ["offload", "offload"]
    lost = _only(ops, "offload", src_slot=0)  # block 0 of P
    mgr.take_events()
    assert mgr.probe_reuse(P[:8]) == 8
    assert mgr.forget_copies([lost]) == []  # no request used it
    # full attention: the whole subtree below the lost block goes (sec. 5)
    assert mgr.probe_reuse(P[:8]) == 0
    assert removed(mgr.take_events()) == [(keys(P[:8])[0], 0), (keys(P[:8])[1], 0)]
    assert attached_keys(mgr) == set(keys(Q[:8]))
    st = lc_stats(mgr.stats(), 0)
    assert st["lost_pages"] == 1 and st["drops"] == 1  # the other page went with the subtree
    assert mgr.probe_reuse(Q[:8]) == 8
    mgr.check_invariants()


def test_failed_offload_of_a_held_page_rolls_back_its_suspended_request(make_manager):
    mgr = make_manager(attn_cfg(gpu=3, host=4))
    a = mgr.create_kv_cache(id="a")
    assert a.resume() and a.resize(10)
    a.commit(P[:10])  # blocks 0, 1 committed, block 2 private (2 tokens written)
    a.suspend()
    b = mgr.create_kv_cache(id="b")
    assert b.resume() and b.resize(12)  # needs all 3 gpu slots: a's pages go to host
    ops = mgr.drain_copy_ops()
    assert [o.reason for o in ops] == ["offload"] * 3
    # lose block 1's page: a rolls back to before it (4 tokens) and is matched again
    lost = [o for o in ops if o.src_slot == 1]
    assert mgr.forget_copies(lost) == ["a"]
    assert a.status == Status.SUSPENDED
    assert a.committed_tokens == P[:4] and a.capacity == a.history_length == 4
    assert a.num_reused_tokens == 0  # the create-time count
    assert mgr.probe_reuse(P[:8]) == 4
    mgr.check_invariants()
    # the private page of block 2 was released, block 0 stays held (on host)
    b.close()
    assert a.resume() and a.resize(10)
    back = mgr.drain_copy_ops()
    assert [o.reason for o in back] == ["onboard"]
    a.commit(P[4:10])
    assert mgr.probe_reuse(P[:8]) == 8
    mgr.check_invariants()


def test_failed_offload_of_a_private_page_rolls_back_to_its_block(make_manager):
    mgr = make_manager(attn_cfg(gpu=3, host=4))
    a = mgr.create_kv_cache(id="a")
    assert a.resume() and a.resize(10)
    idx = a.page_indices(0)
    a.commit(P[:10])
    a.suspend()
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(12)
    ops = mgr.drain_copy_ops()
    lost = [o for o in ops if o.src_slot == idx[2]]  # the uncommitted tail page
    assert mgr.forget_copies(lost) == ["a"]
    assert a.committed_tokens == P[:8] and a.capacity == 8
    assert mgr.probe_reuse(P[:8]) == 8  # committed blocks untouched
    assert lc_stats(mgr.stats(), 0)["lost_pages"] == 1
    mgr.check_invariants()


def test_failed_onboard_forgets_the_page_and_rolls_back_every_user(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=6))
    fill(mgr, P[:8])
    fill(mgr, Q[:8])  # P's pages on host
    mgr.drain_copy_ops()
    a = mgr.create_kv_cache(P[:8] + [1], id="a")
    b = mgr.create_kv_cache(P[:8] + [2], id="b")  # shares both pages (HELD)
    c = mgr.create_kv_cache(P[:4] + [3], id="c")  # shares block 0 only
    assert a.resume()
    ops = mgr.drain_copy_ops()
    onboards = [o for o in ops if o.reason == "onboard"]
    assert len(onboards) == 2
    mgr.take_events()
    lost = onboards[1]  # block 1 of P
    assert mgr.forget_copies([lost]) == ["a", "b"]  # c does not use block 1
    assert removed(mgr.take_events()) == [(keys(P[:8])[1], 0)]
    for kv in (a, b):
        assert kv.status == Status.SUSPENDED and kv.committed_tokens == P[:4] and kv.capacity == 4
    assert c.committed_tokens == P[:4]
    assert mgr.probe_reuse(P[:8]) == 4
    mgr.check_invariants()
    assert a.resume() and a.resize(8)  # block 0 is still on gpu: no copy
    assert mgr.drain_copy_ops() == []
    a.commit(P[4:8])
    assert (keys(P[:8])[1], 0) in stored(mgr.take_events())
    mgr.check_invariants()


def test_failed_cow_of_a_partial_block_rolls_back_the_request(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:6])  # block 1 is a partial block of 2 tokens
    kv = mgr.create_kv_cache(P[:8], id="k")
    assert kv.num_committed_tokens == 6
    assert kv.resume()
    ops = mgr.drain_copy_ops()
    cow = _only(ops, "cow")
    assert mgr.forget_copies([cow]) == ["k"]
    assert kv.committed_tokens == P[:4] and kv.status == Status.SUSPENDED
    assert mgr.probe_reuse(P[:6]) == 6  # the source (a tree page) is intact
    assert lc_stats(mgr.stats(), 0)["lost_pages"] == 1
    assert kv.resume() and mgr.drain_copy_ops() == []  # matched at a block boundary: no cow
    mgr.check_invariants()


def test_failed_snapshot_forgets_the_snapshot_not_the_live_state(make_manager):
    mgr = make_manager(ssm_cfg(gpu=4))
    kv = mgr.create_kv_cache(id="k")
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:4])
    snap_op = _only(mgr.drain_copy_ops(), "snapshot")
    assert mgr.probe_reuse(P[:4]) == 4
    mgr.take_events()
    assert mgr.forget_copies([snap_op]) == []  # the live state is fine
    assert removed(mgr.take_events()) == [(keys(P[:4])[0], 0)]
    assert mgr.probe_reuse(P[:4]) == 0
    assert kv.status == Status.ACTIVE and kv.num_committed_tokens == 4
    mgr.check_invariants()
    kv.commit(P[4:8])  # re-attaches the pageless block 0 as the new block's parent
    assert mgr.probe_reuse(P[:8]) == 8
    mgr.check_invariants()


def test_failed_cow_of_a_snapshot_restarts_from_the_snapshot(make_manager):
    """The live ssm state is lost: the request rolls back to where a snapshot exists."""
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=4))
    fill(mgr, P[:8], chunks=[4, 4])  # snapshots at 4 and 8
    mgr.drain_copy_ops()
    kv = mgr.create_kv_cache(P[:8] + [1], id="k")
    assert kv.num_committed_tokens == 8
    assert kv.resume()
    cow = _only(mgr.drain_copy_ops(), "cow", lc=1)
    assert mgr.forget_copies([cow]) == ["k"]
    # the snapshot at 8 (the copy's source) is intact: matched again, copied again on resume
    assert kv.committed_tokens == P[:8] and kv.status == Status.SUSPENDED
    assert kv.resume()
    assert [o.reason for o in mgr.drain_copy_ops()] == ["cow"]
    mgr.check_invariants()


def test_lost_snapshot_rolls_back_to_an_earlier_snapshot(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=4))
    kv = mgr.create_kv_cache(id="w")
    assert kv.resume() and kv.resize(12)
    kv.commit(P[:4])
    kv.commit(P[4:8])  # snapshots at 4 and 8
    snap8 = [o for o in mgr.drain_copy_ops() if o.reason == "snapshot"][-1]
    kv.commit(P[8:12])
    snap12 = _only(mgr.drain_copy_ops(), "snapshot")
    reader = mgr.create_kv_cache(P[:12] + [1], id="r")
    assert reader.num_committed_tokens == 12
    assert mgr.forget_copies([snap12]) == ["r"]
    assert reader.committed_tokens == P[:8]  # the snapshot at 8 is the latest left
    with pytest.raises(ValueError):  # only the ops of the last drain can be reported
        mgr.forget_copies([snap8])
    assert kv.num_committed_tokens == 12 and kv.status == Status.ACTIVE  # its live state is fine
    mgr.check_invariants()


def test_windowed_request_rolls_back_to_pages_it_can_still_read(make_manager):
    """Window 4, B 4: after 12 tokens blocks 0..1 are stale (released, still DROPPABLE in
    the tree).  Losing block 2 rolls back to 8, where block 1 is needed again: the re-match
    holds it from the tree."""
    cfg = KVCacheManagerConfig(tokens_per_block=B, layers=[AttentionLayer(0, 1, window=4)],
                               tiers=[Tier("gpu", 4 * B), Tier("host", 8 * B)])
    mgr = make_manager(cfg)
    a = mgr.create_kv_cache(id="a")
    assert a.resume() and a.resize(12)
    a.commit(P[:12])
    assert a.page_indices(0)[:2] == [-1, -1]
    a.suspend()
    b = mgr.create_kv_cache(id="b")
    assert b.resume() and b.resize(16)  # every page of a goes to host
    ops = mgr.drain_copy_ops()
    assert len(ops) == 3 and all(o.reason == "offload" for o in ops)  # a's page + 2 stale ones
    b.close()
    assert a.resume()
    onboard = _only(mgr.drain_copy_ops(), "onboard")  # block 2, the only page a uses
    assert mgr.forget_copies([onboard]) == ["a"]
    assert a.committed_tokens == P[:8] and a.history_length == 8
    assert a.resume()
    assert len(a.page_indices(0)) == 2 and a.page_indices(0)[0] == -1 and a.page_indices(0)[1] >= 0
    mgr.check_invariants()


def test_forget_copies_finds_the_page_after_later_calls(make_manager):
    """The ops name slots, the manager remembers the pages: a page that moved on after the
    drain is still the one forgotten."""
    mgr = make_manager(attn_cfg(gpu=2, host=2, disk=4))
    fill(mgr, P[:8])
    fill(mgr, Q[:8])  # P -> host
    ops = mgr.drain_copy_ops()
    fill(mgr, R[:8])  # Q -> host, P -> disk
    assert any(o.reason == "offload" and o.src_tier == HOST for o in mgr.drain_copy_ops())
    with pytest.raises(ValueError):  # the earlier drain is no longer reportable
        mgr.forget_copies(ops[:1])
    mgr.check_invariants()


def test_forget_copies_bad_input_changes_nothing(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=4))
    fill(mgr, P[:8])
    fill(mgr, Q[:8])
    ops = mgr.drain_copy_ops()
    good = ops[0]
    never = CopyOp(0, GPU, 1, HOST, 3, "offload")
    assert never not in ops
    unchanged(mgr, lambda: mgr.forget_copies(good), TypeError)  # not a list
    unchanged(mgr, lambda: mgr.forget_copies("abc"), TypeError)
    unchanged(mgr, lambda: mgr.forget_copies([good, good.to_json()]), TypeError)
    unchanged(mgr, lambda: mgr.forget_copies([CopyOp(0.0, 0, 0, 1, 0, "offload")]), TypeError)
    unchanged(mgr, lambda: mgr.forget_copies([CopyOp(True, 0, 0, 1, 0, "offload")]), TypeError)
    unchanged(mgr, lambda: mgr.forget_copies([CopyOp(0, 0, 0, 1, 0, b"offload")]), TypeError)
    unchanged(mgr, lambda: mgr.forget_copies([good, never]), ValueError)  # never issued
    unchanged(mgr, lambda: mgr.forget_copies([good, good]), ValueError)  # issued once
    unchanged(mgr, lambda: mgr.forget_copies([CopyOp(0, 0, 2**70, 1, 0, "offload")]), ValueError)
    unchanged(mgr, lambda: mgr.forget_copies([CopyOp(0, 0, 0, 1, 0, "offload\0")]), ValueError)
    before = snap(mgr)
    assert mgr.forget_copies([]) == [] and mgr.forget_copies(()) == []
    assert snap(mgr) == before  # an empty report changes nothing (no tick)
    assert mgr.forget_copies([good]) == []
    unchanged(mgr, lambda: mgr.forget_copies([good]), ValueError)  # already reported
    mgr.check_invariants()
