"""The ``cpp`` backend: the C++ core (``kvcm._kvcm_cpp``) behind the shared interface.

The manager, its caches, the radix tree and block keys all run in C++
(``cpp/core/``, one file per concept like ``python_backend/``; a faithful port of the python
reference backend).  This module
is the thin Python face: arguments are validated here with the shared checks of
:mod:`kvcm.checks`, in the same order as the python backend, so bad input raises the same
errors on both; the core then does the work with the GIL released and the manager's
mutex held.  Caches are addressed in C++ by their creation serial; ids live here.
"""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvcm.api import (
    ClosedError,
    CopyOp,
    CopyRun,
    Event,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    ReuseProbe,
    ReuseScope,
    Status,
    Token,
)
from kvcm.checks import (
    FORGET_IN_EXPLICIT,
    MAX_COUNT,
    NOTHING_TO_SETTLE,
    SETTLE_IN_DRAIN,
    check_batch_caches,
    check_block_range,
    check_cache_id,
    check_copy_ops,
    check_count,
    check_lc,
    check_priority,
    check_scope,
    check_shared_hits,
    check_tokens,
    closed_error,
    default_cache_id,
    fork_room_error,
    int32_view,
    not_in_oldest_drain_error,
    not_issued_error,
    quota_refused_error,
    status_error,
)
from kvcm.config import LifeCycle, resolve_config, resolve_quota

# The compiled core, loaded by name: import analysis reads .py files only, so `from kvcm
# import _kvcm_cpp` would read as an import of the package kvcm/__init__ (DECISIONS "The
# outer house's floor plan"); the extension is a leaf.
_kvcm_cpp = importlib.import_module("kvcm._kvcm_cpp")

COPY_REASONS = ("offload", "onboard", "cow", "snapshot", "store", "relocate")
_parse_tokens = _kvcm_cpp.parse_tokens


def block_keys_cpp(tokens: Any, tokens_per_block: int, scope: ReuseScope | None = None) -> list[bytes]:
    """``kvcm.block_keys`` on the C++ core: same keys, same errors as ``block_keys_py``."""
    if type(tokens_per_block) is not int or not 1 <= tokens_per_block <= 4096:
        raise ValueError(f"tokens_per_block must be an int in 1..4096, got {tokens_per_block!r}")
    if scope is None:
        return _kvcm_cpp.block_keys(tokens, tokens_per_block)
    try:
        scope = check_scope(scope)  # re-validated: a ReuseScope can be forged
    except (TypeError, ValueError):
        check_tokens(tokens)  # block_keys_py checks the tokens before the scope; keep that error order
        raise
    return _kvcm_cpp.block_keys(tokens, tokens_per_block, scope.lora_id, scope.salt)


_STATUS = (Status.SUSPENDED, Status.ACTIVE, Status.CLOSED)


def _core_ops(ops: list[CopyOp], refuse: Callable[[int, CopyOp], ValueError]) -> list[tuple]:
    """Type-checked copy ops as the core takes them; an op the core cannot hold (a value
    outside int64, an unknown reason, a key that is no block key) was never issued:
    ``refuse(i, op)`` is raised."""
    items = []
    for i, op in enumerate(ops):
        values = (op.lc, op.src_tier, op.src_slot, op.dst_tier, op.dst_slot)
        if (op.reason not in COPY_REASONS or not all(-MAX_COUNT <= v < MAX_COUNT for v in values)
                or (op.key is not None and len(op.key) != 32)):
            raise refuse(i, op)  # (the core compares int64s and C strings)
        items.append((*values, op.reason, b"" if op.key is None else op.key))
    return items


class CppKVCacheManager(KVCacheManager):
    backend_name = "cpp"

    def __init__(self, config: KVCacheManagerConfig, *, backend: str | None = None) -> None:
        # ``backend`` arrives when built through kvcm.KVCacheManager(config, backend=...)
        rc = resolve_config(config)  # the shared validator: identical ConfigError
        self._rc = rc
        self._config = config
        lcs = [(lc.kind == "ssm", -1 if lc.window is None else lc.window, lc.sinks, lc.slot_bytes)
               for lc in rc.life_cycles]
        self._core = _kvcm_cpp.Manager(
            config.tokens_per_block, lcs, [list(s) for s in rc.slots], list(rc.tier_kinds),
            config.enable_partial_reuse, config.reuse_match_backoff, float(config.max_util_for_resume),
            config.max_events, shared_tier=rc.has_shared, shared_write_evict=rc.shared_write_evict,
            quota_bytes=list(rc.quotas), explicit_settlement=rc.explicit_settlement)
        self._core.set_pending_copy_ops_warning(config.pending_copy_ops_warning)
        self._open: dict[int, CppKVCache] = {}  # serial -> open cache
        self._ids: set[int | str] = set()  # ids of the open caches
        # held while a cache is created or closed: the open ids, and a cache's final record
        # (a property read that finds the cache closed in the core waits here for it)
        self._lock = threading.Lock()

    @property
    def config(self) -> KVCacheManagerConfig:
        return self._config

    @property
    def life_cycles(self) -> tuple[LifeCycle, ...]:
        return self._rc.life_cycles

    def _create_kv_cache(self, input_tokens: Sequence[Token] | None, scope: ReuseScope | None, priority: int | None,
                         id: int | str | None, shared_hits: Any) -> KVCache:
        # check_tokens, without a Python loop; first, so any Python code the tokens run
        # (tolist, __iter__) runs before this call looks at any state
        tokens = _parse_tokens(() if input_tokens is None else input_tokens, "input_tokens")
        scope = check_scope(scope)
        prio = check_priority(priority, self._config.default_priority)
        cache_id = check_cache_id(id)
        hits = check_shared_hits(shared_hits, len(self._rc.life_cycles), self._rc.has_shared)
        with self._lock:  # the open ids change only under it (create / close from several threads)
            if cache_id is not None and cache_id in self._ids:
                raise ValueError(f"id {cache_id!r} is already used by an open cache")
            serial = self._core.create(tokens, scope.lora_id, scope.salt, prio, hits)
            if cache_id is None:
                cache_id = default_cache_id(serial, self._ids)
            cache = CppKVCache(self, serial, cache_id, prio)
            self._open[serial] = cache
            self._ids.add(cache_id)
        return cache

    def probe_reuse(self, tokens: Sequence[Token], scope: ReuseScope | None = None, shared_hits: Any = None) -> int:
        return self._probe(tokens, scope, shared_hits, False)[0]

    def probe_reuse_detail(self, tokens: Sequence[Token], scope: ReuseScope | None = None,
                           shared_hits: Any = None) -> ReuseProbe:
        m, mbs, tiers = self._probe(tokens, scope, shared_hits, True)
        return ReuseProbe(m, mbs, tuple(tiers))

    def _probe(self, tokens: Any, scope: Any, shared_hits: Any, block_tiers: bool) -> tuple[int, int, list[int]]:
        """The probes' checks and core call (``probe_reuse`` leaves the tiers out)."""
        toks = _parse_tokens(tokens, "tokens")
        scope = check_scope(scope)
        hits = check_shared_hits(shared_hits, len(self._rc.life_cycles), self._rc.has_shared)
        return self._core.probe(toks, scope.lora_id, scope.salt, hits, block_tiers)

    def shared_candidates(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> list[tuple[bytes, int]]:
        toks = _parse_tokens(tokens, "tokens")
        scope = check_scope(scope)
        return self._core.shared_candidates(toks, scope.lora_id, scope.salt)

    def drain_copy_ops(self) -> list[CopyOp]:
        return self._core.drain_copy_ops()

    def drain_copy_runs(self) -> list[CopyRun]:
        return self._core.drain_copy_runs()  # kvcm.api.copy_runs's rule, in C++ (manager_bindings.cpp)

    def forget_copies(self, ops: Sequence[CopyOp]) -> list[int | str]:
        ops = check_copy_ops(ops)
        if self._rc.explicit_settlement:  # (the core refuses it too; first, as the python backend)
            raise ValueError(FORGET_IN_EXPLICIT)
        serials = self._core.forget_copies(_core_ops(ops, not_issued_error))
        return [self._open[s]._id for s in serials]

    def settle_copies(self, failed: Sequence[CopyOp] = ()) -> list[int | str]:
        failed = check_copy_ops(failed, "settle_copies", "failed")
        # the core's checks, in the python backend's order, come before an op it cannot hold
        if not self._rc.explicit_settlement:
            raise ValueError(SETTLE_IN_DRAIN)
        if not self._core.unsettled_drains():
            raise ValueError(NOTHING_TO_SETTLE)
        serials = self._core.settle_copies(_core_ops(failed, not_in_oldest_drain_error))
        return [self._open[s]._id for s in serials]

    @property
    def unsettled_drains(self) -> int:
        return self._core.unsettled_drains()

    def clear_reusable(self) -> None:
        self._core.clear_reusable()

    def set_quota(self, tier: str | int, quota_bytes: int) -> None:
        pos, q, per_lc = resolve_quota(self._rc, tier, quota_bytes)
        refused = self._core.set_quota(pos, q, list(per_lc))
        if refused:
            lc, n, need, locked, held = refused
            raise quota_refused_error(self._rc.tier_kinds[pos], q, lc, n, need, locked, held)

    def shutdown(self) -> None:
        self._core.shutdown()

    def stats(self) -> dict:
        return json.loads(self._core.stats_json(False))

    def take_iteration_stats(self) -> dict:
        return json.loads(self._core.stats_json(True))

    def take_events(self) -> list[Event]:
        return self._core.take_events()

    def snapshot(self) -> dict:
        snap = json.loads(self._core.snapshot_json())
        for r in snap["requests"]:
            cache = self._open.get(r["serial"])
            r["id"] = cache._id if cache is not None else r["serial"]
        return snap

    def check_invariants(self) -> None:
        self._core.check_invariants()

    # ---------------------------------------------------------------- batched decode step

    def resize_batch(self, caches: Sequence[KVCache], capacities: Any, history_lengths: Any = None) -> list[bool]:
        return _kvcm_cpp.resize_batch(self._core, self._batch_keys(caches, "resize_batch"), capacities,
                                      history_lengths)

    def commit_batch(self, caches: Sequence[KVCache], tokens: Any) -> None:
        _kvcm_cpp.commit_batch(self._core, self._batch_keys(caches, "commit_batch"), tokens)

    def _batch_keys(self, caches: Sequence[KVCache], what: str) -> list[tuple]:
        """Each cache's ``_batch_key`` (its manager's core, its serial): the core tells this
        manager's caches from others by the core's identity and reports foreign caches
        and duplicates in batch order.  One comprehension with one attribute load per
        cache: this is the whole per-cache Python cost of a batched call."""
        if type(caches) is not list and (not isinstance(caches, Sequence) or isinstance(caches, (str, bytes))):
            raise TypeError(f"{what}(): caches must be a sequence of KVCache, got {type(caches).__name__}")
        try:
            return [c._batch_key for c in caches]
        except AttributeError:
            pass
        # an item that is no CppKVCache: report the first bad item, in batch order
        check_batch_caches(what, caches, lambda c: isinstance(c, CppKVCache) and c._mgr is self, lambda c: c._serial)
        raise AssertionError("kvcm bug: a batch item without _batch_key passed every check")


class CppKVCache(KVCache):
    def __init__(self, mgr: CppKVCacheManager, serial: int, cache_id: int | str, priority: int) -> None:
        self._mgr = mgr
        self._core = mgr._core
        self._serial = serial
        self._id = cache_id
        self._prio = priority
        self._final: tuple | None = None  # (info, committed tokens) once closed
        self._batch_key = (self._core, serial)  # what resize_batch / commit_batch pass to the core

    # ------------------------------------------------------------------ properties

    def _info(self) -> tuple:
        final = self._final
        if final is not None:
            return final[0]
        try:
            return self._core.info(self._serial)
        except ClosedError:
            return self._final_record()[0]

    def _final_record(self) -> tuple:
        """The record close() leaves behind, for a read that found the cache closed in the
        core: another thread is closing it and sets the record under the manager's lock."""
        with self._mgr._lock:
            final = self._final
        if final is None:
            raise AssertionError("kvcm bug: a cache closed in the core has no final record")
        return final

    @property
    def id(self) -> int | str:
        return self._id

    @property
    def status(self) -> Status:
        return _STATUS[self._info()[0]]

    @property
    def capacity(self) -> int:
        return self._info()[2]

    @property
    def history_length(self) -> int:
        return self._info()[3]

    @property
    def num_committed_tokens(self) -> int:
        return self._info()[4]

    @property
    def committed_tokens(self) -> list[Token]:
        final = self._final
        if final is None:
            try:
                return self._core.committed_tokens(self._serial)
            except ClosedError:
                final = self._final_record()
        return final[1].tolist()

    @property
    def num_reused_tokens(self) -> int:
        return self._info()[5]

    @property
    def priority(self) -> int:
        return self._prio

    # ------------------------------------------------------------------ life cycle

    def _require_open(self, what: str) -> None:
        if self._final is not None:
            raise closed_error(what)

    def _require(self, status: Status, what: str) -> tuple:
        self._require_open(what)
        info = self._core.info(self._serial)
        have = _STATUS[info[0]]
        if have != status:
            raise status_error(what, status, have)
        return info

    def resume(self) -> bool:
        self._require_open("resume")
        return self._core.resume(self._serial)

    def suspend(self) -> None:
        self._require_open("suspend")
        self._core.suspend(self._serial)

    def resize(self, capacity: int, history_length: int | None = None) -> bool:
        self._require_open("resize")
        # status, then kvcm.checks.check_count on both arguments, then the resize (all in C++)
        return self._core.resize(self._serial, capacity, history_length)

    def commit(self, tokens: Sequence[Token]) -> None:
        # the tokens first (kvcm.checks.check_tokens semantics): any Python code they run
        # cannot slip a commit past a suspend or close; then status, stopped, room.  The
        # binding parses them and the core checks the rest, in one call.
        if self._final is not None:
            _parse_tokens(tokens, "tokens")
            self._require_open("commit")
        self._core.commit(self._serial, tokens)

    def commit_input(self, n: int | None = None) -> None:
        if n is not None:
            n = check_count(n, "n")  # the argument first, as the python backend
        self._require_open("commit_input")
        self._core.commit_input(self._serial, n)

    def stop_committing(self) -> None:
        self._require_open("stop_committing")
        self._core.stop_committing(self._serial)

    def close(self) -> None:
        if self._final is not None:
            return
        mgr = self._mgr
        with mgr._lock:
            closed = self._core.close(self._serial)  # final state; tokens moved out of the core, decoded on demand
            if not closed.closed_now:  # another thread closed it first
                return
            self._final = (closed.info, closed)
            mgr._open.pop(self._serial, None)
            mgr._ids.discard(self._id)

    def fork(self, id: int | str | None = None) -> KVCache:
        """Forks (DECISIONS.md "Forks (issue 22)"): the python backend's order of checks —
        closed, the id's type, the id in use, then status, history and room in the core."""
        self._require_open("fork")
        cache_id = check_cache_id(id)
        mgr = self._mgr
        with mgr._lock:  # the open ids change only under it (as create_kv_cache)
            if cache_id is not None and cache_id in mgr._ids:
                raise ValueError(f"id {cache_id!r} is already used by an open cache")
            serial = self._core.fork(self._serial)
            if serial < 0:
                raise fork_room_error()
            if cache_id is None:
                cache_id = default_cache_id(serial, mgr._ids)
            child = CppKVCache(mgr, serial, cache_id, self._prio)
            mgr._open[serial] = child
            mgr._ids.add(cache_id)
        return child

    def page_indices(self, lc: int, start: int = 0, stop: int | None = None) -> list[int]:
        self._require(Status.ACTIVE, "page_indices")
        lc = self._check_lc(lc)
        if start == 0 and stop is None:
            return self._core.page_indices(self._serial, lc, 0, -1)
        rc = self._mgr._rc
        n = 1 if lc == rc.ssm_lc else -(-self.capacity // rc.tokens_per_block)
        start, stop = check_block_range(start, stop, n)
        return self._core.page_indices(self._serial, lc, start, stop)

    def page_indices_into(self, lc: int, out: Any) -> int:
        self._require(Status.ACTIVE, "page_indices_into")
        lc = self._check_lc(lc)
        view = int32_view(out)
        return self._core.page_indices_into(self._serial, lc, view)

    def _check_lc(self, lc: Any) -> int:
        return check_lc(lc, len(self._mgr._rc.life_cycles))


__all__ = ["CppKVCache", "CppKVCacheManager", "block_keys_cpp"]
