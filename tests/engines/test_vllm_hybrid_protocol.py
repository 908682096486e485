"""The connector's hybrid path without an engine (every CI leg, the leg's backend): a
Gemma-3-like layout as vLLM's hybrid KV cache manager gives it — a sliding-window group
(W=64) and a full-attention group, views of ONE allocation, global block ids, 0 the null
block — driven through vLLM 0.32's call order by hand (the real engine:
tests/engines/test_vllm_hybrid.py).

Checked: saves store no block outside the window; a hit loads every group's window blocks
into the ids vLLM allocated (and nothing into null blocks), asynchronously; a failed load is
reported by request (``failed_recving`` and ``finished_recving``), never by block id, and the
request's next lookup answers 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvcm.integrations.vllm.metadata import KvcmConnectorMetadata
from kvcm.integrations.vllm.scheduler import KvcmScheduler
from kvcm.integrations.vllm.settings import ConnectorSettings, KvLayout, SpecClasses
from kvcm.integrations.vllm.worker import KvcmWorker

B, W, NB = 32, 64, 64
HEADS, DIM = 2, 8
BLOCK_BYTES = HEADS * B * DIM * 4  # float32 [heads, tokens, dim] per block
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
SlidingWindowSpec = type("SlidingWindowSpec", (SimpleNamespace,), {})  # stand-ins for vLLM's classes
FullAttentionSpec = type("FullAttentionSpec", (SimpleNamespace,), {})
SPECS = SpecClasses(FullAttentionSpec, SlidingWindowSpec)


def layout() -> KvLayout:
    cfg = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=[LAYERS[0]], kv_cache_spec=SlidingWindowSpec(
            block_size=B, num_kv_heads=HEADS, head_size=DIM, dtype="torch.float32", page_size_bytes=BLOCK_BYTES,
            sliding_window=W)),
        SimpleNamespace(layer_names=[LAYERS[1]], kv_cache_spec=FullAttentionSpec(
            block_size=B, num_kv_heads=HEADS, head_size=DIM, dtype="torch.float32", page_size_bytes=BLOCK_BYTES))])
    return KvLayout.from_kv_cache_config(cfg, "cpu", SPECS)


class Request(SimpleNamespace):
    pass


class State:
    """vLLM's ``kv_connector_block_state``: every group's table as vLLM holds it now."""

    def __init__(self, tables: dict[str, list[list[int]]]) -> None:
        self.tables = tables

    def get_block_ids(self, rid: str) -> tuple[list[int], ...] | None:
        t = self.tables.get(rid)
        return None if t is None else tuple(t)


def fill(block: int, group: int, rid_seed: int) -> torch.Tensor:
    return torch.full((HEADS, B, DIM), float(rid_seed * 1000 + group * 100 + block))


@pytest.fixture
def rig(tmp_path, backend: str):
    lay = layout()
    settings = ConnectorSettings.parse({"backend": backend, "host_bytes": 64 * 2 * BLOCK_BYTES,
                                        "disk_path": str(tmp_path / "disk"), "disk_bytes": 64 * 2 * BLOCK_BYTES})
    sched = KvcmScheduler(settings, lay)
    worker = KvcmWorker(settings, lay, num_blocks=NB)
    mem = torch.zeros(NB * BLOCK_BYTES // 4)  # one allocation; both layers' views alias it (vLLM's HMA)
    views = {n: mem.view(NB, HEADS, B, DIM) for n in LAYERS}
    worker.register_kv_caches(views)
    yield sched, worker, mem.view(NB, HEADS, B, DIM)
    worker.shutdown()
    sched.shutdown()


def step(sched: KvcmScheduler, worker: KvcmWorker, so: SimpleNamespace, forward=None) -> tuple[set, set, set]:
    meta: KvcmConnectorMetadata = sched.build_connector_meta(so)
    worker.start_load_kv(meta)
    if forward is not None:
        forward()
    worker.wait_for_save(meta)
    out = worker.get_transfer_results(set())
    assert worker.get_block_ids_with_load_errors() == set()  # never block ids for a hybrid layout
    sched.update_connector_output(worker.build_worker_meta())
    return out


def drain(sched: KvcmScheduler, worker: KvcmWorker) -> tuple[set, set, set]:
    got: tuple[set, set, set] = (set(), set(), set())
    for _ in range(200):
        so = SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0, preempted_req_ids=set(),
                             kv_connector_block_state=State({}))
        out = step(sched, worker, so)
        got = tuple(a | b for a, b in zip(got, out, strict=True))
        if not sched.busy():
            return got
    raise AssertionError(f"still busy: {sched.pending()}")


def test_hybrid_saves_and_loads_only_window_blocks(rig) -> None:
    sched, worker, kv = rig
    prompt = list(range(1, 201))  # 200 tokens: 6 full blocks
    a = Request(request_id="a", all_token_ids=list(prompt), num_computed_tokens=0)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    tables = [list(range(1, 8)), list(range(8, 15))]  # global ids: sliding 1..7, full 8..14
    sched.update_state_after_alloc(a, tuple(tables), 0)

    def forward() -> None:
        for g, t in enumerate(tables):
            for b in t:
                kv[b] = fill(b - t[0], g, 1)  # the KV of block ordinal (b - t[0]) of group g

    so = SimpleNamespace(num_scheduled_tokens={"a": 200}, total_num_scheduled_tokens=200, preempted_req_ids=set(),
                         kv_connector_block_state=State({"a": tables}))
    step(sched, worker, so, forward)
    c = sched.counters
    # history 200 after the step: sliding blocks [0, (201 - 64) // 32) = 0..3 are stale: not stored
    assert c["window_blocks_skipped"] == 4 and c["save_blocks_planned"] == 6
    a.num_computed_tokens = 200
    sched.request_finished(a)
    drain(sched, worker)
    assert c["saved_blocks"] == 6 and worker.engine.gauges()["bytes_in_flight"] == 0

    # the same prompt again: a hit of 192 tokens, asynchronous (a hybrid layout)
    b = Request(request_id="b", all_token_ids=list(prompt), num_computed_tokens=0)
    assert sched.get_num_new_matched_tokens(b, 0) == (192, True)
    # vLLM allocates the sliding group only the window of 192: ordinals 4, 5 (and 6 for the rest)
    tb = [[0, 0, 0, 0, 20, 21, 22], list(range(30, 37))]
    kv[20:23] = -1.0
    kv[30:37] = -1.0
    sched.update_state_after_alloc(b, tuple(tb), 192)
    got = drain(sched, worker)
    assert "b" in got[1] and not got[2]  # finished_recving, no failure
    for i in (4, 5):
        assert torch.equal(kv[tb[0][i]], fill(i, 0, 1)), i
    for i in range(6):
        assert torch.equal(kv[tb[1][i]], fill(i, 1, 1)), i
    assert torch.equal(kv[22], torch.full((HEADS, B, DIM), -1.0)) and torch.equal(kv[36], kv[22])
    assert torch.count_nonzero(kv[0]) == 0  # nothing written into the null block
    assert c["loaded_blocks"] == 6 and c["loads_async"] == 1 and c["loads_sync"] == 0


def test_hybrid_failed_load_is_reported_by_request(rig, monkeypatch) -> None:
    sched, worker, _ = rig
    prompt = list(range(1, 201))
    a = Request(request_id="a", all_token_ids=list(prompt), num_computed_tokens=0)
    sched.get_num_new_matched_tokens(a, 0)
    tables = [list(range(1, 8)), list(range(8, 15))]
    sched.update_state_after_alloc(a, tuple(tables), 0)
    so = SimpleNamespace(num_scheduled_tokens={"a": 200}, total_num_scheduled_tokens=200, preempted_req_ids=set(),
                         kv_connector_block_state=State({"a": tables}))
    step(sched, worker, so)
    a.num_computed_tokens = 200
    sched.request_finished(a)
    drain(sched, worker)

    def broken(*args, **kw):
        raise RuntimeError("injected: the copy into vLLM's cache fails")

    for cp in worker.engine.copiers:
        monkeypatch.setattr(cp, "load", broken)
    b = Request(request_id="b", all_token_ids=list(prompt), num_computed_tokens=0)
    assert sched.get_num_new_matched_tokens(b, 0) == (192, True)
    sched.update_state_after_alloc(b, ([0, 0, 0, 0, 20, 21, 22], list(range(30, 37))), 192)
    _, recving, failed = drain(sched, worker)
    assert failed == {"b"} and "b" in recving
    assert sched.counters["failed_loads"] == 1 and worker.report.counters.get("load_error_blocks", 0) == 0
    # vLLM looks the request up again (num_computed_tokens 0): kvcm answers nothing for it now
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)
    sched.update_state_after_alloc(b, (list(range(1, 8)), list(range(40, 47))), 0)
    sched.request_finished(b)
    drain(sched, worker)
    assert sched.pending() == dict.fromkeys(sched.pending(), 0), sched.pending()


def test_a_shared_prefix_window_out_of_window_is_saved_by_the_next_sibling(rig) -> None:
    """The missing blocks of issue 34 item 7 (DECISIONS.md "Hybrid reuse: the missing
    blocks"): ``a`` computes a 192-token shared prefix + its own 64 tokens in one step, so the
    sliding window at the prefix's end (ordinals 4, 5) is out of the window once the step ran:
    kvcm stores no page of it and ``b`` (the same prefix, other own tokens) gets no hit.  kvcm
    knows the prefix was computed: ``b``'s saves are planned at history 192, so the window
    ending at the shared prefix gets pages, and ``c`` hits the whole prefix (loading ``b``'s
    bytes of the sliding group, ``a``'s or ``b``'s of the full group)."""
    sched, worker, kv = rig
    shared = list(range(1, 193))  # 6 blocks
    ids = iter(range(1, NB))

    def run(rid: str, own: int, seed: int) -> Request:
        r = Request(request_id=rid, all_token_ids=shared + [own + t for t in range(64)], num_computed_tokens=0)
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        tables = [[next(ids) for _ in range(8)], [next(ids) for _ in range(8)]]
        sched.update_state_after_alloc(r, tuple(tables), 0)

        def forward() -> None:
            for g, t in enumerate(tables):
                for i, b in enumerate(t):
                    kv[b] = fill(i, g, seed)

        so = SimpleNamespace(num_scheduled_tokens={rid: 256}, total_num_scheduled_tokens=256,
                             preempted_req_ids=set(), kv_connector_block_state=State({rid: tables}))
        step(sched, worker, so, forward)
        r.num_computed_tokens = 256
        sched.request_finished(r)
        drain(sched, worker)
        return r

    c = sched.counters
    run("a", 1000, 1)  # history 256 after its step: sliding ordinals 0..5 stale, 6, 7 stored
    assert c["window_blocks_skipped"] == 6 and c["junction_windows"] == 0
    run("b", 2000, 2)  # no hit (ordinals 4, 5 missing), but it shares 6 computed blocks: saved at history 192
    assert c["junction_windows"] == 1 and c["window_blocks_skipped"] == 6 + 4
    r = Request(request_id="c", all_token_ids=shared + [3000 + t for t in range(64)], num_computed_tokens=0)
    assert sched.get_num_new_matched_tokens(r, 0) == (192, True)
    tc = [[0, 0, 0, 0, 50, 51, 52, 53], list(range(54, 62))]
    kv[50:62] = -1.0
    sched.update_state_after_alloc(r, tuple(tc), 192)
    got = drain(sched, worker)
    assert "c" in got[1] and not got[2]
    for i in (4, 5):
        assert torch.equal(kv[tc[0][i]], fill(i, 0, 2)), i  # b's window at the shared prefix's end
    for i in range(6):
        assert torch.equal(kv[tc[1][i]], fill(i, 1, 1)), i  # the full group: a's (first committed)
    assert c["loaded_blocks"] == 6 and c["junction_windows"] == 1
    sched.request_finished(r)
    drain(sched, worker)
    assert sched.pending() == dict.fromkeys(sched.pending(), 0), sched.pending()


def test_a_sliding_only_hit_counts_the_window_it_loads(tmp_path, backend: str) -> None:
    """One sliding-window group (Mistral-style): a hit of 192 tokens loads only its window
    (ordinals 4, 5; vLLM allocates the null block for 0..3), and ``load_blocks_planned``
    counts those 2 blocks, as ``loaded_blocks`` does (not the hit's 6 ordinals)."""
    cfg = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=list(LAYERS), kv_cache_spec=SlidingWindowSpec(
            block_size=B, num_kv_heads=HEADS, head_size=DIM, dtype="torch.float32", page_size_bytes=BLOCK_BYTES,
            sliding_window=W))])
    lay = KvLayout.from_kv_cache_config(cfg, "cpu", SPECS)
    settings = ConnectorSettings.parse({"backend": backend, "host_bytes": 64 * 2 * BLOCK_BYTES})
    sched, worker = KvcmScheduler(settings, lay), KvcmWorker(settings, lay, num_blocks=NB)
    kvs = {n: torch.zeros(NB, HEADS, B, DIM) for n in LAYERS}
    worker.register_kv_caches(kvs)
    try:
        prompt = list(range(1, 201))
        a = Request(request_id="a", all_token_ids=list(prompt), num_computed_tokens=0)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        table = [list(range(1, 8))]
        sched.update_state_after_alloc(a, tuple(table), 0)

        def forward() -> None:
            for li, n in enumerate(LAYERS):
                for i, b in enumerate(table[0]):
                    kvs[n][b] = fill(i, li, 1)

        so = SimpleNamespace(num_scheduled_tokens={"a": 200}, total_num_scheduled_tokens=200,
                             preempted_req_ids=set(), kv_connector_block_state=State({"a": table}))
        step(sched, worker, so, forward)
        a.num_computed_tokens = 200
        sched.request_finished(a)
        drain(sched, worker)
        b = Request(request_id="b", all_token_ids=list(prompt), num_computed_tokens=0)
        assert sched.get_num_new_matched_tokens(b, 0) == (192, True)
        sched.update_state_after_alloc(b, ([0, 0, 0, 0, 20, 21, 22],), 192)
        got = drain(sched, worker)
        assert "b" in got[1] and not got[2]
        for li, n in enumerate(LAYERS):
            for i in (4, 5):
                assert torch.equal(kvs[n][16 + i], fill(i, li, 1)), (n, i)
        c = sched.counters
        assert c["loaded_blocks"] == 2 and c["load_blocks_planned"] == 2, dict(c)
        sched.request_finished(b)
        drain(sched, worker)
    finally:
        worker.shutdown()
        sched.shutdown()
