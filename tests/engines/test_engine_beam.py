"""Beam search is forks plus closes (issue 22, SPEC sec. 18): the reference engine keeps
k beams, forks a beam's cache for each extra child, prunes (closes) the rest, and its beams
equal — tokens exactly, scores within float32 round-off — a run that recomputes every beam's
whole sequence from scratch with no cache.

Runs on the env-selected backend (``backend`` fixture) with the tiny hybrid model (full
attention, a sliding window, an ssm layer): shared partial pages are copied on write, ssm
forks get their own live state, windowed blocks go stale under the beams.
"""

from __future__ import annotations

import pytest
import torch
from kvcm.engine import ModelConfig, TinyHybridModel, beam_search, reference_beam_search, torch_threads

B = 4  # tokens per block: the beams' last blocks are partial most steps
SCORE_TOL = 1e-4  # float32 round-off between the paged and the dense computation


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def model() -> TinyHybridModel:
    # a window of 8 tokens with 4 sinks: blocks go stale while the beams grow
    return TinyHybridModel(ModelConfig(window=8, sinks=4))


PROMPT = [5, 17, 3, 44, 9, 23, 61, 2, 30, 11]


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("tiers", ["gpu", "gpu-host-suspend"])
def test_beam_search_through_forks_equals_recomputing_each_beam(model, make_manager, width, tiers):
    steps = 11  # crosses block boundaries (snapshots, full blocks committed per beam)
    if tiers == "gpu":
        mgr = make_manager(model.manager_config(B, gpu_slots=64))
        got = beam_search(model, mgr, PROMPT, width, steps)
    else:  # every beam suspended between steps; a small gpu: shared pages go to host and back
        mgr = make_manager(model.manager_config(B, gpu_slots=12, host_slots=200))
        got = beam_search(model, mgr, PROMPT, width, steps, suspend_between_steps=True)
    want = reference_beam_search(model, PROMPT, width, steps)
    assert [b.seq for b in got] == [b.seq for b in want]
    assert max(abs(g.score - w.score) for g, w in zip(got, want)) < SCORE_TOL
    assert len({tuple(b.seq) for b in got}) == width  # distinct hypotheses
    stats = mgr.stats()
    cows = sum(lc["cows"] for lc in stats["lc"])
    if width > 1:
        assert cows > 0  # forks copied shared partial pages / live states
        if tiers != "gpu":
            assert sum(lc["offloads"] for lc in stats["lc"]) > 0
            assert sum(lc["onboards"] for lc in stats["lc"]) > 0
    mgr.check_invariants()
    assert mgr.snapshot()["requests"] == []  # every beam's cache closed


def test_reference_beams_differ_from_greedy(model):
    """The comparison is not vacuous: with 3 beams the best hypothesis is not only the
    greedy one, and the 3 beams descend from forks (different prefixes)."""
    beams = reference_beam_search(model, PROMPT, 3, 11)
    greedy, _ = model.reference_generate(PROMPT, 11)
    assert len({b.seq[len(PROMPT)] for b in beams}) > 1  # beams that branched at the first step
    assert beams[0].seq[len(PROMPT):] != greedy
    assert torch.isfinite(torch.tensor([b.score for b in beams])).all()
