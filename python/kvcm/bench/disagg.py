"""``python -m kvcm bench disagg``: disaggregated prefill and decode through kvcm, measured
against one vLLM alone, on one multi-turn workload, with real vLLM OpenAI servers.

Configurations (``--configs``; each its own servers, started and stopped here, all on
127.0.0.1):

* ``vllm``            one vLLM OpenAI server, no connector: the reference outputs;
* ``round-robin``     two vLLM servers, no connector, behind ``python -m kvcm proxy`` as a
                      plain round-robin balancer (``--balance round-robin``, no prefill
                      leg): each request whole on one of them;
* ``kvcm``            a prefill server (``kv_role`` ``kv_producer``) and a decode server
                      (``kv_consumer``) with kvcm's connector on one store (``--store``: a
                      directory, or a real Mooncake Store started here), and
                      ``python -m kvcm proxy`` in front (vLLM's disaggregated flow);
* ``mooncake-store``  the same flow with vLLM's own ``MooncakeStoreConnector`` in both roles
                      (a ``mooncake_master`` started here on 127.0.0.1, each engine's segment
                      embedded, P2P handshake over TCP), the same proxy in front: it answers
                      no hand-over params, so the decode instance finds the prompt's blocks by
                      its own store lookup.

Workload: ``--conversations`` chats x ``--turns`` turns (a shared system prompt, each turn a
new user message; the prompt is the whole history, the greedy reply is appended), one turn's
requests sent together, streamed.  Token ids, a random-weight model (``make_model``) unless
``--model`` names one (its tokenizer must accept token-id prompts: any does).

Reported per configuration: prompt tokens; prompt tokens computed on each side (vLLM's
``vllm:prompt_tokens_by_source{source="local_compute"}``; a configuration without a split
has one side, its instances summed) and loaded by the decode side (``external_kv_transfer``);
TTFT and inter-token latency p50 / p90 at the client; bytes written to the store and read
from it by the decode side (kvcm: the manager's ``shared_store_bytes`` in the producer's
stats file and the consumer's shared hits x the object size, read once the servers stopped;
``MooncakeStoreConnector``: vLLM's ``vllm:mooncake_store_operation_bytes_total`` of
``save_put`` and ``load_get``); whether the greedy outputs equal vLLM alone's (the
``vllm`` configuration's, always run first).  Exit 1 if any output differs or a server
failed, 2 on bad usage.

On a few shared CPU cores the timings cannot show what a GPU fleet gains from splitting
prefill and decode (two engines share the cores one engine had); the token counts, bytes and
exactness can, and the output says which is which.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

BLOCK = 32
KV_BYTES = 256 << 20
START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONFIGS = ("vllm", "round-robin", "kvcm", "mooncake-store")
STORE_SEGMENT = 1 << 30  # each MooncakeStoreConnector engine's segment / kvcm's Mooncake client's memory


def kv_config(role: str, store: str, **extra: Any) -> str:
    """kvcm in ``role`` on ``store``: a directory capped at 8 GiB, or a Mooncake Store whose
    objects live in the store's own client (the engines mount no segment: ``shared_bytes``
    0, the default)."""
    cap = {} if store.startswith("mooncake://") else {"shared_bytes": 8 << 30}
    return json.dumps({"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
                       "kv_role": role, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"host_bytes": KV_BYTES, "shared": store, **cap, **extra}})


def mooncake_store_config(role: str) -> str:
    """vLLM's own ``MooncakeStoreConnector`` in ``role`` (its store: ``MOONCAKE_CONFIG_PATH``)."""
    return json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_role": role,
                       "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {}})


def mooncake_env_file(tmp: str, name: str, master: str) -> str:
    """A ``MOONCAKE_CONFIG_PATH`` file (0600) for one ``MooncakeStoreConnector`` engine: the
    master on 127.0.0.1, TCP, embedded mode with its own segment, the P2P handshake."""
    path = os.path.join(tmp, f"{name}.mooncake.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"metadata_server": "P2PHANDSHAKE", "master_server_address": master, "protocol": "tcp",
                   "device_name": "", "mode": "embedded", "global_segment_size": STORE_SEGMENT,
                   "local_buffer_size": 256 << 20}, f)
    return path


class Server:
    """One vLLM OpenAI server (or the proxy) as a child process in its own session."""

    def __init__(self, argv: list[str], log: str, env: dict[str, str], url: str) -> None:
        self.url, self.log = url, log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self, path: str = "/health") -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited ({self.proc.returncode}); its log: {self.log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url} did not start in {START_TIMEOUT_S} s; its log: {self.log}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def engine_env(env: dict[str, str], slot: int) -> dict[str, str]:
    """The environment of the ``slot``-th engine of a pair on this host: its forward on a core
    of its own (``VLLM_CPU_OMP_THREADS_BIND``, the ``slot``-th core this process may use, round
    the list) and kvcm's transfer thread kept on it (``KVCM_TRANSFER_AFFINITY=off``; its default
    moves it to the cores vLLM did not bind, here the other engine's).  vLLM's CPU worker spins
    (``sched_yield``) for a second after each step; two engines bound to one core (what
    ``auto`` binding gives each of them) starved each other here for as long as one spun — a
    decode instance waiting for a hand-over steps every few milliseconds, and the prefill
    instance's forward, holding the GIL its store writes need, got no time until that wait
    ended (DECISIONS.md "Disaggregated prefill and decode")."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return dict(env)
    return dict(env, VLLM_CPU_OMP_THREADS_BIND=str(cores[slot % len(cores)]), KVCM_TRANSFER_AFFINITY="off")


def vllm_server(model: str, port: int, log: str, env: dict[str, str], kv: str | None = None) -> Server:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--block-size", str(BLOCK), "--enforce-eager", "--kv-cache-memory-bytes",
            str(KV_BYTES)]
    if kv is not None:
        argv += ["--kv-transfer-config", kv]
    return Server(argv, log, env, f"http://127.0.0.1:{port}")


def metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}(?:_total)?(\{{.*\}})? ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def sources(url: str) -> tuple[float, float]:
    return (metric(url, "vllm:prompt_tokens_by_source", source="local_compute"),
            metric(url, "vllm:prompt_tokens_by_source", source="external_kv_transfer"))


def stream(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: its token ids, TTFT and the gaps between its chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            for c in chunk.get("choices", []):
                ids = c.get("token_ids") or []
                if ids:
                    times.append(time.perf_counter() - t0)
                    tokens += ids
    return {"tokens": tokens, "ttft": times[0] if times else float("nan"),
            "itl": [b - a for a, b in itertools.pairwise(times)]}


def _one(results: list[Any], i: int, url: str, model: str, prompt: list[int], max_tokens: int) -> None:
    try:
        results[i] = stream(url, model, prompt, max_tokens)
    except Exception as e:  # noqa: BLE001 - reported by run_workload: the run fails
        results[i] = e


def run_workload(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    system = [rng.randrange(3, 500) for _ in range(args.system_len)]
    chats = [list(system) for _ in range(args.conversations)]
    outputs, ttft, itl, prompt_tokens = [], [], [], 0
    for _ in range(args.turns):
        for c in chats:
            c += [rng.randrange(3, 500) for _ in range(args.user_len)]
        results: list[Any] = [None] * len(chats)
        threads = [threading.Thread(target=_one, args=(results, i, url, model, list(chats[i]), args.max_tokens))
                   for i in range(len(chats))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [str(r) for r in results if not isinstance(r, dict)]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
        for i, r in enumerate(results):
            prompt_tokens += len(chats[i])
            outputs.append(r["tokens"])
            ttft.append(r["ttft"])
            itl += r["itl"]
            chats[i] += r["tokens"]
    return {"outputs": outputs, "ttft": ttft, "itl": itl, "prompt_tokens": prompt_tokens}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def build_parser() -> argparse.ArgumentParser:
    from kvcm.tools.cmdline import int_in, names_in

    p = argparse.ArgumentParser(prog="python -m kvcm bench disagg", description=__doc__.split("\n\n")[0],
                                epilog="exit status: 0 every output equal vLLM alone's; 1 an output differs or "
                                       "a server failed; 2 bad usage")
    p.add_argument("--model", default=None, help="a model directory (default: a random-weight one, made here)")
    p.add_argument("--configs", type=names_in(CONFIGS, "configuration"), default=list(CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIGS)} (default: all; vllm, the reference, always runs)")
    p.add_argument("--store", choices=("dir", "mooncake"), default="dir",
                   help="kvcm's shared store: a directory (default) or a real Mooncake Store started here")
    p.add_argument("--conversations", type=int_in(1, 64), default=4)
    p.add_argument("--turns", type=int_in(1, 32), default=3)
    p.add_argument("--system-len", type=int_in(0, 4096), default=160)
    p.add_argument("--user-len", type=int_in(1, 4096), default=48)
    p.add_argument("--max-tokens", type=int_in(1, 1024), default=16)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--reserved-cpus", type=int_in(0, 64), default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep", default=None, help="a directory for the logs and the store (default: a temporary one)")
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    tmp = args.keep or tempfile.mkdtemp(prefix="kvcm-bench-disagg-")
    try:
        return _run(args, tmp)
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


def proxy_server(tmp: str, name: str, env: dict[str, str], prefill: list[Server], decode: list[Server],
                 balance: str = "load") -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "kvcm", "proxy", "--decode", ",".join(s.url for s in decode), "--port", str(port),
            "--balance", balance, "--log-level", "warning"]
    if prefill:
        argv += ["--prefill", ",".join(s.url for s in prefill)]
    return Server(argv, os.path.join(tmp, f"{name}.proxy.log"), env, f"http://127.0.0.1:{port}")


def kvcm_store_bytes(tmp: str) -> tuple[int, int]:
    """(bytes kvcm's producer wrote to the store, bytes its consumer read from it), from
    their stats files (``stats_file``, complete once the servers stopped): the managers'
    ``shared_store_bytes`` and shared hits x the object size."""
    def manager(side: str) -> dict[str, Any]:
        try:
            with open(os.path.join(tmp, f"{side}.stats.json")) as f:
                return json.load(f).get("manager") or {}
        except (OSError, ValueError):
            return {}

    written = stores = hits = 0
    for lc in manager("producer").get("lc", []):
        written += lc.get("shared_store_bytes", 0)
        stores += lc.get("shared_stores", 0)
    for lc in manager("consumer").get("lc", []):
        hits += lc.get("shared_hit_blocks", 0)
    return written, hits * written // stores if stores else 0


def _measure(args: argparse.Namespace, model: str, url: str, sides: dict[str, list[Server]],
             kind: str) -> dict[str, Any]:
    """The workload through ``url``; the prompt tokens each side computed and the decode
    side loaded, the store's bytes, from the instances' metrics before and after."""
    def count() -> dict[str, float]:
        out: dict[str, float] = {}
        for side, servers in sides.items():
            per = [sources(s.url) for s in servers]  # one scrape per server: (computed, loaded)
            out[side] = sum(c for c, _ in per)
            out[side + "_loaded"] = sum(x for _, x in per)
        if kind == "mooncake-store":  # vLLM's own connector's counters
            out["written"] = metric(sides["P"][0].url, "vllm:mooncake_store_operation_bytes", operation="save_put")
            out["read"] = metric(sides["D"][0].url, "vllm:mooncake_store_operation_bytes", operation="load_get")
        return out

    c0 = count()
    r = run_workload(url, model, args)
    time.sleep(2)  # vLLM's metrics lag its responses
    c1 = count()
    d = {k: c1[k] - c0[k] for k in c1}
    r.update(computed_p=d.get("P", 0.0), computed_d=d.get("D", 0.0), loaded_d=d.get("D_loaded", 0.0),
             store_written=int(d.get("written", 0)), store_read=int(d.get("read", 0)))
    return r


def _config(args: argparse.Namespace, tmp: str, model: str, env: dict[str, str], kind: str) -> dict[str, Any]:
    """One configuration's servers started, the workload run through them, all stopped."""
    servers: list[Server] = []
    stores: list[Any] = []
    try:
        if kind == "vllm":
            s = vllm_server(model, free_port(), os.path.join(tmp, "vllm.log"), env)
            servers.append(s)
            s.wait()
            return _measure(args, model, s.url, {"P": [s]}, kind)
        if kind == "round-robin":
            pair = [vllm_server(model, free_port(), os.path.join(tmp, f"rr{i}.log"), engine_env(env, i - 1))
                    for i in (1, 2)]
            servers += pair
            for s in pair:
                s.wait()
            proxy = proxy_server(tmp, "round-robin", env, [], pair, balance="round-robin")
            servers.append(proxy)
            proxy.wait()
            return _measure(args, model, proxy.url, {"P": pair}, kind)
        if kind == "kvcm":
            if args.store == "mooncake":
                from kvcm.dataplane.mooncake_store import LocalMooncake

                mc = LocalMooncake(STORE_SEGMENT, log_dir=tmp)
                stores.append(mc)
                store = mc.url
            else:
                store = os.path.join(tmp, "store")
                shutil.rmtree(store, ignore_errors=True)
            prod = vllm_server(model, free_port(), os.path.join(tmp, "producer.log"), engine_env(env, 0),
                               kv_config("kv_producer", store, stats_file=os.path.join(tmp, "producer.stats.json")))
            servers.append(prod)
            cons = vllm_server(model, free_port(), os.path.join(tmp, "consumer.log"), engine_env(env, 1),
                               kv_config("kv_consumer", store, handover_wait_s=10,
                                         stats_file=os.path.join(tmp, "consumer.stats.json")))
            servers.append(cons)
        else:  # mooncake-store: vLLM's own connector in both roles, a master of its own
            from kvcm.dataplane.mooncake_store import LocalMooncake

            mc = LocalMooncake(segment_bytes=0, client=False, log_dir=tmp)
            stores.append(mc)
            prod = vllm_server(model, free_port(), os.path.join(tmp, "mc-producer.log"),
                               dict(engine_env(env, 0), MOONCAKE_CONFIG_PATH=mooncake_env_file(tmp, "producer", mc.master_addr)),
                               mooncake_store_config("kv_producer"))
            servers.append(prod)
            cons = vllm_server(model, free_port(), os.path.join(tmp, "mc-consumer.log"),
                               dict(engine_env(env, 1), MOONCAKE_CONFIG_PATH=mooncake_env_file(tmp, "consumer", mc.master_addr)),
                               mooncake_store_config("kv_consumer"))
            servers.append(cons)
        prod.wait()
        cons.wait()
        proxy = proxy_server(tmp, kind, env, [prod], [cons])
        servers.append(proxy)
        proxy.wait()
        r = _measure(args, model, proxy.url, {"P": [prod], "D": [cons]}, kind)
    finally:
        for s in reversed(servers):
            s.stop()
        for mc in stores:
            mc.stop()
    if kind == "kvcm":  # the stats files are complete now
        r["store_written"], r["store_read"] = kvcm_store_bytes(tmp)
    return r


def _run(args: argparse.Namespace, tmp: str) -> int:
    from kvcm.bench.vllm_workload import make_model, save_tokenizer

    os.makedirs(tmp, mode=0o700, exist_ok=True)
    model = args.model or save_tokenizer(make_model(os.path.join(tmp, "model")))
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU=str(args.reserved_cpus))
    results: dict[str, Any] = {}
    load = {"start": os.getloadavg()[0]}
    try:
        for kind in ["vllm"] + [c for c in CONFIGS[1:] if c in args.configs]:  # the reference first
            print(f"bench disagg: {kind} ...", file=sys.stderr, flush=True)
            results[kind] = _config(args, tmp, model, env, kind)
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"python -m kvcm bench disagg: {e}", file=sys.stderr)
        return 1
    load["end"] = os.getloadavg()[0]
    from kvcm.bench.vllm_report import differing, exact_cell

    ref = results["vllm"]["outputs"]
    rows = []
    for name, r in results.items():
        exact = None if name == "vllm" else r["outputs"] == ref  # vllm's outputs are ref
        r["exact"] = exact
        split = name in ("kvcm", "mooncake-store")
        rows.append([name, f"{r['prompt_tokens']:,}", f"{r['computed_p']:,.0f}",
                     f"{r['computed_d']:,.0f}" if split else "-",
                     f"{r['loaded_d']:,.0f}" if split else "-",
                     f"{1e3 * pct(r['ttft'], 0.5):.0f} / {1e3 * pct(r['ttft'], 0.9):.0f}",
                     f"{1e3 * pct(r['itl'], 0.5):.1f} / {1e3 * pct(r['itl'], 0.9):.1f}",
                     f"{r['store_written'] / 2**20:.2f}" if split else "-",
                     f"{r['store_read'] / 2**20:.2f}" if split else "-",
                     exact_cell(exact, differing(ref, r["outputs"]))])
    head = ["config", "prompt tokens", "computed: prefill side (all)", "computed: decode side", "loaded: decode side",
            "TTFT p50/p90 ms", "ITL p50/p90 ms", "store MiB written", "store MiB read", "exact vs vllm"]
    store = f"; kvcm's store: {'a Mooncake Store' if args.store == 'mooncake' else 'a directory'}"
    print(f"bench disagg: {args.conversations} chats x {args.turns} turns, system {args.system_len} + "
          f"{args.user_len} tokens a turn, {args.max_tokens} generated; block {BLOCK}{store}; "
          f"load average {load['start']:.2f} -> {load['end']:.2f}")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for side in ("producer", "consumer"):
        try:
            with open(os.path.join(tmp, f"{side}.stats.json")) as f:
                st = json.load(f)
        except (OSError, ValueError):
            continue
        c, w = st.get("counters", {}), st.get("worker", {})
        keys = ("handover_announced", "handover_accepted", "handover_rejected", "handover_deadlines",
                "handover_blocks_missing")
        print(f"kvcm {side}: " + ", ".join(f"{k} {c.get(k, 0)}" for k in keys if c.get(k) or k == "handover_deadlines")
              + f"; store writes {w.get('shared_stores', 0)}, store calls past their deadline "
              f"{w.get('shared_timeouts', 0)}, objects skipped (no write) {w.get('shared_stores_skipped', 0)}")
    print("The token counts, bytes and exactness are what the split changes; the timings are two engines sharing "
          "the few CPU cores one engine had here, and cannot show what a GPU fleet gains (each engine its own "
          "accelerator, prefill off the decode path).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load": load,
                       "results": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()},
                       "median_ttft_s": {k: statistics.median(v["ttft"]) for k, v in results.items()}}, f)
    return 0 if all(r["exact"] is not False for r in results.values()) else 1


__all__ = ["main"]
