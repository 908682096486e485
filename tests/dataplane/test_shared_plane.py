"""The data plane's shared tier (DECISIONS.md "The shared tier"), driven with hand-made copy
ops: batched store / onboard, one existence query per lookup, and every fault of a load or a
store — on the file store and on Mooncake Store."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import os
import shutil
import signal
import time
import zlib

import pytest
import torch
from kvcm.api import SHARED, AttentionLayer, CopyError, CopyOp, KVCacheManagerConfig, SsmLayer, Tier, copy_runs
from kvcm.dataplane import DataPlane
from kvcm.dataplane.store import FileStore, SharedStore, Staging
from mooncake_env import need_mooncake

B = 4
LAYERS = [AttentionLayer(0, 8), SsmLayer(1, 24)]  # lc 0: 32 bytes a slot, lc 1: 24 bytes


def key(i: int) -> bytes:
    return hashlib.sha256(f"k{i}".encode()).digest()


class Spy(SharedStore):
    """Counts the calls that reach the store; ``fail_put`` names objects whose put fails,
    ``fail_get`` maps names to the error their get returns; ``removed`` lists removals."""

    def __init__(self, inner: SharedStore) -> None:
        self.inner = inner
        self.kind, self.location = inner.kind, inner.location
        self.calls: dict[str, int] = {}
        self.fail_put: set[str] = set()
        self.fail_get: dict[str, OSError] = {}
        self.removed: list[str] = []

    def _n(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def exists(self, names):
        self._n("exists")
        return self.inner.exists(names)

    def put(self, items, staging):
        self._n("put")
        ok = [it for it in items if it[0] not in self.fail_put]
        res = iter(self.inner.put(ok, staging))
        return [OSError(5, "injected put failure") if it[0] in self.fail_put else next(res) for it in items]

    def get(self, items, staging):
        self._n("get")
        res = self.inner.get(items, staging)
        return [self.fail_get.get(it[0], r) for it, r in zip(items, res, strict=True)]

    def remove(self, names):
        self.removed += names
        self.inner.remove(names)

    def register(self, staging):
        self.inner.register(staging)

    def unregister(self, staging):
        self.inner.unregister(staging)


@pytest.fixture(params=["file", "mooncake"])
def store_url(request, tmp_path) -> str:
    if request.param == "file":
        return str(tmp_path / "shared")
    need_mooncake()
    return request.getfixturevalue("mooncake").url


def make_plane(url: str, namespace: str, store: SharedStore | None = None, secret: bytes | None = None) -> DataPlane:
    config = KVCacheManagerConfig(B, LAYERS, [Tier("gpu", 8 * 56), Tier("host", 8 * 56), Tier("shared", 0, url)],
                                  shared_namespace=namespace)
    return DataPlane(config, store=store, shared_secret=secret)


def open_spy(url: str) -> Spy:
    from kvcm.dataplane import open_store

    return Spy(open_store(url))


@pytest.fixture
def ns(request) -> str:
    return request.node.nodeid  # a namespace per test: tests never see each other's objects


def fill(plane: DataPlane) -> None:
    g = torch.Generator().manual_seed(1)
    for lc in (0, 1):
        pool = plane.pool("gpu", lc)
        pool.copy_(torch.randint(0, 256, pool.shape, generator=g, dtype=torch.uint8))


def store_ops(n: int) -> list[CopyOp]:
    return [CopyOp(lc, 0, i, SHARED, -1, "store", key=key(i)) for i in range(n) for lc in (0, 1)]


def load_ops(n: int, dst0: int = 4) -> list[CopyOp]:
    return [CopyOp(lc, SHARED, -1, 0, dst0 + i, "onboard", key=key(i)) for i in range(n) for lc in (0, 1)]


def test_store_lookup_onboard_batched(store_url, ns):
    spy = open_spy(store_url)
    with make_plane(store_url, ns, spy) as plane:
        fill(plane)
        before = {lc: plane.pool("gpu", lc)[:3].clone() for lc in (0, 1)}
        assert plane.apply(store_ops(3)) == 6
        assert spy.calls == {"put": 1}  # six objects, one batched put
        cands = [(key(i), lc) for i in range(5) for lc in (0, 1)]
        assert plane.shared_lookup(cands) == cands[:6]
        assert spy.calls["exists"] == 1  # one batched existence query
        assert plane.apply(load_ops(3)) == 6
        assert spy.calls["get"] == 1
        for lc in (0, 1):
            assert torch.equal(plane.pool("gpu", lc)[4:7], before[lc])
        st = plane.shared_stats
        assert (st["stores"], st["loads"], st["store_bytes"], st["load_bytes"]) == (6, 6, 3 * 56, 3 * 56)
        assert plane.routes == {"gpu->shared": 6, "shared->gpu": 6}
    spy.inner.close()


def test_shared_runs_of_alternating_life_cycles_are_one_batch(tmp_path, ns):
    """A drain's store / load ops alternate life cycles, so copy_runs cuts them into runs of
    one op; consecutive shared runs that write no location twice still go as one put / get.
    A run that writes an object again starts the next batch."""
    spy = open_spy(str(tmp_path))
    with make_plane(str(tmp_path), ns, spy) as plane:
        fill(plane)
        runs = copy_runs(store_ops(3))
        assert len(runs) == 6
        assert plane.apply_runs(runs) == 6 and spy.calls == {"put": 1}
        assert plane.apply_runs(copy_runs(load_ops(3))) == 6 and spy.calls["get"] == 1
        assert torch.equal(plane.pool("gpu", 1)[4:7], plane.pool("gpu", 1)[0:3])
        again = [*store_ops(2), CopyOp(0, 0, 5, SHARED, -1, "store", key=key(0))]  # (key 0, lc 0) twice
        assert plane.apply_runs(copy_runs(again)) == 5 and spy.calls["put"] == 3
        bad = [dataclasses.replace(copy_runs([CopyOp(0, 0, 0, SHARED, -1, "store", key=key(0))])[0], keys=[b"short"])]
        with pytest.raises(ValueError, match="32-byte"):
            plane.apply_runs(copy_runs(store_ops(1)) + bad)
        assert spy.calls["put"] == 3  # nothing stored
    spy.inner.close()


def test_ops_as_json_rows(tmp_path, ns):
    with make_plane(str(tmp_path), ns) as plane:
        fill(plane)
        assert plane.apply([op.to_json() for op in store_ops(2)]) == 4
        assert plane.apply([op.to_json() for op in load_ops(2)]) == 4
        assert torch.equal(plane.pool("gpu", 0)[4:6], plane.pool("gpu", 0)[0:2])
        with pytest.raises(ValueError, match="not a copy op"):
            plane.apply([[0, 3, -1, 0, 1, "onboard", "not hex"]])


def test_another_namespace_sees_nothing(store_url, ns):
    with make_plane(store_url, ns) as a, make_plane(store_url, ns + "/other") as b:
        fill(a)
        a.apply(store_ops(2))
        cands = [(key(i), lc) for i in range(2) for lc in (0, 1)]
        assert a.shared_lookup(cands) == cands
        assert b.shared_lookup(cands) == []


def test_bad_shared_ops_are_rejected(tmp_path, ns):
    with make_plane(str(tmp_path), ns) as plane:
        for bad in (CopyOp(0, 0, 1, SHARED, -1, "store"),  # no key
                    CopyOp(0, 0, 1, SHARED, 0, "store", key=key(1)),  # a slot on the shared side
                    CopyOp(0, 0, 1, SHARED, -1, "offload", key=key(1)),  # wrong reason
                    CopyOp(0, SHARED, -1, 0, 1, "store", key=key(1)),
                    CopyOp(0, 0, 1, 1, 1, "offload", key=key(1)),  # a key on a local op
                    CopyOp(0, 0, 1, SHARED, -1, "store", key=b"short")):
            with pytest.raises(ValueError):
                plane.apply([CopyOp(0, 0, 0, 1, 0, "offload"), bad])
        assert plane.copies["offload"] == 0  # nothing ran


def test_load_faults(store_url, ns):
    """Deleted, truncated, foreign objects: their loads fail, the run completes, nothing
    after it runs, CopyError names the failed loads and every later op."""
    spy = open_spy(store_url)
    with make_plane(store_url, ns, spy) as plane:
        fill(plane)
        plane.apply(store_ops(4))
        codec = plane.codec
        spy.remove([codec.name(key(0), 0)])  # evicted / deleted since the lookup
        if isinstance(spy.inner, FileStore):
            with open(spy.inner.path(codec.name(key(1), 1)), "r+b") as f:  # truncated
                f.truncate(40)
            shutil.copy(spy.inner.path(codec.name(key(3), 0)), spy.inner.path(codec.name(key(2), 0)))  # foreign
        later = CopyOp(0, 0, 0, 1, 0, "offload")  # depends on nothing, but comes after the run
        ops = [*load_ops(4), CopyOp(0, 0, 4, 1, 1, "offload"), later]
        with pytest.raises(CopyError) as e:
            plane.apply(ops)
        bad = [load_ops(4)[i] for i in ((0, 3, 4) if isinstance(spy.inner, FileStore) else (0,))]
        assert e.value.ops == [*bad, *ops[-2:]]
        assert plane.shared_stats["load_failures"] == len(bad)
        assert plane.shared_stats["loads"] == 8 - len(bad)
    spy.inner.close()


@pytest.mark.parametrize("err", [errno.EMFILE, errno.ESTALE, errno.EIO, errno.ENOENT, -999])
def test_a_failed_get_removes_only_objects_the_codec_rejected(store_url, ns, err):
    """A get that fails for the store's reasons (out of descriptors, a stale handle, an I/O
    error, an unknown code) says nothing about the object: it stays, for the fleet.  An
    object the codec rejects (foreign bytes under its name) is removed."""
    spy = open_spy(store_url)
    with make_plane(store_url, ns, spy) as plane:
        fill(plane)
        plane.apply(store_ops(3))
        codec = plane.codec
        spy.fail_get[codec.name(key(0), 0)] = OSError(err, "injected get failure")
        ops = load_ops(3)
        if isinstance(spy.inner, FileStore):  # foreign bytes under key 1's name
            shutil.copy(spy.inner.path(codec.name(key(2), 0)), spy.inner.path(codec.name(key(1), 0)))
        with pytest.raises(CopyError) as e:
            plane.apply(ops)
        rejected = [codec.name(key(1), 0)] if isinstance(spy.inner, FileStore) else []
        assert e.value.ops == [ops[0], *([ops[2]] if rejected else [])]
        assert spy.removed == rejected and plane.shared_stats["removed_bad"] == len(rejected)
        spy.fail_get.clear()
        cands = [(key(i), lc) for i in range(3) for lc in (0, 1)]
        assert plane.shared_lookup(cands) == [c for c in cands if codec.name(*c) not in rejected]
        assert plane.apply(load_ops(1)) == 2  # the object that failed to load is still good
    spy.inner.close()


def test_failed_store_stops_nothing(store_url, ns):
    spy = open_spy(store_url)
    with make_plane(store_url, ns, spy) as plane:
        fill(plane)
        ops = store_ops(3)
        spy.fail_put.add(plane.codec.name(key(1), 0))
        after = CopyOp(0, 0, 1, 1, 3, "offload")
        with pytest.raises(CopyError) as e:
            plane.apply([*ops, after])
        assert e.value.ops == [ops[2]]  # only the failed store op
        assert plane.copies["offload"] == 1 and plane.copies["store"] == 5
        cands = [(key(i), lc) for i in range(3) for lc in (0, 1)]
        assert plane.shared_lookup(cands) == [c for c in cands if c != (key(1), 0)]  # never visible
        assert torch.equal(plane.pool("host", 0)[3], plane.pool("gpu", 0)[1])
    spy.inner.close()


def test_failed_store_then_failed_load(tmp_path, ns):
    """A failed store before a failed load: both are listed, in op order."""
    spy = open_spy(str(tmp_path))
    with make_plane(str(tmp_path), ns, spy) as plane:
        fill(plane)
        spy.fail_put.add(plane.codec.name(key(0), 0))
        st = CopyOp(0, 0, 0, SHARED, -1, "store", key=key(0))
        ld = CopyOp(0, SHARED, -1, 0, 6, "onboard", key=key(9))  # never stored
        tail = CopyOp(0, 0, 6, 1, 6, "offload")  # reads what the failed load wrote: a later run
        with pytest.raises(CopyError) as e:
            plane.apply([st, ld, tail])
        assert e.value.ops == [st, ld, tail]


def test_failed_load_before_failed_store_in_one_run(tmp_path, ns):
    """In one run a failed load listed before a failed store that follows it: op order."""
    spy = open_spy(str(tmp_path))
    with make_plane(str(tmp_path), ns, spy) as plane:
        fill(plane)
        spy.fail_put.add(plane.codec.name(key(1), 0))
        ld = CopyOp(0, SHARED, -1, 0, 6, "onboard", key=key(9))  # never stored
        st = CopyOp(0, 0, 1, SHARED, -1, "store", key=key(1))
        with pytest.raises(CopyError) as e:
            plane.apply([ld, st])
        assert e.value.ops == [ld, st]


def test_store_down_lookup_is_empty_and_loads_fail(tmp_path, fresh_mooncake, ns):
    with make_plane(fresh_mooncake.url, ns) as plane:
        fill(plane)
        plane.apply(store_ops(2))
        cands = [(key(i), lc) for i in range(2) for lc in (0, 1)]
        assert plane.shared_lookup(cands) == cands
        fresh_mooncake.kill_master()
        assert plane.shared_lookup(cands) == []  # a store that cannot answer holds nothing
        assert plane.shared_stats["lookup_errors"] == 1
        with pytest.raises(CopyError) as e:
            plane.apply(load_ops(2))
        assert e.value.ops == load_ops(2)
        with pytest.raises(CopyError) as e:
            plane.apply(store_ops(1))
        assert e.value.ops == store_ops(1)


def test_large_batches_are_chunked(tmp_path, ns, monkeypatch):
    import kvcm.dataplane.shared_io as dp

    monkeypatch.setattr(dp, "STAGING_MAX_BYTES", 3 * (dp.HEADER.size + 32))  # three objects a chunk
    spy = open_spy(str(tmp_path))
    with make_plane(str(tmp_path), ns, spy) as plane:
        fill(plane)
        plane.apply(store_ops(4))
        assert spy.calls["put"] >= 3
        plane.apply(load_ops(4))
        for lc in (0, 1):
            assert torch.equal(plane.pool("gpu", lc)[4:8], plane.pool("gpu", lc)[0:4])


# ---------------------------------------------------------------------------------------
# A slow store: a per-call deadline (DECISIONS.md "The shared tier", "Faults")
# ---------------------------------------------------------------------------------------


class Slow(Spy):
    """A store whose exists / put / get take ``delay`` seconds more than the inner one's."""

    delay = 0.0

    def exists(self, names):
        time.sleep(self.delay)
        return super().exists(names)

    def put(self, items, staging):
        time.sleep(self.delay)
        return super().put(items, staging)

    def get(self, items, staging):
        time.sleep(self.delay)
        return super().get(items, staging)


DEADLINE = 0.3
SLOW = 1.5


def test_a_slow_store_fails_like_a_store_that_is_down(store_url, ns):
    """Past the deadline a lookup finds nothing (counted), a load is a CopyError, a store
    is a failed write listed in the CopyError — and the engine waits no longer than the
    deadline.  A get that completes late never writes into a pool slot; the plane goes on
    with a new staging buffer and loads the right bytes once the store is fast again."""
    from kvcm.dataplane import open_store

    slow = Slow(open_store(store_url))
    with make_plane(store_url, ns, slow) as plane:
        plane.shared_timeout_s = DEADLINE
        fill(plane)
        assert plane.apply(store_ops(2)) == 4  # fast: stored
        cands = [(key(i), lc) for i in range(3) for lc in (0, 1)]
        slow.delay = SLOW

        t0 = time.monotonic()
        assert plane.shared_lookup(cands) == []
        assert time.monotonic() - t0 < SLOW - 0.5
        assert plane.shared_stats["lookup_errors"] == 1 and plane.shared_stats["timeouts"] == 1

        sentinel = {lc: torch.full_like(plane.pool("gpu", lc)[4:6], 7) for lc in (0, 1)}
        for lc in (0, 1):
            plane.pool("gpu", lc)[4:6] = sentinel[lc]
        later = CopyOp(0, 0, 0, 1, 0, "offload")
        t0 = time.monotonic()
        with pytest.raises(CopyError) as e:
            plane.apply([*load_ops(2), CopyOp(0, 0, 4, 1, 1, "offload"), later])
        assert time.monotonic() - t0 < SLOW - 0.5
        assert e.value.ops[:4] == load_ops(2) and isinstance(e.value.cause, TimeoutError)
        assert plane.shared_stats["timeouts"] == 2 and plane.shared_stats["loads"] == 0

        t0 = time.monotonic()
        with pytest.raises(CopyError) as e:
            plane.apply(store_ops(3)[4:])  # key 2: never stored before
        assert time.monotonic() - t0 < SLOW - 0.5
        assert e.value.ops == store_ops(3)[4:]
        assert plane.shared_stats["timeouts"] == 3 and plane.shared_stats["store_failures"] == 2

        time.sleep(SLOW + 0.5)  # the late calls complete now: the get into an abandoned buffer
        for lc in (0, 1):
            assert torch.equal(plane.pool("gpu", lc)[4:6], sentinel[lc])  # no pool slot written late
        slow.delay = 0.0
        assert len(plane.shared_io.late) == 3  # the late calls, remembered until their buffers are freed
        assert plane.apply(load_ops(2)) == 4  # a new staging buffer, the right bytes
        assert plane.shared_io.late == []  # the late calls returned: their buffers are freed
        for lc in (0, 1):
            assert torch.equal(plane.pool("gpu", lc)[4:6], plane.pool("gpu", lc)[0:2])
        assert plane.shared_lookup(cands)[:4] == cands[:4]
    slow.inner.close()


def test_the_deadline_is_documented_and_configurable(tmp_path, ns):
    from kvcm.dataplane import open_store
    from kvcm.dataplane.mooncake_store import parse_url
    from kvcm.dataplane.store import DEFAULT_TIMEOUT_S

    assert open_store(str(tmp_path)).timeout_s == DEFAULT_TIMEOUT_S == 10.0
    assert open_store(f"file://{tmp_path}?timeout_s=0.5").timeout_s == 0.5
    assert parse_url("mooncake://h:1?timeout_s=2")["timeout_s"] == 2.0
    assert parse_url("mooncake://h:1")["timeout_s"] == DEFAULT_TIMEOUT_S
    for bad in ("-1", "x", "nan", "inf"):
        with pytest.raises(ValueError, match="timeout_s"):
            open_store(f"file://{tmp_path}?timeout_s={bad}")
        with pytest.raises(ValueError, match="timeout_s"):
            parse_url(f"mooncake://h:1?timeout_s={bad}")
    with pytest.raises(ValueError, match="unknown parameters"):
        open_store(f"file://{tmp_path}?timeout=1")
    with make_plane(f"file://{tmp_path}?timeout_s=0.25", ns) as plane:
        assert plane.shared_timeout_s == 0.25
    config = KVCacheManagerConfig(B, LAYERS, [Tier("gpu", 8 * 56), Tier("shared", 0, str(tmp_path))],
                                  shared_namespace=ns)
    with DataPlane(config, shared_timeout_s=0) as plane:
        assert plane.shared_timeout_s == 0  # no deadline: calls run on the engine's thread
        fill(plane)
        assert plane.apply(store_ops(1)) == 2
    for bad in (-1, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="shared_timeout_s"):
            DataPlane(config, shared_timeout_s=bad)


class Miscounting(Spy):
    """A store that answers with one result too few."""

    def exists(self, names):
        return super().exists(names)[:-1]

    def put(self, items, staging):
        return super().put(items, staging)[:-1]

    def get(self, items, staging):
        return super().get(items, staging)[:-1]


def test_a_store_answering_the_wrong_number_of_results_fails_the_batch(tmp_path, ns):
    store = Spy(FileStore(str(tmp_path)))
    with make_plane(str(tmp_path), ns, store) as plane:
        fill(plane)
        plane.apply(store_ops(2))
        bad = Miscounting(FileStore(str(tmp_path)))
        plane.shared_io.store = bad
        cands = [(key(i), lc) for i in range(2) for lc in (0, 1)]
        assert plane.shared_lookup(cands) == [] and plane.shared_stats["lookup_errors"] == 1
        with pytest.raises(CopyError) as e:
            plane.apply(load_ops(2))
        assert e.value.ops == load_ops(2)
        with pytest.raises(CopyError) as e:
            plane.apply(store_ops(2))
        assert e.value.ops == store_ops(2)
        plane.shared_io.store = store


def wait_stopped(pid: int, timeout: float = 30.0) -> None:
    """Until every thread of ``pid`` is in the stopped state ('T' in /proc): a SIGSTOP takes
    effect when each thread is next scheduled, which a loaded machine can delay."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(s in "tT" for s in states):
            return
        assert time.monotonic() < deadline, f"pid {pid} not stopped: {states}"
        time.sleep(0.01)


def test_a_hung_mooncake_master_costs_the_deadline_only(fresh_mooncake, ns):
    """A real hang (the master stopped with SIGSTOP, its sockets open): every call waits on
    RPCs that never answer.  The plane stops waiting at the deadline; once the master runs
    again the objects are there and load."""
    with make_plane(fresh_mooncake.url, ns) as plane:
        plane.shared_timeout_s = DEADLINE
        fill(plane)
        plane.apply(store_ops(2))
        cands = [(key(i), lc) for i in range(2) for lc in (0, 1)]
        os.kill(fresh_mooncake.master.pid, signal.SIGSTOP)
        try:
            wait_stopped(fresh_mooncake.master.pid)  # hung for certain, not merely slow
            t0 = time.monotonic()
            assert plane.shared_lookup(cands) == []
            with pytest.raises(CopyError) as e:
                plane.apply(load_ops(2))
            assert e.value.ops == load_ops(2)
            # two calls, each cut at the deadline (without it: Mooncake's 30 s RPC timeouts);
            # the slack is for a loaded machine, not a speed claim
            assert time.monotonic() - t0 < 2 * DEADLINE + 10
            assert plane.shared_stats["timeouts"] == 2
        finally:
            os.kill(fresh_mooncake.master.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while plane.shared_lookup(cands) != cands and time.monotonic() < deadline:
            time.sleep(0.2)
        plane.shared_timeout_s = 10.0
        assert plane.apply(load_ops(2)) == 4
        for lc in (0, 1):
            assert torch.equal(plane.pool("gpu", lc)[4:6], plane.pool("gpu", lc)[0:2])


# ---------------------------------------------------------------------------------------
# Authenticated objects (DECISIONS.md "The shared tier", "Object authentication")
# ---------------------------------------------------------------------------------------

SECRET = hashlib.sha256(b"the fleet's store secret").digest()


def forge(store: SharedStore, objects: list[tuple[str, bytes]]) -> None:
    """The forger: writes whole objects under the given names through the store's own API
    (a Mooncake put does not replace an object: removed first)."""
    st = Staging(sum(len(b) for _, b in objects))
    store.register(st)
    try:
        items, off = [], 0
        for name, blob in objects:
            st.view[off:off + len(blob)] = blob
            items.append((name, off, len(blob)))
            off += len(blob)
        store.remove([n for n, _ in objects])
        assert store.put(items, st) == [None] * len(items)
    finally:
        store.unregister(st)
        st.close()


def test_forged_objects_with_a_valid_crc_never_reach_a_pool(store_url, ns):
    """A forger who can write the store — and here even knows the object names — but not
    the secret: objects without a MAC, with another secret's, or a genuine header over
    another payload with the CRC fixed.  Every one is intact, so only the MAC rejects it:
    each load fails (CopyError, the engine recomputes), no byte reaches a pool, each is
    counted (``auth_failures``) and removed like a corrupted object; the plane's own
    objects written again load."""
    from kvcm.dataplane.store import FIELDS, HEADER, MAGIC, ObjectCodec

    spy = open_spy(store_url)
    with make_plane(store_url, ns, spy, secret=SECRET) as plane:
        fill(plane)
        assert plane.codec.authenticated and plane.shared_secret_source == "argument"
        assert plane.apply(store_ops(3)) == 6
        codec, fp = plane.codec, plane.codec.fingerprint
        evil = {lc: bytes([0xAB]) * plane.life_cycles[lc].slot_bytes for lc in (0, 1)}
        objects = []
        for i in range(3):
            for lc in (0, 1):
                if i == 0:  # written without a secret
                    head = ObjectCodec(fp).header(key(i), lc, evil[lc])
                elif i == 1:  # with another secret
                    head = ObjectCodec(fp, b"not the fleet's secret, 32 bytes").header(key(i), lc, evil[lc])
                else:  # the genuine header (its MAC) over another payload, the CRC fixed
                    genuine = codec.header(key(i), lc, plane.pool("gpu", lc)[i].numpy().tobytes())
                    head = FIELDS.pack(MAGIC, fp, key(i), lc, len(evil[lc]), zlib.crc32(evil[lc])) + \
                        genuine[FIELDS.size:HEADER.size]
                objects.append((codec.name(key(i), lc), head + evil[lc]))
        forge(spy.inner, objects)
        cands = [(key(i), lc) for i in range(3) for lc in (0, 1)]
        assert plane.shared_lookup(cands) == cands  # found: the forger wrote under the right names
        sentinel = {lc: torch.full_like(plane.pool("gpu", lc)[4:7], 7) for lc in (0, 1)}
        for lc in (0, 1):
            plane.pool("gpu", lc)[4:7] = sentinel[lc]
        with pytest.raises(CopyError) as e:
            plane.apply(load_ops(3))
        assert e.value.ops == load_ops(3)
        for lc in (0, 1):
            assert torch.equal(plane.pool("gpu", lc)[4:7], sentinel[lc])  # not one byte reached the pool
        st = plane.shared_stats
        assert (st["auth_failures"], st["load_failures"], st["loads"], st["removed_bad"]) == (6, 6, 0, 6)
        assert sorted(spy.removed) == sorted(n for n, _ in objects)
        assert plane.shared_lookup(cands) == []
        assert plane.apply(store_ops(3)) == 6 and plane.apply(load_ops(3)) == 6  # its own objects load
        for lc in (0, 1):
            assert torch.equal(plane.pool("gpu", lc)[4:7], plane.pool("gpu", lc)[0:3])
    spy.inner.close()


def test_secret_and_no_secret_never_read_each_other(store_url, ns):
    """Objects written without a secret are not found by a plane with one, nor those of
    one secret by a plane with another or none (other names); and a MAC'd object put
    under a name of a plane without a secret is rejected there (counted, removed)."""
    with (make_plane(store_url, ns) as plain, make_plane(store_url, ns, secret=SECRET) as keyed,
          make_plane(store_url, ns, secret=b"another secret, at least 16 bytes") as other):
        for p in (plain, keyed, other):
            fill(p)
        cands = [(key(i), lc) for i in range(2) for lc in (0, 1)]
        assert plain.apply(store_ops(2)) == 4
        assert keyed.shared_lookup(cands) == [] and other.shared_lookup(cands) == []
        assert keyed.apply(store_ops(2)) == 4
        assert other.shared_lookup(cands) == [] and plain.shared_lookup(cands) == cands
        # keyed's genuine objects copied under plain's names: intact, but plain has no secret
        spy = open_spy(store_url)
        blobs = []
        for lc in (0, 1):
            page = keyed.pool("gpu", lc)[0].numpy().tobytes()
            blobs.append((plain.codec.name(key(0), lc), keyed.codec.header(key(0), lc, page) + page))
        forge(spy.inner, blobs)
        with pytest.raises(CopyError) as e:
            plain.apply(load_ops(1))
        assert e.value.ops == load_ops(1) and plain.shared_stats["auth_failures"] == 2
        spy.inner.close()
        # the store's own counters ride along in the plane's stats (the file store's quota)
        assert plain.stats()["shared_store"] == plain.shared.stats()
        assert ("skipped" in plain.stats()["shared_store"]) == isinstance(plain.shared, FileStore)
