"""The engine loop (kvcm.engine_loop, issue 30): admission (shared lookup -> create -> resume ->
close on refusal) and copy settlement (drain -> apply -> report -> roll back) in one place,
usable whole or as halves (a side that admits and drains, a side that applies, the report
later), and the config an engine builds from its layout.  Also the data plane's adoption of
an engine's own memory (``DataPlane.adopt_memory``).

Runs on the env-selected backend (``backend`` fixture)."""

from __future__ import annotations

import errno

import pytest
import torch
from kvcm import AttentionLayer, KVCacheManagerConfig, SsmLayer
from kvcm.config import resolve_config
from kvcm.dataplane import DataPlane
from kvcm.engine_loop import EngineLoop, ManagerLoop, PlaneLoop, config_from_layout, page_bytes

B = 4
LAYERS = [AttentionLayer(0, 8), AttentionLayer(1, 8)]  # one life cycle, 64-byte pages
PROMPT_A = list(range(100, 109))  # 2 full blocks and a partial one
PROMPT_B = list(range(200, 209))


def config(gpu: int, host: int = 0, **kw) -> KVCacheManagerConfig:
    return config_from_layout(B, LAYERS, gpu_blocks=gpu, host_blocks=host, **kw)


def fail(reason: str, times: int = 1):
    """A data-plane fault hook failing the first ``times`` ops of ``reason``."""
    left = {"n": times}

    def hook(op) -> None:
        if op.reason == reason and left["n"] > 0:
            left["n"] -= 1
            raise OSError(errno.EIO, f"injected {reason} failure")

    return hook


def serve(loop: EngineLoop, prompt: list[int]) -> None:
    """One request through the loop: admitted, its prompt committed, closed."""
    kv = loop.admit(prompt, capacity=len(prompt))
    assert kv is not None
    kv.commit(prompt[kv.num_committed_tokens:])
    loop.sync()
    kv.close()
    loop.sync()


def offloaded_a(make_manager, plane_kw=None):
    """A manager (gpu 3 pages, host 8) whose prompt A's two full pages went to host; its plane."""
    mgr = make_manager(config(3, 8))
    plane = DataPlane(mgr.config, dtype=torch.uint8, **(plane_kw or {}))
    loop = EngineLoop(mgr, plane)
    serve(loop, PROMPT_A)
    serve(loop, PROMPT_B)  # takes the gpu: A's pages move to host
    assert plane.routes.get("gpu->host", 0) >= 2, plane.routes
    return mgr, plane


# ---------------------------------------------------------------------------------------
# config_from_layout
# ---------------------------------------------------------------------------------------


def test_config_from_layout_sizes_every_tier_in_pages_per_life_cycle(tmp_path):
    layers = [AttentionLayer(0, 64), AttentionLayer(1, 64, window=32, sink_tokens=4), SsmLayer(2, 1024),
              AttentionLayer(3, 64)]
    assert page_bytes(16, layers) == 3 * 64 * 16 + 1024
    cfg = config_from_layout(16, layers, gpu_blocks=10, host_blocks=4, disk_blocks=20, disk_path=str(tmp_path),
                             shared=str(tmp_path / "store"), shared_quota_bytes=5, shared_namespace="ns")
    assert [t.kind for t in cfg.tiers] == ["gpu", "host", "disk", "shared"]
    assert cfg.tiers[3].quota_bytes == 5 and cfg.shared_namespace == "ns"
    rc = resolve_config(cfg)
    assert [list(row) for row in rc.slots] == [[10] * 3, [4] * 3, [20] * 3]  # n pages of every life cycle
    only_gpu = config_from_layout(16, layers, gpu_blocks=3)
    assert [t.kind for t in only_gpu.tiers] == ["gpu"] and only_gpu.tiers[0].quota_bytes == 3 * page_bytes(16, layers)
    with pytest.raises(TypeError, match="AttentionLayer or an SsmLayer"):
        page_bytes(16, [object()])


def test_the_reference_engine_builds_its_config_from_its_layout(tmp_path):
    """``TinyHybridModel.manager_config`` is ``config_from_layout`` of its layers: the same
    quotas as the formula it replaced (slots per life cycle times the bytes of one slot each)."""
    from kvcm.engine import TinyHybridModel

    model = TinyHybridModel()
    cfg = model.manager_config(16, 30, host_slots=8, disk_slots=12, disk_path=str(tmp_path), shared_namespace="x")
    per_slot = sum(layer.bytes_per_token * 16 if isinstance(layer, AttentionLayer) else layer.state_bytes
                   for layer in model.layer_specs())
    assert [(t.kind, t.quota_bytes) for t in cfg.tiers] == [("gpu", 30 * per_slot), ("host", 8 * per_slot),
                                                           ("disk", 12 * per_slot)]
    assert [t.kind for t in model.manager_config(16, 30, host_slots=None).tiers] == ["gpu"]


# ---------------------------------------------------------------------------------------
# admission and sync
# ---------------------------------------------------------------------------------------


def test_admission_refused_closes_the_request_and_changes_nothing_else(make_manager):
    mgr = make_manager(config(3))
    loop = EngineLoop(mgr, DataPlane(mgr.config, dtype=torch.uint8))
    kv = loop.admit(PROMPT_A, capacity=len(PROMPT_A))  # 3 pages: the whole gpu
    assert kv is not None and kv.status.name == "ACTIVE" and kv.capacity == len(PROMPT_A)
    before = mgr.snapshot()
    assert loop.admit(PROMPT_B, capacity=len(PROMPT_B)) is None  # no room: closed, nothing held
    after = mgr.snapshot()
    assert [r["id"] for r in after["requests"]] == [r["id"] for r in before["requests"]]
    assert after["pools"] == before["pools"]
    assert loop.counters["refused"] == 1
    kv.close()
    loop.sync()
    mgr.check_invariants()


def test_a_failed_onboard_at_admission_is_forgotten_and_admitted_again(make_manager):
    """Prompt A's pages are on host; the first onboard fails: the manager forgets that page
    and rolls the new request back (``on_rollback``), the loop resumes it again from the
    shorter match, and it comes back ACTIVE with the pages it can trust."""
    mgr, plane = offloaded_a(make_manager)
    rolled: list = []
    loop = EngineLoop(mgr, plane, on_rollback=rolled.append)
    plane.fault = fail("onboard")
    kv = loop.admit(PROMPT_A[:-1], capacity=len(PROMPT_A))
    assert kv is not None and kv.status.name == "ACTIVE"
    assert rolled == [kv.id] and loop.counters["rollbacks"] == 1 and loop.counters["copy_failures"] == 1
    assert loop.last_error is not None and isinstance(loop.last_error.cause, OSError)
    assert kv.num_committed_tokens == 0  # the first block's page was lost: nothing before it to keep
    assert sum(lc["lost_pages"] for lc in mgr.stats()["lc"]) >= 1
    kv.close()
    loop.sync()
    mgr.check_invariants()


def test_the_halves_do_what_sync_does(make_manager):
    """A scheduler side (``ManagerLoop``: admits without syncing, drains), a worker side
    (``PlaneLoop``: applies) and the report back: the same roll-back and the same manager
    state as the one-sided loop; neither side takes None for the other."""
    whole_mgr, whole_plane = offloaded_a(make_manager)
    whole = EngineLoop(whole_mgr, whole_plane)
    whole_plane.fault = fail("onboard")
    kv = whole.create(PROMPT_A[:-1])
    assert kv.resume()
    assert whole.sync() == [kv.id]

    mgr, plane = offloaded_a(make_manager)
    scheduler, worker = ManagerLoop(mgr), PlaneLoop(plane)
    plane.fault = fail("onboard")
    kv2 = scheduler.admit(PROMPT_A[:-1])
    assert kv2 is not None
    runs = scheduler.drain()
    failed = worker.apply(runs)
    assert failed and worker.counters["copy_failures"] == 1
    assert scheduler.report(failed) == [kv2.id]
    assert mgr.snapshot() == whole_mgr.snapshot()
    assert not hasattr(scheduler, "apply") and not hasattr(worker, "drain")
    assert worker.apply([]) == []
    with pytest.raises(TypeError, match="manager is required"):
        ManagerLoop(None)
    with pytest.raises(TypeError, match="data plane is required"):
        PlaneLoop(None)


def test_admission_asks_the_shared_store_once(make_manager, tmp_path):
    """With a shared tier, the second manager's admission finds the first one's blocks in the
    store (one batched lookup) and onboards them."""
    store = str(tmp_path / "store")
    cfg = config(8, shared=store, shared_namespace="engine-loop-test")
    first_mgr = make_manager(cfg)
    first = EngineLoop(first_mgr, DataPlane(cfg, dtype=torch.uint8))
    serve(first, PROMPT_A)
    second_plane = DataPlane(cfg, dtype=torch.uint8)
    second = EngineLoop(make_manager(cfg), second_plane)
    kv = second.admit(PROMPT_A, capacity=len(PROMPT_A))
    assert second.last_shared_hits == 2 and second.counters["shared_hits"] == 2
    assert kv.num_committed_tokens == 8 and second_plane.shared_stats["lookups"] == 1
    assert second_plane.routes.get("shared->gpu") == 2
    kv.close()
    second.sync()
    assert ManagerLoop(first_mgr).shared_hits(PROMPT_A) is None  # nothing to ask: no lookup


def test_probe_changes_nothing_and_admission_takes_its_hits(make_manager, tmp_path):
    """An engine that asks before it admits (vLLM's scheduler): ``probe`` asks the store and
    answers what ``create`` would match, changing nothing in the manager; ``admit`` with the
    probe's hits holds exactly that and does not ask the store again."""
    store = str(tmp_path / "store")
    cfg = config(8, shared=store, shared_namespace="engine-loop-probe")
    serve(EngineLoop(make_manager(cfg), DataPlane(cfg, dtype=torch.uint8)), PROMPT_A)
    mgr = make_manager(cfg)
    plane = DataPlane(cfg, dtype=torch.uint8)
    scheduler = ManagerLoop(mgr, lookups=[plane])
    before = mgr.snapshot()
    probe, hits = scheduler.probe(PROMPT_A)
    again, same = scheduler.probe(PROMPT_A, shared_hits=hits)  # the first answer, not asked again
    assert mgr.snapshot() == before and plane.shared_stats["lookups"] == 1
    assert probe.num_tokens == again.num_tokens == 8 and list(probe.block_tiers) == [3, 3] and same == hits
    kv = scheduler.admit(PROMPT_A, shared_hits=hits)
    assert kv is not None and kv.num_committed_tokens == probe.num_tokens
    assert plane.shared_stats["lookups"] == 1 and scheduler.last_shared_hits == len(hits) == 2
    assert ManagerLoop(mgr).probe(PROMPT_B)[1] is None  # nothing to ask: no hits
    worker = PlaneLoop(plane)
    assert scheduler.report(worker.apply(scheduler.drain())) == []
    kv.close()
    scheduler.report(worker.apply(scheduler.drain()))
    mgr.check_invariants()


def test_a_block_is_a_shared_hit_only_when_every_lookup_plane_holds_it(make_manager, tmp_path):
    """``lookup_planes`` (one per tensor-parallel rank, each naming objects with its rank):
    the store's hits are the blocks every plane holds, in candidate order."""
    import dataclasses

    store = str(tmp_path / "store")
    cfg = config(8, shared=store, shared_namespace="engine-loop-tp")
    rank = [dataclasses.replace(cfg, shared_namespace=f"engine-loop-tp/r{r}") for r in (0, 1)]
    serve(EngineLoop(make_manager(rank[0]), DataPlane(rank[0], dtype=torch.uint8)), PROMPT_A)  # 2 blocks
    serve(EngineLoop(make_manager(rank[1]), DataPlane(rank[1], dtype=torch.uint8)), PROMPT_A[:5])  # block 0
    planes = [DataPlane(c, dtype=torch.uint8) for c in rank]
    mgr = make_manager(cfg)
    both = ManagerLoop(mgr, lookups=planes)
    cand = mgr.shared_candidates(PROMPT_A)
    assert len(planes[0].shared_lookup(cand)) == 2
    assert both.shared_hits(PROMPT_A) == cand[:1] and both.lookups == planes
    assert both.probe(PROMPT_A)[0].num_tokens == B
    with pytest.raises(ValueError, match="not both"):
        EngineLoop(mgr, planes[0], lookup_plane=planes[0], lookup_planes=planes)


@pytest.mark.skipif("copy_settlement" not in KVCacheManagerConfig.__dataclass_fields__,
                    reason="KVCacheManagerConfig.copy_settlement (settle_copies) is not in this tree yet")
def test_explicit_settlement_settles_every_drain(make_manager):
    import dataclasses

    mgr = make_manager(dataclasses.replace(config(3, 8), copy_settlement="explicit"))
    plane = DataPlane(mgr.config, dtype=torch.uint8)
    loop = EngineLoop(mgr, plane)
    serve(loop, PROMPT_A)
    serve(loop, PROMPT_B)
    plane.fault = fail("onboard")
    kv = loop.admit(PROMPT_A[:-1], capacity=len(PROMPT_A))
    assert kv is not None and loop.counters["rollbacks"] == 1
    assert mgr.unsettled_drains == 0
    kv.close()
    loop.sync()
    mgr.check_invariants()


# ---------------------------------------------------------------------------------------
# DataPlane.adopt_memory
# ---------------------------------------------------------------------------------------


def test_adopted_memory_is_the_pool_copies_move(make_manager):
    cfg = config(3, 8)
    plane = DataPlane(cfg, dtype=torch.uint8)
    mine = torch.zeros((3, page_bytes(B, LAYERS)), dtype=torch.uint8)
    plane.adopt_memory("gpu", 0, mine)
    assert plane.pool("gpu", 0) is mine
    mgr = make_manager(cfg)
    loop = EngineLoop(mgr, plane)
    kv = loop.admit(PROMPT_A, capacity=len(PROMPT_A))
    slots = kv.page_indices(0)
    for i, s in enumerate(slots):  # the engine writes its K/V into its own memory
        mine[s] = i + 1
    kv.commit(PROMPT_A)
    loop.sync()
    kv.close()
    loop.sync()
    serve(loop, PROMPT_B)  # A's full pages are offloaded from the engine's memory to host
    host = plane.pool("host", 0)
    assert plane.routes.get("gpu->host", 0) >= 2
    assert sorted(int(row[0]) for row in host if row.any())[:2] == [1, 2]


@pytest.mark.parametrize("tier,lc,memory,err", [
    ("gpu", 0, torch.zeros((3, 63), dtype=torch.uint8), ValueError),  # a slot is 64 bytes
    ("gpu", 0, torch.zeros((2, 64), dtype=torch.uint8), ValueError),  # 3 slots
    ("gpu", 0, torch.zeros((3, 64), dtype=torch.int16), ValueError),
    ("gpu", 0, torch.zeros((64, 3), dtype=torch.uint8).t(), ValueError),  # slots not contiguous
    ("gpu", 1, torch.zeros((3, 64), dtype=torch.uint8), ValueError),  # no lc 1
    ("gpu", True, torch.zeros((3, 64), dtype=torch.uint8), ValueError),
    ("disk", 0, torch.zeros((3, 64), dtype=torch.uint8), ValueError),
    ("gpu", 0, bytearray(192), TypeError),
])
def test_adopt_memory_refuses_bad_input_and_changes_nothing(tmp_path, tier, lc, memory, err):
    cfg = config_from_layout(B, LAYERS, gpu_blocks=3, disk_blocks=4, disk_path=str(tmp_path))
    plane = DataPlane(cfg, dtype=torch.uint8)
    try:
        before = [list(row) for row in plane.pools]
        with pytest.raises(err):
            plane.adopt_memory(tier, lc, memory)
        assert [list(row) for row in plane.pools] == before
    finally:
        plane.close()


def test_a_copy_that_keeps_failing_ends_the_admission_after_three_attempts(make_manager):
    """A request whose match ends on an ssm snapshot gets its live state copied from it
    (``cow``); when that copy keeps failing, each roll-back re-matches the same prefix, so the
    loop gives up after ``RESUME_ATTEMPTS`` and the admission is refused (closed): the engine
    tries again later."""
    layers = [AttentionLayer(0, 8), SsmLayer(1, 16)]
    mgr = make_manager(config_from_layout(B, layers, gpu_blocks=8))
    plane = DataPlane(mgr.config, dtype=torch.uint8)
    loop = EngineLoop(mgr, plane)
    kv = loop.admit(PROMPT_A, capacity=len(PROMPT_A))
    for i in range(0, 8, B):  # commits ending on block boundaries: snapshots
        kv.commit(PROMPT_A[i:i + B])
        loop.sync()
    kv.close()
    loop.sync()
    plane.fault = fail("cow", times=10**6)
    before = mgr.snapshot()["requests"]
    assert loop.admit(PROMPT_A[:-1]) is None
    assert loop.counters["rollbacks"] == EngineLoop.RESUME_ATTEMPTS and loop.counters["refused"] == 1
    assert mgr.snapshot()["requests"] == before  # closed: nothing of it is left open
    plane.fault = None
    kv = loop.admit(PROMPT_A[:-1])  # the copy works again: admitted from the snapshot
    assert kv is not None and kv.num_committed_tokens == 8
    kv.close()
    loop.sync()
    mgr.check_invariants()


def test_retry_is_the_one_admission_retry(make_manager):
    """``ManagerLoop.retry``: an engine's own attempt (the reference engine's prefill-aware
    one) tried again while it answers None (rolled back), bounded by ``RESUME_ATTEMPTS`` unless
    the engine asks for no bound; its first True or False is the answer."""
    loop = ManagerLoop(make_manager(config(3)))
    answers = iter([None, None, True])
    assert loop.retry(lambda: next(answers)) is True
    calls = []
    assert loop.retry(lambda: calls.append(1)) is False and len(calls) == ManagerLoop.RESUME_ATTEMPTS
    answers = iter([None] * 7 + [False])
    assert loop.retry(lambda: next(answers), attempts=None) is False
