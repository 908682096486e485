"""A file store whose faults the vLLM connector tests switch on from outside the engine.

vLLM runs the connector in its own processes, so the test cannot reach into them: it writes
a mode into the file named by ``KVCM_TEST_FAULT_FILE`` and every store call reads it.  Made
by the connector through ``kv_connector_extra_config["shared_store_class"]``.

Modes: ``""`` none; ``delete``: each object is removed just before it is read (deleted
between the lookup and the load); ``corrupt``: one payload byte of each object is flipped
just before it is read; ``down``: every call fails as a store that cannot be reached;
``hang``: every call sleeps ``HANG_S`` first (past the connector's deadline); ``full``:
writes fail with ENOSPC (a full disk under the store); ``die``: the store goes down inside
the first get (a load in flight): that get fails and so does every call after it (the mode
becomes ``down``, for every process reading the file); ``slow``: every get sleeps ``SLOW_S``
first (within the deadline: loads stay in flight a while, e.g. for aborts to land on);
``unreadable``: every object is listed by ``exists`` but its get (and put) fails with EACCES (instances
running as different users on one directory, a file system returning EIO, a network store
whose metadata answers while its data path is down).

:func:`truncate_disk_hook` is a ``copy_fault_hook``: with the mode ``truncate-disk:DIR`` it
truncates kvcm's disk pool files in ``DIR`` just before the first copy op that reads the disk
tier runs (a disk load in flight), once (the mode is cleared); with ``slow-load`` every page
copied from disk or the store into kvcm's tier 0 takes ``SLOW_LOAD_S`` more.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Sequence

from kvcm.api import DISK, GPU, SHARED, CopyOp
from kvcm.dataplane.store import HEADER, FileStore, Staging

# The real-engine tests' store deadline (``shared_timeout_s``): generous, so that a store call
# on a loaded machine never reaches it by accident; ``hang`` sleeps well past it, ``slow``
# stays well within it.
STORE_DEADLINE_S = 2.0
HANG_S = 3 * STORE_DEADLINE_S
SLOW_S = 0.1
SLOW_LOAD_S = 0.2


class FaultyFileStore(FileStore):
    def __init__(self, location: str, quota_bytes: int = 0) -> None:
        super().__init__(location.removeprefix("file://"), quota_bytes)

    @staticmethod
    def mode() -> str:
        path = os.environ.get("KVCM_TEST_FAULT_FILE")
        if not path or not os.path.exists(path):
            return ""
        with open(path) as f:
            return f.read().strip()

    def _before(self, what: str) -> None:
        m = self.mode()
        if m == "down":
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"test store down ({what})")
        if m == "hang":
            time.sleep(HANG_S)

    def exists(self, names: Sequence[str]) -> list[bool]:
        self._before("exists")
        return super().exists(names)

    def put(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[OSError | None]:
        self._before("put")
        if self.mode() == "full":
            return [OSError(errno.ENOSPC, "No space left on device (test)") for _ in items]
        if self.mode() == "unreadable":  # another user's objects: not ours to overwrite either
            return [PermissionError(errno.EACCES, f"Permission denied (test): {name}") for name, _, _ in items]
        return super().put(items, staging)

    def get(self, items: Sequence[tuple[str, int, int]], staging: Staging) -> list[int | OSError]:
        self._before("get")
        m = self.mode()
        if m == "slow":
            time.sleep(SLOW_S)
        if m == "die":
            _set_mode("down")
            raise ConnectionRefusedError(errno.ECONNREFUSED, "test store died during a get")
        if m == "unreadable":  # listed, never readable (another user's 0600 objects, EIO)
            return [PermissionError(errno.EACCES, f"Permission denied (test): {name}") for name, _, _ in items]
        for name, _, _ in items:
            path = self.path(name)
            if m == "delete" and os.path.exists(path):
                os.unlink(path)
            elif m == "corrupt" and os.path.exists(path):
                with open(path, "r+b") as f:
                    f.seek(HEADER.size)
                    b = f.read(1)
                    f.seek(HEADER.size)
                    f.write(bytes([b[0] ^ 0xFF]))
        return super().get(items, staging)


def _set_mode(mode: str) -> None:
    path = os.environ.get("KVCM_TEST_FAULT_FILE")
    if path:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(mode)
        os.replace(tmp, path)


def truncate_disk_hook(op: CopyOp) -> None:
    """``copy_fault_hook`` (module doc): truncate the disk pool files as a disk read begins;
    with the mode ``slow-load``, every copy of a page from disk or the store into kvcm's
    tier 0 first sleeps ``SLOW_LOAD_S`` (outside the store's deadline: loads stay in flight
    longer than a step waits for them, e.g. for aborts to land on)."""
    if op.src_tier in (DISK, SHARED) and op.dst_tier == GPU and FaultyFileStore.mode() == "slow-load":
        time.sleep(SLOW_LOAD_S)
        return
    if op.src_tier != DISK:
        return
    m = FaultyFileStore.mode()
    if not m.startswith("truncate-disk:"):
        return
    _set_mode("")
    path = m.removeprefix("truncate-disk:")
    for root, _, files in os.walk(path):
        for name in files:
            if name.startswith("kvcm-pool-"):
                os.truncate(os.path.join(root, name), 0)
