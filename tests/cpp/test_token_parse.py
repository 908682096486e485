"""The shared token parser (cpp/token_parse.h) behind block_keys, the manager calls and the
RadixTree port: the same tokens and the same errors as kvcm.checks.check_tokens, on the paths the
small-input tests do not reach (the exact-int fast path's digit cases, chunk and block
boundaries, long lists, and buffers large enough to be converted without the GIL)."""

from __future__ import annotations

import array
import hashlib
import threading

import kvcm
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcm.checks import check_tokens
from spec_reference import spec_keys

ext = pytest.importorskip("kvcm._kvcm_cpp")
testing = pytest.importorskip("kvcm._kvcm_cpp_testing")
np = pytest.importorskip("numpy")

D = hashlib.sha256(b"digest token").digest()
CHUNK = 32  # kChunkTokens in cpp/token_parse.h
BIG = 5000  # above kReleaseGilItems (4096): the buffer path runs without the GIL


def error_of(fn, *args):
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*args)
    return type(info.value), str(info.value)


def cpp_keys(tokens, B):
    return kvcm.block_keys(tokens, B, backend="cpp")


def tree_new_block(tokens):
    tree = testing.RadixTree(4, [("attn", None, 0)])
    return tree.new_block(b"\x01" * 32, tokens, 0)


# Values around the CPython digit boundaries (30-bit digits: 0, 1 and 2 digits) and the
# token limit; the fast path reads these straight from the object.
EDGE_INTS = [0, 1, 255, 256, 2**15, 2**30 - 1, 2**30, 2**30 + 1, 2**31 - 2, 2**31 - 1]
BAD_INTS = [-1, -(2**30), -(2**31), 2**31, 2**31 + 1, 2**60, 2**62, 2**64, -(2**64), 2**200]


@pytest.mark.parametrize("B", [1, 3, 16, 32, 33, 4096])
def test_edge_values_hash_like_the_spec(B):
    tokens = EDGE_INTS * 40  # several chunks, with every value at many offsets
    assert cpp_keys(tokens, B) == spec_keys(tokens, B)
    assert cpp_keys(tuple(tokens), B) == spec_keys(tokens, B)


@pytest.mark.parametrize("bad", BAD_INTS)
@pytest.mark.parametrize("pos", [0, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 999])
def test_bad_int_anywhere_same_error(bad, pos):
    tokens = list(range(1000))
    tokens[pos] = bad
    expected = error_of(check_tokens, tokens)
    assert expected[0] is ValueError
    assert error_of(cpp_keys, tokens, 32) == expected
    assert error_of(ext.parse_tokens, tokens) == expected
    assert error_of(tree_new_block, tokens) == expected


class Sub(int):
    pass


@pytest.mark.parametrize(
    "odd,kind",
    [(True, TypeError), (False, TypeError), (1.0, TypeError), (None, TypeError), (bytearray(32), TypeError),
     (b"\x00" * 31, ValueError), (b"\x00" * 33, ValueError), (Sub(-3), ValueError), (Sub(2**31), ValueError),
     (type("B", (bytes,), {})(b"\x00" * 32), TypeError)],
)
def test_non_exact_items_take_the_checked_path(odd, kind):
    tokens = list(range(100))
    tokens[CHUNK] = odd
    expected = error_of(check_tokens, tokens)
    assert expected[0] is kind
    assert error_of(cpp_keys, tokens, 32) == expected
    assert error_of(ext.parse_tokens, tokens) == expected
    assert error_of(tree_new_block, tokens) == expected


def test_first_error_wins_in_order():
    # a type error before a range error, and the other way round, across a chunk boundary
    assert error_of(cpp_keys, [1] * 40 + [True, -1], 8) == error_of(check_tokens, [1] * 40 + [True, -1])
    assert error_of(cpp_keys, [1] * 40 + [-1, True], 8) == error_of(check_tokens, [1] * 40 + [-1, True])


def test_int_subclasses_are_taken_by_value():
    tokens = [Sub(5), 6, Sub(2**31 - 1)] * 30
    plain = [int(t) for t in tokens]
    assert cpp_keys(tokens, 7) == spec_keys(plain, 7)
    assert len(ext.parse_tokens(tokens)) == len(tokens)


@pytest.mark.parametrize("B", [1, 2, 31, 32, 33])
def test_digests_at_chunk_and_block_boundaries(B):
    for where in (0, CHUNK - 1, CHUNK, 2 * CHUNK - 1, B - 1, B, 95):
        tokens = list(range(96))
        tokens[where] = D
        tokens[-1] = D
        assert cpp_keys(tokens, B) == spec_keys(tokens, B), where
        assert cpp_keys(np.array(tokens, dtype=object), B) == spec_keys(tokens, B), where


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(
            st.integers(0, 2**31 - 1),
            st.sampled_from(EDGE_INTS),
            st.just(D),
        ),
        max_size=300,
    ),
    B=st.integers(1, 70),
)
def test_random_mixed_lists_match_the_spec(tokens, B):
    assert cpp_keys(tokens, B) == spec_keys(tokens, B)


@pytest.mark.parametrize("dtype", ["int32", "uint32", "int64", "uint16", "int8"])
def test_large_buffers_without_the_gil(dtype):
    info = np.iinfo(dtype)
    values = (np.arange(BIG, dtype=np.int64) * 7919) % min(int(info.max) + 1, 2**31)
    arr = values.astype(dtype)
    expected = spec_keys(values.tolist(), 32)
    assert cpp_keys(arr, 32) == expected
    assert cpp_keys(arr[::-1].copy()[::-1], 32) == expected  # negative stride twice: same order
    assert cpp_keys(np.ascontiguousarray(arr[::2]), 32) == spec_keys(values[::2].tolist(), 32)
    assert cpp_keys(arr[::2], 32) == spec_keys(values[::2].tolist(), 32)  # strided view


@pytest.mark.parametrize("pos", [0, 4095, 4096, BIG - 1])
def test_large_buffer_bad_value_same_error(pos):
    for arr in (np.arange(BIG, dtype=np.int64), array.array("i", range(BIG))):
        arr[pos] = -7
        expected = error_of(check_tokens, arr)
        assert expected == (ValueError, "tokens: token -7 out of range [0, 2**31)")
        assert error_of(cpp_keys, arr, 16) == expected
        assert error_of(ext.parse_tokens, arr) == expected
    big = np.arange(BIG, dtype=np.uint64)
    big[pos] = 2**64 - 1
    assert error_of(cpp_keys, big, 16) == error_of(check_tokens, big)


def test_large_buffers_from_threads():
    arr = np.arange(50_000, dtype=np.int32)
    expected = spec_keys(arr.tolist(), 16)
    results = [None] * 4

    def work(i):
        results[i] = cpp_keys(arr, 16)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == expected for r in results)


def test_manager_parser_keeps_every_token():
    tokens = EDGE_INTS * 7 + [D] + list(range(500))
    parsed = ext.parse_tokens(tokens)
    assert len(parsed) == len(tokens)
    assert len(ext.parse_tokens(np.array(tokens[-500:], dtype=np.int64))) == 500
    assert len(ext.parse_tokens(())) == 0
    for bad in (None, "abc", (t for t in [1, 2]), {1: 2}, {1, 2}, memoryview(b"abcd"), np.zeros((2, 2), np.int32)):
        assert error_of(ext.parse_tokens, bad, "prompt") == error_of(check_tokens, bad, "prompt")
        assert error_of(ext.parse_tokens, bad, "prompt")[0] is TypeError
    assert error_of(ext.parse_tokens, [1, -1], "prompt") == error_of(check_tokens, [1, -1], "prompt")
    assert error_of(ext.parse_tokens, [1, True], "prompt") == (
        TypeError,
        "prompt: a token must be an int or 32 bytes, got bool",
    )


def test_manager_calls_agree_across_backends_and_input_forms_on_long_prompts():
    from kvcm import AttentionLayer, KVCacheManagerConfig, Tier

    B = 16
    prompt = [(i * 7919) % 2**31 for i in range(3000)] + EDGE_INTS + [D] + [5] * 20
    cfg = KVCacheManagerConfig(tokens_per_block=B, layers=[AttentionLayer(0, 8)], tiers=[Tier("gpu", 8 * 16 * 400)])
    probes = {}
    for backend in ("python", "cpp"):
        m = kvcm.KVCacheManager(cfg, backend=backend)
        kv = m.create_kv_cache(prompt[:-40])
        assert kv.resume() and kv.resize(len(prompt))
        kv.commit(prompt[:-40])
        kv.commit(prompt[-40:])
        kv.close()
        probes[backend] = [m.probe_reuse(form) for form in (prompt, tuple(prompt), prompt[:1000])]
        probes[backend].append(m.probe_reuse(np.array(prompt[:3000], dtype=np.int64)))
    assert probes["cpp"] == probes["python"]
    assert probes["cpp"][0] > 3000  # the long prompt was cached and found again
