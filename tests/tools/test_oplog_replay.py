"""Replaying op logs (kvcm.oplog.replay, ``python -m kvcm oplog-replay``): recorded runs replay
byte-identically on both backends (shared tier, quotas, failed and settled copies, forks, old
logs), divergences are reported at the first differing outcome or snapshot, and the
differential harness (parity/test_differential.py) catches a planted divergence and prints a
replayable log.  Builders: tests/tools/oplog_helpers.py."""

from __future__ import annotations

import json
from pathlib import Path

import kvcm
import pytest
from kvcm import AttentionLayer, KVCacheManagerConfig, Tier
from kvcm import oplog as L
from kvcm.oplog import ops as O
from kvcm.oplog import playback
from oplog_helpers import B, config, read_lines, record, workload

# ---------------------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------------------


def test_replay_reproduces_a_recorded_run(tmp_path, monkeypatch):
    path = record(tmp_path, monkeypatch)
    report = L.replay(path, ["python"])
    assert report.ok, str(report)
    assert report.steps == len(read_lines(path)) - 1
    assert "no divergence" in str(report)


def shared_workload(m) -> None:
    """The shared tier's calls: candidates, create with hits (a set: recorded as a list),
    store ops and shared onboards with keys, a failed onboard reported."""
    w = m.create_kv_cache()
    assert w.resume() and w.resize(2 * B)
    w.commit(list(range(2 * B)))
    store = {(o.key, o.lc) for o in m.drain_copy_ops() if o.reason == "store"}
    w.close()
    m.clear_reusable()  # the local copies are gone; the store still has them
    hits = {c for c in m.shared_candidates(list(range(2 * B + 1))) if c in store}
    assert len(hits) == 5  # blocks 0, 1 of both attention life cycles, the snapshot at block 1
    # the probes with the store's answer (a set and a generator: recorded as lists)
    assert m.probe_reuse_detail(list(range(2 * B + 1)), shared_hits=hits) == kvcm.ReuseProbe(2 * B, 2 * B, (3, 3))
    assert m.probe_reuse(list(range(2 * B + 1)), None, (h for h in sorted(hits))) == 2 * B
    with pytest.raises(ValueError):
        m.probe_reuse_detail([1], shared_hits=[(b"\x00" * 32, 9)])
    r = m.create_kv_cache(list(range(2 * B + 1)), shared_hits=hits)
    assert r.num_reused_tokens == 2 * B and r.resume()
    onboards = [o for o in m.drain_copy_ops() if o.src_tier == 3]
    assert onboards and all(o.key is not None for o in onboards)
    assert m.forget_copies(onboards[:1]) == [r.id]  # block 0 did not load: r rolls back
    with pytest.raises(TypeError):
        m.create_kv_cache([1], shared_hits=[("k", 0)])


def quota_workload(m) -> None:
    """set_quota while serving: a shrink that offloads and relocates, a refusal, bad input."""
    kvs = []
    for base in (10, 20, 30, 40):
        kv = m.create_kv_cache()
        assert kv.resume() and kv.resize(B)
        kv.commit(list(range(base, base + B)))
        kvs.append(kv)
        if base < 30:
            kv.close()
    m.set_quota("gpu", 40 * 3)
    with pytest.raises(kvcm.OutOfPagesError):
        m.set_quota("gpu", 40 * 1)
    with pytest.raises(ValueError):
        m.set_quota("nvme", 40)
    with pytest.raises(TypeError):
        m.set_quota("host", 1.5)
    m.drain_copy_ops()
    m.set_quota("host", 40 * 9)
    kvs[2].close()
    kvs[3].close()


def test_oplog_records_and_replays_set_quota(tmp_path, monkeypatch):
    path = record(tmp_path, monkeypatch, run=quota_workload)
    ops = [json.loads(x) for x in read_lines(path)][1:]
    sq = [r for r in ops if r["op"] == "set_quota"]
    assert [r["args"] for r in sq] == [{"tier": "gpu", "quota_bytes": 120}, {"tier": "gpu", "quota_bytes": 40},
                                       {"tier": "nvme", "quota_bytes": 40}, {"tier": "host", "quota_bytes": 1.5},
                                       {"tier": "host", "quota_bytes": 360}]
    assert [r["outcome"] for r in sq] == [{"result": None}, {"error": "OutOfPagesError"}, {"error": "ValueError"},
                                          {"error": "TypeError"}, {"result": None}]
    assert "refused, nothing changed" in sq[1]["message"]
    drained = next(r for r in ops if r["op"] == "drain_copy_ops")["outcome"]["result"]
    assert {o[5] for o in drained} >= {"offload", "relocate"}
    for backends in (["python"], ["python", "cpp"]):
        report = L.replay(path, backends)
        assert report.ok, report


def test_replay_reproduces_shared_tier_calls(tmp_path, monkeypatch):
    cfg = config(tiers=[Tier("gpu", 40 * 6), Tier("shared", 0, str(tmp_path))], shared_namespace="oplog")
    path = record(tmp_path, monkeypatch, run=shared_workload, cfg=cfg)
    ops = [json.loads(x) for x in read_lines(path)][1:]
    create = next(r for r in ops if r["op"] == "create_kv_cache" and "shared_hits" in r["args"])
    hits = create["args"]["shared_hits"]
    assert len(hits) == 5 and all(len(bytes.fromhex(k)) == 32 for k, _lc in hits)  # [key hex, lc] pairs
    assert any(r["op"] == "shared_candidates" for r in ops)
    forget = next(r for r in ops if r["op"] == "forget_copies")
    assert len(forget["args"]["ops"][0]) == 7  # the key travels with the op
    probes = [r for r in ops if r["op"] in ("probe_reuse", "probe_reuse_detail")]
    assert [sorted(map(tuple, r["args"]["shared_hits"])) for r in probes[:2]] == [sorted(map(tuple, hits))] * 2
    assert [r["outcome"] for r in probes] == [{"result": [2 * B, 2 * B, [3, 3]]}, {"result": 2 * B},
                                              {"error": "ValueError"}]
    for backends in (["python"], ["python", "cpp"]):
        report = L.replay(path, backends)
        assert report.ok, report


def test_a_log_recorded_before_block_tiers_replays_byte_identically(tmp_path, monkeypatch):
    """A log of a kvcm from before ``ReuseProbe.block_tiers`` and probes' ``shared_hits``:
    its probes have no ``shared_hits`` key and their results are ``[m, m_before_ssm]``.  It
    replays without a divergence, and each op's outcome is recorded again exactly as
    written (kvcm.oplog.ops.recorded_form)."""
    path = record(tmp_path, monkeypatch)
    old = []
    for line in read_lines(path):
        rec = json.loads(line)
        if rec.get("op") in ("probe_reuse", "probe_reuse_detail"):
            assert "shared_hits" not in rec["args"]  # a probe without hits records what it always did
        if rec.get("op") == "probe_reuse_detail":
            m, mbs, tiers = rec["outcome"]["result"]
            assert tiers == [-1] * (m // B)  # the scope of the probe holds nothing
            rec["outcome"]["result"] = [m, mbs]  # what the kvcm before block_tiers wrote
        old.append(O.dumps(rec))
    Path(path).write_text("\n".join(old) + "\n")
    for backends in (["python"], ["python", "cpp"]):
        report = L.replay(path, backends)
        assert report.ok, report
    (stream,) = L.read_log(path)
    ls = L.Lockstep([L.build_manager(config(), b) for b in ("python", "cpp")], ["python", "cpp"])
    for rec, line in zip(stream.ops, old[1:]):
        op = {k: v for k, v in rec.items() if k in ("op", "args", "cache")}
        assert ls.step(op, rec["outcome"]) is None
        written = {k: v for k, v in json.loads(line).items() if k != "message"}
        assert O.dumps({"m": rec["m"], "step": rec["step"], **ls.records[-1]}) == O.dumps(written)
    # a tier that differs from a new log's record is a divergence, as any result
    rec = next(r for r in stream.ops if r["op"] == "probe_reuse_detail")
    fresh = L.Lockstep([L.build_manager(config(), "python")], ["python"])
    assert fresh.step({"op": "probe_reuse_detail", "args": rec["args"]}, {"result": [0, 0, [0]]}) is not None


def bad_hits_workload(m) -> None:
    """Bad shared hits that hold bytes: a key of the wrong length in a list pair and in a
    tuple pair (ValueError), a pair whose lc is no int (TypeError)."""
    for hits, err in (([[b"", 0]], ValueError), ([(b"\x01" * 31, 0)], ValueError), ([(b"\x00" * 32, "0")], TypeError)):
        with pytest.raises(err):
            m.create_kv_cache([1], shared_hits=hits)


def test_bad_shared_hits_with_bytes_replay_as_recorded(tmp_path, monkeypatch):
    """A long differential run's log did not replay: ``[b"", 0]`` was written as the raw
    value ``["", 0]`` (its bytes turned into a str), so the replay raised TypeError where
    the call had raised ValueError.  Such a pair is recorded with its bytes."""
    cfg = config(tiers=[Tier("gpu", 40 * 6), Tier("shared", 0, str(tmp_path))], shared_namespace="oplog")
    path = record(tmp_path, monkeypatch, run=bad_hits_workload, cfg=cfg)
    ops = [json.loads(x) for x in read_lines(path)][1:]
    creates = [r for r in ops if r["op"] == "create_kv_cache"]
    assert [r["outcome"] for r in creates] == [{"error": "ValueError"}, {"error": "ValueError"}, {"error": "TypeError"}]
    assert creates[0]["args"]["shared_hits"] == [{"pair": ["", 0], "type": "list"}]
    for backends in (["python"], ["python", "cpp"]):
        report = L.replay(path, backends)
        assert report.ok, report


def test_replay_reports_the_first_outcome_divergence(tmp_path, monkeypatch):
    path = record(tmp_path, monkeypatch)
    lines = read_lines(path)
    # pretend the recording saw resize fail: replay must stop exactly there
    i = next(i for i, x in enumerate(lines) if json.loads(x).get("op") == "resize")
    rec = json.loads(lines[i])
    rec["outcome"] = {"result": False}
    lines[i] = json.dumps(rec)
    Path(path).write_text("\n".join(lines) + "\n")
    report = L.replay(path, ["python"])
    assert not report.ok
    d = report.divergence
    assert (d.step, d.kind, d.op["op"]) == (i - 1, "outcome", "resize")
    assert d.outcomes["recorded"] == {"result": False}
    assert d.outcomes["python"]["result"] is True
    assert "first divergence" in str(report) and "resize" in str(report)


def test_replay_compares_snapshots_across_backends(tmp_path, monkeypatch):
    path = record(tmp_path, monkeypatch)
    real = L.build_manager

    class Skewed:  # a "second backend" whose snapshot drifts after the 3rd op
        def __init__(self, m):
            self.m, self.calls = m, 0

        def __getattr__(self, name):
            if name == "snapshot":
                return self.snapshot
            self.calls += name in ("create_kv_cache", "drain_copy_ops", "probe_reuse", "probe_reuse_detail")
            return getattr(self.m, name)

        def snapshot(self):
            s = self.m.snapshot()
            if self.calls >= 2:
                s = dict(s, clock=-1)
            return s

    def build(cfg, backend):
        m = real(cfg, "python")
        return Skewed(m) if backend == "cpp" else m

    monkeypatch.setattr(playback, "build_manager", build)  # what replay() builds each side with
    report = L.replay(path, ["python", "cpp"])
    assert not report.ok and report.divergence.kind == "snapshot"
    assert "/clock" in report.divergence.detail
    assert report.minimized is None
    # minimised: the fewest ops that still make the second side's snapshot drift
    report = L.replay(path, ["python", "cpp"], minimize_divergence=True)
    lines = report.minimized.splitlines()
    ops = [json.loads(x)["op"] for x in lines[1:]]
    assert len(ops) < report.divergence.step + 1
    assert sum(op in ("create_kv_cache", "drain_copy_ops", "probe_reuse", "probe_reuse_detail") for op in ops) == 2


def test_oplog_replay_command_exit_codes(tmp_path, monkeypatch, capsys):
    from kvcm.cli.oplog_replay import main as oplog_replay

    path = record(tmp_path, monkeypatch)
    assert oplog_replay([path, "--backend", "python"]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert oplog_replay([path, "--backend", "rust"]) == 2
    assert oplog_replay([str(tmp_path / "missing.jsonl"), "--backend", "python"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"m": "x", "op": "stats"}\n')
    assert oplog_replay([str(bad), "--backend", "python"]) == 2
    assert "before its config line" in capsys.readouterr().err


def test_format_log_is_replayable(tmp_path):
    records = [
        {"op": "create_kv_cache", "args": {"input_tokens": [1, 2, 3]}, "outcome": {"result": 0}},
        {"op": "resume", "cache": 0, "outcome": {"result": True}},
        {"op": "commit", "cache": 0, "args": {"tokens": [1]}, "outcome": {"error": "ValueError"}},
    ]
    p = tmp_path / "f.jsonl"
    p.write_text(L.format_log(config(), records))
    report = L.replay(str(p), ["python"])
    assert report.ok, str(report)


def test_record_and_replay_on_the_active_backend(backend, tmp_path, monkeypatch):
    """The recorder and the replayer on the CI leg's backend (cpp: gap until issue #3)."""
    path = tmp_path / "log.jsonl"
    monkeypatch.setenv(L.ENV_VAR, str(path))
    m = L.maybe_wrap(L.build_manager(config(), backend))
    workload(m)
    report = L.replay(str(path), [backend])
    assert report.ok, str(report)


def test_forget_copies_is_recorded_and_replayed(tmp_path, monkeypatch):
    """The failed-copies call (issue 8) in the op log: its ops as JSON lists, bad input
    too, replayed on both backends with the same outcomes and snapshots."""
    path = tmp_path / "log.jsonl"
    monkeypatch.setenv(L.ENV_VAR, str(path))
    cfg = KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 1)],
                               tiers=[Tier("gpu", 8), Tier("host", 16)])
    m = L.maybe_wrap(L.build_manager(cfg, "python"))
    for base in (100, 200):
        kv = m.create_kv_cache(id=f"r{base}")
        assert kv.resume() and kv.resize(8)
        kv.commit(list(range(base, base + 8)))
        kv.suspend()
    ops = m.drain_copy_ops()
    assert [o.reason for o in ops] == ["offload", "offload"]
    with pytest.raises(TypeError):
        m.forget_copies([ops[0], "x"])
    assert m.forget_copies(ops[1:]) == ["r100"]
    recs = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    forgets = [r for r in recs if r["op"] == "forget_copies"]
    assert forgets[0]["args"]["ops"] == [ops[0].to_json(), {"value": "x"}]
    assert forgets[0]["outcome"] == {"error": "TypeError"}
    assert forgets[1]["args"]["ops"] == [ops[1].to_json()] and forgets[1]["outcome"] == {"result": ["r100"]}
    report = L.replay(str(path), ["python", "cpp"])
    assert report.ok, str(report)


def test_settle_copies_is_recorded_and_replayed(tmp_path, monkeypatch):
    """Explicit settlement (DECISIONS.md "Asynchronous copies: settle_copies") in the op
    log: ``settle_copies``' ``failed`` as JSON lists, bad input and refusals too, the
    config's ``copy_settlement`` in the header; replayed on both backends with the same
    outcomes and snapshots."""
    path = tmp_path / "log.jsonl"
    monkeypatch.setenv(L.ENV_VAR, str(path))
    cfg = KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 1)],
                               tiers=[Tier("gpu", 8), Tier("host", 16)], copy_settlement="explicit")
    m = L.maybe_wrap(L.build_manager(cfg, "python"))
    drains = []
    for base in (100, 200, 300):
        kv = m.create_kv_cache(id=f"r{base}")
        assert kv.resume() and kv.resize(8)
        kv.commit(list(range(base, base + 8)))
        kv.suspend()
        drains.append(m.drain_copy_ops())
    assert [len(d) for d in drains] == [0, 2, 2] and m.unsettled_drains == 2
    with pytest.raises(TypeError):
        m.settle_copies([drains[1][0], "x"])
    with pytest.raises(ValueError):
        m.settle_copies(drains[2][:1] + [drains[2][0]])  # the newer drain's ops: not the oldest's
    with pytest.raises(ValueError):
        m.forget_copies(drains[1])
    assert m.settle_copies(drains[1][1:]) == ["r100"]
    assert m.settle_copies() == []
    with pytest.raises(ValueError):
        m.settle_copies()  # nothing left to settle
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert recs[0]["config"]["copy_settlement"] == "explicit"
    settles = [r for r in recs[1:] if r["op"] == "settle_copies"]
    assert settles[0]["args"]["failed"] == [drains[1][0].to_json(), {"value": "x"}]
    assert [r["outcome"] for r in settles] == [{"error": "TypeError"}, {"error": "ValueError"}, {"result": ["r100"]},
                                               {"result": []}, {"error": "ValueError"}]
    assert settles[2]["args"]["failed"] == [drains[1][1].to_json()]
    report = L.replay(str(path), ["python", "cpp"])
    assert report.ok and report.steps == len(recs) - 1, str(report)


def test_a_log_without_copy_settlement_replays_as_drain(tmp_path, monkeypatch):
    """A log recorded before ``copy_settlement`` existed (its header has no such key)
    replays unchanged: the field's default is today's behaviour."""
    path = tmp_path / "log.jsonl"
    monkeypatch.setenv(L.ENV_VAR, str(path))
    m = L.maybe_wrap(L.build_manager(config(), "python"))
    workload(m)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["config"].pop("copy_settlement") == "drain"
    old = tmp_path / "old.jsonl"
    old.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    report = L.replay(str(old), ["python", "cpp"])
    assert report.ok and report.steps == len(lines) - 1, str(report)


def test_fork_is_recorded_and_replayed(tmp_path, monkeypatch):
    """Forks (issue 22) in the op log: ``fork`` is a cache op whose result is the new
    cache's handle; later ops on the fork name that handle; a refused fork records its
    error; the log replays on both backends with the same outcomes and snapshots."""
    path = tmp_path / "log.jsonl"
    monkeypatch.setenv(L.ENV_VAR, str(path))
    cfg = KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 1)], tiers=[Tier("gpu", 24)])
    m = L.maybe_wrap(L.build_manager(cfg, "python"))
    kv = m.create_kv_cache(id="p")
    assert kv.resume() and kv.resize(6)
    kv.commit(list(range(100, 106)))
    f = kv.fork(id="beam")
    assert isinstance(f, L.RecordingCache) and f.id == "beam"
    with pytest.raises(ValueError):
        kv.fork(id="beam")  # in use
    assert f.resize(7)
    f.commit([7])
    g = f.fork()
    assert [o.reason for o in m.drain_copy_ops()] == ["cow"]
    g.close()
    recs = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    forks = [r for r in recs if r["op"] == "fork"]
    assert [(r["cache"], r["args"], r["outcome"]) for r in forks] == [
        (0, {"id": "beam"}, {"result": 1}),
        (0, {"id": "beam"}, {"error": "ValueError"}),
        (1, {"id": None}, {"result": 2}),
    ]
    assert [r["cache"] for r in recs if r["op"] in ("commit", "close")] == [0, 1, 2]
    report = L.replay(str(path), ["python", "cpp"])
    assert report.ok and report.steps == len(recs), str(report)


# ---------------------------------------------------------------------------------------
# the differential harness (parity/test_differential.py) against a planted divergence
# ---------------------------------------------------------------------------------------


def test_differential_harness_catches_a_divergence_and_prints_a_replayable_log(tmp_path):
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from parity import test_differential as D

    class OffByOne:
        """A 'backend' that answers probe_reuse wrongly once the prefix is 2+ tokens."""

        def __init__(self, m):
            self._m = m

        def __getattr__(self, name):
            return getattr(self._m, name)

        def probe_reuse(self, tokens, scope=None, shared_hits=None):
            n = self._m.probe_reuse(tokens, scope, shared_hits)
            return n + 1 if n >= 2 else n

    class Planted(D.machine_for(("python", "python"))):
        def build(self, config):
            built = super().build(config)
            return None if built is None else [built[0], OffByOne(built[1])]

    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(Planted, settings=settings(D.DIFF_SETTINGS, max_examples=1000))
    msg = str(info.value)
    assert "(outcome)" in msg and "probe_reuse" in msg
    log = msg.split("---\n", 1)[1]
    lines = log.strip().splitlines()
    assert json.loads(lines[0])["kvcm_oplog"] == L.FORMAT_VERSION
    assert json.loads(lines[-1])["op"] == "probe_reuse"
    # minimised: short (the drawn example's own length varies with the op mix), and
    # 1-minimal: dropping any one op loses the divergence
    assert len(lines) <= 10, f"not minimised: {len(lines)} lines"
    recs = [json.loads(x) for x in lines[1:]]
    cfg = L.config_from_json(json.loads(lines[0])["config"])

    def planted_pair(c):
        return [L.build_manager(c, "python"), OffByOne(L.build_manager(c, "python"))]

    for i in range(len(recs) - 1):
        d, _ = L.run_ops(cfg, planted_pair, ["a", "b"], recs[:i] + recs[i + 1 :])
        assert d is None or d.signature != ("outcome", "probe_reuse"), f"op {i} is not needed"
    path = tmp_path / "shrunk.jsonl"
    path.write_text(log)
    report = L.replay(str(path), ["python"])  # recorded outcomes are the reference side's
    assert report.ok, str(report)
