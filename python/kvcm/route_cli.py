"""``python -m kvcm route``: compare routing policies on a trace (see ``kvcm.routing``).

    route [TRACE] --instances N[,M...] [--policy kv,round-robin,random,least-loaded]
          [--limit 1000] [--block-size 32] [--gpu-blocks B] [--seed 0] [--backend cpp]
          [--plot route.png]

Prints one table row per (N, policy): hit rate, prefill tokens saved, load balance
(max/mean requests and prompt tokens per instance), whether the router's answer equalled
every instance's actual reuse, and the time; writes the plot.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

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
    from kvcm.routing import POLICIES

    out = [x.strip() for x in text.split(",") if x.strip()]
    for x in out:
        if x not in POLICIES:
            raise argparse.ArgumentTypeError(f"unknown policy {x!r}; choices: {', '.join(POLICIES)}")
    return out


def main(argv: Sequence[str]) -> int:
    from kvcm.cli_common import format_table
    from kvcm.routing import POLICIES, plot, route_trace, table
    from kvcm.trace import load_trace

    p = argparse.ArgumentParser(prog="python -m kvcm route", description="KV-aware routing across instances")
    p.add_argument("trace", nargs="?", default=None, help="a .jsonl or .jsonl.gz trace (default: the shipped one)")
    p.add_argument("--instances", type=_ints, default=[4], help="instance counts, comma-separated (default 4)")
    p.add_argument("--policy", type=_policies, default=list(POLICIES), help="comma-separated (default: all)")
    p.add_argument("--limit", type=int, default=None,
                   help=f"first N requests (default {DEFAULT_ROUTE_LIMIT} for the shipped trace, all for a file)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="gpu quota per instance in blocks (default: the trace's distinct blocks / N)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    p.add_argument("--backend", default=None, help="python or cpp (default: kvcm.backend)")
    p.add_argument("--plot", default="kvcm-route.png", help="PNG to write (default kvcm-route.png; '' for none)")
    args = p.parse_args(list(argv))
    limit = args.limit if args.limit is not None else (DEFAULT_ROUTE_LIMIT if args.trace is None else None)
    trace = load_trace(args.trace, limit)
    results = []
    for n in args.instances:
        for policy in args.policy:
            results.append(route_trace(trace, n, policy, tokens_per_block=args.block_size,
                                       gpu_quota_blocks=args.gpu_blocks, backend=args.backend, seed=args.seed))
    header, rows = table(results)
    print(f"{len(trace)} requests, {sum(r.input_length for r in trace):,} prompt tokens, "
          f"tokens_per_block={args.block_size}")
    print(format_table(header, rows))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0 if all(r.mispredicted == 0 for r in results) else 1


__all__ = ["main"]
