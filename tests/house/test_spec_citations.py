"""The behaviour contract is in the repository (issue 21): every "SPEC sec. N" (or a bare
"sec. N", as the interface cites it) in the code, the tests and the docs names a section
heading of docs/SPEC.md, and every DECISIONS.md section that docs/SPEC.md refers to exists.
A renumbered or dropped section, or a citation of one that never existed, fails here."""

from __future__ import annotations

import re
from pathlib import Path

from test_mirror import SPEC, spec_sections

ROOT = Path(__file__).resolve().parents[2]
TREES = ("python", "cpp", "tests", "parity", "docs")
TOP_FILES = ("README.md", "DECISIONS.md", "conftest.py", "pyproject.toml")
SUFFIXES = {".py", ".pyi", ".h", ".hpp", ".cpp", ".md", ".toml", ".txt", ".sh"}
# "SPEC sec. 7", "sec. 4, 8", "SPEC secs. 5 / 13", "sec. 12-13", "SPEC sec. 5 and 6": the
# first number, then any list of further numbers joined by , / + & - or "and"
CITATION = re.compile(r"\b(?:SPEC\s+)?secs?\.\s*(\d+)((?:\s*(?:[,/+&-]|and)\s*\d+\b)*)")


def _sources() -> list[Path]:
    files = [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and "build" not in path.relative_to(ROOT).parts:
                files.append(path)
    return files


def citations(text: str) -> list[tuple[int, int]]:
    """``(line, section)`` for every section number ``text`` cites (a range ``12-13`` cites
    every section from 12 to 13)."""
    out = []
    for m in CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        first = int(m[1])
        out.append((line, first))
        prev = first
        for sep, num in re.findall(r"\s*([,/+&-]|and)\s*(\d+)", m[2]):
            n = int(num)
            if sep == "-":
                out.extend((line, k) for k in range(prev + 1, n))
            out.append((line, n))
            prev = n
    return out


def test_citation_parser_reads_lists_and_ranges():
    text = "SPEC sec. 4, 8 and 9\nsee sec. 12-14; SPEC sec. 7 + 10 (+ more); secs. 5 / 13 ."
    assert citations(text) == [(1, 4), (1, 8), (1, 9), (2, 12), (2, 13), (2, 14), (2, 7), (2, 10), (2, 5), (2, 13)]


def test_spec_has_sections_0_to_19_as_headings():
    assert spec_sections() == set(range(20))


def test_every_spec_citation_names_a_section_of_docs_spec():
    sections = spec_sections()
    bad, total = [], 0
    for path in _sources():
        for line, sec in citations(path.read_text(errors="replace")):
            total += 1
            if sec not in sections:
                bad.append(f"{path.relative_to(ROOT)}:{line}: sec. {sec} is no heading of docs/SPEC.md")
    # the code cites the contract a few hundred times: finding few means the scan is broken
    assert total >= 300, f"only {total} SPEC citations found"
    assert not bad, "\n".join(bad)


def test_nothing_points_at_the_spec_outside_the_repository():
    bad = [f"{path.relative_to(ROOT)}" for path in _sources() if "shared/SPEC" in path.read_text(errors="replace")
           and path.name != Path(__file__).name]
    assert not bad, f"cite docs/SPEC.md, not ../shared/SPEC.md: {bad}"


def test_decisions_sections_named_by_the_spec_exist():
    """docs/SPEC.md refers to DECISIONS.md sections by (the start of) their title:
    ``DECISIONS "Title"`` or ``DECISIONS "Title", "Other title"``."""
    headings = [h.strip() for h in re.findall(r"^#+\s+(.+)$", (ROOT / "DECISIONS.md").read_text(), re.MULTILINE)]
    spec = SPEC.read_text()
    refs = [" ".join(t.split()) for group in re.findall(r'DECISIONS\s+((?:"[^"]{1,80}"(?:,\s*)?)+)', spec)
            for t in re.findall(r'"([^"]+)"', group)]
    assert len(refs) >= 20, f"only {len(refs)} DECISIONS references in docs/SPEC.md"
    missing = [r for r in refs if not any(h.startswith(r) for h in headings)]
    assert not missing, f"docs/SPEC.md names DECISIONS.md sections that do not exist: {missing}"
