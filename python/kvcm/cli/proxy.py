"""``python -m kvcm proxy``: disaggregated prefill and decode in front of vLLM servers.

    proxy [--prefill URL[,URL...]] --decode URL[,URL...] [--host 127.0.0.1] [--port 8000]
          [--prefill-events PUB,REPLAY ...  --block-size B] [--balance load|round-robin]
          [--max-concurrency 256] [--max-queue 1024] [--queue-timeout 30]
          [--connect-timeout 5] [--request-timeout 600]

An OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``, streaming or
not, ``/v1/models``, ``/health``, ``/metrics``): each request is prefilled on a prefill
instance (``max_tokens=1``, ``kv_transfer_params={"do_remote_decode": true}``) and decoded
on a decode instance with the params the prefill answered; the instances run vLLM with
kvcm's connector (``kv_role`` ``kv_producer`` / ``kv_consumer``) on one shared store.
``--prefill-events`` (one ``PUB,REPLAY`` pair of ZeroMQ endpoints per ``--prefill`` URL, in
order: each instance's ``events_endpoint`` and ``events_replay_endpoint``) routes each
prompt to the prefill instance that already holds most of its prefix.  Without
``--prefill`` it is a plain balancer over the ``--decode`` servers (each request whole to
one; ``--balance round-robin``: each in turn, the naive baseline).  The runtime is
:mod:`kvcm.fleet.proxy` (the proxy extra: FastAPI, uvicorn, httpx).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

HELP = "an OpenAI-compatible prefill/decode proxy over vLLM servers with kvcm (kvcm.cli.proxy)"
ORDER = 75

PROXY_EXIT_CODES = ("exit status: 0 stopped by a signal after serving; 2 bad usage (an option out of range, a "
                    "malformed URL or endpoint, the address in use; one line, never a traceback)")


def _urls(text: str) -> list[str]:
    out = [u.strip() for u in text.split(",") if u.strip()]
    for u in out:
        if not u.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"not an http(s):// URL: {u!r}")
    if not out:
        raise argparse.ArgumentTypeError("give at least one URL")
    return out


def _pair(text: str) -> tuple[str, str]:
    from kvcm.cli.events import _endpoint

    parts = [x.strip() for x in text.split(",")]
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"not PUB,REPLAY: {text!r} (two ZeroMQ endpoints, comma-separated)")
    return _endpoint(parts[0]), _endpoint(parts[1])


def main(argv: Sequence[str]) -> int:
    """``python -m kvcm proxy ...``: returns the exit status (``PROXY_EXIT_CODES``)."""
    from kvcm.tools.cmdline import finite_in, int_in, missing_extra

    prog = "python -m kvcm proxy"
    try:  # the proxy extra
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401

        from kvcm.fleet.proxy import ProxyConfig, serve_forever
    except ImportError as e:
        why = missing_extra(prog, e, "proxy")
        if why is None:
            raise
        print(why, file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], epilog=PROXY_EXIT_CODES)
    p.add_argument("--prefill", type=_urls, default=[],
                   help="prefill instances (kv_producer), comma-separated (none: a plain balancer over --decode)")
    p.add_argument("--decode", type=_urls, required=True, help="decode instances (kv_consumer), comma-separated")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000)
    p.add_argument("--prefill-events", type=_pair, action="append", default=[], metavar="PUB,REPLAY",
                   help="a prefill instance's kvcm event endpoints, once per --prefill URL in order")
    p.add_argument("--block-size", type=int_in(1, 4096), default=0, help="the instances' block size (with events)")
    p.add_argument("--balance", default="load", choices=("load", "round-robin"),
                   help="how the decode instance is chosen: fewest requests in flight (default) or each in turn")
    p.add_argument("--max-concurrency", type=int_in(1, 100_000), default=256)
    p.add_argument("--max-queue", type=int_in(0, 1_000_000), default=1024)
    p.add_argument("--queue-timeout", type=finite_in(0, 86_400, lo_open=True), default=30.0)
    p.add_argument("--connect-timeout", type=finite_in(0, 86_400, lo_open=True), default=5.0)
    p.add_argument("--request-timeout", type=finite_in(0, 86_400, lo_open=True), default=600.0)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    args = p.parse_args(list(argv))
    try:
        config = ProxyConfig(tuple(args.prefill), tuple(args.decode), tuple(args.prefill_events), args.block_size,
                             args.max_concurrency, args.max_queue, args.queue_timeout, args.connect_timeout,
                             args.request_timeout, args.balance)
    except ValueError as e:
        p.error(str(e))
    import socket

    try:  # the address: a clear error before uvicorn starts
        with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((args.host, args.port))
    except OSError as e:
        print(f"{prog}: cannot bind {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    if config.prefill:
        print(f"kvcm proxy on http://{args.host}:{args.port}: prefill {', '.join(config.prefill)}; decode "
              f"{', '.join(config.decode)} by {config.balance}; prefill routing by "
              f"{'prefix (KV events) then load' if config.prefill_events else 'load'}", file=sys.stderr, flush=True)
    else:
        print(f"kvcm proxy on http://{args.host}:{args.port}: no prefill instances, each request whole to one of "
              f"{', '.join(config.decode)} by {config.balance}", file=sys.stderr, flush=True)
    try:
        serve_forever(config, args.host, args.port, args.log_level)
    except KeyboardInterrupt:
        return 0
    return 0


__all__ = ["main"]
