"""pytest plugin for ci/sanitize.sh: load ``kvcm._kvcm_cpp`` and the test-only
``kvcm._kvcm_cpp_testing`` from the sanitizer build dir (``KVCM_EXT_DIR``) instead of the
installed extensions, so the sanitized build never replaces the regular one.  Loaded with
``-p asan_ext`` (``PYTHONPATH=ci``) before any conftest imports kvcm."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

_dir = os.environ["KVCM_EXT_DIR"]


def _load(name: str):
    found = sorted(glob.glob(os.path.join(_dir, f"{name}.*.so")))
    if not found:
        raise ImportError(f"no {name} extension in {_dir}")
    spec = importlib.util.spec_from_file_location(f"kvcm.{name}", found[0])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"kvcm.{name}"] = mod
    spec.loader.exec_module(mod)
    return mod, found[0]


_mod, _path = _load("_kvcm_cpp")
if not _mod.build_info()["sanitize"]:
    raise ImportError(f"{_path} is not a sanitizer build")
_load("_kvcm_cpp_testing")  # built by the same sanitizer build (CMakeLists.txt)
