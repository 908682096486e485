"""``python -m kvcm vllm SUBCOMMAND``: kvcm's vLLM connector from the command line.

* ``config`` -- vLLM's ``--kv-transfer-config`` JSON, the fixed keys filled, on one line:
  ``--kv-transfer-config "$(python -m kvcm vllm config --host 8GiB --disk /nvme/kvcm:100GiB)"``
  (checked as ``check-config`` checks it before it is printed).
* ``check-config JSON|@FILE`` -- the configuration checked offline, without vLLM, in about a
  second: what the connector would refuse, before an engine start (:func:`check`); with
  ``--model DIR --block-size N`` the sizes against one of vLLM's blocks too
  (:func:`model_layout`, :func:`check_capacity`).  Checked: every key, type, range and
  combination (a ``config_file`` / ``KVCM_CONFIG`` file's keys too), the paths (the disk
  tier's and a directory store's: creatable and writable, with the free space they need), the
  store's location, ``shared_store_class`` importable, the backend it resolves to importable
  (nothing is created); with the model, the capacity rules the connector applies when vLLM
  starts it (:meth:`ConnectorSettings.check_capacity`).  Not checked: the model's identity
  (its weights are read by the engine), and the sizes when the model's KV layout cannot be
  read from its ``config.json`` (:func:`model_layout` says why).
* ``make-model DIR`` -- a small random-weight Llama and a word-level tokenizer saved under
  ``DIR``, offline (no hub): what the README's server walk-through serves.

Exit status: 0 done / valid (warnings on stderr), 2 invalid or unreadable (one line on stderr
naming the key).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

# the connector's settings and checks, without vLLM (light: no torch, no vLLM)
from kvcm.integrations.vllm.identity import size_text
from kvcm.integrations.vllm.settings import ConnectorSettings, KvLayout
from kvcm.integrations.vllm.startup import CONNECTOR, check_transfer_config

HELP = "kvcm in vLLM: config (write --kv-transfer-config), check-config (check it offline), make-model DIR"
ORDER = 80
PROG = "python -m kvcm vllm"
FIXED = {"kv_connector": "KvcmConnector", "kv_connector_module_path": "kvcm.integrations.vllm",
         "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


# ---------------------------------------------------------------- check-config: what is checked

MODULE = "kvcm.integrations.vllm"
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def _hint(got: object, want: str) -> str:
    if isinstance(got, str) and difflib.get_close_matches(got, [want], n=1, cutoff=0.6):
        return f" (a typo of {want!r}?)"
    return ""


def check(data: object) -> tuple[ConnectorSettings, list[str]]:
    """The settings ``data`` gives and the warnings; ValueError or TypeError (one line) when invalid."""
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object (kv_connector_extra_config or kv_transfer_config), got "
                         f"{type(data).__name__}")
    notes = []
    if "kv_connector" in data or "kv_connector_extra_config" in data or "kv_connector_module_path" in data:
        got = data.get("kv_connector")
        if got != CONNECTOR:
            raise ValueError(f'kv_transfer_config["kv_connector"] must be "{CONNECTOR}", got {got!r}{_hint(got, CONNECTOR)}')
        got = data.get("kv_connector_module_path")
        if got != MODULE:
            raise ValueError(f'kv_transfer_config["kv_connector_module_path"] must be "{MODULE}", got '
                             f"{got!r}{_hint(got, MODULE)}")
        settings = check_transfer_config(data)
    else:
        settings = ConnectorSettings.parse(data)
        notes.append('the kv_transfer_config around it also needs "kv_connector": "KvcmConnector", '
                     '"kv_connector_module_path": "kvcm.integrations.vllm", "kv_role": "kv_both", '
                     '"kv_load_failure_policy": "recompute" (python -m kvcm vllm config writes all of it)')
    return settings, settings.check_environment() + notes


def resolved_dtype(config_dtype: str, dtype: str | None = None, kv_cache_dtype: str | None = None) -> str:
    """The KV cache's dtype as vLLM 0.32 resolves it: ``--kv-cache-dtype`` unless ``auto``,
    else the model's dtype: ``--dtype`` unless ``auto``, else the config's, float32 weights
    running in bfloat16 (vLLM's ``auto`` downcasts them: measured, the walk-through's fp32
    model gets a bfloat16 cache on the CPU build)."""
    if kv_cache_dtype not in (None, "auto"):
        return kv_cache_dtype
    if dtype not in (None, "auto"):
        return dtype
    return "bfloat16" if config_dtype in ("float32", "float") else config_dtype


def model_layout(model: str, block_size: int, tensor_parallel_size: int = 1,
                 kv_cache_dtype: str | None = None, dtype: str | None = None) -> tuple[KvLayout, int] | str:
    """vLLM's KV layout of one rank and the model's ``max_position_embeddings``, read from
    ``model/config.json`` for a full-attention decoder (the layout vLLM gives it:
    ``2 x block_size x kv_heads / tp x head_dim x dtype`` bytes a layer, the dtype as
    :func:`resolved_dtype`); else a sentence saying why the sizes cannot be checked (not a
    directory, a sliding-window or hybrid model, an unknown dtype)."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return f"no {path} (a hub name is not read: give the model's directory)"
    try:
        with open(path, encoding="utf-8") as f:
            cfg: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as e:
        return f"{path} unreadable: {e}"
    cfg = cfg.get("text_config") or cfg
    if cfg.get("sliding_window") or cfg.get("layer_types") or cfg.get("layers_block_type"):
        return f"{path}: a sliding-window or hybrid model (its KV cache groups are vLLM's to lay out)"
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        return f"{path}: no {e} (not a decoder config kvcm can read)"
    dtype = resolved_dtype(str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"), dtype, kv_cache_dtype)
    if dtype not in DTYPE_BYTES:
        return f"{path}: dtype {dtype!r} unknown here (give --dtype or --kv-cache-dtype)"
    if kv % tensor_parallel_size:
        return f"{kv} KV heads do not split over {tensor_parallel_size} ranks"
    block = 2 * block_size * (kv // tensor_parallel_size) * head_dim * DTYPE_BYTES[dtype]
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    layout = KvLayout(block_size, names, (block,) * layers,
                      f"FullAttentionSpec:{kv // tensor_parallel_size}x{head_dim}:{dtype}:B{block_size}")
    return layout, int(cfg.get("max_position_embeddings") or 0)


def check_capacity(settings: ConnectorSettings, model: str | None, block_size: int | None,
                   max_model_len: int | None = None, tensor_parallel_size: int = 1,
                   kv_cache_dtype: str | None = None, dtype: str | None = None) -> tuple[str, list[str]]:
    """The connector's capacity rules (ValueError naming the key, as the engine would refuse)
    for ``model`` at ``block_size``: a note for the summary (what was checked, or exactly what
    was not and why) and the warnings."""
    if model is None or block_size is None:
        missing = " and ".join(f"--{n}" for n, v in (("model DIR", model), ("block-size N", block_size)) if v is None)
        return f"sizes against vLLM's block NOT checked (give {missing})", []
    got = model_layout(model, block_size, tensor_parallel_size, kv_cache_dtype, dtype)
    if isinstance(got, str):
        return f"sizes against vLLM's block NOT checked: {got}", []
    layout, max_pos = got
    mml = max_model_len or max_pos or block_size
    warnings = settings.check_capacity(layout, mml, 0, tensor_parallel_size)
    page = layout.page_bytes
    kv_dtype = layout.describe.split(":")[2]
    return (f"vLLM block {block_size} tokens = {size_text(page)} per kvcm page ({len(layout.layer_names)} layers, "
            f"{kv_dtype}), "
            f"host {settings.host_bytes // page} blocks, max_model_len {mml}"), warnings


def summary(s: ConnectorSettings, capacity: str | None = None) -> str:
    tiers = [f"host {size_text(s.host_bytes)}"]
    if s.disk_path is not None:
        tiers.append(f"disk {size_text(s.disk_bytes)} at {s.disk_path}")
    if s.shared is not None:
        if s.store_kind == "mooncake":
            cap = f"this instance mounts {size_text(s.shared_bytes)}"
        else:
            cap = f"cap {size_text(s.shared_bytes)}" if s.shared_bytes else "no cap"
        ident = ("named by shared_namespace only (model_identity off)" if s.model_identity == "off"
                 else f"named by the model's weights ({s.model_identity})"
                 + (f" and {s.shared_namespace!r}" if s.shared_namespace else ""))
        tiers.append(f"shared {s.shared} ({s.store_kind}, {cap}, written on {s.shared_write}; objects {ident})")
    if s.config_file is not None:
        tiers.append(f"keys from {s.config_file}")
    if capacity is not None:
        tiers.append(capacity)
    return f"ok: backend {s.resolved_backend()}; " + "; ".join(tiers)


# ---------------------------------------------------------------- the subcommands

def _capacity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="the model's directory (its config.json): check the sizes "
                   "against one of vLLM's blocks, with --block-size")
    p.add_argument("--block-size", type=int, metavar="N", help="vLLM's --block-size (tokens)")
    p.add_argument("--max-model-len", type=int, metavar="N", help="vLLM's --max-model-len (default: the model's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", help="vLLM's --tensor-parallel-size")
    p.add_argument("--dtype", metavar="DTYPE", help="vLLM's --dtype (default auto: the model's, float32 as bfloat16)")
    p.add_argument("--kv-cache-dtype", metavar="DTYPE", help="vLLM's --kv-cache-dtype (default auto: the model's)")


def _report(prog: str, data: object, args: argparse.Namespace) -> tuple[int, object]:

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
