"""Builders of the shared-tier parity scenarios (SPEC sec. 16; parity/test_shared_tier*.py): a
config with a shared tier, store / onboard ops, what a drain wrote, a reader manager."""

from __future__ import annotations

import dataclasses

from kvcm import CopyOp, KVCacheManagerConfig, Tier

from parity.helpers import fill, snap, toks

SHARED = 3
SHARED_PATH = "/tmp/kvcm-parity-shared"
P = toks(16, base=100)
Q = toks(16, base=200)


def shared(cfg: KVCacheManagerConfig, write: str = "commit", **kw) -> KVCacheManagerConfig:
    """``cfg`` with a shared tier (listed last) and the write policy ``write``."""
    kw.setdefault("shared_namespace", "parity-model")
    return dataclasses.replace(cfg, tiers=[*cfg.tiers, Tier("shared", 0, SHARED_PATH)], shared_write=write, **kw)


def store_op(lc: int, src_tier: int, src_slot: int, key: bytes) -> CopyOp:
    return CopyOp(lc, src_tier, src_slot, SHARED, -1, "store", key=key)


def onboard_op(lc: int, dst_slot: int, key: bytes) -> CopyOp:
    return CopyOp(lc, SHARED, -1, 0, dst_slot, "onboard", key=key)


def written(ops) -> set[tuple[bytes, int]]:
    """What a store holds after executing ``ops``: the ``(key, lc)`` of their store ops."""
    return {(o.key, o.lc) for o in ops if o.reason == "store"}


def page_entries(mgr, tier: int) -> list[dict]:
    return [p for p in snap(mgr)["pages"] if p["tier"] == tier]


def reader(make_manager, cfg, tokens, store: set, **kw):
    """A fresh manager that reuses ``store`` for ``tokens``: candidates, hits, create."""
    mgr = make_manager(cfg)
    hits = [c for c in mgr.shared_candidates(tokens) if c in store]
    return mgr, mgr.create_kv_cache(tokens, shared_hits=hits, **kw)


def written_by(make_manager, cfg, tokens, chunks=None) -> tuple[set, list[CopyOp]]:
    """A writer manager commits ``tokens`` in one request; returns what reached the store
    and every op it drained."""
    w = make_manager(cfg)
    fill(w, tokens, chunks=chunks)
    ops = w.drain_copy_ops()
    return written(ops), ops
