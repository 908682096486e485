"""Fixtures of tests/ (the backend fixtures live in the root conftest)."""

import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from backend_legs import BACKEND_INDEPENDENT, INDEPENDENT_TESTS, TESTS_DIR
from mooncake_env import fresh_mooncake, mooncake

__all__ = ["ctx", "fresh_mooncake", "mooncake"]


@pytest.fixture
def ctx() -> Iterator:
    """A ZeroMQ context for one test (the events tests), destroyed without lingering."""
    import zmq  # the events extra: imported by the tests that use it only

    c = zmq.Context()
    yield c
    c.destroy(linger=0)


# --- which tests run in the cpp leg (issue 36 item 8): the tables and the rule are
# tests/backend_legs.py; here the mark, and its guard in the python leg


def _module_key(path: Path) -> str | None:
    """``folder/test_x.py`` relative to tests/, or None outside tests/."""
    p = Path(path).resolve()
    return p.relative_to(TESTS_DIR).as_posix() if TESTS_DIR in p.parents else None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backend_independent: the outcome does not depend on KVCM_BACKEND (the cpp leg deselects it)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        key = _module_key(item.path)
        fn = getattr(item, "originalname", item.name)
        if key in BACKEND_INDEPENDENT or f"{key}::{fn}" in INDEPENDENT_TESTS:
            if "backend" in getattr(item, "fixturenames", ()):
                raise pytest.UsageError(f"{item.nodeid} requests the backend fixture but tests/backend_legs.py "
                                        "classifies it backend-independent: make it BACKEND_DEPENDENT")
            item.add_marker(pytest.mark.backend_independent)


@pytest.fixture(autouse=True)
def _no_default_backend(request: pytest.FixtureRequest) -> Iterator[None]:
    """A ``backend_independent`` test may not let kvcm choose the default backend (a manager,
    ``block_keys`` ... without ``backend=``): that would make its outcome the leg's."""
    if request.node.get_closest_marker("backend_independent") is None:
        yield
        return
    from kvcm import _select

    chosen = _select._chosen
    used: list[str] = []

    def guarded(backend: str | None) -> str:
        if backend is None:
            used.append("".join(traceback.format_stack(limit=6)[:-1]))
        return chosen(backend)

    _select._chosen = guarded
    try:
        yield
    finally:
        _select._chosen = chosen
    if used:
        pytest.fail(f"{request.node.nodeid} is marked backend_independent (tests/backend_legs.py) but used "
                    f"kvcm's default backend:\n{used[0]}", pytrace=False)
