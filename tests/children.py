"""The environment of a Python child process a test starts (issue #18 item 13): the child
imports the very kvcm this process imported — the source tree, an editable install or an
installed wheel — never another one.

Putting the source tree's ``python/`` on the child's path (what the tests did) breaks after
a non-editable ``pip install .``: the parent runs the installed package, the child the
source tree, which has no compiled extension (``No module named 'kvcm._kvcm_cpp'``).  So the
directory holding *this process's* ``kvcm`` goes first on the child's ``PYTHONPATH``, unless
it is a site directory the child searches anyway (prepending site-packages would put it
before the standard library); then the tests directory (the children's helpers), then the
inherited ``PYTHONPATH``."""

from __future__ import annotations

import os
import site
from pathlib import Path

import kvcm

TESTS_DIR = Path(__file__).resolve().parent


def kvcm_root() -> Path:
    """The directory this process imported ``kvcm`` from (the package's parent)."""
    return Path(kvcm.__file__).resolve().parent.parent


def child_env(base: dict[str, str] | None = None, **overrides: str) -> dict[str, str]:
    """``base`` (default ``os.environ``) with ``overrides``, and a ``PYTHONPATH`` under which
    ``import kvcm`` finds this process's kvcm first (module docstring)."""
    env = dict(os.environ if base is None else base, **overrides)
    root = kvcm_root()
    sites = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()] if p}
    first = [] if root in sites else [str(root)]
    env["PYTHONPATH"] = os.pathsep.join([*first, str(TESTS_DIR), *filter(None, [env.get("PYTHONPATH")])])
    return env


__all__ = ["TESTS_DIR", "child_env", "kvcm_root"]
