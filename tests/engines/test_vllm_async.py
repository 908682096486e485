"""kvcm's vLLM connector without an engine: :class:`KvcmScheduler` and :class:`KvcmWorker`
driven through vLLM 0.32's connector protocol by tests/vllm_sim.py (vLLM's call order, sync
and async scheduling, preemption, aborts, load errors, tensor-parallel ranks), on the
backend of the leg (``KVCM_BACKEND``).  Every forward checks every byte of KV it reads, so
a wrong load, a stale page or a save of garbage served later fails the test ("violations").

The real engine runs in tests/engines/test_vllm_connector.py (the vllm leg)."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable

import pytest
import torch
from kvcm.api import CopyOp
from kvcm.integrations.vllm import worker as worker_mod
from kvcm.integrations.vllm.metadata import KvcmWorkerMetadata, LoadPlan, RankReport, SavePlan
from kvcm.integrations.vllm.stats import KvcmConnectorStats
from vllm_sim import SIM_PAGE, Chats, Sim, close, rig


def extra(tmp_path, backend: str, *, disk: bool = True, shared: bool = False, **kw) -> dict:
    out = {"backend": backend, "host_bytes": 24 * SIM_PAGE}
    if disk:
        out.update(disk_path=str(tmp_path / "disk"), disk_bytes=96 * SIM_PAGE)
    if shared:
        out.update(shared=str(tmp_path / "shared"), shared_namespace="sim-model@1")
    out.update(kw)
    return out


def assert_drained(sim: Sim) -> None:
    """Nothing open or in flight anywhere: the scheduler's mirrors, kvcm's requests and
    unsettled drains, the workers' queues, holds and poisoned slots."""
    p = sim.sched.pending()
    assert p == dict.fromkeys(p, 0), p
    snap = sim.sched.mgr.snapshot()
    assert snap["requests"] == [] and snap["issued_copy_ops"] == [], (snap["requests"], snap["issued_copy_ops"])
    for w in sim.workers:
        g = w.engine.gauges()
        assert g["bytes_in_flight"] == 0 and g["jobs_queued"] == 0 and g["saves_queued"] == 0, g
        assert not w.holds and not w.errors and not w.engine._save_req and not w.engine._pending_saves
    assert not sim.requests and not sim.violations, (list(sim.requests), sim.violations)


class Gate:
    """Holds the transfer threads' jobs of one kind (``"runs"``, ``"loads"``, ``"saves"``)
    until released (the test steps the engine meanwhile)."""

    def __init__(self, sim: Sim, kind: str) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        for w in sim.workers:
            w.engine._execute = self._wrap(w.engine._execute, kind)

    def _wrap(self, execute: Callable, kind: str) -> Callable:
        def gated(job):
            if job.kind == kind:
                self.entered.set()
                self.opened.wait(30)
            return execute(job)

        return gated

    def release(self) -> None:
        self.opened.set()


# ---------------------------------------------------------------------------------------
# exactness


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
@pytest.mark.parametrize("load_mode", ["auto", "sync", "async"])
def test_multi_turn_exact_with_host_and_disk_hits(tmp_path, backend, sims, load_mode, async_scheduling) -> None:
    """Every forward reads exactly the KV a cold run computes; blocks come back from kvcm's
    host and disk tiers (vLLM's small cache evicts them); ``auto`` loads host hits
    synchronously and disk hits asynchronously; nothing is left open afterwards."""
    sim = rig(extra(tmp_path, backend, load_mode=load_mode), num_blocks=20, async_scheduling=async_scheduling)
    sims.append(sim)
    Chats().run(sim, 3)
    c = sim.sched.counters
    assert not sim.violations
    assert c["hit_blocks_host"] > 0 and c["hit_blocks_disk"] > 0, dict(c)
    assert c["loaded_blocks"] == c["load_blocks_planned"] and c["load_error_blocks"] == 0
    assert c["saved_blocks"] > 0 and c["save_failed_blocks"] == 0
    if load_mode == "auto":
        assert c["loads_sync"] > 0 and c["loads_async"] > 0, dict(c)
    elif load_mode == "sync":
        assert c["loads_async"] == 0 and sim.counters["async_loads"] == 0
    else:
        assert c["loads_sync"] == 0 and sim.counters["async_loads"] > 0
    assert_drained(sim)


def test_the_checker_catches_a_wrong_load(tmp_path, backend, sims) -> None:
    """The harness's KV check is not vacuous: a load that writes the wrong block is caught."""
    sim = rig(extra(tmp_path, backend, load_mode="sync"), num_blocks=20)
    sims.append(sim)
    cp = sim.workers[0].engine.copier
    orig = cp.load
    cp.load = lambda slots, blocks, pool, sync, after=None: orig(list(reversed(slots)), blocks, pool, sync, after)
    Chats().run(sim, 2)
    assert sim.violations


def test_reuse_scopes_and_skipped_requests(tmp_path, backend, sims) -> None:
    """The connector's ``scope(request)`` puts a request in a kvcm reuse scope (e.g. vLLM's
    cache salt): the same tokens in another scope are no hit; ``skip(request)`` keeps kvcm
    out of a request entirely (its KV depends on more than its tokens)."""
    from kvcm.api import ReuseScope

    sim = rig(extra(tmp_path, backend, disk=False), num_blocks=40, prefix_cache=False,
              scope=lambda r: ReuseScope(salt=1) if r.request_id.startswith("s") else None,
              skip=lambda r: r.request_id.startswith("x"))
    sims.append(sim)
    prompt = list(range(1, 100))
    for rid in ("a0", "s0", "x0"):
        sim.add(rid, prompt, 4)
        sim.run()
    c = sim.sched.counters
    assert c["skipped_requests"] == 1 and c["mirrors"] == 2 and c["loaded_blocks"] == 0
    for rid in ("a1", "s1", "x1"):
        sim.add(rid, prompt, 4)
        sim.run()
    assert c["loaded_blocks"] == 2 * 6 and c["skipped_requests"] == 2 and not sim.violations
    sim.add("short", [7] * 10, 40)  # a prompt shorter than a block is still mirrored: its decode is saved
    sim.run()
    sim.add("short2", [7] * 10 + sim.finished["short"][:30], 4)
    sim.run()
    assert c["loaded_blocks"] == 2 * 6 + 2 and not sim.violations
    assert_drained(sim)


# ---------------------------------------------------------------------------------------
# asynchronous saves


def test_finished_request_keeps_its_blocks_until_its_saves_are_written(tmp_path, backend, sims) -> None:
    """No step waits for its saves; a request that finishes with saves in flight answers
    True (vLLM keeps its blocks) and is freed once the worker reports it in
    finished_sending; a block enters kvcm only once its bytes are written."""
    sim = rig(extra(tmp_path, backend, disk=False), num_blocks=40)
    sims.append(sim)
    gate = Gate(sim, "saves")
    sim.add("r", list(range(1, 70)), 4)
    for _ in range(12):
        sim.step()
    assert gate.entered.is_set()
    assert sim.sched.counters["holds"] == 1 and sim.finished["r"]
    r = sim.requests["r"]
    assert r.held and r.blocks, "vLLM keeps the blocks of a request whose saves are in flight"
    assert sim.sched.mgr.probe_reuse(list(range(1, 70))) == 0, "nothing committed before it is written"
    gate.release()
    sim.run()
    assert "r" not in sim.requests and sim.sched.counters["saved_blocks"] == 4
    assert sim.sched.mgr.probe_reuse(list(range(1, 70))) == 64
    assert_drained(sim)


def test_bytes_in_flight_are_bounded(tmp_path, backend, sims) -> None:
    """Saves past ``max_inflight_bytes`` wait for a later step (a request that finishes first
    just loses them); the scheduler's count never passes the bound by more than the loads
    and copy runs of one step, which cannot wait."""
    sim = rig(extra(tmp_path, backend, disk=False, max_inflight_bytes=3 * SIM_PAGE), num_blocks=40)
    sims.append(sim)
    gate = Gate(sim, "saves")
    for i in range(3):
        sim.add(f"r{i}", [i + 1] * 100, 30)
    peak = 0
    for _ in range(20):
        sim.step()
        peak = max(peak, sim.sched.inflight_bytes)
    assert peak <= 3 * SIM_PAGE, peak
    assert sim.sched.counters["saves_deferred"] > 0
    gate.release()
    sim.run()
    assert not sim.violations and sim.sched.counters["saved_blocks"] > 3
    assert_drained(sim)


def _poisoning_save(cp, fail_calls: set[int], fail: bool = True) -> list[int]:
    """``cp.save`` replaced: the calls numbered in ``fail_calls`` write WRONG bytes into their
    tier-0 slots (every byte flipped) and then fail (``fail=False``: and then report success,
    the control).  Returns the list of slots so written."""
    orig, calls, poisoned = cp.save, [0], []

    def save(blocks, slots, pool, after):
        calls[0] += 1
        orig(blocks, slots, pool, after)
        if calls[0] in fail_calls:
            for s in slots:
                pool[s] = pool[s].bitwise_not()  # served, these bytes would change what a forward reads
            poisoned.extend(slots)
            if fail:
                raise RuntimeError("test: copy failed")

    cp.save = save
    return poisoned


def test_a_failed_save_is_dropped_never_served(tmp_path, backend, sims) -> None:
    """A save that fails after writing wrong bytes: its pages are dropped, never served --
    every forward of the next turns (which reuse those prefixes) reads the exact KV.  vLLM's
    cache is small (12 blocks): the next turns' prefixes are kvcm's loads, not vLLM's hits."""
    sim = rig(extra(tmp_path, backend, disk=False), num_blocks=12)
    sims.append(sim)
    poisoned = _poisoning_save(sim.workers[0].engine.copier, {2, 3})
    chats = Chats(n=3)
    chats.run(sim, 3)
    c = sim.sched.counters
    assert poisoned and c["save_failed_blocks"] >= len(poisoned) and c["loaded_blocks"] > 0
    assert not sim.violations, sim.violations[:3]
    assert_drained(sim)


def test_a_poisoned_save_reported_as_done_would_be_seen(tmp_path, backend, sims) -> None:
    """The control of the test above: the same wrong bytes from a save that reports success
    are served, and a forward reads wrong KV (so the test above can fail)."""
    sim = rig(extra(tmp_path, backend, disk=False), num_blocks=12)
    sims.append(sim)
    poisoned = _poisoning_save(sim.workers[0].engine.copier, {2, 3}, fail=False)
    Chats(n=3).run(sim, 3)
    assert poisoned and sim.sched.counters["save_failed_blocks"] == 0 and sim.sched.counters["loaded_blocks"] > 0
    assert sim.violations


# ---------------------------------------------------------------------------------------
# faults while a load is in flight


def _fail_first(pred: Callable[[CopyOp], bool], exc: Callable[[], BaseException], times: int = 1):
    seen = [0]

    def hook(op: CopyOp) -> None:
        if pred(op) and seen[0] < times:
            seen[0] += 1
            raise exc()

    return hook


def _truncate_disk(tmp_path) -> Callable[[CopyOp], None]:
    done = [False]

    def hook(op: CopyOp) -> None:
        if op.src_tier == 2 and not done[0]:
            done[0] = True
            for name in os.listdir(tmp_path / "disk"):
                if name.startswith("kvcm-pool-"):
                    os.truncate(tmp_path / "disk" / name, 0)

    return hook


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
@pytest.mark.parametrize("fault", ["disk-read-error", "disk-truncated"])
def test_disk_fault_while_async_load_in_flight(tmp_path, backend, sims, fault, async_scheduling) -> None:
    """A disk read fails (or every disk pool file is truncated) as the onboard of a request
    waiting in WAITING_FOR_REMOTE_KVS runs: vLLM is told which blocks did not load (with the
    request's finished_recving), recomputes them exactly, kvcm forgets the pages and rolls
    its requests back; the scheduler's count of load errors is the workers'."""
    sim = rig(extra(tmp_path, backend), num_blocks=20, async_scheduling=async_scheduling)
    sims.append(sim)
    chats = Chats()
    chats.run(sim, 2)
    eng = sim.workers[0].engine
    if fault == "disk-read-error":
        eng.fault_hook = _fail_first(lambda op: op.src_tier == 2, lambda: OSError(errno.EIO, "test: disk"), times=3)
    else:
        eng.fault_hook = _truncate_disk(tmp_path)
    before = dict(sim.sched.counters)
    chats.run(sim, 2)
    c = sim.sched.counters
    assert not sim.violations
    assert c["failed_ops"] > before["failed_ops"] and c["rollbacks"] > before["rollbacks"]
    assert sim.sched.loop.counters["rollbacks"] == c["rollbacks"]  # settled through the engine loop
    assert c["load_error_blocks"] > 0 and c["load_error_blocks"] == sim.counters["invalid_blocks"]
    assert sim.sched.worker_counters["load_error_blocks"] == c["load_error_blocks"]
    assert_drained(sim)


class _FaultFile:
    def __init__(self, path) -> None:
        self.path = path

    def set(self, mode: str) -> None:
        with open(self.path, "w") as f:
            f.write(mode)


@pytest.fixture
def fault_file(tmp_path, monkeypatch) -> _FaultFile:
    path = tmp_path / "fault"
    monkeypatch.setenv("KVCM_TEST_FAULT_FILE", str(path))
    return _FaultFile(path)


def shared_extra(tmp_path, backend, **kw) -> dict:
    return extra(tmp_path, backend, disk=False, shared=True, shared_store_class="vllm_fault_store:FaultyFileStore",
                 shared_timeout_s=0.5, **kw)


@pytest.mark.parametrize("fault", ["delete", "corrupt", "die"])
def test_store_fault_while_async_load_in_flight(tmp_path, backend, sims, fault_file, fault) -> None:
    """A second instance finds the first one's blocks in the shared store; the store fails
    inside the get of a load in flight (the object deleted, corrupted, or the store dying
    for good): those blocks are recomputed exactly, nothing hangs, nothing leaks."""
    first = rig(shared_extra(tmp_path, backend), num_blocks=20)
    sims.append(first)
    chats = Chats(n=4)
    chats.run(first, 1)
    assert first.workers[0].plane.shared_stats["stores"] > 0
    second = rig(shared_extra(tmp_path / "b", backend) | {"shared": str(tmp_path / "shared")}, num_blocks=20)
    sims.append(second)
    fault_file.set(fault)
    chats.run(second, 1)
    c = second.sched.counters
    assert not second.violations and second.sched.counters["loads_async"] > 0
    assert c["load_error_blocks"] > 0 and c["load_error_blocks"] == second.counters["invalid_blocks"]
    if fault == "die":
        assert fault_file.path.read_text() == "down"
    assert_drained(second)
    fault_file.set("")


def test_shared_hits_deliver_from_the_store(tmp_path, backend, sims, fault_file) -> None:
    first = rig(shared_extra(tmp_path, backend), num_blocks=20)
    sims.append(first)
    chats = Chats(n=4)
    chats.run(first, 1)
    second = rig(shared_extra(tmp_path / "b", backend) | {"shared": str(tmp_path / "shared")}, num_blocks=20)
    sims.append(second)
    chats.run(second, 2)
    c = second.sched.counters
    assert c["hit_blocks_shared"] > 0 and c["load_error_blocks"] == 0 and not second.violations
    assert_drained(second)


# ---------------------------------------------------------------------------------------
# preemption and aborts


def test_preemption_while_saves_in_flight(tmp_path, backend, sims, monkeypatch) -> None:
    """A small vLLM cache forces preemptions while the transfer thread is held in a copy
    run: the saves reading the preempted requests' blocks are waited for, then (past the
    wait) cancelled, never run after vLLM reused the blocks; outputs stay exact."""
    monkeypatch.setattr(worker_mod, "PREEMPT_WAIT_S", 0.05)
    sim = rig(extra(tmp_path, backend), num_blocks=14, max_num_seqs=4)
    sims.append(sim)
    chats = Chats(n=4, system=40, user=40)
    chats.run(sim, 1)
    gate = Gate(sim, "runs")
    ids = chats.add_turn(sim)
    for _ in range(200):
        sim.step()
        if sim.counters["preemptions"] >= 2:
            break
    gate.release()
    sim.run()
    chats.finish_turn(sim, ids)
    assert sim.counters["preemptions"] >= 2 and sim.sched.counters["preemptions"] >= 2
    assert sim.sched.worker_counters["saves_cancelled"] > 0 and sim.sched.counters["save_failed_blocks"] > 0
    assert not sim.violations
    assert_drained(sim)


def test_preemptions_under_load_stay_exact(tmp_path, backend, sims) -> None:
    sim = rig(extra(tmp_path, backend), num_blocks=16, max_num_seqs=4, async_scheduling=True)
    sims.append(sim)
    Chats(n=5, system=30, user=20, reply=40).run(sim, 3)
    assert sim.counters["preemptions"] > 0 and not sim.violations
    assert_drained(sim)


def test_abort_while_async_load_in_flight(tmp_path, backend, sims) -> None:
    """A request aborted in WAITING_FOR_REMOTE_KVS: request_finished answers False (vLLM
    itself keeps its blocks until finished_recving), the load completes into them, then
    the blocks are freed and the mirror closed."""
    sim = rig(extra(tmp_path, backend, load_mode="async"), num_blocks=30, prefix_cache=False)
    sims.append(sim)
    chats = Chats(n=2)
    chats.run(sim, 1)
    gate = Gate(sim, "loads")
    ids = chats.add_turn(sim)
    for _ in range(20):
        sim.step()
        if gate.entered.is_set():
            break
    waiting = [r for r in ids if r in sim.requests and sim.requests[r].status == "WAITING_FOR_REMOTE_KVS"]
    assert waiting
    holds = sim.sched.counters["holds"]  # (turn 1's requests may be held: their saves were in flight)
    sim.abort(waiting[0])
    assert sim.sched.counters["holds"] == holds, "a request loading is not held by kvcm"
    assert waiting[0] in sim.requests, "vLLM keeps the blocks of a request loading"
    gate.release()
    sim.run()
    assert not sim.violations
    assert_drained(sim)


def test_abort_while_saves_in_flight(tmp_path, backend, sims) -> None:
    sim = rig(extra(tmp_path, backend, disk=False), num_blocks=30)
    sims.append(sim)
    gate = Gate(sim, "saves")
    sim.add("a", list(range(1, 90)), 20)
    sim.add("b", list(range(3, 90)), 20)
    for _ in range(3):
        sim.step()
    sim.abort("a")
    assert sim.sched.counters["holds"] == 1 and sim.requests["a"].held
    gate.release()
    sim.run()
    assert "a" not in sim.requests and not sim.violations
    assert_drained(sim)


# ---------------------------------------------------------------------------------------
# tensor parallelism


def test_two_ranks_name_their_shards_and_agree(tmp_path, backend, sims, fault_file) -> None:
    """Two workers (ranks 0 and 1, each its own shard of the KV), one scheduler: the
    manager's namespace is the same everywhere, each rank names its objects with its rank;
    a block is a shared hit only when both ranks' objects exist; a load that fails on one
    rank fails for vLLM (the union of the ranks' errors) and is counted once;
    finished_recving and finished_sending count every rank."""
    first = rig(shared_extra(tmp_path, backend), world=2, num_blocks=20)
    sims.append(first)
    chats = Chats(n=3)
    chats.run(first, 1)
    assert first.sched.config.shared_namespace.endswith("|tp2")
    assert [w.config.shared_namespace.rsplit("|", 1)[1] for w in first.workers] == ["tp2/r0", "tp2/r1"]
    assert all(w.plane.shared_stats["stores"] > 0 for w in first.workers)

    second = rig(shared_extra(tmp_path / "b", backend) | {"shared": str(tmp_path / "shared")}, world=2,
                 num_blocks=20)
    sims.append(second)
    sched, rank1 = second.sched, second.workers[1].plane
    prefix = list(chats.chats[0][:-1])
    cand = sched.mgr.shared_candidates(prefix)
    present = [set(p.shared_lookup(cand)) for p in sched.store_clients]
    assert present[0] and present[0] == present[1]
    gone = sorted(present[1])[:2]
    for key, lc in gone:  # rank 1's shard of two blocks disappears: rank 0's alone is no hit
        os.unlink(rank1.shared.path(rank1.codec.name(key, lc)))
    assert set(sched.loop.shared_hits(prefix)) == present[0] - set(gone)
    chats.run(second, 1)
    assert sched.counters["hit_blocks_shared"] > 0 and not second.violations
    assert_drained(second)

    # one rank's onboards fail: vLLM recomputes the union, the scheduler counts it once
    second.workers[1].engine.fault_hook = _fail_first(lambda op: op.reason == "onboard",
                                                      lambda: OSError(errno.EIO, "test: rank 1"), times=2)
    sched.reset()
    second.prefix_cache = False
    chats.run(second, 1)
    c = sched.counters
    assert c["load_error_blocks"] > 0 and c["load_error_blocks"] == second.counters["invalid_blocks"]
    assert not second.violations
    assert_drained(second)


# ---------------------------------------------------------------------------------------
# observability


def test_stats_aggregate_and_reduce() -> None:
    """The stats line's keys are the /metrics names (kvcm: prefix, bytes); the in-flight gauge
    is the scheduler's newest report, not the interval's maximum; a gauge-only report (back to
    0) is not empty, so the line and /metrics end on the same value."""
    a = KvcmConnectorStats(data={"hit_blocks_host": 2, "loaded_bytes": 1 << 20, "bytes_in_flight": 10,
                                 "sched_bytes_in_flight": 327680})
    b = KvcmConnectorStats(data={"hit_blocks_disk": 3, "loaded_bytes": 1 << 20, "bytes_in_flight": 30,
                                 "load_error_blocks": 1})
    a.aggregate(b)
    r = a.reduce()
    assert r["kvcm:hit_blocks"] == 5 and r['kvcm:hit_blocks{tier="disk"}'] == 3 and r["kvcm:loaded_bytes"] == 2 << 20
    assert r["kvcm:bytes_in_flight"] == 327680 and r["kvcm:load_error_blocks"] == 1
    a.aggregate(KvcmConnectorStats(data={"sched_bytes_in_flight": 0}))  # newer: wins, though smaller
    assert a.reduce()["kvcm:bytes_in_flight"] == 0
    assert not a.is_empty() and KvcmConnectorStats(data={"bytes_in_flight": 5}).is_empty()
    assert not KvcmConnectorStats(data={"sched_bytes_in_flight": 0}).is_empty()
    assert "kvcm:bytes_in_flight" not in KvcmConnectorStats(data={"hit_blocks_host": 1}).reduce()
    a.reset()
    assert a.is_empty()


def test_stats_count_delivered_blocks_on_both_sides(tmp_path, backend, sims) -> None:
    """vLLM's stats (scheduler + workers, summed): hits are blocks delivered, not planned;
    bytes loaded are the workers'."""
    sim = rig(extra(tmp_path, backend), num_blocks=20)
    sims.append(sim)
    total: dict[str, int] = {}
    orig = sim.execute

    def execute(so):
        out = orig(so)
        for d in out.stats + [sim.sched.take_stats() or {}]:
            for k, v in d.items():
                total[k] = total.get(k, 0) + v if "in_flight" not in k else max(total.get(k, 0), v)
        return out

    sim.execute = execute
    Chats().run(sim, 3)
    c = sim.sched.counters
    hits = sum(total.get(f"hit_blocks_{t}", 0) for t in ("host", "disk", "shared"))
    assert hits == c["loaded_blocks"] > 0
    assert total["loaded_bytes"] == c["loaded_blocks"] * SIM_PAGE
    assert total["saved_bytes"] == c["saved_blocks"] * SIM_PAGE
    assert total.get("load_error_blocks", 0) == c["load_error_blocks"]  # counted once, by the scheduler


def test_events_name_kvcm_tiers(tmp_path, backend, sims) -> None:
    """take_events: kvcm's tier events as vLLM wire events, tier 0 (host memory) as CPU,
    disk as STORAGE; never GPU (vLLM's own cache announces that)."""
    sim = rig(extra(tmp_path, backend), num_blocks=20, kv_events=True)
    sims.append(sim)
    media: dict[str, int] = {}
    chats = Chats()
    for _ in range(3):
        ids = chats.add_turn(sim)
        while sim.requests or sim.sched.busy():
            sim.step()
            for e in sim.sched.take_events():
                if type(e).__name__ == "BlockStored":
                    media[e.medium] = media.get(e.medium, 0) + len(e.block_hashes)
        chats.finish_turn(sim, ids)
    assert media.get("CPU", 0) > 0 and media.get("STORAGE", 0) > 0 and "GPU" not in media, media


# ---------------------------------------------------------------------------------------
# the transfer engine


def test_poisoned_slots_fail_what_reads_them(tmp_path, backend, sims) -> None:
    """A slot whose write failed poisons every later op and load reading it (a store op
    never publishes its bytes) until a later write to it succeeds."""
    sim = rig(extra(tmp_path, backend), num_blocks=8)
    sims.append(sim)
    eng = sim.workers[0].engine
    eng.fault_hook = _fail_first(lambda op: True, lambda: OSError(errno.EIO, "test"))
    from kvcm.api import copy_runs

    eng.submit_runs(1, copy_runs([CopyOp(0, 0, 3, 2, 5, "offload")]))  # fails: disk slot 5 poisoned
    eng.submit_runs(2, copy_runs([CopyOp(0, 2, 5, 0, 4, "onboard")]))  # reads it: fails, tier-0 slot 4 poisoned
    eng.submit_loads([LoadPlan(7, "r", [4, 1], [0, 1], sync=False)])
    eng.submit_saves([SavePlan(8, "r", [2], [4])], None)  # rewrites slot 4: unpoisoned
    eng.submit_loads([LoadPlan(9, "r", [4], [3], sync=False)])
    deadline = time.monotonic() + 10
    while eng.gauges()["jobs_queued"] and time.monotonic() < deadline:
        eng.wait_any(0.1)
    done = eng.take()
    assert [(s, len(f)) for s, f in done.drains] == [(1, 1), (2, 1)]
    assert done.loads == {7: [0], 9: []} and done.saves == {8: True}
    assert eng.gauges()["poisoned_slots"] == 1  # disk slot 5, never rewritten


def test_sync_load_waits_only_for_the_writes_of_its_slots(tmp_path, backend, sims) -> None:
    sim = rig(extra(tmp_path, backend), num_blocks=8)
    sims.append(sim)
    eng = sim.workers[0].engine
    gate = Gate(sim, "runs")
    from kvcm.api import copy_runs

    eng.submit_runs(1, copy_runs([CopyOp(0, 2, 0, 0, 6, "onboard")]))  # writes slot 6: held
    t0 = time.monotonic()
    out = eng.sync_loads([LoadPlan(1, "r", [2], [0], sync=True)])
    assert out == {1: []} and time.monotonic() - t0 < 5
    threading.Timer(0.3, gate.release).start()
    t0 = time.monotonic()
    out = eng.sync_loads([LoadPlan(2, "r", [6], [1], sync=True)])
    assert time.monotonic() - t0 >= 0.25
    assert out == {2: [0]}  # the onboard read a never-written disk slot: the load fails


def test_a_jobs_outcome_is_seen_with_its_completion(tmp_path, backend, sims) -> None:
    """Whoever sees a job's results sees it done: while a load job runs, take() reports
    nothing of it and its bytes are in flight; the first take() that reports it finds its
    bytes released and nothing queued (the outcome is published under the lock that marks
    the job done)."""
    sim = rig(extra(tmp_path, backend), num_blocks=8)
    sims.append(sim)
    eng = sim.workers[0].engine
    entered, opened = threading.Event(), threading.Event()
    orig = eng.copier.load

    def held(slots, blocks, pool, sync, after=None):
        entered.set()
        opened.wait(30)
        orig(slots, blocks, pool, sync, after)

    eng.copier.load = held
    eng.submit_loads([LoadPlan(5, "r", [1, 2], [0, 1], sync=False)])
    assert entered.wait(10)
    assert eng.take().loads == {} and eng.gauges()["bytes_in_flight"] == 2 * SIM_PAGE
    threading.Timer(0.05, opened.set).start()
    seen = []
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        done = eng.take()
        if done.loads:
            seen.append((done.loads, eng.gauges()))
    assert seen, "the load never completed"
    loads, gauges = seen[0]
    assert loads == {5: []} and gauges["bytes_in_flight"] == 0 and gauges["jobs_queued"] == 0


def test_async_loads_start_after_the_marker_of_their_step(tmp_path, backend, sims) -> None:
    """start_load_kv hands an asynchronous load the marker recorded on vLLM's thread when it
    was queued (on CUDA: an event on the compute stream, so vLLM's zeroing of the blocks it
    allocated comes first; the transfer thread's current stream is not vLLM's); a
    synchronous load runs on vLLM's thread and records its own (``after`` None)."""
    from kvcm.integrations.vllm.metadata import KvcmConnectorMetadata

    sim = rig(extra(tmp_path, backend), num_blocks=8)
    sims.append(sim)
    w = sim.workers[0]
    eng = w.engine
    marker = object()
    eng.copier.forward_marker = lambda: marker
    seen: dict[bool, object] = {}
    orig = eng.copier.load

    def recording(slots, blocks, pool, sync, after=None):
        seen[sync] = after
        orig(slots, blocks, pool, sync, after)

    eng.copier.load = recording
    meta = KvcmConnectorMetadata(1, loads=[LoadPlan(1, "a", [1], [2], sync=False),
                                           LoadPlan(2, "b", [3], [4], sync=True)])
    w.start_load_kv(meta)
    deadline = time.monotonic() + 10
    while eng.gauges()["jobs_queued"] and time.monotonic() < deadline:
        eng.wait_any(0.1)
    assert seen == {False: marker, True: None}
    _sending, recving, _ = w.get_transfer_results()
    assert recving == {"a"} and w.get_block_ids_with_load_errors() == set()


def test_close_with_work_queued_fails_it_and_joins(tmp_path, backend) -> None:
    sim = rig(extra(tmp_path, backend), num_blocks=8)
    eng = sim.workers[0].engine
    gate = Gate(sim, "runs")
    from kvcm.api import copy_runs

    eng.submit_runs(1, copy_runs([CopyOp(0, 0, 1, 2, 1, "offload")]))
    eng.submit_saves([SavePlan(3, "r", [1], [2])], None)
    threading.Timer(0.2, gate.release).start()
    close(sim)
    assert not eng.alive
    done = eng.take()
    assert done.saves == {3: False}


def test_worker_meta_aggregates_ranks() -> None:
    a = KvcmWorkerMetadata({0: RankReport(saves={1: True})})
    b = KvcmWorkerMetadata({1: RankReport(saves={1: False})})
    assert set(a.aggregate(b).ranks) == {0, 1}
    with pytest.raises(ValueError, match="ranks \\[0\\]"):
        a.aggregate(KvcmWorkerMetadata({0: RankReport()}))


# ---------------------------------------------------------------------------------------
# a long run


def test_long_run_is_flat(tmp_path, backend, sims) -> None:
    """Hundreds of requests with preemptions, host and disk hits and an abort now and then:
    threads and file descriptors come back to what they were, every internal table drains,
    and Python memory does not grow from the first half of the run to the second."""
    import tracemalloc

    sim = rig(extra(tmp_path, backend), num_blocks=16, max_num_seqs=4)
    sims.append(sim)
    chats = Chats(n=6, system=20, user=20, reply=4)
    chats.run(sim, 2)
    threads, fds = set(threading.enumerate()), set(os.listdir("/proc/self/fd"))
    eng = sim.workers[0].engine

    def turns(n: int, first: int) -> None:
        for turn in range(first, first + n):
            ids = chats.add_turn(sim)
            if turn % 7 == 3:
                for _ in range(3):
                    sim.step()
                sim.abort(ids[1])
            sim.run()
            chats.finish_turn(sim, ids)
            if turn % 6 == 5:  # conversations restart: the working set stays bounded
                chats.chats = [c[:20] for c in chats.chats]

    turns(24, 0)
    tracemalloc.start()
    try:
        half = tracemalloc.take_snapshot()
        turns(24, 24)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(half, "filename"))
    finally:
        tracemalloc.stop()
    assert sim.counters["preemptions"] > 0 and sim.sched.counters["hit_blocks_disk"] > 0
    assert sim.sched.counters["mirrors"] > 250 and sim.counters["aborts"] >= 6
    assert grown < 256 << 10, f"Python memory grew {grown} bytes over the second 150 requests"
    assert set(threading.enumerate()) <= threads, "no thread is left behind"
    assert set(os.listdir("/proc/self/fd")) <= fds, "no descriptor is left open"
    assert len(eng._ticket) <= eng.pool.shape[0]
    assert not sim.sched.loads and not sim.sched.saves and not sim.sched.drain_reports and not sim.sched.drain_bytes
    assert_drained(sim)


def test_gpu_copier_requires_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("tests/engines/test_vllm_transfer_gpu.py covers it on CUDA (ci/gpu-check.sh)")
    from kvcm.integrations.vllm.transfer import CudaCopier, Part

    with pytest.raises((RuntimeError, AssertionError)):
        CudaCopier([Part(torch.zeros(2, 2), 0, 8)], torch.device("cuda"))

