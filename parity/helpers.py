"""Shared builders and accessors for the parity scenarios.

Configs are tiny (B = 4, a handful of slots) so every expected page index, copy op and
event can be computed by hand from SPEC.md + DECISIONS.md.  Everything here uses the
public interface only; the few places that read ``stats()`` / ``snapshot()`` go through
the accessors below so the layout is interpreted in one place.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable
from typing import Any

from kvcm import (
    AttentionLayer,
    CopyOp,
    KVCacheManagerConfig,
    ReuseScope,
    SsmLayer,
    Tier,
)

B = 4
GPU, HOST, DISK = 0, 1, 2
DISK_PATH = "/tmp/kvcm-parity-disk"
TIER_NAMES = ("gpu", "host", "disk")


# ---------------------------------------------------------------------------------------
# Tokens and keys
# ---------------------------------------------------------------------------------------


def toks(n: int, base: int = 100) -> list[int]:
    """``n`` distinct tokens starting at ``base`` (different bases never share a prefix)."""
    return list(range(base, base + n))


def root_key(scope: ReuseScope | None = None) -> bytes:
    """Scope root key computed independently from SPEC sec. 3."""
    scope = scope or ReuseScope()
    mask = (1 if scope.lora_id is not None else 0) | (2 if scope.salt is not None else 0)
    data = bytes([mask])
    if scope.lora_id is not None:
        data += struct.pack("<Q", scope.lora_id)
    if scope.salt is not None:
        data += struct.pack("<Q", scope.salt)
    return hashlib.sha256(data).digest()


def tok_bytes(tokens: Iterable) -> bytes:
    return b"".join(t if isinstance(t, bytes) else struct.pack("<I", t) for t in tokens)


def keys(tokens: list, scope: ReuseScope | None = None, bpb: int = B) -> list[bytes]:
    """One key per full or partial block, computed independently from SPEC sec. 3."""
    out = []
    parent = root_key(scope)
    for s in range(0, len(tokens), bpb):
        parent = hashlib.sha256(parent + tok_bytes(tokens[s : s + bpb])).digest()
        out.append(parent)
    return out


# ---------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------


def _tiers(slot_bytes: int, gpu: int, host: int = 0, disk: int = 0) -> list[Tier]:
    tiers = [Tier("gpu", gpu * slot_bytes)]
    if host:
        tiers.append(Tier("host", host * slot_bytes))
    if disk:
        tiers.append(Tier("disk", disk * slot_bytes, path=DISK_PATH))
    return tiers


def attn_cfg(gpu: int = 4, host: int = 0, disk: int = 0, **kw: Any) -> KVCacheManagerConfig:
    """One full-attention life cycle (lc 0), 1 byte/token -> a slot is 4 bytes."""
    return KVCacheManagerConfig(
        tokens_per_block=B, layers=[AttentionLayer(0, 1)], tiers=_tiers(B, gpu, host, disk), **kw
    )


def win_cfg(gpu: int = 4, window: int = 4, sinks: int = 0, host: int = 0, **kw: Any) -> KVCacheManagerConfig:
    """One sliding-window attention life cycle (lc 0)."""
    return KVCacheManagerConfig(
        tokens_per_block=B,
        layers=[AttentionLayer(0, 1, window=window, sink_tokens=sinks)],
        tiers=_tiers(B, gpu, host),
        **kw,
    )


def ssm_cfg(gpu: int = 4, host: int = 0, **kw: Any) -> KVCacheManagerConfig:
    """Pure SSM model: one ssm life cycle (lc 0), 16-byte states."""
    return KVCacheManagerConfig(tokens_per_block=B, layers=[SsmLayer(0, 16)], tiers=_tiers(16, gpu, host), **kw)


def hybrid_cfg(attn_gpu: int = 8, ssm_gpu: int = 4, window: int | None = None, **kw: Any) -> KVCacheManagerConfig:
    """Attention (lc 0, 4 bytes/token -> 16-byte slot) + ssm (lc 1, 16-byte state).

    Equal slot sizes so ``pool_ratio`` gives exactly ``attn_gpu`` / ``ssm_gpu`` slots."""
    total = attn_gpu + ssm_gpu
    return KVCacheManagerConfig(
        tokens_per_block=B,
        layers=[AttentionLayer(0, 4, window=window), SsmLayer(1, 16)],
        tiers=[Tier("gpu", 16 * total)],
        pool_ratio={0: float(attn_gpu), 1: float(ssm_gpu)},
        **kw,
    )


# ---------------------------------------------------------------------------------------
# Request drivers
# ---------------------------------------------------------------------------------------


def fill(mgr, tokens, priority=None, close=True, match=False, chunks=None):
    """Run one request that writes and commits ``tokens``.

    ``match=False`` creates it with no input (nothing reused); ``chunks`` splits the
    commit (each chunk is one ``commit`` call).  Returns the cache."""
    kv = mgr.create_kv_cache(list(tokens) if match else None, priority=priority)
    assert kv.resume() is True
    assert kv.resize(len(tokens)) is True
    start = kv.num_committed_tokens
    rest = list(tokens)[start:]
    if chunks is None:
        chunks = [len(rest)] if rest else []
    pos = 0
    for c in chunks:
        kv.commit(rest[pos : pos + c])
        pos += c
    assert pos == len(rest)
    if close:
        kv.close()
    return kv


def ops(mgr) -> list[tuple]:
    """Drained copy ops as plain tuples ``(lc, src_tier, src_slot, dst_tier, dst_slot, reason)``."""
    out = []
    for op in mgr.drain_copy_ops():
        assert isinstance(op, CopyOp)
        out.append((op.lc, op.src_tier, op.src_slot, op.dst_tier, op.dst_slot, op.reason))
    return out


def op(lc, src_tier, src_slot, dst_tier, dst_slot, reason) -> tuple:
    return (lc, src_tier, src_slot, dst_tier, dst_slot, reason)


# ---------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------


def of_kind(events, kind: str) -> list:
    return [e for e in events if e.kind == kind]


def stored(events) -> list[tuple[bytes, int]]:
    """Flattened ``(key, lc)`` of every stored block, in order."""
    return [(b.key, b.lc) for e in of_kind(events, "stored") for b in e.blocks]


def stored_blocks(events) -> list:
    return [b for e in of_kind(events, "stored") for b in e.blocks]


def removed(events) -> list[tuple[bytes, int]]:
    """Flattened ``(key, lc)`` of every removed key, in order."""
    return [(k, e.lc) for e in of_kind(events, "removed") for k in e.keys]


def tier_changes(events) -> list[tuple[bytes, int, int, int]]:
    return [(e.key, e.lc, e.old_tier, e.new_tier) for e in of_kind(events, "tier_changed")]


# ---------------------------------------------------------------------------------------
# stats() / snapshot() accessors
# ---------------------------------------------------------------------------------------


def pool(stats: dict, tier: int, lc: int) -> dict:
    """``{total, free, locked, held, droppable}`` slot counts of pool ``(tier, lc)``;
    ``tier`` is SPEC's number (gpu 0, host 1, disk 2), each ``stats["tiers"]`` entry's ``tier``."""
    (entry,) = [t["lc"][lc] for t in stats["tiers"] if t["tier"] == tier]
    return {k: entry[k] for k in ("total", "free", "locked", "held", "droppable")}


def lc_stats(stats: dict, lc: int) -> dict:
    """Per life cycle counters (reused/missed/allocated blocks, offloads, ...)."""
    return stats["lc"][lc]


def counts(mgr, tier: int = GPU, lc: int = 0) -> tuple[int, int, int, int, int]:
    """``(total, free, locked, held, droppable)`` of pool ``(tier, lc)`` from ``stats()``."""
    p = pool(mgr.stats(), tier, lc)
    return (p["total"], p["free"], p["locked"], p["held"], p["droppable"])


def tree_nodes(mgr) -> list[dict]:
    """Non-root tree nodes of ``snapshot()`` (attached and referenced orphans)."""
    return [n for n in mgr.snapshot()["tree"] if not n.get("root")]


def attached_keys(mgr) -> set[bytes]:
    return {bytes.fromhex(n["key"]) for n in tree_nodes(mgr) if n["attached"]}


def orphan_keys(mgr) -> list[bytes]:
    return [bytes.fromhex(n["key"]) for n in tree_nodes(mgr) if not n["attached"]]


def snap(mgr) -> dict:
    s = mgr.snapshot()
    json.dumps(s)  # must always be JSON-serialisable
    return s


def unchanged(mgr, call: Callable[[], Any], exc) -> BaseException:
    """``call()`` must raise ``exc`` and leave ``snapshot()`` identical."""
    before = snap(mgr)
    try:
        call()
    except exc as e:
        err = e
    else:
        raise AssertionError(f"expected {exc} to be raised")
    after = snap(mgr)
    assert after == before, "a failed call changed state"
    mgr.check_invariants()
    return err


def held_block_tiers(s: dict, bpb: int = B) -> tuple[int, ...]:
    """Per full committed block of the newest open request of snapshot ``s``, the coldest
    tier of the pages it holds for that block (its attention pages, its matched ssm
    snapshot), -1 when none: what ``ReuseProbe.block_tiers`` promised for it before it was
    created (read before it resumes)."""
    r = s["requests"][-1]
    tier = {p["serial"]: p["tier"] for p in s["pages"]}
    n = len(r["committed_tokens"]) // bpb
    out = [-1] * n
    for serials in r["pages"].values():
        for j, serial in enumerate(serials[:n]):
            if serial is not None:
                out[j] = max(out[j], tier[serial])
    j = len(r["blocks"]) - 1  # the snapshot is the page of the block the match ends in
    if r["snap"] is not None and j < n:
        out[j] = max(out[j], tier[r["snap"]])
    return tuple(out)


def _request_entry(s: dict, cache) -> dict:
    (r,) = [r for r in s["requests"] if r["id"] == cache.id]
    return r


def held_off_gpu(mgr, cache) -> list[tuple[int, int, int]]:
    """``(lc, tier, slot)`` of every page ``cache`` holds that is not on gpu, sorted: what
    its ``resume`` onboards."""
    s = snap(mgr)
    r = _request_entry(s, cache)
    pages = {p["serial"]: p for p in s["pages"]}
    serials = [x for v in r["pages"].values() for x in v if x is not None] + [r["snap"]]
    return sorted((pages[x]["lc"], pages[x]["tier"], pages[x]["slot"]) for x in serials
                  if x is not None and pages[x]["tier"] != GPU)


def probe_then_create(mgr, tokens, scope=None, shared_hits=None):
    """SPEC sec. 6 probe contract, end to end: ``probe_reuse_detail`` (and ``probe_reuse``)
    change nothing at all (snapshot byte-identical), then ``create_kv_cache`` with the same
    arguments matches exactly ``num_tokens`` and holds pages on exactly ``block_tiers``,
    and its ``resume`` onboards exactly the pages it holds off gpu.  Returns the probe and
    the cache (ACTIVE)."""
    hits = None if shared_hits is None else list(shared_hits)
    before = json.dumps(snap(mgr), sort_keys=True)
    probe = mgr.probe_reuse_detail(tokens, scope, shared_hits=hits)
    assert mgr.probe_reuse(tokens, scope, hits) == probe.num_tokens
    assert mgr.probe_reuse_detail(tokens, scope, shared_hits=hits) == probe  # asked again: the same
    assert json.dumps(snap(mgr), sort_keys=True) == before, "a probe changed the state"
    assert len(probe.block_tiers) == probe.num_tokens // B
    kv = mgr.create_kv_cache(tokens, scope, shared_hits=hits)
    assert kv.num_committed_tokens == probe.num_tokens
    assert held_block_tiers(snap(mgr)) == probe.block_tiers
    off_gpu = held_off_gpu(mgr, kv)
    mgr.drain_copy_ops()
    assert kv.resume() is True
    ops = mgr.drain_copy_ops()
    onboards = sorted((o.lc, o.src_tier, o.src_slot) for o in ops if o.reason == "onboard")
    if any(o.reason == "offload" for o in ops):
        # making room on gpu may push a HELD page of this very request one tier colder
        # before it is onboarded (sec. 8): the same pages, from where they went
        assert [x[0] for x in onboards] == [x[0] for x in off_gpu]
        assert all(o[1] >= h[1] for o, h in zip(onboards, off_gpu))
    else:
        assert onboards == off_gpu
    mgr.check_invariants()
    return probe, kv


def announced(mgr) -> set[tuple[bytes, int]]:
    """``(key, lc)`` of every page of an attached block, from ``snapshot()``: exactly the
    pairs a consumer of ``stored``/``removed`` events must currently believe exist."""
    out = set()
    for n in tree_nodes(mgr):
        if n["attached"]:
            for lc, p in enumerate(n["pages"]):
                if p is not None:
                    out.add((bytes.fromhex(n["key"]), lc))
    return out


# ---------------------------------------------------------------------------------------
# Work, counted (never timed)
# ---------------------------------------------------------------------------------------


def python_work(call: Callable[[], Any]) -> int:
    """The lines of kvcm's Python code that ``call()`` executes (a trace hook counts them):
    a deterministic measure of an operation's cost on the python backend, so a test can
    hold that a cost does not grow with a size by comparing two sizes.  A loop's every
    iteration counts, calls or not.  The cpp backend's work is not visible here: its
    scenarios run the same operations with sizes no per-op O(n) implementation finishes."""
    import sys

    count = [0]

    def local(_frame: Any, event: str, _arg: Any) -> Any:
        if event == "line":
            count[0] += 1
        return local

    def scope(frame: Any, _event: str, _arg: Any) -> Any:
        return local if "/kvcm/" in frame.f_code.co_filename.replace("\\", "/") else None

    previous = sys.gettrace()
    sys.settrace(scope)
    try:
        call()
    finally:
        sys.settrace(previous)
    return count[0]
