"""The import structure of python/kvcm (issue 9): the contracts in pyproject.toml
(``lint-imports``; .ci/run runs them too) and no import cycle in the whole module graph,
the package ``kvcm/__init__`` included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="import-linter (a test dependency) is not installed")

ROOT = Path(__file__).resolve().parents[2]
PYTHON_DIR = ROOT / "python"
# Known cycles, listed as data (none since issue 9 split python_backend/cache.py); the test
# fails on any cycle not listed here and on a listed one that disappeared.
KNOWN_CYCLES: list[set[str]] = []


def _graph():
    sys.path.insert(0, str(PYTHON_DIR))  # the source tree, whatever kvcm is installed
    try:
        graph = grimp.build_graph("kvcm", cache_dir=None)
    finally:
        sys.path.remove(str(PYTHON_DIR))
    # grimp reads .py files only: `from kvcm import _kvcm_cpp_testing` (a compiled module, a
    # leaf; `bench keys`) reads as an import of the package; drop exactly those edges.  (The
    # backends load `kvcm._kvcm_cpp` by name, so no such edge is left in the core.)
    for importer in list(graph.modules):
        if not graph.direct_import_exists(importer=importer, imported="kvcm"):
            continue
        details = graph.get_import_details(importer=importer, imported="kvcm")
        if details and all("_kvcm_cpp" in d["line_contents"] for d in details):
            graph.remove_import(importer=importer, imported="kvcm")
    return graph


def _cycles(graph) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in adj:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(adj[v]):
                work.append((v, i + 1))
                w = adj[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            for w in adj[v]:
                if w in on_stack:
                    low[v] = min(low[v], low[w])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert sorted(map(sorted, cycles)) == sorted(map(sorted, KNOWN_CYCLES))


def test_interface_imports_nothing_of_kvcm():
    graph = _graph()
    assert graph.find_modules_directly_imported_by("kvcm.api") == set()


def test_import_contracts():
    pytest.importorskip("importlinter")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]))
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    r = subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
