"""Child processes import the kvcm their parent imported (issue #18 item 13).

The tests that start Python children used to put the source tree's ``python/`` first on the
child's ``PYTHONPATH``: after a non-editable ``pip install .`` the parent ran the installed
package and the children the source tree, which has no compiled extension ("cannot import
name '_kvcm_cpp'").  Here kvcm is "installed" as a copy in a directory of its own, a parent
process imports it from there, builds its children's environment with the tests' helpers
and asks a child where its kvcm comes from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import kvcm
import pytest
from children import TESTS_DIR

# kvcm is found only in SITE: an editable install of the package elsewhere (a redirecting
# import hook of scikit-build-core) would otherwise win over every path entry, in the parent
# and in the child alike
SITECUSTOMIZE = textwrap.dedent("""
    import sys

    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
""")

PARENT = textwrap.dedent("""
    import json, subprocess, sys
    from pathlib import Path

    sys.path[1:1] = sys.argv[1:3]  # the tests' helpers (as pytest's pythonpath does), tests/fleet
    import kvcm
    import children
    import test_shared_engine

    envs = {
        "test_shared_engine.child_command": test_shared_engine.child_command("unused", Path("."), "c",
                                                                             backend="python")[1],
        "children.child_env": children.child_env(KVCM_BACKEND="python"),
    }
    out = {"parent": kvcm.__file__}
    for name, env in envs.items():
        r = subprocess.run([sys.executable, "-c", "import kvcm; print(kvcm.__file__)"], env=env,
                           capture_output=True, text=True, timeout=120, check=False)
        out[name] = r.stdout.strip() or r.stderr.strip()[-1000:]
    print(json.dumps(out))
""")


@pytest.fixture
def installed_copy(tmp_path: Path) -> Path:
    """A directory holding a copy of this process's kvcm package (and nothing else of it)."""
    site = tmp_path / "site"
    shutil.copytree(Path(kvcm.__file__).parent, site / "kvcm", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return site


def test_children_import_the_parents_kvcm_not_the_source_tree(installed_copy: Path):
    """A parent whose kvcm lives elsewhere than the source tree: each child environment the
    tests build makes the child import the parent's kvcm (was: the source tree's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVCM_OPLOG")}
    env.update(PYTHONPATH=str(installed_copy), KVCM_BACKEND="python")
    r = subprocess.run([sys.executable, "-c", PARENT, str(TESTS_DIR), str(TESTS_DIR / "fleet")], env=env, capture_output=True, text=True,
                       timeout=300, check=False, cwd=installed_copy.parent)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    parent = out.pop("parent")
    assert Path(parent).resolve() == (installed_copy / "kvcm" / "__init__.py").resolve()
    for name, child in out.items():
        assert child == parent, f"{name}: the child imported {child}, its parent {parent}"
