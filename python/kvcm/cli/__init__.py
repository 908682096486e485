"""``python -m kvcm``: info, trace replay, benchmarks and op-log replay.

Subcommands::

    info                                   backend, version, cpp extension and build details
    replay [TRACE] [--backend python,cpp] [--block-size 32] [--gpu-blocks N | --gpu-frac F]
           [--host-blocks N | --host-frac F] [--limit N] [--no-partial] [--outputs]
    replay [TRACE] --instances 2,4,8 --shared-tier file:DIR|mooncake|mooncake://HOST:PORT?metadata=URL
           [--page-bytes 4096] [--gpu-blocks 1024] [--plot kvcm-fleet.png]   (the fleet replay, kvcm.tools.fleet_replay)
    bench [replay|keys|probe|decode|step|ssm|evict|memory|all] [--limit N] [--block-size B] [--quick] ...
    bench vllm [--conversations N] [--turns N] [--gpu-blocks N] ...   (kvcm.integrations.vllm.bench)
    vllm check-config JSON|@FILE           the vLLM connector's kv_connector_extra_config (or kv_transfer_config)
                                           checked offline, without vLLM (kvcm.integrations.vllm.check)
    oplog-replay PATH [--backend python,cpp] ...   (all arguments go to kvcm.oplog.main_replay)
    demo [--backend python,cpp] [--workload multi-turn|shared-system-prompt] [--device cpu]
    events --connect ENDPOINT [--replay ENDPOINT] [--snapshot] | --demo | --bench   (kvcm.cli.events)
    route [TRACE] --instances N[,M] [--policy kv,round-robin,random,least-loaded] [--plot PNG]  (kvcm.cli.route)

Exit status (every command): 0 success; 1 a failure the command reports -- a backend that
raised an unexpected error (``replay``, ``bench``), a divergence (``oplog-replay``), outputs
that differ from the no-cache run (``demo``); 2 bad usage or bad input -- an option out of
range, an unreadable or malformed trace or op log (one line on stderr naming the file, the
line and the field, never a traceback), an unusable ``--device``, an empty replay.

``replay`` runs each backend in turn on the same trace and prints a side-by-side table;
a backend that raises NotImplementedError shows ``not implemented yet (issue #3)`` in its
column (likewise ``unavailable (...)`` for one that is not built).  The exit code is 0
as long as at least one backend ran and none raised anything else; an unexpected error
shows ``error: <type>`` in its column, its traceback on stderr, and makes the exit code 1.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from typing import Any

# The shared table / run helpers, under the names this module has always used for them.
from kvcm.cli.common import best_of as _best_of
from kvcm.cli.common import exit_code as _exit_code
from kvcm.cli.common import fmt_int as _fmt_int
from kvcm.cli.common import format_table as _table
from kvcm.cli.common import int_in as _int_in
from kvcm.cli.common import ratio as _ratio
from kvcm.cli.common import run_guarded as _run_guarded
from kvcm.config import ceildiv

# The default replay: a prefix of the shipped trace the python backend replays in about
# 30 s at tokens_per_block=32 (measured on a 2-core machine: 1,000 requests, 11.9M prompt
# tokens, 26 s of CPU; 500 requests take 11 s).  --limit overrides.  Reuse in this trace
# is long-range: the 1,000-request prefix reuses 17.26% of its prompt tokens, the whole
# trace 65.12%.
DEFAULT_REPLAY_LIMIT = 1000
# ``bench replay`` runs each backend twice (unbounded, then a tight quota that evicts and
# is ~4x slower on python), so it defaults to a shorter prefix.
DEFAULT_BENCH_LIMIT = 500
REPLAY_EXIT_CODES = (
    "exit status: 0 at least one backend ran and none failed; 1 a backend raised an unexpected error "
    "(traceback on stderr); 2 bad usage, or an unreadable or malformed trace (one line naming the file, "
    "line and field), or nothing to replay. A quota above what the replay can use is capped (noted)."
)


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _backends(arg: str) -> list[str]:
    names = [b.strip() for b in arg.split(",") if b.strip()]
    if not names:
        raise argparse.ArgumentTypeError("at least one backend")
    from kvcm import BACKENDS

    for b in names:
        if b not in BACKENDS:
            raise argparse.ArgumentTypeError(f"unknown backend {b!r}; choices: {', '.join(BACKENDS)}")
    return names


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


# ---------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    """``python -m kvcm info``: version, active backend, the cpp extension and its build; exit status 0."""
    import kvcm
    from kvcm._select import ENV_VAR

    env = os.environ.get(ENV_VAR)
    print(f"kvcm {kvcm.__version__}")
    print(f"backend: {kvcm.backend} ({ENV_VAR}={env})" if env else f"backend: {kvcm.backend} (default)")
    print(f"backends: {', '.join(kvcm.BACKENDS)}")
    try:
        ext = kvcm.cpp_extension()
    except ImportError as e:
        print("cpp extension: not importable")
        print(f"  {e}")
    else:
        print(f"cpp extension: importable ({getattr(ext, '__file__', '?')})")
        build_info = getattr(ext, "build_info", None)
        if callable(build_info):
            try:
                info = build_info()
            except Exception as e:  # noqa: BLE001 - diagnostics only
                print(f"  build_info() failed: {e!r}")
            else:
                if isinstance(info, dict):
                    for k, v in info.items():
                        print(f"  {k}: {v}")
                else:
                    print(f"  {info}")
        else:
            print("  (no build_info())")
    print(f"python: {platform.python_version()} ({platform.python_implementation()}, {platform.machine()})")
    try:
        import numpy

        print(f"numpy: {numpy.__version__}")
    except ImportError:
        print("numpy: not installed (optional)")
    from kvcm.tools.trace import load_trace, shipped_trace_path

    try:
        n = len(load_trace())
        print(f"shipped trace: {shipped_trace_path()} ({n} requests)")
    except (OSError, ValueError) as e:
        print(f"shipped trace: unreadable ({e})")
    return 0


# ---------------------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------------------


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
    print(f"note: {what} quota {_fmt_int(quota)} blocks is more than this replay can use; capped at {_fmt_int(most)}")
    return most


def _result_rows(results: dict[str, Any]) -> list[list[str]]:
    def row(label: str, f: Callable[[Any], str]) -> list[str]:
        out = [label]
        for r in results.values():
            out.append(f(r) if not isinstance(r, str) else "")
        return out

    rows = [
        row("hit rate", lambda r: f"{100 * r.hit_rate:.2f}%"),
        row("reused tokens", lambda r: f"{_fmt_int(r.reused_tokens)} / {_fmt_int(r.prompt_tokens)}"),
        row("reused blocks", lambda r: _fmt_int(r.reused_blocks)),
        row(
            "evictions (offload/drop)",
            lambda r: f"{_fmt_int(r.evictions)} ({_fmt_int(r.offloads)}/{_fmt_int(r.drops)})",
        ),
        row("onboards", lambda r: _fmt_int(r.onboards)),
        row("failed / preempted", lambda r: f"{r.failed} / {r.preemptions}"),
        row("requests/s", lambda r: f"{r.requests_per_s:,.1f}" if r.requests else "n/a"),
        row("us/block", lambda r: f"{r.us_per_block:.2f}"),
        row("manager s / wall s", lambda r: f"{r.manager_s:.2f} / {r.wall_s:.2f}"),
    ]
    # a backend that did not run: its reason in the first row, blanks below
    for j, r in enumerate(results.values(), 1):
        if isinstance(r, str):
            rows[0][j] = r
    return rows


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
        res, why = _run_guarded(
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


def cmd_replay(args: argparse.Namespace) -> int:
    """``python -m kvcm replay``: replay a trace on each chosen backend and print the side-by-side table
    (or the fleet replay with ``--instances``); exit status as in the module docstring."""
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
        return cmd_fleet(args, trace)
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
        f"{_fmt_int(gpu)} blocks"
        if gpu is not None
        else (f"unbounded ({_fmt_int(total_blocks(trace, B, args.outputs) + 1)} blocks)")
    )
    where = f" from #{start}" if start else ""
    print(f"trace: {name}, {len(trace)} of {len(full)} requests{where}")
    print(
        f"tokens_per_block={B}, gpu quota {gpu_desc}, host quota "
        f"{_fmt_int(host) + ' blocks' if host else 'none'}, partial reuse {'off' if args.no_partial else 'on'}, "
        f"{'prompt + outputs' if args.outputs else 'prompt only'}"
    )
    if gpu is None and not args.outputs:
        ref = reference_figures(trace, B)
        rate = ref.hit_rate_whole_blocks if args.no_partial else ref.hit_rate_partial
        print(f"expected hit rate (from hash_ids): {100 * rate:.2f}%")
    if uniq:
        print(f"unique blocks in this replay: {_fmt_int(uniq[0])}")
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
    print(_table(["", *results.keys()], _result_rows(results)))
    return _exit_code(results)


def cmd_fleet(args: argparse.Namespace, trace: Sequence[Any]) -> int:
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


# ---------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------


def bench_keys(args: argparse.Namespace) -> None:
    """``bench keys``: block-key throughput of each implementation against the hashlib and raw C++ floors."""
    B = args.block_size
    tokens = _trace_tokens(args.key_tokens)
    n = len(tokens)
    print(f"keys: block_keys of {_fmt_int(n)} tokens, tokens_per_block={B}, best of {args.repeat}")
    inputs = _key_inputs(tokens)
    rates: dict[str, float | None] = {}
    rows: list[list[str]] = []
    _time_block_keys(inputs, n, B, args.repeat, rates, rows)
    _time_hashlib_floor(tokens, B, args.repeat, rates, rows)
    _time_cpp_raw_floor(n, B, args.repeat, rates, rows)
    py, cpp = rates.get("python"), rates.get("cpp")
    rows.append(["speedup cpp/python (block_keys)", _ratio(cpp, py)])
    rows.append(["speedup hashlib/python (Python floor)", _ratio(rates.get("hashlib"), py)])
    # Time relative to the floor: how many raw-loop durations one block_keys call takes.
    floor = rates.get("cpp_raw")
    from kvcm.tools.bench import target as bench_target

    for label, _ in inputs:
        cpp_rate = rates.get(f"cpp{label}")
        target = bench_target("<= 1.5x") if label == "" else ""
        ratio = f"{floor / cpp_rate:.2f}x" if floor and cpp_rate else "n/a"
        rows.append([f"cpp{label or ' list'} time / raw floor{target}", ratio])
    print(_table(["", "throughput"], rows))


def _trace_tokens(count: int) -> list[int]:
    """The first ``count`` prompt tokens of the shipped trace."""
    from kvcm.tools.trace import expand_prompt, load_trace

    tokens: list[int] = []
    for req in load_trace():
        tokens.extend(expand_prompt(req))
        if len(tokens) >= count:
            break
    del tokens[count:]
    return tokens


def _key_inputs(tokens: list[int]) -> list[tuple[str, Any]]:
    """The same tokens in each input form engines pass: a list (the target's case), and
    the int32 buffers that skip the per-object conversion."""
    import array

    inputs: list[tuple[str, Any]] = [("", tokens), (" array('i')", array.array("i", tokens))]
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        inputs.append((" numpy int32", np.asarray(tokens, dtype=np.int32)))
    return inputs


def _time_block_keys(inputs: list[tuple[str, Any]], n: int, B: int, repeat: int,
                     rates: dict[str, float | None], rows: list[list[str]]) -> None:
    """``kvcm.block_keys`` on each backend and input form."""
    import kvcm

    def timed(b: str, toks: Any) -> float:
        kvcm.block_keys(toks, B, backend=b)  # warm-up, untimed: first-call effects are not throughput
        return _best_of(lambda: kvcm.block_keys(toks, B, backend=b), repeat)

    from kvcm.tools.bench import NOT_SELECTED, SELECTED

    for label, toks in inputs:
        for b in ("python", "cpp"):
            if b not in SELECTED:
                rates[f"{b}{label}"] = None
                rows.append([f"block_keys{label} [{b}]", NOT_SELECTED])
                continue
            dt, why = _run_guarded(lambda b=b, toks=toks: timed(b, toks))
            rates[f"{b}{label}"] = n / dt if why is None else None
            rows.append([f"block_keys{label} [{b}]", f"{n / dt / 1e6:.2f} M tokens/s" if why is None else why])


def _time_hashlib_floor(tokens: list[int], B: int, repeat: int, rates: dict[str, float | None],
                        rows: list[list[str]]) -> None:
    """The Python floor: chained hashlib.sha256 over pre-packed blocks."""
    import hashlib
    import struct

    from kvcm.keys import scope_root_key

    n = len(tokens)
    packed = struct.pack(f"<{n}I", *tokens)
    step = 4 * B
    root = scope_root_key(None)

    def raw_loop() -> None:
        key = root
        sha = hashlib.sha256
        for i in range(0, len(packed), step):
            key = sha(key + packed[i : i + step]).digest()

    dt = _best_of(raw_loop, repeat)
    rates["hashlib"] = n / dt
    rows.append(["hashlib raw loop (pre-packed)", f"{n / dt / 1e6:.2f} M tokens/s"])


def _time_cpp_raw_floor(n: int, B: int, repeat: int, rates: dict[str, float | None], rows: list[list[str]]) -> None:
    """The C++ floor: the extension's chained SHA-256 loop without token conversion.  It is
    bench/test surface, so it lives in kvcm._kvcm_cpp_testing, installed beside the production
    module (DECISIONS.md "Mirrored wings and production surface")."""
    raw = None
    try:
        from kvcm import _kvcm_cpp_testing

        raw = getattr(_kvcm_cpp_testing, "raw_sha256_loop", None)
    except ImportError:
        pass
    if not callable(raw):
        rows.append(["cpp raw_sha256_loop", "not available"])
        return
    nblocks = ceildiv(n, B)
    try:
        # raw_sha256_loop(n_blocks, block_bytes) -> elapsed ns of the chained hashes
        dt = min(raw(nblocks, 4 * B) for _ in range(repeat)) / 1e9
    except (TypeError, ValueError) as e:
        rows.append(["cpp raw_sha256_loop", f"call failed ({e})"])
    else:
        rates["cpp_raw"] = n / dt
        rows.append(["cpp raw_sha256_loop", f"{n / dt / 1e6:.2f} M tokens/s"])


# The child of a baseline run imports an older kvcm: the replay module moved to
# kvcm.tools in issue 21, so it tries the new home first and falls back to the old one.
BASELINE_CHILD = (
    "import json, sys\n"
    "try:\n    from kvcm.tools.bench_floor import measure_replay\n"
    "except ImportError:\n    from kvcm.bench_floor import measure_replay\n"
    "print(json.dumps(measure_replay(**json.loads(sys.argv[1]))))"
)


def _replay_in_child(impl: str, limit: int, B: int, gpu: int | None, host: int | None,
                     outputs: bool, baseline: str | None = None) -> tuple[Any, dict]:
    """One replay of ``impl`` (a backend or the floor) in a fresh child process, so that its
    peak RSS is its own and no other run's garbage is collected on its clock:
    ``(ReplayResult or the reason it did not run, {"peak_rss", "base_rss"})``.  ``baseline``:
    a directory holding another kvcm package (e.g. an older checkout's ``python/``) that the
    child imports instead of this one."""
    import json
    import subprocess

    import kvcm
    from kvcm.tools.bench_floor import REPLAY_CHILD
    from kvcm.tools.replay import ReplayResult

    pkg_parent = baseline or os.path.dirname(os.path.dirname(os.path.abspath(kvcm.__file__)))
    child = BASELINE_CHILD if baseline else REPLAY_CHILD
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    spec = {"impl": impl, "limit": limit, "tokens_per_block": B, "gpu": gpu, "host": host, "outputs": outputs,
            "output_step": B}
    p = subprocess.run([sys.executable, "-c", child, json.dumps(spec)], capture_output=True, text=True,
                       env=env, check=False)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        return f"error: child exited {p.returncode}", {}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if "why" in out:
        return out["why"], {}
    return ReplayResult(**out["result"]), {"peak_rss": out["peak_rss"], "base_rss": out["base_rss"]}


def _mib(v: float) -> str:
    return f"{v / 2**20:,.0f} MiB"


def _replay_hash_floor(B: int, repeat: int) -> float | None:
    """µs per block of the extension's raw chained SHA-256 loop (block keys of ``B`` int
    tokens: 32 parent bytes + 4*B token bytes per hash), best of ``repeat`` runs of 100k
    blocks; None without the testing module."""
    try:
        from kvcm import _kvcm_cpp_testing
    except ImportError:
        return None
    n = 100_000
    return min(_kvcm_cpp_testing.raw_sha256_loop(n, 4 * B) for _ in range(max(1, repeat))) / 1e3 / n


def bench_replay(args: argparse.Namespace) -> int:
    """Each backend and the floor (kvcm.tools.bench_floor: a minimal pure-Python prefix cache, a
    measuring stick) replay the same prefix, each run in its own child process; with the
    prompt only, and with the outputs decoded a block at a time."""
    from kvcm.tools.bench_floor import FLOOR
    from kvcm.tools.trace import load_trace, unique_blocks

    B = args.block_size
    limit = args.limit if args.limit is not None else DEFAULT_BENCH_LIMIT
    trace = load_trace(limit=limit)
    uniq = unique_blocks(trace, B)
    tight = max(1, int(0.1 * uniq))
    print(
        f"replay: {len(trace)} requests of the shipped trace, tokens_per_block={B}, {_fmt_int(uniq)} unique blocks, "
        f"each backend's fastest of {args.repeat} run(s) (a shared machine's noise only ever adds time), each run "
        f"in its own child process; floor = a minimal pure-Python prefix cache (kvcm.tools.bench_floor: chained SHA-256 "
        f"keys in a dict, an ordered LRU, refcounts; no tiers, partial blocks, events or stats), a measuring stick, "
        f"not a backend"
    )
    rc = 0
    from kvcm.tools.bench import NOT_SELECTED, SELECTED
    from kvcm.tools.bench import target as bench_target

    impls: tuple[str, ...] = ("python", "cpp", FLOOR)
    if args.baseline:  # the python backend of another kvcm tree, side by side (issue 21's guard)
        impls += (BASELINE,)
        print(f"baseline = the python backend of the kvcm package under {args.baseline}, run in the same loop")
    pools = (("unbounded", None, None), (f"tight: gpu {tight} + host {tight} blocks", tight, tight))
    modes = (("prompt only", False), ("prompt + outputs decoded a block at a time", True))
    for (label, gpu, host), (mode, outputs) in itertools.product(pools, modes):
        results: dict[str, Any] = {}
        rss: dict[str, dict] = {}
        for _ in range(args.repeat):
            for b in impls:
                if b not in (FLOOR, BASELINE) and b not in SELECTED:
                    results[b] = NOT_SELECTED
                    continue
                if b == BASELINE:
                    res, mem = _replay_in_child("python", limit, B, gpu, host, outputs, baseline=args.baseline)
                else:
                    res, mem = _replay_in_child(b, limit, B, gpu, host, outputs)
                prev = results.get(b)
                if prev is None or (not isinstance(prev, str) and (isinstance(res, str) or res.manager_s < prev.manager_s)):
                    results[b] = res  # a failure wins: it is reported
                if mem and (b not in rss or mem["peak_rss"] < rss[b]["peak_rss"]):
                    rss[b] = mem
        rows = _result_rows(results)
        rows.append(["peak RSS (child process)", *(_mib(rss[b]["peak_rss"]) if b in rss else "" for b in impls)])
        rows.append(["peak RSS growth over the start", *(_mib(rss[b]["peak_rss"] - rss[b]["base_rss"])
                                                          if b in rss else "" for b in impls)])
        py, cpp, fl = results.get("python"), results.get("cpp"), results.get(FLOOR)
        pad = [""] * (len(impls) - 3)  # the baseline column, when there is one

        def ok(*rs: Any) -> bool:
            return all(r is not None and not isinstance(r, str) for r in rs)

        rows.append(["time ratio python/cpp", "", _ratio(py.manager_s, cpp.manager_s) if ok(py, cpp) else "n/a", "",
                     *pad])
        rows.append([f"time ratio python/floor{bench_target('<= 1.5x')}", "", "",
                     f"{py.manager_s / fl.manager_s:.2f}x" if ok(py, fl) else "n/a", *pad])
        rows.append([f"peak RSS ratio python/floor{bench_target('<= 2x')}", "", "",
                     f"{rss['python']['peak_rss'] / rss[FLOOR]['peak_rss']:.2f}x" if "python" in rss and FLOOR in rss
                     else "n/a", *pad])
        if args.baseline:
            base = results.get(BASELINE)
            rows.append([f"time ratio python/baseline{bench_target('<= 1.6x')}", "", "", "",
                         f"{py.manager_s / base.manager_s:.2f}x" if ok(py, base) else "n/a"])
        floor = _replay_hash_floor(B, args.repeat)
        if floor is not None:
            rows.append(["raw SHA-256 floor us/block (same run)", "", f"{floor:.3f}", "", *pad])
            if not isinstance(cpp, str):
                ratio = cpp.us_per_block / floor
                rows.append([f"cpp us/block / floor{bench_target('<= 3x')}", "", f"{ratio:.2f}x", "", *pad])
        print(f"\n[{label}; {mode}]")
        print(_table(["", *results.keys()], rows))
        sys.stdout.flush()
        rc = max(rc, _exit_code(results))
    return rc


def cmd_bench(args: argparse.Namespace) -> int:
    """``python -m kvcm bench [WHAT]``: run the selected benchmarks (``all``: each in turn); returns
    the highest exit status among them."""
    from kvcm.tools import bench

    bench.SELECTED = tuple(args.backend)
    bench.QUICK = args.quick
    print(bench.QUICK_NOTE if args.quick else bench.TARGETS_NOTE)
    if args.quick:  # tiny sizes for tests (explicit --limit still wins)
        args.key_tokens = min(args.key_tokens, 20_000)
        args.repeat = 1
        if args.limit is None:
            args.limit = 20
    rc = 0
    if args.what in ("keys", "all"):
        bench_keys(args)
    for name, fn in bench.MICRO.items():
        if args.what in (name, "all"):
            rc = max(rc, fn(args))
    if args.what in ("replay", "all"):
        if args.what == "all":
            print()
        rc = max(rc, bench_replay(args))
    return rc


# ---------------------------------------------------------------------------------------
# oplog-replay
# ---------------------------------------------------------------------------------------


def cmd_oplog_replay(argv: list[str]) -> int:
    """Hand every argument to ``kvcm.oplog.main_replay`` (it owns the options)."""
    from kvcm import oplog  # written separately; imported only when used

    return int(oplog.main_replay(argv) or 0)


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m kvcm`` argument parser (``info``, ``replay``, ``bench``; the other commands
    parse their own arguments)."""
    p = argparse.ArgumentParser(
        prog="python -m kvcm",
        description="kvcm: a KV-cache block manager",
        epilog="exit status: 0 success; 1 a failure the command reports (a backend error, a divergence, a "
        "mismatch); 2 bad usage or bad input (one line naming the file, line and field). "
        "See each command's --help.",
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    sub.add_parser("info", help="active backend, version, cpp extension and build details")
    _add_replay_parser(sub)
    _add_bench_parser(sub)
    # commands that parse their own arguments (each module's --help)
    for name, help_text in _PASS_THROUGH:
        sub.add_parser(name, help=help_text, add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    return p


# (command, help) of the commands whose arguments their own module parses
_PASS_THROUGH = (
    ("oplog-replay", "replay a KVCM_OPLOG file on backends: PATH [--backend python,cpp] (kvcm.oplog)"),
    ("demo", "reference engine on a multi-turn workload: reuse, copies, exactness per backend (kvcm.tools.demo)"),
    ("events", "watch a KV-event stream (--connect ENDPOINT [--replay ENDPOINT]), --demo, --bench (kvcm.cli.events)"),
    ("route", "compare routing policies over N instances behind the router index (kvcm.cli.route)"),
)


def _add_replay_parser(sub: Any) -> None:
    r = sub.add_parser(
        "replay",
        help="replay a trace on one or more backends, side by side",
        epilog=REPLAY_EXIT_CODES,
    )
    r.add_argument("trace", nargs="?", default=None, help="a .jsonl or .jsonl.gz trace (default: the shipped one)")
    r.add_argument("--backend", type=_backends, default=None,
                   help="comma-separated (default python,cpp; a fleet replay: one, default KVCM_BACKEND)")
    r.add_argument("--block-size", type=_int_in(1, 4096), default=None,
                   help="tokens_per_block (default 32; a fleet replay: 512)")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--gpu-blocks", type=_int_in(1), default=None, help="gpu quota in blocks (default: unbounded)")
    g.add_argument("--gpu-frac", type=_frac, default=None, help="gpu quota as a fraction of the prefix's unique blocks")
    h = r.add_mutually_exclusive_group()
    h.add_argument(
        "--host-blocks", type=_int_in(0), default=None, help="host tier quota in blocks (default: no host tier)"
    )
    h.add_argument("--host-frac", type=_frac, default=None, help="host quota as a fraction of the unique blocks")
    r.add_argument(
        "--limit",
        type=_int_in(0),
        default=None,
        help=f"replay the first N requests (default: {DEFAULT_REPLAY_LIMIT} for the shipped trace, all for a file)",
    )
    r.add_argument("--start", type=_int_in(0), default=0, help="skip the first N requests (default 0)")
    r.add_argument("--no-partial", action="store_true", help="enable_partial_reuse=False")
    r.add_argument("--outputs", action="store_true", help="also decode and commit the output tokens")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    f = r.add_argument_group("fleet replay (kvcm.tools.fleet_replay): N managers round-robin, local tiers only vs a shared tier")
    f.add_argument("--instances", type=_int_list, default=None, help="N, or a list: 2,4,8")
    f.add_argument("--shared-tier", default=None,
                   help="file:DIR, a directory, mooncake (a local Mooncake Store for the run) or "
                        "mooncake://host:port?metadata=url")
    f.add_argument("--page-bytes", type=_int_in(2), default=4096, help="bytes of one page (default 4096)")
    f.add_argument("--shared-write", type=_policies, default=["commit"],
                   help="write policies to run: commit, evict or commit,evict (default commit)")
    f.add_argument("--plot", default="kvcm-fleet.png", help="PNG to write (default kvcm-fleet.png; '' for none)")


BASELINE = "baseline"


def _baseline_dir(text: str) -> str:
    """``--baseline DIR``: a directory holding a kvcm package (``DIR/kvcm/__init__.py``)."""
    path = os.path.abspath(text)
    if not os.path.isfile(os.path.join(path, "kvcm", "__init__.py")):
        raise argparse.ArgumentTypeError(f"{text}: no kvcm package here (expected {text}/kvcm/__init__.py)")
    return path


def _add_bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="measure both backends and print python/cpp ratios")
    b.add_argument(
        "what", nargs="?", choices=["replay", "keys", "probe", "decode", "step", "ssm", "evict", "memory", "all"], default="all"
    )
    b.add_argument(
        "--limit", type=_int_in(0), default=None, help=f"replay prefix (default {DEFAULT_BENCH_LIMIT} requests)"
    )
    b.add_argument("--block-size", type=_int_in(1, 4096), default=32)
    b.add_argument("--key-tokens", type=_int_in(1), default=1_000_000, help="tokens hashed by the keys bench")
    b.add_argument("--repeat", type=_int_in(1), default=3, help="keys and replay benches: best of N")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--baseline", type=_baseline_dir, default=None, metavar="DIR",
                   help="replay: also run the python backend of the kvcm package in DIR (e.g. an older checkout's "
                        "python/ directory) in the same loop, and print python/baseline")
    b.add_argument("--backend", type=_backends, default=["python", "cpp"],
                   help="comma-separated backends to measure (default python,cpp; the ratios need both)")
    from kvcm.tools.bench import add_arguments as add_micro_bench_arguments

    add_micro_bench_arguments(b)


# Commands that build managers: a KVCM_OPLOG they could not record to is refused first.
_RECORDING = ("replay", "bench", "demo", "events", "route")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcm ...``: parse ``argv`` (default ``sys.argv[1:]``), run the command, return its
    exit status (0 success, 1 a reported failure, 2 bad usage or bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in _RECORDING and not {"-h", "--help"} & set(argv):
        from kvcm.cli.common import oplog_unusable

        why = oplog_unusable(f"python -m kvcm {argv[0]}")
        if why is not None:
            print(why, file=sys.stderr)
            return 2
    if argv[:1] == ["oplog-replay"]:
        return cmd_oplog_replay(argv[1:])
    if argv[:1] == ["demo"]:
        from kvcm.tools.demo import main as demo_main

        return demo_main(argv[1:])
    if argv[:1] in (["events"], ["route"]):
        from kvcm.cli.common import missing_extra

        try:  # their modules import the optional dependencies (pyzmq, msgspec) at the top
            if argv[0] == "events":
                from kvcm.cli.events import main as command
            else:
                from kvcm.cli.route import main as command
        except ImportError as e:
            why = missing_extra(f"python -m kvcm {argv[0]}", e)
            if why is None:
                raise
            print(why, file=sys.stderr)
            return 2
        return command(argv[1:])
    if argv[:1] == ["vllm"]:  # no vLLM needed: the connector's settings and checks only
        from kvcm.integrations.vllm.check import vllm_command

        return vllm_command(argv[1:])
    if argv[:2] == ["bench", "vllm"]:  # real vLLM engines (kvcm[vllm]): kvcm.integrations.vllm.bench
        try:
            from kvcm.integrations.vllm.bench import main as bench_vllm_main
        except ImportError as e:
            print(f"python -m kvcm bench vllm: cannot import it ({e}); it needs vLLM: pip install 'kvcm[vllm]', "
                  "then pip uninstall torchvision torchaudio torchcodec (README: kvcm inside vLLM)", file=sys.stderr)
            return 2
        return bench_vllm_main(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    if args.cmd == "info":
        return cmd_info(args)
    if args.cmd == "replay":
        return cmd_replay(args)
    return cmd_bench(args)


