"""What ``python -m kvcm vllm check-config JSON`` (:mod:`kvcm.cli.vllm`) checks: the
connector's configuration offline, without vLLM, in about a second -- what the connector
would refuse, before an engine start.

``JSON`` is a ``kv_connector_extra_config`` object or a whole ``kv_transfer_config`` (the
object given to ``--kv-transfer-config``; then its connector and ``kv_load_failure_policy``
are checked too), inline or ``@FILE``.  Checked: every key, type, range and combination, the
paths (the disk tier's and a directory store's: creatable and writable, with the free space
they need), the store's location, ``shared_store_class`` importable, the backend importable
(nothing is created).  Not checked: sizes against vLLM's block and the model's identity
(they need the model; the connector checks them when vLLM starts it, before the first request).

Exit status: 0 valid (a summary on stdout, warnings on stderr), 2 invalid or unreadable
(one line on stderr naming the key).
"""

from __future__ import annotations

from kvcm.integrations.vllm.identity import size_text
from kvcm.integrations.vllm.settings import ConnectorSettings
from kvcm.integrations.vllm.startup import CONNECTOR, check_transfer_config

MODULE = "kvcm.integrations.vllm"


def check(data: object) -> tuple[ConnectorSettings, list[str]]:
    """The settings ``data`` gives and the warnings; ValueError or TypeError (one line) when invalid."""
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object (kv_connector_extra_config or kv_transfer_config), got "
                         f"{type(data).__name__}")
    notes = []
    if "kv_connector" in data or "kv_connector_extra_config" in data:
        if data.get("kv_connector") != CONNECTOR:
            raise ValueError(f'kv_transfer_config["kv_connector"] must be "{CONNECTOR}", got {data.get("kv_connector")!r}')
        if data.get("kv_connector_module_path") != MODULE:
            raise ValueError(f'kv_transfer_config["kv_connector_module_path"] must be "{MODULE}", got '
                             f"{data.get('kv_connector_module_path')!r}")
        settings = check_transfer_config(data)
    else:
        settings = ConnectorSettings.parse(data)
        notes.append('the kv_transfer_config around it also needs "kv_load_failure_policy": "recompute"')
    return settings, settings.check_environment() + notes


def summary(s: ConnectorSettings) -> str:
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
    return f"ok: backend {s.backend or '(KVCM_BACKEND)'}; " + "; ".join(tiers)


__all__ = ["check", "summary"]
