"""The ``cpp`` backend: the C++ core (``kvcm._kvcm_cpp``) behind the shared interface.

Stage 1: block keys and the radix tree are in C++; the manager itself is not yet
(issue #3).  Unimplemented methods validate their arguments exactly like the python
backend first (so bad input raises the same TypeError/ValueError on both) and then raise
NotImplementedError; they never return a fake value.
"""

from __future__ import annotations

from typing import Any, NoReturn, Sequence

from kvcm import _kvcm_cpp
from kvcm.api import (
    CopyOp,
    Event,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    LifeCycle,
    ReuseProbe,
    ReuseScope,
    Token,
    check_priority,
    check_scope,
    check_tokens,
    resolve_config,
)

RadixTree = _kvcm_cpp.RadixTree


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


def _not_yet(name: str) -> NoReturn:
    raise NotImplementedError(f"cpp backend: {name} is not implemented yet (issue #3)")


class CppKVCacheManager(KVCacheManager):
    backend_name = "cpp"

    def __init__(self, config: KVCacheManagerConfig) -> None:
        self._rc = resolve_config(config)  # the shared validator: identical ConfigError
        self._config = config

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
        check_tokens(input_tokens, "input_tokens")
        check_scope(scope)
        check_priority(priority, self._config.default_priority)
        if id is not None and (isinstance(id, bool) or not isinstance(id, (int, str))):
            raise TypeError(f"id must be an int or str, got {type(id).__name__}")
        _not_yet("create_kv_cache")

    def probe_reuse(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> int:
        check_tokens(tokens)
        check_scope(scope)
        _not_yet("probe_reuse")

    def probe_reuse_detail(self, tokens: Sequence[Token], scope: ReuseScope | None = None) -> ReuseProbe:
        check_tokens(tokens)
        check_scope(scope)
        _not_yet("probe_reuse_detail")

    def drain_copy_ops(self) -> list[CopyOp]:
        _not_yet("drain_copy_ops")

    def clear_reusable(self) -> None:
        _not_yet("clear_reusable")

    def shutdown(self) -> None:
        _not_yet("shutdown")

    def stats(self) -> dict:
        _not_yet("stats")

    def take_iteration_stats(self) -> dict:
        _not_yet("take_iteration_stats")

    def take_events(self) -> list[Event]:
        _not_yet("take_events")

    def snapshot(self) -> dict:
        _not_yet("snapshot")

    def check_invariants(self) -> None:
        _not_yet("check_invariants")


__all__ = ["CppKVCacheManager", "RadixTree", "block_keys_cpp"]
