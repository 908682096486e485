"""Below the whole-block floor on the real engine (``partial_tail``,
kvcm.integrations.vllm.partial): vLLM 0.32 (CPU build) with kvcm answering hits that end
inside a block.  Three engines share one module fixture: vLLM alone (the reference outputs),
kvcm with whole blocks only, kvcm with ``partial_tail``; the chat workload of
tests/engines/test_vllm_connector.py, all of a turn together, then one request at a time.

Runs in the vLLM leg only (``KVCM_VLLM_TESTS=1``); the protocol is tested without an engine in
tests/engines/test_vllm_partial.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from children import child_env

if os.environ.get("KVCM_VLLM_TESTS") != "1":
    pytest.skip("the vLLM connector tests run in the vllm leg (KVCM_VLLM_TESTS=1)", allow_module_level=True)

BLOCK = 32
GPU_BLOCKS = 16
PAGE = BLOCK * 2 * 2 * 64 * 2 * 4  # a kvcm page: one block of both layers (fp32)
WORKLOAD = {"conversations": 6, "turns": 3, "system_len": 100, "user_len": 60, "seed": 7}
PHASES = [{"name": "together"}, {"name": "one-at-a-time", "reset": True, "workload": {"batch": 1, "seed": 8}}]
CHILD_TIMEOUT_S = int(os.environ.get("KVCM_VLLM_CHILD_TIMEOUT_S", "900"))


def run_engine(tmp: str, model: str, name: str, connector: dict | None) -> dict:
    spec = {"model": model, "gpu_blocks": GPU_BLOCKS, "block_size": BLOCK, "max_tokens": 8, "max_num_seqs": 5,
            "workload": WORKLOAD, "connector": connector, "phases": PHASES}
    spec_path, out_path = os.path.join(tmp, f"{name}.spec.json"), os.path.join(tmp, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    p = subprocess.run([sys.executable, "-m", "kvcm.bench.vllm_workload", spec_path, out_path],
                       env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=CHILD_TIMEOUT_S, check=False)
    if p.returncode != 0:
        raise AssertionError(f"engine {name} failed ({p.returncode}):\n{p.stdout[-12000:]}")
    with open(out_path) as f:
        return json.load(f)


def connector(tmp: str, name: str, **extra) -> dict:
    return {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "backend": "cpp", "host_bytes": 24 * PAGE, "disk_path": os.path.join(tmp, f"{name}-disk"),
                "disk_bytes": 96 * PAGE, "stats_file": os.path.join(tmp, f"{name}.stats.json"), **extra}}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from kvcm.bench.vllm_workload import make_model

    tmp = str(tmp_path_factory.mktemp("vllm-partial"))
    model = make_model(os.path.join(tmp, "model"))
    return {"baseline": run_engine(tmp, model, "baseline", None),
            "whole": run_engine(tmp, model, "whole", connector(tmp, "whole")),
            "partial": run_engine(tmp, model, "partial", connector(tmp, "partial", partial_tail=True))}


def phase(result: dict, name: str) -> dict:
    return next(p for p in result["phases"] if p["name"] == name)


def delta(p: dict, key: str) -> int:
    return p["stats"]["counters"].get(key, 0) - ((p["stats_before"] or {}).get("counters", {}).get(key, 0))


@pytest.mark.parametrize("name", [ph["name"] for ph in PHASES])
def test_partial_tail_is_exact_and_goes_below_the_whole_block_floor(engines: dict, name: str) -> None:
    """Greedy outputs equal vLLM alone's with hits ending inside a block (and kvcm's whole
    blocks only); the tokens kvcm answered inside blocks and the tails it saved are counted;
    one request at a time, the partial run computes fewer prefill tokens than the
    whole-block floor (and than kvcm with whole blocks), never fewer than the partial floor."""
    base, whole, part = (phase(engines[k], name) for k in ("baseline", "whole", "partial"))
    assert part["outputs"] == base["outputs"] and whole["outputs"] == base["outputs"]
    hits, tail = delta(part, "partial_hit_tokens"), delta(part, "partial_tail_tokens")
    assert delta(part, "partial_hits") > 0 and hits > 0 and tail > 0, part["stats"]["counters"]
    assert delta(whole, "partial_hits") == 0
    assert delta(part, "load_error_blocks") == 0 and delta(part, "save_failed_blocks") == 0
    p_whole, p_part = sum(whole["prefill"]), sum(part["prefill"])
    floor, pfloor = part["floor_prefill_tokens"], part["partial_floor_prefill_tokens"]
    for k, r in (("whole", whole), ("partial", part)):
        print(f"\n{name} {k}: prefill {r['prefill']}\n", {c: delta(r, c) for c in sorted(r["stats"]["counters"])
                                                         if delta(r, c) and not c.startswith("probe")})
    print(f"\n{name}: prefill tokens vllm={sum(base['prefill'])} kvcm-whole={p_whole} kvcm-partial={p_part} "
          f"whole-block floor={floor} partial floor={pfloor} partial hit tokens={hits} tail tokens saved={tail}")
    assert pfloor <= p_part
    if name == "one-at-a-time":
        # each turn's requests one at a time: every saved tail is in kvcm before the next
        # turn asks, and kvcm goes below the whole-block floor (together, tier 0's 24 pages
        # hold the live batch's blocks too: how many tails and blocks are kept depends on
        # the order of saves and admissions, so only exactness and the counters are asserted)
        assert p_part < floor and p_part < p_whole
        assert p_part == pfloor, "every turn's tail was kept: the next turn computes only past it"
    assert not any(part["stats"]["pending"].values()), part["stats"]["pending"]
