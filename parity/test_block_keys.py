"""SPEC sec. 3: block keys (SHA-256 chains) and scopes."""

from __future__ import annotations

import hashlib
import struct

import kvcm
import numpy as np
from kvcm import ReuseScope

from parity.helpers import B, attn_cfg, fill, keys, of_kind, stored, stored_blocks, toks


def _announced(make_manager, tokens, scope=None) -> list[bytes]:
    """Commit ``tokens`` (B = 4) and return the keys the manager announces, in order."""
    mgr = make_manager(attn_cfg(gpu=8))
    kv = mgr.create_kv_cache(None, scope=scope)
    assert kv.resume() and kv.resize(len(tokens))
    kv.commit(tokens)
    kv.close()
    got = [b.key for b in stored_blocks(mgr.take_events())]
    mgr.check_invariants()
    return got


def test_block_keys_are_sha256_chain_from_scope_root(backend):
    t = [1, 2, 3, 4, 5, 6, 7, 8]
    root = hashlib.sha256(b"\x00").digest()
    k0 = hashlib.sha256(root + struct.pack("<4I", 1, 2, 3, 4)).digest()
    k1 = hashlib.sha256(k0 + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert kvcm.block_keys(t, B, None, backend=backend) == [k0, k1]
    assert kvcm.block_keys(t, B, ReuseScope(), backend=backend) == [k0, k1]


def test_scope_none_and_zero_are_different_roots(backend):
    t = toks(4)
    default = kvcm.block_keys(t, B, ReuseScope(), backend=backend)
    lora0 = kvcm.block_keys(t, B, ReuseScope(lora_id=0), backend=backend)
    salt0 = kvcm.block_keys(t, B, ReuseScope(salt=0), backend=backend)
    both = kvcm.block_keys(t, B, ReuseScope(lora_id=0, salt=0), backend=backend)
    assert len({default[0], lora0[0], salt0[0], both[0]}) == 4
    assert lora0 == keys(t, ReuseScope(lora_id=0))
    assert salt0 == keys(t, ReuseScope(salt=0))
    assert both == keys(t, ReuseScope(lora_id=0, salt=0))
    # explicit root bytes: mask byte then present fields as u64 little endian
    r = hashlib.sha256(bytes([3]) + struct.pack("<QQ", 7, 2**64 - 1)).digest()
    expect = hashlib.sha256(r + struct.pack("<4I", *t)).digest()
    assert kvcm.block_keys(t, B, ReuseScope(lora_id=7, salt=2**64 - 1), backend=backend) == [expect]


def test_partial_block_key_covers_only_its_tokens(backend):
    t = toks(6)
    k = kvcm.block_keys(t, B, None, backend=backend)
    assert len(k) == 2
    assert k[1] == hashlib.sha256(k[0] + struct.pack("<2I", t[4], t[5])).digest()
    assert kvcm.block_keys(t[:4], B, None, backend=backend) == k[:1]
    assert kvcm.block_keys([], B, None, backend=backend) == []


def test_digest_tokens_hash_their_raw_bytes(backend):
    d = bytes(range(32))
    t = [1, d, 2**31 - 1, 0, d]
    k = kvcm.block_keys(t, B, None, backend=backend)
    root = hashlib.sha256(b"\x00").digest()
    k0 = hashlib.sha256(root + struct.pack("<I", 1) + d + struct.pack("<II", 2**31 - 1, 0)).digest()
    k1 = hashlib.sha256(k0 + d).digest()
    assert k == [k0, k1]


def test_block_keys_equal_across_backends(backend):
    t = toks(11, base=5) + [bytes([7]) * 32]
    for scope in (None, ReuseScope(lora_id=0), ReuseScope(salt=12345), ReuseScope(3, 4)):
        for bpb in (1, 3, 4, 4096):
            mine = kvcm.block_keys(t, bpb, scope, backend=backend)
            assert mine == kvcm.block_keys(t, bpb, scope, backend="python")
            assert mine == keys(t, scope, bpb)


def test_block_keys_accept_numpy_tokens(backend):
    t = toks(9)
    arr = np.array(t, dtype=np.int32)
    assert kvcm.block_keys(arr, B, None, backend=backend) == keys(t)
    assert kvcm.block_keys(np.array(t, dtype=np.int64), B, None, backend=backend) == keys(t)


def test_stored_event_keys_are_block_keys(make_manager):
    mgr = make_manager(attn_cfg(gpu=4))
    scope = ReuseScope(lora_id=3)
    t = toks(8)
    kv = mgr.create_kv_cache(None, scope=scope)
    assert kv.resume()
    assert kv.resize(8)
    kv.commit(t)
    ev = mgr.take_events()
    assert stored(ev) == [(k, 0) for k in keys(t, scope)]
    first = of_kind(ev, "stored")[0]
    assert first.blocks[0].tokens == tuple(t[:4])
    assert first.partial is False
    kv.close()
    mgr.check_invariants()


def test_scopes_do_not_share_blocks(make_manager):
    mgr = make_manager(attn_cfg(gpu=8))
    t = toks(8)
    kv = mgr.create_kv_cache(None, scope=ReuseScope(lora_id=0))
    assert kv.resume() and kv.resize(8)
    kv.commit(t)
    kv.close()
    assert mgr.probe_reuse(t, ReuseScope(lora_id=0)) == 8
    assert mgr.probe_reuse(t) == 0
    assert mgr.probe_reuse(t, ReuseScope(salt=0)) == 0
    other = mgr.create_kv_cache(t)  # default scope: no reuse
    assert other.num_reused_tokens == 0 and other.num_committed_tokens == 0
    other.close()
    fill(mgr, t)  # same tokens, default scope: a second, separate chain
    assert mgr.probe_reuse(t) == 8
    mgr.check_invariants()


def test_announced_keys_are_block_keys_for_scopes_partials_and_digests(make_manager):
    d = bytes(range(32))
    for t, scope in (
        (toks(8), None),
        (toks(8), ReuseScope(lora_id=0)),
        (toks(6), ReuseScope(salt=5)),  # the partial tail is announced on close
        ([1, d, 2**31 - 1, 0, d], None),
    ):
        assert _announced(make_manager, t, scope) == keys(t, scope)
    assert _announced(make_manager, np.array(toks(9), dtype=np.int32)) == keys(toks(9))
