"""A reference router index built from the KV-event stream alone (SPEC sec. 16).

``RouterIndex`` holds, per instance, the blocks its wire stream announced and answers
``reuse(instance, tokens, scope)``: how many prompt tokens that instance would reuse.  It
never talks to a manager; sockets, sequence numbers, gaps and snapshots are
``kvcm.fleet.subscriber``'s job, which feeds decoded batches to :meth:`RouterIndex.apply`.

What it answers (hybrid-aware, the fixed point of SPEC sec. 6 over whole blocks):

1. ``k_0..k_{n-1}`` = ``block_keys(tokens, B, scope)`` of the prompt's *full* blocks
   (a partial block is never on the wire: it cannot be matched by hash).
2. The matched path is ``k_0..k_{L-1}`` with ``L - 1`` the last index whose key the index
   holds.  The index holds a key while the block has a page in some life cycle, or is the
   parent (by ``parent_block_hash``) of a block it holds: SPEC's tree invariant says an
   attached block has a page or a child, and a block's ancestors are attached with it; a
   key chain (``k_i = sha256(k_{i-1} || tokens)``) places every prompt block under the
   previous one, so holding ``k_i`` proves ``k_0..k_i`` are all in the tree.
3. ``m = L * B``, then SPEC sec. 6 step 3 over the path until nothing changes, life cycle by
   life cycle, a page's coverage ``c`` being ``kvcm_coverage`` (the extension; absent = B):
   ssm — ``m`` = ``j * B + c`` of the last path block ``j`` with ``j * B + c <= m``
   holding a snapshot, else 0; attention — with history ``m``, the first non-stale block
   ``j`` (SPEC sec. 7 stale rule, from ``kv_cache_spec_sliding_window`` and the
   ``kvcm_sink_tokens`` extension) below ``m`` whose page does not cover its matched
   tokens (``c < min(B, m - j * B)``; no page: ``c = 0``) cuts ``m`` to ``j * B + c``.
   Pages on any medium count.
4. The answer is that ``m`` counted in whole blocks: ``(m // B) * B``.

Exactness: the answer equals ``(probe_reuse(tokens[:L * B], scope) // B) * B`` on the
instance after every step (``reuse_match_backoff=0``): on a prompt of exactly the ``L``
matched full blocks the probe's walk never misses, so it runs the same fixed point from the
same start with the same coverages.  With ``enable_partial_reuse=False`` every page of a
full block covers it whole and the probe never ends inside a block, so this is
``probe_reuse(tokens, scope)`` itself.  With partial reuse on, ``probe_reuse(tokens)`` can
legitimately exceed it — its walk can continue into a partial block (never on the wire)
whose snapshot or pages then count — and flooring it is *not* the same number (a snapshot
inside that partial block can hold ``m`` past a full-block snapshot the router lacks; with
a window, a longer history changes which blocks are stale), so the reference is the probe
of the whole-block prefix.  One corner is outside what the stream can tell: a window of
1 token, no full attention and no ssm, where a chain of page-less blocks off the prompt's
path keeps a page-less prompt block attached.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.api import KVCacheManagerConfig, ReuseScope, Token
from kvcm.config import LifeCycle, resolve_config
from kvcm.fleet.wire import KIND_FULL, KIND_MAMBA, KIND_WINDOW, AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.matching import MatchRule, fixed_point

BlockKey = bytes | int  # vLLM's ExternalBlockHash; kvcm's own keys are 32-byte ``bytes``


class InvalidBatchError(ValueError):
    """A batch the router cannot apply (it does not fit the router's model, or names a
    block by something that is not a block hash).  Raised before anything of the batch is
    applied: the index is unchanged."""


def block_key(h: object) -> BlockKey:
    """The index key of a wire block hash: the hash itself, ``bytes`` or ``int``.

    An int is keyed *as an int*, never converted by value (``bytes(h)`` would allocate
    ``h`` zero bytes: 10 MB for a hash of 10**7, an error for a negative or 64-bit one).
    An int never equals a ``bytes`` key, so vLLM's int hashes and kvcm's keys cannot meet."""
    t = type(h)
    if t is bytes or t is int:  # exact types: a bool is no block hash
        return h  # type: ignore[return-value]
    raise InvalidBatchError(f"a block hash is bytes or int, not {t.__name__}")


@dataclass(frozen=True)
class GroupSpec:
    """One life cycle as the router sees it (``group_idx`` is its position)."""

    kind: str  # full_attention | sliding_window | mamba
    window: int | None = None
    sinks: int = 0

    @staticmethod
    def of(lc: LifeCycle) -> GroupSpec:
        if lc.kind == "ssm":
            return GroupSpec(KIND_MAMBA)
        if lc.window is None:
            return GroupSpec(KIND_FULL)
        return GroupSpec(KIND_WINDOW, lc.window, lc.sinks)

    @property
    def rule(self) -> MatchRule:
        """What SPEC sec. 6 step 3 needs of it (kvcm.matching)."""
        return MatchRule(self.kind == KIND_MAMBA, self.window, self.sinks)


@dataclass(frozen=True)
class RouterModel:
    """What the router must know about the model: block size and life cycles."""

    block_size: int
    groups: tuple[GroupSpec, ...]

    @staticmethod
    def from_config(config: KVCacheManagerConfig) -> RouterModel:
        rc = resolve_config(config)
        return RouterModel(config.tokens_per_block, tuple(GroupSpec.of(lc) for lc in rc.life_cycles))

    @property
    def rules(self) -> tuple[MatchRule, ...]:
        return tuple(g.rule for g in self.groups)


@dataclass
class _Entry:
    parent: BlockKey | None
    pages: dict[int, str] = field(default_factory=dict)  # group -> medium
    coverage: dict[int, int] = field(default_factory=dict)  # group -> tokens covered, when < B
    live_children: int = 0

    @property
    def live(self) -> bool:
        return bool(self.pages) or self.live_children > 0


class InstanceIndex:
    """The announced blocks of one instance."""

    def __init__(self, model: RouterModel) -> None:
        self.model = model
        self.blocks: dict[BlockKey, _Entry] = {}

    def clear(self) -> None:
        self.blocks.clear()

    def apply(self, events: Iterable[Any]) -> None:
        """Apply a batch's events, all or nothing: the whole batch is validated first
        (:meth:`validate`), so a batch that does not fit raises and changes nothing."""
        events = list(events)
        self.validate(events)
        for e in events:
            if isinstance(e, BlockStored):
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    self._store(h, parent, e.group_idx or 0, e.medium, e.kvcm_coverage)
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self._remove(h, e.group_idx or 0, e.medium)
            else:
                self.clear()

    def validate(self, events: Sequence[Any]) -> None:
        """Raise :class:`InvalidBatchError` unless every event fits the model: known event
        types, block size, a group the model has and its spec, block hashes ``bytes`` or
        ``int``, a ``kvcm_coverage`` of at least one token on a single block."""
        for e in events:
            if isinstance(e, BlockStored):
                self._check(e)
                if e.parent_block_hash is not None:
                    block_key(e.parent_block_hash)
                for h in e.block_hashes:
                    block_key(h)
                c = e.kvcm_coverage
                if c is not None and (c < 1 or (c < self.model.block_size and len(e.block_hashes) != 1)):
                    raise InvalidBatchError(f"kvcm_coverage {c} on {len(e.block_hashes)} blocks "
                                            f"(a partial coverage is >= 1 and names one block)")
            elif isinstance(e, BlockRemoved):
                self._group(e.group_idx)
                for h in e.block_hashes:
                    block_key(h)
            elif not isinstance(e, AllBlocksCleared):
                raise InvalidBatchError(f"not a wire event: {type(e).__name__}")

    def _group(self, group_idx: Any) -> int:
        g = group_idx or 0
        if type(g) is not int or not 0 <= g < len(self.model.groups):
            raise InvalidBatchError(f"group {group_idx!r} is not a life cycle of the router's model "
                                    f"({len(self.model.groups)} groups)")
        return g

    def _check(self, e: Any) -> None:
        g = self._group(e.group_idx)
        m = self.model
        if e.block_size != m.block_size:
            raise InvalidBatchError(f"event for block size {e.block_size}, group {g} does not fit the router's model {m}")
        spec = m.groups[g]
        if e.kv_cache_spec_kind is not None and (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window,
                                                 e.kvcm_sink_tokens or 0) != (spec.kind, spec.window, spec.sinks):
            raise InvalidBatchError(f"group {g} announced as {e.kv_cache_spec_kind}/{e.kv_cache_spec_sliding_window}/"
                                    f"{e.kvcm_sink_tokens}, the router's model says {spec}")

    def _store(self, key: BlockKey, parent: BlockKey | None, group: int, medium: str | None,
               coverage: int | None = None) -> None:
        e = self.blocks.get(key)
        if e is None:
            e = self.blocks[key] = _Entry(parent)
        elif e.parent is None and parent is not None:
            if e.live:
                self._adjust(parent, +1)
            e.parent = parent
        was = e.live
        e.pages[group] = medium or ""
        if coverage is None or coverage >= self.model.block_size:
            e.coverage.pop(group, None)
        else:
            e.coverage[group] = coverage
        if not was:
            self._adjust(e.parent, +1)

    def _remove(self, key: BlockKey, group: int, medium: str | None) -> None:
        e = self.blocks.get(key)
        if e is None or e.pages.get(group) != (medium or ""):
            return
        del e.pages[group]
        e.coverage.pop(group, None)
        if not e.live:
            del self.blocks[key]
            self._adjust(e.parent, -1)

    def _adjust(self, key: BlockKey | None, delta: int) -> None:
        """A child of ``key`` became live (+1) or dead (-1); propagate up the chain."""
        while key is not None:
            e = self.blocks.get(key)
            if e is None:
                if delta < 0:
                    return
                e = self.blocks[key] = _Entry(None)
            was = e.live
            e.live_children += delta
            if e.live == was:
                return
            if not e.live:
                del self.blocks[key]
            key = e.parent

    # ------------------------------------------------------------------ the answer

    def reuse_keys(self, keys: Sequence[BlockKey]) -> int:
        """Reusable tokens for a prompt whose full-block keys are ``keys``."""
        B = self.model.block_size
        blocks = self.blocks
        last = -1
        for i, k in enumerate(keys):
            if k in blocks:
                last = i
        path = [blocks.get(k) for k in keys[: last + 1]]
        empty = _Entry(None)
        entries = [e if e is not None else empty for e in path]

        groups = range(len(self.model.groups))
        coverage = [[e.coverage.get(g, B) if g in e.pages else 0 for g in groups] for e in entries]
        m = fixed_point(len(path) * B, B, self.model.rules, coverage, use_ssm=True)  # as RadixTree.prune_match
        return m // B * B


class RouterIndex:
    """Per-instance indexes of one model's fleet."""

    def __init__(self, model: RouterModel) -> None:
        self.model = model
        self.instances: dict[Any, InstanceIndex] = {}

    def instance(self, name: Any) -> InstanceIndex:
        idx = self.instances.get(name)
        if idx is None:
            idx = self.instances[name] = InstanceIndex(self.model)
        return idx

    def apply(self, name: Any, batch: Any) -> None:
        """Apply one decoded ``KVEventBatch`` of instance ``name`` (all or nothing:
        :class:`InvalidBatchError` leaves the index unchanged)."""
        self.instance(name).apply(batch.events)

    def reset(self, name: Any, batch: Any) -> None:
        """Replace instance ``name``'s state by a snapshot batch (validated first: an
        invalid one raises and leaves the old state)."""
        idx = self.instance(name)
        events = list(batch.events)
        idx.validate(events)
        idx.clear()
        idx.apply(events)

    def clear(self, name: Any) -> None:
        """Forget what instance ``name`` announced (it answers 0 until fed again)."""
        self.instance(name).clear()

    def keys(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> list[bytes]:
        from kvcm import block_keys

        B = self.model.block_size
        n = len(tokens) // B
        return block_keys(list(tokens[: n * B]), B, scope) if n else []

    def reuse(self, name: Any, tokens: Sequence[Token], scope: ReuseScope | None = None) -> int:
        return self.instance(name).reuse_keys(self.keys(tokens, scope))

    def reuse_all(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> dict[Any, int]:
        """``{instance: reusable tokens}`` for every known instance (keys hashed once)."""
        keys = self.keys(tokens, scope)
        return {name: idx.reuse_keys(keys) for name, idx in self.instances.items()}


__all__ = ["BlockKey", "GroupSpec", "InstanceIndex", "InvalidBatchError", "RouterIndex", "RouterModel", "block_key"]
