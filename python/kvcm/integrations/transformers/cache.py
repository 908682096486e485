"""kvcm behind transformers' ``PagedAttentionCache`` (DECISIONS.md "transformers continuous batching").

transformers keeps the paged KV in one flat ``cache_tensor`` cut into *sectors*, each sector
handed to one cache allocator (one per attention kind: full, sliding) and cut into that
allocator's *blocks* (``page_size`` tokens of every layer of the group).  The attention reads
and writes go through ``allocator.block_table[request_id]`` (block ids), turned into physical
token indices.  This module:

* is scoped to one model: :class:`KvcmContinuousBatching` hooks that model's
  ``init_continuous_batching`` (the entry point ``generate_batch`` and
  ``continuous_batching_context_manager`` go through, as transformers' ``ContinuousMixin``
  documents) and gives each continuous-batching manager it returns its own batch-processor
  factory, :func:`build_batch_processor`: transformers' public parts (the scheduler named by
  ``scheduler_type``, ``ContinuousBatchProcessor``) composed around a
  :class:`KvcmPagedAttentionCache`, a subclass of the public ``PagedAttentionCache``;
  nothing process-wide changes, other models and other contexts are untouched;
* gives every data sector to kvcm at construction: allocator ``a`` owns a contiguous run of
  sectors whose blocks are kvcm's gpu slots of the life cycle (lc) of ``a``'s layers, so
  block id = ``base[a] + slot``, and the data plane adopts those blocks' bytes of
  transformers' cache tensor as that lc's gpu pool (``DataPlane.adopt_memory``): kvcm's copy
  ops (offload, onboard, cow, store) move transformers' own bytes;
* overrides the cache's request-level methods (prefix match, allocation, commits, frees,
  forks, free capacity) to drive the kvcm manager through the offload seam every engine
  integration uses (:class:`kvcm.offload.OffloadManager` over an
  :class:`kvcm.engine_loop.EngineLoop`: lookup, prepare_load, touch, prepare_store,
  complete_store, release, suspend, fork, sync, room), and rewrites ``block_table`` from
  ``kv.page_indices(lc)`` before every forward;
* reads sliding-window groups linearly (token ``p`` at block ``p // page_size``, the places
  transformers' full-attention allocator computes) instead of through transformers' ring
  buffer, so that their blocks can enter kvcm's tree and be shared;
* turns a copy that failed (a ``CopyError``: a disk tier's I/O or checksum, a store's load)
  into a recompute: the manager forgets the lost pages and rolls back the requests that used
  them, which are always requests transformers is not running: the one being admitted
  (admitted again from the shorter match), a preempted one (resumed from it when it is
  admitted again) or a child of a fork (handed back to transformers as a new request,
  resumed likewise).  A running request's pages are locked on gpu and only its own
  admission and fork copy into them.

Nothing of transformers is patched or rebuilt.  What it relies on beyond transformers' public
and documented surface is the pin list :data:`PINS` (each pin: what, why nothing public does
it, its check), run by :func:`check_pinned_internals` on entering the context and, for the
pins about a built cache, on every cache built.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import transformers
from transformers.generation.continuous_batching import ContinuousBatchingManager, PagedAttentionCache, RequestState
from transformers.generation.continuous_batching.cache_allocators import (
    SLIDING_ATTENTION,
    FullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
from transformers.generation.continuous_batching.initialization import update_cb_config_after_cache_creation
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler

import kvcm
from kvcm import AttentionLayer
from kvcm.api import KVCache, Status
from kvcm.dataplane import DataPlane
from kvcm.engine_loop import EngineLoop, config_from_layout
from kvcm.offload import OffloadManager

PINNED_TRANSFORMERS = "5.19."  # the minor version whose internals this module was written against
_TOKENS_KEY = "kvcm_tokens"  # our entry in FutureRequestState.complete_blocks: tokens the forward computed


# ---------------------------------------------------------------------------------------
# The pins: what this module relies on that transformers neither exports nor documents
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pin:
    """One internal of transformers this module relies on.  ``check(cache)`` returns what
    changed (``None``: it holds); ``cache`` is a built ``PagedAttentionCache`` for the pins
    about one (``built``), ``None`` for the others (checked on entering the context)."""

    name: str
    why: str
    check: Callable[[Any], str | None]
    built: bool = False


# transformers' factory that build_batch_processor mirrors: the sha-256 prefix of its source
_FACTORY = ContinuousBatchingManager._create_batch_processor
_FACTORY_SHA = "cc0fca82818d2471"


def _source_sha(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def _version(_: Any, version: str | None = None) -> str | None:
    version = transformers.__version__ if version is None else version
    return None if version.startswith(PINNED_TRANSFORMERS) else f"transformers {version} is not the pinned " \
                                                                f"{PINNED_TRANSFORMERS}x"


def _factory(_: Any) -> str | None:
    fn = getattr(ContinuousBatchingManager, "_create_batch_processor", None)
    if fn is None:
        return "ContinuousBatchingManager._create_batch_processor is gone"
    if tuple(inspect.signature(fn).parameters) != ("self",):
        return f"ContinuousBatchingManager._create_batch_processor takes {tuple(inspect.signature(fn).parameters)}"
    if _source_sha(fn) != _FACTORY_SHA:
        return ("ContinuousBatchingManager._create_batch_processor changed (source sha-256 "
                f"{_source_sha(fn)}, pinned {_FACTORY_SHA}): build_batch_processor mirrors it")
    return None


def _signature(cls: type, name: str, want: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(_: Any) -> str | None:
        fn = getattr(cls, name, None)
        if fn is None:
            return f"{cls.__name__}.{name} is gone"
        got = tuple(inspect.signature(fn).parameters)
        return None if got == want else f"{cls.__name__}.{name} takes {got}, pinned {want}"
    return check


def _attrs(where: Callable[[Any], list[Any]], names: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(cache: Any) -> str | None:
        missing = [f"{type(o).__name__}.{n}" for o in where(cache) for n in names if not hasattr(o, n)]
        return f"no attribute {', '.join(missing)}" if missing else None
    return check


def _allocators(cache: Any) -> list[Any]:
    return list(getattr(cache, "cache_allocators", {}).values())


def _sliding(cache: Any) -> list[Any]:
    return [a for a in _allocators(cache) if isinstance(a, SlidingAttentionCacheAllocator)]


def _block_bytes(cache: Any) -> str | None:
    missing = _attrs(lambda c: [c], ("cache_tensor", "num_sectors"))(cache) or _attrs(
        _allocators, ("bytes_per_block", "blocks_per_sector"))(cache)
    if missing:
        return missing
    for a in _allocators(cache):
        if cache.cache_tensor.numel() != (cache.num_sectors + 2) * a.blocks_per_sector * a.bytes_per_block:
            return (f"{type(a).__name__}: the cache tensor is no longer 2 trash sectors then num_sectors sectors of "
                    "blocks_per_sector blocks of bytes_per_block bytes")
    return None


def _seqlen_k(cache: Any) -> str | None:
    missing = _attrs(_sliding, ("sliding_window", "sentinel_index"))(cache)
    if missing:
        return missing
    for a in _sliding(cache):
        w = a.sliding_window
        pasts = (0, 1, w - 1, w, 5 * w)
        try:
            lengths = [a.get_seqlen_k(p, 3) for p in pasts]
        except TypeError as e:
            return f"get_seqlen_k(past_length, query_length) fails: {e}"
        if lengths != [3 + min(p, w - 1) for p in pasts]:
            return "SlidingAttentionCacheAllocator.get_seqlen_k is no longer query + min(past, window - 1)"
    return None


def _linear_places(_: Any) -> str | None:
    if not issubclass(SlidingAttentionCacheAllocator, FullAttentionCacheAllocator):
        return "SlidingAttentionCacheAllocator no longer derives from FullAttentionCacheAllocator"
    return _signature(FullAttentionCacheAllocator, "get_write_indices",
                      ("self", "request_id", "past_length", "query_length"))(None)


_INDEX_PARAMS = ("self", "request_id", "past_length", "query_length")
# The pins, each with why transformers offers nothing public for it.  tests/engines/
# test_transformers_cb.py::test_pin_holds runs each by name; the cache's public interface
# that KvcmPagedAttentionCache implements is checked beside them (interface_pins()).
PINS: tuple[Pin, ...] = (
    Pin("transformers==5.19.*",
        "the pins below are internals of one release line: no API promises them across minor versions",
        _version),
    Pin("ContinuousBatchingManager._create_batch_processor",
        "the only place a manager builds its cache, and nothing (argument, config option, hook) chooses the cache "
        "class: each manager of the hooked model gets build_batch_processor, which composes the same public parts "
        "around kvcm's cache; the source digest says when transformers' factory changes and ours must follow",
        _factory),
    Pin("FullAttentionCacheAllocator.get_read_indices",
        "full-attention groups read kvcm's pages through transformers' own index code (the cache method that calls "
        "it, extend_read_and_write_indices, is overridden for the sliding groups); allocators are not exported",
        _signature(FullAttentionCacheAllocator, "get_read_indices", _INDEX_PARAMS)),
    Pin("FullAttentionCacheAllocator.get_write_indices",
        "the linear place of token p (block p // page_size): full groups' writes, and sliding groups' linear reads "
        "and writes (transformers' sliding indices are a ring buffer whose overwritten blocks cannot be shared)",
        _linear_places),
    Pin("PagedAttentionCache.cache_tensor",
        "kvcm's gpu tier is this tensor: the data plane copies blocks by byte range, and transformers exposes no "
        "block-to-bytes map, so the layout is pinned: 2 trash sectors, then num_sectors sectors of "
        "blocks_per_sector blocks of bytes_per_block bytes per allocator",
        _block_bytes, built=True),
    Pin("PagedAttentionCache.pool.free_sectors",
        "every data sector is kvcm's: transformers' sector pool is emptied so that nothing of transformers hands "
        "one out (no argument gives a cache's sectors away)",
        _attrs(lambda c: [getattr(c, "pool", None)], ("free_sectors",)), built=True),
    Pin("CacheAllocator.block_table",
        "where a request's blocks are for transformers' index, block-table and attention code: kvcm's page "
        "indices are written there (the allocators' own allocation is bypassed by the overridden cache methods)",
        _attrs(_allocators, ("block_table",)), built=True),
    Pin("CacheAllocator.layer_indices",
        "a group's layers and page size (tokens_per_page): kvcm's life cycles and block size are made from them",
        _attrs(_allocators, ("layer_indices", "tokens_per_page")), built=True),
    Pin("SlidingAttentionCacheAllocator.get_seqlen_k",
        "the key length transformers' sliding attention expects, query + min(past, window - 1), is what the "
        "linear reads produce (the cached tokens, then a sentinel_index per new token)",
        _seqlen_k, built=True),
)


def interface_pins() -> tuple[Pin, ...]:
    """The public ``PagedAttentionCache`` methods :class:`KvcmPagedAttentionCache` overrides:
    each must still take what ours takes (derived from the class, not listed)."""
    out = []
    for name, fn in vars(KvcmPagedAttentionCache).items():
        if name.startswith("_") or not inspect.isfunction(fn):  # our own helpers and __init__
            continue
        want = tuple(inspect.signature(fn).parameters)
        out.append(Pin(f"PagedAttentionCache.{name}", "the paged cache's interface, which transformers' scheduler "
                       "and batch processor call: kvcm implements it", _signature(PagedAttentionCache, name, want)))
    for name in ("cache_allocators", "use_prefix_sharing", "dtype"):  # read by transformers' code outside the class too
        out.append(Pin(f"PagedAttentionCache.{name}", "an attribute of the paged cache's interface (the constructor's "
                       "argument, or read by the scheduler and batch processor): kvcm reads it",
                       _attrs(lambda c: [c], (name,)), built=True))
    return tuple(out)


def check_pinned_internals(version: str | None = None) -> list[str]:
    """What changed in the transformers internals this integration relies on ([] = nothing):
    the pins not about a built cache, and the cache interface.  ``version``: the transformers
    version to judge (default: the installed one)."""
    problems = [_version(None, version)]
    problems += [p.check(None) for p in PINS + interface_pins() if not p.built and p.check is not _version]
    return [p for p in problems if p]


def _check_built(cache: Any) -> None:
    """The pins about a built cache (on every cache, before anything of it is used)."""
    problems = [p.check(cache) for p in PINS + interface_pins() if p.built]
    problems = [p for p in problems if p]
    if problems:
        raise _internals_changed("; ".join(problems))


def _internals_changed(what: str) -> RuntimeError:
    return RuntimeError(f"kvcm.integrations.transformers: the pinned transformers internals changed: {what}")


# ---------------------------------------------------------------------------------------
# The hook: one model's continuous batching builds its paged cache with a factory
# ---------------------------------------------------------------------------------------


def build_batch_processor(manager: ContinuousBatchingManager, new_cache: Callable[..., Any]) -> ContinuousBatchProcessor:
    """``manager``'s batch processor around the cache ``new_cache(...)`` builds (called with
    ``PagedAttentionCache``'s arguments): transformers' ``_create_batch_processor`` step for
    step (pinned: its digest), composing transformers' public parts."""
    processor = getattr(manager, "batch_processor", None)
    if isinstance(processor, ContinuousBatchProcessor):  # a persistent manager keeps its processor (and cache)
        processor.reset()
        return processor
    model, cb = manager.model, manager.continuous_batching_config
    text_config = model.config.get_text_config()
    supports_logits_to_keep = getattr(model, "_supports_logits_to_keep", None)
    cache = new_cache(config=text_config, continuous_batching_config=cb, device=model.device,
                      distributed_helper=manager.distributed_helper, dtype=model.dtype,
                      model_supports_logits_to_keep=callable(supports_logits_to_keep) and supports_logits_to_keep())
    manager._use_prefix_sharing = cache.use_prefix_sharing  # add_requests orders prompts for prefix sharing
    update_cb_config_after_cache_creation(cb_config=cb, num_blocks=cache.num_blocks,
                                          max_batch_tokens=cache.max_batch_tokens)
    if SLIDING_ATTENTION in cache.cache_allocators:  # transformers has no decode path with a sliding window
        cb.max_blocks_per_request = 0
    scheduler_cls = SCHEDULER_MAPPING.get(cb.scheduler_type, FIFOScheduler)
    scheduler = scheduler_cls(cache=cache, safety_margin=cb.safety_margin,
                              max_requests_per_batch=cb.max_requests_per_batch)
    tp_driver = manager.is_tp_driver
    return ContinuousBatchProcessor(
        cache=cache, config=text_config, generation_config=manager.generation_config, continuous_batching_config=cb,
        logit_processor=manager.logit_processor, input_queue=manager.input_queue if tp_driver else None,
        cancel_queue=manager.cancel_queue if tp_driver else None, output_router=manager.output_router,
        background_thread_status=manager.background_thread_status, model_device=model.device,
        model_dtype=model.dtype, scheduler=scheduler, distributed_helper=manager.distributed_helper)


class ModelCacheHook:
    """Makes one model's continuous batching build its paged cache with ``factory`` (called
    with ``PagedAttentionCache``'s arguments), from :meth:`attach` to :meth:`detach`.

    It sets the model's ``init_continuous_batching`` (an instance attribute over the class's
    method: removing it restores the model) to one that gives each continuous-batching
    manager it returns its own ``_create_batch_processor``: :func:`build_batch_processor`
    with ``factory``.  No module, class or other model changes, so other models, threads and
    contexts build transformers' own cache."""

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
        """Give ``manager`` (transformers' ContinuousBatchingManager) its own processor factory."""
        own = vars(manager).get("_create_batch_processor")
        if own is not None:
            if getattr(own, "__func__", None) is not None and getattr(own.__func__, "hook", None) is self:
                return  # a persistent manager this hook took before
            raise ValueError("kvcm: this model's cached continuous-batching manager belongs to another context; "
                             "destroy it first (model.destroy_cached_continuous_batching_manager())")
        if getattr(manager, "batch_processor", None) is not None:
            raise ValueError("kvcm: this model's cached continuous-batching manager was built without kvcm; "
                             "destroy it first (model.destroy_cached_continuous_batching_manager())")
        factory = self.factory

        def create_batch_processor(mgr: Any) -> Any:
            return build_batch_processor(mgr, factory)

        create_batch_processor.hook = self  # type: ignore[attr-defined]
        manager._create_batch_processor = types.MethodType(create_batch_processor, manager)


# ---------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------


class KvcmPagedAttentionCache(PagedAttentionCache):
    """transformers' paged cache with kvcm deciding every block (see the module docstring).
    Built by :func:`build_batch_processor` for each manager of the hooked model, inside
    :class:`KvcmContinuousBatching`."""

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
        page per block ordinal; a stale block is -1 and never read), the places transformers'
        full-attention allocator computes (a sliding allocator is one, with a ring buffer on top)."""
        if length <= 0:
            return []
        table, page = allocator.block_table[request_id], allocator.tokens_per_page
        stale = [b for b in range(start // page, (start + length - 1) // page + 1) if table[b] < 0]
        if stale:  # a stale block: kvcm released it because the window no longer needs it
            raise RuntimeError(f"kvcm: request {request_id} reads tokens {start}..{start + length - 1}, in released "
                               f"sliding blocks {stale}")
        return FullAttentionCacheAllocator.get_write_indices(allocator, request_id, start, length)

    # ---------------------------------------------------------------- indices

    def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                      read_index: list[list[int]] | None, write_index: list[list[int]]) -> None:
        """transformers' own indices for full-attention groups; sliding groups are read
        linearly: the last ``min(past, window - 1)`` cached tokens then a sentinel per new
        token (the order transformers' sliding ``update`` and ``get_seqlen_k`` expect), and the
        new tokens written at their linear places."""
        for i, allocator in enumerate(self.cache_allocators.values()):
            if not isinstance(allocator, SlidingAttentionCacheAllocator):
                write_index[i].extend(allocator.get_write_indices(request_id, past_length, query_length))
                if read_index is not None:
                    read_index[i].extend(allocator.get_read_indices(request_id, past_length, query_length))
                continue
            write_index[i].extend(self._linear(allocator, request_id, past_length, query_length))
            if read_index is not None:
                cached = min(past_length, allocator.sliding_window - 1)
                read_index[i].extend(self._linear(allocator, request_id, past_length - cached, cached)
                                     + [allocator.sentinel_index] * query_length)

    # ---------------------------------------------------------------- admission

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """Match the prompt in kvcm's tree (and the shared store), lock the matched pages on
        gpu (onboarding from host / disk / the store) and return the matched length: at most
        ``len(prompt_ids) - 1`` (the last prompt token is always computed: its logits are
        the first sample).  0 with no cache when gpu slots are short: the request waits."""
        kc = self._kc
        seam = kc.seam
        kv = self._kv.get(request_id)
        if kv is not None:
            if kv.status is Status.ACTIVE:  # matched earlier, could not be stored yet
                if kv.num_committed_tokens == 0:
                    return 0
                seam.sync()
                return self._resumed(request_id, kv)
            # SUSPENDED by a preemption or a roll-back: resume it when the prompt extends what it committed
            if kv.num_committed_tokens < len(prompt_ids) and kv.committed_tokens == list(
                    prompt_ids[:kv.num_committed_tokens]):
                if not seam.touch(kv):  # onboard / cow run before anything reads the pages
                    seam.sync()
                    return 0
                kc.counters["resumed_requests"] += 1
                return self._resumed(request_id, kv)
            seam.release(kv)
            del self._kv[request_id]
        prompt = list(prompt_ids[:-1])
        # the lookup asks the store once (no side effect); the load admits with its hits and
        # runs the onboards at once (an EngineLoop): what loop.admit did, in the seam's verbs
        kv = seam.prepare_load(prompt, None, seam.lookup(prompt), id=request_id)
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
        seam, B = self._kc.seam, self._kc.B
        # the step's room, exactly past + request_len tokens (the engine allocates through kvcm)
        if seam.prepare_store(kv, past // B, -(-(past + request_len) // B), past, tokens=past + request_len,
                              exact=True) is None:
            return False
        seam.sync()
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
        self._kc.seam.complete_store(kv, tokens)
        self._kc.seam.sync()

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
        seam = self._kc.seam
        if no_cache and self._kc.has_lower_tier and kv.status is Status.ACTIVE:
            seam.suspend(kv)
            self._preempted.add(request_id)
            self._kc.counters["suspended_requests"] += 1
        else:
            seam.release(kv)
            del self._kv[request_id]
            self._preempted.discard(request_id)
        seam.sync()

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        seam = self._kc.seam
        for request_id in list(self._kv):
            self._drop_tables(request_id)
            seam.release(self._kv.pop(request_id))
        self._preempted.clear()
        self._running.clear()
        seam.sync()

    def reset(self) -> None:
        # the pool stays empty (every sector is kvcm's); reusable pages survive a reset
        self.free_all_requests()

    def evict_cached_blocks(self) -> bool:
        return False  # kvcm evicts (offloads) on demand, inside resize / resume

    # ---------------------------------------------------------------- capacity

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        """gpu slots that a resize can have (free, droppable, and held ones a colder tier can take)."""
        kc = self._kc
        room = kc.seam.room()
        fracs, nbytes = [], 0
        for name, lc in kc.lc.items():
            row = room[lc]
            avail = row.free + row.droppable + (row.held if kc.has_lower_tier else 0)
            fracs.append(avail / max(1, row.total))
            nbytes += avail * self.cache_allocators[name].bytes_per_block
        return min(fracs) if relative else nbytes

    def count_storable_requests(self, list_blocks_needed: list[dict[str, int]]) -> int:
        kc = self._kc
        room = kc.seam.room()
        avail = {name: room[lc].free + room[lc].droppable for name, lc in kc.lc.items()}
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
        seam = self._kc.seam
        src = self._kv[src_state.request_id]
        forked = []
        for dst in dst_req_ids:
            child = seam.fork(src, id=dst)
            if child is None:  # out of pages
                break
            self._kv[dst] = child
            self._sync_tables(dst)
            forked.append(dst)
            self._kc.counters["forks"] += 1
        seam.sync()
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
        self.seam: OffloadManager | None = None  # the offload seam over loop: every request-level call goes through it
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
        _check_built(cache)
        allocators = list(cache.cache_allocators.items())
        kinds = {type(a) for _, a in allocators} - {FullAttentionCacheAllocator, SlidingAttentionCacheAllocator}
        if kinds:  # a new attention kind: its blocks are not laid out as this module knows
            raise _internals_changed(f"unknown cache allocators {sorted(k.__name__ for k in kinds)}")
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
            blocks = cache.cache_tensor.view(-1, a.bytes_per_block)  # one row per block of this group (pinned)
            self.plane.adopt_memory("gpu", self.lc[name], blocks[base:base + n])
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
        self.plane = DataPlane(config, device=cache.cache_tensor.device)
        self.loop = EngineLoop(self.mgr, self.plane, on_rollback=self._rolled_back)
        self.seam = OffloadManager(self.loop)
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
        if self.seam is not None and self.mgr is not None:
            out["kvcm"] = self.seam.stats()
        return out


__all__ = ["PINNED_TRANSFORMERS", "PINS", "KvcmContinuousBatching", "KvcmPagedAttentionCache", "ModelCacheHook", "Pin",
           "build_batch_processor", "check_pinned_internals", "interface_pins"]
