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
* ``disk`` — a file-backed tensor (``torch.from_file(..., shared=True)``, an mmap) in a
  fresh file ``kvcm-pool-*-lc<lc>.bin`` under the tier's ``path``, removed by
  :meth:`DataPlane.close`.

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

Copy ops
--------
:meth:`DataPlane.apply` executes ``CopyOp`` s (whole slots, raw bytes) with sequential
semantics — the result always equals running them one by one in order — but batched: the
ops are cut into maximal *runs* in which no slot written by one op is read or written by
another, and each run is executed as one gather (``index_select``) plus one scatter
(``index_copy_``) per ``(src tier, dst tier, lc)``.  Every op is validated first (known
tier and lc, slot in range, known reason): a bad op raises ``ValueError`` and nothing is
copied.  A tier given as an int (in ops, :meth:`DataPlane.pool`, the views) is SPEC's
number by kind, as the manager's copy ops carry it: gpu 0, host 1, disk 2 (a gpu + disk
config has tiers 0 and 2); ``self.pools`` itself is indexed by config position.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Self

from kvcm.api import AttentionLayer, CopyOp, KVCacheManagerConfig, resolve_config

COPY_REASONS = ("offload", "onboard", "cow", "snapshot")


def _torch():
    import torch  # lazily: kvcm itself never needs torch

    return torch


def _remove_files(paths: list[str]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            os.remove(p)


class DataPlane:
    """Pool tensors per ``(tier, lc)`` for one manager config, and a copy-op executor.

    ``device``: where the ``gpu`` tier lives (default ``"cpu"``).  ``dtype``: the element
    type of the typed views.  ``shapes``: ``{layer_id: shape}`` — per-token shape of an
    attention layer, state shape of an ssm layer (its bytes must match the config).
    """

    def __init__(
        self,
        config: KVCacheManagerConfig,
        *,
        device: Any = "cpu",
        dtype: Any = None,
        shapes: Mapping[int, Sequence[int]] | None = None,
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
        self.num_slots = rc.slots  # [tier][lc]
        self.device = torch.device(device)
        self.dtype = torch.float32 if dtype is None else dtype
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        shapes = dict(shapes or {})

        # where each layer sits inside its lc's slot
        self._layer_lc: dict[int, int] = {}
        self._layer_region: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # id -> (offset, nbytes, view shape)
        layers = {layer.layer_id: layer for layer in config.layers}
        for lc in self.life_cycles:
            off = 0
            for lid in lc.layer_ids:
                layer = layers[lid]
                unit = layer.bytes_per_token if isinstance(layer, AttentionLayer) else layer.state_bytes
                shape = tuple(shapes.pop(lid, (unit // itemsize,)))
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

        pin = torch.cuda.is_available()
        self._files: list[str] = []
        self.pools: list[list[Any]] = []  # [config position][lc] uint8[num_slots, slot_bytes]
        for t, tier in enumerate(config.tiers):
            row = []
            for lc in self.life_cycles:
                n, sb = self.num_slots[t][lc.id], lc.slot_bytes
                if tier.kind == "gpu":
                    pool = torch.zeros((n, sb), dtype=torch.uint8, device=self.device)
                elif tier.kind == "host":
                    pool = torch.zeros((n, sb), dtype=torch.uint8, pin_memory=pin)
                else:  # disk: an mmap'd file, created sparse and sized by from_file
                    os.makedirs(tier.path, exist_ok=True)
                    fd, path = tempfile.mkstemp(prefix="kvcm-pool-", suffix=f"-lc{lc.id}.bin", dir=tier.path)
                    os.close(fd)
                    self._files.append(path)
                    pool = torch.from_file(path, shared=True, size=n * sb, dtype=torch.uint8).view(n, sb)
                row.append(pool)
            self.pools.append(row)
        self._finalizer = weakref.finalize(self, _remove_files, list(self._files))
        self.copies = dict.fromkeys(COPY_REASONS, 0)  # ops executed, by reason
        self.copy_bytes = dict.fromkeys(COPY_REASONS, 0)
        self.routes: dict[str, int] = {}  # ops executed by route, e.g. "gpu->host"
        self.runs = 0  # batched runs executed
        self.kernel_calls = 0  # gather+scatter pairs issued (one per (src tier, dst tier, lc) per run)

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

    # ------------------------------------------------------------------ copy ops

    def check(self, op: Any) -> CopyOp:
        """Validate one op (a CopyOp, or its ``to_json()`` list); ValueError when bad."""
        if not isinstance(op, CopyOp):
            try:
                op = CopyOp(*op)
            except TypeError:
                raise ValueError(f"not a copy op: {op!r}") from None
        for name in ("lc", "src_tier", "src_slot", "dst_tier", "dst_slot"):
            v = getattr(op, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{op}: {name} must be an int")  # noqa: TRY004 - every bad op is a ValueError
        if not 0 <= op.lc < len(self.life_cycles):
            raise ValueError(f"{op}: unknown life cycle {op.lc}")
        for side in ("src", "dst"):
            t, s = getattr(op, f"{side}_tier"), getattr(op, f"{side}_slot")
            if t not in self._tier_pos:
                raise ValueError(f"{op}: unknown {side} tier {t}; tiers are {self._tier_names()}")
            n = self.num_slots[self._tier_pos[t]][op.lc]
            if not 0 <= s < n:
                raise ValueError(f"{op}: {side} slot {s} out of range [0, {n})")
        if op.reason not in COPY_REASONS:
            raise ValueError(f"{op}: unknown reason {op.reason!r}")
        return op

    def apply(self, ops: Iterable[Any]) -> int:
        """Execute ``ops`` in order (sequential semantics, batched); returns how many.
        Every op is validated before anything is copied."""
        checked = [self.check(op) for op in ops]
        for run in self.runs_of(checked):
            self._execute(run)
        return len(checked)

    @staticmethod
    def runs_of(ops: Sequence[CopyOp]) -> list[list[CopyOp]]:
        """Cut ``ops`` into maximal runs of independent ops: within a run no slot written
        by one op is read or written by another, so the run may execute in any order."""
        runs: list[list[CopyOp]] = []
        run: list[CopyOp] = []
        reads: set[tuple[int, int, int]] = set()
        writes: set[tuple[int, int, int]] = set()
        for op in ops:
            src = (op.src_tier, op.lc, op.src_slot)
            dst = (op.dst_tier, op.lc, op.dst_slot)
            if src in writes or dst in writes or dst in reads:
                runs.append(run)
                run, reads, writes = [], set(), set()
            run.append(op)
            reads.add(src)
            writes.add(dst)
        if run:
            runs.append(run)
        return runs

    def _execute(self, run: list[CopyOp]) -> None:
        torch = _torch()
        groups: dict[tuple[int, int, int], tuple[list[int], list[int]]] = {}
        for op in run:
            src, dst = groups.setdefault((op.src_tier, op.dst_tier, op.lc), ([], []))
            src.append(op.src_slot)
            dst.append(op.dst_slot)
            self.copies[op.reason] += 1
            self.copy_bytes[op.reason] += self.life_cycles[op.lc].slot_bytes
            route = f"{self.tier_kinds[self._tier_pos[op.src_tier]]}->{self.tier_kinds[self._tier_pos[op.dst_tier]]}"
            self.routes[route] = self.routes.get(route, 0) + 1
        # a run's reads and writes are disjoint, so its groups may go in any order
        for (st, dt, lc), (src, dst) in groups.items():
            sp, dp = self.pools[self._tier_pos[st]][lc], self.pools[self._tier_pos[dt]][lc]
            rows = sp.index_select(0, torch.tensor(src, dtype=torch.long, device=sp.device))
            dp.index_copy_(0, torch.tensor(dst, dtype=torch.long, device=dp.device), rows.to(dp.device))
            self.kernel_calls += 1
        self.runs += 1

    def stats(self) -> dict:
        return {"copies": dict(self.copies), "copy_bytes": dict(self.copy_bytes), "routes": dict(self.routes),
                "runs": self.runs,
                "kernel_calls": self.kernel_calls}

    def close(self) -> None:
        """Drop the pools and remove the disk tier's files."""
        self.pools = []
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["COPY_REASONS", "DataPlane"]
