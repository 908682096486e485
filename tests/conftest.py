"""Fixtures of tests/ (the backend fixtures live in the root conftest)."""

from collections.abc import Iterator

import pytest
from mooncake_env import fresh_mooncake, mooncake

__all__ = ["ctx", "fresh_mooncake", "mooncake"]


@pytest.fixture
def ctx() -> Iterator:
    """A ZeroMQ context for one test (the events tests), destroyed without lingering."""
    import zmq  # the events extra: imported by the tests that use it only

    c = zmq.Context()
    yield c
    c.destroy(linger=0)
