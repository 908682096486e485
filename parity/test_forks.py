"""Issue 22 / SPEC sec. 18 (+ DECISIONS.md "Forks (issue 22)"): ``KVCache.fork()``.

Each scenario runs on both backends and pins exact page indices, copy ops, pool counts and
events; the differential (parity/test_differential.py) draws forks and beam steps too.
"""

from __future__ import annotations

import pytest
from kvcm import ClosedError, InvalidStateError, OutOfPagesError, Status

from parity.helpers import (
    GPU,
    attn_cfg,
    counts,
    fill,
    hybrid_cfg,
    keys,
    op,
    ops,
    snap,
    ssm_cfg,
    stored,
    toks,
    tree_nodes,
    unchanged,
    win_cfg,
)

P = toks(16, base=100)


def active(mgr, tokens, capacity=None):
    """A fresh ACTIVE cache that wrote and committed ``tokens`` (capacity: its room)."""
    kv = mgr.create_kv_cache()
    assert kv.resume() is True
    assert kv.resize(len(tokens)) is True
    kv.commit(tokens)
    if capacity is not None:
        assert kv.resize(capacity) is True
    ops(mgr)
    mgr.take_events()
    return kv


def test_fork_shares_committed_blocks_and_the_partial_page(make_manager):
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:6])  # block 0 in the tree (slot 0), block 1 partial (slot 1)
    before = counts(mgr)
    f = kv.fork()
    assert f.status is Status.ACTIVE and f.id == 1 and f.priority == kv.priority
    assert (f.capacity, f.history_length, f.num_committed_tokens) == (6, 6, 6)
    assert f.committed_tokens == P[:6] and f.num_reused_tokens == kv.num_reused_tokens == 0
    assert f.page_indices(0) == kv.page_indices(0) == [0, 1]
    assert ops(mgr) == [] and mgr.take_events() == []  # nothing copied, the tree unchanged
    assert counts(mgr) == before  # the same two LOCKED slots, locked twice
    pages = {r["serial"]: r["pages"]["0"] for r in snap(mgr)["requests"]}
    assert pages[0] == pages[1]
    mgr.check_invariants()


def test_first_write_into_a_shared_partial_page_copies_it_and_the_last_does_not(make_manager):
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:6])
    f = kv.fork()
    assert f.resize(7) is True  # the fork writes first: it copies
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    assert f.page_indices(0) == [0, 2]
    assert mgr.stats()["lc"][0]["cows"] == 1
    assert kv.resize(7) is True  # the parent is the page's only user now: no copy
    assert ops(mgr) == [] and kv.page_indices(0) == [0, 1]
    f.commit([7])
    kv.commit([8])
    assert f.committed_tokens == P[:6] + [7] and kv.committed_tokens == P[:6] + [8]
    # both branches complete their block 1: two different children of block 0
    assert f.resize(8) and kv.resize(8)
    f.commit([9])
    kv.commit([9])
    k7, k8 = keys(P[:6] + [7, 9])[1], keys(P[:6] + [8, 9])[1]
    assert stored(mgr.take_events()) == [(k7, 0), (k8, 0)]
    assert mgr.probe_reuse(P[:6] + [7, 9]) == mgr.probe_reuse(P[:6] + [8, 9]) == 8
    mgr.check_invariants()


def test_parent_writes_first_and_copies(make_manager):
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:6])
    f = kv.fork()
    assert kv.resize(8) is True
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    assert kv.page_indices(0) == [0, 2] and f.page_indices(0) == [0, 1]
    assert f.resize(8) is True and ops(mgr) == []
    mgr.check_invariants()


def test_fork_with_room_beyond_the_committed_tokens_copies_at_once(make_manager):
    # the parent may already be writing past its committed tokens: the fork's copy is taken now
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:6], capacity=8)
    f = kv.fork()
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    assert f.capacity == 6 and f.page_indices(0) == [0, 2] and kv.page_indices(0) == [0, 1]
    assert f.resize(8) is True and ops(mgr) == []  # its partial page is its own already
    mgr.check_invariants()


def test_fork_on_a_block_boundary_copies_nothing(make_manager):
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:8], capacity=9)
    f = kv.fork()
    assert f.page_indices(0) == [0, 1]
    assert f.resize(9) is True and kv.page_indices(0) == [0, 1, 2]
    assert f.page_indices(0) == [0, 1, 3] and ops(mgr) == []
    mgr.check_invariants()


def test_resize_without_room_beyond_the_committed_tokens_does_not_copy(make_manager):
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:6])
    f = kv.fork()
    assert f.resize(6) is True and ops(mgr) == []
    assert f.page_indices(0) == kv.page_indices(0) == [0, 1]
    mgr.check_invariants()


def test_copy_on_write_out_of_pages_is_all_or_nothing(make_manager):
    # without partial reuse a close leaves the partial page private: the last user keeps it
    mgr = make_manager(attn_cfg(gpu=2, enable_partial_reuse=False))
    kv = active(mgr, P[:6])
    f = kv.fork()
    before = snap(mgr)
    assert f.resize(7) is False  # the copy needs a third slot
    assert snap(mgr) == before
    assert kv.resize(7) is False and snap(mgr) == before
    f.close()
    assert kv.resize(7) is True and ops(mgr) == []  # its partial page is its own alone now
    assert kv.page_indices(0) == [0, 1]
    mgr.check_invariants()


def test_closing_the_parent_keeps_the_forks_pages(make_manager):
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:6])
    f = kv.fork()
    kv.close()  # its tail enters the tree as a partial block, with the shared page
    assert f.page_indices(0) == [0, 1]
    assert counts(mgr) == (6, 4, 2, 0, 0)
    assert f.resize(7) is True  # a tree page now: copied before the fork writes
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    f.commit([7])
    f.close()
    assert mgr.probe_reuse(P[:6]) == 6 and mgr.probe_reuse(P[:6] + [7]) == 7
    mgr.check_invariants()


def test_closing_the_fork_keeps_the_parents_pages(make_manager):
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:6])
    f = kv.fork()
    f.close()
    assert kv.page_indices(0) == [0, 1] and counts(mgr) == (6, 4, 2, 0, 0)
    assert kv.resize(7) is True  # the fork's close put the partial page into the tree: copied
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    mgr.check_invariants()


def test_last_fork_closing_moves_its_shared_partial_page_out_of_a_detached_block(make_manager):
    # The fault: a fork's partial page that another user's close put into the tree, in a
    # block detached since (a longer sibling covered it, then was dropped), was installed
    # by the fork's own close in a new block while the detached one still held it
    # (check_invariants: "page not linked back").  The page moves into the new block.
    mgr = make_manager(attn_cfg(gpu=8))
    kv = active(mgr, P[:6])  # block 0 (slot 0), partial block 1 (slot 1)
    f1, f2 = kv.fork(), kv.fork()  # both use slot 1 too
    assert kv.resize(7) is True  # the parent writes first: its own copy (slot 2)
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    kv.commit([7])
    f2.close()  # block P[4:6] enters the tree with slot 1, still used by f1
    kv.close()  # block P[4:7] covers it: P[4:6] is detached, slot 1 stays with it for f1
    mgr.clear_reusable()  # P[4:7] goes
    mgr.take_events()
    assert [n["tokens"] for n in tree_nodes(mgr) if n["attached"]] == [P[:4]]
    f1.close()
    mgr.check_invariants()
    # the partial block is back in the tree with slot 1, held by that block alone
    blocks = [(n["tokens"], n["pages"][0]["page"]) for n in tree_nodes(mgr)]
    slot1 = next(p["serial"] for p in snap(mgr)["pages"] if p["slot"] == 1)
    assert blocks == [(P[:4], 0), (P[4:6], slot1)]
    assert stored(mgr.take_events()) == [(keys(P[:6])[1], 0)]
    assert counts(mgr) == (8, 6, 0, 0, 2)
    assert mgr.probe_reuse(P[:6]) == 6


def test_fork_of_a_stopped_cache_closing_moves_the_page_out_of_its_detached_tail_block(make_manager):
    # The same fault where the closing fork references the detached block (it forked a
    # stopped cache, whose tail block it shares): the page moves, the block dies with the
    # fork's reference.
    mgr = make_manager(attn_cfg(gpu=8))
    kv = active(mgr, P[:6])
    kv.stop_committing()  # block P[4:6] in the tree with slot 1
    f, f2 = kv.fork(), kv.fork()
    assert f2.resize(7) is True  # a tree page: copied (slot 2)
    f2.commit([7])
    f2.close()  # block P[4:7] covers P[4:6]: detached, still used by kv and f
    mgr.clear_reusable()  # P[4:7] goes
    kv.close()
    mgr.take_events()
    f.close()
    mgr.check_invariants()
    slot1 = next(p["serial"] for p in snap(mgr)["pages"] if p["slot"] == 1)
    assert [(n["tokens"], n["pages"][0]["page"]) for n in tree_nodes(mgr)] == [(P[:4], 0), (P[4:6], slot1)]
    assert stored(mgr.take_events()) == [(keys(P[:6])[1], 0)]
    assert counts(mgr) == (8, 6, 0, 0, 2)
    assert mgr.probe_reuse(P[:6]) == 6


def test_fork_of_a_stopped_cache_can_commit(make_manager):
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:6])
    kv.stop_committing()
    f = kv.fork()
    assert f.page_indices(0) == [0, 1]
    assert f.resize(8) is True
    assert ops(mgr) == [op(0, GPU, 1, GPU, 2, "cow")]
    f.commit([1, 2])
    with pytest.raises(InvalidStateError):
        kv.commit([1])
    mgr.check_invariants()


def test_fork_is_suspended_resumed_and_closed_like_any_cache(make_manager):
    mgr = make_manager(attn_cfg(gpu=4, host=4))
    kv = active(mgr, P[:6])
    f = kv.fork()
    f.suspend()
    kv.close()
    fill(mgr, toks(16, base=500))  # pressure: the fork's HELD pages go to host
    assert counts(mgr, GPU) == (4, 0, 0, 0, 4)
    moved = ops(mgr)
    assert [o[5] for o in moved].count("offload") == 2
    assert f.resume() is True
    assert [o[5] for o in ops(mgr)].count("onboard") == 2
    assert f.resize(7) is True and ops(mgr)[-1][5] == "cow"
    f.commit([3])
    f.close()
    mgr.check_invariants()


def test_fork_of_a_windowed_cache_shares_the_non_stale_blocks(make_manager):
    mgr = make_manager(win_cfg(gpu=8, window=4, sinks=0))
    kv = active(mgr, P[:10])
    assert kv.page_indices(0) == [-1, 1, 2]
    f = kv.fork()
    assert f.page_indices(0) == [-1, 1, 2] and ops(mgr) == []
    assert f.resize(11) is True
    assert f.page_indices(0) == [-1, 1, 3]  # (slot 0: block 0's stale page, DROPPABLE)
    assert ops(mgr) == [op(0, GPU, 2, GPU, 3, "cow")]
    mgr.check_invariants()


def test_ssm_fork_gets_its_own_live_state(make_manager):
    mgr = make_manager(ssm_cfg(gpu=6))
    kv = active(mgr, P[:6])
    live = kv.page_indices(0)
    f = kv.fork()
    (fl,) = f.page_indices(0)
    assert fl not in live
    assert ops(mgr) == [op(0, GPU, live[0], GPU, fl, "cow")]
    assert mgr.stats()["lc"][0]["cows"] == 1
    assert f.resize(7) is True and ops(mgr) == []  # no attention page to copy
    mgr.check_invariants()


def test_hybrid_fork_copies_the_live_state_then_the_partial_page(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=4))
    kv = active(mgr, P[:6], capacity=8)  # room: the partial page is copied at once too
    assert kv.page_indices(0) == [0, 1] and kv.page_indices(1) == [0]
    f = kv.fork()
    assert ops(mgr) == [op(1, GPU, 0, GPU, 1, "cow"), op(0, GPU, 1, GPU, 2, "cow")]
    assert f.page_indices(0) == [0, 2] and f.page_indices(1) == [1]
    mgr.check_invariants()


def test_ssm_fork_out_of_pages_raises_and_changes_nothing(make_manager):
    mgr = make_manager(ssm_cfg(gpu=1))
    kv = active(mgr, P[:4])  # the live state holds the only slot (no snapshot fits)
    err = unchanged(mgr, kv.fork, OutOfPagesError)
    assert "fork()" in str(err)


@pytest.mark.parametrize("state", ["suspended", "closed", "history", "id_in_use", "id_type"])
def test_fork_in_a_bad_state_raises_and_changes_nothing(make_manager, state):
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:6])
    if state == "suspended":
        kv.suspend()
        unchanged(mgr, kv.fork, InvalidStateError)
    elif state == "closed":
        kv.close()
        unchanged(mgr, kv.fork, ClosedError)
    elif state == "history":
        assert kv.resize(8, history_length=7) is True
        err = unchanged(mgr, kv.fork, InvalidStateError)
        assert "history_length 7" in str(err)
    elif state == "id_in_use":
        other = mgr.create_kv_cache(id="x")
        unchanged(mgr, lambda: kv.fork(id="x"), ValueError)
        unchanged(mgr, lambda: kv.fork(id=kv.id), ValueError)
        other.close()
        assert kv.fork(id="x").id == "x"
    else:
        unchanged(mgr, lambda: kv.fork(id=1.5), TypeError)


def test_fork_ids_follow_create(make_manager):
    mgr = make_manager(attn_cfg(gpu=6))
    kv = active(mgr, P[:6])
    a = kv.fork()
    b = a.fork(id="beam")
    c = kv.fork()
    assert (kv.id, a.id, b.id, c.id) == (0, 1, "beam", 3)
    assert [r["id"] for r in snap(mgr)["requests"]] == [0, 1, "beam", 3]
    for x in (kv, a, b, c):
        x.close()
    mgr.check_invariants()
