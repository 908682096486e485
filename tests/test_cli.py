"""``python -m kvcm`` end to end, in a subprocess (the environment's backend selection and
install are inherited; the package directory is put on PYTHONPATH for source checkouts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import kvcm

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvcm.__file__)))


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "kvcm", *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def test_info():
    p = run_cli("info")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert f"kvcm {kvcm.__version__}" in out
    assert re.search(rf"^backend: {kvcm.backend}\b", out, re.MULTILINE)
    assert re.search(r"^cpp extension: (importable|not importable)", out, re.MULTILINE)
    assert "shipped trace:" in out and "(3993 requests)" in out


def test_replay_python_prefix():
    p = run_cli("replay", "--limit", "20", "--backend", "python")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "20 of 3993 requests" in out
    expected = re.search(r"^expected hit rate \(from hash_ids\): (\d+\.\d\d)%$", out, re.MULTILINE)
    got = re.search(r"^hit rate\s+(\d+\.\d\d)%$", out, re.MULTILINE)
    assert expected and got, out
    assert got.group(1) == expected.group(1)  # unbounded, prompt only: the exact figure
    for label in ("evictions (offload/drop)", "requests/s", "us/block"):
        assert re.search(rf"^{re.escape(label)}\s+\S", out, re.MULTILINE), label
    assert re.search(r"^evictions \(offload/drop\)\s+0 \(0/0\)$", out, re.MULTILINE)


def test_replay_tight_quota_both_backends_side_by_side():
    p = run_cli(
        "replay",
        "--limit",
        "20",
        "--block-size",
        "64",
        "--gpu-frac",
        "0.1",
        "--host-frac",
        "0.1",
        "--backend",
        "python,cpp",
        "--no-progress",
    )
    assert p.returncode == 0, p.stderr
    out = p.stdout
    header = re.search(r"^\s+python\s+cpp$", out, re.MULTILINE)
    assert header, out
    assert "unique blocks in this replay:" in out
    row = re.search(r"^hit rate\s+(\d+\.\d\d)%\s+(.*)$", out, re.MULTILINE)
    assert row, out
    # the cpp column: a figure, or why that backend could not run
    assert re.fullmatch(r"\d+\.\d\d%|not implemented yet \(issue #3\)|unavailable.*", row.group(2).strip())
    assert re.search(r"^evictions \(offload/drop\)\s+[1-9]", out, re.MULTILINE)


def test_bench_keys_small():
    p = run_cli("bench", "keys", "--key-tokens", "20000", "--repeat", "1")
    assert p.returncode == 0, p.stderr
    assert re.search(r"^block_keys \[python\]\s+\d+\.\d\d M tokens/s$", p.stdout, re.MULTILINE)
    assert "hashlib raw loop" in p.stdout


def test_replay_trace_file(tmp_path):
    # two requests sharing one whole hash block and 100 tokens of a partial one
    recs = [
        {"timestamp": 0, "input_length": 612, "output_length": 2, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 700, "output_length": 2, "hash_ids": [1, 2]},
    ]
    path = tmp_path / "mini.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = run_cli("replay", str(path), "--backend", "python", "--block-size", "64")
    assert p.returncode == 0, p.stderr
    assert "trace: mini.jsonl, 2 of 2 requests" in p.stdout
    rate = f"{100 * 612 / (612 + 700):.2f}%"
    assert re.search(rf"^expected hit rate \(from hash_ids\): {re.escape(rate)}$", p.stdout, re.MULTILINE)
    assert re.search(rf"^hit rate\s+{re.escape(rate)}$", p.stdout, re.MULTILINE), p.stdout


def test_bad_arguments(tmp_path):
    p = run_cli("replay", "--backend", "fortran")
    assert p.returncode == 2 and "unknown backend" in p.stderr
    p = run_cli("replay", "--gpu-blocks", "5", "--gpu-frac", "0.1")
    assert p.returncode == 2
    p = run_cli("replay", "--block-size", "0")
    assert p.returncode == 2 and "out of range" in p.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    p = run_cli("replay", str(bad), "--backend", "python")
    assert p.returncode == 2 and "cannot read trace" in p.stderr
    p = run_cli()
    assert p.returncode == 2 and "replay" in p.stdout


# ---------------------------------------------------------------------------------------
# user errors: one line naming the file, line and field, the documented exit code, never a
# traceback (issue #8 item 18).  In process through kvcm.cli.main(argv): a crash raises.
# ---------------------------------------------------------------------------------------


def cli_main(capsys, *argv: str) -> tuple[int, str, str]:
    from kvcm import cli

    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse errors
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return code, out, err


GOOD = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}


def trace_file(tmp_path, *records, name="t.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def bad_trace(capsys, path: str) -> str:
    code, out, err = cli_main(capsys, "replay", path, "--backend", "python", "--no-progress")
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"replay: cannot read trace: {path}:"), err
    return lines[0]


def test_replay_input_length_1e400_is_a_bad_trace(tmp_path, capsys):
    path = trace_file(tmp_path, GOOD, '{"input_length": 1e400, "hash_ids": [1]}')
    assert bad_trace(capsys, path).endswith(":2: input_length: must be an integer >= 0, got Infinity")


def test_replay_true_as_a_length_is_a_bad_trace(tmp_path, capsys):
    path = trace_file(tmp_path, dict(GOOD, input_length=True))
    assert bad_trace(capsys, path).endswith(":1: input_length: must be an integer >= 0, got true")
    path = trace_file(tmp_path, dict(GOOD, output_length=False))
    assert bad_trace(capsys, path).endswith(":1: output_length: must be an integer >= 0, got false")


def test_replay_fractional_length_is_a_bad_trace(tmp_path, capsys):
    path = trace_file(tmp_path, GOOD, GOOD, dict(GOOD, input_length=5.7))
    assert bad_trace(capsys, path).endswith(":3: input_length: must be an integer >= 0, got 5.7")
    path = trace_file(tmp_path, dict(GOOD, output_length=-3))
    assert bad_trace(capsys, path).endswith(":1: output_length: must be an integer >= 0, got -3")


def test_replay_hash_ids_as_a_string_is_a_bad_trace(tmp_path, capsys):
    path = trace_file(tmp_path, dict(GOOD, input_length=3, hash_ids="123"))
    assert bad_trace(capsys, path).endswith(':1: hash_ids: must be a list of integers >= 0, got "123"')
    path = trace_file(tmp_path, dict(GOOD, hash_ids=[1, "2"]))
    assert bad_trace(capsys, path).endswith(':1: hash_ids[1]: must be an integer >= 0, got "2"')


def test_replay_record_that_is_not_an_object_is_a_bad_trace(tmp_path, capsys):
    path = trace_file(tmp_path, GOOD, "[600, [1, 2]]")
    assert ":2: not a trace record (a JSON object)" in bad_trace(capsys, path)
    path = trace_file(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert bad_trace(capsys, path).endswith(":1: JSON nested too deeply")
    path = trace_file(tmp_path, {"input_length": 5})
    assert bad_trace(capsys, path).endswith(":1: hash_ids: missing")


def test_replay_truncated_gz_is_a_bad_trace(tmp_path, capsys):
    import gzip

    data = gzip.compress("".join(json.dumps(dict(GOOD, hash_ids=[i, i + 1])) + "\n" for i in range(2000)).encode())
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    assert "truncated or corrupt gzip data" in bad_trace(capsys, str(path))
    path.write_bytes(b"\x1f\x8b" + b"junk" * 10)
    assert "truncated or corrupt gzip data" in bad_trace(capsys, str(path))


def test_replay_empty_trace_is_an_error_not_inf_requests_per_s(tmp_path, capsys):
    path = trace_file(tmp_path)
    code, out, err = cli_main(capsys, "replay", path, "--backend", "python", "--no-progress")
    assert code == 2 and "inf" not in out
    assert err.strip() == f"replay: {path}: no requests to replay (it has 0)"
    path = trace_file(tmp_path, GOOD)
    code, out, err = cli_main(capsys, "replay", path, "--backend", "python", "--start", "5", "--no-progress")
    assert code == 2 and err.strip() == f"replay: {path}: no requests to replay (it has 1, --start 5)"


def test_replay_gpu_frac_inf_is_a_usage_error(tmp_path, capsys):
    path = trace_file(tmp_path, GOOD)
    for frac in ("inf", "nan", "-1", "0"):
        code, _, err = cli_main(capsys, "replay", path, "--gpu-frac", frac, "--backend", "python")
        assert code == 2 and f"argument --gpu-frac: must be a finite number > 0, got {frac}" in err, err
    code, _, err = cli_main(capsys, "replay", path, "--host-frac", "1e999", "--backend", "python")
    assert code == 2 and "argument --host-frac: must be a finite number > 0, got 1e999" in err


def test_replay_gpu_blocks_10_to_18_is_capped_not_a_crash(tmp_path, capsys):
    path = trace_file(tmp_path, GOOD, dict(GOOD, input_length=700))
    code, out, err = cli_main(
        capsys, "replay", path, "--gpu-blocks", str(10**18), "--host-blocks", str(10**18), "--backend", "python",
        "--block-size", "64", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    most = (-(-600 // 64)) + (-(-700 // 64)) + 1
    assert f"note: gpu quota {10**18:,} blocks is more than this replay can use; capped at {most}" in out
    assert f"gpu quota {most} blocks" in out
    assert re.search(r"^hit rate\s+\d+\.\d\d%$", out, re.MULTILINE), out


def test_demo_unknown_device_is_a_usage_error(capsys, monkeypatch):
    code, _, err = cli_main(capsys, "demo", "--device", "foo", "--backend", "python")
    assert code == 2 and "error: --device 'foo': " in err, err
    monkeypatch.setenv("KVCM_ENGINE_DEVICE", "foo:0")
    code, _, err = cli_main(capsys, "demo", "--backend", "python")
    assert code == 2 and "error: KVCM_ENGINE_DEVICE 'foo:0': " in err, err


def test_exit_codes_are_documented(capsys):
    for argv in (["--help"], ["replay", "--help"], ["demo", "--help"], ["oplog-replay", "--help"]):
        code, out, _ = cli_main(capsys, *argv)
        assert code == 0 and "exit status: 0" in " ".join(out.split()) and "2 bad usage" in " ".join(out.split()), argv
