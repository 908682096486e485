"""The :class:`DataPlane`: the memory behind one manager's slot indices and the executor
of its copy ops (SPEC sec. 14), a facade over three parts, one job each, that it builds
and wires: the pools (:class:`~kvcm.dataplane.slot_memory.SlotMemory`), the shared-tier I/O
(:class:`~kvcm.dataplane.shared_io.SharedIO`, given the pools) and the copy runs
(:class:`~kvcm.dataplane.copy_runs.CopyRuns`, given both), with the counters they share
(:class:`~kvcm.dataplane.copy_stats.CopyStats`).  The parts call one another's public
methods only, through the collaborators they were given; this module alone knows all of
them.  The contract is the package docstring (:mod:`kvcm.dataplane`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self

from kvcm.api import CopyOp, CopyRun, KVCacheManagerConfig
from kvcm.config import resolve_config, resolve_quota
from kvcm.dataplane.copy_runs import CopyRuns
from kvcm.dataplane.copy_stats import CopyStats
from kvcm.dataplane.disk_pool import torch_module
from kvcm.dataplane.shared_io import SharedIO
from kvcm.dataplane.slot_memory import SlotMemory
from kvcm.dataplane.store import ObjectCodec, SharedStore


class DataPlane:
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

    The parts: :attr:`slot_memory`, :attr:`shared_io`, :attr:`copy_runs`, :attr:`copy_stats`.
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
        torch_module()  # without torch nothing else is looked at
        rc = resolve_config(config)
        self.config = config
        self._rc = rc
        self.slot_memory = SlotMemory(config, rc, device=device, dtype=dtype, shapes=shapes)
        self.copy_stats = CopyStats([lc.slot_bytes for lc in rc.life_cycles], self.slot_memory.kind_of)
        try:
            self.shared_io = SharedIO(config, rc, self.slot_memory, self.copy_stats, store=store,
                                      timeout_s=shared_timeout_s, secret=shared_secret)
        except BaseException:
            self.slot_memory.close()  # no disk file left behind
            raise
        self.copy_runs = CopyRuns(self.slot_memory, self.shared_io, self.copy_stats)

    # ------------------------------------------------------------------ the pools

    @property
    def B(self) -> int:
        """Tokens per block."""
        return self.slot_memory.B

    @property
    def life_cycles(self) -> Sequence[Any]:
        return self.slot_memory.life_cycles

    @property
    def tier_kinds(self) -> Sequence[str]:
        return self.slot_memory.tier_kinds

    @property
    def num_slots(self) -> list[list[int]]:
        """``[config position][lc]``: slots per pool now (:meth:`set_quota` changes them)."""
        return self.slot_memory.num_slots

    @property
    def device(self) -> Any:
        return self.slot_memory.device

    @property
    def dtype(self) -> Any:
        return self.slot_memory.dtype

    @property
    def pools(self) -> list[list[Any]]:
        """``[config position][lc]``: ``uint8[num_slots, slot_bytes]`` tensors, or a
        :class:`~kvcm.dataplane.disk_pool.DiskPool` for a disk tier (empty once closed)."""
        return self.slot_memory.grid

    def pool(self, tier: int | str, lc: int):
        """The raw ``uint8[num_slots, slot_bytes]`` pool of ``(tier, lc)``."""
        return self.slot_memory.pool(tier, lc)

    def kv(self, layer_id: int, tier: int | str = "gpu"):
        """Typed view ``[num_slots, B, *token_shape]`` of attention layer ``layer_id``."""
        return self.slot_memory.kv(layer_id, tier)

    def state(self, layer_id: int, tier: int | str = "gpu"):
        """Typed view ``[num_slots, *state_shape]`` of ssm layer ``layer_id``."""
        return self.slot_memory.state(layer_id, tier)

    def lc_of(self, layer_id: int) -> int:
        """The life cycle (index) that layer ``layer_id`` belongs to."""
        return self.slot_memory.lc_of(layer_id)

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
        pools = self.slot_memory
        pos, _q, per_lc = resolve_quota(self._rc, tier, quota_bytes)
        old = list(pools.num_slots[pos])
        grown: list[int] = []
        try:
            for lc, n in enumerate(per_lc):
                if n > old[lc]:
                    pools.resize(pos, lc, n)
                    grown.append(lc)
            manager.set_quota(tier, quota_bytes)
        except BaseException:
            for lc in grown:  # the new slots were never used: nothing to keep
                pools.resize(pos, lc, old[lc])
            raise
        try:
            return self.apply(manager.drain_copy_ops())
        finally:
            for lc, n in enumerate(per_lc):
                if n < old[lc]:
                    pools.resize(pos, lc, n)

    # ------------------------------------------------------------------ copy ops and runs

    def check(self, op: Any) -> CopyOp:
        """Validate one op (a CopyOp, or its ``to_json()`` list); ValueError when bad."""
        return self.copy_runs.check(op)

    def check_run(self, run: Any, where: str = "run") -> CopyRun:
        """Validate one :class:`~kvcm.api.CopyRun` (:meth:`CopyRuns.check_run
        <kvcm.dataplane.copy_runs.CopyRuns.check_run>`); ValueError when bad."""
        return self.copy_runs.check_run(run, where)

    def apply(self, ops: Iterable[Any]) -> int:
        """Execute ``ops`` in order (sequential semantics, batched); returns how many.
        Every op is validated before anything is copied (ValueError); then the ops run as
        ``kvcm.api.copy_runs(ops)`` (:meth:`apply_runs`).  A failed op raises
        :class:`kvcm.api.CopyError` after its run, naming every op not completed (package
        docstring)."""
        return self.copy_runs.apply(ops)

    def apply_runs(self, runs: Iterable[CopyRun]) -> int:
        """Execute ``runs`` (``KVCacheManager.drain_copy_runs()``) in order; returns how many
        ops.  Every run is validated before anything is copied (:meth:`check_run`,
        ValueError).  Failures as :meth:`apply` (``CopyError.ops`` are ``CopyOp`` s)."""
        return self.copy_runs.apply_runs(runs)

    @property
    def fault(self) -> Callable[[CopyOp], None] | None:
        """A test hook (fault injection): called with each op just before it is executed;
        an exception it raises makes that op fail as an I/O error would."""
        return self.copy_runs.fault

    @fault.setter
    def fault(self, hook: Callable[[CopyOp], None] | None) -> None:
        self.copy_runs.fault = hook

    @property
    def copies(self) -> dict[str, int]:
        """Ops executed, by reason."""
        return self.copy_stats.copies

    @property
    def copy_bytes(self) -> dict[str, int]:
        """Bytes copied, by reason."""
        return self.copy_stats.copy_bytes

    @property
    def routes(self) -> dict[str, int]:
        """Ops executed by route, e.g. ``"gpu->host"``."""
        return self.copy_stats.routes

    @property
    def runs(self) -> int:
        """Batched runs executed."""
        return self.copy_stats.runs

    @property
    def kernel_calls(self) -> int:
        """Gather+scatter pairs issued (one per (src tier, dst tier, lc) per run)."""
        return self.copy_stats.kernel_calls

    # ------------------------------------------------------------------ the shared tier

    def shared_lookup(self, candidates: Iterable[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """The ``(key, lc)`` pairs of ``candidates`` (``mgr.shared_candidates``) whose objects
        the store holds: one batched existence query.  A store that cannot answer counts as
        empty (``shared_stats["lookup_errors"]``)."""
        return self.shared_io.lookup(candidates)

    @property
    def shared(self) -> SharedStore | None:
        """The shared tier's store (None: no shared tier, or closed)."""
        return self.shared_io.store

    @property
    def codec(self) -> ObjectCodec | None:
        """How objects are named, framed and authenticated (None: no shared tier)."""
        return self.shared_io.codec

    @property
    def shared_secret_source(self) -> str:
        """Where the store secret came from (``""``: none); never the secret."""
        return self.shared_io.secret_source

    @property
    def shared_timeout_s(self) -> float:
        """The deadline of one store call (0: none)."""
        return self.shared_io.timeout_s

    @shared_timeout_s.setter
    def shared_timeout_s(self, seconds: float) -> None:
        self.shared_io.timeout_s = seconds

    @property
    def shared_stats(self) -> dict[str, int]:
        """The shared tier's counters: lookups, objects and bytes stored / loaded, failures,
        batches, timeouts."""
        return self.shared_io.stats

    @property
    def shared_seconds(self) -> dict[str, float]:
        """Seconds spent in lookups, store and load batches (reporting only)."""
        return self.shared_io.seconds

    # ------------------------------------------------------------------ the whole

    def adopt_memory(self, tier: int | str, lc: int, memory: Any) -> None:
        """Make ``memory`` — a ``uint8[num_slots, slot_bytes]`` tensor the engine owns, e.g. a
        view of its own paged cache — the pool of ``(tier, lc)`` of a ``gpu`` or ``host`` tier:
        slot ``s`` of that pool is then ``memory[s]``, and kvcm's copy ops read and write the
        engine's bytes in place (the pool kvcm made is dropped; nothing is copied).  The engine
        keeps ``memory`` alive, and adopts its new memory again if it reallocates it; a
        ``set_quota`` of that tier gives the pool kvcm's own memory again.  Bad input raises
        ``ValueError`` / ``TypeError`` and changes nothing."""
        self.slot_memory.adopt(tier, lc, memory)

    def stats(self) -> dict:
        """Copy ops and bytes by reason, ops by route, runs and kernel calls; with a shared tier also
        the shared-tier counters (``shared``) and the store's own (``shared_store``)."""
        out = self.copy_stats.as_dict()
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
        self.slot_memory.close()
        self.shared_io.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
