"""pytest plugin for ci/sanitize.sh: load ``kvcm._kvcm_cpp`` from the sanitizer build dir
(``KVCM_EXT_DIR``) instead of the installed extension, so the sanitized build never replaces
the regular one.  Loaded with ``-p asan_ext`` (``PYTHONPATH=ci``) before any conftest imports kvcm."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

_dir = os.environ["KVCM_EXT_DIR"]
_found = sorted(glob.glob(os.path.join(_dir, "_kvcm_cpp*.so")))
if not _found:
    raise ImportError(f"no _kvcm_cpp extension in {_dir}")
_spec = importlib.util.spec_from_file_location("kvcm._kvcm_cpp", _found[0])
_mod = importlib.util.module_from_spec(_spec)
sys.modules["kvcm._kvcm_cpp"] = _mod
_spec.loader.exec_module(_mod)
if not _mod.build_info()["sanitize"]:
    raise ImportError(f"{_found[0]} is not a sanitizer build")
