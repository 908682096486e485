"""``python -m kvcm bench vllm``: real vLLM engines with and without kvcm, on one core layout.

Configurations (``--configs``; each one engine process, :mod:`kvcm.bench.vllm_workload`):

* ``vllm``      vLLM alone, its KV cache shrunk (``num_gpu_blocks_override``) well below the
                workload's working set: the reference outputs;
* ``limit``     vLLM alone with a KV cache that holds the whole working set (and headroom):
                what a perfect tiered cache could at best give;
* ``host``      vLLM (the shrunk cache) + kvcm, host tier only;
* ``host+disk`` vLLM + kvcm, host + disk;
* ``host+disk+partial``  the same with ``partial_tail`` (hits that end inside a block:
                kvcm.integrations.vllm.partial), against the partial floor as well;
* ``shared1``   host + disk + a file store (written on commit);
* ``shared2``   a second vLLM + kvcm process on the store ``shared1`` wrote (local tiers
                empty at start): what a fleet reuses;
* ``mooncake-store``  vLLM + its own ``MooncakeStoreConnector`` (the peer kvcm is judged
                against): a ``mooncake_master`` on 127.0.0.1 started for it, the engine's
                segment sized to hold the working set (embedded mode, TCP, P2P handshake);
* ``host-equal``  vLLM + kvcm, host tier only, as large as the store above (equal memory);
* ``example``   vLLM + its ``ExampleConnector`` (not by default).

Default: ``vllm``, ``limit``, ``mooncake-store``, ``host-equal``, ``host+disk``.

**Core layout.**  vLLM's CPU backend binds the worker's OpenMP threads to the allowed cores
minus ``reserve_cpu_num`` (``vllm/utils/ompmultiprocessing.py``): one core per local rank,
*one more whenever a kv_transfer_config is set*; ``VLLM_CPU_NUM_OF_RESERVED_CPU`` overrides
it.  On two cores vLLM alone computes on one core, while any connector's engine reserves
two, which leaves none, so vLLM binds its threads to both cores, where they contend with the
engine-core and front-end processes: every connector, even ExampleConnector, ran ~3x
slower in wall time.  So every engine here runs with the same
``VLLM_CPU_NUM_OF_RESERVED_CPU`` (``--reserved-cpus``, default 1), and the header prints
the binding each engine logged.

Workloads (``--workload``):

* ``chat``  ``--conversations`` chats x ``--turns`` turns; a shared system prompt, each turn
            a new user message and a greedy reply appended to the history, the whole
            history the prompt;
* ``long``  ``--documents`` documents of ``--doc-len`` tokens, ``--questions`` questions
            each: round q asks every document its q-th question (prompt = document +
            question, short replies), so a document comes back after all the others:
            prefill dominates.

``--batch 1`` submits one request at a time (TTFT is the request's own prefill);
``--together`` submits each turn's (round's) requests together, so one request's loads and
saves meet the others' steps (chat: 20 chats, and vLLM's cache holds the live batch —
``max_num_seqs`` chats at their longest —, not the working set).  ``--suite`` runs the three
workloads the targets name, one after another: chat one at a time, chat together, long.
Every engine first runs ``--warmup`` unrelated requests, then its prefix cache (and kvcm's
local tiers) is reset.

**A quiet machine.**  Before each engine the bench waits (up to ``--settle-s``) for the
1-minute load average to fall to 1.0, prints it before and after the engine, and marks a
run *noisy* when it was above 1.0 when the engine started (on 2 cores an engine alone
brings it to 1-2 while it runs).  ``--repeat N`` runs every configuration N times,
interleaved, and the table shows each figure's best run.

Reported per configuration: prompt tokens, prefill tokens computed (prompt tokens minus
``num_cached_tokens``), blocks kvcm loaded by tier (its ``stats_file``), TTFT p50 / p90
(vLLM's ``first_token_latency``, from arrival), decode ms per output token p50 (vLLM's
engine-core timestamps of each request's first and last token), wall seconds of the
workload, the 1-minute load average when it started and ended, and whether the greedy
outputs equal vLLM alone's; ratios against ``vllm`` and ``limit``.  A markdown table on
stdout, a JSON file, a plot.  Exit 1 if any output differs, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from kvcm.bench import vllm_report as bench_report
from kvcm.bench.vllm_plan import (
    BLOCK,
    CHAT,
    CONFIGS,
    DEFAULT_CONFIGS,
    LONG,
    MODEL,
    Plan,
    UsageError,
    engine_spec,
    make_plan,
    mooncake_config,
)

QUIET_LOAD = 1.0  # the 1-minute load average below which a run counts as quiet (2 cores)

_LAYOUT = (re.compile(r"reserve_cpu_num=(\d+)"), re.compile(r"local_rank=\d+, core ids=\[([^\]]*)\]"),
           re.compile(r"reserved_cpus=\[([^\]]*)\]"))


def core_layout(log: str) -> str:
    """The OpenMP binding an engine logged (vllm/utils/ompmultiprocessing.py), in words."""
    found = [p.findall(log) for p in _LAYOUT]
    if not all(found):
        return "not in vLLM's log"
    return f"reserve_cpu_num={found[0][-1]}, OpenMP threads on cores [{found[1][-1]}], reserved [{found[2][-1]}]"


class EngineKilled(RuntimeError):
    """An engine ended by a signal the bench did not send (a shared machine's other jobs)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


def _forget(key: str, spec: dict) -> None:
    """What an earlier engine of this configuration left in the work dir (a killed one, a
    run before in the same ``--dir``), so every engine starts clean: its stats file, disk
    tier and ExampleConnector files, and for ``shared1`` the store (``shared2`` reads it)."""
    extra = (spec["connector"] or {}).get("kv_connector_extra_config", {})
    for path in (extra.get("disk_path"), extra.get("shared_storage_path"),
                 extra.get("shared") if key == "shared1" else None):
        if path:
            shutil.rmtree(path, ignore_errors=True)
    if extra.get("stats_file") and os.path.exists(extra["stats_file"]):
        os.unlink(extra["stats_file"])


def _child(tmp: str, key: str, spec: dict, plan: Plan, timeout: float,
           env_extra: dict[str, str] | None = None) -> tuple[dict, str, float]:
    name = key.replace("+", "-")
    spec_path, out_path, log_path = (os.path.join(tmp, f"{name}.{x}") for x in ("spec.json", "out.json", "log"))
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ)
    env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    if plan.reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(plan.reserved_cpus)
    env.update(env_extra or {})
    t = time.perf_counter()
    with open(log_path, "w") as log:
        # a session of its own: a timeout ends the engine's whole process group
        p = subprocess.Popen([sys.executable, "-m", "kvcm.bench.vllm_workload", spec_path, out_path],
                             stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise RuntimeError(f"bench vllm: the {key} engine ran past --timeout {timeout:.0f} s (log: {log_path})") from None
    seconds = time.perf_counter() - t
    with open(log_path) as f:
        text = f.read()
    if rc < 0:
        raise EngineKilled(-rc, f"bench vllm: the {key} engine was killed by signal {-rc}; log {log_path}")
    if rc != 0:
        raise RuntimeError(f"bench vllm: the {key} engine failed ({rc}); log {log_path}:\n{text[-6000:]}")
    with open(out_path) as f:
        return json.load(f), core_layout(text), seconds


def settle(limit_s: float) -> float:
    """Wait up to ``limit_s`` for the 1-minute load average to fall to :data:`QUIET_LOAD`
    (the engine before leaves it high for a while); the load average then."""
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] > QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    return os.getloadavg()[0]


def _engine(tmp: str, model: str, key: str, plan: Plan, args: argparse.Namespace) -> dict:
    """One run of configuration ``key`` (again once, from a clean start, if something from
    outside killed it): its ``main`` phase, the layout vLLM logged, its seconds, the load
    average before and after it."""
    spec, killed = engine_spec(tmp, model, key, plan), None
    load_before = settle(plan.settle_s) if plan.settle_s else os.getloadavg()[0]
    for attempt in (1, 2):  # a second kill ends the run
        _forget(key, spec)
        mc = None
        env: dict[str, str] = {}
        try:
            if key == "mooncake-store":  # vLLM's store connector: a master of its own, on 127.0.0.1
                from kvcm.dataplane.mooncake_store import LocalMooncake

                mc = LocalMooncake(segment_bytes=0, client=False, log_dir=tmp)
                path = os.path.join(tmp, "mooncake-store.json")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(mooncake_config(mc.master_addr, plan), f)
                env["MOONCAKE_CONFIG_PATH"] = path
            out, layout, seconds = _child(tmp, key, spec, plan, args.timeout, env)
            break
        except EngineKilled as e:
            if attempt == 2:
                raise
            print(f" {e}: running it again", file=sys.stderr, flush=True)
            killed = e.signum
        finally:
            if mc is not None:
                mc.stop()
    main = next(p for p in out["phases"] if p["name"] == "main")
    return {"phase": main, "layout": layout, "seconds": seconds, "start_seconds": out["start_seconds"],
            "killed_before": killed, "engine_load": (load_before, os.getloadavg()[0])}


def measure(plan: Plan, args: argparse.Namespace, tmp: str, model: str) -> dict[str, dict]:
    """Every configuration ``plan.repeat`` times, interleaved: ``key -> {"runs": [...]}``."""
    results: dict[str, dict] = {key: {"runs": []} for key in plan.configs}
    for rep in range(plan.repeat):
        for key in plan.configs:
            tag = f" (run {rep + 1} of {plan.repeat})" if plan.repeat > 1 else ""
            print(f"bench vllm: {CONFIGS[key]}{tag} ...", file=sys.stderr, end="", flush=True)
            r = _engine(tmp, model, key, plan, args)
            results[key]["runs"].append(r)
            lb, la = r["engine_load"]
            noisy = "  NOISY (load above 1.0 at start)" if lb > QUIET_LOAD else ""
            print(f" {r['seconds']:.0f} s (engine start {r['start_seconds']:.0f} s, workload "
                  f"{r['phase']['seconds']:.1f} s); load 1-min {lb:.2f} before, {la:.2f} after{noisy}",
                  file=sys.stderr, flush=True)
    return results


def run(plan: Plan, args: argparse.Namespace) -> int:
    from kvcm.bench.vllm_workload import make_model

    keep = args.dir is not None
    tmp = args.dir or tempfile.mkdtemp(prefix="kvcm-bench-vllm-")
    os.makedirs(tmp, exist_ok=True)
    done = False
    try:
        model = make_model(os.path.join(tmp, "model"), **MODEL)
        asked = ("vLLM's own core layout" if plan.reserved_cpus is None
                 else f"VLLM_CPU_NUM_OF_RESERVED_CPU={plan.reserved_cpus}")
        print(f"bench vllm: {', '.join(plan.configs)} on the {plan.workload} workload, {asked} in every engine; "
              f"work dir {tmp}", file=sys.stderr, flush=True)
        results = measure(plan, args, tmp, model)
        report = bench_report.summarize(plan, results, CONFIGS, floors=bench_report.copy_floors(results))
        print(bench_report.markdown(plan, report, MODEL))
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\njson: {args.json}")
        if args.plot:
            bench_report.plot(plan, report, args.plot)
            print(f"plot: {args.plot}")
        done = True
    finally:
        if done and not keep:
            shutil.rmtree(tmp, ignore_errors=True)
        elif not done:
            print(f"bench vllm: the work dir is kept for its logs: {tmp}", file=sys.stderr)
    return 0 if all(r["exact"] is not False for r in report["rows"]) else 1


SUITE = (("chat, one at a time", ["--workload", "chat", "--batch", "1"]),
         ("chat, a turn's requests together", ["--workload", "chat", "--together"]),
         ("long documents, one at a time", ["--workload", "long", "--batch", "1"]))


def run_suite(p: argparse.ArgumentParser, argv: list[str]) -> int:
    """``--suite``: the three workloads of the targets, one run each (the other arguments
    apply to all three; ``--json`` / ``--plot`` get the workload's name), then one summary."""
    rest = [a for a in argv if a != "--suite"]
    rc, summary = 0, []
    for name, extra in SUITE:
        args = p.parse_args(extra + rest)
        stem = name.split(",")[0].replace(" ", "-") + ("-together" if args.together else "")
        args.json = f"{os.path.splitext(args.json)[0]}-{stem}.json"
        args.plot = f"{os.path.splitext(args.plot)[0]}-{stem}.png" if args.plot else ""
        try:
            plan = make_plan(args)
        except UsageError as e:
            p.error(f"{name}: {e}")
        print(f"\n## {name}\n")
        rc = max(rc, run(plan, args))
        with open(args.json) as f:
            summary.append((name, json.load(f)))
    print("\n## summary\n")
    print(bench_report.suite_table(summary))
    return rc


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("chat", "long"), default="chat")
    w.add_argument("--conversations", type=int, help=f"chat: chats (default {CHAT['conversations']})")
    w.add_argument("--turns", type=int, help=f"chat: turns per chat (default {CHAT['turns']})")
    w.add_argument("--system-len", type=int, help=f"chat: the shared system prompt, tokens (default {CHAT['system_len']})")
    w.add_argument("--user-len", type=int, help=f"chat: each user message, tokens (default {CHAT['user_len']})")
    w.add_argument("--documents", type=int, help=f"long: documents (default {LONG['documents']})")
    w.add_argument("--doc-len", type=int, help=f"long: tokens per document (default {LONG['doc_len']})")
    w.add_argument("--questions", type=int, help=f"long: questions per document (default {LONG['questions']})")
    w.add_argument("--question-len", type=int, help=f"long: tokens per question (default {LONG['question_len']})")
    w.add_argument("--max-tokens", type=int, help="greedy reply tokens per request (default 16)")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--batch", type=int, help="requests submitted together (default 1: one at a time)")
    m.add_argument("--together", action="store_true", help="each turn's (round's) requests submitted together")
    c = p.add_argument_group("engines and caches")
    c.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)})")
    c.add_argument("--gpu-blocks", type=int,
                   help=f"vLLM's KV cache, blocks of {BLOCK} tokens (default chat {CHAT['gpu_blocks']}, long {LONG['gpu_blocks']})")
    c.add_argument("--limit-blocks", type=int, help="the limit's KV cache (default: working set + headroom)")
    c.add_argument("--host-blocks", type=int,
                   help=f"kvcm's host tier, blocks (default chat {CHAT['host_blocks']}, long {LONG['host_blocks']})")
    c.add_argument("--disk-blocks", type=int, help="kvcm's disk tier, blocks (default: twice the working set)")
    c.add_argument("--max-num-seqs", type=int, default=4)
    c.add_argument("--max-num-batched-tokens", type=int, default=2048)
    c.add_argument("--reserved-cpus", default="1",
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (default 1); 'vllm': leave it to vLLM, "
                        "which reserves one more core for engines with a connector")
    c.add_argument("--load-mode", choices=("auto", "sync", "async"),
                   help="the kvcm engines' load_mode (default: the connector's, auto: host hits load "
                        "synchronously, disk and store hits asynchronously)")
    c.add_argument("--warmup", type=int, default=2, help="unrelated requests each engine runs first (default 2)")
    c.add_argument("--model", choices=("llama", "gemma3"), default="llama",
                   help="gemma3: a sliding-window + full-attention model through vLLM alone, kvcm with vLLM's hybrid "
                        "KV cache manager on and off (kvcm.bench.vllm_hybrid; chat workload)")
    c.add_argument("--kv-pages", type=int, default=40,
                   help="--model gemma3: vLLM's KV cache memory, in blocks of every layer (default 40)")
    o = p.add_argument_group("run and output")
    o.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, the figures mean nothing")
    o.add_argument("--suite", action="store_true",
                   help="the three workloads of the targets: chat one at a time, chat together, long documents")
    o.add_argument("--repeat", type=int, default=1, help="runs of every configuration, interleaved; the table "
                   "shows each figure's best run (default 1)")
    o.add_argument("--settle-s", type=float, default=90.0, help="before each engine, wait up to this long for the "
                   "1-minute load average to fall to 1.0 (default 90; 0: do not wait)")
    o.add_argument("--timeout", type=float, default=1800, help="seconds per engine (default 1800)")
    o.add_argument("--dir", default=None, help="work directory, kept (default: a temp dir, removed)")
    o.add_argument("--json", default="kvcm-vllm.json")
    o.add_argument("--plot", default="kvcm-vllm.png", help="'' for none")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcm bench vllm", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.suite:
        return run_suite(p, argv)
    if args.model == "gemma3":  # the hybrid KV cache manager comparison: its own engines and table
        from kvcm.bench import vllm_hybrid as bench_hybrid

        return bench_hybrid.run(bench_hybrid.with_defaults(args))
    try:
        plan = make_plan(args)
    except UsageError as e:
        p.error(str(e))
    return run(plan, args)


if __name__ == "__main__":
    sys.exit(main())
