"""``python -m kvcm bench [WHAT]``: measure both backends and print python/cpp ratios.

``keys`` (block-key throughput against the hashlib and raw C++ floors) and ``replay``
(each backend and the floor replaying the same prefix, each run in its own child process)
are here; the micro benchmarks (probe, decode, step, ssm, evict, memory) are
:mod:`kvcm.bench.micro`; ``bench vllm`` is :mod:`kvcm.bench.vllm` and ``bench disagg``
:mod:`kvcm.bench.disagg` (real vLLM engines, ``kvcm[vllm]``), ``bench transformers``
:mod:`kvcm.bench.transformers` (transformers' continuous batching, ``kvcm[transformers]``).
Each figure is judged against a floor measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvcm.config import ceildiv
from kvcm.tools.cmdline import backend_list, best_of, exit_code, fmt_int, format_table, int_in, ratio, run_guarded

HELP = "measure both backends and print python/cpp ratios"
ORDER = 30
RECORDS = True

# ``bench replay`` runs each backend twice (unbounded, then a tight quota that evicts and
# is ~4x slower on python), so it defaults to a shorter prefix than ``replay``.
DEFAULT_BENCH_LIMIT = 500


BASELINE = "baseline"


def bench_keys(args: argparse.Namespace) -> None:
    """``bench keys``: block-key throughput of each implementation against the hashlib and raw C++ floors."""
    B = args.block_size
    tokens = _trace_tokens(args.key_tokens)
    n = len(tokens)
    print(f"keys: block_keys of {fmt_int(n)} tokens, tokens_per_block={B}, best of {args.repeat}")
    inputs = _key_inputs(tokens)
    rates: dict[str, float | None] = {}
    rows: list[list[str]] = []
    _time_block_keys(inputs, n, B, args.repeat, rates, rows)
    _time_hashlib_floor(tokens, B, args.repeat, rates, rows)
    _time_cpp_raw_floor(n, B, args.repeat, rates, rows)
    py, cpp = rates.get("python"), rates.get("cpp")
    rows.append(["speedup cpp/python (block_keys)", ratio(cpp, py)])
    rows.append(["speedup hashlib/python (Python floor)", ratio(rates.get("hashlib"), py)])
    # Time relative to the floor: how many raw-loop durations one block_keys call takes.
    floor = rates.get("cpp_raw")
    from kvcm.bench.micro import target as bench_target

    for label, _ in inputs:
        cpp_rate = rates.get(f"cpp{label}")
        target = bench_target("<= 1.5x") if label == "" else ""
        times = f"{floor / cpp_rate:.2f}x" if floor and cpp_rate else "n/a"
        rows.append([f"cpp{label or ' list'} time / raw floor{target}", times])
    print(format_table(["", "throughput"], rows))


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
        return best_of(lambda: kvcm.block_keys(toks, B, backend=b), repeat)

    from kvcm.bench.micro import NOT_SELECTED, SELECTED

    for label, toks in inputs:
        for b in ("python", "cpp"):
            if b not in SELECTED:
                rates[f"{b}{label}"] = None
                rows.append([f"block_keys{label} [{b}]", NOT_SELECTED])
                continue
            dt, why = run_guarded(lambda b=b, toks=toks: timed(b, toks))
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

    dt = best_of(raw_loop, repeat)
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


# The child of a baseline run imports an older kvcm: the floor moved to kvcm.tools in issue
# 21 and to kvcm.bench in issue 36, so it tries the newest home first, then the older ones.
BASELINE_CHILD = (
    "import json, sys\n"
    "try:\n    from kvcm.bench.floor import measure_replay\n"
    "except ImportError:\n"
    "    try:\n        from kvcm.tools.bench_floor import measure_replay\n"
    "    except ImportError:\n        from kvcm.bench_floor import measure_replay\n"
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
    from kvcm.bench.floor import REPLAY_CHILD
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
    """Each backend and the floor (kvcm.bench.floor: a minimal pure-Python prefix cache, a
    measuring stick) replay the same prefix, each run in its own child process; with the
    prompt only, and with the outputs decoded a block at a time."""
    from kvcm.bench.floor import FLOOR
    from kvcm.tools.replay import result_rows
    from kvcm.tools.trace import load_trace, unique_blocks

    B = args.block_size
    limit = args.limit if args.limit is not None else DEFAULT_BENCH_LIMIT
    trace = load_trace(limit=limit)
    uniq = unique_blocks(trace, B)
    tight = max(1, int(0.1 * uniq))
    print(
        f"replay: {len(trace)} requests of the shipped trace, tokens_per_block={B}, {fmt_int(uniq)} unique blocks, "
        f"each backend's fastest of {args.repeat} run(s) (a shared machine's noise only ever adds time), each run "
        f"in its own child process; floor = a minimal pure-Python prefix cache (kvcm.bench.floor: chained SHA-256 "
        f"keys in a dict, an ordered LRU, refcounts; no tiers, partial blocks, events or stats), a measuring stick, "
        f"not a backend"
    )
    rc = 0
    from kvcm.bench.micro import NOT_SELECTED, SELECTED
    from kvcm.bench.micro import target as bench_target

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
        rows = result_rows(results)
        rows.append(["peak RSS (child process)", *(_mib(rss[b]["peak_rss"]) if b in rss else "" for b in impls)])
        rows.append(["peak RSS growth over the start", *(_mib(rss[b]["peak_rss"] - rss[b]["base_rss"])
                                                          if b in rss else "" for b in impls)])
        py, cpp, fl = results.get("python"), results.get("cpp"), results.get(FLOOR)
        pad = [""] * (len(impls) - 3)  # the baseline column, when there is one

        def ok(*rs: Any) -> bool:
            return all(r is not None and not isinstance(r, str) for r in rs)

        rows.append(["time ratio python/cpp", "", ratio(py.manager_s, cpp.manager_s) if ok(py, cpp) else "n/a", "",
                     *pad])
        rows.append([f"time ratio python/floor{bench_target('<= 7x')}", "", "",
                     f"{py.manager_s / fl.manager_s:.2f}x" if ok(py, fl) else "n/a", *pad])
        rows.append([f"peak RSS ratio python/floor{bench_target('<= 2x')}", "", "",
                     f"{rss['python']['peak_rss'] / rss[FLOOR]['peak_rss']:.2f}x" if "python" in rss and FLOOR in rss
                     else "n/a", *pad])
        if args.baseline:
            base = results.get(BASELINE)
            rows.append(["time ratio python/baseline", "", "", "",
                         f"{py.manager_s / base.manager_s:.2f}x" if ok(py, base) else "n/a"])
        floor = _replay_hash_floor(B, args.repeat)
        if floor is not None:
            rows.append(["raw SHA-256 floor us/block (same run)", "", f"{floor:.3f}", "", *pad])
            if not isinstance(cpp, str):
                times = cpp.us_per_block / floor
                rows.append([f"cpp us/block / floor{bench_target('<= 3x')}", "", f"{times:.2f}x", "", *pad])
        print(f"\n[{label}; {mode}]")
        print(format_table(["", *results.keys()], rows))
        sys.stdout.flush()
        rc = max(rc, exit_code(results))
    return rc


def run(args: argparse.Namespace) -> int:
    """Run the selected benchmarks (``all``: each in turn); returns the highest exit status
    among them."""
    from kvcm.bench import micro as bench

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


def _baseline_dir(text: str) -> str:
    """``--baseline DIR``: a directory holding a kvcm package (``DIR/kvcm/__init__.py``)."""
    path = os.path.abspath(text)
    if not os.path.isfile(os.path.join(path, "kvcm", "__init__.py")):
        raise argparse.ArgumentTypeError(f"{text}: no kvcm package here (expected {text}/kvcm/__init__.py)")
    return path


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m kvcm bench`` argument parser (the micro benchmarks add theirs)."""
    b = argparse.ArgumentParser(
        prog="python -m kvcm bench",
        epilog="real engines: python -m kvcm bench vllm|disagg|transformers --help (kvcm.bench)")
    b.add_argument(
        "what", nargs="?", choices=["replay", "keys", "probe", "decode", "step", "ssm", "evict", "memory", "all"], default="all"
    )
    b.add_argument(
        "--limit", type=int_in(0), default=None, help=f"replay prefix (default {DEFAULT_BENCH_LIMIT} requests)"
    )
    b.add_argument("--block-size", type=int_in(1, 4096), default=32)
    b.add_argument("--key-tokens", type=int_in(1), default=1_000_000, help="tokens hashed by the keys bench")
    b.add_argument("--repeat", type=int_in(1), default=3, help="keys and replay benches: best of N")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--baseline", type=_baseline_dir, default=None, metavar="DIR",
                   help="replay: also run the python backend of the kvcm package in DIR (e.g. an older checkout's "
                        "python/ directory) in the same loop, and print python/baseline")
    b.add_argument("--backend", type=backend_list, default=["python", "cpp"],
                   help="comma-separated backends to measure (default python,cpp; the ratios need both)")
    from kvcm.bench.micro import add_arguments as add_micro_bench_arguments

    add_micro_bench_arguments(b)
    return b


# The benchmarks that run a real engine, each a module of :mod:`kvcm.bench` with its own
# ``main(argv)``, and the extra that module needs (named when it cannot be imported).
ENGINE_BENCHES = {
    "vllm": ("kvcm.bench.vllm", ("it needs vLLM: pip install 'kvcm[vllm]', then pip uninstall torchvision "
                                 "torchaudio torchcodec (README: kvcm inside vLLM)")),
    "disagg": ("kvcm.bench.disagg", "it needs vLLM: pip install 'kvcm[vllm]'"),
    "transformers": ("kvcm.bench.transformers", "it needs transformers: pip install 'kvcm[transformers]'"),
}


def main(argv: Sequence[str]) -> int:
    """``python -m kvcm bench ...``: returns the highest exit status of the benchmarks run
    (``bench vllm|disagg|transformers ...``: that command's)."""
    argv = list(argv)
    if argv[:1] and argv[0] in ENGINE_BENCHES:  # real engines: kvcm.bench.<what>
        import importlib

        module, needs = ENGINE_BENCHES[argv[0]]
        try:
            engine_bench = importlib.import_module(module)
        except ImportError as e:
            print(f"python -m kvcm bench {argv[0]}: cannot import it ({e}); {needs}", file=sys.stderr)
            return 2
        return engine_bench.main(argv[1:])
    return run(build_parser().parse_args(argv))
