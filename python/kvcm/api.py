"""The one interface of kvcm: configuration, value types, errors and the abstract manager.

Both backends (``python`` and ``cpp``) import everything here and nothing here is
duplicated per backend.  SPEC sections are cited as ``sec. N``.
"""

from __future__ import annotations

import abc
import enum
import math
import warnings
from collections.abc import Callable, Sequence
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
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if self.pool_ratio is not None:
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
    def ssm_lc(self) -> int | None:
        for lc in self.life_cycles:
            if lc.kind == "ssm":
                return lc.id
        return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def resolve_config(config: KVCacheManagerConfig) -> ResolvedConfig:
    """Validate ``config`` (sec. 2) and derive life cycles and pool sizes.

    The single validator both backends use; raises ConfigError naming the field."""
    if not isinstance(config, KVCacheManagerConfig):
        raise TypeError(f"config must be a KVCacheManagerConfig, got {type(config).__name__}")
    B = config.tokens_per_block
    if not _is_int(B) or not 1 <= B <= 4096:
        raise ConfigError("tokens_per_block", f"must be an int in 1..4096, got {B!r}")
    if not config.layers:
        raise ConfigError("layers", "at least one layer is required")
    seen_ids: set[int] = set()
    lc_keys: list[tuple] = []
    lc_bytes: list[int] = []
    lc_layers: list[list[int]] = []
    for layer in config.layers:
        if not isinstance(layer, (AttentionLayer, SsmLayer)):
            raise ConfigError("layers", f"unknown layer type {type(layer).__name__}")
        if not _is_int(layer.layer_id) or layer.layer_id < 0:
            raise ConfigError("layers.layer_id", f"must be a non-negative int, got {layer.layer_id!r}")
        if layer.layer_id in seen_ids:
            raise ConfigError("layers.layer_id", f"duplicate layer id {layer.layer_id}")
        seen_ids.add(layer.layer_id)
        if isinstance(layer, AttentionLayer):
            if not _is_int(layer.bytes_per_token) or layer.bytes_per_token < 1:
                raise ConfigError("layers.bytes_per_token", f"must be a positive int, got {layer.bytes_per_token!r}")
            if layer.window is not None and (not _is_int(layer.window) or layer.window < 1):
                raise ConfigError("layers.window", f"must be None or an int >= 1, got {layer.window!r}")
            if not _is_int(layer.sink_tokens) or layer.sink_tokens < 0:
                raise ConfigError("layers.sink_tokens", f"must be an int >= 0, got {layer.sink_tokens!r}")
            if layer.sink_tokens and layer.window is None:
                raise ConfigError("layers.sink_tokens", "sink tokens need a window")
            key: tuple = ("attn", layer.window, layer.sink_tokens if layer.window is not None else 0)
            per = layer.bytes_per_token * B
        else:
            if not _is_int(layer.state_bytes) or layer.state_bytes < 1:
                raise ConfigError("layers.state_bytes", f"must be a positive int, got {layer.state_bytes!r}")
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

    if not config.tiers:
        raise ConfigError("tiers", "a gpu tier is required")
    kinds: list[str] = []
    for tier in config.tiers:
        if not isinstance(tier, Tier):
            raise ConfigError("tiers", f"unknown tier type {type(tier).__name__}")
        if tier.kind not in TIER_KINDS:
            raise ConfigError("tiers.kind", f"unknown tier kind {tier.kind!r}; choices: gpu, host, disk")
        if not _is_int(tier.quota_bytes) or tier.quota_bytes < 0:
            raise ConfigError("tiers.quota_bytes", f"must be a non-negative int, got {tier.quota_bytes!r}")
        if tier.kind == "disk" and not tier.path:
            raise ConfigError("tiers.path", "a disk tier needs a path")
        kinds.append(tier.kind)
    if "gpu" not in kinds:
        raise ConfigError("tiers", "a gpu tier is required")
    for k in TIER_KINDS:
        if kinds.count(k) > 1:
            raise ConfigError("tiers", f"at most one {k} tier")
    if kinds != sorted(kinds, key=TIER_KINDS.index) or kinds[0] != "gpu":
        raise ConfigError("tiers", "tiers must be listed warm to cold: gpu, host, disk")

    ratio = config.pool_ratio
    if ratio is not None:
        if set(ratio) != {lc.id for lc in life_cycles}:
            raise ConfigError("pool_ratio", f"must give a weight for every life cycle id {[lc.id for lc in life_cycles]}")
        for w in ratio.values():
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w <= 0:
                raise ConfigError("pool_ratio", f"weights must be positive finite numbers, got {w!r}")
    slots: list[tuple[int, ...]] = []
    for tier in config.tiers:
        if ratio is None:
            n = tier.quota_bytes // sum(lc.slot_bytes for lc in life_cycles)
            per_lc = tuple(n for _ in life_cycles)
        else:
            total_w = float(sum(ratio.values()))
            per_lc = tuple(
                math.floor(tier.quota_bytes * float(ratio[lc.id]) / total_w / lc.slot_bytes) for lc in life_cycles
            )
        if min(per_lc) < 1:
            raise ConfigError("tiers.quota_bytes", f"{tier.kind} quota {tier.quota_bytes} is too small for one slot per life cycle")
        slots.append(per_lc)

    if not isinstance(config.enable_partial_reuse, bool):
        raise ConfigError("enable_partial_reuse", "must be a bool")
    if not _is_int(config.reuse_match_backoff) or config.reuse_match_backoff < 0:
        raise ConfigError("reuse_match_backoff", f"must be an int >= 0, got {config.reuse_match_backoff!r}")
    mu = config.max_util_for_resume
    if not isinstance(mu, (int, float)) or isinstance(mu, bool) or not 0.0 < float(mu) <= 1.0:
        raise ConfigError("max_util_for_resume", f"must be in (0, 1], got {mu!r}")
    if not _is_int(config.default_priority) or not 0 <= config.default_priority <= 100:
        raise ConfigError("default_priority", f"must be an int in 0..100, got {config.default_priority!r}")
    if not _is_int(config.max_events) or config.max_events < 0:
        raise ConfigError("max_events", f"must be an int >= 0, got {config.max_events!r}")
    w = config.pending_copy_ops_warning
    if not _is_int(w) or not 0 <= w < 2**63:
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
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v < 2**64):
                raise ValueError(f"ReuseScope.{name} must be None or an int in [0, 2**64), got {v!r}")


class Status(enum.Enum):
    SUSPENDED = "SUSPENDED"
    ACTIVE = "ACTIVE"
    CLOSED = "CLOSED"


CopyReason = Literal["offload", "onboard", "cow", "snapshot"]


@dataclass(frozen=True)
class CopyOp:
    """Copy one page: the engine executes these in order before using the step's indices."""

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


def check_tokens(tokens: Any, name: str = "tokens") -> list[Token]:
    """Normalise a token sequence to a list; TypeError/ValueError on a bad token."""
    if tokens is None:
        return []
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be a sequence of tokens, got {type(tokens).__name__}")
    if hasattr(tokens, "tolist") and not isinstance(tokens, list):
        tokens = tokens.tolist()  # numpy / torch / array('i'): one C-level conversion
    try:
        out = list(tokens)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of tokens, got {type(tokens).__name__}") from None
    if not out:
        return out
    types = set(map(type, out))
    if types == {int}:  # the common case, checked at C speed
        if min(out) < 0 or max(out) >= MAX_TOKEN:
            bad = next(t for t in out if not 0 <= t < MAX_TOKEN)
            raise ValueError(f"{name}: token {bad} out of range [0, 2**31)")
        return out
    for i, t in enumerate(out):
        if type(t) is bytes:
            if len(t) != DIGEST_TOKEN_BYTES:
                raise ValueError(f"{name}: a digest token must be 32 bytes, got {len(t)}")
        elif isinstance(t, int) and not isinstance(t, bool):
            if not 0 <= t < MAX_TOKEN:
                raise ValueError(f"{name}: token {int(t)} out of range [0, 2**31)")
            out[i] = int(t)
        else:
            raise TypeError(f"{name}: a token must be an int or 32 bytes, got {type(t).__name__}")
    return out


def check_scope(scope: Any) -> ReuseScope:
    if scope is None:
        return ReuseScope()
    if not isinstance(scope, ReuseScope):
        raise TypeError(f"scope must be a ReuseScope or None, got {type(scope).__name__}")
    return scope


def check_priority(priority: Any, default: int) -> int:
    if priority is None:
        return default
    if not _is_int(priority):
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")
    if not 0 <= priority <= 100:
        raise ValueError(f"priority must be in 0..100, got {priority}")
    return priority


def check_count(value: Any, name: str) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


MAX_COUNT = 2**63  # counts the C++ core can hold (int64); larger ones are "too large"


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
    for i, v in enumerate(items):
        if not _is_int(v):
            raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
        if v >= MAX_COUNT:
            raise ValueError(f"{name}[{i}] {v} is too large")
    if len(items) != n:
        raise ValueError(f"{what}(): {name} has {len(items)} items for {n} caches")
    return list(items)


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
