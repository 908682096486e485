"""The mirrored wings (issue #9): every C++ function of cpp/core that implements a SPEC rule
opens with a pointer to its Python twin, ``// py: <file>.py <Class>.<name> — SPEC sec. <N>``.
This test holds the pointers to the code: the file exists in ``python_backend/`` (or the
interface's config module), the class defines a function of that name (one leading
underscore allowed for a private Python method), and the SPEC section exists.  A rename or
move on one side that is not ported to the other fails here.

The seam (issue 21) is held too: the C++ function right after a pointer belongs to the
class the pointer names (``_CLASSES``: BlockPool <-> BlockPool, Request <-> Request,
Manager <-> PyKVCacheManager, RadixTree <-> RadixTree, pools.py's Pool <-> the C++ pool
types), and the pointer sits in the same-named file (``block_pool.cpp|h`` <->
``block_pool.py``, ...).  Pointers to a module-level Python function (batch.py, observe.py)
are held to the file only; pointers to the interface's config module (the stale-range rule,
whose C++ home is lifecycle.h) to neither."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "cpp" / "core"
PY = ROOT / "python" / "kvcm"
SPEC = ROOT / "docs" / "SPEC.md"


def spec_sections(path: Path = SPEC) -> set[int]:
    """The section numbers of docs/SPEC.md, from its ``## N. Title`` headings."""
    return {int(m[1]) for m in re.finditer(r"^## (\d+)\. \S", path.read_text(), re.MULTILINE)}


SPEC_SECTIONS = spec_sections()
POINTER = re.compile(r"//\s*py:\s*(?P<file>[\w/]+\.py)\s+(?P<qual>[\w.]+)\s*[—-]+\s*SPEC sec\.\s*(?P<sec>\d+)")


# Python class named by a pointer -> the C++ classes its functions may live in.  pools.py's
# Pool is split in C++ into the pool's own record (Pool), its free-slot bitmap (FreeSlots)
# and the index operations that walk the page slab (BlockPool members in pools.cpp).
_CLASSES = {
    "BlockPool": {"BlockPool"},
    "Request": {"Request"},
    "PyKVCacheManager": {"Manager"},
    "RadixTree": {"RadixTree"},
    "Pool": {"Pool", "FreeSlots", "BlockPool"},
    "Page": {"Page"},
    # issue 36: the parts of the block pool, one class each in both wings
    "Layout": {"Layout"},
    "Pages": {"Pages"},
    "TreeIndex": {"TreeIndex"},
    "Evictor": {"Evictor"},
    "EvictionStrategy": {"EvictionStrategy", "LruStrategy"},
    "LruStrategy": {"LruStrategy"},
    "Outbox": {"Outbox"},
}
# issue 36, C++: the index operations that walk the page slab (pools.cpp) are Pages members
_CLASSES["Pool"] = {"Pool", "FreeSlots", "Pages"}
# Python modules whose pointers are not held to a file or class (the interface's config
# module: its C++ twin lifecycle.h has no functions of its own to point from).
_ANYWHERE = {"config.py"}
# The C++ definition a pointer stands before: `Class::name(` (a member defined out of line).
_DEFINITION = re.compile(r"(?:^|[\s*&>])(?P<cls>\w+)::(?P<name>~?\w+)\(")


def _cpp_owner(path: Path, line: int) -> tuple[str, str] | None:
    """(class, function) of the definition after the pointer on ``line`` (1-based): the
    first line after the pointer's comment block that names ``Class::function(``."""
    lines = path.read_text().splitlines()
    for text in lines[line:line + 8]:
        if text.lstrip().startswith("//"):
            continue
        m = _DEFINITION.search(text)
        if m:
            return m["cls"], m["name"]
    return None


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


def test_every_twin_pointer_sits_in_the_class_and_file_of_its_twin():
    """The seam (issue 21): a pointer naming ``block_pool.py BlockPool.x`` stands before a
    ``BlockPool::`` member in block_pool.cpp (or .h), one naming ``request.py Request.x``
    before a ``Request::`` member in request.cpp, and so on (see ``_CLASSES``)."""
    bad = []
    for cfile, line, pyfile, qual, _sec in _pointers():
        if pyfile in _ANYWHERE:
            continue
        stem = Path(pyfile).stem
        if Path(cfile).stem != stem:
            bad.append(f"{cfile}:{line}: a pointer to {pyfile} sits in {cfile}, not {stem}.cpp / {stem}.h")
        cls = qual.rpartition(".")[0]
        if not cls:  # a module-level Python function (batch.py, observe.py): the file is the rule
            continue
        owner = _cpp_owner(CORE / cfile, line)
        if owner is None:
            bad.append(f"{cfile}:{line}: no Class::function( definition follows the pointer to {qual}")
            continue
        allowed = _CLASSES.get(cls)
        if allowed is None:
            bad.append(f"{cfile}:{line}: {pyfile} class {cls} has no C++ counterpart in _CLASSES")
        elif owner[0] not in allowed:
            bad.append(f"{cfile}:{line}: {owner[0]}::{owner[1]} points to {qual}: "
                       f"a {cls} twin belongs to {' / '.join(sorted(allowed))}")
    assert not bad, "\n".join(bad)


def test_the_rules_this_project_exists_for_are_mirrored():
    """Orphan re-attachment (sec. 5), match pruning (sec. 6), the victim choice (sec. 8)
    and the failure reports with their one roll-back (sec. 15) each have a pointed-to home."""
    quals = {qual.rpartition(".")[2] for *_, qual, _sec in _pointers()}
    for name in ("parent_for", "prune_match", "victim", "attach", "find_existing", "forget_copies", "settle_copies",
                 "settle_oldest", "roll_back_lost"):
        assert name in quals, f"no C++ function points to a Python twin named {name}"
