"""SPEC sec. 3 block keys written out with hashlib only: the independent reference both
the block-key tests and the token-parser tests compare against (never kvcm.keys)."""

from __future__ import annotations

import hashlib
import struct

from kvcm import ReuseScope


def spec_keys(tokens, B, scope=None):
    """One key per full or partial block of ``tokens`` under ``scope`` (default scope)."""
    scope = scope or ReuseScope()
    mask = (scope.lora_id is not None) | (scope.salt is not None) << 1
    root = bytes([mask])
    for v in (scope.lora_id, scope.salt):
        if v is not None:
            root += struct.pack("<Q", v)
    key = hashlib.sha256(root).digest()
    out = []
    for i in range(0, len(tokens), B):
        data = b"".join(t if isinstance(t, bytes) else struct.pack("<I", t) for t in tokens[i : i + B])
        key = hashlib.sha256(key + data).digest()
        out.append(key)
    return out
