"""What the connector is told: ``kv_connector_extra_config`` and vLLM's KV cache layout.

Both sides of the connector (the scheduler's and each worker's) build the same kvcm config
from the same two inputs, so the manager's slot numbers mean the same pages on both sides.

``kv_connector_extra_config`` keys (all optional unless said):

=====================  ===========================================================================
``config_file``        a YAML or JSON file holding these keys (default: the ``KVCM_CONFIG``
                       environment variable); keys given inline override the file's
``backend``            ``"cpp"`` or ``"python"``: the manager's backend (default: ``KVCM_BACKEND``)
``host_bytes``         kvcm's top tier, in host memory: what vLLM saves into and loads from
                       (default 1 GiB).  "host" wherever the user reads it (start line, stats,
                       metrics, events' medium ``CPU``); the manager's config calls it its ``gpu``
                       tier (tier 0, the tier requests lock pages in); DECISIONS.md "vLLM connector"
``disk_path``          a directory for kvcm's disk tier (tier 2); with ``disk_bytes`` > 0
``disk_bytes``         the disk tier's size (reserved when the worker starts)
``shared``             the shared tier's location: a directory, ``file:///dir?timeout_s=S`` or
                       ``mooncake://host:port?metadata=url`` (kvcm.dataplane.open_store)
``shared_bytes``       the shared tier's size: a directory store's byte cap (default 64 GiB; past
                       it the least recently used objects go; ``"unbounded"``: no cap, said
                       explicitly); Mooncake Store: the segment this instance mounts into the
                       store (default 0: none; the store is bounded by its segments)
``shared_namespace``   a name for the model's KV in the store (optional): the connector adds
                       the model's identity (``model_identity``) and vLLM's KV layout to it
``model_identity``     ``"sampled"`` (default) or ``"full"``: how the model's weights are
                       fingerprinted (kvcm.integrations.vllm.identity), so two models of one
                       shape never share an object; ``"off"``: the objects are named by
                       ``shared_namespace`` (required then) and the layout only
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
``save_decode_cache``  ``kv_role`` ``kv_consumer`` only: also write the decode's blocks to the shared
                       tier (default false: a consumer loads and writes nothing there; vLLM's option
                       of the same name); kvcm.integrations.vllm.handover
``handover_wait_s``    a consumer's deadline for the objects a producer's hand-over announced and
                       has not written yet (default 10 s); past it the rest is computed
``partial_tail``       ``true``: serve hits that end inside a block (kvcm's partial reuse) and save a
                       finished request's trailing partial block (default ``false``; one KV cache
                       group set without a hybrid life cycle, no shared tier: otherwise ignored);
                       kvcm.integrations.vllm.partial, DECISIONS.md "Below the whole-block floor"
=====================  ===========================================================================

Sizes (``*_bytes``) are bytes as an int or a string with a unit: ``"8GiB"``, ``"500MB"``,
``"1.5 TiB"``, ``"8G"`` (:func:`parse_size`; KiB/MiB/GiB/TiB are powers of 1024, kB/MB/GB/TB
of 1000; one letter as vLLM reads its own flags: ``G`` 1024³, ``g`` 1000³).

A test hook, accepted and not offered (:data:`TEST_KEYS`): ``copy_fault_hook``,
``"module:function"`` called by each worker with every kvcm copy op just before it runs (an
exception fails the op as an I/O error would): tests inject faults at an exact point of a load.

Every error names the key as written here (``kv_connector_extra_config['host_bytes'] ...``),
in one line: :meth:`ConnectorSettings.parse` (types, ranges, combinations),
:meth:`ConnectorSettings.check_environment` (paths, free space, the store's location, the
backend: nothing is created) and :meth:`ConnectorSettings.check_capacity` (the sizes against
vLLM's block) -- what ``python -m kvcm vllm check-config`` and the connector run.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

from kvcm.api import AttentionLayer, KVCacheManagerConfig, Tier

# the user's keys (every one in README.md "Use it inside vLLM"; tests/engines/test_vllm_settings.py checks)
KEYS = ("config_file", "backend", "host_bytes", "disk_path", "disk_bytes", "shared", "shared_bytes",
        "shared_namespace", "model_identity", "shared_write", "shared_timeout_s", "shared_store_class",
        "events_endpoint", "events_replay_endpoint", "stats_file", "load_mode", "max_inflight_bytes",
        "save_decode_cache", "handover_wait_s", "partial_tail")
# test hooks: accepted, never offered (not in "known:", not a did-you-mean, not in the README)
TEST_KEYS = ("copy_fault_hook",)
CONFIG_ENV = "KVCM_CONFIG"  # a config file (YAML or JSON) with the keys of kv_connector_extra_config
LOAD_MODES = ("auto", "sync", "async")
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
DEFAULT_HOST_BYTES = 1 << 30
DEFAULT_HANDOVER_WAIT_S = 10.0
DEFAULT_SHARED_BYTES = 64 << 30  # a directory store's cap when none is named (DECISIONS "bounded by default")
UNBOUNDED = "unbounded"
IDENTITY_MODES = ("sampled", "full", "off")
MAX_NAMESPACE_BYTES = 128  # the user's part: kvcm's limit is 256 with the identity and layout appended
PREFIX = "kv_connector_extra_config"


def key_error(key: str, why: str) -> ValueError:
    """A one-line error naming the key."""
    return ValueError(f"{PREFIX}[{key!r}] {why}")


@dataclass(frozen=True)
class SpecClasses:
    """vLLM's KV cache spec classes kvcm maps onto its life cycles, matched with ``isinstance``
    (never by name): ``full`` (``FullAttentionSpec``: every block kept) and ``sliding``
    (``SlidingWindowSpec``: the window's blocks).  A subclass of either adds what kvcm does not
    know (MLA's latent page, attention sinks, a rolling window) and is refused like any other
    kind.  The connector passes vLLM's (:meth:`of_vllm`); the engine-free tests pass stand-ins."""

    full: type
    sliding: type

    @classmethod
    def of_vllm(cls) -> SpecClasses:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        return cls(FullAttentionSpec, SlidingWindowSpec)

    def kind_of(self, spec: Any) -> str | None:
        """``"full"``, ``"sliding"``, or None: a kind kvcm does not map."""
        for kind, klass in (("full", self.full), ("sliding", self.sliding)):
            if isinstance(spec, klass):
                return kind if type(spec) is klass else None  # a subclass: a kind of its own
        return None


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

    @property
    def page_bytes(self) -> int:
        """Bytes of one kvcm page: one block of every layer."""
        return sum(self.block_bytes)

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any, device_type: str, spec_classes: SpecClasses) -> KvLayout:
        """The layout of vLLM's ``kv_cache_config`` (its groups' ``kv_cache_spec``, kinds
        matched against ``spec_classes``; ``device_type``: where vLLM's cache lives)."""
        groups = kv_cache_config.kv_cache_groups
        names: list[str] = []
        nbytes: list[int] = []
        gids: list[int] = []
        windows: list[int | None] = []
        descs: list[str] = []
        B = None
        for gi, g in enumerate(groups):
            spec = g.kv_cache_spec
            kind = type(spec).__name__  # (the class's name, in the store's namespace: never matched on)
            matched = spec_classes.kind_of(spec)
            if matched == "full":
                # a promoted sliding layer (hybrid manager off) keeps its window as an attribute:
                # it still holds every block, so kvcm treats it as full attention
                window = None
            elif matched == "sliding":
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
    shared_bytes: int  # the shared Tier's quota_bytes: 0 = no cap (file store: only when said "unbounded")
    shared_namespace: str
    model_identity: str
    shared_write: str
    shared_timeout_s: float | None
    shared_store_class: str | None
    events_endpoint: str | None
    events_replay_endpoint: str | None
    stats_file: str | None
    load_mode: str = "auto"
    max_inflight_bytes: int = 0  # parse() resolves the default
    copy_fault_hook: str | None = None
    config_file: str | None = None  # the file the keys came from (``config_file`` or KVCM_CONFIG)
    save_decode_cache: bool = False
    handover_wait_s: float = DEFAULT_HANDOVER_WAIT_S
    partial_tail: bool = False  # kvcm.integrations.vllm.partial

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """The settings ``extra`` (vLLM's ``kv_connector_extra_config``) gives; ValueError
        naming the key for anything wrong with it (module docstring)."""
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"{PREFIX} must be a JSON object, got {type(extra).__name__}")
        inline = dict(extra or {})
        _check_names(inline, PREFIX)
        source = inline.get("config_file")
        if source is not None and (not isinstance(source, str) or not source):
            raise key_error("config_file", f"must be a path (a non-empty string), got {source!r}")
        if source is None:
            source = os.environ.get(CONFIG_ENV) or None
        if source is None:
            return cls._parse(inline)
        from_file = load_config_file(source, "config_file" if "config_file" in inline else CONFIG_ENV)
        merged = {**from_file, **{k: v for k, v in inline.items() if k != "config_file"}}
        try:
            settings = cls._parse(merged)
        except ValueError as e:
            named = [k for k in from_file if k not in inline and f"[{k!r}]" in str(e)]
            if named:
                raise ValueError(f"{e} (from {source})") from None
            raise
        return dataclasses.replace(settings, config_file=os.path.abspath(source))

    @classmethod
    def _parse(cls, extra: dict[str, Any]) -> ConnectorSettings:

        def size(name: str, default: int) -> int:
            return _size_value(name, extra.get(name, default))

        def text(name: str) -> str | None:
            v = extra.get(name)
            if v is not None and (not isinstance(v, str) or not v):
                raise key_error(name, f"must be a non-empty string, got {v!r}")
            return v

        backend = text("backend")
        if backend is not None and backend not in ("cpp", "python"):
            raise key_error("backend", f"must be 'cpp' or 'python', got {backend!r}")
        host = size("host_bytes", DEFAULT_HOST_BYTES)
        if host == 0:
            raise key_error("host_bytes", "must be > 0: it is the tier vLLM saves into and loads from")
        disk_path, disk_bytes = text("disk_path"), size("disk_bytes", 0)
        if disk_path is not None and disk_bytes == 0:
            raise key_error("disk_bytes", f"must be > 0 with disk_path {disk_path!r} (the disk tier's size)")
        if disk_path is None and disk_bytes:
            raise key_error("disk_path", f"is needed with disk_bytes {disk_bytes} (a directory for the disk tier)")
        shared = text("shared")
        namespace = extra.get("shared_namespace", "")
        if not isinstance(namespace, str):
            raise key_error("shared_namespace", f"must be a string, got {namespace!r}")
        if len(namespace.encode()) > MAX_NAMESPACE_BYTES or "\0" in namespace:
            raise key_error("shared_namespace", f"must be at most {MAX_NAMESPACE_BYTES} bytes (UTF-8), without NUL")
        identity = extra.get("model_identity", "sampled")
        if identity not in IDENTITY_MODES:
            raise key_error("model_identity", f"must be one of {', '.join(map(repr, IDENTITY_MODES))}, got {identity!r}")
        if shared is not None and identity == "off" and not namespace:
            raise key_error("shared_namespace", "is required with model_identity 'off': it alone then names the "
                            "model's KV in the store (two fine-tunes of one shape must not read each other's)")
        mooncake = shared is not None and shared.startswith("mooncake://")
        shared_bytes = extra.get("shared_bytes", 0 if mooncake else DEFAULT_SHARED_BYTES)
        if shared_bytes == UNBOUNDED:
            if mooncake:
                raise key_error("shared_bytes", "'unbounded' applies to a directory store; Mooncake Store is bounded "
                                "by its segments (shared_bytes is the segment this instance mounts, default 0)")
            shared_bytes = 0
        else:
            shared_bytes = _size_value("shared_bytes", shared_bytes, " or 'unbounded'")
            if shared_bytes == 0 and not mooncake and "shared_bytes" in extra:
                raise key_error("shared_bytes", "0 would leave the store without a cap: give a size (\"64GiB\"), or "
                                "'unbounded' to mean no cap")
        write = extra.get("shared_write", "commit")
        if write not in ("commit", "evict"):
            raise key_error("shared_write", f"must be 'commit' or 'evict', got {write!r}")
        timeout = extra.get("shared_timeout_s")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout < float("inf")):
            raise key_error("shared_timeout_s", f"must be seconds >= 0, got {timeout!r}")
        store_class = text("shared_store_class")
        if store_class is not None and ":" not in store_class:
            raise key_error("shared_store_class", f"must be 'module:Class', got {store_class!r}")
        load_mode = extra.get("load_mode", "auto")
        if load_mode not in LOAD_MODES:
            raise key_error("load_mode", f"must be one of {', '.join(map(repr, LOAD_MODES))}, got {load_mode!r}")
        inflight = size("max_inflight_bytes", min(DEFAULT_MAX_INFLIGHT_BYTES, host // 2))
        if inflight == 0:
            raise key_error("max_inflight_bytes", "must be > 0")
        hook = text("copy_fault_hook")
        if hook is not None and ":" not in hook:
            raise key_error("copy_fault_hook", f"must be 'module:function', got {hook!r}")
        save_decode = extra.get("save_decode_cache", False)
        if not isinstance(save_decode, bool):
            raise key_error("save_decode_cache", f"must be true or false, got {save_decode!r}")
        wait = extra.get("handover_wait_s", DEFAULT_HANDOVER_WAIT_S)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 3600:
            raise key_error("handover_wait_s", f"must be seconds in [0, 3600], got {wait!r}")
        partial_tail = extra.get("partial_tail", False)
        if not isinstance(partial_tail, bool):
            raise key_error("partial_tail", f"must be true or false, got {partial_tail!r}")
        return cls(backend, host, disk_path, disk_bytes, shared, shared_bytes, namespace, identity, write,
                   None if timeout is None else float(timeout), store_class, text("events_endpoint"),
                   text("events_replay_endpoint"), text("stats_file"), load_mode, inflight, hook,
                   save_decode_cache=save_decode, handover_wait_s=float(wait),
                   partial_tail=partial_tail)

    def resolved_backend(self) -> str:
        """The backend the manager will run: ``backend``, else ``KVCM_BACKEND``, else ``cpp``
        (ValueError naming ``KVCM_BACKEND`` when it names no backend)."""
        if self.backend is not None:
            return self.backend
        from kvcm._select import BackendUnavailableError, default_backend

        try:
            return default_backend()
        except BackendUnavailableError as e:
            raise key_error("backend", f"is not given and {e}") from None

    @property
    def store_kind(self) -> str | None:
        """``"mooncake"``, ``"file"``, ``"custom"`` (``shared_store_class``) or None (no shared tier)."""
        if self.shared is None:
            return None
        if self.shared_store_class is not None:
            return "custom"
        return "mooncake" if self.shared.startswith("mooncake://") else "file"

    def check_environment(self, world: int = 1) -> list[str]:
        """What the settings need from this host, checked without creating or changing
        anything: the backend importable, ``disk_path`` / ``stats_file`` / a directory store
        creatable and writable, ``shared`` a valid location, ``shared_store_class``
        importable.  ValueError naming the key; returns warnings (free space below what is
        reserved or capped: the file system fills first)."""
        warnings: list[str] = []
        if self.resolved_backend() == "cpp":
            from kvcm._select import cpp_extension

            try:
                cpp_extension()
            except ImportError as e:
                key = "backend" if self.backend else "backend (KVCM_BACKEND)"
                raise key_error(key, f"'cpp': the compiled extension does not import ({e}); build it, or use 'python'") from None
        if self.disk_path is not None:
            free = _writable_dir("disk_path", self.disk_path)
            need = self.disk_bytes * world
            if free is not None and free < need:
                warnings.append(f"{PREFIX}['disk_bytes'] {_size(need)}{f' ({world} ranks)' if world > 1 else ''} is "
                                f"more than the free space at {self.disk_path!r} ({_size(free)}): the disk tier is "
                                "reserved when the engine starts and would fail")
        if self.shared is not None and self.shared_store_class is None:
            warnings += self._check_store()
        if self.shared_store_class is not None:
            module, _, name = self.shared_store_class.partition(":")
            try:
                ok = hasattr(importlib.import_module(module), name)
            except ImportError as e:
                raise key_error("shared_store_class", f"{self.shared_store_class!r}: cannot import {module!r} ({e})") from None
            if not ok:
                raise key_error("shared_store_class", f"{self.shared_store_class!r}: {module!r} has no {name!r}")
        if self.stats_file is not None:
            _writable_dir("stats_file", os.path.dirname(os.path.abspath(self.stats_file)))
        for key in ("events_endpoint", "events_replay_endpoint"):
            v = getattr(self, key)
            if v is not None and "://" not in v:
                raise key_error(key, f"must be a ZeroMQ endpoint (tcp://127.0.0.1:5557, ipc:///path), got {v!r}")
        return warnings

    def _check_store(self) -> list[str]:
        assert self.shared is not None
        if self.store_kind == "mooncake":
            from kvcm.dataplane.mooncake_store import parse_url

            try:
                parse_url(self.shared)
            except ValueError as e:
                raise key_error("shared", str(e)) from None
            return []
        location = self.shared
        if location.startswith("file://"):
            location, _, query = location[len("file://"):].partition("?")
            from urllib.parse import parse_qs

            from kvcm.dataplane.store import parse_timeout

            params = parse_qs(query, keep_blank_values=True)
            if set(params) - {"timeout_s"}:
                raise key_error("shared", f"{self.shared!r}: unknown parameters {sorted(set(params) - {'timeout_s'})}")
            try:
                if "timeout_s" in params:
                    parse_timeout(params["timeout_s"][-1], self.shared)
            except ValueError as e:
                raise key_error("shared", str(e)) from None
        elif "://" in location:
            raise key_error("shared", f"{location!r}: use a directory, file:///dir or mooncake://host:port?metadata=url")
        free = _writable_dir("shared", location)
        if free is not None and self.shared_bytes and free < self.shared_bytes:
            return [(f"{PREFIX}['shared_bytes'] {_size(self.shared_bytes)} is more than the free space at {location!r} "
                    f"({_size(free)}): the file system fills before the store reaches its cap")]
        return []

    def check_capacity(self, layout: KvLayout, max_model_len: int, vllm_blocks: int,
                       world: int = 1) -> list[str]:
        """The sizes against vLLM's KV layout: ValueError naming the key when a tier cannot
        hold one block (kvcm could do nothing); the warnings (each one line, with the numbers)
        when ``host_bytes`` cannot hold one request of ``max_model_len`` tokens or vLLM's
        whole KV cache (``vllm_blocks``): the running requests' blocks are held there."""
        B, page = layout.block_size, layout.page_bytes
        host = self.host_bytes // page
        what = f"one block of vLLM's KV cache is {page:,} bytes ({B} tokens x {len(layout.layer_names)} layers)"
        if host < 1:
            raise key_error("host_bytes", f"= {self.host_bytes:,} holds no block: {what}; give at least "
                            f"{page * max(1, max_model_len // B):,} (one request of max_model_len {max_model_len})")
        if self.disk_path is not None and self.disk_bytes // page < 1:
            raise key_error("disk_bytes", f"= {self.disk_bytes:,} holds no block: {what}")
        if self.store_kind in ("file", "custom") and self.shared_bytes and self.shared_bytes < page:
            raise key_error("shared_bytes", f"= {self.shared_bytes:,} holds no object: {what}")
        warnings = []
        need = max_model_len // B  # a request's full blocks, the last token excluded
        if host < need:
            warnings.append(
                f"{PREFIX}['host_bytes'] = {self.host_bytes:,} holds {host} blocks of {page:,} bytes; one request of "
                f"max_model_len {max_model_len} tokens needs {need} ({need * page:,} bytes): kvcm stops saving a "
                f"request at {host * B} tokens and cannot load more than that")
        elif host < vllm_blocks:
            warnings.append(
                f"{PREFIX}['host_bytes'] = {self.host_bytes:,} holds {host} blocks; vLLM's KV cache has {vllm_blocks}: "
                f"when the running requests hold more than {host} blocks, kvcm stops mirroring some of them (give "
                f"host_bytes >= {vllm_blocks * page:,})")
        return warnings

    def namespace(self, layout: KvLayout, identity_tag: str | None, world: int = 1) -> str:
        """The manager's ``shared_namespace``: the user's name, the model's identity (its
        tag; None with ``model_identity`` off), vLLM's layout and tensor-parallel size (each
        rank adds its own number to name its shard's objects)."""
        parts = [self.shared_namespace]
        if self.model_identity != "off":
            if identity_tag is None:
                raise ValueError("the model's identity is needed for the shared tier (model_identity "
                                 f"{self.model_identity!r})")
            parts.append(identity_tag)
        return "|".join([*parts, layout.describe, f"tp{world}"])

    def manager_config(self, layout: KvLayout, rank: int = 0, world: int = 1,
                       identity_tag: str | None = None) -> KVCacheManagerConfig:
        """kvcm's config: tier 0 (kvcm's ``gpu``) is host memory, then disk, then shared."""
        B = layout.block_size
        windows = layout.windows or (None,) * len(layout.block_bytes)
        layers = [AttentionLayer(i, bytes_per_token=nbytes // B, window=w)
                  for i, (nbytes, w) in enumerate(zip(layout.block_bytes, windows, strict=True))]
        # role "host", kind "gpu": the core's tier 0 must be of kind gpu (the one tier requests
        # lock pages in, SPEC sec. 2); what the user reads names it by role (scheduler.TIER_ROLES)
        tiers = [Tier("gpu", self.host_bytes)]
        if self.disk_path is not None:
            # one directory per rank: a disk directory is never shared (its files are flock'ed per host)
            path = self.disk_path if world == 1 else os.path.join(self.disk_path, f"rank{rank}")
            tiers.append(Tier("disk", self.disk_bytes, path))
        namespace = ""
        if self.shared is not None:
            tiers.append(Tier("shared", self.shared_bytes, self.shared))
            # the bytes of a page are this model's KV in vLLM's layout of one rank's shard:
            # instances share objects only when all of it matches.  The manager's namespace is
            # the same on the scheduler and on every worker (the identity is computed from the
            # same files by each); each worker names its own objects with its rank
            # (shard_config, below), and a block is a shared hit only
            # when every rank's object is there
            namespace = self.namespace(layout, identity_tag, world)
        # several life cycles (a hybrid model): each gets the same share of every tier's bytes
        # (equal slot counts would give a full-attention life cycle, which keeps a page of every
        # block, as few slots as a window life cycle, which keeps a page of a few blocks per request)
        n_lc = len(layout.lc_groups)
        ratio = {"pool_ratio": dict.fromkeys(range(n_lc), 1.0)} if n_lc > 1 else {}
        return KVCacheManagerConfig(tokens_per_block=B, layers=layers, tiers=tiers, **ratio,
                                    # whole blocks only, unless partial_tail (kvcm.integrations.vllm.partial)
                                    enable_partial_reuse=self.partial_tail and not layout.hybrid and self.shared is None,
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


def _writable_dir(key: str, path: str) -> int | None:
    """``path`` is a directory this process can write into, or could create: its nearest
    existing ancestor is a directory a file can be created in (probed with a temporary file,
    removed at once: nothing is left).  ValueError naming ``key``; the free bytes of its file
    system (None when they cannot be read)."""
    p = os.path.abspath(os.path.expanduser(path))
    probe = p
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise key_error(key, f"{path!r}: {probe!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".kvcm-probe-"):
            pass
    except OSError as e:
        how = "is not writable" if probe == p else f"cannot be created in {probe!r}"
        raise key_error(key, f"{path!r} {how}: {e.strerror or e}") from None
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
# one letter: vLLM's convention (vllm.utils.argparse_utils.human_readable_int, also applied to
# bare tokens inside --kv-transfer-config's JSON): lower case decimal, upper case binary
_LETTERS = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
            "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(v: object) -> int:
    """Bytes from an int (>= 0) or a string with a unit: ``"8GiB"``, ``"500MB"``, ``"1.5 TiB"``,
    ``"4096"``.  KiB/MiB/GiB/TiB are powers of 1024 and kB/MB/GB/TB of 1000, in any case; one
    letter follows vLLM's flags (``--kv-cache-memory-bytes 8G``): ``K``/``M``/``G``/``T``
    powers of 1024, ``k``/``m``/``g``/``t`` of 1000.  ValueError (a short reason) otherwise."""
    if isinstance(v, bool):
        raise ValueError("a size, not a boolean")  # noqa: TRY004 -- one error type for every bad setting
    if isinstance(v, int):
        if v < 0:
            raise ValueError("negative")
        return v
    if isinstance(v, str):
        m = _SIZE.match(v)
        if m is not None:
            unit = m.group(2)
            mult = _LETTERS.get(unit) if len(unit) == 1 and unit.lower() != "b" else _UNITS.get(unit.lower())
            if mult is not None:
                n = float(m.group(1)) * mult
                if n != int(n):
                    raise ValueError("not a whole number of bytes")
                return int(n)
    raise ValueError("not a size")


def _size_value(name: str, v: object, more: str = "") -> int:
    try:
        return parse_size(v)
    except ValueError:
        raise key_error(name, f"must be a size: bytes as an int >= 0 or a string like \"8GiB\" or \"500MB\"{more}, "
                        f"got {v!r}") from None


def _check_names(extra: dict[Any, Any], where: str) -> None:
    bad_names = sorted(repr(k) for k in extra if not isinstance(k, str))
    if bad_names:
        raise ValueError(f"{where}: keys must be strings, got {', '.join(bad_names)}")
    unknown = sorted(set(extra) - set(KEYS) - set(TEST_KEYS))
    if unknown:
        hint = _did_you_mean(unknown[0])
        raise ValueError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {unknown}{hint}; known: "
                         f"{', '.join(KEYS)}")


def load_config_file(path: str, key: str = "config_file") -> dict[str, Any]:
    """The keys a config file holds: a YAML (``.yaml``/``.yml``, needs PyYAML, which vLLM
    installs) or JSON file of one mapping, the keys of ``kv_connector_extra_config`` (not
    ``config_file``).  ValueError, one line naming ``key`` (``config_file`` or the
    ``KVCM_CONFIG`` environment variable) and the file."""
    where = PREFIX + f"[{key!r}]" if key == "config_file" else f"{key} (environment)"
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{where} {path!r}: cannot read it: {e.strerror or e}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{where} {path!r}: a YAML file needs PyYAML (pip install pyyaml), or write it as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{where} {path!r}: not YAML: {' '.join(str(e).split())}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{where} {path!r}: not JSON ({e}); a YAML file's name ends in .yaml or .yml") from None
    if not isinstance(data, dict):
        kind = type(data).__name__  # one error type for every bad setting (vLLM reports ValueError)
        raise ValueError(f"{where} {path!r}: must hold one mapping of kv_connector_extra_config's keys, got {kind}")  # noqa: TRY004
    if "config_file" in data:
        raise ValueError(f"{where} {path!r}: a config file cannot name another (config_file)")
    _check_names(data, f"{where} {path!r}")
    return data


def _did_you_mean(key: str) -> str:
    import difflib

    close = difflib.get_close_matches(key, KEYS, n=1)  # never a test hook (TEST_KEYS)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _size(n: int) -> str:
    from kvcm.integrations.vllm.identity import size_text

    return size_text(n)


def shard_config(config: KVCacheManagerConfig, rank: int) -> KVCacheManagerConfig:
    """The config of rank ``rank``'s data plane and store client (the scheduler's lookups and
    the worker both use it, so it lives here): its shared objects are named with its rank
    (the manager's namespace ``...|tp<world>`` + ``/r<rank>``), so the ranks' shards of one
    block are distinct objects and a block is a shared hit only when all of them exist."""
    if not config.shared_namespace:
        return config
    return dataclasses.replace(config, shared_namespace=f"{config.shared_namespace}/r{rank}")
