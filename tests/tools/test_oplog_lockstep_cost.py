"""``oplog-replay`` in linear time (issue #20 item 3): the full comparison (every cache's
properties, ``snapshot()``, ``check_invariants()``) runs at halving points of the log (1/2, 1/4, ... of it),
not after every op, and a divergence it finds is located exactly, at the op where it
happens, by re-running the log (bisection).  Counts, never timings."""

from __future__ import annotations

import pytest
from kvcm import AttentionLayer, KVCacheManagerConfig, Tier
from kvcm import oplog as L
from kvcm.oplog import ops as O
from kvcm.oplog import playback

REQUESTS = 12
OPS_PER_REQUEST = 6


def write_log(tmp_path) -> str:
    cfg = KVCacheManagerConfig(tokens_per_block=2, layers=[AttentionLayer(0, 4)], tiers=[Tier("gpu", 4 * 2 * 64)])
    recs = []
    for i in range(REQUESTS):
        toks = list(range(3 * i, 3 * i + 8))  # overlapping prefixes: reuse, new nodes, splits
        recs += [
            O.op("create_kv_cache", input_tokens=toks),
            {"op": "resume", "cache": i},
            {"op": "resize", "cache": i, "args": {"capacity": 9}},
            {"op": "drain_copy_ops"},
            {"op": "commit_input", "cache": i},
            {"op": "close", "cache": i},
        ]
    path = tmp_path / "log.jsonl"
    path.write_text(L.format_log(cfg, recs))
    return str(path)


class Planted:
    """The second 'backend': a python manager whose full state (``snapshot()`` or
    ``check_invariants()``) goes wrong from its ``after``-th ``create_kv_cache`` on, while
    every outcome, cache property and ``stats()`` stays right: only a full check sees it."""

    def __init__(self, m, after: int, what: str, counter: list[int]) -> None:
        self.m, self.after, self.what, self.counter = m, after, what, counter
        self.creates = 0

    def create_kv_cache(self, *a, **kw):
        self.creates += 1
        return self.m.create_kv_cache(*a, **kw)

    def snapshot(self):
        self.counter[0] += 1
        s = self.m.snapshot()
        return dict(s, clock=-1) if self.what == "snapshot" and self.creates >= self.after else s

    def check_invariants(self):
        if self.what == "invariants" and self.creates >= self.after:
            raise AssertionError("planted invariant violation")
        self.m.check_invariants()

    def __getattr__(self, name):
        return getattr(self.m, name)


def planted(monkeypatch, after: int, what: str) -> list[int]:
    counter = [0]
    real = L.build_manager

    def build(cfg, backend):
        m = real(cfg, "python")
        return Planted(m, after, what, counter) if backend == "cpp" else m

    monkeypatch.setattr(playback, "build_manager", build)
    return counter


def test_oplog_replay_full_checks_are_not_after_every_op(tmp_path, monkeypatch):
    """The 50-request log that ran 11 minutes: a full snapshot comparison after each of
    its 303 ops.  Now a handful, where the log read reaches 1/2, 1/4, ... of it."""
    path = write_log(tmp_path)
    monkeypatch.setattr(playback, "FULL_CHECK_MIN_CHARS", 1)  # as on a big log: many halving points
    counter = planted(monkeypatch, after=10**9, what="none")
    report = L.replay(path, ["python", "cpp"])
    assert report.ok and report.steps == REQUESTS * OPS_PER_REQUEST
    ops = REQUESTS * OPS_PER_REQUEST
    assert 2 <= counter[0] <= ops.bit_length() + 3, counter[0]  # ~log2(ops) + the first and the last


@pytest.mark.parametrize("min_chars", [1, 1 << 16])
@pytest.mark.parametrize("what", ["snapshot", "invariants"])
@pytest.mark.parametrize("after", [1, 2, 5, 12])
def test_oplog_replay_finds_a_planted_divergence_at_its_op(tmp_path, monkeypatch, after, what, min_chars):
    path = write_log(tmp_path)
    monkeypatch.setattr(playback, "FULL_CHECK_MIN_CHARS", min_chars)
    planted(monkeypatch, after=after, what=what)
    report = L.replay(path, ["python", "cpp"])
    d = report.divergence
    assert d is not None and d.kind == what, str(report)
    expected = (after - 1) * OPS_PER_REQUEST  # the create that starts it
    assert (d.step, d.op["op"]) == (expected, "create_kv_cache"), str(report)
    assert d.line == expected + 2  # the header is line 1
    assert report.steps == expected + 1


def test_oplog_replay_light_check_catches_stats_at_the_op(tmp_path, monkeypatch):
    """Between full checks every op still compares stats() (a digest of the whole state)."""
    path = write_log(tmp_path)
    real = L.build_manager

    class StatsOff:
        def __init__(self, m):
            self.m, self.creates = m, 0

        def create_kv_cache(self, *a, **kw):
            self.creates += 1
            return self.m.create_kv_cache(*a, **kw)

        def stats(self):
            s = self.m.stats()
            return dict(s, requests=s["requests"] + 1) if self.creates >= 4 else s

        def __getattr__(self, name):
            return getattr(self.m, name)

    monkeypatch.setattr(playback, "build_manager",
                        lambda cfg, b: StatsOff(real(cfg, "python")) if b == "cpp" else real(cfg, "python"))
    report = L.replay(path, ["python", "cpp"])
    d = report.divergence
    assert d is not None and d.kind == "snapshot" and "stats(python) vs stats(cpp)" in d.detail
    assert d.step == 3 * OPS_PER_REQUEST
