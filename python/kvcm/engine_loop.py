"""The engine side of kvcm's protocol, in one place (SPEC sec. 14, 15; DECISIONS.md "The engine loop").

Every engine that drives a manager does the same two things around its own scheduling:

* **admission** — ask the shared store which of the prompt's blocks it holds (one batched
  query, only with a shared tier), ``create_kv_cache`` with those hits, ``resume`` (and
  ``resize`` to the room the request needs now); a refusal closes the new request.  An
  engine that decides before it admits (vLLM asks how much is cached first) probes with the
  same hits, without side effects (:meth:`EngineLoop.probe`), and admits with them;
* **sync** — drain the manager's copy runs, execute them in the data plane, and report the
  ops that did not complete (a ``CopyError``: disk I/O, a checksum, a store load) so that
  the manager forgets their pages and rolls back the requests that used them; the engine
  then recomputes those requests from their new committed length.

:class:`EngineLoop` is that protocol; the reference engine (``kvcm.engine``), the tools
(``kvcm.tools.soak``, ``kvcm.tools.fleet_replay``), the transformers integration and, by
halves, the vLLM connector use it.
Its halves can be used apart, for an engine whose copies run elsewhere or later (vLLM's
scheduler and workers): :meth:`EngineLoop.admit` with ``sync=False`` and
:meth:`EngineLoop.drain` on the side that owns the manager, :meth:`EngineLoop.apply` on the
side that owns the bytes, and :meth:`EngineLoop.report` back on the manager's side, once per
non-empty drain, in drain order (with explicit settlement, drains later).  With several
sides that own bytes (vLLM's tensor-parallel ranks, each storing its shard of a block under
its own object name), a block is a shared hit only when every rank's object exists
(``lookup_planes``).

:func:`config_from_layout` is the config an engine builds from its layer layout, with every
tier sized in pages per life cycle.

This module imports no torch and nothing of the data plane at run time: a plane is any
object with ``apply_runs`` (and, for a shared tier, ``shared`` and ``shared_lookup``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from kvcm.api import AttentionLayer, CopyError, CopyOp, CopyRun, KVCacheManagerConfig, Layer, SsmLayer, Tier

if TYPE_CHECKING:
    from kvcm.api import KVCache, KVCacheManager, ReuseProbe, ReuseScope
    from kvcm.dataplane import DataPlane

ASK: Final = object()
"""``shared_hits=ASK`` (the default): ask the store now.  Any other value is the store's
answer from an earlier :meth:`EngineLoop.probe` (None: no shared tier), used as it is."""


def page_bytes(tokens_per_block: int, layers: Sequence[Layer]) -> int:
    """Bytes of one page of every life cycle of ``layers``: an attention layer's
    ``bytes_per_token`` times ``tokens_per_block``, plus an ssm layer's ``state_bytes`` (each
    layer belongs to exactly one life cycle, so this is the sum of their ``slot_bytes``)."""
    total = 0
    for layer in layers:
        if isinstance(layer, AttentionLayer):
            total += layer.bytes_per_token * tokens_per_block
        elif isinstance(layer, SsmLayer):
            total += layer.state_bytes
        else:
            raise TypeError(f"a layer must be an AttentionLayer or an SsmLayer, got {type(layer).__name__}")
    return total


def config_from_layout(tokens_per_block: int, layers: Sequence[Layer], *, gpu_blocks: int, host_blocks: int = 0,
                       disk_blocks: int = 0, disk_path: str | None = None, shared: str | None = None,
                       shared_quota_bytes: int = 0, **options: Any) -> KVCacheManagerConfig:
    """The config of an engine whose layers are ``layers``, each tier sized in pages per life
    cycle (a tier of ``n`` blocks holds ``n`` pages of every life cycle: ``n *``
    :func:`page_bytes` bytes, kvcm's default split): ``gpu``, then ``host`` and ``disk``
    (``disk_path`` its directory) when their block count is not 0, then the ``shared`` tier on
    that store location (``shared_quota_bytes``: the tier's ``quota_bytes``) when given.
    ``options``: the other ``KVCacheManagerConfig`` fields (``shared_namespace``, ...)."""
    per_block = page_bytes(tokens_per_block, layers)
    tiers = [Tier("gpu", gpu_blocks * per_block)]
    if host_blocks:
        tiers.append(Tier("host", host_blocks * per_block))
    if disk_blocks:
        tiers.append(Tier("disk", disk_blocks * per_block, path=disk_path))
    if shared:
        tiers.append(Tier("shared", shared_quota_bytes, path=shared))
    return KVCacheManagerConfig(tokens_per_block=tokens_per_block, layers=list(layers), tiers=tiers, **options)


class EngineLoop:
    """Admission and copy settlement for one manager (module docstring).

    ``manager``: the kvcm manager (``None`` on a side that only applies copies).  ``plane``:
    the data plane that executes its copies (``None`` on a side that only drains and reports).  ``lookup_plane``: the plane that
    answers shared-store queries at admission (default ``plane``; ``None`` and no ``plane``:
    no lookups).  ``lookup_planes``: several planes that answer them together, in place of
    ``lookup_plane``: a block is a hit only when every one holds its object (one plane per
    tensor-parallel rank, each naming objects with its rank).  ``on_rollback``: called with the id of each cache the manager rolled back
    (after the report that rolled it back; the cache is SUSPENDED, its committed tokens cut to
    before the first lost block: resume it and recompute from ``num_committed_tokens``).

    Attributes:
        manager: the manager, or None.
        plane: the plane that executes copies, or None.
        lookup_plane: the plane that answers shared lookups, or None (the first of
            ``lookup_planes`` when those are given).
        lookup_planes: every plane that must hold a block's object for a shared hit.
        on_rollback: the roll-back callback, or None.
        counters: ``copy_failures`` (applies that raised ``CopyError``), ``failed_ops``,
            ``rollbacks`` (caches rolled back), ``shared_hits`` ((key, lc) pairs the store held
            at admission), ``refused`` (admissions refused: no room on gpu).
        last_shared_hits: the pairs the store held for the last :meth:`create`.
        last_error: the ``CopyError`` of the last failed :meth:`apply`, or None."""

    # resume(): how many roll-backs in a row before the admission gives up for now (a failure
    # that repeats, e.g. a live ssm state whose copy keeps failing, re-matches the same prefix)
    RESUME_ATTEMPTS = 3

    def __init__(self, manager: KVCacheManager | None, plane: DataPlane | None = None, *,
                 lookup_plane: DataPlane | None = None, lookup_planes: Sequence[DataPlane] = (),
                 on_rollback: Callable[[int | str], None] | None = None) -> None:
        if lookup_planes and lookup_plane is not None:
            raise ValueError("EngineLoop: give lookup_plane or lookup_planes, not both")
        self.manager = manager
        self.plane = plane
        if lookup_planes:
            self.lookup_planes = list(lookup_planes)
        else:
            one = lookup_plane if lookup_plane is not None else plane
            self.lookup_planes = [one] if one is not None else []
        self.lookup_plane = self.lookup_planes[0] if self.lookup_planes else None
        self.on_rollback = on_rollback
        self.counters = dict.fromkeys(("copy_failures", "failed_ops", "rollbacks", "shared_hits", "refused"), 0)
        self.last_shared_hits = 0
        self.last_error: CopyError | None = None

    # ------------------------------------------------------------------ admission

    def shared_hits(self, tokens: Sequence[Any], scope: ReuseScope | None = None) -> list[tuple[bytes, int]] | None:
        """The ``(key, lc)`` pairs of ``tokens``' blocks past the local match that the shared
        store holds (one batched query per lookup plane; with several, the pairs every one
        holds, in candidate order), or None without a shared store to ask."""
        planes = self.lookup_planes
        if not planes or any(getattr(lp, "shared", None) is None for lp in planes):
            return None
        candidates = self.manager.shared_candidates(tokens, scope)
        if len(planes) == 1:
            return planes[0].shared_lookup(candidates)
        found: set[tuple[bytes, int]] | None = None
        for lp in planes:
            got = set(lp.shared_lookup(candidates))
            found = got if found is None else found & got
            if not found:
                return []
        return [c for c in candidates if c in found]

    def probe(self, tokens: Sequence[Any], scope: ReuseScope | None = None, *,
              shared_hits: Any = ASK) -> tuple[ReuseProbe, list[tuple[bytes, int]] | None]:
        """What :meth:`create` would match now, without side effects on the manager
        (``probe_reuse_detail``: the match and the coldest tier of each block's pages), with
        the store's hits (asked now, or ``shared_hits`` from an earlier probe of the same
        tokens); returns the probe and those hits.  Pass the hits to :meth:`create` or
        :meth:`admit` (``shared_hits=``): the request created then holds what was probed,
        and the store is not asked again."""
        hits = self.shared_hits(tokens, scope) if shared_hits is ASK else shared_hits
        return self.manager.probe_reuse_detail(tokens, scope, shared_hits=hits), hits

    def create(self, tokens: Sequence[Any], scope: ReuseScope | None = None, *, id: int | str | None = None,
               shared_hits: Any = ASK) -> KVCache:
        """``create_kv_cache(tokens, scope, id=id)`` with the shared store's hits (asked now,
        or ``shared_hits`` from :meth:`probe`): a SUSPENDED cache holding the longest match
        (local tiers and the store)."""
        hits = self.shared_hits(tokens, scope) if shared_hits is ASK else shared_hits
        self.last_shared_hits = len(hits or ())
        self.counters["shared_hits"] += self.last_shared_hits
        return self.manager.create_kv_cache(tokens, scope, id=id, shared_hits=hits)

    def resume(self, kv: KVCache, capacity: int | None = None, *, sync: bool = True) -> bool:
        """``kv.resume()`` (and ``kv.resize(capacity)``), then, with ``sync``, :meth:`sync`;
        again while that sync rolled ``kv`` back (the lost pages are gone from the tree, so it
        resumes from the shorter match), at most :attr:`RESUME_ATTEMPTS` times.  False: the gpu
        tier cannot hold it now (that refusal is not synced; ``kv`` is SUSPENDED, or ACTIVE
        when only the resize was refused), or its copies failed every attempt (SUSPENDED)."""
        for _ in range(self.RESUME_ATTEMPTS):
            if not kv.resume() or (capacity is not None and not kv.resize(capacity)):
                return False
            if not sync or kv.id not in self.sync():
                return True
        return False

    def admit(self, tokens: Sequence[Any], scope: ReuseScope | None = None, *, id: int | str | None = None,
              capacity: int | None = None, sync: bool = True, shared_hits: Any = ASK) -> KVCache | None:
        """:meth:`create` (``shared_hits`` as there) then :meth:`resume`: an ACTIVE cache whose
        matched pages are on gpu (and, with ``sync``, whose copies ran).  A refusal closes it
        (then syncs, with ``sync``) and returns None: the request waits and is admitted again
        later."""
        kv = self.create(tokens, scope, id=id, shared_hits=shared_hits)
        if self.resume(kv, capacity, sync=sync):
            return kv
        self.counters["refused"] += 1
        kv.close()
        if sync:
            self.sync()
        return None

    # ------------------------------------------------------------------ copies

    def drain(self) -> list[CopyRun]:
        """The manager's pending copy runs (``drain_copy_runs``), to be applied in order."""
        return self.manager.drain_copy_runs()

    def apply(self, runs: Sequence[CopyRun]) -> list[CopyOp]:
        """Execute ``runs`` in the plane; the ops that did not complete (``CopyError.ops``:
        the failed ops of the run that failed and every op after it), ``[]`` when all did."""
        if not runs:
            return []
        if self.plane is None:
            raise RuntimeError("EngineLoop.apply: this loop has no data plane")
        try:
            self.plane.apply_runs(runs)
        except CopyError as e:
            self.last_error = e
            self.counters["copy_failures"] += 1
            self.counters["failed_ops"] += len(e.ops)
            return list(e.ops)
        return []

    def report(self, failed: Sequence[CopyOp]) -> list[int | str]:
        """Tell the manager which ops of a drain did not complete; the ids of the caches it
        rolled back (each also passed to ``on_rollback``).  Call it once per non-empty drain,
        in drain order (``failed`` may be empty)."""
        ids = self._settle(list(failed))
        self.counters["rollbacks"] += len(ids)
        if self.on_rollback is not None:
            for cache_id in ids:
                self.on_rollback(cache_id)
        return ids

    def _settle(self, failed: list[CopyOp]) -> list[int | str]:
        # The one place that knows how a manager takes copy outcomes.  Today: forget_copies,
        # which takes the failed ops of the LAST drain only (so report before the next drain).
        # With KVCacheManagerConfig.copy_settlement="explicit" (settle_copies, settling the
        # oldest unsettled drain: reports may come several drains late) every non-empty drain
        # is settled, failures or not.
        if getattr(self.manager.config, "copy_settlement", "drain") == "explicit":
            return list(self.manager.settle_copies(failed))
        return list(self.manager.forget_copies(failed)) if failed else []

    def sync(self) -> list[int | str]:
        """:meth:`drain`, :meth:`apply`, :meth:`report`: the copies run before any page index
        of the step is used; returns the ids of the caches rolled back."""
        runs = self.drain()
        if not runs:
            return []
        return self.report(self.apply(runs))


__all__ = ["ASK", "EngineLoop", "config_from_layout", "page_bytes"]
