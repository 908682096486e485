"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_sim import Sim, close


@pytest.fixture
def sims() -> Iterator[list[Sim]]:
    """The rigs (tests/vllm_sim.py) a test made: closed at teardown (workers, then the scheduler)."""
    made: list[Sim] = []
    yield made
    for s in made:
        close(s)
