"""``oplog-replay`` on malformed and crafted logs (issue 8 item 18): one line naming the file,
line and field, exit 2, no traceback; a divergence still exits 1; a crafted log with huge
resizes replays at once.  Builders: tests/tools/oplog_helpers.py."""

from __future__ import annotations

import json

from kvcm import oplog as L
from oplog_helpers import config

from parity.helpers import python_work

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
