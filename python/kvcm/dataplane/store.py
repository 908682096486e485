"""The shared tier's stores: one small interface, a directory of files, and the object format
(DECISIONS.md "The shared tier"; Mooncake Store lives in :mod:`kvcm.dataplane.mooncake_store`).

A store holds **objects**, each one page of one full block: named by the layout fingerprint,
the block key and the life cycle (:meth:`ObjectCodec.name`), so managers with another model
or layout never read each other's bytes.  The manager never talks to a store; the data plane
(:mod:`kvcm.dataplane`) does, in batches.

Object format
-------------
``header || payload``, the header (:data:`HEADER`, 120 bytes, little-endian)::

    magic b"KVCMOBJ2" | fingerprint (32) | block key (32) | lc (u32) | payload length (u64) |
    crc32 of the payload (u32) | mac (32)

Every read is verified (:meth:`ObjectCodec.check`): an object that is missing, short, longer
than expected, or whose magic, fingerprint, key, lc, length, checksum or MAC differs raises
``OSError`` — the load did not complete and the data plane reports the op as failed.  A
present object rejected for its content or length raises :class:`BadObjectError` (an
``OSError``), the only failure for which the data plane removes the object.

Authentication (optional): with a store secret (:func:`store_secret`: the data plane's
argument, ``KVCacheManagerConfig.shared_secret_file``, ``$KVCM_STORE_SECRET_FILE`` or
``$KVCM_STORE_SECRET``) the MAC is HMAC-SHA256 over the fields before it and the payload,
and names carry a keyed hash instead of the block key; an object without a valid MAC
never loads.  Without one the MAC is 32 zero bytes, and an object with a MAC is rejected.
The CRC catches corruption; only the MAC stops a writer who lacks the secret.

The store interface (:class:`SharedStore`)
-----------------------------------------
Bytes move through a :class:`Staging` buffer the store knows (Mooncake registers it with its
transfer engine, so puts and gets are zero-copy from / into it):

* ``exists(names) -> list[bool]``: one batched existence query (``OSError`` when the store
  cannot answer).
* ``put(items, staging) -> list[OSError | None]``: write each ``(name, offset, size)`` region
  of the staging buffer as one object; an object becomes visible only once written whole.
* ``get(items, staging) -> list[int | OSError]``: read each object into its region; the
  number of bytes read, or the error.
* ``remove(names)``: drop objects (tests, tools).
* ``timeout_s``: the data plane's deadline for one ``exists`` / ``put`` / ``get`` call
  (:data:`DEFAULT_TIMEOUT_S`; 0: none).  The data plane runs each call on a worker thread
  and stops waiting at the deadline, so a store may block; a call past it fails like a
  store that is down (:class:`kvcm.dataplane.DataPlane`).

The file store (:class:`FileStore`)
----------------------------------
A directory, one file ``<name>.kvo`` per object, written atomically: a temporary file in the
same directory, ``fsync``, ``rename`` (then one ``fsync`` of the directory per batch), so a
reader on any host of a shared filesystem sees a whole object or none.  An optional byte
quota: past it, the oldest objects (by modification time, then name) are removed down to
a low watermark (90% of the quota), so the next trim is ~10% of the quota of writes away.
A successful load refreshes the object's modification time, so hot objects go last.  The
total is rescanned when this process's running estimate passes the quota, and at least once
per 10% of the quota this process writes, so other writers' bytes are noticed within that:
with N writers the directory stays below ``quota * (1 + N / 10)`` plus one batch each.
Temporary files older than :data:`STALE_TMP_S` (a writer that crashed mid-write) are
removed when the store opens and on every rescan.  Entries it cannot remove (not a regular
file, or another user's) are skipped and counted (``skipped``), never counted against the
quota, and never fail a put: a put's result is its own object's.  A directory the store
creates is 0700; an existing one that group or others may write draws an
:class:`InsecureStoreWarning`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hmac
import math
import mmap
import os
import stat
import struct
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Self

try:  # ISA-L's crc32: the same values as zlib's, about 10x faster (DECISIONS.md "Loads at memory speed")
    from isal.isal_zlib import crc32
except ImportError:  # isal not installed (kvcm[vllm], kvcm[all]): zlib's
    from zlib import crc32

DEFAULT_TIMEOUT_S = 10.0  # the data plane's deadline for one exists / put / get call (0: none)
MAGIC = b"KVCMOBJ2"
# magic, fingerprint, key, lc, payload length, crc32(payload), then the MAC: HMAC-SHA256 of
# the fields before it and the payload with the store secret's key, or 32 zero bytes
# without a secret
FIELDS = struct.Struct("<8s32s32sIQI")
MAC_BYTES = 32
HEADER = struct.Struct(f"<{FIELDS.size}s{MAC_BYTES}s")
NO_MAC = bytes(MAC_BYTES)
SECRET_ENV = "KVCM_STORE_SECRET"  # the store secret itself (UTF-8)
SECRET_FILE_ENV = "KVCM_STORE_SECRET_FILE"  # a file holding it
MIN_SECRET_BYTES = 16
OBJECT_SUFFIX = ".kvo"
TMP_PREFIX = ".tmp-"
QUOTA_LOW_WATERMARK = 0.9  # past the quota, the file store trims to this fraction of it
STALE_TMP_S = 300.0  # a temporary file this old is a crashed writer's: removed on open / rescan


def parse_timeout(value: str, location: str) -> float:
    """A location's ``timeout_s`` parameter: seconds >= 0 (0: no deadline)."""
    try:
        t = float(value)
    except ValueError:
        t = -1.0
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"{location!r}: timeout_s must be a number of seconds >= 0 (0: none), got {value!r}")
    return t


class BadObjectError(OSError):
    """An object that is there but is not the object asked for: the codec rejected it (wrong
    magic, fingerprint, key, life cycle, length, checksum or MAC) or the store saw a wrong
    length.  Only this failure makes the data plane remove the object: any other ``OSError``
    (a store that is down, slow, out of descriptors, a stale handle, an error code it does
    not know) says nothing about the object, and removing it would wipe a good object for
    every instance of the fleet.  ``what``: the field that was wrong (``"mac"``: the object
    is intact but not authenticated by this reader's secret)."""

    def __init__(self, message: str, what: str = "") -> None:
        super().__init__(errno.EIO, message)
        self.what = what


class InsecureStoreWarning(UserWarning):
    """A store directory others can write into, or a secret file others can read."""


def _secret_bytes(value: bytes | str, source: str) -> bytes:
    """A store secret as bytes, checked (the message never shows it)."""
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogateescape")
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"the store secret ({source}) must be bytes or str, got {type(value).__name__}")
    value = bytes(value)
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(f"the store secret ({source}) is {len(value)} bytes; at least {MIN_SECRET_BYTES} "
                         "(e.g. 32 random bytes: head -c 32 /dev/urandom | base64)")
    return value


def read_secret_file(path: str) -> bytes:
    """The secret a file holds: its bytes less trailing line ends (``echo`` adds one).  A
    file others can read is used, with an :class:`InsecureStoreWarning`."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read()
    except OSError as e:
        raise OSError(e.errno, f"cannot read the store secret file {path!r}: {os.strerror(e.errno or 0)}") from None
    if mode & 0o077:
        warnings.warn(f"the store secret file {path!r} is readable by others (mode {stat.S_IMODE(mode):04o}): "
                      "chmod 600 it", InsecureStoreWarning, stacklevel=3)
    return _secret_bytes(data.rstrip(b"\r\n"), f"file {path}")


def store_secret(given: bytes | str | None = None, secret_file: str = "",
                 environ: Mapping[str, str] | None = None) -> tuple[bytes | None, str]:
    """The shared tier's secret and where it came from (``""``, ``"argument"``,
    ``"file <path>"``, ``"$KVCM_STORE_SECRET"``; never the secret itself), first found:
    ``given`` (``DataPlane(shared_secret=...)``), ``secret_file``
    (``KVCacheManagerConfig.shared_secret_file``), then the environment: ``$KVCM_STORE_SECRET_FILE``
    or ``$KVCM_STORE_SECRET`` (both set: ``ValueError``, neither is more specific; an empty
    one is unset).  None: objects are not authenticated."""
    env = os.environ if environ is None else environ
    if given is not None:
        return _secret_bytes(given, "argument"), "argument"
    if secret_file:
        return read_secret_file(secret_file), f"file {secret_file}"
    path, value = env.get(SECRET_FILE_ENV, ""), env.get(SECRET_ENV, "")
    if path and value:
        raise ValueError(f"both ${SECRET_FILE_ENV} and ${SECRET_ENV} are set: set one")
    if path:
        return read_secret_file(path), f"file {path}"
    if value:
        return _secret_bytes(value, f"${SECRET_ENV}"), f"${SECRET_ENV}"
    return None, ""


class ObjectCodec:
    """Names, headers and verification of the objects of one layout fingerprint.

    With a ``secret`` (:func:`store_secret`) every object carries a MAC, HMAC-SHA256 with a
    key derived from the secret over the header's fields (magic, fingerprint — which holds
    the namespace —, block key, life cycle, length, checksum) and the payload, so an object
    verifies only under its own name, layout and namespace, and only if a holder of the
    secret wrote it; and names carry a keyed hash of the block key instead of the key, so
    a listing of the store does not show block keys and writers without the secret (or
    with another) use other names.  Without a secret the MAC field is zero and an object
    with a MAC is rejected (it is not what such a writer writes)."""

    def __init__(self, fingerprint: bytes, secret: bytes | None = None) -> None:
        if not isinstance(fingerprint, bytes) or len(fingerprint) != 32:
            raise ValueError("the layout fingerprint must be 32 bytes")
        self.fingerprint = fingerprint
        self._prefix = f"kvcm-{fingerprint.hex()}-"
        self._mac_key: bytes | None = None
        self._name_key: bytes | None = None
        if secret is not None:
            secret = _secret_bytes(secret, "argument")
            # one key per use: a name's hash is never a valid MAC, nor the other way round
            self._mac_key = hmac.digest(secret, b"kvcm-store-object-mac-v1", "sha256")
            self._name_key = hmac.digest(secret, b"kvcm-store-object-name-v1", "sha256")

    @property
    def authenticated(self) -> bool:
        """Objects carry and need a MAC (a secret was given)."""
        return self._mac_key is not None

    def __repr__(self) -> str:  # never the keys
        return f"ObjectCodec({self.fingerprint.hex()[:16]}..., authenticated={self.authenticated})"

    def name(self, key: bytes, lc: int) -> str:
        """The object's name: fingerprint, block key (with a secret: its keyed hash) and
        life cycle."""
        if self._name_key is None:
            return f"{self._prefix}{key.hex()}-{lc}"
        tag = hmac.digest(self._name_key, self.fingerprint + bytes(key) + lc.to_bytes(4, "little"), "sha256")
        return f"{self._prefix}{tag.hex()}-{lc}"

    def _mac(self, fields: bytes | memoryview, payload: bytes | memoryview) -> bytes:
        h = hmac.new(self._mac_key, fields, "sha256")
        h.update(payload)
        return h.digest()

    def header(self, key: bytes, lc: int, payload: memoryview | bytes) -> bytes:
        """The header of the object of ``(key, lc)`` holding ``payload``: fields, crc32 and MAC."""
        fields = FIELDS.pack(MAGIC, self.fingerprint, key, lc, len(payload), crc32(payload))
        return fields + (NO_MAC if self._mac_key is None else self._mac(fields, payload))

    def check(self, obj: memoryview, key: bytes, lc: int, payload_bytes: int) -> None:
        """Verify one object read back (``obj`` is exactly what was read):
        :class:`BadObjectError` (an ``OSError`` EIO) naming what differs.  The MAC is
        checked last, so a corrupted object is reported as such and ``"mac"`` means an
        intact object this reader's secret did not write."""
        want = HEADER.size + payload_bytes
        if len(obj) != want:
            raise BadObjectError(f"shared object {self.name(key, lc)}: {len(obj)} bytes, expected {want} "
                                 "(truncated or foreign)", "length")
        magic, fp, k, olc, n, crc = FIELDS.unpack_from(obj, 0)
        payload = obj[HEADER.size:]
        what = ("magic" if magic != MAGIC else "fingerprint" if fp != self.fingerprint else "key" if k != key
                else "life cycle" if olc != lc else "length" if n != payload_bytes
                else "checksum" if crc != crc32(payload) else None)
        if what is not None:
            raise BadObjectError(f"shared object {self.name(key, lc)}: wrong {what} (foreign or corrupted)", what)
        mac = obj[FIELDS.size:HEADER.size]
        if self._mac_key is None:
            if mac != NO_MAC:
                raise BadObjectError(f"shared object {self.name(key, lc)}: has a mac, written with a store secret "
                                     "(this reader has none)", "mac")
        elif not hmac.compare_digest(mac, self._mac(obj[:FIELDS.size], payload)):
            raise BadObjectError(f"shared object {self.name(key, lc)}: wrong mac (not written with this store's "
                                 "secret: unauthenticated or forged)", "mac")


class Staging:
    """A page-aligned anonymous buffer the stores read from and write into; ``address`` is
    stable for its lifetime (Mooncake registers it)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(int(nbytes), mmap.PAGESIZE)
        self._mm = mmap.mmap(-1, self.nbytes)
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mm)

    def close(self) -> None:
        """Release the buffer (idempotent)."""
        if self._mm.closed:
            return
        try:
            self.view.release()
            del self._anchor  # the export that keeps the mmap open
            self._mm.close()
        except BufferError:
            # a view into it is still alive (e.g. held by an exception's traceback): the
            # memory goes when the last one does
            pass


class SharedStore:
    """The interface every store implements (see the module docstring)."""

    kind = ""
    location = ""
    # the data plane's deadline for one exists / put / get call, in seconds (0: none); a
    # location sets it with ``?timeout_s=`` (kvcm.dataplane.open_store)
    timeout_s = DEFAULT_TIMEOUT_S

    def exists(self, names: Sequence[str]) -> list[bool]:
        """One batched existence query; ``OSError`` when the store cannot answer."""
        raise NotImplementedError

    def put(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[OSError | None]:
        """Write each ``(name, offset, size)`` region of ``staging`` as one object, visible only once
        written whole; per item None or the ``OSError``."""
        raise NotImplementedError

    def get(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[int | OSError]:
        """Read each object into its ``(offset, size)`` region of ``staging``; per item the number of
        bytes read or the ``OSError``."""
        raise NotImplementedError

    def remove(self, names: Sequence[str]) -> None:
        """Remove the objects ``names``."""
        raise NotImplementedError

    def register(self, staging: Staging) -> None:
        """Make ``staging`` usable by :meth:`put` / :meth:`get` (a no-op for files)."""

    def unregister(self, staging: Staging) -> None:
        """Undo :meth:`register` before the buffer is freed."""

    def stats(self) -> dict[str, int]:
        """The store's own counters (the file store: its quota's; none by default)."""
        return {}

    def close(self) -> None:
        """Release the store's resources (idempotent)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_directory(directory: str) -> None:
    """Create the store's directory 0700 (its parents as ``makedirs`` does); an existing one
    keeps its mode, with an :class:`InsecureStoreWarning` when group or others may write
    into it (they could replace or remove objects: only a store secret keeps their objects
    from loading)."""
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)  # exactly 0700, whatever the umask
    except FileExistsError:
        pass
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "the shared store's location is not a directory", directory)
    if st.st_mode & 0o022:
        warnings.warn(f"the shared store directory {directory!r} is writable by group or others (mode "
                      f"{stat.S_IMODE(st.st_mode):04o}): they can replace and remove objects; make it 0700 "
                      f"and set a store secret (${SECRET_ENV})", InsecureStoreWarning, stacklevel=3)


class FileStore(SharedStore):
    """Objects as files in one directory (see the module docstring)."""

    kind = "file"

    def __init__(self, directory: str, quota_bytes: int = 0, *, fsync: bool = True) -> None:
        if quota_bytes < 0:
            raise ValueError("quota_bytes must be >= 0")
        _open_directory(directory)
        self.directory = self.location = directory
        self.quota_bytes = quota_bytes
        self.fsync = fsync
        self._estimate: int | None = None  # bytes of the objects it holds, as far as this process knows
        self._unscanned = 0  # bytes this store wrote since its last scan of the directory
        self.evicted = 0  # objects this store removed to keep the quota
        self.rescans = 0  # directory scans made to keep the quota
        self.swept = 0  # stale temporary files removed
        # entries the last scan skipped: named like an object or a temporary but not a
        # regular file (a directory, a link), or one this store could not remove (another
        # user's file in a sticky directory, a read-only mount); none counts against the quota
        self.skipped = 0
        self.quota_errors = 0  # trims that failed as a whole (the directory could not be scanned)
        # (name, inode) of object files a removal failed on: skipped without a retry while they stay
        self._unremovable: set[tuple[str, int]] = set()
        self._sweep_tmp()

    def path(self, name: str) -> str:
        """The file that holds object ``name``."""
        return os.path.join(self.directory, name + OBJECT_SUFFIX)

    def exists(self, names: Sequence[str]) -> list[bool]:
        """Whether each object's file exists; ``OSError`` when the directory is gone."""
        if not os.path.isdir(self.directory):
            raise OSError(errno.ENOENT, "the shared store's directory is gone", self.directory)
        return [os.path.isfile(self.path(n)) for n in names]

    def put(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[OSError | None]:
        """Write each region as one file (a temporary file renamed into place: never a partial
        object), within the quota; per item None or the ``OSError``."""
        results: list[OSError | None] = []
        written = 0
        renamed = False
        for name, off, size in items:
            tmp = None
            try:
                fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=self.directory)
                try:
                    view = staging.view[off:off + size]
                    while view:  # a short write continues where it stopped
                        view = view[os.write(fd, view):]
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                dst = self.path(name)
                replaced = self._size(dst)  # a put of an existing name replaces its bytes
                os.rename(tmp, dst)
                tmp = None
                renamed = True
                written += size - replaced
                results.append(None)
            except OSError as e:
                results.append(e)
            finally:
                if tmp is not None:  # never leave a half-written temporary behind
                    with contextlib.suppress(OSError):
                        os.remove(tmp)
        if renamed and self.fsync:
            self._fsync_dir()
        if self.quota_bytes and written:
            try:
                self._keep_quota(written)
            except OSError:
                # each put's result is its own object's: written is written, whatever the
                # trim met; the next put rescans
                self.quota_errors += 1
                self._estimate = None
        return results

    def get(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[int | OSError]:
        """Read each object's file into its region; per item the bytes read or the ``OSError`` (a
        file of another length fails its item)."""
        results: list[int | OSError] = []
        for name, off, size in items:
            try:
                with open(self.path(name), "rb", buffering=0) as f:
                    n = f.readinto(staging.view[off:off + size])
                    if n == size and f.read(1):  # longer than expected: not our object
                        raise BadObjectError(f"shared object {name}: longer than {size} bytes")
                    if n == size:
                        # a hot object is the newest for the quota: evicted last, not first
                        with contextlib.suppress(OSError):
                            os.utime(f.fileno())
                results.append(n)
            except OSError as e:
                results.append(e)
        return results

    def remove(self, names: Sequence[str]) -> None:
        """Remove the objects' files (those absent are skipped), keeping the quota's count."""
        for n in names:
            path = self.path(n)
            size = self._size(path)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
                if self._estimate is not None:
                    self._estimate = max(0, self._estimate - size)

    @staticmethod
    def _size(path: str) -> int:
        """The bytes of the file at ``path``; 0 when there is none."""
        try:
            return os.stat(path).st_size
        except OSError:
            return 0

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError:
            pass  # some filesystems cannot fsync a directory; the rename is still atomic
        finally:
            os.close(fd)

    def _objects(self, *, objects: bool = True) -> list[tuple[int, str, int, int]]:
        """(mtime_ns, name, bytes, inode) of every object file this store holds, oldest
        first (none unless ``objects``); temporary files older than :data:`STALE_TMP_S` (a
        writer that crashed between create and rename) are removed on the way.  Skipped,
        and counted in ``skipped``: an entry named like an object or a temporary that is
        not a regular file (this store writes nothing else), an object file a removal
        already failed on, a stale temporary it cannot remove."""
        out = []
        skipped = 0
        unremovable: set[tuple[str, int]] = set()
        stale_before = time.time_ns() - int(STALE_TMP_S * 1e9)
        with os.scandir(self.directory) as it:
            for e in it:
                is_obj = e.name.endswith(OBJECT_SUFFIX)
                if not (is_obj and objects) and not e.name.startswith(TMP_PREFIX):
                    continue
                try:
                    if not e.is_file(follow_symlinks=False):
                        skipped += 1
                        continue
                    st = e.stat(follow_symlinks=False)
                    if is_obj:
                        if (e.name, st.st_ino) in self._unremovable:
                            unremovable.add((e.name, st.st_ino))
                            skipped += 1
                        else:
                            out.append((st.st_mtime_ns, e.name, st.st_size, st.st_ino))
                    elif st.st_mtime_ns < stale_before:
                        os.remove(e.path)
                        self.swept += 1
                except FileNotFoundError:
                    pass  # removed meanwhile (another writer's rename or trim)
                except OSError:
                    skipped += 1  # a stale temporary this store may not remove
        self._unremovable = unremovable  # forget the ones that are gone
        self.skipped = skipped
        out.sort()
        return out

    def _sweep_tmp(self) -> None:
        """Remove stale temporary files (at open: a crashed writer's leftovers)."""
        with contextlib.suppress(OSError):
            self._objects(objects=False)

    def _keep_quota(self, written: int) -> None:
        """Past the quota, remove the oldest objects down to the low watermark
        (:data:`QUOTA_LOW_WATERMARK` of the quota), so that the next scan is ~10% of the
        quota of writes away instead of at the next write."""
        if self._estimate is not None:
            self._estimate += written
            self._unscanned += written
            # Other writers' bytes show only in a scan: scanning also once per (1 - low
            # watermark) of the quota written here keeps N writers' directory below
            # quota * (1 + N * 0.1) plus a batch each (the estimate alone let two reach ~1.9x).
            if (self._estimate <= self.quota_bytes
                    and self._unscanned <= self.quota_bytes - int(self.quota_bytes * QUOTA_LOW_WATERMARK)):
                return
        self.rescans += 1
        objs = self._objects()
        total = sum(o[2] for o in objs)
        if total > self.quota_bytes:
            low = int(self.quota_bytes * QUOTA_LOW_WATERMARK)
            for _, name, size, ino in objs:
                if total <= low:
                    break
                try:
                    os.remove(os.path.join(self.directory, name))
                    self.evicted += 1
                except FileNotFoundError:
                    pass  # another writer removed it
                except OSError:
                    # not this store's to remove (EACCES / EPERM / EROFS ...): skipped and
                    # counted, not tried again at every rescan, and its bytes are not counted
                    # against the quota: the trim could only make up for them by removing
                    # every object it holds
                    self._unremovable.add((name, ino))
                    self.skipped += 1
                total -= size
        self._estimate = total
        self._unscanned = 0

    def usage(self) -> tuple[int, int]:
        """(objects, bytes) the store holds now: the directory's object files, less the
        entries it skips (``skipped``)."""
        objs = self._objects()
        return len(objs), sum(o[2] for o in objs)

    def stats(self) -> dict[str, int]:
        """The quota's counters: objects evicted, rescans, stale entries swept or skipped, quota errors."""
        return {"evicted": self.evicted, "rescans": self.rescans, "swept": self.swept, "skipped": self.skipped,
                "quota_errors": self.quota_errors}


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FIELDS",
    "HEADER",
    "MAC_BYTES",
    "MAGIC",
    "MIN_SECRET_BYTES",
    "OBJECT_SUFFIX",
    "QUOTA_LOW_WATERMARK",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "STALE_TMP_S",
    "BadObjectError",
    "FileStore",
    "InsecureStoreWarning",
    "ObjectCodec",
    "SharedStore",
    "Staging",
    "parse_timeout",
    "read_secret_file",
    "store_secret",
]
