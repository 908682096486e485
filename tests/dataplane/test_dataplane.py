"""The torch data plane (SPEC sec. 14): pools, byte layout, views, batched copy ops."""

from __future__ import annotations

import array
import errno
import os
import random
import subprocess
import sys

import pytest
import torch
from kvcm import AttentionLayer, CopyOp, KVCacheManagerConfig, SsmLayer, Tier
from kvcm.api import CopyError, CopyRun, copy_runs
from kvcm.dataplane import DataPlane, DiskPool

B = 4
# lc 0: layers 0 and 3 (full attention, 32 + 16 bytes/token); lc 1: layer 1 (window);
# lc 2: layer 2 (ssm, 24 bytes).  slot_bytes: 192, 64, 24 -> 280 per slot set.
LAYERS = [
    AttentionLayer(0, 32),
    AttentionLayer(1, 16, window=8, sink_tokens=1),
    SsmLayer(2, 24),
    AttentionLayer(3, 16),
]
PER = 280
SHAPES = {0: (2, 2, 2), 1: (2, 2), 2: (2, 3), 3: (4,)}
GPU, HOST, DISK = 0, 1, 2


def config(tmp_path, gpu=6, host=5, disk=7) -> KVCacheManagerConfig:
    tiers = [Tier("gpu", gpu * PER)]
    if host:
        tiers.append(Tier("host", host * PER))
    if disk:
        tiers.append(Tier("disk", disk * PER, path=str(tmp_path / "pool")))
    return KVCacheManagerConfig(tokens_per_block=B, layers=LAYERS, tiers=tiers)


@pytest.fixture
def plane(tmp_path):
    with DataPlane(config(tmp_path), shapes=SHAPES) as p:
        fill(p)
        yield p


def raw(pool) -> torch.Tensor:
    """A copy of a pool's bytes (a disk pool is read through its checksummed records)."""
    return pool.read_all() if isinstance(pool, DiskPool) else pool.clone()


def fill(p: DataPlane) -> None:
    """Distinct bytes everywhere, so every copy is visible."""
    for t, row in enumerate(p.pools):
        for lc, pool in enumerate(row):
            n = pool.shape[0] * pool.shape[1]
            data = ((torch.arange(n) * 7 + t * 31 + lc * 101) % 251).to(torch.uint8).view(pool.shape)
            if isinstance(pool, DiskPool):
                pool.write_all(data)
            else:
                pool.copy_(data)


def snapshot(p: DataPlane) -> list[list[torch.Tensor]]:
    return [[raw(pool) for pool in row] for row in p.pools]


def sequential(p: DataPlane, state: list[list[torch.Tensor]], ops) -> None:
    """The meaning of ``apply``: one op at a time, in order."""
    for op in ops:
        state[op.dst_tier][op.lc][op.dst_slot] = state[op.src_tier][op.lc][op.src_slot].clone()


def same(p: DataPlane, state) -> bool:
    return all(torch.equal(raw(a).cpu(), b.cpu()) for ra, rb in zip(p.pools, state, strict=True)
               for a, b in zip(ra, rb, strict=True))


def test_pools_follow_the_config(plane):
    assert plane.tier_kinds == ("gpu", "host", "disk")
    for t, n in enumerate((6, 5, 7)):
        assert [tuple(pool.shape) for pool in plane.pools[t]] == [(n, 192), (n, 64), (n, 24)]
        assert all(raw(pool).dtype == torch.uint8 for pool in plane.pools[t])
    assert plane.pool("gpu", 0).device == torch.device("cpu")
    assert [plane.lc_of(i) for i in range(4)] == [0, 1, 2, 0]


def test_layer_views_follow_the_documented_byte_layout(plane):
    # lc 0 slot: layer 0 (B tokens x 32 bytes), then layer 3 (B x 16), token-major
    k0, k3 = plane.kv(0), plane.kv(3)
    assert tuple(k0.shape) == (6, B, 2, 2, 2) and tuple(k3.shape) == (6, B, 4)
    assert k0.dtype == torch.float32
    k0.zero_()
    k3.zero_()
    k0[2, 1] = 1.5
    k3[4, 3, 2] = -2.0
    raw = plane.pool("gpu", 0)
    assert torch.equal(raw[2, 32:64].view(torch.float32), torch.full((8,), 1.5))
    assert torch.equal(raw[4, 128 + 3 * 16 + 8:128 + 3 * 16 + 12].view(torch.float32), torch.tensor([-2.0]))
    assert int(raw.view(torch.float32).count_nonzero()) == 8 + 1  # nothing else written
    s = plane.state(2, "host")
    assert tuple(s.shape) == (5, 2, 3)
    s[1] = 3.0
    assert torch.equal(plane.pool("host", 2)[1].view(torch.float32), torch.full((6,), 3.0))
    with pytest.raises(ValueError):
        plane.kv(2)  # an ssm layer
    with pytest.raises(ValueError):
        plane.state(0)
    with pytest.raises(ValueError):
        plane.kv(9)


def test_shapes_must_match_the_config(tmp_path):
    with pytest.raises(ValueError):
        DataPlane(config(tmp_path, host=0, disk=0), shapes={0: (3,)})
    with pytest.raises(ValueError):
        DataPlane(config(tmp_path, host=0, disk=0), shapes={7: (1,)})


def test_apply_moves_whole_slots_between_every_pair_of_tiers(plane):
    ops = [
        CopyOp(0, GPU, 1, HOST, 0, "offload"),
        CopyOp(1, HOST, 2, DISK, 6, "offload"),
        CopyOp(2, DISK, 3, GPU, 0, "onboard"),
        CopyOp(0, HOST, 4, GPU, 5, "onboard"),
        CopyOp(0, GPU, 2, GPU, 3, "cow"),
        CopyOp(2, GPU, 5, GPU, 4, "snapshot"),
    ]
    state = snapshot(plane)
    sequential(plane, state, ops)
    assert plane.apply(ops) == len(ops)
    assert same(plane, state)
    assert plane.copies == {"offload": 2, "onboard": 2, "cow": 1, "snapshot": 1, "store": 0, "relocate": 0}
    assert plane.copy_bytes["offload"] == 192 + 64
    assert plane.routes == {"gpu->host": 1, "host->disk": 1, "disk->gpu": 1, "host->gpu": 1, "gpu->gpu": 2}


def test_independent_ops_run_as_one_batch(plane):
    ops = [CopyOp(lc, GPU, s, HOST, s, "offload") for lc in (0, 1) for s in range(5)]
    ops += [CopyOp(0, DISK, s, GPU, 5, "onboard") for s in (0,)]
    state = snapshot(plane)
    sequential(plane, state, ops)
    plane.apply(ops)
    assert same(plane, state)
    assert plane.runs == 3 == len(copy_runs(ops))  # one run per (lc, src tier, dst tier, reason) here
    assert plane.kernel_calls == 3  # one gather + scatter per run


def test_swaps_and_chains_keep_sequential_semantics(plane):
    """A slot freed by one op is the destination of a later op in the same drain."""
    ops = [
        CopyOp(0, GPU, 0, HOST, 0, "offload"),  # swap gpu 0 <-> gpu 1 through host 0 ...
        CopyOp(0, GPU, 1, GPU, 0, "cow"),
        CopyOp(0, HOST, 0, GPU, 1, "onboard"),
        CopyOp(1, GPU, 2, HOST, 3, "offload"),  # ... a chain gpu 2 -> host 3 -> disk 4
        CopyOp(1, HOST, 3, DISK, 4, "offload"),
        CopyOp(1, DISK, 1, GPU, 2, "onboard"),  # ... and the freed gpu 2 refilled
    ]
    before = snapshot(plane)
    state = snapshot(plane)
    sequential(plane, state, ops)
    plane.apply(ops)
    assert same(plane, state)
    assert torch.equal(plane.pool("gpu", 0)[0], before[GPU][0][1])
    assert torch.equal(plane.pool("gpu", 0)[1], before[GPU][0][0])
    assert torch.equal(raw(plane.pool("disk", 1))[4], before[GPU][1][2])
    assert plane.runs == len(copy_runs(ops))


@pytest.mark.parametrize("seed", range(20))
def test_random_drains_equal_sequential_execution(plane, seed):
    rng = random.Random(seed)
    n = {t: [len(pool) for pool in plane.pools[t]] for t in range(3)}
    ops = []
    for _ in range(rng.randint(1, 40)):
        lc = rng.randrange(3)
        st, dt = rng.randrange(3), rng.randrange(3)
        ops.append(CopyOp(lc, st, rng.randrange(n[st][lc]), dt, rng.randrange(n[dt][lc]),
                          rng.choice(["offload", "onboard", "cow", "snapshot"])))
    state = snapshot(plane)
    sequential(plane, state, ops)
    plane.apply(ops)
    assert same(plane, state)
    assert plane.runs == len(copy_runs(ops)) <= len(ops)


@pytest.mark.parametrize(
    "bad",
    [
        CopyOp(0, GPU, 6, HOST, 0, "offload"),  # src slot out of range
        CopyOp(0, GPU, 0, HOST, 5, "offload"),  # dst slot out of range
        CopyOp(0, GPU, -1, HOST, 0, "offload"),
        CopyOp(3, GPU, 0, HOST, 0, "offload"),  # unknown lc
        CopyOp(0, GPU, 0, 3, 0, "offload"),  # unknown tier
        CopyOp(0, -1, 0, GPU, 0, "onboard"),
        CopyOp(0, GPU, 0, HOST, 0, "teleport"),  # unknown reason
        CopyOp(0, GPU, 0.5, HOST, 0, "offload"),  # not an int
        ("not", "an", "op"),
    ],
)
def test_bad_ops_raise_before_anything_is_copied(plane, bad):
    before = snapshot(plane)
    with pytest.raises(ValueError):
        plane.apply([CopyOp(0, GPU, 0, HOST, 0, "offload"), bad])
    assert same(plane, before)
    assert plane.runs == 0 and sum(plane.copies.values()) == 0


def test_a_tier_the_config_lacks_is_unknown(tmp_path):
    with DataPlane(config(tmp_path, disk=0)) as p:
        with pytest.raises(ValueError):
            p.apply([CopyOp(0, HOST, 0, DISK, 0, "offload")])
        with pytest.raises(ValueError):
            p.pool("disk", 0)


def _offloading_manager(cfg, backend: str):
    """A manager of ``cfg`` (one gpu slot) whose drain holds request a's pages moving
    gpu 0 -> disk 0 to make room for request b."""
    import kvcm

    mgr = kvcm.KVCacheManager(cfg, backend=backend)
    a = mgr.create_kv_cache()
    assert a.resume() and a.resize(B)
    a.commit([1, 2, 3, 4])
    a.close()
    b = mgr.create_kv_cache()
    assert b.resume() and b.resize(B)
    return mgr


def test_gpu_disk_config_disk_tier_is_2_as_in_copy_ops(tmp_path):
    """SPEC sec. 1 numbers tiers by kind: with no host tier the manager's copy ops say 2
    for disk, and the data plane executes them (1 names no tier of this config)."""

    cfg = config(tmp_path, gpu=1, host=0, disk=2)
    with DataPlane(cfg, shapes=SHAPES) as p:
        fill(p)
        assert p.pool(DISK, 0) is p.pool("disk", 0) and p.pool(DISK, 0).num_slots == 2
        mgr = _offloading_manager(cfg, "python")
        ops = mgr.drain_copy_ops()
        assert {(op.src_tier, op.dst_tier) for op in ops} == {(GPU, DISK)}
        gpu_before = [p.pool(GPU, lc)[0].clone() for lc in range(3)]
        p.apply(ops)
        for op in ops:
            assert p.pool(DISK, op.lc).read(op.dst_slot) == gpu_before[op.lc].numpy().tobytes()
        assert p.routes == {"gpu->disk": len(ops)}
        for bad in (CopyOp(0, GPU, 0, HOST, 0, "offload"), CopyOp(0, 3, 0, GPU, 0, "onboard")):
            with pytest.raises(ValueError, match="unknown dst tier 1|unknown src tier 3"):
                p.apply([bad])
        with pytest.raises(ValueError, match="unknown tier 1"):
            p.pool(1, 0)


def test_ops_as_json_lists(plane):
    op = CopyOp(2, GPU, 1, HOST, 1, "offload")
    state = snapshot(plane)
    sequential(plane, state, [op])
    plane.apply([op.to_json()])
    assert same(plane, state)


def test_disk_tier_is_a_file_under_its_path(tmp_path):
    p = DataPlane(config(tmp_path), shapes=SHAPES)
    files = sorted(os.listdir(tmp_path / "pool"))
    assert len(files) == 3 and all(f.startswith(f"kvcm-pool-{os.getpid()}-") for f in files)
    state = torch.full((6,), 4.25).view(torch.uint8)
    p.pool("disk", 2).write_rows([6], state.view(1, 24))
    lc2 = next(f for f in files if f.endswith("-lc2.bin"))
    data = (tmp_path / "pool" / lc2).read_bytes()
    rec = 24 + 8  # slot bytes + crc32 trailer
    assert len(data) == 7 * rec  # the whole file is reserved up front
    assert torch.equal(torch.frombuffer(bytearray(data[6 * rec:6 * rec + 24]), dtype=torch.float32),
                       torch.full((6,), 4.25))
    with pytest.raises(ValueError, match="no tensor views"):
        p.state(2, "disk")
    p.close()
    assert os.listdir(tmp_path / "pool") == []


def test_import_kvcm_does_not_import_torch():
    code = "import sys, kvcm, kvcm.dataplane, kvcm.engine_loop, kvcm.engine; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_random_drains_on_the_engine_device(tmp_path):
    """The gpu tier on ``KVCM_ENGINE_DEVICE`` (cuda under ci/gpu-check.sh; host pinned there)."""
    from kvcm.engine import default_device

    with DataPlane(config(tmp_path), device=default_device(), shapes=SHAPES) as p:
        assert p.pool("gpu", 0).device.type == torch.device(default_device()).type
        fill(p)
        rng = random.Random(7)
        for _ in range(10):
            ops = []
            for _ in range(30):
                lc, st, dt = rng.randrange(3), rng.randrange(3), rng.randrange(3)
                ops.append(CopyOp(lc, st, rng.randrange(len(p.pools[st][lc])), dt,
                                  rng.randrange(len(p.pools[dt][lc])), "offload"))
            state = snapshot(p)
            sequential(p, state, ops)
            p.apply(ops)
            assert same(p, state)


# ---------------------------------------------------------------------- apply_runs (CopyRuns)

def _random_ops(rng: random.Random, plane: DataPlane, n_ops: int) -> list[CopyOp]:
    """Ops in stretches of one (lc, src tier, dst tier, reason) — as a drain emits them, so
    runs are long — with random slots: within one tier (cow, snapshot) slots collide."""
    n = {t: [len(pool) for pool in plane.pools[t]] for t in range(3)}
    ops: list[CopyOp] = []
    while len(ops) < n_ops:
        lc, st, dt = rng.randrange(3), rng.randrange(3), rng.randrange(3)
        reason = rng.choice(["cow", "snapshot"] if st == dt else ["offload", "onboard"])
        for _ in range(rng.randint(1, 6)):
            ops.append(CopyOp(lc, st, rng.randrange(n[st][lc]), dt, rng.randrange(n[dt][lc]), reason))
    return ops[:n_ops]


@pytest.mark.parametrize("seed", range(25))
def test_apply_runs_equals_op_by_op_execution(tmp_path, plane, seed):
    rng = random.Random(seed)
    ops = _random_ops(rng, plane, rng.randint(1, 60))
    state = snapshot(plane)
    sequential(plane, state, ops)
    runs = copy_runs(ops)
    assert plane.apply_runs(runs) == len(ops)
    assert same(plane, state)
    assert plane.runs == len(runs)
    with DataPlane(config(tmp_path / "b"), shapes=SHAPES) as q:  # apply(ops) is the same thing
        fill(q)
        q.apply(ops)
        assert same(q, state)
        assert q.stats() == plane.stats()
    assert sum(plane.copies.values()) == len(ops)


def _fail_at(at: int):
    """A fault hook failing the op at position ``at`` of execution (= op) order."""
    seen = iter(range(1 << 30))

    def fault(op: CopyOp) -> None:
        if next(seen) == at:
            raise OSError(errno.EIO, f"injected failure of {op}")

    return fault


@pytest.mark.parametrize("seed", range(12))
def test_apply_runs_failure_names_the_ops_not_completed(tmp_path, plane, seed):
    """A failed op (injected at a random position): its run completes, nothing after it
    runs, CopyError names the failed op and every op of the later runs, in op order, as
    CopyOps; the stats count the completed ops only.  apply(ops) does the same."""
    rng = random.Random(seed)
    ops = _random_ops(rng, plane, rng.randint(2, 40))
    runs = copy_runs(ops)
    at = rng.randrange(len(ops))
    start = 0
    for r in runs:  # the run holding op `at`
        if start + len(r) > at:
            break
        start += len(r)
    end = start + len(r)
    state = snapshot(plane)
    sequential(plane, state, [op for k, op in enumerate(ops[:end]) if k != at])  # the run's ops commute
    plane.fault = _fail_at(at)
    with pytest.raises(CopyError) as e:
        plane.apply_runs(runs)
    assert e.value.ops == [ops[at], *ops[end:]]
    assert all(type(op) is CopyOp for op in e.value.ops)
    assert isinstance(e.value.cause, OSError)
    assert same(plane, state)
    assert sum(plane.copies.values()) == end - 1
    with DataPlane(config(tmp_path / "b"), shapes=SHAPES) as q:
        fill(q)
        q.fault = _fail_at(at)
        with pytest.raises(CopyError) as e2:
            q.apply(ops)
        assert e2.value.ops == e.value.ops and all(a is b for a, b in zip(e2.value.ops, [ops[at], *ops[end:]]))
        assert same(q, state) and q.stats() == plane.stats()


def _run(lc, st, dt, reason, src, dst, keys=None, code="q"):
    return CopyRun(lc, st, dt, reason, array.array(code, src), array.array(code, dst), keys)


@pytest.mark.parametrize(
    "bad",
    [
        _run(0, GPU, HOST, "offload", [6], [0]),  # src slot out of range
        _run(0, GPU, HOST, "offload", [0, 1], [0, 5]),  # dst slot out of range
        _run(0, GPU, HOST, "offload", [-1], [0]),
        _run(3, GPU, HOST, "offload", [0], [0]),  # unknown lc
        _run(0, GPU, 3, "offload", [0], [0]),  # unknown tier (no shared tier here)
        _run(0, -1, GPU, "onboard", [0], [0]),
        _run(0, GPU, 5, "offload", [0], [0]),
        _run(0, GPU, HOST, "teleport", [0], [0]),  # unknown reason
        _run(0, GPU, HOST, "store", [0], [0]),  # a store writes the shared tier
        _run(True, GPU, HOST, "offload", [0], [0]),  # not an int
        _run(0, GPU, HOST, "offload", [0, 1], [0]),  # columns of different lengths
        _run(0, GPU, HOST, "offload", [0], [0], code="i"),  # not int64 columns
        CopyRun(0, GPU, HOST, "offload", [0], [0]),  # lists, not arrays
        _run(0, GPU, HOST, "offload", [0], [0], keys=[b"k" * 32]),  # keys off the shared tier
        _run(0, GPU, HOST, "offload", [0, 1], [2, 2]),  # a slot written twice: not a run
        _run(0, GPU, GPU, "cow", [0, 1], [1, 2]),  # a slot read and written: not a run
        CopyOp(0, GPU, 0, HOST, 0, "offload"),  # an op, not a run
    ],
)
def test_bad_runs_raise_before_anything_is_copied(plane, bad):
    before = snapshot(plane)
    with pytest.raises(ValueError, match=r"runs\[1\]"):
        plane.apply_runs([_run(0, GPU, HOST, "offload", [0, 1], [0, 1]), bad])
    assert same(plane, before)
    assert plane.runs == 0 and sum(plane.copies.values()) == 0 and plane.routes == {}


def test_a_run_reading_one_slot_twice_is_fine(plane):
    state = snapshot(plane)
    ops = [CopyOp(0, GPU, 3, GPU, 1, "cow"), CopyOp(0, GPU, 3, GPU, 2, "cow")]
    sequential(plane, state, ops)
    assert plane.apply_runs([_run(0, GPU, GPU, "cow", [3, 3], [1, 2])]) == 2
    assert same(plane, state) and plane.kernel_calls == 1
    assert plane.apply_runs([_run(0, GPU, GPU, "cow", [4, 0], [4, 5])]) == 2  # a copy onto itself reads what it writes
    with pytest.raises(ValueError, match="do not commute"):
        plane.apply_runs([_run(0, GPU, GPU, "cow", [4, 5], [4, 4])])


@pytest.mark.parametrize("which", ["python", "cpp"])
def test_a_managers_drained_runs_execute(tmp_path, which):
    """drain_copy_runs() of either backend goes straight into apply_runs (gpu -> disk)."""

    cfg = config(tmp_path, gpu=1, host=0, disk=2)
    with DataPlane(cfg, shapes=SHAPES) as p:
        fill(p)
        mgr = _offloading_manager(cfg, which)
        runs = mgr.drain_copy_runs()
        gpu_before = [p.pool(GPU, lc)[0].clone() for lc in range(3)]
        assert p.apply_runs(runs) == sum(len(r) for r in runs) > 0
        for op in (op for r in runs for op in r.ops()):
            assert p.pool(DISK, op.lc).read(op.dst_slot) == gpu_before[op.lc].numpy().tobytes()
