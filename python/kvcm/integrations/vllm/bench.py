"""``python -m kvcm bench vllm``: a multi-turn chat through real vLLM engines, with and without kvcm.

Configurations (each one engine process, :mod:`kvcm.integrations.vllm.workload`; vLLM's KV
cache shrunk with ``num_gpu_blocks_override`` to a fraction of the workload's working set):

* ``vllm``              vLLM alone (its own prefix cache);
* ``vllm+example``      vLLM + its ``ExampleConnector`` (safetensors files per prompt);
* ``kvcm host``         vLLM + kvcm, host tier only;
* ``kvcm host+disk``    vLLM + kvcm, host + disk;
* ``kvcm +shared (1st)`` host + disk + a file store (written on commit, one fsync per block);
* ``kvcm +shared (2nd)`` a second vLLM + kvcm process on the store the first wrote (its
  host tier empty at start): what a fleet reuses.

Reported per configuration: prompt tokens, prefill tokens vLLM computed (prompt tokens minus
``num_cached_tokens``: local and external hits), blocks kvcm loaded by tier, TTFT p50 / p90
(``RequestOutput.metrics.first_token_latency``, from arrival; requests are submitted one
at a time by default, ``--batch N`` submits N together), throughput (prompt + generated tokens per second of the workload's wall time),
and whether the greedy outputs equal vLLM alone's.  A markdown table on stdout and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

BLOCK = 32
# a random-weight Llama large enough that prefill is the cost it is on a real engine
MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 8}
PAGE = BLOCK * MODEL["num_hidden_layers"] * (MODEL["num_key_value_heads"] * 64 * 2 * 4)  # a block of every layer, fp32


def _child(tmp: str, name: str, spec: dict) -> dict:
    spec_path, out_path = os.path.join(tmp, f"{name}.spec.json"), os.path.join(tmp, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    p = subprocess.run([sys.executable, "-m", "kvcm.integrations.vllm.workload", spec_path, out_path],
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"bench vllm: the {name} engine failed ({p.returncode}):\n{p.stderr[-6000:]}")
    with open(out_path) as f:
        return json.load(f)


def _kvcm(tmp: str, name: str, host_pages: int, disk_pages: int, shared: str | None) -> dict:
    extra: dict[str, Any] = {"host_bytes": host_pages * PAGE, "stats_file": os.path.join(tmp, f"{name}.stats.json")}
    if disk_pages:
        extra.update(disk_path=os.path.join(tmp, f"{name}-disk"), disk_bytes=disk_pages * PAGE)
    if shared:
        extra.update(shared=shared, shared_namespace="bench-llama-random")
    return {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def run(args: argparse.Namespace) -> int:
    if args.model == "gemma3":  # the hybrid KV cache manager comparison (bench_hybrid)
        from kvcm.integrations.vllm import bench_hybrid

        return bench_hybrid.run(args)
    from kvcm.integrations.vllm.workload import make_model

    tmp = args.dir or tempfile.mkdtemp(prefix="kvcm-bench-vllm-")
    model = make_model(os.path.join(tmp, "model"), **MODEL)
    workload = {"conversations": args.conversations, "turns": args.turns, "system_len": args.system_len,
                "user_len": args.user_len, "seed": 11, "batch": args.batch}
    base = {"model": model, "gpu_blocks": args.gpu_blocks, "block_size": BLOCK, "max_tokens": args.max_tokens,
            "workload": workload, "stats": True, "phases": [{"name": "main"}], "max_num_seqs": args.max_num_seqs}
    # the working set: every conversation's final history, in blocks
    final = args.system_len + args.turns * (args.user_len + args.max_tokens)
    sys_blocks = args.system_len // BLOCK  # the system prompt's whole blocks are shared by every chat
    working = sys_blocks + args.conversations * (-(-final // BLOCK) - sys_blocks)  # distinct blocks
    shared = os.path.join(tmp, "shared")
    configs = [
        ("vllm", None),
        ("vllm+example", {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"shared_storage_path": os.path.join(tmp, "example")}}),
        ("kvcm host", _kvcm(tmp, "host", args.host_blocks, 0, None)),
        ("kvcm host+disk", _kvcm(tmp, "hostdisk", args.host_blocks, working * 2, None)),
        ("kvcm +shared (1st)", _kvcm(tmp, "first", args.host_blocks, working * 2, shared)),
        ("kvcm +shared (2nd)", _kvcm(tmp, "second", args.host_blocks, working * 2, shared)),
    ]
    rows = []
    for name, conn in configs:
        print(f"bench vllm: {name} ...", file=sys.stderr, flush=True)
        r = _child(tmp, name.replace(" ", "_").replace("+", "_").replace("(", "").replace(")", ""),
                   {**base, "connector": conn})
        rows.append((name, r["phases"][0]))
    ref = rows[0][1]["outputs"]
    table = []
    for name, p in rows:
        c = (p.get("stats") or {}).get("counters", {})
        ttft = sorted(p["ttft"])
        gen = sum(len(o) for o in p["outputs"])
        table.append({
            "config": name, "prompt_tokens": p["prompt_tokens"], "prefill_tokens": p["prompt_tokens"] - p["cached_tokens"],
            "host": c.get("hit_blocks_host", "-"), "disk": c.get("hit_blocks_disk", "-"),
            "shared": c.get("hit_blocks_shared", "-"),
            "ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p90_ms": 1000 * ttft[int(0.9 * (len(ttft) - 1))],
            "tok_s": (p["prompt_tokens"] + gen) / p["seconds"], "exact": p["outputs"] == ref,
            "seconds": p["seconds"],
            "connector_s": sum((p.get("stats") or {}).get("seconds", {}).values())
            + sum(v for k, v in (p.get("stats") or {}).get("worker", {}).items() if k.endswith("_us")) / 1e6})
    print(f"\nworkload: {args.conversations} chats x {args.turns} turns, {args.batch} request(s) at a time, system {args.system_len}, user "
          f"{args.user_len}, reply {args.max_tokens} tokens; working set {working} blocks of {BLOCK}; vLLM's KV "
          f"cache {args.gpu_blocks} blocks; kvcm host {args.host_blocks} blocks, disk {working * 2} blocks\n")
    print("| config | prompt tokens | prefill tokens computed | kvcm hits host / disk / shared (blocks) "
          "| TTFT p50 ms | TTFT p90 ms | tokens/s | wall s (kvcm's part) | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in table:
        part = f" ({t['connector_s']:.1f})" if t["connector_s"] else ""
        print(f"| {t['config']} | {t['prompt_tokens']:,} | {t['prefill_tokens']:,} | {t['host']} / {t['disk']} / "
              f"{t['shared']} | {t['ttft_p50_ms']:.0f} | {t['ttft_p90_ms']:.0f} | {t['tok_s']:,.0f} | "
              f"{t['seconds']:.1f}{part} | {'yes' if t['exact'] else 'NO'} |")
    with open(os.path.join(tmp, "bench-vllm.json"), "w") as f:
        json.dump(table, f, indent=1)
    if args.plot:
        _plot(table, args.plot)
        print(f"\nplot: {args.plot}")
    return 0 if all(t["exact"] for t in table) else 1


def _plot(table: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [t["config"] for t in table]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.barh(names, [t["prefill_tokens"] for t in table], color="tab:blue")
    a.set_xlabel("prefill tokens computed")
    a.invert_yaxis()
    b.barh([n + " p50" for n in names], [t["ttft_p50_ms"] for t in table], color="tab:green")
    b.barh([n + " p90" for n in names], [t["ttft_p90_ms"] for t in table], color="tab:olive")
    b.set_xlabel("TTFT (ms)")
    b.invert_yaxis()
    fig.suptitle("multi-turn chat through vLLM (cpu), working set several times vLLM's KV cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--gpu-blocks", type=int, default=24, help="vLLM's KV cache, blocks of 32 tokens")
    p.add_argument("--host-blocks", type=int, default=64, help="kvcm's host tier, blocks")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--batch", type=int, default=1,
                   help="requests submitted together (1: one at a time, so TTFT is the request's own prefill)")
    p.add_argument("--dir", default=None, help="work directory (default: a new temp dir)")
    p.add_argument("--plot", default="kvcm-vllm.png")
    p.add_argument("--model", choices=("llama", "gemma3"), default="llama",
                   help="gemma3: a sliding-window + full-attention model, vLLM's hybrid KV cache manager on and off "
                        "(kvcm.integrations.vllm.bench_hybrid)")
    p.add_argument("--kv-pages", type=int, default=40,
                   help="--model gemma3: vLLM's KV cache memory, in blocks of every layer")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcm bench vllm", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
