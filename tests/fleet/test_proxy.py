"""``python -m kvcm proxy`` (kvcm.fleet.proxy) without vLLM: the proxy and small real HTTP
backends (FastAPI apps served by uvicorn on 127.0.0.1 ephemeral ports) that answer as vLLM's
OpenAI server does in a disaggregated deployment — a prefill instance returns
``kv_transfer_params`` for a ``do_remote_decode`` request, a decode instance generates (JSON or
an event stream).  Routing (by load, and by prefix from real kvcm event publishers), streaming
pass-through, 503 and retry when a decode instance is down, timeouts, the queue bound, the
command line.  The real engines behind it run in tests/engines/test_vllm_disagg.py.

Needs the proxy extra (FastAPI, uvicorn, httpx: .ci/run installs it); with CI=true a missing
one fails rather than skips."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

try:
    import fastapi
    import httpx
    import uvicorn
except ImportError as e:  # pragma: no cover - the leg's environment
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"the proxy extra is not installed ({e.name}): pip install 'kvcm[proxy]'", allow_module_level=True)

from kvcm.fleet.proxy import ProxyConfig, make_app


class Served:
    """An ASGI app served by uvicorn on 127.0.0.1 (an ephemeral port) in a thread."""

    def __init__(self, app: Any) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


class FakeVllm:
    """What the proxy needs of a vLLM OpenAI server with kvcm's connector (module doc).
    ``delay_s``: how long each generation takes; every request received is recorded."""

    def __init__(self, name: str, role: str, delay_s: float = 0.0, fail: int = 0) -> None:
        self.name, self.role, self.delay_s, self.fail = name, role, delay_s, fail
        self.received: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        app = fastapi.FastAPI()

        async def generate(body: dict, chat: bool) -> Any:
            from fastapi.responses import JSONResponse, StreamingResponse

            self.received.append(body)
            if self.fail:
                self.fail -= 1
                return JSONResponse({"error": "engine dead"}, status_code=500)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.in_flight -= 1
            n = body.get("max_tokens") or body.get("max_completion_tokens") or 4
            words = [f"{self.name}-t{i}" for i in range(n)]
            kvp = body.get("kv_transfer_params")
            params = None
            if self.role == "prefill" and kvp and kvp.get("do_remote_decode"):
                params = {"do_remote_prefill": True, "kvcm": {"v": 1, "from": self.name}}
            if body.get("stream"):
                async def events() -> Any:
                    for w in words:
                        chunk = {"choices": [{"delta": {"content": w}} if chat else {"text": w}], "from": self.name}
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                        await asyncio.sleep(0.01)
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(events(), media_type="text/event-stream")
            choice = {"message": {"role": "assistant", "content": " ".join(words)}} if chat else {"text": " ".join(words)}
            return {"id": "x", "choices": [choice], "from": self.name, "kv_transfer_params": params,
                    "got_params": kvp}

        @app.post("/v1/completions")
        async def completions(body: dict) -> Any:
            return await generate(body, False)

        @app.post("/v1/chat/completions")
        async def chat(body: dict) -> Any:
            return await generate(body, True)

        @app.get("/health")
        async def health() -> Any:
            return {}

        @app.post("/tokenize")
        async def tokenize(body: dict) -> Any:
            return {"tokens": [ord(c) for c in body.get("prompt", "")]}

        self.served = Served(app)
        self.url = self.served.url

    def stop(self) -> None:
        self.served.stop()


def dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def made() -> Iterator[list]:
    out: list = []
    yield out
    for x in reversed(out):
        x.stop()


def start(made: list, prefill: list[str], decode: list[str], **kw: Any) -> str:
    served = Served(make_app(ProxyConfig(tuple(prefill), tuple(decode), **kw)))
    made.append(served)
    return served.url


def fake(made: list, *args: Any, **kw: Any) -> FakeVllm:
    f = FakeVllm(*args, **kw)
    made.append(f)
    return f


def post(url: str, path: str, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=timeout)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_two_legs_prefill_with_one_token_then_decode_with_its_params(made, path) -> None:
    p, d = fake(made, "P", "prefill"), fake(made, "D", "decode")
    url = start(made, [p.url], [d.url])
    body = {"model": "m", "max_tokens": 5, "temperature": 0, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": [1, 2, 3]})
    r = post(url, path, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["from"] == "D"  # the decode instance's answer, passed through
    pre = p.received[0]
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    dec = d.received[0]
    assert dec["max_tokens"] == 5 and dec["kv_transfer_params"] == {"do_remote_prefill": True,
                                                                     "kvcm": {"v": 1, "from": "P"}}
    assert len(p.received) == len(d.received) == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_is_passed_through_as_it_comes(made, path) -> None:
    p, d = fake(made, "P", "prefill"), fake(made, "D", "decode")
    url = start(made, [p.url], [d.url])
    body = {"model": "m", "max_tokens": 6, "stream": True}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hello"})
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    key = "delta" if "chat" in path else "text"
    got = [c["choices"][0][key]["content"] if key == "delta" else c["choices"][0]["text"] for c in chunks]
    assert got == [f"D-t{i}" for i in range(6)]
    assert p.received[0]["stream"] is False and d.received[0]["stream"] is True


def test_a_decode_instance_down_is_retried_on_another(made) -> None:
    p, d = fake(made, "P", "prefill"), fake(made, "D", "decode")
    dead = dead_url()
    url = start(made, [p.url], [dead, d.url])
    for i in range(3):
        r = post(url, "/v1/completions", {"model": "m", "prompt": [1, 2, i], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["from"] == "D", r.text
    metrics = httpx.get(f"{url}/metrics").text
    assert 'kvcm_proxy_events_total{event="decode_retries"} 1' in metrics  # then marked down: skipped
    assert f'url="{dead}",what="errors"}} 1' in metrics


def test_a_decode_instance_answering_5xx_is_retried_on_another(made) -> None:
    p = fake(made, "P", "prefill")
    bad, good = fake(made, "B", "decode", fail=1), fake(made, "G", "decode")
    url = start(made, [p.url], [bad.url, good.url])
    r = post(url, "/v1/completions", {"model": "m", "prompt": [1], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["from"] == "G"
    assert len(bad.received) == 1 and len(good.received) == 1


@pytest.mark.parametrize("which", ["decode", "prefill"])
def test_every_backend_of_a_role_down_is_a_clear_503(made, which) -> None:
    live = fake(made, "L", "prefill" if which == "decode" else "decode")
    dead = [dead_url(), dead_url()]
    url = start(made, [live.url] if which == "decode" else dead, dead if which == "decode" else [live.url])
    r = post(url, "/v1/completions", {"model": "m", "prompt": [1], "max_tokens": 2})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "unavailable" and f"no {which} instance could serve" in err["message"]
    assert all(u in err["message"] for u in dead)
    h = httpx.get(f"{url}/health")
    assert h.status_code == 503 and h.json()["status"] == "unavailable"
    assert set(h.json()[which].values()) == {"down"}


def test_health_and_models(made) -> None:
    p, d = fake(made, "P", "prefill"), fake(made, "D", "decode")
    url = start(made, [p.url], [d.url])
    h = httpx.get(f"{url}/health")
    assert h.status_code == 200 and h.json() == {"status": "ok", "prefill": {p.url: "up"}, "decode": {d.url: "up"}}


def test_a_backend_past_the_request_timeout_is_a_504(made) -> None:
    p, d = fake(made, "P", "prefill"), fake(made, "D", "decode", delay_s=3.0)
    url = start(made, [p.url], [d.url], request_timeout_s=0.5)
    t0 = time.monotonic()
    r = post(url, "/v1/completions", {"model": "m", "prompt": [1], "max_tokens": 2})
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert time.monotonic() - t0 < 2.5


def test_decode_instance_chosen_by_requests_in_flight(made) -> None:
    p = fake(made, "P", "prefill")
    slow, fast = fake(made, "S", "decode", delay_s=1.5), fake(made, "F", "decode")
    url = start(made, [p.url], [slow.url, fast.url])
    results: dict[int, Any] = {}

    def go(i: int) -> None:
        results[i] = post(url, "/v1/completions", {"model": "m", "prompt": [i], "max_tokens": 1}).json()["from"]

    first = threading.Thread(target=go, args=(0,))
    first.start()
    deadline = time.monotonic() + 10
    while not slow.received and not fast.received:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    busy = "S" if slow.received else "F"
    for i in range(1, 4):  # while the first is in flight, the other instance takes the next ones
        go(i)
    first.join()
    idle = "F" if busy == "S" else "S"
    assert results[0] == busy and all(results[i] == idle for i in range(1, 4)), results


def test_queue_bound_answers_503_when_full(made) -> None:
    p, d = fake(made, "P", "prefill"), fake(made, "D", "decode", delay_s=1.5)
    url = start(made, [p.url], [d.url], max_concurrency=1, max_queue=0)
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(post(url, "/v1/completions", {"prompt": [1]}).status_code))
    t.start()
    deadline = time.monotonic() + 10
    while not d.received:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = post(url, "/v1/completions", {"prompt": [2]})
    assert r.status_code == 503 and "overloaded" in r.json()["error"]["message"]
    t.join()
    assert out == [200]
    assert post(url, "/v1/completions", {"prompt": [3]}).status_code == 200  # the slot came back


def test_bad_request_bodies_are_refused_and_change_nothing(made) -> None:
    p, d = fake(made, "P", "prefill"), fake(made, "D", "decode")
    url = start(made, [p.url], [d.url])
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = post(url, "/v1/completions", [1, 2])  # type: ignore[arg-type]
    assert r.status_code == 400
    assert not p.received and not d.received


def test_prefill_instance_chosen_by_where_the_prefix_lives(made) -> None:
    """Two prefill instances, each with a real kvcm event publisher; one of them holds the
    prompt's prefix (a kvcm request committed it): the proxy's router index, fed by their
    events, sends the prompt there, though it is the busier one; another prompt goes by load."""
    import kvcm
    from kvcm.api import AttentionLayer, KVCacheManagerConfig, Tier
    from kvcm.fleet.publisher import EventPublisher

    B = 16
    cfg = KVCacheManagerConfig(B, [AttentionLayer(0, 8)], [Tier("gpu", 64 * 8 * B)], enable_partial_reuse=False)
    mgrs = [kvcm.KVCacheManager(cfg) for _ in range(2)]
    pubs = [EventPublisher(m) for m in mgrs]
    made.extend(_Closer(x) for x in pubs)
    prompt = list(range(1, 5 * B + 4))
    kv = mgrs[1].create_kv_cache(prompt)
    assert kv.resume() and kv.resize(len(prompt))
    mgrs[1].drain_copy_ops()
    kv.commit(prompt)
    kv.close()
    pubs[1].publish(mgrs[1].take_events())
    pubs[0].publish(mgrs[0].take_events())
    p0, p1 = fake(made, "P0", "prefill"), fake(made, "P1", "prefill")
    d = fake(made, "D", "decode")
    url = start(made, [p0.url, p1.url], [d.url],
                prefill_events=tuple((p.endpoint, p.replay_endpoint) for p in pubs), block_size=B)
    deadline = time.monotonic() + 20
    while httpx.get(f"{url}/health").json().get("events") != "synced":
        assert time.monotonic() < deadline, httpx.get(f"{url}/health").json()
        time.sleep(0.05)
    for _ in range(3):
        r = post(url, "/v1/completions", {"model": "m", "prompt": prompt + [7], "max_tokens": 2})
        assert r.status_code == 200
    assert len(p1.received) == 3 and not p0.received
    # a prompt no instance holds: by load (round robin among idle ones)
    for i in range(2):
        post(url, "/v1/completions", {"model": "m", "prompt": [900 + i] * 40, "max_tokens": 1})
    assert len(p0.received) >= 1
    assert 'kvcm_proxy_events_total{event="routed_by_prefix"} 3' in httpx.get(f"{url}/metrics").text


class _Closer:
    def __init__(self, x: Any) -> None:
        self.x = x

    def stop(self) -> None:
        self.x.close()


def test_without_prefill_instances_a_plain_round_robin_balancer(made) -> None:
    """No ``--prefill``: each request goes whole (its own ``max_tokens``, no hand-over params)
    to one server; ``round-robin`` alternates whatever the load (``bench disagg``'s two-vLLM
    baseline; ``load``, the default, is the decode leg's choice tested above)."""
    a, b = fake(made, "A", "decode", delay_s=1.0), fake(made, "B", "decode")
    rr = start(made, [], [a.url, b.url], balance="round-robin")
    results: dict[int, Any] = {}

    def go(url: str, i: int) -> None:
        r = post(url, "/v1/completions", {"model": "m", "prompt": [i], "max_tokens": 3})
        assert r.status_code == 200, r.text
        results[i] = r.json()

    threads = [threading.Thread(target=go, args=(rr, i)) for i in range(4)]
    for t in threads:  # one at a time into the proxy: the order of arrival is the order of choice
        t.start()
        deadline = time.monotonic() + 10
        while len(a.received) + len(b.received) < threads.index(t) + 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    for t in threads:
        t.join()
    assert sorted(r["from"] for r in results.values()) == ["A", "A", "B", "B"], results  # A busy, still its turn
    assert all(r["got_params"] is None and r["choices"][0]["text"].count("-t") == 3 for r in results.values())
    assert all(body["max_tokens"] == 3 and "kv_transfer_params" not in body for body in a.received + b.received)
    h = httpx.get(f"{rr}/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["prefill"] == {}
    with pytest.raises(ValueError, match="--balance"):
        ProxyConfig((), (a.url,), balance="random")
    with pytest.raises(ValueError, match="--decode"):
        ProxyConfig((a.url,), ())


def test_command_line_errors_are_one_line_exit_2() -> None:
    env = dict(os.environ)
    cases = [
        (["--prefill", "ftp://x", "--decode", "http://127.0.0.1:1"], "not an http(s):// URL"),
        (["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--prefill-events",
          "tcp://127.0.0.1:5,tcp://127.0.0.1:6"], "--block-size is needed"),
        (["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "70000"], "--port"),
    ]
    for args, text in cases:
        p = subprocess.run([sys.executable, "-m", "kvcm", "proxy", *args], env=env, capture_output=True, text=True,
                           timeout=60, check=False)
        assert p.returncode == 2 and text in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    with socket.socket() as s:  # the address in use
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "kvcm", "proxy", "--prefill", "http://127.0.0.1:1", "--decode",
                            "http://127.0.0.1:2", "--port", str(port)], env=env, capture_output=True, text=True,
                           timeout=60, check=False)
    assert p.returncode == 2 and f"cannot bind 127.0.0.1:{port}" in p.stderr, p.stderr
