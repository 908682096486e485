"""The fleet replay (kvcm.tools.fleet_replay, ``python -m kvcm replay --instances N --shared-tier ...``):
a tiny smoke run on each store; the full N = 2, 4, 8 table is a manual run (README)."""

from __future__ import annotations

import pytest
from kvcm.cli import main
from kvcm.tools.fleet_replay import run_fleet
from kvcm.tools.trace import load_trace, total_blocks

LIMIT = 60  # the shipped trace's first requests: some reuse across instances
B = 512
PAGE = 1024


@pytest.fixture(scope="module")
def trace():
    return load_trace(limit=LIMIT)


@pytest.fixture(params=["file", "mooncake"])
def location(request, tmp_path) -> str:
    if request.param == "file":
        return str(tmp_path / "store")
    return request.getfixturevalue("mooncake").url


def fleet(trace, n, shared, backend, namespace, gpu_blocks=300, shared_write="commit"):
    return run_fleet(trace, n, shared=shared, backend=backend, tokens_per_block=B, page_bytes=PAGE,
                     gpu_blocks=gpu_blocks, namespace=namespace, shared_write=shared_write)


def test_shared_tier_raises_the_hit_rate_of_a_round_robin_fleet(trace, location, backend, request):
    ns = request.node.nodeid
    local = fleet(trace, 2, None, backend, ns)
    shared = fleet(trace, 2, location, backend, ns)
    # one instance that sees every request and forgets nothing: the most there is to reuse
    single = fleet(trace, 1, None, backend, ns, gpu_blocks=total_blocks(trace, B) + 1)
    assert local.requests == shared.requests == LIMIT and local.prompt_tokens == shared.prompt_tokens
    assert local.hit_rate < shared.hit_rate <= single.hit_rate
    p = shared.plane
    assert shared.shared_hit_blocks > 0 and p["loads"] > 0 and p["stores"] > 0
    assert p["load_bytes"] == p["loads"] * PAGE and p["store_bytes"] == p["stores"] * PAGE
    assert p["load_failures"] == p["store_failures"] == 0 and 0 < p["lookups"] <= LIMIT
    # a second shared fleet on the same store finds everything the first one wrote
    again = fleet(trace, 2, location, backend, ns)
    assert again.hit_rate > shared.hit_rate
    # write-back: only what the small gpu tiers evict reaches the store
    evict = fleet(trace, 2, location, backend, ns + "/evict", shared_write="evict")
    assert 0 < evict.plane["stores"] < shared.plane["stores"] and evict.mode == "evict"
    assert local.hit_rate <= evict.hit_rate <= shared.hit_rate


def test_cli_fleet_replay(tmp_path, capsys, backend):
    png = tmp_path / "fleet.png"
    rc = main(["replay", "--limit", "12", "--instances", "1,2", "--shared-tier", f"file:{tmp_path / 'store'}",
               "--page-bytes", str(PAGE), "--backend", backend, "--plot", str(png), "--shared-write", "commit,evict"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "raw file in the same run" in out
    rows = [line.split() for line in out.splitlines() if line[:2] in ("1 ", "2 ")]
    assert [(r[0], r[1]) for r in rows] == [(n, t) for n in "12" for t in ("local", "shared:commit", "shared:evict")]
    assert png.stat().st_size > 0


def test_cli_fleet_replay_bad_usage(capsys):
    assert main(["replay", "--limit", "5", "--instances", "2"]) == 2
    assert "needs both" in capsys.readouterr().err
    assert main(["replay", "--limit", "5", "--instances", "2", "--shared-tier", "/tmp/x",
                 "--backend", "python,cpp"]) == 2
