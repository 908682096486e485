"""Failed copies never serve wrong bytes (SPEC sec. 15, issue 8 items 2 and 3): with a copy
failure injected at every position of an op list, or disk pages corrupted from outside,
the engine is told (``CopyError``), reports the ops with ``forget_copies``, recomputes what
the manager rolled back, and generates exactly what a run without any cache generates.

Runs on the env-selected backend (``backend`` fixture)."""

from __future__ import annotations

import errno
import os

import pytest
from kvcm.dataplane import DataPlane
from kvcm.dataplane.disk_pool import TRAILER
from kvcm.engine import Engine, EngineRequest, TinyHybridModel, compare_with_reference, torch_threads
from kvcm.tools.workloads import make_workload

B = 16
LOGIT_TOL = 1e-4
# a tight gpu and a tiny host: requests are preempted, pages cascade to disk and come back
SLOTS = {"gpu_slots": 14, "host_slots": 4, "disk_slots": 300}
# three turns of two conversations: reuse inside a block (cow), ssm snapshots, preemption
WORKLOAD = {"system_len": 21, "conversations": 3, "turns": 4, "user_len": (4, 24), "max_new_tokens": 9}


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def model() -> TinyHybridModel:
    return TinyHybridModel()


class Injector:
    """A DataPlane fault hook: fail the op at global position ``at`` (in execution order),
    or call ``corrupt`` on the first op it matches; records every op list it sees."""

    def __init__(self, at: int | None = None) -> None:
        self.at = at
        self.seen = 0
        self.failed: list = []

    def __call__(self, op) -> None:
        k = self.seen
        self.seen += 1
        if k == self.at:
            self.failed.append(op)
            raise OSError(errno.EIO, f"injected failure of op {k}")


def run(model, make_manager, tmp_path, fault=None, workload=WORKLOAD):
    """Run the workload wave by wave; returns (requests, engine counters, plane stats).
    ``fault``: the plane's fault hook, or a function of the plane that returns it."""
    mgr = make_manager(model.manager_config(B, disk_path=str(tmp_path / "disk"), **SLOTS))
    plane = DataPlane(mgr.config, device=model.device, shapes=model.plane_shapes())
    plane.fault = fault(plane) if getattr(fault, "needs_plane", False) else fault
    engine = Engine(model, mgr, plane)
    w = make_workload("faults", **workload)
    try:
        history = [list(w.system) for _ in w.conversations]
        done = []
        for t in range(max(len(c) for c in w.conversations)):
            wave = [(i, EngineRequest(history[i] + list(c[t]), w.max_new_tokens)) for i, c in enumerate(w.conversations)
                    if t < len(c)]
            engine.generate([r for _, r in wave])
            for i, r in wave:
                history[i] = r.prompt + r.output
            done.extend(r for _, r in wave)
        mgr.check_invariants()
        return done, dict(engine.counters), plane.stats()
    finally:
        plane.close()


def _exact(model, requests) -> None:
    equal, diff = compare_with_reference(model, requests)
    assert equal, "generated tokens differ from the no-cache run"
    assert diff < LOGIT_TOL, diff


def _op_lists(model, make_manager, tmp_path, monkeypatch) -> list[tuple[int, list]]:
    """(global position of its first op, ops) of every non-empty op list of a clean run."""
    lists: list[tuple[int, list]] = []
    seen = 0
    orig = DataPlane.apply_runs

    def spy(self, runs):
        nonlocal seen
        runs = list(runs)
        ops = [op for r in runs for op in r.ops()]
        if ops:
            lists.append((seen, ops))
            seen += len(ops)
        return orig(self, runs)

    with monkeypatch.context() as m:
        m.setattr(DataPlane, "apply_runs", spy)
        run(model, make_manager, tmp_path)
    return lists


def with_plane(make):
    make.needs_plane = True
    return make


def test_copy_failure_at_every_op_position_keeps_generation_exact(model, make_manager, tmp_path, monkeypatch):
    """Was: a copy that failed left its page in the tree, and a later request was served
    bytes that never arrived.  For the first op list of each reason and the longest list
    (16 ops: offloads, onboards, copy-on-write), inject a failure at every position (and
    at every 4th op of the run besides): each run must be exact."""
    clean, counters, _ = run(model, make_manager, tmp_path / "clean")
    _exact(model, clean)
    assert counters["copy_failures"] == 0
    lists = _op_lists(model, make_manager, tmp_path / "spy", monkeypatch)
    chosen: dict[str, tuple[int, list]] = {}
    for start, ops in lists:
        for reason in ("offload", "onboard", "cow", "snapshot"):
            if reason not in chosen and any(o.reason == reason for o in ops):
                chosen[reason] = (start, ops)
    chosen["longest"] = max(lists, key=lambda x: len(x[1]))
    assert set(chosen) == {"offload", "onboard", "cow", "snapshot", "longest"}, sorted(chosen)
    total = sum(len(o) for _, o in lists)
    # every position of the chosen lists, and every 4th op of the run besides (time budget)
    positions = sorted({start + k for start, ops in chosen.values() for k in range(len(ops))} | set(range(0, total, 4)))
    rolled = 0
    for i, at in enumerate(positions):
        inj = Injector(at)
        requests, c, _ = run(model, make_manager, tmp_path / f"at{i}", fault=inj)
        assert len(inj.failed) == 1 and c["copy_failures"] == 1, (at, c)
        _exact(model, requests)
        rolled += c["rollbacks"]
    assert rolled > 0  # not vacuous: requests were rolled back and recomputed


def test_corrupted_disk_pages_are_detected_and_recomputed(model, make_manager, tmp_path):
    """Was: 63 of 63 blocks onboarded from a pool file changed by another process were
    served silently.  Corrupt every disk page's bytes (from outside, through the file)
    just before the first onboard from disk: the checksum catches it, and the output is
    exact."""
    corrupted = {"n": 0}

    @with_plane
    def corrupter(plane):
        def corrupt(op) -> None:
            if corrupted["n"] or plane.tier_kinds[op.src_tier] != "disk":
                return
            for pool in plane.pools[op.src_tier]:  # flip a byte in every written record
                rec = pool.slot_bytes + TRAILER.size
                with open(pool.path, "r+b") as f:
                    for s in range(pool.num_slots):
                        f.seek(s * rec + pool.slot_bytes)
                        if f.read(TRAILER.size)[4:] != b"KVCP":
                            continue
                        f.seek(s * rec)
                        b = f.read(1)
                        f.seek(s * rec)
                        f.write(bytes([b[0] ^ 0x5A]))
                        corrupted["n"] += 1
        return corrupt

    requests, c, _ = run(model, make_manager, tmp_path, fault=corrupter)
    assert corrupted["n"] > 0
    assert c["copy_failures"] >= 1 and c["rollbacks"] >= 1, c
    _exact(model, requests)
    assert not os.listdir(tmp_path / "disk")


def test_engine_survives_a_truncated_pool_file(model, make_manager, tmp_path):
    """A pool file truncated by another process: the reads fail (short read), the
    engine recomputes, and nothing is wrong."""
    done = {"n": 0}

    @with_plane
    def truncater(plane):
        def truncate(op) -> None:
            if not done["n"] and plane.tier_kinds[op.src_tier] == "disk":
                for pool in plane.pools[op.src_tier]:
                    os.truncate(pool.path, 0)
                done["n"] = 1
        return truncate

    requests, c, _ = run(model, make_manager, tmp_path, fault=truncater)
    assert done["n"] and c["copy_failures"] >= 1
    _exact(model, requests)
