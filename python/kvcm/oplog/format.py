"""The op-log format (sec. 11): configs as JSON, reading a log into manager streams
(:func:`read_log`, which rejects a malformed log naming the line and field) and writing
one (:func:`format_log`).  The record layout is described in :mod:`kvcm.oplog`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.api import AttentionLayer, KVCacheManagerConfig, SsmLayer, Tier
from kvcm.config import resolve_config
from kvcm.oplog import ops as _ops

ENV_VAR = "KVCM_OPLOG"
FORMAT_VERSION = 1

# ---------------------------------------------------------------------------------------
# config <-> JSON
# ---------------------------------------------------------------------------------------


def config_to_json(config: KVCacheManagerConfig) -> dict[str, Any]:
    """A JSON-able dict that :func:`config_from_json` turns back into an equal config."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(KVCacheManagerConfig):
        v = getattr(config, f.name)
        if f.name == "layers":
            layers = []
            for layer in v:
                if isinstance(layer, AttentionLayer):
                    layers.append(
                        {
                            "type": "attention",
                            "layer_id": layer.layer_id,
                            "bytes_per_token": layer.bytes_per_token,
                            "window": layer.window,
                            "sink_tokens": layer.sink_tokens,
                        }
                    )
                elif isinstance(layer, SsmLayer):
                    layers.append({"type": "ssm", "layer_id": layer.layer_id, "state_bytes": layer.state_bytes})
                else:
                    layers.append({"type": "unknown", "repr": repr(layer)})
            v = layers
        elif f.name == "tiers":
            v = [{"kind": t.kind, "quota_bytes": t.quota_bytes, "path": t.path} for t in v]
        elif f.name == "pool_ratio":
            v = None if v is None else [[k, w] for k, w in v.items()]  # keys stay ints
        out[f.name] = v
    return out


def config_from_json(data: dict[str, Any]) -> KVCacheManagerConfig:
    """The config of a log's header; a malformed one raises ValueError naming the field
    (``config.layers[1]: unknown keys ['colour']``), an invalid one the shared validator's
    ConfigError (also a ValueError)."""
    if not isinstance(data, dict):
        raise ValueError(f"config: must be an object, got {_json_kind(data)}")  # noqa: TRY004 - a malformed log is a ValueError
    fields = {f.name for f in dataclasses.fields(KVCacheManagerConfig)}
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}")
    kw = dict(data)
    layers = []
    raw_layers = kw.get("layers", [])
    if not isinstance(raw_layers, list):
        raise ValueError(f"config.layers: must be a list, got {_json_kind(raw_layers)}")  # noqa: TRY004 - a malformed log is a ValueError
    for i, d in enumerate(raw_layers):
        if not isinstance(d, dict):
            raise ValueError(f"config.layers[{i}]: must be an object, got {_json_kind(d)}")  # noqa: TRY004 - a malformed log is a ValueError
        d = dict(d)
        kind = d.pop("type", None)
        if kind == "attention":
            cls: type = AttentionLayer
        elif kind == "ssm":
            cls = SsmLayer
        else:
            raise ValueError(f"config.layers[{i}].type: unknown layer type {kind!r}; choices: attention, ssm")
        layers.append(_build(cls, d, f"config.layers[{i}]"))
    kw["layers"] = layers
    raw_tiers = kw.get("tiers", [])
    if not isinstance(raw_tiers, list):
        raise ValueError(f"config.tiers: must be a list, got {_json_kind(raw_tiers)}")  # noqa: TRY004 - a malformed log is a ValueError
    tiers = []
    for i, t in enumerate(raw_tiers):
        if not isinstance(t, dict):
            raise ValueError(f"config.tiers[{i}]: must be an object, got {_json_kind(t)}")  # noqa: TRY004 - a malformed log is a ValueError
        tiers.append(_build(Tier, t, f"config.tiers[{i}]"))
    kw["tiers"] = tiers
    pr = kw.get("pool_ratio")
    if pr is not None:
        items = pr.items() if isinstance(pr, dict) else pr
        try:
            kw["pool_ratio"] = {int(k): w for k, w in items}
        except (TypeError, ValueError):
            raise ValueError(f"config.pool_ratio: must be [[lc, weight], ...], got {_short(pr)}") from None
    try:
        return KVCacheManagerConfig(**kw)
    except TypeError as e:  # a required field is missing, or a field of the wrong shape
        raise ValueError(f"config: {e}") from None


def _build(cls: type, d: dict[str, Any], where: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {names}")
    try:
        return cls(**d)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{where}: {e}") from None


def _json_kind(v: Any) -> str:
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return "a number"
    return type(v).__name__


# ---------------------------------------------------------------------------------------
# reading and writing logs
# ---------------------------------------------------------------------------------------


@dataclass
class LoggedManager:
    """One manager's stream in a log: its config and its op records, in order."""

    m: str
    config: dict[str, Any]
    backend: str | None
    ops: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # the log line of each op (1-based)
    sizes: list[int] = field(default_factory=list)  # each op's line length: its share of the replay's work


class LogFormatError(ValueError):
    """A malformed op log: ``str()`` is one line naming the file, the line and the field."""

    def __init__(self, source: str, line: int | None, message: str) -> None:
        super().__init__(f"{source}:{line}: {message}" if line is not None else f"{source}: {message}")
        self.source = source
        self.line = line


def read_log(path_or_lines: str | Iterable[str]) -> list[LoggedManager]:
    """Parse a log (a path, or an iterable of JSON lines) into manager streams.  A
    malformed log raises :class:`LogFormatError` (a ValueError) naming the line and field:
    each record must be a JSON object; a header (``kvcm_oplog``) needs this format version
    and a valid ``config``; an op record must be a well-formed op (:func:`kvcm.oplog.ops.validate_op`)
    with an object ``outcome``."""
    if isinstance(path_or_lines, str):
        source = path_or_lines
        with open(path_or_lines, encoding="utf-8") as f:
            try:
                lines = f.read().splitlines()
            except UnicodeDecodeError as e:
                raise LogFormatError(source, None, f"not UTF-8 text ({e})") from None
    else:
        source = "<op log>"
        lines = list(path_or_lines)
    streams: dict[str, LoggedManager] = {}
    order: list[str] = []
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue

        def bad(message: str, lineno: int = lineno) -> LogFormatError:
            return LogFormatError(source, lineno, message)

        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise bad(f"not JSON ({e})") from None
        except RecursionError:
            raise bad("JSON nested too deeply") from None
        if not isinstance(rec, dict):
            raise bad(f"a record must be a JSON object, got {_json_kind(rec)}")
        m = rec.get("m", "0")
        if not isinstance(m, (str, int)) or isinstance(m, bool):
            raise bad(f"m: must be a string, got {_json_kind(m)}")
        m = str(m)
        if "kvcm_oplog" in rec:
            if rec["kvcm_oplog"] != FORMAT_VERSION:
                raise bad(f"kvcm_oplog: unsupported format version {_short(rec['kvcm_oplog'])} (this kvcm reads {FORMAT_VERSION})")
            if m in streams:
                raise bad(f"manager {m} declared twice")
            if "config" not in rec:
                raise bad(f"config: missing from the header of manager {m}")
            try:
                resolve_config(config_from_json(rec["config"]))  # checked here: a bad one is a bad log
            except ValueError as e:
                msg = str(e)
                raise bad(msg if msg.startswith("config") else f"config.{msg}") from None
            except RecursionError:
                raise bad("config: nested too deeply") from None
            backend = rec.get("backend")
            streams[m] = LoggedManager(m=m, config=rec["config"], backend=backend if isinstance(backend, str) else None)
            order.append(m)
            continue
        if m not in streams:
            raise bad(f"op for manager {m} before its config line")
        try:
            _ops.validate_op(rec)
        except _ops.OpError as e:
            raise bad(str(e)) from None
        if "outcome" in rec and not isinstance(rec["outcome"], dict):
            raise bad(f"outcome: must be an object, got {_json_kind(rec['outcome'])}")
        streams[m].ops.append(rec)
        streams[m].lines.append(lineno)
        streams[m].sizes.append(len(line))
    return [streams[m] for m in order]


def format_log(config: KVCacheManagerConfig | dict, records: Sequence[dict[str, Any]], m: str = "0") -> str:
    """Render a config and op records (with or without outcomes) as a replayable log."""
    cfg = config if isinstance(config, dict) else config_to_json(config)
    lines = [_ops.dumps({"kvcm_oplog": FORMAT_VERSION, "m": m, "config": cfg})]
    for i, r in enumerate(records):
        rec = {"m": m, "step": i}
        rec.update({k: v for k, v in r.items() if k not in ("m", "step")})
        lines.append(_ops.dumps(rec))
    return "\n".join(lines) + "\n"


def _short(v: Any, n: int = 200) -> str:
    s = json.dumps(v, default=repr) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."
