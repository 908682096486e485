"""Below the whole-block floor (``partial_tail``, kvcm.integrations.vllm.partial), engine-free:
a finished request's trailing partial block is saved and committed in kvcm as a partial
block, and the next turn of its conversation is answered a hit that ends inside a block.
tests/vllm_sim.py checks every byte of KV each forward reads, so a partial block served
wrong (a wrong page, a token counted that has no KV, a commit at the wrong offset) fails
("violations").  The real engine: tests/engines/test_vllm_connector.py
(``test_partial_tail_*``)."""

from __future__ import annotations

import pytest
from kvcm.integrations.vllm import partial
from kvcm.integrations.vllm.settings import ConnectorSettings
from vllm_sim import SIM_PAGE, Chats, Sim, rig, sim_layout


def extra(tmp_path, backend: str, **kw) -> dict:
    out = {"backend": backend, "host_bytes": 24 * SIM_PAGE, "disk_path": str(tmp_path / "disk"),
           "disk_bytes": 96 * SIM_PAGE}
    out.update(kw)
    return out


def count_forwarded(sim: Sim) -> list[int]:
    """Tokens the forwards computed (rank 0), counted as the sim runs."""
    n = [0]
    forward = sim._forward

    def counted(rank, r, start, k):
        if rank == 0:
            n[0] += k
        return forward(rank, r, start, k)

    sim._forward = counted
    return n


def drained(sim: Sim) -> None:
    p = sim.sched.pending()
    assert p == dict.fromkeys(p, 0), p
    assert sim.sched.mgr.snapshot()["requests"] == []
    assert not sim.requests and not sim.violations, (list(sim.requests), sim.violations)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync-sched", "async-sched"])
@pytest.mark.parametrize("load_mode", ["auto", "async"])
def test_partial_tail_multi_turn_exact_and_below_the_floor(tmp_path, backend, sims, load_mode,
                                                           async_scheduling) -> None:
    """Each turn's prompt ends inside the block where the last turn's KV ended: kvcm answers
    that partial block (exact: no violation) and the forwards compute fewer tokens than with
    whole blocks only."""
    runs = {}
    for on in (False, True):
        sim = rig(extra(tmp_path / str(on), backend, load_mode=load_mode, partial_tail=on), num_blocks=40,
                  async_scheduling=async_scheduling)
        sims.append(sim)
        n = count_forwarded(sim)
        Chats(n=4, reply=9).run(sim, 3)
        c = sim.sched.counters
        assert not sim.violations, sim.violations
        assert c["load_error_blocks"] == 0 and c["save_failed_blocks"] == 0
        runs[on] = (n[0], dict(c))
        drained(sim)
    (off, c_off), (on, c_on) = runs[False], runs[True]
    assert c_off["partial_hits"] == 0 and c_off["partial_tail_saves"] == 0
    # 4 conversations x 2 later turns, each ending inside a block of the last turn's KV (when
    # the tail was saved: tier 0 is small, and which mirrors stop depends on the transfer
    # threads' timing)
    assert 0 < c_on["partial_hits"] <= 8 and c_on["partial_tail_saves"] >= c_on["partial_hits"] // 2, c_on
    assert c_on["partial_tail_tokens"] > 0 and c_on["partial_hit_tokens"] > 0
    assert on < off, (on, off, c_on["partial_hit_tokens"])


def test_the_checker_catches_a_tail_that_claims_an_unwritten_token(tmp_path, backend, sims, monkeypatch) -> None:
    """The sampled last token has no KV: a tail that claims it is served as garbage and the
    sim sees the wrong read (the exactness check above has teeth on the partial path)."""
    real = partial.tail_tokens
    monkeypatch.setattr(partial, "tail_tokens", lambda request: real(request) + 1)
    sim = rig(extra(tmp_path, backend, partial_tail=True), num_blocks=40)
    sims.append(sim)
    Chats(n=2, reply=9).run(sim, 2)
    assert sim.sched.counters["partial_hits"] > 0
    assert sim.violations


def test_partial_tail_setting(tmp_path) -> None:
    assert ConnectorSettings.parse({}).partial_tail is False
    with pytest.raises(ValueError, match="partial_tail"):
        ConnectorSettings.parse({"partial_tail": 1})
    s = ConnectorSettings.parse({"partial_tail": True})
    assert s.manager_config(sim_layout(), 0, 1).enable_partial_reuse
    assert not ConnectorSettings.parse({}).manager_config(sim_layout(), 0, 1).enable_partial_reuse
    shared = ConnectorSettings.parse({"partial_tail": True, "shared": str(tmp_path / "s"), "shared_namespace": "x"})
    assert not shared.manager_config(sim_layout(), 0, 1, identity_tag="m").enable_partial_reuse
    assert not partial.enabled(True, sim_layout(), "dir") and partial.enabled(True, sim_layout(), None)


def test_answer_and_sources() -> None:
    assert partial.answer(87, 80, 16, True) == 7 and partial.answer(87, 80, 16, False) == 0
    assert partial.answer(87, 48, 16, False) == 32 and partial.answer(40, 48, 16, True) == 0
    assert partial.sources(32, 23, 16, [0, 0, 2, 0], 0) == {2: 16, 0: 7}


def test_partial_floor_counts_hits_that_end_inside_a_block() -> None:
    from kvcm.bench.vllm_workload import PrefillFloor

    f = PrefillFloor(4)
    a = list(range(1, 12))  # 11 tokens: 2 whole blocks and 3 tokens
    f.submit(a)
    assert f.tokens == f.partial_tokens == 11
    f.finish(a, [50, 51, 52])  # computed: a + [50, 51] = 13 tokens: 3 whole blocks and 1 token
    f.submit(a + [50, 51, 60, 61, 62])  # 16 tokens: 3 whole blocks, then [51] of block 3 seen
    assert f.tokens == 11 + 4 and f.partial_tokens == 11 + 3
    f.submit(list(range(1, 7)) + [70, 71])  # block 1 diverges after 2 tokens: [5, 6] reused inside it
    assert f.tokens == 15 + 4 and f.partial_tokens == 14 + 2
    f.submit(list(range(1, 12)))  # a seen prompt again: its last token is computed in any case
    assert f.tokens == 19 + 3 and f.partial_tokens == 16 + 1


def test_bench_partial_config_is_host_disk_with_partial_tail(tmp_path) -> None:
    from types import SimpleNamespace

    from kvcm.bench import vllm_plan as bench_plan

    plan = SimpleNamespace(store_blocks=8, sizes={"host_blocks": 8}, load_mode=None, disk_blocks=16)
    part = bench_plan._connector(str(tmp_path), "host+disk+partial", plan)["kv_connector_extra_config"]
    disk = bench_plan._connector(str(tmp_path), "host+disk", plan)["kv_connector_extra_config"]
    assert ConnectorSettings.parse(part).partial_tail and not ConnectorSettings.parse(disk).partial_tail
    assert {k: v for k, v in part.items() if k != "partial_tail"}.keys() == disk.keys()
    assert part["disk_path"] != disk["disk_path"] and part["stats_file"] != disk["stats_file"]


@pytest.mark.parametrize("on", [False, True], ids=["whole", "partial"])
def test_tier0_too_small_for_the_live_requests_fails_loads_exactly(tmp_path, backend, sims, on) -> None:
    """kvcm's tier 0 (12 pages) cannot hold the live requests' matched pages: admissions fail
    (the mirror stops, its promised blocks fail to load and vLLM recomputes them), with or
    without partial tails, and every forward still reads exact KV.  (With ``partial_tail``
    the extra copy-on-write and tail pages make such failures more frequent here: more tokens
    are recomputed than with whole blocks; DECISIONS.md "Below the whole-block floor".)"""
    sim = rig(extra(tmp_path, backend, host_bytes=12 * SIM_PAGE, partial_tail=on), num_blocks=20, max_num_seqs=5)
    sims.append(sim)
    Chats(n=6, system=50, user=30, reply=8).run(sim, 3)
    c = sim.sched.counters
    assert c["mirror_stops"] > 0 and not sim.violations, (dict(c), sim.violations)
    drained(sim)
