"""SPEC sec. 16: the shared tier (DECISIONS.md "The shared tier"), the life of a shared page,
failed loads (forget_copies), bad input and config, and an engine-like run: a writer manager's
``store`` ops executed into a dict store (``PlaneSim``) that a fresh manager reuses.

A store shared by many managers is the coldest tier. The manager does no I/O: the engine asks
it which ``(key, lc)`` to look up (``shared_candidates``), tells it what the store holds
(``create_kv_cache(shared_hits=...)``), and executes the ``store`` / ``onboard`` ops that name
objects by block key. Each scenario asserts real outcomes (lengths, pages, ops, events, stats)
on both backends. The other parts: parity/test_shared_tier_writes.py,
parity/test_shared_tier_reads.py, parity/shared_tier_helpers.py."""

from __future__ import annotations

import dataclasses

import pytest
from kvcm import AttentionLayer, ConfigError, CopyOp, KVCacheManagerConfig, SsmLayer, Status, Tier

from parity.helpers import (
    B,
    attached_keys,
    attn_cfg,
    fill,
    keys,
    lc_stats,
    removed,
    snap,
    ssm_cfg,
    stored,
    toks,
    unchanged,
)
from parity.shared_tier_helpers import SHARED, SHARED_PATH, P, Q, onboard_op, page_entries, reader, shared, written_by

# ---------------------------------------------------------------------------------------
# Life of a shared page
# ---------------------------------------------------------------------------------------


def test_shared_pages_are_unlinked_when_their_request_closes_without_resume(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:12])
    k = keys(P[:12])
    r, kv = reader(make_manager, cfg, P[:12], store)
    r.take_events()
    kv.close()
    assert removed(r.take_events()) == [(k[0], 0), (k[1], 0), (k[2], 0)]
    assert snap(r)["pages"] == [] and attached_keys(r) == set()
    assert lc_stats(r.stats(), 0)["drops"] == 0  # no local slot was freed
    r.check_invariants()


def test_two_requests_hold_one_shared_page(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:12])
    r, kv1 = reader(make_manager, cfg, P[:12], store)
    kv2 = r.create_kv_cache(P[:12])  # an ordinary match finds the shared blocks
    assert kv2.num_reused_tokens == 12
    assert [p["holds"] for p in page_entries(r, SHARED)] == [2, 2, 2]
    r.check_invariants()
    kv1.close()  # still used by kv2: kept
    assert [p["holds"] for p in page_entries(r, SHARED)] == [1, 1, 1]
    assert kv2.resume() is True  # onboarded once, for kv2
    assert [o.reason for o in r.drain_copy_ops()] == ["onboard"] * 3
    kv2.close()  # now ordinary gpu pages of the tree: DROPPABLE, kept
    assert attached_keys(r) == set(keys(P[:12]))
    assert all(p["state"] == "DROPPABLE" and p["tier"] == 0 for p in snap(r)["pages"])
    r.check_invariants()


def test_a_suspended_holder_keeps_the_onboarded_page(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:8])
    r, kv1 = reader(make_manager, cfg, P[:8], store)
    kv2 = r.create_kv_cache(P[:8])
    assert kv1.resume()
    r.drain_copy_ops()
    kv1.close()
    assert [(p["tier"], p["state"]) for p in snap(r)["pages"]] == [(0, "HELD"), (0, "HELD")]
    assert kv2.resume()
    assert r.drain_copy_ops() == []  # already on gpu
    r.check_invariants()


# ---------------------------------------------------------------------------------------
# forget_copies
# ---------------------------------------------------------------------------------------


def test_forget_copies_of_store_ops_forgets_nothing(make_manager):
    w = make_manager(shared(attn_cfg(gpu=6)))
    fill(w, P[:12])
    ops = w.drain_copy_ops()
    assert len(ops) == 3
    w.take_events()
    tree = snap(w)["tree"]
    assert w.forget_copies(ops[1:]) == []
    assert snap(w)["tree"] == tree and w.take_events() == []
    assert lc_stats(w.stats(), 0)["lost_pages"] == 0
    assert [op[:7] for op in snap(w)["issued_copy_ops"]] == [ops[0].to_json()]
    unchanged(w, lambda: w.forget_copies(ops[1:2]), ValueError)  # already reported
    w.check_invariants()


def test_a_failed_shared_onboard_rolls_the_request_back_and_rematches_locally(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:12])
    k = keys(P[:12])
    r, kv = reader(make_manager, cfg, P[:12], store)
    assert kv.resume()
    ops = r.drain_copy_ops()
    r.take_events()
    assert r.forget_copies([ops[1]]) == [kv.id]  # block 1's object was gone
    assert kv.status == Status.SUSPENDED and kv.num_committed_tokens == 4
    assert removed(r.take_events())[:2] == [(k[1], 0), (k[2], 0)]
    assert attached_keys(r) == {k[0]}
    assert lc_stats(r.stats(), 0)["lost_pages"] == 1
    r.check_invariants()
    # the engine recomputes from token 4
    assert kv.resume() and kv.resize(12)
    kv.commit(P[4:12])
    assert [o.reason for o in r.drain_copy_ops()] == ["store", "store"]
    r.check_invariants()


def test_a_failed_snapshot_load_loses_the_ssm_state_and_rematches(make_manager):
    cfg = shared(ssm_cfg(gpu=4))
    store, _ = written_by(make_manager, cfg, P[:12])
    r, kv = reader(make_manager, cfg, P[:12], store)
    assert kv.resume()
    ops = r.drain_copy_ops()  # onboard of block 2's snapshot, then its copy into the live state
    r.take_events()
    # CopyError.ops lists the failed load and every op after it
    assert r.forget_copies(ops) == [kv.id]
    assert kv.status == Status.SUSPENDED and kv.num_committed_tokens == 0
    assert snap(r)["tree"] == [n for n in snap(r)["tree"] if n["root"]]  # nothing reusable is left
    assert lc_stats(r.stats(), 0)["lost_pages"] == 2
    r.check_invariants()


def test_window_and_ssm_extension(make_manager):
    cfg = shared(KVCacheManagerConfig(tokens_per_block=B, layers=[AttentionLayer(0, 4, window=5), SsmLayer(1, 16)],
                                      tiers=[Tier("gpu", 16 * 12)], pool_ratio={0: 8.0, 1: 4.0}))
    store, _ = written_by(make_manager, cfg, P[:16])
    k = keys(P[:16])
    assert store == {(k[i], 0) for i in range(4)} | {(k[3], 1)}
    r, kv = reader(make_manager, cfg, P[:16], store)
    assert kv.num_reused_tokens == 16
    # stale at 16 (window 5: blocks ending before token 12): 0..2; held: block 3 and the snapshot
    assert stored(r.take_events()) == [(k[3], 0), (k[3], 1)]
    assert kv.resume()
    assert r.drain_copy_ops() == [onboard_op(0, 0, k[3]), onboard_op(1, 0, k[3]), CopyOp(1, 0, 0, 0, 1, "cow")]
    assert kv.page_indices(0) == [-1, -1, -1, 0]
    r.check_invariants()


def test_forget_copies_checks_the_key_of_an_op(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:8])
    r, kv = reader(make_manager, cfg, P[:8], store)
    assert kv.resume()
    op = r.drain_copy_ops()[0]
    for bad in (dataclasses.replace(op, key=None), dataclasses.replace(op, key=b"\1" * 32),
                dataclasses.replace(op, key=b"short")):
        unchanged(r, lambda bad=bad: r.forget_copies([bad]), ValueError)
    unchanged(r, lambda: r.forget_copies([dataclasses.replace(op, key="ab")]), TypeError)


# ---------------------------------------------------------------------------------------
# Bad input and config
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("hits, exc", [
    (5, TypeError),
    ("ab", TypeError),
    (b"x" * 32, TypeError),
    ([b"x" * 32], TypeError),
    ([(b"x" * 32,)], ValueError),
    ([(b"x" * 32, 0, 1)], ValueError),
    ([(b"x" * 31, 0)], ValueError),
    ([("x" * 32, 0)], TypeError),
    ([(b"x" * 32, 1)], ValueError),
    ([(b"x" * 32, -1)], ValueError),
    ([(b"x" * 32, True)], TypeError),
    ([(b"x" * 32, 0.0)], TypeError),
])
def test_bad_shared_hits_change_nothing(make_manager, hits, exc):
    mgr = make_manager(shared(attn_cfg(gpu=6)))
    fill(mgr, P[:4])
    unchanged(mgr, lambda: mgr.create_kv_cache(P[:12], id="x", shared_hits=hits), exc)
    kv = mgr.create_kv_cache(P[:12], id="x", shared_hits=[(keys(P)[1], 0)])  # the id is still free
    assert kv.num_reused_tokens == 8  # block 0 local, block 1 from the store


def test_shared_hits_without_a_shared_tier_are_refused(make_manager):
    mgr = make_manager(attn_cfg())
    for hits in ([], [(keys(P)[0], 0)]):
        unchanged(mgr, lambda hits=hits: mgr.create_kv_cache(P[:8], shared_hits=hits), ValueError)
    assert mgr.create_kv_cache(P[:8], shared_hits=None).num_reused_tokens == 0


def test_shared_hits_accept_any_iterable_of_pairs(make_manager):
    cfg = shared(attn_cfg(gpu=6))
    store, _ = written_by(make_manager, cfg, P[:8])
    mgr = make_manager(cfg)
    as_lists = [[bytearray(k), lc] for k, lc in store]
    assert mgr.create_kv_cache(P[:8], shared_hits=iter(as_lists)).num_reused_tokens == 8
    assert mgr.create_kv_cache(P[:8], shared_hits=set(store)).num_reused_tokens == 8


def _cfg_error(make_manager, cfg) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        make_manager(cfg)
    return info.value


def test_config_shared_tier_rules(make_manager):
    layers = [AttentionLayer(0, 1)]

    def cfg(*tiers, **kw):
        return KVCacheManagerConfig(tokens_per_block=B, layers=layers, tiers=list(tiers), **kw)

    gpu = Tier("gpu", 16)
    sh = Tier("shared", 0, SHARED_PATH)
    assert _cfg_error(make_manager, cfg(sh, gpu)).field == "tiers"  # listed last
    assert _cfg_error(make_manager, cfg(gpu, sh, Tier("host", 16))).field == "tiers"
    assert _cfg_error(make_manager, cfg(gpu, sh, sh)).field == "tiers"  # at most one
    assert _cfg_error(make_manager, cfg(gpu, Tier("shared", 0))).field == "tiers.path"
    assert _cfg_error(make_manager, cfg(gpu, Tier("shared", 0, ""))).field == "tiers.path"
    assert _cfg_error(make_manager, cfg(gpu, Tier("shared", 0, 5))).field == "tiers.path"
    assert _cfg_error(make_manager, cfg(gpu, Tier("shared", -1, SHARED_PATH))).field == "tiers.quota_bytes"
    assert _cfg_error(make_manager, cfg(Tier("shared", 0, SHARED_PATH))).field == "tiers"  # gpu required
    for bad in ("Commit", "", None, 1):
        assert _cfg_error(make_manager, cfg(gpu, sh, shared_write=bad)).field == "shared_write"
    for bad in ("x" * 257, "é" * 129, None, b"ns", "\ud800"):
        assert _cfg_error(make_manager, cfg(gpu, sh, shared_namespace=bad)).field == "shared_namespace"
    # a shared tier needs a namespace (same-shaped models must not read each other's bytes)
    assert _cfg_error(make_manager, cfg(gpu, sh)).field == "shared_namespace"
    assert _cfg_error(make_manager, cfg(gpu, sh, shared_namespace="")).field == "shared_namespace"
    # checked with or without a shared tier
    assert _cfg_error(make_manager, cfg(gpu, shared_write="later")).field == "shared_write"
    assert _cfg_error(make_manager, cfg(gpu, shared_namespace="x" * 257)).field == "shared_namespace"
    make_manager(cfg(gpu, shared_namespace=""))  # no shared tier: no namespace needed
    # accepted: no slots, any quota (even one too small for a slot), a URL, 256 bytes of namespace
    mgr = make_manager(cfg(gpu, Tier("shared", 1, "mooncake://127.0.0.1:50051?metadata=http://x"),
                           shared_write="evict", shared_namespace="é" * 128))
    assert [t["kind"] for t in mgr.stats()["tiers"]] == ["gpu"]
    assert [p["kind"] for p in snap(mgr)["pools"]] == ["gpu"]
    make_manager(cfg(gpu, Tier("disk", 16, "/tmp/kvcm-parity-disk"), Tier("shared", 0, "file:///tmp/x"),
                     shared_namespace="m"))


# ---------------------------------------------------------------------------------------
# An engine-like run: manager A writes through a dict store, manager B (fresh) reuses it
# ---------------------------------------------------------------------------------------


class PlaneSim:
    """Executes copy ops over slot contents (a stand-in for the data plane): local slots by
    (tier, lc, slot), the shared store by (key, lc)."""

    def __init__(self, store: dict) -> None:
        self.mem: dict[tuple[int, int, int], object] = {}
        self.store = store

    def run(self, ops) -> None:
        for o in ops:
            if o.reason == "store":
                assert o.dst_tier == SHARED and o.dst_slot == -1 and len(o.key) == 32
                self.store[(o.key, o.lc)] = self.mem[(o.src_tier, o.lc, o.src_slot)]
            elif o.src_tier == SHARED:
                assert o.reason == "onboard" and o.src_slot == -1
                self.mem[(o.dst_tier, o.lc, o.dst_slot)] = self.store[(o.key, o.lc)]
            else:
                assert o.key is None
                self.mem[(o.dst_tier, o.lc, o.dst_slot)] = self.mem[(o.src_tier, o.lc, o.src_slot)]


def _prefill(mgr, plane: PlaneSim, kv, tokens) -> None:
    """The engine's prefill: the reused prefix is loaded, the rest computed and committed
    (block contents: the tokens of the block, written where page_indices says)."""
    assert kv.resume() and kv.resize(len(tokens))
    plane.run(mgr.drain_copy_ops())
    start = kv.num_committed_tokens
    idx = kv.page_indices(0)
    for i in range(start // B, -(-len(tokens) // B)):
        plane.mem[(0, 0, idx[i])] = tuple(tokens[i * B:(i + 1) * B])
    kv.commit(tokens[start:])
    plane.run(mgr.drain_copy_ops())


@pytest.mark.parametrize("write", ["commit", "evict"])
def test_engine_like_reuse_across_two_managers(make_manager, write):
    cfg = shared(attn_cfg(gpu=6), write=write)
    objects: dict = {}
    a = make_manager(cfg)
    plane_a = PlaneSim(objects)
    prompts = [P[:12], P[:8] + Q[:8], Q[:16]]
    for t in prompts:
        kv = a.create_kv_cache(t)
        _prefill(a, plane_a, kv, t)
        kv.close()
        plane_a.run(a.drain_copy_ops())
    if write == "evict":  # only evicted pages were written; push the rest out with other work
        kv = a.create_kv_cache()
        _prefill(a, plane_a, kv, toks(24, base=900))
        kv.close()
    # every object holds exactly its block's tokens
    for t in prompts:
        for i, key in enumerate(keys(t)):
            if (key, 0) in objects:
                assert objects[(key, 0)] == tuple(t[i * B:(i + 1) * B])
    assert len(objects) >= 5
    b = make_manager(cfg)
    plane_b = PlaneSim(objects)
    for t in prompts:
        local = b.probe_reuse(t)
        cands = b.shared_candidates(t)
        hits = [c for c in cands if c in objects]
        # full attention: the match runs to the first block neither local nor stored
        run = local // B
        while run < len(t) // B and (keys(t)[run], 0) in objects:
            run += 1
        kv = b.create_kv_cache(t, shared_hits=hits)
        assert kv.num_reused_tokens == max(local, run * B)
        _prefill(b, plane_b, kv, t)
        idx = kv.page_indices(0)
        assert [plane_b.mem[(0, 0, idx[i])] for i in range(len(t) // B)] == [
            tuple(t[i * B:(i + 1) * B]) for i in range(len(t) // B)]
        kv.close()
        b.check_invariants()
    assert lc_stats(b.stats(), 0)["shared_hit_blocks"] >= 5
