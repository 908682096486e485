"""The one interface of kvcm: configuration, value types, errors and the abstract manager.

Both backends (``python`` and ``cpp``) import everything here and nothing here is
duplicated per backend.  SPEC sections are cited as ``sec. N``.
"""

from __future__ import annotations

import abc
import enum
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

# ---------------------------------------------------------------------------------------
# Errors (sec. 10).  ValueError / TypeError are used for bad arguments, as documented.
# ---------------------------------------------------------------------------------------


class KvcmError(Exception):
    """Base of every kvcm-specific error."""


class ConfigError(KvcmError, ValueError):
    """Invalid configuration; ``field`` names the offending config field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class ClosedError(KvcmError):
    """A call on a closed KVCache (other than ``close()``, which is idempotent)."""


class InvalidStateError(KvcmError):
    """A call made in the wrong status (e.g. ``commit`` on a SUSPENDED cache)."""


class OutOfPagesError(KvcmError):
    """No slot could be found after eviction.  Public calls documented to return a bool
    return False instead of raising it."""


class InvariantError(KvcmError):
    """``check_invariants()`` found a broken internal rule (always a kvcm bug)."""


class CopyError(KvcmError):
    """Some copy ops did not complete (sec. 15): raised by ``DataPlane.apply``.

    ``ops`` lists, in their order in the applied list, every op whose destination bytes
    cannot be trusted: the op(s) that failed and every op after them that was not executed.
    ``cause`` is the first underlying exception (an ``OSError`` for a disk I/O failure, a
    short read or a checksum mismatch).  Report ``ops`` to the manager with
    :meth:`KVCacheManager.forget_copies`, then recompute what it rolled back."""

    def __init__(self, message: str, ops: Sequence[CopyOp] = (), cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.ops: list[CopyOp] = list(ops)
        self.cause = cause


class PendingCopyOpsWarning(RuntimeWarning):
    """Issued once per manager when undrained copy ops reach
    ``KVCacheManagerConfig.pending_copy_ops_warning`` (the engine forgot ``drain_copy_ops()``)."""


def warn_pending_copy_ops(pending: int) -> None:
    """The one-time warning of both backends (issued after the call that crossed the threshold)."""
    warnings.warn(
        f"kvcm: {pending} copy ops are pending: call drain_copy_ops() and execute them every step "
        f"(stats()['pending_copy_ops'] shows the figure; KVCacheManagerConfig.pending_copy_ops_warning "
        f"sets this threshold)", PendingCopyOpsWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------
# Configuration (sec. 2)
# ---------------------------------------------------------------------------------------

TierKind = Literal["gpu", "host", "disk"]
TIER_KINDS: tuple[str, ...] = ("gpu", "host", "disk")
GPU, HOST, DISK = 0, 1, 2

MAX_TOKEN = 2**31
DIGEST_TOKEN_BYTES = 32
Token = int | bytes


@dataclass(frozen=True)
class AttentionLayer:
    layer_id: int
    bytes_per_token: int
    window: int | None = None
    sink_tokens: int = 0


@dataclass(frozen=True)
class SsmLayer:
    layer_id: int
    state_bytes: int


Layer = AttentionLayer | SsmLayer


@dataclass(frozen=True)
class Tier:
    kind: str
    quota_bytes: int
    path: str | None = None


@dataclass(frozen=True)
class LifeCycle:
    """A class of layers whose pages live and die together (sec. 1)."""

    id: int
    kind: Literal["attn", "ssm"]
    window: int | None  # attention only; None = full attention
    sinks: int  # attention only
    slot_bytes: int  # bytes of one page of this life cycle
    layer_ids: tuple[int, ...]

    @property
    def is_full_attention(self) -> bool:
        return self.kind == "attn" and self.window is None

    def num_sink_blocks(self, tokens_per_block: int) -> int:
        return -(-self.sinks // tokens_per_block)

    def stale_range(self, history: int, tokens_per_block: int) -> tuple[int, int]:
        """Half-open range of block ordinals that are stale at ``history`` (sec. 7).
        Full attention has none (empty range); ssm is handled by the caller (every block)."""
        if self.kind != "attn" or self.window is None:
            return (0, 0)
        nsink = self.num_sink_blocks(tokens_per_block)
        return (nsink, max(nsink, (history + 1 - self.window) // tokens_per_block))


@dataclass(frozen=True)
class KVCacheManagerConfig:
    tokens_per_block: int
    layers: Sequence[Layer]
    tiers: Sequence[Tier]
    pool_ratio: dict[int, float] | None = None
    enable_partial_reuse: bool = True
    reuse_match_backoff: int = 0
    max_util_for_resume: float = 1.0
    default_priority: int = 50
    max_events: int = 10_000
    # warn once (PendingCopyOpsWarning) when this many copy ops are pending; 0: never
    pending_copy_ops_warning: int = 1_000_000

    def __post_init__(self) -> None:
        # Freeze the sequences so the config is hashable-in-spirit and cannot change later.
        # (anything that is no list of layers / tiers is left for resolve_config's ConfigError)
        for name in ("layers", "tiers"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.pool_ratio, Mapping):  # anything else is resolve_config's ConfigError
            object.__setattr__(self, "pool_ratio", dict(self.pool_ratio))


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated config with the derived facts both backends need."""

    config: KVCacheManagerConfig
    life_cycles: tuple[LifeCycle, ...]
    # slots[tier_index][lc_id] = number of slots of that pool
    slots: tuple[tuple[int, ...], ...]
    tier_kinds: tuple[str, ...]

    @property
    def tokens_per_block(self) -> int:
        return self.config.tokens_per_block

    @property
    def tier_ids(self) -> tuple[int, ...]:
        """SPEC sec. 1 tier number (gpu 0, host 1, disk 2) of each configured tier, by
        config position: what copy ops, events, stats and snapshots report (DECISIONS.md)."""
        return tuple(TIER_KINDS.index(k) for k in self.tier_kinds)

    @property
    def ssm_lc(self) -> int | None:
        for lc in self.life_cycles:
            if lc.kind == "ssm":
                return lc.id
        return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


INT64_LIMIT = 2**63  # every count, size and byte figure both backends hold fits below this
MAX_POOL_SLOTS = 2**31 - 1  # page indices are int32 (sec. 7: page_indices_into)
MAX_POOL_WEIGHT = float(2**64)  # pool_ratio weights

_int_value = int.__index__  # the int value of an int subclass; no subclass can override it


def as_int(v: Any) -> int | None:
    """``v`` as an exact ``int`` when it is an int (not bool), else None.  An int subclass
    is read by its value (``int.__index__`` of the base type), so a subclass whose
    ``__index__`` / ``__int__`` / comparisons lie is seen exactly as the C++ core reads it."""
    if type(v) is int:
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return _int_value(v)
    return None


def _config_int(v: Any) -> bool:
    """Config integers are exact ints (no bool, no subclass): the frozen config is read by
    both backends as is, so it must not hold objects that could answer differently."""
    return type(v) is int


def _check_path(tier: Tier) -> None:
    """``Tier.path`` (sec. 2, DECISIONS "Configuration"): only a disk tier takes one; a
    non-empty str or os.PathLike naming a str path without NUL, not an existing non-directory.
    Nothing is created here (the data plane creates a missing directory when it is built)."""
    path = tier.path
    if tier.kind != "disk":
        if path is not None:
            raise ConfigError("tiers.path", f"only a disk tier takes a path; the {tier.kind} tier has {path!r}")
        return
    if path is None:
        raise ConfigError("tiers.path", "a disk tier needs a path")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError("tiers.path", f"must be a str or os.PathLike, got {type(path).__name__}")
    try:
        text = os.fspath(path)
    except TypeError as e:
        raise ConfigError("tiers.path", f"os.fspath() failed: {e}") from None
    if type(text) is not str:
        raise ConfigError("tiers.path", f"must name a str path, got {type(text).__name__}")
    if not text:
        raise ConfigError("tiers.path", "a disk tier needs a path")
    if "\0" in text:
        raise ConfigError("tiers.path", "contains a NUL character")
    if os.path.exists(text) and not os.path.isdir(text):
        raise ConfigError("tiers.path", f"{text!r} exists and is not a directory")


def resolve_config(config: KVCacheManagerConfig) -> ResolvedConfig:
    """Validate ``config`` (sec. 2) and derive life cycles and pool sizes.

    The single validator both backends use; raises ConfigError naming the field."""
    if not isinstance(config, KVCacheManagerConfig):
        raise TypeError(f"config must be a KVCacheManagerConfig, got {type(config).__name__}")
    B = config.tokens_per_block
    if not _config_int(B) or not 1 <= B <= 4096:
        raise ConfigError("tokens_per_block", f"must be an int in 1..4096, got {B!r}")
    if not isinstance(config.layers, tuple):
        raise ConfigError("layers", f"must be a list of layers, got {type(config.layers).__name__}")
    if not config.layers:
        raise ConfigError("layers", "at least one layer is required")
    seen_ids: set[int] = set()
    lc_keys: list[tuple] = []
    lc_bytes: list[int] = []
    lc_layers: list[list[int]] = []
    for layer in config.layers:
        if not isinstance(layer, (AttentionLayer, SsmLayer)):
            raise ConfigError("layers", f"unknown layer type {type(layer).__name__}")
        if not _config_int(layer.layer_id) or not 0 <= layer.layer_id < INT64_LIMIT:
            raise ConfigError("layers.layer_id", f"must be an int in [0, 2**63), got {layer.layer_id!r}")
        if layer.layer_id in seen_ids:
            raise ConfigError("layers.layer_id", f"duplicate layer id {layer.layer_id}")
        seen_ids.add(layer.layer_id)
        if isinstance(layer, AttentionLayer):
            if not _config_int(layer.bytes_per_token) or not 1 <= layer.bytes_per_token < INT64_LIMIT:
                raise ConfigError("layers.bytes_per_token",
                                  f"must be an int in [1, 2**63), got {layer.bytes_per_token!r}")
            if layer.window is not None and (not _config_int(layer.window) or not 1 <= layer.window < INT64_LIMIT):
                raise ConfigError("layers.window", f"must be None or an int in [1, 2**63), got {layer.window!r}")
            if not _config_int(layer.sink_tokens) or not 0 <= layer.sink_tokens < INT64_LIMIT:
                raise ConfigError("layers.sink_tokens", f"must be an int in [0, 2**63), got {layer.sink_tokens!r}")
            if layer.sink_tokens and layer.window is None:
                raise ConfigError("layers.sink_tokens", "sink tokens need a window")
            key: tuple = ("attn", layer.window, layer.sink_tokens if layer.window is not None else 0)
            per = layer.bytes_per_token * B
        else:
            if not _config_int(layer.state_bytes) or not 1 <= layer.state_bytes < INT64_LIMIT:
                raise ConfigError("layers.state_bytes", f"must be an int in [1, 2**63), got {layer.state_bytes!r}")
            key = ("ssm",)
            per = layer.state_bytes
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
    life_cycles = tuple(
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

    if not isinstance(config.tiers, tuple):
        raise ConfigError("tiers", f"must be a list of tiers, got {type(config.tiers).__name__}")
    if not config.tiers:
        raise ConfigError("tiers", "a gpu tier is required")
    kinds: list[str] = []
    for tier in config.tiers:
        if not isinstance(tier, Tier):
            raise ConfigError("tiers", f"unknown tier type {type(tier).__name__}")
        if type(tier.kind) is not str or tier.kind not in TIER_KINDS:
            raise ConfigError("tiers.kind", f"unknown tier kind {tier.kind!r}; choices: gpu, host, disk")
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
        raise ConfigError("tiers", "tiers must be listed warm to cold: gpu, host, disk")

    ratio = config.pool_ratio
    weights: dict[int, float] = {}
    if ratio is not None:
        if not isinstance(ratio, dict):
            raise ConfigError("pool_ratio", f"must be a dict or None, got {type(ratio).__name__}")
        if any(not _config_int(k) for k in ratio) or set(ratio) != {lc.id for lc in life_cycles}:
            raise ConfigError("pool_ratio", f"must give a weight for every life cycle id {[lc.id for lc in life_cycles]}")
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
    slots: list[tuple[int, ...]] = []
    for tier in config.tiers:
        if ratio is None:
            n = tier.quota_bytes // sum(lc.slot_bytes for lc in life_cycles)
            per_lc = tuple(n for _ in life_cycles)
        else:
            total_w = float(sum(weights.values()))
            per_lc = tuple(
                math.floor(tier.quota_bytes * weights[lc.id] / total_w / lc.slot_bytes) for lc in life_cycles
            )
        if min(per_lc) < 1:
            raise ConfigError("tiers.quota_bytes", f"{tier.kind} quota {tier.quota_bytes} is too small for one slot per life cycle")
        if max(per_lc) > MAX_POOL_SLOTS:
            raise ConfigError("tiers.quota_bytes", f"{tier.kind} quota {tier.quota_bytes} gives {max(per_lc)} slots to one "
                              f"life cycle; at most 2**31 - 1 (page indices are int32)")
        slots.append(per_lc)

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
    return ResolvedConfig(config=config, life_cycles=life_cycles, slots=tuple(slots), tier_kinds=tuple(kinds))


# ---------------------------------------------------------------------------------------
# Value types
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReuseScope:
    """Requests only share blocks within one scope (sec. 3).  ``None`` and ``0`` differ."""

    lora_id: int | None = None
    salt: int | None = None

    def __post_init__(self) -> None:
        for name in ("lora_id", "salt"):
            _scope_field(name, getattr(self, name))


def _scope_field(name: str, v: Any) -> int | None:
    """A ReuseScope field: None or an int (by value) in [0, 2**64)."""
    if v is None:
        return None
    value = as_int(v)
    if value is None or not 0 <= value < 2**64:
        raise ValueError(f"ReuseScope.{name} must be None or an int in [0, 2**64), got {v!r}")
    return value


_DEFAULT_SCOPE = ReuseScope()


class Status(enum.Enum):
    SUSPENDED = "SUSPENDED"
    ACTIVE = "ACTIVE"
    CLOSED = "CLOSED"


CopyReason = Literal["offload", "onboard", "cow", "snapshot"]


@dataclass(frozen=True)
class CopyOp:
    """Copy one page: the engine executes these in order before using the step's indices.
    Tiers are SPEC's numbers by kind (``GPU, HOST, DISK = 0, 1, 2``), whatever tiers the
    config lists: with gpu + disk only, disk is still 2."""

    lc: int
    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    reason: str

    def to_json(self) -> list:
        return [self.lc, self.src_tier, self.src_slot, self.dst_tier, self.dst_slot, self.reason]


@dataclass(frozen=True)
class StoredBlock:
    key: bytes
    num_tokens: int
    tokens: tuple[Token, ...]
    lc: int
    tier: int
    priority: int


@dataclass(frozen=True)
class Event:
    event_id: int
    kind: ClassVar[str] = ""

    def to_json(self) -> dict:
        raise NotImplementedError


def _tok_json(t: Token) -> int | str:
    return t if isinstance(t, int) else t.hex()


@dataclass(frozen=True)
class StoredEvent(Event):
    parent_key: bytes | None = None
    blocks: tuple[StoredBlock, ...] = ()
    partial: bool = False
    kind: ClassVar[str] = "stored"

    def to_json(self) -> dict:
        return {
            "event_id": self.event_id,
            "kind": self.kind,
            "parent_key": self.parent_key.hex() if self.parent_key is not None else None,
            "partial": self.partial,
            "blocks": [
                [b.key.hex(), b.num_tokens, [_tok_json(t) for t in b.tokens], b.lc, b.tier, b.priority] for b in self.blocks
            ],
        }


@dataclass(frozen=True)
class RemovedEvent(Event):
    keys: tuple[bytes, ...] = ()
    lc: int = 0
    kind: ClassVar[str] = "removed"

    def to_json(self) -> dict:
        return {"event_id": self.event_id, "kind": self.kind, "keys": [k.hex() for k in self.keys], "lc": self.lc}


@dataclass(frozen=True)
class TierChangedEvent(Event):
    key: bytes = b""
    lc: int = 0
    old_tier: int = 0
    new_tier: int = 0
    kind: ClassVar[str] = "tier_changed"

    def to_json(self) -> dict:
        return {
            "event_id": self.event_id,
            "kind": self.kind,
            "key": self.key.hex(),
            "lc": self.lc,
            "old_tier": self.old_tier,
            "new_tier": self.new_tier,
        }


@dataclass(frozen=True)
class ClearedEvent(Event):
    kind: ClassVar[str] = "cleared"

    def to_json(self) -> dict:
        return {"event_id": self.event_id, "kind": self.kind}


@dataclass(frozen=True)
class ReuseProbe:
    """Side-effect-free match result (sec. 6): ``num_tokens`` is ``m``;
    ``num_tokens_before_ssm`` is the same fixed point without the ssm rule."""

    num_tokens: int
    num_tokens_before_ssm: int


# ---------------------------------------------------------------------------------------
# Argument checks shared by both backends (sec. 10): raise before anything changes.
# ---------------------------------------------------------------------------------------


def _token_items(tokens: Any, name: str) -> list:
    """The items of a token sequence other than an exact list / tuple (DECISIONS "Tokens"):
    a 1-D array (anything with ``tolist()``: numpy, torch, ``array.array``, a memoryview
    that is not over bytes) or a ``collections.abc.Sequence`` (range, list subclasses...).
    Rejected (TypeError): None, str, bytes, bytearray and memoryviews of them, dicts, sets,
    iterators and generators (single use: a failed call would consume them), and arrays of
    more than one dimension.  Any Python code this runs (``tolist()``, ``__iter__``) runs
    here, before the call looks at any state."""
    if tokens is None or isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be a sequence of tokens, got {type(tokens).__name__}")
    if isinstance(tokens, memoryview) and isinstance(tokens.obj, (bytes, bytearray)):
        raise TypeError(f"{name} must be a sequence of tokens, got a memoryview of {type(tokens.obj).__name__}")
    if hasattr(tokens, "tolist"):
        ndim = getattr(tokens, "ndim", 1)
        if ndim != 1:
            raise TypeError(f"{name} must be a 1-D sequence of tokens, got a {ndim}-D {type(tokens).__name__}")
        items = tokens.tolist()  # numpy / torch / array('i'): one C-level conversion
        if type(items) is not list:
            raise TypeError(f"{name}.tolist() must return a list, got {type(items).__name__}")
        return items
    if isinstance(tokens, Sequence):
        return list(tokens)
    raise TypeError(f"{name} must be a sequence of tokens, got {type(tokens).__name__}")


def check_tokens(tokens: Any, name: str = "tokens") -> list[Token]:
    """Normalise a token sequence to a new list; TypeError/ValueError on a bad token.

    The one rule for what a token sequence is (DECISIONS "Tokens"; the C++ parser in
    cpp/token_parse.h has the same results and messages): a list or tuple of tokens, or
    what :func:`_token_items` accepts.  A token is an ``int`` in ``[0, 2**31)`` (not bool;
    an int subclass counts by its int value) or ``bytes`` (exactly) of length 32."""
    out = list(tokens) if type(tokens) in (list, tuple) else _token_items(tokens, name)
    if not out:
        return out
    types = set(map(type, out))
    if types == {int}:  # the common case, checked at C speed
        if min(out) < 0 or max(out) >= MAX_TOKEN:
            bad = next(t for t in out if not 0 <= t < MAX_TOKEN)
            raise ValueError(f"{name}: token {bad} out of range [0, 2**31)")
        return out
    for i, t in enumerate(out):
        tt = type(t)
        if tt is bytes:
            if len(t) != DIGEST_TOKEN_BYTES:
                raise ValueError(f"{name}: a digest token must be 32 bytes, got {len(t)}")
            continue
        v = as_int(t)
        if v is None:
            raise TypeError(f"{name}: a token must be an int or 32 bytes, got {tt.__name__}")
        if not 0 <= v < MAX_TOKEN:
            raise ValueError(f"{name}: token {v} out of range [0, 2**31)")
        out[i] = v
    return out


def check_scope(scope: Any) -> ReuseScope:
    """The scope to use: None is the default scope.  The fields are validated again here
    (a ReuseScope can be forged with ``object.__setattr__``) and an int subclass is read by
    its value, so both backends key exactly the same scope."""
    if scope is None:
        return _DEFAULT_SCOPE
    if not isinstance(scope, ReuseScope):
        raise TypeError(f"scope must be a ReuseScope or None, got {type(scope).__name__}")
    lora, salt = scope.lora_id, scope.salt
    nl, ns = _scope_field("lora_id", lora), _scope_field("salt", salt)
    if type(scope) is ReuseScope and nl is lora and ns is salt:
        return scope
    return ReuseScope(nl, ns)


def check_priority(priority: Any, default: int) -> int:
    if priority is None:
        return default
    value = as_int(priority)
    if value is None:
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")
    if not 0 <= value <= 100:
        raise ValueError(f"priority must be in 0..100, got {value}")
    return value


MAX_COUNT = 2**63  # counts the C++ core can hold (int64); larger ones are "too large"
# A request's page table has one entry per block ordinal below its capacity (sec. 7,
# page_indices); a resize to more ordinals than this is refused like one the pools can
# never hold (DECISIONS "Resource bounds").
MAX_REQUEST_BLOCKS = 2**24


def check_cache_id(cache_id: Any) -> int | str | None:
    """A caller-given cache id: None, an int (not bool; a subclass by its value) or a str
    (a subclass as its plain str), so that comparing ids runs no caller code."""
    if cache_id is None:
        return None
    v = as_int(cache_id)
    if v is not None:
        return v
    if isinstance(cache_id, str):
        return str.__str__(cache_id)
    raise TypeError(f"id must be an int or str, got {type(cache_id).__name__}")


def default_cache_id(serial: int, open_ids: Any) -> int:
    """The id of a cache created without one: its creation serial, or the next integer no
    open cache holds (DECISIONS "API shape")."""
    i = serial
    while i in open_ids:
        i += 1
    return i


def check_count(value: Any, name: str) -> int:
    """A count argument (``capacity``, ``history_length``): an int (not bool; a subclass by
    its value) in ``[0, 2**63)``."""
    v = as_int(value)
    if v is None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    if v >= MAX_COUNT:
        raise ValueError(f"{name} {v} is too large")
    return v


def check_batch_caches(what: str, caches: Any, is_mine: Callable[[Any], bool], key: Callable[[Any], Any]) -> list:
    """Check 1 of the batch calls, item by item in batch order: ``caches`` is a sequence
    (TypeError), each item a KVCache (TypeError) of this manager (ValueError; ``is_mine``
    is the backend's membership test), none twice (ValueError; ``key`` tells caches
    apart).  Returns the caches as a list."""
    if type(caches) is not list and (not isinstance(caches, Sequence) or isinstance(caches, (str, bytes))):
        raise TypeError(f"{what}(): caches must be a sequence of KVCache, got {type(caches).__name__}")
    seen: set[Any] = set()
    for i, c in enumerate(caches):
        if not isinstance(c, KVCache):
            raise TypeError(f"{what}(): caches[{i}] must be a KVCache, got {type(c).__name__}")
        if not is_mine(c):
            raise ValueError(f"{what}(): caches[{i}]: not a cache of this manager")
        k = key(c)
        if k in seen:
            raise ValueError(f"{what}(): caches[{i}]: the same cache appears twice in the batch")
        seen.add(k)
    return list(caches)


def check_counts(values: Any, name: str, n: int, what: str) -> list[int]:
    """A batch argument of ``n`` counts (``resize_batch``'s capacities / history_lengths):
    a list or tuple of ints, or an integer array (``array``, numpy, torch: anything with
    ``tolist()``), each an int (not bool) in ``[0, 2**63)``.  TypeError / ValueError naming
    ``name[i]`` for the first bad item, then ValueError when the length is not ``n``."""
    if type(values) in (list, tuple):
        items = values
    elif hasattr(values, "tolist") and not isinstance(values, (str, bytes, bytearray)):
        items = values.tolist()  # one C-level conversion (numpy / torch / array / memoryview)
        if type(items) is not list:
            raise TypeError(f"{name}.tolist() must return a list, got {type(items).__name__}")
    else:
        raise TypeError(f"{what}(): {name} must be a list or tuple of ints or an integer array, "
                        f"got {type(values).__name__}")
    out = list(items)
    for i, item in enumerate(out):
        v = as_int(item)
        if v is None:
            raise TypeError(f"{name}[{i}] must be an int, got {type(item).__name__}")
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
        if v >= MAX_COUNT:
            raise ValueError(f"{name}[{i}] {v} is too large")
        out[i] = v
    if len(out) != n:
        raise ValueError(f"{what}(): {name} has {len(out)} items for {n} caches")
    return out


def check_copy_ops(ops: Any, what: str = "forget_copies") -> list[CopyOp]:
    """The type checks of :meth:`KVCacheManager.forget_copies` (shared by both backends):
    ``ops`` is a list or tuple (TypeError), each item a ``CopyOp`` (TypeError) whose slots
    and tiers are ints (not bool) and whose reason is a str (TypeError).  Whether each op
    was issued is the backend's check (ValueError)."""
    if type(ops) not in (list, tuple):
        raise TypeError(f"{what}(): ops must be a list or tuple of CopyOp, got {type(ops).__name__}")
    for i, op in enumerate(ops):
        if not isinstance(op, CopyOp):
            raise TypeError(f"{what}(): ops[{i}] must be a CopyOp, got {type(op).__name__}")
        for name in ("lc", "src_tier", "src_slot", "dst_tier", "dst_slot"):
            if not _is_int(getattr(op, name)):
                raise TypeError(f"{what}(): ops[{i}].{name} must be an int, got {type(getattr(op, name)).__name__}")
        if type(op.reason) is not str:
            raise TypeError(f"{what}(): ops[{i}].reason must be a str, got {type(op.reason).__name__}")
    return list(ops)


def int32_view(out: Any) -> memoryview:
    """A writable 1-D int32 view of ``out`` (numpy array, array('i'), CPU torch tensor)."""
    if not hasattr(out, "__buffer__") and hasattr(out, "numpy"):
        out = out.numpy()  # a CPU torch tensor shares its memory with the array
    try:
        view = memoryview(out)
    except TypeError:
        raise TypeError(f"out must be a writable int32 buffer, got {type(out).__name__}") from None
    if view.readonly:
        raise ValueError("out is read-only")
    if view.itemsize != 4 or view.format.lstrip("<=@") not in ("i", "l"):
        raise ValueError(f"out must be an int32 buffer, got format {view.format!r}")
    if view.ndim != 1 or not view.c_contiguous:
        raise ValueError("out must be a contiguous 1-D buffer")
    return view.cast("B").cast("i")


# ---------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------


class KVCache(abc.ABC):
    """One request's view of the cache (sec. 7).  Created SUSPENDED by
    :meth:`KVCacheManager.create_kv_cache`."""

    @property
    @abc.abstractmethod
    def id(self) -> int | str: ...

    @property
    @abc.abstractmethod
    def status(self) -> Status: ...

    @property
    @abc.abstractmethod
    def capacity(self) -> int: ...

    @property
    @abc.abstractmethod
    def history_length(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_committed_tokens(self) -> int: ...

    @property
    @abc.abstractmethod
    def committed_tokens(self) -> list[Token]: ...

    @property
    @abc.abstractmethod
    def num_reused_tokens(self) -> int: ...

    @property
    @abc.abstractmethod
    def priority(self) -> int: ...

    @abc.abstractmethod
    def resume(self) -> bool:
        """SUSPENDED → ACTIVE: lock every page on gpu (onboarding, copy-on-write).
        All or nothing; False when gpu slots run out or ``max_util_for_resume`` would be
        exceeded, with no state changed."""

    @abc.abstractmethod
    def suspend(self) -> None:
        """ACTIVE → SUSPENDED: LOCKED pages become HELD (may be offloaded, never dropped)."""

    @abc.abstractmethod
    def resize(self, capacity: int, history_length: int | None = None) -> bool:
        """ACTIVE only.  Allocate/free pages for the new capacity; False (nothing changed)
        when gpu pages run out."""

    @abc.abstractmethod
    def commit(self, tokens: Sequence[Token]) -> None:
        """ACTIVE only.  Append tokens; every block that becomes full enters the tree."""

    @abc.abstractmethod
    def stop_committing(self) -> None:
        """Insert the partial tail as a partial block; later commits raise."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything.  Idempotent."""

    @abc.abstractmethod
    def page_indices(self, lc: int) -> list[int]:
        """ACTIVE only.  gpu slot per block ordinal (-1 stale/absent); ssm: [live_slot]."""

    @abc.abstractmethod
    def page_indices_into(self, lc: int, out: Any) -> int:
        """Write :meth:`page_indices` into a caller's int32 buffer; returns the count.
        Raises ValueError (writing nothing) when the buffer is too small or not int32."""


class KVCacheManager(abc.ABC):
    """The manager.  ``KVCacheManager(config, backend=None)`` builds the chosen backend's
    implementation (``kvcm.backend`` when ``backend`` is None)."""

    backend_name: ClassVar[str] = ""

    def __new__(cls, config: KVCacheManagerConfig | None = None, *args: Any, backend: str | None = None, **kw: Any):
        if cls is KVCacheManager:
            from kvcm._select import manager_class
            from kvcm.oplog import maybe_wrap_class

            # KVCM_OPLOG set: a recording proxy whose __init__ builds the real manager
            impl = maybe_wrap_class(manager_class(backend))
            return impl.__new__(impl, config, *args, **kw)
        return super().__new__(cls)

    @property
    @abc.abstractmethod
    def config(self) -> KVCacheManagerConfig: ...

    @property
    @abc.abstractmethod
    def life_cycles(self) -> tuple[LifeCycle, ...]: ...

    @abc.abstractmethod
    def create_kv_cache(
        self,
        input_tokens: Sequence[Token] | None = None,
        scope: ReuseScope | None = None,
        priority: int | None = None,
        id: int | str | None = None,
    ) -> KVCache:
        """Match ``input_tokens`` once and return a SUSPENDED cache holding the reused pages."""

    @abc.abstractmethod
    def probe_reuse(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> int:
        """Reusable prefix length; no side effect at all."""

    @abc.abstractmethod
    def probe_reuse_detail(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> ReuseProbe:
        """Like :meth:`probe_reuse`, with the diagnostic ``num_tokens_before_ssm``."""

    @abc.abstractmethod
    def resize_batch(self, caches: Sequence[KVCache], capacities: Any, history_lengths: Any = None) -> list[bool]:
        """``[c.resize(cap, h) for c, cap, h in zip(caches, capacities, history_lengths)]``
        in one call: the decode step of a batch (``resize(capacity + 1)`` for each active
        request) without one Python -> backend crossing per request.

        Each item has exactly the effect and result of the single call, run in batch order
        (a ``False`` undoes only that cache's resize, as the single call does; each True
        ticks the clock once).  But every argument is checked up front, for the whole
        batch, before anything changes: a bad one anywhere raises and changes nothing.
        Checks, in this order (the first failure raises):

        1. ``caches``: a sequence (TypeError); item by item: a KVCache (TypeError) of this
           manager (ValueError), not one that appeared earlier in the batch (ValueError).
        2. ``capacities``: a list or tuple of ints, or an integer array (``array('i'/'q')``,
           numpy, CPU torch tensor; engines keep sequence lengths in arrays), each an int
           (not bool, TypeError) ``>= 0`` (ValueError); then its length must equal
           ``len(caches)`` (ValueError).
        3. ``history_lengths``: None keeps every cache's history; else as ``capacities``.
        4. Cache by cache, the single call's checks in its order: open (ClosedError),
           ACTIVE (InvalidStateError), ``committed <= history <= capacity`` and the history
           not decreasing (ValueError).

        Messages name the offending index (``caches[3]``, ``capacities[3]``)."""

    @abc.abstractmethod
    def commit_batch(self, caches: Sequence[KVCache], tokens: Any) -> None:
        """``c.commit([t])`` for each ``(c, t)`` of ``zip(caches, tokens)``, in batch order:
        one token per cache (the decode step), each item with exactly the effect of the
        single call.  Every argument is checked up front, before anything changes:

        1. ``caches`` as for :meth:`resize_batch`.
        2. ``tokens``: anything ``commit`` accepts (a list, ``array('i')``, numpy, torch;
           each token as in ``commit``: TypeError / ValueError), then its length must equal
           ``len(caches)`` (ValueError).
        3. Cache by cache, the single call's checks in its order: open (ClosedError),
           ACTIVE (InvalidStateError), not stopped (InvalidStateError), room for one more
           token within its capacity (ValueError)."""

    @abc.abstractmethod
    def drain_copy_ops(self) -> list[CopyOp]: ...

    @abc.abstractmethod
    def forget_copies(self, ops: Sequence[CopyOp]) -> list[int | str]:
        """Report copy ops of the last :meth:`drain_copy_ops` that did not complete
        (``CopyError.ops``; SPEC sec. 15, DECISIONS.md "Failed copies").

        The manager forgets exactly the pages those ops were meant to fill: a committed
        one is unlinked from its block (pruning and ``removed`` events as for a drop), and
        every open cache that uses one of them is rolled back: its pages are released, its
        committed tokens are cut to before the first lost block and matched again (as
        ``create_kv_cache`` does, so the ssm state restarts from a snapshot or from 0), and
        it becomes SUSPENDED with ``capacity = history_length = num_committed_tokens``; the
        engine resumes it and recomputes from there.  Returns the ids of the rolled-back
        caches in creation order.  Ticks the clock once when ``ops`` is not empty.

        Bad input raises and changes nothing: ``ops`` not a list/tuple of CopyOp
        (TypeError); an op that the last drain did not return, or one already reported
        (ValueError)."""

    @abc.abstractmethod
    def clear_reusable(self) -> None:
        """Drop every DROPPABLE page and prune the tree."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Requires every cache closed (InvalidStateError otherwise)."""

    @abc.abstractmethod
    def stats(self) -> dict: ...

    @abc.abstractmethod
    def take_iteration_stats(self) -> dict: ...

    @abc.abstractmethod
    def take_events(self) -> list[Event]: ...

    @abc.abstractmethod
    def snapshot(self) -> dict:
        """Canonical JSON-serialisable picture of all observable state (sec. 11)."""

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Raise InvariantError on any broken internal rule."""


__all__ = [
    "AttentionLayer",
    "ClearedEvent",
    "ClosedError",
    "ConfigError",
    "CopyError",
    "CopyOp",
    "Event",
    "InvalidStateError",
    "InvariantError",
    "KVCache",
    "KVCacheManager",
    "KVCacheManagerConfig",
    "KvcmError",
    "LifeCycle",
    "OutOfPagesError",
    "PendingCopyOpsWarning",
    "RemovedEvent",
    "ResolvedConfig",
    "ReuseProbe",
    "ReuseScope",
    "SsmLayer",
    "Status",
    "StoredBlock",
    "StoredEvent",
    "Tier",
    "TierChangedEvent",
    "resolve_config",
]
