"""The python and cpp legs split tests/ honestly (issue 36 item 8): every test module under
tests/ is classified in tests/backend_legs.py -- ``BACKEND_INDEPENDENT`` (run once, by the python
leg) or ``BACKEND_DEPENDENT`` (run by both legs) -- so that a new module never skips the cpp
leg unnoticed, and the cpp leg of ci/matrix.sh deselects exactly the independent ones."""

from __future__ import annotations

import ast
import re

from backend_legs import BACKEND_DEPENDENT, BACKEND_INDEPENDENT, INDEPENDENT_TESTS, TESTS_DIR

ROOT = TESTS_DIR.parent


def test_every_test_module_is_classified_once() -> None:
    modules = {p.relative_to(TESTS_DIR).as_posix() for p in TESTS_DIR.rglob("test_*.py")}
    both = set(BACKEND_INDEPENDENT) & BACKEND_DEPENDENT
    assert not both, f"in both tables of tests/backend_legs.py: {sorted(both)}"
    missing = modules - set(BACKEND_INDEPENDENT) - BACKEND_DEPENDENT
    assert not missing, (f"unclassified test modules {sorted(missing)}: add each to BACKEND_DEPENDENT "
                         "(it builds anything from the leg's backend) or BACKEND_INDEPENDENT in tests/backend_legs.py")
    stale = (set(BACKEND_INDEPENDENT) | BACKEND_DEPENDENT) - modules
    assert not stale, f"tests/backend_legs.py classifies modules that do not exist: {sorted(stale)}"


def test_each_independent_test_of_a_dependent_module_exists() -> None:
    """``INDEPENDENT_TESTS``: ``module::function``, the module in BACKEND_DEPENDENT (a whole
    independent module needs no list), the function defined there."""
    for entry in sorted(INDEPENDENT_TESTS):
        module, _, fn = entry.partition("::")
        assert module in BACKEND_DEPENDENT, f"{entry}: its module is not in BACKEND_DEPENDENT"
        tree = ast.parse((TESTS_DIR / module).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert fn in names, f"{entry}: no test function {fn} in tests/{module}"


def test_each_independent_module_says_why() -> None:
    assert all(why.strip() for why in BACKEND_INDEPENDENT.values())


def test_the_cpp_leg_deselects_the_independent_tests_and_the_python_leg_does_not() -> None:
    matrix = (ROOT / "ci" / "matrix.sh").read_text()
    legs = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(python|cpp)\)\s*(.*)$", matrix, re.MULTILINE)}
    assert '-m "not backend_independent"' in legs["cpp"], legs["cpp"]
    assert "backend_independent" not in legs["python"], legs["python"]
