"""One reference-engine instance as a process: ``python -m kvcm.tools.engine_instance``.

Runs built-in workloads (:mod:`kvcm.tools.workloads`) through :mod:`kvcm.engine` on a
manager of the chosen backend and tiers, compares every output with the no-cache run and
prints what was reused.  Instances given the same ``--shared-tier`` reuse each other's
prefill (DECISIONS.md "The shared tier"); ``--json`` writes the outcome (tokens and logits
included).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from kvcm.engine import QuotaTooSmallError, TinyHybridModel, torch_threads
from kvcm.tools.cmdline import backend_arg, int_in, names_in, oplog_unusable, torch_missing, writable_file
from kvcm.tools.workloads import BUILTIN_WORKLOADS, builtin_workload, run_workload

PROG = "python -m kvcm.tools.engine_instance"


def instance_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run the reference engine on a built-in workload through kvcm (one engine instance); "
                    "instances given the same --shared-tier reuse each other's prefill.")
    p.add_argument("--workload", default=["shared-system-prompt"], type=names_in(sorted(BUILTIN_WORKLOADS), "workload"),
                   help=f"one or more (comma-separated, run in order) of {', '.join(sorted(BUILTIN_WORKLOADS))}")
    p.add_argument("--backend", type=backend_arg, default=None, help="kvcm backend (default: KVCM_BACKEND)")
    p.add_argument("--shared-tier", default=None,
                   help="the shared store: a directory, file:///dir or mooncake://host:port?metadata=url")
    p.add_argument("--shared-quota-bytes", type=int_in(0), default=0,
                   help="file store: byte cap; Mooncake: bytes this client mounts (0: none)")
    p.add_argument("--shared-write", default="commit", choices=("commit", "evict"))
    p.add_argument("--namespace", default="kvcm-tiny-hybrid", help="the layout fingerprint's model/namespace")
    p.add_argument("--block", type=int_in(1, 4096), default=16, help="tokens per block")
    p.add_argument("--gpu-slots", type=int_in(1), default=1000, help="gpu slots per life cycle (default 1000)")
    p.add_argument("--host-slots", type=int_in(0), default=0, help="host slots per life cycle (default 0: none)")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the no-cache run")
    p.add_argument("--json", default=None, help="write the outcome here (requests' tokens and logits included)")
    return p


def run_instance(args: argparse.Namespace) -> dict:
    """One engine instance (see :func:`instance_parser`); returns the outcome as JSON-able."""
    from kvcm import KVCacheManager

    model = TinyHybridModel()
    config = model.manager_config(args.block, args.gpu_slots, host_slots=args.host_slots or None,
                                  shared=args.shared_tier, shared_quota_bytes=args.shared_quota_bytes,
                                  shared_write=args.shared_write, shared_namespace=args.namespace)
    kw = {"backend": args.backend} if args.backend else {}
    mgr = KVCacheManager(config, **kw)
    with torch_threads(1):
        out = run_workload(model, mgr, [builtin_workload(w, model.cfg.vocab) for w in args.workload],
                           check=not args.no_check)
    mgr.shutdown()
    return {
        "backend": mgr.backend_name,
        "tokens_equal": out.tokens_equal, "max_logit_diff": out.max_logit_diff,
        "counters": out.engine_counters, "copies": out.copies, "routes": out.routes, "shared": out.shared,
        "stats": out.stats,
        "requests": [{"prompt": r.prompt, "output": r.output, "reused_tokens": r.reused_tokens,
                      "shared_hits": r.shared_hits, "rollbacks": r.rollbacks,
                      "logits": [row.tolist() for row in r.logits]} for r in out.requests],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 the outputs equal the no-cache run (or ``--no-check``); 1 they
    differ; 2 bad usage or bad input (an option out of range, an unusable shared tier or
    ``--json`` path, a quota too small for a request): one line, never a traceback."""
    import sys

    from kvcm.api import ConfigError

    prog = PROG
    args = instance_parser().parse_args(argv)
    why = torch_missing(prog) or oplog_unusable(prog)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    if args.json:
        why = writable_file(prog, "--json", args.json)
        if why is not None:
            print(why, file=sys.stderr)
            return 2
    try:
        res = run_instance(args)
    except (ConfigError, ValueError, OSError, ImportError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except QuotaTooSmallError as e:
        print(f"{prog}: {e} (--gpu-slots {args.gpu_slots})", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    c = res["counters"]
    print(f"requests {c['requests']}  prompt tokens {c['prompt_tokens']}  reused {c['reused_tokens']}  "
          f"prefilled {c['prefill_tokens']}  shared hits {c['shared_hits']}  "
          f"onboarded from shared {res['routes'].get('shared->gpu', 0)}  stored {res['copies'].get('store', 0)}  "
          f"rollbacks {c['rollbacks']}")
    if not args.no_check:
        print(f"exact vs no-cache run: tokens {'equal' if res['tokens_equal'] else 'DIFFER'}, "
              f"max |logit diff| {res['max_logit_diff']:.2e}")
        return 0 if res["tokens_equal"] else 1
    return 0




__all__ = ["instance_parser", "main", "run_instance"]


if __name__ == "__main__":
    raise SystemExit(main())
