"""The mirrored wings (issue #9): every C++ function of cpp/core that implements a SPEC rule
opens with a pointer to its Python twin, ``// py: <file>.py <Class>.<name> — SPEC sec. <N>``.
This test holds the pointers to the code: the file exists in ``python_backend/`` (or the
interface's config module), the class defines a function of that name (one leading
underscore allowed for a private Python method), and the SPEC section exists.  A rename or
move on one side that is not ported to the other fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "cpp" / "core"
PY = ROOT / "python" / "kvcm"
SPEC = ROOT / "docs" / "SPEC.md"


def spec_sections(path: Path = SPEC) -> set[int]:
    """The section numbers of docs/SPEC.md, from its ``## N. Title`` headings."""
    return {int(m[1]) for m in re.finditer(r"^## (\d+)\. \S", path.read_text(), re.MULTILINE)}


SPEC_SECTIONS = spec_sections()
POINTER = re.compile(r"//\s*py:\s*(?P<file>[\w/]+\.py)\s+(?P<qual>[\w.]+)\s*[—-]+\s*SPEC sec\.\s*(?P<sec>\d+)")


def _pointers() -> list[tuple[str, int, str, str, int]]:
    out = []
    for path in sorted(CORE.glob("*.[hc]*")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("// py:"):
                m = POINTER.search(line)
                assert m, f"{path.name}:{n}: malformed twin pointer: {line.strip()}"
                out.append((path.name, n, m["file"], m["qual"], int(m["sec"])))
    return out


def _defined(pyfile: Path) -> dict[str, set[str]]:
    """{class name or '': names of the functions defined in it} for one Python module."""
    tree = ast.parse(pyfile.read_text())
    found: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[""].add(node.name)
        elif isinstance(node, ast.ClassDef):
            found[node.name] = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return found


def _resolve(file: str) -> Path:
    for base in (PY / "python_backend", PY):
        if (base / file).is_file():
            return base / file
    raise AssertionError(f"no Python module {file} in python_backend/ or kvcm/")


def test_every_twin_pointer_names_an_existing_python_function():
    pointers = _pointers()
    assert len(pointers) >= 40, f"only {len(pointers)} twin pointers in cpp/core"
    bad = []
    for cfile, line, pyfile, qual, sec in pointers:
        try:
            defined = _defined(_resolve(pyfile))
        except AssertionError as e:
            bad.append(f"{cfile}:{line}: {e}")
            continue
        cls, _, name = qual.rpartition(".")
        names = defined.get(cls)
        if names is None:
            bad.append(f"{cfile}:{line}: {pyfile} has no class {cls}")
        elif name not in names and f"_{name}" not in names:
            bad.append(f"{cfile}:{line}: {pyfile} {cls or '(module)'} has no {name} / _{name}")
        if sec not in SPEC_SECTIONS:
            bad.append(f"{cfile}:{line}: SPEC has no sec. {sec}")
    assert not bad, "\n".join(bad)


def test_the_rules_this_project_exists_for_are_mirrored():
    """Orphan re-attachment (sec. 5), match pruning (sec. 6) and the victim choice (sec. 8)
    each have exactly one pointed-to home."""
    quals = {qual.rpartition(".")[2] for *_, qual, _sec in _pointers()}
    for name in ("parent_for", "prune_match", "victim", "attach", "find_existing", "forget_copies"):
        assert name in quals, f"no C++ function points to a Python twin named {name}"
