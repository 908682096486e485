"""The hand-checked stubs python/kvcm/_kvcm_cpp.pyi and _kvcm_cpp_testing.pyi must match the
built extensions (regenerate with ``python -m nanobind.stubgen -m kvcm.<module> -o
python/kvcm/<module>.pyi``)."""

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

KVCM_DIR = Path(__file__).resolve().parents[2] / "python" / "kvcm"


@pytest.mark.parametrize("module", ["_kvcm_cpp", "_kvcm_cpp_testing"])
def test_stub_is_current(tmp_path, module):
    pytest.importorskip(f"kvcm.{module}")
    out = tmp_path / f"{module}.pyi"
    subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-q", "-m", f"kvcm.{module}", "-o", str(out)],
        check=True,
        capture_output=True,
    )
    stub = KVCM_DIR / f"{module}.pyi"
    assert out.read_text() == stub.read_text(), (
        f"python/kvcm/{module}.pyi is stale: regenerate it with "
        f"`python -m nanobind.stubgen -m kvcm.{module} -o python/kvcm/{module}.pyi`"
    )
