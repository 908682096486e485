"""kvcm.oplog.ops (the op vocabulary) and kvcm.oplog (KVCM_OPLOG recording, replay, CLI)."""

from __future__ import annotations

import array
import json
import os
import warnings
from pathlib import Path

import kvcm
import pytest
from kvcm import AttentionLayer, KVCacheManagerConfig, ReuseScope, SsmLayer, Status, Tier
from kvcm import oplog as L
from kvcm.oplog import ops as O
from kvcm.oplog import playback

from parity.helpers import python_work

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


# ---------------------------------------------------------------------------------------
# config and op JSON forms
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        config(),
        config(pool_ratio={0: 1, 1: 0.5, 2: 2}, enable_partial_reuse=False, reuse_match_backoff=3),
        config(tiers=[Tier("gpu", 4000), Tier("host", 4000), Tier("disk", 4000, path="/tmp/x")], max_events=0),
        KVCacheManagerConfig(
            tokens_per_block=16, layers=[SsmLayer(5, 100)], tiers=[Tier("gpu", 1000)], default_priority=0
        ),
    ],
)
def test_config_json_round_trip(cfg):
    text = json.dumps(L.config_to_json(cfg))
    back = L.config_from_json(json.loads(text))
    assert back == cfg
    assert L.config_to_json(back) == json.loads(text)


def test_config_from_json_rejects_unknown_keys():
    d = L.config_to_json(config())
    d["colour"] = 1
    with pytest.raises(ValueError, match="colour"):
        L.config_from_json(d)


def test_tokens_and_scopes_json():
    toks = [0, 2**31 - 1, D, -1, "x", 1.5, True, None]
    enc = O.encode_tokens(toks)
    assert enc == [0, 2**31 - 1, {"digest": D.hex()}, -1, "x", 1.5, True, None]
    assert json.loads(json.dumps(enc)) == enc
    assert O.decode_tokens(enc) == toks
    assert O.decode_tokens("abc") == "abc"
    assert O.encode_scope(ReuseScope(salt=3)) == {"lora_id": None, "salt": 3}
    assert O.decode_scope({"salt": 3}) == ReuseScope(salt=3)
    assert O.decode_scope(None) is None
    assert O.decode_scope("bad") == "bad"


def test_normalize():
    assert O.normalize(kvcm.CopyOp(0, 0, 1, 1, 2, "offload")) == [0, 0, 1, 1, 2, "offload"]
    assert O.normalize(kvcm.ReuseProbe(4, 6)) == [4, 6, []]
    assert O.normalize(kvcm.ReuseProbe(4, 6, (0, 3))) == [4, 6, [0, 3]]
    assert O.normalize(Status.ACTIVE) == "ACTIVE"
    assert O.normalize({1: (b"\x01", None)}) == {"1": ["01", None]}
    ev = kvcm.RemovedEvent(event_id=3, keys=(b"\xaa",), lc=1)
    assert O.normalize([ev]) == [{"event_id": 3, "kind": "removed", "keys": ["aa"], "lc": 1}]


@pytest.mark.parametrize(
    "op, match",
    [
        ({"op": "frobnicate"}, "unknown op"),
        ({"op": "commit", "args": {"tokens": []}}, "needs a cache handle"),
        ({"op": "commit", "cache": 5, "args": {"tokens": []}}, "does not exist"),
        ({"op": "commit", "cache": 0, "args": {"tokns": []}}, "unknown args"),
        ({"op": "stats", "cache": 0}, "takes no cache handle"),
        ({"op": "stats", "extra": 1}, "unknown keys"),
        ("stats", "is a dict"),
    ],
)
def test_malformed_ops_raise_operror(op, match):
    with pytest.raises(O.OpError, match=match):
        O.apply(None, [object()], op)


def test_every_public_call_has_an_op():
    manager_methods = {"create_kv_cache", "probe_reuse", "probe_reuse_detail", "drain_copy_ops", "drain_copy_runs",
                       "clear_reusable", "set_quota",
                       "shutdown", "stats", "take_iteration_stats", "take_events",
                       "resize_batch", "commit_batch", "forget_copies", "settle_copies",
                       "shared_candidates"}  # fmt: skip
    cache_methods = {
        "resume",
        "suspend",
        "resize",
        "commit",
        "commit_input",
        "stop_committing",
        "close",
        "page_indices",
        "page_indices_into",
        "fork",
    }
    assert set(O.MANAGER_OPS) == manager_methods
    assert set(O.CACHE_OPS) == cache_methods
    abstract = set(kvcm.KVCacheManager.__abstractmethods__) | set(kvcm.KVCache.__abstractmethods__)
    observe_only = {"config", "life_cycles", "unsettled_drains", "snapshot", "check_invariants"} | set(O.CACHE_PROPS)
    # calls with a default on the interface (kvcm.api: drain_copy_runs groups drain_copy_ops)
    concrete = {"drain_copy_runs"}
    assert all(callable(getattr(kvcm.KVCacheManager, n, None)) for n in concrete)
    assert abstract - observe_only == (manager_methods - concrete) | cache_methods


def test_apply_on_the_python_backend():
    m = py_manager()
    caches: list = []
    assert O.apply(m, caches, O.op("create_kv_cache", input_tokens=[1, 2, 3], scope=ReuseScope(salt=1))) == {
        "result": 0
    }
    assert O.apply(m, caches, {"op": "resume", "cache": 0}) == {"result": True}
    assert O.apply(m, caches, {"op": "resize", "cache": 0, "args": {"capacity": 4}}) == {"result": True}
    assert O.apply(m, caches, {"op": "commit", "cache": 0, "args": {"tokens": [1, 2, 3]}}) == {"result": None}
    assert O.apply(m, caches, {"op": "commit", "cache": 0, "args": {"tokens": [2**31]}}) == {"error": "ValueError"}
    assert O.apply(m, caches, {"op": "commit", "cache": 0, "args": {"tokens": ["x"]}}) == {"error": "TypeError"}
    assert O.apply(m, caches, {"op": "resume", "cache": 0}) == {"error": "InvalidStateError"}
    out = O.apply(m, caches, {"op": "page_indices_into", "cache": 0, "args": {"lc": 0, "size": 3}})
    assert out["result"]["count"] == 2 and len(out["result"]["out"]) == 2  # nothing written past count
    bad = O.apply(m, caches, {"op": "page_indices_into", "cache": 0, "args": {"lc": 0, "size": 1}}, with_message=True)
    assert bad["error"] == "ValueError" and bad["message"]
    probe = O.apply(m, caches, {"op": "probe_reuse_detail", "args": {"tokens": [1, 2], "scope": {"salt": 1}}})
    assert isinstance(probe["result"], list) and len(probe["result"]) == 3  # [m, m_before_ssm, block tiers]
    assert O.apply(m, caches, {"op": "create_kv_cache", "args": {"scope": {"salt": -1}}}) == {"error": "ValueError"}
    assert O.apply(m, caches, {"op": "close", "cache": 0}) == {"result": None}
    assert O.apply(m, caches, {"op": "suspend", "cache": 0}) == {"error": "ClosedError"}
    events = O.apply(m, caches, {"op": "take_events"})["result"]
    assert events and all(isinstance(e, dict) and "event_id" in e for e in events)
    assert json.loads(json.dumps(O.apply(m, caches, {"op": "stats"}))) == O.apply(m, caches, {"op": "stats"})


def test_batch_ops_json_forms_and_apply():
    """Batch ops: handles, foreign / non-cache items, and int containers keep their type."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    for v in ([1, 2], array.array("q", [1, 2]), array.array("i", [3]), np.array([4, 5], dtype=np.int32),
              np.array([1.5]), torch.tensor([6, 7], dtype=torch.int64)):  # fmt: skip
        enc = O.encode_container(v)
        json.dumps(enc)
        dec = O.decode_container(enc)
        def as_list(x):
            return x if isinstance(x, list) else x.tolist()

        assert type(dec) is type(v) and as_list(dec) == as_list(v)
        assert str(getattr(dec, "dtype", "")) == str(getattr(v, "dtype", "")) and enc == O.encode_container(dec)
    assert O.encode_container([D, 1]) == [{"digest": D.hex()}, 1] and O.decode_container([{"digest": D.hex()}]) == [D]
    with pytest.raises(O.OpError, match="does not exist"):
        O.validate_op({"op": "resize_batch", "args": {"caches": [0, 3], "capacities": [1, 1]}}, 2)
    O.validate_op({"op": "resize_batch", "args": {"caches": [{"foreign": True}, {"value": 9}, True], "capacities": []}}, 0)
    m = py_manager()
    caches: list = []
    for _ in range(2):
        O.apply(m, caches, O.op("create_kv_cache"))
        O.apply(m, caches, {"op": "resume", "cache": len(caches) - 1})
    rb = {"op": "resize_batch", "args": {"caches": [0, 1], "capacities": {"numpy": "int64", "values": [3, 2]}}}
    assert O.apply(m, caches, rb) == {"result": [True, True]}
    cb = {"op": "commit_batch", "args": {"caches": [1, 0], "tokens": {"torch": "int32", "values": [7, 8]}}}
    assert O.apply(m, caches, cb) == {"result": None}
    assert [c.committed_tokens for c in caches] == [[8], [7]]
    for items, err in (([0, {"foreign": True}], "ValueError"), ([{"value": 0}], "TypeError"), ("ab", "TypeError"),
                       ([0, 0], "ValueError")):  # fmt: skip
        out = O.apply(m, caches, {"op": "commit_batch", "args": {"caches": items, "tokens": [1] * len(items)}})
        assert out == {"error": err}, (items, out)
    assert [c.committed_tokens for c in caches] == [[8], [7]]


def test_run_ops_remaps_batch_handles():
    """A subsequence of a log (as minimisation runs): batch handles follow the creates that
    ran; a batch naming a cache that was not created is skipped."""
    ops = [
        {"op": "create_kv_cache", "outcome": {"result": 0}},
        {"op": "create_kv_cache", "outcome": {"result": 1}},
        {"op": "resume", "cache": 1},
        {"op": "resize_batch", "args": {"caches": [1], "capacities": [2]}},
        {"op": "resize_batch", "args": {"caches": [0, 1], "capacities": [2, 3]}},
    ]
    d, recs = L.run_ops(config(), lambda c: [py_manager(c)], ["python"], ops[1:])
    assert d is None
    assert [r["op"] for r in recs] == ["create_kv_cache", "resume", "resize_batch"]
    assert recs[-1]["args"]["caches"] == [0] and recs[-1]["outcome"] == {"result": [True]}


# ---------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------


def test_maybe_wrap_is_a_no_op_without_the_env_var(monkeypatch):
    monkeypatch.delenv(L.ENV_VAR, raising=False)
    m = py_manager()
    assert L.maybe_wrap(m) is m
    assert L.maybe_wrap_class(type(m)) is type(m)


def read_lines(path: str) -> list[str]:
    return Path(path).read_text().splitlines()


def record(tmp_path, monkeypatch, run=workload, cfg=None) -> str:
    path = str(tmp_path / "log.jsonl")
    monkeypatch.setenv(L.ENV_VAR, path)
    m = L.maybe_wrap(py_manager(cfg))
    assert isinstance(m, L.RecordingManager) and isinstance(m, kvcm.KVCacheManager)
    run(m)
    return path


def test_recording_proxy_logs_every_public_call(tmp_path, monkeypatch):
    path = record(tmp_path, monkeypatch)
    lines = [json.loads(x) for x in read_lines(path)]
    head, ops = lines[0], lines[1:]
    assert head["kvcm_oplog"] == L.FORMAT_VERSION and head["backend"] == "python"
    assert L.config_from_json(head["config"]) == config()
    names = [r["op"] for r in ops]
    assert set(names) == set(O.OPS)
    assert [r["step"] for r in ops] == list(range(len(ops)))
    create = ops[0]
    assert create["args"]["input_tokens"][3] == {"digest": D.hex()}
    assert create["args"]["scope"] == {"lora_id": 0, "salt": None}
    assert create["outcome"] == {"result": 0}
    commit = next(r for r in ops if r["op"] == "commit")
    assert commit["args"]["tokens"][3] == {"digest": D.hex()}  # the tuple was recorded
    failed = [r for r in ops if "error" in r["outcome"]]
    assert [(r["op"], r["outcome"]["error"]) for r in failed] == [("commit", "ValueError"), ("resize_batch", "ValueError"),
                                                                  ("settle_copies", "ValueError")]
    assert "out of range" in failed[0]["message"]
    assert "appears twice" in failed[1]["message"] and failed[1]["args"]["caches"] == [0, 0]
    assert "copy_settlement='explicit'" in failed[2]["message"] and failed[2]["args"] == {"failed": []}
    rb = next(r for r in ops if r["op"] == "resize_batch")
    assert rb["args"] == {"caches": [0], "capacities": {"array": "q", "values": [9]}, "history_lengths": None}
    assert rb["outcome"] == {"result": [True]}
    cb = next(r for r in ops if r["op"] == "commit_batch")
    assert cb["args"] == {"caches": [0], "tokens": {"array": "i", "values": [6]}}
    ci = next(r for r in ops if r["op"] == "commit_input")
    assert ci["args"] == {"n": 0} and ci["outcome"] == {"result": None}
    pii = next(r for r in ops if r["op"] == "page_indices_into")
    assert pii["args"] == {"lc": 0, "size": 8, "dtype": "int32"}
    assert pii["outcome"]["result"] == {"count": 4, "out": [0, 1, 2, 3]}


def test_proxy_forwards_results_and_properties(tmp_path, monkeypatch):
    monkeypatch.setenv(L.ENV_VAR, str(tmp_path / "log.jsonl"))
    m = L.maybe_wrap(py_manager())
    kv = m.create_kv_cache([1, 2, 3], id=9)
    assert isinstance(kv, kvcm.KVCache) and kv.id == 9 and kv.status is Status.SUSPENDED
    assert kv.resume() is True and kv.status is Status.ACTIVE
    assert kv.resize(4) and kv.capacity == 4
    kv.commit([1, 2, 3])
    assert kv.num_committed_tokens == 3 and kv.committed_tokens == [1, 2, 3]
    assert kv.page_indices(0) == py_manager_ref_indices()
    assert m.config == config() and m.life_cycles == m.inner.life_cycles
    assert m.snapshot() == m.inner.snapshot()
    m.check_invariants()
    assert all(isinstance(e, kvcm.Event) for e in m.take_events())


def py_manager_ref_indices() -> list[int]:
    ref = py_manager()
    kv = ref.create_kv_cache([1, 2, 3], id=9)
    kv.resume()
    kv.resize(4)
    kv.commit([1, 2, 3])
    return kv.page_indices(0)


def test_pid_in_path_and_several_managers_in_one_log(tmp_path, monkeypatch):
    monkeypatch.setenv(L.ENV_VAR, str(tmp_path / "log-{pid}.jsonl"))
    m1 = L.maybe_wrap(py_manager())
    m2 = L.maybe_wrap(py_manager(config(enable_partial_reuse=False)))
    a = m1.create_kv_cache([1, 2, 3])
    b = m2.create_kv_cache([1, 2, 3])
    a.resume(), b.resume(), a.resize(4), b.resize(4), a.commit([1, 2, 3]), b.commit([1, 2, 3])
    a.close(), b.close()
    path = tmp_path / f"log-{os.getpid()}.jsonl"
    streams = L.read_log(str(path))
    assert len(streams) == 2 and streams[0].m != streams[1].m
    assert [len(s.ops) for s in streams] == [5, 5]
    assert L.config_from_json(streams[1].config).enable_partial_reuse is False
    report = L.replay(str(path), ["python"])
    assert report.ok and report.managers == 2 and report.steps == 10, str(report)


def test_kvcm_manager_entry_point_records_when_env_is_set(tmp_path, monkeypatch):
    """KVCM_OPLOG at construction → kvcm.KVCacheManager returns the recording proxy
    (the hook in kvcm.construct: ``maybe_wrap_class``)."""
    path = tmp_path / "log.jsonl"
    monkeypatch.setenv(L.ENV_VAR, str(path))
    m = kvcm.KVCacheManager(config(), backend="python")
    assert isinstance(m, L.RecordingManager), "KVCacheManager.__new__ does not call kvcm.oplog.maybe_wrap_class"
    m.create_kv_cache([1])
    assert len(path.read_text().splitlines()) == 2
    monkeypatch.delenv(L.ENV_VAR)
    assert not isinstance(kvcm.KVCacheManager(config(), backend="python"), L.RecordingManager)


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


# ---------------------------------------------------------------------------------------
# the op log never changes a call (issue #8 item 5, SPEC sec. 15)
# ---------------------------------------------------------------------------------------


def _enospc_after(monkeypatch, n_ok: int) -> list[int]:
    """Make the op-log writer's ``os.write`` fail with ENOSPC after ``n_ok`` writes (the
    errors a full filesystem gives); returns the attempt counter."""
    import errno

    real = os.write
    attempts = [0]

    def write(fd, data):
        attempts[0] += 1
        if attempts[0] > n_ok:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return attempts


def _recorded(backend, tmp_path, monkeypatch, cfg=None):
    path = tmp_path / "log.jsonl"
    monkeypatch.setenv(L.ENV_VAR, str(path))
    return kvcm.KVCacheManager(cfg or config(), backend=backend), path


_FSIZE_SCRIPT = """
import json, os, resource, signal, sys
import kvcm
from kvcm import AttentionLayer, KVCacheManagerConfig, Tier

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
cfg = KVCacheManagerConfig(tokens_per_block=2, layers=[AttentionLayer(0, 4)], tiers=[Tier("gpu", 80)])
m = kvcm.KVCacheManager(cfg, backend=sys.argv[1])
kv = m.create_kv_cache()
assert kv.resume() and kv.resize(6)
size = os.path.getsize(os.environ["KVCM_OPLOG"])
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
out = {}

def attempt(name, call):
    try:
        out[name] = ["ok", call()]
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]

attempt("commit", lambda: kv.commit([1, 2, 3]))
out["committed"] = kv.committed_tokens
created = []
attempt("create", lambda: created.append(m.create_kv_cache([1, 2])) or created[0].id)
out["open"] = [r["id"] for r in m.snapshot()["requests"]]
for c in [kv, *created]:
    c.close()
attempt("shutdown", lambda: m.shutdown())
out["oplog_error"] = getattr(m, "oplog_error", "no such attribute")
print(json.dumps(out))
"""


def test_oplog_write_failure_does_not_fail_commit_or_lose_a_cache(backend, tmp_path):
    """A failed log write used to raise OSError after the call took effect: commit with
    the tokens committed (a retry committed them twice), create_kv_cache with the cache
    created and unreachable (shutdown() then failed).  A real write failure: the file-size
    limit (RLIMIT_FSIZE, any user) makes the kernel refuse the log's writes."""
    import subprocess
    import sys

    env = dict(os.environ, KVCM_OPLOG=str(tmp_path / "log.jsonl"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(kvcm.__file__).parents[1]), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, "-W", "always", "-c", _FSIZE_SCRIPT, backend], capture_output=True, text=True,
                       env=env, timeout=120, check=False)  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["commit"] == ["ok", None], out  # no exception from the log ...
    assert out["committed"] == [1, 2, 3]  # ... and the tokens committed once
    assert out["create"] == ["ok", 1], out  # the cache is returned, not lost
    assert out["open"] == [0, 1]
    assert out["shutdown"] == ["ok", None], out  # nothing left held
    assert "File too large" in out["oplog_error"]
    assert p.stderr.count("OpLogWarning") == 1 and "KVCM_OPLOG" in p.stderr  # said once
    assert L.replay(str(tmp_path / "log.jsonl"), [backend]).ok  # what was written is a clean prefix


def test_oplog_write_failure_warns_once_and_stops_writing(backend, tmp_path, monkeypatch):
    """An injected ENOSPC: one warning, the flag set, no further write attempted, the
    calls unaffected."""
    m, path = _recorded(backend, tmp_path, monkeypatch)
    kv = m.create_kv_cache()
    assert kv.resume() and kv.resize(6)
    attempts = _enospc_after(monkeypatch, 0)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        kv.commit([1, 2, 3])  # no exception: the call took effect exactly once
        assert kv.committed_tokens == [1, 2, 3] and kv.num_committed_tokens == 3
        kv.commit([4])  # logging stopped: no more writes, no second warning
        m.stats()
    assert kv.committed_tokens == [1, 2, 3, 4]
    assert attempts[0] == 1
    assert [w.category for w in warned] == [L.OpLogWarning]
    assert "No space left on device" in str(warned[0].message) and L.ENV_VAR in str(warned[0].message)
    assert "No space left" in m.oplog_error
    kv.close()
    m.shutdown()
    monkeypatch.undo()
    # the log is the complete prefix before the failure, and replays
    assert [json.loads(x).get("op") for x in read_lines(str(path))] == [None, "create_kv_cache", "resume", "resize"]
    assert L.replay(str(path), [backend]).ok


def test_oplog_write_failure_in_create_kv_cache_returns_the_cache(backend, tmp_path, monkeypatch):
    """An injected ENOSPC on create_kv_cache's record: the cache is returned and usable,
    and shutdown() works once it is closed."""
    m, _ = _recorded(backend, tmp_path, monkeypatch)
    _enospc_after(monkeypatch, 0)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        kv = m.create_kv_cache([1, 2, 3])
    assert isinstance(kv, kvcm.KVCache) and kv.status is Status.SUSPENDED
    assert [w.category for w in warned] == [L.OpLogWarning]
    assert kv.resume() and kv.resize(4)
    kv.commit([1, 2, 3])
    kv.close()
    m.shutdown()  # every cache closed: nothing held
    assert m.oplog_error is not None
    m.check_invariants()


def test_oplog_partial_line_on_a_full_disk_is_cut_off(tmp_path, monkeypatch):
    """A short write (the filesystem filled mid-line) leaves no half record behind."""
    import errno

    m, path = _recorded("python", tmp_path, monkeypatch)
    m.create_kv_cache([1])
    real = os.write

    def short_then_full(fd, data):
        if len(data) > 8:
            return real(fd, bytes(data[:8]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.warns(L.OpLogWarning):
        m.create_kv_cache([1, 2, 3, 4, 5, 6])
    monkeypatch.undo()
    lines = read_lines(str(path))
    assert len(lines) == 2 and all(json.loads(x) for x in lines)
    assert L.replay(str(path), ["python"]).ok


def _mount_tmpfs(where: Path, size: str) -> bool:
    import subprocess

    where.mkdir()
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       check=False)  # fmt: skip
    return r.returncode == 0


def test_oplog_on_a_really_full_filesystem(backend, tmp_path, monkeypatch):
    """The same on a real 64 KiB tmpfs (needs root to mount; skipped elsewhere, where the
    injected-ENOSPC tests above stand in)."""
    import subprocess

    fs = tmp_path / "small"
    if not _mount_tmpfs(fs, "64k"):
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        m, path = _recorded(backend, fs, monkeypatch)
        big = list(range(2000))  # ~10 KB per record: the filesystem fills after a few
        results = []
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            for i in range(12):
                kv = m.create_kv_cache(big, id=f"r{i}")
                results.append((kv.resume(), kv.num_reused_tokens))
                kv.close()
        assert [w.category for w in warned] == [L.OpLogWarning]
        assert "No space left on device" in str(warned[0].message)
        assert "No space left on device" in m.oplog_error
        ref = L.build_manager(config(), backend)  # the same calls, unrecorded
        want = []
        for _ in range(12):
            kv = ref.create_kv_cache(big)
            want.append((kv.resume(), kv.num_reused_tokens))
            kv.close()
        assert results == want
        m.shutdown()
        lines = read_lines(str(path))
        assert 1 < len(lines) and all(json.loads(x) for x in lines)  # a clean prefix
        assert L.replay(str(path), [backend]).ok
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)  # lazy: the log's descriptor may be open


def test_oplog_unusable_path_names_the_variable(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in (blocker / "log.jsonl", tmp_path):  # under a regular file; a directory
        monkeypatch.setenv(L.ENV_VAR, str(bad))
        with pytest.raises(OSError, match=rf"^\[Errno \d+\] {L.ENV_VAR}='{bad}': cannot open"):
            kvcm.KVCacheManager(config(), backend="python")
    assert blocker.read_text() == "x"


def test_oplog_refuses_a_symlink_path(tmp_path, monkeypatch):
    """The log holds prompts: it is never written through a symlink (someone else's
    target, or a link planted where the log will be)."""
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    link = tmp_path / "log.jsonl"
    link.symlink_to(target)
    monkeypatch.setenv(L.ENV_VAR, str(link))
    with pytest.raises(OSError, match=f"{L.ENV_VAR}=.*symbolic link"):
        kvcm.KVCacheManager(config(), backend="python")
    assert target.read_text() == "precious\n"
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "not-yet")
    monkeypatch.setenv(L.ENV_VAR, str(dangling))
    with pytest.raises(OSError, match="symbolic link"):
        kvcm.KVCacheManager(config(), backend="python")
    assert not (tmp_path / "not-yet").exists()


def test_oplog_refuses_a_hard_link_and_a_fifo(tmp_path, monkeypatch):
    other = tmp_path / "other.txt"
    other.write_text("mine\n")
    os.link(other, tmp_path / "log.jsonl")
    monkeypatch.setenv(L.ENV_VAR, str(tmp_path / "log.jsonl"))
    with pytest.raises(OSError, match="hard links"):
        kvcm.KVCacheManager(config(), backend="python")
    assert other.read_text() == "mine\n"
    os.mkfifo(tmp_path / "fifo")
    monkeypatch.setenv(L.ENV_VAR, str(tmp_path / "fifo"))
    with pytest.raises(OSError, match="not a regular file"):  # and no hang waiting for a reader
        kvcm.KVCacheManager(config(), backend="python")


def test_oplog_file_is_created_0600(tmp_path, monkeypatch):
    import stat

    old = os.umask(0)  # even with a permissive umask
    try:
        # the directory must exist: the op log creates none (issue 20 item 9,
        # tests/tools/test_cli.py::test_kvcm_oplog_in_a_missing_directory_is_refused_not_created)
        (tmp_path / "new-dir").mkdir()
        m, path = _recorded("python", tmp_path / "new-dir", monkeypatch)
        m.create_kv_cache([1])
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        loose = tmp_path / "loose.jsonl"
        loose.write_text("")
        loose.chmod(0o644)
        monkeypatch.setenv(L.ENV_VAR, str(loose))
        kvcm.KVCacheManager(config(), backend="python").create_kv_cache([1])
        assert stat.S_IMODE(loose.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_oplog_threaded_run_replays_without_divergence(backend, tmp_path, monkeypatch):
    """Records of calls from several threads used to be written after the manager lock
    was released, so the file's order could differ from the order the calls took effect
    and oplog-replay reported a false divergence.  A slow log write (sleep before it)
    widens that window."""
    import sys
    import threading
    import time

    real_write = L._LogWriter.write

    def slow_write(self, record):
        time.sleep(0.0002)
        real_write(self, record)

    monkeypatch.setattr(L._LogWriter, "write", slow_write)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    # tight gpu, shared prefixes: what each call returns depends on the calls before it
    cfg = config(tiers=[Tier("gpu", 40 * 3)])
    m, path = _recorded(backend, tmp_path, monkeypatch, cfg)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for k in range(25):
                prompt = [1, 2, 3, 4, 5, 6][: 2 + (i + k) % 5] + [100 + i, k]
                kv = m.create_kv_cache(prompt)
                if kv.resume() and kv.resize(len(prompt) + 1):
                    kv.commit(prompt[kv.num_committed_tokens :])
                m.probe_reuse(prompt)
                kv.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    monkeypatch.undo()
    report = L.replay(str(path), [backend] + (["python"] if backend != "python" else []))
    assert report.steps == len(read_lines(str(path))) - 1 > 400
    assert report.ok, str(report)
    assert m.oplog_error is None


# ---------------------------------------------------------------------------------------
# oplog-replay on malformed logs: one line naming file, line and field; exit 2, no
# traceback (issue #8 item 18)
# ---------------------------------------------------------------------------------------


def _log_lines() -> list[str]:
    records = [
        {"op": "create_kv_cache", "args": {"input_tokens": [1, 2, 3]}, "outcome": {"result": 0}},
        {"op": "resume", "cache": 0, "outcome": {"result": True}},
    ]
    return L.format_log(config(), records).splitlines()


def _cli_replay(tmp_path, capsys, lines: list[str]) -> tuple[int, str]:
    from kvcm import cli

    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code = cli.main(["oplog-replay", str(path), "--backend", "python"])  # raises on a crash: no traceback
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, err


def _header(**changes) -> str:
    head = json.loads(_log_lines()[0])
    head.update(changes)
    return json.dumps(head)


def _with_config(**changes) -> str:
    head = json.loads(_log_lines()[0])
    head["config"].update(changes)
    return json.dumps(head)


def test_oplog_replay_line_that_is_a_json_array_is_a_bad_log(tmp_path, capsys):
    code, err = _cli_replay(tmp_path, capsys, [*_log_lines(), "[1, 2]"])
    assert code == 2
    assert err.strip() == f"oplog-replay: {tmp_path / 'bad.jsonl'}:4: a record must be a JSON object, got an array"


def test_oplog_replay_line_that_is_a_json_number_is_a_bad_log(tmp_path, capsys):
    code, err = _cli_replay(tmp_path, capsys, ["42", *_log_lines()])
    assert code == 2 and err.strip().endswith("bad.jsonl:1: a record must be a JSON object, got a number")


def test_oplog_replay_header_without_config_is_a_bad_log(tmp_path, capsys):
    head = json.loads(_log_lines()[0])
    del head["config"]
    code, err = _cli_replay(tmp_path, capsys, [json.dumps(head), *_log_lines()[1:]])
    assert code == 2 and err.strip().endswith("bad.jsonl:1: config: missing from the header of manager 0")


def test_oplog_replay_bad_layer_keys_are_a_bad_log(tmp_path, capsys):
    layers = L.config_to_json(config())["layers"]
    layers[1]["colour"] = "red"
    code, err = _cli_replay(tmp_path, capsys, [_with_config(layers=layers), *_log_lines()[1:]])
    assert code == 2
    assert "bad.jsonl:1: config.layers[1]: unknown keys ['colour']" in err and len(err.strip().splitlines()) == 1
    layers = [{"type": "attention", "layer_id": 0}]  # a required field missing
    code, err = _cli_replay(tmp_path, capsys, [_with_config(layers=layers), *_log_lines()[1:]])
    assert code == 2 and "bad.jsonl:1: config.layers[0]: " in err and "bytes_per_token" in err
    code, err = _cli_replay(tmp_path, capsys, [_with_config(layers=[{"type": "mlp"}]), *_log_lines()[1:]])
    assert code == 2 and "config.layers[0].type: unknown layer type 'mlp'" in err


def test_oplog_replay_bad_tier_keys_are_a_bad_log(tmp_path, capsys):
    code, err = _cli_replay(tmp_path, capsys, [_with_config(tiers=[{"kind": "gpu", "quota": 5}]), *_log_lines()[1:]])
    assert code == 2 and "bad.jsonl:1: config.tiers[0]: unknown keys ['quota']" in err
    code, err = _cli_replay(tmp_path, capsys, [_with_config(tiers=[["gpu", 400]]), *_log_lines()[1:]])
    assert code == 2 and "bad.jsonl:1: config.tiers[0]: must be an object, got an array" in err


def test_oplog_replay_invalid_config_names_the_field(tmp_path, capsys):
    code, err = _cli_replay(tmp_path, capsys, [_with_config(tokens_per_block=0), *_log_lines()[1:]])
    assert code == 2 and "bad.jsonl:1: config.tokens_per_block: must be an int in 1..4096, got 0" in err
    code, err = _cli_replay(tmp_path, capsys, [_with_config(pool_ratio="x"), *_log_lines()[1:]])
    assert code == 2 and "bad.jsonl:1: config.pool_ratio: " in err


def test_oplog_replay_deep_nesting_is_a_bad_log(tmp_path, capsys):
    deep = '{"m": "0", "op": "stats", "args": ' + "[" * 100_000 + "]" * 100_000 + "}"
    code, err = _cli_replay(tmp_path, capsys, [*_log_lines(), deep])
    assert code == 2 and err.strip().endswith("bad.jsonl:4: JSON nested too deeply")
    deep_cfg = '{"kvcm_oplog": 1, "m": "1", "config": ' + "[" * 100_000 + "]" * 100_000 + "}"
    code, err = _cli_replay(tmp_path, capsys, [*_log_lines(), deep_cfg])
    assert code == 2 and "bad.jsonl:4: JSON nested too deeply" in err


def test_oplog_replay_malformed_op_is_a_bad_log(tmp_path, capsys):
    for rec, where, what in (
        ({"m": "0", "op": "frobnicate"}, 4, "unknown op 'frobnicate'"),
        ({"m": "0", "op": "resume", "cache": "zero"}, 4, "needs a cache handle"),
        ({"m": "0", "op": "stats", "outcome": [1]}, 4, "outcome: must be an object, got an array"),
        ({"m": "0", "op": "resume", "cache": 7, "outcome": {"result": True}}, 4, "cache handle 7 does not exist"),
        ({"m": "0", "kvcm_oplog": 99, "config": {}}, 4, "kvcm_oplog: unsupported format version 99"),
    ):
        code, err = _cli_replay(tmp_path, capsys, [*_log_lines(), json.dumps(rec)])
        assert code == 2, (rec, err)
        assert f"bad.jsonl:{where}: " in err and what in err and len(err.strip().splitlines()) == 1, err


def test_oplog_replay_divergence_still_exits_1(tmp_path, capsys):
    lines = _log_lines()
    rec = json.loads(lines[2])
    rec["outcome"] = {"result": False}
    code, _ = _cli_replay(tmp_path, capsys, [lines[0], lines[1], json.dumps(rec)])
    assert code == 1
    assert _cli_replay(tmp_path, capsys, _log_lines())[0] == 0


def test_recording_does_not_change_what_tokens_are_accepted(tmp_path, monkeypatch):
    """Issue 8 (items 6/13, SPEC sec. 15 "observability never changes outcomes"): an
    iterator is refused with the op log on exactly as with it off (it used to be turned
    into a list first, so the recorded call succeeded where the plain one fails)."""
    errors = {}

    def run(m):
        a = m.create_kv_cache()
        assert a.resume() and a.resize(8)
        for name, bad in (("iter", iter([1, 2])), ("gen", (t for t in [1, 2])), ("set", {1, 2})):
            with pytest.raises(TypeError) as ei:
                a.commit(bad)
            errors.setdefault(name, []).append(str(ei.value))
        assert a.num_committed_tokens == 0

    run(py_manager())
    path = record(tmp_path, monkeypatch, run=run)
    assert all(len(set(v)) == 1 and len(v) == 2 for v in errors.values()), errors
    ops = [json.loads(x) for x in read_lines(path)][1:]
    assert [r["outcome"] for r in ops if r["op"] == "commit"] == [{"error": "TypeError"}] * 3


def test_crafted_log_with_huge_resizes_replays_at_once(tmp_path):
    """Issue 8 item 4, through the op log: a crafted log asking for huge capacities is
    refused in O(1) on both backends (False, nothing changed; 2**63 a ValueError), where it
    used to take seconds and gigabytes (cpp) or exhaust memory (python).  Not timed: no
    implementation whose refusal costs O(capacity) replays 2**62 blocks; the python side's
    work is counted, against the same log with capacities of a few blocks."""
    recs = [
        {"op": "create_kv_cache", "args": {"input_tokens": [1, 2, 3]}, "outcome": {"result": 0}},
        {"op": "resume", "cache": 0, "outcome": {"result": True}},
        {"op": "resize", "cache": 0, "args": {"capacity": 10**9}, "outcome": {"result": False}},
        {"op": "resize", "cache": 0, "args": {"capacity": 2**62, "history_length": 2**62}, "outcome": {"result": False}},
        {"op": "resize", "cache": 0, "args": {"capacity": 2**63}, "outcome": {"error": "ValueError"}},
        {"op": "resize_batch", "args": {"caches": [0], "capacities": [2**40]}, "outcome": {"result": [False]}},
        {"op": "resize", "cache": 0, "args": {"capacity": 8}, "outcome": {"result": True}},
    ]
    path = tmp_path / "huge.jsonl"
    path.write_text(L.format_log(config(), recs))
    reports = []
    work = python_work(lambda: reports.append(L.replay(str(path), ["python", "cpp"])))
    report = reports[0]
    assert report.ok, report.divergence
    assert report.steps == len(recs)
    # the same log with the huge counts cut to 10**4 tokens (refused alike: far over the pool)
    def cut(v):
        return [cut(x) for x in v] if isinstance(v, list) else 10**4 if isinstance(v, int) and 10**4 < v < 2**63 else v

    small = tmp_path / "small.jsonl"
    small.write_text(L.format_log(config(), [dict(r, args={k: cut(v) for k, v in r["args"].items()}) if "args" in r
                                             else r for r in recs]))
    assert L.replay(str(small), ["python", "cpp"]).ok
    assert work <= 2 * python_work(lambda: L.replay(str(small), ["python", "cpp"]))
