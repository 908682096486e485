"""``python -m kvcm``'s dispatcher knows no command by name (issue 30 item 3): a command is a
module of ``kvcm.cli`` (``HELP``, ``ORDER``, optional ``RECORDS``, ``main(argv)``), so adding
one is adding its module."""

from __future__ import annotations

import textwrap

import pytest

COMMANDS = ["info", "replay", "bench", "oplog-replay", "demo", "events", "route", "proxy", "vllm"]


def test_every_command_is_a_module_with_its_help_line_and_place():
    from kvcm import cli

    names = cli.command_names()
    assert set(COMMANDS) <= set(names), names
    for name in names:
        module = cli.command(name)
        assert isinstance(module.HELP, str) and module.HELP, name
        assert isinstance(module.ORDER, int), name
        assert callable(module.main), name
    # --help lists them in their ORDER: the list the command line always had
    text = cli.build_parser().format_help()
    where = [text.index(f"\n    {name}") for name in COMMANDS]
    assert where == sorted(where), text


@pytest.fixture
def extra_command(tmp_path, monkeypatch):
    """A command module ``hello-world`` in a directory added to ``kvcm.cli``'s path: what a
    new ``kvcm/cli/hello_world.py`` would be."""
    from kvcm import cli

    (tmp_path / "hello_world.py").write_text(textwrap.dedent('''
        HELP = "say hello"
        ORDER = 75
        RECORDS = True

        def main(argv):
            print("hello", *argv)
            return 7
    '''))
    monkeypatch.setattr(cli, "__path__", [*cli.__path__, str(tmp_path)])
    yield cli
    import sys

    sys.modules.pop("kvcm.cli.hello_world", None)


def test_adding_a_command_is_adding_its_module(extra_command, capsys, monkeypatch):
    cli = extra_command
    monkeypatch.delenv("KVCM_OPLOG", raising=False)
    assert cli.main(["hello-world", "a", "b"]) == 7
    assert capsys.readouterr().out == "hello a b\n"
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "hello-world" in out and "say hello" in out
    assert out.index("route") < out.index("hello-world")  # ORDER 75: after route (70)


def test_a_recording_command_refuses_an_unusable_oplog_first(extra_command, capsys, monkeypatch, tmp_path):
    cli = extra_command
    monkeypatch.setenv("KVCM_OPLOG", str(tmp_path / "no-such-dir" / "log.jsonl"))
    assert cli.main(["hello-world"]) == 2  # RECORDS: refused before main runs
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("python -m kvcm hello-world: ")


def test_an_unknown_command_is_a_usage_error_naming_the_commands(capsys):
    from kvcm import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["no-such-command"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'no-such-command'" in err and "'oplog-replay'" in err
