"""The data plane's shared-tier I/O: opening the store, the batched existence query
(``shared_lookup``), and ``store`` / shared ``onboard`` ops as batches through a staging
buffer, each store call under a deadline on a worker thread; objects are named, framed
and authenticated by an :class:`~kvcm.dataplane.store.ObjectCodec`.  See
:mod:`kvcm.dataplane`, "The shared tier".

:class:`SharedIO` is the part of :class:`~kvcm.dataplane.DataPlane` that talks to the
store; its collaborators are given to it: the pools it gathers pages from and scatters
them into, the counters it counts completed ops in.  It knows nothing of the copy runs
that hand it its batches.
"""

from __future__ import annotations

import contextlib
import errno
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvcm.api import CopyOp, KVCacheManagerConfig
from kvcm.config import ResolvedConfig, layout_fingerprint
from kvcm.dataplane.copy_stats import CopyStats
from kvcm.dataplane.disk_pool import DiskPool, torch_module
from kvcm.dataplane.slot_memory import SlotMemory, copy_rows
from kvcm.dataplane.store import HEADER, BadObjectError, ObjectCodec, SharedStore, Staging, store_secret
from kvcm.dataplane.store_factory import open_store

STAGING_MAX_BYTES = 64 << 20  # the largest staging buffer: bigger batches go in several calls


class SharedIO:
    """The shared tier of one data plane (resolved config ``rc``): its store (``store``, else
    the one the tier's path names; ``None`` without a shared tier or once closed), the
    codec of its objects, the deadline of one store call (``timeout_s``: default the
    store's) and the store secret (``secret``: default the config's or the environment's);
    pages gathered from and scattered into ``memory`` (the pools), completed ops counted in ``stats``
    (both None for a client that only asks what exists: :class:`~kvcm.dataplane.StoreClient`).
    The arguments are those of :class:`~kvcm.dataplane.DataPlane` (``store=``,
    ``shared_timeout_s=``, ``shared_secret=``)."""

    def __init__(self, config: KVCacheManagerConfig, rc: ResolvedConfig, memory: SlotMemory | None, stats: CopyStats | None, *,
                 store: SharedStore | None = None, timeout_s: float | None = None,
                 secret: bytes | str | None = None) -> None:
        self._memory = memory
        self._stats = stats
        self.life_cycles = rc.life_cycles
        self.store: SharedStore | None = None
        self.codec: ObjectCodec | None = None
        self.secret_source = ""  # where the store secret came from ("": none); never the secret
        self.timeout_s = 0.0  # the deadline of one store call (0: none)
        self._own_store = False
        self._staging: Staging | None = None
        # calls past their deadline, remembered until they returned and their buffers are freed (_call)
        self.late: list[tuple[threading.Event, Staging | None]] = []
        self.stats = dict.fromkeys(
            ("lookups", "lookup_names", "lookup_hits", "lookup_errors", "stores", "store_bytes", "store_failures",
             "loads", "load_bytes", "load_failures", "removed_bad", "auth_failures", "put_batches", "get_batches",
             "timeouts"), 0)
        self.seconds = {"lookup": 0.0, "store": 0.0, "load": 0.0}  # reporting only (throughput)
        self._open(config, rc, store, timeout_s, secret)

    def _open(self, config: KVCacheManagerConfig, rc: ResolvedConfig, store: SharedStore | None,
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
        key, self.secret_source = store_secret(secret, config.shared_secret_file)
        self.codec = ObjectCodec(layout_fingerprint(rc, config.shared_namespace), key)
        if store is None:
            # set-up within the deadline; lookups only (no pools, a StoreClient): no quota, so a
            # Mooncake client mounts no segment — the store would place other instances'
            # objects in this process's memory, gone when it ends or misses its heartbeats
            quota = tier.quota_bytes if self._memory is not None else 0
            store = open_store(tier.path, quota, timeout_s)
            self._own_store = True
        self.store = store
        self.timeout_s = float(store.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Release the staging buffer and the store (idempotent; a store given as ``store=``
        stays open).  Calls that ran past their deadline get one more deadline to return;
        a store with a call still in flight is left open (closing a client under a running
        call is not safe), and so is that call's buffer."""
        if self._staging is not None:
            if self.store is not None:
                self.store.unregister(self._staging)
            self._staging.close()
            self._staging = None
        if self.late:
            wait_until = time.monotonic() + self.timeout_s
            for done, _ in self.late:
                done.wait(max(0.0, wait_until - time.monotonic()))
            self._reap()
        if self.store is not None and self._own_store and not self.late:
            self.store.close()
        self.store = None

    # ------------------------------------------------------------------ the shared tier

    def lookup(self, candidates: Iterable[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """The ``(key, lc)`` pairs of ``candidates`` (``mgr.shared_candidates``) whose objects
        the store holds: one batched existence query.  A store that cannot answer counts as
        empty (``stats["lookup_errors"]``)."""
        cands = list(candidates)
        if self.store is None or not cands:
            return []
        t0 = time.perf_counter()
        self.stats["lookups"] += 1
        self.stats["lookup_names"] += len(cands)
        try:
            present = self._call("exists", self.store.exists, [self.codec.name(k, lc) for k, lc in cands])
            if not isinstance(present, list) or len(present) != len(cands):  # a store that breaks its contract
                raise OSError(errno.EIO, f"the shared store answered {len(present) if isinstance(present, list) else present!r} "
                                         f"for {len(cands)} names")
        except OSError:
            self.stats["lookup_errors"] += 1
            return []
        finally:
            self.seconds["lookup"] += time.perf_counter() - t0
        hits = [c for c, p in zip(cands, present, strict=True) if p]
        self.stats["lookup_hits"] += len(hits)
        return hits

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, staging: Staging | None = None) -> Any:
        """``fn(*args)`` (a store's exists / put / get) under the deadline
        ``timeout_s``: run on a worker thread, and past the deadline stop waiting and
        raise ``TimeoutError`` (an ``OSError``, ETIMEDOUT), as a store that is down fails.
        The call may still complete later: ``staging`` (the buffer it reads or writes) is
        then abandoned — never used again by this plane, so a late get cannot write into
        anything that is read afterwards (pools are filled from it only after a call that
        returned in time).  The late call is remembered (``late``): its buffer is
        unregistered and freed on this thread once it has returned (:meth:`_reap`), and
        :meth:`close` does not close the store under a call still in flight.  0: no
        deadline, the call runs on this thread."""
        if not self.timeout_s:
            return fn(*args)
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["result"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e
            done.set()

        worker = threading.Thread(target=work, name=f"kvcm-shared-{what}", daemon=True)
        worker.start()
        if not done.wait(self.timeout_s):
            self.stats["timeouts"] += 1
            self.late.append((done, staging))
            if staging is not None and staging is self._staging:
                self._staging = None  # abandoned: freed by _reap once the call returned
            raise TimeoutError(errno.ETIMEDOUT, f"the shared store's {what} did not answer within "
                                                f"{self.timeout_s:g} s")
        # it answered and is ending: gone before its answer is used, so a call that returned
        # leaves no thread behind (an engine's thread count is flat whenever it is idle)
        worker.join()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _reap(self) -> None:
        """Free the buffers of late calls that have returned since (on the caller's thread,
        so that registering and unregistering never race with each other)."""
        still: list[tuple[threading.Event, Staging | None]] = []
        for done, st in self.late:
            if not done.is_set():
                still.append((done, st))
            elif st is not None:
                if self.store is not None:
                    with contextlib.suppress(OSError):
                        self.store.unregister(st)
                st.close()
        self.late = still

    def _staging_for(self, nbytes: int) -> Staging:
        """The registered staging buffer, grown to ``nbytes`` (at most STAGING_MAX_BYTES
        unless one object needs more)."""
        if self.late:
            self._reap()
        st = self._staging
        if st is None or st.nbytes < nbytes:
            if st is not None:
                self.store.unregister(st)
                st.close()
                self._staging = None
            st = Staging(nbytes)
            self.store.register(st)
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

    def store_batch(self, ops: list[CopyOp]) -> tuple[list[CopyOp], BaseException | None]:
        """Write the pages of ``store`` ops as objects, one batched put per chunk: each
        (tier, lc) group gathered into its staging region in one copy, headers written."""
        torch = torch_module()
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
                sp, sb = self._memory.pool(tier, lc), self.life_cycles[lc].slot_bytes
                try:
                    n = len(group)
                    region = flat[base:base + n * (H + sb)].view(n, H + sb)[:, H:]
                    if isinstance(sp, DiskPool):
                        region.copy_(sp.read_rows([op.src_slot for op in group]))
                    else:  # straight into the staging buffer
                        copy_rows(region, range(n), sp, [op.src_slot for op in group])
                except (OSError, RuntimeError, MemoryError) as e:
                    failed += group
                    cause = cause or e
                    continue
                for j, op in enumerate(group):
                    o = base + j * (H + sb)
                    st.view[o:o + H] = self.codec.header(op.key, lc, st.view[o + H:o + H + sb])
                    items.append((self.codec.name(op.key, lc), o, H + sb))
                    ready.append(op)
            del flat
            if not items:
                continue
            results, timed_out = self._results("put", items, st)
            self.stats["put_batches"] += 1
            for op, err in zip(ready, results, strict=True):
                if err is None:
                    self._stats.count(op)
                    self.stats["stores"] += 1
                    self.stats["store_bytes"] += self.life_cycles[op.lc].slot_bytes
                else:
                    failed.append(op)
                    cause = cause or err
        self.stats["store_failures"] += len(failed)
        self.seconds["store"] += time.perf_counter() - t0
        return failed, cause

    def load_batch(self, ops: list[CopyOp]) -> tuple[list[CopyOp], BaseException | None]:
        """Read the objects of shared ``onboard`` ops into their slots, one batched get per
        chunk; every object is verified before its page is written, and each (tier, lc)
        group's verified pages are scattered into the pool with one ``index_copy_``."""
        torch = torch_module()
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
                self.stats["get_batches"] += 1
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
                                self.stats["auth_failures"] += 1
                        continue
                    good.append(j)
                if not good:
                    continue
                n = len(group)
                region = flat[base:base + n * (H + sb)].view(n, H + sb)
                data = region[:, H:] if len(good) == n else region[good, H:]
                dst = [group[j].dst_slot for j in good]
                dp = self._memory.pool(tier, lc)
                try:
                    if isinstance(dp, DiskPool):
                        dp.write_rows(dst, data)
                    else:
                        copy_rows(dp, dst, data, range(len(dst)))
                except (OSError, RuntimeError, MemoryError) as e:
                    failed += [group[j] for j in good]
                    cause = cause or e
                    continue
                self._stats.kernel_calls += 1
                for j in good:
                    self._stats.count(group[j])
                    self.stats["loads"] += 1
                    self.stats["load_bytes"] += sb
            del flat
            if bad_names:  # never found again: a later store may write it whole
                self._remove_bad(bad_names)
        self.stats["load_failures"] += len(failed)
        self.seconds["load"] += time.perf_counter() - t0
        return failed, cause

    def _results(self, what: str, items: list[tuple[str, int, int]],
                 staging: Staging) -> tuple[list[Any], TimeoutError | None]:
        """One put / get under the deadline: a result per item (``None`` / bytes read, or an
        ``OSError``), and the ``TimeoutError`` when the call ran past the deadline (its
        ``staging`` is abandoned then).  A call that raised, timed out or answered with
        another number of results fails every item."""
        try:
            results = self._call(what, getattr(self.store, what), items, staging, staging=staging)
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
            self.store.remove(names)
        except OSError:
            return
        self.stats["removed_bad"] += len(names)
