"""Argument checks shared by both backends' Python layers (SPEC sec. 10): every bad
argument raises before anything changes, with one set of messages for both backends
(the C++ core raises the same texts for the checks it runs itself; the parity suite pins
them).

Each check normalises what it accepts (a token sequence to a list of ints / digests, an
int subclass to its int value), so both backends see exactly the same values.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

from kvcm.api import (
    DIGEST_TOKEN_BYTES,
    MAX_TOKEN,
    ClosedError,
    CopyOp,
    InvalidStateError,
    KVCache,
    OutOfPagesError,
    ReuseScope,
    Status,
    Token,
    as_int,
    scope_field,
)

DEFAULT_SCOPE = ReuseScope()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------
# Status errors: a call on a closed cache, in the wrong status, or on a shut-down manager
# (sec. 7, 10).  The C++ core raises the same texts for the checks it runs itself
# (cpp/core: InvalidStateErr); the parity suite compares them.
# ---------------------------------------------------------------------------------------


def closed_error(what: str) -> ClosedError:
    """The error of ``what()`` on a closed cache."""
    return ClosedError(f"{what}() on a closed cache")


def status_error(what: str, need: Status, have: Status) -> InvalidStateError:
    """The error of ``what()`` on a cache in status ``have`` when it needs ``need``."""
    return InvalidStateError(f"{what}() needs a {need.value} cache, this one is {have.value}")


def stopped_error() -> InvalidStateError:
    """The error of ``commit`` after ``stop_committing()``."""
    return InvalidStateError("commit after stop_committing()")


def fork_history_error(history: int, committed: int) -> InvalidStateError:
    """The error of ``fork()`` on a cache whose history runs past its committed tokens
    (DECISIONS.md "Forks": written but uncommitted tokens are not shared)."""
    return InvalidStateError(f"fork() needs history_length == num_committed_tokens, this cache has "
                             f"history_length {history} and {committed} committed tokens")


def fork_room_error() -> OutOfPagesError:
    """The error of ``fork()`` when the gpu cannot take the fork's own pages (DECISIONS.md "Forks")."""
    return OutOfPagesError("fork(): no gpu slot for the fork's own pages (live ssm state, copied partial block)")


def input_room_error(n: int, n_input: int, n_committed: int) -> ValueError:
    """The error of ``commit_input(n)`` when fewer than ``n`` input tokens follow the
    committed ones."""
    return ValueError(f"commit_input of {n} tokens exceeds the input ({n_input} input tokens, "
                      f"{n_committed} committed)")


def shut_down_error() -> InvalidStateError:
    """The error of a manager call after ``shutdown()``."""
    return InvalidStateError("the manager is shut down")


def quota_refused_error(kind: str, quota_bytes: int, lc: int, slots: int, need: int, locked: int,
                        held: int) -> OutOfPagesError:
    """set_quota refused (DECISIONS.md "Quotas at run time"): the pages that must stay in
    the tier do not fit what ``quota_bytes`` gives; nothing changed."""
    return OutOfPagesError(
        f"set_quota({kind!r}, {quota_bytes}) refused, nothing changed: it gives life cycle {lc} {slots} "
        f"{kind} slots, but {need} pages must stay there ({locked} LOCKED, {held} HELD that no colder tier "
        f"can take)")


def still_open_error(n_open: int) -> InvalidStateError:
    """The error of ``shutdown()`` while ``n_open`` caches are open."""
    return InvalidStateError(f"shutdown needs every cache closed; {n_open} still open")


# Copy settlement (DECISIONS.md "Asynchronous copies: settle_copies"); the C++ core raises
# the same texts (cpp/core/manager.cpp, block_pool.cpp).
FORGET_IN_EXPLICIT = ("forget_copies() is not used with copy_settlement='explicit': report the failed ops of "
                      "each drain with settle_copies(failed), oldest drain first")
SETTLE_IN_DRAIN = ("settle_copies() needs KVCacheManagerConfig(copy_settlement='explicit'); with "
                   "copy_settlement='drain' report the failed ops of the last drain with forget_copies(ops)")
NOTHING_TO_SETTLE = ("settle_copies(): no unsettled drain (each drain_copy_ops() / drain_copy_runs() that "
                     "returned ops is settled once)")


def not_issued_error(i: int, op: CopyOp) -> ValueError:
    """forget_copies: ``ops[i]`` is no unreported op of the last drain."""
    return ValueError(f"forget_copies(): ops[{i}] {op.to_json()} is not an unreported op of the last "
                      "drain_copy_ops()")


def not_in_oldest_drain_error(i: int, op: CopyOp) -> ValueError:
    """settle_copies: ``failed[i]`` is no op of the oldest unsettled drain (or one listed
    more times than that drain returned it)."""
    return ValueError(f"settle_copies(): failed[{i}] {op.to_json()} is not an op of the oldest unsettled drain "
                      "(or is listed more times than that drain returned it)")


# ---------------------------------------------------------------------------------------
# Arguments
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
    return check_tokens_packed(tokens, name)[0]


def check_tokens_packed(tokens: Any, name: str = "tokens") -> tuple[list[Token], bytes | None]:
    """:func:`check_tokens`, and the tokens as 4-byte little-endian ints (the bytes their
    keys hash, ``kvcm.keys.chain_keys_packed``) when all are ints (None otherwise)."""
    out = list(tokens) if type(tokens) in (list, tuple) else _token_items(tokens, name)
    if not out:
        return out, b""
    if list(map(type, out)).count(int) == len(out):  # all exact ints: the common case, checked at C speed
        # the range check is the packing: it fails below 0 or from 2**32, and a token from
        # 2**31 on has its top bit set, so its high (little-endian: last) byte is not ascii
        try:
            buf = struct.pack(f"<{len(out)}I", *out)
        except struct.error:
            buf = None
        if buf is None or not buf[3::4].isascii():
            bad = next(t for t in out if not 0 <= t < MAX_TOKEN)
            raise ValueError(f"{name}: token {bad} out of range [0, 2**31)")
        return out, buf
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
    return out, None if bytes in set(map(type, out)) else struct.pack(f"<{len(out)}I", *out)


def check_scope(scope: Any) -> ReuseScope:
    """The scope to use: None is the default scope.  The fields are validated again here
    (a ReuseScope can be forged with ``object.__setattr__``) and an int subclass is read by
    its value, so both backends key exactly the same scope."""
    if scope is None:
        return DEFAULT_SCOPE
    if not isinstance(scope, ReuseScope):
        raise TypeError(f"scope must be a ReuseScope or None, got {type(scope).__name__}")
    lora, salt = scope.lora_id, scope.salt
    nl, ns = scope_field("lora_id", lora), scope_field("salt", salt)
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


def check_lc(lc: Any, n: int) -> int:
    """A life cycle id argument (``page_indices``, ``page_indices_into``): an int (not bool;
    a subclass by its value) in ``[0, n)``, ``n`` the model's life cycles."""
    value = as_int(lc)
    if value is None:
        raise TypeError(f"lc must be an int, got {type(lc).__name__}")
    if not 0 <= value < n:
        raise ValueError(f"unknown life cycle {value}; this model has {n}")
    return value


def check_block_range(start: Any, stop: Any, n: int) -> tuple[int, int]:
    """``page_indices``' ``[start, stop)`` of its ``n`` entries (``stop`` None: ``n``)."""
    a = as_int(start)
    if a is None:
        raise TypeError(f"start must be an int, got {type(start).__name__}")
    b = n if stop is None else as_int(stop)
    if b is None:
        raise TypeError(f"stop must be an int or None, got {type(stop).__name__}")
    if not 0 <= a <= b <= n:
        raise ValueError(f"block range [{a}, {b}) is not within the {n} entries [0, {n}]")
    return a, b


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
        out[i] = check_count(item, f"{name}[{i}]")  # the single call's rule, named by index
    if len(out) != n:
        raise ValueError(f"{what}(): {name} has {len(out)} items for {n} caches")
    return out


def check_copy_ops(ops: Any, what: str = "forget_copies", arg: str = "ops") -> list[CopyOp]:
    """The type checks of :meth:`KVCacheManager.forget_copies` and ``settle_copies``
    (shared by both backends; ``arg``: the argument's name in messages): ``ops`` is a list
    or tuple (TypeError), each item a ``CopyOp`` (TypeError) whose slots and tiers are ints
    (not bool) and whose reason is a str (TypeError).  Whether each op was issued is the
    backend's check (ValueError)."""
    if type(ops) not in (list, tuple):
        raise TypeError(f"{what}(): {arg} must be a list or tuple of CopyOp, got {type(ops).__name__}")
    for i, op in enumerate(ops):
        if not isinstance(op, CopyOp):
            raise TypeError(f"{what}(): {arg}[{i}] must be a CopyOp, got {type(op).__name__}")
        for name in ("lc", "src_tier", "src_slot", "dst_tier", "dst_slot"):
            if not _is_int(getattr(op, name)):
                raise TypeError(f"{what}(): {arg}[{i}].{name} must be an int, "
                                f"got {type(getattr(op, name)).__name__}")
        if type(op.reason) is not str:
            raise TypeError(f"{what}(): {arg}[{i}].reason must be a str, got {type(op.reason).__name__}")
        if op.key is not None and type(op.key) is not bytes:
            raise TypeError(f"{what}(): {arg}[{i}].key must be None or bytes, got {type(op.key).__name__}")
    return list(ops)


def check_shared_hits(hits: Any, num_lcs: int, has_shared: bool) -> list[tuple[bytes, int]] | None:
    """``create_kv_cache(shared_hits=...)`` (DECISIONS.md "The shared tier"): None, or an
    iterable of ``(key, lc)`` pairs, each a tuple or list of two (TypeError; ValueError
    for another length), ``key`` 32 bytes (bytes, bytearray or memoryview: TypeError; else
    ValueError), ``lc`` an int (not bool: TypeError) that names a life cycle (ValueError).
    Given without a shared tier: ValueError.  Returns the pairs in order (keys as bytes),
    or None; the iterable is read once, here, before the call looks at any state."""
    if hits is None:
        return None
    if isinstance(hits, (str, bytes, bytearray, memoryview)) or not hasattr(hits, "__iter__"):
        raise TypeError(f"shared_hits must be an iterable of (key, lc) pairs, got {type(hits).__name__}")
    out: list[tuple[bytes, int]] = []
    for i, item in enumerate(hits):
        if type(item) not in (tuple, list):
            raise TypeError(f"shared_hits[{i}] must be a (key, lc) pair, got {type(item).__name__}")
        if len(item) != 2:
            raise ValueError(f"shared_hits[{i}] must be a (key, lc) pair, got {len(item)} items")
        key, lc = item
        if not isinstance(key, (bytes, bytearray, memoryview)):
            raise TypeError(f"shared_hits[{i}] key must be bytes, got {type(key).__name__}")
        key = bytes(key)
        if len(key) != DIGEST_TOKEN_BYTES:
            raise ValueError(f"shared_hits[{i}] key must be {DIGEST_TOKEN_BYTES} bytes, got {len(key)}")
        value = as_int(lc)
        if value is None:
            raise TypeError(f"shared_hits[{i}] lc must be an int, got {type(lc).__name__}")
        if not 0 <= value < num_lcs:
            raise ValueError(f"shared_hits[{i}] names unknown life cycle {value}; this model has {num_lcs}")
        out.append((key, value))
    if not has_shared:
        raise ValueError("shared_hits given, but the config has no shared tier")
    return out


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


__all__ = [
    "DEFAULT_SCOPE",
    "FORGET_IN_EXPLICIT",
    "MAX_COUNT",
    "MAX_REQUEST_BLOCKS",
    "NOTHING_TO_SETTLE",
    "SETTLE_IN_DRAIN",
    "as_int",
    "check_batch_caches",
    "check_cache_id",
    "check_copy_ops",
    "check_count",
    "check_counts",
    "check_priority",
    "check_scope",
    "check_tokens",
    "check_tokens_packed",
    "closed_error",
    "default_cache_id",
    "fork_history_error",
    "fork_room_error",
    "int32_view",
    "not_in_oldest_drain_error",
    "not_issued_error",
    "quota_refused_error",
    "shut_down_error",
    "status_error",
    "still_open_error",
    "stopped_error",
]
