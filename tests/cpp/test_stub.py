"""The hand-checked stub python/kvcm/_kvcm_cpp.pyi must match the built extension
(regenerate with ``python -m nanobind.stubgen -m kvcm._kvcm_cpp -o python/kvcm/_kvcm_cpp.pyi``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kvcm._kvcm_cpp")
nanobind = pytest.importorskip("nanobind")
pytest.importorskip("nanobind.stubgen")

# stubgen's exact output can change between nanobind releases; the golden file is from this one.
STUBGEN_VERSION = "3.1."
if not nanobind.__version__.startswith(STUBGEN_VERSION):
    pytest.skip(f"the golden stub was generated with nanobind {STUBGEN_VERSION}x", allow_module_level=True)

STUB = Path(__file__).resolve().parents[2] / "python" / "kvcm" / "_kvcm_cpp.pyi"


def test_stub_is_current(tmp_path):
    out = tmp_path / "_kvcm_cpp.pyi"
    subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "kvcm._kvcm_cpp", "-o", str(out)],
        check=True,
        capture_output=True,
    )
    assert out.read_text() == STUB.read_text(), (
        "python/kvcm/_kvcm_cpp.pyi is stale: regenerate it with "
        "`python -m nanobind.stubgen -m kvcm._kvcm_cpp -o python/kvcm/_kvcm_cpp.pyi`"
    )
