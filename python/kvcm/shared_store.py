"""The shared tier's stores: one small interface, a directory of files, and the object format
(DECISIONS.md "The shared tier"; Mooncake Store lives in :mod:`kvcm.mooncake_store`).

A store holds **objects**, each one page of one full block: named by the layout fingerprint,
the block key and the life cycle (:meth:`ObjectCodec.name`), so managers with another model
or layout never read each other's bytes.  The manager never talks to a store; the data plane
(:mod:`kvcm.dataplane`) does, in batches.

Object format
-------------
``header || payload``, the header (:data:`HEADER`, 88 bytes, little-endian)::

    magic b"KVCMOBJ1" | fingerprint (32) | block key (32) | lc (u32) | payload length (u64) |
    crc32 of the payload (u32)

Every read is verified (:meth:`ObjectCodec.check`): an object that is missing, short, longer
than expected, or whose magic, fingerprint, key, lc, length or checksum differs raises
``OSError`` — the load did not complete and the data plane reports the op as failed.  A
present object rejected for its content or length raises :class:`BadObjectError` (an
``OSError``), the only failure for which the data plane removes the object.

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
removed when the store opens and on every rescan.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
import struct
import tempfile
import time
import zlib
from collections.abc import Sequence
from typing import Self

DEFAULT_TIMEOUT_S = 10.0  # the data plane's deadline for one exists / put / get call (0: none)
MAGIC = b"KVCMOBJ1"
HEADER = struct.Struct("<8s32s32sIQI")  # magic, fingerprint, key, lc, payload length, crc32(payload)
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
    magic, fingerprint, key, life cycle, length or checksum) or the store saw a wrong
    length.  Only this failure makes the data plane remove the object: any other ``OSError``
    (a store that is down, slow, out of descriptors, a stale handle, an error code it does
    not know) says nothing about the object, and removing it would wipe a good object for
    every instance of the fleet."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


class ObjectCodec:
    """Names, headers and verification of the objects of one layout fingerprint."""

    def __init__(self, fingerprint: bytes) -> None:
        if not isinstance(fingerprint, bytes) or len(fingerprint) != 32:
            raise ValueError("the layout fingerprint must be 32 bytes")
        self.fingerprint = fingerprint
        self._prefix = f"kvcm-{fingerprint.hex()}-"

    def name(self, key: bytes, lc: int) -> str:
        """The object's name: fingerprint, block key and life cycle."""
        return f"{self._prefix}{key.hex()}-{lc}"

    def header(self, key: bytes, lc: int, payload: memoryview | bytes) -> bytes:
        return HEADER.pack(MAGIC, self.fingerprint, key, lc, len(payload), zlib.crc32(payload))

    def check(self, obj: memoryview, key: bytes, lc: int, payload_bytes: int) -> None:
        """Verify one object read back (``obj`` is exactly what was read):
        :class:`BadObjectError` (an ``OSError`` EIO) naming what differs."""
        want = HEADER.size + payload_bytes
        if len(obj) != want:
            raise BadObjectError(f"shared object {self.name(key, lc)}: {len(obj)} bytes, expected {want} "
                                 "(truncated or foreign)")
        magic, fp, k, olc, n, crc = HEADER.unpack_from(obj, 0)
        what = ("magic" if magic != MAGIC else "fingerprint" if fp != self.fingerprint else "key" if k != key
                else "life cycle" if olc != lc else "length" if n != payload_bytes
                else "checksum" if crc != zlib.crc32(obj[HEADER.size:]) else None)
        if what is not None:
            raise BadObjectError(f"shared object {self.name(key, lc)}: wrong {what} (foreign or corrupted)")


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
        raise NotImplementedError

    def put(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[OSError | None]:
        raise NotImplementedError

    def get(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[int | OSError]:
        raise NotImplementedError

    def remove(self, names: Sequence[str]) -> None:
        raise NotImplementedError

    def register(self, staging: Staging) -> None:
        """Make ``staging`` usable by :meth:`put` / :meth:`get` (a no-op for files)."""

    def unregister(self, staging: Staging) -> None:
        """Undo :meth:`register` before the buffer is freed."""

    def close(self) -> None:
        """Release the store's resources (idempotent)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FileStore(SharedStore):
    """Objects as files in one directory (see the module docstring)."""

    kind = "file"

    def __init__(self, directory: str, quota_bytes: int = 0, *, fsync: bool = True) -> None:
        if quota_bytes < 0:
            raise ValueError("quota_bytes must be >= 0")
        os.makedirs(directory, exist_ok=True)
        self.directory = self.location = directory
        self.quota_bytes = quota_bytes
        self.fsync = fsync
        self._estimate: int | None = None  # bytes in the directory, as far as this process knows
        self._unscanned = 0  # bytes this store wrote since its last scan of the directory
        self.evicted = 0  # objects this store removed to keep the quota
        self.rescans = 0  # directory scans made to keep the quota
        self.swept = 0  # stale temporary files removed
        self._sweep_tmp()

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name + OBJECT_SUFFIX)

    def exists(self, names: Sequence[str]) -> list[bool]:
        if not os.path.isdir(self.directory):
            raise OSError(errno.ENOENT, "the shared store's directory is gone", self.directory)
        return [os.path.isfile(self.path(n)) for n in names]

    def put(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[OSError | None]:
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
            self._keep_quota(written)
        return results

    def get(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[int | OSError]:
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

    def _objects(self, *, objects: bool = True) -> list[tuple[int, str, int]]:
        """(mtime_ns, name, bytes) of every object file, oldest first (none unless
        ``objects``); temporary files older than :data:`STALE_TMP_S` (a writer that crashed
        between create and rename) are removed on the way."""
        out = []
        stale_before = time.time_ns() - int(STALE_TMP_S * 1e9)
        with os.scandir(self.directory) as it:
            for e in it:
                with contextlib.suppress(FileNotFoundError):
                    if e.name.endswith(OBJECT_SUFFIX):
                        if objects:
                            st = e.stat()
                            out.append((st.st_mtime_ns, e.name, st.st_size))
                    elif e.name.startswith(TMP_PREFIX) and e.stat().st_mtime_ns < stale_before:
                        os.remove(e.path)
                        self.swept += 1
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
            for _, name, size in objs:
                if total <= low:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.directory, name))
                    self.evicted += 1
                total -= size
        self._estimate = total
        self._unscanned = 0

    def usage(self) -> tuple[int, int]:
        """(objects, bytes) in the directory now."""
        objs = self._objects()
        return len(objs), sum(o[2] for o in objs)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HEADER",
    "MAGIC",
    "OBJECT_SUFFIX",
    "QUOTA_LOW_WATERMARK",
    "STALE_TMP_S",
    "BadObjectError",
    "FileStore",
    "ObjectCodec",
    "SharedStore",
    "Staging",
    "parse_timeout",
]
