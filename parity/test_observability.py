"""SPEC sec. 11 (+ DECISIONS "Clock and LRU"): snapshot(), check_invariants(), the logical
clock and KVCM_OPLOG recording."""

from __future__ import annotations

import json

import kvcm
from kvcm import ReuseScope

from parity.helpers import attn_cfg, fill, hybrid_cfg, ops, snap, toks

P = toks(16, base=100)
Q = toks(16, base=200)


def _script(mgr) -> list:
    """A busy, deterministic op sequence touching every kind of state; returns outcomes."""
    out = []
    fill(mgr, P[:8], chunks=[4, 4])
    a = mgr.create_kv_cache(P[:12], priority=70)
    out.append((a.id, a.num_committed_tokens, a.resume(), a.resize(14)))
    a.commit(P[8:13])
    b = mgr.create_kv_cache(Q[:6], scope=ReuseScope(salt=1))
    out.append((b.resume(), b.resize(8)))
    b.commit(Q[:6])
    b.suspend()
    c = mgr.create_kv_cache(P[:6], id="c")
    out.append((c.resume(), c.page_indices(0), c.page_indices(1)))
    c.close()
    a.stop_committing()
    out.append(mgr.probe_reuse_detail(P[:13]))
    out.append(ops(mgr))
    out.append([e.to_json() for e in mgr.take_events()])
    mgr.clear_reusable()
    out.append(json.dumps(mgr.stats(), sort_keys=True))
    return out


def test_snapshot_is_json_serialisable(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=4))
    json.dumps(mgr.snapshot())
    _script(mgr)
    s = snap(mgr)
    assert json.loads(json.dumps(s)) == s
    mgr.check_invariants()


def test_identical_runs_give_identical_snapshots(make_manager):
    cfg = hybrid_cfg(attn_gpu=8, ssm_gpu=4)
    m1, m2 = make_manager(cfg), make_manager(cfg)
    assert m1.snapshot() == m2.snapshot()
    assert _script(m1) == _script(m2)
    assert m1.snapshot() == m2.snapshot()
    assert json.dumps(m1.snapshot(), sort_keys=True) == json.dumps(m2.snapshot(), sort_keys=True)
    m1.check_invariants()
    m2.check_invariants()


def test_snapshot_does_not_change_on_reads(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=8, ssm_gpu=4))
    fill(mgr, P[:8])
    kv = mgr.create_kv_cache(P[:8])
    assert kv.resume()
    before = snap(mgr)
    _ = (
        kv.id,
        kv.status,
        kv.capacity,
        kv.history_length,
        kv.num_committed_tokens,
        kv.committed_tokens,
        kv.num_reused_tokens,
        kv.priority,
        kv.page_indices(0),
        kv.page_indices(1),
        mgr.config,
        mgr.life_cycles,
    )
    mgr.stats()
    mgr.probe_reuse(P[:8])
    mgr.check_invariants()
    assert snap(mgr) == before
    mgr.check_invariants()


def test_clock_ticks_once_per_state_changing_call(make_manager):
    mgr = make_manager(attn_cfg(gpu=2))

    def clock():
        return mgr.snapshot()["clock"]

    c0 = clock()
    kv = mgr.create_kv_cache()
    assert clock() == c0 + 1
    assert kv.resume()
    assert clock() == c0 + 2
    assert kv.resize(8)
    assert clock() == c0 + 3
    assert kv.resize(12) is False  # failed: no tick
    kv.commit([])  # no-op: no tick
    assert clock() == c0 + 3
    kv.commit(P[:6])
    assert clock() == c0 + 4
    kv.suspend()
    assert clock() == c0 + 5
    other = mgr.create_kv_cache()
    assert other.resume() and other.resize(4) is False
    assert clock() == c0 + 7
    other.close()
    assert clock() == c0 + 8
    kv.stop_committing()
    assert clock() == c0 + 9
    kv.stop_committing()  # already stopped
    mgr.drain_copy_ops()
    mgr.take_events()
    mgr.take_iteration_stats()
    mgr.probe_reuse(P[:6])
    mgr.probe_reuse_detail(P[:6])
    assert clock() == c0 + 9
    kv.close()
    kv.close()
    assert clock() == c0 + 10
    mgr.clear_reusable()
    assert clock() == c0 + 11
    mgr.check_invariants()


def test_check_invariants_holds_after_every_call(make_manager):
    mgr = make_manager(hybrid_cfg(attn_gpu=4, ssm_gpu=3))
    caches = []
    for i in range(6):
        t = P[: 4 + 2 * i] if i % 2 else Q[: 3 + 2 * i]
        kv = mgr.create_kv_cache(t)
        mgr.check_invariants()
        if kv.resume():
            mgr.check_invariants()
            if kv.resize(len(t) + 2):
                kv.commit(t[kv.num_committed_tokens :])
                mgr.check_invariants()
            kv.suspend()
            mgr.check_invariants()
        caches.append(kv)
        if len(caches) > 2:
            caches.pop(0).close()
            mgr.check_invariants()
    for kv in caches:
        kv.close()
    mgr.clear_reusable()
    mgr.check_invariants()


def test_manager_is_the_requested_backend(make_manager, backend):
    mgr = make_manager(attn_cfg(gpu=2))
    assert isinstance(mgr, kvcm.KVCacheManager)
    assert type(mgr).backend_name == backend or getattr(mgr, "backend_name", None) == backend
    mgr.check_invariants()


def test_oplog_records_every_state_visible_call(make_manager, backend, tmp_path, monkeypatch):
    from kvcm import oplog

    path = tmp_path / "ops.jsonl"
    monkeypatch.setenv("KVCM_OPLOG", str(path))
    mgr = make_manager(attn_cfg(gpu=3, host=1))
    fill(mgr, P[:6])
    kv = mgr.create_kv_cache(P[:6])
    assert kv.resume()
    assert kv.resize(40) is False
    mgr.drain_copy_ops()
    mgr.take_events()
    kv.close()
    final = mgr.snapshot()
    monkeypatch.delenv("KVCM_OPLOG")
    streams = oplog.read_log(str(path))
    assert len(streams) == 1
    names = [r["op"] for r in streams[0].ops]
    for expected in ("create_kv_cache", "resume", "resize", "commit", "close", "drain_copy_ops", "take_events"):
        assert expected in names
    assert names.count("resize") == 2 and names.count("create_kv_cache") == 2
    report = oplog.replay(str(path), backends=(backend,))
    assert report.ok, str(report)
    assert report.steps == len(names)
    fresh = oplog.build_manager(mgr.config, backend)  # replaying the log by hand reaches the same state
    assert fresh.snapshot() != final
    mgr.check_invariants()
