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
