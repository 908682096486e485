"""The disk tier's pools: one reserved, locked file per ``(disk tier, lc)`` of checksummed
slot records, read and written with explicit ``pread`` / ``pwrite`` (never an mmap), and
the removal of the files a crashed run left behind.  See :mod:`kvcm.dataplane`, "Disk
files".  Imports nothing of kvcm: bytes and files only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import tempfile
from collections.abc import Sequence
from typing import Any

try:  # ISA-L's crc32: the same values as zlib's, about 10x faster (DECISIONS.md "Loads at memory speed")
    from isal.isal_zlib import crc32
except ImportError:  # isal not installed (kvcm[vllm], kvcm[all]): zlib's
    from zlib import crc32

POOL_PREFIX = "kvcm-pool-"
TRAILER = struct.Struct("<I4s")  # crc32 of the slot's data, magic
MAGIC = b"KVCP"


def torch_module():
    """torch, imported on first use (``import kvcm`` never needs it)."""
    import torch

    return torch


def close_pool_files(files: list[tuple[str, int]]) -> None:
    """Remove each file, then close its descriptor (which drops its lock)."""
    for path, fd in files:
        with contextlib.suppress(OSError):
            os.remove(path)
        with contextlib.suppress(OSError):
            os.close(fd)


def remove_stale_pool_files(directory: str) -> list[str]:
    """Remove the ``kvcm-pool-*`` files in ``directory`` that no live plane holds (their
    ``flock`` is free: the plane that made them is gone).  Returns the removed paths."""
    removed = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return removed
    for name in names:
        if not name.startswith(POOL_PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # held by a live plane
            continue
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                os.remove(path)
                removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


class DiskPool:
    """The slots of one ``(disk tier, lc)``: a reserved file of ``num_slots`` records of
    ``slot_bytes`` data + an 8-byte checksum trailer, read and written with explicit
    ``pread`` / ``pwrite`` (:mod:`kvcm.dataplane`, "Disk files").  Every failure is an ``OSError``."""

    def __init__(self, fd: int, path: str, num_slots: int, slot_bytes: int) -> None:
        self.fd = fd
        self.path = path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.record = slot_bytes + TRAILER.size

    @property
    def shape(self) -> tuple[int, int]:
        """``(num_slots, slot_bytes)``, like a memory pool's tensor shape."""
        return (self.num_slots, self.slot_bytes)

    def __len__(self) -> int:
        return self.num_slots

    def read(self, slot: int) -> bytes:
        """The data of ``slot``, verified (OSError EIO on a short read or a bad checksum)."""
        rec = os.pread(self.fd, self.record, slot * self.record)
        if len(rec) != self.record:
            raise OSError(errno.EIO, f"short read of disk slot {slot}: {len(rec)} of {self.record} bytes "
                                     "(was the pool file truncated?)", self.path)
        data = memoryview(rec)[:self.slot_bytes]
        crc, magic = TRAILER.unpack_from(rec, self.slot_bytes)
        if magic != MAGIC or crc != crc32(data):
            raise OSError(errno.EIO, f"checksum mismatch in disk slot {slot} (never written, or corrupted)",
                          self.path)
        return bytes(data)

    def read_into(self, slot: int, out: Any) -> None:
        """The verified data of ``slot`` read straight into ``out`` (a writable buffer of
        ``slot_bytes`` bytes, e.g. a cpu pool row's numpy view): one copy out of the page
        cache, then the checksum over it (OSError EIO as :meth:`read`; ``out`` is then
        zeroed: bytes that failed their check never stay where a reader could take them)."""
        view = memoryview(out).cast("B")
        if view.nbytes != self.slot_bytes:
            raise ValueError(f"disk slot {slot}: a buffer of {view.nbytes} bytes for {self.slot_bytes}")
        trailer = bytearray(TRAILER.size)
        try:
            n = os.preadv(self.fd, [view, trailer], slot * self.record)
            if n != self.record:
                raise OSError(errno.EIO, f"short read of disk slot {slot}: {n} of {self.record} bytes "
                                         "(was the pool file truncated?)", self.path)
            crc, magic = TRAILER.unpack_from(trailer)
            if magic != MAGIC or crc != crc32(view):
                raise OSError(errno.EIO, f"checksum mismatch in disk slot {slot} (never written, or corrupted)",
                              self.path)
        except OSError:
            view[:] = bytes(view.nbytes)
            raise

    def write(self, slot: int, data: Any) -> None:
        """Write ``data`` (``slot_bytes`` bytes: bytes or any buffer, not copied) and its
        checksum trailer into ``slot``."""
        view = memoryview(data).cast("B")
        trailer = TRAILER.pack(crc32(view), MAGIC)
        n = os.pwritev(self.fd, [view, trailer], slot * self.record)
        if n != view.nbytes + len(trailer):
            raise OSError(errno.EIO, f"short write to disk slot {slot}: {n} of {view.nbytes + len(trailer)} bytes",
                          self.path)

    def read_rows(self, slots: Sequence[int]):
        """``uint8[len(slots), slot_bytes]`` (cpu) of the verified data of ``slots``."""
        torch = torch_module()
        out = torch.empty((len(slots), self.slot_bytes), dtype=torch.uint8)
        for i, s in enumerate(slots):
            self.read_into(s, out[i].numpy())
        return out

    def write_rows(self, slots: Sequence[int], rows) -> None:
        """Write ``rows`` (``uint8[len(slots), slot_bytes]``, any device) into ``slots``."""
        rows = rows.to("cpu").contiguous()
        for i, s in enumerate(slots):
            self.write(s, rows[i].numpy())

    def read_all(self):
        """Every slot's verified data, ``uint8[num_slots, slot_bytes]`` (cpu)."""
        return self.read_rows(range(self.num_slots))

    def resize(self, n: int) -> None:
        """set_quota: ``n`` records.  Growing reserves the new records' space at once
        (``posix_fallocate``: ENOSPC raises and changes nothing) and leaves them unwritten
        (a read fails its checksum until a page is written there); shrinking truncates the
        file after record ``n``.  The records kept are not touched: their checksums hold."""
        if n > self.num_slots:
            try:
                os.posix_fallocate(self.fd, 0, n * self.record)
            except OSError as e:
                why = os.strerror(e.errno) if e.errno else str(e)
                raise OSError(e.errno, f"disk pool: cannot reserve {n} slots of {self.record} bytes: {why}",
                              self.path) from e
        else:
            os.ftruncate(self.fd, n * self.record)
        self.num_slots = n

    def write_all(self, rows) -> None:
        """Write ``rows`` (``uint8[num_slots, slot_bytes]``) into every slot."""
        self.write_rows(range(self.num_slots), rows)


def create_pool_file(directory: str, lc: int, nbytes: int, tier: int) -> tuple[str, int]:
    """A locked, fully reserved pool file (:mod:`kvcm.dataplane`, "Disk files"); OSError naming the
    tier and path when it cannot be made (nothing is left behind)."""
    fd, tmp = tempfile.mkstemp(prefix=".kvcm-new-", suffix=".bin", dir=directory)
    path = tmp
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = os.path.join(directory, f"{POOL_PREFIX}{os.getpid()}-{os.path.basename(tmp)[10:-4]}-lc{lc}.bin")
        os.rename(tmp, path)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path)
        os.close(fd)
        why = os.strerror(e.errno) if e.errno else str(e)
        raise OSError(e.errno, f"disk tier (tier {tier}): cannot reserve {nbytes} bytes for life cycle {lc} "
                               f"at {path}: {why}", path) from e
    return path, fd
