"""``python -m kvcm demo``: the reference engine on a built-in multi-turn workload.

Runs the tiny hybrid model (full attention, sliding window 48 + 4 sinks, ssm, full
attention) through kvcm on each backend, with a tight gpu tier, a small host tier and a disk
tier (a temporary directory), and prints per backend: tokens reused, copy ops by reason
(and by route), and whether the outputs are identical to a no-cache run of the same model.

Exit code: 0 when at least one backend ran and every backend that ran matched the no-cache
run; 1 on a mismatch or an unexpected error; 2 on bad usage (an unknown backend, a
``--device`` -- or ``KVCM_ENGINE_DEVICE`` -- that torch cannot use); a backend without the
request life cycle yet (NotImplementedError) or not built is reported and does not fail
the demo.

One file for the command (issue 36: it was split between ``kvcm.cli.demo``, the dispatcher's
entry, and ``kvcm.tools.demo``, the work): the dispatcher's attributes below, the work after.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence

HELP = "reference engine on a multi-turn workload: reuse, copies, exactness per backend (kvcm.cli.demo)"
ORDER = 50
RECORDS = True

NOT_IMPLEMENTED = "not implemented yet (issue #3)"
TOKENS_PER_BLOCK = 16
LOGIT_TOL = 1e-4
# slots per life cycle: tight enough that requests are suspended and pages go to disk
GPU_SLOTS, HOST_SLOTS, DISK_SLOTS = 14, 4, 300


def _mark(ok: bool) -> str:
    sym = "\u2713" if ok else "\u2717"
    try:
        sym.encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        sym = "OK" if ok else "FAIL"
    return sym


def _unusable_device(device: str) -> str | None:
    """Why torch cannot put a tensor on ``device`` (one line), or None when it can."""
    import torch

    try:
        torch.empty(1, device=torch.device(device))
    except (RuntimeError, ValueError, TypeError, AssertionError) as e:
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None


def _scrape_lines(url: str) -> list[str]:
    """The samples a Prometheus server would scrape from ``url`` that are not zero, but the
    per-state slot counts (a screenful: usage per pool says the same)."""
    import urllib.request

    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return [line for line in body.splitlines()
            if line and not line.startswith("#") and not line.startswith("kvcm:kv_cache_slots")
            and "_created" not in line and float(line.rsplit(" ", 1)[1]) != 0]


def run_backend(backend: str, workload_name: str, device: str | None, metrics_port: int | None = None,
                metrics_addr: str = "127.0.0.1") -> dict:
    """Run the workload on ``backend``; returns the numbers the demo prints.  With
    ``metrics_port`` the manager's Prometheus metrics (kvcm.metrics) are served while it
    runs, and scraped once over HTTP at the end."""
    import kvcm
    from kvcm.engine import TinyHybridModel
    from kvcm.tools.workloads import builtin_workload, run_workload

    model = TinyHybridModel(device=device)
    workload = builtin_workload(workload_name, vocab=model.cfg.vocab)
    with tempfile.TemporaryDirectory(prefix="kvcm-demo-") as disk:
        config = model.manager_config(TOKENS_PER_BLOCK, GPU_SLOTS, HOST_SLOTS, DISK_SLOTS, disk)
        mgr = kvcm.KVCacheManager(config, backend=backend)
        server = None
        if metrics_port is not None:
            from kvcm import metrics

            server = metrics.serve(mgr, metrics_port, metrics_addr, labels={"backend": backend})
            print(f"[{backend}] metrics live at {server.url} while the workload runs", flush=True)
        try:
            t0 = time.perf_counter()
            out = run_workload(model, mgr, workload)
            seconds = time.perf_counter() - t0
            scraped = _scrape_lines(server.url) if server is not None else None
        finally:
            if server is not None:
                server.close()
        mgr.shutdown()
    c = out.engine_counters
    return {
        "requests": c["requests"],
        "prompt_tokens": c["prompt_tokens"],
        "reused_tokens": c["reused_tokens"],
        "computed_tokens": c["prefill_tokens"],
        "preemptions": c["preemptions"],
        "copies": out.copies,
        "routes": out.routes,
        "identical": out.tokens_equal and out.max_logit_diff < LOGIT_TOL,
        "max_logit_diff": out.max_logit_diff,
        "seconds": seconds,
        "metrics": scraped,
    }


def _guarded(backend: str, workload: str, device: str | None, metrics_port: int | None = None,
             metrics_addr: str = "127.0.0.1") -> tuple[dict | None, str | None]:
    from kvcm import BackendUnavailableError

    try:
        return run_backend(backend, workload, device, metrics_port, metrics_addr), None
    except NotImplementedError:
        return None, NOT_IMPLEMENTED
    except BackendUnavailableError as e:
        return None, f"unavailable ({str(e).split(':')[0]})"
    except ImportError as e:
        return None, f"unavailable ({e})"
    except Exception as e:  # noqa: BLE001 - a bug: reported, traceback on stderr
        traceback.print_exc()
        return None, f"error: {type(e).__name__}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcm demo``: returns the exit status (module docstring)."""
    from kvcm.engine import ModelConfig, default_device
    from kvcm.tools.workloads import BUILTIN_WORKLOADS

    p = argparse.ArgumentParser(
        prog="python -m kvcm demo",
        description=__doc__.split("\n\n")[0],
        epilog="exit status: 0 every backend that ran matched the no-cache run; 1 a mismatch or an unexpected "
        "error; 2 bad usage (an unknown backend, an unusable --device)",
    )
    p.add_argument("--backend", default="python,cpp", help="comma-separated backends (default python,cpp)")
    p.add_argument("--workload", choices=sorted(BUILTIN_WORKLOADS), default="multi-turn")
    p.add_argument("--device", default=None, help="where the gpu tier lives (default $KVCM_ENGINE_DEVICE or cpu)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="N",
                   help="serve each backend's Prometheus metrics (kvcm.metrics) on port N while it runs, and print "
                   "one scrape (0: a free port; needs kvcm[metrics])")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="the address the metrics server binds (default 127.0.0.1)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    from kvcm.tools.cmdline import torch_missing

    why = torch_missing("python -m kvcm demo")
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        if not 0 <= args.metrics_port <= 65535:
            p.error(f"--metrics-port {args.metrics_port}: must be in 0..65535")
        try:
            import prometheus_client  # noqa: F401 - only whether the extra is installed
        except ImportError:
            p.error("--metrics-port needs prometheus-client: pip install kvcm[metrics]")
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    from kvcm import BACKENDS

    for b in backends:
        if b not in BACKENDS:
            p.error(f"unknown backend {b!r}; choices: {', '.join(BACKENDS)}")
    why = _unusable_device(args.device or default_device())
    if why is not None:
        where = "--device" if args.device else "KVCM_ENGINE_DEVICE"
        p.error(f"{where} {args.device or default_device()!r}: {why}")

    from kvcm.engine import torch_threads
    from kvcm.tools.workloads import builtin_workload

    mc = ModelConfig()
    w = builtin_workload(args.workload, vocab=mc.vocab)
    print(f"kvcm demo: tiny hybrid model (full attention, window {mc.window} + {mc.sinks} sinks, ssm, full attention), "
          f"float32, seed {mc.seed}, on {args.device or default_device()}")
    print(f"workload {args.workload}: {len(w.conversations)} conversations x {len(w.conversations[0])} turns, "
          f"{len(w.system)}-token system prompt, {w.max_new_tokens} tokens generated per turn")
    print(f"tiers: gpu {GPU_SLOTS} / host {HOST_SLOTS} / disk {DISK_SLOTS} slots per life cycle, "
          f"{TOKENS_PER_BLOCK} tokens per block")
    ran = failed = 0
    for b in backends:
        with torch_threads(1):
            res, why = _guarded(b, args.workload, args.device, args.metrics_port, args.metrics_addr)
        print(f"\n[{b}]")
        if res is None:
            print(f"  {why}")
            failed += why.startswith("error")
            continue
        ran += 1
        failed += not res["identical"]
        share = res["reused_tokens"] / max(1, res["prompt_tokens"])
        cp, routes = res["copies"], res["routes"]
        print(f"  tokens reused       {res['reused_tokens']:,} of {res['prompt_tokens']:,} prompt tokens ({share:.1%}); "
              f"{res['computed_tokens']:,} computed; {res['requests']} requests, {res['preemptions']} preemptions")
        print("  copies by reason    " + ", ".join(f"{k} {v}" for k, v in cp.items()))
        print("  copies by route     " + ", ".join(f"{k} {v}" for k, v in sorted(routes.items())))
        print(f"  {_mark(res['identical'])} outputs identical to no-cache run "
              f"(same tokens; max |logit diff| {res['max_logit_diff']:.1e}); {res['seconds']:.1f}s")
        if res["metrics"] is not None:
            print("  metrics (one scrape over HTTP, non-zero samples but per-state slots):")
            for line in res["metrics"]:
                print(f"    {line}")
    return 0 if ran and not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
