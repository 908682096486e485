"""The seam between a request and the block pool, measured (issue 30 item 1).

A request's operations reach shared state only through ``BlockPool`` methods; this module
counts how wide that surface is, in both wings, and holds it narrow:

* the distinct members of ``BlockPool`` and of its parts (issue 36: ``pages``,
  ``tree_index``, ``evictor``, ``outbox``) ``request.py``'s ``Request`` uses
  (``self.pool.x``, ``pool.x`` after ``pool = self.pool`` or of a parameter ``pool``;
  ``pool.pages.y`` counted as ``pages.y``; ``layout``, the read-only configuration facts,
  not counted), and the members of the tree it reaches through ``pool.tree``
  (``pool.tree.y``, ``tree.y`` after ``tree = pool.tree``);
* the same for the C++ ``Request`` (``pool_.x``, ``pool_.tree().y``) and the number of
  ``pool_.tree()`` calls in ``request.{h,cpp}``;
* writes of a ``Page`` field outside the pool (python: an assignment to ``x.f`` where ``f``
  is one of ``Page.__slots__`` and ``x`` is not ``self``, in every ``python_backend``
  module but ``pages.py`` / ``pools.py`` and ``tree.py`` (whose nodes have fields of
  the same names and which never sees a page); C++: ``x.f =`` / ``x->f =`` (and ``++`` /
  ``--``, ``+=`` / ``-=``) on a variable declared ``Page*`` / ``Page&`` or on
  ``pool_.page(...)``, where ``f`` is a field of ``struct Page``, in every ``cpp/core``
  file but ``pages.*`` / ``pools.*`` (since issue 36 ``Pages::page`` returns ``const Page&``,
  so the rule also holds by type), counted with and without the writes inside a
  lambda handed to ``restate``);
* the C++ ``Request``'s public data members, and the ``Request`` fields
  ``Manager::create`` assigns (``r.f = ...``).

The counting functions take a checkout's root, so the figures of the start commit and of
this one come from the same code (``counts(root)``; DECISIONS.md "The Python wing is the
executable specification").
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The narrow seam's bounds (issue 30 item 1).  Before: python 43 members (30 of the pool,
# 13 of its tree), 9 page-field writes outside the pool; C++ 51 members (35 + 16 of the
# tree), 52 ``pool_.tree()`` calls, 13 page-field writes, 20 public fields, 10 of them
# filled by ``Manager::create``.
# issue 36 (the pool split into parts), counted through the parts: python 12 before (of
# BlockPool, ``layout`` not counted; 13 with it), 12 after (4 of BlockPool, 5 of
# tree_index, 2 of pages, 1 of outbox)
MAX_REQUEST_POOL_MEMBERS = 13
# C++ (issue 36 item 1): the members of BlockPool and of its parts (Pages, TreeIndex, Evictor,
# Outbox) the Request uses, counted through the parts; the config facts (``layout_``, a
# ``const Layout&``) and the token interning (``tokens_``, a ``TokenTable&``) are not pool
# members.  Before: 25 BlockPool members + 2 of its tree (27; the guard said 26), 2
# ``pool_.tree()`` calls.  After: 14 + 1 (15), 1 ``tree()`` call.
MAX_CPP_REQUEST_POOL_MEMBERS = 15
# the ``tree()`` calls in request.{h,cpp} (the tree reads below go through them)
MAX_CPP_REQUEST_TREE_CALLS = 1
# the references to the pool and its parts a C++ Request may hold (request.h), by member name
CPP_POOL_PARTS = {"pool_": "BlockPool", "pages_": "Pages", "index_": "TreeIndex", "evictor_": "Evictor",
                  "outbox_": "Outbox"}
# the tree members the C++ Request may use through the (const) tree: reads only
CPP_TREE_READS = {"digest", "prefetch_child"}


# ---------------------------------------------------------------------------------- python


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"no class {name}")


# the parts of the pool a request calls (``pool.pages.use``): each member it uses of one
# counts as one member of the seam (``pages.use``); ``layout`` is not counted: the
# configuration's facts, read-only, which the request holds (DECISIONS.md / split table)
POOL_PARTS = {"pages", "tree_index", "evictor", "outbox"}
NOT_POOL_MEMBERS = {"layout"}


def _is_pool(node: ast.AST, pool_names: set[str]) -> bool:
    """``node`` is the block pool: ``<x>.pool`` or a local bound to one."""
    if isinstance(node, ast.Attribute) and node.attr == "pool":
        return True
    return isinstance(node, ast.Name) and node.id in pool_names


def _is_tree(node: ast.AST, pool_names: set[str], tree_names: set[str]) -> bool:
    """``node`` is the pool's tree: ``<pool>.tree`` or a local bound to one."""
    if isinstance(node, ast.Attribute) and node.attr == "tree" and _is_pool(node.value, pool_names):
        return True
    return isinstance(node, ast.Name) and node.id in tree_names


def _part_of(node: ast.AST, pool_names: set[str], part_names: dict[str, str]) -> str | None:
    """The part of the pool ``node`` is (``<pool>.pages`` or a local bound to one), or None."""
    if isinstance(node, ast.Attribute) and node.attr in POOL_PARTS and _is_pool(node.value, pool_names):
        return node.attr
    if isinstance(node, ast.Name):
        return part_names.get(node.id)
    return None


def python_request_members(root: Path = ROOT) -> tuple[set[str], set[str]]:
    """(the members of ``BlockPool`` and of its parts ``Request`` uses: ``x`` for
    ``pool.x``, ``part.y`` for ``pool.part.y``, a part used whole (handed on, indexed) by
    its own name; the tree members it reaches through the pool's ``tree``), by name, over
    every method of the class."""
    mod = ast.parse((root / "python/kvcm/python_backend/request.py").read_text())
    cls = _class(mod, "Request")
    pool_members: set[str] = set()
    tree_members: set[str] = set()
    for fn in ast.walk(cls):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        # a parameter holding the pool (``__init__(self, pool: BlockPool, ...)``)
        pool_names = {a.arg for a in fn.args.args + fn.args.kwonlyargs
                      if a.arg == "pool" or (a.annotation is not None and "BlockPool" in ast.unparse(a.annotation))}
        tree_names: set[str] = set()
        part_names: dict[str, str] = {}
        bound: set[int] = set()  # the ``pool.part`` nodes bound to a local (not a use of the part itself)
        # the locals bound to the pool, its tree or one of its parts (``pool = self.pool``, ...)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                if _is_pool(node.value, pool_names):
                    pool_names.add(name)
                elif _is_tree(node.value, pool_names, tree_names):
                    tree_names.add(name)
                elif (part := _part_of(node.value, pool_names, part_names)) is not None:
                    part_names[name] = part
                    bound.add(id(node.value))
        # the nodes an attribute is read from (``pool.pages`` in ``pool.pages.use``)
        bases = {id(node.value) for node in ast.walk(fn) if isinstance(node, ast.Attribute)}
        for node in ast.walk(fn):
            if not isinstance(node, ast.Attribute):
                continue
            part = _part_of(node.value, pool_names, part_names)
            if part is not None:
                pool_members.add(f"{part}.{node.attr}")
            elif _is_tree(node.value, pool_names, tree_names):
                tree_members.add(node.attr)
            elif (_is_pool(node.value, pool_names) and node.attr not in NOT_POOL_MEMBERS
                  and (node.attr not in POOL_PARTS or (id(node) not in bases and id(node) not in bound))):
                pool_members.add(node.attr)  # (a part used whole counts as one member)
    return pool_members, tree_members


def _page_fields_py(root: Path) -> set[str]:
    mod = ast.parse((root / "python/kvcm/python_backend/pools.py").read_text())
    for node in _class(mod, "Page").body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    raise AssertionError("Page has no __slots__")


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def python_page_writes(root: Path = ROOT) -> list[str]:
    """``file:line attr`` of every write of a Page field outside the pool's modules."""
    fields = _page_fields_py(root)
    out = []
    for path in sorted((root / "python/kvcm/python_backend").glob("*.py")):
        if path.name in {"pages.py", "pools.py", "tree.py"}:  # (the tree's Node has fields of those names)
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for t in _targets(node):
                if (isinstance(t, ast.Attribute) and t.attr in fields
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self")):
                    out.append(f"{path.name}:{t.lineno} {t.attr}")
    return out


# ---------------------------------------------------------------------------------- C++


def _cpp_request_text(root: Path) -> str:
    core = root / "cpp/core"
    return (core / "request.h").read_text() + "\n" + (core / "request.cpp").read_text()


def cpp_request_members(root: Path = ROOT) -> tuple[set[str], set[str], int]:
    """(the members of BlockPool and of its parts the C++ Request uses, as ``Class.member``;
    the tree members it reaches through a ``tree()`` accessor; the number of ``tree()``
    calls) in request.{h,cpp}.  A part is reached through the Request's own reference
    (``pages_.use``) or through the pool (``pool_.pages().use``): either counts the part's
    member, never the accessor."""
    text = _strip_comments(_cpp_request_text(root))
    refs = "|".join(CPP_POOL_PARTS)
    accessors = {name.rstrip("_") for name in CPP_POOL_PARTS if name != "pool_"}
    members: set[str] = set()
    for m in re.finditer(r"\b(" + refs + r")\s*\.\s*(\w+)(\s*\(\s*\)\s*\.\s*(\w+))?", text):
        ref, name, chained = m[1], m[2], m[4]
        if ref == "pool_" and name in accessors and chained:
            members.add(f"{CPP_POOL_PARTS[name + '_']}.{chained}")
        else:
            members.add(f"{CPP_POOL_PARTS[ref]}.{name}")
    tree_re = r"\b(?:" + refs + r")\s*\.\s*(?:index\s*\(\s*\)\s*\.\s*)?tree\s*\(\s*\)"
    tree_members = set(re.findall(tree_re + r"\s*\.\s*(\w+)", text))
    calls = len(re.findall(tree_re, text))
    return {m for m in members if not m.endswith(".tree")}, tree_members, calls


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def _struct_fields(text: str, name: str) -> set[str]:
    """The data members of ``struct name { ... };`` (one declaration per line)."""
    m = re.search(r"\bstruct\s+" + name + r"\s*\{", text)
    assert m, f"no struct {name}"
    depth, i = 1, m.end()
    body_start = i
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    body = _strip_comments(text[body_start:i - 1])
    fields: set[str] = set()
    for line in body.splitlines():
        line = line.strip()
        if not line.endswith(";") or "(" in line or line.startswith(("static", "using", "return", "}")):
            continue
        fields |= _declared_names(line[:-1])
    return fields


def _declared_names(decl: str) -> set[str]:
    """The names one declaration (``T a = 1, b = 2``, ``std::optional<X> c, d``) declares."""
    while True:
        stripped = re.sub(r"<[^<>]*>", "", decl)  # template arguments (their commas are not the declaration's)
        if stripped == decl:
            break
        decl = stripped
    out = set()
    for part in decl.split(","):
        words = re.findall(r"\w+", part.split("=")[0].split("{")[0])
        if words:
            out.add(words[-1])
    return out


_PAGE_VAR = re.compile(r"\bPage\s*[*&]\s*(\w+)|\bPage\s+[*&](\w+)")


def cpp_page_writes(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(every write of a Page field outside the pool's files, those of them inside a lambda
    handed to ``restate``) as ``file:line field``."""
    core = root / "cpp/core"
    fields = _struct_fields((core / "pools.h").read_text(), "Page")
    field_alt = "|".join(sorted(fields))
    out: list[str] = []
    in_restate: list[str] = []
    for path in sorted(core.glob("*.[hc]*")):
        if path.stem in {"pages", "pools"}:  # Pages (and its index operations in pools.cpp) own the pages
            continue
        text = _strip_comments(path.read_text())
        names = {a or b for a, b in _PAGE_VAR.findall(text)}
        obj = r"(?:\b(?:" + "|".join(sorted(names)) + r")\b|\bpool_\s*\.\s*page\s*\([^;]*?\))" if names else \
            r"\bpool_\s*\.\s*page\s*\([^;]*?\)"
        write = re.compile(obj + r"\s*(?:->|\.)\s*(" + field_alt + r")\b\s*(?:=(?!=)|\+=|-=|\+\+|--)"
                           r"|(?:\+\+|--)\s*" + obj + r"\s*(?:->|\.)\s*(" + field_alt + r")\b")
        restates = [(m.start(), _lambda_end(text, m.end())) for m in re.finditer(r"\brestate\s*\(", text)]
        for m in write.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            entry = f"{path.name}:{line} {m[1] or m[2]}"
            out.append(entry)
            if any(a <= m.start() < b for a, b in restates):
                in_restate.append(entry)
    return out, in_restate


def _lambda_end(text: str, i: int) -> int:
    """The end of the call whose argument list starts at ``i`` (just after its ``(``)."""
    depth = 1
    while depth and i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return i


def _class_body(text: str, name: str) -> str:
    m = re.search(r"\bclass\s+" + name + r"\s*(?:final\s*)?(?::[^{;]*)?\{", text)
    assert m, f"no class {name}"
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i - 1]


def cpp_request_public_fields(root: Path = ROOT) -> set[str]:
    """The data members declared in the public part(s) of ``class Request`` (request.h)."""
    body = _strip_comments(_class_body((root / "cpp/core/request.h").read_text(), "Request"))
    out: set[str] = set()
    access = "private"
    depth = 0
    for line in body.splitlines():
        s = line.strip()
        m = re.match(r"(public|private|protected)\s*:", s)
        if m and depth == 0:
            access = m[1]
            continue
        if depth == 0 and access == "public" and s.endswith(";") and "(" not in s and ")" not in s and not s.startswith(
                ("using", "friend", "static", "enum", "struct", "class", "}")):
            out |= _declared_names(s[:-1])
        depth += s.count("{") - s.count("}")
    return out


def cpp_create_request_writes(root: Path = ROOT) -> set[str]:
    """The Request fields ``Manager::create`` assigns (``r.f = ...``)."""
    text = _strip_comments((root / "cpp/core/manager.cpp").read_text())
    m = re.search(r"\bManager::create\s*\(", text)
    assert m, "no Manager::create"
    start = text.index("{", m.end())
    depth, i = 1, start + 1
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return set(re.findall(r"\br\s*\.\s*(\w+)\s*=(?!=)", text[start:i]))


def counts(root: Path = ROOT) -> dict:
    """Every figure of this module for the checkout at ``root``."""
    py_pool, py_tree = python_request_members(root)
    cpp_pool, cpp_tree, tree_calls = cpp_request_members(root)
    cpp_writes, cpp_in_restate = cpp_page_writes(root)
    return {
        "python_request_pool_members": sorted(py_pool),
        "python_request_tree_members": sorted(py_tree),
        "python_request_members_total": len(py_pool - {"tree"}) + len(py_tree),
        "python_page_writes_outside_pool": python_page_writes(root),
        "cpp_request_pool_members": sorted(cpp_pool),
        "cpp_request_tree_members": sorted(cpp_tree),
        "cpp_request_members_total": len(cpp_pool) + len(cpp_tree),
        "cpp_request_tree_calls": tree_calls,
        "cpp_page_writes_outside_pool": cpp_writes,
        "cpp_page_writes_in_restate_lambdas": cpp_in_restate,
        "cpp_request_public_fields": sorted(cpp_request_public_fields(root)),
        "cpp_create_request_writes": sorted(cpp_create_request_writes(root)),
    }


# ---------------------------------------------------------------------------------- the bounds


def test_python_request_uses_a_narrow_pool_surface() -> None:
    pool, tree = python_request_members()
    assert not tree, f"Request reaches through the pool into its tree: {sorted(tree)}"
    assert len(pool) <= MAX_REQUEST_POOL_MEMBERS, \
        f"Request uses {len(pool)} members of BlockPool and its parts (limit {MAX_REQUEST_POOL_MEMBERS}): {sorted(pool)}"


def test_cpp_request_uses_a_narrow_pool_surface() -> None:
    pool, tree, calls = cpp_request_members()
    assert tree <= CPP_TREE_READS, f"Request reaches the tree for {sorted(tree - CPP_TREE_READS)}"
    used = len(pool) + len(tree)
    assert used <= MAX_CPP_REQUEST_POOL_MEMBERS, (
        f"Request uses {used} members of the pool and its parts (limit {MAX_CPP_REQUEST_POOL_MEMBERS}): "
        f"{sorted(pool)} + tree {sorted(tree)}")
    assert calls <= MAX_CPP_REQUEST_TREE_CALLS, f"{calls} tree() calls in request.{{h,cpp}} (limit {MAX_CPP_REQUEST_TREE_CALLS})"


def test_the_pool_hands_out_a_const_tree() -> None:
    """The tree changes only through the tree index's methods: its accessor is const (C++),
    and so is the page accessor of Pages (a page changes only through Pages' methods)."""
    for name in ("block_pool.h", "tree_index.h"):
        header = _strip_comments((ROOT / "cpp/core" / name).read_text())
        accessors = re.findall(r"(\bconst\s+)?RadixTree\s*&\s*tree\s*\(\s*\)", header)
        assert all(const for const in accessors), f"{name}: tree() must return a const RadixTree&"
    header = _strip_comments((ROOT / "cpp/core/pages.h").read_text())
    pages = re.findall(r"(\bconst\s+)?Page\s*&\s*page\s*\(", header)
    assert pages and all(const for const in pages), "Pages::page() must return a const Page&"


def test_no_page_field_is_written_outside_the_pool() -> None:
    assert python_page_writes() == []
    writes, _in_restate = cpp_page_writes()
    assert writes == []


def test_cpp_request_state_is_private_and_set_up_by_its_constructor() -> None:
    assert cpp_request_public_fields() == set()
    head = re.search(r"\bclass\s+Request\s*(?::([^{;]*))?\{", (ROOT / "cpp/core/request.h").read_text())
    assert head is not None
    assert "public" not in (head[1] or ""), "a public base would expose the request's fields"
    assert cpp_create_request_writes() == set()


def test_the_counters_see_what_they_count(tmp_path) -> None:
    """The counting functions find a widened seam (a check that cannot fail holds nothing)."""
    import shutil

    for rel in ("python/kvcm/python_backend", "cpp/core"):
        shutil.copytree(ROOT / rel, tmp_path / rel)
    req = tmp_path / "python/kvcm/python_backend/request.py"
    req.write_text(req.read_text().replace(
        "        self._status = Status.SUSPENDED\n",
        "        self._status = Status.SUSPENDED\n        pool.tree.ref(pool.make_room)\n"
        "        self.live = pool.pages[0]\n        self.live.node = 3\n", 1))
    cpp = tmp_path / "cpp/core/request.cpp"
    cpp.write_text(cpp.read_text().replace(
        "  cow_block = m % layout_.B() ? m / layout_.B() : -1;\n",
        "  cow_block = m % layout_.B() ? m / layout_.B() : -1;\n  Page* p = &pool_.page(0);\n  p->node = 1;\n"
        "  pool_.make_room(0, 0);\n  pool_.tree().key(0);\n  pool_.tree().key(0);\n", 1))
    pool, tree = python_request_members(tmp_path)
    assert "make_room" in pool and "pages" in pool and tree == {"ref"}
    assert python_page_writes(tmp_path) == ["request.py:" + str(_line_of(req, "self.live.node = 3")) + " node"]
    assert [w.split()[1] for w in cpp_page_writes(tmp_path)[0]] == ["node"]
    cpp_pool, cpp_tree, calls = cpp_request_members(tmp_path)
    assert "BlockPool.make_room" in cpp_pool and "key" in cpp_tree
    assert calls == cpp_request_members()[2] + 2


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)
