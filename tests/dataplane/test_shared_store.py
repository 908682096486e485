"""The shared tier's stores (DECISIONS.md "The shared tier"): the object format, the file
store and Mooncake Store behind one interface, and their faults."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import zlib

import pytest
from kvcm import AttentionLayer, KVCacheManagerConfig, SsmLayer, Tier
from kvcm.config import layout_fingerprint, resolve_config
from kvcm.dataplane import open_store
from kvcm.dataplane.store import HEADER, FileStore, ObjectCodec, SharedStore, Staging
from mooncake_env import need_mooncake

FP = hashlib.sha256(b"layout").digest()
OTHER_FP = hashlib.sha256(b"another layout").digest()


def key(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def make_object(codec: ObjectCodec, st: Staging, off: int, k: bytes, lc: int, payload: bytes) -> tuple[str, int, int]:
    """Write header + payload at ``off`` of ``st``; the put item."""
    h = HEADER.size
    st.view[off + h:off + h + len(payload)] = payload
    st.view[off:off + h] = codec.header(k, lc, payload)
    return codec.name(k, lc), off, h + len(payload)


# ---------------------------------------------------------------------------- the format


def test_names_differ_by_fingerprint_key_and_lc():
    a, b = ObjectCodec(FP), ObjectCodec(OTHER_FP)
    names = {a.name(key(1), 0), a.name(key(1), 1), a.name(key(2), 0), b.name(key(1), 0)}
    assert len(names) == 4
    assert a.name(key(1), 0) == ObjectCodec(FP).name(key(1), 0)  # deterministic across processes


def _fingerprint(layers, namespace: str = "m", B: int = 4) -> bytes:
    tiers = [Tier("gpu", 1 << 20), Tier("shared", 0, "/tmp/kvcm-unused")]
    return layout_fingerprint(resolve_config(KVCacheManagerConfig(B, layers, tiers, shared_namespace=namespace)),
                              namespace)


def test_fingerprint_names_how_a_slot_splits_between_layers():
    """Same B, life cycles and slot bytes, other per-layer sizes or order: another layout (a
    page of 64+32 bytes per token read as 32+64 would serve wrong K/V)."""
    split = [(64, 32), (32, 64), (48, 48)]
    fps = {_fingerprint([AttentionLayer(0, a), AttentionLayer(1, b)]) for a, b in split}
    assert len(fps) == 3
    # the layer ids (which layer sits where in the slot) count too
    assert _fingerprint([AttentionLayer(0, 8), AttentionLayer(1, 8)]) != _fingerprint(
        [AttentionLayer(0, 8), AttentionLayer(2, 8)])
    # ssm state bytes split between layers
    assert _fingerprint([AttentionLayer(0, 8), SsmLayer(1, 16), SsmLayer(2, 32)]) != _fingerprint(
        [AttentionLayer(0, 8), SsmLayer(1, 32), SsmLayer(2, 16)])
    # and the rest as before: B, namespace; deterministic
    base = [AttentionLayer(0, 8), AttentionLayer(1, 8, window=4)]
    assert _fingerprint(base) == _fingerprint(list(base))
    assert _fingerprint(base) != _fingerprint(base, namespace="n")
    assert _fingerprint(base) != _fingerprint(base, B=8)


@pytest.mark.parametrize("field", ["magic", "fingerprint", "key", "life cycle", "length", "checksum", "short", "long"])
def test_check_rejects_every_wrong_field(field):
    codec = ObjectCodec(FP)
    payload = bytes(range(64))
    obj = bytearray(codec.header(key(1), 2, payload) + payload)
    codec.check(memoryview(bytes(obj)), key(1), 2, 64)  # the good object passes
    k, lc, n = key(1), 2, 64
    if field == "magic":
        obj[0] ^= 1
    elif field == "fingerprint":
        obj[:HEADER.size] = ObjectCodec(OTHER_FP).header(key(1), 2, payload)
    elif field == "key":
        k = key(2)
    elif field == "life cycle":
        lc = 1
    elif field == "length":  # a header that claims another length, same total bytes
        obj[:HEADER.size] = codec.header(key(1), 2, payload[:60])
    elif field == "checksum":
        obj[-1] ^= 0xFF
    elif field == "short":
        obj = obj[:-1]
    elif field == "long":
        obj += b"x"
    with pytest.raises(OSError) as e:
        codec.check(memoryview(bytes(obj)), k, lc, n)
    assert e.value.errno == errno.EIO
    assert (field in str(e.value)) or field in ("short", "long")


def test_open_store_locations(tmp_path):
    assert isinstance(open_store(str(tmp_path / "a")), FileStore)
    s = open_store(f"file://{tmp_path / 'b'}", 1000)
    assert isinstance(s, FileStore) and s.directory == str(tmp_path / "b") and s.quota_bytes == 1000
    for bad in ("", "s3://bucket", None):
        with pytest.raises(ValueError):
            open_store(bad)


def test_mooncake_url_parsing():
    from kvcm.dataplane.mooncake_store import parse_url

    p = parse_url("mooncake://10.0.0.1:50051?metadata=http://10.0.0.1:8080/metadata")
    assert p["master"] == "10.0.0.1:50051" and p["metadata"] == "http://10.0.0.1:8080/metadata"
    assert p["protocol"] == "tcp"
    assert parse_url("mooncake://h:1")["metadata"] == "http://h:8080/metadata"
    # local_hostname: 127.0.0.1 unless given (right on one host only: README, two hosts)
    assert parse_url("mooncake://h:1")["local_hostname"] == "127.0.0.1"
    assert parse_url("mooncake://h:1?local_hostname=10.0.0.2")["local_hostname"] == "10.0.0.2"
    for bad in ("mooncake://nohost", "file:///x", "mooncake://h:1?bogus=1"):
        with pytest.raises(ValueError):
            parse_url(bad)


# ---------------------------------------------------------------------------- both stores


@pytest.fixture(params=["file", "mooncake"])
def store(request, tmp_path) -> SharedStore:
    if request.param == "file":
        s = FileStore(str(tmp_path / "store"))
    else:
        need_mooncake()
        from kvcm.dataplane.mooncake_store import MooncakeStore

        s = MooncakeStore.from_url(request.getfixturevalue("mooncake").url)
    yield s
    s.close()


@pytest.fixture
def codec(request) -> ObjectCodec:
    # one fingerprint per test: tests sharing the session's Mooncake never see each other's objects
    return ObjectCodec(hashlib.sha256(request.node.nodeid.encode()).digest())


def test_round_trip_batched(store, codec):
    st = Staging(1 << 16)
    store.register(st)
    try:
        payloads = {(key(i), lc): os.urandom(100 + 10 * i + lc) for i in range(5) for lc in range(2)}
        items, off = [], 0
        for (k, lc), p in payloads.items():
            items.append(make_object(codec, st, off, k, lc, p))
            off += HEADER.size + len(p)
        assert store.put(items, st) == [None] * len(items)
        assert store.put(items[:2], st) == [None, None]  # writing an existing object again is fine
        names = [codec.name(key(i), 0) for i in range(7)]
        assert store.exists(names) == [True] * 5 + [False] * 2
        # read back into another region, in another order, and verify
        st.view[:off] = bytes(off)
        reads, roff = [], 0
        order = list(payloads)[::-1]
        for k, lc in order:
            n = HEADER.size + len(payloads[(k, lc)])
            reads.append((codec.name(k, lc), roff, n))
            roff += n
        got = store.get(reads, st)
        assert got == [n for _, _, n in reads]
        for (k, lc), (_, o, n) in zip(order, reads, strict=True):
            codec.check(st.view[o:o + n], k, lc, len(payloads[(k, lc)]))
            assert bytes(st.view[o + HEADER.size:o + n]) == payloads[(k, lc)]
        # a missing object is an OSError in its slot of the result, the others still load
        res = store.get([(codec.name(key(9), 0), 0, 200), reads[0]], st)
        assert isinstance(res[0], OSError) and res[1] == reads[0][2]
        store.remove([codec.name(key(0), 0)])
        assert store.exists([codec.name(key(0), 0), codec.name(key(0), 1)]) == [False, True]
    finally:
        store.unregister(st)
        st.close()


def test_other_fingerprint_sees_nothing(store, codec):
    st = Staging(4096)
    store.register(st)
    try:
        assert store.put([make_object(codec, st, 0, key(1), 0, b"x" * 50)], st) == [None]
        other = ObjectCodec(hashlib.sha256(codec.fingerprint).digest())
        assert store.exists([other.name(key(1), 0), codec.name(key(1), 0)]) == [False, True]
    finally:
        store.unregister(st)
        st.close()


# ---------------------------------------------------------------------------- the file store


def test_file_store_failed_write_is_not_visible(tmp_path, monkeypatch):
    s = FileStore(str(tmp_path))
    codec = ObjectCodec(FP)
    st = Staging(4096)
    items = [make_object(codec, st, 0, key(1), 0, b"a" * 100), make_object(codec, st, 1024, key(2), 0, b"b" * 100)]
    real_fsync = os.fsync
    calls = []

    def failing_fsync(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "injected fsync failure")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    res = s.put(items, st)
    assert isinstance(res[0], OSError) and res[1] is None
    assert s.exists([items[0][0], items[1][0]]) == [False, True]
    assert sorted(os.listdir(tmp_path)) == [items[1][0] + ".kvo"]  # no temporary left behind


def test_file_store_truncated_object_fails_the_read(tmp_path):
    s = FileStore(str(tmp_path))
    codec = ObjectCodec(FP)
    st = Staging(4096)
    item = make_object(codec, st, 0, key(1), 0, b"a" * 300)
    assert s.put([item], st) == [None]
    with open(s.path(item[0]), "r+b") as f:
        f.truncate(200)
    (n,) = s.get([item], st)
    assert n == 200  # the store reports what it read; the check refuses it
    with pytest.raises(OSError, match="200 bytes, expected"):
        codec.check(st.view[0:n], key(1), 0, 300)
    with open(s.path(item[0]), "ab") as f:  # longer than expected: an error of the read itself
        f.write(b"z" * (item[2] - 200 + 1))
    (res,) = s.get([item], st)
    assert isinstance(res, OSError)


def put_aged(s: FileStore, codec: ObjectCodec, st: Staging, n: int, payload_bytes: int,
             first_age_s: int) -> list[str]:
    """Put objects 0..n-1 one by one, object i aged ``first_age_s + i`` seconds after the
    epoch (oldest first, distinct whatever the filesystem's clock resolution); their names."""
    names = []
    for i in range(n):
        item = make_object(codec, st, 0, key(i), 0, bytes([i]) * payload_bytes)
        assert s.put([item], st) == [None]
        t = (first_age_s + i) * 10**9
        os.utime(s.path(item[0]), ns=(t, t))
        names.append(item[0])
    return names


def test_file_store_quota_removes_oldest(tmp_path):
    size = HEADER.size + 1000
    s = FileStore(str(tmp_path), quota_bytes=3 * size, fsync=False)
    codec = ObjectCodec(FP)
    st = Staging(8192)
    names = put_aged(s, codec, st, 5, 1000, first_age_s=0)
    assert s.usage() == (3, 3 * size)
    assert s.exists(names) == [False, False, True, True, True]
    assert s.evicted == 2


def _counting_scans(s: FileStore) -> list[int]:
    """Count the directory scans ``s`` makes (wraps its ``_objects``)."""
    n = [0]
    inner = s._objects

    def counted(*a, **kw):
        n[0] += 1
        return inner(*a, **kw)

    s._objects = counted
    return n


def test_file_store_quota_trims_to_a_low_watermark(tmp_path):
    """Writing at the quota: each trim goes down to 90% of it, so the directory is scanned
    once per 10% of the quota written, not at every write; the estimate stays equal
    to the bytes in the directory."""
    size = HEADER.size + 100
    s = FileStore(str(tmp_path), quota_bytes=100 * size, fsync=False)
    scans = _counting_scans(s)
    codec = ObjectCodec(FP)
    st = Staging(4096)
    for i in range(1000):
        assert s.put([make_object(codec, st, 0, key(i), 0, i.to_bytes(4, "little") * 25)], st) == [None]
    # a scan at the first write (no estimate yet), then one per 10 objects (10% of the quota)
    assert scans[0] <= 1 + 1000 // 10
    n, used = s.usage()
    assert 90 * size <= used <= 100 * size and s._estimate == used
    assert s.evicted == 1000 - n


def test_file_store_put_of_an_existing_name_does_not_grow_the_estimate(tmp_path):
    size = HEADER.size + 100
    s = FileStore(str(tmp_path), quota_bytes=3 * size, fsync=False)
    scans = _counting_scans(s)
    codec = ObjectCodec(FP)
    st = Staging(4096)
    item = make_object(codec, st, 0, key(1), 0, b"p" * 100)
    for _ in range(10):
        assert s.put([item], st) == [None]
    assert scans[0] == 1 and s.evicted == 0 and s._estimate == size


def test_file_store_load_refreshes_a_hot_object(tmp_path):
    """A loaded object becomes the newest: past the quota the cold ones go first."""
    size = HEADER.size + 100
    s = FileStore(str(tmp_path), quota_bytes=10 * size, fsync=False)
    codec = ObjectCodec(FP)
    st = Staging(4096)
    names = put_aged(s, codec, st, 10, 100, first_age_s=1)
    assert s.get([(names[0], 0, size)], st) == [size]  # object 0, the oldest, is hot
    assert s.put([make_object(codec, st, 0, key(10), 0, b"n" * 100)], st) == [None]  # past the quota
    assert s.exists(names) == [True, False, False, *[True] * 7]  # trimmed to 9: objects 1 and 2 went


def test_file_store_an_entry_it_cannot_remove_neither_disables_the_quota_nor_fails_puts(tmp_path):
    """A directory named like an object (``*.kvo``) and a stale temporary that is a
    directory, both older than every object: the trim cannot remove them.  They are skipped
    and counted; the quota still holds for the objects the store holds, and every put
    reports its own object's result (written: ``None``), not the trim's trouble."""
    size = HEADER.size + 1000
    (tmp_path / "old.kvo").mkdir()
    (tmp_path / ".tmp-old").mkdir()
    for d in ("old.kvo", ".tmp-old"):
        os.utime(tmp_path / d, (1, 1))
    s = FileStore(str(tmp_path), quota_bytes=3 * size, fsync=False)
    codec = ObjectCodec(FP)
    st = Staging(8192)
    names = put_aged(s, codec, st, 40, 1000, first_age_s=10)  # asserts every put == [None]
    assert (tmp_path / "old.kvo").is_dir() and (tmp_path / ".tmp-old").is_dir()
    n, used = s.usage()
    assert used <= 3 * size and n >= 2 and s.exists(names[-2:]) == [True, True]
    assert s._estimate == used  # the quota counts only the objects it holds
    stats = s.stats()
    assert stats["skipped"] == 2 and stats["evicted"] == 40 - n and stats["quota_errors"] == 0


def test_file_store_an_object_it_may_not_remove_is_skipped_and_not_counted(tmp_path, monkeypatch):
    """An object file the store may not remove (another user's file in a sticky directory,
    a read-only mount: EACCES / EPERM / EROFS; injected, as the tests may run as root): the
    trim skips it, counts it, does not try it again at every rescan, and does not count
    its bytes against the quota (they are not the store's to free), so the objects the
    store holds stay within the quota and every put reports success."""
    size = HEADER.size + 1000
    s = FileStore(str(tmp_path), quota_bytes=3 * size, fsync=False)
    codec = ObjectCodec(FP)
    st = Staging(8192)
    victim = codec.name(key(0), 0)
    real_remove, tries = os.remove, []

    def remove(path, *a, **kw):
        if os.path.basename(path) == victim + ".kvo":
            tries.append(path)
            raise PermissionError(errno.EPERM, "injected: not this user's file", path)
        return real_remove(path, *a, **kw)

    monkeypatch.setattr(os, "remove", remove)
    assert put_aged(s, codec, st, 1, 5000, first_age_s=1) == [victim]  # the oldest, bigger than the quota
    for i in range(1, 40):
        item = make_object(codec, st, 0, key(i), 0, bytes([i]) * 1000)
        assert s.put([item], st) == [None]
        t = (10 + i) * 10**9
        os.utime(s.path(item[0]), ns=(t, t))
    assert s.exists([victim]) == [True] and len(tries) == 1
    _, used = s.usage()
    assert 2 * size <= used <= 3 * size and s._estimate == used
    assert s.stats()["skipped"] == 1


def test_file_store_sweeps_stale_temporaries(tmp_path):
    """A writer that crashed between create and rename left ``.tmp-*``: removed once stale
    (at open and at every rescan); a fresh one (a live writer's) is kept."""
    old, fresh = tmp_path / ".tmp-crashed", tmp_path / ".tmp-live"
    old.write_bytes(b"x" * 10)
    fresh.write_bytes(b"y" * 10)
    os.utime(old, (1, 1))
    s = FileStore(str(tmp_path), quota_bytes=1000)
    assert not old.exists() and fresh.exists() and s.swept == 1
    old.write_bytes(b"x" * 10)
    os.utime(old, (1, 1))
    codec = ObjectCodec(FP)
    st = Staging(4096)
    assert s.put([make_object(codec, st, 0, key(1), 0, b"p" * 10)], st) == [None]  # the first write rescans
    assert not old.exists() and fresh.exists() and s.swept == 2


def test_file_store_shared_between_instances(tmp_path):
    """Two stores on one directory (two processes on a shared filesystem) see each other's
    objects."""
    a, b = FileStore(str(tmp_path)), FileStore(str(tmp_path))
    codec = ObjectCodec(FP)
    st = Staging(4096)
    item = make_object(codec, st, 0, key(7), 1, b"q" * 77)
    assert a.put([item], st) == [None]
    assert b.exists([item[0]]) == [True]
    assert b.get([(item[0], 2048, item[2])], st) == [item[2]]
    codec.check(st.view[2048:2048 + item[2]], key(7), 1, 77)


def test_file_store_directory_gone_is_an_error(tmp_path):
    s = FileStore(str(tmp_path / "d"))
    os.rmdir(tmp_path / "d")
    with pytest.raises(OSError):
        s.exists(["x"])


# ---------------------------------------------------------------------------- Mooncake faults


def _mooncake_client(url: str):
    from kvcm.dataplane.mooncake_store import MooncakeStore

    return MooncakeStore.from_url(url)


def test_mooncake_store_down(fresh_mooncake):
    s = _mooncake_client(fresh_mooncake.url)
    codec = ObjectCodec(FP)
    st = Staging(4096)
    s.register(st)
    try:
        item = make_object(codec, st, 0, key(1), 0, b"m" * 100)
        assert s.put([item], st) == [None]
        fresh_mooncake.kill_master()
        with pytest.raises(OSError):
            s.exists([item[0]])
        (res,) = s.get([item], st)
        assert isinstance(res, OSError)
        (err,) = s.put([make_object(codec, st, 1024, key(2), 0, b"n" * 100)], st)
        assert isinstance(err, OSError)
    finally:
        s.close()
        st.close()


def test_local_mooncake_retries_a_port_taken_before_the_master_binds_it(tmp_path, monkeypatch):
    """A picked port is taken by someone else before the master binds it: the master exits,
    the launch is retried with new ports and the store works."""
    need_mooncake()
    import socket

    import kvcm.dataplane.mooncake_store as ms

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])  # the first pick (the master's rpc port) is taken
    free = ms._free_port
    monkeypatch.setattr(ms, "_free_port", lambda: next(picks, None) or free())
    try:
        with ms.LocalMooncake(16 << 20, log_dir=str(tmp_path)) as mc:
            assert mc.attempts == 2 and mc.rpc_port != taken.getsockname()[1]
            s = _mooncake_client(mc.url)
            try:
                assert s.exists([ObjectCodec(FP).name(key(1), 0)]) == [False]
            finally:
                s.close()
    finally:
        taken.close()


def test_mooncake_objects_lost_with_their_segment(fresh_mooncake):
    """Objects live in the storage client's memory: when it dies they are gone (an
    eviction the data plane sees as a missing object)."""
    s = _mooncake_client(fresh_mooncake.url)
    codec = ObjectCodec(FP)
    st = Staging(4096)
    s.register(st)
    try:
        item = make_object(codec, st, 0, key(1), 0, b"m" * 100)
        assert s.put([item], st) == [None]
        fresh_mooncake.kill_client()
        (res,) = s.get([item], st)
        assert isinstance(res, OSError)
    finally:
        s.close()
        st.close()


def test_mooncake_failed_write_is_not_visible(tmp_path):
    """A store too small for the object: the put fails and no object appears."""
    from mooncake_env import start

    with start(str(tmp_path), segment_bytes=16 << 20) as mc:  # Mooncake's smallest segment
        s = _mooncake_client(mc.url)
        codec = ObjectCodec(FP)
        st = Staging(24 << 20)
        s.register(st)
        try:
            big = make_object(codec, st, 0, key(1), 0, b"b" * (20 << 20))
            (err,) = s.put([big], st)
            assert isinstance(err, OSError)
            assert s.exists([big[0]]) == [False]
        finally:
            s.close()
            st.close()


def test_missing_mooncake_skips_locally_and_fails_in_ci(monkeypatch):
    import importlib.util

    import mooncake_env

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        mooncake_env.need_mooncake()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run"):
        mooncake_env.need_mooncake()


# ---------------------------------------------------------------------------- authentication

SECRET = hashlib.sha256(b"the fleet's store secret").digest()
OTHER_SECRET = hashlib.sha256(b"another fleet's store secret").digest()


def _forged(forgery: str) -> tuple[bytes, bytes]:
    """(a genuine object of key 1, lc 2 written with SECRET, one forged in its place) —
    each forgery intact (magic, fingerprint, key, lc, length and CRC all right)."""
    from kvcm.dataplane.store import FIELDS, MAGIC

    codec = ObjectCodec(FP, SECRET)
    payload, evil = bytes(range(64)), bytes(64)
    good = codec.header(key(1), 2, payload) + payload
    if forgery == "no mac":  # written without a secret
        return good, ObjectCodec(FP).header(key(1), 2, evil) + evil
    if forgery == "another secret":
        return good, ObjectCodec(FP, OTHER_SECRET).header(key(1), 2, evil) + evil
    if forgery == "payload replaced, crc fixed":  # the genuine header's MAC kept
        fields = FIELDS.pack(MAGIC, FP, key(1), 2, 64, zlib.crc32(evil))
        return good, fields + good[FIELDS.size:HEADER.size] + evil
    if forgery == "replayed from another key":  # a genuine object of key 2, relabelled
        other = codec.header(key(2), 2, payload)
        return good, FIELDS.pack(MAGIC, FP, key(1), 2, 64, zlib.crc32(payload)) + other[FIELDS.size:] + payload
    assert forgery == "replayed from another namespace"  # same secret, another layout / namespace
    other = ObjectCodec(OTHER_FP, SECRET).header(key(1), 2, payload)
    return good, FIELDS.pack(MAGIC, FP, key(1), 2, 64, zlib.crc32(payload)) + other[FIELDS.size:] + payload


@pytest.mark.parametrize("forgery", ["no mac", "another secret", "payload replaced, crc fixed",
                                     "replayed from another key", "replayed from another namespace"])
def test_an_object_without_a_valid_mac_is_rejected_like_a_corrupted_one(forgery):
    """With a secret, an object verifies only if a holder of the secret wrote it under
    its own name: a forger who can write the store but lacks the secret gets a
    BadObjectError (EIO, ``what == "mac"``) however well-formed the object is."""
    from kvcm.dataplane.store import BadObjectError

    codec = ObjectCodec(FP, SECRET)
    good, forged = _forged(forgery)
    codec.check(memoryview(good), key(1), 2, 64)  # the genuine object passes
    assert len(forged) == len(good)
    with pytest.raises(BadObjectError) as e:
        codec.check(memoryview(forged), key(1), 2, 64)
    assert e.value.errno == errno.EIO and e.value.what == "mac" and "mac" in str(e.value)


def test_a_reader_without_a_secret_rejects_an_object_with_a_mac():
    from kvcm.dataplane.store import BadObjectError

    good, _ = _forged("no mac")
    with pytest.raises(BadObjectError) as e:
        ObjectCodec(FP).check(memoryview(good), key(1), 2, 64)
    assert e.value.what == "mac"


def test_with_a_secret_names_hide_the_block_key():
    """Names are a keyed hash of the block key: a listing shows no block key, and writers
    without the secret, or with another, never use the same names."""
    plain, keyed, other = ObjectCodec(FP), ObjectCodec(FP, SECRET), ObjectCodec(FP, OTHER_SECRET)
    n = keyed.name(key(1), 0)
    assert key(1).hex() not in n and n.startswith(f"kvcm-{FP.hex()}-") and n.endswith("-0")
    assert len(n) == len(plain.name(key(1), 0))
    assert n == ObjectCodec(FP, SECRET).name(key(1), 0)  # deterministic across processes
    assert len({n, plain.name(key(1), 0), other.name(key(1), 0), keyed.name(key(1), 1), keyed.name(key(2), 0),
                ObjectCodec(OTHER_FP, SECRET).name(key(1), 0)}) == 6
    assert SECRET.hex() not in repr(keyed) and "authenticated=True" in repr(keyed)


def test_store_secret_sources_and_precedence(tmp_path):
    """Argument, then the config's file, then $KVCM_STORE_SECRET_FILE or $KVCM_STORE_SECRET
    (both: an error); an empty variable is unset; too short is an error that never shows the
    secret; a file loses its trailing line end and warns when others may read it."""
    import warnings

    from kvcm.dataplane.store import InsecureStoreWarning, store_secret

    f = tmp_path / "secret"
    f.write_bytes(b"from the file, 32 bytes long....\n")
    f.chmod(0o600)
    env_val = "from the environment, long enough"
    env = {"KVCM_STORE_SECRET": env_val}
    assert store_secret(environ={}) == (None, "")
    assert store_secret(environ={"KVCM_STORE_SECRET": ""}) == (None, "")
    assert store_secret(environ=env) == (env_val.encode(), "$KVCM_STORE_SECRET")
    assert store_secret(environ={"KVCM_STORE_SECRET_FILE": str(f)}) == (b"from the file, 32 bytes long....",
                                                                         f"file {f}")
    with pytest.raises(ValueError, match="both"):
        store_secret(environ={**env, "KVCM_STORE_SECRET_FILE": str(f)})
    assert store_secret(secret_file=str(f), environ=env)[1] == f"file {f}"  # the config beats the environment
    assert store_secret(b"an argument, long enough", str(f), env) == (b"an argument, long enough", "argument")
    for short in ("tiny secret", b"", b"x" * 15):
        with pytest.raises(ValueError, match="at least 16") as e:
            store_secret(short, environ={})
        assert not short or str(short if isinstance(short, str) else short.decode()) not in str(e.value)
    with pytest.raises(ValueError, match="at least 16") as e:
        store_secret(environ={"KVCM_STORE_SECRET": "tiny secret"})
    assert "tiny secret" not in str(e.value)
    with pytest.raises(OSError, match="secret file") as e:
        store_secret(secret_file=str(tmp_path / "missing"), environ={})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store_secret(secret_file=str(f), environ={})  # 0600: no warning
    f.chmod(0o644)
    with pytest.warns(InsecureStoreWarning, match="readable by others"):
        store_secret(secret_file=str(f), environ={})


def test_the_config_names_the_secret_file_never_the_secret(tmp_path):
    from kvcm import ConfigError

    layers = [AttentionLayer(0, 8)]
    tiers = [Tier("gpu", 1 << 20), Tier("shared", 0, str(tmp_path))]
    resolve_config(KVCacheManagerConfig(4, layers, tiers, shared_namespace="m", shared_secret_file="/etc/kvcm/key"))
    with pytest.raises(ConfigError, match="shared_secret_file") as e:
        resolve_config(KVCacheManagerConfig(4, layers, tiers, shared_namespace="m",
                                            shared_secret_file=b"the secret itself by mistake"))
    assert "the secret itself" not in str(e.value)
    with pytest.raises(ConfigError, match="shared_secret_file"):
        resolve_config(KVCacheManagerConfig(4, layers, tiers, shared_namespace="m", shared_secret_file="a\0b"))


def test_file_store_creates_its_directory_0700_and_warns_when_others_may_write(tmp_path):
    """A directory the store creates is 0700 (objects and block keys are this user's); an
    existing one keeps its mode, with a warning when group or others may write into it."""
    import stat
    import warnings

    from kvcm.dataplane.store import InsecureStoreWarning

    old = os.umask(0o022)
    try:
        FileStore(str(tmp_path / "new" / "store"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "store").st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode, warns in ((0o755, False), (0o700, False), (0o775, True), (0o1777, True)):
        shared.chmod(mode)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            FileStore(str(shared))
        got = [x for x in w if issubclass(x.category, InsecureStoreWarning)]
        assert bool(got) == warns, oct(mode)
        assert stat.S_IMODE(os.stat(shared).st_mode) == mode  # never changed
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        FileStore(str(tmp_path / "file"))


def test_two_writers_keep_the_directory_near_the_quota(tmp_path):
    """Two writers on one directory (two instances of a fleet): each used to rescan only when
    its own estimate passed the quota, blind to the other's bytes, and the directory grew to
    ~1.9x the quota.  Each now also rescans once per 10% of the quota it writes: the directory
    stays below quota * (1 + 2 * 0.1) plus a batch each."""
    size = HEADER.size + 100
    quota = 200 * size
    writers = [FileStore(str(tmp_path), quota_bytes=quota, fsync=False) for _ in range(2)]
    codec = ObjectCodec(FP)
    st = Staging(16 * size)
    rng = random.Random(7)
    peak = 0
    for i in range(600):
        w = writers[i % 2]
        batch = [make_object(codec, st, j * size, key(rng.randrange(10**6)), 0, bytes(100)) for j in range(rng.randint(1, 8))]
        assert w.put(batch, st) == [None] * len(batch)
        peak = max(peak, writers[0].usage()[1])
    assert peak > quota  # precondition: the writers did run into the quota
    assert peak <= quota * 1.2 + 2 * 8 * size, f"the directory reached {peak / quota:.2f}x the quota"
