"""Backend selection (SPEC sec. 12), each case in a fresh interpreter: KVCM_BACKEND is read
once, at ``import kvcm``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Makes ``kvcm._kvcm_cpp`` unimportable, as on a machine where the extension was not built.
BLOCK_CPP = textwrap.dedent(
    """
    import sys
    class _NoCpp:
        def find_spec(self, name, path=None, target=None):
            if name == "kvcm._kvcm_cpp":
                raise ImportError("No module named 'kvcm._kvcm_cpp' (blocked by the test)")
            return None
    sys.meta_path.insert(0, _NoCpp())
    """
)

CONFIG = textwrap.dedent(
    """
    from kvcm import AttentionLayer, KVCacheManagerConfig, Tier
    cfg = KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 8)], tiers=[Tier("gpu", 32 * 8)])
    """
)


def run(code: str, backend: str | None, *, block_cpp: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCM_BACKEND", "KVCM_OPLOG")}
    if backend is not None:
        env["KVCM_BACKEND"] = backend
    src = (BLOCK_CPP if block_cpp else "") + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", src], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def cpp_built() -> bool:
    r = run("import kvcm._select as s; s.cpp_extension()", "python")
    return r.returncode == 0


def test_unknown_backend_fails_the_import_listing_the_choices():
    r = run("import kvcm", "rust")
    assert r.returncode != 0
    assert "BackendUnavailableError" in r.stderr
    assert "KVCM_BACKEND='rust' is not a kvcm backend; choices: cpp, python" in r.stderr


def test_python_backend_by_env():
    r = run(
        CONFIG
        + """
import kvcm
assert kvcm.backend == "python", kvcm.backend
m = kvcm.KVCacheManager(cfg)
assert m.backend_name == "python", m.backend_name
assert isinstance(m, kvcm.KVCacheManager)
print("ok")
""",
        "python",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_python_backend_works_without_the_extension():
    r = run(
        CONFIG + "import kvcm\nprint(kvcm.backend, kvcm.KVCacheManager(cfg).backend_name)", "python", block_cpp=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["python", "python"]


@pytest.mark.parametrize("env", [None, "", "cpp"])
def test_cpp_without_the_extension_names_the_fix(env):
    r = run("import kvcm", env, block_cpp=True)
    assert r.returncode != 0
    assert "BackendUnavailableError" in r.stderr
    assert "KVCM_BACKEND=python" in r.stderr
    assert "pip install" in r.stderr


def test_cpp_override_without_the_extension_names_the_fix():
    r = run(
        CONFIG
        + """
import kvcm
try:
    kvcm.KVCacheManager(cfg, backend="cpp")
except kvcm.BackendUnavailableError as e:
    assert "KVCM_BACKEND=python" in str(e), e
    print("refused")
""",
        "python",
        block_cpp=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "refused"


@pytest.mark.parametrize("env", [None, ""])
def test_default_is_cpp(env):
    if not cpp_built():
        pytest.fail("the cpp extension is not built: the default backend (cpp) cannot be checked")
    r = run("import kvcm\nprint(kvcm.backend)", env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "cpp"


def test_backend_override_in_process():
    r = run(
        CONFIG
        + """
import kvcm
assert kvcm.backend == "python"
py = kvcm.KVCacheManager(cfg, backend="python")
cpp = kvcm.KVCacheManager(cfg, backend="cpp")
print(type(py).__name__, py.backend_name, type(cpp).__name__, cpp.backend_name)
try:
    kvcm.KVCacheManager(cfg, backend="rust")
except kvcm.BackendUnavailableError as e:
    print("rejected:", e)
""",
        "python",
    )
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first.split() == ["PyKVCacheManager", "python", "CppKVCacheManager", "cpp"]
    assert "choices: cpp, python" in second


def test_block_keys_backend_override_agrees():
    r = run(
        """
import kvcm
a = kvcm.block_keys([1, 2, 3, 4, 5], 2, backend="python")
b = kvcm.block_keys([1, 2, 3, 4, 5], 2, backend="cpp")
assert a == b and len(a) == 3, (a, b)
print("same")
""",
        "python",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "same"


def run_pytest_without_cpp(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """pytest on parity/ with kvcm._kvcm_cpp blocked (a sitecustomize on PYTHONPATH)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_CPP)
    root = Path(__file__).resolve().parents[2]
    e = {k: v for k, v in os.environ.items() if k not in ("KVCM_BACKEND", "KVCM_OPLOG", "KVCM_ALLOW_NO_CPP")}
    e["PYTHONPATH"] = os.pathsep.join([str(tmp_path), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.update(env)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args]
    return subprocess.run(cmd, cwd=root, env=e, capture_output=True, text=True, timeout=300, check=False)


def test_parity_cpp_items_fail_loudly_without_the_extension(tmp_path):
    r = run_pytest_without_cpp(tmp_path, "parity/test_block_keys.py", KVCM_BACKEND="python")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "the cpp backend is not importable" in r.stdout
    assert "[cpp]" in r.stdout and " error" in r.stdout.splitlines()[-1]
    assert "skipped" not in r.stdout.splitlines()[-1]


def test_parity_cpp_items_skip_with_allow_no_cpp(tmp_path):
    # KVCM_BACKEND unset: KVCM_ALLOW_NO_CPP=1 also makes the default fall back to python
    r = run_pytest_without_cpp(tmp_path, "parity/test_block_keys.py", KVCM_ALLOW_NO_CPP="1")
    assert r.returncode == 0, r.stdout + r.stderr
    last = r.stdout.splitlines()[-1]
    assert "skipped" in last and "failed" not in last and "error" not in last
    assert "cpp backend not built (KVCM_ALLOW_NO_CPP=1)" in r.stdout
