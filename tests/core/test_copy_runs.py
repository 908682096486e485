"""kvcm.api.copy_runs, the grouping rule of drain_copy_runs (DECISIONS.md "Copy runs"), on op
lists no small scenario produces; the backends' drains are held to it in parity/test_copy_runs.py."""

from __future__ import annotations

import array

from kvcm.api import SHARED, CopyOp, CopyRun, copy_runs

K1, K2 = b"\x01" * 32, b"\x02" * 32


def run(lc, src_tier, dst_tier, reason, src, dst, keys=None) -> CopyRun:
    """A CopyRun with its slot columns as int64 arrays."""
    return CopyRun(lc, src_tier, dst_tier, reason, array.array("q", src), array.array("q", dst), keys)


def test_empty_drain_has_no_runs():
    assert copy_runs([]) == []


def test_consecutive_alike_ops_form_one_run_and_a_slot_may_be_read_twice():
    ops = [CopyOp(0, 0, 5, 1, 0, "offload"), CopyOp(0, 0, 5, 1, 1, "offload"), CopyOp(0, 0, 7, 1, 2, "offload")]
    assert copy_runs(ops) == [run(0, 0, 1, "offload", [5, 5, 7], [0, 1, 2])]


def test_lc_reason_or_tiers_change_starts_a_run():
    ops = [CopyOp(0, 0, 1, 1, 0, "offload"), CopyOp(1, 0, 1, 1, 0, "offload"), CopyOp(1, 1, 0, 0, 2, "onboard"),
           CopyOp(1, 0, 3, 0, 4, "cow"), CopyOp(1, 0, 5, 0, 6, "snapshot")]
    assert [len(r) for r in copy_runs(ops)] == [1, 1, 1, 1, 1]
    assert [op for r in copy_runs(ops) for op in r.ops()] == ops


def test_one_pool_hazards_split_but_distinct_slots_do_not():
    raw = [CopyOp(0, 0, 1, 0, 2, "cow"), CopyOp(0, 0, 2, 0, 3, "cow")]  # reads what the run wrote
    war = [CopyOp(0, 0, 1, 0, 2, "cow"), CopyOp(0, 0, 3, 0, 1, "cow")]  # writes what the run read
    waw = [CopyOp(0, 0, 1, 0, 2, "cow"), CopyOp(0, 0, 3, 0, 2, "cow")]  # writes what the run wrote
    fine = [CopyOp(0, 0, 1, 0, 2, "cow"), CopyOp(0, 0, 1, 0, 3, "cow")]  # one source, two copies
    assert [len(copy_runs(o)) for o in (raw, war, waw, fine)] == [2, 2, 2, 1]


def test_two_pools_only_a_destination_written_twice_splits():
    # gpu slot 2 is a source and host slot 2 a destination: different pools, no hazard
    ops = [CopyOp(0, 0, 2, 1, 2, "offload"), CopyOp(0, 0, 3, 1, 2, "offload")]
    assert copy_runs(ops[:1] + [CopyOp(0, 0, 2, 1, 3, "offload")]) == [
        run(0, 0, 1, "offload", [2, 2], [2, 3])]
    assert [len(r) for r in copy_runs(ops)] == [1, 1]


def test_shared_tier_locations_are_keys():
    stores = [CopyOp(0, 0, 1, SHARED, -1, "store", K1), CopyOp(0, 0, 2, SHARED, -1, "store", K2)]
    assert copy_runs(stores) == [run(0, 0, SHARED, "store", [1, 2], [-1, -1], [K1, K2])]
    again = [stores[0], CopyOp(0, 0, 2, SHARED, -1, "store", K1)]  # the same object written twice
    assert [r.keys for r in copy_runs(again)] == [[K1], [K1]]
    onboards = [CopyOp(0, SHARED, -1, 0, 4, "onboard", K1), CopyOp(0, SHARED, -1, 0, 5, "onboard", K1)]
    assert copy_runs(onboards) == [run(0, SHARED, 0, "onboard", [-1, -1], [4, 5], [K1, K1])]
    assert copy_runs(onboards)[0].ops() == onboards
