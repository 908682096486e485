"""The transfer engine: moves bytes between vLLM's paged KV tensors and kvcm's tier 0 (host
memory), and runs the data plane's copy runs (offload to disk, onboard from disk or the
shared store, store to the store), off the forward's critical path.

One worker thread executes jobs that write tier-0 slots (a step's copy runs, then, after the
forward, its saves) in the order they were submitted (FIFO).  FIFO order is what makes the
tier-0 slots safe to reuse: a slot the manager frees and hands to another page is only ever
written by a job queued after every job that read it.  Three things leave the FIFO:

* **asynchronous loads** (tier 0 -> vLLM's blocks; they write no tier-0 slot) wait in a queue
  of their own and overtake the FIFO: the thread runs the oldest load as soon as the jobs
  that write the tier-0 slots it reads are done (its *write ticket*, below), before queued
  saves and unrelated copy runs — a request waiting for its KV never waits behind another
  request's saves (DECISIONS.md "Loads overtake saves").  A load writes only blocks vLLM
  just allocated to its request, which no queued save reads (vLLM keeps a request's blocks
  while its saves are in flight);

* **synchronous loads** (the step's forward reads their blocks) run on the caller's thread
  as soon as the jobs that write the tier-0 slots they read are done (a per-slot *write
  ticket*: the sequence number of the last queued job writing the slot), not after
  unrelated queued work;
* nothing else: saves are never waited for, except by :meth:`TransferEngine.wait_saves`
  (vLLM preempted their request: its blocks are about to be reused).

**A job's outcome is published with its completion**: the thread collects what a job did
(drain results, load and save outcomes, poisoned and healed slots, counters) in a private
outcome and publishes it, marks the job done and releases its bytes in flight under one lock
(``TransferEngine._finish``).  Whoever observes the job done (a synchronous load waiting on
its write ticket, :meth:`TransferEngine.wait_saves`, :meth:`TransferEngine.take`) also sees
its results, and never a result of a job not yet done.

**Slot poisoning**: a tier-0 or disk slot whose last write failed (a failed copy op, an op
of a drain that stopped before it, a failed save) is *poisoned* until a later write to it
succeeds.  Any op or load that reads a poisoned slot fails too (a store op never publishes
the bytes of a poisoned slot: it fails, and nothing is written), and so the failure
propagates to everything that depended on the lost bytes.

Copies between vLLM's tensors and host rows are made by a *copier*: :class:`CpuCopier`
(vLLM's CPU backend: index_select / index_copy_ on the worker thread; torch releases the
GIL, so the forward runs meanwhile) or :class:`CudaCopier` (pinned host staging, a side
stream that waits on an event recorded on the compute stream — after the forward for a save,
when it was queued for an asynchronous load —, CUDA events for completion, one gather or
scatter per layer part per job; the compute stream is never synchronized by the host — a
synchronous load makes it *wait on an event*).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcm.api import GPU, SHARED, CopyOp, CopyRun
from kvcm.engine_loop import PlaneLoop
from kvcm.integrations.vllm.metadata import LoadPlan, SavePlan

logger = logging.getLogger(__name__)

SYNC_WAIT_S = 60.0  # a synchronous load gives up (its blocks fail: vLLM recomputes) past this
STOP_WAIT_S = 30.0  # close(): how long the running job may take to end


# ---------------------------------------------------------------------------------------
# How a kvcm page maps onto vLLM's per-layer tensors


@dataclass(frozen=True)
class Part:
    """One piece of a page: ``tensor[b]`` (block ``b`` of one layer, or of its K or V half)
    is ``nbytes`` bytes at ``offset`` in the page of block ``b``."""

    tensor: torch.Tensor  # block dimension first
    offset: int
    nbytes: int
    group: int = 0  # which of a plan's block ids is this part's (a block given as a tuple: one per vLLM group)


def _ids(blocks: Sequence[Any]) -> torch.Tensor:
    """Block ids as a tensor: ``[n]`` (ints) or ``[n, groups]`` (tuples, one id per vLLM group)."""
    return torch.tensor(list(blocks), dtype=torch.long)


def _col(bidx: torch.Tensor, p: Part) -> torch.Tensor:
    return bidx if bidx.dim() == 1 else bidx[:, p.group].contiguous()


def page_parts(kv_caches: Sequence[torch.Tensor], block_bytes: Sequence[int], num_blocks: int,
               names: Sequence[str], groups: Sequence[int] = ()) -> list[Part]:
    """The parts of a page, layer by layer in the order given.  A layer's tensor holds the
    block in dimension 0 (vLLM's CPU backend: ``[num_blocks, ...]``), or K and V first and
    the block in dimension 1 (``[2, num_blocks, ...]``, e.g. FlashAttention): then the page
    holds the block's K bytes, then its V bytes.  The bytes of a block of each layer must be
    what vLLM's KV cache spec says (``block_bytes``)."""
    parts: list[Part] = []
    off = 0
    groups = list(groups) or [0] * len(names)
    for name, t, nbytes, group in zip(names, kv_caches, block_bytes, groups, strict=True):
        if t.dim() >= 1 and t.shape[0] == num_blocks:
            views = [t]
        elif t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            views = [t[0], t[1]]
        else:
            raise ValueError(f"KvcmConnector: layer {name}: KV cache tensor of shape {tuple(t.shape)} has no "
                             f"dimension of {num_blocks} blocks first (or after a K/V dimension of 2)")
        got = sum(v[0].numel() * v.element_size() for v in views)
        if got != nbytes:
            raise ValueError(f"KvcmConnector: layer {name}: a block is {got} bytes, the KV cache spec says {nbytes}")
        for v in views:
            if not v[0].is_contiguous():
                raise ValueError(f"KvcmConnector: layer {name}: a block's bytes are not contiguous "
                                 f"(shape {tuple(t.shape)}, strides {t.stride()})")
            n = v[0].numel() * v.element_size()
            parts.append(Part(v, off, n, group))
            off += n
    return parts


def _block_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (block dimension first, each block contiguous) as ``uint8[blocks, block bytes]``
    rows: a view when the blocks' strides allow one, else a list-like of per-block views."""
    try:
        return t.view(t.shape[0], -1).view(torch.uint8)
    except RuntimeError:  # blocks not evenly strided: one view per block
        return _Rows(t)


class _Rows:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __getitem__(self, b: int) -> torch.Tensor:
        return self.t[b].reshape(-1).view(torch.uint8)


class CpuCopier:
    """vLLM's KV tensors in host memory: row copies on the calling thread (one ``copy_`` per
    block and part: memcpy speed, where torch's CPU gathers of long byte rows are 10-20x
    slower; DECISIONS.md "Loads at memory speed")."""

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = list(parts)
        self.rows = [_block_rows(p.tensor) for p in self.parts]

    def forward_marker(self) -> Any:
        """What a job waits on before it touches vLLM's blocks: a save, the step's forward;
        an asynchronous load, what vLLM queued before it (e.g. zeroing the blocks it
        allocated).  CPU: nothing — the caller's work is done when it queues the job."""
        return None

    def save(self, blocks: Sequence[int], slots: Sequence[int], pool: torch.Tensor, after: Any) -> None:
        """vLLM blocks -> tier-0 rows."""
        for p, rows in zip(self.parts, self.rows, strict=True):
            col = pool[:, p.offset:p.offset + p.nbytes]
            for b, s in zip(blocks, slots, strict=True):
                col[s].copy_(rows[b[p.group] if isinstance(b, tuple) else b])

    def load(self, slots: Sequence[int], blocks: Sequence[int], pool: torch.Tensor, sync: bool,
             after: Any = None) -> None:
        """tier-0 rows -> vLLM blocks (CPU: done on return; ``sync`` and ``after`` do not
        matter)."""
        for p, rows in zip(self.parts, self.rows, strict=True):
            col = pool[:, p.offset:p.offset + p.nbytes]
            for s, b in zip(slots, blocks, strict=True):
                rows[b[p.group] if isinstance(b, tuple) else b].copy_(col[s])

    def close(self) -> None:
        return


class CudaCopier:
    """vLLM's KV tensors on a CUDA device (DECISIONS.md "vLLM connector", "How bytes move"):

    * a save: the side stream waits on the event recorded on the compute stream after the
      forward (:meth:`forward_marker`), gathers the blocks per part into a device buffer and
      copies it to pinned host staging (non-blocking); the worker thread waits on the copy's
      event (the compute stream never does) and copies the staging rows into tier 0;
    * a load: the tier-0 rows are gathered into pinned staging on the host, copied to the
      device and scattered per part on the side stream, after an event recorded on the
      compute stream when the load was queued (whatever vLLM queued before, e.g. zeroing
      the blocks it allocated, comes first): for an asynchronous load, by ``start_load_kv``
      on vLLM's thread (:meth:`forward_marker`, passed as ``after``: the transfer thread's
      current stream is not vLLM's); for a synchronous one, on the calling thread, which is
      vLLM's.  An asynchronous load's worker thread waits on its event before the request
      is reported loaded; a synchronous one makes the compute stream wait on the event (no
      host sync) and keeps its buffers until the event has completed.
    """

    def __init__(self, parts: Sequence[Part], device: torch.device, *, cuda: Any = None, pin: bool = True) -> None:
        """``cuda``: where streams and events come from (``Stream``, ``Event``, ``stream``,
        ``current_stream``), ``torch.cuda`` when None; ``pin``: host staging in pinned memory.
        A test passes a stand-in and ``pin=False`` to run this class's logic on CPU tensors
        (tests/engines/test_vllm_transfer_gpu.py, in every CI leg)."""
        self.parts = list(parts)
        self.device = device
        self.cuda = torch.cuda if cuda is None else cuda
        self.pin = pin
        self.stream = self.cuda.Stream(device=device)
        self._held: deque[tuple[Any, list[torch.Tensor]]] = deque()  # sync loads' buffers until their event
        self._lock = threading.Lock()

    def _marker(self) -> Any:
        ev = self.cuda.Event()
        ev.record(self.cuda.current_stream(self.device))
        return ev

    def forward_marker(self) -> Any:
        return self._marker()

    def _index(self, ids: Sequence[Any]) -> torch.Tensor:
        ids_t = _ids(ids)
        return (ids_t.pin_memory() if self.pin else ids_t).to(self.device, non_blocking=True)

    def save(self, blocks: Sequence[int], slots: Sequence[int], pool: torch.Tensor, after: Any) -> None:
        n, page = len(blocks), pool.shape[1]
        host = torch.empty((n, page), dtype=torch.uint8, pin_memory=self.pin)
        done = self.cuda.Event()
        with self.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            bidx = self._index(blocks)
            dev = torch.empty((n, page), dtype=torch.uint8, device=self.device)
            for p in self.parts:
                dev[:, p.offset:p.offset + p.nbytes] = p.tensor.index_select(0, _col(bidx, p)).reshape(n, -1).view(torch.uint8)
            host.copy_(dev, non_blocking=True)
            done.record(self.stream)
        done.synchronize()  # this (transfer) thread waits; the compute stream does not
        pool.index_copy_(0, torch.tensor(slots, dtype=torch.long), host)

    def load(self, slots: Sequence[int], blocks: Sequence[int], pool: torch.Tensor, sync: bool,
             after: Any = None) -> None:
        """``after``: an event recorded on the compute stream when the load was queued (an
        asynchronous load runs on the transfer thread, whose current stream is not vLLM's);
        None: recorded now, on this thread's current stream (a synchronous load: vLLM's)."""
        n = len(blocks)
        start = after if after is not None else self._marker()
        host = torch.empty((n, pool.shape[1]), dtype=torch.uint8, pin_memory=self.pin)
        torch.index_select(pool, 0, torch.tensor(slots, dtype=torch.long), out=host)
        done = self.cuda.Event()
        with self.cuda.stream(self.stream):
            self.stream.wait_event(start)
            bidx = self._index(blocks)
            dev = host.to(self.device, non_blocking=True)
            for p in self.parts:
                rows = dev[:, p.offset:p.offset + p.nbytes]
                p.tensor.index_copy_(0, _col(bidx, p), rows.view(p.tensor.dtype).view(n, *p.tensor.shape[1:]))
            done.record(self.stream)
        if sync:
            self.cuda.current_stream(self.device).wait_event(done)  # the forward reads them: a GPU-side wait
            with self._lock:
                self._held.append((done, [host, dev, bidx]))
                while self._held and self._held[0][0].query():
                    self._held.popleft()
        else:
            done.synchronize()

    def close(self) -> None:
        with self._lock:
            for ev, _ in self._held:
                ev.synchronize()
            self._held.clear()


# ---------------------------------------------------------------------------------------
# Where the thread runs (vLLM's CPU build)


def forward_cpus(environ: Any = os.environ) -> set[int]:
    """The cores vLLM's CPU worker bound its forward's OpenMP threads to (``OMP_PLACES``
    ``{0,1}`` / ``{0:2}``, ``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY`` proclist), empty when it
    bound none."""
    text = environ.get("OMP_PLACES", "")
    if text:
        out: set[int] = set()
        for place in re.findall(r"\{([^}]*)\}", text):
            for part in place.split(","):
                part = part.strip()
                if ":" in part:  # start:count[:stride]
                    start, count, *stride = (int(x) for x in part.split(":"))
                    out.update(range(start, start + count * (stride[0] if stride else 1), stride[0] if stride else 1))
                elif part:
                    out.add(int(part))
        return out
    text = environ.get("GOMP_CPU_AFFINITY", "") or \
        (re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", "")) or [None, ""])[1]
    out = set()
    for part in re.split(r"[ ,]+", text.strip()):
        if "-" in part:
            a, b = part.split("-")[:2]
            out.update(range(int(a), int(b) + 1))
        elif part.isdigit():
            out.add(int(part))
    return out


def pin_to_spare_cpus() -> set[int] | None:
    """Move the calling thread off the forward's cores (DECISIONS.md "The transfer thread's
    core"): vLLM's CPU worker binds its OpenMP threads, and a thread it starts inherits the
    forward's core, so copies would take turns with the forward.  The thread goes to the
    machine's other cores (those vLLM reserved for its scheduler and the like), when there
    are any; ``KVCM_TRANSFER_AFFINITY=off`` leaves it where it is.  Returns the cores it was
    moved to, None when it was not moved."""
    if os.environ.get("KVCM_TRANSFER_AFFINITY", "auto") == "off" or not hasattr(os, "sched_setaffinity"):
        return None
    forward = forward_cpus()
    if not forward:
        return None
    try:
        allowed = os.sched_getaffinity(1) if os.path.exists("/proc/1") else set(range(os.cpu_count() or 1))
    except OSError:
        allowed = set(range(os.cpu_count() or 1))
    spare = allowed - forward
    if not spare:
        return None
    try:
        os.sched_setaffinity(0, spare)  # pid 0: this thread only
    except OSError as e:
        logger.info("kvcm transfer thread: could not move to cores %s (%s)", sorted(spare), e)
        return None
    return spare


# ---------------------------------------------------------------------------------------
# The engine


@dataclass
class _Job:
    seq: int
    kind: str  # "runs" | "loads" | "saves"
    nbytes: int
    drain_seq: int = 0
    runs: list[CopyRun] = field(default_factory=list)
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    marker: Any = None
    need: int = 0  # loads: the last job of the FIFO that writes a slot they read (runs first)


@dataclass
class Completed:
    """What finished since the last :meth:`TransferEngine.take` (in completion order)."""

    drains: list[tuple[int, list[CopyOp]]] = field(default_factory=list)
    saves: dict[int, bool] = field(default_factory=dict)
    loads: dict[int, list[int]] = field(default_factory=dict)  # load_id -> failed positions
    failed_blocks: dict[int, list[int]] = field(default_factory=dict)  # load_id -> failed vLLM blocks
    load_reqs: dict[int, str] = field(default_factory=dict)  # load_id -> request (async loads)
    counters: Counter = field(default_factory=Counter)
    saves_done: set[str] = field(default_factory=set)  # asked-about requests with no save left queued


@dataclass
class _Outcome:
    """What one job did, collected by the thread while it runs and published with its
    completion by ``TransferEngine._finish`` (module doc)."""

    done: Completed = field(default_factory=Completed)  # merged into what take() returns
    ended: list[tuple[SavePlan, bool]] = field(default_factory=list)  # the job's saves and whether each succeeded
    poisoned: set[tuple[int, int, int]] = field(default_factory=set)  # slots whose write failed
    healed: set[tuple[int, int, int]] = field(default_factory=set)  # slots written successfully


class TransferEngine:
    """One worker thread executing a FIFO of jobs against one data plane (module doc).
    ``loop``: the engine loop's half that applies copy runs (``PlaneLoop(plane)``);
    its plane holds kvcm's tier 0.  ``copier``: one copier, or one per kvcm life cycle (a
    hybrid model: each life cycle's pages are the blocks of its own vLLM groups); loads and
    saves name their life cycle."""

    def __init__(self, loop: PlaneLoop, copier: Any, page_bytes: int,
                 fault_hook: Callable[[CopyOp], None] | None = None, name: str = "kvcm-transfer") -> None:
        self.loop = loop
        plane = self.plane = loop.plane
        self.copiers = list(copier) if isinstance(copier, (list, tuple)) else [copier]
        self.copier = self.copiers[0]
        self.page_bytes = page_bytes
        self.pools = [plane.pool(GPU, lc) for lc in range(len(self.copiers))]
        self.pool = self.pools[0]
        self.slot_bytes = [lc.slot_bytes for lc in plane.life_cycles]
        self.fault_hook = fault_hook
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()  # runs and saves (FIFO)
        self._loads: deque[_Job] = deque()  # asynchronous loads (FIFO among themselves; they overtake _queue)
        self._load_ids: set[int] = set()  # load ids queued or running
        self._seq = 0  # the last job submitted
        self._done = 0  # every job of _queue <= _done has completed (FIFO; loads are not counted)
        self._ticket: dict[tuple[int, int], int] = {}  # tier-0 (lc, slot) -> the last queued job writing it
        self._poison: set[tuple[int, int, int]] = set()  # (tier, lc, slot) whose last write failed
        self._pending_saves: Counter[str] = Counter()  # request -> save plans queued, not done
        self._save_req: dict[int, str] = {}  # queued save_id -> request
        self._started: set[int] = set()  # save ids the thread has begun
        self._cancelled: set[int] = set()  # save ids cancelled before they began
        self._inflight_bytes = 0
        self._out = Completed()
        self._stop = False
        self.cpus: set[int] | None = None  # the cores the thread was moved to (CPU builds), None: not moved
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submitting

    def _submit(self, job: _Job, writes: Sequence[tuple[int, int]] = ()) -> None:
        with self._cv:
            if self._stop:
                raise RuntimeError("kvcm transfer engine is closed")
            self._seq += 1
            job.seq = self._seq
            for s in writes:
                self._ticket[s] = job.seq
            for sp in job.saves:
                self._pending_saves[sp.req_id] += 1
                self._save_req[sp.save_id] = sp.req_id
            self._inflight_bytes += job.nbytes
            if job.kind == "loads":
                # the jobs writing the tier-0 slots it reads come first (its write ticket)
                job.need = max((self._ticket.get((x.lc, s), 0) for x in job.loads for s in x.slots if s >= 0),
                               default=0)
                self._load_ids.update(x.load_id for x in job.loads)
                self._loads.append(job)
            else:
                self._queue.append(job)
            self._cv.notify_all()

    def submit_runs(self, drain_seq: int, runs: list[CopyRun]) -> None:
        """The data plane's copy runs of one drain (executed as one ``apply_runs``)."""
        nops = sum(len(r) for r in runs)
        if not nops:
            return
        writes = [(r.lc, s) for r in runs if r.dst_tier == GPU for s in r.dst_slots]
        nbytes = sum(len(r) * self.slot_bytes[r.lc] for r in runs)
        self._submit(_Job(0, "runs", nbytes, drain_seq=drain_seq, runs=runs), writes)

    def submit_loads(self, loads: list[LoadPlan], marker: Any = None) -> None:
        """Asynchronous loads (reported by :meth:`take` once done), after ``marker``
        (:meth:`CpuCopier.forward_marker` when they were queued)."""
        if loads:
            self._submit(_Job(0, "loads", sum(len(x.blocks) * self.slot_bytes[x.lc] for x in loads), loads=loads,
                              marker=marker))

    def submit_saves(self, saves: list[SavePlan], marker: Any) -> None:
        """Saves, after the step's forward (``marker``: :meth:`CpuCopier.forward_marker`)."""
        if saves:
            writes = [(sp.lc, s) for sp in saves for s in sp.slots]
            self._submit(_Job(0, "saves", sum(len(x.blocks) * self.slot_bytes[x.lc] for x in saves), saves=saves,
                              marker=marker), writes)

    def sync_loads(self, loads: list[LoadPlan]) -> dict[int, list[int]]:
        """Execute synchronous loads now, on this thread, once the queued jobs that write
        their slots are done; returns ``load_id -> failed positions`` (a slot of -1, a
        poisoned slot, or a copy that raised: vLLM recomputes those blocks)."""
        out: dict[int, list[int]] = {}
        if not loads:
            return out
        t0 = time.perf_counter()
        with self._cv:
            need = max((self._ticket.get((x.lc, s), 0) for x in loads for s in x.slots if s >= 0), default=0)
            deadline = time.monotonic() + SYNC_WAIT_S
            while self._done < need and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            ready = self._done >= need
            poison = set(self._poison)
        waited = time.perf_counter() - t0
        counters: Counter[str] = Counter()
        for x in loads:
            bad = [i for i, s in enumerate(x.slots) if s < 0 or not ready or (GPU, x.lc, s) in poison]
            out[x.load_id] = self._copy_in(x, bad, True, counters)
        counters["sync_wait_us"] += int(1e6 * waited)
        counters["sync_load_us"] += int(1e6 * (time.perf_counter() - t0 - waited))
        with self._cv:
            self._out.counters.update(counters)
        return out

    # ------------------------------------------------------------------ observing

    def take(self, asked: set[str] = frozenset()) -> Completed:  # type: ignore[assignment]
        """What completed since the last call; ``saves_done``: the requests of ``asked``
        with no save queued any more (one consistent snapshot)."""
        with self._cv:
            out, self._out = self._out, Completed()
            out.saves_done = {r for r in asked if self._pending_saves.get(r, 0) == 0}
            return out

    def wait_any(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a job to complete while any is queued (an engine step
        without a forward: poll less)."""
        with self._cv:
            if self._queue or self._loads:
                self._cv.wait(timeout)

    def wait_loads(self, load_ids: Sequence[int], timeout: float) -> bool:
        """Wait up to ``timeout`` until the asynchronous loads ``load_ids`` are done (a step
        without a forward reports them in the same step); True when they are."""
        want = set(load_ids)
        with self._cv:
            return self._wait_until(lambda: not want & self._load_ids, timeout)

    def _wait_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Under ``self._cv``: wait until ``done()`` (re-checked at each completion), the
        engine closes, or ``timeout`` passes; returns ``done()``."""
        deadline = time.monotonic() + timeout
        while not done() and not self._stop:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)
        return done()

    def pending_saves(self, req_id: str) -> int:
        with self._cv:
            return self._pending_saves.get(req_id, 0)

    def flush_saves(self, save_ids: Sequence[int], timeout: float) -> bool:
        """Wait up to ``timeout`` until the saves ``save_ids`` are done (nothing is
        cancelled: past the deadline they go on and are reported later); True when they are."""
        want = set(save_ids)
        with self._cv:
            return self._wait_until(lambda: not want & self._save_req.keys(), timeout)

    def wait_saves(self, req_ids: Sequence[str], timeout: float) -> int:
        """Wait until the saves queued for ``req_ids`` are done (vLLM reuses their blocks
        next).  Past ``timeout``, the saves not yet begun are cancelled (they fail: kvcm
        does not commit them) and only the one running is waited for.  Returns how many
        save plans were cancelled."""
        want = set(req_ids)
        with self._cv:
            self._wait_until(lambda: not any(self._pending_saves.get(r, 0) for r in want), timeout)
            cancel = {sid for sid, r in self._save_req.items() if r in want and sid not in self._started}
            self._cancelled |= cancel
            # the one begun is a memory copy: waited for (vLLM must not overwrite what it reads)
            while any(sid in self._started for sid, r in self._save_req.items() if r in want) \
                    and self._thread.is_alive():
                self._cv.wait(1.0)
            return len(cancel)

    def gauges(self) -> dict[str, int]:
        with self._cv:
            return {"bytes_in_flight": self._inflight_bytes, "jobs_queued": len(self._queue) + len(self._loads),
                    "saves_queued": sum(self._pending_saves.values()), "poisoned_slots": len(self._poison)}

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        if all(isinstance(c, CpuCopier) for c in self.copiers):
            self.cpus = pin_to_spare_cpus()
        while True:
            with self._cv:
                while not self._queue and not self._loads and not self._stop:
                    self._cv.wait()
                if not self._queue and not self._loads:
                    return
                # a load whose slots' writers are done goes first (module doc)
                first_load = self._loads and (self._loads[0].need <= self._done or not self._queue)
                job = self._loads[0] if first_load else self._queue[0]
                cancelled = self._stop  # close(): what has not begun fails
                if not cancelled:
                    self._started.update(sp.save_id for sp in job.saves)
            if cancelled:
                out = self._failed(job)
            else:
                try:
                    out = self._execute(job)
                except BaseException:  # a bug must not leave the queue hung: the job fails
                    logger.exception("kvcm transfer engine: job %s failed", job.kind)
                    out = self._failed(job)
                    out.done.counters["engine_errors"] += 1
            self._finish(job, out)

    def _finish(self, job: _Job, out: _Outcome) -> None:
        """Publish a job's outcome and mark it done, in one step: whoever sees its results
        also sees it done (its bytes no longer in flight, its slots' writes complete), and
        whoever sees it done sees its results (the slots it poisoned or healed)."""
        with self._cv:
            self._poison -= out.healed
            self._poison |= out.poisoned
            for sp, ok in out.ended:
                if sp.save_id in self._save_req:  # (each save ends once)
                    self._end_save(sp, ok)
            o, d = self._out, out.done
            o.drains += d.drains
            o.loads.update(d.loads)
            o.failed_blocks.update(d.failed_blocks)
            o.load_reqs.update(d.load_reqs)
            o.counters.update(d.counters)
            if job.kind == "loads":
                self._loads.popleft()
                self._load_ids.difference_update(x.load_id for x in job.loads)
            else:
                self._queue.popleft()
                self._done = job.seq
            self._inflight_bytes -= job.nbytes
            self._cv.notify_all()

    def _execute(self, job: _Job) -> _Outcome:
        """Run one job on this thread; its outcome is published by :meth:`_finish`."""
        t0 = time.perf_counter()
        out = _Outcome()
        if job.kind == "runs":
            self._exec_runs(job, out)
        elif job.kind == "loads":
            d = out.done
            for x in job.loads:
                with self._cv:  # (only this thread writes the poison set; the lock orders the read)
                    bad = [i for i, s in enumerate(x.slots) if s < 0 or (GPU, x.lc, s) in self._poison]
                failed = self._copy_in(x, bad, False, d.counters, after=job.marker)
                d.loads[x.load_id] = failed
                d.failed_blocks[x.load_id] = [x.blocks[i] for i in failed]
                d.load_reqs[x.load_id] = x.req_id
        else:
            self._exec_saves(job, out)
        out.done.counters[f"{job.kind}_us"] += int(1e6 * (time.perf_counter() - t0))
        return out

    def _fault(self, op: CopyOp) -> None:
        """The data plane's per-op hook: an op reading a poisoned slot fails (and the test
        hook, when configured, may fail any op)."""
        if self.fault_hook is not None:
            self.fault_hook(op)
        if (op.src_tier, op.lc, op.src_slot) in self._poison:
            raise OSError(errno.EIO, f"kvcm: tier {op.src_tier} slot {op.src_slot}: its last write failed")

    def _exec_runs(self, job: _Job, out: _Outcome) -> None:
        plane = self.plane
        before = dict(plane.shared_stats)
        cs = plane.copy_stats
        disk_bytes, disk_s = cs.route_bytes.get("disk->gpu", 0), cs.route_seconds.get("disk->gpu", 0.0)
        with self._cv:
            poisoned = bool(self._poison)
        plane.fault = self._fault if poisoned or self.fault_hook is not None else None
        failed: list[CopyOp] = []
        try:
            failed = self.loop.apply(job.runs)  # the ops of a CopyError, [] when all completed
            if failed:
                logger.warning("kvcm: %d copy ops of drain %d did not complete (%s); their pages are dropped and "
                               "vLLM recomputes what needed them", len(failed), job.drain_seq,
                               getattr(self.loop.last_error, "cause", None))
        except ValueError:  # a run the plane refused (a bug): none of it ran
            logger.exception("kvcm: drain %d refused by the data plane", job.drain_seq)
            failed = [op for r in job.runs for op in r.ops()]
        finally:
            plane.fault = None
        out.poisoned = {(op.dst_tier, op.lc, op.dst_slot) for op in failed if op.dst_tier != SHARED}
        if poisoned:  # the slots written successfully are readable again
            out.healed = {(r.dst_tier, r.lc, d) for r in job.runs if r.dst_tier != SHARED
                          for d in r.dst_slots} - out.poisoned
        d = out.done
        d.drains.append((job.drain_seq, failed))
        c = d.counters
        c["run_ops"] += sum(len(r) for r in job.runs)
        c["failed_ops"] += len(failed)
        c["run_bytes"] += job.nbytes
        for k in ("load_failures", "timeouts", "lookup_errors", "removed_bad", "stores", "loads"):
            c["shared_" + k] += plane.shared_stats[k] - before[k]
        # disk -> kvcm's tier 0 (host memory): the bench's disk read speed
        c["disk_read_bytes"] += cs.route_bytes.get("disk->gpu", 0) - disk_bytes
        c["disk_read_us"] += int(1e6 * (cs.route_seconds.get("disk->gpu", 0.0) - disk_s))

    def _copy_in(self, x: LoadPlan, bad: list[int], sync: bool, counters: Counter, after: Any = None) -> list[int]:
        """Copy the blocks of ``x`` not in ``bad`` into vLLM's cache (after ``after``:
        :meth:`CpuCopier.forward_marker` when the load was queued); counts into
        ``counters``; returns the failed positions."""
        skip = set(bad)
        ok = [i for i in range(len(x.slots)) if i not in skip]
        failed = list(bad)
        if ok:
            try:
                self.copiers[x.lc].load([x.slots[i] for i in ok], [x.blocks[i] for i in ok], self.pools[x.lc], sync,
                                        after)
            except Exception:  # e.g. out of memory: the blocks are recomputed
                logger.exception("kvcm: load of %d blocks for %s failed", len(ok), x.req_id)
                failed = list(range(len(x.slots)))
        counters["loaded_bytes"] += (len(x.slots) - len(failed)) * self.slot_bytes[x.lc]
        counters["load_failed_blocks"] += len(failed)
        return sorted(failed)

    def _exec_saves(self, job: _Job, out: _Outcome) -> None:
        with self._cv:
            todo = [sp for sp in job.saves if sp.save_id not in self._cancelled]
            skipped = [sp for sp in job.saves if sp.save_id in self._cancelled]
        ok = True
        for lc in sorted({sp.lc for sp in todo}):  # one gather per life cycle (its own vLLM groups)
            mine = [sp for sp in todo if sp.lc == lc]
            try:
                self.copiers[lc].save([b for sp in mine for b in sp.blocks], [s for sp in mine for s in sp.slots],
                                      self.pools[lc], job.marker)
            except Exception:  # the blocks are not committed; vLLM is not affected
                logger.exception("kvcm: saving %d blocks failed", sum(len(sp.blocks) for sp in todo))
                ok = False
                break
        self._end_saves(out, [(sp, ok) for sp in todo] + [(sp, False) for sp in skipped])
        out.done.counters["saved_bytes"] += sum(len(sp.blocks) * self.slot_bytes[sp.lc] for sp in todo) if ok else 0
        out.done.counters["saves_cancelled"] += len(skipped)

    @staticmethod
    def _end_saves(out: _Outcome, ended: list[tuple[SavePlan, bool]]) -> None:
        """Record the end of save plans in ``out``: a written slot is healed, one whose save
        failed or was skipped is poisoned (its old bytes may be half overwritten)."""
        out.ended += ended
        for sp, ok in ended:
            (out.healed if ok else out.poisoned).update((GPU, sp.lc, s) for s in sp.slots)
        out.healed -= out.poisoned

    def _end_save(self, sp: SavePlan, ok: bool) -> None:  # under self._cv, by _finish
        self._out.saves[sp.save_id] = ok
        self._pending_saves[sp.req_id] -= 1
        if not self._pending_saves[sp.req_id]:
            del self._pending_saves[sp.req_id]
        self._save_req.pop(sp.save_id, None)
        self._started.discard(sp.save_id)
        self._cancelled.discard(sp.save_id)

    def _failed(self, job: _Job) -> _Outcome:
        """The outcome of a job that raised (a bug) or was cancelled at close: every part of
        it failed (what it should have written is poisoned)."""
        out = _Outcome()
        d = out.done
        if job.kind == "runs":
            ops = [op for r in job.runs for op in r.ops()]
            out.poisoned = {(op.dst_tier, op.lc, op.dst_slot) for op in ops if op.dst_tier != SHARED}
            d.drains.append((job.drain_seq, ops))
        elif job.kind == "loads":
            for x in job.loads:
                d.loads[x.load_id] = list(range(len(x.slots)))
                d.failed_blocks[x.load_id] = list(x.blocks)
                d.load_reqs[x.load_id] = x.req_id
        else:
            self._end_saves(out, [(sp, False) for sp in job.saves])
        return out

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop: the job running ends (its store calls have deadlines), the queued ones fail
        (reported by a last :meth:`take`), the thread is joined."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(STOP_WAIT_S)
        if self._thread.is_alive():
            logger.warning("kvcm transfer engine: a job still runs after %.0f s; the thread is left to end", STOP_WAIT_S)
        self.copier.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
