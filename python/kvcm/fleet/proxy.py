"""The disaggregated prefill/decode proxy (``python -m kvcm proxy``; SPEC sec. 19).

An OpenAI-compatible front (``/v1/completions``, ``/v1/chat/completions``, streaming or not,
``/v1/models``, ``/health``, ``/metrics``) over two fleets of vLLM OpenAI servers running
kvcm's connector: prefill instances (``kv_role`` ``kv_producer``) and decode instances
(``kv_consumer``).  Each request takes vLLM's disaggregated flow:

1. the request, with ``max_tokens=1``, no streaming and ``kv_transfer_params =
   {"do_remote_decode": true}``, to a prefill instance: it computes the prompt, its
   connector writes the prompt's blocks to the shared tier and answers the hand-over params
   (``kvcm.integrations.vllm.handover``) in the response's ``kv_transfer_params``;
2. the original request, with those params, to a decode instance: its connector waits for
   the announced objects (bounded), loads them and generates; its answer (a JSON body or an
   event stream) is passed through as it comes.

**Routing.**  The prefill instance is the one that already holds most of the prompt's
prefix, by kvcm's router index (:class:`~kvcm.fleet.router_index.RouterIndex`) fed by each
instance's KV events (:class:`~kvcm.fleet.subscriber.FleetSubscriber` on the instance's
``events_endpoint`` / ``events_replay_endpoint``), among the healthy ones, ties broken by
load; without events (or before they are in, or for a prompt given as text that the
instance's ``/tokenize`` could not turn into tokens) the least loaded.  The decode instance
is the least loaded (requests in flight; ``balance="round-robin"``: each in turn, whatever
its load).  Without prefill instances the proxy is a plain balancer: each request goes whole
to one of the ``decode`` instances (the baseline ``bench disagg`` compares the split with:
two vLLMs behind a round-robin proxy).  A decode instance that cannot be reached (or
answers 5xx before its first byte) is marked down for ``DOWN_S`` and the request goes to the
next one; with none left the client gets 503 and a JSON error naming the backends.

**Bounds.**  At most ``max_concurrency`` requests run; ``max_queue`` more wait up to
``queue_timeout_s`` (then 503); request bodies above ``MAX_BODY`` bytes are refused (413);
every backend call has a connect and a read timeout (504 when a backend times out).  It binds
the address it is given (127.0.0.1 by default).

Runs on FastAPI + uvicorn + httpx (``kvcm[proxy]``; vLLM brings all three).
"""


import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

BALANCE = ("load", "round-robin")
DOWN_S = 5.0  # a backend that failed is skipped this long (unless every backend is down)
MAX_BODY = 16 << 20
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
               "upgrade", "proxy-authorization", "proxy-authenticate"}


@dataclass
class Backend:
    url: str
    role: str  # "prefill" | "decode"
    events: tuple[str, str] | None = None  # (PUB endpoint, replay endpoint) of its kvcm events
    in_flight: int = 0
    down_until: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)

    def up(self, now: float) -> bool:
        return now >= self.down_until


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    prefill_events: tuple[tuple[str, str], ...] = ()  # one (pub, replay) per prefill instance, or none
    block_size: int = 0  # the instances' block size (routing by prefix needs it with events)
    max_concurrency: int = 256
    max_queue: int = 1024
    queue_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    balance: str = "load"  # how the decode instance is chosen: "load" (fewest in flight) or "round-robin"

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("--decode: give at least one URL")
        if self.balance not in BALANCE:
            raise ValueError(f"--balance: one of {', '.join(BALANCE)}, got {self.balance!r}")
        for name in ("prefill", "decode"):
            urls = getattr(self, name)
            for u in urls:
                if not u.startswith(("http://", "https://")) or len(u) < 10:
                    raise ValueError(f"--{name}: {u!r} is not an http(s):// URL")
        if self.prefill_events and len(self.prefill_events) != len(self.prefill):
            raise ValueError(f"--prefill-events: {len(self.prefill_events)} given for {len(self.prefill)} prefill "
                             "instances (one PUB,REPLAY pair per --prefill URL, in order)")
        if self.prefill_events and self.block_size <= 0:
            raise ValueError("--block-size is needed with --prefill-events (the instances' vLLM block size)")
        for name in ("max_concurrency", "max_queue"):
            if getattr(self, name) < (1 if name == "max_concurrency" else 0):
                raise ValueError(f"--{name.replace('_', '-')} out of range: {getattr(self, name)}")
        for name in ("queue_timeout_s", "connect_timeout_s", "request_timeout_s"):
            v = getattr(self, name)
            if not 0 < v <= 86_400:
                raise ValueError(f"--{name.replace('_', '-').removesuffix('-s')} must be seconds in (0, 86400], got {v}")


class PrefixRouter:
    """kvcm's router index over the prefill instances' KV events, fed by a background thread
    (the subscriber is used by that thread only; queries take the lock briefly)."""

    POLL_S = 0.02

    def __init__(self, instances: dict[str, tuple[str, str]], block_size: int) -> None:
        from kvcm.fleet.router_index import GroupSpec, RouterIndex, RouterModel

        self.index = RouterIndex(RouterModel(block_size, (GroupSpec("full_attention"),)))
        self.instances = instances
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.error: str | None = None
        self.synced = False
        self.thread = threading.Thread(target=self._run, name="kvcm-proxy-events", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from kvcm.fleet.subscriber import FleetSubscriber

        sub = None
        while not self.stop.is_set() and sub is None:
            try:  # the first snapshot of every instance (retried while they start)
                with self.lock:
                    sub = FleetSubscriber(self.index, self.instances, timeout=2.0)
                self.synced = True
            except (TimeoutError, OSError) as e:
                self.error = f"{type(e).__name__}: {e}"
                self.stop.wait(1.0)
        try:
            while sub is not None and not self.stop.is_set():
                with self.lock:
                    n = sub.poll(0)
                if not n:
                    self.stop.wait(self.POLL_S)
        except Exception as e:  # noqa: BLE001 - the router degrades to least-loaded, saying why
            self.error = f"{type(e).__name__}: {e}"
            self.synced = False
        finally:
            if sub is not None:
                with self.lock:
                    sub.close()

    def reuse(self, tokens: Sequence[int]) -> dict[str, int]:
        if not self.synced:
            return {}
        with self.lock:
            return self.index.reuse_all(list(tokens))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


class Unavailable(Exception):
    """No backend of a role could serve: 503 (or 504 for a timeout) with a JSON error."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


class Proxy:
    """The proxy's state and its two legs (module doc); :func:`make_app` serves it."""

    def __init__(self, config: ProxyConfig) -> None:
        import httpx

        self.config = config
        ev = config.prefill_events or (None,) * len(config.prefill)
        self.prefill = [Backend(u.rstrip("/"), "prefill", e) for u, e in zip(config.prefill, ev, strict=True)]
        self.decode = [Backend(u.rstrip("/"), "decode") for u in config.decode]
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s,
                                                              connect=config.connect_timeout_s),
                                        limits=httpx.Limits(max_connections=config.max_concurrency * 2))
        self.slots = asyncio.Semaphore(config.max_concurrency)
        self.waiting = 0
        self.counts: Counter[str] = Counter()
        self.rr = 0
        self.router = (PrefixRouter({b.url: b.events for b in self.prefill if b.events}, config.block_size)
                       if config.prefill_events else None)

    async def close(self) -> None:
        if self.router is not None:
            self.router.close()
        await self.client.aclose()

    # ------------------------------------------------------------------ choosing

    def _order(self, backends: list[Backend], score: dict[str, int] | None = None,
               balance: str = "load") -> list[Backend]:
        """Backends to try, best first: up before down, most prefix reuse, fewest in flight
        (not with ``balance="round-robin"``), then round robin."""
        now = time.monotonic()
        self.rr += 1
        n = len(backends)
        by_load = balance == "load"
        return sorted(backends, key=lambda b: (not b.up(now), -(score or {}).get(b.url, 0),
                                               b.in_flight if by_load else 0, (backends.index(b) - self.rr) % n))

    async def _tokens(self, path: str, body: dict[str, Any], via: Backend) -> list[int] | None:
        """The prompt's token ids: given as ids, or the instance's ``/tokenize`` of its text
        or messages (None when it cannot say: routing falls back to load)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            return prompt[0] if all(type(t) is int for t in prompt[0]) else None
        ask: dict[str, Any] = {"model": body.get("model")}
        if path.endswith("chat/completions") and isinstance(body.get("messages"), list):
            ask["messages"] = body["messages"]
        elif isinstance(prompt, str):
            ask["prompt"] = prompt
        else:
            return None
        try:
            r = await self.client.post(f"{via.url}/tokenize", json=ask, timeout=self.config.connect_timeout_s)
            toks = r.json().get("tokens") if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - routing degrades to load
            return None
        self.counts["tokenize_calls"] += 1
        return toks if isinstance(toks, list) and all(type(t) is int for t in toks) else None

    # ------------------------------------------------------------------ the legs

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
        import httpx

        req = dict(body)
        req.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True,
                                                                    "do_remote_prefill": False})
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        req.pop("stream_options", None)
        score = None
        if self.router is not None:
            toks = await self._tokens(path, body, self._order(self.prefill)[0])
            if toks:
                score = self.router.reuse(toks)
                if score and max(score.values()) > 0:
                    self.counts["routed_by_prefix"] += 1
        errors = []
        for b in self._order(self.prefill, score):
            b.in_flight += 1
            try:
                r = await self.client.post(f"{b.url}{path}", json=req, headers=headers)
            except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
                b.counts["errors"] += 1
                raise  # it took the request and did not answer in time: 504 (not run twice)
            except Exception as e:  # noqa: BLE001 - connection refused, connect timeouts: the next instance
                b.counts["errors"] += 1
                b.down_until = time.monotonic() + DOWN_S
                errors.append(f"{b.url}: {type(e).__name__}")
                self.counts["prefill_retries"] += 1
                continue
            finally:
                b.in_flight -= 1
            b.counts["requests"] += 1
            if r.status_code >= 500:
                b.counts["errors"] += 1
                b.down_until = time.monotonic() + DOWN_S
                errors.append(f"{b.url}: HTTP {r.status_code}")
                continue
            if r.status_code != 200:  # the client's error (400 ...): the decode leg would say the same
                raise ClientError(r.status_code, r.content, r.headers.get("content-type", "application/json"))
            try:
                return r.json().get("kv_transfer_params")
            except ValueError:
                errors.append(f"{b.url}: a body that is not JSON")
        raise Unavailable(f"no prefill instance could serve the request ({'; '.join(errors)})")

    def _decode_failed(self, b: Any, errors: list[str], why: str) -> None:
        """A decode instance that could not take the request: marked down for DOWN_S, the
        request retried on the next one."""
        b.in_flight -= 1
        b.counts["errors"] += 1
        b.down_until = time.monotonic() + DOWN_S
        errors.append(f"{b.url}: {why}")
        self.counts["decode_retries"] += 1

    async def _open_decode(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[Any, Backend]:
        """The decode leg's response, headers received (the body not read), from the first
        instance that answers without a 5xx; the instance's in-flight count is held."""
        import httpx

        errors = []
        for b in self._order(self.decode, balance=self.config.balance):
            b.in_flight += 1
            try:
                req = self.client.build_request("POST", f"{b.url}{path}", json=body, headers=headers)
                r = await self.client.send(req, stream=True)
            except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
                b.in_flight -= 1
                b.counts["errors"] += 1
                raise  # it took the request and did not answer in time: 504 (not run twice)
            except Exception as e:  # noqa: BLE001 - unreachable: the next instance
                self._decode_failed(b, errors, type(e).__name__)
                continue
            if r.status_code >= 500:
                await r.aclose()
                self._decode_failed(b, errors, f"HTTP {r.status_code}")
                continue
            b.counts["requests"] += 1
            return r, b
        raise Unavailable(f"no decode instance could serve the request ({'; '.join(errors)})")

    async def handle(self, path: str, body: dict[str, Any], headers: dict[str, str], release: Any) -> Any:
        """Both legs of one request; returns a starlette response.  ``release`` frees the
        request's slot: called here, or by a streamed response once its stream ends."""
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        params = await self._prefill(path, body, headers) if self.prefill else None
        dreq = dict(body)
        if not self.prefill:  # a plain balancer: the request goes whole to one instance
            pass
        elif params:
            dreq["kv_transfer_params"] = params
            self.counts["handovers"] += 1
        else:
            dreq.pop("kv_transfer_params", None)
            self.counts["no_handover"] += 1
        r, b = await self._open_decode(path, dreq, headers)
        ctype = r.headers.get("content-type", "application/json")
        if not body.get("stream") or r.status_code != 200:  # a whole body: a JSON answer or an error
            try:
                data = await r.aread()
            finally:
                await r.aclose()
                b.in_flight -= 1
                release()
            if body.get("stream"):
                return JSONResponse(_json_or(data), status_code=r.status_code)
            return Response(data, status_code=r.status_code, media_type=ctype)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            except Exception as e:  # noqa: BLE001 - the backend died mid-stream: say so in the stream
                self.counts["stream_errors"] += 1
                b.counts["errors"] += 1
                err = {"error": {"message": f"decode instance {b.url} failed mid-stream: {type(e).__name__}",
                                 "type": "backend_error", "code": 502}}
                yield f"data: {json.dumps(err)}\n\n".encode()
            finally:
                await r.aclose()
                b.in_flight -= 1
                release()

        return StreamingResponse(relay(), status_code=200, media_type=ctype)

    async def admit(self) -> bool:
        """A slot among ``max_concurrency``, waiting in a queue of ``max_queue`` at most
        ``queue_timeout_s``; False: overloaded."""
        if self.waiting >= self.config.max_queue and self.slots.locked():
            return False
        self.waiting += 1
        try:
            await asyncio.wait_for(self.slots.acquire(), self.config.queue_timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1

    # ------------------------------------------------------------------ observing

    async def health(self) -> tuple[int, dict[str, Any]]:
        async def one(b: Backend) -> bool:
            try:
                r = await self.client.get(f"{b.url}/health", timeout=self.config.connect_timeout_s)
                return r.status_code == 200
            except Exception:  # noqa: BLE001 - down
                return False

        ok = await asyncio.gather(*(one(b) for b in self.prefill + self.decode))
        state = {b.url: ("up" if up else "down") for b, up in zip(self.prefill + self.decode, ok, strict=True)}
        good = (not self.prefill or any(ok[:len(self.prefill)])) and any(ok[len(self.prefill):])
        out = {"status": "ok" if good else "unavailable", "prefill": {b.url: state[b.url] for b in self.prefill},
               "decode": {b.url: state[b.url] for b in self.decode}}
        if self.router is not None:
            out["events"] = "synced" if self.router.synced else f"not synced ({self.router.error})"
        return (200 if good else 503), out

    def metrics(self) -> str:
        lines = ["# TYPE kvcm_proxy_events_total counter"]
        for k in sorted(self.counts):
            lines.append(f'kvcm_proxy_events_total{{event="{k}"}} {self.counts[k]}')
        lines.append("# TYPE kvcm_proxy_backend_in_flight gauge")
        for b in self.prefill + self.decode:
            lines.append(f'kvcm_proxy_backend_in_flight{{role="{b.role}",url="{b.url}"}} {b.in_flight}')
        lines.append("# TYPE kvcm_proxy_backend_total counter")
        for b in self.prefill + self.decode:
            for k in ("requests", "errors"):
                lines.append(f'kvcm_proxy_backend_total{{role="{b.role}",url="{b.url}",what="{k}"}} {b.counts[k]}')
        lines.append("# TYPE kvcm_proxy_waiting gauge")
        lines.append(f"kvcm_proxy_waiting {self.waiting}")
        return "\n".join(lines) + "\n"


class ClientError(Exception):
    """The prefill instance refused the request itself (4xx): passed to the client as is."""

    def __init__(self, status: int, body: bytes, ctype: str) -> None:
        super().__init__(status)
        self.status, self.body, self.ctype = status, body, ctype


def _json_or(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return {"error": {"message": data.decode(errors="replace")[:2000], "type": "backend_error"}}


def _error(status: int, message: str, kind: str = "unavailable") -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def make_app(config: ProxyConfig) -> Any:
    """The proxy as an ASGI app (FastAPI)."""
    from contextlib import asynccontextmanager

    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    state: dict[str, Proxy] = {}

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state["proxy"] = Proxy(config)
        try:
            yield
        finally:
            await state["proxy"].close()

    app = FastAPI(title="kvcm disaggregated prefill/decode proxy", lifespan=lifespan)

    async def serve(request: Request, path: str) -> Any:
        proxy = state["proxy"]
        raw = await request.body()
        if len(raw) > MAX_BODY:
            return _error(413, f"request body over {MAX_BODY} bytes", "invalid_request_error")
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}
        if not await proxy.admit():
            proxy.counts["overloaded"] += 1
            return _error(503, "the proxy is overloaded (queue full or queue timeout): retry later")
        proxy.counts["requests"] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                proxy.slots.release()

        try:
            return await proxy.handle(path, body, headers, release)
        except Unavailable as e:
            proxy.counts["unavailable"] += 1
            release()
            return _error(e.status, str(e))
        except ClientError as e:
            release()
            return Response(e.body, status_code=e.status, media_type=e.ctype)
        except httpx.TimeoutException as e:
            proxy.counts["timeouts"] += 1
            release()
            return _error(504, f"a backend timed out: {type(e).__name__}", "timeout")
        except BaseException:
            release()
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await serve(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await serve(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Any:
        proxy = state["proxy"]
        for b in proxy._order(proxy.decode):
            try:
                r = await proxy.client.get(f"{b.url}/v1/models", timeout=config.connect_timeout_s)
                return Response(r.content, status_code=r.status_code,
                                media_type=r.headers.get("content-type", "application/json"))
            except httpx.HTTPError:  # unreachable: the next one
                b.counts["errors"] += 1
        return _error(503, "no decode instance answered /v1/models")

    @app.get("/health")
    async def health() -> Any:
        status, out = await state["proxy"].health()
        return JSONResponse(out, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(state["proxy"].metrics())

    return app


def serve_forever(config: ProxyConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the proxy until interrupted."""
    import uvicorn

    uvicorn.run(make_app(config), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


__all__ = ["Backend", "Proxy", "ProxyConfig", "make_app", "serve_forever"]
