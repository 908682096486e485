"""Op log (sec. 11): record every public call as JSON lines, replay a log on one or both
backends and report the first divergence.

Recording: with ``KVCM_OPLOG=path`` set when a manager is built, ``kvcm.KVCacheManager(...)``
returns a :class:`RecordingManager` proxy (same ABCs; it forwards every call and appends
one line per public call).  ``{pid}`` in the path is replaced by the process id.  Lines::

    {"kvcm_oplog": 1, "m": "<pid>.<n>", "backend": "python", "config": {...}}   # a manager
    {"m": "<pid>.<n>", "step": 0, "op": "create_kv_cache", "args": {...}, "outcome": {...}}

Several managers may write to one file: ``m`` tells their records apart and each replays
independently.

Recording never changes what a call does (SPEC sec. 15): a record is taken under the
proxy's lock together with the call it records, so records from several threads are in
the order the calls took effect; a write that fails (a full disk, an I/O error) stops that
file's logging with one :class:`OpLogWarning`, and ``RecordingManager.oplog_error`` then
says why; the line cut short is cut off, so the file stays a replayable prefix.  The file
is opened once per process and path: created ``0600`` (an existing one is tightened to
``0600``), never through a symlink, and only if it is a regular file of this user with one
link; otherwise building the manager raises an ``OSError`` that names ``KVCM_OPLOG``.  Only state-visible public calls are recorded (the :mod:`kvcm.ops`
vocabulary); property reads, ``snapshot()`` and ``check_invariants()`` are not.

Replay: :func:`replay` (``python -m kvcm oplog-replay PATH [--backend python,cpp]``, wired
through :func:`main_replay`) runs each manager's ops on fresh managers of the chosen
backends, checks every outcome against the recorded one, compares ``snapshot()`` across
backends after every step and runs ``check_invariants()``; it stops at the first
divergence.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import itertools
import json
import os
import stat
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvcm import ops as _ops
from kvcm.api import (
    AttentionLayer,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    SsmLayer,
    Tier,
    resolve_config,
)

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
# recording
# ---------------------------------------------------------------------------------------


def oplog_path() -> str | None:
    p = os.environ.get(ENV_VAR)
    return p or None


class OpLogWarning(RuntimeWarning):
    """The op log stopped recording (a write failed); the calls themselves went on."""


def _open_log(path: str) -> int:
    """Open ``path`` for appending, the way a file that holds prompts must be: created
    ``0600`` (an existing one of ours is tightened to ``0600``), never through a symlink
    (``O_NOFOLLOW``), and only a regular file of this user with no other hard link.
    Raises OSError saying why."""
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o700, exist_ok=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)  # O_NONBLOCK: a FIFO without a reader fails, not hangs
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise OSError(e.errno, "is a symbolic link (refused: the op log holds prompts)") from None
        if e.errno == errno.ENXIO:
            raise OSError(e.errno, "is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "is not a regular file")
        if st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
        if st.st_nlink != 1:
            raise OSError(errno.EMLINK, f"has {st.st_nlink} hard links (refused: the op log holds prompts)")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _LogFile:
    """One op-log file open for appending, shared by every manager of this process that
    logs to it (one descriptor; ``lock`` keeps each record one contiguous line)."""

    _open: ClassVar[dict[str, _LogFile]] = {}
    _registry: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.lock = threading.Lock()
        self.error: str | None = None  # why writing stopped; None while it works
        self.users = 0

    @classmethod
    def acquire(cls, path: str) -> _LogFile:
        """The open file for ``path`` (opened now when none is, or when the open one
        failed: a new manager gets a fresh, complete stream)."""
        with cls._registry:
            f = cls._open.get(path)
            if f is None or f.error is not None:
                f = cls._open[path] = cls(path, _open_log(path))
            f.users += 1
            return f

    def release(self) -> None:
        with self._registry:
            self.users -= 1
            if self.users == 0:
                if self._open.get(self.path) is self:
                    del self._open[self.path]
                with self.lock:
                    fd, self.fd = self.fd, -1
                if fd >= 0:
                    os.close(fd)

    def append(self, line: str) -> str | None:
        """Append one line; the error that stopped this file (now or before), else None.
        Never raises.  A line cut short by the failure is cut off again, so the file stays
        a replayable prefix."""
        data = (line + "\n").encode("utf-8")
        with self.lock:
            if self.error is not None:
                return self.error
            done = 0
            try:
                while done < len(data):
                    done += os.write(self.fd, data[done:])
            except OSError as e:
                if done:
                    try:
                        os.ftruncate(self.fd, os.fstat(self.fd).st_size - done)
                    except OSError:
                        pass
                self.error = f"writing {self.path} failed: {e}"
                warnings.warn(
                    f"kvcm op log ({ENV_VAR}): {self.error}; op logging stopped, the log is incomplete "
                    "(the calls themselves are unaffected)",
                    OpLogWarning,
                    stacklevel=5,
                )
            return self.error


def _release(f: _LogFile) -> None:
    f.release()


class _LogWriter:
    """One manager's stream in an op-log file: its id ``m``, its step counter, and whether
    it still records.  :meth:`write` never raises: the op log never changes a call."""

    _counter = itertools.count()

    def __init__(self, path: str, *, from_env: bool = True) -> None:
        self.path = os.path.abspath(path.replace("{pid}", str(os.getpid())))
        try:
            self._file = _LogFile.acquire(self.path)
        except OSError as e:
            where = f"{ENV_VAR}={path!r}" if from_env else f"op log {path!r}"
            raise OSError(e.errno, f"{where}: cannot open {self.path} for the op log: {e.strerror or e}") from None
        weakref.finalize(self, _release, self._file)
        self.m = f"{os.getpid()}.{next(self._counter)}"
        self.step = 0
        self._error: str | None = None

    @property
    def error(self) -> str | None:
        return self._error or self._file.error

    def write(self, record: dict[str, Any]) -> None:
        if self.error is not None:
            return
        try:
            line = _ops.dumps(record)
        except Exception as e:  # noqa: BLE001 - an unencodable record stops the log, not the call
            self._stop(f"cannot encode a {record.get('op', 'header')!r} record: {type(e).__name__}: {e}")
            return
        self._file.append(line)

    def encode(self, name: str, args: dict[str, Any]) -> dict[str, Any] | None:
        """The JSON form of a call's arguments, or None (logging stopped, or they cannot be
        encoded: that stops this stream's logging)."""
        if self.error is not None:
            return None
        try:
            return _ops.encode_args(name, args)
        except Exception as e:  # noqa: BLE001 - as in write()
            self._stop(f"cannot encode the arguments of {name}: {type(e).__name__}: {e}")
            return None

    def _stop(self, why: str) -> None:
        self._error = why
        warnings.warn(
            f"kvcm op log ({ENV_VAR}) {self.path}: {why}; op logging of manager {self.m} stopped, "
            "the log is incomplete (the calls themselves are unaffected)",
            OpLogWarning,
            stacklevel=5,
        )


class RecordingManager(KVCacheManager):
    """Proxy that forwards to a real manager and records each public call.

    Built by :func:`maybe_wrap` / :func:`wrap`.  Its ``__init__`` accepts and ignores
    anything once set up, so it also works when returned from ``KVCacheManager.__new__``
    (Python then calls ``__init__(config, backend=...)`` on it).  If ``__new__`` returns an
    *unset* instance (``RecordingManager.__new__(RecordingManager)``), that ``__init__``
    call builds the inner manager itself."""

    backend_name = "oplog"
    _inner: KVCacheManager | None = None

    def __init__(self, *args: Any, **kw: Any) -> None:
        if self._inner is not None:
            return
        path = oplog_path()
        if path is None:  # pragma: no cover - only via a misconfigured hook
            raise RuntimeError(f"RecordingManager built without {ENV_VAR}")
        from kvcm._select import manager_class

        backend = kw.pop("backend", None)
        log = _LogWriter(path)  # an unusable path fails before any manager exists
        self._setup(manager_class(backend)(*args, **kw), log)

    def _setup(self, inner: KVCacheManager, log: _LogWriter) -> None:
        self._inner = inner
        self._log = log
        self._caches: list[RecordingCache] = []
        # Held around each call *and* its record: the file's order is the order the calls
        # took effect (both backends serialise a manager's calls; every call of this
        # manager goes through this proxy, so this lock admits them in that same order).
        # Reentrant: a token iterable may call back into a cache of this manager.
        self._call_lock = threading.RLock()
        log.write(
            {
                "kvcm_oplog": FORMAT_VERSION,
                "m": log.m,
                "backend": getattr(inner, "backend_name", type(inner).__name__),
                "config": config_to_json(inner.config),
            }
        )

    # -- recording ------------------------------------------------------------------
    def _record(self, name: str, cache: int | None, args: dict[str, Any], call, post=None) -> Any:
        with self._call_lock:
            log = self._log
            rec: dict[str, Any] | None = None
            if log.error is None:
                rec = {"m": log.m, "step": log.step, "op": name}
                if cache is not None:
                    rec["cache"] = cache
                if args:
                    enc = log.encode(name, args)
                    rec = None if enc is None else dict(rec, args=enc)
            log.step += 1
            try:
                result = call()
            except Exception as e:
                if rec is not None:
                    rec["outcome"] = _ops.error_outcome(e)
                    rec["message"] = str(e)
                    log.write(rec)
                raise
            if name == "create_kv_cache":
                result = RecordingCache(result, self, len(self._caches))
                self._caches.append(result)
                if rec is not None:
                    rec["outcome"] = {"result": result._handle}
                    log.write(rec)
                return result
            if rec is not None:
                try:
                    rec["outcome"] = {"result": post(result) if post is not None else _ops.normalize(result)}
                except Exception as e:  # noqa: BLE001 - as in _LogWriter.write
                    log._stop(f"cannot encode the result of {name}: {type(e).__name__}: {e}")
                else:
                    log.write(rec)
            return result

    @property
    def oplog_error(self) -> str | None:
        """None while this manager's calls are being logged; once a write failed (e.g. the
        disk is full) or a record could not be encoded, why logging stopped (an
        :class:`OpLogWarning` said so once).  The calls themselves are never affected."""
        return self._log.error

    # -- forwarded, unrecorded -----------------------------------------------------
    @property
    def inner(self) -> KVCacheManager:
        return self._inner  # type: ignore[return-value]

    @property
    def oplog_path(self) -> str:
        return self._log.path

    @property
    def config(self) -> KVCacheManagerConfig:
        return self._inner.config

    @property
    def life_cycles(self):
        return self._inner.life_cycles

    def snapshot(self) -> dict:
        return self._inner.snapshot()

    def check_invariants(self) -> None:
        self._inner.check_invariants()

    def __getattr__(self, name: str) -> Any:
        # backend-specific extras (e.g. build details) pass through unrecorded
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    # -- recorded ------------------------------------------------------------------
    def create_kv_cache(self, input_tokens=None, scope=None, priority=None, id=None) -> KVCache:
        input_tokens = _materialize(input_tokens)
        args = {"input_tokens": input_tokens, "scope": scope, "priority": priority, "id": id}
        return self._record(
            "create_kv_cache",
            None,
            args,
            lambda: self._inner.create_kv_cache(input_tokens, scope=scope, priority=priority, id=id),
        )

    def probe_reuse(self, tokens, scope=None) -> int:
        tokens = _materialize(tokens)
        return self._record(
            "probe_reuse", None, {"tokens": tokens, "scope": scope}, lambda: self._inner.probe_reuse(tokens, scope)
        )

    def probe_reuse_detail(self, tokens, scope=None):
        tokens = _materialize(tokens)
        return self._record(
            "probe_reuse_detail",
            None,
            {"tokens": tokens, "scope": scope},
            lambda: self._inner.probe_reuse_detail(tokens, scope),
        )

    def resize_batch(self, caches, capacities, history_lengths=None) -> list[bool]:
        items, inner = self._batch_caches(caches)
        args = {"caches": items, "capacities": capacities, "history_lengths": history_lengths}
        return self._record(
            "resize_batch", None, args, lambda: self._inner.resize_batch(inner, capacities, history_lengths)
        )

    def commit_batch(self, caches, tokens) -> None:
        tokens = _materialize(tokens)
        items, inner = self._batch_caches(caches)
        return self._record(
            "commit_batch", None, {"caches": items, "tokens": tokens}, lambda: self._inner.commit_batch(inner, tokens)
        )

    def _batch_caches(self, caches: Any) -> tuple[Any, Any]:
        """A batch call's ``caches`` as recorded (handles; see kvcm.ops) and as forwarded
        (this proxy's caches unwrapped, anything else as is, so the inner manager rejects
        it exactly as it would without the proxy)."""
        if not isinstance(caches, (list, tuple)):
            return _ops.normalize(caches), caches
        items: list[Any] = []
        inner: list[Any] = []
        for c in caches:
            if isinstance(c, RecordingCache) and c._mgr is self:
                items.append(c._handle)
                inner.append(c._inner)
            else:
                items.append({"foreign": True} if isinstance(c, KVCache) else {"value": _ops.normalize(c)})
                inner.append(c)
        return items, type(caches)(inner)

    def drain_copy_ops(self):
        return self._record("drain_copy_ops", None, {}, self._inner.drain_copy_ops)

    def forget_copies(self, ops):
        return self._record("forget_copies", None, {"ops": ops}, lambda: self._inner.forget_copies(ops))

    def clear_reusable(self) -> None:
        return self._record("clear_reusable", None, {}, self._inner.clear_reusable)

    def shutdown(self) -> None:
        return self._record("shutdown", None, {}, self._inner.shutdown)

    def stats(self) -> dict:
        return self._record("stats", None, {}, self._inner.stats)

    def take_iteration_stats(self) -> dict:
        return self._record("take_iteration_stats", None, {}, self._inner.take_iteration_stats)

    def take_events(self):
        return self._record("take_events", None, {}, self._inner.take_events)

    def __repr__(self) -> str:
        return f"RecordingManager({self._inner!r}, path={self._log.path!r})"


def _materialize(tokens: Any) -> Any:
    """Tokens are forwarded as given: iterators and generators are no token sequence
    (DECISIONS "Tokens"), so materialising them here would make a call that fails without
    the op log succeed with it.  The encoder records them by repr without consuming them."""
    return tokens


class RecordingCache(KVCache):
    def __init__(self, inner: KVCache, manager: RecordingManager, handle: int) -> None:
        self._inner = inner
        self._mgr = manager
        self._handle = handle

    @property
    def inner(self) -> KVCache:
        return self._inner

    def _record(self, name: str, args: dict[str, Any], call) -> Any:
        return self._mgr._record(name, self._handle, args, call)

    # properties: forwarded, not recorded
    id = property(lambda self: self._inner.id)
    status = property(lambda self: self._inner.status)
    capacity = property(lambda self: self._inner.capacity)
    history_length = property(lambda self: self._inner.history_length)
    num_committed_tokens = property(lambda self: self._inner.num_committed_tokens)
    committed_tokens = property(lambda self: self._inner.committed_tokens)
    num_reused_tokens = property(lambda self: self._inner.num_reused_tokens)
    priority = property(lambda self: self._inner.priority)

    def resume(self) -> bool:
        return self._record("resume", {}, self._inner.resume)

    def suspend(self) -> None:
        return self._record("suspend", {}, self._inner.suspend)

    def resize(self, capacity, history_length=None) -> bool:
        args = {"capacity": capacity, "history_length": history_length}
        return self._record("resize", args, lambda: self._inner.resize(capacity, history_length))

    def commit(self, tokens) -> None:
        tokens = _materialize(tokens)
        return self._record("commit", {"tokens": tokens}, lambda: self._inner.commit(tokens))

    def stop_committing(self) -> None:
        return self._record("stop_committing", {}, self._inner.stop_committing)

    def close(self) -> None:
        return self._record("close", {}, self._inner.close)

    def page_indices(self, lc) -> list[int]:
        return self._record("page_indices", {"lc": lc}, lambda: self._inner.page_indices(lc))

    def page_indices_into(self, lc, out) -> int:
        size, dtype = _buffer_spec(out)

        before = _buffer_content(out)

        def written(count: Any) -> dict[str, Any]:
            content = _buffer_content(out)
            if content is not None and before is not None:
                # the first `count` items, then anything changed past them (cf. ops.written)
                n = count if isinstance(count, int) else 0
                content = content[:n] + [b for a, b in zip(before[n:], content[n:]) if a != b]
            return {"count": _ops.normalize(count), "out": content}

        args = {"lc": lc, "size": size, "dtype": dtype}
        return self._mgr._record(
            "page_indices_into", self._handle, args, lambda: self._inner.page_indices_into(lc, out), written
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"RecordingCache({self._inner!r}, handle={self._handle})"


def _buffer_content(out: Any) -> list | None:
    try:
        return memoryview(out).tolist()
    except (TypeError, NotImplementedError, ValueError):
        return None


def _buffer_spec(out: Any) -> tuple[int, str]:
    try:
        mv = memoryview(out)
        dtype = {("i", 4): "int32", ("l", 4): "int32", ("q", 8): "int64", ("l", 8): "int64", ("f", 4): "float32"}.get(
            (mv.format.lstrip("<=@"), mv.itemsize), f"{mv.format}/{mv.itemsize}"
        )
        return len(mv), dtype
    except TypeError:
        return 0, type(out).__name__


def wrap(manager: KVCacheManager, path: str) -> RecordingManager:
    """A recording proxy around an already-built manager, logging to ``path``."""
    log = _LogWriter(path, from_env=False)
    proxy = RecordingManager.__new__(RecordingManager)
    proxy._setup(manager, log)
    return proxy


def maybe_wrap_class(impl: type) -> type:
    """The hook for ``KVCacheManager.__new__``: ``RecordingManager`` when ``KVCM_OPLOG`` is
    set (its ``__init__(config, backend=...)`` then builds the real manager), else ``impl``.
    Wiring (api.py)::

        impl = maybe_wrap_class(manager_class(backend))
        return impl.__new__(impl, config, *args, **kw)
    """
    return RecordingManager if oplog_path() is not None else impl


def maybe_wrap(manager: KVCacheManager) -> KVCacheManager:
    """The hook ``kvcm.KVCacheManager(...)`` calls on each manager it builds: a recording
    proxy when ``KVCM_OPLOG`` is set, the manager itself otherwise."""
    path = oplog_path()
    if path is None or isinstance(manager, RecordingManager):
        return manager
    proxy = RecordingManager.__new__(RecordingManager)
    proxy._setup(manager, _LogWriter(path))
    return proxy


# ---------------------------------------------------------------------------------------
# reading and replay
# ---------------------------------------------------------------------------------------


@dataclass
class LoggedManager:
    """One manager's stream in a log: its config and its op records, in order."""

    m: str
    config: dict[str, Any]
    backend: str | None
    ops: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # the log line of each op (1-based)


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
    and a valid ``config``; an op record must be a well-formed op (:func:`kvcm.ops.validate_op`)
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


@dataclass
class Divergence:
    manager: str
    step: int
    op: dict[str, Any]
    # "outcome" | "snapshot" | "properties" | "invariants" | "crash" | "not_implemented" | "op" | "construct"
    kind: str
    detail: str
    outcomes: dict[str, Any] = field(default_factory=dict)  # "recorded" / side name -> outcome
    line: int | None = None  # the op's line in the replayed log file, when known

    @property
    def signature(self) -> tuple[str, str]:
        """What a minimised sequence must still show: the kind and the op that shows it."""
        return (self.kind, str(self.op.get("op")))

    def __str__(self) -> str:
        lines = [f"first divergence: manager {self.manager}, step {self.step} ({self.kind})"]
        lines.append(f"  op: {_ops.dumps({k: v for k, v in self.op.items() if k not in ('outcome', 'message', 'm')})}")
        for who, out in self.outcomes.items():
            lines.append(f"  {who}: {_ops.dumps(out)}")
        if self.detail:
            lines.append(f"  {self.detail}")
        return "\n".join(lines)


@dataclass
class ReplayReport:
    path: str
    backends: tuple[str, ...]
    managers: int = 0
    steps: int = 0
    divergence: Divergence | None = None
    minimized: str | None = None  # a shortest log showing the divergence (replay(minimize=True))

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def __str__(self) -> str:
        head = f"replayed {self.steps} ops of {self.managers} manager(s) from {self.path} on {', '.join(self.backends)}"
        if self.ok:
            return head + ": no divergence"
        return head + "\n" + str(self.divergence)


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two JSON values first differ (``None`` when equal), for messages."""
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return f"{path or '<root>'}: {_short(a)} != {_short(b)}"
    if isinstance(a, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}/{k}: present in {'first' if k in a else 'second'} only"
            d = first_difference(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        return None
    return None if a == b else f"{path or '<root>'}: {_short(a)} != {_short(b)}"


def _short(v: Any, n: int = 200) -> str:
    s = json.dumps(v, default=repr) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def build_manager(config: KVCacheManagerConfig, backend: str) -> KVCacheManager:
    """A manager of ``backend`` that is never recorded (replaying must not log)."""
    from kvcm._select import manager_class

    return manager_class(backend)(config)


# Error types a public call may raise on bad input (sec. 10); anything else is a crash.
DOCUMENTED_ERRORS = frozenset(
    {"ValueError", "TypeError", "KvcmError", "ConfigError", "ClosedError", "InvalidStateError", "OutOfPagesError"}
)


class Lockstep:
    """Apply ops to several managers at once and check them after every step: equal
    outcomes (and equal to a recorded one, if given), equal cache properties and
    ``snapshot()`` across sides, ``check_invariants()`` on each, no NotImplementedError
    and (with ``allowed_errors``) no undocumented error type.  Records each op with the
    first side's outcome, so :meth:`log` is a replayable op log of what ran."""

    def __init__(
        self,
        managers: Sequence[Any],
        names: Sequence[str],
        *,
        check_invariants: bool = True,
        allowed_errors: frozenset[str] | None = None,
        m: str = "0",
    ) -> None:
        self.managers = list(managers)
        self.names = list(names)
        self.caches: list[list] = [[] for _ in self.managers]
        self.check = check_invariants
        self.allowed = allowed_errors
        self.m = m
        self.records: list[dict[str, Any]] = []

    def step(self, op: dict[str, Any], recorded: dict[str, Any] | None = None) -> Divergence | None:
        i = len(self.records)
        outcomes: dict[str, Any] = {}
        if recorded is not None:
            outcomes["recorded"] = recorded
        outs = []
        for name, mgr, cs in zip(self.names, self.managers, self.caches):
            try:
                out = _ops.apply(mgr, cs, op, with_message=True)
            except _ops.OpError as e:
                return Divergence(self.m, i, op, "op", f"malformed op: {e}", outcomes)
            outs.append(out)
            outcomes[name if name not in outcomes else f"{name}#{len(outs)}"] = out
        rec = dict(op)
        rec["outcome"] = {k: v for k, v in outs[0].items() if k != "message"}
        self.records.append(rec)

        def div(kind: str, detail: str) -> Divergence:
            return Divergence(self.m, i, op, kind, detail, outcomes)

        for name, out in zip(self.names, outs):
            if out.get("error") == "NotImplementedError":
                return div("not_implemented", f"{name}: {out.get('message')}")
        ref_name, ref = next(iter(outcomes.items()))
        for who, out in outcomes.items():
            if not _ops.same_outcome(ref, out):
                return div("outcome", f"{ref_name} and {who} disagree")
        err = outs[0].get("error")
        if self.allowed is not None and err is not None and err not in self.allowed:
            return div("crash", f"{err}: {outs[0].get('message')} is not a documented error of a public call")
        if len(self.managers) > 1:
            for h in range(len(self.caches[0])):
                props = [_ops.cache_props(cs[h]) for cs in self.caches]
                for name, p in zip(self.names[1:], props[1:]):
                    d = first_difference(props[0], p)
                    if d is not None:
                        return div("properties", f"cache {h}: {self.names[0]} vs {name}: {d}")
            snaps = []
            for name, mgr in zip(self.names, self.managers):
                try:
                    snaps.append(_ops.normalize(mgr.snapshot()))
                except Exception as e:  # noqa: BLE001 - any failure is the divergence
                    kind = "not_implemented" if isinstance(e, NotImplementedError) else "snapshot"
                    return div(kind, f"snapshot() on {name}: {type(e).__name__}: {e}")
            for name, snap in zip(self.names[1:], snaps[1:]):
                d = first_difference(snaps[0], snap)
                if d is not None:
                    return div("snapshot", f"snapshot({self.names[0]}) vs snapshot({name}): {d}")
        if self.check:
            for name, mgr in zip(self.names, self.managers):
                try:
                    mgr.check_invariants()
                except Exception as e:  # noqa: BLE001 - any failure is the divergence
                    kind = "not_implemented" if isinstance(e, NotImplementedError) else "invariants"
                    return div(kind, f"check_invariants() on {name}: {type(e).__name__}: {e}")
        return None


def run_ops(
    config: KVCacheManagerConfig,
    factory: Callable[[KVCacheManagerConfig], Sequence[Any]],
    names: Sequence[str],
    ops: Sequence[dict[str, Any]],
    *,
    allowed_errors: frozenset[str] | None = None,
    check_invariants: bool = True,
) -> tuple[Divergence | None, list[dict[str, Any]]]:
    """Run ``ops`` in lockstep on fresh managers from ``factory``; handles refer to the
    creates of ``ops`` *as recorded* (an op whose cache was not created here is skipped),
    so any subsequence of a log can be run.  Returns the first divergence (or None) and
    the records of the ops that ran, renumbered: a replayable log body."""
    try:
        managers = factory(config)
    except Exception as e:  # noqa: BLE001 - a side that cannot build the config diverges
        kind = "not_implemented" if isinstance(e, NotImplementedError) else "construct"
        return Divergence("0", -1, {"op": "<construct>"}, kind, f"{type(e).__name__}: {e}"), []
    ls = Lockstep(managers, names, allowed_errors=allowed_errors, check_invariants=check_invariants)
    handles: dict[int, int] = {}
    for op in ops:
        op = {k: v for k, v in op.items() if k in ("op", "args", "cache", "outcome")}
        recorded_handle = op.pop("outcome", {}).get("result") if op["op"] == "create_kv_cache" else None
        if "cache" in op:
            if op["cache"] not in handles:
                continue
            op["cache"] = handles[op["cache"]]
        items = op.get("args", {}).get("caches")
        if op["op"] in _ops.BATCH_OPS and isinstance(items, list):
            def is_handle(h: Any) -> bool:
                return isinstance(h, int) and not isinstance(h, bool)

            if any(is_handle(h) and h not in handles for h in items):
                continue  # a cache of the batch was not created in this subsequence
            op["args"] = dict(op["args"], caches=[handles[h] if is_handle(h) else h for h in items])
        d = ls.step(op)
        if d is not None:
            return d, ls.records
        result = ls.records[-1]["outcome"].get("result")
        if op["op"] == "create_kv_cache" and isinstance(recorded_handle, int) and isinstance(result, int):
            handles[recorded_handle] = result
    return None, ls.records


def minimize(
    config: KVCacheManagerConfig,
    factory: Callable[[KVCacheManagerConfig], Sequence[Any]],
    names: Sequence[str],
    ops: Sequence[dict[str, Any]],
    signature: tuple[str, str],
    *,
    allowed_errors: frozenset[str] | None = None,
    budget_s: float = 120.0,
) -> list[dict[str, Any]]:
    """A short subsequence of ``ops`` (creates carrying their recorded outcomes, so handles
    can be remapped) that still diverges with ``signature``: delta debugging down to
    single-op removals (1-minimal: removing any one op loses the divergence), returned as
    replayable records.  Pass the ops up to the divergence only.  Stops improving after
    ``budget_s`` seconds (the result is then merely shorter)."""
    deadline = time.monotonic() + budget_s
    ops = [dict(o) for o in ops]

    def fails(candidate: list[dict[str, Any]]) -> bool:
        d, _ = run_ops(config, factory, names, candidate, allowed_errors=allowed_errors)
        return d is not None and d.signature == signature

    if not fails(ops):
        return run_ops(config, factory, names, ops, allowed_errors=allowed_errors)[1]
    n = 2
    while len(ops) >= 2 and time.monotonic() < deadline:
        chunk = max(1, len(ops) // n)
        reduced = False
        for start in range(0, len(ops), chunk):
            candidate = ops[:start] + ops[start + chunk :]
            if candidate and fails(candidate):
                ops = candidate
                n = max(n - 1, 2)
                reduced = True
                break
            if time.monotonic() >= deadline:
                break
        if not reduced:
            if chunk == 1:
                break
            n = min(len(ops), n * 2)
    return run_ops(config, factory, names, ops, allowed_errors=allowed_errors)[1]


def replay(
    path: str,
    backends: Sequence[str] = ("python", "cpp"),
    *,
    check_invariants: bool = True,
    minimize_divergence: bool = False,
) -> ReplayReport:
    """Replay the log at ``path`` on each of ``backends``; stop at the first divergence.
    With ``minimize_divergence`` (and 2+ backends, or a crash/invariant divergence), also
    compute a shortest log showing it (``report.minimized``)."""
    backends = tuple(backends)
    if not backends:
        raise ValueError("replay needs at least one backend")
    streams = read_log(path)
    report = ReplayReport(path=path, backends=backends, managers=len(streams))

    def factory(cfg: KVCacheManagerConfig) -> list[Any]:
        return [build_manager(cfg, b) for b in backends]

    for stream in streams:
        config = config_from_json(stream.config)
        try:
            managers = factory(config)
        except Exception as e:  # noqa: BLE001 - a backend that cannot build it diverges
            report.divergence = Divergence(stream.m, -1, {"op": "<construct>"}, "construct", f"{type(e).__name__}: {e}")
            break
        ls = Lockstep(managers, backends, check_invariants=check_invariants, m=stream.m)
        for rec, lineno in zip(stream.ops, stream.lines):
            op = {k: v for k, v in rec.items() if k in ("op", "args", "cache")}
            d = ls.step(op, rec.get("outcome"))
            report.steps += 1
            if d is not None:
                d.line = lineno
                report.divergence = d
                break
        if report.divergence is not None:
            d = report.divergence
            if d.kind != "op" and minimize_divergence and (
                len(backends) > 1 or d.kind in ("invariants", "not_implemented")
            ):
                recs = minimize(config, factory, backends, stream.ops[: d.step + 1], d.signature)
                report.minimized = format_log(stream.config, recs, m=stream.m)
            break
    return report


def main_replay(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcm oplog-replay PATH [--backend python,cpp] [--minimize OUT]``;
    exit 0 = no divergence, 1 = divergence, 2 = bad usage / unreadable or malformed log
    (one line on stderr naming the file, the line and the field)."""
    p = argparse.ArgumentParser(
        prog="python -m kvcm oplog-replay",
        description="Replay a kvcm op log (KVCM_OPLOG).",
        epilog="exit status: 0 no divergence, 1 a divergence (printed), 2 bad usage or an unreadable or malformed "
        "log (one line naming the file, line and field)",
    )
    p.add_argument("path")
    p.add_argument("--backend", default="python,cpp", help="comma-separated backends (default: python,cpp)")
    p.add_argument("--no-invariants", action="store_true", help="skip check_invariants() after each step")
    p.add_argument("--minimize", metavar="OUT", help="write a shortest log showing the divergence to OUT")
    a = p.parse_args(argv)
    backends = tuple(b.strip() for b in a.backend.split(",") if b.strip())
    from kvcm._select import BACKENDS

    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        print(f"oplog-replay: unknown backend(s) {bad}; choices: {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    try:
        report = replay(a.path, backends, check_invariants=not a.no_invariants, minimize_divergence=bool(a.minimize))
    except LogFormatError as e:
        print(f"oplog-replay: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"oplog-replay: {a.path}: {e}", file=sys.stderr)
        return 2
    d = report.divergence
    if d is not None and d.kind == "op":  # an op the log cannot mean (e.g. a cache never created)
        print(f"oplog-replay: {LogFormatError(a.path, d.line, d.detail)}", file=sys.stderr)
        return 2
    print(report)
    if a.minimize and not report.ok:
        if report.minimized is None:
            print("oplog-replay: minimising needs 2+ backends (one backend only diverges from the recording)")
        else:
            with open(a.minimize, "w", encoding="utf-8") as f:
                f.write(report.minimized)
            n = len(report.minimized.splitlines()) - 1
            print(f"minimised: {n} ops -> {a.minimize}")
    return 0 if report.ok else 1


__all__ = [
    "DOCUMENTED_ERRORS",
    "ENV_VAR",
    "Divergence",
    "Lockstep",
    "LogFormatError",
    "OpLogWarning",
    "RecordingCache",
    "RecordingManager",
    "ReplayReport",
    "config_from_json",
    "config_to_json",
    "first_difference",
    "format_log",
    "main_replay",
    "maybe_wrap",
    "maybe_wrap_class",
    "minimize",
    "read_log",
    "replay",
    "run_ops",
    "wrap",
]
