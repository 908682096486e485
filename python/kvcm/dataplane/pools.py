"""The data plane's pools: one ``uint8[num_slots, slot_bytes]`` tensor (or a
:class:`~kvcm.dataplane.disk_pool.DiskPool`) per ``(tier, life cycle)``, where each layer
sits inside a slot, the typed per-layer views, and the pools following the manager's
quota at run time.  See :mod:`kvcm.dataplane`, "Pools" and "Byte layout of one slot".

:class:`Pools` is one of the three parts :class:`~kvcm.dataplane.DataPlane` is made of
(with :class:`~kvcm.dataplane.copy_runs.CopyRuns` and
:class:`~kvcm.dataplane.shared_io.SharedIO`); the state it uses is set by
``DataPlane.__init__`` and declared below.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvcm.api import AttentionLayer, KVCacheManagerConfig
from kvcm.config import resolve_quota
from kvcm.dataplane.disk_pool import TRAILER, DiskPool, _create_disk_file, _torch, remove_stale_pool_files


class Pools:
    """The pools of a :class:`~kvcm.dataplane.DataPlane`: their making, views and sizes."""

    # set by DataPlane.__init__
    B: int
    life_cycles: Sequence[Any]
    tier_kinds: Sequence[str]
    num_slots: list[list[int]]
    device: Any
    dtype: Any
    pools: list[list[Any]]
    _files: list[tuple[str, int]]
    _tier_pos: dict[int, int]
    _rc: Any
    apply: Callable[[Iterable[Any]], int]  # CopyRuns.apply

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
                remove_stale_pool_files(tier.path)  # files of crashed runs (package docstring, "Disk files")
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
        """The life cycle (index) that layer ``layer_id`` belongs to."""
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
