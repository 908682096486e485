"""``python -m kvcm`` end to end: the commands' runs and their answers to bad input.

* Runs, in a subprocess (the environment's backend selection and install are inherited; the
  package directory is put on PYTHONPATH for source checkouts).
* Bad input (issue 8 item 18; issue 20 items 1, 2, 4 and 9): every command answers it the
  README's way -- exit 2 (1 for a failure it reports), the problem on one line naming what is
  wrong (a trace's file, line and field), never a traceback -- and checks it before a long
  run, not after.  In process through each command's ``main`` where the environment allows
  (a crash raises), in a subprocess where the environment itself (``KVCM_BACKEND``, a
  missing extra) is the bad input."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import kvcm
import pytest
from kvcm import cli

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvcm.__file__)))
BOTH = pytest.mark.parametrize("be", ["python", "cpp"])


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "kvcm", *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def run_py(args: list[str], env_extra: dict[str, str] | None = None, code: str | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCM_BACKEND", "KVCM_OPLOG")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_ROOT, os.environ.get("PYTHONPATH")) if p)
    env.update(env_extra or {})
    argv = [sys.executable, "-c", code, *args] if code is not None else [sys.executable, *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def main_of(capsys, main, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse: usage + one "error:" line, exit 2
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return code, out, err


def usage_error(capsys, main, *argv: str) -> str:
    code, _, err = main_of(capsys, main, *argv)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "error:" in last or last.startswith("python -m kvcm"), err
    return last


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
    return main_of(capsys, cli.main, *argv)


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


# =======================================================================================
# bad input of every command (issue 20): an unknown backend, route, events, the engine
# instance, a missing extra, KVCM_OPLOG
# =======================================================================================


# ---------------------------------------------------------------------------------------
# item 1: an unknown KVCM_BACKEND / --backend
# ---------------------------------------------------------------------------------------

COMMANDS = [
    ["-m", "kvcm", "info"],
    ["-m", "kvcm", "replay", "--limit", "1"],
    ["-m", "kvcm", "route", "--limit", "1"],
    ["-m", "kvcm", "events", "--bench", "--limit", "1"],
    ["-m", "kvcm", "bench", "keys", "--quick"],
    ["-m", "kvcm", "demo"],
    ["-m", "kvcm.tools.engine_instance", "--no-check"],
]


@pytest.mark.parametrize("value", ["rust", "CPP"])
@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[1:3]))
def test_unknown_kvcm_backend_is_one_line_exit_2_not_a_traceback(argv, value):
    p = run_py(argv, {"KVCM_BACKEND": value})
    assert p.returncode == 2, p.stderr
    line = one_line(p.stderr)
    prog = "python -m " + argv[1]
    assert line.startswith(f"{prog}: KVCM_BACKEND={value!r} is not a kvcm backend; choices: cpp, python"), line
    if value == "CPP":
        assert "did you mean 'cpp'?" in line


def test_unknown_kvcm_backend_still_fails_a_plain_import():
    p = run_py([], {"KVCM_BACKEND": "rust"}, code="import kvcm")
    assert p.returncode == 1 and "BackendUnavailableError" in p.stderr


def test_backend_rust_is_a_usage_error_on_every_command(capsys):
    from kvcm.cli import events as events_cli
    from kvcm.cli import route as route_cli
    from kvcm.tools import engine_instance

    for main, argv in ((route_cli.main, ["--backend", "rust"]), (events_cli.main, ["--bench", "--backend", "rust"]),
                       (engine_instance.main, ["--backend", "rust"]), (cli.main, ["bench", "keys", "--backend", "rust"]),
                       (cli.main, ["replay", "--backend", "rust"])):
        last = usage_error(capsys, main, *argv)
        assert "argument --backend: unknown backend 'rust'; choices: cpp, python" in last, (argv, last)


@BOTH
def test_bench_backend_measures_only_that_backend(capsys, be):
    code, out, _ = main_of(capsys, cli.main, "bench", "keys", "--key-tokens", "2000", "--repeat", "1",
                           "--backend", be)
    other = "cpp" if be == "python" else "python"
    assert code == 0
    assert re.search(rf"^block_keys \[{other}\]\s+not run \(--backend\)$", out, re.MULTILINE), out
    assert re.search(rf"^block_keys \[{be}\]\s+\d+\.\d\d M tokens/s$", out, re.MULTILINE), out


# ---------------------------------------------------------------------------------------
# item 2: route
# ---------------------------------------------------------------------------------------


def text_file(tmp_path, text: str) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    return str(p)


@BOTH
def test_route_bad_trace_is_one_line(tmp_path, capsys, be):
    from kvcm.cli.route import main

    code, _, err = main_of(capsys, main, str(tmp_path / "missing.jsonl"), "--backend", be, "--plot", "")
    assert code == 2 and one_line(err).startswith("python -m kvcm route: cannot read trace: ") and "missing" in err
    path = text_file(tmp_path, '{"input_length": 5.7, "hash_ids": [1]}\n')
    code, _, err = main_of(capsys, main, path, "--backend", be, "--plot", "")
    assert code == 2 and one_line(err).endswith(":1: input_length: must be an integer >= 0, got 5.7"), err
    path = text_file(tmp_path, "")
    code, _out, err = main_of(capsys, main, path, "--backend", be, "--plot", "")
    assert code == 2 and "no requests to route" in one_line(err)


@BOTH
def test_route_limit_0_is_refused_not_a_table_of_zero_rows(tmp_path, capsys, be):
    from kvcm.cli.route import main

    plot = tmp_path / "last.png"
    plot.write_bytes(b"the last plot")
    last = usage_error(capsys, main, "--limit", "0", "--backend", be, "--plot", str(plot))
    assert "argument --limit: must be an int >= 1, got 0" in last
    assert plot.read_bytes() == b"the last plot"  # not overwritten


@BOTH
def test_route_gpu_blocks_negative_names_the_option_not_a_byte_quota(capsys, be):
    from kvcm.cli.route import main

    for argv, msg in ((["--gpu-blocks", "-1"], "argument --gpu-blocks: must be an int >= 1, got -1"),
                      (["--block-size", "0"], "argument --block-size: 0 out of range 1..4096"),
                      (["--instances", "0"], "instance counts must be >= 1"),
                      (["--policy", "best"], "unknown policy 'best'")):
        last = usage_error(capsys, main, *argv, "--backend", be)
        assert msg in last and "quota_bytes" not in last, last


@BOTH
def test_route_unwritable_plot_is_refused_before_the_run(tmp_path, capsys, be):
    from kvcm.cli.route import main

    for bad, why in ((tmp_path / "no" / "x.png", "no such directory"), (tmp_path, "is a directory")):
        code, out, err = main_of(capsys, main, "--limit", "2", "--backend", be, "--plot", str(bad))
        assert code == 2 and out == "", out  # nothing ran
        assert one_line(err) == f"python -m kvcm route: --plot {bad}: {why}" + (f" {bad.parent}" if why ==
                                                                                   "no such directory" else "")


@BOTH
def test_route_shows_progress_and_writes_the_plot(tmp_path, capsys, be):
    from kvcm.cli.route import main

    plot = tmp_path / "r.png"
    code, _out, err = main_of(capsys, main, "--limit", "8", "--instances", "2", "--policy", "kv,round-robin",
                             "--backend", be, "--plot", str(plot))
    assert code == 0, err
    assert "route N=2 kv: 25% (4/16)" in err or "route N=2 kv: 25%" in err, err  # non-tty: lines at 25% steps
    assert plot.read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------------
# item 2: events
# ---------------------------------------------------------------------------------------


def test_events_bad_options_are_usage_errors(capsys):
    from kvcm.cli.events import main

    for argv, msg in (
        (["--demo", "--steps", "-3"], "argument --steps: must be an int >= 1, got -3"),
        (["--connect", "foo"], "argument --connect: not an endpoint: 'foo'"),
        (["--connect", "tcp://127.0.0.1"], "argument --connect: not an endpoint"),
        (["--connect", "tcp://127.0.0.1:70000"], "PORT in 1..65535"),
        (["--connect", "tcp://127.0.0.1:5557", "--timeout", "-1"], "argument --timeout: must be a finite number > 0"),
        (["--connect", "tcp://127.0.0.1:5557", "--timeout", "nan"], "argument --timeout: must be a finite number > 0"),
        (["--connect", "tcp://127.0.0.1:5557", "--count", "0"], "argument --count: must be an int >= 1, got 0"),
        (["--connect", "tcp://127.0.0.1:5557", "--snapshot"], "--snapshot needs --replay"),
        (["--bench", "--limit", "0"], "argument --limit: must be an int >= 1, got 0"),
        (["--bench", "--block-size", "0"], "argument --block-size: 0 out of range 1..4096"),
    ):
        assert msg in usage_error(capsys, main, *argv), argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_events_connect_without_a_publisher_says_so_and_stops(capsys):
    from kvcm.cli.events import main

    ep = f"tcp://127.0.0.1:{_free_port()}"
    code, out, err = main_of(capsys, main, "--connect", ep, "--timeout", "0.3")
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"waiting for {ep}"), err
    assert lines[1:] == [f"python -m kvcm events: no batch in 0.3 s from {ep}"], err


def test_events_replay_endpoint_that_does_not_answer_is_one_line(capsys):
    from kvcm.cli.events import main

    ep, rep = (f"tcp://127.0.0.1:{_free_port()}" for _ in range(2))
    code, _, err = main_of(capsys, main, "--connect", ep, "--replay", rep, "--snapshot", "--timeout", "0.3")
    assert code == 1 and err.strip().splitlines()[-1] == f"python -m kvcm events: no answer from {rep} in 0.3 s"


# ---------------------------------------------------------------------------------------
# item 2: one engine instance (python -m kvcm.tools.engine_instance)
# ---------------------------------------------------------------------------------------


def test_engine_bad_options_are_usage_errors(tmp_path, capsys):
    from kvcm.tools.engine_instance import main

    for argv, msg in ((["--block", "0"], "argument --block: 0 out of range 1..4096"),
                      (["--gpu-slots", "-1"], "argument --gpu-slots: must be an int >= 1, got -1"),
                      (["--host-slots", "-5"], "argument --host-slots: must be an int >= 0, got -5"),
                      (["--shared-quota-bytes", "-1"], "argument --shared-quota-bytes: must be an int >= 0")):
        last = usage_error(capsys, main, *argv)
        assert msg in last and "quota_bytes: must be" not in last, last
    code, out, err = main_of(capsys, main, "--json", str(tmp_path / "no" / "x.json"))
    assert code == 2 and out == "" and one_line(err).startswith("python -m kvcm.tools.engine_instance: --json ")


@BOTH
def test_engine_bad_input_after_parsing_is_one_line(capsys, be):
    from kvcm.tools.engine_instance import main

    code, _, err = main_of(capsys, main, "--backend", be, "--gpu-slots", "2", "--no-check")
    assert code == 2 and one_line(err) == "python -m kvcm.tools.engine_instance: the gpu quota cannot hold even one " \
                                          "request (--gpu-slots 2)"
    code, _, err = main_of(capsys, main, "--backend", be, "--shared-tier", "mooncake://nohost", "--no-check")
    assert code == 2 and "not a Mooncake location" in one_line(err)


# ---------------------------------------------------------------------------------------
# item 4: a missing extra names the extra, no traceback
# ---------------------------------------------------------------------------------------

NO_EXTRAS = textwrap.dedent(
    """
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("zmq", "msgspec", "matplotlib"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, _Block())
    from kvcm.cli import main
    raise SystemExit(main(sys.argv[1:]))
    """
)


@pytest.mark.parametrize(("argv", "extra"), [(["events", "--demo"], "events"), (["route", "--limit", "1"], "route"),
                                             (["route", "--limit", "1", "--plot", ""], "route")])
def test_missing_extra_names_the_extra_to_install(argv, extra):
    p = run_py(argv, code=NO_EXTRAS)
    assert p.returncode == 2, p.stderr
    line = one_line(p.stderr)
    assert f"pip install 'kvcm[{extra}]'" in line and "kvcm[all]" in line, line


NO_TORCH = NO_EXTRAS.replace('("zmq", "msgspec", "matplotlib")', '("torch",)').replace(
    "from kvcm.cli import main", "import importlib; main = importlib.import_module(sys.argv[1]).main"
).replace("main(sys.argv[1:])", "main(sys.argv[2:])")


@pytest.mark.parametrize("argv", [["kvcm.cli", "demo", "--backend", "python"], ["kvcm.tools.engine_instance", "--no-check"]])
def test_missing_torch_names_the_pinned_install(argv):
    p = run_py(argv, code=NO_TORCH)
    assert p.returncode == 2, p.stderr
    assert "needs torch: pip install torch==2.13.0" in one_line(p.stderr)


def test_all_extra_holds_every_other_extra():
    import tomllib

    with open(os.path.join(os.path.dirname(PKG_ROOT), "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    # mooncake needs Debian's libraries; vllm and transformers are engines with their own pins (README)
    engines = ("vllm", "transformers")
    want = {d for name, deps in extras.items() if name not in ("all", "test", "mooncake", *engines) for d in deps}
    assert want <= set(extras["all"]), sorted(want - set(extras["all"]))


# ---------------------------------------------------------------------------------------
# item 9: KVCM_OPLOG
# ---------------------------------------------------------------------------------------


def test_kvcm_oplog_in_a_missing_directory_is_refused_not_created(tmp_path, monkeypatch, capsys):
    from kvcm import oplog

    missing = tmp_path / "no" / "such"
    monkeypatch.setenv("KVCM_OPLOG", str(missing / "x.jsonl"))
    with pytest.raises(OSError, match="does not exist"):
        kvcm.KVCacheManager(kvcm.KVCacheManagerConfig(tokens_per_block=4, layers=[kvcm.AttentionLayer(0, 8)],
                                                      tiers=[kvcm.Tier("gpu", 32 * 8)]), backend="python")
    assert not (tmp_path / "no").exists()
    code, out, err = main_of(capsys, cli.main, "replay", "--limit", "1", "--backend", "python", "--no-progress")
    assert code == 2 and out == "" and "its directory" in one_line(err)
    assert not (tmp_path / "no").exists()
    assert oplog.ENV_VAR == "KVCM_OPLOG"


@BOTH
def test_kvcm_oplog_in_proc_is_one_line_not_an_error_table(monkeypatch, capsys, be):
    from kvcm.tools.engine_instance import main as engine_main

    monkeypatch.setenv("KVCM_OPLOG", "/proc/x.jsonl")
    code, out, err = main_of(capsys, cli.main, "replay", "--limit", "1", "--backend", be, "--no-progress")
    assert code == 2 and out == ""
    assert one_line(err).startswith("python -m kvcm replay: KVCM_OPLOG='/proc/x.jsonl': cannot open")
    code, out, err = main_of(capsys, engine_main, "--backend", be)
    assert code == 2 and one_line(err).startswith("python -m kvcm.tools.engine_instance: KVCM_OPLOG=")
