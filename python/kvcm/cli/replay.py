"""``python -m kvcm replay``: replay a trace on each chosen backend and print a side-by-side
table (:mod:`kvcm.tools.replay`); with ``--instances`` and ``--shared-tier``, the fleet
replay over a shared tier (:mod:`kvcm.tools.fleet_replay`).

A backend that raises NotImplementedError shows ``not implemented yet (issue #3)`` in its
column (likewise ``unavailable (...)`` for one that is not built).  The exit code is 0 as
long as at least one backend ran and none raised anything else; an unexpected error shows
``error: <type>`` in its column, its traceback on stderr, and makes the exit code 1.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvcm.tools.cmdline import backend_list, exit_code, fmt_int, format_table, int_in, run_guarded

HELP = "replay a trace on one or more backends, side by side"
ORDER = 20
RECORDS = True

# The default replay: a prefix of the shipped trace the python backend replays in about
# 30 s at tokens_per_block=32 (measured on a 2-core machine: 1,000 requests, 11.9M prompt
# tokens, 26 s of CPU; 500 requests take 11 s).  --limit overrides.  Reuse in this trace
# is long-range: the 1,000-request prefix reuses 17.26% of its prompt tokens, the whole
# trace 65.12%.
DEFAULT_REPLAY_LIMIT = 1000
REPLAY_EXIT_CODES = (
    "exit status: 0 at least one backend ran and none failed; 1 a backend raised an unexpected error "
    "(traceback on stderr); 2 bad usage, or an unreadable or malformed trace (one line naming the file, "
    "line and field), or nothing to replay. A quota above what the replay can use is capped (noted)."
)


def _int_list(text: str) -> list[int]:
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError(f"instance counts must be >= 1, got {text!r}")
    return ns


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names or any(p not in ("commit", "evict") for p in names):
        raise argparse.ArgumentTypeError(f"write policies are commit and evict, got {text!r}")
    return names


def _frac(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def _quota(blocks: int | None, frac: float | None, unique: Callable[[], int]) -> int | None:
    if blocks is not None:
        return blocks
    if frac is not None:
        return max(1, int(frac * unique()))
    return None


def _capped(what: str, quota: int | None, most: int) -> int | None:
    """A quota above what the replay can ever use (``most``: every block of every request,
    plus one) behaves exactly like ``most`` -- nothing is evicted either way -- but would
    make the pools allocate per-slot state for it: capped, with a note."""
    if quota is None or quota <= most:
        return quota
    print(f"note: {what} quota {fmt_int(quota)} blocks is more than this replay can use; capped at {fmt_int(most)}")
    return most


def run_replays(
    backends: Sequence[str],
    trace: Sequence[Any],
    *,
    tokens_per_block: int,
    gpu_blocks: int | None,
    host_blocks: int | None,
    partial: bool,
    outputs: bool,
    progress: bool,
    output_step: int = 1,
) -> dict[str, Any]:
    """``{backend: ReplayResult or reason string}``."""
    from kvcm.tools.replay import replay

    results: dict[str, Any] = {}
    for b in backends:
        # The previous backend's cyclic garbage (the python backend leaves millions of
        # objects) must not be collected on the next backend's clock.
        gc.collect()
        res, why = run_guarded(
            lambda b=b: replay(
                trace,
                b,
                tokens_per_block=tokens_per_block,
                gpu_quota_blocks=gpu_blocks,
                host_quota_blocks=host_blocks,
                enable_partial_reuse=partial,
                with_outputs=outputs,
                output_step=output_step,
                progress=progress,
            )
        )
        results[b] = res if why is None else why
    return results


def run(args: argparse.Namespace) -> int:
    """Replay a trace on each chosen backend and print the side-by-side table (or the fleet
    replay with ``--instances``); exit status as in the module docstring."""
    from kvcm.tools.replay import result_rows
    from kvcm.tools.trace import load_trace, reference_figures, total_blocks, unique_blocks

    try:
        full = load_trace(args.trace)
    except (OSError, ValueError) as e:
        print(f"replay: cannot read trace: {e}", file=sys.stderr)
        return 2
    limit = args.limit
    if limit is None and args.trace is None:
        limit = DEFAULT_REPLAY_LIMIT
    start = args.start
    trace = full[start:] if limit is None else full[start : start + limit]
    name = os.path.basename(args.trace) if args.trace else "shipped Mooncake synthetic trace"
    if not trace:
        why = f"it has {len(full)}" + (f", --start {start}" if start else "") + (
            f", --limit {limit}" if limit is not None else ""
        )
        print(f"replay: {args.trace or name}: no requests to replay ({why})", file=sys.stderr)
        return 2
    if args.instances is not None or args.shared_tier is not None:
        return run_fleet(args, trace)
    args.backend = args.backend or ["python", "cpp"]
    B = args.block_size or 32
    uniq: list[int] = []

    def unique() -> int:
        if not uniq:
            uniq.append(unique_blocks(trace, B))
        return uniq[0]

    most = total_blocks(trace, B, args.outputs) + 1
    gpu = _capped("gpu", _quota(args.gpu_blocks, args.gpu_frac, unique), most)
    host = _capped("host", _quota(args.host_blocks, args.host_frac, unique), most)
    gpu_desc = (
        f"{fmt_int(gpu)} blocks"
        if gpu is not None
        else (f"unbounded ({fmt_int(total_blocks(trace, B, args.outputs) + 1)} blocks)")
    )
    where = f" from #{start}" if start else ""
    print(f"trace: {name}, {len(trace)} of {len(full)} requests{where}")
    print(
        f"tokens_per_block={B}, gpu quota {gpu_desc}, host quota "
        f"{fmt_int(host) + ' blocks' if host else 'none'}, partial reuse {'off' if args.no_partial else 'on'}, "
        f"{'prompt + outputs' if args.outputs else 'prompt only'}"
    )
    if gpu is None and not args.outputs:
        ref = reference_figures(trace, B)
        rate = ref.hit_rate_whole_blocks if args.no_partial else ref.hit_rate_partial
        print(f"expected hit rate (from hash_ids): {100 * rate:.2f}%")
    if uniq:
        print(f"unique blocks in this replay: {fmt_int(uniq[0])}")
    sys.stdout.flush()

    results = run_replays(
        args.backend,
        trace,
        tokens_per_block=B,
        gpu_blocks=gpu,
        host_blocks=host,
        partial=not args.no_partial,
        outputs=args.outputs,
        progress=not args.no_progress,
    )
    print()
    print(format_table(["", *results.keys()], result_rows(results)))
    return exit_code(results)


def run_fleet(args: argparse.Namespace, trace: Sequence[Any]) -> int:
    """``replay --instances N[,M..] --shared-tier SPEC``: the fleet replay (kvcm.tools.fleet_replay)."""
    from kvcm.tools.fleet_replay import main_fleet

    if args.instances is None or args.shared_tier is None:
        print("replay: a fleet replay needs both --instances and --shared-tier", file=sys.stderr)
        return 2
    if args.backend is not None and len(args.backend) != 1:
        print("replay: a fleet replay runs on one --backend", file=sys.stderr)
        return 2
    gpu = args.gpu_blocks or 1024
    B = args.block_size or 512
    most = max(r.num_prompt_blocks(B) for r in trace)
    if gpu < most:
        print(f"replay: --gpu-blocks {gpu} cannot hold the longest prompt ({most} blocks)", file=sys.stderr)
        return 2
    try:
        main_fleet(trace, args.instances, args.shared_tier, backend=args.backend[0] if args.backend else None,
                   tokens_per_block=B, page_bytes=args.page_bytes, gpu_blocks=gpu, plot_path=args.plot or None,
                   policies=args.shared_write)
    except (OSError, ValueError, ImportError) as e:
        print(f"replay: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m kvcm replay`` argument parser."""
    r = argparse.ArgumentParser(prog="python -m kvcm replay", epilog=REPLAY_EXIT_CODES)
    r.add_argument("trace", nargs="?", default=None, help="a .jsonl or .jsonl.gz trace (default: the shipped one)")
    r.add_argument("--backend", type=backend_list, default=None,
                   help="comma-separated (default python,cpp; a fleet replay: one, default KVCM_BACKEND)")
    r.add_argument("--block-size", type=int_in(1, 4096), default=None,
                   help="tokens_per_block (default 32; a fleet replay: 512)")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--gpu-blocks", type=int_in(1), default=None, help="gpu quota in blocks (default: unbounded)")
    g.add_argument("--gpu-frac", type=_frac, default=None, help="gpu quota as a fraction of the prefix's unique blocks")
    h = r.add_mutually_exclusive_group()
    h.add_argument(
        "--host-blocks", type=int_in(0), default=None, help="host tier quota in blocks (default: no host tier)"
    )
    h.add_argument("--host-frac", type=_frac, default=None, help="host quota as a fraction of the unique blocks")
    r.add_argument(
        "--limit",
        type=int_in(0),
        default=None,
        help=f"replay the first N requests (default: {DEFAULT_REPLAY_LIMIT} for the shipped trace, all for a file)",
    )
    r.add_argument("--start", type=int_in(0), default=0, help="skip the first N requests (default 0)")
    r.add_argument("--no-partial", action="store_true", help="enable_partial_reuse=False")
    r.add_argument("--outputs", action="store_true", help="also decode and commit the output tokens")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    f = r.add_argument_group("fleet replay (kvcm.tools.fleet_replay): N managers round-robin, local tiers only vs a shared tier")
    f.add_argument("--instances", type=_int_list, default=None, help="N, or a list: 2,4,8")
    f.add_argument("--shared-tier", default=None,
                   help="file:DIR, a directory, mooncake (a local Mooncake Store for the run) or "
                        "mooncake://host:port?metadata=url")
    f.add_argument("--page-bytes", type=int_in(2), default=4096, help="bytes of one page (default 4096)")
    f.add_argument("--shared-write", type=_policies, default=["commit"],
                   help="write policies to run: commit, evict or commit,evict (default commit)")
    f.add_argument("--plot", default="kvcm-fleet.png", help="PNG to write (default kvcm-fleet.png; '' for none)")
    return r


def main(argv: Sequence[str]) -> int:
    """``python -m kvcm replay ...``: returns the exit status (``REPLAY_EXIT_CODES``)."""
    return run(build_parser().parse_args(list(argv)))
