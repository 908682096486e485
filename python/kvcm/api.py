"""The one interface of kvcm: value types, errors and the abstract classes.

This module imports nothing of kvcm (an import contract in pyproject.toml): it is the
bottom layer every other module builds on.  Above it, ``kvcm.config`` resolves a config,
``kvcm.checks`` holds the argument checks and ``kvcm.construct`` builds a backend for
``KVCacheManager(...)``.  Both backends
(``python`` and ``cpp``) implement the abstract classes here; nothing here is duplicated
per backend.  SPEC sections are cited as ``sec. N``.
"""

from __future__ import annotations

import abc
import array
import enum
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

# ---------------------------------------------------------------------------------------
# Errors (sec. 10).  ValueError / TypeError are used for bad arguments, as documented.
# ---------------------------------------------------------------------------------------


class KvcmError(Exception):
    """Base of every kvcm-specific error (SPEC sec. 10).  Bad arguments raise the built-in
    ``ValueError`` / ``TypeError`` instead (``ConfigError`` is both), and every error a
    public call raises leaves the manager exactly as it was before the call."""


class ConfigError(KvcmError, ValueError):
    """Invalid configuration (SPEC sec. 2): raised by ``KVCacheManager(config)`` for the
    first problem the one shared validator finds.

    Attributes:
        field: the offending config field, dotted for a layer's or tier's part
            (``"tokens_per_block"``, ``"layers.window"``, ``"tiers.quota_bytes"``); the
            message starts with it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class ClosedError(KvcmError):
    """A call on a closed KVCache (other than ``close()``, which is idempotent, and the
    properties, which keep answering), or a batch that names a closed cache (SPEC sec. 7)."""


class InvalidStateError(KvcmError):
    """A call made in the wrong status (SPEC sec. 7, 10): e.g. ``commit`` on a SUSPENDED
    cache, ``resume`` on an ACTIVE one, ``commit`` after ``stop_committing``, ``shutdown``
    with caches open, or a state-changing call on a shut-down manager."""


class OutOfPagesError(KvcmError):
    """No slot could be found even after eviction (SPEC sec. 8).  Public calls documented
    to return a bool (``resume``, ``resize``) return False instead of raising it;
    ``fork`` and ``set_quota`` raise it, changing nothing."""


class InvariantError(KvcmError):
    """``check_invariants()`` found a broken internal rule (SPEC sec. 11; always a kvcm
    bug).  The message names the rule and the page, node or request that breaks it."""


class CopyError(KvcmError):
    """Some copy ops did not complete (sec. 15): raised by ``DataPlane.apply``.

    ``ops`` lists, in their order in the applied list, every op whose destination bytes
    cannot be trusted: the op(s) that failed and every op after them that was not executed.
    ``cause`` is the first underlying exception (an ``OSError`` for a disk I/O failure, a
    short read or a checksum mismatch).  Report ``ops`` to the manager with
    :meth:`KVCacheManager.forget_copies`, then recompute what it rolled back.

    Attributes:
        ops: the copy ops whose destination cannot be trusted, in list order.
        cause: the first underlying exception, or None."""

    def __init__(self, message: str, ops: Sequence[CopyOp] = (), cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.ops: list[CopyOp] = list(ops)
        self.cause = cause


class PendingCopyOpsWarning(RuntimeWarning):
    """Issued once per manager when undrained copy ops reach
    ``KVCacheManagerConfig.pending_copy_ops_warning`` (the engine forgot ``drain_copy_ops()``;
    SPEC sec. 15); with ``copy_settlement="explicit"`` the ops of the unsettled drains count
    too (the engine forgot ``settle_copies()``).  The call that crossed the threshold has
    taken effect."""


def warn_pending_copy_ops(pending: int, explicit: bool = False) -> None:
    """The one-time warning of both backends (issued after the call that crossed the
    threshold; ``explicit``: the manager settles copies explicitly, so unsettled ops count)."""
    if explicit:
        text = (f"kvcm: {pending} copy ops are pending or unsettled: call drain_copy_ops() and execute them "
                f"every step, and settle_copies() once per drain, oldest first (stats()['pending_copy_ops'] "
                f"and KVCacheManager.unsettled_drains show the figures; "
                f"KVCacheManagerConfig.pending_copy_ops_warning sets this threshold)")
    else:
        text = (f"kvcm: {pending} copy ops are pending: call drain_copy_ops() and execute them every step "
                f"(stats()['pending_copy_ops'] shows the figure; KVCacheManagerConfig.pending_copy_ops_warning "
                f"sets this threshold)")
    warnings.warn(text, PendingCopyOpsWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------
# Configuration (sec. 2)
# ---------------------------------------------------------------------------------------

TierKind = Literal["gpu", "host", "disk", "shared"]
# a tier kind's position here is its SPEC tier number: gpu 0, host 1, disk 2, shared 3
TIER_KINDS: tuple[str, ...] = ("gpu", "host", "disk", "shared")
GPU, HOST, DISK = 0, 1, 2
SHARED_WRITE_POLICIES: tuple[str, ...] = ("commit", "evict")  # KVCacheManagerConfig.shared_write
COPY_SETTLEMENTS: tuple[str, ...] = ("drain", "explicit")  # KVCacheManagerConfig.copy_settlement

MAX_TOKEN = 2**31
DIGEST_TOKEN_BYTES = 32
Token = int | bytes


@dataclass(frozen=True)
class AttentionLayer:
    """An attention layer of the model (SPEC sec. 1, 2).  Layers with the same ``window``
    and ``sink_tokens`` share one life cycle (their pages live and die together).

    Attributes:
        layer_id: the layer's id, an int in ``[0, 2**63)``, unique among the config's layers.
        bytes_per_token: the bytes one token occupies in this layer's KV cache (K and V
            together); a page of the life cycle holds ``B`` tokens of each of its layers.
        window: None for full attention, else the sliding window in tokens (>= 1): blocks
            that end before the window are stale and their pages are released (sec. 7).
        sink_tokens: with a window, the leading tokens that always stay attended (their
            blocks are never stale); 0 without a window."""

    layer_id: int
    bytes_per_token: int
    window: int | None = None
    sink_tokens: int = 0


@dataclass(frozen=True)
class SsmLayer:
    """A state-space (Mamba-style) layer (SPEC sec. 1, 2).  All ssm layers form one life
    cycle; a request keeps one live state slot, and commits that end on a block boundary
    leave a snapshot of it in the tree (sec. 7).

    Attributes:
        layer_id: the layer's id, an int in ``[0, 2**63)``, unique among the config's layers.
        state_bytes: the bytes of this layer's recurrent state (one snapshot)."""

    layer_id: int
    state_bytes: int


Layer = AttentionLayer | SsmLayer


@dataclass(frozen=True)
class Tier:
    """A memory tier (SPEC sec. 1, 2).  ``KVCacheManagerConfig.tiers`` lists them warm to
    cold: exactly one ``gpu`` first, then at most one each of ``host``, ``disk``, ``shared``.

    Attributes:
        kind: ``"gpu"``, ``"host"``, ``"disk"`` or ``"shared"`` (tier numbers 0, 1, 2, 3 by
            kind, whatever else is configured).
        quota_bytes: the tier's bytes, an int in ``[0, 2**63)``, split among life cycles
            by ``pool_ratio``; each life cycle needs at least one slot.  A shared tier's quota
            is the data plane's (its store's cap), not the manager's.
        path: a ``disk`` tier's directory (required), or a ``shared`` tier's store location
            (a directory, ``file://...`` or ``mooncake://...``); None for gpu and host."""

    kind: str
    quota_bytes: int
    path: str | None = None


@dataclass(frozen=True)
class KVCacheManagerConfig:
    """Everything a manager is built from (SPEC sec. 2): block size, model layers, memory
    tiers and policies.  Frozen (``layers`` and ``tiers`` are stored as tuples); both
    backends read it as is.  Checked when a manager is built: the first bad field raises
    :class:`ConfigError` naming it.

    Attributes:
        tokens_per_block: ``B``, the tokens of one block, an int in 1..4096.  Required.
            The unit of the radix tree, of page indices and of matching (SPEC sec. 1, 3).
        layers: the model's layers, a list of :class:`AttentionLayer` and :class:`SsmLayer`
            with unique ids.  Required.  Grouped into life cycles, numbered in order of
            first appearance (SPEC sec. 1, 2).
        tiers: the memory tiers, a list of :class:`Tier` warm to cold, one ``gpu`` first.
            Required (SPEC sec. 2, 8).
        pool_ratio: how each tier's ``quota_bytes`` is split among life cycles: a dict of a
            positive weight per life cycle id, or None for the same slot count for every
            life cycle.  Default None (SPEC sec. 2).
        enable_partial_reuse: whether a match may end inside a block and a request's
            partial tail enters the tree at ``stop_committing`` / ``close``.  Default True
            (SPEC sec. 6, 7).
        reuse_match_backoff: tokens taken off every match before its pruning, an int >= 0.
            Default 0 (SPEC sec. 6).
        max_util_for_resume: a number in (0, 1]: ``resume`` fails (returns False) when the
            LOCKED share of a gpu pool would exceed it.  Default 1.0 (SPEC sec. 7).
        default_priority: the priority, 0..100, of a request created without one; pages of
            lower priority are evicted first.  Default 50 (SPEC sec. 4, 8).
        max_events: how many events the buffer keeps (oldest dropped first and counted in
            ``stats()["events_dropped"]``); 0 keeps none.  Default 10_000 (SPEC sec. 9).
        pending_copy_ops_warning: issue :class:`PendingCopyOpsWarning` once when this many
            copy ops are undrained; 0 never warns.  Default 1_000_000 (SPEC sec. 15).
        shared_write: when pages are written to a shared tier: ``"commit"`` (write-through,
            as a full block is committed) or ``"evict"`` (write-back, as eviction drops it
            from the coldest local tier).  Default ``"commit"`` (SPEC sec. 16).
        shared_namespace: the model / namespace string of the shared tier's layout
            fingerprint, at most 256 bytes UTF-8; required (non-empty) with a shared tier,
            so that same-shaped models never read each other's pages.  Default ``""``
            (SPEC sec. 16).
        shared_secret_file: a file holding the secret that authenticates shared-tier
            objects, read by the data plane only (the config holds the path, never the
            secret); ``""`` uses the environment's.  Default ``""`` (SPEC sec. 16).
        copy_settlement: how the outcome of drained copy ops comes back: ``"drain"`` (the
            ops of the last drain may be reported failed with
            :meth:`KVCacheManager.forget_copies`; the next drain settles them) or
            ``"explicit"`` (each drain that returned ops stays unsettled until
            :meth:`KVCacheManager.settle_copies` settles it, oldest first: for engines
            whose copies complete several drains later).  Default ``"drain"`` (SPEC sec. 15)."""

    tokens_per_block: int
    layers: Sequence[Layer]
    tiers: Sequence[Tier]
    pool_ratio: dict[int, float] | None = None
    enable_partial_reuse: bool = True
    reuse_match_backoff: int = 0
    max_util_for_resume: float = 1.0
    default_priority: int = 50
    max_events: int = 10_000
    pending_copy_ops_warning: int = 1_000_000
    # the shared tier's fields: DECISIONS.md "The shared tier" (the secret's default source
    # is kvcm.dataplane.store.store_secret)
    shared_write: str = "commit"
    shared_namespace: str = ""
    shared_secret_file: str = ""
    # DECISIONS.md "Asynchronous copies: settle_copies" (last: positional construction
    # of the fields above is unchanged)
    copy_settlement: str = "drain"

    def __post_init__(self) -> None:
        # Freeze the sequences so the config is hashable-in-spirit and cannot change later.
        # (anything that is no list of layers / tiers is left for resolve_config's ConfigError)
        for name in ("layers", "tiers"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.pool_ratio, Mapping):  # anything else is resolve_config's ConfigError
            object.__setattr__(self, "pool_ratio", dict(self.pool_ratio))


# An int argument is read by its value (here because ReuseScope checks its fields with it;
# kvcm.checks uses it for every other argument).
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


# ---------------------------------------------------------------------------------------
# Value types
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReuseScope:
    """The reuse scope of a request (SPEC sec. 3): requests share blocks only within one
    scope, because its fields enter the root of every block key.  ``ReuseScope()`` is the
    default scope; a field None and a field 0 are different scopes.

    Attributes:
        lora_id: the LoRA adapter the request runs with, or None; an int in ``[0, 2**64)``.
        salt: any further separation (a tenant, a cache salt), or None; an int in
            ``[0, 2**64)``."""

    lora_id: int | None = None
    salt: int | None = None

    def __post_init__(self) -> None:
        for name in ("lora_id", "salt"):
            scope_field(name, getattr(self, name))


def scope_field(name: str, v: Any) -> int | None:
    """A ReuseScope field: None or an int (by value) in [0, 2**64)."""
    if v is None:
        return None
    value = as_int(v)
    if value is None or not 0 <= value < 2**64:
        raise ValueError(f"ReuseScope.{name} must be None or an int in [0, 2**64), got {v!r}")
    return value


class Status(enum.Enum):
    """A request's status (SPEC sec. 7): ``SUSPENDED`` (its pages HELD, may be offloaded;
    what ``create_kv_cache`` returns), ``ACTIVE`` (its pages LOCKED on gpu; after a
    successful ``resume``) or ``CLOSED`` (after ``close``; only the properties answer)."""

    SUSPENDED = "SUSPENDED"
    ACTIVE = "ACTIVE"
    CLOSED = "CLOSED"


CopyReason = Literal["offload", "onboard", "cow", "snapshot", "store", "relocate"]

SHARED = 3  # tier number of the shared tier (a store shared by many managers; DECISIONS.md)


@dataclass(frozen=True, slots=True)  # slots: the cpp backend fills them directly (one op per evicted page)
class CopyOp:
    """Copy one page: the engine executes these in order before using the step's indices.
    Tiers are SPEC's numbers by kind (``GPU, HOST, DISK = 0, 1, 2``), whatever tiers the
    config lists: with gpu + disk only, disk is still 2.

    An op that touches the shared tier (``SHARED``, 3) names its object there by ``key``
    (the block key; with ``lc`` and the layout fingerprint it names the stored object) and
    has slot -1 on that side; every other op has ``key`` None.  (SPEC sec. 8.)

    Attributes:
        lc: the life cycle id (which pool of each tier).
        src_tier: the tier number the page is copied from.
        src_slot: the slot in that tier's pool of ``lc`` (-1 on the shared tier).
        dst_tier: the tier number the page is copied to.
        dst_slot: the slot in that tier's pool of ``lc`` (-1 on the shared tier).
        reason: ``"offload"`` (one tier colder), ``"onboard"`` (to gpu), ``"cow"``
            (copy-on-write of a shared or matched page), ``"snapshot"`` (an ssm snapshot),
            ``"store"`` (to the shared tier) or ``"relocate"`` (out of a slot a quota shrink
            removes).
        key: the 32-byte block key of an op on the shared tier, else None."""

    lc: int
    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    reason: str
    key: bytes | None = None

    def to_json(self) -> list:
        """The op as a JSON row ``[lc, src_tier, src_slot, dst_tier, dst_slot, reason]``,
        with the key's hex appended when it has one (op logs, snapshots)."""
        row: list = [self.lc, self.src_tier, self.src_slot, self.dst_tier, self.dst_slot, self.reason]
        if self.key is not None:
            row.append(self.key.hex())
        return row


@dataclass(frozen=True, slots=True)
class CopyRun:
    """A run of a drain's copy ops in column form (:meth:`KVCacheManager.drain_copy_runs`):
    consecutive ops with one ``lc``, ``src_tier``, ``dst_tier`` and ``reason``, op ``i``
    copying ``src_slots[i]`` to ``dst_slots[i]`` (``array('q')``, int64) (``keys[i]`` names its object on the
    shared tier; ``keys`` is None when the run's tiers do not include it).  The ops of a run
    commute: no location (a slot of the run's pool on either side, a key on the shared
    tier) is written twice or both written and read, so one batched copy per run, runs in
    order, does what the ops in order do (DECISIONS.md "Copy runs").  ``len(run)`` is its
    op count.

    Attributes:
        lc: the life cycle id of every op of the run.
        src_tier: the tier number every op copies from.
        dst_tier: the tier number every op copies to.
        reason: the reason of every op (as :attr:`CopyOp.reason`).
        src_slots: the source slot of each op, ``array('q')``.
        dst_slots: the destination slot of each op, ``array('q')``.
        keys: the block key of each op when a tier of the run is the shared tier, else None."""

    lc: int
    src_tier: int
    dst_tier: int
    reason: str
    src_slots: array.array  # typecode "q" (int64): a buffer an engine hands to torch as is
    dst_slots: array.array
    keys: list[bytes] | None = None

    def __len__(self) -> int:
        """The number of ops in the run."""
        return len(self.src_slots)

    def ops(self) -> list[CopyOp]:
        """The run's ops as CopyOps, in order (e.g. for ``forget_copies``)."""
        keys = self.keys if self.keys is not None else [None] * len(self.src_slots)
        return [CopyOp(self.lc, self.src_tier, s, self.dst_tier, d, self.reason, k)
                for s, d, k in zip(self.src_slots, self.dst_slots, keys)]

    def to_json(self) -> list:
        """The run as a JSON row ``[lc, src_tier, dst_tier, reason, src_slots, dst_slots]``,
        with the keys' hexes appended when it has keys (op logs)."""
        row: list = [self.lc, self.src_tier, self.dst_tier, self.reason, self.src_slots.tolist(),
                     self.dst_slots.tolist()]
        if self.keys is not None:
            row.append([k.hex() for k in self.keys])
        return row


def copy_runs(ops: Sequence[CopyOp]) -> list[CopyRun]:
    """``ops`` (one drain, in order) as maximal runs (the rule of :class:`CopyRun`): an op
    joins the current run when it has the run's lc, tiers and reason and touches no
    location the run wrote, nor writes one it read; otherwise it starts the next run.
    A location is (tier, slot), or (SHARED, key) on the shared tier."""
    runs: list[CopyRun] = []
    head: tuple | None = None
    written: set = set()
    read: set = set()
    for op in ops:
        src = (op.src_tier, op.key) if op.src_tier == SHARED else (op.src_tier, op.src_slot)
        dst = (op.dst_tier, op.key) if op.dst_tier == SHARED else (op.dst_tier, op.dst_slot)
        if (head != (op.lc, op.src_tier, op.dst_tier, op.reason) or src in written or dst in written
                or dst in read):
            head = (op.lc, op.src_tier, op.dst_tier, op.reason)
            written, read = set(), set()
            on_shared = SHARED in (op.src_tier, op.dst_tier)
            runs.append(CopyRun(op.lc, op.src_tier, op.dst_tier, op.reason, array.array("q"), array.array("q"),
                                [] if on_shared else None))
        run = runs[-1]
        run.src_slots.append(op.src_slot)
        run.dst_slots.append(op.dst_slot)
        if run.keys is not None:
            run.keys.append(op.key)
        written.add(dst)
        read.add(src)
    return runs


@dataclass(frozen=True)
class StoredBlock:
    """One block of a :class:`StoredEvent` (SPEC sec. 9): the block gained its first page of
    life cycle ``lc``.

    Attributes:
        key: the block key (SPEC sec. 3), 32 bytes.
        num_tokens: the block's token count (``B``, or fewer for a partial block).
        tokens: the block's tokens.
        lc: the life cycle whose page the block gained.
        tier: the tier number the page is on.
        priority: the page's priority (0..100).
        coverage: the tokens of the block the page covers (ssm: the snapshot's exact end)."""

    key: bytes
    num_tokens: int
    tokens: tuple[Token, ...]
    lc: int
    tier: int
    priority: int
    coverage: int  # tokens of the block this lc's page covers (ssm: the snapshot's exact end)


@dataclass(frozen=True)
class Event:
    """Base of the KV events ``KVCacheManager.take_events()`` returns (SPEC sec. 9).

    Attributes:
        event_id: the event's number; ids only grow, one per event emitted (dropped ones
            included), so a gap shows events lost to ``max_events``.
        kind: ``"stored"``, ``"removed"``, ``"tier_changed"`` or ``"cleared"`` (a class
            constant)."""

    event_id: int
    kind: ClassVar[str] = ""

    def to_json(self) -> dict:
        """The event as a JSON object (``event_id``, ``kind`` and its fields; bytes as hex)."""
        raise NotImplementedError


def _tok_json(t: Token) -> int | str:
    return t if isinstance(t, int) else t.hex()


@dataclass(frozen=True)
class StoredEvent(Event):
    """Blocks gained their first page of a life cycle (SPEC sec. 9): committed, re-attached,
    or taken from the shared tier.

    Attributes:
        parent_key: the key of the block's parent (the scope's root key, sec. 3, for a
            block at ordinal 0); None for a block without a parent.
        blocks: one :class:`StoredBlock` row per life cycle the block gained a page of.
        partial: True for a partial block (announced only this way)."""

    parent_key: bytes | None = None
    blocks: tuple[StoredBlock, ...] = ()
    partial: bool = False
    kind: ClassVar[str] = "stored"

    def to_json(self) -> dict:
        """The event as a JSON object, keys in this order::

            {"event_id": int, "kind": "stored", "parent_key": hex str | null, "partial": bool,
             "blocks": [[key hex str, num_tokens int, tokens [int | hex str, ...], lc int,
                         tier int, priority int, coverage int], ...]}

        one ``blocks`` row per :class:`StoredBlock`, its fields in declaration order; a token
        is its int, or its digest's hex (a digest token, SPEC sec. 3)."""
        return {
            "event_id": self.event_id,
            "kind": self.kind,
            "parent_key": self.parent_key.hex() if self.parent_key is not None else None,
            "partial": self.partial,
            "blocks": [
                [b.key.hex(), b.num_tokens, [_tok_json(t) for t in b.tokens], b.lc, b.tier, b.priority, b.coverage]
                for b in self.blocks
            ],
        }


@dataclass(frozen=True)
class RemovedEvent(Event):
    """Blocks lost their last page of life cycle ``lc``, or were detached from the tree
    with one (SPEC sec. 5, 9).  Mirrors :class:`StoredEvent` per ``(key, lc)``.

    Attributes:
        keys: the block keys.
        lc: the life cycle."""

    keys: tuple[bytes, ...] = ()
    lc: int = 0
    kind: ClassVar[str] = "removed"

    def to_json(self) -> dict:
        """The event as a JSON object, keys in this order::

            {"event_id": int, "kind": "removed", "keys": [hex str, ...], "lc": int}"""
        return {"event_id": self.event_id, "kind": self.kind, "keys": [k.hex() for k in self.keys], "lc": self.lc}


@dataclass(frozen=True)
class TierChangedEvent(Event):
    """A page of an attached block moved between tiers (offload, onboard; SPEC sec. 8, 9).

    Attributes:
        key: the block key.
        lc: the page's life cycle.
        old_tier: the tier number it left.
        new_tier: the tier number it is on now."""

    key: bytes = b""
    lc: int = 0
    old_tier: int = 0
    new_tier: int = 0
    kind: ClassVar[str] = "tier_changed"

    def to_json(self) -> dict:
        """The event as a JSON object, keys in this order::

            {"event_id": int, "kind": "tier_changed", "key": hex str, "lc": int,
             "old_tier": int, "new_tier": int}

        tiers by SPEC tier number (gpu 0, host 1, disk 2, shared 3)."""
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
    """``clear_reusable()`` dropped every unused page (after the ``removed`` events of what
    it dropped; SPEC sec. 8, 9)."""

    kind: ClassVar[str] = "cleared"

    def to_json(self) -> dict:
        """The event as a JSON object: ``{"event_id": int, "kind": "cleared"}``."""
        return {"event_id": self.event_id, "kind": self.kind}


@dataclass(frozen=True)
class ReuseProbe:
    """Side-effect-free match result of ``probe_reuse_detail`` (SPEC sec. 6): what a
    request created now (``create_kv_cache`` with the same tokens, scope and shared hits)
    would match, and where the pages it would hold live.

    Attributes:
        num_tokens: ``m``, the reusable prefix length (what ``probe_reuse`` returns): the
            ``num_committed_tokens`` of a request created now.
        num_tokens_before_ssm: the same fixed point without the ssm rule, over the same
            blocks (the tree path, extended by the shared tier's blocks when those made
            ``m``): a diagnostic that tells "the ssm snapshot was evicted" (it is larger)
            from "attention was evicted".
        block_tiers: one entry per full block of the match (``num_tokens //
            tokens_per_block``, in block order): the coldest tier number (gpu 0, host 1,
            disk 2, shared 3; SPEC sec. 1) among the pages a request created now would hold
            for that block, every life cycle (a stale windowed block's page is not held;
            the ssm snapshot only at the match end), or -1 when it would hold none.  All
            entries 0 or -1: ``resume`` onboards nothing for them; a block matched through
            a shared hit is 3.  Default ``()``."""

    num_tokens: int
    num_tokens_before_ssm: int
    block_tiers: tuple[int, ...] = ()


# ---------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------


def _contract_docs(cls: type, interface: type) -> None:
    """Make ``help()`` on a backend's class read the interface's contract.

    An override without a docstring inherits the interface's (``inspect.getdoc``).  One
    with a docstring of its own (how that backend does it) would hide the contract, so its
    docstring becomes the contract followed by the backend's text as an implementation
    note.  The class docstring likewise (pydoc does not inherit a class's docstring).
    Runs once per subclass, at class creation (``__init_subclass__``)."""
    own_class_doc = cls.__dict__.get("__doc__")
    if not own_class_doc:
        cls.__doc__ = inspect.getdoc(interface)
    elif not inspect.cleandoc(own_class_doc).startswith(inspect.getdoc(interface) or ""):
        cls.__doc__ = f"{inspect.getdoc(interface)}\n\nImplementation note ({cls.__qualname__}): {inspect.cleandoc(own_class_doc)}"
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        contract = interface.__dict__.get(name)
        contract_doc = inspect.getdoc(contract) if contract is not None else None
        own = member.__doc__ if isinstance(member, property) or inspect.isfunction(member) else None
        if not contract_doc or not own or inspect.cleandoc(own).startswith(contract_doc):
            continue
        note = f"{contract_doc}\n\nImplementation note ({cls.__qualname__}): {inspect.cleandoc(own)}"
        member.__doc__ = note


class KVCache(abc.ABC):
    """One request's KV cache: its blocks, its pages and its place in the radix tree
    (SPEC sec. 7).  Made by :meth:`KVCacheManager.create_kv_cache` (or :meth:`fork`),
    never directly.

    Status machine::

        create_kv_cache -> SUSPENDED --resume()--> ACTIVE --suspend()--> SUSPENDED
        any status --close()--> CLOSED     (fork() makes an ACTIVE cache; a forget_copies
                                            roll-back makes a cache SUSPENDED)

    A step of an engine (SPEC sec. 14)::

        kv.resume()                         # SUSPENDED -> ACTIVE; False: no room now
        kv.resize(kv.num_committed_tokens + n)
        plane.apply(mgr.drain_copy_ops())   # before using the indices
        idx = kv.page_indices(lc)           # where to write / read K/V
        kv.commit(new_tokens)               # full blocks become reusable
        kv.close()                          # when the request ends

    Invariant: ``num_committed_tokens <= history_length <= capacity``.  A failed call
    (an exception, or False) changes nothing.  Every call but :meth:`close` and the
    properties raises :class:`ClosedError` on a closed cache."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        _contract_docs(cls, KVCache)

    @property
    @abc.abstractmethod
    def id(self) -> int | str:
        """The cache's id: the one given to ``create_kv_cache`` / ``fork``, else its
        creation serial (or the next integer no open cache holds).  Unique among open caches."""

    @property
    @abc.abstractmethod
    def status(self) -> Status:
        """The current :class:`Status`: SUSPENDED, ACTIVE or CLOSED."""

    @property
    @abc.abstractmethod
    def capacity(self) -> int:
        """Tokens the request has room for: the pages of blocks ``[0, ceil(capacity / B))``
        (set by :meth:`resize`; ``m`` after create)."""

    @property
    @abc.abstractmethod
    def history_length(self) -> int:
        """Tokens whose K/V the engine has (or is writing): decides which windowed blocks
        are stale (SPEC sec. 7).  Raised by :meth:`resize` and :meth:`commit`; never lowered."""

    @property
    @abc.abstractmethod
    def num_committed_tokens(self) -> int:
        """How many tokens are committed (matched at create, or given to :meth:`commit`)."""

    @property
    @abc.abstractmethod
    def committed_tokens(self) -> list[Token]:
        """The committed tokens, a new list."""

    @property
    @abc.abstractmethod
    def num_reused_tokens(self) -> int:
        """Tokens reused from the cache at create (the match length ``m``, SPEC sec. 6)."""

    @property
    @abc.abstractmethod
    def priority(self) -> int:
        """The request's priority, 0..100 (``default_priority`` when none was given); its
        pages are evicted after those of lower priority (SPEC sec. 4, 8)."""

    @abc.abstractmethod
    def resume(self) -> bool:
        """SUSPENDED → ACTIVE: make every page the request uses LOCKED on gpu (SPEC sec. 7).

        Locks the pages already on gpu, onboards the others (copy ops), allocates the live
        ssm state and, on the first resume after a match that ends inside a block or at an
        ssm snapshot, copies that page into a private one (``cow`` op).  Evicts other pages
        as needed.  Drain the copy ops before using :meth:`page_indices`.

        Returns:
            True when resumed; False when the gpu pools cannot take the pages even after
            eviction, or the LOCKED share of a gpu pool would exceed
            ``max_util_for_resume``: nothing changed, the cache stays SUSPENDED.
        Raises:
            InvalidStateError: the cache is not SUSPENDED.
            ClosedError: the cache is closed."""

    @abc.abstractmethod
    def suspend(self) -> None:
        """ACTIVE → SUSPENDED: its LOCKED pages become HELD (SPEC sec. 7); eviction may then
        offload them to a colder tier but never drops them.  Use it to preempt a request.

        Raises:
            InvalidStateError: the cache is not ACTIVE.
            ClosedError: the cache is closed."""

    @abc.abstractmethod
    def resize(self, capacity: int, history_length: int | None = None) -> bool:
        """Make room for ``capacity`` tokens (SPEC sec. 7); ACTIVE only.

        Allocates gpu pages for new blocks that are not stale, frees the pages of blocks
        past a smaller capacity, and releases committed pages of windowed blocks that
        became stale at the new history (they stay in the tree).  Evicts as needed; drain
        the copy ops before using :meth:`page_indices`.  The decode step is
        ``resize(capacity + 1)``; :meth:`KVCacheManager.resize_batch` does it for a batch.

        Args:
            capacity: tokens to have room for, ``>= history_length``.
            history_length: the new history (None: unchanged); ``num_committed_tokens <=
                history_length <= capacity``, and it never decreases.
        Returns:
            True when resized; False when the gpu pool cannot hold the pages even after
            eviction (nothing changed).
        Raises:
            ValueError / TypeError: a bad count (negative, not an int, above ``2**63``) or
                broken invariant.
            InvalidStateError: the cache is not ACTIVE.
            ClosedError: the cache is closed."""

    @abc.abstractmethod
    def commit(self, tokens: Sequence[Token]) -> None:
        """Append ``tokens`` whose K/V the engine has written (SPEC sec. 7); ACTIVE only.

        Raises ``history_length`` to at least the new committed count.  Every block that
        becomes full enters the radix tree (``stored`` events) and is reusable by later
        requests; where the tree has an equal block already, the cache may switch to its
        gpu page (its page index for that block changes).  When the model has ssm layers
        and the commit ends on a block boundary, the live state is snapshotted there (a
        ``snapshot`` copy op): choose commit chunks by where snapshots should be.  ``[]``
        is a no-op.  :meth:`KVCacheManager.commit_batch` commits one token per cache.

        Args:
            tokens: a list, tuple or 1-D integer array of tokens (ints in ``[0, 2**31)`` or
                32-byte digests); read before any state is looked at.
        Raises:
            TypeError / ValueError: a bad token or sequence, or more tokens than the
                capacity has room for.
            InvalidStateError: not ACTIVE, or after :meth:`stop_committing`.
            ClosedError: the cache is closed."""

    @abc.abstractmethod
    def commit_input(self, n: int | None = None) -> None:
        """:meth:`commit` of the next ``n`` tokens of the ``input_tokens`` given at create
        (``input_tokens[c : c + n]``, ``c`` = :attr:`num_committed_tokens`), without
        handing them over again; ``None``: all the rest of them.  ACTIVE only.

        Raises:
            TypeError / ValueError: ``n`` not an int ``>= 0`` (checked first), more tokens
                than the capacity has room for, or fewer than ``n`` input tokens left.
            InvalidStateError / ClosedError: as :meth:`commit`."""

    @abc.abstractmethod
    def stop_committing(self) -> None:
        """End the request's commits (SPEC sec. 7): its partial tail (if any, and if
        ``enable_partial_reuse``) enters the tree as a partial block, with an ssm snapshot
        at its exact end.  Later :meth:`commit` calls raise.  SUSPENDED or ACTIVE; a second
        call is a no-op.  :meth:`close` calls it.

        Raises:
            ClosedError: the cache is closed."""

    @abc.abstractmethod
    def close(self) -> None:
        """End the request (SPEC sec. 7): :meth:`stop_committing`, then release everything.
        Private pages and the live ssm state are freed; committed pages stay in the tree
        (DROPPABLE once no request uses them: reusable until evicted).  Idempotent; the
        properties keep answering afterwards."""

    # --- forks (issue 22, SPEC sec. 18; DECISIONS.md "Forks (issue 22)")
    @abc.abstractmethod
    def fork(self, id: int | str | None = None) -> KVCache:
        """Branch this cache (SPEC sec. 18): for parallel sampling and beam search.

        ACTIVE only, with ``history_length == num_committed_tokens``.  A new ACTIVE cache
        (same scope and priority, id as at create) with this one's committed tokens that
        shares every page this one holds for them, the current partial block's included:
        the first of the two to ``resize`` beyond its committed tokens copies a shared
        partial page (a ``cow`` op) before it writes; an ssm fork gets its own live state
        at once (a ``cow`` op).  ``capacity == history_length == num_committed_tokens``.

        Returns:
            the new cache.
        Raises:
            TypeError / ValueError: ``id`` not an int or str, or held by an open cache.
            InvalidStateError: not ACTIVE, or history past the committed tokens.
            OutOfPagesError: the gpu cannot take the fork's own pages (nothing changed).
            ClosedError: the cache is closed."""

    @abc.abstractmethod
    def page_indices(self, lc: int, start: int = 0, stop: int | None = None) -> list[int]:
        """The gpu slot of each block of life cycle ``lc`` (SPEC sec. 7); ACTIVE only.

        Args:
            lc: the life cycle.
            start, stop: the block ordinals ``[start, stop)`` only (default: all of them,
                ``stop`` None: to the end); the cost is that of the range, so an engine
                that reads the blocks it just filled pays nothing per block for the rest.

        Returns:
            for attention, one entry per block ordinal in ``[0, ceil(capacity / B))``
            (within ``[start, stop)``): the slot index in the gpu pool of ``lc``, -1 for a
            stale or absent block; for ssm, ``[live_slot]`` (one entry: ordinal 0).  Valid
            after the pending copy ops are executed, until the next call that changes this
            cache (or a ``set_quota``).
        Raises:
            ValueError / TypeError: ``lc`` is no life cycle id; ``start`` / ``stop`` not
                ints (``stop`` may be None), or not ``0 <= start <= stop <= n`` for the
                ``n`` entries there are.
            InvalidStateError: the cache is not ACTIVE.
            ClosedError: the cache is closed."""

    @abc.abstractmethod
    def page_indices_into(self, lc: int, out: Any) -> int:
        """:meth:`page_indices` written into ``out``, a caller's writable int32 buffer
        (``array('i')``, numpy, a CPU torch tensor): no list is built.

        Returns:
            the number of entries written.
        Raises:
            ValueError: the buffer is too small or not int32 (nothing written); otherwise
                as :meth:`page_indices`."""


# What ``KVCacheManager(config, backend=...)`` calls to build a manager: registered by
# kvcm.construct when ``import kvcm`` runs (which every import of a kvcm module does
# first), so that the interface never imports the backends it is implemented by.
ManagerFactory = Callable[..., "KVCacheManager"]
_manager_factory: ManagerFactory | None = None


def register_manager_factory(factory: ManagerFactory) -> None:
    """Install the builder behind ``KVCacheManager(...)`` (kvcm.construct does, once)."""
    global _manager_factory
    _manager_factory = factory


class KVCacheManager(abc.ABC):
    """The KV-cache block manager of one model instance (SPEC sec. 0).

    ``KVCacheManager(config, backend=None)`` builds the chosen backend's implementation
    (``"cpp"`` or ``"python"``; ``kvcm.backend`` when None, SPEC sec. 12) through the
    factory :mod:`kvcm.construct` registers; subclasses (the backends) are built directly.
    Both backends behave identically, down to page indices, copy ops and events.
    Raises :class:`ConfigError` for a bad config.

    The manager keeps the radix tree of committed blocks, the page pools of every
    ``(tier, life cycle)`` and the requests.  Per request it answers what is cached
    (:meth:`create_kv_cache`, :meth:`probe_reuse`), where each block lives
    (:meth:`KVCache.page_indices`) and what to copy between tiers
    (:meth:`drain_copy_ops`), which the engine's data plane executes before each step.
    Reporting: :meth:`stats`, :meth:`take_events`, :meth:`snapshot`.

    Typical use (SPEC sec. 14)::

        mgr = kvcm.KVCacheManager(config)
        kv = mgr.create_kv_cache(prompt)        # SUSPENDED, prefix matched
        kv.resume(); kv.resize(len(prompt) + 1)
        plane.apply(mgr.drain_copy_ops())
        ...                                     # compute, kv.commit(...), decode
        kv.close()

    Threads: meant to be driven by one scheduler thread; calls from several threads are
    serialised and never corrupt state (SPEC sec. 10).  A failed call changes nothing.
    Each state-changing call ticks the manager's logical clock once (SPEC sec. 4)."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        _contract_docs(cls, KVCacheManager)

    backend_name: ClassVar[str] = ""

    def __new__(cls, config: KVCacheManagerConfig | None = None, *args: Any, backend: str | None = None, **kw: Any):
        if cls is KVCacheManager:
            if _manager_factory is None:  # pragma: no cover - `import kvcm` always registers one
                raise RuntimeError("kvcm.KVCacheManager: no backend factory registered (import kvcm first)")
            return _manager_factory(config, *args, backend=backend, **kw)
        return super().__new__(cls)

    @property
    @abc.abstractmethod
    def config(self) -> KVCacheManagerConfig:
        """The :class:`KVCacheManagerConfig` the manager was built from (``set_quota``
        does not change it)."""

    @property
    @abc.abstractmethod
    def life_cycles(self) -> tuple[Any, ...]:
        """One :class:`kvcm.LifeCycle` per life cycle id, in id order: the ``lc`` of
        :meth:`KVCache.page_indices`, copy ops and events (SPEC sec. 1).  (Typed ``Any``
        here: the interface imports nothing of kvcm; the rules live in kvcm.config.)"""

    def create_kv_cache(
        self,
        input_tokens: Sequence[Token] | None = None,
        scope: ReuseScope | None = None,
        priority: int | None = None,
        id: int | str | None = None,
        shared_hits: Any = None,
    ) -> KVCache:
        """Start a request: match ``input_tokens`` once and return a SUSPENDED cache holding
        the reused pages (SPEC sec. 6, 7).  Call :meth:`KVCache.resume` before using it.

        The cache has ``num_committed_tokens == history_length == capacity == m``, the
        matched prefix length (``num_reused_tokens``); the engine computes the rest.  Hit
        statistics are recorded; the clock ticks.

        Args:
            input_tokens: the prompt (a list, tuple or 1-D integer array; ints in
                ``[0, 2**31)`` or 32-byte digests), or None for no prompt.  Kept for
                :meth:`KVCache.commit_input`.
            scope: the :class:`ReuseScope` (None: the default scope).
            priority: 0..100 (None: ``config.default_priority``).
            id: an int or str not held by an open cache (None: the creation serial, or the
                next integer no open cache holds).
            shared_hits: see below.
        Returns:
            the new :class:`KVCache`, SUSPENDED.
        Raises:
            TypeError / ValueError: a bad argument (nothing changed).
            InvalidStateError: the manager is shut down.

        ``shared_hits``: with a shared tier, the ``(key, lc)`` pairs of
        :meth:`shared_candidates` that the store holds (one batched existence query); the
        match may then extend into the shared tier (DECISIONS.md "The shared tier").  Each
        item a ``(key, lc)`` tuple or list (TypeError / ValueError), keys 32 bytes, lc a
        life cycle id; pairs that are no candidates are ignored; given without a shared
        tier: ValueError.  A bad item changes nothing."""
        return self._create_kv_cache(input_tokens, scope, priority, id, shared_hits)

    @abc.abstractmethod
    def _create_kv_cache(self, input_tokens: Sequence[Token] | None, scope: ReuseScope | None, priority: int | None,
                         id: int | str | None, shared_hits: Any) -> KVCache:
        """A backend's :meth:`create_kv_cache`, every argument given: the signature, its
        defaults and its documentation are the public method's, declared once (issue 36)."""

    @abc.abstractmethod
    def shared_candidates(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> list[tuple[bytes, int]]:
        """The ``(key, lc)`` pairs to look up in the shared tier for ``tokens``: every full
        block past those on the tree path from the scope root, every life cycle, ordered by
        block then lc.  No side effect at all (like :meth:`probe_reuse`); [] without a
        shared tier (DECISIONS.md "The shared tier")."""

    @abc.abstractmethod
    def probe_reuse(self, tokens: Sequence[Token], scope: ReuseScope | None = None, shared_hits: Any = None) -> int:
        """How many leading tokens of ``tokens`` a request created now would reuse: the
        match length ``m`` of SPEC sec. 6, pages on any tier counting; with ``shared_hits``
        exactly the ``num_committed_tokens`` of ``create_kv_cache(tokens, scope,
        shared_hits=shared_hits)`` (the match extended by the shared tier's blocks).  No
        side effect at all (no tick, no recency change, no stats, no events, no tree
        block or scope root made), so a router or scheduler may call it freely and as
        often as it likes.  Raises TypeError / ValueError for bad tokens, scope or shared
        hits (the hits checked as :meth:`create_kv_cache` checks them, same messages)."""

    @abc.abstractmethod
    def probe_reuse_detail(self, tokens: Sequence[Token], scope: ReuseScope | None = None,
                           shared_hits: Any = None) -> ReuseProbe:
        """Like :meth:`probe_reuse`, as a :class:`ReuseProbe` that adds the diagnostic
        ``num_tokens_before_ssm`` (the match without the ssm snapshot rule) and
        ``block_tiers``: per full block of the match, the coldest tier among the pages a
        request created now would hold for it (-1: none), so an engine knows before it
        creates the request whether ``resume`` would onboard anything (a block not on tier
        0) or not.  The cost grows with the match, not with the tree."""

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
    def drain_copy_ops(self) -> list[CopyOp]:
        """Take the pending copy ops (SPEC sec. 8): every page move since the last drain,
        in order.  The engine executes them, in this order, before it uses the page indices
        of the step (a slot freed by one op may be the destination of a later one).  The
        list becomes "the last drain" that :meth:`forget_copies` accepts reports of; with
        ``copy_settlement="explicit"`` a non-empty list becomes the newest unsettled drain
        instead (:meth:`settle_copies`).  Does not tick the clock.

        Returns:
            the :class:`CopyOp` list (empty when nothing moved); the pending list is cleared."""

    def drain_copy_runs(self) -> list[CopyRun]:
        """:meth:`drain_copy_ops` in column form: the same drain (the pending ops are taken,
        and they are the last drain for :meth:`forget_copies`), handed over as
        ``copy_runs(ops)`` — per run, slot lists an engine feeds to one batched copy
        (DECISIONS.md "Copy runs").  ``[op for r in runs for op in r.ops()]`` is the ops."""
        return copy_runs(self.drain_copy_ops())

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
        (ValueError); a manager with ``copy_settlement="explicit"``, which reports failures
        with :meth:`settle_copies` instead (ValueError)."""

    @abc.abstractmethod
    def settle_copies(self, failed: Sequence[CopyOp] = ()) -> list[int | str]:
        """Settle the **oldest** unsettled drain (``copy_settlement="explicit"``; SPEC sec.
        15, DECISIONS.md "Asynchronous copies: settle_copies"): its ops in ``failed`` did
        not complete, all its other ops did.  For engines that execute the copies of a
        drain asynchronously and learn how they ended several drains later: every
        :meth:`drain_copy_ops` / :meth:`drain_copy_runs` that returns at least one op
        adds one unsettled drain, and the engine settles them one call each, in drain order.

        Each op of ``failed`` is matched by value within that drain only (an op value the
        drain returned k times may be listed up to k times), so an equal op of a newer
        drain is never confused with it.  The pages the failed ops were meant to fill are
        forgotten and the open caches that use one are rolled back exactly as
        :meth:`forget_copies` does; the drain is then settled (gone from
        ``snapshot()["issued_copy_ops"]``).  Returns the ids of the rolled-back caches in
        creation order.  Ticks the clock once when ``failed`` is not empty.

        Bad input raises and changes nothing: ``failed`` not a list/tuple of CopyOp
        (TypeError, as for :meth:`forget_copies`); a manager with
        ``copy_settlement="drain"`` (ValueError); no unsettled drain (ValueError); an op
        that the oldest unsettled drain did not return, or listed more times than it did
        (ValueError naming the op).  Answers on a shut-down manager too (ops drained
        before or after the shutdown may still fail)."""

    @property
    @abc.abstractmethod
    def unsettled_drains(self) -> int:
        """How many drains wait for :meth:`settle_copies` (``copy_settlement="explicit"``;
        always 0 with ``"drain"``).  The manager keeps every unsettled drain's ops (SPEC
        sec. 15: a visible bound; ``snapshot()["issued_copy_ops"]`` lists them).  No side
        effect."""

    @abc.abstractmethod
    def clear_reusable(self) -> None:
        """Drop every DROPPABLE page (those no request uses) on every tier and prune the
        tree (SPEC sec. 8): ``removed`` events, then one ``cleared``.  Pages of open
        requests stay.  Raises InvalidStateError on a shut-down manager."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Shut the manager down (SPEC sec. 8): every cache must be closed
        (InvalidStateError otherwise, nothing changed).  Afterwards calls that would change
        state raise InvalidStateError; reading and draining calls keep answering.  A second
        call is a no-op."""

    @abc.abstractmethod
    def set_quota(self, tier: str | int, quota_bytes: int) -> None:
        """Change a tier's quota while serving (SPEC sec. 18; DECISIONS.md "Quotas at run
        time").  ``tier``: a local tier's kind (``"gpu"``, ``"host"``, ``"disk"``) or SPEC
        number (0, 1, 2); ``quota_bytes`` is split among life cycles as at construction
        (``pool_ratio``), and ``stats()`` / ``snapshot()`` show it.

        Growing adds slots at once (the new ones are the highest indices).  Shrinking first
        evicts in the order of sec. 8 — offloading down the tiers, dropping from the
        coldest, with copy ops and events as usual — until the tier's pages fit, then moves
        the pages left in the vanishing top slots ``[n, total)`` into the lowest free slots
        (``relocate`` copy ops, in slot order): a LOCKED page's index changes, so the engine
        executes the drained ops (``DataPlane.set_quota`` does, then resizes the pools)
        and reads ``page_indices`` again before its next step.  Ticks the clock once.

        Refused, changing nothing: a tier that is not a local tier (ValueError; TypeError
        for a non-str, non-int), ``quota_bytes`` not an int (TypeError) in ``[0, 2**63)``
        or too small for one slot per life cycle (ValueError), a shut-down manager
        (InvalidStateError), and a quota too small for the LOCKED pages plus the HELD ones
        no colder tier can take (OutOfPagesError naming the life cycle and the counts)."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Cumulative statistics as a JSON-serialisable dict (SPEC sec. 9).

        Keys: ``requests``, ``query_tokens``, ``reused_tokens`` (hit rate, attention life
        cycles only); ``lc`` (per life cycle: ``reused_blocks``, ``missed_blocks``,
        ``reused_tokens``, ``allocated_blocks``, ``offloads`` / ``onboards`` / ``drops``
        and their ``*_bytes``, ``cows``, ``snapshots_taken``, ``snapshots_skipped``,
        ``lost_pages``, ``shared_stores``, ``shared_store_bytes``, ``shared_hit_blocks``,
        ``relocations``); ``tiers`` (per configured local tier: ``tier``, ``kind``,
        ``quota_bytes`` and per life cycle ``total``, ``free``, ``locked``, ``held``,
        ``droppable`` slots); ``events_dropped``; ``pending_copy_ops``.  No side effect."""

    @abc.abstractmethod
    def take_iteration_stats(self) -> dict:
        """:meth:`stats` counted since the previous call of this method (the slot counts
        and ``pending_copy_ops`` are current figures), then restart the count."""

    @abc.abstractmethod
    def take_events(self) -> list[Event]:
        """Take the buffered KV events, oldest first (SPEC sec. 9): :class:`StoredEvent`,
        :class:`RemovedEvent`, :class:`TierChangedEvent`, :class:`ClearedEvent`.  The
        buffer keeps at most ``config.max_events`` (older ones are dropped and counted in
        ``stats()["events_dropped"]``; ``event_id`` gaps show them).  Clears the buffer."""

    @abc.abstractmethod
    def snapshot(self) -> dict:
        """A canonical, JSON-serialisable picture of all observable state (SPEC sec. 11):
        tree, pages, pools, requests, stats, pending and issued copy ops, buffered events,
        the clock.  The same calls give the same snapshot on both backends (the parity
        suite compares them).  No side effect."""

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Check every internal rule (slot accounting, page states and tiers, tree links,
        pruning, request invariants; SPEC sec. 11) and raise :class:`InvariantError` naming
        the first broken one.  For tests and debugging; no side effect."""


# The interface's public names, listed once: what the ``kvcm`` package exports with its own
# (kvcm/__init__: ``from kvcm.api import *``, ``__all__ += api.__all__``).  The module's other
# names (``as_int``, ``copy_runs``, ``scope_field``, the tier numbers ``GPU``/``HOST``/``DISK``/
# ``SHARED``, the policy tuples ``COPY_SETTLEMENTS``/``SHARED_WRITE_POLICIES``,
# ``register_manager_factory``/``ManagerFactory``, ``PendingCopyOpsWarning``) are the
# interface's too, imported by name from ``kvcm.api`` by the backends, the data plane and the
# engines.
__all__ = [
    "AttentionLayer",
    "ClearedEvent",
    "ClosedError",
    "ConfigError",
    "CopyError",
    "CopyOp",
    "CopyRun",
    "Event",
    "InvalidStateError",
    "InvariantError",
    "KVCache",
    "KVCacheManager",
    "KVCacheManagerConfig",
    "KvcmError",
    "OutOfPagesError",
    "RemovedEvent",
    "ReuseProbe",
    "ReuseScope",
    "SsmLayer",
    "Status",
    "StoredBlock",
    "StoredEvent",
    "Tier",
    "TierChangedEvent",
]
