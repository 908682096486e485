"""Bad input changes nothing (SPEC sec. 2, 7, 10, 15; DECISIONS "Status rules", "Tokens",
"Integer arguments", "Resource bounds", "API shape", "Shut-down manager"): every public call
rejects bad arguments and wrong-status calls with the documented error -- the same answer,
error type and message on both backends, for huge, loose and hostile input too -- and a
failed call changes nothing (``snapshot()`` equal before and after).  By topic: tokens;
scopes, priorities and ids; sizes; page-index buffers; status rules and a shut-down manager."""

from __future__ import annotations

import array

import numpy as np
import pytest
from kvcm import ClosedError, InvalidStateError, ReuseScope, Status

from parity.helpers import B, attn_cfg, fill, hybrid_cfg, python_work, snap, ssm_cfg, toks, unchanged, win_cfg

P = toks(16, base=100)


def _busy(make_manager, cfg=None):
    """A manager with some state: a tree, an active and a suspended cache."""
    mgr = make_manager(cfg or attn_cfg(gpu=8))
    fill(mgr, P[:8])
    active = mgr.create_kv_cache(P[:8])
    assert active.resume() and active.resize(12)
    active.commit(P[8:10])
    suspended = mgr.create_kv_cache(P[:6])
    return mgr, active, suspended


def _active(mgr, capacity=8, prompt=()):
    kv = mgr.create_kv_cache(list(prompt))
    assert kv.resume() and kv.resize(capacity)
    return kv


def _raises(mgr, call, exc, message):
    """``call()`` raises exactly ``exc(message)`` and changes nothing."""
    err = unchanged(mgr, call, exc)
    assert type(err) is exc, type(err)
    assert str(err) == message
    return err


def _false_and_unchanged(mgr, call):
    before = snap(mgr)
    assert call() is False
    assert snap(mgr) == before
    mgr.check_invariants()


class Liar(int):
    """An int whose every overridable view of its value lies."""

    def __index__(self):
        return 0

    def __int__(self):
        return 0

    def __lt__(self, other):
        return False

    def __le__(self, other):
        return True

    def __ge__(self, other):
        return True

    def __gt__(self, other):
        return False

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0

    def __repr__(self):
        return "Liar()"

    __str__ = __repr__

    def __format__(self, spec):
        return "lie"


class Calls(list):
    """A token list that runs ``action`` when it is read (``yield 6; kv.suspend(); yield 7``)."""

    def __init__(self, items, action):
        super().__init__(items)
        self.action = action

    def __iter__(self):
        self.action()
        return super().__iter__()


class CallsArray:
    """An array-like whose ``tolist()`` calls back into the cache."""

    ndim = 1

    def __init__(self, items, action):
        self.items, self.action = items, action

    def tolist(self):
        self.action()
        return list(self.items)


# ---------------------------------------------------------------------------------------
# tokens: bad, loose and hostile token sequences (DECISIONS "Tokens"); tokens that call back
# ---------------------------------------------------------------------------------------


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


def test_create_kv_cache_rejects_bad_tokens(make_manager):
    mgr, _, _ = _busy(make_manager)
    for tokens, exc in BAD_TOKEN_LISTS:
        unchanged(mgr, lambda t=tokens: mgr.create_kv_cache(t), exc)
    mgr.check_invariants()


def test_commit_rejects_bad_tokens(make_manager):
    mgr, active, _ = _busy(make_manager)
    for tokens, exc in BAD_TOKEN_LISTS:
        unchanged(mgr, lambda t=tokens: active.commit(t), exc)
    unchanged(mgr, lambda: active.commit([1, -5]), ValueError)  # no prefix committed either
    assert active.num_committed_tokens == 10
    mgr.check_invariants()


LOOSE = [
    (None, "tokens must be a sequence of tokens, got NoneType"),
    ({1: 2, 3: 4}, "tokens must be a sequence of tokens, got dict"),
    ({1, 2}, "tokens must be a sequence of tokens, got set"),
    (frozenset({1}), "tokens must be a sequence of tokens, got frozenset"),
    (memoryview(b"abcd"), "tokens must be a sequence of tokens, got a memoryview of bytes"),
    (memoryview(bytearray(32)), "tokens must be a sequence of tokens, got a memoryview of bytearray"),
    (b"abcd", "tokens must be a sequence of tokens, got bytes"),
    (bytearray(b"ab"), "tokens must be a sequence of tokens, got bytearray"),
    ("abcd", "tokens must be a sequence of tokens, got str"),
    (5, "tokens must be a sequence of tokens, got int"),
    (np.zeros((2, 2), dtype=np.int32), "tokens must be a 1-D sequence of tokens, got a 2-D ndarray"),
    (np.zeros((1, 3), dtype=np.int64), "tokens must be a 1-D sequence of tokens, got a 2-D ndarray"),
    (np.array(5), "tokens must be a 1-D sequence of tokens, got a 0-D ndarray"),
    ([[1, 2]], "tokens: a token must be an int or 32 bytes, got list"),
    ([True], "tokens: a token must be an int or 32 bytes, got bool"),
    ([np.int64(3)], "tokens: a token must be an int or 32 bytes, got int64"),
    ([Liar(2**31)], "tokens: token 2147483648 out of range [0, 2**31)"),
    ([Liar(-4)], "tokens: token -4 out of range [0, 2**31)"),
    ([5, Liar(2**70)], f"tokens: token {2**70} out of range [0, 2**31)"),
]


@pytest.mark.parametrize("tokens,message", LOOSE, ids=[f"loose{i}" for i in range(len(LOOSE))])
def test_loose_token_inputs_are_refused_alike(make_manager, tokens, message):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:8])
    kv = _active(mgr, capacity=8)
    _raises(mgr, lambda: kv.commit(tokens), TypeError if "range" not in message else ValueError, message)
    probe_exc = TypeError if "range" not in message else ValueError
    _raises(mgr, lambda: mgr.probe_reuse(tokens), probe_exc, message)
    _raises(mgr, lambda: mgr.probe_reuse_detail(tokens), probe_exc, message)
    _raises(mgr, lambda: mgr.commit_batch([kv], tokens), probe_exc, message)
    if tokens is not None:
        _raises(mgr, lambda: mgr.create_kv_cache(tokens), probe_exc, "input_" + message)


ACCEPTED = [
    ("tuple", lambda t: tuple(t)),
    ("range", lambda t: range(t[0], t[0] + len(t))),
    ("list_subclass", lambda t: type("L", (list,), {})(t)),
    ("array_i", lambda t: array.array("i", t)),
    ("memoryview_of_array", lambda t: memoryview(array.array("i", t))),
    ("np_int32", lambda t: np.array(t, dtype=np.int32)),
    ("np_uint16", lambda t: np.array(t, dtype=np.uint16)),
    ("np_strided", lambda t: np.array([x for x in t for _ in (0, 1)], dtype=np.int64)[::2]),
    ("int_subclass_items", lambda t: [Liar(x) for x in t]),
]


@pytest.mark.parametrize("name,form", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_token_sequences_engines_use_are_accepted(make_manager, name, form):
    mgr = make_manager(attn_cfg(gpu=4))
    tokens = P[:6]
    kv = _active(mgr, capacity=8)
    kv.commit(form(tokens))
    assert kv.committed_tokens == tokens
    assert all(type(t) is int for t in kv.committed_tokens)
    kv.close()
    assert mgr.probe_reuse(form(tokens)) == 6  # the full block and the partial tail
    assert mgr.create_kv_cache(form(tokens)).num_reused_tokens == 6
    mgr.check_invariants()


def test_none_is_no_prompt_only_for_create(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache(None)
    assert kv.num_committed_tokens == 0
    assert kv.resume() and kv.resize(8)
    _raises(mgr, lambda: kv.commit(None), TypeError, "tokens must be a sequence of tokens, got NoneType")
    _raises(mgr, lambda: mgr.resize_batch([kv], None), TypeError,
            "resize_batch(): capacities must be a list or tuple of ints or an integer array, got NoneType")
    _raises(mgr, lambda: mgr.commit_batch([kv], None), TypeError, "tokens must be a sequence of tokens, got NoneType")


def test_lying_int_subclasses_are_read_by_value(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache(P[:4], priority=Liar(70), id=Liar(9))
    assert kv.priority == 70 and type(kv.priority) is int
    assert kv.id == 9 and type(kv.id) is int
    assert kv.resume()
    assert kv.resize(Liar(8), history_length=Liar(6)) is True
    assert (kv.capacity, kv.history_length) == (8, 6)
    assert kv.page_indices(Liar(0)) == [0, 1]
    assert mgr.resize_batch([kv], [Liar(12)], [Liar(6)]) == [True]
    assert kv.capacity == 12
    _raises(mgr, lambda: kv.resize(Liar(2**63)), ValueError, "capacity 9223372036854775808 is too large")
    _raises(mgr, lambda: kv.resize(Liar(-3)), ValueError, "capacity must be >= 0, got -3")
    _raises(mgr, lambda: mgr.resize_batch([kv], [Liar(-3)]), ValueError, "capacities[0] must be >= 0, got -3")
    _raises(mgr, lambda: kv.page_indices(Liar(1)), ValueError, "unknown life cycle 1; this model has 1")
    _raises(mgr, lambda: mgr.create_kv_cache(priority=Liar(101)), ValueError, "priority must be in 0..100, got 101")
    _raises(mgr, lambda: mgr.create_kv_cache(id=Liar(9)), ValueError, "id 9 is already used by an open cache")
    snap_ids = [r["id"] for r in snap(mgr)["requests"]]
    assert snap_ids == [9]


def test_iterators_and_generators_are_no_token_sequences(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = _active(mgr)

    def gen():
        yield 6
        kv.suspend()  # never reached: a generator is refused before it is read
        yield 7

    _raises(mgr, lambda: kv.commit(gen()), TypeError, "tokens must be a sequence of tokens, got generator")
    _raises(mgr, lambda: kv.commit(iter([6, 7])), TypeError, "tokens must be a sequence of tokens, got list_iterator")
    _raises(mgr, lambda: mgr.create_kv_cache(x for x in P), TypeError,
            "input_tokens must be a sequence of tokens, got generator")
    assert kv.status is Status.ACTIVE


@pytest.mark.parametrize("form", [Calls, CallsArray])
def test_tokens_that_suspend_the_cache_cannot_commit(make_manager, form):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = _active(mgr)
    seen = {}

    def suspend():
        kv.suspend()
        seen["mid"] = snap(mgr)

    with pytest.raises(InvalidStateError) as ei:
        kv.commit(form([6, 7], suspend))
    assert str(ei.value) == "commit() needs a ACTIVE cache, this one is SUSPENDED"
    assert snap(mgr) == seen["mid"]  # nothing after the callback's own suspend
    assert kv.status is Status.SUSPENDED and kv.num_committed_tokens == 0
    mgr.check_invariants()


@pytest.mark.parametrize("form", [Calls, CallsArray])
def test_tokens_that_close_or_stop_the_cache_cannot_commit(make_manager, form):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = _active(mgr, capacity=8)
    kv.commit(P[:2])
    seen = {}

    def close():
        kv.close()
        seen["mid"] = snap(mgr)

    with pytest.raises(ClosedError) as ei:
        kv.commit(form([6, 7], close))
    assert str(ei.value) == "commit() on a closed cache"
    assert snap(mgr) == seen["mid"]  # no tick, no tokens
    assert kv.committed_tokens == P[:2]

    kv2 = _active(mgr, capacity=8)

    def stop():
        kv2.stop_committing()
        seen["mid"] = snap(mgr)

    with pytest.raises(InvalidStateError) as ei:
        kv2.commit(form([6, 7], stop))
    assert str(ei.value) == "commit after stop_committing()"
    assert snap(mgr) == seen["mid"]
    mgr.check_invariants()


def test_tokens_that_shut_the_manager_down_cannot_create(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:8])
    seen = {}

    def shutdown():
        mgr.shutdown()
        seen["mid"] = snap(mgr)

    with pytest.raises(InvalidStateError) as ei:
        mgr.create_kv_cache(Calls(P[:8], shutdown))
    assert str(ei.value) == "the manager is shut down"
    assert snap(mgr) == seen["mid"]


def test_batch_tokens_that_suspend_a_cache_cannot_commit(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    a, b = _active(mgr), _active(mgr)
    seen = {}

    def suspend():
        b.suspend()
        seen["mid"] = snap(mgr)

    with pytest.raises(InvalidStateError) as ei:
        mgr.commit_batch([a, b], CallsArray([6, 7], suspend))
    assert str(ei.value) == "commit_batch(): caches[1]: commit() needs a ACTIVE cache, this one is SUSPENDED"
    assert snap(mgr) == seen["mid"]


def test_commit_reads_its_tokens_before_the_status(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = _active(mgr)
    kv.suspend()
    _raises(mgr, lambda: kv.commit([-1]), ValueError, "tokens: token -1 out of range [0, 2**31)")
    _raises(mgr, lambda: kv.commit([1]), InvalidStateError, "commit() needs a ACTIVE cache, this one is SUSPENDED")
    kv.close()
    _raises(mgr, lambda: kv.commit("x"), TypeError, "tokens must be a sequence of tokens, got str")
    _raises(mgr, lambda: kv.commit([1]), ClosedError, "commit() on a closed cache")


# ---------------------------------------------------------------------------------------
# scopes, priorities and ids (DECISIONS "API shape")
# ---------------------------------------------------------------------------------------


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


def _forged(**fields):
    scope = ReuseScope()
    for k, v in fields.items():
        object.__setattr__(scope, k, v)
    return scope


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"lora_id": -1}, "ReuseScope.lora_id must be None or an int in [0, 2**64), got -1"),
        ({"salt": 2**64}, f"ReuseScope.salt must be None or an int in [0, 2**64), got {2**64}"),
        ({"lora_id": "x"}, "ReuseScope.lora_id must be None or an int in [0, 2**64), got 'x'"),
        ({"salt": True}, "ReuseScope.salt must be None or an int in [0, 2**64), got True"),
        ({"lora_id": 1.0}, "ReuseScope.lora_id must be None or an int in [0, 2**64), got 1.0"),
    ],
)
def test_forged_scopes_are_checked_at_use(make_manager, fields, message):
    import kvcm

    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:8])
    scope = _forged(**fields)
    _raises(mgr, lambda: mgr.create_kv_cache(P[:8], scope=scope), ValueError, message)
    _raises(mgr, lambda: mgr.probe_reuse(P[:8], scope=scope), ValueError, message)
    with pytest.raises(ValueError) as ei:
        kvcm.block_keys(P[:8], B, scope, backend=mgr.backend_name)
    assert str(ei.value) == message


def test_scope_with_lying_int_fields_is_the_scope_of_their_values(make_manager):
    import kvcm

    mgr = make_manager(attn_cfg(gpu=4))
    kv = mgr.create_kv_cache(P[:8], scope=ReuseScope(lora_id=3))
    assert kv.resume() and kv.resize(8)
    kv.commit(P[:8])
    kv.close()
    liar = _forged(lora_id=Liar(3))
    assert mgr.probe_reuse(P[:8], scope=liar) == 8
    assert mgr.probe_reuse(P[:8], scope=ReuseScope(lora_id=Liar(3))) == 8
    assert kvcm.block_keys(P[:8], B, liar, backend=mgr.backend_name) == kvcm.block_keys(
        P[:8], B, ReuseScope(lora_id=3), backend=mgr.backend_name)


def test_default_id_skips_ids_of_open_caches(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    a = mgr.create_kv_cache(id=1)  # serial 0
    b = mgr.create_kv_cache()  # serial 1: id 1 is taken -> 2
    c = mgr.create_kv_cache()  # serial 2: id 2 is taken -> 3
    d = mgr.create_kv_cache(id="x")
    assert [a.id, b.id, c.id, d.id] == [1, 2, 3, "x"]
    assert [r["id"] for r in snap(mgr)["requests"]] == [1, 2, 3, "x"]
    _raises(mgr, lambda: mgr.create_kv_cache(id=3), ValueError, "id 3 is already used by an open cache")
    a.close()
    e = mgr.create_kv_cache()  # serial 4: free
    f = mgr.create_kv_cache(id=1)  # a closed cache's id is free again
    g = mgr.create_kv_cache(id=7)
    h = mgr.create_kv_cache()  # serial 7: taken by g -> 8
    assert [e.id, f.id, g.id, h.id] == [4, 1, 7, 8]
    ids = [r["id"] for r in snap(mgr)["requests"]]
    assert len(ids) == len(set(ids))
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------
# sizes: capacities, history, huge counts (DECISIONS "Integer arguments", "Resource bounds")
# ---------------------------------------------------------------------------------------


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


def test_commit_of_nothing_is_a_no_op(make_manager):
    mgr, active, _ = _busy(make_manager)
    before = mgr.snapshot()
    active.commit([])
    assert mgr.snapshot() == before
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


MAX_REQUEST_BLOCKS = 2**24  # kvcm.checks.MAX_REQUEST_BLOCKS


def test_huge_resize_is_refused_in_constant_time(make_manager, backend):
    # 2**62 blocks: no implementation whose refusal costs O(capacity) finishes (before the
    # fix: 5.6 s and gigabytes for 10**9 (cpp) / memory exhaustion (python)); on the python
    # backend the work is counted: refusing 2**63 - 1 tokens costs what refusing 17 does
    mgr = make_manager(attn_cfg(gpu=4))
    kv = _active(mgr, capacity=8)
    work = {}
    for cap in (17, 10**9, 2**40, 2**62, 2**63 - 1):  # more full-attention blocks than the 4 slots
        work[cap] = python_work(lambda c=cap: _false_and_unchanged(mgr, lambda: kv.resize(c)))
        _false_and_unchanged(mgr, lambda c=cap: kv.resize(c, history_length=c))
    assert mgr.resize_batch([kv], [10**9]) == [False]
    assert mgr.resize_batch([kv], np.array([2**62], dtype=np.int64)) == [False]
    if backend == "python":
        assert max(work.values()) <= 2 * work[17], work
    assert kv.resize(16) is True  # exactly the pool: still fine
    assert kv.page_indices(0) == [0, 1, 2, 3]
    mgr.check_invariants()


def test_counts_at_or_past_2_pow_63_are_too_large(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    kv = _active(mgr)
    _raises(mgr, lambda: kv.resize(2**63), ValueError, "capacity 9223372036854775808 is too large")
    _raises(mgr, lambda: kv.resize(2**100), ValueError, f"capacity {2**100} is too large")
    _raises(mgr, lambda: kv.resize(8, history_length=2**63), ValueError,
            "history_length 9223372036854775808 is too large")
    _raises(mgr, lambda: kv.resize(-(2**63) - 1), ValueError, f"capacity must be >= 0, got {-(2**63) - 1}")
    _raises(mgr, lambda: mgr.resize_batch([kv], [2**63]), ValueError, "capacities[0] 9223372036854775808 is too large")
    _raises(mgr, lambda: mgr.resize_batch([kv], [8], [2**64]), ValueError,
            f"history_lengths[0] {2**64} is too large")


def _decode_steps(kv, n):
    for _ in range(n):
        assert kv.resize(kv.capacity + 1, history_length=kv.capacity + 1) is True


def test_windowed_resize_needs_only_sink_and_window_blocks(make_manager, backend):
    # window 4 = one block: at history h only the last block (plus sinks) is non-stale
    mgr = make_manager(win_cfg(gpu=3, window=4, sinks=4))
    kv = _active(mgr, capacity=8)
    _false_and_unchanged(mgr, lambda: kv.resize(10**6))  # history stays 0: every block is live
    big = 4 * 10**5
    assert kv.resize(big, history_length=big) is True  # sink block + last block: 2 of the 3 slots
    idx = kv.page_indices(0)
    assert len(idx) == big // B
    assert idx[0] >= 0 and idx[-1] >= 0 and idx.count(-1) == big // B - 2
    # each decode step touches only the window, not the 10**5 stale ordinals: on the python
    # backend its work is counted, the same as behind a 10**3-block history
    steps = python_work(lambda: _decode_steps(kv, 200))
    if backend == "python":
        short = _active(make_manager(win_cfg(gpu=3, window=4, sinks=4)), capacity=8)
        assert short.resize(4 * 10**3, history_length=4 * 10**3) is True
        assert steps <= 2 * python_work(lambda: _decode_steps(short, 200))
    # the page table is bounded (DECISIONS "Resource bounds"): refused like an impossible resize
    cap = MAX_REQUEST_BLOCKS * B
    _false_and_unchanged(mgr, lambda: kv.resize(cap + 1, history_length=cap + 1))
    _false_and_unchanged(mgr, lambda: kv.resize(2**62, history_length=2**62))
    mgr.check_invariants()


def _long_history_commits(make_manager, history_blocks):
    """300 one-token commits behind a history of ``history_blocks`` (most blocks stale):
    (the manager, the cache, the python work of the commits)."""
    mgr = make_manager(win_cfg(gpu=4, window=8))
    kv = _active(mgr, capacity=16)
    kv.commit(P[:6])
    assert kv.resize(history_blocks * B, history_length=history_blocks * B - 8) is True

    def commits():
        for t in range(300):
            kv.commit([t])  # each commit releases what became stale, nothing more to look at

    return mgr, kv, python_work(commits)


def test_windowed_commit_releases_stale_pages_without_scanning_history(make_manager, backend):
    # counted on the python backend: 100x the history, the same work (a scan of the
    # history from the commit's first block: ~100x)
    mgr, kv, work = _long_history_commits(make_manager, 10**5)
    if backend == "python":
        assert work <= 2 * _long_history_commits(make_manager, 10**3)[2]
    idx = kv.page_indices(0)
    assert sum(1 for i in idx if i >= 0) <= 4
    kv.close()
    mgr.check_invariants()


def test_pure_ssm_resize_needs_no_per_block_pages(make_manager, backend):
    mgr = make_manager(ssm_cfg(gpu=2))
    kv = _active(mgr, capacity=8)
    # 2**63 - 1 tokens of capacity: no per-block implementation finishes; counted on the
    # python backend, the same work as a 16-token resize
    work = python_work(lambda: kv.resize(2**62) is True or pytest.fail("refused"))
    assert kv.resize(2**63 - 1, history_length=2**63 - 1) is True
    if backend == "python":
        small = _active(make_manager(ssm_cfg(gpu=2)), capacity=8)
        assert work <= 2 * python_work(lambda: small.resize(16) is True or pytest.fail("refused"))
    assert kv.capacity == 2**63 - 1 and kv.history_length == 2**63 - 1
    assert kv.page_indices(0) == [0]  # the live state
    kv.commit(P[:6])
    assert kv.num_committed_tokens == 6
    kv.close()
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------
# page-index buffers
# ---------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------
# status rules (DECISIONS "Status rules"), closed caches, a shut-down manager
# ---------------------------------------------------------------------------------------


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


def test_commit_of_suspended_cache_raises(make_manager):
    mgr, _, suspended = _busy(make_manager)
    unchanged(mgr, lambda: suspended.commit([1]), InvalidStateError)
    mgr.check_invariants()


def test_commit_after_stop_committing_raises(make_manager):
    mgr, active, _ = _busy(make_manager)
    active.stop_committing()
    unchanged(mgr, lambda: active.commit([1]), InvalidStateError)
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


def test_shutdown_with_open_cache_raises(make_manager):
    mgr, active, suspended = _busy(make_manager)
    unchanged(mgr, mgr.shutdown, InvalidStateError)
    active.close()
    unchanged(mgr, mgr.shutdown, InvalidStateError)
    suspended.close()
    mgr.shutdown()
    mgr.check_invariants()


def test_calls_on_a_shut_down_manager(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    fill(mgr, P[:8])
    kv = mgr.create_kv_cache(P[:8])
    kv.close()
    mgr.shutdown()
    mgr.take_events()
    mgr.take_iteration_stats()
    _raises(mgr, mgr.clear_reusable, InvalidStateError, "the manager is shut down")
    _raises(mgr, lambda: mgr.create_kv_cache(P[:4]), InvalidStateError, "the manager is shut down")
    before = snap(mgr)
    mgr.shutdown()  # idempotent: no tick
    assert mgr.probe_reuse(P[:8]) == 0  # read-only calls keep answering
    assert mgr.probe_reuse_detail(P[:8]).num_tokens == 0
    assert mgr.drain_copy_ops() == []
    assert mgr.take_events() == []
    assert mgr.resize_batch([], []) == []
    mgr.commit_batch([], [])
    mgr.stats()
    _raises(mgr, lambda: mgr.resize_batch([kv], [4]), ClosedError, "resize_batch(): caches[0]: resize() on a closed cache")
    assert snap(mgr) == before
    assert kv.status is Status.CLOSED and kv.committed_tokens == P[:8]
    mgr.check_invariants()


def test_page_index_ranges_are_slices_and_bad_ranges_change_nothing(make_manager):
    """``page_indices(lc, start, stop)`` is ``page_indices(lc)[start:stop]`` for every range
    within the entries; a range outside them, or not of ints, is refused alike and changes
    nothing (the engine reads the blocks it just filled: SPEC sec. 7)."""
    mgr = make_manager(attn_cfg(gpu=8))
    fill(mgr, P[:8])
    kv = _active(mgr, capacity=5 * B + 1, prompt=P[:8])
    full = kv.page_indices(0)
    n = len(full)
    assert n == 6
    for a in range(n + 1):
        assert kv.page_indices(0, a) == full[a:]
        for b in range(a, n + 1):
            assert kv.page_indices(0, a, b) == full[a:b]
            assert kv.page_indices(0, start=Liar(a), stop=Liar(b)) == full[a:b]  # read by value
    _raises(mgr, lambda: kv.page_indices(0, -1), ValueError, "block range [-1, 6) is not within the 6 entries [0, 6]")
    _raises(mgr, lambda: kv.page_indices(0, 0, 7), ValueError, "block range [0, 7) is not within the 6 entries [0, 6]")
    _raises(mgr, lambda: kv.page_indices(0, 4, 3), ValueError, "block range [4, 3) is not within the 6 entries [0, 6]")
    _raises(mgr, lambda: kv.page_indices(0, "1"), TypeError, "start must be an int, got str")
    _raises(mgr, lambda: kv.page_indices(0, 0, 1.5), TypeError, "stop must be an int or None, got float")
    _raises(mgr, lambda: kv.page_indices(1, 0, 1), ValueError, "unknown life cycle 1; this model has 1")
    ssm = make_manager(ssm_cfg(gpu=2))
    live = _active(ssm, capacity=8)
    one = live.page_indices(0)
    assert len(one) == 1 and live.page_indices(0, 0, 1) == one
    assert live.page_indices(0, 1) == [] and live.page_indices(0, 0, 0) == []
    _raises(ssm, lambda: live.page_indices(0, 0, 2), ValueError, "block range [0, 2) is not within the 1 entries [0, 1]")
    kv.suspend()
    _raises(mgr, lambda: kv.page_indices(0, 0, 1), InvalidStateError,
            "page_indices() needs a ACTIVE cache, this one is SUSPENDED")
    mgr.check_invariants()
