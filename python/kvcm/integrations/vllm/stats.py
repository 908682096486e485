"""kvcm's numbers in vLLM's own observability: ``KVConnectorStats`` (vLLM sums the workers'
and the scheduler's objects, logs ``reduce()`` as its periodic "KV Transfer metrics:" line)
and ``KVConnectorPromMetrics`` (``kvcm_*`` Prometheus metrics per engine).

The data is a flat dict of ints (it crosses processes): counters since the last report —
``hit_blocks_host`` / ``hit_blocks_disk`` / ``hit_blocks_shared`` (blocks DELIVERED into vLLM's
cache, by where kvcm had them), ``loaded_blocks``, ``load_error_blocks`` (promised blocks vLLM
recomputes), ``saved_blocks`` (saves confirmed by every rank), ``save_failed_blocks``,
``saves_deferred`` (blocks past the in-flight bound), ``failed_ops``, ``rollbacks``,
``preemptions``, ``holds`` (scheduler side, counted once for all ranks); ``loaded_bytes``,
``saved_bytes``, ``run_bytes`` (worker side: each rank its shard, summed) — and the gauges
``bytes_in_flight`` (a worker's queue) and ``sched_bytes_in_flight`` (what the scheduler has
planned and not seen done), aggregated as their maximum.

Without vLLM installed the module still imports (its classes derive from local stand-ins).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # engine-free use

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)

    KVConnectorPromMetrics = None  # type: ignore[assignment,misc]

def process_stats() -> dict[str, int]:
    """This process's resident memory, threads and open file descriptors (Linux; the
    long-run test asserts they stay flat in the scheduler's and the workers' processes)."""
    out = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        out["threads"] = len(os.listdir("/proc/self/task"))
        out["fds"] = len(os.listdir("/proc/self/fd"))
    except OSError:
        pass
    return out


GAUGES = frozenset({"bytes_in_flight", "sched_bytes_in_flight"})
TIERS = ("host", "disk", "shared")
MIB = 1 << 20


@dataclass
class KvcmConnectorStats(KVConnectorStats):
    """kvcm's interval stats (module doc)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvcmConnectorStats:
        for k, v in (other.data or {}).items():
            if k in GAUGES:
                self.data[k] = max(self.data.get(k, 0), v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        hits = sum(d.get(f"hit_blocks_{t}", 0) for t in TIERS)
        return {
            "kvcm_hit_blocks": hits,
            **{f"kvcm_hit_blocks_{t}": d.get(f"hit_blocks_{t}", 0) for t in TIERS},
            "kvcm_load_error_blocks": d.get("load_error_blocks", 0),
            "kvcm_saved_blocks": d.get("saved_blocks", 0),
            "kvcm_loaded_MiB": round(d.get("loaded_bytes", 0) / MIB, 3),
            "kvcm_saved_MiB": round(d.get("saved_bytes", 0) / MIB, 3),
            "kvcm_bytes_in_flight": max(d.get("bytes_in_flight", 0), d.get("sched_bytes_in_flight", 0)),
        }

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k not in GAUGES)


# name -> (documentation, data key); hits carry a "tier" label
PROM_COUNTERS = {
    "kvcm_loaded_blocks": ("Blocks kvcm loaded into vLLM's KV cache", "loaded_blocks"),
    "kvcm_load_error_blocks": ("Blocks kvcm promised but could not load (vLLM recomputed them)", "load_error_blocks"),
    "kvcm_saved_blocks": ("Blocks saved from vLLM's KV cache into kvcm (confirmed by every rank)", "saved_blocks"),
    "kvcm_loaded_bytes": ("Bytes kvcm copied into vLLM's KV cache (all ranks)", "loaded_bytes"),
    "kvcm_saved_bytes": ("Bytes kvcm copied out of vLLM's KV cache (all ranks)", "saved_bytes"),
    # disaggregated prefill and decode (kvcm.integrations.vllm.handover)
    "kvcm_handover_announced": ("Hand-overs a producer announced (kv_transfer_params returned)", "handover_announced"),
    "kvcm_handover_accepted": ("Hand-over params a consumer accepted", "handover_accepted"),
    "kvcm_handover_rejected": ("Hand-over params a consumer rejected (forged, stale, malformed): nothing loaded",
                               "handover_rejected"),
    "kvcm_handover_deadlines": ("Hand-overs whose objects were not all there by the deadline (the rest computed)",
                                "handover_deadlines"),
}


if KVConnectorPromMetrics is not None:

    class KvcmPromMetrics(KVConnectorPromMetrics):
        """``kvcm_hit_blocks{tier=host|disk|shared}``, the counters of :data:`PROM_COUNTERS`
        and the gauge ``kvcm_bytes_in_flight``, one labelled child per engine."""

        def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            hits = self._counter_cls(name="kvcm_hit_blocks", labelnames=[*labelnames, "tier"],
                                     documentation="Blocks kvcm delivered into vLLM's KV cache, by the tier they came from")
            self.hits = {(e, t): hits.labels(*v, t) for e, v in per_engine_labelvalues.items() for t in TIERS}
            self.counters: dict[tuple[int, str], Any] = {}
            for name, (doc, key) in PROM_COUNTERS.items():
                c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                for e, v in per_engine_labelvalues.items():
                    self.counters[(e, key)] = c.labels(*v)
            g = self._gauge_cls(name="kvcm_bytes_in_flight", labelnames=labelnames, multiprocess_mode="mostrecent",
                                documentation="Bytes kvcm has queued between vLLM's cache and its tiers")
            self.gauge = {e: g.labels(*v) for e, v in per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            d = transfer_stats_data
            for t in TIERS:
                n = d.get(f"hit_blocks_{t}", 0)
                if n:
                    self.hits[(engine_idx, t)].inc(n)
            for _, key in PROM_COUNTERS.values():
                n = d.get(key, 0)
                if n:
                    self.counters[(engine_idx, key)].inc(n)
            self.gauge[engine_idx].set(max(d.get("bytes_in_flight", 0), d.get("sched_bytes_in_flight", 0)))
