"""What ``python -m kvcm vllm check-config JSON`` (:mod:`kvcm.cli.vllm`) checks: the
connector's configuration offline, without vLLM, in about a second -- what the connector
would refuse, before an engine start.

``JSON`` is a ``kv_connector_extra_config`` object or a whole ``kv_transfer_config`` (the
object given to ``--kv-transfer-config``; then its connector, module path and
``kv_load_failure_policy`` are checked too), inline or ``@FILE``.  Checked: every key, type,
range and combination (a ``config_file`` / ``KVCM_CONFIG`` file's keys too), the paths (the
disk tier's and a directory store's: creatable and writable, with the free space they need),
the store's location, ``shared_store_class`` importable, the backend it resolves to
importable (nothing is created); with the model's directory and vLLM's block size
(:func:`model_layout`), the sizes against one of vLLM's blocks -- the capacity rules the
connector applies when vLLM starts it (:meth:`ConnectorSettings.check_capacity`).  Not
checked: the model's identity (its weights are read by the engine), and the sizes when the
model's KV layout cannot be read from its ``config.json`` (:func:`model_layout` says why).

Exit status: 0 valid (a summary on stdout, warnings on stderr), 2 invalid or unreadable
(one line on stderr naming the key).
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

from kvcm.integrations.vllm.identity import size_text
from kvcm.integrations.vllm.settings import ConnectorSettings, KvLayout
from kvcm.integrations.vllm.startup import CONNECTOR, check_transfer_config

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


__all__ = ["check", "check_capacity", "model_layout", "resolved_dtype", "summary"]
