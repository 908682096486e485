"""What the connector is told: ``kv_connector_extra_config`` and vLLM's KV cache layout.

Both sides of the connector (the scheduler's and each worker's) build the same kvcm config
from the same two inputs, so the manager's slot numbers mean the same pages on both sides.

``kv_connector_extra_config`` keys (all optional unless said):

=====================  ===========================================================================
``backend``            ``"cpp"`` or ``"python"``: the manager's backend (default: ``KVCM_BACKEND``)
``host_bytes``         kvcm's top tier, in host memory: what vLLM saves into and loads from
                       (default 1 GiB).  kvcm calls it its ``gpu`` tier (tier 0): it is the tier
                       requests lock pages in; DECISIONS.md "vLLM connector"
``disk_path``          a directory for kvcm's disk tier (tier 2); with ``disk_bytes`` > 0
``disk_bytes``         the disk tier's size (reserved when the worker starts)
``shared``             the shared tier's location: a directory, ``file:///dir?timeout_s=S`` or
                       ``mooncake://host:port?metadata=url`` (kvcm.dataplane.open_store)
``shared_bytes``       the shared tier's quota (file store: the directory cap; Mooncake: segment)
``shared_namespace``   required with ``shared``: names the model and its weights (DECISIONS "The
                       shared tier"); the connector appends vLLM's KV layout to it
``shared_write``       ``"commit"`` (default) or ``"evict"``
``shared_timeout_s``   the deadline of one store call (default: the location's, 10 s)
``shared_store_class`` ``"module:Class"``: a :class:`kvcm.dataplane.store.SharedStore` made as
                       ``Class(location, quota_bytes)`` instead of the one ``shared`` names
``events_endpoint``    a ZeroMQ endpoint: kvcm's events (host, disk, shared tiers) are published
                       there by :class:`kvcm.fleet.publisher.EventPublisher` (``kvcm[events]``)
``events_replay_endpoint``  its replay endpoint (optional)
``stats_file``         a JSON file the scheduler side rewrites with its counters when a request
                       finishes (tests, the benchmark)
``load_mode``          ``"auto"`` (default), ``"sync"`` or ``"async"``: how blocks reach vLLM's cache.
                       ``auto``: blocks already in kvcm's host tier load synchronously (before
                       the step's forward: a memory copy), blocks that must first come from disk or
                       the shared store load asynchronously (the request waits in vLLM's
                       WAITING_FOR_REMOTE_KVS, off the forward's critical path); DECISIONS.md
                       "vLLM connector" has the measurement
``max_inflight_bytes`` the bound on bytes the connector has queued and not yet done (saves, loads,
                       kvcm's own copies); saves past it wait for a later step (default
                       ``min(256 MiB, host_bytes // 2)``)
``copy_fault_hook``    ``"module:function"`` called by each worker with every kvcm copy op just before
                       it runs (an exception fails the op as an I/O error would): tests inject
                       faults at an exact point of a load with it
=====================  ===========================================================================
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from kvcm.api import AttentionLayer, KVCacheManagerConfig, Tier

KEYS = ("backend", "host_bytes", "disk_path", "disk_bytes", "shared", "shared_bytes", "shared_namespace",
        "shared_write", "shared_timeout_s", "shared_store_class", "events_endpoint", "events_replay_endpoint",
        "stats_file", "load_mode", "max_inflight_bytes", "copy_fault_hook")
LOAD_MODES = ("auto", "sync", "async")
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
DEFAULT_HOST_BYTES = 1 << 30


@dataclass(frozen=True)
class KvLayout:
    """vLLM's paged KV cache as kvcm sees it: one kvcm attention layer per vLLM layer, in the
    order of vLLM's KV cache groups and each group's ``layer_names``; a kvcm page of a block is
    the bytes of that block in every layer of one kvcm life cycle, one after another (each
    layer's block as vLLM's attention backend lays it out: kvcm never looks inside).

    With vLLM's hybrid KV cache manager (the connector declares ``SupportsHMA``) a model has
    one KV cache group per layer kind and group slot: full attention and sliding window
    groups.  Each group maps onto the kvcm life cycle of its kind (``window``: the group's
    sliding window, no sinks: vLLM 0.32's ``SlidingWindowSpec`` has none).  Several vLLM
    groups of one kind (Gemma-3: three sliding groups) are one kvcm life cycle whose page
    holds one block of each of them; vLLM gives each group its own block ids."""

    block_size: int
    layer_names: tuple[str, ...]
    block_bytes: tuple[int, ...]  # bytes of one block of each layer
    describe: str  # what must match between instances sharing a store, beside the sizes
    groups: tuple[int, ...] = ()  # the vLLM KV cache group of each layer (() : all group 0)
    windows: tuple[int | None, ...] = ()  # the sliding window of each layer (() : none)

    @property
    def num_groups(self) -> int:
        return max(self.groups, default=0) + 1

    def window_of_group(self, g: int) -> int | None:
        for lg, w in zip(self.groups, self.windows, strict=False):
            if lg == g:
                return w
        return None

    @property
    def lc_groups(self) -> tuple[tuple[int, ...], ...]:
        """The vLLM groups of each kvcm life cycle (kvcm numbers life cycles in the order
        their kind first appears among the layers; one kind per window)."""
        if not self.groups:
            return ((0,),)
        order: list[int | None] = []
        out: dict[int | None, list[int]] = {}
        for g, w in zip(self.groups, self.windows or (None,) * len(self.groups), strict=True):
            if w not in out:
                order.append(w)
                out[w] = []
            if g not in out[w]:
                out[w].append(g)
        return tuple(tuple(out[w]) for w in order)

    @property
    def hybrid(self) -> bool:
        """Several vLLM groups, or sliding-window ones: loads are asynchronous and a failed
        one is reported by request (``failed_recving``), the one path vLLM 0.32 accepts for
        such models (a block-level report kills a multi-group engine, and truncates a
        sliding-window request to a window of null blocks)."""
        return self.num_groups > 1 or any(w is not None for w in self.windows)

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any, device_type: str) -> KvLayout:
        groups = kv_cache_config.kv_cache_groups
        names: list[str] = []
        nbytes: list[int] = []
        gids: list[int] = []
        windows: list[int | None] = []
        descs: list[str] = []
        B = None
        for gi, g in enumerate(groups):
            spec = g.kv_cache_spec
            kind = type(spec).__name__
            if kind == "FullAttentionSpec":
                # a promoted sliding layer (hybrid manager off) keeps its window as an attribute:
                # it still holds every block, so kvcm treats it as full attention
                window = None
            elif kind == "SlidingWindowSpec":
                window = int(spec.sliding_window)
            else:
                raise ValueError(
                    f"KvcmConnector supports full-attention and sliding-window KV cache groups, not {kind} "
                    f"(group {gi}: {len(g.layer_names)} layers).  vLLM 0.32's CPU build runs Mamba hybrids only "
                    "without prefix caching, where a request's state block is overwritten in place every step "
                    "(DECISIONS.md 'vLLM connector: the hybrid KV cache manager')")
            if B is None:
                B = int(spec.block_size)
            elif int(spec.block_size) != B:
                raise ValueError(f"KvcmConnector: KV cache groups of different block sizes ({B} and "
                                 f"{spec.block_size}) are not supported")
            page = int(spec.page_size_bytes)
            for n in g.layer_names:
                names.append(n)
                nbytes.append(page)
                gids.append(gi)
                windows.append(window)
            descs.append(f"{kind}:{spec.num_kv_heads}x{spec.head_size}:{str(spec.dtype).removeprefix('torch.')}"
                         + (f":W{window}" if window is not None else "") + f":L{len(g.layer_names)}")
        if B is None:
            raise ValueError("KvcmConnector: the model has no KV cache group")
        if len(groups) == 1 and windows[0] is None:  # one full-attention group: the layout of before
            d = descs[0].rsplit(":L", 1)[0]
            return cls(B, tuple(names), tuple(nbytes), f"vllm:{device_type}:{d}:B{B}")
        return cls(B, tuple(names), tuple(nbytes), f"vllm:{device_type}:{'+'.join(descs)}:B{B}",
                   tuple(gids), tuple(windows))


@dataclass(frozen=True)
class ConnectorSettings:
    backend: str | None
    host_bytes: int
    disk_path: str | None
    disk_bytes: int
    shared: str | None
    shared_bytes: int
    shared_namespace: str
    shared_write: str
    shared_timeout_s: float | None
    shared_store_class: str | None
    events_endpoint: str | None
    events_replay_endpoint: str | None
    stats_file: str | None
    load_mode: str = "auto"
    max_inflight_bytes: int = 0  # parse() resolves the default
    copy_fault_hook: str | None = None

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; known: {', '.join(KEYS)}")

        def size(name: str, default: int) -> int:
            v = extra.get(name, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be an int >= 0 (bytes), got {v!r}")
            return v

        def text(name: str) -> str | None:
            v = extra.get(name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be a non-empty string, got {v!r}")
            return v

        backend = text("backend")
        if backend is not None and backend not in ("cpp", "python"):
            raise ValueError(f"kv_connector_extra_config['backend'] must be 'cpp' or 'python', got {backend!r}")
        host = size("host_bytes", DEFAULT_HOST_BYTES)
        if host == 0:
            raise ValueError("kv_connector_extra_config['host_bytes'] must be > 0: it is the tier vLLM saves into")
        disk_path, disk_bytes = text("disk_path"), size("disk_bytes", 0)
        if (disk_path is None) != (disk_bytes == 0):
            raise ValueError("kv_connector_extra_config: 'disk_path' and 'disk_bytes' > 0 go together")
        shared = text("shared")
        namespace = extra.get("shared_namespace", "")
        if not isinstance(namespace, str):
            raise TypeError(f"kv_connector_extra_config['shared_namespace'] must be a string, got {namespace!r}")
        if shared is not None and not namespace:
            raise ValueError("kv_connector_extra_config: 'shared' needs 'shared_namespace' (the model and its "
                             "weights: two fine-tunes of one shape must not read each other's KV)")
        write = extra.get("shared_write", "commit")
        if write not in ("commit", "evict"):
            raise ValueError(f"kv_connector_extra_config['shared_write'] must be 'commit' or 'evict', got {write!r}")
        timeout = extra.get("shared_timeout_s")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"kv_connector_extra_config['shared_timeout_s'] must be seconds >= 0, got {timeout!r}")
        store_class = text("shared_store_class")
        if store_class is not None and ":" not in store_class:
            raise ValueError(f"kv_connector_extra_config['shared_store_class'] must be 'module:Class', got {store_class!r}")
        load_mode = extra.get("load_mode", "auto")
        if load_mode not in LOAD_MODES:
            raise ValueError(f"kv_connector_extra_config['load_mode'] must be one of {LOAD_MODES}, got {load_mode!r}")
        inflight = size("max_inflight_bytes", min(DEFAULT_MAX_INFLIGHT_BYTES, host // 2))
        if inflight == 0:
            raise ValueError("kv_connector_extra_config['max_inflight_bytes'] must be > 0")
        hook = text("copy_fault_hook")
        if hook is not None and ":" not in hook:
            raise ValueError(f"kv_connector_extra_config['copy_fault_hook'] must be 'module:function', got {hook!r}")
        return cls(backend, host, disk_path, disk_bytes, shared, size("shared_bytes", 0), namespace, write,
                   None if timeout is None else float(timeout), store_class, text("events_endpoint"),
                   text("events_replay_endpoint"), text("stats_file"), load_mode, inflight, hook)

    def manager_config(self, layout: KvLayout, rank: int = 0, world: int = 1) -> KVCacheManagerConfig:
        """kvcm's config: tier 0 (kvcm's ``gpu``) is host memory, then disk, then shared."""
        B = layout.block_size
        windows = layout.windows or (None,) * len(layout.block_bytes)
        layers = [AttentionLayer(i, bytes_per_token=nbytes // B, window=w)
                  for i, (nbytes, w) in enumerate(zip(layout.block_bytes, windows, strict=True))]
        tiers = [Tier("gpu", self.host_bytes)]
        if self.disk_path is not None:
            # one directory per rank: a disk directory is never shared (its files are flock'ed per host)
            path = self.disk_path if world == 1 else os.path.join(self.disk_path, f"rank{rank}")
            tiers.append(Tier("disk", self.disk_bytes, path))
        namespace = ""
        if self.shared is not None:
            tiers.append(Tier("shared", self.shared_bytes, self.shared))
            # the bytes of a page are vLLM's layout of one rank's shard: instances share objects
            # only when all of it matches.  The manager's namespace is the same on the scheduler
            # and on every worker; each worker names its own objects with its rank
            # (kvcm.integrations.vllm.worker.shard_config), and a block is a shared hit only when
            # every rank's object is there
            namespace = f"{self.shared_namespace}|{layout.describe}|tp{world}"
        # several life cycles (a hybrid model): each gets the same share of every tier's bytes
        # (equal slot counts would give a full-attention life cycle, which keeps a page of every
        # block, as few slots as a window life cycle, which keeps a page of a few blocks per request)
        n_lc = len(layout.lc_groups)
        ratio = {"pool_ratio": dict.fromkeys(range(n_lc), 1.0)} if n_lc > 1 else {}
        return KVCacheManagerConfig(tokens_per_block=B, layers=layers, tiers=tiers, **ratio,
                                    enable_partial_reuse=False,  # vLLM loads whole blocks only
                                    shared_write=self.shared_write, shared_namespace=namespace)

    def fault_hook(self) -> Any:
        """The callable ``copy_fault_hook`` names (None without one)."""
        if self.copy_fault_hook is None:
            return None
        module, _, name = self.copy_fault_hook.partition(":")
        return getattr(importlib.import_module(module), name)

    def make_store(self) -> Any:
        """The shared store ``shared_store_class`` names (None: the data plane opens ``shared``)."""
        if self.shared_store_class is None or self.shared is None:
            return None
        module, _, name = self.shared_store_class.partition(":")
        cls = getattr(importlib.import_module(module), name)
        return cls(self.shared, self.shared_bytes)
