"""A store written under another layout is not silent (issue 37): the shared tier's objects
are named by the model's identity AND vLLM's KV layout (block size, dtype, heads, the
tensor-parallel size: :meth:`ConnectorSettings.namespace`), so an instance started with
another ``--block-size`` (or dtype, or TP size) on a store that holds this model's KV reads
none of it -- correctly, since the bytes would not fit -- and, without this module, silently.

In a directory store the connector keeps a small record of the layouts each model was
written under: ``<store>/vllm-layouts/<model key>.json`` (a JSON object, the layout's
``describe`` -> its fields; 0600 in a 0700 directory, written atomically; the store's quota
scan ignores it: it counts only ``*.kvo`` objects and its own temporaries).  The model key is
a hash of the user's ``shared_namespace`` and the model's identity tag (or the namespace
alone with ``model_identity`` off): the key of the model, not of the layout.  At start the
scheduler side reads this model's record: any layout other than its own gives ONE warning
line naming what differs and what to change (:func:`check_and_record`), then it adds its own.

Mooncake Store and ``shared_store_class`` stores have no such record (a store's interface
has no listing): no warning there.  Two instances starting at once may each rewrite the
record without the other's entry; the next start adds it back (a warning may be missed, never
wrongly given: an entry is only ever a layout some instance ran with).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from typing import Any

LAYOUTS_DIR = "vllm-layouts"


def store_directory(shared: str | None, store_kind: str | None) -> str | None:
    """The directory of a directory store (``/dir`` or ``file:///dir?...``); None for any other store."""
    if shared is None or store_kind != "file":
        return None
    if shared.startswith("file://"):
        return shared[len("file://"):].partition("?")[0]
    return os.path.expanduser(shared)


def model_key(user_namespace: str, identity_tag: str | None) -> str:
    """The record's name for one model: its namespace and identity, not its layout."""
    return hashlib.sha256(f"{user_namespace}\0{identity_tag or ''}".encode()).hexdigest()[:32]


def fields(describe: str, block_size: int, world: int) -> dict[str, Any]:
    """What a user can change, read from a layout's ``describe`` (KvLayout.describe)."""
    return {"block_size": block_size, "tensor_parallel_size": world,
            "dtype": sorted(set(re.findall(r":\d+x\d+:([A-Za-z0-9_]+)", describe))),
            "kv_heads_x_head_dim": sorted(set(re.findall(r":(\d+x\d+):", describe))),
            "describe": describe}


FIX = {"block_size": "--block-size {v}", "tensor_parallel_size": "--tensor-parallel-size {v}",
       "dtype": "--dtype / --kv-cache-dtype {v}", "kv_heads_x_head_dim": "the same tensor-parallel size and model {v}"}


def differences(theirs: dict[str, Any], mine: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(field, theirs, mine)`` for each user-visible field that differs."""
    out = []
    for k in FIX:
        a, b = theirs.get(k), mine.get(k)
        if a != b:
            out.append((k, a, b))
    return out


def _show(v: Any) -> str:
    return "/".join(map(str, v)) if isinstance(v, list) else str(v)


def warning(directory: str, others: list[dict[str, Any]], mine: dict[str, Any]) -> str | None:
    """The one line for the layouts other than mine this model was written under (None: none)."""
    parts, fixes = [], []
    for theirs in others:
        diff = differences(theirs, mine)
        if not diff:
            continue  # the same visible fields (e.g. another device type): said by describe below
        parts.append(", ".join(f"{k.replace('_', ' ')} {_show(a)} (this instance: {_show(b)})" for k, a, b in diff))
        fixes.append(" ".join(FIX[k].format(v=_show(a)) for k, a, _ in diff))
    if not parts:
        parts = [f"layout {o['describe']} (this instance: {mine['describe']})" for o in others]
        fixes = ["the same vLLM configuration as the instance that wrote it"]
    return (f"the shared tier at {directory} holds this model's KV written under another layout: {'; '.join(parts)}; "
            f"this instance reads none of it (objects are named by the layout). To reuse it, start vLLM with "
            f"{' or '.join(fixes)}; to keep this layout, nothing to do: it is written anew beside the other")


def check_and_record(directory: str, key: str, mine: dict[str, Any]) -> str | None:
    """Read the model's record in ``directory`` (:func:`warning` for any other layout), then
    add this layout to it.  Never fails a start: an unreadable or unwritable record gives no
    warning (the store's own checks name an unusable directory)."""
    path = os.path.join(directory, LAYOUTS_DIR, f"{key}.json")
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if not isinstance(record, dict):
            record = {}
    except (OSError, ValueError):
        record = {}
    others = [v for d, v in record.items() if d != mine["describe"] and isinstance(v, dict) and "describe" in v]
    if mine["describe"] not in record:
        record[mine["describe"]] = {**mine, "since": int(time.time())}
        _write(path, record)
    return warning(directory, others, mine) if others else None


def _write(path: str, record: dict[str, Any]) -> None:
    folder = os.path.dirname(path)
    try:
        if not os.path.isdir(folder):
            os.makedirs(folder, mode=0o700, exist_ok=True)
            os.chmod(folder, 0o700)  # exactly, whatever the umask
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-layout-")  # 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # a record is advice: the store's own checks name an unusable directory


__all__ = ["LAYOUTS_DIR", "check_and_record", "differences", "fields", "model_key", "store_directory", "warning"]
