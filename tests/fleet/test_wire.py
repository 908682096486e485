"""The wire mapping of kvcm events to vLLM's KVEventBatch (kvcm.fleet.wire, kvcm.fleet.wire_state); no sockets.

vLLM's structs are transcribed below exactly as ``vllm/distributed/kv_events.py`` declares
them (v0.28 map layout: positional batch, tagged map events; and the pre-#42892 array
layout), so "vLLM's own subscriber code decodes it" is checked with vLLM's definitions,
not with kvcm's.
"""

# (no "from __future__ import annotations": msgspec must see the local struct classes)

from typing import Any

import kvcm
import msgspec
import pytest
from kvcm import AttentionLayer, KVCacheManagerConfig, ReuseScope, SsmLayer, Tier
from kvcm.fleet.wire import AllBlocksCleared, BlockRemoved, BlockStored, Decoder, Encoder
from kvcm.fleet.wire_state import DIGEST_PLACEHOLDER, WireState, scope_root_key

B = 4
SLOT = 8 * B + 8 * B + 64  # one page of each life cycle of HYBRID


def _vllm(array_like: bool) -> Any:
    """vLLM's event structs (fields, order, defaults, struct options as vLLM declares them)."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
        pass

    class VBlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]

    return KVEventBatch


def hybrid(**kw: Any) -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=B,
        layers=[AttentionLayer(0, 8), AttentionLayer(1, 8, window=9, sink_tokens=2), SsmLayer(2, 64)],
        tiers=[Tier("gpu", 6 * SLOT), Tier("host", 6 * SLOT)],
        **kw,
    )


def run(mgr: kvcm.KVCacheManager, prompt: list, scope: ReuseScope | None = None, chunk: int = B) -> None:
    kv = mgr.create_kv_cache(prompt, scope)
    assert kv.resume() and kv.resize(len(prompt))
    n = kv.num_committed_tokens
    while n < len(prompt):
        kv.commit(prompt[n:n + chunk])
        n += chunk
    kv.close()


def state_for(mgr: kvcm.KVCacheManager, scopes: tuple = ()) -> WireState:
    st = WireState(mgr.life_cycles, B, scopes)
    st.load_snapshot(mgr.snapshot())
    return st


def test_batch_is_positional_and_events_are_tagged_maps_in_vllm_field_order() -> None:
    ev = BlockStored(block_hashes=[b"k" * 32], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                     lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention")
    raw = msgspec.msgpack.decode(Encoder("map", 0).encode(3.0, [ev, BlockRemoved([b"k" * 32], "GPU", 0),
                                                              AllBlocksCleared()]))
    assert raw[0] == 3.0 and raw[2] == 0 and len(raw) == 3
    stored, removed, cleared = raw[1]
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                            "medium", "lora_name", "group_idx", "kv_cache_spec_kind"]  # None defaults omitted
    assert stored["type"] == "BlockStored" and stored["lora_name"] is None  # no default: always on the wire
    assert removed == {"type": "BlockRemoved", "block_hashes": [b"k" * 32], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}
    arr = msgspec.msgpack.decode(Encoder("array", 0).encode(3.0, [ev]))
    assert arr[1][0][:9] == ["BlockStored", [b"k" * 32], None, [1, 2], 2, None, "GPU", None, None]


@pytest.mark.parametrize("layout", ["map", "array"])
def test_vllm_structs_decode_kvcm_payloads_and_ignore_the_extension(layout: str) -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    st = state_for(mgr)
    run(mgr, list(range(12)))
    wire = st.translate(mgr.take_events())
    payload = Encoder(layout, 0).encode(0.0, wire)
    batch = msgspec.msgpack.Decoder(type=_vllm(array_like=layout == "array")).decode(payload)
    ours = Decoder().decode(payload)
    assert len(batch.events) == len(ours.events) == len(wire)
    for v, k in zip(batch.events, ours.events, strict=True):
        assert type(v).__name__.lstrip("V") == type(k).__name__
        assert v.block_hashes == k.block_hashes and v.medium == k.medium and v.group_idx == k.group_idx
    windowed = [e for e in ours.events if e.kv_cache_spec_kind == "sliding_window"]
    assert windowed and all(e.kvcm_sink_tokens == 2 and e.kv_cache_spec_sliding_window == 9 for e in windowed)


def test_mapping_hash_parent_group_kind_medium() -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    st = state_for(mgr)
    prompt = list(range(10))  # two full blocks and a partial one
    run(mgr, prompt, chunk=4)
    keys = kvcm.block_keys(prompt, B)
    wire = st.translate(mgr.take_events())
    assert all(isinstance(e, BlockStored) for e in wire)
    announced = [(e.block_hashes, e.parent_block_hash, e.group_idx, e.kv_cache_spec_kind, e.medium) for e in wire]
    assert announced == [
        ([keys[0]], None, 0, "full_attention", "GPU"),
        ([keys[0]], None, 1, "sliding_window", "GPU"),
        ([keys[0]], None, 2, "mamba", "GPU"),  # commit ended on the boundary: a snapshot
        ([keys[1]], keys[0], 0, "full_attention", "GPU"),
        ([keys[1]], keys[0], 1, "sliding_window", "GPU"),
        ([keys[1]], keys[0], 2, "mamba", "GPU"),
    ]  # the partial third block (tokens 8, 9) is not announced
    assert all(e.token_ids == prompt[:4] for e in wire[:3]) and all(e.block_size == B for e in wire)
    assert set(st.announced()) == {(k, lc) for k in keys[:2] for lc in range(3)}


def test_tier_change_is_removed_then_stored_and_removed_names_the_medium() -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    st = state_for(mgr)
    for base in range(0, 400, 100):  # 4 x 2 blocks > 6 gpu slots: the oldest pages go to host
        run(mgr, list(range(base, base + 8)))
    wire = st.translate(mgr.take_events())
    moved = [(i, e) for i, e in enumerate(wire) if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert moved
    for i, e in moved:
        before = wire[i - 1]
        assert isinstance(before, BlockRemoved) and before.medium == "GPU"
        assert before.block_hashes == e.block_hashes and before.group_idx == e.group_idx
    assert any(t == kvcm.api.HOST for t in st.announced().values())
    mgr.clear_reusable()
    wire = st.translate(mgr.take_events())
    removed_media = {e.medium for e in wire if isinstance(e, BlockRemoved)}
    assert removed_media == {"GPU", "CPU"}
    assert isinstance(wire[-1], AllBlocksCleared) and st.announced() == {}


def test_cleared_restates_the_blocks_a_live_request_still_holds() -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    st = state_for(mgr)
    run(mgr, list(range(100, 108)))  # droppable after close
    kv = mgr.create_kv_cache(list(range(8)))
    assert kv.resume() and kv.resize(8)
    kv.commit(list(range(8)))  # LOCKED: survives clear_reusable
    st.translate(mgr.take_events())
    mgr.clear_reusable()
    wire = st.translate(mgr.take_events())
    i = next(i for i, e in enumerate(wire) if isinstance(e, AllBlocksCleared))
    assert all(isinstance(e, BlockRemoved) for e in wire[:i])
    restated = {(bytes(h), e.group_idx) for e in wire[i + 1:] for h in e.block_hashes}
    keys = kvcm.block_keys(list(range(8)), B)
    assert restated == {(k, lc) for k in keys for lc in (0, 1)}  # attention pages; no snapshot while LOCKED
    assert restated == set(st.announced())
    kv.close()


def test_scope_maps_to_lora_id_and_salt_and_first_blocks_have_no_parent() -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    scope = ReuseScope(lora_id=7, salt=99)
    st = state_for(mgr, (scope,))
    run(mgr, list(range(8)), scope)
    wire = st.translate(mgr.take_events())
    first = [e for e in wire if e.parent_block_hash is None]
    assert first and all(e.lora_id == 7 and e.extra_keys == [(("salt", 99),)] for e in first)
    rest = [e for e in wire if e.parent_block_hash is not None]
    assert rest and all(e.lora_id == 7 and e.extra_keys is None for e in rest)
    # an unregistered scope: its root key stands as the parent, lora unknown
    mgr2 = kvcm.KVCacheManager(hybrid())
    st2 = state_for(mgr2)
    run(mgr2, list(range(4)), ReuseScope(lora_id=3))
    wire2 = st2.translate(mgr2.take_events())
    assert wire2 and all(e.parent_block_hash == scope_root_key(ReuseScope(lora_id=3)) and e.lora_id is None
                         for e in wire2)


def test_digest_tokens_are_placeholders_named_in_extra_keys() -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    st = state_for(mgr)
    d = bytes(range(32))
    run(mgr, [1, d, 2, 3])
    wire = st.translate(mgr.take_events())
    assert wire and all(e.token_ids == [1, DIGEST_PLACEHOLDER, 2, 3] for e in wire)
    assert all(e.extra_keys == [(("digest", 1, d.hex()),)] for e in wire)


def test_restatement_after_reload_equals_the_stream_state_parents_first() -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    st = state_for(mgr)
    run(mgr, list(range(16)))
    run(mgr, list(range(8)) + [50, 51, 52, 53])
    st.translate(mgr.take_events())
    fresh = state_for(mgr)
    assert fresh.announced() == st.announced()
    seen: set[bytes] = set()
    for e in fresh.restatement()[1:]:
        parent = e.parent_block_hash
        assert parent is None or parent in seen
        seen.update(e.block_hashes)


@pytest.mark.parametrize("layout", ["map", "array"])
def test_adopted_page_carries_kvcm_coverage_and_the_upgrade_is_removed_then_stored(layout: str) -> None:
    """A full block adopting a partial sibling's coverage-2 snapshot is announced alone with
    ``kvcm_coverage=2`` (vLLM's structs decode it and ignore the field); a reload restates
    the same coverage; the upgrade to coverage 4 is BlockRemoved + BlockStored whole."""
    cfg = KVCacheManagerConfig(tokens_per_block=B, layers=[SsmLayer(0, 16)], tiers=[Tier("gpu", 8 * 16)])
    mgr = kvcm.KVCacheManager(cfg)
    st = WireState(mgr.life_cycles, B)
    p = list(range(100, 112))
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(6)
    a.commit(p[:6])
    a.stop_committing()
    a.close()
    b = mgr.create_kv_cache(p)
    assert b.resume() and b.resize(12)
    b.commit(p[6:12])
    b.close()
    wire = st.translate(mgr.take_events())
    k = kvcm.block_keys(p, B)
    covered = [(e.block_hashes, e.kvcm_coverage) for e in wire if isinstance(e, BlockStored)]
    assert ([k[1]], 2) in covered and all(c in (None, 2) for _, c in covered)
    assert all(len(h) == 1 for h, c in covered if c is not None)
    payload = Encoder(layout, 0).encode(0.0, wire)
    vllm = msgspec.msgpack.Decoder(type=_vllm(array_like=layout == "array")).decode(payload)
    assert [e.block_hashes for e in vllm.events] == [e.block_hashes for e in wire]
    assert [getattr(e, "kvcm_coverage", None) for e in Decoder().decode(payload).events] == \
        [getattr(e, "kvcm_coverage", None) for e in wire]
    restated = [(e.block_hashes, e.kvcm_coverage) for e in state_for(mgr).restatement()[1:]]
    assert restated == [(e.block_hashes, e.kvcm_coverage) for e in st.restatement()[1:]]
    assert ([k[1]], 2) in restated
    c = mgr.create_kv_cache()
    assert c.resume() and c.resize(8)
    c.commit(p[:8])
    c.close()
    wire = st.translate(mgr.take_events())
    assert [(type(e).__name__, e.block_hashes, getattr(e, "kvcm_coverage", None)) for e in wire] == [
        ("BlockRemoved", [k[1]], None), ("BlockStored", [k[1]], None)]
    assert [(e.block_hashes, e.kvcm_coverage) for e in state_for(mgr).restatement()[1:]] == \
        [(e.block_hashes, e.kvcm_coverage) for e in st.restatement()[1:]]
