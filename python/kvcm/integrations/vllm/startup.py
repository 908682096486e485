"""What the connector checks and says when vLLM starts it (imports nothing of vLLM: vLLM's
objects are read by attribute, so the tests and ``check-config`` run without it).

* :func:`check_transfer_config` -- the ``kv_transfer_config`` vLLM was given: the policy the
  connector needs and ``kv_connector_extra_config`` (:class:`ConnectorSettings`), one-line
  errors naming the key.  Run by the connector's constructor (where vLLM hands the
  configuration over: its extension point) and by ``python -m kvcm vllm check-config``, the
  check to run before a start: vLLM 0.32 runs nothing of a connector before the model's
  weights load, and kvcm does not read vLLM's stack frames to get ahead of it (issue 36;
  DECISIONS.md "vLLM connector: a start that says what it does").
* :func:`prepare` -- at construction (after the model loaded): the sizes against vLLM's
  block, the host's paths, the model's identity for the shared tier.
* :func:`shared_layout_warning` -- a directory store that holds this model's KV under
  another layout: one warning line (:mod:`kvcm.integrations.vllm.layouts`).
* :func:`report_error` -- a configuration error's one ``ERROR`` line in vLLM's log.
* :func:`start_line` -- the one INFO line the scheduler side logs (:func:`announce`, with the
  warnings, from the connector's facade).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvcm.integrations.vllm.identity import IdentityError, ModelIdentity, ModelSource, cached_identity, size_text
from kvcm.integrations.vllm.settings import ConnectorSettings, KvLayout, key_error

CONNECTOR = "KvcmConnector"
# under "vllm.": vLLM's handler and format (``ERROR 12-06 02:00:00 [startup.py:NN] kvcm: ...``);
# without vLLM configured, Python's last-resort handler prints it on stderr
log = logging.getLogger("vllm.kvcm")


def report_error(e: BaseException) -> None:
    """The one line a configuration error gets in vLLM's log, at ERROR, before vLLM's
    traceback (which wraps it in pydantic's ``ValidationError`` or its engine-core failure):
    ``kvcm: kv_connector_extra_config['host_bytes'] ...`` (DECISIONS.md "vLLM connector: one
    line where the user looks")."""
    log.error("kvcm: %s", " ".join(str(e).split()))


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def check_transfer_config(ktc: Any) -> ConnectorSettings:
    """The settings a ``kv_transfer_config`` (vLLM's ``KVTransferConfig`` or its JSON as a
    dict) gives the connector; ValueError, one line naming the key, for what the connector
    would refuse."""
    policy = _get(ktc, "kv_load_failure_policy", "fail")
    if policy != "recompute":
        # vLLM's default ("fail") ends a request whose load failed with an error; a cache
        # that misses must cost a recomputation, never a request
        raise ValueError(f'kv_transfer_config["kv_load_failure_policy"] must be "recompute" for {CONNECTOR} '
                         f"(got {policy!r}): a block kvcm cannot deliver is then recomputed, not an error")
    return ConnectorSettings.parse(_get(ktc, "kv_connector_extra_config"))


@dataclass(frozen=True)
class EngineFacts:
    """What the start line and the capacity checks need of vLLM's configuration."""

    max_model_len: int
    vllm_blocks: int  # blocks of vLLM's own KV cache
    device: str
    enable_prefix_caching: bool

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any, device: str) -> EngineFacts:
        return cls(int(vllm_config.model_config.max_model_len), int(kv_cache_config.num_blocks), device,
                   bool(vllm_config.cache_config.enable_prefix_caching))


@dataclass(frozen=True)
class Prepared:
    identity: ModelIdentity | None  # None: no shared tier, or model_identity off
    warnings: list[str]

    @property
    def tag(self) -> str | None:
        return None if self.identity is None else self.identity.tag


def prepare(settings: ConnectorSettings, layout: KvLayout, facts: EngineFacts, source: ModelSource | Any,
            world: int = 1) -> Prepared:
    """The checks of the connector's constructor (both roles): the host's paths, the sizes
    against vLLM's block (ValueError naming the key), then the model's identity when a
    shared tier needs it (``source``: a :class:`ModelSource` or a callable making one)."""
    warnings = settings.check_environment(world)
    warnings += settings.check_capacity(layout, facts.max_model_len, facts.vllm_blocks, world)
    identity = None
    if settings.shared is not None and settings.model_identity != "off":
        try:
            identity = cached_identity(source() if callable(source) else source, settings.model_identity)
        except IdentityError as e:
            raise key_error("model_identity", f"{settings.model_identity!r}: {e}") from None
    return Prepared(identity, warnings)


def shared_layout_warning(settings: ConnectorSettings, layout: KvLayout, prepared: Prepared,
                          world: int = 1) -> str | None:
    """The scheduler side's check of a directory store (:mod:`kvcm.integrations.vllm.layouts`):
    one warning line when it holds this model's KV under another block size, dtype or
    tensor-parallel size; this layout is recorded there."""
    from kvcm.integrations.vllm import layouts

    directory = layouts.store_directory(settings.shared, settings.store_kind)
    if directory is None:
        return None
    key = layouts.model_key(settings.shared_namespace, prepared.tag)
    return layouts.check_and_record(directory, key, layouts.fields(layout.describe, layout.block_size, world))


def start_line(settings: ConnectorSettings, layout: KvLayout, facts: EngineFacts, prepared: Prepared,
               backend: str, world: int = 1) -> str:
    """The one line the connector logs when it starts: backend, block, tiers and sizes, the
    store and its cap, the namespace with the model's identity."""
    B, page = layout.block_size, layout.page_bytes
    s = settings
    parts = [(f"kvcm connector: backend {backend}; vLLM block {B} tokens = {size_text(page)} per kvcm page "
             f"({len(layout.layer_names)} layers); vLLM's KV cache {facts.vllm_blocks} blocks, max_model_len "
             f"{facts.max_model_len} = {facts.max_model_len // B} blocks"),
             f"host {size_text(s.host_bytes)} = {s.host_bytes // page} blocks"]
    if s.disk_path is not None:
        parts.append(f"disk {size_text(s.disk_bytes)} = {s.disk_bytes // page} blocks at {s.disk_path}"
                     f"{' (per rank)' if world > 1 else ''}")
    else:
        parts.append("no disk tier")
    if s.shared is not None:
        if s.store_kind == "mooncake":
            cap = f"Mooncake Store, this instance mounts {size_text(s.shared_bytes)}"
        else:
            cap = f"cap {size_text(s.shared_bytes)}" if s.shared_bytes else "NO CAP (shared_bytes 'unbounded')"
            cap = f"{'directory' if s.store_kind == 'file' else s.shared_store_class}, {cap}"
        timeout = "" if s.shared_timeout_s is None else f", timeout {s.shared_timeout_s:g} s"
        parts.append(f"shared {s.shared} ({cap}, written on {s.shared_write}{timeout})")
        user = repr(s.shared_namespace) if s.shared_namespace else "(none)"
        who = (prepared.identity.describe() if prepared.identity is not None
               else "model_identity off: the namespace alone names the model")
        ranks = f" + tp{world} (each rank its shard's objects)" if world > 1 else ""
        parts.append(f"namespace {user} + {who} + {layout.describe}{ranks}")
    else:
        parts.append("no shared tier")
    parts.append(f"loads {s.load_mode}, at most {size_text(s.max_inflight_bytes)} in flight")
    if s.config_file is not None:
        parts.append(f"keys from {s.config_file}")
    if s.events_endpoint is not None:
        parts.append(f"events on {s.events_endpoint}")
    return "; ".join(parts)


def announce(log: Any, settings: ConnectorSettings, layout: KvLayout, facts: EngineFacts, prepared: Prepared,
             backend: str, world: int = 1) -> None:
    """The start line at INFO, then each warning at WARNING, on ``log`` (vLLM's logger)."""
    log.info("%s", start_line(settings, layout, facts, prepared, backend, world))
    for w in prepared.warnings:
        log.warning("kvcm connector: %s", w)


__all__ = ["EngineFacts", "Prepared", "announce", "check_transfer_config",
           "prepare", "report_error", "shared_layout_warning", "start_line"]
