"""Prometheus metrics of a manager (issue 22): what ``KVCacheManager.stats()`` counts, where
operators look.  Needs the ``metrics`` extra (``pip install kvcm[metrics]``: prometheus-client).

One call registers a collector and (optionally) serves it::

    from kvcm import metrics
    server = metrics.serve(mgr, port=8000)            # http://127.0.0.1:8000/metrics
    # or: metrics.register(mgr)  on prometheus_client's default registry, served by the engine

The collector reads ``stats()`` (one call, under the manager's lock) at every scrape: no
thread, no state of its own, nothing the manager does changes.  Names follow vLLM's
(``vllm:prefix_cache_queries`` ...) with the ``kvcm:`` prefix; counters get prometheus'
``_total`` suffix.  The contract (names, types, labels, help texts) is in DECISIONS.md
"Metrics (issue 22)"; :data:`METRICS` is its table.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Self

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import REGISTRY, Collector

PREFIX = "kvcm:"
DEFAULT_ADDR = "127.0.0.1"  # never every interface unless asked for

# (name without prefix, type, labels, help): the documented set, in exposition order
METRICS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("prefix_cache_queries", "counter", (),
     "Prefix cache queries, in terms of number of queried tokens (create_kv_cache input tokens)."),
    ("prefix_cache_hits", "counter", (),
     "Prefix cache hits, in terms of number of cached tokens (tokens reused by create_kv_cache)."),
    ("prefix_cache_requests", "counter", (), "Requests matched against the prefix cache (create_kv_cache calls)."),
    ("kv_cache_usage_perc", "gauge", ("tier", "lc"),
     "KV-cache usage of one pool: used slots / total slots. 1 means 100 percent usage."),
    ("kv_cache_slots", "gauge", ("tier", "lc", "state"),
     ("Slots of one pool by state: total, free, locked (active requests), held (suspended requests), "
     "droppable (reusable, owned by the prefix tree only).")),
    ("quota_bytes", "gauge", ("tier",), "The tier's quota in bytes (set_quota changes it)."),
    ("evictions", "counter", ("lc",),
     "Pages evicted or dropped: offloads (moved one tier colder to make room) plus drops."),
    ("offloads", "counter", ("lc",), "Pages moved one tier colder by eviction."),
    ("onboards", "counter", ("lc",), "Pages copied back to gpu for a request (from host, disk or the shared tier)."),
    ("drops", "counter", ("lc",), "Reusable pages dropped (eviction from the coldest tier, clear_reusable, pruning)."),
    ("copy_ops", "counter", ("lc", "reason"),
     "Copy ops issued to the data plane, by reason: offload, onboard, cow, snapshot, store, relocate."),
    ("copy_bytes", "counter", ("lc", "reason"), "Bytes of the offload, onboard and store copy ops."),
    ("lost_pages", "counter", ("lc",), "Pages forgotten because their copy failed (forget_copies)."),
    ("snapshots_skipped", "counter", ("lc",), "SSM snapshots skipped for want of a slot."),
    ("pending_copy_ops", "gauge", (), "Copy ops issued and not drained yet."),
    ("event_buffer_drops", "counter", (), "KV events dropped because the manager's event buffer was full."),
    ("publisher_drops", "counter", (),
     "Engine steps whose KV events the publisher dropped (queue full; healed by a reset batch)."),
)

# copy op reason -> (stats counter, bytes counter or None)
_REASONS = {
    "offload": ("offloads", "offload_bytes"),
    "onboard": ("onboards", "onboard_bytes"),
    "cow": ("cows", None),
    "snapshot": ("snapshots_taken", None),
    "store": ("shared_stores", "shared_store_bytes"),
    "relocate": ("relocations", None),
}
_STATES = ("total", "free", "locked", "held", "droppable")


class ManagerCollector(Collector):
    """The metrics of one manager (and optionally its event publisher), read from
    ``stats()`` at each scrape.  ``labels``: constant labels on every sample (e.g.
    ``{"model_name": ...}``, as vLLM labels its metrics).  ``publisher``: an object with a
    ``dropped`` count (:class:`kvcm.fleet.publisher.EventPublisher`); without one the publisher
    drops read 0."""

    def __init__(self, manager: Any, *, publisher: Any = None, labels: Mapping[str, str] | None = None) -> None:
        self.manager = manager
        self.publisher = publisher
        self.labels = dict(labels or {})
        clash = set(self.labels) & {lb for _, _, lbs, _ in METRICS for lb in lbs}
        if clash:
            raise ValueError(f"labels {sorted(clash)} are kvcm's own metric labels")

    def describe(self) -> Iterator[Metric]:
        """The families with no samples (registering a collector never calls ``stats()``)."""
        for name, kind, labels, doc in METRICS:
            yield self._family(name, kind, labels, doc)

    def _family(self, name: str, kind: str, labels: tuple[str, ...], doc: str) -> Metric:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        return cls(PREFIX + name, doc, labels=[*self.labels, *labels])

    def collect(self) -> Iterator[Metric]:
        stats = self.manager.stats()
        fams = {name: self._family(name, kind, labels, doc) for name, kind, labels, doc in METRICS}
        const = list(self.labels.values())

        def add(name: str, value: float, *labels: str) -> None:
            fams[name].add_metric([*const, *labels], value)

        add("prefix_cache_queries", stats["query_tokens"])
        add("prefix_cache_hits", stats["reused_tokens"])
        add("prefix_cache_requests", stats["requests"])
        for tier in stats["tiers"]:
            kind = tier["kind"]
            add("quota_bytes", tier.get("quota_bytes", 0), kind)
            for lc, pool in enumerate(tier["lc"]):
                total = pool["total"]
                add("kv_cache_usage_perc", (total - pool["free"]) / total if total else 0.0, kind, str(lc))
                for state in _STATES:
                    add("kv_cache_slots", pool[state], kind, str(lc), state)
        for lc, c in enumerate(stats["lc"]):
            lcs = str(lc)
            add("offloads", c["offloads"], lcs)
            add("onboards", c["onboards"], lcs)
            add("drops", c["drops"], lcs)
            add("evictions", c["offloads"] + c["drops"], lcs)
            add("lost_pages", c["lost_pages"], lcs)
            add("snapshots_skipped", c["snapshots_skipped"], lcs)
            for reason, (count, nbytes) in _REASONS.items():
                add("copy_ops", c.get(count, 0), lcs, reason)
                if nbytes is not None:
                    add("copy_bytes", c.get(nbytes, 0), lcs, reason)
        add("pending_copy_ops", stats["pending_copy_ops"])
        add("event_buffer_drops", stats["events_dropped"])
        add("publisher_drops", getattr(self.publisher, "dropped", 0) if self.publisher is not None else 0)
        yield from fams.values()


def register(manager: Any, registry: CollectorRegistry | None = None, *, publisher: Any = None,
             labels: Mapping[str, str] | None = None) -> ManagerCollector:
    """Register a :class:`ManagerCollector` of ``manager`` on ``registry`` (default:
    prometheus_client's global one, which an engine's ``/metrics`` already serves)."""
    collector = ManagerCollector(manager, publisher=publisher, labels=labels)
    (REGISTRY if registry is None else registry).register(collector)
    return collector


class MetricsServer:
    """An HTTP server of one registry's ``/metrics`` on a daemon thread (:func:`serve`)."""

    def __init__(self, registry: CollectorRegistry, collector: ManagerCollector, port: int, addr: str) -> None:
        self.registry = registry
        self.collector = collector
        self._httpd, self._thread = start_http_server(port, addr=addr, registry=registry)
        self.addr = addr
        self.port = int(self._httpd.server_address[1])  # the bound port (port 0: an ephemeral one)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(manager: Any, port: int, addr: str = DEFAULT_ADDR, *, publisher: Any = None,
          labels: Mapping[str, str] | None = None, registry: CollectorRegistry | None = None) -> MetricsServer:
    """Register ``manager``'s collector (on a registry of its own unless one is given) and
    serve it at ``http://addr:port/metrics`` (``addr`` 127.0.0.1 by default: never every
    interface unless asked for; ``port`` 0 picks a free one, see ``.port``)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    registry = CollectorRegistry() if registry is None else registry
    collector = register(manager, registry, publisher=publisher, labels=labels)
    return MetricsServer(registry, collector, port, addr)


__all__ = ["DEFAULT_ADDR", "METRICS", "PREFIX", "ManagerCollector", "MetricsServer", "register", "serve"]
