"""kvcm behind transformers' ``PagedAttentionCache`` (DECISIONS.md "transformers continuous batching (issue 23)").

transformers keeps the paged KV in one flat ``cache_tensor`` cut into *sectors*, each sector
handed to one cache allocator (one per attention kind: full, sliding) and cut into that
allocator's *blocks* (``page_size`` tokens of every layer of the group).  The attention reads
and writes go through ``allocator.block_table[request_id]`` (block ids), turned into physical
token indices by the allocator.  This module:

* gives every data sector to kvcm at construction: allocator ``a`` owns a contiguous run of
  sectors whose blocks are kvcm's gpu slots of the life cycle (lc) of ``a``'s layers, so
  block id = ``base[a] + slot`` and the data plane's gpu pool of that lc *is* a view of
  transformers' cache tensor (``allocator._copy_view[base : base + n]``): kvcm's copy ops
  (offload, onboard, cow, store) move transformers' own bytes;
* overrides the cache's request-level methods (prefix match, allocation, commits, frees,
  forks, free capacity) to call the kvcm manager, and rewrites ``block_table`` from
  ``kv.page_indices(lc)`` before every forward;
* reads sliding-window groups linearly (token ``p`` at block ``p // page_size``) instead of
  through transformers' ring buffer, so that their blocks can enter kvcm's tree and be shared.

Nothing of transformers' source is copied; the internals relied on are listed in
:func:`check_pinned_internals`, which :class:`KvcmContinuousBatching` runs on entry.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Self

import torch
import transformers
from transformers.generation.continuous_batching import cache as tf_cache
from transformers.generation.continuous_batching import continuous_api as tf_api
from transformers.generation.continuous_batching import offloading_manager as tf_offload
from transformers.generation.continuous_batching import scheduler as tf_scheduler
from transformers.generation.continuous_batching.cache_allocators import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    FullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.requests import RequestState

import kvcm
from kvcm import AttentionLayer, KVCacheManagerConfig, Tier
from kvcm.api import KVCache, Status
from kvcm.config import resolve_config
from kvcm.dataplane import DataPlane

PINNED_TRANSFORMERS = "5.19."  # the minor version whose internals this module was written against
_TOKENS_KEY = "kvcm_tokens"  # our entry in FutureRequestState.complete_blocks: tokens the forward computed

# (class, method) -> the parameters it must still take (transformers internals we override or call)
_PINNED_SIGNATURES: dict[tuple[type, str], tuple[str, ...]] = {
    (tf_cache.PagedAttentionCache, "__init__"): (
        "self", "config", "continuous_batching_config", "device", "distributed_helper", "dtype",
        "model_supports_logits_to_keep"),
    (tf_cache.PagedAttentionCache, "search_prefix_match"): ("self", "request_id", "prompt_ids"),
    (tf_cache.PagedAttentionCache, "can_store_request_tokens"): ("self", "state", "request_len", "dry_run"),
    (tf_cache.PagedAttentionCache, "count_new_complete_blocks"): ("self", "state", "request_len"),
    (tf_cache.PagedAttentionCache, "mark_complete_blocks"): ("self", "state", "complete_blocks"),
    (tf_cache.PagedAttentionCache, "free_blocks"): ("self", "request_id", "no_cache"),
    (tf_cache.PagedAttentionCache, "free_all_requests"): ("self", "clear_ledgers"),
    (tf_cache.PagedAttentionCache, "evict_cached_blocks"): ("self",),
    (tf_cache.PagedAttentionCache, "compute_free_capacity"): ("self", "relative"),
    (tf_cache.PagedAttentionCache, "count_storable_requests"): ("self", "list_blocks_needed"),
    (tf_cache.PagedAttentionCache, "prepare_fork_request"): ("self", "src_state", "dst_req_ids", "copy_src_and_dst"),
    (tf_cache.PagedAttentionCache, "reset"): ("self",),
    (FullAttentionCacheAllocator, "register_cache_tensor"): (
        "self", "bytes_per_sector", "non_trash_bytes", "cache_tensor", "pool"),
    (FullAttentionCacheAllocator, "get_read_indices"): ("self", "request_id", "past_length", "query_length"),
    (FullAttentionCacheAllocator, "get_write_indices"): ("self", "request_id", "past_length", "query_length"),
    (SlidingAttentionCacheAllocator, "get_read_indices"): ("self", "request_id", "past_length", "query_length"),
    (SlidingAttentionCacheAllocator, "get_write_indices"): ("self", "request_id", "past_length", "query_length"),
    (SlidingAttentionCacheAllocator, "get_seqlen_k"): ("self", "past_length", "query_length"),
}
# (function, text its source must contain): the call sites that make our overrides take effect
_PINNED_CALLS: tuple[tuple[Any, str], ...] = (
    (tf_scheduler.Scheduler._infer_request_tokens, "self.cache.use_prefix_sharing"),
    (tf_scheduler.Scheduler._infer_request_tokens,
     "self.cache.search_prefix_match(state.request_id, state.remaining_prefill_tokens)"),
    (tf_scheduler.Scheduler._process_candidates, "self.cache.can_store_request_tokens(state, request_len)"),
    (tf_scheduler.Scheduler._process_candidates, "self.cache.count_new_complete_blocks(state, request_len)"),
    (tf_api.ContinuousBatchProcessor.update_batch,
     "self.cache.mark_complete_blocks(state, future_state.complete_blocks)"),
    (tf_api.ContinuousBatchProcessor.update_batch, "self.cache.prepare_fork_request("),
    (tf_api.ContinuousBatchingManager._create_batch_processor, "PagedAttentionCache("),
    (tf_offload.OffloadingManager.offload_requests, "self.cache.free_blocks(state.request_id, no_cache=True)"),
    (tf_cache.PagedAttentionCache.__init__, "allocator.register_cache_tensor("),
    (RequestState.current_len, "return self.position_offset"),
)
# attributes of objects built at run time that we read or write
_PINNED_ALLOCATOR_ATTRS = ("block_table", "_copy_view", "blocks_per_sector", "bytes_per_block", "bytes_per_page",
                           "tokens_per_page", "block_physical_stride", "sentinel_index", "layer_indices", "index",
                           "num_blocks")
_PINNED_CACHE_ATTRS = ("cache_allocators", "pool", "num_sectors", "bytes_per_sector", "cache_tensor",
                       "use_prefix_sharing", "device", "dtype")


def check_pinned_internals(version: str | None = None) -> list[str]:
    """What changed in the transformers internals this integration relies on ([] = nothing).
    ``version``: the transformers version to judge (default: the installed one)."""
    problems = []
    version = transformers.__version__ if version is None else version
    if not version.startswith(PINNED_TRANSFORMERS):
        problems.append(f"transformers {version} is not the pinned {PINNED_TRANSFORMERS}x")
    for (cls, name), want in _PINNED_SIGNATURES.items():
        fn = getattr(cls, name, None)
        if fn is None:
            problems.append(f"{cls.__qualname__}.{name} is gone")
            continue
        got = tuple(inspect.signature(fn).parameters)
        if got != want:
            problems.append(f"{cls.__qualname__}.{name} takes {got}, pinned {want}")
    for fn, text in _PINNED_CALLS:
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            problems.append(f"no source for {fn.__qualname__}")
            continue
        if text not in src:
            problems.append(f"{fn.__qualname__} no longer contains {text!r}")
    if tf_api.PagedAttentionCache is not tf_cache.PagedAttentionCache:
        problems.append("continuous_api.PagedAttentionCache is not cache.PagedAttentionCache")
    if set(tf_cache.ATTN_TYPE_TO_ALLOCATOR) != {FULL_ATTENTION, SLIDING_ATTENTION}:
        problems.append(f"attention kinds are now {sorted(tf_cache.ATTN_TYPE_TO_ALLOCATOR)}")
    return problems


class KvcmSlidingAllocator(SlidingAttentionCacheAllocator):
    """A sliding-window group read linearly: token ``p`` lives at block ``p // page_size`` of
    the request's block table (kvcm's page per block ordinal; stale blocks are -1 and never
    read), so full blocks can be committed to kvcm's tree and shared like full attention's.
    Reads are the last ``window - 1`` cached tokens then the new ones (sentinels), the order
    transformers' ``update`` and ``get_seqlen_k`` expect."""

    def _linear(self, request_id: str, start: int, length: int) -> list[int]:
        table = self.block_table[request_id]
        page, stride = self.tokens_per_page, self.block_physical_stride
        out = []
        for p in range(start, start + length):
            block = table[p // page]
            if block < 0:  # a stale block: kvcm released it because the window no longer needs it
                raise RuntimeError(f"kvcm: request {request_id} reads token {p} of a released sliding block")
            out.append(block * stride + p % page)
        return out

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        cached = min(past_length, self.sliding_window - 1)
        return self._linear(request_id, past_length - cached, cached) + [self.sentinel_index] * query_length

    def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return self._linear(request_id, past_length, query_length)


class KvcmPagedAttentionCache(tf_cache.PagedAttentionCache):
    """transformers' paged cache with kvcm deciding every block (see the module docstring).
    Built by transformers itself inside :class:`KvcmContinuousBatching` (``_kc`` is set on
    the per-context subclass)."""

    _kc: KvcmContinuousBatching

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cb = kwargs.get("continuous_batching_config", args[1] if len(args) > 1 else None)
        if cb is not None and cb.cpu_offload_space:
            # its swap-in path skips admission (no prefix match: no kv) and writes blocks kvcm did not give
            raise ValueError("kvcm: transformers' own CPU swap pool (cpu_offload_space) cannot run with kvcm; "
                             "give kvcm a host tier instead (KvcmContinuousBatching(host_blocks=...))")
        if cb is not None and cb.use_async_batching:
            raise ValueError("kvcm: async batching is not supported (commits would lag the scheduler by a batch); "
                             "use ContinuousBatchingConfig(use_async_batching=False)")
        super().__init__(*args, **kwargs)
        self._kc.transformers_prefix_sharing = self.use_prefix_sharing  # transformers' own choice, for reports
        self._kv: dict[str, KVCache] = {}
        self._preempted: set[str] = set()  # suspended by a preemption: the finish that follows keeps them
        for allocator in self.cache_allocators.values():
            if isinstance(allocator, SlidingAttentionCacheAllocator):
                allocator.__class__ = KvcmSlidingAllocator  # same state, linear reads (class docstring)
        self._kc._attach(self)
        # every data sector belongs to kvcm's pools: transformers' own pool hands out nothing
        self.pool.free_sectors.clear()
        # kvcm matches every admitted prompt, whatever the attention kinds
        self.use_prefix_sharing = True

    # ---------------------------------------------------------------- helpers

    def _sync_tables(self, request_id: str) -> None:
        """``block_table`` of every group from kvcm's page indices (they change on commits that
        adopt a tree page, on cow and on resize)."""
        kv = self._kv[request_id]
        kc = self._kc
        for name, allocator in self.cache_allocators.items():
            base = kc.base[name]
            allocator.block_table[request_id] = [s + base if s >= 0 else -1 for s in kv.page_indices(kc.lc[name])]

    def _drop_tables(self, request_id: str) -> None:
        for allocator in self.cache_allocators.values():
            allocator.block_table.pop(request_id, None)

    # ---------------------------------------------------------------- admission

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """Match the prompt in kvcm's tree (and the shared store), lock the matched pages on
        gpu (onboarding from host / disk / the store) and return the matched length: at most
        ``len(prompt_ids) - 1`` (the last prompt token is always computed: its logits are
        the first sample).  0 with no cache when gpu slots are short: the request waits."""
        kc = self._kc
        kv = self._kv.get(request_id)
        if kv is not None:
            if kv.status is Status.ACTIVE:  # matched earlier, could not be stored yet
                return 0 if kv.num_committed_tokens == 0 else self._resumed(request_id, kv, prompt_ids)
            # SUSPENDED by a preemption: resume it when the prompt extends what it committed
            if kv.num_committed_tokens < len(prompt_ids) and kv.committed_tokens == list(
                    prompt_ids[:kv.num_committed_tokens]):
                if not kv.resume():
                    kc._apply()
                    return 0
                kc.counters["resumed_requests"] += 1
                return self._resumed(request_id, kv, prompt_ids)
            kv.close()
            del self._kv[request_id]
        key = list(prompt_ids[:-1])
        hits = None
        if kc.has_shared:
            hits = kc.plane.shared_lookup(kc.mgr.shared_candidates(key))
        kv = kc.mgr.create_kv_cache(key, id=request_id, shared_hits=hits)
        if not kv.resume():
            kv.close()
            kc._apply()
            return 0
        self._kv[request_id] = kv
        kc.counters["prompt_tokens"] += len(prompt_ids)
        kc.counters["reused_tokens"] += kv.num_committed_tokens
        return self._resumed(request_id, kv, prompt_ids)

    def _resumed(self, request_id: str, kv: KVCache, prompt_ids: list[int]) -> int:
        self._kc._apply()  # onboard / cow before anything reads the pages
        self._sync_tables(request_id)
        return kv.num_committed_tokens

    def can_store_request_tokens(self, state: RequestState, request_len: int, dry_run: bool = False) -> bool:
        """Pages for ``request_len`` more tokens (kvcm evicts / offloads to make room);
        False, nothing changed, when the gpu cannot hold them."""
        if dry_run:  # transformers' probe of the longest request an empty cache holds
            return self._kc.fits_alone(state.current_len() + request_len)
        kv = self._kv.get(state.request_id)
        if kv is None or kv.status is not Status.ACTIVE:
            return False
        past = state.current_len()
        if kv.num_committed_tokens != past:
            raise RuntimeError(f"kvcm: request {state.request_id} has {kv.num_committed_tokens} tokens committed "
                               f"but transformers is at position {past} (async batching is not supported)")
        if not kv.resize(past + request_len, history_length=past):
            return False
        self._kc._apply()
        self._sync_tables(state.request_id)
        return True

    def count_new_complete_blocks(self, state: RequestState, request_len: int) -> dict[str, int]:
        self._kc.counters["computed_tokens"] += request_len
        if not state.generated_tokens:  # a prompt chunk (a preempted request's prompt includes its output)
            self._kc.counters["prefill_tokens"] += request_len
        return {_TOKENS_KEY: request_len}

    def mark_complete_blocks(self, state: RequestState, complete_blocks: dict[str, int]) -> None:
        """Commit the tokens the forward just wrote (before a finished request is freed)."""
        n = complete_blocks.get(_TOKENS_KEY, 0)
        kv = self._kv.get(state.request_id)
        if not n or kv is None or kv.status is not Status.ACTIVE:
            return
        c = kv.num_committed_tokens
        tokens = (state.initial_tokens + state.generated_tokens)[c:c + n]
        if len(tokens) != n:
            raise RuntimeError(f"kvcm: request {state.request_id}: {n} tokens computed from position {c}, "
                               f"but only {len(tokens)} are known")
        kv.commit(tokens)
        self._kc._apply()

    # ---------------------------------------------------------------- release

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """A finished request: close (its committed pages stay reusable).  A preemption
        (``no_cache=True``, transformers' soft reset): suspend when a colder tier can take
        its pages (resumed at re-admission), else close (re-admission matches the tree)."""
        self._drop_tables(request_id)
        kv = self._kv.get(request_id)
        if kv is None:
            return
        if request_id in self._preempted and not no_cache:
            self._preempted.discard(request_id)  # the finish_request right after the preemption
            return
        if no_cache and self._kc.has_lower_tier and kv.status is Status.ACTIVE:
            kv.suspend()
            self._preempted.add(request_id)
            self._kc.counters["suspended_requests"] += 1
        else:
            kv.close()
            del self._kv[request_id]
            self._preempted.discard(request_id)
        self._kc._apply()

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        for request_id in list(self._kv):
            self._drop_tables(request_id)
            self._kv.pop(request_id).close()
        self._preempted.clear()
        self._kc._apply()

    def reset(self) -> None:
        # the pool stays empty (every sector is kvcm's); reusable pages survive a reset
        self.free_all_requests()

    def evict_cached_blocks(self) -> bool:
        return False  # kvcm evicts (offloads) on demand, inside resize / resume

    # ---------------------------------------------------------------- capacity

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        """gpu slots that a resize can have (free, droppable, and held ones a colder tier can take)."""
        kc = self._kc
        gpu = kc.mgr.stats()["tiers"][kc.gpu_pos]["lc"]
        fracs, nbytes = [], 0
        for name, lc in kc.lc.items():
            row = gpu[lc]
            avail = row["free"] + row["droppable"] + (row["held"] if kc.has_lower_tier else 0)
            fracs.append(avail / max(1, row["total"]))
            nbytes += avail * self.cache_allocators[name].bytes_per_block
        return min(fracs) if relative else nbytes

    def count_storable_requests(self, list_blocks_needed: list[dict[str, int]]) -> int:
        kc = self._kc
        gpu = kc.mgr.stats()["tiers"][kc.gpu_pos]["lc"]
        avail = {name: gpu[lc]["free"] + gpu[lc]["droppable"] for name, lc in kc.lc.items()}
        for i, need in enumerate(list_blocks_needed):
            for name, left in avail.items():
                avail[name] = left - need.get(name, 0)
                if avail[name] < 0:
                    return i
        return len(list_blocks_needed)

    # ---------------------------------------------------------------- forks (parallel sampling)

    def prepare_fork_request(self, src_state: RequestState, dst_req_ids: list[str],
                             copy_src_and_dst: dict[str, tuple[list[int], list[int]]]) -> list[str]:
        """``KVCache.fork()`` per child: every committed page shared copy-on-write by kvcm (a
        shared partial page is copied by the first writer's resize, as a ``cow`` op the data
        plane runs); transformers' own copy lists stay empty."""
        src = self._kv[src_state.request_id]
        forked = []
        for dst in dst_req_ids:
            try:
                child = src.fork(id=dst)
            except kvcm.OutOfPagesError:
                break
            self._kv[dst] = child
            self._sync_tables(dst)
            forked.append(dst)
            self._kc.counters["forks"] += 1
        self._kc._apply()
        return forked


class KvcmContinuousBatching:
    """Context manager: inside it, transformers' continuous batching keeps its paged KV in kvcm.

    ``host_blocks`` / ``disk_blocks``: pages per life cycle of a host tier and a disk tier
    (``disk_path`` its directory); ``shared_path``: a shared tier on that store (a directory
    or ``file:///dir`` or ``mooncake://...``) with ``shared_bytes`` of quota (the tier's
    ``quota_bytes``: a file store's byte cap, 0 unbounded; the Mooncake segment this process
    mounts, 0 none: the default, since objects in a process's own segment die with it).  The gpu tier is
    transformers' cache tensor (size it with ``ContinuousBatchingConfig(num_blocks=...)``).
    ``backend``: kvcm backend (default ``KVCM_BACKEND``).  The manager and data plane are
    built with the first cache and kept for every later one in the context (the same
    cache tensor is re-used, so reusable pages survive from one ``generate_batch`` to the next).
    """

    def __init__(self, *, host_blocks: int = 0, disk_blocks: int = 0, disk_path: str | None = None,
                 shared_path: str | None = None, shared_bytes: int = 0, backend: str | None = None) -> None:
        for name, v in (("host_blocks", host_blocks), ("disk_blocks", disk_blocks), ("shared_bytes", shared_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if disk_blocks and not disk_path:
            raise ValueError("disk_blocks needs disk_path")
        self.host_blocks, self.disk_blocks, self.disk_path = host_blocks, disk_blocks, disk_path
        self.shared_path, self.shared_bytes = shared_path, shared_bytes
        self.backend = backend
        self.has_lower_tier = bool(host_blocks or disk_blocks)
        self.has_shared = shared_path is not None
        self.mgr: Any = None
        self.plane: DataPlane | None = None
        self.counters = dict.fromkeys(("prompt_tokens", "reused_tokens", "computed_tokens", "prefill_tokens",
                                       "suspended_requests", "resumed_requests", "forks"), 0)
        self.transformers_prefix_sharing: bool | None = None  # what transformers would have done (last cache)
        self._saved: Any = None
        self._geometry: tuple | None = None
        self._tensor: torch.Tensor | None = None

    # ---------------------------------------------------------------- context

    def __enter__(self) -> Self:
        problems = check_pinned_internals()
        if problems:
            raise RuntimeError("kvcm.integrations.transformers: the pinned transformers internals changed: "
                               + "; ".join(problems))
        self._saved = tf_api.PagedAttentionCache
        tf_api.PagedAttentionCache = type("KvcmPagedAttentionCache", (KvcmPagedAttentionCache,), {"_kc": self})
        return self

    def __exit__(self, *exc: object) -> None:
        tf_api.PagedAttentionCache = self._saved
        self.close()

    def close(self) -> None:
        if self.plane is not None:
            self.plane.close()
            self.plane = None
        if self.mgr is not None:
            self.mgr.shutdown()
            self.mgr = None

    # ---------------------------------------------------------------- wiring

    def _attach(self, cache: KvcmPagedAttentionCache) -> None:
        """Give the cache's data sectors to kvcm (module docstring); build the manager and
        plane with the first cache, re-use them (and the cache tensor) for later ones."""
        missing = [f"PagedAttentionCache.{n}" for n in _PINNED_CACHE_ATTRS if not hasattr(cache, n)]
        missing += [f"{type(a).__name__}.{n}" for a in getattr(cache, "cache_allocators", {}).values()
                    for n in _PINNED_ALLOCATOR_ATTRS if not hasattr(a, n)]
        if missing:
            raise RuntimeError("kvcm.integrations.transformers: the pinned transformers internals changed: "
                               f"no attribute {', '.join(missing)}")
        allocators = list(cache.cache_allocators.items())
        B = allocators[0][1].tokens_per_page
        # slots per lc: the largest n such that every group's n blocks fit in whole sectors
        bps = [a.blocks_per_sector for _, a in allocators]
        lo, hi = 0, cache.num_sectors * max(bps)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(math.ceil(mid / b) for b in bps) <= cache.num_sectors:
                lo = mid
            else:
                hi = mid - 1
        n = lo
        if n < 1:
            raise ValueError("kvcm: the paged cache has no room for one block per attention group")
        geometry = (B, n, cache.num_sectors, cache.bytes_per_sector, cache.dtype, tuple(
            (name, tuple(a.layer_indices), a.bytes_per_block, getattr(a, "sliding_window", None))
            for name, a in allocators))
        if self.mgr is None:
            self._build(cache, allocators, B, n)
            self._geometry, self._tensor = geometry, cache.cache_tensor
        else:
            if geometry != self._geometry:
                raise ValueError("kvcm: a second continuous-batching cache in one KvcmContinuousBatching context must "
                                 f"have the first one's geometry {self._geometry}, got {geometry}")
            # the same bytes under the new allocators: reusable pages stay valid
            cache.cache_tensor = self._tensor
            non_trash = cache.num_sectors * cache.bytes_per_sector
            for _, a in allocators:
                a.register_cache_tensor(cache.bytes_per_sector, non_trash, self._tensor, cache.pool)
        # sector runs: group i owns sectors [2 + first_i, 2 + first_i + ceil(n / bps_i)) (2 trash sectors first)
        first = 0
        pos = self.gpu_pos
        for (name, a), b in zip(allocators, bps):
            base = (2 + first) * b
            self.base[name] = base
            self.plane.pools[pos][self.lc[name]] = a._copy_view[base:base + n]
            first += math.ceil(n / b)

    def _build(self, cache: KvcmPagedAttentionCache, allocators: list, B: int, n: int) -> None:
        layers = []
        for _, a in allocators:
            per_token = a.bytes_per_page // a.tokens_per_page  # one layer's K and V of one token
            window = getattr(a, "sliding_window", None)
            layers += [AttentionLayer(i, per_token, window=window) for i in a.layer_indices]
        layers.sort(key=lambda layer: layer.layer_id)
        # kvcm's life cycles of these layers (the rule lives in kvcm.config), from a probe
        # config with one slot per lc: only the slot sizes are needed to size the tiers
        one_each = sum(layer.bytes_per_token * B for layer in layers)
        lcs = resolve_config(KVCacheManagerConfig(tokens_per_block=B, layers=layers,
                                                  tiers=[Tier("gpu", one_each)])).life_cycles
        per_block = sum(lc.slot_bytes for lc in lcs)
        tiers = [Tier("gpu", n * per_block)]
        if self.host_blocks:
            tiers.append(Tier("host", self.host_blocks * per_block))
        if self.disk_blocks:
            tiers.append(Tier("disk", self.disk_blocks * per_block, path=self.disk_path))
        if self.shared_path is not None:
            tiers.append(Tier("shared", self.shared_bytes, path=self.shared_path))
        config = KVCacheManagerConfig(tokens_per_block=B, layers=layers, tiers=tiers,
                                      shared_namespace=f"transformers-{transformers.__version__}")
        self.mgr = kvcm.KVCacheManager(config, backend=self.backend)
        self.lc: dict[str, int] = {}
        self.base: dict[str, int] = {}
        for name, a in allocators:
            match = [lc for lc in self.mgr.life_cycles if set(lc.layer_ids) == set(a.layer_indices)]
            if len(match) != 1:
                raise ValueError(f"kvcm: the {name} layers {a.layer_indices} are not one kvcm life cycle "
                                 f"({[lc.layer_ids for lc in self.mgr.life_cycles]})")
            if match[0].slot_bytes != a.bytes_per_block:
                raise ValueError(f"kvcm: {name}: slot of {match[0].slot_bytes} bytes, block of {a.bytes_per_block}")
            self.lc[name] = match[0].id
        self.gpu_pos = 0
        self.plane = DataPlane(config, device=cache.device)
        for lc in self.mgr.life_cycles:
            if lc.id not in self.lc.values():
                raise ValueError(f"kvcm: life cycle {lc.id} has no transformers group")
        self.B, self.n = B, n
        self.windows = {name: getattr(a, "sliding_window", None) for name, a in allocators}

    def fits_alone(self, tokens: int) -> bool:
        """Whether one request of ``tokens`` tokens fits the gpu tier on its own."""
        for w in self.windows.values():
            live = tokens if w is None else min(tokens, w + self.B)
            if math.ceil(live / self.B) + 1 > self.n:
                return False
        return True

    def _apply(self) -> None:
        """Run the copy ops the manager made (offload / onboard / cow / store) on the pools."""
        runs = self.mgr.drain_copy_runs()
        if runs:
            self.plane.apply_runs(runs)

    # ---------------------------------------------------------------- reporting

    def stats(self) -> dict:
        """Counters for the benchmark: tokens matched / computed, and copies by route."""
        out = dict(self.counters)
        if self.plane is not None:
            out["routes"] = dict(self.plane.routes)
            out["copies"] = dict(self.plane.copies)
        if self.mgr is not None:
            out["kvcm"] = self.mgr.stats()
        return out


__all__ = ["PINNED_TRANSFORMERS", "KvcmContinuousBatching", "KvcmPagedAttentionCache", "KvcmSlidingAllocator",
           "check_pinned_internals"]
