"""What one instance has announced on the wire, and how kvcm events become wire events.

``WireState`` keeps a mirror of the blocks a subscriber currently believes the instance
holds — per block: its parent, tokens, scope and, per life cycle, the tier of its page —
built from ``manager.snapshot()`` (the public picture of the tree, SPEC sec. 11) and then
moved forward by the events of ``take_events()``.  It needs no manager internals.

Mapping (kvcm event -> vLLM wire event, see ``kvcm.fleet.wire``):

* ``stored`` of a full block -> ``BlockStored`` per life cycle: ``block_hashes=[key]``,
  ``parent_block_hash`` = the parent's key, or None when the parent is a scope root;
  ``token_ids`` = the block's tokens (a 32-byte digest token is written as ``-1`` and named
  in ``extra_keys`` as ``("digest", offset, hex)``); ``block_size`` = B;
  ``lora_id`` = the scope's ``lora_id``; ``lora_name`` = None (kvcm scopes have no adapter
  names); ``extra_keys`` = ``[("salt", salt)]`` on the first block of a salted scope;
  ``medium`` from the tier (gpu ``GPU``, host ``CPU``, disk ``STORAGE``, shared
  ``SHARED`` — a kvcm value: vLLM has no medium for a store shared by instances — by SPEC
  tier number); ``group_idx`` = life cycle id; ``kv_cache_spec_kind`` = ``full_attention`` /
  ``sliding_window`` / ``mamba``; ``kv_cache_spec_sliding_window`` = the window;
  extension ``kvcm_sink_tokens`` = the sink tokens of a windowed life cycle; extension
  ``kvcm_coverage`` = the page's coverage when it is less than B (else absent).
  Consecutive blocks of one chain with equal group, medium and scope, each covered whole,
  share one event.  A coverage upgrade arrives as ``removed`` + ``stored`` and goes out as
  ``BlockRemoved`` + ``BlockStored``.
* ``stored`` flagged ``partial`` -> nothing: a partial block cannot be matched by hash.
* ``removed(keys, lc)`` -> ``BlockRemoved(keys, medium, group_idx=lc)``, the medium being
  the tier the page was announced on; keys never announced (partial blocks) are skipped.
* ``tier_changed(key, lc, old, new)`` -> ``BlockRemoved`` on the old medium, then
  ``BlockStored`` on the new one.
* ``cleared`` -> ``AllBlocksCleared``, then the blocks still held (``clear_reusable`` only
  drops DROPPABLE pages; its ``removed`` events came first) restated as ``BlockStored``,
  so a vLLM subscriber that empties its index on ``AllBlocksCleared`` stays right.

A scope's first blocks name no parent only when the scope root is known: the default scope,
scopes given to the constructor or ``register_scope``, and scopes of the requests in a loaded
snapshot.  Otherwise the root key itself is the parent hash (it is the parent in kvcm's key
chain, so a kvcm router is not affected) and ``lora_id`` is None.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.api import ClearedEvent, Event, RemovedEvent, ReuseScope, StoredEvent, TierChangedEvent, Token
from kvcm.config import LifeCycle
from kvcm.fleet.wire import KIND_FULL, KIND_MAMBA, KIND_WINDOW, MEDIA, AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.keys import scope_root_key

DIGEST_PLACEHOLDER = -1


def medium_of(tier: int) -> str:
    """The wire ``medium`` of manager tier number ``tier``."""
    return MEDIA[tier]


def spec_fields(lc: LifeCycle) -> dict[str, Any]:
    """``group_idx`` and the cache-spec fields of a life cycle's ``BlockStored``."""
    if lc.kind == "ssm":
        return {"group_idx": lc.id, "kv_cache_spec_kind": KIND_MAMBA}
    if lc.window is None:
        return {"group_idx": lc.id, "kv_cache_spec_kind": KIND_FULL}
    return {"group_idx": lc.id, "kv_cache_spec_kind": KIND_WINDOW, "kv_cache_spec_sliding_window": lc.window,
            "kvcm_sink_tokens": lc.sinks or None}


@dataclass
class _Block:
    parent: bytes | None  # the parent key in kvcm's chain (a scope root key for a first block)
    tokens: tuple[Token, ...]
    scope: ReuseScope | None  # None: unknown
    pages: dict[int, int] = field(default_factory=dict)  # lc -> tier
    coverage: dict[int, int] = field(default_factory=dict)  # lc -> tokens covered (< B only)


class WireState:
    """The announced blocks of one instance, and the translation of its events."""

    def __init__(self, life_cycles: Sequence[LifeCycle], tokens_per_block: int,
                 scopes: Iterable[ReuseScope] = (), media: Sequence[str] = MEDIA) -> None:
        self.B = tokens_per_block
        # the medium announced for each tier number (an engine whose tier 0 is not a gpu, e.g.
        # kvcm inside vLLM, where tier 0 is host memory, names its own)
        self._media = tuple(media)
        self._spec = [spec_fields(lc) for lc in life_cycles]
        self._roots: dict[bytes, ReuseScope] = {}
        self._blocks: dict[bytes, _Block] = {}
        self.register_scope(ReuseScope())
        for s in scopes:
            self.register_scope(s)

    # ------------------------------------------------------------------ scopes / state

    def register_scope(self, scope: ReuseScope) -> None:
        """Remember ``scope`` so events of its blocks can name it (by its root key)."""
        self._roots[scope_root_key(scope)] = scope

    @property
    def num_pages(self) -> int:
        """Pages of the blocks the wire currently knows stored."""
        return sum(len(b.pages) for b in self._blocks.values())

    def announced(self) -> dict[tuple[bytes, int], int]:
        """``{(key, lc): tier}`` of every announced page (for tests and diagnostics)."""
        return {(k, lc): t for k, b in self._blocks.items() for lc, t in b.pages.items()}

    def load_snapshot(self, snap: dict) -> None:
        """Replace the mirror by the full blocks with pages of ``manager.snapshot()``."""
        for r in snap.get("requests", ()):
            lora, salt = r["scope"]
            self.register_scope(ReuseScope(lora, salt))
        tiers = {p["serial"]: p["tier"] for p in snap["pages"]}
        nodes = {n["id"]: n for n in snap["tree"]}
        keys = {nid: bytes.fromhex(n["key"]) for nid, n in nodes.items()}
        self._blocks = {}
        for n in snap["tree"]:  # node id order = creation order
            if n["root"] or not n["attached"] or len(n["tokens"]) < self.B:
                continue
            pages = {lc: tiers[p["page"]] for lc, p in enumerate(n["pages"]) if p is not None}
            if not pages:
                continue
            coverage = {lc: p["coverage"] for lc, p in enumerate(n["pages"])
                        if p is not None and p["coverage"] < self.B}
            parent = keys[n["parent"]] if n["parent"] is not None else None
            tokens = tuple(t if isinstance(t, int) else bytes.fromhex(t["digest"]) for t in n["tokens"])
            self._blocks[keys[n["id"]]] = _Block(parent, tokens, self._scope_in(nodes, keys, n), pages, coverage)

    def _scope_in(self, nodes: dict, keys: dict, n: dict) -> ReuseScope | None:
        while n["parent"] is not None:
            n = nodes[n["parent"]]
        return self._roots.get(keys[n["id"]]) if n["root"] else None

    # ------------------------------------------------------------------ translation

    def translate(self, events: Iterable[Event]) -> list[Any]:
        """The wire events of ``events`` (in order); moves the mirror forward."""
        out: list[Any] = []
        for e in events:
            if isinstance(e, StoredEvent):
                if e.partial:
                    continue
                for b in e.blocks:
                    self._stored(out, b.key, e.parent_key, b.tokens, b.lc, b.tier, b.coverage)
            elif isinstance(e, RemovedEvent):
                for key in e.keys:
                    blk = self._blocks.get(key)
                    if blk is None or e.lc not in blk.pages:
                        continue  # never announced (a partial block)
                    tier = blk.pages.pop(e.lc)
                    blk.coverage.pop(e.lc, None)
                    if not blk.pages:
                        del self._blocks[key]
                    self._removed(out, key, e.lc, tier)
            elif isinstance(e, TierChangedEvent):
                blk = self._blocks.get(e.key)
                if blk is None or e.lc not in blk.pages:
                    continue
                self._removed(out, e.key, e.lc, blk.pages[e.lc])
                blk.pages[e.lc] = e.new_tier
                self._emit_stored(out, e.key, blk, e.lc)
            elif isinstance(e, ClearedEvent):
                out.extend(self.restatement())
        return out

    def restatement(self) -> list[Any]:
        """``AllBlocksCleared``, then every announced page as ``BlockStored``, parents
        before children (depth first from the blocks whose parent is not announced)."""
        out: list[Any] = [AllBlocksCleared()]
        children: dict[bytes, list[bytes]] = {}
        tops: list[bytes] = []
        for key, blk in self._blocks.items():
            if blk.parent is not None and blk.parent in self._blocks:
                children.setdefault(blk.parent, []).append(key)
            else:
                tops.append(key)
        stack = list(reversed(tops))
        while stack:
            key = stack.pop()
            blk = self._blocks[key]
            for lc in sorted(blk.pages):
                self._emit_stored(out, key, blk, lc)
            stack.extend(reversed(children.get(key, ())))
        return out

    def _stored(self, out: list, key: bytes, parent: bytes | None, tokens: Sequence[Token], lc: int, tier: int,
                coverage: int) -> None:
        blk = self._blocks.get(key)
        if blk is None:
            if parent in self._roots:
                scope: ReuseScope | None = self._roots[parent]
            else:
                pb = self._blocks.get(parent) if parent is not None else None
                scope = pb.scope if pb is not None else None
            blk = self._blocks[key] = _Block(parent, tuple(tokens), scope)
        old = blk.pages.get(lc)
        cov = coverage if coverage < self.B else None
        if old == tier and blk.coverage.get(lc) == cov:
            return
        if old is not None:
            self._removed(out, key, lc, old)
        blk.pages[lc] = tier
        if cov is None:
            blk.coverage.pop(lc, None)
        else:
            blk.coverage[lc] = cov
        self._emit_stored(out, key, blk, lc)

    def _emit_stored(self, out: list, key: bytes, blk: _Block, lc: int) -> None:
        medium = self._media[blk.pages[lc]]
        first = blk.parent in self._roots
        parent = None if first else blk.parent
        scope = blk.scope
        lora = scope.lora_id if scope is not None else None
        extra: list[tuple] = []
        if first and scope is not None and scope.salt is not None:
            extra.append(("salt", scope.salt))
        if bytes in set(map(type, blk.tokens)):
            tokens: list[int] = []
            for i, t in enumerate(blk.tokens):
                if isinstance(t, int):
                    tokens.append(t)
                else:
                    tokens.append(DIGEST_PLACEHOLDER)
                    extra.append(("digest", i, t.hex()))
        else:
            tokens = list(blk.tokens)
        block_extra = tuple(extra) if extra else None
        cov = blk.coverage.get(lc)
        last = out[-1] if out else None
        if (cov is None and isinstance(last, BlockStored) and last.kvcm_coverage is None
                and last.group_idx == lc and last.medium == medium
                and last.lora_id == lora and parent is not None and last.block_hashes[-1] == parent):
            last.block_hashes.append(key)
            last.token_ids.extend(tokens)
            if block_extra is not None or last.extra_keys is not None:
                if last.extra_keys is None:
                    last.extra_keys = [None] * (len(last.block_hashes) - 1)
                last.extra_keys.append(block_extra)
            return
        out.append(BlockStored(
            block_hashes=[key], parent_block_hash=parent, token_ids=tokens, block_size=self.B,
            lora_id=lora, medium=medium, lora_name=None,
            extra_keys=[block_extra] if block_extra is not None else None, **self._spec[lc],
            kvcm_coverage=cov,
        ))

    def _removed(self, out: list, key: bytes, lc: int, tier: int) -> None:
        medium = self._media[tier]
        last = out[-1] if out else None
        if isinstance(last, BlockRemoved) and last.group_idx == lc and last.medium == medium:
            last.block_hashes.append(key)
            return
        out.append(BlockRemoved(block_hashes=[key], medium=medium, group_idx=lc))


__all__ = ["DIGEST_PLACEHOLDER", "WireState", "medium_of", "scope_root_key", "spec_fields"]
