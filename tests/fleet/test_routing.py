"""KV-aware routing (kvcm.tools.routing) and the ``route`` / ``events`` commands."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import kvcm
import pytest
from kvcm.cli import main
from kvcm.fleet.publisher import EventPublisher
from kvcm.tools.events import watch
from kvcm.tools.routing import POLICIES, route_trace
from kvcm.tools.trace import TraceRequest, load_trace
from test_wire import hybrid, run


def grouped_trace(groups: int = 4, rounds: int = 6) -> list[TraceRequest]:
    """``groups`` conversations, interleaved in a rotating order: request ``r`` of group
    ``g`` shares its first two 512-token hash blocks with every other request of the group."""
    out = []
    for r in range(rounds):
        for k in range(groups):
            g = (k + r) % groups
            ids = (1000 + g, 2000 + g, 3000 + 100 * g + r)
            out.append(TraceRequest(len(out), 0.0, 3 * 512, 0, ids))
    return out


@pytest.fixture(scope="module")
def trace40() -> list[TraceRequest]:
    return load_trace(limit=40)


@pytest.mark.parametrize("policy", POLICIES)
def test_router_predicts_every_instance_reuse_and_counts_add_up(policy: str, trace40: list[TraceRequest]) -> None:
    trace = trace40
    r = route_trace(trace, 3, policy, tokens_per_block=64)
    assert r.requests == 40 and r.mispredicted == 0 and r.failed == 0
    assert sum(r.per_instance_requests) == 40
    assert sum(r.per_instance_tokens) == r.prompt_tokens == sum(t.input_length for t in trace)
    assert r.wire_bytes > 0


def test_policies_are_deterministic() -> None:
    trace = grouped_trace()
    for policy in POLICIES:
        a, b = (route_trace(trace, 3, policy, seed=5) for _ in range(2))
        assert (a.per_instance_requests, a.reused_tokens) == (b.per_instance_requests, b.reused_tokens)
    assert route_trace(trace, 3, "round-robin").per_instance_requests == [8, 8, 8]


def test_kv_policy_keeps_conversations_together_and_reuses_more() -> None:
    trace = grouped_trace()
    kv = route_trace(trace, 4, "kv")
    rr = route_trace(trace, 4, "round-robin")
    # kv: after a group's first request, every later one reuses its two shared hash blocks
    assert kv.reused_tokens == 4 * 5 * 2 * 512
    assert kv.hit_rate > rr.hit_rate
    assert kv.request_imbalance == pytest.approx(1.0)  # four groups on four instances
    assert kv.mispredicted == rr.mispredicted == 0


def test_kv_policy_weighs_load_against_reuse() -> None:
    # one conversation only: pure reuse would pile everything on one instance; with the
    # load term the queue of that instance eventually outweighs the reuse
    trace = [TraceRequest(i, 0.0, 2 * 512, 0, (7, 8 + i)) for i in range(12)]
    r = route_trace(trace, 3, "kv", window=12)
    assert max(r.per_instance_requests) < 12
    greedy = route_trace(trace, 3, "kv", window=12, weight=0.0)
    assert greedy.per_instance_requests.count(0) == 2 and greedy.hit_rate >= r.hit_rate


def test_route_command_prints_the_table_and_writes_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    png = tmp_path / "route.png"
    rc = main(["route", "--instances", "2,3", "--policy", "kv,round-robin", "--limit", "25", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [ln for ln in out.splitlines() if ln.startswith(("kv ", "round-robin "))]
    assert len(lines) == 4 and all(ln.split()[-2] == "yes" for ln in lines)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_events_command_watches_a_publisher(capsys: pytest.CaptureFixture) -> None:
    mgr = kvcm.KVCacheManager(hybrid())
    with EventPublisher(mgr) as pub:
        ready = threading.Event()
        t = threading.Thread(target=watch, args=(pub.endpoint, pub.replay_endpoint, "kvcm", 3, 5.0, True),
                             kwargs={"ready": ready}, daemon=True)
        t.start()
        assert ready.wait(5)
        deadline = time.monotonic() + 10
        i = 0
        while t.is_alive() and time.monotonic() < deadline:  # until 2 live batches were seen
            run(mgr, [500 + i] * 8)
            pub.publish(mgr.take_events())
            i += 1
            time.sleep(0.02)
        t.join(5)
        assert not t.is_alive()
    out = capsys.readouterr().out
    assert "(snapshot)" in out and "stored   group=2 mamba" in out and "sliding_window(9)" in out


def test_events_bench_measures_publish_cost_with_a_subscriber() -> None:
    from kvcm.bench.events import bench

    r = bench(limit=15, backend=None, block_size=32)
    assert r["steps"] == 15 and r["events"] > 0
    assert 0 < r["received"] <= r["batches"]  # a subscriber was attached and received
    assert 0 < r["publish_us_median"] and 0 < r["thread_us_per_event"]
