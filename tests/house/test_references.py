"""Every test file the repository names exists: a ``tests/...py`` or ``parity/...py`` path in
the README, DECISIONS.md, docs/, the CI scripts (ci/, .ci/run), pyproject.toml, the package
and the tests themselves names a file of this checkout, so moving or splitting a test file
cannot leave a CI leg, a DECISIONS citation or a docstring pointing at nothing (tests/README.md
says where each kind of test lives)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w/.])((?:tests|parity)/[\w/]+\.py)\b")
# files that name made-up test files on purpose (a pytester sandbox, this test), and examples
SANDBOXES = {"tests/house/test_gaps_plugin.py", "tests/house/test_references.py"}
EXAMPLES = {"parity/test_x.py"}  # parity/report.py's docstring: the form of a node id


def _sources() -> list[Path]:
    files = [ROOT / n for n in ("README.md", "DECISIONS.md", "pyproject.toml", ".ci/run", "tests/README.md")]
    files += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "ci").glob("*"))
    for tree in ("tests", "parity", "python/kvcm"):
        files += sorted(p for p in (ROOT / tree).rglob("*.py") if "build" not in p.relative_to(ROOT).parts)
    return [f for f in files if f.is_file() and str(f.relative_to(ROOT)) not in SANDBOXES]


def test_every_named_test_file_exists():
    named, missing = 0, []
    for f in _sources():
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in PATH.finditer(line):
                named += 1
                if m.group(1) not in EXAMPLES and not (ROOT / m.group(1)).is_file():
                    missing.append(f"{f.relative_to(ROOT)}:{i}: {m.group(1)}")
    assert named >= 100, f"only {named} test paths found: the scan is broken"
    assert not missing, "paths to test files that do not exist:\n" + "\n".join(missing)


def test_the_scan_finds_a_moved_file():
    """The pattern sees the forms the repository writes paths in (a path in brackets, after a
    space, before ``::name``) and not a longer path that merely ends like one."""
    text = "[tests/tools/test_cli.py, parity/test_tree.py::test_x] see tests/core/x.py; build/tests/y.py"
    assert PATH.findall(text) == ["tests/tools/test_cli.py", "parity/test_tree.py", "tests/core/x.py"]
