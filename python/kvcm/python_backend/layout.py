"""The facts of the configuration the pool's parts and a request read (SPEC sec. 1, 2).

C++ twin: ``cpp/core/layout.h``.  A ``Layout`` is derived once from the configuration and
never changes: the block size, the life cycles, the tiers and the shared tier's write
mode.  Every part of the pool (``pages.py``, ``tree_index.py``, ``evictor.py``,
``outbox.py``) and every request (``request.py``) reads it as one value; it is not a
member of the pool a request works through.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcm.api import SHARED, KVCacheManagerConfig
from kvcm.config import LifeCycle, ResolvedConfig


@dataclass(frozen=True, slots=True)
class Layout:
    """The configuration's facts, read-only (C++ twin: ``Layout`` in layout.h)."""

    B: int  # tokens per block
    lcs: tuple[LifeCycle, ...]
    attn_lcs: tuple[int, ...]  # the attention life cycles, ascending
    ssm_lc: int | None  # the ssm life cycle (at most one)
    # no windowed attention: no block ever becomes stale (the decode step's shortcut)
    full_attention_only: bool
    partial_reuse: bool  # enable_partial_reuse
    reuse_match_backoff: int
    max_util_for_resume: float
    num_tiers: int  # the local tiers (each with a pool per life cycle)
    # pools are indexed by config position; copy ops, events, stats and snapshots report
    # SPEC's tier number by kind (gpu 0, host 1, disk 2): tier_ids maps at that boundary
    # (and the shared tier's position, after the local ones, to SHARED)
    tier_ids: tuple[int, ...]
    tier_kinds: tuple[str, ...]
    # the shared tier (DECISIONS.md "The shared tier"): a shared page's ``tier`` is
    # ``shared_pos`` (the position after the local tiers); it has no slot and is in no pool
    has_shared: bool
    shared_pos: int
    shared_write_evict: bool  # shared_write="evict": a page is written when eviction drops it
    store_on_commit: bool  # shared_write="commit": a page is written when it becomes a tree page
    # sec. 5 pruning: the ordinals below which a block that loses its page of an lc loses
    # its subtree too (full attention: every block; windowed: the sink blocks; ssm: none)
    subtree_below: tuple[int, ...]

    @staticmethod
    def of(rc: ResolvedConfig) -> Layout:
        """The layout of a resolved configuration."""
        config: KVCacheManagerConfig = rc.config
        B = config.tokens_per_block
        lcs = rc.life_cycles
        num_tiers = len(rc.tier_kinds)
        has_shared = rc.has_shared
        return Layout(
            B=B,
            lcs=lcs,
            attn_lcs=tuple(lc.id for lc in lcs if lc.kind == "attn"),
            ssm_lc=rc.ssm_lc,
            full_attention_only=all(lc.window is None for lc in lcs if lc.kind == "attn"),
            partial_reuse=config.enable_partial_reuse,
            reuse_match_backoff=config.reuse_match_backoff,
            max_util_for_resume=config.max_util_for_resume,
            num_tiers=num_tiers,
            tier_ids=(*rc.tier_ids, SHARED) if has_shared else rc.tier_ids,
            tier_kinds=rc.tier_kinds,
            has_shared=has_shared,
            shared_pos=num_tiers,
            shared_write_evict=has_shared and rc.shared_write_evict,
            store_on_commit=has_shared and not rc.shared_write_evict,
            subtree_below=tuple((1 << 63 if lc.is_full_attention else lc.num_sink_blocks(B)) if lc.kind == "attn"
                                else 0 for lc in lcs),
        )

    def stale_range(self, lc: int, history: int) -> tuple[int, int]:
        """SPEC sec. 2: the block ordinals ``[lo, hi)`` of ``lc`` stale at ``history``."""
        return self.lcs[lc].stale_range(history, self.B)
