"""SPEC sec. 16: events on the wire.

``test_wire_payloads_are_byte_identical[cpp]`` drives a python and a cpp manager through
the same op sequence, each behind an ``EventPublisher`` on real sockets (127.0.0.1), and
compares every published payload byte for byte, and the snapshot answer ([python]: two
python managers, which catches nondeterminism).  ``ts`` is the step number and the
publisher's instance identity is given (its default is random per life), so nothing
wall-clock- or chance-dependent is on the wire.
"""

from __future__ import annotations

import kvcm
import zmq
from events_client import replay_request
from kvcm import AttentionLayer, KVCacheManagerConfig, ReuseScope, SsmLayer, Tier
from kvcm.fleet.publisher import EventPublisher
from kvcm.fleet.router_index import RouterIndex, RouterModel
from kvcm.fleet.wire import SNAPSHOT_REQUEST, BlockRemoved, BlockStored, Decoder, seq_bytes

from parity.helpers import B, keys, ssm_cfg, toks

SLOT = 8 * B + 8 * B + 64
DIGEST = bytes(range(32))


def hybrid_config() -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=B,
        layers=[AttentionLayer(0, 8), AttentionLayer(1, 8, window=9, sink_tokens=2), SsmLayer(2, 64)],
        tiers=[Tier("gpu", 6 * SLOT), Tier("host", 4 * SLOT)],
    )


def workload(mgr: kvcm.KVCacheManager, pub: EventPublisher) -> None:
    """Stores, snapshots, offloads, drops, partial tails, scopes, digests, a held request,
    clear_reusable: one ``publish`` per step."""
    scope = ReuseScope(lora_id=3, salt=11)
    held = None
    prompts = [(toks(10, 100), None), (toks(8, 200), scope), ([1, DIGEST, 2, 3, 4, 5, 6, 7], None),
               (toks(12, 300), None), (toks(10, 100) + toks(6, 900), None), (toks(16, 400), scope)]
    for i, (p, s) in enumerate(prompts):
        kv = mgr.create_kv_cache(p, s)
        if kv.resume() and kv.resize(len(p)):
            n = kv.num_committed_tokens
            while n < len(p):
                kv.commit(p[n:n + 4])
                n += 4
        if i == 1:
            kv.suspend()
            held = kv
        else:
            kv.close()
        pub.publish(mgr.take_events())
    mgr.clear_reusable()
    pub.publish(mgr.take_events())
    assert held is not None
    held.close()
    pub.publish(mgr.take_events())




def published(backend: str, ctx: zmq.Context) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
    mgr = kvcm.KVCacheManager(hybrid_config(), backend=backend)
    # a fixed instance identity: the default is random per publisher life
    with EventPublisher(mgr, context=ctx, scopes=[ReuseScope(lora_id=3, salt=11)], instance=b"parity") as pub:
        workload(mgr, pub)
        assert pub.flush()
        batches = replay_request(ctx, pub, seq_bytes(0))
        snapshot = replay_request(ctx, pub, SNAPSHOT_REQUEST)
    mgr.check_invariants()
    mgr.shutdown()
    return batches, snapshot


def test_wire_payloads_are_byte_identical(backend: str) -> None:
    ctx = zmq.Context()
    try:
        ref_batches, ref_snap = published("python", ctx)
        got_batches, got_snap = published(backend, ctx)
    finally:
        ctx.destroy(linger=0)
    assert [s for s, _ in ref_batches] == list(range(len(ref_batches))) and len(ref_batches) >= 7
    assert got_batches == ref_batches
    assert got_snap == ref_snap and ref_snap[0][0] == len(ref_batches)
    kinds = {type(e).__name__ for _, p in ref_batches for e in Decoder().decode(p).events}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    media = {e.medium for _, p in ref_batches for e in Decoder().decode(p).events if isinstance(e, BlockStored)}
    assert media == {"GPU", "CPU"}


def test_wire_first_events_of_a_prompt(make_manager) -> None:
    """A 10-token prompt committed in chunks of 4: two full blocks announced per life cycle,
    chained by parent hash; the partial tail is not announced."""
    mgr = make_manager(hybrid_config())
    ctx = zmq.Context()
    try:
        with EventPublisher(mgr, context=ctx) as pub:
            p = toks(10, 100)
            kv = mgr.create_kv_cache(p)
            assert kv.resume() and kv.resize(10)
            kv.commit(p[:4])
            kv.commit(p[4:8])
            kv.commit(p[8:])
            kv.close()
            pub.publish(mgr.take_events())
            assert pub.flush()
            [(seq, payload)] = replay_request(ctx, pub, seq_bytes(0))
    finally:
        ctx.destroy(linger=0)
    k = keys(p)
    batch = Decoder().decode(payload)
    assert seq == 0 and batch.ts == 0.0
    assert [(e.block_hashes, e.parent_block_hash, e.group_idx, e.medium) for e in batch.events] == [
        ([k[0]], None, 0, "GPU"), ([k[0]], None, 1, "GPU"), ([k[0]], None, 2, "GPU"),
        ([k[1]], k[0], 0, "GPU"), ([k[1]], k[0], 1, "GPU"), ([k[1]], k[0], 2, "GPU"),
    ]
    assert not any(isinstance(e, BlockRemoved) for e in batch.events)
    mgr.check_invariants()


def test_wire_coverage_of_adopted_page_and_upgrade(make_manager) -> None:
    """Partial reuse on (DECISIONS "Tree and events", "Events on the wire"): a full block that
    adopts a partial sibling's coverage-2 snapshot is announced with ``kvcm_coverage=2`` and
    the router stops its match at block start + 2 (whole blocks: 4); the snapshot's upgrade
    to coverage 4 is ``removed`` + ``stored`` in kvcm events and ``BlockRemoved`` +
    ``BlockStored`` (no ``kvcm_coverage``: whole block) on the wire, and the router then
    counts the block."""
    cfg = ssm_cfg(gpu=8)
    mgr = make_manager(cfg)
    p = toks(12, 100)
    k = keys(p)
    router = RouterIndex(RouterModel.from_config(cfg))
    ctx = zmq.Context()
    try:
        with EventPublisher(mgr, context=ctx) as pub:
            a = mgr.create_kv_cache()
            assert a.resume() and a.resize(6)
            a.commit(p[:6])
            a.stop_committing()
            a.close()  # partial block 1 (2 tokens) with a coverage-2 snapshot
            # the probe's walk goes on into the partial block; the whole-block prefix has no snapshot
            assert (mgr.probe_reuse(p[:8]), mgr.probe_reuse(p[:4]), router.reuse("a", p[:8])) == (6, 0, 0)
            pub.publish(mgr.take_events())
            b = mgr.create_kv_cache(p[:12])
            assert b.resume() and b.resize(12)
            b.commit(p[6:12])  # block 1 adopts the coverage-2 snapshot
            b.close()
            ev = mgr.take_events()
            assert [(blk.lc, blk.coverage) for e in ev if e.kind == "stored" for blk in e.blocks
                    if blk.key == k[1]] == [(0, 2)]
            pub.publish(ev)
            probe_b = mgr.probe_reuse(p[:8])
            c = mgr.create_kv_cache()
            assert c.resume() and c.resize(8)
            c.commit(p[:8])  # coverage 4 replaces the adopted snapshot
            c.close()
            ev = mgr.take_events()
            assert [(e.kind, e.keys if e.kind == "removed" else [(x.key, x.lc, x.coverage) for x in e.blocks])
                    for e in ev] == [("removed", (k[1],)), ("stored", [(k[1], 0, 4)])]
            pub.publish(ev)
            assert pub.flush()
            batches = [Decoder().decode(pl) for _, pl in replay_request(ctx, pub, seq_bytes(0))]
    finally:
        ctx.destroy(linger=0)
    assert len(batches) == 2  # the first step announced nothing (a page-less block, a partial one)
    adopted = [e for e in batches[0].events if isinstance(e, BlockStored) and e.block_hashes == [k[1]]]
    assert [(e.parent_block_hash, e.group_idx, e.medium, e.kvcm_coverage) for e in adopted] == [(k[0], 0, "GPU", 2)]
    router.instance("a").apply(batches[0].events)
    assert probe_b == 6 and router.reuse("a", p[:8]) == 4  # block start + 2, floored
    upgrade = [(type(e).__name__, e.block_hashes, e.group_idx, e.medium, getattr(e, "kvcm_coverage", None))
               for e in batches[1].events]
    assert upgrade == [("BlockRemoved", [k[1]], 0, "GPU", None), ("BlockStored", [k[1]], 0, "GPU", None)]
    router.instance("a").apply(batches[1].events)
    assert mgr.probe_reuse(p[:8]) == router.reuse("a", p[:8]) == 8
    mgr.check_invariants()
