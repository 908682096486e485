"""The data plane is composed, not stacked (issue 30 item 4): ``DataPlane`` is a facade over
objects -- the pools, the shared-tier I/O, the copy runs and their counters -- each given
its collaborators, and no part touches another's private names.  (Which part may import
which is the import contract ``data-plane`` in pyproject.toml.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATAPLANE = ROOT / "python" / "kvcm" / "dataplane"
PARTS = ("plane", "copy_runs", "shared_io", "slot_memory", "copy_stats")


def private_reaches(source: str) -> list[str]:
    """Every ``x._name`` whose ``x`` is not ``self`` (another object's private attribute),
    and every private name imported from another module, as ``"line: text"``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                out.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            out += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return sorted(out, key=lambda line: int(line.split(":")[0]))


@pytest.mark.parametrize("part", PARTS)
def test_no_part_reaches_into_another_objects_private_names(part):
    assert private_reaches((DATAPLANE / f"{part}.py").read_text()) == []


def test_the_guard_sees_a_cross_part_private_call():
    bad = "class A:\n    def f(self):\n        self._pools._tier(0)\n        return self._ok\nfrom m import _x\n"
    assert private_reaches(bad) == ["3: self._pools._tier", "5: from m import _x"]


def test_the_parts_are_objects_given_their_collaborators(tmp_path):
    pytest.importorskip("torch")
    from kvcm import AttentionLayer, KVCacheManagerConfig, Tier
    from kvcm.dataplane import DataPlane
    from kvcm.dataplane.copy_runs import CopyRuns
    from kvcm.dataplane.copy_stats import CopyStats
    from kvcm.dataplane.shared_io import SharedIO
    from kvcm.dataplane.slot_memory import SlotMemory

    # no part is another's base class any more: the facade holds them
    for cls in (SlotMemory, CopyRuns, SharedIO, CopyStats):
        assert not issubclass(DataPlane, cls)
    cfg = KVCacheManagerConfig(tokens_per_block=4, layers=[AttentionLayer(0, 8)],
                               tiers=[Tier("gpu", 8 * 32 * 4), Tier("shared", 0, str(tmp_path))], shared_namespace="parts")
    with DataPlane(cfg) as plane:
        assert isinstance(plane.slot_memory, SlotMemory) and isinstance(plane.copy_runs, CopyRuns)
        assert isinstance(plane.shared_io, SharedIO) and isinstance(plane.copy_stats, CopyStats)
        # the facade's state is the parts' (one object each, not copies)
        assert plane.pools is plane.slot_memory.grid and plane.shared is plane.shared_io.store
        assert plane.copies is plane.copy_stats.copies and plane.shared_stats is plane.shared_io.stats
        plane.fault = print
        assert plane.copy_runs.fault is print
        plane.shared_timeout_s = 2.5
        assert plane.shared_io.timeout_s == 2.5
    assert plane.shared is None and plane.pools == []
