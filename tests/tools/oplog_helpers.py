"""Builders shared by the op-log tests (tests/tools/test_oplog_*.py): a tiny config, a python
manager, a workload touching every call, reading and recording a log."""

from __future__ import annotations

import array
from pathlib import Path

import kvcm
import pytest
from kvcm import AttentionLayer, KVCacheManagerConfig, ReuseScope, SsmLayer, Tier
from kvcm import oplog as L

B = 2


def config(**kw) -> KVCacheManagerConfig:
    base = {
        "tokens_per_block": B,
        "layers": [AttentionLayer(0, 4), AttentionLayer(1, 2, window=3, sink_tokens=1), SsmLayer(2, 16)],
        "tiers": [Tier("gpu", 40 * 6), Tier("host", 40 * 4)],
    }
    base.update(kw)
    return KVCacheManagerConfig(**base)


def py_manager(cfg: KVCacheManagerConfig | None = None):
    """A python manager built without the KVCacheManager entry point (never recorded)."""
    return L.build_manager(cfg or config(), "python")


D = bytes(range(32))


def workload(m) -> None:
    """Every recorded public call at least once, one of them failing."""
    a = m.create_kv_cache([1, 2, 3, D, 5], scope=ReuseScope(lora_id=0), priority=70, id="a")
    assert a.resume()
    assert a.resize(7)
    a.commit((1, 2, 3, D, 5))  # a tuple: recorded as a list
    a.commit_input(0)  # the input is all committed: nothing left, a no-op
    with pytest.raises(ValueError):
        a.commit([-1])
    a.page_indices(0)
    buf = array.array("i", [0] * 8)
    assert a.page_indices_into(0, buf) == 4
    assert m.resize_batch([a], array.array("q", [9])) == [True]  # an int array: recorded with its type
    m.commit_batch((a,), array.array("i", [6]))
    with pytest.raises(ValueError):
        m.resize_batch([a, a], [10, 11])  # the same cache twice
    a.fork(id="f").close()  # a cache op whose result is a new cache (issue 22)
    a.suspend()
    m.probe_reuse([1, 2, 3], ReuseScope(lora_id=0))
    m.probe_reuse_detail([1, 2, 3])
    assert m.shared_candidates([1, 2, 3, 4]) == []  # no shared tier in this config
    a.stop_committing()
    a.close()
    a.close()
    b = m.create_kv_cache([1, 2])
    m.set_quota("gpu", 40 * 8)  # grow, then back (DECISIONS.md "Quotas at run time")
    m.set_quota(0, 40 * 6)
    m.drain_copy_ops()
    assert m.drain_copy_runs() == []  # the same drain in column form: nothing left
    assert m.forget_copies([]) == []  # nothing failed
    with pytest.raises(ValueError):
        m.settle_copies()  # copy_settlement="drain": forget_copies reports failures
    m.take_events()
    m.stats()
    m.take_iteration_stats()
    b.close()
    m.clear_reusable()
    m.shutdown()


def read_lines(path: str) -> list[str]:
    return Path(path).read_text().splitlines()


def record(tmp_path, monkeypatch, run=workload, cfg=None) -> str:
    path = str(tmp_path / "log.jsonl")
    monkeypatch.setenv(L.ENV_VAR, path)
    m = L.maybe_wrap(py_manager(cfg))
    assert isinstance(m, L.RecordingManager) and isinstance(m, kvcm.KVCacheManager)
    run(m)
    return path
