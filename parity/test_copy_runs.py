"""DECISIONS.md "Copy runs": ``drain_copy_runs`` is ``drain_copy_ops`` in column form — the
same drain, grouped by ``kvcm.api.copy_runs`` into runs whose ops commute (one batched copy
per run, runs in order)."""

from __future__ import annotations

import array
import dataclasses

import pytest
from kvcm import CopyOp, CopyRun, Tier
from kvcm.api import copy_runs

from parity.helpers import GPU, HOST, attn_cfg, fill, keys, toks

P = toks(16, base=100)
Q = toks(16, base=200)
R = toks(16, base=300)


def run(lc, src_tier, dst_tier, reason, src, dst, keys=None) -> CopyRun:
    """A CopyRun with its slot columns as int64 arrays."""
    return CopyRun(lc, src_tier, dst_tier, reason, array.array("q", src), array.array("q", dst), keys)


def _offloads(make_manager, gpu: int, host: int) -> list:
    """Two managers of the backend under test driven alike up to a drain with offloads: P
    fills the gpu, Q evicts it to host (and host drops what no longer fits)."""
    mgrs = [make_manager(attn_cfg(gpu=gpu, host=host)) for _ in range(2)]
    for m in mgrs:
        fill(m, P[: 4 * gpu])
        m.drain_copy_ops()
        kv = m.create_kv_cache()
        assert kv.resume() and kv.resize(4 * gpu)
    return mgrs


def test_runs_are_the_drain_grouped(make_manager):
    a, b = _offloads(make_manager, gpu=3, host=8)
    runs = a.drain_copy_runs()
    ops = b.drain_copy_ops()
    assert ops == [CopyOp(0, GPU, s, HOST, d, "offload") for s, d in ((2, 0), (1, 1), (0, 2))]
    assert runs == copy_runs(ops) == [run(0, GPU, HOST, "offload", [2, 1, 0], [0, 1, 2])]
    assert [op for r in runs for op in r.ops()] == ops
    assert len(runs[0]) == 3 and runs[0].keys is None
    assert runs[0].to_json() == [0, GPU, HOST, "offload", [2, 1, 0], [0, 1, 2]]
    # the same drain: nothing is left for either form
    assert a.drain_copy_ops() == [] and a.drain_copy_runs() == []
    a.check_invariants()


def test_a_slot_written_twice_starts_a_new_run(make_manager):
    # host holds one page: the second offload of the drain reuses the slot the first wrote
    # (the first's page was dropped to make room), so the two may not run as one batch
    a, b = _offloads(make_manager, gpu=2, host=1)
    ops = b.drain_copy_ops()
    assert ops == [CopyOp(0, GPU, 1, HOST, 0, "offload"), CopyOp(0, GPU, 0, HOST, 0, "offload")]
    runs = a.drain_copy_runs()
    assert runs == copy_runs(ops) == [run(0, GPU, HOST, "offload", [1], [0]),
                                      run(0, GPU, HOST, "offload", [0], [0])]
    a.check_invariants()


def _cows(make_manager, chained: bool) -> list:
    """Two managers driven alike to a drain of two copy-on-writes in the gpu pool: a match
    ending inside P's partial block copies it (cow), twice over.  ``chained``: the first
    copy's page becomes the tree's (a longer partial block) and the second copies it back
    into the slot the replaced page freed; else the first request closes and the second's
    copy lands in the slot the first one's freed."""
    mgrs = [make_manager(attn_cfg(gpu=6)) for _ in range(2)]
    for m in mgrs:
        fill(m, P[:6])
        m.drain_copy_ops()
        a = m.create_kv_cache(P[:7])
        assert a.num_reused_tokens == 6 and a.resume()
        if chained:
            assert a.resize(8)
            a.commit(P[6:7])
        a.close()
        b = m.create_kv_cache(P[:8] if chained else P[:7])
        assert b.num_reused_tokens == (7 if chained else 6) and b.resume()
    return mgrs


def test_one_pool_a_slot_written_twice_starts_a_new_run(make_manager):
    a, b = _cows(make_manager, chained=False)
    ops = b.drain_copy_ops()
    assert ops == [CopyOp(0, GPU, 1, GPU, 2, "cow")] * 2
    assert a.drain_copy_runs() == copy_runs(ops) == [run(0, GPU, GPU, "cow", [1], [2])] * 2
    a.check_invariants()


def test_one_pool_a_slot_the_run_wrote_or_read_starts_a_new_run(make_manager):
    # the second cow reads the slot the first wrote, and writes the one it read
    a, b = _cows(make_manager, chained=True)
    ops = b.drain_copy_ops()
    assert ops == [CopyOp(0, GPU, 1, GPU, 2, "cow"), CopyOp(0, GPU, 2, GPU, 1, "cow")]
    assert a.drain_copy_runs() == copy_runs(ops) == [run(0, GPU, GPU, "cow", [1], [2]),
                                                     run(0, GPU, GPU, "cow", [2], [1])]
    a.check_invariants()


def test_runs_split_where_reason_or_tiers_change(make_manager):
    # P to host (Q fills the gpu), then P matched and resumed: Q's pages go to host and P's
    # come back, alternating, in one drain
    a, b = (make_manager(attn_cfg(gpu=2, host=4)) for _ in range(2))
    for m in (a, b):
        fill(m, P[:8])
        fill(m, Q[:8])
        kv = m.create_kv_cache(P[:8])
        assert kv.num_reused_tokens == 8 and kv.resume()
    ops = b.drain_copy_ops()
    assert [(o.src_tier, o.src_slot, o.dst_tier, o.dst_slot, o.reason) for o in ops] == [
        (GPU, 1, HOST, 0, "offload"), (GPU, 0, HOST, 1, "offload"), (GPU, 0, HOST, 2, "offload"),
        (HOST, 1, GPU, 0, "onboard"), (GPU, 1, HOST, 1, "offload"), (HOST, 0, GPU, 1, "onboard")]
    runs = a.drain_copy_runs()
    assert runs == copy_runs(ops) == [
        run(0, GPU, HOST, "offload", [1, 0, 0], [0, 1, 2]),  # a slot read twice: no conflict
        run(0, HOST, GPU, "onboard", [1], [0]),
        run(0, GPU, HOST, "offload", [1], [1]),
        run(0, HOST, GPU, "onboard", [0], [1])]
    assert [op for r in runs for op in r.ops()] == ops
    a.check_invariants()


def test_forget_copies_takes_the_ops_of_a_run(make_manager):
    a, _ = _offloads(make_manager, gpu=3, host=8)
    run = a.drain_copy_runs()[0]
    assert a.forget_copies(run.ops()[:1]) == []  # the page it filled is forgotten
    with pytest.raises(ValueError):
        a.forget_copies(run.ops()[:1])  # already reported
    a.check_invariants()


def test_shared_tier_runs_carry_the_keys(make_manager):
    base = attn_cfg(gpu=6)
    cfg = dataclasses.replace(base, tiers=[*base.tiers, Tier("shared", 0, "/tmp/kvcm-parity-shared")],
                              shared_write="commit", shared_namespace="parity-model")
    a = make_manager(cfg)
    kv = a.create_kv_cache()
    assert kv.resume() and kv.resize(12)
    kv.commit(R[:12])
    k = keys(R[:12])
    runs = a.drain_copy_runs()
    assert runs == [run(0, GPU, 3, "store", [0, 1, 2], [-1, -1, -1], k)]
    assert runs[0].to_json()[-1] == [x.hex() for x in k]
    assert [o.key for o in runs[0].ops()] == k
    a.check_invariants()
