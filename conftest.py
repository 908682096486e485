"""Root conftest: the backend fixtures and the gap-file plugin (SPEC sec. 12-13).

* ``backend`` (session-scoped, str): tests under ``parity/`` run on both backends
  (ids ``[cpp]`` and ``[python]``); tests under ``tests/`` (and anywhere else) run on
  ``kvcm.backend`` only — ``KVCM_BACKEND`` picks the CI leg.
* ``make_manager(config, **kw)``: ``kvcm.KVCacheManager(config, backend=backend, **kw)``;
  managers are shut down at teardown (errors ignored).
* ``[cpp]`` items FAIL when the compiled extension is not importable, unless
  ``KVCM_ALLOW_NO_CPP=1`` (then they are skipped, and ``KVCM_BACKEND`` defaults to python).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

pytest_plugins = ["parity.gaps"]

ROOT = Path(__file__).resolve().parent
PARITY_DIR = ROOT / "parity"
PARITY_BACKENDS = ("cpp", "python")
ALLOW_NO_CPP = os.environ.get("KVCM_ALLOW_NO_CPP") == "1"


def _import_kvcm():
    """``import kvcm``; with KVCM_ALLOW_NO_CPP=1 and no KVCM_BACKEND, fall back to python."""
    try:
        import kvcm
    except ImportError as e:
        # (kvcm._select cannot be imported here: that would run kvcm/__init__ again)
        if not (ALLOW_NO_CPP and type(e).__name__ == "BackendUnavailableError" and not os.environ.get("KVCM_BACKEND")):
            raise
        os.environ["KVCM_BACKEND"] = "python"
        import kvcm
    return kvcm


if ALLOW_NO_CPP:
    _import_kvcm()  # before any test module imports kvcm: it may have to fall back to python


def _in_parity(path: Path) -> bool:
    p = Path(path).resolve()
    return p == PARITY_DIR or PARITY_DIR in p.parents


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    if _in_parity(metafunc.definition.path):
        values = list(PARITY_BACKENDS)
    else:
        values = [_import_kvcm().backend]
    metafunc.parametrize("backend", values, ids=values, indirect=True, scope="session")


def cpp_unavailable_reason() -> str | None:
    """None when the cpp extension imports, else why not."""
    _import_kvcm()
    from kvcm._select import cpp_extension

    try:
        cpp_extension()
    except ImportError as e:
        return str(e)
    return None


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> str:
    name = getattr(request, "param", None)
    if name is None:  # used outside parametrization (e.g. a fixture-only request)
        name = _import_kvcm().backend
    if name == "cpp":
        why = cpp_unavailable_reason()
        if why is not None:
            if ALLOW_NO_CPP:
                pytest.skip(f"cpp backend not built (KVCM_ALLOW_NO_CPP=1): {why}")
            pytest.fail(
                f"the cpp backend is not importable: {why}\n"
                "Build it (pip install --no-build-isolation -e .) or set KVCM_ALLOW_NO_CPP=1 to skip [cpp] items.",
                pytrace=False,
            )
    return name


@pytest.fixture
def make_manager(backend: str):
    kvcm = _import_kvcm()
    made: list = []

    def make(config, **kw):
        m = kvcm.KVCacheManager(config, backend=backend, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        with contextlib.suppress(Exception):  # a scenario may leave caches open: fine
            m.shutdown()
