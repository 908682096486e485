"""Block keys (sec. 3): SHA-256 chains, identical in both backends and stable everywhere."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvcm.api import ReuseScope, Token
from kvcm.checks import check_scope, check_tokens


def scope_root_key(scope: ReuseScope | None = None) -> bytes:
    """``sha256(mask || lora_le64? || salt_le64?)``; bit0 = lora present, bit1 = salt present."""
    scope = check_scope(scope)
    mask = (1 if scope.lora_id is not None else 0) | (2 if scope.salt is not None else 0)
    data = bytes([mask])
    if scope.lora_id is not None:
        data += struct.pack("<Q", scope.lora_id)
    if scope.salt is not None:
        data += struct.pack("<Q", scope.salt)
    return hashlib.sha256(data).digest()


def token_bytes(tokens: Sequence[Token]) -> bytes:
    """Each int token as 4-byte little endian, each digest token as its 32 raw bytes."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:  # digest tokens present
        pass
    return b"".join(t if isinstance(t, bytes) else struct.pack("<I", t) for t in tokens)


def block_key(parent_key: bytes, tokens: Sequence[Token]) -> bytes:
    return hashlib.sha256(parent_key + token_bytes(tokens)).digest()


def chain_keys(parent_key: bytes, tokens: Sequence[Token], tokens_per_block: int) -> list[bytes]:
    """Keys of every full or partial block of ``tokens`` under ``parent_key`` (no checks)."""
    keys: list[bytes] = []
    key = parent_key
    try:  # all ints (the common case): packed once, each block hashed from a slice
        buf = struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:  # digest tokens present: block by block
        for start in range(0, len(tokens), tokens_per_block):
            key = block_key(key, tokens[start : start + tokens_per_block])
            keys.append(key)
        return keys
    return chain_keys_packed(parent_key, buf, tokens_per_block, len(tokens))


def chain_keys_packed(parent_key: bytes, buf: bytes, tokens_per_block: int, n: int) -> list[bytes]:
    """:func:`chain_keys` of the first ``n`` tokens of ``buf`` (int tokens as 4-byte
    little-endian ints, ``kvcm.checks.check_tokens_packed``): each block hashed from a slice."""
    keys: list[bytes] = []
    key = parent_key
    sha = hashlib.sha256
    step = 4 * tokens_per_block
    end = 4 * n
    for start in range(0, end, step):
        key = sha(key + buf[start : min(start + step, end)]).digest()
        keys.append(key)
    return keys


def block_keys_py(tokens: Sequence[Token], tokens_per_block: int, scope: ReuseScope | None = None) -> list[bytes]:
    """Pure-Python ``kvcm.block_keys``: one key per full or partial block."""
    if type(tokens_per_block) is not int or not 1 <= tokens_per_block <= 4096:
        raise ValueError(f"tokens_per_block must be an int in 1..4096, got {tokens_per_block!r}")
    toks = check_tokens(tokens)
    return chain_keys(scope_root_key(scope), toks, tokens_per_block)
