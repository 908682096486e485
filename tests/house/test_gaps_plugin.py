"""The gap-file plugin (parity/gaps.py, SPEC sec. 13) in a sandbox: each of its four rules,
file validation, and the parity report built on it."""

from __future__ import annotations

import textwrap

import pytest

from parity.report import Outcomes, render

pytest_plugins = ["pytester"]

# A sandbox conftest: the gap plugin plus a minimal backend parametrization (the real root
# conftest imports kvcm; the plugin must not need it).
CONFTEST = """
import pytest
from pathlib import Path

pytest_plugins = ["parity.gaps"]

def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        in_parity = "parity" in Path(metafunc.definition.path).parts
        values = ["cpp", "python"] if in_parity else ["python"]
        metafunc.parametrize("backend", values, ids=values, scope="session")
"""

SCENARIOS = """
def test_ok(backend):
    pass

def test_cpp_asserts(backend):
    assert backend != "cpp", "cpp gets this wrong"

def test_cpp_not_implemented(backend):
    if backend == "cpp":
        raise NotImplementedError("issue #3")

def test_cpp_keyerror(backend):
    if backend == "cpp":
        raise KeyError("crash")
"""


def gap(scenario: str, backend: str = "cpp", issue: int = 3, **extra: str) -> str:
    lines = ["[[gap]]", f'scenario = "{scenario}"', f'backend = "{backend}"', 'reason = "known"', f"issue = {issue}"]
    for k, v in extra.items():
        lines.append(f"{k} = {v}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def sandbox(pytester: pytest.Pytester):
    pytester.makeconftest(CONFTEST)
    pytester.mkdir("parity")
    (pytester.path / "parity" / "test_scenarios.py").write_text(textwrap.dedent(SCENARIOS))
    pytester.mkdir("tests")
    (pytester.path / "tests" / "test_unit.py").write_text("def test_unit(backend):\n    assert backend != 'python'\n")

    def write_gaps(text: str) -> None:
        (pytester.path / "parity" / "gaps.toml").write_text(text)

    pytester.write_gaps = write_gaps  # type: ignore[attr-defined]
    return pytester


ALL_KNOWN = (
    gap("test_cpp_asserts")
    + gap("test_cpp_not_implemented", raises='"NotImplementedError"')
    + gap("test_cpp_keyerror", raises='["KeyError", "NotImplementedError"]')
)


def test_listed_gaps_xfail_and_the_run_passes(sandbox):
    sandbox.write_gaps(ALL_KNOWN)
    r = sandbox.runpytest("parity")
    r.assert_outcomes(passed=5, xfailed=3)
    assert r.ret == 0


def test_rule1_unlisted_failure_fails(sandbox):
    sandbox.write_gaps(
        gap("test_cpp_not_implemented", raises='"NotImplementedError"') + gap("test_cpp_keyerror", raises='"KeyError"')
    )
    r = sandbox.runpytest("parity")
    r.assert_outcomes(passed=5, failed=1, xfailed=2)
    r.stdout.fnmatch_lines(["*FAILED parity/test_scenarios.py::test_cpp_asserts[[]cpp[]]*"])
    assert r.ret == 1


def test_rule2_listed_gap_that_passes_fails(sandbox):
    sandbox.write_gaps(ALL_KNOWN + gap("test_ok", backend="python", issue=7))
    r = sandbox.runpytest("parity")
    r.assert_outcomes(passed=4, failed=1, xfailed=3)
    r.stdout.fnmatch_lines(["*XPASS(strict)*gap fixed → remove its entry from parity/gaps.toml*test_ok*python*"])
    assert r.ret == 1


def test_rule3_entry_matching_nothing_fails_a_full_run(sandbox):
    sandbox.write_gaps(ALL_KNOWN + gap("test_renamed_long_ago") + gap("test_ok", backend="cpp", where='"tests"'))
    r = sandbox.runpytest("parity")
    # only the parity entry is stale here: tests/ was not collected
    r.assert_outcomes(passed=5, failed=1, xfailed=3)
    out = r.stdout.str()
    assert "FAILED parity/gaps.toml::stale_entries" in out
    assert "stale gap entries (match no collected test): test_renamed_long_ago[cpp]\n" in out
    assert r.ret == 1


def test_rule3_is_only_enforced_without_selection(sandbox):
    sandbox.write_gaps(ALL_KNOWN + gap("test_renamed_long_ago"))
    for args in (["parity", "-k", "ok"], ["parity/test_scenarios.py::test_ok"], ["parity", "-m", "not slow"]):
        r = sandbox.runpytest(*args)
        assert r.ret == 0, (args, r.stdout.str())
        assert "stale_entries" not in r.stdout.str()


def test_rule3_tests_dir_entries(sandbox):
    # an entry for tests/ applies to tests/ items (whose backend is the run's default)
    sandbox.write_gaps(gap("test_unit", backend="python", where='"tests"'))
    r = sandbox.runpytest("tests")
    r.assert_outcomes(xfailed=1)
    assert r.ret == 0
    sandbox.write_gaps(gap("test_gone", backend="python", where='"tests"'))
    r = sandbox.runpytest("tests")
    r.assert_outcomes(failed=2)  # test_unit itself, and the stale entry
    assert "stale gap entries (match no collected test): test_gone[python]\n" in r.stdout.str()


def test_rule4_unexpected_exception_type_fails(sandbox):
    # listed with the default raises (AssertionError) but it raises NotImplementedError / KeyError
    sandbox.write_gaps(
        gap("test_cpp_asserts")
        + gap("test_cpp_not_implemented")
        + gap("test_cpp_keyerror", raises='"NotImplementedError"')
    )
    r = sandbox.runpytest("parity", "-rA")
    r.assert_outcomes(passed=5, failed=2, xfailed=1)
    out = r.stdout.str()
    assert "FAILED parity/test_scenarios.py::test_cpp_not_implemented[cpp]" in out
    assert "FAILED parity/test_scenarios.py::test_cpp_keyerror[cpp]" in out
    assert "a gap never hides an unexpected exception" in out


def test_gap_for_one_backend_leaves_the_other_alone(sandbox):
    sandbox.write_gaps(ALL_KNOWN)
    r = sandbox.runpytest("parity", "-rA")
    out = r.stdout.str()
    assert "PASSED parity/test_scenarios.py::test_cpp_asserts[python]" in out
    assert "XFAIL parity/test_scenarios.py::test_cpp_asserts[cpp]" in out


@pytest.mark.parametrize(
    "text, message",
    [
        (gap("test_ok") + "colour = 'red'\n", "unknown keys ['colour']"),
        ('[[gap]]\nscenario = "test_ok"\nbackend = "cpp"\nissue = 3\n', "missing required key 'reason'"),
        ('[[gap]]\nscenario = "test_ok"\nbackend = "cpp"\nreason = "x"\n', "missing required key 'issue'"),
        (gap("test_ok", issue=0), "issue must be a positive issue number"),
        (gap("test_ok", backend="rust"), "backend must be one of ['cpp', 'python']"),
        (gap("test_ok") + gap("test_ok"), "duplicate of entry #1"),
        (gap("test_ok[cpp]"), "without a [param] suffix"),
        (gap("test_ok", raises='"NoSuchError"'), "unknown exception type 'NoSuchError'"),
        (gap("test_ok", where='"src"'), "where must be one of"),
        (
            '[[gap]]\nscenario = "test_ok"\nbackend = "cpp"\nreason = "  "\nissue = 3\n',
            "reason must be a non-empty string",
        ),
        ("[settings]\nx = 1\n", "unknown top-level keys ['settings']"),
        ("[[gap]\n", "not valid TOML"),
    ],
)
def test_invalid_gap_file_is_a_usage_error(sandbox, text, message):
    sandbox.write_gaps(text)
    r = sandbox.runpytest("parity")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert message in r.stderr.str(), r.stderr.str()


def test_report_cells(sandbox):
    sandbox.write_gaps(
        gap("test_cpp_not_implemented", raises='"NotImplementedError"')
        + gap("test_cpp_keyerror", issue=9, raises='"KeyError"')
        + gap("test_ok", backend="python", issue=4)
    )
    (sandbox.path / "parity" / "test_skip.py").write_text(
        "import pytest\ndef test_skipped(backend):\n    pytest.skip('no')\n"
    )
    collector = Outcomes()
    sandbox.runpytest("parity", plugins=[collector])
    text = render(collector.cells)
    rows = {
        line.split()[0]: line.split(None, 1)[1] for line in text.splitlines()[2:] if line and not line.startswith("-")
    }
    assert rows["test_scenarios.py::test_ok"].split() == ["pass", "XPASS", "→", "remove", "gap"]
    assert rows["test_scenarios.py::test_cpp_asserts"].split() == ["FAIL", "pass"]
    assert rows["test_scenarios.py::test_cpp_not_implemented"].split() == ["gap", "#3", "pass"]
    assert rows["test_scenarios.py::test_cpp_keyerror"].split() == ["gap", "#9", "pass"]
    assert rows["test_skip.py::test_skipped"].split() == ["skip", "skip"]
    assert rows["total"] == "1 pass, 2 gap, 1 FAIL, 1 skip  3 pass, 1 XPASS → remove gap, 1 skip"
    md = render(collector.cells, markdown=True)
    assert md.splitlines()[0] == "| scenario | cpp | python |"
    assert "| test_scenarios.py::test_cpp_not_implemented | gap #3 | pass |" in md


def test_report_main_prints_the_table_and_returns_pytests_exit_code(sandbox, capsys):
    from parity import report

    sandbox.write_gaps(ALL_KNOWN)
    out_file = sandbox.path / "report.md"
    assert report.main(["parity", "-q", "-p", "no:cacheprovider", "--output", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert "kvcm parity report (scenario × backend)" in printed
    assert "test_scenarios.py::test_cpp_not_implemented  gap #3" in printed
    assert out_file.read_text().startswith("| scenario | cpp | python |")  # .md → markdown
    sandbox.write_gaps(ALL_KNOWN + gap("test_ok", backend="python", issue=5))
    assert report.main(["parity", "-q", "-p", "no:cacheprovider", "--markdown"]) == 1
    printed = capsys.readouterr().out
    assert "| test_scenarios.py::test_ok | pass | XPASS → remove gap |" in printed
