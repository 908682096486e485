"""Minimising a divergence: delta debugging over a log's ops down to a 1-minimal
subsequence that still shows it (sec. 13: "the shortest op sequence that shows it")."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcm.api import KVCacheManagerConfig
from kvcm.oplog.lockstep import run_ops


def minimize(
    config: KVCacheManagerConfig,
    factory: Callable[[KVCacheManagerConfig], Sequence[Any]],
    names: Sequence[str],
    ops: Sequence[dict[str, Any]],
    signature: tuple[str, str],
    *,
    allowed_errors: frozenset[str] | None = None,
    budget_s: float = 120.0,
) -> list[dict[str, Any]]:
    """A short subsequence of ``ops`` (creates carrying their recorded outcomes, so handles
    can be remapped) that still diverges with ``signature``: delta debugging down to
    single-op removals (1-minimal: removing any one op loses the divergence), returned as
    replayable records.  Pass the ops up to the divergence only.  Stops improving after
    ``budget_s`` seconds (the result is then merely shorter)."""
    deadline = time.monotonic() + budget_s
    ops = [dict(o) for o in ops]

    def fails(candidate: list[dict[str, Any]]) -> bool:
        d, _ = run_ops(config, factory, names, candidate, allowed_errors=allowed_errors)
        return d is not None and d.signature == signature

    if not fails(ops):
        return run_ops(config, factory, names, ops, allowed_errors=allowed_errors)[1]
    n = 2
    while len(ops) >= 2 and time.monotonic() < deadline:
        chunk = max(1, len(ops) // n)
        reduced = False
        for start in range(0, len(ops), chunk):
            candidate = ops[:start] + ops[start + chunk :]
            if candidate and fails(candidate):
                ops = candidate
                n = max(n - 1, 2)
                reduced = True
                break
            if time.monotonic() >= deadline:
                break
        if not reduced:
            if chunk == 1:
                break
            n = min(len(ops), n * 2)
    return run_ops(config, factory, names, ops, allowed_errors=allowed_errors)[1]
