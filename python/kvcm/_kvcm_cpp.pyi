"""kvcm C++ core (nanobind bindings)"""

from collections.abc import Sequence


def block_keys(tokens: object, tokens_per_block: int, lora_id: int | None = None, salt: int | None = None) -> list[bytes]:
    """
    One SHA-256 key per full or partial block of ``tokens`` (SPEC sec. 3).  Tokens are validated like kvcm.checks.check_tokens; the GIL is released while hashing.
    """

def scope_root_key(lora_id: int | None = None, salt: int | None = None) -> bytes:
    """
    sha256(mask || lora_le64? || salt_le64?), the root key of a ReuseScope.
    """

def sha256(data: bytes | bytearray | memoryview) -> bytes:
    """SHA-256 digest of a bytes-like object."""

def sha256_impl() -> str:
    """The SHA-256 compression in use: 'shani' or 'portable'."""

def sha256_shani_available() -> bool:
    """True when the CPU supports SHA-NI."""

def build_info() -> dict:
    """Build details for `python -m kvcm info`."""

class Tokens:
    """A validated token sequence, converted once (see parse_tokens)."""

    def __len__(self) -> int: ...

def parse_tokens(tokens: object, name: str = 'tokens') -> Tokens:
    """
    kvcm.checks.check_tokens without a Python-level loop (lists, tuples, int buffers such as numpy arrays and array('i')): the same errors, as a Tokens object for the manager calls.
    """

class ClosedTokens:
    """
    What a closed cache still answers: its final properties and committed tokens.
    """

    @property
    def closed_now(self) -> bool: ...

    @property
    def info(self) -> tuple: ...

    def __len__(self) -> int: ...

    def tolist(self) -> list: ...

class Manager:
    """The C++ manager core; driven by kvcm.cpp_backend."""

    def __init__(self, tokens_per_block: int, life_cycles: list, slots: Sequence[Sequence[int]], tier_kinds: Sequence[str], enable_partial_reuse: bool, reuse_match_backoff: int, max_util_for_resume: float, max_events: int, shared_tier: bool = False, shared_write_evict: bool = False, quota_bytes: Sequence[int] = [], explicit_settlement: bool = False) -> None: ...

    def create(self, tokens: Tokens, lora_id: object | None, salt: object | None, priority: int, shared_hits: Sequence[tuple[bytes, int]] | None = None) -> int: ...

    def shared_candidates(self, tokens: Tokens, lora_id: object | None, salt: object | None) -> list: ...

    def probe(self, tokens: Tokens, lora_id: object | None, salt: object | None, shared_hits: Sequence[tuple[bytes, int]] | None = None, block_tiers: bool = True) -> tuple[int, int, list[int]]: ...

    def drain_copy_ops(self) -> list: ...

    def drain_copy_runs(self) -> list: ...

    def forget_copies(self, ops: Sequence[tuple[int, int, int, int, int, str, bytes]]) -> list[int]: ...

    def settle_copies(self, failed: Sequence[tuple[int, int, int, int, int, str, bytes]]) -> list[int]: ...

    def unsettled_drains(self) -> int: ...

    def clear_reusable(self) -> None: ...

    def set_quota(self, tier: int, quota_bytes: int, slots: Sequence[int]) -> list[int]: ...

    def set_pending_copy_ops_warning(self, n: int) -> None: ...

    def shutdown(self) -> None: ...

    def is_shutdown(self) -> bool: ...

    def num_open(self) -> int: ...

    def stats_json(self, take_iteration: bool) -> str: ...

    def take_events(self) -> list: ...

    def snapshot_json(self) -> str: ...

    def check_invariants(self) -> None: ...

    def internal_sizes(self) -> dict[str, int]:
        """
        Sizes of the core's internal tables (bounded-memory tests, SPEC sec. 15).
        """

    def info(self, serial: int) -> tuple: ...

    def committed_tokens(self, serial: int) -> list: ...

    def resume(self, serial: int) -> bool: ...

    def suspend(self, serial: int) -> None: ...

    def resize(self, serial: int, capacity: object | None, history_length: object | None) -> bool: ...

    def commit(self, serial: int, tokens: object | None) -> None: ...

    def commit_input(self, serial: int, n: int | None) -> None: ...

    def stop_committing(self, serial: int) -> None: ...

    def close(self, serial: int) -> ClosedTokens:
        """
        Close the cache (idempotent); returns its final state, the tokens moved out of the core.
        """

    def page_indices(self, serial: int, lc: int, start: int = 0, stop: int = -1) -> list: ...

    def page_indices_into(self, serial: int, lc: int, out: object) -> int: ...

    def fork(self, serial: int) -> int:
        """
        Fork the ACTIVE cache `serial` (kvcm.api.KVCache.fork): the new cache's serial, or -1 (nothing changed) when the gpu cannot take its own pages.
        """

def resize_batch(manager: Manager, keys: list[tuple[Manager, int]], capacities: object, history_lengths: object | None) -> list[bool]:
    """
    Manager.resize for each (cache, capacity, history) in order, the whole batch validated first (kvcm.api.KVCacheManager.resize_batch); keys: each cache's (core, serial).
    """

def commit_batch(manager: Manager, keys: list[tuple[Manager, int]], tokens: object) -> None:
    """
    Manager.commit of one token per cache, in order, the whole batch validated first (kvcm.api.KVCacheManager.commit_batch); keys: each cache's (core, serial).
    """
