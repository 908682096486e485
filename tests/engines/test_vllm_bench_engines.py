"""``python -m kvcm bench vllm --quick`` on real vLLM engines (the vllm leg, ``KVCM_VLLM_TESTS=1``):
vLLM alone and vLLM + kvcm host + disk, tiny sizes.  It checks the bench runs end to end on
today's connector and engine (one core layout logged by both engines, outputs exact, kvcm's
hits read from its stats file, the JSON and the plot written); no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from children import child_env

if os.environ.get("KVCM_VLLM_TESTS") != "1":
    pytest.skip("bench vllm runs real engines in the vllm leg (KVCM_VLLM_TESTS=1)", allow_module_level=True)


def test_quick_bench_runs_both_engines_on_one_core_layout(tmp_path) -> None:
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    p = subprocess.run([sys.executable, "-m", "kvcm", "bench", "vllm", "--quick", "--configs", "vllm,host+disk",
                        "--warmup", "1", "--json", str(js), "--plot", str(png), "--timeout", "600"],
                       env=child_env(), capture_output=True, text=True, timeout=1300, check=False)
    assert p.returncode == 0, p.stdout + p.stderr[-6000:]
    report = json.loads(js.read_text())
    vllm, kvcm = report["rows"]
    assert len(report["layouts"]) == 1 and report["layouts"][0].startswith("reserve_cpu_num=1,"), report["layouts"]
    assert "every engine logged: reserve_cpu_num=1" in p.stdout
    assert vllm["exact"] is None and kvcm["exact"] and kvcm["requests"] == vllm["requests"] == report["requests"]
    assert vllm["hits"] is None and sum(kvcm["hits"].values()) > 0, kvcm["hits"]
    assert report["floor_prefill_tokens"] <= kvcm["prefill_tokens"] <= vllm["prefill_tokens"]
    assert vllm["decode_ms_p50"] > 0 and kvcm["ttft_p50_ms"] > 0
    assert png.stat().st_size > 0
