"""The README's vLLM server walk-through (issue 37), run by bash as written: its
``make-model``, ``config`` + ``check-config`` + server, and request blocks (marked
``<!-- shell: NAME -->``, tests/readme_examples.py), with only ``/tmp/kvcm`` (a temporary
directory here) and the port (a free one) replaced.  One engine start.

What it proves: the server starts with kvcm and says so in one line; the working set
(six documents, 42 blocks) exceeds vLLM's own cache (32 blocks), so the second round is
served by kvcm's host tier -- hits > 0 on ``/metrics`` and in vLLM's stats lines, the same
numbers in both (one naming, one unit), the in-flight gauge back to 0 in both; and the
README's expected output names the series the server really exposes.

Runs in the vllm leg (``KVCM_VLLM_TESTS=1``, ci/matrix.sh); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from children import child_env

if os.environ.get("KVCM_VLLM_TESTS") != "1":
    pytest.skip("the vLLM walk-through runs in the vllm leg (KVCM_VLLM_TESTS=1)", allow_module_level=True)

CHILD_TIMEOUT_S = int(os.environ.get("KVCM_VLLM_CHILD_TIMEOUT_S", "900"))
README_ROOT, README_PORT = "/tmp/kvcm", "8000"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bash_env() -> dict[str, str]:
    env = child_env()  # as in an activated virtualenv: `python` is this one
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the README's --kv-cache-memory-bytes
    return env


def expected_output(readme: str) -> str:
    """The plain block right after the requests block: what the README says it prints."""
    after = readme[readme.index("<!-- shell: vllm-requests -->"):]
    return re.findall(r"\n```\n(kvcm:.*?)```", after, re.DOTALL)[0]


def series(lines: str, model: str) -> dict[str, float]:
    out = {}
    for line in lines.splitlines():
        if line.startswith("kvcm:"):
            name, value = line.rsplit(" ", 1)
            out[name.replace(model, "MODEL")] = float(value)
    return out


def test_readme_walkthrough_shows_kvcm_serving_hits(tmp_path: Path) -> None:
    from readme_examples import README, SHELL

    root, port = str(tmp_path / "kvcm"), str(free_port())

    def as_here(script: str) -> str:
        assert README_ROOT in script or "vllm-requests" not in script
        return script.replace(README_ROOT, root).replace(README_PORT, port)

    env = bash_env()
    made = subprocess.run(["bash", "-c", as_here(SHELL["vllm-model"])], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    model = f"{root}/model"
    assert made.returncode == 0 and made.stdout.strip() == model, made
    assert os.path.isfile(f"{model}/config.json") and os.path.isfile(f"{model}/tokenizer.json")
    assert os.stat(model).st_mode & 0o777 == 0o700 and {os.stat(f"{model}/{n}").st_mode & 0o777
                                                        for n in os.listdir(model)} == {0o600}

    log = tmp_path / "serve.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        server = subprocess.Popen(["bash", "-c", as_here(SHELL["vllm-serve"])], stdout=f, stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)
    try:
        requests = subprocess.run(["bash", "-c", as_here(SHELL["vllm-requests"])], env=env, capture_output=True,
                                  text=True, timeout=CHILD_TIMEOUT_S, check=False)
        assert server.poll() is None, log.read_text()[-8000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    took = time.monotonic() - t0
    text = log.read_text()
    print(requests.stdout)  # with -s: what the README's expected output shows
    print("\n".join(ln for ln in text.splitlines() if "KV Transfer metrics:" in ln or "External prefix" in ln))
    assert requests.returncode == 0, (requests.stdout, requests.stderr, text[-8000:])

    # check-config, with the model: the backend it resolves to and the sizes against vLLM's block
    first = text.splitlines()[0]
    assert first.startswith("ok: backend cpp; host 256.0 MiB; disk 1.0 GiB at ") and (
        "vLLM block 32 tokens = 32.0 KiB per kvcm page (2 layers, bfloat16), host 8192 blocks" in first), text[:2000]
    starts = [ln for ln in text.splitlines() if "kvcm connector: backend" in ln]
    assert len(starts) == 1 and "vLLM's KV cache 32 blocks" in starts[0] and "host 256.0 MiB = 8192 blocks" in starts[0]
    assert ":bfloat16:B32" in starts[0], starts  # what check-config assumed
    assert "kvcm connector: kv_connector_extra_config[" not in text and "kvcm: " not in text.replace(starts[0], "")
    assert "Attempted to load weight" not in text  # the model is saved in the dtype vLLM runs

    # /metrics: kvcm served hits from its host tier, and nothing is left in flight
    got = series(requests.stdout, model)
    host = got['kvcm:hit_blocks_total{engine="0",model_name="MODEL",tier="host"}']
    assert host > 0 and got['kvcm:saved_blocks_total{engine="0",model_name="MODEL"}'] > 0, requests.stdout
    assert got['kvcm:bytes_in_flight{engine="0",model_name="MODEL"}'] == 0, requests.stdout
    # the README's expected output names exactly the series the server exposes
    want = series(expected_output(README.read_text()), "/tmp/kvcm/model")
    assert set(want) == set(got), (sorted(want), sorted(got))

    # vLLM's stats lines: the same hits as /metrics, under the same names; its external hit rate
    lines = [ln for ln in text.splitlines() if "KV Transfer metrics:" in ln]
    line_hits = sum(int(n) for ln in lines for n in re.findall(r"kvcm:hit_blocks=(\d+)", ln))
    line_host = sum(int(n) for ln in lines for n in re.findall(r'kvcm:hit_blocks\{tier="host"\}=(\d+)', ln))
    assert line_hits == line_host == host, (lines, got)
    inflight = [int(n) for ln in lines for n in re.findall(r"kvcm:bytes_in_flight=(\d+)", ln)]
    assert inflight and inflight[-1] == 0, lines
    rates = [float(r) for r in re.findall(r"External prefix cache hit rate: ([\d.]+)%", text)]
    assert rates and max(rates) > 0, text[-6000:]
    # the store's layout record, written by the engine with its real layout: a later start with
    # another block size is told (tests/engines/test_vllm_startup.py: the warning itself)
    from kvcm.integrations.vllm.layouts import LAYOUTS_DIR, check_and_record

    folder = Path(root) / "shared" / LAYOUTS_DIR
    records = list(folder.iterdir())
    assert len(records) == 1 and records[0].stat().st_mode & 0o777 == 0o600, records
    assert folder.stat().st_mode & 0o777 == 0o700
    (describe, mine), = json.loads(records[0].read_text()).items()
    assert describe.endswith(":bfloat16:B32") and mine["block_size"] == 32 and mine["dtype"] == ["bfloat16"], mine
    b16 = {**mine, "block_size": 16, "describe": describe.replace(":B32", ":B16")}
    warning = check_and_record(str(Path(root) / "shared"), records[0].stem, b16)
    assert warning is not None and "block size 32 (this instance: 16)" in warning and "--block-size 32" in warning
    print(f"walk-through: {took:.0f} s for the server's start, 12 requests and its stop; kvcm host hits {host:.0f}; "
          f"load {os.getloadavg()[0]:.1f}")
