"""The op vocabulary (kvcm.oplog.ops): configs, tokens and scopes in their JSON forms, malformed
ops, one op for every public call, applying ops (batched ones and their handle remapping).
The rest of kvcm.oplog: tests/tools/test_oplog_record.py (KVCM_OPLOG recording and its
faults), test_oplog_replay.py (replay, the differential harness), test_oplog_bad_logs.py
(oplog-replay on malformed logs); shared builders in oplog_helpers.py."""

from __future__ import annotations

import array
import json

import kvcm
import pytest
from kvcm import KVCacheManagerConfig, ReuseScope, SsmLayer, Status, Tier
from kvcm import oplog as L
from kvcm.oplog import ops as O
from oplog_helpers import D, config, py_manager

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
    # create_kv_cache is declared once on the interface and runs the backend's _create_kv_cache
    abstract = {n.removeprefix("_") for n in abstract}
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
