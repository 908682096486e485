"""The offload seam (kvcm.offload, issue 36 item 2): vLLM's OffloadingManager verbs over one
manager, the pool-less store client that answers its lookups, and the vLLM scheduler's
request tracker (its states and transitions).

Runs on the env-selected backend (``make_manager`` fixture)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvcm import AttentionLayer
from kvcm.dataplane import DataPlane, StoreClient
from kvcm.engine_loop import EngineLoop, ManagerLoop, PlaneLoop, config_from_layout
from kvcm.integrations.vllm.tracker import Life, RequestTracker, TrackerStateError
from kvcm.offload import Lookup, OffloadManager, PoolRoom, StoreSlots

B = 4
LAYERS = [AttentionLayer(0, 8), AttentionLayer(1, 8)]
PROMPT = list(range(100, 109))  # 2 full blocks and a partial one


def served(make_manager, cfg):
    """A first manager that wrote PROMPT's two full blocks to the store."""
    mgr = make_manager(cfg)
    loop = EngineLoop(mgr, DataPlane(cfg, dtype=torch.uint8))
    kv = loop.admit(PROMPT, capacity=len(PROMPT))
    kv.commit(PROMPT)
    loop.sync()
    kv.close()
    loop.sync()


def test_the_verbs_load_store_and_settle(make_manager, tmp_path):
    cfg = config_from_layout(B, LAYERS, gpu_blocks=8, shared=str(tmp_path / "store"), shared_namespace="seam")
    served(make_manager, cfg)
    client = StoreClient(cfg)
    mgr = make_manager(dataclasses.replace(cfg, copy_settlement="explicit"))
    seam = OffloadManager(ManagerLoop(mgr, lookups=[client]))
    prefix = PROMPT[:-1]
    before = mgr.snapshot()
    found = seam.lookup(prefix)  # no side effect: the store asked once
    assert found == Lookup(8, (3, 3), found.hits) and len(found.hits) == 2 and mgr.snapshot() == before
    assert client.shared_stats["lookups"] == 1
    assert seam.stored(seam.candidates(prefix)) == set(found.hits)
    kv = seam.prepare_load(prefix, None, found)
    assert kv is not None and kv.num_committed_tokens == 8 and client.shared_stats["lookups"] == 2  # lookup, stored: not asked again
    worker = PlaneLoop(DataPlane(cfg, dtype=torch.uint8))
    assert seam.complete_copies(worker.apply(seam.drain())) == []  # the onboards ran
    slots = seam.prepare_store(kv, 2, 3)
    assert isinstance(slots, StoreSlots) and [len(s) for s in slots.slots] == [1] and slots.slots[0][0][0] == 2
    seam.complete_store(kv, PROMPT[8:] + [7, 7, 7])
    assert kv.num_committed_tokens == 12
    seam.release(kv)
    seam.complete_copies(worker.apply(seam.drain()))
    assert isinstance(seam.take_events(), list)
    seam.reset()
    mgr.check_invariants()
    client.close()


def test_the_seam_over_a_whole_loop_runs_its_copies_at_once(make_manager):
    """Over an EngineLoop (an engine whose bytes move in its process: transformers, the
    reference engine) the seam's admission runs its copies before it answers."""
    cfg = config_from_layout(B, LAYERS, gpu_blocks=3, host_blocks=8)
    mgr = make_manager(cfg)
    plane = DataPlane(cfg, dtype=torch.uint8)
    seam = OffloadManager(EngineLoop(mgr, plane))
    for prompt in (PROMPT, list(range(200, 209))):  # the second takes the gpu: the first's pages go to host
        kv = seam.prepare_load(prompt, None, seam.lookup(prompt))
        assert seam.prepare_store(kv, 0, 3) is not None  # room for its blocks
        seam.complete_store(kv, prompt)
        seam.release(kv)
        seam.loop.sync()
    found = seam.lookup(PROMPT[:-1])
    assert found.tokens == 8 and found.block_tiers == (1, 1) and found.hits is None
    kv = seam.prepare_load(PROMPT[:-1], None, found)
    assert kv is not None and seam.drain() == []  # onboarded already
    seam.release(kv)
    seam.loop.sync()
    mgr.check_invariants()
    with pytest.raises(TypeError, match="ManagerLoop"):
        OffloadManager(mgr)


def test_the_verbs_of_an_engine_whose_tier_0_kvcm_allocates(make_manager):
    """The transformers integration's verbs: suspend (a preemption), fork (parallel
    sampling), sync (the copies now, over an EngineLoop), room (tier 0 per life cycle),
    prepare_store(exact=True) (the step's room, cut as well as grown)."""
    cfg = config_from_layout(B, LAYERS, gpu_blocks=4, host_blocks=8)
    mgr = make_manager(cfg)
    seam = OffloadManager(EngineLoop(mgr, DataPlane(cfg, dtype=torch.uint8)))
    assert seam.room() == (PoolRoom(4, 0, 0, 4),)
    kv = seam.prepare_load(PROMPT, None, seam.lookup(PROMPT), id="a")
    assert seam.prepare_store(kv, 0, 3, 0, tokens=len(PROMPT), exact=True) is not None
    seam.complete_store(kv, PROMPT)
    assert seam.room() == (PoolRoom(1, 0, 0, 4),)
    assert seam.prepare_store(kv, 2, 4, len(PROMPT), tokens=13, exact=True) is not None and kv.capacity == 13
    assert seam.prepare_store(kv, 2, 3, len(PROMPT), tokens=10, exact=True) is not None and kv.capacity == 10  # cut
    assert seam.prepare_store(kv, 2, 3, len(PROMPT), tokens=len(PROMPT)) is not None and kv.capacity == 10  # not cut
    seam.sync()
    child = seam.fork(kv, id="b")
    assert child is not None and child.id == "b" and child.num_committed_tokens == len(PROMPT)
    assert seam.prepare_store(child, 2, 3, len(PROMPT), tokens=10, exact=True) is not None  # the shared tail: a cow
    assert seam.sync() == [] and seam.room()[0].free == 0
    room = seam.room()
    assert seam.fork(kv, id="c") is None and seam.room() == room  # tier 0 cannot take its own pages: nothing changed
    seam.suspend(child)
    assert seam.room()[0].held > 0
    assert seam.touch(child) and seam.room()[0].held == 0
    for c in (kv, child):
        seam.release(c)
    seam.sync()
    mgr.check_invariants()
    with pytest.raises(TypeError, match="ManagerLoop"):
        OffloadManager(ManagerLoop(mgr)).sync()


def test_store_client_has_no_pools(tmp_path):
    cfg = config_from_layout(B, LAYERS, gpu_blocks=8, shared=str(tmp_path / "store"), shared_namespace="seam")
    client = StoreClient(cfg)
    assert client.shared is not None and client.codec is not None and not hasattr(client, "pools")
    assert client.shared_lookup([]) == []
    client.close()
    assert client.shared is None
    assert StoreClient(config_from_layout(B, LAYERS, gpu_blocks=8)).shared is None  # no shared tier


def test_store_client_opens_the_store_without_a_quota(tmp_path):
    """A lookup-only client asks; it never writes, so it opens the store without the tier's
    quota (a Mooncake client would otherwise mount that much memory as a segment, in which
    the store places other instances' objects); a data plane on the same config keeps it."""
    cfg = config_from_layout(B, LAYERS, gpu_blocks=8, shared=str(tmp_path / "store"), shared_namespace="seam",
                             shared_quota_bytes=1 << 20)
    client, plane = StoreClient(cfg), DataPlane(cfg, dtype=torch.uint8)
    try:
        assert client.shared.quota_bytes == 0 and plane.shared.quota_bytes == 1 << 20
    finally:
        client.close()
        plane.close()


def test_tracker_transitions_check_the_state():
    t = RequestTracker("r", None, object(), 1, committed=2, planned=2)
    assert t.life is Life.RUNNING and not t.stopped and not t.retiring
    t.plan_to(4)
    t.confirm(3, 4)
    assert t.taint(3) and t.planned == 3 and t.confirmed == set() and t.epoch == 1
    assert not t.taint(5)  # nothing planned past it
    t.confirm(2, 3)
    t.commit_to(3)
    assert t.committed == 3 and t.confirmed == set()
    assert t.stop() and not t.stop() and t.stopped
    with pytest.raises(TrackerStateError):
        t.plan_to(5)  # a stopped tracker plans no saves
    t.retire()
    assert t.retiring and t.life is Life.RETIRING
    with pytest.raises(TrackerStateError):
        t.retire()
    assert t.idle(0)
    assert t.close() is not None and t.kv is None and t.life is Life.CLOSED
    with pytest.raises(TrackerStateError):
        t.close()
    with pytest.raises(TrackerStateError):
        t.stop()
    never = RequestTracker("s", None, None, 2)
    assert never.stopped  # never admitted: saves nothing
    with pytest.raises(TrackerStateError):
        never.roll_back(0)
