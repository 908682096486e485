"""Config resolution (SPEC sec. 2): the one validator both backends use, the life cycles
it derives (sec. 1) and the rules on them (stale ranges, sec. 7).

:func:`resolve_config` checks a :class:`~kvcm.api.KVCacheManagerConfig` part by part, in
this order (the first failure raises a ``ConfigError`` naming the field; the order is
observable, so it is kept): tokens per block, layers (grouped into life cycles), tiers,
pool ratio and slot counts, then the scalar fields.

The C++ twin of :class:`LifeCycle`, :func:`floordiv` and :func:`ceildiv` is
``cpp/core/lifecycle.h``.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from kvcm.api import (
    COPY_SETTLEMENTS,
    SHARED_WRITE_POLICIES,
    TIER_KINDS,
    AttentionLayer,
    ConfigError,
    KVCacheManagerConfig,
    SsmLayer,
    Tier,
    as_int,
)

INT64_LIMIT = 2**63  # every count, size and byte figure both backends hold fits below this
MAX_POOL_SLOTS = 2**31 - 1  # page indices are int32 (sec. 7: page_indices_into)
MAX_POOL_WEIGHT = float(2**64)  # pool_ratio weights
MAX_SHARED_NAMESPACE_BYTES = 256  # KVCacheManagerConfig.shared_namespace, UTF-8


# ---------------------------------------------------------------------------------------
# Integer helpers (named as in cpp/core/lifecycle.h, where C++ division truncates)
# ---------------------------------------------------------------------------------------


def floordiv(a: int, b: int) -> int:
    """``a / b`` rounded down (``b > 0``)."""
    return a // b


def ceildiv(a: int, b: int) -> int:
    """``a / b`` rounded up (``b > 0``): blocks needed for ``a`` tokens."""
    return -floordiv(-a, b)


def stale_range(window: int | None, sinks: int, history: int, tokens_per_block: int) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of block ordinals that are stale at ``history`` for a
    windowed attention life cycle (sec. 7): past the sink blocks, every block that ends
    before the window.  Full attention (``window`` None) has none (an empty range)."""
    if window is None:
        return (0, 0)
    nsink = ceildiv(sinks, tokens_per_block)
    return (nsink, max(nsink, floordiv(history + 1 - window, tokens_per_block)))


# ---------------------------------------------------------------------------------------
# Life cycles and the resolved config
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LifeCycle:
    """A class of layers whose pages live and die together (SPEC sec. 1), as derived from
    a config: ``KVCacheManager.life_cycles`` lists them by id.

    Attributes:
        id: the life cycle id (0, 1, ... in order of first appearance in ``config.layers``):
            the ``lc`` of page indices, copy ops, events and stats.
        kind: ``"attn"`` or ``"ssm"``.
        window: attention only: the sliding window in tokens, None for full attention.
        sinks: attention only: the sink tokens (0 without a window).
        slot_bytes: the bytes of one page of this life cycle (SPEC sec. 2).
        layer_ids: the ids of its layers, in config order."""

    id: int
    kind: Literal["attn", "ssm"]
    window: int | None
    sinks: int
    slot_bytes: int
    layer_ids: tuple[int, ...]

    @property
    def is_full_attention(self) -> bool:
        """Attention without a window: its blocks are never stale."""
        return self.kind == "attn" and self.window is None

    def num_sink_blocks(self, tokens_per_block: int) -> int:
        """The blocks holding the sink tokens, ``ceil(sinks / B)``: never stale (sec. 7)."""
        return ceildiv(self.sinks, tokens_per_block)

    def stale_range(self, history: int, tokens_per_block: int) -> tuple[int, int]:
        """Half-open range of block ordinals that are stale at ``history`` (sec. 7).
        Full attention has none (empty range); ssm is handled by the caller (every block)."""
        if self.kind != "attn":
            return (0, 0)
        return stale_range(self.window, self.sinks, history, tokens_per_block)


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated config with the derived facts both backends need."""

    config: KVCacheManagerConfig
    life_cycles: tuple[LifeCycle, ...]
    # slots[tier_index][lc_id] = number of slots of that pool (local tiers only)
    slots: tuple[tuple[int, ...], ...]
    # the local tiers' kinds (those with pools), in config order; a shared tier is not one
    tier_kinds: tuple[str, ...]
    # the shared tier (DECISIONS.md "The shared tier"): no slots, no pools; None without one
    shared_tier: Tier | None = None

    @property
    def has_shared(self) -> bool:
        return self.shared_tier is not None

    @property
    def tokens_per_block(self) -> int:
        return self.config.tokens_per_block

    @property
    def quotas(self) -> tuple[int, ...]:
        """The local tiers' ``quota_bytes`` at construction, by config position."""
        return tuple(t.quota_bytes for t in self.config.tiers if t.kind != "shared")

    @property
    def tier_ids(self) -> tuple[int, ...]:
        """SPEC sec. 1 tier number (gpu 0, host 1, disk 2) of each configured tier, by
        config position: what copy ops, events, stats and snapshots report (DECISIONS.md)."""
        return tuple(TIER_KINDS.index(k) for k in self.tier_kinds)

    @property
    def shared_write_evict(self) -> bool:
        """The shared tier's write policy is "evict" (write-back) rather than "commit"."""
        return self.config.shared_write == "evict"

    @property
    def explicit_settlement(self) -> bool:
        """Copies are settled with ``settle_copies`` (``copy_settlement="explicit"``)."""
        return self.config.copy_settlement == "explicit"

    @property
    def ssm_lc(self) -> int | None:
        for lc in self.life_cycles:
            if lc.kind == "ssm":
                return lc.id
        return None


# ---------------------------------------------------------------------------------------
# resolve_config, part by part
# ---------------------------------------------------------------------------------------


def _config_int(v: Any) -> bool:
    """Config integers are exact ints (no bool, no subclass): the frozen config is read by
    both backends as is, so it must not hold objects that could answer differently."""
    return type(v) is int


def resolve_config(config: KVCacheManagerConfig) -> ResolvedConfig:
    """Validate ``config`` (sec. 2) and derive life cycles and pool sizes.

    The single validator both backends use; raises ConfigError naming the field."""
    if not isinstance(config, KVCacheManagerConfig):
        raise TypeError(f"config must be a KVCacheManagerConfig, got {type(config).__name__}")
    B = config.tokens_per_block
    if not _config_int(B) or not 1 <= B <= 4096:
        raise ConfigError("tokens_per_block", f"must be an int in 1..4096, got {B!r}")
    life_cycles = _resolve_life_cycles(config.layers, B)
    kinds = _resolve_tiers(config.tiers)
    slots = _resolve_slots(config, life_cycles)
    shared = config.tiers[-1] if kinds[-1] == "shared" else None
    _check_scalars(config, shared is not None)
    local = tuple(k for k in kinds if k != "shared")
    return ResolvedConfig(config=config, life_cycles=life_cycles, slots=slots, tier_kinds=local, shared_tier=shared)


def _resolve_life_cycles(layers: Any, B: int) -> tuple[LifeCycle, ...]:
    """Check the layers and group them into life cycles, numbered in order of first
    appearance: all full-attention layers share one, windowed ones one per (window,
    sinks), all ssm layers one (sec. 1)."""
    if not isinstance(layers, tuple):
        raise ConfigError("layers", f"must be a list of layers, got {type(layers).__name__}")
    if not layers:
        raise ConfigError("layers", "at least one layer is required")
    seen_ids: set[int] = set()
    lc_keys: list[tuple] = []
    lc_bytes: list[int] = []
    lc_layers: list[list[int]] = []
    for layer in layers:
        key, per = _check_layer(layer, seen_ids, B)
        if key in lc_keys:
            i = lc_keys.index(key)
            lc_bytes[i] += per
            lc_layers[i].append(layer.layer_id)
        else:
            lc_keys.append(key)
            lc_bytes.append(per)
            lc_layers.append([layer.layer_id])
    for i, k in enumerate(lc_keys):
        if lc_bytes[i] >= INT64_LIMIT:  # B * sum(bytes_per_token), or sum(state_bytes)
            field = "layers.state_bytes" if k[0] == "ssm" else "layers.bytes_per_token"
            raise ConfigError(field, f"the slot of life cycle {i} would be {lc_bytes[i]} bytes; at most 2**63 - 1")
    return tuple(
        LifeCycle(
            id=i,
            kind=k[0],
            window=k[1] if k[0] == "attn" else None,
            sinks=k[2] if k[0] == "attn" else 0,
            slot_bytes=lc_bytes[i],
            layer_ids=tuple(lc_layers[i]),
        )
        for i, k in enumerate(lc_keys)
    )


def _check_layer(layer: Any, seen_ids: set[int], B: int) -> tuple[tuple, int]:
    """One layer's checks; returns its life-cycle key and the bytes it adds to a page of
    that life cycle.  Adds its id to ``seen_ids``."""
    if not isinstance(layer, (AttentionLayer, SsmLayer)):
        raise ConfigError("layers", f"unknown layer type {type(layer).__name__}")
    if not _config_int(layer.layer_id) or not 0 <= layer.layer_id < INT64_LIMIT:
        raise ConfigError("layers.layer_id", f"must be an int in [0, 2**63), got {layer.layer_id!r}")
    if layer.layer_id in seen_ids:
        raise ConfigError("layers.layer_id", f"duplicate layer id {layer.layer_id}")
    seen_ids.add(layer.layer_id)
    if not isinstance(layer, AttentionLayer):  # an SsmLayer
        if not _config_int(layer.state_bytes) or not 1 <= layer.state_bytes < INT64_LIMIT:
            raise ConfigError("layers.state_bytes", f"must be an int in [1, 2**63), got {layer.state_bytes!r}")
        return ("ssm",), layer.state_bytes
    if not _config_int(layer.bytes_per_token) or not 1 <= layer.bytes_per_token < INT64_LIMIT:
        raise ConfigError("layers.bytes_per_token", f"must be an int in [1, 2**63), got {layer.bytes_per_token!r}")
    if layer.window is not None and (not _config_int(layer.window) or not 1 <= layer.window < INT64_LIMIT):
        raise ConfigError("layers.window", f"must be None or an int in [1, 2**63), got {layer.window!r}")
    if not _config_int(layer.sink_tokens) or not 0 <= layer.sink_tokens < INT64_LIMIT:
        raise ConfigError("layers.sink_tokens", f"must be an int in [0, 2**63), got {layer.sink_tokens!r}")
    if layer.sink_tokens and layer.window is None:
        raise ConfigError("layers.sink_tokens", "sink tokens need a window")
    key = ("attn", layer.window, layer.sink_tokens if layer.window is not None else 0)
    return key, layer.bytes_per_token * B


def _resolve_tiers(tiers: Any) -> list[str]:
    """Check the tiers (each, then the set: one gpu tier first, at most one of each kind,
    warm to cold, a shared tier last); returns their kinds in config order."""
    if not isinstance(tiers, tuple):
        raise ConfigError("tiers", f"must be a list of tiers, got {type(tiers).__name__}")
    if not tiers:
        raise ConfigError("tiers", "a gpu tier is required")
    kinds: list[str] = []
    for tier in tiers:
        if not isinstance(tier, Tier):
            raise ConfigError("tiers", f"unknown tier type {type(tier).__name__}")
        if type(tier.kind) is not str or tier.kind not in TIER_KINDS:
            raise ConfigError("tiers.kind", f"unknown tier kind {tier.kind!r}; choices: gpu, host, disk, shared")
        if not _config_int(tier.quota_bytes) or not 0 <= tier.quota_bytes < INT64_LIMIT:
            raise ConfigError("tiers.quota_bytes", f"must be an int in [0, 2**63), got {tier.quota_bytes!r}")
        _check_path(tier)
        kinds.append(tier.kind)
    if "gpu" not in kinds:
        raise ConfigError("tiers", "a gpu tier is required")
    for k in TIER_KINDS:
        if kinds.count(k) > 1:
            raise ConfigError("tiers", f"at most one {k} tier")
    if kinds != sorted(kinds, key=TIER_KINDS.index) or kinds[0] != "gpu":
        raise ConfigError("tiers", "tiers must be listed warm to cold: gpu, host, disk, shared")
    return kinds


def _check_path(tier: Tier) -> None:
    """``Tier.path`` (sec. 2, DECISIONS "Configuration"): only a disk or shared tier takes
    one; a non-empty str or os.PathLike naming a str path without NUL; for a disk tier, not
    an existing non-directory.  A shared tier's path is the store's location (a directory,
    ``file://...`` or ``mooncake://...``), read by the data plane only (DECISIONS "The
    shared tier").  Nothing is created here (the data plane creates a missing directory
    when it is built)."""
    path = tier.path
    if tier.kind not in ("disk", "shared"):
        if path is not None:
            raise ConfigError("tiers.path", f"only a disk or shared tier takes a path; the {tier.kind} tier "
                              f"has {path!r}")
        return
    if path is None:
        raise ConfigError("tiers.path", f"a {tier.kind} tier needs a path")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError("tiers.path", f"must be a str or os.PathLike, got {type(path).__name__}")
    try:
        text = os.fspath(path)
    except TypeError as e:
        raise ConfigError("tiers.path", f"os.fspath() failed: {e}") from None
    if type(text) is not str:
        raise ConfigError("tiers.path", f"must name a str path, got {type(text).__name__}")
    if not text:
        raise ConfigError("tiers.path", f"a {tier.kind} tier needs a path")
    if "\0" in text:
        raise ConfigError("tiers.path", "contains a NUL character")
    if tier.kind == "disk" and os.path.exists(text) and not os.path.isdir(text):
        raise ConfigError("tiers.path", f"{text!r} exists and is not a directory")


def _resolve_weights(ratio: Any, life_cycles: tuple[LifeCycle, ...]) -> dict[int, float]:
    """``pool_ratio`` (not None) as a float weight per life cycle id."""
    if not isinstance(ratio, dict):
        raise ConfigError("pool_ratio", f"must be a dict or None, got {type(ratio).__name__}")
    if any(not _config_int(k) for k in ratio) or set(ratio) != {lc.id for lc in life_cycles}:
        raise ConfigError("pool_ratio", f"must give a weight for every life cycle id {[lc.id for lc in life_cycles]}")
    weights: dict[int, float] = {}
    for k, w in ratio.items():
        if type(w) not in (int, float):
            raise ConfigError("pool_ratio", f"weights must be positive finite numbers, got {w!r}")
        try:
            wf = float(w)
        except OverflowError:
            raise ConfigError("pool_ratio", f"weight {w!r} does not fit a float") from None
        # bounded so that quota * weight (< 2**127) never overflows a float
        if not math.isfinite(wf) or not 0 < wf <= MAX_POOL_WEIGHT:
            raise ConfigError("pool_ratio", f"weights must be positive finite numbers up to 2**64, got {w!r}")
        weights[k] = wf
    return weights


def _resolve_slots(config: KVCacheManagerConfig, life_cycles: tuple[LifeCycle, ...]) -> tuple[tuple[int, ...], ...]:
    """Slots per local tier and life cycle: each tier's quota split evenly (``pool_ratio``
    None: the same count for every life cycle) or by the ratio's weights.  A shared tier
    has no slots: its quota is the data plane's (DECISIONS "The shared tier")."""
    ratio = config.pool_ratio
    weights = _resolve_weights(ratio, life_cycles) if ratio is not None else None
    slots: list[tuple[int, ...]] = []
    for tier in config.tiers:
        if tier.kind == "shared":
            continue
        per_lc = _split_quota(tier.quota_bytes, life_cycles, weights)
        if min(per_lc) < 1:
            raise ConfigError("tiers.quota_bytes", f"{tier.kind} quota {tier.quota_bytes} is too small for one slot per life cycle")
        if max(per_lc) > MAX_POOL_SLOTS:
            raise ConfigError("tiers.quota_bytes", f"{tier.kind} quota {tier.quota_bytes} gives {max(per_lc)} slots to one "
                              f"life cycle; at most 2**31 - 1 (page indices are int32)")
        slots.append(per_lc)
    return tuple(slots)


def _split_quota(quota_bytes: int, life_cycles: tuple[LifeCycle, ...],
                 weights: dict[int, float] | None) -> tuple[int, ...]:
    """One tier's slots per life cycle for ``quota_bytes`` (SPEC sec. 2): the same count
    for every life cycle (``weights`` None), else ``floor(quota * w / sum(w) / slot_bytes)``."""
    if weights is None:
        n = quota_bytes // sum(lc.slot_bytes for lc in life_cycles)
        return tuple(n for _ in life_cycles)
    total_w = float(sum(weights.values()))
    return tuple(math.floor(quota_bytes * weights[lc.id] / total_w / lc.slot_bytes) for lc in life_cycles)


def resolve_quota(rc: ResolvedConfig, tier: Any, quota_bytes: Any) -> tuple[int, int, tuple[int, ...]]:
    """``set_quota(tier, quota_bytes)``'s argument checks, shared by both backends
    (DECISIONS.md "Quotas at run time"): ``tier`` a local tier's kind (``"gpu"``,
    ``"host"``, ``"disk"``) or SPEC number (0, 1, 2); ``quota_bytes`` a count in
    ``[0, 2**63)`` that gives every life cycle between 1 and 2**31 - 1 slots, split as at
    construction.  Returns ``(config position, quota_bytes, slots per lc)``; TypeError /
    ValueError otherwise."""
    if isinstance(tier, str):
        if tier not in rc.tier_kinds:
            why = "the shared tier has no pools (its quota is the store's)" if tier == "shared" else (
                f"tiers: {', '.join(rc.tier_kinds)}")
            raise ValueError(f"set_quota: no {tier!r} tier with pools; {why}")
        pos = rc.tier_kinds.index(tier)
    else:
        t = as_int(tier)
        if t is None:
            raise TypeError(f"set_quota: tier must be a tier kind (str) or SPEC tier number (int), "
                            f"got {type(tier).__name__}")
        if t not in rc.tier_ids:
            names = ", ".join(f"{i} ({k})" for i, k in zip(rc.tier_ids, rc.tier_kinds))
            raise ValueError(f"set_quota: unknown tier {t}; tiers with pools: {names}")
        pos = rc.tier_ids.index(t)
    q = as_int(quota_bytes)
    if q is None:
        raise TypeError(f"set_quota: quota_bytes must be an int, got {type(quota_bytes).__name__}")
    if not 0 <= q < INT64_LIMIT:
        raise ValueError(f"set_quota: quota_bytes must be in [0, 2**63), got {q}")
    ratio = rc.config.pool_ratio
    per_lc = _split_quota(q, rc.life_cycles, _resolve_weights(ratio, rc.life_cycles) if ratio is not None else None)
    kind = rc.tier_kinds[pos]
    if min(per_lc) < 1:
        raise ValueError(f"set_quota: {kind} quota {q} is too small for one slot per life cycle")
    if max(per_lc) > MAX_POOL_SLOTS:
        raise ValueError(f"set_quota: {kind} quota {q} gives {max(per_lc)} slots to one life cycle; "
                         "at most 2**31 - 1 (page indices are int32)")
    return pos, q, per_lc


def _check_scalars(config: KVCacheManagerConfig, has_shared: bool) -> None:
    """The remaining fields, in declaration order."""
    if type(config.enable_partial_reuse) is not bool:
        raise ConfigError("enable_partial_reuse", "must be a bool")
    if not _config_int(config.reuse_match_backoff) or not 0 <= config.reuse_match_backoff < INT64_LIMIT:
        raise ConfigError("reuse_match_backoff", f"must be an int in [0, 2**63), got {config.reuse_match_backoff!r}")
    mu = config.max_util_for_resume
    # compared as given: no float() that could overflow; NaN fails every comparison
    if type(mu) not in (int, float) or not 0 < mu <= 1:
        raise ConfigError("max_util_for_resume", f"must be in (0, 1], got {mu!r}")
    if not _config_int(config.default_priority) or not 0 <= config.default_priority <= 100:
        raise ConfigError("default_priority", f"must be an int in 0..100, got {config.default_priority!r}")
    if not _config_int(config.max_events) or not 0 <= config.max_events < INT64_LIMIT:
        raise ConfigError("max_events", f"must be an int in [0, 2**63), got {config.max_events!r}")
    w = config.pending_copy_ops_warning
    if not _config_int(w) or not 0 <= w < INT64_LIMIT:
        raise ConfigError("pending_copy_ops_warning", f"must be an int in [0, 2**63), got {w!r}")
    if type(config.shared_write) is not str or config.shared_write not in SHARED_WRITE_POLICIES:
        raise ConfigError("shared_write", f"must be 'commit' or 'evict', got {config.shared_write!r}")
    ns = config.shared_namespace
    if type(ns) is not str:
        raise ConfigError("shared_namespace", f"must be a str, got {type(ns).__name__}")
    try:
        nbytes = len(ns.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigError("shared_namespace", "is not encodable as UTF-8") from None
    if nbytes > MAX_SHARED_NAMESPACE_BYTES:
        raise ConfigError("shared_namespace", f"is {nbytes} bytes UTF-8; at most {MAX_SHARED_NAMESPACE_BYTES}")
    if has_shared and not ns:
        # two fine-tunes of one shape have one layout: only the namespace keeps them from
        # reading each other's bytes, so a shared tier never goes without one
        raise ConfigError("shared_namespace", "a shared tier needs a non-empty namespace naming the model "
                                              "(e.g. its name and revision): same-shaped models must not share bytes")
    sf = config.shared_secret_file
    # (the message names the type only: a secret passed here by mistake must not be shown)
    if type(sf) is not str:
        raise ConfigError("shared_secret_file", f"must be a str (a path), got {type(sf).__name__}")
    if "\0" in sf:
        raise ConfigError("shared_secret_file", "must not contain NUL")
    cs = config.copy_settlement
    if type(cs) is not str or cs not in COPY_SETTLEMENTS:
        raise ConfigError("copy_settlement", f"must be 'drain' or 'explicit', got {cs!r}")


__all__ = [
    "INT64_LIMIT",
    "MAX_POOL_SLOTS",
    "MAX_POOL_WEIGHT",
    "MAX_SHARED_NAMESPACE_BYTES",
    "LifeCycle",
    "ResolvedConfig",
    "ceildiv",
    "floordiv",
    "resolve_config",
    "resolve_quota",
    "stale_range",
]


# ---------------------------------------------------------------------------------------
# The layout fingerprint of the shared tier (SPEC sec. 16, DECISIONS "The shared tier")
# ---------------------------------------------------------------------------------------


def layout_fingerprint(resolved: ResolvedConfig, namespace: str) -> bytes:
    """32 bytes naming the byte layout of every page this config writes, so that managers
    with another model, block size or page layout never read each other's objects: B, each
    life cycle's kind, window, sinks and slot bytes, its layers in config order (each
    layer's id and bytes per token / state bytes: how the slot splits between layers, so
    that layers of 64+32 and 32+64 bytes per token never read each other's K/V), and a
    user-given model/namespace string.  Pool sizes, tiers and policies are left out: they do
    not change a page's bytes."""
    if type(namespace) is not str:
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    layers = {layer.layer_id: layer for layer in resolved.config.layers}
    h = hashlib.sha256(b"kvcm-layout-v2\0")
    h.update(resolved.tokens_per_block.to_bytes(4, "little"))
    h.update(len(resolved.life_cycles).to_bytes(4, "little"))
    for lc in resolved.life_cycles:
        h.update(b"a" if lc.kind == "attn" else b"s")
        h.update((0 if lc.window is None else lc.window).to_bytes(8, "little"))
        h.update(lc.sinks.to_bytes(8, "little"))
        h.update(lc.slot_bytes.to_bytes(8, "little"))
        h.update(len(lc.layer_ids).to_bytes(8, "little"))
        for lid in lc.layer_ids:  # config order: the order the layers sit in the slot
            layer = layers[lid]
            unit = layer.bytes_per_token if isinstance(layer, AttentionLayer) else layer.state_bytes
            h.update(lid.to_bytes(8, "little") + unit.to_bytes(8, "little"))
    ns = namespace.encode("utf-8")
    h.update(len(ns).to_bytes(8, "little") + ns)
    return h.digest()
