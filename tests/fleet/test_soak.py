"""The fleet soak (issue 18 "Done means"): requests through publishers + subscriber + router
+ a file store (``kvcm.tools.soak``): RSS, threads, fds, store bytes and router blocks stay flat
after the warm-up, and the router is exact against ``probe_reuse`` throughout.

CI profile: 3000 requests over 2 instances (well under a minute per backend).  The long
profile: ``KVCM_SOAK_REQUESTS=100000`` (or ``python -m kvcm.tools.soak --requests 100000``).
Runs on the env-selected backend (each CI leg: python, cpp); real sockets on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import os

import pytest
from kvcm.fleet.router_index import InstanceIndex
from kvcm.tools.soak import Sample, SoakMismatch, SoakProfile, SoakResult, flat_violations, run_soak

REQUESTS = int(os.environ.get("KVCM_SOAK_REQUESTS", "3000"))


def test_fleet_soak_is_flat_and_the_router_exact(backend: str) -> None:
    profile = SoakProfile(requests=REQUESTS, checkpoints=8 if REQUESTS <= 10_000 else 20)
    res = run_soak(profile, backend=backend)
    assert res.backend == backend
    assert not flat_violations(res), flat_violations(res)
    # every check_every requests, every instance was compared (run_soak raises on a mismatch)
    assert res.exact_checks == profile.instances * ((profile.requests - 1) // profile.check_every)
    first, last = res.samples[0], res.samples[-1]
    assert len(res.samples) == profile.checkpoints + 1 and last.requests == profile.requests
    # preconditions: the soak moved what it claims to (the store written, trimmed and read,
    # the router fed) and nothing was lost on the way
    assert res.planes["stores"] > 0 and res.planes["loads"] > 0 and res.shared_hit_blocks > 0
    assert res.planes["store_failures"] == res.planes["load_failures"] == res.planes["timeouts"] == 0
    assert first.store_objects > 0 and last.router_blocks > 0 and res.reused_tokens > 0
    sub = res.subscriber
    assert sub["malformed"] == sub["dropped"] == sub["restarts"] == 0
    assert sub["applied"] == sum(p["published"] for p in res.publishers)
    assert all(p["dropped"] == p["resets"] == 0 for p in res.publishers)


def synthetic(samples: list[tuple[int, int, int, int, int]]) -> SoakResult:
    """A result with these (rss, threads, fds, store bytes, router blocks) samples."""
    res = SoakResult(dataclasses.asdict(SoakProfile()), "python")
    res.samples = [Sample(i, rss, th, fd, sb, 1, rb, 0.0) for i, (rss, th, fd, sb, rb) in enumerate(samples)]
    return res


@pytest.mark.parametrize("grow", ["rss", "threads", "fds", "store", "router"])
def test_flat_violations_catches_each_kind_of_growth(grow: str) -> None:
    """The flatness check itself can fail: one thing grows past its bound, the rest flat."""
    p = SoakProfile()
    base = (100 << 20, 6, 30, p.store_quota_bytes // 2, 300)
    grown = {"rss": (base[0] + (17 << 20), *base[1:]), "threads": (base[0], 9, *base[2:]),
             "fds": (*base[:2], 31, *base[3:]), "store": (*base[:3], int(p.store_quota_bytes * 1.3), base[4]),
             "router": (*base[:4], 400)}[grow]
    assert flat_violations(synthetic([base] * 5)) == []
    bad = flat_violations(synthetic([base] * 4 + [grown]))
    assert len(bad) == 1 and bad[0].startswith({"store": "store", "router": "router"}.get(grow, grow)), bad


def test_soak_catches_an_inexact_router(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exactness check can fail: a router that never forgets a removed page answers more
    than the instance can reuse once blocks are evicted, and the soak stops at once."""
    monkeypatch.setattr(InstanceIndex, "_remove", lambda self, key, group, medium: None)
    with pytest.raises(SoakMismatch, match="router .* != reference"):
        run_soak(SoakProfile(requests=600, check_every=3, checkpoints=1), backend=backend)
