"""``python -m kvcm events``: watch a KV-event stream, run a demo publisher, measure its cost.

    events --connect tcp://HOST:PORT [--replay tcp://HOST:PORT] [--snapshot] [--count N] [--timeout S]
    events --demo [--steps N]              a local publisher on 127.0.0.1 (small hybrid model), watched
    events --bench [--limit N] [--backend B]  publisher cost per step, a subscriber attached

The watcher prints one line per batch (``seq``, ``ts``, then each event) and, with
``--replay``, heals sequence gaps through the replay endpoint (``gap`` lines say so);
``--snapshot`` first prints the publisher's snapshot (kvcm publishers only).  The work is
:mod:`kvcm.tools.events` (watch, demo) and :mod:`kvcm.bench.events` (``--bench``), the
events extra: pyzmq, msgspec.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

HELP = "watch a KV-event stream (--connect ENDPOINT [--replay ENDPOINT]), --demo, --bench (kvcm.cli.events)"
ORDER = 60
RECORDS = True

EVENTS_EXIT_CODES = (
    "exit status: 0 success; 1 no batch arrived within --timeout, or the replay endpoint did not answer; "
    "2 bad usage (an option out of range, a malformed endpoint; one line, never a traceback)"
)


def _endpoint(text: str) -> str:
    """An argparse type: a ZeroMQ endpoint to connect to, ``tcp://HOST:PORT``,
    ``ipc://PATH`` or ``inproc://NAME``."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise argparse.ArgumentTypeError(f"not an endpoint: {text!r} (tcp://HOST:PORT, ipc://PATH or inproc://NAME)")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"not an endpoint: {text!r} (tcp://HOST:PORT, PORT in 1..65535)")
    return text


def main(argv: Sequence[str]) -> int:
    """``python -m kvcm events ...``: returns the exit status (``EVENTS_EXIT_CODES``)."""
    from kvcm.tools.cmdline import backend_arg, finite_in, int_in, missing_extra

    prog = "python -m kvcm events"
    try:  # the optional dependencies (pyzmq, msgspec): the events extra
        import zmq

        from kvcm.bench.events import bench
        from kvcm.tools.events import demo, watch
    except ImportError as e:
        why = missing_extra(prog, e)
        if why is None:
            raise
        print(why, file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], epilog=EVENTS_EXIT_CODES)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--connect", metavar="ENDPOINT", type=_endpoint,
                      help="a publisher's PUB endpoint, e.g. tcp://127.0.0.1:5557")
    mode.add_argument("--demo", action="store_true", help="run a local publisher and watch it")
    mode.add_argument("--bench", action="store_true", help="measure the publisher's cost per step")
    p.add_argument("--replay", metavar="ENDPOINT", type=_endpoint, help="its replay endpoint (gap healing, --snapshot)")
    p.add_argument("--topic", default="kvcm")
    p.add_argument("--snapshot", action="store_true", help="print the publisher's snapshot first (needs --replay)")
    p.add_argument("--count", type=int_in(1), default=None, help="stop after N batches")
    p.add_argument("--timeout", type=finite_in(0, lo_open=True), default=60.0,
                   help="stop after S seconds without a batch (default 60)")
    p.add_argument("--steps", type=int_in(1), default=6, help="--demo: engine steps")
    p.add_argument("--limit", type=int_in(1), default=300, help="--bench: requests of the shipped trace")
    p.add_argument("--backend", type=backend_arg, default=None, help="--bench: python or cpp (default: kvcm.backend)")
    p.add_argument("--block-size", type=int_in(1, 4096), default=32, help="--bench: tokens_per_block")
    args = p.parse_args(list(argv))
    if args.snapshot and not args.replay:
        p.error("--snapshot needs --replay ENDPOINT (the snapshot comes from the replay endpoint)")
    try:
        if args.demo:
            return demo(args.steps)
        if args.bench:
            r = bench(args.limit, args.backend, args.block_size)
            print(f"publisher cost, {r['steps']} prefill steps of the shipped trace ({r['events']} events, "
                  f"{r['batches']} batches, {r['received']} received by the subscriber):")
            print(f"  publish() on the scheduler thread: {r['publish_us_mean']:.1f} us/step mean, "
                  f"{r['publish_us_median']:.1f} us median; a step without events {r['empty_step_us']:.2f} us")
            print(f"  publisher thread (translate + encode + send): {r['thread_us_per_step']:.1f} us/step, "
                  f"{r['thread_us_per_event']:.2f} us/event")
            return 0
        idle: list[int] = []
        print(f"waiting for {args.connect} (topic {args.topic!r}; stops after {args.timeout:g} s without a batch)",
              file=sys.stderr, flush=True)
        watch(args.connect, args.replay, args.topic, args.count, args.timeout, args.snapshot,
              on_idle=idle.append)
    except zmq.ZMQError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except TimeoutError as e:  # the replay endpoint did not answer a snapshot or gap request
        print(f"{prog}: {e} in {args.timeout:g} s", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if idle:
        print(f"{prog}: no batch in {args.timeout:g} s from {args.connect}"
              + (f" ({idle[0]} printed before)" if idle[0] else ""), file=sys.stderr)
        return 1 if idle[0] == 0 else 0
    return 0


__all__ = ["main"]
