"""Fleet replay: a trace spread over N managers, with and without a shared tier (issue 11).

``python -m kvcm replay --instances 2,4,8 --shared-tier file:DIR|mooncake|mooncake://...``

Requests go to the instances round-robin (the worst case for locality: consecutive turns of
one conversation land on different instances).  Each instance is a manager plus a
:class:`~kvcm.dataplane.DataPlane` (its gpu pool in host memory) driven like an engine::

    loop = EngineLoop(mgr, plane)                                 # kvcm.engine_loop
    kv = loop.admit(prompt, capacity=len(prompt))   # one batched lookup, create, resume,
                                                    # resize, copies: shared pages onboarded
    kv.commit(prompt[kv.num_committed_tokens:]); loop.sync()      # full blocks stored
    kv.close(); loop.sync()

A ``CopyError`` goes to the manager (the loop's sync) and the request is resumed again (it
recomputes what was not loaded).  Each N runs twice: **local** (gpu tier only, the same quota) and
**shared** (gpu + the shared tier).  The hit rate is reused prompt tokens / prompt tokens.
Pages are ``--page-bytes`` (one full-attention life cycle of two layers) and hold no real
K/V: the replay measures reuse and the data plane's movement of bytes, not a model.

Throughput: the data plane's store (gather + headers + checksums + batched put) and load
(batched get + verification + scatter) rates over the shared runs, next to the raw store
moving the same number of objects of the same size in batches of the same mean size,
measured in the same process right after (for Mooncake: ``batch_put_from`` /
``batch_get_into`` on a registered buffer, no kvcm format).  Timing is for reporting only.

``mooncake`` alone starts a local Mooncake Store for the run
(:class:`kvcm.dataplane.mooncake_store.LocalMooncake`) and stops it after.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.api import AttentionLayer, KVCacheManager, KVCacheManagerConfig
from kvcm.dataplane import DataPlane, open_store
from kvcm.dataplane.store import HEADER, SharedStore, Staging
from kvcm.engine_loop import EngineLoop, config_from_layout
from kvcm.tools.cmdline import fmt_int, format_table
from kvcm.tools.trace import TraceRequest, expand_prompt

NUM_LAYERS = 2


@dataclass
class FleetResult:
    """The outcome of one fleet replay: reuse, the data plane's and store's counters, seconds."""

    instances: int
    mode: str  # "local", or the shared tier's write policy: "commit" / "evict"
    backend: str
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    shared_hit_blocks: int = 0
    rollbacks: int = 0  # requests rolled back by a failed load
    plane: dict = field(default_factory=dict)  # summed shared_stats of the instances
    seconds: dict = field(default_factory=dict)  # summed shared_seconds
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Reused prompt tokens / prompt tokens."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def fleet_config(B: int, page_bytes: int, gpu_blocks: int, shared: str | None, namespace: str,
                 shared_write: str = "commit") -> KVCacheManagerConfig:
    """The config of one fleet instance: two attention layers, a gpu tier of ``gpu_blocks``
    pages of ``page_bytes``, and the shared tier at ``shared`` (None: local tiers only)."""
    per_token = page_bytes // (NUM_LAYERS * B)
    if per_token < 1 or per_token * NUM_LAYERS * B != page_bytes:
        raise ValueError(f"--page-bytes {page_bytes} is not a multiple of {NUM_LAYERS} layers x {B} tokens")
    layers = [AttentionLayer(i, per_token) for i in range(NUM_LAYERS)]
    return config_from_layout(B, layers, gpu_blocks=gpu_blocks, shared=shared, shared_namespace=namespace,
                              shared_write=shared_write)


def _request(loop: EngineLoop, prompt: list[int], res: FleetResult) -> None:
    res.requests += 1
    res.prompt_tokens += len(prompt)
    # lookup (with a shared tier), create, resume + resize, copies; a failed load rolls the
    # request back and the loop resumes it again (it recomputes the rest); no room: skipped
    kv = loop.admit(prompt, capacity=len(prompt))
    if kv is None:
        return
    res.reused_tokens += kv.num_committed_tokens
    kv.commit(prompt[kv.num_committed_tokens:])
    loop.sync()
    kv.close()
    loop.sync()


def run_fleet(trace: Sequence[TraceRequest], instances: int, *, shared: str | None, backend: str | None,
              tokens_per_block: int, page_bytes: int, gpu_blocks: int, namespace: str,
              store: SharedStore | None = None, shared_write: str = "commit") -> FleetResult:
    """Replay ``trace`` round-robin over ``instances`` managers; ``shared`` (a store location)
    adds the shared tier to each of them (all on one store: ``store`` if given), written
    by the ``shared_write`` policy."""
    config = fleet_config(tokens_per_block, page_bytes, gpu_blocks, shared, namespace, shared_write)
    mgrs = [KVCacheManager(config, backend=backend) for _ in range(instances)]
    import torch  # the data plane's; byte views, so any page size works

    planes = [DataPlane(config, store=store, dtype=torch.uint8) for _ in range(instances)]
    loops = [EngineLoop(m, p) for m, p in zip(mgrs, planes)]
    res = FleetResult(instances, shared_write if shared else "local", mgrs[0].backend_name)
    # one torch thread: the copies are small, and OpenMP workers spinning on a busy machine
    # made the gathers into the staging buffer ~4x slower (kvcm.engine.torch_threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        for i, req in enumerate(trace):
            _request(loops[i % instances], expand_prompt(req), res)
        for m, loop in zip(mgrs, loops):
            res.rollbacks += loop.counters["rollbacks"]
            m.check_invariants()
            st = m.stats()
            res.shared_hit_blocks += sum(lc.get("shared_hit_blocks", 0) for lc in st["lc"])
    finally:
        res.wall_s = time.perf_counter() - t0
        torch.set_num_threads(threads)
        for p in planes:
            for k, v in p.shared_stats.items():
                res.plane[k] = res.plane.get(k, 0) + v
            for k, v in p.shared_seconds.items():
                res.seconds[k] = res.seconds.get(k, 0.0) + v
            p.close()
        for m in mgrs:
            m.shutdown()
    return res


def raw_throughput(store: SharedStore, objects: int, object_bytes: int, batch: int) -> dict[str, float]:
    """MB/s of the store itself: ``objects`` objects of ``object_bytes`` put, then got, in
    batches of ``batch``, straight from / into one registered buffer (no kvcm format)."""
    batch = max(1, min(batch, objects))
    st = Staging(batch * object_bytes)
    store.register(st)
    try:
        st.view[:batch * object_bytes] = os.urandom(batch * object_bytes)
        prefix = f"kvcm-raw-{os.getpid()}-{time.monotonic_ns()}-"
        names = [f"{prefix}{i}" for i in range(objects)]
        put_s = get_s = 0.0
        for lo in range(0, objects, batch):
            items = [(n, j * object_bytes, object_bytes) for j, n in enumerate(names[lo:lo + batch])]
            t = time.perf_counter()
            errs = store.put(items, st)
            put_s += time.perf_counter() - t
            if any(e is not None for e in errs):
                raise OSError(f"raw put failed: {next(e for e in errs if e is not None)}")
        for lo in range(0, objects, batch):
            items = [(n, j * object_bytes, object_bytes) for j, n in enumerate(names[lo:lo + batch])]
            t = time.perf_counter()
            got = store.get(items, st)
            get_s += time.perf_counter() - t
            if any(isinstance(g, OSError) for g in got):
                raise OSError(f"raw get failed: {next(g for g in got if isinstance(g, OSError))}")
        store.remove(names)
    finally:
        store.unregister(st)
        st.close()
    total = objects * object_bytes / 1e6
    return {"put_MBps": total / put_s if put_s else 0.0, "get_MBps": total / get_s if get_s else 0.0}


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / 1e6 / seconds if seconds else 0.0


def fleet_table(results: Sequence[FleetResult], raw: dict[str, float] | None, store_kind: str) -> str:
    """The fleet replay's results as a text table."""
    rows = []
    for r in results:
        p, s = r.plane, r.seconds
        shared = r.mode != "local"
        rows.append([
            str(r.instances), "local" if not shared else f"shared:{r.mode}", f"{100 * r.hit_rate:.2f}%", fmt_int(r.reused_tokens),
            fmt_int(r.shared_hit_blocks) if shared else "-",
            f"{p.get('store_bytes', 0) / 1e6:.1f}" if shared else "-",
            f"{p.get('load_bytes', 0) / 1e6:.1f}" if shared else "-",
            fmt_int(p.get("stores", 0)) if shared else "-", fmt_int(p.get("loads", 0)) if shared else "-",
            f"{_mbps(p.get('store_bytes', 0), s.get('store', 0)):.1f}" if shared else "-",
            f"{_mbps(p.get('load_bytes', 0), s.get('load', 0)):.1f}" if shared else "-",
            str(r.rollbacks) if shared else "-", f"{r.wall_s:.1f}",
        ])
    head = ["N", "tiers", "hit rate", "reused tok", "shared hits", "stored MB", "loaded MB", "objects out",
            "objects in", "store MB/s", "load MB/s", "rollbacks", "wall s"]
    out = format_table(head, rows)
    if raw:
        out += (f"\nraw {store_kind} in the same run (same objects, batch sizes; no kvcm format): "
                f"put {raw['put_MBps']:.1f} MB/s, get {raw['get_MBps']:.1f} MB/s")
    return out


def plot(results: Sequence[FleetResult], raw: dict[str, float] | None, path: str) -> None:
    """Plot hit rate and throughput against N into ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({r.instances for r in results})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    modes = [m for m in ("local", "commit", "evict") if any(r.mode == m for r in results)]
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        rate = {r.instances: 100 * r.hit_rate for r in results if r.mode == mode}
        a.bar([i + (k - (len(modes) - 1) / 2) * width for i in range(len(ns))], [rate.get(n, 0) for n in ns], width,
              label="local tiers only" if mode == "local" else f"shared tier, write on {mode}")
    a.set_xticks(range(len(ns)), [f"N={n}" for n in ns])
    a.set_ylabel("reused prompt tokens (%)")
    a.set_title("hit rate, round-robin fleet", pad=24)
    a.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(modes), frameon=False, fontsize=8)  # not on a bar
    width = 0.38
    sh = [r for r in results if r.mode != "local"]
    labels = [f"plane N={r.instances} {r.mode}" for r in sh]
    put = [_mbps(r.plane.get("store_bytes", 0), r.seconds.get("store", 0)) for r in sh]
    get = [_mbps(r.plane.get("load_bytes", 0), r.seconds.get("load", 0)) for r in sh]
    if raw:
        labels.append("raw store")
        put.append(raw["put_MBps"])
        get.append(raw["get_MBps"])
    xs = range(len(labels))
    b.bar([x - width / 2 for x in xs], put, width, label="store / put")
    b.bar([x + width / 2 for x in xs], get, width, label="load / get")
    b.set_xticks(list(xs), labels, rotation=20)
    b.set_ylabel("MB/s")
    b.set_title("data plane vs raw store (same run)", pad=24)
    b.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def resolve_shared(spec: str, scratch: str) -> tuple[str, Any]:
    """(the shared tier's location, a LocalMooncake to stop or None) for ``--shared-tier``:
    ``mooncake`` (a local Mooncake Store for the run), ``mooncake://...``, ``file:DIR``,
    ``file://DIR`` or a directory."""
    if spec == "mooncake":
        from kvcm.dataplane.mooncake_store import LocalMooncake

        mc = LocalMooncake(1 << 30, log_dir=scratch)
        return mc.url, mc
    if spec.startswith("file:") and not spec.startswith("file://"):
        spec = spec[len("file:"):]
    return spec, None


def main_fleet(trace: Sequence[TraceRequest], instance_counts: Sequence[int], shared_spec: str, *,
               backend: str | None, tokens_per_block: int, page_bytes: int, gpu_blocks: int,
               plot_path: str | None, raw: bool = True, policies: Sequence[str] = ("commit",)) -> list[FleetResult]:
    """Run the local-only fleet and a shared one per write policy for each N, print the
    table, write the plot."""
    scratch = tempfile.mkdtemp(prefix="kvcm-fleet-")
    location, local_mc = resolve_shared(shared_spec, scratch)
    results: list[FleetResult] = []
    raw_rates = None
    store = open_store(location)
    try:
        run_id = f"fleet-{os.getpid()}-{time.monotonic_ns()}"
        for n in instance_counts:
            for shared, policy in [(None, "commit"), *((location, p) for p in policies)]:
                results.append(run_fleet(trace, n, shared=shared, backend=backend, tokens_per_block=tokens_per_block,
                                         page_bytes=page_bytes, gpu_blocks=gpu_blocks,
                                         namespace=f"{run_id}-N{n}-{policy}", store=store if shared else None,
                                         shared_write=policy))
                r = results[-1]
                print(f"  N={n} {r.mode}: hit rate {100 * r.hit_rate:.2f}% ({r.wall_s:.1f} s)", flush=True)
        sh = [r for r in results if r.mode != "local"]
        objects = sum(r.plane.get("stores", 0) for r in sh) // max(len(sh), 1)
        batches = sum(r.plane.get("put_batches", 0) for r in sh) // max(len(sh), 1)
        if raw and objects:
            raw_rates = raw_throughput(store, objects, HEADER.size + page_bytes, max(1, objects // max(batches, 1)))
    finally:
        store.close()
        if local_mc is not None:
            local_mc.stop()
    print()
    print(format_header(trace, instance_counts, shared_spec, tokens_per_block, page_bytes, gpu_blocks))
    print(fleet_table(results, raw_rates, store.kind))
    if plot_path:
        plot(results, raw_rates, plot_path)
        print(f"plot: {plot_path}")
    return results


def format_header(trace: Sequence[TraceRequest], ns: Sequence[int], spec: str, B: int, page_bytes: int,
                  gpu_blocks: int) -> str:
    """The one-line description printed above the fleet replay's table."""
    return (f"fleet replay: {len(trace)} requests round-robin over N = {', '.join(map(str, ns))} instances; "
            f"tokens_per_block={B}, page {page_bytes} B, gpu quota {fmt_int(gpu_blocks)} blocks per instance; "
            f"shared tier: {spec}")


__all__ = ["FleetResult", "fleet_config", "fleet_table", "main_fleet", "plot", "raw_throughput", "run_fleet"]
