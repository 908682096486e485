"""Mooncake Store as the shared tier's store (DECISIONS.md "The shared tier").

A Mooncake deployment is a ``mooncake_master`` (object metadata; with
``--enable_http_metadata_server`` it also serves the transfer engine's metadata over HTTP)
and clients that mount memory segments into the store.  Each data plane is a
:class:`mooncake.store.MooncakeDistributedStore` client over TCP; it mounts
``segment_bytes`` of its own memory (the shared tier's ``quota_bytes``; 0: none, the objects
live in segments of long-running storage clients such as ``mooncake_client``, which outlive
the engines).  Objects in a segment disappear with the client that mounted it.

Batches: ``exists`` is one ``batch_is_exist``; ``put`` / ``get`` are one ``batch_put_from`` /
``batch_get_into`` straight from / into the registered :class:`~kvcm.dataplane.store.Staging`
buffer (zero-copy on the client side).  A put is published by the master only once its data
is complete (put start / put end), so a failed write never shows an object.

A store that is down: with the master unreachable a put or get only fails after the
client's RPC retries (seconds).  So once a call fails with ``RPC_FAIL`` for every object,
the client is taken as down for ``down_retry_s`` seconds (default 2): calls fail at once
with ``OSError(ECONNREFUSED)`` (lookups: the store holds nothing) until the first call
after that, which tries the master again.  Nothing is lost either way: a failed load is
recomputed, a failed store is only not stored.

Set-up has a deadline too (issue #18 item 7): Mooncake retries its set-up 20 times, each
RPC waiting up to 30 s, and holds the GIL meanwhile, so a master that is down or hung would
stall the process for 90 s to 10 min.  Within ``setup_timeout_s`` (the location's
``timeout_s``, or the data plane's ``shared_timeout_s``) the store is opened or the
constructor raises ``OSError`` (``ECONNREFUSED``: nothing listens; ``ETIMEDOUT``: no answer):
the master (and an ``http`` metadata server) is first probed from Python with the deadline,
then Mooncake's set-up runs with one attempt and its RPC timeouts cut to the time left
(``MC_STORE_CLIENT_SETUP_RETRIES``, ``MC_RPC_CONNECT_TIMEOUT_MS``, ``MC_RPC_TIMEOUT_MS`` for
the set-up only; a smaller value the user set is kept).

Location: ``mooncake://<master host:port>?metadata=<url>[&protocol=tcp][&local_hostname=...]
[&local_buffer_bytes=N][&timeout_s=S]``; ``metadata`` defaults to
``http://<master host>:8080/metadata``; ``metadata=P2PHANDSHAKE`` needs no metadata server
(the clients exchange it through their handshake ports; what :class:`LocalMooncake` uses).
``timeout_s`` is the data plane's deadline for one store call and for the set-up (default
:data:`kvcm.dataplane.store.DEFAULT_TIMEOUT_S`; 0: none).
``local_hostname`` is the address this client's segment and buffers are reached at by the
other clients: it defaults to ``127.0.0.1``, right for one host only — **on several hosts
set it to this host's IP** (``&local_hostname=10.0.0.2``), or other hosts' transfers to it
fail.

**Exposure** (DECISIONS.md "Bind addresses"): whatever ``local_hostname`` says, Mooncake's
transfer engine in this process (and in every ``mooncake_client``) listens on all interfaces
— a handshake port on ``0.0.0.0`` and a data port on ``[::]`` (dual stack), both picked in
``[MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]`` (default 15000–17000) — and the data port reads and
writes any registered buffer (the staging buffer, a mounted segment) for any peer, without
authentication.  Mooncake 0.3.13 has no setting that binds them; firewall them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Self
from urllib.parse import parse_qs, urlsplit

from kvcm.dataplane.store import DEFAULT_TIMEOUT_S, SharedStore, Staging, parse_timeout

# Mooncake's error codes (mooncake-store/include/types.h) that have a clear errno
_ERRNO = {-704: errno.ENOENT, -900: errno.ECONNREFUSED, -600: errno.EMSGSIZE, -200: errno.ENOSPC}
_NAMES = {-704: "OBJECT_NOT_FOUND", -900: "RPC_FAIL", -600: "BUFFER_OVERFLOW", -200: "NO_AVAILABLE_HANDLE",
          -706: "OBJECT_HAS_LEASE", -703: "OBJECT_ALREADY_EXISTS"}


def _error(code: int, what: str) -> OSError:
    return OSError(_ERRNO.get(code, errno.EIO), f"mooncake {what}: error {code} ({_NAMES.get(code, 'see types.h')})")


# Mooncake's set-up knobs, read from the environment by each set-up (real_client.cpp,
# master_client.cpp): its attempts, and the connect / call timeout of each RPC
_SETUP_RETRIES = "MC_STORE_CLIENT_SETUP_RETRIES"
_RPC_TIMEOUTS = ("MC_RPC_CONNECT_TIMEOUT_MS", "MC_RPC_TIMEOUT_MS")
P2P = "P2PHANDSHAKE"  # the metadata "server" of clients that exchange it directly


def _unreachable(what: str, e: BaseException) -> OSError:
    if isinstance(e, TimeoutError):
        return OSError(errno.ETIMEDOUT, f"mooncake set-up: {what} did not answer before the deadline")
    code = e.errno if isinstance(e, OSError) and e.errno else errno.ECONNREFUSED
    return OSError(code, f"mooncake set-up: {what} unreachable ({e})")


def _probe(master: str, metadata: str, deadline: float) -> None:
    """Raise ``OSError`` unless the master's port accepts a connection and an ``http``
    metadata server answers (any status) before ``deadline`` (``time.monotonic()``): from
    Python, because Mooncake's set-up holds the GIL while it retries."""
    host, _, port = master.rpartition(":")
    try:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        with socket.create_connection((host.strip("[]"), int(port)), timeout=left):
            pass
    except OSError as e:
        raise _unreachable(f"master {master}", e) from e
    if not metadata.startswith(("http://", "https://")):
        return  # etcd, redis, P2PHANDSHAKE: Mooncake's own timeouts
    try:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        with urllib.request.urlopen(f"{metadata}?key=kvcm-probe", timeout=left):  # http(s) only
            pass
    except urllib.error.HTTPError:
        pass  # it answered (a missing key is a 404)
    except urllib.error.URLError as e:
        raise _unreachable(f"metadata server {metadata}", e.reason if isinstance(e.reason, OSError) else e) from e
    except OSError as e:
        raise _unreachable(f"metadata server {metadata}", e) from e


@contextlib.contextmanager
def _setup_knobs(left_s: float) -> Iterator[None]:
    """Mooncake's set-up bounded by ``left_s``: one attempt, each RPC timeout at most the
    time left (a smaller one the user set is kept); the environment is restored after."""
    ms = max(1, int(left_s * 1000))
    saved = {k: os.environ.get(k) for k in (_SETUP_RETRIES, *_RPC_TIMEOUTS)}
    os.environ[_SETUP_RETRIES] = "1"  # more attempts cannot fit the deadline
    for k in _RPC_TIMEOUTS:
        user = saved[k]
        if not (user and user.isdigit() and 0 < int(user) < ms):
            os.environ[k] = str(ms)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Mooncake's glog lines that say nothing to a kvcm user: its INFO chatter at set-up and close
# (17 lines per client), glog's notice that it logs before being initialised, and one ERROR it
# logs on every successful set-up (no descriptor of its own segment yet, before it registers one).
_GLOG_INFO = re.compile(rb"^I\d{4} ")
_GLOG_BENIGN = (b"Local segment descriptor not found", b"Logging before InitGoogleLogging() is written to STDERR")


@contextlib.contextmanager
def _quiet_glog() -> Iterator[None]:
    """Hold back Mooncake's INFO lines (and its one benign ERROR) written to fd 2 during a
    set-up or close; every other line, kvcm's and other threads' included, is written
    through afterwards, in order.  ``KVCM_MOONCAKE_LOG=all`` passes everything as it comes
    (Mooncake's glog build ignores GLOG_minloglevel, so the filter is kvcm's)."""
    if os.environ.get("KVCM_MOONCAKE_LOG") == "all":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            keep = [line for line in held.read().splitlines(keepends=True)
                    if not _GLOG_INFO.match(line) and not any(b in line for b in _GLOG_BENIGN)]
            if keep:
                os.write(2, b"".join(keep))


def parse_url(url: str) -> dict:
    """The setup parameters a ``mooncake://`` location names."""
    parts = urlsplit(url)
    if parts.scheme != "mooncake" or not parts.hostname or not parts.port:
        raise ValueError(f"not a Mooncake location (mooncake://host:port?metadata=url): {url!r}")
    q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(q) - {"metadata", "protocol", "local_hostname", "local_buffer_bytes", "timeout_s"}
    if unknown:
        raise ValueError(f"{url!r}: unknown parameters {sorted(unknown)}")
    return {
        "master": f"{parts.hostname}:{parts.port}",
        "metadata": q.get("metadata", f"http://{parts.hostname}:8080/metadata"),
        "protocol": q.get("protocol", "tcp"),
        "local_hostname": q.get("local_hostname", "127.0.0.1"),
        "local_buffer_bytes": int(q.get("local_buffer_bytes", 16 << 20)),
        "timeout_s": parse_timeout(q["timeout_s"], url) if "timeout_s" in q else DEFAULT_TIMEOUT_S,
    }


class MooncakeStore(SharedStore):
    """A Mooncake Store client (see the module docstring)."""

    kind = "mooncake"

    def __init__(self, master: str, metadata: str, *, segment_bytes: int = 0, local_buffer_bytes: int = 16 << 20,
                 protocol: str = "tcp", local_hostname: str = "127.0.0.1", down_retry_s: float = 2.0,
                 setup_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if (isinstance(setup_timeout_s, bool) or not isinstance(setup_timeout_s, (int, float))
                or not setup_timeout_s >= 0 or setup_timeout_s == float("inf")):
            raise ValueError(f"setup_timeout_s must be a number of seconds >= 0 (0: none), got {setup_timeout_s!r}")
        self.down_retry_s = down_retry_s
        self._down_until = 0.0  # time.monotonic() before which the store is taken as down
        # Mooncake's log: warnings and errors only, unless the user chose otherwise
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError("the Mooncake shared store needs the mooncake package: pip install 'kvcm[mooncake]' "
                              "(and Debian's libibverbs1 librdmacm1 libnuma1)") from e
        self.location = f"mooncake://{master}?metadata={metadata}"
        self.master, self.metadata = master, metadata
        self._store = None
        config = {"local_hostname": local_hostname, "metadata_server": metadata, "global_segment_size": segment_bytes,
                  "local_buffer_size": local_buffer_bytes, "protocol": protocol, "master_server_addr": master}
        if setup_timeout_s:
            deadline = time.monotonic() + setup_timeout_s
            _probe(master, metadata, deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                raise OSError(errno.ETIMEDOUT, f"mooncake set-up: no time left of {setup_timeout_s:g} s after "
                                               f"reaching master {master}")
            store = MooncakeDistributedStore()
            with _setup_knobs(left), _quiet_glog():
                rc = store.setup(config)
        else:  # no deadline: Mooncake's own attempts and timeouts
            store = MooncakeDistributedStore()
            with _quiet_glog():
                rc = store.setup(config)
        if rc != 0:
            within = f" within the deadline of {setup_timeout_s:g} s" if setup_timeout_s else ""
            raise OSError(errno.ECONNREFUSED, f"mooncake setup failed (error {rc}){within}: master {master}, "
                                              f"metadata {metadata}")
        self._store = store
        self._registered: set[int] = set()

    @classmethod
    def from_url(cls, url: str, *, segment_bytes: int = 0, setup_timeout_s: float | None = None) -> MooncakeStore:
        """The store ``url`` names; its set-up's deadline is ``setup_timeout_s``, by default
        the location's ``timeout_s``."""
        p = parse_url(url)
        store = cls(p["master"], p["metadata"], segment_bytes=segment_bytes, local_buffer_bytes=p["local_buffer_bytes"],
                    protocol=p["protocol"], local_hostname=p["local_hostname"],
                    setup_timeout_s=p["timeout_s"] if setup_timeout_s is None else setup_timeout_s)
        store.timeout_s = p["timeout_s"]
        return store

    def _client(self):
        if self._store is None:
            raise OSError(errno.EBADF, "the mooncake store is closed")
        if time.monotonic() < self._down_until:
            raise OSError(errno.ECONNREFUSED, f"mooncake master {self.master} unreachable (retrying in "
                                              f"{self._down_until - time.monotonic():.1f} s)")
        return self._store

    def _note(self, codes: list[int]) -> list[int]:
        """Take the store as down when every object of a call failed with RPC_FAIL."""
        if codes and all(c == -900 for c in codes):
            self._down_until = time.monotonic() + self.down_retry_s
        return codes

    def exists(self, names: Sequence[str]) -> list[bool]:
        """One batched existence query (``batch_is_exist``); ``OSError`` when the store cannot answer."""
        if not names:
            return []
        codes = self._note(self._client().batch_is_exist(list(names)))
        bad = [c for c in codes if c < 0]
        if bad or len(codes) != len(names):
            raise _error(bad[0] if bad else -1, "batch_is_exist")
        return [c == 1 for c in codes]

    def register(self, staging: Staging) -> None:
        """Register ``staging`` with the transfer engine, so puts and gets are zero-copy."""
        rc = self._client().register_buffer(staging.address, staging.nbytes)
        if rc != 0:
            raise _error(rc, "register_buffer")
        self._registered.add(staging.address)

    def unregister(self, staging: Staging) -> None:
        """Undo :meth:`register` (before the buffer is freed)."""
        if self._store is not None and staging.address in self._registered:
            self._store.unregister_buffer(staging.address)
            self._registered.discard(staging.address)

    def put(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[OSError | None]:
        """Write each ``(name, offset, size)`` region of ``staging`` as one object; per item None or
        the ``OSError`` (an object that exists already counts as written: same name, same bytes)."""
        codes = self._batch("batch_put_from", items, staging)
        # an object that exists already holds the same bytes (its name is its content's key)
        return [c if isinstance(c, OSError) else None if c in (0, -703) else _error(c, f"put {n}")
                for (n, _, _), c in zip(items, codes, strict=True)]

    def get(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[int | OSError]:
        """Read each object into its region of ``staging``; per item the bytes read or the ``OSError``."""
        codes = self._batch("batch_get_into", items, staging)
        return [c if isinstance(c, OSError) or c >= 0 else _error(c, f"get {n}")
                for (n, _, _), c in zip(items, codes, strict=True)]

    def _batch(self, method: str, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[int | OSError]:
        """One batched transfer of ``items`` (name, staging offset, size): the client's
        result code per item, or the client's error for every item when it is closed or
        taken as down."""
        if not items:
            return []
        try:
            client = self._client()
        except OSError as e:
            return [e] * len(items)
        return self._note(getattr(client, method)([n for n, _, _ in items],
                                                  [staging.address + o for _, o, _ in items],
                                                  [s for _, _, s in items]))

    def remove(self, names: Sequence[str]) -> None:
        """Remove the objects ``names`` (forced)."""
        if names:
            self._client().batch_remove(list(names), force=True)

    def close(self) -> None:
        """Unregister every buffer and close the client."""
        if self._store is not None:
            for addr in list(self._registered):
                self._store.unregister_buffer(addr)
            self._registered.clear()
            with _quiet_glog():
                self._store.close()
            self._store = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    """A Mooncake executable: the one shipped in the mooncake package, else on PATH."""
    try:
        import mooncake
    except ImportError as e:
        raise ImportError("the mooncake package is not installed: pip install 'kvcm[mooncake]'") from e
    path = os.path.join(os.path.dirname(mooncake.__file__), name)
    if os.path.isfile(path):
        if not os.access(path, os.X_OK):
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        return path
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found in the mooncake package nor on PATH")
    return found


class ExitedError(RuntimeError):
    """A Mooncake process exited while it was being started (e.g. its port was taken)."""


def _wait_listening(port: int, proc: subprocess.Popen, what: str, timeout: float,
                    also: tuple[tuple[subprocess.Popen | None, str], ...] = ()) -> None:
    """Wait until ``port`` accepts connections; :class:`ExitedError` when ``proc`` (or a
    process of ``also`` it needs, e.g. the master) exits meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        for p, name in ((proc, what), *also):
            if p is not None and p.poll() is not None:
                raise ExitedError(f"{name} exited with status {p.returncode}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} is not listening on 127.0.0.1:{port} after {timeout} s")
        time.sleep(0.05)


class LocalMooncake:
    """A Mooncake Store on 127.0.0.1 for tests and the fleet replay: ``mooncake_master`` and
    one ``mooncake_client`` that mounts ``segment_bytes`` of memory (the store's capacity; it
    outlives the engines; ``client=False``: no client, e.g. for vLLM's ``MooncakeStoreConnector``,
    whose engines mount their own segments).  Free ports are chosen; :attr:`url` is the shared tier's path.
    ``stop()`` ends both (idempotent).

    Bound to 127.0.0.1: the master's RPC and metrics ports, the storage client's port.  No
    metadata server: the clients exchange it through their transfer engines' handshake
    (``P2PHANDSHAKE``), since the master's built-in HTTP metadata server listens on
    0.0.0.0 whatever ``--http_metadata_server_host`` says (Mooncake 0.3.13).  Each transfer
    engine's own handshake and data ports listen on every interface; nothing binds them
    (module docstring, DECISIONS.md "Bind addresses").

    A free port is only free when it is picked: another process may bind it before the
    master or the client does, and the process then exits.  So the launch is retried with
    new ports (up to ``attempts`` times) when a process exits while starting."""

    def __init__(self, segment_bytes: int = 256 << 20, *, log_dir: str | None = None, timeout: float = 30.0,
                 attempts: int = 5, client: bool = True) -> None:
        self.segment_bytes = segment_bytes
        self.with_client = client  # False: the master alone (the clients bring their own segments)
        self._logs: list = []
        self.master: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None
        self.attempts = 0  # launches tried
        while True:
            self.attempts += 1
            try:
                self._launch(log_dir, timeout)
                return
            except ExitedError:
                self.stop()
                if self.attempts >= attempts:
                    raise
            except BaseException:
                self.stop()
                raise

    def _launch(self, log_dir: str | None, timeout: float) -> None:
        self.rpc_port, self.metrics_port, self.client_port = (_free_port() for _ in range(3))
        self.master_addr = f"127.0.0.1:{self.rpc_port}"
        self.metadata = P2P
        self.url = f"mooncake://{self.master_addr}?metadata={self.metadata}"
        self.master = self._spawn(log_dir, "master", [
            _binary("mooncake_master"), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}"])
        _wait_listening(self.rpc_port, self.master, "mooncake_master", timeout)
        _wait_listening(self.metrics_port, self.master, "mooncake_master's metrics server", timeout)
        if self.with_client:
            self.start_client(log_dir, timeout)

    def _spawn(self, log_dir: str | None, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(log_dir, f"mooncake-{name}.log"), "ab") if log_dir else subprocess.DEVNULL  # noqa: SIM115
        if log is not subprocess.DEVNULL:
            self._logs.append(log)
        # warnings and errors only, unless told otherwise; the store secret stays with kvcm
        # (Mooncake's processes never read it, and their environment is readable by the user)
        env = {"MC_LOG_LEVEL": "WARNING", **{k: v for k, v in os.environ.items() if not k.startswith("KVCM_STORE_SECRET")}}
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start_client(self, log_dir: str | None = None, timeout: float = 30.0) -> None:
        """(Re)start the storage client (after :meth:`kill_client`, with an empty segment)."""
        self.client = self._spawn(log_dir, "client", [
            _binary("mooncake_client"), "--host=127.0.0.1", f"--port={self.client_port}",
            f"--master_server_address={self.master_addr}", f"--metadata_server={self.metadata}",
            f"--global_segment_size={self.segment_bytes}", "--protocol=tcp"])
        # the master too: one whose port was taken may exit only after it seemed to listen
        _wait_listening(self.client_port, self.client, "mooncake_client", timeout, ((self.master, "mooncake_master"),))

    @staticmethod
    def _end(proc: subprocess.Popen | None, sig_kill: bool = False) -> None:
        if proc is None or proc.poll() is not None:
            return
        if sig_kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill_master(self) -> None:
        """SIGKILL the master: the store is down (fault tests)."""
        self._end(self.master, sig_kill=True)

    def kill_client(self) -> None:
        """SIGKILL the storage client: every object in its segment is gone."""
        self._end(self.client, sig_kill=True)

    def stop(self) -> None:
        """Stop the client and master processes this launcher started and close their logs."""
        self._end(self.client)
        self._end(self.master)
        for log in self._logs:
            with contextlib.suppress(OSError):
                log.close()
        self._logs.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["LocalMooncake", "MooncakeStore", "parse_url"]
