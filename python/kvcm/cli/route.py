"""``python -m kvcm route``: compare routing policies on a trace (see ``kvcm.tools.routing``).

    route [TRACE] --instances N[,M...] [--policy kv,round-robin,random,least-loaded]
          [--limit 1000] [--block-size 32] [--gpu-blocks B] [--seed 0] [--backend cpp]
          [--plot route.png]

Prints one table row per (N, policy): hit rate, prefill tokens saved, load balance
(max/mean requests and prompt tokens per instance), whether the router's answer equalled
every instance's actual reuse, and the time; writes the plot.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Self

HELP = "compare routing policies over N instances behind the router index (kvcm.cli.route)"
ORDER = 70
RECORDS = True

DEFAULT_ROUTE_LIMIT = 1000


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of ints: {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("instance counts must be >= 1")
    return out


def _policies(text: str) -> list[str]:
    from kvcm.tools.routing import POLICIES

    out = [x.strip() for x in text.split(",") if x.strip()]
    for x in out:
        if x not in POLICIES:
            raise argparse.ArgumentTypeError(f"unknown policy {x!r}; choices: {', '.join(POLICIES)}")
    return out


ROUTE_EXIT_CODES = (
    "exit status: 0 every run done and the router exact; 1 the router's answer differed from an instance's reuse; "
    "2 bad usage or bad input (an option out of range, an unreadable or malformed trace, an unwritable --plot; "
    "one line, never a traceback)"
)


def main(argv: Sequence[str]) -> int:
    """``python -m kvcm route ...``: returns the exit status (``ROUTE_EXIT_CODES``)."""
    from kvcm.tools.cmdline import backend_arg, format_table, int_in, missing_extra, writable_file
    from kvcm.tools.progress import Progress
    from kvcm.tools.trace import load_trace

    prog = "python -m kvcm route"
    try:  # the router decodes vLLM's wire format: msgspec (the events extra)
        from kvcm.tools.routing import POLICIES, plot, route_trace, table
    except ImportError as e:
        why = missing_extra(prog, e, "route")
        if why is None:
            raise
        print(why, file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog=prog, description="KV-aware routing across instances", epilog=ROUTE_EXIT_CODES)
    p.add_argument("trace", nargs="?", default=None, help="a .jsonl or .jsonl.gz trace (default: the shipped one)")
    p.add_argument("--instances", type=_ints, default=[4], help="instance counts, comma-separated (default 4)")
    p.add_argument("--policy", type=_policies, default=list(POLICIES), help="comma-separated (default: all)")
    p.add_argument("--limit", type=int_in(1), default=None,
                   help=f"first N requests (default {DEFAULT_ROUTE_LIMIT} for the shipped trace, all for a file)")
    p.add_argument("--block-size", type=int_in(1, 4096), default=32, help="tokens_per_block (default 32)")
    p.add_argument("--gpu-blocks", type=int_in(1), default=None,
                   help="gpu quota per instance in blocks (default: the trace's distinct blocks / N)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    p.add_argument("--backend", type=backend_arg, default=None, help="python or cpp (default: kvcm.backend)")
    p.add_argument("--plot", default="kvcm-route.png", help="PNG to write (default kvcm-route.png; '' for none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(list(argv))
    if args.plot:
        why = writable_file(prog, "--plot", args.plot)
        if why is not None:
            print(why, file=sys.stderr)
            return 2
        try:
            import matplotlib  # noqa: F401 - checked before the run, not after it
        except ImportError:
            print(f"{prog}: --plot needs matplotlib: pip install 'kvcm[route]' (or --plot '' for none)",
                  file=sys.stderr)
            return 2
    limit = args.limit if args.limit is not None else (DEFAULT_ROUTE_LIMIT if args.trace is None else None)
    try:
        trace = load_trace(args.trace, limit)
    except (OSError, ValueError) as e:
        print(f"{prog}: cannot read trace: {e}", file=sys.stderr)
        return 2
    if not trace:
        print(f"{prog}: {args.trace}: no requests to route (it has 0)", file=sys.stderr)
        return 2
    print(f"{len(trace)} requests, {sum(r.input_length for r in trace):,} prompt tokens, "
          f"tokens_per_block={args.block_size}")
    sys.stdout.flush()
    results = []
    runs = [(n, policy) for n in args.instances for policy in args.policy]
    with Progress(len(runs) * len(trace), "route") if not args.no_progress else _NoBar() as bar:
        for n, policy in runs:
            bar.label = f"route N={n} {policy}"
            results.append(route_trace(trace, n, policy, tokens_per_block=args.block_size,
                                       gpu_quota_blocks=args.gpu_blocks, backend=args.backend, seed=args.seed,
                                       on_request=bar.update))
    header, rows = table(results)
    print(format_table(header, rows))
    if args.plot:
        try:
            plot(results, args.plot)
        except OSError as e:  # the directory went away during the run
            print(f"{prog}: --plot {args.plot}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"plot: {args.plot}")
    return 0 if all(r.mispredicted == 0 for r in results) else 1


class _NoBar:
    label = ""

    def update(self, k: int = 1) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


__all__ = ["main"]
