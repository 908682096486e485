"""One offload seam (issue 36 item 2): kvcm's manager and the manager side of the engine loop
behind the verbs of vLLM's ``OffloadingManager`` (``vllm/v1/kv_offload/base.py``), so that
every engine adapter — vLLM's scheduler, the disaggregated roles, the transformers
integration — drives the cache the same way and none drives the manager's whole API.

vLLM's verbs and what each one is in kvcm (a request's blocks are a kvcm cache: kvcm keys its
blocks by the prompt's token chain, so the verbs take a request's tokens, not block keys):

=================  ==========================================================================
vLLM               :class:`OffloadManager`
=================  ==========================================================================
``lookup``         :meth:`lookup`: how many leading tokens kvcm holds (local tiers, and the
                   shared store asked once, :meth:`store_hits`) and the tier each block is
                   in: a :class:`Lookup`, no side effect.
``prepare_load``   :meth:`prepare_load`: the request is admitted with the lookup's hits; its
                   matched pages are held (protected from eviction until :meth:`release`),
                   on tier 0 once the next drain ran (colder ones are onboarded).
``touch``          :meth:`touch`: the request's pages are used again (after a roll-back its
                   cache is SUSPENDED at the shorter match: resumed, pages held on tier 0).
``complete_load``  :meth:`complete_copies`: kvcm's own copies (the onboards a load waits for,
``complete_store`` offloads and store writes between its tiers) come out of :meth:`drain`
                   and are settled, failures and all, drain by drain; a failure rolls the
                   requests that used the lost pages back (their ids are returned).
``prepare_store``  :meth:`prepare_store`: pages for the request's blocks to be saved (the
                   slots the engine writes them into), or None when tier 0 cannot hold them.
``complete_store`` :meth:`complete_store`: blocks whose bytes are written enter kvcm's tree
                   (committed: from then on they are found by :meth:`lookup`).
``on_request_``    :meth:`release`: the request's cache closes (what it committed stays).
``finished``
``take_events``    :meth:`take_events`: the manager's events since the last call.
``reset_cache``    :meth:`reset`: every reusable page kvcm holds locally is dropped.
=================  ==========================================================================

Verbs an engine needs where kvcm is its tier-0 allocator too (the transformers integration,
whose paged blocks are kvcm's pages; vLLM allocates its own and has no such verbs):

=================  ==========================================================================
:meth:`suspend`    the request is preempted: its pages stay kvcm's, may leave tier 0, and
                   :meth:`touch` takes them back.
:meth:`fork`       a request branches (parallel sampling): a new cache sharing its pages.
:meth:`sync`       over an :class:`~kvcm.engine_loop.EngineLoop`: :meth:`drain`, the copies
                   run in this process, :meth:`complete_copies`, at once.
:meth:`room`       tier 0's pages per life cycle (free, droppable, held, total): what a
                   scheduler that asks "does it fit" reads.
=================  ==========================================================================

The seam imports the interface and the engine loop only (no torch, no data plane at run
time): the store is asked through the lookups the engine loop takes (``SharedLookup``: a data
plane's shared tier or a pool-less ``kvcm.dataplane.StoreClient``, one per tensor-parallel
rank).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcm.api import OutOfPagesError
from kvcm.engine_loop import ASK, EngineLoop, ManagerLoop, SharedLookup

if TYPE_CHECKING:
    from kvcm.api import CopyOp, CopyRun, KVCache, ReuseScope


@dataclass(frozen=True)
class Lookup:
    """What :meth:`OffloadManager.lookup` found: ``tokens`` leading tokens held (a whole
    number of blocks, or inside one with partial reuse), ``block_tiers`` the coldest tier of
    each held block's pages (0: tier 0; 3: the shared store), ``hits`` the store's answer it
    used (pass the lookup to :meth:`OffloadManager.prepare_load`: the cache created then holds
    exactly this; None: no store to ask)."""

    tokens: int
    block_tiers: tuple[int, ...]
    hits: list[tuple[bytes, int]] | None


@dataclass(frozen=True)
class StoreSlots:
    """Where :meth:`OffloadManager.prepare_store` put a request's blocks ``[first, end)``:
    per life cycle, the ``(block ordinal, slot)`` pairs of the blocks kvcm keeps a page of
    (a block out of a sliding window gets none)."""

    first: int
    end: int
    slots: tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class PoolRoom:
    """Tier 0's pages of one life cycle (:meth:`OffloadManager.room`): ``free`` (no page),
    ``droppable`` (reusable pages nothing holds: eviction takes them), ``held`` (pages of
    suspended requests: a colder tier can take them), out of ``total``."""

    free: int
    droppable: int
    held: int
    total: int


class OffloadManager:
    """The seam over one manager, through the engine loop's manager side ``loop`` (module
    doc): a :class:`~kvcm.engine_loop.ManagerLoop` where the bytes move elsewhere (vLLM's
    scheduler: its lookups one store client per rank), or an
    :class:`~kvcm.engine_loop.EngineLoop` where they move in the same process (the
    transformers integration, the reference engine): then :meth:`prepare_load` and
    :meth:`touch` run their copies at once.

    Attributes:
        manager: the kvcm manager.
        loop: the engine loop it admits, drains and settles through."""

    def __init__(self, loop: ManagerLoop) -> None:
        if not isinstance(loop, ManagerLoop):
            raise TypeError(f"OffloadManager: a ManagerLoop (or an EngineLoop) is required, got {type(loop).__name__}")
        self.loop = loop
        self.manager = loop.manager

    @property
    def block_size(self) -> int:
        return self.manager.config.tokens_per_block

    @property
    def lookups(self) -> list[SharedLookup]:
        return self.loop.lookups

    # ------------------------------------------------------------------ loads

    def store_hits(self, tokens: Sequence[Any], scope: ReuseScope | None = None) -> list[tuple[bytes, int]] | None:
        """The store's existence query for ``tokens``' blocks past the local match (one
        batched query per lookup), or None without a store to ask.  An adapter that looks a
        request up many times asks once and passes the answer to :meth:`lookup`."""
        return self.loop.shared_hits(tokens, scope)

    def stored(self, candidates: Iterable[tuple[bytes, int]]) -> set[tuple[bytes, int]]:
        """The ``(key, lc)`` pairs of ``candidates`` whose objects every lookup holds (a
        consumer's hand-over wait: one batched query per lookup); empty without one."""
        cands = list(candidates)
        found: set[tuple[bytes, int]] | None = None
        for lp in self.lookups:
            got = set(lp.shared_lookup(cands))
            found = got if found is None else found & got
        return found or set()

    def candidates(self, tokens: Sequence[Any], scope: ReuseScope | None = None) -> list[tuple[bytes, int]]:
        """The ``(key, lc)`` store objects of ``tokens``' blocks past the local match."""
        return self.manager.shared_candidates(tokens, scope)

    def lookup(self, tokens: Sequence[Any], scope: ReuseScope | None = None, *, hits: Any = ASK) -> Lookup:
        """What kvcm holds of ``tokens`` now (local tiers and the store's ``hits``: asked now
        by default, else an earlier :meth:`store_hits` answer), without side effects."""
        probe, hits = self.loop.probe(tokens, scope, shared_hits=hits)
        return Lookup(probe.num_tokens, tuple(probe.block_tiers), hits)

    def prepare_load(self, tokens: Sequence[Any], scope: ReuseScope | None, found: Lookup | None, *,
                     id: int | str | None = None) -> KVCache | None:
        """Admit a request whose ``tokens`` were looked up (``found``; None: not looked up,
        the store is not asked): an ACTIVE cache that holds what the lookup saw, its pages on
        tier 0 once the next :meth:`drain` ran; None when tier 0 cannot hold it now (nothing
        kept)."""
        return self.loop.admit(tokens, scope, id=id, shared_hits=found.hits if found is not None else None)

    def touch(self, kv: KVCache) -> bool:
        """Use ``kv``'s pages again (a cache a settlement rolled back is SUSPENDED at its
        shorter match: resumed, its pages held on tier 0, onboards in the next drain).
        False: tier 0 cannot hold it now."""
        return self.loop.resume(kv)

    # ------------------------------------------------------------------ saves

    def prepare_store(self, kv: KVCache, first: int, end: int, history: int | None = None, *,
                      tokens: int | None = None, exact: bool = False) -> StoreSlots | None:
        """Pages for ``kv``'s blocks ``[first, end)`` (its capacity grown to ``end`` blocks, or
        to ``tokens``: a partial last block; ``history``: at least this many tokens computed,
        so that blocks out of a sliding window by then get no page): their slots per life
        cycle.  None: tier 0 cannot hold them (nothing changed past what was prepared before).
        ``exact``: the capacity becomes exactly that many tokens, in one resize, even when it
        held more (an engine whose step's room kvcm allocates: the transformers integration)."""
        need = end * self.block_size if tokens is None else tokens
        hist = None if history is None else max(kv.history_length, history)
        if exact:
            if not kv.resize(need, hist):
                return None
        else:
            if kv.capacity < need and not kv.resize(need, hist):
                return None
            if hist is not None and hist > kv.history_length and not kv.resize(kv.capacity, hist):
                return None
        slots = []
        for lc in range(len(self.manager.life_cycles)):
            got = kv.page_indices(lc, first, end)  # the new blocks only (no per-block O(length) read)
            slots.append(tuple((i, s) for i, s in enumerate(got, first) if s >= 0))  # -1: stale
        return StoreSlots(first, end, tuple(slots))

    def complete_store(self, kv: KVCache, tokens: Sequence[Any]) -> None:
        """``tokens`` (those after kv's committed ones) are written: committed into kvcm's tree
        (their full blocks are found by later lookups)."""
        kv.commit(list(tokens))

    def release(self, kv: KVCache) -> None:
        """The request is done with kvcm: its cache closes (what it committed stays)."""
        kv.close()

    def suspend(self, kv: KVCache) -> None:
        """The request is preempted: its pages stay kvcm's (HELD: eviction may offload them,
        never drop them) until :meth:`touch` takes them back to tier 0."""
        kv.suspend()

    def fork(self, kv: KVCache, *, id: int | str | None = None) -> KVCache | None:
        """A new ACTIVE cache ``id`` branching ``kv`` (parallel sampling): it shares every page
        ``kv`` holds for its committed tokens, copy-on-write.  None: tier 0 cannot hold what
        the branch needs now (nothing changed)."""
        try:
            return kv.fork(id=id)
        except OutOfPagesError:
            return None

    # ------------------------------------------------------------------ kvcm's own copies

    def drain(self) -> list[CopyRun]:
        """kvcm's pending copy runs (onboards, offloads, store writes), for the side that
        owns the bytes; settle each non-empty drain with :meth:`complete_copies`, in order."""
        return self.loop.drain()

    def complete_copies(self, failed: Sequence[CopyOp]) -> list[int | str]:
        """The oldest unsettled drain ran; ``failed``: its ops that did not complete.  The
        ids of the caches rolled back (their committed tokens cut before the first lost
        block: :meth:`touch` them to go on)."""
        return self.loop.report(failed)

    def sync(self) -> list[int | str]:
        """Over an :class:`~kvcm.engine_loop.EngineLoop` (the bytes move in this process):
        :meth:`drain`, run the copies, :meth:`complete_copies`, now; the ids of the caches
        rolled back.  A seam over a ``ManagerLoop`` alone leaves its copies to the side that
        owns the bytes (TypeError)."""
        if not isinstance(self.loop, EngineLoop):
            raise TypeError("OffloadManager.sync: the copies run where the bytes are; over a ManagerLoop, "
                            "drain() and complete_copies() what that side applied")
        return self.loop.sync()

    # ------------------------------------------------------------------ the rest

    def room(self) -> tuple[PoolRoom, ...]:
        """Tier 0's pages per life cycle (:class:`PoolRoom`, by life cycle id)."""
        return tuple(PoolRoom(row["free"], row["droppable"], row["held"], row["total"])
                     for row in self.manager.stats()["tiers"][0]["lc"])

    def take_events(self) -> list[Any]:
        """The manager's events since the last call."""
        return self.manager.take_events()

    def reset(self) -> None:
        """Drop every reusable page kvcm holds locally (the shared store is left alone)."""
        self.manager.clear_reusable()

    def stats(self) -> dict[str, Any]:
        return self.manager.stats()


__all__ = ["Lookup", "OffloadManager", "PoolRoom", "StoreSlots"]
