"""``python -m kvcm bench vllm --model gemma3``: kvcm under vLLM's hybrid KV cache manager.

A Gemma-3-style random-weight model (five sliding-window layers of 128 tokens, then a
full-attention one; untied embeddings, so outputs depend on the KV) through the same
multi-turn chat as ``bench vllm``, three engines of equal KV cache memory
(``kv_cache_memory_bytes``, not a block count: a block of the hybrid manager is one layer's,
a block of today's mode every layer's):

* ``vllm (HMA on)``            vLLM alone, its hybrid manager on (sliding layers keep their window);
* ``kvcm, HMA on``             vLLM + kvcm (``SupportsHMA``): each KV cache group on the kvcm
  life cycle of its kind, no block outside a window stored;
* ``kvcm, HMA off (today)``    vLLM + kvcm with ``disable_hybrid_kv_cache_manager=True``: every
  layer holds (and kvcm stores) every block, as before the connector declared ``SupportsHMA``.

vLLM runs with its default ``prefix_cache_retention_interval`` (0: sliding-window groups keep
only checkpoint blocks, so vLLM alone reuses less of a shared prefix with the hybrid manager on).
Reported: prefill tokens computed, TTFT p50, bytes kvcm stored per request, blocks kvcm
loaded, whether the greedy outputs equal vLLM alone's.
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
WINDOW = 128
MODEL = {"kind": "gemma3", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6,
         "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": WINDOW,
         "tie_word_embeddings": False, "initializer_range": 0.02}
LAYER_BLOCK = BLOCK * MODEL["num_key_value_heads"] * 64 * 2 * 4  # one layer's block, fp32
PAGE = LAYER_BLOCK * MODEL["num_hidden_layers"]  # one block of every layer


def _kvcm(tmp: str, name: str, host_pages: int) -> dict:
    extra: dict[str, Any] = {"host_bytes": host_pages * PAGE, "stats_file": os.path.join(tmp, f"{name}.stats.json")}
    return {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def _child(tmp: str, name: str, spec: dict) -> dict:
    """One engine process (:mod:`kvcm.bench.vllm_workload`) running ``spec``."""
    spec_path, out_path = os.path.join(tmp, f"{name}.spec.json"), os.path.join(tmp, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    p = subprocess.run([sys.executable, "-m", "kvcm.bench.vllm_workload", spec_path, out_path],
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"bench vllm --model gemma3: the {name} engine failed ({p.returncode}):\n{p.stderr[-6000:]}")
    if "Turning off hybrid kv cache manager" in p.stdout + p.stderr and not spec.get("llm"):
        raise RuntimeError(f"bench vllm --model gemma3: vLLM turned its hybrid manager off for {name}")
    with open(out_path) as f:
        return json.load(f)


# the comparison's workload (the chat bench's options left unset take these)
DEFAULTS = {"conversations": 8, "turns": 6, "system_len": 256, "user_len": 64, "max_tokens": 16, "host_blocks": 64,
            "batch": 1, "max_num_seqs": 4}


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every workload option the user left unset at this comparison's default."""
    for key, value in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def run(args: argparse.Namespace) -> int:
    from kvcm.bench.vllm_workload import make_model

    # vLLM's CPU backend reserves one more core when a connector is configured: every engine
    # of the comparison gets the same reservation
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    tmp = args.dir or tempfile.mkdtemp(prefix="kvcm-bench-vllm-hybrid-")
    layers = ["sliding_attention"] * (MODEL["num_hidden_layers"] - 1) + ["full_attention"]
    model = make_model(os.path.join(tmp, "model-gemma3"), **MODEL, layer_types=layers)
    workload = {"conversations": args.conversations, "turns": args.turns, "system_len": args.system_len,
                "user_len": args.user_len, "seed": 11, "batch": args.batch}
    final = args.system_len + args.turns * (args.user_len + args.max_tokens)
    base = {"model": model, "gpu_blocks": None, "kv_cache_memory_bytes": args.kv_pages * PAGE, "block_size": BLOCK,
            "max_model_len": -(-final // BLOCK) * BLOCK + BLOCK, "max_tokens": args.max_tokens, "workload": workload,
            "phases": [{"name": "main"}], "max_num_seqs": args.max_num_seqs}
    configs = [
        ("vllm (HMA on)", None, {}),
        ("kvcm, HMA on", _kvcm(tmp, "hma", args.host_blocks), {}),
        ("kvcm, HMA off (today)", _kvcm(tmp, "nohma", args.host_blocks), {"disable_hybrid_kv_cache_manager": True}),
    ]
    rows = []
    for name, conn, llm in configs:
        print(f"bench vllm --model gemma3: {name} ...", file=sys.stderr, flush=True)
        tag = "".join(ch if ch.isalnum() else "_" for ch in name)
        rows.append((name, _child(tmp, tag, {**base, "connector": conn, "llm": llm})["phases"][0]))
    from kvcm.bench.vllm_report import differing, exact_cell

    ref = rows[0][1]["outputs"]
    requests = args.conversations * args.turns
    table = []
    for name, p in rows:
        st = p.get("stats") or {}
        c, w = st.get("counters", {}), st.get("worker", {})
        table.append({"config": name, "prompt_tokens": p["prompt_tokens"],
                      "prefill_tokens": p["prompt_tokens"] - p["cached_tokens"],
                      "ttft_p50_ms": 1000 * statistics.median(p["ttft"]),
                      "stored_kib_per_request": w.get("saved_bytes", 0) / 1024 / requests if st else None,
                      "loaded_blocks": c.get("loaded_blocks") if st else None,
                      "exact": None if p is rows[0][1] else p["outputs"] == ref,  # the first row is ref
                      "mismatched": differing(ref, p["outputs"])})
    print(f"\nmodel: Gemma-3-style, {MODEL['num_hidden_layers'] - 1} sliding-window layers (W={WINDOW}) + 1 full, "
          f"random weights; workload: {args.conversations} chats x {args.turns} turns, system {args.system_len}, user "
          f"{args.user_len}, reply {args.max_tokens}; vLLM KV cache {args.kv_pages} blocks of every layer "
          f"({args.kv_pages * PAGE >> 20} MiB), prefix_cache_retention_interval default (0); kvcm host "
          f"{args.host_blocks} blocks of every layer\n")
    print("| config | prompt tokens | prefill tokens computed | TTFT p50 ms | kvcm stored KiB / request "
          "| kvcm blocks loaded | exact |")
    print("|---|---|---|---|---|---|---|")
    for t in table:
        kib = "-" if t["stored_kib_per_request"] is None else f"{t['stored_kib_per_request']:,.0f}"
        print(f"| {t['config']} | {t['prompt_tokens']:,} | {t['prefill_tokens']:,} | {t['ttft_p50_ms']:.0f} | {kib} | "
              f"{'-' if t['loaded_blocks'] is None else t['loaded_blocks']} | {exact_cell(t['exact'], t['mismatched'])} |")
    with open(os.path.join(tmp, "bench-vllm-hybrid.json"), "w") as f:
        json.dump(table, f, indent=1)
    return 0 if all(t["exact"] is not False for t in table) else 1
