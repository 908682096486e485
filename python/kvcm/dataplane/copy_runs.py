"""The data plane's copy runs: validating and executing the manager's copy ops and copy
runs (``apply`` / ``apply_runs``): a run of memory tiers is one gather and one scatter, a
disk side goes op by op, a shared side is handed to the shared-tier I/O
(:class:`~kvcm.dataplane.shared_io.SharedIO`) as one batch; a failure stops everything
after its run and raises ``CopyError``.  See :mod:`kvcm.dataplane`, "Copy ops and copy
runs".

:class:`CopyRuns` is the part of :class:`~kvcm.dataplane.DataPlane` that executes; its
collaborators are given to it: the pools it copies between, the shared-tier I/O it hands
shared batches to, the counters it counts completed ops in.
"""

from __future__ import annotations

import array
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvcm.api import SHARED, CopyError, CopyOp, CopyRun, copy_runs
from kvcm.dataplane.copy_stats import COPY_REASONS, CopyStats
from kvcm.dataplane.disk_pool import DiskPool, torch_module
from kvcm.dataplane.shared_io import SharedIO
from kvcm.dataplane.slot_memory import SlotMemory, copy_rows


class CopyRuns:
    """The copy-op executor over ``memory`` (the pools), handing shared-tier batches to ``shared`` and
    counting completed ops in ``stats``.

    ``fault`` is a test hook (fault injection): called with each op just before it is
    executed; an exception it raises makes that op fail as an I/O error would."""

    def __init__(self, memory: SlotMemory, shared: SharedIO, stats: CopyStats) -> None:
        self._memory = memory
        self._shared = shared
        self._stats = stats
        self.fault: Callable[[CopyOp], None] | None = None

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
        if not 0 <= op.lc < len(self._memory.life_cycles):
            raise ValueError(f"{op}: unknown life cycle {op.lc}")
        shared_sides = [side for side in ("src", "dst") if getattr(op, f"{side}_tier") == SHARED]
        if shared_sides:
            self._check_shared(op, shared_sides)
        elif op.key is not None:
            raise ValueError(f"{op}: only an op of the shared tier names a key")
        for side in ("src", "dst"):
            t, s = getattr(op, f"{side}_tier"), getattr(op, f"{side}_slot")
            if t == SHARED and self._shared.store is not None:
                continue
            if not self._memory.has_tier(t):
                raise ValueError(f"{op}: unknown {side} tier {t}; tiers are {self._memory.tier_names()}")
            n = self._memory.slots(t, op.lc)
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
        if self._shared.store is None:
            raise ValueError(f"{what}: unknown {sides[0]} tier {SHARED} (the config has no shared tier); "
                             f"tiers are {self._memory.tier_names()}")
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
        if not 0 <= run.lc < len(self._memory.life_cycles):
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
            if not self._memory.has_tier(t):
                raise ValueError(f"{what}: unknown {side} tier {t}; tiers are {self._memory.tier_names()}")
            lim = self._memory.slots(t, run.lc)
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
        they are; else as ``run.ops()``): see the package docstring (:mod:`kvcm.dataplane`) for failures."""
        total = sum(len(r) for r in runs)
        failed_stores: list[CopyOp] = []  # a failed store stops nothing (package docstring)
        store_cause: BaseException | None = None
        base = 0  # op index of the batch's first op
        i = 0
        while i < len(runs):
            j = self._batch_end(runs, i)
            batch = runs[i:j]
            n = sum(len(r) for r in batch)
            t0 = time.perf_counter()
            failed, cause = self._execute(batch)
            self._stats.timed(batch[0], time.perf_counter() - t0)
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
        self._stats.runs += len(batch)
        run = batch[0]
        if SHARED in (run.src_tier, run.dst_tier):
            skip = set(failed)
            todo = [(p, op) for p, op in enumerate(op for r in batch for op in r.ops()) if p not in skip]
            if todo:
                pos = {id(op): p for p, op in todo}
                method = self._shared.store_batch if run.dst_tier == SHARED else self._shared.load_batch
                bad, why = method([op for _, op in todo])
                failed += [pos[id(op)] for op in bad]
                cause = cause or why
            return sorted(failed), cause
        if len(run) == 0 or len(failed) == len(run):
            return failed, cause
        torch = torch_module()
        sp, dp = self._memory.pool(run.src_tier, run.lc), self._memory.pool(run.dst_tier, run.lc)
        skip = set(failed)
        keep = [p for p in range(len(run)) if p not in skip] if failed else None
        if isinstance(sp, DiskPool) or isinstance(dp, DiskPool):  # file I/O: op by op
            done = 0
            for p in keep if keep is not None else range(len(run)):
                try:  # one copy between the page cache and the pool row, when the row is in host memory
                    if isinstance(sp, DiskPool) and isinstance(dp, DiskPool):  # a relocation inside the disk tier
                        dp.write(run.dst_slots[p], sp.read_rows([run.src_slots[p]])[0].numpy())
                    elif isinstance(sp, DiskPool) and dp.device.type == "cpu":
                        sp.read_into(run.src_slots[p], dp[run.dst_slots[p]].numpy())
                    elif isinstance(sp, DiskPool):
                        dp[run.dst_slots[p]] = sp.read_rows([run.src_slots[p]])[0].to(dp.device)
                    else:
                        dp.write(run.dst_slots[p], sp[run.src_slots[p]].cpu().numpy())
                except OSError as e:
                    failed.append(p)
                    cause = cause or e
                    continue
                done += 1
            self._stats.count(run, done)
            self._stats.kernel_calls += 1
            return sorted(failed), cause
        src = torch.frombuffer(run.src_slots, dtype=torch.int64)  # the run's column, no copy
        dst = torch.frombuffer(run.dst_slots, dtype=torch.int64)
        if keep is not None:
            sel = torch.tensor(keep, dtype=torch.int64)
            src, dst = src[sel], dst[sel]
        try:
            copy_rows(dp, dst, sp, src)
        except (RuntimeError, MemoryError, OSError) as e:  # e.g. out of (device) memory
            return sorted(failed + (keep if keep is not None else list(range(len(run))))), cause or e
        self._stats.count(run, len(src))
        self._stats.kernel_calls += 1
        return failed, cause
