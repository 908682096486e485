"""Recording (sec. 11): with ``KVCM_OPLOG=path`` set, ``kvcm.KVCacheManager(...)`` returns a
:class:`RecordingManager` proxy that forwards every call and appends one JSON line per
state-visible public call (the :mod:`kvcm.oplog.ops` vocabulary).  Recording never changes what
a call does (SPEC sec. 15); see :mod:`kvcm.oplog` for the file rules."""

from __future__ import annotations

import errno
import itertools
import os
import stat
import threading
import warnings
import weakref
from typing import Any, ClassVar

from kvcm._select import manager_class
from kvcm.api import KVCache, KVCacheManager, KVCacheManagerConfig
from kvcm.oplog import ops as _ops
from kvcm.oplog.format import ENV_VAR, FORMAT_VERSION, config_to_json


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
    if d and not os.path.isdir(d):  # never made here: a typo must not create directories (as root)
        raise OSError(errno.ENOENT, f"its directory {d} does not exist (the op log creates no directories)")
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


def check_env_path() -> str | None:
    """Why ``KVCM_OPLOG`` cannot be recorded to (one line), or None (unset, or usable: the
    file is then created as a manager would create it).  For command lines, which check
    it before they build managers rather than fail in the middle of a run."""
    path = oplog_path()
    if path is None:
        return None
    try:
        w = _LogWriter(path)
    except OSError as e:
        return e.strerror or str(e)
    del w
    return None


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
            if name in _ops.CREATING_OPS:  # create_kv_cache, fork: the new cache's handle
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

    @property
    def unsettled_drains(self) -> int:
        return self._inner.unsettled_drains

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
    def _create_kv_cache(self, input_tokens, scope, priority, id, shared_hits) -> KVCache:
        input_tokens = _materialize(input_tokens)
        args = {"input_tokens": input_tokens, "scope": scope, "priority": priority, "id": id}
        if shared_hits is not None:
            shared_hits = _hits_list(shared_hits)
            args["shared_hits"] = shared_hits
        return self._record(
            "create_kv_cache",
            None,
            args,
            lambda: self._inner.create_kv_cache(input_tokens, scope=scope, priority=priority, id=id,
                                                shared_hits=shared_hits),
        )

    def shared_candidates(self, tokens, scope=None) -> list:
        tokens = _materialize(tokens)
        return self._record(
            "shared_candidates",
            None,
            {"tokens": tokens, "scope": scope},
            lambda: self._inner.shared_candidates(tokens, scope),
        )

    def probe_reuse(self, tokens, scope=None, shared_hits=None) -> int:
        tokens = _materialize(tokens)
        args, shared_hits = _probe_args(tokens, scope, shared_hits)
        return self._record(
            "probe_reuse", None, args, lambda: self._inner.probe_reuse(tokens, scope, shared_hits=shared_hits)
        )

    def probe_reuse_detail(self, tokens, scope=None, shared_hits=None):
        tokens = _materialize(tokens)
        args, shared_hits = _probe_args(tokens, scope, shared_hits)
        return self._record(
            "probe_reuse_detail",
            None,
            args,
            lambda: self._inner.probe_reuse_detail(tokens, scope, shared_hits=shared_hits),
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
        """A batch call's ``caches`` as recorded (handles; see kvcm.oplog.ops) and as forwarded
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

    def drain_copy_runs(self):
        return self._record("drain_copy_runs", None, {}, self._inner.drain_copy_runs)

    def forget_copies(self, ops):
        return self._record("forget_copies", None, {"ops": ops}, lambda: self._inner.forget_copies(ops))

    def settle_copies(self, failed=()):
        return self._record("settle_copies", None, {"failed": failed}, lambda: self._inner.settle_copies(failed))

    def clear_reusable(self) -> None:
        return self._record("clear_reusable", None, {}, self._inner.clear_reusable)

    def set_quota(self, tier, quota_bytes) -> None:
        return self._record("set_quota", None, {"tier": tier, "quota_bytes": quota_bytes},
                            lambda: self._inner.set_quota(tier, quota_bytes))

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


def _probe_args(tokens: Any, scope: Any, shared_hits: Any) -> tuple[dict[str, Any], Any]:
    """A probe's recorded arguments and the hits it is called with: ``shared_hits`` is
    recorded only when given, so a probe without it records what it did before the probes
    took it (old and new logs alike replay byte for byte)."""
    args = {"tokens": tokens, "scope": scope}
    if shared_hits is not None:
        shared_hits = _hits_list(shared_hits)
        args["shared_hits"] = shared_hits
    return args, shared_hits


def _hits_list(hits: Any) -> Any:
    """``shared_hits`` is any iterable of pairs (kvcm.checks.check_shared_hits): one that is
    no list or tuple (a set, a generator) is read into a list here, once, so that what is
    recorded is what the call gets; one whose iteration fails is passed on as is."""
    if isinstance(hits, (list, tuple, str, bytes, bytearray, memoryview)) or not hasattr(hits, "__iter__"):
        return hits
    try:
        return list(hits)
    except Exception:  # noqa: BLE001 - the call raises it again (or not): its outcome is recorded
        return hits


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

    def commit_input(self, n=None) -> None:
        return self._record("commit_input", {"n": n}, lambda: self._inner.commit_input(n))

    def stop_committing(self) -> None:
        return self._record("stop_committing", {}, self._inner.stop_committing)

    def close(self) -> None:
        return self._record("close", {}, self._inner.close)

    def fork(self, id=None) -> KVCache:
        return self._record("fork", {"id": id}, lambda: self._inner.fork(id))

    def page_indices(self, lc, start=0, stop=None) -> list[int]:
        args = {"lc": lc, **({"start": start} if start != 0 else {}), **({"stop": stop} if stop is not None else {})}
        return self._record("page_indices", args, lambda: self._inner.page_indices(lc, start, stop))

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
    Wiring (kvcm.construct.new_manager)::

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
