"""The :class:`DataPlane`: the memory behind one manager's slot indices and the executor
of its copy ops (SPEC sec. 14), made of three parts, one job each: its pools
(:mod:`kvcm.dataplane.pools`), its copy runs (:mod:`kvcm.dataplane.copy_runs`) and its
shared-tier I/O (:mod:`kvcm.dataplane.shared_io`).  This module builds and closes it; the
contract is the package docstring (:mod:`kvcm.dataplane`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

from kvcm.api import CopyOp, KVCacheManagerConfig
from kvcm.config import resolve_config
from kvcm.dataplane.copy_runs import COPY_REASONS, CopyRuns
from kvcm.dataplane.disk_pool import _close_files, _torch
from kvcm.dataplane.pools import Pools
from kvcm.dataplane.shared_io import SharedIO
from kvcm.dataplane.store import ObjectCodec, SharedStore, Staging


class DataPlane(Pools, CopyRuns, SharedIO):
    """Pool tensors per ``(tier, lc)`` for one manager config, and a copy-op executor.

    ``device``: where the ``gpu`` tier lives (default ``"cpu"``).  ``dtype``: the element
    type of the typed views.  ``shapes``: ``{layer_id: shape}`` — per-token shape of an
    attention layer, state shape of an ssm layer (its bytes must match the config).
    ``store``: the shared tier's store (default: the one the tier's path names).
    ``shared_timeout_s``: the deadline for one store call (default: the store's
    ``timeout_s``, :data:`kvcm.dataplane.store.DEFAULT_TIMEOUT_S` unless its location says;
    0: none).  ``shared_secret``: the store secret that authenticates objects (bytes or
    str, at least 16 bytes); default: ``config.shared_secret_file``'s, else
    ``$KVCM_STORE_SECRET_FILE``'s or ``$KVCM_STORE_SECRET`` (:func:`kvcm.dataplane.store.store_secret`);
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


    def adopt_memory(self, tier: int | str, lc: int, memory: Any) -> None:
        """Make ``memory`` — a ``uint8[num_slots, slot_bytes]`` tensor the engine owns, e.g. a
        view of its own paged cache — the pool of ``(tier, lc)`` of a ``gpu`` or ``host`` tier:
        slot ``s`` of that pool is then ``memory[s]``, and kvcm's copy ops read and write the
        engine's bytes in place (the pool kvcm made is dropped; nothing is copied).  The engine
        keeps ``memory`` alive, and adopts its new memory again if it reallocates it; a
        ``set_quota`` of that tier gives the pool kvcm's own memory again.  Bad input raises
        ``ValueError`` / ``TypeError`` and changes nothing."""
        torch = _torch()
        pos = self._tier(tier)
        kind = self.tier_kinds[pos]
        if kind not in ("gpu", "host"):
            raise ValueError(f"adopt_memory: the {kind} tier has no tensor pools (gpu and host tiers only)")
        if isinstance(lc, bool) or not isinstance(lc, int) or not 0 <= lc < len(self.life_cycles):
            raise ValueError(f"adopt_memory: unknown life cycle {lc!r}")
        if not isinstance(memory, torch.Tensor):
            raise TypeError(f"adopt_memory: memory must be a torch tensor, got {type(memory).__name__}")
        want = (self.num_slots[pos][lc], self.life_cycles[lc].slot_bytes)
        if memory.dtype != torch.uint8 or tuple(memory.shape) != want:
            raise ValueError(f"adopt_memory: ({kind}, lc {lc}) needs a uint8 tensor of shape {want}, got "
                             f"{memory.dtype} {tuple(memory.shape)}")
        if memory.stride(1) != 1:
            raise ValueError("adopt_memory: each slot must be contiguous (stride 1 along a slot's bytes)")
        self.pools[pos][lc] = memory

    def stats(self) -> dict:
        """Copy ops and bytes by reason, ops by route, runs and kernel calls; with a shared tier also
        the shared-tier counters (``shared``) and the store's own (``shared_store``)."""
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
