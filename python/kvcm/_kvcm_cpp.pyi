"""kvcm C++ core (nanobind bindings)"""

from collections.abc import Sequence


def block_keys(tokens: object, tokens_per_block: int, lora_id: int | None = None, salt: int | None = None) -> list[bytes]:
    """
    One SHA-256 key per full or partial block of ``tokens`` (SPEC sec. 3).  Tokens are validated like kvcm.api.check_tokens; the GIL is released while hashing.
    """

def scope_root_key(lora_id: int | None = None, salt: int | None = None) -> bytes:
    """
    sha256(mask || lora_le64? || salt_le64?), the root key of a ReuseScope.
    """

def sha256(data: bytes | bytearray | memoryview) -> bytes:
    """SHA-256 digest of a bytes-like object."""

def raw_sha256_loop(n_blocks: int, block_bytes: int) -> int:
    """
    Chain ``n_blocks`` hashes of (32-byte parent || ``block_bytes`` bytes); returns elapsed ns.
    """

def sha256_impl() -> str:
    """The SHA-256 compression in use: 'shani' or 'portable'."""

def sha256_shani_available() -> bool:
    """True when the CPU supports SHA-NI."""

def build_info() -> dict:
    """Build details for `python -m kvcm info`."""

NO_PAGE: int = -1

NO_NODE: int = -1

class RadixTree:
    """
    C++ port of kvcm.python_backend.tree.RadixTree (same methods, same results).
    """

    def __init__(self, tokens_per_block: int, life_cycles: Sequence[tuple[str, int | None, int]]) -> None: ...

    def root(self, scope_key: bytes) -> int: ...

    def new_block(self, key: bytes, tokens: Sequence[int | bytes], ordinal: int) -> int: ...

    def find_existing(self, parent: int, key: bytes, tokens: Sequence[int | bytes]) -> int: ...

    def attach(self, parent: int, node: int) -> list[int]: ...

    def detach(self, node: int) -> None: ...

    def remove_subtree(self, node: int) -> list[int]: ...

    def prune_upward(self, node: int) -> list[int]: ...

    def set_page(self, node: int, lc: int, page: int, coverage: int) -> int: ...

    def clear_page(self, node: int, lc: int) -> int: ...

    def ref(self, node: int) -> None: ...

    def unref(self, node: int) -> None: ...

    def collect(self, node: int) -> None: ...

    def match(self, root: int, tokens: Sequence[int | bytes], keys: Sequence[bytes], partial: bool, backoff: int) -> tuple[int, int, list[int]]: ...

    def parent(self, node: int) -> int: ...

    def is_attached(self, node: int) -> bool: ...

    def exists(self, node: int) -> bool: ...

    def key(self, node: int) -> bytes: ...

    def page(self, node: int, lc: int) -> int: ...

    def coverage(self, node: int, lc: int) -> int: ...

    def dump(self) -> list:
        """Canonical picture: every live node by id."""

    def __len__(self) -> int: ...

    @property
    def B(self) -> int: ...

    @property
    def num_lcs(self) -> int: ...
