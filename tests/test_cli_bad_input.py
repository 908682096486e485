"""Issue 20 items 1, 2, 4 and 9: every command answers bad input the README's way --
exit 2 (1 for a failure it reports), the problem on one line naming what is wrong, never a
traceback -- and checks it before a long run, not after.  In process through each
command's ``main`` where the environment allows, in a subprocess where the environment
itself (``KVCM_BACKEND``, a missing extra) is the bad input."""

from __future__ import annotations

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


def trace_file(tmp_path, text: str) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    return str(p)


@BOTH
def test_route_bad_trace_is_one_line(tmp_path, capsys, be):
    from kvcm.cli.route import main

    code, _, err = main_of(capsys, main, str(tmp_path / "missing.jsonl"), "--backend", be, "--plot", "")
    assert code == 2 and one_line(err).startswith("python -m kvcm route: cannot read trace: ") and "missing" in err
    path = trace_file(tmp_path, '{"input_length": 5.7, "hash_ids": [1]}\n')
    code, _, err = main_of(capsys, main, path, "--backend", be, "--plot", "")
    assert code == 2 and one_line(err).endswith(":1: input_length: must be an integer >= 0, got 5.7"), err
    path = trace_file(tmp_path, "")
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
