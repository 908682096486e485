"""kvcm behind transformers' ``PagedAttentionCache`` (DECISIONS.md "transformers continuous batching").

transformers keeps the paged KV in one flat ``cache_tensor`` cut into *sectors*, each sector
handed to one cache allocator (one per attention kind: full, sliding) and cut into that
allocator's *blocks* (``page_size`` tokens of every layer of the group).  The attention reads
and writes go through ``allocator.block_table[request_id]`` (block ids), turned into physical
token indices.  This module:

* is scoped to one model: :class:`KvcmContinuousBatching` hooks that model's
  ``init_continuous_batching`` (the entry point ``generate_batch`` and
  ``continuous_batching_context_manager`` go through) and has each continuous-batching
  manager it returns build its paged cache as a :class:`KvcmPagedAttentionCache` (that
  manager's own ``_create_batch_processor`` runs with this class where transformers' code
  names ``PagedAttentionCache``); nothing process-wide changes, other models and other
  contexts are untouched;
* gives every data sector to kvcm at construction: allocator ``a`` owns a contiguous run of
  sectors whose blocks are kvcm's gpu slots of the life cycle (lc) of ``a``'s layers, so
  block id = ``base[a] + slot``, and the data plane adopts the view
  ``allocator._copy_view[base : base + n]`` of transformers' cache tensor as that lc's gpu
  pool (``DataPlane.adopt_memory``): kvcm's copy ops (offload, onboard, cow, store) move
  transformers' own bytes;
* overrides the cache's request-level methods (prefix match, allocation, commits, frees,
  forks, free capacity) to drive the kvcm manager through :class:`kvcm.engine_loop.EngineLoop`,
  and rewrites ``block_table`` from ``kv.page_indices(lc)`` before every forward;
* reads sliding-window groups linearly (token ``p`` at block ``p // page_size``) instead of
  through transformers' ring buffer (``extend_read_and_write_indices``), so that their blocks
  can enter kvcm's tree and be shared;
* turns a copy that failed (a ``CopyError``: a disk tier's I/O or checksum, a store's load)
  into a recompute: the manager forgets the lost pages and rolls back the requests that used
  them, which are always requests transformers is not running: the one being admitted
  (admitted again from the shorter match), a preempted one (resumed from it when it is
  admitted again) or a child of a fork (handed back to transformers as a new request,
  resumed likewise).  A running request's pages are locked on gpu and only its own
  admission and fork copy into them.

Nothing of transformers' source is copied; the internals relied on are listed in
:func:`check_pinned_internals`, which :class:`KvcmContinuousBatching` runs on entry.
"""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable
from typing import Any, Self

import transformers
from transformers.generation.continuous_batching import cache as tf_cache
from transformers.generation.continuous_batching import continuous_api as tf_api
from transformers.generation.continuous_batching import input_outputs as tf_io
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
from kvcm import AttentionLayer
from kvcm.api import KVCache, Status
from kvcm.dataplane import DataPlane
from kvcm.engine_loop import EngineLoop, config_from_layout

PINNED_TRANSFORMERS = "5.19."  # the minor version whose internals this module was written against
_TOKENS_KEY = "kvcm_tokens"  # our entry in FutureRequestState.complete_blocks: tokens the forward computed

# Methods of transformers' objects that this module CALLS (those it overrides are checked
# against their base by check_pinned_internals): (class, method) -> parameters.  Full-attention
# groups keep transformers' own index code (extend_read_and_write_indices).
_CALLED: dict[tuple[type, str], tuple[str, ...]] = {
    (FullAttentionCacheAllocator, "get_read_indices"): ("self", "request_id", "past_length", "query_length"),
    (FullAttentionCacheAllocator, "get_write_indices"): ("self", "request_id", "past_length", "query_length"),
}
# (function, text its source must contain): the call sites that make the overrides and the hook take effect
_PINNED_CALLS: tuple[tuple[Any, str], ...] = (
    # the hook: every entry point reaches init_continuous_batching, whose manager builds the cache here
    (tf_api.ContinuousMixin.continuous_batching_context_manager, "self.init_continuous_batching("),
    (tf_api.ContinuousMixin.generate_batch, "self.continuous_batching_context_manager("),
    (tf_api.ContinuousBatchingManager._create_batch_processor, "PagedAttentionCache("),
    # admission, allocation and commits
    (tf_scheduler.Scheduler._infer_request_tokens, "self.cache.use_prefix_sharing"),
    (tf_scheduler.Scheduler._infer_request_tokens,
     "self.cache.search_prefix_match(state.request_id, state.remaining_prefill_tokens)"),
    (tf_scheduler.Scheduler._process_candidates, "self.cache.can_store_request_tokens(state, request_len)"),
    (tf_scheduler.Scheduler._process_candidates, "self.cache.count_new_complete_blocks(state, request_len)"),
    (tf_api.ContinuousBatchProcessor.update_batch,
     "self.cache.mark_complete_blocks(state, future_state.complete_blocks)"),
    (tf_api.ContinuousBatchProcessor.update_batch, "self.cache.prepare_fork_request("),
    (RequestState.current_len, "return self.position_offset"),
    # the linear sliding-window reads and writes
    (tf_io.ContinuousBatchingIOs.prepare_batch_tensors, "self.cache.extend_read_and_write_indices("),
    # preemption becomes suspend / resume
    (tf_offload.OffloadingManager.offload_requests, "self.cache.free_blocks(state.request_id, no_cache=True)"),
    # children a fork did not give are queued as new requests (a failed copy-on-write gives none)
    (tf_api.ContinuousBatchProcessor.update_batch, "for new_request_id in new_request_ids[len(forked_ids) :]:"),
)
# attributes of objects built at run time that we read or write (checked on every cache built)
_PINNED_CACHE_ATTRS = ("cache_allocators", "pool", "num_sectors", "cache_tensor", "use_prefix_sharing", "dtype")
_PINNED_ALLOCATOR_ATTRS = ("block_table", "_copy_view", "blocks_per_sector", "bytes_per_block", "tokens_per_page",
                           "layer_indices", "block_physical_stride", "sentinel_index")


def check_pinned_internals(version: str | None = None) -> list[str]:
    """What changed in the transformers internals this integration relies on ([] = nothing).
    ``version``: the transformers version to judge (default: the installed one)."""
    problems = []
    version = transformers.__version__ if version is None else version
    if not version.startswith(PINNED_TRANSFORMERS):
        problems.append(f"transformers {version} is not the pinned {PINNED_TRANSFORMERS}x")
    # every method KvcmPagedAttentionCache overrides takes what transformers' version takes
    base = tf_api.PagedAttentionCache
    for name, fn in vars(KvcmPagedAttentionCache).items():
        if name.startswith("_") or not inspect.isfunction(fn):  # our own helpers and __init__
            continue
        theirs = getattr(base, name, None)
        if theirs is None:
            problems.append(f"PagedAttentionCache.{name} is gone")
            continue
        got, want = tuple(inspect.signature(theirs).parameters), tuple(inspect.signature(fn).parameters)
        if got != want:
            problems.append(f"PagedAttentionCache.{name} takes {got}, pinned {want}")
    for (cls, name), want in _CALLED.items():
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
    build = tf_api.ContinuousBatchingManager._create_batch_processor
    if inspect.unwrap(build) is not build or build.__closure__:
        problems.append("ContinuousBatchingManager._create_batch_processor is wrapped")
    if set(tf_cache.ATTN_TYPE_TO_ALLOCATOR) != {FULL_ATTENTION, SLIDING_ATTENTION}:
        problems.append(f"attention kinds are now {sorted(tf_cache.ATTN_TYPE_TO_ALLOCATOR)}")
    return problems


def _missing(obj: Any, names: tuple[str, ...]) -> list[str]:
    return [f"{type(obj).__name__}.{n}" for n in names if not hasattr(obj, n)]


def _internals_changed(what: str) -> RuntimeError:
    return RuntimeError(f"kvcm.integrations.transformers: the pinned transformers internals changed: {what}")


# ---------------------------------------------------------------------------------------
# The hook: one model's continuous batching builds its paged cache with a factory
# ---------------------------------------------------------------------------------------


class ModelCacheHook:
    """Makes one model's continuous batching build its paged cache with ``factory`` (called
    with transformers' arguments in place of ``PagedAttentionCache(...)``), from
    :meth:`attach` to :meth:`detach`.

    It sets the model's ``init_continuous_batching`` (an instance attribute over the class's
    method: removing it restores the model) to one that gives each continuous-batching
    manager it returns its own ``_create_batch_processor``: transformers' function run with
    ``factory`` bound to the name ``PagedAttentionCache``.  No module, class or other model
    changes, so other models, threads and contexts build transformers' own cache."""

    def __init__(self, model: Any, factory: Callable[..., Any]) -> None:
        self.model = model
        self.factory = factory
        self._fn: Callable[..., Any] | None = None

    def attach(self) -> None:
        if "init_continuous_batching" in vars(self.model):
            raise ValueError("kvcm: this model's continuous batching is already hooked (one KvcmContinuousBatching "
                             "per model at a time)")
        original = self.model.init_continuous_batching
        hook = self

        def init_continuous_batching(*args: Any, **kwargs: Any) -> Any:
            manager = original(*args, **kwargs)
            hook._take(manager)
            return manager

        self._fn = init_continuous_batching
        self.model.init_continuous_batching = init_continuous_batching

    def detach(self) -> None:
        if self._fn is not None and vars(self.model).get("init_continuous_batching") is self._fn:
            del self.model.init_continuous_batching
        self._fn = None

    def _take(self, manager: Any) -> None:
        """Give ``manager`` (transformers' ContinuousBatchingManager) its own cache builder."""
        own = vars(manager).get("_create_batch_processor")
        if own is not None:
            if getattr(own, "__func__", None) is not None and getattr(own.__func__, "hook", None) is self:
                return  # a persistent manager this hook took before
            raise ValueError("kvcm: this model's cached continuous-batching manager belongs to another context; "
                             "destroy it first (model.destroy_cached_continuous_batching_manager())")
        if getattr(manager, "batch_processor", None) is not None:
            raise ValueError("kvcm: this model's cached continuous-batching manager was built without kvcm; "
                             "destroy it first (model.destroy_cached_continuous_batching_manager())")
        build = tf_api.ContinuousBatchingManager._create_batch_processor
        names = dict(build.__globals__)
        names["PagedAttentionCache"] = self.factory
        scoped = types.FunctionType(build.__code__, names, build.__name__, build.__defaults__, build.__closure__)

        def create_batch_processor(mgr: Any) -> Any:
            return scoped(mgr)

        create_batch_processor.hook = self  # type: ignore[attr-defined]
        manager._create_batch_processor = types.MethodType(create_batch_processor, manager)


# ---------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------


class KvcmPagedAttentionCache(tf_api.PagedAttentionCache):
    """transformers' paged cache with kvcm deciding every block (see the module docstring).
    Built by transformers itself, inside :class:`KvcmContinuousBatching`, for the hooked model."""

    def __init__(self, kc: KvcmContinuousBatching, *args: Any, **kwargs: Any) -> None:
        cb = kwargs.get("continuous_batching_config", args[1] if len(args) > 1 else None)
        if cb is not None and cb.cpu_offload_space:
            # its swap-in path skips admission (no prefix match: no kv) and writes blocks kvcm did not give
            raise ValueError("kvcm: transformers' own CPU swap pool (cpu_offload_space) cannot run with kvcm; "
                             "give kvcm a host tier instead (KvcmContinuousBatching(model, host_blocks=...))")
        if cb is not None and cb.use_async_batching:
            raise ValueError("kvcm: async batching is not supported (commits would lag the scheduler by a batch); "
                             "use ContinuousBatchingConfig(use_async_batching=False)")
        super().__init__(*args, **kwargs)
        self._kc = kc
        kc.transformers_prefix_sharing = self.use_prefix_sharing  # transformers' own choice, for reports
        self._kv: dict[str, KVCache] = {}
        self._preempted: set[str] = set()  # suspended by a preemption: the finish that follows keeps them
        self._running: set[str] = set()  # requests transformers runs (stored, until freed)
        kc._attach(self)
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

    def _rolled_back(self, request_id: str) -> None:
        """The manager rolled ``request_id`` back (a copy into one of its pages failed): its
        kvcm request is SUSPENDED with fewer committed tokens, and its next admission resumes
        it from there (being admitted: at once; preempted: when transformers admits it again;
        a fork's child: handed back to transformers as a new request).  A request transformers
        is running cannot be rolled back (module docstring); if one were, its next forward
        would read pages it lost: stop."""
        self._kc.counters["rollbacks"] += 1
        if request_id in self._running:
            raise RuntimeError(f"kvcm: running request {request_id} was rolled back by a failed copy "
                               "(cannot happen: its pages are locked on gpu)")

    def _linear(self, allocator: Any, request_id: str, start: int, length: int) -> list[int]:
        """Physical indices of tokens ``start .. start + length - 1`` of a sliding group read
        linearly: token ``p`` at block ``p // page_size`` of the request's block table (kvcm's
        page per block ordinal; a stale block is -1 and never read)."""
        table = allocator.block_table[request_id]
        page, stride = allocator.tokens_per_page, allocator.block_physical_stride
        out = []
        for p in range(start, start + length):
            block = table[p // page]
            if block < 0:  # a stale block: kvcm released it because the window no longer needs it
                raise RuntimeError(f"kvcm: request {request_id} reads token {p} of a released sliding block")
            out.append(block * stride + p % page)
        return out

    # ---------------------------------------------------------------- indices

    def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                      read_index: list[list[int]] | None, write_index: list[list[int]]) -> None:
        """transformers' own indices for full-attention groups; sliding groups are read
        linearly: the last ``min(past, window - 1)`` cached tokens then a sentinel per new
        token (the order transformers' sliding ``update`` and ``get_seqlen_k`` expect), and the
        new tokens written at their linear places."""
        for i, allocator in enumerate(self.cache_allocators.values()):
            window = getattr(allocator, "sliding_window", None)
            if window is None:
                write_index[i].extend(allocator.get_write_indices(request_id, past_length, query_length))
                if read_index is not None:
                    read_index[i].extend(allocator.get_read_indices(request_id, past_length, query_length))
                continue
            write_index[i].extend(self._linear(allocator, request_id, past_length, query_length))
            if read_index is not None:
                cached = min(past_length, window - 1)
                read_index[i].extend(self._linear(allocator, request_id, past_length - cached, cached)
                                     + [allocator.sentinel_index] * query_length)

    # ---------------------------------------------------------------- admission

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """Match the prompt in kvcm's tree (and the shared store), lock the matched pages on
        gpu (onboarding from host / disk / the store) and return the matched length: at most
        ``len(prompt_ids) - 1`` (the last prompt token is always computed: its logits are
        the first sample).  0 with no cache when gpu slots are short: the request waits."""
        kc = self._kc
        loop = kc.loop
        kv = self._kv.get(request_id)
        if kv is not None:
            if kv.status is Status.ACTIVE:  # matched earlier, could not be stored yet
                if kv.num_committed_tokens == 0:
                    return 0
                loop.sync()
                return self._resumed(request_id, kv)
            # SUSPENDED by a preemption or a roll-back: resume it when the prompt extends what it committed
            if kv.num_committed_tokens < len(prompt_ids) and kv.committed_tokens == list(
                    prompt_ids[:kv.num_committed_tokens]):
                if not loop.resume(kv):  # onboard / cow run before anything reads the pages
                    loop.sync()
                    return 0
                kc.counters["resumed_requests"] += 1
                return self._resumed(request_id, kv)
            kv.close()
            del self._kv[request_id]
        kv = loop.admit(list(prompt_ids[:-1]), id=request_id)  # lookup, create, resume, copies
        if kv is None:
            return 0
        self._kv[request_id] = kv
        kc.counters["prompt_tokens"] += len(prompt_ids)
        kc.counters["reused_tokens"] += kv.num_committed_tokens
        return self._resumed(request_id, kv)

    def _resumed(self, request_id: str, kv: KVCache) -> int:
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
        self._kc.loop.sync()
        self._sync_tables(state.request_id)
        self._running.add(state.request_id)
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
        self._kc.loop.sync()

    # ---------------------------------------------------------------- release

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """A finished request: close (its committed pages stay reusable).  A preemption
        (``no_cache=True``, transformers' soft reset): suspend when a colder tier can take
        its pages (resumed at re-admission), else close (re-admission matches the tree)."""
        self._drop_tables(request_id)
        self._running.discard(request_id)
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
        self._kc.loop.sync()

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        for request_id in list(self._kv):
            self._drop_tables(request_id)
            self._kv.pop(request_id).close()
        self._preempted.clear()
        self._running.clear()
        self._kc.loop.sync()

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
        """``KVCache.fork()`` per child: every committed page shared copy-on-write by kvcm (the
        page a child writes next is copied, a ``cow`` op the data plane runs); transformers'
        own copy lists stay empty.  Returns the children forked, a prefix of ``dst_req_ids``
        (transformers queues the others as new requests): those that did not fit, and from
        the first child whose copy failed (rolled back) on, whose kvcm requests then wait for
        that admission (resumed from what they hold)."""
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
        self._kc.loop.sync()
        ok = 0
        while ok < len(forked) and self._kv[forked[ok]].status is Status.ACTIVE:
            ok += 1
        for dst in forked[ok:]:
            self._drop_tables(dst)
        self._running.update(forked[:ok])
        return forked[:ok]


# ---------------------------------------------------------------------------------------
# The context
# ---------------------------------------------------------------------------------------


class KvcmContinuousBatching:
    """Context manager: inside it, ``model``'s continuous batching keeps its paged KV in kvcm.

    ``model``: the transformers model whose ``generate_batch`` / ``init_continuous_batching``
    / ``continuous_batching_context_manager`` use kvcm (only that model, for this context).
    ``host_blocks`` / ``disk_blocks``: pages per life cycle of a host tier and a disk tier
    (``disk_path`` its directory); ``shared_path``: a shared tier on that store (a directory
    or ``file:///dir`` or ``mooncake://...``) with ``shared_bytes`` of quota (the tier's
    ``quota_bytes``: a file store's byte cap, 0 unbounded; the Mooncake segment this process
    mounts, 0 none: the default, since objects in a process's own segment die with it).  The gpu tier is
    transformers' cache tensor (size it with ``ContinuousBatchingConfig(num_blocks=...)``).
    ``backend``: kvcm backend (default ``KVCM_BACKEND``).  The manager and data plane are
    built with the first cache and kept for every later one in the context (the reusable
    pages are carried from one cache tensor to the next, so they survive from one
    ``generate_batch`` to the next).
    """

    def __init__(self, model: Any, *, host_blocks: int = 0, disk_blocks: int = 0, disk_path: str | None = None,
                 shared_path: str | None = None, shared_bytes: int = 0, backend: str | None = None) -> None:
        if not callable(getattr(model, "init_continuous_batching", None)):
            raise TypeError(f"KvcmContinuousBatching needs a transformers model with continuous batching, "
                            f"got {type(model).__name__}")
        for name, v in (("host_blocks", host_blocks), ("disk_blocks", disk_blocks), ("shared_bytes", shared_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if disk_blocks and not disk_path:
            raise ValueError("disk_blocks needs disk_path")
        if shared_path is not None and (not isinstance(shared_path, str) or not shared_path):
            raise ValueError(f"shared_path must be a non-empty string, got {shared_path!r}")
        self.model = model
        self.host_blocks, self.disk_blocks, self.disk_path = host_blocks, disk_blocks, disk_path
        self.shared_path, self.shared_bytes = shared_path, shared_bytes
        self.backend = backend
        self.has_lower_tier = bool(host_blocks or disk_blocks)
        self.mgr: Any = None
        self.plane: DataPlane | None = None
        self.loop: EngineLoop | None = None
        self.counters = dict.fromkeys(("prompt_tokens", "reused_tokens", "computed_tokens", "prefill_tokens",
                                       "suspended_requests", "resumed_requests", "forks", "rollbacks"), 0)
        self.transformers_prefix_sharing: bool | None = None  # what transformers would have done (last cache)
        self._hook = ModelCacheHook(model, self._new_cache)
        self._cache: KvcmPagedAttentionCache | None = None
        self._geometry: tuple | None = None

    # ---------------------------------------------------------------- context

    def __enter__(self) -> Self:
        problems = check_pinned_internals()
        if problems:
            raise _internals_changed("; ".join(problems))
        self._hook.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.detach()
        self.close()

    def close(self) -> None:
        if self._cache is not None and self._cache._kv and self.mgr is not None:
            self._cache.free_all_requests()  # requests a failed run left open
        self._cache = None
        if self.plane is not None:
            self.plane.close()
            self.plane = None
        if self.mgr is not None:
            self.mgr.shutdown()
            self.mgr = None

    def _new_cache(self, *args: Any, **kwargs: Any) -> KvcmPagedAttentionCache:
        return KvcmPagedAttentionCache(self, *args, **kwargs)

    def _rolled_back(self, request_id: int | str) -> None:
        if self._cache is not None:
            self._cache._rolled_back(str(request_id))

    # ---------------------------------------------------------------- wiring

    def _attach(self, cache: KvcmPagedAttentionCache) -> None:
        """Give the cache's data sectors to kvcm (module docstring); build the manager and
        plane with the first cache; a later one gets the first one's reusable pages (its
        tensor's bytes) and the data plane adopts its tensor."""
        missing = _missing(cache, _PINNED_CACHE_ATTRS)
        missing += [m for a in getattr(cache, "cache_allocators", {}).values() for m in _missing(a, _PINNED_ALLOCATOR_ATTRS)]
        missing += [m for a in getattr(cache, "cache_allocators", {}).values()
                    if isinstance(a, SlidingAttentionCacheAllocator) for m in _missing(a, ("sliding_window",))]
        if missing:
            raise _internals_changed(f"no attribute {', '.join(missing)}")
        allocators = list(cache.cache_allocators.items())
        for name, a in allocators:
            w = getattr(a, "sliding_window", None)
            if w is None:
                continue
            # the linear reads (extend_read_and_write_indices) must be as long as transformers' key lengths
            pasts = (0, 1, w - 1, w, 5 * w)
            try:
                lengths = [a.get_seqlen_k(p, 3) for p in pasts]
            except TypeError as e:
                raise _internals_changed(f"{name}: get_seqlen_k(past_length, query_length) fails: {e}") from None
            if lengths != [3 + min(p, w - 1) for p in pasts]:
                raise _internals_changed(f"{name}: get_seqlen_k is no longer query + min(past, window - 1)")
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
        geometry = (B, n, cache.num_sectors, cache.dtype, tuple(
            (name, tuple(a.layer_indices), a.bytes_per_block, a.blocks_per_sector, getattr(a, "sliding_window", None))
            for name, a in allocators))
        if self.mgr is None:
            self._build(cache, allocators, B, n)
            self._geometry = geometry
        else:
            if geometry != self._geometry:
                raise ValueError("kvcm: a second continuous-batching cache in one KvcmContinuousBatching context must "
                                 f"have the first one's geometry {self._geometry}, got {geometry}")
            old = self._cache.cache_tensor if self._cache is not None else None
            if old is None or old.shape != cache.cache_tensor.shape:
                raise ValueError("kvcm: the new cache tensor does not have the first one's size")
            cache.cache_tensor.copy_(old)  # the reusable pages, byte for byte, at the same block ids
        # sector runs: group i owns sectors [2 + first_i, 2 + first_i + ceil(n / bps_i)) (2 trash sectors first)
        first = 0
        for (name, a), b in zip(allocators, bps):
            base = (2 + first) * b
            self.base[name] = base
            self.plane.adopt_memory("gpu", self.lc[name], a._copy_view[base:base + n])
            first += math.ceil(n / b)
        self._cache = cache

    def _build(self, cache: KvcmPagedAttentionCache, allocators: list, B: int, n: int) -> None:
        layers = []
        for _, a in allocators:
            per_token = a.bytes_per_block // (a.tokens_per_page * len(a.layer_indices))  # one layer's K and V of one token
            window = getattr(a, "sliding_window", None)
            layers += [AttentionLayer(i, per_token, window=window) for i in a.layer_indices]
        layers.sort(key=lambda layer: layer.layer_id)
        config = config_from_layout(B, layers, gpu_blocks=n, host_blocks=self.host_blocks,
                                    disk_blocks=self.disk_blocks, disk_path=self.disk_path, shared=self.shared_path,
                                    shared_quota_bytes=self.shared_bytes,
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
        for lc in self.mgr.life_cycles:
            if lc.id not in self.lc.values():
                raise ValueError(f"kvcm: life cycle {lc.id} has no transformers group")
        self.gpu_pos = 0
        self.plane = DataPlane(config, device=cache.cache_tensor.device)
        self.loop = EngineLoop(self.mgr, self.plane, on_rollback=self._rolled_back)
        self.B, self.n = B, n
        self.windows = {name: getattr(a, "sliding_window", None) for name, a in allocators}

    def fits_alone(self, tokens: int) -> bool:
        """Whether one request of ``tokens`` tokens fits the gpu tier on its own."""
        for w in self.windows.values():
            live = tokens if w is None else min(tokens, w + self.B)
            if math.ceil(live / self.B) + 1 > self.n:
                return False
        return True

    # ---------------------------------------------------------------- reporting

    def stats(self) -> dict:
        """Counters for the benchmark: tokens matched / computed, and copies by route; with
        copy failures, ``copy_failures`` / ``failed_ops`` (the engine loop's counters)."""
        out = dict(self.counters)
        if self.loop is not None:
            out["copy_failures"] = self.loop.counters["copy_failures"]
            out["failed_ops"] = self.loop.counters["failed_ops"]
        if self.plane is not None:
            out["routes"] = dict(self.plane.routes)
            out["copies"] = dict(self.plane.copies)
        if self.mgr is not None:
            out["kvcm"] = self.mgr.stats()
        return out


__all__ = ["PINNED_TRANSFORMERS", "KvcmContinuousBatching", "KvcmPagedAttentionCache", "ModelCacheHook",
           "check_pinned_internals"]
