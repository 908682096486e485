"""The data plane's slot memory, the bytes behind the manager's slots: its pools, one
``uint8[num_slots, slot_bytes]`` tensor (or a :class:`~kvcm.dataplane.disk_pool.DiskPool`)
per ``(tier, life cycle)``, where each layer
sits inside a slot, the typed per-layer views, and their resizing (the manager's quota at
run time).  See :mod:`kvcm.dataplane`, "Pools" and "Byte layout of one slot".

:class:`SlotMemory` is the part of :class:`~kvcm.dataplane.DataPlane` that the copy runs
(:mod:`kvcm.dataplane.copy_runs`) and the shared-tier I/O (:mod:`kvcm.dataplane.shared_io`)
read and write through; it knows neither of them.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from kvcm.api import AttentionLayer, KVCacheManagerConfig
from kvcm.config import ResolvedConfig
from kvcm.dataplane.disk_pool import (
    TRAILER,
    DiskPool,
    close_pool_files,
    create_pool_file,
    remove_stale_pool_files,
    torch_module,
)

# Rows at least this long are copied one by one (``copy_``: memcpy speed); shorter ones with
# one gather and one scatter.  torch's CPU ``index_select`` / ``index_copy_`` move long byte
# rows 10-20x slower than ``copy_`` does (DECISIONS.md "Loads at memory speed").
ROW_COPY_BYTES = 4096


def copy_rows(dst: Any, dst_rows: Sequence[int], src: Any, src_rows: Sequence[int]) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for every ``i``: rows of 2-D tensors of one
    dtype (a pool's ``uint8[slots, bytes]``, or a column slice of one), any devices."""
    n = len(dst_rows)
    if n == 0:
        return
    if n != len(src_rows):
        raise ValueError(f"copy_rows: {n} destination rows for {len(src_rows)} source rows")
    if dst.device.type == src.device.type == "cpu" and dst.shape[1] * dst.element_size() >= ROW_COPY_BYTES:
        for d, s in zip(_ints(dst_rows), _ints(src_rows), strict=True):
            dst[d].copy_(src[s])
        return
    torch = torch_module()
    sidx = torch.as_tensor(_ints(src_rows), dtype=torch.int64, device=src.device)
    didx = torch.as_tensor(_ints(dst_rows), dtype=torch.int64, device=dst.device)
    dst.index_copy_(0, didx, src.index_select(0, sidx).to(dst.device))


def _ints(rows: Any) -> list[int]:
    return rows.tolist() if hasattr(rows, "tolist") else list(rows)


class SlotMemory:
    """The bytes behind the slots of one data plane (named by role: the manager's pools are
    its slots and counters, these their memory): one tensor pool per ``(tier, lc)`` of the
    resolved config ``rc``, ``device`` the gpu tier's, ``dtype`` and ``shapes`` those of the typed views
    (:class:`~kvcm.dataplane.DataPlane`).  A disk tier's files are removed by :meth:`close`
    (or when the object is collected); a failed construction leaves none behind.

    A tier given as an int is SPEC's number by kind (gpu 0, host 1, disk 2), as copy ops
    carry it; :attr:`grid` and :attr:`num_slots` are indexed by config position."""

    def __init__(self, config: KVCacheManagerConfig, rc: ResolvedConfig, *, device: Any = "cpu", dtype: Any = None,
                 shapes: Mapping[int, Sequence[int]] | None = None) -> None:
        torch = torch_module()
        self.B = config.tokens_per_block
        self.life_cycles = rc.life_cycles
        self.tier_kinds = rc.tier_kinds
        self._tier_pos = {tid: pos for pos, tid in enumerate(rc.tier_ids)}
        self.num_slots = [list(row) for row in rc.slots]  # [config position][lc]; resize changes it
        self.device = torch.device(device)
        self.dtype = torch.float32 if dtype is None else dtype
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self._place_layers(config, dict(shapes or {}), itemsize)
        self._files: list[tuple[str, int]] = []  # (path, locked fd) of each disk pool file
        self._finalizer = weakref.finalize(self, close_pool_files, self._files)
        self.grid: list[list[Any]] = []  # [config position][lc] uint8[num_slots, slot_bytes] or a DiskPool
        try:
            self._make_pools(torch, config, rc.tier_ids)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drop the pools and remove the disk tier's files (idempotent)."""
        self.grid = []
        self._finalizer()

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
        """One pool per (tier, life cycle), appended to ``self.grid`` (disk files to
        ``self._files``, which :meth:`close` removes on failure)."""
        pin = torch.cuda.is_available()
        for t, tier in enumerate(config.tiers):
            row = []
            if tier.kind == "shared":  # no slots, no pool (listed last): objects in a store (shared_io)
                continue
            if tier.kind == "disk":
                os.makedirs(tier.path, exist_ok=True)
                remove_stale_pool_files(tier.path)  # files of crashed runs (package docstring, "Disk files")
            for lc in self.life_cycles:
                n, sb = self.num_slots[t][lc.id], lc.slot_bytes
                if tier.kind == "gpu":
                    pool = torch.zeros((n, sb), dtype=torch.uint8, device=self.device)
                elif tier.kind == "host":
                    pool = torch.zeros((n, sb), dtype=torch.uint8, pin_memory=pin)
                else:  # disk: a reserved, locked file read and written with pread/pwrite
                    path, fd = create_pool_file(tier.path, lc.id, n * (sb + TRAILER.size), tier_ids[t])
                    self._files.append((path, fd))
                    pool = DiskPool(fd, path, n, sb)
                row.append(pool)
            self.grid.append(row)

    # ------------------------------------------------------------------ views

    def pool(self, tier: int | str, lc: int):
        """The raw ``uint8[num_slots, slot_bytes]`` pool of ``(tier, lc)``."""
        return self.grid[self._tier(tier)][lc]

    def kv(self, layer_id: int, tier: int | str = "gpu"):
        """Typed view ``[num_slots, B, *token_shape]`` of attention layer ``layer_id``."""
        return self._view(layer_id, tier, "attn")

    def state(self, layer_id: int, tier: int | str = "gpu"):
        """Typed view ``[num_slots, *state_shape]`` of ssm layer ``layer_id``."""
        return self._view(layer_id, tier, "ssm")

    def lc_of(self, layer_id: int) -> int:
        """The life cycle (index) that layer ``layer_id`` belongs to."""
        return self._layer_lc[layer_id]

    def _view(self, layer_id: int, tier: int | str, kind: str):
        if layer_id not in self._layer_lc:
            raise ValueError(f"unknown layer {layer_id}")
        lc = self._layer_lc[layer_id]
        if self.life_cycles[lc].kind != kind:
            raise ValueError(f"layer {layer_id} is not an {kind} layer")
        off, nbytes, shape = self._layer_region[layer_id]
        raw = self.grid[self._tier(tier)][lc]
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
            raise ValueError(f"unknown tier {tier!r}; tiers are {self.tier_names()}")
        return self._tier_pos[tier]

    # ------------------------------------------------------------------ tiers by SPEC's number

    def has_tier(self, tier: int) -> bool:
        """Whether the int ``tier`` is a pool tier of this config (SPEC's number)."""
        return tier in self._tier_pos

    def tier_names(self) -> str:
        """The pool tiers as an error message lists them: ``"0 (gpu), 1 (host)"``."""
        return ", ".join(f"{t} ({self.tier_kinds[p]})" for t, p in self._tier_pos.items())

    def kind_of(self, tier: int) -> str:
        """The kind (``"gpu"``, ``"host"``, ``"disk"``) of pool tier ``tier``."""
        return self.tier_kinds[self._tier(tier)]

    def slots(self, tier: int | str, lc: int) -> int:
        """The number of slots of ``(tier, lc)`` now."""
        return self.num_slots[self._tier(tier)][lc]

    def adopt(self, tier: int | str, lc: int, memory: Any) -> None:
        """``DataPlane.adopt_memory``: ``memory`` (a ``uint8[num_slots, slot_bytes]`` tensor
        of the engine's) becomes the pool of ``(tier, lc)`` of a gpu or host tier.  Bad input
        raises and changes nothing."""
        torch = torch_module()
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
        self.grid[pos][lc] = memory

    # ------------------------------------------------------------------ sizes at run time

    def resize(self, pos: int, lc: int, n: int) -> None:
        """Pool (config position ``pos``, ``lc``) to ``n`` slots, keeping slots
        ``[0, min(old, n))`` byte for byte; new slots of a memory tier are zero (a disk
        pool's new records are reserved: OSError when they cannot be)."""
        pool = self.grid[pos][lc]
        if isinstance(pool, DiskPool):
            pool.resize(n)
        else:
            torch = torch_module()
            keep = min(n, pool.shape[0])
            kind = self.tier_kinds[pos]
            pin = kind == "host" and torch.cuda.is_available()
            new = torch.zeros((n, pool.shape[1]), dtype=torch.uint8, device=pool.device, pin_memory=pin)
            new[:keep].copy_(pool[:keep])
            self.grid[pos][lc] = new
        self.num_slots[pos][lc] = n
