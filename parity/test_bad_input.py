"""SPEC sec. 10 (+ DECISIONS "Status rules"): every public call rejects bad arguments and
wrong-status calls with the documented error and changes nothing (snapshot() equal)."""

from __future__ import annotations

import numpy as np
import pytest
from kvcm import ClosedError, InvalidStateError, ReuseScope, Status

from parity.helpers import attn_cfg, fill, hybrid_cfg, ssm_cfg, toks, unchanged

P = toks(16, base=100)

BAD_TOKEN_LISTS = [
    ([-1], ValueError),
    ([2**31], ValueError),
    ([1, 2, 3, 2**40], ValueError),
    ([True], TypeError),
    ([1.0], TypeError),
    (["a"], TypeError),
    ([None], TypeError),
    ([b"\x00" * 31], ValueError),
    ([b"\x00" * 33], ValueError),
    ("abcd", TypeError),
    (b"\x00" * 32, TypeError),
    (5, TypeError),
]


def _busy(make_manager, cfg=None):
    """A manager with some state: a tree, an active and a suspended cache."""
    mgr = make_manager(cfg or attn_cfg(gpu=8))
    fill(mgr, P[:8])
    active = mgr.create_kv_cache(P[:8])
    assert active.resume() and active.resize(12)
    active.commit(P[8:10])
    suspended = mgr.create_kv_cache(P[:6])
    return mgr, active, suspended


def test_create_kv_cache_rejects_bad_tokens(make_manager):
    mgr, _, _ = _busy(make_manager)
    for tokens, exc in BAD_TOKEN_LISTS:
        unchanged(mgr, lambda t=tokens: mgr.create_kv_cache(t), exc)
    mgr.check_invariants()


def test_create_kv_cache_rejects_bad_scope_priority_and_id(make_manager):
    mgr, active, _ = _busy(make_manager)
    unchanged(mgr, lambda: mgr.create_kv_cache(P[:4], scope="lora"), TypeError)
    unchanged(mgr, lambda: mgr.create_kv_cache(P[:4], scope=0), TypeError)
    unchanged(mgr, lambda: mgr.create_kv_cache(P[:4], priority=101), ValueError)
    unchanged(mgr, lambda: mgr.create_kv_cache(P[:4], priority=-1), ValueError)
    unchanged(mgr, lambda: mgr.create_kv_cache(P[:4], priority=50.0), TypeError)
    unchanged(mgr, lambda: mgr.create_kv_cache(P[:4], priority=True), TypeError)
    unchanged(mgr, lambda: mgr.create_kv_cache(P[:4], id=active.id), ValueError)  # id of an open cache
    unchanged(mgr, lambda: mgr.create_kv_cache(P[:4], id=1.5), TypeError)
    with pytest.raises(ValueError):
        ReuseScope(lora_id=-1)
    with pytest.raises(ValueError):
        ReuseScope(salt=2**64)
    mgr.check_invariants()


def test_probe_rejects_bad_arguments(make_manager):
    mgr, _, _ = _busy(make_manager)
    for tokens, exc in BAD_TOKEN_LISTS:
        unchanged(mgr, lambda t=tokens: mgr.probe_reuse(t), exc)
        unchanged(mgr, lambda t=tokens: mgr.probe_reuse_detail(t), exc)
    unchanged(mgr, lambda: mgr.probe_reuse(P[:4], scope=3), TypeError)
    unchanged(mgr, lambda: mgr.probe_reuse_detail(P[:4], scope="x"), TypeError)
    mgr.check_invariants()


def test_resume_of_active_cache_raises(make_manager):
    mgr, active, _ = _busy(make_manager)
    unchanged(mgr, active.resume, InvalidStateError)
    mgr.check_invariants()


def test_suspend_of_suspended_cache_raises(make_manager):
    mgr, _, suspended = _busy(make_manager)
    unchanged(mgr, suspended.suspend, InvalidStateError)
    mgr.check_invariants()


def test_resize_of_suspended_cache_raises(make_manager):
    mgr, _, suspended = _busy(make_manager)
    unchanged(mgr, lambda: suspended.resize(12), InvalidStateError)
    mgr.check_invariants()


def test_resize_rejects_bad_capacity_and_history(make_manager):
    mgr, active, _ = _busy(make_manager)
    # active: committed 10, history 10, capacity 12
    assert (active.num_committed_tokens, active.history_length, active.capacity) == (10, 10, 12)
    unchanged(mgr, lambda: active.resize(-1), ValueError)
    unchanged(mgr, lambda: active.resize(9), ValueError)  # below history
    unchanged(mgr, lambda: active.resize(12, history_length=13), ValueError)  # history > capacity
    unchanged(mgr, lambda: active.resize(12, history_length=9), ValueError)  # history shrinks
    unchanged(mgr, lambda: active.resize(12, history_length=-1), ValueError)
    unchanged(mgr, lambda: active.resize(12.0), TypeError)
    unchanged(mgr, lambda: active.resize("12"), TypeError)
    unchanged(mgr, lambda: active.resize(None), TypeError)
    unchanged(mgr, lambda: active.resize(12, history_length=11.0), TypeError)
    assert active.resize(11, history_length=11) is True  # the boundary is fine
    mgr.check_invariants()


def test_commit_beyond_capacity_raises(make_manager):
    mgr, active, _ = _busy(make_manager)
    unchanged(mgr, lambda: active.commit(P[10:13]), ValueError)
    unchanged(mgr, lambda: active.commit(toks(100)), ValueError)
    active.commit(P[10:12])  # exactly to capacity is fine
    unchanged(mgr, lambda: active.commit([1]), ValueError)
    mgr.check_invariants()


def test_commit_rejects_bad_tokens(make_manager):
    mgr, active, _ = _busy(make_manager)
    for tokens, exc in BAD_TOKEN_LISTS:
        unchanged(mgr, lambda t=tokens: active.commit(t), exc)
    unchanged(mgr, lambda: active.commit([1, -5]), ValueError)  # no prefix committed either
    assert active.num_committed_tokens == 10
    mgr.check_invariants()


def test_commit_of_suspended_cache_raises(make_manager):
    mgr, _, suspended = _busy(make_manager)
    unchanged(mgr, lambda: suspended.commit([1]), InvalidStateError)
    mgr.check_invariants()


def test_commit_after_stop_committing_raises(make_manager):
    mgr, active, _ = _busy(make_manager)
    active.stop_committing()
    unchanged(mgr, lambda: active.commit([1]), InvalidStateError)
    mgr.check_invariants()


def test_commit_of_nothing_is_a_no_op(make_manager):
    mgr, active, _ = _busy(make_manager)
    before = mgr.snapshot()
    active.commit([])
    assert mgr.snapshot() == before
    mgr.check_invariants()


def test_page_indices_rejects_unknown_lc_and_wrong_status(make_manager):
    mgr, active, suspended = _busy(make_manager)
    unchanged(mgr, lambda: active.page_indices(1), ValueError)
    unchanged(mgr, lambda: active.page_indices(-1), ValueError)
    unchanged(mgr, lambda: active.page_indices("0"), (TypeError, ValueError))
    unchanged(mgr, lambda: suspended.page_indices(0), InvalidStateError)
    out = np.zeros(8, dtype=np.int32)
    unchanged(mgr, lambda: suspended.page_indices_into(0, out), InvalidStateError)
    unchanged(mgr, lambda: active.page_indices_into(3, out), ValueError)
    mgr.check_invariants()


def test_page_indices_into_rejects_bad_buffers_without_writing(make_manager):
    mgr, active, _ = _busy(make_manager)
    small = np.full(2, -9, dtype=np.int32)  # 3 blocks needed
    unchanged(mgr, lambda: active.page_indices_into(0, small), ValueError)
    assert small.tolist() == [-9, -9]
    wide = np.full(8, -9, dtype=np.int64)
    unchanged(mgr, lambda: active.page_indices_into(0, wide), ValueError)
    assert wide.tolist() == [-9] * 8
    floats = np.zeros(8, dtype=np.float32)
    unchanged(mgr, lambda: active.page_indices_into(0, floats), ValueError)
    assert floats.tolist() == [0.0] * 8
    mgr.check_invariants()


def test_every_call_on_closed_cache_raises_closed_error(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=4))
    fill(mgr, P[:8])
    kv = mgr.create_kv_cache(P[:8])
    assert kv.resume()
    kv.close()
    assert kv.status is Status.CLOSED
    out = np.zeros(8, dtype=np.int32)
    for call in (
        kv.resume,
        kv.suspend,
        lambda: kv.resize(12),
        lambda: kv.commit([1]),
        lambda: kv.commit([]),
        kv.stop_committing,
        lambda: kv.page_indices(0),
        lambda: kv.page_indices(1),
        lambda: kv.page_indices_into(0, out),
    ):
        unchanged(mgr, call, ClosedError)
    before = mgr.snapshot()
    kv.close()  # idempotent, no tick
    assert mgr.snapshot() == before
    mgr.check_invariants()


def test_closed_error_takes_precedence_over_bad_arguments(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    kv.close()
    for call in (lambda: kv.resize(-1), lambda: kv.commit([-1]), lambda: kv.page_indices(7)):
        with pytest.raises((ClosedError, ValueError, TypeError)):
            call()
    mgr.check_invariants()


def test_stop_committing_is_allowed_when_suspended_and_only_once_effective(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:6])
    kv.suspend()
    kv.stop_committing()  # SUSPENDED is fine: the tail's pages are committed where they are
    assert mgr.probe_reuse(P[:6]) == 6
    before = mgr.snapshot()
    kv.stop_committing()  # already stopped: nothing happens (no tick)
    assert mgr.snapshot() == before
    assert kv.resume()
    unchanged(mgr, lambda: kv.commit([1]), InvalidStateError)
    mgr.check_invariants()


def test_shutdown_with_open_cache_raises(make_manager):
    mgr, active, suspended = _busy(make_manager)
    unchanged(mgr, mgr.shutdown, InvalidStateError)
    active.close()
    unchanged(mgr, mgr.shutdown, InvalidStateError)
    suspended.close()
    mgr.shutdown()
    mgr.check_invariants()


def test_failed_resume_and_resize_change_nothing(make_manager):
    mgr = make_manager(ssm_cfg(gpu=2))
    a = mgr.create_kv_cache()
    b = mgr.create_kv_cache()
    c = mgr.create_kv_cache()
    assert a.resume() and b.resume()  # both live slots taken (LOCKED)
    before = mgr.snapshot()
    assert c.resume() is False
    assert mgr.snapshot() == before
    assert c.status is Status.SUSPENDED
    a.close()
    assert c.resume() is True
    mgr.check_invariants()
