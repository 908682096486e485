"""Fixtures that start a real Mooncake Store on 127.0.0.1 (``mooncake_master`` with its HTTP
metadata server + one ``mooncake_client`` holding the memory) and stop it.

Without the mooncake package the tests that use them are skipped, except in CI
(``CI=true``), where a missing package fails them: CI must run them."""

from __future__ import annotations

import importlib.util
import os

import pytest


def need_mooncake() -> None:
    if importlib.util.find_spec("mooncake") is None:
        msg = "the mooncake package is not installed (pip install 'kvcm[mooncake]')"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + ": CI must run the Mooncake tests")
        pytest.skip(msg)


def start(tmp_dir: str, segment_bytes: int = 256 << 20):
    need_mooncake()
    from kvcm.mooncake_store import LocalMooncake

    return LocalMooncake(segment_bytes, log_dir=tmp_dir)


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory: pytest.TempPathFactory):
    """One Mooncake Store for the session (tests use distinct object names)."""
    mc = start(str(tmp_path_factory.mktemp("mooncake")))
    try:
        yield mc
    finally:
        mc.stop()


@pytest.fixture
def fresh_mooncake(tmp_path):
    """A Mooncake Store of its own (for tests that kill its processes)."""
    mc = start(str(tmp_path))
    try:
        yield mc
    finally:
        mc.stop()
