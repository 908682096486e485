"""The router index is exact: after every step of a random multi-instance workload, over
real sockets (127.0.0.1), with lost messages healed by replay and router restarts healed by
snapshots, ``router.reuse(instance, prompt)`` equals what the instance's probe answers
counted in whole blocks (see ``kvcm.fleet.router_index``): with ``enable_partial_reuse=False`` that is
``instance.probe_reuse(prompt)`` itself; with partial reuse on it is
``probe_reuse(prompt[:L * B]) // B * B``, ``L`` the prompt's leading full blocks attached in
the instance's tree (read from its ``snapshot()``).  The probe of the whole prompt is not
floored: its walk may go on into a partial block the wire never carries, whose snapshot can
hold the match past a full-block snapshot, so no whole-block stream could give its floor.

``KVCM_EVENTS_EXAMPLES`` raises the number of Hypothesis examples (default 12 per config
and setting).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import kvcm
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcm import AttentionLayer, KVCacheManagerConfig, SsmLayer, Tier
from kvcm.fleet.publisher import EventPublisher
from kvcm.fleet.router_index import RouterIndex, RouterModel
from kvcm.fleet.subscriber import FleetSubscriber

B = 4
N = 2
EXAMPLES = int(os.environ.get("KVCM_EVENTS_EXAMPLES", "12"))
PARTIAL_EXAMPLES = EXAMPLES

LAYERS = {
    "hybrid": [AttentionLayer(0, 8), AttentionLayer(1, 8, window=9, sink_tokens=2), SsmLayer(2, 64)],
    "ssm": [SsmLayer(0, 64)],
    "window+ssm": [AttentionLayer(0, 8, window=6, sink_tokens=3), SsmLayer(1, 32)],
}


def config(name: str, gpu_pages: int = 14, host_pages: int = 6, partial: bool = False) -> KVCacheManagerConfig:
    layers = LAYERS[name]
    slot = sum(layer.bytes_per_token * B if isinstance(layer, AttentionLayer) else layer.state_bytes
               for layer in layers)
    return KVCacheManagerConfig(tokens_per_block=B, layers=layers,
                                tiers=[Tier("gpu", gpu_pages * slot), Tier("host", host_pages * slot)],
                                enable_partial_reuse=partial)


BASES = [[(7 * i + 3 * b) % 23 for i in range(40)] for b in range(3)]


@dataclass(frozen=True)
class Op:
    instance: int
    base: int
    length: int
    suffix: int
    chunk: int  # commit chunk: 4 ends on block boundaries (ssm snapshots), 3/5 mostly not
    keep_open: bool  # leave the request SUSPENDED (HELD pages)
    clear: bool  # clear_reusable afterwards
    drop: bool  # the router loses this step's message
    sync: bool  # the router catches up and is checked after this step
    restart: bool  # the router restarts (new index) before catching up


ops = st.builds(
    Op,
    instance=st.integers(0, N - 1), base=st.integers(0, 2), length=st.integers(1, 40),
    suffix=st.integers(0, 6), chunk=st.sampled_from([4, 4, 3, 5, 8]), keep_open=st.booleans(),
    clear=st.integers(0, 15).map(lambda x: x == 0), drop=st.integers(0, 3).map(lambda x: x == 0),
    sync=st.integers(0, 3).map(lambda x: x != 0), restart=st.integers(0, 12).map(lambda x: x == 0),
)


def prompt_of(op: Op) -> list[int]:
    return BASES[op.base][: op.length] + [100 + op.instance * 10 + i for i in range(op.suffix)]


def step(mgr: kvcm.KVCacheManager, op: Op, held: list, store: set | None = None) -> None:
    """One request of ``op``.  With a fleet ``store`` (a shared tier), the request reuses
    what the store holds and its store ops add to it (the data plane wrote them)."""
    p = prompt_of(op)
    hits = None if store is None else [c for c in mgr.shared_candidates(p) if c in store]
    kv = mgr.create_kv_cache(p, shared_hits=hits)
    if kv.resume() and kv.resize(len(p) + 1):
        n = kv.num_committed_tokens
        while n < len(p):
            kv.commit(p[n:n + op.chunk])
            n += op.chunk
        if op.keep_open:
            kv.suspend()
            held.append(kv)
        else:
            kv.close()
    else:
        kv.close()
    while len(held) > 2:
        held.pop(0).close()
    if op.clear:
        mgr.clear_reusable()
    if store is not None:
        store |= {(o.key, o.lc) for o in mgr.drain_copy_ops() if o.reason == "store"}


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


class Fleet:
    """N managers, each behind a publisher, and a router subscribed to all of them."""

    def __init__(self, cfg: KVCacheManagerConfig, ctx: zmq.Context, buffer_steps: int = 64) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.mgrs = [kvcm.KVCacheManager(cfg) for _ in range(N)]
        self.pubs = [EventPublisher(m, buffer_steps=buffer_steps, context=ctx) for m in self.mgrs]
        self.losing: set[int] = set()
        self.router, self.sub = self._subscribe()

    def _subscribe(self) -> tuple[RouterIndex, FleetSubscriber]:
        router = RouterIndex(RouterModel.from_config(self.cfg))
        sub = FleetSubscriber(router, {i: (p.endpoint, p.replay_endpoint) for i, p in enumerate(self.pubs)},
                              drop=self._drop, context=self.ctx, timeout=5.0)
        return router, sub

    def _drop(self, instance: int, seq: int) -> bool:
        if instance in self.losing:
            self.losing.discard(instance)
            return True
        return False

    def restart_router(self) -> None:
        self.sub.close()
        self.router, self.sub = self._subscribe()

    def catch_up(self) -> None:
        for p in self.pubs:
            assert p.flush()
        self.sub.sync({i: p.next_seq for i, p in enumerate(self.pubs)})

    def check(self, prompts: list[list[int]]) -> None:
        for i, m in enumerate(self.mgrs):
            if not self.cfg.enable_partial_reuse:
                for p in prompts:
                    assert self.router.reuse(i, p) == m.probe_reuse(p), (i, p, m.probe_reuse_detail(p))
                continue
            attached = {bytes.fromhex(n["key"]) for n in m.snapshot()["tree"]
                        if n["attached"] and not n["root"] and len(n["tokens"]) == B}
            for p in prompts:
                n = 0
                for k in self.router.keys(p):
                    if k not in attached:
                        break
                    n += 1
                want = m.probe_reuse(p[: n * B]) // B * B
                assert self.router.reuse(i, p) == want, (i, p, n, m.probe_reuse_detail(p[: n * B]))

    def close(self) -> None:
        self.sub.close()
        for p in self.pubs:
            p.close()


@pytest.mark.parametrize("name", list(LAYERS))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=st.lists(ops, min_size=1, max_size=25))
def test_router_answers_probe_reuse_after_every_step(ctx: zmq.Context, name: str, script: list[Op]) -> None:
    run_script(Fleet(config(name), ctx), script)


@pytest.mark.parametrize("name", list(LAYERS))
@settings(max_examples=PARTIAL_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=st.lists(ops, min_size=1, max_size=25))
def test_router_is_exact_with_partial_reuse_on(ctx: zmq.Context, name: str, script: list[Op]) -> None:
    """Partial reuse on: adopted pages of shorter coverage and coverage upgrades reach the
    router (``kvcm_coverage``, removed + stored), so it answers the whole-block reference."""
    run_script(Fleet(config(name, partial=True), ctx), script)


@pytest.mark.parametrize("name", list(LAYERS))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=st.lists(ops, min_size=1, max_size=25))
def test_router_is_exact_with_a_shared_tier(ctx: zmq.Context, name: str, script: list[Op]) -> None:
    """Instances share a store (DECISIONS.md "The shared tier"): blocks a request takes from
    it enter the tree on tier 3 (medium ``SHARED`` on the wire), are onboarded at resume
    (``tier_changed``) or unlinked when their request closes without resume."""
    cfg = config(name)
    cfg = dataclasses.replace(cfg, tiers=[*cfg.tiers, Tier("shared", 0, "/tmp/kvcm-router-shared")],
                              shared_namespace="router")
    run_script(Fleet(cfg, ctx), script, set())


def test_router_counts_blocks_taken_from_the_shared_tier(ctx: zmq.Context) -> None:
    """Instance 1 takes instance 0's prefill from the store: held on tier 3 (``SHARED``),
    then onboarded, then the request that held them closes."""
    cfg = config("hybrid", gpu_pages=40, host_pages=8)
    cfg = dataclasses.replace(cfg, tiers=[*cfg.tiers, Tier("shared", 0, "/tmp/kvcm-router-shared")],
                              shared_namespace="router")
    fleet = Fleet(cfg, ctx)
    store: set = set()
    try:
        p = BASES[0][:32]
        step(fleet.mgrs[0], Op(0, 0, 32, 0, 8, False, False, False, True, False), [], store)
        fleet.pubs[0].publish(fleet.mgrs[0].take_events())
        assert len(store) > 8
        m1 = fleet.mgrs[1]
        kv = m1.create_kv_cache(p, shared_hits=[c for c in m1.shared_candidates(p) if c in store])
        assert kv.num_reused_tokens == 32
        events = m1.take_events()
        assert {b.tier for e in events if e.kind == "stored" for b in e.blocks} == {3}
        fleet.pubs[1].publish(events)
        fleet.catch_up()
        fleet.check([p])
        assert fleet.router.reuse(1, p) == 32  # pages on the SHARED medium count
        assert kv.resume()  # onboarded: tier_changed 3 -> 0
        fleet.pubs[1].publish(m1.take_events())
        fleet.catch_up()
        fleet.check([p])
        assert fleet.router.reuse(1, p) == 32
        kv.close()
        # held on tier 3, then closed without resume: unlinked at once (removed on SHARED)
        q = BASES[2][:16]
        step(fleet.mgrs[0], Op(0, 2, 16, 0, 8, False, False, False, True, False), [], store)
        fleet.pubs[0].publish(fleet.mgrs[0].take_events())
        kv2 = m1.create_kv_cache(q, shared_hits=[c for c in m1.shared_candidates(q) if c in store])
        assert kv2.num_reused_tokens == 16
        fleet.pubs[1].publish(m1.take_events())
        fleet.catch_up()
        fleet.check([p, q])
        assert fleet.router.reuse(1, q) == 16
        kv2.close()
        fleet.pubs[1].publish(m1.take_events())
        fleet.catch_up()
        fleet.check([p, q])
        assert fleet.router.reuse(1, q) == 0
    finally:
        fleet.close()


def run_script(fleet: Fleet, script: list[Op], store: set | None = None) -> None:
    held: list[list] = [[] for _ in range(N)]
    try:
        probes = [b[:n] for b in BASES for n in (4, 9, 16, 24, 33, 40)]
        for op in script:
            step(fleet.mgrs[op.instance], op, held[op.instance], store)
            if op.drop:
                fleet.losing.add(op.instance)
            fleet.pubs[op.instance].publish(fleet.mgrs[op.instance].take_events())
            probes.append(prompt_of(op))
            if op.restart:
                fleet.restart_router()
            if op.sync:
                fleet.catch_up()
                fleet.check(probes)
        fleet.catch_up()
        fleet.check(probes)
    finally:
        for hs in held:
            for kv in hs:
                kv.close()
        fleet.close()


def test_lost_batches_older_than_the_replay_buffer_heal_by_snapshot(ctx: zmq.Context) -> None:
    fleet = Fleet(config("hybrid", gpu_pages=40, host_pages=8), ctx, buffer_steps=2)
    try:
        fleet.catch_up()
        before = fleet.sub.snapshots
        prompts = [b[:n] for b in BASES for n in (8, 20, 40)]
        fleet.sub.drop = lambda instance, seq: True  # lose everything live
        for i, p in enumerate(prompts):
            step(fleet.mgrs[0], Op(0, i % 3, len(p), 0, 4, False, False, False, True, False), [])
            fleet.pubs[0].publish(fleet.mgrs[0].take_events())
        fleet.catch_up()  # 9 batches missing, 2 buffered: replay falls short -> snapshot
        assert fleet.sub.dropped >= 1 and fleet.sub.snapshots > before and fleet.sub.replays >= 1
        fleet.check(prompts)
        assert any(fleet.router.reuse(0, p) > 0 for p in prompts)
    finally:
        fleet.close()


def test_hybrid_instance_with_evicted_snapshot_is_not_advertised_past_the_last_snapshot(ctx: zmq.Context) -> None:
    """Attention pages of the whole prompt remain, but the ssm snapshot at its end was
    evicted: the router must count only up to the last snapshot still held."""
    layers = LAYERS["hybrid"]
    cfg = KVCacheManagerConfig(
        tokens_per_block=B, layers=layers,
        tiers=[Tier("gpu", 64 * 8 * B + 64 * 8 * B + 4 * 64)],
        pool_ratio={0: 64 * 8 * B, 1: 64 * 8 * B, 2: 4 * 64},  # 64 attention pages each, 4 ssm slots
        enable_partial_reuse=False,
    )
    mgr = kvcm.KVCacheManager(cfg)
    with EventPublisher(mgr, context=ctx) as pub:
        router = RouterIndex(RouterModel.from_config(cfg))
        with FleetSubscriber(router, {"h": (pub.endpoint, pub.replay_endpoint)}, context=ctx) as sub:
            prompt = list(range(1, 17))  # 4 blocks
            kv = mgr.create_kv_cache(prompt)
            assert kv.resume() and kv.resize(16)
            kv.commit(prompt[:8])  # snapshot at the end of block 1
            kv.commit(prompt[8:16])  # snapshot at the end of block 3
            kv.close()
            pub.publish(mgr.take_events())
            pub.flush()
            sub.sync({"h": pub.next_seq})
            assert router.reuse("h", prompt) == mgr.probe_reuse(prompt) == 16
            # another prompt needs 3 ssm slots (live state + 2 snapshots) of the 4: one
            # snapshot is evicted (LRU); block 1's is touched first, so block 3's goes
            touch = mgr.create_kv_cache(prompt[:8])
            assert touch.num_reused_tokens == 8
            touch.close()
            for base in (100,):
                other = [base + i for i in range(8)]
                kv = mgr.create_kv_cache(other)
                assert kv.resume() and kv.resize(8)
                kv.commit(other[:4])
                kv.commit(other[4:])
                kv.close()
            pub.publish(mgr.take_events())
            pub.flush()
            sub.sync({"h": pub.next_seq})
            detail = mgr.probe_reuse_detail(prompt)
            assert detail.num_tokens_before_ssm == 16  # precondition: attention pages all remain
            assert detail.num_tokens == 8  # precondition: block 3's snapshot really was evicted
            assert router.reuse("h", prompt) == 8  # not advertised past the last snapshot
            assert router.reuse("h", prompt[:12]) == 8
        mgr.check_invariants()


def test_publisher_restart_on_the_same_endpoints_is_healed_by_snapshot(ctx: zmq.Context) -> None:
    cfg = config("hybrid", gpu_pages=40, host_pages=8)
    prompts = [b[:n] for b in BASES for n in (8, 20, 40)]
    m1 = kvcm.KVCacheManager(cfg)
    pub1 = EventPublisher(m1, context=ctx)
    router = RouterIndex(RouterModel.from_config(cfg))
    sub = FleetSubscriber(router, {"a": (pub1.endpoint, pub1.replay_endpoint)}, context=ctx)
    try:
        for i, p in enumerate(prompts):
            step(m1, Op(0, i % 3, len(p), 0, 4, False, False, False, True, False), [])
            pub1.publish(m1.take_events())
        assert pub1.flush()
        sub.sync({"a": pub1.next_seq})
        assert any(router.reuse("a", p) > 0 for p in prompts)
        endpoints = (pub1.endpoint, pub1.replay_endpoint)
        pub1.close()
        m2 = kvcm.KVCacheManager(cfg)  # the engine restarted: empty cache, sequence from 0
        pub2 = None
        for _ in range(100):  # the old sockets release their ports asynchronously
            try:
                pub2 = EventPublisher(m2, *endpoints, context=ctx)
                break
            except zmq.ZMQError:
                time.sleep(0.02)
        assert pub2 is not None
        try:
            step(m2, Op(0, 0, 12, 0, 4, False, False, False, True, False), [])
            pub2.publish(m2.take_events())
            assert pub2.flush()
            sub.sync({"a": pub2.next_seq})
            assert sub.restarts >= 1
            for p in prompts:
                assert router.reuse("a", p) == m2.probe_reuse(p)
            assert router.reuse("a", BASES[0][:12]) == 12
        finally:
            pub2.close()
    finally:
        sub.close()
        pub1.close()
