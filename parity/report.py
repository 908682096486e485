"""Parity report (SPEC sec. 13): run the parity suite in-process and print scenario × backend.

    python -m parity.report [--markdown] [--output FILE[.md]] [--suggest-gaps[=ExcType]] [pytest args...]

Without a test path among the pytest args, ``parity`` is run.  Cells:

    pass                 the scenario passed
    gap #N               a listed gap failed as expected (strict xfail, issue N)
    FAIL                 failed, errored, or a gap raised an unexpected exception type
    XPASS → remove gap   a listed gap passed: delete its entry from parity/gaps.toml
    skip                 skipped

followed by totals per backend.  The exit code is pytest's.  ``--suggest-gaps`` also
prints draft ``[[gap]]`` entries for failures that raised NotImplementedError (or the
given type) — a starting point to review, never something to paste blindly.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BACKEND_COLUMNS = ("cpp", "python")
NO_BACKEND = "any"  # column of tests without a backend parameter
CELLS = ("pass", "gap", "FAIL", "XPASS → remove gap", "skip")
_RANK = {"pass": 0, "skip": 1, "gap": 2, "XPASS → remove gap": 3, "FAIL": 4}
_PARAM = re.compile(r"^(?P<base>.*)\[(?P<param>[^\[\]]*)\]$")
# pytest options that take a separate value (so the value is not mistaken for a path)
_VALUE_OPTS = {
    "-k", "-m", "-p", "-o", "-c", "-W", "--deselect", "--ignore", "--ignore-glob", "--rootdir",
    "--gaps-file", "--junitxml", "--junit-xml", "--tb", "--maxfail", "--durations", "--basetemp",
    "--confcutdir", "--hypothesis-profile", "--hypothesis-seed", "-n", "--color", "--log-level",
}  # fmt: skip


class Outcomes:
    """pytest plugin: the final cell of every test (worst phase wins)."""

    def __init__(self) -> None:
        self.cells: OrderedDict[str, tuple[str, int | None]] = OrderedDict()
        self.errors: dict[str, str] = {}  # nodeid -> exception type of its first failing phase

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any):
        outcome = yield
        rep = outcome.get_result()
        if rep.failed and call.excinfo is not None:
            self.errors.setdefault(item.nodeid, call.excinfo.type.__name__)

    def _set(self, nodeid: str, cell: str, issue: int | None = None) -> None:
        old = self.cells.get(nodeid)
        if old is None or _RANK[cell] > _RANK[old[0]]:
            self.cells[nodeid] = (cell, issue)

    def pytest_runtest_logreport(self, report: Any) -> None:
        issue = None
        for k, v in getattr(report, "user_properties", []):
            if k == "kvcm_gap_issue":
                issue = v
        if report.failed:
            longrepr = report.longrepr if isinstance(report.longrepr, str) else ""
            if report.when == "call" and longrepr.startswith("[XPASS(strict)]"):
                self._set(report.nodeid, "XPASS → remove gap", issue)
            else:
                self._set(report.nodeid, "FAIL", issue)
        elif report.skipped:
            if getattr(report, "wasxfail", None) is not None:
                self._set(report.nodeid, "gap", issue)
            else:
                self._set(report.nodeid, "skip")
        elif report.when == "call":
            self._set(report.nodeid, "pass")

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self._set(f"{report.nodeid or '<collection>'} (collection)", "FAIL")


def split_nodeid(nodeid: str) -> tuple[str, str]:
    """``parity/test_x.py::test_y[cpp]`` → (``test_x.py::test_y``, ``cpp``)."""
    m = _PARAM.match(nodeid)
    base, param = (m["base"], m["param"]) if m else (nodeid, NO_BACKEND)
    if param not in BACKEND_COLUMNS:
        base, param = nodeid, NO_BACKEND
    base = base.removeprefix("parity/")
    return base, param


def build_table(cells: OrderedDict[str, tuple[str, int | None]]) -> tuple[list[str], list[str], dict, dict]:
    rows: OrderedDict[str, dict[str, str]] = OrderedDict()
    columns = list(BACKEND_COLUMNS)
    totals: dict[str, Counter] = {c: Counter() for c in columns}
    for nodeid, (cell, issue) in cells.items():
        scenario, col = split_nodeid(nodeid)
        if col not in columns:
            columns.append(col)
            totals[col] = Counter()
        text = f"gap #{issue}" if cell == "gap" and issue is not None else cell
        rows.setdefault(scenario, {})[col] = text
        totals[col][cell] += 1
    order = sorted(rows)
    return order, columns, rows, totals


def render(cells: OrderedDict[str, tuple[str, int | None]], markdown: bool = False) -> str:
    order, columns, rows, totals = build_table(cells)
    used = [c for c in columns if totals[c] or c in BACKEND_COLUMNS]
    header = ["scenario"] + used
    body = [[s] + [rows[s].get(c, "") for c in used] for s in order]
    total_row = ["total"] + [_total_text(totals[c]) for c in used]
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in body]
        out.append("| **" + total_row[0] + "** | " + " | ".join(total_row[1:]) + " |")
        return "\n".join(out) + "\n"
    widths = [max(len(r[i]) for r in [header, total_row] + body) for i in range(len(header))]
    line = lambda r: "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
    sep = "  ".join("-" * w for w in widths)
    out = [line(header), sep] + [line(r) for r in body] + [sep, line(total_row)]
    return "\n".join(out) + "\n"


def _total_text(c: Counter) -> str:
    parts = [f"{c[k]} {'gap' if k == 'gap' else k}" for k in CELLS if c[k]]
    return ", ".join(parts) if parts else "0"


def _has_path(args: Sequence[str]) -> bool:
    skip_next = False
    for a in args:
        if skip_next:
            skip_next = False
            continue
        if a in _VALUE_OPTS:
            skip_next = True
            continue
        if a.startswith("-"):
            continue
        if os.path.exists(a.split("::")[0]):
            return True
    return False


def suggest_gaps(collector: Outcomes, exception: str, issue: int, reason: str) -> str:
    """TOML ``[[gap]]`` entries for every failing ``parity/`` or ``tests/`` item that raised
    ``exception`` (a starting point for the gap file: review each before adding it)."""
    out = []
    seen = set()
    for nodeid, (cell, _) in collector.cells.items():
        where = nodeid.split("/", 1)[0]
        if cell != "FAIL" or collector.errors.get(nodeid) != exception or where not in ("parity", "tests"):
            continue
        m = _PARAM.match(nodeid)
        params = m["param"].split("-") if m else []
        backend = next((p for p in params if p in BACKEND_COLUMNS), None)
        if backend is None:
            continue
        scenario = nodeid.split("::")[-1].split("[")[0]
        if (scenario, backend, where) in seen:
            continue
        seen.add((scenario, backend, where))
        entry = f'[[gap]]\nscenario = "{scenario}"\nbackend = "{backend}"\nreason = "{reason}"\nissue = {issue}\n'
        entry += f'raises = "{exception}"\n'
        if where == "tests":
            entry += 'where = "tests"\n'
        out.append(entry)
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    markdown = False
    output = None
    rest: list[str] = []
    suggest: str | None = None
    it = iter(args)
    for a in it:
        if a == "--markdown":
            markdown = True
        elif a == "--suggest-gaps":
            suggest = "NotImplementedError"
        elif a.startswith("--suggest-gaps="):
            suggest = a.split("=", 1)[1]
        elif a == "--output":
            output = next(it, None)
        elif a.startswith("--output="):
            output = a.split("=", 1)[1]
        else:
            rest.append(a)
    if not _has_path(rest):
        rest.insert(0, str(ROOT / "parity") if Path.cwd().resolve() != ROOT else "parity")
    collector = Outcomes()
    code = pytest.main(rest, plugins=[collector])
    text = render(collector.cells, markdown=markdown)
    title = "kvcm parity report (scenario × backend)"
    print()
    print(f"## {title}\n" if markdown else f"{title}\n")
    print(text, end="")
    if output:  # markdown when the file name says so, else like the console
        md = markdown or output.endswith(".md")
        Path(output).write_text(text if md == markdown else render(collector.cells, markdown=md), encoding="utf-8")
    if suggest:
        print(f"\n# suggested [[gap]] entries: failures raising {suggest} (review before adding)\n")
        print(suggest_gaps(collector, suggest, 3, "cpp stage 1: not implemented yet"))
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
