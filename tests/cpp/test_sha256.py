"""The C++ SHA-256 (portable and SHA-NI paths) against FIPS 180-4 vectors and hashlib."""

from __future__ import annotations

import hashlib
import random

import pytest

_kvcm_cpp = pytest.importorskip("kvcm._kvcm_cpp")

IMPLS = [
    "portable",
    pytest.param(
        "shani", marks=pytest.mark.skipif(not _kvcm_cpp.sha256_shani_available(), reason="CPU without SHA-NI")
    ),
]

FIPS = [
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (
        b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
    ),
    (
        b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu",
        "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1",
    ),
    (b"a" * 1_000_000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
]


@pytest.fixture(params=IMPLS)
def impl(request):
    assert _kvcm_cpp._set_sha256_impl(request.param)
    assert _kvcm_cpp.sha256_impl() == request.param
    yield request.param
    _kvcm_cpp._set_sha256_impl("auto")


@pytest.mark.parametrize("data,digest", FIPS, ids=["empty", "abc", "448bit", "896bit", "million_a"])
def test_fips_vectors(impl, data, digest):
    assert _kvcm_cpp.sha256(data).hex() == digest


def test_every_length_around_block_boundaries(impl):
    rng = random.Random(1)
    for n in range(300):
        data = rng.randbytes(n)
        assert _kvcm_cpp.sha256(data) == hashlib.sha256(data).digest(), n


def test_random_inputs_against_hashlib(impl):
    rng = random.Random(2)
    for _ in range(200):
        data = rng.randbytes(rng.choice([rng.randrange(0, 200), rng.randrange(0, 5000), rng.randrange(0, 70000)]))
        assert _kvcm_cpp.sha256(data) == hashlib.sha256(data).digest()


def test_block_key_chain_uses_the_selected_impl(impl):
    # The streaming path (32-byte parent + token bytes) is what block keys use.
    from kvcm.keys import block_keys_py

    toks = list(range(1000))
    for B in (1, 7, 8, 16, 17, 64):
        assert _kvcm_cpp.block_keys(toks, B) == block_keys_py(toks, B)


def test_bytes_like_inputs():
    data = bytes(range(256)) * 20
    want = hashlib.sha256(data).digest()
    assert _kvcm_cpp.sha256(bytearray(data)) == want
    assert _kvcm_cpp.sha256(memoryview(data)) == want
    with pytest.raises(TypeError):
        _kvcm_cpp.sha256("text")
    with pytest.raises(TypeError):
        _kvcm_cpp.sha256(5)


def test_auto_prefers_shani_when_available():
    _kvcm_cpp._set_sha256_impl("auto")
    assert _kvcm_cpp.sha256_impl() == ("shani" if _kvcm_cpp.sha256_shani_available() else "portable")
    assert _kvcm_cpp.build_info()["sha256_impl"] == _kvcm_cpp.sha256_impl()
    with pytest.raises(ValueError):
        _kvcm_cpp._set_sha256_impl("fast")


def test_raw_sha256_loop():
    testing = pytest.importorskip("kvcm._kvcm_cpp_testing")
    ns = testing.raw_sha256_loop(1000, 64)
    assert isinstance(ns, int) and ns > 0
    assert testing.raw_sha256_loop(0, 64) >= 0
    assert not hasattr(_kvcm_cpp, "raw_sha256_loop")  # test-only surface stays out of production


def test_scope_root_key():
    assert _kvcm_cpp.scope_root_key() == hashlib.sha256(b"\x00").digest()
    assert _kvcm_cpp.scope_root_key(1) == hashlib.sha256(b"\x01" + (1).to_bytes(8, "little")).digest()
    assert _kvcm_cpp.scope_root_key(None, 2) == hashlib.sha256(b"\x02" + (2).to_bytes(8, "little")).digest()
    assert (
        _kvcm_cpp.scope_root_key(3, 4)
        == hashlib.sha256(b"\x03" + (3).to_bytes(8, "little") + (4).to_bytes(8, "little")).digest()
    )
