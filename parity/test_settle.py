"""SPEC sec. 15, explicit settlement of copy ops (DECISIONS.md "Asynchronous copies:
settle_copies"): with ``copy_settlement="explicit"`` every drain that returns ops stays
unsettled until ``settle_copies(failed)`` settles it, oldest first; a failed op is matched
within its own drain only, so an equal op of another drain in flight is never confused
with it.

Settling in order, a failure reported after newer drains moved the pages on, the same op
value in two unsettled drains (either one failing), roll-backs equal to forget_copies',
bad input (nothing changes), the pending-ops warning, shutdown, and both backends giving
the same ids and snapshots at every step."""

from __future__ import annotations

import warnings

import kvcm
import pytest
from kvcm import CopyOp, Status
from kvcm.api import ConfigError, PendingCopyOpsWarning

from parity.helpers import (
    DISK,
    GPU,
    HOST,
    attn_cfg,
    fill,
    hybrid_cfg,
    keys,
    lc_stats,
    removed,
    snap,
    toks,
    unchanged,
)

P = toks(12, base=100)
Q = toks(12, base=200)
R = toks(12, base=300)
S = toks(12, base=400)


def explicit(cfg_fn=attn_cfg, **kw):
    return cfg_fn(copy_settlement="explicit", **kw)


def page_of(mgr, key: bytes, lc: int = 0) -> int:
    """The serial of the page block ``key`` holds for ``lc`` (snapshot)."""
    (node,) = [n for n in mgr.snapshot()["tree"] if n["key"] == key.hex()]
    return node["pages"][lc]["page"]


def page_entry(mgr, serial: int) -> dict | None:
    return next((p for p in mgr.snapshot()["pages"] if p["serial"] == serial), None)


# ---------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["Explicit", "", "async", None, 1, True, b"drain"])
def test_copy_settlement_is_validated(make_manager, bad):
    with pytest.raises(ConfigError, match="copy_settlement"):
        make_manager(attn_cfg(copy_settlement=bad))


def test_drain_mode_is_the_default_and_refuses_settle_copies(make_manager):
    mgr = make_manager(attn_cfg(gpu=2, host=4))
    assert mgr.config.copy_settlement == "drain" and mgr.unsettled_drains == 0
    fill(mgr, P[:8])
    fill(mgr, Q[:8])
    ops = mgr.drain_copy_ops()
    assert len(ops) == 2 and mgr.unsettled_drains == 0
    err = unchanged(mgr, lambda: mgr.settle_copies(), ValueError)
    assert "copy_settlement='explicit'" in str(err)
    unchanged(mgr, lambda: mgr.settle_copies(ops[:1]), ValueError)
    unchanged(mgr, lambda: mgr.settle_copies("abc"), TypeError)  # the argument first, as forget_copies
    # the snapshot keeps today's flat list of the last drain's unreported ops
    assert mgr.snapshot()["issued_copy_ops"] == [[*o.to_json(), p] for o, p in zip(ops, [1, 0])]
    assert mgr.forget_copies(ops[:1]) == []
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------
# settling in order
# ---------------------------------------------------------------------------------------


def test_settle_in_order_without_failures(make_manager):
    mgr = make_manager(explicit(gpu=2, host=2, disk=6))
    fill(mgr, P[:8])
    assert mgr.drain_copy_ops() == [] and mgr.unsettled_drains == 0  # an empty drain records nothing
    fill(mgr, Q[:8])
    d1 = mgr.drain_copy_ops()
    fill(mgr, R[:8])
    d2 = mgr.drain_copy_runs()  # the column form is a drain too
    assert mgr.drain_copy_ops() == [] and mgr.unsettled_drains == 2
    assert d1 == [CopyOp(0, GPU, 1, HOST, 0, "offload"), CopyOp(0, GPU, 0, HOST, 1, "offload")]
    d2_ops = [o for run in d2 for o in run.ops()]
    issued = mgr.snapshot()["issued_copy_ops"]
    # oldest first, each op with the serial of the page it fills
    assert issued == [[[*o.to_json(), p] for o, p in zip(d1, [1, 0])],
                      [[*o.to_json(), p] for o, p in zip(d2_ops, [1, 3, 0, 2])]]
    before = snap(mgr)
    assert mgr.settle_copies() == []
    after = snap(mgr)
    assert after["clock"] == before["clock"]  # nothing failed: no tick
    assert after["issued_copy_ops"] == issued[1:] and mgr.unsettled_drains == 1
    assert {k: v for k, v in after.items() if k != "issued_copy_ops"} == \
           {k: v for k, v in before.items() if k != "issued_copy_ops"}
    assert mgr.settle_copies(()) == []
    assert mgr.unsettled_drains == 0 and mgr.snapshot()["issued_copy_ops"] == []
    unchanged(mgr, lambda: mgr.settle_copies(), ValueError)  # nothing left to settle
    assert mgr.probe_reuse(P[:8]) == mgr.probe_reuse(Q[:8]) == mgr.probe_reuse(R[:8]) == 8
    assert lc_stats(mgr.stats(), 0)["lost_pages"] == 0
    mgr.check_invariants()


def test_a_drain_never_settles_older_drains(make_manager):
    """Drains accumulate; the drain mode's "the next drain settles the last" does not apply."""
    mgr = make_manager(explicit(gpu=2, host=2, disk=6))
    fill(mgr, P[:8])
    fill(mgr, Q[:8])
    d1 = mgr.drain_copy_ops()
    for base in (300, 400, 500):
        fill(mgr, toks(8, base))
        assert mgr.drain_copy_ops()
    assert mgr.unsettled_drains == 4
    assert mgr.snapshot()["issued_copy_ops"][0] == [[*o.to_json(), p] for o, p in zip(d1, [1, 0])]
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------
# failures
# ---------------------------------------------------------------------------------------


def test_failure_in_an_older_drain_reported_after_two_newer_drains(make_manager):
    """a's block-1 offload (drain 1) failed; drains 2 and 3 moved a's pages on to disk and
    other requests matched them before the engine learned it.  Settling drain 1 forgets
    that page wherever it is now and rolls back its users; block 0 and the other
    prefixes are kept."""
    mgr = make_manager(explicit(gpu=2, host=2, disk=6))
    a = mgr.create_kv_cache(id="a")
    assert a.resume() and a.resize(8)
    a.commit(P[:8])
    a.suspend()
    fill(mgr, Q[:8])  # a's HELD pages go to host
    d1 = mgr.drain_copy_ops()
    assert d1 == [CopyOp(0, GPU, 1, HOST, 0, "offload"), CopyOp(0, GPU, 0, HOST, 1, "offload")]
    b0, b1 = page_of(mgr, keys(P[:8])[0]), page_of(mgr, keys(P[:8])[1])
    assert (b0, b1) == (0, 1)  # d1[0] fills block 1's page
    fill(mgr, R[:8])  # a's pages: host -> disk
    d2 = mgr.drain_copy_ops()
    c = mgr.create_kv_cache(P[:8] + [1], id="c")  # uses both blocks
    e = mgr.create_kv_cache(P[:4] + [2], id="e")  # uses block 0 only
    assert c.num_committed_tokens == 8 and e.num_committed_tokens == 4
    fill(mgr, S[:8])
    d3 = mgr.drain_copy_ops()
    assert d2 and d3 and mgr.unsettled_drains == 3
    assert page_entry(mgr, b1)["tier"] == DISK  # the page moved on since d1
    mgr.take_events()
    clock = mgr.snapshot()["clock"]
    assert mgr.settle_copies([d1[0]]) == ["a", "c"]
    assert mgr.snapshot()["clock"] == clock + 1
    assert removed(mgr.take_events()) == [(keys(P[:8])[1], 0)]
    assert page_entry(mgr, b1) is None and page_entry(mgr, b0)["tier"] == DISK
    for kv in (a, c):
        assert kv.status == Status.SUSPENDED and kv.committed_tokens == P[:4]
        assert kv.capacity == kv.history_length == 4
    assert e.committed_tokens == P[:4] and e.status == Status.SUSPENDED
    assert mgr.probe_reuse(P[:8]) == 4
    assert mgr.probe_reuse(Q[:8]) == mgr.probe_reuse(R[:8]) == mgr.probe_reuse(S[:8]) == 8
    assert lc_stats(mgr.stats(), 0)["lost_pages"] == 1
    assert mgr.unsettled_drains == 2
    mgr.check_invariants()
    assert mgr.settle_copies() == [] and mgr.settle_copies() == []
    assert mgr.unsettled_drains == 0
    # the rolled-back request recomputes from block 1
    assert a.resume() and a.resize(8)
    a.commit(P[4:8])
    assert mgr.probe_reuse(P[:8]) == 8
    mgr.check_invariants()


@pytest.mark.parametrize("failing", ["newer", "older"])
def test_the_same_op_value_in_two_unsettled_drains(make_manager, failing):
    """gpu slot 1 -> host slot 0 is issued in drain 1 (filling P's block-1 page) and again
    in drain 2 (filling Q's block-0 page; drain 2 first moves P's page on to disk).  Only
    the page of the drain that reports the failure is forgotten."""
    mgr = make_manager(explicit(gpu=2, host=3, disk=6))
    fill(mgr, P[:8])
    fill(mgr, Q[:8])
    d1 = mgr.drain_copy_ops()
    fill(mgr, R[:8])
    d2 = mgr.drain_copy_ops()
    same = CopyOp(0, GPU, 1, HOST, 0, "offload")
    assert d1.count(same) == 1 and d2.count(same) == 1
    assert d2 == [CopyOp(0, GPU, 0, HOST, 2, "offload"), CopyOp(0, HOST, 0, DISK, 0, "offload"), same]
    p_b1, q_b0 = page_of(mgr, keys(P[:8])[1]), page_of(mgr, keys(Q[:8])[0])
    issued = mgr.snapshot()["issued_copy_ops"]
    assert [*same.to_json(), p_b1] in issued[0] and [*same.to_json(), q_b0] in issued[1]
    mgr.take_events()
    if failing == "newer":  # the older copy succeeded
        assert mgr.settle_copies() == []
        assert mgr.settle_copies([same]) == []
        assert removed(mgr.take_events()) == [(keys(Q[:8])[0], 0), (keys(Q[:8])[1], 0)]  # the subtree
        assert page_entry(mgr, p_b1) is not None and page_entry(mgr, q_b0) is None
        assert mgr.probe_reuse(P[:8]) == 8 and mgr.probe_reuse(Q[:8]) == 0
    else:
        assert mgr.settle_copies([same]) == []
        assert mgr.settle_copies() == []
        assert removed(mgr.take_events()) == [(keys(P[:8])[1], 0)]
        assert page_entry(mgr, p_b1) is None and page_entry(mgr, q_b0) is not None
        assert mgr.probe_reuse(P[:8]) == 4 and mgr.probe_reuse(Q[:8]) == 8
    assert mgr.probe_reuse(R[:8]) == 8 and mgr.unsettled_drains == 0
    assert lc_stats(mgr.stats(), 0)["lost_pages"] == 1
    mgr.check_invariants()


def _rollback_scenario(mgr):
    """An onboard failure with shared users (parity/test_faults.py's), up to the drain."""
    fill(mgr, P[:8])
    fill(mgr, Q[:8])  # P's pages on host
    mgr.drain_copy_ops()
    if mgr.config.copy_settlement == "explicit":
        assert mgr.settle_copies() == []
    kvs = [mgr.create_kv_cache(P[:8] + [1], id="a"), mgr.create_kv_cache(P[:8] + [2], id="b"),
           mgr.create_kv_cache(P[:4] + [3], id="c")]
    assert kvs[0].resume()
    return kvs, mgr.drain_copy_ops()


def test_settle_rolls_back_exactly_as_forget_copies(make_manager):
    """One rule, one home: the same failure reported by settle_copies (explicit) and by
    forget_copies (drain) leaves the same state, returns the same ids, emits the same
    events; only the issued-ops bookkeeping differs."""
    drain = make_manager(attn_cfg(gpu=2, host=6))
    expl = make_manager(explicit(gpu=2, host=6))
    (kd, od), (ke, oe) = _rollback_scenario(drain), _rollback_scenario(expl)
    assert od == oe
    onboards = [o for o in od if o.reason == "onboard"]
    assert len(onboards) == 2
    drain.take_events()
    expl.take_events()
    assert drain.forget_copies([onboards[1]]) == expl.settle_copies([onboards[1]]) == ["a", "b"]
    assert [e.to_json() for e in drain.take_events()] == [e.to_json() for e in expl.take_events()]
    sd, se = snap(drain), snap(expl)
    assert se["issued_copy_ops"] == [] and len(sd["issued_copy_ops"]) == len(od) - 1
    sd.pop("issued_copy_ops")
    se.pop("issued_copy_ops")
    assert sd == se
    for kv in (*kd[:2], *ke[:2]):
        assert kv.committed_tokens == P[:4] and kv.status == Status.SUSPENDED
    expl.check_invariants()


def test_a_lost_live_ssm_state_rolls_back_to_a_snapshot(make_manager):
    """A copy-on-write of an ssm snapshot (the live state) failed, reported a drain late."""
    mgr = make_manager(explicit(hybrid_cfg, attn_gpu=8, ssm_gpu=4))
    fill(mgr, P[:8], chunks=[4, 4])  # snapshots at 4 and 8
    d1 = mgr.drain_copy_ops()
    kv = mgr.create_kv_cache(P[:8] + [1], id="k")
    assert kv.resume()
    d2 = mgr.drain_copy_ops()
    (cow,) = [o for o in d2 if o.reason == "cow" and o.lc == 1]
    unchanged(mgr, lambda: mgr.settle_copies([cow]), ValueError)  # d1 is the oldest
    assert d1 and mgr.settle_copies() == []
    assert mgr.settle_copies([cow]) == ["k"]
    assert kv.committed_tokens == P[:8] and kv.status == Status.SUSPENDED  # the snapshot at 8 is intact
    assert kv.resume()
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------
# bad input, refusals, shutdown, the warning
# ---------------------------------------------------------------------------------------


def test_settle_copies_bad_input_changes_nothing(make_manager):
    mgr = make_manager(explicit(gpu=2, host=3, disk=6))
    unchanged(mgr, lambda: mgr.settle_copies(), ValueError)  # no unsettled drain yet
    unchanged(mgr, lambda: mgr.settle_copies([]), ValueError)
    fill(mgr, P[:8])
    fill(mgr, Q[:8])
    d1 = mgr.drain_copy_ops()
    fill(mgr, R[:8])
    d2 = mgr.drain_copy_ops()
    good = d1[1]  # (d1[0]'s value is issued again in d2)
    newer_only = CopyOp(0, HOST, 0, DISK, 0, "offload")  # an op of d2, not of d1
    assert newer_only in d2 and newer_only not in d1 and good not in d2
    unchanged(mgr, lambda: mgr.settle_copies(good), TypeError)  # not a list
    unchanged(mgr, lambda: mgr.settle_copies("abc"), TypeError)
    unchanged(mgr, lambda: mgr.settle_copies(iter([good])), TypeError)
    unchanged(mgr, lambda: mgr.settle_copies([good, good.to_json()]), TypeError)
    unchanged(mgr, lambda: mgr.settle_copies([CopyOp(0.0, 0, 1, 1, 0, "offload")]), TypeError)
    unchanged(mgr, lambda: mgr.settle_copies([CopyOp(True, 0, 1, 1, 0, "offload")]), TypeError)
    unchanged(mgr, lambda: mgr.settle_copies([CopyOp(0, 0, 1, 1, 0, b"offload")]), TypeError)
    unchanged(mgr, lambda: mgr.settle_copies([CopyOp(0, 0, 1, 1, 0, "offload", key="ab")]), TypeError)
    err = unchanged(mgr, lambda: mgr.settle_copies([good, newer_only]), ValueError)
    assert "failed[1]" in str(err) and "oldest unsettled drain" in str(err)
    unchanged(mgr, lambda: mgr.settle_copies([good, good]), ValueError)  # issued once in d1
    unchanged(mgr, lambda: mgr.settle_copies([CopyOp(0, 0, 2**70, 1, 0, "offload")]), ValueError)
    unchanged(mgr, lambda: mgr.settle_copies([CopyOp(0, 0, 1, 1, 0, "offload\0")]), ValueError)
    unchanged(mgr, lambda: mgr.settle_copies([CopyOp(0, 0, 1, 1, 0, "teleport")]), ValueError)
    unchanged(mgr, lambda: mgr.settle_copies([CopyOp(0, 0, 1, 1, 0, "offload", key=b"k" * 32)]), ValueError)
    # forget_copies belongs to the drain mode: refused, even with nothing to report
    err = unchanged(mgr, lambda: mgr.forget_copies([good]), ValueError)
    assert "settle_copies" in str(err)
    unchanged(mgr, lambda: mgr.forget_copies([]), ValueError)
    unchanged(mgr, lambda: mgr.forget_copies("abc"), TypeError)
    assert mgr.unsettled_drains == 2
    assert mgr.settle_copies([good]) == []
    # d1 is settled: its ops are gone with it; d2's are reportable now
    unchanged(mgr, lambda: mgr.settle_copies([good]), ValueError)
    assert mgr.settle_copies([newer_only]) == []
    mgr.check_invariants()


def test_an_op_issued_twice_in_one_drain_may_be_reported_twice(make_manager):
    """An op value a drain returned k times may be listed up to k times (not k + 1)."""
    mgr = make_manager(explicit(gpu=2, host=1))
    for base in range(100, 600, 100):
        fill(mgr, toks(4, base))
    ops = mgr.drain_copy_ops()
    # host slot 0 is the destination again and again (its page dropped each time)
    op = CopyOp(0, GPU, 0, HOST, 0, "offload")
    assert ops == [op, CopyOp(0, GPU, 1, HOST, 0, "offload"), op]
    k = 2
    unchanged(mgr, lambda: mgr.settle_copies([op] * (k + 1)), ValueError)
    assert mgr.settle_copies([op] * k) == []
    assert mgr.unsettled_drains == 0
    mgr.check_invariants()


def test_shutdown_with_unsettled_drains(make_manager):
    """Shutdown does not wait for settlement; settle_copies keeps answering afterwards
    (the copies may still fail in the data plane), as forget_copies does."""
    mgr = make_manager(explicit(gpu=2, host=2, disk=6))
    fill(mgr, P[:8])
    fill(mgr, Q[:8])
    d1 = mgr.drain_copy_ops()
    fill(mgr, R[:8])
    mgr.drain_copy_ops()
    assert mgr.unsettled_drains == 2
    mgr.shutdown()
    assert mgr.unsettled_drains == 2
    assert mgr.snapshot()["pages"] == []  # everything reusable was dropped
    clock = mgr.snapshot()["clock"]
    assert mgr.settle_copies([d1[0]]) == []  # its page is gone already: nothing to forget
    assert mgr.snapshot()["clock"] == clock + 1
    assert mgr.settle_copies() == []
    unchanged(mgr, lambda: mgr.settle_copies(), ValueError)
    assert mgr.unsettled_drains == 0
    mgr.check_invariants()


def test_pending_warning_counts_unsettled_ops(make_manager):
    """With explicit settlement the one PendingCopyOpsWarning counts the undrained ops
    plus the ops of the unsettled drains: an engine that drains but never settles is told."""
    mgr = make_manager(explicit(gpu=2, host=16, pending_copy_ops_warning=5))
    fill(mgr, P[:8])
    fill(mgr, Q[:8])
    assert len(mgr.drain_copy_ops()) == 2  # 2 unsettled
    fill(mgr, R[:8])
    assert len(mgr.drain_copy_ops()) == 2  # 4 unsettled
    with pytest.warns(PendingCopyOpsWarning, match="unsettled") as rec:
        fill(mgr, S[:4])  # the 5th op
    assert len(rec) == 1 and "settle_copies()" in str(rec[0].message)
    assert mgr.stats()["pending_copy_ops"] == 1 and mgr.unsettled_drains == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per manager
        fill(mgr, toks(8, 500))
    mgr.check_invariants()


def test_settling_keeps_the_pending_warning_away(make_manager):
    mgr = make_manager(explicit(gpu=2, host=16, pending_copy_ops_warning=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for base in range(100, 1000, 100):
            fill(mgr, toks(8, base))
            if mgr.drain_copy_ops():
                assert mgr.settle_copies() == []
    assert mgr.unsettled_drains == 0
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------
# both backends side by side
# ---------------------------------------------------------------------------------------


def test_both_backends_roll_back_alike(backend):
    """Failures in two drains reported in order on the python manager and ``backend``'s
    in step (python vs python: the determinism pair): equal returned ids, roll-back
    points (every cache's properties) and snapshots after every call."""
    mgrs = [kvcm.KVCacheManager(explicit(gpu=3, host=3, disk=6), backend=b) for b in ("python", backend)]
    caches: list[list] = [[], []]

    def step(f):
        out = [f(m, cs) for m, cs in zip(mgrs, caches)]
        assert out[0] == out[1]
        assert mgrs[0].snapshot() == mgrs[1].snapshot()
        props = [[(c.id, c.status, c.num_committed_tokens, c.capacity, c.history_length, c.committed_tokens)
                  for c in cs] for cs in caches]
        assert props[0] == props[1]
        return out[0]

    def held(m, cs, cid, tokens):
        kv = m.create_kv_cache(id=cid)
        assert kv.resume() and kv.resize(len(tokens))
        kv.commit(tokens)
        kv.suspend()
        cs.append(kv)

    step(lambda m, cs: held(m, cs, "a", P[:8]))
    step(lambda m, cs: held(m, cs, "b", Q[:12]))  # a's pages to host
    d1 = step(lambda m, cs: m.drain_copy_ops())
    step(lambda m, cs: cs.extend([m.create_kv_cache(P[:8] + [1], id="c"), m.create_kv_cache(P[:4] + [9], id="d")]))
    step(lambda m, cs: fill(m, R[:8]).id)  # b's last block to host, then on to disk
    d2 = [o for run in step(lambda m, cs: m.drain_copy_runs()) for o in run.ops()]
    assert d1 == [CopyOp(0, GPU, 1, HOST, 0, "offload"), CopyOp(0, GPU, 0, HOST, 1, "offload")]
    assert d2[:2] == [CopyOp(0, GPU, 0, HOST, 2, "offload"), CopyOp(0, HOST, 2, DISK, 0, "offload")]
    step(lambda m, cs: m.unsettled_drains)
    assert step(lambda m, cs: m.settle_copies([d1[1]])) == ["a", "c", "d"]  # P's block 0
    assert [c.num_committed_tokens for c in caches[1]] == [0, 12, 0, 0]
    assert step(lambda m, cs: m.settle_copies(d2[:1])) == ["b"]  # Q's block 2, moved on to disk since
    assert [c.num_committed_tokens for c in caches[1]] == [0, 8, 0, 0]
    step(lambda m, cs: m.unsettled_drains)
    for m in mgrs:
        m.check_invariants()
        with pytest.raises(ValueError):
            m.settle_copies()
