"""What the connector costs vLLM per step, without an engine (tests/vllm_sim.py drives the
scheduler and workers in vLLM's order, on the leg's backend): a waiting request is not
probed afresh every step, a load from disk is synchronous when its request is the only
work, an asynchronous load in a step without a forward is reported in that step, loads
overtake queued saves, the transfer thread leaves the forward's core, and a load that
failed is never promised again (DECISIONS.md "kvcm at the limit inside vLLM")."""

from __future__ import annotations

import os
import threading
import time

import pytest
from kvcm.integrations.vllm.metadata import LoadPlan, SavePlan
from kvcm.integrations.vllm.transfer import forward_cpus, pin_to_spare_cpus
from vllm_sim import SIM_PAGE, Chats, Req, Sim, rig


def extra(tmp_path, backend: str, **kw) -> dict:
    return {"backend": backend, "host_bytes": 24 * SIM_PAGE, "disk_path": str(tmp_path / "disk"),
            "disk_bytes": 96 * SIM_PAGE, **kw}


def shared_extra(tmp_path, backend: str, shared, **kw) -> dict:
    return {"backend": backend, "host_bytes": 24 * SIM_PAGE, "shared": str(shared), "shared_namespace": "sim-model@1",
            "shared_store_class": "vllm_fault_store:FaultyFileStore", "shared_timeout_s": 0.5, **kw}


@pytest.fixture
def fault_file(tmp_path, monkeypatch):
    path = tmp_path / "fault"
    monkeypatch.setenv("KVCM_TEST_FAULT_FILE", str(path))
    path.write_text("")
    return path


def one_at_a_time(sim: Sim, chats: Chats, turns: int) -> None:
    """Each turn's requests one after another (the next is added once the last finished)."""
    for _ in range(turns):
        ids = []
        for i, c in enumerate(chats.chats):
            c += [chats.rng.randrange(1, 500) for _ in range(chats.user)]
            rid = f"t{chats.turns}c{i}"
            sim.add(rid, list(c), chats.reply)
            sim.run()
            ids.append(rid)
        chats.turns += 1
        chats.finish_turn(sim, ids)


# ---------------------------------------------------------------------------------------
# probes


def test_a_waiting_request_is_not_probed_afresh_while_nothing_changed(tmp_path, backend, sims) -> None:
    """vLLM asks about a waiting request every step: the answer is memoized until the
    manager or the live requests change, and is the same answer a fresh probe gives."""
    sim = rig(extra(tmp_path, backend), num_blocks=20)
    sims.append(sim)
    chats = Chats(n=2)
    chats.run(sim, 2)  # kvcm holds blocks of both chats
    sched = sim.sched
    r = Req("x", chats.chats[0] + [7] * 40, 4)
    first = sched.get_num_new_matched_tokens(r, 0)
    memo = sched.counters["probes_memoized"]
    for _ in range(5):
        assert sched.get_num_new_matched_tokens(r, 0) == first
    assert sched.counters["probes_memoized"] == memo + 5
    # another request admitted: the manager changed, the next probe is fresh
    other = Req("y", [3] * 40, 4)
    sched.get_num_new_matched_tokens(other, 0)
    sched.update_state_after_alloc(other, [[1, 2, 3]], 0)
    assert sched.get_num_new_matched_tokens(r, 0) == first
    assert sched.counters["probes_memoized"] == memo + 5
    # a different local hit is a different question
    sched.get_num_new_matched_tokens(r, 16)
    assert sched.counters["probes_memoized"] == memo + 5
    sched.request_finished(other)
    sched.request_finished(r)


# ---------------------------------------------------------------------------------------
# synchronous or asynchronous, by the engine's state


def test_auto_loads_from_disk_synchronously_when_the_request_is_alone(tmp_path, backend, sims) -> None:
    """One request at a time: every hit loads in the step that schedules its request (from
    host memory or disk alike: no other request's forward waits for it); exact."""
    sim = rig(extra(tmp_path, backend, host_bytes=6 * SIM_PAGE), num_blocks=20)
    sims.append(sim)
    one_at_a_time(sim, Chats(n=4), 3)
    c = sim.sched.counters
    assert not sim.violations
    assert c["hit_blocks_disk"] > 0 and c["loads_sync"] > 0, dict(c)
    assert c["loads_async"] == 0 and sim.counters["async_loads"] == 0, dict(c)
    assert c["loaded_blocks"] == c["load_blocks_planned"]


def test_auto_loads_from_disk_asynchronously_beside_other_requests(tmp_path, backend, sims) -> None:
    """A turn's requests together: a disk load beside other live requests is asynchronous
    (their forwards do not wait for it)."""
    sim = rig(extra(tmp_path, backend), num_blocks=20)
    sims.append(sim)
    Chats().run(sim, 3)
    c = sim.sched.counters
    assert not sim.violations and c["loads_async"] > 0 and c["hit_blocks_disk"] > 0, dict(c)


def test_an_async_load_in_a_step_without_a_forward_is_reported_in_that_step(tmp_path, backend, sims) -> None:
    """``load_mode`` async, one request at a time: the step that only loads (no forward)
    reports the load done, so the request computes in the very next step."""
    sim = rig(extra(tmp_path, backend, load_mode="async"), num_blocks=12)
    sims.append(sim)
    chats = Chats(n=4)
    chats.run(sim, 1)
    waits = []
    orig = sim.workers[0].get_transfer_results

    def spy(finished=None):
        meta = sim.workers[0].meta
        out = orig(finished)
        if meta is not None and not meta.forward and any(not x.sync for x in meta.loads):
            waits.append(bool(out[1]))  # finished_recving in the same step
        return out

    sim.workers[0].get_transfer_results = spy
    one_at_a_time(sim, chats, 1)
    assert waits and all(waits), (waits, dict(sim.sched.counters))
    assert not sim.violations and sim.sched.counters["loads_async"] > 0


# ---------------------------------------------------------------------------------------
# loads overtake queued saves


def held(eng, hold, name) -> tuple[threading.Event, list[str]]:
    """The transfer thread's jobs run in the order they are taken, recorded by ``name(job)``;
    a job for which ``hold(job)`` is true holds the thread until the gate is set."""
    gate, order = threading.Event(), []
    orig = eng._execute

    def execute(job):
        if hold(job) and not gate.is_set():
            gate.wait(10)  # the first job held keeps the thread while more jobs queue up
        order.append(name(job))
        return orig(job)

    eng._execute = execute
    return gate, order


def test_loads_overtake_queued_saves(tmp_path, backend, sims) -> None:
    """An asynchronous load queued behind saves runs first (it reads no slot they write)."""
    sim = rig(extra(tmp_path, backend), num_blocks=20)
    sims.append(sim)
    eng = sim.workers[0].engine
    gate, order = held(eng, lambda job: job.kind == "saves", lambda job: job.kind)
    pool = eng.pools[0]
    eng.submit_saves([SavePlan(1, "a", [1, 2], [0, 1])], None)
    time.sleep(0.05)  # the thread holds the first save
    eng.submit_saves([SavePlan(2, "b", [3], [2])], None)
    eng.submit_loads([LoadPlan(3, "c", [5], [4], sync=False)], None)  # slot 5: written by no queued job
    gate.set()
    assert eng.wait_loads([3], 10)
    deadline = time.monotonic() + 10
    while eng.gauges()["jobs_queued"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == ["saves", "loads", "saves"], order
    assert pool.shape[0] > 5


def test_a_load_waits_for_the_job_that_writes_its_slot(tmp_path, backend, sims) -> None:
    """A load that reads a slot a queued job writes does not overtake that job."""
    sim = rig(extra(tmp_path, backend), num_blocks=20)
    sims.append(sim)
    eng = sim.workers[0].engine
    gate, order = held(eng, lambda job: True, lambda job: f"{job.kind}:{job.seq}")
    eng.submit_saves([SavePlan(1, "a", [1], [0])], None)
    time.sleep(0.05)
    eng.submit_saves([SavePlan(2, "b", [3], [7])], None)  # writes slot 7
    eng.submit_loads([LoadPlan(3, "c", [7], [4], sync=False)], None)  # reads slot 7
    gate.set()
    assert eng.wait_loads([3], 10)
    assert order == ["saves:1", "saves:2", "loads:3"], order


# ---------------------------------------------------------------------------------------
# the transfer thread's core


def test_forward_cores_are_read_from_vllms_omp_binding() -> None:
    assert forward_cpus({"OMP_PLACES": "{0}"}) == {0}
    assert forward_cpus({"OMP_PLACES": "{0,2,5}"}) == {0, 2, 5}
    assert forward_cpus({"OMP_PLACES": "{4:3}"}) == {4, 5, 6}
    assert forward_cpus({"GOMP_CPU_AFFINITY": "0 1 4-5"}) == {0, 1, 4, 5}
    assert forward_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[3,7]"}) == {3, 7}
    assert forward_cpus({}) == set()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores and sched_setaffinity")
def test_the_transfer_thread_leaves_the_forwards_core(monkeypatch) -> None:
    """vLLM bound the forward to one core: the thread moves to the others (and stays put with
    KVCM_TRANSFER_AFFINITY=off); the caller's own thread is not moved."""
    mine = os.sched_getaffinity(0)
    forward = min(mine)
    monkeypatch.setenv("OMP_PLACES", f"{{{forward}}}")
    got: dict[str, object] = {}

    def run(tag: str) -> None:
        got[tag] = (pin_to_spare_cpus(), os.sched_getaffinity(0))

    t = threading.Thread(target=run, args=("auto",))
    t.start()
    t.join()
    moved, mask = got["auto"]
    assert moved and forward not in moved and mask == moved
    assert os.sched_getaffinity(0) == mine
    monkeypatch.setenv("KVCM_TRANSFER_AFFINITY", "off")
    t = threading.Thread(target=run, args=("off",))
    t.start()
    t.join()
    assert got["off"][0] is None and forward in got["off"][1]


# ---------------------------------------------------------------------------------------
# a load that failed is not promised again


@pytest.mark.parametrize("together", [False, True], ids=["one-at-a-time", "together"])
def test_unreadable_store_objects_are_not_promised_again(tmp_path, backend, sims, fault_file, together) -> None:
    """The store lists objects it cannot deliver (get: EACCES): each request fails at most
    one load, the objects are marked unreadable and never promised again, every request
    finishes exactly (computed), one at a time or all at once."""
    shared = tmp_path / "shared"
    first = rig(shared_extra(tmp_path / "a", backend, shared), num_blocks=40)
    sims.append(first)
    n = 8 if together else 4
    Chats(n=n).run(first, 2)
    assert first.workers[0].plane.shared_stats["stores"] > 0
    second = rig(shared_extra(tmp_path / "b", backend, shared), num_blocks=40, max_num_seqs=n)
    sims.append(second)
    fault_file.write_text("unreadable")
    chats = Chats(n=n)
    if together:
        chats.run(second, 2)
    else:
        one_at_a_time(second, chats, 2)
    c = second.sched.counters
    assert not second.violations
    assert c["unreadable_objects"] > 0 and c["load_error_blocks"] > 0, dict(c)
    assert c["failed_loads"] <= 2 * n, dict(c)  # at most one per request
    # the same prompts again (other requests): still at most one failed load each, and the
    # store never delivered a byte it could not read
    before = dict(c)
    Chats(n=n).run(second, 2)
    assert c["failed_loads"] - before["failed_loads"] <= 2 * n and c["hit_blocks_shared"] == 0, dict(c)
    assert not second.violations
    fault_file.write_text("")


def test_unreadable_objects_are_tried_again_after_a_while_or_a_reset(tmp_path, backend, sims, fault_file,
                                                                      monkeypatch) -> None:
    """The store recovers: objects marked unreadable are promised again after
    ``UNREADABLE_STEPS`` engine steps, or at once after ``reset_prefix_cache``."""
    from kvcm.integrations.vllm import scheduler as sched_mod

    shared = tmp_path / "shared"
    first = rig(shared_extra(tmp_path / "a", backend, shared), num_blocks=40)
    sims.append(first)
    Chats(n=3).run(first, 1)
    # no prefix cache in "vLLM": every prompt asks kvcm
    second = rig(shared_extra(tmp_path / "b", backend, shared), num_blocks=40, prefix_cache=False)
    sims.append(second)
    c = second.sched.counters
    for how in ("steps", "reset"):
        monkeypatch.setattr(sched_mod, "UNREADABLE_STEPS", 10**9)  # marks last while the store fails
        second.sched.mgr.clear_reusable()  # hits from the store only
        fault_file.write_text("unreadable")
        Chats(n=3).run(second, 1)
        assert second.sched.unreadable and c["unreadable_objects"] > 0
        fault_file.write_text("")
        second.sched.mgr.clear_reusable()  # kvcm's local tiers forget: hits can come from the store only
        if how == "steps":
            monkeypatch.setattr(sched_mod, "UNREADABLE_STEPS", 1)
            second.sched.step += 1
        else:
            second.sched.reset()
            assert not second.sched.unreadable
        before = c["hit_blocks_shared"]
        Chats(n=3).run(second, 1)
        assert c["hit_blocks_shared"] > before and not second.violations, (how, dict(c))


def test_an_object_written_again_is_readable_again(tmp_path, backend, sims) -> None:
    """A drain that wrote a marked object (its store op did not fail) makes it readable."""
    from kvcm.api import SHARED, CopyOp

    sim = rig(extra(tmp_path, backend), num_blocks=20)
    sims.append(sim)
    sched = sim.sched
    a, b = (b"a" * 32, 0), (b"b" * 32, 0)
    sched._unreadable([CopyOp(0, SHARED, -1, 0, 3, "onboard", a[0]), CopyOp(0, SHARED, -1, 0, 4, "onboard", b[0])])
    assert set(sched.unreadable) == {a, b} and sched._is_unreadable(a)
    store_b = CopyOp(0, 0, 4, SHARED, -1, "store", b[0])
    sched._unreadable([store_b], stored=[a, b])  # a written, b's store failed
    assert set(sched.unreadable) == {b} and sched.counters["readable_again"] == 1


def test_saves_the_in_flight_bound_deferred_are_made_when_the_request_finishes(tmp_path, backend, sims) -> None:
    """A turn's requests together under a tight in-flight bound: the saves it deferred are
    planned when each request finishes (vLLM keeps its blocks meanwhile), so every block a
    request computed is in kvcm afterwards — a deferral never becomes a miss."""
    sim = rig(extra(tmp_path, backend, host_bytes=64 * SIM_PAGE, max_inflight_bytes=2 * SIM_PAGE), num_blocks=40,
              max_num_seqs=6)
    sims.append(sim)
    chats = Chats(n=6)
    ids = chats.add_turn(sim)
    sim.run()
    c = sim.sched.counters
    assert c["saves_deferred"] > 0 and c["saves_at_finish"] > 0, dict(c)
    assert not sim.violations and c["save_failed_blocks"] == 0 and c["mirror_stops"] == 0
    for rid, chat in zip(ids, chats.chats, strict=True):
        computed = chat + sim.finished[rid][:-1]  # the last output token is sampled, never computed
        probe, _ = sim.sched.loop.probe(computed)
        assert probe.num_tokens == len(computed) // sim.B * sim.B, rid
