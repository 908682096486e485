"""``python -m kvcm vllm SUBCOMMAND``: kvcm's vLLM connector from the command line.

* ``config`` -- vLLM's ``--kv-transfer-config`` JSON, the fixed keys filled, on one line:
  ``--kv-transfer-config "$(python -m kvcm vllm config --host 8GiB --disk /nvme/kvcm:100GiB)"``
  (checked as ``check-config`` checks it before it is printed).
* ``check-config JSON|@FILE`` -- the configuration checked offline, without vLLM, in about a
  second: what the connector would refuse, before an engine start
  (:mod:`kvcm.integrations.vllm.check`); with ``--model DIR --block-size N`` the sizes against
  one of vLLM's blocks too.
* ``make-model DIR`` -- a small random-weight Llama and a word-level tokenizer saved under
  ``DIR``, offline (no hub): what the README's server walk-through serves.

Exit status: 0 done / valid (warnings on stderr), 2 invalid or unreadable (one line on stderr
naming the key).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

HELP = "kvcm in vLLM: config (write --kv-transfer-config), check-config (check it offline), make-model DIR"
ORDER = 80
PROG = "python -m kvcm vllm"
FIXED = {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
         "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def _capacity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="the model's directory (its config.json): check the sizes "
                   "against one of vLLM's blocks, with --block-size")
    p.add_argument("--block-size", type=int, metavar="N", help="vLLM's --block-size (tokens)")
    p.add_argument("--max-model-len", type=int, metavar="N", help="vLLM's --max-model-len (default: the model's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", help="vLLM's --tensor-parallel-size")
    p.add_argument("--dtype", metavar="DTYPE", help="vLLM's --dtype (default auto: the model's, float32 as bfloat16)")
    p.add_argument("--kv-cache-dtype", metavar="DTYPE", help="vLLM's --kv-cache-dtype (default auto: the model's)")


def _report(prog: str, data: object, args: argparse.Namespace) -> tuple[int, object]:
    from kvcm.integrations.vllm.check import check, check_capacity  # no vLLM: the settings and their checks

    try:
        settings, warnings = check(data)
        capacity, more = check_capacity(settings, args.model, args.block_size, args.max_model_len,
                                        args.tensor_parallel_size, args.kv_cache_dtype, args.dtype)
    except (ValueError, TypeError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2, None
    for w in warnings + more:
        print(f"warning: {w}", file=sys.stderr)
    return 0, (settings, capacity)


def check_config(argv: Sequence[str]) -> int:
    """``check-config JSON|@FILE [--model DIR --block-size N]``: 0 valid, 2 invalid (one line on stderr)."""
    prog = f"{PROG} check-config"
    p = argparse.ArgumentParser(prog=prog, description="check a vLLM kv_connector_extra_config (or the whole "
                                "kv_transfer_config) offline, without vLLM",
                                epilog="exit status: 0 valid (a summary; warnings on stderr), 2 invalid or unreadable "
                                "(one line naming the key)")
    p.add_argument("config", help="kv_connector_extra_config or kv_transfer_config as JSON, or @FILE")
    _capacity_args(p)
    args = p.parse_args(list(argv))
    text = args.config
    try:
        if text.startswith("@"):
            with open(text[1:], encoding="utf-8") as f:
                text = f.read()
        data = json.loads(text)
    except OSError as e:
        print(f"{prog}: cannot read {text[1:]!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{prog}: not JSON: {e}", file=sys.stderr)
        return 2
    rc, got = _report(prog, data, args)
    if rc == 0:
        from kvcm.integrations.vllm.check import summary

        settings, capacity = got  # type: ignore[misc]
        print(summary(settings, capacity))
    return rc


def _tier(text: str, what: str) -> tuple[str, str]:
    path, sep, size = text.rpartition(":")
    if not sep or not path or not size:
        raise argparse.ArgumentTypeError(f"{what} must be DIR:SIZE (e.g. /nvme/kvcm:100GiB), got {text!r}")
    return path, size


def config(argv: Sequence[str]) -> int:
    """``config --host SIZE [--disk DIR:SIZE] [--shared LOCATION [--shared-size SIZE]] [--set KEY=VALUE]``:
    the ``--kv-transfer-config`` JSON on one line; 2 (one line) when the connector would refuse it."""
    prog = f"{PROG} config"
    p = argparse.ArgumentParser(
        prog=prog, description="print vLLM's --kv-transfer-config for kvcm (the fixed keys filled), checked as "
        "check-config checks it",
        epilog='use: vllm serve MODEL --kv-transfer-config "$(python -m kvcm vllm config --host 8GiB)".  Sizes: bytes '
        'or 8GiB, 500MB, ...  exit status: 0 printed, 2 invalid (one line naming the key)')
    p.add_argument("--host", metavar="SIZE", help="kvcm's host tier (host_bytes; default 1GiB)")
    p.add_argument("--disk", metavar="DIR:SIZE", type=lambda t: _tier(t, "--disk"),
                   help="kvcm's disk tier (disk_path, disk_bytes)")
    p.add_argument("--shared", metavar="LOCATION", help="the shared tier: a directory, file:///dir?timeout_s=S or "
                   "mooncake://host:port?metadata=URL")
    p.add_argument("--shared-size", metavar="SIZE", help="shared_bytes (a directory store's cap, default 64GiB; "
                   "'unbounded')")
    p.add_argument("--config-file", metavar="PATH", help="a YAML or JSON file of the keys (config_file)")
    p.add_argument("--backend", choices=("cpp", "python"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other kv_connector_extra_config key (VALUE: JSON, else a string); repeatable")
    p.add_argument("--pretty", action="store_true", help="indented JSON instead of one line")
    _capacity_args(p)
    args = p.parse_args(list(argv))
    extra: dict[str, object] = {}
    if args.config_file:
        extra["config_file"] = os.path.abspath(args.config_file)  # the engine may start elsewhere
    if args.backend:
        extra["backend"] = args.backend
    if args.host:
        extra["host_bytes"] = args.host
    if args.disk:
        extra["disk_path"], extra["disk_bytes"] = args.disk
    if args.shared:
        extra["shared"] = args.shared
    if args.shared_size:
        extra["shared_bytes"] = args.shared_size
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"{prog}: --set takes KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        try:
            extra[key] = json.loads(value)
        except ValueError:
            extra[key] = value
    data = {**FIXED, "kv_connector_extra_config": extra}
    rc, _ = _report(prog, data, args)
    if rc == 0:
        print(json.dumps(data, indent=2 if args.pretty else None))
    return rc


def make_model(argv: Sequence[str]) -> int:
    """``make-model DIR``: a random-weight model and a tokenizer saved offline (needs torch and
    transformers, which vLLM installs); 0 saved (or already there), 2 bad usage."""
    p = argparse.ArgumentParser(
        prog=f"{PROG} make-model",
        description="save a small random-weight Llama (2 layers, 2 KV heads x 64, bfloat16, 512-word vocabulary) and a "
        "word-level tokenizer (token i is the word t<i>) under DIR, offline: a model to try kvcm in vLLM on. "
        "Its outputs are random words; its KV cache is real.")
    p.add_argument("dir", help="where to save it (reused when a model is there already)")
    p.add_argument("--seed", type=int, default=20261201, help="the weights' seed (another seed: another model)")
    args = p.parse_args(list(argv))
    from kvcm.bench.vllm_workload import make_model as save_model
    from kvcm.bench.vllm_workload import save_tokenizer

    fresh = not os.path.exists(os.path.join(args.dir, "config.json"))
    if fresh:
        os.makedirs(args.dir, mode=0o700, exist_ok=True)
        os.chmod(args.dir, 0o700)  # kvcm's files: 0600 in a 0700 directory, whatever the umask
    path = save_model(args.dir, seed=args.seed, dtype="bfloat16")  # vLLM's auto dtype: loaded as saved
    save_tokenizer(path)
    if fresh:
        for name in os.listdir(path):
            os.chmod(os.path.join(path, name), 0o600)
    print(path)
    return 0


SUBCOMMANDS = {"config": config, "check-config": check_config, "make-model": make_model}


def main(argv: Sequence[str]) -> int:
    """``python -m kvcm vllm SUBCOMMAND ...`` (:data:`SUBCOMMANDS`); 2 for anything else."""
    argv = list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    usage = (f"usage: {PROG} {{config,check-config,make-model}} ...  ({PROG} SUBCOMMAND --help)\n"
             f"  config        print --kv-transfer-config for kvcm: {PROG} config --host 8GiB --disk DIR:100GiB\n"
             f"  check-config  check a configuration offline: {PROG} check-config JSON|@FILE [--model DIR --block-size N]\n"
             f"  make-model    save a small random-weight model offline: {PROG} make-model DIR")
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    print(usage, file=sys.stderr)
    return 2
