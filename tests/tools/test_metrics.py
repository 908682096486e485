"""kvcm.metrics (issue 22): the Prometheus collector over stats(), scraped over HTTP and read
back with Prometheus' own text parser (DECISIONS.md "Metrics (issue 22)")."""

from __future__ import annotations

import types
import urllib.request

import kvcm
import pytest
from kvcm import AttentionLayer, KVCacheManagerConfig, Tier, metrics
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import REGISTRY

B = 4
SLOT = B * 2


def _cfg(**kw) -> KVCacheManagerConfig:
    return KVCacheManagerConfig(tokens_per_block=B, layers=[AttentionLayer(0, 2)],
                                tiers=[Tier("gpu", 2 * SLOT), Tier("host", 2 * SLOT)], **kw)


def _block(mgr, base: int, close: bool = True):
    kv = mgr.create_kv_cache(list(range(base, base + B)))
    assert kv.resume() and kv.resize(B)
    kv.commit(list(range(base + kv.num_committed_tokens, base + B)))
    if close:
        kv.close()
    return kv


def _scrape(url: str) -> dict[str, dict]:
    """{family name: {"type", "help", "samples": {(name, sorted labels): value}}}."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        out[fam.name] = {"type": fam.type, "help": fam.documentation,
                         "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}}
    return out


def _value(scraped: dict, family: str, **labels: str) -> float:
    fam = scraped[family]
    want = tuple(sorted(labels.items()))
    (value,) = [v for (name, lbs), v in fam["samples"].items() if lbs == want and not name.endswith("_created")]
    return value


def test_metrics_scraped_over_http_match_stats(backend):
    mgr = kvcm.KVCacheManager(_cfg(max_events=2), backend=backend)
    for base in (100, 200, 300):
        _block(mgr, base)  # the third evicts block 100 to host
    again = _block(mgr, 100, close=False)  # reuses block 100: onboarded from host
    assert again.num_reused_tokens == B
    ops = mgr.drain_copy_ops()
    assert mgr.forget_copies(ops[-1:])  # the onboard failed: one lost page, the cache rolls back
    again.close()
    mgr.set_quota("gpu", 1 * SLOT)  # a relocate (or offload) as well
    _block(mgr, 400)
    publisher = types.SimpleNamespace(dropped=3)  # kvcm.fleet.publisher.EventPublisher's counter
    with metrics.serve(mgr, 0, publisher=publisher, labels={"model_name": "tiny"}) as srv:
        assert srv.addr == "127.0.0.1" and srv.url.startswith("http://127.0.0.1:")
        scraped = _scrape(srv.url)
    stats = mgr.stats()
    m = {"model_name": "tiny"}
    for name, kind, _labels, doc in metrics.METRICS:  # every documented family, with its type and help
        fam = scraped["kvcm:" + name]
        assert (fam["type"], fam["help"]) == (kind, doc), name
    assert _value(scraped, "kvcm:prefix_cache_queries", **m) == stats["query_tokens"] == 5 * B
    assert _value(scraped, "kvcm:prefix_cache_hits", **m) == stats["reused_tokens"] > 0
    assert _value(scraped, "kvcm:prefix_cache_requests", **m) == stats["requests"] == 5
    lc0 = stats["lc"][0]
    for tier in stats["tiers"]:
        pool = tier["lc"][0]
        assert _value(scraped, "kvcm:kv_cache_usage_perc", tier=tier["kind"], lc="0", **m) == pytest.approx(
            (pool["total"] - pool["free"]) / pool["total"])
        for state in ("total", "free", "locked", "held", "droppable"):
            assert _value(scraped, "kvcm:kv_cache_slots", tier=tier["kind"], lc="0", state=state, **m) == pool[state]
        assert _value(scraped, "kvcm:quota_bytes", tier=tier["kind"], **m) == tier["quota_bytes"]
    assert _value(scraped, "kvcm:quota_bytes", tier="gpu", **m) == SLOT  # after set_quota
    assert _value(scraped, "kvcm:offloads", lc="0", **m) == lc0["offloads"] > 0
    assert _value(scraped, "kvcm:onboards", lc="0", **m) == lc0["onboards"] > 0
    assert _value(scraped, "kvcm:drops", lc="0", **m) == lc0["drops"]
    assert _value(scraped, "kvcm:evictions", lc="0", **m) == lc0["offloads"] + lc0["drops"]
    for reason, counter in (("offload", "offloads"), ("onboard", "onboards"), ("cow", "cows"),
                            ("snapshot", "snapshots_taken"), ("store", "shared_stores"), ("relocate", "relocations")):
        assert _value(scraped, "kvcm:copy_ops", lc="0", reason=reason, **m) == lc0[counter], reason
    assert _value(scraped, "kvcm:copy_bytes", lc="0", reason="offload", **m) == lc0["offload_bytes"] > 0
    assert _value(scraped, "kvcm:lost_pages", lc="0", **m) == lc0["lost_pages"] == 1
    assert _value(scraped, "kvcm:pending_copy_ops", **m) == stats["pending_copy_ops"] > 0
    assert _value(scraped, "kvcm:event_buffer_drops", **m) == stats["events_dropped"] > 0
    assert _value(scraped, "kvcm:publisher_drops", **m) == 3


def test_metrics_follow_the_manager_between_scrapes(backend):
    mgr = kvcm.KVCacheManager(_cfg(), backend=backend)
    with metrics.serve(mgr, 0) as srv:
        first = _scrape(srv.url)
        assert _value(first, "kvcm:prefix_cache_requests") == 0
        assert _value(first, "kvcm:publisher_drops") == 0  # no publisher
        _block(mgr, 100)
        mgr.set_quota("host", 5 * SLOT)
        second = _scrape(srv.url)
    assert _value(second, "kvcm:prefix_cache_requests") == 1
    assert _value(second, "kvcm:quota_bytes", tier="host") == 5 * SLOT
    assert _value(second, "kvcm:kv_cache_slots", tier="host", lc="0", state="total") == 5


def test_register_on_a_registry_and_bad_arguments(backend):
    mgr = kvcm.KVCacheManager(_cfg(), backend=backend)
    reg = CollectorRegistry()
    metrics.register(mgr, reg)
    assert reg.get_sample_value("kvcm:kv_cache_slots", {"tier": "gpu", "lc": "0", "state": "total"}) == 2
    collector = metrics.register(mgr)  # the default registry, which an engine's /metrics serves
    try:
        assert REGISTRY.get_sample_value("kvcm:quota_bytes", {"tier": "host"}) == 2 * SLOT
    finally:
        REGISTRY.unregister(collector)
    with pytest.raises(ValueError, match="kvcm's own metric labels"):
        metrics.ManagerCollector(mgr, labels={"tier": "x"})
    for port in (-1, 65536, "80", 1.5, True):
        with pytest.raises(ValueError, match="port"):
            metrics.serve(mgr, port)


def test_demo_serves_and_prints_the_metrics(backend, capsys):
    from kvcm.cli.demo import main

    assert main(["--backend", backend, "--metrics-port", "0"]) == 0
    out = capsys.readouterr().out
    assert f"[{backend}] metrics live at http://127.0.0.1:" in out
    assert f'kvcm:prefix_cache_hits_total{{backend="{backend}"}}' in out
    assert 'reason="snapshot"' in out  # the demo's hybrid model takes ssm snapshots
    with pytest.raises(SystemExit) as e:
        main(["--backend", backend, "--metrics-port", "70000"])
    assert e.value.code == 2
