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

TierKind = Literal["gpu", "host", "disk", "shared"]
# a tier kind's position here is its SPEC tier number: gpu 0, host 1, disk 2, shared 3
TIER_KINDS: tuple[str, ...] = ("gpu", "host", "disk", "shared")
GPU, HOST, DISK = 0, 1, 2
SHARED_WRITE_POLICIES: tuple[str, ...] = ("commit", "evict")  # KVCacheManagerConfig.shared_write

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
    # the shared tier (DECISIONS.md "The shared tier"): when a page is written to the store
    # ("commit": write-through; "evict": when dropped from the coldest local tier), and the
    # model/namespace string of the layout fingerprint that names its objects
    shared_write: str = "commit"
    shared_namespace: str = ""
    # a file holding the store secret that authenticates the shared tier's objects (read
    # by the data plane only; the config holds the path, never the secret; "": the
    # environment's, if any: kvcm.shared_store.store_secret)
    shared_secret_file: str = ""

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
    """Requests only share blocks within one scope (sec. 3).  ``None`` and ``0`` differ."""

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
    has slot -1 on that side; every other op has ``key`` None."""

    lc: int
    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    reason: str
    key: bytes | None = None

    def to_json(self) -> list:
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
    order, does what the ops in order do (DECISIONS.md "Copy runs")."""

    lc: int
    src_tier: int
    dst_tier: int
    reason: str
    src_slots: array.array  # typecode "q" (int64): a buffer an engine hands to torch as is
    dst_slots: array.array
    keys: list[bytes] | None = None

    def __len__(self) -> int:
        return len(self.src_slots)

    def ops(self) -> list[CopyOp]:
        """The run's ops as CopyOps, in order (e.g. for ``forget_copies``)."""
        keys = self.keys if self.keys is not None else [None] * len(self.src_slots)
        return [CopyOp(self.lc, self.src_tier, s, self.dst_tier, d, self.reason, k)
                for s, d, k in zip(self.src_slots, self.dst_slots, keys)]

    def to_json(self) -> list:
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
    key: bytes
    num_tokens: int
    tokens: tuple[Token, ...]
    lc: int
    tier: int
    priority: int
    coverage: int  # tokens of the block this lc's page covers (ssm: the snapshot's exact end)


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
                [b.key.hex(), b.num_tokens, [_tok_json(t) for t in b.tokens], b.lc, b.tier, b.priority, b.coverage]
                for b in self.blocks
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
    def commit_input(self, n: int | None = None) -> None:
        """ACTIVE only.  :meth:`commit` of the next ``n`` tokens of the ``input_tokens``
        given at create (``input_tokens[c : c + n]``, ``c`` = :attr:`num_committed_tokens`),
        without handing them over again; ``None``: all the rest of them.  The checks of
        :meth:`commit` (status, stopped, capacity), then ValueError when fewer than ``n``
        input tokens follow position ``c``; ``n`` itself is checked first (an int >= 0)."""

    @abc.abstractmethod
    def stop_committing(self) -> None:
        """Insert the partial tail as a partial block; later commits raise."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything.  Idempotent."""

    # --- forks (issue 22, SPEC sec. 18; DECISIONS.md "Forks (issue 22)")
    @abc.abstractmethod
    def fork(self, id: int | str | None = None) -> KVCache:
        """ACTIVE only, with ``history_length == num_committed_tokens``.  A new ACTIVE cache
        (same scope and priority, id as at create) with this one's committed tokens that
        shares every page this one holds for them, the current partial block's included:
        the first of the two to ``resize`` beyond its committed tokens copies a shared
        partial page (a ``cow`` op) before it writes; an ssm fork gets its own live state
        at once (a ``cow`` op).  ``capacity == history_length == num_committed_tokens``.
        OutOfPagesError (nothing changed) when the gpu cannot take the fork's own pages."""

    @abc.abstractmethod
    def page_indices(self, lc: int) -> list[int]:
        """ACTIVE only.  gpu slot per block ordinal (-1 stale/absent); ssm: [live_slot]."""

    @abc.abstractmethod
    def page_indices_into(self, lc: int, out: Any) -> int:
        """Write :meth:`page_indices` into a caller's int32 buffer; returns the count.
        Raises ValueError (writing nothing) when the buffer is too small or not int32."""


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
    """The manager.  ``KVCacheManager(config, backend=None)`` builds the chosen backend's
    implementation (``kvcm.backend`` when ``backend`` is None) through the factory
    :mod:`kvcm.construct` registers; subclasses (the backends) are built directly."""

    backend_name: ClassVar[str] = ""

    def __new__(cls, config: KVCacheManagerConfig | None = None, *args: Any, backend: str | None = None, **kw: Any):
        if cls is KVCacheManager:
            if _manager_factory is None:  # pragma: no cover - `import kvcm` always registers one
                raise RuntimeError("kvcm.KVCacheManager: no backend factory registered (import kvcm first)")
            return _manager_factory(config, *args, backend=backend, **kw)
        return super().__new__(cls)

    @property
    @abc.abstractmethod
    def config(self) -> KVCacheManagerConfig: ...

    @property
    @abc.abstractmethod
    def life_cycles(self) -> tuple[Any, ...]:
        """One :class:`kvcm.config.LifeCycle` per life cycle id (typed ``Any`` here: the
        interface imports nothing of kvcm, and the life-cycle rules live in kvcm.config)."""

    @abc.abstractmethod
    def create_kv_cache(
        self,
        input_tokens: Sequence[Token] | None = None,
        scope: ReuseScope | None = None,
        priority: int | None = None,
        id: int | str | None = None,
        shared_hits: Any = None,
    ) -> KVCache:
        """Match ``input_tokens`` once and return a SUSPENDED cache holding the reused pages.

        ``shared_hits``: with a shared tier, the ``(key, lc)`` pairs of
        :meth:`shared_candidates` that the store holds (one batched existence query); the
        match may then extend into the shared tier (DECISIONS.md "The shared tier").  Each
        item a ``(key, lc)`` tuple or list (TypeError / ValueError), keys 32 bytes, lc a
        life cycle id; pairs that are no candidates are ignored; given without a shared
        tier: ValueError.  A bad item changes nothing."""

    @abc.abstractmethod
    def shared_candidates(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> list[tuple[bytes, int]]:
        """The ``(key, lc)`` pairs to look up in the shared tier for ``tokens``: every full
        block past those on the tree path from the scope root, every life cycle, ordered by
        block then lc.  No side effect at all (like :meth:`probe_reuse`); [] without a
        shared tier (DECISIONS.md "The shared tier")."""

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
        (ValueError)."""

    @abc.abstractmethod
    def clear_reusable(self) -> None:
        """Drop every DROPPABLE page and prune the tree."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Requires every cache closed (InvalidStateError otherwise)."""

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
    "SHARED",
    "SHARED_WRITE_POLICIES",
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
    "ManagerFactory",
    "OutOfPagesError",
    "PendingCopyOpsWarning",
    "RemovedEvent",
    "ReuseProbe",
    "ReuseScope",
    "SsmLayer",
    "Status",
    "StoredBlock",
    "StoredEvent",
    "Tier",
    "TierChangedEvent",
    "as_int",
    "copy_runs",
    "register_manager_factory",
    "scope_field",
]
