"""Disaggregated prefill and decode without an engine (issue 35): two instances, a producer
and a consumer, each a :class:`KvcmScheduler` and its worker driven through vLLM 0.32's
connector protocol by tests/vllm_sim.py, on one directory store.  Their scheduler calls go
through :class:`kvcm.integrations.vllm.handover.Handover` as the connector's facade routes
them.  Every forward checks every byte of KV it reads (``violations``), so a hand-over that
loads wrong bytes fails here; the real engines run in tests/engines/test_vllm_disagg.py."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest
from kvcm.dataplane.store import OBJECT_SUFFIX
from kvcm.integrations.vllm.handover import PARAMS_KEY, Handover, Role, tokens_digest
from kvcm.integrations.vllm.settings import ConnectorSettings
from vllm_sim import SIM_BLOCK, SIM_PAGE, Sim, rig

B = SIM_BLOCK


class Facade:
    """The connector's scheduler-side routing: lookups and finishes through the hand-over,
    everything else to the scheduler; keeps the params each finished request returned."""

    def __init__(self, sched: Any, handover: Handover) -> None:
        self._sched, self.handover = sched, handover
        self.params: dict[str, dict | None] = {}
        self.after_lookup: Any = None  # called with the request after each positive answer (fault tests)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sched, name)

    def get_num_new_matched_tokens(self, request: Any, n_local: int) -> tuple[int | None, bool]:
        out = self.handover.lookup(request, n_local)
        if self.after_lookup is not None and out[0]:
            self.after_lookup(request)
        return out

    def request_finished(self, request: Any, block_ids: Any = None) -> bool:
        hold, self.params[request.request_id] = self.handover.finished(request, block_ids)
        return hold


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def instance(tmp_path, role: str, clock: Clock, *, sims: list, wait_s: float = 5.0, identity: str = "model:sim",
             prefix_cache: bool = True, **kw: Any) -> tuple[Sim, Facade]:
    """One instance; ``prefix_cache=False``: vLLM's own prefix cache off, so that every hit
    of a later request is kvcm's (and counted by tier)."""
    extra = {"backend": os.environ.get("KVCM_BACKEND", "cpp"), "host_bytes": 24 * SIM_PAGE,
             "shared": str(tmp_path / "shared"), "shared_namespace": "sim-model@1", **kw}
    sim = rig(extra, num_blocks=24, identity=identity, prefix_cache=prefix_cache)
    sims.append(sim)
    settings = ConnectorSettings.parse(extra)
    r = Role(role, settings.save_decode_cache)
    for w in sim.workers:  # as the connector sets them
        w.shared_writes = r.writes_shared
        w.flush_saves = r.flushes_saves
    facade = Facade(sim.sched, Handover(sim.sched, r, wait_s, clock=clock, poll_s=0.0))
    sim.sched = facade
    return sim, facade


def objects(tmp_path) -> int:
    d = tmp_path / "shared"
    return sum(1 for n in os.listdir(d) if n.endswith(OBJECT_SUFFIX)) if d.exists() else 0


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def counters(f: Facade) -> dict[str, int]:
    return dict(f._sched.counters)


def prefill(sim: Sim, facade: Facade, rid: str, tokens: list[int]) -> dict:
    """The proxy's first leg: max_tokens=1 with do_remote_decode; runs the producer until it
    is idle (no further request) and returns the params it answered."""
    sim.add(rid, tokens, 1, kv_transfer_params={"do_remote_decode": True})
    sim.run()
    return facade.params[rid]


def test_producer_writes_every_prompt_block_without_further_requests(tmp_path, sims) -> None:
    clock = Clock()
    p, pf = instance(tmp_path, "kv_producer", clock, sims=sims)
    tokens = prompt(5 * B + 7, 1)
    params = prefill(p, pf, "r1", tokens)
    # the engine stepped on its own (has_pending_push_work) until the store writes were done
    assert objects(tmp_path) == 5
    assert params["do_remote_prefill"] is True
    h = params[PARAMS_KEY]
    assert h["tokens"] == 5 * B and h["digest"] == tokens_digest(tokens[:5 * B])
    assert counters(pf)["handover_announced"] == 1
    assert not p.sched.busy() and not p.violations
    # a request without do_remote_decode gets no params (a plain request on a producer)
    p.add("plain", prompt(3 * B + 1, 2), 1)
    p.run()
    assert pf.params["plain"] is None and objects(tmp_path) == 8


def test_producer_writes_a_finished_prompt_at_the_next_step(tmp_path, sims) -> None:
    """A prefill's saves are reported with its own step (the producer's worker waits for
    them, bounded), so its store writes go out at the very next step — not after a further
    forward (another request keeps the engine busy: every step runs one)."""
    clock = Clock()
    p, pf = instance(tmp_path, "kv_producer", clock, sims=sims)
    p.add("busy", prompt(B + 3, 5), 40)  # decodes throughout
    p.step()
    p.add("r1", prompt(5 * B + 7, 6), 1, kv_transfer_params={"do_remote_decode": True})
    p.step()  # r1's prefill (and its saves); it finishes with this step's output
    assert "r1" in pf.params and pf.params["r1"][PARAMS_KEY]["tokens"] == 5 * B
    p.step()  # the next step hands the store writes to the worker
    deadline = time.monotonic() + 10
    while objects(tmp_path) < 6 and time.monotonic() < deadline:  # the copy thread writes them
        time.sleep(0.01)
    assert objects(tmp_path) == 6  # r1's 5 full blocks and the first of "busy"
    assert p.requests  # "busy" still decoding: the writes did not wait for the engine to go idle
    p.run()
    assert not p.violations


def test_consumer_loads_what_the_producer_announced_exactly(tmp_path, sims) -> None:
    clock = Clock()
    p, pf = instance(tmp_path, "kv_producer", clock, sims=sims)
    c, cf = instance(tmp_path, "kv_consumer", clock, sims=sims)
    tokens = prompt(5 * B + 7, 3)
    params = prefill(p, pf, "r1", tokens)
    c.add("d1", tokens, 6, kv_transfer_params=params)
    c.run()
    k = counters(cf)
    assert k["handover_accepted"] == 1 and k.get("handover_rejected", 0) == 0
    assert k["hit_blocks_shared"] == 5 and k["loaded_blocks"] == 5
    assert not c.violations and len(c.finished["d1"]) == 6
    assert cf.handover.pending() == 0  # nothing kept per request once it finished
    # the consumer wrote nothing to the shared tier (its decode blocks stay in its host tier)
    assert objects(tmp_path) == 5


def test_consumer_waits_for_announced_objects_with_one_query_per_step(tmp_path, sims) -> None:
    """Params arrive before the producer wrote (the proxy races it): the consumer answers
    "ask again later" while the objects are missing, one existence query per step for all
    waiting requests together, and loads once they are written."""
    clock = Clock()
    p, pf = instance(tmp_path, "kv_producer", clock, sims=sims)
    c, cf = instance(tmp_path, "kv_consumer", clock, sims=sims)
    convs = [prompt(4 * B + 3, 10 + i) for i in range(6)]
    # the params the producer will answer (computed as it does) handed to the consumer first
    early = [{"do_remote_prefill": True, PARAMS_KEY: {"v": 1, "ns": cf.handover.ns_digest, "tokens": 4 * B,
                                                     "digest": tokens_digest(t[:4 * B])}} for t in convs]
    for i, t in enumerate(convs):
        c.add(f"d{i}", t, 3, kv_transfer_params=early[i])
    steps = 12
    for _ in range(steps):
        c.step()
    assert c.counters["ask_later"] == 6 * steps
    assert all(r.status == "WAITING" and r.num_computed_tokens == 0 for r in c.requests.values())
    # one query per step for all six (plus one as each arrived), not one per request per step
    assert cf.handover.queries <= steps + 6
    for i, t in enumerate(convs):
        assert prefill(p, pf, f"p{i}", t)[PARAMS_KEY] == early[i][PARAMS_KEY]
    c.run()
    k = counters(cf)
    assert k["hit_blocks_shared"] == 6 * 4 and k.get("handover_deadlines", 0) == 0
    assert not c.violations and all(len(c.finished[f"d{i}"]) == 3 for i in range(6))


def test_slow_producer_past_the_deadline_is_computed(tmp_path, sims) -> None:
    clock = Clock()
    p, pf = instance(tmp_path, "kv_producer", clock, sims=sims)
    c, cf = instance(tmp_path, "kv_consumer", clock, sims=sims, wait_s=2.0, prefix_cache=False)
    tokens = prompt(4 * B + 5, 20)
    params = {"do_remote_prefill": True, PARAMS_KEY: {"v": 1, "ns": cf.handover.ns_digest, "tokens": 4 * B,
                                                     "digest": tokens_digest(tokens[:4 * B])}}
    c.add("d", tokens, 4, kv_transfer_params=params)
    for _ in range(5):
        c.step()
    assert "d" not in c.finished
    clock.t = 2.5  # past the deadline: what arrived is loaded (nothing), the rest computed
    c.run()
    k = counters(cf)
    assert k["handover_deadlines"] == 1 and k.get("loaded_blocks", 0) == 0
    assert len(c.finished["d"]) == 4 and not c.violations
    # the producer's late write changes nothing for the finished request; the next request of
    # the prompt waits for nothing (its blocks are in the consumer's own host tier now)
    prefill(p, pf, "p", tokens)
    c.add("d2", tokens, 2, kv_transfer_params=params)
    c.run()
    k = counters(cf)
    assert k["loaded_blocks"] == 4 and k["hit_blocks_host"] == 4 and k["handover_deadlines"] == 1
    assert not c.violations


def test_part_of_the_objects_arrives_before_the_deadline(tmp_path, sims) -> None:
    """The producer died after writing some blocks (its later writes never happen): the
    consumer loads the blocks that are there and computes the rest."""
    clock = Clock()
    p, pf = instance(tmp_path, "kv_producer", clock, sims=sims)
    c, cf = instance(tmp_path, "kv_consumer", clock, sims=sims, wait_s=1.0)
    tokens = prompt(6 * B + 2, 30)
    prefill(p, pf, "p", tokens[:3 * B + 1])  # only the first 3 blocks were written
    params = {"do_remote_prefill": True, PARAMS_KEY: {"v": 1, "ns": cf.handover.ns_digest, "tokens": 6 * B,
                                                     "digest": tokens_digest(tokens[:6 * B])}}
    c.add("d", tokens, 3, kv_transfer_params=params)
    c.step()
    clock.t = 1.5
    c.run()
    k = counters(cf)
    assert k["handover_deadlines"] == 1 and k["handover_blocks_missing"] == 3 and k["hit_blocks_shared"] == 3
    assert not c.violations and len(c.finished["d"]) == 3


@pytest.mark.parametrize("forge", ["other-model", "other-prompt", "malformed", "partial-block", "version",
                                   "too-long", "not-a-dict"])
def test_forged_or_stale_params_are_rejected_and_nothing_is_loaded(tmp_path, sims, forge) -> None:
    clock = Clock()
    p, pf = instance(tmp_path, "kv_producer", clock, sims=sims)
    c, cf = instance(tmp_path, "kv_consumer", clock, sims=sims, prefix_cache=False)
    tokens = prompt(5 * B + 7, 40)
    good = prefill(p, pf, "p", tokens)[PARAMS_KEY]  # the objects are in the store
    bad: Any = dict(good)
    if forge == "other-model":
        bad["ns"] = "0" * len(good["ns"])
    elif forge == "other-prompt":
        bad["digest"] = tokens_digest(prompt(5 * B, 41))
    elif forge == "malformed":
        bad["tokens"] = "80"
    elif forge == "partial-block":
        bad["tokens"] = good["tokens"] - 1
    elif forge == "version":
        bad["v"] = 2
    elif forge == "too-long":
        bad["tokens"] = 64 * B
    else:
        bad = ["not", "a", "dict"]
    c.add("d", tokens, 3, kv_transfer_params={"do_remote_prefill": True, PARAMS_KEY: bad})
    c.run()
    k = counters(cf)
    assert k["handover_rejected"] == 1 and k.get("loaded_blocks", 0) == 0 and k.get("handover_accepted", 0) == 0
    assert not c.violations and len(c.finished["d"]) == 3 and cf.handover.pending() == 0
    # the genuine params for the same prompt load (the store held the objects all along)
    c.add("d2", tokens, 3, kv_transfer_params={"do_remote_prefill": True, PARAMS_KEY: good})
    c.run()
    assert counters(cf)["hit_blocks_shared"] == 5 and not c.violations


def test_another_models_consumer_rejects_the_params(tmp_path, sims) -> None:
    """Same shapes, other weights (another identity): the namespace differs, nothing loads."""
    clock = Clock()
    p, pf = instance(tmp_path, "kv_producer", clock, sims=sims)
    c, cf = instance(tmp_path, "kv_consumer", clock, sims=sims, identity="model:other")
    tokens = prompt(4 * B + 7, 50)
    params = prefill(p, pf, "p", tokens)
    c.add("d", tokens, 2, kv_transfer_params=params)
    c.run()
    assert counters(cf)["handover_rejected"] == 1 and counters(cf).get("loaded_blocks", 0) == 0
    assert not c.violations


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_object_damaged_between_write_and_read_is_recomputed(tmp_path, sims, damage) -> None:
    clock = Clock()
    p, pf = instance(tmp_path, "kv_producer", clock, sims=sims)
    c, cf = instance(tmp_path, "kv_consumer", clock, sims=sims, wait_s=1.0)
    tokens = prompt(5 * B + 7, 60)
    params = prefill(p, pf, "p", tokens)
    names = sorted(n for n in os.listdir(tmp_path / "shared") if n.endswith(OBJECT_SUFFIX))
    assert len(names) == 5

    def damage_now(request: Any) -> None:  # the consumer saw every object; its load is not yet read
        cf.after_lookup = None
        for n in names[:2]:
            path = tmp_path / "shared" / n
            if damage == "corrupt":
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
            else:
                os.remove(path)

    cf.after_lookup = damage_now
    c.add("d", tokens, 3, kv_transfer_params=params)
    c.run()
    k = counters(cf)
    # the load saw the damage (integrity check / missing object): those blocks are recomputed,
    # never read as K/V
    assert cf.after_lookup is None and k["loaded_blocks"] < 5 and k["load_error_blocks"] + k["failed_ops"] > 0, k
    assert not c.violations and len(c.finished["d"]) == 3


@pytest.mark.parametrize("save_decode_cache", [False, True])
def test_consumer_writes_the_shared_tier_only_with_save_decode_cache(tmp_path, sims, save_decode_cache) -> None:
    clock = Clock()
    c, cf = instance(tmp_path, "kv_consumer", clock, sims=sims, save_decode_cache=save_decode_cache,
                     prefix_cache=False)
    c.add("d", prompt(4 * B + 2, 70), 2 * B)
    c.run()
    assert (objects(tmp_path) > 0) == save_decode_cache
    skipped = cf._sched.worker_counters["shared_stores_skipped"]
    assert (skipped == 0) == save_decode_cache and (save_decode_cache or skipped >= 4)
    # its own host tier keeps the request's blocks either way: a second request hits them
    c.add("d2", prompt(4 * B + 2, 70) + [1] * 3, 1)
    c.run()
    assert counters(cf)["hit_blocks_host"] >= 4 and not c.violations


def test_roles_and_settings() -> None:
    assert Role("kv_producer").produces and not Role("kv_producer").consumes
    assert Role("kv_consumer").consumes and not Role("kv_consumer").writes_shared
    assert Role("kv_consumer", save_decode_cache=True).writes_shared and Role("kv_both").writes_shared
    assert Role.of({"kv_role": "kv_consumer"}).name == "kv_consumer" and Role.of({}).name == "kv_both"
    with pytest.raises(ValueError, match="kv_role"):
        Role("kv_decoder")
    with pytest.raises(ValueError, match="save_decode_cache"):
        ConnectorSettings.parse({"save_decode_cache": "yes"})
    with pytest.raises(ValueError, match="handover_wait_s"):
        ConnectorSettings.parse({"handover_wait_s": -1})
    assert ConnectorSettings.parse({"handover_wait_s": 3}).handover_wait_s == 3.0


def test_a_request_asked_again_does_not_wait_again(tmp_path, sims) -> None:
    """vLLM asks a request again after its load failed (a hybrid model's failed_recving): a
    hand-over already decided is not waited for a second time, and a rejected one still loads
    nothing; the decision is forgotten when the request finishes."""
    from vllm_sim import Req

    clock = Clock()
    _c, cf = instance(tmp_path, "kv_consumer", clock, sims=sims, wait_s=1.0)
    h = cf.handover
    tokens = prompt(4 * B + 3, 80)
    good = {"v": 1, "ns": h.ns_digest, "tokens": 4 * B, "digest": tokens_digest(tokens[:4 * B])}
    r = Req("x", tokens, 2, kv_transfer_params={"do_remote_prefill": True, PARAMS_KEY: good})
    assert h.lookup(r, 0) == (None, False)  # nothing written yet
    clock.t = 1.5
    assert h.lookup(r, 0) == (0, False)  # the deadline: computed
    assert h.lookup(r, 0) == (0, False) and h.pending() == 1  # asked again: no second wait
    assert counters(cf)["handover_deadlines"] == 1
    h.finished(r)
    assert h.pending() == 0
    bad = Req("y", tokens, 2, kv_transfer_params={"do_remote_prefill": True, PARAMS_KEY: {**good, "v": 9}})
    assert h.lookup(bad, 0) == (0, False) and h.lookup(bad, 0) == (0, False)
    assert counters(cf)["handover_rejected"] == 1 and h.queries == 1  # one query: the first arrival
    h.finished(bad)
    assert h.pending() == 0


def test_bench_disagg_bad_usage_is_one_line_exit_2() -> None:
    """``python -m kvcm bench disagg`` (the real run is the vllm leg's; its numbers are in
    DECISIONS.md): an option out of range is refused before any server starts."""
    import subprocess
    import sys

    from children import child_env

    p = subprocess.run([sys.executable, "-m", "kvcm", "bench", "disagg", "--turns", "0"], env=child_env(),
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2 and "--turns" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_waiting_hand_overs_pace_an_engine_with_nothing_to_run(tmp_path, sims) -> None:
    """vLLM steps an engine with waiting requests as fast as it can; while hand-overs wait and
    the last step ran no forward, the first waiting lookup of a step sleeps until the next
    poll is due (one sleep per step, whatever the number of waiting requests), never past the
    deadline; a step after a forward is never slowed."""
    from vllm_sim import Req

    clock = Clock()
    slept: list[float] = []
    _c, cf = instance(tmp_path, "kv_consumer", clock, sims=sims, wait_s=1.0)
    h = Handover(cf._sched, Role("kv_consumer"), 1.0, clock=clock, poll_s=0.02, sleep=slept.append)
    reqs = []
    for i in range(3):
        tokens = prompt(4 * B + 3, 90 + i)
        params = {"v": 1, "ns": h.ns_digest, "tokens": 4 * B, "digest": tokens_digest(tokens[:4 * B])}
        reqs.append(Req(f"w{i}", tokens, 2, kv_transfer_params={"do_remote_decode": False, PARAMS_KEY: params}))
    sched = cf._sched
    sched.last_forward = True
    assert all(h.lookup(r, 0) == (None, False) for r in reqs) and slept == []  # after a forward: no pause
    sched.last_forward = False
    for step in range(1, 4):
        sched.step += 1
        clock.t += 0.005
        assert all(h.lookup(r, 0) == (None, False) for r in reqs)
        assert len(slept) == step  # one pause per step for all three
    assert all(0 < s <= 0.02 for s in slept)
    clock.t = 0.995  # the deadline is 1.0: a pause never runs past it
    sched.step += 1
    h.lookup(reqs[0], 0)
    assert slept[-1] <= 0.005 + 1e-9
