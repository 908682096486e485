"""The torch data plane: the memory behind kvcm's slot indices (SPEC sec. 14).

The manager only hands out slot indices and copy ops; a :class:`DataPlane` owns the bytes.
torch is imported lazily (on first construction), so ``import kvcm`` stays light.

Pools
-----
One pool tensor per ``(tier, life cycle)``, shaped ``uint8[num_slots, slot_bytes]`` where
``num_slots`` is the manager's pool size for that tier and lc (``resolve_config``) and
``slot_bytes`` is ``LifeCycle.slot_bytes``:

* ``gpu``  — on the engine's ``device`` (``cpu`` when there is no accelerator);
* ``host`` — CPU memory, pinned when CUDA is available (fast, async-capable H2D/D2H);
* ``disk`` — a :class:`DiskPool`: a file ``kvcm-pool-<pid>-<random>-lc<lc>.bin`` under the
  tier's ``path``, read and written with explicit ``os.pread`` / ``os.pwrite`` (never an
  mmap: a full filesystem or a truncated file must be an ``OSError``, never a SIGBUS).

Disk files (SPEC sec. 15)
-------------------------
* **Space is reserved** when the plane is built (``os.posix_fallocate`` of the whole file):
  a filesystem too small raises ``OSError(ENOSPC)`` naming the tier and the path, and the
  plane removes every file it created.
* **Each slot is a record** of ``slot_bytes`` data bytes then an 8-byte trailer: the
  ``zlib.crc32`` of the data (little-endian uint32) and the magic ``b"KVCP"``.  The trailer
  is written with the page and verified on every read: a mismatch, a never-written slot or
  a short read (a truncated file) raises ``OSError(EIO)`` — the op did not complete.
* **Stale files**: the plane holds an exclusive ``flock`` on each of its files while it is
  open (the kernel drops it when the process dies).  A new plane removes every
  ``kvcm-pool-*`` file in its directory whose lock it can take: the file of a crashed run.
  A file is created under a temporary name, locked, and only then renamed to
  ``kvcm-pool-*``, so a live plane's file is never seen unlocked.  (``flock`` is advisory
  and per host: do not share one disk directory between hosts.)

Byte layout of one slot
-----------------------
The layers of a life cycle are laid out one after another in **config order**
(``LifeCycle.layer_ids``); a slot is exactly ``slot_bytes`` bytes, no padding:

* attention lc: ``[layer][token 0..B-1][bytes_per_token]`` — layer ``l`` occupies bytes
  ``off_l .. off_l + B * bytes_per_token_l`` of the slot, token-major, so the K/V of token
  ``t`` of the block is one contiguous run of ``bytes_per_token`` bytes.
* ssm lc: ``[layer][state_bytes]`` — one recurrent state per layer.

Typed views (no copies) are offered per layer: :meth:`DataPlane.kv` returns
``dtype[num_slots, B, *token_shape]`` and :meth:`DataPlane.state` returns
``dtype[num_slots, *state_shape]``; ``token_shape``/``state_shape`` come from the
``shapes`` argument (default: flat, ``bytes // itemsize``).  The reference engine uses
``token_shape = (2, heads, head_dim)``: K then V of one token.

Copy ops and copy runs
----------------------
:meth:`DataPlane.apply_runs` executes :class:`~kvcm.api.CopyRun` s
(``KVCacheManager.drain_copy_runs()``: whole slots, raw bytes), runs in order, with the
result of the ops one by one in order: the ops of a run commute (DECISIONS.md "Copy runs"),
so a run of memory tiers (gpu, host) is **one** gather (``index_select``) and one scatter
(``index_copy_``) whose index tensors are the run's ``array('q')`` slot columns as they are
(``torch.frombuffer``: no per-op Python); a disk side goes op by op (``pread`` /
``pwrite``); consecutive runs of the shared tier with one direction that write no location
twice (``copy_runs`` cuts them apart at every change of life cycle) are one store or load
batch.  :meth:`DataPlane.apply` executes ``CopyOp`` s: it validates them and hands
``kvcm.api.copy_runs(ops)`` to the same code, so the project has one run rule.  Everything
is validated before anything is copied (known tier and lc, every slot in range, a known
reason, keys exactly on the shared side; for a run also that its ops commute): a bad op or
run raises ``ValueError`` and nothing is copied.

Failures (SPEC sec. 15): when an op fails (an ``OSError`` of disk I/O or a checksum, or any
exception of a torch copy, e.g. out of memory), the plane finishes the run it is in (the
shared batch it is in: its ops commute), executes **nothing after it**, and raises
:class:`kvcm.api.CopyError` whose ``ops`` (``CopyOp`` s: ``run.ops()``, or the very ops
given to :meth:`DataPlane.apply`) are the failed ops of the run and every op after the run,
in op order: exactly the ops whose destination cannot be trusted.  Stats count completed
ops only.  The engine passes them to ``KVCacheManager.forget_copies``.

A tier given as an int (in ops, :meth:`DataPlane.pool`, the views) is SPEC's number by
kind, as the manager's copy ops carry it: gpu 0, host 1, disk 2, shared 3 (a gpu + disk
config has tiers 0 and 2); ``self.pools`` itself is indexed by config position.

The shared tier (DECISIONS.md "The shared tier")
------------------------------------------------
A ``Tier("shared", quota_bytes, path)`` has no pool: its ``path`` names a store
(:func:`open_store`: a directory, ``file:///dir``, or
``mooncake://host:port?metadata=url``), or one is given as ``store=``.  Objects are named
and checked by an :class:`~kvcm.shared_store.ObjectCodec` of the config's layout
fingerprint (``layout_fingerprint(resolved, config.shared_namespace)``).

* :meth:`DataPlane.shared_lookup` turns the manager's ``shared_candidates`` into the present
  pairs with **one** batched existence query; a store that cannot answer counts as empty
  (``lookup_errors``): nothing is lost, the request computes.
* ``store`` ops (a pool slot -> an object) and shared ``onboard`` ops (an object -> a gpu
  slot) of one run are each executed as one batch per staging buffer's worth: the pages are
  gathered into a :class:`~kvcm.shared_store.Staging` buffer (registered with Mooncake: the
  put / get themselves are zero-copy), each object's header written / verified there, and
  loaded pages scattered into the pool with one ``index_copy_`` per (tier, lc).  In runs,
  the shared side of an op is the object ``(3, lc, key)``.
* Faults: a load that fails (missing, short, foreign, corrupted, store down) fails its op
  like a disk read: the run finishes, nothing after it runs, ``CopyError``.  A **store**
  op that fails stops nothing: every other op still runs, and the failed store ops are
  listed in the ``CopyError`` raised at the end (``forget_copies`` forgets nothing for
  them).  A failed write never shows an object (the stores publish whole objects only).
  An object the codec rejected (a :class:`~kvcm.shared_store.BadObjectError`: short, long,
  foreign, corrupted) is removed from the store, so that later lookups do not find it
  again and a later store can write it whole (``removed_bad``).  No other failure removes
  anything (a store that is down, slow, out of descriptors, an unknown error code: the
  object may be good, and it is shared by the whole fleet).
* A slow store: each ``exists`` / ``put`` / ``get`` call has a deadline
  (``shared_timeout_s``, from the store's ``timeout_s``: default
  :data:`~kvcm.shared_store.DEFAULT_TIMEOUT_S`); it runs on a worker thread and past the
  deadline fails as a store that is down (``timeouts``); its staging buffer is abandoned,
  so a late get never writes into anything read afterwards (:meth:`DataPlane._call`).  A
  store that answers with the wrong number of results fails the call the same way.
* Authentication: with a store secret (``shared_secret=``, else the config's
  ``shared_secret_file``, else ``$KVCM_STORE_SECRET_FILE`` / ``$KVCM_STORE_SECRET``) objects
  carry an HMAC-SHA256, checked with the rest of the object before any byte is scattered
  into a pool; an object without a valid one fails its load like a corrupted one, is
  removed, and is counted (``auth_failures``).
* ``shared_stats``: lookups, objects and payload bytes stored / loaded, failures, batches,
  timeouts, and the seconds the data plane spent in store and load batches (gather, checksums, I/O).
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import math
import os
import struct
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self
from urllib.parse import parse_qs

from kvcm.api import SHARED, AttentionLayer, CopyError, CopyOp, CopyRun, KVCacheManagerConfig, copy_runs
from kvcm.config import layout_fingerprint, resolve_config, resolve_quota
from kvcm.shared_store import (
    HEADER,
    BadObjectError,
    FileStore,
    ObjectCodec,
    SharedStore,
    Staging,
    parse_timeout,
    store_secret,
)

COPY_REASONS = ("offload", "onboard", "cow", "snapshot", "store", "relocate")
STAGING_MAX_BYTES = 64 << 20  # the largest staging buffer: bigger batches go in several calls
POOL_PREFIX = "kvcm-pool-"
TRAILER = struct.Struct("<I4s")  # crc32 of the slot's data, magic
MAGIC = b"KVCP"


def _torch():
    import torch  # lazily: kvcm itself never needs torch

    return torch


def _close_files(files: list[tuple[str, int]]) -> None:
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
    ``pread`` / ``pwrite`` (see the module docstring).  Every failure is an ``OSError``."""

    def __init__(self, fd: int, path: str, num_slots: int, slot_bytes: int) -> None:
        self.fd = fd
        self.path = path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.record = slot_bytes + TRAILER.size

    @property
    def shape(self) -> tuple[int, int]:
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
        if magic != MAGIC or crc != zlib.crc32(data):
            raise OSError(errno.EIO, f"checksum mismatch in disk slot {slot} (never written, or corrupted)",
                          self.path)
        return bytes(data)

    def write(self, slot: int, data: bytes) -> None:
        """Write ``data`` (``slot_bytes`` bytes) and its checksum trailer into ``slot``."""
        buf = bytes(data) + TRAILER.pack(zlib.crc32(data), MAGIC)
        n = os.pwrite(self.fd, buf, slot * self.record)
        if n != len(buf):
            raise OSError(errno.EIO, f"short write to disk slot {slot}: {n} of {len(buf)} bytes", self.path)

    def read_rows(self, slots: Sequence[int]):
        """``uint8[len(slots), slot_bytes]`` (cpu) of the verified data of ``slots``."""
        torch = _torch()
        out = torch.empty((len(slots), self.slot_bytes), dtype=torch.uint8)
        for i, s in enumerate(slots):
            out[i] = torch.frombuffer(bytearray(self.read(s)), dtype=torch.uint8)
        return out

    def write_rows(self, slots: Sequence[int], rows) -> None:
        """Write ``rows`` (``uint8[len(slots), slot_bytes]``, any device) into ``slots``."""
        rows = rows.to("cpu").contiguous()
        for i, s in enumerate(slots):
            self.write(s, rows[i].numpy().tobytes())

    def read_all(self):
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
        self.write_rows(range(self.num_slots), rows)


def _create_disk_file(directory: str, lc: int, nbytes: int, tier: int) -> tuple[str, int]:
    """A locked, fully reserved pool file (see the module docstring); OSError naming the
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


def open_store(location: str, quota_bytes: int = 0, timeout_s: float | None = None) -> SharedStore:
    """The store a shared tier's ``path`` names: ``mooncake://host:port?metadata=<url>``
    (:class:`kvcm.mooncake_store.MooncakeStore`), ``file:///dir[?timeout_s=S]`` or a plain
    directory.  ``timeout_s`` (both kinds): the data plane's deadline for one store call
    (default :data:`kvcm.shared_store.DEFAULT_TIMEOUT_S`; 0: none); Mooncake's set-up is
    bounded by it too (the argument ``timeout_s``, else the location's)."""
    if not isinstance(location, str) or not location:
        raise ValueError("the shared tier needs a path: a directory, file:///dir or mooncake://host:port?metadata=url")
    if location.startswith("mooncake://"):
        from kvcm.mooncake_store import MooncakeStore  # only when asked for: an optional dependency

        return MooncakeStore.from_url(location, segment_bytes=quota_bytes, setup_timeout_s=timeout_s)
    timeout = None
    if location.startswith("file://"):
        path, _, q = location[len("file://"):].partition("?")
        query = parse_qs(q, keep_blank_values=True)
        if set(query) - {"timeout_s"}:
            raise ValueError(f"{location!r}: unknown parameters {sorted(set(query) - {'timeout_s'})}")
        if "timeout_s" in query:
            timeout = parse_timeout(query["timeout_s"][-1], location)
        location = path
    elif "://" in location:
        raise ValueError(f"unknown shared store {location!r}: use a directory, file:///dir or "
                         "mooncake://host:port?metadata=url")
    store = FileStore(location, quota_bytes)
    if timeout is not None:
        store.timeout_s = timeout
    return store



class DataPlane:
    """Pool tensors per ``(tier, lc)`` for one manager config, and a copy-op executor.

    ``device``: where the ``gpu`` tier lives (default ``"cpu"``).  ``dtype``: the element
    type of the typed views.  ``shapes``: ``{layer_id: shape}`` — per-token shape of an
    attention layer, state shape of an ssm layer (its bytes must match the config).
    ``store``: the shared tier's store (default: the one the tier's path names).
    ``shared_timeout_s``: the deadline for one store call (default: the store's
    ``timeout_s``, :data:`kvcm.shared_store.DEFAULT_TIMEOUT_S` unless its location says;
    0: none).  ``shared_secret``: the store secret that authenticates objects (bytes or
    str, at least 16 bytes); default: ``config.shared_secret_file``'s, else
    ``$KVCM_STORE_SECRET_FILE``'s or ``$KVCM_STORE_SECRET`` (:func:`kvcm.shared_store.store_secret`);
    none: objects carry no MAC.
    """

    def __init__(
        self,
        config: KVCacheManagerConfig,
        *,
        device: Any = "cpu",
        dtype: Any = None,
        shapes: Mapping[int, Sequence[int]] | None = None,
        store: SharedStore | None = None,
        shared_timeout_s: float | None = None,
        shared_secret: bytes | str | None = None,
    ) -> None:
        torch = _torch()
        rc = resolve_config(config)
        self.config = config
        self.B = config.tokens_per_block
        self.life_cycles = rc.life_cycles
        self.tier_kinds = rc.tier_kinds
        # an int tier is SPEC's number by kind (gpu 0, host 1, disk 2), as in copy ops;
        # pools are indexed by config position
        self._tier_pos = {tid: pos for pos, tid in enumerate(rc.tier_ids)}
        self._rc = rc
        self.num_slots = [list(row) for row in rc.slots]  # [tier][lc]; set_quota changes it
        self.device = torch.device(device)
        self.dtype = torch.float32 if dtype is None else dtype
        itemsize = torch.empty((), dtype=self.dtype).element_size()

        self._place_layers(config, dict(shapes or {}), itemsize)

        self._files: list[tuple[str, int]] = []  # (path, locked fd) of each disk pool file
        self._finalizer = weakref.finalize(self, _close_files, self._files)
        self.pools: list[list[Any]] = []  # [config position][lc] uint8[num_slots, slot_bytes] or a DiskPool
        self.shared: SharedStore | None = None
        self.codec: ObjectCodec | None = None
        self.shared_secret_source = ""  # where the store secret came from ("": none); never the secret
        self._own_store = False
        self._staging: Staging | None = None
        self.shared_timeout_s = 0.0
        self._late: list[tuple[threading.Event, Staging | None]] = []  # calls past their deadline (_call)
        self.shared_stats = dict.fromkeys(
            ("lookups", "lookup_names", "lookup_hits", "lookup_errors", "stores", "store_bytes", "store_failures",
             "loads", "load_bytes", "load_failures", "removed_bad", "auth_failures", "put_batches", "get_batches",
             "timeouts"), 0)
        self.shared_seconds = {"lookup": 0.0, "store": 0.0, "load": 0.0}  # reporting only (throughput)
        try:
            self._make_pools(torch, config, rc.tier_ids)
            self._open_shared(config, rc, store, shared_timeout_s, shared_secret)
        except BaseException:
            self.pools = []
            self._finalizer()
            raise
        # a test hook (fault injection): called with each op just before it is executed;
        # an exception it raises makes that op fail as an I/O error would
        self.fault: Callable[[CopyOp], None] | None = None
        self.copies = dict.fromkeys(COPY_REASONS, 0)  # ops executed, by reason
        self.copy_bytes = dict.fromkeys(COPY_REASONS, 0)
        self.routes: dict[str, int] = {}  # ops executed by route, e.g. "gpu->host"
        self.runs = 0  # batched runs executed
        self.kernel_calls = 0  # gather+scatter pairs issued (one per (src tier, dst tier, lc) per run)

    def _place_layers(self, config: KVCacheManagerConfig, shapes: dict[int, Sequence[int]], itemsize: int) -> None:
        """Where each layer sits inside its life cycle's slot, and its typed view's shape
        (``shapes`` is consumed: a shape left over names an unknown layer)."""
        self._layer_lc: dict[int, int] = {}
        self._layer_region: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # id -> (offset, nbytes, view shape)
        layers = {layer.layer_id: layer for layer in config.layers}
        for lc in self.life_cycles:
            off = 0
            for lid in lc.layer_ids:
                layer = layers[lid]
                unit = layer.bytes_per_token if isinstance(layer, AttentionLayer) else layer.state_bytes
                shape = tuple(shapes.pop(lid, (unit // itemsize,)))
                bad = [d for d in shape if isinstance(d, bool) or not isinstance(d, int) or d < 1]
                if bad:
                    raise ValueError(f"layer {lid}: shape {shape} has a dimension that is not a positive int: "
                                     f"{bad[0]!r}")
                if math.prod(shape) * itemsize != unit:
                    raise ValueError(f"layer {lid}: shape {shape} of {self.dtype} is not {unit} bytes")
                nbytes = unit * self.B if lc.kind == "attn" else unit
                view_shape = (self.B, *shape) if lc.kind == "attn" else shape
                self._layer_lc[lid] = lc.id
                self._layer_region[lid] = (off, nbytes, view_shape)
                off += nbytes
            assert off == lc.slot_bytes
        if shapes:
            raise ValueError(f"shapes given for unknown layers {sorted(shapes)}")

    def _make_pools(self, torch: Any, config: KVCacheManagerConfig, tier_ids: Sequence[int]) -> None:
        """One pool per (tier, life cycle), appended to ``self.pools`` (disk files to
        ``self._files``, which the caller's finalizer closes on failure)."""
        pin = torch.cuda.is_available()
        for t, tier in enumerate(config.tiers):
            row = []
            if tier.kind == "shared":  # no slots, no pool (listed last): objects in a store (_open_shared)
                continue
            if tier.kind == "disk":
                os.makedirs(tier.path, exist_ok=True)
                remove_stale_pool_files(tier.path)  # files of crashed runs (module docstring)
            for lc in self.life_cycles:
                n, sb = self.num_slots[t][lc.id], lc.slot_bytes
                if tier.kind == "gpu":
                    pool = torch.zeros((n, sb), dtype=torch.uint8, device=self.device)
                elif tier.kind == "host":
                    pool = torch.zeros((n, sb), dtype=torch.uint8, pin_memory=pin)
                else:  # disk: a reserved, locked file read and written with pread/pwrite
                    path, fd = _create_disk_file(tier.path, lc.id, n * (sb + TRAILER.size), tier_ids[t])
                    self._files.append((path, fd))
                    pool = DiskPool(fd, path, n, sb)
                row.append(pool)
            self.pools.append(row)

    def _open_shared(self, config: KVCacheManagerConfig, rc: Any, store: SharedStore | None,
                     timeout_s: float | None, secret: bytes | str | None) -> None:
        tier = rc.shared_tier
        if tier is None:
            if store is not None:
                raise ValueError("store= given but the config has no shared tier")
            if secret is not None:
                raise ValueError("shared_secret given but the config has no shared tier")
            return
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not math.isfinite(timeout_s) or timeout_s < 0):
            raise ValueError(f"shared_timeout_s must be a number of seconds >= 0 (0: none), got {timeout_s!r}")
        key, self.shared_secret_source = store_secret(secret, config.shared_secret_file)
        self.codec = ObjectCodec(layout_fingerprint(rc, config.shared_namespace), key)
        if store is None:
            store = open_store(tier.path, tier.quota_bytes, timeout_s)  # set-up within the deadline
            self._own_store = True
        self.shared = store
        self.shared_timeout_s = float(store.timeout_s if timeout_s is None else timeout_s)

    # ------------------------------------------------------------------ views

    def pool(self, tier: int | str, lc: int):
        """The raw ``uint8[num_slots, slot_bytes]`` pool of ``(tier, lc)``."""
        return self.pools[self._tier(tier)][lc]

    def kv(self, layer_id: int, tier: int | str = "gpu"):
        """Typed view ``[num_slots, B, *token_shape]`` of attention layer ``layer_id``."""
        return self._view(layer_id, tier, "attn")

    def state(self, layer_id: int, tier: int | str = "gpu"):
        """Typed view ``[num_slots, *state_shape]`` of ssm layer ``layer_id``."""
        return self._view(layer_id, tier, "ssm")

    def lc_of(self, layer_id: int) -> int:
        return self._layer_lc[layer_id]

    def _view(self, layer_id: int, tier: int | str, kind: str):
        if layer_id not in self._layer_lc:
            raise ValueError(f"unknown layer {layer_id}")
        lc = self._layer_lc[layer_id]
        if self.life_cycles[lc].kind != kind:
            raise ValueError(f"layer {layer_id} is not an {kind} layer")
        off, nbytes, shape = self._layer_region[layer_id]
        raw = self.pools[self._tier(tier)][lc]
        if isinstance(raw, DiskPool):
            raise ValueError("the disk tier has no tensor views: it is read and written with explicit file I/O "  # noqa: TRY004
                             "(DiskPool.read_rows / write_rows)")
        return raw[:, off:off + nbytes].view(self.dtype).view(raw.shape[0], *shape)

    def _tier(self, tier: int | str) -> int:
        if isinstance(tier, str):
            if tier not in self.tier_kinds:
                raise ValueError(f"no {tier!r} tier; tiers: {', '.join(self.tier_kinds)}")
            return self.tier_kinds.index(tier)
        if isinstance(tier, bool) or not isinstance(tier, int) or tier not in self._tier_pos:
            raise ValueError(f"unknown tier {tier!r}; tiers are {self._tier_names()}")
        return self._tier_pos[tier]

    def _tier_names(self) -> str:
        return ", ".join(f"{t} ({self.tier_kinds[p]})" for t, p in self._tier_pos.items())

    # ------------------------------------------------------------------ quotas at run time

    def set_quota(self, manager: Any, tier: int | str, quota_bytes: int) -> int:
        """``manager.set_quota(tier, quota_bytes)`` with the pools following it
        (DECISIONS.md "Quotas at run time"): pools that grow are grown first (a disk pool's
        new records reserved), then the manager resizes its pools, then its pending copy
        ops are drained and executed (:meth:`apply`: the offloads of the shrink and the
        ``relocate`` ops that move live pages out of the vanishing slots), and only then do
        shrinking pools lose their top slots, so no live page's bytes are lost.  Returns
        the number of ops executed.  A refusal of the manager (or a disk that cannot
        reserve the space) raises with the pools as they were.  A failed copy raises
        :class:`~kvcm.api.CopyError` after the pools are resized (the manager's already
        are): report its ops with ``manager.forget_copies``.  Views taken before
        (:meth:`kv`, :meth:`state`, :meth:`pool`) are stale afterwards."""
        pos, _q, per_lc = resolve_quota(self._rc, tier, quota_bytes)
        old = list(self.num_slots[pos])
        grown: list[int] = []
        try:
            for lc, n in enumerate(per_lc):
                if n > old[lc]:
                    self._resize_pool(pos, lc, n)
                    grown.append(lc)
            manager.set_quota(tier, quota_bytes)
        except BaseException:
            for lc in grown:  # the new slots were never used: nothing to keep
                self._resize_pool(pos, lc, old[lc])
            raise
        try:
            return self.apply(manager.drain_copy_ops())
        finally:
            for lc, n in enumerate(per_lc):
                if n < old[lc]:
                    self._resize_pool(pos, lc, n)

    def _resize_pool(self, pos: int, lc: int, n: int) -> None:
        """Pool (config position ``pos``, ``lc``) to ``n`` slots, keeping slots
        ``[0, min(old, n))`` byte for byte; new slots of a memory tier are zero."""
        pool = self.pools[pos][lc]
        if isinstance(pool, DiskPool):
            pool.resize(n)
        else:
            torch = _torch()
            keep = min(n, pool.shape[0])
            kind = self.tier_kinds[pos]
            pin = kind == "host" and torch.cuda.is_available()
            new = torch.zeros((n, pool.shape[1]), dtype=torch.uint8, device=pool.device, pin_memory=pin)
            new[:keep].copy_(pool[:keep])
            self.pools[pos][lc] = new
        self.num_slots[pos][lc] = n

    # ------------------------------------------------------------------ copy ops

    def check(self, op: Any) -> CopyOp:
        """Validate one op (a CopyOp, or its ``to_json()`` list); ValueError when bad."""
        if not isinstance(op, CopyOp):
            try:
                op = CopyOp(*op)
                if isinstance(op.key, str):  # to_json() writes the key as hex
                    op = CopyOp(op.lc, op.src_tier, op.src_slot, op.dst_tier, op.dst_slot, op.reason,
                                bytes.fromhex(op.key))
            except (TypeError, ValueError):
                raise ValueError(f"not a copy op: {op!r}") from None
        for name in ("lc", "src_tier", "src_slot", "dst_tier", "dst_slot"):
            v = getattr(op, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{op}: {name} must be an int")  # noqa: TRY004 - every bad op is a ValueError
        if not 0 <= op.lc < len(self.life_cycles):
            raise ValueError(f"{op}: unknown life cycle {op.lc}")
        shared_sides = [side for side in ("src", "dst") if getattr(op, f"{side}_tier") == SHARED]
        if shared_sides:
            self._check_shared(op, shared_sides)
        elif op.key is not None:
            raise ValueError(f"{op}: only an op of the shared tier names a key")
        for side in ("src", "dst"):
            t, s = getattr(op, f"{side}_tier"), getattr(op, f"{side}_slot")
            if t == SHARED and self.shared is not None:
                continue
            if t not in self._tier_pos:
                raise ValueError(f"{op}: unknown {side} tier {t}; tiers are {self._tier_names()}")
            n = self.num_slots[self._tier_pos[t]][op.lc]
            if not 0 <= s < n:
                raise ValueError(f"{op}: {side} slot {s} out of range [0, {n})")
        if op.reason not in COPY_REASONS:
            raise ValueError(f"{op}: unknown reason {op.reason!r}")
        if op.reason == "store" and not shared_sides:
            raise ValueError(f"{op}: a store op writes the shared tier")
        return op

    def _check_shared(self, op: CopyOp, sides: list[str]) -> None:
        self._check_shared_route(str(op), sides, op.reason)
        if getattr(op, f"{sides[0]}_slot") != -1:
            raise ValueError(f"{op}: the shared side of an op has slot -1")
        if not isinstance(op.key, bytes) or len(op.key) != 32:
            raise ValueError(f"{op}: an op of the shared tier names its object by a 32-byte block key")

    def _check_shared_route(self, what: str, sides: list[str], reason: str) -> None:
        """The shared tier exists, is one side only, written by store and read by onboard."""
        if self.shared is None:
            raise ValueError(f"{what}: unknown {sides[0]} tier {SHARED} (the config has no shared tier); "
                             f"tiers are {self._tier_names()}")
        if sides != ["dst"] and sides != ["src"]:
            raise ValueError(f"{what}: a copy within the shared tier")
        if (reason, sides[0]) not in (("store", "dst"), ("onboard", "src")):
            raise ValueError(f"{what}: the shared tier is written by store ops and read by onboard ops only")

    def check_run(self, run: Any, where: str = "run") -> CopyRun:
        """Validate one :class:`~kvcm.api.CopyRun` (known tiers and lc, every slot in
        range, a known reason, keys exactly on the shared tier, and its ops commute: no
        location written twice, none both read and written); ValueError when bad."""
        if not isinstance(run, CopyRun):
            raise ValueError(f"{where}: not a CopyRun: {run!r}")  # noqa: TRY004 - every bad run is a ValueError
        what = f"{where} (lc {run.lc!r}, tiers {run.src_tier!r}->{run.dst_tier!r}, {run.reason!r})"
        for name in ("lc", "src_tier", "dst_tier"):
            v = getattr(run, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{what}: {name} must be an int")  # noqa: TRY004
        for name in ("src_slots", "dst_slots"):
            col = getattr(run, name)
            if not isinstance(col, array.array) or col.typecode != "q":
                raise ValueError(f"{what}: {name} must be an array('q')")
        n = len(run.src_slots)
        if len(run.dst_slots) != n:
            raise ValueError(f"{what}: {n} source slots but {len(run.dst_slots)} destination slots")
        if not 0 <= run.lc < len(self.life_cycles):
            raise ValueError(f"{what}: unknown life cycle {run.lc}")
        if run.reason not in COPY_REASONS:
            raise ValueError(f"{what}: unknown reason {run.reason!r}")
        shared_sides = [side for side in ("src", "dst") if getattr(run, f"{side}_tier") == SHARED]
        if shared_sides:
            self._check_shared_route(what, shared_sides, run.reason)
            keys = run.keys
            if not isinstance(keys, list) or len(keys) != n:
                raise ValueError(f"{what}: a run of the shared tier names one key per op")
            if any(not isinstance(k, bytes) or len(k) != 32 for k in keys):
                raise ValueError(f"{what}: an op of the shared tier names its object by a 32-byte block key")
            if shared_sides == ["dst"] and len(set(keys)) != n:
                raise ValueError(f"{what}: its ops do not commute (an object written twice)")
        elif run.keys is not None:
            raise ValueError(f"{what}: only a run of the shared tier names keys")
        elif run.reason == "store":
            raise ValueError(f"{what}: a store op writes the shared tier")
        for side in ("src", "dst"):
            t, col = getattr(run, f"{side}_tier"), getattr(run, f"{side}_slots")
            if t == SHARED:
                if n and (min(col) != -1 or max(col) != -1):
                    raise ValueError(f"{what}: the shared side of an op has slot -1")
                continue
            if t not in self._tier_pos:
                raise ValueError(f"{what}: unknown {side} tier {t}; tiers are {self._tier_names()}")
            lim = self.num_slots[self._tier_pos[t]][run.lc]
            if n and not (0 <= min(col) and max(col) < lim):
                bad = next(s for s in col if not 0 <= s < lim)
                raise ValueError(f"{what}: {side} slot {bad} out of range [0, {lim})")
        if run.dst_tier != SHARED:
            dst = set(run.dst_slots)
            if len(dst) != n or (run.src_tier == run.dst_tier and not dst.isdisjoint(run.src_slots) and any(
                    s != d for s, d in zip(run.src_slots, run.dst_slots, strict=True) if s in dst)):
                # (an op may read the slot it writes: a copy onto itself; no other op may)
                raise ValueError(f"{what}: its ops do not commute (a slot written twice, or written by one op "
                                 "and read by another)")
        return run

    def apply(self, ops: Iterable[Any]) -> int:
        """Execute ``ops`` in order (sequential semantics, batched); returns how many.
        Every op is validated before anything is copied (ValueError); then the ops run as
        ``kvcm.api.copy_runs(ops)`` (:meth:`apply_runs`).  A failed op raises
        :class:`kvcm.api.CopyError` after its run, naming every op not completed (module
        docstring)."""
        checked = [self.check(op) for op in ops]
        return self._run(copy_runs(checked), checked)

    def apply_runs(self, runs: Iterable[CopyRun]) -> int:
        """Execute ``runs`` (``KVCacheManager.drain_copy_runs()``) in order; returns how many
        ops.  Every run is validated before anything is copied (:meth:`check_run`,
        ValueError).  Failures as :meth:`apply` (``CopyError.ops`` are ``CopyOp`` s)."""
        runs = list(runs)
        for i, run in enumerate(runs):
            self.check_run(run, f"runs[{i}]")
        return self._run(runs, None)

    def _run(self, runs: list[CopyRun], ops: list[CopyOp] | None) -> int:
        """Execute validated ``runs`` (whose ops, when given as ``ops``, are reported as
        they are; else as ``run.ops()``): see the module docstring for failures."""
        total = sum(len(r) for r in runs)
        failed_stores: list[CopyOp] = []  # a failed store stops nothing (module docstring)
        store_cause: BaseException | None = None
        base = 0  # op index of the batch's first op
        i = 0
        while i < len(runs):
            j = self._batch_end(runs, i)
            batch = runs[i:j]
            n = sum(len(r) for r in batch)
            failed, cause = self._execute(batch)
            if failed:
                mine = ops[base:base + n] if ops is not None else [op for r in batch for op in r.ops()]
                lost = [mine[p] for p in failed]
                if batch[0].reason == "store":
                    failed_stores += lost
                    store_cause = store_cause or cause
                else:  # the batch is done; nothing after it runs
                    rest = ops[base + n:] if ops is not None else [op for r in runs[j:] for op in r.ops()]
                    first = lost[0]
                    lost = failed_stores + lost + rest  # in op order: earlier stores, this batch, the rest
                    raise CopyError(f"{len(lost)} of {total} copy ops did not complete "
                                    f"(first failure: {first.to_json()}: {cause})", lost, cause)
            base += n
            i = j
        if failed_stores:
            raise CopyError(f"{len(failed_stores)} of {total} copy ops (store) did not complete "
                            f"(first failure: {failed_stores[0].to_json()}: {store_cause})", failed_stores,
                            store_cause)
        return total

    @staticmethod
    def _batch_end(runs: list[CopyRun], i: int) -> int:
        """The end of the batch that starts at run ``i``: the run alone, except that
        consecutive runs of the shared tier with the same tiers and reason go in one store /
        load batch (one put / get per staging buffer) while no location is written twice:
        such runs commute (a store reads pool slots and writes objects, a load reads
        objects and writes pool slots, so only two writes can collide), and ``copy_runs``
        cuts them apart at every change of life cycle."""
        head = runs[i]
        if SHARED not in (head.src_tier, head.dst_tier):
            return i + 1

        def written(r: CopyRun) -> set:
            return {(r.lc, x) for x in (r.keys if r.dst_tier == SHARED else r.dst_slots)}

        seen = written(head)
        j = i + 1
        while j < len(runs) and (runs[j].src_tier, runs[j].dst_tier, runs[j].reason) == (
                head.src_tier, head.dst_tier, head.reason):
            w = written(runs[j])
            if not seen.isdisjoint(w):
                break
            seen |= w
            j += 1
        return j

    def _faulted(self, batch: list[CopyRun]) -> tuple[list[int], BaseException | None]:
        """The positions (in the batch's op order) of the ops the test hook ``fault`` fails."""
        failed: list[int] = []
        cause: BaseException | None = None
        for p, op in enumerate(op for r in batch for op in r.ops()):
            try:
                self.fault(op)
            except Exception as e:  # noqa: BLE001 - any injected failure fails the op
                failed.append(p)
                cause = cause or e
        return failed, cause

    def _execute(self, batch: list[CopyRun]) -> tuple[list[int], BaseException | None]:
        """Execute one batch (one run, or consecutive shared runs: :meth:`_batch_end`) of
        commuting ops; returns (the positions of the ops that failed, in op order, the first
        failure).  Only completed ops are counted in the stats."""
        failed, cause = self._faulted(batch) if self.fault is not None else ([], None)
        self.runs += len(batch)
        run = batch[0]
        if SHARED in (run.src_tier, run.dst_tier):
            skip = set(failed)
            todo = [(p, op) for p, op in enumerate(op for r in batch for op in r.ops()) if p not in skip]
            if todo:
                pos = {id(op): p for p, op in todo}
                method = self._store_batch if run.dst_tier == SHARED else self._load_batch
                bad, why = method([op for _, op in todo])
                failed += [pos[id(op)] for op in bad]
                cause = cause or why
            return sorted(failed), cause
        if len(run) == 0 or len(failed) == len(run):
            return failed, cause
        torch = _torch()
        sp, dp = self.pools[self._tier_pos[run.src_tier]][run.lc], self.pools[self._tier_pos[run.dst_tier]][run.lc]
        skip = set(failed)
        keep = [p for p in range(len(run)) if p not in skip] if failed else None
        if isinstance(sp, DiskPool) or isinstance(dp, DiskPool):  # file I/O: op by op
            done = 0
            for p in keep if keep is not None else range(len(run)):
                try:
                    if isinstance(sp, DiskPool):
                        row = torch.frombuffer(bytearray(sp.read(run.src_slots[p])), dtype=torch.uint8)
                    else:
                        row = sp[run.src_slots[p]]
                    if isinstance(dp, DiskPool):
                        dp.write(run.dst_slots[p], row.cpu().numpy().tobytes())
                    else:
                        dp[run.dst_slots[p]] = row.to(dp.device)
                except OSError as e:
                    failed.append(p)
                    cause = cause or e
                    continue
                done += 1
            self._count_n(run, done)
            self.kernel_calls += 1
            return sorted(failed), cause
        src = torch.frombuffer(run.src_slots, dtype=torch.int64)  # the run's column, no copy
        dst = torch.frombuffer(run.dst_slots, dtype=torch.int64)
        if keep is not None:
            sel = torch.tensor(keep, dtype=torch.int64)
            src, dst = src[sel], dst[sel]
        try:
            rows = sp.index_select(0, src.to(sp.device))
            dp.index_copy_(0, dst.to(dp.device), rows.to(dp.device))
        except (RuntimeError, MemoryError, OSError) as e:  # e.g. out of (device) memory
            return sorted(failed + (keep if keep is not None else list(range(len(run))))), cause or e
        self._count_n(run, len(src))
        self.kernel_calls += 1
        return failed, cause

    def _count(self, op: CopyOp) -> None:
        self._count_n(op, 1)

    def _count_n(self, op: CopyOp | CopyRun, n: int) -> None:
        """Count ``n`` completed ops of ``op``'s lc, tiers and reason."""
        if not n:
            return
        self.copies[op.reason] += n
        self.copy_bytes[op.reason] += n * self.life_cycles[op.lc].slot_bytes
        route = f"{self._kind(op.src_tier)}->{self._kind(op.dst_tier)}"
        self.routes[route] = self.routes.get(route, 0) + n

    def _kind(self, tier: int) -> str:
        return "shared" if tier == SHARED else self.tier_kinds[self._tier_pos[tier]]

    # ------------------------------------------------------------------ the shared tier

    def shared_lookup(self, candidates: Iterable[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """The ``(key, lc)`` pairs of ``candidates`` (``mgr.shared_candidates``) whose objects
        the store holds: one batched existence query.  A store that cannot answer counts as
        empty (``shared_stats["lookup_errors"]``)."""
        cands = list(candidates)
        if self.shared is None or not cands:
            return []
        t0 = time.perf_counter()
        self.shared_stats["lookups"] += 1
        self.shared_stats["lookup_names"] += len(cands)
        try:
            present = self._call("exists", self.shared.exists, [self.codec.name(k, lc) for k, lc in cands])
            if not isinstance(present, list) or len(present) != len(cands):  # a store that breaks its contract
                raise OSError(errno.EIO, f"the shared store answered {len(present) if isinstance(present, list) else present!r} "
                                         f"for {len(cands)} names")
        except OSError:
            self.shared_stats["lookup_errors"] += 1
            return []
        finally:
            self.shared_seconds["lookup"] += time.perf_counter() - t0
        hits = [c for c, p in zip(cands, present, strict=True) if p]
        self.shared_stats["lookup_hits"] += len(hits)
        return hits

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, staging: Staging | None = None) -> Any:
        """``fn(*args)`` (a store's exists / put / get) under the deadline
        ``shared_timeout_s``: run on a worker thread, and past the deadline stop waiting and
        raise ``TimeoutError`` (an ``OSError``, ETIMEDOUT), as a store that is down fails.
        The call may still complete later: ``staging`` (the buffer it reads or writes) is
        then abandoned — never used again by this plane, so a late get cannot write into
        anything that is read afterwards (pools are filled from it only after a call that
        returned in time).  The late call is remembered (``_late``): its buffer is
        unregistered and freed on this thread once it has returned (:meth:`_reap`), and
        :meth:`close` does not close the store under a call still in flight.  0: no
        deadline, the call runs on this thread."""
        if not self.shared_timeout_s:
            return fn(*args)
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["result"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e
            done.set()

        threading.Thread(target=work, name=f"kvcm-shared-{what}", daemon=True).start()
        if not done.wait(self.shared_timeout_s):
            self.shared_stats["timeouts"] += 1
            self._late.append((done, staging))
            if staging is not None and staging is self._staging:
                self._staging = None  # abandoned: freed by _reap once the call returned
            raise TimeoutError(errno.ETIMEDOUT, f"the shared store's {what} did not answer within "
                                                f"{self.shared_timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _reap(self) -> None:
        """Free the buffers of late calls that have returned since (on the caller's thread,
        so that registering and unregistering never race with each other)."""
        still: list[tuple[threading.Event, Staging | None]] = []
        for done, st in self._late:
            if not done.is_set():
                still.append((done, st))
            elif st is not None:
                if self.shared is not None:
                    with contextlib.suppress(OSError):
                        self.shared.unregister(st)
                st.close()
        self._late = still

    def _staging_for(self, nbytes: int) -> Staging:
        """The registered staging buffer, grown to ``nbytes`` (at most STAGING_MAX_BYTES
        unless one object needs more)."""
        if self._late:
            self._reap()
        st = self._staging
        if st is None or st.nbytes < nbytes:
            if st is not None:
                self.shared.unregister(st)
                st.close()
                self._staging = None
            st = Staging(nbytes)
            self.shared.register(st)
            self._staging = st
        return st

    def _chunks(self, ops: list[CopyOp], pool_side: str) -> list[tuple[Staging, list[tuple[int, int, int, list[CopyOp]]]]]:
        """Cut ``ops`` into batches that fit the staging buffer.  Within a batch the objects
        are laid out grouped by (pool tier, lc) — ``pool_side`` names the op's pool side,
        "src" or "dst" — so each group is one ``uint8[n, header + slot_bytes]`` region,
        filled or read with one torch copy.  Returns [(buffer, [(tier, lc, offset, ops)])]."""
        ops = sorted(ops, key=lambda op: (getattr(op, f"{pool_side}_tier"), op.lc))  # stable
        sizes = [HEADER.size + self.life_cycles[op.lc].slot_bytes for op in ops]
        cap = max(min(sum(sizes), STAGING_MAX_BYTES), max(sizes))
        st = self._staging_for(cap)
        out: list[tuple[Staging, list[tuple[int, int, int, list[CopyOp]]]]] = []
        groups: list[tuple[int, int, int, list[CopyOp]]] = []
        used = 0
        for op, n in zip(ops, sizes, strict=True):
            if groups and used + n > cap:
                out.append((st, groups))
                groups, used = [], 0
            tier = getattr(op, f"{pool_side}_tier")
            if not groups or groups[-1][:2] != (tier, op.lc):
                groups.append((tier, op.lc, used, []))
            groups[-1][3].append(op)
            used += n
        out.append((st, groups))
        return out

    def _chunks_or_fail(self, ops: list[CopyOp], side: str) -> tuple[list, list[CopyOp], BaseException | None]:
        """``(chunks, failed, cause)`` for a shared batch: its staging chunks, or none and
        every op failed when the staging buffer cannot be registered (the store is down)."""
        try:
            return self._chunks(ops, side), [], None
        except OSError as e:
            return [], list(ops), e

    def _store_batch(self, ops: list[CopyOp]) -> tuple[list[CopyOp], BaseException | None]:
        """Write the pages of ``store`` ops as objects, one batched put per chunk: each
        (tier, lc) group gathered into its staging region in one copy, headers written."""
        torch = _torch()
        t0 = time.perf_counter()
        H = HEADER.size
        chunks, failed, cause = self._chunks_or_fail(ops, "src")
        timed_out: OSError | None = None
        for st, groups in chunks:
            if timed_out is not None:  # the buffer is abandoned: fill nothing into it
                failed += [op for _, _, _, group in groups for op in group]
                continue
            flat = torch.frombuffer(st.view, dtype=torch.uint8)
            items: list[tuple[str, int, int]] = []
            ready: list[CopyOp] = []
            for tier, lc, base, group in groups:
                sp, sb = self.pools[self._tier_pos[tier]][lc], self.life_cycles[lc].slot_bytes
                try:
                    if isinstance(sp, DiskPool):
                        rows = sp.read_rows([op.src_slot for op in group])
                    else:
                        sel = torch.tensor([op.src_slot for op in group], dtype=torch.long, device=sp.device)
                        rows = sp.index_select(0, sel).cpu()
                except (OSError, RuntimeError, MemoryError) as e:
                    failed += group
                    cause = cause or e
                    continue
                n = len(group)
                flat[base:base + n * (H + sb)].view(n, H + sb)[:, H:].copy_(rows)
                for j, op in enumerate(group):
                    o = base + j * (H + sb)
                    st.view[o:o + H] = self.codec.header(op.key, lc, st.view[o + H:o + H + sb])
                    items.append((self.codec.name(op.key, lc), o, H + sb))
                    ready.append(op)
            del flat
            if not items:
                continue
            results, timed_out = self._results("put", items, st)
            self.shared_stats["put_batches"] += 1
            for op, err in zip(ready, results, strict=True):
                if err is None:
                    self._count(op)
                    self.shared_stats["stores"] += 1
                    self.shared_stats["store_bytes"] += self.life_cycles[op.lc].slot_bytes
                else:
                    failed.append(op)
                    cause = cause or err
        self.shared_stats["store_failures"] += len(failed)
        self.shared_seconds["store"] += time.perf_counter() - t0
        return failed, cause

    def _load_batch(self, ops: list[CopyOp]) -> tuple[list[CopyOp], BaseException | None]:
        """Read the objects of shared ``onboard`` ops into their slots, one batched get per
        chunk; every object is verified before its page is written, and each (tier, lc)
        group's verified pages are scattered into the pool with one ``index_copy_``."""
        torch = _torch()
        t0 = time.perf_counter()
        H = HEADER.size
        chunks, failed, cause = self._chunks_or_fail(ops, "dst")
        timed_out: OSError | None = None
        for st, groups in chunks:
            items = [(self.codec.name(op.key, lc), base + j * (H + self.life_cycles[lc].slot_bytes),
                      H + self.life_cycles[lc].slot_bytes)
                     for _, lc, base, group in groups for j, op in enumerate(group)]
            if timed_out is None:
                results, timed_out = self._results("get", items, st)
                self.shared_stats["get_batches"] += 1
            if timed_out is not None:
                # the store is slow: this chunk and the rest of the batch fail as if it were
                # down, and the abandoned buffer is not read (a late get may still write it)
                failed += [op for _, _, _, group in groups for op in group]
                cause = cause or timed_out
                continue
            flat = torch.frombuffer(st.view, dtype=torch.uint8)
            bad_names: list[str] = []
            k = 0
            for tier, lc, base, group in groups:
                sb = self.life_cycles[lc].slot_bytes
                good: list[int] = []
                for j, op in enumerate(group):
                    name, o, _ = items[k]
                    res = results[k]
                    k += 1
                    try:
                        if isinstance(res, BaseException):
                            raise res
                        self.codec.check(st.view[o:o + res], op.key, lc, sb)
                    except OSError as e:
                        failed.append(op)
                        cause = cause or e
                        if isinstance(e, BadObjectError):  # the object itself is bad, not the store
                            bad_names.append(name)
                            if e.what == "mac":  # intact, but not written with this plane's secret
                                self.shared_stats["auth_failures"] += 1
                        continue
                    good.append(j)
                if not good:
                    continue
                n = len(group)
                region = flat[base:base + n * (H + sb)].view(n, H + sb)
                data = region[:, H:] if len(good) == n else region[good, H:]
                dst = [group[j].dst_slot for j in good]
                dp = self.pools[self._tier_pos[tier]][lc]
                try:
                    if isinstance(dp, DiskPool):
                        dp.write_rows(dst, data)
                    else:
                        dp.index_copy_(0, torch.tensor(dst, dtype=torch.long, device=dp.device), data.to(dp.device))
                except (OSError, RuntimeError, MemoryError) as e:
                    failed += [group[j] for j in good]
                    cause = cause or e
                    continue
                self.kernel_calls += 1
                for j in good:
                    self._count(group[j])
                    self.shared_stats["loads"] += 1
                    self.shared_stats["load_bytes"] += sb
            del flat
            if bad_names:  # never found again: a later store may write it whole
                self._remove_bad(bad_names)
        self.shared_stats["load_failures"] += len(failed)
        self.shared_seconds["load"] += time.perf_counter() - t0
        return failed, cause

    def _results(self, what: str, items: list[tuple[str, int, int]],
                 staging: Staging) -> tuple[list[Any], TimeoutError | None]:
        """One put / get under the deadline: a result per item (``None`` / bytes read, or an
        ``OSError``), and the ``TimeoutError`` when the call ran past the deadline (its
        ``staging`` is abandoned then).  A call that raised, timed out or answered with
        another number of results fails every item."""
        try:
            results = self._call(what, getattr(self.shared, what), items, staging, staging=staging)
        except TimeoutError as e:
            return [e] * len(items), e
        except OSError as e:
            return [e] * len(items), None
        if not isinstance(results, list) or len(results) != len(items):  # a store that breaks its contract
            n = len(results) if isinstance(results, list) else results
            err = OSError(errno.EIO, f"the shared store's {what} answered {n!r} for {len(items)} objects")
            return [err] * len(items), None
        return results, None

    def _remove_bad(self, names: list[str]) -> None:
        """Remove objects the codec rejected (short, long, foreign, corrupted): otherwise
        every later lookup would find them and every load fail; a store that cannot remove
        them now keeps them (they still never load)."""
        try:
            self.shared.remove(names)
        except OSError:
            return
        self.shared_stats["removed_bad"] += len(names)

    def stats(self) -> dict:
        out = {"copies": dict(self.copies), "copy_bytes": dict(self.copy_bytes), "routes": dict(self.routes),
               "runs": self.runs, "kernel_calls": self.kernel_calls}
        if self.shared is not None:
            out["shared"] = dict(self.shared_stats)
            out["shared_store"] = self.shared.stats()
        return out

    def close(self) -> None:
        """Drop the pools, remove the disk tier's files, release the shared store and its
        staging buffer (idempotent; a store given as ``store=`` stays open).  Calls that ran
        past their deadline get one more deadline to return; a store with a call still in
        flight is left open (closing a client under a running call is not safe), and so is
        that call's buffer."""
        self.pools = []
        self._finalizer()
        if self._staging is not None:
            if self.shared is not None:
                self.shared.unregister(self._staging)
            self._staging.close()
            self._staging = None
        if self._late:
            wait_until = time.monotonic() + self.shared_timeout_s
            for done, _ in self._late:
                done.wait(max(0.0, wait_until - time.monotonic()))
            self._reap()
        if self.shared is not None and self._own_store and not self._late:
            self.shared.close()
        self.shared = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["COPY_REASONS", "DataPlane", "DiskPool", "open_store", "remove_stale_pool_files"]
