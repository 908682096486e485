"""``KvcmScheduler``: the scheduler side of the connector (vLLM's scheduler process): an
adapter from vLLM's scheduler hooks to kvcm's offload seam.

It owns kvcm's manager and tracks each vLLM request that runs as a kvcm request (a
:class:`~kvcm.integrations.vllm.tracker.RequestTracker`), whose pages live in kvcm's tier 0
(host memory), then disk, then the shared store (DECISIONS.md "vLLM connector").  Every
manager call goes through :class:`kvcm.offload.OffloadManager` (over the engine loop's
manager side, :class:`kvcm.engine_loop.ManagerLoop`, whose store lookups are one pool-less
``StoreClient`` per rank; the workers' ``PlaneLoop`` applies).  It imports nothing of vLLM:
the requests and scheduler outputs it reads are duck-typed (``request_id``, ``all_token_ids``,
``num_computed_tokens``; ``num_scheduled_tokens``, ``preempted_req_ids``,
``total_num_scheduled_tokens``, ``kv_connector_block_state`` or the new / cached request
data), so tests drive it without an engine.

Per step (vLLM's order; under async scheduling vLLM builds step N+1 before it hands over
the workers' output of step N, and nothing here depends on that output being in):

* ``get_num_new_matched_tokens`` (a waiting request, maybe several times): the seam's
  ``lookup`` (no side effects) with the store's answer (``store_hits``: cached per request and
  prompt length).  The answer is the whole blocks kvcm holds past vLLM's local hit;
  asynchronous when one of them must first come from disk or the store (``load_mode``).
* ``update_state_after_alloc``: ``prepare_load`` admits the kvcm request with the lookup's
  hits (created, resumed, closed if refused), and the load is planned (kvcm tier-0 slots ->
  the vLLM blocks just allocated).
* ``build_connector_meta``: saves are planned for the blocks full after the step
  (``prepare_store``, bounded by ``max_inflight_bytes``), preemptions and finished requests
  holding blocks are passed on, then ONE drain (``drain``; drains are settled explicitly,
  oldest first).
* ``update_connector_output``: the workers' reports, once every rank made its report: drains
  are settled (``complete_copies``: ``settle_copies``, roll-backs, ``touch`` to go on), loads
  counted as delivered or failed, confirmed saves committed (``complete_store``: a block
  enters kvcm's tree only after its bytes are written).
* ``request_finished``: True while saves of the request are in flight (vLLM keeps its blocks
  until every worker reports it in ``finished_sending``).

A tracker's kvcm request closes (``release``) only when none of its transfers is in flight.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import kvcm
from kvcm.api import DISK, GPU, HOST, SHARED, CopyOp, CopyRun, KVCacheManagerConfig
from kvcm.dataplane import StoreClient
from kvcm.engine_loop import ASK, ManagerLoop
from kvcm.fleet.wire import MEDIUM_CPU, MEDIUM_SHARED, MEDIUM_STORAGE
from kvcm.integrations.vllm import partial
from kvcm.integrations.vllm.metadata import KvcmConnectorMetadata, KvcmWorkerMetadata, LoadPlan, SavePlan
from kvcm.integrations.vllm.settings import ConnectorSettings, KvLayout, shard_config
from kvcm.integrations.vllm.stats import process_stats
from kvcm.integrations.vllm.tracker import RequestTracker
from kvcm.offload import Lookup, OffloadManager

UNREADABLE_MAX = 1 << 16  # store objects remembered as unreadable (32-byte keys: ~6 MiB at most)
UNREADABLE_STEPS = 2048  # engine steps an unreadable object is not promised (then tried again: a store recovers)
SEEN_MAX = 1 << 16  # block keys of prefixes computed (sliding windows: shared-prefix junctions), the oldest forgotten
LC = 0  # the life cycle of a model with one full-attention group (KvLayout.lc_groups: one per kind)


class TierRole(NamedTuple):
    """What one kvcm tier is to the connector's user."""

    name: str  # its name wherever the user reads it: stats line, metrics' tier label, stats file, logs
    medium: str  # its KV events' medium (vLLM's names, kvcm.fleet.wire)


# kvcm tier number -> its role here.  The manager's tier 0 is of kind "gpu" (the one tier
# requests lock pages in: SPEC sec. 2 wants exactly one, first); in the connector it is host
# memory behind vLLM's own GPU cache, so the user sees "host" (settings.manager_config).  The
# connector configures no tier 1; its row is there for a complete table.
TIER_ROLES = {GPU: TierRole("host", MEDIUM_CPU), HOST: TierRole("host", MEDIUM_CPU),
              DISK: TierRole("disk", MEDIUM_STORAGE), SHARED: TierRole("shared", MEDIUM_SHARED)}
MEDIA = tuple(TIER_ROLES[t].medium for t in range(len(TIER_ROLES)))  # the events' medium by tier number


@dataclass
class PendingLookup:
    """What ``get_num_new_matched_tokens`` found and answered for a waiting request, kept
    until ``update_state_after_alloc`` acts on it (no side effect on kvcm).  vLLM's side of a
    lookup: it holds the seam's :class:`~kvcm.offload.Lookup` (``found``)."""

    ntokens: int
    n_local: int
    answer: int
    is_async: bool
    found: Lookup | None  # the seam's lookup (None: not looked up, a prompt of one block at most)
    tiers: list[int]  # the coldest tier of each block's pages (0: kvcm's tier 0, host memory)
    scope: Any = None  # the request's kvcm ReuseScope (None: the default scope)
    junction: int = 0  # sliding windows: blocks of the prompt computed before (by any request) past the hit


@dataclass
class LoadInfo:
    tracker: RequestTracker
    n: int
    sync: bool
    slots: list[int]
    blocks: list[int]
    tiers: list[int] = field(default_factory=list)  # where each block came from (counted when delivered)
    ranks: dict[int, list[int]] = field(default_factory=dict)
    lc: int = 0
    counts: bool = True  # counted in the hit statistics (one plan per request: the one with most blocks)
    t0: float = 0.0  # when it was planned (reporting only: how long asynchronous loads keep a request waiting)


@dataclass
class SaveInfo:
    tracker: RequestTracker
    first: int  # blocks [first, end) of the request
    end: int
    epoch: int
    ranks: dict[int, bool] = field(default_factory=dict)
    batch: int = 0  # the first save id of the batch this save belongs to (0: alone)
    nbytes: int = 0


# the stats file's counters; their names predate the tracker and the lookup ("mirrors": trackers
# started, "probes": lookups asked), kept for the file's readers
COUNTERS = ("probes", "lookups", "lookup_tokens", "matched_blocks", "mirrors", "mirror_stops", "unmirrored",
            "loads_sync", "loads_async", "load_blocks_planned", "loaded_blocks", "hit_blocks_host",
            "hit_blocks_disk", "hit_blocks_shared", "load_error_blocks", "saved_blocks", "save_failed_blocks",
            "save_blocks_planned", "saves_deferred", "failed_ops", "drains", "rollbacks", "taints", "preemptions",
            "holds", "finished_loading", "skipped_requests", "steps", "failed_loads", "window_blocks_skipped",
            "probes_memoized", "unreadable_objects", "readable_again", "junction_windows", "saves_at_finish", "partial_hits",
            "partial_hit_tokens", "partial_tail_saves", "partial_tail_tokens")


class KvcmScheduler:
    """The scheduler side (module doc).  ``world``: vLLM's tensor-parallel size (every rank
    reports every drain, load and save before the scheduler acts on it).  ``config``: the
    manager's config (default ``settings.manager_config(layout, 0, world)``; the scheduler
    sets explicit settlement on it).  ``scope(request)``: the request's kvcm ``ReuseScope``
    (default: None, kvcm's default scope).  ``skip(request)``: True for a request kvcm must
    not serve or save (its KV depends on more than its tokens); default: none."""

    def __init__(self, settings: ConnectorSettings, layout: KvLayout, world: int = 1, *,
                 kv_events: bool = False, config: KVCacheManagerConfig | None = None,
                 scope: Callable[[Any], Any] | None = None, skip: Callable[[Any], bool] | None = None) -> None:
        self.settings = settings
        self.layout = layout
        self.world = world
        self.B = layout.block_size
        self.page_bytes = sum(layout.block_bytes)  # one block of every layer (one page of every life cycle)
        self.lc_groups = layout.lc_groups
        groups = layout.groups or (0,) * len(layout.block_bytes)
        self.slot_bytes = [sum(nb for nb, g in zip(layout.block_bytes, groups, strict=True) if g in lcg)
                           for lcg in self.lc_groups]
        self.hybrid = layout.hybrid
        self.windowed = [layout.window_of_group(lcg[0]) is not None for lcg in self.lc_groups]
        # block keys of the prefixes requests computed (a window layout only): where a prompt
        # shares more blocks with them than kvcm's hit, the window ending there is saved
        # (DECISIONS.md "Hybrid reuse: the missing blocks")
        self.seen: OrderedDict[bytes, None] | None = OrderedDict() if any(self.windowed) else None
        self.no_load: set[str] = set()  # requests whose load failed: recomputed, never loaded again
        # store objects a load could not read (listed by the store, unreadable: EACCES, EIO, a
        # data path down): never promised again (bounded: the oldest are forgotten first)
        self.unreadable: dict[tuple[bytes, int], int] = {}  # -> the step it was marked at
        # the manager's state changes (admit, commit, resize, close, settle, clear): a lookup's
        # answer is memoized per request until then (vLLM asks for a waiting request every step)
        self.version = 0
        self.memo: dict[str, tuple[tuple[int, int, int], tuple[int, bool]]] = {}
        self.batches: dict[int, list[int]] = {}  # save batch -> [save plans not yet reported, all ok (1/0)]
        self.scope = scope or (lambda request: None)
        self.skip = skip or (lambda request: False)
        base = config if config is not None else settings.manager_config(layout, 0, world)
        consumed = settings.events_endpoint is not None or kv_events
        # explicit settlement: copies are reported done (or failed) drains later; events are
        # kept only when something takes them (else the buffer would fill to no use)
        self.config = replace(base, copy_settlement="explicit", **({} if consumed else {"max_events": 0}))
        # partial_tail: matches may end inside a block, finished requests save their partial tail
        self.partial = partial.enabled(settings.partial_tail, layout, settings.shared) and self.config.enable_partial_reuse
        self.pending_tail_saves: list[SavePlan] = []  # planned by request_finished (deferred blocks, a partial tail): the next step's saves
        self.mgr = kvcm.KVCacheManager(self.config, backend=settings.backend)
        # the store's existence queries: one client per rank (no pools; the store, the deadline
        # and the fault rules of the data plane), naming objects as that rank's worker does
        self.store_clients: list[StoreClient] = []
        if settings.shared is not None:
            self.store_clients = [StoreClient(shard_config(self.config, rank), store=settings.make_store(),
                                              shared_timeout_s=settings.shared_timeout_s) for rank in range(world)]
        # the offload seam over the manager (kvcm.offload): every manager call of the adapter
        # goes through its verbs (the engine loop's manager side inside; the workers apply)
        self.loop = ManagerLoop(self.mgr, lookups=self.store_clients)
        self.offload = OffloadManager(self.loop)
        self.trackers: dict[str, RequestTracker] = {}  # by request id: the live tracker of a request
        self.retiring: dict[int, RequestTracker] = {}  # by serial: finished or preempted, transfers in flight
        self.by_cache: dict[Any, RequestTracker] = {}  # kvcm cache id -> tracker
        self.pending_lookups: dict[str, PendingLookup] = {}
        self.sources: dict[str, Counter[int]] = {}  # request -> tokens to load by planned tier (this step)
        self.hit_cache: dict[str, tuple[int, Any]] = {}  # request -> (prompt length, the store's hits)
        self.pending_loads: list[LoadPlan] = []  # planned since the last step's metadata
        self.pending_holds: list[str] = []
        self.created: list[RequestTracker] = []  # created since the last drain
        self.loads: dict[int, LoadInfo] = {}
        self.saves: dict[int, SaveInfo] = {}
        self.drain_seq = 0  # the last non-empty drain
        self.settled = 0  # drains [1, settled] are settled
        self.drain_reports: dict[int, dict[int, list[CopyOp]]] = {}
        self.drain_bytes: dict[int, int] = {}
        self.drain_stores: dict[int, list[tuple[bytes, int]]] = {}  # objects a drain writes (while some are unreadable)
        self.shared_writes = True  # False: the workers drop the store ops (a consumer: handover.Role)
        self.kv_open = 0  # kvcm requests the trackers hold open
        self.inflight_bytes = 0  # saves + loads + drains planned, not reported done by every rank
        self.max_inflight = settings.max_inflight_bytes
        self.next_id = 0
        self.serial = 0
        self.step = 0
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))  # since start (stats_file)
        self.interval: Counter[str] = Counter()  # since the last get_stats (vLLM's stats)
        self.worker_counters: Counter[str] = Counter()
        self.worker_gauges: dict[int, dict[str, int]] = {}
        self.seconds = {"match": 0.0, "alloc": 0.0, "meta": 0.0, "output": 0.0}  # reporting only
        # reporting only: how long asynchronous loads kept their requests waiting (planned ->
        # reported done by every rank), summed
        self.waits = {"async_load_s": 0.0}
        self.stats_dirty = False
        # commits since the last drain: their shared-tier writes (write-through) are drained at
        # the next step, which an idle engine takes only while busy() says so (issue 35)
        self.undrained = False
        self.last_forward = True  # the last step scheduled tokens
        self.publisher = None
        if settings.events_endpoint is not None:
            from kvcm.fleet.publisher import EventPublisher

            self.publisher = EventPublisher(self.mgr, settings.events_endpoint,
                                            replay_endpoint=settings.events_replay_endpoint, media=MEDIA)
        self.wire = None
        self.vllm_events: list[Any] = []
        if kv_events:
            from kvcm.fleet.wire_state import WireState

            self.wire = WireState(self.mgr.life_cycles, self.B, media=MEDIA)
            self.wire.load_snapshot(self.mgr.snapshot())

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] += n
        self.interval[key] += n

    # ------------------------------------------------------------------ admission

    def get_num_new_matched_tokens(self, request: Any, n_local: int) -> tuple[int, bool]:
        t0 = time.perf_counter()
        try:
            return self._lookup(request, n_local)
        finally:
            self.seconds["match"] += time.perf_counter() - t0

    def _lookup(self, request: Any, n_local: int) -> tuple[int, bool]:
        rid = request.request_id
        tokens = request.all_token_ids
        self.counters["probes"] += 1
        if self.skip(request):
            self.pending_lookups.pop(rid, None)
            self.counters["skipped_requests"] += 1
            return 0, False
        # vLLM asks again every step while the request waits (for blocks, behind another): the
        # answer stands while nothing it depends on changed (the manager, the live requests)
        key = (len(tokens), n_local, self.version)
        memo = self.memo.get(rid)
        if memo is not None and memo[0] == key and rid in self.pending_lookups:
            self.counters["probes_memoized"] += 1
            return memo[1]
        scope = self.scope(request)
        if len(tokens) <= self.B:  # the last token's logits are computed: no full block to reuse
            # (still tracked: the blocks it fills as it decodes are saved)
            self.pending_lookups[rid] = PendingLookup(len(tokens), n_local, 0, False, None, [], scope)
            return 0, False
        prefix = list(tokens[:-1])
        hits = self._known_hits(rid, prefix)
        if hits is ASK:
            hits = self.offload.store_hits(prefix, scope)
            self._remember_hits(rid, prefix, hits)
        if hits and self.unreadable:  # objects a load could not read are not promised again
            hits = [h for h in hits if not self._is_unreadable(h)]
        found = self.offload.lookup(prefix, scope, hits=hits)
        tiers = list(found.block_tiers)
        hit = found.tokens // self.B
        answer = partial.answer(found.tokens, n_local, self.B, self.partial)
        if rid in self.no_load:
            answer = 0  # its load failed: vLLM recomputes it (answering again could fail again)
        is_async = answer > 0 and self._load_async(rid, tiers[n_local // self.B:hit])
        junction = self._shared_blocks(prefix, scope) if self.seen is not None else 0
        self.pending_lookups[rid] = PendingLookup(len(tokens), n_local, answer, is_async, found, tiers[:hit],
                                                  scope, junction if junction * self.B > max(hit * self.B, n_local) else 0)
        self.memo[rid] = (key, (answer, is_async))
        return answer, is_async

    def _keys(self, tokens: Any, scope: Any) -> list[bytes]:
        n = len(tokens) // self.B * self.B
        return kvcm.block_keys(list(tokens[:n]), self.B, scope) if n else []

    def _shared_blocks(self, prefix: list[int], scope: Any) -> int:
        """The leading blocks of ``prefix`` some request computed (admitted with them in its
        prompt, or retired having computed them): a sliding window's prefix whose window
        kvcm may not hold (its blocks were out of the window once the step that computed them
        ran: never stored)."""
        n = 0
        for k in self._keys(prefix, scope):
            if k not in self.seen:
                break
            n += 1
        return n

    def _see(self, tokens: Any, scope: Any) -> None:
        for k in self._keys(tokens, scope):
            self.seen.pop(k, None)
            self.seen[k] = None
        while len(self.seen) > SEEN_MAX:
            del self.seen[next(iter(self.seen))]

    def _load_async(self, rid: str, tiers: list[int]) -> bool:
        """Whether a load of blocks now in ``tiers`` is asynchronous (``load_mode`` auto: DECISIONS.md
        "Synchronous or asynchronous loads, by the engine's state").  A hybrid model's loads are
        always asynchronous (vLLM takes a failed load by request only from those).  A load
        from host memory is synchronous: it costs the step a memory copy.  One from disk or
        the store is synchronous when no other request is live (the step has nothing else to
        do, and an asynchronous load would cost the request engine steps, not bytes), else
        asynchronous (the forwards of the others do not wait for it)."""
        mode = self.settings.load_mode
        if mode == "async" or self.hybrid:
            return True
        if mode == "sync" or all(t == GPU for t in tiers):
            return False
        return any(r != rid for r in self.trackers)

    def _known_hits(self, rid: str, prefix: list[int]) -> Any:
        """The store's hits for ``prefix`` asked at an earlier lookup of this request and
        prompt length (vLLM may ask for a waiting request every step), else ``ASK``: the loop
        asks (one batched query per rank: a block is a hit only when every rank's shard is
        there)."""
        cached = self.hit_cache.get(rid)
        return cached[1] if cached is not None and cached[0] == len(prefix) else ASK

    def _remember_hits(self, rid: str, prefix: list[int], hits: Any) -> None:
        if not self.store_clients:
            return
        self._count("lookups")
        self.counters["lookup_tokens"] += len(prefix)
        self.hit_cache[rid] = (len(prefix), hits)

    def update_state_after_alloc(self, request: Any, block_ids: Any, n_external: int) -> None:
        """vLLM allocated the request's blocks (``block_ids``: its blocks of each KV cache
        group, or a list of ints for one group); ``n_external`` tokens from kvcm are to be
        loaded into them."""
        t0 = time.perf_counter()
        try:
            self._alloc(request, block_ids, n_external)
        finally:
            self.seconds["alloc"] += time.perf_counter() - t0

    def _alloc(self, request: Any, block_ids: Any, n_external: int) -> None:
        tables = [list(block_ids)] if not block_ids or isinstance(block_ids[0], int) else [list(t) for t in block_ids]
        rid = request.request_id
        lookup = self.pending_lookups.pop(rid, None)
        self.memo.pop(rid, None)
        self.version += 1  # admitted: the manager and the live requests change
        old = self.trackers.get(rid)
        if old is not None:
            if lookup is None:  # the second call of an asynchronous load (n_external 0): nothing new
                return
            # admitted afresh (its asynchronous load failed from the first block: vLLM freed
            # its blocks and asked again): the old tracker retires, a new one starts
            del self.trackers[rid]
            self._retire(old)
        self.hit_cache.pop(rid, None)
        if lookup is None or lookup.ntokens != len(request.all_token_ids):
            self.counters["unmirrored"] += 1  # admitted without a lookup (nothing to load): not tracked
            return
        prefix = list(request.all_token_ids[:-1])
        # created with the lookup's hits, resumed; closed when tier 0 is full of locked pages
        # (then not tracked: its load, if any, fails and vLLM recomputes)
        kv = self.offload.prepare_load(prefix, lookup.scope, lookup.found)
        if kv is None:
            self._count("mirror_stops")
        else:
            self.kv_open += 1
        if kv is None and n_external <= 0:
            return
        matched = kv.num_committed_tokens // self.B if kv is not None else 0
        self.serial += 1
        m = RequestTracker(rid, request, kv, self.serial, committed=matched, planned=matched, tables=tables)
        if lookup.junction * self.B > max(matched * self.B, lookup.n_local):
            m.junction = lookup.junction  # its window is saved as the prompt is computed (_plan_saves)
        if self.seen is not None:
            self._see(request.all_token_ids, lookup.scope)  # later prompts sharing it: a junction
        self.counters["mirrors"] += 1
        self.counters["matched_blocks"] += matched
        if kv is not None:  # (a tracker without a kvcm request saves nothing: RequestTracker)
            self.by_cache[kv.id] = m
        self.trackers[rid] = m
        self.created.append(m)
        if n_external > 0:
            a = lookup.n_local // self.B
            b = -(-(lookup.n_local + n_external) // self.B)  # partial_tail: the last block may be partial
            plans = []
            held = kv.num_committed_tokens if kv is not None else 0  # a match may end inside a block
            for lc in range(len(self.lc_groups)):
                slots = kv.page_indices(lc) if kv is not None else []
                pos, pslots, pblocks = [], [], []
                for i in range(a, b):
                    blk = self._block(m, lc, i)
                    if blk is None:  # outside the window in vLLM: neither loaded nor needed
                        continue
                    slot = slots[i] if i * self.B < held and i < len(slots) else -1
                    pos.append(i)
                    pslots.append(slot)  # -1: promised, not held (fails: vLLM recomputes)
                    pblocks.append(blk)
                if pos:
                    plans.append((lc, pslots, pblocks))
            most = max((len(p[1]) for p in plans), default=0)
            counted = False
            for lc, pslots, pblocks in plans:
                load = LoadPlan(self._id(), rid, pslots, pblocks, sync=not lookup.is_async, lc=lc)
                m.loads.add(load.load_id)
                counts = not counted and len(pslots) == most
                counted = counted or counts
                self.loads[load.load_id] = LoadInfo(m, len(pslots), load.sync, load.slots, load.blocks, lc=lc,
                                                    counts=counts, t0=time.perf_counter())
                self.pending_loads.append(load)
                self.inflight_bytes += len(pslots) * self.slot_bytes[lc]
            self.sources[rid] = Counter(partial.sources(lookup.n_local, n_external, self.B, lookup.tiers, GPU))
            self._count("loads_sync" if not lookup.is_async else "loads_async")
            # the blocks of the plan counted in loaded_blocks: with sliding windows only, the window
            # (ordinals outside it are vLLM's null block: neither loaded nor needed)
            self._count("load_blocks_planned", most)
            if (lookup.n_local + n_external) % self.B:  # partial_tail: vLLM took a hit that ends inside a block
                self._count("partial_hits")
                self._count("partial_hit_tokens", (lookup.n_local + n_external) % self.B)

    def planned_sources(self, rid: str, n_external: int) -> dict[int, int]:
        """The tokens of the load just planned for ``rid`` by the tier kvcm had them in
        when it was admitted (vLLM's ``get_external_cache_hit_sources``, right after
        ``update_state_after_alloc``)."""
        tokens = self.sources.pop(rid, Counter())
        if sum(tokens.values()) != n_external:
            return {}
        return dict(tokens)

    def request_finished(self, request: Any, block_ids: Any = None) -> bool:
        """vLLM finished the request (done, aborted, or while it waited for its load).  True:
        saves reading its blocks are in flight; vLLM keeps the blocks until every worker
        reports the request in ``finished_sending``.  ``block_ids``: vLLM's blocks of its
        computed tokens (one group's list, or every group's), for the partial tail's block."""
        rid = request.request_id
        self.pending_lookups.pop(rid, None)
        self.memo.pop(rid, None)
        self.hit_cache.pop(rid, None)
        self.no_load.discard(rid)
        self.version += 1
        self.stats_dirty = True
        m = self.trackers.pop(rid, None)
        if m is None:
            return False
        if m.loads:
            self._count("finished_loading")  # aborted in WAITING_FOR_REMOTE_KVS: closes once the load is in
        if block_ids:  # the table as vLLM holds it now (the tracker's may predate its last blocks)
            m.tables = [list(block_ids)] if isinstance(block_ids[0], int) else [list(t) for t in block_ids]
        self._save_deferred(m, request)
        if self.partial:
            self._save_tail(m)
        hold = bool(m.saves)
        if hold:
            m.held = True
            self.pending_holds.append(rid)
            self._count("holds")
        self._retire(m)
        return hold

    def _save_deferred(self, m: RequestTracker, request: Any) -> None:
        """The full blocks of a finished request whose saves the in-flight bound deferred:
        planned now, past the bound (vLLM keeps the request's blocks while they are in flight;
        a deferral must not become a miss — with a turn's requests together, bounded saves
        of requests that finished first were never planned)."""
        if m.stopped or m.kv is None or m.loads or m.kv.status.name != "ACTIVE" or not m.tables:
            return
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        full = min(computed // self.B, min(len(t) for t in m.tables))
        if full <= m.planned:
            return
        fin = KvcmConnectorMetadata(0, forward=False)
        self._plan_saves(m, full, fin, computed, bounded=False)
        if fin.saves:
            self.pending_tail_saves += fin.saves
            self._count("saves_at_finish", sum(len(p.blocks) for p in fin.saves))

    def _save_tail(self, m: RequestTracker) -> None:
        """partial_tail: the save of a finished request's trailing partial block (in the
        next step's metadata, with its hold; module ``partial``)."""
        p = partial.plan_tail(self, m)
        if p is None:
            return
        nbytes, f = self.slot_bytes[0], m.tail // self.B
        self.saves[p.save_id] = SaveInfo(m, f, f + 1, m.epoch, nbytes=nbytes)
        m.saves[p.save_id] = m.epoch
        self.inflight_bytes += nbytes
        self.pending_tail_saves.append(p)
        self._count("partial_tail_saves")

    # ------------------------------------------------------------------ one step

    def build_connector_meta(self, so: Any) -> KvcmConnectorMetadata:
        t0 = time.perf_counter()
        try:
            return self._build(so)
        finally:
            self.seconds["meta"] += time.perf_counter() - t0

    def _build(self, so: Any) -> KvcmConnectorMetadata:
        self.step += 1
        self._count("steps")
        meta = KvcmConnectorMetadata(self.step, forward=bool(getattr(so, "total_num_scheduled_tokens", 1)))
        self.last_forward = meta.forward  # (handover.py: a waiting hand-over paces an engine with nothing to run)
        for rid in sorted(getattr(so, "preempted_req_ids", None) or ()):
            m = self.trackers.pop(rid, None)
            self.version += 1
            self._count("preemptions")
            meta.preempted.append(rid)
            if m is not None:  # vLLM freed its blocks: its saves in flight finish first (handle_preemptions)
                self._retire(m)
        meta.loads, self.pending_loads = self.pending_loads, []
        self.sources.clear()  # asked for (if at all) right after each allocation
        meta.finished_holds, self.pending_holds = self.pending_holds, []
        meta.saves += self.pending_tail_saves
        self.pending_tail_saves = []
        blocks = _BlockIds(so)
        for rid, n in so.num_scheduled_tokens.items():
            m = self.trackers.get(rid)
            if m is None:
                continue
            after = min(m.request.num_computed_tokens + n, len(m.request.all_token_ids))
            if blocks.whole and (m.stopped or m.kv is None or after // self.B <= m.planned):
                continue  # no block to plan: vLLM's block table is not read (per step, O(1) a request)
            blocks.refresh(m)
            if m.stopped or m.kv is None:
                continue
            self._plan_saves(m, min(after // self.B, min(len(t) for t in m.tables)), meta, after)
        runs = self.offload.drain()
        flushed = self.undrained
        self.undrained = False
        if any(len(r) for r in runs):
            self.drain_seq += 1
            meta.drain_seq = self.drain_seq
            meta.runs = runs
            nbytes = sum(len(r) * self.slot_bytes[r.lc] for r in runs)
            self.drain_bytes[self.drain_seq] = nbytes
            if self.unreadable and self.shared_writes:  # an object written again is readable again (_settle)
                self.drain_stores[self.drain_seq] = [(k, r.lc) for r in runs if r.dst_tier == SHARED for k in r.keys]
            self.inflight_bytes += nbytes
            self._count("drains")
            for m in self.created:
                m.drain_dep = self.drain_seq
        self.created = []
        self._tiers_of_loads(meta.loads, runs)
        self._events()
        if flushed:  # the stats file said commits waited for a drain: it says what is in flight now
            self.write_stats()
        return meta

    def _block(self, m: RequestTracker, lc: int, i: int) -> Any:
        """vLLM's block(s) of block ordinal ``i`` in life cycle ``lc``: an id (one group), a
        tuple (one id per group of the life cycle), or None when vLLM holds none (null block:
        outside a sliding window, or past the table)."""
        ids = []
        windowed = self.windowed[lc]
        for g in self.lc_groups[lc]:
            t = m.tables[g] if g < len(m.tables) else []
            if i >= len(t) or (windowed and t[i] == 0):  # vLLM's null block (a full group has none)
                return None
            ids.append(t[i])
        return ids[0] if len(ids) == 1 else tuple(ids)

    def _plan_saves(self, m: RequestTracker, full: int, meta: KvcmConnectorMetadata, after: int = 0,
                    bounded: bool = True) -> None:
        """Saves of the blocks ``[planned, full)`` (full once this step ran), within the
        in-flight bound (``bounded``): blocks past it are planned in a later step.  ``after``:
        the tokens computed once this step ran: kvcm's history, so that blocks out of a
        sliding window by then get no page (kvcm stores no block outside a window)."""
        n = full - m.planned
        if n <= 0:
            return
        room = max(0, self.max_inflight - self.inflight_bytes) // self.page_bytes if bounded else n
        if self.inflight_bytes == 0:
            room = max(room, 1)  # progress whatever the bound
        if room < n:
            self._count("saves_deferred", n - room)
            n = room
        if n <= 0:
            return
        end = m.planned + n
        self.version += 1  # pages allocated (maybe evicting others)
        hist = min(after, end * self.B) if self.hybrid else None  # at least (the seam keeps kvcm's if more)
        if m.junction and m.planned < m.junction <= end:
            # a shared prefix ends at block j = m.junction (another request computed it; kvcm
            # holds not the window ending there: it was out of the window once that request's
            # step ran): the step's saves are planned at history j, so that window gets pages
            # too (one request per shared prefix pays this: the next ones hit there), when vLLM
            # still holds it (saves deferred past the step that computed it: it may not)
            if self._holds_window(m, m.junction):
                hist = m.junction * self.B
            else:
                m.junction = 0
        prepared = self.offload.prepare_store(m.kv, m.planned, end, hist)
        if prepared is None:
            self._stop(m)  # tier 0 cannot hold it: what is committed stays
            return
        wanted = [list(want) for want in prepared.slots]  # per life cycle: (ordinal, kvcm slot) kvcm keeps a page of
        for lc, want in enumerate(wanted):
            for i, _ in want:
                if self._block(m, lc, i) is None:  # kvcm wants a page vLLM no longer holds: stop before it
                    end = min(end, i)
                    break
        if end <= m.planned:
            self._stop(m)
            return
        first, window = 0, False
        for lc, want in enumerate(wanted):
            want = [(i, slot) for i, slot in want if i < end]
            if not want:
                continue
            p = SavePlan(self._id(), m.rid, [self._block(m, lc, i) for i, _ in want], [slot for _, slot in want], lc=lc)
            first = first or p.save_id
            nbytes = len(want) * self.slot_bytes[lc]
            self.saves[p.save_id] = SaveInfo(m, m.planned, end, m.epoch, batch=first, nbytes=nbytes)
            m.saves[p.save_id] = m.epoch
            self.inflight_bytes += nbytes
            meta.saves.append(p)
            if first in self.batches:
                self.batches[first][0] += 1
            else:
                self.batches[first] = [1, 1]
            window = window or self.windowed[lc]
        if first and self.batches[first][0] == 1:
            del self.batches[first]  # one plan: confirmed alone
        if window and self.hybrid and m.rid not in meta.window_saves:
            meta.window_saves.append(m.rid)
        if not first:  # every block of the range is outside a window: nothing to store, committed as is
            m.confirm(m.planned, end)
            self._commit(m)
        else:  # the blocks of windowed life cycles kvcm leaves out (stale once this step ran)
            self._count("window_blocks_skipped", sum(end - m.planned - len([i for i, _ in want if i < end])
                                                     for lc, want in enumerate(wanted) if self.windowed[lc]))
        self._count("save_blocks_planned", end - m.planned)
        if m.junction and m.planned < m.junction <= end:
            self._count("junction_windows")
        m.plan_to(end)

    def _holds_window(self, m: RequestTracker, j: int) -> bool:
        """vLLM holds every block from ``m.planned`` that the windows ending at block ``j`` need."""
        for lc, lcg in enumerate(self.lc_groups):
            w = self.layout.window_of_group(lcg[0])
            lo = m.planned if w is None else max(m.planned, (j * self.B + 1 - w) // self.B)
            if any(self._block(m, lc, i) is None for i in range(lo, j)):
                return False
        return True

    def _tiers_of_loads(self, loads: list[LoadPlan], runs: list[CopyRun]) -> None:
        """Where each block of the step's loads comes from: an onboard into its slot in this
        step's drain came from disk or the store; any other slot was in host memory."""
        if not loads:
            return
        src: dict[tuple[int, int], int] = {}
        for r in runs:
            if r.reason == "onboard" and r.dst_tier == GPU:
                for d in r.dst_slots:
                    src[(r.lc, d)] = r.src_tier
        for x in loads:
            self.loads[x.load_id].tiers = [src.get((x.lc, s), GPU) for s in x.slots]

    # ------------------------------------------------------------------ the workers' reports

    def update_connector_output(self, wm: Any) -> None:
        t0 = time.perf_counter()
        try:
            if isinstance(wm, KvcmWorkerMetadata):
                self._reports(wm)
        finally:
            self.seconds["output"] += time.perf_counter() - t0

    def _reports(self, wm: KvcmWorkerMetadata) -> None:
        loads, saves = set(), set()
        for rank, rep in wm.ranks.items():
            for seq, failed in rep.drains:
                self.drain_reports.setdefault(seq, {})[rank] = list(failed)
            for lid, failed in rep.loads.items():
                if lid in self.loads:
                    self.loads[lid].ranks[rank] = list(failed)
                    loads.add(lid)
            for sid, ok in rep.saves.items():
                if sid in self.saves:
                    self.saves[sid].ranks[rank] = ok
                    saves.add(sid)
            self.worker_counters.update(rep.counters)
            if rep.gauges:
                self.worker_gauges[rank] = dict(rep.gauges)
        touched: set[int] = set()
        self._settle(touched)
        for lid in sorted(loads):  # before the saves: a failed load taints the saves that read its blocks
            info = self.loads[lid]
            if len(info.ranks) == self.world:
                self._load_done(lid, info, touched)
        for sid in sorted(saves):
            info = self.saves[sid]
            if len(info.ranks) == self.world:
                self._save_done(sid, info, touched)
        for serial in sorted(touched):
            m = self.retiring.get(serial)
            if m is not None:
                self._maybe_close(m)
        self.stats_dirty = True

    def _settle(self, touched: set[int]) -> None:
        """Settle every drain all ranks reported, oldest first (``settle_copies``)."""
        while True:
            seq = self.settled + 1
            reps = self.drain_reports.get(seq)
            if reps is None or len(reps) < self.world:
                return
            del self.drain_reports[seq]
            failed = _union(reps.values())
            self._unreadable(failed, self.drain_stores.pop(seq, ()))
            rolled = self.offload.complete_copies(failed)  # settle_copies (explicit settlement)
            self.version += 1
            self.settled = seq
            self.inflight_bytes -= self.drain_bytes.pop(seq, 0)
            self._count("failed_ops", len(failed))
            for cid in rolled:
                m = self.by_cache.get(cid)
                if m is not None:
                    self._rolled_back(m)
                    touched.add(m.serial)
            for m in list(self.retiring.values()):
                if m.drain_dep == seq:
                    touched.add(m.serial)

    def _unreadable(self, failed: list[CopyOp], stored: Any = ()) -> None:
        """Store objects whose read failed are not promised again (the store may still list
        them: another user's 0600 objects, EIO, a data path down while the metadata answers)
        until this instance writes them again (``stored``: the objects the drain wrote; those
        whose store op did not fail are readable again), for ``UNREADABLE_STEPS`` engine
        steps (a store that recovers is tried again), or until ``reset``; at most
        ``UNREADABLE_MAX``, the oldest forgotten first.  A retry costs a request at most one
        failed load, and vLLM recomputes it."""
        for op in failed:
            if op.src_tier == SHARED and op.key is not None:
                self.unreadable.pop((op.key, op.lc), None)
                self.unreadable[(op.key, op.lc)] = self.step
                self._count("unreadable_objects")
        if stored and self.unreadable:
            lost = {(op.key, op.lc) for op in failed if op.dst_tier == SHARED}
            for k in stored:
                if k not in lost and self.unreadable.pop(k, None) is not None:
                    self._count("readable_again")
        while len(self.unreadable) > UNREADABLE_MAX:
            del self.unreadable[next(iter(self.unreadable))]

    def _is_unreadable(self, key: tuple[bytes, int]) -> bool:
        marked = self.unreadable.get(key)
        if marked is None:
            return False
        if self.step - marked < UNREADABLE_STEPS:
            return True
        del self.unreadable[key]  # long enough: tried again
        return False

    def _rolled_back(self, m: RequestTracker) -> None:
        """kvcm forgot a page the request used (a failed copy): its kvcm request is
        SUSPENDED at its re-match.  Saves in flight stop counting; blocks past the re-match
        are saved again from vLLM (which recomputes those whose load failed) as it runs on."""
        self._count("rollbacks")
        m.roll_back(m.kv.num_committed_tokens // self.B)
        if m.stopped or m.retiring or not self.offload.touch(m.kv):
            self._stop(m)
        else:
            self.created.append(m)  # resume may onboard pages: the next drain fills them

    def _load_done(self, lid: int, info: LoadInfo, touched: set[int]) -> None:
        del self.loads[lid]
        if not info.sync:
            self.waits["async_load_s"] += time.perf_counter() - info.t0
        m = info.tracker
        m.loads.discard(lid)
        touched.add(m.serial)
        self.inflight_bytes -= info.n * self.slot_bytes[info.lc]
        failed = sorted(set().union(*info.ranks.values()))
        if info.counts:
            for i in range(info.n):
                if i not in failed:
                    self._count("hit_blocks_" + TIER_ROLES.get(info.tiers[i] if info.tiers else GPU, TIER_ROLES[GPU]).name)
            self._count("loaded_blocks", info.n - len(failed))
        self._count("load_error_blocks", len(failed))
        if failed:
            # hybrid: reported by request (failed_recving), vLLM recomputes it from its first
            # token; one group: vLLM recomputes from the first failed block.  Either way vLLM
            # may look it up again (a load that failed from its first block frees its blocks):
            # kvcm answers 0 for it from now on, so no answer of kvcm can make a request fail
            # its load twice (DECISIONS.md "A load that failed is not promised again")
            if not m.load_failed:  # one per request (its life cycles' plans fail together)
                self._count("failed_loads")
            m.load_failed = True
            if self.trackers.get(m.rid) is m:  # still running (an aborted request is not looked up again)
                self.no_load.add(m.rid)
        if failed and not self.hybrid:
            self._taint({info.blocks[i] for i in failed})

    def _taint(self, bad_blocks: set[int]) -> None:
        """vLLM blocks whose load failed held garbage while the forwards of their step ran:
        every block computed after them by a request that has them in its block table is
        suspect until vLLM recomputed it.  Saves of such blocks in flight stop counting, and
        the tracker plans them again from its committed blocks (vLLM rewinds the request to
        the failed block and recomputes from there)."""
        for m in list(self.trackers.values()) + list(self.retiring.values()):
            j = next((i for i, b in enumerate(m.block_ids) if b in bad_blocks), None)
            if j is not None and m.taint(j):
                self._count("taints")

    def _save_done(self, sid: int, info: SaveInfo, touched: set[int]) -> None:
        del self.saves[sid]
        m = info.tracker
        m.saves.pop(sid, None)
        touched.add(m.serial)
        n = info.end - info.first
        self.inflight_bytes -= info.nbytes if info.nbytes else n * self.page_bytes
        ok = all(info.ranks.values())
        b = self.batches.get(info.batch)
        if b is not None:  # one save per life cycle of the same blocks: confirmed when all are in
            b[0] -= 1
            b[1] = b[1] and ok
            if b[0] > 0:
                return
            del self.batches[info.batch]
            ok = bool(b[1])
        if info.epoch != m.epoch:  # rolled back or tainted since: planned again
            return
        if ok:
            self._count("saved_blocks", n)
            m.confirm(info.first, info.end)
            self._commit(m)
        else:  # a save that fails is dropped: nothing at or past it is committed
            self._count("save_failed_blocks", n)
            self._stop(m)

    def _commit(self, m: RequestTracker) -> None:
        """Commit the confirmed blocks that follow the committed ones, as far as their tokens
        are known (under async scheduling a step's last token may not be yet)."""
        if m.kv is None or m.kv.status.name != "ACTIVE":
            return
        end = m.committed
        while end in m.confirmed:
            end += 1
        end = min(end, len(m.request.all_token_ids) // self.B)
        if m.tail:  # the tail's block is committed by its tokens only (commit_tail)
            end = min(end, m.tail // self.B)
        if end > m.committed:
            # from kvcm's committed count: a match that ended inside block m.committed
            # (partial_tail) committed part of it already
            tokens = m.request.all_token_ids[m.kv.num_committed_tokens:end * self.B]
            self.offload.complete_store(m.kv, tokens)
            self.version += 1
            self.undrained = True
            m.commit_to(end)
        if m.tail:
            n = partial.commit_tail(m, self.offload)
            if n:
                self.version += 1
                self.undrained = True
                self._count("partial_tail_tokens", n)

    # ------------------------------------------------------------------ tracker lifetime

    def _stop(self, m: RequestTracker) -> None:
        """No more saves for this request (what is committed stays)."""
        if m.stop():
            self._count("mirror_stops")

    def _retire(self, m: RequestTracker) -> None:
        m.retire()
        if self.seen is not None:  # what it computed: later prompts sharing it find a junction
            self._see(m.request.all_token_ids[:m.request.num_computed_tokens], self.scope(m.request))
        self._commit(m)
        self.retiring[m.serial] = m
        self._maybe_close(m)

    def _maybe_close(self, m: RequestTracker) -> None:
        """Close the kvcm request of a retiring tracker once none of its transfers is in
        flight (loads, saves, the drain that onboarded its pages)."""
        if not m.idle(self.settled):
            return
        self._commit(m)
        kv = m.close()
        if kv is not None:
            self.version += 1
            self.by_cache.pop(kv.id, None)
            self.offload.release(kv)
            self.kv_open -= 1
        self.retiring.pop(m.serial, None)
        self.stats_dirty = True

    # ------------------------------------------------------------------ observing

    def busy(self) -> bool:
        """Work is in flight that vLLM's steps must drive to completion (vLLM's
        ``has_pending_push_work``: an idle engine keeps stepping until it is done)."""
        return bool(self.settled < self.drain_seq or self.loads or self.saves or self.retiring
                    or self.pending_holds or self.pending_loads or self.undrained)

    def pending(self) -> dict[str, int]:
        """What is open or in flight (tests assert it drains to nothing)."""
        return {"mirrors": len(self.trackers), "retiring": len(self.retiring), "loads": len(self.loads),
                "saves": len(self.saves), "unsettled_drains": self.drain_seq - self.settled,
                "holds": len(self.pending_holds), "probes": len(self.pending_lookups), "hit_cache": len(self.hit_cache),
                "no_load": len(self.no_load),  # "mirrors", "probes": the stats file's keys, kept for its readers
                "kvcm_open": self.kv_open, "bytes_in_flight": self.inflight_bytes, "undrained": int(self.undrained)}

    def take_stats(self) -> dict[str, int] | None:
        """The counters since the last call (vLLM's ``get_kv_connector_stats``), with the
        scheduler's bytes in flight; None when nothing happened."""
        if not any(self.interval.values()):
            return None
        out = {k: v for k, v in self.interval.items() if v}
        out["sched_bytes_in_flight"] = self.inflight_bytes
        self.interval = Counter()
        return out

    def _events(self) -> None:
        """The manager's events of the step: to kvcm's publisher and, translated, to vLLM's."""
        if self.publisher is None and self.wire is None:
            return
        events = self.offload.take_events()
        if self.publisher is not None:
            self.publisher.publish(events)
        if self.wire is not None and events:
            self.vllm_events += self.wire.translate(events)

    def take_events(self) -> list[Any]:
        out, self.vllm_events = self.vllm_events, []
        return out

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: kvcm drops every reusable
        page it holds locally (the shared store is the fleet's and is left alone)."""
        self.offload.reset()
        self.unreadable.clear()  # what kvcm learned of the store is forgotten too: tried again
        self.version += 1
        return True

    def write_stats(self) -> None:
        path = self.settings.stats_file
        if path is None:
            return
        self.stats_dirty = False
        data = {"counters": dict(self.counters), "worker": dict(self.worker_counters),
                "worker_gauges": {str(k): v for k, v in self.worker_gauges.items()}, "seconds": self.seconds,
                "waits": self.waits, "namespace": self.config.shared_namespace,
                "pending": self.pending(), "manager": _with_roles(self.offload.stats()), "process": process_stats(),
                "lookup": _lookup_stats(self.store_clients), "loop": dict(self.loop.counters)}
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # kvcm's files are 0600
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, default=str)
        os.replace(tmp, path)

    def shutdown(self) -> None:
        """The engine stops: kvcm's requests still open close (what they committed stays)."""
        self.write_stats()
        for m in list(self.trackers.values()) + list(self.retiring.values()):
            kv = m.close()
            if kv is not None:
                self.offload.release(kv)
        self.trackers.clear()
        self.retiring.clear()
        if self.publisher is not None:
            self.publisher.close()
        for client in self.store_clients:
            client.close()
        self.mgr.shutdown()


class _BlockIds:
    """The vLLM blocks of the step's scheduled requests, from the SchedulerOutput (vLLM
    0.32's ``kv_connector_block_state``; else the new and cached request data: a new or
    resumed request's whole block table, a running one's new blocks), never from the
    scheduler's private KV cache manager."""

    def __init__(self, so: Any) -> None:
        self.state = getattr(so, "kv_connector_block_state", None)
        # vLLM 0.32 gives every table whole: a tracker reads it only when it plans saves (the
        # new / cached request data give a running request's new blocks only: read every step)
        self.whole = self.state is not None
        self.new: dict[str, list[list[int]]] = {}
        self.cached: dict[str, tuple[list[list[int]], bool]] = {}
        if self.state is None:
            for r in so.scheduled_new_reqs:
                self.new[r.req_id] = [list(t) for t in r.block_ids]
            c = so.scheduled_cached_reqs
            resumed = getattr(c, "resumed_req_ids", set())
            for rid, ids in zip(c.req_ids, c.new_block_ids, strict=True):
                if ids is not None:
                    self.cached[rid] = ([list(t) for t in ids], rid in resumed)

    def refresh(self, m: RequestTracker) -> None:
        # vLLM 0.32's kv_connector_block_state: every group's table as vLLM holds it now
        # (sliding-window blocks it freed are 0); the new/cached request data would keep them
        if self.state is not None:
            ids = self.state.get_block_ids(m.rid)
            if ids is not None:
                m.tables = [list(t) for t in ids]
        elif m.rid in self.new:
            m.tables = self.new[m.rid]
        elif m.rid in self.cached:
            ids, whole = self.cached[m.rid]
            m.tables = ids if whole else [a + b for a, b in zip(m.tables or [[]] * len(ids), ids, strict=True)]


def _union(reports: Any) -> list[CopyOp]:
    """The failed ops of one drain over every rank: an op failed when it failed on any rank
    (each op value as many times as the rank that lists it most)."""
    most: Counter[CopyOp] = Counter()
    order: list[CopyOp] = []
    for ops in reports:
        c = Counter(ops)
        for op, n in c.items():
            if op not in most:
                order.append(op)
            most[op] = max(most[op], n)
    return [op for op in order for _ in range(most[op])]


def _with_roles(stats: dict[str, Any]) -> dict[str, Any]:
    """The manager's stats with each tier's ``role`` after its ``kind`` (the stats file): tier 0
    reads ``"kind": "gpu", "role": "host"`` -- the kind kept for the readers that know it."""
    tiers = []
    for t in stats.get("tiers", ()):
        row = {}
        for k, v in t.items():
            row[k] = v
            if k == "kind":
                row["role"] = TIER_ROLES[t["tier"]].name
        tiers.append(row)
    return {**stats, "tiers": tiers}


def _lookup_stats(clients: list[StoreClient]) -> dict[str, int] | None:
    if not clients:
        return None
    out: Counter[str] = Counter()
    for p in clients:
        out.update(p.shared_stats)
    return dict(out)
