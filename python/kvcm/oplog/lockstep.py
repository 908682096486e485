"""Lockstep: run the same ops on several managers and report the first divergence
(outcomes, cache properties, ``snapshot()``, ``check_invariants()``).  Used by the log
replay (:mod:`kvcm.oplog.playback`), the minimiser and the parity differential test."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.api import KVCacheManagerConfig
from kvcm.oplog import ops as _ops
from kvcm.oplog.format import _short


@dataclass
class Divergence:
    manager: str
    step: int
    op: dict[str, Any]
    # "outcome" | "snapshot" | "properties" | "invariants" | "crash" | "not_implemented" | "op" | "construct"
    kind: str
    detail: str
    outcomes: dict[str, Any] = field(default_factory=dict)  # "recorded" / side name -> outcome
    line: int | None = None  # the op's line in the replayed log file, when known

    @property
    def signature(self) -> tuple[str, str]:
        """What a minimised sequence must still show: the kind and the op that shows it."""
        return (self.kind, str(self.op.get("op")))

    def __str__(self) -> str:
        lines = [f"first divergence: manager {self.manager}, step {self.step} ({self.kind})"]
        lines.append(f"  op: {_ops.dumps({k: v for k, v in self.op.items() if k not in ('outcome', 'message', 'm')})}")
        for who, out in self.outcomes.items():
            lines.append(f"  {who}: {_ops.dumps(out)}")
        if self.detail:
            lines.append(f"  {self.detail}")
        return "\n".join(lines)


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two JSON values first differ (``None`` when equal), for messages."""
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return f"{path or '<root>'}: {_short(a)} != {_short(b)}"
    if isinstance(a, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}/{k}: present in {'first' if k in a else 'second'} only"
            d = first_difference(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        return None
    return None if a == b else f"{path or '<root>'}: {_short(a)} != {_short(b)}"


# Error types a public call may raise on bad input (sec. 10); anything else is a crash.
DOCUMENTED_ERRORS = frozenset(
    {"ValueError", "TypeError", "KvcmError", "ConfigError", "ClosedError", "InvalidStateError", "OutOfPagesError"}
)


# The cache properties compared after every op for the caches an op may have changed;
# ``committed_tokens`` (a cache's whole token list) waits for a full check.
LIGHT_PROPS: tuple[str, ...] = tuple(p for p in _ops.CACHE_PROPS if p != "committed_tokens")


class Lockstep:
    """Apply ops to several managers at once and check them after every step: equal
    outcomes (and equal to a recorded one, if given), equal cache properties and
    ``snapshot()`` across sides, ``check_invariants()`` on each, no NotImplementedError
    and (with ``allowed_errors``) no undocumented error type.  Records each op with the
    first side's outcome, so :meth:`log` is a replayable op log of what ran.

    ``step(op, full=False)`` checks only what an op can change at the cost of the op: the
    outcomes, the properties (all but ``committed_tokens``) of the caches the op names or
    creates and of every cache not yet closed, and ``stats()`` -- a digest of the whole
    state that moves with every page, request and event.  :meth:`full_check` compares
    the rest (every cache's properties, ``snapshot()``, ``check_invariants()``); the log
    replay calls it on an amortised schedule and locates a failure exactly by re-running
    (:mod:`kvcm.oplog.playback`).  ``step(op)`` does both, as before."""

    def __init__(
        self,
        managers: Sequence[Any],
        names: Sequence[str],
        *,
        check_invariants: bool = True,
        allowed_errors: frozenset[str] | None = None,
        m: str = "0",
    ) -> None:
        self.managers = list(managers)
        self.names = list(names)
        self.caches: list[list] = [[] for _ in self.managers]
        self.check = check_invariants
        self.allowed = allowed_errors
        self.m = m
        self.records: list[dict[str, Any]] = []
        self._open: set[int] = set()  # handles whose last seen status was not CLOSED

    def step(self, op: dict[str, Any], recorded: dict[str, Any] | None = None, *, full: bool = True) -> Divergence | None:
        i = len(self.records)
        outcomes: dict[str, Any] = {}
        if recorded is not None:
            outcomes["recorded"] = recorded
        outs = []
        for name, mgr, cs in zip(self.names, self.managers, self.caches):
            try:
                out = _ops.recorded_form(op, _ops.apply(mgr, cs, op, with_message=True), recorded)
            except _ops.OpError as e:
                return Divergence(self.m, i, op, "op", f"malformed op: {e}", outcomes)
            outs.append(out)
            outcomes[name if name not in outcomes else f"{name}#{len(outs)}"] = out
        rec = dict(op)
        rec["outcome"] = {k: v for k, v in outs[0].items() if k != "message"}
        self.records.append(rec)

        def div(kind: str, detail: str) -> Divergence:
            return Divergence(self.m, i, op, kind, detail, outcomes)

        for name, out in zip(self.names, outs):
            if out.get("error") == "NotImplementedError":
                return div("not_implemented", f"{name}: {out.get('message')}")
        ref_name, ref = next(iter(outcomes.items()))
        for who, out in outcomes.items():
            if not _ops.same_outcome(ref, out):
                return div("outcome", f"{ref_name} and {who} disagree")
        err = outs[0].get("error")
        if self.allowed is not None and err is not None and err not in self.allowed:
            return div("crash", f"{err}: {outs[0].get('message')} is not a documented error of a public call")
        if len(self.managers) > 1:
            d = self._light(op)
            if d is not None:
                return div(*d)
        if full:
            d = self._full()
            if d is not None:
                return div(*d)
        return None

    def full_check(self) -> Divergence | None:
        """The checks ``step(op, full=False)`` left out, for the state after the last op
        (reported at that op)."""
        d = self._full()
        if d is None:
            return None
        rec = self.records[-1] if self.records else {"op": "<construct>"}
        op = {k: v for k, v in rec.items() if k != "outcome"}
        return Divergence(self.m, len(self.records) - 1, op, d[0], d[1])

    def _touched(self, op: dict[str, Any]) -> set[int]:
        n = len(self.caches[0])
        hs = set(self._open)
        h = op.get("cache")
        if isinstance(h, int) and not isinstance(h, bool) and 0 <= h < n:
            hs.add(h)
        items = op.get("args", {}).get("caches") if isinstance(op.get("args"), dict) else None
        if isinstance(items, list):
            hs.update(x for x in items if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n)
        if op.get("op") == "create_kv_cache" and n:
            hs.add(n - 1)
        return hs

    def _light(self, op: dict[str, Any]) -> tuple[str, str] | None:
        if any(len(cs) != len(self.caches[0]) for cs in self.caches):
            return ("properties", "the sides hold different numbers of caches")
        for h in sorted(self._touched(op)):
            props = [_ops.cache_props(cs[h], LIGHT_PROPS) for cs in self.caches]
            for name, p in zip(self.names[1:], props[1:]):
                if p != props[0]:
                    return ("properties", f"cache {h}: {self.names[0]} vs {name}: {first_difference(props[0], p)}")
            if props[0].get("status") == "CLOSED":
                self._open.discard(h)
            else:
                self._open.add(h)
        return self._same_across("stats")

    def _same_across(self, call: str) -> tuple[str, str] | None:
        """``mgr.<call>()`` (``stats`` or ``snapshot``) normalised on every manager: the first
        difference from the first manager's, or a failing call, as a divergence."""
        values = []
        for name, mgr in zip(self.names, self.managers):
            try:
                values.append(_ops.normalize(getattr(mgr, call)()))
            except Exception as e:  # noqa: BLE001 - any failure is the divergence
                kind = "not_implemented" if isinstance(e, NotImplementedError) else "snapshot"
                return (kind, f"{call}() on {name}: {type(e).__name__}: {e}")
        for name, v in zip(self.names[1:], values[1:]):
            if v != values[0]:  # == first (C speed); first_difference only to say where
                d = first_difference(values[0], v) or "(equal values of different types)"
                return ("snapshot", f"{call}({self.names[0]}) vs {call}({name}): {d}")
        return None

    def _full(self) -> tuple[str, str] | None:
        if len(self.managers) > 1:
            for h in range(len(self.caches[0])):
                props = [_ops.cache_props(cs[h]) for cs in self.caches]
                for name, p in zip(self.names[1:], props[1:]):
                    if p != props[0]:
                        return ("properties", f"cache {h}: {self.names[0]} vs {name}: {first_difference(props[0], p)}")
            found = self._same_across("snapshot")
            if found is not None:
                return found
        if self.check:
            for name, mgr in zip(self.names, self.managers):
                try:
                    mgr.check_invariants()
                except Exception as e:  # noqa: BLE001 - any failure is the divergence
                    kind = "not_implemented" if isinstance(e, NotImplementedError) else "invariants"
                    return (kind, f"check_invariants() on {name}: {type(e).__name__}: {e}")
        return None


def run_ops(
    config: KVCacheManagerConfig,
    factory: Callable[[KVCacheManagerConfig], Sequence[Any]],
    names: Sequence[str],
    ops: Sequence[dict[str, Any]],
    *,
    allowed_errors: frozenset[str] | None = None,
    check_invariants: bool = True,
) -> tuple[Divergence | None, list[dict[str, Any]]]:
    """Run ``ops`` in lockstep on fresh managers from ``factory``; handles refer to the
    creates of ``ops`` *as recorded* (an op whose cache was not created here is skipped),
    so any subsequence of a log can be run.  Returns the first divergence (or None) and
    the records of the ops that ran, renumbered: a replayable log body."""
    try:
        managers = factory(config)
    except Exception as e:  # noqa: BLE001 - a side that cannot build the config diverges
        kind = "not_implemented" if isinstance(e, NotImplementedError) else "construct"
        return Divergence("0", -1, {"op": "<construct>"}, kind, f"{type(e).__name__}: {e}"), []
    ls = Lockstep(managers, names, allowed_errors=allowed_errors, check_invariants=check_invariants)
    handles: dict[int, int] = {}
    for op in ops:
        op = {k: v for k, v in op.items() if k in ("op", "args", "cache", "outcome")}
        recorded_handle = op.pop("outcome", {}).get("result") if op["op"] in _ops.CREATING_OPS else None
        if "cache" in op:
            if op["cache"] not in handles:
                continue
            op["cache"] = handles[op["cache"]]
        items = op.get("args", {}).get("caches")
        if op["op"] in _ops.BATCH_OPS and isinstance(items, list):
            def is_handle(h: Any) -> bool:
                return isinstance(h, int) and not isinstance(h, bool)

            if any(is_handle(h) and h not in handles for h in items):
                continue  # a cache of the batch was not created in this subsequence
            op["args"] = dict(op["args"], caches=[handles[h] if is_handle(h) else h for h in items])
        d = ls.step(op)
        if d is not None:
            return d, ls.records
        result = ls.records[-1]["outcome"].get("result")
        if op["op"] in _ops.CREATING_OPS and isinstance(recorded_handle, int) and isinstance(result, int):
            handles[recorded_handle] = result
    return None, ls.records
