"""kvcm's numbers in vLLM's own observability: ``KVConnectorStats`` (vLLM sums the workers'
and the scheduler's objects, logs ``reduce()`` as its periodic "KV Transfer metrics:" line)
and ``KVConnectorPromMetrics`` (``kvcm:*`` Prometheus metrics per engine).

One naming, wherever a user reads it (DECISIONS.md "vLLM connector: one name, one unit"): the
``kvcm:`` prefix of kvcm's own metrics (:mod:`kvcm.metrics`, after vLLM's ``vllm:``); the
stats line's keys are the ``/metrics`` names without the counters' ``_total`` (``kvcm:hit_blocks``
with ``tier="host|disk|shared"``, ``kvcm:loaded_bytes`` ...); sizes in bytes in both;
``kvcm:bytes_in_flight`` in both is the same gauge: the bytes the scheduler side has planned
(saves, loads, kvcm's own copies) and not seen done by every rank, its LATEST value (the
line: at the interval's last report; ``/metrics``: now).  kvcm's tier 0 is "host" here.

The data is a flat dict of ints (it crosses processes; its keys are unchanged since issue 18):
counters since the last report -- ``hit_blocks_host`` / ``hit_blocks_disk`` /
``hit_blocks_shared`` (blocks DELIVERED into vLLM's cache, by where kvcm had them),
``loaded_blocks``, ``load_error_blocks`` (promised blocks vLLM recomputes), ``saved_blocks``
(saves confirmed by every rank), ``save_failed_blocks``, ``saves_deferred`` (blocks past the
in-flight bound), ``failed_ops``, ``rollbacks``, ``preemptions``, ``holds`` (scheduler side,
counted once for all ranks); ``loaded_bytes``, ``saved_bytes``, ``run_bytes`` (worker side:
each rank its shard, summed) -- and the gauges ``sched_bytes_in_flight`` (the scheduler's,
reported whenever it changed; the newest report wins) and ``bytes_in_flight`` (a worker's
queue, the maximum over ranks; in the stats file, not shown).

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
LATEST = "sched_bytes_in_flight"  # the gauge users read (kvcm:bytes_in_flight): the newest report wins
TIERS = ("host", "disk", "shared")
PREFIX = "kvcm:"  # kvcm.metrics.PREFIX (not imported: that module needs prometheus_client at import)


def hit_key(tier: str) -> str:
    """The stats line's key of one tier's hits: the /metrics series' name and label."""
    return f'{PREFIX}hit_blocks{{tier="{tier}"}}'


@dataclass
class KvcmConnectorStats(KVConnectorStats):
    """kvcm's interval stats (module doc)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvcmConnectorStats:
        # vLLM aggregates the newer object into the older (a step's workers' into ..., the
        # scheduler's into the step's, each step's into the interval's): ``other`` is the newer
        for k, v in (other.data or {}).items():
            if k == LATEST:
                self.data[k] = v
            elif k in GAUGES:
                self.data[k] = max(self.data.get(k, 0), v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {f"{PREFIX}hit_blocks": sum(d.get(f"hit_blocks_{t}", 0) for t in TIERS)}
        out.update({hit_key(t): d.get(f"hit_blocks_{t}", 0) for t in TIERS})
        for name, (_, key) in PROM_COUNTERS.items():
            out[name] = d.get(key, 0)
        if LATEST in d:
            out[f"{PREFIX}bytes_in_flight"] = d[LATEST]
        return out

    def is_empty(self) -> bool:
        # a report of the gauge alone (it changed: e.g. back to 0 once the saves are done) is
        # logged and observed too, so the line and /metrics end on the same value
        return not any(v for k, v in self.data.items() if k not in GAUGES) and LATEST not in self.data


# name -> (documentation, data key); hits carry a "tier" label
PROM_COUNTERS = {
    "kvcm:loaded_blocks": ("Blocks kvcm loaded into vLLM's KV cache", "loaded_blocks"),
    "kvcm:load_error_blocks": ("Blocks kvcm promised but could not load (vLLM recomputed them)", "load_error_blocks"),
    "kvcm:saved_blocks": ("Blocks saved from vLLM's KV cache into kvcm (confirmed by every rank)", "saved_blocks"),
    "kvcm:loaded_bytes": ("Bytes kvcm copied into vLLM's KV cache (all ranks)", "loaded_bytes"),
    "kvcm:saved_bytes": ("Bytes kvcm copied out of vLLM's KV cache (all ranks)", "saved_bytes"),
    # disaggregated prefill and decode (kvcm.integrations.vllm.handover)
    "kvcm:handover_announced": ("Hand-overs a producer announced (kv_transfer_params returned)", "handover_announced"),
    "kvcm:handover_accepted": ("Hand-over params a consumer accepted", "handover_accepted"),
    "kvcm:handover_rejected": ("Hand-over params a consumer rejected (forged, stale, malformed): nothing loaded",
                               "handover_rejected"),
    "kvcm:handover_deadlines": ("Hand-overs whose objects were not all there by the deadline (the rest computed)",
                                "handover_deadlines"),
}


if KVConnectorPromMetrics is not None:

    class KvcmPromMetrics(KVConnectorPromMetrics):
        """``kvcm:hit_blocks{tier=host|disk|shared}``, the counters of :data:`PROM_COUNTERS`
        (prometheus adds ``_total``) and the gauge ``kvcm:bytes_in_flight``, one labelled
        child per engine."""

        def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            hits = self._counter_cls(name=f"{PREFIX}hit_blocks", labelnames=[*labelnames, "tier"],
                                     documentation="Blocks kvcm delivered into vLLM's KV cache, by the tier they came from")
            self.hits = {(e, t): hits.labels(*v, t) for e, v in per_engine_labelvalues.items() for t in TIERS}
            self.counters: dict[tuple[int, str], Any] = {}
            for name, (doc, key) in PROM_COUNTERS.items():
                c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                for e, v in per_engine_labelvalues.items():
                    self.counters[(e, key)] = c.labels(*v)
            g = self._gauge_cls(name=f"{PREFIX}bytes_in_flight", labelnames=labelnames, multiprocess_mode="mostrecent",
                                documentation="Bytes kvcm has planned between vLLM's cache and its tiers and not "
                                "seen done by every rank")
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
            if LATEST in d:
                self.gauge[engine_idx].set(d[LATEST])
