"""A JSON-able vocabulary of every public kvcm call, and a function that applies one.

One *op* is a dict::

    {"op": "create_kv_cache", "args": {"input_tokens": [1, 2, 3], "scope": null}}
    {"op": "commit", "cache": 0, "args": {"tokens": [4, {"digest": "ab..."}]}}
    {"op": "drain_copy_ops"}
    {"op": "drain_copy_runs"}

``cache`` is a *handle*: the index, in creation order, of a cache created by a successful
``create_kv_cache`` or ``fork`` (a cache op whose result is the new cache's handle) of the
same op sequence.  ``args`` holds keyword arguments; a missing
key means "use the default" (the argument is not passed at all).

Tokens: an int stays an int; a digest token (``bytes``) is ``{"digest": "<hex>"}``.  Any
other JSON value (a string, a float, ``true``, ``null``, an out-of-range int, a short
digest) is passed through unchanged, so bad input is expressible too.  A token list that
is not a JSON list (e.g. the string ``"abc"``) is also passed as is.

Batch ops (``resize_batch``, ``commit_batch``) are manager ops whose ``caches`` argument is
a JSON list of items: an int is a cache handle, ``{"foreign": true}`` a KVCache of no
manager of this run (a "cache of another manager"), ``{"value": x}`` the raw value ``x``
(not a cache at all); a non-list ``caches`` is passed as is.  Their integer containers
(``capacities``, ``history_lengths``, and ``commit_batch``'s ``tokens``) keep their type: a
JSON list is a list, ``{"array": "q", "values": [...]}`` an ``array.array``,
``{"numpy": "int32", "values": [...]}`` a numpy array, ``{"torch": "int64", "values":
[...]}`` a torch tensor (engines keep sequence lengths in arrays).

``forget_copies``' ``ops`` and ``settle_copies``' ``failed`` are JSON lists whose items are
``CopyOp.to_json()`` lists (each becomes a ``CopyOp``; a seventh item is the key's hex) or
``{"value": x}`` (the raw value ``x``, bad input); a non-list is passed as is.

``shared_hits`` (of ``create_kv_cache``, ``probe_reuse`` and ``probe_reuse_detail``; a
probe recorded without it has no such key, as before the probes took it) is a JSON list
whose items are ``[key hex, lc]`` (each
becomes a ``(bytes, lc)`` pair), ``{"pair": [key hex, x], "type": "tuple" | "list"}`` (a
pair of bytes and anything else, bad input kept with its bytes) or ``{"value": x}`` (the raw
value ``x``, bad input); a non-list is passed as is.

Scope: ``null`` (default scope), ``{"lora_id": x, "salt": y}`` (either may be missing or
null), or any other JSON value passed through unchanged (a bad scope).

:func:`apply` runs one op and returns an *outcome*: ``{"result": <json>}`` or
``{"error": "<ExceptionTypeName>"}``.  Results are normalised so both backends' outcomes
can be compared with ``==`` and written as JSON: a KVCache becomes its handle, a CopyOp
and an Event their ``to_json()``, a ReuseProbe ``[num_tokens, num_tokens_before_ssm,
[block tiers...]]`` (a log recorded before ``block_tiers`` holds ``[num_tokens,
num_tokens_before_ssm]``: :func:`recorded_form` replays it in that form), a Status its
name, bytes their hex, dict keys strings.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import enum
import json
from collections.abc import Sequence
from typing import Any

from kvcm.api import CopyOp, CopyRun, Event, KVCache, ReuseProbe, ReuseScope, Status

# op name -> allowed argument names (manager ops, then cache ops, which need a handle)
MANAGER_OPS: dict[str, tuple[str, ...]] = {
    "create_kv_cache": ("input_tokens", "scope", "priority", "id", "shared_hits"),
    "probe_reuse": ("tokens", "scope", "shared_hits"),
    "shared_candidates": ("tokens", "scope"),
    "probe_reuse_detail": ("tokens", "scope", "shared_hits"),
    "drain_copy_ops": (),
    "drain_copy_runs": (),
    "clear_reusable": (),
    "take_events": (),
    "stats": (),
    "take_iteration_stats": (),
    "shutdown": (),
    # quotas at run time (DECISIONS.md "Quotas at run time")
    "set_quota": ("tier", "quota_bytes"),
    # the batched decode step (``caches``: handles, see the module docstring)
    "resize_batch": ("caches", "capacities", "history_lengths"),
    "commit_batch": ("caches", "tokens"),
    # failed copies (``ops``: see the module docstring)
    "forget_copies": ("ops",),
    # explicit settlement (DECISIONS.md "Asynchronous copies: settle_copies"; ``failed`` as ``ops``)
    "settle_copies": ("failed",),
}
BATCH_OPS: frozenset[str] = frozenset({"resize_batch", "commit_batch"})
CACHE_OPS: dict[str, tuple[str, ...]] = {
    "resume": (),
    "suspend": (),
    "resize": ("capacity", "history_length"),
    "commit": ("tokens",),
    "commit_input": ("n",),
    "stop_committing": (),
    "close": (),
    "page_indices": ("lc", "start", "stop"),  # start / stop: only when not the defaults
    # out: a fresh buffer of ``size`` items of ``dtype`` ("int32", "int64", "float32")
    # filled with -7; the result is {"count": n, "out": [...]} (see ``written``).
    "page_indices_into": ("lc", "size", "dtype"),
    # forks (issue 22): the result is the new cache's handle, as create_kv_cache's
    "fork": ("id",),
}
OPS: tuple[str, ...] = tuple(MANAGER_OPS) + tuple(CACHE_OPS)
# The ops whose successful result is a new cache (recorded and compared as its handle).
CREATING_OPS: frozenset[str] = frozenset({"create_kv_cache", "fork"})

# The properties of a KVCache (sec. 7) compared by :func:`cache_props`.
CACHE_PROPS: tuple[str, ...] = (
    "id",
    "status",
    "capacity",
    "history_length",
    "num_committed_tokens",
    "committed_tokens",
    "num_reused_tokens",
    "priority",
)

_BUFFER_TYPECODES = {"int32": "i", "int64": "q", "float32": "f"}
BUFFER_FILL = -7


class OpError(ValueError):
    """A malformed op (unknown name, unknown argument, bad handle): a harness bug, never
    an outcome."""


# ---------------------------------------------------------------------------------------
# encoding (Python values -> JSON) and decoding (JSON -> Python values)
# ---------------------------------------------------------------------------------------


def encode_token(t: Any) -> Any:
    """One token as JSON (a digest as ``{"digest": hex}``; other values as they are)."""
    if isinstance(t, (bytes, bytearray, memoryview)):
        return {"digest": bytes(t).hex()}
    if isinstance(t, bool) or t is None or isinstance(t, (str, float)):
        return t
    if isinstance(t, int):
        return int(t)
    item = getattr(t, "item", None)  # numpy / torch scalar
    if callable(item) and not hasattr(t, "__len__"):
        with contextlib.suppress(Exception):
            return encode_token(item())
    return {"repr": repr(t)}


def encode_tokens(tokens: Any) -> Any:
    """JSON form of a token sequence (anything the API accepts, or bad input)."""
    if tokens is None or isinstance(tokens, (str, int, float, bool)):
        return tokens
    if isinstance(tokens, (bytes, bytearray)):
        return {"bytes": bytes(tokens).hex()}
    if hasattr(tokens, "tolist") and not isinstance(tokens, list):
        try:
            tokens = tokens.tolist()
        except Exception:  # noqa: BLE001 - unencodable: recorded by repr
            return {"repr": repr(tokens)}
    elif not isinstance(tokens, Sequence):  # an iterator (not consumed), dict, set...: refused by the call
        return {"repr": repr(tokens)}
    try:
        seq = list(tokens)
    except TypeError:
        return {"repr": repr(tokens)}
    return [encode_token(t) for t in seq]


def decode_token(t: Any) -> Any:
    """The inverse of :func:`encode_token`."""
    if isinstance(t, dict) and set(t) == {"digest"}:
        return bytes.fromhex(t["digest"])
    return t


def decode_tokens(tokens: Any) -> Any:
    """A token list or a ``{"bytes": hex}`` tokens record back to its value."""
    if isinstance(tokens, list):
        return [decode_token(t) for t in tokens]
    if isinstance(tokens, dict) and set(tokens) == {"bytes"}:
        return bytes.fromhex(tokens["bytes"])
    return tokens


def encode_scope(scope: Any) -> Any:
    """A reuse scope as JSON (a ``ReuseScope`` as its fields; a bad value kept as given)."""
    if scope is None:
        return None
    if isinstance(scope, ReuseScope):
        return {"lora_id": scope.lora_id, "salt": scope.salt}
    if isinstance(scope, (str, int, float, bool)):
        return scope
    return {"repr": repr(scope)}


def decode_scope(scope: Any) -> Any:
    """May raise (a bad lora_id/salt): :func:`apply` turns that into an error outcome."""
    if isinstance(scope, dict) and set(scope) <= {"lora_id", "salt"}:
        return ReuseScope(lora_id=scope.get("lora_id"), salt=scope.get("salt"))
    return scope


_TOKEN_ARGS = {"input_tokens", "tokens"}
_CONTAINER_ARGS = {"capacities", "history_lengths"}  # batch ops' int containers (and commit_batch's tokens)


def encode_container(values: Any) -> Any:
    """JSON form of a batch op's int / token container, keeping its type (module docstring)."""
    if values is None or isinstance(values, (str, int, float, bool)):
        return values
    if isinstance(values, (list, tuple)):
        return [encode_token(t) for t in values]
    if isinstance(values, array.array):
        return {"array": values.typecode, "values": values.tolist()}
    module = type(values).__module__.split(".")[0]
    if module in ("numpy", "torch") and hasattr(values, "dtype") and hasattr(values, "tolist"):
        return {module: str(values.dtype).removeprefix("torch."), "values": values.tolist()}
    return encode_tokens(values)


def decode_container(values: Any) -> Any:
    """A recorded token container (a list, or an array / numpy / torch record) back to its value."""
    if isinstance(values, list):
        return [decode_token(t) for t in values]
    if isinstance(values, dict) and "values" in values:
        kind = next((k for k in ("array", "numpy", "torch") if k in values), None)
        try:
            if kind == "array":
                return array.array(values["array"], values["values"])
            if kind == "numpy":
                import numpy

                return numpy.array(values["values"], dtype=values["numpy"])
            if kind == "torch":
                import torch

                return torch.tensor(values["values"], dtype=getattr(torch, values["torch"]))
        except ImportError as e:
            raise OpError(f"a {kind} container needs {e.name}") from None
        except (TypeError, ValueError, AttributeError, OverflowError) as e:
            raise OpError(f"bad {kind} container {values!r}: {e}") from None
    return decode_tokens(values)


class ForeignCache(KVCache):
    """What a batch op's ``{"foreign": ...}`` item becomes: a KVCache of no manager of the
    run (never called: the batch calls reject it before touching it)."""


ForeignCache.__abstractmethods__ = frozenset()  # a placeholder: no method is ever called


def _decode_caches(items: Any, caches: Sequence[KVCache]) -> Any:
    if not isinstance(items, list):
        return items
    out: list[Any] = []
    for it in items:
        if isinstance(it, int) and not isinstance(it, bool):
            out.append(caches[it])
        elif isinstance(it, dict) and set(it) == {"foreign"}:
            out.append(ForeignCache())
        elif isinstance(it, dict) and set(it) == {"value"}:
            out.append(it["value"])
        else:
            out.append(it)
    return out


# the arguments that are copy-op lists: (op name, argument name)
_COPY_OP_ARGS = {("forget_copies", "ops"), ("settle_copies", "failed")}


def encode_copy_ops(ops: Any) -> Any:
    """JSON form of ``forget_copies``' ``ops`` / ``settle_copies``' ``failed`` (module docstring)."""
    if not isinstance(ops, (list, tuple)):
        return normalize(ops)
    return [op.to_json() if isinstance(op, CopyOp) else {"value": normalize(op)} for op in ops]


def decode_copy_ops(ops: Any) -> Any:
    """Recorded copy ops (6-element lists) back to ``CopyOp`` s; other values as they are."""
    if not isinstance(ops, list):
        return ops
    out: list[Any] = []
    for it in ops:
        if isinstance(it, list) and len(it) == 6:
            out.append(CopyOp(*it))
        elif isinstance(it, list) and len(it) == 7 and isinstance(it[6], str):
            out.append(CopyOp(*it[:6], key=bytes.fromhex(it[6])))
        elif isinstance(it, dict) and set(it) == {"value"}:
            out.append(it["value"])
        else:
            out.append(it)
    return out


def _encode_hit(h: Any) -> Any:
    if type(h) is tuple and len(h) == 2 and type(h[0]) is bytes and type(h[1]) is int:
        return [h[0].hex(), h[1]]
    if type(h) in (tuple, list) and len(h) == 2 and type(h[0]) is bytes:
        # bad input that holds a key: {"value": ...} would turn the bytes into a str (the
        # replay would then raise TypeError where the call raised ValueError)
        return {"pair": [h[0].hex(), normalize(h[1])], "type": type(h).__name__}
    return {"value": normalize(h)}


def encode_shared_hits(hits: Any) -> Any:
    """JSON form of ``create_kv_cache``'s ``shared_hits`` (module docstring)."""
    if not isinstance(hits, (list, tuple)):
        return normalize(hits)
    return [_encode_hit(h) for h in hits]


def _decode_hit(h: Any) -> Any:
    if isinstance(h, list) and len(h) == 2 and isinstance(h[0], str):
        return (bytes.fromhex(h[0]), h[1])
    if isinstance(h, dict) and set(h) == {"value"}:
        return h["value"]
    if isinstance(h, dict) and set(h) == {"pair", "type"} and isinstance(h["pair"], list) and len(h["pair"]) == 2:
        pair = (bytes.fromhex(h["pair"][0]), h["pair"][1])
        return list(pair) if h["type"] == "list" else pair
    return h


def decode_shared_hits(hits: Any) -> Any:
    """Recorded shared hits (``[hex key, lc]``) back to ``(bytes, lc)`` pairs; raw bad input
    as it was given."""
    if not isinstance(hits, list):
        return hits
    return [_decode_hit(h) for h in hits]


def encode_args(op: str, args: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call of ``op`` as JSON (tokens, scopes, copy ops, hits in their forms)."""
    out: dict[str, Any] = {}
    for k, v in args.items():
        if (op, k) in _COPY_OP_ARGS:
            out[k] = encode_copy_ops(v)
        elif k == "shared_hits":
            out[k] = encode_shared_hits(v)
        elif k in _CONTAINER_ARGS or (k == "tokens" and op == "commit_batch"):
            out[k] = encode_container(v)
        elif k in _TOKEN_ARGS:
            out[k] = encode_tokens(v)
        elif k == "scope":
            out[k] = encode_scope(v)
        else:
            out[k] = normalize(v)
    return out


# ---------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------


def normalize(value: Any, caches: Sequence[KVCache] = ()) -> Any:
    """A JSON value equal (with ``==``) for equal observable results."""
    # Fast paths for the bulk of a snapshot (token lists, one flat dict per tree node and
    # page), values that are plain JSON already: copied, not walked value by value.
    if type(value) in (list, dict):
        try:
            return _json_copy(value)
        except _NotPlain:
            pass
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, Status):
        return value.name
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (CopyOp, CopyRun, Event)):
        return normalize(value.to_json())
    if isinstance(value, ReuseProbe):
        return [value.num_tokens, value.num_tokens_before_ssm, list(value.block_tiers)]
    if isinstance(value, KVCache):
        for i, c in enumerate(caches):
            if c is value:
                return i
        return {"kvcache": normalize(value.id)}
    if isinstance(value, dict):
        return {str(normalize(k)): normalize(v, caches) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalize(v, caches) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: normalize(getattr(value, f.name), caches) for f in dataclasses.fields(value)}
    if hasattr(value, "tolist"):
        return normalize(value.tolist(), caches)
    return {"repr": repr(value)}


_SCALARS = frozenset({int, str, float, bool, type(None)})


def _plain(items: list) -> bool:
    """All items are exact ``int`` / ``str`` / ``float`` / ``bool`` / ``None`` (no
    subclass): values :func:`normalize` returns unchanged."""
    return set(map(type, items)) <= _SCALARS


class _NotPlain(Exception):
    pass


def _json_copy(v: Any) -> Any:
    """A copy of ``v`` if it is plain JSON already (exact str / int / float / bool / None,
    lists, dicts with str keys): what :func:`normalize` returns for it.  Raises
    :class:`_NotPlain` otherwise."""
    tv = type(v)
    if tv in _SCALARS:
        return v
    if tv is list:
        return list(v) if _plain(v) else [_json_copy(x) for x in v]
    if tv is dict:
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                raise _NotPlain
            tx = type(x)  # inline for the common leaves: one call per dict, not per key
            out[k] = x if tx in _SCALARS else list(x) if tx is list and _plain(x) else _json_copy(x)
        return out
    raise _NotPlain


def error_outcome(exc: BaseException, with_message: bool = False) -> dict[str, Any]:
    """The recorded outcome of a call that raised ``exc``: its type (and message, if asked)."""
    out: dict[str, Any] = {"error": type(exc).__name__}
    if with_message:
        out["message"] = str(exc)
    return out


def recorded_form(op: dict[str, Any], outcome: dict[str, Any], recorded: dict[str, Any] | None) -> dict[str, Any]:
    """``outcome`` of ``op`` in the form ``recorded`` has: a ``probe_reuse_detail`` result
    recorded by a kvcm from before ``ReuseProbe.block_tiers`` (``[m, m_before_ssm]``) is
    compared, and recorded again, without the tiers, so such a log replays as it was
    written, byte for byte.  Anything else is returned as it is."""
    if op.get("op") != "probe_reuse_detail" or recorded is None:
        return outcome
    old, new = recorded.get("result"), outcome.get("result")
    if isinstance(old, list) and len(old) == 2 and isinstance(new, list) and len(new) == 3:
        return {**outcome, "result": new[:2]}
    return outcome


def same_outcome(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Outcomes agree: equal results, or the same error type (messages may differ)."""
    if "error" in a or "error" in b:
        return a.get("error") == b.get("error")
    return a.get("result") == b.get("result")


def cache_props(cache: KVCache, names: Sequence[str] = CACHE_PROPS) -> dict[str, Any]:
    """Every property of a cache (or those in ``names``), normalised (a property that
    raises gives its error)."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = normalize(getattr(cache, name))
        except Exception as e:  # noqa: BLE001 - the error is the observable value
            out[name] = error_outcome(e)
    return out


# ---------------------------------------------------------------------------------------
# apply
# ---------------------------------------------------------------------------------------


def validate_op(op: Any, num_caches: int | None = None) -> None:
    """Raise :class:`OpError` unless ``op`` is well formed."""
    if not isinstance(op, dict) or not isinstance(op.get("op"), str):
        raise OpError(f"an op is a dict with an 'op' name, got {op!r}")
    name = op["op"]
    extra = set(op) - {"op", "args", "cache", "outcome", "message", "m", "step"}
    if extra:
        raise OpError(f"op {name!r}: unknown keys {sorted(extra)}")
    if name in MANAGER_OPS:
        allowed = MANAGER_OPS[name]
        if "cache" in op:
            raise OpError(f"op {name!r} takes no cache handle")
    elif name in CACHE_OPS:
        allowed = CACHE_OPS[name]
        h = op.get("cache")
        if not isinstance(h, int) or isinstance(h, bool) or h < 0:
            raise OpError(f"op {name!r} needs a cache handle (int >= 0), got {h!r}")
        if num_caches is not None and h >= num_caches:
            raise OpError(f"op {name!r}: cache handle {h} does not exist ({num_caches} caches created)")
    else:
        raise OpError(f"unknown op {name!r}; choices: {', '.join(OPS)}")
    args = op.get("args", {})
    if not isinstance(args, dict):
        raise OpError(f"op {name!r}: args must be a dict, got {args!r}")
    unknown = set(args) - set(allowed)
    if unknown:
        raise OpError(f"op {name!r}: unknown args {sorted(unknown)}; allowed: {list(allowed)}")
    items = args.get("caches")
    if name in BATCH_OPS and isinstance(items, list):
        for h in items:
            is_handle = isinstance(h, int) and not isinstance(h, bool)
            if is_handle and (h < 0 or (num_caches is not None and h >= num_caches)):
                raise OpError(f"op {name!r}: cache handle {h} does not exist")


def _make_buffer(size: Any, dtype: Any) -> Any:
    code = _BUFFER_TYPECODES.get(dtype or "int32")
    if code is None or not isinstance(size, int) or size < 0:
        raise OpError(f"page_indices_into: bad buffer spec size={size!r} dtype={dtype!r}")
    if code == "i" and array.array("i").itemsize != 4:  # pragma: no cover - exotic ABI
        code = "l"
    return array.array(code, [BUFFER_FILL] * size)


def written(content: list | None, count: Any) -> list | None:
    """What ``page_indices_into`` wrote: the first ``count`` items, plus anything past
    them that differs from what the buffer held before (it must write nothing there)."""
    if content is None or not isinstance(count, int) or isinstance(count, bool):
        return content
    return content[:count] + [v for v in content[count:] if v != BUFFER_FILL]


def _call(manager: Any, caches: list, op: dict[str, Any]) -> Any:
    name = op["op"]
    raw = op.get("args", {})
    args: dict[str, Any] = {}
    for k, v in raw.items():
        if k in _CONTAINER_ARGS or (k == "tokens" and name == "commit_batch"):
            args[k] = decode_container(v)
        elif (name, k) in _COPY_OP_ARGS:
            args[k] = decode_copy_ops(v)
        elif k == "shared_hits":
            args[k] = decode_shared_hits(v)
        elif k == "caches":
            args[k] = _decode_caches(v, caches)
        elif k in _TOKEN_ARGS:
            args[k] = decode_tokens(v)
        elif k == "scope":
            args[k] = decode_scope(v)
        else:
            args[k] = v
    if name in MANAGER_OPS:
        result = getattr(manager, name)(**args)
        if name == "create_kv_cache":
            caches.append(result)
            return len(caches) - 1
        return normalize(result, caches)
    cache = caches[op["cache"]]
    if name == "fork":
        caches.append(cache.fork(**args))
        return len(caches) - 1
    if name == "page_indices_into":
        buf = _make_buffer(args.pop("size", 0), args.pop("dtype", "int32"))
        count = cache.page_indices_into(args.get("lc"), buf)
        return {"count": normalize(count), "out": written(buf.tolist(), count)}
    return normalize(getattr(cache, name)(**args), caches)


def apply(manager: Any, caches: list, op: dict[str, Any], *, with_message: bool = False) -> dict[str, Any]:
    """Run ``op`` on ``manager``; ``caches`` (created caches by handle) grows on a
    successful ``create_kv_cache`` or ``fork``.  Returns ``{"result": ...}`` or ``{"error": name}``
    (plus ``"message"`` when ``with_message``).  Raises :class:`OpError` for a malformed op."""
    validate_op(op, len(caches))
    try:
        return {"result": _call(manager, caches, op)}
    except OpError:
        raise
    except Exception as e:  # noqa: BLE001 - the error type is the outcome
        return error_outcome(e, with_message)


def op(name: str, cache: int | None = None, **args: Any) -> dict[str, Any]:
    """Build an op from Python values (tokens/scope encoded): ``op("commit", 0, tokens=[1])``."""
    d: dict[str, Any] = {"op": name}
    if cache is not None:
        d["cache"] = cache
    if args:
        d["args"] = encode_args(name, args)
    validate_op(d)
    return d


def dumps(value: Any) -> str:
    """Compact, key-order-stable JSON (one op-log line)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=False, allow_nan=True)


__all__ = [
    "BATCH_OPS",
    "CACHE_OPS",
    "CACHE_PROPS",
    "CREATING_OPS",
    "MANAGER_OPS",
    "OPS",
    "ForeignCache",
    "OpError",
    "apply",
    "cache_props",
    "decode_container",
    "decode_scope",
    "decode_tokens",
    "dumps",
    "encode_args",
    "encode_container",
    "encode_scope",
    "encode_tokens",
    "error_outcome",
    "normalize",
    "op",
    "recorded_form",
    "same_outcome",
    "validate_op",
]
