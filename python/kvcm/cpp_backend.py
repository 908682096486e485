"""The ``cpp`` backend: the C++ core (``kvcm._kvcm_cpp``) behind the shared interface.

The manager, its caches, the radix tree and block keys all run in C++
(``cpp/core/manager.cpp``; a faithful port of the python reference backend).  This module
is the thin Python face: arguments are validated here with the shared checks of
:mod:`kvcm.api`, in the same order as the python backend, so bad input raises the same
errors on both; the core then does the work with the GIL released and the manager's
mutex held.  Caches are addressed in C++ by their creation serial; ids live here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvcm import _kvcm_cpp
from kvcm.api import (
    ClosedError,
    CopyOp,
    Event,
    InvalidStateError,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    LifeCycle,
    ReuseProbe,
    ReuseScope,
    Status,
    Token,
    check_batch_caches,
    check_priority,
    check_scope,
    check_tokens,
    int32_view,
    resolve_config,
)

RadixTree = _kvcm_cpp.RadixTree
_parse_tokens = _kvcm_cpp.parse_tokens


def block_keys_cpp(tokens: Any, tokens_per_block: int, scope: ReuseScope | None = None) -> list[bytes]:
    """``kvcm.block_keys`` on the C++ core: same keys, same errors as ``block_keys_py``."""
    if type(tokens_per_block) is not int or not 1 <= tokens_per_block <= 4096:
        raise ValueError(f"tokens_per_block must be an int in 1..4096, got {tokens_per_block!r}")
    if scope is not None and not isinstance(scope, ReuseScope):
        # block_keys_py checks the tokens before the scope; keep that error order.
        check_tokens(tokens)
        check_scope(scope)
    if scope is None:
        return _kvcm_cpp.block_keys(tokens, tokens_per_block)
    return _kvcm_cpp.block_keys(tokens, tokens_per_block, scope.lora_id, scope.salt)


_STATUS = (Status.SUSPENDED, Status.ACTIVE, Status.CLOSED)


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
            config.max_events)
        self._core.set_pending_copy_ops_warning(config.pending_copy_ops_warning)
        self._open: dict[int, CppKVCache] = {}  # serial -> open cache

    @property
    def config(self) -> KVCacheManagerConfig:
        return self._config

    @property
    def life_cycles(self) -> tuple[LifeCycle, ...]:
        return self._rc.life_cycles

    def create_kv_cache(
        self,
        input_tokens: Sequence[Token] | None = None,
        scope: ReuseScope | None = None,
        priority: int | None = None,
        id: int | str | None = None,
    ) -> KVCache:
        tokens = _parse_tokens(input_tokens, "input_tokens")  # check_tokens, without a Python loop
        scope = check_scope(scope)
        prio = check_priority(priority, self._config.default_priority)
        if id is not None:
            if isinstance(id, bool) or not isinstance(id, (int, str)):
                raise TypeError(f"id must be an int or str, got {type(id).__name__}")
            if any(c._id == id for c in list(self._open.values())):
                raise ValueError(f"id {id!r} is already used by an open cache")
        serial = self._core.create(tokens, scope.lora_id, scope.salt, prio)
        cache = CppKVCache(self, serial, serial if id is None else id, prio)
        self._open[serial] = cache
        return cache

    def probe_reuse(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> int:
        return self.probe_reuse_detail(tokens, scope).num_tokens

    def probe_reuse_detail(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> ReuseProbe:
        toks = _parse_tokens(tokens, "tokens")
        scope = check_scope(scope)
        m, mbs = self._core.probe(toks, scope.lora_id, scope.salt)
        return ReuseProbe(m, mbs)

    def drain_copy_ops(self) -> list[CopyOp]:
        return self._core.drain_copy_ops()

    def clear_reusable(self) -> None:
        self._core.clear_reusable()

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
        if self._final is not None:
            return self._final[0]
        return self._core.info(self._serial)

    @property
    def id(self) -> int | str:
        return self._id

    @property
    def status(self) -> Status:
        if self._final is not None:
            return Status.CLOSED
        return _STATUS[self._core.info(self._serial)[0]]

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
        if self._final is not None:
            return self._final[1].tolist()
        return self._core.committed_tokens(self._serial)

    @property
    def num_reused_tokens(self) -> int:
        return self._info()[5]

    @property
    def priority(self) -> int:
        return self._prio

    # ------------------------------------------------------------------ life cycle

    def _require_open(self, what: str) -> None:
        if self._final is not None:
            raise ClosedError(f"{what}() on a closed cache")

    def _require(self, status: Status, what: str) -> tuple:
        self._require_open(what)
        info = self._core.info(self._serial)
        have = _STATUS[info[0]]
        if have != status:
            raise InvalidStateError(f"{what}() needs a {status.value} cache, this one is {have.value}")
        return info

    def resume(self) -> bool:
        self._require_open("resume")
        return self._core.resume(self._serial)

    def suspend(self) -> None:
        self._require_open("suspend")
        self._core.suspend(self._serial)

    def resize(self, capacity: int, history_length: int | None = None) -> bool:
        self._require_open("resize")
        # status, then kvcm.api.check_count on both arguments, then the resize (all in C++)
        return self._core.resize(self._serial, capacity, history_length)

    def commit(self, tokens: Sequence[Token]) -> None:
        self._require_open("commit")
        # status, stopped, then kvcm.api.check_tokens semantics, then the commit (all in C++)
        self._core.commit(self._serial, tokens)

    def stop_committing(self) -> None:
        self._require_open("stop_committing")
        self._core.stop_committing(self._serial)

    def close(self) -> None:
        if self._final is not None:
            return
        closed = self._core.close(self._serial)  # final state; tokens moved out of the core, decoded on demand
        if not closed.closed_now:  # another thread closed it first
            return
        self._final = (closed.info, closed)
        self._mgr._open.pop(self._serial, None)

    def page_indices(self, lc: int) -> list[int]:
        self._require(Status.ACTIVE, "page_indices")
        self._check_lc(lc)
        return self._core.page_indices(self._serial, lc)

    def page_indices_into(self, lc: int, out: Any) -> int:
        self._require(Status.ACTIVE, "page_indices_into")
        self._check_lc(lc)
        view = int32_view(out)
        return self._core.page_indices_into(self._serial, lc, view)

    def _check_lc(self, lc: Any) -> None:
        if isinstance(lc, bool) or not isinstance(lc, int):
            raise TypeError(f"lc must be an int, got {type(lc).__name__}")
        n = len(self._mgr._rc.life_cycles)
        if not 0 <= lc < n:
            raise ValueError(f"unknown life cycle {lc}; this model has {n}")


__all__ = ["CppKVCache", "CppKVCacheManager", "RadixTree", "block_keys_cpp"]
