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

:class:`ManagerLoop` is the side that owns the manager (admission: store hits, probe,
create, resume, resize, the retry after a roll-back, :meth:`ManagerLoop.retry`; the drain and
the report), :class:`PlaneLoop` the side that owns the bytes (apply), and
:class:`EngineLoop` both in one process, its copies run at once (``sync``).  Neither side
takes ``None`` for the other: an engine whose copies run elsewhere or later (vLLM's scheduler
and workers) builds a ``ManagerLoop`` where the manager is (admit, drain) and a ``PlaneLoop``
where the bytes are (apply), and reports back on the manager's side, once per non-empty
drain, in drain order (with explicit settlement, drains later).  With several sides that
own bytes (vLLM's tensor-parallel ranks, each storing its shard of a block under its own
object name), a block is a shared hit only when every rank's object exists (``lookups``).
An engine that counts a request admitted only after more work (the reference engine
prefills it) passes its own attempt to :meth:`ManagerLoop.retry`: one retry rule for all.
The reference engine (``kvcm.engine``), the tools (``kvcm.tools.soak``,
``kvcm.tools.fleet_replay``) and the transformers integration use ``EngineLoop``; the vLLM
connector the two sides (through :mod:`kvcm.offload` on the manager's side).

:func:`config_from_layout` is the config an engine builds from its layer layout, with every
tier sized in pages per life cycle.

This module imports no torch and nothing of the data plane at run time: a plane is any
object with ``apply_runs`` (and, for a shared tier, ``shared`` and ``shared_lookup``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

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


class SharedLookup(Protocol):
    """What answers the shared store's existence query at admission: a data plane with a
    shared tier (``DataPlane.shared_lookup``) or a store client without pools
    (``kvcm.dataplane.StoreClient``)."""

    def shared_lookup(self, candidates: Iterable[tuple[bytes, int]]) -> list[tuple[bytes, int]]: ...


class ManagerLoop:
    """The side of the protocol that owns the manager (module docstring): admission (the
    store's hits, probe, create, resume, resize, a refusal closes), the drain and the report
    of what the plane side did with it.

    ``manager``: the kvcm manager.  ``lookups``: what answers the shared store's existence
    query at admission (:class:`SharedLookup`: a data plane with a shared tier, a store
    client); with several, a block is a hit only when every one holds its object (one per
    tensor-parallel rank, each naming objects with its rank); none: no lookups.
    ``on_rollback``: called with the id of each cache the manager rolled back (after the
    report that rolled it back; the cache is SUSPENDED, its committed tokens cut to before
    the first lost block: resume it and recompute from ``num_committed_tokens``).
    ``counters``: a dict to count into (default: a new one).

    Attributes:
        manager: the manager.
        lookups: every lookup that must hold a block's object for a shared hit.
        on_rollback: the roll-back callback, or None.
        counters: ``rollbacks`` (caches rolled back), ``shared_hits`` ((key, lc) pairs the
            store held at admission), ``refused`` (admissions refused: no room on gpu).
        last_shared_hits: the pairs the store held for the last :meth:`create`."""

    # retry(): how many roll-backs in a row before the admission gives up for now (a failure
    # that repeats, e.g. a live ssm state whose copy keeps failing, re-matches the same prefix)
    RESUME_ATTEMPTS = 3

    def __init__(self, manager: KVCacheManager, *, lookups: Sequence[SharedLookup] = (),
                 on_rollback: Callable[[int | str], None] | None = None,
                 counters: dict[str, int] | None = None) -> None:
        if manager is None:
            raise TypeError("ManagerLoop: a manager is required (a side that only applies copies is a PlaneLoop)")
        self.manager = manager
        self.lookups = list(lookups)
        self.on_rollback = on_rollback
        self.counters = counters if counters is not None else {}
        for name in ("rollbacks", "shared_hits", "refused"):
            self.counters.setdefault(name, 0)
        self.last_shared_hits = 0

    # ------------------------------------------------------------------ admission

    def shared_hits(self, tokens: Sequence[Any], scope: ReuseScope | None = None) -> list[tuple[bytes, int]] | None:
        """The ``(key, lc)`` pairs of ``tokens``' blocks past the local match that the shared
        store holds (one batched query per lookup; with several, the pairs every one holds, in
        candidate order), or None without a shared store to ask."""
        lookups = self.lookups
        if not lookups or any(getattr(lp, "shared", None) is None for lp in lookups):
            return None
        candidates = self.manager.shared_candidates(tokens, scope)
        if len(lookups) == 1:
            return lookups[0].shared_lookup(candidates)
        found: set[tuple[bytes, int]] | None = None
        for lp in lookups:
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

    def retry(self, attempt: Callable[[], bool | None], attempts: int | None = RESUME_ATTEMPTS) -> bool:
        """The admission's retry, in one place: ``attempt()`` (one try at making a request
        ready: resume, resize, its copies, and whatever the engine does before it counts the
        request as admitted, e.g. the reference engine's prefill) answers True (admitted),
        False (refused: no room now) or None (the request was rolled back meanwhile: the lost
        pages are gone from the tree, so the next try resumes from the shorter match); tried
        again while it answers None, at most ``attempts`` times (None: until it answers).
        False after the last roll-back."""
        n = 0
        while attempts is None or n < attempts:
            n += 1
            verdict = attempt()
            if verdict is not None:
                return verdict
        return False

    def resume(self, kv: KVCache, capacity: int | None = None) -> bool:
        """``kv.resume()`` (and ``kv.resize(capacity)``), then its copies (:meth:`_run_copies`:
        on this side, left to the plane side's next apply; :class:`EngineLoop` runs them now);
        again while they rolled ``kv`` back (:meth:`retry`).  False: the gpu tier cannot hold
        it now (``kv`` is SUSPENDED, or ACTIVE when only the resize was refused; that refusal
        runs no copies), or its copies failed every attempt (SUSPENDED)."""
        def attempt() -> bool | None:
            if not kv.resume() or (capacity is not None and not kv.resize(capacity)):
                return False
            return None if self._run_copies(kv) else True
        return self.retry(attempt)

    def admit(self, tokens: Sequence[Any], scope: ReuseScope | None = None, *, id: int | str | None = None,
              capacity: int | None = None, shared_hits: Any = ASK) -> KVCache | None:
        """:meth:`create` (``shared_hits`` as there) then :meth:`resume`: an ACTIVE cache whose
        matched pages are on gpu once its copies ran.  A refusal closes it (then runs the
        copies, with :class:`EngineLoop`) and returns None: the request waits and is admitted
        again later."""
        kv = self.create(tokens, scope, id=id, shared_hits=shared_hits)
        if self.resume(kv, capacity):
            return kv
        self.counters["refused"] += 1
        kv.close()
        self._run_copies(None)
        return None

    def _run_copies(self, kv: KVCache | None) -> bool:
        """The hook where the admission's copies run: True when they rolled ``kv`` back.  On
        this side they run on the plane side, after the next :meth:`drain` (the roll-back, if
        any, comes with its :meth:`report`): nothing to do now."""
        return False

    # ------------------------------------------------------------------ copies

    def drain(self) -> list[CopyRun]:
        """The manager's pending copy runs (``drain_copy_runs``), to be applied in order."""
        return self.manager.drain_copy_runs()

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


class PlaneLoop:
    """The side of the protocol that owns the bytes (module docstring): it executes copy runs
    in ``plane`` (a data plane: ``apply_runs``) and says which ops did not complete; the
    manager's side reports them.  ``counters``: a dict to count into (default: a new one).

    Attributes:
        plane: the plane that executes copies.
        counters: ``copy_failures`` (applies that raised ``CopyError``), ``failed_ops``.
        last_error: the ``CopyError`` of the last failed :meth:`apply`, or None."""

    def __init__(self, plane: DataPlane, *, counters: dict[str, int] | None = None) -> None:
        if plane is None:
            raise TypeError("PlaneLoop: a data plane is required")
        self.plane = plane
        self.counters = counters if counters is not None else {}
        for name in ("copy_failures", "failed_ops"):
            self.counters.setdefault(name, 0)
        self.last_error: CopyError | None = None

    def apply(self, runs: Sequence[CopyRun]) -> list[CopyOp]:
        """Execute ``runs`` in the plane; the ops that did not complete (``CopyError.ops``:
        the failed ops of the run that failed and every op after it), ``[]`` when all did."""
        if not runs:
            return []
        try:
            self.plane.apply_runs(runs)
        except CopyError as e:
            self.last_error = e
            self.counters["copy_failures"] += 1
            self.counters["failed_ops"] += len(e.ops)
            return list(e.ops)
        return []


class EngineLoop(ManagerLoop):
    """Both sides in one process (module docstring): a :class:`ManagerLoop` over ``manager``
    whose copies a :class:`PlaneLoop` over ``plane`` executes at once (:meth:`sync`), so that
    an admission resumes again when its own copies rolled it back.  The shared store is asked
    through ``plane`` (its shared tier), or ``lookup_plane``, or every one of
    ``lookup_planes`` (as :class:`ManagerLoop`'s ``lookups``).  One ``counters`` dict holds
    both sides' counters.

    Attributes (besides :class:`ManagerLoop`'s):
        plane: the plane that executes copies.
        applier: the :class:`PlaneLoop` over it.
        lookup_plane: the first lookup, or None.
        last_error: the ``CopyError`` of the last failed apply, or None."""

    def __init__(self, manager: KVCacheManager, plane: DataPlane, *, lookup_plane: SharedLookup | None = None,
                 lookup_planes: Sequence[SharedLookup] = (),
                 on_rollback: Callable[[int | str], None] | None = None) -> None:
        if lookup_planes and lookup_plane is not None:
            raise ValueError("EngineLoop: give lookup_plane or lookup_planes, not both")
        lookups = list(lookup_planes) or [lookup_plane if lookup_plane is not None else plane]
        counters = dict.fromkeys(("copy_failures", "failed_ops", "rollbacks", "shared_hits", "refused"), 0)
        super().__init__(manager, lookups=lookups, on_rollback=on_rollback, counters=counters)
        self.applier = PlaneLoop(plane, counters=counters)
        self.plane = plane
        self.lookup_plane = self.lookups[0]

    @property
    def last_error(self) -> CopyError | None:
        return self.applier.last_error

    def apply(self, runs: Sequence[CopyRun]) -> list[CopyOp]:
        """:meth:`PlaneLoop.apply`."""
        return self.applier.apply(runs)

    def _run_copies(self, kv: KVCache | None) -> bool:
        # the admission's copies run now: a roll-back of kv is known before it is admitted
        rolled_back = self.sync()
        return kv is not None and kv.id in rolled_back

    def sync(self) -> list[int | str]:
        """Drain, apply, report: the copies run before any page index of the step is used;
        returns the ids of the caches rolled back."""
        runs = self.drain()
        if not runs:
            return []
        return self.report(self.apply(runs))


__all__ = ["ASK", "EngineLoop", "ManagerLoop", "PlaneLoop", "SharedLookup", "config_from_layout", "page_bytes"]
