"""``python -m kvcm bench vllm``'s plan: the configurations, the workloads' sizes, the
arguments checked (:class:`UsageError` before any engine starts) and each engine's spec for
:mod:`kvcm.bench.vllm_workload`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

BLOCK = 32
# a random-weight Llama large enough that prefill is the cost it is on a real engine
MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 8, "max_position_embeddings": 16384}
HEAD_DIM = MODEL["hidden_size"] // MODEL["num_attention_heads"]
PAGE = BLOCK * MODEL["num_hidden_layers"] * (MODEL["num_key_value_heads"] * HEAD_DIM * 2 * 4)  # a block, every layer, fp32

CONFIGS = {  # key -> table label, in the order they run
    "vllm": "vllm", "limit": "limit (vllm, cache = working set)", "example": "vllm+example",
    "mooncake-store": "vllm+MooncakeStoreConnector (store = working set)",
    "host-equal": "kvcm host (= the store's memory)", "host": "kvcm host", "host+disk": "kvcm host+disk",
    "host+disk+partial": "kvcm host+disk, partial tails", "shared1": "kvcm +shared (1st)",
    "shared2": "kvcm +shared (2nd)"}
DEFAULT_CONFIGS = ("vllm", "limit", "mooncake-store", "host-equal", "host+disk")
KVCM_CONFIGS = ("host-equal", "host", "host+disk", "host+disk+partial", "shared1", "shared2")

# per workload: its options' defaults, full size and --quick (a smoke run: nothing measured)
CHAT = {"conversations": 10, "turns": 5, "system_len": 384, "user_len": 96, "max_tokens": 16,
        "gpu_blocks": 32, "host_blocks": 64}
CHAT_QUICK = {"conversations": 3, "turns": 2, "system_len": 64, "user_len": 32, "max_tokens": 4,
              "gpu_blocks": 8, "host_blocks": 8}
LONG = {"documents": 6, "doc_len": 3072, "questions": 3, "question_len": 32, "max_tokens": 16,
        "gpu_blocks": 200, "host_blocks": 256}
LONG_QUICK = {"documents": 2, "doc_len": 256, "questions": 2, "question_len": 16, "max_tokens": 4,
              "gpu_blocks": 12, "host_blocks": 16}
# --together on the chat: more chats, and vLLM's cache holds the live batch (max_num_seqs chats
# at their longest), not the working set
CHAT_TOGETHER = {**CHAT, "conversations": 20}
WORKLOAD_KEYS = {"chat": ("conversations", "turns", "system_len", "user_len"),
                 "long": ("documents", "doc_len", "questions", "question_len")}
WARMUP_SEED = 1_000_003  # the warm-up's tokens: unrelated to the workload's


class UsageError(ValueError):
    """Bad arguments: reported on one line, exit 2, nothing run."""


@dataclass
class Plan:
    """Everything a run needs, resolved from the arguments before any engine starts."""

    workload: str
    sizes: dict[str, int]  # the workload's sizes and the caches' (blocks)
    batch: int
    together: bool
    configs: list[str]
    reserved_cpus: int | None  # None: vLLM's own choice per engine
    warmup: int
    quick: bool
    working_set: int  # blocks (every request's final tokens, whole blocks rounded up)
    requests: int
    max_model_len: int
    limit_blocks: int
    disk_blocks: int
    extra: dict[str, Any] = field(default_factory=dict)
    load_mode: str | None = None  # the kvcm engines' load_mode (None: the connector's default)
    repeat: int = 1  # runs of every configuration, interleaved (the table shows each one's best)
    settle_s: float = 0.0  # before each engine: wait up to this long for the 1-minute load to fall to QUIET_LOAD

    @property
    def store_blocks(self) -> int:
        """MooncakeStoreConnector's store, and kvcm's host tier beside it (``host-equal``):
        the limit's cache, the working set and headroom."""
        return self.limit_blocks

    @property
    def reference(self) -> str:
        """Whose greedy outputs every configuration must give: vLLM alone."""
        return "vllm" if "vllm" in self.configs else "limit"


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    chat = CHAT_QUICK if args.quick else CHAT_TOGETHER if args.together else CHAT
    defaults = {"chat": chat, "long": LONG_QUICK if args.quick else LONG}[args.workload]
    other = WORKLOAD_KEYS["long" if args.workload == "chat" else "chat"]
    given = [k for k in other if getattr(args, k) is not None]
    if given:
        raise UsageError(f"--{given[0].replace('_', '-')} is an option of --workload "
                         f"{'long' if args.workload == 'chat' else 'chat'}, not {args.workload}")
    sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in defaults.items()}
    for k, v in sizes.items():
        if v < 1:
            raise UsageError(f"--{k.replace('_', '-')} must be at least 1 (got {v})")
    return sizes


def working_set(workload: str, s: dict[str, int]) -> tuple[int, int, int]:
    """(working set in blocks, requests, the longest request in tokens).  Chat: the system
    prompt's whole blocks shared by every chat, plus each chat's final history (system, every
    turn's message and reply) rounded up to whole blocks.  Long: each document's whole blocks
    (what its questions reuse) plus, per question, the rest of its prompt and reply."""
    if workload == "chat":
        final = s["system_len"] + s["turns"] * (s["user_len"] + s["max_tokens"])
        shared = s["system_len"] // BLOCK
        return shared + s["conversations"] * (-(-final // BLOCK) - shared), s["conversations"] * s["turns"], final
    longest = s["doc_len"] + s["question_len"] + s["max_tokens"]
    doc = s["doc_len"] // BLOCK
    return (s["documents"] * (doc + s["questions"] * (-(-longest // BLOCK) - doc)),
            s["documents"] * s["questions"], longest)


def make_plan(args: argparse.Namespace) -> Plan:
    """The run the arguments describe, or :class:`UsageError` (nothing has run yet)."""
    sizes = _sizes(args)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise UsageError(f"--configs: unknown {unknown or 'empty list'}; choose from {', '.join(CONFIGS)}")
    if len(set(configs)) != len(configs):
        raise UsageError(f"--configs names a configuration twice: {args.configs}")
    if "vllm" not in configs and "limit" not in configs:
        raise UsageError("--configs needs vllm or limit: every output is checked against vLLM alone's")
    if "shared2" in configs and "shared1" not in configs:
        raise UsageError("--configs: shared2 reuses the store shared1 writes; name shared1 too")
    configs = [c for c in CONFIGS if c in configs]  # run order: shared1 before shared2
    work, requests, longest = working_set(args.workload, sizes)
    group = sizes["conversations" if args.workload == "chat" else "documents"]
    batch = group if args.together else (args.batch if args.batch is not None else 1)
    if batch < 1:
        raise UsageError(f"--batch must be at least 1 (got {batch})")
    max_model_len = -(-longest // BLOCK) * BLOCK
    need = max_model_len // BLOCK + 1  # vLLM holds one block back (its null block)
    if args.together and args.workload == "chat" and args.gpu_blocks is None and not args.quick:
        sizes["gpu_blocks"] = args.max_num_seqs * (max_model_len // BLOCK) + 1  # the live batch
        if args.host_blocks is None:  # kvcm's host tier holds the live requests' pages: at least the live batch
            sizes["host_blocks"] = max(sizes["host_blocks"], -(-work // 4), sizes["gpu_blocks"])
    if sizes["gpu_blocks"] < need:
        raise UsageError(f"--gpu-blocks {sizes['gpu_blocks']} cannot hold the longest request "
                         f"({longest} tokens): give at least {need}")
    limit = args.limit_blocks if args.limit_blocks is not None else work + args.max_num_seqs + need
    if limit < work:
        raise UsageError(f"--limit-blocks {limit} is smaller than the working set ({work} blocks)")
    disk = args.disk_blocks if args.disk_blocks is not None else 2 * work
    for name, v in (("--disk-blocks", disk), ("--max-num-seqs", args.max_num_seqs), ("--timeout", args.timeout)):
        if v < 1:
            raise UsageError(f"{name} must be at least 1 (got {v})")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more (got {args.warmup})")
    reserved: int | None
    if args.reserved_cpus == "vllm":
        reserved = None
    else:
        try:
            reserved = int(args.reserved_cpus)
        except ValueError:
            raise UsageError(f"--reserved-cpus: a number of cores or 'vllm' (got {args.reserved_cpus!r})") from None
        if reserved < 0:
            raise UsageError(f"--reserved-cpus must be 0 or more (got {reserved})")
    if args.repeat < 1:
        raise UsageError(f"--repeat must be at least 1 (got {args.repeat})")
    if args.settle_s < 0:
        raise UsageError(f"--settle-s must be 0 or more (got {args.settle_s})")
    return Plan(workload=args.workload, sizes=sizes, batch=batch, together=bool(args.together), configs=configs,
                reserved_cpus=reserved, warmup=args.warmup, quick=args.quick, working_set=work, requests=requests,
                max_model_len=max_model_len, limit_blocks=limit, disk_blocks=disk,
                extra={"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
                load_mode=args.load_mode, repeat=args.repeat, settle_s=args.settle_s)


def _connector(tmp: str, key: str, plan: Plan) -> dict | None:
    if key in ("vllm", "limit"):
        return None
    if key == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": os.path.join(tmp, "example")}}
    if key == "mooncake-store":  # vLLM's own store connector (its master: bench.py; MOONCAKE_CONFIG_PATH)
        return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {}}
    name = key.replace("+", "-")
    host = plan.store_blocks if key == "host-equal" else plan.sizes["host_blocks"]
    extra: dict[str, Any] = {"host_bytes": host * PAGE, "stats_file": os.path.join(tmp, f"{name}.stats.json")}
    if plan.load_mode is not None:
        extra["load_mode"] = plan.load_mode
    if key not in ("host", "host-equal"):
        extra.update(disk_path=os.path.join(tmp, f"{name}-disk"), disk_bytes=plan.disk_blocks * PAGE)
    if key == "host+disk+partial":  # below the whole-block floor (kvcm.integrations.vllm.partial)
        extra["partial_tail"] = True
    if key in ("shared1", "shared2"):
        extra.update(shared=os.path.join(tmp, "shared"), shared_namespace="bench-llama-random")
    return {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def mooncake_config(master: str, plan: Plan) -> dict:
    """MOONCAKE_CONFIG_PATH's content for the ``mooncake-store`` engine: the master on
    127.0.0.1, TCP, the engine's own segment sized as :attr:`Plan.store_blocks` (embedded
    mode, no metadata server: the P2P handshake)."""
    return {"metadata_server": "P2PHANDSHAKE", "master_server_address": master, "protocol": "tcp",
            "device_name": "", "mode": "embedded", "global_segment_size": plan.store_blocks * PAGE,
            "local_buffer_size": max(64 << 20, 4 * (plan.max_model_len // BLOCK) * PAGE)}


def engine_spec(tmp: str, model: str, key: str, plan: Plan) -> dict:
    """The workload child's spec for one configuration."""
    blocks = plan.limit_blocks if key == "limit" else plan.sizes["gpu_blocks"]
    workload: dict[str, Any] = {"kind": plan.workload, "seed": 11, "batch": plan.batch, "block_size": BLOCK,
                                **{k: plan.sizes[k] for k in WORKLOAD_KEYS[plan.workload]}}
    if plan.workload == "chat":
        workload["vocab"] = 512
    phases: list[dict] = [{"name": "main"}]
    if plan.warmup:
        phases = [{"name": "warmup", "workload": {"kind": "chat", "conversations": plan.warmup, "turns": 1,
                                                  "system_len": 2 * BLOCK, "user_len": BLOCK, "seed": WARMUP_SEED,
                                                  "batch": 1}},
                  {"name": "main", "reset": True}]
    return {"model": model, "gpu_blocks": blocks, "kv_cache_memory_bytes": blocks * PAGE, "block_size": BLOCK,
            "max_model_len": plan.max_model_len, "max_tokens": plan.sizes["max_tokens"], "workload": workload,
            "phases": phases, "connector": _connector(tmp, key, plan), **plan.extra}
